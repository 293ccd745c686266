"""Rotary position embedding (rotate_half convention): plain-torch reference (CPU path, oracle).

cos/sin tables are float32 [max_positions, rotary_dim] (rotary_dim: the head's dims that rotate,
all or, for Phi's partial rotary, the first ones); as in Hugging Face, the rows are cast to the
activations' dtype before the products, and each product and the sum round to that dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hibana_kernels import attention, norm


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by their positions, out of place. positions: [T]; q: [T, H, D];
    k: [T, H_kv, D]."""
    cos = cos_table[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rotary_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                         eps: float = 0.0, kv_scale: torch.Tensor | None = None,
                         unit_offset: bool = False) -> torch.Tensor:
    """An attention layer's prologue: per-head RMSNorm of q and k when weights are given (Qwen3;
    `unit_offset`: Gemma's, see `norm.rms_norm`), rotary on the first cos_table.shape[-1] dims
    of each head (all of them, or Phi's partial rotary: the rest pass through), then k and v
    into their cache slots (negative slot: skipped; an fp8 cache: quantized with `kv_scale`, see
    `attention.store_kv`). Returns the rotated q [T, H, D]. The Triton version does all of it in
    one launch."""
    if q_weight is not None:
        q = norm.rms_norm(q, q_weight, eps, unit_offset)
        k = norm.rms_norm(k, k_weight, eps, unit_offset)
    r = cos_table.shape[-1]
    if r == q.shape[-1]:
        q, k = rotary_embedding(positions, q, k, cos_table, sin_table)
    else:
        q_rot, k_rot = rotary_embedding(positions, q[..., :r], k[..., :r], cos_table, sin_table)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
    attention.store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return q


class AttentionPrologue(NamedTuple):
    """What an attention layer's prologue takes besides q and the cache (`qk_norm_rotary_store`'s
    arguments), for `kernels.paged_attention` to run it first: folded into the decode attention
    kernel on the GPU where the fusion policy says (`Fusion.attention_prologue`)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    slot_mapping: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0
    unit_offset: bool = False

    def run(self, impl, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            kv_scale: torch.Tensor | None) -> torch.Tensor:
        """The prologue as its own launch of `impl` (this module, or the Triton one): the rotated q."""
        return impl.qk_norm_rotary_store(self.positions, q, self.k, self.v, self.cos_table, self.sin_table,
                                         k_cache, v_cache, self.slot_mapping, self.q_weight, self.k_weight,
                                         self.eps, kv_scale, self.unit_offset)
