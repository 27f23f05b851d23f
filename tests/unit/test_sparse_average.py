"""``sparse_average``: the server divides a sliced coordinate's sum by the ranks that sent it
("senders") instead of by every rank ("ranks", the default). Checked against the closed form on
simulated ranks (each rank's slice is the top-k of its gradient, so the test knows who sent
what), on both of the server's paths (a sliced pull and one as dense as the push), with the
same bits on every rank, a bitwise resume, a refused checkpoint and the handshake."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.ddp import SlimState
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.transport import run_ranks

from test_reliability_checkpoint import assert_resume_is_bitwise, refused, trained_states
from test_reliability_mismatch import SAME, first_step_error, params, same_everywhere

D = 5000


def grad(rank: int) -> torch.Tensor:
    return torch.randn(D, generator=torch.Generator().manual_seed(100 + rank))


def first_step(size: int, **kw):
    """One exchange of ``grad(rank)`` on ``size`` ranks: what each rank was delivered, and
    the push's core size. 32-bit values and no exploration, so each push is exactly its
    rank's top-k, and a pull large enough to hold their whole union delivers the sum."""
    config = SlimConfig(min_compress_numel=0, density=0.02, exploration=0.0, value_bits=32,
                        warmup_decay_steps=0, **kw)

    def body(rank, tr):
        p = torch.nn.Parameter(torch.zeros(D))
        ex = SlimExchange(Layout([("w", p)], config, lambda dt: dt), config, tr)
        p.grad = grad(rank).clone()
        ex.step()
        return p.grad.clone(), ex.layout.sparse[0].k_core
    return run_ranks(size, body, timeout=60)


def closed_form(size: int, k: int, over_senders: bool) -> torch.Tensor:
    total, count = torch.zeros(D), torch.zeros(D)
    for r in range(size):
        g = grad(r)
        top = g.abs().topk(k).indices
        total[top] += g[top]
        count[top] += 1
    return total / (count.clamp(min=1) if over_senders else size)


@pytest.mark.parametrize("pull_density", [0.2, 1.0], ids=["sliced-pull", "dense-pull"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("how", ["ranks", "senders"])
def test_each_coordinate_is_averaged_as_asked(how, size, pull_density):
    got = first_step(size, pull_density=pull_density, pull_value_bits=32, sparse_average=how)
    k = got[0][1]
    want = closed_form(size, k, how == "senders")
    for delivered, _ in got:
        assert torch.equal(delivered, got[0][0])   # every replica the same bits
    assert torch.allclose(got[0][0], want, rtol=1e-6, atol=1e-7)


def test_senders_and_ranks_differ_only_where_fewer_than_all_sent():
    ranks = first_step(3, pull_density=0.2, pull_value_bits=32)[0][0]
    senders = first_step(3, pull_density=0.2, pull_value_bits=32,
                         sparse_average="senders")[0][0]
    k = SlimConfig(density=0.02).density * D
    assert int((ranks != senders).sum()) > k   # most pushed coordinates had one sender
    assert torch.equal(ranks == 0, senders == 0)


def test_resume_is_bitwise(tmp_path):
    assert_resume_is_bitwise(tmp_path, 3, 3, density=0.01, sparse_average="senders")


def test_a_checkpoint_under_another_setting_is_refused():
    states = trained_states(sparse_average="senders")
    refused(states[1], r"config field 'sparse_average': 'senders' in the checkpoint vs. "
                       r"'ranks' now")


def test_the_handshake_names_a_rank_with_another_setting():
    def make(rank):
        return params(), SlimConfig(min_compress_numel=1000, density=0.01,
                                    sparse_average="senders" if rank == 2 else "ranks"), SAME
    msg = same_everywhere(first_step_error(3, make))
    assert "Config field 'sparse_average': 'ranks' on ranks 0, 1 vs. 'senders' on rank 2." \
        in msg, msg


def test_the_ddp_hook_refuses_it(monkeypatch):
    with pytest.raises(ConfigError, match="sparse_average='senders' cannot be served"):
        SlimState(sparse_average="senders")
    monkeypatch.setenv("HVD_SLIM_SPARSE_AVERAGE", "senders")
    with pytest.raises(ConfigError, match="HVD_SLIM_SPARSE_AVERAGE"):
        SlimState()
