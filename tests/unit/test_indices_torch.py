"""The torch index codec (wire/indices_torch.py) against the numpy one (wire/indices.py): bitwise
the same bytes and the same choice of encoding, the same decoded indices, and the same strict
refusals (the same WireError, message included) on arbitrary and corrupted input. Runs on CPU
tensors; the code has no device-specific branch, so a GPU runs the same ops."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_slim.wire import indices as npi
from hvd_slim.wire import indices_torch as ti
from hvd_slim.wire.errors import WireError
from hvd_slim.wire.indices import IDX_BITMAP, IDX_EF, encoded_size

KINDS = (IDX_EF, IDX_BITMAP)


def fuzz(examples):
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@st.composite
def index_sets(draw):
    """(sorted unique int64 indices, d), from empty to full, tiny to large d."""
    d = draw(st.one_of(st.integers(1, 70), st.integers(71, 300_000)))
    density = draw(st.sampled_from([0.0, 1e-4, 1e-3, 0.01, 0.1, 0.3, 0.7, 1.0]))
    n = min(d, draw(st.integers(0, 3)) if density == 0 else max(1, int(density * d)), 20_000)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    return np.sort(rng.choice(d, n, replace=False)).astype(np.int64), d


def outcome(fn):
    """("ok", result as numpy) or ("error", type, message) of ``fn()``."""
    try:
        out = fn()
    except (WireError, ValueError) as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", out.numpy() if isinstance(out, torch.Tensor) else out)


def same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    return np.array_equal(a[1], b[1]) if a[0] == "ok" else a == b


@fuzz(400)
@given(index_sets())
def test_same_bytes_choice_and_round_trip(case):
    idx, d = case
    t = torch.from_numpy(idx)
    for kind in KINDS:
        ref = npi.encode_as(kind, idx, d)
        got = ti.encode_as(kind, t, d)
        assert got.dtype == torch.uint8 and got.dim() == 1
        assert np.array_equal(got.numpy(), ref)
        back = ti.decode_indices(kind, got, d, idx.size)
        assert back.dtype == torch.int64 and np.array_equal(back.numpy(), idx)
    kind, buf = ti.encode_indices(t, d)
    ref_kind, ref_buf = npi.encode_indices(idx, d)
    assert kind == ref_kind and np.array_equal(buf.numpy(), ref_buf)


@pytest.mark.parametrize("d,idx", [
    (1, []), (1, [0]), (2, [1]), (8, list(range(8))), (9, [8]), (1000, list(range(1000))),
    (1000, []), (1000, [0, 999]), (1000, list(range(0, 1000, 2))), (2 ** 40, [0, 5, 2 ** 40 - 1]),
    (2 ** 62, [2 ** 61, 2 ** 62 - 1]), (11_700_000, None)])
def test_edge_cases(d, idx):
    if idx is None:   # large d at density 0.01, as a ResNet-18-sized bucket
        idx = np.sort(np.random.default_rng(1).choice(d, d // 100, replace=False))
    a = np.asarray(idx, dtype=np.int64)
    kind, buf = ti.encode_indices(torch.from_numpy(a), d)
    ref_kind, ref_buf = npi.encode_indices(a, d)
    assert kind == ref_kind and np.array_equal(buf.numpy(), ref_buf)
    assert np.array_equal(ti.decode_indices(kind, buf, d, a.size).numpy(), a)


def test_pack_and_unpack_match_numpy_on_every_byte_and_length():
    data = torch.arange(256, dtype=torch.uint8)
    assert np.array_equal(ti.unpack_bits(data).numpy(), np.unpackbits(data.numpy()))
    rng = np.random.default_rng(0)
    for n in range(0, 70):
        bits = (rng.random(n) < 0.5).astype(np.uint8)
        assert np.array_equal(ti.pack_bits(torch.from_numpy(bits)).numpy(), np.packbits(bits))
    odd = torch.from_numpy((rng.random(81) < 0.5).astype(np.uint8))[1:]   # unaligned view
    assert np.array_equal(ti.pack_bits(odd).numpy(), np.packbits(odd.numpy()))


@pytest.mark.parametrize("bad,d", [([3, 3], 10), ([5, 2], 10), ([-1, 2], 10), ([0, 10], 10),
                                   ([[1, 2]], 10), ([0.5], 10)])
def test_bad_input_is_refused_the_same_way(bad, d):
    a = np.array(bad)
    ref = outcome(lambda: npi.encode_indices(a, d))
    got = outcome(lambda: ti.encode_indices(torch.from_numpy(a), d))
    assert ref[0] == got[0] == "error" and ref[1] == got[1] == "ValueError"
    if a.ndim == 1 and a.dtype.kind == "i":
        assert ref == got


@fuzz(3000)
@given(kind=st.sampled_from([*KINDS, 0, 3]), d=st.integers(0, 3000),
       count=st.integers(-2, 3002), data=st.data())
def test_arbitrary_bytes_decode_identically(kind, d, count, data):
    exact = kind in KINDS and 0 <= count <= d and data.draw(st.booleans())
    size = encoded_size(kind, d, count) if exact else data.draw(st.integers(0, 400))
    raw = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8).copy()
    ref = outcome(lambda: npi.decode_indices(kind, raw, d, count))
    got = outcome(lambda: ti.decode_indices(kind, torch.from_numpy(raw), d, count))
    assert same(ref, got), (ref, got)


@fuzz(2000)
@given(case=index_sets(), kind=st.sampled_from(KINDS), data=st.data())
def test_corrupted_payloads_decode_identically(case, kind, data):
    """A valid encoding with a bit flipped, a byte dropped or added, or a wrong count."""
    idx, d = case
    raw = npi.encode_as(kind, idx, d).copy()
    n = idx.size
    how = data.draw(st.sampled_from(["flip", "drop", "add", "count"]))
    if how == "flip" and raw.size:
        pos = data.draw(st.integers(0, raw.size * 8 - 1))
        raw[pos // 8] ^= np.uint8(1 << (pos % 8))
    elif how == "drop" and raw.size:
        raw = raw[:-1].copy()
    elif how == "add":
        raw = np.append(raw, np.uint8(data.draw(st.integers(0, 255))))
    else:
        n = data.draw(st.integers(0, d))
    ref = outcome(lambda: npi.decode_indices(kind, raw, d, n))
    got = outcome(lambda: ti.decode_indices(kind, torch.from_numpy(raw), d, n))
    assert same(ref, got), (ref, got)


def test_wrong_payload_types_are_wire_errors():
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.uint8), b"\x00"):
        with pytest.raises(WireError):
            ti.decode_indices(IDX_BITMAP, bad, 16, 0)


def test_decoding_stays_on_the_payloads_device_and_reads_no_numpy(monkeypatch):
    """The decode and encode never convert the payload to numpy (on a GPU: never copy it to the
    host); only scalars are read back."""
    idx = torch.from_numpy(np.sort(np.random.default_rng(3).choice(100_000, 1000, replace=False)))

    def refuse(self, *a, **k):
        raise AssertionError("a payload went through numpy")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    kind, buf = ti.encode_indices(idx, 100_000)
    out = ti.decode_indices(kind, buf, 100_000, 1000)
    assert out.device == idx.device and torch.equal(out, idx)


def test_both_kernels_meet_the_index_kernel_contract():
    """The one front end (wire/index_codec.py) runs over either kernel: each has every member
    of IndexKernel."""
    from hvd_slim.wire.index_codec import IndexKernel

    for kernel in (npi.NumpyKernel(), ti.TorchKernel()):
        assert isinstance(kernel, IndexKernel), type(kernel).__name__
