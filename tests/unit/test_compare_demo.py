"""scripts/compare_demo.py: two `make demo` outputs match on accuracies and byte counts, whatever
their timing columns and progress bars say, and a changed figure is named with both values."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts real processes: not in `pytest -m unit`

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_demo.py"

DEMO = """\
dense epoch 1/1: 100%|##########| 235/235 [00:10<00:00]\rslim-dp epoch 1/1:  50%|#####
MNIST, 4 ranks, 60000 training images, 1 epoch(s), batch 64/rank, lr 0.05; bytes are rank 0's, per optimizer step; network: switched cluster, 4 hosts with one 1gbit NIC each

| method | density | test acc. (%) | steps | pushed B/step | pulled B/step | dense B/step | dense/pushed | train s | ms/step |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| dense | 1 | 98.13 | 235 | 861,552 | 861,552 | 861,480 | 1.0x | 10.1 | 43 |
| slim-dp | 0.01 | 97.15 | 235 | 18,180 | 18,180 | 861,480 | 47.4x | 11.4 | 49 |
"""


def run(tmp_path: Path, first: str, second: str) -> subprocess.CompletedProcess:
    (tmp_path / "a.txt").write_text(first, encoding="utf-8")
    (tmp_path / "b.txt").write_text(second, encoding="utf-8")
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a.txt"),
                           str(tmp_path / "b.txt")], capture_output=True, text=True, timeout=60)


def test_equal_figures_match_whatever_the_timing(tmp_path):
    other = DEMO.replace("| 10.1 | 43 |", "| 31.7 | 135 |").replace(
        "[00:10<00:00]", "[00:31<00:00]").replace(
        "switched cluster, 4 hosts with one 1gbit NIC each", "loopback (one machine, no NIC)")
    proc = run(tmp_path, DEMO, "Open MPI warning on another line\n" + other)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "match" in proc.stdout
    assert "train s: host 10.1/11.4, image 31.7/11.4" in proc.stdout  # shown, not compared
    assert "ms/step: host 43/49, image 135/49" in proc.stdout


def test_a_changed_accuracy_is_named_with_both_values(tmp_path):
    proc = run(tmp_path, DEMO, DEMO.replace("97.15", "97.40"))
    assert proc.returncode == 1
    assert "row slim-dp: test acc. (%) host 97.15, image 97.40" in proc.stdout
    assert "row dense" not in proc.stdout


def test_byte_counts_caption_and_missing_rows_are_compared(tmp_path):
    changed = (DEMO.replace("18,180 | 18,180", "18,180 | 18,184")
               .replace("4 ranks", "2 ranks"))
    proc = run(tmp_path, DEMO, changed)
    assert proc.returncode == 1
    assert "pulled B/step host 18,180, image 18,184" in proc.stdout
    assert "caption:" in proc.stdout
    dropped = "\n".join(line for line in DEMO.splitlines() if not line.startswith("| dense |"))
    proc = run(tmp_path, DEMO, dropped + "\n")
    assert proc.returncode == 1
    assert "row dense: missing from image's output" in proc.stdout


def test_an_unfinished_demo_says_so(tmp_path):
    proc = run(tmp_path, DEMO, "dense epoch 1/1:  20%|##\nmpirun noticed that process rank 1 exited\n")
    assert proc.returncode == 2
    assert "no demo table" in proc.stderr and "mpirun noticed" in proc.stderr
