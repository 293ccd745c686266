"""ChatHibana beyond the standard suites: plugin registration, which state serves a call, forced
tool calls on the demo model, structured output methods, errors."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Annotated, Literal

import pytest


from langchain_core.exceptions import OutputParserException  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from typing_extensions import TypedDict  # noqa: E402

import hibana_core  # noqa: E402
from hibana_core import Engine, StateBusyError  # noqa: E402
from hibana_core.turn import SYNTAX, tool_call_grammar  # noqa: E402
from hibana_plugins.langchain import ChatHibana, UnsupportedContentError  # noqa: E402
from hibana_plugins.manager import HibanaPluginManager  # noqa: E402
from hibana_plugins.options import RELEASE_WAIT  # noqa: E402


@tool
def get_weather(city: Annotated[str, "Name of the city."]) -> str:
    """Get the current weather for a city."""
    return json.dumps({"temperature": 21, "condition": "sunny"})


@tool
def multiply(a: Annotated[float, "The first number."], b: Annotated[float, "The second number."]) -> str:
    """Multiply two numbers and return the product."""
    return json.dumps({"result": a * b})


class Book(BaseModel):
    """Save a book as a structured record."""

    title: str = Field(description="Title of the book.")
    author: str = Field(description="Who wrote it.")
    year: int = Field(description="Year of publication.")


BOOK = 'Save the book "The Silent River" by Maya Tanaka, published in 1987.'   # a task the demo knows
DEMO_CHECKPOINT = str(Path(hibana_core.__file__).parent / "demo" / "model")  # the demo by path: another engine


@pytest.fixture(scope="module")
def llm():
    return ChatHibana(model="demo", max_tokens=64)


# --- plugin ----------------------------------------------------------------------------------------

def test_registered_as_the_langchain_adapter(llm):
    manager = HibanaPluginManager(entry_point_group=None)
    factory = manager.adapters()["langchain"]
    assert factory is ChatHibana
    assert factory(engine=llm.engine).engine is llm.engine
    assert not [e for e in manager.load_errors if "langchain" in e.plugin]


def test_module_imports_without_langchain_core():
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("langchain_core", "langchain", "langgraph"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        import warnings
        warnings.simplefilter("error")
        from hibana_plugins.manager import HibanaPluginManager
        manager = HibanaPluginManager(entry_point_group=None)
        assert "langchain" in manager.adapters(), manager.adapters()
        assert not manager.load_errors, manager.load_errors
        from hibana_plugins.langchain import ChatHibana
        try:
            ChatHibana(model="demo")
        except ImportError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'hibana[langchain]'" in done.stdout


def test_objects_on_one_model_share_an_engine(llm):
    assert ChatHibana(model="demo").engine is llm.engine
    assert ChatHibana(engine=llm.engine).model == "demo"


# --- which state serves a call ---------------------------------------------------------------------

def test_state_id_on_the_object_by_bind_or_per_call(llm):
    assert ChatHibana(model="demo", state_id="lc-test-a").invoke("Hello").response_metadata["state_id"] == "lc-test-a"
    assert llm.bind(state_id="lc-test-b").invoke("Hello").response_metadata["state_id"] == "lc-test-b"
    assert llm.invoke("Hello", state_id="lc-test-c").response_metadata["state_id"] == "lc-test-c"


def test_a_state_serving_a_call_is_not_given_to_another(llm):
    stream = llm.bind_tools([get_weather]).stream("What's the weather in Paris?", state_id="lc-test-busy")
    next(stream)  # the call is under way and holds its state
    try:
        with pytest.raises(StateBusyError, match="lc-test-busy"):
            llm.invoke("Hello", state_id="lc-test-busy")
    finally:
        stream.close()
    assert llm.invoke("Hello", state_id="lc-test-busy").content  # free again


async def test_concurrent_calls_without_an_id_get_distinct_states(llm):
    """Four calls running at once are served on four states. (Each holds its state from its first
    chunk: with `ainvoke` a call could end before another leased, and the same question then
    continues the ended call's conversation, as a regenerated reply does: a race, not sharing.)"""
    streams = [llm.astream("Hello") for _ in range(4)]
    firsts = [await anext(stream) for stream in streams]  # all four under way at once
    replies = []
    for first, stream in zip(firsts, streams):
        reply = first
        async for chunk in stream:
            reply += chunk
        replies.append(reply)
    assert len({r.response_metadata["state_id"] for r in replies}) == 4


def test_a_conversation_goes_on_in_its_state_and_another_gets_its_own(llm):
    model = llm.bind_tools([get_weather])
    history = [HumanMessage("What's the weather in Oslo?")]
    first = model.invoke(history)
    assert first.tool_calls
    history += [first, ToolMessage(get_weather.invoke(first.tool_calls[0]["args"]),
                                   tool_call_id=first.tool_calls[0]["id"])]
    second = model.invoke(history)
    assert second.response_metadata["state_id"] == first.response_metadata["state_id"]
    usage = second.usage_metadata
    assert usage["input_token_details"]["cache_read"] >= 0.85 * usage["input_tokens"]

    other = model.invoke("What is 3 times 4?")
    assert other.response_metadata["state_id"] != first.response_metadata["state_id"]


def _one_agent_graph(llm):
    """A compiled LangGraph graph of one node, "agent", that calls `llm` on the messages."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    def agent(state: MessagesState):
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_edge(START, "agent")
    graph.add_edge("agent", END)
    return graph.compile()


def test_langgraph_thread_and_node_name_the_state(llm):
    reply = _one_agent_graph(llm).invoke({"messages": [("user", "Hello")]}, {"configurable": {"thread_id": "lc-t9"}})
    assert reply["messages"][-1].response_metadata["state_id"] == "lc-t9/agent"


def test_a_falsy_thread_id_still_names_the_state(llm):
    """LangGraph takes any thread_id, integers too: thread 0 was read as no thread (an unnamed state,
    chosen by prefix), while thread 1 named "1/agent". An empty one names none."""
    app = _one_agent_graph(llm)
    for thread, state_id in [(0, "0/agent"), (1, "1/agent")]:
        reply = app.invoke({"messages": [("user", "Hello")]}, {"configurable": {"thread_id": thread}})
        assert reply["messages"][-1].response_metadata["state_id"] == state_id
    assert llm.invoke("Hi", config={"configurable": {"thread_id": 0}}).response_metadata["state_id"] == "0"
    reply = app.invoke({"messages": [("user", "Hello")]}, {"configurable": {"thread_id": ""}})
    assert reply["messages"][-1].response_metadata["state_id"].startswith("auto-")


def test_a_thread_id_in_the_call_config_names_the_state_outside_a_graph(llm):
    """`configurable.thread_id` of a direct call (no graph sets the run config) names the state,
    for invoke, ainvoke, stream and astream alike, and the thread's next turn goes on in it."""
    import asyncio

    def config(thread: str) -> dict:
        return {"configurable": {"thread_id": thread}}

    first = llm.invoke("Hello", config=config("direct-1"))
    assert first.response_metadata["state_id"] == "direct-1"
    again = llm.invoke([HumanMessage("Hello"), first, HumanMessage("And Oslo?")], config=config("direct-1"))
    assert again.response_metadata["state_id"] == "direct-1"
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    assert asyncio.run(llm.ainvoke("Hi", config=config("direct-2"))).response_metadata["state_id"] == "direct-2"
    streamed = [c for c in llm.stream("Hi", config=config("direct-3"))]
    assert any(c.response_metadata.get("state_id") == "direct-3" for c in streamed)

    async def astream() -> list:
        return [c async for c in llm.astream("Hi", config=config("direct-4"))]
    assert any(c.response_metadata.get("state_id") == "direct-4" for c in asyncio.run(astream()))
    assert llm.invoke("Hi").response_metadata["state_id"] not in {f"direct-{i}" for i in range(1, 5)}


def test_a_streams_thread_id_stays_out_of_the_callers_context(llm):
    """A stream's `configurable.thread_id` names its state, but the caller's code between chunks,
    and everything after a stream left early, runs in the caller's own context: an async stream
    left by `break` is closed later by the event loop from another context, and its thread_id
    stayed set in the caller's task for good (the next plain call ran on that thread's state, a
    checkpointed graph without a thread_id wrote into it)."""
    from langchain_core.runnables.config import var_child_runnable_config

    def configurable():
        return (var_child_runnable_config.get() or {}).get("configurable")

    config = {"configurable": {"thread_id": "leak-1"}}
    before = configurable()
    for _ in llm.stream("Hi", config=config):
        assert configurable() == before  # the loop body sees the caller's context
        break

    async def left_early():
        async for chunk in llm.astream("Hello there", config=config):
            assert configurable() == before
            break
        await asyncio.sleep(0.2)  # the loop's finalizer closes the stream meanwhile
        inside = configurable()
        return inside, await llm.ainvoke("Good morning")

    inside, reply = asyncio.run(left_early())
    assert inside == before and configurable() == before
    assert reply.response_metadata["state_id"] != "leak-1"


# --- tool choice -------------------------------------------------------------------------------------

def test_tool_choice_auto_none_and_forced(llm):
    question = "What's the weather in Paris?"
    assert llm.bind_tools([get_weather, multiply]).invoke(question).tool_calls[0]["args"] == {"city": "Paris"}
    assert not llm.bind_tools([get_weather, multiply], tool_choice="none").invoke(question).tool_calls

    forced = llm.bind_tools([get_weather, multiply], tool_choice="multiply").invoke("Hello!")
    assert [c["name"] for c in forced.tool_calls] == ["multiply"]
    assert set(forced.tool_calls[0]["args"]) == {"a", "b"}
    assert forced.response_metadata["finish_reason"] == "tool_calls"

    some = llm.bind_tools([get_weather, multiply], tool_choice="any").invoke("Hello!")
    assert some.tool_calls and some.tool_calls[0]["name"] in ("get_weather", "multiply")

    with pytest.raises(ValueError, match="names no bound tool"):
        llm.bind_tools([get_weather], tool_choice="search")


def test_forced_call_streams_id_and_name_first_then_arguments(llm):
    model = llm.bind_tools([Book], tool_choice="Book")
    chunks = list(model.stream(BOOK))
    calls = [c for chunk in chunks for c in chunk.tool_call_chunks]
    assert calls[0]["id"] and calls[0]["name"] == "Book"
    assert all(c["id"] is None and c["name"] is None for c in calls[1:])
    full = sum(chunks[1:], chunks[0])
    assert full.tool_calls[0]["args"] == {"title": "The Silent River", "author": "Maya Tanaka", "year": 1987}
    assert full.tool_calls[0]["args"] == model.invoke(BOOK).tool_calls[0]["args"]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["input_tokens"] > 0


# --- structured output -------------------------------------------------------------------------------

class BookDict(TypedDict):
    """Save a book as a structured record."""

    title: Annotated[str, ..., "Title of the book."]
    author: Annotated[str, ..., "Who wrote it."]
    year: Annotated[int, ..., "Year of publication."]


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_structured_output_methods(llm, method):
    assert llm.with_structured_output(Book, method=method).invoke(BOOK) == Book(
        title="The Silent River", author="Maya Tanaka", year=1987)
    assert llm.with_structured_output(BookDict, method=method).invoke(BOOK)["year"] == 1987


def test_structured_output_include_raw(llm):
    out = llm.with_structured_output(Book, method="json_schema", include_raw=True).invoke(BOOK)
    assert isinstance(out["raw"], AIMessage) and json.loads(out["raw"].content)["year"] == 1987
    assert out["parsed"].author == "Maya Tanaka" and out["parsing_error"] is None
    # the answer is the content, not a call: a turn that calls no tool, as OpenAI's json_schema reply
    assert out["raw"].tool_calls == [] and out["raw"].response_metadata["finish_reason"] == "stop"
    bound = llm.with_structured_output(Book, method="json_schema").first  # the chat model, bound
    assert list(bound.stream(BOOK))[-1].response_metadata["finish_reason"] == "stop"
    # cut at max_tokens: no answer, with its reason, and never the call's markup as the content
    short = ChatHibana(model="demo", max_tokens=6)
    cut = short.with_structured_output(Book, method="json_schema", include_raw=True).invoke(BOOK)
    assert cut["raw"].content == "" and cut["raw"].response_metadata["finish_reason"] == "length"
    assert cut["parsed"] is None and cut["parsing_error"] is not None
    # cut inside the arguments: those it had begun, as streaming sends them (it was "" here alone)
    inside = ChatHibana(model="demo", max_tokens=18)
    cut = inside.with_structured_output(Book, method="json_schema", include_raw=True).invoke(BOOK)
    streamed = "".join(c.content for c in inside.with_structured_output(Book, method="json_schema").first.stream(BOOK))
    assert cut["raw"].response_metadata["finish_reason"] == "length" and cut["parsed"] is None
    assert cut["raw"].content.startswith('{"') and cut["raw"].content == streamed, (cut["raw"].content, streamed)
    # a dict schema too: LangChain's JSON parser read the cut JSON as a dict without its required keys
    for method in ("json_schema", "json_mode"):
        cut = inside.with_structured_output(BookDict, method=method, include_raw=True).invoke(BOOK)
        assert cut["parsed"] is None and "cut before its JSON ended" in str(cut["parsing_error"]), method
        with pytest.raises(OutputParserException, match="raise max_tokens"):
            inside.with_structured_output(BookDict, method=method).invoke(BOOK)


def test_json_mode_takes_a_json_schema_without_a_title(llm):
    """json_mode with a bare JSON schema (no title, which LangChain names a function by) was a
    ToolSchemaError; ChatOpenAI's json_mode takes any dict. The answer is held to the schema all
    the same. (function_calling and json_schema need the title, as ChatOpenAI's do.)"""
    from hibana_core.chat import ToolSchemaError

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    answer = llm.with_structured_output(schema, method="json_mode").invoke("Which city is the capital of France?")
    assert isinstance(answer, dict) and list(answer) == ["city"] and isinstance(answer["city"], str)
    with pytest.raises(ToolSchemaError, match="title"):
        llm.with_structured_output(schema, method="json_schema")


def test_a_call_cut_by_max_tokens_is_an_invalid_call_not_text(llm):
    """A forced call that max_tokens cut came back as its `<tool_call>` markup in the content (an
    outside tester: an agent took it as the answer). It is an invalid tool call now, as ChatOpenAI
    reports a cut one; a stream sends nothing of it (a chunk would merge into a call the model
    never finished); neither content holds its markup."""
    bound = ChatHibana(model="demo", max_tokens=12).bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke("What's the weather in Paris?")
    assert reply.response_metadata["finish_reason"] == "length" and reply.tool_calls == []
    assert "<tool_call>" not in reply.content
    (cut,) = reply.invalid_tool_calls
    assert cut["name"] and "get_weather".startswith(cut["name"]) and "length" in cut["error"]
    streamed = None
    for chunk in bound.stream("What's the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == reply.content and not streamed.tool_calls


class Author(BaseModel):
    """An author of the book."""

    name: str = Field(max_length=24)
    born: int | None = Field(default=None, ge=1000, le=2100)


class Shelf(BaseModel):
    """Save a book as a structured record."""

    title: str = Field(max_length=40)
    year: int = Field(ge=0, le=2100)
    tags: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    authors: list[Author] = Field(max_length=2)
    genre: Literal["fiction", "history", "science"]
    rating: float | None = None


SHELF = 'Save the book "The Silent River" by Maya Tanaka (born 1951), a history of rivers, published in 1987.'


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_structured_output_holds_full_schemas(method):
    """Lists, nested models, enums, optional fields: the grammar holds the answer to the whole
    schema, so it parses into the class (the values are the demo model's; bounded lengths let even
    a model that never saw lists finish within max_tokens)."""
    shelf = ChatHibana(model="demo").with_structured_output(Shelf, method=method).invoke(SHELF)
    assert isinstance(shelf, Shelf) and shelf.title == "The Silent River"


def test_structured_output_grammar_covers_lists_and_nested_models(monkeypatch):
    """A pydantic model with a list[str] field (which used to get no guidance and fail to parse):
    the request carries a grammar whose schema is the whole model."""
    from hibana_core.state import StateHandle
    from scripted import ScriptedEvents

    class Tagged(BaseModel):
        """Tag a note."""

        note: str
        tags: list[str]
        author: Author

    sent = []

    def stream(self, params, prompt=None):
        sent.append(params)
        return ScriptedEvents(['<tool_call>\n{"name": "Tagged", "arguments": {"note": "n", "tags": ["a", "b"], '
                               '"author": {"name": "Ana"}}}\n</tool_call>'])
    monkeypatch.setattr(StateHandle, "stream", stream)
    out = ChatHibana(model="demo").with_structured_output(Tagged, method="json_schema").invoke("Tag it.")
    assert out == Tagged(note="n", tags=["a", "b"], author=Author(name="Ana"))
    [tag] = sent[0].grammar["format"]["tags"]
    assert tag["begin"] == {"type": "token", "token": "<tool_call>"}  # the demo tokenizer's markup word
    head, arguments = tag["content"]["elements"]
    assert head == {"type": "const_string", "value": '\n{"name": "Tagged", "arguments": '}
    schema = arguments["json_schema"]
    assert schema["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    assert schema["properties"]["author"]["properties"]["name"]["type"] == "string"
    assert sent[0].grammar["format"]["type"] == "tags_with_separator"  # a call from the first token


def test_bind_tools_strict_holds_calls_to_the_strict_schema(llm):
    import jsonschema

    model = ChatHibana(model="demo", max_tokens=128).bind_tools([Shelf], tool_choice="Shelf", strict=True)
    [call] = model.invoke(SHELF).tool_calls
    strict = model.kwargs["tools"][0]["function"]["parameters"]
    assert strict["additionalProperties"] is False and set(strict["required"]) == set(Shelf.model_fields)
    jsonschema.validate(call["args"], strict)
    assert set(call["args"]) == set(Shelf.model_fields)
    # the same tool as an OpenAI tool dict (LangChain's conversion hands those back as they are)
    as_dict = {"type": "function", "function": {"name": "Shelf", "description": "a shelf",
                                                "parameters": Shelf.model_json_schema()}}
    bound = ChatHibana(model="demo").bind_tools([as_dict], strict=True).kwargs["tools"][0]["function"]
    assert bound["strict"] is True and bound["parameters"]["additionalProperties"] is False
    bare = {"type": "function", "function": {"name": "now", "description": "the time"}}  # OpenAI's: no parameters
    bound = ChatHibana(model="demo").bind_tools([bare], strict=True).kwargs["tools"][0]["function"]
    assert bound["strict"] is True and bound["parameters"]["properties"] == {}


def test_bind_tools_strict_refuses_a_schema_the_grammar_cannot_hold(llm):
    """strict promises arguments valid under the schema (OpenAI refuses such a schema); before,
    the grammar fell back to any JSON object without a word. A tool bound without strict still runs."""
    from hibana_core.messages import ToolSchemaError

    class Picks(BaseModel):
        numbers: list[int] = Field(json_schema_extra={"contains": {"const": 7}})

    unknown_type = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "objekt"}}}
    lookahead = {"type": "function", "function": {"name": "g", "parameters": {  # strict from bind_tools alone
        "type": "object", "properties": {"x": {"type": "string", "pattern": "^(?!b)[a-z]{1,3}$"}}, "required": ["x"]}}}
    for tool_, named in ((Picks, "'Picks' is strict.*contains at #/properties/numbers"),
                         (lookahead, "'g' is strict.*lookahead"),
                         (unknown_type, "'f' has parameters of type 'objekt'; a call's arguments are a JSON object")):
        with pytest.raises(ToolSchemaError, match=named):
            llm.bind_tools([tool_], tool_choice="required", strict=True).invoke("go", state_id="strict-refused")
    assert "strict-refused" not in [s.id for s in llm.engine.states()], "refused before a state was opened"
    relaxed = llm.bind_tools([Picks], tool_choice="required").invoke("go", max_tokens=40)
    assert [c["name"] for c in relaxed.tool_calls] in ([], ["Picks"])


