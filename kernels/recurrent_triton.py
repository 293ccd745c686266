"""Gated DeltaNet linear attention: Triton kernels, same signatures as `hibana_kernels.recurrent`.

Every kernel walks a sequence's rows one by one, as decode and verify steps have few: the
convolution one program per (sequence, channel block), the delta rule one per (sequence, v head,
block of Dv) with its [Dk, BLOCK_DV] slice of the state in registers, float32, token by token
(the recurrent form). A step with a long sequence (a prefill chunk) runs the delta rule's chunked
form instead: the same programs, each taking its rows a chunk at a time in a few tensor-core dots
(`_chunked_delta_rule_kernel`). Bounds, slots and counts are read on the device: no host sync, so
a launch can be captured in a CUDA graph. The layer's gates and its gated RMSNorm are elementwise
and row-wise kernels over tiles of rows.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hibana_kernels import pdl, recurrent
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.recurrent import check_activation

try:
    from triton.language.extra import libdevice
except ImportError:  # triton 3.0 has it under its backend's name only
    from triton.language.extra.cuda import libdevice

L2_EPS = tl.constexpr(recurrent.L2_EPS)  # a jitted function reads only constexpr globals
SOFTPLUS_THRESHOLD = tl.constexpr(recurrent.SOFTPLUS_THRESHOLD)
TILE = 1024
"""Elements a gates or gated-norm program takes: [rows, Hv] or [rows, D], whole rows."""
CONV_BLOCK_C = 128
STATE_TILE = 4096
"""Float32 elements of the state a delta-rule program holds ([Dk, BLOCK_DV]): 32 registers a
thread at 4 warps."""
CHUNKED_MIN_ROWS: int | None = None if os.environ.get("HIBANA_CHUNKED_DELTA", "1") == "0" else 64
"""Rows of a step's longest sequence (`gated_delta_rule`'s max_rows) from which the chunked kernel
runs; None (HIBANA_CHUNKED_DELTA=0): never. Checked on an H100 on 2026-12-07 (the tiny Qwen3.5,
Qwen3.5-MoE and Qwen3-Next give transformers' tokens with it; bench/tune_recurrent.py at
qwen3.5-35b-a3b's layer: 2.8x the token loop at 64 rows, 4.3x from 4096, within 3e-7 of its state).
Decode and verify steps (1 to 17 rows a sequence, the steps CUDA graphs capture) stay token by
token: few rows are few dependent steps, and a chunk's fixed work (its [C, C] inverse, dots of C
rows however few are the sequence's) would buy little. A prefill chunk (hundreds of rows or more)
goes chunked. 64 leaves a margin above the longest verify step: 4 chunks of 16 against 64 steps of
the loop (bench/tune_recurrent.py times both forms from 64 rows up)."""


class ChunkTiles(NamedTuple):
    """The chunked delta rule's launch: `chunk` rows a step (a power of two from 16, tl.dot's
    smallest side), `block_dv` columns of the state a program (from 16), warps and stages."""

    chunk: int
    block_dv: int
    num_warps: int
    num_stages: int


CHUNK_TILES = ChunkTiles(chunk=16, block_dv=32, num_warps=8, num_stages=2)
"""Chosen for registers, not yet timed (bench/tune_recurrent.py --sweep times others). At Qwen3.5's
heads (Dk = Dv = 128, bf16 rows) compiled for sm_90 by Triton 3.9, ptxas spills 144 bytes a
thread; 32 rows a chunk spill about 2 KB and 64 rows 3-4 KB, at 4 warps or 8 (the registers
that the inverse's [C, C] dots and the row dots' [C, Dk] operands take grow with C); 16 rows at
4 warps spill 280 bytes. Two stages: the next chunk's rows load while this one computes
(cp.async), off the loop's dependent path, for 40 bytes more."""


@triton.jit
def _only_if(condition, mask):
    """mask where the scalar condition holds, else all False. (Not `mask & condition`: Triton's
    interpreter turns a block & a scalar boolean into int32, which no load takes as a mask.)"""
    return tl.where(condition, mask, False)


