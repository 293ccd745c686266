"""Linear layers: the plain-torch reference (CPU path, oracle for Triton)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N], as `torch.nn.Linear`."""
    return F.linear(x, weight, bias)
