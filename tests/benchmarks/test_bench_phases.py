"""The results' table of hvd_slim's phase timings (benchmarks/phases.py): medians by hand on a
made-up record, and what the recorded sitting shows (only the server serves)."""
import json
import os

import pytest

from benchmarks import phases

pytestmark = pytest.mark.bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def step(prepare, push, serve, pull, apply):
    return {"prepare": prepare, "push": push, "serve": serve, "pull": pull, "apply": apply}


def test_rows_are_per_rank_medians_then_the_others_median():
    server = [step(0.004, 0.010, 0.005, 0.0, 0.002), step(0.006, 0.012, 0.007, 0.0, 0.002),
              step(0.005, 0.030, 0.006, 0.0, 0.003)]
    worker = lambda x: [step(x, 0.0, 0.0, 0.020, 0.002)] * 3   # noqa: E731
    peer = {"status": "ok", "rank_phase_steps_s": [server, worker(0.004), worker(0.008),
                                                   worker(0.005)]}
    rows = phases.phase_rows("hvd_slim-slim@0.01", peer)
    assert rows == [
        "| hvd_slim-slim@0.01 | rank 0 (server) | 5.0 | 12.0 | 6.0 | 0.0 | 2.0 | 25.0 |",
        "| hvd_slim-slim@0.01 | other 3 (median) | 5.0 | 0.0 | 0.0 | 20.0 | 2.0 | 27.0 |"]
    assert phases.phase_rows("x", {"status": "ok"}) == []
    assert phases.phase_rows("x", {**peer, "status": "failed"}) == []
    one = {"status": "ok", "rank_phase_steps_s": [server]}
    assert len(phases.phase_rows("x", one)) == 1


def test_the_table_of_the_phases_sitting():
    path = os.path.join(ROOT, "benchmarks", "results", "cluster_phases",
                        "scaling_cnn1m_8h_100m.json")
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    lines = phases.table(res)
    rows = [line.split(" | ") for line in lines if line.startswith("| hvd_slim")]
    by = {(r[0][2:], r[1]): [float(x) for x in r[2:7]] for r in rows}
    single = by[("hvd_slim-slim@0.01", "rank 0 (server)")]
    workers = by[("hvd_slim-slim@0.01", "other 7 (median)")]
    # One server serves; the workers wait for it in the pull, the server for them in the push.
    assert single[2] > 1.0 and workers[2] == 0.0
    assert single[1] > workers[1] and workers[3] > single[3]
    # servers=8: every rank serves its shard.
    assert by[("hvd_slim-sharded@0.01", "other 7 (median)")][2] > 0.0
    assert phases.table({"peers": {"floor": {"status": "ok"}}}) == []
