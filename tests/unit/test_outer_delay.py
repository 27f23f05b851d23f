"""``outer_delay=1`` (outer/delayed.py) on simulated ranks: a round's exchange runs during the
next round and its outer step lands one round late, with the global parameters and the outer
state bitwise the same on every rank."""
import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.transport import FakeCluster, run_ranks
from hvd_slim.transport.base import TransportTimeout

from test_local_steps import (batch, flat, inf_on_rank_1, model, one_step, outer_state,
                              plain_and_resumed, wrap)


def globals_of(opt):
    return torch.cat([g.reshape(-1) for g in opt._outer.global_params])


def test_global_parameters_and_outer_state_are_identical_after_every_round():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=3, outer_delay=1, servers=2)
        rounds, busy = [], []
        for t in range(12):
            one_step(m, opt, rank, t)
            if (t + 1) % 3 == 0:
                busy.append(opt._ends.flight.busy)
                rounds.append((flat(m), globals_of(opt)))
        assert opt._ends.flight.runner.threaded   # collectives on the communication thread
        st = opt.comm_stats()
        opt.flush()
        return rounds, busy, outer_state(opt), st, flat(m), globals_of(opt)

    res = run_ranks(3, body)
    for k in range(4):
        assert all(torch.equal(res[0][0][k][1], r[0][k][1]) for r in res), k
        # Each rank keeps its own progress of the round on top of the global parameters.
        assert not torch.equal(res[0][0][k][0], res[1][0][k][0]), k
    assert torch.equal(res[0][0][0][1], flat(model()))   # round 0's step has not landed yet
    assert not torch.equal(res[0][0][1][1], res[0][0][0][1])
    assert all(torch.equal(res[0][2], r[2]) for r in res)
    assert all(r[1] == [True] * 4 for r in res)   # every round's exchange was in flight
    assert res[0][3]["steps"] == 3 and res[0][3]["local_steps_taken"] == 12   # one in flight
    # After flush every model is the global parameters, the same everywhere.
    assert all(torch.equal(r[4], res[0][4]) and torch.equal(r[4], r[5]) for r in res)


def test_with_parameters_changed_after_the_optimizer_was_built_the_ranks_still_agree():
    """A script broadcasts rank 0's parameters after building the optimizer: the global
    parameters are taken at the first step, so every rank starts from the broadcast ones."""
    def body(rank, tr, delay):
        torch.manual_seed(rank)   # every rank its own initial parameters
        m = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3))
        opt = wrap(m, tr, local_steps=2, outer_delay=delay)
        m.load_state_dict(model().state_dict())   # the broadcast
        for t in range(6):
            one_step(m, opt, rank, t)
        opt.flush()
        return flat(m), globals_of(opt)

    for delay in (0, 1):
        res = run_ranks(3, lambda r, tr: body(r, tr, delay))
        assert all(torch.equal(r[0], res[0][0]) and torch.equal(r[1], res[0][1])
                   for r in res), delay


def test_delayed_rounds_match_a_single_process_reference():
    """Three ranks at density 1.0 against the same training written out in one process: local
    AdamW steps from where each rank is; at a round's end DiLoCo's outer step on the previous
    round's mean pseudo-gradient, then each rank at the global parameters plus its own
    progress of the round."""
    steps, h, size = 8, 2, 3

    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, density=1.0, local_steps=h, outer_delay=1)
        for t in range(steps):
            one_step(m, opt, rank, t)
        return flat(m), globals_of(opt)

    res = run_ranks(size, body)
    ms = [model() for _ in range(size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in ms]
    glob = model()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    starts = [[p.detach().clone() for p in m.parameters()] for m in ms]
    in_flight = None
    for t in range(steps):
        for rank, (m, inner) in enumerate(zip(ms, inners)):
            x, y = batch(rank, t)
            inner.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            inner.step()
        if (t + 1) % h:
            continue
        own = [[p.detach() - s for p, s in zip(m.parameters(), st)]
               for m, st in zip(ms, starts)]
        if in_flight is not None:
            for p, d in zip(glob.parameters(), in_flight):
                p.grad = d.clone()
            outer.step()
        in_flight = [-sum(o[i] for o in own) / size for i in range(len(own[0]))]
        with torch.no_grad():
            for m, o, st in zip(ms, own, starts):
                for p, g, d, s in zip(m.parameters(), glob.parameters(), o, st):
                    p.copy_(g + d)
                    s.copy_(p)
    want = flat(glob)
    for r, m in zip(res, ms):
        assert torch.allclose(r[1], want, atol=1e-5), float((r[1] - want).abs().max())
        assert torch.allclose(r[0], flat(m), atol=1e-5), float((r[0] - flat(m)).abs().max())


@pytest.mark.parametrize("split", [4, 6, 7])
def test_resume_with_a_round_in_flight_is_bitwise(split):
    def finish(opt):   # the flush lands the round in flight: the run's whole state
        opt.flush()
        return opt._exchange.residual_norm(), globals_of(opt)

    plain, resumed = plain_and_resumed({"local_steps": 3, "outer_delay": 1}, 11, split, finish)
    for a, b in zip(plain, resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert a[2][0] == b[2][0] and torch.equal(a[2][1], b[2][1])


def test_checkpoints_of_the_other_outer_delay_are_refused():
    tr = FakeCluster(1).transport(0)
    m = model()
    delayed = wrap(m, tr, local_steps=4, outer_delay=1)
    for t in range(5):
        one_step(m, delayed, 0, t)
    saved = delayed.state_dict()
    assert saved["hvd_slim_outer"]["delayed"]["ready"] is not None
    with pytest.raises(ValueError, match="'outer_delay': 1 in the checkpoint vs. 0 now"):
        wrap(model(), tr, local_steps=4).load_state_dict(saved)
    with pytest.raises(ValueError, match="'outer_delay': 0 in the checkpoint vs. 1 now"):
        wrap(model(), tr, local_steps=4, outer_delay=1).load_state_dict(
            wrap(model(), tr, local_steps=4).state_dict())
    bad = dict(saved, hvd_slim_outer=dict(saved["hvd_slim_outer"],
                                          delayed={"ready": [torch.zeros(2)]}))
    fresh = wrap(model(), tr, local_steps=4, outer_delay=1)
    with pytest.raises(ValueError, match="delayed outer step"):
        fresh.load_state_dict(bad)
    assert fresh._ends.flight.ready is None and fresh._exchange.step_count == 0


def test_the_first_step_handshake_names_another_outer_delay():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, timeout=20, local_steps=2, outer_delay=rank % 2)
        try:
            one_step(m, opt, rank, 0)
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        return None

    msgs = run_ranks(3, body)
    assert all(m is not None and "outer_delay" in m for m in msgs), msgs


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_nonfinite_pseudo_gradient_drops_its_round_and_the_next_on_every_rank(mode):
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=2, outer_delay=1, nonfinite=mode,
                   inner=torch.optim.SGD(m.parameters(), lr=0.1))
        one_step(m, opt, rank, 0)
        inf_on_rank_1(m, opt, rank, 1)   # round 0 ends: its exchange (with the Inf) is launched
        one_step(m, opt, rank, 2)
        try:
            one_step(m, opt, rank, 3)   # round 1 ends: round 0's verdict lands
        except hvd_slim.NonFiniteGradientError:
            outcome = "raised"
        else:
            outcome = opt.comm_stats()["skipped_steps"]
        return outcome, torch.equal(flat(m), flat(model())), opt._exchange.step_count, \
            opt._ends.flight.busy, opt._exchange.residual_norm()

    res = run_ranks(3, body)
    # No outer step, nothing in flight: every rank restarts from the unchanged global
    # parameters, and nothing of either round is kept.
    assert all(r[1] and r[2] == 0 and not r[3] and r[4] == 0.0 for r in res), res
    assert all(r[0] == ("raised" if mode == "raise" else 1) for r in res), res


