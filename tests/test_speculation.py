"""Speculation through the whole engine (issue 13): drafts change speed, never output or state.

- greedy output with speculation on equals output with it off (and so `transformers` generate),
  for every family and the demo model, with agents of mixed draft settings batched together
  under async scheduling, while drafts are both accepted and rejected;
- after rejections a state's KV holds exactly what a run without speculation holds;
- a drafter registered by a plugin is used when named (engine-wide and per request), an unknown
  one is a ConfigError that lists the registered drafters;
- seeded sampling, forced outputs, max_tokens and stops inside an accepted draft end exactly as
  without speculation.

Random tiny models rarely repeat themselves, so acceptance comes from two sources: the oracle
drafter (tests/spec_drafters.py), which proposes the continuation a run without speculation
produced with chosen positions wrong, and the suffix drafter's shared corpus, which holds what an
agent generated the first time it answered a history it is asked again.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.errors import ConfigError
from hibana_plugins.manager import PluginWarning
from hibana_core.speculation import force_outputs
from spec_drafters import BrokenDrafter, FixedDrafter, OracleDrafter, ProposeOnly, registered, registered_as_is
from tiny_models import (ARCHS, VOCAB_SIZE, assert_greedy_matches, hf_greedy, make_tiny_checkpoint,
                         random_tokens)

pytestmark = pytest.mark.timeout(120)

GEN = 20  # tokens generated per turn


def wrong_every_fifth(p: int) -> bool:
    """The oracle's drafts at continuation positions 3, 8, 13, ... are wrong."""
    return p % 5 == 3


def greedy(n: int = GEN, speculation=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, speculation=speculation, **kw)


def state_of(engine, handle):
    """The KVSequence behind a handle (white box: the KV comparison reads its blocks)."""
    return engine.registry._entry(handle).seq


def concurrently(fn, args: list) -> list:
    """fn(*a) for every a in `args` on its own thread, released together."""
    start = threading.Barrier(len(args), timeout=60)

    def run(a):
        start.wait()
        return fn(*a)

    with ThreadPoolExecutor(len(args)) as pool:
        futures = [pool.submit(run, a) for a in args]
        return [f.result(timeout=100) for f in futures]


# --- 1. greedy equality, mixed draft settings in one batch ----------------------------------------

MODES = [
    "off",
    {"method": "suffix", "k": 2},
    {"method": "suffix", "k": 4},
    "adaptive",
    {"method": "ngram", "k": 3},
    {"method": "oracle", "k": 3},
    {"method": "oracle"},  # adaptive with the oracle
]


