"""Ranks that disagree (model, settings, frozen parameters, step) are caught at the first step:
every simulated rank raises the same error naming the first differing parameter or config field
and the ranks on each side, instead of hanging or training on garbage (issue 6)."""
import numpy as np
import pytest
import torch

import hvd_slim
from hvd_slim.config import SlimConfig
from hvd_slim.exchange import ExchangeError, Layout, SlimExchange
from hvd_slim.exchange.handshake import _guard, _judge_hellos
from hvd_slim.transport import run_ranks
from hvd_slim.wire import control
from hvd_slim.wire import message as wm

SHAPES = {"conv.weight": (20, 10, 5, 5), "fc.weight": (30, 200), "fc.bias": (30,)}


def params(shapes=SHAPES, dtype=torch.float32):
    return [(n, torch.nn.Parameter(torch.ones(s, dtype=dtype))) for n, s in shapes.items()]


def first_step_error(size, make):
    """Run one exchange step per simulated rank; ``make(rank)`` returns (named params, config,
    comm dtype function). Returns every rank's error text (None where a rank succeeded)."""
    def body(rank, transport):
        named, config, wire = make(rank)
        ex = SlimExchange(Layout(named, config, wire), config, transport)
        for _, p in named:
            p.grad = torch.ones_like(p)
        try:
            ex.step()
        except ExchangeError as exc:
            return str(exc)
        return None
    return run_ranks(size, body, timeout=60)


def same_everywhere(msgs):
    assert all(m is not None for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs
    return msgs[0]


CFG = SlimConfig(density=0.01, min_compress_numel=1000)
SAME = lambda dt: dt  # noqa: E731


def test_different_models_name_the_parameter_and_the_ranks():
    def make(rank):
        shapes = dict(SHAPES, **({"fc.weight": (31, 200)} if rank == 1 else {}))
        return params(shapes), CFG, SAME
    msg = same_everywhere(first_step_error(3, make))
    assert ("Parameter 'fc.weight': shape (30, 200) float32 on ranks 0, 2 vs. "
            "shape (31, 200) float32 on rank 1.") in msg, msg
    assert "digest" in msg and "same model" in msg


def test_a_parameter_missing_on_one_rank():
    def make(rank):
        shapes = {k: v for k, v in SHAPES.items() if not (rank == 2 and k == "conv.weight")}
        return params(shapes), CFG, SAME
    msg = same_everywhere(first_step_error(3, make))
    assert "Parameter 'conv.weight': shape (20, 10, 5, 5) float32 on ranks 0, 1 vs. absent on " \
           "rank 2." in msg, msg


def test_a_different_density_names_the_config_field():
    def make(rank):
        return params(), SlimConfig(density=0.05 if rank == 2 else 0.01,
                                    min_compress_numel=1000), SAME
    msg = same_everywhere(first_step_error(3, make))
    assert "Config field 'density': 0.01 on ranks 0, 1 vs. 0.05 on rank 2." in msg, msg
    assert "HVD_SLIM_" in msg  # says how to fix it


@pytest.mark.parametrize("field, mine, theirs, shown", [
    ("value_bits", 8, 16, ("8", "16")),
    ("warmup_start_density", 0.08, 0.5, ("0.08", "0.5")),
    ("warmup_decay_steps", None, 7, ("100", "7")),   # automatic: 1/density steps
    ("nonfinite", "flag", "raise", ("'flag'", "'raise'")),   # one rank skipping, one raising
])
def test_new_keywords_are_compared_by_the_handshake(field, mine, theirs, shown):
    """value_bits and the warm-up's settings change the wire or its slice sizes: a rank that
    differs is named, with the values in force (an automatic one resolved)."""
    def make(rank):
        return params(), SlimConfig(min_compress_numel=1000, density=0.01,
                                    **{field: theirs if rank == 1 else mine}), SAME
    msg = same_everywhere(first_step_error(3, make))
    assert (f"Config field '{field}': {shown[0]} on ranks 0, 2 vs. {shown[1]} on rank 1."
            in msg), msg


def test_an_automatic_value_spelt_out_agrees_with_it():
    """Ranks compare the settings in force: spelling out the automatic warm-up is no mismatch."""
    def make(rank):
        explicit = dict(warmup_decay_steps=100, warmup_start_density=0.08) if rank else {}
        return params(), SlimConfig(min_compress_numel=1000, density=0.01, **explicit), SAME
    assert first_step_error(2, make) == [None, None]


def test_a_different_server_rank_is_caught_instead_of_waiting_on_two_roots():
    def make(rank):
        return params(), SlimConfig(server_rank=1 if rank == 1 else 0,
                                    min_compress_numel=1000), SAME
    msg = same_everywhere(first_step_error(2, make))
    assert "Config field 'server_rank': 0 on rank 0 vs. 1 on rank 1." in msg, msg


def test_a_different_compression_names_the_wire_dtype():
    def make(rank):
        return params(), CFG, (lambda dt: torch.float16) if rank == 1 else SAME
    msg = same_everywhere(first_step_error(2, make))
    assert "sent as float16 on rank 1" in msg, msg


def test_a_parameter_frozen_on_one_rank_only():
    def body(rank, transport):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Linear(60, 3))
        if rank == 1:
            model[0].weight.requires_grad_(False)
        opt = hvd_slim.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            transport=transport, min_compress_numel=1000)
        model(torch.randn(4, 40)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ExchangeError) as info:
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return str(info.value)
    msg = same_everywhere(run_ranks(3, body, timeout=60))
    assert ("Parameter '0.weight': shape (60, 40) float32 on ranks 0, 2 vs. frozen "
            "(requires_grad=False), shape (60, 40) float32 on rank 1.") in msg, msg


