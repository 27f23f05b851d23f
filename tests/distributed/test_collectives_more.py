"""reducescatter, alltoall, the grouped collectives, sparse_allreduce_async, Adasum and the
timeline under mpirun, at any world size, against closed forms and dense references.

Every test runs on every rank in the same order and makes the same collective calls there.
"""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from hvd_slim.api import adasum
from hvd_slim.runtime import basics


def _expected_rows(n, size):
    """Horovod's uneven split, written out: the first n % size ranks get one row more."""
    counts = [n // size + (1 if r < n % size else 0) for r in range(size)]
    return [sum(counts[:r]) for r in range(size)], counts


def _calls():
    return basics.job_collectives().calls


# ---- reducescatter -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16])
def test_reducescatter_is_the_slice_of_the_sum(hvd, dtype):
    r, n = hvd.rank(), hvd.size()
    total = n * (n - 1) // 2
    for rows in (2 * n, 2 * n + 1, 3 * n - 1, 1, 0):
        base = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3)
        t = (base + r).to(dtype)
        starts, counts = _expected_rows(rows, n)
        want = (base * n + total)[starts[r]:starts[r] + counts[r]]
        got = hvd.reducescatter(t, op=hvd.Sum)
        assert got.dtype == dtype and got.shape == (counts[r], 3)
        assert torch.equal(got.double(), want)
        avg = hvd.reducescatter(t, op=hvd.Average)
        exact = want / n
        assert torch.allclose(avg.double(), exact.trunc() if not dtype.is_floating_point else exact,
                              atol=0.05 if dtype == torch.float16 else 1e-6)


def test_reducescatter_scales_and_keeps_dims(hvd):
    r, n = hvd.rank(), hvd.size()
    t = torch.full((2 * n, 2, 3), float(r + 1), dtype=torch.float64)
    got = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert got.shape == (2, 2, 3)
    assert torch.allclose(got, torch.full((2, 2, 3), 1.5 * n * (n + 1) / 2, dtype=torch.float64))
    ints = hvd.reducescatter(torch.full((n,), 3, dtype=torch.int32), op=hvd.Sum, prescale_factor=0.5)
    assert ints.tolist() == [n * 1]   # 3 * 0.5 = 1.5 truncates to 1 before the sum, as in Horovod
    h = hvd.reducescatter_async(torch.ones(n, 2), op=hvd.Sum, name="rs")
    assert hvd.synchronize(h).tolist() == [[float(n)] * 2]


def test_reducescatter_in_process_sets(hvd, my_set):
    ps = my_set
    members = ps.ranks
    t = torch.arange(4 * len(members), dtype=torch.float32) + hvd.rank()
    got = hvd.reducescatter(t, op=hvd.Sum, process_set=ps)
    me = ps.rank()
    want = (torch.arange(4 * len(members), dtype=torch.float32) * len(members) + sum(members))
    assert torch.equal(got, want[4 * me:4 * me + 4])


def test_reducescatter_gradient_is_horovods(hvd):
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1
    starts, counts = _expected_rows(rows, n)
    owner = torch.tensor([j for j in range(n) for _ in range(counts[j])], dtype=torch.float64)
    for op, factor in ((hvd.Sum, n), (hvd.Average, 1)):
        x = torch.zeros(rows, 2, dtype=torch.float64, requires_grad=True)
        out = hvd.reducescatter(x, op=op, prescale_factor=2.0)
        out.backward(torch.full(out.shape, float(r + 1), dtype=torch.float64))
        # each rank's rows come back from the rank that holds them, times size for Sum, times 2
        assert torch.equal(x.grad, ((owner + 1) * factor * 2).unsqueeze(1).expand(rows, 2))


def test_reducescatter_refusals_on_every_rank(hvd):
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(ValueError, match="0-d"):
        hvd.reducescatter(torch.tensor(float(r)))
    for op in (hvd.Adasum, hvd.Min, hvd.Max, hvd.Product):
        with pytest.raises(NotImplementedError, match="only supports"):
            hvd.reducescatter(torch.ones(n), op=op)
    with pytest.raises(ValueError, match="op=99"):
        hvd.reducescatter(torch.ones(n), op=99)
    with pytest.raises(TypeError, match="prescale_factor"):
        hvd.reducescatter(torch.ones(n), prescale_factor="2")
    if n > 1:
        with pytest.raises(hvd.MismatchError, match="mismatched"):
            hvd.reducescatter(torch.ones(n + r, 2))
        with pytest.raises(RuntimeError, match="mismatched"):
            hvd.reducescatter(torch.ones(n, dtype=torch.int32 if r % 2 else torch.float32))


