"""The cost model's mechanisms behind its validation on the switched cluster, in closed form:
the tbf token buckets, serialized pairwise exchanges, Open MPI 4.1's choice of algorithm
(Rabenseifner's allreduce, recursive-doubling allgathers), hvd_slim's sharded pull as one
Iallgatherv, the inputs read from a results file, and the load index of --local-from."""
import glob
import json
import os

import pytest

from benchmarks.model import net as nw
from benchmarks.model import openmpi as om
from benchmarks.model import validate
from benchmarks.model.inputs import inputs_of, tc_bytes
from benchmarks.model.scenario import Scenario
from benchmarks.model.strategies import predict
from benchmarks.model.workloads import numel, shapes_of

pytestmark = pytest.mark.bench

GBIT = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RERUN = os.path.join(ROOT, "benchmarks", "results", "cluster_rerun")


def switched(hosts=4, rate=GBIT, burst=(), rph=1, latency=0.0):
    return nw.Network("switched", (rate,) * hosts, latency_s=latency, ranks_per_host=rph,
                      burst_bytes=burst)


# --- token buckets ---------------------------------------------------------------------------
def test_a_full_bucket_passes_its_bytes_at_line_speed():
    net = switched(burst=(100_000,))
    # Three 50 kB pushes into the server's NIC: its first 100 kB pass free.
    assert nw.gather(net, 4, 0, 50_000).seconds == pytest.approx(50_000 * 8 / GBIT)
    assert nw.gather(net, 2, 0, 50_000).seconds == 0.0          # all of it within the bucket
    assert nw.gather(switched(), 4, 0, 50_000).seconds == pytest.approx(150_000 * 8 / GBIT)
    # The bucket counts frames: a NIC with Ethernet framing passes fewer payload bytes.
    framed = nw.Network("switched", (GBIT,), burst_bytes=(100_000,), frame_overhead=1.25)
    assert framed.burst(0) == pytest.approx(80_000)


def test_back_to_back_phases_spend_the_bucket_once():
    b, nbytes = 30_000.0, 4e6       # every ring phase moves 1 MB a NIC each way
    with_bucket = nw.ring_allreduce(switched(burst=(b,)), 4, nbytes).seconds
    without = nw.ring_allreduce(switched(), 4, nbytes).seconds
    assert without - with_bucket == pytest.approx(b * 8 / GBIT)
    # A shared link has one bucket.
    shared = nw.Network("shared", (GBIT,), latency_s=0.0, burst_bytes=(b,))
    assert nw.gather(shared, 4, 0, 1e6).seconds == pytest.approx((3e6 - b) * 8 / GBIT)


def test_a_serialized_exchange_sends_then_receives():
    flows = [(0, 1, 1e6), (1, 0, 1e6)]
    assert nw.phase(switched(2), 2, flows).seconds == pytest.approx(8e6 / GBIT)
    assert nw.phase(switched(2), 2, flows, serial=True).seconds == pytest.approx(16e6 / GBIT)
    shared = nw.Network("shared", (GBIT,), latency_s=0.0)    # every byte crosses it anyway
    assert nw.phase(shared, 2, flows, serial=True).seconds == \
        nw.phase(shared, 2, flows).seconds == pytest.approx(16e6 / GBIT)


# --- Open MPI ----------------------------------------------------------------------------------
def test_open_mpi_picks_rabenseifner_for_every_measured_allreduce():
    cnn1m, resnet18 = 4 * numel(shapes_of("cnn1m")), 4 * numel(shapes_of("resnet18"))
    for n, nbytes in ((2, cnn1m), (4, cnn1m), (8, cnn1m), (4, resnet18), (4, resnet18 / 2)):
        assert om.decide(om.ALLREDUCE_RULES, n, nbytes) == 6
    assert om.decide(om.ALLREDUCE_RULES, 4, 1000) == 3        # recursive doubling
    assert om.decide(om.ALLREDUCE_RULES, 4, 8) == 4           # ring
    assert om.decide(om.ALLREDUCE_RULES, 300, 1000) == 2      # reduce + bcast
    assert om.decide(om.ALLGATHER_RULES, 2, 1e6) == 6         # two_proc
    assert om.decide(om.ALLGATHER_RULES, 8, 1e6) == 3         # recursive doubling
    assert om.decide(om.ALLGATHER_RULES, 64, 1e6) == 4        # ring
    assert om.decide(om.ALLGATHER_RULES, 64, 10_000) == 5     # neighbor exchange


