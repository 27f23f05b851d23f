"""``overlap_forward=True`` (exchange/overlap/order.py, hvd_slim/optim/forward_apply.py) on
simulated ranks: after backward the stages nearest the input go first, ``step()`` hands the step
over, and each stage's update lands when the next forward pass reaches its modules. Whatever the
schedule, the training is bitwise the one ``overlap`` alone gives."""
import copy
import warnings

import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.config.env import resolve_config
from hvd_slim.exchange import Layout
from hvd_slim.exchange.overlap.staged import StagedExchange
from hvd_slim.exchange.overlap.order import Deferred
from hvd_slim.transport import FakeCluster, run_ranks

from test_exchange import grad_for, make_params
from test_optimizer import Net, batch, flat, wrap

FWD = dict(overlap=3, overlap_forward=True)


def train(rank, tr, steps=5, zero="opt", sched=False, passes=1, branch=None, **kw):
    """``steps`` steps of ``Net``; ``zero``: how the script clears gradients ("opt", "model",
    "keep": ``zero_grad(set_to_none=False)``); ``sched``: a scheduler stepped after each."""
    model = Net()
    opt = wrap(model, tr, backward_passes_per_step=passes, **kw)
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if sched else None
    for t in range(steps):
        if zero == "opt":
            opt.zero_grad()
        elif zero == "model":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=False)
        for k in range(passes):
            x, y = batch(rank, passes * t + k)
            b = branch(rank, t) if branch else 0
            torch.nn.functional.cross_entropy(model(x, b), y).backward()
        opt.step()
        if lr is not None:
            lr.step()
    opt.apply_updates()
    return flat(model), opt


def same(a, b):
    return all(torch.equal(x[0], y[0]) for x, y in zip(a, b))


def one_step(model, opt, rank, t):
    x, y = batch(rank, t)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def stepped(model, tr, rank, steps, **kw):
    """``model`` wrapped (density 0.05, 3 stages, ``kw``) and trained ``steps`` steps; the
    optimizer, its last step possibly still in flight."""
    opt = wrap(model, tr, density=0.05, overlap=3, **kw)
    for t in range(steps):
        one_step(model, opt, rank, t)
    return opt


@pytest.mark.parametrize("zero", ["opt", "model", "keep"])
@pytest.mark.parametrize("density", [1.0, 0.05])
def test_training_is_bitwise_that_of_overlap_alone(density, zero):
    plain = run_ranks(3, lambda r, tr: train(r, tr, zero=zero, density=density, overlap=3))
    fwd = run_ranks(3, lambda r, tr: train(r, tr, zero=zero, density=density, **FWD))
    assert same(plain, fwd)
    assert all(torch.equal(fwd[0][0], r[0]) for r in fwd)   # replicas identical


@pytest.mark.parametrize("opt_cls, opt_kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=1e-2))])
def test_every_stage_steps_with_the_learning_rate_of_its_step(opt_cls, opt_kw):
    # The scheduler halves the rate right after step(); the stages land later, at the rate of
    # their step. Adam at density 0.05 is stepped by optim/inner/adam.py after the dense warm-up.
    kw = dict(opt_cls=opt_cls, opt_kw=opt_kw, density=0.05, sched=True, warmup_dense_steps=2)
    plain = run_ranks(2, lambda r, tr: train(r, tr, overlap=3, **kw))
    fwd = run_ranks(2, lambda r, tr: train(r, tr, **FWD, **kw))
    assert same(plain, fwd)


@pytest.mark.parametrize("passes", [1, 2])
def test_unused_parameters_and_accumulation_keep_it_bitwise(passes):
    branch = lambda rank, t: int(rank == 1 and t % 2 == 1)   # noqa: E731
    plain = run_ranks(3, lambda r, tr: train(r, tr, passes=passes, branch=branch, density=0.05,
                                             overlap=3))
    fwd = run_ranks(3, lambda r, tr: train(r, tr, passes=passes, branch=branch, density=0.05,
                                           **FWD))
    assert same(plain, fwd)


def test_the_models_state_dict_lands_the_step_first():
    def body(rank, tr, **kw):
        model = Net()
        opt = stepped(model, tr, rank, 3, **kw)
        held = opt._forward is not None and opt._forward.pending
        saved = copy.deepcopy(model.state_dict())   # no apply_updates() first
        return torch.cat([v.reshape(-1) for v in saved.values()]), held

    plain = run_ranks(2, lambda r, tr: body(r, tr))
    fwd = run_ranks(2, lambda r, tr: body(r, tr, overlap_forward=True))
    assert [r[1] for r in fwd] == [True, True] and same(plain, fwd)


def test_clipping_between_synchronize_and_step_is_settled_at_once():
    def body(rank, tr, **kw):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, **kw)
        for t in range(3):
            x, y = batch(rank, t)
            opt.zero_grad()
            (torch.nn.functional.cross_entropy(model(x), y) * 100).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
            assert opt._forward is None or not opt._forward.pending
        return flat(model), None

    plain = run_ranks(2, lambda r, tr: body(r, tr))
    assert same(plain, run_ranks(2, lambda r, tr: body(r, tr, overlap_forward=True)))


