"""The exchange's deadline (``timeout`` / HVD_SLIM_TIMEOUT) in one process: a rank that stops
taking part ends the others' step with a TransportTimeout naming the collective, the step and
the missing rank, instead of a hang. The MPI version runs in test_reliability_launch.py."""
import threading
import time

import pytest
import torch

import hvd_slim
from hvd_slim.transport import FakeCluster, run_ranks
from hvd_slim.transport.base import TransportTimeout
from hvd_slim.transport.deadline import poll_until


def test_poll_until_returns_as_soon_as_done():
    calls = []
    poll_until(lambda: calls.append(1) or len(calls) >= 3, rank=0, seconds=5, label="x",
               op="gather", root_side=True, stalled=lambda: "nobody")
    assert len(calls) == 3


def test_poll_until_names_the_operation_the_phase_and_who_is_missing():
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match=r"^rank 4: gather to rank 0 in the push of step 9 "
                                               r"timed out after 0.2 s: rank\(s\) 2 sent nothing$"):
        poll_until(lambda: False, rank=4, seconds=0.2, label="the push of step 9",
                   op="gather to rank 0", root_side=True, stalled=lambda: "rank(s) 2 sent nothing")
    assert 0.2 <= time.monotonic() - start < 1.0


def test_non_root_ranks_wait_longer_so_the_root_reports_first(capsys):
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="timed out after 0.3 s"):
        poll_until(lambda: False, rank=1, seconds=0.2, label="", op="broadcast from rank 0",
                   root_side=False, stalled=lambda: "rank 0 did not send")
    assert time.monotonic() - start >= 0.3
    # Half-way, one stall warning says who is waited for.
    assert capsys.readouterr().err.count("has waited") == 1


def test_a_rank_that_stops_stepping_times_the_others_out():
    timeout, stop_after = 1.0, 2

    def body(rank, tr):
        torch.manual_seed(0)
        model = torch.nn.Linear(80, 60)
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            transport=tr, timeout=timeout, min_compress_numel=1000)
        for t in range(4):
            if rank == 2 and t == stop_after:
                return None   # e.g. a rank that left the loop early
            model(torch.randn(4, 80)).sum().backward()
            start = time.monotonic()
            try:
                opt.step()
            except TransportTimeout as exc:
                return str(exc), time.monotonic() - start
            opt.zero_grad()
        return "no timeout", 0.0

    res = run_ranks(3, body, timeout=30)
    assert res[2] is None
    for rank in (0, 1):
        msg, waited = res[rank]
        assert msg.startswith(f"rank {rank}: gather to rank 0 in the push of step 2 timed out "
                              f"after 1 s: rank(s) 2 never arrived"), msg
        assert "HVD_SLIM_TIMEOUT" in msg and "(now 1 s)" in msg, msg
        assert timeout - 0.01 <= waited < timeout + 2, waited   # Barrier.wait may wake µs early


def test_a_watch_nests_and_applies_to_the_thread_that_set_it():
    """The deadline of watch() (transport/base.py's Deadlines, which the tensor API's MPI
    collectives share): innermost first, restored on exit, and per thread, so concurrent API
    calls from several threads keep their own limits and labels."""
    t = FakeCluster(1).transport(0)
    seen = []
    with t.watch(2.0, "outer"):
        with t.watch(1.0, "inner"):
            other = threading.Thread(target=lambda: seen.append(t.deadline))
            other.start()
            other.join()
            seen.append(t.deadline)
        seen.append(t.deadline)
    seen.append(t.deadline)
    assert seen == [(None, ""), (1.0, "inner"), (2.0, "outer"), (None, "")]
