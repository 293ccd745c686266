"""Rotary position embedding: Triton kernels, same signatures as `hibana_kernels.rotary`.

`rotary_embedding`: one program per token rotates all its query and key heads; q and k may be
strided views (e.g. slices of a fused QKV projection), the results are new contiguous tensors.
`qk_norm_rotary_store`: the whole attention prologue (q/k norm, rotary, K/V into the cache) in
one launch, one program per (token, KV head) handling the query heads of its group; an fp8 cache
takes the bytes of `attention_triton.quantize_kv`. A head's dims, as it reads them:

    [ x1: HALF | x2: HALF | x3: PASS ]    rotary over x1, x2 (the table's width, 2 * HALF);
                                          x3, Phi's partial rotary, passes through (PASS = 0: none)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hibana_kernels import pdl
from hibana_kernels.attention import check_kv_scale
from hibana_kernels.rotary import AttentionPrologue
from hibana_kernels.attention_triton import normed, quantize_kv
from hibana_kernels.pdl import wait_for_previous


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, stride_t, stride_h, c1, c2, s1, s2,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    src = x_ptr + token * stride_t + h * stride_h + j
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, with every product and the sum rounded to the
    # activations' dtype as torch does; rotate_half(x) = [-x2, x1]
    o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    dst = out_ptr + token * (NUM_HEADS * 2 * HALF) + h * (2 * HALF) + j
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _table_row(cos_ptr, sin_ptr, row, j, jm, act_ptr, HALF: tl.constexpr):
    """The halves of one position's cos and sin rows, cast to the activations' dtype (act_ptr's)
    first as the reference does, then to float32."""
    dtype = act_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + row + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + row + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    jm = j < HALF
    c1, c2, s1, s2 = _table_row(cos_ptr, sin_ptr, pos * stride_table, j, jm, q_ptr, HALF)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, c1, c2, s1, s2,
                  NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, c1, c2, s1, s2,
                  NUM_KV_HEADS, HALF, BLOCK_KV, BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.rotary.rotary_embedding` (out of place)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_table.stride() != sin_table.stride() \
            or cos_table.stride(1) != 1 or q.dtype != k.dtype:
        raise ValueError("rotary_embedding wants head_dim contiguous, q and k of one dtype, "
                         "cos and sin tables alike")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos_table, sin_table, q_out, k_out, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos_table.stride(0), NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return q_out, k_out


@triton.jit
def _store(ptr, x, mask, scale, QUANTIZE: tl.constexpr):
    """x stored; as fp8 codes of its head's `scale` when QUANTIZE (x in the activations' dtype:
    the reference quantizes keys as rounded to it)."""
    if QUANTIZE:
        x = quantize_kv(x, scale)
    tl.store(ptr, x, mask=mask)


@triton.jit
def _prologue_rows(src, dst, rows, w_ptr, c1, c2, s1, s2, eps, j, p, scale,
                   HALF: tl.constexpr, PASS: tl.constexpr, HAS_NORM: tl.constexpr,
                   UNIT_OFFSET: tl.constexpr, QUANTIZE: tl.constexpr):
    """Head rows from `src` to `dst` ([rows, 1] pointers, `rows` their mask): RMSNorm over the
    whole head when HAS_NORM, rotary on its first 2 * HALF dims, its last PASS dims through.
    Every rounding of the reference: the norm's output, each rotary product and sum in the
    activations' dtype (w_ptr's)."""
    dtype = w_ptr.dtype.element_ty
    jm = j < HALF
    x1 = tl.load(src + j, mask=rows & jm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j, mask=rows & jm, other=0.0).to(tl.float32)
    if PASS > 0:  # (a constexpr branch: x3 exists only where PASS does)
        pm = p < PASS
        x3 = tl.load(src + 2 * HALF + p, mask=rows & pm, other=0.0).to(tl.float32)
    if HAS_NORM:
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if PASS > 0:
            squares += tl.sum(x3 * x3, 1)
        inv = tl.rsqrt(squares / (2 * HALF + PASS) + eps)[:, None]
        x1 = normed(x1, inv, w_ptr, j, jm, UNIT_OFFSET)
        x2 = normed(x2, inv, w_ptr + HALF, j, jm, UNIT_OFFSET)
        if PASS > 0:
            x3 = normed(x3, inv, w_ptr + 2 * HALF, p, pm, UNIT_OFFSET)
    # out = x * cos + rotate_half(x) * sin over the rotated dims; rotate_half(x) = [-x2, x1]
    o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    _store(dst + j, o1.to(dtype), rows & jm, scale, QUANTIZE)
    _store(dst + HALF + j, o2.to(dtype), rows & jm, scale, QUANTIZE)
    if PASS > 0:
        _store(dst + 2 * HALF + p, x3.to(dtype), rows & pm, scale, QUANTIZE)


@triton.jit
def _prologue_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                     k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr, k_scale_ptr, v_scale_ptr, eps,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_table, stride_slot, stride_head,
                     GROUP: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                     KV_FP8: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, KV head): its query heads' rows, then its key and value rows."""
    wait_for_previous(PDL)
    HEAD_DIM: tl.constexpr = 2 * HALF + PASS
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    p = tl.arange(0, BLOCK_PASS)[None, :]
    c1, c2, s1, s2 = _table_row(cos_ptr, sin_ptr, pos * stride_table, j, j < HALF, q_ptr, HALF)

    g = tl.arange(0, BLOCK_G)[:, None]  # the query heads of this KV head's group
    head = kv_head * GROUP + g
    _prologue_rows(q_ptr + token * stride_qt + head * stride_qh,
                   q_out_ptr + token * (GROUP * tl.num_programs(1) * HEAD_DIM) + head * HEAD_DIM,
                   g < GROUP, qw_ptr, c1, c2, s1, s2, eps, j, p, 1.0,
                   HALF, PASS, HAS_NORM, UNIT_OFFSET, False)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # (names inside the branch are new: Triton wants one type per name)
        one = tl.arange(0, 1)[:, None]  # the one key head, as [1, 1] rows
        slot_row = slot * stride_slot + kv_head * stride_head
        k_scale = tl.load(k_scale_ptr + kv_head) if KV_FP8 else 1.0
        _prologue_rows(k_ptr + token * stride_kt + kv_head * stride_kh + one, k_cache_ptr + slot_row + one,
                       one < 1, kw_ptr, c1, c2, s1, s2, eps, j, p, k_scale,
                       HALF, PASS, HAS_NORM, UNIT_OFFSET, KV_FP8)
        d = tl.arange(0, BLOCK_D)[None, :]
        v_row = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + d, mask=d < HEAD_DIM)
        v_scale = tl.load(v_scale_ptr + kv_head) if KV_FP8 else 1.0
        _store(v_cache_ptr + slot_row + d, v_row, d < HEAD_DIM, v_scale, KV_FP8)


