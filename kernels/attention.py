"""Attention over a paged KV cache: plain-torch references (CPU path, and the oracle for Triton).

KV cache layout, one layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (a token's row in cache.view(-1, H_kv, D))

A step packs the new tokens of all sequences back to back ("varlen"): sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1], and after this step holds seq_lens[i] tokens of context,
the last (query_len) of which are its new tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' keys and values into their cache slots."""
    num_kv_heads, head_dim = k.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [T, H_kv, D]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: Sequence[int],
                    query_start_loc: Sequence[int], scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged context.

    q: [T, H, D]; block_tables: [B, max_blocks]; seq_lens, query_start_loc: host ints (B and B+1).
    A query at position p sees keys at positions j with j <= p and, with a sliding window w,
    p - j < w (the convention of Hugging Face's masks). Returns [T, H, D].
    """
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, ctx_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        num_q = end - start
        blocks = block_tables[i, : (ctx_len + block_size - 1) // block_size]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]  # [L, H_kv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)  # [L, H, D]
            v = v.repeat_interleave(group, dim=1)
        q_pos = torch.arange(ctx_len - num_q, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        needs_mask = num_q > 1 or (sliding_window is not None and ctx_len > sliding_window)
        mask = None
        if needs_mask:
            mask = k_pos <= q_pos  # [Q, L]
            if sliding_window is not None:
                mask &= q_pos - k_pos < sliding_window
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale)  # [1, H, Q, D]
        out[start:end] = o[0].transpose(0, 1)
    return out
