"""``SlimState(optimizer=...)``: Adam's update through the DDP hook (hvd_slim/ddp/adam.py). Each
rank's own Adam update travels and the optimizer's step applies what was delivered: on one rank
with an exact exchange that is torch's AdamW itself, and on three the average of each rank's own
Adam update, computed here in closed form. Skipped passes leave the moments alone, a checkpoint
resumes bitwise, and what cannot be served is refused by name."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import ConfigError
from hvd_slim.ddp import SlimState
from hvd_slim.transport import run_ranks

from test_ddp_state import BUCKETS, SHAPES, grads, iterate

# Sparse buckets whose first steps are exact dense averages (of the ranks' updates).
EXACT = dict(density=0.05, warmup_dense_steps=8)


_GEN = torch.Generator().manual_seed(1)
_INIT = [torch.randn(s, generator=_GEN) * 0.1 for _, s in SHAPES]   # made once: ranks are threads


def make_params():
    return [torch.nn.Parameter(x.clone()) for x in _INIT]


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def hook_run(size, steps, state_kw, skip_at=None, save=None, load=None):
    """Each rank: the hook's passes, then the optimizer's step; returns its parameters."""
    def body(rank, tr):
        params = make_params()
        opt = adamw(params)
        state = SlimState(transport=tr, optimizer=opt, **state_kw)
        if load is not None:
            state.load_state_dict(load[rank][0])
            opt.load_state_dict(load[rank][1])
            for p, saved in zip(params, load[rank][2]):
                p.data.copy_(saved)
        first = 0 if load is None else load[rank][3]
        for t in range(first, first + steps):
            iterate(state, params, rank, t)
            opt.step()
        out = [p.detach().clone() for p in params]
        if save:
            return state.state_dict(), opt.state_dict(), out, first + steps
        return out
    return run_ranks(size, body, timeout=60)


def test_one_rank_with_an_exact_exchange_is_torchs_adamw():
    got = hook_run(1, 4, EXACT)[0]
    ref = make_params()
    opt = adamw(ref)
    for t in range(4):
        for p, g in zip(ref, grads(0, t)):
            p.grad = g
        opt.step()
    for a, b in zip(got, ref):
        assert torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-7)


def test_density_one_is_adamw_on_the_average_gradient():
    """density=1.0 sends every bucket dense: nothing travels as an update, and the optimizer's
    own AdamW steps everything on the exact average gradient, as plain DDP's does."""
    got = hook_run(2, 3, {"density": 1.0})
    ref = make_params()
    opt = adamw(ref)
    for t in range(3):
        for j, p in enumerate(ref):
            p.grad = (grads(0, t)[j] + grads(1, t)[j]) / 2
        opt.step()
    for r in range(2):
        for a, b in zip(got[r], ref):
            assert torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-7)


def test_three_ranks_apply_the_average_of_their_own_adam_updates():
    """The closed form (optim/inner/adam_update.py's docstring): each rank's Adam moments of its
    own gradient, normalised by its estimate of the average's second moment
    ``(v / N + (1 - 1/N) * w) / bc2``; every replica steps by the average of the updates. The
    biases (under min_compress_numel, sent dense) take torch's AdamW on the average gradient."""
    n, steps, lr, wd, (b1, b2), eps = 3, 3, 0.01, 0.1, (0.9, 0.999), 1e-8
    hooked = hook_run(n, steps, EXACT)
    ref = [p.detach().clone() for p in make_params()]
    dense = [j for j, p in enumerate(ref) if p.numel() < 4096]
    assert dense == [1, 3]   # the two biases; the weights' updates travel
    bias = [torch.nn.Parameter(ref[j].clone()) for j in dense]
    bias_opt = adamw(bias)
    mom = [[[torch.zeros_like(p) for _ in range(3)] for p in ref] for _ in range(n)]
    for t in range(1, steps + 1):
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        total = [torch.zeros_like(p) for p in ref]
        for r in range(n):
            for j, g in enumerate(grads(r, t - 1)):
                m, v, w = mom[r][j]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                mh = m / bc1
                w.mul_(b2).addcmul_(mh, mh, value=1 - b2)
                est = (v / n + (1 - 1 / n) * w) / bc2
                total[j] += lr * mh / (est.sqrt() + eps)
        for p, u in zip(ref, total):
            p.mul_(1 - lr * wd).sub_(u / n)
        for p, j in zip(bias, dense):
            p.grad = sum(grads(r, t - 1)[j] for r in range(n)) / n
        bias_opt.step()
        for p, j in zip(bias, dense):
            ref[j] = p.detach().clone()
    for r in range(n):
        assert all(torch.equal(a, b) for a, b in zip(hooked[r], hooked[0]))
        for a, b in zip(hooked[r], ref):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sparse_replicas_stay_identical_and_resume_bitwise():
    full = hook_run(2, 6, {"density": 0.05})
    first = hook_run(2, 3, {"density": 0.05}, save=True)
    resumed = hook_run(2, 3, {"density": 0.05}, load=first)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(full[r], full[0]))
        assert all(torch.equal(a, b) for a, b in zip(resumed[r], full[r]))


