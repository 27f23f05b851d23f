"""The payload layout of one exchange message, and its strict decoder.

A message is one contiguous byte buffer::

    header (32 B) | table: 16 B per bucket | values of bucket 0, 1, ... | indices of bucket 0, 1, ...

Header: magic ``HVSL``, version, kind, bucket count, sender rank, step, layout digest, reserved.
Table entry per bucket: mode, index encoding, count of values, count of indices, index bytes.
Values come first, in bucket order (widest dtype first), so each value section stays aligned for
its dtype; explored indices never travel (the receiver regenerates them from the seed).

Decoding checks every field against what the receiver expects (kind, sender, step, digest, and
per bucket the allowed modes and exact counts) and the exact total length, and raises
:class:`WireError` naming what differs. It never reads past the buffer.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from .errors import WireError
from .indices import decode_indices, encode_indices, encoded_size

MAGIC = b"HVSL"
VERSION = 1
HEADER = struct.Struct("<4sBBHIQQI")
ENTRY = struct.Struct("<BBHIII")
assert HEADER.size == 32 and ENTRY.size == 16

# Message kinds.
PUSH, PULL, FLUSH_PUSH, FLUSH_PULL, ERROR = 1, 2, 3, 4, 5
KIND_NAMES = {PUSH: "push", PULL: "pull", FLUSH_PUSH: "flush push", FLUSH_PULL: "flush pull",
              ERROR: "error"}

# Section modes.
M_DENSE = 0         # all d values, no indices
M_SLICE = 1         # k values: core (indices sent) then explored (regenerated)
M_SLICE_CACHED = 2  # k values: core cached from the last refresh, then explored
M_EXPLICIT = 3      # n values at n explicitly sent indices (the union pull), no exploration
M_EMPTY = 4         # nothing for this bucket (dense buckets during flush)
MODE_NAMES = {M_DENSE: "dense", M_SLICE: "slice", M_SLICE_CACHED: "cached slice",
              M_EXPLICIT: "explicit", M_EMPTY: "empty"}


class RemoteError(RuntimeError):
    """The server reported a failure to every rank instead of a pull."""


@dataclass
class Section:
    """One bucket's part of a message. ``values`` are raw bytes of ``count`` wire-dtype values."""

    mode: int
    values: np.ndarray
    count: int
    indices: Optional[np.ndarray] = None   # int64, sorted; core (M_SLICE) or explicit indices
    idx_kind: int = 0
    idx_bytes: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))


@dataclass(frozen=True)
class Expect:
    """What the receiver accepts for one bucket: ``modes`` maps mode -> (values, core indices);
    None means "any count up to d" (explicit indices)."""

    d: int
    itemsize: int
    modes: Dict[int, Optional[tuple]]


def make_section(mode: int, values: np.ndarray, d: int,
                 indices: Optional[np.ndarray] = None) -> Section:
    """Build a section from raw value bytes and (for M_SLICE / M_EXPLICIT) sorted indices."""
    vals = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
    if indices is None:
        return Section(mode, vals, count=-1)
    kind, enc = encode_indices(np.asarray(indices, dtype=np.int64), d)
    return Section(mode, vals, count=-1, indices=indices, idx_kind=kind, idx_bytes=enc)


