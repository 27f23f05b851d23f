"""The emulated network: a Linux network namespace whose loopback carries a ``tc tbf`` rate limit.

Every rank runs inside the namespace and talks TCP over its ``lo``, so all traffic of the job
shares one rate-limited link (docs/performance.md). The namespace is named
``hvdslim-bench-<pid>`` after the harness process that made it, so a later run (or ``make
bench``'s shell trap) can remove namespaces whose owner died without ever touching anyone else's.

    python -m benchmarks.netem --cleanup-stale     # remove namespaces of dead harness runs
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

PREFIX = "hvdslim-bench-"
# name -> (tbf rate, burst). A burst must cover rate/HZ or tbf throttles below the rate; 10 Gbit/s
# needs a larger one than 1 Gbit/s.
NETS: Dict[str, Optional[tuple]] = {
    "tbf1g": ("1gbit", "128kb"),
    "tbf10g": ("10gbit", "1mb"),
    "loopback": None,
}
# Open MPI over TCP on the namespace's ``lo`` only: shared memory would bypass the shaping.
MPI_ARGS = ("--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
            "--mca", "oob_tcp_if_include", "lo")


class NetemError(RuntimeError):
    """The namespace could not be created (privileges, missing tools)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def check_privileges() -> None:
    """Refuse early and clearly when the namespace cannot be made."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetemError(f"the emulated network needs {' and '.join(missing)} (package iproute2): "
                         "`apt-get install -y iproute2` (make bench does it), or use --net loopback")
    if os.geteuid() != 0:
        raise NetemError("the emulated network needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to "
                         "create a network namespace and shape its loopback: run as root or under "
                         "sudo, or pass --net loopback to measure on the unshaped loopback")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours() -> List[str]:
    """Namespaces this harness made (by name prefix)."""
    res = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def cleanup_stale() -> List[str]:
    """Delete ``hvdslim-bench-<pid>`` namespaces (and a switched cluster's
    ``hvdslim-bench-<pid>-<role>``, benchmarks/cluster.py) whose harness process is gone."""
    removed = []
    for name in ours():
        tail = name[len(PREFIX):].split("-")[0]
        if tail.isdigit() and not _pid_alive(int(tail)):
            if _ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


def raise_on_signal(signum: int, _frame: object) -> None:
    # Turning SIGTERM/SIGHUP into an exception makes the ``finally`` below run.
    raise SystemExit(128 + signum)


@contextmanager
def namespace(net: str, rate: str = "") -> Iterator[Optional[str]]:
    """Yield the name of a fresh shaped namespace (None for ``loopback``); always removed after.
    ``net="shared"`` shapes the loopback to ``rate`` (tc's units, e.g. ``"100mbit"``)."""
    if net == "shared":
        from .cluster import burst
        spec: Optional[tuple] = (rate, burst(rate))
    else:
        spec = NETS[net]
    if spec is None:
        yield None
        return
    check_privileges()
    cleanup_stale()
    name = f"{PREFIX}{os.getpid()}"
    rate, burst = spec
    old = {s: signal.signal(s, raise_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        res = _ip("netns", "add", name, check=False)
        if res.returncode != 0:
            raise NetemError(f"`ip netns add {name}` failed: {res.stderr.strip()}; the emulated "
                             "network needs root with CAP_SYS_ADMIN (in a container: --privileged "
                             "or --cap-add SYS_ADMIN,NET_ADMIN), or use --net loopback")
        for cmd in (["ip", "link", "set", "lo", "up"],
                    ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                     "burst", burst, "latency", "50ms"]):
            res = subprocess.run(["ip", "netns", "exec", name, *cmd], capture_output=True,
                                 text=True, timeout=30)
            if res.returncode != 0:
                raise NetemError(f"`{' '.join(cmd)}` in {name} failed: {res.stderr.strip()}")
        yield name
    finally:
        _ip("netns", "del", name, check=False)
        for s, h in old.items():
            signal.signal(s, h)


def wrap(ns: Optional[str], argv: List[str]) -> List[str]:
    """``argv`` run inside namespace ``ns`` (unchanged for None)."""
    return argv if ns is None else ["ip", "netns", "exec", ns, *argv]


def mpi_args(net: str) -> List[str]:
    """The mpirun options a job on ``net`` needs (none on the plain loopback)."""
    return [] if NETS[net] is None else list(MPI_ARGS)


def qdisc(ns: Optional[str]) -> str:
    """The shaping in force, for the record."""
    if ns is None:
        return "none (plain loopback)"
    res = subprocess.run(wrap(ns, ["tc", "qdisc", "show", "dev", "lo"]), capture_output=True,
                         text=True, timeout=30)
    return res.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description="manage the benchmark's network namespaces")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="remove hvdslim-bench-<pid> namespaces whose harness process is gone")
    args = ap.parse_args()
    if args.cleanup_stale:
        if shutil.which("ip") is None:
            return
        for name in cleanup_stale():
            print(f"removed stale namespace {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
