"""The byte bound of a ``pull="union"`` message (expect.message_bound of expect.pull_expect), which
fixed-size transports (Gloo, NCCL) pad every pull to: it must be tight (the explicit section of
the at most ``size * k`` coordinates the workers pushed, not dense) and safe (every pull the
server really builds fits), and padding to it must not change any result."""
import random
import zlib

import numpy as np
import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.exchange.expect import (explicit_section_bound, message_bound, pull_expect,
                                      push_expect)
from hvd_slim.transport import run_ranks
from hvd_slim.transport.fake import FakeTransport
from hvd_slim.wire import message as wm
from hvd_slim.wire.indices import index_bytes_bound

SHAPES = {"fc1.weight": (400, 500), "fc2.weight": (100, 400), "fc2.bias": (100,)}


def layout_for(config, dtype=torch.float32):
    named = [(n, torch.nn.Parameter(torch.zeros(s, dtype=dtype))) for n, s in SHAPES.items()]
    return named, Layout(named, config, lambda dt: dt)


def dense_bound(layout):
    """What the pull's bound was before: every compressed bucket at dense size."""
    return wm.HEADER.size + sum(wm.ENTRY.size + b.numel * b.value_bytes for b in layout.buckets)


def test_explicit_bytes_never_shrink_as_the_count_grows():
    """message_bound takes the largest count as the worst case: values of one byte or more
    outgrow the at most one-byte drops of the index encoding (where Elias-Fano's split moves)."""
    rng = random.Random(5)
    for d in list(range(1, 400)) + [rng.randrange(400, 3_000_000) for _ in range(25)]:
        # Beyond small d: random counts, and those where Elias-Fano's low-bit width changes.
        near = [rng.randrange(d) for _ in range(300)] + [d // 2 ** s for s in range(22)]
        counts = range(d + 1) if d < 400 else sorted(
            {n + j for n in near for j in range(-2, 3) if 0 <= n + j <= d})
        prev_n, prev = None, None
        for n in counts:
            now = explicit_section_bound(d, n, 1)
            if prev is not None and n == prev_n + 1:
                assert now >= prev, (d, n, prev, now)
            prev_n, prev = n, now


@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_union_bound_is_the_pushed_coordinates_not_dense(size):
    config = SlimConfig(density=0.01, pull="union", min_compress_numel=1000)
    _, layout = layout_for(config)
    (b,) = layout.sparse
    tight = message_bound(pull_expect(layout.buckets, "union", size=size))
    n = size * b.k
    assert tight == dense_bound(layout) - b.numel * 4 + n * 4 + index_bytes_bound(b.numel, n)
    assert tight < 0.1 * dense_bound(layout), (tight, dense_bound(layout))
    # Without the world size nothing is known: the dense bound, as before.
    assert message_bound(pull_expect(layout.buckets, "union")) == dense_bound(layout)
    # The modes are unchanged: explicit indices or dense (the count limit is tested below).
    assert [ex.modes for ex in pull_expect(layout.buckets, "union", size=size)] == \
        [ex.modes for ex in pull_expect(layout.buckets, "union")]


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_a_union_pull_with_more_than_the_pushed_coordinates_is_refused(path):
    """The bound is also a check: an explicit section over more than ``size * k`` coordinates
    cannot come from this job's server, so decoding it fails, naming the bucket and the limit."""
    from hvd_slim.wire import message_torch as wt
    size = 2
    config = SlimConfig(density=0.01, pull="union", min_compress_numel=1000)
    _, layout = layout_for(config)
    expect = pull_expect(layout.buckets, "union", size=size)
    (sparse_at,) = [i for i, b in enumerate(layout.buckets) if b in layout.sparse]
    most = size * layout.buckets[sparse_at].k

    def message(n):
        sections, sizes = [], []
        for i, b in enumerate(layout.buckets):
            idx = np.arange(n, dtype=np.int64) * 3 if i == sparse_at else None
            vals = np.ones(n if i == sparse_at else b.numel, np.float32)
            if path == "numpy":
                sections.append(wm.make_section(wm.M_EXPLICIT if i == sparse_at else wm.M_DENSE,
                                                vals, b.numel, indices=idx))
            else:
                sections.append(wt.make_section(
                    wm.M_EXPLICIT if i == sparse_at else wm.M_DENSE, torch.from_numpy(vals),
                    b.numel, None if idx is None else torch.from_numpy(idx)))
            sizes.append(4)
        enc = wm.encode if path == "numpy" else \
            lambda *a: wt.encode(*a, torch.device("cpu"))
        return enc(wm.PULL, 0, 0, 7, sections, sizes)[0]

    dec = wm.decode if path == "numpy" else wt.decode
    kw = dict(kind=wm.PULL, sender=0, step=0, digest=7, expect=expect, who="pull from rank 0")
    got = dec(message(most), **kw)
    assert len(got[sparse_at].indices) == most
    with pytest.raises(wm.WireError, match=rf"pull from rank 0: bucket {sparse_at}: "
                                           rf"{most + 1} values .* at most {most}"):
        dec(message(most + 1), **kw)
    # Without the world size, any count up to d is accepted, as before.
    loose = pull_expect(layout.buckets, "union")
    assert len(dec(message(most + 1), **{**kw, "expect": loose})[sparse_at].indices) == most + 1


def test_union_bound_caps_at_dense_when_the_workers_cover_everything():
    config = SlimConfig(density=0.4, pull="union", min_compress_numel=1000, exploration=0.0)
    _, layout = layout_for(config)
    assert layout.sparse
    bound = message_bound(pull_expect(layout.buckets, "union", size=3))
    assert bound == dense_bound(layout)


def test_push_and_pull_expectations_keep_their_shape():
    """expect.py's one helper behind push_expect and pull_expect: each mode and count as before."""
    config = SlimConfig(density=0.01, min_compress_numel=1000)
    _, layout = layout_for(config)
    (s,) = layout.sparse

    def modes(expect, sparse):   # dense buckets always travel dense outside a flush
        want = [sparse if b is s else {wm.M_DENSE: (b.numel, 0)} for b in layout.buckets]
        assert [ex.modes for ex in expect] == want
        # Slices travel as scaled 8-bit values (value_bits=8); dense and explicit as float32.
        sliced = wm.M_SLICE in sparse
        assert [(ex.d, ex.itemsize, ex.scaled) for ex in expect] == [
            (b.numel, 1, True) if b is s and sliced else (b.numel, 4, False)
            for b in layout.buckets]

    modes(push_expect(layout.buckets), {wm.M_SLICE: (s.k, s.k_core)})
    # A slim pull may also come short: fewer values than its core, none of them zero.
    slim = pull_expect(layout.buckets, "slim")
    modes(slim, {wm.M_SLICE: (s.k_pull, s.k_pull_core), wm.M_SHORT: None})
    assert slim[s.index].most_explicit == s.k_pull_core - 1
    assert message_bound(slim) == message_bound(
        [wm.Expect(ex.d, ex.itemsize, {m: c for m, c in ex.modes.items() if c is not None},
                   ex.scaled) for ex in slim])   # never larger than the full slice
    modes(pull_expect(layout.buckets, "union"), {wm.M_EXPLICIT: None,
                                                 wm.M_DENSE: (s.numel, 0)})
    flushed = [{wm.M_DENSE: (b.numel, 0)} if b is s else {wm.M_EMPTY: (0, 0)}
               for b in layout.buckets]
    for expect in (push_expect(layout.buckets, flush=True),
                   pull_expect(layout.buckets, "slim", flush=True),
                   pull_expect(layout.buckets, "union", flush=True, size=3)):
        assert [ex.modes for ex in expect] == flushed


def grad_for(rank, step, name, shape):
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}|{step}|{name}".encode()))
    return torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(4)


