"""A randomized stress of the memory manager (issue 17): many agents on threads share a device
pool too small for them, a host tier of a few states (and sometimes a disk tier), small prefill
chunks, tool latencies, cancelled streams, queue timeouts, forks, truncations, priorities and
pins. Afterwards: every agent finished within a bound (a watchdog fails the test, it does not
hang), no state was lost or changed behind its agent's back, greedy output equals transformers'
generate on the full history on every turn, the host budget was never exceeded, and once
every state is closed no KV block, host byte or spill file is left.

Seeded and a few seconds on two cores; the `slow` variant runs more agents, turns and seeds
(`HIBANA_MEMFUZZ_SEEDS=N`: N of them instead of 20, a nightly-style run).
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time

import pytest

from hibana_core import QueueTimeoutError, SamplingParams
from tiny_models import ODD_SHAPES, assert_greedy_matches, make_tiny_checkpoint, random_tokens

pytestmark = pytest.mark.timeout(900)

MAX_HISTORY = 100
"""Past this many tokens an agent truncates its state: a turn's history must fit the smallest pool."""

SLOW_SEEDS = int(os.environ.get("HIBANA_MEMFUZZ_SEEDS", "20"))

WATCHDOG_S = 90.0
"""Every agent's turns end within this (a hang fails the test with the scheduler's queues)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    arch: str
    odd: bool          # ODD_SHAPES' config (windows shorter than a block on gemma3, MQA, ...)
    seed: int
    agents: int = 6
    turns: int = 5
    disk: bool = False


@dataclasses.dataclass
class Turn:
    """One generation an agent saw end: the history it ran on and the tokens it got."""

    agent: str
    history: list[int]
    output: list[int]
    how: str           # "generate", "stream-stop", "fork", ...


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, odd) -> a tiny checkpoint, built once per module."""
    root, made = tmp_path_factory.mktemp("memfuzz"), {}

    def get(arch: str, odd: bool):
        if (arch, odd) not in made:
            overrides = ODD_SHAPES[arch] if odd else {}
            made[arch, odd] = make_tiny_checkpoint(arch, root / f"{arch}-{int(odd)}", **overrides)
        return made[arch, odd]

    return get


