"""Exploration (docs/design.md §2, "Select"): seeded stratified sampling outside the core.

The ``M = d - len(core)`` coordinates outside the core are numbered by complement position
``p`` in ``[0, M)``. These positions are split into ``c`` contiguous strata of equal width (to
within one), and one position is drawn uniformly from each: distinct by construction, sorted,
O(c). A position maps back to its coordinate with one ``searchsorted`` against the core.

Integer strata cannot all have width exactly ``M / c``, so a fixed layout would favour the
positions of narrow strata (by up to 2x when ``M / c`` is near 1). The strata are therefore laid
out on the complement read as a ring, starting at a random rotation: every position then has
inclusion probability exactly ``c / M``, and each stratum still gets an independent pick.

Randomness comes only from a Philox counter-based generator keyed by ``key``, read as raw 64-bit
words (numpy keeps raw bit-generator streams stable across versions and machines), so a
receiver regenerates the same set from the same key and explored indices never travel.
"""
from __future__ import annotations

import threading
from typing import Sequence, Union

import numpy as np
import torch

from ..wire.indices import counting
from ..wire.recent import Recent
from .backend import use_torch

# Domain tag mixed into every key, so exploration streams never coincide with another use of
# the same (seed, role, rank, step, bucket) tuple elsewhere in the package.
_DOMAIN = 0x45585031   # "EXP1"

# The role tags of an exploration key: a worker's push slice and the server's pull slice draw
# from different streams even when the server's rank, step and bucket equal a worker's.
ROLE_PUSH, ROLE_PULL = 0, 1
_TIES = 0x54494553   # "TIES": the domain of tie_start's keys
_U53 = 2.0 ** -53


def _rng_words(key: Sequence[int], count: int) -> np.ndarray:
    """``count`` raw uint64 words of the Philox stream keyed by ``key``."""
    words = [_DOMAIN, len(key)]
    for v in key:
        v = int(v)
        if v < 0 or v >= 1 << 64:
            raise ValueError(f"explore: key entries must be in [0, 2**64), got {v} in {tuple(key)}")
        # Fixed two words per entry: SeedSequence alone would map (1, 2) and (1, 2, 0), or
        # (2**32,) and (0, 1), to the same pool.
        words += [v & 0xFFFFFFFF, v >> 32]
    # The same pool as from the list of ints (each is one 32-bit word), 3x cheaper to build.
    seed = np.random.SeedSequence(np.array(words, dtype=np.uint32)).generate_state(
        2, dtype=np.uint64)
    return _PHILOX.draw(seed, count)


