"""What the XML tool-call formats' tests share (test_qwen_xml, test_glm45, test_minimax_xml,
test_seed_oss_xml): the tools their calls are typed by, an OpenAI-style tool call of a history, and
a parser's stream read back into its text, its calls and its result."""

from __future__ import annotations

import json

from hibana_plugins.hookspecs import ToolCallDelta

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "metric": {"type": "boolean"}, "options": {"type": "object"}, "tags": {"type": "array"},
        "zip": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"]}}}

ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm.",
    "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "loud": {"type": "boolean"},
        "label": {"type": "string", "enum": ["work", "gym"]},
        "note": {"type": "string", "maxLength": 12}},
        "required": ["hour", "label"]}}}


def tool_call(call_id: str, name: str, arguments: dict) -> dict:
    """An assistant message's tool call, as OpenAI-style histories hold one."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def streamed(parser, chunks, tools):
    """(the text pieces, each call as (index, name, arguments), the stream's result) of `chunks`
    fed to the parser's stream one by one."""
    stream, text, calls = parser.stream(tools), [], {}
    pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.close()
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            entry = calls.setdefault(piece.index, [piece.id, piece.name, ""])
            entry[2] += piece.arguments_fragment
        else:
            text.append(piece)
    return text, [(i, n, json.loads(a)) for i, n, a in calls.values()], stream.finish()
