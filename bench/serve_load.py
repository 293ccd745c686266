"""`hibana bench serve`: N clients in tool loops over HTTP against `hibana serve` on the loopback
address, and the same workload in process, side by side (issue 19's bounded load test).

Each client runs one scripted conversation of M turns (one chat completion a turn, streamed) with
two tools: a turn that calls tools gets their results next, a turn that answers gets the next
question. The tools answer from their arguments alone, so a conversation depends only on what the
model writes: greedy, every conversation over HTTP must be the in-process one, turn for turn.

    in process: asyncio tasks on `Chat.astream_respond`, one named state per client
    over HTTP:  the `openai` SDK in processes of its own (its JSON and sockets do not share the
                server's interpreter; `client_processes` of them, each running its share of the
                clients on one event loop, so that on a fast GPU the clients' parsing of every
                chunk does not pace the run), the server in a thread beside the engine; requests
                name no state, so the server finds each conversation's state by its prefix

Time to first token is to the first delta in process and to the first chunk over HTTP. Each run
has an engine of its own; afterwards every state is closed and the KV pool must hold no block.
Each run also reports the engine's steps in it: how many, the tokens generated per step and the
wall time per step, which tell a server whose steps are slower (its threads holding the GIL while
the step loop wants it) from one that keeps fewer requests in each step (time spent between turns).

Greedy outputs are the same over HTTP only where the arithmetic is exact whatever the batch: in
float32. In bfloat16 a request's logits depend on which requests share its step, and the two runs
batch differently, so conversations may part ways; the report says so (`exact`) and the check is
only made in float32.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hibana_core.engine import Engine, EngineStats

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Name of the city."}},
                   "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two numbers and return the product.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, MULTIPLY]
CITIES = ("Oslo", "Paris", "Rome", "Lima", "Cairo", "Quito", "Tokyo", "Nairobi", "Madrid", "Hanoi")


@dataclass(frozen=True)
class ServeLoadConfig:
    clients: int = 64      # concurrent conversations
    turns: int = 20        # chat completions per conversation
    max_tokens: int = 64   # per turn
    client_processes: int = 1  # processes the HTTP clients are spread over, one SDK event loop each


# --- the scripted conversation ----------------------------------------------------------------------

def question(client: int, k: int) -> str:
    """The k-th question of a client: weather and products, alternating, different per client."""
    if k % 2 == 0:
        return f"What's the weather in {CITIES[(client + k // 2) % len(CITIES)]}?"
    return f"What is {client % 9 + 2} times {k + 3}?"


def tool_result(name: str, arguments: dict) -> str:
    """What a tool returns: from its arguments alone, so both runs feed back the same text."""
    if name == "get_weather":
        city = str(arguments.get("city", ""))
        return json.dumps({"city": city, "temperature": 10 + len(city) % 20, "condition": "sunny"})
    a, b = arguments.get("a"), arguments.get("b")
    if name == "multiply" and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return json.dumps({"product": a * b})
    return json.dumps({"error": f"{name} cannot run on these arguments"})


@dataclass(frozen=True)
class Turn:
    text: str
    calls: tuple[tuple[str, str], ...]   # (name, arguments as JSON), in order
    ttft: float                          # seconds from the request to its first delta or chunk
    seconds: float                       # the whole turn


@dataclass
class Conversation:
    """One client's conversation; `reply` appends a turn's reply and what follows it."""

    client: int
    asked: int = 1
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages.append({"role": "user", "content": question(self.client, 0)})

    def reply(self, text: str, calls: list[tuple[str, str, dict]]) -> None:
        """`calls`: (id, name, arguments) of the turn's tool calls."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}} for i, name, args in calls]
        self.messages.append(message)
        if calls:
            self.messages += [{"role": "tool", "tool_call_id": i, "content": tool_result(name, args)}
                              for i, name, args in calls]
        else:
            self.messages.append({"role": "user", "content": question(self.client, self.asked)})
            self.asked += 1


def _turn(text: str, calls: list[tuple[str, str, dict]], start: float, first: float | None) -> Turn:
    end = time.perf_counter()
    return Turn(text, tuple((name, json.dumps(args, sort_keys=True)) for _, name, args in calls),
                (first or end) - start, end - start)


