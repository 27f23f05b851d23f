"""``residual_decay`` (beta): each step a worker's residual is multiplied by beta before the new
gradient joins it, SparseLoCo's decayed error feedback. Then ``r_T = sum_t beta^(T-t) (g_t -
s_t)``, so what is delivered, weighted by beta once per later step, plus the residual a flush
sends equals the beta-weighted sum of the gradients: conservation with decay, checked on fake
ranks against that closed form. beta = 1 is today's error feedback, bit for bit."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.memory import ResidualMemory

from test_exchange import SHAPES, grad_for
from test_momentum_masking import STEPS, delivered
from test_reliability_checkpoint import assert_resume_is_bitwise, refused, trained_states
from test_reliability_mismatch import SAME, first_step_error, params, same_everywhere



@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_unsent_mass_fades_by_beta_a_step(momentum, nesterov):
    """Nothing sent: the residual is the beta-weighted sum of what each step offered (the
    gradient, or with momentum correction its velocity; nesterov's ``g + m*u``)."""
    beta, n = 0.8, 50
    mem = ResidualMemory(n, momentum=momentum, nesterov=nesterov, decay=beta)
    want, u = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        g = torch.randn(n, generator=gen)
        u = momentum * u + g.double()
        offered = (g.double() + momentum * u) if nesterov else (u if momentum else g.double())
        want = beta * want + offered
        a, u_new = mem.propose(g.clone())
        mem.commit(a, u_new, sent=torch.zeros(0, dtype=torch.int64))
    assert torch.allclose(mem.residual.double(), want, rtol=1e-5, atol=1e-5)


def test_no_decay_keeps_the_bits_of_plain_error_feedback():
    gen = torch.Generator().manual_seed(5)
    plain, ones = ResidualMemory(40), ResidualMemory(40, decay=1.0)
    for _ in range(3):
        g = torch.randn(40, generator=gen)
        for mem in (plain, ones):
            a, u = mem.propose(g.clone())
            mem.commit(a, u, sent=torch.tensor([1, 7]))
    assert torch.equal(plain.residual, ones.residual)


def test_the_memory_refuses_a_decay_outside_zero_one():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="decay must be in"):
            ResidualMemory(4, decay=bad)


def _decayed_delivery(size: int, beta: float, momentum: float):
    """Each rank's ``sum_t beta^(T-t) delivered_t`` plus its flush, op=Sum, exact union pull."""
    return delivered(size, SlimConfig(density=0.01, min_compress_numel=1000, op="sum",
                                      pull="union", value_bits=32, residual_decay=beta),
                     momentum, fade=beta)


def _decayed_sum(size: int, name: str, beta: float, momentum: float) -> torch.Tensor:
    total = torch.zeros(SHAPES[name], dtype=torch.float64)
    for r in range(size):
        acc, u = torch.zeros_like(total), torch.zeros_like(total)
        for t in range(STEPS):
            u = momentum * u + grad_for(r, t, name, SHAPES[name]).double()
            acc = beta * acc + u
        total += acc
    return total


@pytest.mark.parametrize("size, beta, momentum", [(2, 0.9, 0.0), (3, 0.5, 0.0), (3, 0.9, 0.9)])
def test_what_is_delivered_and_flushed_is_the_decayed_sum(size, beta, momentum):
    res = _decayed_delivery(size, beta, momentum)
    got, compressed = res[0]
    assert compressed
    for name in compressed:
        want = _decayed_sum(size, name, beta, momentum)
        assert torch.allclose(got[name], want, rtol=1e-5, atol=1e-4), name
        # and it is not plain conservation: the decay took something off
        assert not torch.allclose(got[name], _decayed_sum(size, name, 1.0, momentum),
                                  rtol=1e-3, atol=1e-3), name
    for other, _ in res[1:]:   # every replica received the same
        assert all(torch.equal(got[n], other[n]) for n in SHAPES)


def test_residual_decay_is_validated():
    for bad in (0, -0.1, 1.01, float("nan"), "0.9", None):
        with pytest.raises(ConfigError, match="residual_decay") as info:
            SlimConfig(residual_decay=bad)
        assert info.value.field == "residual_decay"
    assert SlimConfig(residual_decay=1).residual_decay == 1.0


def test_the_handshake_names_a_residual_decay_mismatch():
    def make(rank):
        return params(), SlimConfig(min_compress_numel=1000, density=0.01,
                                    residual_decay=0.9 if rank == 1 else 1.0), SAME
    msg = same_everywhere(first_step_error(3, make))
    assert "Config field 'residual_decay': 1.0 on ranks 0, 2 vs. 0.9 on rank 1." in msg, msg


def test_a_checkpoint_under_another_decay_is_refused():
    states = trained_states(residual_decay=0.9)
    refused(states[1], r"config field 'residual_decay': 0.9 in the checkpoint vs. 1.0 now")


def test_resume_with_decay_is_bitwise(tmp_path):
    assert_resume_is_bitwise(tmp_path, 2, 3, residual_decay=0.9, opt_kw=dict(lr=0.1))


def test_the_variable_sets_it(monkeypatch):
    from hvd_slim.config.env import resolve_config
    monkeypatch.setenv("HVD_SLIM_RESIDUAL_DECAY", "0.95")
    assert resolve_config({}).residual_decay == 0.95
    monkeypatch.setenv("HVD_SLIM_RESIDUAL_DECAY", "2")
    with pytest.raises(ConfigError, match="HVD_SLIM_RESIDUAL_DECAY"):
        resolve_config({})
