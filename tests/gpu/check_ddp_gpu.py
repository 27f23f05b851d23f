"""The DDP communication hook (hvd_slim.ddp) on CUDA models, one torchrun process per rank:

    torchrun --nproc-per-node 1 tests/gpu/check_ddp_gpu.py --backend nccl
    torchrun --nproc-per-node 2 tests/gpu/check_ddp_gpu.py --backend gloo   # CUDA tensors

NCCL refuses two ranks of one communicator on one GPU, so with a single GPU the NCCL run has
one rank (its own server: the same frames, device path and registration over a real NCCL
communicator); Gloo carries CUDA tensors through pinned host frames at any number of ranks.

Checked on the device: replicas stay bitwise identical under SGD and under AdamW given to the
state (Adam's update travels); ``density=1.0`` equals DDP's own allreduce; a checkpoint resumes
bitwise; autocast with a ``GradScaler`` given to the state trains finite; over NCCL no payload
goes through the host; and, with Lightning installed, ``DDPStrategy(ddp_comm_state=,
ddp_comm_hook=slim_hook)`` (which Lightning registers on CUDA itself) with
``SlimHookCallback`` trains, the callback handing the state its AdamW.

``HVD_SLIM_GPU_CHECK_ON_CPU=1`` runs the same checks on CPU tensors over Gloo, which is how
this script's own logic is tested without a GPU (tests/gpu/test_gpu_tier.py). Each rank appends
``hvd_slim-gpu-ddp: rank R of N PASS <check>`` (or FAIL with the traceback) to
``$HVD_SLIM_REPORT_DIR/rank<R>.txt``; a check failing on some ranks only ends the job.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import traceback
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_slim.ddp import SlimState, slim_hook

ON_CPU = os.environ.get("HVD_SLIM_GPU_CHECK_ON_CPU") == "1"


def device() -> torch.device:
    if ON_CPU:
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


class Net(torch.nn.Module):
    """65k compressed coordinates in fc1, so a push's payload dwarfs any metadata."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * dist.get_rank() + step)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
    return x.to(device()), y.to(device())


def ddp(state: Any = None, adamw: bool = False) -> Tuple[DDP, torch.optim.Optimizer]:
    model = DDP(Net().to(device()), device_ids=None if ON_CPU else [device()])
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01) if adamw
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if state is not None:
        if adamw:
            state.set_optimizer(opt)
        state.register(model)
    return model, opt


def train(model: DDP, opt: torch.optim.Optimizer, steps: range, scaler: Any = None) -> None:
    for t in steps:
        x, y = batch(t)
        opt.zero_grad()
        with torch.autocast(device().type, dtype=torch.bfloat16 if ON_CPU else torch.float16,
                            enabled=scaler is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def same_everywhere(t: torch.Tensor, what: str) -> None:
    mine = hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert len(set(every)) == 1, f"{what} differ between ranks: {every}"


def check_hook_replicas_identical() -> str:
    state = SlimState(density=0.01, min_compress_numel=1000)
    model, opt = ddp(state)
    start = flat(model.module)
    train(model, opt, range(12))
    same_everywhere(flat(model.module), "replicas")
    assert not torch.equal(flat(model.module), start), "the model did not move"
    assert all(p.device == device() for p in model.parameters())
    st = state.comm_stats()
    assert st["steps"] == 12 and 0 < st["bytes_pushed"] < st["dense_bytes"], st
    return f"pushed {st['bytes_pushed']} B against dense {st['dense_bytes']} B"


def check_hook_adamw_update() -> str:
    state = SlimState(min_compress_numel=1000)
    model, opt = ddp(state, adamw=True)
    train(model, opt, range(12))
    assert state.config.adam_exchange == "update", state.config.adam_exchange
    same_everywhere(flat(model.module), "replicas")
    return f"adam_exchange={state.config.adam_exchange}"


def check_hook_density_one_is_ddp_allreduce() -> str:
    model, opt = ddp(SlimState(density=1.0))
    ref, ref_opt = ddp()
    train(model, opt, range(8))
    train(ref, ref_opt, range(8))
    diff = (flat(model.module) - flat(ref.module)).abs().max().item()
    assert diff <= 1e-5, f"density=1.0 differs from DDP's allreduce by {diff}"
    return f"max diff {diff:.2e}"


def check_hook_resume_bitwise() -> str:
    state = SlimState(density=0.01, min_compress_numel=1000)
    model, opt = ddp(state)
    train(model, opt, range(6))
    buf = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "slim": state.state_dict()}, buf)
    train(model, opt, range(6, 12))
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=True)   # as a user loads one
    again_state = SlimState(density=0.01, min_compress_numel=1000)
    again_state.load_state_dict(saved["slim"])
    again, again_opt = ddp(again_state)
    again.module.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    train(again, again_opt, range(6, 12))
    assert torch.equal(flat(again.module), flat(model.module)), "the resumed run differs"
    return "bitwise"


