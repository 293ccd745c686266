"""Weight-only quantized linear layers in Triton, same signatures as `hibana_kernels.quant`.

Paths, picked by the number of rows and the format:

- int4 with 16-bit inputs on tensor cores, the codes become 16-bit floats in the dots' inputs
  (below): groups of 128-256 through `_int4_words_kernel` up to DEQUANT_MIN_ROWS rows (decode,
  verify and batch steps, 16-64 rows of x a program), groups of 32 and 64 through
  `_int4_dot_kernel` up to GEMV_MAX_ROWS rows;
- a GEMV for decode (up to GEMV_MAX_ROWS rows; int8, float32 inputs, other int4 groups): as in
  matmul_triton, the time should be the weight's bytes over memory bandwidth, now a half (int8)
  or a quarter (int4) of bf16's. At a quarter, arithmetic bounds it unless each code costs very
  little: the I2F instruction runs at a quarter of the float rate, and a reduction across threads
  every step costs more than the step. So the codes are read as int32 words and each becomes the float 1 + code / 2^bits by a
  shift and one logic op (its bits moved into the mantissa of 1.0); the offset leaves the sum
  through sum(x), and int4's scale and zero apply twice a word, not once a code. Products stay
  per column of the tile in float32 until the last step;
- a GEMM for verify batches and short prefill chunks of the other formats: tiles of x against
  dequantized weight tiles through tl.dot. The grid runs the row tiles of one weight tile
  together, so the weight still comes from memory once and x, the small operand, from the L2;
- from DEQUANT_MIN_ROWS rows the product is compute-bound: the weight is dequantized to x's
  dtype once and cuBLAS takes it.

All accumulate in float32 and round the output once. The GEMM unpacks an int4 tile as

    packed bytes [BLOCK_N, BLOCK_K // 2]     byte j = code(2j) | code(2j + 1) << 4
      -> interleave(low, high) -> codes [BLOCK_N, BLOCK_K]            (k in order)
      -> view [BLOCK_N, BLOCK_K // G, G]: (codes - zeros[:, :, None]) * scales[:, :, None]

so BLOCK_K is a multiple of the group size G, and G a power of two (32, 64, 128 in the
checkpoints we repack; others take the torch reference). int8's per-channel scale is constant
along K and multiplies the finished sum instead.

The int4 kernel for 16-bit inputs takes a group a step: its bytes become pairs of 16-bit floats
OFFSET + code (a byte permute, a shift and one logic op per pair: the code moved into the mantissa
of OFFSET, 128 in bf16 and 1024 in fp16, exact), two tensor-core dots take the even and odd
columns against x's, and the group's share is scale * (dots - (OFFSET + zero) * sum(x)). Rows of
x are padded to 16, the dots' smallest tile: at one row the tensor cores idle, the point is that
a code costs one integer operation, not four. Layers with few output tiles split K over programs
(`DotTiles.splits`); each writes its float32 partial sum and the last to arrive adds them in
order (deterministic) and writes the output. `_int4_words_kernel` reads the codes as int32 words
and takes eight dots a group, one per nibble position: its conversion needs no regrouping of
registers (bench/kernel_sass.py counts both): 1.13-1.27x the first's speed on the H200, the default
for groups of 128 and more (with PREFETCH, 256 features a program: `choose_tiles`).

fp8 (e4m3) weights take the same three paths with their own kernels (the last section): codes
become float32 in registers (a hardware conversion from sm_89 on), and a tile is cut into
sub-tiles of SUB columns, each inside one scale block (SUB a power of two dividing the block's
width bk), so a tile needs one scale per row and sub-tile:

    codes [BLOCK_N, BLOCK_K] -> view [BLOCK_N, BLOCK_K // SUB, SUB] * scales[n // bn, (k0 + j SUB) // bk]

One block spanning all of K (per channel, per tensor) multiplies the finished sum instead.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hibana_kernels import counters, pdl, quant
from hibana_kernels.pdl import wait_for_previous

GEMV_MAX_ROWS = 4  # rows the GEMV takes; more go to the GEMM (a first guess: bench/tune_quant.py)
DEQUANT_MIN_ROWS = 128  # from here on: dequantize to x's dtype, then cuBLAS (compute-bound)


class GemvTiles(NamedTuple):
    block_n: int  # output features a program owns
    block_k: int  # columns of K a step (int4: a whole number of groups)
    num_warps: int
    x_vector: bool = False  # int4: a word's 8 inputs in one vector load, its 8 codes in one tensor


class DotTiles(NamedTuple):
    """int4 on tensor cores (16-bit inputs): BLOCK_N output features a program, a group a step,
    K split over `splits` programs (whole groups each); `words`: `_int4_words_kernel` (groups of
    128 or more), else `_int4_dot_kernel`; `prefetch`: the words kernel's PREFETCH; `block_m`:
    rows of x a program takes (16, the dots' smallest, or more for verify and batch steps)."""
    block_n: int
    splits: int
    num_warps: int
    num_stages: int
    words: bool = False
    prefetch: bool = False
    block_m: int = 16


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _unit(words, BIT: tl.constexpr, WIDTH: tl.constexpr):
    """The WIDTH-bit field at bit BIT of int32 `words` as the float32 1 + field / 2^WIDTH,
    exactly: the field moved to the top of the mantissa of 1.0 (a shift and one logic op)."""
    MASK: tl.constexpr = ((1 << WIDTH) - 1) << (23 - WIDTH)
    if BIT <= 23 - WIDTH:
        field = (words << (23 - WIDTH - BIT)) & MASK
    else:
        field = (words >> (BIT - 23 + WIDTH)) & MASK
    return (field | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_units(words):
    """The 8 nibbles of int32 `words` along a new last axis, each as `_unit` makes it (1 + code
    / 16, nibble p from bit 4p): one tensor of shifts where `_unit` takes one nibble at a time."""
    field = ((tl.expand_dims(words, len(words.shape)) >> (4 * tl.arange(0, 8))) << 19) & 0x780000
    return (field | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _as_float(v):
    """Integers 0 <= v < 2^23 (int32) as float32, exactly, without I2F."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _gemv_int8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """y[:, n] = scale[n] * sum_k x[:, k] * code[n, k]: BLOCK_N rows of codes per program,
    streamed in BLOCK_K-wide tiles; the scale multiplies the finished sum."""
    wait_for_previous(PDL)
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
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                      X_VECTOR: tl.constexpr):
    """y[:, n] = sum over groups g of scale[n, g] * sum_{k in g} x[:, k] (code[n, k] - zero[n, g]),
    the codes read as int32 words of eight (nibble p of word i is column 8i + p). As units
    f = 1 + code / 16, a group's share is scale * (16 sum x f - (16 + zero) sum x): per code a
    shift, a logic op and one multiply-add, scale and zero twice a word. Sums stay per word
    column of the tile until the loop ends; BLOCK_K is a whole number of groups, unrolled.
    X_VECTOR: a word's 8 inputs come in one 16-byte load ([.., WORDS, 8]) and its 8 units as one
    tensor of shifts, summed along the 8 inside each thread, where the default loads the inputs of
    nibble p of every word, strided, eight times a group (which of the two is faster is measured
    by bench/tune_quant.py --sweep)."""
    wait_for_previous(PDL)
    WORDS: tl.constexpr = GROUP // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_w = tl.arange(0, WORDS)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    sz_rows = offs_n.to(tl.int64) * stride_sn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N, WORDS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):
            kg = k0 + g * GROUP  # the group's first column; K is a whole number of groups
            w_mask = kg + 8 * offs_w < K  # the whole group is in or out
            words = tl.load(w_rows + (kg // 8 + offs_w)[None, :], mask=n_mask[:, None] & w_mask[None, :],
                            other=0)  # [BLOCK_N, WORDS]
            g_mask = n_mask & (offs_n * 0 + kg < K)
            scale = tl.load(s_ptr + sz_rows + kg // GROUP, mask=g_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + sz_rows + kg // GROUP, mask=g_mask, other=0.0).to(tl.float32)
            if X_VECTOR:
                offs_p = tl.arange(0, 8)
                cols = kg + 8 * offs_w[:, None] + offs_p[None, :]  # [WORDS, 8]
                x8 = tl.load(x_rows[:, :, None] + cols[None, :, :],
                             mask=m_mask[:, None, None] & w_mask[None, :, None], other=0.0).to(tl.float32)
                units = tl.sum(x8[:, None, :, :] * _nibble_units(words)[None, :, :, :], axis=3)  # [M, N, WORDS]
                x_sum = tl.sum(x8, axis=2)
            else:
                units = tl.zeros([BLOCK_M, BLOCK_N, WORDS], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_M, WORDS], dtype=tl.float32)
                for p in tl.static_range(8):
                    x = tl.load(x_rows + (kg + 8 * offs_w + p)[None, :], mask=m_mask[:, None] & w_mask[None, :],
                                other=0.0).to(tl.float32)  # [BLOCK_M, WORDS]
                    units += x[:, None, :] * _unit(words, 4 * p, 4)[None, :, :]
                    x_sum += x
            acc += (16.0 * scale)[None, :, None] * units \
                - (scale * (16.0 + zero))[None, :, None] * x_sum[:, None, :]
    total = tl.sum(acc, axis=2)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             total.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_PAIRS_ASM = """{
    .reg .b32 t<2>;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    lop3.b32 $0, t0, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $1, t1, 0x000F000F, MAGIC, 0xEA;
    shr.b32 t0, t0, 4;
    shr.b32 t1, t1, 4;
    lop3.b32 $2, t0, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $3, t1, 0x000F000F, MAGIC, 0xEA;
}"""  # 4 bytes b3 b2 b1 b0 in $4 -> 00 b1 00 b0 and 00 b3 00 b2 -> each 16-bit half's low nibble
#       (then its high one) | MAGIC's bits (0xEA: a & b | c): OFFSET + code, two a register
_PAIRS_BF16 = tl.constexpr(_PAIRS_ASM.replace("MAGIC", "0x43004300"))  # bf16 128.0 twice
_PAIRS_FP16 = tl.constexpr(_PAIRS_ASM.replace("MAGIC", "0x64006400"))  # fp16 1024.0 twice


@triton.jit
def _int4_pairs(packed, FP16: tl.constexpr, ASM: tl.constexpr):
    """uint8 bytes of two codes (low nibble: the even column) -> (OFFSET + low, OFFSET + high), in
    fp16 (OFFSET 1024) or bf16 (128) through inline PTX (ASM), else in float32 (the interpreter,
    whose 16-bit dots are wrong); exact either way."""
    if ASM:
        if FP16:
            lo, hi = tl.inline_asm_elementwise(_PAIRS_FP16, "=r,=r,=r,=r,r", [packed],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(_PAIRS_BF16, "=r,=r,=r,=r,r", [packed],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        offset = 1024.0 if FP16 else 128.0
        lo = (packed & 0xF).to(tl.float32) + offset
        hi = (packed >> 4).to(tl.float32) + offset
    return lo, hi


@triton.jit
def _group_share(acc, dots, x_sum, s_ptr, z_ptr, sz, n_mask, OFFSET: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus a group's scale * (dots - (OFFSET + zero) * sum x)."""
    scale = tl.load(s_ptr + sz, mask=n_mask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + sz, mask=n_mask, other=0.0).to(tl.float32)
    return acc + scale[:, None] * (dots - (OFFSET + zero)[:, None] * x_sum[None, :])


@triton.jit
def _finish_split(acc, y_ptr, b_ptr, part_ptr, counter_ptr, offs_n, offs_m, n_mask, m_mask, M, N, stride_ym,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write y^T's tile acc [BLOCK_N, BLOCK_M] (float32) with the bias. With SPLIT, this program's
    sum goes to part_ptr [splits, M, N] and the last program of the output tile to arrive (as the
    split decode attention merges, kernels/counters.py) adds the splits in order and writes y."""
    out_mask = n_mask[:, None] & m_mask[None, :]
    last = True
    if SPLIT:
        pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tl.store(part_ptr + (split * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=out_mask)
        tl.debug_barrier()
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1
        if last:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for other in range(0, tl.num_programs(1)):
                acc += tl.load(part_ptr + (other * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None],
                               mask=out_mask, other=0.0)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _int4_tile(N, M, K, groups_per_split, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """Program (n tile, split, m tile)'s output features and rows with their masks, and its groups
    [first, end)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * groups_per_split
    return offs_n, offs_m, offs_n < N, offs_m < M, first, tl.minimum(first + groups_per_split, K // GROUP)


@triton.jit
def _int4_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, counter_ptr, M, N, K,
                     stride_xm, stride_wn, stride_sn, stride_ym, groups_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                     STAGES: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = sum over groups g of scale[n, g] * (sum_{k in g} x[m, k] (OFFSET + code[n, k])
    - (OFFSET + zero[n, g]) sum_{k in g} x[m, k]), the inner sums on tensor cores ([BLOCK_N, GROUP
    / 2] codes of the even and of the odd columns against x's, padded to BLOCK_M rows). Program
    (n tile, split, m tile) takes groups split * groups_per_split onward (`_finish_split`)."""
    wait_for_previous(PDL)
    HALF: tl.constexpr = GROUP // 2
    OFFSET: tl.constexpr = 1024.0 if FP16 else 128.0
    offs_n, offs_m, n_mask, m_mask, first, end = _int4_tile(N, M, K, groups_per_split, BLOCK_N, BLOCK_M, GROUP)
    offs_j = tl.arange(0, HALF)
    w_tile = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_j[None, :]  # [BLOCK_N, HALF] bytes
    x_even = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + 2 * offs_j[:, None]  # [HALF, BLOCK_M]
    sz_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g in tl.range(first, end, num_stages=STAGES):
        lo, hi = _int4_pairs(tl.load(w_tile + g * HALF, mask=n_mask[:, None], other=0), FP16, ASM)
        xe = tl.load(x_even + g * GROUP, mask=m_mask[None, :], other=0.0)
        xo = tl.load(x_even + g * GROUP + 1, mask=m_mask[None, :], other=0.0)
        x_sum = tl.sum(xe.to(tl.float32), axis=0) + tl.sum(xo.to(tl.float32), axis=0)  # [BLOCK_M]
        if not ASM:
            xe, xo = xe.to(tl.float32), xo.to(tl.float32)
        dots = tl.dot(hi, xo, tl.dot(lo, xe))  # [BLOCK_N, BLOCK_M]
        acc = _group_share(acc, dots, x_sum, s_ptr, z_ptr, sz_rows + g, n_mask, OFFSET)
    _finish_split(acc, y_ptr, b_ptr, part_ptr, counter_ptr, offs_n, offs_m, n_mask, m_mask, M, N, stride_ym,
                  BLOCK_N, BLOCK_M, SPLIT, HAS_BIAS)


_UNITS_ASM = """{
    .reg .b32 t<4>, u<4>;
    prmt.b32 t0, $8, $9, 0x4400;
    prmt.b32 t1, $8, $9, 0x5511;
    prmt.b32 t2, $8, $9, 0x6622;
    prmt.b32 t3, $8, $9, 0x7733;
    shr.b32 u0, t0, 4;
    shr.b32 u1, t1, 4;
    shr.b32 u2, t2, 4;
    shr.b32 u3, t3, 4;
    lop3.b32 $0, t0, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $1, u0, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $2, t1, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $3, u1, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $4, t2, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $5, u2, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $6, t3, 0x000F000F, MAGIC, 0xEA;
    lop3.b32 $7, u3, 0x000F000F, MAGIC, 0xEA;
}"""  # words a ($8) and b ($9): t_j = byte j of a in the low half, of b in the high (selector 4+j 4+j j j);
#       nibble p of both words -> output p: (OFFSET + code p of a, OFFSET + code p of b), the pair the dot
#       wants in one register (consecutive words are consecutive k of output p's tile)
_UNITS_BF16 = tl.constexpr(_UNITS_ASM.replace("MAGIC", "0x43004300"))
_UNITS_FP16 = tl.constexpr(_UNITS_ASM.replace("MAGIC", "0x64006400"))


@triton.jit
def _int4_units(words, FP16: tl.constexpr, ASM: tl.constexpr):
    """int32 words of eight codes (nibble p: column 8i + p) -> eight tensors, tensor p the codes of
    nibble p as OFFSET + code, in fp16 / bf16 through inline PTX (ASM: two words a call, no
    repacking for the dot), else in float32 (the interpreter)."""
    if ASM:
        if FP16:
            units = tl.inline_asm_elementwise(_UNITS_FP16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                              dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        else:
            units = tl.inline_asm_elementwise(_UNITS_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                              dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        offset = 1024.0 if FP16 else 128.0
        units = (((words >> 0) & 0xF).to(tl.float32) + offset, ((words >> 4) & 0xF).to(tl.float32) + offset,
                 ((words >> 8) & 0xF).to(tl.float32) + offset, ((words >> 12) & 0xF).to(tl.float32) + offset,
                 ((words >> 16) & 0xF).to(tl.float32) + offset, ((words >> 20) & 0xF).to(tl.float32) + offset,
                 ((words >> 24) & 0xF).to(tl.float32) + offset, ((words >> 28) & 0xF).to(tl.float32) + offset)
    return units


@triton.jit
def _x_nibbles(xg, m_mask):
    """x's columns 8i + p of a group for p = 0 .. 7 ([WORDS, BLOCK_M] each, from `xg`: the group's
    pointers of p = 0)."""
    return (tl.load(xg + 0, mask=m_mask[None, :], other=0.0), tl.load(xg + 1, mask=m_mask[None, :], other=0.0),
            tl.load(xg + 2, mask=m_mask[None, :], other=0.0), tl.load(xg + 3, mask=m_mask[None, :], other=0.0),
            tl.load(xg + 4, mask=m_mask[None, :], other=0.0), tl.load(xg + 5, mask=m_mask[None, :], other=0.0),
            tl.load(xg + 6, mask=m_mask[None, :], other=0.0), tl.load(xg + 7, mask=m_mask[None, :], other=0.0))


@triton.jit
def _words_dots(words, xs, FP16: tl.constexpr, ASM: tl.constexpr):
    """A group's eight dots of its words against x's columns (`xs`, `_x_nibbles`), and sum x."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    c0, c1, c2, c3, c4, c5, c6, c7 = _int4_units(words, FP16, ASM)
    x_sum = tl.sum(x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32)
                   + x4.to(tl.float32) + x5.to(tl.float32) + x6.to(tl.float32) + x7.to(tl.float32), axis=0)
    if not ASM:
        x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        x4, x5, x6, x7 = x4.to(tl.float32), x5.to(tl.float32), x6.to(tl.float32), x7.to(tl.float32)
    dots = tl.dot(c0, x0)
    dots = tl.dot(c1, x1, dots)
    dots = tl.dot(c2, x2, dots)
    dots = tl.dot(c3, x3, dots)
    dots = tl.dot(c4, x4, dots)
    dots = tl.dot(c5, x5, dots)
    dots = tl.dot(c6, x6, dots)
    dots = tl.dot(c7, x7, dots)
    return dots, x_sum


@triton.jit
def _int4_words_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, counter_ptr, M, N, K,
                       stride_xm, stride_wn, stride_sn, stride_ym, groups_per_split,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                       STAGES: tl.constexpr, FP16: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False):
    """`_int4_dot_kernel` with the codes read as int32 words (stride_wn in words): eight dots a
    group, dot p over the codes of nibble p ([BLOCK_N, GROUP / 8], column 8i + p) against x's
    columns 8i + p. Its conversion is four byte permutes, four shifts and eight logic ops for two
    words, and no repacking into the dots' registers (sm_90 SASS: ~6 instructions a weight byte
    against ~8-12 for the byte kernel's tiles); GROUP of 128 or more (a dot's 16 words).

    The weights' words are pipelined by Triton (asynchronous copies, STAGES deep), but not x's
    columns (two-byte loads, too small for them) nor a group's scales and zeros (two bytes a row):
    their loads are issued in the step that uses them, whose time then holds their latency (sm_90
    SASS at 128 x 4 warps). PREFETCH loads them one group ahead, in registers."""
    wait_for_previous(PDL)
    WORDS: tl.constexpr = GROUP // 8
    OFFSET: tl.constexpr = 1024.0 if FP16 else 128.0
    offs_n, offs_m, n_mask, m_mask, first, end = _int4_tile(N, M, K, groups_per_split, BLOCK_N, BLOCK_M, GROUP)
    offs_w = tl.arange(0, WORDS)
    w_tile = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_w[None, :]  # [BLOCK_N, WORDS]
    x_tile = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + 8 * offs_w[:, None]  # [WORDS, BLOCK_M]
    sz_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PREFETCH:
        xs = _x_nibbles(x_tile + first * GROUP, m_mask)
        scale = tl.load(s_ptr + sz_rows + first, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + sz_rows + first, mask=n_mask, other=0.0).to(tl.float32)
        for g in tl.range(first, end, num_stages=STAGES):
            words = tl.load(w_tile + g * WORDS, mask=n_mask[:, None], other=0)
            ahead = tl.minimum(g + 1, end - 1)  # the next group's x, scales and zeros (the last: again)
            xs_next = _x_nibbles(x_tile + ahead * GROUP, m_mask)
            scale_next = tl.load(s_ptr + sz_rows + ahead, mask=n_mask, other=0.0).to(tl.float32)
            zero_next = tl.load(z_ptr + sz_rows + ahead, mask=n_mask, other=0.0).to(tl.float32)
            dots, x_sum = _words_dots(words, xs, FP16, ASM)
            acc += scale[:, None] * (dots - (OFFSET + zero)[:, None] * x_sum[None, :])
            xs, scale, zero = xs_next, scale_next, zero_next
    else:
        for g in tl.range(first, end, num_stages=STAGES):
            words = tl.load(w_tile + g * WORDS, mask=n_mask[:, None], other=0)
            dots, x_sum = _words_dots(words, _x_nibbles(x_tile + g * GROUP, m_mask), FP16, ASM)
            acc = _group_share(acc, dots, x_sum, s_ptr, z_ptr, sz_rows + g, n_mask, OFFSET)
    _finish_split(acc, y_ptr, b_ptr, part_ptr, counter_ptr, offs_n, offs_m, n_mask, m_mask, M, N, stride_ym,
                  BLOCK_N, BLOCK_M, SPLIT, HAS_BIAS)


# ---------------------------------------------------------- int4 / int8 x int8 (dp4a) at one row
#
# At one row the tensor cores idle, and the float paths above spend 3-6 instructions a weight
# converting codes: the int4 words kernel reads at 26-45% of the copy bandwidth whatever its tiles
# (bench/RESULTS.md, seventeenth session). Here, as llama.cpp's CUDA decode reads its quantized
# weights: x becomes int8 codes in blocks of 32 columns (x ~ d * code, d = max |x| / 127, one
# small kernel a product), and each int32 word of weight codes meets x's codes in integer dot
# products of four (dp4a): an int4 word is two masks, a shift and two dp4a for eight weights, an
# int8 word one dp4a for four. The sums are exact in int32; a block's d and the group's scale and
# zero apply once per 32 weights. Each program reads long runs of a few rows (a warp 512
# contiguous bytes of one row), as the bf16 GEMV does: on the H200 the int4 layers of Qwen3-8B went
# from 25-43% to 44-73% of the copy bandwidth (bench/RESULTS.md, twenty-second session).
#
# The cost is x's rounding to 8 bits a block of 32 (relative error of a layer's output ~0.5% for
# Gaussian x, against ~5-10% for the int4 weight itself); `quant.reference_a8` is the oracle. Rows of
# 16-bit x up to A8_MAX_ROWS take it (decode); batch and verify rows keep x in 16 bits (the
# kernels above), so a sequence's decode and a verify or prefill of the same tokens round
# differently. MXFP4 experts (moe_triton's DecodeTiles.a8) take it on all the rows of their decode
# path (up to moe_triton.DECODE_MAX_TOKENS tokens). HIBANA_A8_ROWS=0 turns both off.

A8_BLOCK, A8_COLUMNS, A8_PAIRS, A8_HALVES = quant.A8_BLOCK, quant.A8_COLUMNS, quant.A8_PAIRS, quant.A8_HALVES


def _a8_rows_setting() -> int:
    """HIBANA_A8_ROWS (read once, when the kernels are imported): rows of 16-bit x that take the
    x int8 GEMV, 0 for none; 1 when unset or not a whole number of 0 or more."""
    value = os.environ.get("HIBANA_A8_ROWS", "1").strip()
    return int(value) if value.isdigit() else 1


A8_MAX_ROWS = _a8_rows_setting()
A8_MAX_BLOCK_M = 8  # rows of x a program takes at most (more: more programs)


class A8GemvTiles(NamedTuple):
    """The int4 / int8 x int8 GEMV: BLOCK_N output features a program, their rows read BLOCK_K
    columns a step (no split of K); block_m rows of x a program (each weight word unpacked once
    for all of them: verify steps and small batches)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    block_m: int = 1


def a8_fits(k: int, group_size: int) -> bool:
    """Whether the x int8 kernels take rows of k columns: whole blocks of x's codes, int8 (group
    size 1) or int4 groups of whole blocks, a power of two."""
    if group_size == 1:
        return k % A8_BLOCK == 0
    return group_size >= A8_BLOCK and group_size & (group_size - 1) == 0 and k % group_size == 0


@triton.jit
def _quantize_a8_kernel(x_ptr, q_ptr, d_ptr, K, stride_xm, BLOCKS: tl.constexpr, ORDER: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (row m, chunk c): x's blocks c * BLOCKS onward in row m as int8 codes, four a word
    from the low byte, q [M, K / 4] int32, block b in words 8b .. 8b + 7 in ORDER (A8_COLUMNS,
    A8_PAIRS, A8_HALVES); and d [M, K / 32, 2] float32: the block's d and d * (sum of its codes)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    quantize_a8_blocks(x_ptr + row * stride_xm, q_ptr + row * (K // 4), d_ptr + row * (K // 16),
                       tl.program_id(1) * BLOCKS, K, BLOCKS, ORDER)


@triton.jit
def quantize_a8_blocks(x_row, q_row, d_row, first, K, BLOCKS: tl.constexpr, ORDER: tl.constexpr):
    """Blocks first .. first + BLOCKS of one row of x (x_row: its first column) as
    `_quantize_a8_kernel` writes them (q_row, d_row: the row's words and (d, d * sum) pairs)."""
    blocks, col = a8_block_columns(first, BLOCKS, ORDER)
    x = tl.load(x_row + col, mask=(blocks < K // 32)[:, None, None, None], other=0.0).to(tl.float32)
    store_a8_blocks(x, blocks, q_row, d_row, K)


@triton.jit
def a8_block_columns(first, BLOCKS: tl.constexpr, ORDER: tl.constexpr):
    """(blocks [BLOCKS], columns [BLOCKS, 2, 4, 4]) of x's blocks first .. first + BLOCKS: the
    column each of a block's 32 codes comes from, in the words' ORDER (A8_COLUMNS, A8_PAIRS,
    A8_HALVES). The kernels that write x (norms, SiLU-and-mul: `rms_norm_a8`, `silu_and_mul_a8`)
    compute their values at these columns and hand them to `store_a8_blocks` as they are."""
    blocks = first + tl.arange(0, BLOCKS)
    half, word, byte = tl.arange(0, 2), tl.arange(0, 4), tl.arange(0, 4)
    if ORDER == 1:
        within = half[:, None, None] + 8 * word[None, :, None] + 2 * byte[None, None, :]
    elif ORDER == 2:
        within = 4 * half[:, None, None] + 8 * word[None, :, None] + byte[None, None, :]
    else:
        within = 16 * half[:, None, None] + 4 * word[None, :, None] + byte[None, None, :]
    return blocks, blocks[:, None, None, None] * 32 + within[None, :, :, :]


@triton.jit
def store_a8_blocks(x, blocks, q_row, d_row, K):
    """x [BLOCKS, 2, 4, 4] float32, the values at `a8_block_columns`' columns, as int8 codes, four
    a word from the low byte (q_row: the row's words, block b in words 8b .. 8b + 7), and each
    block's d and d * (sum of its codes) (d_row); blocks past K / 32 are not written."""
    mask = blocks < K // 32
    half, word, byte = tl.arange(0, 2), tl.arange(0, 4), tl.arange(0, 4)
    amax = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)
    codes = tl.minimum(tl.maximum(tl.floor(x * inv[:, None, None, None] + 0.5), -127.0), 127.0).to(tl.int32)
    words = tl.sum((codes & 0xFF) << (8 * byte[None, None, None, :]), axis=3)  # [BLOCKS, 2, 4]
    tl.store(q_row + blocks[:, None, None] * 8 + half[None, :, None] * 4 + word[None, None, :], words,
             mask=mask[:, None, None])
    # a NaN in a block makes its d NaN (tl.max passes over NaN), so the product is NaN as the 16-bit
    # kernels' is, not that of clamped codes; an inf makes it inf, and 0 codes times inf NaN
    nans = tl.sum(tl.sum(tl.sum((x != x).to(tl.int32), axis=3), axis=2), axis=1)
    d = tl.where(nans > 0, float("nan"), amax / 127.0)
    code_sum = tl.sum(tl.sum(tl.sum(codes, axis=3), axis=2), axis=1).to(tl.float32)
    tl.store(d_row + 2 * blocks, d, mask=mask)
    tl.store(d_row + 2 * blocks + 1, d * code_sum, mask=mask)


_DP4A_NIBBLES_ASM = tl.constexpr("""{
    .reg .b32 lo, hi, t;
    and.b32 lo, $1, 0x0F0F0F0F;
    shr.u32 hi, $1, 4;
    and.b32 hi, hi, 0x0F0F0F0F;
    dp4a.s32.s32 t, lo, $2, 0;
    dp4a.s32.s32 $0, hi, $3, t;
}""")  # word $1 of eight int4 codes: the bytes' low nibbles (even columns) against x's codes $2,
#        the high nibbles (odd columns) against $3


@triton.jit
def _signed_byte(v, J: tl.constexpr):
    return (v << (24 - 8 * J)) >> 24


@triton.jit
def _dp4a_nibbles(words, x_even, x_odd, ASM: tl.constexpr):
    """Sum over a word's eight int4 codes of code * x's code: dp4a through inline PTX (ASM), else
    the same integer sum byte by byte (the interpreter)."""
    if ASM:
        out = tl.inline_asm_elementwise(_DP4A_NIBBLES_ASM, "=r,r,r,r", [words, x_even, x_odd], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        out = tl.zeros(words.shape, tl.int32)
        for j in tl.static_range(4):
            out += ((words >> (8 * j)) & 0xF) * _signed_byte(x_even, j) + ((words >> (8 * j + 4)) & 0xF) * \
                _signed_byte(x_odd, j)
    return out


@triton.jit
def _dp4a(words, x, ASM: tl.constexpr):
    """Sum over a word's four int8 codes of code * x's code (dp4a; byte by byte in the interpreter)."""
    if ASM:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [words, x], dtype=tl.int32,
                                        is_pure=True, pack=1)
    else:
        out = tl.zeros(words.shape, tl.int32)
        for j in tl.static_range(4):
            out += _signed_byte(words, j) * _signed_byte(x, j)
    return out


@triton.jit
def _a8_words(w_rows, k0, offs_b, n_mask, K, WORDS: tl.constexpr):
    """Weight words [BLOCK_N, BLOCKS, WORDS] of blocks k0 / 32 onward (WORDS a block: int4 4, int8 8)."""
    blocks = k0 // 32 + offs_b
    return tl.load(w_rows + WORDS * blocks[None, :, None] + tl.arange(0, WORDS)[None, None, :],
                   mask=n_mask[:, None, None] & (blocks < K // 32)[None, :, None], other=0)


@triton.jit
def _a8_step(q_row, d_row, sz_rows, s_ptr, z_ptr, words, k0, offs_b, n_mask, K, GROUP: tl.constexpr,
             INT4: tl.constexpr, ASM: tl.constexpr):
    """One step's share [BLOCK_N, BLOCKS] of `_a8_gemv_kernel`: columns k0 onward, whose weight
    words `words` are loaded. int4: scale * (d * dots - zero * d * sum of x's codes) per block;
    int8: d * dots (the row's scale multiplies the finished sum)."""
    # x's codes and d loaded for every row of the tile (the same addresses: the L1 serves them), so
    # that they come in the words' layout, not in a narrower one converted through shared memory
    blocks = (k0 // 32 + offs_b)[None, :] + 0 * sz_rows[:, None]  # [BLOCK_N, BLOCKS]
    b_mask = blocks < K // 32
    d = tl.load(d_row + 2 * blocks, mask=b_mask, other=0.0)
    if INT4:
        x_words = q_row + 8 * blocks[:, :, None] + tl.arange(0, 4)[None, None, :]
        x_even = tl.load(x_words, mask=b_mask[:, :, None], other=0)
        x_odd = tl.load(x_words + 4, mask=b_mask[:, :, None], other=0)
        d_sum = tl.load(d_row + 2 * blocks + 1, mask=b_mask, other=0.0)
        groups = sz_rows[:, None] + blocks * 32 // GROUP
        mask = n_mask[:, None] & b_mask
        scale = tl.load(s_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        dots = tl.sum(_dp4a_nibbles(words, x_even, x_odd, ASM), axis=2)
        share = scale * (dots.to(tl.float32) * d - zero * d_sum)
    else:
        x = tl.load(q_row + 8 * blocks[:, :, None] + tl.arange(0, 8)[None, None, :], mask=b_mask[:, :, None], other=0)
        share = tl.sum(_dp4a(words, x, ASM), axis=2).to(tl.float32) * d
    return share


@triton.jit
def _a8_step_rows(q_rows, d_rows, m_mask, sz_rows, s_ptr, z_ptr, words, k0, offs_b, n_mask, K,
                  GROUP: tl.constexpr, INT4: tl.constexpr, ASM: tl.constexpr):
    """`_a8_step` for BLOCK_M rows of x at once (q_rows, d_rows: [BLOCK_M] pointers): the share
    [BLOCK_M, BLOCK_N, BLOCKS], each weight word's nibbles taken apart once for all the rows."""
    blocks = (k0 // 32 + offs_b)[None, :] + 0 * sz_rows[:, None]  # [BLOCK_N, BLOCKS]
    b_mask = blocks < K // 32
    x_mask = m_mask[:, None, None] & b_mask[None, :, :]  # [BLOCK_M, BLOCK_N, BLOCKS]
    d = tl.load(d_rows[:, None, None] + 2 * blocks[None, :, :], mask=x_mask, other=0.0)
    if INT4:
        x_words = q_rows[:, None, None, None] + 8 * blocks[None, :, :, None] + tl.arange(0, 4)[None, None, None, :]
        x_even = tl.load(x_words, mask=x_mask[:, :, :, None], other=0)
        x_odd = tl.load(x_words + 4, mask=x_mask[:, :, :, None], other=0)
        d_sum = tl.load(d_rows[:, None, None] + 2 * blocks[None, :, :] + 1, mask=x_mask, other=0.0)
        groups = sz_rows[:, None] + blocks * 32 // GROUP
        mask = n_mask[:, None] & b_mask
        scale = tl.load(s_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        low, high = (words & 0x0F0F0F0F)[None], ((words >> 4) & 0x0F0F0F0F)[None]  # even, odd columns' codes
        dots = tl.sum(_dp4a(low, x_even, ASM) + _dp4a(high, x_odd, ASM), axis=3)
        share = scale[None] * (dots.to(tl.float32) * d - zero[None] * d_sum)
    else:
        x = tl.load(q_rows[:, None, None, None] + 8 * blocks[None, :, :, None] + tl.arange(0, 8)[None, None, None, :],
                    mask=x_mask[:, :, :, None], other=0)
        share = tl.sum(_dp4a(words[None], x, ASM), axis=3).to(tl.float32) * d
    return share


@triton.jit
def _a8_gemv_kernel(q_ptr, d_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_qm, stride_dm,
                    stride_wn, stride_sn, stride_ym,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr,
                    STAGES: tl.constexpr, ASM: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
                    BLOCK_M: tl.constexpr = 1):
    """y[m, n] = sum over x's blocks b of d_b * sum_{k in b} w[n, k] xcode[m, k], w the int4 or int8
    weight (int4: (code - zero) * scale per group, the zero's share through d_b * sum of the block's
    x codes; int8: the row's scale once at the end). Program (n tile, row m) streams its BLOCK_N
    rows BLOCK_K columns a step (a thread one block of 32 a row: 16 or 32 bytes of weight words),
    sums [BLOCK_N, BLOCK_K / 32] per block to the end, then across them once. The first step's
    words are loaded before the wait for the previous kernel (PDL: weights are no kernel's
    output); stride_wn in int32 words, x's codes and d from `_quantize_a8_kernel`. BLOCK_M > 1:
    program (n tile, m tile) takes BLOCK_M rows of x against the weight words it reads once
    (`_a8_step_rows`)."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    WORDS: tl.constexpr = 4 if INT4 else 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_b = tl.arange(0, BLOCKS)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn
    sz_rows = offs_n.to(tl.int64) * stride_sn
    words = _a8_words(w_rows, 0, offs_b, n_mask, K, WORDS)
    wait_for_previous(PDL)
    if BLOCK_M == 1:
        row = tl.program_id(1).to(tl.int64)
        q_row = q_ptr + row * stride_qm  # (K / 4 and K / 16 as arguments: their divisibility is known)
        d_row = d_ptr + row * stride_dm
        acc = _a8_step(q_row, d_row, sz_rows, s_ptr, z_ptr, words, 0, offs_b, n_mask, K, GROUP, INT4, ASM)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            acc += _a8_step(q_row, d_row, sz_rows, s_ptr, z_ptr, _a8_words(w_rows, k0, offs_b, n_mask, K, WORDS), k0,
                            offs_b, n_mask, K, GROUP, INT4, ASM)
        out = tl.sum(acc, axis=1)
        if not INT4:
            out *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        q_rows = q_ptr + offs_m.to(tl.int64) * stride_qm
        d_rows = d_ptr + offs_m.to(tl.int64) * stride_dm
        acc = _a8_step_rows(q_rows, d_rows, m_mask, sz_rows, s_ptr, z_ptr, words, 0, offs_b, n_mask, K, GROUP, INT4,
                            ASM)
        for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            acc += _a8_step_rows(q_rows, d_rows, m_mask, sz_rows, s_ptr, z_ptr,
                                 _a8_words(w_rows, k0, offs_b, n_mask, K, WORDS), k0, offs_b, n_mask, K, GROUP, INT4,
                                 ASM)
        out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        if not INT4:
            out *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


A8_QUANT_BLOCKS = 16  # blocks of x a `_quantize_a8_kernel` program takes


def quantize_a8(x2: torch.Tensor, order: int = A8_PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32, unit stride along it) -> (q int32 [M, K / 4], d float32
    [M, K / 32, 2]) as `_quantize_a8_kernel` packs them, codes in `order` (A8_PAIRS: int4's)."""
    m, k = x2.shape
    q, d = a8_codes(m, k, x2.device)
    grid = (m, triton.cdiv(k // A8_BLOCK, A8_QUANT_BLOCKS))
    _quantize_a8_kernel[grid](x2, q, d, k, x2.stride(0), BLOCKS=A8_QUANT_BLOCKS, ORDER=order, num_warps=4,
                              **pdl.launch_args(x2.device, "other", grid[0] * grid[1]))
    return q, d


def a8_codes(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (q, d) for m rows of k columns of x's codes, as `quantize_a8` returns them."""
    return (torch.empty((m, k // 4), dtype=torch.int32, device=device),
            torch.empty((m, k // A8_BLOCK, 2), dtype=torch.float32, device=device))


def takes_a8(x: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether `linear_int8` (group_size 1) / `linear_int4` would take the rows of x (a tensor of
    the step's rows: x itself, or what x is made from) as k-wide input through the x int8 GEMV
    (choose_tiles' rule): then a kernel writing x may hand its codes over (`linear_a8`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.device.type == "cuda" and rows > 0 and isinstance(
        choose_tiles(rows, 1, k, group_size, x.dtype, counters.sm_count(x.device)), A8GemvTiles)


def linear_a8(q: torch.Tensor, d: torch.Tensor, lead: tuple[int, ...], dtype: torch.dtype, qweight: torch.Tensor,
              scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_int8` / `linear_int4` (int4 when zeros are given) of x given as its int8 codes (q, d
    in the weight's order: A8_PAIRS for int4, A8_COLUMNS for int8), [*lead, N] in `dtype`."""
    m, n = q.shape[0], qweight.shape[0]
    k = q.shape[1] * 4
    y = torch.empty((m, n), dtype=dtype, device=q.device)
    if m == 0 or n == 0:
        return y.view(*lead, n)
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    tiles = choose_tiles(m, n, k, group_size if zeros is not None else 1, dtype, counters.sm_count(q.device))
    if not isinstance(tiles, A8GemvTiles):
        raise ValueError(f"{m} rows of {k} columns do not take the x int8 GEMV (see takes_a8)")
    _a8_gemv_codes(q, d, qweight, scales, zeros, group_size, bias, tiles, y)
    return y.view(*lead, n)


def _a8_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_size: int, bias: torch.Tensor | None, tiles: A8GemvTiles, y: torch.Tensor) -> None:
    q, d = quantize_a8(x2, A8_PAIRS if zeros is not None else A8_COLUMNS)
    _a8_gemv_codes(q, d, qweight, scales, zeros, group_size, bias, tiles, y)


def _a8_gemv_codes(q: torch.Tensor, d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, group_size: int, bias: torch.Tensor | None, tiles: A8GemvTiles,
                   y: torch.Tensor) -> None:
    m, n = y.shape
    int4 = zeros is not None
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m))
    _a8_gemv_kernel[grid](
        q, d, qweight.view(torch.int32), scales, zeros if int4 else scales, bias if bias is not None else scales, y,
        m, n, q.shape[1] * 4, q.stride(0), d.stride(0), qweight.view(torch.int32).stride(0), scales.stride(0),
        y.stride(0), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP=group_size, INT4=int4,
        STAGES=tiles.num_stages, ASM=y.device.type == "cuda", HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m,
        num_warps=tiles.num_warps, **pdl.launch_args(y.device, "gemv", grid[0] * grid[1]))


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


def gemv_fits(k: int, group_size: int = 1) -> bool:
    """Whether the GEMV takes rows of k columns: int4 groups of whole int32 words (8 codes), a
    power of two (the tiles' aranges); int8 takes any."""
    return group_size == 1 or group_size >= 8 and group_size & (group_size - 1) == 0


DOT_PROGRAMS_PER_SM = 2.5  # splits of K until the grid has this many programs an SM


WORDS_MIN_GROUP = 128  # `_int4_words_kernel` takes a group's words 16 bytes a row at least
WORDS_PROGRAMS_PER_SM = 0.95  # its K splits: until the grid has about a program an SM


def _splits(tiles: int, groups: int, programs: float, least: int = 1) -> int:
    """Splits of K (a power of two, none empty) until `tiles` output tiles make `programs`
    programs, and `least` splits where there are groups enough."""
    splits = 1
    while (tiles * splits < programs or splits < least) and splits * 2 <= groups:
        splits *= 2
    return splits


DOT_MAX_GROUP = 256  # a group is one step's tile: larger ones spill registers (512: 80 B a thread)


def dot_fits(k: int, group_size: int) -> bool:
    """Whether the int4 tensor-core kernels take rows of k columns: groups of 32 to DOT_MAX_GROUP
    columns (a dot's 16 columns of each parity; one group a step), a power of two, K a whole
    number of groups. Per-channel int4 (one group of K) takes the GEMV."""
    return 32 <= group_size <= DOT_MAX_GROUP and group_size & (group_size - 1) == 0 and k % group_size == 0


def choose_tiles(rows: int, n: int, k: int, group_size: int = 1, dtype: torch.dtype | None = None,
                 sms: int = 132) -> GemvTiles | DotTiles | A8GemvTiles | GemmTiles | None:
    """The kernel and its tiles for an [rows, k] x [n, k]^T product (group_size 1: int8) with x
    of `dtype` on a device of `sms` multiprocessors (`counters.sm_count`; the H200's by default:
    it sizes the int4 tensor-core kernels' K splits), or None from DEQUANT_MIN_ROWS rows on
    (dequantize, then cuBLAS). From bench/tune_quant.py's measurements on the H200 where it
    says so, first guesses elsewhere."""
    if rows >= DEQUANT_MIN_ROWS:
        return None
    if rows <= A8_MAX_ROWS and dtype in (torch.bfloat16, torch.float16) and a8_fits(k, group_size):
        # int4, Qwen3-8B's layers on the H200 (`tune_quant.py --a8`, bench/RESULTS.md,
        # twenty-second session): 2 output features a program in 2 warps, 2048 columns a step, best
        # or within 2% of it on all four (gate_up 17.4 us against the words kernel's 29.7, down
        # 9.7 / 17.5, qkv 6.4 / 11.6, o 4.8 / 8.4), and for int8 (60.5 us over the four, the best
        # sum). Several rows (HIBANA_A8_ROWS > 1, not measured yet): all of them in a program
        return A8GemvTiles(2, 2048, num_warps=2, block_m=min(A8_MAX_BLOCK_M, triton.next_power_of_2(rows)))
    tensor_cores = dtype in (torch.bfloat16, torch.float16) and dot_fits(k, group_size)
    if tensor_cores and group_size >= WORDS_MIN_GROUP:
        # Qwen3-8B's layers on the H200 (`tune_quant.py --sweep --words-only`: bench/RESULTS.md,
        # seventeenth session): 256 output features a program in 8 warps, 3 stages, x's columns
        # and the group's scales and zeros loaded a group ahead (PREFETCH: 1.05-1.19x), K split
        # until the grid has about a program an SM, in 4 at least (one row: gate_up 4 splits
        # 28.2 us, down 8 17.3, qkv 8 11.5, o 8 8.3). Batch rows 16, 32 or 64 a program: from 32
        # rows on it beats the GEMM on three layers of four (at 32 gate_up 52.8 against 56.1 us;
        # at 64 the GEMM's gate_up 71.6 against 79.2, but down 40.5, qkv 28.7, o 18.9 where the
        # GEMM's are over 50, 31 and 21), and from 64 rows half the splits (each one's partial
        # sums grow with the rows: at 96, gate_up 128.9 us in 2 against 143.9 in 4)
        splits = _splits(triton.cdiv(n, 256), k // group_size, WORDS_PROGRAMS_PER_SM * sms, 4)
        return DotTiles(256, splits if rows <= 64 else max(1, splits // 2), num_warps=8, num_stages=3,
                        words=True, prefetch=True, block_m=16 if rows <= 16 else 32 if rows <= 32 else 64)
    if tensor_cores and rows <= GEMV_MAX_ROWS:
        groups = k // group_size
        # (groups of 32 and 64) 1.11-1.36x the GEMV below (fourteenth session): 64 output
        # features a program (16, 32 and 128 slower), K split until ~2.5 programs an SM
        return DotTiles(64, _splits(triton.cdiv(n, 64), groups, DOT_PROGRAMS_PER_SM * sms),
                        num_warps=4, num_stages=4)
    k_tile = triton.next_power_of_2(k)
    if rows == 1 and group_size == 1:  # int8 from 2 rows: the GEMM (measured at 4)
        return GemvTiles(block_n=8, block_k=min(k_tile, 2048), num_warps=4)
    if rows <= GEMV_MAX_ROWS and group_size > 1 and gemv_fits(k, group_size):
        return GemvTiles(block_n=8, block_k=max(group_size, 512 if rows == 1 else 256), num_warps=4)
    return _gemm_tiles(rows, k_tile, group_size)


def _gemm_tiles(rows: int, k_tile: int, group_size: int = 1) -> GemmTiles:
    """The GEMM's tiles for every format (group_size 1: int8, fp8): they grow with the batch."""
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
            tiles: GemvTiles | DotTiles | GemmTiles | None) -> torch.Tensor:
    """Any of the paths on either format; int4 when zeros are given."""
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
    if isinstance(tiles, GemvTiles) and not gemv_fits(k, group_size if int4 else 1):
        raise ValueError(f"the GEMV cannot take K={k} with group size {group_size}; see gemv_fits")
    if isinstance(tiles, DotTiles) and not (int4 and dot_fits(k, group_size) and x.dtype in (torch.bfloat16,
                                                                                             torch.float16)
                                            and (group_size >= WORDS_MIN_GROUP or not tiles.words)
                                            and (tiles.words or not tiles.prefetch)
                                            and tiles.block_m >= 16 and tiles.block_m & (tiles.block_m - 1) == 0):
        raise ValueError(f"the int4 tensor-core kernels take 16-bit x and groups of 32 or more (see dot_fits; "
                         f"words: 128), not {x.dtype}, K={k}, group size {group_size}")
    if isinstance(tiles, A8GemvTiles) and (tiles.block_m < 1 or tiles.block_m & (tiles.block_m - 1)):
        raise ValueError(f"the x int8 GEMV takes a power of two of rows a program, not {tiles.block_m}")
    if isinstance(tiles, A8GemvTiles) and not a8_fits(k, group_size if int4 else 1):
        raise ValueError(f"the x int8 GEMV takes whole blocks of 32 columns and int4 groups of them (see a8_fits), "
                         f"not K={k} with group size {group_size}")
    if isinstance(tiles, A8GemvTiles):
        _a8_gemv(x2, qweight, scales, zeros, group_size, bias, tiles, y)
    elif isinstance(tiles, GemvTiles) and not int4:
        _gemv_int8_kernel[(triton.cdiv(n, tiles.block_n),)](
            x2, qweight, scales, bias_arg, y, m, n, k, x2.stride(0),
            qweight.stride(0), y.stride(0), BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
            num_warps=tiles.num_warps, num_stages=1,
            **pdl.launch_args(x.device, "gemv", triton.cdiv(n, tiles.block_n)))
    elif isinstance(tiles, DotTiles):
        _int4_dot(x2, qweight, scales, zeros, group_size, bias, tiles, y)
    elif isinstance(tiles, GemvTiles):
        _gemv_int4_kernel[(triton.cdiv(n, tiles.block_n),)](
            x2, qweight.view(torch.int32), scales, zeros, bias_arg, y, m, n, k,
            x2.stride(0), qweight.stride(0) // 4, scales.stride(0), y.stride(0),
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP=group_size, HAS_BIAS=bias is not None, X_VECTOR=tiles.x_vector, num_warps=tiles.num_warps,
            num_stages=1,
            **pdl.launch_args(x.device, "gemv", triton.cdiv(n, tiles.block_n)))
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


DOT_COUNTERS = 4096  # output tiles a split launch may have (n tiles x m tiles)


def _int4_dot(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, bias: torch.Tensor | None, tiles: DotTiles, y: torch.Tensor) -> None:
    m, n = y.shape
    k = x2.shape[1]
    groups = k // group_size
    per_split = triton.cdiv(groups, max(1, min(tiles.splits, groups)))
    splits = triton.cdiv(groups, per_split)  # none empty
    grid = (triton.cdiv(n, tiles.block_n), splits, triton.cdiv(m, tiles.block_m))
    if grid[0] * grid[2] > DOT_COUNTERS:
        per_split, splits = groups, 1
        grid = (grid[0], 1, grid[2])
    split = splits > 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=y.device) if split else y
    counts = counters.counters("int4 split-K", DOT_COUNTERS, y.device) if split else y
    if tiles.words:
        kernel, weight, stride_wn = _int4_words_kernel, qweight.view(torch.int32), qweight.stride(0) // 4
        variant = dict(PREFETCH=tiles.prefetch)
    else:
        kernel, weight, stride_wn = _int4_dot_kernel, qweight, qweight.stride(0)
        variant = {}
    kernel[grid](
        x2, weight, scales, zeros, bias if bias is not None else scales, y, part, counts, m, n, k,
        x2.stride(0), stride_wn, scales.stride(0), y.stride(0), per_split,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, GROUP=group_size, STAGES=tiles.num_stages,
        FP16=x2.dtype == torch.float16, ASM=x2.device.type == "cuda", SPLIT=split, HAS_BIAS=bias is not None,
        num_warps=tiles.num_warps, **variant, **pdl.launch_args(y.device, "gemv", grid[0] * grid[1] * grid[2]))


def linear_int8_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None, tiles: GemvTiles | A8GemvTiles | GemmTiles | None) -> torch.Tensor:
    """linear_int8 with the kernel and tiles chosen by the caller (tests, the tuning script)."""
    return _launch(x, qweight, scales, None, 1, bias, tiles)


def linear_int4_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                       tiles: GemvTiles | DotTiles | A8GemvTiles | GemmTiles | None) -> torch.Tensor:
    """linear_int4 with the kernel and tiles chosen by the caller (tests, the tuning script)."""
    return _launch(x, qweight, scales, zeros, group_size, bias, tiles)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_int8`."""
    if x.dtype not in _DTYPES:
        return quant.linear_int8(x, qweight, scales, bias)
    n, k = qweight.shape
    tiles = choose_tiles(x.numel() // k if k else 0, n, k, 1, x.dtype, counters.sm_count(x.device))
    return linear_int8_launch(x, qweight, scales, bias, tiles)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_int4`."""
    if x.dtype not in _DTYPES or group_size & (group_size - 1):  # the tile views need 2^i groups
        return quant.linear_int4(x, qweight, scales, zeros, group_size, bias)
    n, k = qweight.shape[0], qweight.shape[1] * 2
    tiles = choose_tiles(x.numel() // k if k else 0, n, k, group_size, x.dtype, counters.sm_count(x.device))
    return linear_int4_launch(x, qweight, scales, zeros, group_size, bias, tiles)


# --------------------------------------------------------------------------------------- fp8


@triton.jit
def _fp8_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, BN, BK, stride_wn, stride_sn,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
              ONE_K_BLOCK: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of fp8 weight rows offs_n as float32 [BLOCK_N, BLOCK_K], zero
    outside the weight: dequantized, or the raw codes when one scale block spans K (its scale
    then multiplies the finished sum, `_fp8_finish`)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    codes = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    if ONE_K_BLOCK:
        return codes
    G: tl.constexpr = BLOCK_K // SUB
    starts = k0 + tl.arange(0, G) * SUB  # each sub-tile lies inside one block: SUB divides BK
    scales = tl.load(s_ptr + (offs_n // BN).to(tl.int64)[:, None] * stride_sn + (starts // BK)[None, :],
                     mask=n_mask[:, None] & (starts < K)[None, :], other=0.0)  # [BLOCK_N, G]
    w = tl.reshape(codes, [BLOCK_N, G, SUB]) * scales[:, :, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K])


@triton.jit
def _fp8_finish(acc, s_ptr, b_ptr, offs_n, n_mask, BN, stride_sn, ONE_K_BLOCK: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """acc [rows, BLOCK_N] with the row's scale (one block along K) and the bias applied."""
    if ONE_K_BLOCK:
        acc *= tl.load(s_ptr + (offs_n // BN).to(tl.int64) * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, BN, BK,
                     stride_xm, stride_wn, stride_sn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SUB: tl.constexpr, ONE_K_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PDL: tl.constexpr):
    """y[:, n] = sum_k x[:, k] w[n, k]: BLOCK_N weight rows per program, streamed in BLOCK_K-wide
    tiles dequantized in registers. Products stay per tile column until the loop ends: threads
    sit along K, and a reduction across them every step costs more than the step's loads
    (bench/notes_quant.md)."""
    wait_for_previous(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _fp8_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, BN, BK, stride_wn, stride_sn,
                      BLOCK_N, BLOCK_K, SUB, ONE_K_BLOCK)  # [BLOCK_N, BLOCK_K]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    total = _fp8_finish(tl.sum(acc, axis=2), s_ptr, b_ptr, offs_n, n_mask, BN, stride_sn, ONE_K_BLOCK,
                        HAS_BIAS)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             total.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemm_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, BN, BK,
                     stride_xm, stride_wn, stride_sn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SUB: tl.constexpr, ONE_K_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     UPCAST: tl.constexpr):
    # as _gemm_kernel: axis 0 (fastest) over rows, so the programs sharing a weight tile run together
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
        w = _fp8_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, BN, BK, stride_wn, stride_sn,
                      BLOCK_N, BLOCK_K, SUB, ONE_K_BLOCK)  # [BLOCK_N, BLOCK_K]
        w = w.to(x.dtype)  # 16-bit x: rounded as the reference dequantizes (raw codes: exactly)
        if UPCAST:  # exact: products of 16-bit floats are exact in float32
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    acc = _fp8_finish(acc, s_ptr, b_ptr, offs_n, n_mask, BN, stride_sn, ONE_K_BLOCK, HAS_BIAS)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, BN, BK, stride_wn, stride_sn, stride_on,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                           ONE_K_BLOCK: tl.constexpr):
    """The weight as out's dtype [N, K], rounded once from float32 as the reference does."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k0 = tl.program_id(1) * BLOCK_K
    w = _fp8_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, BN, BK, stride_wn, stride_sn,
                  BLOCK_N, BLOCK_K, SUB, ONE_K_BLOCK)
    if ONE_K_BLOCK:
        w *= tl.load(s_ptr + (offs_n // BN).to(tl.int64) * stride_sn, mask=n_mask, other=0.0)[:, None]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


def _fp8_sub(block_k: int, k: int, bk: int) -> tuple[int, bool]:
    """(SUB, ONE_K_BLOCK) for tiles of block_k columns over blocks bk wide: one block spanning
    K needs no sub-tiles; otherwise SUB is the largest power of two dividing bk, up to block_k."""
    if bk >= k:
        return block_k, True
    return min(block_k, bk & -bk), False


def choose_tiles_fp8(rows: int, n: int, k: int) -> GemvTiles | GemmTiles | None:
    """The kernel and its tiles for an [rows, k] x fp8 [n, k]^T product, or None from
    DEQUANT_MIN_ROWS rows on (dequantize, then cuBLAS). First guesses, as int8's were: to be
    replaced by bench/tune_quant.py's measurements."""
    if rows >= DEQUANT_MIN_ROWS:
        return None
    k_tile = triton.next_power_of_2(k)
    if rows <= GEMV_MAX_ROWS:
        # the sums per column, [rows, 8, block_k], at most 32 float32 registers a thread (4 warps)
        return GemvTiles(block_n=8, block_k=min(k_tile, 512 if rows == 1 else 128), num_warps=4)
    return _gemm_tiles(rows, k_tile)


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`, equal to the reference's `dequantize_fp8`."""
    n, k = qweight.shape
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 16, 256
    sub, one_k_block = _fp8_sub(block_k, k, block[1])
    _dequantize_fp8_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, out, n, k, block[0], block[1], qweight.stride(0), scales.stride(0),
        out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, SUB=sub, ONE_K_BLOCK=one_k_block, num_warps=4)
    return out


def linear_fp8_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None,
                      tiles: GemvTiles | GemmTiles | None) -> torch.Tensor:
    """linear_fp8 with the kernel and tiles chosen by the caller (tests, the tuning script);
    tiles None: dequantize, then cuBLAS."""
    n, k = qweight.shape
    if tiles is None:
        return F.linear(x, dequantize_fp8(qweight, scales, block, x.dtype), bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n)
    bias_arg = bias if bias is not None else scales
    sub, one_k_block = _fp8_sub(tiles.block_k, k, block[1])
    common = (x2, qweight, scales, bias_arg, y, m, n, k, block[0], block[1], x2.stride(0),
              qweight.stride(0), scales.stride(0), y.stride(0))
    if isinstance(tiles, GemvTiles):
        _gemv_fp8_kernel[(triton.cdiv(n, tiles.block_n),)](
            *common, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            SUB=sub, ONE_K_BLOCK=one_k_block, HAS_BIAS=bias is not None, num_warps=tiles.num_warps,
            num_stages=1, **pdl.launch_args(x.device, "gemv", triton.cdiv(n, tiles.block_n)))
    else:
        _gemm_fp8_kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))](
            *common, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            SUB=sub, ONE_K_BLOCK=one_k_block, HAS_BIAS=bias is not None, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            # Triton's interpreter (CPU tensors) gets tl.dot of bf16 tiles wrong (triton 3.9)
            UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16)
    return y.view(*x.shape[:-1], n)


@functools.cache
def _fp8_native(device: torch.device) -> bool:
    """Whether Triton converts e4m3 here: from sm_89 on (before, it has no e4m3 type); the
    interpreter (CPU tensors) always."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def linear_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.quant.linear_fp8`; GPUs before sm_89 take the torch reference."""
    if x.dtype not in _DTYPES or not _fp8_native(x.device):
        return quant.linear_fp8(x, qweight, scales, block, bias)
    n, k = qweight.shape
    return linear_fp8_launch(x, qweight, scales, block, bias, choose_tiles_fp8(x.numel() // k if k else 0, n, k))
