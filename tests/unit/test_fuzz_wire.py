"""Strict decoding, fuzzed (issue 6): truncated, oversized, out-of-range, bit-flipped, random and
wrong-dtype payloads for the index codec, the message decoder, the control messages and the
server. Every input ends in a WireError (or the server's RemoteError) or decodes to exactly what
its bytes say: re-encoding the result gives back the same bytes, so nothing was ignored, guessed
or read from outside the buffer. About 11,000 generated inputs in all (``max_examples`` below),
in a few seconds per test.
"""
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hvd_slim.config import SlimConfig
from hvd_slim.exchange.expect import push_expect
from hvd_slim.exchange.layout import Layout
from hvd_slim.exchange.sections import itemsizes
from hvd_slim.exchange.server import Server
from hvd_slim.wire import WireError, control
from hvd_slim.wire import message as wm
from hvd_slim.wire.indices import IDX_BITMAP, IDX_EF, decode_indices, encode_as, encoded_size
from hvd_slim.wire.values import quantize

def fuzz(examples):
    """Hypothesis settings of one fuzz test: no deadline, no example database in the tree."""
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
KINDS = [IDX_EF, IDX_BITMAP]


def _sorted_sample(rng, d, n):
    return np.sort(rng.choice(d, size=n, replace=False)).astype(np.int64)


def _check_indices(out, d, count):
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.ndim == 1
    assert len(out) == count
    if count:
        assert out[0] >= 0 and out[-1] < d and np.all(np.diff(out) > 0)


# --- the index codec -------------------------------------------------------------------------
@fuzz(3000)
@given(kind=st.sampled_from([*KINDS, 0, 3, 255, -1]), d=st.integers(0, 3000),
       count=st.integers(-2, 3002), data=st.data())
def test_index_decoder_on_arbitrary_bytes(kind, d, count, data):
    exact = kind in KINDS and 0 <= count <= d and data.draw(st.booleans())
    size = encoded_size(kind, d, count) if exact else data.draw(st.integers(0, 400))
    raw = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8)
    try:
        out = decode_indices(kind, raw, d, count)
    except WireError:
        return
    _check_indices(out, d, count)
    assert np.array_equal(encode_as(kind, out, d), raw)   # canonical: the bytes mean exactly this


@fuzz(2500)
@given(kind=st.sampled_from(KINDS), d=st.integers(1, 4000), frac=st.floats(0, 1),
       seed=st.integers(0, 2 ** 32 - 1), mutation=st.sampled_from(
           ["flip", "truncate", "extend", "count", "d", "container"]), data=st.data())
