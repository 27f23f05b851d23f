"""Turn the workers' raw records into figures, targets, a JSON file and a markdown table."""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional

from hvd_slim.config import SlimConfig, default_pull_density

from . import phases, plots

# The issue's reference figures (ResNet-18 shapes, 4 ranks, 1 Gbit/s), median s per step.
REFERENCE = {"floor": 0.026, "mpi-allreduce": 2.28, "horovod": 2.29, "horovod-fp16": 1.17,
             "topk-ef@0.01": 0.71, "ddp-powersgd-r1": 0.217, "ddp-powersgd-r4": 0.304}
EXPLORATION = SlimConfig.exploration   # hvd_slim's defaults, used by the closed form
VALUE_BITS = SlimConfig.value_bits
FIELDS = ("handed_sent", "handed_recv", "wire_sent", "wire_recv", "select_s")


def _pct(xs: List[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def index_bytes_bound(d: int, n: int) -> int:
    """The index codec (docs/design.md §2): the smaller of Elias-Fano and a bitmap for n
    indices in [0, d)."""
    if n == 0:
        return 0
    low = 0 if d < 2 * n else (d // n).bit_length() - 1
    ef = (n * low + 7) // 8 + (n + ((d - 1) >> low) + 1 + 7) // 8
    return min(ef, (d + 7) // 8)


def closed_form(d: int, dense_numel: int, density: float, value_bits: int = 8,
                pull_density: Optional[float] = None) -> Dict[str, int]:
    """Bytes of one hvd_slim push (and of a pull="slim" pull) from its density: the 8-byte length
    word, a 32-byte header and a 16-byte table entry per bucket, the dense small tensors (fp32),
    k values of ``value_bits`` and the core's indices (at most :func:`index_bytes_bound`); the
    slim pull carries ``k_pull`` values and indices at ``pull_density`` (default: hvd_slim's
    rule)."""
    k = min(d, max(1, math.ceil(density * d)))
    k_core = k - int(round(EXPLORATION * k))
    pd = default_pull_density(density) if pull_density is None else pull_density
    k_pull = min(d, max(1, math.ceil(pd * d)))
    buckets = int(d > 0) + int(dense_numel > 0)
    vbytes = value_bits / 8
    fixed = 8 + 32 + 16 * buckets + 4 * dense_numel
    bound = index_bytes_bound(d, k_core)
    return {"d": d, "dense_numel": dense_numel, "k": k, "k_core": k_core, "buckets": buckets,
            "value_bits": value_bits, "value_bytes": int(vbytes * k),
            "index_bytes_bound": bound, "bytes_min": fixed + int(vbytes * k),
            "bytes_max": fixed + int(vbytes * k) + bound, "k_pull": k_pull,
            "pull_bytes_min": fixed + int(vbytes * k_pull),
            "pull_bytes_max": fixed + int(vbytes * k_pull) + min((d + 7) // 8, 8 * k_pull)}


def _peer(name: str, recs: List[Dict[str, Any]], env: Dict[str, str]) -> Dict[str, Any]:
    ok = [r for r in recs if r.get("status") == "ok"]
    if not ok:
        r = recs[0] if recs else {"status": "failed", "error": "no record"}
        return {"status": r["status"], "error": r.get("error", ""),
                "detail": r.get("traceback") or r.get("output_tail", "")}
    times = [t for r in ok for t in r["step_times_s"]]
    ranks = [rank for r in ok for rank in r["per_rank_per_step"]]
    rounds = local_steps(name, env)
    mean = {f: statistics.fmean(x.get(f, 0.0) for x in ranks) for f in FIELDS}
    out: Dict[str, Any] = {
        "status": "ok", "steps_measured": len(times), "repeats": len(ok),
        # the mean as well: under local_steps=H the median is a step without an exchange, and
        # only the mean over whole rounds (steps a multiple of H) is what a step costs
        "median_s": statistics.median(times), "mean_s": statistics.fmean(times),
        "local_steps": rounds,
        "p10_s": _pct(times, 10), "p90_s": _pct(times, 90),
        "iqr_s": _pct(times, 75) - _pct(times, 25), "min_s": min(times), "max_s": max(times),
        "repeat_medians_s": [statistics.median(r["step_times_s"]) for r in ok],
        "bytes_sent_per_step": mean["wire_sent"], "bytes_recv_per_step": mean["wire_recv"],
        "handed_sent_per_step": mean["handed_sent"], "handed_recv_per_step": mean["handed_recv"],
        "select_ms_per_step": 1e3 * mean["select_s"],
        "basis": ok[0].get("basis", {}), "per_rank_per_step": ok[0]["per_rank_per_step"],
        "hosts": ok[0].get("hosts"), "local_size": ok[0].get("local_size"),
        "step_times_s": times,
        "loadavg": [r.get("loadavg_before") for r in ok] + [ok[-1].get("loadavg_after")]}
    # What a step costs, which the ratios and targets compare: the median, or in rounds of
    # local steps the mean (the measured steps should be a multiple of local_steps).
    out["step_s"] = out["mean_s"] if rounds > 1 else out["median_s"]
    if ok[0].get("rank_phase_steps_s"):
        # Per rank, every measured step of every repeat: {phase: seconds} (hvd_slim's phases,
        # comm_stats' <phase>_seconds): when each rank's CPU work ended within the step.
        out["rank_phase_steps_s"] = [sum((r["rank_phase_steps_s"][i] for r in ok), [])
                                     for i in range(len(ok[0]["rank_phase_steps_s"]))]
    if ok[0].get("backward_profile"):   # the floor of a real backward (benchmarks.ready)
        out["backward_profile"] = ok[0]["backward_profile"]
    nic = _nic(ok[0])
    if nic:
        out["nic_bytes_per_step"] = nic
    if name.startswith("hvd_slim-"):
        pull, density = name[len("hvd_slim-"):].split("@")
        ex = ok[0]["extra"][0]
        cf = closed_form(ex["compressed_numel"], ex["dense_numel"], float(density),
                         value_bits=int(env.get("HVD_SLIM_VALUE_BITS", VALUE_BITS)))
        pushes = [r["handed_sent"] for r in ranks]
        pulls = [r["handed_recv"] for r in ranks]
        out["ring_allreduce_bytes_per_step"] = statistics.fmean(r["ring_allreduce_bytes"]
                                                                for r in ranks)
        out["server_recv_per_step"] = sum(x["handed_sent"] for x in ok[0]["per_rank_per_step"])
        out["exchange_ms_per_step"] = 1e3 * statistics.fmean(r["exchange_s"] for r in ranks)
        out["closed_form"] = cf
        out["closed_form_push_ok"] = all(cf["bytes_min"] <= b <= cf["bytes_max"] for b in pushes)
        if pull == "slim":
            out["closed_form_pull_ok"] = all(cf["pull_bytes_min"] <= b <= cf["pull_bytes_max"]
                                             for b in pulls)
        out["last_step"] = [e["last_step"] for e in ok[0]["extra"]]
    return out


def _nic(rec: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Per host NIC bytes per measured step (counted by the kernel; a host's ranks share its
    NIC, so its first rank's counters stand for it), and the busiest host's."""
    hosts, ranks = rec.get("hosts") or [], rec["per_rank_per_step"]
    if not hosts or None in hosts or "nic_tx" not in ranks[0]:
        return None
    per_host: Dict[int, Dict[str, float]] = {}
    for h, r in zip(hosts, ranks):
        per_host.setdefault(int(h), {"tx": r["nic_tx"], "rx": r["nic_rx"]})
    rows = [per_host[h] for h in sorted(per_host)]
    return {"busiest_tx": max(r["tx"] for r in rows), "busiest_rx": max(r["rx"] for r in rows),
            "per_host": rows, "basis": "counted: the kernel's eth0 byte counters in each host "
                                       "namespace over the measured steps (frames, headers too)"}


def local_steps(name: str, env: Dict[str, str]) -> int:
    """The rounds a peer runs: ``ddp-localH``'s H, hvd_slim's ``HVD_SLIM_LOCAL_STEPS`` (from
    ``--env``), else 1 (a step exchanges every time). The DDP peer (peers_fw.py) reads its H
    here too."""
    if name.startswith("ddp-local"):
        return int(name[len("ddp-local"):])
    if name.startswith("hvd_slim-"):
        return max(1, int(env.get("HVD_SLIM_LOCAL_STEPS", "1") or 1))
    return 1


def _ratios(peers: Dict[str, Dict[str, Any]]) -> None:
    dense, floor = peers.get("mpi-allreduce", {}), peers.get("floor", {})
    for p in peers.values():
        if p["status"] != "ok":
            continue
        if floor.get("status") == "ok":
            p["comm_s"] = max(p["step_s"] - floor["step_s"], 0.0)
        if dense.get("status") == "ok":
            p["time_vs_dense"] = p["step_s"] / dense["step_s"]
            p["bytes_fewer_than_dense"] = (dense["bytes_sent_per_step"] / p["bytes_sent_per_step"]
                                           if p["bytes_sent_per_step"] else None)
            if "comm_s" in p and "comm_s" in dense:
                p["comm_fewer_than_dense"] = dense["comm_s"] / p["comm_s"] if p["comm_s"] else None


def _target(name: str, value: Optional[float], goal: float, better: str, what: str) -> Dict:
    met = None if value is None else (value >= goal if better == "higher" else value <= goal)
    return {"target": name, "value": value, "goal": goal, "better": better, "met": met,
            "what": what}


def targets(peers: Dict[str, Dict[str, Any]], density: float = 0.01) -> List[Dict[str, Any]]:
    """The issue's four targets for hvd_slim at ``density``, per pull mode that ran."""
    out = []
    ok = {n: p for n, p in peers.items() if p["status"] == "ok"}
    others = {n: p for n, p in ok.items() if not n.startswith("hvd_slim") and n != "floor"}
    topk = ok.get(f"topk-ef@{density:g}")
    for pull in ("slim", "union"):
        s = ok.get(f"hvd_slim-{pull}@{density:g}")
        if s is None:
            continue
        tag = f"hvd_slim pull={pull} @{density:g}"
        out.append(_target(f"{tag}: communication time vs dense allreduce",
                           s.get("comm_fewer_than_dense"), 50, "higher",
                           "(dense step - floor step) / (hvd_slim step - floor step)"))
        out.append(_target(f"{tag}: bytes sent vs a ring allreduce",
                           s["ring_allreduce_bytes_per_step"] / s["bytes_sent_per_step"], 70,
                           "higher", "ring_allreduce_bytes / bytes_pushed, per rank per step"))
        best = min(others.items(), key=lambda kv: kv[1]["step_s"]) if others else None
        if best:
            out.append(_target(f"{tag}: step time vs the fastest other peer ({best[0]})",
                               s["step_s"] / best[1]["step_s"], 1.0, "lower",
                               "hvd_slim step / fastest non-hvd_slim peer's step (< 1 beats it)"))
        if "floor" in ok:
            out.append(_target(f"{tag}: step time vs the floor", s["step_s"] /
                               ok["floor"]["step_s"], 1.5, "lower", "hvd_slim step / floor"))
        if topk and s["select_ms_per_step"]:
            out.append(_target(f"{tag}: selection compute vs exact torch.topk",
                               topk["select_ms_per_step"] / s["select_ms_per_step"], 10, "higher",
                               "topk-ef's torch.topk ms / hvd_slim's select ms, per step, "
                               "same d and k, measured under the same load"))
    return out


def build(meta: Dict[str, Any], records: List[Dict[str, Any]], names: List[str],
          args: Any) -> Dict[str, Any]:
    env = dict(kv.split("=", 1) for kv in getattr(args, "env", []) or [])
    peers = {n: _peer(n, [r for r in records if r.get("peer") == n], env) for n in names}
    for n, p in peers.items():   # how busy the machine was (others) just before each run
        p["others_cpu_busy_before"] = [j.get("cpu_busy_before") for j in meta.get("jobs", [])
                                       if n in j["peers"]]
    _ratios(peers)
    return {**meta, "peers": peers, "targets": targets(peers), "reference_s": REFERENCE,
            "byte_fields": {
                "bytes_sent_per_step": "per rank per step, mean over ranks: what leaves the rank "
                                       "on the network (basis.wire says counted or derived)",
                "handed_sent_per_step": "per rank per step: bytes of the buffers handed to the "
                                        "collective (basis.handed)",
                "counted": "measured from the buffers actually handed to MPI / Gloo, or hvd_slim's "
                           "transport counters",
                "derived": "a formula applied to counted sizes (named in basis.note)"}}


def _fmt_b(x: Optional[float]) -> str:
    if x is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= div:
            return f"{x / div:.3g} {unit}"
    return f"{x:.0f} B"


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _busiest(res: Dict[str, Any]) -> float:
    vals = [j.get("cpu_busy_before", 0) or 0 for j in res.get("jobs", [])]
    return max(vals) if vals else 0.0


def _topology(res: Dict[str, Any]) -> str:
    net = res.get("network", {})
    if net.get("mode") == "switched":
        rates = sorted(set(net["rate_gbit"]))
        rate = (f"{rates[0]:g} Gbit/s NICs" if len(rates) == 1 else
                "NICs at " + ", ".join(f"{r:g}" for r in net["rate_gbit"]) + " Gbit/s")
        lat = f", +{net['latency_ms']:g} ms one way" if net.get("latency_ms") else ""
        return (f"switched cluster of {net['hosts']} hosts x {net['ranks_per_host']} rank(s), "
                f"{rate}{lat}")
    if net.get("mode") == "shared" or res["settings"]["net"] in ("tbf1g", "tbf10g", "shared"):
        return f"shared medium (network `{res['settings']['net']}`: one link for all ranks)"
    return f"network `{res['settings']['net']}`"


def markdown(res: Dict[str, Any]) -> str:
    s = res["settings"]
    pp = res.get("network", {}).get("pingpong")
    link = f"; measured link {pp['gbit_per_s']:.2f} Gbit/s" if pp else ""
    lines = [f"**{s['model']}**, {s['ranks']} ranks, {_topology(res)}{link}; "
             f"{s['steps']} measured steps x {s['repeats']} repeat(s) after {s['warmup']} warm-up; "
             f"load average {res['loadavg_start'][0]:.2f} at start, {res['loadavg_end'][0]:.2f} at "
             f"end; before each job other processes kept at most {_busiest(res):.0%} of the "
             f"CPUs busy; {res['started']}", "",
             "| peer | median s/step | mean s/step | p10-p90 s | x dense time | x compute "
             "| comm s/step | sent/rank/step | recv/rank/step | busiest NIC out/in per step "
             "| x fewer bytes than dense | select ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    floor = res["peers"].get("floor", {})
    for name, p in res["peers"].items():
        if p["status"] != "ok":
            lines.append(f"| {name} | {p['status']}: {p['error'][:80]} | | | | | | | | | | |")
            continue
        mark = "" if p["basis"].get("wire") == "counted" else " *"
        nic = p.get("nic_bytes_per_step")
        nic_s = f"{_fmt_b(nic['busiest_tx'])} / {_fmt_b(nic['busiest_rx'])}" if nic else "-"
        x_compute = p["step_s"] / floor["step_s"] if floor.get("status") == "ok" else None
        lines.append(
            f"| {name} | {p['median_s']:.4f} | {_f(p.get('mean_s'), '.4f')} | "
            f"{p['p10_s']:.3f}-{p['p90_s']:.3f} | "
            f"{_f(p.get('time_vs_dense'), '.3f')} | {_f(x_compute, '.2f')} | "
            f"{_f(p.get('comm_s'), '.4f')} | "
            f"{_fmt_b(p['bytes_sent_per_step'])}{mark} | {_fmt_b(p['bytes_recv_per_step'])}{mark} | "
            f"{nic_s} | {_f(p.get('bytes_fewer_than_dense'), '.1f')} | "
            f"{p['select_ms_per_step']:.1f} |")
    lines += ["", "`*` derived (ring allreduce 2(N-1)/N x the counted buffer bytes; ring allgather "
              "(N-1) x payload); others counted. A step's cost is its median, or under "
              "local_steps (ddp-localH, HVD_SLIM_LOCAL_STEPS) the mean over whole rounds, whose "
              "median is a step with no exchange: comm = step - floor's, x compute = step / "
              "floor's (floor: the same step with no communication), x dense time likewise. "
              "Busiest NIC: "
              "the kernel's byte counters of the host NIC that sent (received) most.", ""]
    lines += phases.table(res)
    if res["targets"]:
        lines += ["| target | measured | goal | met |", "|---|---:|---:|---|"]
        for t in res["targets"]:
            cmp_ = ">=" if t["better"] == "higher" else "<="
            met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
            lines.append(f"| {t['target']} | {_f(t['value'], '.2f')} | {cmp_} {t['goal']:g} | {met} |")
        lines.append("")
    ref = [(n, v) for n, v in res["reference_s"].items() if n in res["peers"]]
    if ref:
        lines += ["| peer | issue's reference s/step | this run |", "|---|---:|---:|"]
        for n, v in ref:
            p = res["peers"][n]
            got = _f(p.get("median_s"), ".3f") if p["status"] == "ok" else p["status"]
            lines.append(f"| {n} | {v:g} | {got} |")
    return "\n".join(lines) + "\n"


def write(res: Dict[str, Any], out_dir: str, tag: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{tag}.json"), os.path.join(out_dir, f"{tag}.md")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(res))
    paths += plots.draw(res, out_dir, tag)
    return paths
