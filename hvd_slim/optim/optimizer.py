"""The methods of an hvd_slim optimizer: Horovod's optimizer protocol with the Slim-DP exchange
underneath.

:func:`hvd_slim.DistributedOptimizer` (optim/distributed_optimizer.py) returns an instance of a class
created on the fly that subclasses the user's optimizer class (same name), as Horovod does, with
these methods. Gradient hooks count backward passes (and, with ``overlap``, start each stage's
exchange); the exchange runs in :meth:`synchronize`, or with ``local_steps`` once a round.
"""
from __future__ import annotations

import logging
import math
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Dict, List

import torch

from ..api import engine
from ..api import join as api_join
from ..exchange import SPARSE, Layout
from ..exchange.build import build_exchange
from ..exchange.errors import NonFiniteGradientError
from ..exchange.loss_scale import checked_scaler, loss_scale
from ..exchange.protocol import OverlappedExchange
from ..outer import OuterRounds
from ..outer.ends import RoundEnds
from ..runtime.horovod import called_by_horovod_state_init
from .forward_apply import ForwardApply
from .inner import adam, wrapped
from .inner.adam_update import AdamUpdate
from .wrapping import SlimSettings, adopt_source, comm_dtype_fn, momentum_plan

log = logging.getLogger("hvd_slim")


