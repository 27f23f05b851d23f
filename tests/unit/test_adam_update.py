"""Adam and AdamW exchanging their update (hvd_slim/optim/inner/adam_update.py, ``adam_exchange``):
each rank's own moments on its own gradient, the average of the ranks' updates applied as a
parameter delta; checked against a single-process reference of N ranks, for bitwise replicas,
speculation (a skipped step leaves the moments alone), checkpoints, flush and the keyword's
resolution and validation."""
from __future__ import annotations

import logging

import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.transport import FakeCluster, run_ranks

from test_adam_variance import resumed_or_not
from test_warmup import _batch, _mlp as _net   # one tanh MLP, its initial weights made once

LR, WD = 1e-2, 0.1


def _loss(m: torch.nn.Module, rank: int, t: int) -> torch.Tensor:
    x, y = _batch(rank, t)
    return torch.nn.functional.cross_entropy(m(x), y)


def _wrap(m, tr, cls=torch.optim.AdamW, opt_kw=None, **kw):
    kw.setdefault("min_compress_numel", 1000)
    kw.setdefault("density", 0.02)
    kw.setdefault("value_bits", 8)   # both modes alike (the update exchange's default is 2)
    inner = cls(m.parameters(), lr=LR, **dict({"weight_decay": WD}, **(opt_kw or {})))
    return hvd_slim.DistributedOptimizer(inner, named_parameters=m.named_parameters(),
                                         transport=tr, **kw)


def _flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _train(rank, tr, steps, **kw):
    m = _net()
    opt = _wrap(m, tr, **kw)
    for t in range(steps):
        opt.zero_grad()
        _loss(m, rank, t).backward()
        opt.step()
    return m, opt


def _reference(size: int, steps: int, decoupled: bool, b1=0.9, b2=0.999, eps=1e-8):
    """A single-process simulation of ``size`` ranks with exact exchanges: each rank's own
    moments m, v of its gradient and w, the slow average of m_hat^2; its update
    lr * m_hat / (sqrt((v / N + (1 - 1/N) * w) / bc2) + eps); the parameters move by the
    ranks' average update after AdamW's decoupled decay (Adam: L2 decay in each gradient).
    The small tensors: one shared Adam on the average gradient."""
    ref = _net()
    big = ref[0].weight          # compressed (2400 >= 1000); the rest is one dense bucket
    others = [p for p in ref.parameters() if p is not big]
    shared = (torch.optim.AdamW if decoupled else torch.optim.Adam)(others, lr=LR,
                                                                    weight_decay=WD)
    m, v, w = ([torch.zeros_like(big) for _ in range(size)] for _ in range(3))
    for t in range(1, steps + 1):
        grads = []
        for r in range(size):
            ref.zero_grad()
            _loss(ref, r, t - 1).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            moved = []
            for r in range(size):
                g = grads[r][0] if decoupled else grads[r][0] + WD * big
                m[r] = b1 * m[r] + (1 - b1) * g
                v[r] = b2 * v[r] + (1 - b2) * g * g
                mh = m[r] / (1 - b1 ** t)
                w[r] = b2 * w[r] + (1 - b2) * mh * mh
                est = (v[r] / size + (1 - 1 / size) * w[r]) / (1 - b2 ** t)
                moved.append(LR * mh / (est.sqrt() + eps))
            if decoupled:
                big.mul_(1 - LR * WD)
            big.sub_(sum(moved) / size)
        for i, p in enumerate(others, start=1):
            p.grad = sum(g[i] for g in grads) / size
        shared.step()
    return _flat(ref)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("size", [2, 3])