@triton.jit
def _rows_of(qsl_ptr, skip_ptr, seq, SKIP: tl.constexpr):
    """(start, end) of a sequence's rows, int64 (offsets of T * C can pass 2^31); SKIP: the first
    skip[seq] of them are padding, none of its own."""
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    if SKIP:
        start = tl.minimum(start + tl.load(skip_ptr + seq).to(tl.int64), end)
    return start, end


@triton.jit
def _zero_rows(ptr, stride_t, cols, cmask, first, start, stop, end):
    """Zeros into rows [first, start) (a sequence's skipped padding) and [stop, end) (its rows, where
    it has no slot), at `cols`: a program's share of the rows it does not compute, so the output
    needs no fill launch before it."""
    zeros = tl.zeros(cols.shape, dtype=ptr.dtype.element_ty)
    for t in range(first, start):
        tl.store(ptr + t * stride_t + cols, zeros, mask=cmask)
    for t in range(stop, end):
        tl.store(ptr + t * stride_t + cols, zeros, mask=cmask)


@triton.jit
def _inputs(x_ptr, state_row, c, cm, pos, valid, start, has, stride_x, K: tl.constexpr):
    """The inputs at absolute rows `pos` [N] (where `valid`, else zero) and channels c [BLOCK_C]
    -> [BLOCK_C, N] in x's dtype: a row of the sequence (pos >= start), else its slot's previous
    input (zero for a fresh sequence)."""
    from_x = pos >= start
    xv = tl.load(x_ptr + tl.maximum(pos, 0)[None, :] * stride_x + c[:, None],
                 mask=cm[:, None] & (valid & from_x)[None, :], other=0.0)
    sv = tl.load(state_row + tl.maximum(pos - start + K - 1, 0)[None, :],
                 mask=cm[:, None] & _only_if(has, valid & ~from_x)[None, :], other=0.0)
    return xv + sv  # one of the two is zero: exact


@triton.jit
def _store_shifted_state(x_ptr, state_row, c, cm, start, end, has, write, stride_x,
                         K: tl.constexpr, BLOCK_W: tl.constexpr):
    """The slot's state after rows [start, end): the last K-1 inputs of (previous ++ rows)."""
    i = tl.arange(0, BLOCK_W)
    new = _inputs(x_ptr, state_row, c, cm, end - (K - 1) + i, i < K - 1, start, has, stride_x, K)
    tl.debug_barrier()  # every thread has read the previous state before any overwrites it
    tl.store(state_row + i[None, :], new, mask=_only_if(write, cm[:, None] & (i < K - 1)[None, :]))


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, copy_ptr, slots_ptr, has_ptr, qsl_ptr, skip_ptr,
                 stride_x, stride_out, stride_copy, stride_ss, stride_sc, C,
                 K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU: tl.constexpr, WRITE: tl.constexpr, SKIP: tl.constexpr,
                 COPY_X: tl.constexpr, ZERO_OTHERS: tl.constexpr):
    """Program (sequence, channel block): its output rows, then (WRITE) its slot's new state.
    Each row reads its K inputs back from x and the state (cached): no window to shift. SKIP: the
    sequence's rows start skip[seq] rows in; COPY_X: its rows of x are copied to copy_ptr;
    ZERO_OTHERS: its rows it does not compute (skipped, or all where it has no slot) get zeros."""
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    start, end = _rows_of(qsl_ptr, skip_ptr, seq, SKIP)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has = tl.load(has_ptr + seq) != 0
    state_row = state_ptr + tl.maximum(slot, 0) * stride_ss + c[:, None] * stride_sc
    w_dtype = w_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=cm[:, None] & (j < K)[None, :], other=0.0)
    w = w.to(tl.float32)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
    stop = tl.where(slot >= 0, end, start)  # no slot: no rows
    if ZERO_OTHERS:
        _zero_rows(out_ptr, stride_out, c, cm, tl.load(qsl_ptr + seq).to(tl.int64), start, stop, end)
    for t in range(start, stop):
        inputs = _inputs(x_ptr, state_row, c, cm, t - (K - 1) + j, j < K, start, has, stride_x, K)
        # as transformers: inputs cast to the weight's dtype, the conv and activation rounded there
        y = tl.sum(w * inputs.to(w_dtype).to(tl.float32), axis=1) + bias
        y = y.to(w_dtype).to(tl.float32)
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + t * stride_out + c, y.to(w_dtype).to(out_ptr.dtype.element_ty), mask=cm)
        if COPY_X:
            tl.store(copy_ptr + t * stride_copy + c, tl.load(x_ptr + t * stride_x + c, mask=cm), mask=cm)
    if WRITE:
        _store_shifted_state(x_ptr, state_row, c, cm, start, end, has, stop > start, stride_x, K, BLOCK_W)


