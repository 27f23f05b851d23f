"""The DDP hook's state (hvd_slim/ddp) on simulated ranks, with DDP's buckets played by hand: a
bucket is the flat concatenation of its parameters' gradients, handed over bucket by bucket,
the last one flagged, and DDP's re-bucketing is a change of which parameters share a bucket.
Checked against the exact average (``density=1.0``), conservation per parameter (what was
delivered plus what every rank holds is everything fed in, across a re-bucketing too), a
bitwise resume, and the refusals."""
from __future__ import annotations

import pytest
import torch

from hvd_slim.config import ConfigError
from hvd_slim.ddp import SlimState, slim_hook
from hvd_slim.transport import run_ranks
from test_elastic import same as same_state   # every tensor of two state dicts, bit for bit

# DDP-style buckets (the last parameters first), each with a weight large enough to be compressed
# and a bias sent dense (under min_compress_numel, as DistributedOptimizer sends it); then a
# re-bucketing that regroups them.
SHAPES = [("fc2.weight", (20, 400)), ("fc2.bias", (20,)), ("fc1.weight", (400, 30)),
          ("fc1.bias", (400,))]
BUCKETS = [[0, 1], [2, 3]]
REBUCKETED = [[1, 3, 0], [2]]


class FakeBucket:
    """What slim_hook reads of ``torch.distributed.GradBucket``."""

    def __init__(self, index, params, last):
        self._i, self._params, self._last = index, params, last
        self._buf = torch.cat([p.grad.reshape(-1) for p in params])

    def index(self):
        return self._i

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params

    def is_last(self):
        return self._last


def make_params():
    return [torch.nn.Parameter(torch.zeros(s)) for _, s in SHAPES]


