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
import torch.nn.functional as F
import triton
import triton.language as tl

from hibana_kernels import quant

GEMV_MAX_ROWS = 4  # rows the GEMV takes; more go to the GEMM (a first guess: bench/tune_quant.py)
DEQUANT_MIN_ROWS = 128  # from here on: dequantize to x's dtype, then cuBLAS (compute-bound)

# Codes become floats without the integer-to-float conversion instruction (a quarter of the
# float rate: at int4's 8 codes per 4 bytes it, not memory, would bound the GEMV). An integer
# 0 <= v < 2^23 or'ed into the bits of 2^23 is the float 2^23 + v exactly; one subtraction
# leaves v. For the tensor-core GEMV, the same in 16 bits: 0x4300 | c is bf16 128 + c and
# 0x6400 | c is fp16 1024 + c (c < 128), the offset taken out after the dot through sum(x).
_MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}  # bits, value


class GemvTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    dot: bool = False  # int4 at 16-bit x: tensor cores (tl.dot, rows padded to 16) take the sum


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _as_float(v):
    """Integers 0 <= v < 2^23 (int32) as float32, exactly, without I2F."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _gemv_int8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    """y[:, n] = scale[n] * sum_k x[:, k] * code[n, k]: BLOCK_N rows of codes per program,
    streamed in BLOCK_K-wide tiles; the scale multiplies the finished sum."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        codes = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        w = _as_float(codes.to(tl.int32) + 128) - 128.0  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP: tl.constexpr, DOT: tl.constexpr, MAGIC: tl.constexpr,
                      OFFSET: tl.constexpr, UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[:, n] = sum over groups g of scale[n, g] * (sum_{k in g} x[:, k] * code[n, k]
    - zero[n, g] * sum_{k in g} x[:, k]): per element only the code's conversion and one
    multiply-add; scale and zero once a group. A group's bytes hold its even codes in the low
    nibbles and its odd ones in the high: they meet the even and odd columns of x, so no
    interleaving of the codes. BLOCK_K is a whole number of groups, unrolled.

    DOT: the group sums on tensor cores, the codes as 16-bit floats 128 + c (bf16) or 1024 + c
    (fp16) against x padded to BLOCK_M >= 16 rows, the offset taken out through sum(x); products
    of 16-bit floats are exact in the float32 accumulator. UPCAST: the same in float32 "ieee"
    (Triton's interpreter gets tl.dot of 16-bit tiles wrong)."""
    HALF: tl.constexpr = GROUP // 2
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_h = tl.arange(0, HALF)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    sz_rows = offs_n.to(tl.int64) * stride_sn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):
            kg = k0 + g * GROUP  # the group's first column; K is a whole number of groups
            k_even = kg + 2 * offs_h
            h_mask = k_even < K  # the whole group is in or out
            packed = tl.load(w_rows + (kg // 2 + offs_h)[None, :], mask=n_mask[:, None] & h_mask[None, :],
                             other=0)  # uint8 [BLOCK_N, HALF]
            x_even = tl.load(x_rows + k_even[None, :], mask=m_mask[:, None] & h_mask[None, :], other=0.0)
            x_odd = tl.load(x_rows + (k_even + 1)[None, :], mask=m_mask[:, None] & h_mask[None, :],
                            other=0.0)  # [BLOCK_M, HALF]
            g_mask = n_mask & (offs_n * 0 + kg < K)
            scale = tl.load(s_ptr + sz_rows + kg // GROUP, mask=g_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + sz_rows + kg // GROUP, mask=g_mask, other=0.0).to(tl.float32)
            x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)  # [BLOCK_M]
            if DOT:
                p16 = packed.to(tl.uint16)
                low = ((p16 & 0xF) | MAGIC).to(x_ptr.dtype.element_ty, bitcast=True)
                high = ((p16 >> 4) | MAGIC).to(x_ptr.dtype.element_ty, bitcast=True)
                x_even, x_odd = tl.trans(x_even), tl.trans(x_odd)  # [HALF, BLOCK_M]
                if UPCAST:
                    part = (tl.dot(low.to(tl.float32), x_even.to(tl.float32), input_precision="ieee")
                            + tl.dot(high.to(tl.float32), x_odd.to(tl.float32), input_precision="ieee"))
                else:
                    part = tl.dot(low, x_even) + tl.dot(high, x_odd)  # [BLOCK_N, BLOCK_M]
                acc += scale[:, None] * (part - (zero + OFFSET)[:, None] * x_sum[None, :])
            else:
                p32 = packed.to(tl.int32)
                low = _as_float(p32 & 0xF)
                high = _as_float(p32 >> 4)
                part = tl.sum(x_even.to(tl.float32)[:, None, :] * low[None, :, :]
                              + x_odd.to(tl.float32)[:, None, :] * high[None, :, :], axis=2)
                acc += scale[None, :] * (part - zero[None, :] * x_sum[:, None])  # [BLOCK_M, BLOCK_N]
    if DOT:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       INT4: tl.constexpr):
    """The weight as out's dtype [N, K], rounded once from float32 as the references do."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = _weight_tile(w_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                     BLOCK_N, BLOCK_K, GROUP, INT4)
    if not INT4:
        w *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


def choose_tiles(rows: int, n: int, k: int, group_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16) -> GemvTiles | GemmTiles | None:
    """The kernel and its tiles for an [rows, k] x [n, k]^T product (group_size 1: int8), or
    None from DEQUANT_MIN_ROWS rows on (dequantize, then cuBLAS). First guesses, to be replaced
    by bench/tune_quant.py's measurements."""
    if rows >= DEQUANT_MIN_ROWS:
        return None
    k_tile = triton.next_power_of_2(k)
    if rows <= GEMV_MAX_ROWS:
        if group_size == 1:  # int8: about 4096 codes a row of x in flight
            block_k = min(k_tile, 4096 // triton.next_power_of_2(rows))
            return GemvTiles(block_n=4, block_k=block_k, num_warps=8 if block_k >= 4096 else 4)
        if dtype in _MAGIC16 and group_size >= 32:
            return GemvTiles(block_n=64, block_k=max(group_size, min(k_tile, 256)), num_warps=4, dot=True)
        return GemvTiles(block_n=8, block_k=max(group_size, min(k_tile, 1024)), num_warps=4)
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    block_n = 128 if rows > 64 else 64
    block_k = max(group_size, 16, min(k_tile, 64))  # tl.dot takes tiles of 16 and up
    return GemmTiles(block_m, block_n, block_k, num_warps=8 if block_m * block_n >= 128 * 128 else 4,
                     num_stages=3)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (int4 when zeros are given), equal to the references'
    `dequantize_int8` / `dequantize_int4`."""
    int4 = zeros is not None
    n = qweight.shape[0]
    k = qweight.shape[1] * 2 if int4 else qweight.shape[1]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 16, max(group_size if int4 else 1, 256)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if int4 else scales, out, n, k, qweight.stride(0), scales.stride(0),
        out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group_size if int4 else 1, INT4=int4,
        num_warps=4)
    return out


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
            tiles: GemvTiles | GemmTiles | None) -> torch.Tensor:
    """Any of the three paths on either format; int4 when zeros are given."""
    int4 = zeros is not None
    n = qweight.shape[0]
    k = qweight.shape[1] * 2 if int4 else qweight.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    zeros = zeros.contiguous() if int4 else None
    if tiles is None:
        return F.linear(x, dequantize(qweight, scales, zeros, group_size, x.dtype), bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    bias_arg = bias if bias is not None else scales
    if isinstance(tiles, GemvTiles) and not int4:
        _gemv_int8_kernel[(triton.cdiv(n, tiles.block_n),)](
            x2, qweight, scales, bias_arg, y, m, n, k, x2.stride(0), qweight.stride(0), y.stride(0),
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            HAS_BIAS=bias is not None, num_warps=tiles.num_warps, num_stages=1)
    elif isinstance(tiles, GemvTiles):
        dot = tiles.dot and x.dtype in _MAGIC16 and group_size >= 32
        magic, offset = _MAGIC16.get(x.dtype, (0, 0.0))
        _gemv_int4_kernel[(triton.cdiv(n, tiles.block_n),)](
            x2, qweight, scales, zeros, bias_arg, y, m, n, k,
            x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            BLOCK_M=max(16, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m),
            BLOCK_N=max(16, tiles.block_n) if dot else tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP=group_size, DOT=dot, MAGIC=magic, OFFSET=offset, UPCAST=x.device.type == "cpu",
            HAS_BIAS=bias is not None, num_warps=tiles.num_warps, num_stages=1)
    else:
        _gemm_kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
            x2, qweight, scales, zeros if int4 else scales, bias_arg, y, m, n, k,
            x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP=group_size if int4 else 1, INT4=int4, HAS_BIAS=bias is not None,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            # Triton's interpreter (CPU tensors) gets tl.dot of bf16 tiles wrong (triton 3.9)
            UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16)
    return y.view(*x.shape[:-1], n)


def linear_int8_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None, tiles: GemvTiles | GemmTiles | None) -> torch.Tensor:
    """linear_int8 with the kernel and tiles chosen by the caller (tests, the tuning script)."""
    return _launch(x, qweight, scales, None, 1, bias, tiles)


def linear_int4_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                       tiles: GemvTiles | GemmTiles | None) -> torch.Tensor:
    """linear_int4 with the kernel and tiles chosen by the caller (tests, the tuning script)."""
    return _launch(x, qweight, scales, zeros, group_size, bias, tiles)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_int8`."""
    if x.dtype not in _DTYPES:
        return quant.linear_int8(x, qweight, scales, bias)
    n, k = qweight.shape
    tiles = choose_tiles(x.numel() // k if k else 0, n, k, 1, x.dtype)
    return linear_int8_launch(x, qweight, scales, bias, tiles)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_int4`."""
    if x.dtype not in _DTYPES or group_size & (group_size - 1):  # the tile views need 2^i groups
        return quant.linear_int4(x, qweight, scales, zeros, group_size, bias)
    n, k = qweight.shape[0], qweight.shape[1] * 2
    tiles = choose_tiles(x.numel() // k if k else 0, n, k, group_size, x.dtype)
    return linear_int4_launch(x, qweight, scales, zeros, group_size, bias, tiles)
