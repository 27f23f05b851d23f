"""DistributedOptimizer's Horovod protocol and Slim-DP semantics, with N simulated ranks in one
process (threads over the fake transport). The MPI tier repeats the key checks under mpirun."""
import warnings

import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError
from hvd_slim.transport import FakeCluster, run_ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(40, 60)
        self.b = torch.nn.Linear(60, 50)
        self.head = torch.nn.Linear(50, 3)
        self.unused = torch.nn.Linear(60, 50)
        # Same start on every simulated rank without touching the global RNG from threads.
        if _INIT is not None:
            self.load_state_dict(_INIT)

    def forward(self, x, branch=0):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h) if branch == 0 else self.unused(h))
        return self.head(h)


_INIT = None
torch.manual_seed(0)
_INIT = Net().state_dict()


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 40, generator=g), torch.randint(0, 3, (n,), generator=g)


def wrap(model, transport, opt_cls=torch.optim.SGD, **kw):
    opt_kw = kw.pop("opt_kw", dict(lr=0.1, momentum=0.9))
    opt = opt_cls(model.parameters(), **opt_kw)
    kw.setdefault("min_compress_numel", 1000)
    return hvd_slim.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         transport=transport, **kw)


def train(rank, transport, steps=6, **kw):
    model = Net()
    opt = wrap(model, transport, **kw)
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_result_is_an_instance_of_the_users_optimizer_class():
    tr = FakeCluster(1).transport(0)
    model = Net()
    opt = wrap(model, tr, opt_kw=dict(lr=0.25, momentum=0.5, weight_decay=1e-4))
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[0]["weight_decay"] == 1e-4


@pytest.mark.parametrize("size", [2, 3])
def test_density_one_matches_dense_averaging(size):
    steps = 5
    res = run_ranks(size, lambda r, tr: flat(train(r, tr, steps, density=1.0)[0]))
    # Reference: one process, SGD with momentum on the mean of every rank's gradient.
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(steps):
        grads = []
        for r in range(size):
            model.zero_grad()
            x, y = batch(r, t)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / size
        opt.step()
    for r in range(size):
        assert torch.allclose(res[r], flat(model), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("pull", ["slim", "union"])
def test_replicas_stay_bitwise_identical(size, pull):
    res = run_ranks(size, lambda r, tr: flat(train(r, tr, 8, density=0.01, pull=pull)[0]))
    for r in range(1, size):
        assert torch.equal(res[0], res[r])
    assert not torch.equal(res[0], flat(Net()))


def test_unused_parameters_on_one_rank_do_not_deadlock():
    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=0.05)
        for t in range(3):
            x, y = batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, branch=rank % 2), y).backward()
            opt.step()
        return flat(model)

    res = run_ranks(3, body, timeout=60)
    assert torch.equal(res[0], res[1]) and torch.equal(res[0], res[2])


def test_zero_grad_guard():
    tr = FakeCluster(1).transport(0)
    model = Net()
    opt = wrap(model, tr)
    x, y = batch(0, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad\\(\\) was called after loss.backward"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_synchronize_clip_skip_synchronize_and_the_warning():
    tr = FakeCluster(1).transport(0)
    model = Net()
    opt = wrap(model, tr, density=1.0)
    x, y = batch(0, 0)
    (torch.nn.functional.cross_entropy(model(x), y) * 100).backward()
    opt.synchronize()
    before = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    after = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()
                                    if p.grad is not None]))
    assert before > 0.5 and after <= 0.5 + 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


def test_backward_passes_per_step_accumulates_then_guards():
    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=1.0, backward_passes_per_step=2, opt_kw=dict(lr=0.1))
        opt.zero_grad()
        for t in range(2):
            x, y = batch(rank, t)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        x, y = batch(rank, 9)
        opt.zero_grad()
        for _ in range(2):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        return flat(model)

    res = run_ranks(2, body)
    # Reference: the gradient summed over both passes (Horovod accumulates), averaged over ranks.
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = None
    for r in range(2):
        model.zero_grad()
        for t in range(2):
            x, y = batch(r, t)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        g = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    for p, g in zip(model.parameters(), total):
        p.grad = g / 2
    opt.step()
    assert torch.allclose(res[0], flat(model), atol=1e-6) and torch.equal(res[0], res[1])


def test_no_named_parameters():
    def body(rank, tr):
        model = Net()
        opt = hvd_slim.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            transport=tr, density=0.05, min_compress_numel=1000)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return flat(model)

    res = run_ranks(2, body)
    assert torch.equal(res[0], res[1])


def test_momentum_correction_moves_momentum_out_of_the_inner_optimizer():
    def body(rank, tr):
        model, opt = train(rank, tr, 2, density=0.01)
        compressed = {id(p) for b in opt._layout.sparse for p in b.params()}
        has_buf = {id(p): opt.state.get(p, {}).get("momentum_buffer") is not None
                   for p in model.parameters()}
        return compressed, has_buf, opt._exchange.worker.memory

    compressed, has_buf, memory = run_ranks(2, body)[0]
    assert compressed and all(not has_buf[i] for i in compressed)
    assert any(has_buf[i] for i in has_buf if i not in compressed)
    assert all(m.velocity is not None for m in memory.values())


