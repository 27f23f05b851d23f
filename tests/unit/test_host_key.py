"""HVD_SLIM_HOST_KEY: which ranks are one host when MPI's shared-memory split cannot tell
(network namespaces or containers on one machine): the pure rule, and ``local_rank()``,
``local_size()`` and ``cross_rank()`` of a real 4-rank job whose ranks name 2 hosts."""
import shutil
import sys

import pytest

from hvd_slim.runtime.hosts import HOST_KEY_VAR, host_colors
from tests.mpi_launch import run_mpi, tail

# Rank 0 prints every rank's row: lines of several ranks could interleave.
REPORT = ("import hvd_slim as hvd; hvd.init(); "
          "rows = hvd.allgather_object((hvd.rank(), hvd.local_rank(), hvd.local_size(), "
          "hvd.cross_rank(), hvd.cross_size())); "
          "hvd.rank() == 0 and print('hostkey', rows, flush=True)")


def test_host_numbers_follow_the_first_rank_of_each_host():
    assert host_colors([None, None, None]) is None
    assert host_colors(["b", "a", "b", "a"]) == [0, 1, 0, 1]
    assert host_colors(["h0", "h0", "h1", "h1", "h2"]) == [0, 0, 1, 1, 2]
    assert host_colors([" x ", "x"]) == [0, 0]   # surrounding blanks do not make a new host


@pytest.mark.parametrize("keys, bad", [(["a", None, "a"], "1"), (["a", " ", None], "1, 2")])
def test_a_key_on_some_ranks_only_is_refused_naming_them(keys, bad):
    with pytest.raises(ValueError, match=rf"{HOST_KEY_VAR} is unset or empty on rank\(s\) {bad} "
                                         r"but set on others: set it on every rank"):
        host_colors(keys)


def _job(script_env: str):
    # Each rank sets its own key from its MPI rank before Python starts.
    command = ["sh", "-c", f"{script_env} exec {sys.executable} -c \"{REPORT}\""]
    return run_mpi(4, command, 120)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_four_ranks_naming_two_hosts_get_two_local_ranks_each():
    rc, out, _ = _job(f"{HOST_KEY_VAR}=host$((OMPI_COMM_WORLD_RANK / 2)) && export {HOST_KEY_VAR} &&")
    assert rc == 0, tail(out)
    # rank, local rank, local size, cross rank, cross size
    want = "hostkey [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2)]"
    assert want in out, tail(out)


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_a_key_on_one_rank_only_ends_the_job_with_the_ranks_named():
    rc, out, _ = _job(f"if [ \"$OMPI_COMM_WORLD_RANK\" = 0 ]; then export {HOST_KEY_VAR}=h0; fi;")
    assert rc != 0, tail(out)
    assert f"{HOST_KEY_VAR} is unset or empty on rank(s) 1, 2, 3" in out, tail(out)
