"""``nonfinite="flag"``, the default, over N simulated ranks: a step with a NaN/Inf anywhere is
skipped by every rank exactly as ``"skip"`` skips it (bitwise a step never taken), and every
rank is handed NaN gradients, so ``torch.amp.GradScaler`` skips and backs off on every rank
alike (Horovod's mixed-precision pattern)."""
import pytest
import torch

import hvd_slim
from hvd_slim.transport import run_ranks

from test_reliability_nonfinite import assert_same, backward, batch, flat, model, snapshot, wrap


def grads(m):
    return [p.grad.detach().clone() for p in m.parameters()]


def all_nan(gs):
    return all(bool(torch.isnan(g).all()) for g in gs)


def test_the_default_is_flag_and_a_clean_run_does_not_notice_it():
    """Without a NaN/Inf, "flag" and "raise" are the same run, bit for bit."""
    def body(rank, tr, **kw):
        m = model()
        opt = wrap(m, tr, **kw)
        for t in range(4):
            opt.zero_grad()
            backward(m, rank, t)
            opt.step()
        return opt.slim_config.nonfinite, flat(m)

    default = run_ranks(2, body, timeout=60)
    raising = run_ranks(2, lambda r, tr: body(r, tr, nonfinite="raise"), timeout=60)
    assert [mode for mode, _ in default] == ["flag", "flag"]
    for (_, got), (_, ref) in zip(default, raising):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kw", [{}, {"value_bits": 1, "density": 1.0}], ids=["slices", "signs"])
def test_flag_skips_bitwise_and_hands_nan_grads_to_every_rank(kw):
    """One rank's NaN at step 3: every rank's step() returns None with parameters, residuals,
    velocities (momentum correction), selectors and step count untouched, every gradient
    is NaN on every rank, and the run equals one that never took that step; also where every
    coordinate's sign is pushed (value_bits=1), whose coding would spread a NaN to them all."""
    steps, bad = 7, 3

    def body(rank, tr, poison):
        m = model()
        opt = wrap(m, tr, **kw)
        flagged = None
        for t in range(steps):
            if not poison and t == bad:
                continue   # the reference never takes this step
            opt.zero_grad()
            backward(m, rank, t, ("0.weight", float("nan")) if poison and t == bad
                     and rank == 2 else None)
            before = snapshot(m, opt) if t == bad else None
            out = opt.step()
            if before is not None:
                assert out is None
                assert_same(before, snapshot(m, opt))
                flagged = grads(m)
        stats = opt.comm_stats()
        return flat(m), flagged, stats["skipped_steps"], stats["last_skip_reason"]

    flagged = run_ranks(3, lambda r, tr: body(r, tr, True), timeout=60)
    reference = run_ranks(3, lambda r, tr: body(r, tr, False), timeout=60)
    for (got, gs, n_skip, why), (ref, _, ref_skip, _) in zip(flagged, reference):
        assert torch.equal(got, ref)
        assert all_nan(gs) and len(gs) == len(list(model().parameters()))
        assert (n_skip, ref_skip) == (1, 0)
        assert "step 3 skipped on every rank (nonfinite='flag')" in why and "rank 2" in why


def test_a_parameter_without_gradient_gets_a_nan_one_too():
    """Every rank's gradients are the same after a flagged step, also where a rank computed
    none (a parameter outside this rank's graph)."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr)
        opt.zero_grad()
        backward(m, rank, 0, ("1.weight", float("inf")) if rank == 0 else None)
        if rank == 1:
            m[2].bias.grad = None
        opt.synchronize()
        return grads(m)

    res = run_ranks(2, body, timeout=60)
    assert all_nan(res[0]) and all_nan(res[1])


def test_the_servers_overflow_is_flagged_on_every_rank():
    """Each rank's 40000 fits float16, their sum does not: the server finds it, and every rank
    still gets NaN gradients and an untouched state."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, op=hvd_slim.Sum, compression=hvd_slim.Compression.fp16, density=1.0)
        opt.zero_grad()
        for p in m.parameters():
            p.grad = torch.full_like(p, 40000.0)
        before = snapshot(m, opt)
        assert opt.step() is None
        assert_same(before, snapshot(m, opt))
        return grads(m), opt.comm_stats()["last_skip_reason"]

    res = run_ranks(2, body, timeout=60)
    assert all(all_nan(gs) for gs, _ in res)
    assert "the server's aggregate" in res[0][1]


def amp_run(rank, tr, overflow, steps=6):
    """Horovod's GradScaler pattern; ``overflow``: the (rank, step)s whose loss overflows."""
    m = model()
    opt = wrap(m, tr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    scales, moved = [], []
    for t in range(steps):
        opt.zero_grad()
        x, y = batch(rank, t)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        if (rank, t) in overflow:
            loss = loss * 1e38   # finite, but Inf once scaled
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        before = flat(m)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(not torch.equal(before, flat(m)))
    return flat(m), scales, moved, opt.comm_stats()["skipped_steps"]


def test_grad_scaler_skips_and_backs_off_on_every_rank_alike():
    res = run_ranks(3, lambda r, tr: amp_run(r, tr, {(1, 2)}), timeout=60)
    for got, scales, moved, skipped in res:
        assert torch.equal(got, res[0][0])
        # growth_interval=2: grow after two clean steps, halve at the overflow, grow again
        assert scales == [256.0, 512.0, 256.0, 256.0, 512.0, 512.0]
        assert moved == [True, True, False, True, True, True] and skipped == 1


def test_plain_scaler_step_without_synchronize_is_refused_with_the_pattern_to_use():
    """GradScaler.step(opt) checks this rank's gradients before it calls step(), so on an
    overflow the exchange never runs: the next zero_grad() says how to call it."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        x, y = batch(rank, 0)
        scaler.scale(torch.nn.functional.cross_entropy(m(x), y) * 1e38).backward()
        scaler.step(opt)
        scaler.update()
        with pytest.raises(AssertionError) as info:
            opt.zero_grad()
        return str(info.value)

    msg = run_ranks(1, body, timeout=60)[0]
    assert "optimizer.synchronize(); scaler.unscale_(optimizer)" in msg
    assert "with optimizer.skip_synchronize(): scaler.step(optimizer)" in msg


def test_resume_from_raise_to_the_default_equals_an_uninterrupted_run():
    """nonfinite may change on resume: 3 steps under "raise", saved; resumed under the default
    with a NaN at step 4, the run equals an uninterrupted default one bit for bit."""
    poison = ("0.weight", float("nan"))

    def uninterrupted(rank, tr):
        m = model()
        opt = wrap(m, tr)
        for t in range(6):
            opt.zero_grad()
            backward(m, rank, t, poison if (rank, t) == (1, 4) else None)
            opt.step()
        return flat(m)

    def resumed(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite="raise")
        for t in range(3):
            opt.zero_grad()
            backward(m, rank, t)
            opt.step()
        saved = opt.state_dict(), m.state_dict()
        m2 = model()
        m2.load_state_dict(saved[1])
        opt2 = wrap(m2, tr)
        opt2.load_state_dict(saved[0])
        for t in range(3, 6):
            opt2.zero_grad()
            backward(m2, rank, t, poison if (rank, t) == (1, 4) else None)
            opt2.step()
        return flat(m2), opt2.comm_stats()["skipped_steps"]

    ref = run_ranks(2, uninterrupted, timeout=60)
    for (got, skipped), want in zip(run_ranks(2, resumed, timeout=60), ref):
        assert torch.equal(got, want) and skipped == 1
