"""Sharded servers (``servers=S``) over the in-process fake transport: the pieces, and the
invariants of docs/design.md §6 per shard (conservation, identity, checkpoints, the handshake),
at 2, 3 and 5 simulated ranks. The dense mean at density 1.0, flush and determinism with
shards are test_exchange.py's tests, run with ``servers`` too."""
import random

import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout, SlimExchange
from hvd_slim.exchange.shards import ShardPlan, server_roots, shares
from hvd_slim.transport import run_ranks

from test_exchange import SHAPES, assert_resumes_identically, grad_for, make_params, simulate, total
from test_reliability_mismatch import first_step_error, same_everywhere


def held_by_name(res):
    """Every residual of every rank (workers' and every shard's server's), per parameter."""
    out = {}
    for rank in res:
        ex = rank[2]
        held = ex.held_residuals()
        for b in ex.layout.sparse:
            for s in b.segments:
                part = held[b.index][s.offset:s.offset + s.numel].view(s.param.shape)
                out[s.name] = out.get(s.name, 0) + part
    return out


def test_shares_add_up_and_never_exceed_a_piece():
    rng = random.Random(5)
    for _ in range(500):
        lengths = [rng.randint(0, 50) for _ in range(rng.randint(1, 9))]
        total_ = rng.randint(0, sum(lengths))
        got = shares(total_, lengths)
        assert sum(got) == total_
        assert all(0 <= g <= n for g, n in zip(got, lengths)), (total_, lengths, got)
        # Proportional: no piece is off its exact share by a whole coordinate.
        d = sum(lengths) or 1
        assert all(abs(g - total_ * n / d) < 1 for g, n in zip(got, lengths))


@pytest.mark.parametrize("size, servers, server_rank, want", [
    (4, 4, 0, [0, 1, 2, 3]), (4, 2, 0, [0, 2]), (8, 4, 1, [1, 3, 5, 7]), (5, 3, 4, [4, 0, 2]),
    (3, 1, 2, [2])])
def test_server_roots_are_distinct_and_evenly_spaced(size, servers, server_rank, want):
    assert server_roots(size, servers, server_rank) == want


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_pieces_cover_every_bucket_and_share_its_budget(servers):
    config = SlimConfig(density=0.02, min_compress_numel=1000)
    layout = Layout(make_params(), config, lambda dt: dt)
    plan = ShardPlan(layout, servers, 5, 0)
    for step in (0, 3, None):
        buckets = layout.buckets if step is None else layout.at_step(step)
        for b, pieces in zip(buckets, plan.pieces(step)):
            assert [p.lo for p in pieces][0] == 0 and pieces[-1].hi == b.numel
            assert all(x.hi == y.lo for x, y in zip(pieces, pieces[1:]))
            lengths = [p.hi - p.lo for p in pieces]
            assert max(lengths) - min(lengths) <= 1   # balanced by size
            assert sorted(p.shard for p in pieces) == list(range(len(pieces)))
            for f in ("k_core", "k_explore", "k_pull_core", "k_pull_explore"):
                assert sum(getattr(p.b, f) for p in pieces) == getattr(b, f), f
            if servers == 1:
                assert pieces[0].b is b   # one server: the bucket itself, as before
    assert len({pb for pb in plan.piece_sizes(None)}) == sum(
        len(ps) for ps in plan.pieces(None))   # piece ids are distinct


@pytest.mark.parametrize("size, servers", [(2, 2), (3, 3), (3, 2), (5, 5), (5, 3)])
@pytest.mark.parametrize("pull", ["slim", "union"])
def test_conservation_and_identity_per_shard(size, servers, pull):
    steps = 6
    res = simulate(size, steps, op="sum", density=0.02, pull=pull, seed=7, servers=servers)
    for t in range(steps):
        for name in SHAPES:
            for r in range(1, size):
                assert torch.equal(res[0][0][t][name], res[r][0][t][name]), (t, name, r)
    # Everything pulled + every shard's server residual + every worker's residual equals the
    # sum of every gradient fed in (op=Sum).
    fed, pulled, held = total(d for rank in res for d in rank[1]), total(res[0][0]), \
        held_by_name(res)
    for name in SHAPES:
        assert torch.allclose(pulled[name] + held.get(name, 0), fed[name], rtol=1e-5,
                              atol=1e-4), name
    servers_seen = [rank[2].shard for rank in res if rank[2].server is not None]
    assert sorted(servers_seen) == list(range(servers))


def test_held_residuals_leave_a_float64_residual_as_it_was():
    res = simulate(3, 2, op="sum", density=0.02, servers=3, dtype=torch.float64)
    for rank in res:
        ex = rank[2]
        before = {i: m.residual.clone() for i, m in ex.worker.memory.items()}
        first, second = ex.held_residuals(), ex.held_residuals()
        assert all(torch.equal(first[i], second[i]) for i in first)
        assert all(torch.equal(before[i], m.residual) for i, m in ex.worker.memory.items())


