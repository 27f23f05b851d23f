"""A GradScaler told to the exchange (``set_grad_scaler``) where gradients travel: residuals and
velocities are kept in true units (hvd_slim/exchange/loss_scale.py), so a scale that changes at
every step gives, bit for bit, the run without a scaler, and ``flush()`` applies true units. The
handshake names a rank that told none, a checkpoint says whether one was told, and the scaler
cannot be given or taken away once the residuals hold something."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.ddp import SlimState
from hvd_slim.exchange.errors import ExchangeError
from hvd_slim.transport import run_ranks

from test_adam_update import _flat, _loss, _net, _wrap
from test_ddp_adam import make_params
from test_ddp_state import BUCKETS, REBUCKETED, iterate

SGD = {"cls": torch.optim.SGD, "opt_kw": {"momentum": 0.9, "weight_decay": 1e-4}}


def _scaler(on: bool) -> torch.amp.GradScaler:
    # growth_interval=1: the scale doubles at every step, so residuals left at one scale meet
    # gradients at another at every step
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1, enabled=on)


def _train(rank, tr, steps, scaled, tell, flush=False, kw=None, save=None, load=None,
           inf_at=None, keep=False):
    """Horovod's AMP order; ``tell``: the optimizer is given the scaler; ``inf_at``: a step
    whose gradient overflows on the last rank (every rank skips it; a scaler backs off).
    Returns the parameters after the steps (and after a flush), the last scale, and
    (``save``) the optimizer's and scaler's states to resume from; ``keep``: also the layout."""
    m = _net()
    opt = _wrap(m, tr, **dict(SGD, **(kw or {})))
    scaler = _scaler(scaled)
    if tell:
        opt.set_grad_scaler(scaler)
    first = 0
    if load is not None:
        opt.load_state_dict(load[rank]["opt"])
        scaler.load_state_dict(load[rank]["scaler"])
        m.load_state_dict(load[rank]["model"])
        first = load[rank]["t"]
    for t in range(first, first + steps):
        opt.zero_grad()
        scaler.scale(_loss(m, rank, t)).backward()
        if t == inf_at and rank == tr.size - 1:
            next(m.parameters()).grad.view(-1)[0] = float("inf")
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    if save:
        return {"opt": opt.state_dict(), "scaler": scaler.state_dict(), "t": first + steps,
                "model": {k: v.clone() for k, v in m.state_dict().items()}}
    stepped = _flat(m).clone()
    if flush:
        opt.flush()
    if keep:
        return stepped, _flat(m), scaler.get_scale(), opt._layout
    return stepped, _flat(m), scaler.get_scale()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("kw", [{}, {"momentum_correction": False}, {"overlap": 2},
                                {"gradient_predivide_factor": 2.0}],
                         ids=["momentum-correction", "plain-residual", "overlap", "predivide"])
def test_a_told_scaler_gives_the_run_without_one_and_its_flush(size, kw):
    steps = 7
    plain = run_ranks(size, lambda r, tr: _train(r, tr, steps, False, False, True, kw))
    told = run_ranks(size, lambda r, tr: _train(r, tr, steps, True, True, True, kw))
    assert told[0][2] == 2.0 ** (10 + steps)   # the scale changed at every step
    for r in range(size):
        assert torch.equal(told[r][0], plain[r][0]), r   # the steps
        assert torch.equal(told[r][1], plain[r][1]), r   # and the flush after them
    # Not told, the residuals mix scales and the flush applies them at the loss scale
    untold = run_ranks(size, lambda r, tr: _train(r, tr, steps, True, False, True, kw))
    assert not torch.equal(untold[0][0], plain[0][0])
    flushed = [(run[0][1] - run[0][0]).abs().max() for run in (plain, untold)]
    assert flushed[1] > 100 * flushed[0]


def test_the_warm_up_settles_on_the_true_units_of_what_was_delivered():
    """warmup_settle ends the warm-up's hold on the norm of what each step delivered: told a
    scale, that is the norm of the pull in true units, so the hold ends where the run without
    a scaler's does (step 10 here), not never, as the doubling scale's norms would have it."""
    kw = {"density": 0.02, "warmup_settle": 0.9}

    def body(rank, tr, scaled):
        got = _train(rank, tr, 24, scaled, scaled, kw=kw, keep=True)
        return got[0], got[3].schedule.settled_at
    plain = run_ranks(2, lambda r, tr: body(r, tr, False))
    told = run_ranks(2, lambda r, tr: body(r, tr, True))
    assert plain[0][1] == told[0][1] == 10
    assert all(torch.equal(told[r][0], plain[r][0]) for r in range(2))


def test_a_scaler_backing_off_after_an_overflow_changes_nothing_either():
    """An overflow on one rank: every rank skips the step and the scaler halves its scale
    (after doubling twice); the run is still the run without a scaler, which skips it too."""
    plain = run_ranks(3, lambda r, tr: _train(r, tr, 6, False, False, True, inf_at=2))
    told = run_ranks(3, lambda r, tr: _train(r, tr, 6, True, True, True, inf_at=2))
    assert told[0][2] == 2.0 ** (10 + 5 - 1)   # 5 growths, one halving
    for r in range(3):
        assert torch.equal(told[r][0], plain[r][0]) and torch.equal(told[r][1], plain[r][1])


def test_a_checkpoint_resumes_bitwise_and_says_whether_a_scaler_was_told():
    unbroken = run_ranks(2, lambda r, tr: _train(r, tr, 6, True, True))
    saved = run_ranks(2, lambda r, tr: _train(r, tr, 3, True, True, save=True))
    resumed = run_ranks(2, lambda r, tr: _train(r, tr, 3, True, True, load=saved))
    for r in range(2):
        assert torch.equal(resumed[r][0], unbroken[r][0])
    assert saved[0]["opt"]["hvd_slim_scaled"] is True
    with pytest.raises(RuntimeError, match="saved with a GradScaler given to "
                                           "set_grad_scaler.*this optimizer has none"):
        run_ranks(2, lambda r, tr: _train(r, tr, 1, True, False, load=saved))


def test_ranks_that_differ_on_a_scaler_are_named_at_the_first_step():
    def body(rank, tr):
        with pytest.raises(ExchangeError, match="Config field 'set_grad_scaler': 'given' on "
                                                "rank 0 vs. '<unset>' on rank 1.*give "
                                                r"set_grad_scaler\(\) a GradScaler on every"):
            _train(rank, tr, 1, True, rank == 0)
        return True
    assert run_ranks(2, body) == [True, True]


def test_a_scaler_is_given_or_taken_away_before_the_first_step_only():
    def body(rank, tr):
        m = _net()
        opt = _wrap(m, tr, **SGD)
        opt.set_grad_scaler(_scaler(True))
        opt.set_grad_scaler(None)          # before the first step: anything goes
        with pytest.raises(TypeError, match="set_grad_scaler: scaler must be a torch.amp"):
            opt.set_grad_scaler(2.0 ** 16)
        opt.set_grad_scaler(_scaler(True))
        opt.zero_grad()
        _loss(m, rank, 0).backward()
        opt.step()
        opt.set_grad_scaler(_scaler(True))   # one scaler for another
        with pytest.raises(RuntimeError, match="only before the first step"):
            opt.set_grad_scaler(None)
        return True
    assert run_ranks(2, body) == [True, True]


# --- the DDP hook, gradients travelling ------------------------------------------------------
def _hook_run(size, steps, scaled, tell, buckets=BUCKETS, then=REBUCKETED):
    """SGD with momentum through the hook (no optimizer given: gradients travel); DDP's
    buckets laid out again after the first pass (``then``), so what the first exchanges held
    is carried into the new ones."""
    def body(rank, tr):
        params = make_params()
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        state = SlimState(transport=tr, density=0.05)
        scaler = _scaler(scaled)
        if tell:
            assert state.set_grad_scaler(scaler) is state
        for t in range(steps):
            scale = float(scaler.scale(torch.ones(()))) if scaled else 1.0
            iterate(state, params, rank, t, buckets=buckets if t == 0 else then, scale=scale)
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in params], state.state_dict()
    return run_ranks(size, body, timeout=60)


@pytest.mark.parametrize("size", [2, 3])
def test_the_hook_told_a_scaler_gives_the_run_without_one(size):
    plain, told = _hook_run(size, 6, False, False), _hook_run(size, 6, True, True)
    untold = _hook_run(size, 6, True, False)
    for r in range(size):
        assert all(torch.equal(a, b) for a, b in zip(told[r][0], plain[r][0])), r
    assert not all(torch.equal(a, b) for a, b in zip(untold[0][0], plain[0][0]))
    assert told[0][1]["scaled"] is True and plain[0][1]["scaled"] is False


def test_the_hooks_checkpoint_and_late_scaler_are_refused_by_name():
    saved = _hook_run(1, 2, True, True)[0][1]
    state = SlimState(density=0.05)
    with pytest.raises(ValueError, match="saved with a GradScaler given to set_grad_scaler"):
        state.load_state_dict(saved)
    state.set_grad_scaler(_scaler(True))
    state.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="only before the first backward pass"):
        state.set_grad_scaler(None)
    state.set_grad_scaler(_scaler(True))   # one scaler for another


def test_the_scale_is_read_again_whenever_the_scaler_changed_it():
    """LossScale keeps the value it read (a read waits for the GPU on CUDA) until the scaler's
    scale tensor changes: update() growing or backing off, a loaded state, another scaler."""
    from hvd_slim.exchange.loss_scale import LossScale
    held, scaler = LossScale(), _scaler(True)
    assert held.read() == 1.0 and not held.told
    held.scaler = scaler
    assert held.read() == 2.0 ** 10   # before the first scale(): the initial scale
    w = torch.ones(2, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    assert held.read() == 2.0 ** 10
    scaler.step(opt)
    scaler.update()
    assert held.read() == 2.0 ** 11
    scaler.update(3.0)
    assert held.read() == 3.0
    scaler.load_state_dict(dict(scaler.state_dict(), scale=64.0))
    assert held.read() == 64.0
    held.scaler = _scaler(False)   # disabled: it leaves the gradients as they are
    assert held.read() == 1.0


@pytest.mark.parametrize("hosts, per_host", [(2, 2), (3, 2)])
def test_host_first_told_a_scale_is_the_exchange_of_the_unscaled_gradients(hosts, per_host):
    """hierarchical=True: the host leaders' exchange divides the scale out of the host's sum
    and the pull, spread on the host, carries it back; unscaled, every step's delivery and the
    flush are bitwise those of the gradients never scaled, the scale changing at every step."""
    from hvd_slim.config import SlimConfig
    from hvd_slim.exchange import Layout
    from hvd_slim.exchange.hosts.hierarchy import HierarchicalExchange

    from test_exchange import grad_for
    from test_exchange import make_params as exchange_params
    from test_hierarchy import host_numbers, run_hosts
    hosts_of, steps = host_numbers(hosts, per_host), 5
    config = SlimConfig(min_compress_numel=1000, density=0.02, seed=3)

    def run(scaled):
        def fn(rank, world, local, cross):
            named = exchange_params()
            layout = Layout(named, config, lambda dt: dt)
            scaler = _scaler(True)
            scaler.scale(torch.ones(()))   # its scale tensor, for update(new_scale)
            if scaled:
                layout.loss_scale.scaler = scaler
            ex = HierarchicalExchange(layout, config, world, local, cross, hosts_of)
            out = []
            for t in range(steps):
                s = 2.0 ** (10 + (3 * t) % 7) if scaled else 1.0
                scaler.update(s)
                for name, p in named:
                    p.grad = grad_for(rank, t, name, p.shape) * s
                ex.step()
                out.append({n: p.grad / s for n, p in named})   # unscale_: exact
            for _, p in named:
                p.grad = None
            ex.flush()
            out.append({n: p.grad.clone() for n, p in named if p.grad is not None})
            return out
        return run_hosts(hosts_of, fn)

    plain, told = run(False), run(True)
    for r in range(len(hosts_of)):
        for t, (a, b) in enumerate(zip(told[r], plain[r])):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (r, t)


def test_host_first_a_failed_steps_carry_keeps_its_true_units_through_a_change_of_scale():
    """hierarchical=True with overlap: step 1 fails (stage 1's server), so stage 2's gradient
    goes to each rank's carry, at step 1's scale; the scale then changes before the carry joins
    step 2's host reduction, and again before the flush. Told the scale, every delivery and the
    flush are bitwise those of the run never scaled, and so is what each rank holds."""
    from hvd_slim.exchange.errors import ExchangeError

    from test_exchange import grad_for
    from test_exchange import make_params as exchange_params
    from test_hierarchy import held_by_name, host_numbers, run_hosts
    from test_overlap_hosts import break_server, config_of, mend_server, staged
    hosts_of = host_numbers(2, 2)
    config = config_of(op="sum", density=0.02, seed=2)

    def run(scaled):
        def fn(rank, world, local, cross):
            named = exchange_params()
            ex = staged(config, hosts_of, world, local, cross, named, threaded=False)
            scaler = _scaler(True)
            scaler.scale(torch.ones(()))   # its scale tensor, for update(new_scale)
            if scaled:
                ex.layout.loss_scale.scaler = scaler
            out = []
            for t in range(4):
                s = 2.0 ** (10 + (3 * t) % 7) if scaled else 1.0
                scaler.update(s)
                for name, p in named:
                    p.grad = grad_for(rank, t, name, p.shape) * s
                if t == 1:
                    break_server(ex, rank)
                try:
                    ex.step()
                    out.append({n: p.grad / s for n, p in named})   # unscale_: exact
                except ExchangeError:
                    out.append("failed")
                if t == 1:
                    mend_server(ex, rank)
            held = {k: v.clone() for k, v in held_by_name(ex).items()}
            scaler.update(2.0 ** 5 if scaled else 1.0)   # the flush's scale: yet another
            for _, p in named:
                p.grad = None
            ex.flush()
            out.append({n: p.grad.clone() for n, p in named if p.grad is not None})
            return out, held
        return run_hosts(hosts_of, fn)

    plain, told = run(False), run(True)
    for r in range(len(hosts_of)):
        (a_out, a_held), (b_out, b_held) = told[r], plain[r]
        assert a_out[1] == b_out[1] == "failed"
        for t, (a, b) in enumerate(zip(a_out, b_out)):
            if t != 1:
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (r, t)
        assert a_held.keys() == b_held.keys()
        assert all(torch.equal(a_held[k], b_held[k]) for k in a_held), r


def test_an_old_host_first_checkpoint_with_a_carry_is_refused_once_a_scaler_is_told():
    """Before the carry was kept in true units a checkpoint held it at its failed step's scale
    without the scale: with a GradScaler told it cannot be read, and says so; without one (the
    units were the same) it loads, as does a checkpoint that records its carry unscaled."""
    from hvd_slim.exchange.errors import ExchangeError

    from test_exchange import grad_for
    from test_exchange import make_params as exchange_params
    from test_hierarchy import host_numbers, run_hosts
    from test_overlap_hosts import break_server, config_of, mend_server, staged
    hosts_of = host_numbers(2, 2)
    config = config_of(op="sum", density=0.02, seed=2)

    def fn(rank, world, local, cross):
        named = exchange_params()
        ex = staged(config, hosts_of, world, local, cross, named, threaded=False)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
        break_server(ex, rank)
        with pytest.raises(ExchangeError):
            ex.step()
        mend_server(ex, rank)
        state = ex.state_dict()
        assert any(st["carry"] and st["carry_unscaled"] for st in state["stages"])
        old = dict(state, stages=[{k: v for k, v in st.items() if k != "carry_unscaled"}
                                  for st in state["stages"]])
        outcomes = []
        for told, saved in ((True, old), (False, old), (True, state)):
            fresh = staged(config, hosts_of, world, local, cross, exchange_params(),
                           threaded=False)
            if told:
                fresh.layout.loss_scale.scaler = _scaler(True)
            try:
                fresh.load_state_dict(saved)
                outcomes.append("loaded")
            except ValueError as exc:
                outcomes.append(str(exc))
        return outcomes

    for outcomes in run_hosts(hosts_of, fn):
        assert "carry" in outcomes[0] and "loss scale" in outcomes[0], outcomes[0]
        assert outcomes[1:] == ["loaded", "loaded"]