def test_ranks_at_different_steps_are_out_of_step():
    def body(rank, transport):
        named = params()
        ex = SlimExchange(Layout(named, CFG, SAME), CFG, transport)
        ex.step_count = 7 if rank == 2 else 5   # as if rank 2 loaded a later checkpoint
        for _, p in named:
            p.grad = torch.ones_like(p)
        with pytest.raises(ExchangeError) as info:
            ex.step()
        return str(info.value)
    msg = same_everywhere(run_ranks(3, body, timeout=60))
    assert "out of step: step 5 on ranks 0, 1 vs. step 7 on rank 2." in msg, msg


def test_agreement_costs_one_small_round_once():
    def body(rank, transport):
        named = params()
        ex = SlimExchange(Layout(named, CFG, SAME), CFG, transport)
        calls = []
        for t in range(3):
            for _, p in named:
                p.grad = torch.full_like(p, float(t + 1))
            before = transport.stats.calls
            ex.step()
            calls.append(transport.stats.calls - before)
        return calls, transport.stats.per_op
    for calls, _ in run_ranks(3, body, timeout=60):
        assert calls == [4, 2, 2]   # handshake (gather + broadcast) on the first step only


def test_a_malformed_hello_becomes_an_error_every_rank_reads():
    hellos = [control.encode_control(wm.HELLO, r, 3, 42) for r in range(3)]
    hellos[2] = hellos[2][:20]   # truncated
    reply = _guard(lambda: _judge_hellos(hellos, 3), 3)
    with pytest.raises(wm.RemoteError, match="hello from rank 2: truncated message of 20 bytes"):
        wm.peek(reply, "reply")
    hellos[2] = control.encode_control(wm.HELLO, 1, 3, 42)   # claims to be rank 1
    with pytest.raises(wm.RemoteError, match="hello from rank 2: message claims sender rank 1"):
        wm.peek(_guard(lambda: _judge_hellos(hellos, 3), 3), "reply")


def test_handshake_verdicts_are_strictly_decoded():
    agreed = control.encode_control(wm.AGREED, 0, 3, 0)
    assert control.decode_control(agreed, kind=wm.AGREED, sender=0, step=3, digest=None,
                                  who="reply") == (3, 0)
    for bad in (agreed[:31], np.concatenate([agreed, agreed[:1]])):
        with pytest.raises(wm.WireError):
            control.decode_control(bad, kind=wm.AGREED, sender=0, step=3, digest=None, who="r")
    with pytest.raises(wm.WireError, match="expected step 4"):
        control.decode_control(agreed, kind=wm.AGREED, sender=0, step=4, digest=None, who="r")
