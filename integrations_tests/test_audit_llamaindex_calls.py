"""Audit of HibanaLLM as a LlamaIndex user meets it: structured output through every program
LlamaIndex picks, round trips through LlamaIndex's and pydantic's dicts."""

from __future__ import annotations

import pytest
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel

from hibana_core import Engine
from hibana_core.errors import ConfigError
from hibana_plugins.llamaindex import HibanaLLM


class Point(BaseModel):
    x: int
    y: int


PROMPT = PromptTemplate("Give the point {q}")


@pytest.fixture(scope="module")
def engine():
    return Engine.shared("demo")  # the engine a dict or a pickle of a HibanaLLM finds


async def test_pydantic_program_mode_llm_holds_the_text_answer_to_the_schema(engine):
    """pydantic_program_mode="llm" (LLMTextCompletionProgram: the schema in the prompt, the answer
    parsed from the text) is held by the grammar as the no-tools template's path is; the demo
    model, asked freely, wrote prose and every entry point raised 'Could not extract json string'
    (the stream ended on an object of empty fields)."""
    llm = HibanaLLM(engine=engine, max_tokens=64, pydantic_program_mode="llm")
    assert isinstance(llm.structured_predict(Point, PROMPT, q="1 2"), Point)
    assert isinstance(list(llm.stream_structured_predict(Point, PROMPT, q="1 2"))[-1], Point)
    assert isinstance(await llm.astructured_predict(Point, PROMPT, q="1 2"), Point)
    assert isinstance(llm.as_structured_llm(Point).complete("point 1 2").raw, Point)


def test_its_own_dicts_build_it_again(engine):
    """to_dict() and model_dump() add LlamaIndex's "class_name" key; HibanaLLM(**llm.to_dict())
    and HibanaLLM.model_validate(llm.model_dump()) refused it ("does not take 'class_name'"),
    where LlamaIndex's other LLMs ignore it. Another class's dict is still refused."""
    llm = HibanaLLM(engine=engine, temperature=0.3, state_id="serialized", max_tokens=7)
    for again in (HibanaLLM(**llm.to_dict()), HibanaLLM.model_validate(llm.model_dump()),
                  HibanaLLM.from_dict(llm.to_dict())):
        assert (again.temperature, again.state_id, again.max_tokens) == (0.3, "serialized", 7)
        assert again.engine is engine  # Engine.shared("demo"), as a pickle finds it
    with pytest.raises(ConfigError, match="class_name"):
        HibanaLLM(engine=engine, class_name="OpenAI")


def test_max_tokens_of_the_whole_context_leaves_llamaindex_room_for_the_prompt(engine):
    """max_tokens at or past the context means no limit but the context, as None does; metadata
    reported it as num_output, and LlamaIndex's PromptHelper (query engines, response synthesizers)
    then had context_window - num_output < 0 tokens for the prompt: "Calculated available context
    size -1 was not non-negative". A limit below the context is reported as it is."""
    from llama_index.core.indices.prompt_helper import PromptHelper

    context = engine.max_model_len
    for max_tokens in (context, context + 1000):
        metadata = HibanaLLM(engine=engine, max_tokens=max_tokens).metadata
        assert metadata.num_output == HibanaLLM(engine=engine, max_tokens=None).metadata.num_output < context
        packed = PromptHelper.from_llm_metadata(metadata).repack(PromptTemplate("{context_str} Q"), ["abc " * 50])
        assert packed and "abc" in packed[0]
    assert HibanaLLM(engine=engine, max_tokens=context - 1).metadata.num_output == context - 1


def test_llamaindex_tools_given_to_chat_say_where_they_go(engine):
    """chat(messages, tools=[FunctionTool]) said only what an OpenAI tool dict looks like; the
    LlamaIndex user is told to pass the tools to chat_with_tools / predict_and_call."""
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.tools import FunctionTool

    from hibana_core.chat import ToolSchemaError

    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return "sunny"

    llm = HibanaLLM(engine=engine, max_tokens=4)
    with pytest.raises(ToolSchemaError, match="chat_with_tools"):
        llm.chat([ChatMessage(role="user", content="Weather in Oslo?")], tools=[FunctionTool.from_defaults(get_weather)])


def test_openais_strict_says_the_grammar_holds_the_schema_always(engine):
    """OpenAI(strict=True) and chat_with_tools(tools, strict=True) (LlamaIndex's OpenAI LLM) were
    refused as an unknown option, without saying that the grammar holds every call and answer to
    its schema (strict, as HibanaLLM always is)."""
    from llama_index.core.tools import FunctionTool

    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return "sunny"

    with pytest.raises(ConfigError, match="held to their schema by the grammar"):
        HibanaLLM(engine=engine, strict=True)
    with pytest.raises(ConfigError, match="held to their schema by the grammar"):
        HibanaLLM(engine=engine).chat_with_tools([FunctionTool.from_defaults(get_weather)], user_msg="hi", strict=True)


def test_a_prompt_past_the_context_says_to_count_with_the_models_tokenizer(engine, monkeypatch):
    """A query engine's tree_summarize (Settings.llm = HibanaLLM, tiktoken's count by default) packed
    more tokens than the demo's context and got "shorten the history", which its user never wrote:
    the error now says to count with the model's tokenizer, unless LlamaIndex already does."""
    import llama_index.core
    from llama_index.core import Settings

    from hibana_core.errors import ContextLengthError

    llm = HibanaLLM(engine=engine, max_tokens=4)
    too_long = "Die Wetterlage über Zürich ist äußerst wechselhaft. " * 200
    monkeypatch.setattr(llama_index.core, "global_tokenizer", None)  # LlamaIndex's default: tiktoken's
    with pytest.raises(ContextLengthError, match="Settings.tokenizer = llm.engine.tokenizer"):
        llm.complete(too_long)
    Settings.tokenizer = engine.tokenizer  # (restored by monkeypatch)
    with pytest.raises(ContextLengthError) as caught:
        llm.complete(too_long)
    assert "Settings.tokenizer" not in str(caught.value) and "shorten the history" in str(caught.value)
