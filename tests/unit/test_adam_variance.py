"""Adam under Slim-DP's gradient exchange (hvd_slim/optim/inner/adam.py, ``adam_variance``, with
``adam_exchange="gradient"``): a coordinate delivered every
step is stepped exactly as by torch.optim.Adam; a burst of n summed gradients moves a parameter
about as far as n dense Adam steps (where Adam's own step on the burst moves it a few steps'
worth whatever n is); the wrapper steps the compressed parameters this way, keeps replicas and
checkpoints exact, and validates the keyword."""
from __future__ import annotations

import io
import warnings

import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.optim.inner import adam
from hvd_slim.transport import run_ranks

from test_warmup import _batch, _mlp as _net   # one tanh MLP, its initial weights made once

ADAM_KWARGS = [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, decoupled_weight_decay=True),
               dict(maximize=True), dict(amsgrad=True), dict(betas=(0.8, 0.99), eps=1e-6)]


@pytest.mark.parametrize("kw", ADAM_KWARGS, ids=lambda kw: ",".join(kw) or "plain")
def test_a_coordinate_delivered_every_step_is_stepped_as_by_torch_adam(kw):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(300))
    b = torch.nn.Parameter(a.detach().clone())
    ref, ours = torch.optim.Adam([a], lr=0.01, **kw), torch.optim.Adam([b], lr=0.01, **kw)
    for _ in range(30):
        g = torch.randn(300)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        adam.step(ours.param_groups[0], [b], ours.state)
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kw.get("amsgrad") else ()):
        assert torch.allclose(ref.state[a][key], ours.state[b][key], rtol=1e-5, atol=1e-9), key
    assert float(ours.state[b]["step"]) == 30
    assert torch.equal(ours.state[b][adam.LAST], torch.full((300,), 30, dtype=torch.int32))


def test_state_laid_out_channels_last_is_updated_in_place():
    """A conv weight in channels_last memory keeps Adam's state in that layout; the delivered
    coordinates must be found and updated by position, not by memory order."""
    torch.manual_seed(1)
    w = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ref, ours = torch.optim.Adam([a], lr=0.01), torch.optim.Adam([b], lr=0.01)
    for _ in range(5):
        g = torch.randn(4, 3, 5, 5)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        adam.step(ours.param_groups[0], [b], ours.state)
    assert ours.state[b]["exp_avg_sq"].is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert torch.allclose(ref.state[a]["exp_avg_sq"], ours.state[b]["exp_avg_sq"], rtol=1e-5)


