"""benchmarks/demo.py (``make demo``): the switched cluster where it can be built, else the
loopback with a line saying so; the demo's own flags pass through. The launches are captured,
not run."""
from __future__ import annotations

import contextlib

import pytest

from benchmarks import cluster, demo, netem


@pytest.fixture
def launched(monkeypatch):
    calls = []

    def fake_run(argv, timeout, env, capture=True):
        calls.append((list(argv), dict(env)))
        return 0, "", 0.0

    monkeypatch.setattr(demo, "run_session", fake_run)
    return calls


def test_without_privileges_it_runs_on_the_loopback_and_says_so(monkeypatch, launched, capsys):
    def refuse():
        raise netem.NetemError("the emulated network needs root")

    monkeypatch.setattr(netem, "check_privileges", refuse)
    assert demo.main(["--np", "3", "--", "--train-subset", "512"]) == 0
    (argv, env), = launched
    assert argv[:3] == ["mpirun", "-np", "3"] and "ip" not in argv
    assert argv[-6:] == ["-m", "examples.demo", "--network", "loopback (one machine, no NIC)",
                         "--train-subset", "512"]
    assert env["OMP_NUM_THREADS"] == "1"
    out = capsys.readouterr().out
    assert "no switched cluster here (the emulated network needs root)" in out
    assert "loopback" in out


def test_as_root_each_rank_enters_its_host_of_the_switched_cluster(monkeypatch, launched):
    built = []

    @contextlib.contextmanager
    def fake_switched(spec):
        built.append(spec)
        yield cluster.Cluster(spec, "hvdslim-bench-1", "/tmp/enter_host.sh",
                              [f"hvdslim-bench-1-h{i}" for i in range(spec.hosts)])

    monkeypatch.setattr(netem, "check_privileges", lambda: None)
    monkeypatch.setattr(cluster, "switched", fake_switched)
    assert demo.main(["--np", "4", "--rate", "100mbit"]) == 0
    (spec,), ((argv, env),) = built, launched
    assert (spec.hosts, spec.rate) == (4, "100mbit")
    assert argv[:5] == ["ip", "netns", "exec", "hvdslim-bench-1-l", "mpirun"]
    wrapper = argv.index("/tmp/enter_host.sh")
    assert argv[wrapper + 2:wrapper + 4] == ["-m", "examples.demo"]
    assert argv[-1] == "switched cluster, 4 hosts with one 100mbit NIC each"
    assert env["MASTER_ADDR"] == f"{cluster.SUBNET}.1" and env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_a_bad_rate_is_an_error_not_a_fallback(launched):
    with pytest.raises(ValueError):
        demo.main(["--rate", "fast"])
    assert not launched
