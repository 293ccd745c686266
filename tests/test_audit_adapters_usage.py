"""Audit (adapters in use): the adapters driven as their frameworks' users drive them, on tiny
seeded checkpoints with real chat formats."""

# (no `from __future__ import annotations`: LlamaIndex's FunctionTool cannot read a string Literal)
from typing import Literal

import pytest


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    """An engine on test_harmony's tiny gpt_oss checkpoint with harmony's tokens and template."""
    from test_harmony import make_harmony_checkpoint
    from tiny_models import open_engine

    with open_engine(make_harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "gpt_oss")) as engine:
        yield engine


def lookup(city: Literal["Oslo", "Paris"]) -> str:
    """Look up a forecast."""
    return "sunny"


@pytest.mark.parametrize("max_tokens", [3, 15, 16, 27])
def test_a_harmony_call_cut_in_its_header_is_an_invalid_call_not_content(harmony_engine, max_tokens):
    """gpt-oss (harmony) held to a call writes its recipient first (" to=functions.lookup<|channel|>
    commentary json<|message|>{...}<|call|>", a form the grammar allows). Cut by max_tokens before
    <|message|>, the header's text before <|channel|> came back as the reply's content
    ("to=functions.lookup") with no invalid call; cut right after <|message|>, the call came back
    valid with arguments {} (its required "city" never written). Now the content is empty and the
    cut call is an invalid call (named where its header had ended the name), through both
    adapters, streamed too."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from llama_index.core.tools import FunctionTool

    from hibana_plugins.langchain import ChatHibana
    from hibana_plugins.llamaindex import HibanaLLM

    llm = ChatHibana(engine=harmony_engine, max_tokens=max_tokens).bind_tools([lookup], tool_choice="lookup")
    reply = llm.invoke("Forecast for Oslo?")
    generated = harmony_engine.tokenizer.decode(harmony_engine.open_state(reply.response_metadata["state_id"]).tokens)
    assert "<|call|>" not in generated.rsplit("<|start|>assistant", 1)[-1]  # the call was cut
    assert reply.content == "" and reply.tool_calls == []
    named = "lookup" if max_tokens > 15 else None  # the name is whole once <|channel|> ends it
    assert [(c["name"], c["args"]) for c in reply.invalid_tool_calls] == [(named, "")]
    assert "raise max_tokens" in reply.invalid_tool_calls[0]["error"]
    assert "".join(chunk.content for chunk in llm.stream("Forecast for Oslo?")) == ""

    li = HibanaLLM(engine=harmony_engine, max_tokens=max_tokens)
    response = li.chat_with_tools([FunctionTool.from_defaults(lookup)], user_msg="Forecast for Oslo?",
                                  tool_choice="lookup")
    assert response.message.content == ""
    with pytest.raises(ValueError, match="raise max_tokens"):
        li.get_tool_calls_from_response(response)


def test_tools_given_per_call_are_taken_as_bind_tools_takes_them(harmony_engine):
    """`invoke(..., tools=[@tool or function])` (as ChatOllama takes them) was a ToolSchemaError
    ("tool 0 is a StructuredTool") that never said bind_tools would have taken it; now such tools
    are described as bind_tools describes them, and the call is the bound call's."""
    pytest.importorskip("langchain_core")
    from langchain_core.tools import tool

    from hibana_plugins.langchain import ChatHibana

    llm = ChatHibana(engine=harmony_engine, max_tokens=64)
    bound = llm.bind_tools([lookup], tool_choice="lookup").invoke("Forecast for Oslo?")
    for given in (lookup, tool(lookup)):
        reply = llm.invoke("Forecast for Oslo?", tools=[given], tool_choice="lookup")
        assert [(c["name"], c["args"]) for c in reply.tool_calls] == [(c["name"], c["args"]) for c in bound.tool_calls]
    assert bound.tool_calls and bound.tool_calls[0]["name"] == "lookup"