# --- errors and limits -------------------------------------------------------------------------------

def test_bind_tools_given_one_tool_rather_than_a_list_says_so(llm):
    """Iterated, a @tool gave its pydantic fields and a dict its keys: "tool 0 (('name', ...)) is
    not a tool LangChain can describe", which hid the mistake."""
    from hibana_core.messages import ToolSchemaError

    as_dict = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for one in (get_weather, Book, as_dict, "get_weather"):
        with pytest.raises(ToolSchemaError, match=r"bind_tools takes a list of tools, got one \w+; pass \[tool\]"):
            llm.bind_tools(one)
    assert llm.bind_tools((get_weather, Book)).kwargs["tool_choice"] == "auto"


def test_images_are_refused_with_a_clear_error(llm):
    message = HumanMessage([{"type": "text", "text": "What is this?"},
                            {"type": "image", "base64": "aGk=", "mime_type": "image/png"}])
    with pytest.raises(UnsupportedContentError, match="text only"):
        llm.invoke([message])


def test_timeout_cancels_the_call(llm):
    with pytest.raises(TimeoutError):
        ChatHibana(model="demo", timeout=1e-9).invoke("Hello")
    assert llm.invoke("Hello").content


def test_tool_call_grammar_names_the_offered_tools():
    """"auto" opens the grammar at `<tool_call>`; a forced call holds the turn to calls of the
    named tool from the first token; parallel_tool_calls=False ends it after the first."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
        for n in ("get_weather", "magic_function")]
    auto = tool_call_grammar(tools, "auto", SYNTAX["hermes"])["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"] and not auto["stop_after_first"]
    assert [t["begin"] for t in auto["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                  '<tool_call>\n{"name": "magic_function", "arguments": ']
    assert auto["tags"][0]["content"]["json_schema"] == tools[0]["function"]["parameters"]
    named = tool_call_grammar(tools, "magic_function", SYNTAX["hermes"], parallel=False)["format"]
    assert named["type"] == "tags_with_separator" and named["at_least_one"] and named["stop_after_first"]
    assert [t["begin"] for t in named["tags"]] == ['<tool_call>\n{"name": "magic_function", "arguments": ']
    llama = tool_call_grammar(tools, "required", SYNTAX["llama3_json"])["format"]  # or after <|python_tag|>
    assert llama["type"] == "or" and llama["elements"][1]["elements"][0]["token"] == "<|python_tag|>"
    assert [t["begin"] for t in llama["elements"][0]["tags"]][0] == '{"name": "get_weather", "parameters": '


async def test_closing_an_async_stream_early_frees_its_state(llm):
    model = llm.bind_tools([get_weather])
    async with contextlib.aclosing(model.astream("What's the weather in Paris?", state_id="lc-test-early")) as stream:
        async for _ in stream:
            break
    # LangChain's astream leaves our generator to the event loop's finalizer: a loop turn or two,
    # then the lease let go in a worker thread (a deadline, not 100 turns of 10 ms: a loaded
    # machine may take longer). The state's lease, not its engine request, is what a call waits
    # for: the request may have ended before the lease is let go
    from hibana_core import StateBusyError

    deadline = time.monotonic() + 30
    while True:
        try:
            reply = await llm.ainvoke("Hello", state_id="lc-test-early")
            break
        except StateBusyError:
            assert time.monotonic() < deadline, "the closed stream still holds its state"
            await asyncio.sleep(0.02)
    assert reply.content


# --- truthful tool-call streams (issue 11, defects 1 and 2) -----------------------------------------

def test_streamed_tool_calls_equal_invokes_when_the_turn_is_cut():
    """Defect 1: cut by max_tokens anywhere in (or after) the call, the aggregated stream holds
    exactly invoke's calls: never a call the model did not finish (greedy, so both runs agree)."""
    question = "What's the weather in Paris?"
    for max_tokens in range(6, 26, 2):
        model = ChatHibana(model="demo", max_tokens=max_tokens).bind_tools([get_weather])
        whole = model.invoke(question)
        chunks = list(model.stream(question))
        streamed = sum(chunks[1:], chunks[0])
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
            (c["name"], c["args"]) for c in whole.tool_calls], max_tokens
        assert streamed.content == whole.content, max_tokens
        assert not streamed.invalid_tool_calls, max_tokens


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


