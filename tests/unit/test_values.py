"""value_bits: how a slice's values are rounded for the wire (wire/values.py) and carried
(the scale exponent in the section table, both decoders)."""
import math

import numpy as np
import pytest
import torch

from hvd_slim.wire import message as wm
from hvd_slim.wire import message_torch as wt
from hvd_slim.wire.errors import WireError
from hvd_slim.wire.values import FP8, FP8_MAX, dequantize, quantize, scale_exponent, slice_dtype


@pytest.mark.parametrize("bits, wire, want", [
    (8, torch.float32, FP8), (8, torch.float16, FP8), (16, torch.float32, torch.bfloat16),
    (16, torch.float64, torch.bfloat16), (16, torch.float16, torch.float16),
    (16, torch.bfloat16, torch.bfloat16), (32, torch.float32, torch.float32),
    (32, torch.float16, torch.float16), (8, torch.int64, torch.int64)])
def test_slice_dtype(bits, wire, want):
    assert slice_dtype(bits, wire) == want


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 1e-3, 1.0, 1e3, 1e30])
def test_fp8_uses_the_whole_range_and_rounds_within_a_sixteenth(scale):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4000, generator=g) * scale
    wire, exp, delivered = quantize(x, FP8)
    assert wire.dtype == FP8 and delivered.dtype == torch.float32
    top = float(x.abs().max()) * 2.0 ** -exp
    assert FP8_MAX / 2 <= top < FP8_MAX   # the largest value lands in fp8's top binade
    # 3 mantissa bits: each value within 1/16 of itself where fp8 is normal (2**-6 of 448
    # times the scale and up); below that, the error is at most half fp8's smallest step.
    normal = x.abs() * 2.0 ** -exp >= 2.0 ** -6
    err = (delivered - x).abs()
    assert bool((err[normal] <= x.abs()[normal] / 16).all())
    assert bool((err[~normal] <= 2.0 ** (exp - 10)).all())
    # The receiver's decode of the bytes is bitwise what the sender kept as delivered.
    back = dequantize(wire.view(torch.uint8).view(FP8), exp, torch.float32)
    assert torch.equal(back, delivered)


def test_fp8_edge_cases():
    assert quantize(torch.zeros(5), FP8)[1] == 0
    assert quantize(torch.zeros(0), FP8)[0].numel() == 0
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), -2.0])
    wire, exp, delivered = quantize(x, FP8)
    assert exp == 0
    # float8_e4m3fn has no Inf: non-finite values go as NaN, never as a saturated 448.
    assert torch.isnan(delivered[1:4]).all() and delivered[[0, 4]].tolist() == [1.0, -2.0]
    assert scale_exponent(torch.tensor([1e-40])) <= -120   # subnormal float32 still scaled


def test_bf16_and_full_precision():
    x = torch.randn(100, dtype=torch.float32) * 1e20
    wire, exp, delivered = quantize(x, torch.bfloat16)
    assert exp == 0 and torch.equal(delivered, x.to(torch.bfloat16).float())
    same, exp, delivered = quantize(x, torch.float32)
    assert same is x and exp == 0 and delivered is None


def _message(exp, mode=wm.M_SLICE, path="numpy"):
    vals = np.arange(6, dtype=np.uint8)   # a slice of explored coordinates only: no indices
    if path == "numpy":
        sec = wm.make_section(mode, vals, 100, indices=np.zeros(0, np.int64), exp=exp)
        return wm.encode(wm.PULL, 0, 3, 9, [sec], [1])[0]
    sec = wt.make_section(mode, torch.from_numpy(vals), 100,
                          indices=torch.zeros(0, dtype=torch.int64), exp=exp)
    return wt.encode(wm.PULL, 0, 3, 9, [sec], [1], torch.device("cpu"))[0]


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_the_exponent_travels_in_the_table_and_is_checked(path):
    dec = wm.decode if path == "numpy" else wt.decode
    kw = dict(kind=wm.PULL, sender=0, step=3, digest=9, who="pull from the server")
    scaled = [wm.Expect(100, 1, {wm.M_SLICE: (6, 0)}, scaled=True)]
    for exp in (-37, 0, 25, wm.MAX_EXP):
        (sec,) = dec(_message(exp, path=path), expect=scaled, **kw)
        assert sec.exp == exp and bytes(np.asarray(sec.values)) == bytes(range(6))
    with pytest.raises(WireError, match=r"bucket 0: scale exponent -1101 is out of range"):
        dec(_message(-wm.MAX_EXP - 1, path=path), expect=scaled, **kw)
    plain = [wm.Expect(100, 1, {wm.M_SLICE: (6, 0)})]
    with pytest.raises(WireError, match=r"scale exponent 4, expected 0 \(these values are not "
                                        r"scaled\)"):
        dec(_message(4, path=path), expect=plain, **kw)
    assert dec(_message(0, path=path), expect=plain, **kw)[0].exp == 0


def test_numpy_and_torch_encoders_agree_on_the_exponent():
    assert np.array_equal(_message(-12), _message(-12, path="torch").numpy())
    assert math.isclose(2.0 ** -12, float(dequantize(torch.ones(1, dtype=FP8), -12,
                                                     torch.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float8_decoding_by_byte_pairs_is_bitwise_torchs(dtype):
    """Long sections decode two float8 bytes per lookup (wire/values.py, _fp8_from_table):
    bitwise torch's own conversion for every byte in either place of a pair, at even and odd
    lengths and offsets (where a pair view is impossible, one byte per lookup)."""
    from hvd_slim.wire.values import FP8, dequantize
    every = torch.arange(1 << 16, dtype=torch.int32)
    pairs = torch.stack([every & 0xFF, every >> 8], 1).reshape(-1).to(torch.uint8)
    buf = torch.cat([torch.tensor([7], dtype=torch.uint8), pairs, pairs[:3]])
    bits = torch.int32 if dtype == torch.float32 else torch.int16   # NaN compared as bits
    for raw in (pairs, buf[1:1 + pairs.numel()], buf[:pairs.numel()], buf):
        want = raw.view(FP8).to(dtype)
        got = dequantize(raw.view(FP8), 0, dtype)
        assert torch.equal(got.view(bits), want.view(bits)), raw.storage_offset()
