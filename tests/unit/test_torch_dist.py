"""Transport selection, torch.distributed framing, launcher checks and running inside Horovod,
all in one process (the multi-process Gloo runs are in test_torch_dist_launch.py)."""
from __future__ import annotations

import datetime
import re
import types

import numpy as np
import pytest
import torch

import hvd_slim
from hvd_slim.runtime import basics, env, horovod, torch_world
from hvd_slim.optim import transport_choice as choose_transport, rendezvous
from hvd_slim.transport import FakeCluster, TransportError
from hvd_slim.transport import torch_dist
from hvd_slim.transport.torch_frames import Frames
from hvd_slim.optim.wrapping import parameter_device

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "HOROVOD_RANK", "HOROVOD_SIZE",
               choose_transport.TRANSPORT_ENV)


@pytest.fixture(autouse=True)
def clean_launch_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


# --- the transport keyword and HVD_SLIM_TRANSPORT ---------------------------------------------

def test_unknown_transport_lists_the_available_ones():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"transport='carrier-pigeon' is not a transport: pass one of "
                                         r"\['auto', 'mpi', 'gloo'"):
        hvd_slim.DistributedOptimizer(sgd(model), transport="carrier-pigeon")
    with pytest.raises(ValueError, match=r"is not a transport"):
        hvd_slim.DistributedOptimizer(sgd(model), transport=3)


def test_nccl_for_cpu_parameters_is_unavailable_and_says_why():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"transport='nccl' is not available: NCCL needs CUDA "
                                         r"parameters and these are on cpu; available here: "
                                         r"\['auto', 'mpi', 'gloo'\]"):
        hvd_slim.DistributedOptimizer(sgd(model), transport="nccl")


def test_environment_variable_is_named_and_the_keyword_wins(monkeypatch):
    model = torch.nn.Linear(4, 2)
    monkeypatch.setenv(choose_transport.TRANSPORT_ENV, "smoke-signals")
    with pytest.raises(ValueError, match=r"environment variable HVD_SLIM_TRANSPORT='smoke-signals'"):
        hvd_slim.DistributedOptimizer(sgd(model))
    opt = hvd_slim.DistributedOptimizer(sgd(model), transport=FakeCluster(1).transport(0))
    assert opt.comm_stats()["transport"] == "fake"


def test_parameters_on_two_devices_are_refused_naming_one_of_each():
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(3, device="meta"))  # stands in for CUDA on a CPU machine
    opt = torch.optim.SGD([a, b], lr=0.1)
    with pytest.raises(ValueError, match=r"parameters are on 2 devices \('w' is on cpu; 'v' is on "
                                         r"meta\).*model.to\(device\)"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=[("w", a), ("v", b)],
                                      transport=FakeCluster(1).transport(0))
    assert parameter_device([]) == torch.device("cpu")
    assert parameter_device([("w", a)]) == torch.device("cpu")


