"""Workloads for the benchmark: real parameter shapes with synthetic gradients, or a small CNN.

Synthetic mode measures the exchange, not compute: a module holds parameters with the real
shapes of ResNet-18 / ResNet-50 / a BERT-base encoder, and its "forward" returns views of them.
Backpropagating a seeded gradient through those views fires every autograd hook a real backward
fires (Horovod's, DDP's reducer, hvd_slim's), at the cost of one gradient copy.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from examples.synthetic_benchmark import ResNet

Shape = Tuple[int, ...]
Shapes = List[Tuple[str, Shape]]


def _bn(prefix: str, c: int) -> Shapes:
    return [(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,))]


def resnet_shapes(blocks: List[int], bottleneck: bool) -> Shapes:
    """torchvision's ResNet parameter names and shapes (1000 classes)."""
    out: Shapes = [("conv1.weight", (64, 3, 7, 7))] + _bn("bn1", 64)
    inplanes, expansion = 64, 4 if bottleneck else 1
    for li, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        for bi in range(n):
            p = f"layer{li}.{bi}"
            if bottleneck:
                convs = [(planes, inplanes, 1, 1), (planes, planes, 3, 3),
                         (planes * 4, planes, 1, 1)]
            else:
                convs = [(planes, inplanes, 3, 3), (planes, planes, 3, 3)]
            for ci, shape in enumerate(convs, start=1):
                out += [(f"{p}.conv{ci}.weight", shape)] + _bn(f"{p}.bn{ci}", shape[0])
            if bi == 0 and (li > 1 or inplanes != planes * expansion):
                out += [(f"{p}.downsample.0.weight", (planes * expansion, inplanes, 1, 1))]
                out += _bn(f"{p}.downsample.1", planes * expansion)
            inplanes = planes * expansion
    return out + [("fc.weight", (1000, 512 * expansion)), ("fc.bias", (1000,))]


def bert_base_shapes(layers: int = 12, hidden: int = 768, ffn: int = 3072) -> Shapes:
    """A BERT-base encoder (embeddings, 12 layers, pooler): 109.5M parameters."""
    out: Shapes = [("embeddings.word_embeddings.weight", (30522, hidden)),
                   ("embeddings.position_embeddings.weight", (512, hidden)),
                   ("embeddings.token_type_embeddings.weight", (2, hidden)),
                   ("embeddings.LayerNorm.weight", (hidden,)), ("embeddings.LayerNorm.bias", (hidden,))]
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for lin, (o, n) in {"attention.self.query": (hidden, hidden),
                            "attention.self.key": (hidden, hidden),
                            "attention.self.value": (hidden, hidden),
                            "attention.output.dense": (hidden, hidden),
                            "intermediate.dense": (ffn, hidden),
                            "output.dense": (hidden, ffn)}.items():
            out += [(f"{p}.{lin}.weight", (o, n)), (f"{p}.{lin}.bias", (o,))]
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            out += [(f"{p}.{ln}.weight", (hidden,)), (f"{p}.{ln}.bias", (hidden,))]
    return out + [("pooler.dense.weight", (hidden, hidden)), ("pooler.dense.bias", (hidden,))]


def tiny_shapes() -> Shapes:
    """A few layers (~150k parameters) for the smoke test: big enough to be compressed."""
    return [("conv.weight", (64, 32, 3, 3)), ("conv.bias", (64,)), ("fc.weight", (1000, 128)),
            ("fc.bias", (1000,)), ("norm.weight", (128,)), ("norm.bias", (128,))]


def smallcnn_shapes() -> Shapes:
    """SmallCNN's parameter shapes (1.1M parameters), for synthetic gradients at many ranks."""
    return [(n, tuple(p.shape)) for n, p in SmallCNN().named_parameters()]


SHAPES: Dict[str, Callable[[], Shapes]] = {
    "resnet18": lambda: resnet_shapes([2, 2, 2, 2], bottleneck=False),
    "cnn1m": smallcnn_shapes,
    "resnet50": lambda: resnet_shapes([3, 4, 6, 3], bottleneck=True),
    "bert": bert_base_shapes,
    "tiny": tiny_shapes,
}
REAL = ("smallcnn", "resnet18-real")   # real forward and backward passes on random images
MODELS = tuple(SHAPES) + REAL


