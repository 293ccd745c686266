"""Attention over a paged KV cache: Triton kernels, same signatures as `hibana_kernels.attention`.

Two attention kernels share one online-softmax step (`_attend`), fp32 accumulation:

- decode (every sequence has one new token, or the same few: a verify step of speculation): one
  program per (sequence, KV head, split) handles all query heads of the KV head's group, for
  each of the sequence's QUERY_LEN new tokens, as the rows of one tile, so each key is loaded
  once per group and step. Long contexts are split along the sequence (flash-decoding): each
  split writes its unnormalised output with its running max and sum, and the last split of its
  (sequence, KV head) to finish merges them (it counts arrivals on an atomic counter, which it
  resets for the next launch or graph replay), or, where `hibana_kernels.fusion` says not to,
  `_reduce_splits_kernel` does in a second launch.
- prefill / verify (general batches): one program per (sequence, query tile, KV head); the rows of
  a tile are (query token, head in group) pairs, keys are gathered tile by tile through the block
  table under the causal (and sliding-window) mask.

Both walk their keys with `_attend_keys`: the window's, [lo, hi), and with StreamingLLM's sink
tokens first those before it, [0, min(sink_tokens, lo)); no other key is read, so the blocks
between them may be freed.

Keys are gathered per position (block id = block_table[pos // block_size]), so key tiles need not
line up with cache blocks. An fp8 cache (kv8) is read as it is stored, each fp8 tile converted to
the activations' dtype (exact); each program serves one KV head, so that head's key scale joins
the score scale and its value scale multiplies the output. For the power-of-two scales kv8
calibrates this equals dequantizing every key and value first, as the reference does. Every launch is sized from host ints only (B, max_query_len,
max_seq_len), never from device values: no host sync, and the launches can be graph-captured.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from hibana_kernels import counters, fusion, pdl, quant_triton
from hibana_kernels.attention import check_kv_scale
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.quant_triton import quantize_a8_blocks
from hibana_kernels.rotary import AttentionPrologue

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the same, for the kernels
DECODE_MIN_SPLIT = 64  # keys per split at least (a 16-bit cache's key tile; an fp8 cache's tile: 128)
DECODE_PROGRAMS_PER_SM = 4  # splits are added until the grid has this many programs per SM
MAX_SPLITS = 64  # 128 or 256 were slower at 8192 keys (H200: qwen3-30b-a3b 283.6 -> 260.2 / 177.0 tok/s)
MERGE_TILE = MAX_SPLITS
"""The split merge's tile of splits at least (`paged_attention_launch`): 64 where 16 would do at
1024 keys costs nothing measurable (qwen3-0.6b, H200: graph replay 0.786-0.792 ms against
0.788-0.789 at 512 keys) and keeps the merge's sums in one order across span graphs."""
WINDOW_SPLITS = True
"""Split a sliding-window layer's decode for its window's keys, not for the longest sequence: the
splits past the window held nothing (gpt-oss-20b at 8192 keys: 512 programs a sliding layer, 16 of
them with keys). The keys part alike either way (whole split tiles), so the outputs are the same
to the bit. A switch for A/B runs only (bench/tune_decode.py's variant window_splits=0)."""
MAX_DECODE_QUERY_LEN = 32  # verify steps up to this many tokens per sequence take the decode kernel
NUM_STAGES = 2
MERGE_COUNTERS = 1 << 16  # (sequence, KV head) pairs the in-kernel merge counts for, per device
MERGE_MAX_ROWS = 8  # query rows (group x tokens) one program merges in turn; more: a second launch


