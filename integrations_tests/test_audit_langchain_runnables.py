"""ChatHibana inside LangChain's wider Runnable ecosystem, as a LangChain user expects of any chat
model (ChatOpenAI, ChatOllama): the global LLM cache, retries and fallbacks, configurable fields and
alternatives, bound stop strings, callbacks with tags and metadata, astream_events, batches,
token counting over a tool conversation, LangSmith's ls_params, serialisation and copies, the rate
limiter, disable_streaming, output_version, and chains with LangChain's output parsers. All on the
demo model (CPU)."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from typing import Annotated

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.globals import get_llm_cache, set_llm_cache
from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.load import dumpd, dumps, loads
from langchain_core.messages import AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import JsonOutputParser, StrOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.rate_limiters import InMemoryRateLimiter
from langchain_core.runnables import ConfigurableField
from langchain_core.tools import tool
from pydantic import BaseModel, Field

import hibana_plugins.langchain as lc
from hibana_core import HibanaError
from hibana_plugins.langchain import ChatHibana

HELLO = "hello"                  # the demo answers "Hi! What can I do for you?" (10 tokens, then its end)
QUESTIONS = ["What is 3 plus 5?", "Weather in Paris?", HELLO, "What is 7 times 2?"]


@tool
def get_weather(city: Annotated[str, "Name of the city."]) -> str:
    """Get the current weather for a city."""
    return "sunny"


class GetWeather(BaseModel):
    """Get the current weather for a city."""

    city: str = Field(description="Name of the city.")


@pytest.fixture(scope="module")
def llm():
    return ChatHibana(model="demo", max_tokens=12)


@pytest.fixture(scope="module")
def greeting(llm):
    return llm.invoke(HELLO).content


@pytest.fixture
def global_cache():
    before = get_llm_cache()
    cache = InMemoryCache()
    set_llm_cache(cache)
    try:
        yield cache
    finally:
        set_llm_cache(before)


def _merged(chunks):
    full = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    return full


# --- the LLM cache -----------------------------------------------------------------------------------

def test_the_global_cache_serves_an_identical_call_and_keeps_other_options_apart(llm, global_cache, greeting):
    first = llm.invoke(HELLO)
    assert len(global_cache._cache) == 1
    again = llm.invoke(HELLO)  # served from the cache: LangChain zeroes a hit's cost
    assert again.content == first.content == greeting and again.usage_metadata.get("total_cost") == 0
    assert len(global_cache._cache) == 1
    short = llm.invoke(HELLO, max_tokens=2)  # another option, another entry and another reply
    assert short.usage_metadata["output_tokens"] == 2 and len(global_cache._cache) == 2
    sampled = llm.configurable_fields(temperature=ConfigurableField(id="temp"))
    sampled.invoke(HELLO, config={"configurable": {"temp": 0.9}}, seed=3)
    assert len(global_cache._cache) == 3
    other_model = llm.model_copy(update={"model": "org/other"})
    assert other_model._get_llm_string() != llm._get_llm_string()  # the model is in the key
    assert asyncio.run(llm.ainvoke(HELLO)).content == greeting and len(global_cache._cache) == 3


def test_the_cache_keeps_output_versions_apart():
    """The cache stores a reply after output_version's conversion, and keyed without it: an
    output_version="v1" object got a cached v0 reply (content a string, not blocks), and a v0
    object a v1 one (ChatOpenAI keys on it through its serialised form)."""
    cache = InMemoryCache()
    plain = ChatHibana(model="demo", max_tokens=12, cache=cache).invoke(HELLO)
    blocks = ChatHibana(model="demo", max_tokens=12, cache=cache, output_version="v1").invoke(HELLO)
    assert isinstance(plain.content, str)
    assert blocks.content == [{"type": "text", "text": plain.content}]
    assert isinstance(ChatHibana(model="demo", max_tokens=12, cache=cache).invoke(HELLO).content, str)


# --- retries, fallbacks, configuration -----------------------------------------------------------------

def test_with_fallbacks_either_way(llm, greeting):
    class Failing(FakeListChatModel):
        def _call(self, *args, **kwargs):
            raise RuntimeError("down")

    assert Failing(responses=["x"]).with_fallbacks([llm]).invoke(HELLO).content == greeting
    timing_out = ChatHibana(model="demo", max_tokens=12, timeout=1e-9)
    with pytest.raises(HibanaError):
        timing_out.invoke(HELLO)
    guarded = timing_out.with_fallbacks([FakeListChatModel(responses=["fallback"])])
    assert guarded.invoke(HELLO).content == "fallback"
    assert "".join(c.content for c in guarded.stream(HELLO)) == "fallback"  # failed before its first chunk


def test_with_retry_retries_a_failed_call(llm, greeting, monkeypatch):
    opened = []
    real_open = lc._Call.open

    def flaky(self, stack):
        opened.append(1)
        if len(opened) == 1:
            raise RuntimeError("transient")
        return real_open(self, stack)

    monkeypatch.setattr(lc._Call, "open", flaky)
    assert llm.with_retry(stop_after_attempt=2, wait_exponential_jitter=False).invoke(HELLO).content == greeting
    assert len(opened) == 2


def test_configurable_fields_and_alternatives_switch_at_call_time(llm, greeting):
    configurable = llm.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"),
                                           temperature=ConfigurableField(id="temperature"),
                                           stop=ConfigurableField(id="stop"))
    assert configurable.invoke(HELLO).content == greeting
    assert configurable.invoke(HELLO, config={"configurable": {"max_tokens": 2}}).usage_metadata["output_tokens"] == 2
    assert configurable.invoke(HELLO, config={"configurable": {"stop": ["What"]}}).content == "Hi! "
    with pytest.raises(HibanaError, match="temperature"):  # checked as the object is rebuilt
        configurable.invoke(HELLO, config={"configurable": {"temperature": -1}})
    choice = llm.configurable_alternatives(ConfigurableField(id="llm"), default_key="hibana",
                                           fake=FakeListChatModel(responses=["F"]))
    assert choice.invoke(HELLO).content == greeting
    assert choice.invoke(HELLO, config={"configurable": {"llm": "fake"}}).content == "F"


def test_bind_stop_cuts_the_reply_and_is_what_langsmith_sees(llm):
    seen = []

    class Start(BaseCallbackHandler):
        def on_chat_model_start(self, serialized, messages, **kwargs):
            seen.append(kwargs["metadata"])

    reply = llm.bind(stop=["What"]).invoke(HELLO, config={"callbacks": [Start()]})
    assert reply.content == "Hi! " and reply.response_metadata["finish_reason"] == "stop"
    assert seen[0]["ls_stop"] == ["What"]
    assert llm.invoke(HELLO, stop="What").content == "Hi! "  # one string, as a list of one


def test_ls_params_report_the_values_the_call_runs_with(llm):
    """LangSmith's ls_params read the call's kwargs as given: `.bind(num_predict=3)` (an alias
    the adapter takes) reported the object's max_tokens, and a call's `temperature=None` (the
    object's value) reported None."""
    assert llm._get_ls_params() == {"ls_provider": "hibana", "ls_model_name": "demo", "ls_model_type": "chat",
                                    "ls_temperature": 0.0, "ls_max_tokens": 12}
    assert llm._get_ls_params(stop=["x"], temperature=0.5, max_tokens=3)["ls_stop"] == ["x"]
    seen = []

    class Start(BaseCallbackHandler):
        def on_chat_model_start(self, serialized, messages, **kwargs):
            seen.append(kwargs["metadata"])

    reply = llm.bind(num_predict=3).invoke(HELLO, config={"callbacks": [Start()]})
    assert reply.usage_metadata["output_tokens"] == 3
    assert seen[-1]["ls_max_tokens"] == 3
    params = llm._get_ls_params(temperature=None, max_tokens=None)
    assert params["ls_temperature"] == 0.0 and params["ls_max_tokens"] == 12
    assert llm._identifying_params["model"] == "demo" and llm._llm_type == "hibana-chat"


# --- callbacks and events --------------------------------------------------------------------------------

def test_callbacks_get_tokens_tags_metadata_and_usage(llm, greeting):
    class Recorder(BaseCallbackHandler):
        def __init__(self):
            self.starts, self.tokens, self.ends = [], [], []

        def on_chat_model_start(self, serialized, messages, **kwargs):
            self.starts.append(kwargs)

        def on_llm_new_token(self, token, **kwargs):
            self.tokens.append((token, kwargs.get("chunk")))

        def on_llm_end(self, response, **kwargs):
            self.ends.append((response, kwargs))

    recorder = Recorder()
    config = {"callbacks": [recorder], "tags": ["audit"], "metadata": {"who": "auditor"}}
    streamed = _merged(llm.stream(HELLO, config=config))
    assert "".join(token for token, _ in recorder.tokens) == streamed.content == greeting
    assert all(chunk is not None for _, chunk in recorder.tokens)
    start = recorder.starts[0]
    assert "audit" in start["tags"] and start["metadata"]["who"] == "auditor"
    assert start["metadata"]["ls_provider"] == "hibana" and start["invocation_params"]["max_tokens"] == 12
    response, kwargs = recorder.ends[0]
    message = response.generations[0][0].message
    assert "audit" in kwargs["tags"]
    assert message.usage_metadata == streamed.usage_metadata and message.usage_metadata["output_tokens"] == 10
    assert message.response_metadata["model_name"] == "demo"
    assert message.response_metadata["finish_reason"] == "stop"

    class AsyncRecorder(AsyncCallbackHandler):
        def __init__(self):
            self.tokens = []

        async def on_llm_new_token(self, token, **kwargs):
            self.tokens.append(token)

    recorder = AsyncRecorder()
    streaming = ChatHibana(model="demo", max_tokens=12, streaming=True)
    reply = asyncio.run(streaming.ainvoke(HELLO, config={"callbacks": [recorder]}))
    assert "".join(recorder.tokens) == reply.content == greeting


def test_astream_events_in_order_their_chunks_making_the_final_message(llm, greeting):
    async def events(runnable, text):
        return [e async for e in runnable.astream_events(text, version="v2", config={"tags": ["ev"]})]

    evs = asyncio.run(events(llm, HELLO))
    names = [e["event"] for e in evs]
    assert names[0] == "on_chat_model_start" and names[-1] == "on_chat_model_end"
    assert set(names[1:-1]) == {"on_chat_model_stream"}
    assert all("ev" in e["tags"] for e in evs)
    output = evs[-1]["data"]["output"]
    assert _merged(e["data"]["chunk"] for e in evs[1:-1]).content == output.content == greeting
    assert output.usage_metadata["output_tokens"] == 10

    evs = asyncio.run(events(llm.bind_tools([get_weather]).bind(max_tokens=40), "Weather in Paris?"))
    chunks = [e["data"]["chunk"] for e in evs if e["event"] == "on_chat_model_stream"]
    assert any(chunk.tool_call_chunks for chunk in chunks)
    merged = _merged(chunks)
    output = evs[-1]["data"]["output"]
    assert merged.tool_calls == output.tool_calls
    assert [(c["name"], c["args"]) for c in output.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert output.response_metadata["finish_reason"] == "tool_calls"


# --- batches and counting -------------------------------------------------------------------------------

def test_batch_and_abatch_keep_the_order_of_one_by_one_greedy_calls(llm):
    one_by_one = [llm.invoke(q).content for q in QUESTIONS]
    assert [m.content for m in llm.batch(QUESTIONS, config={"max_concurrency": 2})] == one_by_one
    assert [m.content for m in asyncio.run(llm.abatch(QUESTIONS, config={"max_concurrency": 3}))] == one_by_one
    bad = llm.batch([HELLO, HELLO], config=[{}, {"callbacks": []}], return_exceptions=True, timeout=-1)
    assert all(isinstance(result, HibanaError) for result in bad)  # refused per call, in its place


def test_the_count_is_the_prompt_each_turn_of_a_tool_conversation_reports(llm):
    agent = llm.bind_tools([get_weather]).bind(max_tokens=40)
    messages = [SystemMessage("Be brief."), HumanMessage("Weather in Paris?")]
    for follow_up in (None, "And in Rome?"):
        if follow_up:
            messages.append(HumanMessage(follow_up))
        reply = agent.invoke(messages)
        assert llm.get_num_tokens_from_messages(messages, tools=[get_weather]) == reply.usage_metadata["input_tokens"]
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage("sunny", tool_call_id=call["id"]))
    assert llm.get_num_tokens(HELLO) == len(llm.engine.tokenizer.encode(HELLO, add_special_tokens=False))


# --- serialisation and copies ------------------------------------------------------------------------------

def test_serialisation_pickles_dumps_and_copies(llm, greeting):
    assert ChatHibana.is_lc_serializable() is False
    assert dumpd(llm)["kwargs"] == {"max_tokens": 12, "model": "demo"}
    back = loads(dumps(llm), allowed_objects=[ChatHibana], valid_namespaces=["hibana_plugins"])
    assert back.max_tokens == 12 and back.invoke(HELLO).content == greeting
    assert ChatHibana(**llm.model_dump()).invoke(HELLO).content == greeting
    assert json.loads(llm.model_dump_json())["max_tokens"] == 12
    assert pickle.loads(pickle.dumps(llm.bind_tools([get_weather]))).invoke(
        "Weather in Paris?", max_tokens=40).tool_calls[0]["args"] == {"city": "Paris"}
    shorter = llm.model_copy(update={"max_tokens": 3})
    assert shorter.invoke(HELLO).usage_metadata["output_tokens"] == 3 and llm.max_tokens == 12
    assert shorter.engine is llm.engine


# --- options LangChain gives every chat model --------------------------------------------------------------

def test_rate_limiter_disable_streaming_and_output_version(greeting):
    limiter = InMemoryRateLimiter(requests_per_second=4, check_every_n_seconds=0.01, max_bucket_size=1)
    limited = ChatHibana(model="demo", max_tokens=1, rate_limiter=limiter)
    started = time.monotonic()
    for _ in range(3):
        limited.invoke(HELLO)
    assert time.monotonic() - started >= 0.4  # the bucket refills at 4 a second
    whole = ChatHibana(model="demo", max_tokens=12, disable_streaming=True)
    assert [c.content for c in whole.stream(HELLO)] == [greeting]
    tools_whole = ChatHibana(model="demo", max_tokens=40, disable_streaming="tool_calling")
    assert len(list(tools_whole.bind_tools([get_weather]).stream("Weather in Paris?"))) == 1
    assert len(list(tools_whole.stream(HELLO))) > 1
    v1 = ChatHibana(model="demo", max_tokens=40, output_version="v1")
    assert v1.invoke(HELLO).content == [{"type": "text", "text": greeting}]
    call = v1.bind_tools([get_weather]).invoke("Weather in Paris?")
    assert [b["type"] for b in call.content] == ["tool_call"] and call.tool_calls[0]["args"] == {"city": "Paris"}
    streamed = _merged(v1.bind_tools([get_weather]).stream("Weather in Paris?"))
    assert isinstance(streamed, AIMessageChunk) and streamed.tool_calls[0]["args"] == {"city": "Paris"}


def test_chains_with_langchains_parsers(llm, greeting):
    prompt = ChatPromptTemplate.from_messages([("system", "You are helpful."), ("user", "{q}")])
    assert (prompt | llm | StrOutputParser()).invoke({"q": HELLO}) == greeting
    assert "".join((prompt | llm | StrOutputParser()).stream({"q": HELLO})) == greeting
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    as_json = prompt | llm.bind(response_format=schema, max_tokens=40) | JsonOutputParser()
    answer = as_json.invoke({"q": "Weather in Paris?"})
    assert isinstance(answer, dict) and isinstance(answer["city"], str)
    assert list(as_json.stream({"q": "Weather in Paris?"}))[-1] == answer
    forced = llm.bind_tools([GetWeather], tool_choice="any").bind(max_tokens=40)
    tools = forced | PydanticToolsParser(tools=[GetWeather])
    assert tools.invoke("Weather in Paris?") == [GetWeather(city="Paris")]


def test_llm_output_carries_the_token_usage_as_chatopenais(llm):
    """`on_llm_end`'s `LLMResult.llm_output` and `generate`'s: `token_usage` in OpenAI's names and
    `model_name`, summed over a batch's prompts (callbacks written for ChatOpenAI read them; it was None)."""
    class Ends(BaseCallbackHandler):
        def __init__(self) -> None:
            self.outputs: list = []

        def on_llm_end(self, response, **kwargs) -> None:
            self.outputs.append(response.llm_output)

    ends = Ends()
    reply = llm.invoke("Say hello.", config={"callbacks": [ends]})
    usage = reply.usage_metadata
    assert ends.outputs[-1]["model_name"] == "demo"
    assert {k: ends.outputs[-1]["token_usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} \
        == {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"]}
    both = llm.generate([[HumanMessage("Say hello.")], [HumanMessage("Weather in Oslo?")]])
    alone = [llm.invoke([HumanMessage(q)]).usage_metadata for q in ("Say hello.", "Weather in Oslo?")]
    assert both.llm_output["token_usage"]["completion_tokens"] == sum(u["output_tokens"] for u in alone)
    assert both.llm_output["token_usage"]["prompt_tokens"] == sum(u["input_tokens"] for u in alone)
