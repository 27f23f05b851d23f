"""``overlap`` with ``hierarchical=True`` through failed and skipped steps, on simulated hosts:
what a failed step leaves in a rank's carry (its own gradient that no host reduction took in)
is never lost, whatever follows (a skip, a NaN/Inf under "raise", a checkpoint, a flush); a
failure in a stage's local phase keeps its gradient too; and another optimizer's host-first
exchange on the same transports waits for the communication thread."""
import pytest
import torch

from hvd_slim.config import SlimConfig
from hvd_slim.exchange import Layout
from hvd_slim.exchange.errors import ExchangeError, NonFiniteGradientError
from hvd_slim.exchange.hosts.hierarchy import HierarchicalExchange

from test_exchange import grad_for, make_params, total
from test_hierarchy import held_by_name, host_numbers, run_hosts
from test_overlap_hosts import break_server, config_of, mend_server, staged

# break_server's default: stage 1's cross exchange fails at its server (host 0, local rank 0,
# which is rank 0): every rank raises at stage 1; stage 2, never begun, goes to each rank's carry.
HOSTS = host_numbers(2, 2)


def feed(named, rank, t, inf=False):
    """Rank ``rank``'s gradients of step ``t`` (with an Inf in stage 2's conv.weight on rank 3
    when ``inf``); a copy of them."""
    for name, p in named:
        p.grad = grad_for(rank, t, name, p.shape)
        if inf and rank == 3 and name == "conv.weight":
            p.grad.view(-1)[7] = float("inf")
    return {name: p.grad.clone() for name, p in named}


def assert_conserved(res):
    """Everything pulled plus every residual and carry held equals every gradient of every
    step that was not dropped (op="sum"), for the compressed tensors."""
    fed = total(d for r in res for d in r[1])
    pulled, held = total(res[0][0]), total(r[2] for r in res)
    assert sorted(held) == ["conv.weight", "fc.weight"]
    for name in held:
        assert torch.allclose(pulled[name] + held[name], fed[name], rtol=1e-4, atol=1e-3), name


@pytest.mark.parametrize("mode", ["skip", "flag", "raise"])
def test_a_step_dropped_after_a_failed_one_keeps_the_carry(mode):
    """Step 0 fails at stage 1 (stage 2's gradient goes to the carry); step 1 is dropped for an
    Inf in stage 2 (skipped, or raised): the carry must outlive it and reach step 2."""
    config = config_of(op="sum", density=0.02, seed=2, nonfinite=mode)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, HOSTS, world, local, cross, named, threaded=False)
        fed, pulled, kept = [], [], []
        for t in range(4):
            grads = feed(named, rank, t, inf=(t == 1))
            if t == 0:
                break_server(ex, rank)
            try:
                ok = ex.step()
            except (ExchangeError, NonFiniteGradientError) as exc:
                ok = type(exc).__name__
            mend_server(ex, rank) if t == 0 else None
            kept.append(bool(ex.stages[2].host_phases.carry))
            if t != 1:   # a dropped step's gradient is dropped, by design
                fed.append(grads)
            if ok is True:
                pulled.append({name: p.grad.clone() for name, p in named})
        return pulled, fed, held_by_name(ex), kept

    res = run_hosts(HOSTS, fn)
    assert all(r[3] == [True, True, False, False] for r in res), [r[3] for r in res]
    assert_conserved(res)


def test_a_step_on_the_wire_refuses_a_checkpoint_and_takes_the_carry_in():
    """The communication thread has run every stage of step 1 (the host reductions read the
    carry) but step() has not settled it: state_dict() is refused then (the stages are mid-step),
    the carry the failed step 0 left is still held, and step 1's commit takes it in."""
    config = config_of(op="sum", density=0.02, seed=2)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, HOSTS, world, local, cross, named)
        feed(named, rank, 0)
        break_server(ex, rank)
        with pytest.raises(ExchangeError):
            ex.step()
        mend_server(ex, rank)
        left = {i: c.clone() for i, c in ex.stages[2].host_phases.carry.items()}
        feed(named, rank, 1)
        for _, p in reversed(named):   # backward's hooks, in backward order
            ex.grad_ready(p, None)
        ex._job.done.wait()
        with pytest.raises(ValueError, match="in flight"):
            ex.state_dict()
        held = {i: c.clone() for i, c in ex.stages[2].host_phases.carry.items()}
        ex.step()
        return left, held, ex.stages[2].host_phases.carry

    for left, held, after in run_hosts(HOSTS, fn):
        assert left and sorted(held) == sorted(left), (sorted(left), sorted(held))
        assert all(torch.equal(held[i], left[i]) for i in left)
        assert after == {}


def test_a_flush_after_a_failed_step_delivers_the_carry_too():
    """optimizer.flush() promises that nothing computed is pending afterwards: after a step
    that failed at stage 1 (stage 2's gradients in every rank's carry), the flush delivers every
    residual and every carry, so what was pulled plus what was flushed is every gradient fed in
    (op="sum"; the model p0 - lr * that sum is the closed form), and nothing is held."""
    config = config_of(op="sum", density=0.02, seed=2)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, HOSTS, world, local, cross, named, threaded=False)
        fed, pulled = [feed(named, rank, 0)], []
        ex.step()
        pulled.append({name: p.grad.clone() for name, p in named})
        fed.append(feed(named, rank, 1))
        break_server(ex, rank)
        with pytest.raises(ExchangeError):
            ex.step()
        mend_server(ex, rank)
        for _, p in named:
            p.grad = None
        ex.flush()
        flushed = {name: p.grad.clone() for name, p in named if p.grad is not None}
        return pulled, fed, flushed, ex.residual_norm()

    res = run_hosts(HOSTS, fn)
    fed, pulled = total(d for r in res for d in r[1]), total(res[0][0])
    assert all(r[3] == 0.0 for r in res), [r[3] for r in res]
    for name in ("conv.weight", "fc.weight"):   # the compressed tensors
        assert all(torch.equal(r[2][name], res[0][2][name]) for r in res), name
        assert torch.allclose(pulled[name] + res[0][2][name].double(), fed[name], rtol=1e-4,
                              atol=1e-3), name


