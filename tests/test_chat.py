"""The chat layer on the bundled demo model: rendering, round trips, tool calls, streaming."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import threading
import types

import pytest

from hibana_core import Engine, HibanaError, SamplingParams, StateBusyError, ToolSchemaError
from hibana_core.chat import (MALFORMED, Chat, ChatResult, ConversationError, ToolChoiceError, assistant_message,
                              clean_tool, normalize_messages, normalize_tool_choice, normalize_tools)
from hibana_core.config import MAX_DRAFT_TOKENS
from hibana_core.kv.sequence import common_prefix_len
from hibana_core.state import UNNAMED_PREFIX
from hibana_core import turn
from hibana_core.turn import result as turn_result
from hibana_core.demo import corpus, tasks as T, template
from scripted import ScriptedEvents
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


def test_malformed_tool_call_is_text_not_an_exception():
    parser = get_plugin_manager().lookup("tool_parser", "hermes")
    raw = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'
    usage = turn_result(parser.parse(raw), raw, "stop", None)
    assert usage.finish_reason == MALFORMED and usage.text == raw and usage.tool_calls == [] and usage.error
    cut = '<tool_call>\n{"name": "f", "argu'
    result = turn_result(parser.parse(cut), cut, "length", None)
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


# --- tool_choice: forced calls ----------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
HELLO = [{"role": "user", "content": "Hello!"}]


def test_tool_choice_forces_a_call(engine):
    """"Hello!" gets a greeting; forced, it gets a call that parses and has the schema's keys
    (a named tool, or one of the tools), and the state holds the call as the turn's end."""
    chat = Chat(engine, "forced-choice")
    assert chat.respond(HELLO, [WEATHER, MULTIPLY]).tool_calls == []
    named = chat.respond(HELLO, [WEATHER, MULTIPLY], tool_choice="multiply")
    assert [c.name for c in named.tool_calls] == ["multiply"] and set(named.tool_calls[0].arguments) == {"a", "b"}
    assert named.finish_reason == "tool_calls" and named.raw_text.startswith('<tool_call>\n{"name": "multiply"')
    held = chat.handle.tokens
    assert held[-1] in chat.stop_token_ids and engine.tokenizer.decode(held[:-1]).endswith(named.raw_text)
    assert named.usage.prompt_tokens > 0 and named.usage.completion_tokens > 0
    some = chat.respond(HELLO, [WEATHER, MULTIPLY], tool_choice="any")
    assert len(some.tool_calls) == 1 and some.tool_calls[0].name in ("get_weather", "multiply")
    assert chat.respond(HELLO, [WEATHER], tool_choice={"function": {"name": "get_weather"}}).tool_calls[0].name \
        == "get_weather"
    question = [{"role": "user", "content": "What's the weather in Paris?"}]
    assert chat.respond(question, [WEATHER], tool_choice="none").tool_calls == []


