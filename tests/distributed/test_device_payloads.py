"""Tensor payloads under mpirun, at any world size: the MPI transport's ``gather_tensor`` /
``broadcast_tensor`` (straight through DLPack, and staged through host buffers as for CUDA
tensors without CUDA-aware MPI) against its numpy collectives, and the exchange's device path
against its host path on the tier's transport (HVD_SLIM_TRANSPORT: mpi or gloo), bitwise.
Every rank runs these tests in the same order."""
import hashlib

import numpy as np
import pytest
import torch

import hvd_slim as hvd
from hvd_slim.exchange.step import SlimExchange
from hvd_slim.selection import backend
from hvd_slim.transport import mpi_device
from hvd_slim.transport.mpi import MpiTransport
from hvd_slim.transport.torch_dist import TorchDistTransport
from hvd_slim.wire import message as wm


def counts(t):
    return t.stats.bytes_sent, t.stats.bytes_received


@pytest.mark.parametrize("staged", [False, True])
def test_mpi_tensor_payloads_match_the_numpy_collectives(hvd, monkeypatch, staged):
    if staged:   # as for CUDA tensors when MPI is not CUDA-aware
        monkeypatch.setattr(mpi_device, "_direct", lambda device: False)
    t = hvd.world_transport()
    n, r = hvd.size(), hvd.rank()
    assert not t.device_payloads(torch.device("cpu")) and t.device_payloads(torch.device("cuda"))
    for root in range(n):
        payload = (np.arange(r + root + 9) * (r + 3)).astype(np.uint8)
        a = counts(t)
        want = t.gather(payload, root)
        b = counts(t)
        got = t.gather_tensor(torch.from_numpy(payload.copy()), root)
        c = counts(t)
        assert np.subtract(b, a).tolist() == np.subtract(c, b).tolist()
        if r == root:
            assert [g.numpy().tolist() for g in got] == [w.tolist() for w in want]
        else:
            assert got is None
        msg = np.arange(6 + root, dtype=np.uint8) if r == root else None
        a = counts(t)
        want = t.broadcast(msg, root)
        b = counts(t)
        got = t.broadcast_tensor(None if msg is None else torch.from_numpy(msg.copy()), root,
                                 device="cpu")
        c = counts(t)
        assert got.numpy().tolist() == want.tolist()
        assert np.subtract(b, a).tolist() == np.subtract(c, b).tolist()


def test_cuda_awareness_is_asked_once_and_is_a_bool():
    assert isinstance(mpi_device.cuda_aware(), bool)
    assert mpi_device.cuda_aware() is mpi_device.cuda_aware()


def _train(device_path: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.ReLU(), torch.nn.Linear(96, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.02,
                                   min_compress_numel=500, nonfinite="skip")
    for step in range(6):
        g = torch.Generator().manual_seed(7919 * hvd.rank() + step)
        x, y = torch.randn(16, 48, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step == 3 and hvd.rank() == hvd.size() - 1:
            model[0].weight.grad[0, 0] = float("nan")   # a skipped step, decided by the server
        opt.step()
        assert opt._exchange.path.device_payloads == device_path
    opt.flush()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    stats = opt.comm_stats()
    return flat, (stats["bytes_pushed"], stats["bytes_pulled"], stats["skipped_steps"])


@pytest.mark.parametrize("staged", [False, True])
def test_the_device_path_equals_the_host_path_on_this_transport(hvd, monkeypatch, staged):
    for cls in (MpiTransport, TorchDistTransport):
        monkeypatch.setattr(cls, "device_payloads", lambda self, device: False)
    host, host_counts = _train(False)
    for cls in (MpiTransport, TorchDistTransport):
        monkeypatch.setattr(cls, "device_payloads", lambda self, device: True)
    monkeypatch.setattr(backend, "FORCE_TORCH", True)   # selection in torch ops, as on a GPU
    if staged:
        monkeypatch.setattr(mpi_device, "_direct", lambda device: False)
    big = []
    real_numpy, real_step = torch.Tensor.numpy, SlimExchange.step
    armed = [False]

    def spy(self, *a, **k):
        out = real_numpy(self, *a, **k)
        if armed[0] and self.numel() * self.element_size() > 32 + 16 * 3 and not (
                out.dtype == np.uint8 and out[:4].tobytes() == wm.MAGIC
                and int(out[5]) in wm.TEXT_KINDS):   # a skip verdict or a report: text
            big.append((tuple(self.shape), self.dtype))
        return out

    def step(self):
        armed[0] = self.step_count > 0 and not staged   # staging copies to the host by design
        try:
            return real_step(self)
        finally:
            armed[0] = False

    monkeypatch.setattr(torch.Tensor, "numpy", spy)
    monkeypatch.setattr(SlimExchange, "step", step)
    dev, dev_counts = _train(True)
    assert not big, big[:5]
    assert torch.equal(host, dev) and host_counts == dev_counts
    digests = hvd.allgather_object(hashlib.sha256(dev.numpy().tobytes()).hexdigest())
    assert len(set(digests)) == 1
