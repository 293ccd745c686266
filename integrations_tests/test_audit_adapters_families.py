"""Audit of both adapters across the non-Llama families: gpt-oss (harmony), Qwen3 (thinking),
Qwen3-MoE, Gemma 3 and Phi-3, each a tiny seeded checkpoint with its chat markup, outputs forced
where the random weights would write nothing a parser reads."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock

import tiny_models
from hibana_core.errors import ConversationError
from hibana_plugins.langchain import ChatHibana
from hibana_plugins.llamaindex import HibanaLLM

PHI3_SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PHI3_TEMPLATE = (  # Phi-3-mini-4k-instruct's and Phi-3.5-mini-instruct's: no tools, and a tool message is dropped
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tiny_models.make_chat_checkpoint("phi3", tmp_path_factory.mktemp("phi3") / "m", PHI3_TEMPLATE, PHI3_SPECIAL)
    with tiny_models.open_engine(path) as engine:
        yield engine


RESULT = "It is 21 degrees in Oslo."


def test_a_tool_result_phi3s_template_would_drop_is_refused(phi3):
    """Phi-3's template renders system, user and assistant messages only: a tool's result (a
    history from another model, an OpenAI client's) went to the model without a word, its call an
    empty assistant turn, and the model answered as if the tool had never run."""
    history = [HumanMessage("Weather in Oslo?"),
               AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Oslo"}, "id": "c1"}]),
               ToolMessage(RESULT, tool_call_id="c1")]
    llm = ChatHibana(engine=phi3, state_id="lc", max_tokens=2)
    with pytest.raises(ConversationError, match="does not render tool results"):
        llm.invoke(history)
    with pytest.raises(ConversationError, match="does not render tool results"):
        list(llm.stream(history))
    assert phi3.open_state("lc").tokens == []  # refused before anything ran

    messages = [ChatMessage(role="user", content="Weather in Oslo?"),
                ChatMessage(role="assistant", blocks=[TextBlock(text=""), ToolCallBlock(
                    tool_call_id="c1", tool_name="get_weather", tool_kwargs={"city": "Oslo"})]),
                ChatMessage(role="tool", content=RESULT, additional_kwargs={"tool_call_id": "c1"})]
    with pytest.raises(ConversationError, match="does not render tool results"):
        HibanaLLM(engine=phi3, state_id="li", max_tokens=2).chat(messages)
    # the result as a user message, as the error says, is rendered
    reply = llm.invoke([HumanMessage("Weather in Oslo?"), AIMessage("I will look it up."), HumanMessage(RESULT)])
    assert reply.usage_metadata["output_tokens"] >= 1
    assert RESULT in phi3.tokenizer.decode(phi3.open_state("lc").tokens)
