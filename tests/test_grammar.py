"""Grammar-constrained decoding (`hibana_core.grammar`): property tests on random-weight tiny
models, the batch and speculation contracts, and failures that stay with their request.

Random schemas are bounded (strings by maxLength, arrays by maxItems, integers by a range) so that
even a random model finishes them within max_tokens: every output must then parse and validate.
"""

from __future__ import annotations

import dataclasses
import json
import typing
import math
import random
import re
import statistics
import string
import threading
import time
from typing import Annotated, List, Literal, Optional, Union

import jsonschema
import pydantic
import pytest
import torch
from typing_extensions import NotRequired, TypedDict

from hibana_core import ConfigError, GrammarError, HibanaError, SamplingParams
from hibana_core.grammar import MAX_NUMBER_DIGITS, allowed_tokens, unenforced_keywords
from hibana_core.sampler import Sampler, SamplingRow, TokenMasks
from hibana_core.turn import SYNTAX, no_call_grammar, tool_call_grammar
from hibana_plugins.tool_parsers import HermesToolParser, Llama3JsonToolParser
from spec_drafters import OracleDrafter, registered
from tiny_models import EOS_ID, VOCAB_SIZE, assert_greedy_matches, random_tokens

ARCH = "qwen3"
pytestmark = pytest.mark.timeout(600)


# --- random schemas -------------------------------------------------------------------------------

def _name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6))) + rng.choice("_xyz")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded JSON schema: nested objects (optional keys), arrays, enums, strings, integers,
    booleans, nullable values."""
    kinds = ["string", "integer", "boolean", "enum", "nullable"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 3, None, "a b", "é"], rng.randint(1, 4))}
    if kind == "nullable":
        return {"anyOf": [random_schema(rng, depth + 1), {"type": "null"}]}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    names = list(dict.fromkeys(_name(rng) for _ in range(rng.randint(1, 4))))
    properties = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": properties,
            "required": [n for n in names if rng.random() < 0.6]}


def random_tools(rng: random.Random) -> list[dict]:
    names = list(dict.fromkeys("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
                               for _ in range(rng.randint(1, 4))))
    tools = []
    for name in names:
        schema = random_schema(rng, depth=1) if rng.random() < 0.3 else None
        parameters = {"type": "object", "properties": {_name(rng): random_schema(rng, 1) for _ in range(rng.randint(0, 3))}}
        parameters["required"] = [k for k in parameters["properties"] if rng.random() < 0.5]
        if schema is not None and schema.get("type") == "object":
            parameters = schema
        tools.append({"type": "function", "function": {"name": name, "parameters": parameters}})
    return tools


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    from tiny_models import open_engine

    engine = open_engine(tiny_checkpoints[ARCH], speculation="off")
    yield engine
    engine.close()


def _generate(engine, state: str, prompt: list[int], **params):
    h = engine.open_state(state)
    try:
        return h.generate(SamplingParams(**params), prompt=prompt)
    finally:
        h.close()


# --- properties -----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_random_schemas_give_json_that_validates(engine, seed):
    """Greedy and sampled, every output of a random schema on a random model parses and validates."""
    rng = random.Random(seed)
    schema = random_schema(rng)
    if rng.random() < 0.5:
        schema = {"type": "object", "properties": {"value": schema, "note": {"type": "string", "maxLength": 4}},
                  "required": ["value"]}
    prompt = random_tokens(rng, 12)
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": seed}, {"temperature": 0.7, "top_p": 0.9}):
        out = _generate(engine, f"schema-{seed}", prompt, max_tokens=600, json_schema=schema, **params)
        assert out.finish_reason == "stop", (schema, out.text)
        assert out.token_ids[-1] == EOS_ID  # the end is allowed once the grammar is complete, and taken
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert out.text == json.dumps(value, ensure_ascii=False)  # compact, json.dumps' spacing


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_random_tool_lists_give_calls_of_offered_tools_with_valid_arguments(engine, seed, parser_name):
    rng = random.Random(100 + seed)
    tools = random_tools(rng)
    names = [t["function"]["name"] for t in tools]
    parser = {"hermes": HermesToolParser(), "llama3_json": Llama3JsonToolParser()}[parser_name]
    prompt = random_tokens(rng, 10)
    for choice in ("required", rng.choice(names)):
        grammar = tool_call_grammar(tools, choice, SYNTAX[parser_name], parallel=rng.random() < 0.5)
        out = _generate(engine, f"tools-{seed}", prompt, max_tokens=700, grammar=grammar,
                        temperature=1.0, seed=seed)
        assert out.finish_reason == "stop", out.text
        parsed = parser.parse(out.text)
        assert parsed.error is None and parsed.tool_calls and parsed.content == "", out.text
        for call in parsed.tool_calls:
            assert call.name in names and (choice == "required" or call.name == choice)
            jsonschema.validate(call.arguments, tools[names.index(call.name)]["function"]["parameters"])


def test_auto_tool_grammar_leaves_text_free_and_holds_calls(engine):
    """"auto": text is free (its tokens are the model's own greedy choice while no call is open,
    control tokens aside); a call the model opens is held to an offered tool."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"]}}}]
    grammar = tool_call_grammar(tools, "auto", SYNTAX["hermes"])
    for seed in range(6):
        prompt = random_tokens(random.Random(seed), 10)
        out = _generate(engine, "auto", prompt, max_tokens=80, grammar=grammar, temperature=1.0, seed=seed)
        parsed = HermesToolParser().parse(out.text)
        assert parsed.error is None, out.text
        for call in parsed.tool_calls:
            assert call.name == "lookup" and set(call.arguments) == {"q"}


def test_regex_and_ebnf_and_the_end_only_where_complete(engine):
    prompt = random_tokens(random.Random(3), 8)
    out = _generate(engine, "re", prompt, max_tokens=40, regex=r"[0-9]{3}-[a-c]{2}")
    assert out.finish_reason == "stop" and len(out.text) == 6 and out.text[3] == "-"
    out = _generate(engine, "ebnf", prompt, max_tokens=40, grammar='root ::= "yes" | "no" | "maybe " [a-z]')
    assert out.text in ("yes", "no") or (out.text.startswith("maybe ") and len(out.text) == 7)
    # without a stop token the request ends where the grammar is complete
    out = _generate(engine, "noeos", prompt, max_tokens=40, regex=r"ab", ignore_eos=True)
    assert out.text == "ab" and out.finish_reason == "stop"


# --- the batch and speculation contracts ------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-step", "async"])
def test_unconstrained_rows_are_unchanged_beside_constrained_ones(tiny_checkpoints, make_engine, async_scheduling):
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, async_scheduling=async_scheduling, speculation="off")
    rng = random.Random(11)
    prompts = [random_tokens(rng, 15 + 3 * i) for i in range(6)]
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}, "maxItems": 4}}}
    handles = [engine.open_state(f"b{i}") for i in range(6)]
    constrained = {1, 3, 4}
    with engine.core.lock:  # all six join the same steps
        streams = [h.stream(SamplingParams(max_tokens=24, ignore_eos=True, json_schema=schema) if i in constrained
                            else SamplingParams(max_tokens=24, ignore_eos=True), prompt=p)
                   for i, (h, p) in enumerate(zip(handles, prompts))]
    outputs = [[ev.token_id for ev in s if ev.token_id is not None] for s in streams]
    assert engine.stats().max_batch_sequences == 6
    for i in range(6):
        if i in constrained:
            jsonschema.validate(json.loads(engine.tokenizer.decode(outputs[i], skip_special_tokens=True)), schema)
        else:
            assert len(outputs[i]) == 24
            assert_greedy_matches(path, prompts[i], outputs[i])


def test_async_scheduling_samples_constrained_rows_as_one_step_scheduling_does(tiny_checkpoints, make_engine,
                                                                              monkeypatch):
    """With async scheduling a constrained step's masks are filled after the previous step's
    tokens are read back, while its forward runs (on the grammar's worker thread, while the engine
    processes the previous step's outputs): greedy output is the same as stepping one at a time,
    for a batch of agents under different grammars."""
    path = tiny_checkpoints[ARCH]
    rng = random.Random(21)
    schemas = [random_schema(random.Random(s)) for s in (6, 7, 8, 9)]
    prompts = [random_tokens(rng, 10 + i) for i in range(len(schemas))]
    outputs = []
    for async_scheduling in (False, True):
        engine = make_engine(path, async_scheduling=async_scheduling, speculation="off")
        fills = []  # the threads that filled masks: with async scheduling, the grammar's worker
        fill = engine.grammars._fill
        monkeypatch.setattr(engine.grammars, "_fill",
                            lambda *a: (fills.append(threading.current_thread().name), fill(*a))[1])
        handles = [engine.open_state(f"a{i}") for i in range(len(schemas))]
        with engine.core.lock:
            streams = [h.stream(SamplingParams(max_tokens=300, json_schema=s), prompt=p)
                       for h, s, p in zip(handles, schemas, prompts)]
        outputs.append([[ev.token_id for ev in st if ev.token_id is not None] for st in streams])
        for out, schema in zip(outputs[-1], schemas):
            jsonschema.validate(json.loads(engine.tokenizer.decode(out[:-1])), schema)
        on_worker = sum(name.startswith("hibana-grammar") for name in fills)
        assert on_worker > len(fills) // 2 if async_scheduling else on_worker == 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("fail_at", [3, 6])
