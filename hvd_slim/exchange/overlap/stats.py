"""``comm_stats()`` of ``overlap=S``: the stages' figures added up, as one exchange's."""
from __future__ import annotations

from typing import Dict, List

from ..layout import Layout
from ..stats import ExchangeStats

# Counted once per step by every stage alike, or by the staged exchange itself.
_PER_STEP = ("steps", "flushes")


class StagedStats:
    """What :class:`ExchangeStats` reports, summed over the stages' own counters (bytes, time);
    steps and flushes are the first stage's (all stages settle together), skipped steps the
    staged exchange's own count. ``ring_allreduce_bytes`` and ``dense_bytes`` are the whole
    model's."""

    def __init__(self, layout: Layout, size: int, stages: List) -> None:
        self._stages = stages
        whole = ExchangeStats(layout, size)
        self.grad_bytes, self.ring_bytes = whole.grad_bytes, whole.ring_bytes
        self.compressed_grad_bytes = whole.compressed_grad_bytes
        self.skipped_steps = 0
        self.last_skip = ""

    def __getattr__(self, name: str):
        if name in ExchangeStats.FIELDS:
            return self.as_dict()[name]
        raise AttributeError(name)

    def as_dict(self) -> Dict[str, float]:
        stats = [st.stats for st in self._stages]
        out: Dict[str, float] = {}
        for f in ExchangeStats.FIELDS:
            out[f] = getattr(stats[0], f) if f in _PER_STEP else sum(getattr(s, f) for s in stats)
        steps = out["steps"]
        out.update(skipped_steps=self.skipped_steps, dense_bytes=steps * self.grad_bytes,
                   ring_allreduce_bytes=steps * self.ring_bytes,
                   compressed_dense_bytes=steps * self.compressed_grad_bytes)
        last: Dict[str, int] = {}
        for s in stats:
            for k, v in s.last.items():
                last[k] = last.get(k, 0) + v
        out["last_step"] = last
        out["last_skip_reason"] = self.last_skip
        return out

    def state_dict(self) -> Dict[str, float]:
        return {"skipped_steps": self.skipped_steps}
