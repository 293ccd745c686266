"""The harmony format (gpt-oss): its tool parser whole and streamed, and its chat format."""

from __future__ import annotations

import random

import pytest

from hibana_plugins.harmony import HarmonyToolParser
from hibana_plugins.manager import get_plugin_manager
from test_hostile_chat import chunkings, streamed

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
CALL_AFTER_CHANNEL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                      '<|message|>{"city": "Oslo", "days": [1, 2]}<|call|>')
CALL_IN_HEADER = ('<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>'
                  '{"q": "a string"}')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.<|return|>"

CASES = {
    "analysis-then-call": (ANALYSIS + CALL_AFTER_CHANNEL, "",
                           [("get_weather", {"city": "Oslo", "days": [1, 2]})], None),
    "analysis-then-final": (ANALYSIS + FINAL, "It is sunny in Oslo.", [], None),
    "recipient-in-header": (ANALYSIS + CALL_IN_HEADER, "", [("lookup", {"q": "a string"})], None),
    "preamble-then-call": ("<|channel|>commentary<|message|>Checking the weather.<|end|>" + CALL_AFTER_CHANNEL,
                           "Checking the weather.", [("get_weather", {"city": "Oslo", "days": [1, 2]})], None),
    "two-calls": (ANALYSIS + CALL_AFTER_CHANNEL + CALL_AFTER_CHANNEL.replace("Oslo", "Bergen"), "",
                  [("get_weather", {"city": "Oslo", "days": [1, 2]}),
                   ("get_weather", {"city": "Bergen", "days": [1, 2]})], None),
    "no-markup": ("Just an answer.", "Just an answer.", [], None),
    "cut-off-final": (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sun", "It is sun", [], None),
    "malformed-arguments": (ANALYSIS + CALL_AFTER_CHANNEL.replace('"days"', "days"),
                            '{"city": "Oslo", days: [1, 2]}', [], "invalid JSON"),
    "arguments-not-an-object": (CALL_AFTER_CHANNEL.replace('{"city": "Oslo", "days": [1, 2]}', "[1]"),
                                "[1]", [], "must be a JSON object"),
}


@pytest.mark.parametrize("text, content, calls, error", CASES.values(), ids=CASES.keys())
def test_parse(text, content, calls, error):
    parsed = HarmonyToolParser().parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert (parsed.error is None) if error is None else (error in parsed.error)


def test_analysis_is_reasoning_never_content():
    stream = HarmonyToolParser().stream()
    stream.feed(ANALYSIS + FINAL)
    assert "call the tool" not in stream.finish().content
    assert stream.reasoning == "The user wants the weather; call the tool."


@pytest.mark.parametrize("text", [case[0] for case in CASES.values()], ids=CASES.keys())
def test_streaming_equals_parsing_at_once(text):
    """Every chunking (whole, character by character, random cuts) streams the calls and text
    that parsing the whole text gives, and the stream's own result agrees with both."""
    parser, whole = HarmonyToolParser(), HarmonyToolParser().parse(text)
    for chunks in chunkings(random.Random(len(text)), text):
        content, calls, own = streamed(parser, chunks)
        assert calls == [(c.id, c.name, c.arguments) for c in own.tool_calls]
        assert [(c.name, c.arguments) for c in own.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert content == own.content == whole.content
        assert own.error == whole.error


def test_final_text_streams_before_the_message_ends():
    stream = HarmonyToolParser().stream()
    assert stream.feed(ANALYSIS) == []  # reasoning: not streamed as content
    pieces = stream.feed("<|start|>assistant<|channel|>final<|message|>It is sunny<|")
    assert pieces == ["It is sunny"]  # "<|" may begin <|return|>: held back
    assert stream.feed("return|>") == []


def test_registered_as_gpt_oss_chat_format_and_parser():
    manager = get_plugin_manager()
    chat_format = manager.chat_formats()["gpt_oss"]
    assert chat_format.template is None  # the checkpoint's own template
    assert isinstance(manager.lookup("tool_parser", chat_format.tool_parser), HarmonyToolParser)
    assert "<|end|>" not in chat_format.end_of_turn_tokens  # it ends a message, not the turn
