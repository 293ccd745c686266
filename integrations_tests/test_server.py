"""`hibana serve` through the real `openai` client and LangChain's ChatOpenAI: a server on a free
port of 127.0.0.1, in this process, on the bundled demo model (nothing downloaded)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_core import ConfigError, Engine  # noqa: E402
from hibana_core.config import EngineConfig  # noqa: E402
from hibana_plugins.openai_api import STATE_HEADER  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402
from hibana_bench.serve_load import MULTIPLY, WEATHER  # noqa: E402 - the load test's tools

KEY = "test-key"


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo") as engine:
        yield engine


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(engine, ServerConfig("demo", api_key=KEY, max_body_bytes=64 << 10, max_tokens_limit=512)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)


def post(base_url: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    """A raw POST to the chat endpoint: what a client that is not the SDK sends."""
    request = urllib.request.Request(base_url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# --- the OpenAI API --------------------------------------------------------------------------------

def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list()] == ["demo"]
    assert abs(client.models.list().data[0].created - time.time()) < 24 * 3600  # when it began serving, not 1970
    assert client.models.retrieve("demo").id == "demo"  # GET /v1/models/{model}, as OpenAI serves it
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    with urllib.request.urlopen(base_url + "/health", timeout=10) as response:  # no key wanted
        assert json.loads(response.read()) == {"status": "ok"}
    with urllib.request.urlopen(urllib.request.Request(base_url + "/health", method="HEAD"), timeout=10) as response:
        assert response.status == 200  # a load balancer's probe


def test_plain_chat_is_the_in_process_reply(client, engine):
    messages = [{"role": "user", "content": "Hello!"}]
    reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=48)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    local = engine.chat("server-test-local").respond(messages, params=__import__("hibana_core").SamplingParams(
        max_tokens=48))
    assert choice.message.content == local.text
    assert reply.usage.prompt_tokens == local.usage.prompt_tokens
    assert reply.usage.completion_tokens == local.usage.completion_tokens > 0


def test_streaming_gives_the_same_text_and_a_usage_chunk(client):
    messages = [{"role": "user", "content": "Hello there!"}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=48)
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=48, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    # OpenAI's rule with include_usage: every other chunk has the field too, null (here, legacy completions too)
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
    texts = list(client.completions.create(model="demo", prompt="Hello", max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))
    assert all("usage" in c.model_fields_set and c.usage is None for c in texts[:-1]) and texts[-1].usage
    plain = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=4, stream=True))
    assert not any("usage" in c.model_fields_set for c in plain)  # asked for no usage: no field


def test_deltas_made_at_once_are_one_chunk_per_run_of_text():
    """Several tokens read in one go (a step's, or several steps' where the loop fell behind)
    stream as one content chunk, as OpenAI's multi-token deltas; calls and the result stay apart."""
    from hibana_core.turn import ChatDelta
    from hibana_plugins.hookspecs import ToolCallDelta
    from hibana_plugins.openai_api import Reply, joined

    call = ChatDelta(tool_call=ToolCallDelta(0, "call_1", "get_weather", '{"city"'))
    batch = [ChatDelta(text="Let"), ChatDelta(text=" me"), call, ChatDelta(text=" see"),
             ChatDelta(reasoning="hm"), ChatDelta(reasoning="m"), ChatDelta(text="!")]
    assert joined(batch) == [ChatDelta(text="Let me"), call, ChatDelta(text=" see"), ChatDelta(reasoning="hmm"),
                             ChatDelta(text="!")]
    chunks = Reply("demo").chunks(batch[:2])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Let me"}]


def test_tool_call_then_its_result_reuses_the_prompt(client):
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    first = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, MULTIPLY])
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "condition": "sunny"}'}]
    second = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, MULTIPLY])
    assert second.choices[0].message.content
    usage = second.usage
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
    assert usage.completion_tokens_details.reasoning_tokens == 0  # OpenAI's field: the demo does not think


def test_streamed_tool_call_deltas_by_index(client):
    stream = client.chat.completions.create(model="demo", stream=True, tools=[WEATHER, MULTIPLY],
                                            messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for piece in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or piece.id
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "multiply"}}])
def test_tool_choice_forces_a_call(client, choice):
    reply = client.chat.completions.create(model="demo", tools=[WEATHER, MULTIPLY], tool_choice=choice,
                                           messages=[{"role": "user", "content": "Hello!"}], max_tokens=64)
    names = [c.function.name for c in reply.choices[0].message.tool_calls]
    assert names and (choice == "required" or names == ["multiply"])


def test_allowed_tools_hold_the_calls_to_those_named_and_list_every_tool(client):
    """OpenAI's `allowed_tools` form: the prompt is the one with every tool (its KV reused as the
    allowed set changes), the calls only to the tools named; in `auto` mode the demo still calls."""
    ask = dict(model="demo", tools=[WEATHER, MULTIPLY], max_tokens=64,
               messages=[{"role": "user", "content": "What's the weather in Oslo?"}])
    listed = client.chat.completions.create(**ask, tool_choice="required").usage.prompt_tokens
    for mode in ("required", "auto"):
        reply = client.chat.completions.create(**ask, tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": mode, "tools": [{"type": "function", "function": {"name": "multiply"}}]}})
        assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["multiply"]
        assert reply.usage.prompt_tokens == listed


def test_max_completion_tokens_cuts_the_reply(client):
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello!"}],
                                           max_completion_tokens=3)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_parallel_tool_calls_false_gives_one_call(client):
    ask = dict(model="demo", tools=[WEATHER, MULTIPLY], tool_choice="required", max_tokens=96,
               messages=[{"role": "user", "content": "Weather in Oslo and in Rome?"}])
    assert len(client.chat.completions.create(**ask).choices[0].message.tool_calls) == 2  # the demo calls twice
    assert len(client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0].message.tool_calls) == 1


def test_a_reply_cut_by_max_tokens_inside_its_second_call_is_length_with_the_first_call(client):
    """As OpenAI and vLLM: output stopped by max_tokens is "length", calls or not; the complete
    call is a tool call and the cut one's markup is nobody's content, streamed or not."""
    ask = dict(model="demo", tools=[WEATHER, MULTIPLY], tool_choice="required",
               messages=[{"role": "user", "content": "Weather in Oslo and in Rome?"}])
    whole = client.chat.completions.create(**ask, max_tokens=96)
    assert len(whole.choices[0].message.tool_calls) == 2
    ask["max_tokens"] = whole.usage.completion_tokens - 4  # inside the second call's arguments
    cut = client.chat.completions.create(**ask).choices[0]
    assert cut.finish_reason == "length" and not cut.message.content
    assert [c.function for c in cut.message.tool_calls] == [whole.choices[0].message.tool_calls[0].function]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    named = [piece.function.name for c in chunks for piece in c.choices[0].delta.tool_calls or () if piece.id]
    assert named == [cut.message.tool_calls[0].function.name]


def test_tool_choice_none_lists_the_tools_and_calls_none(client):
    """As OpenAI's "none": the model sees the tools (the prompt is the one with them, so a tool
    loop's state goes on being reused) and writes no call, not even as text."""
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    first = client.chat.completions.create(model="demo", tools=[WEATHER], messages=messages, max_tokens=48)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "condition": "sunny"}'}]
    reply = client.chat.completions.create(model="demo", tools=[WEATHER], tool_choice="none", max_tokens=48,
                                           messages=messages)
    choice = reply.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
    assert "<tool_call>" not in choice.message.content
    assert reply.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens  # the loop's state
    auto = client.chat.completions.create(model="demo", tools=[WEATHER], messages=messages, max_tokens=1)
    assert reply.usage.prompt_tokens == auto.usage.prompt_tokens


