"""Overlap with backward (``overlap=S``, exchange/overlap/staged.py) on simulated ranks: the stage
exchanges start from the gradient hooks on the communication thread, and the step they make
together keeps the flat exchange's guarantees."""
import time

import pytest
import torch

from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.exchange import Layout
from hvd_slim.exchange.errors import NonFiniteGradientError
from hvd_slim.exchange.overlap.staged import StagedExchange, stage_cuts
from hvd_slim.exchange.protocol import Stage
from hvd_slim.transport import FakeCluster, run_ranks
from hvd_slim.transport.base import TransportTimeout

from test_exchange import SHAPES, drive, make_params, total
from test_optimizer import Net, batch, flat, wrap
from test_shards import held_by_name


def staged(named, config, transport):
    return StagedExchange(Layout(named, config, lambda dt: dt), config, transport, {}, None,
                          [n for n, _ in named], threaded=True)


def simulate(size, steps, flush=False, **cfg):
    config = SlimConfig(min_compress_numel=cfg.pop("min_compress_numel", 1000), **cfg)

    def body(rank, tr):
        named = make_params()
        ex = staged(named, config, tr)
        assert all(isinstance(st, Stage) for st in ex.stages)   # what the staged one asks

        def hooks(ps):   # what the gradient hooks report: every parameter, in backward order
            for _, p in reversed(ps):
                ex.grad_ready(p, None)

        return drive(rank, named, ex, steps, flush, before_step=hooks)

    return run_ranks(size, body)


def test_stages_cover_every_parameter_once_in_backward_order():
    named = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([5, 100, 3, 40, 40, 2, 60])]
    for s in range(1, 10):
        cuts = stage_cuts(named, s)
        assert len(cuts) == min(s, len(named)) and all(cuts)
        assert [n for cut in cuts for n, _ in cut] == [n for n, _ in reversed(named)]
    sizes = [sum(p.numel() for _, p in cut) for cut in stage_cuts(named, 2)]
    assert sizes == [142, 108]


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("servers", [1, 2])
def test_conservation_and_identity(size, servers):
    servers = min(servers, size)
    res = simulate(size, 5, op="sum", density=0.02, seed=1, overlap=3, servers=servers)
    for t in range(5):
        for name in SHAPES:
            assert all(torch.equal(res[0][0][t][name], res[r][0][t][name]) for r in range(size))
    fed, pulled, held = total(d for rank in res for d in rank[1]), total(res[0][0]), \
        held_by_name(res)
    for name in SHAPES:
        got = pulled[name] + held.get(name, 0)
        assert torch.allclose(got, fed[name], rtol=1e-4, atol=1e-3), name


def test_density_one_is_the_dense_mean_and_flush_empties_every_residual():
    res = simulate(3, 3, density=1.0, overlap=4)
    for t in range(3):
        for name in SHAPES:
            mean = sum(res[r][1][t][name].double() for r in range(3)) / 3
            assert torch.allclose(res[0][0][t][name].double(), mean, atol=1e-6), (t, name)
    res = simulate(3, 4, flush=True, op="sum", density=0.02, overlap=2)
    fed, pulled, flushed = total(d for r in res for d in r[1]), total(res[0][0]), res[0][3]
    assert all(r[2].residual_norm() == 0.0 for r in res)
    for name in flushed:
        assert torch.allclose(pulled[name] + flushed[name].double(), fed[name], rtol=1e-4,
                              atol=1e-3), name


def train_overlap(rank, tr, steps=5, passes=1, branch=None, **kw):
    model = Net()
    opt = wrap(model, tr, backward_passes_per_step=passes, **kw)
    for t in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(rank, passes * t + k)
            b = branch(rank, t) if branch else 0
            torch.nn.functional.cross_entropy(model(x, b), y).backward()
        opt.step()
    return flat(model), opt


