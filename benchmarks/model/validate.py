"""Predictions against a benchmark results JSON (``benchmarks.run``'s ``<tag>.json``).

The inputs taken from a file, and where each comes from, are :mod:`.inputs`' (each table's
preamble lists them).

Measured local work (``--local-from CALIB.json ...``): the derived pass cost badly underestimates
what 4 or 8 ranks sharing 2 cores spend on each peer's O(d) work (fp8 encoding and scatters,
the reduction arithmetic inside MPI's and Gloo's collectives, PowerSGD's matrix products). A
calibration run measures it: the same peers, model and rank count on the unshaped loopback.
For a results file, the calibration with the same ``settings.model``, ``settings.ranks`` and
``settings.ranks_per_host`` is taken (none, or more than one: an error), and for each peer
that ran in both

    added local work = calibration median - comm_model(peer, calibration network)
                       - the calibration's floor median
    predicted        = this file's floor median + added * load
                       + comm_model(peer, this file's network)

where the calibration network is read like any other file: a loopback is a shared link at its
measured pingpong rate (``network.pingpong``; every byte any rank sends is copied through the
one kernel, on the same 2 cores, so the ranks share that rate), with the file's latency or
the inputs' documented constant, and no token bucket. A negative difference would be clipped
to 0 (the table shows both terms). Peers missing from the calibration keep the derived local
work, and the table marks each peer's compute + local as (m) measured or (d) derived.

**The load index** (``load``, one number per file, :func:`.calibration.load_index`). Each
peer is its own ``mpirun`` job, and the calibration ran minutes from the file's jobs: the
machine's speed for
the same O(d) work drifted between them (other processes, the host; in the one sitting of
``cluster_rerun`` the floor, identical work, took 0.027 to 0.048 s). Both runs time one piece
of that work on its own, outside the step's wire time: the selection (``select_ms_per_step``,
hvd_slim's and top-k's, every rank, every step), which the model already takes as measured.
``load`` is the median, over the peers with a selection in both runs, of (this file's
selection / the calibration's): how much faster or slower the same CPU work ran in this file's
sitting. A ratio counts only when both runs ran the same selection code (hvd_slim's by
``machine.hvd_slim_sha256``, top-k's torch.topk by ``machine.torch``): the timings of two
versions of a selector measure the change of code, not the machine's load. It scales every
peer's calibrated added local work. The median keeps one job's drift from setting the file's
(the floors' ratio, one job of 8 steps, moved by 77% within a sitting).
``--no-load-correction`` sets ``load`` to 1.

**Compute is this file's floor**, as without a calibration: the model takes compute time as an
input, and the floor (the same forward/backward or gradient writes, no exchange) is its
measurement in the same sitting. Only what a peer adds to the floor comes from the
calibration. The floor is then an input, not scored. (The history of these rules, with the
misses each one removed: docs/performance.md, "The cost model".)

Nothing is fitted to a step time: the inputs from the calibration are one number per peer (and
for hvd_slim's single server its ranks' measured ready times, below) and one per file, and the
model's own communication time on the loopback (small there: tens of Gbit/s) is what is
removed. The load index is measured in the validated file itself, as the floor and the
selections are without --local-from: the predictions know the file's CPU speed, not its step
times.

**Horovod over a real backward overlaps** (:mod:`.overlap`): its allreduces start as the
gradients come in (the floor's measured ``backward_profile``), and the step is the later of
the CPU path (this file's floor + the calibrated added work x load) and the wire path (the
floor + the wire's end past ``backward()``); its added work is the calibration's median minus
its floor, the loopback's wire being hidden behind that backward.

Otherwise wire time and CPU work *add*: every other peer exchanges after its backward, and
the CPU work in the exchange sits in its critical path: hvd_slim encodes before its push and
the server aggregates and selects after the gather, top-k selects before its allgather, MPI
reduces between Rabenseifner's steps and Gloo each received ring chunk before forwarding it,
and PowerSGD's products separate its allreduces. With 4 or 8 ranks on 2 cores there is no spare
core to hide one behind the other.

**hvd_slim's pushes queue at the server's NIC** (:mod:`.push_queue`). Where the ranks
outnumber the cores they are not ready to push together: each one's prepare phase
(compensate, select, encode) time-shares the cores, and their ends spread over 10-20 ms at 8
ranks on 2 cores (cnn1m). A push leaves when its rank is ready, so the early pushes cross the
server's NIC while the late ranks still compute, and the push adds only how long after the last
rank is ready the last push lands. The ready times are the calibration's: every rank's
``prepare`` seconds in every measured step (``rank_phase_steps_s``, from ``comm_stats()``'s
phase timings), times the load index; each step is queued on its own and the median taken,
on the calibration's network (where it is nearly nothing, as before) and on this file's. A
calibration without them (before 4 December evening) gives the plain gather, every push at
once, which counted the hidden part of the push twice (single-server cnn1m steps at 4 and 8
hosts predicted +11% to +34% slow).

With a core per rank the ranks are ready together and the queue is the plain gather, which is
what the extrapolation (no measured ready times) assumes.

What is still added in full: the pull. Its binomial broadcast reaches the ranks round by round,
and a rank that has its pull may apply it while later ranks still wait on the wire, which would
hide part of the apply. The per-rank phases show that part small here (2-4 ms of apply a rank
against 4 ms a broadcast round at 100 Mbit/s), and it is not modelled. The sharded exchange
pushes to every root at once and keeps the plain phase.

A peer whose ``|error|`` exceeds the tolerance makes the command exit 1 (exit 2: a file without
a calibration under --local-from).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .calibration import (Calibration, calibration_for, floor_median, load_calibration,
                          load_index, selection_s, succeeded)
from .inputs import Inputs, inputs_of, local_costs_of
from .push_queue import Ready, ready_times, scaled
from .scenario import Prediction
from .strategies import parse, predict
from .tables import LEGEND_BYTES, LEGEND_CALIBRATED, LEGEND_DERIVED, net_words, table

__all__ = ["Calibration", "Row", "calibration_for", "inputs_of", "load_calibration",
           "load_index", "local_costs_of", "main", "report", "rows_of"]


@dataclass
class Row:
    peer: str
    measured: float
    pred: Prediction         # the model on the file's own network (comm, bytes, derived local)
    error: float             # seconds / measured - 1
    peer_rec: Dict[str, Any]
    seconds: float = 0.0     # the prediction: pred.seconds, or load * calibrated local + comm
    # With a calibration: (its median, the model's communication on its network); local work
    # = max(0, median - communication).
    calib: Optional[Tuple[float, float]] = None
    load: float = 1.0        # the file's load index (see the module docstring)
    # With a calibration: (this file's floor median, the calibration's), the compute input.
    floors: Tuple[float, float] = (0.0, 0.0)

    @property
    def overlapped(self) -> bool:
        """Whether the wire overlaps the backward (Horovod over a real one, :mod:`.overlap`)."""
        return bool(self.pred.detail.get("overlapped"))

    @property
    def local_m(self) -> Optional[float]:
        """The calibrated work this peer adds to the floor (None: no calibration). Overlapped,
        the calibration's wire is hidden behind its backward (tens of Gbit/s), so all it adds
        to its floor is local work."""
        if self.calib is None:
            return None
        comm = 0.0 if self.overlapped else self.calib[1]
        return max(0.0, self.calib[0] - comm - self.floors[1])


def push_ready(peer: str, calib_peer: Dict[str, Any], ranks: int) -> Ready:
    """The calibration's measured push readiness (:func:`.push_queue.ready_times`) for a flat
    hvd_slim peer (one server NIC); () for any other peer or a failed run."""
    try:
        flat = parse(peer)[0] == "hvd_slim"
    except ValueError:
        return ()
    return ready_times(calib_peer, ranks) if flat and succeeded(calib_peer) else ()


def rows_of(res: Dict[str, Any], inp: Inputs, calib: Optional[Calibration] = None,
            load: float = 1.0) -> List[Row]:
    """One row per modelled peer that ran. With ``calib``, a peer that also ran there is
    predicted as its calibrated local work times ``load`` plus the model's communication on
    ``res``'s network; the others keep the derived local work."""
    cal_peers = calib.res.get("peers", {}) if calib else {}
    floors = (floor_median(res), floor_median(calib.res) if calib else 0.0)
    out = []
    for name, p in res.get("peers", {}).items():
        if not succeeded(p):
            continue
        try:
            parse(name)
        except ValueError:
            continue
        c = cal_peers.get(name) or {}
        ready = push_ready(name, c, calib.inputs.scenario.ranks) if calib is not None else ()
        here_sc = replace(inp.scenario, push_ready=scaled(ready, load))
        pred = predict(name, here_sc, selection_s(p))
        row = Row(name, p["median_s"], pred, 0.0, p, pred.seconds)
        if calib is not None and succeeded(c):
            there = predict(name, replace(calib.inputs.scenario, push_ready=ready), selection_s(c))
            row.calib, row.load, row.floors = (float(c["median_s"]), there.comm_s), load, floors
            added = row.local_m * load
            # overlapped: the later of the CPU path and the wire path (.overlap)
            row.seconds = floors[0] + (max(added, pred.comm_s) if row.overlapped
                                       else added + pred.comm_s)
        row.error = row.seconds / row.measured - 1
        out.append(row)
    return out