@triton.jit
def _gather_kv(cache_ptr, table_ptr, pos, pos_mask, kv_head, offs_d, d_mask,
               stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr):
    """[N, D] tile of one KV head at the given positions, 0 where masked."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    row = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    return tl.load(cache_ptr + row[:, None] + offs_d[None, :],
                   mask=pos_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def quantize_e4m3(x):
    """float32 -> float8_e4m3fn bit patterns (uint8), saturated at +-448 and rounded to nearest
    even, by integer operations only: the same bytes as torch's cast of the clamped values on
    every device (the interpreter's own float-to-fp8 cast does not round to nearest even)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = tl.minimum(a, 0x43E00000)  # 448: larger values and inf saturate
    # normal range (>= 2^-6): 3 of the 23 mantissa bits kept; a carry raises the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # below it: multiples of 2^-9 (the 24-bit significand shifted right by 141 - exponent)
    shift = tl.minimum(141 - (a >> 23), 30)
    significand = (a & 0x7FFFFF) | 0x800000
    q = significand >> shift
    rest = significand - (q << shift)
    half = 1 << (shift - 1)
    q += ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a >= 0x3C800000, normal, q)
    code = tl.where(nan, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def quantize_kv(x, scale):
    """Keys or values and their head's scale (broadcast) -> fp8 codes: x / scale, IEEE-rounded
    as torch divides, then `quantize_e4m3`."""
    return quantize_e4m3(tl.math.fdiv(x.to(tl.float32), scale, ieee_rounding=True))


@triton.jit
def normed(x, inv, w_ptr, offs, mask, UNIT_OFFSET: tl.constexpr):
    """A part of head rows (float32 values of the activations' dtype, w_ptr's) normalised by
    `inv` as the reference's RMSNorm rounds it: Llama's weight * round(x * inv), or Gemma's
    round(x * inv * (1 + weight)) all in float32."""
    dtype = w_ptr.dtype.element_ty
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        x = (x * inv) * (1.0 + w)
    else:
        x = w * (x * inv).to(dtype).to(tl.float32)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _prologue_tile(src, rows, pos, cos_ptr, sin_ptr, stride_table, w_ptr, eps,
                   HALF: tl.constexpr, PASS: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                   HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Head rows [R, HEAD_DIM_P] from `src` ([R, 1] pointers, `rows` their mask, `pos` their
    positions [R, 1]) through the attention prologue, as `rotary_triton._prologue_rows` rounds it:
    RMSNorm over the head when HAS_NORM, rotary on its first 2 * HALF dims, its last PASS dims
    through. Whole rows at once: each dim's rotary partner (rotate_half's) is loaded beside it,
    so the tile needs no shuffle. Returns the rows in the activations' dtype (src's), 0 where
    masked."""
    HEAD_DIM: tl.constexpr = 2 * HALF + PASS
    dtype = src.dtype.element_ty
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    d_mask = d < HEAD_DIM
    first, rotated = d < HALF, d < 2 * HALF
    partner = tl.where(first, d + HALF, tl.where(rotated, d - HALF, d))
    x = tl.load(src + d, mask=rows & d_mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rows & d_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = normed(x, inv, w_ptr, d, d_mask, UNIT_OFFSET)
        xp = normed(xp, inv, w_ptr, partner, d_mask, UNIT_OFFSET)
    # out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: each product and the sum
    # rounded to the activations' dtype, the tables' rows first cast to it
    table = pos * stride_table + d
    c = tl.load(cos_ptr + table, mask=rows & rotated, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=rows & rotated, other=0.0).to(dtype).to(tl.float32)
    out = (x * c).to(dtype).to(tl.float32) + (tl.where(first, -xp, xp) * s).to(dtype).to(tl.float32)
    return tl.where(rotated, out, x).to(dtype)


@triton.jit
def _prologue_keys(pos_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kw_ptr, slot_ptr, k_store_ptr, v_store_ptr,
                   k_scale_ptr, v_scale_ptr, eps, q_start, q_len, first_pos, split_lo, split_hi, kv_head,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_table, stride_slot, stride_head,
                   HALF: tl.constexpr, PASS: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_T: tl.constexpr,
                   HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, KV_FP8: tl.constexpr):
    """The keys and values of a sequence's new tokens (key positions first_pos + t) that fall in
    [split_lo, split_hi) into their cache slots (a negative slot: none), for one KV head."""
    t = tl.arange(0, BLOCK_T)
    key_pos = first_pos + t
    token = (q_start + t).to(tl.int64)
    mine = (t < q_len) & (key_pos >= split_lo) & (key_pos < split_hi)
    slot = tl.load(slot_ptr + token, mask=mine, other=-1).to(tl.int64)
    mine = mine & (slot >= 0)
    pos = tl.load(pos_ptr + token, mask=mine, other=0).to(tl.int64)
    k = _prologue_tile(k_ptr + token[:, None] * stride_kt + kv_head * stride_kh, mine[:, None], pos[:, None],
                       cos_ptr, sin_ptr, stride_table, kw_ptr, eps, HALF, PASS, HEAD_DIM_P, HAS_NORM, UNIT_OFFSET)
    d = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = mine[:, None] & (d < 2 * HALF + PASS)
    v = tl.load(v_ptr + token[:, None] * stride_vt + kv_head * stride_vh + d, mask=mask)
    if KV_FP8:
        k = quantize_kv(k, tl.load(k_scale_ptr + kv_head))
        v = quantize_kv(v, tl.load(v_scale_ptr + kv_head))
    dst = slot[:, None] * stride_slot + kv_head * stride_head + d
    tl.store(k_store_ptr + dst, k, mask=mask)
    tl.store(v_store_ptr + dst, v, mask=mask)


@triton.jit
def _queries_fp16(q):
    """Queries for dots on an fp8 cache taken in fp16: fp8 tiles become fp16 in one conversion
    (bf16: three), exactly; a bf16 query past fp16's range becomes its largest value, not inf."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # exact for bf16/fp16 inputs: their products are exact in float32
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend(q, k, v, visible, m_i, l_i, acc, qk_scale,
            DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step of the rows of q over one key tile (log2 domain)."""
    s = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * qk_scale  # [M, N]
    s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (-1e30), so a row with nothing visible yet keeps p = 0, alpha = 1
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _attend_keys(q, q_pos, row_mask, m_i, l_i, acc, lo, hi, window, sink_tokens, qk_scale,
                 k_cache_ptr, v_cache_ptr, table, kv_head, offs_d, d_mask,
                 stride_block, stride_slot, stride_head,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 SLIDING: tl.constexpr, SINK_TOKENS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The online softmax of the rows of q (at positions q_pos) over the keys at positions
    [lo, hi), key tile by key tile, no other key read. A key is visible to a row under the
    causal mask (CAUSAL) and the sliding window (SLIDING: less than `window` before the row's
    position, or with SINK_TOKENS one of the first `sink_tokens`)."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        k = _gather_kv(k_cache_ptr, table, pos, pos_mask, kv_head, offs_d, d_mask,
                       stride_block, stride_slot, stride_head, BLOCK_SIZE)
        v = _gather_kv(v_cache_ptr, table, pos, pos_mask, kv_head, offs_d, d_mask,
                       stride_block, stride_slot, stride_head, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)  # fp8: exact; otherwise no-ops
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & row_mask[:, None] & pos_mask[None, :]
        else:
            visible = row_mask[:, None] & pos_mask[None, :]
        if SLIDING:
            in_window = q_pos[:, None] - pos[None, :] < window
            if SINK_TOKENS:
                in_window = in_window | (pos[None, :] < sink_tokens)
            visible = visible & in_window
        m_i, l_i, acc = _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION, UPCAST)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["sink_tokens"])
def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, window, sink_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        stride_block, stride_slot, stride_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, SINK_TOKENS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_FP16: tl.constexpr,
        SINKS: tl.constexpr):
    # rows of a tile: BLOCK_Q = BLOCK_M // GROUP query tokens x the GROUP heads of one KV head
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP  # [M] query token within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = first_pos + q_idx
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [M, D]

    # keys the tile can see: [lo, hi)
    tile_first = first_pos + q_tile * BLOCK_Q
    hi = tl.minimum(tile_first + BLOCK_Q, seq_len)
    lo = 0
    if SLIDING:
        lo = tl.maximum(tile_first - window + 1, 0)

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    if FP8_AS_FP16:
        q = _queries_fp16(q)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink as a first key with no value: its exp2 is 1 at the running maximum
        m_i = tl.load(sinks_ptr + head, mask=row_mask, other=-1.0e30).to(tl.float32) * _LOG2E
        l_i = tl.where(row_mask, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if SINK_TOKENS:  # the sink tokens before the tile's window (causal: they precede every row)
        m_i, l_i, acc = _attend_keys(
            q, q_pos, row_mask, m_i, l_i, acc, 0, tl.minimum(sink_tokens, lo), window, sink_tokens,
            qk_scale, k_cache_ptr, v_cache_ptr, table, kv_head, offs_d, d_mask, stride_block,
            stride_slot, stride_head, BLOCK_SIZE, BLOCK_N, True, False, False, DOT_PRECISION, UPCAST)
    m_i, l_i, acc = _attend_keys(
        q, q_pos, row_mask, m_i, l_i, acc, lo, hi, window, sink_tokens, qk_scale,
        k_cache_ptr, v_cache_ptr, table, kv_head, offs_d, d_mask, stride_block, stride_slot,
        stride_head, BLOCK_SIZE, BLOCK_N, True, SLIDING, SINK_TOKENS, DOT_PRECISION, UPCAST)

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["sink_tokens"])
def _decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        counter_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        k_scale_ptr, v_scale_ptr, sinks_ptr, qk_scale, window, sink_tokens, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        stride_block, stride_slot, stride_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        SLIDING: tl.constexpr, SINK_TOKENS: tl.constexpr, SPLIT: tl.constexpr, SPLIT_TILE: tl.constexpr,
        MERGE: tl.constexpr, SPLITS_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr, QUERY_LEN: tl.constexpr, KV_FP8: tl.constexpr, FP8_AS_FP16: tl.constexpr,
        SINKS: tl.constexpr, PDL: tl.constexpr,
        pos_ptr=None, k_ptr=None, v_ptr=None, cos_ptr=None, sin_ptr=None, qw_ptr=None, kw_ptr=None,
        slot_ptr=None, k_store_ptr=None, v_store_ptr=None, eps=None, stride_kt=None, stride_kh=None,
        stride_vt=None, stride_vh=None, stride_table=None, PROLOGUE: tl.constexpr = False,
        HALF: tl.constexpr = 0, PASS: tl.constexpr = 0, BLOCK_T: tl.constexpr = 1,
        HAS_NORM: tl.constexpr = False, UNIT_OFFSET: tl.constexpr = False):
    # rows of a tile: QUERY_LEN new tokens x the GROUP heads of one KV head. PROLOGUE: q is the
    # projection's, and the layer's prologue runs here (`rotary_triton.fold_args`)
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start  # QUERY_LEN, or 0: a sequence with no query
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - QUERY_LEN - window + 1, 0)
    # this split's share of [lo, seq_len), whole SPLIT_TILEs of keys (a multiple of BLOCK_N; the
    # sink tokens before lo: split 0's). A sequence of at most num_splits tiles gets a tile a
    # split whatever num_splits is: launches of several split counts part its keys alike
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), SPLIT_TILE) * SPLIT_TILE
    split_lo = lo + split * per_split
    split_hi = tl.minimum(split_lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    q_idx = g // GROUP  # query token within the sequence
    head = kv_head * GROUP + g % GROUP
    g_mask = g < GROUP * q_len  # q_len is QUERY_LEN or 0 (not `& (q_len > 0)`: the interpreter
                                # mishandles a scalar & a block)
    q_pos = seq_len - QUERY_LEN + q_idx
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    if PROLOGUE:
        # every split normalises and rotates its query rows; the one holding a new token's
        # position stores its key and value, then reads them back as any key (its threads'
        # stores made visible to all of them by a CTA barrier)
        pos = tl.load(pos_ptr + token, mask=g_mask, other=0).to(tl.int64)
        q = _prologue_tile(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh, g_mask[:, None],
                           pos[:, None], cos_ptr, sin_ptr, stride_table, qw_ptr, eps,
                           HALF, PASS, HEAD_DIM_P, HAS_NORM, UNIT_OFFSET)  # [G, D]
        _prologue_keys(pos_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kw_ptr, slot_ptr, k_store_ptr, v_store_ptr,
                       k_scale_ptr, v_scale_ptr, eps, q_start, q_len, seq_len - QUERY_LEN, split_lo, split_hi,
                       kv_head, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
                       stride_slot, stride_head, HALF, PASS, HEAD_DIM_P, BLOCK_T, HAS_NORM, UNIT_OFFSET, KV_FP8)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    if FP8_AS_FP16:
        q = _queries_fp16(q)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if SINKS:  # the sink as a first key with no value, in the first split only
        if split == 0:
            m_i = tl.load(sinks_ptr + head, mask=g_mask, other=-1.0e30).to(tl.float32) * _LOG2E
            l_i = tl.where(g_mask, 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_P], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if SINK_TOKENS:  # the sink tokens before the window, in the first split only
        sink_hi = tl.where(split == 0, tl.minimum(sink_tokens, lo), 0)
        m_i, l_i, acc = _attend_keys(
            q, q_pos, g_mask, m_i, l_i, acc, 0, sink_hi, window, sink_tokens, qk_scale,
            k_cache_ptr, v_cache_ptr, table, kv_head, offs_d, d_mask, stride_block, stride_slot,
            stride_head, BLOCK_SIZE, BLOCK_N, True, False, False, DOT_PRECISION, UPCAST)
    # one new token per sequence (QUERY_LEN 1) sees every key of [lo, seq_len): no mask
    m_i, l_i, acc = _attend_keys(
        q, q_pos, g_mask, m_i, l_i, acc, split_lo, split_hi, window, sink_tokens, qk_scale,
        k_cache_ptr, v_cache_ptr, table, kv_head, offs_d, d_mask, stride_block, stride_slot,
        stride_head, BLOCK_SIZE, BLOCK_N, QUERY_LEN > 1, SLIDING and QUERY_LEN > 1, SINK_TOKENS,
        DOT_PRECISION, UPCAST)

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if SPLIT:
        # partials: [T, H, num_splits] for max and sum, [T, H, num_splits, D] for the output.
        # Splits past the keys (bounds overstated in graphs: num_splits for the longest
        # sequence the engine takes) write nothing; only the first `with_keys` are read
        num_heads = GROUP * tl.num_programs(1)
        part = (token * num_heads + head) * num_splits + split
        with_keys = tl.cdiv(seq_len - lo, tl.maximum(per_split, 1))
        keys_mask = g < tl.where(split < with_keys, GROUP * q_len, 0)  # g_mask where the split holds keys
        tl.store(part_max_ptr + part, m_i, mask=keys_mask)
        tl.store(part_sum_ptr + part, l_i, mask=keys_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc,
                 mask=keys_mask[:, None])
        if not MERGE:  # the first split tells the reduce how many to read, per query row
            first_mask = g < tl.where(split == 0, GROUP * q_len, 0)
            tl.store(counter_ptr + token * num_heads + head, tl.zeros([BLOCK_G], dtype=tl.int32) + with_keys,
                     mask=first_mask)
        if MERGE:
            # every thread's partials are written before one thread releases them with the
            # count (a CTA barrier, then an acq_rel atomic: the pattern of CUTLASS's semaphores);
            # the last split to arrive acquires all of them, merges, and zeroes the counter
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:  # only the splits with keys are read
                for row in tl.static_range(GROUP * QUERY_LEN):
                    if row < GROUP * q_len:
                        _merge_splits(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                                      q_start + row // GROUP, kv_head * GROUP + row % GROUP,
                                      num_heads, num_splits, with_keys, stride_ot, stride_oh, 0,
                                      HEAD_DIM, HEAD_DIM_P, SPLITS_P, HEAD_DIM_P)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, token, head, num_heads,
                  num_splits, read_splits, stride_ot, stride_oh, d_start,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """One query row's output from the partials of its first `read_splits` splits (read past
    the L1: the splits ran on other SMs), all of them in one tile of SPLITS_P: one round of
    loads. (Summed 16 at a time in a loop, in an order that would not depend on the tile's
    width, the merge made qwen3-8b's decode at 8192 keys 7% slower on the H200: bf16 188.4
    against 203.1 tok/s, int4 361.6 against 408.4, bench/RESULTS.md 2026-12-04.) The columns
    [d_start, d_start + BLOCK_D) of the row. The order of each column's sum follows the tile's
    layout on the GPU (its columns and warps; on the CUDA partition test, 32 columns in one warp
    gave other last bits than the whole row in four): every launch keeps one merge tile
    (`_merge_tiles`) so that graphs of several spans agree."""
    read_splits = tl.minimum(tl.maximum(read_splits, 0), num_splits)
    splits = tl.arange(0, SPLITS_P)
    s_mask = splits < read_splits
    part = (token * num_heads + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=s_mask, other=-1.0e30, cache_modifier=".cg")
    l = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0, cache_modifier=".cg")
    offs_d = d_start + tl.arange(0, BLOCK_D)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0, cache_modifier=".cg")  # [S, BLOCK_D]
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)
    total = tl.sum(l * w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _reduce_splits_kernel(
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, with_keys_ptr, num_splits,
        stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr, BLOCK_D: tl.constexpr,
        PDL: tl.constexpr, q_ptr=None, d_ptr=None, A8_ORDER: tl.constexpr = -1):
    # every query row of the batch, BLOCK_D columns a program: each row was written by its splits
    # that hold keys, as many as its first split wrote in with_keys [T, H]. A8_ORDER >= 0 (out
    # contiguous, HEAD_DIM and BLOCK_D whole blocks of 32): the program's columns also as x's int8
    # codes for the output projection's x int8 GEMV (`quant_triton.quantize_a8_blocks` on what it
    # wrote, after a barrier: the writes of this program are visible to it)
    wait_for_previous(PDL)
    token, head, num_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    read_splits = tl.load(with_keys_ptr + token * num_heads + head)
    d_start = tl.program_id(2) * BLOCK_D
    _merge_splits(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, token, head, num_heads,
                  num_splits, read_splits, stride_ot, stride_oh, d_start, HEAD_DIM, HEAD_DIM_P, SPLITS_P, BLOCK_D)
    if A8_ORDER >= 0:
        tl.debug_barrier()
        width = num_heads * HEAD_DIM
        row = token.to(tl.int64)
        quantize_a8_blocks(out_ptr + row * stride_ot, q_ptr + row * (width // 4), d_ptr + row * (width // 16),
                           (head * HEAD_DIM + d_start) // 32, width, BLOCK_D // 32, A8_ORDER)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, sliding_window: int | None = None,
                    uniform_query_len: bool = False, kv_scale: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, sink_tokens: int = 0, a8_order: int = -1,
                    prologue: AttentionPrologue | None = None):
    """See `hibana_kernels.attention.paged_attention`. Decode batches (max_query_len == 1, or
    every sequence with max_query_len <= 32 new tokens: `uniform_query_len`) take the decode
    kernel, split along the sequence when the batch alone would not fill the device.
    `a8_order` >= 0: (out, q, d), the output's rows [T, H * D] also as x's int8 codes in that
    order (`quant_triton.quantize_a8`'s), written by the split merge where there is one. `prologue`:
    see `kernels.paged_attention`; in the decode kernel where the fusion policy folds it, else its
    own launch first."""
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    num_splits = 1
    decode = max_query_len == 1 or (uniform_query_len and max_query_len <= MAX_DECODE_QUERY_LEN)
    if decode:  # a split holds whole key tiles: no shorter than the cache's tile
        head_dim_p = max(16, triton.next_power_of_2(q.shape[-1]))
        min_split = max(DECODE_MIN_SPLIT, _decode_tiles(q.dtype, head_dim_p, kv_scale is not None)[0])
        keys = max_seq_len
        if sliding_window is not None and WINDOW_SPLITS:  # a window's keys at most (sink tokens: split 0's)
            keys = min(keys, sliding_window + max_query_len - 1)
        num_splits = _num_splits(q.device, num_seqs * num_kv_heads, keys, min_split)
    if prologue is not None and not fusion.policy().attention_prologue:  # (folded only into decode: the launch's)
        q = prologue.run(importlib.import_module("hibana_kernels.rotary_triton"), q, k_cache, v_cache, kv_scale)
        prologue = None
    return paged_attention_launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                  max_query_len, scale, sliding_window, num_splits, decode=decode,
                                  kv_scale=kv_scale, sinks=sinks, sink_tokens=sink_tokens, a8_order=a8_order,
                                  prologue=prologue)


def paged_attention_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                           sliding_window: int | None, num_splits: int,
                           tiles: tuple[int, ...] | None = None, decode: bool | None = None,
                           merge: bool | None = None, merge_tiles: tuple[int, int] | None = None,
                           kv_scale: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None, sink_tokens: int = 0, a8_order: int = -1,
                           prologue: AttentionPrologue | None = None):
    """The launches behind `paged_attention`, with the decode split count chosen by the caller
    (tests use it to cover split and unsplit decode on the same shapes). `tiles`, for the tuning
    script: (BLOCK_N, num_warps, num_stages) for decode, (BLOCK_M, BLOCK_N, num_warps,
    num_stages) for prefill. `decode`: every sequence has max_query_len new tokens (or none) and
    the decode kernel takes them (default: when max_query_len == 1). `merge`: split decode
    merges in the same launch (default: as the fusion policy says) where a program's query rows
    are few enough (MERGE_MAX_ROWS) for its last split to merge them in turn. `merge_tiles`:
    (columns, num_warps) of a program of the separate merge (default `_merge_tiles`). `kv_scale`: an
    fp8 cache's. `sinks`: per-head sink logits [H], which the kernels start each row's online
    softmax from (in the log2 domain, as the scores). `sink_tokens`: with a sliding window, the
    keys below it stay visible: those before a program's window get a loop of their own ahead
    of the window's (in split decode, the first split's). A runtime int: one compiled kernel
    serves every value; without sink tokens or a window the loop is not compiled in. `a8_order`:
    see `paged_attention`. `prologue`: in the decode kernel (with `decode`), else its own launch first."""
    check_kv_scale(k_cache, kv_scale)
    if decode is None:
        decode = max_query_len == 1
    fold = {}
    if prologue is not None:
        rotary_triton = importlib.import_module("hibana_kernels.rotary_triton")
        if decode:
            fold = rotary_triton.fold_args(q, prologue, k_cache, v_cache, kv_scale)
        else:
            q = prologue.run(rotary_triton, q, k_cache, v_cache, kv_scale)
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged_attention wants k_cache and v_cache alike, head_dim contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def result(codes: tuple[torch.Tensor, torch.Tensor] | None = None):
        """out, or with a8_order (out, q, d): the codes the merge wrote, else one quantize launch's."""
        if a8_order < 0:
            return out
        if codes is None:
            codes = (quant_triton.quantize_a8(out.view(num_tokens, -1), a8_order) if num_tokens else
                     quant_triton.a8_codes(0, num_heads * head_dim, q.device))
        return (out, *codes)

    if num_tokens == 0:
        return result()
    kv_fp8 = kv_scale is not None
    with_sink_tokens = sliding_window is not None and sink_tokens > 0
    common = dict(
        k_scale_ptr=kv_scale[0] if kv_fp8 else q, v_scale_ptr=kv_scale[1] if kv_fp8 else q,
        sinks_ptr=q if sinks is None else sinks.contiguous(), SINKS=sinks is not None,  # in log2 inside
        qk_scale=scale * LOG2E, window=sliding_window or 0, KV_FP8=kv_fp8,
        # bf16 queries on an fp8 cache: the dots in fp16 (fp8 -> fp16 is one instruction on
        # sm_89+, -> bf16 three; with bf16 the fp8 decode kernel ran slower than on a bf16 cache)
        FP8_AS_FP16=kv_fp8 and q.dtype == torch.bfloat16,
        # unused, None: no kernel argument at all, so that path compiles as before sink tokens
        sink_tokens=sink_tokens if with_sink_tokens else None, SINK_TOKENS=with_sink_tokens,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0),
        stride_oh=out.stride(1), stride_bt=block_tables.stride(0),
        stride_block=k_cache.stride(0), stride_slot=k_cache.stride(1),
        stride_head=k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, SLIDING=sliding_window is not None,
        DOT_PRECISION="ieee",  # fp32 inputs: exact products, not tf32; no effect on bf16/fp16
        # Triton's interpreter (CPU tensors) gets tl.dot of bf16 tiles wrong (triton 3.9)
        UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,
    )
    if not decode:
        block_m, block_n, num_warps, num_stages = tiles or _prefill_tiles(q.dtype, common["HEAD_DIM_P"], kv_fp8)
        block_m = max(block_m, triton.next_power_of_2(group))  # rows: query tokens x group heads
        block_q = block_m // group
        grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
        _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                              BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
                              num_warps=num_warps, num_stages=num_stages, **common)
        return result()

    split = num_splits > 1
    part_shape = (num_tokens, num_heads, num_splits) if split else (1,)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_out = torch.empty(part_shape + (common["HEAD_DIM_P"],) if split else (1,),
                           dtype=torch.float32, device=q.device)
    if merge is None:
        merge = fusion.policy().attention_merge
    merge = (split and merge and num_seqs * num_kv_heads <= MERGE_COUNTERS
             and group * max_query_len <= MERGE_MAX_ROWS)
    # the merge's tile of splits: one width whatever the count (a tree's sums depend on its
    # width), so that launches which part a sequence's keys alike agree to the bit (graphs of
    # several spans)
    splits_p = max(MERGE_TILE, triton.next_power_of_2(num_splits))
    block_n, num_warps, num_stages = tiles or _decode_tiles(q.dtype, common["HEAD_DIM_P"], kv_fp8)
    # MERGE: the arrival counters; else the splits with keys per query row, for the reduce
    with_keys = torch.empty((num_tokens, num_heads) if split and not merge else (1,), dtype=torch.int32,
                            device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_max, part_sum,
        _merge_counters(q.device) if merge else with_keys, block_tables, seq_lens,
        query_start_loc, num_splits=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group * max_query_len)), BLOCK_N=block_n, SPLIT=split,
        SPLIT_TILE=max(DECODE_MIN_SPLIT, block_n),
        MERGE=merge, SPLITS_P=splits_p, QUERY_LEN=max_query_len, num_warps=num_warps,
        num_stages=num_stages, BLOCK_T=triton.next_power_of_2(max_query_len), **fold, **common,
        **pdl.launch_args(q.device, "attention"))
    codes = None
    if split and not merge:
        block_d, merge_warps = merge_tiles or _merge_tiles(common["HEAD_DIM_P"])
        block_d = min(block_d, common["HEAD_DIM_P"])  # a tile past the row would read the next row's
        # the merge writes the codes where its programs' columns are whole blocks of them
        if a8_order >= 0 and head_dim == common["HEAD_DIM_P"] and block_d % quant_triton.A8_BLOCK == 0:
            codes = quant_triton.a8_codes(num_tokens, num_heads * head_dim, q.device)
        _reduce_splits_kernel[(num_tokens, num_heads, triton.cdiv(common["HEAD_DIM_P"], block_d))](
            out, part_out, part_max, part_sum, with_keys, num_splits,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_P=common["HEAD_DIM_P"],
            SPLITS_P=splits_p, BLOCK_D=block_d, num_warps=merge_warps,
            q_ptr=out if codes is None else codes[0], d_ptr=out if codes is None else codes[1],
            A8_ORDER=-1 if codes is None else a8_order, **pdl.launch_args(q.device, "attention"))
    return result(codes)


