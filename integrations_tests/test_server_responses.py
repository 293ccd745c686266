"""`POST /v1/responses` (OpenAI's Responses API) through the real `openai` client's
`responses.create`, on the bundled demo model: a tool loop with function_call and
function_call_output items that reuses the resident prompt, the same reply as the chat endpoint's,
the typed stream joining to the whole response, structured output, and the requests it refuses."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_core import Engine  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402
from hibana_bench.serve_load import MULTIPLY, WEATHER  # noqa: E402

KEY = "test-key"
TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER, MULTIPLY)]  # the Responses API's form


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo") as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine):
    with serving(engine, ServerConfig("demo", api_key=KEY, max_tokens_limit=512)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_a_tool_loop_with_items_reuses_the_prompt_and_answers_as_the_chat_endpoint(client):
    question = "What's the weather in Oslo?"
    first = client.responses.create(model="demo", input=question, tools=TOOLS)
    assert first.status == "completed" and first.object == "response" and first.id.startswith("resp_")
    call, = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}],
                                          tools=[WEATHER, MULTIPLY])
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments  # the same turn
    items = [{"role": "user", "content": question}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21, "condition": "sunny"}'}]
    second = client.responses.create(model="demo", input=items, tools=TOOLS)
    assert second.output_text and "21" in second.output_text
    usage = second.usage
    assert usage.input_tokens_details.cached_tokens >= 0.9 * usage.input_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_instructions_and_developer_messages_are_system_messages(client):
    by_field = client.responses.create(model="demo", instructions="You are terse.", input="Hello!", max_output_tokens=16)
    by_item = client.responses.create(model="demo", max_output_tokens=16, input=[
        {"role": "developer", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}])
    assert by_field.output_text == by_item.output_text and by_field.instructions == "You are terse."


def test_the_stream_joins_to_the_whole_response(client):
    ask = dict(model="demo", input="What's the weather in Paris?", tools=TOOLS)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in added] == [item.type for item in done] == [i.type for i in whole.output]
    final = events[-1].response
    assert final.status == "completed" and [i.model_dump() for i in final.output] == [i.model_dump() for i in done]
    calls = [item for item in final.output if item.type == "function_call"]
    want = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]
    assert arguments == "".join(c.arguments for c in calls)


def test_streamed_text_joins_to_output_text_and_max_output_tokens_is_incomplete(client):
    ask = dict(model="demo", input="Tell me something.", max_output_tokens=3)
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[-1].status == "incomplete"  # the message it cut, as OpenAI marks it (was "completed")
    events = list(client.responses.create(**ask, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == text
    done, = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.status == "incomplete" and events[-1].response.output[-1].status == "incomplete"


def test_text_format_json_schema_holds_the_reply(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    reply = client.responses.create(model="demo", input="Plan a trip to Rome.", max_output_tokens=64,
                                    text={"format": {"type": "json_schema", "name": "trip", "schema": schema,
                                                     "strict": True}})
    value = json.loads(reply.output_text)
    assert set(value) == {"city", "days"} and isinstance(value["days"], int)


def test_tool_choice_forms(client):
    named = client.responses.create(model="demo", input="Hello!", tools=TOOLS, max_output_tokens=64,
                                    tool_choice={"type": "function", "name": "multiply"})
    assert [i.name for i in named.output if i.type == "function_call"] == ["multiply"]
    allowed = client.responses.create(model="demo", input="Hello!", tools=TOOLS, max_output_tokens=64,
                                      tool_choice={"type": "allowed_tools", "mode": "required",
                                                   "tools": [{"type": "function", "name": "get_weather"}]})
    assert {i.name for i in allowed.output if i.type == "function_call"} == {"get_weather"}


def test_logprobs_come_with_the_output_text(client):
    reply = client.responses.create(model="demo", input="Tell me something.", max_output_tokens=8,
                                    include=["message.output_text.logprobs"], top_logprobs=2)
    assert reply.top_logprobs == 2
    part = next(item for item in reply.output if item.type == "message").content[0]
    assert part.logprobs and all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in part.logprobs)


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"include": ["message.output_text.logprobs", "bogus"]}, "include"),
])
def test_what_it_cannot_serve_is_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", input="hi", extra_body=fields)  # (the client checks no names)
    assert caught.value.body["param"] == param, caught.value.body


def test_every_field_of_the_clients_create_is_known(client):
    """Each argument of the installed client's responses.create sent as null is taken."""
    import inspect

    from openai.resources.responses.responses import Responses

    own = {"self", "extra_headers", "extra_query", "extra_body", "timeout", "model", "input", "stream"}
    names = [name for name in inspect.signature(Responses.create).parameters if name not in own]
    reply = client.responses.create(model="demo", input="hi", max_output_tokens=4,
                                    extra_body={name: None for name in names if name != "max_output_tokens"})
    assert reply.status in ("completed", "incomplete")


