"""Linear layers: the plain-torch references (CPU path, oracle for Triton), and the compositions
whose Triton versions fold a step's neighbouring kernel into the GEMV (`hibana_kernels.fusion`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hibana_kernels import activation, norm


GLU_ACTIVATIONS = {"silu": activation.silu_and_mul, "gelu_tanh": activation.gelu_tanh_and_mul}
"""The activations a gate/up projection's `glu` names."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           glu: str | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N], as `torch.nn.Linear`; with `glu`
    ("silu", "gelu_tanh") the weight is a fused [gate | up] and the result act(gate) * up
    [..., N // 2], an MLP's up side."""
    y = F.linear(x, weight, bias)
    return y if glu is None else GLU_ACTIVATIONS[glu](y)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    glu: str | None = None, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a decoder layer's residual add, the norm
    after it and the projection after that (`glu` as `linear`'s; `unit_offset`: Gemma's norm, by
    1 + weight). Without a residual: (linear(rms_norm(x)), x)."""
    if residual is None:
        return linear(norm.rms_norm(x, norm_weight, eps, unit_offset), weight, bias, glu), x
    normed, residual = norm.fused_add_rms_norm(x, residual, norm_weight, eps, unit_offset)
    return linear(normed, weight, bias, glu), residual


def folds_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether `rms_norm_linear` runs as one launch: never here."""
    return False


def folds_glu(x: torch.Tensor, weight: torch.Tensor, glu: str) -> bool:
    """Whether `linear(x, weight, glu=...)` takes the activation into the GEMV: never here."""
    return False


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) of a fused [..., 2 * K] gate/up projection: an MLP's down side."""
    return linear(activation.silu_and_mul(gate_up), weight, bias)