def _calibration_notes(res: Dict[str, Any], inp: Inputs, calib: Calibration, rows: List[Row],
                       load: float, over: List[str], corrected: bool) -> List[str]:
    sc, csc = inp.scenario, calib.inputs.scenario
    n_m = sum(r.calib is not None for r in rows)
    text = [f"- measured: compute + local of {n_m} of {len(rows)} peers from {calib.path} "
            f"({net_words(csc)}): its median minus the model's communication there, times the "
            "load index; added to the communication modelled here (see validate's docstring)"]
    if not corrected:
        text.append("- load index: not applied (--no-load-correction)")
    elif over:
        peers = f"{len(over)} peer{'s' if len(over) > 1 else ''}"
        text.append(f"- measured: load index {load:.3f}, the median of this file's selection "
                    f"time over the calibration's for {peers} ({', '.join(over)})")
    else:
        text.append("- load index: 1 (no peer has a selection timed in both runs by the same "
                    "code)")
    text += [f"- calibration: {n}" for n in calib.inputs.notes
             if not n.startswith("measured: compute")]
    if csc.slim != sc.slim:
        text.append(f"- warning: hvd_slim settings differ (calibration {csc.slim}, here "
                    f"{sc.slim}): its calibrated local work is for the former's sizes")
    mine, theirs = res.get("machine") or {}, calib.res.get("machine") or {}
    if mine.get("hvd_slim_sha256") != theirs.get("hvd_slim_sha256"):
        text.append(f"- warning: hvd_slim's code differs (sha256 {mine.get('hvd_slim_sha256')} "
                    f"here, {theirs.get('hvd_slim_sha256')} in the calibration)")
    return text