# ---- alltoall ----------------------------------------------------------------------------------

def _outgoing(r, n, sends):
    """Rank r's rows: the block for rank j holds 100 * r + j in column 0 and the row index in 1."""
    rows = [torch.tensor([[100.0 * r + j, k] for k in range(sends[j])]).reshape(-1, 2) for j in range(n)]
    return torch.cat(rows)


def test_alltoall_with_splits_is_the_exchange(hvd):
    r, n = hvd.rank(), hvd.size()
    plan = [[(i + j) % 3 for j in range(n)] for i in range(n)]   # plan[i][j]: rows i sends j
    for kind in (list, torch.int32, torch.int64):
        splits = plan[r] if kind is list else torch.tensor(plan[r], dtype=kind)
        out, received = hvd.alltoall(_outgoing(r, n, plan[r]), splits)
        want = torch.cat([_outgoing(i, n, plan[i])[sum(plan[i][:r]):sum(plan[i][:r + 1])]
                          for i in range(n)])
        assert torch.equal(out, want)
        assert received.tolist() == [plan[i][r] for i in range(n)]
        assert received.dtype == (torch.int32 if kind is list else kind)


def test_alltoall_equal_split_and_fewer_rows_than_the_tensor(hvd):
    r, n = hvd.rank(), hvd.size()
    t = torch.arange(2 * n, dtype=torch.int16) + 10 * r
    out = hvd.alltoall(t)
    assert isinstance(out, torch.Tensor)
    assert out.tolist() == [10 * i + 2 * r + k for i in range(n) for k in range(2)]
    h = hvd.alltoall_async(t)
    out2, got = hvd.synchronize(h)
    assert torch.equal(out2, out) and got.tolist() == [2] * n
    # splits summing to less than dim 0: the trailing rows stay home, and get a zero gradient
    x = torch.arange(n + 2, dtype=torch.float64, requires_grad=True)
    y, _ = hvd.alltoall(x, [1] * n)
    assert y.tolist() == [float(r)] * n
    (y * y / 2).sum().backward()
    assert x.grad.tolist() == [float(k) for k in range(n)] + [0.0, 0.0]


def test_alltoall_gradient_goes_back(hvd, my_set):
    ps = my_set
    m, me = ps.size(), ps.rank()
    x = torch.randn(m * (me + 1), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(me))
    x.requires_grad_()
    splits = torch.tensor([me + 1] * m, dtype=torch.int32)
    out, received = hvd.alltoall(x, splits, process_set=ps)
    assert received.tolist() == [i + 1 for i in range(m)] and not received.requires_grad
    (out * out / 2).sum().backward()
    assert torch.allclose(x.grad, x.detach())
    z = torch.ones(2 * m, requires_grad=True)
    hvd.alltoall(z, process_set=ps).sum().backward()
    assert z.grad.tolist() == [1.0] * (2 * m)


def test_alltoall_bad_splits_are_refused_on_every_rank(hvd):
    r, n = hvd.rank(), hvd.size()
    if n > 1:
        with pytest.raises(ValueError, match="not divisible"):
            hvd.alltoall(torch.ones(n + 1))
    for splits, match in (([1] * (n + 1), "entries"), ([n + 1] + [0] * (n - 1), "more than dim 0"),
                          ([-1] + [1] * (n - 1), "negative"),
                          (torch.ones(n, dtype=torch.float32), "int32 or int64"),
                          ([0.5] * n, "ints"), ("1", "list")):
        with pytest.raises(ValueError, match=match):
            hvd.alltoall(torch.ones(n, 2), splits)
    if n > 1:
        bad = [n + 5] * n if r == 0 else [1] * n
        with pytest.raises(ValueError, match="more than dim 0" if r == 0 else r"rank\(s\) \[0\]"):
            hvd.alltoall(torch.ones(n), bad)
        with pytest.raises(RuntimeError, match="mismatched"):
            hvd.alltoall(torch.ones(2 * n, 1 + r))
    with pytest.raises(ValueError, match="0-d"):
        hvd.alltoall(torch.tensor(1.0))
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n   # still in step


# ---- grouped -----------------------------------------------------------------------------------

def _mixed(r):
    g = torch.Generator().manual_seed(7 + r)
    return [torch.randn(5, 3, generator=g), torch.randint(-50, 50, (4,), generator=g, dtype=torch.int64),
            torch.randn(2, 2, 2, generator=g, dtype=torch.float64), torch.randn(7, generator=g),
            torch.randn(3, generator=g).half()]


