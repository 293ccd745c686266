"""The qwen3_coder tool parser: Qwen3-Coder's XML calls, typed by the tools' schemas, read alike
whole and streamed, chosen by the chat template, and held to the tools by its grammar."""

from __future__ import annotations

import json
import random

import pytest

from hibana_plugins.hookspecs import CutCall, ToolCallDelta
from hibana_plugins.qwen_xml import QwenXmlToolParser, typed_value
from parser_cases import streamed

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "metric": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
        "zip": {"type": "string"}, "unit": {"type": ["string", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "required": ["city"]}}}


def call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder's template writes one."""
    lines = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{lines}</function>\n</tool_call>"


@pytest.mark.parametrize("text, schema, value", [
    ("007", {"type": "string"}, "007"),          # a string keeps what it spells
    ("true", {"type": "string"}, "true"),
    ("3", {"type": "integer"}, 3),
    ("3.0", {"type": "integer"}, 3),
    ("2.5", {"type": "number"}, 2.5),
    ("7", {"type": "number"}, 7),
    ("True", {"type": "boolean"}, True),         # the template writes Python's spelling (`| string`)
    ("false", {"type": "boolean"}, False),
    ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
    ("{'a': 'b'}", {"type": "object"}, {"a": "b"}),  # a Python literal, as models write one at times
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("null", {"type": ["string", "null"]}, None),
    ("None", {"type": ["string", "null"]}, None),
    ("Paris", {"type": ["string", "null"]}, "Paris"),
    ("12", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 12),
    ("twelve", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "twelve"),
    ("2", {"enum": [1, 2, 3]}, 2),
    ("work\r", {"type": "string", "enum": ["work", "gym"]}, "work"),  # the grammar's whitespace around it
    (" a ", {"type": "string", "enum": [" a ", "a"]}, " a "),
    ("many", {"type": "integer"}, "many"),       # text not of its type stays text
    ("1e999", {"type": "number"}, "1e999"),      # past a float's range: no JSON number
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("3", None, "3"),                            # a parameter the schema does not declare
])
def test_a_value_is_typed_by_its_schema(text, schema, value):
    got = typed_value(text, schema)
    assert got == value and type(got) is type(value)


TEXTS = [
    "Let me look.\n\n" + call("get_weather", city="Paris", days="3", metric="True", options='{"a": 1}', zip="007")
    + "\n" + call("get_weather", city="Lima\nPeru", tags='["x", "y"]'),
    "no calls at all, only <tool text and a </tool_call> ending",
    call("get_weather", city="Oslo") + " then text after <tool_call",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo",                         # cut inside a value
    call("get_weather", city="Rome")[:-5],                                               # cut in </tool_call>
    call("get_weather", city="Rome").replace("</tool_call>", ""),                        # no </tool_call> at all
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n<parameter=days>\n2\n</parameter>\n</function>\n"
    "</tool_call>",                                                                      # a </parameter> left out
    "<tool_call>\nnot xml\n</tool_call> " + call("get_weather", city="B"),               # malformed, then a call
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "C"}}\n</tool_call>',   # the hermes form
]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_says_what_parsing_says_for_any_chunking(text):
    parser = QwenXmlToolParser()
    whole = parser.parse(text, [WEATHER])
    rng = random.Random(7)
    chunkings = [[text], list(text)] + [[text[i:i + n] for i in range(0, len(text), n)] for n in (2, 3, 5, 11)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for chunks in chunkings:
        pieces, calls, output = streamed(parser, chunks, [WEATHER])
        assert "".join(pieces) == output.content == whole.content
        assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in output.tool_calls]
        assert [(c.name, c.arguments) for c in output.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert output.error == whole.error


def test_calls_are_read_and_typed():
    parser = QwenXmlToolParser()
    out = parser.parse(TEXTS[0], [WEATHER])
    assert out.content == "Let me look." and out.error is None
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True, "options": {"a": 1}, "zip": "007"}),
        ("get_weather", {"city": "Lima\nPeru", "tags": ["x", "y"]})]
    assert len({c.id for c in out.tool_calls}) == 2
    # without the tools, every value is the text the model wrote
    assert parser.parse(TEXTS[0]).tool_calls[0].arguments["days"] == "3"
    # a block cut before its </function> is a cut call: content, with the error said
    cut = parser.parse(TEXTS[3], [WEATHER])
    assert cut.tool_calls == [] and cut.content == TEXTS[3] and "unclosed <tool_call>" in cut.error
    stream = parser.stream([WEATHER])
    stream.feed(TEXTS[3])
    assert [type(p) for p in stream.close()] == [CutCall]
    # cut inside </tool_call>, or without it: the call is whole
    for text in TEXTS[4:6]:
        assert [(c.name, c.arguments) for c in parser.parse(text, [WEATHER]).tool_calls] == [
            ("get_weather", {"city": "Rome"})]
    assert parser.parse(TEXTS[6], [WEATHER]).tool_calls[0].arguments == {"city": "A", "days": 2}
    malformed = parser.parse(TEXTS[7], [WEATHER])
    assert [c.arguments for c in malformed.tool_calls] == [{"city": "B"}]
    assert malformed.content == "<tool_call>\nnot xml\n</tool_call>" and "<function=NAME>" in malformed.error
    assert parser.parse(TEXTS[8], [WEATHER]).tool_calls[0].arguments == {"city": "C"}


