"""A top-k + error-feedback baseline (the DGC/GRACE family) for ``--method topk``.

Each step every rank compresses its gradient with benchmarks/topk.py's error feedback (the
``k = ceil(density * d)`` largest magnitudes of residual + gradient over all compressed
coordinates), allgathers those values and their int32 indices through ``hvd``, and averages
them into a dense gradient; what it did not send stays in its residual. Small tensors (under ``min_compress_numel`` elements, as in hvd_slim) are averaged densely with
one fused allreduce. Unlike hvd_slim there is no server, no momentum correction (the wrapped
optimizer keeps its own momentum, as in GRACE's plain error feedback) and a full ``torch.topk``.

Bytes are modelled from the payloads (values + int32 indices), not counted at a transport:
``bytes_pushed`` is what this rank contributes to the allgather, ``bytes_pulled`` what it
receives from the other ranks; the dense part is charged as a ring allreduce (2(N-1)/N each way).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Iterable, List, Tuple

import torch

from benchmarks.topk import TopKErrorFeedback, average


class TopKOptimizer:
    """Wraps a torch optimizer; ``step()`` exchanges top-k slices, then steps it."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[Tuple[str, torch.Tensor]], density: float,
                 hvd: ModuleType, min_compress_numel: int = 4096) -> None:
        self.optimizer = optimizer
        self._hvd = hvd
        params = [p for _, p in named_parameters if p.requires_grad]
        self._sparse = [p for p in params if p.numel() >= min_compress_numel]
        self._dense = [p for p in params if p.numel() < min_compress_numel]
        d = sum(p.numel() for p in self._sparse)
        self._ef = TopKErrorFeedback(d, density)
        self.k = self._ef.k
        self.residual = self._ef.residual
        n = hvd.size()
        dense_numel = sum(p.numel() for p in self._dense)
        self._ring = 2 * (n - 1) / n if n > 1 else 0.0
        self._dense_part = int(round(self._ring * dense_numel * 4))
        self.stats: Dict[str, float] = {"steps": 0, "bytes_pushed": 0, "bytes_pulled": 0,
                                        "dense_bytes": 0}
        self._grad_bytes = (d + dense_numel) * 4

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "residual": self.residual.clone()}

    @staticmethod
    def _flat(params: List[torch.Tensor]) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params]) if params else torch.zeros(0)

    @staticmethod
    def _write(params: List[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def step(self) -> None:
        """Exchange the top-k slices and the dense remainder, then step the wrapped optimizer."""
        hvd, n = self._hvd, self._hvd.size()
        if self._sparse:
            idx, values = self._ef.compress(self._flat(self._sparse))
            all_values = hvd.allgather(values)
            all_idx = hvd.allgather(idx.to(torch.int32)).long()
            update = average([all_idx], [all_values], self.residual.numel(), n)
            self._write(self._sparse, update)
            self.stats["bytes_pushed"] += self.k * 8
            self.stats["bytes_pulled"] += (n - 1) * self.k * 8
        if self._dense:
            self._write(self._dense, hvd.allreduce(self._flat(self._dense), op=hvd.Average))
            self.stats["bytes_pushed"] += self._dense_part
            self.stats["bytes_pulled"] += self._dense_part
        self.stats["steps"] += 1
        self.stats["dense_bytes"] += self._grad_bytes
        self.optimizer.step()

    def flush(self) -> None:
        """Apply the ranks' averaged residual once as a plain SGD step (``p -= lr * r``), so the
        final model holds everything computed, as hvd_slim's ``flush()`` does. Collective."""
        if not self._sparse:
            return
        mean = self._hvd.allreduce(self.residual, op=self._hvd.Average)
        self.residual.zero_()
        lr = {id(p): g["lr"] for g in self.optimizer.param_groups for p in g["params"]}
        offset = 0
        with torch.no_grad():
            for p in self._sparse:
                n = p.numel()
                p.sub_(mean[offset:offset + n].view_as(p), alpha=lr[id(p)])
                offset += n

    def comm_stats(self) -> Dict[str, float]:
        """Cumulative modelled bytes of this rank (see the module docstring)."""
        return dict(self.stats, modelled=True, k=self.k)
