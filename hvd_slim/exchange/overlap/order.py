"""P3's order for ``overlap_forward=True`` (docs/design.md §2 "Overlap"): the stages nearest
the input go first once backward is over, and ``step()`` may return before the rest is back.

During backward the stages run as with ``overlap`` alone, in backward order, each once its
gradients are in. Before each stage every rank says, in one small round (ORDER), whether all
its gradients are in. Once every rank says so, the stages not begun yet run in reverse (the
first layers, which the next forward pass needs first, first), and that same round carries the
step's verdict: whether any rank found a NaN/Inf in them (their local phases, compensate and
select, run before it). The stages begun earlier have had their verdicts already (a skip ends
the step there). So when the round is clear, every stage of the step will commit, barring a
failed transport (or a sum of finite values that overflows after the round, a 16-bit wire's
or host's: then :func:`late_verdict` has ``step()`` wait for every stage instead), and
``step()`` may hand the step over as a :class:`Deferred`: each stage is
settled, and its parameters stepped, only when the next forward pass reaches them
(hvd_slim/optim/forward_apply.py). When it is not clear the stages run in backward order and the
step is settled as one, as without ``overlap_forward``.

Every rank decides from the round's answer alone, so all make the same collectives in the same
order; the round costs one gather and one broadcast of 32 bytes a stage.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set

import torch

from ...wire import control
from ...wire import message as wm
from ..handshake import ROOT
from .runner import Job, ends_step

if TYPE_CHECKING:   # pragma: no cover
    from ...config import SlimConfig
    from ..layout import Layout
    from ..protocol import Stage

# ORDER flags: this rank's gradients are all in; none of its stages not begun found NaN/Inf.
FINAL, CLEAR = 1, 2
# Job.error's stage for a failed schedule round (-1 is the join round's).
ROUND_FAILED = -2


# The reply's bound: an ORDER, or an ERROR whose text says why rank 0 could not read one.
REPLY_BOUND = wm.HEADER.size + 512


def order_round(ex: "Stage", t: int, digest: int, flags: int) -> int:
    """Collective over ``ex``'s ranks: the AND of every rank's ``flags`` (gathered on rank 0
    of the set, answered to all). A malformed message raises the same error on every rank."""
    tr, rank = ex.transport, ex.rank
    msg = control.encode_order(rank, t, digest, flags)

    def run() -> int:
        got = tr.gather(msg, root=ROOT, bound=len(msg))
        reply = None
        if rank == ROOT:
            try:
                both = FINAL | CLEAR
                for r, buf in enumerate(got):
                    both &= control.decode_order(buf, sender=r, step=t, digest=digest,
                                                 who=f"schedule round of step {t} from rank {r}")
                reply = control.encode_order(ROOT, t, digest, both)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then raise
                reply = wm.encode_error(ROOT, t, f"rank {ROOT} could not read the schedule "
                                        f"round of step {t}: {exc}", limit=REPLY_BOUND)
        buf = tr.broadcast(reply, root=ROOT, bound=REPLY_BOUND)
        return control.decode_order(buf, sender=ROOT, step=t, digest=digest,
                                    who=f"schedule round of step {t} from rank {ROOT}")

    return ex.collective(run, f"the schedule round of step {t}")


def late_verdict(layout: "Layout", config: "SlimConfig", host_sums: bool = False) -> bool:
    """Whether a server can refuse a step whose pushes were all finite: its sum overflowing a
    16-bit wire (fp16, or bf16 at the edge of float32) is found only once the stage is
    aggregated, after the schedule round, so ``overlap_forward`` must not hand such a step
    over before every stage is back. FP8 and packed values are scaled to fit, and
    ``nonfinite="propagate"`` refuses nothing. ``host_sums``: each stage is hosts first
    (exchange/hosts/hierarchy.py), whose host reduction adds the local ranks' gradients in the
    bucket's own dtype, so a 16-bit bucket's finite gradients can sum to an Inf that only
    that stage's cross exchange finds."""
    if config.nonfinite == "propagate":
        return False
    sixteen = (torch.float16, torch.bfloat16)

    def narrowed(dt: torch.dtype, b: Any) -> bool:
        return dt in sixteen and dt != b.dtype

    return any((host_sums and b.dtype in sixteen) or narrowed(b.comm_dtype, b)
               or (not b.slice_bits and narrowed(b.slice_dtype, b))
               or (not b.as_pulled().slice_bits and narrowed(b.as_pulled().slice_dtype, b))
               for b in layout.buckets)