def mixed_batch(make_engine, path, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """One agent per mode of MODES, each with its own history; all generate at once (threads,
    async scheduling). First every history is answered with speculation off (the reference, and
    the oracle's continuations); then each agent answers its history in its mode twice (the
    second time after `truncate` back to it: the suffix drafters find the first answer in their
    shared corpus). Returns (histories, reference outputs)."""
    oracle = OracleDrafter(vocab, wrong_every_fifth)
    rng = random.Random(seed)

    def history() -> list[int]:  # A + B + A: prompt lookup finds the second A, drafts B
        a, b = ([rng.randrange(vocab) for _ in range(rng.randint(8, 14))] for _ in range(2))
        return a + b + a

    histories = [history() for _ in MODES]
    with registered(oracle=oracle):
        engine = make_engine(path, async_scheduling=True, max_num_batched_tokens=256)

    def reference(i: int) -> list[int]:
        return list(engine.open_state(f"ref-{i}").generate(greedy(speculation="off"), prompt=histories[i]).token_ids)

    want = concurrently(reference, [(i,) for i in range(len(MODES))])
    assert engine.stats().draft_tokens_proposed == 0, "speculation='off' requests drafted"
    for history, out in zip(histories, want):
        oracle.add(history, out)

    def agent(i: int) -> list[list[int]]:
        h = engine.open_state(f"agent-{i}")
        outs = [list(h.generate(greedy(speculation=MODES[i]), prompt=histories[i]).token_ids)]
        assert h.tokens == histories[i] + outs[0]
        h.truncate(len(histories[i]))
        outs.append(list(h.generate(greedy(speculation=MODES[i])).token_ids))
        assert h.tokens == histories[i] + outs[1]
        return outs

    got = concurrently(agent, [(i,) for i in range(len(MODES))])
    for i, (outs, expected) in enumerate(zip(got, want)):
        for turn, out in enumerate(outs):
            assert out == expected, f"agent {i} ({MODES[i]}) turn {turn}: {out} != {expected}"

    stats = engine.stats()
    assert stats.max_batch_sequences > 1, "the agents never shared a step"
    assert stats.verify_steps > 0
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed, stats
    speculator = engine.scheduler.speculation
    for method in ("suffix", "ngram", "oracle"):  # each drafter's drafts were verified
        assert speculator.global_stats[method].tries[0] > 0, method
    for method in ("suffix", "oracle"):  # runs of two accepted drafts: no chance hits
        assert speculator.global_stats[method].accepted[1] > 0, method
    assert speculator._stats.get(state_of(engine, engine.open_state("agent-0"))) is None, \
        "the agent with speculation='off' drafted"
    assert oracle.proposed > oracle.wrong_proposed > 0
    return histories, want


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equality_mixed_draft_settings(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    histories, want = mixed_batch(make_engine, path, VOCAB_SIZE, seed=ARCHS.index(arch))
    for history, out in zip(histories, want):
        assert_greedy_matches(path, history, out)


def test_greedy_equality_mixed_draft_settings_demo(make_engine):
    """The demo model (a trained qwen3 that repeats itself: the suffix and ngram drafters find
    their own drafts); its reference is the engine with speculation off."""
    mixed_batch(make_engine, "demo", 4096, seed=99)


def test_greedy_equality_with_drafts_under_preemption(tiny_checkpoints, make_engine):
    """Four agents, prompts several prefill chunks long, on a pool too small for them all:
    drafts take blocks only where there is room, agents give their KV back and recompute, and
    every token is still transformers' greedy (as test_golden's chunked case, with drafts)."""
    path = tiny_checkpoints["llama"]
    modes = [{"method": "oracle", "k": 16}, {"method": "suffix", "k": 4}, "adaptive", {"method": "oracle"}]
    oracle = OracleDrafter(VOCAB_SIZE, wrong_every_fifth)
    plans = []
    for agent in range(4):
        rng = random.Random(300 + agent)
        first = random_tokens(rng, rng.randint(50, 70))
        out1 = hf_greedy(path, first, GEN)
        second = first + out1 + random_tokens(rng, rng.randint(13, 30))
        out2 = hf_greedy(path, second, 12)
        oracle.add(first, out1)
        oracle.add(second, out2)
        plans.append([(first, out1), (second, out2)])
    with registered(oracle=oracle):
        # no host tier: its KV given back, an agent recomputes (parked, it would wait for room instead)
        engine = make_engine(path, num_blocks=12, max_prefill_chunk=12, async_scheduling=True, host_kv_bytes=0)

    handles = [engine.open_state(f"chunked-{i}") for i in range(4)]
    rounds = []
    for turn in range(2):  # each round's four turns queued together: at once on any machine (see test_golden)
        with engine.core.lock:
            streams = [h.stream(greedy(len(plan[turn][1]), speculation=mode), prompt=plan[turn][0])
                       for h, plan, mode in zip(handles, plans, modes)]
        rounds.append([list(events)[-1].completion for events in streams])
    completions = [list(outs) for outs in zip(*rounds)]
    for i, (plan, outs) in enumerate(zip(plans, completions)):
        for (history, want), c in zip(plan, outs):
            assert list(c.token_ids) == want, f"agent {i} ({modes[i]})"
    served_twice = sum(c.stats.computed + c.stats.reused - c.stats.prompt_tokens for cs in completions for c in cs)
    assert served_twice > 0, "no agent was preempted: the pool was meant to run out"
    assert sum(c.stats.preemptions for cs in completions for c in cs) > 0
    stats = engine.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed, stats


def test_drafts_share_a_small_token_budget(tiny_checkpoints, make_engine):
    """max_num_batched_tokens=8 for three agents drafting 4 each: prefills run in chunks, drafts
    take what the budget leaves, no step runs more than 8 tokens, and the output is unchanged."""
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(21)
    histories = [random_tokens(rng, 20) for _ in range(3)]
    wants = [hf_greedy(path, history, 12) for history in histories]
    oracle = OracleDrafter(VOCAB_SIZE)
    for history, want in zip(histories, wants):
        oracle.add(history, want)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 4}, max_num_batched_tokens=8,
                             async_scheduling=True)
    sizes = []
    launch = engine.runner.launch

    def counting_launch(scheduled, previous=None, **kwargs):
        sizes.append(scheduled.num_tokens)
        return launch(scheduled, previous, **kwargs)

    engine.runner.launch = counting_launch
    outs = concurrently(lambda i: list(engine.open_state(f"b{i}").generate(greedy(12), prompt=histories[i]).token_ids),
                        [(i,) for i in range(3)])
    assert outs == wants
    assert max(sizes) <= 8 and sizes.count(8) > 0
    stats = engine.stats()
    assert stats.draft_tokens_accepted == stats.draft_tokens_proposed > 0, stats