def test_an_exact_exchange_averages_the_ranks_updates(size, cls):
    """Dense warm-up steps (exact) against the single-process reference above."""
    steps = 4
    got = run_ranks(size, lambda r, tr: _flat(_train(r, tr, steps, cls=cls,
                                                     warmup_dense_steps=steps)[0]))
    ref = _reference(size, steps, cls is torch.optim.AdamW)
    for out in got:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(got[0], o) for o in got[1:])


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_one_rank_steps_as_torch_adam(cls):
    """At N = 1 the estimate is Adam's own second moment: the compressed tensor moves as
    torch's Adam moves it (the exchange exact: dense warm-up steps)."""
    steps = 5
    got = run_ranks(1, lambda r, tr: _flat(_train(r, tr, steps, cls=cls,
                                                  warmup_dense_steps=steps)[0]))[0]
    ref = _net()
    opt = cls(ref.parameters(), lr=LR, weight_decay=WD)
    for t in range(steps):
        opt.zero_grad()
        _loss(ref, 0, t).backward()
        opt.step()
    assert torch.allclose(got, _flat(ref), rtol=1e-5, atol=1e-6)


def test_density_one_is_dense_adam_on_the_average_gradient():
    """density=1.0 sends every bucket dense: nothing is compressed, so the wrapped Adam steps
    everything on the exact average, as dense data parallelism does."""
    def body(rank, tr):
        m, opt = _train(rank, tr, 3, density=1.0)
        assert opt._adam.buckets == []
        return _flat(m)

    got = run_ranks(2, body)
    ref = _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for t in range(3):
        opt.zero_grad()
        (sum(_loss(ref, r, t) for r in range(2)) / 2).backward()
        opt.step()
    assert torch.allclose(got[0], _flat(ref), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("size", [2, 3])
def test_replicas_stay_bitwise_identical_and_the_update_is_what_travels(size):
    def body(rank, tr):
        m, opt = _train(rank, tr, 12)
        assert opt.slim_config.adam_exchange == "update"
        # Adam's own state holds nothing for the compressed tensor: its moments are hvd_slim's.
        assert "exp_avg" not in opt.state.get(m[0].weight, {})
        assert "exp_avg" in opt.state[m[2].weight]
        st = opt.state_dict()["hvd_slim_adam"]
        return _flat(m), st["exp_avg"][0], st["steps"]

    out = run_ranks(size, body)
    assert all(torch.equal(out[0][0], o[0]) for o in out[1:])
    # Each rank's moments are its own: they differ across ranks.
    assert not torch.equal(out[0][1], out[1][1])
    assert out[0][2] == [[12]]


def test_a_step_every_rank_skips_leaves_the_moments_as_they_were():
    def body(rank, tr):
        m = _net()
        opt = _wrap(m, tr)
        for t in range(3):
            opt.zero_grad()
            _loss(m, rank, t).backward()
            opt.step()
        before = opt.state_dict()
        params = _flat(m)
        opt.zero_grad()
        _loss(m, rank, 3).backward()
        if rank == 1:
            m[0].weight.grad[0, 0] = float("nan")
        opt.step()
        after = opt.state_dict()
        assert opt.comm_stats()["skipped_steps"] == 1
        for key in ("exp_avg", "exp_avg_sq", "mean_sq"):
            assert torch.equal(before["hvd_slim_adam"][key][0], after["hvd_slim_adam"][key][0])
        assert before["hvd_slim_adam"]["steps"] == after["hvd_slim_adam"]["steps"]
        assert torch.equal(params, _flat(m))
        return True

    assert all(run_ranks(2, body))


@pytest.mark.parametrize("split", [2, 5])
def test_checkpoint_resumes_bitwise_through_a_weights_only_file(split):
    def make(tr):
        m = _net()
        return m, _wrap(m, tr)

    a, b = resumed_or_not(make, 8, split)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_checkpoints_across_modes_are_refused_naming_the_keyword():
    def body(rank, tr):
        _, update = _train(rank, tr, 2)
        _, gradient = _train(rank, tr, 2, adam_exchange="gradient")
        with pytest.raises(ValueError, match="'adam_exchange': 'update' in the checkpoint vs. "
                                             "'gradient' now"):
            _wrap(_net(), tr, adam_exchange="gradient").load_state_dict(update.state_dict())
        with pytest.raises(ValueError, match="'adam_exchange': 'gradient' in the checkpoint"):
            _wrap(_net(), tr).load_state_dict(gradient.state_dict())
        # The moments alone (the exchange's entry dropped) are refused by a gradient optimizer,
        # and a damaged entry changes nothing.
        sd = update.state_dict()
        del sd["hvd_slim"]
        with pytest.raises(ValueError, match="Resume with the same adam_exchange"):
            _wrap(_net(), tr, adam_exchange="gradient").load_state_dict(sd)
        fresh = _wrap(_net(), tr)
        before = fresh.state_dict()
        bad = update.state_dict()
        bad["hvd_slim_adam"]["exp_avg"] = [torch.zeros(7)]
        with pytest.raises(ValueError, match="exp_avg does not match"):
            fresh.load_state_dict(bad)
        assert torch.equal(before["hvd_slim_adam"]["exp_avg"][0],
                           fresh.state_dict()["hvd_slim_adam"]["exp_avg"][0])
        return True

    assert all(run_ranks(2, body))


def test_flush_applies_every_residual_without_a_second_decay():
    def body(rank, tr):
        m, opt = _train(rank, tr, 5)
        held = opt._exchange.residual_norm()
        before = _flat(m)
        opt.flush()
        assert held > 0 and opt._exchange.residual_norm() == 0
        return before, _flat(m), held

    out = run_ranks(2, body)
    assert torch.equal(out[0][1], out[1][1])
    # A flush moves the parameters by the residuals only: the dense bucket does not move, and
    # no decay is applied (the small tensors, sent whole, hold no residual).
    m = _net()
    small = m[0].weight.numel()
    assert torch.equal(out[0][0][small:], out[0][1][small:])


def test_after_an_explicit_synchronize_step_applies_the_update_as_delivered(caplog):
    """A GradScaler's unscale_ or a clip between synchronize() and step() changes p.grad, not
    the update step() applies; it is logged once."""
    def body(rank, tr, touch):
        m = _net()
        opt = _wrap(m, tr)
        for t in range(4):
            opt.zero_grad()
            _loss(m, rank, t).backward()
            opt.synchronize()
            if touch:   # the compressed tensor's (a clip of the others changes their path)
                torch.nn.utils.clip_grad_norm_([m[0].weight], 1e-6)
            with opt.skip_synchronize():
                opt.step()
        return _flat(m)

    from hvd_slim.optim.inner.adam_update import CHANGED_AFTER_SYNC
    plain = run_ranks(2, lambda r, tr: body(r, tr, False))
    CHANGED_AFTER_SYNC.given = False   # once a process: another test may have given it
    with caplog.at_level(logging.WARNING, logger="hvd_slim"):
        clipped = run_ranks(2, lambda r, tr: body(r, tr, True))
    assert torch.equal(plain[0], clipped[0]) and torch.equal(plain[1], clipped[1])
    named = [m for m in caplog.messages if "changed between synchronize() and step()" in m]
    assert len(named) == 1, caplog.messages   # once, though two ranks (threads) saw it


# --- the keyword -------------------------------------------------------------------------------
class _MyAdam(torch.optim.AdamW):
    """A user's AdamW whose step may differ from torch's."""


def test_a_changed_gradient_is_told_from_a_sample_of_it():
    """altered() compares a strided sample of a large gradient: a norm clip (every value
    scaled) or an unexpected unscale is seen, an expected unscale or nothing is not; a clip
    by value that changed no sampled value goes unseen (the documented miss)."""
    from hvd_slim.optim.inner.adam_update import CHECKED, altered
    gen = torch.Generator().manual_seed(0)
    delivered = torch.randn(16, CHECKED * 3 // 16, generator=gen)   # 3x the sample, 2-D
    delivered[torch.rand(delivered.shape, generator=gen) < 0.8] = 0   # a sparse delivery
    scale = 2.0 ** 12
    assert not altered(delivered.clone(), delivered, 1.0)
    assert altered(delivered * 0.5, delivered, 1.0)                  # clip_grad_norm_
    assert not altered(delivered / scale, delivered, scale)          # the expected unscale_
    assert altered(delivered / scale, delivered, 1.0)                # an unscale not told of
    assert altered(delivered * 0.5 / scale, delivered, scale)        # unscaled, then clipped
    off = delivered.clone()
    flat = off.view(-1)
    flat[1] = 1e3   # stride 3: position 1 is outside the sample
    assert not altered(off, delivered, 1.0)
    flat[3] = 1e3
    assert altered(off, delivered, 1.0)


def test_auto_resolves_by_optimizer_and_logs_why_it_keeps_the_gradient(caplog):
    tr = FakeCluster(1).transport(0)
    assert _wrap(_net(), tr).slim_config.adam_exchange == "update"
    assert _wrap(_net(), tr, cls=torch.optim.Adam).slim_config.adam_exchange == "update"
    sgd = hvd_slim.DistributedOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1),
                                        transport=tr)
    assert sgd.slim_config.adam_exchange == "gradient"
    with caplog.at_level(logging.INFO, logger="hvd_slim"):
        assert _wrap(_net(), tr, cls=_MyAdam).slim_config.adam_exchange == "gradient"
        assert "_MyAdam subclasses torch's Adam" in caplog.text
        assert _wrap(_net(), tr, opt_kw={"amsgrad": True}).slim_config.adam_exchange == \
            "gradient"
        assert "amsgrad=True" in caplog.text
        assert _wrap(_net(), tr, overlap=2).slim_config.adam_exchange == "gradient"
        assert _wrap(_net(), tr, local_steps=4).slim_config.adam_exchange == "gradient"
    # Asked for explicitly, a subclass gets torch's Adam step.
    assert _wrap(_net(), tr, cls=_MyAdam, adam_exchange="update").slim_config.adam_exchange \
        == "update"


