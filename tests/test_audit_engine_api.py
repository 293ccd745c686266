"""An outside tester's checks of the engine's public API (DESIGN.md, README) on checkpoints unlike
the other tests' defaults: a vocabulary of 16 tokens and no tokenizer, odd head counts, a short
context. Each test pins a defect found by the audit."""

from __future__ import annotations

import os
import re

import pytest

import tiny_models
from hibana_core import MemoryBudgetError, SamplingParams


@pytest.fixture(scope="module")
def vocab16(tmp_path_factory):
    """A llama of 16 tokens and 40 positions, without tokenizer files."""
    path = tiny_models.make_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("audit") / "llama_v16", seed=5, vocab_size=16, max_position_embeddings=40,
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(path / name)
    return path


def test_top_logprobs_beyond_a_small_vocabulary_give_every_token(vocab16, make_engine):
    # top_logprobs=20 (OpenAI's most) on a 16-token vocabulary failed the step ("selected index k
    # out of range") and so the request; it gives the whole vocabulary, most likely first
    engine = make_engine(vocab16, block_size=4, num_blocks=30)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    for extra in ({}, {"temperature": 1.0, "seed": 1}):
        got = engine.open_state(f"lp{len(extra)}").generate(
            SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=20, **extra), prompt=prompt)
        assert len(got.token_ids) == 4 and len(got.logprobs) == 4
        for lp in got.logprobs:
            assert sorted(t for t, _ in lp.top) == list(range(16))
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
    greedy = engine.open_state("g").generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert greedy.token_ids == engine.open_state("lp0").tokens[len(prompt):]


@pytest.fixture(scope="module")
def gemma3_small(tmp_path_factory):
    """A gemma3 of two sliding-window layers (window 9) and one global, one KV head, 80 positions."""
    return tiny_models.make_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("audit") / "gemma3", seed=77,
                                            vocab_size=640, max_position_embeddings=80, num_key_value_heads=1,
                                            sliding_window=9)


def test_the_least_budget_a_windowed_model_is_told_serves_a_request(gemma3_small, make_engine):
    # the least memory_budget the error named gave a windowed model two pages, one of them its null
    # page: one page for three block tables, and every request failed ("a history of 3 tokens needs
    # more KV blocks than the pool (1 blocks of 16) can give it")
    with pytest.raises(MemoryBudgetError, match=r"raise it to at least ([\d,]+) bytes") as refused:
        make_engine(gemma3_small, num_blocks=None, memory_budget=1000, speculation="off")
    least = int(re.search(r"at least ([\d,]+) bytes", str(refused.value)).group(1).replace(",", ""))
    with pytest.raises(MemoryBudgetError, match="at least"):
        make_engine(gemma3_small, num_blocks=None, memory_budget=least - 1, speculation="off")
    engine = make_engine(gemma3_small, num_blocks=None, memory_budget=least, speculation="off")
    prompt = [5, 6, 7]
    got = engine.open_state("a").generate(SamplingParams(max_tokens=30, ignore_eos=True), prompt=prompt)
    assert got.finish_reason == "length" and len(got.token_ids) == 30
    tiny_models.assert_greedy_matches(gemma3_small, prompt, got.token_ids)


@pytest.fixture(scope="module")
def qwen2_mha(tmp_path_factory):
    """A qwen2 of five query heads over five KV heads (head_dim 8), vocabulary 520, 256 positions."""
    return tiny_models.make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("audit") / "qwen2", seed=77,
                                            vocab_size=520, max_position_embeddings=256, hidden_size=40,
                                            num_attention_heads=5, num_key_value_heads=5)


def test_a_generation_uses_its_state_until_it_ends(qwen2_mha, make_engine):
    # a state's last use was its call's start: a state that generated until a moment ago looked
    # older than one synced while it generated, and least-recently-used eviction took it first
    engine = make_engine(qwen2_mha, block_size=4, num_blocks=40, host_kv_bytes=0, eviction_policy="lru",
                         speculation="off")
    a, b = engine.open_state("a"), engine.open_state("b")
    events = a.stream(SamplingParams(max_tokens=200, ignore_eos=True), prompt=[1, 2, 3, 4])
    next(events)
    b.sync(list(range(10, 22)))  # while a generates
    events.stop()
    done = [ev for ev in events if ev.completion is not None][0].completion
    assert done.finish_reason == "cancelled"
    info = {s.id: s for s in engine.states()}
    assert info["a"].last_use > info["b"].last_use
    # room for one more block than is free: the least recently used idle state alone leaves
    free = engine.stats().kv_blocks_total - engine.stats().kv_blocks_used
    engine.open_state("c").sync(list(range(100, 100 + 4 * (free + 1))))
    tiers = {s.id: s.tier for s in engine.states()}
    assert tiers == {"a": "device", "b": "none", "c": "device"}
