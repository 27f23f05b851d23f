"""The one-process hook-cost probe (benchmarks/hook_cost.py) on the tiny shapes, run as a user
runs it (``python -m``, its own Gloo group in its own process): every series runs and its ratios
are the medians' own."""
import json
import subprocess
import sys

import pytest

from tests.mpi_launch import ROOT


def test_the_probe_times_every_path_and_reads_its_ratios(tmp_path):
    out = tmp_path / "hook_cost.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.hook_cost", "--model", "tiny",
                           "--steps", "2", "--repeats", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    med = r["medians_s"]
    assert set(med) == {"backward", "sgd", "do", "hook", "hook_1b", "hook_1bv"}
    assert r["cost_s"] == pytest.approx({s: med[s] - med["backward"] for s in med
                                         if s != "backward"})
    for s in ("hook", "hook_1b", "hook_1bv"):
        assert r["over_do"][s] == pytest.approx(r["cost_s"][s] / r["cost_s"]["do"])
        assert f"{r['over_do'][s]:.2f}x DistributedOptimizer" in proc.stdout
    assert r["do_over_sgd"] == pytest.approx(r["cost_s"]["do"] / r["cost_s"]["sgd"])
    assert len(r["load"]) == 2 and r["tensors"] == 6
