"""A switched cluster on one machine: one network namespace per host, one NIC each, one switch.

Each host ``h<i>`` has a veth ``eth0`` whose other end is port ``h<i>`` of a bridge in a switch
namespace. A ``tc tbf`` at the host's rate sits on both ends of that veth: on ``eth0`` it limits
what the host sends, on the switch port what it receives, so every NIC is full duplex at its
own rate and a ring allreduce uses all of them at once, as on a real switched network. An
optional ``netem`` delay on each host's egress adds one-way latency between hosts. ``mpirun``
runs in an unshaped launcher namespace on the same bridge; each rank execs into its host's
namespace through a wrapper keyed by ``OMPI_COMM_WORLD_RANK`` (ranks ``i*k .. i*k+k-1`` on host
``i`` with ``k`` ranks per host; between them the host's own loopback, unshaped, carries the
traffic, like a real host's memory bus).

Addresses come from :data:`SUBNET`, a block that exists only inside these namespaces; no route
leads out of them. Namespaces are named ``hvdslim-bench-<pid>-<role>`` (:mod:`.netem` removes
those of dead runs) and always deleted afterwards, also on failure and SIGTERM.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from . import netem

SUBNET = "10.213.77"          # hosts .1 .. .N, the launcher .254; /24, nowhere else
LAUNCHER_ADDR = f"{SUBNET}.254"
MPI_ARGS = ("--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0",
            "--mca", "oob_tcp_if_include", "eth0")
# PMIx must listen on the bridge too, or ranks in host namespaces cannot reach mpirun.
MPIRUN_ENV = {"PMIX_MCA_ptl_tcp_remote_connections": "1", "PMIX_MCA_ptl_tcp_if_include": "eth0"}
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bps(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (tc's units, bits per second)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(kbit|mbit|gbit)\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 100mbit, 1gbit, 2.5gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def burst(rate: str) -> str:
    # A burst must cover what the rate sends in a timer tick, or tbf throttles below its rate:
    # 1 ms worth (128 kB at 1 Gbit/s, measured to reach 0.96 Gbit/s), at least 32 kB.
    return f"{max(32, int(rate_bps(rate) / 8 / 1000 / 1024))}kb"


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster's shape: ``hosts`` hosts at ``rate`` (``host_rates`` overrides per host),
    ``ranks_per_host`` ranks each, ``latency_ms`` added one way between hosts."""
    hosts: int
    rate: str = "1gbit"
    ranks_per_host: int = 1
    host_rates: Tuple[str, ...] = ()
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"hosts={self.hosts} and ranks_per_host={self.ranks_per_host} must "
                             f"be at least 1")
        if self.host_rates and len(self.host_rates) != self.hosts:
            raise ValueError(f"host_rates has {len(self.host_rates)} entries for {self.hosts} "
                             f"hosts: give one rate per host, e.g. 1gbit,1gbit,1gbit,250mbit")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms={self.latency_ms} must be >= 0")
        for r in self.rates():
            rate_bps(r)

    def rates(self) -> List[str]:
        return list(self.host_rates) or [self.rate] * self.hosts

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host


@dataclass
class Cluster:
    """A running cluster (see :func:`switched`)."""
    spec: ClusterSpec
    tag: str
    wrapper: str
    hosts: List[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @property
    def launcher(self) -> str:
        return f"{self.tag}-l"

    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def mpirun_prefix(self) -> List[str]:
        """What goes before ``mpirun``: it runs in the launcher namespace."""
        return ["ip", "netns", "exec", self.launcher]

    def rank_prefix(self) -> List[str]:
        """What goes before each rank's command: the wrapper that enters its host."""
        return [self.wrapper]

    def mpirun_argv(self, np_: int, command: Sequence[str], export: Sequence[str] = ()
                    ) -> List[str]:
        """``mpirun`` in the launcher's namespace over the hosts' eth0, each rank entering its
        host, for ``command`` (PYTHONPATH, this cluster's :meth:`env` and ``export`` exported)."""
        return [*self.mpirun_prefix(), "mpirun", "-np", str(np_), "--oversubscribe",
                "--bind-to", "none", *MPI_ARGS, "--mca", "mpi_yield_when_idle", "1",
                "-x", "PYTHONPATH", "-x", "PYTHONDONTWRITEBYTECODE",
                *[a for k in (*export, *self.env()) for a in ("-x", k)], *self.rank_prefix(),
                *command]

    def env(self) -> Dict[str, str]:
        """mpirun's environment additions; Gloo's store lives at host 0's address."""
        return {**MPIRUN_ENV, "GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": self.addr(0),
                "HVDSLIM_BENCH_ADDR": self.addr(0), "HVDSLIM_BENCH_NIC": "eth0"}

    def nic_counters(self) -> List[Dict[str, int]]:
        """Bytes each host's eth0 has sent and received so far."""
        out = []
        for ns in self.hosts:
            res = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", "eth0"],
                                 capture_output=True, text=True, timeout=30, check=True)
            s = json.loads(res.stdout)[0]["stats64"]
            out.append({"tx": int(s["tx"]["bytes"]), "rx": int(s["rx"]["bytes"])})
        return out

    def describe(self) -> Dict[str, object]:
        """The topology, for the results' JSON."""
        qdisc = _run(["ip", "netns", "exec", self.hosts[0], "tc", "qdisc", "show", "dev",
                      "eth0"]).stdout.strip()
        return {"mode": "switched", "hosts": self.spec.hosts,
                "ranks_per_host": self.spec.ranks_per_host,
                "rate_gbit": [rate_bps(r) / 1e9 for r in self.spec.rates()],
                "latency_ms": self.spec.latency_ms, "subnet": f"{SUBNET}.0/24",
                "qdisc_host0": qdisc}


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


