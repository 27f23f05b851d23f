"""``overlap`` with ``hierarchical=True`` (exchange/overlap/staged.py, each stage a
:class:`HierarchicalExchange`) on simulated hosts: the staged step is bitwise the stages' own
host-first steps run one after another, it conserves every gradient (also through a failed
step: what no host reduction took in waits in the rank's carry), skips alike, and resumes
bitwise."""
import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout
from hvd_slim.exchange.errors import ExchangeError, NonFiniteGradientError
from hvd_slim.exchange.hosts.hierarchy import HierarchicalExchange
from hvd_slim.exchange.overlap.staged import StagedExchange, stage_cuts
from hvd_slim.exchange.overlap.order import Deferred
from hvd_slim.exchange.protocol import Stage

from test_exchange import SHAPES, drive, grad_for, make_params, total
from test_hierarchy import (LAYOUTS, assert_hosts_resume_bitwise, held_by_name,
                            host_numbers, run_hosts)


def staged(config, hosts_of, world, local, cross, named, threaded=True):
    return StagedExchange(Layout(named, config, lambda dt: dt), config, world, None, None,
                          [n for n, _ in named], threaded=threaded,
                          make_stage=lambda part, plan: HierarchicalExchange(
                              part, config, world, local, cross, hosts_of, plan))


def break_server(ex, rank, stage=1, at=0):
    """Stage ``stage``'s cross exchange fails at its server on rank ``at`` (``mend_server``
    undoes it): every rank of that cross exchange raises at that stage."""
    if rank == at:
        def broken(*a, **kw):
            raise RuntimeError("injected")
        ex.stages[stage].inner.server.serve = broken


def mend_server(ex, rank, stage=1, at=0):
    if rank == at:
        del ex.stages[stage].inner.server.serve


def config_of(**kw):
    return SlimConfig(min_compress_numel=kw.pop("min_compress_numel", 1000), overlap=3, **kw)


@pytest.mark.parametrize("threaded", [True, False])
@pytest.mark.parametrize("hosts, per_host, interleaved", LAYOUTS[:4])
def test_the_staged_step_is_the_stages_host_first_steps_one_after_another(
        hosts, per_host, interleaved, threaded):
    hosts_of = host_numbers(hosts, per_host, interleaved)
    config = config_of(density=0.02, seed=5)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, hosts_of, world, local, cross, named, threaded)
        assert all(isinstance(st, Stage) for st in ex.stages)   # what the staged one asks
        return drive(rank, named, ex, 4)[0]

    def reference(rank, world, local, cross):
        named = make_params()
        stages = [HierarchicalExchange(Layout(cut, config, lambda dt: dt), config, world,
                                       local, cross, hosts_of)
                  for cut in stage_cuts(named, config.overlap)]
        out = []
        for t in range(4):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            for st in stages:
                st.step()
            out.append({name: p.grad.clone() for name, p in named})
        return out

    got, want = run_hosts(hosts_of, fn), run_hosts(hosts_of, reference)
    for r, (a, b) in enumerate(zip(got, want)):
        for t, (x, y) in enumerate(zip(a, b)):
            for name in SHAPES:
                assert torch.equal(x[name], y[name]), (r, t, name)
                assert torch.equal(x[name], got[0][t][name]), (r, t, name)   # identity