def grads(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return [torch.randn(s, generator=g) for _, s in SHAPES]


def iterate(state, params, rank, t, buckets=BUCKETS, scale=1.0):
    """One backward pass, every bucket through the hook: what was delivered, per parameter.
    ``scale``: a GradScaler's loss scale, which backward leaves in every gradient."""
    for p, g in zip(params, grads(rank, t)):
        p.grad = g * scale if scale != 1.0 else g
    # DDP waits for the futures at the end of backward: they complete at the last bucket.
    futures = [slim_hook(state, FakeBucket(i, [params[j] for j in members],
                                           i == len(buckets) - 1))
               for i, members in enumerate(buckets)]
    out = {}
    for fut, members in zip(futures, buckets):
        got = fut.wait()
        offset = 0
        for j in members:
            n = params[j].numel()
            out[j] = got[offset:offset + n].clone()
            params[j].grad = out[j].view(params[j].shape).clone()   # as DDP copies it back
            offset += n
    return out


def mean_grad(size, t, j):
    return sum(grads(r, t)[j].reshape(-1) for r in range(size)) / size


def named_state(tr, params, named, **kw):
    """A state over ``params``; ``named``: given their names (``named_parameters=``)."""
    return SlimState(transport=tr, named_parameters=[(n, p) for (n, _), p in zip(SHAPES, params)]
                     if named else None, **kw)


def run(size, steps, layouts=None, named=False, **kw):
    layouts = layouts or [BUCKETS] * steps

    def body(rank, tr):
        params = make_params()
        state = named_state(tr, params, named, **kw)
        return [iterate(state, params, rank, t, layouts[t]) for t in range(steps)], state
    return run_ranks(size, body, timeout=60)


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_bits_and_a_sparse_slice(size):
    got = run(size, 4, density=0.05, warmup_decay_steps=0)
    for res, _ in got[1:]:
        for t in range(4):
            assert all(torch.equal(res[t][j], got[0][0][t][j]) for j in range(4)), t
    later = torch.cat([got[0][0][2][j] for j in (2, 3)])
    assert 0 < int((later != 0).sum()) < later.numel() // 4
    stats = got[0][1].comm_stats()
    assert stats["steps"] == 4 and stats["buckets"] == 2
    assert stats["dense_bytes"] == 4 * sum(torch.Size(s).numel() for _, s in SHAPES) * 4
    assert stats["bytes_pushed"] < stats["dense_bytes"] / 5


def test_each_parameter_is_its_own_tensor_as_in_distributed_optimizer():
    """A bucket is exchanged parameter by parameter: the biases (under min_compress_numel) arrive
    as the exact average at every pass, while the weights sharing their bucket are sliced."""
    got = run(3, 3, density=0.05, warmup_decay_steps=0)
    for t in range(3):
        for j in (1, 3):
            assert torch.allclose(got[0][0][t][j], mean_grad(3, t, j), atol=1e-6), (t, j)
        for j in (0, 2):
            assert int((got[0][0][t][j] != 0).sum()) < got[0][0][t][j].numel() // 4, (t, j)
    stats = got[0][1].comm_stats()
    assert stats["dense_numel"] == 420 and stats["compressed_numel"] == 20000


def test_density_one_is_the_exact_average_every_iteration():
    got = run(3, 3, density=1.0)
    for t in range(3):
        for j in range(4):
            assert torch.allclose(got[1][0][t][j], mean_grad(3, t, j), atol=1e-6), (t, j)


@pytest.mark.parametrize("layouts", [[BUCKETS] * 6, [BUCKETS] * 2 + [REBUCKETED] * 4,
                                     [BUCKETS, REBUCKETED, [[0], [1], [2], [3]]] * 2],
                         ids=["fixed", "rebucketed-once", "rebucketed-often"])
def test_what_was_delivered_plus_what_every_rank_holds_is_everything_fed_in(layouts):
    size, steps = 3, len(layouts)
    got = run(size, steps, layouts, density=0.02)
    for res, _ in got[1:]:   # the same bits everywhere, across re-bucketings too
        assert all(torch.equal(res[t][j], got[0][0][t][j]) for t in range(steps)
                   for j in range(4))
    held = [st.held_by_parameter() for _, st in got]
    for j in range(4):
        delivered = sum(got[0][0][t][j].double() for t in range(steps)) * size
        kept = sum(h.get(j, torch.zeros(1, dtype=torch.float64)) for h in held)
        fed = sum(mean_grad(size, t, j).double() for t in range(steps)) * size
        assert torch.allclose(delivered + kept, fed, atol=1e-4), j


REORDERED = [[1, 0], [3, 2]]


@pytest.mark.parametrize("named", [False, True], ids=["by-position", "named"])
@pytest.mark.parametrize("first, later", [(BUCKETS, BUCKETS), (BUCKETS, REORDERED)],
                         ids=["same-layout", "ddp-reorders-its-buckets"])
def test_a_resumed_state_continues_bitwise(tmp_path, first, later, named):
    """Saved after 3 passes, resumed by a fresh model whose first pass has DDP's first layout
    (then its rebuilt one, here the same parameters in another order): the exchanges go on
    in their own order, so every pass delivers what an unbroken run's did; laid out by
    position or by the names given."""
    size, half = 2, 3
    layouts = [first] + [later] * (2 * half - 1)
    full = run(size, 2 * half, layouts, named=named, density=0.05)

    def body(rank, tr):
        params = make_params()
        state = named_state(tr, params, named, density=0.05)
        for t in range(half):
            iterate(state, params, rank, t, layouts[t])
        torch.save(state.state_dict(), tmp_path / f"s{rank}.pt")
        fresh = make_params()
        again = named_state(tr, fresh, named, density=0.05)
        again.load_state_dict(torch.load(tmp_path / f"s{rank}.pt", weights_only=True))
        out = [iterate(again, fresh, rank, t, first if t == half else later)
               for t in range(half, 2 * half)]
        return out, again.comm_stats()

    for rank, (resumed, stats) in enumerate(run_ranks(size, body, timeout=60)):
        for t in range(half):
            assert all(torch.equal(resumed[t][j], full[rank][0][half + t][j]) for j in range(4))
        assert stats["buckets"] == 2 and stats["steps"] == 2 * half


def test_a_resumed_state_laid_out_otherwise_loses_nothing(tmp_path):
    """Saved after DDP's re-bucketing, resumed by a fresh model whose first pass has the first
    layout: the saved exchanges are split by parameter into the new ones."""
    size, layouts = 2, [BUCKETS, REBUCKETED, REBUCKETED, BUCKETS, REBUCKETED]

    def body(rank, tr):
        state, params = SlimState(transport=tr, density=0.02), make_params()
        out = [iterate(state, params, rank, t, layouts[t]) for t in range(3)]
        torch.save(state.state_dict(), tmp_path / f"s{rank}.pt")
        again, fresh = SlimState(transport=tr, density=0.02), make_params()
        again.load_state_dict(torch.load(tmp_path / f"s{rank}.pt", weights_only=True))
        out += [iterate(again, fresh, rank, t, layouts[t]) for t in range(3, 5)]
        return out, again

    got = run_ranks(size, body, timeout=60)
    held = [st.held_by_parameter() for _, st in got]
    for j in range(4):
        delivered = sum(got[0][0][t][j].double() for t in range(5)) * size
        kept = sum(h.get(j, torch.zeros(1, dtype=torch.float64)) for h in held)
        fed = sum(mean_grad(size, t, j).double() for t in range(5)) * size
        assert torch.allclose(delivered + kept, fed, atol=1e-4), j


def test_a_state_saved_under_other_settings_is_refused():
    (_, state), _ = run(2, 2, density=0.05)
    other = SlimState(density=0.02)
    with pytest.raises(ConfigError, match="'density': 0.05 in the checkpoint vs. 0.02 now"):
        other.load_state_dict(state.state_dict())


def test_a_second_model_is_refused_at_its_first_bucket():
    def body(rank, tr):
        state = SlimState(transport=tr, density=0.05)
        iterate(state, make_params(), rank, 0)
        with pytest.raises(ValueError, match="another DDP model"):
            iterate(state, make_params(), rank, 1)
        return True
    assert run_ranks(2, body, timeout=60) == [True, True]


def test_a_rank_with_another_setting_is_named_by_the_handshake():
    def body(rank, tr):
        state = SlimState(transport=tr, density=0.1 if rank == 1 else 0.05)
        params = make_params()
        with pytest.raises(Exception) as info:
            iterate(state, params, rank, 0)
        return str(info.value)
    msgs = run_ranks(3, body, timeout=60)
    assert all("'density': 0.05 on ranks 0, 2 vs. 0.1 on rank 1" in m for m in msgs), msgs


def test_a_rank_naming_its_parameters_otherwise_is_named_by_the_handshake():
    """Names lay a bucket out: a rank whose names differ would slice other coordinates than
    the others', so the handshake at the exchange's first step names it."""
    def body(rank, tr):
        params = make_params()
        names = [n for n, _ in SHAPES]
        if rank == 1:
            names[0] = "head.weight"   # sorts after fc2.bias where fc2.weight sorted before
        state = SlimState(transport=tr, density=0.05, named_parameters=zip(names, params))
        with pytest.raises(Exception) as info:
            iterate(state, params, rank, 0)
        return str(info.value)
    for msg in run_ranks(2, body, timeout=60):
        assert "Parameter 'fc2.weight'" in msg and "absent on rank 1" in msg, msg


def test_nan_under_flag_reaches_every_rank():
    def body(rank, tr):
        state, params = SlimState(transport=tr, density=0.05), make_params()
        iterate(state, params, rank, 0)
        for p, g in zip(params, grads(rank, 1)):
            p.grad = g
        if rank == 1:
            params[0].grad[0, 0] = float("nan")
        before = state.held_by_parameter()
        futures = [slim_hook(state, FakeBucket(i, [params[j] for j in m], i == 1))
                   for i, m in enumerate(BUCKETS)]
        # The pass is skipped as a whole: every bucket NaN on every rank, nothing committed.
        after = state.held_by_parameter()
        assert all(torch.equal(before[j], after[j]) for j in before)
        return [bool(torch.isnan(f.wait()).all()) for f in futures], \
            state.comm_stats()["skipped_steps"]
    assert run_ranks(2, body, timeout=60) == [([True, True], 1)] * 2


@pytest.mark.parametrize("kw, match", [
    ({"local_steps": 8}, "local_steps=8 cannot be served by a DDP hook"),
    ({"overlap": 2}, "overlap=2 cannot be served.*already overlap"),
    ({"adam_exchange": "update"}, "adam_exchange='update'"),
    ({"momentum_correction": True}, "momentum_correction=True"),
    ({"magnitude_weight": 0.5}, "magnitude_weight=0.5"),
    ({"density": 2.0}, "density must be in"),
])
def test_what_a_hook_cannot_serve_is_refused_by_name(kw, match):
    with pytest.raises(ConfigError, match=match) as info:
        SlimState(**kw)
    assert info.value.field == next(iter(kw))


def test_a_variable_is_named_and_an_unknown_keyword_refused(monkeypatch):
    monkeypatch.setenv("HVD_SLIM_LOCAL_STEPS", "4")
    with pytest.raises(ConfigError, match="HVD_SLIM_LOCAL_STEPS"):
        SlimState()
    monkeypatch.delenv("HVD_SLIM_LOCAL_STEPS")
    monkeypatch.setenv("HVD_SLIM_DENSITY", "0.03")
    assert SlimState().config.density == 0.03
    with pytest.raises(TypeError, match="unexpected keyword.*compression"):
        SlimState(compression=None)


@pytest.mark.parametrize("named, match", [
    ([("w", torch.zeros(2)), ("w", torch.zeros(3))], "must be unique. Found duplicates: w"),
    ([torch.zeros(2)], "sequence of tuples"),
    ([(3, torch.zeros(2))], "names must be strings"),
    ([("w", [1.0, 2.0])], "'w' names a list, not a tensor"),
])
def test_bad_named_parameters_are_refused_by_name(named, match):
    with pytest.raises(ValueError, match=match):
        SlimState(named_parameters=named)


def test_a_bucket_parameter_left_unnamed_is_refused_naming_the_bucket():
    """Names given, a bucket holding a parameter they do not name cannot be laid out by name:
    refused naming the bucket (by every rank alike: nothing was exchanged), not laid out by
    position behind the user's back."""
    def body(rank, tr):
        params = make_params()
        state = SlimState(transport=tr, density=0.1,
                          named_parameters=[(n, p) for (n, _), p in zip(SHAPES, params)
                                            if n != "fc1.bias"])   # fc1.bias: bucket 1
        iterate(state, params, rank, 0)
    with pytest.raises(Exception, match="bucket 1 holds 1 parameters that named_parameters "
                                        "does not name"):
        run_ranks(2, body, timeout=30)


def test_an_empty_named_parameters_names_nothing_and_is_refused_at_the_first_bucket():
    """``named_parameters=[]`` is names given, none of them: refused as Horovod refuses it,
    not laid out by position as if no names were given."""
    def body(rank, tr):
        state = SlimState(transport=tr, density=0.1, named_parameters=[])
        iterate(state, make_params(), rank, 0)
    with pytest.raises(Exception, match="bucket 0 holds 2 parameters that named_parameters "
                                        "does not name"):
        run_ranks(2, body, timeout=30)


def test_an_exchange_failing_mid_pass_fails_every_bucket_and_loses_nothing():
    """Bucket 1's exchange raises on every rank (on the communication thread): every bucket's
    future carries the error, and what the pass fed in for the compressed weights waits in the
    residuals (the biases, sent dense, have none: their gradients stay with DDP's parameters)."""
    def body(rank, tr):
        state, params = SlimState(transport=tr, density=0.05), make_params()
        iterate(state, params, rank, 0)
        before = state.held_by_parameter()
        broken = next(b for b in state._buckets.live.values() if 2 in b.keys)

        def boom(*args):   # inside the exchange's collective phases, which then keep the
            raise RuntimeError("boom")   # gradient in the residual, as on a real failure
        broken.exchange.agreement.ensure = boom
        for p, g in zip(params, grads(rank, 1)):
            p.grad = g
        futures = [slim_hook(state, FakeBucket(i, [params[j] for j in m], i == 1))
                   for i, m in enumerate(BUCKETS)]
        errors = []
        for f in futures:
            with pytest.raises(RuntimeError, match="boom"):
                f.wait()
            errors.append(True)
        after = state.held_by_parameter()
        fed = grads(rank, 1)
        kept = all(torch.allclose(after[j], before[j] + fed[j].reshape(-1).double(), atol=1e-5)
                   for j in (0, 2)) and all(not after[j].any() for j in (1, 3))
        return errors, kept
    assert run_ranks(2, body, timeout=60) == [([True, True], True)] * 2


def test_inline_where_the_transport_allows_no_second_thread():
    """MPI without MPI_THREAD_MULTIPLE: each exchange runs in DDP's thread, with the same bits."""
    def body(rank, tr):
        tr.threads_allowed = lambda: False
        state, params = SlimState(transport=tr, density=0.05), make_params()
        out = [iterate(state, params, rank, t) for t in range(3)]
        return out, state._pass.threaded is False
    inline = run_ranks(2, body, timeout=60)
    threaded = run(2, 3, density=0.05)
    for (res, no_pool), (ref, _) in zip(inline, threaded):
        assert no_pool
        assert all(torch.equal(res[t][j], ref[t][j]) for t in range(3) for j in range(4))


def test_a_checkpoint_of_another_format_is_refused_by_its_version():
    state = SlimState(density=0.05)
    with pytest.raises(ValueError, match="SlimState checkpoint is format 1.*fresh SlimState"):
        state.load_state_dict({"version": 1, "buckets": [], "iteration": 3, "carry": {}})
    with pytest.raises(ValueError, match="unknown SlimState format version 7"):
        state.load_state_dict({"version": 7})
    assert state.iteration == 0 and not state._buckets.saved


def test_close_ends_the_thread_keeps_the_data_and_refuses_later_passes():
    """close() between passes: the communication thread ends, a transport the state did not
    make is left open, comm_stats() and state_dict() still answer (unchanged), a second close
    does nothing, and the next pass fails on every bucket naming close(). Mid-pass it is
    refused, and the pass goes on."""
    def body(rank, tr):
        closed = []
        tr.close = lambda: closed.append(True)
        state, params = SlimState(transport=tr, density=0.05), make_params()
        iterate(state, params, rank, 0)
        for p, g in zip(params, grads(rank, 1)):   # the first bucket of a pass...
            p.grad = g
        first = slim_hook(state, FakeBucket(0, [params[j] for j in BUCKETS[0]], False))
        with pytest.raises(RuntimeError, match="during a backward pass"):
            state.close()
        last = slim_hook(state, FakeBucket(1, [params[j] for j in BUCKETS[1]], True))
        delivered = [first.wait(), last.wait()]   # ... which ends as usual
        pool = state._pass._starter._pool
        before, stats = state.state_dict(), state.comm_stats()
        state.close()
        state.close()
        after, same_stats = state.state_dict(), state.comm_stats() == stats
        same = same_state(before, after)
        with pytest.raises(RuntimeError, match=r"was closed \(SlimState.close\(\)\)"):
            iterate(state, params, rank, 2)
        return (pool._shutdown, state._pass.threaded, closed, same, same_stats,
                all(d.isfinite().all() for d in delivered))
    assert run_ranks(2, body, timeout=60) == [(True, False, [], True, True, True)] * 2


def test_the_transport_the_state_made_is_closed_once_by_close_or_when_collected(monkeypatch):
    """What the state made at its first bucket (torch.distributed's private group, here a
    simulated transport in its place) it closes: at close() once, or when it is collected
    unclosed (as at exit, through the same finalizer)."""
    import gc

    import hvd_slim.ddp.state as state_module

    def body(rank, tr):
        closed = []
        tr.close = lambda: closed.append(True)
        monkeypatch.setattr(state_module, "group_transport", lambda group, device: (tr, True))
        counts = []
        for explicit in (True, False):
            state, params = SlimState(density=0.05), make_params()
            iterate(state, params, rank, 0)
            counts.append(len(closed))
            if explicit:
                state.close()
                state.close()
            del state
            gc.collect()
            counts.append(len(closed))
        return counts
    # one rank at a time patches the module: two ranks would patch it with each other's transport
    assert run_ranks(1, body, timeout=60) == [[0, 1, 1, 2]]


def test_the_lightning_callback_takes_a_slim_state_only():
    """hvd_slim.ddp.lightning.SlimHookCallback (run whole in examples/lightning_ddp.py's
    tests, under SGD and AdamW) refuses anything but a SlimState, naming what it got."""
    pytest.importorskip("lightning")
    from hvd_slim.ddp.lightning import SlimHookCallback
    with pytest.raises(TypeError, match="must be a hvd_slim.ddp.SlimState, got dict"):
        SlimHookCallback({})
    state = SlimState(density=0.05)
    assert SlimHookCallback(state).state is state
