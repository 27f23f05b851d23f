"""How a round of local steps ends on this rank: its pseudo-gradient through the exchange and
the outer step, waited for at the round's end (``outer_delay=0``) or landing one round late
(``outer_delay=1``, outer/delayed.py). The optimizer calls :meth:`RoundEnds.end` at a round's
last local step, :meth:`serve` on a joined rank, :meth:`land` before a flush, and the
checkpoint methods for ``"hvd_slim_outer"``."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from .delayed import InFlight, Opener
from .rounds import OuterRounds


class RoundEnds:
    """The round ends of one optimizer: ``rounds`` (global parameters, outer optimizer),
    the ``exchange``, and with ``delayed`` the round in flight (``flight``).
    ``end_accumulation`` ends the optimizer's gradient accumulation (after every exchange,
    failed or not)."""

    def __init__(self, rounds: OuterRounds, exchange: Any, params: List[torch.Tensor],
                 delayed: bool, end_accumulation: Callable[[], None]) -> None:
        self.rounds, self.exchange = rounds, exchange
        self.flight = InFlight(exchange, params) if delayed else None
        self._end_accumulation = end_accumulation

    def end(self, step_round: Callable[[], Any], open_round: Opener) -> None:
        """The round's exchange, after the join round that starts it: run now
        (``step_round``), or queued with the exchange on the communication thread
        (``open_round``)."""
        if self.flight is None:
            step_round()
            self._exchange_now()
        else:
            self._exchange_delayed(open_round)

    def serve(self) -> None:
        """On a joined rank, inside the round that runs the exchange: its part of it."""
        if self.flight is None:
            self._exchange_now()
        else:
            self._exchange_delayed(None)

    def land(self) -> None:
        """``outer_delay=1``: the round in flight lands now and the outer step takes it, so that
        nothing is pending (a flush). A no-op otherwise."""
        if self.flight is None:
            return
        try:
            landed = self.flight.land()
        except BaseException:
            self.rounds.reset()
            raise
        self._outer_step(landed)

    # --- the two ways ----------------------------------------------------------------------
    def _exchange_now(self) -> None:
        """``global - local`` through the exchange, then the outer step (or, for a round every
        rank dropped, back to the global parameters)."""
        rounds = self.rounds
        rounds.load_pseudo_gradients()
        try:
            ok = self.exchange.step()
        except BaseException:
            rounds.reset()   # what this rank computed is kept in its residual
            raise
        finally:
            self._end_accumulation()
        if ok:
            rounds.apply()
        else:
            rounds.reset()

    def _exchange_delayed(self, opener: Opener) -> None:
        """The previous round's exchange lands and the outer step takes its average; then this
        round's pseudo-gradient starts its exchange, which runs during the next round."""
        rounds, flight = self.rounds, self.flight
        deltas = rounds.pseudo_gradients()   # before the outer step moves the parameters
        try:
            try:
                landed = flight.land()
            except BaseException:
                # This round's work is kept in the residual, as a failed exchange keeps it.
                rounds.load_pseudo_gradients(deltas)
                self.exchange.absorb(None)
                rounds.reset()
                raise
            self._outer_step(landed)
            rounds.load_pseudo_gradients(deltas)
            flight.launch(opener)
        finally:
            self._end_accumulation()

    def _outer_step(self, landed: Optional[bool]) -> None:
        if landed:
            self.rounds.apply(grads=self.flight.take())
        else:   # none in flight, or every rank skipped it: the global parameters stay
            self.rounds.reset()

    # --- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The rounds' state, and with ``outer_delay=1`` the landed average under
        ``"delayed"`` (the round in flight lands first)."""
        if self.flight is not None:
            self.flight.land()
        out = self.rounds.state_dict()
        if self.flight is not None:
            out["delayed"] = self.flight.state_dict()
        return out

    def prepare_load(self) -> None:
        """Before a checkpoint replaces the exchange's state: land the round in flight."""
        if self.flight is not None:
            self.flight.land()

    def validate_state_dict(self, state: Any) -> None:
        self.rounds.validate_state_dict(state)
        if self.flight is not None:
            self.flight.validate_state_dict(state.get("delayed") or {})

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rounds.load_state_dict(state)
        if self.flight is not None:
            self.flight.load_state_dict(state.get("delayed") or {})
