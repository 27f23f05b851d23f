"""The tensor form of :mod:`hvd_slim.wire.message`: the same bytes, as one uint8 tensor on the
device that holds the values and indices (a GPU on the NCCL path), built and taken apart there.

Only small, fixed-size metadata crosses to the host: the header and section table (built on
the host and copied over when encoding; read back when decoding), and text messages (ERROR,
SKIP, NONFINITE: a few hundred bytes), which :func:`host_text` hands to the numpy decoders.
Values and indices never leave the device. Decoding is exactly as strict as the numpy decoder,
with the same :class:`WireError` messages.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import indices_torch
from .errors import WireError
from .message import (ENTRY, ERROR, HEADER, MAGIC, TEXT_KINDS, VERSION, Expect, Section,
                      head_and_table, header_fields, read_table, split_sections)

__all__ = ["make_section", "empty_section", "encode", "decode", "peek", "host_text",
           "from_host", "is_error"]


def make_section(mode: int, values: torch.Tensor, d: int,
                 indices: Optional[torch.Tensor] = None, exp: int = 0) -> Section:
    """A section over ``values`` (any dtype: its raw bytes, no copy when contiguous; they
    stand for ``values * 2**exp``) and, for the indexed modes, the sorted ``indices``,
    encoded on their device."""
    vals = values.detach().contiguous().view(-1).view(torch.uint8)
    if indices is None:
        return Section(mode, vals, count=-1, idx_bytes=vals.new_empty(0), exp=exp)
    kind, enc = indices_torch.encode_indices(indices, d)
    return Section(mode, vals, count=-1, indices=indices, idx_kind=kind, idx_bytes=enc, exp=exp)


def empty_section(mode: int, device: torch.device) -> Section:
    """A section with no values and no indices (M_EMPTY)."""
    none = torch.empty(0, dtype=torch.uint8, device=device)
    return Section(mode, none, count=-1, idx_bytes=none)


def encode(kind: int, sender: int, step: int, digest: int, sections: Sequence[Section],
           itemsizes: Sequence[int], device: torch.device) -> Tuple[torch.Tensor, Dict[str, int]]:
    """Serialise into one uint8 tensor on ``device``: bitwise the bytes of
    :func:`hvd_slim.wire.message.encode`. Returns (message, byte counts) as that does."""
    meta = torch.frombuffer(bytearray(head_and_table(kind, sender, step, digest, sections,
                                                        itemsizes)),
                            dtype=torch.uint8).to(device)
    parts = [meta] + [s.values for s in sections] + [s.idx_bytes for s in sections]
    buf = torch.cat([p.to(device) for p in parts])
    sizes = {"header": len(meta),
             "values": sum(len(s.values) for s in sections),
             "indices": sum(len(s.idx_bytes) for s in sections)}
    return buf, sizes


def _check_payload(buf: torch.Tensor, who: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        what = type(buf).__name__ if not isinstance(buf, torch.Tensor) else \
            f"{str(buf.dtype).replace('torch.', '')} tensor of shape {tuple(buf.shape)}"
        raise WireError(f"{who}: payload must be a 1-D uint8 array, got a {what}")
    if not buf.is_contiguous():
        raise WireError(f"{who}: payload must be contiguous")


def _head(buf: torch.Tensor, n: int) -> np.ndarray:
    """The first ``n`` bytes (or fewer) of ``buf`` on the host: the one read of metadata."""
    return buf[:n].cpu().numpy()


def _is_text(meta: np.ndarray) -> bool:
    """Whether a header announces a text kind (ERROR included): its body goes to the host."""
    return len(meta) >= HEADER.size and bytes(meta[:4]) == MAGIC and int(meta[4]) == VERSION \
        and int(meta[5]) in TEXT_KINDS + (ERROR,)


def host_text(buf: Union[np.ndarray, torch.Tensor]) -> Union[np.ndarray, torch.Tensor]:
    """``buf`` as a host array when it is a text message (ERROR, SKIP, NONFINITE, DESCRIPTION:
    small), so the numpy decoders read it; any other message is returned as it is."""
    if not isinstance(buf, torch.Tensor):
        return buf
    _check_payload(buf, "message")
    return buf.cpu().numpy() if _is_text(_head(buf, HEADER.size)) else buf


def is_error(buf: torch.Tensor) -> bool:
    """True for an ERROR message (as :func:`hvd_slim.wire.message.is_error`)."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 \
            or len(buf) < HEADER.size:
        return False
    meta = _head(buf, HEADER.size)
    return bytes(meta[:4]) == MAGIC and int(meta[5]) == ERROR


def peek(buf: torch.Tensor, who: str) -> int:
    """The kind of a well-formed header, reading only the header (and an ERROR's text, which
    it raises as :class:`RemoteError`); :class:`WireError` for anything malformed."""
    _check_payload(buf, who)
    meta = _head(buf, HEADER.size)
    if _is_text(meta):
        meta = buf.cpu().numpy()
    return header_fields(meta, len(buf), who)[0]


def decode(buf: torch.Tensor, *, kind: int, sender: int, step: int, digest: int,
           expect: Sequence[Expect], who: str) -> List[Section]:
    """Strictly decode the message tensor ``buf``: sections whose values and indices are
    tensors on ``buf``'s device (views of it, and decoded indices)."""
    _check_payload(buf, who)
    meta = _head(buf, HEADER.size + ENTRY.size * len(expect))
    if _is_text(meta):   # an ERROR raises its text; other text kinds fail the envelope check
        meta = buf.cpu().numpy()
    entries = read_table(meta, len(buf), kind=kind, sender=sender, step=step, digest=digest,
                         expect=expect, who=who)
    return split_sections(buf, entries, expect, who, indices_torch.decode_indices)


def from_host(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host-built message (a control or text message) as a uint8 tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(buf, dtype=np.uint8)).to(device)