def test_a_named_tool_choice_gets_one_call(engine):
    """A named tool is that one call, as vLLM's named function calling and OpenAI's forced
    function give: asked for two things, the model made a second call of it (a city it invented,
    then the asked one) under the parallel grammar; `parallel_tool_calls` does not reopen it."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": city}} for name in ("get_weather", "get_time")]
    question = [{"role": "user", "content": "What's the weather and time in Paris?"}]
    for chat, deltas in ((Chat(engine, "named-one"), False), (Chat(engine, "named-one-stream"), True)):
        if deltas:
            result = list(chat.stream_respond(question, tools, tool_choice="get_time"))[-1].result
        else:
            result = chat.respond(question, tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                  parallel_tool_calls=True)
        assert [c.name for c in result.tool_calls] == ["get_time"] and result.raw_text.count("<tool_call>") == 1


def test_guided_values_and_free_arguments(engine):
    """Guided: the model fills the values of a flat schema; unguided or on a nested schema, it
    writes the arguments itself after the forced name."""
    book = {"type": "function", "function": {"name": "Book", "description": "Save a book as a structured record.",
            "parameters": {"type": "object", "properties": {
                "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
                "required": ["title", "author", "year"]}}}
    messages = [{"role": "user", "content": 'Save the book "The Silent River" by Maya Tanaka, published in 1987.'}]
    chat = Chat(engine, "guided")
    guided = chat.respond(messages, [book], tool_choice="Book")
    assert guided.tool_calls[0].arguments == {"title": "The Silent River", "author": "Maya Tanaka", "year": 1987}
    free = chat.respond(HELLO, [MULTIPLY], tool_choice="multiply", guided=False)
    assert free.raw_text.startswith('<tool_call>\n{"name": "multiply", "arguments":')  # then the model's
    nested = {"type": "function", "function": {"name": "tag", "description": "Tag a note.", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["tags"]}}}
    assert chat.respond(HELLO, [nested], tool_choice="tag").raw_text.startswith(
        '<tool_call>\n{"name": "tag", "arguments":')


def test_forced_call_streams_like_a_free_one(engine):
    """Sync and async, streamed or not: the same call; its id and name come first, then
    argument fragments that join to its arguments."""
    whole = Chat(engine, "forced-whole").respond(HELLO, [WEATHER, MULTIPLY], tool_choice="multiply")
    deltas = list(Chat(engine, "forced-stream").stream_respond(HELLO, [WEATHER, MULTIPLY], tool_choice="multiply"))
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    assert calls[0].id and calls[0].name == "multiply" and all(c.id is None for c in calls[1:])
    assert json.loads("".join(c.arguments_fragment for c in calls)) == whole.tool_calls[0].arguments
    assert deltas[-1].result.tool_calls[0].arguments == whole.tool_calls[0].arguments

    async def both():
        chat = Chat(engine, "forced-async")
        awhole = await chat.arespond(HELLO, [WEATHER, MULTIPLY], tool_choice="multiply")
        adeltas = [d async for d in Chat(engine, "forced-astream").astream_respond(
            HELLO, [WEATHER, MULTIPLY], tool_choice="required")]
        return awhole, adeltas

    awhole, adeltas = asyncio.run(both())
    assert awhole.tool_calls[0].arguments == whole.tool_calls[0].arguments
    assert awhole.usage.completion_tokens == whole.usage.completion_tokens
    assert len(adeltas[-1].result.tool_calls) == 1


@pytest.mark.parametrize("name", ['my tool"} <x>', "back\\slash", "a<b", "new\nline"])
def test_a_tool_name_that_would_break_the_call_markup_is_refused(name):
    """Templates write a call's name into its markup unescaped ('{"name": "' + name + '"'): a name
    with a quote was offered, called, and its call broke the history it was written into."""
    with pytest.raises(ToolSchemaError, match="rename the tool"):
        normalize_tools([{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}])
    for fine in ("get_weather", "web.search", "Search Tool", "lookup-v2"):  # spaces: LangChain's older tools
        assert normalize_tools([{"type": "function", "function": {"name": fine}}])[0]["function"]["name"] == fine


def test_a_tool_named_as_a_mode_is_not_forced_as_that_mode():
    """{"function": {"name": "none"}} forcing a tool called "none" was read as the mode "none"
    (no call at all): refused, saying to rename it; named as a mode, the choice stays the mode."""
    tools = normalize_tools([{"type": "function", "function": {"name": name}} for name in ("none", "lookup")])
    with pytest.raises(ToolChoiceError, match="rename the tool"):
        normalize_tool_choice({"type": "function", "function": {"name": "none"}}, tools)
    assert normalize_tool_choice("none", tools) == "none"
    assert normalize_tool_choice({"function": {"name": "lookup"}}, tools) == "lookup"


def test_normalize_tool_choice_spellings():
    tools = [WEATHER, MULTIPLY]
    assert [normalize_tool_choice(c, tools) for c in (None, "auto", "none", False, "any", "required", True)] == [
        "auto", "auto", "none", "none", "required", "required", "required"]
    assert normalize_tool_choice("multiply", tools) == "multiply"
    assert normalize_tool_choice({"type": "function", "function": {"name": "multiply"}}, tools) == "multiply"
    assert normalize_tool_choice({"name": "get_weather"}, tools) == "get_weather"
    with pytest.raises(ToolChoiceError, match="names no bound tool"):
        normalize_tool_choice("search", tools)
    assert issubclass(ToolChoiceError, (HibanaError, ValueError))


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "functon"}, {"mode": "any"}, {}])
def test_a_tool_choice_dict_naming_no_tool_and_no_mode_is_refused_not_read_as_auto(choice):
    with pytest.raises(ToolChoiceError, match="names no tool and no mode"):
        normalize_tool_choice(choice, [WEATHER, MULTIPLY])


def test_clean_tool_lays_out_schemas_as_openai_does():
    tool = {"function": {"description": "Save a book.", "name": "Book", "parameters": {
        "description": "A book.", "properties": {"title": {"description": "Its title.", "title": "Title",
                                                           "type": "string"}},
        "required": ["title"], "title": "Book", "type": "object"}}}
    cleaned = clean_tool(tool)
    assert list(cleaned) == ["type", "function"] and list(cleaned["function"]) == ["name", "description", "parameters"]
    assert list(cleaned["function"]["parameters"]) == ["type", "properties", "description", "required"]
    assert cleaned["function"]["parameters"]["properties"] == {"title": {"type": "string", "description": "Its title."}}


def test_timeout_cancels_the_turn(engine):
    chat = Chat(engine, "timeout")
    with pytest.raises(TimeoutError):
        chat.respond(HELLO, timeout=1e-9)
    assert chat.respond(HELLO).text  # the state is free again


def test_a_turns_unknown_or_mistyped_options_are_config_errors(engine):
    """A sampling option given to the turn says where it goes, a misspelt one its close match, a
    flag that is no bool is refused, and max_tokens=0 (no reply) too; the chat goes on."""
    from hibana_core import ConfigError

    chat = Chat(engine, "options")
    with pytest.raises(ConfigError, match=r"'temperature' is a sampling option: pass params=SamplingParams"):
        chat.respond(HELLO, temperature=0.5)
    with pytest.raises(ConfigError, match="did you mean 'tool_choice'"):
        list(chat.stream_respond(HELLO, tool_chioce="auto"))
    with pytest.raises(ConfigError, match="parallel_tool_calls must be True or False"):
        chat.respond(HELLO, parallel_tool_calls="yes")
    with pytest.raises(ConfigError, match="max_tokens=0 leaves a chat turn no reply"):
        chat.respond(HELLO, params=SamplingParams(max_tokens=0))
    assert chat.respond(HELLO, params=SamplingParams(max_tokens=3)).text


# --- Chat without a state: render, then lease one per call ------------------------------------------

def test_chat_without_a_state_renders_and_leases(engine):
    chat = Chat(engine)
    assert chat.handle is None and chat.render(HELLO) == Chat(engine, "render-ref").render(HELLO)
    with pytest.raises(HibanaError, match="no state"):
        chat.respond(HELLO)

    history = [{"role": "user", "content": "Repeat after me: blue harbor clock"}]
    with chat.lease(chat.render_text(history)) as first:
        assert first.handle.id.startswith(UNNAMED_PREFIX) and chat.handle is None
        reply = first.respond(history)
        held = len(first.handle)
    history += [assistant_message(reply), {"role": "user", "content": "Thanks!"}]
    with chat.lease(chat.render_text(history)) as second:  # the conversation goes on in its state
        assert second.handle.id == first.handle.id
        assert second.respond(history).usage.cached_tokens >= held - 1
    with chat.lease(chat.render_text(HELLO)) as other:     # another conversation gets its own
        assert other.handle.id not in (first.handle.id, "render-ref")


def test_a_conversation_goes_on_in_its_state_after_an_edited_branch_of_it(engine):
    """Edit-and-resend, then the original conversation goes on: its state must serve it. The
    demo writes call markup as text when offered no tools, and that reply, re-rendered,
    tokenizes otherwise than generated: the edited branch's state then shares more tokens
    with the next prompt than the conversation's own, and the lease went to a new state
    (144 of 201 prompt tokens reused, against 186 without the edit)."""
    chat = Chat(engine)
    system = {"role": "system", "content": "You are a helpful travel agent for ACME corp, ticket 99123. " * 5}

    def turn(messages):
        with chat.lease(chat.render_text(messages)) as leased:
            reply = leased.respond(messages, params=SamplingParams(max_tokens=20))
            messages.append({"role": "assistant", "content": reply.text})
            return leased.handle.id, reply.usage.cached_tokens

    conversation = [system, {"role": "user", "content": "Hi, I'm Alice."}]
    own, _ = turn(conversation)
    conversation.append({"role": "user", "content": "Flight to Rome?"})
    assert turn(conversation)[0] == own
    edited = conversation[:-2] + [{"role": "user", "content": "Flight to Paris?"}]
    branch, _ = turn(edited)
    assert branch != own
    conversation.append({"role": "user", "content": "And back?"})
    ids = chat.prompt_tokens(chat.render_text(conversation))
    shared = {sid: common_prefix_len(engine.open_state(sid).tokens, ids) for sid in (own, branch)}
    assert shared[branch] > shared[own]  # what made the lease go wrong (else this test shows nothing)
    held = len(engine.open_state(own))
    served, cached = turn(conversation)
    assert served == own and cached >= held - 2


def test_lease_never_shares_a_state(engine):
    chat = Chat(engine)
    with chat.lease(chat.render_text(HELLO), "lease-named") as held:
        assert held.handle.id == "lease-named"
        with pytest.raises(StateBusyError, match="lease-named"):
            with chat.lease(chat.render_text(HELLO), "lease-named"):
                pass
        with chat.lease(chat.render_text(HELLO), "lease-named", fallback=True) as other:
            assert other.handle.id != "lease-named"
    with chat.lease(chat.render_text(HELLO), "lease-named") as again:  # free once the call ended
        assert again.handle.id == "lease-named"

    async def concurrent():
        async def one():
            with chat.lease(chat.render_text(HELLO)) as leased:
                await leased.arespond(HELLO)
                return leased.handle.id
        return await asyncio.gather(*(one() for _ in range(3)))

    assert len(set(asyncio.run(concurrent()))) == 3


# --- truthful streams (issue 11, defects 1 and 2), on scripted model output --------------------------

class ScriptedHandle:
    """A state whose every request streams given text in given chunks, then finishes for `reason`."""

    def __init__(self, chunks: list[str], reason: str = "stop") -> None:
        self.id, self.tokens, self.chunks, self.reason = "scripted", [], chunks, reason
        self.requests: list[ScriptedEvents] = []

    def stream(self, params, *, prompt=None):
        self.requests.append(ScriptedEvents(self.chunks, self.reason))
        return self.requests[-1]

    def astream(self, params, *, prompt=None, loop=None):
        return self.stream(params, prompt=prompt)


def streamed_turn(deltas):
    """(text, [(id, name, arguments)], result) assembled from a turn's deltas."""
    calls = {}
    for d in deltas[:-1]:
        assert d.result is None
        if d.tool_call is not None and d.tool_call.id is not None:
            calls[d.tool_call.index] = [d.tool_call.id, d.tool_call.name, d.tool_call.arguments_fragment]
        elif d.tool_call is not None:
            calls[d.tool_call.index][2] += d.tool_call.arguments_fragment
    text = "".join(d.text for d in deltas)
    return text, [(i, n, json.loads(a)) for i, n, a in calls.values()], deltas[-1].result


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRUTH_OUTPUTS = [
    CALL,
    'Let me check. ' + CALL + '\n' + CALL.replace("Paris", "Oslo"),
    '<tool_call>\n{"name": "get_weather", "arguments": "hello"}\n</tool_call>',
    CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',  # valid + malformed
]


def test_a_turn_without_tools_returns_call_markup_as_text(engine):
    """No tool offered: no call can name one, so `<tool_call>` markup the model writes anyway is
    content, as the adapters and the server have it (a new user's trial: Chat.respond without
    tools returned calls to a tool named 'drowim', finish_reason "tool_calls")."""
    chat = Chat(engine)
    for tools in (None, []):
        result = chat.on(ScriptedHandle([CALL])).respond(HELLO, tools)
        assert result.tool_calls == [] and result.text == CALL and result.finish_reason == "stop"
        deltas = list(chat.on(ScriptedHandle(list(CALL))).stream_respond(HELLO, tools))
        assert "".join(d.text for d in deltas) == CALL and all(d.tool_call is None for d in deltas)
    assert chat.on(ScriptedHandle([CALL])).respond(HELLO, [WEATHER]).tool_calls  # offered: a call


@pytest.mark.parametrize("output", TRUTH_OUTPUTS)
def test_stream_and_result_agree_for_every_cut_and_chunking(engine, output):
    """Defect 1: what `stream_respond` sends as calls is exactly what `respond` returns, for the
    output cut by length at every character and for any chunking; text agrees too."""
    chat = Chat(engine)
    rng = random.Random(3)
    for end in range(len(output) + 1):
        text, reason = output[:end], "length" if end < len(output) else "stop"
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        for chunks in (list(text), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]):
            deltas = list(chat.on(ScriptedHandle(chunks, reason)).stream_respond(HELLO, [WEATHER]))
            streamed_text, calls, result = streamed_turn(deltas)
            assert calls == [(c.id, c.name, c.arguments) for c in result.tool_calls], (text, chunks)
            assert streamed_text == result.text
            whole = chat.on(ScriptedHandle([text], reason)).respond(HELLO, [WEATHER])
            assert [(c.name, c.arguments) for c in whole.tool_calls] == [(n, a) for _, n, a in calls]
            assert whole.text == result.text and whole.finish_reason == result.finish_reason


