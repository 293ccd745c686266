"""The KV cache tensors: one allocation for all layers, addressed by block id.

    data: [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]

Block ids come from `BlockPool`; this object only moves bytes (copy-on-write, save, load).
"""

from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # empty, not zeros: pages are committed as blocks are written (slots past a sequence's
        # length are never read)
        self.data = torch.empty(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, H_kv, D]."""
        return self.data[index, 0], self.data[index, 1]

    def copy_block(self, src: int, dst: int) -> None:
        self.data[:, :, dst] = self.data[:, :, src]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[num_layers, 2, len(block_ids), block_size, H_kv, D], on the host."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.data.device)
        return self.data.index_select(2, index).cpu()

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.data.device)
        self.data.index_copy_(2, index, blocks.to(self.data.device, self.data.dtype))
