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

    fp8 (e4m3), per block of (bn, bk) weights, as FP8 checkpoints store it:
        qweight float8_e4m3fn [N, K]    w[n, k] = float(qweight[n, k]) * scales[n // bn, k // bk]
        scales  float32 [ceil(N / bn), ceil(K / bk)]
        per output channel: block (1, K); per tensor: block (N, K); the last block of a row or
        column may be partial

K must be a multiple of group_size, and group_size even. Checkpoints in other layouts (AWQ,
GPTQ, compressed-tensors) are repacked into these at load time, so one set of kernels serves all;
FP8 checkpoints keep their codes and scales as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


A8_BLOCK = 32  # x's columns sharing one scale d in the GPU's x int8 GEMVs
A8_COLUMNS, A8_PAIRS, A8_HALVES = 0, 1, 2
"""Orders of x's int8 codes in a block's eight words, for the GPU's x int8 GEMVs
(`quant_triton.quantize_a8`), each the order in which a kernel's weight words give their codes:
half h (words 4h .. 4h + 3), word w, byte j holds column 32b + 16h + 4w + j (COLUMNS: int8
weights), 8w + 2j + h (PAIRS: int4, the bytes' low nibbles then their high ones) or 8w + 4h + j
(HALVES: MXFP4, a word's nibbles 0-3 then 4-7)."""


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


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """float(code) * its block's scale in float32 (exact for e4m3 codes and 16-bit scales), rounded
    once to `dtype`; the scales broadcast over a view of the weight (no [N, K] copy of them)."""
    n, k = qweight.shape
    bn, bk = block
    w = qweight.float()  # [N, K]
    s = scales.float().repeat_interleave(bn, dim=0)[:n]  # [N, ceil(K / bk)]: one row per output
    full, rest = divmod(k, bk)
    w[:, :full * bk].view(n, full, bk).mul_(s[:, :full, None])
    if rest:
        w[:, full * bk:].mul_(s[:, full:])
    return w.to(dtype)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T (+ bias) -> [..., N] in x's dtype."""
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype), bias)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T (+ bias) -> [..., N] in x's dtype."""
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype), bias)


def linear_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K]^T (+ bias) -> [..., N] in x's dtype."""
    return F.linear(x, dequantize_fp8(qweight, scales, block, x.dtype), bias)


def reference_quantize_a8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes int8 [M, K], d float32 [M, K // 32]): code = floor(x * (127 / max |x|) +
    0.5) per block of 32 columns (0 where the block is all zero), d = max |x| / 127."""
    m, k = x.shape
    blocks = x.float().view(m, k // A8_BLOCK, A8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.floor(blocks * inv[..., None] + 0.5).clamp(-127, 127)
    return codes.to(torch.int8).view(m, k), amax / 127.0


def reference_a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the GPU's x int8 kernels (`quant_triton`) compute, in float64: the dequantized weight
    (int4 when zeros are given, else int8) against x's int8 codes times their blocks' d."""
    codes, d = reference_quantize_a8(x.reshape(-1, x.shape[-1]))
    m, k = codes.shape
    x_hat = (codes.double().view(m, k // A8_BLOCK, A8_BLOCK) * d.double()[..., None]).view(m, k)
    weight = (dequantize_int4(qweight, scales, zeros, group_size, torch.float64) if zeros is not None
              else dequantize_int8(qweight, scales, torch.float64))
    out = x_hat @ weight.T
    out = out if bias is None else out + bias.double()
    return out.view(*x.shape[:-1], -1)
