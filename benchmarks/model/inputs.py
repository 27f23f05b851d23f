"""A benchmark results JSON (``benchmarks.run``'s ``<tag>.json``) as the model's inputs.

Measured: ranks and model (``settings``); the link (``network``: ``mode``, ``rate_gbit`` per
host, ``ranks_per_host``, ``latency_ms``; older files: ``settings.net``, "tbf1g" = a shared
1 Gbit/s link, "tbf10g" 10, "loopback"); the achieved rate (``network.pingpong``, as a share of
the nominal one); compute (the ``floor`` peer's median) and, for a real backward, when each
gradient was ready in it (the floor's ``backward_profile``, which Horovod's overlap is modelled
from: :mod:`.overlap`); hvd_slim's settings (the defaults at
``machine.git_commit``, ``settings.env``'s HVD_SLIM_* variables); the MPI (``machine.mpi``:
Open MPI runs its own algorithms over its TCP BTL, ``Scenario.mpi = "openmpi-tcp"``; a file
that names no MPI gets the ideal one).

Configured by the benchmark, and read from its code: each shaped NIC direction's token bucket
(``tc tbf`` ``burst``: benchmarks/cluster.py's rule, one millisecond at the rate and at least
32 KiB, as ``network.qdisc_host0`` shows; the old shared files' ``netem.NETS``; an unshaped
loopback has none).

Derived: the cost of one streaming pass per element, the floor over its
:data:`~.scenario.FLOOR_PASSES` passes of d elements. Documented constants: :data:`LATENCY_S`
where the file has no latency, no per-message overhead, Ethernet framing and TCP ACKs on
switched NIC counters (net.ETH_*).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from . import net as nw
from .scenario import FLOOR_PASSES, LocalCosts, Scenario
from .slim import SlimSettings, defaults_at, with_env
from .strategies import SMALL_NUMEL
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


def tc_bytes(size: str) -> float:
    """A ``tc`` size ("32750b", "32Kb", "128kb", "1mb") in bytes (tc's k and m are 1024s)."""
    m = re.fullmatch(r"([0-9.]+)([kKmMgG]?)[bB]?", size.strip())
    if not m:
        raise ValueError(f"not a tc size: {size!r}")
    return float(m[1]) * {"": 1, "k": 1024, "m": 1 << 20, "g": 1 << 30}[m[2].lower()]


def _bursts(mode: str, settings: Dict[str, Any], rates: Tuple[float, ...]
            ) -> Tuple[float, ...]:
    """Each NIC's (or the shared link's) tbf bucket, as the benchmark configured it."""
    if mode == "loopback":
        return ()
    from benchmarks import cluster, netem      # the benchmark's own rules
    spec = netem.NETS.get(settings.get("net", ""))
    if spec:
        return (tc_bytes(spec[1]),)
    return tuple(tc_bytes(cluster.burst(f"{r / 1e6:g}mbit")) for r in rates)


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
    bursts = _bursts(mode, settings, rates)
    if bursts:
        notes.append("configured: token bucket " + ", ".join(f"{b / 1024:g}" for b in bursts) +
                     " KiB per NIC direction" + (" (the link)" if mode != "switched" else ""))
    net = nw.Network(mode, rates, latency_s=latency, efficiency=eff, ranks_per_host=rph,
                     frame_overhead=nw.ETH_FRAME_OVERHEAD if eth else 1.0,
                     ack_overhead=nw.ETH_ACK_OVERHEAD if eth else 0.0, burst_bytes=bursts)
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
    mpi_name = str((res.get("machine") or {}).get("mpi") or "")
    mpi = "openmpi-tcp" if "Open MPI" in mpi_name else "ideal"
    notes.append(f"MPI: {mpi_name or 'not recorded'}; modelled as {mpi!r}")
    cores = int((res.get("machine") or {}).get("logical_cpus") or 0)
    if cores:
        notes.append(f"measured: {cores} logical CPUs for {n} ranks" +
                     (" (ranks outnumber cores: MPI partners enter steps apart)"
                      if n > cores else " (a core per rank)"))
    ready, back = _backward_profile(res, d, notes)
    sc = Scenario(n, net, shapes, compute_s=compute, local=LocalCosts(pass_s=pass_s), slim=slim,
                  mpi=mpi, cores=cores, ready=ready, backward_end_s=back)
    return Inputs(sc, notes)


def _backward_profile(res: Dict[str, Any], d: int, notes: List[str]
                      ) -> Tuple[Tuple[Tuple[float, int], ...], float]:
    """The floor's measured gradient-ready times (benchmarks.ready), if it recorded them."""
    prof = (res.get("peers", {}).get("floor") or {}).get("backward_profile") or {}
    if not prof:
        return (), 0.0
    ready = tuple(zip((float(t) for t in prof["ready_s"]), (int(k) for k in prof["numel"])))
    if sum(k for _, k in ready) != d:
        raise ValueError(f"the floor's backward_profile covers {sum(k for _, k in ready)} "
                         f"elements, the model {d}")
    back = float(prof["backward_end_s"])
    first = min(t for t, _ in ready)
    notes.append(f"measured: backward profile of {len(ready)} tensors (floor, slowest rank, "
                 f"median of {prof.get('steps')} steps): first gradient at {first:.4f} s, "
                 f"backward() ends at {back:.4f} s")
    return ready, back


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