@pytest.mark.parametrize("body, error", [
    ("<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>", "given twice"),
    ("<function=f>\nstray\n<parameter=a>\n1\n</parameter>\n</function>", "text outside a parameter"),
    ("<function=>\n</function>", "function name"),
    ("<function=f>\n<parameter=>\n1\n</parameter>\n</function>", "needs a name"),
    ("<function=f>\n</function>\nafter", "nothing else"),
])
def test_malformed_calls_stay_content_with_the_error_said(body, error):
    text = f"<tool_call>\n{body}\n</tool_call>"
    out = QwenXmlToolParser().parse(text)
    assert out.tool_calls == [] and out.content == text and error in out.error


@pytest.mark.parametrize("tools", [[WEATHER], None])
def test_a_cut_calls_arguments_are_the_json_its_whole_call_sends_so_far(tools):
    """A call max_tokens cut (what LangChain reports as an invalid call, and a structured answer as its
    content) has the arguments it had begun as JSON text, as a cut hermes call has: they were the
    parameters' markup ("<parameter=days>\\n1"). At every cut, taken as the stream gives it (its `CutCall`),
    they begin the JSON the whole call sends, each value typed by the schema as the whole call's (1, not
    "1"; text where no tools type them); a cut in </function> has them whole."""
    parser = QwenXmlToolParser()
    whole = call("get_weather", city="Lima\nPeru", days="12", options='{"a": [1, 2]}', metric="True", zip="007")
    stream = parser.stream(tools)
    sent = "".join(p.arguments_fragment for p in stream.feed(whole) + stream.close() if isinstance(p, ToolCallDelta))
    assert json.loads(sent) == ({"city": "Lima\nPeru", "days": 12, "options": {"a": [1, 2]}, "metric": True,
                                 "zip": "007"} if tools else
                                {"city": "Lima\nPeru", "days": "12", "options": '{"a": [1, 2]}', "metric": "True",
                                 "zip": "007"})
    closed = whole.index("</function>") + len("</function>")
    begun = whole.index("\n<parameter=")
    for n in range(len("<tool_call>"), closed):
        stream = parser.stream(tools)
        (cut,) = [p for p in stream.feed(whole[:n]) + stream.close() if isinstance(p, CutCall)]
        name, arguments = parser.cut_call_parts(cut, tools)
        assert "get_weather".startswith(name) and sent.startswith(arguments), (whole[:n], name, arguments)
        assert (arguments == "") == (n <= begun + 1), (whole[:n], arguments)  # "{" once a parameter's tag began
    assert arguments == sent
    at = whole.index("days>\n1") + len("days>\n1")
    assert parser.cut_call_parts(whole[:at], tools) == (
        "get_weather", '{"city": "Lima\\nPeru", "days": ' + ("1" if tools else '"1'))
    assert parser.cut_call_parts(whole[:whole.index("metric>\nTr") + 10], tools)[1].endswith(
        '"metric": ' if tools else '"metric": "Tr')  # a boolean's value once it is one


# --- end to end, on a tiny Qwen3-Coder checkpoint ---------------------------------------------------

TOOL = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm.",
    "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "loud": {"type": "boolean"},
        "label": {"type": "string", "enum": ["work", "gym"]}},
        "required": ["hour", "label"]}}}