@pytest.mark.parametrize("hosts, per_host, interleaved", LAYOUTS)
def test_conservation_and_the_dense_mean(hosts, per_host, interleaved):
    hosts_of = host_numbers(hosts, per_host, interleaved)
    n = len(hosts_of)

    def run(**kw):
        config = config_of(**kw)

        def fn(rank, world, local, cross):
            named = make_params()
            return drive(rank, named, staged(config, hosts_of, world, local, cross, named), 4)
        return run_hosts(hosts_of, fn)

    res = run(op="sum", density=0.02, seed=3)
    fed, pulled = total(d for rank in res for d in rank[1]), total(res[0][0])
    held = total(held_by_name(rank[2]) for rank in res)
    for name in SHAPES:
        assert torch.allclose(pulled[name] + held.get(name, 0), fed[name], rtol=1e-4,
                              atol=1e-3), name
    dense = run(density=1.0)
    for t in range(4):
        for name in SHAPES:
            mean = sum(dense[r][1][t][name].double() for r in range(n)) / n
            assert torch.allclose(dense[0][0][t][name].double(), mean, atol=1e-6), (t, name)


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_nonfinite_gradient_on_one_rank_is_every_ranks_verdict(mode):
    hosts_of = host_numbers(2, 2)
    config = config_of(density=0.02, nonfinite=mode)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, hosts_of, world, local, cross, named)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape)
            if rank == 3 and name == "conv.weight":   # the last stage to be exchanged
                p.grad.view(-1)[7] = float("inf")
        try:
            ok = ex.step()
        except NonFiniteGradientError:
            return "raised", ex.residual_norm(), ex.step_count
        nan = all(torch.isnan(p.grad).all() for _, p in named)
        return (ok, nan), ex.residual_norm(), ex.step_count

    res = run_hosts(hosts_of, fn)
    want = "raised" if mode == "raise" else (False, mode == "flag")
    assert all(r == (want, 0.0, 0) for r in res), res


def test_a_failed_stage_raises_everywhere_and_every_gradient_is_kept():
    """Stage 1's cross exchange fails at its server (host 0, local rank 0): every rank raises
    at that stage; stage 0's host gradient stays in its residual pieces, stage 1's too, and
    stage 2, never reduced, in each rank's carry. The next step takes the carry in, and a
    checkpoint taken in between holds it: resuming from it is bitwise."""
    hosts_of = host_numbers(2, 2)
    config = config_of(op="sum", density=0.02, seed=2)

    def fn(rank, world, local, cross, reload):
        named = make_params()
        ex = staged(config, hosts_of, world, local, cross, named, threaded=False)
        fed, pulled = [], []
        for t in range(4):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            fed.append({name: p.grad.clone() for name, p in named})
            if t == 1:
                break_server(ex, rank)
            try:
                ex.step()
            except ExchangeError as exc:
                failed = (t, str(exc)[:60], bool(ex.stages[2].host_phases.carry))
                mend_server(ex, rank)
                if reload:
                    state = ex.state_dict()
                    named = make_params()
                    ex = staged(config, hosts_of, world, local, cross, named, threaded=False)
                    ex.load_state_dict(state)
                continue
            pulled.append({name: p.grad.clone() for name, p in named})
        return pulled, fed, held_by_name(ex), failed

    res = run_hosts(hosts_of, lambda *a: fn(*a, reload=False))
    assert all(r[3][0] == 1 and r[3][2] for r in res), [r[3] for r in res]
    assert any("injected" in r[3][1] for r in res)
    fed = total(d for r in res for d in r[1])
    pulled, held = total(res[0][0]), total(r[2] for r in res)
    for name in held:   # the compressed tensors (a dense bucket has no residual to keep it)
        assert torch.allclose(pulled[name] + held[name], fed[name], rtol=1e-4,
                              atol=1e-3), name
    assert sorted(held) == ["conv.weight", "fc.weight"]
    again = run_hosts(hosts_of, lambda *a: fn(*a, reload=True))
    for a, b in zip(res, again):
        for x, y in zip(a[0], b[0]):
            assert all(torch.equal(x[k], y[k]) for k in SHAPES)


def test_a_checkpoint_resumes_bitwise_and_refuses_a_flat_one():
    hosts_of = host_numbers(2, 2)
    config = config_of(density=0.02, seed=4)

    def build(world, local, cross):
        named = make_params()
        return named, staged(config, hosts_of, world, local, cross, named)

    def refuses_a_flat_one(ex, state):
        bad = dict(state, stages=[dict(s, hierarchical=None) for s in state["stages"]])
        with pytest.raises(ValueError, match="checkpoint holds rank"):
            ex.load_state_dict(bad)

    assert_hosts_resume_bitwise(hosts_of, build, steps=5, split=2, check_load=refuses_a_flat_one)


