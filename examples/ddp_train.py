"""A plain ``torchrun`` + ``DistributedDataParallel`` script with Slim-DP as its communication
hook: one added line (``SlimState(...).register(ddp)``, which is ``register_comm_hook``
with the DDP model's group checked, marked below; under AdamW its ``SlimState`` takes
the optimizer, so that each rank's Adam update travels, not its gradient).

It trains a small byte-level transformer (benchmarks/convergence/lm.py: the same model and the
standard library's sources as text, so nothing is downloaded) with AdamW and a cosine schedule,
then prints the validation bits per byte, the bytes each rank pushed against a dense allreduce,
and whether every replica ended bitwise identical::

    torchrun --nproc-per-node 4 -m examples.ddp_train --steps 600
    torchrun --nproc-per-node 4 -m examples.ddp_train --steps 600 --hook none   # plain DDP
    torchrun --nproc-per-node 4 -m examples.ddp_train --hook slim-gradient  # no optimizer=
    torchrun --nproc-per-node 4 -m examples.ddp_train --small --steps 2500   # 20 bytes/param
    torchrun --nproc-per-node 4 -m examples.ddp_train --hook local --local-steps 4  # rounds
    HVD_SLIM_DENSITY=0.01 torchrun --nproc-per-node 4 -m examples.ddp_train

The Slim-DP settings come from ``HVD_SLIM_*`` variables or ``SlimState``'s keywords.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, List, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from benchmarks.convergence.lm import ByteLM, Windows, load_corpus, lm_loss, validation_windows
from hvd_slim.ddp import SlimState, local_optimizer


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Validation bits per byte, each rank scoring a slice (summed over the group)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, len(x), size * 16):
            xs, ys = x[i:i + 16 * size:size], y[i:i + 16 * size:size]
            total[0] += float(lm_loss(model, xs, ys)) * ys.numel()
            total[1] += ys.numel()
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1]) / math.log(2)


def gathered_replicas(model: torch.nn.Module) -> Tuple[bool, List[torch.Tensor]]:
    """Whether every rank holds bitwise the same parameters, and the tensors gathered to tell.

    Keep those tensors referenced until DDP and its process group are gone (return them from
    ``main()``). Freeing the group joins Gloo's worker threads while holding the GIL, and a
    worker that releases a finished collective's tensors after Python dropped them needs the
    GIL: torch's teardown deadlock (docs/ddp.md, "Teardown"). ``all_gather_object``'s tensors
    are its own temporaries, so this gathers tensors instead."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], t) for t in every[1:]), every + [flat]


def leave_together() -> Any:
    """A barrier every rank leaves together; keep what it returns (its work) referenced until
    DDP and its process group are gone, with the gathered tensors. Otherwise Gloo's worker
    thread may free the last collectives itself, and their tensors with them, which needs the
    GIL that the freeing of the group holds while it joins that thread: torch's teardown
    deadlock (docs/ddp.md, "Teardown"). Held here, the last reference is Python's."""
    done = dist.barrier(async_op=True)
    done.wait()
    return done


def main() -> List[Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hook", choices=("slim", "slim-gradient", "local", "none", "powersgd"),
                    default="slim", help="local: rounds of --local-steps local steps "
                    "(hvd_slim.ddp.local_optimizer), the rest per step")
    ap.add_argument("--local-steps", type=int, default=4, help="with --hook local")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true",
                    help="the fair-horizon model: width 96, 4 blocks (0.5M parameters)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb (default: DDP's 25); the model's size or more puts "
                         "every parameter in one bucket, so one exchange a step")
    ap.add_argument("--json", default=None, help="also write the figures here (rank 0)")
    args = ap.parse_args()

    dist.init_process_group("gloo")   # torchrun's environment: RANK, WORLD_SIZE, MASTER_*
    torch.manual_seed(args.seed)
    corpus = load_corpus()
    model = ByteLM(width=96, layers=4) if args.small else ByteLM()
    ddp = DDP(model) if args.bucket_cap_mb is None else DDP(model,
                                                            bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.1)
    state = None
    if args.hook == "slim":
        # The one added line (and its import). optimizer=: each rank's AdamW update travels,
        # not its gradient, and opt.step() applies what was delivered.
        state = SlimState(optimizer=opt).register(ddp)
    elif args.hook == "local":   # rounds of local steps: the optimizer is wrapped instead
        opt = local_optimizer(ddp, opt, local_steps=args.local_steps)
    elif args.hook == "slim-gradient":   # the hook without the optimizer: gradients travel
        state = SlimState().register(ddp)
    elif args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                   start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)

    data = Windows(corpus.train, 128)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min((t + 1) / warm, 0.5 * (
        1 + math.cos(math.pi * min(1.0, t / args.steps)))))
    vx, vy = validation_windows(corpus.val, 128, 512)

    step, start = 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(step)
        for x, y in loader:
            opt.zero_grad()
            lm_loss(ddp, x, y).backward()
            opt.step()
            sched.step()
            step += 1
            if step == args.steps:
                break
    seconds = time.perf_counter() - start
    bpb = evaluate(ddp.module, vx, vy)

    identical, gathered = gathered_replicas(model)
    figures = {"hook": args.hook, "ranks": dist.get_world_size(), "steps": step,
               "bucket_cap_mb": args.bucket_cap_mb,
               "val_bpb": bpb, "replicas_identical": identical, "seconds": seconds,
               "local_steps": args.local_steps if args.hook == "local" else 1}
    if args.hook.startswith("slim") or args.hook == "local":
        st = (opt if args.hook == "local" else state).comm_stats()
        figures.update(bytes_pushed=st["bytes_pushed"], bytes_pulled=st["bytes_pulled"],
                       dense_bytes=st["dense_bytes"], buckets=st.get("buckets"),
                       fewer_pushed=st["dense_bytes"] / max(1, st["bytes_pushed"]))
    if dist.get_rank() == 0:
        print(json.dumps(figures))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
    done = leave_together()   # a rank still writing must not be left alone
    dist.destroy_process_group()
    return gathered + [done]   # outlive DDP and its group (leave_together)


if __name__ == "__main__":
    kept = main()   # freed only after main()'s DDP model and its group