def test_the_template_picks_the_parser_and_a_call_round_trips(coder):
    """Qwen3-Coder's template writes `<function=...>` calls: the chat layer reads them with
    qwen3_coder unasked (hermes read them as text), types the values by the tool's schema, streams
    what it returns, and the call re-rendered in the next turn's history is what the model wrote,
    so that turn reuses the whole state."""
    from hibana_core import SamplingParams
    from hibana_core.chat import Chat, assistant_message
    from hibana_core.speculation import force_outputs
    from test_chat import streamed_turn

    tokenizer = coder.tokenizer
    written = call("set_alarm", hour="7", label="gym")  # (a boolean's `true` would re-render as Python's True)
    ids = tokenizer.encode(written, add_special_tokens=False) + tokenizer.convert_tokens_to_ids(["<|im_end|>"])
    want = [("set_alarm", {"hour": 7, "label": "gym"})]
    messages = [{"role": "user", "content": "Wake me at 7 for the gym."}]
    for n, stream in enumerate((False, True)):
        chat = Chat(coder, f"coder-{n}")
        assert chat.parser_name == "qwen3_coder"
        force_outputs(chat.handle, ids)
        params = SamplingParams(max_tokens=len(ids))
        if stream:
            text, calls, result = streamed_turn(list(chat.stream_respond(messages, [TOOL], params)))
            assert (text, [(name, args) for _, name, args in calls]) == ("", want)
        else:
            result = chat.respond(messages, [TOOL], params)
        assert [(c.name, c.arguments) for c in result.tool_calls] == want and result.finish_reason == "tool_calls"
    history = messages + [assistant_message(result),
                          {"role": "tool", "tool_call_id": result.tool_calls[0].id, "content": "set"}]
    again = chat.respond(history, [TOOL], SamplingParams(max_tokens=2))
    assert again.usage.cached_tokens >= result.usage.prompt_tokens + result.usage.completion_tokens - 1


@pytest.mark.parametrize("tool_choice", ["required", "set_alarm"])
def test_the_grammar_holds_calls_to_the_tool_and_its_schema(coder, tool_choice):
    """A random model held by the grammar writes a call the parser reads, its values of the
    schema's types and within its bounds."""
    from hibana_core import SamplingParams
    from hibana_core.chat import Chat

    for seed in range(3):
        result = Chat(coder, f"held-{tool_choice}-{seed}").respond(
            [{"role": "user", "content": "alarm"}], [TOOL],
            SamplingParams(max_tokens=400, temperature=1.0, seed=seed), tool_choice=tool_choice)
        assert result.tool_calls, (result.text, result.finish_reason)
        for c in result.tool_calls:
            assert c.name == "set_alarm" and c.arguments["label"] in ("work", "gym")
            assert type(c.arguments["hour"]) is int and 0 <= c.arguments["hour"] <= 23
            assert type(c.arguments.get("loud", False)) is bool


def test_langchain_reports_a_cut_call_alike_streamed_and_invoked(coder):
    """A call max_tokens cut, through LangChain: the invalid call's args, and a structured answer's
    content (json_schema: the call's arguments are the answer), streamed and invoked alike, are the
    arguments begun as JSON text ('{"n": 1'), never the parameters' markup ("<parameter=n>\\n1")."""
    from langchain_core.messages import HumanMessage

    from hibana_core.speculation import force_outputs
    from hibana_plugins.langchain import ChatHibana

    text = call("w", n="12")
    ids = coder.tokenizer.encode(text, add_special_tokens=False)
    cut_at = len(coder.tokenizer.encode(text[:text.index("12") + 1], add_special_tokens=False))
    llm = ChatHibana(engine=coder, max_tokens=cut_at)
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    answer = llm.with_structured_output({"title": "w", **tool["function"]["parameters"]}, method="json_schema").first
    messages = [HumanMessage("n")]
    for n, runnable in enumerate((llm.bind_tools([tool], tool_choice="w"), answer)):
        force_outputs(coder.open_state(f"lc-cut-{n}"), ids)
        reply = runnable.invoke(messages, state_id=f"lc-cut-{n}")
        force_outputs(coder.open_state(f"lc-cut-{n}"), ids)
        chunks = list(runnable.stream(messages, state_id=f"lc-cut-{n}"))
        streamed = sum(chunks[1:], chunks[0])
        assert reply.response_metadata["finish_reason"] == "length" and not reply.tool_calls
        if runnable is answer:
            assert reply.content == streamed.content == '{"n": 1'
        else:
            assert [(c["name"], c["args"]) for c in reply.invalid_tool_calls] == [("w", '{"n": 1')]
            assert not streamed.tool_calls and streamed.content == ""