def test_index_decoder_on_damaged_encodings(kind, d, frac, seed, mutation, data):
    rng = np.random.default_rng(seed)
    idx = _sorted_sample(rng, d, int(frac * d))
    enc = encode_as(kind, idx, d)
    n, dd, buf = len(idx), d, enc.copy()
    if mutation == "flip" and len(buf):
        for _ in range(data.draw(st.integers(1, 3))):
            buf[data.draw(st.integers(0, len(buf) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif mutation == "truncate":
        buf = buf[:data.draw(st.integers(0, max(0, len(buf) - 1)))]
    elif mutation == "extend":
        buf = np.concatenate([buf, rng.integers(0, 256, data.draw(st.integers(1, 9)),
                                                dtype=np.uint8)])
    elif mutation == "count":
        n = data.draw(st.sampled_from([n - 1, n + 1, 0, d, d + 1, 2 ** 31]))
    elif mutation == "d":
        dd = data.draw(st.sampled_from([d - 1, d + 1, 2 * d, max(0, n - 1), -1]))
    else:   # the right bytes in the wrong container: never reinterpreted
        bad = data.draw(st.sampled_from(["int8", "float32", "2d", "list", "str"]))
        wrong = {"int8": lambda: buf.view(np.int8), "float32": lambda: buf.astype(np.float32),
                 "2d": lambda: buf.reshape(1, -1), "list": lambda: buf.tolist(),
                 "str": lambda: "".join(map(chr, buf))}[bad]()
        with pytest.raises(WireError):
            decode_indices(kind, wrong, d, n)
        return
    try:
        out = decode_indices(kind, buf, dd, n)
    except WireError:
        return
    _check_indices(out, dd, n)
    assert np.array_equal(encode_as(kind, out, dd), buf)
    if len(buf) != len(enc) or n != len(idx):
        pytest.fail(f"a {mutation}d payload decoded")   # the exact length check must catch these


# --- the message decoder ---------------------------------------------------------------------
def message(seed):
    """A valid message of 1-4 buckets of every mode, with what its receiver expects. Built from
    one seed (cheaper than many hypothesis draws; hypothesis picks the seeds and mutations)."""
    rng = np.random.default_rng(seed)
    sections, expect, sizes = [], [], []
    for _ in range(int(rng.integers(1, 5))):
        isz, d = int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 2001))
        mode = int(rng.choice(list(wm.MODE_NAMES)))
        # Slices of one-byte values may be scaled (value_bits=8): a power-of-two exponent.
        scaled = isz == 1 and mode in wm.SLICED and bool(rng.integers(2))
        exp = int(rng.integers(-40, 41)) if scaled else 0
        k = int(rng.integers(1, min(d, 150) + 1))
        kc = int(rng.integers(0, k + 1))
        count, idx, modes = {
            wm.M_DENSE: (d, None, {wm.M_DENSE: (d, 0)}),
            wm.M_SLICE: (k, _sorted_sample(rng, d, kc), {wm.M_SLICE: (k, kc)}),
            wm.M_EXPLICIT: (kc, _sorted_sample(rng, d, kc), {wm.M_EXPLICIT: None,
                                                             wm.M_DENSE: (d, 0)}),
            wm.M_EMPTY: (0, None, {wm.M_EMPTY: (0, 0)}),
            # a short slice, beside the full slice it stands in for
            wm.M_SHORT: (kc, _sorted_sample(rng, d, kc), {wm.M_SLICE: (k, kc),
                                                         wm.M_SHORT: None}),
            # every coordinate coded (1-bit signs and their scale), no indices
            wm.M_CODED: (4 + (d + 7) // 8, None, {wm.M_CODED: (4 + (d + 7) // 8, 0)}),
        }[mode]
        values = rng.integers(0, 256, count * isz, dtype=np.uint8)
        sections.append(wm.make_section(mode, values, d, indices=idx, exp=exp))
        expect.append(wm.Expect(d, isz, modes, scaled))
        sizes.append(isz)
    buf, _ = wm.encode(wm.PUSH, 2, 17, 0xC0FFEE, sections, sizes)
    return buf, expect, sizes


def _decode(buf, expect):
    return wm.decode(buf, kind=wm.PUSH, sender=2, step=17, digest=0xC0FFEE, expect=expect,
                     who="push from rank 2")


def _reencode(out, expect, sizes, sender=2, step=17, digest=0xC0FFEE):
    """The decoded sections, encoded again; also checks every section is self-consistent."""
    for sec, ex in zip(out, expect):
        assert len(sec.values) == sec.count * ex.itemsize
        if sec.mode in wm.INDEXED:
            _check_indices(sec.indices, ex.d, len(sec.indices))
            assert np.array_equal(encode_as(sec.idx_kind, sec.indices, ex.d), sec.idx_bytes)
        else:
            sec.indices = None
    return wm.encode(wm.PUSH, sender, step, digest, out, sizes)[0]


HEADER_FIELDS = [(4, "B"), (5, "B"), (6, "H"), (8, "I"), (12, "Q"), (20, "Q"), (28, "I")]
ENTRY_FIELDS = [(0, "B"), (1, "B"), (2, "H"), (4, "I"), (8, "I"), (12, "I")]


def damaged(buf: np.ndarray, expect, rng, mutation: str, edge: str) -> np.ndarray:
    """A copy of ``buf`` damaged one way: cut, extended, a header or table field set to an edge
    value, bytes flipped, or replaced by random bytes (keeping the magic for edge "zero")."""
    bad = buf.copy()
    if mutation == "truncate":
        return bad[:int(rng.integers(0, len(buf)))]
    if mutation == "extend":
        return np.concatenate([bad, rng.integers(0, 256, int(rng.integers(1, 65)), np.uint8)])
    if mutation in ("header", "table"):
        if mutation == "header":
            off, fmt = HEADER_FIELDS[int(rng.integers(len(HEADER_FIELDS)))]
        else:
            off, fmt = ENTRY_FIELDS[int(rng.integers(len(ENTRY_FIELDS)))]
            off += wm.HEADER.size + wm.ENTRY.size * int(rng.integers(len(expect)))
        top = 2 ** (8 * struct.calcsize(fmt)) - 1
        old = struct.unpack_from("<" + fmt, bad, off)[0]
        new = {"zero": 0, "one": 1, "max": top, "next": old + 1, "previous": max(0, old - 1),
               "random": int(rng.integers(0, top, endpoint=True, dtype=np.uint64))}[edge]
        struct.pack_into("<" + fmt, bad, off, min(new, top))
        return bad
    if mutation == "flip":
        for p in rng.integers(0, len(bad), int(rng.integers(1, 5))):
            bad[p] ^= int(rng.integers(1, 256))
        return bad
    bad = rng.integers(0, 256, int(rng.integers(0, 300)), np.uint8)   # "random"
    if edge == "zero" and len(bad) >= 8:
        bad[:8] = buf[:8]   # a valid magic/version/kind: the rest must still be checked
    return bad


@fuzz(3000)
@given(seed=st.integers(0, 2 ** 32 - 1), mutation=st.sampled_from(
    ["truncate", "extend", "header", "table", "flip", "random", "container"]),
    edge=st.sampled_from(["zero", "one", "max", "next", "previous", "random"]))
def test_message_decoder_on_damaged_messages(seed, mutation, edge):
    buf, expect, sizes = message(seed)
    assert np.array_equal(_reencode(_decode(buf, expect), expect, sizes), buf)
    rng = np.random.default_rng(seed + 1)
    if mutation != "container":
        bad = damaged(buf, expect, rng, mutation, edge)
    else:
        bad = {"zero": lambda: buf.view(np.int8), "one": lambda: buf.astype(np.float32),
               "max": lambda: buf.reshape(1, -1), "next": lambda: np.repeat(buf, 2)[::2],
               "previous": lambda: buf.tobytes(), "random": lambda: buf.tolist()}[edge]()
        with pytest.raises(WireError):
            _decode(bad, expect)
        return
    try:
        out = _decode(bad, expect)
    except (WireError, wm.RemoteError):
        return
    assert len(bad) == len(buf), "a message of the wrong length decoded"
    assert np.array_equal(_reencode(out, expect, sizes), bad)


@fuzz(1000)
@given(which=st.sampled_from(["control", "text", "description"]),
       raw=st.binary(max_size=200), flips=st.lists(st.integers(0, 10 ** 6), max_size=4),
       keep=st.integers(0, 300))
def test_control_messages_on_damaged_input(which, raw, flips, keep):
    good = {"control": control.encode_control(wm.HELLO, 1, 5, 77),
            "text": control.encode_text(wm.NONFINITE, 1, 5, 77, "NaN/Inf in 'fc.weight'"),
            "description": control.encode_description(1, 5, 77, {"params": [], "config": {}})
            }[which]
    candidates = [np.frombuffer(raw, np.uint8), good[:keep].copy(), good.copy()]
    for f in flips:
        candidates[2][f % len(good)] ^= (f >> 8) % 255 + 1
    for buf in candidates:
        try:
            if which == "control":
                out = control.decode_control(buf, kind=wm.HELLO, sender=1, step=5, digest=77,
                                             who="hello")
                assert out == (5, 77) and np.array_equal(buf, good)
            elif which == "text":
                text = control.decode_text(buf, kind=wm.NONFINITE, sender=1, step=5, digest=77,
                                           who="report")
                assert len(buf) == wm.HEADER.size + len(text.encode("utf-8", "replace")) or \
                    "\ufffd" in text
            else:
                assert isinstance(control.decode_description(buf, sender=1, step=5, digest=77,
                                                             who="description"), dict)
        except (WireError, wm.RemoteError):
            pass


# --- the server: a malformed push can neither crash it nor change it --------------------------
def _server_setup():
    cfg = SlimConfig(density=0.05, min_compress_numel=500, seed=3, warmup_decay_steps=0,
                     nonfinite="raise")   # a push summing to Inf: the ERROR path below
    named = [("w", torch.nn.Parameter(torch.zeros(40, 30))), ("b", torch.nn.Parameter(
        torch.zeros(30)))]
    layout = Layout(named, cfg, lambda dt: dt)
    return cfg, layout, Server(layout, cfg, 2, 0)


CFG, LAYOUT, _ = _server_setup()
DIGEST = 0xABC


def _push(rank, seed):
    rng = np.random.default_rng(seed)
    sections = []
    for b in LAYOUT.buckets:
        if b.kind == "dense":
            sections.append(wm.make_section(wm.M_DENSE, rng.standard_normal(b.numel)
                                            .astype(np.float32), b.numel))
        else:   # a slice as a worker sends it: scaled float8 values (value_bits=8)
            wire, exp, _ = quantize(torch.from_numpy(rng.standard_normal(b.k).astype(
                np.float32)), b.slice_dtype)
            sections.append(wm.make_section(wm.M_SLICE, wire.view(torch.uint8).numpy(),
                                            b.numel, exp=exp,
                                            indices=_sorted_sample(rng, b.numel, b.k_core)))
    return wm.encode(wm.PUSH, rank, 0, DIGEST, sections, itemsizes(LAYOUT.buckets, sections))[0]


def _server_state(server):
    return ([m.residual.clone() for m in server.memory.values()],
            [s.state_dict() for s in server.selector.values()])


@fuzz(1200)
@given(seed=st.integers(0, 2 ** 32 - 1), positions=st.lists(st.integers(0, 10 ** 6), min_size=1,
                                                          max_size=6), cut=st.integers(0, 3))
@example(seed=0, positions=[522195], cut=0)   # a valid push whose sum is Inf (found by CI)
def test_a_malformed_push_leaves_the_server_untouched(seed, positions, cut):
    _, _, server = _server_setup()
    good, bad = _push(0, seed), _push(1, seed + 1)
    for p in positions:
        bad[p % len(bad)] ^= (p >> 4) % 255 + 1
    if cut:
        bad = bad[:len(bad) - cut]
    before = _server_state(server)
    try:
        reply = server.serve([good, bad], 0, DIGEST, limit=None)
    except WireError as exc:
        assert "push from rank 1" in str(exc) or "push from rank 0" in str(exc)
        after = _server_state(server)
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        assert before[1] == after[1]   # the pull's selector untouched
        return
    # It decoded: then rank 1's bytes were a valid push, and the pull is well formed.
    expect = push_expect(LAYOUT.buckets)
    out = wm.decode(bad, kind=wm.PUSH, sender=1, step=0, digest=DIGEST, expect=expect, who="x")
    assert np.array_equal(_reencode(out, expect, itemsizes(LAYOUT.buckets, out), 1, 0, DIGEST),
                          bad)
    try:
        assert wm.peek(reply, "pull") == wm.PULL
    except wm.RemoteError as exc:
        # A valid push whose values sum to NaN/Inf (a flipped exponent bit): every rank is told
        # the step failed, and the server kept its state for the step that follows.
        assert "NaN/Inf" in str(exc) and "No rank's parameters" in str(exc), str(exc)
        after = _server_state(server)
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))


def test_undamaged_pushes_are_served():
    """The fuzzed pushes are real ones: undamaged, the server takes them and pulls."""
    _, _, server = _server_setup()
    reply = server.serve([_push(0, 1), _push(1, 2)], 0, DIGEST, limit=None)
    assert wm.peek(reply, "pull") == wm.PULL
    assert any(float(m.residual.abs().sum()) > 0 for m in server.memory.values())