def encode(kind: int, sender: int, step: int, digest: int, sections: Sequence[Section],
           itemsizes: Sequence[int]) -> tuple:
    """Serialise; returns (buffer, {"header": .., "values": .., "indices": ..}) byte counts."""
    head = HEADER.pack(MAGIC, VERSION, kind, len(sections), sender, step, digest, 0)
    table = bytearray()
    for s, isz in zip(sections, itemsizes):
        if len(s.values) % isz:
            raise ValueError(f"value bytes {len(s.values)} are not a multiple of itemsize {isz}")
        n_idx = 0 if s.indices is None else len(s.indices)
        table += ENTRY.pack(s.mode, s.idx_kind, 0, len(s.values) // isz, n_idx, len(s.idx_bytes))
    parts = [np.frombuffer(head + bytes(table), np.uint8)]
    parts += [s.values for s in sections] + [s.idx_bytes for s in sections]
    buf = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    sizes = {"header": len(head) + len(table),
             "values": sum(len(s.values) for s in sections),
             "indices": sum(len(s.idx_bytes) for s in sections)}
    return buf, sizes


def is_error(buf: np.ndarray) -> bool:
    """True for a message made by :func:`encode_error`."""
    return len(buf) >= HEADER.size and bytes(buf[:4]) == MAGIC and int(buf[5]) == ERROR


def encode_error(sender: int, step: int, text: str) -> np.ndarray:
    body = text.encode("utf-8", "replace")
    head = HEADER.pack(MAGIC, VERSION, ERROR, 0, sender, step, 0, len(body))
    return np.frombuffer(head + body, np.uint8).copy()


def _header(buf: np.ndarray, who: str) -> tuple:
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise WireError(f"{who}: payload must be a 1-D uint8 array")
    if len(buf) < HEADER.size:
        raise WireError(f"{who}: truncated message of {len(buf)} bytes, shorter than the "
                        f"{HEADER.size}-byte header")
    magic, ver, kind, nb, sender, step, digest, extra = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError(f"{who}: bad magic {magic!r}: not an hvd_slim message")
    if ver != VERSION:
        raise WireError(f"{who}: wire version {ver}, this build speaks {VERSION}: "
                        "run the same hvd_slim version on every rank")
    if kind == ERROR:
        # The text may have been cut to fit the pull's bound: decode what arrived.
        text = bytes(buf[HEADER.size:HEADER.size + extra]).decode("utf-8", "replace")
        raise RemoteError(text)
    if extra != 0:
        raise WireError(f"{who}: reserved header field is {extra}, expected 0")
    return kind, nb, sender, step, digest


def decode(buf: np.ndarray, *, kind: int, sender: int, step: int, digest: int,
           expect: Sequence[Expect], who: str) -> List[Section]:
    """Strictly decode ``buf``; ``who`` names the message in errors (e.g. "push from rank 2")."""
    got_kind, nb, got_sender, got_step, got_digest = _header(buf, who)
    if got_kind != kind:
        raise WireError(f"{who}: expected a {KIND_NAMES.get(kind, kind)} message, got "
                        f"{KIND_NAMES.get(got_kind, got_kind)}")
    if got_sender != sender:
        raise WireError(f"{who}: message claims sender rank {got_sender}, expected {sender}")
    if got_digest != digest:
        raise WireError(f"{who}: parameter/config digest {got_digest:016x} differs from "
                        f"{digest:016x}: ranks disagree on the model (names, shapes, dtypes) "
                        "or on the Slim-DP settings")
    if got_step != step:
        raise WireError(f"{who}: message is for step {got_step}, expected step {step}: "
                        "ranks are out of step (a rank skipped or repeated optimizer.step())")
    if nb != len(expect):
        raise WireError(f"{who}: {nb} buckets, expected {len(expect)}")
    table_end = HEADER.size + ENTRY.size * nb
    if len(buf) < table_end:
        raise WireError(f"{who}: truncated: {len(buf)} bytes, the table needs {table_end}")
    entries = [ENTRY.unpack_from(buf, HEADER.size + i * ENTRY.size) for i in range(nb)]
    total = table_end
    for i, ((mode, ikind, pad, count, n_idx, nbytes), ex) in enumerate(zip(entries, expect)):
        if pad != 0:
            raise WireError(f"{who}: bucket {i}: reserved table field is {pad}, expected 0")
        if mode not in ex.modes:
            allowed = ", ".join(MODE_NAMES.get(m, str(m)) for m in ex.modes)
            raise WireError(f"{who}: bucket {i} has mode {MODE_NAMES.get(mode, mode)}, "
                            f"allowed here: {allowed}")
        want = ex.modes[mode]
        if want is None:
            if count != n_idx or count > ex.d:
                raise WireError(f"{who}: bucket {i}: {count} values for {n_idx} explicit indices "
                                f"(d={ex.d}); they must be equal and at most d")
        elif (count, n_idx) != tuple(want):
            raise WireError(f"{who}: bucket {i} ({MODE_NAMES[mode]}): {count} values and {n_idx} "
                            f"indices, expected {want[0]} and {want[1]}")
        has_idx = mode in (M_SLICE, M_EXPLICIT)
        if has_idx:
            try:
                need = encoded_size(ikind, ex.d, n_idx)
            except (ValueError, KeyError) as exc:
                raise WireError(f"{who}: bucket {i}: bad index encoding {ikind}: {exc}") from None
            if nbytes != need:
                raise WireError(f"{who}: bucket {i}: index section of {nbytes} bytes, encoding "
                                f"{ikind} of {n_idx} indices in d={ex.d} takes {need}")
        elif ikind != 0 or nbytes != 0:
            raise WireError(f"{who}: bucket {i} ({MODE_NAMES[mode]}) carries index bytes")
        total += count * ex.itemsize + nbytes
    if len(buf) != total:
        raise WireError(f"{who}: message is {len(buf)} bytes, its table describes {total}")
    out, pos = [], table_end
    for (mode, ikind, _pad, count, n_idx, _nb), ex in zip(entries, expect):
        n = count * ex.itemsize
        out.append(Section(mode, buf[pos:pos + n], count, idx_kind=ikind))
        pos += n
    for i, ((mode, ikind, _pad, count, n_idx, nbytes), ex, s) in enumerate(zip(entries, expect, out)):
        s.idx_bytes = buf[pos:pos + nbytes]
        pos += nbytes
        if mode in (M_SLICE, M_EXPLICIT):
            try:
                s.indices = decode_indices(ikind, s.idx_bytes, ex.d, n_idx)
            except WireError as exc:
                raise WireError(f"{who}: bucket {i} indices: {exc}") from None
    return out
