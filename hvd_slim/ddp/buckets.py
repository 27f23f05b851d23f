"""The exchanges of one DDP model's buckets, for ``SlimState``: one exchange per set of
parameters a bucket carries, over stand-ins that share the bucket's storage.

**Buckets change once.** DDP lays its buckets out again after its first iteration or two, in the
order gradients became ready. Exchanges are therefore keyed by what a bucket carries (its
parameters), not by its index. When a bucket with new contents arrives, the exchanges holding any
of its parameters retire: what this rank holds of theirs (its residual, and on a server its
shard's residual) is split by parameter and joins those parameters' gradients in the new
buckets, so no value is lost or sent twice.

**Parameters are keyed by position.** DDP shows the hook tensors, not names. A parameter's key is
its position in the first backward pass the state sees (bucket by bucket, in DDP's first
layout, which a fresh DDP model of the same module always repeats). Checkpoints store these keys,
so a resumed state finds each saved exchange's bucket in the fresh model, or splits it by
parameter when DDP lays it out otherwise. Where the state was given the parameters' names
(``SlimState(named_parameters=...)``, or ``register()``), an exchange's stand-ins carry them
and its layout orders them by name, as ``DistributedOptimizer``'s does; a saved exchange keeps
the names it was laid out by.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import SlimConfig
from ..exchange import SPARSE, Layout
from ..exchange.build import build_exchange
from ..exchange.loss_scale import LossScale
from ..exchange.stats import ExchangeStats
from ..transport.base import Transport

Keys = Tuple[int, ...]


@dataclass
class Bucket:
    """One bucket's exchange, over stand-ins that share the bucket's storage, one per parameter
    (in ``keys``' order)."""

    exchange: Any
    stand_ins: List[torch.nn.Parameter]
    index: int
    keys: Keys                     # its parameters, by position (see the module docstring)
    numels: Tuple[int, ...]        # theirs, in the exchange's order
    dense: frozenset               # the keys the exchange sends dense (an exact average)
    key_of: Dict[str, int]         # a stand-in's name in the exchange's layout -> its key
    names: Tuple[str, ...] = ()    # the stand-ins' names (in ``keys``' order), saved with it
    # For each layout DDP has given these parameters (its first, and its rebuilt one): where
    # each stand-in's part begins in that layout's flat buffer, in the exchange's order.
    layouts: Dict[Keys, Tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def starts(self, keys: Keys, numels: Tuple[int, ...]) -> Tuple[int, ...]:
        """Where, in a bucket laid out as ``keys`` (with ``numels``), each stand-in's part
        begins."""
        found = self.layouts.get(keys)
        if found is None:
            start, offset = {}, 0
            for k, n in zip(keys, numels):
                start[k], offset = offset, offset + n
            found = self.layouts[keys] = tuple(start[k] for k in self.keys)
        return found

    def feed(self, flat: torch.Tensor, starts: Tuple[int, ...]) -> None:
        """Point each stand-in's gradient at its parameter's part of ``flat``: views, so a
        bucket in any layout is read where it lies, with no copy."""
        for s, n, at in zip(self.stand_ins, self.numels, starts):
            s.grad = flat[at:at + n]

    def deliver(self, flat: torch.Tensor, starts: Tuple[int, ...]) -> torch.Tensor:
        """Write the settled update into ``flat``, each parameter's part where the bucket's
        layout has it (a part the exchange updated in place is not copied; the others in one
        ``_foreach_copy_``), and return it."""
        dsts, srcs = [], []
        for s, n, at in zip(self.stand_ins, self.numels, starts):
            dst, src = flat[at:at + n], s.grad.reshape(-1)
            if src.data_ptr() != dst.data_ptr():
                dsts.append(dst)
                srcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return flat


class BucketExchanges:
    """The live exchanges by the parameters their bucket carries, the saved ones waiting for
    their bucket, what retired ones held (by parameter, waiting for a bucket), and the
    parameters' keys.

    Args:
        config: The state's settings.
        transport_for: The exchange's transport for gradients on a device (made once).
        loss_scale: The scale of the gradients DDP hands over (exchange/loss_scale.py), which
            every bucket's exchange shares.
    """

    def __init__(self, config: SlimConfig,
                 transport_for: Callable[[torch.device], Transport],
                 loss_scale: Optional[LossScale] = None) -> None:
        self.config = config
        self._transport_for = transport_for
        self.loss_scale = LossScale() if loss_scale is None else loss_scale
        self.live: Dict[frozenset, Bucket] = {}   # by the parameters a bucket carries
        # id(parameter) -> its name in the model (SlimState's named_parameters= or register()),
        # None where none were given: the stand-ins are named so, and the exchange lays them
        # out by name, as DistributedOptimizer does; given, every parameter must have one.
        self.names: Optional[Dict[int, str]] = None
        self.saved: List[dict] = []            # loaded exchanges waiting for their bucket
        self.carry: Dict[int, torch.Tensor] = {}   # by key: held values waiting for a bucket
        # id(parameter) -> (a weak reference to it, its key)
        self._keys: Dict[int, Tuple[Any, int]] = {}
        self._next_key = 0
        self.keys_final = False                # after the first backward pass: no new ones
        self.retired = {f: 0 for f in ExchangeStats.FIELDS}   # the retired exchanges' figures

    def for_bucket(self, index: int, buffer: torch.Tensor, keys: Keys,
                   numels: Tuple[int, ...]) -> Bucket:
        """The exchange of DDP's bucket ``index`` (its flat ``buffer``, carrying ``keys``): the
        live one, or one begun now."""
        b = self.live.get(frozenset(keys))
        return b if b is not None else self._begin(index, buffer, keys, numels)

    def keys_of(self, index: int, params: Sequence[torch.Tensor]) -> Keys:
        out = []
        for p in params:
            known = self._keys.get(id(p))
            # The same object, not a new one that took a freed parameter's id.
            k = known[1] if known is not None and known[0]() is p else None
            if k is None:
                if self.keys_final:
                    raise ValueError(f"hvd_slim.ddp: DDP's bucket {index} carries a parameter "
                                     f"({tuple(p.shape)}) this SlimState has not seen: it "
                                     f"already serves another DDP model. Make one SlimState "
                                     f"per model")
                k, self._next_key = self._next_key, self._next_key + 1
                self._keys[id(p)] = (weakref.ref(p), k)
            out.append(k)
        return tuple(out)

    def _begin(self, index: int, buffer: torch.Tensor, keys: Keys,
               numels: Tuple[int, ...]) -> Bucket:
        """The exchange for a bucket carrying ``keys`` for the first time: a saved one made for
        the same parameters (in its own order), else a new one, fed what the exchanges it
        replaces held."""
        mine, sizes = set(keys), dict(zip(keys, numels))
        saved = next((s for s in self.saved if set(s["keys"]) == mine and
                      dict(zip(s["keys"], s["numels"])) == sizes), None)
        if saved is not None:
            self.saved.remove(saved)
            b = self._from_saved(saved, index, buffer)
            self.live[frozenset(keys)] = b
            return b
        for k, old in [(k, b) for k, b in self.live.items() if mine.intersection(k)]:
            del self.live[k]
            self._retire(old)
        for entry in [s for s in self.saved if mine.intersection(s["keys"])]:
            self.saved.remove(entry)
            self._retire(self._from_saved(entry, -1, torch.zeros(
                sum(entry["numels"]), dtype=buffer.dtype, device=buffer.device)))
        b = self.live[frozenset(keys)] = self._new(index, buffer, keys, numels)
        return b

    def take_carry(self, keys: Keys, numels: Tuple[int, ...], buffer: torch.Tensor) -> None:
        """Add what retired exchanges held for these parameters to their part of ``buffer``
        (after Adam's preconditioning: it is an update, not a gradient, when updates travel).
        Held in true units, it joins a scaled buffer at the loss scale (exactly: a power of
        two), which the exchange then divides out again."""
        if not self.carry:
            return
        scale, offset = self.loss_scale.read(), 0
        for k, n in zip(keys, numels):
            held = self.carry.pop(k, None)
            if held is not None:
                buffer[offset:offset + n].add_(held.to(buffer.dtype).to(buffer.device),
                                               alpha=scale)
            offset += n

    def _from_saved(self, saved: dict, index: int, buffer: torch.Tensor) -> Bucket:
        """A saved exchange made again over ``buffer``, laid out by the names it was saved
        with, and given its state (validated completely first); ``index``: DDP's bucket
        index, where the save has none."""
        at = int(saved.get("index", index))
        names = saved.get("names")
        if names is None:   # saved before exchanges kept names (7 December): the positional ones
            names = [_name(at, i) for i in range(len(saved["keys"]))]
        b = self._new(at, buffer, tuple(saved["keys"]), tuple(saved["numels"]), names)
        b.exchange.load_state_dict(saved["exchange"])
        return b

    def _new(self, index: int, buffer: torch.Tensor, keys: Keys,
             numels: Tuple[int, ...], names: Optional[Sequence[str]] = None) -> Bucket:
        # The stand-ins' values are never read (magnitude_weight is refused): they share the
        # bucket's storage, so the exchange keeps no second copy of the gradients. They carry
        # the parameters' own names where register() gave them, so the layout (it orders by
        # name) is DistributedOptimizer's; else names that sort in the bucket's order. A saved
        # exchange brings its own, so it is laid out as it was.
        flat, stand_ins, offset = buffer.detach(), [], 0
        for n in numels:
            stand_ins.append(torch.nn.Parameter(flat[offset:offset + n], requires_grad=False))
            offset += n
        if names is None and self.names is not None:
            named = {k: self.names[pid] for pid, (_, k) in self._keys.items()
                     if pid in self.names}
            missing = [numels[i] for i, k in enumerate(keys) if k not in named]
            if missing:
                raise ValueError(f"hvd_slim.ddp: bucket {index} holds {len(missing)} parameters "
                                 f"that named_parameters does not name (of {missing[:5]} "
                                 f"elements); pass named_parameters=model.named_parameters() "
                                 f"of the model DDP wraps")
            names = [named[k] for k in keys]
        elif names is None:
            names = [_name(index, i) for i in range(len(keys))]
        names = tuple(str(n) for n in names)
        if len(names) != len(keys) or len(set(names)) != len(names):
            raise ValueError(f"hvd_slim.ddp: the names of bucket {index}'s parameters in the "
                             f"checkpoint are not one each: {list(names)[:5]}...")
        layout = Layout(list(zip(names, stand_ins)), self.config, lambda dt: dt,
                        loss_scale=self.loss_scale)
        key_of = dict(zip(names, keys))
        dense = frozenset(key_of[sg.name] for lb in layout.buckets if lb.kind != SPARSE
                          for sg in lb.segments)
        return Bucket(build_exchange(layout, self.config, self._transport_for(buffer.device)),
                      stand_ins, index, keys, numels, dense, key_of, names=names)

    def _retire(self, b: Bucket) -> None:
        """Split what ``b``'s exchange holds on this rank by parameter, to join their next
        gradients (:meth:`_begin`), and keep its figures."""
        for k, part in self._split(b).items():
            self.carry[k] = part if k not in self.carry else self.carry[k] + part
        stats = b.exchange.stats
        for f in ExchangeStats.FIELDS:
            self.retired[f] += getattr(stats, f)

    @staticmethod
    def _split(b: Bucket) -> Dict[int, torch.Tensor]:
        """What ``b``'s exchange holds on this rank (float64, in the units of a gradient), by
        parameter key; zeros for a parameter sent dense."""
        held = b.exchange.held_as_pushes()
        out = {}
        for lb in b.exchange.layout.buckets:
            flat = held.get(lb.index)
            for s in lb.segments:
                out[b.key_of[s.name]] = torch.zeros(s.numel, dtype=torch.float64,
                                                  device=b.stand_ins[0].device) \
                    if flat is None else flat[s.offset:s.offset + s.numel]
        return out

    def held_by_parameter(self) -> Dict[int, torch.Tensor]:
        """Everything this rank holds back (float64, flat, in the units of its gradients), by
        parameter position (the order of the first backward pass the state saw): with what
        every rank's hook delivered, it adds up to every gradient fed in."""
        out = {k: v.clone() for k, v in self.carry.items()}
        for b in self.live.values():
            for k, part in self._split(b).items():
                out[k] = out[k] + part if k in out else part
        return out

    # --- checkpoint -------------------------------------------------------------------------
    def state(self) -> Tuple[List[dict], Dict[int, torch.Tensor], Dict[str, int]]:
        """Every exchange's state (live and still saved), with its parameters' keys; what
        retired ones held; their figures."""
        live = [{"index": b.index, "keys": list(b.keys), "numels": list(b.numels),
                 "names": list(b.names), "exchange": b.exchange.state_dict()}
                for b in self.live.values()]
        return live + list(self.saved), dict(self.carry), dict(self.retired)

    def load(self, buckets: List[dict], carry: Dict[Any, torch.Tensor],
             retired: Dict[str, int]) -> None:
        """Start over from :meth:`state`'s parts (checked by the caller): the exchanges wait for
        their buckets, and keys are given afresh by the first backward pass."""
        self.live, self._keys, self.keys_final, self._next_key = {}, {}, False, 0
        self.saved = [dict(s) for s in buckets]
        self.carry = {int(k): v for k, v in carry.items()}
        self.retired = {f: retired.get(f, 0) for f in ExchangeStats.FIELDS}


def _name(index: int, position: int) -> str:
    """A stand-in's name: bucket ``index``'s parameter at ``position``, sorting in order."""
    return f"bucket{index}.{position:06d}"
