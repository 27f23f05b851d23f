"""tests/mpi_launch.py over benchmarks/launch.py, the one launcher of the study, the benchmarks
and the MPI, Horovod and GPU tiers: a job runs in a session of its own and, when it outlives its
timeout, the whole session is killed, including processes that left the launcher's process
group (as Open MPI's ranks do), and the test fails instead of hanging."""
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests import mpi_launch

pytestmark = pytest.mark.slow  # starts real processes: not in `pytest -m unit`

ROOT = Path(__file__).resolve().parents[2]

# A "launcher" that starts a "rank" in a process group of its own, then both hang.
HANG = ("import os, subprocess, sys, time\n"
        "code = 'import os, time; os.setpgrp(); print(\"rank pid\", os.getpid(), flush=True); "
        "time.sleep(300)'\n"
        "subprocess.Popen([sys.executable, '-c', code])\n"
        "time.sleep(300)\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie waiting for its reaper counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_finished_job_returns_its_exit_code_and_output():
    rc, out, seconds = mpi_launch.run_session(
        [sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"], 60,
        mpi_launch.session_env())
    assert (rc, out) == (3, "hello\n") and seconds < 60


def test_session_env_drops_launcher_variables_and_finds_the_package(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("HVD_SLIM_DENSITY", "0.5")
    env = mpi_launch.session_env(drop=("HVD_SLIM_",))
    assert "OMPI_COMM_WORLD_RANK" not in env and "HVD_SLIM_DENSITY" not in env
    assert "HVD_SLIM_DENSITY" in mpi_launch.session_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the session's processes in /proc")
def test_a_hung_job_is_killed_whole_and_fails_the_test():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3s") as info:
        mpi_launch.run_session([sys.executable, "-c", HANG], 3, mpi_launch.session_env())
    assert time.monotonic() - start < 30
    pid = int(re.search(r"rank pid (\d+)", str(info.value)).group(1))
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the rank in its own process group outlived the kill"
