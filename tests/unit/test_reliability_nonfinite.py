"""NaN/Inf gradients under ``nonfinite="raise" | "skip" | "propagate"``, over N simulated ranks:
every rank reaches the same outcome and no rank diverges (issue 6, "Failures")."""
import copy

import pytest
import torch

import hvd_slim
from hvd_slim.exchange import NonFiniteGradientError
from hvd_slim.transport import run_ranks

torch.manual_seed(0)
_INIT = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 50),
                            torch.nn.Linear(50, 3)).state_dict()


def model():
    m = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 50),
                            torch.nn.Linear(50, 3))
    m.load_state_dict(_INIT)
    return m


def batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(8, 40, generator=g), torch.randint(0, 3, (8,), generator=g)


def wrap(m, transport, **kw):
    kw.setdefault("min_compress_numel", 1000)
    kw.setdefault("density", 0.02)
    lr = kw.pop("lr", 0.1)
    return hvd_slim.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9),
                                         named_parameters=m.named_parameters(),
                                         transport=transport, **kw)


def backward(m, rank, t, poison=None):
    x, y = batch(rank, t)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    if poison is not None:
        name, value = poison
        dict(m.named_parameters())[name].grad.view(-1)[1] = value


def snapshot(m, opt):
    sd = copy.deepcopy(opt.state_dict())
    sd["hvd_slim"].pop("stats")
    return [p.detach().clone() for p in m.parameters()], sd, opt._exchange.step_count