def _merge_tiles(head_dim_p: int) -> tuple[int, int]:
    """(columns, num_warps) of a separate merge's program: a whole row in 4 warps."""
    return head_dim_p, 4


def _merge_counters(device: torch.device) -> torch.Tensor:
    """The in-kernel merge's arrival counts, one per (sequence, KV head)."""
    return counters.counters("attention merge", MERGE_COUNTERS, device)


def _prefill_tiles(dtype: torch.dtype, head_dim_p: int, kv_fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): for 16-bit inputs the best of a sweep on the
    H200 for 512-token chunks (bench/notes_decode.md; an fp8 cache: twice the keys a tile,
    bench/kv8_attention.py); float32, the exactness path, the largest tiles ptxas fits in
    registers for sm_90 with 4 warps."""
    if dtype == torch.float32:
        return ((32, 16) if head_dim_p <= 64 else (16, 16)) + (4, NUM_STAGES)
    if head_dim_p > 128:
        return 32, 16, 4, NUM_STAGES
    return (64, 128, 4, 3) if kv_fp8 else (64, 64, 4, 3)


def _decode_tiles(dtype: torch.dtype, head_dim_p: int, kv_fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): for 16-bit caches, the best of a sweep over tiles and
    splits on the H200 (bench/notes_decode.md); an fp8 cache reads half the bytes a key, so
    its tile takes twice the keys (bench/kv8_attention.py: 32 x 4608 keys 121 us against 181
    at 64 keys and bf16's 146); float32 as in _prefill_tiles."""
    if dtype == torch.float32:
        return ((32, 8) if head_dim_p <= 128 else (16, 4)) + (NUM_STAGES,)
    if head_dim_p > 128:
        return 32, 4, NUM_STAGES
    return (128, 4, 3) if kv_fp8 else (64, 4, 3)


