"""Lightning with Slim-DP: ``hvd_slim.ddp.lightning.SlimHookCallback`` registers the hook::

    torchrun --nproc-per-node 2 -m examples.lightning_ddp
    torchrun --nproc-per-node 2 -m examples.lightning_ddp --optimizer adamw
    torchrun --nproc-per-node 2 -m examples.lightning_ddp --optimizer adamw --local-steps 4

Lightning (2.6) registers a ``DDPStrategy(ddp_comm_hook=...)`` on CUDA devices only, silently
dropping it on the CPU, and makes the optimizer (``configure_optimizers``) after the strategy. The
callback registers the state on the DDP model at ``on_fit_start`` (with the parameters' names,
so each bucket is laid out by name, as ``DistributedOptimizer`` does) and, under AdamW, gives it
the optimizer, so that each rank's Adam update travels, not its gradient.

With ``--local-steps H`` there is no hook state: ``configure_optimizers`` returns
``hvd_slim.ddp.local_optimizer(strategy's DDP model, optimizer, local_steps=H)``, which
registers the hook that keeps gradients local (Lightning wraps the model in DDP before it makes
the optimizers), and each round's end goes through Slim-DP.

The model is a small classifier on a fixed synthetic task (a random teacher network labels
Gaussian inputs), so the script runs anywhere in seconds. Rank 0 prints the final training loss,
the bytes pushed against a dense allreduce, and whether the replicas ended identical.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, List

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from examples.ddp_train import gathered_replicas, leave_together
from hvd_slim.ddp import SlimState, local_optimizer
from hvd_slim.ddp.lightning import SlimHookCallback


def teacher_data(n: int = 4096, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w1, w2 = torch.randn(32, 64, generator=g), torch.randn(64, 8, generator=g)
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2).argmax(1))


class Classifier(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd", local_steps: int = 1) -> None:
        super().__init__()
        self.optimizer_name, self.local_steps = optimizer, local_steps
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 8))
        self.last_loss = float("nan")

    def training_step(self, batch, _index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.local_steps > 1:   # the strategy's model is DDP's by now
            return local_optimizer(self.trainer.strategy.model, opt, density=0.01,
                                   local_steps=self.local_steps)
        return opt


def framework_args(doc: str) -> argparse.Namespace:
    """The framework examples' command line (this one's and examples/accelerate_ddp.py's)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--local-steps", type=int, default=1,
                    help="above 1: rounds of local steps (local_optimizer), no hook state")
    ap.add_argument("--json", default=None, help="also write the figures here (rank 0)")
    return ap.parse_args()


def main() -> List[Any]:
    args = framework_args(__doc__)
    pl.seed_everything(0, verbose=False)
    model = Classifier(args.optimizer, args.local_steps)
    local = args.local_steps > 1
    # The added lines: the state, and the callback that registers it (and gives it AdamW).
    state = None if local else SlimState(density=0.01)
    strategy = DDPStrategy(process_group_backend="gloo")
    callbacks: List[pl.Callback] = [] if local else [SlimHookCallback(state)]
    # Under torchrun, Lightning takes the processes it started: as many devices as it has here.
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(teacher_data(), batch_size=32, shuffle=True))

    identical, gathered = gathered_replicas(model)
    st = (trainer.optimizers[0] if local else state).comm_stats()
    config = trainer.optimizers[0].slim_config if local else state.config
    figures = {"ranks": dist.get_world_size(), "loss": model.last_loss,
               "steps": st["local_steps_taken"] if local else st["steps"],
               "local_steps": args.local_steps,
               "optimizer": args.optimizer, "adam_exchange": config.adam_exchange,
               "replicas_identical": identical,
               "fewer_pushed": st["dense_bytes"] / max(1, st["bytes_pushed"])}
    if trainer.global_rank == 0:
        print(json.dumps(figures))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f)
    # Lightning leaves the process group up. Freed at exit, a Gloo worker can still be
    # releasing the last collective's tensors while the interpreter finalises, and the thread
    # aborts the process ("terminate called without an active exception"; docs/ddp.md,
    # "Teardown"): every rank leaves together and the group goes while Python still runs.
    done = leave_together()
    dist.destroy_process_group()
    return gathered + [done]   # outlive the group (leave_together)


if __name__ == "__main__":
    kept = main()   # freed only after the process group
