"""Audit: token-triggered tool calls (dbcd22b, 5fcb3b6) through the HTTP server and the real
clients, for the XML-style families (Qwen3-Coder, GLM-4.5, Seed-OSS, MiniMax-M2).

Each family's tiny checkpoint carries its real chat template and markup words
(tests/test_audit_control_tokens_families.py). The state a request is served on is named with the
X-Hibana-State header and its next generation forced (`force_outputs`), so that the random model
writes: (a) a real call (the markup words' tokens), (b) the same call spelled in ordinary tokens
(a quote: no call), (c) text, then a real call, (d) two real calls. The reasoning families (GLM-4.5,
Seed-OSS, MiniMax-M2) think first: a short think block leads every reply. For each, the whole
reply and the streamed one (`stream=True`, the deltas joined) must agree, with tool_choice "auto",
with parallel_tool_calls=False (one call kept), with logprobs and top_logprobs, and with n=2 (each
choice's state forced as it is leased); Anthropic's Messages endpoint for (a) and (b) too.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402
from test_audit_control_tokens_families import FAMILIES, conversation, tools_for  # noqa: E402

from hibana_core.prompt import plain_encoder  # noqa: E402
from hibana_core.speculation import force_outputs  # noqa: E402
from hibana_plugins.openai_api import STATE_HEADER  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _call(family: str, city: str) -> str:
    return {
        "qwen3-coder": f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n"
                       "</tool_call>",
        "glm-4.5": f"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{city}</arg_value>\n</tool_call>",
        "seed-oss": f"<seed:tool_call>\n<function=get_weather>\n<parameter=city>{city}</parameter>\n</function>\n"
                    "</seed:tool_call>",
        "minimax-m2": f'<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">{city}</parameter>\n'
                      "</invoke>\n</minimax:tool_call>",
    }[family]


def _two_calls(family: str) -> str:
    if family == "minimax-m2":  # a turn's calls in one block
        return ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                '</invoke>\n<invoke name="get_weather">\n<parameter name="city">Lima</parameter>\n</invoke>\n'
                "</minimax:tool_call>")
    return _call(family, "Paris") + "\n" + _call(family, "Lima")


THINK = {"qwen3-coder": "", "glm-4.5": "\n<think>Check it.</think>\n", "seed-oss": "<seed:think>Check it.</seed:think>",
         "minimax-m2": "Check it.</think>\n"}  # (its generation prompt opens <think>)
END = {"qwen3-coder": "<|im_end|>", "glm-4.5": "<|observation|>", "seed-oss": "<seed:eos>", "minimax-m2": "[e~["}
# a forced call follows what the template writes after a think block (`Chat.answer_gap`: Seed-OSS's
# newline, MiniMax-M2's blank line, then the newline it writes before its block of calls)
FORCED_THINK = {**THINK, "seed-oss": "<seed:think>Check it.</seed:think>\n", "minimax-m2": "Check it.</think>\n\n\n"}
REASONING = {"qwen3-coder": None, "glm-4.5": "Check it.", "seed-oss": "Check it.", "minimax-m2": "Check it."}
XML_FAMILIES = sorted(THINK)
LEAD = "Let me check. "
PARIS = ("get_weather", {"city": "Paris"})
LIMA = ("get_weather", {"city": "Lima"})


def case_ids(tokenizer, family: str, case: str) -> list[int]:
    """The tokens the model is made to write for `case`."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    think = encode((FORCED_THINK if case == "forced" else THINK)[family])
    if case in ("real", "forced"):
        body = encode(_call(family, "Paris"))
    elif case == "spelled":
        body = encode("The tool said: ") + plain_encoder(tokenizer, words=True)(_call(family, "Paris"))
    elif case == "text_then_call":
        body = encode(LEAD + _call(family, "Paris"))
    else:
        body = encode(_two_calls(family))
    return think + body + tokenizer.convert_tokens_to_ids([END[family]])


def expected(family: str, case: str, parallel: bool = True) -> tuple:
    """(content, calls, finish_reason) the reply must have."""
    if case in ("real", "forced"):
        return None, [PARIS], "tool_calls"
    if case == "spelled":
        return "The tool said: " + _call(family, "Paris"), [], "stop"
    if case == "text_then_call":
        return LEAD.strip(), [PARIS], "tool_calls"
    return None, [PARIS, LIMA] if parallel else [PARIS], "tool_calls"


