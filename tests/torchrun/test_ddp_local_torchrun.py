"""Rounds of local steps for a DDP model (``hvd_slim.ddp.local_optimizer``), every rank one
torchrun process on the default Gloo group. Checked: a DDP model with ``local_hook`` trains bit
for bit as ``DistributedOptimizer(local_steps=H)`` on the bare model (so DDP leaves each rank's
gradient untouched, and the rounds are that optimizer's); replicas differ inside a round and
are bitwise the same at its end; a checkpoint saved mid-round resumes bitwise; what cannot
work is refused by name. Every rank runs these in the same order (tests/torchrun/conftest.py)."""
from __future__ import annotations

import contextlib
import io
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_slim.config import ConfigError
from hvd_slim.exchange import ExchangeError
from hvd_slim.ddp import SlimState, local_hook, local_optimizer, slim_hook

from tests.torchrun.test_ddp_torchrun import Net, batch, flat, same_everywhere

KW = dict(density=0.05, min_compress_numel=100)
H = 3

INNER = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def local_step(module: torch.nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    x, y = batch(t, dist.get_rank())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(module(x), y).backward()
    opt.step()


@pytest.mark.parametrize("inner", sorted(INNER))
def test_a_ddp_model_in_rounds_is_distributed_optimizer_in_rounds(hvd: Any, inner: str) -> None:
    """DDP with local_optimizer against DistributedOptimizer(local_steps=3) on a bare copy of
    the model, step by step through three rounds: the same bits after every step. Inside a
    round the ranks' replicas differ (nothing was exchanged); at a round's end they are the
    same bits on every rank."""
    make: Callable[[Any], torch.optim.Optimizer] = INNER[inner]
    ddp = DDP(Net())
    opt = local_optimizer(ddp, make(ddp.parameters()), local_steps=H, **KW)
    net = Net()
    ref = hvd.DistributedOptimizer(make(net.parameters()), named_parameters=net.named_parameters(),
                                   local_steps=H, **KW)
    for t in range(3 * H):
        local_step(ddp, opt, t)
        local_step(net, ref, t)
        assert torch.equal(flat(ddp.module), flat(net)), f"step {t}"
        assert same_everywhere(flat(net)) == ((t + 1) % H == 0), f"step {t}"
    got, want = opt.comm_stats(), ref.comm_stats()
    assert got["local_steps_taken"] == 3 * H
    assert got["bytes_pushed"] == want["bytes_pushed"] > 0
    assert got["bytes_pushed"] < got["dense_bytes"] / 10


def test_a_checkpoint_saved_mid_round_resumes_bitwise(hvd: Any) -> None:
    """Saved two steps into the second round (model and the wrapped optimizer's per-rank
    state_dict) and resumed in a fresh DDP model: the run is the unbroken one."""
    full = DDP(Net())
    full_opt = local_optimizer(full, INNER["adamw"](full.parameters()), local_steps=H, **KW)
    for t in range(10):
        local_step(full, full_opt, t)

    ddp = DDP(Net())
    opt = local_optimizer(ddp, INNER["adamw"](ddp.parameters()), local_steps=H, **KW)
    for t in range(H + 2):
        local_step(ddp, opt, t)
    saved = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    ckpt = torch.load(saved, weights_only=False)
    again = DDP(Net())
    again_opt = local_optimizer(again, INNER["adamw"](again.parameters()), local_steps=H, **KW)
    again.module.load_state_dict(ckpt["model"])
    again_opt.load_state_dict(ckpt["opt"])
    for t in range(H + 2, 10):
        local_step(again, again_opt, t)
    assert torch.equal(flat(again.module), flat(full.module))


def test_what_cannot_work_is_refused_by_name(hvd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refusal comes before anything collective, so every rank raises it alike."""
    net = Net()
    with pytest.raises(TypeError, match="must be a torch.nn.parallel.DistributedDataParallel"):
        local_optimizer(net, INNER["sgd"](net.parameters()), local_steps=H)
    ddp = DDP(Net())
    with pytest.raises(ConfigError, match="local_steps=1 leaves no local steps"):
        local_optimizer(ddp, INNER["sgd"](ddp.parameters()))
    monkeypatch.setenv("HVD_SLIM_LOCAL_STEPS", "1")
    with pytest.raises(ConfigError, match="HVD_SLIM_LOCAL_STEPS"):
        local_optimizer(ddp, INNER["sgd"](ddp.parameters()))
    monkeypatch.delenv("HVD_SLIM_LOCAL_STEPS")
    with pytest.raises(TypeError, match="sets named_parameters, transport itself"):
        local_optimizer(ddp, INNER["sgd"](ddp.parameters()), local_steps=H,
                        named_parameters=[], transport="gloo")
    with pytest.raises(TypeError, match="unexpected keyword.*densty"):
        local_optimizer(ddp, INNER["sgd"](ddp.parameters()), local_steps=H, densty=0.1)
    with pytest.raises(ConfigError, match="local_steps"):   # SlimState points here
        SlimState(local_steps=H)
    hooked = DDP(Net())
    hooked.register_comm_hook(SlimState(**KW), slim_hook)
    with pytest.raises(RuntimeError, match="has a communication hook already"):
        local_optimizer(hooked, INNER["sgd"](hooked.parameters()), local_steps=H)


def test_local_hook_without_its_optimizer_fails_backward(hvd: Any) -> None:
    """Registered by hand with a plain optimizer as its state, the hook would keep gradients
    local for good: the first backward pass fails, naming local_optimizer."""
    ddp = DDP(Net())
    opt = INNER["sgd"](ddp.parameters())
    ddp.register_comm_hook(opt, local_hook)
    x, y = batch(0, dist.get_rank())
    with pytest.raises(RuntimeError, match="local_optimizer"):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()


def test_a_rank_with_other_rounds_is_named_at_the_first_step(hvd: Any) -> None:
    """The last rank asks for rounds of 2, the others of 3: the wrapped optimizer's handshake
    refuses the first step on every rank with the same message, naming that rank and the
    setting, before any rank steps."""
    n, r = hvd.size(), hvd.rank()
    ddp = DDP(Net())
    opt = local_optimizer(ddp, INNER["sgd"](ddp.parameters()), local_steps=2 if r == n - 1 else H,
                          **KW)
    with pytest.raises(ExchangeError) as info:
        local_step(ddp, opt, 0)
    messages = hvd.allgather_object(str(info.value))
    assert len(set(messages)) == 1, messages
    assert f"rank {n - 1}" in messages[0] or f"rank(s) {n - 1}" in messages[0], messages[0]
    assert "local_steps" in messages[0], messages[0]


def test_no_sync_accumulation_takes_backward_passes_per_step(hvd: Any) -> None:
    """Two backward passes a step (the first under DDP's ``no_sync()``) with
    ``backward_passes_per_step=2``: bit for bit the bare model's DistributedOptimizer doing
    the same two passes, through two rounds."""
    ddp, net = DDP(Net()), Net()
    kw = dict(KW, local_steps=H, backward_passes_per_step=2)
    opt = local_optimizer(ddp, INNER["sgd"](ddp.parameters()), **kw)
    ref = hvd.DistributedOptimizer(INNER["sgd"](net.parameters()),
                                   named_parameters=net.named_parameters(), **kw)

    def step(module: torch.nn.Module, o: torch.optim.Optimizer, t: int, first: Any) -> None:
        o.zero_grad()
        for half, ctx in ((0, first), (1, contextlib.nullcontext())):
            with ctx:
                x, y = batch(2 * t + half, dist.get_rank())
                torch.nn.functional.cross_entropy(module(x), y).backward()
        o.step()

    for t in range(2 * H):
        step(ddp, opt, t, ddp.no_sync())
        step(net, ref, t, contextlib.nullcontext())
        assert torch.equal(flat(ddp.module), flat(net)), f"step {t}"
    assert same_everywhere(flat(net))
