"""Horovod's tensor API under torchrun, over Gloo: every collective against its closed form,
computed on every rank from data each rank can regenerate for every other (seeded by rank).
Every rank runs these in the same order (tests/torchrun/conftest.py)."""
from __future__ import annotations

import math
import time
from typing import Any, List

import pytest
import torch

from hvd_slim.api import adasum
from hvd_slim.api.checks import MismatchError


def data(rank: int, shape: Any = (5, 3), dtype: torch.dtype = torch.float64, seed: int = 0
         ) -> torch.Tensor:
    """Rank ``rank``'s tensor: any rank can rebuild any other's. Small integers, so that sums
    and products are exact in every dtype whatever order the ranks are combined in."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 10).round().to(dtype)


def every(n: int, **kw: Any) -> List[torch.Tensor]:
    return [data(q, **kw) for q in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64,
                                   torch.int16, torch.int8, torch.uint8])
@pytest.mark.parametrize("op", ["Sum", "Min", "Max", "Product"])
def test_allreduce_of_every_dtype_and_op(hvd: Any, dtype: torch.dtype, op: str) -> None:
    n, r = hvd.size(), hvd.rank()
    parts = [t.abs() if dtype == torch.uint8 else t for t in every(n, dtype=dtype)]
    fold = {"Sum": torch.add, "Min": torch.minimum, "Max": torch.maximum, "Product": torch.mul}[op]
    expected = parts[0].clone()
    for t in parts[1:]:
        expected = fold(expected, t)   # in the dtype: integers wrap as Gloo's (and MPI's) do
    got = hvd.allreduce(parts[r], op=getattr(hvd, op), name=f"{dtype} {op}")
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype)), (got, expected)


def test_average_scale_factors_and_half_precision(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    total = sum(every(n))
    got = hvd.allreduce(data(r), op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.allclose(got, total / n, rtol=0, atol=1e-12)
    half = hvd.allreduce(data(r, dtype=torch.bfloat16), op=hvd.Sum, name="bf16")
    assert half.dtype == torch.bfloat16
    expected = sum(t.float() for t in every(n, dtype=torch.bfloat16)).to(torch.bfloat16)
    assert torch.equal(half, expected)
    wrapped = hvd.allreduce(torch.tensor([30000], dtype=torch.int16), op=hvd.Sum, name="wrap")
    assert wrapped.item() == torch.tensor([30000 * n]).to(torch.int16).item()   # as int16 adds
    inplace = data(r)
    assert hvd.allreduce_(inplace, op=hvd.Sum, name="in place") is inplace
    assert torch.allclose(inplace, total, rtol=0, atol=1e-12)


def test_async_calls_fuse_poll_and_synchronize(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    handles = [hvd.allreduce_async(data(r, seed=s), op=hvd.Sum, name=f"async {s}")
               for s in range(6)]
    for s, h in enumerate(handles):
        got = hvd.synchronize(h)
        assert torch.allclose(got, sum(every(n, seed=s)), rtol=0, atol=1e-12)
    h = hvd.allgather_async(torch.full((r + 1, 2), r), name="async gather")
    while not hvd.poll(h):   # poll is False until the engine's thread has run the call
        time.sleep(0.001)
    assert torch.equal(hvd.synchronize(h),
                       torch.cat([torch.full((q + 1, 2), q) for q in range(n)]))
    grouped = hvd.grouped_allreduce([data(r, seed=7), data(r, shape=(4,), seed=8)], op=hvd.Sum)
    assert torch.allclose(grouped[0], sum(every(n, seed=7)), rtol=0, atol=1e-12)
    assert torch.allclose(grouped[1], sum(every(n, shape=(4,), seed=8)), rtol=0, atol=1e-12)


def test_grouped_gathers_scatters_and_a_sparse_allreduce(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    a, b = hvd.grouped_allgather([torch.full((r + 1,), r), data(r, shape=(1, 3))])
    assert torch.equal(a, torch.cat([torch.full((q + 1,), q) for q in range(n)]))
    assert torch.equal(b, torch.cat(every(n, shape=(1, 3))))
    x, y = hvd.grouped_reducescatter([data(r, shape=(2 * n, 2)), data(r, shape=(n,), seed=3)],
                                     op=hvd.Sum)
    assert torch.equal(x, sum(every(n, shape=(2 * n, 2)))[2 * r:2 * r + 2])
    assert torch.equal(y, sum(every(n, shape=(n,), seed=3))[r:r + 1])
    # Rank q holds the value q + 1 at index q and 1 at index 0: duplicates add up.
    sparse = torch.sparse_coo_tensor([[0, r]], [1.0, r + 1.0], (n,), check_invariants=True)
    got = hvd.sparse_allreduce_async(sparse, "sparse", hvd.Sum)().to_dense()
    expected = torch.arange(1.0, n + 1)
    expected[0] += n
    assert torch.equal(got, expected)


def test_allgather_broadcast_and_their_gradients(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    mine = data(r, shape=(r + 1, 3)).requires_grad_()
    gathered = hvd.allgather(mine, name="rows")
    assert torch.equal(gathered.detach(), torch.cat([data(q, shape=(q + 1, 3)) for q in range(n)]))
    gathered.sum().backward()   # Horovod's gradient: the average over ranks of the sum's = ones
    assert torch.equal(mine.grad, torch.ones_like(mine))
    for root in range(n):
        got = hvd.broadcast(data(r, seed=root), root_rank=root, name=f"from {root}")
        assert torch.equal(got, data(root, seed=root))
        t = data(r, dtype=torch.int32)
        assert hvd.broadcast_(t, root_rank=root) is t and torch.equal(t, data(root, dtype=torch.int32))


def test_alltoall_and_reducescatter(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    # Rank q sends j + 1 rows to rank j, row values 100*q + j.
    rows = lambda q: torch.cat([torch.full((j + 1, 2), 100 * q + j) for j in range(n)])  # noqa: E731
    got = hvd.alltoall(rows(r), splits=torch.tensor([j + 1 for j in range(n)]))
    got = got[0] if isinstance(got, tuple) else got
    assert torch.equal(got, torch.cat([torch.full((r + 1, 2), 100 * q + r) for q in range(n)]))
    # 7 rows over n ranks: Horovod's split, the first ranks taking one more.
    full = sum(every(n, shape=(7, 2)))
    base, extra = divmod(7, n)
    start = r * base + min(r, extra)
    mine = full[start:start + base + (1 if r < extra else 0)]
    assert torch.allclose(hvd.reducescatter(data(r, shape=(7, 2)), op=hvd.Sum), mine,
                          rtol=0, atol=1e-12)
    assert torch.allclose(hvd.reducescatter(data(r, shape=(7, 2)), op=hvd.Average), mine / n,
                          rtol=0, atol=1e-12)


def test_adasum_matches_the_pairwise_reference(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    if n & (n - 1):
        with pytest.raises(NotImplementedError, match="non-power of 2"):
            hvd.allreduce(data(r), op=hvd.Adasum, name="adasum")
        return
    got = hvd.allreduce(data(r), op=hvd.Adasum, name="adasum")
    assert torch.allclose(got, adasum.reference(every(n)).view_as(got), rtol=1e-12, atol=0)


def test_objects_parameters_and_optimizer_state(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    assert hvd.broadcast_object({"rank": r, "list": [r] * r}, root_rank=n - 1) == \
        {"rank": n - 1, "list": [n - 1] * (n - 1)}
    assert hvd.allgather_object(("r", r)) == [("r", q) for q in range(n)]
    torch.manual_seed(r)   # different on every rank until broadcast
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (r + 1))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    digests = hvd.allgather_object([p.detach().numpy().tobytes() for p in model.parameters()]
                                   + [opt.param_groups[0]["lr"]])
    assert all(d == digests[0] for d in digests) and digests[0][-1] == 0.1
    hvd.barrier()


def test_mismatched_calls_raise_the_same_error_on_every_rank(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    with pytest.raises(MismatchError, match=r"ranks passed mismatched arguments") as info:
        hvd.allreduce(torch.zeros(2 + (r == n - 1)), name="mismatch")
    messages = hvd.allgather_object(str(info.value))
    assert len(set(messages)) == 1 and f"rank {n - 1}: float32 shape [3]" in messages[0]


def test_join_serves_the_others_allreduces_with_zeros(hvd: Any) -> None:
    """Rank q makes q + 1 allreduces, then joins: each allreduce sums the ranks still in."""
    n, r = hvd.size(), hvd.rank()
    for k in range(r + 1):
        got = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"uneven {k}")
        assert torch.equal(got, torch.full((3,), float(n - k)))   # ranks 0..k-1 have joined
    assert hvd.join() == n - 1


def test_process_sets_run_apart(hvd: Any, sets: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    ps = sets[r % 2]
    members = list(range(r % 2, n, 2))
    assert ps.ranks == members and ps.size() == len(members) and ps.rank() == members.index(r)
    got = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=ps)
    assert got.item() == sum(members)
    assert torch.equal(hvd.allgather(torch.tensor([r]), process_set=ps), torch.tensor(members))
    assert hvd.broadcast(torch.tensor([r]), root_rank=members[-1], process_set=ps).item() == members[-1]
    assert hvd.broadcast_object(r, root_rank=members[0], process_set=ps) == members[0]
    with pytest.raises(ValueError, match="not in the process set"):
        hvd.broadcast(torch.tensor([r]), root_rank=(members[0] + 1) % n, process_set=ps)


def test_sync_batch_norm_matches_batch_norm_over_every_rank(hvd: Any) -> None:
    n, r = hvd.size(), hvd.rank()
    x = [data(q, shape=(4, 3, 5)).float() for q in range(n)]
    bn = hvd.SyncBatchNorm(3)
    bn.train()
    mine = x[r].clone().requires_grad_()
    out = bn(mine)
    ref = torch.nn.BatchNorm1d(3)
    ref.train()
    everyone = torch.cat(x).requires_grad_()
    expected = ref(everyone)
    assert torch.allclose(out, expected[4 * r:4 * r + 4], atol=1e-5)
    assert torch.allclose(bn.running_mean, ref.running_mean, atol=1e-6)
    assert math.isclose(float(bn.running_var.sum()), float(ref.running_var.sum()), rel_tol=1e-5)