def test_a_constrained_sampling_that_fails_after_the_next_step_was_scheduled_loses_nothing(
        tiny_checkpoints, make_engine, monkeypatch, fail_at):
    """With async scheduling a constrained step is sampled just before the next step's forward,
    after that step was scheduled. A fill that fails there (once) fails its step: the step
    scheduled after it is reverted (nothing of it ran), the agents run again one at a time, and
    every agent ends with the tokens and KV it has without the failure."""
    path = tiny_checkpoints[ARCH]
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}, "maxItems": 6}}}
    rng = random.Random(5)
    prompts = [random_tokens(rng, 12), random_tokens(rng, 17), random_tokens(rng, 9)]

    def run(fail: bool):
        engine = make_engine(path, async_scheduling=True, speculation="off")
        fills, reverts = [], []
        fill, revert = engine.grammars._fill, engine.core.scheduler.revert

        def flaky(*args):
            fills.append(threading.current_thread().name)
            if fail and len(fills) == fail_at:
                raise RuntimeError("a fill that fails")
            return fill(*args)
        monkeypatch.setattr(engine.grammars, "_fill", flaky)
        monkeypatch.setattr(engine.core.scheduler, "revert", lambda s: (reverts.append(s), revert(s))[1])
        handles = [engine.open_state(f"f{i}") for i in range(3)]
        with engine.core.lock:  # one batch: two constrained agents and one free
            streams = [h.stream(SamplingParams(max_tokens=60, json_schema=schema) if i < 2
                                else SamplingParams(max_tokens=20, ignore_eos=True), prompt=p)
                       for i, (h, p) in enumerate(zip(handles, prompts))]
        outputs = [[ev.token_id for ev in st if ev.token_id is not None] for st in streams]
        assert fills[fail_at - 1].startswith("hibana-grammar")  # filled while the next step was scheduled
        reverted = [r for r in reverts if r.chunks]
        seqs = [engine.registry._entry(h).seq for h in handles]  # white box: the KV behind each state
        data, bs = engine.kv_cache.data, engine.kv_cache.block_size
        kv = [torch.stack([data[:, :, q.block_ids[p // bs], p % bs] for p in range(q.num_computed)]) for q in seqs]
        for out in outputs[:2]:  # the end token last
            jsonschema.validate(json.loads(engine.tokenizer.decode(out[:-1])), schema)
        return outputs, [(list(q.tokens), q.num_computed) for q in seqs], kv, reverted

    clean, clean_states, clean_kv, clean_reverts = run(fail=False)
    failed, failed_states, failed_kv, failed_reverts = run(fail=True)
    assert not clean_reverts and failed_reverts  # the failure met a step scheduled after it
    assert failed == clean and failed_states == clean_states
    for a, b in zip(failed_kv, clean_kv):  # run again alone, a row's sums may round otherwise (~1e-6)
        assert (a - b).abs().max() <= 1e-5


def test_a_constrained_steps_time_holds_its_own_fill_once(tiny_checkpoints, make_engine, monkeypatch):
    """A constrained step sampled inside the next step's launch: the next step's time (what the
    speculation controller learns step costs from) starts after that sampling, so no step's time
    holds two fills (each fill made 0.2 s slow: a step's time ~0.2 s, not 0.4)."""
    engine = make_engine(tiny_checkpoints[ARCH], async_scheduling=True, speculation="off")
    fill = engine.grammars._fill
    fills_ended = []  # perf_counter() once each fill returned (before the step waiting on it goes on)

    def slow_fill(*args):
        time.sleep(0.2)
        out = fill(*args)
        fills_ended.append(time.perf_counter())
        return out
    monkeypatch.setattr(engine.grammars, "_fill", slow_fill)
    windows = []  # each timed step's (start, end) on the same clock (a CPU timer is wall time)
    deliver = engine.core._deliver

    def timed(step, updated, filling=False):
        if step.timer is not None:
            windows.append((step.timer._start, step.timer._start + step.timer.seconds()))
        return deliver(step, updated, filling)
    monkeypatch.setattr(engine.core, "_deliver", timed)
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}}
    engine.open_state("t").generate(SamplingParams(max_tokens=8, json_schema=schema), prompt=[5, 6, 7, 8])
    # each step's time holds its own fill (so it is longer than one fill) and no other fill's end:
    # counted by order, not by an upper bound on wall time that a loaded machine may pass
    held = [sum(start < end_of_fill <= end for end_of_fill in fills_ended) for start, end in windows]
    assert len(windows) >= 4 and held == [1] * len(windows), (held, windows, fills_ended)
    assert statistics.median(end - start for start, end in windows) > 0.19


def test_constrained_speculation_equals_constrained_without(tiny_checkpoints, make_engine):
    """Greedy under a grammar: drafts (from an oracle, some deliberately wrong: the grammar cuts
    some, verification rejects others) change nothing but speed."""
    path = tiny_checkpoints[ARCH]
    rng = random.Random(7)
    long = {"type": "object", "required": ["notes", "kind", "n"], "properties": {
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 3, "maxItems": 6},
        "kind": {"enum": ["alpha", "beta", "gamma delta"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9999}}}
    schemas = [long, random_schema(random.Random(2)), long, random_schema(random.Random(5))]
    prompts = [random_tokens(rng, 14) for _ in schemas]
    plain = make_engine(path, speculation="off")
    expected = [_generate(plain, f"p{i}", p, max_tokens=200, json_schema=s).token_ids
                for i, (p, s) in enumerate(zip(prompts, schemas))]
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 7 == 3)  # 7: not the period of 4 drafts + 1
    for p, e in zip(prompts, expected):
        oracle.add(p, e)
    with registered(oracle=oracle):
        engine = make_engine(path, speculation={"method": "oracle", "k": 4})
        results = [None] * len(prompts)

        def run(i):
            results[i] = _generate(engine, f"s{i}", prompts[i], max_tokens=200, json_schema=schemas[i]).token_ids
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert results == expected
    stats = engine.stats()
    assert oracle.wrong_proposed > 0 and stats.draft_tokens_accepted > 0
    assert stats.draft_tokens_proposed < oracle.proposed  # drafts cut where the grammar rejects them
    assert stats.draft_tokens_accepted < stats.draft_tokens_proposed  # wrong drafts the grammar allows: rejected


def test_matcher_rolls_back_drafts_and_cuts_at_the_first_rejected(engine):
    tok = engine.tokenizer
    matcher = engine.grammars.matcher(SamplingParams(regex=r"ab*c"), [EOS_ID])
    good = tok.encode("abbb", add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)
    assert matcher.valid_prefix(good + bad + good) == len(good)
    assert all(matcher.accept(t) for t in good)  # valid_prefix left the matcher where it was
    bitmask = torch.full((3, engine.grammars.width), -1, dtype=torch.int32)
    c = tok.encode("c", add_special_tokens=False)
    matcher.fill(bitmask, 0, c + [EOS_ID])
    allowed = lambda row: {t for t in range(VOCAB_SIZE) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}  # noqa: E731
    assert c[0] in allowed(0) and EOS_ID not in allowed(0)
    assert allowed(1) == {EOS_ID}  # after "c" only the end
    assert matcher.accept(c[0]) and matcher.accept(EOS_ID) and matcher.done



def test_ignore_eos_runs_a_complete_grammar_on_while_it_allows_more(engine):
    """ignore_eos under a grammar once ended the output where the grammar could first end
    (`[a-z]+`: one token, "stop"; an outside tester): the end-of-sequence tokens are the
    grammar's last resort now, so the output runs on to max_tokens while the grammar allows more,
    and ends where it allows nothing else."""
    free = engine.open_state("free").generate(SamplingParams(max_tokens=12, regex="[a-z]+", ignore_eos=True),
                                              prompt=[5, 6, 7])
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    assert re.fullmatch("[a-z]+", engine.tokenizer.decode(list(free.token_ids)))
    bounded = engine.open_state("bounded").generate(SamplingParams(max_tokens=30, regex="[a-z]{5}", ignore_eos=True),
                                                    prompt=[5, 6, 7])
    text = engine.tokenizer.decode(list(bounded.token_ids), skip_special_tokens=True)
    assert bounded.finish_reason == "stop" and re.fullmatch("[a-z]{5}", text), (bounded.token_ids, text)
    assert bounded.token_ids[-1] == EOS_ID  # the grammar's end, taken only where nothing else was allowed
    assert bounded.text == text  # and, as a stop token, not part of the text


DEMO_SCHEMA = {"type": "object", "required": ["name", "items", "n"], "properties": {
    "name": {"type": "string", "maxLength": 12},
    "items": {"type": "array", "items": {"enum": ["x", "y", "zz"]}, "maxItems": 4}, "n": {"type": "integer"}}}


def test_a_matchers_masks_depend_on_its_state_alone():
    """A forced string ('", "items": [' after a full name) is spelled with the tokenizer's first
    token and followed token by token; where nothing was forced, the next state was once taken to
    force nothing too, so the spelling stopped for good after the first free token in a row that
    fills step by step, but not in one that fills drafts and rolls them back: speculation changed
    greedy output under a grammar (an outside tester). At every position of a text, the mask of a
    matcher that filled at each step equals that of a new one that only accepted the text."""
    from hibana_core import Engine

    with Engine.from_pretrained("demo", progress=False, speculation="off") as demo:
        grammars, params = demo.grammars, SamplingParams(json_schema=DEMO_SCHEMA)
        text = demo.tokenizer.encode('{"name": "kg. The robo", "items": ["y", "zz"], "n": 97}', add_special_tokens=False)
        stepped = grammars.matcher(params, demo.eos_token_ids)
        suspects = grammars.suspects()
        spelled = 0
        for p, token in enumerate(text):
            fresh = grammars.matcher(params, demo.eos_token_ids)
            assert all(fresh.accept(t) for t in text[:p])
            masks = torch.full((2, grammars.width), -1, dtype=torch.int32)
            stepped.fill(masks, 0, suspects=suspects)
            fresh.fill(masks, 1, suspects=suspects)
            assert torch.equal(masks[0], masks[1]), (p, demo.tokenizer.decode(text[:p]))
            spelled += int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in masks[0]) == 1)
            assert stepped.accept(token)
        assert spelled >= 3  # the forced keys were spelled, not just the first


def test_batched_and_single_fills_give_a_state_one_mask():
    """`Grammars._fill` fills 8 rows or more through xgrammar's batched fill, then spells forced
    strings, drops refused tokens and holds an ignore_eos row's end back row by row; a verify
    step's rows go through `Matcher.fill`. The masks of one state must not depend on the path
    (speculation compares the two), forced keys and ignore_eos ends included."""
    from hibana_core import Engine
    from hibana_core.grammar import BATCH_FILL_ROWS

    with Engine.from_pretrained("demo", progress=False, speculation="off") as demo:
        grammars, tok = demo.grammars, demo.tokenizer
        text = tok.encode('{"name": "kg. The robo", "items": ["y", "zz"], "n": 97}', add_special_tokens=False)
        cases = [(SamplingParams(json_schema=DEMO_SCHEMA), text[:p]) for p in range(0, len(text), 3)]
        cases += [(SamplingParams(regex="[a-z]+", ignore_eos=True), tok.encode(w, add_special_tokens=False))
                  for w in ("", "ab", "word")]
        assert len(cases) >= BATCH_FILL_ROWS
        matchers = []
        for params, prefix in cases:
            m = grammars.matcher(params, set() if params.ignore_eos else demo.eos_token_ids)
            assert all(m.accept(t) for t in prefix)
            matchers.append(m)
        batched = torch.empty((len(cases), grammars.width), dtype=torch.int32)
        grammars._fill([(m, ()) for m in matchers], batched)
        for i, m in enumerate(matchers):
            single = torch.full((1, grammars.width), -1, dtype=torch.int32)
            m.fill(single, 0, suspects=grammars.suspects())
            assert torch.equal(batched[i], single[0]), (i, tok.decode(cases[i][1]))


