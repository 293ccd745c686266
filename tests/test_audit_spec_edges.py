"""Outside audit of speculation (issue 13) where several tokens are accepted in one step and the
turn ends among them: a stop string, a stop token or max_tokens inside an accepted draft, under a
grammar that completes inside one, with logprobs asked, with penalties and a logit bias, and with a
draft model whose every draft is kept. Each turn ends as it does without speculation (tokens,
text, finish reason, usage, logprobs), and the state it leaves goes on as transformers goes on
from the same history: nothing of the drafts past the end stays in its KV.

Drafts come from the oracle (tests/spec_drafters.py), which proposes the continuation a run
without speculation produced, so that drafts are accepted on a random tiny model.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from hibana_core import SamplingParams
from spec_drafters import OracleDrafter, registered
from tiny_models import VOCAB_SIZE, assert_greedy_matches, random_tokens

pytestmark = pytest.mark.timeout(120)

GEN = 20


def greedy(n: int = GEN, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def state_of(engine, handle):
    return engine.registry._entry(handle).seq


@pytest.fixture
def oracle_engine(tiny_checkpoints, make_engine):
    """(path, engine drafting with the oracle at k=4 under async scheduling, the oracle)."""
    path = tiny_checkpoints["qwen3"]
    oracle = OracleDrafter(VOCAB_SIZE)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 4}, async_scheduling=True)
    return path, engine, oracle


def test_a_stop_string_inside_an_accepted_draft_leaves_a_state_that_goes_on_exactly(oracle_engine):
    """The stop string completes at each position of the reply in turn (inside a draft, at its
    bonus token): text, tokens and finish reason as without speculation, the state holds the
    history and those tokens with no KV past them, and the next turn (drafted too) is
    transformers' continuation of that history."""
    path, engine, oracle = oracle_engine
    history = random_tokens(random.Random(21), 24)
    ref = engine.open_state("ref").generate(greedy(speculation="off"), prompt=history)
    oracle.add(history, ref.token_ids)
    text, seen = ref.text, set()
    checked = 0
    for i in range(1, len(text) - 2, 3):
        stop = text[i:i + 2]
        if stop in seen or not stop.strip():
            continue
        seen.add(stop)
        off = engine.open_state(f"off-{i}").generate(greedy(stop=[stop], speculation="off"), prompt=history)
        before = engine.stats().draft_tokens_accepted
        h = engine.open_state(f"on-{i}")
        on = h.generate(greedy(stop=[stop]), prompt=history)
        assert (list(on.token_ids), on.text, on.finish_reason, on.stats.generated) == \
            (list(off.token_ids), off.text, off.finish_reason, off.stats.generated), stop
        assert h.tokens == history + list(off.token_ids)
        seq = state_of(engine, h)
        assert seq.num_computed <= len(seq.tokens), "KV of drafts past the stop string was kept"
        if off.finish_reason == "stop" and len(off.token_ids) > 2:
            assert engine.stats().draft_tokens_accepted > before, "no draft was accepted on the way to the stop"
            checked += 1
        if checked <= 2:  # the next turn, drafted from the oracle, equals transformers on the whole history
            held = list(h.tokens)
            nxt = engine.open_state("next-ref").generate(greedy(6, speculation="off"), prompt=held)
            oracle.add(held, nxt.token_ids)
            assert list(h.generate(greedy(6)).token_ids) == list(nxt.token_ids)
            assert_greedy_matches(path, held, nxt.token_ids)
    assert checked >= 2