def test_response_format_json_schema_holds_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Name a city."}], max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["city"] in ("Oslo", "Paris")
    assert reply.choices[0].finish_reason == "stop"


def test_response_format_keywords_the_grammar_cannot_hold_are_refused_only_when_strict(client):
    """As OpenAI: `strict` defaults to false, and a schema keyword the grammar cannot hold (`not`)
    is then left to the model, the rest of the schema held; with strict: true it is a 400 naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9,
                                                     "not": {"const": 3}}},
              "required": ["n"], "additionalProperties": False}
    ask = dict(model="demo", messages=[{"role": "user", "content": "Pick a digit."}], max_tokens=16)
    for strict in (None, False):
        spec = {"name": "digit", "schema": schema} | ({} if strict is None else {"strict": strict})
        reply = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": spec}, **ask)
        assert 0 <= json.loads(reply.choices[0].message.content)["n"] <= 9
    with pytest.raises(openai.BadRequestError, match="not at #/properties/n"):
        client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
            "name": "digit", "schema": schema, "strict": True}}, **ask)


def test_response_format_beside_tools_holds_the_answer_and_leaves_the_calls(client):
    """As OpenAI: with tools and a response_format the model may still call, and its text answer
    (here after the tool's result) follows the schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}}, "required": ["answer"],
              "additionalProperties": False}
    ask = dict(model="demo", tools=[WEATHER, MULTIPLY], max_tokens=96,
               response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    messages = [{"role": "user", "content": "What's the weather in Rome?"}]
    called = client.chat.completions.create(messages=messages, **ask).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.name == "get_weather"
    call = called.message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "condition": "sunny"}'}]
    answered = client.chat.completions.create(messages=messages, **ask).choices[0]
    assert answered.finish_reason == "stop" and not answered.message.tool_calls
    assert isinstance(json.loads(answered.message.content)["answer"], str)


def test_stop_strings_end_the_reply_before_them(client):
    messages = [{"role": "user", "content": "Hello!"}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=48).choices[0].message.content
    word = whole.split()[len(whole.split()) // 2]
    cut = client.chat.completions.create(model="demo", messages=messages, max_tokens=48, stop=[word]).choices[0]
    assert cut.message.content == whole[:whole.index(word)] and cut.finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something."}], max_tokens=24,
               temperature=1.5, top_p=0.95)
    replies = [client.chat.completions.create(**ask, seed=seed).choices[0].message.content for seed in (7, 7, 8)]
    assert replies[0] == replies[1] and replies[0] != replies[2]


def test_vllm_sampling_fields_in_extra_body_sample_as_asked(client):
    """vLLM's top_k, min_p and repetition_penalty (sent in extra_body) were a 400 "Unrecognized
    request argument"; they sample now: top_k=1 or min_p=1 at a high temperature is the greedy
    reply, a repetition penalty changes it, and out-of-range values are 400s."""
    import openai

    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something."}], max_tokens=24)
    greedy = client.chat.completions.create(**ask).choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        reply = client.chat.completions.create(**ask, temperature=1.5, seed=3, extra_body=extra)
        assert reply.choices[0].message.content == greedy, extra
    assert client.chat.completions.create(**ask, temperature=1.5, seed=3, extra_body={"top_k": -1}) \
        .choices[0].message.content != greedy
    penalized = client.chat.completions.create(**ask, extra_body={"repetition_penalty": 2.0})
    assert penalized.choices[0].message.content != greedy
    assert client.chat.completions.create(**ask, extra_body={"repetition_penalty": 3.0}).choices  # vLLM's: no cap
    for bad in ({"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**ask, extra_body=bad)


def test_vllm_stop_token_ids_and_ignore_eos(client, engine):
    """vLLM's stop_token_ids and ignore_eos were 400s though the engine takes both: a token of the
    greedy reply in stop_token_ids ends the reply before it; ignore_eos runs on to max_tokens."""
    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something."}], max_tokens=24)
    greedy = client.chat.completions.create(**ask).choices[0]
    ids = engine.tokenizer.encode(greedy.message.content, add_special_tokens=False)
    cut = client.chat.completions.create(**ask, extra_body={"stop_token_ids": [ids[2]]}).choices[0]
    assert cut.finish_reason == "stop" and greedy.message.content.startswith(cut.message.content)
    assert len(cut.message.content) < len(greedy.message.content)
    short = dict(ask, max_tokens=64)
    assert client.chat.completions.create(**short).usage.completion_tokens < 64  # the demo ends its turn
    on = client.chat.completions.create(**short, extra_body={"ignore_eos": True})
    assert on.usage.completion_tokens == 64 and on.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="stop_token_ids") as caught:
        client.chat.completions.create(**ask, extra_body={"stop_token_ids": [-1]})
    assert caught.value.body["param"] == "stop_token_ids"  # was "prompt", a field a chat request has not


def test_logit_bias_bans_and_favours_tokens_and_bad_biases_are_400s(client, engine, base_url):
    """logit_bias was refused (a 400); it biases the logits now, as OpenAI's and vLLM's: the greedy
    reply's first token at -100 never starts the reply again; keys that are no token id, biases
    out of [-100, 100] and ids past the vocabulary are 400s naming the field."""
    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something."}], max_tokens=16)
    greedy = client.chat.completions.create(**ask).choices[0]
    first = engine.tokenizer.encode(greedy.message.content, add_special_tokens=False)[0]
    biased = client.chat.completions.create(**ask, logit_bias={str(first): -100}).choices[0]
    assert biased.message.content != greedy.message.content
    assert engine.tokenizer.encode(biased.message.content, add_special_tokens=False)[0] != first
    hi = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for bias in ({"x": 1}, {"5": 101}, {"5": "high"}, {str(engine.vocab_size): 1}):
        status, reply = post(base_url, json.dumps({**hi, "logit_bias": bias}).encode())
        assert status == 400 and reply["error"]["param"] == "logit_bias", (bias, reply)


def test_openai_fields_known_but_not_served_are_taken_as_null_and_refused_otherwise(base_url):
    """Clients that write every field send `"audio": null`, `"functions": null`: those were 400
    "Unrecognized request argument" (a field OpenAI knows); null is taken now, and a value is a 400
    saying what to use instead. `prediction` (a speed hint) is taken and changes nothing."""
    hi = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    nulls = {name: None for name in ("audio", "functions", "function_call", "web_search_options", "prediction")}
    status, reply = post(base_url, json.dumps({**hi, **nulls}).encode())
    assert status == 200, reply
    status, reply = post(base_url, json.dumps({**hi, "prediction": {"type": "content", "content": "x"}}).encode())
    assert status == 200, reply
    for name, value, says in (("audio", {"voice": "alloy", "format": "wav"}, "text only"),
                              ("functions", [{"name": "f", "parameters": {}}], "tools"),
                              ("function_call", "auto", "tool_choice"),
                              ("web_search_options", {}, "search tool")):
        status, reply = post(base_url, json.dumps({**hi, name: value}).encode())
        assert status == 400 and reply["error"]["param"] == name and says in reply["error"]["message"], reply


def test_every_field_of_the_openai_clients_create_is_known(base_url, client):
    """Each argument of the installed openai client's chat.completions.create is a field the server
    knows: sent as null it is taken (prompt_cache_retention, prompt_cache_options and moderation
    were "Unrecognized request argument"), and reasoning_effort takes the client's levels."""
    import inspect
    import typing

    from openai.resources.chat.completions import Completions

    hi = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    own = {"self", "extra_headers", "extra_query", "extra_body", "timeout", "stream", *hi}
    names = [name for name in inspect.signature(Completions.create).parameters if name not in own]
    status, reply = post(base_url, json.dumps({**hi, **dict.fromkeys(names)}).encode())
    assert status == 200, reply
    from openai.types.shared.reasoning_effort import ReasoningEffort

    levels = [level for arg in typing.get_args(ReasoningEffort) for level in typing.get_args(arg)]
    assert "max" in levels or "xhigh" in levels
    for level in levels:
        assert client.chat.completions.create(**hi, reasoning_effort=level).choices


def test_the_responses_api_tool_choice_and_a_json_schema_without_schema(client):
    """{"type": "function", "name": ...} (the Responses API's tool_choice) named the tool and got
    "tool_choice.function.name is None"; a json_schema response_format without `schema` (optional
    in OpenAI's spec) was a 400 and holds the reply to a JSON object now."""
    reply = client.chat.completions.create(model="demo", tools=[WEATHER, MULTIPLY], max_tokens=64,
                                           tool_choice={"type": "function", "name": "multiply"},
                                           messages=[{"role": "user", "content": "Hello!"}])
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["multiply"]
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello!"}],
                                           max_tokens=48, response_format={"type": "json_schema",
                                                                           "json_schema": {"name": "any"}})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.lstrip().startswith("{")


