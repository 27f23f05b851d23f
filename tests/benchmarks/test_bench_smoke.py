"""The benchmark harness end to end in a tiny mode: 2 ranks, plain loopback, a few steps.

It checks that the JSON carries every peer's figures and that hvd_slim's counted bytes equal the
closed form for its density (docs/design.md §2: k fp32 values + header + core indices within
the codec's bound + the dense small tensors), computed here independently of the harness.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.models import tiny_shapes
from hvd_slim.config import default_pull_density

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DENSITIES = (0.1, 0.01, 0.001)
MIN_COMPRESS = 4096          # hvd_slim's default min_compress_numel
EXPLORATION = 0.1            # hvd_slim's default exploration

pytestmark = [
    pytest.mark.mpi,  # starts jobs under mpirun: not in `pytest -m unit`
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun"),
]


def _ef_or_bitmap_bound(d: int, n: int) -> int:
    """Elias-Fano: n*L low bits + a unary high part of n + (d-1 >> L) + 1 bits, L=floor(log2 d/n);
    or a d-bit bitmap; whichever is smaller (README "Push")."""
    low = 0 if d < 2 * n else int(math.floor(math.log2(d / n)))
    ef = math.ceil(n * low / 8) + math.ceil((n + ((d - 1) >> low) + 1) / 8)
    return min(ef, math.ceil(d / 8))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "benchmarks.run", "--ranks", "2", "--net", "loopback",
           "--model", "tiny", "--steps", "3", "--warmup", "2", "--no-isolate",
           "--pingpong-mib", "1", "--densities", ",".join(map(str, DENSITIES)),
           "--out", str(out), "--tag", "smoke", "--timeout", "75"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=85)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for ext in (".md", "_step_time.png", "_bytes.png", "_density.png"):
        assert (out / f"smoke{ext}").stat().st_size > 0
    return json.loads((out / "smoke.json").read_text())


def test_every_peer_has_figures(result):
    names = ["floor", "mpi-allreduce", "horovod", "horovod-fp16", "ddp-allreduce", "ddp-fp16",
             "ddp-powersgd-r1", "ddp-powersgd-r4", "ddp-slim", "ddp-slim-1b", "ddp-slim-1bv",
             "ddp-local4"]
    names += [f"topk-ef@{d:g}" for d in DENSITIES]
    names += [f"hvd_slim-{p}@{d:g}" for d in DENSITIES for p in ("slim", "union")]
    assert list(result["peers"]) == names
    for name, p in result["peers"].items():
        if name.startswith("horovod") and p["status"] == "not installed":
            assert "horovod" in p["error"]
            continue
        assert p["status"] == "ok", (name, p)
        assert p["steps_measured"] == 3 and len(p["step_times_s"]) == 3
        assert 0 < p["p10_s"] <= p["median_s"] <= p["p90_s"]
        # a step's cost: the median, or over whole rounds the mean (ddp-local4 runs rounds)
        rounds = 4 if name == "ddp-local4" else 1
        assert p["local_steps"] == rounds, name
        assert p["step_s"] == (p["mean_s"] if rounds > 1 else p["median_s"]), name
        for key in ("bytes_sent_per_step", "bytes_recv_per_step", "select_ms_per_step",
                    "time_vs_dense", "comm_s"):
            assert p[key] is not None and p[key] >= 0, (name, key)
        assert p["basis"]["wire"] in ("counted", "derived") and p["basis"]["note"]
        assert (p["bytes_sent_per_step"] == 0) == (name == "floor")
    assert "command" in result and "benchmarks.run" in result["command"]
    assert result["machine"]["logical_cpus"] and result["machine"]["torch"]
    assert result["network"]["pingpong"]["gbit_per_s"] > 0
    assert result["loadavg_start"] and result["loadavg_end"]


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("pull", ("slim", "union"))
def test_hvd_slim_counted_bytes_match_closed_form(result, density, pull):
    shapes = [math.prod(s) for _, s in tiny_shapes()]
    d = sum(n for n in shapes if n >= MIN_COMPRESS)
    dense = sum(n for n in shapes if n < MIN_COMPRESS)
    k = math.ceil(density * d)
    k_core = k - round(EXPLORATION * k)
    p = result["peers"][f"hvd_slim-{pull}@{density:g}"]
    # 8-byte length word, 32-byte header, a 16-byte table entry per bucket (dense + compressed);
    # dense values are float32, sliced ones one byte each (value_bits=8, the default).
    fixed = 8 + 32 + 2 * 16 + 4 * dense + k
    for rank, (counts, last) in enumerate(zip(p["per_rank_per_step"], p["last_step"])):
        idx = last["push_index_bytes"]
        assert 0 < idx <= _ef_or_bitmap_bound(d, k_core), (rank, idx)
        assert last["push_sparse_value_bytes"] == k
        assert last["push_dense_value_bytes"] == 4 * dense
        assert counts["handed_sent"] == fixed + idx, (rank, counts, fixed, idx)
        if pull == "slim":   # the server's pull: a slice of the default pull density, or
            # (a short pull) every coordinate its residual holds when that is fewer than the
            # slice's core: at 0.001 the two ranks' pushes fill a pull 4x the push only half
            k_pull = math.ceil(default_pull_density(density) * d)
            pulled = last["pull_sparse_value_bytes"]
            assert pulled == k_pull or 0 < pulled < k_pull - round(EXPLORATION * k_pull), pulled
            assert (pulled < k_pull) == (density == 0.001), (density, pulled, k_pull)
            assert counts["handed_recv"] == fixed - k + pulled + last["pull_index_bytes"]
    ring = 2 * (2 - 1) / 2 * (d + dense) * 4
    assert p["ring_allreduce_bytes_per_step"] == pytest.approx(ring)


def test_ranks_per_host_off_the_switched_cluster_names_hosts_by_key_only():
    from benchmarks import run
    args = run.parse_args(["--net", "loopback", "--ranks", "4", "--ranks-per-host", "2"])
    argv = run.mpirun_argv(args, ["hvd_slim-hier@0.01"], "/tmp/out.jsonl", 1, 0, None)
    at = argv.index(sys.executable)
    assert argv[at - 4:at - 2] == ["sh", "-c"] and \
        "HVD_SLIM_HOST_KEY=host$((OMPI_COMM_WORLD_RANK / 2))" in argv[at - 2]
    plain = run.mpirun_argv(run.parse_args(["--net", "loopback"]), ["floor"], "/tmp/o", 1, 0, None)
    assert not any("HVD_SLIM_HOST_KEY" in a for a in plain)
    with pytest.raises(SystemExit):   # argparse's error: 3 ranks are not hosts of 2
        run.parse_args(["--net", "loopback", "--ranks", "3", "--ranks-per-host", "2"])


def test_every_rank_records_its_phases_in_every_measured_step(result):
    """The per-step phase seconds the model's push queue reads (rank_phase_steps_s): every
    rank, every measured step, only the server serving (hvd_slim's optimizer and its DDP hook);
    no phases for the other peers. In rounds of local steps (ddp-local4: warm-up 2, measured
    3) only the round's end, the second measured step, exchanges."""
    for name, p in result["peers"].items():
        if not name.startswith(("hvd_slim-", "ddp-slim", "ddp-local")):
            assert "rank_phase_steps_s" not in p, name
            continue
        ranks = p["rank_phase_steps_s"]
        assert len(ranks) == 2 and all(len(r) == p["steps_measured"] for r in ranks), name
        if name.startswith("ddp-local"):
            assert [s["prepare"] > 0 for s in ranks[1]] == [False, True, False], name
            assert [s["serve"] > 0 for s in ranks[0]] == [False, True, False], name
            continue
        assert all(s["prepare"] > 0 and s["apply"] > 0 for r in ranks for s in r), name
        assert all(s["serve"] > 0 for s in ranks[0]) and all(s["serve"] == 0 for s in ranks[1])
