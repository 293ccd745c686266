"""Linear layers: the plain-torch references (CPU path, oracle for Triton), and the compositions
whose Triton versions fold a step's neighbouring kernel into the GEMV (`hibana_kernels.fusion`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hibana_kernels import activation, norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N], as `torch.nn.Linear`."""
    return F.linear(x, weight, bias)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual): a decoder layer's residual add, the norm
    after it and the projection after that. Without a residual: (linear(rms_norm(x)), x)."""
    if residual is None:
        return linear(norm.rms_norm(x, norm_weight, eps), weight, bias), x
    normed, residual = norm.fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), residual


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) of a fused [..., 2 * K] gate/up projection: an MLP's down side."""
    return linear(activation.silu_and_mul(gate_up), weight, bias)