def test_tool_choice_none_and_parallel_tool_calls_false_are_enforced(llm, scripted):
    """Defect 2: tool_choice="none" never returns a call, parallel_tool_calls=False at most one,
    invoked or streamed, sync or async."""
    scripted("Checking. " + CALL % "Paris" + "\n" + CALL % "Oslo")
    question = "What's the weather in Paris and Oslo?"

    def calls(model):
        streamed = list(model.stream(question))
        astreamed = asyncio.run(_collect(model.astream(question)))
        return [[(c["name"], c["args"]) for c in m.tool_calls]
                for m in (model.invoke(question), asyncio.run(model.ainvoke(question)),
                          sum(streamed[1:], streamed[0]), sum(astreamed[1:], astreamed[0]))]

    assert calls(llm.bind_tools([get_weather])) == [[("get_weather", {"city": "Paris"}),
                                                     ("get_weather", {"city": "Oslo"})]] * 4
    assert calls(llm.bind_tools([get_weather], parallel_tool_calls=False)) == [
        [("get_weather", {"city": "Paris"})]] * 4
    assert calls(llm.bind_tools([get_weather], tool_choice="none")) == [[]] * 4
    assert "<tool_call>" in llm.bind_tools([get_weather], tool_choice="none").invoke(question).content


async def _collect(aiterator):
    return [item async for item in aiterator]


