"""Tensor payloads over real Gloo processes (started the torchrun way, as in
test_torch_dist_launch.py): ``gather_tensor``/``broadcast_tensor`` agree with the numpy
collectives byte for byte and in byte accounting, and the exchange's device path (which Gloo
takes for CPU parameters) gives bitwise the host path's result with no payload through numpy.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List

import numpy as np
import pytest
import torch

from test_torch_dist_launch import launch as launch_workers
from test_torch_dist_launch import result, worker_main

pytestmark = [
    pytest.mark.slow,  # starts real processes: not in `pytest -m unit`
    pytest.mark.skipif(not torch.distributed.is_available()
                       or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with Gloo is not available"),
]


def launch(scenario: str, world: int, timeout: float = 150.0) -> Dict[int, str]:
    """This file's ``scenario`` at ranks 0..world-1, the torchrun way, under ``timeout``."""
    return launch_workers(scenario, list(range(world)), world, timeout, script=__file__)


def test_tensor_collectives_match_the_numpy_ones_at_three_ranks():
    outs = launch("tensor_collectives", 3)
    said = [result(outs[r], "tensor_collectives", r) for r in range(3)]
    assert all(s == "ok" for s in said), said


def test_the_exchange_takes_the_device_path_over_gloo_and_matches_the_host_path():
    outs = launch("exchange_paths", 2)
    said = [result(outs[r], "exchange_paths", r) for r in range(2)]
    assert all(s.startswith("ok ") for s in said), said
    assert len(set(said)) == 1, f"replicas differ: {said}"


# --- workers (run as `python test_torch_dist_tensor.py <scenario>`) ----------------------------

def _worker_tensor_collectives(rank: int, size: int) -> str:
    from hvd_slim.optim.rendezvous import torch_transport
    t = torch_transport("gloo", torch.device("cpu"))
    assert t.device_payloads(torch.device("cpu"))
    for root in range(size):
        for bound in (None, 40 + root):
            payload = np.arange(rank + root + 7, dtype=np.uint8) * (rank + 1)
            before = (t.stats.bytes_sent, t.stats.bytes_received)
            want = t.gather(payload, root, bound=bound)
            mid = (t.stats.bytes_sent, t.stats.bytes_received)
            got = t.gather_tensor(torch.from_numpy(payload.copy()), root, bound=bound)
            after = (t.stats.bytes_sent, t.stats.bytes_received)
            assert np.subtract(mid, before).tolist() == np.subtract(after, mid).tolist()
            if rank == root:
                assert [g.numpy().tolist() for g in got] == [w.tolist() for w in want]
                assert all(g.dtype == torch.uint8 for g in got)
            else:
                assert got is None and want is None
            msg = np.arange(5 + root, dtype=np.uint8) + 3 if rank == root else None
            before = (t.stats.bytes_sent, t.stats.bytes_received)
            want = t.broadcast(msg, root, bound=bound)
            mid = (t.stats.bytes_sent, t.stats.bytes_received)
            got = t.broadcast_tensor(None if msg is None else torch.from_numpy(msg.copy()), root,
                                     bound=bound, device="cpu")
            after = (t.stats.bytes_sent, t.stats.bytes_received)
            assert got.numpy().tolist() == want.tolist()
            assert np.subtract(mid, before).tolist() == np.subtract(after, mid).tolist()
    return "ok"


def _worker_exchange_paths(rank: int, size: int) -> str:
    import hvd_slim
    from hvd_slim.exchange.step import SlimExchange
    from hvd_slim.selection import backend
    from hvd_slim.transport.torch_dist import TorchDistTransport

    def run(device_path: bool) -> tuple:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 4))
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), density=0.02, min_compress_numel=500)
        for step in range(6):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert opt._exchange.path.device_payloads == device_path
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        stats = opt.comm_stats()
        return flat, (stats["bytes_pushed"], stats["bytes_pulled"])

    real = TorchDistTransport.device_payloads
    TorchDistTransport.device_payloads = lambda self, device: False
    try:
        host, host_bytes = run(False)
    finally:
        TorchDistTransport.device_payloads = real
    backend.FORCE_TORCH = True   # selection in torch ops too, as on a GPU
    big: List[tuple] = []
    real_numpy, real_step = torch.Tensor.numpy, SlimExchange.step
    armed = [False]

    def spy(self, *a, **k):
        if armed[0] and self.numel() * self.element_size() > 32 + 16 * 3:
            big.append((tuple(self.shape), self.dtype))
        return real_numpy(self, *a, **k)

    def step(self):
        armed[0] = self.step_count > 0   # step 0's handshake is host-built, by design
        try:
            return real_step(self)
        finally:
            armed[0] = False

    torch.Tensor.numpy, SlimExchange.step = spy, step
    try:
        dev, dev_bytes = run(True)
    finally:
        torch.Tensor.numpy, SlimExchange.step = real_numpy, real_step
    assert not big, f"payload-sized numpy conversions on the device path: {big[:5]}"
    assert torch.equal(host, dev), (host - dev).abs().max()
    assert host_bytes == dev_bytes, (host_bytes, dev_bytes)
    return "ok " + hashlib.sha256(dev.numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    worker_main(globals(), with_traceback=True)
