"""One training run of the convergence study from the command line, with any ``--method``.

    mpirun -np 4 --oversubscribe --bind-to none .venv/bin/python -m benchmarks.convergence.train \
        --method slim --density 0.01 --epochs 2 --json mnist.json

(as root also set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1). Methods are
training.py's: dense, slim, horovod (Horovod's own DistributedOptimizer: one MPI runtime per
process, so the study runs it here rather than in sweep.py), topk and powersgd. Each rank reads
its own shard (DistributedSampler with set_epoch); rank 0 shows a progress bar and the test
accuracy after every epoch, and ``--json`` writes loss, accuracy, wall time and bytes per epoch.
``--dataset mnist1d`` swaps in the seconds-fast MNIST-1D task: an MLP on 9600 generated
40-sample signals, 30 short epochs, cosine LR (an MLP cannot saturate MNIST-1D, so accuracy
keeps telling settings apart). The data are read offline (data.py); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from .tasks import load_dataset, make_model
from .training import (METHODS, HorovodMissing, Schedule, fit, make_inner,
                      runtime_for, wrap_optimizer)

# Per-dataset defaults: MNIST as in `make demo`; MNIST-1D trains a small MLP for many short
# epochs (about 75 steps each at 4 ranks), so its sweeps take seconds.
DEFAULTS = {"mnist": {"epochs": 2, "batch_size": 64, "lr": 0.05, "schedule": "constant"},
            "mnist1d": {"epochs": 30, "batch_size": 32, "lr": 0.05, "schedule": "cosine"}}


def build_parser(dataset: str = "mnist") -> argparse.ArgumentParser:
    """The command-line flags; ``dataset`` picks the defaults shown."""
    d = DEFAULTS[dataset]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=sorted(DEFAULTS), default=dataset)
    p.add_argument("--method", choices=METHODS, default="slim")
    p.add_argument("--density", type=float, default=None,
                   help="for slim (default: hvd_slim's, or HVD_SLIM_DENSITY) and topk (0.02)")
    p.add_argument("--epochs", type=int, default=None, help=f"default {d['epochs']}")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"per rank; default {d['batch_size']}")
    p.add_argument("--lr", type=float, default=None, help=f"default {d['lr']}")
    p.add_argument("--lr-schedule", choices=("constant", "cosine", "step"), default=None,
                   help=f"default {d['schedule']}")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="the wrapped optimizer (adam: torch.optim.Adam; pass --lr too, e.g. 1e-3)")
    p.add_argument("--momentum", type=float, default=0.9, help="for sgd")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-subset", type=int, default=None, metavar="N",
                   help="train on the first N training examples only")
    p.add_argument("--evals-per-epoch", type=int, default=1, metavar="N",
                   help="also score the model N-1 times inside each epoch (the records' curve)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the per-epoch log to OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    s = p.add_argument_group("Slim-DP keywords (--method slim); unset ones come from "
                             "HVD_SLIM_<NAME> or hvd_slim's defaults")
    s.add_argument("--pull", choices=("slim", "union"), default=None)
    s.add_argument("--pull-density", type=float, default=None)
    s.add_argument("--exploration", type=float, default=None)
    s.add_argument("--momentum-correction", choices=("on", "off"), default=None)
    s.add_argument("--momentum-masking", default=None, metavar="on|off|SHARE",
                   help="share of the velocity dropped where sent (on = 1, off = 0)")
    s.add_argument("--magnitude-weight", type=float, default=None)
    s.add_argument("--warmup-dense-steps", type=int, default=None,
                   help="first optimizer steps exchanged dense (exactly dense momentum SGD)")
    s.add_argument("--warmup-decay-steps", type=int, default=None,
                   help="then the densities fall geometrically to --density over this many steps")
    s.add_argument("--warmup-start-density", type=float, default=None,
                   help="the density that fall starts from (1 = dense)")
    s.add_argument("--value-bits", type=int, choices=(2, 4, 8, 16, 32), default=None,
                   help="precision of sliced values (what rounding loses stays in the residual)")
    s.add_argument("--adam-variance", choices=("auto", "rescaled", "live"), default=None,
                   help="with --optimizer adam: how Adam's second moment sees sparse deliveries")
    return p


def slim_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """Only the Slim-DP keywords given on the command line (so HVD_SLIM_* still apply)."""
    out: Dict[str, Any] = {}
    for key in ("pull", "pull_density", "exploration", "magnitude_weight",
                "warmup_dense_steps", "warmup_decay_steps", "warmup_start_density",
                "value_bits", "adam_variance"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.momentum_correction is not None:
        out["momentum_correction"] = args.momentum_correction == "on"
    if args.momentum_masking is not None:
        m = args.momentum_masking
        out["momentum_masking"] = {"on": True, "off": False}.get(m) if m in ("on", "off") \
            else float(m)
    return out


_SLIM_FLAGS = {"pull": "--pull", "pull_density": "--pull-density", "exploration": "--exploration",
               "magnitude_weight": "--magnitude-weight",
               "warmup_dense_steps": "--warmup-dense-steps",
               "warmup_decay_steps": "--warmup-decay-steps", "adam_variance": "--adam-variance",
               "momentum_masking": "--momentum-masking", "value_bits": "--value-bits",
               "warmup_start_density": "--warmup-start-density"}


def spec_argv(spec: Dict[str, Any], json_path: str) -> List[str]:
    """This script's flags for one sweep.py run spec (the convergence study runs
    ``--method horovod`` specs this way). Raises ValueError for what the flags cannot say."""
    unsupported = {k: spec[k] for k in ("dense_warmup_steps", "lr_via")
                   if spec.get(k) not in (None, 0, "optimizer")}
    if unsupported:
        raise ValueError(f"train.py cannot run {unsupported}; use sweep.py")
    # No density (None or absent): the script's default, hvd_slim's own, as in sweep.py.
    density = [] if spec.get("density") is None else ["--density", repr(float(spec["density"]))]
    argv = ["--dataset", spec["dataset"], "--method", spec["method"], *density,
            "--epochs", str(spec["epochs"]),
            "--batch-size", str(spec["batch_size"]), "--lr", repr(float(spec["lr"])),
            "--lr-schedule", spec["schedule"], "--optimizer", spec.get("optimizer", "sgd"),
            "--momentum", repr(float(spec.get("momentum", 0.9))),
            "--seed", str(spec["seed"]), "--evals-per-epoch", str(spec.get("evals_per_epoch", 1)),
            "--no-progress", "--json", json_path]
    if spec.get("train_subset"):
        argv += ["--train-subset", str(spec["train_subset"])]
    for key, value in spec.get("slim", {}).items():
        if key == "momentum_correction" or (key == "momentum_masking"
                                            and isinstance(value, bool)):
            argv += ["--" + key.replace("_", "-"), "on" if value else "off"]
        elif key in _SLIM_FLAGS:
            argv += [_SLIM_FLAGS[key], repr(value) if isinstance(value, float) else str(value)]
        else:
            raise ValueError(f"train.py has no flag for the Slim-DP keyword {key!r}")
    return argv


def spec_result(spec: Dict[str, Any], log: Dict[str, Any]) -> Dict[str, Any]:
    """A results.jsonl line (as sweep.py writes it) from this script's ``--json`` log."""
    return dict(spec, world_size=log["world_size"], seconds=log["seconds"], records=log["epochs"])