def test_invoked_text_is_the_streamed_text(llm, scripted):
    """A reply without tools comes whole as it streams: invoke does not strip what stream sends
    (a stop string ending after a space, a reply ending in a newline)."""
    scripted("  Hi! What \n")
    streamed = list(llm.stream("Hello"))
    astreamed = asyncio.run(_collect(llm.astream("Hello")))
    assert {llm.invoke("Hello").content, asyncio.run(llm.ainvoke("Hello")).content,
            sum(streamed[1:], streamed[0]).content, sum(astreamed[1:], astreamed[0]).content} == {"  Hi! What \n"}


class Tree(BaseModel):
    """A tree of small numbers."""
    v: int = Field(ge=0, le=9)
    kids: list["Tree"] = Field(default_factory=list, max_length=2)


def test_structured_output_of_a_model_that_holds_itself_is_held_to_its_own_schema(llm):
    """LangChain's conversion writes {} where a pydantic model recurs (any value: the grammar let
    "kids": [53539, "x"] through); the model's own schema is kept instead, every answer parses."""
    import jsonschema

    bound = llm.with_structured_output(Tree).first.kwargs["tools"][0]["function"]["parameters"]
    assert bound == Tree.model_json_schema()  # not LangChain's, whose "kids" take any items
    for method in ("function_calling", "json_schema"):
        for seed in range(3):
            out = llm.bind(seed=seed, temperature=1.0).with_structured_output(Tree, method=method, include_raw=True)
            got = out.invoke("a tree", max_tokens=120)
            if got["raw"].response_metadata.get("finish_reason") == "length":
                continue  # cut by max_tokens: not a grammar's promise
            assert got["parsing_error"] is None and isinstance(got["parsed"], Tree), got
            jsonschema.validate(got["parsed"].model_dump(), Tree.model_json_schema())


