"""The header rows that start an optimizer's exchange, and what ``join`` learns from them
(pure logic: rows built here, no processes)."""
import numpy as np
import pytest

from hvd_slim.api.engine_rounds import ALLREDUCE, FLUSH, JOIN, STEP, JoinState, Round, Sig, header

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
