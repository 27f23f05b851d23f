"""value_bits=1 (wire/values.py): each value's sign at the values' mean magnitude; at
density=1.0 every coordinate's sign is pushed whole (exchange/layout.py, coded_whole) with no
indices, what the signs lose kept in each worker's residual, and the server's pull as asked."""
import math

import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.exchange import DENSE, SPARSE, Layout, SlimExchange
from hvd_slim.exchange.expect import pull_expect, push_expect
from hvd_slim.exchange.layout import coded_pull
from hvd_slim.transport import run_ranks
from hvd_slim.wire import message as wm
from hvd_slim.wire.values import pack, packed_nbytes, unpack

from test_exchange import SHAPES, drive, make_params
from test_value_bits_packed import assert_conserved_and_identical, simulate


def test_signs_at_the_mean_magnitude_round_trip():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 1000):
        x = torch.randn(n, generator=g)
        coded, delivered = pack(x, 1)
        assert coded.dtype == torch.uint8 and coded.numel() == packed_nbytes(n, 1) == \
            4 + math.ceil(n / 8)
        assert torch.equal(unpack(coded, n, 1, torch.float32), delivered)
        s = x.abs().mean()
        assert torch.allclose(delivered, torch.where(x >= 0, s, -s))
    with pytest.raises(ValueError, match="bytes"):
        unpack(coded, 1000 - 8, 1, torch.float32)
    assert torch.equal(pack(torch.zeros(5), 1)[1], torch.zeros(5))
    x[3] = float("nan")   # a NaN anywhere makes every decoded value non-finite: caught as such
    assert not torch.isfinite(pack(x, 1)[1]).any()


def test_density_one_at_one_bit_stays_compressed_and_pushes_no_indices():
    config = SlimConfig(min_compress_numel=1000, density=1.0, value_bits=1,
                        pull_density=0.5, pull_value_bits=8)
    layout = Layout(make_params(), config, lambda dt: dt)
    b = layout.sparse[0]
    assert b.kind == SPARSE and b.slice_bits == 1 and b.k == b.numel
    (ex,) = [e for e, bb in zip(push_expect(layout.buckets), layout.buckets) if bb is b]
    assert ex.modes == {wm.M_CODED: (packed_nbytes(b.numel, 1), 0)} and ex.itemsize == 1
    # Any other value_bits at density 1.0 is still the exact dense average
    dense = Layout(make_params(), SlimConfig(min_compress_numel=1000, density=1.0,
                                             value_bits=2), lambda dt: dt)
    assert all(bb.kind == DENSE for bb in dense.buckets)


@pytest.mark.parametrize("servers, pull, device", [(1, "slim", False), (2, "slim", True),
                                                   (3, "union", False)])
def test_conservation_and_identity_of_a_sign_push(servers, pull, device):
    assert_conserved_and_identical(simulate(3, 5, device=device, op="sum", density=1.0,
                                            value_bits=1, pull_density=0.5, pull_value_bits=8,
                                            servers=servers, pull=pull), 5)


def test_a_dense_pull_delivers_the_mean_of_every_ranks_signs():
    """A closed form: with the pull as dense as the push at 32 bits (exact), each step
    delivers exactly the mean over the ranks of ``s_i sign(r_i)``, ``r_i`` being rank i's
    gradient plus what its signs lost before, ``s_i = mean |r_i|`` over the bucket."""
    size, steps = 3, 4
    res = simulate(size, steps, density=1.0, value_bits=1, pull_density=1.0,
                   pull_value_bits=32)
    names = [n for n, s in SHAPES.items() if math.prod(s) >= 1000]
    resid = [torch.zeros(sum(math.prod(SHAPES[n]) for n in names)) for _ in range(size)]
    for t in range(steps):
        want = 0
        for i in range(size):
            r = resid[i].add_(torch.cat([res[i][1][t][n].reshape(-1) for n in names]))
            s = r.abs().mean()
            sent = torch.where(r >= 0, s, -s)
            r.sub_(sent)
            want = want + sent
        got = torch.cat([res[0][0][t][n].reshape(-1) for n in names])
        assert torch.allclose(got, want / size, rtol=1e-5, atol=1e-6), t
        for r in res[1:]:
            assert all(torch.equal(res[0][0][t][n], r[0][t][n]) for n in SHAPES)


@pytest.mark.parametrize("pull_density", [0.5, 1.0])
def test_the_push_is_a_bit_a_coordinate_and_resumes_bitwise(pull_density):
    """Each step pushes d/8 bytes (and a 4-byte scale) and no index bytes, and a checkpoint
    taken mid-run resumes bitwise: the residuals hold what the signs (and the server's 8-bit
    pull, sliced or coded whole) lost."""
    config = SlimConfig(min_compress_numel=1000, density=1.0, value_bits=1,
                        pull_density=pull_density, pull_value_bits=8)

    def body(rank, tr):
        named = make_params()
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, tr)
        drive(rank, named, ex, 3)
        saved = ex.state_dict()
        after = drive(rank, named, ex, 3)[0]
        again = SlimExchange(Layout(named, config, lambda dt: dt), config, tr)
        again.load_state_dict(saved)
        resumed = drive(rank, named, again, 3)[0]
        return after, resumed, ex.stats.as_dict(), ex.layout.sparse[0].numel

    for after, resumed, stats, d in run_ranks(2, body):
        assert stats["push_sparse_value_bytes"] == 6 * packed_nbytes(d, 1)
        assert stats["push_index_bytes"] == 0
        for a, b in zip(after, resumed):
            assert all(torch.equal(a[n], b[n]) for n in SHAPES)


