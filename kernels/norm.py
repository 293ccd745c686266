"""RMSNorm: plain-torch references (CPU path, and the oracle for Triton).

The arithmetic is Hugging Face's, step by step: the statistic in float32, the normalised value
cast back to the input dtype, then multiplied by the weight (in the promoted dtype).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim; x: [..., N], weight: [N]."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add of a decoder layer and the next
    norm in one pass. Out of place."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
