"""Async scheduling: each step launched before the previous step's tokens are read back (the CUDA
default). On the CPU nothing overlaps, but `async_scheduling=True` runs the same logic, so these
tests hold it to the one-step-at-a-time engine and to transformers through stops (a step computed
past the end), cancellation (a token in flight dropped), preemption and penalties (steps that wait
for their tokens)."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from hibana_core import SamplingParams
from tiny_models import assert_greedy_matches, random_tokens

ARCH = "qwen3"

pytestmark = pytest.mark.timeout(300)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def run_agents(engine, plans: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """All agents at once, one thread each: a turn with its params, then a greedy follow-up turn
    that appends 5 tokens (it must find the state exactly as the first turn left it)."""
    start = threading.Barrier(len(plans), timeout=60)

    def agent(i: int) -> dict:
        prompt, params = plans[i]
        h = engine.open_state(f"agent-{i}")
        start.wait()
        first = h.generate(params, prompt=prompt)
        after_first = h.tokens
        h.append(random_tokens(random.Random(i), 5))
        second = h.generate(greedy(8))
        return dict(first=list(first.token_ids), reason=first.finish_reason, after_first=after_first,
                    second=list(second.token_ids), tokens=h.tokens)

    with ThreadPoolExecutor(len(plans)) as pool:
        return [f.result(timeout=240) for f in [pool.submit(agent, i) for i in range(len(plans))]]


def test_async_scheduling_gives_what_one_step_at_a_time_gives(tiny_checkpoints, make_engine):
    path = tiny_checkpoints[ARCH]
    prompts = [random_tokens(random.Random(100 + i), 20 + 7 * i) for i in range(6)]
    sync_engine = make_engine(path, async_scheduling=False)
    probe = sync_engine.open_state("probe").generate(greedy(12), prompt=prompts[1]).token_ids
    plans = [
        (prompts[0], greedy(24)),
        (prompts[1], greedy(24, stop_token_ids=[probe[6]])),   # stops mid-way: a step runs past it
        (prompts[2], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5)),
        (prompts[3], greedy(16, repetition_penalty=1.3)),        # steps wait for their tokens
        (prompts[4], greedy(1)),                                 # finishes at its first token
        (prompts[5], greedy(16, presence_penalty=0.5, frequency_penalty=0.5)),
    ]
    expected = run_agents(sync_engine, plans)
    got = run_agents(make_engine(path, async_scheduling=True), plans)
    assert expected[1]["reason"] == "stop" and len(expected[1]["first"]) == 7
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, f"agent {i}"
        assert min(have["tokens"]) >= 0  # real token ids only
    for i in (0, 1, 4):  # greedy: transformers' tokens too, on the state the first turn left
        assert_greedy_matches(path, plans[i][0], got[i]["first"])
        assert_greedy_matches(path, got[i]["tokens"][:-8], got[i]["second"])


def test_a_cancelled_stream_drops_the_token_in_flight(tiny_checkpoints, make_engine):
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, async_scheduling=True)
    h = engine.open_state("a")
    prompt = random_tokens(random.Random(7), 30)
    h.sync(prompt)
    events = h.stream(greedy(900))  # far more than a loaded machine makes before the close lands
    seen = [next(events).token_id for _ in range(3)]
    events.close()  # cancels: the engine may be a step (and a token on the device) ahead
    tokens = h.tokens
    assert tokens[:len(prompt) + 3] == prompt + seen
    assert min(tokens) >= 0 and len(h) == len(tokens) < len(prompt) + 900
    assert_greedy_matches(path, prompt, tokens[len(prompt):])
    more = h.generate(greedy(10))
    assert_greedy_matches(path, tokens, more.token_ids)


def recomputed_prompt_tokens(completions) -> int:
    """Prompt tokens computed more than once: with prefix caching off, only a request that gave
    its KV back (was preempted) computes part of its prompt again."""
    return sum(c.stats.computed - c.stats.prompt_tokens for c in completions)


@pytest.mark.parametrize("host_kv_bytes", [0, None], ids=["recompute", "host-tier"])
def test_preemption_under_async_scheduling(tiny_checkpoints, make_engine, host_kv_bytes):
    """Four agents submitted together, any two of whose histories overflow the pool (80 tokens,
    5 blocks each, of 8): the newest gives its KV back while the others' tokens are still in
    flight, and still generates transformers' greedy: without a host tier it recomputes later,
    with one its KV is parked and copied back (nothing computed twice)."""
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, async_scheduling=True, num_blocks=8, enable_prefix_caching=False,
                         host_kv_bytes=host_kv_bytes)
    plans = [(random_tokens(random.Random(200 + i), 40), greedy(40)) for i in range(4)]
    handles = [engine.open_state(f"p{i}") for i in range(4)]
    with engine.core.lock:  # all four queued before a step, whatever the machine's load
        streams = [h.stream(params, prompt=prompt) for h, (prompt, params) in zip(handles, plans)]
    outs = [[ev for ev in events][-1].completion for events in streams]
    if host_kv_bytes == 0:
        assert recomputed_prompt_tokens(outs) > 0, "no agent was preempted: the pool was meant to run out"
    else:
        assert engine.stats().parks > 0, "no agent was preempted: the pool was meant to run out"
        assert recomputed_prompt_tokens(outs) == 0
    assert sum(out.stats.preemptions for out in outs) > 0
    for (prompt, _), out, h in zip(plans, outs, handles):
        assert out.finish_reason == "length" and h.tokens == prompt + list(out.token_ids)
        assert out.stats.reused == 0, "KV a request computed itself, given back and found again, is not reuse"
        assert_greedy_matches(path, prompt, out.token_ids)


def test_context_limit_and_stop_strings_under_async_scheduling(tiny_checkpoints, make_engine):
    """A generation that runs into max_model_len, and one ended by a stop string (the demo
    model, which has a tokenizer), end where they end one step at a time."""
    from hibana_core import Engine

    path = tiny_checkpoints[ARCH]
    prompt = random_tokens(random.Random(11), 50)
    outs = []
    for mode in (False, True):
        h = make_engine(path, async_scheduling=mode, max_model_len=64).open_state("a")
        c = h.generate(greedy(40), prompt=prompt)
        outs.append((c.token_ids, c.finish_reason, h.tokens))
    assert outs[0] == outs[1] and outs[0][1] == "length" and len(outs[0][2]) == 64

    texts = []
    for mode in (False, True):
        with Engine.from_pretrained("demo", progress=False, async_scheduling=mode) as engine:
            text = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Write a long story about a fox."}],
                add_generation_prompt=True, tokenize=False)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            free = engine.open_state("free").generate(greedy(40), prompt=ids)
            stop = free.text[10:14]  # a string the model does write, ending it part-way
            h = engine.open_state("s")
            c = h.generate(SamplingParams(max_tokens=40, stop=[stop]), prompt=ids)
            # the text stops before the stop string, tokens part-way through the free run
            assert free.text.startswith(c.text + stop) and len(c.token_ids) < 40, (free.text, c.text)
            texts.append((c.text, c.finish_reason, c.token_ids, h.tokens))
    assert texts[0] == texts[1] and texts[0][1] == "stop"


def test_a_state_read_mid_generation_shows_only_known_tokens(tiny_checkpoints, make_engine):
    """While a token is still on the device, `tokens`, `len` and `states()` leave it out."""
    engine = make_engine(tiny_checkpoints[ARCH], async_scheduling=True)
    h = engine.open_state("a")
    prompt = random_tokens(random.Random(3), 25)
    seen = []
    for event in h.stream(greedy(12), prompt=prompt):
        if event.token_id is None:
            break
        seen.append(event.token_id)
        tokens, length = h.tokens, len(h)  # three reads while the engine goes on: each may know more
        (info,) = [s for s in engine.states() if s.id == "a"]
        assert min(tokens) >= 0 and len(tokens) <= length <= info.tokens  # never a token still on the device
        assert tokens[:len(prompt) + len(seen)] == prompt + seen
        if h.tokens == tokens:  # nothing came meanwhile: the three agree
            assert length == len(tokens)
    assert h.tokens == prompt + seen and len(seen) == 12


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-step", "async"])
def test_random_concurrent_operations_keep_every_state_exact(tiny_checkpoints, make_engine, join_all,
                                                             async_scheduling):
    """Six agents at once on a pool too small for all of them, each doing a seeded random mix of
    appends and generations, streams closed early, truncations, forks, syncs to other histories
    and stops: no error, no placeholder ever visible, and every completed generation is
    transformers' greedy continuation of the history it started from."""
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, async_scheduling=async_scheduling, num_blocks=40)
    generations: list[tuple[list[int], list[int]]] = []
    failures: list[BaseException] = []

    def agent(i: int) -> None:
        rng = random.Random(i)
        h = engine.open_state(f"s{i}")
        try:
            for step in range(15):
                op = rng.random()
                if op < 0.35:
                    h.append(random_tokens(rng, rng.randint(1, 20)))
                    before = h.tokens
                    c = h.generate(greedy(rng.randint(1, 12)))
                    assert h.tokens == before + list(c.token_ids)
                    generations.append((before, list(c.token_ids)))
                elif op < 0.5:
                    h.append(random_tokens(rng, 5))
                    events = h.stream(greedy(30))
                    for _ in range(rng.randint(1, 4)):
                        next(events)
                    events.close()
                elif op < 0.6 and len(h) > 3:
                    h.truncate(rng.randint(1, len(h) - 1))
                elif op < 0.7:
                    h.fork(f"s{i}-fork{step}").close()
                elif op < 0.8:
                    h.sync(random_tokens(rng, rng.randint(5, 60)))
                elif len(h):
                    h.generate(greedy(8, stop_token_ids=[rng.randrange(16, 100)]))
                assert min(h.tokens, default=0) >= 0
        except BaseException as exc:  # noqa: BLE001 - reported below, with the agent
            failures.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    join_all(threads, timeout=240)
    assert not failures, failures
    assert len(generations) > 20
    for history, got in generations:
        assert_greedy_matches(path, history, got)


