"""Checkpoint, then restart the job from it (issue 6, "Nothing lost").

``mpirun -np 3 python tests/scripts/checkpoint_restart.py full DIR T``: train 2T steps, saving
every rank's model and ``optimizer.state_dict()`` (its residuals; the server's state on the
server rank) to DIR after step T, and print the final parameter hash.
``... resume DIR T``: a new job loads those files (``weights_only=True``) and trains steps T to
2T. Both print ``restart: rank R step S hash H``; the hashes must be equal bit for bit.
"""
import hashlib
import sys
from pathlib import Path

import torch

import hvd_slim as hvd


def main(mode: str, directory: Path, T: int) -> None:
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.ReLU(), torch.nn.Linear(96, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=0.02,
                                   min_compress_numel=1000)
    path = directory / f"ckpt-rank{rank}.pt"
    first = 0
    if mode == "resume":
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        first = T
    for step in range(first, 2 * T):
        g = torch.Generator().manual_seed(7919 * rank + step)
        x, y = torch.randn(16, 48, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if mode == "full" and step + 1 == T:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    sys.stdout.write(f"restart: rank {rank} step {2 * T} hash {h.hexdigest()[:16]}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
