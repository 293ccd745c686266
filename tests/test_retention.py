"""Pins and retention priorities (issue 17): which idle state keeps its device KV when the pool
needs room. A pin within `pin_budget` stays; beyond it, it degrades to a priority; lower-priority
states leave first; nothing deadlocks and every output stays exact."""

from __future__ import annotations

import random
import threading

import pytest

from hibana_core import ConfigError, SamplingParams
from hibana_core.kv.policies import POLICIES, StateUse, retention_order
from tiny_models import random_tokens

BLOCK = 16


def order(states, pin_blocks, policy="lru"):
    return retention_order(POLICIES[policy], states, now=100.0, pin_blocks=pin_blocks)


def test_unpinned_states_leave_lowest_priority_first_then_least_recently_used():
    a, b, c = StateUse(last_use=1.0), StateUse(last_use=2.0, priority=5), StateUse(last_use=3.0)
    assert order([("a", a, 2), ("b", b, 2), ("c", c, 2)], pin_blocks=0) == ["a", "c", "b"]


def test_pins_within_the_budget_leave_last_first_pinned_first_served():
    old, new = StateUse(last_use=0.2, pinned_at=10.0), StateUse(last_use=0.5, pinned_at=20.0)
    high = StateUse(last_use=0.1, priority=9)
    states = [("old_pin", old, 3), ("new_pin", new, 3), ("high", high, 3), ("plain", StateUse(last_use=5.0), 3)]
    # room for both pins: after every unpinned state, least recently used first among them
    assert order(states, pin_blocks=6) == ["plain", "high", "old_pin", "new_pin"]
    # room for one: the first pinned is honoured, the second degrades to just above the unpinned
    assert order(states, pin_blocks=4) == ["plain", "high", "new_pin", "old_pin"]
    assert order(states, pin_blocks=0) == ["plain", "high", "old_pin", "new_pin"]  # both degraded


def test_pin_budget_is_checked():
    from hibana_core.config import EngineConfig

    with pytest.raises(ConfigError, match="pin_budget"):
        EngineConfig.from_overrides("demo", pin_budget=1.5)


def fill(engine, ids, rng, length=40):
    """Each state gets a history of `length` tokens and one generated token; returns their prompts."""
    prompts = {}
    for state_id in ids:
        prompts[state_id] = random_tokens(rng, length)
        engine.open_state(state_id).generate(SamplingParams(max_tokens=1, ignore_eos=True),
                                             prompt=prompts[state_id])
    return prompts


def test_a_pinned_state_keeps_its_kv_while_others_leave(tiny_checkpoints, make_engine):
    # 3 blocks per state (41 tokens); the pool holds three such states and a block
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=10, host_kv_bytes=0, speculation="off")
    rng = random.Random(3)
    fill(engine, ["pinned", "b", "c"], rng)
    engine.open_state("pinned").pin()
    fill(engine, ["d", "e"], rng)  # needs room twice: the least recently used unpinned states leave
    tiers = {info.id: info.tier for info in engine.states()}
    assert tiers["pinned"] == "device" and tiers["b"] == "none" and tiers["c"] == "none"
    assert {info.id: info.pinned for info in engine.states()}["pinned"] is True
    engine.open_state("pinned").unpin()
    fill(engine, ["f"], rng)  # now the pinned state is the least recently used: it leaves
    assert {info.id: info.tier for info in engine.states()}["pinned"] == "none"


def test_lower_priority_idle_states_leave_first(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=10, host_kv_bytes=0, speculation="off")
    rng = random.Random(4)
    important = engine.open_state("important")
    important.generate(SamplingParams(max_tokens=1, ignore_eos=True, priority=5), prompt=random_tokens(rng, 40))
    fill(engine, ["b", "c"], rng)
    fill(engine, ["d"], rng)  # LRU alone would evict "important" first
    infos = {info.id: info for info in engine.states()}
    assert infos["important"].tier == "device" and infos["important"].priority == 5
    assert infos["b"].tier == "none"


def test_pins_beyond_the_budget_degrade_and_never_deadlock(tiny_checkpoints, make_engine, hf_greedy):
    """Every state pinned, a budget for one: requests still run (pins give way before a request
    fails) and output equals transformers' greedy."""
    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, num_blocks=14, host_kv_bytes=0, speculation="off", pin_budget=0.3)
    rng = random.Random(5)
    for i in range(6):
        h = engine.open_state(f"s{i}")
        prompt = random_tokens(rng, 40)
        got = h.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt).token_ids
        assert list(got) == hf_greedy(str(path), prompt, 4)
        h.pin()
    resident = [info.id for info in engine.states() if info.tier == "device"]
    assert "s0" in resident  # the first pin is within the budget (4 of 0.3 x 14 blocks)
    assert engine.stats().kv_blocks_used <= 14


def test_random_pins_parks_and_closes_leak_nothing(tiny_checkpoints, make_engine):
    """A bounded stress: threads generate, pin, unpin and close states at random in a pool too small
    for them all (a host tier on, a tight pin budget); afterwards no block is leaked."""
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=20, speculation="off", pin_budget=0.25,
                         max_concurrent_agents=4)
    errors: list[BaseException] = []

    def agent(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for step in range(8):
                h = engine.open_state(f"a{seed}-{step % 3}")
                action = rng.random()
                if action < 0.2:
                    h.pin()
                elif action < 0.3:
                    h.unpin()
                elif action < 0.4:
                    h.close()
                    continue
                h.generate(SamplingParams(max_tokens=3, ignore_eos=True),
                           prompt=h.tokens + random_tokens(rng, rng.randint(5, 30)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "an agent is stuck: deadlock"
    assert not errors, errors
    held = sum(info.blocks for info in engine.states())
    assert engine.pool.num_used <= held  # shared blocks count once in the pool
    for info in engine.states():
        engine.open_state(info.id).close()
    assert engine.pool.num_used == 0