@pytest.mark.parametrize("extra", [dict(warmup_decay_steps=0), dict(warmup_dense_steps=2), dict(magnitude_weight=0.5),
                                   dict(value_bits=16), dict(value_bits=32)])
def test_options_keep_conservation_with_shards(extra):
    res = simulate(3, 6, op="sum", density=0.02, seed=2, servers=3, **extra)
    fed, pulled, held = total(d for rank in res for d in rank[1]), total(res[0][0]), \
        held_by_name(res)
    for name in SHAPES:
        assert torch.allclose(pulled[name] + held.get(name, 0), fed[name], rtol=1e-5,
                              atol=1e-4), name
        assert all(torch.equal(res[0][0][5][name], r[0][5][name]) for r in res)


def test_a_server_per_rank_balances_the_traffic():
    """Every rank sends and receives about the same; a single server receives N-1 pushes."""
    steps = 4
    one = simulate(5, steps, density=0.02, seed=1, warmup_decay_steps=0)
    many = simulate(5, steps, density=0.02, seed=1, warmup_decay_steps=0, servers=5)
    recv1 = [r[2].stats.bytes_received for r in one]
    recv = [r[2].stats.bytes_received for r in many]
    sent = [r[2].stats.bytes_sent for r in many]
    assert max(recv) <= 1.1 * min(recv) and max(sent) <= 1.1 * min(sent), (recv, sent)
    # A single server receives 5 pushes and its pull; each of 5 servers a fifth of 5 pushes and
    # every shard's pull: (p + 2p) / (5p + 2p) at a pull twice the push, less fixed headers.
    assert max(recv) < 0.6 * max(recv1), (recv, recv1)
    # bytes_sent / bytes_received are the transport's own counts: pushes and pulls included.
    for r in many:
        st = r[2].stats
        assert st.bytes_sent >= st.bytes_pushed and st.bytes_received >= st.bytes_pulled
        assert st.last["bytes_sent"] > 0


def test_resume_with_shards_is_bitwise():
    assert_resumes_identically(SlimConfig(density=0.02, min_compress_numel=1000, servers=3,
                                          seed=4), size=3)


def _state(size, config, steps=2):
    def body(rank, transport):
        named = make_params()
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        for t in range(steps):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
        return ex.state_dict()
    return run_ranks(size, body)


def test_a_checkpoint_is_refused_under_another_servers_value():
    states = _state(3, SlimConfig(density=0.02, min_compress_numel=1000, servers=3))

    def load(config):
        def body(rank, transport):
            ex = SlimExchange(Layout(make_params(), config, lambda dt: dt), config, transport)
            with pytest.raises(ValueError) as info:
                ex.load_state_dict(states[rank])
            return str(info.value)
        return run_ranks(3, body)

    for msg in load(SlimConfig(density=0.02, min_compress_numel=1000, servers=1)):
        assert "servers" in msg and "in the checkpoint" in msg, msg
    # "auto" spelled differently is a different setting too; the resolved count is checked
    # besides, so a rule that resolves otherwise can never resume silently.
    for msg in load(SlimConfig(density=0.02, min_compress_numel=1000, servers="auto")):
        assert "servers" in msg, msg


def test_the_handshake_names_a_servers_mismatch():
    def make(rank):
        config = SlimConfig(density=0.01, min_compress_numel=1000, servers=3 if rank == 1 else 1)
        return make_params(), config, lambda dt: dt

    msg = same_everywhere(first_step_error(3, make))
    assert "servers" in msg and "rank 1" in msg, msg


def test_a_nonfinite_gradient_on_one_rank_changes_no_shard():
    config = SlimConfig(density=0.02, min_compress_numel=1000, servers=3, nonfinite="skip")

    def body(rank, transport):
        named = make_params()
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
        ex.step()
        before = {i: t.clone() for i, t in ex.held_residuals().items()}
        for name, p in named:
            p.grad = grad_for(rank, 1, name, p.shape)
            if rank == 2 and name == "fc.weight":
                p.grad[3, 4] = float("nan")
        went = ex.step()
        after = ex.held_residuals()
        return went, all(torch.equal(before[i], after[i]) for i in before), ex.stats.last_skip

    for went, unchanged, why in run_ranks(3, body):
        assert not went and unchanged and "fc.weight" in why and "rank 2" in why, why


def test_servers_auto_keeps_every_shard_large():
    auto = SlimConfig(servers="auto")
    assert auto.servers_for(8, 8 << 20) == 8
    assert auto.servers_for(8, (8 << 20) - 1) == 7
    assert auto.servers_for(64, 25_000_000) == 23      # ResNet-50 on 64 hosts
    assert auto.servers_for(8, 1_100_000) == 1         # 1.1M parameters: one server
    assert auto.servers_for(2, 1 << 30) == 1
    with pytest.raises(ValueError, match=r"servers must be an integer in 1\.\.2"):
        SlimConfig(servers=3).servers_for(2, 100)