def test_grouped_allreduce_matches_allreduce(hvd):
    r = hvd.rank()
    ts = _mixed(r)
    for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max):
        got = hvd.grouped_allreduce(ts, op=op, prescale_factor=2.0)
        assert isinstance(got, list)
        for g, t in zip(got, ts):
            want = hvd.allreduce(t, op=op, prescale_factor=2.0)
            assert g.dtype == t.dtype and torch.allclose(g.double(), want.double(), atol=1e-6)
    copies = [t.clone() for t in ts]
    back = hvd.grouped_allreduce_(copies, op=hvd.Sum)
    assert isinstance(back, tuple) and all(b is c for b, c in zip(back, copies))
    h = hvd.grouped_allreduce_async(ts, op=hvd.Sum)
    for a, b in zip(hvd.synchronize(h), copies):
        assert torch.equal(a, b)
    again = [t.clone() for t in ts]
    res = hvd.synchronize(hvd.grouped_allreduce_async_(again, op=hvd.Sum))
    assert all(x is y for x, y in zip(res, again)) and all(torch.equal(a, b) for a, b in zip(again, copies))


def test_grouped_ops_send_one_message_per_dtype(hvd):
    n = hvd.size()
    same = [torch.ones(3), torch.ones(4, 2), torch.ones(1)]
    before = _calls()
    out = hvd.grouped_allreduce(same, op=hvd.Sum)
    # Each call: the engine's header round, the list's check, then one fused message.
    assert _calls() - before == 3
    assert all(torch.equal(o, torch.full_like(o, n)) for o in out)
    before = _calls()
    hvd.grouped_allgather(same + [torch.ones(2, dtype=torch.int8)])
    assert _calls() - before == 4   # header, check, row counts, one allgatherv of every tensor
    before = _calls()
    hvd.grouped_reducescatter([torch.ones(n), torch.ones(2 * n, 3)], op=hvd.Sum)
    assert _calls() - before == 3


def test_grouped_allgather_and_reducescatter_match_the_single_ops(hvd):
    r, n = hvd.rank(), hvd.size()
    ts = [torch.full((r + 1, 2), float(r)), torch.arange(r + 2, dtype=torch.int32), torch.tensor(r)]
    got = hvd.grouped_allgather(ts)
    assert isinstance(got, tuple)
    for g, t in zip(got, ts):
        assert torch.equal(g, hvd.allgather(t))
    assert all(torch.equal(a, b) for a, b in zip(hvd.synchronize(hvd.grouped_allgather_async(ts)), got))
    rs = [torch.arange(2 * n + 1, dtype=torch.float64) * (r + 1), torch.ones(n, 2, dtype=torch.int32)]
    for op in (hvd.Sum, hvd.Average):
        out = hvd.grouped_reducescatter(rs, op=op, postscale_factor=2.0)
        for o, t in zip(out, rs):
            assert torch.equal(o, hvd.reducescatter(t, op=op, postscale_factor=2.0))
    out = hvd.synchronize(hvd.grouped_reducescatter_async(rs, op=hvd.Sum))
    assert torch.equal(out[1], hvd.reducescatter(rs[1], op=hvd.Sum))


def test_grouped_gradients(hvd, my_set):
    ps = my_set
    m = ps.size()
    xs = [torch.ones(3, requires_grad=True), torch.ones(2, 2, dtype=torch.float64, requires_grad=True)]
    for o in hvd.grouped_allreduce(xs, op=hvd.Sum, process_set=ps):
        o.sum().backward()
    assert [x.grad.tolist() for x in xs] == [[float(m)] * 3, [[float(m)] * 2] * 2]
    y = torch.ones(ps.rank() + 1, 2, requires_grad=True)
    (g,) = hvd.grouped_allgather([y], process_set=ps)
    (g * torch.arange(g.shape[0], dtype=torch.float32).unsqueeze(1)).sum().backward()
    start = sum(i + 1 for i in range(ps.rank()))
    assert y.grad[:, 0].tolist() == [float(start + k) for k in range(ps.rank() + 1)]
    z = torch.ones(2 * m, requires_grad=True)
    (w,) = hvd.grouped_reducescatter([z], op=hvd.Sum, process_set=ps)
    w.sum().backward()
    assert z.grad.tolist() == [float(m)] * (2 * m)


def test_grouped_refusals(hvd):
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(ValueError, match="empty"):
        hvd.grouped_allreduce([])
    with pytest.raises(TypeError, match="list"):
        hvd.grouped_allgather(torch.ones(2))
    with pytest.raises(ValueError, match="0-d"):
        hvd.grouped_reducescatter([torch.zeros(3, 1), torch.tensor(1.0)])
    if n > 1:
        with pytest.raises(hvd.MismatchError, match="tensor lists"):
            hvd.grouped_allreduce([torch.ones(2)] * (1 + r))
        with pytest.raises(hvd.MismatchError, match="tensor lists"):
            hvd.grouped_allgather([torch.ones(2, 1 + r)])