class PaddingTransport(FakeTransport):
    """A fake rank that moves what Gloo moves: every payload padded to the announced bound
    (plus its length word). Records each broadcast's bound and payload size."""

    def __init__(self, cluster, rank):
        super().__init__(cluster, rank)
        self.pulls = []

    def broadcast(self, payload, root, bound=None):
        out = super().broadcast(payload, root, bound)
        if wm.peek(out, "test") == wm.PULL:   # not the first step's handshake replies
            self.pulls.append((bound, len(out)))
        extra = 0 if bound is None else bound - len(out)
        self.stats.record("padding", extra if self.rank == root else 0, extra)
        return out


def run_union(size, steps, transport_cls, density=0.01, warmup=0):
    """``steps`` union exchanges on ``size`` simulated ranks, each over ``transport_cls``; per
    rank: the pulled gradients, the transport and the layout. ``warmup``: decay steps."""
    config = SlimConfig(density=density, pull="union", min_compress_numel=1000, seed=3,
                        warmup_decay_steps=warmup)

    def body(rank, fake):
        tr = transport_cls(fake._c, rank)   # the same simulated cluster, another endpoint class
        named, layout = layout_for(config)
        ex = SlimExchange(layout, config, tr)
        pulled = []
        for t in range(steps):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            pulled.append({name: p.grad.clone() for name, p in named})
        return pulled, tr, layout

    return run_ranks(size, body)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_union_pull_fits_the_tight_bound(size):
    """The server's real pulls never exceed the bound every rank computes from the world size,
    and come close to it (the workers' slices barely overlap here)."""
    res = run_union(size, 4, PaddingTransport)
    layout = res[0][2]
    tight = message_bound(pull_expect(layout.buckets, "union", size=size))
    for _, tr, _ in res:
        assert tr.pulls and all(n <= tight for _, n in tr.pulls), (tight, tr.pulls)
        assert max(n for _, n in tr.pulls) > 0.8 * tight, (tight, tr.pulls)
    assert tight < 0.1 * dense_bound(layout)


def test_during_a_warmup_every_union_pull_fits_its_steps_bound():
    """The slices shrink step by step; each pull's bound follows its step's slice sizes."""
    res = run_union(3, 4, PaddingTransport, warmup=6)
    layout = res[0][2]
    want = [message_bound(pull_expect(layout.at_step(t), "union", size=3))
            for t in range(4)]
    assert want == sorted(want, reverse=True) and want[0] > want[-1]
    for _, tr, _ in res:
        assert [bound for bound, _ in tr.pulls] == want
        assert all(n <= bound for bound, n in tr.pulls), tr.pulls


@pytest.mark.parametrize("size", [2, 3])
def test_union_pull_over_a_padding_transport_moves_far_less_than_dense(size):
    plain = run_union(size, 3, FakeTransport)
    padded = run_union(size, 3, PaddingTransport)
    layout = padded[0][2]
    for (a, _, _), (b, tr, _) in zip(plain, padded):
        for t in range(3):   # padding changes no result
            for name in SHAPES:
                assert torch.equal(a[t][name], b[t][name]), (t, name)
        assert all(bound < 0.1 * dense_bound(layout) for bound, _ in tr.pulls), tr.pulls
    received = np.mean([tr.stats.per_op["broadcast"][1] + tr.stats.per_op["padding"][1]
                        for _, tr, _ in padded])
    assert received < 0.1 * 3 * dense_bound(layout), received
