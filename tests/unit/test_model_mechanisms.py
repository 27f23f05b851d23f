"""The cost model's mechanisms behind its validation on the switched cluster, in closed form:
the tbf token buckets, serialized pairwise exchanges, Open MPI 4.1's choice of algorithm
(Rabenseifner's allreduce, recursive-doubling allgathers) and hvd_slim's sharded pull as one
Iallgatherv."""
import pytest

from benchmarks.model import net as nw
from benchmarks.model import openmpi as om
from benchmarks.model.scenario import Scenario
from benchmarks.model.strategies import predict
from benchmarks.model.workloads import numel, shapes_of

pytestmark = pytest.mark.unit

GBIT = 1e9


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