def check_hook_amp_gradscaler() -> str:
    state = SlimState(density=0.01, min_compress_numel=1000)
    model, opt = ddp(state)
    scaler = torch.amp.GradScaler(device().type)
    state.set_grad_scaler(scaler)
    train(model, opt, range(10), scaler)
    assert torch.isfinite(flat(model.module)).all(), "non-finite parameters"
    same_everywhere(flat(model.module), "replicas")
    return f"scale {scaler.get_scale():g}"


def check_hook_payloads_stay_on_the_gpu() -> str:
    """Over NCCL (on CPU tensors: Gloo), after the first step's handshake no device-to-host
    copy comes near a payload's size (tests/gpu/host_copies.py)."""
    from host_copies import HostCopies, metadata_limit
    from hvd_slim.selection import backend
    backend.FORCE_TORCH = ON_CPU   # on CPU tensors, selection's torch path, as on a GPU
    try:
        state = SlimState(density=0.01, min_compress_numel=1000)
        model, opt = ddp(state)
        train(model, opt, range(1))
        with HostCopies(cuda=not ON_CPU) as seen:
            train(model, opt, range(1, 6))
    finally:
        backend.FORCE_TORCH = False
    limit = metadata_limit(8, dist.get_world_size())
    payload = int(0.01 * 64 * 1024) * 4
    biggest = max((n for _, n in seen), default=0)
    assert limit < payload and biggest <= limit, sorted(seen, key=lambda s: -s[1])[:5]
    return f"{len(seen)} host reads in 5 steps, largest {biggest} B"


def check_lightning_strategy_and_callback() -> str:
    """Lightning's own registration on CUDA (DDPStrategy's ddp_comm_state/ddp_comm_hook; on a
    CPU Lightning drops it and the callback registers instead), and the callback handing the
    state AdamW."""
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError:
        return "skipped: lightning is not installed"
    from torch.utils.data import DataLoader, TensorDataset

    from hvd_slim.ddp.lightning import SlimHookCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, b: Any, _: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.net(b[0]), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(dist.get_rank())
    data = TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 4, (256,),
                                                                          generator=g))
    state = SlimState(min_compress_numel=1000)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu" if ON_CPU else "gpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=DDPStrategy(process_group_backend=dist.get_backend(), ddp_comm_state=state,
                             ddp_comm_hook=slim_hook),
        callbacks=[SlimHookCallback(state)], max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=16))
    st = state.comm_stats()
    assert st["steps"] == 6, st
    assert state.config.adam_exchange == "update", state.config.adam_exchange
    same_everywhere(flat(module.net), "replicas")
    return f"{st['steps']} steps through the hook, adam_exchange=update"


CHECKS: List[Callable[[], str]] = [
    check_hook_replicas_identical, check_hook_adamw_update,
    check_hook_density_one_is_ddp_allreduce, check_hook_resume_bitwise,
    check_hook_amp_gradscaler]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--no-lightning", action="store_true")
    args = ap.parse_args()
    if not ON_CPU:
        torch.cuda.set_device(device())
    dist.init_process_group(args.backend)
    plan = list(CHECKS)
    if args.backend == "nccl" or ON_CPU:
        plan.append(check_hook_payloads_stay_on_the_gpu)
    if not args.no_lightning:
        plan.append(check_lightning_strategy_and_callback)   # last: Lightning owns the group after
    tag = f"hvd_slim-gpu-ddp: rank {dist.get_rank()} of {dist.get_world_size()}"
    folder = os.environ.get("HVD_SLIM_REPORT_DIR")
    failed = []
    for check in plan:
        try:
            detail, ok = check(), True
        except BaseException:  # noqa: BLE001 - reported; the other checks still run
            detail, ok = traceback.format_exc(), False
        verdicts: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, ok)
        line = f"{tag} {'PASS' if ok else 'FAIL'} {check.__name__}[{args.backend}]: {detail}"
        print(line, flush=True)
        if folder:
            with open(os.path.join(folder, f"rank{dist.get_rank()}.txt"), "a",
                      encoding="utf-8") as f:
                f.write(line + "\n")
        if not ok:
            failed.append(check.__name__)
        if len(set(verdicts)) > 1:   # some ranks failed: the others are out of step
            os._exit(1)
    # Every rank leaves together, the barrier's work still referenced while the group goes
    # (Gloo's teardown, docs/ddp.md).
    done = dist.barrier(async_op=True)
    done.wait()
    dist.destroy_process_group()
    del done
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
