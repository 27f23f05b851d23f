"""Process sets under mpirun, at any world size: collectives inside the even and odd ranks'
sets against closed forms, and the refusals (bad, duplicate or differing sets, a rank outside
its set), raised on every rank alike."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI


def _mine(hvd, sets):
    even, odd = sets
    return even if hvd.rank() % 2 == 0 else odd


def test_collectives_stay_inside_the_set(hvd, sets):
    r = hvd.rank()
    ps = _mine(hvd, sets)
    members = ps.ranks
    assert ps.included() and ps.size() == len(members) and ps.rank() == members.index(r)
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        t = torch.full((4, 3), r + 1, dtype=dtype)
        assert torch.equal(hvd.allreduce(t, op=hvd.Sum, process_set=ps),
                           torch.full((4, 3), sum(m + 1 for m in members), dtype=dtype))
    avg = hvd.allreduce(torch.full((5,), float(r)), process_set=ps)
    assert torch.allclose(avg, torch.full((5,), sum(members) / len(members)))
    got = hvd.allgather(torch.full((r + 1, 2), r), process_set=ps)
    assert got[:, 0].tolist() == [m for m in members for _ in range(m + 1)]
    root = members[-1]
    assert torch.equal(hvd.broadcast(torch.full((3,), r), root, process_set=ps), torch.full((3,), root))
    t = torch.full((2,), r)
    hvd.broadcast_(t, members[0], process_set=ps)
    assert t.tolist() == [members[0]] * 2
    assert hvd.broadcast_object({"from": r}, root, process_set=ps) == {"from": root}
    assert hvd.allgather_object(r, process_set=ps) == members
    hvd.barrier(process_set=ps)
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=ps)
    assert hvd.synchronize(h).tolist() == [len(members)] * 2


def test_gradients_flow_inside_the_set(hvd, sets):
    ps = _mine(hvd, sets)
    x = torch.full((3,), float(hvd.rank() + 1), requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum, process_set=ps).sum().backward()
    assert x.grad.tolist() == [float(ps.size())] * 3
    y = torch.ones(2, requires_grad=True)
    hvd.allgather(y, process_set=ps).sum().backward()
    assert y.grad.tolist() == [1.0, 1.0]


def test_global_process_set_is_every_rank(hvd):
    assert hvd.global_process_set.ranks == list(range(hvd.size()))
    assert hvd.global_process_set.size() == hvd.size() and hvd.global_process_set.rank() == hvd.rank()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=hvd.global_process_set)
    assert total.item() == hvd.size()
    assert not hvd.remove_process_set(hvd.global_process_set)


def test_bad_sets_are_refused_on_every_rank(hvd, sets):
    n, r = hvd.size(), hvd.rank()
    for bad, match in (([0, 0], "listed twice"), ([n], "out of range"), ([], "no ranks"),
                       (sets[0].ranks, "exists already")):
        with pytest.raises(ValueError, match=match):
            hvd.add_process_set(bad)
    with pytest.raises(ValueError, match="ints"):
        hvd.ProcessSet([0, "1"])
    if n > 1:
        with pytest.raises(RuntimeError, match="different process sets.*rank 0: \\[0\\]"):
            hvd.add_process_set([0] if r == 0 else list(range(n)))
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="must be an hvd.ProcessSet"):
        hvd.barrier(process_set=[0])


def test_a_rank_outside_the_set_and_a_root_outside_it_are_refused(hvd, sets):
    even, odd = sets
    r = hvd.rank()
    other = odd if r % 2 == 0 else even
    if other is not None:
        with pytest.raises(ValueError, match=f"rank {r} is not in"):
            hvd.allreduce(torch.ones(1), process_set=other)
    mine = _mine(hvd, sets)
    outsider = next((x for x in range(hvd.size()) if x not in mine.ranks), None)
    if outsider is not None:
        with pytest.raises(ValueError, match="not in the process set"):
            hvd.broadcast(torch.ones(1), outsider, process_set=mine)
    hvd.barrier()


def test_mismatched_tensors_in_a_set_raise_a_runtime_error(hvd, sets):
    ps = _mine(hvd, sets)
    if ps.size() >= 2:   # (a one-rank set has no one to disagree with; every rank still passes,
        # as the tier's launcher wants the same count from each)
        with pytest.raises(RuntimeError, match="mismatched"):
            hvd.allreduce(torch.ones(ps.rank() + 1), process_set=ps)
    hvd.barrier()


def test_init_registers_sets_from_ranks_and_communicators(hvd):
    n, r = hvd.size(), hvd.rank()
    world = MPI.COMM_WORLD
    head = world.Split(0 if r < max(1, n - 1) else MPI.UNDEFINED, r)
    by_ranks, by_comm = hvd.ProcessSet([n - 1]), hvd.ProcessSet(head)
    hvd.shutdown()
    try:
        hvd.init(process_sets=[by_ranks, by_comm])
        assert by_ranks.ranks == [n - 1] and by_comm.ranks == list(range(max(1, n - 1)))
        if by_comm.included():
            got = hvd.allgather(torch.tensor([r]), process_set=by_comm)
            assert got.tolist() == by_comm.ranks
        with pytest.raises(ValueError, match="process_sets"):
            hvd.shutdown() or hvd.init(process_sets="every")
    finally:
        hvd.shutdown()
        hvd.init()
        if head != MPI.COMM_NULL:
            head.Free()
