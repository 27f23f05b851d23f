"""Where an hvd_slim step's time goes, per rank: the results table of ``comm_stats()``'s phase
timings, which the workers record in every measured step (``rank_phase_steps_s``).

The phases are the step's order (docs/design.md §2): *prepare* (compensate, select, encode the
push), *push* (the gather: the wire, and the wait for the slowest rank), *serve* (a server's
aggregation and pull selection), *pull* (the broadcast: the wire, and the wait for the server)
and *apply*. Prepare, serve and apply are this rank's CPU work; push and pull are mostly
waiting. A server's push is its wait for every other rank's push, a worker's its own send.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List

from hvd_slim.exchange.stats import ExchangeStats

PHASES = ExchangeStats.PHASES


def medians(per_step: List[Dict[str, float]]) -> Dict[str, float]:
    """Median seconds of each phase over one rank's measured steps."""
    return {ph: statistics.median(s.get(ph, 0.0) for s in per_step) for ph in PHASES}


def phase_rows(name: str, peer: Dict[str, Any], server_rank: int = 0) -> List[str]:
    """Markdown rows for one peer: its server rank, and the median over the other ranks of
    each phase's per-rank median (ms per step); [] when it recorded no phases."""
    ranks = peer.get("rank_phase_steps_s") or []
    if peer.get("status") != "ok" or not ranks:
        return []
    per_rank = [medians(steps) for steps in ranks]

    def row(who: str, ms: Dict[str, float]) -> str:
        return f"| {name} | {who} | " + " | ".join(f"{1e3 * ms[ph]:.1f}" for ph in PHASES) + \
            f" | {1e3 * sum(ms.values()):.1f} |"

    out = [row(f"rank {server_rank} (server)", per_rank[server_rank])]
    others = [m for r, m in enumerate(per_rank) if r != server_rank]
    if others:
        out.append(row(f"other {len(others)} (median)",
                       {ph: statistics.median(m[ph] for m in others) for ph in PHASES}))
    return out


def table(res: Dict[str, Any]) -> List[str]:
    """The phases table of a results file's hvd_slim peers (markdown lines, [] when none
    recorded phases). ``servers=N`` peers serve on every rank; rank 0 is shown first."""
    rows = [r for name, p in res.get("peers", {}).items() if name.startswith("hvd_slim")
            for r in phase_rows(name, p)]
    if not rows:
        return []
    return ["hvd_slim's phases, ms per step (each rank's median over the measured steps; "
            "`comm_stats()`'s `<phase>_seconds`): prepare, serve and apply are CPU work, push "
            "and pull mostly waiting on the wire or on other ranks.", "",
            "| peer | rank | prepare | push | serve | pull | apply | sum |",
            "|---|---|---:|---:|---:|---:|---:|---:|", *rows, ""]