def test_a_host_first_step_or_flush_on_the_callers_thread_waits_for_the_queued_steps():
    """A staged optimizer's communication thread and another optimizer's host-first exchange
    share the world, host and cross transports (cached per world transport): the other's
    step() and flush() must run after the queued step, never beside it (their collectives
    would interleave), as a flat exchange's do (overlap_runner.exclusive)."""
    config = config_of(op="sum", density=0.02, seed=2)
    alone = SlimConfig(min_compress_numel=1000, op="sum", density=0.02, seed=3)

    def fn(rank, world, local, cross):
        named, other = make_params(), make_params()
        ex = staged(config, HOSTS, world, local, cross, named)
        solo = HierarchicalExchange(Layout(other, alone, lambda dt: dt), alone, world, local,
                                    cross, HOSTS)
        feed(named, rank, 0)
        ex.step()
        order = []
        for t, use in ((1, solo.step), (2, solo.flush)):
            feed(named, rank, t)
            feed(other, rank, t)
            ex.grad_ready(dict(named)["norm.weight"], None)   # stage 0 waits for fc.bias
            job = ex._job
            use()
            order.append(job.done.is_set())
            ex.step()
        return order

    assert all(r == [True, True] for r in run_hosts(HOSTS, fn))


@pytest.mark.parametrize("forward", [False, True])
def test_a_failure_in_a_stages_local_phase_keeps_its_gradient(forward):
    """Stage 1's prepare (its gradient read into the host reduction's messages) fails on every
    rank at step 1: every rank raises, and stage 1's gradient waits in the carry like stage
    2's, so every gradient fed in is pulled or held (op="sum")."""
    config = config_of(op="sum", density=0.02, seed=2, overlap_forward=forward)

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, HOSTS, world, local, cross, named, threaded=False)
        fed, pulled = [], []
        for t in range(4):
            fed.append(feed(named, rank, t))
            if t == 1:
                def broken():
                    raise RuntimeError("injected")
                ex.stages[1].host_phases.encode = broken
                with pytest.raises(RuntimeError, match="injected"):
                    ex.step()
                del ex.stages[1].host_phases.encode
                continue
            ex.step()
            pulled.append({name: p.grad.clone() for name, p in named})
        return pulled, fed, held_by_name(ex)

    assert_conserved(run_hosts(HOSTS, fn))


def test_a_double_fault_keeps_the_carry_of_the_pieces_it_dropped():
    """Step 0 fails at stage 1, so stage 2's gradients wait in every rank's carry. In step 1
    rank 3 sends an Inf in stage 2 (host 1's pieces are poisoned, so the cross exchange of
    local rank 0 skips) while that of local rank 1 fails at its server (rank 1): host 0's
    piece 1 keeps the host's gradient (a failure), its piece 0 and all of host 1 drop it (a
    skip). The carry's share in the dropped pieces stays for the next step; the share piece 1
    took in is forgotten (not counted twice). Whatever was kept, pulled or held adds up."""
    config = config_of(op="sum", density=0.02, seed=2, nonfinite="skip")

    def fn(rank, world, local, cross):
        named = make_params()
        ex = staged(config, HOSTS, world, local, cross, named, threaded=False)
        hp = ex.stages[2].host_phases
        fed, pulled = [], []
        for t in range(4):
            grads = feed(named, rank, t, inf=(t == 1))
            if t == 0:
                break_server(ex, rank)
            if t == 1:   # the cross exchange of local rank 1, served by rank 1
                break_server(ex, rank, stage=2, at=1)
            try:
                ex.step()
                pulled.append({name: p.grad.clone() for name, p in named})
            except ExchangeError:
                pass
            if t == 0:
                mend_server(ex, rank)
                before = {i: c.clone() for i, c in hp.carry.items()}
            if t == 1:
                mend_server(ex, rank, stage=2, at=1)
                after = {i: c.clone() for i, c in hp.carry.items()}
                kept = {"fc.weight": grads["fc.weight"]}   # stage 1 went through, absorbed
                if HOSTS[rank] == 0:   # piece 1 of conv.weight (stage 2), at local rank 1
                    (i, _, n), = hp.frames.places[1]
                    lo = hp.frames.bounds[i][1]
                    piece = torch.zeros_like(grads["conv.weight"]).view(-1)
                    piece[lo:lo + n] = grads["conv.weight"].view(-1)[lo:lo + n]
                    kept["conv.weight"] = piece.view_as(grads["conv.weight"])
                grads = kept
            fed.append(grads)
        return pulled, fed, held_by_name(ex), (before, after, hp.frames)

    res = run_hosts(HOSTS, fn)
    for rank, (_, _, _, (before, after, frames)) in enumerate(res):
        assert sorted(before) == sorted(after) == [0], rank   # conv.weight's bucket
        want = before[0].clone()
        if HOSTS[rank] == 0:   # piece 1 took host 0's carries in; piece 0 dropped them
            (_, _, n), = frames.places[1]
            lo = frames.bounds[0][1]
            want[lo:lo + n] = 0
        assert torch.equal(after[0], want), rank
    assert_conserved(res)
