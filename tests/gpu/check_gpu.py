"""The distributed checks on CUDA parameters: ``mpirun -np 2 python tests/gpu/check_gpu.py
--transports nccl`` (or ``mpi,gloo``). Ranks share the GPUs round-robin, so one GPU serves both.

Per transport: replicas stay bitwise identical over 20 steps at density 0.01; ``density=1.0``
equals the dense average (mpi4py's Allreduce on host copies, independent of hvd_slim) to 1e-5;
``flush()`` zeroes every residual and lands on the closed form; Adam on sparse deliveries
keeps replicas and its state identical; a checkpoint loaded with ``map_location="cpu"``
resumes bitwise; under ``torch.use_deterministic_algorithms(True)`` nothing is refused. On NCCL: no device-to-host copy
of payload size happens in a step (tests/gpu/host_copies.py counts them). Plus: ``auto`` picks NCCL for CUDA
parameters, and mixed CPU/CUDA parameters or NCCL for CPU parameters are refused clearly.

``HVD_SLIM_GPU_CHECK_ON_CPU=1`` runs the same checks on CPU tensors (``--transports mpi,gloo``):
that is how this script's own logic is exercised on a machine without a GPU.

Each rank appends ``hvd_slim-gpu: rank R of N PASS <check>`` (or ``FAIL``, with the traceback)
lines to ``$HVD_SLIM_REPORT_DIR/rank<R>.txt``. A check that fails on every rank does not stop the
others, so one run on a GPU reports every failure; the job then exits non-zero. A check that
fails on some ranks only aborts every rank.
"""
import argparse
import hashlib
import io
import os
import sys
import traceback

import torch
from mpi4py import MPI

import hvd_slim as hvd

COMM = MPI.COMM_WORLD


ON_CPU = os.environ.get("HVD_SLIM_GPU_CHECK_ON_CPU") == "1"


def device() -> torch.device:
    if ON_CPU:
        return torch.device("cpu")
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same start everywhere (broadcast_parameters is tested elsewhere)
        self.fc = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


def batch(step: int):
    g = torch.Generator().manual_seed(7919 * hvd.rank() + step)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
    return x.to(device()), y.to(device())


def wrap(model, transport, lr=0.05, momentum=0.9, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    transport=transport, min_compress_numel=1000, **kw)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def host_mean(t: torch.Tensor) -> torch.Tensor:
    buf = t.detach().double().cpu().numpy().copy()
    COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf / COMM.Get_size())


def assert_same_on_every_rank(t: torch.Tensor, what: str) -> None:
    """``t`` (on the host) hashes the same on every rank."""
    digests = hvd.allgather_object(hashlib.sha256(t.numpy().tobytes()).hexdigest())
    assert len(set(digests)) == 1, f"{what} differ: {digests}"


def loss(model, step):
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x), y)


def train(model, opt, steps) -> None:
    """One optimizer step on ``loss`` for each step number in ``steps``."""
    for t in steps:
        opt.zero_grad()
        loss(model, t).backward()
        opt.step()


def check_replicas_identical(transport: str) -> str:
    model = Net().to(device())
    opt = wrap(model, transport, density=0.01)
    train(model, opt, range(20))
    stats = opt.comm_stats()
    assert stats["transport"] == transport, stats
    assert_same_on_every_rank(flat(model), "replicas")
    assert all(p.device == device() for p in model.parameters())
    return f"pushed {stats['bytes_pushed']} B vs dense {stats['dense_bytes']} B"


def check_density_one_is_the_dense_average(transport: str) -> str:
    model, ref = Net().to(device()), Net().to(device())
    opt = wrap(model, transport, density=1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for t in range(10):
        opt.zero_grad()
        loss(model, t).backward()
        opt.step()
        ref_opt.zero_grad()
        loss(ref, t).backward()
        for p in ref.parameters():
            p.grad = host_mean(p.grad).to(p.dtype).to(p.device)
        ref_opt.step()
    diff = (flat(model) - flat(ref)).abs().max().item()
    assert diff <= 1e-5, f"density=1.0 differs from the dense average by {diff}"
    return f"max diff {diff:.2e}"


def check_flush_lands_on_the_closed_form(transport: str) -> str:
    """loss = sum(p * c): gradients do not depend on p, so the flushed model is p0 - lr * mean(c)."""
    model = Net().to(device())
    p0 = flat(model).clone()
    opt = wrap(model, transport, lr=0.5, momentum=0.0, density=0.01)
    total = torch.zeros_like(p0)
    for t in range(5):
        c = torch.randn(p0.shape, generator=torch.Generator().manual_seed(31 * hvd.rank() + t))
        total += c
        opt.zero_grad()
        (torch.cat([p.reshape(-1) for p in model.parameters()]) * c.to(device())).sum().backward()
        opt.step()
    assert opt._exchange.residual_norm() > 0
    opt.flush()
    assert opt._exchange.residual_norm() == 0.0
    expected = p0 - 0.5 * host_mean(total).float()
    diff = (flat(model) - expected).abs().max().item()
    assert diff <= 1e-5, f"after flush() the model is {diff} away from the closed form"
    return f"max diff {diff:.2e}"


def check_adam_on_sparse_deliveries(transport: str) -> str:
    """The gradient exchange's Adam (adam_exchange="gradient"): the compressed parameters
    stepped by hvd_slim/optim/inner/adam.py on the device: replicas and Adam's state stay bitwise
    equal, and the delivery clock lives on the parameters' device."""
    model = Net().to(device())
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   transport=transport, min_compress_numel=1000, density=0.01,
                                   adam_exchange="gradient")
    assert opt._rescaled_params, "no parameter took the rescaled Adam path"
    train(model, opt, range(15))
    state = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()])
    both = torch.cat([flat(model), state.cpu()])
    assert_same_on_every_rank(both, "replicas or Adam states")
    clocks = [opt.state[p]["last_delivery"] for p in model.parameters()
              if "last_delivery" in opt.state[p]]
    assert clocks and all(c.device == device() for c in clocks)
    return f"{len(clocks)} tensors on the rescaled path"


