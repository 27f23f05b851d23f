"""``hierarchical=True`` under mpirun, with hosts named by HVD_SLIM_HOST_KEY (2 hosts of 2
ranks, in blocks or round robin; one host of 3), over MPI and Gloo, alone and with ``overlap``
(and ``overlap_forward``), and the refusal of hosts of different sizes
(tests/scripts/hierarchical_train.py)."""
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from hvd_slim.runtime.hosts import HOST_KEY_VAR
from tests.mpi_launch import run_mpi, tail

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "scripts" / "hierarchical_train.py"

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpirun") is None
                       or importlib.util.find_spec("mpi4py") is None,
                       reason="needs mpirun and mpi4py"),
]


def _job(np_, host_of_rank, density, transport="mpi", shape=""):
    # Each rank names its host from its MPI rank before Python starts.
    command = ["sh", "-c", f"{HOST_KEY_VAR}=host$(({host_of_rank})) && export {HOST_KEY_VAR} && "
               f"exec {sys.executable} {SCRIPT} {density} {shape}"]
    return run_mpi(np_, command, 180, drop=("HVD_SLIM_",),
                   extra_env={"HVD_SLIM_TRANSPORT": transport})


@pytest.mark.parametrize("np_, host_of_rank, transport, shape", [
    (4, "OMPI_COMM_WORLD_RANK / 2", "mpi", ""), (4, "OMPI_COMM_WORLD_RANK % 2", "mpi", ""),
    (3, "0", "mpi", ""), (4, "OMPI_COMM_WORLD_RANK % 2", "gloo", ""),
    # overlap with backward, each stage hosts first (and with the next forward)
    (4, "OMPI_COMM_WORLD_RANK / 2", "mpi", "3"), (4, "OMPI_COMM_WORLD_RANK % 2", "gloo", "3"),
    (4, "OMPI_COMM_WORLD_RANK % 2", "mpi", "3 forward"), (3, "0", "gloo", "3 forward")])
@pytest.mark.parametrize("density", [1.0, 0.05])
def test_every_rank_ends_bitwise_equal_and_resumes_bitwise(np_, host_of_rank, transport, shape,
                                                           density):
    rc, out, _ = _job(np_, host_of_rank, density, transport, shape)
    assert rc == 0, tail(out)
    hashes = re.search(r"hier: hashes \[(.*)\]", out).group(1).split(", ")
    assert len(hashes) == np_ and len(set(hashes)) == 1, tail(out)
    assert "hier: resume bitwise True" in out, tail(out)
    local = 3 if np_ == 3 else 2
    assert f"hier: local {local} hosts {np_ // local}" in out, tail(out)
    gap = float(re.search(r"hier: dense gap (\S+)", out).group(1))
    if density == 1.0:   # two stages of means instead of one: rounding only
        assert gap < 1e-5, tail(out)
    local_bytes = int(re.search(r"hier: local bytes (\d+)", out).group(1))
    assert local_bytes > 0, tail(out)


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_overlap_forward_trains_bitwise_as_overlap_alone_across_hosts(transport):
    """The step handed over after backward lands in the next forward, across 2 hosts of 2:
    the same parameters as ``overlap`` alone (the script clears the gradients meanwhile)."""
    runs = [_job(4, "OMPI_COMM_WORLD_RANK % 2", 0.05, transport, shape)
            for shape in ("3", "3 forward")]
    hashes = []
    for rc, out, _ in runs:
        assert rc == 0, tail(out)
        hashes.append(re.search(r"hier: hashes \[(.*)\]", out).group(1))
    assert hashes[0] == hashes[1], hashes


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_hosts_of_different_sizes_end_the_job_naming_them(transport):
    rc, out, _ = _job(3, "OMPI_COMM_WORLD_RANK / 2", 0.05, transport)
    assert rc != 0, tail(out)
    assert "hierarchical=True needs as many ranks on every host, but host 0 has 2 (ranks 0, 1); " \
           "host 1 has 1 (ranks 2)" in out, tail(out)
