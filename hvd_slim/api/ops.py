"""How one tensor collective of the Horovod API runs: Horovod's reduce ops, the op check, host
staging, the scaling of a reduction and the autograd functions, over the
:class:`~hvd_slim.transport.mpi_api.MpiCollectives` (or, under torchrun,
:class:`~hvd_slim.transport.torch_api.TorchCollectives`) the runtime hands out
(:func:`~hvd_slim.runtime.basics.job_collectives`). The public calls are in api/collectives.py
(synchronous) and api/async_ops.py (handles).

Every call is queued through the engine (:mod:`hvd_slim.api.engine`), whose thread runs
the calls in order, and starts with a header round that allgathers a small signature (dtype,
shape, root or op) so that ranks passing mismatched tensors all raise the same clear error
instead of hanging or corrupting memory; it waits at most ``HVD_SLIM_TIMEOUT`` seconds for the
other ranks (:mod:`hvd_slim.api.timeout`). CUDA tensors are staged through host memory; float16 and
bfloat16 are reduced in float32, because MPI has no half-precision sum.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..runtime import basics
from ..transport.bounds import check_length
from . import adasum, engine, timeline
from .checks import label
from .engine_rounds import ALLGATHER, ALLREDUCE, BROADCAST, Sig
from .process_sets import Group, resolve

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
    so a bad ``HVD_SLIM_TIMEOUT`` is reported before hvd_slim starts. The block's collectives
    run on the calling thread in the engine's order, after a header round that checks every
    rank makes this call (:func:`~hvd_slim.api.engine.exclusive`)."""
    with engine.on_group(what, process_set) as group, timeline.span(what):
        yield group.api, group


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
    as in Horovod. The division comes last and is a division, not a multiplication by
    ``1/divisor``: an average of equal values (``(x + x) / 3``) then comes out exactly as the
    closed form, at any world size."""
    if factor == 1 and divisor == 1:
        return
    if buf.dtype.is_floating_point:
        if factor != 1:
            buf.mul_(factor)
        if divisor != 1:
            buf.div_(divisor)
    else:
        buf.copy_(buf.to(torch.float64).mul_(factor).div_(divisor))


def _allreduce(tensor: torch.Tensor, op: int, prescale: float, postscale: float, name: Optional[str],
               what: str, out: Optional[torch.Tensor] = None, process_set: Any = None,
               wait: bool = True) -> Any:
    """The reduction (``wait``) or a handle to it. Queued through the engine, which fuses
    allreduces of one dtype, op and scale waiting in its queue into one MPI message."""
    work = torch.float32 if tensor.dtype in _HALF else tensor.dtype
    sig = Sig(ALLREDUCE, what, tensor.dtype, tuple(tensor.shape), extra={"op": op},
              work=work if work in _REDUCIBLE else None, scale=(prescale, postscale))
    return engine.submit(f"{what}{label(name)}", name, process_set, _run_allreduce, sig, wait,
                         nbytes=tensor.numel() * tensor.element_size(), payload=(tensor, out))


def _run_allreduce(jobs: List[engine.Job], rnd: Any) -> None:
    """On the engine's thread: ``jobs`` (agreed by every rank) reduced in one message."""
    head = jobs[0]
    work, op, (pre, post) = head.sig.work, head.sig.extra["op"], head.sig.scale
    if work is None:
        raise TypeError(f"{head.label}: cannot reduce dtype {head.sig.dtype}; use a floating "
                        f"point or integer tensor")
    if op == Adasum:
        if work not in adasum.FLOATS:
            raise TypeError(f"{head.label}: Adasum combines floating point tensors only, got "
                            f"{head.sig.dtype}")
        adasum.check_size(head.label, head.group.size)
    with torch.no_grad():
        first_out = head.payload[1]
        if len(jobs) == 1 and _direct(first_out, work):
            flat = first_out.detach()   # MPI reduces the caller's own memory
            parts = [first_out]
        elif len(jobs) == 1:
            flat = _host_copy(head.payload[0], work)
            parts = [flat]
        else:
            bufs = [_host_copy(j.payload[0], work) for j in jobs]
            flat = torch.cat([b.reshape(-1) for b in bufs])
            offsets = np.cumsum([0] + [b.numel() for b in bufs])
            parts = [flat[offsets[i]:offsets[i + 1]].view(b.shape) for i, b in enumerate(bufs)]
        _scale_(flat, pre)
        size = head.group.size
        with timeline.span(head.label):
            if op == Adasum:   # per-tensor coefficients even when fused
                adasum.adasum_(head.group.api, head.group.rank, size, flat.reshape(-1),
                               [p.numel() for p in parts])
            else:
                head.group.api.allreduce_inplace(flat.numpy(), _MPI_OPS[op])
        _scale_(flat, post, size if op == Average else 1)
        for j, part in zip(jobs, parts):
            tensor, out = j.payload
            if out is None:
                j.result = part.to(device=tensor.device, dtype=tensor.dtype)
            else:
                if part is not out:
                    out.copy_(part)
                j.result = out