def test_concurrent_clients_get_their_own_states_and_the_sequential_replies(client):
    from concurrent.futures import ThreadPoolExecutor

    questions = [f"What's the weather in {city}?" for city in ("Oslo", "Paris", "Rome", "Lima")]

    def ask(question: str):
        reply = client.chat.completions.with_raw_response.create(
            model="demo", tools=[WEATHER], messages=[{"role": "user", "content": question}])
        return reply.headers["x-hibana-state"], reply.parse().choices[0].message.tool_calls[0].function.arguments

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, questions))
    assert len({state for state, _ in together}) == 4
    assert [args for _, args in together] == [ask(q)[1] for q in questions]


def test_concurrent_tool_loops_give_the_in_process_replies(client, engine):
    from concurrent.futures import ThreadPoolExecutor

    from hibana_core import SamplingParams
    from hibana_core.chat import assistant_message

    cities = ["Oslo", "Paris", "Rome", "Lima", "Cairo", "Quito"]
    result = '{"temperature": 21, "condition": "sunny"}'

    def over_http(city: str) -> list:
        messages, replies = [{"role": "user", "content": f"What's the weather in {city}?"}], []
        for question in (None, "What is 3 times 4?"):
            if question:
                messages.append({"role": "user", "content": question})
            while True:
                reply = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, MULTIPLY],
                                                       max_tokens=64).choices[0].message
                calls = [(c.function.name, json.loads(c.function.arguments)) for c in reply.tool_calls or ()]
                replies.append((reply.content or "", calls))
                messages.append(reply.model_dump(exclude_none=True))
                if not calls or len(replies) > 6:
                    break
                messages += [{"role": "tool", "tool_call_id": c.id, "content": result} for c in reply.tool_calls]
        return replies

    def in_process(city: str) -> list:
        chat = engine.chat(f"in-process-{city}")
        messages, replies = [{"role": "user", "content": f"What's the weather in {city}?"}], []
        for question in (None, "What is 3 times 4?"):
            if question:
                messages.append({"role": "user", "content": question})
            while True:
                turn = chat.respond(messages, tools=[WEATHER, MULTIPLY], params=SamplingParams(max_tokens=64))
                replies.append((turn.text, [(c.name, c.arguments) for c in turn.tool_calls]))
                messages.append(assistant_message(turn))
                if not turn.tool_calls or len(replies) > 6:
                    break
                messages += [{"role": "tool", "tool_call_id": c.id, "content": result} for c in turn.tool_calls]
        return replies

    with ThreadPoolExecutor(len(cities)) as pool:
        served = list(pool.map(over_http, cities))
    assert all(len(replies) >= 4 for replies in served)  # a call and an answer per question
    assert served == [in_process(city) for city in cities]


LONG_LIST = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
    "type": "array", "items": {"type": "integer"}, "minItems": 300}}}  # 600 tokens at least


