"""`hibana serve` used from outside as LangChain's `ChatOpenAI` and the `openai` client's users use
it: a LangGraph tool loop whose turns read their history from resident KV and whose greedy replies
are transformers' on the rendered history, streams that assemble to the whole reply with the usage
last, structured output by each of ChatOpenAI's methods, the client's typed helpers and errors
(a context overflow as LangChain's ContextOverflowError), several clients at once and one that
leaves, and the message shapes clients send. One server on the bundled demo model."""

from __future__ import annotations

import json
import threading
import time
from typing import Literal

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from hibana_plugins.server import ServerConfig, serving  # noqa: E402


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city"""
    return json.dumps({"temperature": 21, "condition": "sunny"})


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers"""
    return a * b


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


class Answer(BaseModel):
    """An answer"""
    sunny: bool
    mood: Literal["happy", "sad"]


@pytest.fixture(scope="module")
def url(engine):
    with serving(engine, ServerConfig("demo", max_tokens_limit=256)) as url:
        yield url + "/v1"


def chat_openai(url: str, **options) -> "langchain_openai.ChatOpenAI":
    return langchain_openai.ChatOpenAI(base_url=url, api_key="unused", model="demo", temperature=0, max_retries=0,
                                       **{"max_tokens": 64, **options})


def joined(chunks: list):
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    return whole


class Recorded:
    """Every request body an httpx client sent, with the reply it got (ChatOpenAI's `http_client`)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.client = httpx.Client(event_hooks={"request": [self.sent], "response": [self.got]}, timeout=60)

    def sent(self, request: httpx.Request) -> None:
        self.calls.append({"body": json.loads(request.content)})

    def got(self, response: httpx.Response) -> None:
        response.read()
        self.calls[-1]["reply"] = response.json()


@pytest.fixture(scope="module")
def reference():
    """transformers' demo model and tokenizer, the reference of greedy output."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hibana_core.loader import DEMO_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    return tokenizer, AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def greedy_tokens(reference, body: dict, n: int) -> tuple[int, list[str]]:
    """The rendered prompt's length and transformers' greedy continuation (n tokens, each as text)."""
    import torch

    tokenizer, model = reference
    messages = json.loads(json.dumps(body["messages"]))
    for message in messages:  # the template writes arguments it is given as a dict
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return len(ids), [tokenizer.decode([t]) for t in out]


# --- a LangGraph agent on ChatOpenAI --------------------------------------------------------------

def test_a_langgraph_tool_loop_reads_each_turn_from_resident_kv_and_is_transformers_greedy(url, reference):
    from langgraph.prebuilt import create_react_agent

    recorded = Recorded()
    llm = chat_openai(url, http_client=recorded.client, logprobs=True)
    agent = create_react_agent(llm, [get_weather, multiply])
    out = agent.invoke({"messages": [HumanMessage("What's the weather in Oslo and in Paris?")]}, {"recursion_limit": 8})
    assert [len(m.tool_calls) for m in out["messages"] if m.type == "ai"] == [2, 0], out["messages"]
    assert out["messages"][-1].content
    held = None  # tokens the conversation's state held after the turn before
    for call in recorded.calls:
        usage, choice = call["reply"]["usage"], call["reply"]["choices"][0]
        prompt, want = greedy_tokens(reference, call["body"], usage["completion_tokens"])
        assert usage["prompt_tokens"] == prompt
        got = [entry["token"] for entry in choice["logprobs"]["content"]]  # (the reply's closing token left out)
        assert got == want[:len(got)] and len(got) >= usage["completion_tokens"] - 1, (got, want)
        if held is not None:  # all of the turn before, but its last token (never fed back)
            assert usage["prompt_tokens_details"]["cached_tokens"] >= held - 1, usage
        held = usage["prompt_tokens"] + usage["completion_tokens"]


# --- ChatOpenAI's calls -------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{"tool_choice": "required"}, {"tool_choice": "get_weather"},
                                     {"tool_choice": "any", "parallel_tool_calls": False},
                                     {"tool_choice": "required", "strict": True}])
