"""The cost model (benchmarks/model) against closed forms, against hvd_slim's own byte counters
(the fake transport at the current defaults) and against the bytes counted in the shared-link
benchmark (benchmarks/results/resnet18_4r_tbf1g.json, made before value_bits existed)."""
import importlib.util
import json
import math
import os
import zlib
from dataclasses import replace

import pytest
import torch

from benchmarks.model import bcast as bc
from benchmarks.model import net as nw
from benchmarks.model import validate
from benchmarks.model.__main__ import main as cli
from benchmarks.model.slim import (V1_DEFAULTS, SlimSettings, defaults_at, pull_density_of,
                                   step_bytes, union_size, with_env)
from benchmarks.model.strategies import (FLOOR_PASSES, PASSES, LocalCosts, Scenario, parse,
                                         predict)
from benchmarks.model.workloads import numel, powersgd_sizes, shapes_of, split, \
    transformer_shapes
from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.transport import run_ranks

pytestmark = pytest.mark.bench

# The benchmark's tbf bucket at 1 Gbit/s (benchmarks/cluster.burst: 122 KiB), in payload bytes.
FREE_1G = 122 * 1024 / nw.ETH_FRAME_OVERHEAD
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD = os.path.join(ROOT, "benchmarks", "results", "resnet18_4r_tbf1g.json")
GBIT = 1e9


def switched(n_hosts=4, rate=GBIT, latency=0.0, **kw):
    rates = rate if isinstance(rate, tuple) else (rate,) * n_hosts
    return nw.Network("switched", rates, latency_s=latency, **kw)


# --- transfer primitives -------------------------------------------------------------------
def test_ring_allreduce_is_the_closed_form():
    lat = 20e-6
    cost = nw.ring_allreduce(switched(latency=lat), 4, 4e6)   # d = 1e6 fp32
    assert cost.seconds == pytest.approx(2 * 3 / 4 * 4e6 * 8 / 1e9 + 2 * 3 * lat, rel=1e-12)
    assert cost.phases == 6
    assert cost.tx == pytest.approx([2 * 3 / 4 * 4e6] * 4)
    assert cost.rx == pytest.approx([2 * 3 / 4 * 4e6] * 4)


def test_a_shared_link_multiplies_the_bandwidth_term_by_n():
    for n in (2, 4, 7):
        sw = nw.ring_allreduce(switched(n), n, 8e6).seconds
        sh = nw.ring_allreduce(nw.Network("shared", (GBIT,), latency_s=0.0), n, 8e6).seconds
        assert sh == pytest.approx(n * sw, rel=1e-12)
        assert sh == pytest.approx(2 * (n - 1) * 8e6 * 8 / GBIT, rel=1e-12)


def test_a_quarter_rate_host_slows_the_ring_four_times():
    base = nw.ring_allreduce(switched(), 4, 4e6).seconds
    slow = nw.ring_allreduce(switched(rate=(GBIT, GBIT, GBIT / 4, GBIT)), 4, 4e6).seconds
    assert slow == pytest.approx(4 * base, rel=1e-12)


def test_server_ingress_is_shared_by_n_minus_one_pushes():
    lat, push = 7e-6, 1.5e6
    for n in (2, 5, 16):
        cost = nw.gather(switched(n, latency=lat), n, 0, push)
        assert cost.seconds == pytest.approx((n - 1) * push * 8 / GBIT + lat, rel=1e-12)
        assert cost.rx[0] == (n - 1) * push and max(cost.rx[1:]) == 0
        assert cost.tx[0] == 0 and cost.tx[1:] == [push] * (n - 1)
    # A slow server NIC is the bottleneck; a slow worker is not, while its push is shorter.
    slow_server = nw.gather(switched(4, rate=(GBIT / 4, GBIT, GBIT, GBIT)), 4, 0, push)
    assert slow_server.seconds == pytest.approx(4 * 3 * push * 8 / GBIT)
    slow_worker = nw.gather(switched(4, rate=(GBIT, GBIT, GBIT, GBIT / 2)), 4, 0, push)
    assert slow_worker.seconds == pytest.approx(3 * push * 8 / GBIT)


