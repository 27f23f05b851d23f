"""The model's queue of hvd_slim's pushes at the server's NIC (benchmarks/model/push_queue.py):
against the plain gather where every rank is ready at once, and against hand-computed queues
where they are not; and validate's reading of the calibration's measured ready times."""
import glob
import json
import os
from dataclasses import replace

import pytest

from benchmarks.model import net as nw
from benchmarks.model import validate
from benchmarks.model.push_queue import staggered_gather
from benchmarks.model.scenario import Scenario
from benchmarks.model.strategies import predict
from benchmarks.model.workloads import shapes_of

pytestmark = pytest.mark.bench

MBIT = 1e6
EACH = 12_500.0          # bytes: 1 ms at 100 Mbit/s


def switched(hosts=4, burst=()):
    return nw.Network("switched", (100 * MBIT,) * hosts, latency_s=0.0, burst_bytes=burst)


@pytest.mark.parametrize("burst", [(), (20_000.0,)])
@pytest.mark.parametrize("topology", ["switched", "shared"])
def test_ready_at_once_is_the_plain_gather(burst, topology):
    net = nw.Network(topology, (100 * MBIT,) * 4, latency_s=2e-5, burst_bytes=burst)
    plain = nw.gather(net, 4, 0, EACH)
    queued = staggered_gather(net, 4, 0, EACH, [(0.0, 0.0, 0.0, 0.0), (0.003,) * 4])
    assert queued.seconds == pytest.approx(plain.seconds)
    assert (queued.tx, queued.rx) == (plain.tx, plain.rx)
    assert staggered_gather(net, 4, 0, EACH, ()).seconds == plain.seconds   # nothing measured


def test_a_queue_by_hand():
    # Root 0 ready at 0; workers at 0, 0.5 ms and 5 ms, 1 ms of wire each, no bucket: pushes
    # land at 1 and 2 ms (the second queued behind the first), the last alone at 6 ms, 1 ms
    # after its rank was ready.
    out = staggered_gather(switched(), 4, 0, EACH, [(0.0, 0.0, 0.0005, 0.005)])
    assert out.seconds == pytest.approx(0.001)
    # Ready 0, 0, 0.5 ms, 1 ms: a queue from 0 to 3 ms, 2 ms after the last is ready.
    out = staggered_gather(switched(), 4, 0, EACH, [(0.0, 0.0, 0.0005, 0.001)])
    assert out.seconds == pytest.approx(0.002)
    # The server is the last ready (4 ms): every push has landed by then, nothing is added.
    assert staggered_gather(switched(), 4, 0, EACH, [(0.004, 0.0, 0.0, 0.0)]).seconds == 0.0


def test_the_bucket_refills_while_the_ingress_is_idle():
    # A 6250-byte bucket (0.5 ms of wire): each push after an idle spell of at least 0.5 ms
    # passes half free; back to back, only the first does.
    net = switched(burst=(6250.0 * 1.0,))
    spaced = staggered_gather(net, 4, 0, EACH, [(0.0, 0.0, 0.002, 0.004)])
    assert spaced.seconds == pytest.approx(0.0005)
    together = staggered_gather(net, 4, 0, EACH, [(0.0,) * 4])
    assert together.seconds == pytest.approx(0.0025) == nw.gather(net, 4, 0, EACH).seconds


def test_a_sender_cannot_push_faster_than_its_own_nic():
    # A slow host 3 (25 Mbit/s: 4 ms for the push) is the last: its push lands 4 ms after it
    # is ready, although the server's ingress is idle.
    net = nw.Network("switched", (100 * MBIT,) * 3 + (25 * MBIT,), latency_s=0.0)
    out = staggered_gather(net, 4, 0, EACH, [(0.0, 0.0, 0.0, 0.010)])
    assert out.seconds == pytest.approx(0.004)


def test_the_median_over_steps():
    steps = [(0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.010), (0.0, 0.0, 0.0, 0.010)]
    assert staggered_gather(switched(), 4, 0, EACH, steps).seconds == pytest.approx(0.001)


def test_a_ready_vector_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="3 times for 4 ranks"):
        staggered_gather(switched(), 4, 0, EACH, [(0.0, 0.0, 0.0)])


def test_hvd_slims_step_uses_the_queue():
    sc = Scenario(4, switched(), shapes_of("cnn1m"))
    plain = predict("hvd_slim-slim@0.01", sc)
    late = tuple((0.0, 0.001, 0.002, 0.003) for _ in range(3))
    queued = predict("hvd_slim-slim@0.01", replace(sc, push_ready=late))
    assert queued.comm_s < plain.comm_s
    assert (queued.tx, queued.rx) == (plain.tx, plain.rx)
    # Every other strategy ignores it.
    assert predict("topk-ef@0.01", replace(sc, push_ready=late)).comm_s == \
        predict("topk-ef@0.01", sc).comm_s


def test_validate_reads_the_calibrations_prepare_phases():
    steps = [[{"prepare": 0.001 * (j + 1) + 0.01 * i, "push": 0.0} for i in range(3)]
             for j in range(4)]
    peer = {"status": "ok", "median_s": 0.1, "rank_phase_steps_s": steps}
    ready = validate.push_ready("hvd_slim-slim@0.01", peer, 4)
    assert ready == tuple(tuple(0.001 * (j + 1) + 0.01 * i for j in range(4)) for i in range(3))
    # Only the flat single-server exchange queues its pushes at one NIC; other ranks, failed
    # runs and files without phases give nothing.
    assert validate.push_ready("hvd_slim-sharded@0.01", peer, 4) == ()
    assert validate.push_ready("topk-ef@0.01", peer, 4) == ()
    assert validate.push_ready("hvd_slim-slim@0.01", peer, 8) == ()
    assert validate.push_ready("hvd_slim-slim@0.01", {**peer, "status": "failed"}, 4) == ()
    assert validate.push_ready("hvd_slim-slim@0.01", {"status": "ok", "median_s": 0.1}, 4) == ()


PHASES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "benchmarks", "results", "cluster_phases")


def test_the_phases_sitting_is_predicted_within_25_percent():
    """The sitting of 4 December evening (docs/performance.md, "The cost model"), whose
    calibrations recorded every rank's phases: every scored step within 25%, the single server
    at 4 and 8 hosts included, and its pushes queued (a smaller wire time than the plain
    gather's) wherever the ranks outnumber the cores."""
    calibs = [validate.load_calibration(p)
              for p in sorted(glob.glob(os.path.join(PHASES, "calibrate_*.json")))]
    scored = 0
    for hosts in (2, 4, 8):
        path = os.path.join(PHASES, f"scaling_cnn1m_{hosts}h_100m.json")
        _, bad = validate.report(path, 0.25, calibs)
        assert not bad, [(hosts, r.peer, round(r.error, 3)) for r in bad]
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        c = validate.calibration_for(res, calibs, path)
        rows = validate.rows_of(res, validate.inputs_of(res), c, validate.load_index(res, c)[0])
        scored += sum(r.peer != "floor" for r in rows)
        slim = {r.peer: r for r in rows if r.peer.startswith("hvd_slim-slim")}
        assert set(slim) == {"hvd_slim-slim@0.02", "hvd_slim-slim@0.01"}
        if hosts > 2:   # more ranks than the 2 cores: the queue hides part of the push
            plain = validate.inputs_of(res).scenario
            for name, r in slim.items():
                assert r.pred.comm_s < predict(name, plain, r.peer_rec["select_ms_per_step"]
                                               / 1e3).comm_s, name
    assert scored == 21
