"""The chat layer on the bundled demo model: rendering, round trips, tool calls, streaming."""

from __future__ import annotations

import json
import random

import pytest

from hibana_core import Completion, Engine, RequestStats, SamplingParams
from hibana_core.chat import MALFORMED, Chat, ChatResult, assistant_message, normalize_messages, normalize_tools
from hibana_core.demo import corpus, tasks as T, template
from hibana_core.demo.evaluate import run_tool
from hibana_plugins.manager import get_plugin_manager


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        yield engine


def agent_setup(seed: int, kinds: tuple[str, ...]):
    rng = random.Random(seed)
    box = corpus.ToolBox(rng, held_out=True)
    task_list = [T.make_task(rng, kind, box) for kind in kinds]
    box.add_distractors(2)
    return task_list, box.tools()


def run_agent(chat: Chat, task_list, tools, check):
    """A real tool loop over several tasks in one conversation; after each turn
    `check(result, tokens the state held before, the prompt it was given)`."""
    schemas = [t.schema for t in tools]
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for task in task_list:
        messages.append({"role": "user", "content": task.question})
        for _ in range(4):
            held, prompt = chat.handle.tokens, chat.prompt_ids(messages, schemas)
            result = chat.respond(messages, schemas)
            check(result, held, prompt)
            messages.append(assistant_message(result))
            if not result.tool_calls:
                break
            messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(tools, c.name, c.arguments)}
                         for c in result.tool_calls]
    return messages


def test_demo_template_is_the_tokenizers(engine):
    """The corpus renderer and the checkpoint's tokenizer render conversations identically."""
    for i in range(20):
        c = corpus.conversation(7, i)
        for prompt in (False, True):
            ours = template.render(c.messages, c.tools, add_generation_prompt=prompt)
            theirs = engine.tokenizer.apply_chat_template(c.messages, tools=c.tools, tokenize=False,
                                                          add_generation_prompt=prompt)
            assert ours == theirs


def test_round_trip_reuses_the_history(engine):
    """Turn 2 and later: the prompt starts with every token the state held, the model's own
    spelling included, and at least 95% of them are reused (all but the last generated token,
    which has no KV yet); the canonical re-tokenization stays within the same bound."""
    turns = []

    def check(result: ChatResult, held: list[int], prompt: list[int]):
        turns.append(result)
        assert result.usage.prompt_tokens == len(prompt)
        if held:
            assert prompt[:len(held)] == held, "re-rendering changed tokens the model produced"
            assert result.usage.cached_tokens >= max(0.95 * len(held), len(held) - 1)

    task_list, tools = agent_setup(11, ("weather", "arithmetic_chain", "read_file"))
    chat = Chat(engine, "round-trip")
    messages = run_agent(chat, task_list, tools, check)
    assert len(turns) >= 6
    assert turns[0].usage.cached_tokens == 0
    assert sum(r.finish_reason == "tool_calls" for r in turns) >= 3

    # the whole conversation the model produced, rendered again: nearly all of it is reused
    again = chat.respond(messages + [{"role": "user", "content": "Thanks!"}], [t.schema for t in tools],
                         SamplingParams(max_tokens=1))
    assert again.usage.cached_tokens >= 0.95 * again.usage.prompt_tokens


def test_tool_call_and_answer(engine):
    task_list, tools = agent_setup(3, ("conversion",))
    task = task_list[0]
    chat = Chat(engine, "convert")
    messages = [{"role": "user", "content": task.question}]
    first = chat.respond(messages, [t.schema for t in tools])
    assert first.finish_reason == "tool_calls" and first.text == ""
    expected = task.turns[0][0]
    assert [(c.name, c.arguments) for c in first.tool_calls] == [(expected.tool.name, expected.arguments)]
    assert first.tool_calls[0].id.startswith("call_")
    messages += [assistant_message(first), {"role": "tool", "content": expected.result}]
    final = chat.respond(messages, [t.schema for t in tools])
    assert final.finish_reason == "stop" and not final.tool_calls
    assert all(k in final.text for k in task.answer_keys)
    assert final.usage.completion_tokens > 0


def test_plain_chat_without_tools(engine):
    result = Chat(engine, "hello").respond([{"role": "user", "content": "Hi!"}])
    assert result.finish_reason == "stop" and result.tool_calls == []
    assert result.text.startswith("H")


def test_stream_matches_respond(engine):
    task_list, tools = agent_setup(5, ("weather",))
    messages = [{"role": "user", "content": task_list[0].question}]
    schemas = [t.schema for t in tools]
    whole = Chat(engine, "whole").respond(messages, schemas)
    deltas = list(Chat(engine, "streamed").stream_respond(messages, schemas))
    result = deltas[-1].result
    assert result is not None and all(d.result is None for d in deltas[:-1])
    assert [(c.name, c.arguments) for c in result.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    assert calls[0].name == result.tool_calls[0].name and calls[0].id == result.tool_calls[0].id
    assert json.loads("".join(c.arguments_fragment for c in calls)) == result.tool_calls[0].arguments
    assert "".join(d.text for d in deltas) == result.text


def test_openai_messages_render_like_dicts(engine):
    """Arguments as a JSON string (OpenAI wire format), content None, bare function tools."""
    tool = {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object", "properties": {}}}
    as_dicts = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": '{"t": 3}'}]
    wire = [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"t": 3}'}]
    chat = Chat(engine, "render")
    assert chat.render(wire, [tool]) == chat.render(as_dicts, [{"type": "function", "function": tool}])
    assert normalize_tools([tool]) == [{"type": "function", "function": tool}]
    assert normalize_messages(wire)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def _completion(text: str, reason: str = "stop") -> Completion:
    return Completion([1, 2], reason, text, RequestStats(10, 0, 10, 2, None, 0.0))


def test_malformed_tool_call_is_text_not_an_exception():
    parser = get_plugin_manager().lookup("tool_parser", "hermes")
    raw = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'
    usage = Chat._result(parser.parse(raw), raw, _completion(raw), None)
    assert usage.finish_reason == MALFORMED and usage.text == raw and usage.tool_calls == [] and usage.error
    cut = '<tool_call>\n{"name": "f", "argu'
    result = Chat._result(parser.parse(cut), cut, _completion(cut, "length"), None)
    assert result.finish_reason == "length" and result.text == cut and result.tool_calls == []


def test_truncated_generation_does_not_raise(engine):
    task_list, tools = agent_setup(8, ("email",))
    result = Chat(engine, "short").respond([{"role": "user", "content": task_list[0].question}],
                                           [t.schema for t in tools], SamplingParams(max_tokens=5))
    assert result.finish_reason == "length" and result.tool_calls == []
    assert result.text.startswith("<tool_call>")


def test_prefill_forces_a_tool_call_and_parse_tools_false_returns_raw_text():
    from hibana_core import Engine

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        chat = engine.chat("forced")
        messages = [{"role": "user", "content": "Hi! What's the weather like in Oslo?"}]
        forced = chat.respond(messages, [weather], prefill='<tool_call>\n{"name": "')
        assert [c.name for c in forced.tool_calls] == ["get_weather"], forced.raw_text
        assert forced.raw_text.startswith('<tool_call>\n{"name": "get_weather"')
        raw = engine.chat("raw").respond(messages, [weather], parse_tools=False)
        assert raw.tool_calls == [] and raw.text == raw.raw_text and "<tool_call>" in raw.text