@pytest.mark.parametrize("reason", ["length", "stop"])
def test_a_call_cut_by_max_tokens_or_a_stop_is_marked_in_stream_and_result(engine, reason):
    """Cut anywhere by max_tokens or a stop string, the text the parser lets go only at the end is
    the call being written: marked `cut_call` (in the result too), so the rest is the answer
    without any markup."""
    chat = Chat(engine)
    output = TRUTH_OUTPUTS[1]  # text, a call, a second call
    for end in range(len(output)):
        deltas = list(chat.on(ScriptedHandle([output[:end]], reason)).stream_respond(HELLO, [WEATHER]))
        result = deltas[-1].result
        answer = "".join(d.text for d in deltas if not d.cut_call)
        assert "<" not in answer and answer == result.text.removesuffix(result.cut_call), output[:end]
        assert result.cut_call == "".join(d.text for d in deltas if d.cut_call)
    whole = chat.on(ScriptedHandle([output], "stop")).respond(HELLO, [WEATHER])
    assert whole.cut_call == "" and len(whole.tool_calls) == 2


def test_a_call_the_model_ended_without_the_call_grammar_stays_content(engine):
    """No call grammar held the turn (the request's own regex): a turn that ends ("stop") inside a
    call is the model's malformed text, kept as content; under the call grammar only a stop string
    or token could cut a call there, and that is a cut call (above)."""
    output = TRUTH_OUTPUTS[1]
    cut = output[:output.index("<tool_call>") + 20]
    result = Chat(engine).on(ScriptedHandle([cut], "stop")).respond(
        HELLO, [WEATHER], SamplingParams(max_tokens=64, regex="(.|\n)*"))
    assert result.cut_call == "" and result.text == cut and result.finish_reason == "malformed_tool_call"


@pytest.mark.parametrize("text, cut", [('{"answer": "Oslo is', False),  # an answer in JSON: content
                                       ('{"name": "get_weather", "parameters": {"ci', True),
                                       ('{"name": "get_wea', True), ('{"na', True),  # cut before the name ends
                                       ('{"names": "Ann', False),
                                       ('Let me see. <|python_ta', True)])
def test_a_cut_call_is_what_the_parser_read_as_one(engine, text, cut):
    """Llama 3's calls open with "{": a JSON answer cut by max_tokens is the answer, not a cut call."""
    result = Chat(engine, tool_parser="llama3_json").on(ScriptedHandle([text], "length")).respond(HELLO, [WEATHER])
    assert result.text == text and bool(result.cut_call) == cut and result.finish_reason == "length"


def test_valid_and_malformed_calls_keep_the_valid_one_in_stream_and_result(engine):
    output = TRUTH_OUTPUTS[3]
    result = Chat(engine).on(ScriptedHandle([output])).respond(HELLO, [WEATHER])
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert result.finish_reason == MALFORMED and "invalid JSON" in result.error
    assert result.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": }}')


def test_tool_choice_none_never_returns_calls(engine):
    """Defect 2: with tool_choice="none", a call the model writes anyway is content."""
    chat = Chat(engine)
    for respond in (lambda c: c.respond(HELLO, [WEATHER], tool_choice="none"),
                    lambda c: asyncio.run(c.arespond(HELLO, [WEATHER], tool_choice="none"))):
        result = respond(chat.on(ScriptedHandle([CALL])))
        assert result.tool_calls == [] and result.text == CALL and result.finish_reason == "stop"
    deltas = list(chat.on(ScriptedHandle(list(CALL))).stream_respond(HELLO, [WEATHER], tool_choice="none"))
    assert all(d.tool_call is None for d in deltas) and "".join(d.text for d in deltas) == CALL


def test_tool_choice_none_holds_the_model_off_a_call(engine):
    """The prompt lists the tools and a grammar keeps the model from opening a call: the demo,
    which calls for the weather, answers in text instead of writing a call as text."""
    ask = [{"role": "user", "content": "What's the weather in Oslo?"}]
    free = Chat(engine, "none-free").respond(ask, [WEATHER], SamplingParams(max_tokens=40, grammar=None),
                                             tool_choice="auto")
    assert free.tool_calls  # what the demo does when it may call
    held = Chat(engine, "none-held").respond(ask, [WEATHER], SamplingParams(max_tokens=40), tool_choice="none")
    assert not held.tool_calls and held.text and "<tool_call>" not in held.raw_text
    assert held.usage.prompt_tokens == free.usage.prompt_tokens  # the tools are listed all the same


def test_parallel_tool_calls_false_gives_one_call_in_stream_and_result(engine):
    """Defect 2: parallel_tool_calls=False: the first call only, streamed and returned alike."""
    chat = Chat(engine)
    output = TRUTH_OUTPUTS[1]
    both = chat.on(ScriptedHandle([output])).respond(HELLO, [WEATHER])
    assert len(both.tool_calls) == 2
    for chunks in (list(output), [output]):
        deltas = list(chat.on(ScriptedHandle(chunks)).stream_respond(HELLO, [WEATHER], parallel_tool_calls=False))
        text, calls, result = streamed_turn(deltas)
        assert calls == [(c.id, c.name, c.arguments) for c in result.tool_calls]
        assert [(n, a) for _, n, a in calls] == [("get_weather", {"city": "Paris"})]
        assert result.finish_reason == "tool_calls" and text == result.text == "Let me check."

    async def streamed():
        return [d async for d in chat.on(ScriptedHandle(list(output))).astream_respond(
            HELLO, [WEATHER], parallel_tool_calls=False)]
    assert [c.name for c in asyncio.run(streamed())[-1].result.tool_calls] == ["get_weather"]


class ArrivedTogether(ScriptedEvents):
    """Events that all wait to be read by the time the reader comes (a loop behind the steps)."""

    def ready(self) -> bool:
        return True


class TogetherHandle(ScriptedHandle):
    def stream(self, params, *, prompt=None):
        self.requests.append(ArrivedTogether(self.chunks, self.reason))
        return self.requests[-1]


def test_async_batches_are_the_deltas_made_at_once(engine):
    """`turn.arun_batches` (what a server writes, one send each): events read one at a time give a
    list each, the result's last; events all waiting give one list; flattened, both are `arun`'s."""
    chat = Chat(engine)
    chunks = list("Let me check the weather.")

    def batches(handle):
        async def read():
            return [b async for b in turn.arun_batches(chat.on(handle).opener(HELLO, [WEATHER]))]
        return asyncio.run(read())

    async def deltas():
        return [d async for d in chat.on(ScriptedHandle(chunks)).astream_respond(HELLO, [WEATHER])]

    apart, together = batches(ScriptedHandle(chunks)), batches(TogetherHandle(chunks))
    assert len(together) == 1 and together[0][-1].result is not None
    assert len(apart) > len(chunks) // 2 and all(d.result is None for b in apart[:-1] for d in b)
    assert [d for b in apart for d in b] == [d for b in together for d in b] == asyncio.run(deltas())
    assert "".join(d.text for d in together[0]) == together[0][-1].result.text == "".join(chunks)


class ThreadNoted(ScriptedEvents):
    """Events whose `stop` notes the thread it ran in (the engine's waits on its lock, a step)."""

    def stop(self) -> None:
        self.stopped_in = threading.current_thread()
        super().stop()


