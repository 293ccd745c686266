"""OpenAI's deprecated functions form in a LangChain history: an AIMessage whose call is in
`additional_kwargs["function_call"]`, answered by a FunctionMessage, is the call and result it
means (as langchain-openai reads it), not a result without a call."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, FunctionMessage, HumanMessage, ToolMessage  # noqa: E402

from hibana_core.messages import normalize_messages  # noqa: E402
from hibana_plugins.langchain import ChatHibana, _to_chat_messages  # noqa: E402

QUESTION = HumanMessage("What is the weather in Paris?")


def _legacy(arguments: str) -> list:
    return [QUESTION, AIMessage("", additional_kwargs={"function_call": {"name": "get_weather", "arguments": arguments}}),
            FunctionMessage(name="get_weather", content='{"temp": 21}')]


def test_a_legacy_function_call_is_the_call_it_means(engine):
    llm = ChatHibana(engine=engine, max_tokens=12, temperature=0)
    modern = [QUESTION, AIMessage("", tool_calls=[{"id": "call_1", "name": "get_weather", "args": {"city": "Paris"}}]),
              ToolMessage('{"temp": 21}', tool_call_id="call_1")]
    assert normalize_messages(_to_chat_messages(_legacy('{"city": "Paris"}')))[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert llm.get_num_tokens_from_messages(_legacy('{"city": "Paris"}')) == llm.get_num_tokens_from_messages(modern)
    assert llm.invoke(_legacy('{"city": "Paris"}')).content == llm.invoke(modern).content


def test_legacy_arguments_that_are_not_an_object_are_kept_as_text():
    call = normalize_messages(_to_chat_messages(_legacy("not json")))[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": "not json"}
    assert "tool_calls" not in _to_chat_messages([AIMessage("hi", additional_kwargs={"function_call": {}})])[0]