def test_flush_applies_every_pending_gradient_in_closed_form():
    """loss = sum(p * c): the gradient is c whatever p is, so after flush every parameter must
    be exactly p0 - lr * mean over ranks of the sum of its c's."""
    steps, size, lr = 4, 3, 0.5

    def coeff(rank, t, p):
        g = torch.Generator().manual_seed(100 * rank + t)
        return torch.randn(p.shape, generator=g)

    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=0.01, opt_kw=dict(lr=lr))
        for t in range(steps):
            opt.zero_grad()
            sum((p * coeff(rank, t, p)).sum() for p in model.parameters()).backward()
            opt.step()
        opt.flush()
        return flat(model), opt._exchange.residual_norm()

    res = run_ranks(size, body)
    model = Net()
    expected = []
    for p in model.parameters():
        c = sum(coeff(r, t, p) for r in range(size) for t in range(steps)) / size
        expected.append((p.detach() - lr * c).reshape(-1))
    for got, norm in res:
        assert norm == 0.0
        assert torch.allclose(got, torch.cat(expected), atol=1e-5)


def test_state_dict_carries_residuals_and_resumes_bitwise():
    def body(rank, tr, split):
        model = Net()
        opt = wrap(model, tr, density=0.02)
        for t in range(6):
            if t == split:
                sd_m, sd_o = model.state_dict(), opt.state_dict()
                assert "hvd_slim" in sd_o
                model = Net()
                opt = wrap(model, tr, density=0.02)
                model.load_state_dict(sd_m)
                opt.load_state_dict(sd_o)
            x, y = batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return flat(model)

    a = run_ranks(2, lambda r, tr: body(r, tr, -1))
    b = run_ranks(2, lambda r, tr: body(r, tr, 3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- argument validation ----------------------------------------------------------------------
def _opt():
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("kw, match", [
    (dict(density=0.0), "density must be in"),
    (dict(density=float("nan")), "density must be a number"),
    (dict(density="x"), "density must be a number"),
    (dict(exploration=1.5), "exploration must be in"),
    (dict(pull_density=2.0), "pull_density must be in"),
    (dict(backward_passes_per_step=0), "backward_passes_per_step must be >= 1"),
    (dict(min_compress_numel=-1), "min_compress_numel must be >= 0"),
    (dict(pull="both"), "pull must be one of"),
    (dict(server_rank=2), "server_rank must be in \\[0, 1\\)"),
    (dict(op=hvd_slim.api.collectives.Adasum), "Adasum is not supported"),
    (dict(process_set=object()), "process_set must be an hvd.ProcessSet"),
    (dict(process_set=hvd_slim.ProcessSet([0])), "process_set: .*not registered"),
    (dict(op=hvd_slim.api.collectives.Sum, gradient_predivide_factor=2.0), "predivide"),
    (dict(transport="carrier-pigeon"), "available"),
])
def test_bad_arguments_are_rejected_up_front(kw, match):
    model, opt = _opt()
    kw.setdefault("transport", FakeCluster(1).transport(0))
    with pytest.raises(ValueError, match=match):
        hvd_slim.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


@pytest.mark.parametrize("density, env, says", [
    (None, {}, "a sparse exchange (density=0.02) cannot carry it"),
    (None, {"HVD_SLIM_DENSITY": "0.001"},
     "density=0.001 (from environment variable HVD_SLIM_DENSITY)"),
    (1.0, {}, "also at density=1.0: its dense exchange (and hvd.allreduce) only average or sum"),
])
def test_adasum_is_refused_saying_what_is_supported(density, env, says, monkeypatch):
    """Adasum is a dense reduction: refused below density 1, and at 1.0 too (no dense Adasum
    either); the error names the density in force and the ops to use."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model, opt = _opt()
    kw = {} if density is None else {"density": density}
    with pytest.raises(ValueError) as info:
        hvd_slim.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      op=hvd_slim.Adasum, transport=FakeCluster(1).transport(0),
                                      **kw)
    msg = str(info.value)
    assert says in msg and "use op=hvd.Average (the default) or op=hvd.Sum" in msg, msg


def test_unknown_keyword_is_a_type_error():
    model, opt = _opt()
    with pytest.raises(TypeError, match="densty"):
        hvd_slim.DistributedOptimizer(opt, densty=0.1, transport=FakeCluster(1).transport(0))


def test_named_parameters_checks():
    model, opt = _opt()
    tr = FakeCluster(1).transport(0)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=named + named[:1], transport=tr)
    with pytest.raises(ValueError, match="not named"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=named[1:], transport=tr)
    with pytest.raises(ValueError, match="tuples"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=[p for _, p in named], transport=tr)


def test_environment_variables_supply_defaults(monkeypatch):
    model, opt = _opt()
    tr = FakeCluster(1).transport(0)
    monkeypatch.setenv("HVD_SLIM_DENSITY", "0.05")
    monkeypatch.setenv("HVD_SLIM_PULL", "union")
    wrapped = hvd_slim.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            transport=tr, exploration=0.2)
    assert wrapped.slim_config.density == 0.05 and wrapped.slim_config.pull == "union"
    model, opt = _opt()
    wrapped = hvd_slim.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            transport=tr, density=0.5)
    assert wrapped.slim_config.density == 0.5  # an explicit keyword wins
    monkeypatch.setenv("HVD_SLIM_DENSITY", "7")
    model, opt = _opt()
    with pytest.raises(ConfigError, match="HVD_SLIM_DENSITY"):
        hvd_slim.DistributedOptimizer(opt, named_parameters=model.named_parameters(), transport=tr)
