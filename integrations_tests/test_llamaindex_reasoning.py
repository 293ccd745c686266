"""HibanaLLM's thinking where LlamaIndex's agents read it, on the tiny Qwen3-style reasoning
checkpoint (tests/reasoning_model.py, its outputs forced so that it thinks)."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.agent.workflow import AgentStream, FunctionAgent
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool

import tiny_models
from hibana_core.speculation import force_outputs
from hibana_plugins.llamaindex import HibanaLLM
from reasoning_model import make_reasoning_checkpoint

THOUGHT = "The user says hi. I should greet them."
ANSWER = "Hello there, friend."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"

# LlamaIndex's workflows inspect agents (pydantic models) attribute by attribute
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:inspect")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    yield engine
    engine.close()


def force(engine, state_id: str) -> int:
    ids = engine.tokenizer.encode(OUTPUT, add_special_tokens=False)
    force_outputs(engine.open_state(state_id), ids)
    return len(ids)


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return "sunny"


def test_streamed_thinking_is_a_thinking_delta(engine):
    """LlamaIndex's agents read a streamed response's thinking from
    `additional_kwargs["thinking_delta"]` (AgentStream.thinking_delta), as Ollama's and OpenAI's LLMs
    put it; HibanaLLM put it only in the growing ThinkingBlock, so an agent's stream had none."""
    llm = HibanaLLM(engine=engine, state_id="li-delta", max_tokens=force(engine, "li-delta"))
    responses = list(llm.stream_chat([ChatMessage(role="user", content="hi")]))
    assert "".join(r.additional_kwargs.get("thinking_delta", "") for r in responses) == THOUGHT
    assert all(not r.delta for r in responses if r.additional_kwargs.get("thinking_delta"))

    llm = HibanaLLM(engine=engine, state_id="li-agent", max_tokens=force(engine, "li-agent"))
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(get_weather)], llm=llm)

    async def run() -> tuple[object, list]:
        handler = agent.run(user_msg="hi")
        events = [event async for event in handler.stream_events()]
        return await handler, events

    result, events = asyncio.run(run())
    streams = [e for e in events if isinstance(e, AgentStream)]
    assert "".join(e.thinking_delta or "" for e in streams) == THOUGHT
    assert "".join(e.delta for e in streams) == ANSWER == result.response.content


def test_completion_carries_the_thinking(engine):
    """complete() and its streams keep the think block out of the text, as chat() does, and give
    the thinking where a completion can hold it: `additional_kwargs["thinking"]` (the whole so far,
    where LlamaIndex's chat_to_completion_decorator leaves a message's) and each streamed piece as
    `thinking_delta`, as chat's. They returned none of it."""
    llm = HibanaLLM(engine=engine, state_id="li-complete", max_tokens=force(engine, "li-complete"))
    response = llm.complete("hi")
    assert (response.text, response.additional_kwargs["thinking"]) == (ANSWER, THOUGHT)

    llm = HibanaLLM(engine=engine, state_id="li-stream-complete", max_tokens=force(engine, "li-stream-complete"))
    responses = list(llm.stream_complete("hi"))
    assert "".join(r.additional_kwargs.get("thinking_delta", "") for r in responses) == THOUGHT
    assert "".join(r.delta for r in responses) == ANSWER == responses[-1].text
    assert responses[-1].additional_kwargs["thinking"] == THOUGHT

    async def astream() -> list:
        return [r async for r in await llm.astream_complete("hi")]

    llm = HibanaLLM(engine=engine, state_id="li-astream-complete", max_tokens=force(engine, "li-astream-complete"))
    responses = asyncio.run(astream())
    assert "".join(r.additional_kwargs.get("thinking_delta", "") for r in responses) == THOUGHT
    assert (responses[-1].text, responses[-1].additional_kwargs["thinking"]) == (ANSWER, THOUGHT)
