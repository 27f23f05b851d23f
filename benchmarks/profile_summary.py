"""Summarise py-spy raw profiles written by ``python -m benchmarks.run --profile DIR``.

    python -m benchmarks.profile_summary DIR [--under SlimExchange.step] [--top 25]

For each ``<peers>.rank<r>.txt`` file (collapsed stacks: ``frame;frame;... count``), prints the
functions with the largest inclusive share of the samples whose stack passes through ``--under``
(default: the whole optimizer step), and their self (leaf) share.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
from typing import Dict, List, Tuple

FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``file.py:func``; the line is dropped so a function's
    samples add up across lines."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    parts = m.group("file").split("/")
    return f"{'/'.join(parts[-2:])}:{m.group('fn')}"


def load(path: str) -> List[Tuple[List[str], int]]:
    stacks = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            head, _, count = line.rstrip("\n").rpartition(" ")
            if head and count.isdigit():
                stacks.append(([_short(fr) for fr in head.split(";")], int(count)))
    return stacks


def summarise(stacks: List[Tuple[List[str], int]], under: str, top: int) -> List[str]:
    total = sum(c for _, c in stacks)
    inside = [(fr[next(i for i, f in enumerate(fr) if under in f):], c) for fr, c in stacks
              if any(under in f for f in fr)]
    n = sum(c for _, c in inside)
    incl: Dict[str, int] = collections.Counter()
    self_: Dict[str, int] = collections.Counter()
    for frames, c in inside:
        for f in set(frames):
            incl[f] += c
        self_[frames[-1]] += c
    out = [f"  {n} of {total} samples ({100 * n / max(total, 1):.0f}%) are under '{under}'",
           f"  {'incl%':>6} {'self%':>6}  function"]
    for f, c in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {100 * c / max(n, 1):6.1f} {100 * self_[f] / max(n, 1):6.1f}  {f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--under", default="worker.py:run_peer",
                    help="only stacks through a frame containing this text")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, "*.rank*.txt"))):
        print(os.path.basename(path))
        print("\n".join(summarise(load(path), args.under, args.top)))


if __name__ == "__main__":
    main()