def wait_until_free(client, pinned: dict) -> None:
    """Return once a request on the pinned state is served (409 while a turn still holds it)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_headers=pinned)
            return
        except openai.ConflictError:  # still generating for the client that left
            assert time.monotonic() < deadline, "the abandoned request still holds its state"
            time.sleep(0.05)


def test_a_client_gone_mid_stream_cancels_its_turn(client, engine, base_url):
    """The connection goes mid-stream: the turn stops, lets its state go and is counted as a 499,
    as a non-streamed request whose client left (/metrics once left abandoned streams out)."""
    pinned = {"X-Hibana-State": "gone-1"}
    before = engine.stats().generated_tokens
    closed = 'hibana_requests_total{endpoint="/v1/chat/completions",status="499"}'
    closed_before = scrape(base_url).get(closed, 0)
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=500, stream=True, response_format=LONG_LIST,
                                            extra_headers=pinned)
    next(iter(stream))
    stream.close()  # the connection goes: the turn must stop and let the state go
    wait_until_free(client, pinned)
    assert engine.stats().generated_tokens - before < 500  # cancelled short of its length (and 2 for the probe)
    deadline = time.monotonic() + 30
    while scrape(base_url).get(closed, 0) != closed_before + 1:
        assert time.monotonic() < deadline, "the abandoned stream was never counted as a 499"
        time.sleep(0.02)


def test_a_client_gone_mid_stream_cancels_every_choice(client, engine):
    before = engine.stats().generated_tokens
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Count on."}],
                                            max_tokens=500, stream=True, response_format=LONG_LIST, n=3)
    chunks = iter(stream)
    while not next(chunks).choices[0].delta.content:  # past the role chunks: the turns generate
        pass
    stream.close()
    deadline = time.monotonic() + 30
    while any(info.busy for info in engine.states()):
        assert time.monotonic() < deadline, "an abandoned choice still holds its state"
        time.sleep(0.02)
    assert engine.stats().generated_tokens - before < 3 * 500  # each cancelled short of its length


def test_a_client_gone_before_its_whole_reply_cancels_its_turn(engine):
    """Not streamed: the client's timeout closes the connection while the server generates; the
    turn is cancelled short of its length (its schema cannot end before), lets its state go, and
    is counted as a 499; a client beside it gets its reply. How many tokens come between the
    client leaving and the cancel is the machine's speed: the turn asks for 1800 (a server of its
    own, without the shared one's 512-token limit), where a fast machine had generated 500 before
    the cancel landed."""
    from concurrent.futures import ThreadPoolExecutor

    longer = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 900}}}  # 1800 tokens at least
    beside = dict(model="demo", messages=[{"role": "user", "content": "What's the weather in Rome?"}],
                  tools=[WEATHER, MULTIPLY], max_tokens=64, extra_headers={"X-Hibana-State": "beside-gone-2"})
    counting = dict(model="demo", messages=[{"role": "user", "content": "Count."}], response_format=longer)
    with serving(engine, ServerConfig("demo", api_key=KEY)) as url:
        own = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        prompt = own.chat.completions.create(**counting, max_tokens=1).usage.prompt_tokens
        alone = own.chat.completions.create(**beside).choices[0].message
        closed = 'hibana_requests_total{endpoint="/v1/chat/completions",status="499"}'
        closed_before = scrape(url).get(closed, 0)
        impatient = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=0.5)
        state = engine.open_state("gone-2")
        with ThreadPoolExecutor(1) as pool:
            together = pool.submit(lambda: own.chat.completions.create(**beside).choices[0].message)
            with pytest.raises(openai.APITimeoutError):
                impatient.chat.completions.create(**counting, max_tokens=1800, extra_headers={"X-Hibana-State": "gone-2"})
            deadline = time.monotonic() + 30
            while any(info.id == "gone-2" and info.busy for info in engine.states()):
                assert time.monotonic() < deadline, "the abandoned request still holds its state"
                time.sleep(0.02)
            assert prompt <= len(state) < prompt + 1800  # cancelled, not run to the 1800 tokens asked for
            assert together.result(60).tool_calls[0].function == alone.tool_calls[0].function
            # the handler counts its 499 after the cancelled turn has let the state go: on a loaded
            # machine the scrape can come between the two (clean-clone CI once read 0 here)
            deadline = time.monotonic() + 30
            while scrape(url).get(closed, 0) != closed_before + 1:
                assert time.monotonic() < deadline, "the abandoned request was never counted as a 499"
                time.sleep(0.02)


def test_pinned_state_header_serves_that_state(client, engine):
    reply = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8,
        extra_headers={"X-Hibana-State": "pinned-1"})
    assert reply.headers["x-hibana-state"] == "pinned-1"
    assert any(info.id == "pinned-1" and info.tokens > 0 for info in engine.states())


def test_the_user_field_pins_a_state_too(client):
    ask = dict(model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, user="user-7")
    served = [client.chat.completions.with_raw_response.create(**ask).headers["x-hibana-state"] for _ in range(2)]
    assert served == ["user-7", "user-7"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("user, header", [("张三", "%E5%BC%A0%E4%B8%89"), (" bob", "%20bob"), ("a\nb", "a%0Ab"),
                                          ("José", "José")])
def test_a_user_that_no_header_can_carry_still_gets_its_reply(client, engine, user, header, stream):
    # the reply names the state in a header: written raw, it failed after the turn ran (a 500, a dropped connection)
    reply = client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, user=user, stream=stream)
    parsed = reply.parse()
    assert list(parsed) if stream else parsed.choices[0].message.content
    assert reply.headers["x-hibana-state"] == header
    assert any(info.id == user for info in engine.states())


def test_completions_continue_the_prompt_as_it_is(client, engine):
    messages = [{"role": "user", "content": "Hello!"}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    local = engine.chat("server-test-raw").respond(messages, params=__import__("hibana_core").SamplingParams(
        max_tokens=20), parse_tools=False)
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=20)
    assert whole.object == "text_completion" and whole.choices[0].text == local.raw_text
    assert whole.usage.completion_tokens == local.usage.completion_tokens
    chunks = list(client.completions.create(model="demo", prompt=[prompt], max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == local.raw_text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the first request's state


def test_completions_of_several_prompts_give_a_choice_each(client):
    prompts = ["Once upon a time", "The weather in Oslo is", "Hello"]
    alone = [client.completions.create(model="demo", prompt=p, max_tokens=12) for p in prompts]
    together = client.completions.with_raw_response.create(model="demo", prompt=prompts, max_tokens=12)
    reply = together.parse()
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [r.choices[0].text for r in alone]
    assert [c.finish_reason for c in reply.choices] == [r.choices[0].finish_reason for r in alone]
    assert reply.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert reply.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    assert len(together.headers[STATE_HEADER].split(", ")) == 3
    for body, says in [({"prompt": prompts}, "header"), ({"prompt": ["a"] * 65}, "at most 64"),
                       ({"prompt": ["a", ""]}, "at least one character")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="demo", max_tokens=2, extra_headers={STATE_HEADER: "pinned"}
                                      if says == "header" else None, **body)
        assert caught.value.body["param"] == "prompt" and says in caught.value.body["message"]


def test_completions_take_prompts_as_token_ids(client, engine):
    """OpenAI's other prompt forms: token ids, or a list of them. They are the prompt as given (no
    template, no re-tokenizing: control tokens the caller wrote stay, as in a text prompt); ids
    outside the vocabulary are a 400 on `prompt`."""
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                                tokenize=False)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    as_text = client.completions.create(model="demo", prompt=text, max_tokens=12)
    as_ids = client.completions.create(model="demo", prompt=ids, max_tokens=12)
    assert as_ids.choices[0].text == as_text.choices[0].text and as_ids.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(model="demo", prompt=ids, max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == as_text.choices[0].text
    other = engine.tokenizer.encode("Once upon a time", add_special_tokens=False)
    both = client.completions.create(model="demo", prompt=[ids, other], max_tokens=12)
    alone = client.completions.create(model="demo", prompt=other, max_tokens=12)
    assert [c.text for c in both.choices] == [as_text.choices[0].text, alone.choices[0].text]
    for prompt, says in [([engine.vocab_size], "vocabulary"), ([ids, [5, -1]], "vocabulary"), ([ids, []], "token"),
                         ([1, "a"], "prompt")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="demo", prompt=prompt, max_tokens=2)
        assert caught.value.body["param"] == "prompt" and says in caught.value.body["message"], caught.value.body


# --- errors ------------------------------------------------------------------------------------------

def test_a_wrong_or_missing_key_is_refused(base_url):
    bad = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    status, body = post(base_url, b'{"model": "demo", "messages": []}', key=None)
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    (b'{"model": "demo", "messages": [', None),                                       # not JSON
    (b'[1, 2]', None),                                                                  # not an object
    (b'{"model": "demo", "messages": "hi"}', "messages"),                              # wrong type
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": "1"}', "temperature"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 65}', "n"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000000}', "max_tokens"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"}',
     "tool_choice"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temprature": 0.5}', "temprature"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),  # not JSON
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}', None),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\n", ""]}', "stop"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}', "top_logprobs"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
     "top_logprobs"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": 1}}',
     "stream_options.include_usage"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}',
     "stream_options"),                                                                   # without stream: true
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
     "tools"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}', "tool_choice"),
    (b'{"model": "demo", "messages": [{"role": "tool", "content": "hi"}]}', "messages"),
    (b'{"model": "demo", "messages": [{"role": "user"}]}', "messages"),                      # no content
    (b'{"model": "demo", "messages": [{"role": "user", "content": []}]}', "messages[0].content"),  # no part
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": '
     b'"c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "ok"}]}',
     "messages"),                                                                             # no tool_call_id
    (b'{"model": "demo", "messages": [{"role": "system", "content": null}, {"role": "user", "content": "hi"}]}',
     "messages"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
     b'{"url": "https://example.com/a.png"}}]}]}', "messages"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "seed": 1180591620717411303424}', "seed"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "custom", "custom": '
     b'{"name": "grep"}}]}', "tools"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "function"}}', "tool_choice"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "none"}}}', "tool_choice"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "custom", "custom": {"name": "f"}}}', "tool_choice"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": '
     b'[{"type": "function", "function": {"name": "g"}}]}}}', "tool_choice"),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f"}}], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": '
     b'[{"type": "function", "function": {"name": "f"}}]}}}', "tool_choice"),
])
def test_bad_requests_get_openai_shaped_400s(base_url, body, param):
    status, reply = post(base_url, body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    assert reply["error"]["param"] == param


def nested_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("asked", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(400)}}},
    {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": nested_schema(400)}}]},
])
def test_a_body_nested_too_deep_is_a_400_not_a_500(base_url, asked):
    """A schema 400 levels deep ran the schema checks out of stack: a 500. The body's nesting is
    bounded as its size is; a schema nested within it is served."""
    status, reply = post(base_url, json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2, **asked}).encode())
    assert status == 400 and "levels deep" in reply["error"]["message"], reply
    within = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(60)}}
    status, reply = post(base_url, json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2, "response_format": within}).encode())
    assert status == 200, reply


def test_a_body_deeper_than_pythons_json_reads_says_how_deep_it_may_be(base_url):
    """30,000 levels of arrays: the 400 quoted CPython's "maximum recursion depth exceeded"."""
    body = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 30_000 + \
        b"]" * 30_000 + b"}"
    status, reply = post(base_url, body)
    assert status == 400 and "levels deep" in reply["error"]["message"] and "recursion" not in \
        reply["error"]["message"], reply