@pytest.mark.parametrize("k, wrong_every", [(16, 0), (8, 5)], ids=["k16-exact", "k8-some-wrong"])
def test_long_drafts_under_a_schema_change_nothing_on_the_demo_model(k, wrong_every):
    """The outside tester's case: the demo tokenizer spells forced JSON keys in several tokens;
    an oracle's drafts, exact or with some wrong, leave greedy output as without speculation."""
    from hibana_core import Engine

    with Engine.from_pretrained("demo", progress=False, speculation="off") as plain:
        prompts = [plain.tokenizer.encode(p) for p in ('Example: {"name": "bob", "items": ["x", "y"], "n": 5} Now:',
                                                        '{"name": "ann", "items": ["zz", "zz"], "n": 1} again:')]
        expected = [_generate(plain, f"p{i}", p, max_tokens=60, json_schema=DEMO_SCHEMA).token_ids
                    for i, p in enumerate(prompts)]
    oracle = OracleDrafter(4096, wrong=lambda p: bool(wrong_every) and p % wrong_every == 2)
    for p, e in zip(prompts, expected):
        oracle.add(p, e)
    with registered(oracle=oracle), Engine.from_pretrained("demo", progress=False,
                                                           speculation={"method": "oracle", "k": k}) as engine:
        got = [_generate(engine, f"s{i}", p, max_tokens=60, json_schema=DEMO_SCHEMA).token_ids
               for i, p in enumerate(prompts)]
        accepted = engine.stats().draft_tokens_accepted
    assert got == expected and accepted > 10