def qk_norm_rotary_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                         eps: float = 0.0, kv_scale: torch.Tensor | None = None,
                         unit_offset: bool = False) -> torch.Tensor:
    """See `hibana_kernels.rotary.qk_norm_rotary_store`."""
    check_prologue(q, k, v, cos_table, sin_table, k_cache, v_cache, q_weight, k_weight, kv_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_table.shape[1]
    has_norm = q_weight is not None
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kv_fp8 = kv_scale is not None
    if kv_fp8:  # fp8 codes are written as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if num_tokens:
        group, half, rest = num_heads // num_kv_heads, rotary_dim // 2, head_dim - rotary_dim
        _prologue_kernel[(num_tokens, num_kv_heads)](
            positions, q, k, v, cos_table, sin_table, q_weight if has_norm else q,
            k_weight if has_norm else k, k_cache, v_cache, slot_mapping, q_out,
            kv_scale[0] if kv_fp8 else q, kv_scale[1] if kv_fp8 else q, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_table.stride(0), k_cache.stride(1), k_cache.stride(2),
            GROUP=group, HALF=half, PASS=rest, BLOCK_G=triton.next_power_of_2(group),
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(max(rest, 1)),
            BLOCK_D=triton.next_power_of_2(head_dim), HAS_NORM=has_norm, UNIT_OFFSET=unit_offset,
            KV_FP8=kv_fp8, num_warps=1 if group <= 2 else 4, **pdl.launch_args(q.device))
    return q_out


def check_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor,
                   sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                   kv_scale: torch.Tensor | None) -> None:
    """What the prologue's kernels (this one, or folded into decode attention) take."""
    check_kv_scale(k_cache, kv_scale)
    rotary_dim = cos_table.shape[1]
    if (q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or rotary_dim % 2
            or not 0 < rotary_dim <= q.shape[2]
            or cos_table.stride() != sin_table.stride() or cos_table.stride(1) != 1
            or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1
            or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1)):
        raise ValueError("qk_norm_rotary_store wants head_dim contiguous, cos and sin tables alike "
                         "and of an even width up to head_dim, k_cache and v_cache alike with slots "
                         "contiguous")
    if q_weight is not None and (q_weight.dtype != q.dtype or k_weight is None or k_weight.dtype != q.dtype):
        raise ValueError("qk_norm_rotary_store wants q and k norm weights in the activations' dtype")


def fold_args(q: torch.Tensor, prologue: AttentionPrologue, k_cache: torch.Tensor, v_cache: torch.Tensor,
              kv_scale: torch.Tensor | None) -> dict:
    """The decode attention kernel's arguments for running `prologue` in its programs
    (`attention_triton._decode_kernel`'s PROLOGUE)."""
    p = prologue
    check_prologue(q, p.k, p.v, p.cos_table, p.sin_table, k_cache, v_cache, p.q_weight, p.k_weight, kv_scale)
    has_norm = p.q_weight is not None
    rotary_dim = p.cos_table.shape[1]
    kv_fp8 = kv_scale is not None
    return dict(
        pos_ptr=p.positions, k_ptr=p.k, v_ptr=p.v, cos_ptr=p.cos_table, sin_ptr=p.sin_table,
        qw_ptr=p.q_weight if has_norm else q, kw_ptr=p.k_weight if has_norm else q, slot_ptr=p.slot_mapping,
        # fp8 codes are written as bytes
        k_store_ptr=k_cache.view(torch.uint8) if kv_fp8 else k_cache,
        v_store_ptr=v_cache.view(torch.uint8) if kv_fp8 else v_cache, eps=p.eps,
        stride_kt=p.k.stride(0), stride_kh=p.k.stride(1), stride_vt=p.v.stride(0), stride_vh=p.v.stride(1),
        stride_table=p.cos_table.stride(0), PROLOGUE=True, HALF=rotary_dim // 2, PASS=q.shape[2] - rotary_dim,
        HAS_NORM=has_norm, UNIT_OFFSET=p.unit_offset)
