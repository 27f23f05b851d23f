"""Horovod's ``broadcast_optimizer_state`` on a fresh hvd_slim optimizer: the step it makes on
zero gradients to create the state must run no Slim-DP exchange (nothing counted, the step
counter untouched), as Horovod's own optimizer runs no allreduce there. Horovod itself is
stood in for by a function of the same name in a ``horovod.*`` module; the real one runs in
the Horovod tier (tests/horovod/check_horovod.py)."""
import types

import pytest
import torch

import hvd_slim
from hvd_slim.transport import run_ranks

# What Horovod 0.28.1 does for a fresh optimizer that is not its own DistributedOptimizer.
_INIT_SOURCE = '''
def {name}(optimizer, root_rank=0):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = p.data.new(p.size()).zero_()
    optimizer.step()
'''


def fake_init(module: str, name: str = "broadcast_optimizer_state"):
    mod = types.ModuleType(module)
    exec(compile(_INIT_SOURCE.format(name=name), f"<{module}>", "exec"), mod.__dict__)
    return getattr(mod, name)


def _net():
    return torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.ReLU(), torch.nn.Linear(60, 3))


torch.manual_seed(0)
_START = _net().state_dict()   # one start for every simulated rank (threads share torch's RNG)


def model_and_opt(transport):
    model = _net()
    model.load_state_dict(_START)
    opt = hvd_slim.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters(),
                                        transport=transport, min_compress_numel=1000)
    return model, opt


def values(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("scheduler", [False, True])
def test_horovods_state_initialisation_runs_no_exchange(scheduler):
    """Every rank creates the state locally; training afterwards exchanges and agrees."""
    init = fake_init("horovod.torch.functions")

    def body(rank, tr):
        model, opt = model_and_opt(tr)
        if scheduler:   # torch wraps opt.step to count calls: looked through
            torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        before = values(model).clone()
        init(opt)
        stats = opt.comm_stats()
        assert (stats["steps"], stats["bytes_pushed"], stats["bytes_pulled"]) == (0, 0, 0), stats
        assert opt._exchange.step_count == 0
        assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
        assert torch.equal(values(model), before)   # zero gradients, no weight decay
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 40, generator=g)).pow(2).mean().backward()
            opt.step()
        assert opt.comm_stats()["steps"] == 2 and opt._exchange.step_count == 2
        return values(model)

    out = run_ranks(3, body, timeout=60)
    assert all(torch.equal(out[0], v) for v in out[1:])


@pytest.mark.parametrize("module,name", [("mypackage.utils", "broadcast_optimizer_state"),
                                         ("horovod.torch.functions", "some_other_helper")])
def test_any_other_caller_still_gets_the_exchange(module, name):
    """Only Horovod's broadcast_optimizer_state is recognised: a user's step() on zero
    gradients is an ordinary, collective step."""
    call = fake_init(module, name)

    def body(rank, tr):
        _, opt = model_and_opt(tr)
        call(opt)
        return opt.comm_stats()["steps"], opt._exchange.step_count

    assert run_ranks(2, body, timeout=60) == [(1, 1), (1, 1)]