def test_structured_output_leaves_what_the_grammar_cannot_hold_to_the_model_unless_strict(llm):
    """As ChatOpenAI's `strict` (unset: false) and HibanaLLM's structured output: a keyword the
    grammar drops (max_length beside a pattern; pydantic's HttpUrl) is left to the model and the
    answer is checked as it is parsed, so a breaking answer is a parse error naming the field
    (with_structured_output refused such classes outright, whatever the answer); strict=True
    refuses the schema by name, before any token."""
    from hibana_core.messages import ToolSchemaError

    class Code(BaseModel):
        code: str = Field(pattern="^[a-z]+$", max_length=3)

    for method in ("function_calling", "json_schema", "json_mode"):
        with pytest.raises(ToolSchemaError, match="maxLength beside pattern"):
            llm.with_structured_output(Code, method=method, strict=True)
        got = llm.with_structured_output(Code, method=method, include_raw=True).invoke(
            "Give me a short code for the Python site", max_tokens=40)
        # the demo writes a longer code than max_length allows: the grammar held the pattern only
        assert got["parsed"] is None and "at most 3 characters" in str(got["parsing_error"]), (method, got)
        raw = got["raw"]
        code = raw.tool_calls[0]["args"]["code"] if method == "function_calling" else json.loads(raw.content)["code"]
        assert re.fullmatch(r"[a-z]+", code), raw


