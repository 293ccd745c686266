"""Small defects audited: the first chunk of a streamed chat reply, as OpenAI's."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

pytest.importorskip("fastapi")

from hibana_core.turn import ChatDelta  # noqa: E402
from hibana_plugins.hookspecs import ToolCallDelta  # noqa: E402
from hibana_plugins.openai_api import Reply  # noqa: E402
from hibana_plugins.server import Drain, Metrics, sse  # noqa: E402


def streamed(*batches: list[ChatDelta], turns: int = 1) -> list[dict]:
    """The deltas `sse` sends for these batches (of choice 0, then 1, ...: one batch per turn)."""
    async def choices():
        for index, batch in enumerate(batches):
            yield index % turns, batch

    async def frames() -> str:
        call = types.SimpleNamespace(include_usage=False)
        return "".join([f async for f in sse("chat", Reply("demo"), choices(), turns, call, Metrics(), Drain())])

    chunks = [json.loads(line[6:]) for line in asyncio.run(frames()).splitlines() if line.startswith("data: {")]
    return [(chunk["choices"][0]["index"], chunk["choices"][0]["delta"]) for chunk in chunks]


def test_a_streamed_reply_of_calls_only_opens_with_content_null():
    """A streamed reply opened with a chunk {"role": "assistant", "content": ""} however it went
    on: a reply of tool calls only thus had content "" where its whole message has null. As
    OpenAI's, such a reply's first chunk is its first call's, with the role and content null; a
    reply of text still opens with content "", each choice of several with its own role."""
    call = ToolCallDelta(0, "call_1", "get_weather", "")
    called = streamed([ChatDelta(tool_call=call), ChatDelta(tool_call=ToolCallDelta(0, None, None, '{"city": 1}'))])
    assert called[0] == (0, {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]})
    assert [delta for _, delta in called[1:]] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": 1}'}}]}]
    text = streamed([ChatDelta(text="Hi")], [ChatDelta(tool_call=call)], [ChatDelta(text=" there")], turns=2)
    assert text == [(0, {"role": "assistant", "content": ""}), (0, {"content": "Hi"}),
                    (1, {"role": "assistant", "content": None, "tool_calls": [
                        {"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]}),
                    (0, {"content": " there"})]
