"""Weight-only quantized linear layers: the plain-torch references (CPU path, oracle for Triton).

Two packed layouts, both row-major over the output features like `nn.Linear.weight` [N, K]:

    int8, per output channel, symmetric:
        qweight int8 [N, K]             w[n, k] = qweight[n, k] * scales[n]
        scales  float32 [N]

    int4, per group of `group_size` inputs along K, asymmetric:
        qweight uint8 [N, K // 2]       two codes a byte: k even in the low nibble, k odd in the high
        scales  float16 [N, K // group_size]
        zeros   float16 [N, K // group_size]   in code units, may be fractional
        w[n, k] = (code(n, k) - zeros[n, k // group_size]) * scales[n, k // group_size]

K must be a multiple of group_size, and group_size even. Checkpoints in other layouts (AWQ,
GPTQ, compressed-tensors) are repacked into these at load time, so one set of kernels serves all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> the codes as uint8 [N, K], each in [0, 15]."""
    low, high = qweight & 0xF, qweight >> 4
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in [0, 15] (any integer dtype, K even) -> uint8 [N, K // 2]."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_int4(qweight).float()  # [N, K]
    n, k = codes.shape
    grouped = codes.view(n, k // group_size, group_size)
    w = (grouped - zeros.float()[..., None]) * scales.float()[..., None]
    return w.view(n, k).to(dtype)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T (+ bias) -> [..., N] in x's dtype."""
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T (+ bias) -> [..., N] in x's dtype."""
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype), bias)