def test_rabenseifner_on_two_hosts_of_two_puts_b_on_each_nic():
    # Measured: 4.84 MB a NIC for cnn1m's 4.59 MB (hosts_cnn1m_2hx2_100m); a ring puts 1.5 B.
    B = 4 * numel(shapes_of("cnn1m"))
    net = switched(2, rate=1e8, rph=2)
    rab, ring = om.allreduce(net, 4, B), nw.ring_allreduce(net, 4, B)
    assert rab.tx == pytest.approx([B, B]) and rab.rx == pytest.approx([B, B])
    assert ring.tx == pytest.approx([1.5 * B, 1.5 * B])
    # Its two cross-host steps move B/2 each way through a NIC, one direction after the other;
    # the steps within a host are free.
    assert rab.seconds == pytest.approx(2 * (B / 2 + B / 2) * 8 / 1e8)


def test_only_steps_beyond_128_kib_are_serialized():
    big = om.allreduce(switched(), 4, 4e6).seconds              # steps of 2 MB and 1 MB
    ideal = nw.rabenseifner_allreduce(switched(), 4, 4e6).seconds
    assert ideal == pytest.approx(1.5 * 4e6 * 8 / GBIT)
    assert big == pytest.approx(2 * ideal)
    small = om.allreduce(switched(), 4, 400e3).seconds          # 200 kB serialized, 100 kB not
    assert small == pytest.approx(2 * (2 * 200e3 + 100e3) * 8 / GBIT)


def test_rabenseifner_for_three_ranks_folds_one_in_and_out():
    # Ranks 0 and 1 swap halves, 1 hands its half to 0; 0 and 2 halve and double; 0 sends the
    # whole result to 1.
    B = 1e6
    c = om.rabenseifner(switched(3), 3, B)
    assert c.tx == pytest.approx([2.5 * B, B, B])
    assert c.rx == pytest.approx([2 * B, 1.5 * B, B])


def test_open_mpi_allgathers():
    each = 100e3      # recursive doubling on 4: 100 kB (not serialized), then 200 kB (serialized)
    rd = om.allgather(switched(), 4, each)
    assert rd.tx == pytest.approx([3 * each] * 4)
    assert rd.seconds == pytest.approx((each + 2 * 2 * each) * 8 / GBIT)
    two = om.allgather(switched(2), 2, 1e6)                      # two_proc, serialized
    assert two.seconds == pytest.approx(2e6 * 8 / GBIT)
    ne = om.allgather(switched(64), 64, 10e3)                   # neighbor exchange: n-1 blocks
    assert ne.tx == pytest.approx([63 * 10e3] * 64)


def test_the_mpi_setting_picks_the_algorithms():
    shapes = tuple(shapes_of("cnn1m"))
    net = switched(2, rate=1e8, rph=2)
    ideal = predict("mpi-allreduce", Scenario(4, net, shapes))
    tcp = predict("mpi-allreduce", Scenario(4, net, shapes, mpi="openmpi-tcp"))
    assert ideal.busiest_tx == pytest.approx(1.5 * 4 * numel(shapes))      # the ring
    assert tcp.busiest_tx == pytest.approx(4 * numel(shapes))              # Rabenseifner
    gloo = predict("ddp-allreduce", Scenario(4, net, shapes, mpi="openmpi-tcp"))
    assert gloo.busiest_tx == pytest.approx(1.5 * 4 * numel(shapes))       # Gloo: a ring
    with pytest.raises(ValueError, match="mpi must be"):
        Scenario(4, net, shapes, mpi="mpich")


