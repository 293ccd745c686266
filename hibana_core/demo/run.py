"""`hibana demo`: agents solving tasks in real tool loops, their KV cache resident between turns.

Each agent is a thread with its own state and its own tools (names it never saw in training),
and asks its tasks one after another in one conversation:

    user question -> model turn -> <tool_call> -> Python tool runs -> result -> model turn -> answer

The engine batches all agents' turns into one step loop. The closing table has one row per turn
number (the n-th model turn of every agent): prompt tokens, how many were reused from the state,
how many computed, tokens generated and the speed of generation.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hibana_core.config import SamplingParams
from hibana_core.demo import corpus, tasks
from hibana_core.demo.evaluate import MAX_ROUNDS, run_tool
from hibana_core.demo.tasks import Task
from hibana_core.demo.tools import Tool

SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class TurnRecord:
    agent: int
    turn: int              # 1-based: the n-th model turn of this agent's conversation
    prompt_tokens: int
    history_tokens: int    # tokens the state held before the turn
    reused: int
    generated: int
    seconds: float

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.reused


@dataclass
class AgentView:
    """What the live display shows for one agent; written by its thread."""

    task: int = 0
    status: str = "waiting"
    turns: int = 0
    generated: int = 0
    solved: list[bool] = field(default_factory=list)


def agent_work(seed: int, agent: int, n_tasks: int) -> tuple[list[Task], list[Tool]]:
    """The agent's tasks and its tools: each task's tools plus a few it does not need."""
    rng = random.Random(f"demo:{seed}:{agent}")
    box = corpus.ToolBox(rng, held_out=True)
    work = [tasks.make_task(rng, kind, box) for kind in corpus.pick_kinds(rng, n_tasks)]
    box.add_distractors(rng.randint(1, 2))
    return work, box.tools()


def run_agent(engine, agent: int, work: list[Task], tools: list[Tool], params: SamplingParams,
              view: AgentView, records: list[TurnRecord]) -> None:
    from hibana_core.chat import Chat, assistant_message

    chat = Chat(engine, f"demo-agent-{agent}")
    schemas = [t.schema for t in tools]
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for number, task in enumerate(work, 1):
        view.task = number
        messages.append({"role": "user", "content": task.question})
        answer = None
        for _ in range(MAX_ROUNDS):
            view.status = "thinking"
            held, started = len(chat.handle), time.perf_counter()
            result = chat.respond(messages, schemas, params)
            view.turns += 1
            view.generated += result.usage.completion_tokens
            records.append(TurnRecord(agent, view.turns, result.usage.prompt_tokens, held, result.usage.cached_tokens,
                                      result.usage.completion_tokens, time.perf_counter() - started))
            messages.append(assistant_message(result))
            if not result.tool_calls:
                answer = result.text
                break
            for call in result.tool_calls:
                view.status = f"calling {call.name}"
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(tools, call.name, call.arguments)})
        view.solved.append(answer is not None and all(k in answer for k in task.answer_keys))
    view.status = "done"


@dataclass(frozen=True)
class AgentFailure:
    agent: int
    task: int                    # 1-based: the task the agent was on
    error: BaseException

    def describe(self, tasks: int) -> str:
        """One line for stderr, with what to do where the demo's own options are the cause."""
        from hibana_core import ContextLengthError

        line = f"agent {self.agent} failed at task {self.task} of {tasks}: {type(self.error).__name__}: {self.error}"
        if isinstance(self.error, ContextLengthError):  # every task of an agent is one conversation
            line += (f"; each agent asks its tasks in one conversation, whose history outgrew the model's context "
                     f"by task {self.task}: give fewer --tasks")
        return line


@dataclass
class DemoResult:
    views: list[AgentView]
    records: list[TurnRecord]    # sorted by turn, then agent
    seconds: float
    errors: list[AgentFailure]

    @property
    def solved(self) -> int:
        return sum(sum(v.solved) for v in self.views)