@pytest.mark.parametrize("passes", [1, 2])
def test_at_density_one_overlap_trains_bitwise_as_the_flat_exchange(passes):
    # Rank 1 takes the other branch on odd steps: stages with parameters that got no gradient
    # on some ranks, released by step() instead of the hooks.
    branch = lambda rank, t: int(rank == 1 and t % 2 == 1)   # noqa: E731
    plain = run_ranks(3, lambda r, tr: train_overlap(r, tr, passes=passes, branch=branch,
                                                     density=1.0)[0])
    over = run_ranks(3, lambda r, tr: train_overlap(r, tr, passes=passes, branch=branch,
                                                    density=1.0, overlap=3)[0])
    for a, b in zip(plain, over):
        assert torch.equal(a, b)


def test_replicas_stay_identical_and_traffic_is_counted_per_stage():
    res = run_ranks(3, lambda r, tr: train_overlap(r, tr, density=0.05, overlap=True))
    assert all(torch.equal(res[0][0], m) for m, _ in res)
    stats = res[0][1].comm_stats()
    assert stats["steps"] == 5 and stats["bytes_pushed"] > 0
    assert stats["dense_bytes"] == 5 * 4 * sum(p.numel() for p in Net().parameters()
                                               if p.requires_grad)
    assert res[0][1].slim_config.overlap == 4


def stages_begun(opt, expected, linger=0.0):
    """How many stages of the step in flight the communication thread has begun, once it has
    begun ``expected`` (or 30 s passed) and ``linger`` more seconds (time for any further one)."""
    job = opt._exchange._job
    deadline = time.monotonic() + 30
    while len(job.results) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(linger)
    return len(job.results)


