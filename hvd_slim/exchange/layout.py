"""How parameters map onto the exchange's flat buffers ("buckets").

Parameters are ordered by name (the same on every rank whatever the registration order), then
split by size: tensors under ``min_compress_numel`` are fused into a dense bucket per dtype; the
rest form one compressed bucket per dtype, a single flat vector of ``d`` coordinates on which the
slice is chosen (docs/design.md §2). A compressed bucket whose slice would not be smaller than
dense is sent dense ("dense fallback"), which also makes ``density=1.0`` exactly a dense average,
except at ``value_bits=1``: there every coordinate's sign goes, coded whole (:func:`coded_whole`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import SlimConfig
from ..wire.indices import index_bytes_bound
from ..wire.values import PACKED_BITS, packed_nbytes, slice_dtype
from .loss_scale import LossScale
from .warmup import Schedule

DENSE = "dense"
SPARSE = "sparse"


@dataclass(frozen=True)
class Segment:
    """One parameter's place in a bucket's flat buffer."""

    name: str
    param: torch.Tensor
    offset: int
    numel: int


@dataclass
class Bucket:
    """A flat buffer of same-dtype parameters, exchanged dense or as Slim-DP slices."""

    index: int
    kind: str                 # DENSE or SPARSE
    dtype: torch.dtype
    comm_dtype: torch.dtype   # dtype of all values sent but slices (fp16 with Compression.fp16)
    segments: List[Segment]
    numel: int
    device: torch.device = torch.device("cpu")  # where the bucket's residual and buffers live
    k: int = 0                # push slice size
    k_core: int = 0
    k_explore: int = 0
    k_pull: int = 0           # pull slice size (pull="slim")
    k_pull_core: int = 0
    k_pull_explore: int = 0
    slice_dtype: Optional[torch.dtype] = None  # sliced values (value_bits); None: comm_dtype
    slice_bits: int = 0       # 4 or 2: slices packed below a byte (wire/values.py, pack); else 0
    # The server's pull slice (pull_value_bits), when it differs from the push's; None: the same
    pull_slice: Optional[Tuple[torch.dtype, int]] = None
    # A shard's piece of a compressed bucket (shards.py): whether the bucket is sent whole at
    # this step, which all its pieces follow; None: decided by the sizes (sent_whole).
    whole: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.slice_dtype is None:
            self.slice_dtype = self.comm_dtype

    @property
    def value_bytes(self) -> int:
        """Bytes of one dense value (dense sections and the exact union pull)."""
        return self.comm_dtype.itemsize

    @property
    def slice_bytes(self) -> int:
        # A packed slice's wire items are its bytes (its table count is its byte count).
        """Bytes of one sliced value (pushes, and the server's ``pull="slim"`` slice)."""
        return self.slice_dtype.itemsize

    def as_pulled(self) -> "Bucket":
        """This bucket as the server's pull slice codes it (``pull_value_bits``): itself when
        the pull's values are the push's."""
        if self.pull_slice is None:
            return self
        dtype, bits = self.pull_slice
        return dataclasses.replace(self, slice_dtype=dtype, slice_bits=bits, pull_slice=None)

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of what is kept for this bucket across steps (residuals, the server's
        sums): float32 for 16-bit parameters, where a small gradient added to a large 16-bit
        residual would round away; the parameters' own dtype otherwise."""
        return torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype

    def params(self) -> List[torch.Tensor]:
        return [s.param for s in self.segments]


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def slice_sizes(d: int, density: float, exploration: float) -> Tuple[int, int, int]:
    """(k, k_core, k_explore) for a vector of ``d`` coordinates."""
    k = min(d, max(1, int(math.ceil(density * d))))
    k_e = int(round(exploration * k))
    return k, k - k_e, k_e


def slice_is_smaller(d: int, k: int, k_core: int, slice_bytes: int, value_bytes: int,
                     bits: int = 0) -> bool:
    """True when a slice of k < d values of ``slice_bytes`` plus the worst-case core index
    encoding beats sending all d values of ``value_bytes``. A slice of every coordinate is never
    smaller: all d go dense, exactly (``density=1.0`` is a dense average at any value_bits)."""
    values = packed_nbytes(k, bits) if bits else k * slice_bytes   # bits: packed (4 or 2)
    return k < d and values + index_bytes_bound(d, k_core) < d * value_bytes


def coded_whole(b: Bucket) -> bool:
    """A compressed bucket whose push holds every coordinate at 1 bit (``value_bits=1`` at
    ``density=1.0``): it travels coded, with no indices (``M_CODED``), 32x smaller than dense,
    and what the signs lose stays in the residual. (Not a dense warm-up step, which is sent
    whole and exact: :meth:`Layout.at_step`.)"""
    return b.kind == SPARSE and b.slice_bits == 1 and b.k >= b.numel and b.whole is not True


def coded_pull(b: Bucket) -> bool:
    """A bucket of :func:`coded_whole` pushes whose server pulls every coordinate
    (``pull_density=1.0``) at ``pull_value_bits`` below the comm dtype's: the whole sum coded
    (``M_CODED``, no indices, no selection), what the coding loses kept in the server's
    residual. At 32 bits the pull is the exact dense sum."""
    return coded_whole(b) and b.k_pull >= b.numel and b.as_pulled().slice_dtype != b.comm_dtype


def sent_whole(b: Bucket) -> bool:
    """A compressed bucket whose push slice (at a warm-up step's size) would not be smaller than
    all of it: that step sends it whole, the residual included (see the worker)."""
    if b.kind == SPARSE and b.whole is not None:
        return b.whole
    return b.kind == SPARSE and not coded_whole(b) and not slice_is_smaller(
        b.numel, b.k, b.k_core, b.slice_bytes, b.value_bytes, b.slice_bits)


class Layout:
    """Buckets for a fixed, name-ordered list of parameters."""

    def __init__(self, named_params: Sequence[Tuple[str, torch.Tensor]], config: SlimConfig,
                 comm_dtype_of: Callable[[torch.dtype], torch.dtype],
                 frozen: Sequence[Tuple[str, torch.Tensor]] = (),
                 kinds: Optional[Dict[str, str]] = None,
                 loss_scale: Optional[LossScale] = None) -> None:
        # kinds: DENSE or SPARSE by name, instead of by size (exchange/hosts/hierarchy.py's host
        # pieces keep the kind of the bucket they were cut from). Frozen parameters
        # (requires_grad=False) take no part in the exchange; they are kept only so that a mismatch
        # error can say "frozen on rank 1" rather than "missing". loss_scale: the scale of the
        # gradients it reads (exchange/loss_scale.py), shared with the layouts cut from it.
        self.loss_scale = LossScale() if loss_scale is None else loss_scale
        self.frozen = sorted(((n, tuple(p.shape), p.dtype) for n, p in frozen),
                             key=lambda item: item[0])
        ordered = sorted(named_params, key=lambda item: item[0])
        groups: dict = {}
        for name, p in ordered:
            kind = SPARSE if p.numel() >= config.min_compress_numel and p.is_floating_point() \
                else DENSE
            kind = (kinds or {}).get(name, kind)
            groups.setdefault((kind, p.dtype, p.device), []).append((name, p))
        # Widest comm dtype first keeps every value section aligned for its own dtype.
        keys = sorted(groups, key=lambda kd: (-torch.empty((), dtype=comm_dtype_of(kd[1]))
                                               .element_size(), kd[0] != DENSE, str(kd[1]),
                                               str(kd[2])))
        self.buckets: List[Bucket] = []
        for kind, dtype, device in keys:
            segs, off = [], 0
            for name, p in groups[(kind, dtype, device)]:
                segs.append(Segment(name, p, off, p.numel()))
                off += p.numel()
            comm = comm_dtype_of(dtype)
            packed = kind == SPARSE and config.value_bits in PACKED_BITS and \
                comm.is_floating_point
            b = Bucket(len(self.buckets), kind, dtype, comm, segs, off, device=device,
                       slice_dtype=slice_dtype(config.value_bits, comm) if kind == SPARSE
                       else comm, slice_bits=config.value_bits if packed else 0)
            pbits = config.effective_pull_value_bits
            if kind == SPARSE and pbits != config.value_bits:
                b.pull_slice = (slice_dtype(pbits, comm),
                                pbits if pbits in PACKED_BITS and comm.is_floating_point else 0)
            if kind == SPARSE:
                b.k, b.k_core, b.k_explore = slice_sizes(off, config.density, config.exploration)
                b.k_pull, b.k_pull_core, b.k_pull_explore = slice_sizes(
                    off, config.effective_pull_density, config.exploration)
                if not coded_whole(b) and not slice_is_smaller(
                        off, b.k, b.k_core, b.slice_bytes, b.value_bytes, b.slice_bits):
                    b.kind = DENSE  # dense fallback: no residual, exactly a dense average
                    b.slice_dtype, b.slice_bits, b.pull_slice = comm, 0, None
            self.buckets.append(b)
        self.names = [n for n, _ in ordered]
        self._config = config
        self.schedule = Schedule(config)
        # The sizes of the last step asked for, keyed by the step and where the warm-up's decay
        # starts (which a loaded checkpoint may move).
        self._at: Tuple[Tuple[int, int], List[Bucket]] = ((-1, -1), self.buckets)

    def at_step(self, step: int) -> List[Bucket]:
        """The buckets with the slice sizes of exchange step ``step``: ``buckets`` itself, except
        during a warm-up (:meth:`Schedule.densities_at`), where compressed buckets get that
        step's sizes and may be sent whole (:func:`sent_whole`) while keeping their memory."""
        dens = self.schedule.densities_at(step)
        if dens is None:
            return self.buckets
        key = (step, self.schedule.decay_start)
        if self._at[0] != key:
            expl = self._config.exploration
            out = []
            for b in self.buckets:
                if b.kind == SPARSE:
                    k, kc, ke = slice_sizes(b.numel, dens[0], expl)
                    kp, kpc, kpe = slice_sizes(b.numel, dens[1], expl)
                    # A dense warm-up step (warmup_dense_steps) is the exact dense average at
                    # any value_bits, signs (coded_whole) included.
                    b = dataclasses.replace(b, k=k, k_core=kc, k_explore=ke, k_pull=kp,
                                            k_pull_core=kpc, k_pull_explore=kpe,
                                            whole=True if dens[0] >= 1.0 else b.whole)
                out.append(b)
            self._at = (key, out)
        return self._at[1]

    @property
    def sparse(self) -> List[Bucket]:
        return [b for b in self.buckets if b.kind == SPARSE]

    def digest(self) -> int:
        """64-bit hash of names, shapes, dtypes and bucket plan; equal on agreeing ranks."""
        h = hashlib.sha256()
        for b in self.buckets:
            # The device type is deliberately left out: a CPU and a CUDA replica may interoperate.
            pulled = "" if b.pull_slice is None else f"|pull {b.pull_slice[0]}/{b.pull_slice[1]}"
            h.update(f"{b.kind}|{b.dtype}|{b.comm_dtype}|{b.slice_dtype}/{b.slice_bits}|{b.numel}|{b.k}|"
                     f"{b.k_pull}{pulled}\n".encode())
            for s in b.segments:
                h.update(f"{s.name}|{tuple(s.param.shape)}\n".encode())
        return int.from_bytes(h.digest()[:8], "little")

    def description(self) -> List[list]:
        """JSON-ready ``[name, shape, dtype, comm dtype, "trainable" | "frozen"]`` per parameter,
        by name: what ranks (and checkpoints) compare to name the first parameter that differs."""
        rows = [[s.name, list(s.param.shape), _dt(b.dtype), _dt(b.comm_dtype), "trainable"]
                for b in self.buckets for s in b.segments]
        rows += [[n, list(shape), _dt(dtype), "", "frozen"] for n, shape, dtype in self.frozen]
        return sorted(rows, key=lambda row: row[0])

    def delivered_norm(self) -> float:
        """The norm of the compressed buckets' ``p.grad`` (after a pull: what it delivered), in
        float64; the same on every rank that holds the same gradients."""
        total = 0.0
        for b in self.buckets:
            if b.kind != SPARSE:
                continue
            for s in b.segments:
                g = s.param.grad
                if g is not None:
                    g = g.coalesce().values() if g.is_sparse else g
                    total += float(g.double().square().sum())
        return math.sqrt(total)

    # --- flat views ------------------------------------------------------------------------
    @staticmethod
    def read_grads(bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        """Copy each parameter's gradient into ``out`` (zeros where a parameter got none), in
        one ``_foreach_copy_``: a launch per step, not per tensor, on a GPU."""
        dsts, srcs = [], []
        for s in bucket.segments:
            dst = out[s.offset:s.offset + s.numel]
            g = s.param.grad
            if g is None:
                dst.zero_()
            else:
                dsts.append(dst)
                srcs.append((g.to_dense() if g.is_sparse else g).reshape(-1))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return out

    @staticmethod
    def grad_parts(bucket: Bucket) -> List[Tuple[int, int, Optional[torch.Tensor]]]:
        """``(offset, numel, grad or None)`` per parameter: the gradients where they lie, for
        folding into a flat buffer without copying them there first."""
        parts = []
        for s in bucket.segments:
            g = s.param.grad
            if g is not None and g.is_sparse:
                g = g.to_dense()
            parts.append((s.offset, s.numel, g))
        return parts

    @staticmethod
    def read_params(bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        for s in bucket.segments:
            out[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        return out

    @staticmethod
    def point_grads(bucket: Bucket, flat: torch.Tensor) -> None:
        """Make each parameter's ``.grad`` a view of ``flat`` (kept while it already is one).
        ``flat`` must outlive the step: the inner optimizer and the next backward use it."""
        for s in bucket.segments:
            p = s.param
            view = flat[s.offset:s.offset + s.numel].view(p.shape)
            g = p.grad
            if g is not None and g.is_sparse:
                p.grad = view.to_sparse()   # hand back sparse, as write_grads does
            elif g is None or g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                p.grad = view

    @staticmethod
    def write_grads(bucket: Bucket, flat: torch.Tensor,
                    only: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        """Write ``flat`` into each parameter's ``.grad`` (in place when it exists: one
        ``_foreach_copy_`` for all of those)."""
        dsts, srcs = [], []
        for s in bucket.segments:
            p = s.param
            if only is not None and not only(p):
                continue
            src = flat[s.offset:s.offset + s.numel].view(p.shape)
            if p.grad is not None and p.grad.is_sparse:
                p.grad = src.to(device=p.device, dtype=p.dtype).to_sparse()  # hand back sparse
            elif p.grad is None or p.grad.shape != p.shape:
                p.grad = src.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                dsts.append(p.grad)
                srcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
