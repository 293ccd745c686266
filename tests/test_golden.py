"""Golden test: the engine's greedy output is transformers' greedy output, token for token.

For each family, 4 agents run 4 turns at once (threads, with async scheduling on as on CUDA: each
step launched before the previous one's tokens are read back; or asyncio with `agenerate`, with
the CPU's default of one step at a time): each turn
appends 10-60 seeded random tokens and generates 16-32 greedy tokens. Every generation is compared
with `transformers` generate on the full history the state held before it; every append computes
at most its new tokens plus one block, the rest being reused.

A last case runs prefills in small chunks on a pool so small that agents are preempted and
recompute, and holds every token to transformers just the same.
"""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from hibana_core import Completion, SamplingParams
from tiny_models import EVERY_TENSOR_USED, ARCHS, agent_turn_plan, assert_greedy_matches, random_tokens

AGENTS = 4
BLOCK_SIZE = 16

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


@dataclass
class Turn:
    """What one turn did, kept for the comparison with HF after all agents finish."""

    new: list[int]
    history: list[int]  # the state's tokens before generating
    reused: int
    computed: int
    generated: list[int]


def plan_seed(arch: str, agent: int, variant: int) -> int:
    return 1000 * ARCHS.index(arch) + 500 * variant + agent


def check_append(h, history: list[int], new: list[int], st) -> None:
    assert h.tokens == history, "append must leave the state holding the old history + the new tokens"
    assert len(h) == len(history)
    assert st.reused + st.computed == len(history), (st, len(history))
    assert st.computed <= len(new) + BLOCK_SIZE, f"{st} for {len(new)} new tokens"


def check_generate(h, history: list[int], n: int, c) -> None:
    assert len(c.token_ids) == n, (len(c.token_ids), n)
    assert c.finish_reason == "length"
    assert h.tokens == history + list(c.token_ids), "generated tokens must be appended to the state"


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_against_hf(path, agents_turns: list[list[Turn]]) -> None:
    for agent, turns in enumerate(agents_turns):
        assert len(turns) == 4
        for i, turn in enumerate(turns):
            try:
                assert_greedy_matches(path, turn.history, turn.generated)
            except AssertionError as e:
                raise AssertionError(f"agent {agent} turn {i}: {e}") from None