def test_allowed_tokens_a_matcher_refuses_are_dropped_from_the_mask(engine):
    """xgrammar's mask can allow a token that its accept_token refuses (0.2.9, a 151k byte-level
    BPE: '-' + the first byte of a two-byte character where an integer starts; the H200's batch-32
    grammar run failed a request on it). Allowed tokens that are not whole UTF-8 are checked
    against the matcher and the refused ones cleared, in both fill paths; where many are allowed
    (free text) none is checked."""
    from hibana_core.grammar import VERIFY_MAX, allowed_tokens

    grammars = engine.grammars
    suspects = grammars.suspects()
    cut = set(allowed_tokens(suspects, 10 ** 6))
    vocab = grammars._describe().decoded_vocab
    assert cut and all(_utf8(vocab[t]) != (t in cut) for t in range(len(vocab)))

    class Refusing:  # xgrammar's matcher, refusing the tokens in `refused`
        def __init__(self, inner, refused):
            self.inner, self.refused, self.rollbacks = inner, refused, 0

        def accept_token(self, token):
            return token not in self.refused and self.inner.accept_token(token)

        def rollback(self, n):
            self.rollbacks += n
            self.inner.rollback(n)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def fill(regex, batch, refuse_all):
        matchers = [grammars.matcher(SamplingParams(regex=regex), [EOS_ID]) for _ in range(batch)]
        raw = torch.zeros((batch, grammars.width), dtype=torch.int32)
        for i, m in enumerate(matchers):
            m._matcher.fill_next_token_bitmask(raw, i)
        few = allowed_tokens(raw[0] & suspects, 10 ** 6)
        for m in matchers:
            m._matcher = Refusing(m._matcher, set(few) if refuse_all else set())
        bitmask = torch.zeros_like(raw)
        grammars._fill([(m, ()) for m in matchers], bitmask)
        return raw, bitmask, few, matchers

    for batch in (1, 9):  # one row at a time, and xgrammar's batch fill
        raw, bitmask, few, matchers = fill(r"[a-z\u00e9]{0,8}", batch, refuse_all=True)
        assert 0 < len(few) <= VERIFY_MAX  # the first byte of "\u00e9"
        expected = raw.clone()
        for token in few:
            expected[:, token // 32] &= ~(1 << token % 32) if token % 32 < 31 else 0x7FFFFFFF
        assert torch.equal(bitmask, expected) and not torch.equal(bitmask, raw)
        raw, bitmask, few, matchers = fill(r"[a-z\u00e9]{0,8}", batch, refuse_all=False)
        assert torch.equal(bitmask, raw)  # accepted: kept, and rolled back
        assert all(m._matcher.rollbacks == len(few) for m in matchers)
        raw, bitmask, few, matchers = fill(r"[\s\S]{0,8}", batch, refuse_all=True)
        assert len(few) > VERIFY_MAX and torch.equal(bitmask, raw)  # free text: not checked
        assert all(m._matcher.rollbacks == 0 for m in matchers)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_an_end_the_request_does_not_stop_at_is_no_token_of_its_grammar(engine):
    """A request that stops at other tokens than the end of sequence (ignore_eos, stop_token_ids):
    no grammar allows the end (a blank token that xgrammar did not count as special, as the
    engine's end was, was allowed and taken as nothing)."""
    matcher = engine.grammars.matcher(SamplingParams(regex=r"[a-z ]*x"), [VOCAB_SIZE - 1])
    bitmask = torch.full((1, engine.grammars.width), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    assert not (int(bitmask[0, EOS_ID // 32]) >> (EOS_ID % 32)) & 1 and not matcher.accept(EOS_ID)


def test_a_stop_token_the_grammar_needs_as_text_fails_its_call_saying_so(engine):
    """A stop token is allowed only where the grammar is complete: one the grammar needs as text
    (the only token that spells "q") leaves it nothing to continue with, a GrammarError that names
    stop_token_ids, not the schema alone; the engine serves on."""
    q = engine.tokenizer.convert_tokens_to_ids("q")
    with pytest.raises(GrammarError, match=rf"out of stop_token_ids \(\[{q}\]"):
        _generate(engine, "stuck", [5, 6, 7], max_tokens=8, regex="qq", stop_token_ids=[q])
    assert _generate(engine, "stuck", [5, 6, 7], max_tokens=8, regex="qq").text == "qq"


def test_a_stop_token_the_grammar_ends_on_as_text_fails_its_call_saying_so(engine):
    """xgrammar took the stop token "a" as the text that completes regex "xa" and the request
    ended at it as a stop, its text dropped: "x", finish_reason "stop" (an outside audit). A stop
    token is an end only, allowed where the grammar is complete: here the grammar cannot be
    completed without it, a GrammarError that says to take it out of stop_token_ids."""
    a = engine.tokenizer.convert_tokens_to_ids("a")
    with pytest.raises(GrammarError, match=rf"needs the stop token {a} as text .*out of stop_token_ids \(\[{a}\]"):
        _generate(engine, "short", [5, 6, 7, 8, 9, 10], max_tokens=8, regex="xa", stop_token_ids=[a])
    assert _generate(engine, "whole", [5, 6, 7, 8, 9, 10], max_tokens=8, regex="xa").text == "xa"


def test_a_stop_token_is_an_end_where_the_grammar_is_complete_and_never_text(engine):
    """A caller's stop token that is text ("a") is neither allowed nor accepted where the grammar
    is not complete (drafts are cut there), and ends the output where it is, as the end of
    sequence does; a grammar with another way on takes it (regex "x[ab]": "xb")."""
    a, b, x = (engine.tokenizer.convert_tokens_to_ids(c) for c in "abx")
    matcher = engine.grammars.matcher(SamplingParams(regex="x[ab]"), [a, EOS_ID])

    def allowed() -> set[int]:
        bitmask = torch.full((1, engine.grammars.width), -1, dtype=torch.int32)
        matcher.fill(bitmask, 0, suspects=engine.grammars.suspects())
        return set(allowed_tokens(bitmask[0], VOCAB_SIZE))

    assert matcher.valid_prefix([x, a]) == 1 and matcher.valid_prefix([x, b, a]) == 3
    assert matcher.accept(x)
    assert a not in allowed() and b in allowed() and EOS_ID not in allowed()
    assert not matcher.accept(a) and not matcher.done
    assert matcher.accept(b)
    assert {a, EOS_ID} <= allowed()
    assert matcher.accept(a) and matcher.done
    out = _generate(engine, "other-way", [5, 6, 7, 8, 9, 10], max_tokens=8, regex="x[ab]", stop_token_ids=[a])
    assert (out.text, out.finish_reason) == ("xb", "stop")


def test_a_batched_fill_holds_a_stop_token_as_a_single_fill_does(engine):
    """`Grammars._fill` over BATCH_FILL_ROWS rows or more clears a stop token where the grammar is
    not complete (before it spells a forced string: "a" may be its first token), as `Matcher.fill`."""
    from hibana_core.grammar import BATCH_FILL_ROWS

    a, x = (engine.tokenizer.convert_tokens_to_ids(c) for c in "ax")
    grammars = engine.grammars
    matchers = [grammars.matcher(SamplingParams(regex=regex), [a, EOS_ID])
                for regex in ["x[ab]", "xab", "x(ab)?", "x[a-c]+"] * (BATCH_FILL_ROWS // 4 + 1)]
    assert all(m.accept(x) for m in matchers)
    batched = torch.empty((len(matchers), grammars.width), dtype=torch.int32)
    grammars._fill([(m, ()) for m in matchers], batched)
    for i, m in enumerate(matchers):
        single = torch.full((1, grammars.width), -1, dtype=torch.int32)
        m.fill(single, 0, suspects=grammars.suspects())
        assert torch.equal(batched[i], single[0]), i
        allowed = set(allowed_tokens(batched[i], VOCAB_SIZE))
        assert allowed and (a in allowed) == (i % 4 == 2)  # "x" is whole under x(ab)? alone


@pytest.mark.parametrize("regex", ["x[ab]", "[ab]{1,4}c", "(ab|ba)+", "x(ya|zb)", "xa?", "a*b", '"[ab ]{0,5}"'])
@pytest.mark.parametrize("stop", ["a", "b"])
def test_a_stop_token_never_ends_an_output_short_of_a_match(engine, regex, stop):
    """Sampled or greedy, a request whose stop_token_ids hold text its grammar may need ends with a
    whole match, or fails with a GrammarError naming stop_token_ids; max_tokens aside."""
    token = engine.tokenizer.convert_tokens_to_ids(stop)
    for seed in range(4):
        params = {"temperature": 0.0} if seed == 0 else {"temperature": 1.0, "seed": seed}
        try:
            out = _generate(engine, f"stop-{seed}", random_tokens(random.Random(seed), 8), max_tokens=12,
                            regex=regex, stop_token_ids=[token], **params)
        except GrammarError as exc:
            assert f"out of stop_token_ids ([{token}]" in str(exc)
            continue
        if out.finish_reason == "stop":
            assert re.fullmatch(regex, out.text), (regex, stop, seed, out.text)


@pytest.mark.parametrize("constraint", [{"json_schema": {"type": "string", "maxLength": 3}},
                                        {"json_schema": {"type": "string", "pattern": "^.{0,3}$"}},
                                        {"regex": '".{0,3}"'}])
def test_no_utf16_surrogate_is_spelled_byte_by_byte(engine, constraint):
    """xgrammar takes 0xED then A0-BF as a character; it is a UTF-16 surrogate, which the text
    decodes as three U+FFFD (a sampled '":\\xed\\xac\\xb7u"' broke maxLength 3 and ^.{0,3}$): the
    mask clears those tails after 0xED, and the matcher refuses them."""
    matcher = engine.grammars.matcher(SamplingParams(**constraint), [EOS_ID])
    byte = {text: token for token, text in enumerate(engine.grammars._bytes) if len(text) == 1}
    assert matcher.accept(byte[b'"']) and matcher.accept(byte[b"\xed"])
    bitmask = torch.full((2, engine.grammars.width), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0, drafts=[byte[b"\x9f"]])  # the second row after a draft: a whole character

    def allowed(row: int, token: int) -> bool:
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

    assert allowed(0, byte[b"\x80"]) and allowed(0, byte[b"\x9f"])
    assert not allowed(0, byte[b"\xa0"]) and not allowed(0, byte[b"\xac"]) and not allowed(0, byte[b"\xbf"])
    assert allowed(1, byte[b"\xbf"])  # ED 9F BF is U+D7FF, a character: its next byte is free
    assert not matcher.accept(byte[b"\xac"]) and matcher.accept(byte[b"\x9f"])


@pytest.mark.parametrize("lead, bad, good", [(0xE0, 0x9F, 0xA0), (0xF0, 0x8D, 0x90), (0xF4, 0x90, 0x8F)])
def test_no_overlong_or_out_of_range_character_is_spelled_byte_by_byte(engine, lead, bad, good):
    """As after 0xED: xgrammar took F0 8D 9F 9F (an overlong form) as a character under a pattern,
    which the text decodes as four U+FFFD (a '^\\W{3}$' string came out as "\ufffd" * 4 + "''").
    The byte that spells no character after each such lead is masked and refused; a token that can
    be in no UTF-8 text (C0, a stray continuation byte) is masked everywhere."""
    from hibana_core.grammar import _never_utf8

    matcher = engine.grammars.matcher(SamplingParams(json_schema={"type": "string", "pattern": "^.{0,3}$"}),
                                      [EOS_ID])
    byte = {text: token for token, text in enumerate(engine.grammars._bytes) if len(text) == 1}
    bitmask = torch.full((1, engine.grammars.width), -1, dtype=torch.int32)

    def allowed(token: int) -> bool:
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    assert matcher.accept(byte[b'"'])
    matcher.fill(bitmask, 0)
    assert not allowed(byte[b"\xc0"]) and not allowed(byte[b"\xf5"]) and allowed(byte[bytes([lead])])
    assert matcher.accept(byte[bytes([lead])])
    bitmask.fill_(-1)
    matcher.fill(bitmask, 0)
    assert not allowed(byte[bytes([bad])]) and allowed(byte[bytes([good])])
    assert not matcher.accept(byte[bytes([bad])]) and matcher.accept(byte[bytes([good])])
    assert [_never_utf8(t) for t in (b"\xf0\x8d", b"a\x80", b"\xe2a", b"\x9f\x98\x80", "\u00e9t\u00e9".encode())] == [
        True, True, True, False, False]


@pytest.mark.parametrize("regex", [r".{3}", r"\W{3}", r"\S\s\S", r"[^\w-]{3}", r"\D{2}"])
def test_a_regex_holds_the_output_as_pythons_re_reads_it(engine, regex):
    """xgrammar reads `.` as any character (a line break too) and \\W \\S \\D as any but ASCII
    word characters, digits or its few spaces: sampled outputs that ended "stop" failed
    re.fullmatch ('.\\n\\nx' for .{4}, a CJK ideograph for \\W, '\\x1f' for \\S). Random weights
    at a high temperature try the corners."""
    for seed in range(12):
        out = _generate(engine, f"re{seed}", [5, 6, 7], max_tokens=12, regex=regex, temperature=1.5, seed=seed)
        if out.finish_reason == "stop":
            assert re.fullmatch(regex, out.text), (seed, out.text)


@pytest.mark.parametrize("constraint", [{"regex": r"[^\s\S]"}, {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}])
def test_a_grammar_no_output_can_start_is_refused_before_the_prompt_is_computed(engine, constraint):
    """A regex of an empty class compiled, and its request failed at the first step with "the
    model's token 0 does not continue the request's grammar", its prompt computed into the state."""
    h = engine.open_state("nothing-starts")
    with pytest.raises(GrammarError, match="matches no output"):
        h.generate(SamplingParams(max_tokens=4, **constraint), prompt=[5, 6, 7])
    assert h.tokens == [] and _generate(engine, "nothing-starts", [5, 6], max_tokens=3, regex="x*").text in (
        "", "x", "xx", "xxx")


def test_a_loose_schema_holds_what_the_grammar_can_and_leaves_the_rest_to_the_model(engine):
    """strict_schema=False (OpenAI's strict: false, vLLM's guided decoding): a keyword the grammar
    cannot hold is left to the model rather than refused, the rest held; the same schema stays
    refused where strict (a cache of its own: neither compile answers for the other)."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9},
                                                     "contains": {"const": 3}, "maxItems": 3}},
              "required": ["xs"], "additionalProperties": False}
    for strict in (True, False, True):
        if strict:
            with pytest.raises(GrammarError, match="contains at #/properties/xs"):
                _generate(engine, "loose", [5, 6], max_tokens=24, json_schema=schema)
            continue
        out = _generate(engine, "loose", [5, 6], max_tokens=24, json_schema=schema, strict_schema=False)
        value = json.loads(out.text)  # the held part: an object of up to three digits
        assert set(value) == {"xs"} and len(value["xs"]) <= 3 and all(0 <= x <= 9 for x in value["xs"])
    with pytest.raises(ConfigError, match="strict_schema"):
        SamplingParams(json_schema=schema, strict_schema="no")


def test_the_server_reads_strict_from_a_chat_request_only():
    """A legacy completions request has no response_format: reading its strict switch made every
    /v1/completions call a 500 (an AttributeError)."""
    from hibana_plugins.openai_api import ChatRequest, CompletionRequest, chat_call

    call = chat_call(CompletionRequest(model="demo", prompt="Once upon a time"), None, 1024)
    assert call.params.json_schema is None and call.params.max_tokens == 16
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for strict in (None, False, True):
        response_format = {**loose, "json_schema": {**loose["json_schema"], "strict": strict}}
        call = chat_call(ChatRequest(model="demo", messages=[{"role": "user", "content": "hi"}],
                                     response_format=response_format), None, 1024)
        assert call.params.strict_schema is (strict is True)


def test_date_and_time_formats_allow_only_dates_and_times_that_exist():
    """xgrammar's formats let through Feb 30, Apr 31, year 0000, second 60 and endless fractions
    of a second, which Python's datetime (and pydantic) refuse: every day of a (common) year is
    allowed and no other, and seconds and fractions are bounded."""
    import datetime

    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hibana_core.grammar import MAX_FRACTION_DIGITS, json_schema_grammar

    date, moment, time_ = (json_schema_grammar({"type": "string", "format": f}) for f in ("date", "date-time", "time"))
    for month in range(1, 13):
        for day in range(1, 32):
            text = f"2023-{month:02d}-{day:02d}"
            try:
                real = bool(datetime.date(2023, month, day))
            except ValueError:
                real = False
            assert accepts(date, f'"{text}"') == real, text
            assert accepts(moment, f'"{text}T12:34:56Z"') == real, text
    for year, ok in (("0000", False), ("0001", True), ("0999", True), ("9999", True)):
        assert accepts(date, f'"{year}-01-31"') == ok
    fraction = "1" * MAX_FRACTION_DIGITS
    for grammar, prefix in ((moment, "2024-06-30T"), (time_, "")):
        assert accepts(grammar, f'"{prefix}23:59:59.{fraction}+05:30"')
        assert not accepts(grammar, f'"{prefix}23:59:59.{fraction}1Z"')
        assert not accepts(grammar, f'"{prefix}23:59:60Z"') and not accepts(grammar, f'"{prefix}24:00:00Z"')
    # a pattern that reads like a second is the user's, not narrowed
    assert accepts(json_schema_grammar({"type": "string", "pattern": "^([0-5][0-9]|60)$"}), '"60"')


def test_latin1_letters_before_hex_digits_stay_themselves():
    """xgrammar prints U+0080..U+00FF as \\xHH and reads back every hex digit after a \\x: the
    schema grammar, printed, edited and compiled again, turned "éa" into U+0E9A ("café2", the key
    "ï1", the tool argument "décembre"), so the grammar forced a string outside the schema. The
    schema's own strings are what it holds now, in enums, consts, keys and inside tool calls."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hibana_core.grammar import json_schema_grammar

    enum = json_schema_grammar({"enum": ["éa", "décembre", "x"]})
    assert accepts(enum, '"éa"') and accepts(enum, '"décembre"') and not accepts(enum, '"\u0e9a"')
    assert accepts(json_schema_grammar({"const": "café2"}), '"café2"')
    key = json_schema_grammar({"type": "object", "properties": {"ï1": {"type": "integer", "maximum": 9},
                                                                 "a\\xe9é": {"type": "boolean"}},
                               "required": ["ï1", "a\\xe9é"], "additionalProperties": False})
    assert accepts(key, '{"ï1": 3, "a\\\\xe9é": true}')
    assert not accepts(key, '{"\u0ef1": 3, "a\\\\xe9é": true}')
    tools = [{"type": "function", "function": {"name": "make_note", "parameters": {
        "type": "object", "properties": {"month": {"enum": ["décembre", "ÿ1"]}}, "required": ["month"]}}}]
    import xgrammar as xgr

    from hibana_core.grammar import compact_json_tag

    tag = compact_json_tag(tool_call_grammar(tools, "required", SYNTAX["hermes"]))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"]))
    compiled = compiler.compile_structural_tag(xgr.StructuralTag.from_json(json.dumps(tag)))
    syntax = SYNTAX["hermes"]
    for month, ok in (("décembre", True), ("ÿ1", True), ("d\ue9cembre", False)):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        call = f'{syntax.open}make_note{syntax.mid}{{"month": "{month}"}}{syntax.close}'
        assert (matcher.accept_string(call) and matcher.is_completed()) == ok, month


def test_an_object_asking_more_keys_than_it_declares_is_open():
    """JSON Schema's objects are open where additionalProperties is left out; the grammar keeps
    an object to its declared keys (xgrammar's strict mode, as OpenAI's strict outputs), which
    refused {"minProperties": 1} as unsatisfiable: such an object takes other keys now."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hibana_core.grammar import json_schema_grammar

    some = json_schema_grammar({"type": "object", "minProperties": 1})
    assert accepts(some, '{"k": 1}') and not accepts(some, "{}")
    two = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2})
    assert accepts(two, '{"a": 1, "b": [true]}') and not accepts(two, '{"a": 1}')
    nested = json_schema_grammar({"type": "array", "items": {"type": "object", "minProperties": 1}})
    assert accepts(nested, '[{"x": null}]') and not accepts(nested, "[{}]")
    closed = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(closed, '{"a": 1}') and not accepts(closed, '{"b": 1}')  # declared keys only


def test_pydantic_dates_and_times_parse_from_a_random_model(engine):
    """Sampled from a random-weight model: every datetime, date and time validates in pydantic."""
    import datetime

    class When(pydantic.BaseModel):
        at: datetime.datetime
        day: datetime.date
        clock: datetime.time

    schema = When.model_json_schema()
    for seed in range(6):
        out = _generate(engine, f"when-{seed}", random_tokens(random.Random(seed), 10), max_tokens=200,
                        json_schema=schema, temperature=1.0, seed=seed)
        assert out.finish_reason == "stop", out.text
        When.model_validate_json(out.text)


def test_a_long_forced_string_is_spelled_from_its_beginning_only(engine, monkeypatch):
    """A grammar that forces a long text (a const of 200k characters) spells only the first
    SPELLED_CHARS of what is left to find its next token: its whole spelling each step made
    every agent's step wait 100 ms (a new user's trial), and the output is the const all the same."""
    from hibana_core.grammar import SPELLED_CHARS

    spelled = []
    spell = engine.grammars.spell
    monkeypatch.setattr(engine.grammars, "spell", lambda text: spelled.append(len(text)) or spell(text))
    const = "ab" * 5000
    c = _generate(engine, "long-const", random_tokens(random.Random(2), 8), max_tokens=12,
                  json_schema={"const": const})
    assert spelled and max(spelled) <= SPELLED_CHARS
    assert len(c.token_ids) == 12 and (json.dumps(const)).startswith(c.text)


def test_a_forced_string_is_searched_for_once_and_followed_token_by_token(engine):
    """xgrammar's forced-string search reads all of what is forced, each call (a const of 1M
    characters cost every step 58 ms): it runs once, and each kept token takes its bytes off what
    it found; the tokens are the forced text's, and a draft rolled back leaves it as it was."""
    from hibana_core.grammar import Matcher

    class Counting:
        def __init__(self, inner):
            self.inner, self.searches = inner, 0

        def find_jump_forward_string(self):
            self.searches += 1
            return self.inner.find_jump_forward_string()

        def __getattr__(self, name):
            return getattr(self.inner, name)

    const = "ab" * 5000
    matcher = engine.grammars.matcher(SamplingParams(json_schema={"const": const}), [EOS_ID])
    assert isinstance(matcher, Matcher)
    counting = matcher._matcher = Counting(matcher._matcher)
    tokens = []
    for _ in range(40):
        bitmask = torch.full((3, engine.grammars.width), -1, dtype=torch.int32)
        matcher.fill(bitmask, 0)  # a row, as a step fills it
        [token] = allowed_tokens(bitmask[0], 2)  # the forced text's next token alone
        if tokens:  # a draft accepted and rolled back changes nothing
            assert matcher.valid_prefix([token]) == 1
        assert matcher.accept(token)
        tokens.append(token)
    assert counting.searches == 1
    assert json.dumps(const).startswith(engine.tokenizer.decode(tokens))


def test_one_grammar_asked_by_many_at_once_compiles_once(engine, monkeypatch):
    """Sixteen agents sending the same new grammar together compiled it sixteen times (22 s of a
    101-tool grammar; a new user's trial): the first compiles, the others wait for it, and a
    failure reaches each of them."""
    from concurrent.futures import ThreadPoolExecutor

    grammars, compiles = engine.grammars, []
    compile_ = grammars._compile

    def slow(kind, params):
        compiles.append(kind)
        time.sleep(0.3)  # long enough for every caller to arrive meanwhile
        return compile_(kind, params)

    monkeypatch.setattr(grammars, "_compile", slow)
    schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}, "required": ["only_here"]}
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: grammars.compile(SamplingParams(json_schema=schema)), range(8)))
    assert len(compiles) == 1 and all(r is results[0] for r in results)
    bad = SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "frobnicate"}}})
    with ThreadPoolExecutor(4) as pool:
        failures = list(pool.map(lambda _: _error_of(lambda: grammars.compile(bad)), range(4)))
    assert len(compiles) == 2 and all(isinstance(f, GrammarError) for f in failures)