def test_tree_allreduces_take_log_n_steps():
    n, b, lat = 8, 1e6, 3e-6
    rd = nw.recursive_doubling_allreduce(switched(n, latency=lat), n, b)
    assert rd.phases == 3
    assert rd.seconds == pytest.approx(3 * (b * 8 / GBIT + lat))
    rab = nw.rabenseifner_allreduce(switched(n, latency=lat), n, b)
    assert rab.phases == 6
    assert rab.tx == pytest.approx([2 * (n - 1) / n * b] * n)   # the ring's volume
    assert rab.seconds == pytest.approx(2 * (n - 1) / n * b * 8 / GBIT + 6 * lat)


def test_broadcasts():
    b, lat = 1e6, 4e-6
    lin = bc.bcast_linear(switched(4, latency=lat), 4, 0, b)
    assert lin.seconds == pytest.approx(3 * b * 8 / GBIT + lat) and lin.tx[0] == 3 * b
    binom = bc.bcast_binomial(switched(8, latency=lat), 8, 0, b)
    # libnbc's schedule: the root sends its 3 copies at once, vrank 1 its 2, then vrank 3 one,
    # so the path 0 -> 1 -> 3 -> 7 takes 3 + 2 + 1 message times.
    assert binom.phases == 3 and binom.seconds == pytest.approx(6 * b * 8 / GBIT + 3 * lat)
    assert sum(binom.rx) == 7 * b and binom.rx[0] == 0
    assert binom.tx == pytest.approx([3 * b, 2 * b, b, b, 0, 0, 0, 0])
    assert [bc.binomial_children(v, 8) for v in range(4)] == [[1, 2, 4], [3, 5], [6], [7]]
    assert bc.binomial_children(0, 6) == [1, 2, 4] and bc.binomial_children(1, 6) == [3, 5]
    seg = 32768
    chain = bc.bcast_chain(switched(8, latency=lat), 8, 0, b, seg)
    nseg = math.ceil(b / seg)
    assert chain.seconds == pytest.approx((nseg + 6) * seg * 8 / GBIT + 7 * lat)
    assert chain.tx == pytest.approx([b] * 7 + [0]) and chain.rx == pytest.approx([0] + [b] * 7)
    # On a shared link the chain carries the message n-1 times.
    sh = bc.bcast_chain(nw.Network("shared", (GBIT,), latency_s=0), 8, 0, b, seg)
    assert sh.seconds == pytest.approx(7 * b * 8 / GBIT)


def test_libnbc_picks_by_size_and_reads_the_datatype_only_when_told():
    assert bc.libnbc_ibcast(4, 1e8) == ("linear", 0)
    assert bc.libnbc_ibcast(5, 1000) == ("binomial", 0)
    # Open MPI 4.1.4's default (coll_libnbc_ibcast_skip_dt_decision): the size alone decides.
    assert bc.libnbc_ibcast(64, 100_000) == ("binomial", 0)
    assert bc.libnbc_ibcast(8, 10_000_000) == ("binomial", 0)
    assert bc.libnbc_ibcast(64, 100_000, skip_dt_decision=False) == ("chain", 8192)
    assert bc.libnbc_ibcast(64, 10_000_000, skip_dt_decision=False) == ("chain", 32768)


def test_ranks_of_one_host_do_not_touch_its_nic():
    net = switched(2, latency=1e-6, ranks_per_host=2)
    cost = nw.phase(net, 4, [(0, 1, 1e6), (2, 3, 1e6)])
    assert cost.seconds == pytest.approx(1e-6) and cost.tx == [0, 0]
    cost = nw.phase(net, 4, [(1, 2, 1e6)])
    assert cost.tx == [1e6, 0] and cost.rx == [0, 1e6]


def test_the_busiest_rank_pays_the_overhead_of_each_of_its_messages():
    o = 30e-6
    net = switched(8, overhead_s=o)
    assert nw.gather(net, 8, 0, 1000).seconds == pytest.approx(7000 * 8 / GBIT + 7 * o)
    ring = nw.ring_allreduce(net, 8, 8000)
    assert ring.seconds == pytest.approx(14 * (1000 * 8 / GBIT + o))


