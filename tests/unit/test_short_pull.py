"""A short pull slice (wire mode M_SHORT, exchange/server.py's ``_slice_pull``): when the server's
residual holds fewer non-zeros than the pull's core, the core is those non-zeros padded with
zeros and exploration adds only zeros; the server then sends the non-zeros alone. Checked
against the full slice the same run sends with the short path switched off: the same bits on
every rank at every step, fewer bytes, and none of it at a packed pull (whose code has no zero)."""
from __future__ import annotations

import zlib

import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.selection import CoreSelector
from hvd_slim.transport import run_ranks
from hvd_slim.wire import message as wm

SHAPES = {"fc1.weight": (300, 200), "fc2.weight": (50, 300), "fc2.bias": (50,)}


def grad_for(rank, step, name, shape):
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}|{step}|{name}".encode()))
    return torch.randn(shape, generator=g)


def run(size, steps, **kw):
    """``steps`` exchanges on ``size`` simulated ranks: per rank, each step's pulled gradients
    and the bytes it pulled."""
    config = SlimConfig(min_compress_numel=1000, seed=5, **kw)

    def body(rank, tr):
        named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, tr)
        pulled = []
        for t in range(steps):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            pulled.append([p.grad.clone() for _, p in named])
        return pulled, ex.stats.bytes_pulled
    return run_ranks(size, body, timeout=60)


@pytest.fixture
def pull_modes(monkeypatch):
    """The modes of every pulled section any rank decodes (cleared by the test between runs)."""
    seen, decode = [], wm.decode

    def spy(*args, **kwargs):
        out = decode(*args, **kwargs)
        if kwargs.get("kind") == wm.PULL:
            seen.extend(s.mode for s in out)
        return out
    monkeypatch.setattr(wm, "decode", spy)
    return seen


@pytest.fixture
def full_slices(monkeypatch):
    """Switch the short path off: the selector always fills a short set up with zeros."""
    def switch_off():
        original = CoreSelector.select_magnitude

        def never_short(self, a, k, ties=0, short=False, **kw):
            return original(self, a, k, ties, **kw)
        monkeypatch.setattr(CoreSelector, "select_magnitude", never_short)
    return switch_off


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_short_selection_is_every_positive_entry(backend):
    a = torch.zeros(1000)
    a[[5, 17, 400, 999]] = torch.tensor([1.0, -2.0, 0.5, -0.1])
    assert CoreSelector(backend=backend).select_magnitude(a, 10, short=True).tolist() == \
        [5, 17, 400, 999]
    # Without short the zeros fill it up, by lowest index.
    assert CoreSelector(backend=backend).select_magnitude(a, 10).tolist() == \
        [0, 1, 2, 3, 4, 5, 6, 17, 400, 999]
    # With enough positive entries, short changes nothing.
    b = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(CoreSelector(backend=backend).select_magnitude(b, 10, short=True),
                       CoreSelector(backend=backend).select_magnitude(b, 10))


# A pull 4x the push, from a warm-up starting 8x denser: a lone rank's pull asks for twice what
# its push holds, three ranks' for about two thirds of their union.
SETTINGS = dict(density=0.02, pull_density=0.08, warmup_decay_steps=4, value_bits=8)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_short_pull_delivers_the_full_slices_bits_in_fewer_bytes(size, full_slices,
                                                                    pull_modes):
    short = run(size, 6, **SETTINGS)
    assert wm.M_SHORT in pull_modes
    pull_modes.clear()
    full_slices()
    full = run(size, 6, **SETTINGS)
    assert pull_modes and wm.M_SHORT not in pull_modes
    for (got, short_bytes), (want, full_bytes) in zip(short, full):
        assert all(torch.equal(a, b) for s, w in zip(got, want) for a, b in zip(s, w))
        assert short_bytes < full_bytes
    for rank in short[1:]:   # every replica the same bits
        assert all(torch.equal(a, b) for s, w in zip(rank[0], short[0][0]) for a, b in zip(s, w))


def test_a_packed_pull_is_never_short(full_slices, pull_modes):
    """At 2 bits a code has no zero, so the zeros a slice is filled with deliver something."""
    settings = dict(SETTINGS, pull_value_bits=2)
    short = run(1, 4, **settings)
    assert pull_modes and wm.M_SHORT not in pull_modes
    full_slices()
    full = run(1, 4, **settings)
    assert short[0][1] == full[0][1]
    assert all(torch.equal(a, b) for s, w in zip(short[0][0], full[0][0]) for a, b in zip(s, w))
