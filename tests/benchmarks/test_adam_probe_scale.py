"""The Adam screen's 2-bit coding (benchmarks/convergence/adam_probe.py): hvd_slim's scale puts
the largest magnitude on the top level, the least-squares scale trades it for the bulk."""
import pytest
import torch

from benchmarks.convergence.adam_probe import quantize, two_bit_scale
from hvd_slim.wire.values import pack


def _tail() -> torch.Tensor:
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    return x[x.abs() >= x.abs().quantile(0.95)]


def test_the_max_rule_is_what_hvd_slims_wire_delivers():
    x = _tail()
    _, delivered = pack(x, 2)
    assert torch.allclose(quantize(x, 2, "max"), delivered)
    assert float(quantize(x, 2, "max").abs().max()) == float(x.abs().max())


def test_the_least_squares_rule_clips_the_largest_values_for_a_closer_bulk():
    x = _tail()
    err = {r: float((quantize(x, 2, r) - x).pow(2).sum()) for r in ("max", "mse")}
    assert err["mse"] < err["max"] / 3
    s = two_bit_scale(x, "mse")
    assert s < two_bit_scale(x, "max")
    top = float(quantize(x, 2, "mse").abs().max())
    assert top == pytest.approx(1.5 * s) and top < float(x.abs().max())


def test_a_stride_push_sends_every_pth_coordinate_and_no_index_bytes():
    """``--shared stride``: at density 1/P each rank sends every P-th coordinate in turn, the
    same ones on every rank, so the union pull is those coordinates and no index travels
    either way: with 32-bit values each rank pushes P-th of the dense bytes, and the pull
    carries the same share."""
    from benchmarks.convergence.adam_probe import main
    out = main(["--workers", "2", "--width", "16", "--layers", "1", "--heads", "2",
                "--context", "16", "--batch", "2", "--steps", "4", "--evals", "1",
                "--val-windows", "4", "--density", "0.5", "--bits", "32",
                "--shared", "stride", "--pull", "union"])
    assert out["push_ratio"] == pytest.approx(2 / 2)   # two ranks, each half the coordinates
    assert out["pull_ratio"] == pytest.approx(2.0)
