"""The last rank skips one tensor-API collective and stays alive (it sleeps); the others must
get a TransportTimeout after HVD_SLIM_TIMEOUT seconds naming the call, the skipping rank and
how to raise the timeout, and the job must then end (the uncaught error aborts every rank).

Usage: ``HVD_SLIM_TIMEOUT=3 mpirun -np N python tests/scripts/skip_collective.py OP [catch]``
with OP one of ``allreduce``, ``broadcast_object``, ``barrier``. Every rank that times out
prints ``skip_collective: rank R caught: <message>``, then re-raises; with ``catch`` it returns
normally instead, and the job must still end (at exit, since MPI cannot finalise then).
Launched by tests/distributed/test_tier_mpi.py, and under torchrun by
tests/torchrun/test_tier_torchrun.py.
"""
import sys
import time

import torch

import hvd_slim as hvd

CALLS = {
    "allreduce": lambda: hvd.allreduce(torch.ones(3), name="skipped"),
    "broadcast_object": lambda: hvd.broadcast_object({"step": 1}, root_rank=0, name="skipped"),
    "barrier": lambda: hvd.barrier(),
}


def main(op: str, catch: bool) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert hvd.allreduce(torch.ones(1), name="warm-up", op=hvd.Sum).item() == size
    if rank == size - 1:
        print(f"skip_collective: rank {rank} skips {op}", flush=True)
        time.sleep(300)   # alive but absent: only the others' timeout (and abort) ends the job
        return
    try:
        CALLS[op]()
    except hvd.TransportTimeout as exc:
        print(f"skip_collective: rank {rank} caught: {exc}", flush=True)
        time.sleep(2)   # let every timed-out rank print before the first abort ends the job
        if catch:
            return
        raise
    print(f"skip_collective: rank {rank}: unreachable: {op} completed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["catch"])
