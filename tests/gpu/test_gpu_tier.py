"""The GPU tier: tests/gpu/check_gpu.py on CUDA parameters under mpirun, over NCCL and over
MPI/Gloo (2 ranks, sharing the GPUs round-robin, so one GPU serves both), and three simulated ranks
on one GPU in one process, the CUDA launches of a steady step at 9 and 90 tensors, and the DDP
hook on CUDA models under torchrun (tests/gpu/check_ddp_gpu.py: over NCCL, over Gloo, and
Lightning's own registration of it on CUDA). Skipped without a GPU, except each check script's
own run on CPU tensors. Run it alone with ``bash tests/gpu/run.sh`` (under 5 minutes).

NCCL itself refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected",
ncclInvalidUsage, since NCCL 2.5). With a single GPU the NCCL checks therefore run at one rank:
the same code (frames, padding, the device path, the host-copy count) over a real NCCL
communicator, where the rank is its own server.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import List

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
from tests.mpi_launch import run_mpi, run_session, session_env, tail

SCRIPT = ROOT / "tests" / "gpu" / "check_gpu.py"
TIMEOUT = float(os.environ.get("HVD_SLIM_GPU_TIMEOUT", "150"))
PER_TRANSPORT = ["check_replicas_identical", "check_density_one_is_the_dense_average",
                 "check_flush_lands_on_the_closed_form", "check_adam_on_sparse_deliveries",
                 "check_adam_update_exchange", "check_sign_push",
                 "check_resume_from_a_cpu_mapped_checkpoint", "check_deterministic_algorithms"]
HOST_COPIES = "check_no_payload_goes_through_the_host"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")


def nccl_ranks() -> int:
    """Ranks for the NCCL run: one per GPU, at most 2 (NCCL refuses two ranks on one GPU)."""
    return max(1, min(2, torch.cuda.device_count()))


def passed_checks(reports: Path, np_: int, tag: str = "hvd_slim-gpu") -> set:
    """(rank, "check[transport]") for every PASS line the ranks' reports hold under ``tag``
    (check_gpu.py's, or check_ddp_gpu.py's ``hvd_slim-gpu-ddp``)."""
    found = set()
    for r in range(np_):
        path = reports / f"rank{r}.txt"
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        found |= {(r, m) for m in re.findall(rf"^{tag}: rank {r} of {np_} PASS (\S+?):", text,
                                             re.M)}
    return found


def run_checks(tmp_path: Path, transports: str, extra=None, np_: int = 2) -> tuple:
    env = {"HVD_SLIM_REPORT_DIR": str(tmp_path), "HVD_SLIM_TRANSPORT_TIMEOUT": "60",
           "HVD_SLIM_TRANSPORT": "auto",  # check_auto_picks_nccl relies on the default
           # cuBLAS's deterministic mode (check_deterministic_algorithms) needs a fixed workspace
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), **(extra or {})}
    rc, out, seconds = run_mpi(np_, [sys.executable, str(SCRIPT), "--transports", transports],
                               TIMEOUT, extra_env=env)
    print(f"[gpu tier] {transports} at {np_} rank(s): exit {rc} after {seconds:.1f}s\n"
          f"{tail(out, 30)}")
    return rc, out


def assert_passed(rc: int, out: str, tmp_path: Path, expected: List[str], np_: int = 2,
                  tag: str = "hvd_slim-gpu") -> None:
    passed = passed_checks(tmp_path, np_, tag)
    missing = [(r, c) for r in range(np_) for c in expected if (r, c) not in passed]
    assert rc == 0 and not missing, f"exit {rc}, not passed (rank, check): {missing}\n{tail(out)}"


@needs_gpu
def test_cuda_over_nccl(tmp_path: Path) -> None:
    np_ = nccl_ranks()
    rc, out = run_checks(tmp_path, "nccl", np_=np_)
    assert_passed(rc, out, tmp_path, [f"{c}[nccl]" for c in PER_TRANSPORT]
                  + [f"{HOST_COPIES}[nccl]", "check_auto_picks_nccl[nccl]"], np_=np_)


@needs_gpu
def test_cuda_over_mpi_and_gloo(tmp_path: Path) -> None:
    rc, out = run_checks(tmp_path, "mpi,gloo")
    assert_passed(rc, out, tmp_path, [f"{c}[{t}]" for t in ("mpi", "gloo") for c in PER_TRANSPORT]
                  + ["check_bad_device_combinations_are_refused[-]"])


def test_the_check_script_itself_on_cpu(tmp_path: Path) -> None:
    """No GPU needed: check_gpu.py's closed forms and plumbing, on CPU tensors over Gloo."""
    rc, out = run_checks(tmp_path, "gloo", {"HVD_SLIM_GPU_CHECK_ON_CPU": "1"})
    assert_passed(rc, out, tmp_path, [f"{c}[gloo]" for c in PER_TRANSPORT + [HOST_COPIES]])


DDP_SCRIPT = ROOT / "tests" / "gpu" / "check_ddp_gpu.py"
DDP_CHECKS = ["check_hook_replicas_identical", "check_hook_adamw_update",
              "check_hook_density_one_is_ddp_allreduce", "check_hook_resume_bitwise",
              "check_hook_amp_gradscaler"]
DDP_PAYLOADS, DDP_LIGHTNING = "check_hook_payloads_stay_on_the_gpu", \
    "check_lightning_strategy_and_callback"