def test_nic_counters_carry_the_frame_overhead_but_time_does_not():
    plain = nw.ring_allreduce(switched(), 4, 4e6)
    framed = nw.ring_allreduce(switched(frame_overhead=nw.ETH_FRAME_OVERHEAD), 4, 4e6)
    assert framed.seconds == plain.seconds
    assert framed.tx[0] == pytest.approx(plain.tx[0] * 1514 / 1448)
    acked = nw.gather(switched(ack_overhead=nw.ETH_ACK_OVERHEAD), 4, 0, 1e6)
    assert acked.rx[0] == 3e6 and acked.tx[0] == pytest.approx(3e6 * 66 / 2896)
    assert acked.tx[1] == 1e6 and acked.rx[1] == pytest.approx(1e6 * 66 / 2896)


# --- workloads and strategies --------------------------------------------------------------
def test_shapes():
    assert numel(shapes_of("resnet18")) == 11_689_512
    assert numel(shapes_of("resnet50")) == 25_557_032
    t = transformer_shapes()
    assert 1.2e9 < numel(t) < 1.35e9
    assert split(shapes_of("resnet18"), 4096) == (11_678_912, 10_600)


def test_names_parse_and_unknown_ones_fail():
    assert parse("hvd_slim-union@0.001") == ("hvd_slim", {"pull": "union", "density": 0.001})
    assert parse("ddp-powersgd-r4") == ("ddp-powersgd", {"rank": 4})
    assert parse("topk-ef@0.1") == ("topk-ef", {"density": 0.1})
    with pytest.raises(ValueError, match="no model for peer"):
        parse("gossip@3")


def test_dense_fp16_halves_the_bytes_and_local_work_counts_passes():
    shapes = ((1000, 1000),)
    sc = Scenario(4, switched(), shapes, compute_s=0.5, local=LocalCosts(pass_s=1e-9))
    fp32, fp16 = predict("horovod", sc), predict("horovod-fp16", sc)
    assert fp32.comm_s == pytest.approx(2 * fp16.comm_s, rel=1e-9)
    assert fp32.busiest_rx == pytest.approx(2 * 3 / 4 * 4e6)
    assert fp32.local_s == pytest.approx(PASSES["horovod"] * 1e6 * 1e-9)
    assert fp32.seconds == pytest.approx(0.5 + fp32.local_s + fp32.comm_s)


# --- bytes against counted bytes ---------------------------------------------------------
@pytest.fixture(scope="module")
def old():
    with open(OLD, encoding="utf-8") as f:
        return json.load(f)


def test_powersgd_and_topk_bytes_match_the_counted_buffers(old):
    shapes = shapes_of("resnet18")
    for r in (1, 4):
        p, q, unc = powersgd_sizes(shapes, r)
        assert 4 * (p + q + unc) == old["peers"][f"ddp-powersgd-r{r}"]["handed_sent_per_step"]
    sc = Scenario(4, nw.Network("shared", (GBIT,)), tuple(shapes))
    for dens in (0.1, 0.01, 0.001):
        got = predict(f"topk-ef@{dens:g}", sc)
        rec = old["peers"][f"topk-ef@{dens:g}"]
        assert got.detail["payload"] + 4 * 10_600 == rec["handed_sent_per_step"]
        assert got.sent_per_rank == pytest.approx(rec["bytes_sent_per_step"], rel=1e-12)


def test_hvd_slim_bytes_match_the_old_benchmark(old):
    """Push and slim pull exactly, union pull (a model of the union's size) within 3%."""
    big, small = split(shapes_of("resnet18"), V1_DEFAULTS.min_compress_numel)
    for name, rec in old["peers"].items():
        if not name.startswith("hvd_slim"):
            continue
        pull, dens = name[len("hvd_slim-"):].split("@")
        s = replace(V1_DEFAULTS, density=float(dens), pull=pull)
        b = step_bytes(big, small, 4, s)
        assert b.push == rec["bytes_sent_per_step"], name
        if pull == "slim":
            assert b.pull == rec["bytes_recv_per_step"], name
        else:
            assert b.pull == pytest.approx(rec["bytes_recv_per_step"], rel=0.03), name