async def test_agenerate_compiles_a_new_grammar_off_the_event_loop(engine, monkeypatch):
    """A big grammar compiles for seconds: agenerate does it in a worker thread, not on the loop."""
    grammars, threads = engine.grammars, []
    compile_ = grammars._compile

    def noting(kind, params):
        threads.append(threading.get_ident())
        return compile_(kind, params)

    monkeypatch.setattr(grammars, "_compile", noting)
    h = engine.open_state("async-new-grammar")
    try:
        out = await h.agenerate(SamplingParams(max_tokens=8, regex=r"[a-z]{3}x"), prompt=random_tokens(random.Random(3), 6))
    finally:
        h.close()
    assert out.text[-1] == "x" and threads and threading.get_ident() not in threads


async def test_astream_compiles_a_new_grammar_off_the_event_loop(engine, monkeypatch):
    """astream too: its call returns at once, the grammar compiles in a worker thread at the
    first read while the loop serves others (a coroutine beside it keeps ticking), and the
    request is submitted once it is compiled."""
    import asyncio

    grammars, threads, ticked = engine.grammars, [], []
    compile_ = grammars._compile

    def slow(kind, params):
        threads.append(threading.get_ident())
        before = ticks
        time.sleep(0.5)  # a big schema's seconds
        ticked.append(ticks - before)
        return compile_(kind, params)

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    monkeypatch.setattr(grammars, "_compile", slow)
    ticks, ticker = 0, asyncio.create_task(tick())
    h = engine.open_state("astream-new-grammar")
    try:
        events = h.astream(SamplingParams(max_tokens=8, regex=r"[a-z]{3}q"), prompt=random_tokens(random.Random(4), 6))
        assert not threads and h.tokens == []  # nothing compiled nor submitted yet
        last = [event async for event in events][-1]
    finally:
        ticker.cancel()
        h.close()
    assert last.completion.text[-1] == "q" and threads and threading.get_ident() not in threads
    assert ticked[0] >= 10, ticked  # the loop went on while it compiled


async def test_an_astream_closed_or_stopped_before_its_grammar_compiled(engine):
    """Closed before its first read, an astream whose grammar is new submits nothing; stopped
    then, it is stopped once submitted and its final event still carries the completion."""
    h = engine.open_state("astream-closed-first")
    try:
        closed = h.astream(SamplingParams(max_tokens=8, regex=r"[a-z]{4}w"), prompt=random_tokens(random.Random(5), 6))
        assert not closed.ready()
        await closed.aclose()
        assert closed.ready() and [event async for event in closed] == [] and h.tokens == []
        stopped = h.astream(SamplingParams(max_tokens=8, regex=r"[a-z]{5}w"), prompt=random_tokens(random.Random(5), 6))
        stopped.stop()
        events = [event async for event in stopped]
        assert events[-1].completion.finish_reason == "cancelled"
    finally:
        h.close()


def _error_of(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - returned for the test to look at
        return exc
    return None


# --- failures stay with their request -----------------------------------------------------------------

def test_number_bounds_keep_every_int64_and_no_number_overflows():
    """The digit bound lets every int64 through (19-digit ids) and ends a number at 20 digits; an
    exponent has two digits, so that the largest number allowed is a finite double and ordinary
    doubles (as `json.dumps` writes them) keep their spelling."""
    import xgrammar as xgr

    from hibana_core.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "x": {"type": "number"}}}
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)])).compile_grammar(
        json_schema_grammar(schema))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    assert accepts('{"id": -9223372036854775808}') and accepts('{"id": 1234567890123456789}')
    assert not accepts('{"id": 12345678901234567890}')
    for x in (6.02214076e23, -1.602176634e-19, 1e-99, 9.999e99, 0.1, 2.5e-05, 1234.5678):
        assert accepts(json.dumps({"x": x})), x
    largest = "9" * (MAX_NUMBER_DIGITS + 1) + "." + "9" * MAX_NUMBER_DIGITS + "e+99"
    assert accepts(f'{{"x": {largest}}}') and math.isfinite(json.loads(largest))
    assert not accepts('{"x": 429000888e906}') and not accepts('{"x": 1e100}')


