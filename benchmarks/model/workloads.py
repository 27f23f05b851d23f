"""Parameter shapes the model reasons about, and the splits each strategy makes of them.

ResNet-18/50, BERT-base and ``cnn1m`` (SmallCNN's shapes with synthetic gradients, 1.15M
parameters) come from :mod:`benchmarks.models` (the benchmark's own shapes, so a prediction and
a measurement talk about the same tensors), as do the two real-compute models, ``smallcnn`` and
``resnet18-real`` (the CIFAR-stem ResNet-18), from the modules the benchmark trains. The
1B-parameter transformer exists only here, for extrapolation: a GPT-style decoder, 24 layers of
hidden 2048 (16 heads) and a 4x MLP, a 32000-token tied embedding and 2048 learned positions:
1.278e9 parameters, almost all in 2048x2048 / 8192x2048 matrices.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence, Tuple

Shape = Tuple[int, ...]


def transformer_shapes(layers: int = 24, hidden: int = 2048, ffn: int = 8192,
                       vocab: int = 32000, positions: int = 2048) -> List[Shape]:
    """A GPT-style decoder's parameter shapes (fused QKV, pre-LayerNorm, tied output)."""
    out: List[Shape] = [(vocab, hidden), (positions, hidden)]
    for _ in range(layers):
        out += [(hidden,), (hidden,),                       # ln_1
                (3 * hidden, hidden), (3 * hidden,),        # fused q, k, v
                (hidden, hidden), (hidden,),                # attention output
                (hidden,), (hidden,),                       # ln_2
                (ffn, hidden), (ffn,), (hidden, ffn), (hidden,)]   # MLP
    return out + [(hidden,), (hidden,)]                     # final LayerNorm


def _bench(name: str) -> Callable[[], List[Shape]]:
    def get() -> List[Shape]:
        from benchmarks.models import SHAPES   # imports torch: only when asked
        return [s for _, s in SHAPES[name]()]
    return get


def _real(name: str) -> Callable[[], List[Shape]]:
    def get() -> List[Shape]:
        from benchmarks.models import real_model   # what the benchmark trains
        model = real_model(name)
        return [tuple(p.shape) for p in model.parameters()]
    return get


WORKLOADS: Dict[str, Callable[[], List[Shape]]] = {
    "resnet18": _bench("resnet18"), "resnet50": _bench("resnet50"), "bert": _bench("bert"),
    "tiny": _bench("tiny"), "cnn1m": _bench("cnn1m"), "smallcnn": _real("smallcnn"),
    "resnet18-real": _real("resnet18-real"), "transformer-1b": transformer_shapes}


def shapes_of(name: str) -> List[Shape]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name]()


def numel(shapes: Sequence[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


def split(shapes: Sequence[Shape], threshold: int) -> Tuple[int, int]:
    """(elements of tensors with at least ``threshold`` elements, elements of the rest): the
    compressed and the dense part of top-k (SMALL_NUMEL) and hvd_slim (min_compress_numel)."""
    big = sum(math.prod(s) for s in shapes if math.prod(s) >= threshold)
    return big, numel(shapes) - big


def powersgd_sizes(shapes: Sequence[Shape], rank: int, min_rate: float = 2.0
                   ) -> Tuple[int, int, int]:
    """(P elements, Q elements, uncompressed elements) of torch's ``powerSGD_hook``: each
    tensor is viewed as ``shape[0] x rest`` and compressed when ``(n + m) * r * min_rate < n * m``
    (``_should_compress``, min_compression_rate 2); the rest, 1-D tensors included, is
    allreduced dense."""
    p = q = dense = 0
    for s in shapes:
        n = s[0]
        m = math.prod(s) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            p, q = p + n * r, q + m * r
        else:
            dense += n * m
    return p, q, dense