def check_adam_update_exchange(transport: str) -> str:
    """AdamW's default, the update exchange (optim/inner/adam_update.py), on the device: replicas stay
    bitwise equal and each rank's moments live on the parameters' device."""
    model = Net().to(device())
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   transport=transport, min_compress_numel=1000)
    assert opt.slim_config.adam_exchange == "update"
    train(model, opt, range(15))
    assert_same_on_every_rank(flat(model), "replicas")
    moments = opt.state_dict()["hvd_slim_adam"]["exp_avg_sq"]
    assert moments and all(v.device == device() for v in moments)
    return f"{len(moments)} bucket(s) of moments on {device()}"


def check_sign_push(transport: str) -> str:
    """``value_bits=1`` under AdamW on the device: every coordinate's sign pushed (a coded
    section, no indices), the server's sum pulled half at 8 bits and then whole (coded):
    replicas stay bitwise equal and the push is about 1/32 of the compressed bytes."""
    out = []
    for pull_density in (0.5, 1.0):
        model = Net().to(device())
        opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(),
                                       transport=transport, min_compress_numel=1000,
                                       value_bits=1, pull_density=pull_density)
        (b,) = opt._layout.sparse
        assert b.slice_bits == 1 and b.k == b.numel and b.device == device()
        train(model, opt, range(10))
        assert_same_on_every_rank(flat(model), f"replicas (pull_density={pull_density})")
        last = opt.comm_stats()["last_step"]
        assert last["push_index_bytes"] == 0 and \
            last["push_sparse_value_bytes"] == 4 + (b.numel + 7) // 8, last
        out.append(f"pull {pull_density}: {last['pull_sparse_value_bytes']} B")
    return ", ".join(out)


def check_resume_from_a_cpu_mapped_checkpoint(transport: str) -> str:
    """A checkpoint saved from the GPU and loaded with ``map_location="cpu"`` (how a script
    loads one anywhere) resumes bitwise as an uninterrupted run: residuals, selectors and,
    with local steps, a delayed outer step in flight."""
    done = []
    for kw in (dict(warmup_decay_steps=0), dict(local_steps=2, outer_delay=1)):
        def run(steps, state=None):
            model = Net().to(device())
            opt = wrap(model, transport, density=0.01, **kw)
            if state is not None:
                model.load_state_dict(state[0])
                opt.load_state_dict(state[1])
            train(model, opt, steps)
            return model, opt
        full, _ = run(range(8))
        half, opt = run(range(5))
        buf = io.BytesIO()
        torch.save((half.state_dict(), opt.state_dict()), buf)
        buf.seek(0)
        resumed, _ = run(range(5, 8), torch.load(buf, map_location="cpu", weights_only=True))
        assert torch.equal(flat(resumed), flat(full)), f"resumed with {kw} differs"
        assert all(p.device == device() for p in resumed.parameters())
        if "local_steps" not in kw:   # inside a round of local steps the replicas differ
            assert_same_on_every_rank(flat(resumed), f"replicas resumed with {kw}")
        done.append(",".join(kw))
    return f"bitwise after resuming ({'; '.join(done)})"


def check_deterministic_algorithms(transport: str) -> str:
    """Under ``torch.use_deterministic_algorithms(True)`` (a reproducible run's setting) the
    exchange uses no CUDA kernel torch refuses there, and two runs agree bitwise."""
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            model = WideNet().to(device())
            opt = wrap(model, transport, density=0.01)
            train(model, opt, range(6))
            runs.append(flat(model))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0], runs[1]), "two deterministic runs differ"
    return "6 steps twice, bitwise equal"


