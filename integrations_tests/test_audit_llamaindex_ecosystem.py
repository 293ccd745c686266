"""Audit (LlamaIndex's wider ecosystem): `HibanaLLM` as `Settings.llm` behind the components that read
Settings (a VectorStoreIndex's query engines in each response mode, chat engines over several turns),
LlamaIndex's callback and instrumentation systems (TokenCountingHandler, CallbackManager, the
dispatcher's events and spans), `metadata` as prompt packing and chat memory read it, LlamaIndex's
prompt options, structured programs with nested models, predict_and_call with async and parallel
tools, and agents whose Context is written out and read back between runs. On the bundled demo
model (one engine for the module); its answers are not judged, only what LlamaIndex gets back."""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import List, Optional

import pytest

pytest.importorskip("llama_index.core")

import llama_index.core.instrumentation as instrument  # noqa: E402
from llama_index.core import Document, MockEmbedding, PromptTemplate, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock  # noqa: E402
from llama_index.core.callbacks import CallbackManager, CBEventType, TokenCountingHandler  # noqa: E402
from llama_index.core.callbacks.base_handler import BaseCallbackHandler  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent  # noqa: E402
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from hibana_core import Engine  # noqa: E402
from hibana_core.demo import world  # noqa: E402
from hibana_core.errors import ConfigError  # noqa: E402
from hibana_plugins.llamaindex import HibanaLLM  # noqa: E402

# LlamaIndex's workflows inspect agents (pydantic models) attribute by attribute
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:inspect")


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        yield engine


@pytest.fixture
def settings(engine):
    """Settings as a LlamaIndex app sets them (the model's tokenizer, as the README says), restored after."""
    saved = {name: getattr(Settings, f"_{name}") for name in ("llm", "embed_model", "tokenizer", "callback_manager")}
    Settings.embed_model = MockEmbedding(embed_dim=8)
    Settings.tokenizer = engine.tokenizer
    yield Settings
    for name, value in saved.items():
        setattr(Settings, f"_{name}", value)


class Recorder(BaseEventHandler):
    """The dispatcher's events, by class name; with `usage`, each LLM call's reply's raw."""

    events: list = []
    spans: object = None  # the SimpleSpanHandler beside it

    @classmethod
    def class_name(cls) -> str:
        return "Recorder"

    def handle(self, event, **kwargs) -> None:
        self.events.append(event)

    def names(self) -> list[str]:
        names = [type(e).__name__ for e in self.events if "InProgress" not in type(e).__name__]
        self.events.clear()
        return names

    def raws(self, kind=LLMChatEndEvent) -> list[dict]:
        return [e.response.raw for e in self.events if isinstance(e, kind)]


@pytest.fixture
def recorder():
    dispatcher = instrument.get_dispatcher()
    spans = SimpleSpanHandler()
    recorder = Recorder(events=[], spans=spans)
    dispatcher.add_event_handler(recorder)
    dispatcher.add_span_handler(spans)
    yield recorder
    dispatcher.event_handlers.remove(recorder)
    dispatcher.span_handlers.remove(spans)


DOCS = [Document(text=f"Ana Garcia lives in {city}. The weather there is sunny.") for city in ("Lyon", "Oslo", "Porto")]


# --- Settings.llm behind LlamaIndex's components --------------------------------------------------

def test_query_engines_over_settings_llm_answer_in_every_response_mode(engine, settings, recorder):
    """A VectorStoreIndex (MockEmbedding) queried through Settings.llm = HibanaLLM in compact, refine
    and tree_summarize, plain, streamed and async: every answer comes back as LlamaIndex's response
    type, and every LLM call's usage is the engine's (a prompt that fits the context)."""
    settings.llm = HibanaLLM(engine=engine, max_tokens=12)
    index = VectorStoreIndex.from_documents(DOCS)
    for mode in ("compact", "refine", "tree_summarize"):
        answer = index.as_query_engine(response_mode=mode, similarity_top_k=3).query("Where does Ana live?")
        assert str(answer).strip() and answer.source_nodes
        streamed = index.as_query_engine(response_mode=mode, similarity_top_k=3, streaming=True).query("Where?")
        assert "".join(streamed.response_gen).strip()
        answer = asyncio.run(index.as_query_engine(response_mode=mode).aquery("Where does Ana live?"))
        assert str(answer).strip()
    raws = recorder.raws(LLMChatEndEvent)
    assert len(raws) >= 9 and all(0 < r["usage"]["prompt_tokens"] < engine.max_model_len for r in raws)