def test_a_checkpoint_of_the_format_before_is_refused_naming_it():
    """Format 1 stepped the small tensors by each rank's update; its moments do not fit."""
    saved = hook_run(1, 2, {"density": 0.05}, save=True)[0][0]
    saved["adam"]["format"] = 1
    state = SlimState(optimizer=adamw(make_params()), density=0.05)
    with pytest.raises(ValueError, match="Adam state is format 1"):
        state.load_state_dict(saved)


def test_a_skipped_pass_leaves_the_moments_alone():
    def body(rank, tr):
        params = make_params()
        opt = adamw(params)
        state = SlimState(transport=tr, optimizer=opt, density=0.05)
        iterate(state, params, rank, 0)
        opt.step()
        before = state.state_dict()["adam"]
        for p, g in zip(params, grads(rank, 1)):
            p.grad = g
        if rank == 1:
            params[2].grad[0, 0] = float("inf")
        from test_ddp_state import FakeBucket
        from hvd_slim.ddp import slim_hook
        futs = [slim_hook(state, FakeBucket(i, [params[j] for j in m], i == 1))
                for i, m in enumerate(BUCKETS)]
        assert all(bool(torch.isnan(f.wait()).all()) for f in futs)
        after = state.state_dict()["adam"]
        return all(torch.equal(before["moments"][k][x], after["moments"][k][x])
                   for k in before["moments"] for x in ("exp_avg", "exp_avg_sq"))
    assert run_ranks(2, body, timeout=60) == [True, True]


def test_what_the_update_exchange_cannot_serve_is_refused():
    params = make_params()
    with pytest.raises(ValueError, match="takes torch.optim.Adam or AdamW, got SGD"):
        SlimState(optimizer=torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="amsgrad=True"):
        SlimState(optimizer=torch.optim.Adam(params, amsgrad=True))
    with pytest.raises(ConfigError, match="adam_exchange='gradient'"):
        SlimState(optimizer=adamw(params), adam_exchange="gradient")
    with pytest.raises(ConfigError, match="pass optimizer="):
        SlimState(adam_exchange="update")
    opt = adamw(params)
    SlimState(optimizer=opt)
    with pytest.raises(ValueError, match="already serves another SlimState"):
        SlimState(optimizer=opt)


def test_the_update_exchanges_defaults_apply_unless_given():
    st = SlimState(optimizer=adamw(make_params()))
    assert (st.config.density, st.config.value_bits, st.config.adam_exchange) == (0.05, 2, "update")
    st = SlimState(optimizer=adamw(make_params()), density=0.01)
    assert (st.config.density, st.config.value_bits) == (0.01, 2)


def test_an_optimizer_given_later_is_the_optimizer_given_at_construction():
    """Lightning makes the optimizer after the strategy holding the state: set_optimizer()
    before the first pass gives bitwise the run of SlimState(optimizer=...), at the update
    exchange's defaults."""
    def body(rank, tr):
        params = make_params()
        opt = adamw(params)
        state = SlimState(transport=tr, density=0.05)
        assert state.config.adam_exchange == "gradient" and state.config.value_bits == 8
        assert state.set_optimizer(opt) is state
        assert (state.config.adam_exchange, state.config.value_bits) == ("update", 2)
        for t in range(6):
            iterate(state, params, rank, t)
            opt.step()
        return [p.detach().clone() for p in params]
    later = run_ranks(2, body, timeout=60)
    at_once = hook_run(2, 6, {"density": 0.05})
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(later[r], at_once[r]))