def test_the_old_benchmark_predates_value_bits():
    commit = json.load(open(OLD, encoding="utf-8"))["machine"]["git_commit"]
    got = defaults_at(commit)
    if got is None:
        pytest.skip("no git history here to place the benchmark's commit")
    assert got == V1_DEFAULTS
    assert defaults_at("HEAD") == SlimSettings()
    assert pull_density_of(0.001, "v1") == 0.004 and pull_density_of(0.1, "v1") == 0.1
    assert pull_density_of(0.1) == 0.2


def test_env_overrides_settings():
    s = with_env(SlimSettings(), ["HVD_SLIM_VALUE_BITS=16", "HVD_SLIM_PULL_DENSITY=none",
                                  "OMP_NUM_THREADS=1", "HVD_SLIM_EXPLORATION=0"])
    assert (s.value_bits, s.pull_density, s.exploration) == (16, None, 0.0)


SHAPES = {"conv.weight": (20, 10, 5, 5), "fc.weight": (30, 200), "fc.bias": (30,),
          "norm.weight": (30,)}


def _counted(size, pull, steps=3):
    """Per-step bytes_pushed / bytes_pulled of rank 1 over the fake transport, at hvd_slim's
    current defaults (min_compress_numel lowered so that the two matrices are compressed)."""
    config = SlimConfig(min_compress_numel=1000, pull=pull, warmup_decay_steps=0)

    def rank_fn(rank, transport):
        named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        for t in range(steps):
            for name, p in named:
                g = torch.Generator().manual_seed(zlib.crc32(f"{rank}|{t}|{name}".encode()))
                p.grad = torch.randn(p.shape, generator=g) * torch.rand(p.shape, generator=g)
            ex.step()
        return ex.stats.bytes_pushed / steps, ex.stats.bytes_pulled / steps

    return run_ranks(size, rank_fn)[1]


@pytest.mark.parametrize("size", [2, 3])
def test_hvd_slim_bytes_match_its_own_counters_at_the_current_defaults(size):
    shapes = list(SHAPES.values())
    big, small = split(shapes, 1000)
    s = SlimSettings(min_compress_numel=1000)
    b = step_bytes(big, small, size, s)
    push, pull = _counted(size, "slim")
    assert (b.push, b.pull) == (push, pull)
    assert b.pull > b.push   # the default pull is twice the push
    u = step_bytes(big, small, size, SlimSettings(min_compress_numel=1000, pull="union"))
    push, pull = _counted(size, "union")
    assert u.push == push
    assert u.pull == pytest.approx(pull, rel=0.10)


def test_the_union_grows_with_n_until_dense():
    d, k = 1_000_000, 10_000
    sizes = [union_size(d, k, n) for n in (1, 2, 8, 64, 1024)]
    assert sizes[0] == pytest.approx(k) and sizes == sorted(sizes)
    assert sizes[-1] == pytest.approx(d, rel=1e-4)
    assert step_bytes(d, 0, 4, SlimSettings(density=0.01, pull="union")).pull_mode == "explicit"
    dense = step_bytes(d, 0, 1024, SlimSettings(density=0.01, pull="union"))
    assert dense.pull_mode == "dense" and dense.pull == 8 + 32 + 16 + 4 * d


def test_hvd_slim_step_is_its_phases_in_series():
    shapes = ((4000, 1000), (100,))
    n, lat = 8, 5e-6
    sc = Scenario(n, switched(n, rate=10 * GBIT, latency=lat), shapes)
    got = predict("hvd_slim-slim@0.01", sc)
    b = step_bytes(4_000_000, 100, n, SlimSettings(density=0.01))
    net = sc.net
    want = (nw.bruck_allgather(net, n, 352).seconds + nw.gather(net, n, 0, b.push).seconds
            + bc.bcast(net, n, 0, 8).seconds + bc.bcast(net, n, 0, b.pull).seconds)
    assert got.comm_s == pytest.approx(want, rel=1e-12) and got.local_s == 0
    assert got.detail["bcast"] == "binomial"   # libnbc by size alone, 8 > 4 ranks
    assert got.busiest_rx == pytest.approx((n - 1) * b.push + (n - 1) * 352, rel=1e-9)