def test_step_leaves_the_update_to_the_next_forward_and_gradients_as_without_it():
    def body(rank, tr, forward):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, overlap_forward=forward)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before = flat(model)
        opt.step()
        unchanged = torch.equal(before, flat(model))
        held = opt._forward is not None and opt._forward.pending
        model.a(x)   # the first layer's forward: its stage lands, the others wait
        first = not torch.equal(model.a.weight, before[:model.a.weight.numel()].view(60, 40))
        still = opt._forward is not None and opt._forward.pending
        opt.apply_updates()
        grads = [p.grad.clone() for n, p in model.named_parameters() if "unused" not in n]
        return unchanged, held, first, still, flat(model), grads

    plain = run_ranks(2, lambda r, tr: body(r, tr, False))
    fwd = run_ranks(2, lambda r, tr: body(r, tr, True))
    assert all(r[:4] == (True, True, True, True) for r in fwd), [r[:4] for r in fwd]
    assert all(r[0] is False for r in plain)
    for a, b in zip(plain, fwd):
        assert torch.equal(a[4], b[4])
        assert len(a[5]) == len(b[5]) and all(torch.equal(g, h) for g, h in zip(a[5], b[5]))


def test_after_backward_the_stages_run_nearest_the_input_first():
    def body(rank, tr):
        named = make_params()
        config = SlimConfig(min_compress_numel=1000, density=0.05, **FWD)
        ex = StagedExchange(Layout(named, config, lambda dt: dt), config, tr, {}, None,
                            [n for n, _ in named], threaded=True)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
        out = ex.step(None, defer=True)   # no hooks: every gradient is in at the first round
        if not isinstance(out, Deferred):
            return out, ex.step_count
        for k in range(len(ex.stages)):
            out.settle(k)
        return list(out.job.outcomes), ex.step_count

    res = run_ranks(3, body)
    assert all(r == ([2, 1, 0], 1) for r in res), res


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_nonfinite_gradient_settles_the_step_at_once_as_without_it(mode):
    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=0.05, nonfinite=mode, **FWD)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if rank == 2:
            model.b.weight.grad[0, 0] = float("inf")
        before = flat(model)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, opt._exchange.residual_norm(), opt._forward.pending
        nan = all(torch.isnan(p.grad).all() for p in model.parameters() if p.grad is not None)
        return nan, opt._exchange.residual_norm(), torch.equal(before, flat(model))

    res = run_ranks(3, body)
    assert all(r[1] == 0.0 for r in res), res
    if mode == "raise":
        assert all(r[0] == "NonFiniteGradientError" and r[2] is False for r in res), res
    else:
        assert all(r[0] is (mode == "flag") and r[2] for r in res), res


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_sum_that_overflows_the_16_bit_wire_is_refused_in_step_not_later(mode):
    """Every push is finite, so the schedule round is clear, but the server's sum overflows
    float16: with a 16-bit wire the step cannot be handed over before every stage is back."""
    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=1.0, nonfinite=mode, op=hvd_slim.Sum,
                   compression=hvd_slim.Compression.fp16, **FWD)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.a.weight.grad[0, 0] = 40000.0   # fits float16; the sum of three does not
        before = flat(model)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, opt._forward.pending, torch.equal(before, flat(model))
        pending = opt._forward.pending
        nan = all(torch.isnan(p.grad).all() for p in model.parameters() if p.grad is not None)
        model(x)
        opt.apply_updates()
        return nan, pending, torch.equal(before, flat(model))

    res = run_ranks(3, body)
    first = "NonFiniteGradientError" if mode == "raise" else mode == "flag"
    assert all(r == (first, False, True) for r in res), res


class Listed(torch.nn.Module):
    """Parameters in an ``nn.ParameterList``, read by the holder's forward, not a child's."""

    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(40, 40))
                                          for _ in range(3)])
        self.head = torch.nn.Linear(40, 3)
        if _LISTED is not None:   # the same start on every simulated rank (no global RNG)
            self.load_state_dict(_LISTED)

    def forward(self, x, branch=0):
        for w in self.ws:
            x = torch.relu(x @ w)
        return self.head(x)


_LISTED = None
torch.manual_seed(3)
_LISTED = {k: v + 0.1 * torch.randn(v.shape) for k, v in Listed().state_dict().items()}


def test_a_parameter_list_lands_with_the_module_that_holds_it():
    def body(rank, tr, **kw):
        model = Listed()
        opt = stepped(model, tr, rank, 4, **kw)
        opt.apply_updates()
        return flat(model), None

    plain = run_ranks(2, lambda r, tr: body(r, tr))
    assert same(plain, run_ranks(2, lambda r, tr: body(r, tr, overlap_forward=True)))


