"""Record `hibana demo`'s agents as a trace: `python -m hibana_bench.record_demo_trace`.

The agents get the very tasks and tools `hibana demo --seed S` gives them (`agent_work`) and run
the same tool loop through the chat layer, greedy, on the bundled demo model, one agent after
another (greedy output does not depend on batching, and one at a time keeps the run simple).
After each model turn the state holds the turn's prompt followed by its completion: the last
`completion_tokens` tokens are the output, and what the prompt adds to the previous history is
the turn's input (the chat layer keeps the model's own tokens, so the prompt always extends it;
a turn where it does not stops the recording with an error).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hibana_bench.traces import TRACES_DIR, Trace, describe, make_trace, save_trace

DESCRIPTION = ("hibana demo's agents on the bundled demo model: each agent asks its tasks one after another in one "
               "conversation (question, tool call, tool result, answer), greedy; tool calls and answers copy names "
               "and values from the prompt")


def record_agent(engine, agent: int, n_tasks: int, seed: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """One agent's conversation as (input, output) token-id turns."""
    from hibana_core.chat import Chat, assistant_message
    from hibana_core.config import SamplingParams
    from hibana_core.demo.evaluate import MAX_ROUNDS, run_tool
    from hibana_core.demo.run import SYSTEM, agent_work

    work, tools = agent_work(seed, agent, n_tasks)
    chat = Chat(engine, f"record-agent-{agent}")
    schemas = [t.schema for t in tools]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    history: list[int] = []
    turns = []
    for task in work:
        messages.append({"role": "user", "content": task.question})
        for _ in range(MAX_ROUNDS):
            result = chat.respond(messages, schemas, params)
            held = chat.handle.tokens
            n = result.usage.completion_tokens
            prompt, output = held[:len(held) - n], held[len(held) - n:]
            if prompt[:len(history)] != history:
                raise RuntimeError(f"agent {agent}: the prompt of turn {len(turns)} does not extend the history "
                                   "(the chat layer re-tokenized it); a trace needs appended inputs")
            turns.append((prompt[len(history):], output))
            history = held
            messages.append(assistant_message(result))
            if not result.tool_calls:
                break
            for call in result.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(tools, call.name, call.arguments)})
    chat.handle.close()
    return turns


def record(agents: int, n_tasks: int, seed: int, max_tokens: int) -> Trace:
    from hibana_core import Engine

    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off") as engine:  # plain greedy
        conversations = [record_agent(engine, i, n_tasks, seed, max_tokens) for i in range(agents)]
        tokenizer = f"hibana demo model (hibana_core/demo/model/tokenizer.json, {len(engine.tokenizer)} ids)"
    command = (f"python -m hibana_bench.record_demo_trace --agents {agents} --tasks {n_tasks} --seed {seed} "
               f"--max-tokens {max_tokens}")
    return make_trace("demo", DESCRIPTION, command, tokenizer, conversations)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hibana_bench.record_demo_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=8, help="as hibana demo --agents (default 8)")
    p.add_argument("--tasks", type=int, default=3, help="as hibana demo --tasks (default 3)")
    p.add_argument("--seed", type=int, default=0, help="as hibana demo --seed (default 0)")
    p.add_argument("--max-tokens", type=int, default=160, help="as hibana demo --max-tokens (default 160)")
    p.add_argument("--out", type=Path, default=TRACES_DIR / "demo.json.gz")
    args = p.parse_args(argv)
    trace = record(args.agents, args.tasks, args.seed, args.max_tokens)
    size = save_trace(trace, args.out)
    print(f"{args.out}: {describe(trace)}, {size / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