@dataclass
class Run:
    """One system's run: each client's turns (None where it failed), its errors, the wall time,
    and the CPU time of the engine's process and of the clients' own (over HTTP), which on a
    machine with few cores share them."""

    seconds: float
    turns: list[list[Turn] | None]
    errors: list[str]
    cpu_seconds: float = 0.0
    client_cpu_seconds: float = 0.0
    steps: int = 0                # the engine's steps during the run
    generated_tokens: int = 0     # tokens they generated
    step_seconds: float = 0.0     # their wall time, summed

    def summary(self) -> dict:
        turns = [t for client in self.turns if client for t in client]
        ttfts, whole = sorted(t.ttft for t in turns), sorted(t.seconds for t in turns)
        return {"turns": len(turns), "seconds": self.seconds, "turns_per_hour": len(turns) / self.seconds * 3600,
                "ttft_p50_s": _percentile(ttfts, 0.5), "ttft_p95_s": _percentile(ttfts, 0.95),
                "turn_p50_s": _percentile(whole, 0.5), "errors": len(self.errors),
                "cpu_s": self.cpu_seconds, "client_cpu_s": self.client_cpu_seconds, "steps": self.steps,
                "tokens_per_step": self.generated_tokens / max(self.steps, 1),
                "step_ms": 1000 * self.step_seconds / max(self.steps, 1)}

    def count_steps(self, before: "EngineStats", after: "EngineStats") -> "Run":
        """The engine's steps between `before` and `after` (stats taken around the run)."""
        self.steps = after.steps - before.steps
        self.generated_tokens = after.generated_tokens - before.generated_tokens
        self.step_seconds = after.step_seconds - before.step_seconds
        return self


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.median(values) if q == 0.5 else values[min(len(values) - 1, int(q * len(values)))]


async def _gather(clients: list, first: int = 0) -> tuple[list[list[Turn] | None], list[str]]:
    """Each client's turns (None where it failed) and the failures; `first`: the first client's number."""
    done = await asyncio.gather(*clients, return_exceptions=True)
    errors = [f"client {i}: {type(r).__name__}: {r}" for i, r in enumerate(done, first) if isinstance(r, BaseException)]
    return [None if isinstance(r, BaseException) else r for r in done], errors


# --- in process -------------------------------------------------------------------------------------

async def in_process_client(engine: "Engine", client: int, cfg: ServeLoadConfig, prefix: str = "bench") -> list[Turn]:
    from hibana_core import SamplingParams

    chat, conversation, turns = engine.chat(f"{prefix}-{client}"), Conversation(client), []
    params = SamplingParams(max_tokens=cfg.max_tokens)
    for _ in range(cfg.turns):
        start, first, result = time.perf_counter(), None, None
        async for delta in chat.astream_respond(conversation.messages, tools=TOOLS, params=params):
            first, result = first or time.perf_counter(), delta.result or result
        calls = [(c.id, c.name, c.arguments) for c in result.tool_calls]
        text = result.text.removesuffix(result.cut_call)  # as OpenAI's content carries it
        turns.append(_turn(text, calls, start, first))
        conversation.reply(text, calls)
    return turns


def run_in_process(engine: "Engine", cfg: ServeLoadConfig) -> Run:
    async def clients() -> Run:
        start, cpu = time.perf_counter(), time.process_time()
        turns, errors = await _gather([in_process_client(engine, i, cfg) for i in range(cfg.clients)])
        return Run(time.perf_counter() - start, turns, errors, time.process_time() - cpu)
    return asyncio.run(clients())


# --- over HTTP (in the clients' own process) --------------------------------------------------------

async def http_client(client: Any, model: str, index: int, cfg: ServeLoadConfig) -> list[Turn]:
    conversation, turns = Conversation(index), []
    for _ in range(cfg.turns):
        start, first, text, calls = time.perf_counter(), None, "", {}
        stream = await client.chat.completions.create(model=model, messages=conversation.messages, tools=TOOLS,
                                                      max_tokens=cfg.max_tokens, stream=True)
        async for chunk in stream:
            first = first or time.perf_counter()
            delta = chunk.choices[0].delta if chunk.choices else None
            text += (delta and delta.content) or ""
            for piece in (delta and delta.tool_calls) or ():
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = call["id"] or piece.id or ""
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        parsed = [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        turns.append(_turn(text, parsed, start, first))
        conversation.reply(text, parsed)
    return turns


def run_http_clients(url: str, model: str, cfg: ServeLoadConfig, indices: range, start: Any) -> Run:
    """The clients numbered `indices` (the entry point of one clients' process), timed from when
    every clients' process is warmed (`start`: a barrier they all wait at)."""
    import openai

    async def clients() -> Run:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600.0) as client:
            await client.models.list()  # the connection pool and the SDK warmed, untimed
            start.wait()
            began, cpu = time.perf_counter(), time.process_time()
            turns, errors = await _gather([http_client(client, model, i, cfg) for i in indices], indices.start)
            return Run(time.perf_counter() - began, turns, errors, client_cpu_seconds=time.process_time() - cpu)
    return asyncio.run(clients())


