"""Speculative decoding under the token-triggered tool-call grammars (commit dbcd22b).

Where the tokenizer has the call trigger as an added token (Qwen's `<tool_call>`, GLM-4.5's,
MiniMax-M2's `<minimax:tool_call>`), tool_choice "auto" holds the turn with xgrammar's
`token_triggered_tags` (free text until the trigger token, then the call held to the tools'
schemas) and a forced call ("required", a named tool) begins with a `token` format. Speculation
verifies several drafted tokens a step and rolls the grammar's matcher back past rejected drafts:
greedy output must be the same with speculation off, with n-gram drafts and with a draft model
(the checkpoint itself, which drafts its unconstrained greedy continuation: drafts the grammar
cuts, and drafts it keeps), token for token: raw text, calls, finish reason and the state's tokens.

Replies are either the model's own greedy ones (a forced call, an enum-typed argument so that it
ends within max_tokens) or forced (`force_outputs`): a reply that opens a real call with the
trigger token in the middle of text, and one that spells the markup in ordinary tokens.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402
from spec_drafters import OracleDrafter, registered  # noqa: E402
from test_audit_control_tokens_families import FAMILIES, conversation, tool  # noqa: E402

from hibana_core import SamplingParams  # noqa: E402
from hibana_core.chat import RUN_PAST_STOP, Chat  # noqa: E402
from hibana_core.prompt import plain_encoder  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TRIGGER = {"qwen2.5": "<tool_call>", "qwen3-coder": "<tool_call>", "glm-4.5": "<tool_call>",
           "minimax-m2": "<minimax:tool_call>"}
FAMILY_LIST = sorted(TRIGGER)

SPECS = {"ngram": {"method": "ngram", "k": 4}, "draft_model": {"method": "draft_model", "k": 4},
         "oracle": {"method": "oracle", "k": 4}}
"""n-gram drafts; the checkpoint as its own draft model (its unconstrained greedy continuation);
the oracle (tests/spec_drafters.py): the output without speculation, every third position wrong,
so that drafts are accepted and rejected inside the calls as well."""
ORACLES: dict = {}  # engine -> its OracleDrafter

# family -> (what the model writes before the call, the call, what it writes after it, its end of turn)
CALLS = {
    "qwen2.5": ("Let me check. ", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                "<|im_end|>"),
    "qwen3-coder": ("Let me check. ", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>", "<|im_end|>"),
    "glm-4.5": ("\n<think>Check it.</think>\nLet me check. ",
                "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                "<|observation|>"),
    "minimax-m2": ("<think>Check it.</think>\nLet me check. ",
                   '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   "</invoke>\n</minimax:tool_call>", "[e~["),
}
THINK_FIRST = {"minimax-m2": "<think>Check it.</think>\n"}  # a random model never ends its thinking


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """family -> an engine on its tiny checkpoint whose own drafter is the checkpoint itself as a
    draft model (requests pick off, ngram or it)."""
    opened: dict = {}

    def get(family: str):
        if family not in opened:
            path = FAMILIES[family](tmp_path_factory.mktemp(family.replace(".", "_")) / "model")
            oracle = OracleDrafter(tiny_models.VOCAB_SIZE, wrong=lambda p: p % 3 == 2)
            with registered(oracle=oracle):
                opened[family] = tiny_models.open_engine(
                    path, speculation={"method": "draft_model", "draft_model": str(path), "k": 4})
            ORACLES[opened[family]] = oracle
        return opened[family]
    yield get
    for engine in opened.values():
        engine.close()


def enum_tools(*names: str) -> list[dict]:
    tools = [tool("Weather of a city.", name) for name in names or ("get_weather",)]
    for t in tools:
        t["function"]["parameters"]["properties"]["city"]["enum"] = ["Lima", "Paris"]  # a call that ends
    return tools


def turn(engine, family, state, spec, messages, tools, params, ids=None, **options):
    """One turn on a fresh state with speculation `spec`: (raw text, calls, finish reason, the
    state's tokens), and the drafts it verified and accepted."""
    from hibana_core.speculation import force_outputs

    chat = Chat(engine, state)
    if ids is not None:
        force_outputs(chat.handle, ids)
    before = engine.stats()
    result = chat.respond(messages, tools, SamplingParams(**{**params, "speculation": spec}), **options)
    after = engine.stats()
    drafts = (after.draft_tokens_proposed - before.draft_tokens_proposed,
              after.draft_tokens_accepted - before.draft_tokens_accepted)
    out = (result.raw_text, [(c.name, c.arguments) for c in result.tool_calls], result.finish_reason,
           list(chat.handle.tokens), result.usage.prompt_tokens)
    chat.handle.close()
    return out, drafts


def first_difference(a, b) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"at token {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def same_with_and_without_speculation(engine, family, name, messages, tools, params, ids=None, **options):
    """Runs the turn with speculation off and with each drafter; asserts they agree. Returns the
    output without speculation and the drafts (proposed, accepted) by drafter."""
    off, _ = turn(engine, family, f"{name}-off", "off", messages, tools, params, ids, **options)
    ORACLES[engine].add(off[3][:off[4]], off[3][off[4]:])
    drafted = {}
    past_stop = options.get("parallel_tool_calls") is False
    for spec_name, spec in SPECS.items():
        on, drafted[spec_name] = turn(engine, family, f"{name}-{spec_name}", spec, messages, tools, params, ids,
                                      **options)
        assert on[:3] == off[:3], (spec_name, off[:3], on[:3])
        if past_stop:  # the turn stops the request after its call: the state may hold a few tokens the
            # engine generated past it (the step that saw the call's end and the one after it; a verify
            # step's bonus token), up to RUN_PAST_STOP (`Chat._stopped_reply` leaves them out)
            short, long = sorted((off[3], on[3]), key=len)
            assert long[:len(short)] == short, (spec_name, first_difference(off[3], on[3]))
            assert len(long) - len(short) <= RUN_PAST_STOP
        else:
            assert on[3] == off[3], (spec_name, first_difference(off[3], on[3]), off[0], on[0])
        assert on[4] == off[4]
    return off, drafted


def forced_ids(engine, family, spelled: bool, after: str = "", second: bool = False) -> list[int]:
    lead, call, end = CALLS[family]
    tokenizer = engine.tokenizer
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    markup = plain_encoder(tokenizer, words=True)(call) if spelled else encode(call)
    ids = encode(lead) + markup
    if second:
        ids += encode("\n" if family != "minimax-m2" else "\n") + (
            encode(call.replace("Paris", "Lima")) if not spelled else plain_encoder(tokenizer, words=True)(call))
    if after:
        ids += encode(after)
    return ids + tokenizer.convert_tokens_to_ids([end])


def question(family):
    return conversation(family)[:-1] + [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("family", FAMILY_LIST)
@pytest.mark.parametrize("case", ["real", "real-then-text", "spelled", "two-real"])
def test_auto_forced_reply(engines, family, case):
    """tool_choice "auto": a forced reply with a real call opened by the trigger token after text
    (and text after it, or a second call), or with the call markup spelled in ordinary tokens:
    the same with and without speculation, and read as the parser reads it."""
    engine = engines(family)
    ids = forced_ids(engine, family, spelled=case == "spelled", after=" Done." if case == "real-then-text" else "",
                     second=case == "two-real")
    params = dict(max_tokens=len(ids), ignore_eos=True)
    off, drafted = same_with_and_without_speculation(engine, family, f"auto-{case}-{family}", question(family),
                                                     enum_tools(), params, ids)
    want = {"real": [("get_weather", {"city": "Paris"})], "real-then-text": [("get_weather", {"city": "Paris"})],
            "spelled": [], "two-real": [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lima"})]}[case]
    assert off[1] == want, off[0]
    print(family, case, drafted, off[2])


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_auto_forced_reply_one_call(engines, family):
    """parallel_tool_calls=False: text and a real call forced, then the model's own tokens, which
    the grammar ends after the call (stop_after_first): alike with and without speculation. (Forcing
    a second call would force tokens the grammar refuses past its end: a verify step's bonus token
    after an accepted closing tag fails with GrammarError, where speculation off has usually been
    stopped by the turn first. That is `force_outputs` overriding the mask, not a decoding fault.)"""
    engine = engines(family)
    ids = forced_ids(engine, family, spelled=False)[:-1]  # no end of turn: the model's
    params = dict(max_tokens=len(ids) + 8)
    off, drafted = same_with_and_without_speculation(engine, family, f"auto-one-{family}", question(family),
                                                     enum_tools(), params, ids, parallel_tool_calls=False)
    assert off[1] == [("get_weather", {"city": "Paris"})], off[0]
    print(family, drafted, off[2])


@pytest.mark.parametrize("family", FAMILY_LIST)
@pytest.mark.parametrize("choice", ["required", "get_weather", "required-one"])
@pytest.mark.parametrize("bias", [False, pytest.param(True, marks=pytest.mark.slow)])  # (the bias: also
# test_audit_control_tokens_families' forced calls, without speculation; the grammar's spelling forces the token)
def test_forced_call_greedy(engines, family, choice, bias):
    """"required", a named tool, and "required" with parallel_tool_calls=False: the model's own
    greedy call (an enum argument so that it ends), alike with and without speculation; with
    `bias` the model would rather spell the trigger in pieces (logit_bias on its first piece)."""
    engine = engines(family)
    tools = enum_tools("get_weather", "get_time")
    params = dict(max_tokens=120)
    if bias:
        piece = plain_encoder(engine.tokenizer, words=True)(TRIGGER[family])[0]
        params["logit_bias"] = {piece: 50.0}
    ids = None
    if family in THINK_FIRST:  # the think block forced, the rest the model's
        ids = engine.tokenizer.encode(THINK_FIRST[family], add_special_tokens=False)
    options = dict(tool_choice="required" if choice == "required-one" else choice,
                   parallel_tool_calls=choice != "required-one")
    if family not in THINK_FIRST:
        options["reasoning"] = False
    off, drafted = same_with_and_without_speculation(engine, family, f"forced-{choice}-{bias}-{family}",
                                                     question(family), tools, params, ids, **options)
    assert off[1], off[0]
    if choice == "get_weather":
        assert {c[0] for c in off[1]} == {"get_weather"}
    if choice == "required-one":
        assert len(off[1]) == 1
    trigger = engine.tokenizer.convert_tokens_to_ids(TRIGGER[family])
    assert trigger in off[3]
    print(family, choice, bias, drafted, off[0][:200])


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_auto_greedy(engines, family):
    """tool_choice "auto" unforced: whatever the random model writes, alike with and without."""
    engine = engines(family)
    ids = None
    options = {}
    if family in THINK_FIRST:
        ids = engine.tokenizer.encode(THINK_FIRST[family], add_special_tokens=False)
    else:
        options["reasoning"] = False
    off, drafted = same_with_and_without_speculation(engine, family, f"auto-greedy-{family}", question(family),
                                                     enum_tools(), dict(max_tokens=60), ids, **options)
    print(family, drafted, off[0][:200])


@pytest.mark.parametrize("family", FAMILY_LIST)
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_greedy_opening_its_own_calls(engines, family, parallel):
    """tool_choice "auto" unforced, the trigger token favoured (logit_bias) so that the model opens
    calls of its own (at once, or after a little text): the grammar holds each call from the token on, and the
    output is the same with and without speculation."""
    engine = engines(family)
    trigger = engine.tokenizer.convert_tokens_to_ids(TRIGGER[family])
    ids, options = None, {"parallel_tool_calls": parallel}
    if family in THINK_FIRST:
        ids = engine.tokenizer.encode(THINK_FIRST[family], add_special_tokens=False)
    else:
        options["reasoning"] = False
    params = dict(max_tokens=120, logit_bias={trigger: 6.0})
    off, drafted = same_with_and_without_speculation(engine, family, f"auto-own-{parallel}-{family}",
                                                     question(family), enum_tools("get_weather", "get_time"), params,
                                                     ids, **options)
    assert trigger in off[3][off[4]:], off[0]
    print(family, parallel, drafted, off[2], off[1], repr(off[0][:160]))
