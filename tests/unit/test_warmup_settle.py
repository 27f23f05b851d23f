"""``warmup_settle``: the warm-up ends on a measured signal (exchange/warmup.py). The start
densities hold while the pulled update's norm still changes by more than eta between windows,
then a decay a quarter of the count's runs; the whole never outlasts the warm-up by count.
Checked against the schedule's closed form, and on simulated ranks: every replica decides
alike (bitwise parameters, the same step), it sends no more than the count, and it resumes
bitwise from a checkpoint taken inside the hold."""
from __future__ import annotations

import math

import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.exchange.warmup import Schedule
from hvd_slim.transport import run_ranks

from test_reliability_checkpoint import assert_resume_is_bitwise, refused, trained_states
from test_reliability_mismatch import SAME, first_step_error, params, same_everywhere
from test_reliability_nonfinite import batch, flat, model

# The automatic warm-up at 0.01: S = 100 decay steps from 0.08, so windows of 10, a hold of at
# most 31 steps (its push densities then sum to the count's), and a decay of 25 after it.
CFG = dict(density=0.01, pull_density=0.02)


def _fed(schedule: Schedule, norms, first: int = 0) -> None:
    for t, n in enumerate(norms, start=first):
        schedule.observe(t, n)


def _push_sum(densities) -> float:
    return sum(d[0] for d in densities if d is not None)


def test_the_hold_ends_after_the_first_window_that_settled():
    cfg = SlimConfig(warmup_settle=0.2, **CFG)
    s = Schedule(cfg)
    assert (s.window, cfg.warmup_hold_limit, cfg.warmup_settle_decay) == (10, 31, 25)
    # 10 -> 5 moved 50%: still holding; 5 -> 4.5 moved 10%: settled after step 29.
    _fed(s, [10.0] * 10 + [5.0] * 10 + [4.5] * 10)
    assert s.settled_at == 30 and not s.observing(30)
    start = cfg.decay_densities(-1, 25)
    assert start == pytest.approx((0.08, 0.16))
    assert all(s.densities_at(t) == start for t in range(30))
    for i in range(25):   # then the count's geometric path, over 25 steps
        push, pull = s.densities_at(30 + i)
        assert push == pytest.approx(0.08 * (0.01 / 0.08) ** ((i + 1) / 26))
        assert pull == pytest.approx(0.16 * (0.02 / 0.16) ** ((i + 1) / 26))
    assert s.densities_at(55) is None and s.densities_at(500) is None


def test_a_run_that_never_settles_sends_no_more_than_the_count():
    cfg = SlimConfig(warmup_settle=0.2, **CFG)
    s = Schedule(cfg)
    _fed(s, ([1.0] * 10 + [3.0] * 10) * 2)   # every window moves 200% or 67%
    assert s.settled_at is None
    assert all(s.densities_at(t) == cfg.decay_densities(-1, 25) for t in range(31))
    assert s.densities_at(55) is not None and s.densities_at(56) is None
    held = _push_sum(s.densities_at(t) for t in range(56))
    counted = _push_sum(cfg.densities_at(t) for t in range(100))
    assert counted - 0.08 < held <= counted   # within one step's worth of the budget


def test_dense_steps_come_first_and_are_not_observed():
    cfg = SlimConfig(warmup_settle=0.5, warmup_dense_steps=3, **CFG)
    s = Schedule(cfg)
    assert [s.densities_at(t) for t in range(3)] == [(1.0, 1.0)] * 3
    assert not any(s.observing(t) for t in range(3)) and s.observing(3)
    _fed(s, [7.0] * 20, first=3)   # two equal windows: settled after step 22
    assert s.settled_at == 20 and s.densities_at(22) == cfg.decay_densities(-1, 25)
    assert s.densities_at(23) == cfg.decay_densities(0, 25)


def test_without_it_the_schedule_is_the_count():
    cfg = SlimConfig(**CFG)
    s = Schedule(cfg)
    assert all(s.densities_at(t) == cfg.densities_at(t) for t in range(45))
    assert not s.observing(0)


def test_bad_values_are_refused_naming_the_keyword_or_variable():
    for bad in (0, -0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ConfigError, match="warmup_settle") as info:
            SlimConfig(warmup_settle=bad)
        assert info.value.field == "warmup_settle"
    with pytest.raises(ConfigError, match="warmup_settle=0.5 ends a warm-up, but there is "
                                          "none.*warmup_decay_steps=None"):
        SlimConfig(warmup_settle=0.5, warmup_decay_steps=0)
    assert resolve_config({}, {"HVD_SLIM_WARMUP_SETTLE": "0.3"}).warmup_settle == 0.3
    assert resolve_config({}, {"HVD_SLIM_WARMUP_SETTLE": "none"}).warmup_settle is None
    with pytest.raises(ConfigError, match="HVD_SLIM_WARMUP_SETTLE"):
        resolve_config({}, {"HVD_SLIM_WARMUP_SETTLE": "soon"})


