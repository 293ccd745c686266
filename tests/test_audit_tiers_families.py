"""Audit of resident agent state across memory tiers (device, host, disk) on families with unusual
state. gpt_oss (sliding windows, sinks), gemma3 (local and global layers), qwen3_moe and the
hybrids (qwen3_5, qwen3_next) were driven through parks, spills, forks, saves, truncations and
restarts under tight budgets; what failed was a hybrid state's linear layers' state, which lives in
a state slot and in its parked copy alone: restores and prefetches that lost it or fought over
slots. Each parked state must come back with transformers' greedy tokens, computing only its new
tokens."""

from __future__ import annotations

import random

import pytest

from hibana_core import SamplingParams
from tiny_models import assert_greedy_matches, make_tiny_checkpoint, random_tokens

pytestmark = pytest.mark.timeout(300)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "q")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_parked_hybrid_state_whose_kv_the_index_holds_resumes_without_recompute(hybrid, make_engine, tmp_path,
                                                                                   tier):
    """A hybrid state parked at a block boundary (64 computed tokens), its fork resumed first: the
    prefix index then holds all of the parent's KV. The parent's restore adopted that KV and
    dropped its parked copy, linear layers' state included, so its next turn recomputed its
    whole history (67 tokens, not 3)."""
    options = dict(state_dir=tmp_path, host_kv_bytes=0) if tier == "disk" else {}
    engine = make_engine(hybrid, num_blocks=11, speculation="off", **options)
    rng = random.Random(1)
    parent = engine.open_state("parent")
    parent.sync(random_tokens(rng, 65))  # a hybrid sync computes all but the last token: 64
    engine.open_state("other").generate(greedy(3), prompt=random_tokens(rng, 120))  # parks the parent
    assert {info.id: info.tier for info in engine.states()}["parent"] == tier
    twin = parent.fork("twin")
    history = parent.tokens + [1, 2]
    done = twin.generate(greedy(4), prompt=history)
    assert done.stats.computed == 3
    assert_greedy_matches(hybrid, history, done.token_ids)
    history = parent.tokens + [3, 4]
    done = parent.generate(greedy(4), prompt=history)
    assert done.stats.computed == 3, "the parked copy (KV and linear layers' state) comes back"
    assert_greedy_matches(hybrid, history, done.token_ids)


def test_a_hybrid_restore_that_evicts_for_a_state_slot_keeps_its_own_host_copy(hybrid, make_engine):
    """Four state slots (max_concurrent_agents=1), all held by idle agents, and a host budget of
    one state's KV holding A's parked copy. A's restore takes a slot by parking an idle agent,
    whose copy pushed A's own out of the host budget mid-restore: the step failed with
    AttributeError ('NoneType' object has no attribute 'kv') and took every request with it."""
    probe = make_engine(hybrid, speculation="off", max_concurrent_agents=1)
    per_block = probe.kv_cache.bytes_per_block_here
    probe.close()
    engine = make_engine(hybrid, speculation="off", max_concurrent_agents=1, host_kv_bytes=3 * per_block)
    rng = random.Random(2)
    handles = {name: engine.open_state(name) for name in "ABCDE"}
    for h in handles.values():  # E's slot parks A (40 tokens and 4 generated: 3 blocks)
        h.generate(greedy(4), prompt=random_tokens(rng, 40))
    assert {info.id: info.tier for info in engine.states()}["A"] == "host"
    history = handles["A"].tokens + [1]
    done = handles["A"].generate(greedy(4), prompt=history)
    assert done.stats.computed == 2, "A's copy came back: only its new tokens computed"
    assert_greedy_matches(hybrid, history, done.token_ids)
    tiers = {info.id: info.tier for info in engine.states()}
    assert tiers["A"] == "device" and "none" in tiers.values()  # the evicted agent's copy found no room
    history = handles["B"].tokens + [2]  # (a state dropped for the budget recomputes, exactly)
    assert_greedy_matches(hybrid, history, handles["B"].generate(greedy(4), prompt=history).token_ids)


def test_prefetching_a_hybrid_state_takes_a_free_slot_and_evicts_nobody(hybrid, make_engine, monkeypatch):
    """Prefetch copies a parked state due back from its tools into free room only. A hybrid
    state's restore took a state slot by evicting an idle agent: with two agents due and no
    free slot they evicted each other at every idle tick (parks and resumes without a request)."""
    import time

    from hibana_core.kv import policies

    monkeypatch.setattr(policies, "DEFAULT_TOOL_SECONDS", 60.0)  # due at once, for two minutes
    monkeypatch.setattr("hibana_core.registry.PREFETCH_LEAD", 59.9)
    engine = make_engine(hybrid, speculation="off", max_concurrent_agents=1, eviction_policy="lru")  # 4 slots
    rng = random.Random(2)
    handles = {name: engine.open_state(name) for name in "ABCDEF"}
    for name, h in handles.items():
        h.generate(greedy(2), prompt=random_tokens(rng, 40))
        if name in "AB":
            engine.registry.note_turn(h, called_tools=True)  # as the chat layer does when a turn calls tools

    def tiers():
        return {info.id: info.tier for info in engine.states()}

    assert tiers() == dict(A="host", B="host", C="device", D="device", E="device", F="device")  # (E's and F's slots)
    parks = engine.stats().parks
    time.sleep(2.5)  # the idle loop tries to prefetch A and B at least twice
    assert engine.stats().parks == parks and tiers()["A"] == tiers()["B"] == "host"
    handles["D"].close()  # a free slot: A, due first, comes back into it
    deadline = time.monotonic() + 30
    while tiers()["A"] != "device" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiers() == dict(A="device", B="host", C="device", E="device", F="device")
    history = handles["A"].tokens + [5]
    done = handles["A"].generate(greedy(4), prompt=history)
    assert done.stats.computed == 2
    assert_greedy_matches(hybrid, history, done.token_ids)