def test_json_schema_strict_is_a_boolean_and_a_replayed_refusal_is_text(base_url):
    """`strict: "yes"` was taken (as not strict), where every other flag is typed; an assistant
    message replaying an OpenAI reply's refusal part was a 400 (OpenAI's schema allows it there)."""
    hi = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, reply = post(base_url, json.dumps({**hi, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": "yes", "schema": {"type": "object"}}}}).encode())
    assert status == 400 and reply["error"]["param"] == "response_format.json_schema.strict", reply
    history = [{"role": "user", "content": "Do a bad thing."},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
               {"role": "user", "content": "Then say hi."}]
    status, reply = post(base_url, json.dumps({**hi, "messages": history}).encode())
    assert status == 200, reply
    status, reply = post(base_url, json.dumps({**hi, "messages": [
        {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}).encode())
    assert status == 400, reply  # a refusal is the assistant's


def test_a_tool_parser_plugin_that_fails_is_the_servers_error_not_the_requests(engine):
    """`--tool-parser` naming a plugin whose parser raises: a 500 server_error (it was a 400
    invalid_request_error, blaming the client), and the server serves the next request."""
    from hibana_plugins import hookimpl
    from hibana_plugins.manager import get_plugin_manager, reset_plugin_manager
    from hibana_plugins.tool_parsers import HermesToolParser

    class Raises(HermesToolParser):
        def stream(self, **options):
            raise ValueError("a parser bug")

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            register("raising_parser", Raises())

    reset_plugin_manager()
    get_plugin_manager().register(Plugin(), name="hibana-test-raising-parser")
    try:
        with serving(engine, ServerConfig("demo", tool_parser="raising_parser")) as url:
            body = {"model": "demo", "max_tokens": 8, "tools": [WEATHER],
                    "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
            status, reply = post(url, json.dumps(body).encode(), key=None)
            assert status == 500 and reply["error"]["type"] == "server_error", reply
            assert "raising_parser" in reply["error"]["message"]
            status, reply = post(url, json.dumps({**body, "tools": None}).encode(), key=None)
            assert status == 200, reply
    finally:
        reset_plugin_manager()


def test_top_logprobs_past_twenty_is_out_of_range_not_unsupported(base_url):
    status, reply = post(base_url, json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                               "logprobs": True, "top_logprobs": 21}).encode())
    assert status == 400 and "20" in reply["error"]["message"]
    assert "not support" not in reply["error"]["message"]


def tool_loop(client, city: str, state: str) -> list:
    """A weather question, its call, the tool's result and the answer, on a pinned state."""
    messages, replies = [{"role": "user", "content": f"What's the weather in {city}?"}], []
    for _ in range(2):
        reply = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, MULTIPLY],
                                               max_tokens=64, extra_headers={"X-Hibana-State": state})
        message = reply.choices[0].message
        replies.append((message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]))
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21, "condition": "sunny"}'}
                     for c in message.tool_calls or ()]
    return replies


def refused(base_url: str, body, key) -> tuple[int, dict]:
    """`post`, where a connection the server closed while the body was still being sent (a body
    refused past the size limit: the server answers 413 and closes without reading the rest, so
    the sender sees a reset or a broken pipe, whichever its next write meets) counts as that 413."""
    import urllib.error

    try:
        return post(base_url, body, key=key)
    except (urllib.error.URLError, ConnectionError) as exc:
        if not isinstance(getattr(exc, "reason", exc), (ConnectionResetError, BrokenPipeError)):
            raise
        return 413, {"error": {"message": "the connection was reset while the body was sent"}}


