"""The first-step handshake: every rank checks, once, that all ranks run the same exchange.

Rank 0 gathers a 32-byte HELLO (step and digest of names, shapes, dtypes and config) from every
rank. When all agree it answers AGREED and training goes on: one small round trip per run.
Otherwise it answers DESCRIBE, every rank sends a JSON description (describe.py), and rank 0
broadcasts one ERROR naming the first differing config field and parameter and the ranks on each
side, which every rank raises as the same :class:`ExchangeError`. Rank 0 leads whatever
``server_rank`` says, so ranks that disagree on the server cannot wait on different roots.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import numpy as np

from ..wire import control
from ..wire import message as wm
from .describe import (config_difference, grouped, param_difference, params_of, rank_description,
                       ranks_text)
from .errors import ExchangeError
from .loss_scale import TOLD_BIT

if TYPE_CHECKING:   # step.py imports this module
    from .step import SlimExchange

ROOT = 0
REPLY_BOUND = 1 << 14  # every reply (AGREED, DESCRIBE, ERROR) fits; error texts are cut to fit
FIX = ("Every rank must build the same model, freeze the same parameters, pass the same "
       "DistributedOptimizer keywords and HVD_SLIM_* variables, give set_grad_scaler() a "
       "GradScaler on every rank or on none, and call optimizer.step() the same number of "
       "times (a resumed job: every rank loads its own checkpoint of one save)")


def check_agreement(ex: SlimExchange, step: int) -> None:
    """Collective over every rank of ``ex.transport``: return when all ranks agree with this
    one, else raise the same :class:`ExchangeError` on every rank."""
    tr, rank = ex.transport, ex.rank
    # Whether the exchange was told a loss scale (exchange/loss_scale.py) joins the digest here
    # only: it may be told after the exchange was built, before this first step.
    told = ex.layout.loss_scale.told
    hello = control.encode_control(wm.HELLO, rank, step, ex.digest ^ (TOLD_BIT if told else 0))
    got = tr.gather(hello, root=ROOT, bound=len(hello))
    reply = _guard(lambda: _judge_hellos(got, step), step) if rank == ROOT else None
    if _read_reply(tr.broadcast(reply, root=ROOT, bound=REPLY_BOUND), step) == wm.AGREED:
        return
    desc = control.encode_description(rank, step, ex.digest,
                                      rank_description(ex.layout, ex.cfg, rank, step, ex.digest,
                                                       told))
    got = tr.gather(desc, root=ROOT, bound=None)
    reply = _guard(lambda: _judge_descriptions(got, step), step) if rank == ROOT else None
    _read_reply(tr.broadcast(reply, root=ROOT, bound=REPLY_BOUND), step)
    raise ExchangeError(f"rank {rank}: the handshake of step {step} ended without a verdict")


class Agreement:
    """Whether the ranks of an exchange have agreed yet: :meth:`ensure` runs the handshake once,
    before the first push, and again after :meth:`reset` (a checkpoint loaded, so ranks resumed
    from different steps are caught). ``done``: it has run since."""

    def __init__(self) -> None:
        self.done = False

    def ensure(self, ex: SlimExchange, step: int,
               collective: Callable[[Callable[[], Any], str], Any]) -> None:
        """Unless ``done``: :func:`check_agreement` of ``ex`` at ``step``, run by ``collective``
        (the exchange's, under its timeout). Collective then; a failure leaves it not done."""
        if not self.done:
            collective(lambda: check_agreement(ex, step), f"the handshake of step {step}")
            self.done = True

    def mark(self) -> None:
        """The ranks agreed in a handshake that covers this exchange too (a staged
        exchange's, of the whole model): no handshake of its own."""
        self.done = True

    def reset(self) -> None:
        """Run the handshake again before the next push."""
        self.done = False


def _guard(judge: Callable[[], np.ndarray], step: int) -> np.ndarray:
    """Rank 0's verdict, or an ERROR carrying whatever went wrong while judging."""
    try:
        return judge()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then raise
        return wm.encode_error(ROOT, step, f"rank {ROOT} could not check the ranks' agreement at "
                               f"step {step}: {type(exc).__name__}: {exc}", limit=REPLY_BOUND)


def _read_reply(buf: np.ndarray, step: int) -> int:
    """AGREED or DESCRIBE; an ERROR raises its text as :class:`ExchangeError`."""
    who = f"handshake reply from rank {ROOT}"
    try:
        kind = wm.peek(buf, who)
        if kind not in (wm.AGREED, wm.DESCRIBE):
            raise wm.WireError(f"{who}: unexpected {wm.KIND_NAMES[kind]} message")
        control.decode_control(buf, kind=kind, sender=ROOT, step=step, digest=None, who=who)
        return kind
    except wm.RemoteError as exc:
        raise ExchangeError(str(exc)) from None
    except wm.WireError as exc:
        raise ExchangeError(str(exc)) from None


def _judge_hellos(got: List[np.ndarray], step: int) -> np.ndarray:
    steps: Dict[int, str] = {}
    digests: Dict[int, str] = {}
    for j, buf in enumerate(got):
        s, d = control.decode_control(buf, kind=wm.HELLO, sender=j, step=None, digest=None,
                                      who=f"hello from rank {j}")
        steps[j], digests[j] = f"step {s}", f"{d:016x}"
    if len(set(digests.values())) > 1:
        return control.encode_control(wm.DESCRIBE, ROOT, step, 0)
    if len(set(steps.values())) > 1:
        return wm.encode_error(ROOT, step, "hvd_slim: the ranks are out of step: "
                               f"{grouped(steps, ranks_text)}. {FIX}", limit=REPLY_BOUND)
    return control.encode_control(wm.AGREED, ROOT, step, 0)


def _judge_descriptions(got: List[np.ndarray], step: int) -> np.ndarray:
    descs: Dict[int, dict] = {}
    for j, buf in enumerate(got):
        # Strict, but without a digest check: the digests are what differs.
        descs[j] = control.decode_description(buf, sender=j, step=step, digest=None,
                                              who=f"description from rank {j}")
    return wm.encode_error(ROOT, step, mismatch_text(descs, step), limit=REPLY_BOUND)


def mismatch_text(descs: Dict[int, dict], step: Optional[int] = None) -> str:
    """The error every rank raises when ``descs`` (rank -> description) disagree."""
    params = {}
    for j, d in descs.items():
        try:
            params[j] = params_of(d)
        except ValueError as exc:
            return f"hvd_slim: rank {j} sent an unreadable description ({exc})"
    found = [t for t in (config_difference({j: d.get("config") for j, d in descs.items()},
                                           ranks_text),
                         param_difference(params, ranks_text)) if t]
    digests = grouped({j: f"{d.get('digest')}" for j, d in descs.items()}, ranks_text)
    at = "" if step is None else f" at step {step}"
    detail = ". ".join(t[0].upper() + t[1:] for t in found) if found else \
        "No parameter or config field differs (a different hvd_slim version on some rank?)"
    return (f"hvd_slim: the ranks disagree on the model or the Slim-DP settings{at}. {detail}. "
            f"(Layout/config digest {digests}.) {FIX}")