def check_engine_stats(engine, agents_turns: list[list[Turn]]) -> None:
    """Engine-wide counters agree with what the handles saw (a generate may count its own
    prompt reuse, and recompute a token, on top of the appends)."""
    turns = [t for ts in agents_turns for t in ts]
    stats = engine.stats()
    assert stats.generated_tokens == sum(len(t.generated) for t in turns)
    assert sum(t.computed for t in turns) <= stats.prompt_tokens_computed, stats
    assert stats.prompt_tokens_computed <= sum(len(t.new) + BLOCK_SIZE for t in turns), stats
    assert stats.prompt_tokens_reused >= sum(t.reused for t in turns), stats
    assert stats.steps > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_golden_threads(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = make_engine(path, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                         async_scheduling=True)
    start = threading.Barrier(AGENTS, timeout=60)

    def run_agent(agent: int) -> list[Turn]:
        h = engine.open_state(f"agent-{agent}")
        history: list[int] = []
        turns = []
        start.wait()
        for new, n in agent_turn_plan(plan_seed(arch, agent, variant=0)):
            history = history + new
            st = h.append(new)
            check_append(h, history, new, st)
            c = h.generate(params(n))
            check_generate(h, history, n, c)
            turns.append(Turn(new, history, st.reused, st.computed, list(c.token_ids)))
            history = history + list(c.token_ids)
        return turns

    with ThreadPoolExecutor(AGENTS) as pool:
        futures = [pool.submit(run_agent, agent) for agent in range(AGENTS)]
        agents_turns = [f.result(timeout=240) for f in futures]

    check_engine_stats(engine, agents_turns)
    check_against_hf(path, agents_turns)


@pytest.mark.parametrize("arch", ARCHS)
async def test_golden_asyncio(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = make_engine(path, device="cpu", dtype="float32", block_size=BLOCK_SIZE)

    async def run_agent(agent: int) -> list[Turn]:
        h = engine.open_state(f"async-agent-{agent}")
        history: list[int] = []
        turns = []
        for new, n in agent_turn_plan(plan_seed(arch, agent, variant=1)):
            history = history + new
            st = h.append(new)
            check_append(h, history, new, st)
            c = await h.agenerate(params(n))
            check_generate(h, history, n, c)
            turns.append(Turn(new, history, st.reused, st.computed, list(c.token_ids)))
            history = history + list(c.token_ids)
        return turns

    agents_turns = await asyncio.wait_for(asyncio.gather(*(run_agent(a) for a in range(AGENTS))), 240)

    check_engine_stats(engine, agents_turns)
    check_against_hf(path, agents_turns)


CHUNK = 12  # not a divisor of BLOCK_SIZE: chunks start mid-block
SMALL_POOL = 12  # blocks of 16; each agent's history takes 5-6 blocks, then up to 9


@pytest.mark.parametrize("prefix_caching, host_kv_bytes", [(True, 0), (False, 0), (True, None)],
                         ids=["prefix-caching", "no-prefix-caching", "host-tier"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gpt_oss"])
def test_golden_chunked_prefill_and_preemption(arch, prefix_caching, host_kv_bytes, tiny_checkpoints, make_engine):
    """4 agents, two turns each with prompts several chunks long, on a pool far too small for
    all of them: prefills run in chunks of CHUNK tokens, agents give their KV back and recompute,
    or, with the host tier, park it and copy it back (asserted from the requests' and the
    engine's stats), and every token is transformers' greedy.

    Each round's four turns are queued together under the engine's lock, so that they run at
    once whatever the machine's load: released from threads, a loaded machine could run them one
    after another (then nothing running is ever preempted, and a state parked after its agent's
    last turn is never resumed: the CI failure of the windowed host-tier case)."""
    path = tiny_checkpoints[arch]
    engine = make_engine(path, block_size=BLOCK_SIZE, num_blocks=SMALL_POOL, max_prefill_chunk=CHUNK,
                         enable_prefix_caching=prefix_caching, async_scheduling=True, host_kv_bytes=host_kv_bytes)
    rngs = [random.Random(plan_seed(arch, agent, variant=2)) for agent in range(AGENTS)]
    plans = [((rng.randint(50, 70), 20), (rng.randint(13, 30), 12)) for rng in rngs]
    handles = [engine.open_state(f"chunked-{agent}") for agent in range(AGENTS)]
    turns: list[tuple[list[int], Completion]] = []
    for round_ in range(2):
        histories = [h.tokens + random_tokens(rng, plan[round_][0]) for h, rng, plan in zip(handles, rngs, plans)]
        with engine.core.lock:  # all four queued before the next step
            streams = [h.stream(params(plan[round_][1]), prompt=history)
                       for h, plan, history in zip(handles, plans, histories)]
        completions = [list(events)[-1].completion for events in streams]
        for h, plan, history, c in zip(handles, plans, histories, completions):
            check_generate(h, history, plan[round_][1], c)
            turns.append((history, c))

    # a request that gave its KV back serves part of its prompt twice (computed, or re-adopted)
    served_twice = sum(c.stats.computed + c.stats.reused - c.stats.prompt_tokens for _, c in turns)
    stats = engine.stats()
    assert sum(c.stats.preemptions for _, c in turns) > 0, "nothing running was preempted: the pool was meant to run out"
    if host_kv_bytes == 0:
        assert served_twice > 0, "no agent was preempted: the pool was meant to run out"
    else:
        assert stats.parks > 0 and stats.resumes > 0, "nothing was parked: the pool was meant to run out"
    assert all(c.stats.prompt_tokens > CHUNK for _, c in turns)
    for history, c in turns:
        assert_greedy_matches(path, history, c.token_ids)