def _movement(n: int, mode: str, lr: float = 0.01, lead: int = 2000, tail: int = 200) -> float:
    """How far one coordinate moves after ``lead`` steps of gradient 1.0 (Adam settled), when
    the next n gradients of 1.0 arrive one per step ("dense") or summed at the n-th step
    ("rescaled": stepped by optim/inner/adam.py; "live": by Adam itself), then ``tail`` steps with
    nothing."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=lr)
    burst = [1.0] * n if mode == "dense" else [0.0] * (n - 1) + [float(n)]
    start = 0.0
    for i, g in enumerate([1.0] * lead + burst + [0.0] * tail):
        p.grad = torch.full((1,), g)
        if mode == "rescaled" and i >= lead:
            adam.step(opt.param_groups[0], [p], opt.state)
        else:
            opt.step()
        if i == lead - 1:
            start = float(p.detach())
    return start - float(p.detach())


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_a_burst_of_n_steps_moves_a_parameter_as_far_as_n_dense_steps(n):
    dense, rescaled, live = (_movement(n, m) for m in ("dense", "rescaled", "live"))
    assert dense == pytest.approx(0.01 * (n + 9), rel=0.02)   # lr a step, then m's tail
    assert rescaled == pytest.approx(dense, rel=0.01)
    # Adam's own step squares the burst into its variance: a few steps' worth, whatever n is.
    if n >= 100:
        assert live < 0.4 * dense, (n, live, dense)


# --- the wrapper -------------------------------------------------------------------------------
def _loss(m: torch.nn.Module, rank: int, t: int) -> torch.Tensor:
    x, y = _batch(rank, t)
    return torch.nn.functional.cross_entropy(m(x), y)


def _wrap(m, tr, cls=torch.optim.Adam, **kw):
    kw.setdefault("adam_exchange", "gradient")   # this file tests the gradient exchange's Adam
    kw.setdefault("min_compress_numel", 1000)
    kw.setdefault("density", 0.02)
    return hvd_slim.DistributedOptimizer(cls(m.parameters(), lr=1e-3),
                                         named_parameters=m.named_parameters(), transport=tr, **kw)


@pytest.mark.parametrize("size", [2, 3])
def test_compressed_parameters_get_per_step_variance_updates_only_where_delivered(size):
    def body(rank, tr):
        m = _net()
        opt = _wrap(m, tr)
        big, small = m[0].weight, m[2].weight     # compressed (2400 >= 1000), and fused dense
        assert id(big) in opt._rescaled_params and id(small) not in opt._rescaled_params
        changed = []
        for t in range(8):
            before = opt.state[big]["exp_avg_sq"].clone() if big in opt.state else None
            opt.zero_grad()
            _loss(m, rank, t).backward()
            opt.synchronize()
            delivered = big.grad != 0
            with opt.skip_synchronize():
                opt.step()
            after = opt.state[big]["exp_avg_sq"]
            if before is not None:
                # Not delivered: untouched (bitwise); delivered: updated.
                assert torch.equal(after[~delivered], before[~delivered]), t
                changed.append(bool((after[delivered] != before[delivered]).all()))
            assert 0 < int(delivered.sum()) < big.numel()
            assert torch.equal(opt.state[big][adam.LAST][delivered],
                               torch.full_like(opt.state[big][adam.LAST][delivered], t + 1))
        assert all(changed) and adam.LAST not in opt.state[small]
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    out = run_ranks(size, body)
    assert all(torch.equal(out[0], o) for o in out[1:])


def test_live_keeps_adams_own_step_and_warm_up_steps_are_adams_own():
    def body(rank, tr, **kw):
        m = _net()
        opt = _wrap(m, tr, **kw)
        for t in range(3):
            opt.zero_grad()
            _loss(m, rank, t).backward()
            opt.step()
        return opt, m

    for opt, _ in run_ranks(2, lambda r, tr: body(r, tr, adam_variance="live")):
        assert not opt._rescaled_params
        assert all(adam.LAST not in st for st in opt.state.values())
    # Three dense warm-up steps: Adam's own step on the exact average (the state has no clock
    # yet); the single-process reference averages the two ranks' gradients.
    got = run_ranks(2, lambda r, tr: body(r, tr, warmup_dense_steps=3))
    assert all(adam.LAST not in st for st in got[0][0].state.values())
    ref = _net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for t in range(3):
        ref_opt.zero_grad()
        (sum(_loss(ref, r, t) for r in range(2)) / 2).backward()
        ref_opt.step()
    for a, b in zip(got[0][1].parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def resumed_or_not(make, steps: int, split: int):
    """Every rank's parameters after ``steps`` steps of ``make(tr)`` (a model and its wrapped
    optimizer) at 2 ranks, uninterrupted and with a checkpoint at step ``split`` round-tripped
    through a ``weights_only`` file into a fresh model and optimizer."""
    def body(rank, tr, split):
        m, opt = make(tr)
        for t in range(steps):
            if t == split:
                buf = io.BytesIO()
                torch.save((m.state_dict(), opt.state_dict()), buf)
                buf.seek(0)
                sd_m, sd_o = torch.load(buf, weights_only=True)
                m, opt = make(tr)
                m.load_state_dict(sd_m)
                opt.load_state_dict(sd_o)
            opt.zero_grad()
            _loss(m, rank, t).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    return (run_ranks(2, lambda r, tr: body(r, tr, -1)),
            run_ranks(2, lambda r, tr: body(r, tr, split)))


def _adamw(tr):
    m = _net()
    return m, _wrap(m, tr, cls=torch.optim.AdamW)


def test_checkpoint_resumes_bitwise_and_loads_from_weights_only_files():
    a, b = resumed_or_not(_adamw, 6, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_checkpoint_from_before_the_new_config_fields_still_loads():
    def body(rank, tr):
        m = _net()
        opt = _wrap(m, tr, cls=torch.optim.SGD)
        opt.zero_grad()
        _loss(m, rank, 0).backward()
        opt.step()
        sd = opt.state_dict()
        for key in ("adam_variance", "momentum_masking"):   # as version 2 wrote it before
            del sd["hvd_slim"]["config"][key]
        opt.load_state_dict(sd)
        return True

    assert all(run_ranks(2, body))


# --- validation --------------------------------------------------------------------------------
def test_bad_adam_variance_is_refused_naming_the_field_or_variable():
    with pytest.raises(ConfigError, match="adam_variance must be one of") as info:
        SlimConfig(adam_variance="frozen")
    assert info.value.field == "adam_variance"
    with pytest.raises(ConfigError, match="HVD_SLIM_ADAM_VARIANCE"):
        resolve_config({}, {"HVD_SLIM_ADAM_VARIANCE": "sometimes"})
    assert resolve_config({}, {"HVD_SLIM_ADAM_VARIANCE": " Live "}).adam_variance == "live"


def test_rescaled_needs_adam_and_says_so():
    def body(rank, tr):
        m = _net()
        with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW, got SGD"):
            _wrap(m, tr, cls=torch.optim.SGD, adam_variance="rescaled")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = _wrap(m, tr, cls=torch.optim.SGD)   # auto: nothing to do for SGD
        return opt._rescaled_params

    assert run_ranks(2, body) == [set(), set()]


class _MyAdam(torch.optim.Adam):
    """A user's Adam whose step may differ from torch's."""


def test_auto_leaves_an_adam_subclass_alone_and_rescaled_opts_in():
    def body(rank, tr):
        auto = _wrap(_net(), tr, cls=_MyAdam)
        explicit = _wrap(_net(), tr, cls=_MyAdam, adam_variance="rescaled")
        plain = _wrap(_net(), tr, cls=torch.optim.AdamW)
        return bool(auto._rescaled_params), bool(explicit._rescaled_params), \
            bool(plain._rescaled_params)

    assert run_ranks(2, body) == [(False, True, True)] * 2