def test_update_that_cannot_be_served_is_refused_naming_the_keyword(monkeypatch):
    tr = FakeCluster(1).transport(0)
    with pytest.raises(ValueError, match="adam_exchange='update' needs torch.optim.Adam or "
                                         "AdamW, got SGD"):
        hvd_slim.DistributedOptimizer(torch.optim.SGD(_net().parameters(), lr=0.1),
                                      transport=tr, adam_exchange="update")
    with pytest.raises(ValueError, match="amsgrad=True .* Pass adam_exchange='gradient'"):
        _wrap(_net(), tr, opt_kw={"amsgrad": True}, adam_exchange="update")
    monkeypatch.setenv("HVD_SLIM_ADAM_EXCHANGE", "update")
    with pytest.raises(ValueError, match="overlap > 1 .*from environment variable "
                                         "HVD_SLIM_ADAM_EXCHANGE"):
        _wrap(_net(), tr, overlap=2)


def test_the_variable_and_bad_values():
    assert resolve_config({}, {"HVD_SLIM_ADAM_EXCHANGE": " Gradient "}).adam_exchange == \
        "gradient"
    with pytest.raises(ConfigError, match="HVD_SLIM_ADAM_EXCHANGE") as info:
        resolve_config({}, {"HVD_SLIM_ADAM_EXCHANGE": "sometimes"})
    assert info.value.field == "adam_exchange"
    with pytest.raises(ConfigError, match="adam_exchange must be one of"):
        SlimConfig(adam_exchange="momentum")