def test_hostile_requests_get_4xx_and_leave_a_client_beside_them_unaffected(client, base_url):
    """All at once, beside a tool loop. (A body that declares more than the limit is refused
    unread, test_unknown_model_and_oversized_body: its sender may see the connection reset first.)"""
    from concurrent.futures import ThreadPoolExecutor

    hi = [{"role": "user", "content": "hi"}]
    hostile = [  # (body, API key, status)
        (b'{"model": "demo", "messages": [', KEY, 400),                                        # invalid JSON
        (b"[" * 30000 + b"]" * 30000, KEY, 400),                                               # nested past the parser
        (iter([b'{"model": "demo", "messages": [{"role": "user", "content": "'] + [b"x" * 1024] * 80 + [b'"}]}']),
         KEY, 413),                                                                             # chunked: no length
        (json.dumps({"model": "demo", "messages": hi, "n": 10 ** 6}).encode(), KEY, 400),
        (json.dumps({"model": "demo", "messages": hi, "max_tokens": 10 ** 12}).encode(), KEY, 400),
        (json.dumps({"model": "demo", "messages": [{"role": "user", "content": 5}]}).encode(), KEY, 400),
        (json.dumps({"model": "demo", "messages": hi, "tools": [WEATHER],
                     "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}).encode(), KEY, 400),
        (json.dumps({"model": "demo", "messages": hi}).encode(), None, 401),
        (json.dumps({"model": "demo", "messages": hi}).encode(), "wrong", 401),
    ]
    alone = tool_loop(client, "Lima", "beside-hostile-1")
    with ThreadPoolExecutor(4) as pool:
        beside = pool.submit(tool_loop, client, "Lima", "beside-hostile-2")
        answers = list(pool.map(lambda h: refused(base_url, h[0], h[1]), hostile))
        assert beside.result(120) == alone
    for (_, _, status), (got, body) in zip(hostile, answers):
        assert got == status and body["error"]["message"], (status, got, body)


def test_n_choices_are_the_replies_of_n_requests(client):
    """n > 1 as OpenAI answers it: n choices by index, the prompt counted once in the usage. Choice
    i of a seeded request samples with seed + i, so choice 0 is the reply to n=1; greedy choices
    are alike. Pinned to one state (X-Hibana-State): 400."""
    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something."}], max_tokens=12)
    alone = [client.chat.completions.create(**ask, temperature=1.5, seed=seed) for seed in (7, 8, 9)]
    together = client.chat.completions.create(**ask, temperature=1.5, seed=7, n=3)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.message.content for c in together.choices] == [r.choices[0].message.content for r in alone]
    assert len({c.message.content for c in together.choices}) > 1
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert together.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    greedy = client.chat.completions.create(**ask, n=2).choices
    assert greedy[0].message.content == greedy[1].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, n=2, extra_headers={STATE_HEADER: "pinned-n"})
    assert caught.value.body["param"] == "n"
    texts = client.completions.create(model="demo", prompt=["Once upon a time", "Hello"], max_tokens=6, n=2,
                                      temperature=1.5, seed=3).choices
    one = [client.completions.create(model="demo", prompt=p, max_tokens=6, temperature=1.5, seed=s).choices[0].text
           for p in ("Once upon a time", "Hello") for s in (3, 4)]
    assert [c.index for c in texts] == [0, 1, 2, 3] and [c.text for c in texts] == one
    top = 2**63 - 1  # the largest seed taken: choice 1 samples with the bottom of the range (was a 500)
    edge = client.chat.completions.create(**ask, temperature=1.5, seed=top, n=2).choices
    assert edge[0].message.content == client.chat.completions.create(**ask, temperature=1.5, seed=top) \
        .choices[0].message.content
    assert edge[1].message.content == client.chat.completions.create(**ask, temperature=1.5, seed=-2**63) \
        .choices[0].message.content


def test_n_choices_and_several_prompts_stream_by_index(client):
    """Streamed, each choice's chunks carry its index (interleaved as the turns run at once): a
    role chunk each, its text, its finish reason; then one usage chunk for the whole request."""
    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something."}], max_tokens=12,
               temperature=1.5, seed=7, n=3)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert sorted(d.index for d in deltas if d.delta.role) == [0, 1, 2]
    for choice in whole.choices:
        mine = [d for d in deltas if d.index == choice.index]
        assert "".join(d.delta.content or "" for d in mine) == choice.message.content
        assert [d.finish_reason for d in mine if d.finish_reason] == [choice.finish_reason]
    # the counts, not prompt_tokens_details.cached_tokens: how much of the prompt the cache held
    # depends on what ran before and what was evicted since (seen as 12 and 0 in one CI run)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, f) for f in counts] == [getattr(whole.usage, f) for f in counts]
    assert len({c.id for c in chunks}) == 1
    prompts = ["Once upon a time", "Hello"]
    texts = client.completions.create(model="demo", prompt=prompts, max_tokens=6, n=2, seed=3, temperature=1.5)
    streamed = list(client.completions.create(model="demo", prompt=prompts, max_tokens=6, n=2, seed=3,
                                              temperature=1.5, stream=True))
    assert ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(4)] == \
        [c.text for c in texts.choices]


def test_unknown_model_and_oversized_body(client, base_url):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"
    status, reply = post(base_url, json.dumps({"model": "demo", "messages": [
        {"role": "user", "content": "x" * (70 << 10)}]}).encode())
    assert status == 413 and reply["error"]["code"] == "request_too_large"


def test_a_wrong_url_or_method_says_which(base_url):
    """As OpenAI's: the error names the method and path it got, not a bare "Not Found"."""
    for method, path, status in [("POST", "/v1/chat/complete", 404), ("GET", "/v1/chat/completions", 405)]:
        request = urllib.request.Request(base_url + path, method=method, data=b"{}" if method == "POST" else None,
                                         headers={"Authorization": f"Bearer {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        error = json.loads(caught.value.read())["error"]
        assert caught.value.code == status and f"({method} {path})" in error["message"], error


def test_a_context_too_long_is_refused_and_the_server_goes_on(client, engine):
    words = " ".join(["hello"] * (engine.max_model_len + 10))
    status_error = None
    try:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": words[:60000]}])
    except openai.APIStatusError as exc:
        status_error = exc
    assert status_error is not None and status_error.status_code == 400
    assert status_error.body["code"] == "context_length_exceeded"
    assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4).choices


def test_a_request_past_the_timeout_gets_a_503_and_frees_its_state(engine):
    with serving(engine, ServerConfig("demo", request_timeout=0.001)) as url:
        hurried = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            hurried.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello!"}],
                                            extra_headers={"X-Hibana-State": "hurried-1"})
    assert caught.value.status_code == 503 and caught.value.body["code"] == "timeout"
    with engine.lease(state_id="hurried-1") as handle:  # not held by the request that timed out (StateBusyError)
        assert handle.id == "hurried-1"


def test_a_turn_past_the_timeout_after_its_first_token_is_not_to_be_repeated():
    """Not streamed, a turn cut by the timeout after it started: a 503 that OpenAI's clients do not
    retry (their rule retries 408 and 5xx: three times the wait for the same cut)."""
    from hibana_core.errors import ChatTimeoutError
    from hibana_plugins.server import api_error

    error = api_error(ChatTimeoutError("the chat call ran past its timeout"))
    assert (error.status, error.code, error.kind) == (503, "timeout", "server_error")
    assert error.headers() == {"x-should-retry": "false"}


def test_a_plugins_failure_is_not_to_be_repeated():
    """A plugin of the server's that raised (its tool parser) raises again on the same request:
    the 500 tells OpenAI's clients not to retry it (they retried it twice, after waits)."""
    from hibana_plugins.manager import PluginError
    from hibana_plugins.server import api_error

    error = api_error(PluginError("tool parser 'raising_parser' failed in stream: ValueError('a parser bug')"))
    assert (error.status, error.code, error.kind) == (500, "plugin_error", "server_error")
    assert error.headers() == {"x-should-retry": "false"}


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {series: value}."""
    request = urllib.request.Request(base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_count_the_tokens_of_cancelled_streams(client, base_url):
    """An outside tester: a stream the client left, or a turn cut by --request-timeout, did work
    that /metrics never counted (its tokens were counted from completed replies alone); they are
    the engine's counts now."""
    before = scrape(base_url)["hibana_generated_tokens_total"]
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Tell me a story."}],
                                            max_tokens=400, stream=True)
    read = 0
    for chunk in stream:
        read += bool(chunk.choices and chunk.choices[0].delta.content)
        if read >= 5:
            break
    stream.close()
    assert scrape(base_url)["hibana_generated_tokens_total"] - before >= 5