def report(path: str, tolerance: float, calibs: Optional[Sequence[Calibration]] = None,
           corrected: bool = True) -> Tuple[str, List[Row]]:
    """(Markdown for one results file, its rows beyond ``tolerance``). ``calibs``: the
    --local-from files, one of which must match (:func:`calibration_for`); ``corrected``: apply
    the load index."""
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    inp = inputs_of(res)
    calib = calibration_for(res, calibs, path) if calibs is not None else None
    load, over = load_index(res, calib) if calib is not None else (1.0, [])
    if not corrected:
        load = 1.0
    rows = rows_of(res, inp, calib, load)
    sc = inp.scenario
    text = [f"### {path}", "",
            f"{net_words(sc)}, model {res['settings'].get('model')} (d = {sc.d}).", ""]
    text += [f"- {n}" for n in inp.notes]
    if calib is not None:
        text += _calibration_notes(res, inp, calib, rows, load, over, corrected)
    legend = LEGEND_CALIBRATED if calib is not None else LEGEND_DERIVED
    text += ["", table(rows, calib is not None), "", legend + LEGEND_BYTES, ""]
    # The floor is an input (its prediction is itself).
    scored = [r for r in rows if r.peer != "floor"]
    bad = [r for r in scored if abs(r.error) > tolerance]
    worst = max(scored, key=lambda r: abs(r.error), default=None)
    if worst is not None:
        text.append(f"max |error| {100 * abs(worst.error):.1f}% ({worst.peer}); "
                    f"{len(scored) - len(bad)} of {len(scored)} peers within, {len(bad)} "
                    f"beyond {100 * tolerance:g}%"
                    + (": " + ", ".join(r.peer for r in bad) if bad else ""))
    return "\n".join(text) + "\n", bad


def main(paths: Sequence[str], tolerance: float, local_from: Optional[Sequence[str]] = None,
         corrected: bool = True) -> int:
    """Print every file's table; 1 if any peer is beyond ``tolerance``, 2 if a file has no
    calibration among ``local_from`` (checked before anything is printed), else 0."""
    calibs = None
    if local_from:
        calibs = [load_calibration(c) for c in local_from]
        try:
            for path in paths:
                with open(path, encoding="utf-8") as f:
                    calibration_for(json.load(f), calibs, path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    failed = False
    for path in paths:
        text, bad = report(path, tolerance, calibs, corrected)
        print(text)
        failed = failed or bool(bad)
    return 1 if failed else 0
