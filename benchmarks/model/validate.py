"""Predictions against a benchmark results JSON (``benchmarks.run``'s ``<tag>.json``).

Inputs, and where each comes from (the table's preamble repeats them per file):

* measured: ranks and model (``settings``); the link (``network``: ``mode``, ``rate_gbit`` per
  host, ``ranks_per_host``, ``latency_ms``; older files: ``settings.net``, "tbf1g" = a shared
  1 Gbit/s link, "tbf10g" 10, "loopback"); the achieved rate (``network.pingpong``, as a share
  of the nominal one); compute (the ``floor`` peer's median); each peer's selection
  (``select_ms_per_step``); hvd_slim's settings (the defaults at ``machine.git_commit``,
  ``settings.env``'s HVD_SLIM_* variables).
* derived: the cost of one streaming pass per element, the floor over its
  :data:`~.strategies.FLOOR_PASSES` passes of d elements.
* documented constants: :data:`LATENCY_S` where the file has no latency, no per-message
  overhead, Ethernet framing and TCP ACKs on switched NIC counters (net.ETH_*).

Measured local work (``--local-from CALIB.json ...``): the derived pass cost badly underestimates
what 4 or 8 ranks sharing 2 cores spend on each peer's O(d) work (fp8 encoding and scatters,
the reduction arithmetic inside MPI's and Gloo's rings, PowerSGD's matrix products). A
calibration run measures it: the same peers, model and rank count on the unshaped loopback.
For a results file, the calibration with the same ``settings.model``, ``settings.ranks`` and
``settings.ranks_per_host`` is taken (none, or more than one: an error), and for each peer
that ran in both

    local (compute + local work) = calibration median - comm_model(peer, calibration network)
    predicted                    = local + comm_model(peer, this file's network)

where the calibration network is read like any other file: a loopback is a shared link at its
measured pingpong rate (``network.pingpong``; every byte any rank sends is copied through the
one kernel, on the same 2 cores, so the ranks share that rate), with the file's latency or
:data:`LATENCY_S`. A negative difference would be clipped to 0 (the table shows both terms).
Peers missing from the calibration keep the derived local work, and the table marks each
peer's compute + local as (m) measured or (d) derived. Nothing is tuned against the file being
validated: the only input taken from a calibration is one number per peer, and the model's
own communication time on the loopback (small there: tens of Gbit/s) is what is removed.

Wire time and CPU work *add*: every peer here exchanges after its backward, and the CPU work in
the exchange sits in its critical path: hvd_slim encodes before its push and the server
aggregates and selects after the gather, top-k selects before its allgather, MPI and Gloo reduce
each received ring chunk before forwarding it, and PowerSGD's products separate its
allreduces. With 4 or 8 ranks on 2 cores there is no spare core to hide one behind the other.
Open MPI's ring does overlap the reduction of one chunk with the next chunk's receive, so for
the dense rings the sum is an upper bound; no factor for that is applied.

Nothing is fitted to a peer's time. A peer whose ``|error|`` exceeds the tolerance makes the
command exit 1 (exit 2: a file without a calibration under --local-from).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import net as nw
from .slim import SlimSettings, defaults_at, with_env
from .strategies import (FLOOR_PASSES, SMALL_NUMEL, LocalCosts, Prediction, Scenario, parse,
                         predict)
from .workloads import numel, shapes_of, split

RATE_GBIT = {"tbf1g": 1.0, "tbf10g": 10.0, "loopback": 20.0}   # benchmarks.run's nominal rates
MODE_OF_NET = {"tbf1g": "shared", "tbf10g": "shared", "loopback": "loopback"}
# One-way latency of a message when the file does not say: Open MPI's TCP BTL over a Linux
# loopback is some 10-30 us; 4 ranks on 2 cores add scheduling delay. Not measured; at most a
# millisecond of any step modelled here.
LATENCY_S = 50e-6


@dataclass
class Inputs:
    """A results file as the model's inputs, and notes on where each came from."""

    scenario: Scenario
    notes: List[str]


def _rates(netw: Dict[str, Any], settings: Dict[str, Any], mode: str) -> Tuple[float, ...]:
    given = netw.get("rate_gbit")
    if given is None:
        given = RATE_GBIT.get(settings.get("net", ""), 1.0)
    rates = given if isinstance(given, list) else [given]
    return tuple(1e9 * float(r) for r in rates)