def test_ranks_that_exchange_different_things_are_named_at_the_handshake():
    def body(rank, tr):
        m = _net()
        opt = _wrap(m, tr, adam_exchange="gradient" if rank == 1 else "auto")
        opt.zero_grad()
        _loss(m, rank, 0).backward()
        with pytest.raises(Exception, match="adam_exchange"):
            opt.step()
        return True

    assert all(run_ranks(2, body))


def test_the_update_exchange_has_its_own_defaults_where_the_user_set_none(monkeypatch):
    tr = FakeCluster(1).transport(0)

    def build(cls=torch.optim.AdamW, **kw):
        m = _net()
        return hvd_slim.DistributedOptimizer(cls(m.parameters(), lr=LR),
                                             named_parameters=m.named_parameters(),
                                             transport=tr, **kw).slim_config

    cfg = build()
    assert (cfg.adam_exchange, cfg.density, cfg.value_bits, cfg.pull_value_bits) == \
        ("update", 0.05, 2, 8)
    assert cfg.pull_density == 0.2 == cfg.effective_pull_density   # 4x the push
    assert build(density=0.1).pull_density == 0.4 and build(density=0.5).pull_density == 1.0
    assert build(pull_density=0.06).pull_density == 0.06
    assert build(torch.optim.SGD).pull_value_bits is None
    assert build(torch.optim.SGD).pull_density is None
    assert build(torch.optim.SGD).density == 0.02 and build(torch.optim.SGD).value_bits == 8
    assert build(adam_exchange="gradient").density == 0.02
    assert (build(value_bits=8).density, build(value_bits=8).value_bits) == (0.05, 8)
    monkeypatch.setenv("HVD_SLIM_DENSITY", "0.01")
    cfg = build()
    assert (cfg.density, cfg.value_bits, cfg.pull_density) == (0.01, 2, 0.04)
    monkeypatch.setenv("HVD_SLIM_PULL_DENSITY", "0.03")
    assert build().pull_density == 0.03
    monkeypatch.delenv("HVD_SLIM_PULL_DENSITY")
    assert cfg.env_note("density") == " (from environment variable HVD_SLIM_DENSITY)"