class ThreadNotedHandle(ScriptedHandle):
    def stream(self, params, *, prompt=None):
        self.requests.append(ThreadNoted(self.chunks, self.reason))
        return self.requests[-1]


def test_an_async_single_call_turn_stops_its_request_off_the_event_loop(engine):
    """parallel_tool_calls=False on an event loop: the stop after the call waits on the engine's
    lock, which a running step holds, so it ran on the loop and held every other turn of that loop
    (a server's clients) for up to a step. It runs in Hibana's worker threads, as the deadline's does."""
    chat = Chat(engine)
    handle = ThreadNotedHandle([CALL, "\n", CALL.replace("Paris", "Oslo")] + ["more"] * 5)

    async def streamed():
        deltas = [d async for d in chat.on(handle).astream_respond(HELLO, [WEATHER], parallel_tool_calls=False)]
        return deltas, threading.current_thread()
    deltas, loop_thread = asyncio.run(streamed())
    assert [c.name for c in deltas[-1].result.tool_calls] == ["get_weather"]
    assert deltas[-1].result.finish_reason == "tool_calls"
    assert handle.requests[0].stopped and handle.requests[0].stopped_in is not loop_thread


def test_single_call_turn_stops_generating_after_the_call(engine, monkeypatch):
    """parallel_tool_calls=False: once the call is complete the request is stopped, not run on;
    the turn still ends as "tool_calls" with its usage complete."""
    chat = Chat(engine)
    output = [CALL, "\n", CALL.replace("Paris", "Oslo")] + ["more"] * 50
    handle = ScriptedHandle(output)
    result = chat.on(handle).respond(HELLO, [WEATHER], parallel_tool_calls=False)
    assert [c.name for c in result.tool_calls] == ["get_weather"] and result.finish_reason == "tool_calls"
    assert result.usage.completion_tokens == 1 and handle.requests[0].stopped

    async def streamed():
        return [d async for d in chat.on(ScriptedHandle(output)).astream_respond(
            HELLO, [WEATHER], parallel_tool_calls=False)]
    last = asyncio.run(streamed())[-1].result
    assert last.finish_reason == "tool_calls" and last.usage.completion_tokens == 1
    # on the demo model, which writes the call again after a prefilled one unless stopped (20
    # tokens, then it ends by itself). When the stop lands is the reader's lag behind the engine's
    # thread (7 tokens seen on a loaded CI machine), so what is asserted is that the turn asks
    # for it at once: at the first event after the (prefilled) call, once; that a stop ends a
    # request is test_state_api's test_a_stream_stopped_early_still_ends_with_its_completion.
    seen, stopped_at = [0], []
    on_event, stop_now = turn.TurnRun.on_event, turn.TurnRun.stop_now

    def counted(self, event):
        seen[0] += 1
        return on_event(self, event)

    def watched(self):
        stopping = stop_now(self)
        if stopping:
            stopped_at.append(seen[0])
        return stopping
    monkeypatch.setattr(turn.TurnRun, "on_event", counted)
    monkeypatch.setattr(turn.TurnRun, "stop_now", watched)
    real = Chat(engine, "single-call")
    result = real.respond(HELLO, [WEATHER], SamplingParams(max_tokens=64, speculation="off"), prefill=CALL + "\n",
                          parallel_tool_calls=False)
    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
    assert stopped_at == [1], stopped_at  # the request was told to stop at its first event
    assert len(real.handle.tokens) == result.usage.prompt_tokens + result.usage.completion_tokens


def test_a_reply_stopped_before_its_end_token_is_kept_where_the_prompt_ends_it(engine):
    """A turn stopped after its one call (parallel_tool_calls=False) or at max_tokens holds no
    end-of-turn token, and the engine may have run a token or two past the stop. Its tokens
    still spell the reply the next prompt sends back: they are kept (not re-tokenized) up to
    where the prompt closes that reply, so a model's own spelling of a call is no recompute."""
    chat = Chat(engine, "stopped-reply")
    tokenizer = engine.tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    asked = HELLO + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    then = asked + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    first = str(chat.render_text(HELLO, [WEATHER]))
    rendered = str(chat.render_text(then, [WEATHER]))
    reply = rendered[len(first):rendered.index("<|im_end|>", len(first))]
    spelled = [t for ch in reply for t in tokenizer.encode(ch, add_special_tokens=False)]  # not the tokenizer's way
    assert spelled != tokenizer.encode(reply, add_special_tokens=False)
    prompt = chat.prompt_ids(HELLO, [WEATHER])
    # the engine runs on by what is in flight when the stop lands: with speculation, a step of
    # accepted drafts (up to MAX_DRAFT_TOKENS + 1 tokens) and the step launched after it
    again = tokenizer.encode("\n<tool_call>\n" + CALL, add_special_tokens=False)
    long_run = (again * (1 + 2 * (MAX_DRAFT_TOKENS + 1) // len(again)))[:2 * (MAX_DRAFT_TOKENS + 1)]
    for run_on in ([], tokenizer.encode("\n<tool_call>", add_special_tokens=False), long_run):
        chat.handle.sync(prompt + spelled + run_on)
        kept = prompt + spelled
        assert chat.prompt_ids(then, [WEATHER])[:len(kept)] == kept


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}}, "required": ["answer"],
          "additionalProperties": False}


def test_a_json_schema_beside_tools_holds_the_answer_and_leaves_the_calls(engine):
    """OpenAI's response_format with tools: the model may still call (greedy, the same call as
    without the schema), and its text answer, once it has the tool's result, follows the schema."""
    import jsonschema

    task_list, tools = agent_setup(3, ("weather", "arithmetic"))
    schemas = [t.schema for t in tools]
    for i, task in enumerate(task_list):
        messages = [{"role": "user", "content": task.question}]
        free = Chat(engine, f"free-{i}").respond(messages, schemas, SamplingParams(max_tokens=120))
        chat = Chat(engine, f"answer-{i}")
        held = chat.respond(messages, schemas, SamplingParams(max_tokens=120, json_schema=ANSWER))
        assert free.tool_calls and held.finish_reason == "tool_calls"
        calls = [(c.name, c.arguments) for c in free.tool_calls]
        assert [(c.name, c.arguments) for c in held.tool_calls] == calls
        forced = Chat(engine, f"forced-{i}").respond(  # "required": calls, whatever the schema
            messages, schemas, SamplingParams(max_tokens=120, json_schema=ANSWER), tool_choice="required")
        assert [(c.name, c.arguments) for c in forced.tool_calls] == calls and forced.text == ""
        messages += [assistant_message(held)] + [
            {"role": "tool", "tool_call_id": c.id, "content": run_tool(tools, c.name, c.arguments)}
            for c in held.tool_calls]
        answer = chat.respond(messages, schemas, SamplingParams(max_tokens=120, json_schema=ANSWER))
        assert answer.finish_reason == "stop" and not answer.tool_calls, answer.raw_text
        jsonschema.validate(json.loads(answer.text), ANSWER)


def test_a_json_schema_beside_tools_is_refused_where_it_cannot_be_held(engine):
    """A call format that builds its own grammar (harmony's channels) or has none cannot take an
    answer schema beside calls: ConfigError naming both ways out; a schema keyword the grammar
    cannot hold is the GrammarError a json_schema alone gets."""
    from hibana_core import ConfigError, GrammarError

    class OwnGrammar:
        def tool_call_grammar(self, tools, tool_choice, parallel):
            return {"type": "structural_tag", "format": {"type": "any_text"}}

    tools = [WEATHER]
    for parser, name in ((OwnGrammar(), "own"), (object(), "unknown")):
        with pytest.raises(ConfigError, match="either drop the tools .* or drop json_schema"):
            turn.answer_or_calls(parser, name, tools, "auto", ANSWER)
    # a call forced: the schema has no text to hold, the parser's own grammar of calls serves
    assert turn.answer_or_calls(OwnGrammar(), "own", tools, "required", ANSWER)["format"] == {"type": "any_text"}
    with pytest.raises(ConfigError, match="either drop the tools"):
        turn.answer_or_calls(object(), "unknown", tools, "required", ANSWER)
    with pytest.raises(GrammarError, match=r"not at #/properties/answer"):
        Chat(engine, "unheld").respond(HELLO, tools, SamplingParams(max_tokens=8, json_schema={
            "type": "object", "properties": {"answer": {"type": "integer", "not": {"const": 3}}}}))


