"""`POST /v1/messages` (Anthropic's Messages API) through the real `anthropic` client, on the bundled
demo model and a tiny reasoning checkpoint: replies equal to the chat endpoint's under greedy
sampling, a tool loop through tool_use and tool_result that reads its prompt from resident state
(cache_read_input_tokens), streams that the SDK assembles into the whole message, stop sequences,
max_tokens, thinking blocks, count_tokens, the named-state header, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from hibana_core import Engine  # noqa: E402
from hibana_bench.serve_load import MULTIPLY, WEATHER  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402

KEY = "test-key"
TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, MULTIPLY)]  # Anthropic's form
QUESTION = "What's the weather in Oslo?"
RESULT = '{"temperature": 21, "condition": "sunny"}'
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo") as engine:
        yield engine


@pytest.fixture(scope="module")
def url(engine):
    with serving(engine, ServerConfig("demo", api_key=KEY, max_tokens_limit=512)) as url:
        yield url


@pytest.fixture
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


@pytest.fixture
def chat(url):
    """The chat-completions endpoint of the same server, whose greedy replies the messages must equal."""
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def prompt_total(usage) -> int:
    """The prompt's tokens in Anthropic's usage: computed, read from the cache, written to it."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def blocks(message) -> list[dict]:
    """A message's content without the tool_use ids (each reply makes its own)."""
    return [{k: v for k, v in block.model_dump(exclude_none=True).items() if k != "id"} for block in message.content]


def test_a_message_answers_as_the_chat_endpoint(client, chat):
    message = client.messages.create(model="demo", max_tokens=64, messages=HELLO)
    assert (message.type, message.role, message.model) == ("message", "assistant", "demo")
    assert message.id.startswith("msg_") and message.stop_reason == "end_turn" and message.stop_sequence is None
    reply = chat.chat.completions.create(model="demo", max_tokens=64, messages=HELLO)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == reply.choices[0].message.content
    assert prompt_total(message.usage) == reply.usage.prompt_tokens and message.usage.cache_creation_input_tokens == 0
    assert message.usage.output_tokens == reply.usage.completion_tokens


def test_system_as_a_string_or_text_blocks(client, chat):
    system = "You are terse.\nAnswer briefly."
    by_string = client.messages.create(model="demo", max_tokens=32, system=system, messages=HELLO)
    by_blocks = client.messages.create(model="demo", max_tokens=32, messages=HELLO, system=[
        {"type": "text", "text": "You are terse."},
        {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}])
    reply = chat.chat.completions.create(model="demo", max_tokens=32,
                                         messages=[{"role": "system", "content": system}, *HELLO])
    assert by_string.content[0].text == by_blocks.content[0].text == reply.choices[0].message.content
    assert prompt_total(by_string.usage) == prompt_total(by_blocks.usage) == reply.usage.prompt_tokens
    bare = client.messages.count_tokens(model="demo", messages=HELLO).input_tokens
    assert prompt_total(by_string.usage) > bare  # the system prompt is in it


def test_a_second_turn_reads_the_first_from_resident_state(client):
    first_turn = [{"role": "user", "content": "Hello, how are you today?"}]
    first = client.messages.create(model="demo", max_tokens=32, messages=first_turn)
    history = [*first_turn, {"role": "assistant", "content": first.content},
               {"role": "user", "content": "Tell me something."}]
    second = client.messages.create(model="demo", max_tokens=32, messages=history)
    assert second.usage.cache_read_input_tokens >= prompt_total(first.usage)  # the whole first prompt, at least
    assert 0 < second.usage.input_tokens < second.usage.cache_read_input_tokens
    assert prompt_total(second.usage) == client.messages.count_tokens(model="demo", messages=history).input_tokens


