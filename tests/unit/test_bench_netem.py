"""The benchmark's emulated network: refused clearly without privileges, always torn down."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import netem

pytestmark = pytest.mark.slow  # starts real processes: not in `pytest -m unit`

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
can_make = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")


def test_loopback_needs_no_namespace(monkeypatch):
    monkeypatch.setattr(netem, "_ip", lambda *a, **k: pytest.fail("loopback must not call ip"))
    with netem.namespace("loopback") as ns:
        assert ns is None
    assert netem.wrap(None, ["mpirun"]) == ["mpirun"]


def test_refuses_clearly_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/sbin/{name}")
    with pytest.raises(netem.NetemError, match=r"needs root .*--net loopback"):
        with netem.namespace("tbf1g"):
            pytest.fail("must not get here")


def test_refuses_clearly_without_iproute2(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(netem.NetemError, match="iproute2"):
        netem.check_privileges()


@pytest.mark.skipif(not can_make, reason="needs root and iproute2")
def test_namespace_is_shaped_and_removed_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with netem.namespace("tbf1g") as ns:
            assert ns == f"{netem.PREFIX}{os.getpid()}" and ns in netem.ours()
            assert "rate 1Gbit" in netem.qdisc(ns)
            raise RuntimeError("boom")
    assert ns not in netem.ours()


@pytest.mark.skipif(not can_make, reason="needs root and iproute2")
def test_namespace_is_removed_on_sigterm():
    code = ("import time; from benchmarks import netem\n"
            "with netem.namespace('tbf10g') as ns:\n"
            "    print(ns, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    name = proc.stdout.readline().strip()
    assert name in netem.ours()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert name not in netem.ours()


@pytest.mark.skipif(not can_make, reason="needs root and iproute2")
def test_stale_namespaces_of_dead_runs_are_removed():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    name = f"{netem.PREFIX}{proc.pid}"   # a pid that has just exited
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        time.sleep(0.05)
        assert name in netem.cleanup_stale()
        assert name not in netem.ours()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