def test_chat_engines_continue_their_conversation_turn_after_turn(engine, settings, recorder):
    """SimpleChatEngine and CondensePlusContextChatEngine over four turns (chat, stream_chat,
    astream_chat, achat): each turn's chat call continues the state of the turn before (its prompt
    served from it), while the condense step's completions run beside it."""
    llm = HibanaLLM(engine=engine, max_tokens=12)
    settings.llm = llm
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, SimpleChatEngine

    index = VectorStoreIndex.from_documents(DOCS)
    for chat_engine in (SimpleChatEngine.from_defaults(llm=llm, system_prompt="You are helpful."),
                        CondensePlusContextChatEngine.from_defaults(index.as_retriever(), llm=llm)):
        recorder.events.clear()
        assert chat_engine.chat("Hi").response
        assert "".join(chat_engine.stream_chat("Where does Ana Garcia live?").response_gen)

        async def more() -> None:
            streamed = await chat_engine.astream_chat("thanks")
            assert "".join([token async for token in streamed.async_response_gen()])
            assert (await chat_engine.achat("bye")).response
        asyncio.run(more())
        assert len(chat_engine.chat_history) == 8
        turns = recorder.raws(LLMChatEndEvent)
        assert len(turns) == 4 and len({t["state_id"] for t in turns}) == 1
        for before, after in zip(turns, turns[1:]):  # all but the last generated token's KV
            assert after["usage"]["cached_tokens"] >= before["usage"]["prompt_tokens"]


# --- callbacks and instrumentation ----------------------------------------------------------------

class LLMEvents(BaseCallbackHandler):
    def __init__(self) -> None:
        super().__init__([], [])
        self.events: list[tuple[str, CBEventType]] = []

    def on_event_start(self, event_type, payload=None, event_id="", parent_id="", **kwargs) -> str:
        self.events.append(("start", event_type))
        return event_id

    def on_event_end(self, event_type, payload=None, event_id="", **kwargs) -> None:
        self.events.append(("end", event_type))

    def start_trace(self, trace_id=None) -> None:
        pass

    def end_trace(self, trace_id=None, trace_map=None) -> None:
        pass


async def _every_entry_point(llm) -> list[dict]:
    """Each chat/complete entry point once, plain, streamed and async; their usages."""
    chat = [ChatMessage(role="user", content="Hi there")]
    replies = [llm.complete("Hi"), llm.chat(chat), list(llm.stream_complete("Hello"))[-1],
               list(llm.stream_chat(chat))[-1], await llm.acomplete("Hey"), await llm.achat(chat),
               [r async for r in await llm.astream_complete("Hey you")][-1],
               [r async for r in await llm.astream_chat(chat)][-1]]
    return [r.raw["usage"] for r in replies]


def test_token_counting_and_callback_events_are_the_engines_usage(engine):
    """TokenCountingHandler with the model's tokenizer counts, per call and in total, exactly the
    prompt and completion tokens the engine reports; the CallbackManager sees one LLM start and end
    per call, streamed and async ones included (an end only once the stream is read)."""
    counter, events = TokenCountingHandler(tokenizer=engine.tokenizer.encode), LLMEvents()
    llm = HibanaLLM(engine=engine, max_tokens=10, callback_manager=CallbackManager([counter, events]))
    usages = asyncio.run(_every_entry_point(llm))
    assert [(c.prompt_token_count, c.completion_token_count) for c in counter.llm_token_counts] == [
        (u["prompt_tokens"], u["completion_tokens"]) for u in usages]
    assert counter.total_llm_token_count == sum(u["total_tokens"] for u in usages)
    assert events.events == [("start", CBEventType.LLM), ("end", CBEventType.LLM)] * 8