def test_logprobs_with_drafts_are_those_of_the_tokens_kept(oracle_engine):
    """logprobs and top_logprobs with drafts accepted: one per token kept (a stop token inside a
    draft ends them there), for the same tokens and alternatives as without speculation, with
    the values a one-token step gives (to float rounding: a verify step's matmuls are shaped
    otherwise)."""
    _, engine, oracle = oracle_engine
    history = random_tokens(random.Random(22), 24)
    full = engine.open_state("ref").generate(greedy(speculation="off"), prompt=history).token_ids
    oracle.add(history, full)
    at = next(i for i in range(2, GEN) if full[i] not in full[:i])
    for extra in ({}, {"stop_token_ids": [full[at]]}, {"max_tokens": at + 1}):
        params = dataclasses.replace(greedy(logprobs=True, top_logprobs=3), **extra)
        off = engine.open_state("off").generate(dataclasses.replace(params, speculation="off"), prompt=history)
        on = engine.open_state("on").generate(params, prompt=history)
        assert list(on.token_ids) == list(off.token_ids) and len(on.logprobs) == len(on.token_ids), extra
        for a, b in zip(on.logprobs, off.logprobs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
    assert engine.stats().draft_tokens_accepted > 0


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.4),
    dict(presence_penalty=1.2, frequency_penalty=0.6),
    dict(logit_bias={7: 4.0, 11: -100.0}),
])
def test_penalties_and_logit_bias_with_accepted_drafts_are_greedy_exact(oracle_engine, options):
    """The penalised (biased) continuation drafted whole: each drafted position's penalties count
    the drafts before it, so every draft is kept and the output is the one without speculation,
    ending inside a draft at max_tokens."""
    _, engine, oracle = oracle_engine
    history = random_tokens(random.Random(23), 24)
    off = engine.open_state("off").generate(greedy(speculation="off", **options), prompt=history)
    oracle.add(history, off.token_ids)
    before = engine.stats()
    for n in (GEN, 7):
        on = engine.open_state(f"on-{n}").generate(greedy(n, **options), prompt=history)
        assert list(on.token_ids) == list(off.token_ids)[:n] and on.finish_reason == "length"
    after = engine.stats()
    assert after.draft_tokens_accepted - before.draft_tokens_accepted >= GEN // 2
    assert after.draft_tokens_accepted - before.draft_tokens_accepted == \
        after.draft_tokens_proposed - before.draft_tokens_proposed  # the oracle drafted the penalised output


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_completed_inside_an_accepted_draft(oracle_engine, ignore_eos):
    """A regex completed inside an accepted draft ends the output there, as without speculation
    (its end token kept or, with ignore_eos, the end of sequence as its last resort), and the
    state goes on exactly."""
    path, engine, oracle = oracle_engine
    history = random_tokens(random.Random(24), 24)
    params = SamplingParams(max_tokens=GEN, regex="[a-z]{2,6}", ignore_eos=ignore_eos)
    off = engine.open_state("off").generate(dataclasses.replace(params, speculation="off"), prompt=history)
    assert off.finish_reason == "stop" and 2 <= len(off.text) <= 6
    oracle.add(history, off.token_ids)
    before = engine.stats().draft_tokens_accepted
    h = engine.open_state("on")
    on = h.generate(params, prompt=history)
    assert (list(on.token_ids), on.text, on.finish_reason) == (list(off.token_ids), off.text, off.finish_reason)
    assert engine.stats().draft_tokens_accepted > before
    assert h.tokens == history + list(off.token_ids)
    assert_greedy_matches(path, h.tokens, h.generate(greedy(5, speculation="off")).token_ids)


