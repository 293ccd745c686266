"""A LangGraph ReAct agent on ChatHibana: 4 conversations at once, each several questions long.

Every question needs a real tool call (weather, multiplication: families the demo model was
trained on); each thread keeps one resident state ("t<i>/agent", from LangGraph's thread_id), so
from its second model call on nearly the whole prompt is read from cache; and the 4 threads'
turns are batched into the same engine steps.
"""

from __future__ import annotations

import asyncio
import json
import warnings
from typing import Annotated

import pytest


from langchain_core.messages import AIMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402

from hibana_core import Engine  # noqa: E402
from hibana_core.demo import world  # noqa: E402
from hibana_plugins.langchain import ChatHibana  # noqa: E402

SYSTEM = "You are an agent. Use the tools to answer."
CITIES = ("Paris", "Lisbon", "Osaka", "Nairobi")


@tool
def get_weather(city: Annotated[str, "Name of the city."]) -> str:
    """Get the current weather for a city."""
    return json.dumps(world.weather(city))


@tool
def multiply(a: Annotated[float, "The first number."], b: Annotated[float, "The second number."]) -> str:
    """Multiply two numbers and return the product."""
    return json.dumps({"result": world.fmt_number(a * b)})


def make_agent(llm, tools):
    """langchain's create_agent where installed, else LangGraph's prebuilt ReAct agent."""
    try:
        from langchain.agents import create_agent
    except ImportError:
        from langgraph.prebuilt import create_react_agent

        with warnings.catch_warnings():  # LangGraph 1.x points to langchain.agents
            warnings.simplefilter("ignore")
            return create_react_agent(llm, tools, prompt=SYSTEM, checkpointer=InMemorySaver())
    return create_agent(llm, tools, system_prompt=SYSTEM, checkpointer=InMemorySaver())


def questions(i: int) -> list[tuple[str, str, str]]:
    """(question, tool it needs, text the answer must contain) for thread i."""
    here, there = CITIES[i], CITIES[(i + 1) % len(CITIES)]
    a, b = 12 + i, 7 + i
    return [(f"What's the weather in {here}?", "get_weather", f"{world.weather(here)['temperature']} degrees"),
            (f"What is {a} times {b}?", "multiply", str(a * b)),
            (f"How is the weather in {there} today?", "get_weather", world.weather(there)["condition"])]


@pytest.fixture(scope="module", params=[None, True], ids=["default", "async-scheduling"])
def engine(request):
    """Its own engine (stats count this test only); once as the CPU runs by default, once with
    async scheduling, the CUDA default: a step launched before the last one's tokens are read."""
    with Engine.from_pretrained("demo", progress=False, async_scheduling=request.param) as engine:
        yield engine


async def run_thread(agent, i: int) -> list:
    config = {"configurable": {"thread_id": f"t{i}"}}
    messages = []
    for question, _, _ in questions(i):
        messages = (await agent.ainvoke({"messages": [("user", question)]}, config))["messages"]
    return messages


async def test_react_agent_threads_keep_their_state_and_batch(engine):
    agent = make_agent(ChatHibana(engine=engine, max_tokens=96), [get_weather, multiply])

    threads = await asyncio.gather(*(run_thread(agent, i) for i in range(4)))

    for i, messages in enumerate(threads):
        called = [m.name for m in messages if isinstance(m, ToolMessage)]
        assert called == [needed for _, needed, _ in questions(i)], f"thread {i}: tools called {called}"
        answers = [m.content for m in messages if isinstance(m, AIMessage) and not m.tool_calls]
        assert len(answers) == 3
        for answer, (_, _, expected) in zip(answers, questions(i)):
            assert expected in answer, f"thread {i}: {answer!r} lacks {expected!r}"

        model_calls = [m for m in messages if isinstance(m, AIMessage)]
        assert len(model_calls) == 6
        assert {m.response_metadata["state_id"] for m in model_calls} == {f"t{i}/{graph_node(agent)}"}
        for n, m in enumerate(model_calls[1:], 2):
            usage = m.usage_metadata
            cached = usage["input_token_details"]["cache_read"]
            assert cached >= 0.9 * usage["input_tokens"], f"thread {i}, model call {n}: {usage}"

    assert engine.stats().multi_sequence_steps > 0
    assert engine.stats().max_batch_sequences >= 2


def graph_node(agent) -> str:
    """The node that calls the model: "agent" in LangGraph's prebuilt agent, "model" in langchain's."""
    return "agent" if "agent" in agent.nodes else "model"
