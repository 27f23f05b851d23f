"""Node-local aggregation (exchange/hosts/hierarchy.py), on simulated hosts: H hosts of L ranks,
each rank with its world, host and cross transports (fake N-rank clusters)."""
import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.exchange import Layout
from hvd_slim.exchange.hosts.hierarchy import HierarchicalExchange
from hvd_slim.runtime.hosts import host_table
from hvd_slim.exchange.hosts.wire import cuts
from hvd_slim.exchange.errors import NonFiniteGradientError
from hvd_slim.transport import run_ranks
from hvd_slim.transport.fake import FakeCluster

from test_exchange import SHAPES, drive, grad_for, make_params, total


def host_numbers(hosts, per_host, interleaved=False):
    """Each rank's host: contiguous blocks, or round robin (rank r on host r % hosts)."""
    n = hosts * per_host
    return [r % hosts if interleaved else r // per_host for r in range(n)]


def run_hosts(hosts_of, fn, timeout=60.0):
    """``fn(rank, world, local, cross)`` on every simulated rank; results in rank order."""
    table = host_table(hosts_of)
    L, H = len(table[0]), len(table)
    locals_ = [FakeCluster(L, timeout) for _ in range(H)]
    crosses = [FakeCluster(H, timeout) for _ in range(L)]

    def body(rank, world):
        h = hosts_of[rank]
        lr = table[h].index(rank)
        try:
            return fn(rank, world, locals_[h].transport(lr), crosses[lr].transport(h))
        except BaseException:   # wake the ranks waiting on the other clusters too
            for c in locals_ + crosses:
                c.abort()
            raise

    return run_ranks(len(hosts_of), body, timeout=timeout)


def simulate(hosts_of, steps, flush=False, **cfg):
    config = SlimConfig(min_compress_numel=cfg.pop("min_compress_numel", 1000), **cfg)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = HierarchicalExchange(Layout(named, config, lambda dt: dt), config, world, local,
                                  cross, hosts_of)
        return drive(rank, named, ex, steps, flush)

    return run_hosts(hosts_of, fn)


def held_by_name(ex):
    out = {}
    held = ex.held_residuals()
    for b in ex.layout.sparse:
        for s in b.segments:
            out[s.name] = held[b.index][s.offset:s.offset + s.numel].view(s.param.shape)
    return out


LAYOUTS = [(2, 2, False), (3, 2, False), (2, 3, False), (2, 2, True), (3, 2, True)]


@pytest.mark.parametrize("hosts, per_host, interleaved", LAYOUTS)
@pytest.mark.parametrize("servers", [1, 2])
def test_conservation_and_identity_across_hosts(hosts, per_host, interleaved, servers):
    hosts_of = host_numbers(hosts, per_host, interleaved)
    n, steps = len(hosts_of), 5
    res = simulate(hosts_of, steps, op="sum", density=0.02, seed=3, servers=servers)
    for t in range(steps):
        for name in SHAPES:
            for r in range(1, n):
                assert torch.equal(res[0][0][t][name], res[r][0][t][name]), (t, name, r)
    # Everything pulled + every residual = every gradient fed in (op=Sum, as the flat tests).
    fed, pulled = total(d for rank in res for d in rank[1]), total(res[0][0])
    held = total(held_by_name(rank[2]) for rank in res)
    for name in SHAPES:
        assert torch.allclose(pulled[name] + held.get(name, 0), fed[name], rtol=1e-4,
                              atol=1e-3), name


@pytest.mark.parametrize("hosts, per_host, interleaved", LAYOUTS[:3])
def test_density_one_is_the_dense_mean(hosts, per_host, interleaved):
    hosts_of = host_numbers(hosts, per_host, interleaved)
    res = simulate(hosts_of, 3, density=1.0)
    for t in range(3):
        for name in SHAPES:
            mean = sum(res[r][1][t][name].double() for r in range(len(hosts_of))) / len(hosts_of)
            assert torch.allclose(res[0][0][t][name].double(), mean, atol=1e-6), (t, name)


def test_flush_delivers_every_host_residual():
    hosts_of = host_numbers(2, 2)
    res = simulate(hosts_of, 4, flush=True, op="sum", density=0.02)
    fed, pulled = total(d for rank in res for d in rank[1]), total(res[0][0])
    flushed = res[0][3]
    for r in range(1, 4):
        assert all(torch.equal(flushed[k], res[r][3][k]) for k in flushed)
    sparse = {s.name for b in res[0][2].layout.sparse for s in b.segments}
    for name in sparse:
        assert torch.allclose(pulled[name] + flushed[name].double(), fed[name], rtol=1e-4,
                              atol=1e-3), name


def test_pieces_cover_every_bucket():
    for n in (1, 2, 5, 1000):
        for parts in (1, 2, 3):
            b = cuts(n, parts)
            assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:]))
            assert max(y - x for x, y in zip(b, b[1:])) - min(y - x for x, y in zip(b, b[1:])) <= 1