def test_dispatcher_events_and_spans_of_each_entry_point(engine, recorder):
    """The instrumentation dispatcher: start, in-progress and end events per entry point (their end
    event's response carrying the engine's usage), predict's and structured_predict's own events
    around them, and a closed span per method called."""
    llm = HibanaLLM(engine=engine, max_tokens=10)
    usages = asyncio.run(_every_entry_point(llm))
    assert [r["usage"] for r in recorder.raws(LLMChatEndEvent)] == usages[1::2]
    assert [r["usage"] for r in recorder.raws(LLMCompletionEndEvent)] == usages[::2]
    assert recorder.names() == ["LLMCompletionStartEvent", "LLMCompletionEndEvent",
                                "LLMChatStartEvent", "LLMChatEndEvent"] * 4
    llm.predict(PromptTemplate("Hi {x}"), x="there")
    assert recorder.names() == ["LLMPredictStartEvent", "LLMChatStartEvent", "LLMChatEndEvent", "LLMPredictEndEvent"]
    llm.structured_predict(Point, PromptTemplate("The point {q}"), llm_kwargs={"max_tokens": 64}, q="1 2")
    assert recorder.names() == ["LLMStructuredPredictStartEvent", "LLMChatStartEvent", "LLMChatEndEvent",
                                "LLMStructuredPredictEndEvent"]
    spans = {span.id_.split("-")[0] for span in recorder.spans.completed_spans}
    assert {f"HibanaLLM.{name}" for name in ("complete", "chat", "stream_complete", "stream_chat", "acomplete",
                                             "achat", "astream_complete", "astream_chat", "predict",
                                             "structured_predict")} <= spans
    assert not recorder.spans.dropped_spans


# --- metadata and LlamaIndex's prompt options -----------------------------------------------------

