"""Horovod on Gloo without MPI (``horovodrun --gloo``): hvd_slim must refuse with a clear message
before it starts MPI (which would come up as a lone singleton on every rank).

Prints ``hvd_slim-horovod: rank R of N PASS check_gloo_refused`` when both entry points (building
a DistributedOptimizer, and hvd_slim.init()) raise that message. Launched by
tests/horovod/test_tier_horovod.py.
"""
import os
import sys

import torch

import horovod.torch as hvd

import hvd_slim
from hvd_slim.runtime.horovod import GLOO_ONLY


def main() -> int:
    hvd.init()
    tag = f"hvd_slim-horovod: rank {hvd.rank()} of {hvd.size()}"
    assert hvd.gloo_enabled() and not hvd.mpi_enabled(), "this script must run on Gloo"
    model = torch.nn.Linear(8, 2)
    failures = []
    for what, call in (
            ("DistributedOptimizer", lambda: hvd_slim.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters())),
            ("init", hvd_slim.init)):
        try:
            call()
            failures.append(f"{what}: no error")
        except RuntimeError as exc:
            if str(exc) != GLOO_ONLY:
                failures.append(f"{what}: unexpected message {exc}")
    if "mpi4py.MPI" in sys.modules:
        failures.append("mpi4py was imported (MPI started) before the refusal")
    hvd.barrier()
    if failures:
        print(f"{tag} FAILED check_gloo_refused: {failures}", flush=True)
        return 1
    line = f"{tag} PASS check_gloo_refused: {GLOO_ONLY[:60]}..."
    print(line, flush=True)
    if os.environ.get("HVD_SLIM_REPORT_DIR"):  # stdout of the ranks may interleave mid-line
        with open(os.path.join(os.environ["HVD_SLIM_REPORT_DIR"], f"rank{hvd.rank()}.txt"), "a",
                  encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