@triton.jit
def _conv_advance_kernel(x_ptr, state_ptr, slots_ptr, has_ptr, qsl_ptr, skip_ptr, counts_ptr,
                         stride_x, stride_ss, stride_sc, C,
                         K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, SKIP: tl.constexpr):
    """Program (sequence, channel block): the slot's state after its first counts[seq] rows
    (SKIP: after skip[seq] rows)."""
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    start, end = _rows_of(qsl_ptr, skip_ptr, seq, SKIP)
    stop = start + tl.maximum(tl.minimum(tl.load(counts_ptr + seq), end - start), 0)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has = tl.load(has_ptr + seq) != 0
    state_row = state_ptr + tl.maximum(slot, 0) * stride_ss + c[:, None] * stride_sc
    _store_shifted_state(x_ptr, state_row, c, cm, start, stop, has, (slot >= 0) & (stop > start), stride_x,
                         K, BLOCK_W)


@triton.jit
def _state_slice(state_ptr, slots_ptr, has_ptr, seq, hv, dk, dv, dkm, dvm, start, end, stride_ss, stride_sh,
                 stride_sk):
    """A delta-rule program's slice of its sequence's state: (stop: the end of the rows it runs, its
    start where the sequence has no slot (its rows get zeros); the slice's pointers and mask;
    the slice [BLOCK_DK, BLOCK_DV] float32, zeros for a fresh sequence)."""
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has = tl.load(has_ptr + seq) != 0
    stop = tl.where(slot >= 0, end, start)
    s_ptrs = state_ptr + tl.maximum(slot, 0) * stride_ss + hv * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    smask = dkm[:, None] & dvm[None, :]
    return stop, s_ptrs, smask, tl.load(s_ptrs, mask=_only_if(has & (stop > start), smask), other=0.0)


