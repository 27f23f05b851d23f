"""Horovod's gradient compressors (``hvd.Compression``): a dtype cast before a collective and
its inverse after. hvd_slim's exchange accepts the dtype-casting ones (optim/wrapping.py); the tensor
collectives apply them as Horovod does."""
from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)`` before a collective,
    ``decompress(tensor, ctx) -> tensor`` after it; ``ctx`` never leaves the rank."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Casts floating-point tensors to float16 for the wire and back; other dtypes pass through."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