def test_flush_mid_round_lands_every_round_and_empties_every_residual():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=4, outer_delay=1, density=0.05)
        for t in range(6):
            one_step(m, opt, rank, t)
        opt.flush()
        return flat(m), opt._exchange.residual_norm(), opt.comm_stats()["steps"], \
            opt._outer.taken, opt._ends.flight.busy, opt._ends.flight.ready

    res = run_ranks(3, body)
    assert all(torch.equal(res[0][0], r[0]) for r in res)
    assert all(r[1] == 0.0 and r[2] == 2 and r[3] == 0 and not r[4] and r[5] is None
               for r in res), res


def test_a_rank_that_stops_stepping_times_the_others_out_naming_it():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=2, outer_delay=1, timeout=1.0)
        for t in range(8):
            if rank == 2 and t == 2:
                return None   # round 1's exchange never gets this rank
            try:
                one_step(m, opt, rank, t)
            except TransportTimeout as exc:
                return t, str(exc)
        return "finished"

    res = run_ranks(3, body)
    assert res[0][0] == 5, res   # raised at the round's end after the one that waited
    assert "rank(s) 2" in res[0][1] or "rank 2" in res[0][1], res


def test_bad_outer_delay_is_refused_naming_it(monkeypatch):
    for bad in (2, -1, 0.5, True, "1"):
        with pytest.raises(ConfigError, match="outer_delay"):
            SlimConfig(local_steps=4, outer_delay=bad)
    with pytest.raises(ConfigError, match="needs local_steps > 1"):
        SlimConfig(outer_delay=1)
    monkeypatch.setenv("HVD_SLIM_OUTER_DELAY", "1")
    monkeypatch.setenv("HVD_SLIM_LOCAL_STEPS", "8")
    tr = FakeCluster(1).transport(0)
    assert wrap(model(), tr).slim_config.outer_delay == 1
    monkeypatch.setenv("HVD_SLIM_OUTER_DELAY", "yes")
    with pytest.raises(ConfigError, match="HVD_SLIM_OUTER_DELAY"):
        wrap(model(), tr)


def test_a_skip_landed_by_a_checkpoint_drops_the_same_rounds_as_without_one():
    """The checkpoint lands the round in flight early; its skip verdict is kept (and saved),
    so the round's end drops what it would have dropped without the checkpoint."""
    def body(rank, tr, resume):
        m = model()
        kw = dict(local_steps=2, outer_delay=1, nonfinite="skip", seed=5,
                  inner=torch.optim.SGD(m.parameters(), lr=0.1))
        opt = wrap(m, tr, **kw)
        one_step(m, opt, rank, 0)
        inf_on_rank_1(m, opt, rank, 1)   # round 0 ends: its exchange (with the Inf) launched
        one_step(m, opt, rank, 2)
        if resume:
            state, weights = opt.state_dict(), {k: v.clone() for k, v in
                                                m.state_dict().items()}
            assert state["hvd_slim_outer"]["delayed"]["skipped"]
            m = model()
            m.load_state_dict(weights)
            opt = wrap(m, tr, **dict(kw, inner=torch.optim.SGD(m.parameters(), lr=0.1)))
            opt.load_state_dict(state)
        for t in range(3, 6):
            one_step(m, opt, rank, t)
        opt.flush()
        return flat(m), globals_of(opt)

    plain = run_ranks(3, lambda r, tr: body(r, tr, False))
    resumed = run_ranks(3, lambda r, tr: body(r, tr, True))
    for a, b in zip(plain, resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
