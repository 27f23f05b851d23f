"""hvd_slim inside real Horovod: run under ``horovodrun -np N`` or ``mpirun -np N``.

The script is what a Horovod user writes: ``import horovod.torch as hvd; hvd.init()``, Horovod's
own ``broadcast_parameters`` / ``broadcast_optimizer_state`` / ``DistributedOptimizer`` for the
baseline, and ``hvd_slim.DistributedOptimizer`` without ever calling ``hvd_slim.init()``.
Each check prints ``hvd_slim-horovod: rank R of N PASS <check>`` (also appended to
``$HVD_SLIM_REPORT_DIR/rank<R>.txt`` when set: launchers interleave the ranks' stdout mid-line);
any failure prints the traceback and aborts every rank (MPI Abort), so the launcher never hangs.
Launched by tests/horovod/test_tier_horovod.py.
"""
import hashlib
import os
import sys
import traceback

import torch

import horovod.torch as hvd

import hvd_slim

STEPS = 10


class Net(torch.nn.Module):
    """A conv layer and two linear layers: one compressed bucket (fc) and small dense tensors."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.head(torch.relu(self.fc(h)))


def batch(step: int):
    g = torch.Generator().manual_seed(7919 * hvd.rank() + step)
    return torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def fresh_model() -> Net:
    """Different weights on every rank until Horovod's broadcast_parameters makes them equal."""
    model = Net(seed=hvd.rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def train(model: Net, opt, steps: int = STEPS, start: int = 0) -> None:
    for t in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(t)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def assert_same_everywhere(value, what: str) -> None:
    rows = hvd.allgather_object(value)
    assert len(set(rows)) == 1, f"{what} differs between ranks: {rows}"


def slim(model, opt_cls=torch.optim.SGD, **kw):
    opt_kw = {"lr": 0.05, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 0.01}
    kw.setdefault("min_compress_numel", 1000)
    return hvd_slim.DistributedOptimizer(opt_cls(model.parameters(), **opt_kw),
                                         named_parameters=model.named_parameters(), **kw)


# --- checks, run in this order on every rank ---------------------------------------------------

def check_starts_from_horovod() -> None:
    from mpi4py import MPI  # after hvd.init(): Horovod owns MPI here
    assert not hvd_slim.is_initialized()
    # Queries before the start are answered by Horovod and must not start anything.
    assert (hvd_slim.rank(), hvd_slim.size()) == (hvd.rank(), hvd.size())
    assert (hvd_slim.local_rank(), hvd_slim.local_size()) == (hvd.local_rank(), hvd.local_size())
    assert not hvd_slim.is_initialized()
    opt = slim(fresh_model(), density=0.1)  # collective: starts hvd_slim on COMM_WORLD
    assert hvd_slim.is_initialized()
    world = MPI.COMM_WORLD
    assert (hvd_slim.rank(), hvd_slim.size()) == (hvd.rank(), hvd.size()) \
        == (world.Get_rank(), world.Get_size())
    stats = opt.comm_stats()
    assert stats["world_size"] == hvd.size() and stats["transport"] == "mpi", stats


def check_density_one_matches_horovod() -> str:
    ref = fresh_model()
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=ref.named_parameters(), op=hvd.Average)
    hvd.broadcast_optimizer_state(ref_opt, root_rank=0)
    model = fresh_model()
    start = flat(model).clone()
    opt = slim(model, density=1.0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train(ref, ref_opt)
    train(model, opt)
    diff = (flat(model) - flat(ref)).abs().max().item()
    moved = (flat(ref) - start).abs().max().item()
    assert moved > 1e-3, f"the baseline barely trained (moved {moved}): the check would be vacuous"
    assert diff <= 1e-5, f"density=1.0 differs from Horovod's DistributedOptimizer by {diff}"
    return f"max |hvd_slim - horovod| = {diff:.2e} after {STEPS} steps (parameters moved {moved:.2e})"


def check_replicas_identical() -> None:
    for transport in ("mpi", "gloo"):
        model = fresh_model()
        start = flat(model).clone()
        opt = slim(model, density=0.01, transport=transport)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        train(model, opt, steps=3 * STEPS)
        stats = opt.comm_stats()
        assert stats["transport"] == transport, stats
        assert stats["bytes_pushed"] < stats["dense_bytes"] / 2, stats
        assert not torch.equal(flat(model), start), "training did not change the model"
        assert_same_everywhere(digest(flat(model)), f"parameters after {3 * STEPS} steps over {transport}")


def check_broadcast_optimizer_state() -> None:
    # A fresh optimizer has no state: Horovod runs one step() on zero gradients to create it.
    # As for Horovod's own optimizer, that step is local: no Slim-DP exchange runs or counts
    # (also through an LR scheduler, which wraps step()).
    model = fresh_model()
    opt = slim(model, density=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.param_groups[0]["lr"] = 0.05 * (hvd.rank() + 1)
    before = flat(model).clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.05, opt.param_groups[0]["lr"]
    stats = opt.comm_stats()
    assert (stats["steps"], stats["bytes_pushed"], stats["bytes_pulled"]) == (0, 0, 0), stats
    assert opt._exchange.step_count == 0, opt._exchange.step_count
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters()), "no state created"
    assert torch.equal(flat(model), before), "the zero-gradient step moved the parameters"
    train(model, opt, steps=2)
    assert opt.comm_stats()["steps"] == 2 and opt._exchange.step_count == 2
    assert_same_everywhere(digest(flat(model)), "parameters after Horovod's state initialisation")
    # With state: every tensor and scalar of Adam's state comes from the root.
    model = fresh_model()
    opt = slim(model, opt_cls=torch.optim.Adam, density=0.1)
    train(model, opt, steps=3)
    root_view = [digest(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert root_view, "Adam kept no state"
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                v.add_(hvd.rank())
    opt.param_groups[0]["lr"] = 0.01 * (hvd.rank() + 1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    now = [digest(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert_same_everywhere(tuple(now), "optimizer state after hvd.broadcast_optimizer_state")
    if hvd.rank() == 0:
        assert now == root_view, "the root's own state changed"
    assert opt.param_groups[0]["lr"] == 0.01
    train(model, opt, steps=2, start=3)
    assert_same_everywhere(digest(flat(model)), "parameters after training on the broadcast state")


def check_fp16_compression() -> None:
    model = fresh_model()
    # value_bits=32: slices at the comm dtype, which Horovod's compressor makes float16.
    opt = slim(model, density=0.05, compression=hvd.Compression.fp16, value_bits=32,
               warmup_decay_steps=0)
    train(model, opt, steps=4)
    (bucket,) = opt._layout.sparse
    last = opt.comm_stats()["last_step"]
    assert last["push_sparse_value_bytes"] == 2 * bucket.k, (last, bucket.k)  # fp16 on the wire
    assert last["push_dense_value_bytes"] == 2 * sum(
        b.numel for b in opt._layout.buckets if b.kind == "dense"), last
    assert_same_everywhere(digest(flat(model)), "parameters with Compression.fp16")


def check_overlap_forward() -> None:
    """Inside Horovod, the exchange overlapped with backward and the next forward trains
    bitwise as overlap alone, over both transports, and every replica stays identical."""
    for transport in ("mpi", "gloo"):
        got = []
        for forward in (False, True):
            model = fresh_model()
            opt = slim(model, density=0.05, transport=transport, overlap=3,
                       overlap_forward=forward)
            train(model, opt, steps=STEPS)
            opt.apply_updates()
            got.append(flat(model).clone())
        assert torch.equal(got[0], got[1]), f"overlap_forward over {transport} differs from " \
            f"overlap alone by {(got[0] - got[1]).abs().max().item()}"
        assert_same_everywhere(digest(got[1]), f"parameters with overlap_forward over {transport}")


CHECKS = [check_starts_from_horovod, check_density_one_matches_horovod, check_replicas_identical,
          check_broadcast_optimizer_state, check_fp16_compression, check_overlap_forward]


def report(line: str) -> None:
    """Print ``line``; also append it to this rank's file in ``$HVD_SLIM_REPORT_DIR``."""
    print(line, flush=True)
    folder = os.environ.get("HVD_SLIM_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"rank{hvd.rank()}.txt"), "a", encoding="utf-8") as f:
            f.write(line + "\n")


def main() -> None:
    hvd.init()
    tag = f"hvd_slim-horovod: rank {hvd.rank()} of {hvd.size()}"
    for check in CHECKS:
        try:
            detail = check()
        except BaseException:  # noqa: BLE001 - report, then end every rank
            sys.stderr.write(f"{tag} FAILED {check.__name__}\n{traceback.format_exc()}")
            sys.stderr.flush()
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(1)
        report(f"{tag} PASS {check.__name__}" + (f": {detail}" if detail else ""))
    report(f"{tag} done passed={len(CHECKS)}")


if __name__ == "__main__":
    main()
