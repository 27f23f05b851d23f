"""One Slim-DP step as a fixed sequence of phases (DESIGN §2), for one rank.

    compensate -> select -> push -> aggregate (server) -> pull -> apply

:meth:`SlimExchange.step` is the only place that fixes this order. It reads each parameter's
``.grad`` and writes the pulled update back into it; the wrapped optimizer's ``step()`` runs
afterwards. Nothing here knows about MPI: the transport is passed in.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np
import torch

from ..config import SlimConfig
from ..memory import ResidualMemory
from ..selection import CoreSelector, explore, significance
from ..transport.base import Transport
from ..wire import message as wm
from .codec import (from_bytes, indices_on, is_refresh, message_bound, pull_expect,
                    push_expect, to_bytes)
from .layout import DENSE, Bucket, Layout
from .server import ROLE_PULL, ROLE_PUSH, Server, decode_pull
from .stats import ExchangeStats


class ExchangeError(RuntimeError):
    """A step failed on the server or in decoding; raised identically on every rank."""


class SlimExchange:
    """Per-rank Slim-DP state (residuals, cached cores, server state) and the step sequence."""

    def __init__(self, layout: Layout, config: SlimConfig, transport: Transport,
                 momentum: Optional[Dict[int, dict]] = None) -> None:
        config.check_world(transport.size)
        self.layout, self.cfg, self.transport = layout, config, transport
        self.rank, self.size = transport.rank, transport.size
        self.digest = layout.digest() ^ int(config.digest(), 16)
        self.step_count = 0
        momentum = momentum or {}
        self.memory = {b.index: ResidualMemory(b.numel, b.dtype, b.device,
                                               **momentum.get(b.index, {}))
                       for b in layout.sparse}
        self.selector = {b.index: CoreSelector() for b in layout.sparse}
        self.core: Dict[int, torch.Tensor] = {}        # this worker's cached push cores
        self.pull_core: Dict[int, torch.Tensor] = {}   # the server's cached pull cores
        self.server = Server(layout, config, self.size, self.rank) \
            if self.rank == config.server_rank else None
        self._flat = {b.index: torch.zeros(b.numel, dtype=b.dtype, device=b.device)
                      for b in layout.buckets}
        self._score = {b.index: torch.zeros(b.numel, dtype=b.dtype, device=b.device)
                       for b in layout.sparse}
        self._pending: List[tuple] = []
        self.stats = ExchangeStats(layout, self.size)

    # --- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Exchange the current gradients; afterwards every ``p.grad`` holds the pulled update."""
        t, t0 = self.step_count, time.perf_counter()
        sections = [self._compensate_and_select(b, t) for b in self.layout.buckets]
        pushed = self._push(sections, wm.PUSH, t)
        pulled = self._aggregate_and_pull(pushed, t, flush=False)
        self._apply(pulled, t, flush=False)
        self.step_count += 1
        self.stats.finish_step(time.perf_counter() - t0)

    def flush(self) -> None:
        """Send every residual (workers' and server's) densely; compressed ``p.grad`` then hold
        it and dense-bucket grads are untouched. Call the inner optimizer's step afterwards."""
        t = self.step_count
        sections = []
        for b in self.layout.buckets:
            if b.kind == DENSE:
                sections.append(wm.make_section(wm.M_EMPTY, np.empty(0, np.uint8), b.numel))
                continue
            a = self.memory[b.index].residual
            wire = a.to(b.wire_dtype)
            self._pending.append((b.index, None, wire.to(b.dtype) if b.wire_dtype != b.dtype
                                  else None, False))
            sections.append(wm.make_section(wm.M_DENSE, to_bytes(wire), b.numel))
        pushed = self._push(sections, wm.FLUSH_PUSH, t)
        pulled = self._aggregate_and_pull(pushed, t, flush=True)
        self._apply(pulled, t, flush=True)
        self.stats.flushes += 1

    # --- phases ------------------------------------------------------------------------------
    def _compensate_and_select(self, b: Bucket, t: int) -> wm.Section:
        cfg = self.cfg
        g = self.layout.read_grads(b, self._flat[b.index])
        if cfg.op == "average" and cfg.gradient_predivide_factor != 1.0:
            g.div_(cfg.gradient_predivide_factor)
        if b.kind == DENSE:
            return wm.make_section(wm.M_DENSE, to_bytes(g.to(b.wire_dtype)), b.numel)
        a = self.memory[b.index].compensate(g)
        t_sel = time.perf_counter()
        refresh = is_refresh(t, cfg.refresh_interval) or b.index not in self.core
        if refresh:
            w = None
            if cfg.magnitude_weight > 0:
                w = self.layout.read_params(b, torch.empty_like(a))
            score = significance(a, w, cfg.magnitude_weight, out=self._score[b.index])
            self.core[b.index] = self.selector[b.index].select(score, b.k_core)
        core = self.core[b.index]
        sel = torch.cat([core, explore(b.numel, core, b.k_explore,
                                       (cfg.seed, ROLE_PUSH, self.rank, t, b.index)).to(b.device)])
        self.stats.select_seconds += time.perf_counter() - t_sel
        wire = a[sel].to(b.wire_dtype)
        # Forget what was sent only once the step succeeds: until then it stays in the residual.
        self._pending.append((b.index, sel, wire.to(b.dtype) if b.wire_dtype != b.dtype else None,
                              True))
        if is_refresh(t, cfg.refresh_interval):
            return wm.make_section(wm.M_SLICE, to_bytes(wire), b.numel, indices=core.cpu().numpy())
        return wm.make_section(wm.M_SLICE_CACHED, to_bytes(wire), b.numel)

    def _push(self, sections: List[wm.Section], kind: int, t: int) -> Optional[List[np.ndarray]]:
        buf, sizes = wm.encode(kind, self.rank, t, self.digest, sections,
                               [b.value_bytes for b in self.layout.buckets])
        self.stats.record_push(sections, sizes)
        before = self.transport.stats.bytes_sent
        bound = message_bound(push_expect(self.layout.buckets, t, self.cfg.refresh_interval,
                                          flush=kind == wm.FLUSH_PUSH))
        gathered = self.transport.gather(buf, root=self.cfg.server_rank, bound=bound)
        sent = self.transport.stats.bytes_sent - before
        self.stats.bytes_pushed += sent
        self.stats.last["bytes_pushed"] = sent
        return gathered

    def _aggregate_and_pull(self, gathered: Optional[List[np.ndarray]], t: int,
                            flush: bool) -> List[wm.Section]:
        reply = None
        if self.server is not None:
            try:
                reply, _ = self.server.serve(gathered, t, self.digest, flush)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then raise
                reply = wm.encode_error(self.rank, t, f"server rank {self.rank} failed at step "
                                        f"{t}: {type(exc).__name__}: {exc}")
        before = self.transport.stats.bytes_received
        bound = message_bound(pull_expect(self.layout.buckets, t, self.cfg.refresh_interval,
                                          self.cfg.pull, flush))
        if reply is not None and len(reply) > bound and wm.is_error(reply):
            reply = reply[:bound]  # an error text never needs more room than a pull
        buf = self.transport.broadcast(reply, root=self.cfg.server_rank, bound=bound)
        received = self.transport.stats.bytes_received - before
        self.stats.bytes_pulled += received
        self.stats.last["bytes_pulled"] = received
        try:
            sections = decode_pull(self.layout, self.cfg, buf, t, self.digest, flush)
        except wm.RemoteError as exc:
            self._pending.clear()
            raise ExchangeError(str(exc)) from None
        except wm.WireError as exc:
            self._pending.clear()
            raise ExchangeError(f"rank {self.rank}: {exc}") from None
        self.stats.record_pull(buf, sections)
        return sections

    def _apply(self, sections: List[wm.Section], t: int, flush: bool) -> None:
        for i, sel, delivered, mask_velocity in self._pending:
            self.memory[i].update(sel, delivered, mask_velocity)
        self._pending.clear()
        for b, sec in zip(self.layout.buckets, sections):
            if sec.mode == wm.M_EMPTY:
                continue
            vals = from_bytes(sec.values, b.wire_dtype, like=b)
            if sec.mode == wm.M_DENSE:
                flat = vals
            else:
                flat = self._flat[b.index].zero_()
                if sec.mode == wm.M_EXPLICIT:
                    idx = indices_on(sec.indices, b)
                else:
                    if sec.mode == wm.M_SLICE:
                        self.pull_core[b.index] = indices_on(sec.indices, b)
                    core = self.pull_core.get(b.index)
                    if core is None:
                        raise ExchangeError(f"rank {self.rank}: the server reused a cached pull "
                                            "core this rank does not have")
                    idx = torch.cat([core, explore(b.numel, core, b.k_pull_explore,
                                                   (self.cfg.seed, ROLE_PULL,
                                                    self.cfg.server_rank, t, b.index)
                                                   ).to(b.device)])
                flat[idx] = vals
            self.layout.write_grads(b, flat)

    # --- checkpoint --------------------------------------------------------------------------
    def residual_norm(self) -> float:
        """Sum of squares of every residual this rank holds (worker and server)."""
        total = sum(float(m.residual.double().pow(2).sum()) for m in self.memory.values())
        if self.server is not None:
            total += sum(float(m.residual.double().pow(2).sum())
                         for m in self.server.memory.values())
        return total

    def state_dict(self) -> dict:
        return {"version": 1, "rank": self.rank, "size": self.size, "step": self.step_count,
                "digest": self.digest, "config": self.cfg.to_dict(),
                "memory": {i: m.state_dict() for i, m in self.memory.items()},
                "selector": {i: s.state_dict() for i, s in self.selector.items()},
                "core": {i: c.clone() for i, c in self.core.items()},
                "pull_core": {i: c.clone() for i, c in self.pull_core.items()},
                "server": None if self.server is None else self.server.state_dict(),
                "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown hvd_slim checkpoint version {state.get('version')!r}")
        if state["digest"] != self.digest:
            raise ValueError("hvd_slim checkpoint was made with a different model or Slim-DP "
                             f"config: saved {state['config']}, now {self.cfg.to_dict()}")
        if state["size"] != self.size or state["rank"] != self.rank:
            raise ValueError(f"hvd_slim checkpoint holds the residuals of rank {state['rank']} "
                             f"of {state['size']}; this is rank {self.rank} of {self.size}. "
                             "Residuals are per rank: save and load every rank's "
                             "optimizer.state_dict(), or call optimizer.flush() before saving")
        self.step_count = int(state["step"])
        for i, m in self.memory.items():
            m.load_state_dict(state["memory"][i])
            self.selector[i].load_state_dict(state["selector"][i])
        self.core = {int(i): c.clone() for i, c in state["core"].items()}
        self.pull_core = {int(i): c.clone() for i, c in state["pull_core"].items()}
        if self.server is not None:
            if state["server"] is None:
                raise ValueError(f"rank {self.rank} is the server but its checkpoint has no "
                                 "server state: was server_rank changed?")
            self.server.load_state_dict(state["server"])
        self.stats.load_state_dict(state.get("stats", {}))
