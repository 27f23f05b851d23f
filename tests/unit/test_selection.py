"""Core selection (exact top-k by a carried threshold) and seeded stratified exploration."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from hvd_slim.selection import CoreSelector, explore, significance, tie_start
from hvd_slim.selection.scores_numpy import NumpyScores


def topk_set(score: torch.Tensor, k: int) -> torch.Tensor:
    """Reference: torch.topk indices, sorted ascending."""
    k = min(k, score.numel())
    return torch.sort(torch.topk(score, k).indices).values


def assert_valid_topk(score: torch.Tensor, idx: torch.Tensor, k: int) -> None:
    """``idx`` is a sorted, unique set of min(k, n) entries no smaller than any left out."""
    n = score.numel()
    assert idx.dtype == torch.int64
    assert idx.numel() == min(k, n)
    if idx.numel() > 1:
        assert bool((idx[1:] > idx[:-1]).all())
    if 0 < idx.numel() < n:
        mask = torch.zeros(n, dtype=torch.bool)
        mask[idx] = True
        assert score[mask].min() >= score[~mask].max()


def rand(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * scale


# ------------------------------------------------------------------------------ significance
def test_significance_values_and_out_reuse():
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(300_001, generator=g), torch.randn(300_001, generator=g)
    out = torch.empty_like(a)
    res = significance(a, w, 0.25, out=out)
    assert res is out
    torch.testing.assert_close(res, a.abs() + 0.25 * w.abs())
    assert torch.equal(significance(a, w, 0.0), a.abs())      # lam == 0 ignores w
    assert torch.equal(significance(a, None, 3.0), a.abs())   # so does w None
    # out may alias a (in-place scoring of the accumulator's copy).
    a2 = a.clone()
    torch.testing.assert_close(significance(a2, w, 0.5, out=a2), a.abs() + 0.5 * w.abs())


def test_significance_rejects_bad_shapes():
    with pytest.raises(ValueError):
        significance(torch.zeros(3, 2), None, 0.0)
    with pytest.raises(ValueError):
        significance(torch.zeros(4), torch.zeros(5), 1.0)
    with pytest.raises(ValueError):
        significance(torch.zeros(4), None, 0.0, out=torch.zeros(3))
    with pytest.raises(ValueError):
        significance(torch.zeros(4), None, -1.0)


# ------------------------------------------------------------------------------ core
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097, 65_537, 300_000])
def test_core_is_exact_topk(n):
    sel = CoreSelector()
    for seed, frac in enumerate([0.0, 0.001, 0.01, 0.1, 0.5, 0.99, 1.0, 1.5]):
        k = int(round(frac * n)) if frac < 1.5 else n + 5
        score = rand(n, seed + 10 * n)
        idx = sel.select(score, k)
        assert torch.equal(idx, topk_set(score, k)), (n, k)


def test_select_magnitude_equals_select_of_abs_bitwise():
    """The in-cache |a| pass picks the same set, ties and carried threshold as select(|a|)."""
    plain, fused = CoreSelector(), CoreSelector()
    for step, (n, k) in enumerate([(300_000, 3_000), (300_000, 3_000), (600_001, 17),
                                   (1_000, 999), (70_000, 69_000), (5, 2)]):
        a = torch.randn(n, generator=torch.Generator().manual_seed(step)) * (10.0 ** step)
        a[::5] = 0.0                           # zeros, so the zero-threshold path is reached
        a[1::11] = -a[2::11][: a[1::11].numel()]   # equal magnitudes of opposite sign: ties
        expect = plain.select(a.abs(), k)
        got = fused.select_magnitude(a, k)
        assert torch.equal(got, expect), (n, k)
        assert got.numel() == min(k, n)
        assert plain.state_dict() == fused.state_dict()


def test_core_small_k_on_large_vector():
    sel = CoreSelector()
    for seed, k in enumerate([1, 2, 5, 33, 500]):
        score = rand(500_000, seed)
        assert torch.equal(sel.select(score, k), topk_set(score, k))


def test_core_steady_state_is_one_pass_with_few_candidates():
    sel = CoreSelector()
    n, k = 1_000_000, 10_000
    base = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for step in range(6):
        noise = torch.randn(n, generator=torch.Generator().manual_seed(100 + step))
        score = (0.95 * base + 0.3 * noise).abs()
        assert torch.equal(sel.select(score, k), topk_set(score, k))
        if step:
            assert sel.last_passes == 1
            assert k <= sel.last_candidates <= 1.5 * k


def ties_at_levels(n: int, seed: int, tied: float = 1.125) -> torch.Tensor:
    """Signed scores on a float8-like grid (a server's residual sums a few float8 pushes): a
    spread of values on eighths, and a third of all entries exactly at ``tied``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 24, (n,), generator=g).float() / 8.0
    x[torch.rand(n, generator=g) < 1 / 3] = tied
    return x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


