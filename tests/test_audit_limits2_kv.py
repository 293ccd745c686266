"""KV pool limits in the units the user sized the pool in (an outside tester of limits, second pass)."""

from __future__ import annotations

import random

import pytest

from hibana_core import MemoryBudgetError


def _history(n: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_a_windowed_models_pool_errors_count_the_blocks_kv_device_blocks_counts(tiny_checkpoints, make_engine):
    """gemma3 (two window layers, one global) keeps each layer in pages of its own: kv_device_blocks=4
    is 12 pages, and a 200-token history was "needs 19 KV blocks ..., more than the device pool's
    12": neither number was the user's. It says the blocks (7, which fits, 6 does not) and the pages."""
    path = tiny_checkpoints["gemma3"]
    engine = make_engine(path, speculation="off", num_blocks=4, enable_prefix_caching=False)
    with pytest.raises(MemoryBudgetError, match=r"needs 7 \(19 pages of 1 of the 3 layers\) KV blocks of 16 tokens, "
                                                r"more than the device pool's 4 \(12 pages"):
        engine.open_state("a").sync(_history(200))
    with pytest.raises(MemoryBudgetError, match=r"needs 7 \(19 pages.*pool's 6 \(18 pages"):
        make_engine(path, speculation="off", num_blocks=6, enable_prefix_caching=False).open_state("a").sync(
            _history(200))
    assert make_engine(path, speculation="off", num_blocks=7, enable_prefix_caching=False).open_state(
        "a").sync(_history(200)).computed == 200


def test_a_plain_models_pool_errors_are_unchanged(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], speculation="off", num_blocks=4, enable_prefix_caching=False)
    with pytest.raises(MemoryBudgetError, match=r"needs 13 KV blocks of 16 tokens, more than the device pool's 4;"):
        engine.open_state("a").sync(_history(200))


def test_a_windowed_pool_too_large_to_allocate_is_named_in_kv_device_blocks(tiny_checkpoints, make_engine):
    with pytest.raises(MemoryBudgetError, match=r"cannot allocate 1000000000000 \(3000000000000 pages of 1 of the 3 "):
        make_engine(tiny_checkpoints["gemma3"], speculation="off", num_blocks=10**12)
