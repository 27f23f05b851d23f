"""``hvd.init()`` under torchrun: the job's shape from torchrun's variables, no MPI anywhere,
what only MPI provides refused naming the call, and shutdown followed by a second init.
Every rank runs these in the same order (tests/torchrun/conftest.py)."""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist


def test_the_job_is_torchruns_and_runs_without_mpi(hvd: Any) -> None:
    assert hvd.is_initialized() and hvd.backend() == "torch"
    assert (hvd.rank(), hvd.size()) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    # One host: the local ranks are torchrun's, the cross groups have one rank each.
    assert (hvd.local_rank(), hvd.local_size()) == (int(os.environ["LOCAL_RANK"]),
                                                    int(os.environ["LOCAL_WORLD_SIZE"]))
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    assert not hvd.mpi_enabled() and not hvd.mpi_threads_supported()
    assert hvd.gloo_enabled() and hvd.gloo_built()
    assert sys.modules["mpi4py"] is None   # the tier blocked it; nothing replaced it
    assert not any(m.startswith("hvd_slim.transport.mpi") for m in sys.modules)
    # hvd.init() initialised torch.distributed for the script too.
    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (hvd.rank(), hvd.size())


def test_the_default_group_is_the_scripts_own(hvd: Any) -> None:
    """The script's own torch.distributed calls and hvd_slim's (a group of its own) do not
    meet: interleaved, both give their closed forms."""
    n, r = hvd.size(), hvd.rank()
    mine = torch.tensor([float(r)])
    h = hvd.allreduce_async(torch.tensor([1.0 + r]), op=hvd.Sum, name="interleaved")
    dist.all_reduce(mine)
    assert mine.item() == n * (n - 1) / 2
    assert hvd.synchronize(h).item() == n + n * (n - 1) / 2


@pytest.mark.parametrize("call, match", [
    (lambda hvd: hvd.job_comm(), r"hvd_slim.job_comm\(\) needs MPI: it returns hvd_slim's MPI "
                                 r"communicator\. This job was started by torchrun"),
    (lambda hvd: hvd.world_transport(), r"world_transport\(\) needs MPI: .*transport='gloo'"),
    (lambda hvd: hvd.init(comm=[0]), r"hvd_slim.init\(comm=\.\.\.\) needs MPI: .*add_process_set"),
])
def test_what_needs_mpi_says_which_call_and_why(hvd: Any, call: Any, match: str) -> None:
    if "init" in match:
        hvd.shutdown()   # init is idempotent: only a fresh one looks at comm=
        try:
            with pytest.raises(RuntimeError, match=match):
                call(hvd)
        finally:
            hvd.init()
        return
    with pytest.raises(RuntimeError, match=match + ".*launch with mpirun or horovodrun"):
        call(hvd)


def test_an_mpi_communicator_process_set_and_elastic_run_need_mpi(hvd: Any) -> None:
    fake_comm = type("Intracomm", (), {"__module__": "mpi4py.MPI"})()   # what mpi4py would hand
    hvd.shutdown()
    try:
        with pytest.raises(RuntimeError, match=r"hvd.ProcessSet\(communicator\) needs MPI: .*list "
                                               r"of job ranks"):
            hvd.init(process_sets=[hvd.ProcessSet(fake_comm)])
    finally:
        hvd.init()

    @hvd.elastic.run
    def train(state: Any) -> None:
        raise AssertionError("elastic.run must refuse before calling the function")
    with pytest.raises(RuntimeError, match=r"hvd.elastic.run needs MPI: .*torchrun --max-restarts"):
        train(hvd.elastic.ObjectState(epoch=0))


def test_shutdown_and_init_again(hvd: Any) -> None:
    """A second init after shutdown starts afresh (new groups, the default group again) and
    its collectives give the closed forms."""
    n = hvd.size()
    hvd.shutdown()
    assert not hvd.is_initialized() and not dist.is_initialized()
    hvd.init()
    assert hvd.backend() == "torch" and dist.is_initialized()
    got = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="after re-init")
    assert got.item() == n * (n - 1) / 2
    assert hvd.allgather_object(hvd.rank()) == list(range(n))


@pytest.mark.parametrize("var", ["HVD_SLIM_TIMEOUT", "HVD_SLIM_TRANSPORT_TIMEOUT"])
def test_a_bad_timeout_variable_is_refused_at_init(hvd: Any, monkeypatch: Any, var: str) -> None:
    hvd.shutdown()
    monkeypatch.setenv(var, "soon")
    try:
        with pytest.raises(ValueError, match=var):
            hvd.init()
        assert not hvd.is_initialized() and not dist.is_initialized()
    finally:
        monkeypatch.delenv(var)
        hvd.init()
    assert hvd.is_initialized()


def test_init_after_the_script_started_torch_distributed_itself(hvd: Any) -> None:
    """The script called init_process_group first: hvd.init() runs on that world (a group of
    its own on it) and leaves it to the script at shutdown."""
    n = hvd.size()
    hvd.shutdown()
    dist.init_process_group("gloo")   # torchrun's env:// variables
    try:
        hvd.init()
        assert hvd.backend() == "torch" and (hvd.rank(), hvd.size()) == (dist.get_rank(), n)
        assert hvd.allgather_object(hvd.rank()) == list(range(n))
        hvd.shutdown()
        assert dist.is_initialized()   # the script's, not hvd_slim's
        mine = torch.ones(1)
        dist.all_reduce(mine)
        assert mine.item() == n
    finally:
        if hvd.is_initialized():
            hvd.shutdown()
        dist.destroy_process_group()
        hvd.init()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item() == n
