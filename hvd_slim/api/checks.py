"""Argument checks shared by the public API, and :func:`agree`, the collective check that all
ranks passed matching tensors, so a mismatch raises one clear error everywhere instead of hanging
MPI or corrupting memory."""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import numpy as np
import torch

from ..transport.base import HorovodInternalError
from ..transport.bounds import check_length

if TYPE_CHECKING:   # pragma: no cover
    from ..transport.mpi_api import MpiCollectives


# Horovod's synchronize() raises HorovodInternalError for a collective the ranks disagree on.
class MismatchError(HorovodInternalError, ValueError):
    """Ranks passed a collective mismatched arguments (dtype, shape, root, op, process set).

    Raised on every rank alike. A RuntimeError (a :class:`HorovodInternalError`), as Horovod
    raises for such a mismatch, and a ValueError, as hvd_slim raised before, so either
    ``except`` catches it."""


def check_tensor_args(what: str, tensor: Any, name: Any) -> None:
    """Local checks of a collective's common arguments; ``what`` names the call in errors."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}{label(name)}: sparse tensors are not supported; pass "
                        f"tensor.to_dense() (or sparse_as_dense=True to the optimizer)")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str or None, got {type(name).__name__}")


def label(name: Optional[str]) -> str:
    """`` of 'name'`` for error messages, or nothing for an unnamed tensor."""
    return f" of {name!r}" if name else ""


def check_root_rank(what: str, root_rank: Any, size: int) -> int:
    """``root_rank`` as an int, or a ValueError when it is not a rank of a ``size``-rank job."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) \
            or not 0 <= root_rank < size:
        raise ValueError(f"{what}: root_rank={root_rank!r} is not a rank of this job; pass an int in "
                         f"[0, {size})")
    return int(root_rank)


_DESC_MAX = 1 << 20   # a mismatch description's bytes; more means the ranks are out of step


def _crc(obj: Any) -> int:
    return zlib.crc32(repr(obj).encode())


def agree(api: "MpiCollectives", what: str, name: Optional[str], tensor: torch.Tensor,
          extra: Dict[str, int], dim0_free: bool = False) -> np.ndarray:
    """Collective check over ``api`` that every rank passed the same dtype, shape (except dim 0
    when ``dim0_free``) and ``extra`` values; raises the same :class:`MismatchError` on every
    rank otherwise.
    Returns every rank's first dimension (0 when the tensor is 0-d)."""
    shape = tuple(tensor.shape)
    compared = shape[1:] if dim0_free else shape
    key = [_crc(tensor.dtype), len(shape), _crc(compared), *extra.values()]
    rows = api.allgather_int64(key + [shape[0] if shape else 0])
    row_bytes = tensor.element_size() * int(np.prod(shape[1:], dtype=np.int64))
    for r, n in enumerate(rows[:, -1]):   # before a caller sizes anything from them
        check_length(what + label(name), int(n) * max(row_bytes, 1), r, api.rank)
    if (rows[:, :-1] != rows[0, :-1]).any():
        mine = f"{str(tensor.dtype).replace('torch.', '')} shape {list(shape)}" + "".join(
            f" {k}={v}" for k, v in extra.items())
        descs = api.allgather_bytes(np.frombuffer(mine.encode(), dtype=np.uint8), _DESC_MAX)
        listing = "; ".join(f"rank {r}: {d.tobytes().decode()}" for r, d in enumerate(descs))
        rule = "the same dtype and trailing dimensions" if dim0_free else "the same dtype and shape"
        raise MismatchError(f"{what}{label(name)}: ranks passed mismatched arguments ({listing}); every "
                         f"rank must pass {rule}" + (" and the same " + ", ".join(extra) if extra else ""))
    return rows[:, -1]




def _describe(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}" for t in tensors)


def agree_many(api: "MpiCollectives", what: str, name: Optional[str],
               tensors: Sequence[torch.Tensor], extra: Dict[str, int],
               dim0_free: bool = False) -> np.ndarray:
    """:func:`agree` for a list of tensors in one collective: every rank passes as many tensors,
    with the same dtypes and shapes (except dim 0 when ``dim0_free``) position by position, and
    the same ``extra`` values; else the same :class:`MismatchError` on every rank.
    Returns a (ranks, tensors) int64 array of every rank's first dimensions (0 for 0-d)."""
    sig = [(str(t.dtype), tuple(t.shape)[1:] if dim0_free else tuple(t.shape), t.dim())
           for t in tensors]
    key = [len(tensors), _crc(sig), *extra.values()]
    rows = api.allgather_int64(key)   # fixed size on every rank, so it can be compared safely
    if (rows != rows[0]).any():
        mine = f"[{_describe(tensors)}]" + "".join(f" {k}={v}" for k, v in extra.items())
        descs = api.allgather_bytes(np.frombuffer(mine.encode(), dtype=np.uint8), _DESC_MAX)
        listing = "; ".join(f"rank {r}: {d.tobytes().decode()}" for r, d in enumerate(descs))
        rule = "the same dtypes and trailing dimensions" if dim0_free else "the same dtypes and shapes"
        raise MismatchError(f"{what}{label(name)}: ranks passed mismatched tensor lists ({listing}); "
                            f"every rank must pass as many tensors, with {rule} position by "
                            f"position" + (" and the same " + ", ".join(extra) if extra else ""))
    if not dim0_free:
        return np.tile(np.array([t.shape[0] if t.dim() else 0 for t in tensors], np.int64),
                       (rows.shape[0], 1))
    return api.allgather_int64([t.shape[0] if t.dim() else 0 for t in tensors])