def test_one_bit_is_validated_and_named():
    assert SlimConfig(value_bits=1).value_bits == 1
    with pytest.raises(ConfigError, match="value_bits"):
        SlimConfig(value_bits=3)


def test_a_dense_warm_up_step_is_exact_then_signs_follow():
    """warmup_dense_steps: those steps are the exact dense average at value_bits=1 too."""
    res = simulate(2, 3, density=1.0, value_bits=1, pull_density=1.0, pull_value_bits=32,
                   warmup_dense_steps=1)
    for name in SHAPES:
        mean = (res[0][1][0][name].double() + res[1][1][0][name].double()) / 2
        assert torch.allclose(res[0][0][0][name].double(), mean, atol=1e-6)
    big = [n for n, s in SHAPES.items() if math.prod(s) >= 1000]
    step1 = res[0][0][1][big[0]].reshape(-1)
    assert step1.abs().unique().numel() <= 4   # a mean of two ranks' signs: few magnitudes


def test_value_bits_one_alone_pushes_every_sign_and_pulls_all_at_8_bits(caplog, monkeypatch):
    """value_bits=1's defaults, for what the user leaves unset, whatever the optimizer: the
    update exchange's (density 0.05 at 2 bits) give way to them; a keyword or variable wins."""
    import logging

    import hvd_slim
    from hvd_slim.config.env import resolve_config
    from hvd_slim.transport import FakeCluster

    c = resolve_config({"value_bits": 1})
    assert (c.density, c.effective_pull_density, c.effective_pull_value_bits) == (1.0, 1.0, 8)
    c = resolve_config({"pull_density": 0.25}, {"HVD_SLIM_VALUE_BITS": "1"})
    assert (c.density, c.effective_pull_density) == (1.0, 0.25)
    c = resolve_config({"value_bits": 1, "density": 0.05})   # signs of a slice: the usual pull
    assert (c.density, c.effective_pull_density) == (0.05, 0.1)
    assert resolve_config({"value_bits": 2}).density == 0.02

    monkeypatch.setenv("HVD_SLIM_VALUE_BITS", "1")
    m = torch.nn.Linear(80, 60)
    with caplog.at_level(logging.INFO, logger="hvd_slim"):
        opt = hvd_slim.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3),
                                            named_parameters=m.named_parameters(),
                                            transport=FakeCluster(1).transport(0))
    assert "density=1.0 (value_bits=1 default)" in caplog.text
    assert "pull_value_bits=8 (value_bits=1 default)" in caplog.text
    assert "value_bits=1 (HVD_SLIM_VALUE_BITS)" in caplog.text
    (b,) = opt._layout.sparse
    assert b.slice_bits == 1 and b.k == b.numel and coded_pull(b)


@pytest.mark.parametrize("pull_bits", [8, 2])
@pytest.mark.parametrize("servers, device", [(1, False), (2, True)])
def test_every_coordinate_pulled_coded_keeps_the_invariants(pull_bits, servers, device):
    """pull_density=1.0 at pull_value_bits below 32 after a sign push: the server's whole sum
    coded (M_CODED, no indices), what the coding loses kept in its residual."""
    assert_conserved_and_identical(simulate(3, 5, device=device, op="sum", density=1.0,
                                            value_bits=1, pull_density=1.0,
                                            pull_value_bits=pull_bits, servers=servers), 5)
    config = SlimConfig(min_compress_numel=1000, density=1.0, value_bits=1, pull_density=1.0,
                        pull_value_bits=pull_bits)
    layout = Layout(make_params(), config, lambda dt: dt)
    b = layout.sparse[0]
    (ex,) = [e for e, bb in zip(pull_expect(layout.buckets, "slim"), layout.buckets)
             if bb is b]
    size = b.numel if pull_bits == 8 else packed_nbytes(b.numel, pull_bits)
    assert ex.modes == {wm.M_CODED: (size, 0)} and ex.scaled == (pull_bits == 8)


def test_an_8_bit_pull_of_every_coordinate_delivers_the_sum_within_float8():
    """The coded pull after one step: the mean of the ranks' signs, within float8's 6.25%, and
    the server's residual holds exactly what float8 lost (nothing before)."""
    res = simulate(2, 1, density=1.0, value_bits=1, pull_density=1.0, pull_value_bits=8)
    names = [n for n, s in SHAPES.items() if math.prod(s) >= 1000]
    want = 0
    for i in range(2):
        r = torch.cat([res[i][1][0][n].reshape(-1) for n in names])
        s = r.abs().mean()
        want = want + torch.where(r >= 0, s, -s) / 2
    got = torch.cat([res[0][0][0][n].reshape(-1) for n in names])
    assert torch.all((got - want).abs() <= 0.0625 * want.abs() + 1e-7)
    server = res[0][2].server.memory[res[0][2].layout.sparse[0].index].residual
    assert torch.allclose(server + got, want, atol=1e-7)