def test_metadata_is_what_llamaindex_sizes_prompts_and_memory_by(engine, settings):
    """metadata: the engine's context, max_tokens as num_output, a chat and function-calling model
    named as given; ChatMemoryBuffer.from_defaults(llm=...) takes its share of that context, and with
    the model's tokenizer keeps a conversation within its token limit."""
    from llama_index.core.memory import ChatMemoryBuffer

    llm = HibanaLLM(engine=engine, max_tokens=40)
    metadata = llm.metadata
    assert (metadata.context_window, metadata.num_output, metadata.is_chat_model,
            metadata.is_function_calling_model, metadata.model_name) == (engine.max_model_len, 40, True, True, "demo")
    assert HibanaLLM(engine=engine, context_window=engine.max_model_len).metadata.context_window == engine.max_model_len
    with pytest.raises(ConfigError):  # an engine loaded with another context
        HibanaLLM(engine=engine, context_window=engine.max_model_len // 2)
    memory = ChatMemoryBuffer.from_defaults(llm=llm)
    assert memory.token_limit == int(engine.max_model_len * 0.75)
    memory = ChatMemoryBuffer.from_defaults(llm=llm, token_limit=200)
    for n in range(20):
        memory.put(ChatMessage(role="user" if n % 2 == 0 else "assistant", content=f"message {n} " * 8))
    kept = memory.get()
    assert 0 < len(kept) < 20
    assert len(engine.tokenizer.encode(" ".join(m.content for m in kept), add_special_tokens=False)) <= 200
    reply = llm.chat(kept + [ChatMessage(role="user", content="Hi")])
    assert reply.raw["usage"]["prompt_tokens"] < engine.max_model_len - metadata.num_output


def test_system_prompt_reaches_predict_and_its_stream(engine):
    """LLM.system_prompt is LlamaIndex's for predict / stream / apredict / astream (and the programs
    built on them): it is the first message the chat template renders. chat() and complete() take
    the messages as given, as LlamaIndex's OpenAI LLM does."""
    llm = HibanaLLM(engine=engine, max_tokens=4, system_prompt="You speak like a pirate.", state_id="pirate")

    def rendered() -> str:
        return engine.tokenizer.decode(engine.open_state("pirate").tokens)

    prompt = PromptTemplate("Say hi to {who}")
    for call in (lambda: llm.predict(prompt, who="Ana"), lambda: "".join(llm.stream(prompt, who="Ana")),
                 lambda: asyncio.run(llm.apredict(prompt, who="Ana"))):
        call()
        assert "pirate" in rendered()
    llm.chat([ChatMessage(role="user", content="Say hi")])
    assert "pirate" not in rendered()


def test_prompt_formatters_of_ones_own_are_refused_however_set(engine):
    """LlamaIndex's LLM base takes messages_to_prompt, completion_to_prompt and query_wrapper_prompt
    (HuggingFaceLLM's way to write a model's prompt format) and applies none of them to a chat model.
    The first two were refused at construction, but assigned afterwards (llm.messages_to_prompt = fn)
    they were silently ignored, and query_wrapper_prompt was silently ignored either way: every call
    rendered the chat template without it. Each is now a ConfigError that says so; LlamaIndex's
    defaults and None stay accepted (its unpickling passes them back)."""
    wrapper = PromptTemplate("[INST] {query_str} [/INST]")
    with pytest.raises(ConfigError, match="query_wrapper_prompt.*chat template"):
        HibanaLLM(engine=engine, query_wrapper_prompt=wrapper)
    llm = HibanaLLM(engine=engine, max_tokens=4, query_wrapper_prompt=None)
    for name, value in (("messages_to_prompt", lambda messages: "X"), ("completion_to_prompt", lambda text: "X"),
                        ("query_wrapper_prompt", wrapper)):
        with pytest.raises(ConfigError, match=f"{name}.*chat template"):
            setattr(llm, name, value)
        with pytest.raises(ConfigError, match=f"{name}.*chat template"):
            llm.model_copy(update={name: value})  # (pydantic's copy sets fields without __setattr__)
    assert llm.model_copy(update={"max_tokens": 5}).max_tokens == 5
    llm.messages_to_prompt = llm.messages_to_prompt  # LlamaIndex's own default
    llm.query_wrapper_prompt = None
    llm.system_prompt = "Be brief."  # (LlamaIndex's other fields are assigned as before)
    assert llm.complete("Hi").text


# --- structured output --------------------------------------------------------------------------

class Point(BaseModel):
    x: int
    y: int


class Color(str, Enum):
    red = "red"
    blue = "blue"


class Address(BaseModel):
    city: str
    zip: Optional[int] = None


class Person(BaseModel):
    """A person and where they live."""

    name: str
    age: int
    favourite: Color
    addresses: List[Address]


async def test_nested_structured_output_from_every_entry_point_and_program(engine):
    """A nested model (enum, optional field, list of models) from structured_predict and its async
    and streamed forms, as_structured_llm, FunctionCallingProgram (parallel calls: a list) and
    LLMTextCompletionProgram (its prompt asks for JSON; `json_schema` in its llm_kwargs holds the
    demo model's answer to the class's schema, which it otherwise writes as prose)."""
    from llama_index.core.program import FunctionCallingProgram, LLMTextCompletionProgram

    llm = HibanaLLM(engine=engine, max_tokens=96)
    prompt = PromptTemplate("Describe {who}")
    assert isinstance(llm.structured_predict(Person, prompt, who="Ana"), Person)
    assert isinstance(await llm.astructured_predict(Person, prompt, who="Ana"), Person)
    assert isinstance(list(llm.stream_structured_predict(Person, prompt, who="Ana"))[-1], Person)
    assert isinstance([p async for p in await llm.astream_structured_predict(Person, prompt, who="Ana")][-1], Person)
    structured = llm.as_structured_llm(Person)
    assert isinstance(structured.chat([ChatMessage(role="user", content="Describe Bob")]).raw, Person)
    assert isinstance(list(structured.stream_chat([ChatMessage(role="user", content="Describe Bob")]))[-1].raw,
                      Person)
    assert isinstance((await structured.acomplete("Describe Bob")).raw, Person)
    program = FunctionCallingProgram.from_defaults(output_cls=Point, prompt_template_str="The points {q}", llm=llm,
                                                   allow_parallel_tool_calls=True)
    points = program(q="1 2 and 3 4")
    assert isinstance(points, list) and points and all(isinstance(p, Point) for p in points)
    program = LLMTextCompletionProgram.from_defaults(output_cls=Person, prompt_template_str="Describe {who}", llm=llm)
    assert isinstance(program(llm_kwargs={"json_schema": Person.model_json_schema()}, who="Ana"), Person)


# --- tools --------------------------------------------------------------------------------------

async def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    await asyncio.sleep(0)
    return json.dumps(world.weather(city))


def add_numbers(a: float, b: float) -> str:
    """Add two numbers and return the sum."""
    return json.dumps({"result": world.fmt_number(a + b)})


def find_home_city(name: str) -> str:
    """Find the city where a person lives."""
    return json.dumps(world.home_city(name))


def tool(fn):
    from llama_index.core.tools import FunctionTool

    if asyncio.iscoroutinefunction(fn):
        return FunctionTool.from_defaults(async_fn=fn, description=fn.__doc__)
    return FunctionTool.from_defaults(fn, description=fn.__doc__)


async def test_predict_and_call_with_async_and_parallel_tools(engine):
    """predict_and_call / apredict_and_call over an async FunctionTool: with
    allow_parallel_tool_calls both calls run (two sources), without it the first alone; a reply with
    no call is text with error_on_no_tool_call=False, and no selection from get_tool_calls_from_response."""
    llm = HibanaLLM(engine=engine, max_tokens=96)
    tools = [tool(get_weather), tool(add_numbers)]
    question = "What is the weather in Paris and in Oslo?"
    both = [json.dumps(world.weather(city)) for city in ("Paris", "Oslo")]
    reply = llm.predict_and_call(tools, question, allow_parallel_tool_calls=True)
    assert [s.content for s in reply.sources] == both and not any(s.is_error for s in reply.sources)
    reply = await llm.apredict_and_call(tools, question, allow_parallel_tool_calls=True)
    assert [s.content for s in reply.sources] == both
    assert [s.content for s in (await llm.apredict_and_call(tools, question)).sources] == both[:1]
    assert [s.content for s in llm.predict_and_call(tools, question).sources] == both[:1]
    response = llm.chat_with_tools(tools, user_msg="Hi")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(response)
    assert (await llm.apredict_and_call(tools, "Hi", error_on_no_tool_call=False)).response == response.message.content


# --- agents across runs -------------------------------------------------------------------------

def scripted_router(messages, **kwargs) -> ChatMessage:
    """The router's decision (the 7M demo model cannot write a handoff): hand off to the weather agent."""
    return ChatMessage(role="assistant", blocks=[ToolCallBlock(
        tool_call_id="call_handoff", tool_name="handoff",
        tool_kwargs={"to_agent": "weather", "reason": "the user asks about the weather"})])


async def test_agents_context_written_out_and_read_back_between_runs(engine):
    """A FunctionAgent's Context written with ctx.to_dict (JsonPickleSerializer: the chat memory
    too) and read back with Context.from_dict: the next run continues the conversation on the
    agent's resident state. A ReActAgent's Context round-trips as well, and an AgentWorkflow whose
    router handed off to a HibanaLLM agent stays with that agent after the round trip."""
    from llama_index.core.agent.workflow import (AgentOutput, AgentWorkflow, FunctionAgent, ReActAgent,
                                                 ToolCallResult)
    from llama_index.core.llms.mock import MockFunctionCallingLLM
    from llama_index.core.workflow import Context, JsonPickleSerializer, JsonSerializer

    async def run(workflow, question, ctx):
        handler = workflow.run(question, ctx=ctx, max_iterations=6)
        events = [event async for event in handler.stream_events()]
        return await handler, events

    def round_trip(workflow, ctx, serializer=JsonPickleSerializer()):
        return Context.from_dict(workflow, json.loads(json.dumps(ctx.to_dict(serializer=serializer))),
                                 serializer=serializer)

    agent = FunctionAgent(tools=[tool(add_numbers)], llm=HibanaLLM(engine=engine, state_id="ctx-agent"),
                          system_prompt="You are a helpful assistant.")
    ctx = Context(agent)
    first, events = await run(agent, "What is 100 plus 23?", ctx)
    assert "123" in first.response.content
    held = [e.raw["usage"] for e in events if isinstance(e, AgentOutput)][-1]
    _, events = await run(agent, "What is 7 plus 5?", round_trip(agent, ctx))
    usage = [e.raw["usage"] for e in events if isinstance(e, AgentOutput)][0]
    assert usage["prompt_tokens"] > held["prompt_tokens"]  # the first run's conversation came back
    assert usage["cached_tokens"] >= held["prompt_tokens"]

    react = ReActAgent(tools=[tool(add_numbers)], llm=HibanaLLM(engine=engine, state_id="ctx-react", max_tokens=64))
    ctx = Context(react)
    await run(react, "What is 1 plus 2?", ctx)
    result, _ = await run(react, "What is 3 plus 2?", round_trip(react, ctx, JsonSerializer()))
    assert result.response.content

    router = FunctionAgent(name="router", description="Routes requests.", can_handoff_to=["weather"],
                           llm=MockFunctionCallingLLM(response_generator=scripted_router))
    weather = FunctionAgent(name="weather", description="Looks up the weather where people live.",
                            tools=[tool(find_home_city), tool(get_weather)], can_handoff_to=[],
                            llm=HibanaLLM(engine=engine, state_id="ctx-weather"))
    workflow = AgentWorkflow(agents=[router, weather], root_agent="router")
    ctx = Context(workflow)
    handed, _ = await run(workflow, "Transfer me to the weather agent.", ctx)
    assert handed.current_agent_name == "weather"
    result, events = await run(workflow, "What's the weather where Ana Garcia lives?", round_trip(workflow, ctx))
    assert {e.current_agent_name for e in events if isinstance(e, AgentOutput)} == {"weather"}
    assert [e.tool_name for e in events if isinstance(e, ToolCallResult)] == ["find_home_city", "get_weather"]
    city = world.home_city("Ana Garcia")["city"]
    assert city in result.response.content
