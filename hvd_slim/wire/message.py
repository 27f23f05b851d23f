"""The payload layout of one exchange message, and its strict decoder.

A message is one contiguous byte buffer::

    header (32 B) | table: 16 B per bucket | values of bucket 0, 1, ... | indices of bucket 0, 1, ...

Header: magic ``HVSL``, version, kind, bucket count, sender rank, step, layout digest, and a
last field that is zero, except in text messages (ERROR and the control kinds of control.py),
where it is the length of the UTF-8 body that follows the header; an ERROR's bucket count holds
its ``E_*`` code. Table entry per bucket: mode, index encoding, the values' power-of-two scale
exponent (nonzero only for sections whose receiver expects scaled 8-bit values: the value
``v`` stands for ``v * 2**exp``), count of values, count of indices, index bytes.
Values come first, in bucket order (widest dtype first), so each value section stays aligned for
its dtype; explored indices never travel (the receiver regenerates them from the seed).

Decoding checks every field against what the receiver expects (kind, sender, step, digest, and
per bucket the allowed modes and exact counts) and the exact total length, and raises
:class:`WireError` naming what differs. It never reads past the buffer.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .errors import WireError
from .indices import decode_indices, encode_indices, encoded_size

MAGIC = b"HVSL"
# 2: the table's third field is a scale exponent (was reserved, always 0); 3: mode M_SHORT;
# 4: mode M_CODED
VERSION = 4
HEADER = struct.Struct("<4sBBHIQQI")
ENTRY = struct.Struct("<BBhIII")
MAX_EXP = 1100  # |scale exponent|: beyond what any finite float64 value can need
assert HEADER.size == 32 and ENTRY.size == 16

# Message kinds. Data: PUSH, PULL and their flush variants (header, table, sections).
PUSH, PULL, FLUSH_PUSH, FLUSH_PULL, ERROR = 1, 2, 3, 4, 5
# Control (see control.py): the first-step handshake, and the decisions a step can end in.
HELLO, AGREED, DESCRIBE, DESCRIPTION, NONFINITE, SKIP = 6, 7, 8, 9, 10, 11
# The schedule round of ``overlap_forward`` (exchange/overlap/order.py): flags in ``extra``.
ORDER = 12
KIND_NAMES = {PUSH: "push", PULL: "pull", FLUSH_PUSH: "flush push", FLUSH_PULL: "flush pull",
              ERROR: "error", HELLO: "hello", AGREED: "agreed", DESCRIBE: "describe request",
              DESCRIPTION: "description", NONFINITE: "non-finite report", SKIP: "skip",
              ORDER: "schedule round"}
# Kinds whose body is UTF-8 text of ``extra`` bytes (the header's last field).
TEXT_KINDS = (ERROR, DESCRIPTION, NONFINITE, SKIP)
# ERROR codes (the header's bucket-count field), so every rank raises the same exception type.
E_GENERIC, E_NONFINITE = 0, 1

# Section modes.
M_DENSE = 0         # all d values, no indices
M_SLICE = 1         # k values: core (indices sent) then explored (regenerated)
# 2 was a slice whose core was cached from an earlier step (refresh_interval, removed):
# decoders refuse it as an unknown mode.
M_EXPLICIT = 3      # n values at n explicitly sent indices (the union pull), no exploration
M_EMPTY = 4         # nothing for this bucket (dense buckets during flush)
# A slice cut short: the n < k_core non-zero values a server's residual holds, at n explicit
# indices and coded as a slice (value_bits), no exploration: what a slice whose core had to be
# filled up with zeros would deliver, without the zeros.
M_SHORT = 5
# All d values coded as a slice is (value_bits), no indices: a push of every coordinate's sign
# (value_bits=1 at density=1.0), which is 32x smaller than dense where a slice's indices
# would cost it twice its values again.
M_CODED = 6
SLICED = (M_SLICE, M_SHORT, M_CODED)   # the modes whose values follow value_bits
INDEXED = (M_SLICE, M_EXPLICIT, M_SHORT)   # the modes that carry indices
MODE_NAMES = {M_DENSE: "dense", M_SLICE: "slice", M_EXPLICIT: "explicit", M_EMPTY: "empty",
              M_SHORT: "short slice", M_CODED: "coded"}


class RemoteError(RuntimeError):
    """The server reported a failure to every rank instead of a pull. ``code`` is one of the
    ``E_*`` codes."""

    def __init__(self, message: str, code: int = E_GENERIC) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Section:
    """One bucket's part of a message. ``values`` are raw bytes of ``count`` wire-dtype values.
    Numpy arrays here; uint8/int64 tensors on the message's device in the tensor form
    (:mod:`hvd_slim.wire.message_torch`)."""

    mode: int
    values: np.ndarray
    count: int
    indices: Optional[np.ndarray] = None   # int64, sorted; core (M_SLICE) or explicit indices
    idx_kind: int = 0
    idx_bytes: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    exp: int = 0                           # the values stand for values * 2**exp


@dataclass(frozen=True)
class Expect:
    """What the receiver accepts for one bucket: ``modes`` maps mode -> (values, core indices);
    None means "any count up to d" (explicit indices). ``scaled``: the sliced modes' values
    carry a scale exponent (8-bit values); otherwise every exponent must be 0."""

    d: int
    itemsize: int
    modes: Dict[int, Optional[tuple]]
    scaled: bool = False


def make_section(mode: int, values: np.ndarray, d: int,
                 indices: Optional[np.ndarray] = None, exp: int = 0) -> Section:
    """Build a section from raw value bytes (standing for ``values * 2**exp``) and (for
    the indexed modes, ``INDEXED``) sorted indices."""
    vals = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
    if indices is None:
        return Section(mode, vals, count=-1, exp=exp)
    kind, enc = encode_indices(np.asarray(indices, dtype=np.int64), d)
    return Section(mode, vals, count=-1, indices=indices, idx_kind=kind, idx_bytes=enc, exp=exp)


def head_and_table(kind: int, sender: int, step: int, digest: int, sections: Sequence[Any],
                   itemsizes: Sequence[int]) -> bytes:
    """A message's header and section table (the host and device encoders share it)."""
    head = HEADER.pack(MAGIC, VERSION, kind, len(sections), sender, step, digest, 0)
    table = bytearray()
    for s, isz in zip(sections, itemsizes):
        if len(s.values) % isz:
            raise ValueError(f"value bytes {len(s.values)} are not a multiple of itemsize {isz}")
        n_idx = 0 if s.indices is None else len(s.indices)
        table += ENTRY.pack(s.mode, s.idx_kind, s.exp, len(s.values) // isz, n_idx,
                            len(s.idx_bytes))
    return head + bytes(table)