def test_an_optimizer_given_too_late_or_twice_is_refused_and_changes_nothing():
    params = make_params()
    with pytest.raises(RuntimeError, match="has an optimizer already"):
        SlimState(optimizer=adamw(params)).set_optimizer(adamw(make_params()))
    st = SlimState()
    with pytest.raises(ValueError, match="takes torch.optim.Adam or AdamW, got SGD"):
        st.set_optimizer(torch.optim.SGD(params, lr=0.1))
    assert st._adam is None and st.config.adam_exchange == "gradient"

    class Wrapper:   # what Accelerate's prepare() and Lightning hand back
        def __init__(self, opt):
            self.optimizer = opt
    with pytest.raises(ValueError, match="the Wrapper wrapping it: pass its .optimizer"):
        st.set_optimizer(Wrapper(adamw(params)))
    with pytest.raises(ConfigError, match="adam_exchange='gradient'"):
        SlimState(adam_exchange="gradient").set_optimizer(adamw(params))

    def body(rank, tr):
        ps = make_params()
        state = SlimState(transport=tr, density=0.05)
        iterate(state, ps, rank, 0)
        with pytest.raises(RuntimeError, match="before the first backward pass"):
            state.set_optimizer(adamw(ps))
        assert state.config.adam_exchange == "gradient"
        return state.state_dict()
    saved = run_ranks(2, body, timeout=60)
    resumed = SlimState(density=0.05)
    resumed.load_state_dict(saved[0])
    with pytest.raises(RuntimeError, match="and before load_state_dict"):
        resumed.set_optimizer(adamw(params))


def test_a_rank_that_was_not_given_the_optimizer_is_named_by_the_handshake():
    """One rank's framework callback did not run: its gradients would meet the others'
    updates. The first pass's handshake names the setting and the rank, on every rank."""
    def body(rank, tr):
        params = make_params()
        state = SlimState(transport=tr, density=0.05)
        if rank != 1:
            state.set_optimizer(adamw(params))
        with pytest.raises(Exception) as info:
            iterate(state, params, rank, 0)
        return str(info.value)
    msgs = run_ranks(3, body, timeout=60)
    assert all("adam_exchange" in m and "rank 1" in m for m in msgs), msgs


def scaled_run(size, steps, scaled, kw):
    """AdamW through the hook, with or without a GradScaler whose scale doubles every step
    (growth_interval=1): the scale a GradScaler leaves in the gradients is a power of two, so
    once the hook unscales them the two runs are the same bits."""
    def body(rank, tr):
        params = make_params()
        opt = adamw(params)
        state = SlimState(transport=tr, optimizer=opt, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        if scaled:
            assert state.set_grad_scaler(scaler) is state
        for t in range(steps):
            scale = float(scaler.scale(torch.ones(()))) if scaled else 1.0
            iterate(state, params, rank, t, scale=scale)
            if scaled:
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        return [p.detach().clone() for p in params], scale
    return run_ranks(size, body, timeout=60)


@pytest.mark.parametrize("size", [2, 3])
def test_a_grad_scaler_changing_its_scale_leaves_adams_update_unchanged(size):
    """Each rank's Adam moments are of its unscaled gradient: a GradScaler's scale (doubling
    here at every step) does not enter them, the residuals or the update."""
    kw = {"density": 0.05}
    plain, scaled = scaled_run(size, 8, False, kw), scaled_run(size, 8, True, kw)
    assert scaled[0][1] == 2.0 ** 17   # the scale really changed, step after step
    for r in range(size):
        assert all(torch.equal(a, b) for a, b in zip(scaled[r][0], plain[r][0]))


def test_set_grad_scaler_takes_a_grad_scaler_only():
    state = SlimState(optimizer=adamw(make_params()))
    with pytest.raises(TypeError, match="SlimState.set_grad_scaler: scaler must be a torch.amp"):
        state.set_grad_scaler("dynamic")
    assert state.set_grad_scaler(None) is state


def test_a_clip_after_backward_is_named_once_and_an_expected_unscale_is_not(caplog):
    """The hook exchanged each rank's Adam update in backward: a clip of p.grad afterwards does
    not reach it, and step() says so once. A GradScaler's unscale_ the state was told of is
    expected and silent."""
    from hvd_slim.ddp.adam import CHANGED_AFTER_BACKWARD

    def body(rank, tr, clip, scaled):
        params = make_params()
        opt = adamw(params)
        state = SlimState(transport=tr, optimizer=opt, density=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
        if scaled:
            state.set_grad_scaler(scaler)
        for t in range(3):
            scale = float(scaler.scale(torch.ones(()))) if scaled else 1.0
            iterate(state, params, rank, t, scale=scale)
            if scaled:
                scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 1e-3)
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        return True
    for clip, scaled, warned in ((False, True, False), (True, False, True)):
        CHANGED_AFTER_BACKWARD.given = False
        caplog.clear()
        with caplog.at_level("WARNING", logger="hvd_slim"):
            run_ranks(2, lambda r, tr: body(r, tr, clip, scaled), timeout=60)
        named = [m for m in caplog.messages if "a clip after backward does not reach" in m]
        assert len(named) == int(warned), caplog.messages   # once, though two ranks saw it
