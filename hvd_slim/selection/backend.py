"""Which implementation the selection code runs for a tensor: numpy for CPU tensors (faster on a
CPU, and a CPU tensor's numpy view is free), torch ops for tensors on any other device (so a
GPU's scores, cores and explored indices never go through host memory).

The two give bitwise the same results. ``FORCE_TORCH`` runs the torch code on CPU tensors too:
that is how the device path is tested on a machine without a GPU.
"""
from __future__ import annotations

import torch

FORCE_TORCH = False


def use_torch(t: torch.Tensor) -> bool:
    """Whether selection code should handle ``t`` with torch ops rather than numpy."""
    return FORCE_TORCH or t.device.type != "cpu"
