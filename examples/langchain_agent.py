"""A LangGraph ReAct agent on Hibana: several conversations at once, each keeping its KV cache resident.

    python examples/langchain_agent.py                      # the bundled demo model, on the CPU
    python examples/langchain_agent.py --model path/to/hf-checkpoint --device cuda --threads 8

The only Hibana line is the chat model: `ChatHibana(model=...)` where the agent would otherwise
get `ChatOpenAI(...)`. Each LangGraph thread gets its own resident state, named from the thread_id
and the node ("t0/model" under langchain's create_agent, "t0/agent" under LangGraph's prebuilt
create_react_agent), the threads run concurrently (asyncio) and the engine batches their turns.
The table at the end has one row per model call: from a thread's second call on, nearly the whole
prompt is read from the state (cache_read) and only the new tail is computed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import warnings
from typing import Annotated

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from hibana_core import HibanaError
from hibana_core.demo import world
from hibana_plugins.langchain import ChatHibana

SYSTEM = "You are an agent. Use the tools to answer."


# --- tools: the demo model's world (hibana_core/demo/world.py) ------------------------------------

@tool
def get_weather(city: Annotated[str, "Name of the city."]) -> str:
    """Get the current weather for a city."""
    return json.dumps(world.weather(city))


@tool
def multiply(a: Annotated[float, "The first number."], b: Annotated[float, "The second number."]) -> str:
    """Multiply two numbers and return the product."""
    return json.dumps({"result": world.fmt_number(a * b)})


@tool
def convert_units(value: Annotated[float, "The amount to convert."],
                  from_unit: Annotated[str, "Unit to convert from."],
                  to_unit: Annotated[str, "Unit to convert to."]) -> str:
    """Convert a value from one unit to another."""
    from hibana_core.demo.tools import convert

    try:
        return json.dumps(convert(value, from_unit, to_unit))
    except ValueError as exc:
        return json.dumps({"error": str(exc)})


TOOLS = [get_weather, multiply, convert_units]


def questions(thread: int) -> list[str]:
    city, other = world.CITIES[thread % 12], world.CITIES[(thread + 5) % 12]
    return [f"What's the weather in {city}?", f"What is {12 + thread} times {7 + thread}?",
            f"Convert {20 + 5 * thread} km to miles.", f"How is the weather in {other} today?"]


def make_agent(llm):
    """langchain's create_agent where installed, else LangGraph's prebuilt ReAct agent."""
    try:
        from langchain.agents import create_agent
    except ImportError:
        from langgraph.prebuilt import create_react_agent

        with warnings.catch_warnings():  # LangGraph 1.x points to langchain.agents
            warnings.simplefilter("ignore")
            return create_react_agent(llm, TOOLS, prompt=SYSTEM, checkpointer=InMemorySaver())
    return create_agent(llm, TOOLS, system_prompt=SYSTEM, checkpointer=InMemorySaver())


async def converse(agent, thread: int) -> list:
    """Ask the thread's questions one after another in one conversation; its messages at the end."""
    config = {"configurable": {"thread_id": f"t{thread}"}}
    messages: list = []
    for question in questions(thread):
        messages = (await agent.ainvoke({"messages": [("user", question)]}, config))["messages"]
    return messages


def print_conversation(thread: int, messages: list) -> None:
    print(f"--- thread t{thread}")
    for m in messages:
        if isinstance(m, ToolMessage):
            print(f"    tool {m.name} -> {m.content}")
        elif isinstance(m, AIMessage) and m.tool_calls:
            print("    calls " + ", ".join(f"{c['name']}({json.dumps(c['args'])})" for c in m.tool_calls))
        elif isinstance(m, AIMessage):
            print(f"    answer: {m.content}")
        elif m.type == "human":
            print(f"  user: {m.content}")


def print_calls(threads: list[list]) -> None:
    print(f"\n{'thread':>6} {'call':>4} {'input':>6} {'cache_read':>10} {'computed':>8} {'output':>6}")
    for thread, messages in enumerate(threads):
        calls = [m.usage_metadata for m in messages if isinstance(m, AIMessage)]
        for n, usage in enumerate(calls, 1):
            cached = usage["input_token_details"]["cache_read"]
            print(f"{'t%d' % thread:>6} {n:>4} {usage['input_tokens']:>6} "
                  f"{cached:>5} {cached / usage['input_tokens']:>4.0%} "
                  f"{usage['input_tokens'] - cached:>8} {usage['output_tokens']:>6}")


async def main(args: argparse.Namespace) -> None:
    llm = ChatHibana(model=args.model, engine_kwargs={"device": args.device, "progress": False},
                     max_tokens=args.max_tokens)
    agent = make_agent(llm)
    threads = await asyncio.gather(*(converse(agent, i) for i in range(args.threads)))
    for thread, messages in enumerate(threads):
        print_conversation(thread, messages)
    print_calls(threads)
    stats = llm.engine.stats()
    print(f"\nengine: {stats.prompt_tokens_reused} prompt tokens reused, {stats.prompt_tokens_computed} "
          f"computed; {stats.multi_sequence_steps} of {stats.steps} steps batched several threads "
          f"(at most {stats.max_batch_sequences} at once)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo",
                        help="checkpoint directory or Hugging Face repo id (default: the bundled demo model)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=4, help="concurrent conversations (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens per model call")
    arguments = parser.parse_args()
    if arguments.threads < 1:
        parser.error(f"--threads must be at least 1, got {arguments.threads}")
    try:
        asyncio.run(main(arguments))
    except HibanaError as exc:  # a model that does not load, an option out of range: one line, as the commands say it
        sys.exit(f"langchain_agent.py: {exc}")