CASES = ["real", "spelled", "text_then_call", "two_calls"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """family -> (engine, url) on its tiny checkpoint, opened on first use."""
    opened: dict = {}
    with contextlib.ExitStack() as stack:
        def get(family: str):
            if family not in opened:
                path = FAMILIES[family](tmp_path_factory.mktemp(family.replace(".", "_")) / "model")
                engine = stack.enter_context(tiny_models.open_engine(path))
                url = stack.enter_context(serving(engine, ServerConfig("tiny")))
                opened[family] = engine, url
            return opened[family]
        yield get


def messages_for(family: str) -> list[dict]:
    wire = []
    for m in conversation(family)[:-1] + [{"role": "user", "content": "Weather in Paris and Lima?"}]:
        m = {k: v for k, v in m.items() if k != "reasoning_content"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        wire.append(m)
    return wire


def whole(reply) -> dict:
    choice = reply.choices[0]
    message = choice.message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    logprobs = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in choice.logprobs.content] \
        if choice.logprobs and choice.logprobs.content else None
    return {"content": message.content or None, "reasoning": getattr(message, "reasoning_content", None) or None,
            "calls": calls, "finish": choice.finish_reason, "logprobs": logprobs,
            "ids": [c.id for c in message.tool_calls or []]}


def streamed(chunks, index: int = 0) -> dict:
    content, reasoning, calls, finish, logprobs, ids = "", "", {}, None, [], {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.id:
                    ids[call.index] = call.id
                if call.function and call.function.name:
                    entry[0] += call.function.name
                if call.function and call.function.arguments:
                    entry[1] += call.function.arguments
            if choice.logprobs and choice.logprobs.content:
                logprobs += [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in choice.logprobs.content]
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))],
            "finish": finish, "logprobs": logprobs or None, "ids": [ids.get(i) for i in sorted(calls)]}


def ask(engine, url, family: str, case: str, state: str, stream: bool, **options):
    ids = case_ids(engine.tokenizer, family, case)
    force_outputs(engine.open_state(state), ids)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=messages_for(family), tools=tools_for(family),
                                           max_tokens=len(ids), stream=stream,
                                           extra_headers={STATE_HEADER: state}, **options)
    return streamed(list(reply)) if stream else whole(reply)


def check(got: dict, family: str, case: str, parallel: bool = True) -> None:
    content, calls, finish = expected(family, case, parallel)
    assert (got["content"], got["calls"], got["finish"]) == (content, calls, finish), got
    assert got["reasoning"] == REASONING[family], got
    assert all(got["ids"]) and len(set(got["ids"])) == len(got["ids"]), got


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", XML_FAMILIES)
def test_whole_and_streamed_replies_agree(served, family, case):
    engine, url = served(family)
    whole_reply = ask(engine, url, family, case, f"{family}-{case}-whole", stream=False)
    stream_reply = ask(engine, url, family, case, f"{family}-{case}-stream", stream=True)
    check(whole_reply, family, case)
    check(stream_reply, family, case)


@pytest.mark.parametrize("case", ["real", "spelled", "text_then_call"])
@pytest.mark.parametrize("family", XML_FAMILIES)
def test_parallel_tool_calls_off(served, family, case):
    engine, url = served(family)
    for stream in (False, True):
        got = ask(engine, url, family, case, f"{family}-{case}-one-{stream}", stream=stream, parallel_tool_calls=False)
        check(got, family, case, parallel=False)


def first_call_only(tokenizer, family: str) -> list[int]:
    """Case (d)'s tokens up to the end of its first call (a second would be a token the grammar masks:
    forced, it is the request's grammar error, which no model can meet)."""
    text = THINK[family] + _two_calls(family)
    cut = {"minimax-m2": "</invoke>\n"}.get(family, _call(family, "Paris"))
    return tokenizer.encode(text[:text.index(cut) + len(cut)], add_special_tokens=False)


@pytest.mark.parametrize("family", XML_FAMILIES)
def test_parallel_tool_calls_off_ends_the_turn_after_the_first_call(served, family):
    """parallel_tool_calls=False under the token-triggered grammar: the model writes a first call
    (forced), then goes on by itself, held by the grammar: the turn ends there, one call."""
    engine, url = served(family)
    ids = first_call_only(engine.tokenizer, family)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        state = f"{family}-first-only-{stream}"
        force_outputs(engine.open_state(state), ids)
        reply = client.chat.completions.create(model="tiny", messages=messages_for(family), tools=tools_for(family),
                                               max_tokens=len(ids) + 24, stream=stream, parallel_tool_calls=False,
                                               extra_headers={STATE_HEADER: state})
        got = streamed(list(reply)) if stream else whole(reply)
        check(got, family, "real", parallel=False)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("family", XML_FAMILIES)
def test_forced_tool_choice(served, family, tool_choice):
    """A forced call (begun by the markup token) written by the model: whole and streamed agree."""
    engine, url = served(family)
    for stream in (False, True):
        got = ask(engine, url, family, "forced", f"{family}-forced-{json.dumps(tool_choice)}-{stream}", stream=stream,
                  tool_choice=tool_choice)
        check(got, family, "forced")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", XML_FAMILIES)
