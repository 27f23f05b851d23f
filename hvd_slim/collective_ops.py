"""How one tensor collective of the Horovod API runs: Horovod's reduce ops, the op check, host
staging, the scaling of a reduction and the autograd functions, over the
:class:`~hvd_slim.transport.mpi_api.MpiCollectives` the runtime hands out
(:func:`~hvd_slim.runtime.basics.job_collectives`). The public calls are in collectives.py
(synchronous) and collectives_async.py (handles).

Every call first allgathers a small signature (dtype, shape, root or op) so that ranks passing
mismatched tensors all raise the same clear error instead of hanging or corrupting memory, and
waits at most ``HVD_SLIM_TIMEOUT`` seconds for the other ranks
(:mod:`hvd_slim.runtime.api_timeout`). CUDA tensors are staged through host memory; float16 and
bfloat16 are reduced in float32, because MPI has no half-precision sum.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Tuple

import numpy as np
import torch

from . import adasum, timeline
from .runtime import basics
from .runtime.api_timeout import operation
from .runtime.checks import agree, label
from .runtime.process_sets import Group, resolve

# Horovod's reduce-op values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_MPI_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_HALF = (torch.float16, torch.bfloat16)
_REDUCIBLE = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64)


# ---- validation ---------------------------------------------------------------------------

def _resolve_op(what: str, op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's handling of the deprecated ``average`` flag, then a check of ``op``."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average; pass only one of them")
    if op is None:
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                          DeprecationWarning, stacklevel=3)
        op = Sum if average is False else Average
    if op not in _MPI_OPS and op != Adasum:
        raise ValueError(f"{what}: op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, "
                         f"hvd.Max, hvd.Product")
    return op


# ---- implementations ----------------------------------------------------------------------

@contextmanager
def on_group(what: str, process_set: Any) -> Iterator[Tuple[Any, Group]]:
    """:func:`operation` for one call named ``what``, on ``process_set``'s group (None: every
    rank); yields its collectives and the group. The set is resolved inside the operation,
    so a bad ``HVD_SLIM_TIMEOUT`` is reported before hvd_slim starts."""
    found = []

    def fetch() -> Any:
        found.append(resolve(what.split(" of ")[0], process_set))
        return found[0].api
    with operation(what, fetch) as api, timeline.span(what):
        yield api, found[0]


def _host_copy(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A fresh contiguous CPU copy (the staging buffer that MPI writes into)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype).copy_(t.detach())


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view aliasing a contiguous CPU tensor's memory (any dtype, 0-d included)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _direct(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether MPI can work on ``t``'s own memory instead of a staged copy."""
    return t is not None and t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype


def _scale_(buf: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """``buf *= factor / divisor`` in place; integers go through float64 and truncate toward zero,
    as in Horovod, dividing last so an exact average stays exact."""
    if factor == 1 and divisor == 1:
        return
    if buf.dtype.is_floating_point:
        buf.mul_(factor / divisor)
    else:
        buf.copy_(buf.to(torch.float64).mul_(factor).div_(divisor))


def _allreduce(tensor: torch.Tensor, op: int, prescale: float, postscale: float, name: Optional[str],
               what: str, out: Optional[torch.Tensor] = None, process_set: Any = None) -> torch.Tensor:
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        size = group.size
        agree(api, what, name, tensor, {"op": op})
        work = torch.float32 if tensor.dtype in _HALF else tensor.dtype
        if work not in _REDUCIBLE:
            raise TypeError(f"{what}{label(name)}: cannot reduce dtype {tensor.dtype}; use a "
                            f"floating point or integer tensor")
        if op == Adasum:
            if work not in adasum.FLOATS:
                raise TypeError(f"{what}{label(name)}: Adasum combines floating point tensors only, "
                                f"got {tensor.dtype}")
            adasum.check_size(what, size)
        direct = _direct(out, work)
        with torch.no_grad():
            buf = out.detach() if direct else _host_copy(tensor, work)
            _scale_(buf, prescale)
            if op == Adasum:
                adasum.adasum_(api, group.rank, size, buf.reshape(-1), [buf.numel()])
            else:
                api.allreduce_inplace(buf.numpy(), _MPI_OPS[op])
            _scale_(buf, postscale, size if op == Average else 1)
            if out is None:
                return buf.to(device=tensor.device, dtype=tensor.dtype)
            if not direct:
                out.copy_(buf)
    return out


def _allgather(tensor: torch.Tensor, name: Optional[str], what: str, process_set: Any = None
               ) -> Tuple[torch.Tensor, np.ndarray]:
    """The concatenation along dim 0 (0-d tensors count as one row) and every rank's row count."""
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    with on_group(f"{what}{label(name)}", process_set) as (api, _):
        rows = agree(api, what, name, t, {}, dim0_free=True)
        host = t if _direct(t, t.dtype) else _host_copy(t)
        row_bytes = host.element_size() * int(np.prod(host.shape[1:], dtype=np.int64))
        out = torch.empty((int(rows.sum()), *t.shape[1:]), dtype=t.dtype)
        api.allgatherv_bytes(_bytes(host), rows * row_bytes, out=_bytes(out))
    return out.to(tensor.device), rows


def _broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str], what: str,
               out: Optional[torch.Tensor] = None, checked: bool = True,
               process_set: Any = None) -> torch.Tensor:
    """Root's ``tensor`` as a new tensor, or written into ``out``. ``root_rank`` is a job rank,
    within ``process_set``. ``checked=False`` skips the cross-rank check, for callers that
    already made one for a whole batch of tensors."""
    with on_group(f"{what}{label(name)}", process_set) as (api, group):
        root = group.local_root(what, root_rank)
        if checked:
            agree(api, what, name, tensor, {"root_rank": root_rank})
        direct = _direct(out, tensor.dtype)
        with torch.no_grad():
            buf = out.detach() if direct else _host_copy(tensor)
            api.bcast_inplace(_bytes(buf), root)
            if out is None:
                return buf.to(tensor.device)
            if not direct:
                out.copy_(buf)
    return out


# Out-of-place collectives are differentiable, with Horovod's gradients.
class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, pre: float, post: float, name: Optional[str],
                process_set: Any = None) -> torch.Tensor:
        ctx.args = (op, pre, post, name, process_set)
        return _allreduce(tensor, op, pre, post, name, "allreduce", process_set=process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, pre, post, name, ps = ctx.args
        return (_allreduce(grad, op, pre, post, name, "allreduce (backward)", process_set=ps),
                None, None, None, None, None)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], process_set: Any = None) -> torch.Tensor:
        out, rows = _allgather(tensor, name, "allgather", process_set)
        ctx.name, ctx.shape, ctx.rows, ctx.ps = name, tensor.shape, rows, process_set
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = _allreduce(grad, Average, 1.0, 1.0, ctx.name, "allgather (backward)",
                             process_set=ctx.ps)
        r = resolve("allgather (backward)", ctx.ps).rank
        start = int(ctx.rows[:r].sum())
        return reduced.narrow(0, start, int(ctx.rows[r])).reshape(ctx.shape), None, None


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: Optional[str],
                process_set: Any = None) -> torch.Tensor:
        ctx.root, ctx.name, ctx.ps = root, name, process_set
        return _broadcast(tensor, root, name, "broadcast", process_set=process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        reduced = _allreduce(grad, Average, 1.0, 1.0, ctx.name, "broadcast (backward)",
                             process_set=ctx.ps)
        mine = reduced if basics.rank() == ctx.root else torch.zeros_like(reduced)
        return mine, None, None, None


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()