def _train_amp(rank, tr, steps, scaled, tell, cls=torch.optim.AdamW):
    """Horovod's AMP order (scaled backward, synchronize(), unscale_, step under
    skip_synchronize()) with a GradScaler whose scale doubles every step; ``tell``: the
    optimizer is given the scaler (set_grad_scaler)."""
    m = _net()
    opt = _wrap(m, tr, cls=cls)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1,
                                  enabled=scaled)
    if tell:
        opt.set_grad_scaler(scaler)
    for t in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(m, rank, t)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return _flat(m), scaler.get_scale()


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("size", [2, 3])
def test_a_grad_scaler_changing_its_scale_leaves_adams_update_unchanged(size, cls, caplog):
    """Given the scaler, each rank's moments are of its true gradient: a scale doubling at every
    step (a power of two, so exactly divided out) gives the run without a scaler, bit for bit,
    sliced and with Adam's L2 decay joining the true gradient. Not given it, the scale enters
    the moments and the runs part."""
    from hvd_slim.optim.inner.adam_update import CHANGED_AFTER_SYNC
    steps = 8
    plain = run_ranks(size, lambda r, tr: _train_amp(r, tr, steps, False, False, cls))
    CHANGED_AFTER_SYNC.given = False
    with caplog.at_level(logging.WARNING, logger="hvd_slim"):
        told = run_ranks(size, lambda r, tr: _train_amp(r, tr, steps, True, True, cls))
    # Its unscale_ between synchronize() and step() was expected: nothing logged
    assert "changed between synchronize() and step()" not in caplog.text
    untold = run_ranks(size, lambda r, tr: _train_amp(r, tr, steps, True, False, cls))
    assert told[0][1] == 2.0 ** 18   # the scale really changed, step after step
    for r in range(size):
        assert torch.equal(told[r][0], plain[r][0])
    assert not torch.equal(untold[0][0], plain[0][0])


def test_set_grad_scaler_takes_a_grad_scaler_only():
    opt = run_ranks(1, lambda r, tr: _wrap(_net(), tr))[0]
    with pytest.raises(TypeError, match="set_grad_scaler: scaler must be a torch.amp.GradScaler"):
        opt.set_grad_scaler(2.0 ** 16)
    opt.set_grad_scaler(None)