def test_a_tool_loop_through_tool_use_and_tool_result(client, chat):
    ask = {"model": "demo", "max_tokens": 64, "tools": TOOLS}
    first = client.messages.create(**ask, messages=[{"role": "user", "content": QUESTION}])
    assert first.stop_reason == "tool_use"
    call, = [block for block in first.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and call.input == {"city": "Oslo"}
    reply = chat.chat.completions.create(model="demo", max_tokens=64, tools=[WEATHER, MULTIPLY],
                                         messages=[{"role": "user", "content": QUESTION}])
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == call.input  # the same turn
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.content}]
    answer = {"type": "tool_result", "tool_use_id": call.id, "content": RESULT}
    second = client.messages.create(**ask, messages=[*history, {"role": "user", "content": [answer]}])
    assert second.stop_reason == "end_turn" and "21" in second.content[-1].text
    assert second.usage.cache_read_input_tokens >= 0.9 * prompt_total(second.usage)
    # the tool_result read as the chat endpoint's tool message: the same reply
    function = {"name": call.name, "arguments": json.dumps(call.input)}
    chat_history = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                                                                         "function": function}]},
                    {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    reply = chat.chat.completions.create(model="demo", max_tokens=64, tools=[WEATHER, MULTIPLY], messages=chat_history)
    assert second.content[-1].text == reply.choices[0].message.content
    # content as text blocks is the string; is_error is written for the model to read
    as_blocks = {**answer, "content": [{"type": "text", "text": RESULT}]}
    again = client.messages.create(**ask, messages=[*history, {"role": "user", "content": [as_blocks]}])
    assert blocks(again) == blocks(second) and prompt_total(again.usage) == prompt_total(second.usage)
    failed = client.messages.count_tokens(model="demo", tools=TOOLS, messages=[
        *history, {"role": "user", "content": [{**answer, "is_error": True}]}]).input_tokens
    assert failed > prompt_total(second.usage)


def test_tool_choice_forms(client):
    ask = {"model": "demo", "max_tokens": 64, "tools": TOOLS}

    def calls(message) -> list[str]:
        return [block.name for block in message.content if block.type == "tool_use"]
    forced = client.messages.create(**ask, messages=HELLO, tool_choice={"type": "any"})
    assert calls(forced) and forced.stop_reason == "tool_use"
    named = client.messages.create(**ask, messages=HELLO, tool_choice={"type": "tool", "name": "multiply"})
    assert calls(named) == ["multiply"]
    one = client.messages.create(**ask, messages=HELLO, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len(calls(one)) == 1
    none = client.messages.create(**ask, messages=[{"role": "user", "content": QUESTION}], tool_choice={"type": "none"})
    assert calls(none) == [] and none.stop_reason != "tool_use"


@pytest.mark.parametrize("ask", [
    {"messages": [{"role": "user", "content": "Tell me something."}]},
    {"messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS},
    {"messages": HELLO, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "multiply"}},
], ids=["text", "tool_use", "forced_call"])
def test_the_stream_assembles_to_the_whole_message(client, ask):
    ask = {"model": "demo", "max_tokens": 64, **ask}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole) and final.content
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_total(final.usage) == prompt_total(whole.usage) and final.usage.cache_read_input_tokens > 0


def test_the_stream_sends_anthropics_events_in_order(url):
    body = {"model": "demo", "max_tokens": 64, "stream": True, "tools": TOOLS,
            "messages": [{"role": "user", "content": QUESTION}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    frames = [frame.split("\n") for frame in text.strip().split("\n\n")]
    events = [(frame[0].removeprefix("event: "), json.loads(frame[1].removeprefix("data: "))) for frame in frames]
    assert all(name == data["type"] for name, data in events)
    kinds = [name for name, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    opened = [data for name, data in events if name == "content_block_start"]
    assert [data["index"] for data in opened] == list(range(len(opened)))
    tool = opened[-1]["content_block"]
    assert tool["type"] == "tool_use" and tool["input"] == {} and tool["id"].startswith("toolu_")
    arguments = "".join(data["delta"]["partial_json"] for name, data in events if name == "content_block_delta"
                        and data["delta"]["type"] == "input_json_delta")
    assert json.loads(arguments) == {"city": "Oslo"}
    assert kinds.count("content_block_stop") == len(opened)
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and delta["usage"]["output_tokens"] > 0


def test_stop_sequences(client):
    ask = {"model": "demo", "max_tokens": 64, "messages": HELLO}
    plain = client.messages.create(**ask).content[0].text
    assert "help" in plain
    cut = client.messages.create(**ask, stop_sequences=["zzz", "help"])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "help")
    assert cut.content[0].text == plain[:plain.index("help")]  # the text before it, as generated
    with client.messages.stream(**ask, stop_sequences=["zzz", "help"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, blocks(final)) == ("stop_sequence", "help", blocks(cut))
    missed = client.messages.create(**ask, stop_sequences=["zzz"])
    assert (missed.stop_reason, missed.stop_sequence, missed.content[0].text) == ("end_turn", None, plain)


def test_max_tokens_stops_the_reply(client):
    ask = {"model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": "Tell me something."}]}
    cut = client.messages.create(**ask)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, blocks(final)) == ("max_tokens", blocks(cut))
    # a call max_tokens cut: no tool_use, and no call markup in the text
    call = client.messages.create(model="demo", max_tokens=5, messages=HELLO, tools=TOOLS, tool_choice={"type": "any"})
    assert call.stop_reason == "max_tokens" and all(block.type == "text" for block in call.content)
    assert "tool_call" not in "".join(block.text for block in call.content)


def test_sampling_fields(client):
    """temperature, top_p and top_k (which the newest SDK sends in extra_body, as older SDKs and other
    clients send them in the body): top_k=1 samples the greedy reply."""
    ask = {"model": "demo", "max_tokens": 16, "messages": [{"role": "user", "content": "Tell me something."}]}
    greedy = client.messages.create(**ask)
    sampled = client.messages.create(**ask, extra_body={"temperature": 1.0, "top_p": 0.9, "top_k": 1})
    assert blocks(sampled) == blocks(greedy)


def test_output_config_format_holds_the_answer_to_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    reply = client.messages.create(model="demo", max_tokens=64, output_config={"format": {
        "type": "json_schema", "schema": schema}}, messages=[{"role": "user", "content": "Plan a trip to Rome."}])
    value = json.loads(reply.content[0].text)
    assert set(value) == {"city", "days"} and isinstance(value["days"], int)


def test_a_reply_the_context_cut_short_of_max_tokens_says_so():
    """finish "length" short of max_tokens: the context had no room for more (Anthropic's
    model_context_window_exceeded), where max_tokens itself is "max_tokens"."""
    from hibana_core.turn import ChatResult, Usage
    from hibana_plugins.anthropic_messages import MessagesReply

    def stop_reason(generated: int) -> str:
        result = ChatResult("Once upon", [], "length", Usage(20, 5, generated))
        return MessagesReply("demo", None, 8).completion(result)["stop_reason"]
    assert (stop_reason(8), stop_reason(5)) == ("max_tokens", "model_context_window_exceeded")


def test_count_tokens_counts_the_prompt_a_message_reads(client):
    ask = {"model": "demo", "system": "Be brief.", "tools": TOOLS, "messages": [{"role": "user", "content": QUESTION}]}
    counted = client.messages.count_tokens(**ask).input_tokens
    message = client.messages.create(**ask, max_tokens=64)
    assert counted == prompt_total(message.usage)
    assert client.messages.count_tokens(**{**ask, "tools": TOOLS[:1]}).input_tokens < counted


def test_the_named_state_header_pins_a_conversation(client, url):
    pinned = {"X-Hibana-State": "claude-session-1"}
    first_turn = [{"role": "user", "content": "What is the capital of France?"}]
    raw = client.messages.with_raw_response.create(model="demo", max_tokens=32, messages=first_turn,
                                                   extra_headers=pinned)
    assert raw.headers["X-Hibana-State"] == "claude-session-1"
    first = raw.parse()
    second = client.messages.create(model="demo", max_tokens=32, extra_headers=pinned, messages=[
        *first_turn, {"role": "assistant", "content": first.content}, {"role": "user", "content": "Thanks!"}])
    assert second.usage.cache_read_input_tokens >= prompt_total(first.usage)
    states = httpx.get(url + "/v1/hibana/states", headers={"x-api-key": KEY}).json()["data"]
    assert any(s["id"] == "claude-session-1" and s["client_named"] for s in states)


def test_bearer_keys_and_the_model_list(url):
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)  # ANTHROPIC_AUTH_TOKEN's header
    assert bearer.messages.create(model="demo", max_tokens=4, messages=HELLO).content
    assert [model.id for model in bearer.models.list()] == ["demo"]
    assert bearer.models.retrieve("demo").display_name == "demo"