def test_logprobs_whole_and_streamed_agree(served, family, case):
    engine, url = served(family)
    got = [ask(engine, url, family, case, f"{family}-{case}-lp-{stream}", stream=stream, logprobs=True,
               top_logprobs=2) for stream in (False, True)]
    for reply in got:
        check(reply, family, case)
        assert reply["logprobs"] and all(len(top) == 2 for _, _, top in reply["logprobs"])
    assert [t for t, _, _ in got[0]["logprobs"]] == [t for t, _, _ in got[1]["logprobs"]]
    assert [lp for _, lp, _ in got[0]["logprobs"]] == pytest.approx([lp for _, lp, _ in got[1]["logprobs"]], abs=1e-4)
    # every generated token has its entry, the call markup's included
    assert len(got[0]["logprobs"]) == len(case_ids(engine.tokenizer, family, case)) - 1  # (not the end token)


@contextlib.contextmanager
def every_lease_forced(engine, ids):
    """Each state the engine leases meanwhile (each of n choices' own) writes `ids` next."""
    lease = engine.lease

    @contextlib.contextmanager
    def forced(*args, **kwargs):
        with lease(*args, **kwargs) as handle:
            force_outputs(handle, ids)
            yield handle
    engine.lease = forced
    try:
        yield
    finally:
        del engine.lease


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", XML_FAMILIES)
def test_two_choices(served, family, case):
    engine, url = served(family)
    ids = case_ids(engine.tokenizer, family, case)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with every_lease_forced(engine, ids):
        asked = dict(model="tiny", messages=messages_for(family), tools=tools_for(family), max_tokens=len(ids), n=2)
        reply = client.chat.completions.create(**asked)
        chunks = list(client.chat.completions.create(**asked, stream=True))
    assert len(reply.choices) == 2
    for index in (0, 1):
        choice = reply.choices[index]
        message = choice.message
        got = {"content": message.content or None, "reasoning": getattr(message, "reasoning_content", None) or None,
               "calls": [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []],
               "finish": choice.finish_reason, "ids": [c.id for c in message.tool_calls or []]}
        check(got, family, case)
        check(streamed(chunks, index), family, case)


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city.",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]}}]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", XML_FAMILIES)
def test_anthropic_messages(served, family, case):
    engine, url = served(family)
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    ids = case_ids(engine.tokenizer, family, case)
    content, calls, finish = expected(family, case)

    def blocks(message):
        return [(b.type, b.text if b.type == "text" else (b.name, b.input) if b.type == "tool_use" else b.thinking)
                for b in message.content]
    want = ([("thinking", REASONING[family])] if REASONING[family] else []) \
        + ([("text", content)] if content else []) + [("tool_use", c) for c in calls]
    asked = dict(model="tiny", max_tokens=len(ids), tools=ANTHROPIC_TOOLS,
                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    force_outputs(engine.open_state(f"a-{family}-{case}-whole"), ids)
    message = client.messages.create(**asked, extra_headers={STATE_HEADER: f"a-{family}-{case}-whole"})
    assert blocks(message) == want
    assert message.stop_reason == ("tool_use" if calls else "end_turn")
    force_outputs(engine.open_state(f"a-{family}-{case}-stream"), ids)
    with client.messages.stream(**asked, extra_headers={STATE_HEADER: f"a-{family}-{case}-stream"}) as stream:
        final = stream.get_final_message()
    assert blocks(final) == want and final.stop_reason == message.stop_reason


@pytest.mark.parametrize("family", ["qwen3-coder", "seed-oss"])
def test_a_value_spelling_call_markup_stays_the_value(served, family):
    """5fcb3b6 through the server: a real call whose value spells the block's markup in ordinary
    tokens is one call with that value, whole and streamed (its arguments joined from the deltas)."""
    from test_markup_tokens_inside_calls import SPELLED_MARKUP, XML_CALLS

    engine, url = served(family)
    tokenizer = engine.tokenizer
    _, opening, closing, end = XML_CALLS[family]
    value = SPELLED_MARKUP[family]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = (encode(THINK[family]) + encode(opening) + plain_encoder(tokenizer, words=True)(value) + encode(closing)
           + tokenizer.convert_tokens_to_ids([end]))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        state = f"{family}-value-{stream}"
        force_outputs(engine.open_state(state), ids)
        reply = client.chat.completions.create(model="tiny", messages=messages_for(family), tools=tools_for(family),
                                               max_tokens=len(ids), stream=stream, extra_headers={STATE_HEADER: state})
        got = streamed(list(reply)) if stream else whole(reply)
        assert (got["content"], got["calls"], got["finish"]) == (None, [("get_weather", {"city": value})],
                                                                 "tool_calls"), got