def main(argv: Optional[List[str]] = None, dataset: str = "mnist") -> int:
    """Train one model with ``--method`` and report it; returns the exit status."""
    args = build_parser(dataset).parse_args(argv)
    for key, value in DEFAULTS[args.dataset].items():  # fill what was not given
        attr = "lr_schedule" if key == "schedule" else key
        if getattr(args, attr) is None:
            setattr(args, attr, value)
    try:
        hvd = runtime_for(args.method)
    except HorovodMissing as exc:
        # No runtime is up yet, so every rank says it; exit 2 like a usage error.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hvd.init()
    torch.set_num_threads(1)  # ranks share the machine's cores; more threads only contend
    train_set, test = load_dataset(args.dataset, args.train_subset)

    torch.manual_seed(args.seed)  # rank 0's initial weights are broadcast to every rank
    model = make_model(args.dataset)
    opt = make_inner(args.optimizer, model, args.lr, args.momentum)
    opt = wrap_optimizer(args.method, hvd, opt, model, args.density, slim_kwargs(args))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hasattr(opt, "synchronize"):  # the Horovod-protocol wrappers; topk has no state to sync
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    rank0 = hvd.rank() == 0

    def report(r: Dict[str, Any]) -> None:
        if rank0:
            flushed = r.get("flushed_accuracy")
            print(f"epoch {r['epoch']}: train loss {r['train_loss']:.4f}, test accuracy "
                  f"{r['test_accuracy']:.2f}%, {r['epoch_seconds']:.1f}s, pushed "
                  f"{r['epoch_bytes_pushed'] / 1e6:.2f} MB "
                  f"(dense {r['epoch_dense_bytes'] / 1e6:.2f} MB)"
                  + (f"; after flush {flushed:.2f}%" if flushed is not None else ""), flush=True)

    label = args.method if args.method != "slim" else \
        f"slim d={opt.slim_config.density:g}"
    start = time.perf_counter()
    # powersgd and slim-hook train through their DDP module, whose backward runs the hook
    records = fit(hvd, args.method, getattr(opt, "module", model), opt, train_set, test,
                  epochs=args.epochs,
                  batch_size=args.batch_size, schedule=Schedule(args.lr, args.lr_schedule),
                  seed=args.seed, name=label, on_epoch=report, show_progress=not args.no_progress,
                  evals_per_epoch=args.evals_per_epoch)
    seconds = time.perf_counter() - start
    if rank0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"dataset": args.dataset, "world_size": hvd.size(),
                       "train_examples": len(train_set), "args": vars(args), "seconds": seconds,
                       "slim_config": slim_kwargs(args), "epochs": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