def expect_error(kind: type, call, message: str, error_type: str = "invalid_request_error") -> None:
    """`call()` raises the SDK's `kind` with Anthropic's error body, its message holding `message`."""
    with pytest.raises(kind) as caught:
        call()
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    assert message in body["error"]["message"], body


def test_errors_come_as_the_sdks_typed_errors_in_anthropics_shape(client, url):
    create = client.messages.create
    expect_error(anthropic.BadRequestError,  # (a timeout given: the SDK computes its own from max_tokens)
                 lambda: create(model="demo", max_tokens=anthropic.omit, messages=HELLO, timeout=60),
                 "max_tokens: Field required")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]),
        "messages[0].content[1] is an image block: Hibana serves text models")
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, tools=TOOLS, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}]),
        "is an image block")
    web_search = {"type": "web_search_20250305", "name": "web_search"}
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, messages=HELLO,
                                                           tools=[web_search]), "Hibana calls client tools only")
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=513, messages=HELLO),
                 "max_tokens=513 is more than this server allows")
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, messages=HELLO,
                                                           stop_sequences=[""]), "stop_sequences:")
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, messages=HELLO,
                                                           extra_body={"temperature": 1.5}), "temperature")
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, messages=HELLO,
                                                           extra_body={"frobnicate": 1}), "frobnicate")
    expect_error(anthropic.BadRequestError, lambda: create(model="demo", max_tokens=8, messages=[
        *HELLO, {"role": "assistant", "content": "Sure,"}]), "the last message is the assistant's")
    expect_error(anthropic.NotFoundError, lambda: create(model="claude-sonnet-4-5", max_tokens=8, messages=HELLO),
                 "this server serves 'demo'", "not_found_error")
    stranger = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    expect_error(anthropic.AuthenticationError, lambda: stranger.messages.create(model="demo", max_tokens=8,
                                                                                  messages=HELLO),
                 "missing or wrong API key", "authentication_error")
    expect_error(anthropic.BadRequestError, lambda: client.messages.count_tokens(model="demo", messages=[
        {"role": "user", "content": [image]}]), "is an image block")



