"""Local steps (``local_steps=H``, outer/rounds.py) on simulated ranks: H local steps of the
wrapped optimizer, then the pseudo-gradient through the exchange to the outer optimizer, with
the global parameters and the outer state bitwise the same on every rank."""
import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.transport import FakeCluster, run_ranks

torch.manual_seed(3)
_INIT = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 3)).state_dict()


def model():
    m = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    m.load_state_dict(_INIT)
    return m


def nesterov(m):
    """DiLoCo's outer optimizer, passed explicitly: the rounds' mechanics are tested with an
    outer momentum, whose state must match bitwise on every rank (over a sparse exchange the
    default outer SGD has none; its own tests are in test_local_defaults.py)."""
    return torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)


def wrap(m, tr, inner=None, **kw):
    kw.setdefault("min_compress_numel", 100)
    kw.setdefault("density", 0.1)
    if kw.get("local_steps", 1) > 1:
        kw.setdefault("outer_optimizer", nesterov(m))
    inner = inner or torch.optim.AdamW(m.parameters(), lr=1e-2)
    return hvd_slim.DistributedOptimizer(inner, named_parameters=m.named_parameters(),
                                         transport=tr, **kw)


def batch(rank, t):
    g = torch.Generator().manual_seed(100 * rank + t)
    x = torch.randn(16, 40, generator=g)
    return x, (x[:, 0] > 0).long()


def one_step(m, opt, rank, t):
    x, y = batch(rank, t)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def outer_state(opt):
    st = opt._outer.outer.state_dict()["state"]
    return torch.cat([st[i]["momentum_buffer"].reshape(-1) for i in sorted(st)])


def test_global_parameters_and_outer_state_are_identical_after_every_round():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=4)
        rounds, mid = [], []
        for t in range(12):
            one_step(m, opt, rank, t)
            if (t + 1) % 4 == 0:
                rounds.append((flat(m), outer_state(opt),
                               torch.cat([g.reshape(-1) for g in opt._outer.global_params])))
            elif t == 5:
                mid.append(flat(m))
        return rounds, mid, opt.comm_stats()

    res = run_ranks(3, body)
    for k in range(3):
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(res[0][0][k], r[0][k])), k
        assert torch.equal(res[0][0][k][0], res[0][0][k][2])   # the model is the global state
    assert not torch.equal(res[0][1][0], res[1][1][0])   # mid-round, every rank is its own
    st = res[0][2]
    assert st["steps"] == 3 and st["local_steps_taken"] == 12
    numel = sum(p.numel() for p in model().parameters())
    assert st["dense_bytes"] == 12 * 4 * numel   # data parallelism: an allreduce a step


def test_density_one_and_outer_lr_one_is_parameter_averaging():
    """Outer SGD with lr 1 and no momentum on the exact mean pseudo-gradient lands on the mean
    of the ranks' local parameters (DiLoCo's closed form)."""
    def body(rank, tr):
        m = model()
        outer = torch.optim.SGD(m.parameters(), lr=1.0)
        opt = wrap(m, tr, density=1.0, local_steps=3, outer_optimizer=outer)
        seen = []
        load = opt._outer.load_pseudo_gradients
        opt._outer.load_pseudo_gradients = lambda: (seen.append(flat(m).double()), load())[1]
        for t in range(6):
            one_step(m, opt, rank, t)
            if (t + 1) % 3 == 0:
                seen.append(flat(m).double())
        return seen

    res = run_ranks(3, body)
    for k in (0, 2):   # [local before round 1, after round 1, local before round 2, after]
        mean = sum(r[k] for r in res) / 3
        assert torch.allclose(res[0][k + 1], mean, atol=1e-6), k


