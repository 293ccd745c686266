"""SiLU- and GELU-and-multiply of a fused gate/up projection: plain-torch references (CPU path, oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up: [..., 2 * I] holds gate then up. Returns [..., I]."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up (transformers' gelu_pytorch_tanh), where gate_up:
    [..., 2 * I] holds gate then up. Returns [..., I]."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh") * gate_up[..., inter:]