def test_drafts_stay_within_the_rows_the_workspace_holds(tiny_checkpoints, make_engine):
    """The workspace holds the logits of max_concurrent_agents x (1 + the engine default's draft
    length) rows: a request that asks for drafts in an engine whose default is off drafts only
    into rows other sequences leave unused (here none: one agent at most), with the same output."""
    path = tiny_checkpoints["qwen3"]
    history = random_tokens(random.Random(8), 24)
    want = hf_greedy(path, history, 12)
    oracle = OracleDrafter(VOCAB_SIZE)
    oracle.add(history, want)
    with registered(oracle=oracle):
        off = make_engine(path, speculation="off", max_concurrent_agents=1)
        fixed = make_engine(path, speculation={"method": "oracle", "k": 3}, max_concurrent_agents=1)
    asked = greedy(12, speculation={"method": "oracle", "k": 3})
    assert list(off.open_state("a").generate(asked, prompt=history).token_ids) == want
    assert off.stats().draft_tokens_proposed == 0
    assert list(fixed.open_state("a").generate(asked, prompt=history).token_ids) == want
    assert fixed.stats().draft_tokens_accepted == fixed.stats().draft_tokens_proposed > 0
    # adaptive in one agent slot: that agent may verify as long a draft as in 64 slots (16)
    with registered(oracle=oracle):
        one = make_engine(path, speculation={"method": "oracle"}, max_concurrent_agents=1)
    got = one.open_state("a").generate(greedy(12, speculation={"method": "oracle", "k": 11}), prompt=history)
    assert list(got.token_ids) == want
    assert one.stats().draft_tokens_accepted == 11, one.stats()


# --- 3. after rejections the KV is what a run without speculation holds ---------------------------

KV_ATOL = 1e-4
"""Float32 on the CPU: a token's KV computed in a multi-token verify step, or beside other
states' tokens (which batch they share is the threads' timing), runs matmuls of other shapes
than a one-token decode, so its sums may round differently (observed up to 1.06e-5 in a full
run under two workers); a KV row of a wrong token or position differs by ~1e-1."""


