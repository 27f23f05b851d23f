"""The convergence study's training loop, and one optimizer per method.

Methods (``--method``):

* ``dense``: ``hvd_slim.DistributedOptimizer`` at ``density=1.0``, an exact dense average
  (tested against MPI's Allreduce to 1e-6); bytes are counted by hvd_slim's transport.
* ``slim``: hvd_slim's Slim-DP exchange at ``--density`` with the given Slim-DP keywords.
* ``horovod``: ``horovod.torch``'s own DistributedOptimizer (dense ring allreduce); bytes are
  modelled as a ring allreduce, since Horovod does not count them.
* ``topk``: the top-k + error-feedback allgather baseline in topk.py.
* ``powersgd``: torch DDP with its PowerSGD hook (powersgd.py); train through the
  optimizer's ``.module``.
* ``slim-hook``: torch DDP with hvd_slim's own hook (ddp_hook.py) and the run's Slim-DP
  keywords; train through the optimizer's ``.module``.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from .tasks import CLASSIFICATION, Task, TestSet, progress
from .topk import TopKOptimizer

METHODS = ("dense", "slim", "horovod", "topk", "powersgd", "slim-hook")
HOROVOD_MISSING = (
    "--method horovod needs Horovod (horovod.torch), which is not installed in this Python "
    "({python}): {error}. Install it with `make install-horovod` (scripts/install_horovod.sh), "
    "or use --method dense for the same dense allreduce through hvd_slim.")


class HorovodMissing(RuntimeError):
    """``--method horovod`` was asked for but ``horovod.torch`` cannot be imported."""


def runtime_for(method: str) -> ModuleType:
    """The ``hvd`` module for ``method``: ``horovod.torch`` for "horovod", else ``hvd_slim``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "horovod":
        return importlib.import_module("hvd_slim")
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as exc:  # also a broken build: horovod present, its torch extension not
        raise HorovodMissing(HOROVOD_MISSING.format(python=sys.executable, error=exc)) from None


def wrap_optimizer(method: str, hvd: ModuleType, opt: torch.optim.Optimizer, model: nn.Module,
                   density: Optional[float], slim_kwargs: Optional[Dict[str, Any]] = None,
                   powersgd_rank: int = 1) -> Any:
    """Wrap ``opt`` for ``method`` (see the module docstring). ``density`` None: hvd_slim's
    default (or ``HVD_SLIM_DENSITY``) for slim, 0.02 for topk."""
    named = list(model.named_parameters())
    # The study records a run that meets a NaN/Inf as diverged (sweep.py): it needs "raise",
    # where the default ("flag") would skip every such step and train on.
    finite = {} if "HVD_SLIM_NONFINITE" in os.environ else {"nonfinite": "raise"}
    if method == "dense":
        return hvd.DistributedOptimizer(opt, named_parameters=named, density=1.0, **finite)
    if method == "slim":
        kwargs = dict(finite, **(slim_kwargs or {}))
        order = kwargs.pop("name_order", None)
        if order in ("reverse", "model"):
            named = ordered_names(named, reverse=order == "reverse")
        if density is not None:
            kwargs["density"] = density
        outer = kwargs.pop("outer_sgd", None)
        if outer is not None:   # a run spec is JSON: the outer optimizer as SGD's keywords
            kwargs["outer_optimizer"] = torch.optim.SGD(
                [p for p in model.parameters() if p.requires_grad], **outer)
        return hvd.DistributedOptimizer(opt, named_parameters=named, **kwargs)
    if method == "horovod":
        return hvd.DistributedOptimizer(opt, named_parameters=named)
    if method == "powersgd":
        from .powersgd import PowerSGDOptimizer  # needs torch.distributed
        return PowerSGDOptimizer(opt, model, powersgd_rank, hvd.size())
    if method == "slim-hook":
        from .ddp_hook import SlimHookOptimizer  # needs torch.distributed
        return SlimHookOptimizer(opt, model, density, dict(finite, **(slim_kwargs or {})))
    return TopKOptimizer(opt, named, 0.02 if density is None else density, hvd)


def ordered_names(named: List[Any], reverse: bool = False) -> List[Any]:
    """``named`` renamed so that hvd_slim's name order (it sorts by name) is the model's order
    (as DDP's first bucket holds the parameters, and with them the hook's exchange in one
    bucket), or that reversed (about the order gradients become ready, as DDP's rebuilt
    buckets hold them): the study's probe of whether the flat buffer's order is what the DDP
    hook loses."""
    n = len(named)
    return [(f"{n - 1 - i if reverse else i:05d}.{name}", p) for i, (name, p) in enumerate(named)]


