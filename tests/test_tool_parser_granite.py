"""The "granite" tool parser: IBM Granite 3.x's `<|tool_call|>` control token, then a JSON array
of call objects; read as "mistral"'s array form, with OpenAI-style ids; its grammar; and the chat
layer picking it for a Granite-like chat template."""

from __future__ import annotations

import json
import random
import re

import pytest

from hibana_core import SamplingParams
from hibana_core.chat import Chat, _template_parser
from hibana_plugins.hookspecs import GeneratedText, ToolCallDelta
from hibana_plugins.manager import get_plugin_manager
from hibana_plugins.tool_parsers import GraniteToolParser

CALLS = (
    'Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "note": "] <|tool_call|> }"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": [2]}, "id": "abcDEF123"}]'
)
TEXTS = [
    CALLS,
    '<|tool_call|>[{"name": "f", "arguments": {}}]',
    '<|tool_call|>{"name": "f", "arguments": {"a": 1}}',  # one object, no array
    '<|tool_call|> [{"name": "ok", "arguments": {}}, {"name": "bad", "arguments": {"q": }}] tail',
    '<|tool_call|>[{"name": "f", "arguments": "hello"}]',
    '<|tool_call|>f[ARGS]{"a": 1}',  # Mistral's named form is no Granite call
    '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}',  # cut: calls kept
    "No calls here, <|tool_call but not the marker.",
]

GRANITE_MARKERS = ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"]
GRANITE_TEMPLATE = """{{- bos_token if bos_token else "" }}
{%- if tools %}{{- "<|start_of_role|>available_tools<|end_of_role|>" + tools|tojson + "<|end_of_text|>" }}{%- endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}
{{- "<|start_of_role|>assistant<|end_of_role|><|tool_call|>" + m.tool_calls|map(attribute="function")|list|tojson + eos_token }}
{%- elif m.role == "tool" %}{{- "<|start_of_role|>tool_response<|end_of_role|>" + m.content + "<|end_of_text|>" }}
{%- else %}{{- "<|start_of_role|>" + m.role + "<|end_of_role|>" + m.content + eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_of_role|>assistant<|end_of_role|>" }}{%- endif %}"""
"""Granite 3.x's template as far as calls go: `<|tool_call|>` then the calls as a JSON array."""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                                          "required": ["city"]}}}


def streamed(parser, chunks):
    """The content and calls (id, name, arguments) a stream gives for `chunks`, and its result."""
    stream, text, calls = parser.stream(), [], {}
    for piece in [p for chunk in chunks for p in stream.feed(chunk)] + stream.close():
        if isinstance(piece, ToolCallDelta):
            call = calls.setdefault(piece.index, [None, None, ""])
            call[0], call[1] = piece.id or call[0], piece.name or call[1]
            call[2] += piece.arguments_fragment
        else:
            text.append(str(piece))
    return "".join(text), [(i, n, json.loads(a)) for i, n, a in calls.values()], stream.finish()


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_char_by_char_and_at_random_cuts_is_the_whole_parse(text):
    parser, rng = GraniteToolParser(), random.Random(5)
    whole = parser.parse(text)
    chunkings = [list(text), [text]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), 4))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for chunks in chunkings:
        content, calls, output = streamed(parser, chunks)
        assert content == output.content == whole.content and output.error == whole.error
        assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert calls == [(c.id, c.name, c.arguments) for c in output.tool_calls]  # ids too