def test_unbounded_numbers_end(engine):
    """Integers and numbers without bounds (pydantic's `int`, `list[float]`) have at most
    MAX_NUMBER_DIGITS digits before and after the point: a random model that starts repeating a
    digit still finishes, and the output validates."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "low": {"type": "integer", "minimum": 7},
                                               "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
              "required": ["n", "low", "xs"], "additionalProperties": False}
    rng = random.Random(31)
    for seed in range(6):
        params = dict(temperature=1.0, seed=seed) if seed % 2 else {}
        out = _generate(engine, f"numbers-{seed}", random_tokens(rng, 10), max_tokens=300, json_schema=schema, **params)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        assert all(len(run) <= MAX_NUMBER_DIGITS + 1 for run in re.findall(r"[0-9]+", out.text)), out.text


@pytest.mark.parametrize("seed", range(6))
def test_generated_numbers_are_finite(engine, seed):
    """Numbers sampled from a random model, exponents included, are finite doubles once read."""
    schema = {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 8}
    out = _generate(engine, f"finite-{seed}", random_tokens(random.Random(40 + seed), 10), max_tokens=400,
                    json_schema=schema, temperature=1.3, seed=seed)
    assert out.finish_reason == "stop", out.text
    assert all(math.isfinite(x) for x in json.loads(out.text)), out.text


def test_a_bad_schema_fails_its_call_alone(engine):
    rng = random.Random(9)
    prompts = [random_tokens(rng, 12) for _ in range(3)]
    solo = [_generate(engine, f"solo{i}", p, max_tokens=30, ignore_eos=True).token_ids for i, p in enumerate(prompts)]
    handles = [engine.open_state(f"ok{i}") for i in range(3)]
    streams = [h.stream(SamplingParams(max_tokens=30, ignore_eos=True), prompt=p) for h, p in zip(handles, prompts)]
    bad = engine.open_state("bad")
    for params in ({"json_schema": {"type": "frobnicate"}}, {"regex": "(unclosed"}, {"grammar": 'root ::= "a'},
                   {"grammar": "root ::= missing_rule"}, {"json_schema": {"$ref": "#/$defs/none"}},
                   {"grammar": {"type": "structural_tag", "format": {"type": "nonsense"}}}):
        with pytest.raises(GrammarError) as failure:
            bad.generate(SamplingParams(max_tokens=5, **params), prompt=prompts[0])
        assert isinstance(failure.value, HibanaError) and "cannot be compiled" in str(failure.value)
        assert bad.tokens == []  # refused before the state changed
    assert [[ev.token_id for ev in s if ev.token_id is not None] for s in streams] == solo
    out = bad.generate(SamplingParams(max_tokens=10, json_schema={"type": "boolean"}), prompt=prompts[1])
    assert out.text in ("true", "false")
    for h in handles + [bad]:
        h.close()


def test_a_schema_keyword_the_grammar_cannot_hold_is_refused_by_name(engine):
    """xgrammar compiles these but lets outputs break them (on a random model: arrays without the
    item `contains` asks for, {"a": 7} without the b that `dependentRequired` asks for, booleans
    for an allOf of objects): refused, naming keyword and place, rather than "valid" outputs that
    are not."""
    h = engine.open_state("unenforced")
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    cases = {
        "contains at #/properties/xs": {"type": "object", "properties": {"xs": {"type": "array", "items": digit,
                                                                           "contains": {"const": 3}}}},
        "dependentRequired at #": {"type": "object", "properties": {"a": digit, "b": digit},
                                   "dependentRequired": {"a": ["b"]}},
        "if at #/$defs/p": {"$defs": {"p": {"if": {"required": ["a"]}, "then": {"required": ["b"]}}},
                            "$ref": "#/$defs/p"},
        "allOf with 2 subschemas at #/anyOf/1": {"anyOf": [digit, {"allOf": [{"type": "object"}, {"required": ["a"]}]}]},
        # dropped with a warning on stderr alone: "cccc" under maxLength 3, 3 under not const 3, ...
        "maxLength beside pattern at #/properties/code": {"type": "object", "properties": {"code": {
            "type": "string", "pattern": "^[a-c]+$", "maxLength": 3}}},
        "minLength/maxLength beside format at #/$defs/E": {"$defs": {"E": {"type": "string", "format": "email",
                                                                           "minLength": 5, "maxLength": 30}},
                                                          "$ref": "#/$defs/E"},
        "not at #/items": {"type": "array", "items": {"type": "integer", "not": {"const": 3}}},
        "multipleOf at #/properties/x": {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}},
        "a lookahead (?= in pattern at #/anyOf/0": {"anyOf": [{"type": "string", "pattern": "^(?=.*x)[a-z]+$"}]},
        "an anchor ^ inside pattern at #": {"type": "string", "pattern": "^a$|^b$"},
        # the listed values alone are written: "abcdef" under maxLength 2, 7 under maximum 3
        "maxLength beside enum at #/properties/e": {"type": "object", "properties": {"e": {
            "enum": ["abcdef", "a"], "maxLength": 2}}},
        "maximum beside const at #/items": {"type": "array", "items": {"const": 7, "maximum": 3}},
        "a lookahead (?! in '^(?!a)' at #/patternProperties": {"type": "object",
                                                               "patternProperties": {"^(?!a)": digit}},
        # the declared keys alone are written: {} under required ["zz"], {"r": 1} without q
        "required ['zz'] not under properties at #": {"type": "object", "required": ["zz"], "maxProperties": 2},
        "required ['q'] not under properties at #/properties/a": {"type": "object", "properties": {"a": {
            "type": "object", "properties": {"r": digit}, "required": ["r", "q"]}}, "required": ["a"]},
        # not followed, so any value passes: 2e40 for a digit
        "$ref '#dig' at #": {"$defs": {"D": {"$anchor": "dig", **digit}}, "$ref": "#dig"},
        "$ref 'https://example.com/s.json' at #/items": {"type": "array",
                                                          "items": {"$ref": "https://example.com/s.json"}},
        "$dynamicRef at #": {"$dynamicRef": "#/$defs/D", "$defs": {"D": digit}},
        # the referenced schema alone is held: 2e18 under maximum 5, a runaway string under maxLength 2
        "maximum beside $ref at #/properties/x": {"$defs": {"D": digit}, "type": "object",
                                                 "properties": {"x": {"$ref": "#/$defs/D", "maximum": 5}}},
        "type/maxLength beside $ref at #": {"$defs": {"S": {"type": "string"}}, "$ref": "#/$defs/S",
                                            "type": "string", "maxLength": 2},
        "$recursiveRef at #/properties/n": {"type": "object", "properties": {"n": {"$recursiveRef": "#"}}},
        # held as the branches alone: false for a string, {} without its required key, 90 under maximum 6
        "type beside anyOf at #": {"type": "string", "anyOf": [{"format": "date"}, {"format": "email"}]},
        "type/required/properties/additionalProperties beside oneOf at #": {
            "type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
            "additionalProperties": False, "oneOf": [{"properties": {"kind": {"const": "a"}}}]},
        "type/minimum/maximum beside allOf at #": {"type": "integer", "minimum": 5, "maximum": 6,
                                                    "allOf": [{"type": "integer"}]},
        # the listed values alone: 1 under multipleOf 2
        "multipleOf beside enum at #": {"type": "integer", "enum": [1, 2, 3, 4], "multipleOf": 2},
        "dependencies at #": {"type": "object", "properties": {"a": digit, "b": digit}, "dependencies": {"a": ["b"]}},
        # written into the JSON string unescaped: "a"b", a raw tab, "\" (no JSON, or one backslash)
        "pattern '^a\"b$' at #": {"type": "string", "pattern": '^a"b$'},
        "pattern '^\\t$' at #/items": {"type": "array", "items": {"type": "string", "pattern": "^\t$"}},
        "pattern '^[\"\\\\\\\\]{2}$' at #": {"type": "string", "pattern": '^["\\\\]{2}$'},
        "pattern '^\"+$' at #/patternProperties": {"type": "object", "patternProperties": {'^"+$': digit}},
    }
    for where, schema in cases.items():
        with pytest.raises(GrammarError, match="cannot hold") as failure:
            h.generate(SamplingParams(max_tokens=5, json_schema=schema), prompt=[5, 6])
        assert where in str(failure.value)
        assert h.tokens == []
    with pytest.raises(GrammarError, match=r"a lookahead \(\?! in regex: write it without"):
        h.generate(SamplingParams(max_tokens=5, regex=r"(?!0)[0-9]+"), prompt=[5, 6])
    # a multiple of an integer on integers, anchors that are escaped or in a class or follow inline
    # flags (refused as "an anchor inside"), a quote where xgrammar escapes it, bounds without a type
    # (ignored: 90 under maximum 4) are held
    for schema in ({"type": ["integer", "null"], "multipleOf": 2, "minimum": 0, "maximum": 8},
                   {"type": "string", "pattern": r"^[$^]\$$"}, {"type": "string", "pattern": "(?i)^ab$"},
                   {"type": "string", "pattern": '^[a"]{2}$'}, {"minimum": 3, "maximum": 4},
                   {"maxLength": 2}, {"minItems": 1, "maxItems": 2}, {"exclusiveMaximum": 0}):
        out = h.generate(SamplingParams(max_tokens=20, json_schema=schema), prompt=[5, 6])
        jsonschema.validate(json.loads(out.text), schema)
    # a property named like a keyword is no keyword; one allOf subschema (pydantic's $ref) is held
    fine = {"$defs": {"D": digit}, "type": "object", "properties": {"if": {"allOf": [{"$ref": "#/$defs/D"}]}},
            "required": ["if"], "additionalProperties": False}
    out = h.generate(SamplingParams(max_tokens=20, json_schema=fine), prompt=[5, 6])
    assert set(json.loads(out.text)) == {"if"} and 0 <= json.loads(out.text)["if"] <= 9
    # annotations beside a $ref (pydantic writes a field's description and default there) are no constraints
    annotated = {"$defs": {"D": digit}, "$ref": "#/$defs/D", "description": "a digit", "default": 3, "title": "D"}
    assert 0 <= json.loads(h.generate(SamplingParams(max_tokens=20, json_schema=annotated), prompt=[5, 6]).text) <= 9


HELD_SCHEMAS = [
    {"type": "number", "minimum": -2.5, "maximum": 7},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 6},
    {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 100},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "string", "pattern": "^[a-c]{2,5}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"const": "fixed"},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "minProperties": 1,
     "maxProperties": 2, "propertyNames": {"pattern": "^[a-z]{1,3}$"}},
    {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "boolean"}}, "additionalProperties": False,
     "maxProperties": 2},
]


@pytest.mark.parametrize("schema", HELD_SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_the_keywords_the_grammar_holds_are_accepted_and_held(engine, schema):
    """Number ranges, integer multipleOf, item and property counts, patterns and formats alone,
    const, lengths alone, propertyNames, patternProperties: accepted, and every sampled output of
    a random model validates (formats checked too). Not ipv4 and date-time, which xgrammar holds
    more loosely than jsonschema's checks: a part with leading zeros ("38.081.48.53", Python's
    ipaddress refuses it), a second 60 at any time ("21:38:60Z", RFC 3339 at 23:59 alone)."""
    assert not unenforced_keywords(schema)
    for seed in range(3):
        out = _generate(engine, "held", random_tokens(random.Random(seed), 8), max_tokens=120, json_schema=schema,
                        temperature=1.0, seed=seed)
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


class _Node(pydantic.BaseModel):
    name: str
    child: "_Node"  # required at every level: no finite value


class _Tree(pydantic.BaseModel):
    name: str
    parent: Optional["_Tree"] = None
    children: List["_Tree"] = []


@pytest.mark.parametrize("schema, where", [
    (_Node, "#/$defs/_Node"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
    ({"$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/B"}, "minItems": 1},
                "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}]}},
      "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"]}, "#/$defs/A"),
])
def test_a_schema_without_a_finite_value_is_refused(schema, where):
    """A schema whose every value contains itself (a required property or a non-empty list of it,
    all the way down) is a GrammarError naming where: xgrammar's forced-string search ran without
    end on it and took the process down (out of memory, 24 GB in a second)."""
    from hibana_core.grammar import json_schema_grammar

    with pytest.raises(GrammarError, match=f"no finite value.*{re.escape(where)}"):
        json_schema_grammar(SamplingParams(json_schema=schema).json_schema)


_MUTUAL = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"}
"""a needs a b, whose a is optional: {"b": {}} is finite (refused once: b, met while a was
weighed, was never weighed itself; a new user's trial)."""


@pytest.mark.parametrize("schema", [_Tree, {"type": "object", "properties": {"a": {"$ref": "#"}}},
                                    {"type": "array", "items": {"$ref": "#"}}, _MUTUAL])
def test_a_recursive_schema_with_a_way_out_compiles(schema):
    from hibana_core.grammar import json_schema_grammar

    json_schema_grammar(SamplingParams(json_schema=schema).json_schema)


@pytest.mark.parametrize("grammar, endless", [('root ::= "a" root', "root"),
                                             ('root ::= "{" root "}" | x\nx ::= "(" x ")"', "root, x")])
def test_a_grammar_without_a_finite_string_is_refused(engine, grammar, endless):
    """An EBNF grammar whose every derivation goes on for ever is a GrammarError naming its rules
    (compiled here, not generated: xgrammar's forced-string search never ended on it and took the
    process down); one with a way out compiles."""
    grammars = engine.grammars
    with pytest.raises(GrammarError, match=f"no finite string: its rules {endless} never end"):
        grammars.compile(SamplingParams(grammar=grammar))
    grammars.compile(SamplingParams(grammar='root ::= "a" root | "b"'))


def test_sampling_params_refuse_constraints_that_are_not_one():
    with pytest.raises(GrammarError, match="one of json_schema, regex and grammar"):
        SamplingParams(json_schema={}, regex="a")
    with pytest.raises(GrammarError, match="not JSON"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(GrammarError, match="EBNF text or a structural tag"):
        SamplingParams(grammar={"type": "other"})
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        tags: list[str]

    assert SamplingParams(json_schema=Point).json_schema["required"] == ["x", "tags"]
    assert SamplingParams(json_schema='{"type": "integer"}').json_schema == {"type": "integer"}
    with pytest.raises(GrammarError, match="the type Opaque, which has no JSON schema"):
        SamplingParams(json_schema=type("Opaque", (), {}))


class Place(TypedDict):  # at module level: pydantic resolves the (postponed) annotations here
    city: str
    rank: int
    tags: NotRequired[list[str]]


@dataclasses.dataclass
class Trip:
    place: Place
    days: int = 1


def test_a_typeddict_or_a_dataclass_is_a_json_schema(engine):
    """Any type pydantic writes a schema for is taken as that schema (`TypeAdapter(t).json_schema()`),
    and the output parses as the type."""
    for kind in (Place, Trip, list[Place], Optional[Trip], Union[Place, Trip], Trip | None, Literal["a", "b"],
                 Annotated[int, pydantic.Field(ge=0)], List[int]):
        params = SamplingParams(max_tokens=300, json_schema=kind)
        assert params.json_schema == pydantic.TypeAdapter(kind).json_schema()
    schema = SamplingParams(json_schema=Place).json_schema
    assert schema["required"] == ["city", "rank"] and schema["properties"]["tags"]["type"] == "array"
    assert SamplingParams(json_schema=Trip).json_schema["required"] == ["place"]
    out = _generate(engine, "typed", random_tokens(random.Random(4), 8), max_tokens=40,
                    json_schema=list[pydantic.conint(ge=0, le=9)])
    assert out.finish_reason == "stop" and all(0 <= n <= 9 for n in json.loads(out.text))


class TypingPlace(typing.TypedDict):  # typing's own TypedDict, as LangChain's docs write them
    """A place."""
    city: str
    rank: typing.NotRequired[int]


class TypingTrip(typing.TypedDict, total=False):
    places: list[TypingPlace]
    home: TypingPlace | None


def test_typings_own_typeddict_is_a_json_schema_before_python_3_12():
    """pydantic refuses typing.TypedDict before Python 3.12 ("use typing_extensions.TypedDict"):
    it is read as the typing_extensions class with the same keys, nested ones too."""
    class ExtensionPlace(TypedDict):
        """A place."""
        city: str
        rank: NotRequired[int]

    class ExtensionTrip(TypedDict, total=False):
        places: list[ExtensionPlace]
        home: ExtensionPlace | None

    want = pydantic.TypeAdapter(ExtensionTrip).json_schema()
    got = SamplingParams(json_schema=TypingTrip).json_schema
    assert json.dumps(got).replace("Typing", "Extension") == json.dumps(want)
    assert SamplingParams(json_schema=list[TypingPlace]).json_schema["$defs"]["TypingPlace"]["required"] == ["city"]


# --- the sampler's masks ------------------------------------------------------------------------------

@pytest.mark.parametrize("every", [True, False])
def test_masks_set_forbidden_logits_to_minus_infinity_on_their_rows_only(every):
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 77, 4
    logits = torch.randn(rows, vocab, generator=gen)
    constrained = [0, 1, 2, 3] if every else [1, 3]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(constrained), 3), dtype=torch.int32, generator=gen)
    masks = TokenMasks(bitmask, torch.tensor(constrained), every)
    out = Sampler(torch.device("cpu")).apply_masks(logits, masks)
    assert torch.equal(Sampler(torch.device("cpu")).apply_masks(logits, masks, shift=True), out)  # the GPU's way
    for r in range(rows):
        for t in range(vocab):
            if r in constrained:
                word = int(bitmask[constrained.index(r), t // 32]) & 0xFFFFFFFF
                allowed = (word >> (t % 32)) & 1
                assert out[r, t] == (logits[r, t] if allowed else float("-inf"))
            else:
                assert out[r, t] == logits[r, t]
    params = SamplingParams(temperature=0.0)
    picked = Sampler(torch.device("cpu"))(logits, [SamplingRow(params, None, (), ())] * rows, masks)
    assert torch.equal(picked, out.argmax(dim=-1))


def test_the_overhead_benchmark_runs(tiny_checkpoints, capsys):
    """`hibana bench grammar` runs on a tiny checkpoint and reports each batch size."""
    from hibana_bench.cli import main

    assert main(["grammar", "--model", str(tiny_checkpoints[ARCH]), "--device", "cpu", "--batch", "1,3",
                 "--generate", "12", "--prompt", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch   1:" in out and "batch   3:" in out and "grammar host work" in out
    assert "engine thread, ms a step, unconstrained -> constrained: step" in out


def test_a_strict_tool_whose_schema_the_grammar_cannot_hold_is_refused():
    """A strict tool's arguments are held to its schema: a keyword xgrammar would drop is refused
    by name, as it is in a json_schema; without strict the tool is taken (its arguments best-effort)."""
    from hibana_core.messages import ToolSchemaError, normalize_tools

    code = {"type": "string", "pattern": "^[a-c]+$", "maxLength": 3}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"code": code}}}}
    with pytest.raises(ToolSchemaError, match="maxLength beside pattern at #/properties/code"):
        normalize_tools([tool])
    tool["function"]["strict"] = False
    assert normalize_tools([tool])[0]["function"]["parameters"]["properties"]["code"] == code
    tool["function"]["strict"] = "yes"  # read as not strict, silently (an outside audit)
    with pytest.raises(ToolSchemaError, match="tool 'f' has strict = 'yes'; strict is true or false"):
        normalize_tools([tool])


