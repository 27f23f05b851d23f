"""``SlimState``: what the Slim-DP DDP communication hook keeps between calls (one per DDP model).

DDP hands its communication hook one flat gradient bucket at a time during backward. Each
bucket gets an exchange of its own (exchange/step.py) over stand-in parameters that share the
bucket's storage, one per parameter the bucket carries: the exchange sees the model's own tensors,
so it treats them as ``DistributedOptimizer`` does (tensors under ``min_compress_numel`` sent
dense, norms and biases among them, and the rest sliced), and writes the pulled update back into
the bucket (ddp/buckets.py keeps them, by the parameters a bucket carries, through DDP's
re-bucketing). The exchanges run on the process group's torch.distributed backend (Gloo for CPU
tensors, NCCL for CUDA), with the guarantees of ``DistributedOptimizer``'s: validated settings,
the handshake at each exchange's first step (a rank with another bucket or other settings is
named), bitwise identical replicas, NaN/Inf verdicts every rank shares, and a checkpoint that
resumes bitwise.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError, SlimConfig
from ..config.env import resolve_config
from ..exchange.describe import config_difference
from ..exchange.stats import ExchangeStats
from ..exchange.loss_scale import LossScale, checked_scaler, loss_scale
from ..optim.wrapping import checked_named
from ..transport.base import Transport
from .adam import HookAdam
from .buckets import BucketExchanges
from .checks import check_keywords, refuse_old_format
from .group import group_transport
from .hook import slim_hook
from .passes import BackwardPass

# 2: one stand-in per parameter (1: one per bucket, whose exchanges' state does not fit).
VERSION = 2


class SlimState:
    """The state of :func:`hvd_slim.ddp.slim_hook` for one DDP model, as PowerSGD's
    ``PowerSGDState`` is for its hook::

        ddp_model.register_comm_hook(SlimState(), slim_hook)

    Args:
        process_group: The process group the exchange runs on (default None: a private
            group over the default group's ranks, made at the first bucket, whose exchanges
            run on a communication thread; a group given is used as it is, in DDP's thread).
            Gloo carries CPU gradients, NCCL CUDA ones.
        optimizer: torch's ``Adam`` or ``AdamW`` over the DDP model's parameters (default
            None: gradients travel, for any optimizer). Given, each rank's Adam update travels
            and ``optimizer.step()`` applies what was delivered (docs/ddp.md, "Adam"). A
            framework that makes the optimizer later gives it with :meth:`set_optimizer`.
        named_parameters: ``(name, parameter)`` tuples, usually ``model.named_parameters()``
            of the model DDP wraps (default None). Each exchange then lays its bucket out by
            name, as ``DistributedOptimizer`` does, where DDP's bucket order would otherwise
            fix it; at the fair horizon that order cost AdamW about half a point
            (docs/ddp.md). :meth:`register` gives the names itself: pass them where a framework
            registers the hook (Lightning's ``DDPStrategy(ddp_comm_hook=...)``). Every
            parameter DDP reduces must be named; every rank must name them alike (the
            handshake names a rank that differs).
        **keywords: The Slim-DP keywords of ``hvd_slim.DistributedOptimizer`` (``density``,
            ``value_bits``, ``pull_value_bits``, ``servers``, ``nonfinite``, ``timeout``, the
            warm-up's, ...), each read from ``HVD_SLIM_<NAME>`` when not passed. What needs
            the optimizer or the model is refused by name: ``local_steps`` (rounds of local
            steps: :func:`hvd_slim.ddp.local_optimizer` wraps the optimizer), ``overlap``
            (DDP's buckets already overlap backward), ``hierarchical``, momentum correction,
            ``adam_exchange="update"`` and ``magnitude_weight``.

    Raises:
        TypeError: an unknown keyword.
        ConfigError: (a ValueError) a value out of range, or one the hook cannot serve; a
            value from the environment names its variable.
    """

    def __init__(self, process_group: Any = None, optimizer: Any = None,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 **keywords: Any) -> None:
        transport = keywords.pop("transport", None)
        check_keywords(keywords)
        named = None if named_parameters is None else checked_named(named_parameters)
        self._keywords = dict(keywords)
        self.config: SlimConfig = self._configure(update=optimizer is not None)
        self._adam = None if optimizer is None else HookAdam(optimizer)
        self._scaler: Any = None               # set_grad_scaler()'s
        self.process_group = process_group
        if transport is not None and not isinstance(transport, Transport):
            raise TypeError(f"transport must be an hvd_slim Transport (for tests), got "
                            f"{type(transport).__name__}")
        self._transport: Optional[Transport] = transport
        self._private = transport is not None   # a private group (or a test's): threads allowed
        # The scale of the gradients the exchanges take, when they are gradients (told by
        # set_grad_scaler): exchange/loss_scale.py.
        self._loss_scale = LossScale()
        self._buckets = BucketExchanges(self.config, self._transport_for, self._loss_scale)
        if named is not None:   # register() then keeps them
            self._buckets.names = {id(p): n for n, p in named}
        self._pass = BackwardPass()            # the buckets of the pass in flight
        # What the state owns besides its data (from the first bucket), released by close(),
        # when the state is collected, or at exit while Python still runs (the finalizer's).
        self._owned = _Owned(self._pass)
        self._release: Optional[weakref.finalize] = None
        self._closed = False
        self._skipped = 0                      # passes every rank skipped (NaN/Inf)
        self.iteration = 0                     # backward passes that reached the hook
        self._model: Optional[Any] = None      # a weak reference to the model register() saw

    def _configure(self, update: bool) -> SlimConfig:
        """The settings from the keywords given and ``HVD_SLIM_*``; ``update``: Adam's update
        travels (an optimizer was given), at the update exchange's defaults."""
        config = resolve_config(self._keywords)
        check_keywords(self._keywords, config, update=update)
        if not update:   # gradients travel: no optimizer takes momentum or Adam's update
            return config.replaced(momentum_correction=False, adam_exchange="gradient")
        config = config.replaced(momentum_correction=False, adam_exchange="update")
        return config.replaced(**config.update_defaults())

    def set_optimizer(self, optimizer: Any) -> "SlimState":
        """Give the state its optimizer after it was made, as ``SlimState(optimizer=...)``
        does: for frameworks that make the optimizer after the hook's state (Lightning calls
        ``configure_optimizers`` after the ``DDPStrategy`` holding the state is built).

        Args:
            optimizer: torch's ``Adam`` or ``AdamW`` over the DDP model's parameters (a
                framework's wrapper refused, naming the torch optimizer it holds).

        Returns:
            This state.

        Raises:
            RuntimeError: the state has an optimizer already, has seen a backward pass, or
                holds a loaded checkpoint (whose settings were those without an optimizer):
                call it before both.
            ValueError: what ``optimizer=`` refuses (another optimizer, ``amsgrad``, an
                optimizer serving another state, a setting the update exchange cannot serve).
        """
        if self._adam is not None:
            raise RuntimeError("SlimState.set_optimizer: this state has an optimizer already; "
                               "make one SlimState per optimizer")
        if self._begun:
            raise RuntimeError("SlimState.set_optimizer: call it before the first backward pass "
                               "and before load_state_dict(): the exchanges are made with the "
                               "settings of the optimizer they serve")
        config = self._configure(update=True)   # refused here, nothing changed
        adam = HookAdam(optimizer)
        self.config, self._adam = config, adam
        self._loss_scale.scaler = None   # Adam takes the scale out before the exchange
        names = self._buckets.names   # named_parameters= or register(), if given first
        self._buckets = BucketExchanges(config, self._transport_for, self._loss_scale)
        self._buckets.names = names
        return self

    def set_grad_scaler(self, scaler: Any) -> "SlimState":
        """Tell the state of the ``torch.amp.GradScaler`` that scales this model's loss. The hook
        runs in backward, before the scaler's ``unscale_``, on scaled gradients; told the
        scale, what outlives a pass is kept in true units, so a scale that grows or backs off
        changes nothing and a run is bitwise the run without a scaler: the residuals where
        gradients travel, each rank's Adam moments under ``optimizer=``.

        Call it before the first backward pass and before ``load_state_dict()``; afterwards only
        one scaler may replace another. Where gradients travel every rank must give one, or
        none (the handshake names a rank that differs), and a checkpoint records it.

        Args:
            scaler: A ``torch.amp.GradScaler`` (its scale is read at each backward pass), or
                None to forget one.

        Returns:
            This state.

        Raises:
            TypeError: ``scaler`` is not a ``torch.amp.GradScaler``.
            RuntimeError: a scaler given, or taken away, after the first backward pass or a
                loaded checkpoint, while gradients travel.
        """
        scaler = checked_scaler(scaler, "SlimState.set_grad_scaler")
        if self._adam is None:   # gradients travel
            self._loss_scale.give(scaler, self._begun, "SlimState.set_grad_scaler",
                                  "the first backward pass and before load_state_dict()")
        self._scaler = scaler
        return self

    @property
    def _begun(self) -> bool:
        """Whether a backward pass reached the hook or a checkpoint was loaded: the exchanges
        (or the saved ones) hold state made with the settings in force."""
        b = self._buckets
        return bool(self.iteration or not self._pass.fresh or b.live or b.saved or b.carry)

    # --- registration -----------------------------------------------------------------------
    def register(self, ddp_model: Any) -> "SlimState":
        """Register :func:`hvd_slim.ddp.slim_hook` with this state on ``ddp_model``, as
        ``ddp_model.register_comm_hook(state, slim_hook)`` does, after checking what the hook
        alone cannot see: that the model is DDP's, that this state serves no other model, and
        that its process group has the DDP model's ranks. It also gives the state the
        parameters' names, so each exchange lays them out by name as ``DistributedOptimizer``
        does (registered directly, the hook lays them out in DDP's bucket order).

        Args:
            ddp_model: A ``torch.nn.parallel.DistributedDataParallel`` model.

        Returns:
            This state, so ``state = SlimState(...).register(ddp_model)`` is one line.

        Raises:
            TypeError: ``ddp_model`` is not a DistributedDataParallel model.
            RuntimeError: this state was registered on another DDP model.
            ValueError: this rank is outside the state's process group, or the group has
                other ranks than the DDP model's (its size differs, or its members).
        """
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"SlimState.register: ddp_model must be a torch.nn.parallel."
                            f"DistributedDataParallel model, got {type(ddp_model).__name__}; "
                            f"wrap the module in DistributedDataParallel first")
        held = self._model() if self._model is not None else None
        if held is not None and held is not ddp_model:
            raise RuntimeError("SlimState.register: this SlimState already serves another DDP "
                               "model (its residuals belong to that model's parameters). Make "
                               "one SlimState per model")
        mine, theirs = _group_ranks(self.process_group), _group_ranks(ddp_model.process_group)
        if mine is None:
            raise ValueError(f"SlimState.register: rank {dist.get_rank()} is not a member of "
                             f"the SlimState's process_group; build it with the DDP model's "
                             f"group: SlimState(process_group=ddp_model.process_group)")
        if mine != theirs:
            what = (f"{len(mine)} ranks and the DDP model's {len(theirs or [])}"
                    if len(mine) != len(theirs or []) else
                    f"ranks {mine} and the DDP model's {theirs}")
            raise ValueError(f"SlimState.register: the SlimState's process_group has {what}: "
                             f"replicas outside the state's group would drift apart. Build it "
                             f"with SlimState(process_group=ddp_model.process_group), or leave "
                             f"process_group None for DDP's default group")
        ddp_model.register_comm_hook(self, slim_hook)
        self._model = weakref.ref(ddp_model)
        # The exchanges lay the parameters out by name, as DistributedOptimizer does: in one
        # bucket the hook then trains bit for bit as DistributedOptimizer's default.
        if self._buckets.names is None:   # else named_parameters= gave them
            self._buckets.names = {id(p): n for n, p in ddp_model.module.named_parameters()}
        return self

    # --- the transport ----------------------------------------------------------------------
    def _transport_for(self, device: torch.device) -> Transport:
        """The exchange's transport (made at the first bucket, for its gradients' device)."""
        if self._release is None:   # the first bucket: a thread, and maybe a group, to release
            if self._transport is None:
                self._transport, self._private = group_transport(self.process_group, device)
                self._owned.transport = self._transport
            self._release = weakref.finalize(self, self._owned.release)
        return self._transport

    def close(self) -> None:
        """Release what the state holds besides its data: its communication thread, and the
        private process group it made at the first bucket (a ``process_group`` given is the
        caller's, and stays). Python does it at exit for a state not closed, before the
        interpreter's teardown, where torch's Gloo threads can abort a process that leaves
        its groups to it (docs/ddp.md, "Teardown"). A closed state still gives
        :meth:`comm_stats` and :meth:`state_dict`; a backward pass through its hook fails
        naming ``close()``. Calling it again does nothing.

        Raises:
            RuntimeError: a backward pass is in flight: close the state after backward.
        """
        if self._pass.in_flight:
            raise RuntimeError("hvd_slim.ddp: SlimState.close() during a backward pass (its "
                               "buckets are in flight); close the state after backward returns")
        self._closed = True
        if self._release is not None:
            self._release()   # a finalizer runs at most once

    # --- one backward pass ------------------------------------------------------------------
    def reduce(self, index: int, buffer: torch.Tensor, params: Sequence[torch.Tensor],
               last: bool) -> "torch.futures.Future[torch.Tensor]":
        """A future of the averaged update for DDP's bucket ``index``: its flat gradient
        ``buffer``, the concatenation of ``params``' gradients; ``last``: the last bucket of
        this backward pass.

        Each bucket is exchanged (pushed, aggregated, pulled) when it comes; the pass is
        settled at its last bucket, all or nothing as DistributedOptimizer's step: when any
        bucket's step was skipped by every rank (a NaN/Inf under ``nonfinite="flag"``),
        nothing of any exchange changes and every bucket's update is NaN, so GradScaler skips
        and backs off alike everywhere. The futures complete then; DDP waits for them at the
        end of backward. An error ends the pass on every bucket, each keeping its gradient."""
        fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
        flight = self._pass
        try:
            if self._closed:
                raise RuntimeError("hvd_slim.ddp: this SlimState was closed (SlimState.close()"
                                   "); to train on, make a new SlimState and load this one's "
                                   "state_dict() into it")
            if flight.fresh and self._adam is not None:
                self._adam.new_pass(loss_scale(self._scaler))
            flight.fresh = False
            if flight.failed is not None:
                raise flight.failed
            keys = self._buckets.keys_of(index, params)
            numels = tuple(p.numel() for p in params)
            transport = self._transport_for(buffer.device)
            b = self._buckets.for_bucket(index, buffer, keys, numels)
            if self._adam is not None:   # this rank's Adam update travels, not its gradient
                self._adam.precondition(keys, params, buffer, transport.size, b.dense)
            # What retired exchanges held joins after Adam: it is in the units that travel.
            self._buckets.take_carry(keys, numels, buffer)
            # The same parameters in another order (DDP's first layout and its rebuilt one):
            # the exchange keeps its own order, so a resumed run matches an unbroken one.
            starts = b.starts(keys, numels)
            b.feed(buffer, starts)
            # A thread of its own only on a private group (or a test's): DDP's own group may
            # be in use by DDP's thread meanwhile.
            flight.begin(b, fut, starts, buffer, list(params), keys,
                         threaded=self._private and transport.threads_allowed())
        except Exception as exc:  # noqa: BLE001 - every bucket of the pass reports it
            flight.fail(exc, fut, self._adam)
        if last:
            try:
                if flight.settle(self._adam, flag=self.config.nonfinite == "flag"):
                    self._skipped += 1
            finally:
                flight.end()
                self.iteration += 1
                self._buckets.keys_final = True
        return fut

    def held_by_parameter(self) -> Dict[int, torch.Tensor]:
        """Everything this rank holds back (float64, flat, in the units that travel), by
        parameter position (the order of the first backward pass the state saw): with what
        every rank's hook delivered, it adds up to everything fed in."""
        return self._buckets.held_by_parameter()

    # --- figures ----------------------------------------------------------------------------
    def comm_stats(self) -> Dict[str, Any]:
        """Cumulative traffic of this rank, with the fields of
        ``DistributedOptimizer.comm_stats()``: the buckets' exchanges (and those DDP's
        re-bucketing retired) added up; ``steps`` counts the backward passes that reached the
        hook, ``buckets`` the exchanges in use."""
        live = self._buckets.live.values()
        stats = [b.exchange.stats for b in live]
        out: Dict[str, Any] = {f: self._buckets.retired[f] + sum(getattr(s, f) for s in stats)
                               for f in ExchangeStats.FIELDS}
        out["steps"], out["skipped_steps"] = self.iteration, self._skipped
        out["flushes"] = max((s.flushes for s in stats), default=0)
        last: Dict[str, int] = {}
        for s in stats:
            for k, v in s.last.items():
                last[k] = last.get(k, 0) + v
        out["last_step"] = last
        out["last_skip_reason"] = next((s.last_skip for s in stats if s.last_skip), "")
        layouts = [b.exchange.layout for b in live]
        tr = self._transport
        out.update(transport=None if tr is None else tr.name,
                   world_size=None if tr is None else tr.size,
                   servers=max((b.exchange.servers for b in live), default=0),
                   density=self.config.density, buckets=len(layouts),
                   compressed_numel=sum(b.numel for lo in layouts for b in lo.sparse),
                   dense_numel=sum(b.numel for lo in layouts for b in lo.buckets
                                   if b.kind != "sparse"))
        return out

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: every exchange's residuals and selectors, with the positions of
        the parameters its bucket carries (tensors and plain values only; ``torch.load(...,
        weights_only=True)`` reads it). Save each rank's own."""
        buckets, carry, retired = self._buckets.state()
        return {"version": VERSION, "iteration": self.iteration,
                "config": self.config.effective_dict(), "buckets": buckets,
                "carry": carry, "retired": retired,
                "skipped": self._skipped, "scaled": self._loss_scale.told,
                "adam": None if self._adam is None else self._adam.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (this rank's own) before the first backward pass of a
        fresh DDP model. The settings must be the same; each saved exchange is checked
        completely when its bucket comes. A refused state changes nothing."""
        refuse_old_format(state, "version", 1, "SlimState checkpoint",
                          "exchanges covered a whole bucket as one tensor",
                          "exchanges each parameter apart (version 2)")
        if not isinstance(state, dict) or state.get("version") != VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"hvd_slim.ddp: unknown SlimState format version {got!r}; expected "
                             f"{VERSION}, a SlimState.state_dict()")
        diff = config_difference({"in the checkpoint": state.get("config"),
                                  "now": self.config.effective_dict()},
                                 lambda keys: " and ".join(keys), ignore=("timeout", "nonfinite"))
        if diff:
            raise ConfigError(f"hvd_slim.ddp: the checkpoint was made with other Slim-DP "
                              f"settings: {diff}. Build the SlimState with the same keywords "
                              f"and HVD_SLIM_* variables", "state_dict")
        buckets, it, carry = state.get("buckets"), state.get("iteration"), state.get("carry", {})
        ok = isinstance(buckets, list) and isinstance(it, int) and not isinstance(it, bool) \
            and it >= 0 and isinstance(carry, dict) and all(
                isinstance(s, dict) and {"keys", "numels", "exchange"} <= set(s) and
                len(s["keys"]) == len(s["numels"]) for s in buckets)
        if not ok:
            raise ValueError("hvd_slim.ddp: a SlimState checkpoint needs 'iteration' (an integer "
                             ">= 0), 'buckets' (each with keys, numels and its exchange) and "
                             "'carry'; load a SlimState.state_dict()")
        self._loss_scale.check_resumed(state.get("scaled", False), "hvd_slim.ddp: the checkpoint",
                                       "state")
        if self._adam is not None:
            self._adam.load_state_dict(state.get("adam"))   # refused before anything changes
        self._buckets.load(buckets, carry, state.get("retired", {}))
        self.iteration, self._skipped = it, int(state.get("skipped", 0))


class _Owned:
    """What a :class:`SlimState` owns besides its data: the communication thread of its
    backward passes, and the transport it made (a private group, destroyed when it closes).
    Apart from the state, so that the state's finalizer can hold it."""

    def __init__(self, backward: BackwardPass) -> None:
        self.backward = backward
        self.transport: Optional[Transport] = None   # made by the state, at the first bucket

    def release(self) -> None:
        self.backward.close()
        if self.transport is not None:
            self.transport.close()


def _group_ranks(group: Any) -> Optional[List[int]]:
    """The global ranks of ``group`` (None: the default group), or None where this rank is
    not a member."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hvd_slim.ddp: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group() (torchrun sets up its "
                           "environment) before registering the hook")
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    if dist.get_rank(group) < 0:
        return None
    return list(dist.get_process_group_ranks(group))

