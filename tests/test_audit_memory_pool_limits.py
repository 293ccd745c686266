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
    # (in the blocks kv_device_blocks counts, the pages of each layer group beside them: KVLayout.counted)
    with pytest.raises(MemoryBudgetError, match=r"needs 9 \(25 pages of 1 of the 3 layers\) KV blocks of 16 tokens"
                                                ".*the state is unchanged"):
        state.generate(GREEDY, prompt=too_long)
    assert state.tokens == history
    with pytest.raises(MemoryBudgetError, match="kv_device_blocks"):
        state.sync(too_long[:289])
    assert state.tokens == history
    fits = too_long[:288]
    done = state.generate(GREEDY, prompt=fits)
    assert list(done.token_ids) == hf_greedy(str(path), fits, 1)


def test_a_parked_state_waits_for_a_queued_requests_kv_rather_than_recompute(tiny_checkpoints, make_engine,
                                                                              hf_greedy):
    """One running slot, a pool of 12 blocks: state a (130 tokens, 9 blocks) parked in host
    memory, b resident (6 blocks) and its request queued behind a's. a's restore finds 6 free
    blocks and no idle state to evict (b is queued); a prefill chunk of 32 tokens fits, so a
    recomputed its whole history beside its copy. Now b's queued KV gives way (parked, as a
    preempted request's is) and a is restored."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=12, speculation="off", max_concurrent_agents=1,
                         max_num_batched_tokens=32)
    rng = random.Random(3)
    a, b, c = (engine.open_state(name) for name in "abc")
    history_a, history_b = random_tokens(rng, 130), random_tokens(rng, 90)
    a.sync(history_a)
    c.sync(random_tokens(rng, 190))  # the whole pool: a parked, its blocks out of the prefix index
    c.close()
    b.sync(history_b)
    assert {info.id: info.tier for info in engine.states()} == {"a": "host", "b": "device"}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with engine.core.lock:  # both queued before the scheduler picks: a first, b waiting behind it
        streams = [a.stream(params), b.stream(params)]
    done = [[event.completion for event in events if event.completion is not None][0] for events in streams]
    assert done[0].stats.computed == 1  # its last token's logits only: the rest came back from its copy
    for history, completion in zip((history_a, history_b), done):
        assert list(completion.token_ids) == hf_greedy(str(path), history, 4)
