"""The KV cache tensors: one allocation for all layers, addressed by block id.

    data: [page_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]

A block (page) holds `page_layers` layers: all of them for most models; for models with sliding
windows, the layers of one `KVLayout` group (layer l in slot `layout.place(l)[1]`), each group
reaching its pages through its own block table. Block ids come from `BlockPool`; this object
only moves bytes (copy-on-write, save, load). An
fp8 cache (float8_e4m3fn: the kv8 surgery pass) is moved as its bytes: its per-head scales live
on the model's attention layers, not here, so blocks move, fork and reload unchanged.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hibana_core.kv.layout import NULL_BLOCK, KVLayout
from hibana_core.kv.transfers import device_tensor

FP8 = torch.float8_e4m3fn


def kv_cache_dtype(model: torch.nn.Module, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype `model` stores its keys and values in: fp8 once kv8 gave its attention layers
    scales (`set_kv_scales`), otherwise its compute dtype."""
    scaled = any(getattr(m, "kv_scale", None) is not None for m in model.modules() if hasattr(m, "set_kv_scales"))
    return FP8 if scaled else compute_dtype


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, layout: KVLayout | None = None) -> None:
        self.layout = layout or KVLayout.plain(num_layers)
        if self.layout.num_layers != num_layers:
            raise ValueError(f"the layout places {self.layout.num_layers} layers, the model has {num_layers}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # empty, not zeros: pages are committed as blocks are written (slots past a sequence's
        # length are never read)
        self.data = torch.empty(self.layout.page_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)
        # what copies go through: fp8 as bytes (not every device's index ops take fp8)
        self._raw = self.data.view(torch.uint8) if dtype == FP8 else self.data
        if self.layout.windowed and num_blocks:
            self._raw[:, :, NULL_BLOCK].zero_()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes of a page of `num_layers` layers (a layout's page_layers)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(k_cache, v_cache, group) of model layer `index`: the caches each [num_blocks,
        block_size, H_kv, D], and the `KVLayout` group whose block table addresses them."""
        group, slot = self.layout.place(index)
        return self.data[slot, 0], self.data[slot, 1], group

    def copy_block(self, src: int, dst: int) -> None:
        self._raw[:, :, dst] = self._raw[:, :, src]

    @property
    def bytes_per_block_here(self) -> int:
        """Bytes of one block of this cache (all layers, k and v)."""
        return self.nbytes // self.num_blocks

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """The blocks at `index` (a long tensor on the cache's device), on the device:
        [page_layers, 2, len(index), block_size, H_kv, D]."""
        return self._raw.index_select(2, index).view(self.data.dtype)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[page_layers, 2, len(block_ids), block_size, H_kv, D], on the host."""
        return self.gather(device_tensor(list(block_ids), torch.long, self.data.device)).cpu()

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        index = device_tensor(list(block_ids), torch.long, self.data.device)  # no wait for the step in flight
        blocks = blocks.to(self.data.device, self.data.dtype)
        self._raw.index_copy_(2, index, blocks.view(self._raw.dtype))
