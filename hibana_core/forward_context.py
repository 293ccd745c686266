"""The one scoped context through which attention layers see the current batch and the KV cache.

Models receive a `ForwardContext` at construction and read `ctx.batch` inside their forward;
the runner sets it with `with ctx.forward_batch(batch): model(input_ids, positions)`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from hibana_core.kv.cache import KVCache
from hibana_core.kv.recurrent_cache import RecurrentCache, VerifyStash


@dataclass(frozen=True)
class ForwardBatch:
    """Attention metadata of one step; tokens of all sequences are packed back to back."""

    slot_mapping: torch.Tensor     # [G, T] int64: per KV layer group, the slot each new token's K/V goes to
    block_tables: torch.Tensor     # [G, B, max_blocks] int32, padded with 0 (G: the `KVLayout`'s groups)
    seq_lens: torch.Tensor         # [B] int32: context length of each sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] int32: first query row of each sequence
    max_query_len: int             # host ints: bounds that size kernel launches (may overstate)
    max_seq_len: int
    uniform_query_len: bool = False  # every sequence has exactly max_query_len new tokens
    # a hybrid model's linear-attention layers (kv/recurrent.py); None for other models
    state_slots: torch.Tensor | None = None  # [B] int32: each sequence's recurrent state slot
    has_state: torch.Tensor | None = None    # [B] bool: the slot holds the state before its first row
    writes_state: bool = True                # False: a verify step (the states fold in the kept rows later)
    state_skip: torch.Tensor | None = None   # [B] int32: padding rows in front of each sequence's (a CUDA graph's)
    state_stash: VerifyStash | None = None   # where a verify graph leaves what the commit reads


class ForwardContext:
    """Holds the KV cache for the model's lifetime and the batch for the duration of a forward."""

    def __init__(self, kv_cache: KVCache | None = None) -> None:
        self.kv_cache = kv_cache
        self.recurrent: RecurrentCache | None = None  # a hybrid model's linear-attention states
        self._batch: ForwardBatch | None = None

    @contextmanager
    def forward_batch(self, batch: ForwardBatch) -> Iterator[ForwardBatch]:
        if self._batch is not None:
            raise RuntimeError("forward_batch scopes do not nest")
        self._batch = batch
        try:
            yield batch
        finally:
            self._batch = None

    @property
    def batch(self) -> ForwardBatch:
        if self._batch is None:
            raise RuntimeError("the model was called outside `with ctx.forward_batch(batch):`")
        return self._batch