def _num_splits(device: torch.device, programs: int, max_seq_len: int,
                min_split: int = DECODE_MIN_SPLIT) -> int:
    """As many splits as keep the grid within one wave of DECODE_PROGRAMS_PER_SM programs per SM
    (a second, partial wave costs more than the splits save), none shorter than `min_split`
    keys. (With the bound overstated, as in CUDA graphs, splits past a sequence's end exit.)"""
    target = DECODE_PROGRAMS_PER_SM * counters.sm_count(device)
    by_length = triton.cdiv(max(max_seq_len, 1), min_split)
    return max(1, min(target // programs, by_length, MAX_SPLITS))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """See `hibana_kernels.attention.store_kv`: negative slots are skipped, with no host sync;
    an fp8 cache takes the bytes of `quantize_kv`."""
    check_kv_scale(k_cache, kv_scale)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if (k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
            or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1)):
        raise ValueError("store_kv wants k_cache and v_cache alike, slots and head_dim contiguous")
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    kv_fp8 = kv_scale is not None
    if kv_fp8:  # fp8 codes are written as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, kv_scale[0] if kv_fp8 else k, kv_scale[1] if kv_fp8 else k,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=kv_fp8, num_warps=4 if block_h * block_d >= 2048 else 1)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    # a slot's row: the cache is [num_blocks, block_size, ...], so slot * stride_slot lands on it
    dst = slot * stride_slot + h * stride_head + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        k = quantize_kv(k, tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0))
        v = quantize_kv(v, tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0))
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)
