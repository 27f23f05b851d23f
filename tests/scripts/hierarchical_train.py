"""A few steps with ``hierarchical=True`` under mpirun, hosts named by HVD_SLIM_HOST_KEY
(tests/unit/test_hierarchy_launch.py).

``python tests/scripts/hierarchical_train.py DENSITY [OVERLAP [forward]]``: every rank trains a
small model on its own data (with ``overlap=OVERLAP`` stages, and ``overlap_forward``); rank 0 prints ``hier: hashes [...]`` (every rank's parameter hash), ``hier: local
L hosts H``, the largest gap to MPI's own average of the gradients at density 1.0 (``hier:
dense gap G``), and one checkpoint round trip's result (``hier: resume bitwise True``).
"""
import copy
import hashlib
import sys

import torch

import hvd_slim as hvd


def build(density, overlap=1, forward=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), density=density,
                                   min_compress_numel=100, hierarchical=True, timeout=60,
                                   overlap=overlap, overlap_forward=forward)
    return model, opt


def batch(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(16, 40, generator=g), torch.randint(0, 3, (16,), generator=g)


def train(model, opt, steps, start=0, check=True):
    """``steps`` steps; with ``check``, each gradient is compared with MPI's average of the raw
    ones (through synchronize()); without, step() does it all, so an overlapped step runs
    during backward (and with overlap_forward lands in the next forward)."""
    gap = 0.0
    for t in range(start, start + steps):
        x, y = batch(t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if not check:
            opt.step()
            continue
        raw = [p.grad.clone() for p in model.parameters()]
        opt.synchronize()
        for p, g in zip(model.parameters(), raw):
            gap = max(gap, float((p.grad - hvd.allreduce(g, op=hvd.Average)).abs().max()))
        with opt.skip_synchronize():
            opt.step()
    opt.apply_updates()
    return gap


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:12]


def main(density, overlap=1, forward=False):
    hvd.init()
    model, opt = build(density, overlap, forward)
    gap = train(model, opt, 4)
    train(model, opt, 2, start=4, check=False)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, 3, start=6, check=False)
    after = digest(model)
    model2, opt2 = build(density, overlap, forward)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, 3, start=6, check=False)
    hashes = hvd.allgather_object(digest(model2))
    resumed = hvd.allgather_object(digest(model2) == after)
    stats = opt.comm_stats()
    if hvd.rank() == 0:
        print(f"hier: hashes {hashes}", flush=True)
        print(f"hier: local {hvd.local_size()} hosts {hvd.cross_size()}", flush=True)
        print(f"hier: dense gap {gap:.3g}", flush=True)
        print(f"hier: resume bitwise {all(resumed)}", flush=True)
        print(f"hier: local bytes {stats['local_bytes_sent']} cross bytes "
              f"{stats['bytes_sent']}", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1,
         sys.argv[3:4] == ["forward"])