def test_tool_choice_none_keeps_the_tools_listed_and_calls_none(llm):
    """As OpenAI does and the README says: the prompt is the one "auto" renders (the tools listed),
    and the grammar keeps the model from calling them."""

    class Find(BaseModel):
        """Find a thing."""
        q: str

    auto = llm.bind_tools([Find], tool_choice="auto").invoke("hello", max_tokens=4)
    none = llm.bind_tools([Find], tool_choice="none").invoke("hello", max_tokens=24)
    assert none.usage_metadata["input_tokens"] == auto.usage_metadata["input_tokens"]
    assert none.tool_calls == [] and "<tool_call>" not in none.content


# --- copies, LangChain's cache, streams left early (an outside trial of the adapters) -----------------

def test_the_cache_keeps_apart_objects_whose_options_differ():
    """LangChain's cache keyed on six options: with `cache=InMemoryCache()`, ChatHibana(stop=[...])
    (or logprobs, min_p, a repetition penalty, other engine options, ...) got another object's reply."""
    from langchain_core.caches import InMemoryCache

    base = {"model": "demo", "max_tokens": 12}
    variants = [{}, {"stop": ["What"]}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 2}, {"min_p": 0.5},
                {"repetition_penalty": 3.0}, {"presence_penalty": 1.0}, {"frequency_penalty": 1.0},
                {"speculation": "off"}, {"engine_kwargs": {"max_model_len": 64}}, {"reasoning": False},
                {"reasoning_history": "generated"}, {"guided_tool_arguments": False}, {"state_id": "lc-cache"}]
    keys = [ChatHibana(**base, **options)._get_llm_string() for options in variants]
    assert len(set(keys)) == len(keys)
    # the object's stop strings and a call's are one key: the call's apply where it gives them
    assert ChatHibana(**base, stop=["x"])._get_llm_string() == ChatHibana(**base)._get_llm_string(stop=["x"])
    cache = InMemoryCache()
    assert "What" in ChatHibana(**base, cache=cache).invoke("hello").content
    assert "What" not in ChatHibana(**base, cache=cache, stop=["What"]).invoke("hello").content


def test_a_copy_for_another_model_or_engine_options_runs_on_their_engine(llm):
    """`model_copy(update=...)` copied the engine the original had loaded: a copy for another model
    (or with other engine options) ran on the original's engine, reporting the other model. A given
    engine serves only the model and engine_kwargs it was given with."""
    llm.invoke("Hello", max_tokens=2)  # the engine is loaded
    by_path = llm.model_copy(update={"model": DEMO_CHECKPOINT})
    assert by_path.engine is Engine.shared(DEMO_CHECKPOINT) and by_path.engine is not llm.engine
    shorter = llm.model_copy(update={"engine_kwargs": {"max_model_len": 128}})
    assert shorter.engine.max_model_len == 128 and llm.engine.max_model_len == 2048
    given = ChatHibana(engine=shorter.engine)
    assert given.model_copy(update={"max_tokens": 3}).engine is shorter.engine
    assert given.model_copy(update={"model": DEMO_CHECKPOINT}).engine is by_path.engine
    assert given.model_copy(update={"engine_kwargs": {"max_model_len": 128}}).engine is shorter.engine


def test_configured_objects_keep_the_engine_passed(llm):
    """LangChain rebuilds a configured object from its fields, and `engine=` was none of them: the
    configured calls ran on Engine.shared(model), not on the engine passed. The engine is no part of
    what LangChain serialises."""
    from langchain_core.load import dumpd
    from langchain_core.runnables import ConfigurableField

    engine = ChatHibana(model="demo", engine_kwargs={"max_model_len": 128}).engine  # not llm's
    given = ChatHibana(engine=engine, max_tokens=8, state_id="lc-configured")
    configured = given.configurable_fields(max_tokens=ConfigurableField(id="mt"))
    reply = configured.invoke("Hello", config={"configurable": {"mt": 3}})
    assert reply.usage_metadata["output_tokens"] <= 3
    assert "lc-configured" in {s.id for s in engine.states()}
    assert "lc-configured" not in {s.id for s in llm.engine.states()}
    assert "given_engine" not in given.model_dump() and "given_engine" not in json.dumps(dumpd(given))


def test_deep_copies_and_pickles_after_the_first_call(llm):
    """Once the engine had loaded, copy.deepcopy and pickle.dumps failed: "cannot pickle
    '_thread.lock'". A deep copy shares the engine; a pickle carries none, not even a given one."""
    llm.invoke("Hello", max_tokens=2)
    twin = copy.deepcopy(llm)
    assert twin.engine is llm.engine and twin.max_tokens == llm.max_tokens
    back = pickle.loads(pickle.dumps(llm))
    assert back.engine is llm.engine and back.invoke("Hello", max_tokens=2).content
    shorter = ChatHibana(model="demo", engine_kwargs={"max_model_len": 128}).engine
    given = ChatHibana(engine=shorter, max_tokens=2)
    given.invoke("Hello")
    assert copy.deepcopy(given).engine is shorter
    assert pickle.loads(pickle.dumps(given)).engine is llm.engine  # Engine.shared("demo")


