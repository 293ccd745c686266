"""Audit (parsers 2): a LangGraph run cancelled while its model node streams (stream_mode
"messages": a chat UI's stop, a client gone), and the next run on its thread started at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain.agents")

from langchain.agents import create_agent  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402

from hibana_core import Engine  # noqa: E402
from hibana_core.demo import world  # noqa: E402
from hibana_plugins.langchain import ChatHibana  # noqa: E402


@tool
def get_weather(city: Annotated[str, "Name of the city."]) -> str:
    """Get the current weather for a city."""
    return json.dumps(world.weather(city))


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", progress=False) as engine:
        yield engine


@pytest.mark.parametrize("leave", ["cancel", "break"])
@pytest.mark.parametrize("state_id", [None, "agent-7"], ids=["thread", "state_id"])
async def test_the_next_run_of_a_thread_gets_the_state_a_cancelled_run_streamed_on(engine, leave, state_id):
    """The cancelled run's model call held its state until LangGraph cancelled its node, which it does
    once the consumer's cancellation (or the generator's close, after a `break`) has gone through
    the graph's own clean-up, a few loop turns later: the next run, started meanwhile, found the state
    held by a call whose task was neither done nor cancelled, and its model call went to another state
    (the thread's id: the prompt computed again there) or raised StateBusyError (a state_id). A call
    of a later step of the thread now waits for the earlier step's call to let the state go."""
    agent = create_agent(ChatHibana(engine=engine, max_tokens=200, state_id=state_id), [get_weather],
                         system_prompt="You are an agent. Use the tools to answer.", checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": f"t-{leave}-{state_id}"}}
    await agent.ainvoke({"messages": [("user", "What's the weather in Paris?")]}, config)
    streaming = asyncio.Event()

    async def consume():
        async for _ in agent.astream({"messages": [("user", "And in Lisbon, and in Osaka?")]}, config,
                                     stream_mode="messages"):
            streaming.set()
            if leave == "break":
                break
    run = asyncio.create_task(consume())
    await streaming.wait()
    if leave == "cancel":
        run.cancel()
    served = {state.id for state in engine.states()}
    out = await agent.ainvoke({"messages": [("user", "What's the weather in Osaka?")]}, config)
    with contextlib.suppress(asyncio.CancelledError):
        await run
    calls = [m for m in out["messages"] if isinstance(m, AIMessage)][-2:]
    expected = state_id or f"{config['configurable']['thread_id']}/model"
    assert [m.response_metadata["state_id"] for m in calls] == [expected] * 2
    assert {state.id for state in engine.states()} == served  # no other state made for it
    assert not any(state.busy for state in engine.states())