def test_bound_tools_stream_as_they_answer_whole_with_the_usage_in_the_stream(url, options):
    model = chat_openai(url, stream_usage=True).bind_tools([get_weather, multiply], **options)
    question = [HumanMessage("What's the weather in Oslo and in Paris?")]
    whole = model.invoke(question)
    chunks = list(model.stream(question))
    streamed = joined(chunks)
    calls = [(c["name"], c["args"]) for c in whole.tool_calls]
    assert calls and [(c["name"], c["args"]) for c in streamed.tool_calls] == calls
    assert len(calls) == 1 if options.get("parallel_tool_calls") is False else len(calls) >= 1
    assert options["tool_choice"] != "get_weather" or {name for name, _ in calls} == {"get_weather"}
    assert streamed.response_metadata["finish_reason"] == whole.response_metadata["finish_reason"] == "tool_calls"
    assert [c for c in chunks if c.usage_metadata] and streamed.usage_metadata["output_tokens"] == \
        whole.usage_metadata["output_tokens"]
    assert streamed.usage_metadata["input_token_details"]["cache_read"] >= streamed.usage_metadata["input_tokens"] - 1


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_by_each_method_whole_and_streamed(url, method):
    structured = chat_openai(url).with_structured_output(Answer, method=method, include_raw=True)
    asked = "Is it sunny in Oslo? Answer with sunny and mood."
    reply = structured.invoke(asked)
    assert isinstance(reply["parsed"], Answer) and reply["parsing_error"] is None
    assert reply["raw"].usage_metadata["input_tokens"] > 0
    plain = chat_openai(url).with_structured_output(Answer, method=method)
    assert list(plain.stream(asked))[-1] == plain.invoke(asked) == reply["parsed"]


def test_chatopenais_fields_are_taken_as_openai_takes_them(url):
    asked = [HumanMessage("Hello!")]
    base = chat_openai(url).invoke(asked)
    for options in ({"extra_body": {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.0}},
                    {"max_completion_tokens": 64}, {"seed": 7}, {"stop": ["zzz"]}, {"reasoning_effort": "low"},
                    {"service_tier": "default"}, {"store": False, "extra_body": {"metadata": {"run": "a"}}},
                    {"model_kwargs": {"prompt_cache_key": "k", "safety_identifier": "s"}}):
        assert chat_openai(url, **options).invoke(asked).content == base.content, options
    scored = chat_openai(url, logprobs=True, top_logprobs=2).invoke(asked)
    entries = scored.response_metadata["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == base.content and all(len(e["top_logprobs"]) == 2 for e in entries)
    two = chat_openai(url, n=2).generate([asked]).generations[0]
    assert [g.text for g in two] == [base.content] * 2  # greedy: both choices the one reply


# --- the openai client's typed replies, helpers and errors ----------------------------------------

def test_the_stream_helper_assembles_each_choice_as_the_whole_reply_with_log_probabilities(url):
    """A later choice's first chunk carried its tokens' log-probabilities (a reply that opens with
    a call: the call's first chunk, the role in it): the openai client's stream helper copies a
    new choice's first chunk's into its snapshot and then adds them again, so that choice 1 of
    n=2 held the call's first tokens twice (58 entries where its reply has 39)."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    asked = dict(model="demo", messages=[{"role": "user", "content": "What's the weather in Oslo and Paris?"}],
                 tools=[WEATHER], tool_choice="required", max_tokens=60, n=2, logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**asked)
    with client.chat.completions.stream(**asked, stream_options={"include_usage": True}) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert len(streamed.choices) == 2
    for one, other in zip(whole.choices, streamed.choices):
        assert [c.function.arguments for c in other.message.tool_calls] == \
            [c.function.arguments for c in one.message.tool_calls]
        assert [e.token for e in other.logprobs.content] == [e.token for e in one.logprobs.content]
    assert streamed.usage.completion_tokens == whole.usage.completion_tokens


def test_parse_and_every_reply_as_the_clients_types(url):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    parsed = client.chat.completions.parse(model="demo", messages=[{"role": "user", "content": "Sunny in Oslo?"}],
                                           response_format=Answer, max_tokens=40)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    assert [m.id for m in client.models.list()] == ["demo"]
    body = {"model": "demo", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "tool_choice": "required", "max_tokens": 40, "n": 2, "logprobs": True, "top_logprobs": 2}
    ChatCompletion.model_validate(httpx.post(url + "/chat/completions", json=body, timeout=60).json())
    with httpx.stream("POST", url + "/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    firsts = [next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i) for i in (0, 1)]
    assert all(f["delta"]["role"] == "assistant" and f["delta"]["tool_calls"][0]["id"] for f in firsts)


def test_a_context_overflow_is_langchains_context_overflow_error(url):
    """Hibana's 400 for a prompt past the context has OpenAI's code, but the openai client's error
    text is its message alone, and ChatOpenAI tells an overflow by the message: it raised a plain
    invalid request, so that SummarizationMiddleware's retry on a shorter prompt never ran."""
    from langchain_core.exceptions import ContextOverflowError

    llm = chat_openai(url, max_tokens=8)
    for asked in ("word " * 5000, [HumanMessage("hi")] * 3000):  # too many tokens; more messages than tokens
        with pytest.raises(ContextOverflowError):
            llm.invoke(asked)
        with pytest.raises(ContextOverflowError):
            list(llm.stream(asked))
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "word " * 5000}])
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    assert llm.invoke("Hello!").content  # and the server goes on


