"""Audit (LlamaIndex from outside, second pass): `HibanaLLM` used as a demanding LlamaIndex user
would, held to LlamaIndex's own contracts on the bundled demo model (one engine for the module)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent  # noqa: E402
from llama_index.core.bridge.pydantic import BaseModel  # noqa: E402
from llama_index.core.memory import ChatMemoryBuffer  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

from hibana_core import Engine  # noqa: E402
from hibana_plugins.llamaindex import HibanaLLM  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        yield engine


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Total(BaseModel):
    """The answer as a number."""

    total: int


async def test_an_agents_output_cls_extraction_keeps_off_the_agents_state(engine):
    """FunctionAgent(output_cls=...) ends each run with a structured call of its own prompt (the
    conversation rewritten as XML, `generate_structured_response`) on the agent's LLM: on the bound
    state it replaced the agent's conversation with that prompt (the state held 490 tokens of XML,
    and the next run recomputed the tail its freed blocks no longer held). It runs beside it, on
    "<state_id>/structured"; the agent's state keeps its history, and its next run reuses all of it."""
    llm = HibanaLLM(engine=engine, max_tokens=48, state_id="fa-out")
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(add)], llm=llm, output_cls=Total,
                          system_prompt="You are a calculator.")
    memory = ChatMemoryBuffer.from_defaults(token_limit=100000)
    runs = []  # per run: (state, usage, the state's tokens) of each of its calls
    for question in ["Add 2 and 3", "Add 4 and 5"]:
        runs.append([])
        handler = agent.run(question, memory=memory)
        async for event in handler.stream_events():
            if isinstance(event, AgentOutput):
                runs[-1].append((event.raw["state_id"], event.raw["usage"], engine.open_state("fa-out").tokens))
        with warnings.catch_warnings():  # (a garbage answer is LlamaIndex's warning, not an error)
            warnings.simplefilter("ignore")
            result = await handler
        assert result.structured_response is not None
        assert engine.open_state("fa-out").tokens == runs[-1][-1][2]  # the history its last call left
    state_id, usage, _ = runs[1][0]
    assert state_id == "fa-out" and usage["cached_tokens"] >= len(runs[0][-1][2]) - 1
    assert engine.open_state("fa-out/structured").tokens  # the extraction's own state
    held = engine.open_state("fa-out").tokens  # a structured call of the user's own keeps off it too
    llm.structured_predict(Total, PromptTemplate("What is {a} plus {b}?"), a=2, b=3)
    assert engine.open_state("fa-out").tokens == held
