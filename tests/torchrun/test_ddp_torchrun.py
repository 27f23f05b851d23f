"""The Slim-DP DDP communication hook (hvd_slim/ddp) on real ``DistributedDataParallel`` models,
every rank one torchrun process on the default Gloo group. Checked: replicas stay bitwise
identical; ``density=1.0`` equals DDP's own allreduce; ``no_sync`` accumulation, ``static_graph``,
unused parameters, ``GradScaler``, ``clip_grad_norm_``, ``gradient_as_bucket_view`` and
``torch.compile`` work; a checkpoint resumes bitwise.
Every rank runs these in the same order (tests/torchrun/conftest.py)."""
from __future__ import annotations

import hashlib
import io
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_slim.ddp import SlimState, slim_hook


class Net(torch.nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)   # the same start on every rank (DDP broadcasts rank 0's anyway)
        self.fc1, self.fc2 = torch.nn.Linear(24, 256), torch.nn.Linear(256, 4)
        self.spare = torch.nn.Linear(24, 24) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step: int, rank: int) -> Any:
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_everywhere(t: torch.Tensor) -> bool:
    """Whether every rank holds these exact bits (compared by digest on the default group)."""
    mine = hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return len(set(every)) == 1


def train(ddp: DDP, opt: torch.optim.Optimizer, steps: range, scaler: Any = None,
          clip: bool = False) -> None:
    for t in steps:
        x, y = batch(t, dist.get_rank())
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def model(state: Any = None, **ddp_kw: Any) -> Any:
    net = Net(unused=ddp_kw.pop("unused", False))
    ddp = DDP(net, **ddp_kw)
    if state is not None:
        ddp.register_comm_hook(state, slim_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def test_replicas_stay_identical_and_the_bytes_shrink(hvd: Any) -> None:
    state = SlimState(density=0.01, min_compress_numel=100)
    ddp, opt = model(state)
    start = flat(ddp.module)
    train(ddp, opt, range(12))
    assert same_everywhere(flat(ddp.module)) and not torch.equal(flat(ddp.module), start)
    st = state.comm_stats()
    assert st["steps"] == 12 and st["transport"] == "gloo" and st["world_size"] == hvd.size()
    # The first iteration is dense; then the warm-up, then 1%.
    assert st["bytes_pushed"] < st["dense_bytes"] / 3, st


def test_density_one_is_ddps_own_allreduce(hvd: Any) -> None:
    ours, opt = model(SlimState(density=1.0))
    plain, plain_opt = model()
    train(ours, opt, range(5))
    train(plain, plain_opt, range(5))
    assert torch.allclose(flat(ours.module), flat(plain.module), atol=1e-5)


def test_no_sync_accumulates_before_the_exchange(hvd: Any) -> None:
    """Two micro-batches under no_sync, then one synchronised: the hook sees their sum, and at
    density 1.0 the result is DDP's own accumulation."""
    def run(state: Any) -> torch.Tensor:
        ddp, opt = model(state)
        for t in range(3):
            opt.zero_grad()
            with ddp.no_sync():
                for m in range(2):
                    x, y = batch(10 * t + m, dist.get_rank())
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
            x, y = batch(10 * t + 2, dist.get_rank())
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return flat(ddp.module)
    sparse = run(SlimState(density=0.05, min_compress_numel=100))
    assert same_everywhere(sparse)
    assert torch.allclose(run(SlimState(density=1.0)), run(None), atol=1e-5)


@pytest.mark.parametrize("ddp_kw", [{"static_graph": True},
                                    {"find_unused_parameters": True, "unused": True}])
def test_static_graph_and_unused_parameters(hvd: Any, ddp_kw: dict) -> None:
    ddp, opt = model(SlimState(density=0.02, min_compress_numel=100), **ddp_kw)
    spare = None if ddp.module.spare is None else flat(ddp.module.spare)
    train(ddp, opt, range(6))
    assert same_everywhere(flat(ddp.module))
    if spare is not None:
        assert torch.equal(flat(ddp.module.spare), spare)


@pytest.mark.parametrize("tell", [False, True], ids=["untold", "told"])
def test_grad_scaler_and_clipping(hvd: Any, tell: bool) -> None:
    state = SlimState(density=0.02, min_compress_numel=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    if tell:   # the residuals in true units (exchange/loss_scale.py)
        state.set_grad_scaler(scaler)
    ddp, opt = model(state)
    train(ddp, opt, range(6), scaler=scaler, clip=True)
    assert same_everywhere(flat(ddp.module)) and scaler.get_scale() == 1024.0


@pytest.mark.parametrize("tell", [False, True], ids=["untold", "told"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(hvd: Any, tell: bool) -> None:
    """nonfinite="flag": a rank's inf makes every rank's update NaN, so GradScaler skips the step
    and backs off alike everywhere."""
    state = SlimState(density=0.02, min_compress_numel=100)
    ddp, opt = model(state)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    if tell:
        state.set_grad_scaler(scaler)
    train(ddp, opt, range(2), scaler=scaler)
    before = flat(ddp.module)
    x, y = batch(2, dist.get_rank())
    if dist.get_rank() == dist.get_world_size() - 1:
        x[0, 0] = float("inf")
    opt.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(ddp(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(flat(ddp.module), before) and scaler.get_scale() == 512.0
    assert state.comm_stats()["skipped_steps"] == 1


@pytest.mark.parametrize("how", ["direct", "register", "old"])
def test_a_checkpoint_resumes_bitwise(hvd: Any, how: str) -> None:
    """Saved mid-run and resumed in a fresh model, the run is the unbroken one: registered
    directly (the exchange in DDP's order), with register() (by name), and a checkpoint of
    before the exchanges kept their names (laid out in DDP's order then), resumed with
    register(): its exchanges keep the order they were saved in."""
    kw = dict(density=0.02, min_compress_numel=100)

    def hooked(state: Any, named: bool) -> Any:
        ddp, opt = model()
        if named:
            state.register(ddp)
        else:
            ddp.register_comm_hook(state, slim_hook)
        return ddp, opt

    full, full_opt = hooked(SlimState(**kw), how == "register")
    train(full, full_opt, range(8))

    state = SlimState(**kw)
    ddp, opt = hooked(state, how == "register")
    train(ddp, opt, range(4))
    saved = io.BytesIO()
    slim = state.state_dict()
    if how == "old":
        slim["buckets"] = [{k: v for k, v in b.items() if k != "names"} for b in slim["buckets"]]
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "slim": slim}, saved)
    saved.seek(0)
    ckpt = torch.load(saved, weights_only=True)
    again = SlimState(**kw)
    again.load_state_dict(ckpt["slim"])
    resumed, resumed_opt = hooked(again, how != "direct")
    resumed.module.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    train(resumed, resumed_opt, range(4, 8))
    assert torch.equal(flat(resumed.module), flat(full.module))


def test_a_second_model_on_one_state_is_refused(hvd: Any) -> None:
    state = SlimState(density=0.02, min_compress_numel=100)
    first, opt = model(state)
    train(first, opt, range(2))
    second, opt2 = model(state)
    with pytest.raises(RuntimeError, match="another DDP model"):
        train(second, opt2, range(2))


def test_register_checks_the_model_and_the_state(hvd: Any) -> None:
    """SlimState.register refuses what the hook cannot see at its buckets: something other than
    a DDP model, and a state already serving another model. What it registers trains (by
    name, as DistributedOptimizer: test_in_one_bucket_the_hook_is_distributed_optimizer)."""
    state = SlimState(density=0.02, min_compress_numel=100)
    with pytest.raises(TypeError, match="must be a torch.nn.parallel.DistributedDataParallel"):
        state.register(Net())
    first, opt = model()
    start = flat(first.module)
    assert state.register(first) is state
    train(first, opt, range(3))
    assert not torch.equal(flat(first.module), start)
    assert same_everywhere(flat(first.module))
    second, _ = model()
    with pytest.raises(RuntimeError, match="already serves another DDP model"):
        state.register(second)


def test_a_process_group_of_another_size_is_refused(hvd: Any) -> None:
    """A state on a group of other ranks than DDP's would let replicas drift apart: register
    refuses it on every rank, before any collective (no rank waits on another)."""
    small = dist.new_group(ranks=list(range(dist.get_world_size() - 1)))
    ddp, _ = model()
    state = SlimState(process_group=small, density=0.02)
    expected = "is not a member" if dist.get_rank() == dist.get_world_size() - 1 else \
        f"has {dist.get_world_size() - 1} ranks and the DDP model's {dist.get_world_size()}"
    with pytest.raises(ValueError, match=expected):
        state.register(ddp)


def gone(group: Any) -> bool:
    """Whether ``group`` was destroyed (torch forgets its ranks then)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return True
    return False


def test_close_destroys_the_private_group_and_leaves_a_given_one(hvd: Any) -> None:
    """SlimState.close() destroys the private group made at the first bucket; a group the
    caller gave stays usable. Both states keep their data, and the models stay identical."""
    private = SlimState(density=0.02, min_compress_numel=100)
    given_group = dist.new_group()
    given = SlimState(process_group=given_group, density=0.02, min_compress_numel=100)
    for state in (private, given):
        ddp, opt = model(state)
        train(ddp, opt, range(2))
        assert same_everywhere(flat(ddp.module))
    made = private._transport.group
    assert not gone(made) and made is not given_group
    private.close()
    given.close()
    assert gone(made) and not gone(given_group)
    dist.barrier(group=given_group)
    assert private.state_dict()["iteration"] == given.state_dict()["iteration"] == 2


def test_adamw_through_the_hook_keeps_replicas_identical_and_resumes(hvd: Any) -> None:
    """SlimState(optimizer=AdamW): each rank's update travels and opt.step() applies what was
    delivered; with an LR scheduler made afterwards, and a checkpoint mid-run."""
    def make() -> Any:
        ddp = DDP(Net())
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
        state = SlimState(optimizer=opt, min_compress_numel=100)
        ddp.register_comm_hook(state, slim_hook)
        return ddp, opt, state, torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)

    def steps(ddp: DDP, opt: Any, sched: Any, span: range) -> None:
        for t in span:
            x, y = batch(t, dist.get_rank())
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            sched.step()

    ddp, opt, state, sched = make()
    start = flat(ddp.module)
    steps(ddp, opt, sched, range(8))
    assert same_everywhere(flat(ddp.module)) and not torch.equal(flat(ddp.module), start)

    half, hopt, hstate, hsched = make()
    steps(half, hopt, hsched, range(4))
    saved = io.BytesIO()
    torch.save({"model": half.module.state_dict(), "opt": hopt.state_dict(),
                "sched": hsched.state_dict(), "slim": hstate.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved, weights_only=True)
    again, aopt, astate, asched = make()
    again.module.load_state_dict(ckpt["model"])
    aopt.load_state_dict(ckpt["opt"])
    asched.load_state_dict(ckpt["sched"])
    astate.load_state_dict(ckpt["slim"])
    steps(again, aopt, asched, range(4, 8))
    assert torch.equal(flat(again.module), flat(ddp.module))


@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adamw"])
def test_gradient_as_bucket_view_trains_bit_for_bit_as_copied_gradients(hvd: Any,
                                                                         adam: bool) -> None:
    """DDP(gradient_as_bucket_view=True) saves DDP's copies of every gradient into its bucket and
    back: the gradients are the bucket. The hook reads and writes the bucket in place (Adam's
    update too), so the run is bitwise the one with copied gradients, sliced and under AdamW."""
    def run(view: bool) -> torch.Tensor:
        ddp = DDP(Net(), gradient_as_bucket_view=view)
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1) if adam else \
            torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        SlimState(optimizer=opt if adam else None, density=0.02,
                  min_compress_numel=100).register(ddp)
        train(ddp, opt, range(8))
        return flat(ddp.module)
    viewed, copied = run(True), run(False)
    assert torch.equal(viewed, copied) and same_everywhere(viewed)


def test_adamw_under_a_changing_grad_scaler_is_adamw_without_one(hvd: Any) -> None:
    """SlimState(optimizer=AdamW).set_grad_scaler(scaler): the hook takes the loss scale out
    before each rank's Adam moments, so a scale that doubles at every step gives, bit for
    bit, the run without a scaler (the scale is a power of two)."""
    def run(scaled: bool) -> torch.Tensor:
        ddp = DDP(Net())
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1,
                                      enabled=scaled)
        SlimState(optimizer=opt, density=0.02, min_compress_numel=100
                  ).set_grad_scaler(scaler).register(ddp)
        train(ddp, opt, range(8), scaler=scaler)
        assert scaler.get_scale() == (1024.0 * 2 ** 8 if scaled else 1.0)
        return flat(ddp.module)
    scaled = run(True)
    assert torch.equal(scaled, run(False)) and same_everywhere(scaled)


@pytest.mark.parametrize("push", ["slices", "signs"])
@pytest.mark.parametrize("how", ["register", "direct"])
@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adamw"])
def test_in_one_bucket_the_hook_is_distributed_optimizer(hvd: Any, adam: bool,
                                                         how: str, push: str) -> None:
    """Real DDP, every parameter in one bucket: the hook trains bit for bit as
    ``DistributedOptimizer`` over the same Gloo transport, through the warm-up into steady
    slicing (40 steps at 0.05). Registered with ``state.register(ddp)``, the exchange lays the
    parameters out by name, as ``DistributedOptimizer`` does by default; registered directly
    (``register_comm_hook``), it has no names and takes them in DDP's first bucket's order,
    the model's: ``DistributedOptimizer`` with names that sort so is its twin then. "signs":
    every coordinate's sign pushed (``value_bits=1`` at ``density=1.0``), half pulled."""
    kw = dict(density=0.05, min_compress_numel=100) if push == "slices" else \
        dict(density=1.0, value_bits=1, pull_density=0.5, pull_value_bits=8,
             min_compress_numel=100)

    def inner(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1) if adam else \
            torch.optim.SGD(params, lr=0.05, momentum=0.9)

    ddp = DDP(Net(), bucket_cap_mb=64)
    opt = inner(ddp.parameters())
    state = SlimState(optimizer=opt if adam else None, **kw)
    if how == "register":
        state.register(ddp)
    else:
        ddp.register_comm_hook(state, slim_hook)
    train(ddp, opt, range(40))

    net = Net()
    named = list(net.named_parameters()) if how == "register" else \
        [(f"p{i:03d}", p) for i, p in enumerate(net.parameters())]   # the model's order
    extra = {} if adam else {"momentum_correction": False}
    dopt = hvd.DistributedOptimizer(inner(net.parameters()), named_parameters=named, **kw,
                                    **extra)
    for t in range(40):
        x, y = batch(t, dist.get_rank())
        dopt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        dopt.step()
    assert torch.equal(flat(ddp.module), flat(net)) and same_everywhere(flat(net))
    assert dopt.comm_stats()["bytes_pushed"] < dopt.comm_stats()["dense_bytes"] / 3


class Branchy(torch.nn.Module):
    """A branch (``side``) that only rank 0 takes on odd steps: the others leave it unused,
    as a mixture of experts leaves an expert."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(24, 256), torch.nn.Linear(256, 4)
        self.side = torch.nn.Linear(256, 256)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if dist.get_rank() == 0 and self.step % 2:
            h = h + self.side(h)
        return self.fc2(h)


def test_adamw_leaves_a_locally_unused_parameters_moments_as_distributed_optimizer_does(
        hvd: Any) -> None:
    """find_unused_parameters=True and a parameter only rank 0 uses, on odd steps: each rank's
    Adam steps on its own gradients, and a parameter this rank did not use has none (torch's
    Adam passes such a parameter by), so its moments neither decay nor count a step, and it
    sends no update. The hook in one bucket then trains bit for bit as DistributedOptimizer,
    and replicas stay identical."""
    kw = dict(density=0.05, min_compress_numel=100)
    ddp = DDP(Branchy(), bucket_cap_mb=64, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
    SlimState(optimizer=opt, **kw).register(ddp)
    net = Branchy()
    named = list(net.named_parameters())   # register() lays the exchange out by name
    dopt = hvd.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.01,
                                                      weight_decay=0.1),
                                    named_parameters=named, **kw)
    for t in range(30):
        ddp.module.step = net.step = t
        x, y = batch(t, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        dopt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        dopt.step()
    assert torch.equal(flat(ddp.module), flat(net)) and same_everywhere(flat(net))


def test_a_compiled_ddp_model_takes_the_hook_bit_for_bit(hvd: Any) -> None:
    """``torch.compile`` over the DDP model (Dynamo's DDPOptimizer cuts the graph at DDP's
    buckets; aot_eager, so no C++ compiler is needed): the hook serves every backward pass of
    the compiled graph, under AdamW, and training is bit for bit the eager model's."""
    def run(compiled: bool) -> Any:
        ddp = DDP(Net())
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
        state = SlimState(optimizer=opt, density=0.05, min_compress_numel=100).register(ddp)
        net = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        train(net, opt, range(12))
        return flat(ddp.module), state.comm_stats()
    (eager, eager_stats), (compiled, stats) = run(False), run(True)
    assert torch.equal(eager, compiled) and same_everywhere(compiled)
    assert stats["steps"] == 12 and stats["bytes_pushed"] == eager_stats["bytes_pushed"]
    assert stats["bytes_pushed"] < stats["dense_bytes"] / 3, stats