@triton.jit
def _unit_row(ptr, d, dm):
    """A q or k head's row, float32, L2-normalised (transformers' `l2norm`)."""
    x = tl.load(ptr + d, mask=dm, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + L2_EPS)


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, has_ptr, qsl_ptr,
                       skip_ptr, counts_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_gt, stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, scale,
                       DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BLOCK_DK: tl.constexpr,
                       BLOCK_DV: tl.constexpr, ADVANCE: tl.constexpr, WRITE: tl.constexpr, SKIP: tl.constexpr):
    """Program (sequence, v head, Dv block): the state's [Dk, BLOCK_DV] slice, token by token.
    ADVANCE: `gated_delta_advance`, the first counts[seq] rows and no output; else
    `gated_delta_rule`, every row with its output (zeros in the rows it skips, or all where the
    sequence has no slot), the state kept where WRITE. SKIP: the sequence's rows start skip[seq]
    rows in."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dkm, dvm = dk < DK, dv < DV
    start, end = _rows_of(qsl_ptr, skip_ptr, seq, SKIP)
    if ADVANCE:
        end = start + tl.maximum(tl.minimum(tl.load(counts_ptr + seq), end - start), 0)
    stop, s_ptrs, smask, s = _state_slice(state_ptr, slots_ptr, has_ptr, seq, hv, dk, dv, dkm, dvm, start, end,
                                          stride_ss, stride_sh, stride_sk)
    if not ADVANCE:
        _zero_rows(out_ptr + hv * stride_oh, stride_ot, dv, dvm, tl.load(qsl_ptr + seq).to(tl.int64), start, stop,
                   end)
    for t in range(start, stop):
        k = _unit_row(k_ptr + t * stride_kt + hk * stride_kh, dk, dkm)
        v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + dv, mask=dvm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + hv).to(tl.float32)
        s = s * tl.exp(tl.load(g_ptr + t * stride_gt + hv).to(tl.float32))
        kv_mem = tl.sum(s * k[:, None], axis=0)  # [BLOCK_DV]: what the state recalls for k
        s = s + k[:, None] * (beta * (v - kv_mem))[None, :]
        if not ADVANCE:
            q = _unit_row(q_ptr + t * stride_qt + hk * stride_qh, dk, dkm) * scale
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(out_ptr + t * stride_ot + hv * stride_oh + dv, o.to(out_ptr.dtype.element_ty), mask=dvm)
    if WRITE:
        tl.store(s_ptrs, s, mask=_only_if(stop > start, smask))


@triton.jit
def _tf32(x):
    """float32 x rounded to tf32 (its top 10 bits of mantissa, to nearest): x - _tf32(x) is exact."""
    return ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b):
    """a @ b in float32 on tensor cores, to about float32's rounding (tf32 alone, 2^-11 an operand,
    would leave states a thousandth off; ieee dots take the CUDA cores): a float32 operand is a
    sum of two tf32 parts and the dot the sum of the products but the low parts' (3xTF32). A
    16-bit operand (a q or k row as loaded) is exact in tf32, one part; two 16-bit operands take
    one 16-bit dot (exact products, float32 sums). The interpreter multiplies in float32."""
    if a.dtype != tl.float32 and b.dtype != tl.float32:
        d = tl.dot(a, b)
    elif a.dtype != tl.float32:
        a = a.to(tl.float32)
        high = _tf32(b)
        d = tl.dot(a, high, tl.dot(a, b - high, input_precision="tf32"), input_precision="tf32")
    elif b.dtype != tl.float32:
        b = b.to(tl.float32)
        high = _tf32(a)
        d = tl.dot(high, b, tl.dot(a - high, b, input_precision="tf32"), input_precision="tf32")
    else:
        a_high, b_high = _tf32(a), _tf32(b)
        d = tl.dot(a - a_high, b_high, input_precision="tf32")
        d = tl.dot(a_high, b - b_high, d, input_precision="tf32")
        d = tl.dot(a_high, b_high, d, input_precision="tf32")
    return d


@triton.jit
def _unit_lower_inverse(a, i, LEVELS: tl.constexpr):
    """(I + a)^-1 of a lower-triangular a [C, C] taken as strictly lower (its diagonal is not read;
    C = 2^LEVELS; i [C]: its rows' indices, counted from a multiple of C), in dots: the inverse of
    its diagonal blocks of one row (I), their size doubled LEVELS times by

        [[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]

    for every pair of neighbouring blocks at once (Y: a's entries joining the pair)."""
    inverse = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    for level in tl.static_range(LEVELS):
        half = 2 ** level  # rows of the blocks inverted so far
        joins = (i[:, None] // (2 * half) == i[None, :] // (2 * half)) & (i[:, None] // half != i[None, :] // half)
        inverse -= _dot(inverse, _dot(tl.where(joins, a, 0.0), inverse))
    return inverse


@triton.jit
def _chunked_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, slots_ptr, has_ptr,
                               qsl_ptr, skip_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                               stride_gt, stride_bt, stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, scale,
                               DK: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BLOCK_DK: tl.constexpr,
                               BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, LEVELS: tl.constexpr,
                               WRITE: tl.constexpr, SKIP: tl.constexpr, UPCAST: tl.constexpr):
    """Program (sequence, v head, Dv block): `_delta_rule_kernel`'s work, CHUNK rows at a time in
    the chunked form (`hibana_kernels.recurrent._chunked`). Per chunk, with Q, K [C, Dk] its rows
    L2-normalised (Q scaled), V [C, BLOCK_DV], G the cumulative log decay and D[i, j] =
    exp(G_i - G_j) on and below the diagonal (0 above), from the state S [Dk, BLOCK_DV]:

        U = (I + strictly_lower(beta_i (k_i . k_j) D_ij))^-1 beta (V - exp(G) K S)    the updates
        O = exp(G) Q S + ((Q K^T) D) U
        S = exp(G_last) S + (K exp(G_last - G))^T U

    Rows past the sequence's end are zeros (g 0, beta 0: no decay, no update). The dots take q
    and k rows as loaded, their norms applied to the products (16-bit rows: one-part operands,
    see `_dot`). Each Dv block of a head computes the chunk's inverse again. WRITE, SKIP: as
    `_delta_rule_kernel`'s; UPCAST: 16-bit q and k rows taken as float32 (the interpreter, whose
    16-bit tl.dot is wrong)."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dkm, dvm = dk < DK, dv < DV
    start, end = _rows_of(qsl_ptr, skip_ptr, seq, SKIP)
    stop, s_ptrs, smask, s = _state_slice(state_ptr, slots_ptr, has_ptr, seq, hv, dk, dv, dkm, dvm, start, end,
                                          stride_ss, stride_sh, stride_sk)
    r = tl.arange(0, CHUNK)
    for c in range(start, stop, CHUNK):
        t = c + r  # the chunk's rows
        tm = t < stop
        # the rows' places in the sequence, which the [CHUNK, CHUNK] masks are built from chunk by
        # chunk (masks of r, a constant, would be hoisted out of the loop and held in registers)
        i = (t - start).to(tl.int32)
        km, vm = tm[:, None] & dkm[None, :], tm[:, None] & dvm[None, :]
        k = tl.load(k_ptr + hk * stride_kh + t[:, None] * stride_kt + dk[None, :], mask=km, other=0.0)
        q = tl.load(q_ptr + hk * stride_qh + t[:, None] * stride_qt + dk[None, :], mask=km, other=0.0)
        if UPCAST:
            k, q = k.to(tl.float32), q.to(tl.float32)
        k_norm = tl.rsqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=1) + L2_EPS)  # [CHUNK]
        q_norm = tl.rsqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1) + L2_EPS) * scale
        v = tl.load(v_ptr + t[:, None] * stride_vt + hv * stride_vh + dv[None, :], mask=vm, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + hv, mask=tm, other=0.0).to(tl.float32)
        decay = tl.cumsum(tl.load(g_ptr + t * stride_gt + hv, mask=tm, other=0.0).to(tl.float32), axis=0)  # G
        pair = tl.exp(tl.where(i[:, None] >= i[None, :], decay[:, None] - decay[None, :], float("-inf")))  # D
        kk = k_norm[:, None] * _dot(k, tl.trans(k)) * k_norm[None, :]  # [CHUNK, CHUNK]
        a = beta[:, None] * kk * pair  # lower-triangular; the inverse reads it below the diagonal
        known = (tl.exp(decay) * k_norm)[:, None] * _dot(k, s)  # exp(G) K S: what S recalls for the rows
        u = _dot(_unit_lower_inverse(a, i, LEVELS), beta[:, None] * (v - known))  # [CHUNK, BLOCK_DV]
        qk = q_norm[:, None] * _dot(q, tl.trans(k)) * k_norm[None, :]
        o = (tl.exp(decay) * q_norm)[:, None] * _dot(q, s) + _dot(qk * pair, u)
        tl.store(out_ptr + t[:, None] * stride_ot + hv * stride_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=vm)
        last = tl.sum(tl.where(r == CHUNK - 1, decay, 0.0), axis=0)  # G_last
        s = s * tl.exp(last) + _dot(tl.trans(k), u * (k_norm * tl.exp(last - decay))[:, None])
    if WRITE:
        tl.store(s_ptrs, s, mask=_only_if(stop > start, smask))


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """exp(x) in float32. LIBDEVICE: libdevice's expf, which torch's CUDA kernels call, for their
    results bit for bit (tl.exp is ex2.approx; the interpreter has no libdevice: numpy's exp)."""
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log1p(u, LIBDEVICE: tl.constexpr):
    """log(1 + u) in float32, accurate for small u: libdevice's log1pf (torch's on CUDA), else
    log(w) * u / (w - 1) with w = 1 + u, which cancels w's rounding (Goldberg's form)."""
    if LIBDEVICE:
        y = libdevice.log1p(u)
    else:
        w = 1.0 + u
        y = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return y


@triton.jit
def _sigmoid(x, LIBDEVICE: tl.constexpr):
    """1 / (1 + exp(-x)) in float32, torch's formula, its division IEEE-rounded as nvcc's."""
    return tl.math.fdiv(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, LIBDEVICE), ieee_rounding=True)


@triton.jit
def _gdn_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, T, stride_a, stride_b,
                      H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, LIBDEVICE: tl.constexpr,
                      PDL: tl.constexpr):
    """Program (block of BLOCK_T rows): g and beta of its rows, each rounding as torch's ops."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    decay = -_exp(tl.load(a_log_ptr + h, mask=hm, other=0.0).to(tl.float32), LIBDEVICE)  # -exp(A_log)
    dt_bias = tl.load(dt_bias_ptr + h, mask=hm, other=0.0).to(tl.float32)
    wait_for_previous(PDL)  # (the weights above are read before: no kernel of the step writes them)
    mask = (t < T)[:, None] & hm[None, :]
    x = tl.load(a_ptr + t[:, None] * stride_a + h[None, :], mask=mask, other=0.0).to(tl.float32) + dt_bias[None, :]
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, _log1p(_exp(x, LIBDEVICE), LIBDEVICE))
    tl.store(g_ptr + t[:, None] * H + h[None, :], decay[None, :] * softplus, mask=mask)
    b = tl.load(b_ptr + t[:, None] * stride_b + h[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t[:, None] * H + h[None, :], _sigmoid(b, LIBDEVICE).to(beta_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, eps, rows, heads, stride_xm, stride_xh,
                           stride_gm, stride_gh, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                           ROUND_PRODUCT: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BLOCK_ROWS rows r of [M, H, D] views, r = m * H + h): their gated norm.
    ROUND_PRODUCT: weight * normed rounded to x's dtype (a weight of x's dtype, torch's promotion)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    m, hd = r // heads, r % heads
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    mask = (r < rows)[:, None] & dm[None, :]
    x = tl.load(x_ptr + (m * stride_xm + hd * stride_xh)[:, None] + d[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    h = w[None, :] * (xf * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    if ROUND_PRODUCT:
        h = h.to(x.dtype).to(tl.float32)
    gate = tl.load(gate_ptr + (m * stride_gm + hd * stride_gh)[:, None] + d[None, :], mask=mask,
                   other=0.0).to(tl.float32)
    silu = tl.math.fdiv(gate, 1.0 + _exp(-gate, LIBDEVICE), ieee_rounding=True)
    tl.store(out_ptr + r[:, None] * D + d[None, :], (h * silu).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dim (a strided view of a fused projection stays one)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _in_place(state: torch.Tensor) -> torch.Tensor:
    """A state tensor the kernels write: any strides but a unit last one (no copy to lose)."""
    if state.stride(-1) != 1:
        raise ValueError(f"state tensors want a unit stride along their last dim, not {state.stride()}")
    return state


def _conv_grid(num_seqs: int, channels: int) -> tuple[tuple[int, int], int]:
    block = min(CONV_BLOCK_C, triton.next_power_of_2(channels))
    return (num_seqs, triton.cdiv(channels, block)), block


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                  query_start_loc: torch.Tensor, activation: str | None = "silu",
                  write: bool = True, skip: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  x_copy: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.recurrent.causal_conv1d`."""
    check_activation(activation)
    x, weight, conv_state = _rows(x), weight.contiguous(), _in_place(conv_state)
    channels, width = weight.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else _in_place(out)
    copy = y if x_copy is None else _in_place(x_copy)  # (any pointer: not written without COPY_X)
    grid, block = _conv_grid(slots.shape[0], channels)
    if grid[0]:
        bias_ptr = weight if bias is None else bias  # any pointer: not read without a bias
        _conv_kernel[grid](x, weight, bias_ptr, conv_state, y, copy, slots, has_state, query_start_loc,
                           slots if skip is None else skip, x.stride(0), y.stride(0), copy.stride(0),
                           conv_state.stride(0), conv_state.stride(1), channels, K=width,
                           BLOCK_C=block, BLOCK_K=triton.next_power_of_2(width),
                           BLOCK_W=triton.next_power_of_2(max(width - 1, 1)), HAS_BIAS=bias is not None,
                           SILU=activation == "silu", WRITE=write, SKIP=skip is not None,
                           COPY_X=x_copy is not None, ZERO_OTHERS=out is None)
    return y


def conv_advance(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                 query_start_loc: torch.Tensor, counts: torch.Tensor,
                 has_state: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """See `hibana_kernels.recurrent.conv_advance`."""
    x, conv_state = _rows(x), _in_place(conv_state)
    channels, width = conv_state.shape[1], conv_state.shape[2] + 1
    grid, block = _conv_grid(slots.shape[0], channels)
    if grid[0]:
        _conv_advance_kernel[grid](x, conv_state, slots, _has_state(has_state, slots), query_start_loc,
                                   counts if skip is None else skip, counts, x.stride(0), conv_state.stride(0),
                                   conv_state.stride(1), channels, K=width, BLOCK_C=block,
                                   BLOCK_W=triton.next_power_of_2(max(width - 1, 1)), SKIP=skip is not None)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor, query_start_loc: torch.Tensor,
                     write: bool = True, skip: torch.Tensor | None = None,
                     max_rows: int | None = None) -> torch.Tensor:
    """See `hibana_kernels.recurrent.gated_delta_rule`. max_rows from CHUNKED_MIN_ROWS: the chunked
    kernel (`chunked_delta_rule`); else, or None, the token-by-token one."""
    if max_rows is not None and CHUNKED_MIN_ROWS is not None and max_rows >= CHUNKED_MIN_ROWS:
        return chunked_delta_rule(q, k, v, g, beta, state, slots, has_state, query_start_loc, write, skip)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (the kernel writes every row: zeros where none)
    _delta_rule(q, k, v, g, beta, state, o, slots, has_state, query_start_loc, slots, write, advance=False,
                skip=skip)
    return o


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                       has_state: torch.Tensor, query_start_loc: torch.Tensor,
                       write: bool = True, skip: torch.Tensor | None = None,
                       tiles: ChunkTiles = CHUNK_TILES) -> torch.Tensor:
    """`gated_delta_rule` in the chunked form whatever the rows, launched with `tiles` (tests, the
    tuning script)."""
    chunk = tiles.chunk
    if chunk < 16 or chunk & (chunk - 1) or tiles.block_dv < 16:
        raise ValueError(f"chunked_delta_rule takes chunks of a power of two rows from 16 and blocks of "
                         f"16 columns or more, not {tiles}")
    q, k, v, g, beta, state = _rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), _in_place(state)
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    num_v_heads, dk, dv = state.shape[1:]
    block_dv = min(tiles.block_dv, max(triton.next_power_of_2(dv), 16))
    grid = (slots.shape[0], num_v_heads, triton.cdiv(dv, block_dv))
    upcast = k.device.type == "cpu" and k.dtype != torch.float32  # the interpreter's 16-bit tl.dot is wrong
    if grid[0]:
        _chunked_delta_rule_kernel[grid](q, k, v, g, beta, state, o, slots, has_state, query_start_loc,
                                         slots if skip is None else skip, q.stride(0), q.stride(1), k.stride(0),
                                         k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
                                         o.stride(0), o.stride(1), state.stride(0), state.stride(1),
                                         state.stride(2), dk ** -0.5, DK=dk, DV=dv, GROUP=num_v_heads // k.shape[1],
                                         BLOCK_DK=max(triton.next_power_of_2(dk), 16), BLOCK_DV=block_dv,
                                         CHUNK=chunk, LEVELS=chunk.bit_length() - 1, WRITE=write,
                                         SKIP=skip is not None, UPCAST=upcast,
                                         num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return o


def gated_delta_advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                        counts: torch.Tensor, has_state: torch.Tensor | None = None,
                        skip: torch.Tensor | None = None) -> None:
    """See `hibana_kernels.recurrent.gated_delta_advance`."""
    # k and v stand in for q and o, which an advance neither reads nor writes
    _delta_rule(k, k, v, g, beta, state, v, slots, _has_state(has_state, slots), query_start_loc, counts,
                write=True, advance=True, skip=skip)


