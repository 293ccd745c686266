"""A call that a stop sequence cut: `response_metadata["tool_call_error"]` says what ended it and
what to do, in invoke and in a stream alike (a stream's merged message has no invalid call to
carry that, only this)."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from hibana_plugins.langchain import ChatHibana  # noqa: E402


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def test_a_cut_calls_error_says_to_take_the_stop_out_streamed_or_not(engine):
    llm = ChatHibana(engine=engine, max_tokens=40, temperature=0).bind_tools(
        [get_weather], tool_choice="get_weather", stop=["Par"])
    question = [HumanMessage("What is the weather in Paris?")]
    whole = llm.invoke(question)
    merged = None
    for chunk in llm.stream(question):
        merged = chunk if merged is None else merged + chunk
    said = whole.response_metadata["tool_call_error"]
    assert "take that sequence out of stop" in said and "['Par']" in said
    assert merged.response_metadata["tool_call_error"] == said == whole.invalid_tool_calls[0]["error"]