def make_inner(name: str, model: nn.Module, lr: float, momentum: float, nesterov: bool = False,
               weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer being wrapped: "sgd" (with ``momentum``, ``nesterov``), "adam" or "adamw";
    ``weight_decay`` is each optimizer's own (L2 for SGD and Adam, decoupled for AdamW)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=nesterov,
                               weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer must be 'sgd', 'adam' or 'adamw', got {name!r}")


class DenseWarmup:
    """Run the first ``steps`` steps as a plain dense allreduce, then hand over to the optimizer
    ``make_main()`` builds (e.g. Slim-DP): an emulation of a dense warm-up from outside hvd_slim.

    The main wrapper is built only at the hand-over, because an hvd_slim (or Horovod) wrapper
    counts every backward pass from its construction on. Both phases share one inner optimizer,
    so its state (momentum buffers) carries over. ``comm_stats`` adds the two phases up.
    """

    def __init__(self, inner: torch.optim.Optimizer, model: nn.Module, hvd: ModuleType,
                 steps: int, make_main: Callable[[], Any]) -> None:
        # A TopKOptimizer whose every tensor is "small" is exactly a fused dense allreduce.
        self._warm = TopKOptimizer(inner, list(model.named_parameters()), 1.0, hvd,
                                   min_compress_numel=2 ** 62)
        self._make_main, self._left, self._main = make_main, steps, None

    @property
    def current(self) -> Any:
        return self._main if self._main is not None else self._warm

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.current.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.current.zero_grad(set_to_none)

    def step(self) -> None:
        self.current.step()
        self._left -= 1
        if self._left == 0:  # hand over before the next backward pass
            self._main = self._make_main()

    def flush(self) -> None:
        if hasattr(self.current, "flush"):
            self.current.flush()

    def comm_stats(self) -> Dict[str, float]:
        warm = self._warm.comm_stats()
        main = self._main.comm_stats() if self._main is not None else {}
        return {k: float(warm[k]) + float(main.get(k, 0))
                for k in ("steps", "bytes_pushed", "bytes_pulled", "dense_bytes")}


def comm_totals(method: str, opt: Any, steps: int, model: nn.Module, size: int) -> Dict[str, float]:
    """Cumulative ``bytes_pushed``, ``bytes_pulled``, ``dense_bytes`` of this rank so far."""
    if method == "horovod":  # modelled: a ring allreduce of every gradient, each way
        grad = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        ring = 2 * (size - 1) / size * grad if size > 1 else 0.0
        return {"bytes_pushed": steps * ring, "bytes_pulled": steps * ring,
                "dense_bytes": float(steps * grad)}
    s = opt.comm_stats()
    return {k: float(s[k]) for k in ("bytes_pushed", "bytes_pulled", "dense_bytes")}


COMPRESSED_KEYS = ("push_sparse_value_bytes", "push_index_bytes", "pull_sparse_value_bytes",
                   "pull_index_bytes", "compressed_dense_bytes", "push_dense_value_bytes",
                   "pull_dense_value_bytes", "push_header_bytes", "pull_header_bytes")


def compressed_totals(opt: Any) -> Optional[Dict[str, float]]:
    """hvd_slim's cumulative breakdown (the compressed tensors' slices apart from the dense
    small tensors and headers), or None for an optimizer that does not count it."""
    stats = opt.comm_stats() if hasattr(opt, "comm_stats") else {}
    if "compressed_dense_bytes" not in stats:
        return None
    return {k: float(stats[k]) for k in COMPRESSED_KEYS}


@dataclass
class Schedule:
    """The learning rate: ``lr`` times a shape over the whole run (the same for every method).

    ``constant``; ``cosine``: half a cosine from 1 down to ``floor``; ``step``: x0.1 after 50%
    and again after 75% of the steps. ``warmup_steps`` ramps linearly from ``lr/10`` first.

    ``via="loss"`` keeps the optimizer's LR at ``lr`` and scales the loss by the schedule's
    factor instead (momentum then integrates LR-scaled gradients). For plain SGD the two are the
    same schedule; for error feedback they differ: a residual held back at a high LR and sent at a
    low one keeps its size when the schedule is in the loss, but shrinks when it is in the LR.
    """
    lr: float
    shape: str = "constant"
    floor: float = 0.01
    warmup_steps: int = 0
    via: str = "optimizer"

    def at(self, step: int, total: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (0.1 + 0.9 * step / self.warmup_steps)
        t = step / max(total, 1)
        if self.shape == "cosine":
            return self.lr * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t)))
        if self.shape == "step":
            return self.lr * (0.01 if t >= 0.75 else 0.1 if t >= 0.5 else 1.0)
        return self.lr


