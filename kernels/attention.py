"""Attention over a paged KV cache: plain-torch references (CPU path, and the oracle for Triton).

KV cache layout, one layer:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset          (a token's row in cache.view(-1, H_kv, D))

A step packs the new tokens of all sequences back to back ("varlen"): sequence i owns query rows
query_start_loc[i]:query_start_loc[i+1], and after this step holds seq_lens[i] tokens of context,
the last (query_len) of which are its new tokens.

    query rows:  | seq 0: 5 new tokens | seq 1: 1 | seq 2: 3 |     query_start_loc = [0, 5, 6, 9]
    seq 0 keys:  [ 0 ....................... seq_lens[0] )     its queries: the last 5 positions

An fp8 cache (float8_e4m3fn, the kv8 surgery pass) comes with `kv_scale`, float32 [2, H_kv]: the
scale of each KV head's keys (row 0) and values (row 1). A stored value is
`fp8(clamp(x / scale, -448, 448))`, rounded to nearest even (saturating, never inf or NaN); it
reads back as `fp8 * scale` in the activations' dtype, dequantized after the blocks a step needs
are gathered, never as a copy of the cache. kv8 calibrates powers of two, so the read-back is
exact in bf16/fp16/fp32 (the Triton kernels rely on it: they apply the scales to the scores and
outputs instead of to every loaded key and value).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, H_kv, D] keys or values -> float8_e4m3fn with the per-head `scale` [H_kv]: x / scale
    in float32, saturated at +-448, rounded to nearest even."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., H_kv, D] float8_e4m3fn -> `dtype`, times the per-head `scale` [H_kv]."""
    return (x.float() * scale[:, None]).to(dtype)