# --- validate and extrapolate ----------------------------------------------------------------
def _synthetic(tmp_path, factor):
    """A switched-cluster results file for the "tiny" shapes: the floor, and mpi-allreduce at
    ``factor`` times its closed form (floor + its 3 passes at floor/(4 d) + the ring, whose
    first phase sends its first FREE_1G bytes a NIC from the full token bucket)."""
    d = numel(shapes_of("tiny"))
    floor, lat = 0.01, 1e-4
    ring = 2 * 3 / 4 * 4 * d * 8 / GBIT + 6 * lat - FREE_1G * 8 / GBIT
    want = floor + PASSES["mpi-allreduce"] * floor / FLOOR_PASSES + ring
    wire = 2 * 3 / 4 * 4 * d
    res = {"settings": {"ranks": 4, "model": "tiny", "net": "switched"},
           "network": {"mode": "switched", "hosts": 4, "ranks_per_host": 1,
                       "rate_gbit": [1, 1, 1, 1], "latency_ms": lat * 1e3},
           "peers": {"floor": {"status": "ok", "median_s": floor, "select_ms_per_step": 0.0},
                     "mpi-allreduce": {"status": "ok", "median_s": factor * want,
                                       "select_ms_per_step": 0.0,
                                       "bytes_sent_per_step": wire,
                                       "nic_bytes_per_step": {"busiest_tx": 1.05 * wire,
                                                              "busiest_rx": 1.05 * wire}}}}
    path = tmp_path / f"r{factor}.json"
    path.write_text(json.dumps(res))
    return str(path)


def test_validate_passes_within_tolerance_and_fails_beyond(tmp_path, capsys):
    good, bad = _synthetic(tmp_path, 1.0), _synthetic(tmp_path, 1.5)
    assert cli(["validate", good]) == 0
    out = capsys.readouterr().out
    assert "| mpi-allreduce |" in out and "+0.0%" in out and "max |error| 0.0%" in out
    assert cli(["validate", bad]) == 1
    assert "-33.3%" in capsys.readouterr().out
    assert cli(["validate", good, bad]) == 1
    assert cli(["validate", bad, "--tolerance", "0.4"]) == 0


def test_validate_reads_the_old_shared_file(old):
    inp = validate.inputs_of(old)
    sc = inp.scenario
    assert sc.net.topology == "shared" and sc.ranks == 4
    assert sc.compute_s == old["peers"]["floor"]["median_s"]
    assert sc.net.efficiency == pytest.approx(old["network"]["pingpong"]["gbit_per_s"], rel=1e-9)
    rows = {r.peer: r for r in validate.rows_of(old, inp)}
    # The dense allreduce is all bandwidth: within a few percent of the measurement.
    assert abs(rows["mpi-allreduce"].error) < 0.05
    assert rows["hvd_slim-slim@0.01"].pred.sent_per_rank == \
        old["peers"]["hvd_slim-slim@0.01"]["bytes_sent_per_step"]


def test_extrapolate_writes_a_table_and_plots(tmp_path, capsys):
    out = tmp_path / "x"
    assert cli(["extrapolate", "--out", str(out), "--models", "tiny", "--ranks", "16,64",
                "--rates-gbit", "10", "--peers", "mpi-allreduce,hvd_slim-slim@0.02"]) == 0
    text = (out / "extrapolation.md").read_text()
    assert "| 16 |" in text and "| 64 |" in text and "hvd_slim-slim@0.02 slower than" in text
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plots" in text
    else:
        assert (out / "extrapolate_tiny.png").stat().st_size > 0


