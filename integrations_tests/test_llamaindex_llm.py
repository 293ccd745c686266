"""HibanaLLM as a LlamaIndex LLM on the demo model: registration, the eight entry points, tool
calling (forced calls included), structured output, usage, and which state serves a call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import datetime
import enum
import logging
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Annotated, List, Literal, Optional

import pytest


from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict, Field, field_validator
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import HttpUrl

import hibana_core
from hibana_core import Engine
from hibana_core.chat import clean_schema
from hibana_core.errors import ConfigError
from hibana_plugins.llamaindex import HibanaLLM, openai_messages
from hibana_plugins.manager import HibanaPluginManager

REPO = Path(__file__).resolve().parents[1]
DEMO_CHECKPOINT = str(Path(hibana_core.__file__).parent / "demo" / "model")  # the demo by path: another engine


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        yield engine


def get_weather(city: str) -> str:
    """Get the current weather for a city."""


def add_numbers(a: float, b: float) -> str:
    """Add two numbers and return the sum."""


TOOLS = [FunctionTool.from_defaults(fn, description=fn.__doc__) for fn in (get_weather, add_numbers)]


class Book(BaseModel):
    """A book, as a structured record."""

    title: str = Field(description="Title of the book.")
    author: str = Field(description="Who wrote it.")
    year: int = Field(description="Year of publication.")


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


def calls(llm: HibanaLLM, response) -> list[tuple[str, dict]]:
    return [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(response, False)]


# --- plugin and metadata ----------------------------------------------------------------------------

def test_registered_as_the_llamaindex_adapter(engine):
    factory = HibanaPluginManager(entry_point_group=None).lookup("adapter", "llamaindex")
    llm = factory(engine=engine, max_tokens=64)
    assert isinstance(llm, HibanaLLM) and llm.engine is engine
    meta = llm.metadata
    assert meta.context_window == engine.hf_config.max_position_embeddings == 2048
    assert (meta.num_output, meta.is_chat_model, meta.is_function_calling_model) == (64, True, True)
    assert meta.model_name == str(engine.config.model)


def test_shared_engine_by_default():
    llm = HibanaLLM(model="demo", engine_kwargs={"device": "cpu", "progress": False})
    assert llm.engine is Engine.shared("demo", device="cpu", progress=False)
    assert HibanaLLM(engine_kwargs={"device": "cpu", "progress": False}).engine is llm.engine


def test_module_imports_without_llama_index():
    """The plugin manager imports the module on every start: without llama-index it must import
    cleanly, and HibanaLLM must say what to install."""
    script = """
