"""What stays at the sent coordinates, written by one scatter (``left``) instead of subtracting
what was delivered: the worker and the server hand ``ResidualMemory.update`` their gathered
values less the delivered ones wherever the memory takes them (up to a sixth of the buffer,
so the automatic warm-up's denser slices too). Both ways must leave bitwise the same residual
and velocity, or a warm-up step would change the training it only makes cheaper."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.memory import ResidualMemory
from hvd_slim.wire.values import FP8, quantize


def _memory(numel: int, seed: int, momentum: bool) -> ResidualMemory:
    g = torch.Generator().manual_seed(seed)
    mem = ResidualMemory(numel, torch.float32, torch.device("cpu"),
                         **({"momentum": 0.9} if momentum else {}))
    mem.residual.copy_(torch.randn(numel, generator=g) * 1e-3)
    mem.residual[:7] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, 1.0, -1.0])
    if momentum:
        mem.velocity.copy_(torch.randn(numel, generator=g))
    return mem


@pytest.mark.parametrize("density", [0.02, 0.057, 0.16])
@pytest.mark.parametrize("momentum", [False, True])
def test_left_scatter_is_bitwise_the_subtraction(density, momentum):
    numel = 20_000
    k = int(density * numel)
    g = torch.Generator().manual_seed(1)
    # The worker's order: the core ascending, then its exploration ascending.
    perm = torch.randperm(numel, generator=g)[:k]
    sent = torch.cat([perm[: k - k // 10].sort().values, perm[k - k // 10:].sort().values])
    sent[:2] = torch.tensor([0, 1])   # the signed zeros are sent too
    by_sub, by_left = _memory(numel, 2, momentum), _memory(numel, 2, momentum)
    values = by_sub.residual.index_select(0, sent)
    _, _, delivered = quantize(values, FP8)
    assert by_left.takes_left(k)
    left = values.clone().sub_(delivered)
    by_sub.update(sent, delivered, mask_velocity=0.5)
    by_left.update(sent, delivered, mask_velocity=0.5, left=left)
    assert torch.equal(by_sub.residual.view(torch.int32), by_left.residual.view(torch.int32))
    if momentum:
        assert torch.equal(by_sub.velocity, by_left.velocity)


def test_the_scatter_stops_at_a_sixth_of_the_buffer():
    mem = ResidualMemory(1200, torch.float32, torch.device("cpu"))
    assert mem.takes_left(200) and not mem.takes_left(201)
    # Above it, a left handed in is not what is written: the subtraction runs.
    mem.residual.fill_(1.0)
    sent = torch.arange(500)
    mem.update(sent, torch.full((500,), 0.25), left=torch.full((500,), 7.0))
    assert torch.equal(mem.residual[:500], torch.full((500,), 0.75))
