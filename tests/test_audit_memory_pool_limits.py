"""Audit of the memory manager under pressure: what the device pool can never hold is refused
up front, the state unchanged, for models with sliding windows too."""

from __future__ import annotations

import random

import pytest

from hibana_core import MemoryBudgetError, SamplingParams
from tiny_models import random_tokens

GREEDY = SamplingParams(max_tokens=1, ignore_eos=True)


def test_a_windowed_history_the_pool_cannot_hold_is_refused_with_the_state_unchanged(tiny_checkpoints, make_engine,
                                                                                     hf_greedy):
    """gemma3's tiny config: one full-attention group beside two windows of 20 tokens, a pool of
    24 blocks. The step at position 288 (the first of block 18) holds the full group's 19 blocks
    and each window's blocks 16..18: 25. A longer history was taken by the state and failed in
    the scheduler after its prefill had run (the state changed); 288 tokens still run."""
    path = tiny_checkpoints["gemma3"]
    engine = make_engine(path, num_blocks=8, speculation="off")
    assert engine.pool.num_blocks == 24
    rng = random.Random(17)
    state = engine.open_state("a")
    history = random_tokens(rng, 20)
    state.sync(history)
    too_long = history + random_tokens(rng, 274)  # 294 tokens
    with pytest.raises(MemoryBudgetError, match="needs 25 KV blocks of 16 tokens.*the state is unchanged"):
        state.generate(GREEDY, prompt=too_long)
    assert state.tokens == history
    with pytest.raises(MemoryBudgetError, match="kv_device_blocks"):
        state.sync(too_long[:289])
    assert state.tokens == history
    fits = too_long[:288]
    done = state.generate(GREEDY, prompt=fits)
    assert list(done.token_ids) == hf_greedy(str(path), fits, 1)