def test_the_raw_stream_names_each_event_and_ends_without_done(client):
    """As OpenAI's: `event: <type>` before each event's data, and no chat-style [DONE] line."""
    import httpx

    body = {"model": "demo", "input": "Hello!", "max_output_tokens": 4, "stream": True}
    text = httpx.post(f"{client.base_url}responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60).text
    frames = [frame for frame in text.split("\n\n") if frame]
    assert frames and "[DONE]" not in text
    for frame in frames:
        named, data = frame.split("\n")
        assert named == f"event: {json.loads(data.removeprefix('data: '))['type']}"


@pytest.mark.parametrize("fields, param, named", [
    ({"max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens=100000"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "reasoning.effort"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema", "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "text.format.type"),
    ({"input": "hello " * 3000}, "input", "context"),
    ({"input": [{"role": "user", "content": []}]}, "input", "input[0].content is an empty list"),
])
def test_errors_name_the_field_the_client_sent(client, fields, param, named):
    """The request is checked as the chat request it means: its errors named max_completion_tokens,
    reasoning_effort, response_format and messages, fields a Responses client never sent."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="demo", **{"input": "hi", **fields})
    body = caught.value.body
    assert body["param"] == param and named in body["message"], body
    for chat_field in ("max_completion_tokens", "reasoning_effort", "response_format"):
        assert chat_field not in body["message"]


def test_an_assistant_message_of_empty_text_after_a_call_is_served(client):
    """An assistant message item after a function_call joins that call's turn: an empty text gives
    it no parts, which is a turn of calls alone, not an empty list the chat layer refuses."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    reply = client.responses.create(model="demo", tools=[tool], max_output_tokens=3, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "message", "role": "assistant", "content": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert reply.status in ("completed", "incomplete")


def test_an_error_mid_stream_is_the_streams_error_event():
    """An error after the stream began (the server writes its `{"error": ...}` body) is the
    Responses stream's `error` event, typed, numbered and named as the events before it (OpenAI's
    ResponseErrorEvent; LangChain raises it by its type), its param the client's field."""
    from openai.types.responses import ResponseErrorEvent

    from hibana_plugins.openai_responses import ResponsesReply, ResponsesRequest

    reply = ResponsesReply("demo", None, ResponsesRequest(model="demo", input="hi"))
    opening = reply.frame(reply.role_chunk())
    frame = reply.frame({"error": {"message": "response_format: the grammar failed", "type": "invalid_request_error",
                                   "param": "response_format", "code": None}})
    named, data = frame.strip().split("\n")
    event = ResponseErrorEvent.model_validate_json(data.removeprefix("data: "), strict=True)
    assert named == "event: error" and opening.startswith("event: response.created")
    assert (event.sequence_number, event.param, event.message) == (1, "text.format", "text.format: the grammar failed")


THOUGHT = "The user says hi. I should greet them."
ANSWER = "Hello there, friend."


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A server on the tiny Qwen3-style reasoning checkpoint (tests/reasoning_model.py) and a client
    whose requests are forced to think (`forced`)."""
    import tiny_models
    from reasoning_model import make_reasoning_checkpoint

    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    with engine, serving(engine, ServerConfig("thinker")) as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def forced(engine, state_id: str) -> dict:
    """The options that serve a request on `state_id`, whose next generation thinks THOUGHT and answers ANSWER."""
    from hibana_core.speculation import force_outputs

    ids = engine.tokenizer.encode(f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>", add_special_tokens=False)
    force_outputs(engine.open_state(state_id), ids)
    return {"max_output_tokens": len(ids), "extra_headers": {"X-Hibana-State": state_id}}


def test_the_reasoning_item_streams_its_text_part_as_a_message_does(thinker):
    """A reasoning item opens its reasoning_text part (`response.content_part.added`) before its
    deltas and closes it after, as a message's output_text part: its output_item.added has no
    content yet, and its deltas said content_index 0 of a part never added."""
    engine, client = thinker
    whole = client.responses.create(model="thinker", input="hi", **forced(engine, "think-whole"))
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == ANSWER
    events = list(client.responses.create(model="thinker", input="hi", stream=True, **forced(engine, "think-stream")))
    reasoning = [e for e in events if getattr(e, "output_index", None) == 0]
    assert [e.type for e in reasoning if not e.type.endswith(".delta")] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert reasoning[1].part.type == "reasoning_text" and reasoning[-2].part.text == THOUGHT
    assert "".join(e.delta for e in reasoning if e.type == "response.reasoning_text.delta") == THOUGHT
    assert events[-1].response.output[0].model_dump() == reasoning[-1].item.model_dump()
    assert reasoning[-1].item.model_dump() == {**whole.output[0].model_dump(), "id": reasoning[-1].item.id}


def test_the_output_texts_logprobs_are_its_own_tokens_not_the_thinkings(thinker):
    """A reasoning model's output_text logprobs are those of its text: they held every token of the
    turn (the thinking and its markup, 40 for an answer of 10), and streamed, the markup between."""
    engine, client = thinker
    ask = dict(model="thinker", input="hi", include=["message.output_text.logprobs"])
    whole = client.responses.create(**ask, **forced(engine, "think-logprobs-whole"))
    part = whole.output[-1].content[0]
    assert "".join(lp.token for lp in part.logprobs) == part.text == ANSWER
    events = list(client.responses.create(**ask, stream=True, **forced(engine, "think-logprobs-stream")))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]  # (the values: another run's)
    final = events[-1].response.output[-1].content[0].logprobs
    assert [lp.model_dump() for lp in final] == [lp.model_dump() for lp in streamed]