GEMMA_LIKE = ("{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_template_without_tools_refuses_tools_rather_than_hide_them(engine):
    """A chat template with no tools section (Gemma 3's, Phi-3's) drops the tools it is given: the
    model would not see them, yet the grammar would make it call one. Refused, with what to do;
    the same chat answers without tools."""
    from hibana_core.chat import ConversationError

    chat = Chat(engine, "no-tools-template")
    chat.template = GEMMA_LIKE
    user = [{"role": "user", "content": "What's the weather in Oslo?"}]
    for choice in ("auto", "required", "none"):
        with pytest.raises(ConversationError, match="does not render tools.*register_chat_formats"):
            chat.respond(user, [WEATHER], SamplingParams(max_tokens=4), tool_choice=choice)
    assert chat.respond(user, params=SamplingParams(max_tokens=4)).usage.completion_tokens >= 1
    assert "get_weather" in Chat(engine, "own-template").render_text(user, [WEATHER])  # the demo's renders them



def test_a_tool_without_a_description_renders(engine):
    """OpenAI's description is optional, and templates (gpt-oss's) read it unguarded: a tool
    without one reaches the template with an empty description, not a Jinja error."""
    chat = Chat(engine, "no-description")
    chat.template = ("{% for t in tools %}{{ t.function.name }}: {{ t.function.description.strip() }}\n{% endfor %}"
                     + GEMMA_LIKE)
    bare = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    assert "lookup: \n" in chat.render_text([{"role": "user", "content": "hi"}], [bare])


def test_a_plugin_tool_parser_that_is_none_or_breaks_is_a_hibana_error(engine):
    """A parser registered as its class or as an object without parse/stream is a ConfigError
    when named; one that raises, or returns another type, fails its turn with a HibanaError that
    names it, the state put back and the engine serving the next call (they were bare TypeErrors,
    AttributeErrors and the plugin's own exceptions: a new user's trial)."""
    from hibana_core.errors import ConfigError
    from hibana_plugins.hookspecs import ParsedOutput, hookimpl
    from hibana_plugins.manager import reset_plugin_manager

    class Raises:
        def parse(self, text):
            return ParsedOutput(text, [])

        def stream(self):
            return self

        def feed(self, text):
            raise ZeroDivisionError("a parser bug")

    class Strings(Raises):
        def feed(self, text):
            return text  # a str where a list of pieces is due

    class BadGrammar(Raises):
        def tool_call_grammar(self, tools, tool_choice, parallel):
            return {}["no grammar here"]

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            register("as_class", Raises)
            register("nothing", object())
            register("raises", Raises())
            register("strings", Strings())
            register("bad_grammar", BadGrammar())

    reset_plugin_manager()
    get_plugin_manager().register(Plugin(), name="hibana-test-parsers")
    try:
        for name in ("as_class", "nothing"):
            with pytest.raises(ConfigError, match=rf"tool parser '{name}' is registered as .*no tool parser object"):
                Chat(engine, tool_parser=name)
        for name, says in (("raises", "failed in feed: ZeroDivisionError"),
                           ("strings", "returned GeneratedText from feed, not a list"),
                           ("bad_grammar", "failed building its call grammar: KeyError")):
            chat = Chat(engine, f"parser-{name}", tool_parser=name)
            with pytest.raises(HibanaError, match=rf"tool parser '{name}' .*{says}"):
                chat.respond(HELLO, tools=[WEATHER], params=SamplingParams(max_tokens=8))
            assert chat.handle.tokens == [], "the state is put back as it was"
    finally:
        reset_plugin_manager()
    assert Chat(engine, "after-parsers").respond(HELLO, params=SamplingParams(max_tokens=4)).usage.completion_tokens


def test_a_call_required_of_a_parser_without_call_syntax_is_a_tool_choice_error(engine):
    """A plugin's tool parser with neither call_syntax nor tool_call_grammar gives no grammar to
    hold a call to: tool_choice "required" or a tool's name was dropped without a word (the model
    answered in text, finish "length"). It is a ToolChoiceError naming the parser; "auto" runs."""
    from hibana_plugins.hookspecs import ParsedOutput, hookimpl
    from hibana_plugins.manager import reset_plugin_manager

    class Plain:
        def parse(self, text):
            return ParsedOutput(text, [])

        def stream(self):
            return self

        def feed(self, text):
            return [text]

        def close(self):
            return []

        def finish(self):
            return ParsedOutput("", [])

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            register("plain", Plain())

    reset_plugin_manager()
    get_plugin_manager().register(Plugin(), name="hibana-test-plain-parser")
    try:
        chat = Chat(engine, "plain-parser", tool_parser="plain")
        for choice in ("required", "get_weather"):
            with pytest.raises(ToolChoiceError, match=rf"tool_choice='{choice}' asks for a call, and the plain tool "
                                                      "parser .* has no call syntax"):
                chat.respond(HELLO, tools=[WEATHER], tool_choice=choice, params=SamplingParams(max_tokens=4))
            assert chat.handle.tokens == [], "the state is put back as it was"
        assert chat.respond(HELLO, tools=[WEATHER], params=SamplingParams(max_tokens=4)).usage.completion_tokens
    finally:
        reset_plugin_manager()


@contextlib.contextmanager
def with_plugin(plugin, name: str):
    """`plugin` registered on a fresh plugin manager until the block ends (then the manager is fresh again)."""
    from hibana_plugins.manager import reset_plugin_manager

    reset_plugin_manager()
    get_plugin_manager().register(plugin, name=name)
    try:
        yield
    finally:
        reset_plugin_manager()


def test_a_plugin_chat_format_that_breaks_is_an_error_naming_it_and_what_is_wrong(engine):
    """A chat format's template that is no string or no valid Jinja was a ConversationError at the
    first call ("cannot render the conversation", blaming the user's messages); its
    prepare_messages raising was the plugin's bare exception; a tool_parser that no plugin
    registers was a PluginError that did not say which format asked. Each is now a ConfigError
    (PluginError for the missing parser) naming the chat format, its plugin and the attribute at
    fault: the template's when the Chat is made. A refusal of the conversation (a ConversationError
    from prepare_messages, a template that raises on it) stays a ConversationError."""
    from hibana_core.errors import ConfigError, ConversationError, PluginError
    from hibana_plugins.hookspecs import hookimpl

    def prepare_raises(messages):
        raise RuntimeError("a bug in prepare_messages")

    def prepare_refuses(messages):
        raise ConversationError("this format takes no such conversation")

    refusing = "{% if messages[0].content == 'Hello!' %}{{ raise_exception('no hellos here') }}{% endif %}hi"
    named = r"chat format 'qwen3' \(an instance of .*BrokenFormat\)"
    cases = [  # attributes, what goes wrong, when: at Chat(engine) ("made") or at a render
        ({"template": 42}, ConfigError,
         rf"{named} has template = int 42, where a Jinja template \(str\) or None belongs", "made"),
        ({"template": "{% for m in messages %}{{ m.content }"}, ConfigError,
         rf"{named} has a template that is no valid Jinja \(unexpected '}}', line 1\)", "made"),
        ({"end_of_turn_tokens": "<|im_end|>"}, ConfigError, rf"{named} has end_of_turn_tokens = str '<\|im_end",
         "made"),
        ({"always_thinks": "yes"}, ConfigError, rf"{named} has always_thinks = str 'yes', where True or False", "made"),
        ({"tool_parser": "no_such_parser"}, PluginError,
         rf"{named} names tool parser 'no_such_parser' \(its tool_parser\), and no tool parser named", "made"),
        ({"prepare_messages": staticmethod(prepare_raises)}, ConfigError,
         rf"{named} failed in prepare_messages: RuntimeError\('a bug in prepare_messages'\)", "render"),
        ({"prepare_messages": staticmethod(tuple)}, ConfigError,
         rf"{named} returned tuple .* from prepare_messages, not a list of messages", "render"),
        ({"prepare_messages": staticmethod(prepare_refuses)}, ConversationError, "takes no such conversation",
         "render"),
        ({"template": refusing}, ConversationError,
         rf"cannot render the conversation with {named}'s template: no hellos here", "render"),
    ]
    for attributes, error, says, when in cases:
        chat_format = type("BrokenFormat", (), attributes)()
        plugin = types.SimpleNamespace(register_chat_formats=hookimpl(lambda register: register("qwen3", chat_format)))
        with with_plugin(plugin, "hibana-test-format"):
            with pytest.raises(error, match=says):
                if when == "made":
                    Chat(engine)
                else:
                    Chat(engine).render_text(HELLO)
            if "tool_parser" in attributes:  # one the caller names is used instead
                assert Chat(engine, tool_parser="hermes").parser_name == "hermes"
    assert Chat(engine).render_text(HELLO)


def test_a_plugin_tool_parser_whose_results_hold_the_wrong_types_is_a_hibana_error(engine):
    """Tool parsers' results were checked by their outer type only: tool calls as dicts, a
    ToolCall's arguments as a JSON string (encoded twice over on the next turn, silently), content
    None, pieces of feed that are ints all passed into the result. Each is a HibanaError naming
    the parser and what it returned, the state put back."""
    from hibana_plugins.hookspecs import ParsedOutput, ToolCall, ToolCallDelta, hookimpl

    call = "call_" + "1" * 24

    def parser(finished=ParsedOutput("text", []), fed=(), closed=()):
        class Parser:
            def parse(self, text):
                return finished

            def stream(self):
                return self

            def feed(self, text):
                return list(fed)

            def close(self):
                return list(closed)

            def finish(self):
                return finished
        return Parser()

    cases = {
        "dict_calls": (parser(ParsedOutput("", [{"name": "get_weather", "arguments": {}}])),
                       r"returned a tool call that is dict .* from finish, not a ToolCall\(id, name, arguments\)"),
        "str_arguments": (parser(ParsedOutput("", [ToolCall(call, "get_weather", '{"city": "Oslo"}')])),
                          r"returned ToolCall\(.*arguments='.*from finish, where a ToolCall's .* arguments a dict"),
        "no_name": (parser(ParsedOutput("", [ToolCall(call, None, {})])),
                    "returned .* from finish, where a ToolCall's id and name"),
        "none_content": (parser(ParsedOutput(None, [])),
                         "returned a ParsedOutput whose content is NoneType from finish"),
        "int_error": (parser(ParsedOutput("", [], 1)), "returned a ParsedOutput whose error is int from finish"),
        "tuple_calls": (parser(ParsedOutput("", ())), "returned a ParsedOutput whose tool_calls is tuple from finish"),
        "int_pieces": (parser(fed=[123]), r"returned a list holding int 123 from feed, where text \(str\) and "
                                          "ToolCallDelta pieces belong"),
        "none_closed": (parser(closed=[None]), "returned a list holding NoneType None from close"),
        "dict_fragment": (parser(fed=[ToolCallDelta(0, call, "get_weather", {"city": "Oslo"})]),
                          "returned .* from feed, whose id and name are str or None and arguments_fragment a str"),
    }
    plugin = types.SimpleNamespace(register_tool_parsers=hookimpl(
        lambda register: [register(name, p) for name, (p, _) in cases.items()]))
    with with_plugin(plugin, "hibana-test-sloppy-parsers"):
        for name, (_, says) in cases.items():
            chat = Chat(engine, f"contents-{name}", tool_parser=name)
            with pytest.raises(HibanaError,
                               match=rf"tool parser '{name}' \(an instance of .*\) {says}.*; fix its plugin"):
                chat.respond(HELLO, tools=[WEATHER], params=SamplingParams(max_tokens=3))
            assert chat.handle.tokens == [], "the state is put back as it was"


def test_ignore_eos_runs_a_chat_turn_past_its_end_of_turn_token(engine):
    """`ignore_eos=True` was dropped by the chat layer, which always stopped at the end-of-turn
    token (the demo's <|im_end|>, its EOS too): a turn ran to max_tokens on a state handle and
    stopped after ten tokens in a chat. It runs on as the handle's generate does (and vLLM's
    chat), with or without tools, streamed alike; the reply is all it generated, and the next
    turn renders and reuses it. A grammar still ends at the EOS where it allows nothing else
    (its last resort). The end-of-turn tokens it ran past are control text, not content (they
    were left in the reply's text, streamed and whole)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    chat = Chat(engine, "ignore-eos")
    prompt = chat.prompt_ids(HELLO)
    result = chat.respond(HELLO, params=params)
    assert (result.finish_reason, result.usage.completion_tokens) == ("length", 40)
    raw = engine.open_state("ignore-eos-raw")
    raw.sync(prompt)
    completion = raw.generate(params)
    assert set(completion.token_ids[:-1]) & set(chat.stop_token_ids), "the turn ran past an end of turn"
    # the end-of-turn tokens it ran past are in the raw text, not in the content (vLLM's text skips them)
    assert result.raw_text == completion.text and "<|im_end|>" in result.raw_text
    assert result.text == completion.text.replace("<|im_end|>", "").strip()
    streamed = list(Chat(engine, "ignore-eos-stream").stream_respond(HELLO, params=params))[-1].result
    assert (streamed.text, streamed.finish_reason) == (result.text, "length")

    with_tools = Chat(engine, "ignore-eos-tools").respond(HELLO, [WEATHER], params)
    assert with_tools.usage.completion_tokens == 40

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    answer = Chat(engine, "ignore-eos-json").respond(
        HELLO, params=SamplingParams(max_tokens=60, ignore_eos=True, json_schema=schema))
    assert answer.finish_reason == "stop" and answer.usage.completion_tokens < 60
    assert set(json.loads(answer.text)) == {"a"}

    follow_up = [*HELLO, assistant_message(result), {"role": "user", "content": "Thanks!"}]
    after = chat.respond(follow_up, params=SamplingParams(max_tokens=4))
    assert after.usage.cached_tokens >= len(prompt) and after.usage.completion_tokens >= 1


@pytest.mark.parametrize("parameters, says", [
    ({"type": "object", "properties": {"x": {"type": "strang"}}, "required": ["x"]}, "at properties/x/type"),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "required": "x"}, "'x' is not of type 'array'"),
    ({"type": "object", "properties": [1, 2]}, "at properties"),
    ({"type": "object", "properties": {"x": {"type": "integer", "minimum": "a"}}}, "at properties/x/minimum"),
])
def test_a_tool_schema_that_breaks_json_schema_is_refused(parameters, says):
    """A mistake in a tool's schema is a ToolSchemaError saying where, not a schema the grammar
    leaves free (the call's arguments would then ignore even its valid parts); keywords JSON
    Schema does not define stay allowed."""
    from hibana_core.messages import ToolSchemaError, normalize_tools

    with pytest.raises(ToolSchemaError, match=f"not a valid JSON schema: .*{says}"):
        normalize_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    ok = {"type": "object", "properties": {"x": {"type": ["string", "null"], "x-vendor": 1}}, "$defs": {}}
    assert normalize_tools([{"type": "function", "function": {"name": "f", "parameters": ok}}])



@pytest.mark.parametrize("parameters, says", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}, "required": ["a"]},
     r"\$ref '#/\$defs/nope' points at nothing in the schema \(at /properties/a\)"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#here"}]}}}, r"\$ref '#here' points at nothing"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "property 'a' has an empty enum"),
    ({"type": "object", "allOf": [{}], "properties": {"a": {"$ref": "#/allOf/\u00b2"}}}, "points at nothing"),
])
def test_a_tool_schema_no_arguments_can_meet_is_refused(parameters, says):
    """Valid JSON Schema that no arguments meet (the grammar would not compile it, and the
    arguments would have been left free): a ToolSchemaError saying where."""
    from hibana_core.messages import ToolSchemaError, normalize_tools

    with pytest.raises(ToolSchemaError, match=f"no arguments can meet: .*{says}"):
        normalize_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])


def test_references_that_resolve_and_data_that_looks_like_schemas_pass():
    from hibana_core.messages import normalize_tools

    refs = {"type": "object", "properties": {"a": {"$ref": "#/$defs/a~1b"}, "b": {"$ref": "#there"},
                                             "c": {"$ref": "#"}, "d": {"$ref": "#/properties/a"},
                                             "e": {"$ref": "#/$defs/a%20c"}, "f": {"$ref": "#/%24defs/x"},
                                             "h": {"$ref": "#dyn"},
                                             "i": {"default": {"$ref": "#/components/x"}, "const": {"enum": []}},
                                             "j": {"not": {"enum": []}},
                                             "k": {"$id": "https://example.com/k", "$ref": "#/$defs/local",
                                                   "$defs": {"local": {"type": "integer"}}}},
            "$defs": {"a/b": {"type": "integer"}, "c": {"$anchor": "there", "type": "string"},
                      "a c": {"type": "number"}, "x": {"type": "boolean"},
                      "dyn": {"$dynamicAnchor": "dyn"},
                      "unused": {"enum": []}}}
    assert normalize_tools([{"type": "function", "function": {"name": "f", "parameters": refs}}])
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"a": {"$ref": "#old"}}, "definitions": {"d": {"$id": "#old", "type": "string"}}}
    assert normalize_tools([{"type": "function", "function": {"name": "f", "parameters": draft7}}])


LLAMA3_TEMPLATE = """\
{{- bos_token + "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools %}{{- "Environment: ipython\\n" }}
{%- for t in tools %}{{- t | tojson(indent=4) + "\\n\\n" }}{% endfor %}{% endif %}
{{- "<|eot_id|>" }}
{%- for m in messages %}
{%- if m.tool_calls %}{% set call = m.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": ' }}
{{- call.arguments | tojson + '}<|eot_id|>' }}
{%- elif m.role == "tool" %}{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + m.content + "<|eot_id|>" }}
{%- else %}{{- "<|start_header_id|>" + m.role + "<|end_header_id|>\\n\\n" + m.content | trim + "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{% endif %}"""
"""Llama 3.1's template as far as calls go: past calls as {"name": ..., "parameters": ...}."""


def _llama3_checkpoint(path, template: str):
    """A tiny llama checkpoint with Llama 3's special tokens and `template` as its chat template."""
    import tiny_models

    path = tiny_models.make_tiny_checkpoint("llama", path, vocab_size=tiny_models.VOCAB_SIZE + 5)
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]})
    tokenizer.bos_token, tokenizer.chat_template = "<|begin_of_text|>", template
    tokenizer.save_pretrained(path)
    return path


def test_a_llama3_template_gets_the_llama3_json_parser(engine, tmp_path):
    """A Llama 3.x checkpoint (model_type "llama", no chat format) writes its calls as its template
    does, `{"name": ..., "parameters": ...}`, after `<|python_tag|>` or not: the chat layer reads
    them with llama3_json without being told (hermes read them as text, so `hibana serve` and the
    adapters, which name no parser, never returned a Llama 3 call); Qwen-style templates keep hermes."""
    import tiny_models

    path = _llama3_checkpoint(tmp_path, LLAMA3_TEMPLATE)
    assert Chat(engine).parser_name == "hermes"
    with tiny_models.open_engine(path) as llama:
        chat = Chat(llama)
        assert chat.parser_name == "llama3_json"
        for output in ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                       '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'):
            result = chat.on(ScriptedHandle([output])).respond(HELLO, [WEATHER])
            assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
            assert result.finish_reason == "tool_calls" and result.text == ""
        assert Chat(llama, tool_parser="hermes").parser_name == "hermes"


LLAMA31_TEMPLATE = LLAMA3_TEMPLATE.replace(
    "{%- if m.tool_calls %}",
    "{%- if m.tool_calls %}{% if not m.tool_calls|length == 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}")
"""Llama 3.1-3.3's as far as several calls go: an assistant message of more than one call raises."""


def test_a_template_of_one_call_a_message_gets_one_call_a_turn_and_renders_past_parallel_calls(engine, tmp_path):
    """Llama 3.1's template raises on an assistant message of several calls, so a turn that made two
    (the grammar let it) made the agent's next turn fail, and so did a history from another model.
    Such a template gets one call a turn (as parallel_tool_calls=False), and a past turn of several
    calls is written as one call a message, each followed by its result (by id, else in order)."""
    import tiny_models

    path = _llama3_checkpoint(tmp_path, LLAMA31_TEMPLATE)
    assert not Chat(engine).one_call
    with tiny_models.open_engine(path) as llama:
        chat = Chat(llama)
        assert chat.one_call and chat.parser_name == "llama3_json"
        two = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_weather", "parameters": {"city": "Rome"}}')
        result = chat.on(ScriptedHandle([two])).respond(HELLO, [WEATHER])
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
        streamed = list(chat.on(ScriptedHandle(list(two))).stream_respond(HELLO, [WEATHER]))
        assert [c.arguments for c in streamed[-1].result.tool_calls] == [{"city": "Paris"}]

        def call(i, city):
            return {"id": f"call_{i}", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        parallel = HELLO + [{"role": "assistant", "content": "", "tool_calls": [call(1, "Paris"), call(2, "Rome")]},
                            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
                            {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
        split = HELLO + [{"role": "assistant", "content": "", "tool_calls": [call(1, "Paris")]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sun"},
                         {"role": "assistant", "content": "", "tool_calls": [call(2, "Rome")]},
                         {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
        assert chat.render(parallel, [WEATHER]) == chat.render(split, [WEATHER])
        unnamed = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in parallel]
        assert "rain" in str(chat.render_text(unnamed, [WEATHER])).split("Rome")[0]  # no ids: in order
        with pytest.raises(ConversationError, match="call_9"):  # a result for no call of the turn
            chat.render(parallel[:-1] + [{"role": "tool", "tool_call_id": "call_9", "content": "?"}], [WEATHER])


def test_a_llama3_call_may_open_with_its_python_tag_under_the_grammar(tmp_path):
    """Llama 3.x opens a call with <|python_tag|> as often as not, and llama3_json reads it so; but
    the call grammar blocked the control token (free text never holds one): a GrammarError for the
    model's own format, with the grammar on and with guided=False. The tag may open the calls now,
    where the vocabulary has it; elsewhere the grammar is as before."""
    import tiny_models

    from hibana_core.speculation import force_outputs

    with tiny_models.open_engine(_llama3_checkpoint(tmp_path, LLAMA31_TEMPLATE)) as llama:
        call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
        for n, (reply, options) in enumerate([(f"<|python_tag|>{call}<|eot_id|>", {}),
                                              (f"<|python_tag|>{call}<|eot_id|>", {"guided": False}),
                                              (f"<|python_tag|>{call}<|eot_id|>", {"tool_choice": "required"}),
                                              (f"{call}<|eot_id|>", {"tool_choice": "get_weather"})]):
            ids = llama.tokenizer.encode(reply, add_special_tokens=False)
            force_outputs(llama.open_state(f"tag-{n}"), ids)
            result = Chat(llama, f"tag-{n}").respond(HELLO, [WEATHER], SamplingParams(max_tokens=len(ids)), **options)
            assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Rome"})], options
        # a prefill still starts in the grammar's free text (the "or" around it refused one)
        assert Chat(llama, "prefilled").respond(HELLO, [WEATHER], SamplingParams(max_tokens=3), prefill="Sure, ").usage


MISTRAL_TEMPLATE = """{{- bos_token }}
{%- if tools %}{{- "[AVAILABLE_TOOLS] " + tools|tojson + "[/AVAILABLE_TOOLS]" }}{%- endif %}
{%- for m in messages %}
{%- if m.role == "user" %}{{- "[INST] " + m.content + "[/INST]" }}
{%- elif m.role == "assistant" and m.tool_calls %}{{- "[TOOL_CALLS] [" }}
{%- for c in m.tool_calls %}
{%- if c.id is not defined or c.id|length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
{{- '{"name": "' + c.function.name + '", "arguments": ' + c.function.arguments|tojson + ', "id": "' + c.id + '"}' }}
{%- if not loop.last %}{{- ", " }}{%- endif %}
{%- endfor %}{{- "]" + eos_token }}
{%- elif m.role == "assistant" %}{{- " " + m.content + eos_token }}
{%- elif m.role == "tool" %}
{%- if m.tool_call_id is not defined or m.tool_call_id|length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
{{- '[TOOL_RESULTS] {"content": ' + m.content|tojson + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""
"""Mistral 7B v0.3's template as far as calls go: [TOOL_CALLS] and an array, 9-character ids or it raises."""

MISTRAL_MARKERS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"]


def mistral_checkpoint(path, template: str = MISTRAL_TEMPLATE):
    """The tiny mistral checkpoint with Mistral's control tokens and `template`."""
    import tiny_models

    path = tiny_models.make_tiny_checkpoint("mistral", path, vocab_size=tiny_models.VOCAB_SIZE + len(MISTRAL_MARKERS))
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": MISTRAL_MARKERS})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def test_a_result_for_a_call_not_made_names_the_ids_the_client_sent(tmp_path):
    """Where the template's ids are 9 characters, a tool result that answers no call of the message
    before it is refused naming the client's ids ("call_9", "call_1"), not the 9-character ones
    derived from them, which the client never saw."""
    import tiny_models

    with tiny_models.open_engine(mistral_checkpoint(tmp_path)) as mistral:
        conversation = HELLO + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
        with pytest.raises(ConversationError, match=r"'call_9'.*\['call_1'\]"):
            Chat(mistral).render_text(conversation)


def test_calls_and_results_without_ids_render_on_a_template_that_demands_them(tmp_path):
    """OpenAI-style histories may leave ids out (results pair with calls in order); Mistral's
    template raised a bare Jinja TypeError on them. A call gets an id derived from its place (the
    same on every turn), a result the first unanswered call's."""
    import tiny_models

    def call(city):
        return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
    with tiny_models.open_engine(mistral_checkpoint(tmp_path)) as mistral:
        conversation = HELLO + [{"role": "assistant", "content": "", "tool_calls": [call("Oslo"), call("Rome")]},
                                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"}]
        text = str(Chat(mistral).render_text(conversation))
        ids = re.findall(r'"id": "([0-9A-Za-z]{9})"', text)
        assert len(set(ids)) == 2 and text == str(Chat(mistral).render_text(conversation))
        named = [dict(m) for m in conversation]
        named[1] = {**named[1], "tool_calls": [{**c, "id": i} for c, i in zip(named[1]["tool_calls"], ids)]}
        named[2], named[3] = {**named[2], "tool_call_id": ids[0]}, {**named[3], "tool_call_id": ids[1]}
        assert str(Chat(mistral).render_text(named)) == text  # paired in order


def test_a_mistral_call_may_carry_the_id_its_template_writes(tmp_path):
    """Mistral's templates write past calls as {"name", "arguments", "id"}, and Nemo writes the id
    when it calls: the grammar refused it (a GrammarError for the model's own form). It may write
    one now, and the call keeps it."""
    import tiny_models

    from hibana_core.speculation import force_outputs

    with tiny_models.open_engine(mistral_checkpoint(tmp_path)) as mistral:
        reply = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcDEF123"}]'
        ids = mistral.tokenizer.encode(reply, add_special_tokens=False) + [tiny_models.EOS_ID]
        force_outputs(mistral.open_state("own-id"), ids)
        result = Chat(mistral, "own-id").respond(HELLO, [WEATHER], SamplingParams(max_tokens=len(ids)))
        assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [("abcDEF123", "get_weather",
                                                                              {"city": "Rome"})]


@pytest.mark.parametrize("form, markers, parser", [("array", "[TOOL_CALLS] [", "mistral"),
                                                    ("args", "[TOOL_CALLS][ARGS] [", "mistral_args"),
                                                    ("call_id", "[TOOL_CALLS][CALL_ID][ARGS] [", "mistral_call_id")],
                         ids=["array", "args", "call_id"])
def test_a_mistral_template_gets_the_mistral_parser_its_grammar_and_its_ids(tmp_path, form, markers, parser):
    """A Mistral checkpoint's template writes calls after its [TOOL_CALLS] token (an array; or
    NAME[ARGS]{...} where the template writes [ARGS]; NAME[CALL_ID]ID[ARGS]{...} where it writes
    [CALL_ID] too: the id the grammar made is the call's) and refuses any call id but 9 letters and
    digits: the chat layer reads the calls with the mistral parser, a forced call is held to that
    form by the grammar (the control token named by a `token` format), and ids from elsewhere
    (OpenAI's call_..., a client's own) render as the same 9 characters on every turn, so a tool
    loop goes on (the template raised on the second turn) and the KV of earlier turns is reused."""
    import tiny_models

    template = MISTRAL_TEMPLATE.replace("[TOOL_CALLS] [", markers)
    with tiny_models.open_engine(mistral_checkpoint(tmp_path, template)) as mistral:
        chat = Chat(mistral, "agent")
        assert chat.parser_name == parser
        short = {"type": "function", "function": {**WEATHER["function"], "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}
        first = chat.respond(HELLO, [short], tool_choice="required", parallel_tool_calls=False,
                             params=SamplingParams(max_tokens=80))
        assert first.finish_reason == "tool_calls", first.text
        assert [c.name for c in first.tool_calls] and {c.name for c in first.tool_calls} == {"get_weather"}
        assert all(re.fullmatch(r"[0-9a-zA-Z]{9}", c.id) for c in first.tool_calls)
        assert all(isinstance(c.arguments.get("city"), str) for c in first.tool_calls)
        if form == "call_id":  # the model's own id, as the grammar let it write one after [CALL_ID]
            assert f"get_weather[CALL_ID]{first.tool_calls[0].id}[ARGS]" in first.raw_text, first.raw_text
        foreign = [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0123456789abcdef01234567", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny"}]
        text = chat.render_text(HELLO + foreign)
        ids = re.findall(r'"(?:id|call_id)": "([^"]*)"', str(text))
        assert len(ids) == 2 and ids[0] == ids[1] and re.fullmatch(r"[0-9a-zA-Z]{9}", ids[0])
        assert str(chat.render_text(HELLO + foreign)) == str(text)  # the same ids each turn
        second = chat.respond(HELLO + foreign, [short], params=SamplingParams(max_tokens=40))  # "auto"
        assert second.usage.prompt_tokens > 0 and (second.tool_calls or "[TOOL_CALLS]" not in second.text)


def test_one_call_a_message_keeps_every_result_of_a_call():
    """Two results naming one call (a retried call) kept the last alone, and the next call lost
    its result to nothing."""
    from hibana_core.messages import one_call_a_message

    def call(i):
        return {"id": i, "type": "function", "function": {"name": "f", "arguments": {}}}
    split = one_call_a_message(HELLO + [{"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
                                        {"role": "tool", "tool_call_id": "a", "content": "first"},
                                        {"role": "tool", "tool_call_id": "a", "content": "retry"},
                                        {"role": "tool", "tool_call_id": "b", "content": "bee"}])
    assert [(m["role"], m.get("content"), [c["id"] for c in m.get("tool_calls", ())]) for m in split[1:]] == [
        ("assistant", "", ["a"]), ("tool", "first", []), ("tool", "retry", []),
        ("assistant", "", ["b"]), ("tool", "bee", [])]


def test_an_empty_tool_calls_list_is_no_calls():
    """`"tool_calls": []` (as clients send it) reached the template, and templates that test
    `'tool_calls' in message` (Llama 3.1's, Mistral's) took it for calls: "This model only supports
    single tool-calls at once!" for a message of none."""
    for empty in ([], None, ()):
        (message,) = normalize_messages([{"role": "assistant", "content": "Hello there.", "tool_calls": empty}])
        assert "tool_calls" not in message and message["content"] == "Hello there."


def test_a_json_schema_held_after_thinking_refuses_keywords_the_grammar_cannot_hold(tmp_path):
    """On a reasoning model (and harmony's channels) the answer's json_schema is held after the think
    block, as a structural tag's JSON content, which drops what the grammar cannot hold: a schema with
    `contains` was held without it, silently (a list without the 7 it asks for), where the same schema
    on a handle, or with thinking off, is a GrammarError naming it. strict_schema=False still runs."""
    from transformers import AutoTokenizer

    import reasoning_model
    import tiny_models
    from hibana_core import GrammarError
    from test_harmony import HARMONY_TEMPLATE, HARMONY_TOKENS

    schema = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"},
                                                     "contains": {"const": 7}}}, "required": ["n"]}
    harmony = tiny_models.make_tiny_checkpoint("gpt_oss", tmp_path / "harmony",
                                               vocab_size=tiny_models.VOCAB_SIZE + len(HARMONY_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(harmony)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(harmony)
    for path in (reasoning_model.make_reasoning_checkpoint(tmp_path / "qwen3"), harmony):
        with tiny_models.open_engine(path) as model:
            with pytest.raises(GrammarError, match="contains at #/properties/n"):
                Chat(model, "strict").respond(HELLO, None, SamplingParams(max_tokens=4, json_schema=schema))
            loose = SamplingParams(max_tokens=4, json_schema=schema, strict_schema=False)
            assert Chat(model, "loose").respond(HELLO, None, loose).usage.completion_tokens == 4