def plain_and_resumed(keywords, steps, split, finish=None):
    """Two ranks trained ``steps`` steps straight, and with a checkpoint taken and loaded into
    a new model and optimizer before step ``split``: each rank's parameters and outer state
    (and what ``finish(opt)`` returns) from both."""
    def body(rank, tr, split):
        m = model()
        opt = wrap(m, tr, seed=5, **keywords)
        for t in range(steps):
            if t == split:
                state, weights = opt.state_dict(), {k: v.clone() for k, v in
                                                    m.state_dict().items()}
                m = model()
                m.load_state_dict(weights)
                opt = wrap(m, tr, seed=5, **keywords)
                opt.load_state_dict(state)
            one_step(m, opt, rank, t)
        extra = finish(opt) if finish else None
        return flat(m), outer_state(opt), extra

    return (run_ranks(2, lambda r, tr: body(r, tr, -1)),
            run_ranks(2, lambda r, tr: body(r, tr, split)))


def test_resume_mid_round_is_bitwise():
    plain, resumed = plain_and_resumed({"local_steps": 4}, 10, 6)
    for a, b in zip(plain, resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_checkpoints_of_other_local_steps_are_refused():
    tr = FakeCluster(1).transport(0)
    m = model()
    four = wrap(m, tr, local_steps=4)
    one_step(m, four, 0, 0)
    saved = four.state_dict()
    # (an AdamW at local_steps=1 exchanges its update by default, which differs too)
    with pytest.raises(ValueError, match="'local_steps': 4 in the checkpoint vs. 1 now"):
        wrap(model(), tr, adam_exchange="gradient").load_state_dict(saved)
    with pytest.raises(ValueError, match="'local_steps': 4 in the checkpoint vs. 8 now"):
        wrap(model(), tr, local_steps=8).load_state_dict(saved)
    with pytest.raises(ValueError, match="'local_steps': 1 in the checkpoint vs. 4 now"):
        wrap(model(), tr, local_steps=4).load_state_dict(
            wrap(model(), tr, adam_exchange="gradient").state_dict())
    # The exchange's own state alone (the outer state dropped) is refused too.
    partial = dict(saved)
    partial.pop("hvd_slim_outer")
    with pytest.raises(ValueError, match="without local_steps > 1"):
        wrap(model(), tr, local_steps=4).load_state_dict(partial)


def first_step_errors(size, keywords):
    """Every rank's error text from its first step (None where it succeeded), the optimizer
    built with ``keywords(rank, model)``."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, timeout=20, **keywords(rank, m))
        try:
            one_step(m, opt, rank, 0)
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        return None

    return run_ranks(size, body)


def test_the_first_step_handshake_names_another_local_steps():
    msgs = first_step_errors(3, lambda rank, m: {"local_steps": 4 if rank else 8})
    assert all(m is not None and "local_steps" in m for m in msgs), msgs


def test_the_handshake_names_an_outer_optimizer_with_other_settings():
    msgs = first_step_errors(2, lambda rank, m: {
        "local_steps": 4, "outer_optimizer": torch.optim.SGD(
            m.parameters(), lr=0.7 if rank else 0.5, momentum=0.9, nesterov=True)})
    assert all(m is not None and "outer_optimizer" in m and "lr=0.5" in m for m in msgs), msgs


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_nonfinite_pseudo_gradient_drops_the_round_on_every_rank(mode):
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=2, nonfinite=mode, inner=torch.optim.SGD(
            m.parameters(), lr=0.1))
        before = flat(m)
        one_step(m, opt, rank, 0)
        try:
            inf_on_rank_1(m, opt, rank, 1)
        except hvd_slim.NonFiniteGradientError:
            return "raised", torch.equal(flat(m), before), opt._exchange.residual_norm()
        return opt.comm_stats()["skipped_steps"], torch.equal(flat(m), before), \
            opt._exchange.residual_norm()

    res = run_ranks(3, body)
    assert all(r[1] and r[2] == 0.0 for r in res), res   # back at the global parameters
    assert all(r[0] == ("raised" if mode == "raise" else 1) for r in res), res


def inf_on_rank_1(m, opt, rank, t):
    """A step of batch ``t`` whose gradient rank 1 makes Inf before ``opt.step()``."""
    x, y = batch(rank, t)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    if rank == 1:
        m[0].weight.grad[0, 0] = float("inf")
    opt.step()


def test_flush_mid_round_ends_the_round_and_empties_every_residual():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=4, density=0.05)
        for t in range(6):
            one_step(m, opt, rank, t)
        opt.flush()
        return flat(m), opt._exchange.residual_norm(), opt.comm_stats()["steps"], \
            opt._outer.taken

    res = run_ranks(3, body)
    assert all(torch.equal(res[0][0], r[0]) for r in res)
    assert all(r[1] == 0.0 and r[2] == 2 and r[3] == 0 for r in res), res


def test_synchronize_mid_round_leaves_the_local_gradient_and_step_still_steps():
    tr = FakeCluster(1).transport(0)
    m = model()
    opt = wrap(m, tr, local_steps=3, inner=torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = batch(0, 0)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    before = flat(m)
    opt.synchronize()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters()))
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
    with opt.skip_synchronize():
        opt.step()
    step = torch.cat([(-0.1 * p.grad).reshape(-1) for p in m.parameters()])
    assert torch.allclose(flat(m), before + step, atol=1e-7)
    assert opt.comm_stats()["steps"] == 0


def test_bad_local_steps_and_outer_optimizers_are_refused_naming_them():
    for bad in (0, 2.5, "4", True):
        with pytest.raises(ConfigError, match="local_steps"):
            SlimConfig(local_steps=bad)
    with pytest.raises(ConfigError, match="overlap"):
        SlimConfig(local_steps=4, overlap=2)
    with pytest.raises(ConfigError, match="momentum_correction"):
        SlimConfig(local_steps=4, momentum_correction=True)
    tr = FakeCluster(1).transport(0)
    m = model()
    with pytest.raises(ValueError, match="outer_optimizer must be a torch.optim.Optimizer"):
        wrap(m, tr, local_steps=4, outer_optimizer=lambda ps: None)
    with pytest.raises(ValueError, match="exactly the trainable parameters"):
        wrap(m, tr, local_steps=4, outer_optimizer=torch.optim.SGD(model().parameters(), lr=1))
    with pytest.raises(ValueError, match="needs local_steps > 1"):
        wrap(m, tr, outer_optimizer=torch.optim.SGD(m.parameters(), lr=1))
    with pytest.raises(ValueError, match="adam_variance='rescaled'"):
        wrap(m, tr, local_steps=4, adam_variance="rescaled")


def test_local_steps_from_the_environment(monkeypatch):
    monkeypatch.setenv("HVD_SLIM_LOCAL_STEPS", "16")
    tr = FakeCluster(1).transport(0)
    assert wrap(model(), tr).slim_config.local_steps == 16


def test_flush_subtracts_the_residuals_from_the_global_parameters_as_they_are():
    """One rank: the flush's pull is its own worker and server residuals, and they land on the
    global parameters with lr 1, the outer optimizer's state untouched."""
    tr = FakeCluster(1).transport(0)
    m = model()
    opt = wrap(m, tr, local_steps=4, density=0.05)
    for t in range(8):   # two whole rounds: nothing of a round is pending
        one_step(m, opt, 0, t)
    before = {id(p): g.clone() for p, g in zip(opt._outer.params, opt._outer.global_params)}
    momentum = outer_state(opt).clone()
    held = opt._exchange.held_residuals()
    want = dict(before)
    for b in opt._layout.sparse:
        for s in b.segments:
            r = held[b.index][s.offset:s.offset + s.numel].view(s.param.shape)
            want[id(s.param)] = before[id(s.param)] - r.to(s.param.dtype)
    assert any(float(r.abs().max()) > 0 for r in held.values())
    opt.flush()
    for p in m.parameters():
        assert torch.allclose(p.detach(), want[id(p)], atol=1e-7)
    assert torch.equal(outer_state(opt), momentum)
    assert opt._exchange.residual_norm() == 0.0


def test_the_automatic_warm_up_lasts_as_many_local_steps_as_without_rounds():
    assert SlimConfig(density=0.01).effective_warmup_decay_steps == 100
    assert SlimConfig(density=0.01, local_steps=32).effective_warmup_decay_steps == 4
    assert SlimConfig(density=0.01, local_steps=128).effective_warmup_decay_steps == 1
    assert SlimConfig(density=0.01, local_steps=32,
                      warmup_decay_steps=50).effective_warmup_decay_steps == 50