def test_overlap_forward_hands_the_step_over_and_lands_it_bitwise():
    hosts_of = host_numbers(2, 2)

    def fn(rank, world, local, cross, forward):
        config = config_of(density=0.02, seed=6, overlap_forward=forward)
        named = make_params()
        ex = staged(config, hosts_of, world, local, cross, named)
        out, handed = [], 0
        for t in range(4):
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            got = ex.step(defer=True)
            if isinstance(got, Deferred):
                handed += 1
                for _, p in named:   # the script's zero_grad(), with stages still on the wire
                    p.grad.zero_()
                for k in range(len(ex.stages)):   # nearest the input first, as a forward would
                    got.settle(k)
            out.append([p.grad.clone() for _, p in named])
        return out, handed

    plain = run_hosts(hosts_of, lambda *a: fn(*a, forward=False))
    fwd = run_hosts(hosts_of, lambda *a: fn(*a, forward=True))
    assert all(h == 0 for _, h in plain) and all(h == 4 for _, h in fwd)
    for (a, _), (b, _) in zip(plain, fwd):
        for x, y in zip(a, b):
            assert all(torch.equal(u, v) for u, v in zip(x, y))


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_host_sum_that_overflows_float16_is_refused_in_step_not_later(mode):
    """float16 parameters: every rank's gradient is finite, so the schedule round is clear, but
    host 0's sum of fc.weight overflows (the host reduction adds in the bucket's dtype), found
    only by that stage's cross exchange: step() must wait for every stage and refuse the step
    there, with nothing of the exchange changed."""
    hosts_of = host_numbers(2, 2)
    config = config_of(density=0.02, seed=6, overlap_forward=True, nonfinite=mode)

    def fn(rank, world, local, cross):
        named = make_params(torch.float16)
        ex = staged(config, hosts_of, world, local, cross, named)
        for name, p in named:
            p.grad = grad_for(rank, 0, name, p.shape, torch.float16)
            if name == "fc.weight" and rank in (0, 1):
                p.grad[0, 0] = 40000.0   # fits float16; the sum of two does not
        try:
            got = ex.step(defer=True)
        except NonFiniteGradientError:
            got = "raised"
        nan = all(torch.isnan(p.grad).all() for _, p in named)
        return got, nan, ex.residual_norm(), ex.step_count

    res = run_hosts(hosts_of, fn)
    want = "raised" if mode == "raise" else False
    assert all(r == (want, mode == "flag", 0.0, 0) for r in res), res


def test_a_rank_with_no_piece_in_the_first_stage_resumes_bitwise_and_counts_every_step():
    """Stage 0 is b (one coordinate) alone: local rank 0 of each host has no piece of it, so
    no cross exchange there, yet its step count (which the staged exchange takes from stage
    0) must survive a checkpoint, and comm_stats()["steps"] is the same on every rank."""
    hosts_of = host_numbers(2, 2)
    config = SlimConfig(min_compress_numel=100, overlap=2, density=0.05, seed=3)

    def fn(rank, world, local, cross, split):
        def build():
            named = [("w", torch.nn.Parameter(torch.zeros(200))),
                     ("b", torch.nn.Parameter(torch.zeros(1)))]
            return named, staged(config, hosts_of, world, local, cross, named)
        named, ex = build()
        assert [[n for n, _ in c] for c in ex.cuts] == [["b"], ["w"]]
        out = []
        for t in range(4):
            if t == split:
                state = ex.state_dict()
                named, ex = build()
                ex.load_state_dict(state)
            for name, p in named:
                p.grad = grad_for(rank, t, name, p.shape)
            ex.step()
            out.append([p.grad.clone() for _, p in named])
        return out, ex.stages[0].inner is None, ex.step_count, ex.stats.as_dict()["steps"]

    plain = run_hosts(hosts_of, lambda *a: fn(*a, split=-1))
    resumed = run_hosts(hosts_of, lambda *a: fn(*a, split=2))
    assert [r[1] for r in plain] == [True, False, True, False]
    for run in (plain, resumed):
        assert all(r[2:] == (4, 4) for r in run), [r[2:] for r in run]
    for a, b in zip(plain, resumed):
        for x, y in zip(a[0], b[0]):
            assert all(torch.equal(u, v) for u, v in zip(x, y))
