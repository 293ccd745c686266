"""RMSNorm: plain-torch references (CPU path, and the oracle for Triton).

The arithmetic is Hugging Face's, step by step: the statistic in float32, the normalised value
cast back to the input dtype, then multiplied by the weight (in the promoted dtype); Gemma's
(`unit_offset`) multiplies by 1 + weight in float32 and casts last; gpt-oss's (`cast_last`) multiplies
by the weight in float32 and casts last. In float32 the three Llama-style orders agree; in bf16 they
round differently, and greedy output follows the rounding.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             cast_last: bool = False) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim; x: [..., N], weight: [N].
    `unit_offset` (Gemma): (1 + weight) * that, all in float32, cast to x's dtype at the end.
    `cast_last` (gpt-oss): weight * that in float32, cast to x's dtype at the end."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x * (1.0 + weight.float())).to(dtype)
    if cast_last:
        return (weight.float() * x).to(dtype)
    return weight * x.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, unit_offset: bool = False,
                       cast_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add of a decoder layer and the next
    norm in one pass. Out of place."""
    residual = x + residual
    return rms_norm(residual, weight, eps, unit_offset, cast_last), residual
