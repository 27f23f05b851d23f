"""How an exchange holds its messages: host numpy arrays, or uint8 tensors on the parameters'
device. The worker, server and step code call a :class:`WirePath` and never ask which.

* :class:`HostPath`: sections are numpy views of the values and numpy-encoded indices, messages
  numpy arrays (the MPI transport on CPU parameters: numpy is fastest there, and a CPU tensor's
  numpy view costs nothing).
* :class:`DevicePath`: sections, indices and whole messages are tensors on the parameters'
  device, encoded and decoded by torch ops there (wire/message_torch.py): on the NCCL path a
  GPU's values and indices never go through host memory; only the header and section table,
  the frames' length words and short text messages (errors, skip verdicts) are read on the host.

:func:`wire_path` picks the device path when the transport says it takes tensor payloads for
the parameters' device (``Transport.device_payloads``). Both produce bitwise the same bytes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np
import torch

from ..transport.base import Transport
from ..wire import message as wm
from ..wire import message_torch as wt
from ..wire.views import to_bytes


@runtime_checkable   # so a test can check both paths against it
class WirePath(Protocol):
    """The form an exchange's sections and messages take, and the collectives that move them.

    A message (``buf``) is whatever this path holds one as: a numpy uint8 array or a uint8
    tensor on the parameters' device. Both paths write and read bitwise the same bytes."""

    device_payloads: bool   # messages are device tensors (the transport's *_tensor calls)

    def section(self, mode: int, values: torch.Tensor, d: int,
                indices: Optional[torch.Tensor] = None, exp: int = 0) -> wm.Section:
        """The section carrying ``values`` (standing for ``values * 2**exp``) and, for the
        indexed modes (``wm.INDEXED``), ``indices``."""

    def empty(self, mode: int = wm.M_EMPTY) -> wm.Section:
        """A section with no values and no indices."""

    def encode(self, kind: int, sender: int, step: int, digest: int,
               sections: Sequence[wm.Section], itemsizes: Sequence[int]
               ) -> Tuple[Any, Dict[str, int]]:
        """(the message, its byte counts by part), as :func:`hvd_slim.wire.message.encode`."""

    def decode(self, buf: Any, **kw: Any) -> List[wm.Section]:
        """The strictly decoded sections, as :func:`hvd_slim.wire.message.decode`."""

    def peek(self, buf: Any, who: str) -> int:
        """The message's kind, from its header alone (RemoteError for an ERROR message,
        WireError for anything malformed)."""

    def is_error(self, buf: Any) -> bool:
        """Whether the message is an ERROR."""

    def host(self, buf: Any) -> np.ndarray:
        """A (text) message as a host array, for the numpy control decoders."""

    def from_host(self, buf: np.ndarray) -> Any:
        """A host-built message (control, text, error) in this path's form."""

    def gather(self, tr: Transport, buf: Any, root: int, bound: Optional[int]) -> Any:
        """Every rank's message, in rank order, on ``root``; None on the other ranks."""

    def broadcast(self, tr: Transport, buf: Any, root: int, bound: Optional[int]) -> Any:
        """``root``'s message (``buf``; None off the root) on every rank."""

    def gather_many(self, tr: Transport, bufs: Sequence[Any], roots: Sequence[int],
                    bounds: Sequence[Optional[int]]) -> Any:
        """``bufs[i]`` to ``roots[i]``: on a root, every rank's message for it in rank order;
        None on the other ranks (sharded servers)."""

    def broadcast_many(self, tr: Transport, buf: Any, roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> List[Any]:
        """Every root's message (``buf`` on a root, None elsewhere) on every rank, in
        ``roots`` order."""


class HostPath:
    """:class:`WirePath` with messages as numpy arrays (the transport's ``gather`` /
    ``broadcast``)."""

    device_payloads = False

    def section(self, mode: int, values: torch.Tensor, d: int,
                indices: Optional[torch.Tensor] = None, exp: int = 0) -> wm.Section:
        idx = None if indices is None else indices.detach().cpu().numpy()
        return wm.make_section(mode, to_bytes(values), d, indices=idx, exp=exp)

    def empty(self, mode: int = wm.M_EMPTY) -> wm.Section:
        return wm.make_section(mode, np.empty(0, np.uint8), 0)

    def encode(self, kind: int, sender: int, step: int, digest: int,
               sections: Sequence[wm.Section], itemsizes: Sequence[int]
               ) -> Tuple[Any, Dict[str, int]]:
        return wm.encode(kind, sender, step, digest, sections, itemsizes)

    def decode(self, buf: Any, **kw: Any) -> List[wm.Section]:
        return wm.decode(buf, **kw)

    def peek(self, buf: Any, who: str) -> int:
        return wm.peek(buf, who)

    def is_error(self, buf: Any) -> bool:
        return wm.is_error(buf)

    def host(self, buf: Any) -> np.ndarray:
        return buf

    def from_host(self, buf: np.ndarray) -> Any:
        return buf

    def gather(self, tr: Transport, buf: Any, root: int, bound: Optional[int]) -> Any:
        return tr.gather(buf, root=root, bound=bound)

    def broadcast(self, tr: Transport, buf: Any, root: int, bound: Optional[int]) -> Any:
        return tr.broadcast(buf, root=root, bound=bound)

    def gather_many(self, tr: Transport, bufs: Sequence[Any], roots: Sequence[int],
                    bounds: Sequence[Optional[int]]) -> Any:
        return tr.gather_many(bufs, roots, bounds)

    def broadcast_many(self, tr: Transport, buf: Any, roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> List[Any]:
        return tr.broadcast_many(buf, roots, bounds)


class DevicePath:
    """:class:`WirePath` with messages as uint8 tensors on ``device`` (the transport's
    ``gather_tensor`` / ``broadcast_tensor``)."""

    device_payloads = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def section(self, mode: int, values: torch.Tensor, d: int,
                indices: Optional[torch.Tensor] = None, exp: int = 0) -> wm.Section:
        return wt.make_section(mode, values, d, indices, exp)

    def empty(self, mode: int = wm.M_EMPTY) -> wm.Section:
        return wt.empty_section(mode, self.device)

    def encode(self, kind: int, sender: int, step: int, digest: int,
               sections: Sequence[wm.Section], itemsizes: Sequence[int]
               ) -> Tuple[Any, Dict[str, int]]:
        return wt.encode(kind, sender, step, digest, sections, itemsizes, self.device)

    def decode(self, buf: Any, **kw: Any) -> List[wm.Section]:
        return wt.decode(buf, **kw)

    def peek(self, buf: Any, who: str) -> int:
        return wt.peek(buf, who)

    def is_error(self, buf: Any) -> bool:
        return wt.is_error(buf)

    def host(self, buf: Any) -> np.ndarray:
        return buf.cpu().numpy() if isinstance(buf, torch.Tensor) else buf   # text: small

    def from_host(self, buf: np.ndarray) -> Any:
        return wt.from_host(buf, self.device)

    def gather(self, tr: Transport, buf: Any, root: int, bound: Optional[int]) -> Any:
        return tr.gather_tensor(buf, root=root, bound=bound)

    def broadcast(self, tr: Transport, buf: Any, root: int, bound: Optional[int]) -> Any:
        return tr.broadcast_tensor(buf, root=root, bound=bound, device=self.device)

    def gather_many(self, tr: Transport, bufs: Sequence[Any], roots: Sequence[int],
                    bounds: Sequence[Optional[int]]) -> Any:
        return tr.gather_many_tensor(bufs, roots, bounds)

    def broadcast_many(self, tr: Transport, buf: Any, roots: Sequence[int],
                       bounds: Sequence[Optional[int]]) -> List[Any]:
        return tr.broadcast_many_tensor(buf, roots, bounds, device=self.device)


def wire_path(transport: Transport, device: torch.device) -> WirePath:
    """The device path when ``transport`` takes tensor payloads on ``device``, else the host
    path."""
    return DevicePath(device) if transport.device_payloads(device) else HostPath()