def _delta_rule(q, k, v, g, beta, state, o, slots, has_state, query_start_loc, counts, write, advance, skip):
    """One `_delta_rule_kernel` launch."""
    q, k, v, g, beta, state = _rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), _in_place(state)
    num_v_heads, dk, dv = state.shape[1:]
    block_dk = triton.next_power_of_2(dk)
    block_dv = min(triton.next_power_of_2(dv), max(STATE_TILE // block_dk, 16))
    grid = (slots.shape[0], num_v_heads, triton.cdiv(dv, block_dv))
    if grid[0]:
        _delta_rule_kernel[grid](q, k, v, g, beta, state, o, slots, has_state, query_start_loc,
                                 counts if skip is None else skip, counts,
                                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 g.stride(0), beta.stride(0), o.stride(0), o.stride(1), state.stride(0),
                                 state.stride(1), state.stride(2), dk ** -0.5, DK=dk, DV=dv,
                                 GROUP=num_v_heads // k.shape[1], BLOCK_DK=block_dk, BLOCK_DV=block_dv,
                                 ADVANCE=advance, WRITE=write, SKIP=skip is not None)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.recurrent.gdn_gates`."""
    a, b = _rows(a), _rows(b)
    tokens, heads = a.shape
    if out is None:
        g = torch.empty((tokens, heads), dtype=torch.float32, device=a.device)
        beta = torch.empty((tokens, heads), dtype=b.dtype, device=b.device)
    else:
        g, beta = out
        if not (g.is_contiguous() and beta.is_contiguous()):
            raise ValueError("gdn_gates writes contiguous [T, Hv] buffers")
    block_h = triton.next_power_of_2(heads)
    block_t = max(TILE // block_h, 1)
    grid = (triton.cdiv(tokens, block_t),)
    if grid[0]:
        _gdn_gates_kernel[grid](a, b, a_log.contiguous(), dt_bias.contiguous(), g, beta, tokens, a.stride(0),
                                b.stride(0), H=heads, BLOCK_T=block_t, BLOCK_H=block_h, LIBDEVICE=a.is_cuda,
                                **pdl.launch_args(a.device, "other", grid[0]))
    return g, beta


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See `hibana_kernels.recurrent.gated_rms_norm`."""
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm wants x and gate of one shape, not {tuple(x.shape)} and {tuple(gate.shape)}")
    x3, gate3 = _heads(x), _heads(gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dim, rows = x.shape[-1], x3.shape[0] * x3.shape[1]
    block_d = triton.next_power_of_2(dim)
    block_rows = max(TILE // block_d, 1)
    grid = (triton.cdiv(rows, block_rows),)
    if grid[0]:
        _gated_rms_norm_kernel[grid](x3, gate3, weight.contiguous(), out, eps, rows, x3.shape[1], x3.stride(0),
                                     x3.stride(1), gate3.stride(0), gate3.stride(1), D=dim, BLOCK_ROWS=block_rows,
                                     BLOCK_D=block_d,
                                     ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
                                     LIBDEVICE=x.is_cuda, **pdl.launch_args(x.device, "other", grid[0]))
    return out


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [M, H, D] (H its second-last dim, 1 for fewer than 3 dims) with a unit stride
    along D: a view of a head-strided projection's rows (z's heads), a copy only where the leading
    dims do not merge."""
    x = x.reshape(-1, x.shape[-2] if x.dim() > 2 else 1, x.shape[-1])
    return _rows(x)


def _has_state(has_state: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """has_state, or (None) every slot holding its state."""
    if has_state is None:
        return torch.ones(slots.shape, dtype=torch.bool, device=slots.device)
    return has_state