def test_a_tool_choice_naming_no_offered_tool_names_the_field_sent(client):
    """tool_choice {"type": "tool", "name": ...} naming a tool not offered: the error names Anthropic's field,
    tool_choice.name, not the chat request's tool_choice.function.name that it is read as."""
    message = "tool_choice.name is 'nope'; name one of the tools offered: ['get_weather', 'multiply']"
    expect_error(anthropic.BadRequestError, lambda: client.messages.create(
        model="demo", max_tokens=8, messages=HELLO, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), message)


def test_an_error_about_a_message_names_it_by_its_place_in_the_request(client):
    """The chat layer counts its own messages (the system prompt one of them, each tool_result one): an error
    about a message names it as the client sent it, messages[i], not as the chat request counts it."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    answers = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
               {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain"}]
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": [call]},
                {"role": "user", "content": answers}]
    for system in ("Be brief.", anthropic.omit):
        for send in (lambda: client.messages.create(model="demo", max_tokens=8, tools=TOOLS, system=system,
                                                    messages=messages),
                     lambda: client.messages.count_tokens(model="demo", tools=TOOLS, system=system, messages=messages)):
            expect_error(anthropic.BadRequestError, send,
                         "messages[2] answers tool call 'toolu_2', which the assistant message before it did not make")

def test_an_error_mid_stream_is_anthropics_error_event():
    """The server ends a stream that fails after its first event with the error's body (`sse`): here
    Anthropic's `error` event, of the type its status would have had."""
    from hibana_plugins.anthropic_messages import MessagesReply
    from hibana_plugins.openai_api import ApiError
    from hibana_plugins.server import shutting_down

    reply = MessagesReply("demo", None, 8)
    name, data = reply.frame(shutting_down().body()).strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": shutting_down().message}}
    body = ApiError(400, "stop: each stop string needs at least one character", "stop").body()
    assert json.loads(reply.frame(body).split("data: ")[1])["error"] == {
        "type": "invalid_request_error", "message": "stop_sequences: each stop string needs at least one character"}


