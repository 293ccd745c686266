"""HibanaLLM on inputs a LlamaIndex user's code hands it: messages of several text blocks (as
LlamaIndex's own Memory builds them), messages that are not ChatMessages, and per-call switches
that are not True or False."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

import pytest

from llama_index.core.base.llms.types import ChatMessage, TextBlock
from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool

from hibana_core import Engine
from hibana_core.errors import ConfigError, ConversationError
from hibana_plugins.llamaindex import HibanaLLM, openai_messages


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        yield engine


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return "sunny"


TOOLS = [FunctionTool.from_defaults(get_weather, description=get_weather.__doc__)]


def test_text_blocks_are_a_line_apart_as_in_llamaindexs_content():
    """LlamaIndex reads a message of several TextBlocks as their texts a line apart
    (`ChatMessage.content`); the adapter glued them: Memory's memory blocks, put before the
    system prompt, became '...</memory>You are a helpful assistant.'."""
    from llama_index.core.memory import Memory, StaticMemoryBlock

    memory = Memory.from_defaults(session_id="blocks", token_limit=4000, memory_blocks=[
        StaticMemoryBlock(name="core_info", static_content="My name is Logan.", priority=0)])

    async def history() -> list[ChatMessage]:
        await memory.aput(ChatMessage(role="system", content="You are a helpful assistant."))
        await memory.aput(ChatMessage(role="user", content="Hi"))
        return await memory.aget()

    messages = asyncio.run(history())
    assert len(messages[0].blocks) == 2
    system, user = openai_messages(messages)
    assert system["content"] == messages[0].content and system["content"].endswith(
        "</memory>\nYou are a helpful assistant.")
    question = ChatMessage(role="user", blocks=[TextBlock(text="Context: Oslo is cold."),
                                                TextBlock(text="Question: is Oslo cold?")])
    assert openai_messages([question])[0]["content"] == question.content == \
        "Context: Oslo is cold.\nQuestion: is Oslo cold?"


def test_a_message_that_is_no_chat_message_is_a_conversation_error(engine):
    """An OpenAI-style dict (code moved from another client) was an AttributeError ('dict' object
    has no attribute 'role') from inside the adapter. (A message LlamaIndex's own call event cannot
    read, None or a string, fails there first, with pydantic's error.)"""
    llm = HibanaLLM(engine=engine, max_tokens=8)
    with pytest.raises(ConversationError, match="ChatMessage"):
        llm.chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(ConversationError, match="message 1 is a str"):
        openai_messages([ChatMessage(role="user", content="Hi"), "Hi"])
    assert llm.chat([ChatMessage(role="user", content="Hi")]).message.content  # the engine goes on


def test_per_call_switches_are_true_or_false(engine):
    """tool_required='no' forced a tool call (a non-empty string is truthy); parallel_tool_calls
    and allow_parallel_tool_calls 'no' allowed parallel calls. They are refused as the
    constructor's switches are; None stays LlamaIndex's falsy default."""
    llm = HibanaLLM(engine=engine, max_tokens=32)
    for options in ({"tool_required": "no"}, {"allow_parallel_tool_calls": "no"}, {"tool_required": 0}):
        with pytest.raises(ConfigError, match="True or False"):
            llm.chat_with_tools(TOOLS, user_msg="Hi!", **options)
    for options in ({"parallel_tool_calls": "no"}, {"tool_required": "yes"}):
        with pytest.raises(ConfigError, match="True or False"):
            llm.chat([ChatMessage(role="user", content="Hi!")],
                     tools=llm._prepare_chat_with_tools(TOOLS)["tools"], **options)
    greeting = llm.chat_with_tools(TOOLS, user_msg="Hi!", tool_required=False, allow_parallel_tool_calls=None)
    assert llm.get_tool_calls_from_response(greeting, error_on_no_tool_call=False) == []


def test_constructor_takes_what_chathibana_takes(engine, monkeypatch):
    """A checkpoint's Path (as Engine.from_pretrained takes it) and stop as one string (as chat(...,
    stop="...") takes it) were pydantic errors; engine_kwargs beside engine= were not checked at all
    (a misspelt option passed in silence). ChatHibana takes the first two and refuses the third."""
    from pathlib import Path

    import hibana_core
    import hibana_plugins.llamaindex as adapter
    from hibana_plugins.options import EngineChoice

    asked = []  # the engine the Path asks for is the demo's (this one), not loaded a second time
    monkeypatch.setattr(adapter, "choose_engine", lambda model, kwargs, *_: asked.append(model) or EngineChoice(
        engine, model, dict(kwargs)))
    demo = Path(hibana_core.__file__).parent / "demo" / "model"
    assert HibanaLLM(model=demo).model == str(demo) and asked == [str(demo)]
    monkeypatch.undo()
    llm = HibanaLLM(engine=engine, stop="What", max_tokens=16)
    assert llm.stop == ["What"] and "What" not in llm.chat([ChatMessage(role="user", content="Hi")]).message.content
    with pytest.raises(ConfigError, match="unknown engine option 'kv_dtpye'"):
        HibanaLLM(engine=engine, engine_kwargs={"kv_dtpye": "fp8"})


def add_numbers(a: float, b: float) -> str:
    """Add two numbers and return the sum."""
    return f"{a + b:g}"


Year = TypeVar("Year")


class Record(BaseModel, Generic[Year]):
    """A book, as a structured record."""

    title: str = Field(description="Title of the book.")
    author: str = Field(description="Who wrote it.")
    year: Year = Field(description="Year of publication.")


def test_a_tool_is_offered_and_called_under_its_own_name(engine):
    """LlamaIndex writes tool names to OpenAI's pattern ("calc.add" as "calc_add", the class
    Record[int] as "Record_int_") and then looks the called tool up by its own name: predict_and_call
    and structured_predict raised KeyError('calc_add'), and a FunctionAgent answered 'Tool calc_add
    not found' to every call. The template writes any name but quotes and markup: the tool's own one."""
    llm = HibanaLLM(engine=engine, max_tokens=64)
    dotted = FunctionTool.from_defaults(add_numbers, name="calc.add", description=add_numbers.__doc__)
    response = llm.chat_with_tools([dotted], user_msg="What is 12 plus 30?")
    assert [c.tool_name for c in llm.get_tool_calls_from_response(response)] == ["calc.add"]
    assert str(llm.predict_and_call([dotted], user_msg="What is 12 plus 30?")) == "42"
    text = 'Save the book "The Silent River" by Ana Garcia, published in 1843.'
    assert llm.structured_predict(Record[int], PromptTemplate("{text}"), text=text) == Record[int](
        title="The Silent River", author="Ana Garcia", year=1843)
