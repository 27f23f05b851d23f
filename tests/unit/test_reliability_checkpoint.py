"""Checkpoints: a mismatched one is refused clearly and changes nothing; save + resume (through
files, weights_only) equals an uninterrupted run bitwise; flush() makes a checkpoint hold every
gradient computed, exactly (issue 6, "Nothing lost")."""
import copy
import io

import pytest
import torch

import hvd_slim
from hvd_slim.transport import run_ranks

from test_reliability_nonfinite import assert_same, batch, flat, model


def wrap(m, transport, **kw):
    kw.setdefault("min_compress_numel", 1000)
    kw.setdefault("density", 0.02)
    opt_kw = kw.pop("opt_kw", dict(lr=0.1, momentum=0.9))
    return hvd_slim.DistributedOptimizer(torch.optim.SGD(m.parameters(), **opt_kw),
                                         named_parameters=m.named_parameters(),
                                         transport=transport, **kw)


def train(m, opt, rank, steps):
    for t in steps:
        x, y = batch(rank, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


def roundtrip(obj):
    """Through bytes the way a checkpoint file goes, and read back without unpickling code."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def trained_states(size=2, steps=3, **kw):
    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, **kw)
        train(m, opt, rank, range(steps))
        return roundtrip(opt.state_dict())
    return run_ranks(size, body, timeout=60)


def refused(state, match, size=2, rank=1, **kw):
    """Load ``state`` into a fresh, trained-once rank ``rank``; it must raise ValueError
    matching ``match`` and leave the optimizer and model bitwise unchanged."""
    def body(r, tr):
        m = model()
        opt = wrap(m, tr, **kw)
        train(m, opt, r, range(1))
        before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in m.parameters()]
        if r == rank:
            with pytest.raises(ValueError, match=match) as info:
                opt.load_state_dict(state)
            assert_same(before, (opt.state_dict(), [p.detach() for p in m.parameters()]))
            return str(info.value)
        return None
    return run_ranks(size, body, timeout=60)[rank]


def test_another_ranks_checkpoint_is_refused_and_says_how_to_fix_it():
    states = trained_states()
    msg = refused(states[0], r"holds the residuals of rank 0 of 2; this is rank 1 of 2")
    assert "save every rank's optimizer.state_dict()" in msg and "flush()" in msg


def test_another_models_checkpoint_names_the_first_differing_parameter():
    states = trained_states()
    state = copy.deepcopy(states[1])
    row = next(r for r in state["hvd_slim"]["layout"] if r[0] == "0.weight")
    row[1] = [61, 40]
    refused(state, r"different model: parameter '0.weight': shape \(61, 40\) float32 in the "
                   r"checkpoint vs. shape \(60, 40\) float32 now")


def test_another_configs_checkpoint_names_the_field():
    states = trained_states(density=0.05)
    refused(states[1], r"other Slim-DP settings: config field 'density': 0.05 in the checkpoint "
                       r"vs. 0.02 now")


def test_timeout_and_nonfinite_may_change_on_resume():
    states = trained_states(timeout=30, nonfinite="raise")

    def body(rank, tr):
        m = model()
        opt = wrap(m, tr, timeout=90, nonfinite="skip")
        opt.load_state_dict(states[rank])
        train(m, opt, rank, range(3, 5))
        return flat(m)
    res = run_ranks(2, body, timeout=60)
    assert torch.equal(res[0], res[1])


@pytest.mark.parametrize("corrupt, match", [
    (lambda s, i: s["memory"][i].__setitem__("residual", torch.zeros(5)), r"residual is \(5,\)"),
    (lambda s, i: s["memory"][i].pop("velocity"), r"velocity is"),
    (lambda s, i: s["selector"][i].__setitem__("threshold", float("nan")), r"threshold nan"),
    (lambda s, i: s.__setitem__("step", -2), r"step must be an integer >= 0"),
    (lambda s, i: s.__setitem__("version", 99), r"unknown format version 99"),
    (lambda s, i: s.__setitem__("server", None), r"is the server but its checkpoint has no"),
    (lambda s, i: s["server"]["memory"][i].__setitem__("residual", torch.zeros(3).long()),
     r"residual is \(3,\) torch.int64"),
])
def test_a_corrupted_checkpoint_is_refused_before_anything_changes(corrupt, match):
    """Rank 0 is the server; every corruption is found before the first byte is loaded (the
    server's state is loaded last, so a late check would have left the rest half-loaded)."""
    state = copy.deepcopy(trained_states()[0])
    (index,) = state["hvd_slim"]["memory"]   # the one compressed bucket
    corrupt(state["hvd_slim"], index)
    refused(state, match, rank=0)


def test_an_inner_optimizer_mismatch_leaves_the_slim_state_alone():
    states = trained_states()
    state = copy.deepcopy(states[1])
    state["param_groups"].append(dict(state["param_groups"][0], params=[]))
    refused(state, r"different number of parameter groups")


def assert_resume_is_bitwise(tmp_path, size, T, **kw):
    """Save at step T and resume from the files: the model and residual norm after 2T steps
    equal an uninterrupted run's, on every rank (``kw`` go to :func:`wrap`)."""
    def run(rank, tr, mode):
        m = model()
        opt = wrap(m, tr, **kw)
        if mode == "resume":
            m.load_state_dict(torch.load(tmp_path / f"model-{rank}.pt", weights_only=True))
            opt.load_state_dict(torch.load(tmp_path / f"opt-{rank}.pt", weights_only=True))
        train(m, opt, rank, range(T, 2 * T) if mode == "resume" else range(T))
        if mode == "save":
            torch.save(m.state_dict(), tmp_path / f"model-{rank}.pt")
            torch.save(opt.state_dict(), tmp_path / f"opt-{rank}.pt")
            return None
        if mode == "full":
            train(m, opt, rank, range(T, 2 * T))
        return flat(m), opt._exchange.residual_norm()

    full = run_ranks(size, lambda r, tr: run(r, tr, "full"), timeout=60)
    run_ranks(size, lambda r, tr: run(r, tr, "save"), timeout=60)
    resumed = run_ranks(size, lambda r, tr: run(r, tr, "resume"), timeout=60)
    for (a, na), (b, nb) in zip(full, resumed):
        assert torch.equal(a, b) and na == nb and na > 0


def test_save_at_t_and_resume_from_files_equals_an_uninterrupted_run_at_2t(tmp_path):
    """3 ranks, momentum correction, pull="slim" (the server's residual is saved too)."""
    assert_resume_is_bitwise(tmp_path, 3, 4)


def test_flush_before_a_checkpoint_conserves_every_gradient_exactly():
    """Integer gradients, op=Sum, plain SGD with lr=1: every sum is exact in float32, so the
    flushed model must equal p0 - (sum of every gradient of every rank) bit for bit."""
    steps, size = 5, 3

    def grads(rank, t, p, name):
        g = torch.Generator().manual_seed(hash((rank, t, name)) % (2 ** 31))
        return torch.randint(-8, 9, p.shape, generator=g).float()

    def body(rank, tr):
        m = model()
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.round(p * 64))   # integers: exact arithmetic from here on
        opt = wrap(m, tr, op=hvd_slim.Sum, density=0.01, opt_kw=dict(lr=1.0))
        for t in range(steps):
            opt.zero_grad()
            for name, p in m.named_parameters():
                p.grad = grads(rank, t, p, name)
            opt.step()
        held = opt._exchange.residual_norm()
        opt.flush()
        saved = roundtrip(m.state_dict())
        return saved, held, opt._exchange.residual_norm()

    res = run_ranks(size, body, timeout=60)
    m = model()
    for name, p in m.named_parameters():
        expected = torch.round(p.detach() * 64) - sum(
            grads(r, t, p, name) for r in range(size) for t in range(steps))
        for saved, held, after in res:
            assert torch.equal(saved[name], expected), name
    assert all(held > 0 and after == 0.0 for _, held, after in res)


def _as_saved_before_refresh_interval_was_removed(state, q):
    """A version-3 state: refresh_interval among the settings, cached cores beside the rest."""
    old = copy.deepcopy(state)
    slim = old["hvd_slim"]
    slim["version"] = 3
    slim["effective"]["refresh_interval"] = q
    slim["config"]["refresh_interval"] = q
    slim["core"] = {i: torch.arange(3) for i in slim["memory"]}
    slim["pull_core"] = {}
    if slim.get("server") is not None:
        slim["server"]["worker_cores"] = [{}, {}]
        slim["server"]["pull_core"] = {}
    return old


def test_a_checkpoint_saved_before_refresh_interval_was_removed_resumes_bitwise():
    """At q = 1 (every step selected anew) an older checkpoint's cached cores were never read
    again: it loads, and a step from it equals a step from today's checkpoint. At q > 1 it is
    refused, naming the keyword and what to do."""
    states = trained_states()

    def body(rank, tr):
        out, start = [], None
        for state in (states[rank], _as_saved_before_refresh_interval_was_removed(states[rank], 1)):
            m = model()
            opt = wrap(m, tr)
            train(m, opt, rank, range(1))
            opt.load_state_dict(state)
            if start is None:
                start = copy.deepcopy(m.state_dict())
            m.load_state_dict(start)   # the same parameters, so the steps compare
            train(m, opt, rank, range(3, 5))
            out.append((flat(m), roundtrip(opt.state_dict())["hvd_slim"]["memory"]))
        return out

    for today, older in run_ranks(2, body, timeout=60):
        assert torch.equal(today[0], older[0])
        assert_same(today[1], older[1])
    msg = refused(_as_saved_before_refresh_interval_was_removed(states[1], 4),
                  r"made with refresh_interval=4, which hvd_slim no longer has")
    assert "flush()" in msg
