"""The exchange message: round trips, and strict rejection of anything malformed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_slim.wire import WireError
from hvd_slim.wire import message as wm

D_SPARSE, D_DENSE, K, KC = 5000, 40, 50, 45


def sample_message(step=3, sender=1, digest=0xABCDEF):
    rng = np.random.default_rng(0)
    dense = rng.standard_normal(D_DENSE).astype(np.float32)
    core = np.sort(rng.choice(D_SPARSE, KC, replace=False)).astype(np.int64)
    vals = rng.standard_normal(K).astype(np.float32)
    sections = [wm.make_section(wm.M_DENSE, dense, D_DENSE),
                wm.make_section(wm.M_SLICE, vals, D_SPARSE, indices=core)]
    buf, sizes = wm.encode(wm.PUSH, sender, step, digest, sections, [4, 4])
    return buf, sizes, dense, vals, core


EXPECT = [wm.Expect(D_DENSE, 4, {wm.M_DENSE: (D_DENSE, 0)}),
          wm.Expect(D_SPARSE, 4, {wm.M_SLICE: (K, KC)})]


def decode(buf, **kw):
    args = dict(kind=wm.PUSH, sender=1, step=3, digest=0xABCDEF, expect=EXPECT, who="test")
    args.update(kw)
    return wm.decode(buf, **args)


def test_round_trip_and_byte_breakdown():
    buf, sizes, dense, vals, core = sample_message()
    out = decode(buf)
    assert np.array_equal(out[0].values.view(np.float32), dense)
    assert np.array_equal(out[1].values.view(np.float32), vals)
    assert np.array_equal(out[1].indices, core)
    assert sizes["values"] == (D_DENSE + K) * 4
    assert sizes["header"] == 32 + 2 * 16
    assert len(buf) == sizes["header"] + sizes["values"] + sizes["indices"]
    assert sizes["indices"] <= 2 * KC


@pytest.mark.parametrize("kw, match", [
    (dict(kind=wm.PULL), "expected a pull message"),
    (dict(sender=2), "sender rank 1, expected 2"),
    (dict(step=4), "step 3, expected step 4"),
    (dict(digest=1), "digest"),
    (dict(expect=EXPECT[:1]), "2 buckets, expected 1"),
    (dict(expect=[EXPECT[0], wm.Expect(D_SPARSE, 4, {wm.M_SLICE: (K + 1, KC)})]), "expected 51"),
    (dict(expect=[EXPECT[0], wm.Expect(D_SPARSE, 4, {wm.M_DENSE: (D_SPARSE, 0)})]), "allowed"),
])
def test_mismatched_expectations_are_rejected(kw, match):
    buf = sample_message()[0]
    with pytest.raises(WireError, match=match):
        decode(buf, **kw)


def test_truncated_and_oversized_are_rejected():
    buf = sample_message()[0]
    for n in (0, 10, 31, 40, len(buf) - 1):
        with pytest.raises(WireError):
            decode(buf[:n].copy())
    with pytest.raises(WireError, match="bytes, its table describes"):
        decode(np.concatenate([buf, np.zeros(3, np.uint8)]))


def test_bad_magic_and_version():
    buf = sample_message()[0].copy()
    bad = buf.copy()
    bad[0] = ord("X")
    with pytest.raises(WireError, match="magic"):
        decode(bad)
    bad = buf.copy()
    bad[4] = 99
    with pytest.raises(WireError, match="version"):
        decode(bad)


def test_error_message_reaches_the_receiver():
    buf = wm.encode_error(0, 5, "server rank 0 failed: boom")
    with pytest.raises(wm.RemoteError, match="boom"):
        decode(buf)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_bytes_never_decode_silently_wrong(data):
    """Flip bytes anywhere: the decoder either raises WireError or returns exactly the original
    content (a flip inside a value changes only that value, which it cannot detect)."""
    buf, _, dense, vals, core = sample_message()
    bad = buf.copy()
    n_flips = data.draw(st.integers(1, 4))
    positions = data.draw(st.lists(st.integers(0, len(buf) - 1), min_size=n_flips,
                                   max_size=n_flips))
    for p in positions:
        bad[p] ^= data.draw(st.integers(1, 255))
    positions = np.flatnonzero(bad != buf).tolist()  # a byte flipped twice may be unchanged
    try:
        out = decode(bad)
    except (WireError, wm.RemoteError):
        return
    values = set(range(64, 64 + (D_DENSE + K) * 4))
    index_section = set(range(64 + (D_DENSE + K) * 4, len(buf)))
    # Every header and table byte is checked, so only value or index bytes can slip through.
    assert all(p in values or p in index_section for p in positions)
    idx = out[1].indices
    assert len(idx) == KC and np.all(np.diff(idx) > 0) and idx[0] >= 0 and idx[-1] < D_SPARSE
    if not any(p in index_section for p in positions):
        assert np.array_equal(idx, core)
