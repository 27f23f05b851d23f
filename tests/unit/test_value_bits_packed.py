"""value_bits=4 and 2 (wire/values.py, pack/unpack): values packed below a byte with a float32
scale, on the host and the device path, keep the exchange's invariants."""
import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.transport import run_ranks
from hvd_slim.wire.values import pack, packed_nbytes, unpack

from test_exchange import SHAPES, drive, make_params, total
from test_shards import held_by_name


@pytest.mark.parametrize("bits, err", [(4, 1 / 14), (2, 1 / 3)])
def test_packing_rounds_to_the_nearest_level_and_round_trips(bits, err):
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 1000):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        coded, delivered = pack(x, bits)
        assert coded.dtype == torch.uint8 and coded.numel() == packed_nbytes(n, bits)
        assert torch.equal(unpack(coded, n, bits, torch.float64), delivered)
        assert float((x - delivered).abs().max()) <= err * float(x.abs().max()) + 1e-6
    with pytest.raises(ValueError, match="bytes"):   # a section of another length
        unpack(coded, 990, bits, torch.float32)
    zeros, got = pack(torch.zeros(5), bits)
    assert torch.equal(got, torch.zeros(5))


def simulate(size, steps, device=False, **cfg):
    config = SlimConfig(min_compress_numel=1000, **cfg)

    def body(rank, tr):
        named = make_params()
        return drive(rank, named, SlimExchange(Layout(named, config, lambda dt: dt), config, tr),
                     steps)

    return run_ranks(size, body, device_payloads=device)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("servers, pull, device", [(1, "slim", False), (2, "slim", True),
                                                   (3, "union", False)])
def test_conservation_and_identity_at_packed_bits(bits, servers, pull, device):
    assert_conserved_and_identical(simulate(3, 5, device=device, op="sum", density=0.02,
                                            value_bits=bits, servers=servers, pull=pull), 5)


def assert_conserved_and_identical(res, steps):
    """Every rank pulled the same bits at every step, and (op=Sum) what was pulled plus every
    residual held equals everything fed."""
    for t in range(steps):
        for name in SHAPES:
            assert all(torch.equal(res[0][0][t][name], r[0][t][name]) for r in res)
    fed, pulled, held = total(d for r in res for d in r[1]), total(res[0][0]), held_by_name(res)
    for name in SHAPES:
        assert torch.allclose(pulled[name] + held.get(name, 0), fed[name], rtol=1e-4,
                              atol=1e-3), name


def test_density_one_is_exactly_dense_at_two_bits():
    res = simulate(2, 2, density=1.0, value_bits=2)
    for t in range(2):
        for name in SHAPES:
            mean = (res[0][1][t][name].double() + res[1][1][t][name].double()) / 2
            assert torch.allclose(res[0][0][t][name].double(), mean, atol=1e-6)


@pytest.mark.parametrize("push, pull_bits", [(2, 8), (8, 2), (4, 32)])
@pytest.mark.parametrize("servers, device", [(1, False), (2, True)])
def test_a_pull_at_other_bits_keeps_the_invariants_and_its_size(push, pull_bits, servers,
                                                                 device):
    """pull_value_bits: the server's slice at its own bits (Bucket.as_pulled), conservation and
    identity as at one precision; every pull is decoded strictly against the size its bits
    give (pull_expect), so a pull coded at the push's bits would be refused."""
    kw = dict(op="sum", density=0.02, value_bits=push, servers=servers)
    assert_conserved_and_identical(simulate(3, 5, device=device, pull_value_bits=pull_bits,
                                            **kw), 5)
    config = SlimConfig(min_compress_numel=1000, pull_value_bits=pull_bits, **kw)
    layout = Layout(make_params(), config, lambda dt: dt)
    b = layout.sparse[0]
    assert (b.as_pulled().slice_bits or b.as_pulled().slice_dtype.itemsize * 8) == pull_bits
    assert (b.slice_bits or b.slice_dtype.itemsize * 8) == push
