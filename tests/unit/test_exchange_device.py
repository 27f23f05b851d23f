"""The exchange's device path (exchange/wirepath.py: messages as tensors on the parameters'
device) against its host path, over the in-process fake transport on CPU tensors: bitwise the
same pulled updates, the same message bytes on the wire, the same byte counts, and no payload
ever turned into a numpy array (on a GPU: copied to the host)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.exchange.stats import ExchangeStats
from hvd_slim.selection import backend
from hvd_slim.transport import run_ranks
from hvd_slim.transport.fake import FakeTransport

from test_exchange import grad_for, make_params

TIMINGS = ExchangeStats.TIMINGS


@pytest.fixture
def wire_log(monkeypatch):
    """Every payload each rank sends or receives, as bytes, in order."""
    log = {}

    def record(rank, what, buf):
        data = buf.numpy().tobytes() if isinstance(buf, torch.Tensor) else buf.tobytes()
        log.setdefault(rank, []).append((what, data))

    for name in ("gather", "gather_tensor", "broadcast", "broadcast_tensor"):
        real = getattr(FakeTransport, name)

        def spy(self, payload, root, *a, _real=real, _name=name, **k):
            if payload is not None:
                record(self.rank, _name.split("_")[0] + " sent", payload)
            out = _real(self, payload, root, *a, **k)
            for buf in (out if isinstance(out, list) else [] if out is None else [out]):
                record(self.rank, _name.split("_")[0] + " got", buf)
            return out

        monkeypatch.setattr(FakeTransport, name, spy)
    return log


def simulate(device_payloads, size=3, steps=6, dtype=torch.float32, poison=None, wire=None,
             **cfg):
    config = SlimConfig(min_compress_numel=1000, **cfg)

    def rank_fn(rank, transport):
        named = make_params(dtype)
        ex = SlimExchange(Layout(named, config, wire or (lambda dt: dt)), config, transport)
        assert ex.path.device_payloads == device_payloads
        out = []
        for t in range(steps):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape, dtype)
                if poison and (rank, t) == poison[:2]:
                    p.grad.view(-1)[7] = poison[2]
            try:
                ok = ex.step()
            except Exception as exc:  # noqa: BLE001 - compared between the paths
                out.append(f"{type(exc).__name__}: {exc}")
                continue
            out.append((ok, torch.cat([p.grad.reshape(-1).double() for _, p in named])))
        try:
            ex.flush()
            out.append(torch.cat([p.grad.reshape(-1).double() for _, p in named
                                  if p.grad is not None]))
        except Exception as exc:  # noqa: BLE001 - compared between the paths
            out.append(f"{type(exc).__name__}: {exc}")
        stats = {k: v for k, v in ex.stats.as_dict().items() if k not in TIMINGS}
        state = ex.state_dict()
        state["stats"] = {k: v for k, v in state["stats"].items() if k not in TIMINGS}
        return out, stats, state

    return run_ranks(size, rank_fn, device_payloads=device_payloads)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):   # bitwise (a skipped step leaves NaN in its grads)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


CASES = [dict(), dict(pull="union"), dict(density=0.3),
         dict(size=1), dict(size=2, server_rank=1), dict(magnitude_weight=0.5),
         dict(dtype=torch.float64), dict(wire=lambda dt: torch.float16),
         dict(poison=(1, 2, float("nan")), nonfinite="skip"),
         dict(poison=(0, 3, float("inf")), nonfinite="raise"),
         dict(servers=3), dict(servers=2, pull="union"),
         dict(servers=3, poison=(1, 2, float("nan")), nonfinite="skip")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}" for k in c) or "default")
def test_device_path_is_bitwise_the_host_path(case, wire_log):
    host = simulate(False, **case)
    host_log = {r: list(v) for r, v in wire_log.items()}
    wire_log.clear()
    dev = simulate(True, **case)
    assert same(host, dev)
    assert host_log == wire_log   # the same bytes, in the same order, on every rank


def test_with_torch_selection_nothing_payload_sized_goes_through_numpy(monkeypatch):
    """FORCE_TORCH runs selection and exploration in torch ops as on a GPU: then, after the
    first step's handshake, no tensor bigger than a header and table becomes a numpy array."""
    want = simulate(False, steps=5)
    monkeypatch.setattr(backend, "FORCE_TORCH", True)
    limit = 32 + 16 * 3   # the header and a table of at most three buckets
    big = []
    real_numpy, real_tolist = torch.Tensor.numpy, torch.Tensor.tolist

    def spy_numpy(self, *a, **k):
        if getattr(spy_numpy, "armed", False) and self.numel() * self.element_size() > limit:
            big.append(("numpy", tuple(self.shape), self.dtype))
        return real_numpy(self, *a, **k)

    def spy_tolist(self, *a, **k):
        if getattr(spy_numpy, "armed", False) and self.numel() * self.element_size() > limit:
            big.append(("tolist", tuple(self.shape), self.dtype))
        return real_tolist(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "numpy", spy_numpy)
    monkeypatch.setattr(torch.Tensor, "tolist", spy_tolist)
    real_step = SlimExchange.step

    def step(self):
        spy_numpy.armed = self.step_count > 0   # the handshake (step 0) is host-built
        try:
            return real_step(self)
        finally:
            spy_numpy.armed = False

    monkeypatch.setattr(SlimExchange, "step", step)
    got = simulate(True, steps=5)
    assert not big, big[:5]
    assert same(want, got)


def test_a_malformed_push_on_the_device_path_names_the_sender(monkeypatch):
    """Strict decoding holds on the device path: a damaged push ends in the same error on
    every rank, and the server's state is untouched."""
    real = FakeTransport.gather_tensor

    def damage(self, payload, root, *a, **k):
        if self.rank == 2:
            payload = payload[:-1].clone()   # one byte short
        return real(self, payload, root, *a, **k)

    monkeypatch.setattr(FakeTransport, "gather_tensor", damage)
    out = simulate(True, steps=1)
    errors = {o[0][0] for o in out}   # the step's outcome on each rank (the flush fails too)
    assert len(errors) == 1
    (msg,) = errors
    assert msg.startswith("ExchangeError") and "push from rank 2" in msg and "bytes" in msg


def test_values_at_misaligned_offsets_are_read_correctly():
    """from_bytes on a tensor view whose offset is not a multiple of the itemsize."""
    from hvd_slim.wire.views import from_bytes
    x = torch.arange(10, dtype=torch.float32)
    raw = torch.cat([torch.zeros(3, dtype=torch.uint8), x.view(torch.uint8)])
    got = from_bytes(raw[3:], torch.float32)
    assert torch.equal(got, x)
    assert from_bytes(raw[:0], torch.float32).numel() == 0
    assert np.array_equal(from_bytes(x.view(torch.uint8).numpy(), torch.float32).numpy(),
                          x.numpy())


def test_both_wire_paths_meet_the_wirepath_contract():
    """HostPath and DevicePath are separate classes; each has every member of WirePath, the
    contract the worker, server and step are written against."""
    from hvd_slim.exchange.wirepath import DevicePath, HostPath, WirePath

    for path in (HostPath(), DevicePath(torch.device("cpu"))):
        assert isinstance(path, WirePath), type(path).__name__
    assert not issubclass(DevicePath, HostPath)