def topk_lowest_ties(x: torch.Tensor, k: int) -> torch.Tensor:
    """Reference: the k largest |x|, ties at the k-th going to the lowest indices."""
    v = x.abs().numpy()
    order = np.lexsort((np.arange(v.size), -v))
    return torch.from_numpy(np.sort(order[:k]))


def test_core_drops_a_tied_floor_below_the_kth(monkeypatch):
    # Two thirds of the entries tie at exactly 1.0, the rest spread above it. With k just
    # under their count the sampled threshold lands on the tied level; the k-th lies above,
    # so the tied candidates are dropped before the partition (``above``), exactly.
    n = 600_000
    g = torch.Generator().manual_seed(5)
    x = torch.ones(n)
    spread = torch.rand(n, generator=g) < 1 / 3
    x[spread] = 1.0 + torch.rand(int(spread.sum()), generator=g)
    k = int(0.95 * int(spread.sum()))
    calls = []
    real = NumpyScores.above
    monkeypatch.setattr(NumpyScores, "above",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    sel = CoreSelector()
    for sign in (1.0, -1.0):
        assert torch.equal(sel.select_magnitude(sign * x, k), topk_lowest_ties(x, k))
    assert calls


@pytest.mark.parametrize("want_at_floor", [True, False])
def test_exact_drops_a_fifth_tied_at_the_floor_with_the_same_result(monkeypatch, want_at_floor):
    # A 4-rank server's candidates: a coarse grid, a fifth of them exactly at the floor, the
    # k-th above it. The tied fifth is dropped before the partition (np.partition slows over
    # many equal values); the slice and the carried threshold (the want-th largest candidate)
    # are those of a full sort.
    c = 200_000
    g = torch.Generator().manual_seed(9)
    vals = 1.0 + torch.randint(1, 64, (c,), generator=g).float() / 64.0
    at_floor = torch.rand(c, generator=g) < 0.2
    vals[at_floor] = 1.0
    cand = torch.sort(torch.randperm(4 * c, generator=g)[:c]).values
    n_floor = int(at_floor.sum())
    k = c - n_floor - 5_000
    want = c - n_floor // 2 if want_at_floor else k + 2_000
    calls = []
    real = NumpyScores.above
    monkeypatch.setattr(NumpyScores, "above",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    sel = CoreSelector()
    s = NumpyScores(np.zeros(4 * c, dtype=np.float32), magnitude=True)
    s.take_sample(64)
    got = sel._exact(s, cand.numpy(), vals.numpy(), k, want, floor=1.0, ties=0)
    order = np.lexsort((np.arange(c), -vals.numpy()))
    assert np.array_equal(got, np.sort(cand.numpy()[order[:k]]))
    assert sel._thr == float(np.sort(vals.numpy())[c - want])
    assert calls, "the tied floor was partitioned with the rest"


def test_core_takes_a_needed_tied_level_by_lowest_indices():
    # The k-th value is the tied level itself: all above it, then the tied entries in index
    # order, from one candidate pass, with that level carried as the next threshold.
    n = 600_000
    x = ties_at_levels(n, 7, tied=2.5)   # 20/8: three levels of the grid lie above
    above = int((x.abs() > 2.5).sum())
    k = above + 5_000
    sel = CoreSelector()
    for _ in range(3):
        assert torch.equal(sel.select_magnitude(x, k), topk_lowest_ties(x, k))
        assert sel.last_passes == 1
        assert sel.state_dict() == {"threshold": 2.5}


def topk_ties_from(x: torch.Tensor, k: int, ties: int) -> torch.Tensor:
    """Reference: the k largest |x|; of those tied at the k-th, a run in index order from the
    ``ties mod count``-th, wrapping around."""
    v = x.abs().numpy()
    kth = np.sort(v)[::-1][k - 1]
    above = np.flatnonzero(v > kth)
    tied = np.flatnonzero(v == kth)
    need = k - above.size
    start = ties % tied.size if need < tied.size else 0
    run = np.concatenate([tied[start:], tied[:start]])[:need]
    return torch.from_numpy(np.sort(np.concatenate([above, run])))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_core_takes_a_tied_level_from_the_given_start_and_wraps(backend):
    n = 600_000
    x = ties_at_levels(n, 7, tied=2.5)
    k = int((x.abs() > 2.5).sum()) + 5_000
    tied = int((x.abs() == 2.5).sum())
    sel = CoreSelector(backend=backend)
    assert torch.equal(sel.select_magnitude(x, k, ties=0), topk_lowest_ties(x, k))
    # a start near the end of the tied run wraps to the lowest tied indices
    for ties in (1, 12_345, tied - 100, 3 * tied + 17, 2 ** 62 + 5):
        got = sel.select_magnitude(x, k, ties=ties)
        assert torch.equal(got, topk_ties_from(x, k, ties)), ties
        assert got.numel() == k
    # the carried threshold does not depend on the start
    assert sel.state_dict() == {"threshold": 2.5}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_first_chooses_nan_and_inf_before_any_finite_entry(backend, bad):
    """nonfinite="propagate"'s rule: NaN/Inf rank above every finite entry (a NaN otherwise
    never reaches any threshold), the rest is the finite top-k, and the carried threshold
    stays finite, so the selector's checkpoint still loads."""
    a = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    poisoned = [7, 20_011, 49_999]
    a[poisoned] = bad
    sel = CoreSelector(backend=backend)
    for _ in range(2):   # the second call runs from the carried threshold
        got = sel.select_magnitude(a, 100, nonfinite_first=True)
        finite = a.clone()
        finite[poisoned] = 0.0
        want = torch.cat([torch.tensor(poisoned), torch.topk(finite.abs(), 97).indices])
        assert torch.equal(got, want.sort().values)
        CoreSelector(backend=backend).load_state_dict(sel.state_dict())
    if bad != bad:   # without the rule no NaN is ever chosen
        assert not set(poisoned) & set(CoreSelector(backend=backend).select_magnitude(
            a, 100).tolist())


def test_tie_start_is_keyed_and_reproducible():
    starts = {tie_start((0, step, 0)) for step in range(50)}
    assert len(starts) == 50 and all(0 <= s < 2 ** 63 for s in starts)
    assert tie_start((3, 7, 1)) == tie_start((3, 7, 1)) != tie_start((3, 7, 2))
    # keys of any length, each entry counted
    assert tie_start((0, 0, 5, 1, 2)) != tie_start((0, 1, 5, 1, 2))


def test_core_exact_when_distribution_shifts():
    sel = CoreSelector()
    n, k = 200_000, 2_000
    scales = [1.0, 1000.0, 1.0, 1e-3, 1e-3, 1e3, 1e6, 1.0]
    for step, scale in enumerate(scales):
        score = rand(n, step, scale)
        if step % 3 == 2:
            score = score ** 8   # a heavy tail: the old threshold's rank changes a lot
        assert torch.equal(sel.select(score, k), topk_set(score, k)), (step, scale)
    # k changing between calls as well.
    for step, k in enumerate([10, 50_000, 3, 199_999, 2_000]):
        score = rand(n, 50 + step)
        assert torch.equal(sel.select(score, k), topk_set(score, k)), k


def test_core_ties_and_zeros():
    sel = CoreSelector()
    n = 100_000
    zeros = torch.zeros(n)
    # All tied: the lowest indices win, deterministically.
    assert torch.equal(sel.select(zeros, 1000), torch.arange(1000))
    assert torch.equal(sel.select(torch.ones(n), 7), torch.arange(7))
    # Few positives, fewer than k: all of them, then the lowest zeros.
    sparse = torch.zeros(n)
    sparse[[5, 70_000, 99_999]] = torch.tensor([1.0, 2.0, 3.0])
    assert sel.select(sparse, 6).tolist() == [0, 1, 2, 5, 70_000, 99_999]
    assert sel.select(sparse, 2).tolist() == [70_000, 99_999]
    # Heavily tied integer levels: a valid top-k set, ties broken toward low indices.
    levels = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(3)).float()
    for k in [1, 100, 30_000, 60_000]:
        idx = sel.select(levels, k)
        assert_valid_topk(levels, idx, k)
        kth = levels[idx].min()
        chosen_ties = idx[levels[idx] == kth]
        all_ties = torch.nonzero(levels == kth).squeeze(1)
        assert torch.equal(chosen_ties, all_ties[: chosen_ties.numel()])


def test_core_float64_and_degenerate_k():
    sel = CoreSelector()
    score = rand(10_000, 4).double()
    assert torch.equal(sel.select(score, 123), topk_set(score, 123))
    assert sel.select(score, 0).numel() == 0
    assert sel.select(score, 0).dtype == torch.int64
    assert torch.equal(sel.select(score, 10_000), torch.arange(10_000))
    assert sel.select(torch.zeros(0), 5).numel() == 0
    with pytest.raises(ValueError):
        sel.select(score, -1)
    with pytest.raises(ValueError):
        sel.select(score.view(100, 100), 3)


def test_core_never_calls_full_topk_or_sort(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("full topk/sort called")
    monkeypatch.setattr(torch, "topk", boom)
    monkeypatch.setattr(torch, "sort", boom)
    monkeypatch.setattr(np, "sort", boom)
    sel = CoreSelector()
    score = rand(200_000, 5)
    for _ in range(2):
        assert sel.select(score, 2_000).numel() == 2_000


def test_core_state_dict_round_trip_is_bitwise():
    n, k = 300_000, 3_000
    a = CoreSelector()
    for step in range(4):
        a.select(rand(n, step), k)
    state = a.state_dict()
    assert isinstance(state["threshold"], float)
    restored = json.loads(json.dumps(state))      # plain Python values only
    b = CoreSelector()
    b.load_state_dict(restored)
    for step in range(4, 8):
        score = rand(n, step, scale=1.0 + step)
        ia, ib = a.select(score, k), b.select(score, k)
        assert torch.equal(ia, ib)
        assert (a.last_passes, a.last_candidates) == (b.last_passes, b.last_candidates)
        assert a.state_dict() == b.state_dict()
    # A fresh selector's state is "no threshold yet", and loading it resets a used one.
    a.load_state_dict(CoreSelector().state_dict())
    assert a.state_dict() == {"threshold": None}
    score = rand(n, 99)
    assert torch.equal(a.select(score, k), CoreSelector().select(score, k))


# ------------------------------------------------------------------------------ explore
def check_explore(d, core, k_e, out):
    core_set = set(core.tolist())
    got = out.tolist()
    assert out.dtype == torch.int64
    assert len(got) == min(k_e, d - len(core_set))
    assert got == sorted(set(got))
    assert all(0 <= x < d for x in got)
    assert not core_set & set(got)


@pytest.mark.parametrize("d,n_core,k_e", [
    (1, 0, 1), (10, 3, 3), (10, 3, 7), (10, 3, 50), (10, 10, 4), (100, 0, 100),
    (1000, 100, 37), (1000, 990, 20), (5000, 2500, 1), (123_457, 1_234, 1_111),
])
def test_explore_properties(d, n_core, k_e):
    rng = np.random.default_rng(d + n_core + k_e)
    core = torch.from_numpy(np.sort(rng.choice(d, n_core, replace=False)).astype(np.int64))
    for key in [(0,), (1, 2, 3), (7, 0, 1, 99, 3)]:
        out = explore(d, core, k_e, key)
        check_explore(d, core, k_e, out)
        assert torch.equal(out, explore(d, core.clone(), k_e, key))   # deterministic
    if k_e >= d - n_core:   # complement smaller than k_e: all of it
        mask = np.ones(d, dtype=bool)
        mask[core.numpy()] = False
        assert explore(d, core, k_e, (5,)).tolist() == np.flatnonzero(mask).tolist()


def test_explore_edge_cases():
    assert explore(0, torch.empty(0, dtype=torch.int64), 5, (1,)).numel() == 0
    assert explore(10, torch.arange(3), 0, (1,)).numel() == 0
    with pytest.raises(ValueError):
        explore(10, torch.tensor([3, 2]), 2, (1,))      # unsorted core
    with pytest.raises(ValueError):
        explore(10, torch.tensor([2, 2]), 2, (1,))      # duplicate
    with pytest.raises(ValueError):
        explore(10, torch.tensor([10]), 2, (1,))        # out of range
    with pytest.raises(ValueError):
        explore(10, torch.arange(2), 2, (1, -1))        # negative key


def test_explore_keys_differ_and_rng_untouched():
    d, core = 100_000, torch.arange(0, 100_000, 7)
    np_state, torch_state = np.random.get_state()[1].copy(), torch.get_rng_state().clone()
    outs = {tuple(explore(d, core, 200, (42, 0, r, t)).tolist()) for r in range(4) for t in range(5)}
    assert len(outs) == 20
    # Keys that a naive SeedSequence would conflate stay distinct.
    assert not torch.equal(explore(d, core, 200, (1, 2)), explore(d, core, 200, (1, 2, 0)))
    assert not torch.equal(explore(d, core, 200, (2 ** 32,)), explore(d, core, 200, (0, 1)))
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_explore_golden_output():
    # Pinned output: any change to the stream or mapping breaks cross-version agreement.
    out = explore(50, torch.tensor([0, 1, 2, 10, 20, 30, 40, 49]), 6, (1234, 1, 0, 17, 2))
    assert out.tolist() == GOLDEN


GOLDEN = [11, 21, 25, 34, 46, 48]


def test_explore_golden_output_of_wide_keys_and_a_full_complement():
    # Key entries past 32 bits (two words each) and a draw of every non-core coordinate, pinned
    # from the implementation that built a fresh SeedSequence and Philox per call.
    out = explore(10 ** 6, torch.arange(0, 10 ** 6, 1000), 12,
                  (2 ** 64 - 1, 1, 2 ** 40 + 3, 2 ** 33, 7))
    assert out.tolist() == [34855, 109539, 164222, 287491, 375900, 472505, 553864, 612211,
                            672116, 736158, 830592, 960902]
    core = torch.tensor([0, 1, 2, 10, 20, 30, 40, 49])
    assert explore(50, core, 50, (3,)).tolist() == sorted(set(range(50)) - set(core.tolist()))


def test_explore_from_many_threads_matches_one_thread():
    # Each thread rekeys its own generator: concurrent draws (the communication thread and the
    # caller's) must not see each other's state.
    d, core = 200_000, torch.arange(0, 200_000, 97)
    keys = [(5, r % 2, r, t, 0) for r in range(4) for t in range(25)]
    want = [explore(d, core, 300, key) for key in keys]
    got = [None] * len(keys)

    def work(lo: int) -> None:
        for i in range(lo, len(keys), 4):
            got[i] = explore(d, core, 300, keys[i])

    threads = [threading.Thread(target=work, args=(lo,)) for lo in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _frequencies(d, core, k_e, keys):
    counts = np.zeros(d, dtype=np.int64)
    for key in keys:
        counts[explore(d, core, k_e, key).numpy()] += 1
    return counts


@pytest.mark.parametrize("d,core,k_e", [
    (30, list(range(0, 30, 3)), 8),     # complement 20 into 8 strata: widths 2 and 3
    (400, np.random.default_rng(0).choice(400, 57, replace=False).tolist(), 7),
])
def test_explore_is_uniform_over_the_complement(d, core, k_e):
    core = torch.tensor(sorted(core), dtype=torch.int64)
    m = d - core.numel()
    keys = [(9, 1, 0, t) for t in range(4000)]
    counts = _frequencies(d, core, k_e, keys)
    assert counts[core.numpy()].sum() == 0
    comp = np.delete(counts, core.numpy())
    expected = len(keys) * k_e / m
    chi2 = float(((comp - expected) ** 2 / expected).sum())
    # Multinomial chi-square has mean m - 1 (stratification only lowers it); allow 6 sigma.
    # A fixed stratum layout (picks 1/2 vs 1/3 likely) or always picking one end of a
    # stratum gives values in the thousands.
    assert chi2 < (m - 1) + 6 * np.sqrt(2 * (m - 1)), chi2
    assert (comp > 0).all()


def test_explore_picks_are_independent_within_strata():
    # Marginals alone cannot tell independent per-stratum picks from one shared offset (a
    # rotated "first element of every stratum" is uniform too). Gaps can: between independent
    # uniform picks in adjacent strata of width w the gap is triangular on (0, 2w), so an
    # eighth of the gaps fall below w/2 and an eighth above 3w/2; a shared offset gives none.
    d, k_e = 5_000, 100
    core = torch.from_numpy(np.sort(np.random.default_rng(1).choice(d, 500, replace=False)))
    comp_pos = np.cumsum(np.isin(np.arange(d), core.numpy(), invert=True)) - 1
    w = (d - core.numel()) / k_e
    gaps = np.concatenate([np.diff(comp_pos[explore(d, core, k_e, (3, t)).numpy()])
                           for t in range(300)])
    low, high = np.mean(gaps < w / 2), np.mean(gaps > 1.5 * w)
    assert abs(low - 0.125) < 0.02 and abs(high - 0.125) < 0.02, (low, high)


def test_the_candidate_scan_finds_every_hit_whether_blocks_hold_many_or_few():
    """NumpyScores' block scan (its packed search of each block's mask) gives exactly the
    indices a plain full-size search gives, over blocks of 30%, 0.05% and no hits."""
    from hvd_slim.selection.scores_numpy import _BLOCK
    rng = np.random.default_rng(5)
    parts = []
    for share in (0.3, 0.0005, 0.0, 0.0005, 0.3, 0.02):
        blk = rng.standard_normal(_BLOCK).astype(np.float32) * 0.1
        hit = rng.random(_BLOCK) < share
        blk[hit] = np.where(rng.random(hit.sum()) < 0.5, -5.0, 5.0)
        parts.append(blk)
    s = np.concatenate(parts + [rng.standard_normal(1000).astype(np.float32)])
    for magnitude in (True, False):
        scores = NumpyScores(s, magnitude)
        scored = np.abs(s) if magnitude else s
        want = np.flatnonzero(scored >= 1.0)
        idx, vals = scores.at_least(1.0)
        assert np.array_equal(idx, want) and np.array_equal(vals, scored[want])


@pytest.mark.parametrize("kind", ["normal", "ties", "one value", "sorted", "low end hidden",
                                  "sample lowest"])
def test_order_stats_of_many_candidates_are_the_full_partitions(kind):
    """NumpyScores.order_stats partitions only the low end of many candidates, bounded from a
    sample: the j-th and jw-th smallest must be the values a partition of them all gives, with
    ties, one repeated value, sorted input, a low end the strided sample misses (every small
    value off the sample's stride), and a sample holding the smallest values (the bound then
    keeps too few, and it falls back to partitioning them all)."""
    rng = np.random.default_rng(11)
    n = 200_000
    vals = {"normal": np.abs(rng.standard_normal(n)) + 1.0,
            "ties": np.round(rng.random(n) * 8) / 8 + 1.0,
            "one value": np.full(n, 3.0),
            "sorted": np.sort(rng.random(n)),
            "low end hidden": rng.random(n) + 1.0,
            "sample lowest": rng.random(n) + 1.0}[kind].astype(np.float32)
    stride = n // 4096
    if kind == "sample lowest":
        vals[stride // 2::stride] = 0.1
    if kind == "low end hidden":
        off = np.ones(n, bool)
        off[stride // 2::stride] = False
        vals[np.flatnonzero(off)[:30_000]] = 0.5   # many small values, none in the sample
    for j, jw in ((n // 11, n // 11 - 1000), (0, None), (5, 2), (n // 3, 10)):
        part = np.partition(vals, j)
        want_nxt = None if jw is None else float(np.partition(part[:j], jw)[jw])
        kth, nxt = NumpyScores.order_stats(vals, j, jw)
        assert kth == part[j] and nxt == want_nxt, (kind, j, jw)
