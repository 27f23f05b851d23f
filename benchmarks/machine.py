"""What the benchmark ran on: machine, software versions, repository state, Horovod."""
from __future__ import annotations

import glob
import hashlib
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(argv: list, timeout: float = 30) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    return (res.stdout or res.stderr).strip()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    return 0.0


def describe() -> Dict[str, Any]:
    """Host, CPU, memory, kernel, Python/torch/numpy/mpi4py/Open MPI versions, git commit."""
    import mpi4py
    import numpy
    import torch
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    dirty_files = [] if dirty.startswith("unavailable") or "fatal" in dirty else dirty.splitlines()
    return {"hostname": platform.node(), "cpu": _cpu_model(), "logical_cpus": os.cpu_count(),
            "memory_gib": _mem_gib(), "kernel": platform.release(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "numpy": numpy.__version__, "mpi4py": mpi4py.__version__,
            "mpi": _run(["mpirun", "--version"]).splitlines()[0],
            "git_commit": _run(["git", "rev-parse", "HEAD"]),
            "git_modified_files": dirty_files[:50], **hvd_slim_source()}


def hvd_slim_source() -> Dict[str, str]:
    """Where the workers import hvd_slim from (the repository root comes first on their path)
    and a digest of its sources, so a result can be tied to the exact code it measured."""
    pkg = os.path.join(ROOT, "hvd_slim")
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(pkg, "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, pkg).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return {"hvd_slim_path": pkg, "hvd_slim_sha256": h.hexdigest()[:16]}


def horovod_status() -> str:
    """'' when ``import horovod.torch`` works in a fresh interpreter, else why not."""
    try:
        res = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not check ({exc})"
    if res.returncode == 0:
        return ""
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {res.returncode}"


def cpu_busy(seconds: float = 2.0) -> float:
    """Fraction of all CPUs busy over the next ``seconds`` (from /proc/stat); -1 if unknown.
    Sampled between jobs, when this harness runs nothing, it measures everyone else's load."""
    def sample() -> tuple:
        with open("/proc/stat", encoding="utf-8") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)   # idle + iowait
        return sum(vals), idle
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return -1.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_for_quiet(limit: float, max_wait: float) -> Dict[str, float]:
    """Block until others keep under ``limit`` of the CPUs busy, or ``max_wait`` seconds pass."""
    t0 = time.monotonic()
    busy = cpu_busy()
    while limit > 0 and busy > limit and time.monotonic() - t0 < max_wait:
        time.sleep(8)
        busy = cpu_busy()
    return {"cpu_busy_before": round(busy, 3), "waited_s": round(time.monotonic() - t0, 1),
            "loadavg_1m": os.getloadavg()[0]}
