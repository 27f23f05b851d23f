"""``outer_delay=1`` (outer/delayed.py) on simulated ranks: a round's exchange runs during the
next round and its outer step lands one round late, with the global parameters and the outer
state bitwise the same on every rank."""
import pytest
import torch

import hvd_slim
from hvd_slim.config import ConfigError, SlimConfig
from hvd_slim.transport import FakeCluster, run_ranks
from hvd_slim.transport.base import TransportTimeout

from test_local_steps import batch, flat, model, one_step, outer_state, wrap


def test_global_parameters_and_outer_state_are_identical_after_every_round():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=3, outer_delay=1, servers=2)
        rounds, busy = [], []
        for t in range(12):
            one_step(m, opt, rank, t)
            if (t + 1) % 3 == 0:
                busy.append(opt._ends.flight.busy)
                rounds.append((flat(m), torch.cat([g.reshape(-1) for g in
                                                   opt._outer.global_params])))
        assert opt._ends.flight.runner.threaded   # collectives on the communication thread
        return rounds, busy, outer_state(opt), opt.comm_stats()

    res = run_ranks(3, body)
    for k in range(4):
        for r in res[1:]:
            assert torch.equal(res[0][0][k][0], r[0][k][0]), k
        assert torch.equal(res[0][0][k][0], res[0][0][k][1])   # the model is the global state
    assert torch.equal(res[0][0][0][0], flat(model()))   # round 0's step has not landed yet
    assert not torch.equal(res[0][0][1][0], res[0][0][0][0])
    assert all(torch.equal(res[0][2], r[2]) for r in res)
    assert all(r[1] == [True] * 4 for r in res)   # every round's exchange was in flight
    st = res[0][3]
    assert st["steps"] == 3 and st["local_steps_taken"] == 12   # the fourth is still in flight


def test_delayed_rounds_match_a_single_process_reference():
    """Three ranks at density 1.0 against the same training written out in one process: local
    AdamW steps, then DiLoCo's outer step on the previous round's mean pseudo-gradient."""
    steps, h, size = 8, 2, 3

    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, density=1.0, local_steps=h, outer_delay=1)
        for t in range(steps):
            one_step(m, opt, rank, t)
        return flat(m)   # the global parameters: the last round is still in flight

    res = run_ranks(size, body)
    ms = [model() for _ in range(size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in ms]
    glob = model()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    in_flight = None

    def outer_step(mean):
        for p, d in zip(glob.parameters(), mean):
            p.grad = d.clone()
        outer.step()

    for t in range(steps):
        for rank, (m, inner) in enumerate(zip(ms, inners)):
            x, y = batch(rank, t)
            inner.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            inner.step()
        if (t + 1) % h:
            continue
        deltas = [[g.detach() - p.detach() for g, p in zip(glob.parameters(), m.parameters())]
                  for m in ms]
        if in_flight is not None:
            outer_step(in_flight)
        in_flight = [sum(d[i] for d in deltas) / size for i in range(len(deltas[0]))]
        for m in ms:
            m.load_state_dict(glob.state_dict())
    want = flat(glob)
    assert all(torch.allclose(r, want, atol=1e-5) for r in res), \
        [float((r - want).abs().max()) for r in res]


@pytest.mark.parametrize("split", [4, 6, 7])
def test_resume_with_a_round_in_flight_is_bitwise(split):
    def body(rank, tr, split):
        m = model()
        opt = wrap(m, tr, local_steps=3, outer_delay=1, seed=5)
        for t in range(11):
            if t == split:
                state, weights = opt.state_dict(), {k: v.clone() for k, v in
                                                    m.state_dict().items()}
                m = model()
                m.load_state_dict(weights)
                opt = wrap(m, tr, local_steps=3, outer_delay=1, seed=5)
                opt.load_state_dict(state)
            one_step(m, opt, rank, t)
        opt.flush()
        return flat(m), outer_state(opt), opt._exchange.residual_norm()

    plain = run_ranks(2, lambda r, tr: body(r, tr, -1))
    resumed = run_ranks(2, lambda r, tr: body(r, tr, split))
    for a, b in zip(plain, resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


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
def test_a_nonfinite_pseudo_gradient_drops_its_round_on_every_rank(mode):
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, local_steps=2, outer_delay=1, nonfinite=mode,
                   inner=torch.optim.SGD(m.parameters(), lr=0.1))
        one_step(m, opt, rank, 0)
        x, y = batch(rank, 1)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        if rank == 1:
            m[0].weight.grad[0, 0] = float("inf")
        opt.step()   # round 0 ends: its exchange (with the Inf) is launched
        start = flat(m)
        one_step(m, opt, rank, 2)
        try:
            one_step(m, opt, rank, 3)   # round 1 ends: round 0's verdict lands
        except hvd_slim.NonFiniteGradientError:
            return "raised", torch.equal(flat(m), start), opt._exchange.step_count
        return opt.comm_stats()["skipped_steps"], torch.equal(flat(m), start), \
            opt._exchange.step_count

    res = run_ranks(3, body)
    # No outer step: every rank restarts from the unchanged global parameters.
    assert all(r[1] and r[2] == 0 for r in res), res
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