@pytest.mark.parametrize("body, error, param", [
    ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     openai.BadRequestError, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     openai.BadRequestError, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, openai.BadRequestError, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "y"}]},
     openai.BadRequestError, "messages"),
    ({"max_completion_tokens": 100000}, openai.BadRequestError, "max_completion_tokens"),
])
def test_errors_are_the_clients_typed_errors_in_openais_shape(url, body, error, param):
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    asked = {"model": "demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, **body}
    for stream in (False, True):
        with pytest.raises(error) as caught:
            client.chat.completions.create(**asked, stream=stream)
        assert caught.value.param == param and caught.value.type == "invalid_request_error"
    assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2).choices[0].message.content


# --- robustness ----------------------------------------------------------------------------------

def test_eight_chatopenai_streams_at_once_get_what_each_gets_alone(url):
    model = chat_openai(url, stream_usage=True).bind_tools([get_weather, multiply])
    cities = ["Oslo", "Paris", "Lima", "Rome", "Tokyo", "Cairo", "Quito", "Perth"]

    def run(city: str) -> tuple:
        reply = joined(list(model.stream(f"What's the weather in {city}?")))
        return reply.content, [(c["name"], c["args"]) for c in reply.tool_calls], reply.usage_metadata["output_tokens"]

    alone = [run(city) for city in cities]
    together: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(cities[i]))) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [together.get(i) for i in range(8)] == alone


def test_a_chatopenai_stream_left_early_lets_its_state_go(url):
    llm = chat_openai(url, max_tokens=200, default_headers={"X-Hibana-State": "audit4-left"})
    for i, _ in enumerate(llm.stream("Tell me a very long story about cats and dogs")):
        if i == 2:
            break
    deadline = time.monotonic() + 30
    while any(s["busy"] for s in httpx.get(url + "/hibana/states").json()["data"] if s["id"] == "audit4-left"):
        assert time.monotonic() < deadline, "the stream left early still holds its state"
        time.sleep(0.05)
    assert llm.invoke("Hello!").content  # its state serves the next call


def test_the_message_shapes_clients_send(url):
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def prompt_tokens(messages: list[dict]) -> int:
        return client.chat.completions.create(model="demo", messages=messages, max_tokens=2).usage.prompt_tokens

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    asked = {"role": "user", "content": "Weather in Oslo?"}
    text = prompt_tokens([asked, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}])
    for shapes in ([{**asked, "name": "alice"}, {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}],
                   [asked, {"role": "assistant", "content": "Sunny.", "tool_calls": []},
                    {"role": "user", "content": "Thanks"}]):
        assert prompt_tokens(shapes) == text
    assert prompt_tokens([{"role": "user", "content": "Héllo 🌍 日本語 \u0000 ''"}])
    assert prompt_tokens([{"role": "user", "content": ""}])
    calls = prompt_tokens([asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    parts = [{"type": "text", "text": "sunny"}]
    assert prompt_tokens([asked, {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "c1", "content": parts}]) == calls
    with pytest.raises(openai.BadRequestError):  # OpenAI's types require a tool message's content
        prompt_tokens([asked, {"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1"}])


def test_a_refusal_sent_back_as_the_client_got_it_is_the_assistants_text(url):
    """An OpenAI reply that refused has content null and the refusal in `refusal`; sent back in the
    history as the client got it, its text was dropped (the turn rendered empty), where the same
    refusal as a content part is its text."""
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def prompt_tokens(assistant: dict) -> int:
        messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", **assistant},
                    {"role": "user", "content": "Why not?"}]
        return client.chat.completions.create(model="demo", messages=messages, max_tokens=2).usage.prompt_tokens

    said = "I can't help with that."
    as_part = prompt_tokens({"content": [{"type": "refusal", "refusal": said}]})
    assert prompt_tokens({"content": None, "refusal": said}) == as_part > prompt_tokens({"content": None})