class _Philox(threading.local):
    """One Philox generator per thread, rekeyed for each draw: the stream of a fresh
    ``np.random.Philox(key=seed)``, without building one (a quarter of the cost). Per thread,
    since a communication thread explores while the caller's thread may too."""

    def __init__(self) -> None:
        self.gen = np.random.Philox(key=np.zeros(2, dtype=np.uint64))
        self.zero4 = np.zeros(4, dtype=np.uint64)

    def draw(self, seed: np.ndarray, count: int) -> np.ndarray:
        # A fresh generator's state: counter 0, the key, and nothing buffered.
        self.gen.state = {"bit_generator": "Philox",
                          "state": {"counter": self.zero4, "key": seed},
                          "buffer": self.zero4, "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return np.asarray(self.gen.random_raw(count), dtype=np.uint64)


_PHILOX = _Philox()


def tie_start(key: Sequence[int]) -> int:
    """Where a selection keyed by ``key`` (e.g. ``(seed, step, bucket)``) starts taking the
    entries tied at its k-th value (:meth:`CoreSelector.select`'s ``ties``): a 63-bit draw
    from the same seeded Philox stream as exploration, so it changes every step and is the same
    on every rank and after a resume. Without it the lowest indices win every tie, and on a
    server summing float8 pushes tens of thousands tie at the threshold."""
    return int(_rng_words((_TIES,) + tuple(key), 1)[0] >> np.uint64(1))


def _uniform(raw: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from the top 53 bits of raw words (exact, platform independent)."""
    return (raw >> np.uint64(11)).astype(np.float64) * _U53


def _as_core(core: Union[torch.Tensor, np.ndarray], d: int) -> np.ndarray:
    """The core as int64 numpy, checked sorted, unique and within [0, d)."""
    c = core.detach().cpu().numpy() if isinstance(core, torch.Tensor) else np.asarray(core)
    if c.ndim != 1 or (c.size and not np.issubdtype(c.dtype, np.integer)):
        raise ValueError(f"explore: core must be a 1-D integer tensor, got {c.dtype} {c.shape}")
    c = c.astype(np.int64, copy=False)
    if c.size:
        if c[0] < 0 or c[-1] >= d:
            raise ValueError(f"explore: core indices must lie in [0, {d}), "
                             f"got range [{c[0]}, {c[-1]}]")
        if c.size > 1 and not np.all(c[1:] > c[:-1]):
            raise ValueError("explore: core must be sorted ascending without duplicates")
    return c


def _core_on_device(core: torch.Tensor, d: int) -> torch.Tensor:
    """The core as int64 on its own device, checked as :func:`_as_core` does (one host read of
    three scalars instead of a copy of the core)."""
    if core.dim() != 1 or (core.numel() and (core.is_floating_point() or core.is_complex())):
        raise ValueError(f"explore: core must be a 1-D integer tensor, got {core.dtype} "
                         f"{tuple(core.shape)}")
    c = core.detach().to(torch.int64)
    if c.numel():
        first, last, bad = torch.stack([c[0], c[-1], (c[1:] <= c[:-1]).sum()]).tolist()
        if first < 0 or last >= d:
            raise ValueError(f"explore: core indices must lie in [0, {d}), "
                             f"got range [{first}, {last}]")
        if bad:
            raise ValueError("explore: core must be sorted ascending without duplicates")
    return c


def _positions(key: Sequence[int], m: int, c: int) -> np.ndarray:
    """``c`` sorted complement positions in [0, m), stratified on a randomly rotated ring."""
    u = _uniform(_rng_words(key, c + 1))
    rot = min(int(u[0] * m), m - 1)   # ring rotation, uniform in [0, m)
    bounds = np.arange(c + 1, dtype=np.int64)
    if c * m < 1 << 62:
        bounds *= m
        bounds //= c              # exact integer stratum bounds
    else:                         # i * m would overflow int64: float bounds, still increasing
        bounds = np.floor(bounds * (m / c)).astype(np.int64)
        bounds[-1] = m
    lo = bounds[:-1]
    width = bounds[1:] - lo       # every width >= 1 since c <= m
    u = u[1:]
    u *= width
    pick = u.astype(np.int64)
    width -= 1
    np.minimum(pick, width, out=pick)
    pick += lo

    # Undo the rotation: positions >= m - rot wrap to the front. Both runs are ascending, so
    # the result is sorted by moving the wrapped tail ahead (no sort needed).
    pick += rot
    split = int(np.searchsorted(pick, m, side="left"))
    if split == c:
        return pick
    return np.concatenate([pick[split:] - m, pick[:split]])


def explore(d: int, core: torch.Tensor, k_e: int, key: Sequence[int], keep: bool = True
            ) -> torch.Tensor:
    """``min(k_e, d - len(core))`` distinct indices in [0, d) outside ``core``, ascending (int64).

    ``core``: sorted unique int64 indices. ``key``: non-negative ints, e.g.
    ``(seed, role, rank, step, bucket)``; the same key always gives the same output, on the
    core's device. A core on a GPU stays there: the random positions depend only on the key and
    the sizes, so they are drawn on the host and only they cross to the device. ``keep``: keep
    the result for a later call with the same key in this process (:data:`RECENT`); False
    where none will come, since keeping copies the core and the result (a third of the call
    for a 470k core).
    """
    d, k_e = int(d), int(k_e)
    if d < 0 or k_e < 0:
        raise ValueError(f"explore: need d >= 0 and k_e >= 0, got d={d}, k_e={k_e}")
    on_device = isinstance(core, torch.Tensor) and use_torch(core)
    cr = _core_on_device(core, d) if on_device else _as_core(core, d)
    m = d - len(cr)               # complement size
    c = min(k_e, m)
    if c <= 0:
        return torch.empty(0, dtype=torch.int64, device=cr.device if on_device else "cpu")
    memo = (d, k_e, tuple(int(v) for v in key), on_device)
    if c >= _RECALL_MIN:
        known = RECENT.get(memo, cr)
        if known is not None:
            return known
    out = _coordinates(cr, _positions(key, m, c), on_device)
    if keep and c >= _RECALL_MIN:
        RECENT.put(memo, cr, out)
    return out


# The exploration sets this process drew last: the server regenerates its own push's set, and
# the worker on the server's rank the pull's, which it drew as the sender (wire/recent.py).
RECENT = Recent(max_bytes=64 << 20)
_RECALL_MIN = 1024


def _coordinates(cr: Union[torch.Tensor, np.ndarray], pos: np.ndarray, on_device: bool
                 ) -> torch.Tensor:
    """The coordinates of complement positions ``pos`` outside the core ``cr``."""
    # Complement position p -> coordinate: p plus the number of core entries at or below it,
    # which is how many of ``core[j] - j`` (non-core coordinates before core[j]) are <= p.
    if on_device:
        p = torch.from_numpy(pos).to(cr.device)
        if cr.numel():
            gaps = cr - torch.arange(cr.numel(), dtype=torch.int64, device=cr.device)
            p = p + torch.searchsorted(gaps, p, right=True)
        return p
    if cr.size:
        gaps = cr - counting(cr.size)
        pos = pos + np.searchsorted(gaps, pos, side="right")
    return torch.from_numpy(pos)


def slice_indices(d: int, core: torch.Tensor, k_e: int, *, seed: int, role: int, rank: int,
                  step: int, bucket: int, device: torch.device, keep: bool = True
                  ) -> torch.Tensor:
    """A slice's coordinates on ``device``: ``core``, then its exploration set keyed by
    ``(seed, role, rank, step, bucket)`` (``role``: :data:`ROLE_PUSH` or :data:`ROLE_PULL`).

    The sender and every receiver call this with the same arguments, so the explored indices
    never travel. ``core`` is expected on ``device`` already; the result is not sorted (the
    core's entries come first). ``keep``: as :func:`explore`'s (True where this process will
    ask again: a worker on its own push's server rank, a server for its own worker's pull)."""
    return torch.cat([core, explore(d, core, k_e, (seed, role, rank, step, bucket),
                                    keep).to(device)])
