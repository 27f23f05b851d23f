"""The language-model task: a small byte-level causal transformer on the CPython standard library.

The corpus is the ``.py`` sources of the running interpreter's standard library (about 13 MB on
CPython 3.11, test suites and site-packages left out), so every machine with Python has it and
nothing is downloaded. Files are sorted by path and split deterministically by a hash of the
path: about 1 in 20 files is validation. The corpus digest (paths and contents) is recorded with
every result, because another Python version means another corpus.

Training samples are non-overlapping windows of ``context + 1`` bytes of the concatenated
training files; validation is a fixed, evenly spread set of windows of the validation files.
The metric is validation loss in bits per byte (lower is better).
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

# Directories of the standard library that are not "the library": test suites (most of the
# bytes, and mostly generated data) and third-party packages.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
VAL_EVERY = 20  # about 1 file in VAL_EVERY goes to validation


@dataclass(frozen=True)
class Corpus:
    """The split corpus: training and validation bytes and what identifies them."""

    train: torch.Tensor          # uint8, the training files concatenated
    val: torch.Tensor            # uint8, the validation files concatenated
    digest: str                  # sha256 over (path, content) of every file, both splits
    files: Tuple[int, int]       # (training files, validation files)
    root: str

    def describe(self) -> Dict[str, object]:
        return {"corpus_sha256": self.digest, "train_bytes": int(self.train.numel()),
                "val_bytes": int(self.val.numel()), "train_files": self.files[0],
                "val_files": self.files[1], "stdlib": self.root}


def stdlib_files(root: str) -> List[str]:
    """The standard library's ``.py`` files under ``root`` as sorted relative paths."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        rel = os.path.relpath(folder, root)
        out += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return sorted(out)


def is_validation(path: str) -> bool:
    """The split of one file, from a hash of its relative path (stable across machines)."""
    return hashlib.sha256(path.encode()).digest()[0] % VAL_EVERY == 0


def load_corpus(root: str | None = None) -> Corpus:
    """Read and split the corpus (the running interpreter's standard library by default)."""
    root = root or sysconfig.get_paths()["stdlib"]
    h = hashlib.sha256()
    parts: Dict[bool, List[bytes]] = {False: [], True: []}
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        h.update(rel.encode() + b"\0" + data + b"\0")
        parts[is_validation(rel)].append(data)
    if not parts[False] or not parts[True]:
        raise FileNotFoundError(f"no standard-library sources to split under {root!r}")

    def joined(chunks: List[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    return Corpus(joined(parts[False]), joined(parts[True]), h.hexdigest(),
                  (len(parts[False]), len(parts[True])), root)


class Windows(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: ``(x, y)`` = bytes and next bytes."""

    def __init__(self, data: torch.Tensor, context: int) -> None:
        self.data, self.context = data, context
        self.n = (data.numel() - 1) // context

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.context:(i + 1) * self.context + 1].long()
        return chunk[:-1], chunk[1:]


def validation_windows(data: torch.Tensor, context: int, count: int) -> Tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """``count`` windows spread evenly over the validation bytes, as ``(x, y)`` batches."""
    starts = torch.linspace(0, data.numel() - context - 2, count).long()
    chunks = torch.stack([data[s:s + context + 1].long() for s in starts.tolist()])
    return chunks[:, :-1], chunks[:, 1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    """A causal transformer over bytes: embedding (256 x width), learned positions, ``layers``
    blocks, a final norm and an untied output layer. The defaults have about 1.3M parameters."""

    def __init__(self, context: int = 128, width: int = 128, layers: int = 6,
                 heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual outputs
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats)."""
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def evaluate_bpb(hvd: ModuleType, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 batch: int = 64) -> float:
    """Validation loss in bits per byte; each rank scores a disjoint slice of the windows."""
    model.eval()
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(xs), batch):
            logits = model(xs[i:i + batch])
            total += float(F.cross_entropy(logits.flatten(0, 1), ys[i:i + batch].flatten(),
                                           reduction="sum"))
    sums = hvd.allreduce(torch.tensor([total, float(ys.numel())], dtype=torch.float64),
                         op=hvd.Sum)
    model.train()
    return float(sums[0]) / float(sums[1]) / math.log(2)
