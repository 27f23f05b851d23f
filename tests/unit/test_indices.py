"""Index-set codec: Elias-Fano and bitmap round-trips, sizes, and strict rejection."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_slim.wire.errors import WireError
from hvd_slim.wire.indices import (IDX_BITMAP, IDX_EF, _ef_pack, decode_indices, encode_as,
                                   encode_indices, encoded_size, index_bytes_bound)


@st.composite
def index_sets(draw):
    """(sorted unique int64 indices, d): sparse and dense sets, small and mid-sized d."""
    d = draw(st.one_of(st.integers(0, 70), st.integers(71, 200_000)))
    if d == 0:
        return np.empty(0, dtype=np.int64), 0
    density = draw(st.sampled_from([0.0, 1e-4, 1e-3, 0.01, 0.1, 0.3, 0.7, 1.0]))
    n = min(d, draw(st.integers(0, 3)) if density == 0 else max(1, int(density * d)))
    n = min(n, 5_000)
    seed = draw(st.integers(0, 2 ** 32 - 1))
    idx = np.sort(np.random.default_rng(seed).choice(d, n, replace=False)).astype(np.int64)
    return idx, d


@settings(max_examples=300, deadline=None)
@given(index_sets())
def test_round_trip_both_kinds_and_choice(case):
    idx, d = case
    n = idx.size
    for kind in (IDX_EF, IDX_BITMAP):
        buf = encode_as(kind, idx, d)
        assert buf.dtype == np.uint8 and buf.ndim == 1
        assert buf.size == encoded_size(kind, d, n)
        assert np.array_equal(decode_indices(kind, buf, d, n), idx)
        assert np.array_equal(decode_indices(kind, buf.tobytes(), d, n), idx)
    kind, buf = encode_indices(idx, d)
    ef, bm = encoded_size(IDX_EF, d, n), encoded_size(IDX_BITMAP, d, n)
    assert buf.size == min(ef, bm) == index_bytes_bound(d, n)
    assert kind == (IDX_EF if ef <= bm else IDX_BITMAP)
    out = decode_indices(kind, buf, d, n)
    assert out.dtype == np.int64 and np.array_equal(out, idx)


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_at_most_two_bytes_per_index(density):
    d = 100_000
    n = int(density * d)
    idx = np.sort(np.random.default_rng(0).choice(d, n, replace=False))
    kind, buf = encode_indices(idx, d)
    assert kind == IDX_EF
    assert buf.size <= 2 * n and buf.size <= index_bytes_bound(d, n)


def test_extreme_sets():
    d = 1000
    for idx in ([0], [d - 1], [0, d - 1], list(range(d)), list(range(0, d, 2)), []):
        a = np.array(idx, dtype=np.int64)
        kind, buf = encode_indices(a, d)
        assert np.array_equal(decode_indices(kind, buf, d, a.size), a)
    assert encode_indices(np.array([], dtype=np.int64), 0)[1].size == 0
    assert encode_indices(np.array([], dtype=np.int64), 10**9)[1].size == 0   # empty: 0 bytes
    # Large d with few indices: L is large, sizes stay tiny.
    a = np.array([0, 5, 2**40 + 3], dtype=np.int64)
    kind, buf = encode_indices(a, 2**41)
    assert kind == IDX_EF and buf.size < 24
    assert np.array_equal(decode_indices(kind, buf, 2**41, 3), a)


def test_encode_rejects_bad_input():
    for bad, d in [([3, 2], 10), ([2, 2], 10), ([-1, 2], 10), ([1, 10], 10),
                   ([[1, 2]], 10), ([0.5], 10)]:
        with pytest.raises(ValueError):
            encode_indices(np.array(bad), d)
    with pytest.raises(ValueError):
        encode_as(7, np.array([1]), 10)


# ------------------------------------------------------------------------------ strict decode
SAMPLE_D = 10_000
SAMPLE = np.sort(np.random.default_rng(5).choice(SAMPLE_D, 100, replace=False)).astype(np.int64)


@pytest.mark.parametrize("kind", [IDX_EF, IDX_BITMAP])
def test_reject_wrong_length(kind):
    buf = encode_as(kind, SAMPLE, SAMPLE_D)
    with pytest.raises(WireError, match="bytes, expected"):
        decode_indices(kind, buf[:-1], SAMPLE_D, SAMPLE.size)       # truncated
    with pytest.raises(WireError, match="bytes, expected"):
        decode_indices(kind, np.concatenate([buf, np.zeros(1, np.uint8)]), SAMPLE_D, SAMPLE.size)
    with pytest.raises(WireError):
        decode_indices(kind, buf[:0], SAMPLE_D, SAMPLE.size)


@pytest.mark.parametrize("kind", [IDX_EF, IDX_BITMAP])
def test_reject_wrong_count(kind):
    buf = encode_as(kind, SAMPLE, SAMPLE_D)
    for count in (SAMPLE.size - 1, SAMPLE.size + 1, -1, SAMPLE_D + 1):
        # EF's length depends on the count: a wrong count fails the length or the bit count.
        with pytest.raises(WireError):
            decode_indices(kind, buf, SAMPLE_D, count)


def test_reject_unknown_kind_and_bad_buffer():
    buf = encode_as(IDX_EF, SAMPLE, SAMPLE_D)
    with pytest.raises(WireError, match="unknown index encoding"):
        decode_indices(3, buf, SAMPLE_D, SAMPLE.size)
    with pytest.raises(WireError, match="uint8"):
        decode_indices(IDX_EF, buf.astype(np.int16), SAMPLE_D, SAMPLE.size)
    with pytest.raises(WireError):
        encoded_size(0, SAMPLE_D, 1)


def test_reject_padding_bits():
    d = 13                                 # 13 bits: 3 padding bits in the last bitmap byte
    buf = encode_as(IDX_BITMAP, np.array([0, 12]), d)
    bad = buf.copy()
    bad[-1] |= 1
    with pytest.raises(WireError, match="padding"):
        decode_indices(IDX_BITMAP, bad, d, 2)
    # EF: d=100, n=3 -> L=5, low section 15 bits (1 padding bit), high section 3+4=7 bits.
    idx = np.array([1, 40, 99])
    buf = encode_as(IDX_EF, idx, 100)
    assert buf.size == encoded_size(IDX_EF, 100, 3) == 3
    for byte in (1, 2):                    # last byte of the low section, then the high one
        bad = buf.copy()
        bad[byte] |= 1
        with pytest.raises(WireError, match="padding"):
            decode_indices(IDX_EF, bad, 100, 3)


def test_reject_wrong_number_of_set_bits():
    buf = encode_as(IDX_BITMAP, np.array([1, 5]), 16)
    bad = buf.copy()
    bad[1] |= 0x80                         # index 8 added
    with pytest.raises(WireError, match="set bits"):
        decode_indices(IDX_BITMAP, bad, 16, 2)
    # EF d=100: highs 0, 1, 3 -> ones at unary positions 0, 2, 5 of the third byte: 0xA4.
    ef = encode_as(IDX_EF, np.array([1, 40, 99]), 100)
    assert ef[2] == 0xA4
    for high in (0xA4 | 0x40, 0xA4 & ~0x20, 0):      # 4 ones, 2 ones, none
        bad = ef.copy()
        bad[2] = high
        with pytest.raises(WireError, match="set bits"):
            decode_indices(IDX_EF, bad, 100, 3)


def test_reject_out_of_range_and_unsorted():
    # d=100, n=2 -> L=5, 4 buckets: 127 fits the unary section but is >= d.
    with pytest.raises(WireError, match="out of range"):
        decode_indices(IDX_EF, _ef_pack(np.array([3, 127]), 100), 100, 2)
    # Same high bucket, low bits not increasing: duplicate, then decreasing.
    for bad in ([7, 7], [9, 7], [40, 33]):
        with pytest.raises(WireError, match="strictly increasing"):
            decode_indices(IDX_EF, _ef_pack(np.array(bad), 100), 100, 2)


def test_counting_is_a_shared_read_only_range_that_grows_and_stays_bounded(monkeypatch):
    import hvd_slim.wire.indices as ix
    monkeypatch.setattr(ix, "_COUNTING_MAX", 1000)
    monkeypatch.setattr(ix, "_COUNTING", np.arange(0, dtype=np.int64))
    a = ix.counting(300)
    assert a.dtype == np.int64 and np.array_equal(a, np.arange(300))
    assert not a.flags.writeable   # a caller writing into it would corrupt every other one
    with pytest.raises(ValueError):
        a[0] = 7
    b = ix.counting(200)
    assert np.shares_memory(a, b) and np.array_equal(b, np.arange(200))   # no fresh pages
    c = ix.counting(500)   # grows: to at least twice what it held
    assert np.array_equal(c, np.arange(500)) and ix._COUNTING.size == 600
    c = ix.counting(900)   # ... and never past the bound
    assert np.array_equal(c, np.arange(900)) and ix._COUNTING.size == 1000
    assert np.array_equal(a, np.arange(300))   # what a caller held stays as it was
    big = ix.counting(5000)   # past the bound: a fresh array, the shared one unchanged
    assert np.array_equal(big, np.arange(5000)) and ix._COUNTING.size == 1000
    empty = ix.counting(0)
    assert empty.size == 0 and empty.flags.writeable and empty.dtype == np.int64


def test_decoded_indices_do_not_share_the_counting_range():
    # Decoding subtracts the shared range from the high bits: the result is the caller's own.
    idx = np.array([3, 17, 40, 41, 99], dtype=np.int64)
    kind, enc = encode_indices(idx, 128)
    out = decode_indices(kind, enc, 128, idx.size)
    assert np.array_equal(out, idx) and out.flags.writeable
    out[0] = 5   # writing into it must not touch anything shared
    assert np.array_equal(decode_indices(kind, enc, 128, idx.size), idx)
