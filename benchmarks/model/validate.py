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

Nothing is fitted to a peer's time. A peer whose ``|error|`` exceeds the tolerance makes the
command exit 1.
"""
from __future__ import annotations

import json
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
    pred: Prediction
    error: float             # predicted / measured - 1
    peer_rec: Dict[str, Any]


def rows_of(res: Dict[str, Any], inp: Inputs) -> List[Row]:
    out = []
    for name, p in res.get("peers", {}).items():
        if p.get("status") != "ok" or not p.get("median_s"):
            continue
        try:
            parse(name)
        except ValueError:
            continue
        sel = p.get("select_ms_per_step")
        pred = predict(name, inp.scenario, None if sel is None else sel / 1e3)
        out.append(Row(name, p["median_s"], pred, pred.seconds / p["median_s"] - 1, p))
    return out


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _bytes(measured: Optional[float], predicted: float, derived: bool) -> str:
    if measured is None:
        return f"- / {_mb(predicted)}"
    return f"{_mb(measured)}{'*' if derived else ''} / {_mb(predicted)}"


def table(rows: Sequence[Row]) -> str:
    """The Markdown table of one file's rows."""
    head = ("| peer | measured s/step | predicted s/step | error | compute (m) | local | "
            "comm (model) | sent/rank MB meas/pred | recv/rank MB meas/pred | "
            "busiest NIC tx MB meas/pred | busiest NIC rx MB meas/pred |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        p, rec = r.pred, r.peer_rec
        derived = (rec.get("basis") or {}).get("wire") == "derived"
        nic = rec.get("nic_bytes_per_step") or {}
        sel = p.detail.get("select_s")
        local = f"{p.local_s:.4f}" + (f" (select {sel:.4f} m)" if sel else "")
        lines.append(
            f"| {r.peer} | {r.measured:.4f} | {p.seconds:.4f} | {100 * r.error:+.1f}% | "
            f"{p.compute_s:.4f} | {local} | {p.comm_s:.4f} | "
            f"{_bytes(rec.get('bytes_sent_per_step'), p.sent_per_rank, derived)} | "
            f"{_bytes(rec.get('bytes_recv_per_step'), p.recv_per_rank, derived)} | "
            f"{_bytes(nic.get('busiest_tx'), p.busiest_tx, False)} | "
            f"{_bytes(nic.get('busiest_rx'), p.busiest_rx, False)} |")
    return "\n".join(lines)


def report(path: str, tolerance: float) -> Tuple[str, List[Row]]:
    """(Markdown for one results file, its rows beyond ``tolerance``)."""
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    inp = inputs_of(res)
    rows = rows_of(res, inp)
    sc = inp.scenario
    text = [f"### {path}", "",
            f"{sc.ranks} ranks, {sc.net.topology} at "
            f"{', '.join(f'{r / 1e9:g}' for r in sc.net.rate_bps)} Gbit/s, model "
            f"{res['settings'].get('model')} (d = {sc.d}).", ""]
    text += [f"- {n}" for n in inp.notes]
    text += ["", table(rows), "",
             "(m) measured input; local = the measured selection (m) plus the streaming passes "
             "and scatters the model counts for the strategy (derived pass cost); comm from the "
             "model. Bytes: `*` the benchmark's figure is itself derived (a ring/allgather "
             "formula on counted buffers), others counted; hvd_slim's are the transport's push "
             "and pull sizes.", ""]
    scored = [r for r in rows if r.peer != "floor"]   # the floor is an input: error 0
    bad = [r for r in scored if abs(r.error) > tolerance]
    worst = max(scored, key=lambda r: abs(r.error), default=None)
    if worst is not None:
        text.append(f"max |error| {100 * abs(worst.error):.1f}% ({worst.peer}); "
                    f"{len(bad)} of {len(scored)} peers beyond {100 * tolerance:g}%"
                    + (": " + ", ".join(r.peer for r in bad) if bad else ""))
    return "\n".join(text) + "\n", bad


def main(paths: Sequence[str], tolerance: float) -> int:
    """Print every file's table; 1 if any peer is beyond ``tolerance``, else 0."""
    failed = False
    for path in paths:
        text, bad = report(path, tolerance)
        print(text)
        failed = failed or bool(bad)
    return 1 if failed else 0

