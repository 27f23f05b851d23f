"""A small Slim-DP training loop in which one rank fails at a given step, for the launcher tests
of issue 6 (tests/unit/test_reliability_launch.py). Every other rank must then exit non-zero
within 60 s, and the job's output must name the failed rank.

Usage: ``mpirun -np N python tests/scripts/fail_mid_training.py MODE [RANK] [STEP]``

MODE: ``raise`` (an exception in the user's loop), ``sigkill`` (the process is killed),
``hang`` (the rank stops taking part but stays alive, like a stuck data loader: only the
exchange timeout, HVD_SLIM_TIMEOUT, can end the job) or ``none`` (no failure).
"""
import os
import signal
import sys
import time

import torch

import hvd_slim as hvd


def main(mode: str, bad_rank: int, bad_step: int) -> None:
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), density=0.05,
                                   min_compress_numel=1000)
    for step in range(20):
        if rank == bad_rank and step == bad_step:
            print(f"rank {rank}: failing with {mode} at step {step} (t={time.time():.3f})",
                  flush=True)
            if mode == "raise":
                raise RuntimeError(f"deliberate failure on rank {rank} at step {step}")
            if mode == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                time.sleep(3600)
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    print(f"rank {rank}: finished all steps", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "none", int(args[1]) if len(args) > 1 else 1,
         int(args[2]) if len(args) > 2 else 5)