def test_the_sharded_pull_is_one_iallgatherv():
    shapes = ((1000, 1000),)
    sc = Scenario(8, switched(8, latency=1e-5), shapes)
    got = predict("hvd_slim-sharded@0.01", sc)
    push, pull = got.detail["push"], got.detail["pull"]
    # Every root sends its eighth of the pull straight to the 7 others (and receives theirs).
    assert got.busiest_tx == pytest.approx(7 * push / 8 + 7 * pull / 8 + 7 * 352 + 7 * 8,
                                           rel=1e-9)
    header, lengths = nw.bruck_allgather(sc.net, 8, 352), nw.bruck_allgather(sc.net, 8, 8)
    one_phase = 7 * pull / 8 * 8 / GBIT + 1e-5
    push_phase = 7 * push / 8 * 8 / GBIT + 1e-5
    assert got.comm_s == pytest.approx(header.seconds + push_phase + lengths.seconds + one_phase)


# --- inputs ------------------------------------------------------------------------------------
def test_tc_sizes_and_the_benchmarks_buckets():
    assert tc_bytes("32750b") == 32750 and tc_bytes("32Kb") == 32768
    assert tc_bytes("128kb") == 131072 and tc_bytes("1mb") == 1 << 20
    with pytest.raises(ValueError):
        tc_bytes("fast")

    def net_of(network, net="switched", mpi="mpirun (Open MPI) 4.1.4"):
        inp = inputs_of({"settings": {"ranks": 4, "model": "tiny", "net": net},
                         "network": network, "machine": {"mpi": mpi},
                         "peers": {"floor": {"status": "ok", "median_s": 0.01}}})
        return inp.scenario

    sw = net_of({"mode": "switched", "hosts": 4, "rate_gbit": [0.1, 1, 1, 0.01]})
    assert sw.net.burst_bytes == (32768, 122 * 1024, 122 * 1024, 32768)
    assert sw.mpi == "openmpi-tcp"
    assert net_of({"mode": "loopback", "pingpong": {"gbit_per_s": 30}}).net.burst_bytes == ()
    assert net_of({}, net="tbf1g").net.burst_bytes == (131072,)       # netem.NETS
    assert net_of({"mode": "shared", "rate_gbit": [1.0]}, net="shared").net.burst_bytes == \
        (122 * 1024,)
    assert net_of({"mode": "loopback"}, mpi="").mpi == "ideal"        # no MPI named


# --- the load index ----------------------------------------------------------------------------
def _file(tmp_path, name, network, peers, sha="same"):
    res = {"settings": {"ranks": 4, "model": "tiny", "net": network["mode"]},
           "network": network, "machine": {"mpi": "mpirun (Open MPI) 4.1.4",
                                           "hvd_slim_sha256": sha}, "peers": peers}
    path = tmp_path / name
    path.write_text(json.dumps(res))
    return str(path), res


def test_the_load_index_makes_a_uniformly_slower_run_exact(tmp_path):
    """A run whose CPU work all takes 0.6 of the calibration's (floor, selections, the rest):
    the floor and every calibrated peer are predicted exactly."""
    loop = {"mode": "loopback", "latency_ms": 0.05, "pingpong": {"gbit_per_s": 20.0}}
    wire = {"mode": "switched", "hosts": 4, "ranks_per_host": 1, "rate_gbit": [1, 1, 1, 1],
            "latency_ms": 0.0}
    peers = ("floor", "topk-ef@0.01", "hvd_slim-slim@0.01", "mpi-allreduce")
    local = {"floor": 0.02, "topk-ef@0.01": 0.05, "hvd_slim-slim@0.01": 0.04,
             "mpi-allreduce": 0.03}
    select = {"topk-ef@0.01": 12.0, "hvd_slim-slim@0.01": 3.0}
    scale = 0.6

    def medians(network, factor, name):
        _, probe = _file(tmp_path, name, network, {"floor": {"status": "ok",
                                                             "median_s": factor * 0.02}})
        sc = inputs_of(probe).scenario
        out = {}
        for p in peers:
            sel = select.get(p, 0.0) * factor
            comm = predict(p, sc, sel / 1e3).comm_s
            out[p] = {"status": "ok", "median_s": factor * local[p] + comm,
                      "select_ms_per_step": sel}
        return _file(tmp_path, name, network, out)

    cal, _ = medians(loop, 1.0, "cal.json")
    target, res = medians(wire, scale, "target.json")
    c = validate.load_calibration(cal)
    load, over = validate.load_index(res, c)
    assert load == pytest.approx(scale) and over == ["hvd_slim-slim@0.01", "topk-ef@0.01"]
    rows = validate.rows_of(res, inputs_of(res), c, load)
    assert {r.peer for r in rows} == set(peers)
    for r in rows:
        assert r.error == pytest.approx(0, abs=1e-9), r.peer      # the floor too
    text, bad = validate.report(target, 0.25, [c])
    assert not bad and "load index 0.600, the median" in text and "differs" not in text
    uncorrected, bad = validate.report(target, 0.25, [c], corrected=False)
    # Without the load index the selection-heavy peers miss; the floor is an input, not scored,
    # and mpi-allreduce's own CPU work (0.01 s) is too small against its wire time to miss.
    assert "not applied" in uncorrected
    assert {r.peer for r in bad} == {"hvd_slim-slim@0.01", "topk-ef@0.01"}


