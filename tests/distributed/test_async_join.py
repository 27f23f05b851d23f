"""The engine under mpirun, at any world size: truly asynchronous handles, tensor fusion,
duplicate names, ``join`` with uneven work per rank, and the bound on received lengths.

Every test runs on every rank in the same order and makes the same collective calls there;
results are checked against closed forms.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hvd_slim.api import engine, engine_rounds
from hvd_slim.transport import mpi_api


def _calls(hvd):
    return hvd.job_collectives().calls


# ---- asynchronous handles ---------------------------------------------------------------------

def test_poll_is_false_until_a_late_rank_arrives(hvd):
    n, r = hvd.size(), hvd.rank()
    hvd.barrier()
    if r == 0:
        time.sleep(0.5)   # every other rank submits first and must see its call pending
    handle = hvd.allreduce_async(torch.full((3,), float(r)), op=hvd.Sum, name="late")
    if r != 0:
        assert not hvd.poll(handle)
    deadline = time.monotonic() + 60
    while not hvd.poll(handle):   # completes in the background, without synchronize
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert hvd.synchronize(handle).tolist() == [n * (n - 1) / 2] * 3
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(handle)
    assert hvd.synchronize(handle) is None


@pytest.mark.parametrize("call", ["reducescatter", "alltoall", "grouped_allreduce",
                                  "grouped_allgather", "grouped_reducescatter"])
def test_every_async_op_is_pending_until_a_late_rank_arrives(hvd, call):
    n, r = hvd.size(), hvd.rank()
    t = torch.arange(2.0 * n).reshape(n, 2) + r
    grouped = call.startswith("grouped")
    kwargs = {"op": hvd.Sum} if "reduce" in call else {}
    args = [t] if grouped else t
    hvd.barrier()
    if r == 0:
        time.sleep(0.5)   # every other rank submits first and must see its call pending
    handle = getattr(hvd, call + "_async")(args, name=call, **kwargs)
    if r != 0:
        assert not hvd.poll(handle)
    with pytest.raises(ValueError, match="pending"):
        getattr(hvd, call + "_async")(args, name=call, **kwargs)   # its name is still pending
    got = hvd.synchronize(handle)
    want = getattr(hvd, call)(args, **kwargs)
    if call == "alltoall":
        got = got[0]
    for g, w in zip(got if grouped else [got], want if grouped else [want]):
        assert torch.equal(g, w)


def test_queued_calls_run_in_order_with_synchronous_ones(hvd):
    n, r = hvd.size(), hvd.rank()
    eye = torch.eye(3) * (r + 1)
    b = hvd.broadcast_async(eye, root_rank=n - 1)
    g = hvd.allgather_async(torch.full((r + 1, 2), r))
    a = hvd.allreduce_async_(eye.clone(), op=hvd.Max)
    hvd.barrier()
    assert hvd.broadcast_object(r, root_rank=0) == 0   # an on_group call, in its turn
    assert torch.equal(hvd.synchronize(b), torch.eye(3) * n)
    assert hvd.synchronize(g).tolist() == [[k, k] for k in range(n) for _ in range(k + 1)]
    assert torch.equal(hvd.synchronize(a), torch.eye(3) * n)


def test_errors_surface_at_synchronize_on_every_rank(hvd):
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    handle = hvd.allreduce_async(torch.zeros(r + 1), name="uneven")
    with pytest.raises(hvd.MismatchError, match="rank 1: float32 shape \\[2\\]"):
        hvd.synchronize(handle)
    # Different calls meet in the same fixed-width round: one clear error on every rank.
    with pytest.raises(hvd.MismatchError, match="different calls.*rank 0: barrier"):
        hvd.barrier() if r == 0 else hvd.allreduce(torch.ones(1))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n   # still in step


# ---- tensor fusion ---------------------------------------------------------------------------

def test_queued_allreduces_fuse_into_one_message(hvd):
    n, r = hvd.size(), hvd.rank()
    hvd.barrier()
    before = _calls(hvd)
    inplace = torch.full((2, 2), float(r))
    with engine.get().hold():   # queue them all before the engine looks
        handles = [hvd.allreduce_async(torch.full((k + 1,), float(r + k)), op=hvd.Sum)
                   for k in range(6)]
        handles.append(hvd.allreduce_async_(inplace, op=hvd.Sum))
    outs = [hvd.synchronize(h) for h in handles]
    assert _calls(hvd) - before == 2   # one header round, one Iallreduce for all seven
    for k, out in enumerate(outs[:6]):
        assert out.tolist() == [n * (n - 1) / 2 + n * k] * (k + 1)
    assert outs[6] is inplace and inplace.tolist() == [[n * (n - 1) / 2] * 2] * 2

    before = _calls(hvd)
    with engine.get().hold():   # a change of dtype, op or scale starts a new message
        handles = [hvd.allreduce_async(torch.ones(2), op=hvd.Sum),
                   hvd.allreduce_async(torch.ones(3), op=hvd.Sum),
                   hvd.allreduce_async(torch.ones(2, dtype=torch.int64), op=hvd.Sum),
                   hvd.allreduce_async(torch.ones(2) * (r + 1), op=hvd.Average),
                   hvd.allreduce_async(torch.ones(2) * (r + 1), op=hvd.Average),
                   hvd.allreduce_async(torch.ones(2), op=hvd.Sum, postscale_factor=0.5)]
    outs = [hvd.synchronize(h) for h in handles]
    assert _calls(hvd) - before == 8
    assert [o.tolist() for o in outs] == [[n] * 2, [n] * 3, [n] * 2, [(n + 1) / 2] * 2,
                                          [(n + 1) / 2] * 2, [n / 2] * 2]
    assert outs[2].dtype == torch.int64


def test_fusion_when_ranks_queue_different_numbers(hvd):
    """Rank 0 queues all its calls at once, the others one by one: each message carries what
    every rank has queued; the results are the same."""
    n, r = hvd.size(), hvd.rank()
    tensors = [torch.full((k % 3 + 1,), float(r * k)) for k in range(12)]
    if r == 0:
        with engine.get().hold():
            handles = [hvd.allreduce_async(t, op=hvd.Sum) for t in tensors]
    else:
        handles = [hvd.allreduce_async(t, op=hvd.Sum) for t in tensors]
    for k, h in enumerate(handles):
        assert hvd.synchronize(h).tolist() == [k * n * (n - 1) / 2] * (k % 3 + 1)


# ---- duplicate names -------------------------------------------------------------------------

def test_a_name_still_pending_is_refused_on_the_rank_that_reuses_it(hvd):
    n = hvd.size()
    t = torch.ones(4)
    with engine.get().hold():
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="'dup' is still pending"):
            hvd.allreduce_async(t, name="dup")
        with pytest.raises(ValueError, match="'dup' is still pending"):
            hvd.allgather(t, name="dup")   # refused before it is queued: it cannot wait
    assert hvd.synchronize(first).tolist() == [n] * 4
    again = hvd.allreduce_async(t, name="dup", op=hvd.Sum)   # free once it completed
    assert hvd.synchronize(again).tolist() == [n] * 4


def test_a_barrier_overtakes_calls_still_pending(hvd):
    """Horovod matches calls by name, so a barrier does not wait for a rank's pending async
    calls: rank 0 queues an allreduce, then waits in a barrier the others reach first."""
    n, r = hvd.size(), hvd.rank()
    t = torch.ones(3)
    if r == 0:
        handle = hvd.allreduce_async(t, name="pending", op=hvd.Sum)
    hvd.barrier()
    if r != 0:
        handle = hvd.allreduce_async(t, name="pending", op=hvd.Sum)
    assert hvd.synchronize(handle).tolist() == [n] * 3
    hvd.barrier()


def test_a_barrier_queued_after_the_pending_calls_header_went_out_still_overtakes_it(hvd):
    """Rank 0's engine starts its async allreduce's round before rank 0 queues the barrier
    (forced here by a pause), so its header says no barrier is behind: the ranks look again
    (Round.second_look) instead of raising a mismatch, and the barrier overtakes the call."""
    n, r = hvd.size(), hvd.rank()
    t = torch.ones(2)
    if r == 0:
        handle = hvd.allreduce_async(t, name="late", op=hvd.Sum)
        time.sleep(0.05)
    hvd.barrier()
    if r != 0:
        handle = hvd.allreduce_async(t, name="late", op=hvd.Sum)
    assert hvd.synchronize(handle).tolist() == [n] * 2
    hvd.barrier()


# ---- join ------------------------------------------------------------------------------------

def test_join_with_uneven_steps_per_rank(hvd):
    """Rank r runs r + 1 steps, then joins; joined ranks contribute zeros to allreduces (an
    average still divides by size), wait in barriers, and allgather and broadcast are refused
    while one has joined, as in Horovod."""
    n, r = hvd.size(), hvd.rank()
    for s in range(r + 1):
        active = range(s, n)   # ranks s.. are still stepping; ranks below s have joined
        total = float(sum(k + 1 for k in active))
        assert hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum).tolist() == [total] * 3
        avg = hvd.allreduce(torch.full((2, 2), float(r + 1)))
        assert torch.allclose(avg, torch.full((2, 2), total / n))
        ints = hvd.allreduce(torch.full((2,), r + 1, dtype=torch.int32), op=hvd.Average)
        assert ints.tolist() == [int(total / n)] * 2
        handles = [hvd.allreduce_async(torch.full((k + 1,), float(r + 1)), op=hvd.Sum,
                                       name=f"step{s}.{k}") for k in range(3)]
        for k, h in enumerate(handles):
            assert hvd.synchronize(h).tolist() == [total] * (k + 1)
        hvd.barrier()
        if s == 0:
            assert hvd.allgather(torch.full((1,), r)).tolist() == list(range(n))
            assert hvd.broadcast(torch.full((1,), r), root_rank=0).item() == 0
        else:
            with pytest.raises(RuntimeError, match="have called hvd.join"):
                hvd.allgather(torch.full((1,), r))
            with pytest.raises(RuntimeError, match="have called hvd.join"):
                hvd.broadcast(torch.full((1,), r), root_rank=n - 1)
            with pytest.raises(RuntimeError, match="have called hvd.join"):
                hvd.broadcast_object(r, root_rank=n - 1)
    last = hvd.join()
    assert last == n - 1   # ranks joined in order of rank, each in a round of its own
    assert hvd.allgather_object(last) == [n - 1] * n
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n   # everyone is back


def test_join_when_every_rank_joins_at_once(hvd):
    n = hvd.size()
    assert hvd.join() == n - 1   # all seen joining in one round: the highest rank
    assert hvd.join(device=0) == n - 1
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n


def test_the_first_rank_to_join_serves_fused_allreduces(hvd):
    n, r = hvd.size(), hvd.rank()
    if r == 0:
        last = hvd.join()
    else:
        with engine.get().hold():
            handles = [hvd.allreduce_async(torch.full((k + 2,), 2.0), op=hvd.Sum)
                       for k in range(4)]
        for k, h in enumerate(handles):
            assert hvd.synchronize(h).tolist() == [2.0 * (n - 1)] * (k + 2)
        last = hvd.join()
    assert last == (n - 1 if n > 1 else 0)


# ---- lengths are bounded before anything is allocated ----------------------------------------

def test_a_length_from_another_message_raises_before_allocating(hvd):
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    comm = MPI.COMM_WORLD.Dup()
    api = mpi_api.MpiCollectives(comm)
    huge = 127 << 40   # the 127 TiB a joined and an allreducing rank once produced
    if r == 0:   # not a length at all: rank 0 broadcasts some other eight bytes
        api.bcast_inplace(np.array([huge], dtype=np.int64).view(np.uint8), 0)
    else:
        with api.watch(30, "broadcast_object ('probe')"):
            with pytest.raises(hvd.TransportError, match=f"broadcast_object \\('probe'\\) \\(in MPI "
                               f"Bcast\\): rank 0 announced {huge} bytes, more than this machine"):
                api.bcast_bytes(None, 0)
    if r == 0:
        api.allgather_int64([-5])
    else:
        with pytest.raises(hvd.TransportError, match="rank 0 announced -5 bytes, negative"):
            api.allgather_bytes(np.zeros(3, dtype=np.uint8))
    # The header round refuses a row that is no header, before sizing anything from it.
    sig = engine_rounds.Sig(engine_rounds.ALLGATHER, "allgather", torch.float32, (2, 3), True)
    if r == 0:
        api.allgather_int64(np.full(engine_rounds.WIDTH, 7))
    else:
        with pytest.raises(hvd.TransportError, match="rank 0 sent \\[7, 7, 7, 7\\]... where an "
                           "hvd_slim call header belongs"):
            engine_rounds.exchange(api, engine_rounds.header(sig), "allgather of 'x'")
    comm.Barrier()
    comm.Free()


def test_agree_bounds_the_row_counts_it_returns(hvd):
    """agree() (the check collectives of other modules make) bounds each rank's dim 0."""
    from hvd_slim.api.checks import agree
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        return
    comm = MPI.COMM_WORLD.Dup()
    api = mpi_api.MpiCollectives(comm)
    t = torch.zeros(3, 1000)
    if r == 0:
        api.allgather_int64(list(agree_key(t)) + [1 << 50])
    else:
        with pytest.raises(hvd.TransportError, match="reducescatter of 'x': rank 0 announced"):
            agree(api, "reducescatter", "x", t, {}, dim0_free=True)
    comm.Free()


def agree_key(t):
    from hvd_slim.api import checks
    shape = tuple(t.shape)
    return [checks._crc(t.dtype), len(shape), checks._crc(shape[1:])]


# ---- without MPI_THREAD_MULTIPLE ------------------------------------------------------------

def test_without_thread_multiple_calls_run_as_they_are_made(hvd, monkeypatch):
    from hvd_slim.transport import mpi_comm
    n = hvd.size()
    hvd.shutdown()
    monkeypatch.setattr(mpi_comm, "thread_multiple", lambda: False)
    try:
        hvd.init()
        handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
        assert hvd.poll(handle) and hvd.synchronize(handle).tolist() == [n, n]
        assert hvd.join() == n - 1
        assert hvd.broadcast_object("x", root_rank=n - 1) == "x"
    finally:
        hvd.shutdown()
        monkeypatch.undo()
        hvd.init()