def test_hosts_of_different_sizes_are_refused_naming_them():
    with pytest.raises(ConfigError, match=r"host 0 has 2 \(ranks 0, 1\); host 1 has 1 \(ranks 2\)"):
        host_table([0, 0, 1])


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_nonfinite_gradient_on_one_rank_is_shared_by_every_rank(mode):
    hosts_of = host_numbers(2, 2)
    config = SlimConfig(min_compress_numel=1000, density=0.02, nonfinite=mode)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = HierarchicalExchange(Layout(named, config, lambda dt: dt), config, world, local,
                                  cross, hosts_of)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
            if rank == 3 and name == "fc.bias":
                p.grad[0] = float("nan")
        try:
            ok = ex.step()
        except NonFiniteGradientError as exc:
            return "raised", str(exc), ex.residual_norm()
        return ok, [p.grad.clone() for _, p in named], ex.residual_norm()

    res = run_hosts(hosts_of, fn)
    if mode == "raise":
        assert all(r[0] == "raised" for r in res), res
    else:
        assert all(r[0] is False for r in res)
        if mode == "flag":
            assert all(torch.isnan(g).all() for r in res for g in r[1])
    assert all(r[2] == 0.0 for r in res)   # no residual changed anywhere


def assert_hosts_resume_bitwise(hosts_of, build, steps, split, check_load=None):
    """Saving and loading every rank's exchange at ``split`` changes no pulled update.
    ``build(world, local, cross)``: a fresh ``(named, exchange)``; ``check_load(exchange,
    state)``: what a test asserts about loading, before the state is loaded."""
    def fn(rank, world, local, cross, split):
        named, ex = build(world, local, cross)
        out = []
        for t in range(steps):
            if t == split:
                state = ex.state_dict()
                named, ex = build(world, local, cross)
                if check_load is not None:
                    check_load(ex, state)
                ex.load_state_dict(state)
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            out.append([p.grad.clone() for _, p in named])
        return out

    plain = run_hosts(hosts_of, lambda *a: fn(*a, split=-1))
    resumed = run_hosts(hosts_of, lambda *a: fn(*a, split=split))
    for a, b in zip(plain, resumed):
        for x, y in zip(a, b):
            assert all(torch.equal(u, v) for u, v in zip(x, y))


def test_resume_is_bitwise():
    hosts_of = host_numbers(2, 2)
    config = SlimConfig(min_compress_numel=1000, density=0.02, seed=4)

    def build(world, local, cross):
        named = make_params()
        return named, HierarchicalExchange(Layout(named, config, lambda dt: dt), config,
                                           world, local, cross, hosts_of)

    assert_hosts_resume_bitwise(hosts_of, build, steps=6, split=3)


def test_the_handshake_names_a_rank_without_hierarchical():
    from hvd_slim.exchange import SlimExchange
    from hvd_slim.exchange.errors import ExchangeError
    hosts_of = host_numbers(2, 2)
    on = SlimConfig(min_compress_numel=1000, density=0.02, hierarchical=True)
    off = SlimConfig(min_compress_numel=1000, density=0.02)

    def fn(rank, world, local, cross):
        named = make_params()
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
        if rank == 3:
            ex = SlimExchange(Layout(named, off, lambda dt: dt), off, world)
        else:
            ex = HierarchicalExchange(Layout(named, on, lambda dt: dt), on, world, local, cross,
                                      hosts_of)
        try:
            ex.step()
        except ExchangeError as exc:
            return str(exc)
        return None

    texts = run_hosts(hosts_of, fn)
    assert all(t is not None and "Config field 'hierarchical': True on ranks 0, 1, 2 vs. False on rank 3" in t
               for t in texts), texts
    assert len(set(texts)) == 1   # every rank raises the same error


def test_servers_beyond_the_hosts_are_refused_naming_them():
    hosts_of = host_numbers(2, 2)
    config = SlimConfig(min_compress_numel=1000, servers=3, hierarchical=True)

    def fn(rank, world, local, cross):
        named = make_params()
        HierarchicalExchange(Layout(named, config, lambda dt: dt), config, world, local, cross,
                             hosts_of)

    with pytest.raises(RuntimeError, match=r"servers must be an integer in 1\.\.2 .*with "
                                           r"hierarchical=True every host piece has its own "
                                           r"servers, among the 2 hosts"):
        run_hosts(hosts_of, fn)


def test_a_rank_whose_pieces_are_all_empty_follows_its_host():
    # One 1-element tensor on hosts of 2 ranks: local rank 0 has no piece (no cross exchange),
    # yet applies the same updates, skips the same steps and counts the same steps.
    hosts_of = host_numbers(2, 2)
    config = SlimConfig(min_compress_numel=0, density=0.5, nonfinite="skip")

    def fn(rank, world, local, cross):
        p = torch.nn.Parameter(torch.zeros(1))
        ex = HierarchicalExchange(Layout([("w", p)], config, lambda dt: dt), config, world,
                                  local, cross, hosts_of)
        out = []
        for t in range(3):
            p.grad = torch.tensor([float("nan") if (t == 1 and rank == 1) else rank + t * 10.0])
            out.append((ex.step(), p.grad.clone()))
        return (ex.inner is None, ex.step_count, out, ex.stats.as_dict()["steps"])

    res = run_hosts(hosts_of, fn)
    assert [r[0] for r in res] == [True, False, True, False]   # cuts(1, 2) == [0, 0, 1]
    assert all(r[1] == res[0][1] == r[3] == 2 for r in res), res   # comm_stats' count too
    for t in range(3):
        assert all(r[2][t][0] == res[0][2][t][0] for r in res)
        if res[0][2][t][0]:
            assert all(torch.equal(r[2][t][1], res[0][2][t][1]) for r in res)
    assert [ok for ok, _ in res[0][2]] == [True, False, True]