# --- a reasoning model -------------------------------------------------------------------------------

THOUGHT = "The user says hi. I should greet them."
ANSWER = "Hello there, friend."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A server on the tiny Qwen3-style reasoning checkpoint (tests/reasoning_model.py) and clients of it."""
    import tiny_models
    from reasoning_model import make_reasoning_checkpoint

    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    with engine, serving(engine, ServerConfig("thinker")) as url:
        yield (engine, anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0),
               openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))


def forced(engine, state_id: str) -> dict:
    """The request options that serve a call on `state_id`, whose next generation writes OUTPUT (so
    that the random model thinks)."""
    from hibana_core.speculation import force_outputs

    ids = engine.tokenizer.encode(OUTPUT, add_special_tokens=False)
    force_outputs(engine.open_state(state_id), ids)
    return {"max_tokens": len(ids), "extra_headers": {"X-Hibana-State": state_id}}


def test_thinking_comes_as_a_thinking_block_and_streams_as_thinking_deltas(thinker):
    engine, client, _ = thinker
    message = client.messages.create(model="thinker", messages=HI, **forced(engine, "think-1"))
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (THOUGHT, ANSWER)
    with client.messages.stream(model="thinker", messages=HI, **forced(engine, "think-2")) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert blocks(final) == blocks(message) and final.stop_reason == "end_turn"
    assert "thinking_delta" in kinds and kinds.index("text_delta") > max(
        i for i, kind in enumerate(kinds) if kind == "thinking_delta")


def test_thinking_switches_the_templates_thinking(thinker):
    engine, client, _ = thinker
    empty_block = len(engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))

    def counted(**options) -> int:
        return client.messages.count_tokens(model="thinker", messages=HI, **options).input_tokens
    default = counted()
    assert counted(thinking={"type": "disabled"}) == default + empty_block
    assert counted(thinking={"type": "enabled", "budget_tokens": 1024}) == counted(thinking={"type": "adaptive"}) \
        == default


def test_thinking_in_the_history_goes_back_as_reasoning_content(thinker):
    engine, client, chat = thinker
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]}
    history = [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": "x"},
                                                      call]}, result]
    with_thought = client.messages.count_tokens(model="thinker", tools=TOOLS, messages=history).input_tokens
    without = client.messages.count_tokens(model="thinker", tools=TOOLS, messages=[
        *HI, {"role": "assistant", "content": [call]}, result]).input_tokens
    assert with_thought > without  # the template renders the thinking of a turn after the last query
    function = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    reply = chat.chat.completions.create(model="thinker", max_tokens=1, tools=[WEATHER, MULTIPLY], messages=[
        *HI, {"role": "assistant", "content": "", "reasoning_content": THOUGHT,
              "tool_calls": [{"id": "toolu_1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": RESULT}])
    assert reply.usage.prompt_tokens == with_thought