def encode(kind: int, sender: int, step: int, digest: int, sections: Sequence[Section],
           itemsizes: Sequence[int]) -> tuple:
    """Serialise; returns (buffer, {"header": .., "values": .., "indices": ..}) byte counts."""
    meta = head_and_table(kind, sender, step, digest, sections, itemsizes)
    parts = [np.frombuffer(meta, np.uint8)]
    parts += [s.values for s in sections] + [s.idx_bytes for s in sections]
    buf = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    sizes = {"header": len(meta),
             "values": sum(len(s.values) for s in sections),
             "indices": sum(len(s.idx_bytes) for s in sections)}
    return buf, sizes


def is_error(buf: np.ndarray) -> bool:
    """True for a message made by :func:`encode_error`."""
    return isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1 \
        and len(buf) >= HEADER.size and bytes(buf[:4]) == MAGIC and int(buf[5]) == ERROR


def encode_error(sender: int, step: int, text: str, code: int = E_GENERIC,
                 limit: Optional[int] = None) -> np.ndarray:
    """An ERROR message carrying ``text`` (cut to fit ``limit`` bytes in all) and ``code``."""
    body = fit_text(text, None if limit is None else limit - HEADER.size)
    head = HEADER.pack(MAGIC, VERSION, ERROR, code, sender, step, 0, len(body))
    return np.frombuffer(head + body, np.uint8).copy()


def fit_text(text: str, room: Optional[int]) -> bytes:
    """``text`` as UTF-8, cut at a character boundary to at most ``room`` bytes (marked "...")."""
    body = text.encode("utf-8", "replace")
    if room is None or len(body) <= room:
        return body
    mark = b"..." if room >= 3 else b""
    return body[:max(0, room - len(mark))].decode("utf-8", "ignore").encode("utf-8") + mark


def peek(buf: np.ndarray, who: str) -> int:
    """The kind of a well-formed header (raises :class:`RemoteError` for an ERROR message and
    :class:`WireError` for anything malformed), so a receiver can pick the right decoder."""
    return _header(buf, who)[0]


def _header(buf: np.ndarray, who: str) -> tuple:
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        what = type(buf).__name__ if not isinstance(buf, np.ndarray) else \
            f"{buf.dtype} array of shape {buf.shape}"
        raise WireError(f"{who}: payload must be a 1-D uint8 array, got a {what}")
    if not buf.flags.c_contiguous:
        raise WireError(f"{who}: payload must be contiguous")
    return header_fields(buf, len(buf), who)


def header_fields(meta: np.ndarray, length: int, who: str) -> tuple:
    """Parse and check the header held in ``meta``, the first bytes (at least the header, and
    all of an ERROR's text) of a message of ``length`` bytes; returns (kind, buckets, sender,
    step, digest, extra). Raises :class:`RemoteError` for an ERROR message."""
    if length < HEADER.size:
        raise WireError(f"{who}: truncated message of {length} bytes, shorter than the "
                        f"{HEADER.size}-byte header")
    magic, ver, kind, nb, sender, step, digest, extra = HEADER.unpack_from(meta, 0)
    if magic != MAGIC:
        raise WireError(f"{who}: bad magic {magic!r}: not an hvd_slim message")
    if ver != VERSION:
        raise WireError(f"{who}: wire version {ver}, this build speaks {VERSION}: "
                        "run the same hvd_slim version on every rank")
    if kind == ERROR:
        # The text may have been cut to fit the pull's bound: decode what arrived.
        text = bytes(meta[HEADER.size:HEADER.size + extra]).decode("utf-8", "replace")
        raise RemoteError(text, nb)
    if kind not in KIND_NAMES:
        raise WireError(f"{who}: unknown message kind {kind}")
    if extra != 0 and kind not in TEXT_KINDS and kind != ORDER:
        raise WireError(f"{who}: reserved header field is {extra}, expected 0")
    return kind, nb, sender, step, digest, extra


