"""Rotary position embedding: Triton kernel, same signature as `kernels.rotary`.

One program per token rotates all its query and key heads; q and k may be strided views (e.g.
slices of a fused QKV projection), the results are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
                   NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    jm = j < HALF
    row = pos * stride_table
    dtype = q_ptr.dtype.element_ty
    # the tables' rows cast to the activations' dtype first, as the reference does
    c1 = tl.load(cos_ptr + row + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + row + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, c1, c2, s1, s2,
                  NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, c1, c2, s1, s2,
                  NUM_KV_HEADS, HALF, BLOCK_KV, BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """See `kernels.rotary.rotary_embedding` (out of place)."""
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