def inputs_of(res: Dict[str, Any]) -> Inputs:
    """The :class:`Scenario` a results file describes (see the module docstring)."""
    settings, netw = res.get("settings", {}), res.get("network", {}) or {}
    n = int(settings["ranks"])
    notes: List[str] = []
    mode = netw.get("mode") or MODE_OF_NET.get(settings.get("net", ""), "shared")
    if "mode" not in netw:
        notes.append(f"topology {mode!r} inferred from settings.net={settings.get('net')!r}")
    rates = _rates(netw, settings, mode)
    hosts = int(netw.get("hosts") or (1 if mode != "switched" else n))
    rph = int(netw.get("ranks_per_host") or max(1, n // max(hosts, 1)))
    pp = (netw.get("pingpong") or {}).get("gbit_per_s")
    eff = 1.0
    if pp and mode == "switched" and rph > 1:
        # Ranks 0 and 1 share a host (ranks fill hosts in order): the pingpong never saw a NIC.
        notes.append(f"pingpong {pp:.3f} Gbit/s ignored: ranks 0 and 1 share a host")
        pp = None
    if pp:
        nominal = min(rates[:2]) if mode == "switched" and len(rates) > 1 else rates[0]
        if mode == "loopback":        # an unshaped loopback: the pingpong is the link's rate
            rates, eff = (1e9 * pp,), 1.0
        else:
            eff = min(1.0, 1e9 * pp / nominal)
        notes.append(f"measured: pingpong {pp:.3f} Gbit/s (efficiency {eff:.3f})")
    lat_ms = netw.get("latency_ms")
    latency = LATENCY_S if lat_ms is None else float(lat_ms) / 1e3
    notes.append(("measured" if lat_ms is not None else "documented constant") +
                 f": one-way latency {latency * 1e6:.0f} us")
    eth = mode == "switched"   # eth0 counters see framing and ACKs; a loopback's lo barely
    net = nw.Network(mode, rates, latency_s=latency, efficiency=eff, ranks_per_host=rph,
                     frame_overhead=nw.ETH_FRAME_OVERHEAD if eth else 1.0,
                     ack_overhead=nw.ETH_ACK_OVERHEAD if eth else 0.0)
    shapes = tuple(shapes_of(settings["model"]))
    floor = (res.get("peers", {}).get("floor") or {}).get("median_s")
    compute = float(floor) if floor else 0.0
    d = numel(shapes)
    pass_s = compute / (FLOOR_PASSES * d) if d else 0.0
    notes.append(f"measured: compute = floor median {compute:.4f} s; derived: one pass "
                 f"= floor / ({FLOOR_PASSES} d) = {pass_s * 1e9:.2f} ns per element")
    commit = (res.get("machine") or {}).get("git_commit")
    slim = defaults_at(commit)
    if slim is None:
        slim = SlimSettings()
        notes.append(f"hvd_slim defaults: current ones (git cannot place commit {commit!r})")
    else:
        notes.append(f"hvd_slim defaults at commit {str(commit)[:7]}: value_bits "
                     f"{slim.value_bits}, pull rule {slim.pull_rule!r}")
    slim = with_env(slim, settings.get("env") or [])
    sc = Scenario(n, net, shapes, compute_s=compute, local=LocalCosts(pass_s=pass_s), slim=slim)
    return Inputs(sc, notes)


def local_costs_of(res: Dict[str, Any], density: float = 0.01) -> LocalCosts:
    """Per-element local costs measured in a results file, for extrapolation: the pass cost
    (floor / (FLOOR_PASSES d)) and the per-element selection of ``topk-ef@density`` and
    ``hvd_slim-slim@density`` (their select time over the compressed elements)."""
    inp = inputs_of(res)
    shapes, peers = inp.scenario.shapes, res.get("peers", {})

    def per_elem(peer: str, threshold: int) -> float:
        sel = (peers.get(peer) or {}).get("select_ms_per_step")
        big = split(shapes, threshold)[0]
        return sel / 1e3 / big if sel and big else 0.0

    return LocalCosts(pass_s=inp.scenario.local.pass_s,
                      topk_select_s=per_elem(f"topk-ef@{density:g}", SMALL_NUMEL),
                      slim_select_s=per_elem(f"hvd_slim-slim@{density:g}",
                                             inp.scenario.slim.min_compress_numel))


@dataclass
class Row:
    peer: str
    measured: float
    pred: Prediction         # the model on the file's own network (comm, bytes, derived local)
    error: float             # seconds / measured - 1
    peer_rec: Dict[str, Any]
    seconds: float = 0.0     # the prediction: pred.seconds, or calibrated local + pred.comm_s
    # With a calibration: (its median, the model's communication on its network); local work
    # = max(0, median - communication).
    calib: Optional[Tuple[float, float]] = None

    @property
    def local_m(self) -> Optional[float]:
        return None if self.calib is None else max(0.0, self.calib[0] - self.calib[1])


@dataclass
class Calibration:
    """A calibration run's results and its scenario (the network its communication is
    modelled on)."""

    path: str
    res: Dict[str, Any]
    inputs: Inputs


def load_calibration(path: str) -> Calibration:
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    return Calibration(path, res, inputs_of(res))


def _key(res: Dict[str, Any]) -> Tuple[str, int, int]:
    settings = res.get("settings", {})
    return (str(settings.get("model")), int(settings.get("ranks", 0)),
            int(settings.get("ranks_per_host") or 1))


def _named(key: Tuple[str, int, int]) -> str:
    per_host = f", {key[2]} per host" if key[2] != 1 else ""
    return f"model {key[0]!r}, {key[1]} ranks{per_host}"


def calibration_for(res: Dict[str, Any], calibs: Sequence[Calibration],
                    path: str = "results") -> Calibration:
    """The one calibration with the same ``settings.model``, ``settings.ranks`` and
    ``settings.ranks_per_host`` (hosts of several ranks: ``hierarchical=True`` does other work)
    as ``res``; ValueError when there is none or more than one."""
    want = _key(res)
    hits = [c for c in calibs if _key(c.res) == want]
    if len(hits) != 1:
        have = ", ".join(f"{c.path} ({_named(_key(c.res))})" for c in calibs) or "none"
        what = "no calibration" if not hits else f"{len(hits)} calibrations"
        raise ValueError(f"{what} for {path} ({_named(want)}) among --local-from: {have}")
    return hits[0]


def _ok(p: Dict[str, Any]) -> bool:
    return p.get("status") == "ok" and bool(p.get("median_s"))


def _sel(p: Dict[str, Any]) -> Optional[float]:
    sel = p.get("select_ms_per_step")
    return None if sel is None else sel / 1e3


def rows_of(res: Dict[str, Any], inp: Inputs, calib: Optional[Calibration] = None
            ) -> List[Row]:
    """One row per modelled peer that ran. With ``calib``, a peer that also ran there is
    predicted as its calibrated local work plus the model's communication on ``res``'s network;
    the others keep the derived local work."""
    cal_peers = calib.res.get("peers", {}) if calib else {}
    out = []
    for name, p in res.get("peers", {}).items():
        if not _ok(p):
            continue
        try:
            parse(name)
        except ValueError:
            continue
        pred = predict(name, inp.scenario, _sel(p))
        row = Row(name, p["median_s"], pred, 0.0, p, pred.seconds)
        c = cal_peers.get(name) or {}
        if calib is not None and _ok(c):
            there = predict(name, calib.inputs.scenario, _sel(c))
            row.calib = (float(c["median_s"]), there.comm_s)
            row.seconds = row.local_m + pred.comm_s
        row.error = row.seconds / row.measured - 1
        out.append(row)
    return out


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _bytes(measured: Optional[float], predicted: float, derived: bool) -> str:
    if measured is None:
        return f"- / {_mb(predicted)}"
    return f"{_mb(measured)}{'*' if derived else ''} / {_mb(predicted)}"


def _local_cells(r: Row) -> Tuple[str, str]:
    """(compute + local, where it comes from) for the calibrated table."""
    p = r.pred
    if r.calib is not None:
        return f"{r.local_m:.4f} (m)", f"calibration {r.calib[0]:.4f} - its comm {r.calib[1]:.4f}"
    sel = p.detail.get("select_s")
    return (f"{p.compute_s + p.local_s:.4f} (d)",
            f"compute {p.compute_s:.4f} (m) + local {p.local_s:.4f}" +
            (f" (select {sel:.4f} m)" if sel else ""))


def table(rows: Sequence[Row], calibrated: bool = False) -> str:
    """The Markdown table of one file's rows (``calibrated``: the --local-from columns)."""
    mid = ("compute + local | from | " if calibrated else "compute (m) | local | ")
    head = ("| peer | measured s/step | predicted s/step | error | " + mid +
            "comm (model) | sent/rank MB meas/pred | recv/rank MB meas/pred | "
            "busiest NIC tx MB meas/pred | busiest NIC rx MB meas/pred |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        p, rec = r.pred, r.peer_rec
        derived = (rec.get("basis") or {}).get("wire") == "derived"
        nic = rec.get("nic_bytes_per_step") or {}
        if calibrated:
            cells = " | ".join(_local_cells(r))
        else:
            sel = p.detail.get("select_s")
            cells = f"{p.compute_s:.4f} | {p.local_s:.4f}" + \
                (f" (select {sel:.4f} m)" if sel else "")
        lines.append(
            f"| {r.peer} | {r.measured:.4f} | {r.seconds:.4f} | {100 * r.error:+.1f}% | "
            f"{cells} | {p.comm_s:.4f} | "
            f"{_bytes(rec.get('bytes_sent_per_step'), p.sent_per_rank, derived)} | "
            f"{_bytes(rec.get('bytes_recv_per_step'), p.recv_per_rank, derived)} | "
            f"{_bytes(nic.get('busiest_tx'), p.busiest_tx, False)} | "
            f"{_bytes(nic.get('busiest_rx'), p.busiest_rx, False)} |")
    return "\n".join(lines)


def _net_words(sc: Scenario) -> str:
    return (f"{sc.ranks} ranks, {sc.net.topology} at "
            f"{', '.join(f'{r / 1e9:g}' for r in sc.net.rate_bps)} Gbit/s")


def report(path: str, tolerance: float, calibs: Optional[Sequence[Calibration]] = None
           ) -> Tuple[str, List[Row]]:
    """(Markdown for one results file, its rows beyond ``tolerance``). ``calibs``: the
    --local-from files, one of which must match (:func:`calibration_for`)."""
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    inp = inputs_of(res)
    calib = calibration_for(res, calibs, path) if calibs is not None else None
    rows = rows_of(res, inp, calib)
    sc = inp.scenario
    text = [f"### {path}", "",
            f"{_net_words(sc)}, model {res['settings'].get('model')} (d = {sc.d}).", ""]
    text += [f"- {n}" for n in inp.notes]
    if calib is not None:
        csc = calib.inputs.scenario
        n_m = sum(r.calib is not None for r in rows)
        text += [f"- measured: compute + local of {n_m} of {len(rows)} peers from {calib.path} "
                 f"({_net_words(csc)}): its median minus the model's communication there; "
                 "added to the communication modelled here (see validate's docstring)"]
        text += [f"- calibration: {n}" for n in calib.inputs.notes
                 if not n.startswith("measured: compute")]
        if csc.slim != sc.slim:
            text.append(f"- warning: hvd_slim settings differ (calibration {csc.slim}, "
                        f"here {sc.slim}): its calibrated local work is for the former's sizes")
    if calib is not None:
        legend = ("compute + local: (m) measured on the calibration run (its median minus the "
                  "model's communication on its network; the floor's too), (d) derived as "
                  "without --local-from (the floor's median here, measured, plus the counted "
                  "passes at the floor's cost per element and the measured selection). comm "
                  "from the model on this file's network.")
    else:
        legend = ("(m) measured input; local = the measured selection (m) plus the streaming "
                  "passes and scatters the model counts for the strategy (derived pass cost); "
                  "comm from the model.")
    text += ["", table(rows, calib is not None), "",
             legend + " Bytes: `*` the benchmark's figure is itself derived (a ring/allgather "
             "formula on counted buffers), others counted; hvd_slim's are the transport's push "
             "and pull sizes.", ""]
    # The floor is an input (error 0) unless it was predicted from a calibration.
    scored = [r for r in rows if r.peer != "floor" or r.calib is not None]
    bad = [r for r in scored if abs(r.error) > tolerance]
    worst = max(scored, key=lambda r: abs(r.error), default=None)
    if worst is not None:
        text.append(f"max |error| {100 * abs(worst.error):.1f}% ({worst.peer}); "
                    f"{len(scored) - len(bad)} of {len(scored)} peers within, {len(bad)} "
                    f"beyond {100 * tolerance:g}%"
                    + (": " + ", ".join(r.peer for r in bad) if bad else ""))
    return "\n".join(text) + "\n", bad


def main(paths: Sequence[str], tolerance: float, local_from: Optional[Sequence[str]] = None
         ) -> int:
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
        text, bad = report(path, tolerance, calibs)
        print(text)
        failed = failed or bool(bad)
    return 1 if failed else 0
