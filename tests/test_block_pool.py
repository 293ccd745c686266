"""CPU tests of the block pool: exact block ids, eviction order, prefix index."""

from __future__ import annotations

import pytest

from hibana_core.errors import MemoryBudgetError
from hibana_core.kv.block_pool import BlockPool, hash_block, hash_blocks


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate and commit one block per full block of `tokens`, as the engine would."""
    ids = pool.allocate(len(tokens) // pool.block_size)
    for block_id, h in zip(ids, hash_blocks(tokens, pool.block_size), strict=True):
        assert pool.commit(block_id, h) == block_id
    return ids


def test_allocate_lowest_ids_first():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_used, pool.num_free, pool.num_cached) == (5, 3, 0)
    assert [pool.ref_count(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.allocate(0) == []


def test_freed_empty_block_goes_to_back():
    pool = BlockPool(num_blocks=4, block_size=4)
    a = pool.allocate(2)
    pool.free([a[0]])
    assert pool.allocate(3) == [2, 3, 0]


def test_can_allocate_pairs_with_allocate():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate(3)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(MemoryBudgetError, match="close or truncate idle states"):
        pool.allocate(2)
    assert (pool.num_used, pool.num_free) == (3, 1)  # nothing taken on failure
    assert pool.allocate(1) == [3]


def test_failed_allocate_keeps_cached_blocks():
    pool = BlockPool(num_blocks=2, block_size=2)
    ids = _fill(pool, [1, 2, 3, 4])
    pool.free([ids[1]])
    with pytest.raises(MemoryBudgetError):
        pool.allocate(2)
    assert pool.num_cached == 1 and pool.lookup(pool.block_hash(ids[1])) == ids[1]


def test_free_keeps_hashed_block_findable():
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = _fill(pool, [1, 2, 3, 4])
    hashes = hash_blocks([1, 2, 3, 4], 2)
    pool.free(reversed(ids))
    assert (pool.num_free, pool.num_cached, pool.num_used) == (4, 2, 0)
    assert [pool.lookup(h) for h in hashes] == ids
    assert pool.block_hash(ids[0]) == hashes[0] and pool.is_committed(ids[0])
    assert pool.lookup(hash_block(None, [9, 9])) is None


def test_incref_cached_block_is_a_hit():
    pool = BlockPool(num_blocks=3, block_size=2)
    ids = _fill(pool, [1, 2, 3, 4])
    pool.free(reversed(ids))
    pool.incref(ids[0])
    assert pool.ref_count(ids[0]) == 1
    assert (pool.num_free, pool.num_cached, pool.num_used) == (2, 1, 1)
    assert pool.allocate(2) == [2, ids[1]]  # the hit block is not handed out
    assert not pool.can_allocate(1)
    assert pool.lookup(pool.block_hash(ids[0])) == ids[0]


def test_incref_used_block_shares_it():
    pool = BlockPool(num_blocks=2, block_size=2)
    [b] = pool.allocate(1)
    pool.incref(b)
    pool.free([b])
    assert pool.ref_count(b) == 1 and pool.num_used == 1
    pool.free([b])
    assert pool.num_free == 2


def test_eviction_order_empty_then_lru_tail_first():
    pool = BlockPool(num_blocks=6, block_size=2)
    a = _fill(pool, [1, 2, 3, 4, 5, 6])      # blocks 0, 1, 2
    b = _fill(pool, [7, 8, 9, 10])           # blocks 3, 4
    scratch = pool.allocate(1)               # block 5, never committed
    assert (a, b, scratch) == ([0, 1, 2], [3, 4], [5])
    pool.free(reversed(a))                   # cached LRU -> MRU: 2, 1, 0
    pool.free(scratch)
    pool.free(reversed(b))                   # cached LRU -> MRU: 2, 1, 0, 4, 3
    assert pool.num_cached == 5
    # The empty block goes first, then a's tail before its head, then b's tail.
    assert pool.allocate(1) == [5]
    assert pool.allocate(3) == [2, 1, 0]
    assert pool.lookup(hash_blocks([1, 2, 3, 4, 5, 6], 2)[0]) is None
    assert pool.block_hash(0) is None and not pool.is_committed(0)
    assert pool.allocate(1) == [4]
    assert pool.lookup(hash_blocks([7, 8], 2)[0]) == 3
    assert pool.num_cached == 1


def test_cache_hit_refreshes_lru_position():
    pool = BlockPool(num_blocks=2, block_size=2)
    x, y = _fill(pool, [1, 2, 3, 4])
    pool.free([x, y])                        # LRU -> MRU: x, y
    pool.incref(x)
    pool.free([x])                           # LRU -> MRU: y, x
    assert pool.allocate(1) == [y]


def test_commit_dedupes_to_existing_block():
    pool = BlockPool(num_blocks=4, block_size=2)
    h = hash_block(None, [1, 2])
    first, dup = pool.allocate(2)
    assert pool.commit(first, h) == first
    assert pool.commit(dup, h) == first      # index unchanged, caller switches
    assert pool.lookup(h) == first and not pool.is_committed(dup)
    pool.incref(first)
    pool.free([dup])
    assert pool.ref_count(first) == 2 and pool.num_used == 1
    assert pool.commit(first, h) == first    # idempotent


def test_commit_dedupes_to_cached_block():
    pool = BlockPool(num_blocks=2, block_size=2)
    h = hash_block(None, [1, 2])
    [old] = pool.allocate(1)
    pool.commit(old, h)
    pool.free([old])
    [new] = pool.allocate(1)
    assert pool.commit(new, h) == old
    pool.incref(old)
    pool.free([new])
    assert (pool.num_used, pool.num_cached) == (1, 0)


def test_hash_depends_on_prefix():
    first = hash_block(None, [1, 2])
    other = hash_block(None, [3, 4])
    assert len(first) == 16
    assert hash_block(first, [5, 6]) != hash_block(other, [5, 6])
    assert hash_block(None, [5, 6]) != hash_block(first, [5, 6])
    assert hash_block(first, [5, 6]) == hash_block(hash_block(None, [1, 2]), [5, 6])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_hash_blocks_skips_partial_tail():
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert hash_blocks(tokens[:3], 4) == []
    pairs = hash_blocks(tokens, 2)
    assert hash_blocks(tokens[4:], 2, parent=pairs[1]) == pairs[2:]  # resumes a chain


def test_double_free_asserts():
    pool = BlockPool(num_blocks=2, block_size=2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_reset_prefix_index_forgets_only_unreferenced():
    pool = BlockPool(num_blocks=4, block_size=2)
    ids = _fill(pool, [1, 2, 3, 4])
    hashes = hash_blocks([1, 2, 3, 4], 2)
    pool.free([ids[1]])
    pool.reset_prefix_index()
    assert pool.lookup(hashes[1]) is None and pool.num_cached == 0
    assert pool.lookup(hashes[0]) == ids[0]
    assert pool.num_free == 3
    assert pool.allocate(3) == [2, 3, ids[1]]