def test_text_before_several_calls_with_openai_ids():
    output = GraniteToolParser().parse(CALLS)
    assert output.content == "Let me check." and output.error is None
    assert [(c.name, c.arguments) for c in output.tool_calls] == [
        ("get_weather", {"city": "Paris", "note": "] <|tool_call|> }"}), ("add", {"a": 1, "b": [2]})]
    ids = [c.id for c in output.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2  # not Mistral's 9


@pytest.mark.parametrize("text, error", [
    ('<|tool_call|>[{"name": "f", "arguments": {"a": }}]', "invalid JSON"),
    ('<|tool_call|>[{"name": "f", "arguments": [1]}]', "must be a JSON object"),
    ("<|tool_call|>", "without its calls"),
    ('<|tool_call|>f[ARGS]{"a": 1}', "JSON array of call objects"),
    ('<|tool_call|>["f"]', "call objects only"),
])
def test_malformed_calls_stay_content_with_an_error(text, error):
    output = GraniteToolParser().parse(text)
    assert output.tool_calls == [] and output.content == text and error in output.error


def test_the_marker_spelled_by_ordinary_tokens_is_content():
    """`<|tool_call|>` is a control token: spelled by ordinary tokens (quoting a tool result) it
    is text, whole or streamed; where the model generated the token, a call."""
    quoted = 'It says <|tool_call|>[{"name": "rm", "arguments": {}}] there'
    spelled = GraniteToolParser().parse(GeneratedText(quoted, ()))
    assert spelled.tool_calls == [] and spelled.content == quoted and spelled.error is None
    stream = GraniteToolParser().stream()
    pieces = [p for i in range(len(quoted)) for p in stream.feed(GeneratedText(quoted[i], ()))] + stream.close()
    assert "".join(pieces) == quoted
    real = GraniteToolParser().parse(GeneratedText(quoted, ((8, 21),)))
    assert [c.name for c in real.tool_calls] == ["rm"] and real.content == "It says  there"


def test_registered_and_picked_for_a_granite_template():
    assert isinstance(get_plugin_manager().lookup("tool_parser", "granite"), GraniteToolParser)
    vocab = {marker: i for i, marker in enumerate(GRANITE_MARKERS)}
    assert _template_parser(GRANITE_TEMPLATE, vocab) == "granite"
    assert _template_parser(GRANITE_TEMPLATE, {}) == "hermes"  # the token is no token of the tokenizer
    assert _template_parser(GRANITE_TEMPLATE + "<tool_call>", vocab) == "hermes"


def test_the_grammar_compiles_and_holds_calls_to_the_offered_tools():
    """The structural tag compiles with xgrammar on a tokenizer that has `<|tool_call|>` as a
    special token, reached as that token only, and holds the calls to the offered tools' names
    and schemas."""
    import tiny_models
    import xgrammar as xgr

    from hibana_core.grammar import Grammars

    tokenizer = tiny_models.make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": GRANITE_MARKERS})
    marker = tokenizer.get_vocab()["<|tool_call|>"]
    grammars = Grammars(tokenizer, len(tokenizer), [tiny_models.EOS_ID], "cpu")
    for choice, parallel in (("required", True), ("get_weather", False)):
        tag = GraniteToolParser().tool_call_grammar([WEATHER, {"type": "function", "function": {"name": "now"}}],
                                                    choice, parallel)
        compiled = grammars.compile(SamplingParams(grammar=tag)).grammar

        def accepts(token: int | None, text: str) -> bool:
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            return (token is None or matcher.accept_token(token)) and matcher.accept_string(text) \
                and matcher.is_completed()
        call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        assert accepts(marker, f"[{call}]")
        assert accepts(marker, f"[{call}, {call}]") == parallel
        assert not accepts(None, f"<|tool_call|>[{call}]")  # the marker spelled by ordinary tokens
        assert not accepts(marker, '[{"name": "rm", "arguments": {}}]')  # no offered tool
        assert not accepts(marker, '[{"name": "get_weather", "arguments": {"city": "Reykjavik"}}]')  # schema
        assert accepts(marker, '[{"name": "now", "arguments": {}}]') == (choice == "required")


def test_a_granite_checkpoint_calls_through_the_chat_layer(tmp_path):
    """A checkpoint whose template writes `<|tool_call|>` (a token of its tokenizer): the chat
    layer reads its calls with "granite", a forced call is held to Granite's form by the grammar,
    and the calls get OpenAI-style ids."""
    import tiny_models

    path = tiny_models.make_tiny_checkpoint("llama", tmp_path, vocab_size=tiny_models.VOCAB_SIZE + len(GRANITE_MARKERS))
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": GRANITE_MARKERS})
    tokenizer.chat_template = GRANITE_TEMPLATE
    tokenizer.save_pretrained(path)
    with tiny_models.open_engine(path) as granite:
        chat = Chat(granite, "agent")
        assert chat.parser_name == "granite"
        result = chat.respond([{"role": "user", "content": "Hello!"}], [WEATHER], tool_choice="required",
                              parallel_tool_calls=False, params=SamplingParams(max_tokens=60))
        assert result.finish_reason == "tool_calls", result.raw_text
        assert result.raw_text.startswith('<|tool_call|>[{"name": "get_weather", "arguments": ')
        assert [c.name for c in result.tool_calls] == ["get_weather"]
        assert re.fullmatch(r"call_[0-9a-f]{24}", result.tool_calls[0].id)
