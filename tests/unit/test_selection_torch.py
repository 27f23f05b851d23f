"""The torch path of selection (CoreSelector's TorchScores, explore on the core's device) against
the numpy path, on CPU tensors: the same exact top-k sets (ties to the lowest indices), the same
carried thresholds and passes, the same explored indices, and the same refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_slim.selection import CoreSelector, backend, explore


def pair():
    return CoreSelector(backend="numpy"), CoreSelector(backend="torch")


def check_same(ref: CoreSelector, dev: CoreSelector, x: torch.Tensor, k: int,
               magnitude: bool) -> torch.Tensor:
    fn = "select_magnitude" if magnitude else "select"
    a = getattr(ref, fn)(x, k)
    b = getattr(dev, fn)(x, k)
    assert a.dtype == b.dtype == torch.int64 and b.device == x.device
    assert torch.equal(a, b), (k, magnitude)
    assert ref.state_dict() == dev.state_dict()
    assert (ref.last_passes, ref.last_candidates) == (dev.last_passes, dev.last_candidates)
    return a


@pytest.mark.parametrize("magnitude", [False, True])
def test_tied_levels_select_and_carry_identically(magnitude):
    """Scores on a coarse grid with a heavily tied level (a server's residual of float8
    pushes): the step over an unneeded level and the partition-free take of a needed one."""
    ref, dev = pair()
    g = torch.Generator().manual_seed(3)
    for step in range(12):
        n = 200_000
        x = torch.randint(1, 24, (n,), generator=g).float() / 8.0
        x[torch.rand(n, generator=g) < 1 / 3] = 1.0 + (step % 4) / 8.0
        if magnitude:
            x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        k = [2_000, 20_000, 60_000][step % 3]
        check_same(ref, dev, x, k, magnitude)
    # A floor two thirds of the entries tie at, with the k-th just above it.
    x = torch.ones(n)
    spread = torch.rand(n, generator=g) < 1 / 3
    x[spread] = 1.0 + torch.rand(int(spread.sum()), generator=g)
    check_same(ref, dev, x, int(0.95 * int(spread.sum())), magnitude)


@pytest.mark.parametrize("magnitude", [False, True])
def test_a_drifting_sequence_selects_and_carries_identically(magnitude):
    """Steps whose scale jumps up and down reach every branch: the carried threshold kept or
    refreshed, lowered from the sample, and the zero-threshold fallback."""
    ref, dev = pair()
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        n = [300_000, 70_001, 5][step % 7 == 6] if step % 5 else 300_000
        x = torch.randn(n, generator=g) * (10.0 ** ((step % 9) - 4))
        if step % 3 == 0:
            x[::4] = 0.0                                   # many zeros: the zero fallback
        if step % 4 == 1:
            x[1::7] = x[1::7].round()                      # plenty of ties
        if not magnitude:
            x = x.abs()
        k = [3_000, 17, 1, 299_999, n // 2][step % 5] if n > 5 else 2
        check_same(ref, dev, x, min(k, n), magnitude)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(n=st.integers(1, 20_000), frac=st.floats(0, 1.2), seed=st.integers(0, 2 ** 31),
       levels=st.sampled_from([0, 2, 5, 1000]), zeros=st.floats(0, 1),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
       magnitude=st.booleans(), carried=st.booleans())
def test_random_scores_select_identically(n, frac, seed, levels, zeros, dtype, magnitude,
                                          carried):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if levels:   # few distinct values: ties everywhere
        x = (x * levels).round()
    x[torch.rand(n, generator=g, dtype=torch.float64) < zeros] = 0.0
    x = x.to(dtype)
    if not magnitude:
        x = x.abs()
    ref, dev = pair()
    k = int(frac * n)
    if carried:   # a threshold carried over from an earlier, different call
        check_same(ref, dev, x.flip(0).contiguous(), max(1, n // 3), magnitude)
    check_same(ref, dev, x, k, magnitude)


def test_trivial_sizes_and_refusals_match():
    ref, dev = pair()
    x = torch.rand(10)
    for k in (0, 10, 11):
        check_same(ref, dev, x, k, False)
    for bad in (torch.zeros(3, 2), torch.zeros(4, dtype=torch.int32)):
        for sel in (ref, dev):
            with pytest.raises(ValueError, match="select: score must"):
                sel.select(bad, 1)
    neg = torch.zeros(100)
    neg[:3] = -1.0
    for sel in pair():
        with pytest.raises(ValueError, match="non-negative"):
            sel.select(neg, 50)
    with pytest.raises(ValueError):
        CoreSelector(backend="cupy")


def test_the_default_follows_the_device_and_the_force_switch(monkeypatch):
    """CPU tensors take numpy unless FORCE_TORCH; the torch path never makes a numpy array."""
    x = torch.rand(50_000, generator=torch.Generator().manual_seed(1))
    want = CoreSelector(backend="numpy").select(x, 500)
    monkeypatch.setattr(backend, "FORCE_TORCH", True)

    def refuse(self, *a, **k):
        raise AssertionError("the torch path made a numpy array of the scores")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    assert torch.equal(CoreSelector().select(x, 500), want)
    assert torch.equal(CoreSelector().select_magnitude(x - 0.5, 500),
                       CoreSelector(backend="torch").select((x - 0.5).abs(), 500))


@pytest.mark.parametrize("d,core_n,k_e", [(1, 0, 1), (1, 1, 1), (10, 3, 7), (10, 3, 50),
                                          (100_000, 900, 100), (100_000, 0, 1000),
                                          (5_000, 4_999, 3), (2 ** 40, 50, 10)])
def test_explore_on_the_cores_device_matches(monkeypatch, d, core_n, k_e):
    rng = np.random.default_rng(d + core_n)
    if d < 1 << 30:
        core = np.sort(rng.choice(d, core_n, replace=False))
    else:
        core = np.unique(rng.integers(0, d, core_n))
    core_t = torch.from_numpy(core.astype(np.int64))
    key = (7, 0, 1, 42, 3)
    want = explore(d, core_t, k_e, key)
    monkeypatch.setattr(backend, "FORCE_TORCH", True)
    got = explore(d, core_t, k_e, key)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    for bad in (torch.tensor([3, 3]), torch.tensor([5, 2]), torch.tensor([-1]),
                torch.tensor([10]), torch.tensor([0.5])):
        with pytest.raises(ValueError, match="explore: core"):
            explore(10, bad, 1, key)


def test_both_score_backends_meet_the_scores_contract():
    """NumpyScores and TorchScores each have every member of backend.Scores, the contract
    CoreSelector is written against."""
    from hvd_slim.selection.scores_numpy import NumpyScores
    from hvd_slim.selection.scores_torch import TorchScores

    x = torch.rand(100)
    for scores in (NumpyScores(x.numpy(), False), TorchScores(x, True)):
        assert isinstance(scores, backend.Scores), type(scores).__name__


@pytest.mark.parametrize("zeros", [0.0, 0.3, 0.95, 1.0])
@pytest.mark.parametrize("negative", [False, True])
def test_a_sample_order_statistic_is_the_sorted_samples_mostly_zero_or_not(zeros, negative):
    """sample_order(i) is the i-th smallest sample in both twins, where most of the sample is
    zero (the numpy twin counts the zeros there instead of partitioning them) or little."""
    from hvd_slim.selection.scores_numpy import NumpyScores
    from hvd_slim.selection.scores_torch import TorchScores

    gen = torch.Generator().manual_seed(int(zeros * 100) + negative)
    x = torch.rand(5000, generator=gen)
    x[torch.rand(5000, generator=gen) < zeros] = 0
    if negative:   # outside the scores' contract, but the order statistic stays exact
        x[:300] = -x[:300]
    want = torch.sort(x).values
    twins = (NumpyScores(x.numpy(), False), TorchScores(x, False))
    for scores in twins:
        scores.take_sample(1)
    for i in (0, 150, 299, 300, 2499, 4750, 4999):
        assert [t.sample_order(i) for t in twins] == [float(want[i])] * 2, i


def test_slice_indices_is_the_core_then_its_keyed_exploration():
    from hvd_slim.selection import ROLE_PULL, ROLE_PUSH, slice_indices

    core = torch.tensor([2, 30, 31, 700], dtype=torch.int64)
    got = slice_indices(1000, core, 50, seed=9, role=ROLE_PUSH, rank=1, step=4, bucket=2,
                        device=torch.device("cpu"))
    assert torch.equal(got, torch.cat([core, explore(1000, core, 50, (9, ROLE_PUSH, 1, 4, 2))]))
    pulled = slice_indices(1000, core, 50, seed=9, role=ROLE_PULL, rank=1, step=4, bucket=2,
                           device=torch.device("cpu"))
    assert ROLE_PUSH != ROLE_PULL and not torch.equal(got, pulled)


@pytest.mark.parametrize("seed", range(6))
def test_few_positives_fill_with_the_lowest_zeros_on_both_paths(seed):
    """Fewer positive scores than k: every positive, then the lowest-indexed zeros, read from a
    prefix only; both twins give the reference set (positives anywhere, some inside the prefix)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(50, 5000, (1,), generator=g))
    score = torch.zeros(n)
    npos = int(torch.randint(0, n // 4, (1,), generator=g))
    where = torch.randperm(n, generator=g)[:npos]
    score[where] = torch.rand(npos, generator=g) + 0.1
    k = min(n - 1, npos + int(torch.randint(1, n // 2, (1,), generator=g)))
    pos = sorted(where.tolist())
    zeros = [i for i in range(n) if score[i] == 0][:k - npos]
    want = sorted(pos + zeros)
    for sel in pair():
        assert sel.select(score, k).tolist() == want
        assert sel.select_magnitude(-score, k).tolist() == want   # |a| of a negative vector
