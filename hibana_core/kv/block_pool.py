"""Fixed-size KV blocks: reference counts, free queues and the engine-wide prefix index.

Plain Python, no torch: the pool hands out block ids; the runner owns the tensors behind them.

A block is in exactly one of three places:

    used      ref_count > 0                 owned by one or more agents
    empty     ref_count 0, no hash          free, contents meaningless      -> `_empty` queue
    cached    ref_count 0, committed hash   free, but findable by `lookup`  -> `_cached` queue

`allocate` drains `_empty` first (FIFO), then evicts `_cached` from its LRU end. A cache hit
(`incref` of a cached block) takes it back out of `_cached` without touching its contents.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from hibana_core.errors import MemoryBudgetError

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Hash of a full block: its token ids chained onto its prefix's hash (None for the first)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))  # little-endian int64, same on every host
    return h.digest()


def hash_blocks(tokens: Sequence[int], block_size: int,
                parent: BlockHash | None = None) -> list[BlockHash]:
    """Chain hashes of every full block of `tokens`; a trailing partial block gets none."""
    hashes: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class _Block:
    """Bookkeeping for one KV block."""

    ref_count: int = 0
    hash: BlockHash | None = None


class BlockPool:
    """Fixed-size KV blocks with reference counts and an engine-wide prefix index."""

    def __init__(self, num_blocks: int, block_size: int, reserve_null: bool = False) -> None:
        """`reserve_null`: block 0 is never handed out (`kv.layout.NULL_BLOCK`: what window
        groups' tables point at outside their window); it counts as neither used nor free."""
        if num_blocks < 0 or block_size <= 0 or (reserve_null and num_blocks < 1):
            raise ValueError(f"need num_blocks >= {int(reserve_null)} and block_size > 0, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks - reserve_null  # the blocks that can be handed out
        self.block_size = block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Free queues: front = next to hand out / evict, back = most recently freed.
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(int(reserve_null), num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockHash, int] = {}  # hash -> the one block holding it

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with ref_count 0: empty ones plus cached ones."""
        return len(self._empty) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks with ref_count > 0."""
        return self.num_blocks - self.num_free

    @property
    def num_shared(self) -> int:
        """Blocks with ref_count > 1: held by more than one owner (a fork, a common prefix)."""
        return sum(block.ref_count > 1 for block in self._blocks)

    @property
    def num_cached(self) -> int:
        """Blocks with ref_count 0 that `lookup` still finds."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed (it may evict cached blocks to do so)."""
        return n <= self.num_free

    def ref_count(self, block_id: int) -> int:
        """How many owners the block has."""
        return self._blocks[block_id].ref_count

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, used or cached, or None; no side effects."""
        return self._index.get(block_hash)

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash the block was committed under, or None."""
        return self._blocks[block_id].hash

    def is_committed(self, block_id: int) -> bool:
        """Whether the block is full and in the prefix index (writers copy it first, or `uncommit` it)."""
        return self._blocks[block_id].hash is not None

    # -- actions ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with ref_count 1 and no hash: empty ones first, then LRU cached ones."""
        assert n >= 0, n
        if not self.can_allocate(n):
            raise MemoryBudgetError(
                f"the KV cache needs {n} free blocks but has {self.num_free} of {self.num_blocks} "
                f"({self.num_used} in use); close or truncate idle states, or raise "
                f"memory_budget / kv_device_blocks")
        ids: list[int] = []
        for _ in range(n):
            if self._empty:
                block_id, _ = self._empty.popitem(last=False)
            else:
                block_id, _ = self._cached.popitem(last=False)
                self._forget(block_id)
            self._blocks[block_id].ref_count = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; one reaching 0 joins the MRU end of its free queue.

        Pass a sequence's blocks in reverse order (tail first): the tail then sits nearer the LRU
        end and is evicted before the head, so the shared prefix outlives the private suffix.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed while already free"
            block.ref_count -= 1
            if block.ref_count == 0:
                (self._empty if block.hash is None else self._cached)[block_id] = None

    def incref(self, block_id: int) -> None:
        """Add an owner; a cached block is taken off its free queue (a prefix-cache hit)."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            assert block.hash is not None, f"block {block_id} is empty; allocate it instead"
            del self._cached[block_id]
        block.ref_count += 1

    def commit(self, block_id: int, block_hash: BlockHash) -> int:
        """Register a full block under its hash; returns the block that holds the hash.

        If another block already holds it, the index is left alone and that block's id comes
        back: the caller switches to it (incref) and frees its duplicate. Committed blocks are
        immutable; the engine copies a block before writing to it (or, its one owner with no block to
        spare, `uncommit`s it first).
        """
        block = self._blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} committed while free"
        if block.hash is not None:
            assert block.hash == block_hash, f"block {block_id} is already committed elsewhere"
            return block_id
        holder = self._index.setdefault(block_hash, block_id)
        if holder == block_id:
            block.hash = block_hash
        return holder

    def uncommit(self, block_id: int) -> None:
        """Make a committed block that one owner holds writable in place: it leaves the prefix
        index (no one else can find it meanwhile), to be committed again once full."""
        block = self._blocks[block_id]
        assert block.ref_count == 1 and block.hash is not None, f"block {block_id} is not one owner's committed block"
        self._forget(block_id)

    def reset_prefix_index(self) -> None:
        """Forget the hashes of all unreferenced blocks (tests, model reload)."""
        while self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._forget(block_id)
            self._empty[block_id] = None

    def _forget(self, block_id: int) -> None:
        """Drop a block's hash from the block and the index."""
        block = self._blocks[block_id]
        del self._index[block.hash]
        block.hash = None