def test_validate_reads_the_switched_fields():
    res = {"settings": {"ranks": 4, "model": "tiny", "net": "x"},
           "network": {"mode": "switched", "hosts": 2, "ranks_per_host": 2,
                       "rate_gbit": [10, 2.5], "latency_ms": 0.02,
                       "pingpong": {"gbit_per_s": 30.0}},
           "peers": {"floor": {"status": "ok", "median_s": 0.02}}}
    inp = validate.inputs_of(res)
    net = inp.scenario.net
    assert (net.topology, net.ranks_per_host, net.rate_bps) == ("switched", 2, (1e10, 2.5e9))
    assert net.latency_s == pytest.approx(2e-5) and net.efficiency == 1.0
    assert any("ignored" in n for n in inp.notes)   # ranks 0 and 1 share a host
    # The ring crosses the slow host's NIC: its bandwidth term is the quarter-rate one; its
    # first phase (d bytes each way a NIC) fits in both NICs' token buckets (1220 and 305 KiB).
    assert net.burst_bytes == (1220 * 1024, 305 * 1024)
    d = numel(shapes_of("tiny"))
    ring = predict("mpi-allreduce", inp.scenario)
    assert ring.comm_s == pytest.approx(5 * (4 * d / 4 * 8 / 2.5e9 + 2e-5) + 2e-5)
    assert ring.busiest_tx == pytest.approx(2 * 3 / 4 * 4 * d * (1514 / 1448 + 66 / 2896))


def test_cnn1m_is_smallcnns_shapes_and_the_real_models_are_known():
    from benchmarks.models import real_model
    cnn = shapes_of("cnn1m")
    assert cnn == shapes_of("smallcnn")
    assert numel(cnn) == 1_147_466    # 3x3 convs 3-32-64-128 with biases, 2048-512-10
    assert split(cnn, 4096) == (1_145_856, 1_610)
    assert numel(shapes_of("resnet18-real")) == sum(p.numel() for p in
                                                    real_model("resnet18-real").parameters())


# --- validate --local-from -------------------------------------------------------------------
CAL_GBIT, CAL_LAT, CAL_LOCAL = 10.0, 2e-4, 0.05


def _calibration(tmp_path, ranks=4, model="tiny", name="cal.json"):
    """A loopback calibration run: the floor at 0.011 s, mpi-allreduce at CAL_LOCAL plus the
    ring on a shared link at the pingpong's CAL_GBIT (every rank's d/4-element chunk crosses
    it in each of the 6 phases)."""
    d = numel(shapes_of(model))
    ring = 2 * (ranks - 1) * (ranks * 4 * d / ranks * 8 / (CAL_GBIT * GBIT) + CAL_LAT)
    res = {"settings": {"ranks": ranks, "model": model, "net": "loopback"},
           "network": {"mode": "loopback", "latency_ms": CAL_LAT * 1e3,
                       "pingpong": {"gbit_per_s": CAL_GBIT}},
           "peers": {"floor": {"status": "ok", "median_s": 0.011},
                     "mpi-allreduce": {"status": "ok", "median_s": CAL_LOCAL + ring}}}
    path = tmp_path / name
    path.write_text(json.dumps(res))
    return str(path)


def _target(tmp_path):
    """A switched 4 x 1 Gbit/s file: floor 0.01, mpi-allreduce at CAL_LOCAL plus its ring
    there, and horovod (not in the calibration) at its derived closed form."""
    d = numel(shapes_of("tiny"))
    lat = 1e-4
    ring = 2 * 3 * (4 * d / 4 * 8 / GBIT + lat) - FREE_1G * 8 / GBIT   # the bucket, once
    res = {"settings": {"ranks": 4, "model": "tiny", "net": "switched"},
           "network": {"mode": "switched", "hosts": 4, "ranks_per_host": 1,
                       "rate_gbit": [1, 1, 1, 1], "latency_ms": lat * 1e3},
           "peers": {"floor": {"status": "ok", "median_s": 0.01},
                     "mpi-allreduce": {"status": "ok", "median_s": CAL_LOCAL + ring},
                     "horovod": {"status": "ok", "median_s": 0.01 + PASSES["horovod"] * 0.01 /
                                 FLOOR_PASSES + ring}}}
    path = tmp_path / "target.json"
    path.write_text(json.dumps(res))
    return str(path), ring


