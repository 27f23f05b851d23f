"""Control messages: the first-step handshake and the decisions a step can end in.

All share the 32-byte header of :mod:`hvd_slim.wire.message` (the last header field holds the
body length of text kinds and ORDER's flags, and must be zero otherwise):

* ``HELLO`` (rank -> rank 0): header only; its step and digest are what rank 0 compares.
* ``AGREED`` / ``DESCRIBE`` (rank 0 -> all): header only; all agree, or "send your description".
* ``DESCRIPTION`` (rank -> rank 0): a JSON object (names, shapes, dtypes, config); JSON, never
  pickle, so a peer's bytes can never run code here.
* ``NONFINITE`` (rank -> server, instead of a push): this rank's gradient has NaN/Inf; the body
  names the tensors.
* ``SKIP`` (server -> all, instead of a pull): every rank skips this step; the body says why.
* ``ORDER`` (rank -> rank 0, then rank 0 -> all): header only, a few flags in the last field;
  the schedule round of ``overlap_forward`` (exchange/overlap/order.py).

Every decoder checks the exact length, kind, sender, step and digest, and raises
:class:`~hvd_slim.wire.errors.WireError` naming what differs.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from .errors import WireError
from .message import (AGREED, DESCRIBE, DESCRIPTION, HEADER, HELLO, KIND_NAMES, MAGIC, NONFINITE,
                      ORDER, SKIP, TEXT_KINDS, VERSION, _header, check_envelope, fit_text)

# Largest text body accepted per kind: a report or decision is a few lines; a description
# lists every parameter (about 80 bytes each), so it gets room for very large models.
MAX_TEXT = {NONFINITE: 4096, SKIP: 1 << 16, DESCRIPTION: 1 << 26}
CONTROL_KINDS = (HELLO, AGREED, DESCRIBE)


def encode_control(kind: int, sender: int, step: int, digest: int) -> np.ndarray:
    """A header-only message (HELLO, AGREED or DESCRIBE)."""
    if kind not in CONTROL_KINDS:
        raise ValueError(f"{KIND_NAMES.get(kind, kind)} is not a header-only control kind")
    return np.frombuffer(HEADER.pack(MAGIC, VERSION, kind, 0, sender, step, digest, 0),
                         np.uint8).copy()


def decode_control(buf: np.ndarray, *, kind: int, sender: int, step: Optional[int],
                   digest: Optional[int], who: str) -> tuple:
    """Strictly decode a header-only message; returns its (step, digest). ``step``/``digest``
    None accept any value (rank 0 compares the hellos itself, to name every differing rank)."""
    got_kind, nb, got_sender, got_step, got_digest, _ = _header(buf, who)
    check_envelope(who, (got_kind, got_sender, got_step, got_digest), kind, sender,
                   got_step if step is None else step, got_digest if digest is None else digest)
    if nb != 0 or len(buf) != HEADER.size:
        raise WireError(f"{who}: a {KIND_NAMES[kind]} message is {HEADER.size} bytes with no "
                        f"buckets, got {len(buf)} bytes and {nb} buckets")
    return got_step, got_digest


# ORDER's flags (the header's last field): at most these bits.
ORDER_FLAGS = 0xFF


def encode_order(sender: int, step: int, digest: int, flags: int) -> np.ndarray:
    """An ORDER message: header only, ``flags`` (a few bits) in its last field."""
    if not 0 <= flags <= ORDER_FLAGS:
        raise ValueError(f"ORDER flags must be in [0, {ORDER_FLAGS}], got {flags}")
    return np.frombuffer(HEADER.pack(MAGIC, VERSION, ORDER, 0, sender, step, digest, flags),
                         np.uint8).copy()


def decode_order(buf: np.ndarray, *, sender: int, step: int, digest: int, who: str) -> int:
    """Strictly decode an ORDER message of ``sender`` at ``step``; returns its flags."""
    got_kind, nb, got_sender, got_step, got_digest, extra = _header(buf, who)
    check_envelope(who, (got_kind, got_sender, got_step, got_digest), ORDER, sender, step,
                   digest)
    if nb != 0 or len(buf) != HEADER.size or extra > ORDER_FLAGS:
        raise WireError(f"{who}: a {KIND_NAMES[ORDER]} message is {HEADER.size} bytes with no "
                        f"buckets and flags <= {ORDER_FLAGS}, got {len(buf)} bytes, {nb} "
                        f"buckets, flags {extra}")
    return extra


def encode_text(kind: int, sender: int, step: int, digest: int, text: str,
                limit: Optional[int] = None) -> np.ndarray:
    """A text message (NONFINITE, SKIP, DESCRIPTION), cut to at most ``limit`` bytes in all."""
    if kind not in MAX_TEXT:
        raise ValueError(f"{KIND_NAMES.get(kind, kind)} does not carry text")
    room = MAX_TEXT[kind] if limit is None else min(MAX_TEXT[kind], limit - HEADER.size)
    body = fit_text(text, room)
    head = HEADER.pack(MAGIC, VERSION, kind, 0, sender, step, digest, len(body))
    return np.frombuffer(head + body, np.uint8).copy()


def decode_text(buf: np.ndarray, *, kind: int, sender: int, step: int, digest: Optional[int],
                who: str) -> str:
    """Strictly decode a text message of ``kind``; returns the text. ``digest`` None accepts
    any (rank 0 reads descriptions precisely because the digests differ)."""
    assert kind in TEXT_KINDS and kind in MAX_TEXT
    got_kind, nb, got_sender, got_step, got_digest, extra = _header(buf, who)
    check_envelope(who, (got_kind, got_sender, got_step, got_digest), kind, sender, step,
                   got_digest if digest is None else digest)
    if nb != 0:
        raise WireError(f"{who}: a {KIND_NAMES[kind]} message has no buckets, got {nb}")
    if extra > MAX_TEXT[kind]:
        raise WireError(f"{who}: {KIND_NAMES[kind]} text of {extra} bytes exceeds the "
                        f"{MAX_TEXT[kind]}-byte limit")
    if len(buf) != HEADER.size + extra:
        raise WireError(f"{who}: message is {len(buf)} bytes, its header describes "
                        f"{HEADER.size + extra}")
    return bytes(buf[HEADER.size:]).decode("utf-8", "replace")


def encode_description(sender: int, step: int, digest: int, description: dict) -> np.ndarray:
    """A rank's layout and config description as a DESCRIPTION message (JSON)."""
    return encode_text(DESCRIPTION, sender, step, digest, json.dumps(description, sort_keys=True))


def decode_description(buf: np.ndarray, *, sender: int, step: int, digest: Optional[int],
                       who: str) -> dict:
    """Strictly decode a DESCRIPTION: valid JSON whose top level is an object."""
    text = decode_text(buf, kind=DESCRIPTION, sender=sender, step=step, digest=digest, who=who)
    try:
        obj: Any = json.loads(text)
    except ValueError as exc:
        raise WireError(f"{who}: description is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"{who}: description must be a JSON object, got {type(obj).__name__}")
    return obj


__all__ = ["AGREED", "DESCRIBE", "DESCRIPTION", "HELLO", "NONFINITE", "ORDER", "SKIP",
           "MAX_TEXT", "encode_control", "decode_control", "encode_order", "decode_order",
           "encode_text", "decode_text", "encode_description", "decode_description"]
