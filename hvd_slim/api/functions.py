"""Horovod's higher-level helpers: ``broadcast_object``, ``allgather_object``,
``broadcast_parameters``, ``broadcast_optimizer_state`` and ``barrier`` (``join``: join.py).

Every function is collective: all ranks must call it, in the same order. Each runs on the job
communicator's :class:`~hvd_slim.transport.mpi_api.MpiCollectives`, handed out by the runtime
(:func:`~hvd_slim.runtime.basics.job_collectives`). A local failure (an unpicklable object,
mismatched parameter lists) is turned into the same exception on every rank instead of leaving
the others waiting in MPI, and no call waits longer than ``HVD_SLIM_TIMEOUT`` for a rank that
never comes (:mod:`hvd_slim.api.timeout`).
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ..runtime import basics
from . import engine
from .checks import check_root_rank
from .engine_rounds import BARRIER, Sig
from .ops import _broadcast, on_group
from .pending import drain_all
from .timeout import operation

if TYPE_CHECKING:   # pragma: no cover
    from ..transport.mpi_api import MpiCollectives

try:  # Horovod uses cloudpickle (lambdas, local classes); plain pickle covers ordinary objects
    import cloudpickle as _pickle
except ImportError:  # pragma: no cover - depends on the environment
    import pickle as _pickle  # type: ignore[no-redef]


class _PickleFailure:
    """Sent in place of an object that could not be pickled, so every rank can raise."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank, self.message = rank, message


def _dumps(obj: Any) -> Tuple[np.ndarray, bool]:
    """``obj`` pickled, or a pickled :class:`_PickleFailure` (and True) when it cannot be."""
    try:
        return np.frombuffer(bytearray(_pickle.dumps(obj)), dtype=np.uint8), False
    except Exception as exc:  # noqa: BLE001 - sent to the peers, who raise it in _loads
        failure = _PickleFailure(basics.rank(), f"{type(exc).__name__}: {exc}")
        return np.frombuffer(bytearray(_pickle.dumps(failure)), dtype=np.uint8), True


def _loads(buf: np.ndarray, what: str) -> Any:
    obj = _pickle.loads(buf.tobytes())
    if isinstance(obj, _PickleFailure):
        raise ValueError(f"{what}: rank {obj.rank} could not pickle its object ({obj.message}); pass "
                         f"a picklable object")
    return obj


def _check_same(api: "MpiCollectives", what: str, values: List[int], meaning: str) -> None:
    """Collective: raise on every rank unless every rank passed the same ``values``."""
    rows = api.allgather_int64(values)
    bad = np.nonzero((rows != rows[0]).any(axis=1))[0]
    if bad.size:
        raise ValueError(f"{what}: rank {int(bad[0])} passed {meaning} {rows[bad[0]].tolist()} but rank 0 "
                         f"passed {rows[0].tolist()}; every rank must pass the same {meaning}")


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """Send ``root_rank``'s ``obj`` to every rank, pickled (with cloudpickle when installed).

    Collective: every rank calls it with the same ``root_rank``. Unpickling runs code chosen by
    the sender: use it between trusted ranks only, as Horovod's. The optimizer's data path never
    unpickles.

    Args:
        obj: The object to send; only the root's is used (other ranks may pass None).
        root_rank: The sending rank (default 0), an int in ``[0, size())``.
        name: Optional label for error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only its
            ranks call this, and ``root_rank`` (a job rank) must be one of them.

    Returns:
        The root's object: on the root the very object it passed, elsewhere an unpickled copy.

    Raises:
        ValueError: ``root_rank`` invalid or not the same on every rank, ``process_set`` not a
            registered set of this rank, or the root's object cannot be pickled (then every
            rank raises, the root too).
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    what = "broadcast_object" + (f" ({name!r})" if name else "")
    with on_group(what, process_set) as (api, group):
        root = group.local_root(what, root_rank)
        _check_same(api, what, [root], "root_rank")
        is_root = group.rank == root
        payload, failed = _dumps(obj) if is_root else (None, False)
        data = api.bcast_bytes(payload, root)
    if is_root and not failed:
        return obj
    return _loads(data, what)  # raises on every rank (the root too) after a pickling failure


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None) -> List[Any]:
    """Collect every rank's ``obj`` on every rank, pickled (with cloudpickle when installed).

    Collective: every rank calls it. Unpickling runs code chosen by the sender: use it between
    trusted ranks only, as Horovod's.

    Args:
        obj: This rank's object.
        name: Optional label for error messages.
        process_set: The :class:`ProcessSet` to run on (default None: every rank); only its
            ranks call this.

    Returns:
        A list of one object per rank of the set, in rank order; every entry, this rank's own included, is
        an unpickled copy.

    Raises:
        ValueError: some rank's object cannot be pickled (every rank raises, naming it).
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    what = "allgather_object" + (f" ({name!r})" if name else "")
    with on_group(what, process_set) as (api, _):
        parts = api.allgather_bytes(_dumps(obj)[0])
    return [_loads(p, what) for p in parts]


