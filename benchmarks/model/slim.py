"""The bytes of one steady-state hvd_slim step: the push every worker sends and the pull the
server broadcasts, built from hvd_slim's own size functions (layout.slice_sizes, the index
codec's bound, the wire's header and table entry), so that the model follows the code.

A message is the transport's 8-byte length word, a 32-byte header, a 16-byte table entry per
bucket (one dense bucket of the tensors under ``min_compress_numel``, one compressed bucket),
the dense values at the comm dtype (fp32), and the compressed bucket's section:

* push: ``k`` values of ``value_bits`` and the core's ``k_core = k - round(exploration * k)``
  indices, Elias-Fano or a bitmap, whichever is smaller (the explored ones are regenerated from
  the seed, never sent); the core's indices travel every step.
* pull ``slim``: the same for the server's ``k_pull`` slice (``pull_density``).
* pull ``union``: the exact aggregate at every coordinate any worker pushed, at the comm dtype,
  with explicit indices, or dense when that is no smaller. The union of ``n`` pushes of ``k`` of
  ``d`` coordinates is modelled as independent selections, ``d (1 - (1 - k/d)^n)``: what
  uncorrelated gradients give (the benchmark's synthetic ones are within 2% of it); correlated
  real gradients overlap more, so this is an upper bound there.

A slice that would not be smaller than dense is sent dense (hvd_slim's dense fallback).
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence

from hvd_slim.config import default_pull_density
from hvd_slim.exchange.layout import slice_is_smaller, slice_sizes
from hvd_slim.transport.base import LENGTH_BYTES
from hvd_slim.wire.index_codec import index_bytes_bound
from hvd_slim.wire.message import ENTRY, HEADER

# Before commit 7d9042f (value_bits) sliced values were the comm dtype (fp32), the default
# density 0.01 and the pull max(density, min(4 density, 0.004)).
DEFAULTS_CHANGED_AT = "7d9042f"
PULL_RULES = ("current", "v1")


def pull_density_of(density: float, rule: str = "current") -> float:
    """The default pull density: hvd_slim's ``default_pull_density`` (rule "current"), or the
    rule before 7d9042f (``"v1"``)."""
    if rule == "current":
        return default_pull_density(density)
    if rule == "v1":
        return max(density, min(4.0 * density, 0.004))
    raise ValueError(f"pull rule must be one of {PULL_RULES}, got {rule!r}")


@dataclass(frozen=True)
class SlimSettings:
    """The hvd_slim keywords that size a step (defaults: hvd_slim's current ones)."""

    density: float = 0.02
    pull: str = "slim"
    pull_density: Optional[float] = None     # None: the default rule below
    pull_rule: str = "current"
    value_bits: int = 8
    exploration: float = 0.1
    min_compress_numel: int = 4096
    server_rank: int = 0

    @property
    def effective_pull_density(self) -> float:
        return self.pull_density if self.pull_density is not None else \
            pull_density_of(self.density, self.pull_rule)


V1_DEFAULTS = SlimSettings(density=0.01, pull_rule="v1", value_bits=32)

# HVD_SLIM_<NAME> variables a benchmark run may have set (settings.env), and their types.
_ENV = {"DENSITY": ("density", float), "PULL_DENSITY": ("pull_density", float),
        "VALUE_BITS": ("value_bits", int), "EXPLORATION": ("exploration", float),
        "MIN_COMPRESS_NUMEL": ("min_compress_numel", int),
        "SERVER_RANK": ("server_rank", int)}


def defaults_at(commit: Optional[str], repo: Optional[str] = None) -> Optional[SlimSettings]:
    """hvd_slim's defaults at ``commit`` (the benchmark's ``machine.git_commit``): the current
    ones if it contains 7d9042f, :data:`V1_DEFAULTS` if not; None when git cannot tell."""
    if not commit:
        return None
    repo = repo or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        res = subprocess.run(["git", "-C", repo, "merge-base", "--is-ancestor",
                              DEFAULTS_CHANGED_AT, commit], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: SlimSettings(), 1: V1_DEFAULTS}.get(res.returncode)


def with_env(base: SlimSettings, env: Sequence[str]) -> SlimSettings:
    """``base`` with the ``HVD_SLIM_<NAME>=value`` entries of ``env`` applied."""
    changes: Dict[str, object] = {}
    for kv in env:
        key, _, value = kv.partition("=")
        name = key[len("HVD_SLIM_"):] if key.startswith("HVD_SLIM_") else None
        if name in _ENV:
            field_name, typ = _ENV[name]
            changes[field_name] = None if value.lower() in ("", "none") else typ(value)
    return replace(base, **changes)


@dataclass(frozen=True)
class SlimBytes:
    """Sizes of one steady-state step (bytes, length word included) and the slice sizes."""

    d: int                 # compressed coordinates
    dense: int             # coordinates of the dense bucket
    k: int
    k_core: int
    k_pull: int
    k_pull_core: int
    push: float            # every worker's push
    pull: float            # the server's broadcast
    pull_coords: float     # compressed coordinates the pull carries (union: its expected size)
    pull_mode: str         # "slice", "explicit" (union) or "dense"
    push_mode: str         # "slice" or "dense" (the dense fallback)


def _section(d: int, k: int, k_core: int, vbytes: int) -> float:
    """A compressed bucket's section: the slice, or all of it dense when no smaller."""
    if not slice_is_smaller(d, k, k_core, vbytes, 4):
        return 4.0 * d
    return k * vbytes + index_bytes_bound(d, k_core)


def union_size(d: int, k: int, n: int) -> float:
    """Expected size of the union of ``n`` independent ``k``-subsets of ``d`` coordinates."""
    return d * (1.0 - (1.0 - k / d) ** n) if d else 0.0


def step_bytes(d: int, dense: int, n: int, s: SlimSettings) -> SlimBytes:
    """Push and pull sizes for ``d`` compressed and ``dense`` dense fp32 coordinates, ``n``
    ranks and settings ``s``."""
    vbytes = s.value_bits // 8
    buckets = int(d > 0) + int(dense > 0)
    fixed = LENGTH_BYTES + HEADER.size + ENTRY.size * buckets + 4 * dense
    k = kc = kp = kpc = 0
    push = pull = float(fixed)
    coords, mode, push_mode = 0.0, "dense", "dense"
    if d:
        k, kc, _ = slice_sizes(d, s.density, s.exploration)
        kp, kpc, _ = slice_sizes(d, s.effective_pull_density, s.exploration)
        push += _section(d, k, kc, vbytes)
        if not slice_is_smaller(d, k, kc, vbytes, 4):     # dense fallback: an exact average
            pull += 4.0 * d
            coords = float(d)
        elif s.pull == "union":
            push_mode = "slice"
            u = union_size(d, k, n)
            explicit = 4.0 * u + index_bytes_bound(d, int(round(u)))
            mode = "explicit" if explicit < 4.0 * d else "dense"
            coords = u if mode == "explicit" else float(d)
            pull += min(explicit, 4.0 * d)
        else:
            push_mode = "slice"
            pull += _section(d, kp, kpc, vbytes)
            mode = "slice" if slice_is_smaller(d, kp, kpc, vbytes, 4) else "dense"
            coords = float(kp if mode == "slice" else d)
    return SlimBytes(d, dense, k, kc, kp, kpc, push, pull, coords, mode, push_mode)
