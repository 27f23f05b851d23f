"""The bound every length the tensor API receives is checked against before anything is
allocated from it.

A length word read from the wrong message (ranks out of step, a peer that made another
collective) can be any number: allocating from it fails with an opaque MemoryError, or worse,
succeeds and waits for bytes that never come. No honest payload is larger than this machine's
memory, so a length beyond it, or a negative one, raises a :class:`TransportError` naming the
call and the rank it came from.
"""
from __future__ import annotations

import os
from typing import Optional

from .base import TransportError


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):   # not POSIX: a generous fixed bound
        return 1 << 40


MAX_BYTES = _memory_bytes()


def check_length(what: str, nbytes: int, source: Optional[int], rank: int) -> int:
    """``nbytes`` if it is a plausible length, else a TransportError: ``what`` names the call,
    ``source`` the rank the length came from (None: the sum over ranks), ``rank`` this one."""
    if 0 <= nbytes <= MAX_BYTES:
        return nbytes
    origin = "the ranks' lengths add up to" if source is None else f"rank {source} announced"
    raise TransportError(f"rank {rank}: {what}: {origin} {nbytes} bytes, "
                         f"{'negative' if nbytes < 0 else 'more than this machine holds'} "
                         f"({MAX_BYTES} bytes of memory); the length was read from another "
                         f"message: the ranks' collectives are out of step (every rank must make "
                         f"the same calls in the same order)")
