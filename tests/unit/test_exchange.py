"""The whole Slim-DP exchange over the in-process fake transport, checked against the
invariants of docs/design.md §6 (conservation, identity, determinism, wire size) and a dense
reference."""
import math
import zlib

import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import ExchangeError, Layout, SlimExchange
from hvd_slim.transport import run_ranks
from hvd_slim.wire.indices import index_bytes_bound

from test_reliability_mismatch import first_step_error

SHAPES = {"conv.weight": (20, 10, 5, 5), "fc.weight": (30, 200), "fc.bias": (30,),
          "norm.weight": (30,)}


def make_params(dtype=torch.float32):
    return [(n, torch.nn.Parameter(torch.zeros(s, dtype=dtype))) for n, s in SHAPES.items()]


def grad_for(rank, step, name, shape, dtype=torch.float32):
    """Seeded per (rank, step, name) so every run and every rank count agree; heavy-tailed so
    that the significant coordinates matter."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}|{step}|{name}".encode()))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (x * torch.rand(shape, generator=g, dtype=torch.float64).pow(4) * 10).to(dtype)


def simulate(size, steps, flush=False, dtype=torch.float32, **cfg):
    """Run ``steps`` exchanges on ``size`` simulated ranks. Per rank returns the pulled updates
    per step, the gradients it fed in, its exchange, and the flushed update if any."""
    config = SlimConfig(min_compress_numel=cfg.pop("min_compress_numel", 1000), **cfg)

    def rank_fn(rank, transport):
        named = make_params(dtype)
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        return drive(rank, named, ex, steps, flush, dtype)

    return run_ranks(size, rank_fn)


def drive(rank, named, ex, steps, flush=False, dtype=torch.float32, before_step=None):
    """``steps`` exchanges of rank ``rank``'s seeded gradients through ``ex`` (then a flush):
    the pulled updates per step, the gradients fed in, ``ex``, and the flushed update if any.
    ``before_step(named)`` runs between the gradients and each step (overlap's hooks)."""
    pulled, fed = [], []
    for t in range(steps):
        for name, p in named:
            p.grad = grad_for(rank, t, name, p.shape, dtype)
        fed.append({name: p.grad.clone() for name, p in named})
        if before_step is not None:
            before_step(named)
        ex.step()
        pulled.append({name: p.grad.clone() for name, p in named})
    flushed = None
    if flush:
        for _, p in named:
            p.grad = None
        ex.flush()
        flushed = {name: p.grad.clone() for name, p in named if p.grad is not None}
    return pulled, fed, ex, flushed


def total(dicts):
    out = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v.double()
    return out


def residual_by_name(ex, which="worker"):
    """Worker (or server) residual, cut back into parameter-shaped tensors."""
    mems = ex.worker.memory if which == "worker" else ex.server.memory
    out = {}
    for b in ex.layout.sparse:
        r = mems[b.index].residual
        for s in b.segments:
            out[s.name] = r[s.offset:s.offset + s.numel].view(s.param.shape).double()
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("pull", ["slim", "union"])
def test_conservation_and_identity(size, pull):
    steps = 6
    res = simulate(size, steps, op="sum", density=0.02, pull=pull, seed=7)
    # Identity: every rank applied bitwise the same update at every step.
    for t in range(steps):
        for name in SHAPES:
            for r in range(1, size):
                assert torch.equal(res[0][0][t][name], res[r][0][t][name]), (t, name, r)
    # Conservation: everything pulled + the server's residual + every worker's residual equals
    # the sum of every gradient fed in (op=Sum).
    fed = total(d for rank in res for d in rank[1])
    pulled = total(res[0][0])
    server = res[0][2] if res[0][2].server is not None else None
    srv = residual_by_name(server, "server") if pull == "slim" else {}
    for name in SHAPES:
        lhs = pulled[name] + srv.get(name, 0)
        for rank in res:
            lhs = lhs + residual_by_name(rank[2]).get(name, 0)
        assert torch.allclose(lhs, fed[name], rtol=1e-5, atol=1e-4), name
    if pull == "union":
        for b in res[0][2].layout.sparse:
            assert float(server.server.memory[b.index].residual.abs().sum()) == 0.0


@pytest.mark.parametrize("servers", [1, "all"])
def test_the_phase_timings_split_each_rank_s_exchange(servers):
    """comm_stats' five phases are disjoint parts of every step: each rank prepares and
    applies, only the servers serve, the selection is part of the preparation, and together
    they take no longer than the whole exchange (which also holds the handshake)."""
    size = 3
    res = simulate(size, 4, density=0.05, servers=servers_of(servers, size))
    for rank, (_, _, ex, _) in enumerate(res):
        st = ex.stats
        phases = [getattr(st, f"{ph}_seconds")
                  for ph in ("prepare", "push", "serve", "pull", "apply")]
        assert all(x >= 0 for x in phases) and sum(phases) <= st.exchange_seconds, rank
        assert st.prepare_seconds > 0 and st.apply_seconds > 0, rank
        assert (st.serve_seconds > 0) == (ex.server is not None), rank
        assert 0 < st.select_seconds <= st.prepare_seconds, rank
        assert set(ex.stats.TIMINGS) <= set(ex.stats.as_dict())


def servers_of(spec, size):
    """A ``servers`` value: 1, or one server shard per rank ("all", shards.py)."""
    return size if spec == "all" else spec


@pytest.mark.parametrize("servers", [1, "all"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_density_one_is_the_dense_mean(size, servers):
    res = simulate(size, 3, density=1.0, servers=servers_of(servers, size))
    for t in range(3):
        for name in SHAPES:
            mean = sum(res[r][1][t][name].double() for r in range(size)) / size
            assert torch.allclose(res[0][0][t][name].double(), mean, rtol=1e-6, atol=1e-5)
    # Dense fallback keeps no residual at all.
    assert not res[0][2].layout.sparse


@pytest.mark.parametrize("servers", [1, "all"])
@pytest.mark.parametrize("size", [2, 3])
def test_flush_empties_every_residual_and_delivers_everything(size, servers):
    steps = 5
    res = simulate(size, steps, flush=True, op="sum", density=0.01, seed=3,
                   servers=servers_of(servers, size))
    fed = total(d for rank in res for d in rank[1])
    delivered = total(res[0][0] + [res[0][3]])
    for name in SHAPES:
        assert torch.allclose(delivered[name], fed[name], rtol=1e-5, atol=1e-4), name
    for rank in res:
        assert rank[2].residual_norm() == 0.0
        assert rank[3].keys() == res[0][3].keys()
        for name, v in rank[3].items():
            assert torch.equal(v, res[0][3][name])


@pytest.mark.parametrize("servers", [1, 3])
def test_determinism_same_seed_same_result_other_seed_differs(servers):
    a = simulate(3, 4, density=0.01, seed=11, servers=servers)
    b = simulate(3, 4, density=0.01, seed=11, servers=servers)
    c = simulate(3, 4, density=0.01, seed=12, servers=servers)
    same = all(torch.equal(a[0][0][t][n], b[0][0][t][n]) for t in range(4) for n in SHAPES)
    differs = any(not torch.equal(a[0][0][t][n], c[0][0][t][n]) for t in range(4) for n in SHAPES)
    assert same and differs


@pytest.mark.parametrize("bits", [8, 16, 32, 4, 2])
def test_wire_size_values_plus_core_indices_only(bits):
    steps = 6
    res = simulate(2, steps, density=0.01, value_bits=bits, warmup_decay_steps=0)
    ex = res[1][2]
    (b,) = ex.layout.sparse
    k = b.k
    stats = ex.stats
    if bits < 8:   # packed: a float32 scale, then the codes, several to a byte
        assert b.slice_bits == bits
        assert stats.push_sparse_value_bytes == steps * (4 + (k * bits + 7) // 8)
    else:
        assert b.slice_bytes == bits // 8
        assert stats.push_sparse_value_bytes == steps * k * bits // 8
    assert stats.push_index_bytes <= steps * index_bytes_bound(b.numel, b.k_core)
    assert stats.push_index_bytes > 0
    dense_numel = sum(bb.numel for bb in ex.layout.buckets if bb.kind == "dense")
    assert stats.push_dense_value_bytes == steps * dense_numel * 4
    # Transport-counted bytes are exactly the message parts plus one length word a step.
    assert stats.bytes_pushed == (stats.push_header_bytes + stats.push_dense_value_bytes
                                  + stats.push_sparse_value_bytes + stats.push_index_bytes
                                  + 8 * steps)


def test_index_bytes_stay_under_two_per_core_index_at_one_percent():
    res = simulate(2, 3, density=0.01, exploration=0.0, warmup_decay_steps=0)
    ex = res[1][2]
    (b,) = ex.layout.sparse
    assert ex.stats.push_index_bytes <= 3 * 2 * b.k_core


@pytest.mark.parametrize("bits", [32, 8, 4, 2])
def test_lossy_values_keep_their_rounding_error_in_the_residual(bits):
    """Compression.fp16 (value_bits=32: slices in the comm dtype, fp16), value_bits=8 (scaled
    fp8) and 4 or 2 (packed): what the wire rounds away stays in the senders' residuals."""
    config = SlimConfig(density=0.02, op="sum", min_compress_numel=1000, value_bits=bits)

    def rank_fn(rank, transport):
        named = make_params()
        layout = Layout(named, config, lambda dt: torch.float16 if dt.is_floating_point else dt)
        ex = SlimExchange(layout, config, transport)
        fed, pulled = [], []
        for t in range(4):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            fed.append({n: p.grad.clone() for n, p in named})
            ex.step()
            pulled.append({n: p.grad.clone() for n, p in named})
        return fed, pulled, ex

    res = run_ranks(2, rank_fn)
    (b,) = res[0][2].layout.sparse
    ks = [res[0][2].layout.at_step(t)[b.index].k for t in range(4)]
    if bits < 8:
        assert res[0][2].stats.push_sparse_value_bytes == sum(4 + (k * bits + 7) // 8
                                                                for k in ks)
    else:
        assert res[0][2].stats.push_sparse_value_bytes == sum(ks) * (2 if bits == 32 else 1)
    fed = total(d for r in res for d in r[0])
    got = total(res[0][1])
    srv = residual_by_name(res[0][2], "server")
    name = "fc.weight"
    lhs = got[name] + srv[name] + residual_by_name(res[0][2])[name] + residual_by_name(res[1][2])[name]
    assert torch.allclose(lhs, fed[name], rtol=1e-4, atol=1e-3)


def test_mismatched_model_fails_on_every_rank_without_hanging():
    config = SlimConfig(density=0.01, min_compress_numel=1000)

    def make(rank):
        named = make_params()
        if rank == 1:
            named[1] = ("fc.weight", torch.nn.Parameter(torch.zeros(31, 200)))
        return named, config, lambda dt: dt

    msgs = first_step_error(3, make)
    assert all(m is not None and "rank 1" in m and "digest" in m for m in msgs), msgs
    assert len(set(msgs)) == 1


def test_a_failed_step_loses_no_gradient():
    """A worker whose step fails keeps what it computed in its residual."""
    config = SlimConfig(density=0.01, min_compress_numel=1000, op="sum")

    def rank_fn(rank, transport):
        named = make_params()
        if rank == 1:
            named[0] = ("conv.weight", torch.nn.Parameter(torch.zeros(20, 10, 5, 6)))
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        for _, p in named:
            p.grad = torch.ones_like(p)
        with pytest.raises(ExchangeError):
            ex.step()
        return sum(float(m.residual.sum()) for m in ex.worker.memory.values())

    sums = run_ranks(2, rank_fn)
    assert sums[0] == sum(math.prod(s) for n, s in SHAPES.items() if math.prod(s) >= 1000)


def assert_resumes_identically(config, size=3, steps=8, split=4):
    """Saving and loading every rank's state at ``split`` changes no pulled update."""
    def run(rank, transport, split):
        named = make_params()
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        out = []
        for t in range(steps):
            if t == split:
                state = ex.state_dict()
                named = make_params()
                ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
                ex.load_state_dict(state)
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            out.append([p.grad.clone() for _, p in named])
        return out

    plain = run_ranks(size, lambda r, tr: run(r, tr, split=-1))
    resumed = run_ranks(size, lambda r, tr: run(r, tr, split=split))
    for r in range(size):
        for t in range(steps):
            for a, b in zip(plain[r][t], resumed[r][t]):
                assert torch.equal(a, b), (r, t)


def test_state_dict_round_trip_continues_identically():
    assert_resumes_identically(SlimConfig(density=0.02, min_compress_numel=1000, seed=5))


def test_checkpoint_of_another_rank_is_refused():
    config = SlimConfig(density=0.02, min_compress_numel=1000)

    def rank_fn(rank, transport):
        ex = SlimExchange(Layout(make_params(), config, lambda dt: dt), config, transport)
        return ex

    exs = run_ranks(2, rank_fn)
    with pytest.raises(ValueError, match="rank 0 of 2.*rank 1 of 2"):
        exs[1].load_state_dict(exs[0].state_dict())


@pytest.mark.parametrize("bits", [8, 16, 4, 2])
def test_resume_mid_warmup_at_low_value_bits_continues_identically(bits):
    """The shipped defaults: 8-bit values and the automatic warm-up (here 50 steps at density
    0.02); a checkpoint taken in the middle of the decay resumes bit for bit."""
    config = SlimConfig(min_compress_numel=1000, value_bits=bits)
    assert config.warmup_steps == 50
    assert_resumes_identically(config, size=3, steps=6, split=3)


def _saved_state(config):
    def rank_fn(rank, transport):
        named = make_params()
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
        ex.step()
        return ex.state_dict()
    return run_ranks(1, rank_fn)[0]


def _loader(config):
    def rank_fn(rank, transport):
        return SlimExchange(Layout(make_params(), config, lambda dt: dt), config, transport)
    return run_ranks(1, rank_fn)[0]


def test_a_checkpoint_of_other_value_bits_is_refused():
    state = _saved_state(SlimConfig(min_compress_numel=1000, value_bits=8))
    with pytest.raises(ValueError, match=r"config field 'value_bits': 8 in the checkpoint vs. "
                                         r"16 now"):
        _loader(SlimConfig(min_compress_numel=1000, value_bits=16)).load_state_dict(state)


def test_a_checkpoint_from_before_the_new_defaults_resumes_only_with_its_settings():
    """A version-2 checkpoint has no value_bits, start density or effective settings: it was
    made at full precision, decaying from dense, with the pull max(d, min(4d, 0.004)). Loaded
    under the new defaults it is refused naming what differs; with those settings it loads."""
    old = SlimConfig(min_compress_numel=1000, density=0.01, value_bits=32,
                     warmup_decay_steps=0, momentum_masking=1.0, pull_density=0.01)
    state = _saved_state(old)
    config = {k: v for k, v in state["config"].items()
              if k not in ("value_bits", "warmup_start_density")}
    state = dict(state, version=2, config=dict(config, pull_density=None))
    del state["effective"]
    # The first setting in force that differs (automatic ones are named last): the precision.
    with pytest.raises(ValueError, match="config field 'value_bits': 32 in the "
                                         "checkpoint vs. 8 now"):
        _loader(SlimConfig(min_compress_numel=1000, density=0.01)).load_state_dict(state)
    # With the rest as then, the pull a default meant then (0.01) and now.
    with pytest.raises(ValueError, match="config field 'pull_density': 0.01 in the "
                                         "checkpoint vs. 0.02 now"):
        _loader(SlimConfig(min_compress_numel=1000, density=0.01, value_bits=32,
                           warmup_decay_steps=0, momentum_masking=1.0)).load_state_dict(state)
    _loader(old).load_state_dict(state)