def _named_tensors(params: Any, what: str) -> List[Tuple[Any, torch.Tensor]]:
    if isinstance(params, torch.Tensor) or isinstance(params, (str, bytes)):
        raise ValueError(f"{what}: invalid params of type {type(params).__name__}; pass a dict such as "
                         f"model.state_dict() or a list of parameters or (name, parameter) tuples")
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"{what}: invalid params of type {type(params).__name__}; pass a dict or a list")
    for i, item in enumerate(items):
        if len(item) != 2 or not isinstance(item[1], torch.Tensor):
            raise ValueError(f"{what}: entry {i} is a {type(item[-1]).__name__}, not a tensor or a "
                             f"(name, tensor) pair")
    return items


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every tensor in ``params`` in place with ``root_rank``'s values.

    Collective: every rank passes the same ``root_rank`` and the same number of tensors with
    the same dtypes and shapes. One check covers the whole list first, so a mismatch raises the
    same ValueError (naming the first difference) on every rank before anything is sent.

    Args:
        params: A dict such as ``model.state_dict()`` (taken in sorted key order), or an
            iterable of tensors or of ``(name, tensor)`` tuples such as
            ``model.named_parameters()``. A single tensor or a string is refused.
        root_rank: The sending rank, an int in ``[0, size())``; no default.

    Returns:
        None; the tensors in ``params`` hold the root's values.

    Raises:
        ValueError: ``params`` has the wrong type or an entry that is not a tensor or a
            ``(name, tensor)`` pair, ``root_rank`` is invalid, or the ranks' lists differ.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    what = "broadcast_parameters"
    drain_all()   # overlap_forward: updates still in flight land before the values are sent
    items = _named_tensors(params, what)
    root = check_root_rank(what, root_rank, basics.size())
    layout = [(str(t.dtype), tuple(t.shape)) for _, t in items]
    with on_group(what, None) as (api, _):
        # One collective checks the whole list, so a mismatch raises everywhere before any
        # transfer.
        rows = api.allgather_int64([root, len(items), zlib.crc32(repr(layout).encode())])
        if (rows != rows[0]).any():
            _explain_mismatch(what, items, layout, rows)
        for key, tensor in items:
            _broadcast(tensor, root, None if key is None else str(key), what, out=tensor)


def _explain_mismatch(what: str, items: List[Tuple[Any, torch.Tensor]], layout: List[Any],
                      rows: np.ndarray) -> None:
    """Collective (all ranks got here together): raise a ValueError naming the first difference."""
    if (rows[:, 0] != rows[0, 0]).any():
        raise ValueError(f"{what}: ranks passed different root_rank values {rows[:, 0].tolist()}")
    mine = [(str(k), d, s) for (k, _), (d, s) in zip(items, layout)]
    everyone = allgather_object(mine, name=what)
    for r, theirs in enumerate(everyone):
        if len(theirs) != len(everyone[0]):
            raise ValueError(f"{what}: rank {r} passed {len(theirs)} tensors but rank 0 passed "
                             f"{len(everyone[0])}; every rank must pass the same parameters")
        for i, (a, b) in enumerate(zip(everyone[0], theirs)):
            if a[1:] != b[1:]:
                raise ValueError(f"{what}: tensor {i} ({b[0]}) is {b[1]} {list(b[2])} on rank {r} but "
                                 f"{a[1]} {list(a[2])} on rank 0; every rank must pass the same shapes "
                                 f"and dtypes")
    raise ValueError(f"{what}: ranks passed different parameter lists")


def _is_wrapped(optimizer: torch.optim.Optimizer) -> bool:
    """An hvd_slim or Horovod DistributedOptimizer, whose own step() would start an exchange."""
    return bool(getattr(optimizer, "_hvd_slim_wrapped", False)) or \
        type(optimizer).__module__.startswith("horovod.")