def _without_unknown_tokens(node):
    """A structural tag as the engine compiles it for a vocabulary without the tokens its
    `"if_known"` token formats name (Llama 3's <|python_tag|>): those are nothing."""
    if isinstance(node, list):
        return [_without_unknown_tokens(v) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "token" and node.get("if_known"):
        return {"type": "const_string", "value": ""}
    return {k: v if k == "json_schema" else _without_unknown_tokens(v) for k, v in node.items()}


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_an_answer_schema_beside_tools_takes_calls_or_the_answer_alone(parser_name):
    """`answer_or_calls` with "auto": a call of an offered tool, or JSON valid under the answer's
    schema (which the parser reads as content), and nothing else."""
    import xgrammar as xgr

    from hibana_core.grammar import compact_json_tag
    from hibana_core.turn import answer_or_calls

    parser = {"hermes": HermesToolParser(), "llama3_json": Llama3JsonToolParser()}[parser_name]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    tag = _without_unknown_tokens(compact_json_tag(answer_or_calls(parser, parser_name, tools, "auto", answer)))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"]))
    compiled = compiler.compile_structural_tag(xgr.StructuralTag.from_json(json.dumps(tag)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_completed()

    syntax = SYNTAX[parser_name]
    call = f'{syntax.open}get_weather{syntax.mid}{{"city": "Paris"}}{syntax.close}'
    assert accepts(call) and parser.parse(call).tool_calls[0].arguments == {"city": "Paris"}
    assert accepts('{"answer": "hi"}') and parser.parse('{"answer": "hi"}').content == '{"answer": "hi"}'
    for text in ('{"answer": 3}', "hello", '{"answer": "hi"} and more', call.replace("get_weather", "nope")):
        assert not accepts(text), text


# --- what a new user's trial found (fifteenth session) ----------------------------------------------

@pytest.mark.parametrize("schema, where", [
    ({"anyOf": []}, "anyOf with no subschema at #"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}, "anyOf with no subschema at #/properties/a"),
    ({"type": "string", "enum": [1, 2]}, "enum values [1, 2] at # are not of type string"),
    ({"type": "integer", "const": "x"}, 'const "x" at # is not of type integer'),
    ({"type": "array", "items": {"enum": []}}, "an empty enum at #/items")])
def test_a_schema_that_allows_no_value_somewhere_is_refused(engine, schema, where):
    """xgrammar writes something there anyway ('' or '{"a": }' ended with "stop", an enum's values
    whatever the type says): the output would break the schema."""
    with pytest.raises(GrammarError, match=re.escape(where)):
        _generate(engine, "impossible", [5, 6, 7], max_tokens=8, json_schema=schema)
    for fine in ({"type": "number", "enum": [1, 2.5]}, {"type": ["string", "null"], "enum": ["a", None]}):
        _generate(engine, "possible", [5, 6, 7], max_tokens=8, json_schema=fine)


def test_a_schema_that_is_not_json_data_is_a_grammar_error(engine):
    with pytest.raises(GrammarError, match="not plain JSON data"):
        _generate(engine, "bytes", [5, 6], max_tokens=4, json_schema={"type": "object", "properties": {b"a": {}}})


@pytest.mark.parametrize("schema, where", [({"type": "string", "minLength": -1}, "at minLength"),
                                           ({"type": "string", "maxLength": -1}, "at maxLength"),
                                           ({"type": "array", "minItems": -1}, "at minItems"),
                                           ({"type": "string", "format": 5}, "at format")])
def test_a_schema_that_breaks_the_metaschema_is_a_grammar_error(engine, schema, where):
    """xgrammar failed on `"minLength": -1` with a bare RuntimeError, and read `"maxLength": -1`
    as no bound at all (any string let through)."""
    with pytest.raises(GrammarError, match=f"metaschema: .*{where}"):
        _generate(engine, "metaschema", [5, 6], max_tokens=4, json_schema=schema)


@pytest.mark.parametrize("pattern, part", [(r"\Aab\Z", r"an anchor \A"), (r"\d\z", r"an anchor \z"),
                                           (r"a\0", r"an escape \0"), (r"\qx", r"an escape \q")])
def test_regex_escapes_xgrammar_reads_otherwise_are_refused(engine, pattern, part):
    """xgrammar 0.2.9 reads \\A, \\Z, \\z and unknown letters as the letter itself ('AabZ' matched
    \\Aab\\Z) and \\0 as nothing; the escapes it reads as re does stay allowed."""
    with pytest.raises(GrammarError, match=re.escape(part)):
        _generate(engine, "escape", [5, 6], max_tokens=4, regex=pattern)
    out = _generate(engine, "escapes", [5, 6], max_tokens=12, regex=r"\d\w\s\x41\u0042\.")
    assert re.fullmatch(r"\d\w\s\x41\u0042\.", out.text), out.text


def test_tools_a_call_cannot_name_or_fill_are_refused(engine):
    from hibana_core.errors import ToolSchemaError

    def tool(name, parameters):
        return {"type": "function", "function": {"name": name, "parameters": parameters}}
    obj = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = engine.chat("tools")
    with pytest.raises(ToolSchemaError, match="'f' are offered twice"):
        chat.respond([{"role": "user", "content": "hi"}], [tool("f", obj), tool("f", obj)])
    with pytest.raises(ToolSchemaError, match="arguments are a JSON object"):
        chat.respond([{"role": "user", "content": "hi"}], [tool("s", {"type": "string"})], tool_choice="required")


def _nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_nested_past_the_checks_depth_is_refused_and_the_engine_serves_on(engine):
    """A json_schema (as a dict or its text), a structural tag or a tool's parameters nested 400
    levels deep ran the grammar's schema checks out of stack: a bare RecursionError from generate.
    Refused when given, saying how deep they may go (dicts and lists: a nested object is two); 60
    levels of objects still serve."""
    from hibana_core.errors import ToolSchemaError

    deep = _nested(400)
    for schema in (deep, json.dumps(deep)):
        with pytest.raises(GrammarError, match="more than 128 levels deep"):
            SamplingParams(max_tokens=4, json_schema=schema)
    with pytest.raises(GrammarError, match="structural tag nests"):
        SamplingParams(max_tokens=4, grammar={"type": "structural_tag", "format": deep})
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(ToolSchemaError, match="more than 128 levels deep"):
        engine.chat("deep").respond([{"role": "user", "content": "hi"}], [tool])
    state = engine.open_state("deep-ok")
    out = state.generate(SamplingParams(max_tokens=40, json_schema=_nested(60)), prompt=[5, 6, 7])
    assert out.text.startswith('{"a":'), out.text
    state.close()


def test_options_that_contradict_the_tool_choice_or_the_prefill_are_refused(engine):
    """A forced call beside a regex or grammar that takes the whole output, and a prefill beside a
    grammar that starts at the turn's first token (it would not see the prefill)."""
    from hibana_core.errors import ConfigError

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    chat, hi = engine.chat("options"), [{"role": "user", "content": "call f"}]
    with pytest.raises(ConfigError, match="asks for a tool call"):
        chat.respond(hi, tools, SamplingParams(max_tokens=8, regex="[0-9]+"), tool_choice="required")
    with pytest.raises(ConfigError, match="asks for a tool call"):
        chat.respond(hi, tools, SamplingParams(max_tokens=8, grammar='root ::= "no"'), tool_choice="f")
    with pytest.raises(ConfigError, match="prefill with a grammar"):
        chat.respond(hi, None, SamplingParams(max_tokens=8, json_schema={"type": "object"}), prefill='{"a": ')
    with pytest.raises(ConfigError, match="prefill with a grammar"):
        chat.respond(hi, tools, SamplingParams(max_tokens=8), prefill="<tool_call>\n", tool_choice="required")
    # with "auto" a prefill stays allowed (tests/test_chat.py forces a call by prefilling its opening)


def test_one_of_compiles_as_any_of_without_xgrammar_warning_on_stderr(capfd):
    """oneOf is held as anyOf (README); handed over as anyOf, xgrammar compiles it without its
    C++ warning, which pydantic's unions printed on stderr at every call."""
    from hibana_core.grammar import json_schema_grammar

    json_schema_grammar({"type": "object", "required": ["a"],
                         "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}}})
    assert "oneOf" not in capfd.readouterr().err


def test_a_schema_refused_for_its_keywords_prints_nothing_of_its_own(capfd):
    """unheld() compiled a schema it had already found keywords the grammar drops in, and xgrammar's
    C++ warning about them ("pattern combined with minLength/maxLength ...") reached stderr ahead of
    the refusal."""
    from hibana_core.messages import unheld

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5, "pattern": "^[a-z]+$"}}}
    assert unheld(schema)
    assert "json_schema_converter" not in capfd.readouterr().err


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_free_text_never_holds_a_stray_closing_tag(choice):
    """Free text beside hermes calls may hold anything but markup: the demo, after a tool result,
    wrote `...Lima"}}\n</tool_call>` into a LangGraph agent's final answer (a call it never
    opened, closed). The closing tag is out of the text as the opening one is; calls still close."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    tag = (tool_call_grammar(tools, "auto", SYNTAX["hermes"]) if choice == "auto"
           else no_call_grammar(HermesToolParser(), "hermes"))
    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(tag))
    assert accepts(grammar, "It is 21 degrees in Lima, see <b>this</b>.")
    assert not accepts(grammar, 'It is 21 degrees andLima"}}\n</tool_call>')
    assert accepts(grammar, 'Let me look.<tool_call>\n{"name": "lookup", "arguments": {"q": "Lima"}}\n</tool_call>') \
        == (choice == "auto")


def test_formats_the_grammar_writes_as_any_string_are_refused_when_strict():
    """idn-email, idn-hostname, iri, iri-reference and regex are formats JSON Schema defines (and
    validators check) that xgrammar holds to nothing: with strict_schema (the default) they were
    written as any string all the same, and the output failed validation. They are refused by
    name now, and left to the model without strict; formats the grammar holds, and annotations
    JSON Schema does not define (pydantic's "password"), pass."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hibana_core.grammar import UNHELD_FORMATS, check_held

    for name in UNHELD_FORMATS:  # xgrammar's own: still any string (else this list is out of date)
        assert accepts(xgrammar.Grammar.from_json_schema(json.dumps({"type": "string", "format": name})), '"z z!"')
        with pytest.raises(GrammarError, match=f"format '{name}'"):
            check_held({"type": "object", "properties": {"a": {"type": "string", "format": name}}})
    for name in ("email", "date-time", "uuid", "uri", "password"):
        check_held({"type": "string", "format": name})


def test_keywords_xgrammar_ignores_are_left_out_before_it_warns(capfd):
    """A loose schema (strict_schema=False, LangChain's strict=False) keeps keywords the grammar
    cannot hold for the model: xgrammar printed a C++ warning on stderr at every compile of a
    pydantic field with a pattern and a max_length. They are left out before it sees them."""
    from hibana_core.grammar import json_schema_grammar

    for schema in ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
                   {"type": "string", "format": "email", "minLength": 3},
                   {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}):
        json_schema_grammar(schema)
    assert "Warning" not in capfd.readouterr().err


def test_lengths_beside_a_format_xgrammar_does_not_hold_are_kept():
    """xgrammar ignores minLength/maxLength beside the formats it holds, and holds them beside any
    other (pydantic's SecretStr(min_length=8): "format": "password"): those were dropped too, and
    "ab" passed a minLength of 8."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from hibana_core.grammar import check_held, json_schema_grammar

    secret = {"type": "string", "format": "password", "minLength": 8}
    check_held(secret)  # nothing the grammar drops
    grammar = json_schema_grammar(secret)
    assert not accepts(grammar, '"ab"') and accepts(grammar, '"abcdefgh"')
    with pytest.raises(GrammarError, match="minLength beside format"):
        check_held({"type": "string", "format": "email", "minLength": 8})


def test_keywords_xgrammar_holds_on_other_keys_alone_are_refused_where_they_would_not_hold():
    """Outside audit: a pattern beside a format xgrammar holds was dropped ("3990-11-05" for ^20..);
    propertyNames and patternProperties are held on keys properties does not declare alone
    ({"a": null} where propertyNames allows "b" only). Refused where they bite; kept where not."""
    from hibana_core.grammar import check_held

    from xgrammar.testing import _is_grammar_accept_string as accepts
    import xgrammar

    date = {"type": "string", "format": "date", "pattern": "^20[0-9]{2}-"}
    assert accepts(xgrammar.Grammar.from_json_schema(json.dumps(date)), '"3990-11-05"')  # (else: out of date)
    with pytest.raises(GrammarError, match="pattern beside format"):
        check_held(date)
    with pytest.raises(GrammarError, match=r"propertyNames barring declared \['a'\]"):
        check_held({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}},
                    "propertyNames": {"enum": ["b"]}})
    with pytest.raises(GrammarError, match=r"patternProperties matching declared \['ab'\]"):
        check_held({"type": "object", "properties": {"ab": {"type": "integer"}},
                    "patternProperties": {"^a": {"type": "string"}}})
    check_held({"type": "object", "properties": {"name": {"type": "string"}}, "propertyNames": {"pattern": "^[a-z]+$"},
                "patternProperties": {"^x-": {"type": "string"}}})  # no declared key barred or matched


def test_a_regex_pythons_re_cannot_read_is_refused(engine):
    with pytest.raises(GrammarError, match="no regex Python's re reads .*bad character range"):
        _generate(engine, "bad-range", [5, 6], max_tokens=4, regex=r"[\d-z]")


def test_the_compiled_grammars_cache_is_bounded_in_bytes_too(engine, monkeypatch):
    """CACHE_SIZE bounds the count; a large vocabulary makes each grammar large, so CACHE_BYTES bounds
    their bytes as xgrammar counts them: the least recently used go first, the newest always stays."""
    import hibana_core.grammar.grammars as grammar_module  # where Grammars reads CACHE_BYTES

    grammars = engine.grammars
    monkeypatch.setattr(grammars, "_cache", type(grammars._cache)())
    monkeypatch.setattr(grammars, "_cache_bytes", 0)
    one = grammars.compile(SamplingParams(regex=r"a{1,40}b"))
    size = one.grammar.memory_size_bytes
    assert size > 0 and grammars._cache_bytes == size
    monkeypatch.setattr(grammar_module, "CACHE_BYTES", int(2.5 * size))
    for n in range(41, 47):
        grammars.compile(SamplingParams(regex=f"a{{1,{n}}}b"))
        assert grammars._cache_bytes <= grammar_module.CACHE_BYTES or len(grammars._cache) == 1
        assert grammars._cache_bytes == sum(c.grammar.memory_size_bytes for c in grammars._cache.values())
    assert 1 <= len(grammars._cache) < 7
    assert grammars.cached(SamplingParams(regex="a{1,46}b")) and not grammars.cached(SamplingParams(regex=r"a{1,40}b"))
    monkeypatch.setattr(grammar_module, "CACHE_BYTES", 1)  # smaller than any: the newest alone
    grammars.compile(SamplingParams(regex="c+"))
    assert list(grammars._cache) and len(grammars._cache) == 1


def test_llama3_auto_writes_calls_only_where_its_parser_reads_them(tmp_path):
    """Llama 3's parser reads calls at the start of the turn or after the <|python_tag|> token,
    and text then a call's JSON as content, as vLLM's llama3_json does; the "auto" grammar opened a
    call at `{"name": "` anywhere in the text, so a turn the grammar held could end with a call's
    JSON in its content, finish_reason "stop". Now: calls from the start, or text, and calls only
    after the token (the model's own way to open them mid-turn)."""
    from test_chat import LLAMA3_TEMPLATE, _llama3_checkpoint
    from tiny_models import open_engine

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    with open_engine(_llama3_checkpoint(tmp_path / "llama3", LLAMA3_TEMPLATE)) as engine:
        tok = engine.tokenizer
        eot, tag = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|python_tag|>")

        def held(*pieces) -> bool:
            grammar = tool_call_grammar(tools, "auto", SYNTAX["llama3_json"])
            matcher = engine.grammars.matcher(SamplingParams(grammar=grammar), [eot])
            ids = [i for p in pieces for i in ([tag] if p is tag else tok.encode(p, add_special_tokens=False))]
            return all(matcher.accept(t) for t in ids + [eot])

        assert held(call) and held(" \n" + call) and held(call + "\n" + call) and held("It is sunny.")
        assert held(tag, call) and held("It said:", tag, call) and held('It holds {"a": 1}.')
        assert not held("Let me check. " + call) and not held('{"name": "other"}')
    parser = Llama3JsonToolParser()
    assert [c.name for c in parser.parse(call).tool_calls] == ["get_weather"]
    assert not parser.parse("Let me check. " + call).tool_calls  # what the grammar no longer writes