def fit(hvd: ModuleType, method: str, model: nn.Module, opt: Any, train_set: Dataset,
        test: TestSet, *, epochs: int, batch_size: int, schedule: Schedule, seed: int,
        name: str = "", on_epoch: Optional[Callable[[Dict[str, Any]], None]] = None,
        show_progress: bool = True, evals_per_epoch: int = 1,
        task: Task = CLASSIFICATION) -> List[Dict[str, Any]]:
    """Train ``model`` with ``opt`` and return one record per epoch (the last also after flush).

    ``task`` gives the loss and the score (common.CLASSIFICATION: cross-entropy and test
    accuracy; common.LANGUAGE: next-byte loss and validation bits per byte under ``val_bpb``).
    Below, ``test_accuracy`` and ``flushed_accuracy`` stand for the task's two score keys.

    Each record: ``epoch``, ``lr``, ``train_loss`` (mean over the epoch and the ranks),
    ``test_accuracy`` (of the model as it stands), ``epoch_seconds`` and ``wall_seconds``
    (training only, evaluation excluded; ``wall_seconds`` counts from the start of the run),
    ``eval_seconds`` (every evaluation so far, reported apart), ``steps``, and rank 0's
    cumulative ``bytes_pushed``, ``bytes_pulled``, ``dense_bytes`` plus the same for the epoch
    alone (``epoch_bytes_*``).
    The final record adds ``flushed_accuracy``: the accuracy after ``opt.flush()`` (residuals
    applied), which is the method's final, exact model. ``evals_per_epoch > 1`` also scores the
    model at evenly spaced points inside each epoch: those land in the record's ``curve``
    as ``{epoch (fractional), steps, wall_seconds, test_accuracy, bytes_pushed, bytes_pulled,
    eval_seconds}`` (times as in the record: training up to the point, evaluations apart).
    """
    # Same seed => same shuffles for every method; equal shard sizes => equal step counts per
    # rank, which the collective exchange inside opt.step() requires.
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    per_epoch = len(loader)
    total, step, wall, evals = epochs * per_epoch, 0, 0.0, 0.0
    checkpoints = {round(per_epoch * i / evals_per_epoch) for i in range(1, evals_per_epoch)}
    records: List[Dict[str, Any]] = []
    previous = {"bytes_pushed": 0.0, "bytes_pulled": 0.0, "dense_bytes": 0.0}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        bar = progress(loader, f"{name} epoch {epoch + 1}/{epochs}",
                       show_progress and hvd.rank() == 0)
        loss_sum, batches, start, curve, paused = 0.0, 0, time.perf_counter(), [], 0.0
        for xb, yb in bar:
            lr = schedule.at(step, total)
            scale = 1.0
            if schedule.via == "loss":
                lr, scale = schedule.lr, lr / schedule.lr
            for group in opt.param_groups:
                group["lr"] = lr
            loss = task.loss(model, xb, yb)
            (loss * scale if scale != 1.0 else loss).backward()
            opt.step()
            opt.zero_grad()
            loss_sum, batches, step = loss_sum + loss.item(), batches + 1, step + 1
            if batches % 20 == 0 and hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            if batches in checkpoints:  # an intermediate point, not counted as training time
                t0 = time.perf_counter()
                point = {"epoch": epoch + batches / per_epoch, "steps": step,
                         "wall_seconds": wall + t0 - start - paused,
                         task.metric: task.score(hvd, model, *test),
                         **comm_totals(method, opt, step, model, hvd.size())}
                paused += time.perf_counter() - t0
                curve.append(dict(point, eval_seconds=evals + paused))
        seconds = time.perf_counter() - start - paused
        wall, evals = wall + seconds, evals + paused
        totals = comm_totals(method, opt, step, model, hvd.size())
        t0 = time.perf_counter()
        record: Dict[str, Any] = {
            "epoch": epoch + 1, "lr": lr, "steps": step, "breakdown": compressed_totals(opt),
            "train_loss": float(hvd.allreduce(torch.tensor([loss_sum / max(batches, 1)]))),
            task.metric: task.score(hvd, model, *test),
            "epoch_seconds": seconds, "wall_seconds": wall, **totals,
            **{f"epoch_{k}": v - previous[k] for k, v in totals.items()}}
        evals += time.perf_counter() - t0
        record["eval_seconds"] = evals
        if curve:
            record["curve"] = curve
        previous = totals
        if epoch == epochs - 1:
            if hasattr(opt, "flush"):  # apply every pending residual: the exact final model
                opt.flush()
            record[task.flushed] = task.score(hvd, model, *test)
        records.append(record)
        if on_epoch is not None:
            on_epoch(record)
    return records
