"""How a round of local steps ends on this rank: its pseudo-gradient through the exchange and
the outer step, waited for at the round's end (``outer_delay=0``) or landing one round late
(``outer_delay=1``, outer/delayed.py). The optimizer calls :meth:`RoundEnds.end` at a round's
last local step, :meth:`serve` on a joined rank, :meth:`land` before a flush, and the
checkpoint methods for ``"hvd_slim_outer"``.

With ``outer_delay=1`` a round does not restart from the global parameters, which lack the
round in flight: each rank keeps its own progress. A round's pseudo-gradient is measured from
where this rank started it (``start``), and at its end the model becomes the new global
parameters plus that progress, which reaches the global parameters a round later. (Restarting
from the global parameters instead trains every round from one round back, and DiLoCo's
outer momentum on those overlapping pseudo-gradients ended MNIST at 32 to 56%.) With one rank
and an outer SGD of lr 1 this is exactly local training. A round in flight that every rank
skipped (a NaN/Inf) drops the round that built on it too: every rank restarts from the global
parameters, and nothing is launched."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..exchange.errors import NonFiniteGradientError
from .delayed import InFlight, Opener
from .rounds import OuterRounds, matches_params


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
        # outer_delay=1: where this rank's current round started (its own progress is
        # measured from here); the global parameters when training starts.
        self.start = [p.detach().clone() for p in rounds.params] if delayed else None

    def rebind(self, exchange: Any) -> None:
        """Elastic recovery: later rounds run over ``exchange``. A round in flight on the old
        one is dropped with it; the state to resume comes from a commit."""
        self.exchange = exchange
        if self.flight is not None:
            self.flight = InFlight(exchange, self.flight.params)

    def first_step(self) -> None:
        """Before the first local step: the global parameters (and this rank's round start)
        are the model's now, after any broadcast the script made after building the
        optimizer. A no-op after that, or once a checkpoint was loaded."""
        if self.rounds.capture():
            self._mark_start()

    def flushed(self, only: set) -> None:
        """A flush's pulled residuals (in ``p.grad``) land on the global parameters
        (:meth:`OuterRounds.apply_flushed`); the next round starts from them."""
        self.rounds.apply_flushed(only)
        self._mark_start()

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
        own = self._progress()
        try:
            landed = self.flight.land()
        except BaseException:
            self._restart(None)
            raise
        self._restart(landed, own)

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
        own = self._progress()   # this round's, before the outer step moves the parameters
        deltas = [-d for d in own]   # start - local: what the exchange sends
        try:
            try:
                landed = flight.land()
            except NonFiniteGradientError:
                self._restart(None)   # this round built on the dropped one: it goes too
                raise
            except BaseException:
                # This round's work is kept in the residual, as a failed exchange keeps it.
                rounds.load_pseudo_gradients(deltas)
                self.exchange.absorb(None)
                self._restart(None)
                raise
            if landed is False:   # every rank skipped the round in flight (a NaN/Inf): this
                self._restart(None)   # one built on it goes too, and every rank restarts
                return
            self._restart(landed, own)
            rounds.load_pseudo_gradients(deltas)
            flight.launch(opener)
        finally:
            self._end_accumulation()

    def _progress(self) -> List[torch.Tensor]:
        """``local - start``: this rank's progress in its current round."""
        return [p.detach() - s for p, s in zip(self.rounds.params, self.start)]

    def _restart(self, landed: Optional[bool], own: Optional[List[torch.Tensor]] = None
                 ) -> None:
        """The outer step on the landed average (``landed`` True; False or None: none, the
        global parameters stay), then the model is the global parameters plus ``own`` (None:
        nothing of the round kept, after a failure), and the next round starts there."""
        if landed:
            self.rounds.apply(grads=self.flight.take())
        else:
            self.flight.take()   # forget a landed skip: it has been acted on
            self.rounds.reset()
        if own is not None:
            with torch.no_grad():
                for p, d in zip(self.rounds.params, own):
                    p.add_(d)
        self._mark_start()

    def _mark_start(self) -> None:
        """``outer_delay=1``: the next round starts from the model as it is now."""
        if self.start is None:
            return
        with torch.no_grad():
            for p, s in zip(self.rounds.params, self.start):
                s.copy_(p)

    # --- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The rounds' state, and with ``outer_delay=1`` under ``"delayed"`` the landed average
        (the round in flight lands first) and where this rank's round started."""
        if self.flight is not None:
            self.flight.land()
        out = self.rounds.state_dict()
        if self.flight is not None:
            out["delayed"] = dict(self.flight.state_dict(),
                                  start=[s.clone() for s in self.start])
        return out

    def prepare_load(self) -> None:
        """Before a checkpoint replaces the exchange's state: land the round in flight."""
        if self.flight is not None:
            self.flight.land()

    def validate_state_dict(self, state: Any) -> None:
        self.rounds.validate_state_dict(state)
        if self.flight is not None:
            delayed = state.get("delayed") or {}
            self.flight.validate_state_dict(delayed)
            if not matches_params(delayed.get("start"), self.start):
                raise ValueError("hvd_slim checkpoint: its round start ('delayed'/'start') does "
                                 "not match this model's trainable parameters; it was saved "
                                 "without outer_delay=1 or for another model")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rounds.load_state_dict(state)
        if self.flight is not None:
            self.flight.load_state_dict(state["delayed"])
            for s, t in zip(self.start, state["delayed"]["start"]):
                s.copy_(t)