import sys, warnings
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "llama_index" or name.startswith("llama_index."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
warnings.simplefilter("error")
from hibana_core.errors import HibanaError
from hibana_plugins.manager import HibanaPluginManager
manager = HibanaPluginManager(entry_point_group=None)
assert manager.load_errors == [], manager.load_errors
factory = manager.lookup("adapter", "llamaindex")
try:
    factory(engine=None)
except HibanaError as exc:
    assert "pip install" in str(exc), exc
else:
    raise AssertionError("HibanaLLM() without llama-index should raise")
assert "torch" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# --- the entry points -------------------------------------------------------------------------------

async def test_entry_points_agree_and_report_usage(engine):
    llm = HibanaLLM(engine=engine, state_id="entry-points")
    messages = user("Hi!")
    replies = [llm.chat(messages), await llm.achat(messages)]
    streamed = list(llm.stream_chat(messages))
    astreamed = [chunk async for chunk in await llm.astream_chat(messages)]
    for chunks in (streamed, astreamed):
        assert "".join(c.delta for c in chunks) == chunks[-1].message.content
        replies.append(chunks[-1])
    assert len({r.message.content for r in replies}) == 1
    assert replies[0].message.content.startswith("Hello")

    completions = [llm.complete("Hi!"), await llm.acomplete("Hi!"), list(llm.stream_complete("Hi!"))[-1],
                   [c async for c in await llm.astream_complete("Hi!")][-1]]
    assert {c.text for c in completions} == {replies[0].message.content}

    again = llm.chat(messages)  # the same prompt again: everything but the last token is resident
    usage = again.raw["usage"]
    assert again.additional_kwargs == usage
    assert usage["prompt_tokens"] == 10 and usage["cached_tokens"] == 9
    assert usage["completion_tokens"] > 0 and usage["total_tokens"] == 10 + usage["completion_tokens"]
    assert again.raw["finish_reason"] == "stop" and again.raw["state_id"] == "entry-points"


def test_formatted_prompt_is_continued_as_it_is(engine):
    llm = HibanaLLM(engine=engine, state_id="raw")
    text = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert llm.complete(text, formatted=True).text == llm.chat(user("Hi!")).message.content


async def test_async_calls_run_on_the_callers_loop(engine):
    """No thread executor: the loop's default executor refuses work, and the loop stays free while
    the engine generates (a ticker advances between chunks)."""

    class NoThreads(concurrent.futures.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise AssertionError("HibanaLLM handed work to a thread executor")

    asyncio.get_running_loop().set_default_executor(NoThreads())
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    llm = HibanaLLM(engine=engine, state_id="async")
    seen = []
    before = ticks
    async for chunk in await llm.astream_chat(user("Who are you?")):
        seen.append(ticks)
    response = await llm.achat_with_tools(TOOLS, user_msg="What's the weather in Paris?")
    after = ticks
    task.cancel()
    # the ticker ran while each call waited for the engine (its first chunk, the tool call's
    # reply). How many chunks the reply came in, and whether the loop turned between them, is the
    # machine's speed: where the engine ran ahead of a loaded loop, the tokens come in one chunk
    assert seen and before < seen[0] and seen[-1] < after, (before, seen, after)
    assert calls(llm, response) == [("get_weather", {"city": "Paris"})]


# --- tool calling -----------------------------------------------------------------------------------

def test_tool_calls_as_blocks_and_openai_kwargs(engine):
    llm = HibanaLLM(engine=engine, state_id="tools")
    response = llm.chat_with_tools(TOOLS, user_msg="What's the weather in Paris?")
    blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert [(b.tool_name, b.tool_kwargs) for b in blocks] == [("get_weather", {"city": "Paris"})]
    [openai] = response.message.additional_kwargs["tool_calls"]
    assert openai["id"] == blocks[0].tool_call_id and openai["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert response.raw["finish_reason"] == "tool_calls"

    plain = llm.chat_with_tools(TOOLS, user_msg="Hi!")
    assert calls(llm, plain) == [] and plain.message.content.startswith("Hello")
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(plain)
    # one tool, not a list (ChatHibana's bind_tools says the same): was a bare TypeError "not iterable"
    with pytest.raises(hibana_core.ToolSchemaError, match=r"pass \[tool\]"):
        llm.chat_with_tools(TOOLS[0], user_msg="Hi!")
    assert calls(llm, llm.chat_with_tools(iter(TOOLS), user_msg="What's the weather in Paris?")) == [
        ("get_weather", {"city": "Paris"})]  # any iterable of tools


def test_every_streamed_chunk_carries_the_calls_so_far(engine):
    llm = HibanaLLM(engine=engine, state_id="parallel")
    chunks = list(llm.stream_chat_with_tools(TOOLS, user_msg="What's the weather in Paris and in Oslo?",
                                             allow_parallel_tool_calls=True))
    counts = [len(calls(llm, c)) for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 2    # never drops a call once it appeared
    assert calls(llm, chunks[-1]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    ids = [[b.tool_call_id for b in c.message.blocks if isinstance(b, ToolCallBlock)] for c in chunks]
    assert all(i == ids[-1][:len(i)] for i in ids)          # one id per call, from its first chunk on

    single = llm.chat_with_tools(TOOLS, user_msg="What's the weather in Paris and in Oslo?")
    assert calls(llm, single) == [("get_weather", {"city": "Paris"})]  # allow_parallel_tool_calls=False
    unset = llm.chat_with_tools(TOOLS, user_msg="What's the weather in Paris and in Oslo?",
                                allow_parallel_tool_calls=None)  # falsy, as LlamaIndex reads it: one call
    assert calls(llm, unset) == [("get_weather", {"city": "Paris"})]
    both = llm.chat([ChatMessage(role="user", content="What's the weather in Paris and in Oslo?")],
                    tools=llm._prepare_chat_with_tools(TOOLS)["tools"], parallel_tool_calls=None)
    assert len(calls(llm, both)) == 2  # None, as OpenAI reads it: the default, calls in parallel


def test_tool_required_forces_a_call(engine):
    """"Hi!" gets a greeting; with tool_required the turn opens with the tool-call syntax, so even a
    7M model calls a tool; tool_choice names the tool."""
    llm = HibanaLLM(engine=engine, state_id="forced")
    assert calls(llm, llm.chat_with_tools(TOOLS, user_msg="Hi!")) == []
    forced = calls(llm, llm.chat_with_tools(TOOLS, user_msg="Hi!", tool_required=True))
    assert len(forced) == 1 and forced[0][0] in ("get_weather", "add_numbers")
    named = calls(llm, llm.chat_with_tools(TOOLS, user_msg="Hi!", tool_choice="add_numbers"))
    assert [name for name, _ in named] == ["add_numbers"]
    assert calls(llm, llm.chat_with_tools(TOOLS, user_msg="What's the weather in Paris?", tool_choice="none")) == []
    streamed = list(llm.stream_chat_with_tools(TOOLS, user_msg="Hi!", tool_required=True))
    assert len(calls(llm, streamed[-1])) == 1


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_never_opens_a_call(engine):
    """As OpenAI's "none" and ChatHibana's: the prompt is the one with the tools (the turn's
    prompt tokens equal "auto"'s), and the grammar keeps the model from writing a call, which it
    otherwise opens on this question (a new user's trial: "none" dropped the tools, and the reply
    held `<tool_call>` markup)."""
    llm = HibanaLLM(engine=engine, max_tokens=48)
    question = "What is 2 plus 3?"
    auto = llm.chat_with_tools(TOOLS, user_msg=question)
    none = llm.chat_with_tools(TOOLS, user_msg=question, tool_choice="none")
    assert calls(llm, auto), "the demo model calls a tool here; the check below needs it"
    assert none.additional_kwargs["prompt_tokens"] == auto.additional_kwargs["prompt_tokens"]
    assert calls(llm, none) == [] and "<tool_call>" not in none.message.content, none.message.content


def test_forced_call_has_the_schemas_keys(engine):
    """A forced call on a flat schema is written around the model's values: whatever the model
    makes of the question, the call parses and has every required key (guided_tool_arguments)."""
    llm = HibanaLLM(engine=engine, state_id="guided")
    for choice in ("add_numbers", "get_weather"):
        [(name, arguments)] = calls(llm, llm.chat_with_tools(TOOLS, user_msg="Hi!", tool_choice=choice))
        assert name == choice and set(arguments) == {"add_numbers": {"a", "b"}, "get_weather": {"city"}}[choice]
    unguided = HibanaLLM(engine=engine, state_id="unguided", guided_tool_arguments=False)
    response = unguided.chat_with_tools(TOOLS, user_msg="Hi!", tool_choice="add_numbers")
    assert response.message.content.startswith('<tool_call>\n{"name": "add_numbers"') or \
        [name for name, _ in calls(unguided, response)] == ["add_numbers"]


async def test_structured_output_through_tool_calling(engine):
    llm = HibanaLLM(engine=engine, state_id="structured")
    prompt = PromptTemplate("{text}")
    text = 'Save the book "The Silent River" by Ana Garcia, published in 1843.'
    book = llm.structured_predict(Book, prompt, text=text)
    assert book == Book(title="The Silent River", author="Ana Garcia", year=1843)
    book = await llm.astructured_predict(Book, prompt, text="Record this book: The Last Harbor by Hiro Tanaka (1999).")
    assert book == Book(title="The Last Harbor", author="Hiro Tanaka", year=1999)
    response = llm.as_structured_llm(Book).chat(user('Save the book "The Blue Clock" by Maya Kim, published in 1970.'))
    assert response.raw == Book(title="The Blue Clock", author="Maya Kim", year=1970)


async def test_a_structured_answer_cut_by_max_tokens_raises_streamed_too(engine):
    """A cut structured answer raises ValueError ("raise max_tokens") from every structured entry
    point: the streamed ones yielded an object of empty fields (LlamaIndex's streaming program turns
    a reply without a call into partial_output_cls()) where structured_predict raised."""
    llm = HibanaLLM(engine=engine, state_id="structured-cut", max_tokens=12)
    prompt = PromptTemplate("{text}")
    text = 'Save the book "The Silent River" by Ana Garcia, published in 1843.'
    with pytest.raises(ValueError, match="raise max_tokens"):
        llm.structured_predict(Book, prompt, text=text)
    with pytest.raises(ValueError, match="raise max_tokens"):
        list(llm.stream_structured_predict(Book, prompt, text=text))
    with pytest.raises(ValueError, match="raise max_tokens"):
        [x async for x in await llm.astream_structured_predict(Book, prompt, text=text)]
    with pytest.raises(ValueError, match="raise max_tokens"):
        list(llm.as_structured_llm(Book).stream_chat(user(text)))
    whole = HibanaLLM(engine=engine, state_id="structured-cut")
    assert list(whole.stream_structured_predict(Book, prompt, text=text))[-1] == Book(
        title="The Silent River", author="Ana Garcia", year=1843)
    # the streamed forms call the answer's tool whatever the model would rather do (LlamaIndex asks
    # for it as "auto": on a greeting the model answered in text, and the stream ended on empty fields)
    for streamed in (list(whole.stream_structured_predict(Book, prompt, text="Hello there!")),
                     [r.raw for r in whole.as_structured_llm(Book).stream_chat(user("Good morning!"))]):
        Book.model_validate(streamed[-1].model_dump())


class Author(BaseModel):
    """An author of the book."""

    name: str = Field(max_length=24)
    born: Optional[int] = Field(default=None, ge=1000, le=2100)


class Shelf(BaseModel):
    """A book, as a structured record."""

    title: str = Field(max_length=40)
    year: int = Field(ge=0, le=2100)
    tags: List[Annotated[str, Field(max_length=12)]] = Field(max_length=3)
    authors: List[Author] = Field(max_length=2)
    genre: Literal["fiction", "history", "science"]
    rating: Optional[float] = None


async def test_structured_output_holds_full_schemas(engine):
    """structured_predict and as_structured_llm call the class as a tool, held by the grammar to
    its whole schema: lists, nested models, enums, optional fields."""
    llm = HibanaLLM(engine=engine, state_id="structured-full")
    text = 'Save the book "The Silent River" by Maya Tanaka (born 1951), a history of rivers, published in 1987.'
    shelf = llm.structured_predict(Shelf, PromptTemplate("{text}"), text=text)
    assert isinstance(shelf, Shelf) and shelf.title == "The Silent River"
    shelf = await llm.astructured_predict(Shelf, PromptTemplate("{text}"), text=text)
    assert isinstance(shelf, Shelf)
    response = llm.as_structured_llm(Shelf).chat(user(text))
    assert isinstance(response.raw, Shelf) and response.raw.genre in ("fiction", "history", "science")


class Code(BaseModel):
    """A code of capital letters."""
    code: str = Field(pattern=r"^[A-Z]+$", max_length=2)


class Page(BaseModel):
    """A web page."""
    title: str
    url: HttpUrl  # {"format": "uri", "minLength": 1, "maxLength": 2083}: the grammar holds the format alone


class Impossible(BaseModel):
    """No value meets it."""
    n: int = Field(ge=5, le=3)


def scripted_answer(scripted, name: str, arguments: str) -> None:
    scripted(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')


async def test_structured_output_holds_the_nearest_schema_and_reads_the_answer_into_the_class(engine, scripted):
    """A class whose schema the grammar holds only in part (pydantic's HttpUrl: a length beside a
    format; maxLength beside a pattern) is held to the nearest schema the grammar can hold, as
    LlamaIndex's OpenAI LLM leaves the schema to the model, and the answer is read into the class:
    one that breaks it is a ToolSchemaError naming the field and what the grammar could not hold,
    from every structured entry point (the streamed ones ended on an unchecked partial object).
    These classes were refused before any token (a ToolSchemaError), so HttpUrl fields could not be
    asked for at all. A schema no value meets is still refused before any token."""
    from hibana_core.chat import ToolSchemaError

    llm = HibanaLLM(engine=engine, max_tokens=64)
    prompt = PromptTemplate("{text}")
    scripted_answer(scripted, "Page", '{"title": "Python", "url": "https://python.org/"}')
    assert llm.structured_predict(Page, prompt, text="page?") == Page(title="Python", url="https://python.org/")
    assert llm.as_structured_llm(Page).chat(user("page?")).raw.url.host == "python.org"

    scripted_answer(scripted, "Code", '{"code": "ABCDE"}')  # the pattern held, not the length
    broken = "at most 2 characters.*maxLength beside pattern at #/properties/code"
    with pytest.raises(ToolSchemaError, match=broken):
        llm.structured_predict(Code, prompt, text="code?")
    with pytest.raises(ToolSchemaError, match=broken):
        await llm.astructured_predict(Code, prompt, text="code?")
    with pytest.raises(ToolSchemaError, match=broken):
        list(llm.stream_structured_predict(Code, prompt, text="code?"))
    with pytest.raises(ToolSchemaError, match=broken):
        [x async for x in await llm.astream_structured_predict(Code, prompt, text="code?")]
    with pytest.raises(ToolSchemaError, match=broken):
        list(llm.as_structured_llm(Code).stream_chat(user("code?")))
    scripted('{"code": "ABCDE"}')  # LlamaIndex's text program: the answer as JSON text
    with pytest.raises(ToolSchemaError, match=broken):
        HibanaLLM(engine=engine, pydantic_program_mode="llm").structured_predict(Code, prompt, text="code?")
    scripted('{"code": "AB"}')
    assert HibanaLLM(engine=engine, pydantic_program_mode="llm").structured_predict(Code, prompt, text="?") == \
        Code(code="AB")

    with pytest.raises(ToolSchemaError, match="cannot be compiled: Invalid range"):
        llm.structured_predict(Impossible, prompt, text="n?")


# --- which state serves a call ------------------------------------------------------------------------

async def test_state_selection(engine):
    bound = HibanaLLM(engine=engine, state_id="bound")
    reply = bound.chat(user("Who are you?"))
    assert reply.raw["state_id"] == "bound"
    assert engine.open_state("bound").tokens[-1] in engine.chat("bound").stop_token_ids

    # no state bound: the state whose conversation the prompt continues, else a new one; "bound"
    # shares a prefix with this conversation but is not taken over
    free = HibanaLLM(engine=engine)
    held = engine.open_state("bound").tokens
    history = user("Repeat after me: blue harbor clock")
    first = free.chat(history)
    history += [first.message, *user("Thanks!")]
    second = free.chat(history)
    assert second.raw["state_id"] == first.raw["state_id"] not in ("bound", None)
    assert second.raw["usage"]["cached_tokens"] >= first.raw["usage"]["total_tokens"] - 1
    assert engine.open_state("bound").tokens == held

    # calls at once never share a state: the bound one serves one, the others get their own. Three
    # streams, each read to its first response (its state leased) before the next opens, are at
    # once for certain (three gathered achats need not be: a short reply may end before the next
    # call leases, which may then take the bound state, free again)
    streams = []
    for _ in range(3):
        stream = await bound.astream_chat(user("Who are you?"))
        streams.append((stream, await stream.__anext__()))
    replies = []
    for stream, last in streams:
        async for last in stream:
            pass
        replies.append(last)
    assert len({r.raw["state_id"] for r in replies}) == 3 and "bound" in {r.raw["state_id"] for r in replies}
    assert len({r.message.content for r in replies}) == 1


# --- conversions --------------------------------------------------------------------------------------

def test_messages_from_blocks_and_from_openai_kwargs():
    call = ToolCallBlock(tool_call_id="c1", tool_name="f", tool_kwargs={"x": 1})
    block = ChatMessage(role="assistant", blocks=[call])
    legacy = ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]})
    result = ChatMessage(role="tool", content='{"y": 2}', additional_kwargs={"tool_call_id": "c1"})
    a, b, r = openai_messages([block, legacy, result])
    assert a["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert b["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert r == {"role": "tool", "content": '{"y": 2}', "tool_call_id": "c1"}
    assert openai_messages([ChatMessage(role="developer", content="Be brief.")]) == [
        {"role": "system", "content": "Be brief."}]


def test_a_citable_blocks_text_is_the_message_text():
    """A FunctionTool may return a CitableBlock (LlamaIndex passes it on as the tool message's block):
    its text is the tool's result (it was dropped: the model saw an empty result), and an image
    inside it is refused as any image is."""
    from llama_index.core.base.llms.types import CitableBlock, CitationBlock, ImageBlock, TextBlock

    from hibana_core.chat import UnsupportedContentError

    cited = CitableBlock(title="doc", source="s", content=[TextBlock(text='{"temperature": 4}')])
    result = ChatMessage(role="tool", blocks=[cited], additional_kwargs={"tool_call_id": "c1"})
    assert openai_messages([result]) == [{"role": "tool", "content": '{"temperature": 4}', "tool_call_id": "c1"}]
    citation = CitationBlock(cited_content=TextBlock(text="Oslo is cold."), source="s", title="t",
                             additional_location_info={})
    said = ChatMessage(role="assistant", blocks=[TextBlock(text="As cited: "), citation])
    assert openai_messages([said])[0]["content"] == "As cited: Oslo is cold."
    with pytest.raises(UnsupportedContentError):
        openai_messages([ChatMessage(role="tool", blocks=[CitableBlock(title="d", source="s", content=[
            ImageBlock(url="https://example.com/cat.png")])])])


def test_clean_schema_drops_titles_not_properties_named_title():
    schema = Book.model_json_schema()
    cleaned = clean_schema(schema)
    assert list(cleaned) == ["type", "properties", "description", "required"]
    assert cleaned["properties"]["title"] == {"type": "string", "description": "Title of the book."}
    assert "title" not in cleaned and cleaned["required"] == ["title", "author", "year"]


# --- issue 11, defect 2: tool_choice="none" and single calls enforced --------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


def test_tool_choice_none_and_single_calls_are_enforced(engine, scripted):
    """tool_choice="none": a call the model writes anyway is text; allow_parallel_tool_calls=False
    (LlamaIndex's default): one call, in every streamed chunk as in the response, sync and async."""
    scripted(CALL % "Paris" + "\n" + CALL % "Oslo")
    llm = HibanaLLM(engine=engine, state_id="enforced")
    question = "What's the weather in Paris and Oslo?"
    both = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert calls(llm, llm.chat_with_tools(TOOLS, user_msg=question, allow_parallel_tool_calls=True)) == both
    for chunk in llm.stream_chat_with_tools(TOOLS, user_msg=question):
        assert len(calls(llm, chunk)) <= 1
    assert calls(llm, chunk) == both[:1]

    async def last_async():
        async for chunk in await llm.astream_chat_with_tools(TOOLS, user_msg=question):
            assert len(calls(llm, chunk)) <= 1
        return chunk
    assert calls(llm, asyncio.run(last_async())) == both[:1]
    none = llm.chat_with_tools(TOOLS, user_msg=question, tool_choice="none")
    assert calls(llm, none) == [] and none.message.content.startswith("<tool_call>")
    streamed_none = list(llm.stream_chat(user(question), tools=[llm._tool_spec(t) for t in TOOLS],
                                         tool_choice="none"))
    assert calls(llm, streamed_none[-1]) == []


class Even(BaseModel):
    """An even number."""
    n: int

    @field_validator("n")
    @classmethod
    def even(cls, value: int) -> int:
        if value % 2:
            raise ValueError("n must be even")
        return value


async def test_a_structured_answer_its_class_refuses_raises_streamed_too(engine, scripted):
    """An answer the grammar held to the class's schema but the class's own validator refuses: the
    streamed forms ended on an unchecked partial object (FlexibleEven(n=3), no Even at all), where
    the non-streamed ones raised; every entry point now raises the same ValueError naming the field."""
    scripted('<tool_call>\n{"name": "Even", "arguments": {"n": 3}}\n</tool_call>')
    llm, prompt = HibanaLLM(engine=engine), PromptTemplate("{text}")
    refused = "does not read into Even .n: Value error, n must be even"
    with pytest.raises(ValueError, match="n must be even"):
        llm.structured_predict(Even, prompt, text="n?")
    with pytest.raises(ValueError, match=refused):
        list(llm.stream_structured_predict(Even, prompt, text="n?"))
    with pytest.raises(ValueError, match=refused):
        [x async for x in await llm.astream_structured_predict(Even, prompt, text="n?")]
    with pytest.raises(ValueError, match=refused):
        list(llm.as_structured_llm(Even).stream_chat(user("n?")))
    scripted('{"n": 3}')  # LlamaIndex's text program
    with pytest.raises(ValueError, match=refused):
        list(HibanaLLM(engine=engine, pydantic_program_mode="llm").stream_structured_predict(Even, prompt, text="n?"))
    scripted('<tool_call>\n{"name": "Even", "arguments": {"n": 4}}\n</tool_call>')
    assert list(llm.stream_structured_predict(Even, prompt, text="n?"))[-1] == Even(n=4)


class Color(enum.Enum):
    RED = "red"


class StrictEvent(BaseModel):
    """An event."""
    model_config = ConfigDict(strict=True)
    when: datetime.date
    color: Color


async def test_a_strict_class_takes_its_answer_as_json_from_every_entry_point(engine, scripted):
    """A strict class (ConfigDict(strict=True)) takes a date or an enum as JSON text in JSON mode
    alone: LlamaIndex's programs read a call's arguments in python mode, so structured_predict and
    as_structured_llm(...).chat failed on a right answer ("Input should be a valid date"), and the
    streamed forms ended on a partial object (FlexibleStrictEvent) instead of the class's."""
    event = StrictEvent(when=datetime.date(2024, 1, 2), color=Color.RED)
    llm, prompt = HibanaLLM(engine=engine), PromptTemplate("{text}")
    for mode, answer in (("default", '<tool_call>\n{"name": "StrictEvent", "arguments": %s}\n</tool_call>'),
                         ("llm", "%s")):
        scripted(answer % '{"when": "2024-01-02", "color": "red"}')
        llm = HibanaLLM(engine=engine, pydantic_program_mode=mode)
        assert llm.structured_predict(StrictEvent, prompt, text="when?") == event
        assert await llm.astructured_predict(StrictEvent, prompt, text="when?") == event
        assert llm.as_structured_llm(StrictEvent).chat(user("when?")).raw == event
        assert list(llm.stream_structured_predict(StrictEvent, prompt, text="when?"))[-1] == event
        assert [x async for x in await llm.astream_structured_predict(StrictEvent, prompt, text="when?")][-1] == event
        assert list(llm.as_structured_llm(StrictEvent).stream_chat(user("when?")))[-1].raw == event


class Tree(BaseModel):
    """A tree of small numbers."""
    v: int = Field(ge=0, le=9)
    kids: List["Tree"] = Field(default_factory=list, max_length=2)


def test_a_self_referring_output_class_keeps_its_root_schema(engine):
    """LlamaIndex's tool description of a model that refers to itself keeps its "$defs" but drops
    the root "$ref" (the arguments then take any object); the model's own schema is used."""
    from llama_index.core.program.function_program import get_function_tool

    spec = HibanaLLM(engine=engine)._tool_spec(get_function_tool(Tree))
    assert spec["function"]["parameters"]["$ref"] == "#/$defs/Tree"


async def test_a_self_referring_output_class_is_predicted_from_every_entry_point(engine, scripted):
    """structured_predict, astructured_predict and as_structured_llm(...).chat into a class that
    refers to itself: LlamaIndex's non-streamed program calls the class as a tool through
    `call_tool`, which reads its parameters' "properties" (a root "$ref" has none), and failed on a
    right answer ("Structured output extraction failed ... Error: 'properties'"); the streamed forms
    worked. The non-streamed ones now read the streamed program's answer."""
    scripted('<tool_call>\n{"name": "Tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": []}]}}\n</tool_call>')
    llm, tree = HibanaLLM(engine=engine), Tree(v=1, kids=[Tree(v=2)])
    prompt = PromptTemplate("{text}")
    assert llm.structured_predict(Tree, prompt, text="a tree") == tree
    assert await llm.astructured_predict(Tree, prompt, text="a tree") == tree
    assert llm.as_structured_llm(Tree).chat(user("a tree")).raw == tree
    assert list(llm.stream_structured_predict(Tree, prompt, text="a tree"))[-1] == tree


def test_a_call_cut_by_max_tokens_leaves_no_markup_in_the_text(engine):
    """A call that max_tokens cut came back as `<tool_call>` markup in a TextBlock (an outside
    tester); the text holds none of it, as the server's reply holds none."""
    llm = HibanaLLM(engine=engine, max_tokens=12)
    history = [ChatMessage(role="user", content="What's the weather in Paris?")]
    reply = llm.chat_with_tools(TOOLS[:1], chat_history=history, tool_required=True)
    assert "<tool_call>" not in (reply.message.content or "")
    assert llm.get_tool_calls_from_response(reply, error_on_no_tool_call=False) == []
    streamed = list(llm.stream_chat_with_tools(TOOLS[:1], chat_history=history, tool_required=True))
    assert "<tool_call>" not in (streamed[-1].message.content or "")


def test_a_call_cut_by_a_stop_reports_an_openai_finish_reason(engine):
    """`raw["finish_reason"]` was the chat layer's own "malformed_tool_call" where a stop string cut a
    call; it is "stop", as the server and ChatOpenAI report it, the parse error beside it."""
    llm = HibanaLLM(engine=engine, max_tokens=40)
    history = [ChatMessage(role="user", content="What is the weather in Paris?")]
    reply = llm.chat_with_tools(TOOLS[:1], chat_history=history, tool_required=True, stop=["Paris"])
    assert reply.raw["finish_reason"] == "stop" and reply.raw["error"]


# --- copies, pickles, streams left early (an outside trial of the adapters) -----------------------------

def test_a_copy_for_another_model_or_engine_options_runs_on_their_engine(engine):
    """`model_copy(update=...)` copied the chat layer, and the engine with it: a copy for another
    model ran on the original's engine. A given engine serves only the model and engine_kwargs it
    was given with."""
    given = HibanaLLM(engine=engine, max_tokens=4)
    assert given.model_copy(update={"max_tokens": 2}).engine is engine
    by_path = given.model_copy(update={"model": DEMO_CHECKPOINT})
    assert by_path.engine is Engine.shared(DEMO_CHECKPOINT) and by_path.complete("Hello").text
    shorter = given.model_copy(update={"engine_kwargs": {"max_model_len": 128}})
    assert shorter.engine.max_model_len == 128 and shorter.metadata.context_window == 128


def test_deep_copies_and_pickles(engine, caplog):
    """LlamaIndex's unpickling runs __init__ again, with its own default messages_to_prompt, which
    HibanaLLM refused: the unpickled LLM had no chat layer (AttributeError on the first call), and
    copy.deepcopy failed ("cannot pickle '_thread.lock'"). A pickle carries no engine, not even a
    given one; a deep copy shares it."""
    llm = HibanaLLM(engine=engine, max_tokens=4, state_id="li-pickled")
    assert copy.deepcopy(llm).engine is engine
    with caplog.at_level(logging.WARNING):
        back = pickle.loads(pickle.dumps(llm))
    assert "unpickleable" not in caplog.text  # nothing dropped but the engine, which never tries
    assert (back.max_tokens, back.state_id) == (4, "li-pickled") and back.engine is Engine.shared("demo")
    assert back.complete("Hello").text
    assert HibanaLLM(engine=engine, messages_to_prompt=llm.messages_to_prompt).engine is engine  # LlamaIndex's own
    with pytest.raises(ConfigError, match="messages_to_prompt"):
        HibanaLLM(engine=engine, messages_to_prompt=lambda messages: "")


async def test_a_stream_left_early_lets_its_callers_next_call_have_the_state(engine):
    """Breaking out of astream_chat left the bound state leased until the event loop's finalizer
    closed the streams: the next call went to another state (2 trials in 3). Closing the stream
    frees the state before aclose returns."""
    llm = HibanaLLM(engine=engine, max_tokens=30, state_id="li-left")
    for _ in range(3):
        async for _ in await llm.astream_chat(user("Tell me a long story about Paris")):
            break
        assert (await llm.achat(user("Hello"))).raw["state_id"] == "li-left"
        async for _ in await llm.astream_complete("Tell me a long story about Paris"):
            break
        assert (await llm.acomplete("Hello")).raw["state_id"] == "li-left"
    stream = await llm.astream_chat(user("Tell me a long story about Paris"))
    await anext(stream)
    await stream.aclose()
    with engine.lease(state_id="li-left"):  # StateBusyError while the stream holds it
        pass


def test_a_missing_call_says_why(engine):
    """A required call that max_tokens cut: "expected at least one tool call, got none: ''"."""
    llm = HibanaLLM(engine=engine, max_tokens=10)
    reply = llm.chat_with_tools(TOOLS[:1], user_msg="What is the weather in Paris?", tool_required=True)
    with pytest.raises(ValueError, match="finish_reason 'length'.*unclosed <tool_call>.*raise max_tokens"):
        llm.get_tool_calls_from_response(reply)
