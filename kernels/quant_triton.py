"""Weight-only quantized linear layers in Triton, same signatures as `hibana_kernels.quant`.

Two kernels, picked by the number of rows:

- a GEMV for decode (up to GEMV_MAX_ROWS rows): as in matmul_triton, the time is the weight's
  bytes over memory bandwidth, now a half (int8) or a quarter (int4) of bf16's. Each program owns
  BLOCK_N output features and streams their packed rows once, dequantizing in registers;
- a GEMM for prefill and verify batches: tiles of x against dequantized weight tiles through
  tl.dot. The grid runs the row tiles of one weight tile together, so the weight still comes
  from memory once and x, the small operand, from the L2.

Both accumulate in float32 and round the output once. The int4 tile is unpacked as

    packed bytes [BLOCK_N, BLOCK_K // 2]     byte j = code(2j) | code(2j + 1) << 4
      -> interleave(low, high) -> codes [BLOCK_N, BLOCK_K]            (k in order)
      -> view [BLOCK_N, BLOCK_K // G, G]: (codes - zeros[:, :, None]) * scales[:, :, None]

so BLOCK_K is a multiple of the group size G, and G a power of two (32, 64, 128 in the
checkpoints we repack; others take the torch reference). int8's per-channel scale is constant
along K and multiplies the finished sum instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hibana_kernels import quant

GEMV_MAX_ROWS = 4  # rows the GEMV takes; more go to the GEMM (a first guess: bench/tune_quant.py)


class GemvTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 INT4: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of weight rows offs_n as float32 [BLOCK_N, BLOCK_K], zero
    outside the weight: int4 dequantized, int8 as raw codes (its scale comes after the sum)."""
    if INT4:
        offs_kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_kp[None, :],
                         mask=n_mask[:, None] & (offs_kp < K // 2)[None, :], other=0)
        codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_mask = n_mask[:, None] & (offs_g < K // GROUP)[None, :]
        g_ptrs = offs_n.to(tl.int64)[:, None] * stride_sn + offs_g[None, :]
        scales = tl.load(s_ptr + g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
        zeros = tl.load(z_ptr + g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
        w = tl.reshape(codes, [BLOCK_N, BLOCK_K // GROUP, GROUP])
        w = (w - zeros[:, :, None]) * scales[:, :, None]
        return tl.reshape(w, [BLOCK_N, BLOCK_K])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & (offs_k < K)[None, :], other=0)
        return codes.to(tl.float32)


@triton.jit
def _finish(acc, s_ptr, b_ptr, offs_n, n_mask, INT4: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [rows, BLOCK_N] with int8's per-channel scale and the bias applied, still float32."""
    if not INT4:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
                 stride_xm, stride_wn, stride_sn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                         BLOCK_N, BLOCK_K, GROUP, INT4)  # [BLOCK_N, BLOCK_K]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    acc = _finish(acc, s_ptr, b_ptr, offs_n, n_mask, INT4, HAS_BIAS)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
                 stride_xm, stride_wn, stride_sn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr,
                 UPCAST: tl.constexpr):
    # axis 0 (fastest) over rows: the programs sharing a weight tile run side by side
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                         BLOCK_N, BLOCK_K, GROUP, INT4)  # [BLOCK_N, BLOCK_K]
        w = w.to(x.dtype)  # 16-bit x: w rounded to x's dtype, as the reference dequantizes
        if UPCAST:  # exact: products of 16-bit floats are exact in float32
            x, w = x.to(tl.float32), w.to(tl.float32)
        # float32 x: exact products ("ieee"), not tf32
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    acc = _finish(acc, s_ptr, b_ptr, offs_n, n_mask, INT4, HAS_BIAS)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def choose_tiles(rows: int, n: int, k: int, group_size: int = 1) -> GemvTiles | GemmTiles:
    """The kernel and its tiles for an [rows, k] x [n, k]^T product (group_size 1: int8).
    First guesses, to be replaced by bench/tune_quant.py's measurements: the GEMV keeps about
    4096 weight elements a row of x in flight; the GEMM's tiles grow with the batch."""
    k_tile = triton.next_power_of_2(k)
    if rows <= GEMV_MAX_ROWS:
        block_k = max(group_size, min(k_tile, 4096 // triton.next_power_of_2(rows)))
        return GemvTiles(block_n=4, block_k=block_k, num_warps=8 if block_k >= 4096 else 4)
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 128 if rows > 64 else 64
    block_k = max(group_size, 16, min(k_tile, 64))  # tl.dot takes tiles of 16 and up
    return GemmTiles(block_m, block_n, block_k, num_warps=8 if block_m * block_n >= 128 * 128 else 4,
                     num_stages=3)


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
            tiles: GemvTiles | GemmTiles) -> torch.Tensor:
    """Either kernel on either format; int4 when zeros are given."""
    int4 = zeros is not None
    n = qweight.shape[0]
    k = qweight.shape[1] * 2 if int4 else qweight.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    args = (x2, qweight, scales, zeros.contiguous() if int4 else scales,
            bias if bias is not None else scales, y, m, n, k,
            x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0))
    consts = dict(GROUP=group_size if int4 else 1, INT4=int4, HAS_BIAS=bias is not None)
    if isinstance(tiles, GemvTiles):
        _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
            *args, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=1, **consts)
    else:
        _gemm_kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
            *args, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **consts,
            # Triton's interpreter (CPU tensors) gets tl.dot of bf16 tiles wrong (triton 3.9)
            UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16)
    return y.view(*x.shape[:-1], n)


def linear_int8_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None, tiles: GemvTiles | GemmTiles) -> torch.Tensor:
    """linear_int8 with the kernel and tiles chosen by the caller (tests, the tuning script)."""
    return _launch(x, qweight, scales, None, 1, bias, tiles)


def linear_int4_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                       tiles: GemvTiles | GemmTiles) -> torch.Tensor:
    """linear_int4 with the kernel and tiles chosen by the caller (tests, the tuning script)."""
    return _launch(x, qweight, scales, zeros, group_size, bias, tiles)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_int8`."""
    if x.dtype not in _DTYPES:
        return quant.linear_int8(x, qweight, scales, bias)
    n, k = qweight.shape
    tiles = choose_tiles(x.numel() // k if k else 0, n, k)
    return linear_int8_launch(x, qweight, scales, bias, tiles)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_int4`."""
    if x.dtype not in _DTYPES or group_size & (group_size - 1):  # the tile views need 2^i groups
        return quant.linear_int4(x, qweight, scales, zeros, group_size, bias)
    n, k = qweight.shape[0], qweight.shape[1] * 2
    tiles = choose_tiles(x.numel() // k if k else 0, n, k, group_size)
    return linear_int4_launch(x, qweight, scales, zeros, group_size, bias, tiles)