def chain():
    """Three layers, every parameter used: the same start on every simulated rank."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.ReLU(),
                                torch.nn.Linear(60, 50), torch.nn.ReLU(), torch.nn.Linear(50, 3))
    model.load_state_dict(_CHAIN)
    return model


torch.manual_seed(1)
_CHAIN = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.ReLU(), torch.nn.Linear(60, 50),
                             torch.nn.ReLU(), torch.nn.Linear(50, 3)).state_dict()


def test_stages_are_exchanged_during_backward_before_step():
    def body(rank, tr):
        model = chain()
        opt = wrap(model, tr, density=0.05, overlap=3)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()   # every stage ready
        begun = stages_begun(opt, 3)
        opt.step()
        return begun, flat(model)

    res = run_ranks(2, body)
    assert [r[0] for r in res] == [3, 3] and torch.equal(res[0][1], res[1][1])


def test_an_unused_parameter_holds_back_the_stages_after_it_until_step():
    def body(rank, tr):
        model = Net()   # backward order: unused, then head and b, then a
        opt = wrap(model, tr, density=0.05, overlap=3)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x, 1), y).backward()   # b gets no gradient
        begun = stages_begun(opt, 1, linger=0.2)
        opt.step()
        return begun, flat(model)

    res = run_ranks(2, body)
    assert [r[0] for r in res] == [1, 1] and torch.equal(res[0][1], res[1][1])


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_nonfinite_gradient_in_the_last_stage_drops_the_whole_step(mode):
    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, nonfinite=mode)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if rank == 2:   # the first layer is the last stage in backward order
            model.a.weight.grad[0, 0] = float("nan")
        before = flat(model)
        try:
            opt.step()
        except NonFiniteGradientError:
            return "raised", opt._exchange.residual_norm(), torch.equal(before, flat(model))
        nan = all(torch.isnan(p.grad).all() for p in model.parameters() if p.grad is not None)
        return nan, opt._exchange.residual_norm(), torch.equal(before, flat(model))

    res = run_ranks(3, body)
    assert all(r[1] == 0.0 and r[2] for r in res), res   # no residual, no parameter changed
    if mode == "raise":
        assert all(r[0] == "raised" for r in res)
    else:
        assert all(r[0] is (mode == "flag") for r in res)


def test_resume_is_bitwise_and_other_overlap_checkpoints_are_refused():
    def body(rank, tr, split):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, seed=2)
        for t in range(6):
            if t == split:
                state = opt.state_dict()
                model2 = Net()
                model2.load_state_dict(model.state_dict())
                model, opt = model2, wrap(model2, tr, density=0.05, overlap=3, seed=2)
                opt.load_state_dict(state)
            x, y = batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return flat(model), opt.state_dict()

    plain = run_ranks(2, lambda r, tr: body(r, tr, -1))
    resumed = run_ranks(2, lambda r, tr: body(r, tr, 3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain, resumed))
    tr = FakeCluster(2).transport(0)
    flat_opt = wrap(Net(), tr, density=0.05)
    with pytest.raises(ValueError, match="overlap"):
        flat_opt.load_state_dict(plain[0][1])
    other = wrap(Net(), tr, density=0.05, overlap=2, seed=2)
    with pytest.raises(ValueError, match="stages"):
        other.load_state_dict(plain[0][1])
    with pytest.raises(ValueError, match="overlap=1"):
        wrap(Net(), tr, density=0.05, overlap=3).load_state_dict(flat_opt.state_dict())


@pytest.mark.parametrize("other, named", [(dict(overlap=1), "overlap"),
                                          (dict(overlap=3, overlap_forward=True),
                                           "overlap_forward")])
def test_the_handshake_names_a_rank_with_another_overlap(other, named):
    def body(rank, tr):
        model = Net()
        kw = other if rank == 1 else dict(overlap=3)
        opt = wrap(model, tr, density=0.05, timeout=20, **kw)
        x, y = batch(rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        return None

    msgs = run_ranks(3, body)
    assert all(m is not None and named in m for m in msgs), msgs


@pytest.mark.parametrize("forward", [False, True])
def test_a_rank_that_stops_stepping_times_the_others_out_naming_it(forward):
    def body(rank, tr):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, overlap_forward=forward, timeout=1.0)
        for t in range(3):
            if rank == 2 and t == 1:
                return None
            x, y = batch(rank, t)
            opt.zero_grad()
            try:   # with overlap_forward the wait may come in the next forward
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.apply_updates()
            except TransportTimeout as exc:
                return str(exc)
        return "finished"

    res = run_ranks(3, body)
    assert "rank(s) 2" in res[0] or "rank 2" in res[0], res
    assert res[1] is not None and "timed out" in res[1], res


def test_an_overlapped_and_a_flat_optimizer_share_a_transport_in_any_order():
    def body(rank, tr):
        a, b = Net(), Net()
        oa = wrap(a, tr, density=0.05, overlap=3)
        ob = wrap(b, tr, density=0.05)
        for t in range(3):
            x, y = batch(rank, t)
            oa.zero_grad()
            ob.zero_grad()
            torch.nn.functional.cross_entropy(a(x), y).backward()
            torch.nn.functional.cross_entropy(b(x), y).backward()
            ob.step()   # the flat step waits for the overlapped one queued before it
            oa.step()
        return flat(a), flat(b)

    res = run_ranks(3, body)
    assert all(torch.equal(res[0][0], r[0]) and torch.equal(res[0][1], r[1]) for r in res)


def test_bad_overlap_values_are_refused_naming_the_keyword():
    for bad in (0, -2, 1.5, "3"):
        with pytest.raises(ConfigError, match="overlap"):
            SlimConfig(overlap=bad)


def test_a_checkpoint_is_refused_while_a_step_is_in_flight_and_taken_after_it():
    """Between backward and step() the stages' selectors are mid-step on the communication
    thread: state_dict() says to call step() first instead of saving a speculative state; after
    step() the saved state resumes bitwise."""
    def body(rank, tr, split):
        model = Net()
        opt = wrap(model, tr, density=0.05, overlap=3, seed=4)
        for t in range(4):
            x, y = batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if t == split:
                with pytest.raises(ValueError, match=r"in flight.*before state_dict\(\)"):
                    opt.state_dict()
            opt.step()
            if t == split:
                state, model2 = opt.state_dict(), Net()
                model2.load_state_dict(model.state_dict())
                model, opt = model2, wrap(model2, tr, density=0.05, overlap=3, seed=4)
                opt.load_state_dict(state)
        return flat(model)

    plain = run_ranks(2, lambda r, tr: body(r, tr, -1))
    resumed = run_ranks(2, lambda r, tr: body(r, tr, 1))
    assert all(torch.equal(a, b) for a, b in zip(plain, resumed))
