"""The Gloo transport across real processes started the torchrun way (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; no MPI, no hvd_slim.init()), each under a hard timeout.

The workers are this file run as a script; each checks its own closed forms and prints one
``worker <scenario> rank R: <result>`` line that the test reads. Bad launches (a duplicated or
missing rank, a peer that dies) must end in a clear error within HVD_SLIM_TRANSPORT_TIMEOUT.
"""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STRIP = ("OMPI_", "PMI_", "PMIX_", "HOROVOD_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_",
         "HVD_SLIM_TRANSPORT")
pytestmark = [
    pytest.mark.slow,  # starts real processes: not in `pytest -m unit`
    pytest.mark.skipif(not torch.distributed.is_available()
                       or not torch.distributed.is_gloo_available(),
                       reason="torch.distributed with Gloo is not available"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, ranks: List[int], world: int, timeout: float = 120.0,
           transport_timeout: float = 60.0, script: str = __file__) -> Dict[int, str]:
    """Start one worker (``script`` run with ``scenario``) per entry of ``ranks`` (RANK values,
    possibly wrong on purpose); return each process's output by index. All are killed if any
    outlives ``timeout``."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(STRIP)}
    procs = []
    for r in ranks:
        env = dict(base, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), HVD_SLIM_TRANSPORT_TIMEOUT=str(transport_timeout),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, script, scenario], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    outs: Dict[int, str] = {}
    try:
        for i, p in enumerate(procs):
            outs[i] = p.communicate(timeout=timeout)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario}: workers did not finish within {timeout:.0f}s (a hang)")
    return outs


def result(out: str, scenario: str, idx_rank: int) -> str:
    tag = f"worker {scenario} rank {idx_rank}: "
    lines = [ln[len(tag):] for ln in out.splitlines() if ln.startswith(tag)]
    assert lines, f"no result from {scenario} rank {idx_rank}; output:\n{out[-3000:]}"
    return lines[-1]


def test_collectives_and_optimizer_over_gloo_at_three_ranks():
    outs = launch("collectives", [0, 1, 2], 3)
    digests = [result(outs[r], "collectives", r) for r in range(3)]
    assert all(d.startswith("ok ") for d in digests), digests
    assert len(set(digests)) == 1, f"replicas differ: {digests}"


def test_duplicated_rank_is_a_clear_error_not_a_hang():
    outs = launch("bootstrap", [0, 0], 2, timeout=90, transport_timeout=3)
    said = [result(o, "bootstrap", 0) for o in outs.values()]
    # One cannot open the store (the port is taken); the other waits for a rank 1 that never
    # comes. Both must say so, and what to check, within the timeout.
    assert all("hvd_slim rendezvous" in s and "exactly one process rank 0" in s for s in said), said


def test_missing_rank_is_a_clear_error_not_a_hang():
    outs = launch("bootstrap", [1], 2, timeout=90, transport_timeout=3)
    said = result(outs[0], "bootstrap", 1)
    assert "hvd_slim rendezvous" in said and "RANK=1, WORLD_SIZE=2" in said, said


def test_a_dead_peer_ends_the_collective_with_a_transport_error():
    outs = launch("dead_peer", [0, 1], 2, timeout=90, transport_timeout=10)
    assert result(outs[1], "dead_peer", 1) == "exited", outs[1]
    said = result(outs[0], "dead_peer", 0)
    assert said.startswith("TransportError: rank 0: gloo gather") and "failed" in said, said


@pytest.mark.skipif(not hasattr(__import__("hvd_slim.transport.base").transport.base.Transport,
                            "watch"), reason="this Transport interface has no watch() deadlines")
def test_a_watch_deadline_ends_a_collective_whose_peer_is_late():
    outs = launch("deadline", [0, 1], 2, timeout=90, transport_timeout=60)
    said = result(outs[0], "deadline", 0)
    assert said.startswith("TransportTimeout: rank 0: gloo gather in the push of step 3 timed out "
                           "after 1 s"), said
    assert said.endswith("| then: the gloo transport is unusable after an earlier failure"), said


# --- workers (run as `python test_torch_dist_launch.py <scenario>`) ------------------------------

def _worker_collectives(rank: int, size: int) -> str:
    import hvd_slim
    from hvd_slim.optim.rendezvous import torch_transport
    t = torch_transport("gloo", torch.device("cpu"))
    assert (t.name, t.rank, t.size) == ("gloo", rank, size) and not hvd_slim.is_initialized()
    sent = received = 0
    for root in range(size):
        for bound in (None, 4 + size + root):
            payload = np.full(rank + root, rank + 1, dtype=np.uint8)  # sizes differ per rank
            out = t.gather(payload, root, bound=bound)
            frame = (size - 1 + root if bound is None else bound) + 8
            sent += frame + (8 if bound is None else 0)
            if rank == root:
                assert [x.tolist() for x in out] == [[k + 1] * (k + root) for k in range(size)]
                received += size * frame
            else:
                assert out is None
            received += 8 if bound is None else 0
            got = t.broadcast(np.arange(3 + root, dtype=np.uint8) if rank == root else None, root,
                              bound=bound)
            assert got.tolist() == list(range(3 + root))
            moved = (3 + root if bound is None else bound) + 8
            sent += moved if rank == root else 0
            received += moved
    assert (t.stats.bytes_sent, t.stats.bytes_received) == (sent, received), (t.stats, sent, received)
    # density=1.0 equals the dense average, which every worker can compute from all ranks' data.
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3))

    def data(step: int, r: int) -> torch.Tensor:
        return torch.randn(8, 40, generator=torch.Generator().manual_seed(100 * step + r))

    model, ref = make(), make()
    opt = hvd_slim.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), density=1.0,
                                        min_compress_numel=100)  # transport: auto -> gloo
    assert opt.comm_stats()["transport"] == "gloo"
    for step in range(3):
        opt.zero_grad()
        model(data(step, rank)).square().mean().backward()
        opt.step()
        ref.zero_grad()
        for r in range(size):  # gradients add up over the ranks' batches
            (ref(data(step, r)).square().mean() / size).backward()
        with torch.no_grad():
            for w in ref.parameters():
                w -= 0.1 * w.grad
        for p, w in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p, w, atol=1e-6), (step, (p - w).abs().max())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return "ok " + hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _worker_bootstrap(rank: int, size: int) -> str:
    from hvd_slim.optim.rendezvous import torch_transport
    torch_transport("gloo", torch.device("cpu"))
    return "ok"


def _worker_dead_peer(rank: int, size: int) -> str:
    from hvd_slim.optim.rendezvous import torch_transport
    t = torch_transport("gloo", torch.device("cpu"))
    if rank == 1:
        return "exited"  # leaves without ever taking part in the gather
    t.gather(np.zeros(4, dtype=np.uint8), 0, bound=4)
    return "gather completed without its peer"


def _worker_deadline(rank: int, size: int) -> str:
    import time
    from hvd_slim.optim.rendezvous import torch_transport
    t = torch_transport("gloo", torch.device("cpu"))
    if rank == 1:
        time.sleep(4)  # far past rank 0's deadline, well within the group's own timeout
        return "late"
    try:
        with t.watch(1.0, "the push of step 3"):
            t.gather(np.zeros(4, dtype=np.uint8), 0, bound=4)
        return "gather completed without its peer"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        first = f"{type(exc).__name__}: {exc}"
    try:
        t.broadcast(np.zeros(1, dtype=np.uint8), 0)
        return first + " | then: a broken transport was reused"
    except Exception as exc:  # noqa: BLE001
        return first + " | then: " + str(exc).split(" (")[0].split(": ", 1)[1]


def worker_main(scenarios: Dict[str, object], with_traceback: bool = False) -> None:
    """A launched worker: run ``_worker_<argv[1]>`` from ``scenarios`` (a module's globals) as
    rank RANK of WORLD_SIZE and print its one-line result (or its exception) for the test."""
    scenario = sys.argv[1]
    me, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        line = scenarios[f"_worker_{scenario}"](me, world)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks the message
        line = f"{type(exc).__name__}: {exc}"
        if with_traceback:
            import traceback
            line += f" {traceback.format_exc()[-800:]}"
        line = line.replace("\n", " ")
    print(f"worker {scenario} rank {me}: {line}", flush=True)
    os._exit(0)  # skip interpreter teardown: a half-built process group may block at exit


if __name__ == "__main__":
    worker_main(globals())
