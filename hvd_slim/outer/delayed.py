"""A round's exchange overlapped with the next round (``outer_delay=1``), as Streaming DiLoCo
overlaps its outer communication with the following inner steps.

At the end of round r every rank computes its pseudo-gradient and :meth:`InFlight.launch`
starts its exchange: the local phases (compensate and select, which read ``p.grad``) on the
caller's thread, the collectives (handshake, push, aggregate, pull) on the transport's
communication thread (exchange/overlap/runner.py), while round r+1's local steps run. At the end
of round r+1, :meth:`InFlight.land` waits for it and settles it; the outer optimizer then steps
the global parameters on round r's average and round r+1's pseudo-gradient is launched. So the
outer step lands one round late (what each rank's model holds meanwhile: outer/ends.py). The
global parameters and the outer state stay bitwise the same on every rank: each outer step
takes the same pulled values in the same order.

The settled average is kept in :attr:`InFlight.ready` (not in ``p.grad``, which holds the
local gradients meanwhile) until the outer step takes it. A checkpoint lands the round in
flight first and saves ``ready`` with the outer state. Without MPI_THREAD_MULTIPLE the runner
runs the collectives in :meth:`land`, with the same results and no overlap.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..exchange.build import threads_allowed
from ..exchange.overlap.runner import Job, runner_for
from ..exchange.step import Pending, SlimExchange
from .rounds import matches_params

Opener = Optional[Callable[[], Optional[Callable[[], Any]]]]


class InFlight:
    """The exchange of at most one round in flight, and the average it pulled (``ready``:
    one tensor per trainable parameter, or None) waiting for the outer step."""

    def __init__(self, exchange: Any, params: List[torch.Tensor]) -> None:
        if not isinstance(exchange, SlimExchange):
            raise ValueError("outer_delay=1 runs over the flat exchange; it cannot be combined "
                             "with overlap > 1 or hierarchical=True")
        self.exchange, self.params = exchange, list(params)
        self.runner = runner_for(exchange.transport, threads_allowed(exchange.transport))
        self.job: Optional[Job] = None
        self.box: Dict[str, Pending] = {}
        self.ready: Optional[List[torch.Tensor]] = None
        # A round every rank skipped, landed (by a checkpoint) before the round's end used it.
        self.skipped = False

    @property
    def busy(self) -> bool:
        """Whether a round's exchange is in flight (launched and not yet landed)."""
        return self.job is not None

    def launch(self, opener: Opener = None) -> None:
        """Start the exchange of the pseudo-gradient now in ``p.grad``: its local phases here,
        its collectives on the communication thread. ``opener`` (if any) queues the join round
        that must precede them and returns what waits for it (optimizer._open_round)."""
        assert self.job is None and self.ready is None, "land the round in flight first"
        exchange = self.exchange
        prep = exchange.prepare()   # reads p.grad: the caller may change it afterwards
        box: Dict[str, Pending] = {}

        def stage() -> bool:
            box["pending"] = exchange.communicate(prep)
            return True

        try:
            first = opener() if opener is not None else None
        except BaseException:
            exchange.worker.absorb()   # the round's gradient stays in the residual
            raise
        job = Job([stage], first=first)
        self.runner.submit(job)
        self.runner.ready(job, 0)
        self.job, self.box = job, box

    def land(self) -> Optional[bool]:
        """Wait for the round in flight and settle it: True (its average is in ``ready``),
        False (every rank skipped it: a NaN/Inf under ``nonfinite="flag"``/``"skip"``), None
        (none was in flight). Its failure is raised here, settled as a flat exchange settles
        one (``"raise"``: nothing changes; otherwise this rank's part is kept in its
        residual)."""
        job = self.job
        if job is None:
            return False if self.skipped else (None if self.ready is None else True)
        self.job = None
        self.runner.wait(job)
        if job.error is not None:
            stage, exc = job.error
            if stage < 0:   # the join round failed: the exchange never began
                self.exchange.worker.absorb()
            raise exc
        pending = self.box.pop("pending")
        if pending.pulled is None:
            self.exchange.settle(pending, commit=False)
            self.exchange.stats.skipped_steps += 1
            self.skipped = True
            return False
        saved = [p.grad for p in self.params]
        try:
            for p in self.params:
                p.grad = None   # the settled values land in fresh tensors, not the local grads
            self.exchange.settle(pending, commit=True)
            self.ready = [p.grad if p.grad is not None else torch.zeros_like(p)
                          for p in self.params]
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g
        return True

    def take(self) -> Optional[List[torch.Tensor]]:
        """The landed average for the outer step (and forget it), or None."""
        out, self.ready, self.skipped = self.ready, None, False
        return out

    # --- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``ready`` (landed first: a checkpoint never holds a round in flight)."""
        self.land()
        return {"ready": None if self.ready is None else [t.clone() for t in self.ready],
                "skipped": self.skipped}

    def validate_state_dict(self, state: Dict[str, Any]) -> None:
        ready = state.get("ready")
        if ready is None:
            return
        if not matches_params(ready, self.params):
            raise ValueError("hvd_slim checkpoint: its delayed outer step ('ready') does not "
                             "match this model's trainable parameters (count, shapes or dtypes)")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        ready = state.get("ready")
        self.job, self.box = None, {}
        # On the parameters' devices: a checkpoint loaded with map_location="cpu" holds them
        # on the host, and they become the parameters' .grad when the round lands.
        self.ready = None if ready is None else [t.to(p.device, copy=True)
                                                 for t, p in zip(ready, self.params)]
        self.skipped = bool(state.get("skipped", False))