class World:
    """The engine under stress and what its agents know: per agent id, the history it expects
    the state to hold (None: closed)."""

    def __init__(self, engine, scenario: Scenario) -> None:
        self.engine, self.scenario = engine, scenario
        self.turns: list[Turn] = []
        self.expected: dict[str, list[int] | None] = {}
        self.failures: list[str] = []
        self.over_budget: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def record(self, turn: Turn) -> None:
        with self.lock:
            self.turns.append(turn)

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message[:400])

    # --- one agent ------------------------------------------------------------------------------

    def agent(self, index: int) -> None:
        rng = random.Random(self.scenario.seed * 1000 + index)
        name = f"agent-{index}"
        h = self.engine.open_state(name)
        history = random_tokens(rng, rng.randint(20, 70))
        try:
            for _ in range(self.scenario.turns):
                time.sleep(rng.uniform(0, 0.05))  # the tool runs
                if rng.random() < 0.08:  # the agent is done; a new one takes its id
                    h.close()
                    h, history = self.engine.open_state(name), []
                if len(history) > MAX_HISTORY:  # the agent compacts its context (the pool holds 160 tokens)
                    h.truncate(rng.randint(20, 60))
                    history = h.tokens
                history = history + random_tokens(rng, rng.randint(1, 12))
                try:
                    history = self.one_turn(rng, name, h, history)
                except QueueTimeoutError:  # it waited too long for admission; it holds what it was sent
                    history = h.tokens
            self.expected[name] = history
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.fail(f"{name}: {type(exc).__name__}: {exc}")
            self.expected[name] = None

    def one_turn(self, rng: random.Random, name: str, h, history: list[int]) -> list[int]:
        """One randomly chosen thing an agent does; returns the history its state now holds."""
        params = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True,
                                priority=rng.choice([0, 0, 1, 5, -3]))
        action = rng.random()
        if action < 0.1:
            h.pin()
        elif action < 0.15:
            h.unpin()
        if action < 0.3:  # a stream stopped after a token or two (the caller's timeout)
            events = h.stream(params, prompt=history)
            got, stop_after = [], rng.randint(1, 2)
            for event in events:
                if event.completion is not None:
                    got = list(event.completion.token_ids)
                    break
                stop_after -= 1
                if not stop_after:
                    events.stop()
            self.record(Turn(name, history, got, "stream-stop"))
            return history + got
        if action < 0.4:  # a fork takes a turn of its own, then goes away
            twin = h.fork(f"{name}-fork-{rng.randrange(10**6)}")
            branch = history[: rng.randint(1, len(history))] + random_tokens(rng, rng.randint(1, 6))
            try:
                out = twin.generate(params, prompt=branch)
                self.record(Turn(twin.id, branch, list(out.token_ids), "fork"))
            finally:
                twin.close()
            return h.tokens  # the new tool tokens were never sent
        if action < 0.5:  # an edited history: the state drops its tail
            h.truncate(rng.randint(1, len(history)))
            history = h.tokens + random_tokens(rng, rng.randint(1, 6))
        try:
            out = h.generate(params, prompt=history)
        except QueueTimeoutError:
            if h.tokens != history:  # lost nothing: the state holds the prompt
                self.fail(f"{name}: a queue timeout changed the state ({len(h.tokens)} tokens, {len(history)} sent)")
            raise
        self.record(Turn(name, history, list(out.token_ids), "generate"))
        self.engine.registry.note_turn(h, called_tools=rng.random() < 0.8)  # as the chat layer does
        return history + list(out.token_ids)

    # --- the invariants -------------------------------------------------------------------------

    def watch_budget(self) -> None:
        """Sample the host tier's bytes while the agents run: never past its budget."""
        while not self.done.wait(0.005):
            tier = self.engine.host_tier
            if tier is not None and tier.bytes_used > tier.budget_bytes:
                self.over_budget.append(f"{tier.bytes_used} bytes parked in a budget of {tier.budget_bytes}")

    def queues(self) -> str:
        """The scheduler's queues, for the message of a hang: per request (state, tokens, computed,
        device blocks, parked, preemptions)."""
        def show(requests) -> list[tuple]:
            return [(r.state_id, len(r.seq), r.seq.num_computed, r.seq.num_blocks, r.seq.parked is not None,
                     r.preemptions) for r in list(requests)]

        scheduler = self.engine.scheduler
        return (f"running {show(scheduler.running)} waiting {show(scheduler.waiting)} "
                f"free blocks {self.engine.pool.num_free} of {self.engine.pool.num_blocks}")


def build_engine(make_engine, path, scenario: Scenario, tmp_path):
    rng = random.Random(scenario.seed)
    options = dict(num_blocks=rng.choice([10, 12, 16]), speculation=rng.choice(["off", "off", "adaptive"]),
                   max_prefill_chunk=rng.choice([8, 16, 32]), max_num_batched_tokens=rng.choice([32, 64]),
                   max_concurrent_agents=rng.choice([1, 2, 3, 8]), pin_budget=rng.choice([0.0, 0.25, 0.5]),
                   priority_strategy=rng.choice(["fifo", "priority", "shortest_first"]),
                   queue_timeout_ms=rng.choice([None, 150.0, 2000.0]), max_model_len=512,
                   async_scheduling=rng.choice([True, False]))  # True: the GPU's step loop, run on the CPU
    probe = make_engine(path, num_blocks=4, speculation="off")
    per_block = probe.kv_cache.bytes_per_block_here
    probe.close()
    host = per_block * 4 * rng.choice([0, 1, 2, 3])  # a few states' worth (a state is 2-10 blocks); 0: disk only
    disk = {"state_dir": tmp_path / "states"} if scenario.disk else {}
    return make_engine(path, host_kv_bytes=host, **options, **disk), options


