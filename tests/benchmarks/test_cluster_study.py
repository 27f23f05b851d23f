"""benchmarks.cluster_study's plan: every measured series has a loopback calibration with the
same model, ranks and peers (what ``validate --local-from`` pairs them by), and ``--only`` picks
jobs by tag or refuses an unknown one before anything runs."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import cluster_study as cs


def _opt(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_every_validated_series_has_a_calibration_with_its_settings():
    jobs = cs.plan(list(cs.SERIES), 12)
    cal = {(_opt(j["argv"], "--model"), _opt(j["argv"], "--ranks"),
            _opt(j["argv"], "--ranks-per-host")): j for j in jobs if j["series"] == "calibrate"}
    for j in jobs:
        if j["series"] in ("peers", "compute", "scaling", "hosts"):
            key = (_opt(j["argv"], "--model"), _opt(j["argv"], "--ranks"),
                   _opt(j["argv"], "--ranks-per-host"))
            assert key in cal, j["tag"]
            c = cal[key]
            assert _opt(c["argv"], "--net") == "loopback"
            # the calibration times at least the peers of the file it calibrates
            peers = _opt(j["argv"], "--peers")
            if peers is not None:
                assert set(peers.split(",")) <= set(_opt(c["argv"], "--peers").split(",")), \
                    j["tag"]
    compute = [j for j in jobs if j["series"] == "compute"]
    assert {_opt(j["argv"], "--model") for j in compute} == {"resnet18-real", "smallcnn"}


def test_only_runs_the_named_jobs_and_refuses_an_unknown_tag(monkeypatch, tmp_path, capsys):
    ran = []
    monkeypatch.setattr(cs.run, "main", lambda argv: ran.append(argv[argv.index("--tag") + 1])
                        or 0)
    monkeypatch.setattr(cs, "summarise", lambda results, out: "summary")
    rc = cs.main(["--series", "compute,calibrate", "--out", str(tmp_path),
                  "--only", "compute_smallcnn_4h_1g,calibrate_smallcnn_4r_loopback"])
    assert rc == 0 and ran == ["compute_smallcnn_4h_1g", "calibrate_smallcnn_4r_loopback"]
    with pytest.raises(SystemExit) as e:
        cs.main(["--series", "compute", "--out", str(tmp_path), "--only", "calibrate_x"])
    assert e.value.code == 2 and "--only: no job tagged calibrate_x" in capsys.readouterr().err
    assert ran == ["compute_smallcnn_4h_1g", "calibrate_smallcnn_4r_loopback"]


def test_importing_the_launchers_does_not_initialise_mpi():
    """mpi4py.MPI initialises MPI on import; a process that did so (a pytest run, a launcher)
    hands its singleton's variables to every mpirun it starts, and those jobs exit 1 with no
    output. The launchers import only what runs outside MPI."""
    code = ("import sys, benchmarks.cluster_study, benchmarks.run; "
            "print('mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
