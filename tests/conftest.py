"""The test tiers as pytest markers, so that ``pytest -m unit`` is the fast single-process run.

* ``unit``: one process (the fake N-rank transport); given here to every test of tests/unit that
  carries none of the markers below.
* ``mpi``: starts jobs under ``mpirun`` (the distributed tier, and the unit files that launch
  MPI jobs: they say so in their ``pytestmark``).
* ``torchrun``: starts jobs under ``torchrun`` (tests/torchrun: ``hvd.init()`` on
  torch.distributed, no MPI).
* ``horovod``: needs Horovod itself (the Horovod tier).
* ``gpu``: needs a CUDA GPU (the GPU tier).
* ``slow``: starts real processes without mpirun (torch.distributed workers, scripts, network
  namespaces).
* ``bench``: tests of the benchmarks and studies (tests/benchmarks: benchmarks/ and the
  examples), some of which read recorded results under benchmarks/results/, which the
  reproduction image leaves out: not in ``pytest -m unit``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, List

import pytest

MARKERS = {"unit": "one process, the fake N-rank transport (pytest -m unit)",
           "mpi": "starts jobs under mpirun",
           "torchrun": "starts jobs under torchrun (no MPI)",
           "horovod": "needs Horovod (horovod.torch)",
           "gpu": "needs a CUDA GPU",
           "slow": "starts real processes without mpirun",
           "bench": "tests of benchmarks/ and examples/ (tests/benchmarks)"}
HERE = Path(__file__).resolve().parent
# The tiers whose every test has one kind: by the folder or launcher file it lives in.
KIND_OF = {"distributed": "mpi", "torchrun": "torchrun", "horovod": "horovod", "gpu": "gpu",
           "benchmarks": "bench"}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        try:
            top = Path(item.path).resolve().relative_to(HERE).parts[0]
        except ValueError:   # a test outside tests/ (none today)
            continue
        if top in KIND_OF:
            item.add_marker(KIND_OF[top])
        elif top == "unit" and not any(item.get_closest_marker(m) for m in MARKERS if m != "unit"):
            item.add_marker("unit")


@pytest.fixture(autouse=True)
def _unit_tests_leave_mpi_alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """A unit test must not initialise MPI in the pytest process: importing ``mpi4py.MPI``
    makes it an Open MPI singleton, whose daemon and C-level environment every later subprocess
    inherits, and the benchmark tier's nested ``mpirun`` jobs then fail to start."""
    before = "mpi4py.MPI" in sys.modules
    yield
    if request.node.get_closest_marker("unit") and not before and "mpi4py.MPI" in sys.modules:
        pytest.fail("this unit test imported mpi4py.MPI (initialising MPI in the pytest "
                    "process); use the fake transport, or mark it `mpi` and run it under mpirun",
                    pytrace=False)