def run_scenario(scenario: Scenario, checkpoints, make_engine, tmp_path) -> int:
    """Run the agents and check every invariant; returns how many times states were parked."""
    path = checkpoints(scenario.arch, scenario.odd)
    engine, options = build_engine(make_engine, path, scenario, tmp_path)
    world = World(engine, scenario)
    threads = [threading.Thread(target=world.agent, args=(i,), name=f"agent-{i}", daemon=True)
               for i in range(scenario.agents)]
    watcher = threading.Thread(target=world.watch_budget, daemon=True)
    watcher.start()
    for t in threads:
        t.start()
    deadline = time.monotonic() + WATCHDOG_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    world.done.set()
    context = f"{scenario} {options}"
    assert not stuck, f"{context}: agents still waiting after {WATCHDOG_S} s: {stuck}; {world.queues()}"
    assert not world.failures, f"{context}: {world.failures}"
    assert not world.over_budget, f"{context}: {world.over_budget[:3]}"

    open_ids = {info.id for info in engine.states()}
    assert open_ids == {name for name, h in world.expected.items() if h is not None}, \
        f"{context}: states open {sorted(open_ids)}"
    for name, history in world.expected.items():
        assert engine.open_state(name).tokens == history, f"{context}: state {name} lost or changed"

    for turn in world.turns:  # every turn's tokens are transformers' greedy continuation
        try:
            assert_greedy_matches(path, turn.history, turn.output)
        except AssertionError as exc:
            raise AssertionError(f"{context}: {turn.how} of {turn.agent}: {exc}") from None

    parks = engine.stats().parks
    if scenario.disk:
        engine = restart(engine, make_engine, path, world, context)
    for name in world.expected:
        engine.open_state(name).close()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0, f"{context}: {stats.kv_blocks_used} blocks leaked"
    if stats.host_tier is not None:
        assert stats.host_tier["bytes_used"] == 0 and stats.host_tier["disk_bytes_used"] == 0, \
            f"{context}: parked copies left {stats.host_tier}"
    if scenario.disk:
        from hibana_core.engine import SPILL_LOCK

        # (the live engine's lock on its spill folder is no file left behind)
        spilled = [p for p in (tmp_path / "states").rglob("*") if p.is_file() and p.name != SPILL_LOCK]
        assert not spilled, f"{context}: files left {spilled}"
    return parks


def restart(engine, make_engine, path, world: World, context: str):
    """Close the engine (its states are written to state_dir) and start another on the same
    folder: each agent's state comes back by id with its history, and its next turn computes
    only its new tokens, exactly."""
    for name, history in world.expected.items():  # KV for every token (a truncation into a freed
        engine.open_state(name).sync(history)     # window, or a dropped copy, recomputes anyway)
    options = dict(engine.config.cache.__dict__, **engine.config.scheduler.__dict__)
    engine.close()
    engine = make_engine(path, num_blocks=engine.pool.num_blocks, speculation="off", max_model_len=512,
                         host_kv_bytes=options["host_kv_bytes"], state_dir=options["state_dir"],
                         max_prefill_chunk=options["max_prefill_chunk"])
    rng = random.Random(0)
    for name, history in world.expected.items():
        h = engine.open_state(name)
        assert h.tokens == history, f"{context}: state {name} lost in a restart"
        prompt = history + random_tokens(rng, 3)
        out = h.generate(SamplingParams(max_tokens=3, ignore_eos=True), prompt=prompt)
        assert out.stats.computed == 3, f"{context}: {name} recomputed {out.stats.computed - 3} tokens after a restart"
        assert_greedy_matches(path, prompt, out.token_ids)
    return engine


SCENARIOS = [
    Scenario("llama", False, seed=14),
    Scenario("gemma3", True, seed=2, disk=True),
    Scenario("qwen2", True, seed=5),
    Scenario("mistral", True, seed=4, disk=True),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s.arch}-{s.seed}")
def test_agents_under_memory_pressure(scenario, checkpoints, make_engine, tmp_path):
    assert run_scenario(scenario, checkpoints, make_engine, tmp_path) > 0, "the pool was never short: nothing parked"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 10 + SLOW_SEEDS))
def test_agents_under_memory_pressure_long(seed, checkpoints, make_engine, tmp_path):
    arch = random.Random(seed).choice(["llama", "qwen3", "gemma3", "mistral", "phi3", "qwen2"])
    scenario = Scenario(arch, odd=seed % 2 == 0, seed=seed, agents=8, turns=10, disk=seed % 3 == 0)
    run_scenario(scenario, checkpoints, make_engine, tmp_path)