def test_metrics_count_requests_and_reused_tokens(client, base_url):
    client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    values = scrape(base_url)
    assert values['hibana_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert values['hibana_prompt_tokens_total{kind="computed"}'] > 0
    assert values["hibana_time_to_first_token_seconds_count"] >= 1
    assert values['hibana_kv_blocks{kind="total"}'] > 0
    assert values['hibana_kv_bytes{tier="device"}'] > 0 and values['hibana_kv_bytes{tier="host"}'] >= 0
    assert values['hibana_kv_bytes{tier="disk"}'] >= 0
    assert {'hibana_kv_moves{kind="parks"}', 'hibana_kv_moves{kind="spills"}',
            'hibana_kv_moves{kind="disk_resumes"}'} <= set(values)
    assert values["hibana_requests_queued"] == 0 and values["hibana_requests_running"] >= 0
    steps = values["hibana_step_seconds_count"]
    assert steps >= 1 and values['hibana_step_seconds_bucket{le="+Inf"}'] == steps
    assert values['hibana_step_seconds_bucket{le="0.001"}'] <= values['hibana_step_seconds_bucket{le="2.5"}'] <= steps
    assert values["hibana_step_seconds_sum"] > 0


# --- a reasoning model -------------------------------------------------------------------------------

THOUGHT = "The user says hi. I should greet them."
ANSWER = "Hello there, friend."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A server on the tiny Qwen3-style reasoning checkpoint (tests/reasoning_model.py) and a client."""
    import tiny_models
    from reasoning_model import make_reasoning_checkpoint

    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    with engine, serving(engine, ServerConfig("thinker")) as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def forced(engine, state_id: str) -> dict:
    """The request options that serve a call on `state_id`, whose next generation writes OUTPUT (so
    that the random model thinks)."""
    from hibana_core.speculation import force_outputs

    ids = engine.tokenizer.encode(OUTPUT, add_special_tokens=False)
    force_outputs(engine.open_state(state_id), ids)
    return {"max_tokens": len(ids), "extra_headers": {"X-Hibana-State": state_id}}


def test_thinking_comes_as_reasoning_content_never_in_the_content(thinker):
    engine, client = thinker
    reply = client.chat.completions.create(model="thinker", messages=HI, **forced(engine, "think-1"))
    message = reply.choices[0].message
    assert (message.content, message.reasoning_content) == (ANSWER, THOUGHT)
    chunks = list(client.chat.completions.create(model="thinker", messages=HI, stream=True,
                                                 **forced(engine, "think-2")))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert "".join(thinking).strip() == THOUGHT
    # streamed as it comes, ahead of the answer (in how many chunks is the server loop's lag
    # behind the engine: a loaded machine may read the whole thought in one go)
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(i < first_answer for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
    assert "".join(d.content or "" for d in deltas) == ANSWER


def test_legacy_completions_keep_the_thinking_in_the_text(thinker):
    engine, client = thinker
    prompt = engine.tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    reply = client.completions.create(model="thinker", prompt=prompt, **forced(engine, "think-3"))
    assert reply.choices[0].text == OUTPUT.removesuffix("<|im_end|>")


@pytest.mark.parametrize("off", [{"reasoning_effort": "none"},
                                 {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}])
def test_thinking_can_be_switched_off(thinker, off):
    engine, client = thinker
    empty_block = len(engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))

    def prompt_tokens(**options) -> int:
        return client.chat.completions.create(model="thinker", messages=HI, max_tokens=1, **options).usage.prompt_tokens
    assert prompt_tokens(**off) == prompt_tokens() + empty_block == prompt_tokens(reasoning_effort="low") + empty_block


def test_reasoning_effort_reaches_the_chat_layer_as_given():
    """"none" goes to the chat layer as it is, which reads it as thinking off, unless the model's chat
    format declares a level "none" of its own (the server switched thinking off and dropped the level,
    so such a format's "none" was a 400 where in process it is a level); enable_thinking alone is the
    switch."""
    from hibana_plugins.openai_api import ChatRequest, reasoning_level, thinking_switch

    none = ChatRequest(model="thinker", messages=HI, reasoning_effort="none")
    assert (thinking_switch(none), reasoning_level(none)) == (None, "none")
    high = ChatRequest(model="thinker", messages=HI, reasoning_effort="high",
                       chat_template_kwargs={"enable_thinking": True})
    assert (thinking_switch(high), reasoning_level(high)) == (True, "high")


@pytest.mark.parametrize("options, param", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": "no"}}}, "chat_template_kwargs.enable_thinking"),
    ({"extra_body": {"chat_template_kwargs": {"tools_in_user_message": True}}},
     "chat_template_kwargs.tools_in_user_message"),
    ({"reasoning_effort": "high", "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
     "reasoning_effort"),
])
def test_bad_thinking_options_are_400s(thinker, options, param):
    _, client = thinker
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="thinker", messages=HI, max_tokens=1, **options)
    assert caught.value.body["param"] == param


# --- LangChain ---------------------------------------------------------------------------------------

def test_langchain_chat_openai_calls_a_tool(base_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(base_url=base_url + "/v1", api_key=KEY, model="demo", temperature=0,
                                      max_retries=0)
    model = llm.bind_tools([WEATHER, MULTIPLY])
    history = [HumanMessage("What's the weather in Oslo?")]
    first = model.invoke(history)
    assert first.tool_calls[0]["name"] == "get_weather" and first.tool_calls[0]["args"] == {"city": "Oslo"}
    history += [first, ToolMessage('{"temperature": 21, "condition": "sunny"}', tool_call_id=first.tool_calls[0]["id"])]
    second = model.invoke(history)
    assert second.content and not second.tool_calls
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 0.9 * second.usage_metadata["input_tokens"]


# --- LangChain's standard suite on ChatOpenAI pointed at the server ---------------------------------

langchain_tests = pytest.importorskip("langchain_tests.integration_tests")


class TestChatOpenAIOnHibana(langchain_tests.ChatModelIntegrationTests):
    url = ""

    @pytest.fixture(autouse=True)
    def _server(self, base_url):
        type(self).url = base_url + "/v1"

    @property
    def chat_model_class(self):
        from langchain_openai import ChatOpenAI

        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        # an async HTTP client per model: langchain-openai's shared default one keeps connections of
        # the event loop it was first used on, which pytest-asyncio closes after each test
        return {"model": "demo", "base_url": self.url, "api_key": KEY, "max_tokens": 64, "temperature": 0,
                "max_retries": 0, "http_async_client": openai.DefaultAsyncHttpxClient(),
                "stream_usage": True}  # ChatOpenAI asks for the usage chunk from OpenAI's own URL only

    @property
    def structured_output_kwargs(self) -> dict:
        # the demo model answers in tool calls (ChatHibana's json_schema and json_mode methods are forced
        # calls too); response_format holds free text to the schema by the grammar, but the demo model,
        # trained on tool calls only, then runs to max_tokens inside the JSON (json_mode is left out so)
        return {"method": "function_calling"}


def test_the_api_key_comes_from_the_environment_too(monkeypatch):
    from hibana_plugins import server

    monkeypatch.setenv(server.API_KEY_ENV, "from-env")
    assert server.build_parser().parse_args(["demo"]).api_key == "from-env"
    assert server.build_parser().parse_args(["demo", "--api-key", "given"]).api_key == "given"
    assert server.build_parser().parse_args(["demo"]).host == "127.0.0.1"
    monkeypatch.setenv(server.API_KEY_ENV, "")  # set but empty, as CI files leave it: no key wanted
    assert server.build_parser().parse_args(["demo"]).api_key is None
    with pytest.raises(ConfigError, match="API key must not be empty"):  # nor a key that is the empty bearer token
        ServerConfig("demo", api_key=" ")
    with pytest.raises(ConfigError, match="must be positive"):  # `--request-timeout nan` once served with it
        ServerConfig("demo", request_timeout=float("nan"))
    # each named with its flag (one message named all three fields)
    with pytest.raises(ConfigError, match=r"^max_tokens_limit \(--max-tokens-limit\) must be positive, got 0$"):
        ServerConfig("demo", max_tokens_limit=0)
    with pytest.raises(ConfigError, match=r"^request_timeout \(--request-timeout\) must be positive, got -5"):
        ServerConfig("demo", request_timeout=-5)


def test_engine_options_from_the_command_line():
    from hibana_plugins import server

    args = server.build_parser().parse_args(["demo", "--memory-budget", "80%", "--state-dir", "states",
                                             "--option", "pin_budget=0.25"])
    options = server.engine_options(args)
    assert options["memory_budget"] == "80%" and options["state_dir"] == "states" and options["pin_budget"] == 0.25


@pytest.mark.parametrize("given, want", [("0.8", 0.8), ("20000000000", 20 * 10**9), ("20GB", "20GB")])
def test_a_memory_budget_on_the_command_line_takes_every_form_the_engine_does(given, want):
    """`--memory-budget 0.8` is the fraction 0.8 (as a string, the engine reads "0.8" as no size)."""
    from hibana_plugins import server

    options = server.engine_options(server.build_parser().parse_args(["demo", "--memory-budget", given]))
    assert options["memory_budget"] == want
    EngineConfig.from_overrides("demo", **options)  # accepted


def test_a_request_that_waited_too_long_in_the_queue_is_a_429():
    """queue_timeout_ms on a full server: the waiting requests get OpenAI's rate-limit shape
    (retry later); the one running is unaffected. The running one is held busy in process
    (ignore_eos), so that on a loaded machine neither its admission nor its end races the wait."""
    import openai
    from hibana_core import SamplingParams

    with Engine.from_pretrained("demo", progress=False, max_concurrent_agents=1, queue_timeout_ms=200) as engine, \
            serving(engine, ServerConfig("demo", api_key=KEY)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        errors = []
        with engine.lease(state_id="runs-long") as busy:
            busy.sync(engine.tokenizer.encode("Tell me a long story."))
            events = busy.stream(SamplingParams(max_tokens=engine.max_model_len // 2, ignore_eos=True))
            next(events)  # admitted and generating: the server is full

            def ask(i: int) -> None:
                try:
                    client.chat.completions.create(model="demo", max_tokens=8,
                                                   messages=[{"role": "user", "content": f"Story {i}?"}])
                except openai.RateLimitError as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for event in events:  # the running request goes on to its end
                pass
        assert len(errors) == 3 and event.completion.finish_reason == "length"
        assert errors[0].status_code == 429 and errors[0].body["code"] == "queue_timeout"
        assert errors[0].body["type"] == "requests"  # as OpenAI types a rate limit (not an invalid request)
        assert "queue_timeout_ms" in errors[0].body["message"]


def test_metrics_show_the_queue():
    """With room for one request, a second one waits in the queue while the first streams."""
    with Engine.from_pretrained("demo", progress=False, max_concurrent_agents=1) as engine, \
            serving(engine, ServerConfig("demo", api_key=KEY)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Count."}],
                                                max_tokens=500, stream=True, response_format=LONG_LIST)
        next(iter(stream))
        waiting = threading.Thread(target=client.chat.completions.create, kwargs=dict(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2))
        waiting.start()
        deadline = time.monotonic() + 30
        while (values := scrape(url))["hibana_requests_queued"] != 1:
            assert time.monotonic() < deadline, values
            time.sleep(0.02)
        assert values["hibana_requests_running"] == 1
        stream.close()
        waiting.join(60)
        assert scrape(url)["hibana_requests_queued"] == 0


def test_logprobs_plain_and_streamed(client):
    """logprobs / top_logprobs in OpenAI's shape; asking for them changes no token."""
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=12)
    got = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, logprobs=True, top_logprobs=3)
    assert got.choices[0].message.content == plain.choices[0].message.content
    content = got.choices[0].logprobs.content
    # the content's tokens: their bytes joined are the content; the end-of-turn token is left out
    assert len(content) == got.usage.completion_tokens - (got.choices[0].finish_reason == "stop")
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == got.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy: the sampled token is the top one
        assert entry.top_logprobs[0].token == entry.token
    assert plain.choices[0].logprobs is None
    # streamed, each chunk carries its own tokens' (they were all on the last chunk); joined, the reply's
    messages = [{"role": "user", "content": "Tell me something."}]  # a reply in text, streamed as it comes
    content = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, logprobs=True,
                                             top_logprobs=3).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=12, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    # (how many chunks is no given: drafts of the reply just made, or a server loop behind the
    # engine, may bring all 12 tokens at once; that each text chunk carries its own is checked below)
    joined = [e for lp in streamed for e in lp.content]
    assert [e.token for e in joined] == [e.token for e in content]
    # (a state reused or not computes the prompt in other kernels: the same tokens, logprobs within float error)
    assert [e.logprob for e in joined] == pytest.approx([e.logprob for e in content], abs=1e-4)
    texts = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert sum(c.logprobs is not None for c in texts) >= len(texts) - 1
    text, spelt = "", b""
    for choice in texts:  # the tokens so far spell the text so far (the detokenizer may hold a piece back)
        text += choice.delta.content
        spelt += b"".join(bytes(e.bytes) for e in (choice.logprobs.content if choice.logprobs else ()))
        assert text.encode().startswith(spelt) or spelt.startswith(text.encode()), (text, spelt)


