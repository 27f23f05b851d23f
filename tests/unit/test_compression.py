"""Compression.none and Compression.fp16 in one process (Horovod's Compressor semantics)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_slim.api.compression import Compression, Compressor, FP16Compressor, NoneCompressor


def test_none_passes_the_same_tensor_through():
    t = torch.randn(3, 4)
    sent, ctx = Compression.none.compress(t)
    assert sent is t and ctx is None
    assert Compression.none.decompress(sent, ctx) is t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fp16_casts_floats_and_restores_the_dtype(dtype):
    t = torch.linspace(-3, 3, 25, dtype=torch.float64).reshape(5, 5).to(dtype)
    sent, ctx = Compression.fp16.compress(t)
    assert sent.dtype == torch.float16 and sent.shape == t.shape and ctx == dtype
    back = Compression.fp16.decompress(sent, ctx)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.allclose(back.double(), t.double(), rtol=2 ** -8, atol=0)
    assert torch.equal(t, torch.linspace(-3, 3, 25, dtype=torch.float64).reshape(5, 5).to(dtype))


def test_fp16_exact_for_representable_values():
    t = torch.tensor([0.5, -2.0, 1024.0, 0.0], dtype=torch.float64)
    back = Compression.fp16.decompress(*Compression.fp16.compress(t))
    assert back.dtype == torch.float64 and torch.equal(back, t)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_fp16_leaves_non_float_tensors_alone(dtype):
    t = torch.ones(4, dtype=dtype)
    sent, ctx = Compression.fp16.compress(t)
    assert sent is t
    assert Compression.fp16.decompress(sent, ctx) is t


def test_compressor_interface():
    assert Compression.none is NoneCompressor and Compression.fp16 is FP16Compressor
    assert issubclass(NoneCompressor, Compressor) and issubclass(FP16Compressor, Compressor)
    with pytest.raises(NotImplementedError):
        Compressor.compress(torch.zeros(1))
    # Static methods: usable on the class, as Horovod's optimizer calls them.
    sent, ctx = FP16Compressor.compress(torch.zeros(2))
    assert FP16Compressor.decompress(sent, ctx).dtype == torch.float32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-60000, max_value=60000, allow_nan=False, width=32),
                min_size=0, max_size=40))
def test_fp16_round_trip_relative_error(values):
    t = torch.tensor(values, dtype=torch.float32)
    back = Compression.fp16.decompress(*Compression.fp16.compress(t))
    assert back.dtype == torch.float32 and back.shape == t.shape
    # float16 keeps 11 significant bits; tiny values fall into its subnormal range.
    assert torch.all((back - t).abs() <= t.abs() * 2 ** -11 + 2 ** -24)
