"""SiLU- and GELU-and-multiply of a fused gate/up projection, and the attention output's sigmoid
gate: plain-torch references (CPU path, oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up: [..., 2 * I] holds gate then up. Returns [..., I]."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), in x's dtype (transformers' gated attention, Qwen3.5's: the attention's
    output [T, H, D] times its gate, a strided view of q_proj's rows)."""
    return x * torch.sigmoid(gate)


def add_sigmoid_gated(base: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate) * x, each op rounded to x's dtype (transformers' shared expert of
    Qwen3.5-MoE and Qwen3-Next: the routed experts' sum plus the shared expert's output scaled by
    its per-token gate). base and x [T, H]; gate [T, 1]."""
    return base + torch.sigmoid(gate) * x


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up (transformers' gelu_pytorch_tanh), where gate_up:
    [..., 2 * I] holds gate then up. Returns [..., I]."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh") * gate_up[..., inter:]