def test_a_compiled_model_trains_bitwise_too():
    # torch.compile traces into global module hooks; ours runs outside the graph.
    def body(rank, tr, compiled, **kw):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, **kw)
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        for t in range(3):
            x, y = batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(fwd(x), y).backward()
            opt.step()
        opt.apply_updates()
        return flat(model), None

    plain = run_ranks(2, lambda r, tr: body(r, tr, False))
    with warnings.catch_warnings():   # torch notes that global hooks fire for the wrapper too
        warnings.simplefilter("ignore", UserWarning)
        assert same(plain, run_ranks(2, lambda r, tr: body(r, tr, True, overlap_forward=True)))


@pytest.mark.parametrize("read", ["bias", "weight"])
def test_a_parameter_read_outside_its_module_raises_at_backward(read):
    class Direct(Net):   # reads unused's parameters without running unused's forward
        def forward(self, x, branch=0):
            h = torch.relu(self.a(x))
            if read == "bias":
                h = torch.relu(self.b(h) + self.unused.bias)
            else:
                h = torch.relu(torch.nn.functional.linear(h, self.unused.weight))
            return self.head(h)

    def body(rank, tr):
        model = Direct()
        opt = wrap(model, tr, density=0.05, **FWD)
        for t in range(2):
            x, y = batch(rank, t)
            opt.zero_grad()
            try:
                torch.nn.functional.cross_entropy(model(x), y).backward()
            except RuntimeError as exc:
                return t, str(exc)
            opt.step()
        return None

    res = run_ranks(2, body)
    assert all(r is not None and r[0] == 1 for r in res), res
    if read == "bias":   # ours; a saved weight is caught by autograd's version check first
        assert all("'unused.bias'" in r[1] and "apply_updates" in r[1] for r in res), res
    else:
        assert all("inplace" in r[1] or "apply_updates" in r[1] for r in res), res


def test_checkpoints_land_the_step_first_and_resume_bitwise_either_way():
    def body(rank, tr, split, resume_fwd):
        model = Net()
        opt = wrap(model, tr, density=0.05, seed=2, **FWD)
        for t in range(6):
            if t == split:
                state = opt.state_dict()   # lands the step in flight first
                model2 = Net()
                model2.load_state_dict(model.state_dict())
                model, opt = model2, wrap(model2, tr, density=0.05, seed=2, overlap=3,
                                          overlap_forward=resume_fwd)
                opt.load_state_dict(state)
            one_step(model, opt, rank, t)
        opt.apply_updates()
        return flat(model), None

    plain = run_ranks(2, lambda r, tr: body(r, tr, -1, True))
    for resume_fwd in (True, False):
        assert same(plain, run_ranks(2, lambda r, tr: body(r, tr, 3, resume_fwd)))


def test_a_failed_stage_raises_and_keeps_its_gradient_in_the_residual():
    # Whether the stage fails before step() returns (then step() raises) or after it (then
    # whatever waits for it raises) depends on timing; either way every rank raises, nothing
    # stays pending and the stage's gradient is kept.
    def body(rank, tr):
        model = Net()
        opt = stepped(model, tr, rank, 1, overlap_forward=True)
        opt.apply_updates()
        first = opt._exchange.stages[-1]   # the input side: the last one ready in backward

        def broken(*args, **kw):
            raise RuntimeError("the wire broke")
        # On every rank, the stage's push fails on the wire: communicate keeps the gradient,
        # then raises (each stage has a wire path of its own).
        first.path.gather = broken
        held = first.residual_norm()
        try:
            one_step(model, opt, rank, 1)
            opt.apply_updates()
        except RuntimeError as exc:
            return str(exc), opt._forward.pending, first.residual_norm() != held
        return None

    res = run_ranks(2, body)
    assert all(r == ("the wire broke", False, True) for r in res), res


def test_loading_over_a_step_in_flight_drops_it_exactly():
    def body(rank, tr, detour):
        model = Net()
        opt = wrap(model, tr, density=0.05, seed=2, **FWD)
        for t in range(5):
            if t == 2 and detour:
                so = copy.deepcopy(opt.state_dict())   # lands step 1 first
                sm = copy.deepcopy(model.state_dict())
                one_step(model, opt, rank, 99)   # one more step, left in flight, loaded over
                assert opt._forward.pending
                model.load_state_dict(sm)
                opt.load_state_dict(so)
            one_step(model, opt, rank, t)
        opt.apply_updates()
        return flat(model), None

    assert same(run_ranks(2, lambda r, tr: body(r, tr, False)),
                run_ranks(2, lambda r, tr: body(r, tr, True)))


def test_bad_values_are_refused_naming_the_keyword_and_the_variable():
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="overlap_forward"):
            SlimConfig(overlap=2, overlap_forward=bad)
    with pytest.raises(ConfigError, match="overlap_forward=True needs overlap > 1"):
        SlimConfig(overlap_forward=True)
    assert resolve_config({"overlap": 2}, {"HVD_SLIM_OVERLAP_FORWARD": "on"}).overlap_forward
    with pytest.raises(ConfigError, match="HVD_SLIM_OVERLAP_FORWARD"):
        resolve_config({"overlap": 2}, {"HVD_SLIM_OVERLAP_FORWARD": "maybe"})
    tr = FakeCluster(1).transport(0)
    with pytest.raises(ValueError, match="overlap_forward"):
        wrap(Net(), tr, overlap_forward=True)