def test_local_steps_without_a_warm_up_refuse_it_and_say_how():
    def body(rank, tr):
        m = model()
        with pytest.raises(ConfigError, match="warmup_decay_steps is 0.*warmup_decay_steps="
                                              "None") as e:
            hvd_slim.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                transport=tr, local_steps=4, density=0.01, warmup_decay_steps=0,
                warmup_settle=0.5)
        return e.value.field
    assert run_ranks(2, body, timeout=60) == ["warmup_settle"] * 2


def _run(size, steps, **kw):
    """Every rank's parameters, the step the hold ended at, and the bytes it pushed."""
    def body(rank, tr):
        m = model()
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            named_parameters=m.named_parameters(), transport=tr, min_compress_numel=1000,
            density=0.01, warmup_decay_steps=20, **kw)
        for t in range(steps):
            x, y = batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        ex = opt._exchange
        stages = getattr(ex, "stages", [ex])
        return flat(m), [st.layout.schedule.settled_at for st in stages], \
            opt.comm_stats()["bytes_pushed"]
    return run_ranks(size, body, timeout=120)


@pytest.mark.parametrize("size, kw", [(2, {}), (3, {}), (3, {"overlap": 2}),
                                      (2, {"local_steps": 2})])
def test_every_rank_ends_the_hold_at_the_same_step_and_sends_less(size, kw):
    """(Under local_steps the exchange steps are rounds: 24 local steps are 12 of them.)"""
    steps = 24 * kw.get("local_steps", 1)   # past the count's warm-up of 20 exchange steps
    got = _run(size, steps, warmup_settle=1.0, **kw)
    counted = _run(size, steps, warmup_settle=None, **kw)   # (local steps default to 0.5)
    params0, settled0, _ = got[0]
    for p, settled, _ in got[1:]:
        assert torch.equal(p, params0) and settled == settled0
    # eta = 1: a window within 2x of the one before settles, before the hold's limit (6 of
    # S = 20 steps); without local steps the second window of 2 does, ending at step 4.
    assert all(s is not None and s <= 6 for s in settled0), settled0
    assert "local_steps" in kw or settled0 == [4] * len(settled0), settled0
    # Its push densities sum to at most the count's; the bytes follow them but for the index
    # coding and each slice's rounding: here the hold ended early (fewer bytes), or under local
    # steps at its limit (within 1% of the count's).
    for (_, _, sent), (_, _, sent_by_count) in zip(got, counted):
        assert sent < sent_by_count if settled0[0] < 6 else sent < 1.01 * sent_by_count
    assert not torch.equal(params0, counted[0][0])


def test_resume_inside_the_hold_is_bitwise(tmp_path):
    # Windows of 2 (S = 20): a checkpoint after 3 steps is half-way through the second window.
    assert_resume_is_bitwise(tmp_path, 3, 3, density=0.01, warmup_decay_steps=20,
                             warmup_settle=0.5)


def test_a_checkpoint_under_another_setting_is_refused():
    states = trained_states(warmup_settle=0.5)
    refused(states[1], r"config field 'warmup_settle': 0.5 in the checkpoint vs. None now")


def test_a_corrupt_warm_up_state_is_refused_before_anything_changes():
    states = trained_states(warmup_settle=0.5)
    bad = dict(states[1], hvd_slim=dict(states[1]["hvd_slim"], warmup={"settled_at": "x"}))
    refused(bad, "the warm-up's state", warmup_settle=0.5)


def test_the_handshake_names_a_rank_with_another_setting():
    def make(rank):
        return params(), SlimConfig(min_compress_numel=1000, density=0.01,
                                    warmup_settle=0.25 if rank == 1 else None), SAME
    msg = same_everywhere(first_step_error(3, make))
    assert "Config field 'warmup_settle': None on ranks 0, 2 vs. 0.25 on rank 1." in msg, msg


def test_the_norm_is_what_the_pull_delivered():
    """The signal is the compressed buckets' pulled ``p.grad``: the same on every rank."""
    def body(rank, tr):
        m = model()
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
            transport=tr, min_compress_numel=1000, density=0.01, warmup_settle=0.5)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.synchronize()
        layout = opt._exchange.layout
        want = math.sqrt(sum(float(s.param.grad.double().square().sum())
                             for b in layout.sparse for s in b.segments))
        return layout.delivered_norm(), want, layout.schedule.state_dict()
    got = run_ranks(2, body, timeout=60)
    assert got[0][0] == got[1][0] == got[0][1] > 0
    assert got[0][2] == got[1][2] and got[0][2]["count"] == 1