async def test_a_stream_left_early_lets_its_callers_next_call_have_the_state(llm):
    """Breaking out of astream left the state leased until the event loop's finalizer closed the
    streams: the next call on it raised StateBusyError (2 trials in 3), or, named by a thread_id,
    went to another state without a word. Through a binding (LangChain's own stream around ours,
    closed by the finalizer a loop turn later) only the call's wait for the release helps."""
    for trial in range(3):
        state = f"lc-left-{trial}"
        async for _ in llm.astream("Tell me a long story about Paris", state_id=state, max_tokens=30):
            break
        assert (await llm.ainvoke("Hello", state_id=state)).response_metadata["state_id"] == state
        bound = llm.bind(state_id=f"lc-left-bound-{trial}", max_tokens=30)
        async for _ in bound.astream("Tell me a long story about Paris"):
            break
        assert (await bound.ainvoke("Hello")).response_metadata["state_id"] == f"lc-left-bound-{trial}"
        thread = llm.with_config({"configurable": {"thread_id": f"lc-left-thread-{trial}"}})
        async for _ in thread.astream("Tell me a long story", max_tokens=30):
            break
        assert (await thread.ainvoke("Hello")).response_metadata["state_id"] == f"lc-left-thread-{trial}"


async def test_a_closed_stream_frees_its_state_at_once_and_a_read_one_is_not_waited_for(llm):
    """Closing astream closes the engine's stream before it returns (LangChain's astream never
    closes `_astream`, which the event loop's finalizer closed later): the state is free at once.
    A stream still open is not waited for: a call from another task, or from its own, finds its
    state busy (at once, or once the stream had a moment to be closed)."""
    for _trial in range(3):
        async with contextlib.aclosing(llm.astream("Tell me a long story about Paris", state_id="lc-closed",
                                                   max_tokens=30)) as stream:
            async for _ in stream:
                break
        with llm.engine.lease(state_id="lc-closed"):  # StateBusyError while the stream holds it
            pass

    async with contextlib.aclosing(llm.astream("Tell me a long story about Paris", state_id="lc-read",
                                               max_tokens=30)) as stream:
        await anext(stream)
        for call in (asyncio.create_task(llm.ainvoke("Hello", state_id="lc-read")),
                     llm.ainvoke("Hello", state_id="lc-read")):
            start = time.monotonic()
            with pytest.raises(StateBusyError, match="lc-read"):
                await call
            assert time.monotonic() - start < RELEASE_WAIT / 2


def test_a_call_cut_by_a_stop_sequence_says_so(llm):
    """The invalid call's error said "raise max_tokens" for a call that a stop string ended."""
    reply = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?", stop=["Paris"], max_tokens=40)
    (cut,) = reply.invalid_tool_calls
    assert "stop sequence" in cut["error"] and "'Paris'" in cut["error"] and "max_tokens" not in cut["error"]
    # one of OpenAI's finish reasons, as the server's (it was the chat layer's "malformed_tool_call")
    assert reply.response_metadata["finish_reason"] == "stop" and "malformed" not in cut["error"]


def test_one_stop_string_on_the_object_is_taken_as_in_a_call(llm):
    """`invoke(..., stop="help")` was taken and `ChatHibana(stop="help")` (ChatOpenAI takes it)
    was a ConfigError quoting pydantic's "Input should be a valid list"."""
    on_object = ChatHibana(model="demo", max_tokens=64, stop="help")
    assert on_object.stop == ["help"]
    assert on_object.invoke("Hello!").content == llm.invoke("Hello!", stop="help").content == "Hello! How can I "


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_structured_output_takes_openai_response_formats_as_chat_openai_does(llm, method):
    """{"name", "schema"} was read as a function without parameters: the grammar held the answer
    to any object and the demo answered {}; the full {"type": "json_schema", ...} was refused."""
    book = Book.model_json_schema()
    for schema in ({"name": "Book", "schema": book, "strict": True},
                   {"type": "json_schema", "json_schema": {"name": "Book", "description": Book.__doc__,
                                                           "schema": book}}):
        assert llm.with_structured_output(schema, method=method).invoke(BOOK) == {
            "title": "The Silent River", "author": "Maya Tanaka", "year": 1987}