def check_envelope(who: str, got: tuple, kind: int, sender: int, step: int, digest: int) -> None:
    """Compare a header's (kind, sender, step, digest) with what the receiver expects."""
    got_kind, got_sender, got_step, got_digest = got
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


def read_table(meta: np.ndarray, length: int, *, kind: int, sender: int, step: int,
               digest: int, expect: Sequence[Expect], who: str) -> List[tuple]:
    """Check the header and table held in ``meta`` (the first bytes of a message of ``length``
    bytes: at least its header and ``len(expect)`` table entries) against what the receiver
    expects, and the exact total length; returns the table entries."""
    got_kind, nb, got_sender, got_step, got_digest, _ = header_fields(meta, length, who)
    check_envelope(who, (got_kind, got_sender, got_step, got_digest), kind, sender, step, digest)
    if nb != len(expect):
        raise WireError(f"{who}: {nb} buckets, expected {len(expect)}")
    table_end = table_size(nb)
    if length < table_end:
        raise WireError(f"{who}: truncated: {length} bytes, the table needs {table_end}")
    entries = [ENTRY.unpack_from(meta, HEADER.size + i * ENTRY.size) for i in range(nb)]
    total = table_end
    for i, ((mode, ikind, exp, count, n_idx, nbytes), ex) in enumerate(zip(entries, expect)):
        if mode not in ex.modes:
            allowed = ", ".join(MODE_NAMES.get(m, str(m)) for m in ex.modes)
            raise WireError(f"{who}: bucket {i} has mode {MODE_NAMES.get(mode, mode)}, "
                            f"allowed here: {allowed}")
        want = ex.modes[mode]
        if want is None:
            # An Expect may know fewer coordinates than d can arrive (a union pull holds at
            # most what the workers pushed): more means a corrupt or foreign message.
            most = getattr(ex, "most_explicit", None)
            most = ex.d if most is None else min(int(most), ex.d)
            if count != n_idx or count > most:
                raise WireError(f"{who}: bucket {i}: {count} values for {n_idx} explicit indices "
                                f"(d={ex.d}); they must be equal and at most {most}")
        elif (count, n_idx) != tuple(want):
            raise WireError(f"{who}: bucket {i} ({MODE_NAMES[mode]}): {count} values and {n_idx} "
                            f"indices, expected {want[0]} and {want[1]}")
        scaled = ex.scaled and mode in SLICED
        if exp != 0 and not scaled:
            raise WireError(f"{who}: bucket {i} ({MODE_NAMES[mode]}): scale exponent {exp}, "
                            "expected 0 (these values are not scaled)")
        if abs(exp) > MAX_EXP:
            raise WireError(f"{who}: bucket {i}: scale exponent {exp} is out of range "
                            f"(at most {MAX_EXP} in magnitude)")
        if mode in INDEXED:
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
    if length != total:
        raise WireError(f"{who}: message is {length} bytes, its table describes {total}")
    return entries


def table_size(buckets: int) -> int:
    """Bytes of the header and a table of ``buckets`` entries: where the values start."""
    return HEADER.size + ENTRY.size * buckets


def decode(buf: np.ndarray, *, kind: int, sender: int, step: int, digest: int,
           expect: Sequence[Expect], who: str) -> List[Section]:
    """Strictly decode ``buf``; ``who`` names the message in errors (e.g. "push from rank 2")."""
    _header(buf, who)
    entries = read_table(buf, len(buf), kind=kind, sender=sender, step=step, digest=digest,
                         expect=expect, who=who)
    return split_sections(buf, entries, expect, who, decode_indices)


def split_sections(buf: Any, entries: List[tuple], expect: Sequence[Expect], who: str,
                   decode_idx: Callable[..., Any]) -> List[Section]:
    """Sections over the checked message ``buf`` (a numpy array or a tensor: views, no copies),
    their indices decoded with ``decode_idx`` (the numpy or the torch codec)."""
    out, pos = [], table_size(len(entries))
    for (mode, ikind, exp, count, n_idx, _nb), ex in zip(entries, expect):
        n = count * ex.itemsize
        out.append(Section(mode, buf[pos:pos + n], count, idx_kind=ikind, exp=exp))
        pos += n
    for i, ((mode, ikind, _exp, count, n_idx, nbytes), ex, s) in enumerate(zip(entries, expect,
                                                                               out)):
        s.idx_bytes = buf[pos:pos + nbytes]
        pos += nbytes
        if mode in INDEXED:
            try:
                s.indices = decode_idx(ikind, s.idx_bytes, ex.d, n_idx)
            except WireError as exc:
                raise WireError(f"{who}: bucket {i} indices: {exc}") from None
    return out
