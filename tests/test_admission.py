"""Admission beyond `max_concurrent_agents`: the order waiting requests are admitted in
(`priority_strategy`), and `queue_timeout_ms`, which fails a request that waited too long and
nothing else."""

from __future__ import annotations

import random
import threading
import types

import pytest

from hibana_core import ConfigError, QueueTimeoutError, SamplingParams
from tiny_models import random_tokens


def _admission_order(engine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> list[str]:
    """Queue `prompts` together, in dict order, on an engine with one running slot (under the
    engine's lock: every one of them waits when the scheduler next picks), and return their names
    in the order the scheduler admitted them. Read from the scheduler: the time each reader thread
    saw its first token is not that order on a loaded machine (a reader held up a few steps sees
    its token after the next request's), nor is a blocker of a few dozen tokens sure to outlast
    the submissions queued behind it."""
    scheduler = engine.scheduler
    take, admitted = scheduler._next_waiting, []

    def recorded():
        request = take()
        admitted.append(request.state_id)
        return request

    scheduler._next_waiting = recorded
    with engine.core.lock:
        streams = [engine.open_state(name).stream(params[name], prompt=prompt) for name, prompt in prompts.items()]
    for events in streams:
        for _ in events:
            pass
    return list(dict.fromkeys(admitted))  # a request put back at the head of the queue counts once


@pytest.mark.parametrize("strategy, want", [("fifo", ["b", "c", "d"]), ("priority", ["c", "d", "b"]),
                                            ("shortest_first", ["c", "d", "b"])])
def test_admission_order(tiny_checkpoints, make_engine, strategy, want):
    engine = make_engine(tiny_checkpoints["llama"], max_concurrent_agents=1, priority_strategy=strategy,
                         speculation="off")
    rng = random.Random(2)
    prompts = {"b": random_tokens(rng, 200), "c": random_tokens(rng, 20), "d": random_tokens(rng, 80)}
    params = {name: SamplingParams(max_tokens=4, ignore_eos=True, priority=priority)
              for name, priority in (("b", 0), ("c", 5), ("d", 1))}
    assert _admission_order(engine, prompts, params) == want


def test_queue_timeout_fails_the_waiting_request_alone(tiny_checkpoints, make_engine, hf_greedy):
    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, max_concurrent_agents=1, queue_timeout_ms=20, speculation="off")
    rng = random.Random(3)
    long_prompt, waiting_prompt = random_tokens(rng, 40), random_tokens(rng, 50)
    runner = engine.open_state("runner")
    long = runner.stream(SamplingParams(max_tokens=300, ignore_eos=True), prompt=long_prompt)
    next(long)
    waiter = engine.open_state("waiter")
    with pytest.raises(QueueTimeoutError, match="queue_timeout_ms"):
        for _ in waiter.stream(SamplingParams(max_tokens=8, ignore_eos=True), prompt=waiting_prompt):
            pass
    tokens = [e.token_id for e in long if e.token_id is not None]
    assert len(tokens) == 299  # the running request went on, untouched
    # the waiter's state holds the history it was called with, and serves the next call
    assert {i.id: i.tokens for i in engine.states()}["waiter"] == len(waiting_prompt)
    got = list(waiter.generate(SamplingParams(max_tokens=8, ignore_eos=True)).token_ids)
    assert got == hf_greedy(str(path), waiting_prompt, 8)
    stats = engine.stats()
    assert stats.kv_blocks_used <= stats.kv_blocks_total


def test_no_timeout_for_a_request_admitted_in_time(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], max_concurrent_agents=2, queue_timeout_ms=60_000)
    rng = random.Random(4)
    handles = [engine.open_state(f"s{i}") for i in range(4)]
    results = [None] * 4

    def run(i: int) -> None:
        results[i] = handles[i].generate(SamplingParams(max_tokens=6, ignore_eos=True), prompt=random_tokens(rng, 30))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None and len(r.token_ids) == 6 for r in results)


def test_a_request_that_can_run_at_once_never_times_out_in_the_queue(tiny_checkpoints, make_engine, monkeypatch):
    """The queue expired before it admitted: a lone request on an idle engine that waited longer
    than queue_timeout_ms for the step loop to reach it failed with "0 running of
    max_concurrent_agents=64". Only a request still waiting for a slot or for room times out."""
    from hibana_core import scheduler as scheduler_module

    engine = make_engine(tiny_checkpoints["llama"], queue_timeout_ms=1, speculation="off")
    clock = iter(range(0, 10**9, 10))  # the scheduler's every read of the clock 10 s after the last
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=lambda: float(next(clock))))
    h = engine.open_state("lone")
    for _ in range(3):
        assert len(h.generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=[5, 6, 7]).token_ids) == 2


@pytest.mark.parametrize("options, message", [
    (dict(priority_strategy="lifo"), "priority_strategy must be one of fifo, priority, shortest_first"),
    (dict(queue_timeout_ms=0), "queue_timeout_ms must be > 0"),
    (dict(queue_timeout_ms="soon"), "queue_timeout_ms"),
])
def test_bad_admission_options(tiny_checkpoints, make_engine, options, message):
    with pytest.raises(ConfigError, match=message):
        make_engine(tiny_checkpoints["llama"], **options)


def test_priority_must_be_an_integer():
    with pytest.raises(ConfigError, match="priority"):
        SamplingParams(priority="high")


def test_shortest_first_counts_a_parked_states_kv_as_computed(tiny_checkpoints, make_engine):
    """A state parked in the host tier brings its KV back by copy: its turn computes only its new
    tokens, so under "shortest_first" it goes before a cold prompt, as a resident state does."""
    engine = make_engine(tiny_checkpoints["llama"], max_concurrent_agents=1, priority_strategy="shortest_first",
                         num_blocks=10, speculation="off")
    rng = random.Random(5)
    resumed = engine.open_state("resumed")
    resumed.generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=random_tokens(rng, 100))
    cold_prompt = random_tokens(rng, 20)
    # another agent's turn needs the pool: "resumed" (idle) is parked
    engine.open_state("other").generate(SamplingParams(max_tokens=60, ignore_eos=True),
                                        prompt=random_tokens(random.Random(1), 30))
    assert {i.id: i.tier for i in engine.states()}["resumed"] == "host"
    prompts = {"cold": cold_prompt, "resumed": resumed.tokens + [7]}
    params = {name: SamplingParams(max_tokens=2, ignore_eos=True) for name in prompts}
    order = _admission_order(engine, prompts, params)
    assert engine.stats().host_tier["resumes"] >= 1  # it came back by copy
    assert order == ["resumed", "cold"]


@pytest.mark.parametrize("speculation", ["off", "adaptive"])
def test_a_history_that_fills_the_pool_exactly_still_gives_its_token(tiny_checkpoints, make_engine, speculation):
    """A history of exactly the pool's slots (80 in 5 blocks of 16) synced, then a generate: it
    recomputes its last token for the logits, and the full block that token is in was published
    in the prefix index, so the write copied it first: no block to copy into, a MemoryBudgetError
    (79 tokens gave 2). The block, ours alone, is written in place: one token, at the pool's limit
    "length", and it is transformers' greedy token."""
    from tiny_models import hf_greedy

    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=5, speculation=speculation)
    for n, tokens in ((79, 2), (80, 1)):
        history = random_tokens(random.Random(n), n)
        state = engine.open_state(f"full-{n}")
        state.sync(history)
        out = state.generate(SamplingParams(max_tokens=20, ignore_eos=True))
        assert (len(out.token_ids), out.finish_reason) == (tokens, "length")
        assert list(out.token_ids) == hf_greedy(path, history, tokens)
        state.close()
