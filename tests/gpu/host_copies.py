"""Count the device-to-host copies Python code makes, with their sizes, for the GPU tier's "no
payload through host memory" checks.

Inside ``with HostCopies(cuda=True) as seen:`` every ``Tensor.cpu``, ``Tensor.to`` (to the host),
``Tensor.copy_`` (GPU -> host), ``Tensor.numpy``, ``Tensor.tolist``, ``Tensor.item`` and
``Tensor.__array__`` whose source is a CUDA tensor is recorded as ``(op, bytes)``. With
``cuda=False`` (the same checks on CPU tensors, where a GPU is missing) every tensor -> numpy or
list conversion is recorded instead: on the device path those are the only way bytes could leave
"the device".

Scalar reads inside C++ (``float(t)``, ``bool(t)``, ``torch.nonzero``'s count) are not seen;
they are a few bytes each. What matters is that no copy is as large as a payload section.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostCopies:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seen: List[Tuple[str, int]] = []
        self._saved: List[Tuple[str, Any]] = []

    def _src(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (t.is_cuda if self.cuda else True)

    def __enter__(self) -> List[Tuple[str, int]]:
        T, seen, src = torch.Tensor, self.seen, self._src

        def wrap_result(name: str):   # recorded when a GPU tensor comes back on the host
            real = getattr(T, name)

            def spy(self, *a, **k):
                out = real(self, *a, **k)
                if self.is_cuda and isinstance(out, torch.Tensor) and not out.is_cuda:
                    seen.append((name, _nbytes(self)))
                return out
            return real, spy

        def wrap_always(name: str):   # a conversion out of torch (numpy, list, Python number)
            real = getattr(T, name)

            def spy(self, *a, **k):
                if src(self):
                    seen.append((name, _nbytes(self)))
                return real(self, *a, **k)
            return real, spy

        real_copy = T.copy_

        def copy_spy(self, other, *a, **k):
            if isinstance(other, torch.Tensor) and other.is_cuda and not self.is_cuda:
                seen.append(("copy_", _nbytes(other)))
            return real_copy(self, other, *a, **k)

        patches = {"copy_": (real_copy, copy_spy)}
        if self.cuda:
            patches.update({n: wrap_result(n) for n in ("cpu", "to")})
        patches.update({n: wrap_always(n) for n in ("numpy", "tolist", "item", "__array__")})
        for name, (real, spy) in patches.items():
            self._saved.append((name, real))
            setattr(T, name, spy)
        return seen

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._saved:
            setattr(torch.Tensor, name, real)
        self._saved.clear()


def metadata_limit(n_buckets: int, size: int) -> int:
    """The most bytes one legitimate host read takes on the device path: a message's header and
    section table (32 + 16 per bucket), or the gathered frames' length words (8 per rank)."""
    return max(32 + 16 * n_buckets, 8 * size)