def kv_rows(engine, seq, n: int) -> torch.Tensor:
    """[n, layers, 2, kv_heads, head_dim]: the KV of positions 0..n-1, read through the
    sequence's block table."""
    data = engine.kv_cache.data  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    bs = engine.kv_cache.block_size
    return torch.stack([data[:, :, seq.block_ids[p // bs], p % bs] for p in range(n)])


def snapshot(engine, i: int) -> tuple[list[int], int, int, torch.Tensor]:
    """State s{i}'s tokens, computed count, blocks held and the KV of its computed positions."""
    seq = state_of(engine, engine.open_state(f"s{i}"))
    return list(seq.tokens), seq.num_computed, len(seq.block_ids), kv_rows(engine, seq, seq.num_computed)


def assert_same_state(plain, spec, i: int, when: str) -> None:
    tokens, computed, blocks, kv = snapshot(plain, i)
    spec_tokens, spec_computed, spec_blocks, spec_kv = snapshot(spec, i)
    assert spec_tokens == tokens, f"state {i} {when}"
    assert (spec_computed, spec_blocks) == (computed, blocks) == (len(tokens) - 1, -(-computed // 16)), \
        f"state {i} {when}: (computed, blocks) {spec_computed, spec_blocks} != {computed, blocks}"
    diff = (spec_kv - kv).abs().flatten(1).amax(1)  # [positions]
    assert diff.max() <= KV_ATOL, f"state {i} {when}: KV differs at position {int(diff.argmax())}"


def test_kv_after_rejections_equals_a_run_without_speculation(tiny_checkpoints, make_engine):
    """Two turns per state, the second after new tokens; every third draft is wrong. After each
    turn the speculating engine's states hold what the plain engine's hold: tokens, computed
    count, blocks, and the KV of every computed position."""
    path = tiny_checkpoints["qwen2"]
    rng = random.Random(7)
    histories = [random_tokens(rng, n) for n in (21, 33, 47)]  # drafts cross block boundaries
    appended = [random_tokens(rng, n) for n in (5, 16, 9)]
    plain = make_engine(path, speculation="off", async_scheduling=True)
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 3 == 1)
    with registered(oracle=oracle):
        spec = make_engine(path, speculation={"method": "oracle", "k": 4}, async_scheduling=True)

    def turn(engine, i: int, first: bool) -> list[int]:
        h = engine.open_state(f"s{i}")
        if first:
            return list(h.generate(greedy(), prompt=histories[i]).token_ids)
        h.append(appended[i])  # a turn after the rejections: its KV sits past them
        return list(h.generate(greedy(10)).token_ids)

    for first in (True, False):
        want = concurrently(turn, [(plain, i, first) for i in range(3)])
        for i, out in enumerate(want):
            oracle.add(state_of(plain, plain.open_state(f"s{i}")).tokens[:-len(out)], out)
        assert concurrently(turn, [(spec, i, first) for i in range(3)]) == want
        for i in range(3):
            assert_same_state(plain, spec, i, "after the first turn" if first else "after the second turn")
    stats = spec.stats()
    assert stats.draft_tokens_accepted > 0 and stats.draft_tokens_proposed - stats.draft_tokens_accepted > 20, stats
    assert spec.pool.num_used == plain.pool.num_used, "rejected drafts' blocks were not given back"


# --- 4. a plugin's drafter ---------------------------------------------------------------------


def test_a_plugin_drafter_is_used_when_named(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    oracle = OracleDrafter(VOCAB_SIZE)
    history = random_tokens(random.Random(3), 30)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 3})
        other = make_engine(path, speculation="off")
    want = list(other.open_state("a").generate(greedy(), prompt=history).token_ids)
    oracle.add(history, want)

    # engine-wide: every step drafts 3, fewer only where max_tokens leaves less room (18 tokens
    # in steps of 1 + 3: the last step may draft 1), and all are right
    h = engine.open_state("a")
    n = 18
    assert list(h.generate(greedy(n), prompt=history).token_ids) == want[:n]
    assert [k for _, k, _ in oracle.calls] == [3, 3, 3, 3, 1]
    assert [length - len(history) for length, _, _ in oracle.calls] == [0, 4, 8, 12, 16]
    assert oracle.calls[0][0] == len(history), "the first draft follows the prompt"
    stats = engine.stats()
    assert stats.draft_tokens_proposed == stats.draft_tokens_accepted == oracle.proposed > 0
    assert oracle.finished_outputs == [want[:n]], "the drafter is told what the request generated"

    # per request, on an engine whose default is off
    calls = len(oracle.calls)
    h2 = other.open_state("b")
    assert list(h2.generate(greedy(speculation={"method": "oracle", "k": 3}), prompt=history).token_ids) == want
    assert len(oracle.calls) > calls and other.stats().draft_tokens_accepted > 0

    # an unknown name: per request and engine-wide, the message lists what is registered
    with pytest.raises(ConfigError, match=r"registered: draft_model, layer_skip, ngram, oracle, suffix"):
        h2.generate(greedy(speculation={"method": "nope", "k": 3}))
    assert h2.tokens == history + want, "a refused call leaves the state as it was"
    with registered(oracle=oracle), pytest.raises(ConfigError, match=r"'nope'.*registered: draft_model, layer_skip, ngram, oracle, suffix"):
        make_engine(path, speculation={"method": "nope"})


def test_a_broken_plugin_drafter_costs_speed_only(tiny_checkpoints, make_engine):
    """A drafter that raises, or proposes ids past the vocabulary, leaves every request's output
    as it is: its own (decoded without its drafts, with a warning) and a bystander's that does
    not speculate at all (before, the step failed and took the bystander's request with it)."""
    path = tiny_checkpoints["qwen2"]
    raising = BrokenDrafter(fine_calls=2)
    past_vocab = BrokenDrafter(tokens=[5, VOCAB_SIZE, 6])  # the first id is fine, the second is not
    negative = BrokenDrafter(tokens=[-1, 5])

    class Meddling:  # changes the history it is handed (it was the state's live list: greedy output changed)
        def propose(self, state, k):
            state.tokens.append(7) if hasattr(state.tokens, "append") else state.tokens.__setitem__(0, 7)
            return [7]

        def finished(self, context, output):
            output.append(7) if hasattr(output, "append") else output.__setitem__(0, 7)

    with registered(raising=raising, past_vocab=past_vocab, negative=negative, meddling=Meddling()):
        engine = make_engine(path, speculation="off")
    rng = random.Random(21)
    histories = [random_tokens(rng, 20) for _ in range(5)]
    modes = ["off", {"method": "raising", "k": 3}, {"method": "past_vocab", "k": 3}, {"method": "negative"},
             {"method": "meddling"}]

    def run(i: int) -> list[int]:
        return list(engine.open_state(f"broken-{i}").generate(greedy(speculation=modes[i]), prompt=histories[i]).token_ids)

    with pytest.warns(PluginWarning, match=r"drafter 'raising' raised in propose: RuntimeError\('a drafter bug'\)"):
        outs = concurrently(run, [(i,) for i in range(5)])
    for i, (history, out) in enumerate(zip(histories, outs)):
        assert_greedy_matches(path, history, out)
        assert engine.states()[[s.id for s in engine.states()].index(f"broken-{i}")].tokens == len(history) + len(out)
    assert raising.calls > 2 and past_vocab.calls > 0
    stats = engine.stats()
    assert stats.draft_tokens_proposed > 0, "the valid prefix of past_vocab's proposals was drafted"
    errors = stats.speculation["drafter_errors"]
    assert errors["raising"] > 1 and set(errors) == {"raising", "past_vocab", "negative", "meddling"}, errors


class _BrokenOptionals(FixedDrafter):
    """Drafts fine; its optional `summary`, `resident_bytes` and `close` raise."""

    def summary(self) -> dict:
        raise RuntimeError("a drafter bug in summary")

    def resident_bytes(self) -> int:
        raise RuntimeError("a drafter bug in resident_bytes")

    def close(self) -> None:
        raise RuntimeError("a drafter bug in close")


def test_a_drafter_whose_optional_calls_raise_fails_no_engine_call(tiny_checkpoints, make_engine):
    """A plugin drafter's `summary`, `resident_bytes` or `close` that raises is skipped, counted
    and warned of, as one in `propose` is: before, engine.stats() and engine.memory() raised its
    RuntimeError, and engine.close() stopped there (the model and the KV cache not freed)."""
    path = tiny_checkpoints["llama"]
    with registered(broken=_BrokenOptionals(tokens=[5, 6])):
        engine = make_engine(path, speculation={"method": "broken", "k": 2})
    history = random_tokens(random.Random(23), 20)
    engine.open_state("a").generate(greedy(6, speculation={"method": "ngram", "k": 2}), prompt=history)
    assert_greedy_matches(path, history, engine.open_state("b").generate(greedy(6), prompt=history).token_ids)
    with pytest.warns(PluginWarning, match=r"drafter 'broken' raised in summary: .*its summary\(\) is skipped"):
        figures = engine.stats().speculation
    assert set(figures["drafters"]) == {"ngram"} and figures["drafter_errors"] == {"broken": 1}, figures
    assert "draft_model" not in engine.memory()["device"]
    errors = engine.scheduler.speculation.drafter_errors
    engine.close()
    assert errors["broken"] == 3 and engine.model is None and engine.kv_cache is None


def test_a_drafter_object_with_only_propose_is_used_as_it_is(tiny_checkpoints, make_engine):
    """A plugin may register its drafter itself rather than a factory, and `propose` is all it
    must have: no call to a missing `finished` (before, a PluginWarning at each request's end)."""
    path = tiny_checkpoints["llama"]
    history = random_tokens(random.Random(5), 30)
    want = hf_greedy(path, history, GEN)
    oracle = OracleDrafter(VOCAB_SIZE)
    oracle.add(history, want)
    with registered_as_is(bare=ProposeOnly(oracle)):
        engine = make_engine(path, speculation={"method": "bare", "k": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        assert list(engine.open_state("a").generate(greedy(), prompt=history).token_ids) == want
    stats = engine.stats()
    assert stats.draft_tokens_accepted == oracle.proposed > 0
    assert not stats.speculation["drafter_errors"]


class NoEngineDrafter:
    """A drafter class whose constructor takes no engine: a plugin's mistake."""

    def __init__(self) -> None:
        pass

    def propose(self, state, k: int) -> list[int]:
        return []


class ProposeOfStateOnly:
    """A drafter whose propose forgets k."""

    def propose(self, state) -> list[int]:
        return []


@pytest.mark.parametrize("registered_obj, says", [
    (NoEngineDrafter, r"'wrong' is registered as the class test_speculation\.NoEngineDrafter, which cannot be "
                      r"called as factory\(engine\)"),
    (42, r"'wrong' is registered as an instance of builtins\.int, which cannot be called as factory\(engine\)"),
    (lambda engine: None, r"'wrong': its factory, the function test_speculation\.<lambda>, returned an instance of "
                          r"builtins\.NoneType, which has no propose\(state, k\)"),
    (ProposeOfStateOnly(), r"'wrong' is registered as an instance of test_speculation\.ProposeOfStateOnly, whose "
                           r"propose cannot be called as propose\(state, k\)"),
    (lambda engine: ProposeOfStateOnly(), r"'wrong' \(from its factory, the function test_speculation\.<lambda>\) "
                                          r"is an instance of test_speculation\.ProposeOfStateOnly, whose propose"),
], ids=["class-without-engine", "not-callable", "factory-returns-none", "propose-of-state-only",
        "factory-returns-propose-of-state-only"])
def test_a_wrongly_registered_drafter_is_a_config_error_at_engine_build(tiny_checkpoints, make_engine,
                                                                         registered_obj, says):
    """What a plugin registers that is neither a drafter nor a `factory(engine) -> drafter` is a
    ConfigError naming the expected signature and what was registered (its module: whose plugin),
    at engine build when the engine's default names it; before, a raw TypeError."""
    with registered_as_is(wrong=registered_obj), pytest.raises(ConfigError, match=says) as raised:
        make_engine(tiny_checkpoints["llama"], speculation={"method": "wrong", "k": 3})
    assert "register('wrong', factory) with factory(engine) -> drafter" in str(raised.value)


def test_a_drafter_factory_that_raises_is_a_config_error_naming_it(tiny_checkpoints, make_engine):
    """A plugin's factory that raised passed its bare exception out of Engine.from_pretrained and
    generate, naming neither the drafter nor its plugin; and a propose_many returning the wrong
    shape was warned of as "raised in propose" with a zip() error of Hibana's own."""
    def exploding(engine):
        raise RuntimeError("factory exploded")

    with registered_as_is(boom=exploding), pytest.raises(
            ConfigError, match=r"drafter 'boom': its factory, the function .*exploding, failed: RuntimeError: factory"):
        make_engine(tiny_checkpoints["llama"], speculation={"method": "boom", "k": 3})

    class Garbage(FixedDrafter):
        def propose_many(self, inputs, ks):
            return "nope"

    path = tiny_checkpoints["llama"]
    with registered(garbage=Garbage(tokens=[5, 6])):
        engine = make_engine(path, speculation="off")
    history = random_tokens(random.Random(31), 20)
    with pytest.warns(PluginWarning, match=r"drafter 'garbage' propose_many returned what Hibana cannot read: an instance of builtins\.str"):
        out = engine.open_state("g").generate(greedy(6, speculation={"method": "garbage", "k": 2}), prompt=history)
    assert_greedy_matches(path, history, out.token_ids)


def test_a_drafter_name_clash_fails_only_where_drafters_are_used(tiny_checkpoints, make_engine):
    """A plugin registering the built-in name "suffix" made every engine fail to load, with
    speculation="off" too; the clash is a PluginError where a drafter is named."""
    from hibana_plugins.manager import PluginError

    path = tiny_checkpoints["llama"]
    with registered_as_is(suffix=FixedDrafter(tokens=[5])):
        engine = make_engine(path, speculation="off")
        history = random_tokens(random.Random(33), 12)
        assert_greedy_matches(path, history, engine.open_state("off").generate(greedy(4), prompt=history).token_ids)
        with pytest.raises(PluginError, match="'suffix'"):
            engine.open_state("on").generate(greedy(4, speculation={"method": "ngram", "k": 2}), prompt=history)
        with pytest.raises(PluginError, match="'suffix'"):
            make_engine(path, speculation="adaptive")


# --- 5. endings, seeds and forced outputs inside drafts --------------------------------------------


def test_a_model_of_few_positions_profiles_its_steps_within_them(make_engine, tmp_path):
    """The step-cost profile of adaptive speculation runs eager steps of up to 256 tokens at
    positions 0..n-1; a model of 64 positions profiles up to 64, not past its rotary table."""
    path = make_tiny_checkpoint("qwen3", tmp_path / "short", max_position_embeddings=64)
    engine = make_engine(path)  # speculation="adaptive", the default
    assert engine.stats().speculation["step_cost_ms"]["tokens"][-1] == 64
    history = random_tokens(random.Random(4), 40)
    done = engine.open_state("a").generate(greedy(40), prompt=history)
    assert done.finish_reason == "length" and len(done.token_ids) == 24
    assert_greedy_matches(path, history, done.token_ids)


def test_max_tokens_and_stops_inside_an_accepted_draft(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["mistral"]
    history = random_tokens(random.Random(11), 25)
    oracle = OracleDrafter(VOCAB_SIZE)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 4}, async_scheduling=True)
    full = list(engine.open_state("ref").generate(greedy(speculation="off"), prompt=history).token_ids)
    assert_greedy_matches(path, history, full)
    oracle.add(history, full)
    # a stop token first seen at position >= 2: it sits inside the first draft of 4
    at = next(i for i in range(2, GEN) if full[i] not in full[:i])
    cases = {
        "max_tokens": dict(params=greedy(at + 1), want=full[:at + 1], reason="length"),
        "stop_token": dict(params=greedy(stop_token_ids=[full[at]]), want=full[:at + 1], reason="stop"),
    }
    for name, case in cases.items():
        for spec in ("off", None):
            h = engine.open_state(f"{name}-{spec}")
            params = dataclasses.replace(case["params"], speculation=spec)
            before = engine.stats()
            c = h.generate(params, prompt=history)
            assert (list(c.token_ids), c.finish_reason) == (case["want"], case["reason"]), (name, spec)
            # the figures count what the request kept: drafts past its end were verified, not emitted
            after = engine.stats()
            assert after.verified_tokens - before.verified_tokens <= len(c.token_ids), (name, spec)
            assert after.draft_tokens_accepted - before.draft_tokens_accepted <= len(c.token_ids), (name, spec)
            assert h.tokens == history + case["want"]
            seq = state_of(engine, h)
            assert seq.num_computed <= len(seq.tokens), "KV of drafts past the stop was kept"
            # the state goes on exactly: the KV past the stop was dropped
            c2 = h.generate(greedy(6))
            assert_greedy_matches(path, history + case["want"], c2.token_ids)
    assert engine.stats().draft_tokens_accepted >= 2 * len(cases)

    # the context limit inside a draft: the same end as one token at a time
    with registered(oracle=oracle):
        short = make_engine(path, speculation={"method": "oracle", "k": 4}, async_scheduling=True,
                            max_model_len=len(history) + at + 1)
    calls = len(oracle.calls)
    for spec in ("off", None):
        h = short.open_state(f"context-{spec}")
        c = h.generate(greedy(speculation=spec), prompt=history)
        assert (list(c.token_ids), c.finish_reason) == (full[:at + 1], "length"), spec
        assert h.tokens == history + full[:at + 1]
    assert short.stats().draft_tokens_accepted > 0
    assert all(length + k < len(history) + at + 1 for length, k, _ in oracle.calls[calls:]), \
        "drafts past the context limit were asked for"


def test_stop_string_inside_an_accepted_draft(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    history = random_tokens(random.Random(12), 25)
    oracle = OracleDrafter(VOCAB_SIZE)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 4})
    ref = engine.open_state("ref").generate(greedy(speculation="off"), prompt=history)
    oracle.add(history, ref.token_ids)
    stop = ref.text[len(ref.text) // 3:len(ref.text) // 3 + 3]
    off = engine.open_state("off").generate(greedy(stop=[stop], speculation="off"), prompt=history)
    on = engine.open_state("on").generate(greedy(stop=[stop]), prompt=history)
    assert off.finish_reason == "stop" and len(off.token_ids) < GEN
    assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, off.finish_reason)
    assert engine.stats().draft_tokens_accepted > 0


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(13)
    histories = [random_tokens(rng, 30) for _ in range(3)]
    settings = [dict(temperature=0.9, seed=5), dict(temperature=1.0, top_p=0.9, seed=6),
                dict(temperature=0.7, top_k=8, repetition_penalty=1.3, seed=7)]
    oracle = OracleDrafter(VOCAB_SIZE, wrong_every_fifth)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 3}, async_scheduling=True)

    def run(i: int, spec) -> list[int]:
        params = SamplingParams(max_tokens=GEN, ignore_eos=True, speculation=spec, **settings[i])
        return list(engine.open_state(f"{i}-{spec}").generate(params, prompt=histories[i]).token_ids)

    want = concurrently(run, [(i, "off") for i in range(3)])
    for history, out in zip(histories, want):
        oracle.add(history, out)
    assert concurrently(run, [(i, None) for i in range(3)]) == want
    stats = engine.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed, stats


def test_forced_outputs_with_and_without_speculation(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    # async scheduling: the first steps find nothing to draft and overlap; drafting starts once
    # the pattern repeats, which needs the step in flight read back before the next is scheduled
    engine = make_engine(path, speculation={"method": "suffix", "k": 4}, async_scheduling=True)
    history = random_tokens(random.Random(14), 20)
    forced = [7, 8, 9, 10, 11] * 5  # periodic: the suffix drafter learns it from the state itself
    for spec in (None, "off"):  # speculating first: the shared corpus holds no earlier run's text
        h = engine.open_state(f"forced-{spec}")
        h.sync(history)
        force_outputs(h, forced)
        c = h.generate(greedy(len(forced), speculation=spec))
        assert list(c.token_ids) == forced and h.tokens == history + forced
        # the next generation is the model's own again
        assert_greedy_matches(path, history + forced, h.generate(greedy(4)).token_ids)
    stats = engine.stats()
    assert stats.draft_tokens_accepted > len(forced) // 2, stats


def test_stats_give_each_states_acceptance_by_drafter_and_position(tiny_checkpoints, make_engine):
    """engine.stats().speculation["acceptance_by_state"]: the per-agent figures the controller
    picks draft lengths from, by state id and drafter; {} for an open state that never drafted (the
    README's `["agent-1"]` was a KeyError for it), and for every state with speculation off."""
    engine = make_engine(tiny_checkpoints["llama"], speculation={"method": "ngram", "k": 3})
    loop = random_tokens(random.Random(9), 6) * 6  # repeats: n-gram drafts every step
    engine.open_state("drafting").generate(greedy(12), prompt=loop)
    engine.open_state("plain").generate(greedy(4, speculation="off"), prompt=loop)
    by_state = engine.stats().speculation["acceptance_by_state"]
    assert set(by_state) == {"drafting", "plain"} and set(by_state["drafting"]) == {"ngram"}
    assert by_state["plain"] == {}
    rates = by_state["drafting"]["ngram"]
    assert rates and all(0.0 <= r <= 1.0 for r in rates)
    off = make_engine(tiny_checkpoints["llama"], speculation="off")
    off.open_state("agent-1").generate(greedy(3), prompt=loop)
    assert off.stats().speculation["acceptance_by_state"] == {"agent-1": {}}


def test_stats_report_the_drafters_host_memory(tiny_checkpoints, make_engine):
    """The suffix drafter's per-state indexes are bounded host memory, and engine.stats() says how
    much: states indexed, tokens, estimated bytes, the window and the budget."""
    engine = make_engine(tiny_checkpoints["llama"], speculation={"method": "suffix", "k": 3})
    loop = random_tokens(random.Random(4), 6) * 6
    for name in ("a", "b"):
        engine.open_state(name).generate(greedy(8), prompt=loop)
    figures = engine.stats().speculation["drafters"]["suffix"]
    assert figures["states"] == 2 and len(loop) * 2 <= figures["indexed_tokens"] <= (len(loop) + 8) * 2
    assert figures["host_bytes"] > figures["indexed_tokens"] * 100
    assert figures["state_window"] == 1 << 14 and figures["max_tokens"] == 1 << 19 and figures["evictions"] == 0


def test_drawn_drafts_are_verified_as_chosen_ones_under_a_grammar_and_trace_replay(tiny_checkpoints, make_engine,
                                                                                    monkeypatch):
    """A grammar cuts drafts by their values, and a drawn draft it forbids is a rejection whose
    position needs the residual max(0, p - q), not p: kept at min(1, p/q), a regex's first token
    came out biased (0.124 against 0.073 for a token q favoured). Under a grammar, and under trace
    replay (forced outputs), a drafter's drawn proposal is verified as a chosen one: kept where the
    target's own draw equals it. The sampler's p/q verification never runs for them."""
    from hibana_core.sampler import Sampler
    from spec_drafters import DrawnDrafter

    path = tiny_checkpoints["llama"]
    verified = []
    original = Sampler._drawn_drafts
    monkeypatch.setattr(Sampler, "_drawn_drafts",
                        lambda self, *args: verified.append(1) or original(self, *args))
    drafter = DrawnDrafter(torch.full((VOCAB_SIZE,), 1.0 / VOCAB_SIZE), seed=1)
    with registered(drawn=drafter):
        engine = make_engine(path, speculation={"method": "drawn", "k": 2})
    prompt = random_tokens(random.Random(3), 12)
    for i in range(4):
        out = engine.open_state(f"g{i}").generate(
            SamplingParams(max_tokens=8, temperature=1.0, regex="[ab]{8}"), prompt=prompt)
        assert len(out.text) == 8 and set(out.text) <= {"a", "b"}, out.text
    h = engine.open_state("forced")
    force_outputs(h, [7, 8, 9, 10, 11, 12])
    h.generate(SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True), prompt=prompt)
    assert drafter.calls and engine.stats().draft_tokens_proposed > 0
    assert not verified
    engine.open_state("free").generate(SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), prompt=prompt)
    assert verified  # the same drafter's proposals for a free request are verified at p/q
