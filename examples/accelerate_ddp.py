"""Accelerate with Slim-DP: ``accelerator.prepare`` returns a DDP model, which takes the hook::

    torchrun --nproc-per-node 2 -m examples.accelerate_ddp
    torchrun --nproc-per-node 2 -m examples.accelerate_ddp --optimizer adamw
    torchrun --nproc-per-node 2 -m examples.accelerate_ddp --optimizer adamw --local-steps 4

(``accelerate launch`` starts the processes the same way.) Accelerate's own ``comm_hook``
option takes only its built-in hooks, so the hook is registered on the prepared model. The task
is examples/lightning_ddp.py's synthetic classifier; rank 0 prints the final training loss, the
bytes pushed against a dense allreduce, and whether the replicas ended identical. Under AdamW
the state takes the torch optimizer that ``prepare`` wrapped (``opt.optimizer``), so that each
rank's Adam update travels, not its gradient.

With ``--local-steps H`` the model is prepared first and the optimizer is wrapped by
``hvd_slim.ddp.local_optimizer`` (which registers the hook that keeps gradients local) before
``prepare`` takes it: rounds of local steps, each round's end through Slim-DP.
"""
from __future__ import annotations

import json
from typing import Any, List

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from examples.ddp_train import gathered_replicas, leave_together
from examples.lightning_ddp import framework_args, teacher_data
from hvd_slim.ddp import SlimState, local_optimizer


def main() -> List[Any]:
    args = framework_args(__doc__)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    adamw = args.optimizer == "adamw"
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01) if adamw else \
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(teacher_data(), batch_size=32, shuffle=True)
    local = args.local_steps > 1
    if local:   # the DDP model first: local_optimizer wraps the optimizer and hooks the model
        model = accelerator.prepare(net)
        opt = local_optimizer(model, opt, density=0.01, local_steps=args.local_steps)
        opt, loader = accelerator.prepare(opt, loader)
        state = opt.optimizer   # the wrapped optimizer keeps the figures
    else:
        model, opt, loader = accelerator.prepare(net, opt, loader)
        # The added line (and its import); under AdamW with the torch optimizer prepare()
        # wrapped.
        state = SlimState(density=0.01, optimizer=opt.optimizer if adamw else None).register(model)
        if accelerator.scaler is not None:   # mixed_precision="fp16": its scale out of what is kept
            state.set_grad_scaler(accelerator.scaler)

    step, loss = 0, torch.tensor(float("nan"))
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            step += 1
            if step == args.steps:
                break

    identical, gathered = gathered_replicas(net)
    st = state.comm_stats()
    config = state.slim_config if local else state.config
    figures = {"ranks": accelerator.num_processes,
               "steps": st["local_steps_taken"] if local else st["steps"],
               "local_steps": args.local_steps,
               "loss": float(loss.detach()), "optimizer": args.optimizer,
               "adam_exchange": config.adam_exchange,
               "replicas_identical": identical,
               "fewer_pushed": st["dense_bytes"] / max(1, st["bytes_pushed"])}
    if accelerator.is_main_process:
        print(json.dumps(figures))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f)
    done = leave_together()   # every rank leaves together
    accelerator.end_training()
    return gathered + [done]   # outlive DDP and its group (leave_together)


if __name__ == "__main__":
    kept = main()   # freed only after main()'s DDP model and its group