def test_legacy_completions_logprobs_whole_and_streamed(client):
    """/v1/completions' logprobs (the alternatives' count, up to 5) were a 400; they come in that
    endpoint's shape now: tokens, token_logprobs, top_logprobs (a dict a token; None for 0) and
    text_offset, the tokens spelling the text; streamed, each chunk its own tokens', the offsets
    going on, joined the whole reply's."""
    ask = dict(model="demo", prompt="The weather in Paris is", max_tokens=8, extra_body={"ignore_eos": True})
    plain = client.completions.create(**ask).choices[0]
    assert plain.logprobs is None
    got = client.completions.create(**ask, logprobs=3).choices[0]
    assert got.text == plain.text
    lp = got.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == got.text and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy
    zero = client.completions.create(**ask, logprobs=0).choices[0].logprobs
    assert zero.top_logprobs is None and zero.tokens == lp.tokens
    chunks = list(client.completions.create(**ask, logprobs=3, stream=True))
    carried = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert [t for c in carried for t in c.tokens] == lp.tokens
    assert [o for c in carried for o in c.text_offset] == lp.text_offset
    assert [v for c in carried for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(**ask, logprobs=6)


def test_a_call_cut_by_a_stop_sequence_stays_in_the_content(client):
    """An outside tester: stop=["Paris"] inside a call's arguments answered an empty message with
    finish "stop" and no calls, nothing to say a call was begun. Its markup is the content now, as
    vLLM leaves a call it cannot parse, streamed or not (a max_tokens cut still leaves it out)."""
    ask = dict(model="demo", tools=[WEATHER], max_tokens=40,
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    cut = client.chat.completions.create(**ask, stop=["Paris"]).choices[0]
    assert cut.finish_reason == "stop" and not cut.message.tool_calls
    assert "<tool_call>" in cut.message.content and '"get_weather"' in cut.message.content
    chunks = list(client.chat.completions.create(**ask, stop=["Paris"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut.message.content


def test_an_empty_user_names_no_state_and_a_request_is_timed_once(client, base_url):
    """user: "" was a 400 about state ids (OpenAI takes it); n choices answered whole were timed
    to their first token once each, where a streamed request is timed once."""
    ask = dict(model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4)
    assert client.chat.completions.create(**ask, user="").choices[0].message.content is not None
    for stream in (False, True):
        before = scrape(base_url)["hibana_time_to_first_token_seconds_count"]
        reply = client.chat.completions.create(**ask, n=3, stream=stream)
        if stream:
            list(reply)
        assert scrape(base_url)["hibana_time_to_first_token_seconds_count"] - before == 1, stream
