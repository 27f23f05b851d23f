"""The server's half of a step: decode every push, aggregate, choose the pull slice.

The server is rank ``server_rank`` (also a worker). Every push is decoded strictly before any
state changes, so a bad message leaves the server's residual untouched.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ..config import SlimConfig
from ..memory import ResidualMemory
from ..selection import CoreSelector, explore
from ..wire import message as wm
from ..wire.indices import index_bytes_bound
from .codec import from_bytes, is_refresh, pull_expect, pull_is_dense, push_expect, to_bytes
from .layout import DENSE, Bucket, Layout

ROLE_PUSH, ROLE_PULL = 0, 1


class Server:
    """Aggregation state: its own residual ``e`` per compressed bucket (pull="slim"), the cores
    each worker last sent (for ``refresh_interval > 1``) and its own cached pull core."""

    def __init__(self, layout: Layout, config: SlimConfig, size: int, rank: int) -> None:
        self.layout, self.cfg, self.size, self.rank = layout, config, size, rank
        self.memory = {b.index: ResidualMemory(b.numel, b.dtype) for b in layout.sparse}
        self.selector = {b.index: CoreSelector() for b in layout.sparse}
        self.worker_cores: List[dict] = [dict() for _ in range(size)]
        self.pull_core: dict = {}

    # --- aggregate -------------------------------------------------------------------------
    def serve(self, payloads: List[np.ndarray], step: int, digest: int, flush: bool = False
              ) -> tuple:
        """Aggregate ``payloads`` (rank order) and return (pull buffer, byte breakdown)."""
        cfg, buckets = self.cfg, self.layout.buckets
        q = cfg.refresh_interval
        kind = wm.FLUSH_PUSH if flush else wm.PUSH
        expect = push_expect(buckets, step, q, flush)
        decoded = [wm.decode(buf, kind=kind, sender=j, step=step, digest=digest, expect=expect,
                             who=f"push from rank {j}") for j, buf in enumerate(payloads)]
        scale = 1.0 if cfg.op == "sum" else cfg.gradient_predivide_factor / self.size
        sections = []
        for b in buckets:
            total = torch.zeros(b.numel, dtype=b.dtype)
            touched = torch.zeros(b.numel, dtype=torch.bool) if cfg.pull == "union" else None
            for j in range(self.size):
                self._accumulate(b, j, decoded[j][b.index], step, total, touched)
            if scale != 1.0:
                total.mul_(scale)
            sections.append(self._pull_section(b, total, touched, step, flush))
        return wm.encode(wm.FLUSH_PULL if flush else wm.PULL, self.rank, step, digest, sections,
                         [b.value_bytes for b in buckets])

    def _accumulate(self, b: Bucket, j: int, sec: wm.Section, step: int, total: torch.Tensor,
                    touched: Optional[torch.Tensor]) -> None:
        if sec.mode == wm.M_EMPTY:
            return
        vals = from_bytes(sec.values, b.wire_dtype).to(b.dtype)
        if sec.mode == wm.M_DENSE:
            total.add_(vals)
            if touched is not None:
                touched.fill_(True)
            return
        if sec.mode == wm.M_SLICE:
            core = torch.from_numpy(sec.indices)
            self.worker_cores[j][b.index] = core
        else:
            core = self.worker_cores[j].get(b.index)
            if core is None:
                raise wm.WireError(f"push from rank {j}: bucket {b.index} reuses a cached core, "
                                   "but the server has none (restored from another checkpoint?)")
        idx = torch.cat([core, explore(b.numel, core, b.k_explore,
                                       (self.cfg.seed, ROLE_PUSH, j, step, b.index))])
        total.index_add_(0, idx, vals)
        if touched is not None:
            touched[idx] = True

    # --- pull ------------------------------------------------------------------------------
    def _pull_section(self, b: Bucket, total: torch.Tensor, touched: Optional[torch.Tensor],
                      step: int, flush: bool) -> wm.Section:
        if b.kind == DENSE:
            if flush:
                return wm.make_section(wm.M_EMPTY, np.empty(0, np.uint8), b.numel)
            return wm.make_section(wm.M_DENSE, to_bytes(total.to(b.wire_dtype)), b.numel)
        if self.cfg.pull == "union" and not flush:
            idx = touched.nonzero().reshape(-1)
            n = idx.numel()
            if n * b.value_bytes + index_bytes_bound(b.numel, n) < b.numel * b.value_bytes:
                return wm.make_section(wm.M_EXPLICIT, to_bytes(total[idx].to(b.wire_dtype)),
                                       b.numel, indices=idx.numpy())
            return wm.make_section(wm.M_DENSE, to_bytes(total.to(b.wire_dtype)), b.numel)
        mem = self.memory[b.index]
        v = mem.compensate(total)
        if flush or pull_is_dense(b):
            wire = v.to(b.wire_dtype, copy=True)  # a copy: update() zeroes v's buffer
            mem.update(None, wire.to(b.dtype) if b.wire_dtype != b.dtype else None)
            return wm.make_section(wm.M_DENSE, to_bytes(wire), b.numel)
        refresh = is_refresh(step, self.cfg.refresh_interval)
        if refresh:
            core = self.selector[b.index].select(v.abs(), b.k_pull_core)
            self.pull_core[b.index] = core
        else:
            core = self.pull_core[b.index]
        sel = torch.cat([core, explore(b.numel, core, b.k_pull_explore,
                                       (self.cfg.seed, ROLE_PULL, self.rank, step, b.index))])
        wire = v[sel].to(b.wire_dtype)
        mem.update(sel, wire.to(b.dtype) if b.wire_dtype != b.dtype else None)
        if refresh:
            return wm.make_section(wm.M_SLICE, to_bytes(wire), b.numel, indices=core.numpy())
        return wm.make_section(wm.M_SLICE_CACHED, to_bytes(wire), b.numel)

    # --- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"memory": {i: m.state_dict() for i, m in self.memory.items()},
                "selector": {i: s.state_dict() for i, s in self.selector.items()},
                "worker_cores": [{i: c.clone() for i, c in d.items()} for d in self.worker_cores],
                "pull_core": {i: c.clone() for i, c in self.pull_core.items()}}

    def load_state_dict(self, state: dict) -> None:
        if len(state["worker_cores"]) != self.size:
            raise ValueError(f"server checkpoint is from a job of {len(state['worker_cores'])} "
                             f"ranks, this job has {self.size}")
        for i, m in self.memory.items():
            m.load_state_dict(state["memory"][i])
            self.selector[i].load_state_dict(state["selector"][i])
        self.worker_cores = [{int(i): c.clone() for i, c in d.items()}
                             for d in state["worker_cores"]]
        self.pull_core = {int(i): c.clone() for i, c in state["pull_core"].items()}


def decode_pull(layout: Layout, cfg: SlimConfig, buf: np.ndarray, step: int, digest: int,
                flush: bool = False) -> List[wm.Section]:
    """A worker's strict decode of the server's pull."""
    expect = pull_expect(layout.buckets, step, cfg.refresh_interval, cfg.pull, flush)
    return wm.decode(buf, kind=wm.FLUSH_PULL if flush else wm.PULL, sender=cfg.server_rank,
                     step=step, digest=digest, expect=expect, who="pull from the server")