def test_a_call_cut_before_its_name_is_not_resent_as_a_call():
    """An AIMessage whose call max_tokens cut before its name (an invalid call named None) went back
    into the history as a call named "" the model never wrote (Mistral's template then refused the
    conversation); a named invalid call is still resent as the model wrote it."""
    from langchain_core.messages.tool import invalid_tool_call

    from hibana_plugins.langchain import _to_chat_messages

    cut = AIMessage(content="", invalid_tool_calls=[invalid_tool_call(name=None, args="", id=None, error="cut")])
    named = AIMessage(content="", invalid_tool_calls=[invalid_tool_call(name="add", args='{"a": 4', id="c1",
                                                                          error="cut")])
    (resent_cut, resent_named) = _to_chat_messages([cut, named])
    assert "tool_calls" not in resent_cut
    assert resent_named["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 4'}


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_a_structured_answer_cut_by_a_stop_or_max_tokens_is_a_parsing_error(method):
    """A structured answer a stop sequence cut came back parsed as a partial dict ({"title": ...,
    "author": "Maya"}: LangChain's JSON parser reads partial JSON), and function_calling's, cut by a
    stop or by max_tokens, as None with no parsing_error: each is a parsing error that says why."""
    for llm, why in ((ChatHibana(model="demo", max_tokens=64, stop=["Tanaka"]), "stop"),
                     (ChatHibana(model="demo", max_tokens=18), "max_tokens")):
        out = llm.with_structured_output(BookDict, method=method, include_raw=True).invoke(BOOK)
        assert out["parsed"] is None and why in str(out["parsing_error"]), (method, why, out)
        with pytest.raises(OutputParserException, match=why):
            llm.with_structured_output(Book, method=method).invoke(BOOK)
    whole = ChatHibana(model="demo", max_tokens=64, stop=["Paris"]).with_structured_output(BookDict, method=method)
    assert whole.invoke(BOOK) == {"title": "The Silent River", "author": "Maya Tanaka", "year": 1987}


def test_bind_tools_holds_a_model_that_holds_itself_to_its_own_schema(llm):
    """with_structured_output kept a self-referring model's own schema, bind_tools did not (nor for
    a @tool taking one): its "kids" took any items (LangChain's conversion writes {} where the model recurs), so a forced
    call's arguments could fail PydanticToolsParser. Both bind the model's own schema now."""
    import jsonschema

    for strict in (None, True):
        bound = llm.bind_tools([Tree], tool_choice="Tree", strict=strict)
        assert bound.kwargs["tools"][0]["function"]["parameters"] == Tree.model_json_schema()

    @tool
    def plant(tree: Tree, name: str) -> str:
        """Plant a tree."""
        return name

    parameters = llm.bind_tools([plant]).kwargs["tools"][0]["function"]["parameters"]  # a @tool's arguments too
    assert parameters == plant.tool_call_schema.model_json_schema() and parameters["properties"]["tree"]["$ref"]
    for seed in range(2):
        reply = llm.bind_tools([Tree], tool_choice="Tree").invoke("a tree", seed=seed, temperature=1.0, max_tokens=120)
        for call in reply.tool_calls:
            jsonschema.validate(call["args"], Tree.model_json_schema())


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_structured_output_reads_output_version_v1_content_blocks(method):
    """With output_version="v1" (LangChain 1.x's content blocks) the answer's content is a list of
    blocks: the check that its JSON is whole read the list, not its text, and refused every answer
    as ended by a stop sequence. The generation's text is read, as LangChain's parsers read it."""
    v1 = ChatHibana(model="demo", max_tokens=64, output_version="v1")
    assert v1.with_structured_output(Book, method=method).invoke(BOOK) == Book(
        title="The Silent River", author="Maya Tanaka", year=1987)
    out = v1.with_structured_output(BookDict, method=method, include_raw=True).invoke(BOOK)
    assert isinstance(out["raw"].content, list) and out["parsing_error"] is None and out["parsed"]["year"] == 1987
    cut = ChatHibana(model="demo", max_tokens=18, output_version="v1")
    out = cut.with_structured_output(BookDict, method=method, include_raw=True).invoke(BOOK)
    assert out["parsed"] is None and "raise max_tokens" in str(out["parsing_error"])
    assert out["parsing_error"].llm_output.startswith('{"')


def test_a_tools_json_block_is_read_as_its_json_text(llm):
    """A tool run on a tool call (as LangGraph's ToolNode runs it) passes its [{"type": "json",
    "json": ...}] result on as the ToolMessage's content (a standard tool-result block): ChatHibana
    refused it with a ConversationError and the agent ended. It reads as the JSON text the tool
    could have returned."""
    from hibana_core.chat import ConversationError
    from hibana_plugins.langchain import _to_chat_messages

    @tool
    def weather_json(city: str) -> list:
        """Get the current weather for a city, as JSON."""
        return [{"type": "json", "json": {"temperature": 21, "condition": "sunny", "city": city}}]

    call = AIMessage("", tool_calls=[{"name": "weather_json", "args": {"city": "Paris"}, "id": "c1"}])
    result = weather_json.invoke(call.tool_calls[0])
    assert result.content == [{"type": "json", "json": {"temperature": 21, "condition": "sunny", "city": "Paris"}}]
    history = [HumanMessage("What's the weather in Paris?"), call, result]
    assert _to_chat_messages(history)[-1]["content"] == '{"temperature": 21, "condition": "sunny", "city": "Paris"}'
    reply = llm.bind_tools([weather_json]).invoke(history, max_tokens=4)
    assert reply.usage_metadata["input_tokens"] > 0
    with pytest.raises(ConversationError, match="json block"):
        _to_chat_messages([ToolMessage([{"type": "json", "json": {1, 2}}], tool_call_id="c1")])


def test_a_tools_search_result_and_custom_output_blocks_are_read_as_text():
    """The other standard tool-result blocks ToolNode passes on (langchain_core's
    TOOL_MESSAGE_BLOCK_TYPES): a search result reads as its title, source and text, an OpenAI
    custom tool's output as its text. They were a ConversationError, and as the ToolMessage stays
    in a LangGraph thread's history, every later call on that thread failed."""
    from hibana_core.chat import ConversationError
    from hibana_plugins.langchain import _to_chat_messages

    found = {"type": "search_result", "source": "https://example.org/paris", "title": "Paris weather",
             "content": [{"type": "text", "text": "Sunny, 21 C."}, {"type": "text", "text": " Light wind."}],
             "citations": {"enabled": True}}
    output = {"type": "custom_tool_call_output", "output": "patched 3 files"}
    read = _to_chat_messages([ToolMessage([found], tool_call_id="c1"), ToolMessage([output], tool_call_id="c2"),
                              ToolMessage([{"type": "custom_tool_call_output", "output": {"ok": 1}}], tool_call_id="c3")])
    assert [m["content"] for m in read] == ["Paris weather\nhttps://example.org/paris\nSunny, 21 C. Light wind.",
                                            "patched 3 files", '{"ok": 1}']
    with pytest.raises(ConversationError, match="search_result block"):
        _to_chat_messages([ToolMessage([{**found, "content": [{"type": "image", "url": "x"}]}], tool_call_id="c1")])