def test_the_load_index_is_a_median_and_flags_other_code(tmp_path):
    loop = {"mode": "loopback", "pingpong": {"gbit_per_s": 20.0}}
    ok = {"status": "ok", "median_s": 1.0}
    names = ("topk-ef@0.1", "topk-ef@0.01", "topk-ef@0.001", "hvd_slim-slim@0.01")
    cal, _ = _file(tmp_path, "c.json", loop, {p: {**ok, "select_ms_per_step": 10.0}
                                              for p in names}, sha="a")
    # hvd_slim's selector changed between the runs (another sha256): its timing is left out.
    _, res = _file(tmp_path, "r.json", loop,
                   {"topk-ef@0.1": {**ok, "select_ms_per_step": 5.0},
                    "topk-ef@0.01": {**ok, "select_ms_per_step": 7.0},
                    "topk-ef@0.001": {**ok, "select_ms_per_step": 30.0},
                    "hvd_slim-slim@0.01": {**ok, "select_ms_per_step": 1.0}}, sha="b")
    c = validate.load_calibration(cal)
    assert validate.load_index(res, c) == (pytest.approx(0.7), list(names[:3][::-1]))
    res["machine"]["hvd_slim_sha256"] = "a"
    assert validate.load_index(res, c)[0] == pytest.approx((0.5 + 0.7) / 2)
    assert validate.load_index({"peers": {}}, c) == (1.0, [])
    text, _ = validate.report(str(tmp_path / "r.json"), 0.25, [c])
    assert "hvd_slim's code differs" in text


def test_the_cluster_rerun_is_predicted_within_25_percent():
    """The one sitting of 2 December (docs/performance.md, "The cost model"): 70 of its 72
    scored steps within 25% (the floors are inputs, not scored); the two misses are the
    documented ones."""
    files = [os.path.join(RERUN, f) for f in (
        "peers_resnet18_4h_1g.json", "scaling_cnn1m_2h_100m.json", "scaling_cnn1m_4h_100m.json",
        "scaling_cnn1m_8h_100m.json", "hetero_resnet18_slow0.json", "hetero_resnet18_slow3.json",
        "shared_resnet18_4r_1g.json", "hosts_cnn1m_2hx2_100m.json", "hosts_cnn1m_2hx2_10m.json")]
    calibs = [validate.load_calibration(p)
              for p in sorted(glob.glob(os.path.join(RERUN, "calibrate_*.json")))]
    scored, misses = 0, []
    for path in files:
        _, bad = validate.report(path, 0.25, calibs)
        text, _ = validate.report(path, 10.0, calibs)
        scored += sum(line.startswith("| ") and not line.startswith(("| peer", "| floor "))
                      for line in text.splitlines())
        misses += [(os.path.basename(path), r.peer) for r in bad]
    assert scored == 72
    assert sorted(misses) == sorted([
        ("scaling_cnn1m_4h_100m.json", "hvd_slim-slim@0.02"),
        ("scaling_cnn1m_8h_100m.json", "hvd_slim-slim@0.01")])
