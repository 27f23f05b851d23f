"""The header rows that start an optimizer's exchange, and what ``join`` learns from them
(pure logic: rows built here, no processes)."""
import numpy as np
import pytest
import torch

from hvd_slim.api.engine_rounds import (ALLREDUCE, BARRIER, FLUSH, JOIN, LOOKS, STEP, JoinState,
                                        Round, Sig, exchange, header)

pytestmark = pytest.mark.unit


def step_row(oid, flush=False):
    kind = FLUSH if flush else STEP
    return header(Sig(kind, f"DistributedOptimizer #{oid} {'flush' if flush else 'step'}",
                      extra={"optimizer": oid}))


def join_row():
    return header(Sig(JOIN, "join"))


def test_the_exchange_round_names_the_optimizer():
    rnd = Round(np.stack([join_row(), step_row(3), step_row(3)]))
    assert rnd.kind() == STEP and rnd.exchange_id() == 3 and rnd.agreed()
    assert rnd.joined == [0] and rnd.active == [1, 2]


def test_two_optimizers_or_a_step_and_a_flush_do_not_agree():
    assert not Round(np.stack([step_row(1), step_row(2)])).agreed()
    assert not Round(np.stack([step_row(1), step_row(1, flush=True)])).agreed()
    allreduce = header(Sig(ALLREDUCE, "allreduce", extra={"op": 1}))
    assert not Round(np.stack([step_row(1), allreduce])).agreed()


def test_join_state_reports_the_optimizers_served_while_a_rank_had_joined():
    joins = JoinState()
    assert joins.observe(Round(np.stack([step_row(5), step_row(5), step_row(5)]))) is None
    assert joins.observe(Round(np.stack([join_row(), step_row(7), step_row(7)]))) is None
    assert joins.observe(Round(np.stack([join_row(), step_row(5), step_row(5)]))) is None
    assert joins.observe(Round(np.stack([join_row(), join_row(), step_row(7)]))) is None
    # every rank has joined: the last to join, and optimizers 7 and 5 in the order first served
    assert joins.observe(Round(np.stack([join_row()] * 3))) == (2, [7, 5])
    # a fresh epoch: an exchange no rank was joined for is not reported
    assert joins.observe(Round(np.stack([step_row(5)] * 3))) is None
    assert joins.observe(Round(np.stack([join_row()] * 3))) == (2, [])


def _allreduce(behind=False, looks=0):
    return header(Sig(ALLREDUCE, "allreduce", torch.float32, (3,), extra={"op": 1}),
                  barrier_behind=behind, looks=looks)


def _barrier(looks=0):
    return header(Sig(BARRIER, "barrier"), looks=looks)


def test_a_barrier_against_a_call_with_a_barrier_behind_it_catches_up():
    rnd = Round(np.stack([_allreduce(behind=True), _barrier()]))
    assert rnd.catch_up() and not rnd.agreed()


def test_a_barrier_against_a_call_not_yet_known_to_have_one_behind_looks_again_then_stands():
    """The pending rank's header may have gone out before its caller queued the barrier: the
    ranks meet again, each deciding from the rows alike, until some rank has looked LOOKS
    times; then the mismatch stands."""
    for looks in range(LOOKS):
        rnd = Round(np.stack([_allreduce(looks=looks), _barrier(looks=min(looks, 2))]))
        assert not rnd.catch_up() and rnd.second_look()
    rnd = Round(np.stack([_allreduce(looks=LOOKS), _barrier(looks=3)]))
    assert not rnd.second_look() and not rnd.agreed()
    # looks never make ranks that agree disagree, nor a joined rank's row count
    assert Round(np.stack([_barrier(looks=4), _barrier()])).agreed()
    assert not Round(np.stack([_allreduce(), _allreduce(looks=1)])).second_look()
    joined = Round(np.stack([header(Sig(JOIN, "join")), _barrier(), _allreduce(looks=2)]))
    assert joined.second_look() and joined.active == [1, 2]


def test_a_rows_looks_are_bounded_and_checked_on_receipt():
    with pytest.raises(ValueError, match="looks"):
        header(Sig(BARRIER, "barrier"), looks=LOOKS + 1)

    class Api:
        rank = 0

        def __init__(self, rows):
            self.rows = rows

        def allgather_int64(self, row):
            return np.stack(self.rows)

    good = _allreduce(behind=True, looks=LOOKS)
    assert exchange(Api([good, _barrier()]), good, "x").catch_up()
    bad = good.copy()
    bad[11] = 2 * (LOOKS + 1)
    with pytest.raises(Exception, match="rank 1 sent"):
        exchange(Api([good, bad]), good, "x")
