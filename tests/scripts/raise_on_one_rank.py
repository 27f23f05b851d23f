"""Rank 1 fails right after ``hvd.init()`` while the other ranks wait in a collective it will
never join. With hvd_slim's abort hooks the whole job must end, non-zero, naming rank 1, under
mpirun (tests/distributed/test_tier_mpi.py) and under torchrun (tests/torchrun/test_tier_torchrun.py).

Usage: ``mpirun -np N python tests/scripts/raise_on_one_rank.py [main|thread|gloo]`` (or
``torchrun --nproc-per-node N tests/scripts/raise_on_one_rank.py ...``): ``main``
raises in the main thread, ``thread`` in a worker thread, ``gloo`` in the main thread after a
Gloo transport started torch.distributed (whose excepthook then wraps hvd_slim's).
"""
import sys
import threading
import time

import torch

import hvd_slim as hvd

MESSAGE = "deliberate failure on rank 1"


def fail() -> None:
    raise RuntimeError(MESSAGE)


def main(mode: str) -> None:
    hvd.init()
    if mode == "gloo":
        from hvd_slim.optim.rendezvous import torch_transport
        torch_transport("gloo", torch.device("cpu"))
    if hvd.rank() == 1:
        if mode == "thread":
            worker = threading.Thread(target=fail, name="worker")
            worker.start()
            worker.join()
            time.sleep(600)  # the abort must end this process, not the end of the script
        else:
            fail()
    hvd.allreduce(torch.ones(1), name="never_completes")  # rank 1 never joins this
    print(f"rank {hvd.rank()}: unreachable: the collective completed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "main")