GIL_SCRIPT = """
import sys
from hibana_core import Engine, SamplingParams
from hibana_core.engine_core import SWITCH_INTERVAL
sys.setswitchinterval(0.01)
options = dict(device="cpu", dtype="float32", block_size=16, num_blocks=64, progress=False)
first, second = Engine.from_pretrained(sys.argv[1], **options), Engine.from_pretrained(sys.argv[1], **options)
assert sys.getswitchinterval() == SWITCH_INTERVAL < 0.01, sys.getswitchinterval()
first.close()
assert sys.getswitchinterval() == SWITCH_INTERVAL, "the other engine still runs"
second.open_state("a").generate(SamplingParams(max_tokens=2), prompt=[5, 6, 7])
second.close()
assert sys.getswitchinterval() == 0.01, sys.getswitchinterval()
third = Engine.from_pretrained(sys.argv[1], **options)
del third  # an engine nobody closed, once collected, lets the setting go too
import gc; gc.collect()
assert sys.getswitchinterval() == 0.01, sys.getswitchinterval()
print("ok")
"""


def test_the_step_loop_takes_the_gil_back_quickly_while_an_engine_runs(tiny_checkpoints):
    """While any engine runs, the process's GIL switch interval is at most SWITCH_INTERVAL (the
    step loop gets the GIL back quickly from callers' busy threads); the last engine to stop, closed
    or collected, puts the process's own setting back. In a process of its own: the other tests'
    engines are alive in this one."""
    out = subprocess.run([sys.executable, "-c", GIL_SCRIPT, str(tiny_checkpoints["qwen3"])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("fail_at", [2, 5])
def test_a_read_back_that_fails_drops_the_step_launched_after_it(tiny_checkpoints, make_engine, monkeypatch, fail_at):
    """With async scheduling a step is launched before the previous one is read back, with that
    step's tokens as its inputs. Where reading the previous step back fails (the device failed
    under it), its requests fail or run again, and the step launched after it is dropped and
    scheduled again: every agent ends with the tokens of a run without the failure."""
    from hibana_core.runner import StepInFlight

    path = tiny_checkpoints[ARCH]
    rng = random.Random(9)
    prompts = [random_tokens(rng, 11 + 3 * i) for i in range(3)]

    def run(fail: bool):
        engine = make_engine(path, async_scheduling=True, speculation="off")
        reads = []
        result = StepInFlight.result

        def flaky(step):
            reads.append(step)
            if fail and len(reads) == fail_at:
                raise RuntimeError("the device failed under this step")
            return result(step)
        monkeypatch.setattr(StepInFlight, "result", flaky)
        handles = [engine.open_state(f"r{i}") for i in range(3)]
        with engine.core.lock:  # one batch
            streams = [h.stream(SamplingParams(max_tokens=12, ignore_eos=True), prompt=p)
                       for h, p in zip(handles, prompts)]
        outputs = [[ev.token_id for ev in st if ev.token_id is not None] for st in streams]
        monkeypatch.setattr(StepInFlight, "result", result)
        return outputs, [h.tokens for h in handles]

    assert run(fail=True) == run(fail=False)
    for p, (out, _) in zip(prompts, zip(*run(fail=False))):
        assert_greedy_matches(path, p, out)