class WideNet(torch.nn.Module):
    """Payload sections far larger than any metadata read: 65k compressed coordinates, so a
    push carries about 650 values (2.6 KB) and their indices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 1024)
        self.head = torch.nn.Linear(1024, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


def check_no_payload_goes_through_the_host(transport: str) -> str:
    """The device path (NCCL; on CPU tensors, Gloo): after the first step's handshake, no
    device-to-host copy (on CPU: no numpy conversion) is anywhere near a payload's size. Only
    headers, section tables, length words and scalars are read on the host."""
    from hvd_slim.selection import backend
    from host_copies import HostCopies, metadata_limit
    backend.FORCE_TORCH = ON_CPU   # on CPU tensors, run selection's torch path as a GPU would
    try:
        model = WideNet().to(device())
        opt = wrap(model, transport, density=0.01)
        seen = []
        for t in range(6):
            opt.zero_grad()
            loss(model, t).backward()
            if t == 0:
                opt.step()   # the handshake is host-built, by design
                continue
            with HostCopies(cuda=not ON_CPU) as got:
                opt.step()
            seen += got
    finally:
        backend.FORCE_TORCH = False
    ex = opt._exchange
    assert ex.path.device_payloads, f"{transport} did not take the device path"
    limit = metadata_limit(len(ex.layout.buckets), hvd.size())
    payload = min(b.k * b.value_bytes for b in ex.layout.sparse)
    biggest = max((n for _, n in seen), default=0)
    assert limit < payload, (limit, payload)
    assert biggest <= limit, f"host copies larger than metadata: {sorted(seen, key=lambda x: -x[1])[:5]}"
    return f"{len(seen)} host reads in 5 steps, largest {biggest} B (a value section is {payload} B)"


def check_auto_picks_nccl(_: str) -> str:
    model = Net().to(device())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert opt.comm_stats()["transport"] == "nccl", opt.comm_stats()["transport"]
    return "auto -> nccl"


def check_bad_device_combinations_are_refused(_: str) -> str:
    model = Net()
    model.head.to(device())  # fc stays on the CPU
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
        raise AssertionError("mixed CPU/CUDA parameters were accepted")
    except ValueError as exc:
        assert "'fc.weight' is on cpu" in str(exc) and "'head.weight' is on cuda" in str(exc), exc
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(Net().parameters(), lr=0.1), transport="nccl")
        raise AssertionError("NCCL was accepted for CPU parameters")
    except ValueError as exc:
        assert "NCCL needs CUDA parameters" in str(exc), exc
    return "refused"


PER_TRANSPORT = [check_replicas_identical, check_density_one_is_the_dense_average,
                 check_flush_lands_on_the_closed_form, check_adam_on_sparse_deliveries,
                 check_adam_update_exchange, check_sign_push,
                 check_resume_from_a_cpu_mapped_checkpoint, check_deterministic_algorithms]
# Transports on which the device path keeps payloads off the host: NCCL (and Gloo on CPU tensors).
DEVICE_RESIDENT = {"nccl", "gloo"} if ON_CPU else {"nccl"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transports", default="nccl")
    names = parser.parse_args().transports.split(",")
    hvd.init()
    tag = f"hvd_slim-gpu: rank {hvd.rank()} of {hvd.size()}"
    plan = [(check, t) for t in names for check in PER_TRANSPORT]
    plan += [(check_no_payload_goes_through_the_host, t) for t in names if t in DEVICE_RESIDENT]
    if "nccl" in names:
        plan.append((check_auto_picks_nccl, "nccl"))
    elif not ON_CPU:
        plan.append((check_bad_device_combinations_are_refused, "-"))
    folder = os.environ.get("HVD_SLIM_REPORT_DIR")

    def report(line: str) -> None:
        print(line, flush=True)
        if folder:
            with open(os.path.join(folder, f"rank{hvd.rank()}.txt"), "a", encoding="utf-8") as f:
                f.write(line + "\n")

    failed = []
    for check, transport in plan:
        name = f"{check.__name__}[{transport}]"
        try:
            detail, ok = check(transport), True
        except BaseException:  # noqa: BLE001 - reported; the other checks still run
            detail, ok = traceback.format_exc(), False
        # A check that failed on every rank leaves the ranks in step (each raised at its end,
        # or timed out of the collective its peer left), so the next checks still run and one
        # GPU session reports every failure. Ranks that disagree are out of step: end them all.
        verdicts = COMM.allgather(ok)
        if ok:
            report(f"{tag} PASS {name}: {detail}")
            continue
        failed.append(name)
        report(f"{tag} FAIL {name}:\n{detail}")
        if any(verdicts):
            sys.stderr.write(f"{tag}: {name} failed here but passed on another rank\n")
            sys.stderr.flush()
            COMM.Abort(1)
    hvd.barrier()
    hvd.shutdown()  # releases the NCCL/Gloo groups before exit
    if failed:
        sys.exit(f"{tag}: {len(failed)} check(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