def run_demo(engine, agents: int = 8, n_tasks: int = 3, seed: int = 0, max_tokens: int = 160,
             on_tick: Callable[[list[AgentView], float], None] | None = None) -> DemoResult:
    """Run the agents, one thread each, until all are done; `on_tick` sees the views ~10 times a second."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    views = [AgentView() for _ in range(agents)]
    records: list[TurnRecord] = []
    errors: list[AgentFailure] = []

    def work(i: int) -> None:
        try:
            run_agent(engine, i, *agent_work(seed, i, n_tasks), params, views[i], records)
        except Exception as exc:  # reported once the others finish
            views[i].status = f"failed: {type(exc).__name__}"  # the whole error goes to stderr at the end
            errors.append(AgentFailure(i, views[i].task, exc))

    threads = [threading.Thread(target=work, args=(i,), name=f"demo-agent-{i}") for i in range(agents)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if on_tick is not None:
            on_tick(views, time.perf_counter() - started)
        time.sleep(0.1)
    records.sort(key=lambda r: (r.turn, r.agent))
    return DemoResult(views, records, time.perf_counter() - started, errors)


# --- display ------------------------------------------------------------------------------------

def live_table(views: list[AgentView], n_tasks: int, elapsed: float):
    from rich.table import Table

    table = Table(title=f"hibana demo: {len(views)} agents, {elapsed:4.1f}s", title_justify="left")
    for column in ("agent", "task", "status", "turns", "generated", "solved"):
        table.add_column(column, justify="left" if column == "status" else "right")
    for i, v in enumerate(views):
        marks = "".join("✓" if ok else "✗" for ok in v.solved)
        table.add_row(str(i), f"{v.task}/{n_tasks}", v.status, str(v.turns), str(v.generated), marks)
    return table


def per_turn_rows(records: list[TurnRecord]) -> list[tuple[str, ...]]:
    rows = []
    for turn in sorted({r.turn for r in records}):
        group = [r for r in records if r.turn == turn]
        rows.append(_row(str(turn), group))
    rows.append(_row("all", records))
    return rows


def _row(label: str, group: list[TurnRecord]) -> tuple[str, ...]:
    prompt, reused = sum(r.prompt_tokens for r in group), sum(r.reused for r in group)
    generated, seconds = sum(r.generated for r in group), sum(r.seconds for r in group)
    later = [r for r in group if r.history_tokens]   # a first turn reuses only other agents' prefix
    held = sum(r.history_tokens for r in later)
    of_held = f"{sum(min(r.reused, r.history_tokens) for r in later) / held:.1%}" if held else "-"
    return (label, str(len(group)), str(prompt), str(reused), str(prompt - reused), f"{reused / max(1, prompt):.1%}",
            of_held, str(generated), f"{generated / max(seconds, 1e-9):.1f}")


TURN_COLUMNS = ("turn", "agents", "prompt", "reused", "computed", "reused %", "of held", "generated", "tok/s")


def print_summary(console, result: DemoResult, engine, tasks: int) -> None:
    from rich.table import Table

    table = Table(*TURN_COLUMNS, title="model turns (reused %: of the prompt; of held: of the tokens the state "
                  "held; tok/s: per agent)", title_justify="left")
    for row in per_turn_rows(result.records):
        table.add_row(*row)
    console.print(table)
    generated = sum(r.generated for r in result.records)
    stats = engine.stats()
    console.print(f"tasks solved: {result.solved}/{tasks}; {generated} tokens generated in {result.seconds:.1f}s "
                  f"({generated / result.seconds:.1f} tok/s over all agents); engine steps: {stats.steps}, "
                  f"most agents in one step: {stats.max_batch_sequences}", markup=False, highlight=False)
    spec = stats.speculation or {}
    if stats.verify_steps:
        console.print(f"speculation {spec.get('default')}: {stats.draft_tokens_accepted}/{stats.draft_tokens_proposed} "
                      f"drafts accepted in {stats.verify_steps} verify steps, "
                      f"{spec.get('tokens_per_verify') or 0:.2f} tokens per verifying agent and step",
                      markup=False, highlight=False)


# --- command line -------------------------------------------------------------------------------

def parse_speculation(value: str) -> str | dict:
    """ "adaptive" | "off" | METHOD[:K] -> the engine's `speculation` option (an argparse type: a K
    that is no count is a usage error, not adaptive speculation under another name)."""
    if value in ("adaptive", "off"):
        return value
    method, colon, k = value.partition(":")
    if colon and not k.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: K must be a number of tokens, as in suffix:4")
    from hibana_plugins.manager import get_plugin_manager

    registered = sorted(get_plugin_manager().drafters())
    if method not in registered:
        raise argparse.ArgumentTypeError(f"{value!r}: no drafter {method!r} is registered; give adaptive, off or "
                                          f"METHOD[:K] with METHOD one of {', '.join(registered)}")
    return {"method": method, "k": int(k)} if colon else {"method": method}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hibana demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=8, help="concurrent agents (default 8)")
    p.add_argument("--tasks", type=int, default=3, help="tasks per agent (default 3)")
    p.add_argument("--seed", type=int, default=0, help="picks the tasks and tools")
    p.add_argument("--model", default="demo", help="checkpoint directory or Hugging Face repo id (default: the "
                   "bundled demo model; the tasks need a model trained on them)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--max-tokens", type=int, default=160, help="most tokens per model turn (default 160)")
    p.add_argument("--no-live", action="store_true", help="no live view, only the final table")
    p.add_argument("--speculation", default="adaptive", type=parse_speculation,
                   help='"adaptive" (default), "off", or METHOD[:K] (e.g. suffix:4, ngram, draft_model:4)')
    p.add_argument("--draft-model", metavar="PATH", help="the draft checkpoint of --speculation draft_model[:K] "
                   "(a smaller model with the same tokenizer)")
    return p


def main(argv=None, started: float | None = None) -> int:
    """`started`: when the process started (time.time()), for the cold-start figure; None: now,
    or when the OS says this process started."""
    from hibana_core.coldstart import measure, process_start_time

    started = started or process_start_time() or time.time()
    p = build_parser()
    args = p.parse_args(argv)
    if args.agents < 1 or args.tasks < 1:
        p.error("--agents and --tasks must be at least 1")
    if args.max_tokens < 1:  # a turn of no tokens solves nothing (the adapters and the server refuse 0 too)
        p.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.max_tokens >= 2**63:  # SamplingParams' bound, said now rather than as "hibana: ..." after the load
        p.error(f"--max-tokens must be a 64-bit integer, got {args.max_tokens} (a turn ends at the model's context "
                "anyway)")
    drafting = isinstance(args.speculation, dict) and args.speculation["method"] == "draft_model"
    if drafting != (args.draft_model is not None):
        p.error("--speculation draft_model[:K] needs --draft-model PATH (a smaller checkpoint with the model's "
                "tokenizer)" if drafting else "--draft-model goes with --speculation draft_model[:K]")
    if drafting:
        args.speculation = {**args.speculation, "draft_model": args.draft_model}
    from rich.console import Console
    from rich.live import Live

    from hibana_core import CheckpointError, ConfigError, HibanaError

    console = Console(width=None if sys.stdout.isatty() else 120)
    try:
        cold, engine = measure(args.model, started, device=args.device, progress=sys.stderr.isatty(),
                               speculation=args.speculation)
    except HibanaError as exc:
        print(f"hibana demo: {exc}", file=sys.stderr)  # as every command's errors: not in the output
        return 2 if isinstance(exc, (ConfigError, CheckpointError)) else 1  # an option's value: a usage error
    with engine:
        try:  # a model the chat layer cannot talk to (no chat template): said once, before any agent runs
            from hibana_core.chat import Chat
            if not Chat(engine).renders_tools():
                print(f"hibana demo: {args.model} cannot run the demo's agents: they call tools, and this model's chat "
                      "template renders none (the model would never see them)", file=sys.stderr)
                return 1
        except HibanaError as exc:
            print(f"hibana demo: {args.model} cannot run the demo's agents: {exc}", file=sys.stderr)
            return 1
        if console.is_terminal and not args.no_live:
            with Live(live_table([], args.tasks, 0.0), console=console, refresh_per_second=8) as live:
                result = run_demo(engine, args.agents, args.tasks, args.seed, args.max_tokens,
                                  lambda views, t: live.update(live_table(views, args.tasks, t)))
                live.update(live_table(result.views, args.tasks, result.seconds))
        else:
            result = run_demo(engine, args.agents, args.tasks, args.seed, args.max_tokens)
            console.print(live_table(result.views, args.tasks, result.seconds))
        print_summary(console, result, engine, args.agents * args.tasks)
        console.print(cold.describe(), markup=False, highlight=False)
    for failure in result.errors:  # on stderr, as every command's errors
        print(f"hibana demo: {failure.describe(args.tasks)}", file=sys.stderr)
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