def _initialise_state(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> None:
    """Create the optimizer's state with one step on zero gradients, leaving the parameters as
    they were (Horovod lets weight decay move them here). A parameter that requires a gradient
    and had none keeps a zero one, as in Horovod; an existing gradient is restored (Horovod
    zeroes it: here nothing computed is dropped)."""
    sparse = set()
    if model is not None:
        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    try:
        for p in params:
            if p.requires_grad:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if id(p) in sparse else zero
        if _is_wrapped(optimizer):
            # The wrapper subclasses the user's optimizer: its parent's step() runs no exchange.
            super(optimizer.__class__, optimizer).step()
        else:
            optimizer.step()
    finally:
        with torch.no_grad():
            for p, data, grad in saved:
                p.copy_(data)
                if grad is None and p.requires_grad:
                    # A fresh zero: the step may have kept a reference to the one it read.
                    zero = torch.zeros_like(p)
                    p.grad = zero.to_sparse() if id(p) in sparse else zero
                else:
                    p.grad = grad


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None) -> None:
    """Make every rank's optimizer state and param-group options equal to ``root_rank``'s.

    Collective. An empty state is first created by one step on zero gradients (for an hvd_slim
    or Horovod ``DistributedOptimizer`` the wrapped class's step, so no exchange), which leaves
    the parameters as they were; afterwards, as in Horovod, a parameter that requires a
    gradient and had none has a zero one (sparse for ``model``'s sparse embeddings), while an
    existing gradient is kept. State tensors are broadcast in place; scalar state and the
    options of every param group (all but ``"params"``, e.g. ``lr``) go through
    :func:`broadcast_object`, even for a stateless optimizer, unlike Horovod.

    Args:
        optimizer: A ``torch.optim.Optimizer`` (not ``torch.optim.LBFGS``), wrapped or not.
        root_rank: The sending rank, an int in ``[0, size())``; no default.
        model: Optional module whose sparse ``nn.Embedding``/``nn.EmbeddingBag`` weights get
            sparse zero gradients in that first step.

    Returns:
        None; the optimizer's state and options hold the root's values; on a rank whose state
        was empty, every parameter that requires a gradient has one (zero where it had none).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: an LBFGS optimizer, an invalid ``root_rank``, state tensors that differ
            between ranks, or (on non-root ranks) a different number of param groups.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    what = "broadcast_optimizer_state"
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"{what}: cannot broadcast torch.optim.LBFGS state")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = check_root_rank(what, root_rank, basics.size())
    # Its collectives are in the nested broadcasts, each an operation with its own label; the
    # block only names the outer call, so it fetches no collectives (nor starts hvd_slim).
    with operation(what, None):
        _broadcast_state(optimizer, root, model)


def _broadcast_state(optimizer: torch.optim.Optimizer, root: int,
                     model: Optional[torch.nn.Module]) -> None:
    """The collective part of :func:`broadcast_optimizer_state`."""
    what = "broadcast_optimizer_state"
    if len(optimizer.state) == 0:
        _initialise_state(optimizer, model)
    tensors: List[Tuple[str, torch.Tensor]] = []
    scalars: Dict[Tuple[int, int, Any], Any] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            state = optimizer.state.get(p) or {}
            for key in sorted(state, key=str):  # sorted: the order must not depend on history
                value = state[key]
                if torch.is_tensor(value):
                    tensors.append((f"group {g} param {i} state {key!r}", value))
                else:
                    scalars[(g, i, key)] = value
    options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    # Unlike Horovod, options are broadcast even for a stateless optimizer (plain SGD's lr too).
    broadcast_parameters(tensors, root)
    scalars, options = broadcast_object((scalars, options), root, name=what)
    if basics.rank() == root:
        return
    if len(options) != len(optimizer.param_groups):
        raise ValueError(f"{what}: rank {root} has {len(options)} param groups but rank "
                         f"{basics.rank()} has {len(optimizer.param_groups)}")
    for (g, i, key), value in scalars.items():
        optimizer.state[optimizer.param_groups[g]["params"][i]][key] = value
    for group, opts in zip(optimizer.param_groups, options):
        group.update(opts)


def barrier(process_set: Any = None) -> None:
    """Block until every rank has called ``barrier``.

    Args:
        process_set: The :class:`ProcessSet` whose ranks wait for each other (default None:
            every rank); only its ranks call this.

    Returns:
        None.

    Raises:
        ValueError: ``process_set`` is not a registered set of this rank.
        TransportTimeout: a rank did not arrive within ``HVD_SLIM_TIMEOUT`` seconds.
    """
    # The header round every call starts with is itself a barrier: nothing more to send.
    engine.submit("barrier", None, process_set, lambda jobs, rnd: None, Sig(BARRIER, "barrier"),
                  wait=True)