def test_auto_picks_nccl_for_cuda_then_mpi_then_gloo_under_torchrun(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not basics.is_initialized()
    assert choose_transport.choose_auto(cpu) == "mpi"
    monkeypatch.setattr(choose_transport, "available",
                        lambda d: ["auto", "mpi", "gloo"] + (["nccl"] if d.type == "cuda" else []))
    assert choose_transport.choose_auto(cuda) == "nccl"
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29500")):
        monkeypatch.setenv(var, value)
    assert choose_transport.choose_auto(cpu) == "gloo"  # torchrun, hvd_slim not started on MPI
    assert choose_transport.choose_auto(cuda) == "nccl"


def test_torch_transport_without_any_launcher_says_how_to_start(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match=r"transport='gloo' cannot find the job: call "
                                         r"hvd_slim.init\(\).*torchrun"):
        rendezvous.torch_transport("gloo", torch.device("cpu"))


# --- launcher environments ----------------------------------------------------------------------

def test_torchrun_environment_is_checked():
    full = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert rendezvous.torchrun_env({}) is None
    assert rendezvous.torchrun_env(full) == (1, 2)
    with pytest.raises(ValueError, match=r"RANK, WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not"):
        rendezvous.torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"RANK=2 is not in \[0, WORLD_SIZE=2\)"):
        rendezvous.torchrun_env(dict(full, RANK="2"))
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE say rank 0 of "
                                         r"2 but RANK/WORLD_SIZE say rank 1 of 2"):
        rendezvous.torchrun_env(dict(full, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2"))
    # torchrun's own workers trust RANK even where an outer launcher's (srun's PMI) leak in.
    leaked = dict(full, PMI_RANK="0", PMI_SIZE="1", TORCHELASTIC_RUN_ID="job")
    assert rendezvous.torchrun_env(leaked) == (1, 2)


def test_hvd_init_runs_on_torch_distributed_under_torchrun_only():
    full = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert torch_world.launched_by_env(full)
    assert torch_world.launched_by_env({"RANK": "1"})   # incomplete: torchrun_env says what lacks
    assert not torch_world.launched_by_env({})
    mpirun = dict(full, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2")
    assert not torch_world.launched_by_env(mpirun)      # an MPI launcher started it: MPI
    assert torch_world.launched_by_env(dict(mpirun, TORCHELASTIC_RUN_ID="job"))   # torchrun did
    with pytest.raises(RuntimeError, match=r"launcher says this is rank 1 of 2 \(OMPI"):
        env.check_against_mpi(0, 1, mpirun)


def test_transport_timeout_variable():
    assert rendezvous.timeout({}).total_seconds() == rendezvous.DEFAULT_TIMEOUT_S
    assert rendezvous.timeout({rendezvous.TIMEOUT_ENV: "2.5"}).total_seconds() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match="HVD_SLIM_TRANSPORT_TIMEOUT"):
            rendezvous.timeout({rendezvous.TIMEOUT_ENV: bad})


# --- frames -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,size", [(0, 0), (0, 5), (3, 3), (5, 17)])
def test_frame_round_trip(n, size):
    payload = np.arange(n, dtype=np.uint8) + 1
    frame = Frames(torch.device("cpu")).around(torch.from_numpy(payload), size)
    assert len(frame) == size + 8 and int(frame[8 + n:].sum()) == 0
    (m,) = Frames.lengths([frame], size, [0], "gather")
    assert frame[8:8 + m].tolist() == payload.tolist()
    assert Frames.payload(frame, m, "cpu").tolist() == payload.tolist()


def test_a_frame_announcing_more_than_the_bound_is_refused():
    frame = Frames(torch.device("cpu")).around(torch.ones(4, dtype=torch.uint8), 6)
    frame[:8] = torch.from_numpy(np.frombuffer(np.int64(7).tobytes(), np.uint8).copy())
    with pytest.raises(TransportError, match=r"frame from rank 2 announces 7 bytes, outside \[0, 6\]"):
        Frames.lengths([frame], 6, [2], "gather")


# --- inside Horovod (a stand-in horovod.torch module) ---------------------------------------------

def fake_horovod(monkeypatch, rank=1, size=3, mpi=True, initialized=True):
    hvd = types.SimpleNamespace(is_initialized=lambda: initialized, mpi_enabled=lambda: mpi,
                                rank=lambda: rank, size=lambda: size, local_rank=lambda: rank,
                                local_size=lambda: size, cross_rank=lambda: 0, cross_size=lambda: 1)
    monkeypatch.setitem(__import__("sys").modules, "horovod.torch", hvd)
    return hvd


def test_queries_are_answered_by_an_initialised_horovod(monkeypatch):
    with pytest.raises(ValueError, match="has not been initialized"):
        hvd_slim.rank()
    fake_horovod(monkeypatch, initialized=False)
    with pytest.raises(ValueError, match="has not been initialized"):
        hvd_slim.rank()
    fake_horovod(monkeypatch, rank=2, size=4)
    assert (hvd_slim.rank(), hvd_slim.size(), hvd_slim.local_rank()) == (2, 4, 2)
    assert not hvd_slim.is_initialized()  # a query never starts hvd_slim


def test_horovod_on_gloo_and_rank_mismatch_are_refused(monkeypatch):
    fake_horovod(monkeypatch, mpi=False)
    with pytest.raises(RuntimeError) as info:
        horovod.check_not_gloo_only()
    assert str(info.value) == horovod.GLOO_ONLY and "horovodrun --mpi" in str(info.value)
    fake_horovod(monkeypatch, rank=1, size=3)
    horovod.check_against(1, 3)
    with pytest.raises(RuntimeError, match=r"Horovod says this is rank 1 of 3 but MPI.COMM_WORLD "
                                           r"\(mpi4py\) says rank 0 of 1"):
        horovod.check_against(0, 1)


# --- the rendezvous check-in (threads sharing one in-memory store) ------------------------------

def _check_in(store, rank, size, seconds):
    """Run rendezvous._register in a thread; returns a function giving its outcome."""
    import threading
    outcome = {}

    def body():
        try:
            rendezvous._register(store, rank, size, datetime.timedelta(seconds=seconds))
            outcome["result"] = "ok"
        except RuntimeError as exc:
            outcome["result"] = str(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return lambda: (thread.join(30), outcome.get("result", "still waiting"))[1]


@pytest.mark.parametrize("second,expect", [
    ((1, 2), "ok"),
    ((0, 2), "two processes claim rank 0 of 2"),
    # whichever rank checks in second names the mismatch from its own side
    ((1, 3), r"rank (1 was launched for a world of 3 ranks but another rank for 2|0 was launched "
             r"for a world of 2 ranks but another rank for 3)"),
])
def test_check_in_catches_duplicated_and_mismatched_ranks_everywhere(second, expect):
    store = torch.distributed.HashStore()
    first = _check_in(store, 0, 2, 20)
    other = _check_in(store, *second, 20)
    results = [first(), other()]
    assert all(re.search(expect, r) for r in results), results


def test_check_in_names_missing_ranks_after_the_timeout():
    said = _check_in(torch.distributed.HashStore(), 0, 3, 0.3)()
    assert "only 1 of 3 ranks joined within 0.3 s; missing ranks [1, 2]" in said, said


def test_backend_errors_keep_nccls_reason_and_drop_the_cpp_stack():
    exc = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1727, invalid usage\n"
                       "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
                       "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device f000\n"
                       "Exception raised from getNCCLComm at ProcessGroupNCCL.cpp:1727\n"
                       "frame #0: c10::Error::Error(...)\n")
    said = torch_dist.summary(exc)
    assert said.startswith("NCCL error in:") and "Duplicate GPU detected : rank 1" in said, said
    assert "frame #" not in said and "Exception raised from" not in said
    assert len(torch_dist.summary(RuntimeError("x" * 2000))) == 603