def _allgather(tensor: torch.Tensor, name: Optional[str], what: str, process_set: Any = None,
               wait: bool = True) -> Any:
    """The concatenation along dim 0 (0-d tensors count as one row) and every rank's row count
    (``wait``), or a handle to the concatenation."""
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    sig = Sig(ALLGATHER, what, t.dtype, tuple(t.shape), dim0_free=True)
    payload = {"tensor": t, "device": tensor.device}
    out = engine.submit(f"{what}{label(name)}", name, process_set, _run_allgather, sig, wait,
                        payload=payload)
    return (out, payload["rows"]) if wait else out


def _run_allgather(jobs: List[engine.Job], rnd: Any) -> None:
    job = jobs[0]
    t = job.payload["tensor"]
    rows = rnd.dim0s()
    host = t if _direct(t, t.dtype) else _host_copy(t)
    row_bytes = host.element_size() * int(np.prod(host.shape[1:], dtype=np.int64))
    for r, n in enumerate(rows):   # checked before the output is sized from them
        check_length(job.label, int(n) * row_bytes, r, job.group.api.rank)
    check_length(job.label, int(rows.sum()) * row_bytes, None, job.group.api.rank)
    out = torch.empty((int(rows.sum()), *t.shape[1:]), dtype=t.dtype)
    job.group.api.allgatherv_bytes(_bytes(host), rows * row_bytes, out=_bytes(out))
    job.payload["rows"] = rows
    job.result = out.to(job.payload["device"])


def _broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str], what: str,
               out: Optional[torch.Tensor] = None, process_set: Any = None,
               wait: bool = True) -> Any:
    """Root's ``tensor`` as a new tensor, or written into ``out`` (``wait``), or a handle to
    it. ``root_rank`` is a job rank, within ``process_set``; the call's header round checks
    that the ranks agree on it, the dtype and the shape."""
    # A bad root raises on every rank once they agree on it (the round compares it).
    key = int(root_rank) if isinstance(root_rank, (int, np.integer)) else -1
    sig = Sig(BROADCAST, what, tensor.dtype, tuple(tensor.shape), extra={"root_rank": key})
    return engine.submit(f"{what}{label(name)}", name, process_set, _run_broadcast, sig, wait,
                         payload=(tensor, out, root_rank))


def _run_broadcast(jobs: List[engine.Job], rnd: Any) -> None:
    job = jobs[0]
    tensor, out, root_rank = job.payload
    root = job.group.local_root(job.sig.call, root_rank)
    direct = _direct(out, tensor.dtype)
    with torch.no_grad():
        buf = out.detach() if direct else _host_copy(tensor)
        job.group.api.bcast_inplace(_bytes(buf), root)
        if out is None:
            job.result = buf.to(tensor.device)
            return
        if not direct:
            out.copy_(buf)
        job.result = out


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
