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


# ---- the switched cluster (benchmarks/cluster.py) ----------------------------------------------

def test_cluster_spec_refuses_bad_shapes():
    from benchmarks import cluster
    with pytest.raises(ValueError, match="one rate per host"):
        cluster.ClusterSpec(hosts=3, host_rates=("1gbit", "1gbit"))
    with pytest.raises(ValueError, match="write it as tc does"):
        cluster.ClusterSpec(hosts=2, rate="fast")
    with pytest.raises(ValueError, match="at least 1"):
        cluster.ClusterSpec(hosts=0)
    spec = cluster.ClusterSpec(hosts=2, ranks_per_host=2)
    assert spec.ranks == 4 and [spec.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert cluster.rate_bps("2.5gbit") == 2.5e9 and cluster.rate_bps("100mbit") == 1e8


def test_switched_needs_root_and_says_so(monkeypatch):
    from benchmarks import cluster
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/sbin/{name}")
    with pytest.raises(netem.NetemError, match=r"needs root .*--net loopback"):
        with cluster.switched(cluster.ClusterSpec(hosts=2)):
            pytest.fail("must not get here")


_FLOW = ("import socket, sys, time\n"
         "if sys.argv[1] == 'serve':\n"
         "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "    s.bind(('0.0.0.0', 5201)); s.listen(1); c, _ = s.accept(); n = 0; t = None\n"
         "    while True:\n"
         "        b = c.recv(1 << 20)\n"
         "        if not b: break\n"
         "        t = t or time.perf_counter(); n += len(b)\n"
         "    print(n, 8 * n / (time.perf_counter() - t) / 1e6)\n"
         "else:\n"
         "    for _ in range(100):\n"
         "        try: s = socket.create_connection((sys.argv[2], 5201)); break\n"
         "        except OSError: time.sleep(0.05)\n"
         "    s.sendall(bytes(8 << 20)); s.close()\n")


@pytest.mark.skipif(not can_make, reason="needs root and iproute2")
def test_two_host_cluster_is_shaped_counted_and_removed():
    """Two hosts at 100 Mbit/s: a flow between them runs at about that rate, each host's NIC
    counts it, and every namespace is gone afterwards, also after an error."""
    from benchmarks import cluster
    spec = cluster.ClusterSpec(hosts=2, rate="100mbit")
    with pytest.raises(RuntimeError, match="boom"):
        with cluster.switched(spec) as c:
            names = [*c.hosts, c.switch, c.launcher]
            assert set(names) <= set(netem.ours())
            before = c.nic_counters()
            server = subprocess.Popen(["ip", "netns", "exec", c.hosts[1], sys.executable, "-c",
                                       _FLOW, "serve"], stdout=subprocess.PIPE, text=True)
            client = subprocess.run(["ip", "netns", "exec", c.hosts[0], sys.executable, "-c",
                                     _FLOW, "send", c.addr(1)], capture_output=True, text=True,
                                    timeout=60)
            assert client.returncode == 0, client.stderr
            got, mbit = server.communicate(timeout=30)[0].split()
            assert int(got) == 8 << 20
            assert 60 < float(mbit) < 110, mbit   # shaped: not the veth's tens of Gbit/s
            after = c.nic_counters()
            assert after[0]["tx"] - before[0]["tx"] >= 8 << 20
            assert after[1]["rx"] - before[1]["rx"] >= 8 << 20
            assert "rate 100Mbit" in c.describe()["qdisc_host0"]
            raise RuntimeError("boom")
    assert not set(names) & set(netem.ours())


@pytest.mark.skipif(not can_make or shutil.which("mpirun") is None,
                    reason="needs root, iproute2 and Open MPI")
def test_benchmark_runs_on_a_two_host_switched_cluster(tmp_path):
    """`make bench`'s default network, small: every rank in its own host, NIC bytes counted."""
    cmd = [sys.executable, "-m", "benchmarks.run", "--ranks", "2", "--model", "tiny",
           "--steps", "2", "--warmup", "1", "--no-isolate", "--pingpong-mib", "1",
           "--peers", "floor,mpi-allreduce,hvd_slim-slim@0.01", "--densities", "0.01",
           "--pulls", "slim", "--out", str(tmp_path), "--tag", "sw", "--timeout", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json
    res = json.loads((tmp_path / "sw.json").read_text())
    assert res["network"]["mode"] == "switched" and res["network"]["hosts"] == 2
    dense = res["peers"]["mpi-allreduce"]
    nic = dense["nic_bytes_per_step"]
    # a 2-rank ring sends each rank's whole buffer once: the NIC counts at least that
    assert nic["busiest_tx"] >= dense["handed_sent_per_step"] * 0.99
    slim = res["peers"]["hvd_slim-slim@0.01"]
    assert slim["nic_bytes_per_step"]["busiest_rx"] < nic["busiest_rx"] / 5
    assert not [n for n in netem.ours() if n.startswith(f"{netem.PREFIX}")
                and n.split("-")[2].isdigit() and int(n.split("-")[2]) == proc.pid]