def test_local_from_takes_each_peers_calibrated_local_work(tmp_path, capsys):
    cal, (target, ring) = _calibration(tmp_path), _target(tmp_path)
    with open(target, encoding="utf-8") as f:
        res = json.load(f)
    c = validate.load_calibration(cal)
    assert c.inputs.scenario.net.topology == "loopback"
    assert c.inputs.scenario.net.rate() == pytest.approx(CAL_GBIT * GBIT)
    rows = {r.peer: r for r in validate.rows_of(res, validate.inputs_of(res), c)}
    mpi = rows["mpi-allreduce"]
    # What the peer adds to the calibration's floor (0.011): its median - loopback ring - floor;
    # compute is the target's own floor (0.010).
    added = CAL_LOCAL - 0.011
    assert mpi.local_m == pytest.approx(added, rel=1e-9)
    assert mpi.seconds == pytest.approx(0.010 + added + ring, rel=1e-9)
    assert mpi.error == pytest.approx(-0.001 / (CAL_LOCAL + ring), rel=1e-6)
    assert rows["floor"].seconds == pytest.approx(0.010)   # an input, not scored
    assert rows["horovod"].calib is None and rows["horovod"].error == pytest.approx(0, abs=1e-9)
    assert cli(["validate", target, "--local-from", cal]) == 0
    out = capsys.readouterr().out
    assert "| compute + local | from |" in out
    assert f"| {0.010 + added:.4f} (m) | floor 0.0100 + (calibration " in out
    assert " - its floor 0.0110)" in out and " (d) | compute 0.0100 (m)" in out
    assert "compute + local of 2 of 3 peers from" in out
    assert "(mpi-allreduce); 2 of 2 peers within, 0 beyond 25%" in out
    # Without the flag: the derived local work, the floor unscored.
    assert cli(["validate", target]) == 1
    assert "| compute (m) | local |" in capsys.readouterr().out


def test_local_from_refuses_a_file_without_its_calibration(tmp_path, capsys):
    target, _ = _target(tmp_path)
    other = [_calibration(tmp_path, ranks=2, name="c2.json"),
             _calibration(tmp_path, model="cnn1m", name="c3.json")]
    assert cli(["validate", target, "--local-from", *other]) == 2
    captured = capsys.readouterr()
    assert "no calibration for" in captured.err and "'tiny', 4 ranks" in captured.err
    assert captured.out == ""
    twice = [_calibration(tmp_path, name="a.json"), _calibration(tmp_path, name="b.json")]
    assert cli(["validate", target, "--local-from", *twice]) == 2
    assert "2 calibrations for" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no calibration"):
        validate.calibration_for(json.load(open(target, encoding="utf-8")),
                                 [validate.load_calibration(other[0])])


def test_hierarchical_puts_the_flat_exchange_among_hosts_on_each_nic():
    # 4 hosts of 2 ranks: the NICs carry what one flat exchange among the 4 hosts would, each
    # rank sends half of a flat worker's push, and with one rank per host it is the flat step.
    shapes = ((1000, 1000),)
    local = LocalCosts(pass_s=1e-9, slim_select_s=2e-9)
    hier = predict("hvd_slim-hier@0.01", Scenario(8, switched(ranks_per_host=2), shapes,
                                                  local=local))
    among_hosts = predict("hvd_slim-slim@0.01", Scenario(4, switched(), shapes, local=local))
    assert hier.tx == pytest.approx(among_hosts.tx) and hier.rx == pytest.approx(among_hosts.rx)
    assert hier.comm_s == pytest.approx(among_hosts.comm_s)
    assert hier.sent_per_rank == pytest.approx(among_hosts.sent_per_rank / 2)
    host = (PASSES["hvd_slim-hier-host"] + 3 / 2 + 1) * 1e6 * 1e-9
    assert hier.local_s == pytest.approx(among_hosts.local_s / 2 + host)
    one_per_host = Scenario(4, switched(), shapes, local=local)
    assert predict("hvd_slim-hier@0.01", one_per_host).seconds == \
        pytest.approx(predict("hvd_slim-slim@0.01", one_per_host).seconds)
    assert parse("hvd_slim-hier@0.01") == ("hvd_slim-hier", {"density": 0.01})