def assert_same(a, b, path="state"):
    """Bitwise equality of nested tensors/containers (NaN compares equal to the same NaN)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.view(-1).view(torch.uint8) if b.numel() else b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def refused_step(m, opt):
    """Step, expecting a refusal (a skip, or NonFiniteGradientError's text) that changes no
    parameter, residual, velocity, core or step count."""
    before = snapshot(m, opt)
    try:
        out = opt.step()
    except NonFiniteGradientError as exc:
        out = str(exc)
    assert_same(before, snapshot(m, opt))
    return out


def assert_refused(results, mode, text):
    """Every rank skipped (mode "skip"), or raised the same error containing ``text``."""
    if mode == "skip":
        assert results == [None] * len(results)
    else:
        assert len(set(results)) == 1 and text in results[0], results


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_raise_every_rank_raises_the_same_error_and_nothing_changes(value):
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite="raise")
        for t in range(2):
            opt.zero_grad()
            backward(m, rank, t)
            opt.step()
        opt.zero_grad()
        backward(m, rank, 2, poison=("1.weight", value) if rank == 1 else None)
        before = snapshot(m, opt)
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
        assert_same(before, snapshot(m, opt))
        # Training goes on afterwards, and the replicas still agree.
        for t in range(3, 5):
            opt.zero_grad()
            backward(m, rank, t)
            opt.step()
        return str(info.value), flat(m)

    res = run_ranks(3, body, timeout=60)
    msgs = {msg for msg, _ in res}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert "non-finite gradient at step 2" in msg and "rank 1: NaN/Inf in the gradient of " \
        "'1.weight'" in msg and "nonfinite='flag'" in msg and "nonfinite='skip'" in msg, msg
    assert all(torch.equal(res[0][1], f) for _, f in res)


def test_skip_equals_a_run_without_that_step():
    """A skipped step changes nothing anywhere: the run equals one that never took the step
    (with momentum correction, so velocities are covered)."""
    steps, bad = 7, 3

    def body(rank, tr, poison):
        m = model()
        opt = wrap(m, tr, nonfinite="skip")
        results = []
        for t in range(steps):
            if not poison and t == bad:
                continue   # the reference never takes this step
            opt.zero_grad()
            backward(m, rank, t, ("0.weight", float("nan")) if poison and t == bad
                     and rank == 2 else None)
            before = snapshot(m, opt) if t == bad else None
            results.append(opt.step())
            if before is not None:
                assert_same(before, snapshot(m, opt))
        stats = opt.comm_stats()
        return flat(m), stats["skipped_steps"], stats["steps"], stats["last_skip_reason"]

    skipped = run_ranks(3, lambda r, tr: body(r, tr, True), timeout=60)
    reference = run_ranks(3, lambda r, tr: body(r, tr, False), timeout=60)
    for (got, n_skip, n_steps, why), (ref, ref_skip, ref_steps, _) in zip(skipped, reference):
        assert torch.equal(got, ref)
        assert (n_skip, n_steps) == (1, steps - 1) and (ref_skip, ref_steps) == (0, steps - 1)
        assert "step 3 skipped on every rank" in why and "rank 2" in why and "'0.weight'" in why


def test_skip_with_synchronize_then_skip_synchronize():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite="skip")
        opt.zero_grad()
        backward(m, rank, 0, ("2.bias", float("inf")) if rank == 0 else None)
        before = snapshot(m, opt)
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        with opt.skip_synchronize():
            assert opt.step() is None
        assert_same(before, snapshot(m, opt))
        return opt.comm_stats()["skipped_steps"]

    assert run_ranks(2, body, timeout=60) == [1, 1]


def test_propagate_lets_nan_through_identically_on_every_rank():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite="propagate", density=1.0)
        for t in range(3):
            opt.zero_grad()
            backward(m, rank, t, ("1.bias", float("nan")) if (rank, t) == (1, 1) else None)
            opt.step()
        return flat(m)

    res = run_ranks(3, body, timeout=60)
    assert torch.isnan(res[0]).any()
    for r in res[1:]:
        assert torch.equal(r.view(torch.int32), res[0].view(torch.int32))


def test_propagate_with_slices_keeps_replicas_identical():
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite="propagate", density=0.02)
        for t in range(4):
            opt.zero_grad()
            backward(m, rank, t, ("0.weight", float("inf")) if (rank, t) == (0, 1) else None)
            opt.step()
        return flat(m)

    res = run_ranks(2, body, timeout=60)
    assert not torch.isfinite(res[0]).all()
    assert torch.equal(res[0].view(torch.int32), res[1].view(torch.int32))


@pytest.mark.parametrize("ranks", [2, 3])
def test_propagate_carries_a_nan_out_of_the_slices_at_once(ranks):
    """A NaN in a sliced tensor's gradient reaches every replica's parameter in the step it
    came, as a dense allreduce would carry it; no comparison ranks a NaN, so without a rule
    for it it waited in the residuals until a flush (found by reading, 6 December)."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite="propagate", density=0.02)
        w = dict(m.named_parameters())["0.weight"]
        seen = []
        for t in range(3):
            opt.zero_grad()
            backward(m, rank, t, ("0.weight", float("nan")) if (rank, t) == (ranks - 1, 1)
                     else None)
            opt.step()
            seen.append(bool(torch.isnan(w.view(-1)[1])))
        return seen, flat(m)

    res = run_ranks(ranks, body, timeout=60)
    for seen, params in res:
        assert seen == [False, True, True]
        assert torch.equal(params.view(torch.int32), res[0][1].view(torch.int32))


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_fp16_overflow_on_the_wire_is_caught(mode):
    """Finite in float32 but beyond float16's range: sending it would put Inf into every
    replica and -Inf into the sender's residual."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, nonfinite=mode, compression=hvd_slim.Compression.fp16, value_bits=32)
        opt.zero_grad()
        backward(m, rank, 0, ("1.weight", 1e6) if rank == 1 else None)
        return refused_step(m, opt)

    assert_refused(run_ranks(2, body, timeout=60), mode, "'1.weight' overflow float16 on the wire")


def test_scaled_8bit_slices_carry_what_float16_cannot():
    """With value_bits=8 a slice travels as float8 times a power of two, whatever
    Compression.fp16 does to dense values: 1e6 arrives (rounded), nothing is refused, and the
    replicas stay identical."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, compression=hvd_slim.Compression.fp16, value_bits=8)
        opt.zero_grad()
        backward(m, rank, 0, ("1.weight", 1e6) if rank == 1 else None)
        opt.step()
        return flat(m)

    res = run_ranks(2, body, timeout=60)
    assert torch.isfinite(res[0]).all() and torch.equal(res[0], res[1])


def test_the_servers_aggregate_overflowing_fp16_is_caught():
    """Each rank's 40000 fits float16, their sum (op=Sum) does not: the server decides."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, op=hvd_slim.Sum, compression=hvd_slim.Compression.fp16, density=1.0,
                   nonfinite="raise")
        opt.zero_grad()
        for p in m.parameters():
            p.grad = torch.full_like(p, 40000.0)
        with pytest.raises(NonFiniteGradientError) as info:
            opt.step()
        return str(info.value)

    res = run_ranks(2, body, timeout=60)
    assert res[0] == res[1] and "the server's aggregate" in res[0] and "float16" in res[0]


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_the_servers_sliced_aggregate_overflowing_fp16_restores_its_residual(mode):
    """pull="slim" aggregates into the server's residual in place; when the pulled slice then
    overflows float16 the step is refused and that residual must come back bit for bit."""
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, op=hvd_slim.Sum, nonfinite=mode,
                   compression=hvd_slim.Compression.fp16, value_bits=32)
        for t in range(3):   # ordinary steps first: non-zero residuals everywhere
            opt.zero_grad()
            backward(m, rank, t)
            opt.step()
        opt.zero_grad()
        backward(m, rank, 3, ("1.weight", 40000.0))   # fits float16; the sum of two does not
        return refused_step(m, opt)

    assert_refused(run_ranks(2, body, timeout=60), mode, "the server's aggregate")
