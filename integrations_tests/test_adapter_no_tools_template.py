"""Structured output on a model whose chat template renders no tools (Gemma 3's, Phi-3's): the
answer itself is held to the schema, as OpenAI's response_format holds it. LangChain's
json_schema / json_mode methods were a forced call the template could not show the model (a
ConversationError), and LlamaIndex's structured_predict went the same way."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

import tiny_models
from hibana_core.errors import ConversationError, GrammarError
from hibana_core.speculation import force_outputs
from hibana_plugins.langchain import ChatHibana
from hibana_plugins.llamaindex import HibanaLLM

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A chat template without a place for tools."""


class Pick(BaseModel):
    n: int
    color: Literal["red", "blue"]


ANSWER = '{"n": 3, "color": "blue"}'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_models.make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("no-tools"))
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    engine = tiny_models.open_engine(path)
    yield engine
    engine.close()


def force(engine, state_id: str, text: str) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False) + [tiny_models.EOS_ID]
    force_outputs(engine.open_state(state_id), ids)
    return len(ids)


def test_langchain_json_methods_hold_the_answer_without_a_tool(engine):
    from hibana_core.chat import Chat

    assert not Chat(engine).renders_tools()
    for method in ("json_schema", "json_mode"):
        state = f"lc-{method}"
        llm = ChatHibana(engine=engine, state_id=state, max_tokens=force(engine, state, ANSWER))
        schema = Pick if method == "json_schema" else None
        got = llm.with_structured_output(schema, method=method).invoke("pick one")
        assert got == (Pick(n=3, color="blue") if schema else {"n": 3, "color": "blue"})
        assert "pick one" in engine.tokenizer.decode(engine.open_state(state).tokens)
        force(engine, state + "-off", '{"n": 3, "color": "green"}')  # outside the schema: refused by the grammar
        off = ChatHibana(engine=engine, state_id=state + "-off", max_tokens=32)
        if method == "json_schema":
            with pytest.raises(GrammarError):
                off.with_structured_output(Pick, method=method).invoke("pick one")
    with pytest.raises(ConversationError, match="does not render tools"):  # a call: the model could not see it
        ChatHibana(engine=engine, max_tokens=8).with_structured_output(Pick).invoke("pick one")


def test_llamaindex_structured_predict_holds_the_answer_without_a_tool(engine):
    from llama_index.core.prompts import PromptTemplate

    structured = "li/structured"  # the state a structured call on an LLM bound to "li" runs on
    llm = HibanaLLM(engine=engine, state_id="li", max_tokens=force(engine, structured, ANSWER))
    assert not llm.metadata.is_function_calling_model
    assert llm.structured_predict(Pick, PromptTemplate("pick one of {what}"), what="colors") == Pick(n=3, color="blue")
    force(engine, structured, '{"n": 3, "color": "green"}')
    with pytest.raises(GrammarError):
        llm.structured_predict(Pick, PromptTemplate("pick one of {what}"), what="colors")


def test_a_call_the_context_cut_says_so_not_raise_max_tokens():
    """A forced call that the model's context ended (the prompt left it a few tokens) was reported
    as "raise max_tokens", which changes nothing: the advice is to shorten the history."""
    from langchain_core.tools import tool
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.tools import FunctionTool

    from hibana_core import Engine

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return "sunny"

    ask = "What is the weather in Paris?"

    def tight(prompt_tokens: int):  # an engine whose context leaves the reply 6 tokens
        return Engine.from_pretrained("demo", progress=False, max_model_len=prompt_tokens + 6)

    reply = ChatHibana(model="demo", max_tokens=64).bind_tools([get_weather], tool_choice="any").invoke(ask)
    with tight(reply.usage_metadata["input_tokens"]) as engine:
        reply = ChatHibana(engine=engine, max_tokens=64).bind_tools([get_weather], tool_choice="any").invoke(ask)
        (cut,) = reply.invalid_tool_calls
        assert "context of" in cut["error"] and "max_tokens" not in cut["error"]
    tools, history = [FunctionTool.from_defaults(get_weather.func)], [ChatMessage(role="user", content=ask)]
    response = HibanaLLM(model="demo", max_tokens=64).chat_with_tools(tools, chat_history=history, tool_required=True)
    with tight(response.raw["usage"]["prompt_tokens"]) as engine:
        llm = HibanaLLM(engine=engine, max_tokens=64)
        response = llm.chat_with_tools(tools, chat_history=history, tool_required=True)
        with pytest.raises(ValueError, match="at the model's context: shorten the history"):
            llm.get_tool_calls_from_response(response)