class OrderedJob(Job):
    """One step of ``overlap_forward``: the stages' exchanges (``exchanges``, in backward
    order), run as the module docstring says. ``verdict`` is set once the order is known (or
    the job ended): then ``clear`` says whether every stage will commit. ``prepared`` holds the
    stages whose local phases ran but whose exchange did not (the step ended first)."""

    def __init__(self, exchanges: List["Stage"], first: Optional[Callable[[], Any]],
                 t: int, digest: int) -> None:
        super().__init__([ex.communicate for ex in exchanges], first)
        self.exchanges, self.t, self.digest = exchanges, t, digest
        self.verdict = threading.Event()
        self.clear = False

    def run(self, wait_ready: Callable[[Job, int], None]) -> None:
        try:
            super().run(wait_ready)
        finally:
            self.verdict.set()

    def _run(self, wait_ready: Callable[[Job, int], None]) -> None:
        if not self.run_first():
            return
        n, k = len(self.exchanges), 0
        while k < n:
            wait_ready(self, k)
            flags = 0
            if all(self.ready):   # every gradient of the step is in on this rank
                if not self._prepare(range(k, n)):
                    return
                clear = all(self.prepared[s].report is None for s in range(k, n))
                flags = FINAL | (CLEAR if clear else 0)
            try:
                agreed = order_round(self.exchanges[0], self.t, self.digest, flags)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self.error = (ROUND_FAILED, exc)   # no stage kept its gradient itself
                return
            if agreed & FINAL:
                break
            if not self._prepare([k]) or not self.run_stage(k, self._stage(k)):
                return
            k += 1
        else:
            return
        self.clear = bool(agreed & CLEAR)
        self.verdict.set()
        order = range(n - 1, k - 1, -1) if self.clear else range(k, n)
        for s in order:
            if not self.run_stage(s, self._stage(s)):
                return

    def _prepare(self, stages: Any) -> bool:
        """The local phases of ``stages`` not prepared yet; False (the error kept) on failure
        (that stage's gradient is then in its residual: prepare absorbs it)."""
        for s in stages:
            if s in self.prepared:
                continue
            try:
                self.prepared[s] = self.exchanges[s].prepare()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                self.error = (s, exc)
                return False
        return True

    def _stage(self, s: int) -> Callable[[], Any]:
        prep = self.prepared.pop(s)
        return lambda: self.stages[s](prep)


class Deferred:
    """A step :meth:`StagedExchange.step` handed over before all its stages were back (the
    schedule round was clear). :meth:`settle` commits one stage once it is back; a failed
    stage raises there, after keeping in the residuals what the unsettled stages computed."""

    def __init__(self, staged: Any, job: OrderedJob) -> None:
        self.staged, self.job = staged, job
        self.pending: Set[int] = set(range(len(job.stages)))

    def settle(self, k: int) -> None:
        """Wait for stage ``k`` and commit it (its pulled values into its ``p.grad``)."""
        if k not in self.pending:
            return
        job = self.job
        job.finished[k].wait()
        if job.error is not None or k not in job.outcomes or ends_step(job.outcomes[k]):
            job.done.wait()
            self._fail()
        self.pending.discard(k)
        self.staged.stages[k].settle(job.outcomes[k], commit=True)

    def drop(self) -> None:
        """Once the job has ended: drop every stage not settled exactly (nothing of it stays;
        a checkpoint is about to be loaded over it)."""
        self.job.done.wait()
        self.staged.drop(sorted(self.pending), self.job)
        self.pending.clear()

    def _fail(self) -> None:
        """The transport failed after the verdict: stages settled stay; every other one keeps
        this rank's gradient in its residual, as a failed step does; then raise."""
        job = self.job
        failed, exc = job.error if job.error is not None else (-1, None)
        # A skip cannot follow a clear round; such a stage is dropped all the same.
        skipped = sorted(k for k in self.pending if k in job.outcomes
                         and ends_step(job.outcomes[k]))
        self.staged.drop(skipped, job)
        rest = sorted(self.pending - set(skipped))
        self.staged.keep(rest, job.outcomes, job.prepared, failed)
        self.pending.clear()
        raise exc if exc is not None else RuntimeError(
            "hvd_slim: a stage of the step ended without a result")
