"""What the optimizer asks of an exchange: the contract :class:`SlimExchange` (flat),
:class:`~hvd_slim.exchange.hosts.hierarchy.HierarchicalExchange` (hosts first) and
:class:`~hvd_slim.exchange.overlap.staged.StagedExchange` (overlap with backward) all meet, so that
``build_exchange`` can hand out any of them; and what a staged exchange asks of each stage
(:class:`Stage`: the first two meet it)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, runtime_checkable

import torch

from .handshake import Agreement


@runtime_checkable
class Exchange(Protocol):
    """One rank's Slim-DP exchange for one optimizer."""

    rank: int
    size: int
    servers: int
    transport: Any
    stats: Any   # ExchangeStats, or a view with the same as_dict()

    @property
    def step_count(self) -> int:
        """Exchange steps taken (skipped ones not counted)."""

    def step(self) -> bool:
        """Exchange every ``p.grad``; False when every rank skipped the step."""

    def flush(self) -> None:
        """Send every residual densely into the compressed ``p.grad``."""

    def state_dict(self) -> dict:
        """This rank's exchange state (tensors and plain values)."""

    def validate_state_dict(self, state: dict) -> None:
        """Raise ValueError, naming what differs, unless ``state`` loads here."""

    def load_state_dict(self, state: dict) -> None:
        """Validate, then load ``state``."""

    def held_residuals(self) -> Dict[int, torch.Tensor]:
        """Every residual this rank holds, per compressed bucket of the optimizer's layout."""

    def residual_norm(self) -> float:
        """Sum of squares of every residual this rank holds."""


@runtime_checkable
class OverlappedExchange(Exchange, Protocol):
    """An exchange that starts in backward: the gradient hook announces each parameter whose
    last pass of the step is in, and ``step`` takes the join round's opener."""

    def grad_ready(self, p: torch.Tensor,
                   opener: Optional[Callable[[], Optional[Callable[[], Any]]]]) -> None:
        """``p``'s gradient of this step is complete."""

    def step(self, opener: Optional[Callable[[], Optional[Callable[[], Any]]]] = None
             ) -> bool:  # type: ignore[override]
        """As :meth:`Exchange.step`; ``opener`` queues the step's join round."""


@runtime_checkable
class Stage(Exchange, Protocol):
    """An exchange whose step comes apart, so that several make one step
    (exchange/overlap/staged.py): the local phases, the collective ones, and an outcome that
    commits, drops or keeps. What
    :meth:`prepare` returns has ``report`` (a NaN/Inf this rank found, or None); what
    :meth:`communicate` returns has ``pulled`` (None: every rank skips the step). The staged
    exchange also reads each stage's layout and settings, runs its one handshake and its
    schedule rounds through the first stage's :meth:`collective`, and then marks every stage's
    ``agreement``."""

    layout: Any   # the stage's Layout
    cfg: Any   # its SlimConfig (a process set's: server_rank in the set's numbering)
    ranks: List[int]
    in_set: bool
    agreement: Agreement   # whether its ranks agreed (the handshake ran)

    def collective(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn``'s collectives of the whole job (or set) under the exchange timeout."""

    def prepare(self) -> Any:
        """The local phases: no collective, so a rank may run them ahead of the others."""

    def communicate(self, prep: Any) -> Any:
        """The collective phases; on a failure, this rank's gradient is kept, then raised."""

    def begin(self) -> Any:
        """``communicate(prepare())``."""

    def settle(self, pending: Any, commit: bool) -> None:
        """Commit a pulled step (its values into ``p.grad``), else drop it exactly."""

    def drop(self, what: Any) -> None:
        """Every rank drops the step, begun or only prepared: nothing changes."""

    def absorb(self, what: Any) -> None:
        """Another stage failed: keep this rank's gradient (begun, prepared or None)."""

    def flag_grads(self) -> None:
        """A step skipped under ``nonfinite="flag"``: every gradient NaN."""
