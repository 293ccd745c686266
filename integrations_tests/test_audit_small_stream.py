"""Small defects audited: the first chunk of a streamed chat reply, as OpenAI's."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def deltas(url: str, body: dict) -> list[dict]:
    """The streamed reply's chunks' deltas (choice 0), as sent on the wire."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    return [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]


def test_a_streamed_reply_of_calls_only_opens_with_content_null(url):
    """A streamed reply opened with a chunk {"role": "assistant", "content": ""} however it went on:
    a reply of tool calls only thus had content "" where its whole message has null. As OpenAI's,
    such a reply's first chunk is its first call's, with the role and content null; a reply of
    text still opens with content ""."""
    ask = {"model": "demo", "max_tokens": 48, "messages": [{"role": "user", "content": "What's the weather in Paris?"}]}
    called = deltas(url, {**ask, "tools": [WEATHER], "tool_choice": "required"})
    first = called[0]
    assert first["role"] == "assistant" and first["content"] is None and first["tool_calls"][0]["id"], called
    assert first["tool_calls"][0]["function"]["name"] == "get_weather"
    assert not any(delta.get("content") == "" for delta in called)
    assert [delta.get("role") for delta in called].count("assistant") == 1
    text = deltas(url, {**ask, "messages": [{"role": "user", "content": "Hello there!"}]})
    assert text[0] == {"role": "assistant", "content": ""} and text[1]["content"]