def _must(argv: Sequence[str], ns: Optional[str] = None) -> None:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    res = _run(full)
    if res.returncode != 0:
        raise netem.NetemError(f"`{' '.join(full)}` failed: {res.stderr.strip()}")


def _shape(dev: str, ns: str, rate: str, latency_ms: float) -> None:
    """tbf at ``rate`` on ``dev``'s egress, behind a netem delay when ``latency_ms``."""
    tbf = ["tbf", "rate", rate, "burst", burst(rate), "latency", "50ms"]
    if latency_ms > 0:
        # netem holds a bandwidth-delay product of packets: raise its 1000-packet default.
        argv = ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                f"{latency_ms:g}ms", "limit", "100000"]
        res = _run(["ip", "netns", "exec", ns, *argv])
        if res.returncode != 0:
            raise netem.NetemError(
                f"latency_ms={latency_ms:g} needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM, "
                f"module sch_netem), and `{' '.join(argv)}` failed: {res.stderr.strip()}; run "
                f"without added latency here, or on a kernel that has netem")
        _must(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf], ns)
    else:
        _must(["tc", "qdisc", "add", "dev", dev, "root", *tbf], ns)


def _wrapper(path: str, spec: ClusterSpec, hosts: List[str]) -> None:
    """A shell script that execs its arguments inside the host of ``OMPI_COMM_WORLD_RANK``."""
    cases = "\n".join(f"  {i}) ns={ns} ;;" for i, ns in enumerate(hosts))
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"#!/bin/sh\n# hvd_slim benchmark: run this rank inside its host's namespace\n"
                f"host=$(( ${{OMPI_COMM_WORLD_RANK:?not started by mpirun}} / "
                f"{spec.ranks_per_host} ))\n"
                f"case $host in\n{cases}\n  *) echo \"rank $OMPI_COMM_WORLD_RANK has no host "
                f"(the cluster has {spec.hosts} hosts of {spec.ranks_per_host} ranks)\" >&2; "
                f"exit 2 ;;\nesac\n"
                # HVD_SLIM_HOST_KEY: hvd_slim's local_rank()/local_size() see these hosts, not
                # the one machine that MPI's shared-memory split sees.
                f"export HVDSLIM_BENCH_HOST=$host HVD_SLIM_HOST_KEY=host$host\n"
                f"exec ip netns exec \"$ns\" \"$@\"\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _build(c: Cluster) -> None:
    spec = c.spec
    for ns in (c.switch, c.launcher, *c.hosts):
        res = _run(["ip", "netns", "add", ns])
        if res.returncode != 0:
            raise netem.NetemError(f"`ip netns add {ns}` failed: {res.stderr.strip()}; the "
                                   f"switched cluster needs root with CAP_SYS_ADMIN (in a "
                                   f"container: --privileged), or use --net loopback")
    _must(["ip", "link", "add", "br0", "type", "bridge"], c.switch)
    _must(["ip", "link", "set", "br0", "up"], c.switch)
    ports = [(f"h{i}", ns, c.addr(i)) for i, ns in enumerate(c.hosts)]
    for port, ns, addr in ports + [("launch", c.launcher, LAUNCHER_ADDR)]:
        _must(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
              c.switch)
        _must(["ip", "link", "set", port, "master", "br0"], c.switch)
        _must(["ip", "link", "set", port, "up"], c.switch)
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{addr}/24", "dev",
                                                        "eth0"], ["ip", "link", "set", "eth0", "up"]):
            _must(cmd, ns)
    for i, (port, ns, _) in enumerate(ports):
        rate = spec.rates()[i]
        _shape("eth0", ns, rate, spec.latency_ms)   # what host i sends
        _shape(port, c.switch, rate, 0.0)           # what host i receives


def _teardown(c: Cluster) -> None:
    for ns in (*c.hosts, c.launcher, c.switch):
        _run(["ip", "netns", "del", ns])


@contextmanager
def switched(spec: ClusterSpec) -> Iterator[Cluster]:
    """Build the cluster, yield it, always tear it down (on errors and SIGTERM/SIGHUP too)."""
    netem.check_privileges()
    netem.cleanup_stale()
    tag = f"{netem.PREFIX}{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix="hvdslim-cluster-")
    c = Cluster(spec, tag, os.path.join(tmp, "enter_host.sh"),
                [f"{tag}-h{i}" for i in range(spec.hosts)])
    old = {s: signal.signal(s, netem.raise_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _build(c)
        _wrapper(c.wrapper, spec, c.hosts)
        yield c
    finally:
        _teardown(c)
        for s, h in old.items():
            signal.signal(s, h)
        if os.path.exists(c.wrapper):
            os.remove(c.wrapper)
        os.rmdir(tmp)