def run_ddp_checks(tmp_path: Path, backend: str, np_: int, extra=None,
                   lightning: bool = True) -> tuple:
    """tests/gpu/check_ddp_gpu.py under torchrun at ``np_`` processes (no MPI involved)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(np_), "--max-restarts", "0", str(DDP_SCRIPT), "--backend", backend]
    env = {**session_env(("HVD_SLIM_TRANSPORT", "TORCHELASTIC_", "GROUP_RANK", "ROLE_")),
           "HVD_SLIM_REPORT_DIR": str(tmp_path), "HVD_SLIM_TRANSPORT_TIMEOUT": "60",
           "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), **(extra or {})}
    rc, out, seconds = run_session(argv + ([] if lightning else ["--no-lightning"]), TIMEOUT,
                                   env)
    print(f"[gpu tier] DDP hook over {backend} at {np_} rank(s): exit {rc} after "
          f"{seconds:.1f}s\n{tail(out, 30)}")
    return rc, out


def assert_ddp_passed(rc: int, out: str, tmp_path: Path, backend: str, expected: List[str],
                      np_: int) -> None:
    assert_passed(rc, out, tmp_path, [f"{c}[{backend}]" for c in expected], np_,
                  tag="hvd_slim-gpu-ddp")


def lightning_installed() -> bool:
    return importlib.util.find_spec("lightning") is not None


@needs_gpu
def test_ddp_hook_on_cuda_over_nccl(tmp_path: Path) -> None:
    """The hook on CUDA models over NCCL (one rank per GPU), payloads kept on the device, and
    Lightning's own registration of it on CUDA with the callback handing over AdamW."""
    np_ = nccl_ranks()
    rc, out = run_ddp_checks(tmp_path, "nccl", np_)
    expected = DDP_CHECKS + [DDP_PAYLOADS] + ([DDP_LIGHTNING] if lightning_installed() else [])
    assert_ddp_passed(rc, out, tmp_path, "nccl", expected, np_)


@needs_gpu
def test_ddp_hook_on_cuda_over_gloo(tmp_path: Path) -> None:
    """CUDA tensors through Gloo's pinned host frames, at 2 ranks sharing the GPUs (Lightning
    only with a GPU per rank: it puts rank r on cuda:r)."""
    lightning = torch.cuda.device_count() >= 2 and lightning_installed()
    rc, out = run_ddp_checks(tmp_path, "gloo", 2, lightning=lightning)
    assert_ddp_passed(rc, out, tmp_path, "gloo",
                      DDP_CHECKS + ([DDP_LIGHTNING] if lightning else []), 2)


def test_the_ddp_check_script_itself_on_cpu(tmp_path: Path) -> None:
    """No GPU needed: check_ddp_gpu.py's checks and plumbing on CPU tensors over Gloo."""
    lightning = lightning_installed()
    rc, out = run_ddp_checks(tmp_path, "gloo", 2, {"HVD_SLIM_GPU_CHECK_ON_CPU": "1"},
                             lightning=lightning)
    assert_ddp_passed(rc, out, tmp_path, "gloo",
                      DDP_CHECKS + [DDP_PAYLOADS] + ([DDP_LIGHTNING] if lightning else []), 2)


@needs_gpu
def test_the_device_path_keeps_payloads_on_one_gpu():
    """In one process, so a single GPU suffices (NCCL needs two): three simulated ranks on the
    same GPU exchange through the in-process transport's tensor payloads. After the handshake,
    no device-to-host copy of payload size happens, and the ranks end bitwise identical."""
    from host_copies import HostCopies, metadata_limit   # tests/gpu, on pytest's path
    from hvd_slim.config import SlimConfig
    from hvd_slim.exchange import Layout, SlimExchange
    from hvd_slim.transport import run_ranks

    config = SlimConfig(density=0.01, min_compress_numel=1000)
    dev = torch.device("cuda", 0)
    seen: list = []

    def rank_fn(rank, transport):
        torch.manual_seed(0)
        named = [("w", torch.nn.Parameter(torch.zeros(256, 512, device=dev))),
                 ("b", torch.nn.Parameter(torch.zeros(512, device=dev)))]
        ex = SlimExchange(Layout(named, config, lambda dt: dt), config, transport)
        assert ex.path.device_payloads
        for t in range(5):
            g = torch.Generator(device=dev).manual_seed(100 * rank + t)
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=g, device=dev)
            ex.step()
        return torch.cat([p.grad.reshape(-1) for _, p in named]), ex   # still on the GPU

    with HostCopies(cuda=True) as got:
        out = run_ranks(3, rank_fn, device_payloads=True)
    seen += got
    grads = [g.cpu() for g, _ in out]
    assert all(torch.equal(grads[0], g) for g in grads[1:])
    ex = out[0][1]
    limit = metadata_limit(len(ex.layout.buckets), 3)
    payload = min(b.k * b.value_bytes for b in ex.layout.sparse)
    # The handshake of step 0 is host-built (32-byte control messages) and read on the host.
    big = [(op, n) for op, n in seen if n > limit]
    assert limit < payload and not big, f"payload-sized host copies: {big[:5]}"


@needs_gpu
@pytest.mark.parametrize("inner", ["sgd momentum", "adamw"])
def test_a_steady_step_launches_as_many_kernels_for_90_tensors_as_for_9(inner):
    """The local-work issue's GPU target: CUDA kernel launches (and copies) of one steady step,
    counted by torch's profiler, do not grow with the number of tensors."""
    from torch.profiler import ProfilerActivity, profile

    from hvd_slim.transport import FakeCluster
    from tests.step_ops import make_optimizer, steady

    def launches(tensors: int) -> int:
        opt, ps = make_optimizer(tensors, inner, FakeCluster(1).transport(0), device="cuda")
        steady(opt, ps)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages()
                   if e.key.startswith(("cudaLaunchKernel", "cudaMemcpy", "cuLaunchKernel")))

    few, many = launches(9), launches(90)
    print(f"[gpu tier] {inner}: {few} launches a step at 9 tensors, {many} at 90")
    assert 0 < few and many <= few + 20
