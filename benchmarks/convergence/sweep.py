"""Run a list of trainings back to back inside one MPI job (the worker of the convergence study).

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python -m benchmarks.convergence.sweep \
        PLAN RESULTS

``PLAN`` is a JSON list of run specs (below); ``RESULTS`` is a JSON-lines file to which rank 0
appends one line per finished run: the spec, the per-epoch records of ``training.fit`` and the
run's seconds. Runs whose ``key`` is already in ``RESULTS`` are skipped, so an interrupted sweep
resumes where it stopped. One job amortises what dominates short runs on a small machine:
starting the interpreters, importing torch and loading the data (once per dataset).

A spec: ``key`` (unique), ``dataset`` ("mnist"/"mnist1d"), ``method`` (dense, slim or topk;
see training.py),
``density`` (None or absent: hvd_slim's default), ``slim`` (Slim-DP keywords), ``seed``, ``epochs``, ``batch_size``, ``lr``,
``schedule`` ("constant"/"cosine"/"step"), and optionally ``optimizer`` ("sgd"/"adam"),
``momentum`` (0.9), ``train_subset``, ``dense_warmup_steps`` (see ``training.DenseWarmup``),
``evals_per_epoch`` (1), ``lr_via`` ("optimizer" or "loss": see ``training.Schedule``),
``net`` and ``network`` (where it ran: stored, not read). A result line adds ``world_size``,
``seconds``, ``records``, ``loadavg`` (1-minute load at start and end), ``hvd_slim_digest``
and, for "pystdlib", ``corpus`` (the digest and sizes of the text it trained on).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import torch

from .tasks import dataset_identity, load_dataset, make_model, task_of
from .training import DenseWarmup, Schedule, fit, make_inner, wrap_optimizer


def run_one(hvd: Any, spec: Dict[str, Any], data: Tuple[Any, Any]) -> Dict[str, Any]:
    """Train the run ``spec`` describes and return the spec with its records."""
    torch.manual_seed(spec["seed"])  # rank 0's initial weights are broadcast to every rank
    model = make_model(spec["dataset"], spec.get("model"))
    if spec.get("param_dtype"):   # e.g. "bfloat16": the parameters (and so the gradients) in it
        model = model.to(getattr(torch, spec["param_dtype"]))
    inner = make_inner(spec.get("optimizer", "sgd"), model, spec["lr"], spec.get("momentum", 0.9),
                       nesterov=bool(spec.get("nesterov", False)),
                       weight_decay=float(spec.get("weight_decay", 0.0)))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(inner, root_rank=0)

    def build() -> Any:
        return wrap_optimizer(spec["method"], hvd, inner, model, spec.get("density"),
                              spec.get("slim", {}), int(spec.get("powersgd_rank", 1)))

    warm = int(spec.get("dense_warmup_steps", 0))
    opt = DenseWarmup(inner, model, hvd, warm, build) if warm > 0 else build()
    start, load0 = time.perf_counter(), os.getloadavg()[0]  # the load: for reading the times
    try:
        # PowerSGD and slim-hook train through their DDP module, whose backward runs the hook.
        records = _fit(hvd, spec, getattr(opt, "module", model), opt, data)
    except FloatingPointError as exc:
        # hvd_slim raises the same NonFiniteGradientError on every rank with nothing changed,
        # so the job can go on to the next run; a diverged run is a result too.
        return dict(spec, world_size=hvd.size(), seconds=time.perf_counter() - start,
                    records=[], diverged=str(exc)[:500])
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return dict(spec, world_size=hvd.size(), seconds=time.perf_counter() - start,
                records=records, loadavg=[load0, os.getloadavg()[0]])


def _fit(hvd: Any, spec: Dict[str, Any], model: Any, opt: Any, data: Tuple[Any, Any]
         ) -> List[Dict[str, Any]]:
    """``training.fit`` with the spec's settings."""
    schedule = Schedule(spec["lr"], spec["schedule"], via=spec.get("lr_via", "optimizer"),
                        warmup_steps=int(spec.get("lr_warmup_steps", 0)))
    return fit(hvd, spec["method"], model, opt, data[0], data[1], epochs=spec["epochs"],
               batch_size=spec["batch_size"], schedule=schedule, seed=spec["seed"],
               name=spec["key"], show_progress=False,
               evals_per_epoch=int(spec.get("evals_per_epoch", 1)),
               task=task_of(spec["dataset"]))


def source_digest() -> str:
    """A short hash of hvd_slim's source files, stored with each result: results from a
    changed exchange are then told apart from older ones."""
    import hvd_slim
    root = os.path.dirname(hvd_slim.__file__)
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:12]


def main(plan_path: str, results_path: str) -> None:
    """Run every spec of the plan not yet in the results file (rank 0 appends the results)."""
    import hvd_slim as hvd  # every method except "horovod" runs on hvd_slim's runtime
    hvd.init()
    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only contend
    with open(plan_path, encoding="utf-8") as f:
        plan: List[Dict[str, Any]] = json.load(f)
    done = set()
    if hvd.rank() == 0 and os.path.exists(results_path):
        with open(results_path, encoding="utf-8") as f:
            done = {json.loads(line)["key"] for line in f if line.strip()}
    done = hvd.broadcast_object(done, root_rank=0)
    todo = [s for s in plan if s["key"] not in done]
    if any(s["method"] == "horovod" for s in plan):  # one process, one MPI runtime
        raise ValueError("sweep.py runs every method on hvd_slim's runtime; run --method horovod "
                         "with benchmarks.convergence.train instead")
    if hvd.rank() == 0:
        print(f"sweep: {len(todo)} of {len(plan)} runs to do ({len(plan) - len(todo)} already in "
              f"{results_path})", flush=True)
    digest = source_digest()
    datasets: Dict[Tuple[str, Any], Any] = {}
    for i, spec in enumerate(todo):
        ds_key = (spec["dataset"], spec.get("train_subset"))
        if ds_key not in datasets:
            datasets[ds_key] = (load_dataset(*ds_key), dataset_identity(spec["dataset"]))
        data, identity = datasets[ds_key]
        result = dict(run_one(hvd, spec, data), **identity, hvd_slim_digest=digest)
        if hvd.rank() == 0:
            if result.get("diverged"):
                outcome = f"DIVERGED: {result['diverged'][:120]}"
            else:
                last, task = result["records"][-1], task_of(spec["dataset"])
                unit = "%" if task.higher_is_better else ""
                outcome = (f"{task.metric} {last[task.metric]:.4g}{unit} (flushed "
                           f"{last[task.flushed]:.4g}{unit})")
            print(f"sweep [{i + 1}/{len(todo)}] {spec['key']}: {outcome}, "
                  f"{result['seconds']:.1f}s", flush=True)
            with open(results_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.convergence.sweep PLAN.json RESULTS.jsonl")
    main(sys.argv[1], sys.argv[2])
