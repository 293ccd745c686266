"""LlamaIndex agents on Hibana: two FunctionAgents in one Workflow, on one engine, each keeping its
KV cache resident between its LLM calls.

    python examples/llamaindex_workflow.py                  # the bundled demo model, on the CPU
    python examples/llamaindex_workflow.py --model path/to/hf-checkpoint --device cuda

Each agent is a FunctionAgent on its own `HibanaLLM(engine=engine, state_id=<agent>)`: one engine
(weights, KV pool, step loop) shared by all, one resident state per agent. The workflow runs both
agents at once, so the engine batches their steps, and streams their tool calls as they happen.
The table at the end has one row per LLM call: from an agent's second call on, nearly the whole
prompt comes from its state and only the new tail (tool result, next question) is computed.

With a model that follows instructions, the same agents go into
`AgentWorkflow(agents=[...], root_agent=...)` and hand off to each other; the 7M demo model was
not trained to hand off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import warnings

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.tools import FunctionTool
from llama_index.core.workflow import Context, Event, StartEvent, StopEvent, Workflow, step

from hibana_core import Engine
from hibana_core.demo import world
from hibana_plugins.llamaindex import HibanaLLM

# the memory each run is given again (Desk.work) is left out of the context between runs: said once, not per run
warnings.filterwarnings("ignore", message="Skipping serialization of known unserializable key: memory")

QUESTIONS = {
    "calculator": ["What is 12 plus 30, then times 5?", "What is 100 plus 23?", "Multiply 7 by 6."],
    "weather": ["What's the weather where Ana Garcia lives?", "What's the weather in Oslo?"],
}


# --- tools: the demo model's world (hibana_core/demo/world.py) ------------------------------------

def add_numbers(a: float, b: float) -> str:
    """Add two numbers and return the sum."""
    return json.dumps({"result": world.fmt_number(a + b)})


def multiply_numbers(a: float, b: float) -> str:
    """Multiply two numbers and return the product."""
    return json.dumps({"result": world.fmt_number(a * b)})


def find_home_city(name: str) -> str:
    """Find the city where a person lives."""
    return json.dumps(world.home_city(name))


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return json.dumps(world.weather(city))


def make_agents(engine: Engine) -> dict[str, FunctionAgent]:
    def agent(name: str, *functions) -> FunctionAgent:
        tools = [FunctionTool.from_defaults(f, description=f.__doc__) for f in functions]
        llm = HibanaLLM(engine=engine, state_id=name)          # one resident state per agent
        return FunctionAgent(name=name, tools=tools, llm=llm, system_prompt="You are a helpful assistant.")

    return {"calculator": agent("calculator", add_numbers, multiply_numbers),
            "weather": agent("weather", find_home_city, get_weather)}


# --- the workflow: one job per agent, run concurrently ------------------------------------------------

class AgentJob(Event):
    agent: str
    questions: list[str]


class AgentDone(Event):
    agent: str
    answers: list[str]
    usage: list[dict]        # one per LLM call, in order


class Progress(Event):
    line: str


class Desk(Workflow):
    def __init__(self, agents: dict[str, FunctionAgent], **kwargs) -> None:
        super().__init__(**kwargs)
        self.agents = agents

    @step
    async def dispatch(self, ctx: Context, ev: StartEvent) -> AgentJob | None:
        for name, questions in ev.jobs.items():
            ctx.send_event(AgentJob(agent=name, questions=questions))
        return None

    @step(num_workers=4)
    async def work(self, ctx: Context, ev: AgentJob) -> AgentDone:
        """One agent answers its questions in one conversation: each run is given the same memory
        (a Context alone does not keep it: LlamaIndex's workflows serialise the context between
        runs and leave the memory out, with an UnserializableKeyWarning)."""
        agent = self.agents[ev.agent]
        agent_ctx = Context(agent)
        memory = ChatMemoryBuffer.from_defaults(llm=agent.llm)
        answers, usage = [], []
        for question in ev.questions:
            ctx.write_event_to_stream(Progress(line=f"[{ev.agent}] user: {question}"))
            handler = agent.run(question, ctx=agent_ctx, memory=memory)
            async for event in handler.stream_events():
                if isinstance(event, ToolCallResult):
                    ctx.write_event_to_stream(Progress(
                        line=f"[{ev.agent}]   {event.tool_name}({event.tool_kwargs}) -> {event.tool_output.content}"))
                elif isinstance(event, AgentOutput) and isinstance(event.raw, dict) and "usage" in event.raw:
                    usage.append(event.raw["usage"])
            answer = str((await handler).response.content)
            ctx.write_event_to_stream(Progress(line=f"[{ev.agent}] agent: {answer}"))
            answers.append(answer)
        return AgentDone(agent=ev.agent, answers=answers, usage=usage)

    @step
    async def collect(self, ctx: Context, ev: AgentDone) -> StopEvent | None:
        done = ctx.collect_events(ev, [AgentDone] * len(self.agents))
        return None if done is None else StopEvent(result={d.agent: d for d in done})


def print_table(results: dict[str, AgentDone]) -> None:
    print(f"\n{'agent':<11} {'call':>4} {'prompt':>7} {'reused':>7} {'computed':>9} {'reused %':>9}")
    for name, done in results.items():
        for n, u in enumerate(done.usage, 1):
            prompt, reused = u["prompt_tokens"], u["cached_tokens"]
            print(f"{name:<11} {n:>4} {prompt:>7} {reused:>7} {prompt - reused:>9} {reused / prompt:>9.1%}")


async def main(model: str, device: str) -> None:
    with Engine.from_pretrained(model, device=device, progress=False) as engine:
        desk = Desk(make_agents(engine), timeout=600)
        handler = desk.run(jobs=QUESTIONS)
        async for event in handler.stream_events():
            if isinstance(event, Progress):
                print(event.line)
        print_table(await handler)
        stats = engine.stats()
        print(f"\nengine: {stats.prompt_tokens_reused} prompt tokens reused, {stats.prompt_tokens_computed} "
              f"computed; {stats.steps} steps, {stats.multi_sequence_steps} of them batching both agents")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args()
    asyncio.run(main(args.model, args.device))