def check_kv_scale(k_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """An fp8 cache needs its scales, and only an fp8 cache takes them."""
    if (k_cache.dtype == FP8) != (kv_scale is not None):
        raise ValueError(f"a {k_cache.dtype} KV cache {'needs' if kv_scale is None else 'takes no'} kv_scale")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Write the new tokens' keys and values into their cache slots; a negative slot is skipped
    (padding rows of a CUDA-graph batch). An fp8 cache stores them quantized with `kv_scale`."""
    check_kv_scale(k_cache, kv_scale)
    num_kv_heads, head_dim = k.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if kv_scale is not None:  # bytes moved as uint8: index_copy_ does not take fp8 everywhere
        k = quantize_kv(k, kv_scale[0]).view(torch.uint8)
        v = quantize_kv(v, kv_scale[1]).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [T, H_kv, D]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, sliding_window: int | None = None,
                    uniform_query_len: bool = False, kv_scale: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, sink_tokens: int = 0) -> torch.Tensor:
    """Causal attention of packed queries over each sequence's paged context (device-tensor form).

    q: [T, H, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32;
    query_start_loc: [B + 1] int32, all on q's device. max_query_len and max_seq_len are host ints
    from which the Triton path sizes its launches; upper bounds give the same result (a CUDA graph
    can be captured with its bucket's bounds). max_query_len == 1 selects the decode kernel, so it
    must not understate. `uniform_query_len`: every sequence has exactly max_query_len new
    tokens (a verify step's CUDA graph), which lets the Triton path use its decode kernel; the
    result is the same. `kv_scale`: an fp8 cache's scales (see the module docstring). `sinks`:
    attention sinks (gpt-oss), one learned logit per query head [H] that joins every row's
    softmax denominator as a key with no value. `sink_tokens`: with a sliding window, the keys
    at positions below it stay visible to every later query (StreamingLLM's sink tokens: the
    cache of a "sink + window" layer keeps only those and the window); no effect without a
    window. Returns [T, H, D].
    """
    return paged_attention_host(q, k_cache, v_cache, block_tables, seq_lens.tolist(),
                                query_start_loc.tolist(), scale, sliding_window, kv_scale, sinks,
                                sink_tokens)


def paged_attention_host(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: Sequence[int],
                         query_start_loc: Sequence[int], scale: float,
                         sliding_window: int | None = None,
                         kv_scale: torch.Tensor | None = None,
                         sinks: torch.Tensor | None = None, sink_tokens: int = 0) -> torch.Tensor:
    """`paged_attention` with the lengths as host ints (B and B + 1 of them).

    A query at position p sees keys at positions j with j <= p and, with a sliding window w,
    p - j < w (the convention of Hugging Face's masks) or j < sink_tokens. Keys in the gap
    between the sinks and a sequence's window are zeroed after the gather (as `_short_batch`
    says why): a "sink + window" layer's cache points them at freed blocks. Returns [T, H, D].
    """
    check_kv_scale(k_cache, kv_scale)
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
    gather = _Gather(k_cache, v_cache, kv_scale, q.dtype)
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = num_heads // num_kv_heads
    num_q = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    short = [i for i, n in enumerate(num_q) if 0 < n <= SHORT_QUERY]  # decodes, verify steps
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if len(short) == len(seq_lens) and max(num_q) == 1:  # a plain decode step: no copies
        return _short_batch(q[:, None], gather, block_tables, seq_lens, num_q, scale, sliding_window,
                            sinks, sink_tokens)[:, 0]
    if short:
        rows = [range(query_start_loc[i], query_start_loc[i + 1]) for i in short]
        longest = max(num_q[i] for i in short)
        padded = torch.zeros(len(short), longest, num_heads, head_dim, dtype=q.dtype, device=q.device)
        for j, r in enumerate(rows):  # queries right-aligned: row j of `longest` is position len - longest + j
            padded[j, longest - len(r):] = q[r.start:r.stop]
        o = _short_batch(padded, gather, block_tables[short], [seq_lens[i] for i in short],
                         [num_q[i] for i in short], scale, sliding_window, sinks, sink_tokens)
        for j, r in enumerate(rows):
            out[r.start:r.stop] = o[j, longest - len(r):]
    for i, ctx_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if num_q[i] <= SHORT_QUERY:  # done above
            continue
        blocks = block_tables[i, : (ctx_len + block_size - 1) // block_size].long()
        k, v = gather(blocks)
        k, v = k.flatten(0, 1)[:ctx_len], v.flatten(0, 1)[:ctx_len]  # [L, H_kv, D]
        if sliding_window is not None:
            _zero_gap(k, v, sink_tokens, ctx_len - num_q[i] - sliding_window + 1)
        windowed = sliding_window is not None and ctx_len > sliding_window
        causal = num_q[i] == ctx_len and not windowed  # a fresh prompt: SDPA's own causal path
        mask = None
        if not causal:
            q_pos = torch.arange(ctx_len - num_q[i], ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(ctx_len, device=q.device)[None, :]
            mask = k_pos <= q_pos  # [Q, L]
            if sliding_window is not None:
                mask &= _in_window(q_pos, k_pos, sliding_window, sink_tokens)
        # 4-D [1, heads, tokens, D], K/V repeated per query head: the layout of CPU SDPA's fast
        # (flash) path, several times faster than 3-D views for long queries
        o = _sdpa(q[start:end].transpose(0, 1)[None], _per_head(k, group), _per_head(v, group),
                  mask, causal, scale, None if sinks is None else sinks[None, :, None])  # [1, H, Q, D]
        out[start:end] = o[0].transpose(0, 1)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of [B, H, Q, D] queries over [B, H, L, D] keys and values (boolean `mask`
    broadcastable to [B, H, Q, L]); with `sinks` (broadcastable to [B, H, Q]) transformers' eager
    gpt-oss arithmetic instead, which SDPA has no input for: the sink logit joins each row's
    scores, the row's maximum is subtracted, the softmax is taken and the sink's share dropped."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Q, L]
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat((scores, sinks.to(scores.dtype)[..., None].expand(*scores.shape[:-1], 1)), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


SHORT_QUERY = 32
"""Sequences with at most this many new tokens (decodes, verify steps) attend in one batched call."""


class _Gather:
    """Whole blocks of keys and values, copied out of the cache in the activations' dtype (an fp8
    cache's blocks dequantized after the copy)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scale: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.k_cache, self.v_cache, self.kv_scale, self.dtype = k_cache, v_cache, kv_scale, dtype

    def __call__(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks: [N] long -> (k, v), each [N, block_size, H_kv, D]."""
        k, v = self.k_cache.index_select(0, blocks), self.v_cache.index_select(0, blocks)
        if self.kv_scale is None:
            return k, v
        return (dequantize_kv(k, self.kv_scale[0], self.dtype), dequantize_kv(v, self.kv_scale[1], self.dtype))


def _in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sink_tokens: int) -> torch.Tensor:
    """Which keys a sliding window leaves a query (broadcast positions -> bool): the last
    `window` positions up to its own, and the first `sink_tokens`."""
    return (q_pos - k_pos < window) | (k_pos < sink_tokens)


def _zero_gap(k: torch.Tensor, v: torch.Tensor, sink_tokens: int, first: int) -> None:
    """Zero gathered keys and values [L, ...] from the sinks' end up to `first`, the first key
    any query of the sequence sees in its window: those slots may be never-written memory (NaN)."""
    first = max(first, 0)
    gap = slice(min(sink_tokens, first), first)
    k[gap].zero_()
    v[gap].zero_()


def _per_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """[L, H_kv, D] -> [1, H_kv * group, L, D]: each KV head once per query head of its group."""
    return x.transpose(0, 1).repeat_interleave(group, dim=0)[None]


def _short_batch(q: torch.Tensor, gather: _Gather, block_tables: torch.Tensor,
                 seq_lens: Sequence[int], query_lens: Sequence[int], scale: float,
                 sliding_window: int | None, sinks: torch.Tensor | None = None,
                 sink_tokens: int = 0) -> torch.Tensor:
    """A few new tokens per sequence (q: [B, Q, H, D], right-aligned: row j of sequence i is at
    position seq_lens[i] - Q + j; rows before a sequence's own query_lens[i] queries are padding
    whose output is dropped): every sequence in one attention call, keys gathered into
    [B, L_max] and masked by position (per-sequence calls cost more than the padding on the
    CPU). Each KV head serves its group of query heads without being repeated (queries
    [B, H_kv, G * Q, D]). Slots no query of a sequence sees (past its end; with a window,
    between its sinks and its first query's window) are zeroed after the gather: never-written
    or freed cache memory may hold NaN, which a mask alone would let through. Returns
    [B, Q, H, D]."""
    batch, num_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = gather.k_cache.shape[1], gather.k_cache.shape[2]
    group = num_heads // num_kv_heads
    longest = max(seq_lens)
    tables = block_tables[:, : -(-longest // block_size)].long()  # [B, blocks]
    keys = torch.arange(tables.shape[1] * block_size, device=q.device)[None, None, :]  # [1, 1, L]
    lengths = torch.tensor(list(seq_lens), device=q.device)[:, None, None]
    # a query's position; padding rows of a sequence shorter than Q sit at 0 (they see a key)
    queries = (lengths - num_q + torch.arange(num_q, device=q.device)[None, :, None]).clamp(min=0)  # [B, Q, 1]
    visible = (keys <= queries) & (keys < lengths)  # [B, Q, L]
    if sliding_window is not None:
        visible &= _in_window(queries, keys, sliding_window, sink_tokens)
    # whole blocks at a time, into a fresh copy: far cheaper than one copy per slot
    shape = (batch, -1, num_kv_heads, head_dim)
    k, v = (x.view(shape) for x in gather(tables.flatten()))  # [B, L, H_kv, D]
    for i, length in enumerate(seq_lens):  # slices, not a boolean index: much cheaper
        if sliding_window is not None:
            _zero_gap(k[i], v[i], sink_tokens, length - query_lens[i] - sliding_window + 1)
        k[i, length:].zero_()
        v[i, length:].zero_()
    qg = q.view(batch, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, H_kv, G, Q, D]
    mask = visible[:, None, None].expand(batch, 1, group, num_q, visible.shape[-1])
    if sinks is not None:  # query head h = kv_head * group + g, rows ordered (g, q)
        sinks = sinks.view(num_kv_heads, group, 1).expand(num_kv_heads, group, num_q).reshape(
            1, num_kv_heads, group * num_q)
    o = _sdpa(qg.reshape(batch, num_kv_heads, group * num_q, head_dim), k.transpose(1, 2), v.transpose(1, 2),
              mask.reshape(batch, 1, group * num_q, -1), False, scale, sinks)
    return o.view(batch, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4).reshape(
        batch, num_q, num_heads, head_dim)