# ---- sparse ------------------------------------------------------------------------------------

def test_sparse_allreduce_matches_dense(hvd, my_set):
    r = hvd.rank()
    g = torch.Generator().manual_seed(11 + r)
    for ps in (None, my_set):
        for shape in ((17, 4), (9,)):
            dense = torch.rand(*shape, generator=g)
            dense[dense < 0.7] = 0
            sparse = dense.to_sparse()
            for op in (hvd.Average, hvd.Sum):
                h = hvd.sparse_allreduce_async(sparse, name=f"s{len(shape)}", op=op, process_set=ps)
                got = h() if op == hvd.Average else hvd.synchronize(h)
                assert got.is_sparse and got.shape == dense.shape
                assert torch.allclose(got.to_dense(), hvd.allreduce(dense, op=op, process_set=ps), atol=1e-6)
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(2), name="d", op=hvd.Sum)
    with pytest.raises(ValueError, match="op="):
        hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), name="d", op=hvd.Max)
    if hvd.size() > 1:
        with pytest.raises(hvd.MismatchError):
            hvd.sparse_allreduce_async(torch.ones(2 + r).to_sparse(), name="m", op=hvd.Sum)


# ---- Adasum ------------------------------------------------------------------------------------

def test_adasum_pair_closed_forms():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert adasum.reference([a, b]).tolist() == [1.0, 2.0]           # orthogonal: the sum
    assert adasum.reference([a, a.clone()]).tolist() == [1.0, 0.0]   # parallel equal: the mean
    assert adasum.reference([a, torch.zeros(2)]).tolist() == [1.0, 0.0]
    c = torch.tensor([3.0, 4.0])
    dot = float(a @ c)
    want = (1 - dot / 2) * a + (1 - dot / 50) * c
    assert torch.allclose(adasum.reference([a, c]), want)


def test_allreduce_adasum_matches_the_reference_tree(hvd):
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(3 + r)
    mine = [torch.randn(6, 2, generator=g, dtype=torch.float64), torch.randn(5, generator=g)]
    if n & (n - 1):
        with pytest.raises(NotImplementedError, match="power of 2"):
            hvd.allreduce(mine[0], op=hvd.Adasum)
        with pytest.raises(NotImplementedError, match="power of 2"):
            hvd.grouped_allreduce(mine, op=hvd.Adasum)
        return
    every = hvd.allgather_object([t.clone() for t in mine])
    got = hvd.allreduce(mine[0], op=hvd.Adasum)
    want = adasum.reference([e[0] for e in every]).reshape(6, 2)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(x, got) for x in hvd.allgather_object(got))   # the same bits everywhere
    same = hvd.allreduce(torch.full((4,), 2.5), op=hvd.Adasum)
    assert torch.allclose(same, torch.full((4,), 2.5))
    onehot = torch.zeros(n)
    onehot[r] = 1.0
    assert torch.allclose(hvd.allreduce(onehot, op=hvd.Adasum), torch.ones(n))
    grouped = hvd.grouped_allreduce(mine, op=hvd.Adasum)
    for i, t in enumerate(grouped):
        ref = adasum.reference([e[i] for e in every]).reshape(t.shape).to(t.dtype)
        assert torch.allclose(t, ref, rtol=1e-5, atol=1e-6)
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Adasum).sum().backward()
    assert torch.allclose(x.grad, torch.ones(3))   # the Adasum of equal gradients is that gradient
    with pytest.raises(TypeError, match="floating point"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum)


# ---- timeline and errors -----------------------------------------------------------------------

def test_timeline_records_the_collectives(hvd):
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(prefix="hvdtl"), "t.json"), 0)
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="tl_tensor")
    hvd.reducescatter(torch.ones(hvd.size()))
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        events = json.loads(text)
        names = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
        assert "allreduce.tl_tensor" in names and "reducescatter.noname.1" in names
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START", "REDUCESCATTER"} <= \
            {e.get("name") for e in events}
        assert "start_time_since_epoch_in_micros" in text
    hvd.stop_timeline()   # stopping twice is fine
    with pytest.raises(TypeError, match="file_path"):
        hvd.start_timeline(3)
    with pytest.raises(TypeError, match="mark_cycles"):
        hvd.start_timeline(path, mark_cycles="yes")
    hvd.barrier()


def test_horovod_internal_error_is_a_runtime_error(hvd):
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(hvd.MismatchError, hvd.HorovodInternalError)
    assert issubclass(hvd.MismatchError, ValueError)
