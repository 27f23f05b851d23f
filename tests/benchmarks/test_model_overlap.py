"""Horovod's allreduce overlapping a real backward: the cycle loop's replay against closed
forms, the step as the later of the CPU and wire paths, validate's calibrated form, and the
benchmark's measurement of when each gradient is ready."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from benchmarks.model import net as nw
from benchmarks.model import validate
from benchmarks.model.overlap import FUSION_BYTES, wire_end
from benchmarks.model.strategies import Scenario, predict
from benchmarks.model.workloads import numel, shapes_of
from benchmarks.ready import ReadyClock, profile

pytestmark = pytest.mark.bench

RATE = 1e8      # bytes per second of the fake allreduce: seconds = nbytes / RATE


def _linear(nbytes: float) -> float:
    return nbytes / RATE


def test_everything_ready_at_once_is_one_fused_allreduce():
    end, bufs = wire_end([(0.0, 1000), (0.0, 3000)], 4, _linear)
    assert bufs == [16000.0] and end == pytest.approx(16000 / RATE)


def test_a_late_tensor_waits_for_the_next_cycle_after_it_is_ready():
    # the wire is idle when the second tensor arrives at 0.5 s: it goes at the first cycle
    # start at or after 0.5 s, on the 1 ms grid that began at 0
    end, bufs = wire_end([(0.0, 10), (0.5004, 10)], 4, _linear)
    assert bufs == [40.0, 40.0]
    assert end == pytest.approx(0.501 + 40 / RATE, abs=1e-9)


def test_a_busy_wire_fuses_what_arrived_meanwhile():
    # 1 MB takes 10 ms; tensors arriving during it are fused into one buffer after it
    ready = [(0.0, 250_000)] + [(0.001 * i, 1000) for i in range(1, 6)]
    end, bufs = wire_end(ready, 4, _linear)
    assert bufs == [1e6, 20_000.0]
    assert end == pytest.approx(0.01 + 0.0002)


def test_the_fusion_threshold_splits_a_cycle_into_buffers_in_turn():
    big = FUSION_BYTES // 4 // 2 + 1          # two of these exceed the threshold
    end, bufs = wire_end([(0.0, big), (0.0, big), (0.0, 10)], 4, _linear)
    assert bufs == [4.0 * big, 4.0 * big + 40]
    assert end == pytest.approx(sum(bufs) / RATE)


def _scenario(ready, back, compute, rate=1e9):
    shapes = tuple(shapes_of("tiny"))
    net = nw.Network("switched", (rate,) * 4, latency_s=0.0)
    return Scenario(4, net, shapes, compute_s=compute, ready=ready, backward_end_s=back)


def test_horovod_is_the_later_of_the_cpu_path_and_the_wire_path():
    shapes = shapes_of("tiny")
    d = numel(shapes)
    # every gradient ready at 0.1 s, backward() returns at 0.1 s, the step's floor is 0.12 s
    ready = tuple((0.1, n) for n in (numel([s]) for s in shapes))
    slow = _scenario(ready, 0.1, 0.12, rate=1e7)          # the wire path dominates
    serial = predict("horovod", Scenario(4, slow.net, slow.shapes, compute_s=0.12))
    p = predict("horovod", slow)
    assert p.detail["overlapped"] and p.detail["allreduces"] == 1
    ring = serial.comm_s                                  # one allreduce of all of it
    assert p.detail["wire_end_s"] == pytest.approx(0.1 + ring)
    assert p.comm_s == pytest.approx(ring)
    assert p.seconds == pytest.approx(0.12 + max(p.local_s, ring))
    # ready earlier than backward()'s end: the wire hides behind the rest of backward
    early = tuple((0.0, k) for _, k in ready)
    q = predict("horovod", _scenario(early, 0.5, 0.52, rate=1e7))
    assert q.comm_s == pytest.approx(max(0.0, ring - 0.5))
    assert q.seconds == pytest.approx(0.52 + max(q.local_s, q.comm_s))
    # fp16 halves what is on the wire; mpi-allreduce never overlaps
    h = predict("horovod-fp16", slow)
    assert h.detail["handed"] == 2 * d and h.comm_s < p.comm_s
    assert not predict("mpi-allreduce", slow).detail.get("overlapped")


def test_a_profile_that_does_not_cover_the_model_is_refused():
    res = {"settings": {"ranks": 2, "model": "tiny", "net": "loopback"},
           "network": {"mode": "loopback"},
           "peers": {"floor": {"status": "ok", "median_s": 0.01, "backward_profile": {
               "names": ["a"], "numel": [5], "ready_s": [0.001], "backward_end_s": 0.002}}}}
    with pytest.raises(ValueError, match="covers 5 elements, the model"):
        validate.inputs_of(res)


def _file(tmp_path, name, net, floor, horovod, back):
    shapes = shapes_of("tiny")
    prof = {"names": [f"t{i}" for i in range(len(shapes))], "numel": [numel([s]) for s in shapes],
            "ready_s": [back * 0.5] * len(shapes), "backward_end_s": back, "steps": 3}
    res = {"settings": {"ranks": 4, "model": "tiny", "net": net["mode"]}, "network": net,
           "peers": {"floor": {"status": "ok", "median_s": floor, "backward_profile": prof},
                     "horovod": {"status": "ok", "median_s": horovod}}}
    path = tmp_path / name
    path.write_text(json.dumps(res))
    return str(path)


def test_validate_takes_the_calibrations_added_work_and_overlaps_the_wire(tmp_path, capsys):
    loop = {"mode": "loopback", "latency_ms": 0.0, "pingpong": {"gbit_per_s": 20.0}}
    cal = _file(tmp_path, "cal.json", loop, 0.011, 0.031, 0.008)
    switched = {"mode": "switched", "hosts": 4, "ranks_per_host": 1,
                "rate_gbit": [0.01] * 4, "latency_ms": 0.0}
    target = _file(tmp_path, "t.json", switched, 0.010, 0.2, 0.008)
    res = json.load(open(target, encoding="utf-8"))
    row = {r.peer: r for r in validate.rows_of(res, validate.inputs_of(res),
                                              validate.load_calibration(cal))}["horovod"]
    assert row.overlapped and row.local_m == pytest.approx(0.031 - 0.011)
    exposed = row.pred.comm_s
    assert exposed == pytest.approx(row.pred.detail["wire_end_s"] - 0.008) and exposed > 0.02
    assert row.seconds == pytest.approx(0.010 + max(0.020, exposed))
    assert cli_out(target, cal, capsys).count("overlapped, the wire ends") == 1


def cli_out(target, cal, capsys):
    from benchmarks.model.__main__ import main as cli
    cli(["validate", target, "--local-from", cal])
    return capsys.readouterr().out


def test_profile_keeps_the_slowest_rank_and_the_median_step():
    rank0 = [([0.1, 0.3], 0.4), ([0.2, 0.5], 0.6), ([0.1, 0.4], 0.5)]
    rank1 = [([0.3, 0.2], 0.45), ([0.1, 0.1], 0.2), ([0.2, 0.2], 0.3)]
    out = profile([rank0, rank1], ["a", "b"], [3, 4])
    # per step, the max over ranks: a 0.3 0.2 0.2, b 0.3 0.5 0.4
    assert out["ready_s"] == pytest.approx([0.2, 0.4])
    assert out["backward_end_s"] == pytest.approx(0.5)
    assert out["numel"] == [3, 4] and out["steps"] == 3 and out["ranks"] == 2
    assert profile([[], rank1], ["a", "b"], [3, 4]) == {}


def test_the_clock_sees_the_output_layer_before_the_input_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    clock = ReadyClock(list(model.named_parameters()))
    import time
    for _ in range(3):
        model.zero_grad()
        t0 = time.perf_counter()
        model(torch.randn(32, 64)).square().sum().backward()
        clock.mark(t0, time.perf_counter())
    clock.close()
    ready, end = clock.steps[-1]
    by = dict(zip(clock.names, ready))
    assert 0 < by["4.weight"] <= by["2.weight"] <= by["0.weight"] <= end
    assert clock.numel == [p.numel() for p in model.parameters()]
    model(torch.randn(2, 64)).sum().backward()      # closed: no more marks, no error
    assert len(clock.steps) == 3