def test_a_draft_model_whose_drafts_are_all_kept_ends_turns_exactly(tiny_checkpoints, make_engine):
    """The target as its own draft model (every greedy draft kept, k=8): max_tokens, a stop token
    and a stop string inside a draft end the turn as without speculation, and the draft model's
    KV follows the state into its next turn (drafts still all kept, output transformers')."""
    path = tiny_checkpoints["qwen3"]
    off = make_engine(path, speculation="off")
    engine = make_engine(path, speculation={"method": "draft_model", "draft_model": str(path), "k": 8},
                         async_scheduling=True)
    history = random_tokens(random.Random(25), 30)
    ref = off.open_state("ref").generate(greedy(), prompt=history)
    full = list(ref.token_ids)
    at = next(i for i in range(3, GEN) if full[i] not in full[:i])
    cut = next(i for i in range(len(ref.text) // 2, len(ref.text) - 2) if ref.text[i:i + 2].strip())
    for name, params in {"max_tokens": greedy(at + 1), "stop_token": greedy(stop_token_ids=[full[at]]),
                         "stop": greedy(stop=[ref.text[cut:cut + 2]])}.items():
        want = off.open_state(name).generate(params, prompt=history)
        h = engine.open_state(name)
        got = h.generate(params, prompt=history)
        assert (list(got.token_ids), got.text, got.finish_reason) == \
            (list(want.token_ids), want.text, want.finish_reason), name
        assert h.tokens == history + list(want.token_ids)
        assert state_of(engine, h).num_computed <= len(h.tokens)
        nxt = h.generate(greedy(6))
        assert list(nxt.token_ids) == list(off.open_state(name).generate(greedy(6)).token_ids), name
    assert engine.stats().draft_tokens_accepted > 0
    agreed = engine.scheduler.speculation.global_stats["draft_model"]  # every draft, past a turn's end too
    assert agreed.tries[0] > 0 and agreed.accepted == agreed.tries


def test_a_prompt_longer_than_the_drafters_windows(tiny_checkpoints, make_engine):
    """Suffix and n-gram drafters whose per-state windows (64 tokens) and budgets are shorter than
    the turn's prompt (a loop of 7 tokens, 300 tokens long): their indexes take the prompt's last
    window, drafts are accepted, nothing of them fails, and the output and the next turn are the
    ones without speculation."""
    from hibana_core.speculation.drafters import NgramDrafter, SuffixDrafter
    from spec_drafters import registered_as_is

    path = tiny_checkpoints["qwen3"]
    rng = random.Random(26)
    loop = random_tokens(rng, 7)
    prompt = random_tokens(rng, 20) + loop * 40 + random_tokens(rng, 5) + loop[:3]
    with registered_as_is(small_suffix=lambda engine: SuffixDrafter(engine, corpus_tokens=64, state_window=64,
                                                                    max_tokens=128),
                          small_ngram=lambda engine: NgramDrafter(engine, state_window=64, max_tokens=128)):
        engine = make_engine(path, speculation="off", async_scheduling=True)
        want = engine.open_state("ref").generate(greedy(40), prompt=prompt)
        then = engine.open_state("ref").generate(greedy(10))
        for method in ("small_suffix", "small_ngram"):
            h = engine.open_state(method)
            params = greedy(40, speculation={"method": method, "k": 8})
            assert list(h.generate(params, prompt=prompt).token_ids) == list(want.token_ids), method
            assert list(h.generate(dataclasses.replace(params, max_tokens=10)).token_ids) == list(then.token_ids)
    speculation = engine.stats().speculation
    assert engine.stats().draft_tokens_accepted > 0 and speculation["drafter_errors"] == {}
    for method in ("small_suffix", "small_ngram"):
        assert speculation["drafters"][method]["indexed_tokens"] <= 128, speculation["drafters"]


def test_the_shared_corpus_stays_within_its_bound_whatever_the_outputs_length():
    """The suffix drafter's engine-wide corpus of recent outputs holds at most `corpus_tokens`
    tokens: a turn's output was added whole, so turns of long outputs (a file rewritten) held
    twice the bound and more (one of 500 tokens in a corpus of 64: 532), in host memory and in
    engine.stats(). Each generation now holds half of it at most; the newest output's continuation
    is still drafted."""
    from hibana_core.speculation.drafters import DraftInput, SuffixDrafter

    rng = random.Random(27)
    drafter = SuffixDrafter(corpus_tokens=64)
    for n in (500, 20, 30, 31, 40, 5, 200):
        context, output = random_tokens(rng, 40), list(range(n, 0, -1))
        drafter.finished(context, output)
        assert drafter.summary()["corpus_tokens"] <= 64, n
    key = type("Key", (), {})()  # a state stand-in (drafters key their indexes on it weakly)
    assert drafter.propose(DraftInput(random_tokens(rng, 9) + [9, 8, 7], key, 0), 3) == [6, 5, 4]