class _SlimOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer class."""

    def __init__(self, params, settings: SlimSettings, source: torch.optim.Optimizer) -> None:
        super(self.__class__, self).__init__(params)
        adopt_source(self, settings, source)
        named = settings.named_parameters
        self._parameter_names = {p: n for n, p in named}
        self._requires_update = [p for _, p in named if p.requires_grad]
        self._layout = Layout([(n, p) for n, p in named if p.requires_grad], settings.config,
                              comm_dtype_fn(settings.compression),
                              frozen=[(n, p) for n, p in named if not p.requires_grad])
        cfg = settings.config
        # local_steps > 1: the wrapped optimizer steps on local gradients and the exchange
        # carries pseudo-gradients to the outer optimizer (outer/rounds.py), so neither momentum
        # correction nor optim/inner/adam.py's rescaled steps apply.
        self._outer = None
        if cfg.local_steps > 1:
            if cfg.adam_variance == "rescaled":
                raise ValueError("adam_variance='rescaled' cannot be combined with local_steps "
                                 "> 1: the wrapped optimizer steps on local dense gradients. "
                                 f"Leave it 'auto'{cfg.env_note('adam_variance')}")
            self._outer = OuterRounds(self._requires_update, cfg.local_steps, settings.outer,
                                      cfg.density)
        try:
            plan = momentum_plan(self, self._layout, cfg) if self._outer is None else {}
        except ValueError as exc:
            note = cfg.env_note("momentum_correction")
            if not note:
                raise
            raise ValueError(f"{exc}{note}") from None
        self._mc_params = {id(p) for b in self._layout.sparse if b.index in plan
                           for p in b.params()}
        self._sparse_params = {id(p) for b in self._layout.sparse for p in b.params()}
        self._rescaled_params = adam.rescaled_parameters(self, self._layout, cfg) \
            if self._outer is None and cfg.adam_exchange != "update" else set()
        self._plan = plan
        self._exchange = self._make_exchange(settings)
        # adam_exchange="update" (resolved by DistributedOptimizer): each rank's Adam update
        # of the compressed parameters is what the exchange carries (optim/inner/adam_update.py).
        self._adam = AdamUpdate(self, self._layout, self._exchange.size) \
            if cfg.adam_exchange == "update" else None
        self._grad_scaler: Any = None   # set_grad_scaler()'s
        # How a round ends (outer/ends.py); outer_delay=1: its exchange runs during the next.
        self._ends = None if self._outer is None else RoundEnds(
            self._outer, self._exchange, self._requires_update, bool(cfg.outer_delay),
            self._end_accumulation)
        # overlap > 1: the hooks start each stage's exchange as its gradients come in.
        self._overlapped = isinstance(self._exchange, OverlappedExchange)
        # overlap_forward: step() may leave its updates to the next forward (optim/forward_apply.py).
        self._forward = None
        if cfg.overlap_forward and self._overlapped:
            self._forward = ForwardApply([[p for _, p in cut] for cut in self._exchange.cuts],
                                         self._step_deferred)
        self._delay = {p: self.backward_passes_per_step for p in self._requires_update}
        self._pending = set()
        self._synchronized = False
        self._should_synchronize = True
        self._skipped = False   # the last exchange was skipped by every rank (NaN/Inf)
        self._hook_handles = []
        for p in self._requires_update:
            # A DistributedOptimizer built again over the same parameters (after unfreezing
            # layers, say) replaces the earlier one's hook: two would count each backward twice.
            ref, old = _HOOKS.pop(id(p), (None, None))
            if old is not None and ref() is p:
                old.remove()
            handle = p.register_post_accumulate_grad_hook(self._make_hook(p))
            _HOOKS[id(p)] = (weakref.ref(p, lambda _r, key=id(p): _HOOKS.pop(key, None)),
                             handle)
            self._hook_handles.append(handle)
        # Each exchange starts with a round a joined rank serves (api/join.py); None: no round.
        self._join_id = api_join.register(self, settings.ranks, settings.transport)

    # --- hooks -------------------------------------------------------------------------------
    def _make_hook(self, p: torch.Tensor):
        def hook(_param: torch.Tensor) -> None:
            if self._forward is not None:
                self._forward.on_grad(p, self._parameter_names.get(p, "?"))
            if self._delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            self._delay[p] -= 1
            self._pending.add(p)
            if self._overlapped and self._delay[p] == 0:
                self._exchange.grad_ready(p, self._open_round)
        return hook


    def _make_exchange(self, settings: SlimSettings) -> Any:
        """The exchange of this optimizer's layout on ``settings.transport``."""
        return build_exchange(self._layout, settings.config, settings.transport, self._plan,
                              ranks=settings.ranks, order=[
                                  n for n, p in settings.named_parameters if p.requires_grad])

    def _rebind_exchange(self, settings: SlimSettings) -> None:
        """Elastic recovery (elastic/rebind.py): a new exchange on ``settings.transport``, taken
        by everything that held the old one (the update exchange's rank count, the round ends
        of ``local_steps > 1``). It starts empty; the caller loads a committed state."""
        self._settings = settings
        self._exchange = self._make_exchange(settings)
        if self._adam is not None:
            self._adam.size = self._exchange.size
        if self._ends is not None:
            self._ends.rebind(self._exchange)
    def _step_round(self, wait: bool = True) -> Any:
        """The join round that starts this step's exchange (api/join.py), if this optimizer has
        one: run now, or (``wait=False``) queued, returning its handle."""
        if self._join_id is not None:
            return engine.exchange_round(f"the exchange of step {self._exchange.step_count}",
                                         self._join_id, flush=False, wait=wait)
        return None

    def _open_round(self):
        """Queue the join round of an overlapped step (from its first hook, so it keeps its
        place among the script's tensor-API calls); returns what waits for it, or None."""
        handle = self._step_round(wait=False)
        return None if handle is None else (lambda: engine.synchronize(handle))

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate before each exchange."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def set_grad_scaler(self, scaler: Any) -> None:
        """Tell the optimizer of the ``torch.amp.GradScaler`` that scales the loss. In Horovod's
        AMP order the exchange runs before ``scaler.unscale_``, on scaled gradients; told the
        scale, it keeps what outlives a step in true units, so a scale that grows or backs off
        changes nothing and a run is bitwise the run without a scaler:

        - where gradients travel, the residuals (and momentum correction's velocities) hold
          true units, and ``flush()`` applies them as such (untold, they hold the scale of the
          step that left them, and a flush applies them at the loss scale);
        - under ``adam_exchange="update"``, each rank's Adam moments are of its true gradient.

        Call it before the first step and before ``load_state_dict()``; afterwards only one
        scaler may replace another. Where gradients travel every rank must give one, or none
        (the handshake names a rank that differs), and a checkpoint records it (a resumed
        optimizer must say the same).

        Args:
            scaler: A ``torch.amp.GradScaler`` (its scale is read at each exchange), or None
                to forget one.

        Raises:
            TypeError: ``scaler`` is not a ``torch.amp.GradScaler``.
            RuntimeError: a scaler given, or taken away, after the first step.
        """
        scaler = checked_scaler(scaler, "set_grad_scaler")
        if self._adam is None and self._outer is None:   # gradients travel
            self._layout.loss_scale.give(scaler, self._exchange.step_count > 0,
                                         "set_grad_scaler", "the first step (and before "
                                         "load_state_dict())")
        self._grad_scaler = scaler

    # --- Horovod protocol --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Run the Slim-DP exchange now: afterwards every ``p.grad`` holds the pulled update.

        Every rank must call it the same number of times; parameters that got no gradient on
        this rank contribute zeros, so different subgraphs per rank never deadlock. A step with
        a NaN/Inf gradient on any rank is skipped by every rank (nothing of the exchange
        changes) and the following ``step()`` does not step the wrapped optimizer. Under
        ``nonfinite="flag"`` (default) every ``p.grad`` is then NaN on every rank, so a
        ``torch.amp.GradScaler`` on each rank sees ``found_inf``, skips its step and lowers its
        scale alike; under ``"skip"`` they keep this rank's gradients. A rank inside
        ``hvd.join()`` takes part with zero gradients (:mod:`hvd_slim.api.join`).

        With ``adam_exchange="update"`` (torch's Adam and AdamW by default) the compressed
        parameters' ``p.grad`` then hold the average of the ranks' Adam updates, not of their
        gradients, and ``step()`` applies that update as it was delivered: clip before
        ``synchronize()`` to clip this rank's gradient."""
        self._synchronize(explicit=True)

    def _synchronize(self, explicit: bool) -> None:
        if self._outer is not None:   # local steps: p.grad is this rank's, nothing to exchange
            self._synchronized = True
            return
        self.apply_updates()
        if self._overlapped:   # the round, if any, was queued by the first hook (or is now)
            self._synchronize_now(self._open_round)
            return
        self._step_round()   # before anything changes: a refusal leaves all as it was
        self._synchronize_now()
        if explicit and self._adam is not None and not self._skipped:
            self._adam.snapshot()   # what step() applies, whatever happens to p.grad now

    def _synchronize_now(self, opener=None) -> None:
        self._skipped = False
        if self._adam is not None:
            self._adam.precondition(loss_scale(self._grad_scaler))
        try:
            self._skipped = not (self._exchange.step(opener) if self._overlapped
                                 else self._exchange.step())
        except NonFiniteGradientError:   # nonfinite="raise": nothing of the step is kept
            if self._adam is not None:
                self._adam.settle(keep=False)
            raise
        except BaseException:   # the update is kept in the residual, so are the moments
            if self._adam is not None:
                self._adam.settle(keep=True)
            raise
        finally:
            # A failed exchange also ends this step's accumulation: the next backward starts a
            # new one (what was computed is kept in the residual, or dropped on NaN/Inf).
            self._end_accumulation()
        if self._adam is not None:
            self._adam.settle(keep=not self._skipped)
        if self._skipped:
            _log_skip(self._exchange.stats.skipped_steps, self._exchange.stats.last_skip)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip the exchange, after an explicit ``synchronize()``::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Exchange (unless inside ``skip_synchronize``), then the wrapped optimizer's step."""
        if not self.state and called_by_horovod_state_init():
            # Horovod's broadcast_optimizer_state creates a fresh optimizer's state with a step
            # on zero gradients, and for its own DistributedOptimizer calls the parent class's
            # step() so no allreduce runs. It recognises only its own class, so do the same
            # here: no exchange, nothing counted, the exchange's step counter untouched. Every
            # rank in that call takes this path; it communicates nothing, as in Horovod. (It
            # steps only an optimizer with no state, so other steps skip the stack walk.)
            return super(self.__class__, self).step(closure)
        if self._outer is not None:
            return self._local_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            if self._forward is not None and closure is None and not self._synchronized:
                return self._step_deferring()
            self._synchronize(explicit=False)
        self._synchronized = False
        if self._skipped:   # every rank skipped this step: the wrapped optimizer must not step
            self._skipped = False
            return None
        return self._inner_step(closure, only_sparse=False)

    def _step_deferring(self):
        """``overlap_forward``: exchange, and leave the update of the stages still in flight
        to the next forward pass (optim/forward_apply.py) when every rank's step is sure to commit."""
        self.apply_updates()
        self._skipped = False
        try:
            out = self._exchange.step(self._open_round, defer=True)
        finally:
            self._end_accumulation()
        if out is True or out is False:   # settled already (a NaN/Inf somewhere, or no thread)
            if out is False:
                return None
            return self._inner_step(None, only_sparse=False)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        self._forward.defer(out, groups, self._exchange.step_count + 1)
        return None

    def _step_deferred(self, only, groups, count) -> None:
        """The wrapped optimizer's step of a deferred stage (``only``: its parameters' ids)."""
        self._inner_step(None, only_sparse=False, only=only, groups=groups, count=count)

    def apply_updates(self) -> None:
        """With ``overlap_forward=True``: apply every update ``step()`` left to the next
        forward pass now (the next forward, backward, ``step()``, ``synchronize()``,
        ``flush()``, ``state_dict()`` and the model's ``state_dict()`` do so themselves). Call
        it before reading parameters outside a forward pass otherwise, e.g. for an EMA.
        Otherwise a no-op."""
        if self._forward is not None:
            self._forward.settle_all()

    def _local_step(self, closure):
        """``local_steps > 1``: the wrapped optimizer's step on this rank's gradients; the last
        local step of a round then exchanges the pseudo-gradient and takes the outer step."""
        self._exchange.agree()   # at the first step: a rank with other settings is named now
        self._ends.first_step()
        self._synchronized = False
        out = super(self.__class__, self).step(closure)
        self._end_accumulation()
        if self._outer.tick():
            self._ends.end(self._step_round, self._open_round)
        return out

    def _end_accumulation(self) -> None:
        self._pending.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition. " + _AMP_HINT)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def _inner_step(self, closure, only_sparse: bool, only=None, groups=None, count=None):
        """The wrapped optimizer's step (optim/inner/wrapped.py): of the compressed parameters only
        (``only_sparse``, a flush), or of ``only`` (a deferred stage of ``overlap_forward``,
        with the hyperparameters ``groups`` of its step ``count``). Adam's rescaled steps
        (optim/inner/adam.py) start once the dense warm-up, if any, is over."""
        count = self._exchange.step_count if count is None else count
        rescaled = self._rescaled_params if count > \
            self._settings.config.warmup_dense_steps else set()
        if self._adam is None:
            return wrapped.step(self, super(self.__class__, self).step, closure,
                                corrected=self._mc_params, rescaled=rescaled, groups=groups,
                                only=self._sparse_params if only_sparse else only)
        # The compressed parameters step by the delivered update; the rest by Adam's own step.
        out = None
        if not only_sparse:
            out = wrapped.step(self, super(self.__class__, self).step, closure, corrected=set(),
                               rescaled=set(), groups=groups, only=only,
                               skip=self._sparse_params)
        self._adam.apply(only=only, decay=not only_sparse)
        return out

    # --- Slim-DP extras ----------------------------------------------------------------------
    def flush(self) -> None:
        """Send every residual (workers' and server's) densely and apply it through one step of
        the wrapped optimizer on the compressed parameters. Afterwards nothing computed is
        pending: call it before a final checkpoint or an exact evaluation. Collective."""
        if self._pending:
            raise AssertionError("optimizer.flush() was called after loss.backward() but before "
                                 "optimizer.step(): step first, then flush")
        self.apply_updates()
        if self._outer is not None:
            if self._outer.taken:   # end the round first
                self._ends.end(self._step_round, self._open_round)
            self._ends.land()
        if self._join_id is not None:
            engine.exchange_round("flush", self._join_id, flush=True)
        self._flush_now()

    def _flush_now(self) -> None:
        self._exchange.flush()
        if self._outer is not None:
            self._ends.flushed(self._sparse_params)
        else:   # residuals, delivered: the compressed parameters' step (no decay under "update")
            self._inner_step(None, only_sparse=True)
        for b in self._layout.sparse:
            for p in b.params():
                if p.grad is not None:
                    p.grad.zero_()

    def _serve_joined(self, flush: bool) -> None:
        """On a rank inside ``hvd.join()``, when the others start this optimizer's exchange:
        take part with zero gradients (Horovod's joined ranks contribute zeros; a backward not
        yet stepped is dropped, as there) and step on the pulled update as they do."""
        self.apply_updates()   # its own last step first (overlap_forward)
        for p in self._requires_update:
            p.grad = None
        self._pending.clear()
        if flush:
            if self._outer is not None:
                self._ends.land()
            self._flush_now()
            return
        if self._outer is not None:   # its pseudo-gradient: its part of a round, if any
            self._ends.serve()
            return
        self._synchronize_now()
        self._synchronized = False
        if self._skipped:
            self._skipped = False
        else:
            self._inner_step(None, only_sparse=False)

    def comm_stats(self) -> Dict[str, Any]:
        """Cumulative traffic of this rank: ``steps``, ``bytes_pushed``, ``bytes_pulled`` (counted
        at the transport), ``dense_bytes`` (gradient bytes a dense allreduce would reduce),
        ``ring_allreduce_bytes`` (what a ring allreduce would send per rank; with
        ``local_steps`` both count every local step, as data parallelism would allreduce at
        each, and ``local_steps_taken`` counts them), the per-part
        breakdown, selection time, wall seconds per phase of the exchange
        (``prepare_seconds``: compensate, select and encode; ``push_seconds``;
        ``serve_seconds``, on a server; ``pull_seconds``; ``apply_seconds``) and ``last_step``;
        ``skipped_steps`` and ``last_skip_reason`` count the steps every rank skipped (a NaN/Inf
        under ``nonfinite="flag"`` or ``"skip"``). ``bytes_sent`` and ``bytes_received`` count
        everything this rank's transport moved in the exchange, its server shard's traffic
        included (``bytes_pushed``/``bytes_pulled`` are its worker side only); ``servers``
        is the number of server shards in force."""
        out = self._exchange.stats.as_dict()
        out.update(transport=self._settings.transport.name, world_size=self._exchange.size,
                   servers=self._exchange.servers,
                   density=self._settings.config.density,
                   compressed_numel=sum(b.numel for b in self._layout.sparse),
                   dense_numel=sum(b.numel for b in self._layout.buckets if b.kind != SPARSE))
        if self._outer is not None:
            # What data parallelism would have moved for the same training: an allreduce at
            # every local step, not only at the rounds' ends.
            st, n = self._exchange.stats, self._outer.local_total
            out.update(local_steps_taken=n, dense_bytes=n * st.grad_bytes,
                       ring_allreduce_bytes=n * st.ring_bytes,
                       compressed_dense_bytes=n * st.compressed_grad_bytes)
        return out

    @property
    def slim_config(self):
        """The validated :class:`hvd_slim.SlimConfig` in force."""
        return self._settings.config

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus this rank's Slim-DP state under ``"hvd_slim"``
        (residuals, velocities, selectors, step). Residuals are per rank: save every rank's.
        With ``outer_delay=1`` the round in flight lands first (its average is saved, to be
        applied at the round's end)."""
        self.apply_updates()
        outer = None if self._ends is None else self._ends.state_dict()   # lands first
        sd = super(self.__class__, self).state_dict()
        sd["hvd_slim"] = self._exchange.state_dict()
        if self._layout.loss_scale.told:   # the residuals are in true units
            sd["hvd_slim_scaled"] = True
        if self._adam is not None:
            sd["hvd_slim_adam"] = self._adam.state_dict()
        if outer is not None:
            sd["hvd_slim_outer"] = outer
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` on this rank. Everything is validated first:
        a checkpoint of another rank, model or Slim-DP config raises ValueError (naming what
        differs) and leaves the optimizer exactly as it was."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict expects a dict, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        slim = state_dict.pop("hvd_slim", None)
        outer = state_dict.pop("hvd_slim_outer", None)
        moments = state_dict.pop("hvd_slim_adam", None)
        scaled = state_dict.pop("hvd_slim_scaled", False)
        if slim is not None:
            self._layout.loss_scale.check_resumed(scaled, "hvd_slim checkpoint", "optimizer")
        if self._ends is not None:
            self._ends.prepare_load()   # the exchange's state is whole before it is replaced
        if slim is not None:
            self._exchange.validate_state_dict(slim)
            if self._ends is not None:
                self._ends.validate_state_dict(outer)
            elif outer is not None:
                raise ValueError(f"hvd_slim checkpoint was saved with local_steps="
                                 f"{outer.get('local_steps')}; this optimizer has "
                                 "local_steps=1. Resume with the same local_steps")
        if moments is not None and self._adam is None:
            raise ValueError("hvd_slim checkpoint holds the Adam update state of "
                             "adam_exchange='update'; this optimizer exchanges gradients. "
                             "Resume with the same adam_exchange")
        if moments is not None:
            self._adam.validate(moments)
        # torch checks the groups before it changes anything; ours is validated already, so
        # from here on nothing can fail half-way.
        if self._forward is not None:   # a step in flight (or failed) is replaced, not landed
            self._forward.discard()
        super(self.__class__, self).load_state_dict(state_dict)
        if slim is not None:
            self._exchange.load_state_dict(slim)
            if self._ends is not None:
                self._ends.load_state_dict(outer)
        if moments is not None:
            self._adam.load_state_dict(moments)
        self._end_accumulation()
        self._synchronized = False
        self._should_synchronize = True
        self._skipped = False


def _log_skip(count: int, why: str) -> None:
    """A step every rank skipped for a NaN/Inf: a WARNING naming the rank and tensor (the
    verdict's text), for the 1st, 10th, 100th, ... such step, so an AMP run that skips now and
    then is not flooded while a script without a GradScaler learns why it stopped moving."""
    if count >= 1 and math.log10(count).is_integer():
        log.warning("hvd_slim: %s (skipped steps so far: %d; nonfinite='raise' stops at the "
                    "first instead)", why or "a step was skipped for a NaN/Inf", count)


# The live gradient hook of each parameter wrapped by a DistributedOptimizer (see __init__).
# By id (tensors compare elementwise), with a weak reference that drops the entry with it.
_HOOKS: Dict[int, Any] = {}

# GradScaler.step(optimizer) checks this rank's gradients for Inf/NaN before it calls step(), so
# a rank that overflowed alone never joins the exchange the others wait in.
_AMP_HINT = ("With torch.amp.GradScaler, exchange before the scaler looks at the gradients, as "
             "in Horovod: scaler.scale(loss).backward(); optimizer.synchronize(); "
             "scaler.unscale_(optimizer); with optimizer.skip_synchronize(): "
             "scaler.step(optimizer); then scaler.update().")


__all__: List[str] = []   # the public factory is in optim/distributed_optimizer.py