class SyntheticGrads(nn.Module):
    """Parameters of the given shapes; ``forward(step)`` returns flat views of them, and
    :meth:`grads` the seeded gradients to backpropagate through those views at that step."""

    def __init__(self, shapes: Shapes, rank: int, seed: int = 0, pool: int = 4) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.names = [n for n, _ in shapes]
        # nn.Module names may not contain dots: keep the real names in ``named_shaped()``.
        self.params = nn.ParameterList([nn.Parameter(0.05 * torch.randn(s, generator=gen))
                                        for _, s in shapes])
        numel = sum(p.numel() for p in self.params)
        # A small pool of distinct gradients per rank, cycled: generating 11.7M normals per step
        # would cost more than the exchange being measured. Per-layer scales differ, as in real
        # networks, so the top-k is not uniform across layers.
        g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (rank + 1))
        self.pool = torch.randn(pool, numel, generator=g)
        offs, scales = 0, []
        for p in self.params:
            scales.append((offs, p.numel(), 1.0 / max(1.0, float(p[0].numel()) ** 0.5)))
            offs += p.numel()
        for off, n, s in scales:
            self.pool[:, off:off + n].mul_(s)
        self._slices = scales
        self._buf = torch.empty(numel)

    def named_shaped(self) -> List[Tuple[str, nn.Parameter]]:
        """(real name, parameter) pairs, as a Horovod user would pass ``named_parameters``."""
        return list(zip(self.names, self.params))

    def forward(self, step: int) -> List[torch.Tensor]:  # noqa: ARG002 - same views every step
        return [p.view(-1) for p in self.params]

    def grads(self, step: int) -> List[torch.Tensor]:
        # A copy into a reused buffer: autograd hands these tensors to .grad without copying and
        # peers write their averaged update into .grad in place, which must not corrupt the pool;
        # reusing one buffer avoids page-faulting a fresh allocation every step.
        row = self._buf.copy_(self.pool[step % self.pool.shape[0]])
        return [row[off:off + n] for off, n, _ in self._slices]


class SmallCNN(nn.Module):
    """A CIFAR-sized CNN (about 1.1M parameters) for the end-to-end mode."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 512), nn.ReLU(),
                                        nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def real_model(name: str) -> nn.Module:
    """The module a real-compute workload (:data:`REAL`) trains."""
    if name == "smallcnn":
        return SmallCNN()
    # ResNet-18 (11.2M parameters) with the 3x3 stem for small images: real compute at a size
    # 2 cores can run; the same model examples/synthetic_benchmark.py trains.
    return ResNet([2, 2, 2, 2], num_classes=10, small_images=True)


class Workload:
    """What every peer runs each step: ``backward(step, module)`` leaves gradients in ``.grad``
    through autograd (so hooks fire). ``module`` may be a DDP wrapper around ``self.model``."""

    def __init__(self, name: str, rank: int, seed: int = 0, batch: int = 32) -> None:
        self.name = name
        if name in REAL:
            torch.manual_seed(seed)
            self.model: nn.Module = real_model(name)
            batch = batch if name == "smallcnn" else 8   # ResNet-18: about 0.3 s a step here
            g = torch.Generator().manual_seed(seed + 101 * (rank + 1))
            # A few fixed batches of random images cycled: real compute, no data loading.
            self.batches = [(torch.randn(batch, 3, 32, 32, generator=g),
                             torch.randint(0, 10, (batch,), generator=g)) for _ in range(4)]
            self.named = list(self.model.named_parameters())
        else:
            pool = 2 if name == "bert" else 4   # BERT's gradients are 440 MB per copy
            self.model = SyntheticGrads(SHAPES[name](), rank, seed, pool=pool)
            self.named = self.model.named_shaped()

    @property
    def real(self) -> bool:
        """Whether ``backward`` is a real forward and backward pass (:data:`REAL`)."""
        return self.name in REAL

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.named)

    @staticmethod
    def numel_of(name: str) -> int:
        """Parameter count of a workload, without building its gradients."""
        if name in REAL:
            return sum(p.numel() for p in real_model(name).parameters())
        return sum(math.prod(s) for _, s in SHAPES[name]())

    def backward(self, step: int, module: nn.Module) -> None:
        if isinstance(self.model, SyntheticGrads):
            outs = module(step)
            torch.autograd.backward(outs, self.model.grads(step))
        else:
            x, y = self.batches[step % len(self.batches)]
            nn.functional.cross_entropy(module(x), y).backward()
