"""The one-process step-cost probe (benchmarks/step_cost.py) on the tiny shapes: every series
runs, the ratios are the medians' own, and the phases come from the steady steps only."""
import pytest

from benchmarks.step_cost import measure


def test_the_probe_measures_every_series_and_its_ratios():
    r = measure("tiny", steps=2, repeats=2)
    assert r["tensors"] == 6 and r["numel"] == 147752
    med = r["medians_s"]
    assert r["slim_over_sgd"] == pytest.approx(
        (med["slim"] - med["backward"]) / (med["sgd"] - med["backward"]))
    assert r["tensors_over_flat"] == pytest.approx(
        (med["slim"] - med["backward"]) / (med["flat_slim"] - med["flat_backward"]))
    assert r["warmup_steps"] > 0 and r["warmup_over_steady"] > 0
    assert set(r["phases_s"]) == {"prepare", "select", "serve", "apply"}
    assert all(v > 0 for v in r["phases_s"].values())
    assert len(r["load"]) == 2
