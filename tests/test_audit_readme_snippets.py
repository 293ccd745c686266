"""The README's chat-layer snippet ("Messages rather than tokens") runs as written on the demo model."""

from __future__ import annotations

import pytest

from hibana_core import Engine, SamplingParams
from hibana_core.chat import assistant_message

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", kv_device_blocks=64) as engine:
        yield engine


def test_readme_chat_layer_snippet(engine):
    tools, messages = TOOLS, [{"role": "user", "content": "What's the weather in Paris?"}]
    chat = engine.chat("agent-1")
    r = chat.respond(messages, tools=tools, params=SamplingParams(max_tokens=128))
    assert (r.finish_reason, [(c.name, c.arguments) for c in r.tool_calls]) == (
        "tool_calls", [("get_weather", {"city": "Paris"})])
    assert (r.usage.prompt_tokens, r.usage.cached_tokens) > (0, -1) and r.usage.completion_tokens > 0
    messages += [assistant_message(r), {"role": "tool", "tool_call_id": r.tool_calls[0].id, "content": "..."}]
    deltas = list(chat.stream_respond(messages, tools, SamplingParams(max_tokens=8)))
    result = deltas[-1].result
    assert result is not None and result.usage.cached_tokens >= r.usage.prompt_tokens
