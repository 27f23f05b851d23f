"""Elastic training with one rank failing mid-run (tests/unit/test_elastic_launch.py).

``mpirun [--enable-recovery] -np 3 python tests/scripts/elastic_train.py MODE DIR [RANK STEP]``:

* ``none``: train uninterrupted;
* ``raise``: rank RANK raises ``HorovodInternalError`` at step STEP (once) and stays alive;
  the others time out in the exchange; all restore the last commit and retry on 3 ranks;
* ``kill``: rank RANK SIGKILLs itself at step STEP; the survivors time out, drop it, restore
  the last commit and finish on 2 ranks (needs ``mpirun --enable-recovery``);
* ``reference DIR STEP``: a fresh job loads the commit the survivors restored to
  (DIR/commit-STEP.pt, written by rank 0 at each commit) and finishes from there.

Every rank prints ``elastic: rank R of N step S hash H`` at the end and ``elastic: restored to
step S on N ranks`` after each recovery.
"""
import hashlib
import os
import signal
import sys
from pathlib import Path

import torch

import hvd_slim as hvd
from hvd_slim.elastic import HorovodInternalError

EPOCHS, BATCH, COMMIT_EVERY, N_DATA = 2, 4, 3, 72
failed = False   # the injected failure happens once, not again when the step is retried


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.05,
                                   min_compress_numel=1000)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(N_DATA, 32, generator=g), torch.randint(0, 4, (N_DATA,), generator=g)
    return model, opt, data


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main(mode: str, directory: Path, fail_rank: int, fail_step: int) -> None:
    hvd.init()
    world_rank = hvd.rank()
    model, opt, (xs, ys) = build()
    sampler = hvd.elastic.ElasticSampler(range(N_DATA), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
    if mode == "reference":
        saved = torch.load(directory / f"commit-{fail_step}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])   # the inner optimizer only: no "hvd_slim"
        sampler.load_state_dict(saved["sampler"])
        state.epoch, state.step = saved["epoch"], saved["step"]
        state.commit()
    state.register_reset_callbacks([lambda: print(
        f"elastic: restored to step {state.step} on {hvd.size()} ranks", flush=True)])

    def commit() -> None:
        state.commit()
        if hvd.rank() == 0 and mode != "reference":
            inner = {k: v for k, v in opt.state_dict().items() if k != "hvd_slim"}
            torch.save({"model": model.state_dict(), "optimizer": inner, "epoch": state.epoch,
                        "sampler": sampler.state_dict(), "step": state.step},
                       directory / f"commit-{state.step}.pt")

    @hvd.elastic.run
    def train(state) -> None:
        global failed
        while state.epoch < EPOCHS:
            indices = list(state.sampler)
            for b in range(0, len(indices) - BATCH + 1, BATCH):
                # COMM_WORLD's rank: hvd.rank() renumbers the survivors.
                if state.step == fail_step and world_rank == fail_rank and not failed:
                    failed = True
                    print(f"elastic: rank {fail_rank} fails with {mode} at step {fail_step}",
                          flush=True)
                    if mode == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if mode == "raise":
                        raise HorovodInternalError(f"injected on rank {fail_rank}")
                batch = indices[b:b + BATCH]
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xs[batch]), ys[batch]).backward()
                opt.step()
                state.sampler.record_batch(b // BATCH, BATCH)
                state.step += 1
                if state.step % COMMIT_EVERY == 0:
                    commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            commit()

    train(state)
    print(f"elastic: rank {hvd.rank()} of {hvd.size()} step {state.step} hash {digest(model)}",
          flush=True)


if __name__ == "__main__":
    args = sys.argv[1:] + ["-1", "-1"]
    main(args[0], Path(args[1]), int(args[2]), int(args[3]))
