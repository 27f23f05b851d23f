#!/usr/bin/env python3
"""Compare two outputs of `make demo` (say this machine's and the image's) figure by figure.

    python3 scripts/compare_demo.py HOST.txt IMAGE.txt [--names host,image]

Both files hold what `make demo` printed (progress bars and launcher messages are skipped).
Compared: the caption line above the table (ranks, images, epochs, batch, lr) and every cell of
every row, matched by method, except timing columns (a header ending in " s", naming seconds or
time, or ms per something) and the caption's network: wall-clock times depend on the machine's
load and network, the accuracies and byte counts do not.
Prints the lines that differ, cell by cell; exit status 0 when the figures match, 1 when they
differ, 2 when a file holds no demo table.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

TIMING = re.compile(r"(^|\s)s$|seconds?|\btime\b|\bms/", re.IGNORECASE)
# The caption's last part names the network the run crossed (make demo picks the switched
# cluster as root, else the loopback): shown, not compared, like the timings it explains.
NETWORK = re.compile(r";\s*network:.*$")


@dataclass
class Table:
    """The first markdown table of a demo output, and the caption line printed above it."""
    caption: Optional[str]
    header: List[str]
    rows: Dict[str, List[str]] = field(default_factory=dict)   # first cell -> cells
    lines: Dict[str, str] = field(default_factory=dict)        # first cell -> the line as printed


def cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def is_separator(line: str) -> bool:
    return bool(re.fullmatch(r"\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?", line.strip()))


def parse(text: str) -> Optional[Table]:
    """The table in ``text``, or None when there is none. tqdm rewrites its bar with carriage
    returns, so those split lines too."""
    lines = [ln.rstrip() for ln in re.split(r"\r\n|\r|\n", text)]
    for i, line in enumerate(lines):
        if not (line.startswith("|") and i + 1 < len(lines) and is_separator(lines[i + 1])):
            continue
        caption = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), None)
        table = Table(caption=caption, header=cells(line))
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            values = cells(row)
            table.rows[values[0]] = values
            table.lines[values[0]] = row
        return table
    return None


def compare(a: Table, b: Table, names: Tuple[str, str]) -> Tuple[List[str], List[str]]:
    """(differences, ignored timing columns), each as lines for a person to read."""
    diffs: List[str] = []
    if NETWORK.sub("", a.caption or "") != NETWORK.sub("", b.caption or ""):
        diffs.append(f"caption:\n  {names[0]}: {a.caption}\n  {names[1]}: {b.caption}")
    if a.header != b.header:
        diffs.append(f"table header:\n  {names[0]}: {' | '.join(a.header)}\n"
                     f"  {names[1]}: {' | '.join(b.header)}")
        return diffs, []
    timing = [j for j, name in enumerate(a.header) if TIMING.search(name)]
    for key in list(a.rows) + [k for k in b.rows if k not in a.rows]:
        if key not in b.rows or key not in a.rows:
            where = names[1] if key not in b.rows else names[0]
            diffs.append(f"row {key}: missing from {where}'s output")
            continue
        bad = [f"{a.header[j]} {names[0]} {x}, {names[1]} {y}"
               for j, (x, y) in enumerate(zip(a.rows[key], b.rows[key]))
               if j not in timing and x != y]
        if bad:
            diffs.append(f"row {key}: " + "; ".join(bad) + f"\n  {names[0]}: {a.lines[key]}\n"
                         f"  {names[1]}: {b.lines[key]}")
    ignored = [f"{a.header[j]}: {names[0]} " + "/".join(r[j] for r in a.rows.values())
               + f", {names[1]} " + "/".join(r[j] for r in b.rows.values()) for j in timing]
    return diffs, ignored


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--names", default="host,image",
                   help="what to call the two outputs (default: host,image)")
    args = p.parse_args(argv)
    names = tuple(args.names.split(",", 1)) if "," in args.names else ("first", "second")
    tables = []
    for name, path in zip(names, (args.first, args.second)):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        table = parse(text)
        if table is None:
            last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "(empty)")
            print(f"compare_demo: no demo table in {path} ({name}): did `make demo` finish? "
                  f"Its last line: {last.strip()[:200]}", file=sys.stderr)
            return 2
        tables.append(table)
    diffs, ignored = compare(tables[0], tables[1], names)  # type: ignore[arg-type]
    note = f" (timing, not compared: {'; '.join(ignored)})" if ignored else ""
    if diffs:
        print(f"demo figures differ between {names[0]} and {names[1]}:")
        for d in diffs:
            print(f"- {d}")
        print(f"everything else compared is equal{note}")
        return 1
    columns = [h for h in tables[0].header[1:] if not TIMING.search(h)]
    print(f"demo figures match between {names[0]} and {names[1]}: caption and "
          f"{len(tables[0].rows)} rows ({', '.join(tables[0].rows)}), columns "
          f"{', '.join(columns)}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