def run_over_http(engine: "Engine", model: str, cfg: ServeLoadConfig) -> Run:
    from hibana_plugins.server import ServerConfig, serving

    n = min(cfg.client_processes, cfg.clients)
    bounds = [cfg.clients * k // n for k in range(n + 1)]
    spawn = multiprocessing.get_context("spawn")
    with serving(engine, ServerConfig(model)) as url, spawn.Manager() as manager, \
            ProcessPoolExecutor(n, mp_context=spawn) as pool:
        start = manager.Barrier(n)
        cpu = time.process_time()  # the server's and the engine's (the clients' processes start idle)
        runs = [job.result() for job in [pool.submit(run_http_clients, url, model, cfg, range(a, b), start)
                                         for a, b in zip(bounds, bounds[1:])]]
        return Run(max(run.seconds for run in runs), [t for run in runs for t in run.turns],
                   [e for run in runs for e in run.errors], time.process_time() - cpu,
                   sum(run.client_cpu_seconds for run in runs))


def server_stack() -> str:
    """What uvicorn serves on here: it takes httptools' HTTP parser and uvloop's event loop where
    they are installed, else h11 and asyncio's loop (pure Python, more of the GIL per chunk)."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"uvicorn on {http} and {'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'}"


# --- both, side by side -----------------------------------------------------------------------------

def warm_up(engine: "Engine") -> None:
    """One turn on a state closed afterwards: the first forward and the tool grammar's compilation
    stay out of the timed run."""
    asyncio.run(in_process_client(engine, 0, ServeLoadConfig(clients=1, turns=1), prefix="warm-up"))
    close_states(engine)


def close_states(engine: "Engine") -> int:
    """Close every state; the KV blocks still in use afterwards (leaked: 0 expected)."""
    for info in engine.states():
        engine.open_state(info.id).close()
    return engine.stats().kv_blocks_used


def serve_load(open_engine: "Any", model: str, cfg: ServeLoadConfig, exact: bool = True) -> dict:
    """Both runs, each on an engine `open_engine()` makes; the figures and the checks. `exact`:
    whether greedy outputs must be equal in both runs (float32; module docstring)."""
    runs, leaked = {}, {}
    for system in ("in_process", "server"):
        with open_engine() as engine:
            warm_up(engine)
            before = engine.stats()
            run = run_in_process(engine, cfg) if system == "in_process" else run_over_http(engine, model, cfg)
            runs[system] = run.count_steps(before, engine.stats())
            leaked[system] = close_states(engine)
    local, served = runs["in_process"], runs["server"]
    mismatched = [i for i, (a, b) in enumerate(zip(local.turns, served.turns))
                  if a is None or b is None or [(t.text, t.calls) for t in a] != [(t.text, t.calls) for t in b]]
    results = {system: run.summary() for system, run in runs.items()}
    served_rate = results["server"]["turns_per_hour"]  # 0 where every client over HTTP failed: see the errors
    return {"config": asdict(cfg), "model": model, "exact": exact, "server_stack": server_stack(),
            "results": results, "leaked_blocks": leaked,
            "errors": local.errors + served.errors, "mismatched_clients": mismatched,
            "server_overhead": results["in_process"]["turns_per_hour"] / served_rate - 1 if served_rate else None,
            "differences": [_first_difference(i, local.turns[i], served.turns[i]) for i in mismatched[:5]]}


def _first_difference(client: int, local: list[Turn] | None, served: list[Turn] | None) -> dict:
    """Where a client's conversation over HTTP first left the in-process one."""
    pairs = zip(local or (), served or ())
    turn = next((k for k, (a, b) in enumerate(pairs) if (a.text, a.calls) != (b.text, b.calls)),
                min(len(local or ()), len(served or ())))
    def at(turns: list[Turn] | None) -> Any:
        return [turns[turn].text, turns[turn].calls] if turns and turn < len(turns) else None
    return {"client": client, "turn": turn, "in_process": at(local), "server": at(served)}


def print_serve_load(report: dict) -> None:
    cfg = report["config"]
    print(f"serve, {report['model']}: {cfg['clients']} clients x {cfg['turns']} tool-loop turns "
          f"(max_tokens {cfg['max_tokens']}; over HTTP from {cfg['client_processes']} clients' process(es)), greedy; "
          f"the server: {report['server_stack']}")
    header = ("system", "turns", "turns/h", "ttft p50", "ttft p95", "turn p50", "errors", "leaked", "engine cpu",
              "client cpu", "steps", "tok/step", "step ms")
    print("".join(f"{h:>12}" for h in header))
    for system, r in report["results"].items():
        seconds = [f"{r[key]:.3f}s" if r[key] == r[key] else "-" for key in ("ttft_p50_s", "ttft_p95_s", "turn_p50_s")]
        cells = (system, r["turns"], f"{r['turns_per_hour']:.0f}", *seconds, r["errors"], report["leaked_blocks"][system],
                 f"{r['cpu_s']:.1f}s", f"{r['client_cpu_s']:.1f}s", r["steps"], f"{r['tokens_per_step']:.1f}",
                 f"{r['step_ms']:.2f}")
        print("".join(f"{c:>12}" for c in cells))
    equal = cfg["clients"] - len(report["mismatched_clients"])
    caveat = "" if report["exact"] else (" (not checked: outside float32 the two runs' batches round "
                                         "differently, so greedy outputs may part ways)")
    overhead = report["server_overhead"]
    print(f"conversations equal over HTTP and in process: {equal}/{cfg['clients']}{caveat}; "
          f"server overhead per turn: {'-' if overhead is None else f'{100 * overhead:+.1f}%'}")
    for error in report["errors"][:5]:
        print(f"error: {error}")
    for d in report["differences"]:
        print(f"client {d['client']}, turn {d['turn']}: in process {d['in_process']!r:.200}, "
              f"over HTTP {d['server']!r:.200}")
