"""Soak test of `hibana serve`: a real server process driven for minutes by the `openai` client.

    python bench/soak_server.py --minutes 8 --clients 12            # the demo model on the CPU

The server runs as a subprocess (`python -m hibana_plugins.server MODEL`, i.e. `hibana serve`) with
a small device KV pool (`--kv-blocks`), a small host tier (`--host-kv-bytes`) and a `--state-dir`,
so that idle conversations are parked in host memory, spilled to disk and read back all the time,
and with small bounds on the states clients name and the engine makes, so that those are put away.

`--clients` threads, one `openai.OpenAI` client each, run a weighted mix of requests:

    tool        a multi-turn tool-calling conversation that goes on turn after turn (its KV resident
                between turns: `usage.prompt_tokens_details.cached_tokens` must cover the previous
                prompt), streamed or not, named by nothing, by `user` or by `X-Hibana-State`
    cancel      a long reply whose stream the client closes after a few chunks (sometimes on the
                client's named conversation, which the next turn then continues: it must not stay busy)
    abort       a client that gives up (its timeout) before the first token: the turn is cancelled
    n2          `n=2`, streamed or not: two choices, each index once
    stop        stop strings: no reply contains one
    completions `/v1/completions`: one prompt or two, streamed or not, with logprobs sometimes
    bad         bad parameters: each must be a 400 (a wrong model name a 404)
    overflow    a prompt past the context: a 400 `context_length_exceeded`
    near_limit  a prompt just inside the context with a large max_tokens: `finish_reason` "length"

Every `--sample-every` seconds it reads `/metrics`, `/v1/hibana/states` and the server's RSS, and
runs a fixed greedy request (the canary) whose reply must never change. After the load it waits
`--idle` seconds and checks that the server is back at rest: nothing in flight, queued or running,
the request counters equal to what the clients saw, the canary unchanged; then it deletes every
state and checks that no KV block, host or disk byte is left. Last, it opens streams and sends the
server SIGTERM (`--signal int`: SIGINT): the process must exit promptly, with status 0, each stream
ending either complete or with the `server_shutting_down` error event.

Exit status 1 on a hang (a request past its deadline), a 5xx, a wrong reply or status, a leak (RSS
growing past `--rss-leak-mb` after warm-up, states past their bounds, KV left after the states are
deleted, gauges not back to 0), a traceback or ERROR in the server's log, or a slow or unclean
shutdown. The summary table goes to stdout; `--json PATH` also writes every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hibana_bench.serve_load import MULTIPLY, WEATHER  # the load test's tools

# --- the conversations ---------------------------------------------------------------------------------

TOOLS = [WEATHER, MULTIPLY]
CITIES = ("Oslo", "Paris", "Rome", "Lima", "Cairo", "Quito", "Tokyo", "Nairobi", "Madrid", "Hanoi", "Bern", "Accra")
SYSTEM = "You are a helpful agent. Use the tools when they help."
OTHER_SYSTEM = "You are a helpful agent. Answer briefly."  # one-off requests': no conversation's history
CANARY_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What's the weather in Oslo?"}]
CANARY_PROMPT = "The weather in Oslo is"
MAX_CONVERSATION_TOKENS = 1200  # a conversation starts over past this many prompt tokens (the demo's context: 2048)
REPORTED_ONLY = ("reuse_miss_unnamed", "reuse_miss_user_busy")  # failure kinds that do not fail the run
REUSE_FLOOR = 0.9  # a continued conversation's cached_tokens cover at least this share of its previous prompt


def question(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"What's the weather in {rng.choice(CITIES)}?"
    return f"What is {rng.randint(2, 99)} times {rng.randint(2, 99)}?"


def tool_result(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return json.dumps({"error": "arguments are not JSON"})
    if not isinstance(args, dict):
        return json.dumps({"error": "arguments are not an object"})
    if name == "get_weather":
        city = str(args.get("city", ""))
        return json.dumps({"city": city, "temperature": 10 + len(city) % 20, "condition": "sunny"})
    a, b = args.get("a"), args.get("b")
    if name == "multiply" and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return json.dumps({"product": a * b})
    return json.dumps({"error": f"{name} cannot run on these arguments"})


# --- bookkeeping -----------------------------------------------------------------------------------------

class Failure(Exception):
    """A reply that is wrong (status, shape, content): counted under its kind."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass
class Tally:
    """What the clients saw, shared by their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: collections.Counter = field(default_factory=collections.Counter)       # (scenario, outcome)
    server_statuses: collections.Counter = field(default_factory=collections.Counter)  # (endpoint, status) the server should count
    failures: collections.Counter = field(default_factory=collections.Counter)     # kind -> count
    examples: dict = field(default_factory=dict)                                   # kind -> first detail
    latencies: dict = field(default_factory=lambda: collections.defaultdict(list))
    reuse: list = field(default_factory=list)  # (previous prompt, cached now) of continued conversations
    details: list = field(default_factory=list)  # (time, kind, detail) of the first 200 failures
    conflicts_after_cancel: int = 0
    requests: int = 0

    def outcome(self, scenario: str, outcome: str, seconds: float | None = None) -> None:
        with self.lock:
            self.outcomes[scenario, outcome] += 1
            self.requests += 1
            if seconds is not None:
                self.latencies[scenario].append(seconds)

    def expect(self, endpoint: str, status: str, count: int = 1) -> None:
        with self.lock:
            self.server_statuses[endpoint, status] += count

    def fail(self, kind: str, detail: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            self.examples.setdefault(kind, detail[:400])
            if len(self.details) < 200:
                self.details.append((round(time.time(), 1), kind, detail[:400]))


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Client(threading.Thread):
    """One agent: its own `openai.OpenAI`, its own conversation, a weighted mix of requests."""

    WEIGHTS = {"tool": 40, "cancel": 10, "n2": 8, "stop": 8, "completions": 12, "bad": 8, "overflow": 5,
               "near_limit": 3, "abort": 4}

    def __init__(self, soak: "Soak", index: int) -> None:
        super().__init__(name=f"soak-client-{index}", daemon=True)
        import openai

        self.soak, self.index = soak, index
        self.rng = random.Random(soak.args.seed * 1000 + index)
        self.openai = openai
        self.client = openai.OpenAI(base_url=soak.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=soak.args.request_timeout)
        self.current: tuple[str, float] | None = None  # (scenario, started): the watchdog's view
        self.conversation: dict[str, Any] = {}
        self.conversations = 0
        self.new_conversation()

    # --- the loop ---------------------------------------------------------------------------------------

    def run(self) -> None:
        names, weights = zip(*self.WEIGHTS.items())
        while not self.soak.stop_load.is_set():
            scenario = self.rng.choices(names, weights)[0]
            started = time.monotonic()
            self.current = (scenario, started)
            try:
                outcome = getattr(self, f"do_{scenario}")()
                self.soak.tally.outcome(scenario, outcome, time.monotonic() - started)
            except Failure as exc:
                self.soak.tally.outcome(scenario, "failed:" + exc.kind, time.monotonic() - started)
                self.soak.tally.fail(exc.kind, f"{scenario}: {exc.detail}")
            except self.openai.APITimeoutError as exc:
                self.soak.tally.outcome(scenario, "failed:hang")
                self.soak.tally.fail("hang", f"{scenario}: no reply within {self.soak.args.request_timeout} s ({exc})")
                self.new_conversation()
            except self.openai.APIStatusError as exc:
                kind = "5xx" if exc.status_code >= 500 else f"http_{exc.status_code}"
                self.soak.tally.outcome(scenario, "failed:" + kind)
                self.soak.tally.fail(kind, f"{scenario}: {exc.status_code} {str(exc)[:300]}")
                self.new_conversation()
            except Exception as exc:  # noqa: BLE001 - a connection reset, a broken stream: counted, the soak goes on
                self.soak.tally.outcome(scenario, "failed:exception")
                self.soak.tally.fail("exception", f"{scenario}: {type(exc).__name__}: {exc}"[:400])
                self.new_conversation()
            finally:
                self.current = None

    # --- the agent's conversation -------------------------------------------------------------------------

    def new_conversation(self) -> None:
        self.conversations += 1
        mode = self.rng.choice(("prefix", "prefix", "user", "header"))
        name = f"soak-{self.index}-{self.conversations}"
        old = self.conversation
        if old.get("name") and self.rng.random() < 0.5:  # forget some named ones, leave the rest to the bound
            try:
                self.client.delete(f"/hibana/states/{old['name']}", cast_to=object)
            except self.openai.APIStatusError as exc:
                if exc.status_code not in (404, 409):  # put away already, or (never here) busy
                    self.soak.tally.fail("delete_state", f"{exc.status_code} {exc}")
        self.conversation = {
            "mode": mode, "name": name if mode != "prefix" else None,
            # each conversation its own: a request whose history is another conversation's continues that
            # conversation's state (the server cannot tell them apart), which then no longer holds the other's
            "messages": [{"role": "system", "content": f"{SYSTEM} Session {self.index}-{self.conversations}."},
                         {"role": "user", "content": question(self.rng)}],
            "previous_prompt": None,  # the last turn's prompt tokens, whose KV the state holds
        }

    def naming(self) -> dict[str, Any]:
        conv = self.conversation
        if conv["mode"] == "user":
            return {"user": conv["name"]}
        if conv["mode"] == "header":
            return {"extra_headers": {"X-Hibana-State": conv["name"]}}
        return {}

    def turn_request(self, stream: bool, **extra: Any) -> Any:
        """The conversation's next turn; a 409 (its named state still held by a request the client
        closed) is waited out for a while, as an agent would retry."""
        conv = self.conversation
        deadline = time.monotonic() + 15
        while True:
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.soak.args.model, messages=conv["messages"], tools=TOOLS, max_tokens=64, stream=stream,
                    **({"stream_options": {"include_usage": True}} if stream else {}), **self.naming(), **extra)
                conv["served_by"] = raw.headers.get("x-hibana-state")
                return raw.parse()
            except self.openai.ConflictError:
                self.note_conflict(deadline)

    def note_conflict(self, deadline: float) -> None:
        """A 409 on the client's own named state: only the turn it closed a moment ago may hold it."""
        self.soak.tally.expect(CHAT, "409")
        with self.soak.tally.lock:
            self.soak.tally.conflicts_after_cancel += 1
        if time.monotonic() > deadline:
            raise Failure("stuck_busy", f"state {self.conversation['name']!r} still busy 15 s after its stream was closed")
        time.sleep(0.2)

    def do_tool(self) -> str:
        conv = self.conversation
        stream = self.rng.random() < 0.5
        extra = {}
        if self.rng.random() < 0.2:
            extra = {"temperature": 0.7, "seed": self.rng.randint(0, 1000)}
        started = time.monotonic()
        if stream:
            content, calls, usage, finish = self.read_stream(self.turn_request(True, **extra), started)
        else:
            reply = self.turn_request(False, **extra)
            choice = reply.choices[0]
            content, finish, usage = choice.message.content, choice.finish_reason, reply.usage
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in choice.message.tool_calls or ()]
        self.soak.tally.expect(CHAT, "200")
        self.check_usage(usage, stream)
        cached = usage.prompt_tokens_details.cached_tokens
        if conv["previous_prompt"] is not None:
            with self.soak.tally.lock:
                self.soak.tally.reuse.append((conv["previous_prompt"], cached))
            if cached < REUSE_FLOOR * conv["previous_prompt"]:
                # a state named by its client must come back whole (from the device, host or disk tier);
                # one the server made may have been closed past --max-unnamed-states meanwhile (reported only)
                # and a `user` names a state that may still be held by the turn whose stream the
                # client closed a moment before: the server then serves it on another (reported only)
                kind = ("reuse_miss_unnamed" if conv["mode"] == "prefix" else
                        "reuse_miss_user_busy" if conv["mode"] == "user" and conv.get("served_by") != conv["name"]
                        else "reuse_miss")
                self.soak.tally.fail(kind, f"mode {conv['mode']}: previous prompt {conv['previous_prompt']} "
                                                   f"tokens, now {usage.prompt_tokens} of which {cached} cached; served by "
                                                   f"{conv.get('served_by')!r}, previously {conv.get('previous_state')!r}")
        conv["previous_prompt"], conv["previous_state"] = usage.prompt_tokens, conv.get("served_by")
        if calls and finish == "tool_calls":
            conv["messages"].append({"role": "assistant", "content": content, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]})
            conv["messages"].extend({"role": "tool", "tool_call_id": c["id"], "content": tool_result(c["name"], c["arguments"])}
                                    for c in calls)
        else:
            conv["messages"].append({"role": "assistant", "content": content or ""})
            conv["messages"].append({"role": "user", "content": question(self.rng)})
        if usage.prompt_tokens > MAX_CONVERSATION_TOKENS:
            self.new_conversation()
        return ("streamed" if stream else "whole") + ("/call" if calls and finish == "tool_calls" else "/answer")

    def read_stream(self, stream: Any, started: float, keep: int | None = None
                    ) -> tuple[str, list[dict], Any, str | None]:
        """A chat stream's content, tool calls (assembled from their deltas), usage and finish reason;
        past the request timeout it is a hang (the client's read timeout is per chunk)."""
        content, calls, usage, finish = "", {}, None, None
        for chunk in stream:
            if time.monotonic() - started > self.soak.args.request_timeout:
                stream.close()
                raise Failure("hang", "a stream still going past the request timeout")
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                content += delta.content or ""
                for call in delta.tool_calls or ():
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.id or entry["id"]
                    if call.function is not None:
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
                finish = choice.finish_reason or finish
        if usage is None:
            raise Failure("no_usage", "a stream with include_usage ended without its usage chunk")
        return content, [calls[i] for i in sorted(calls)], usage, finish

    def check_usage(self, usage: Any, stream: bool) -> None:
        if usage is None:
            raise Failure("no_usage", f"a reply without usage (stream={stream})")
        details = usage.prompt_tokens_details
        if details is None or details.cached_tokens is None:
            raise Failure("no_cached_tokens", "usage without prompt_tokens_details.cached_tokens")
        if not 0 <= details.cached_tokens <= usage.prompt_tokens:
            raise Failure("cached_tokens", f"cached_tokens {details.cached_tokens} of {usage.prompt_tokens} prompt tokens")
        if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
            raise Failure("usage_sum", f"{usage}")

    # --- the other requests ---------------------------------------------------------------------------------

    def do_cancel(self) -> str:
        on_conversation = self.rng.random() < 0.5 and self.conversation["mode"] != "prefix"
        if on_conversation:  # the agent gives up on a turn and sends the same history again next
            messages, naming = self.conversation["messages"], {**self.naming(), "tools": TOOLS}
        else:
            messages = [{"role": "system", "content": OTHER_SYSTEM},
                        {"role": "user", "content": f"Tell me a long story about {self.rng.choice(CITIES)}."}]
            naming = {}
        deadline = time.monotonic() + 15
        while True:  # a 409: the state is still held by the turn this client closed just before
            try:
                stream = self.client.chat.completions.create(
                    model=self.soak.args.model, messages=messages, max_tokens=400, stream=True,
                    extra_body={"ignore_eos": True}, **naming)
                break
            except self.openai.ConflictError:
                self.note_conflict(deadline)
        chunks = 0
        for _ in stream:
            chunks += 1
            if chunks >= self.rng.randint(1, 4):
                break
        stream.close()
        self.soak.tally.expect(CHAT, "499")  # (a 200 where the whole reply came first: `check_counters` allows it)
        return "on_conversation" if on_conversation else "fresh"

    def do_abort(self) -> str:
        """A client that gives up before the first token (its timeout): the server must cancel the turn."""
        messages = [{"role": "system", "content": OTHER_SYSTEM},
                    {"role": "user", "content": self.long_text(self.rng.randint(300, 900))}]
        stream = self.rng.random() < 0.5
        try:
            reply = self.client.with_options(timeout=0.02).chat.completions.create(
                model=self.soak.args.model, messages=messages, max_tokens=300, stream=stream)
            if stream:
                reply.close()
        except self.openai.APITimeoutError:
            self.soak.tally.expect(CHAT, "499")  # (a 200 where the server answered first)
            return "gone"
        self.soak.tally.expect(CHAT, "499")  # answered in time, or closed by the client: either count
        return "answered"

    def do_n2(self) -> str:
        messages = [{"role": "system", "content": OTHER_SYSTEM}, {"role": "user", "content": question(self.rng)}]
        stream = self.rng.random() < 0.5
        extra = {"temperature": 0.8, "seed": self.rng.randint(0, 1000)} if self.rng.random() < 0.5 else {}
        if stream:
            seen, started = set(), time.monotonic()
            usage = None
            for chunk in self.client.chat.completions.create(
                    model=self.soak.args.model, messages=messages, tools=TOOLS, max_tokens=48, n=2, stream=True,
                    stream_options={"include_usage": True}, **extra):
                if time.monotonic() - started > self.soak.args.request_timeout:
                    raise Failure("hang", "an n=2 stream still going past the request timeout")
                usage = chunk.usage or usage
                seen.update(choice.index for choice in chunk.choices)
            if seen != {0, 1}:
                raise Failure("n2_choices", f"streamed n=2 gave choice indexes {sorted(seen)}")
            self.check_usage(usage, True)
        else:
            reply = self.client.chat.completions.create(model=self.soak.args.model, messages=messages, tools=TOOLS,
                                                        max_tokens=48, n=2, **extra)
            if sorted(c.index for c in reply.choices) != [0, 1]:
                raise Failure("n2_choices", f"n=2 gave choice indexes {[c.index for c in reply.choices]}")
            self.check_usage(reply.usage, False)
        self.soak.tally.expect(CHAT, "200")
        return "streamed" if stream else "whole"

    def do_stop(self) -> str:
        city = self.rng.choice(CITIES)
        messages = [{"role": "system", "content": OTHER_SYSTEM}, {"role": "user", "content": f"What's the weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": tool_result("get_weather", json.dumps({"city": city}))}]
        stops = self.rng.choice((["sunny"], [" degrees", city], ["."], ["\n", "it"]))
        stream = self.rng.random() < 0.5
        if stream:
            content, _, usage, finish = self.read_stream(self.client.chat.completions.create(
                model=self.soak.args.model, messages=messages, tools=TOOLS, max_tokens=48, stop=stops, stream=True,
                stream_options={"include_usage": True}), time.monotonic())
        else:
            reply = self.client.chat.completions.create(model=self.soak.args.model, messages=messages, tools=TOOLS,
                                                        max_tokens=48, stop=stops)
            content, usage = reply.choices[0].message.content or "", reply.usage
        self.check_usage(usage, stream)
        if any(s in (content or "") for s in stops):
            raise Failure("stop_leaked", f"stop {stops} in the reply {content!r}")
        self.soak.tally.expect(CHAT, "200")
        return "streamed" if stream else "whole"

    def do_completions(self) -> str:
        prompts: Any = f"The weather in {self.rng.choice(CITIES)} is"
        if self.rng.random() < 0.3:
            prompts = [prompts, f"{self.rng.randint(2, 99)} times {self.rng.randint(2, 99)} is"]
        count = len(prompts) if isinstance(prompts, list) else 1
        stream = self.rng.random() < 0.5
        extra = {"logprobs": 2} if self.rng.random() < 0.3 else {}
        max_tokens = self.rng.randint(8, 40)
        if stream:
            seen, finished, started = set(), 0, time.monotonic()
            for chunk in self.client.completions.create(model=self.soak.args.model, prompt=prompts, max_tokens=max_tokens,
                                                        stream=True, **extra):
                if time.monotonic() - started > self.soak.args.request_timeout:
                    raise Failure("hang", "a completions stream still going past the request timeout")
                for choice in chunk.choices:
                    seen.add(choice.index)
                    finished += choice.finish_reason is not None
            if seen != set(range(count)) or finished != count:
                raise Failure("completions_choices", f"{count} prompts streamed indexes {sorted(seen)}, {finished} finished")
        else:
            reply = self.client.completions.create(model=self.soak.args.model, prompt=prompts, max_tokens=max_tokens, **extra)
            if sorted(c.index for c in reply.choices) != list(range(count)):
                raise Failure("completions_choices", f"{count} prompts gave indexes {[c.index for c in reply.choices]}")
            if reply.usage.completion_tokens > count * max_tokens:
                raise Failure("completions_usage", f"{reply.usage.completion_tokens} tokens for {count} x {max_tokens}")
            if extra and any(c.logprobs is None or len(c.logprobs.tokens) == 0 for c in reply.choices):
                raise Failure("completions_logprobs", "logprobs asked, none given")
        self.soak.tally.expect(COMPLETIONS, "200")
        return "streamed" if stream else "whole"

    BAD = (  # (what, endpoint, keyword arguments, expected status)
        ("n_over_64", CHAT, {"n": 65}, 400),
        ("temperature_5", CHAT, {"temperature": 5}, 400),
        ("max_tokens_0", CHAT, {"max_tokens": 0}, 400),
        ("max_tokens_huge", CHAT, {"max_tokens": 10**6}, 400),
        ("top_logprobs_no_logprobs", CHAT, {"top_logprobs": 3}, 400),
        ("unknown_field", CHAT, {"extra_body": {"not_a_field": 1}}, 400),
        ("tool_choice_unknown", CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
        ("too_many_stops", CHAT, {"stop": [f"s{i}" for i in range(65)]}, 400),
        ("empty_messages", CHAT, {"messages": []}, 400),
        ("tool_without_id", CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}, 400),
        ("n2_with_header", CHAT, {"n": 2, "extra_headers": {"X-Hibana-State": "soak-n2"}}, 400),
        ("wrong_model", CHAT, {"model": "no-such-model"}, 404),
        ("completions_bad_token", COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400),
        ("completions_logprobs_9", COMPLETIONS, {"logprobs": 9}, 400),
    )

    def do_bad(self) -> str:
        what, endpoint, kwargs, status = self.rng.choice(self.BAD)
        kwargs = {"model": self.soak.args.model, **kwargs}
        try:
            if endpoint == CHAT:
                kwargs.setdefault("messages", [{"role": "user", "content": "Hello"}])
                self.client.chat.completions.create(max_tokens=kwargs.pop("max_tokens", 8), **kwargs)
            else:
                kwargs.setdefault("prompt", "Hello")
                self.client.completions.create(max_tokens=8, **kwargs)
        except self.openai.APIStatusError as exc:
            if exc.status_code != status:
                raise Failure("wrong_status", f"{what}: {exc.status_code} where {status} was due: {exc}") from None
            self.soak.tally.expect(endpoint, str(status))
            return what
        raise Failure("wrong_status", f"{what}: 200 where {status} was due")

    def long_text(self, tokens: int) -> str:
        words = max(1, int(tokens / self.soak.tokens_per_word))
        return " ".join(f"{CITIES[i % len(CITIES)].lower()}{i % 97}" for i in range(words))

    def do_overflow(self) -> str:
        completions = self.rng.random() < 0.3
        text = self.long_text(self.soak.context * 1.4)
        try:
            if completions:
                self.client.completions.create(model=self.soak.args.model, prompt=text, max_tokens=8)
            else:
                self.client.chat.completions.create(model=self.soak.args.model, max_tokens=8, stream=self.rng.random() < 0.5,
                                                    messages=[{"role": "user", "content": text}])
        except self.openai.BadRequestError as exc:
            code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
            if code != "context_length_exceeded":
                raise Failure("overflow_code", f"400 with code {code!r}: {exc}") from None
            self.soak.tally.expect(COMPLETIONS if completions else CHAT, "400")
            return "completions" if completions else "chat"
        raise Failure("overflow_accepted", "a prompt past the context was served")

    def do_near_limit(self) -> str:
        text = self.long_text(self.soak.context * 0.85)
        reply = self.client.completions.create(model=self.soak.args.model, prompt=text, max_tokens=self.soak.context)
        choice = reply.choices[0]
        if reply.usage.prompt_tokens >= self.soak.context:
            raise Failure("near_limit_calibration", f"{reply.usage.prompt_tokens} prompt tokens")
        if reply.usage.prompt_tokens + reply.usage.completion_tokens > self.soak.context:
            raise Failure("near_limit_overrun", f"{reply.usage} past the context {self.soak.context}")
        if choice.finish_reason not in ("length", "stop"):
            raise Failure("near_limit_finish", f"finish_reason {choice.finish_reason!r}")
        self.soak.tally.expect(COMPLETIONS, "200")
        return choice.finish_reason


# --- the server, its figures and the run -----------------------------------------------------------------------

def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    figures = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            figures[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return figures


def figure(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class Sample:
    t: float
    rss_mb: float
    in_flight: float
    running: float
    queued: float
    kv_used: float
    kv_cached: float
    kv_total: float
    states: float
    host_bytes: float
    disk_bytes: float
    parks: float
    resumes: float
    spills: float
    disk_resumes: float
    requests: float
    tiers: dict


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tally = Tally()
        self.stop_load = threading.Event()
        self.samples: list[Sample] = []
        self.problems: list[str] = []    # what fails the run, besides the tally's failures
        self.notes: list[str] = []       # what is reported only
        self.log_lines: list[str] = []
        self.url = ""
        self.process: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.context = 2048
        self.tokens_per_word = 2.0
        self.canary: tuple | None = None

    # --- the server process ---------------------------------------------------------------------------------

    def start_server(self, state_dir: str) -> None:
        a = self.args
        command = [sys.executable, "-m", "hibana_plugins.server", a.model, "--port", "0", "--device", "cpu",
                   "--dtype", "float32", "--state-dir", state_dir, "--max-named-states", str(a.max_named_states),
                   "--shutdown-timeout", str(a.shutdown_timeout), "--option", f"kv_device_blocks={a.kv_blocks}",
                   "--option", f"host_kv_bytes={a.host_kv_bytes}", "--option", f"max_unnamed_states={a.max_unnamed_states}",
                   *a.server_arg]
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env, bufsize=1, errors="replace")
        threading.Thread(target=self.read_log, daemon=True).start()
        if not self.ready.wait(a.start_timeout):
            raise SystemExit(f"the server did not start within {a.start_timeout} s:\n" + "".join(self.log_lines[-30:]))
        if self.process.poll() is not None:
            raise SystemExit("the server exited at start:\n" + "".join(self.log_lines[-30:]))

    def read_log(self) -> None:
        log = open(self.args.log, "w") if self.args.log else None
        for line in self.process.stdout:
            self.log_lines.append(line)
            if log:
                log.write(line)
                log.flush()
            found = re.search(r"serving .* on (http://\S+)/v1", line)
            if found and not self.url:
                self.url = found.group(1)
                self.ready.set()
        if log:
            log.close()
        self.ready.set()  # it ended: no longer waited for

    def get(self, path: str, timeout: float = 30) -> Any:
        import httpx

        reply = httpx.get(self.url + path, timeout=timeout)
        reply.raise_for_status()
        return reply

    def sample(self) -> Sample:
        import psutil

        metrics = parse_metrics(self.get("/metrics").text)
        states = self.get("/v1/hibana/states").json()["data"]
        rss = psutil.Process(self.process.pid).memory_info().rss / 2**20
        requests = sum(value for (name, _), value in metrics.items() if name == "hibana_requests_total")
        return Sample(
            t=time.monotonic(), rss_mb=rss, in_flight=figure(metrics, "hibana_requests_in_flight"),
            running=figure(metrics, "hibana_requests_running"), queued=figure(metrics, "hibana_requests_queued"),
            kv_used=figure(metrics, "hibana_kv_blocks", kind="used"), kv_cached=figure(metrics, "hibana_kv_blocks", kind="cached"),
            kv_total=figure(metrics, "hibana_kv_blocks", kind="total"), states=figure(metrics, "hibana_states"),
            host_bytes=figure(metrics, "hibana_kv_bytes", tier="host"), disk_bytes=figure(metrics, "hibana_kv_bytes", tier="disk"),
            parks=figure(metrics, "hibana_kv_moves", kind="parks"), resumes=figure(metrics, "hibana_kv_moves", kind="resumes"),
            spills=figure(metrics, "hibana_kv_moves", kind="spills"),
            disk_resumes=figure(metrics, "hibana_kv_moves", kind="disk_resumes"), requests=requests,
            tiers=dict(collections.Counter(state["tier"] for state in states)))

    # --- fixed checks -----------------------------------------------------------------------------------------

    def canary_reply(self) -> tuple:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                               timeout=self.args.request_timeout)
        chat = client.chat.completions.create(model=self.args.model, messages=CANARY_MESSAGES, tools=TOOLS, max_tokens=40)
        text = client.completions.create(model=self.args.model, prompt=CANARY_PROMPT, max_tokens=24)
        self.tally.expect(CHAT, "200")
        self.tally.expect(COMPLETIONS, "200")
        message = chat.choices[0].message
        return (message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or ()],
                text.choices[0].text)

    def check_canary(self, when: str) -> None:
        try:
            reply = self.canary_reply()
        except Exception as exc:  # noqa: BLE001
            self.problems.append(f"canary {when}: {type(exc).__name__}: {exc}")
            return
        if self.canary is None:
            self.canary = reply
        elif reply != self.canary:
            self.problems.append(f"canary {when}: the fixed greedy request's reply changed: {reply!r} (first: {self.canary!r})")

    def calibrate(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=self.args.request_timeout)
        words = " ".join(f"{CITIES[i % len(CITIES)].lower()}{i % 97}" for i in range(200))
        reply = client.completions.create(model=self.args.model, prompt=words, max_tokens=1)
        self.tally.expect(COMPLETIONS, "200")
        self.tokens_per_word = reply.usage.prompt_tokens / 200
        self.context = self.args.context

    # --- the run ------------------------------------------------------------------------------------------------

    def run(self) -> int:
        with tempfile.TemporaryDirectory(prefix="hibana-soak-") as state_dir:
            self.start_server(state_dir)
            try:
                return self.soak(state_dir)
            finally:
                if self.process.poll() is None:
                    self.process.kill()
                    self.process.wait()

    def soak(self, state_dir: str) -> int:
        a = self.args
        self.calibrate()
        self.check_canary("at start")
        self.samples.append(self.sample())
        clients = [Client(self, i) for i in range(a.clients)]
        started = time.monotonic()
        for client in clients:
            client.start()
        load_seconds = a.minutes * 60
        progress = self.progress(load_seconds)
        next_sample = started + a.sample_every
        while (now := time.monotonic()) < started + load_seconds:
            time.sleep(min(1.0, started + load_seconds - now))
            if progress is not None:
                progress.n = round(min(time.monotonic() - started, load_seconds))
                progress.set_postfix(requests=self.tally.requests, failures=sum(self.tally.failures.values()),
                                     refresh=False)
                progress.refresh()
            if time.monotonic() >= next_sample:
                next_sample += a.sample_every
                self.during_load(clients)
        self.stop_load.set()
        for client in clients:
            client.join(a.request_timeout + 30)
            if client.is_alive():
                self.tally.fail("hang", f"{client.name} still in {client.current} after the load ended")
        if progress is not None:
            progress.close()
        load_end = self.sample()
        self.samples.append(load_end)
        time.sleep(a.idle)
        idle = self.sample()
        self.samples.append(idle)
        self.check_at_rest(idle, load_end)
        self.check_canary("at end")
        self.check_counters()
        self.check_leaks(started)
        self.check_baseline()
        self.shutdown(state_dir)
        self.check_log()
        return self.report(started)

    def progress(self, total: float) -> Any:
        if self.args.no_progress:
            return None
        from tqdm import tqdm

        return tqdm(total=round(total), desc="soak", unit="s", file=sys.stderr, mininterval=1.0)

    def during_load(self, clients: list[Client]) -> None:
        try:
            sample = self.sample()
        except Exception as exc:  # noqa: BLE001
            self.problems.append(f"sampling failed under load: {type(exc).__name__}: {exc}")
            return
        self.samples.append(sample)
        self.check_canary(f"at {sample.t - self.samples[0].t:.0f} s")
        bound = self.args.max_named_states + self.args.max_unnamed_states + 3 * self.args.clients
        if sample.states > bound:
            self.problems.append(f"{sample.states:.0f} states held, more than the bounds allow ({bound})")
        if sample.in_flight > 2 * self.args.clients or sample.running > 4 * self.args.clients:
            self.problems.append(f"in flight {sample.in_flight:.0f}, running {sample.running:.0f} with "
                                 f"{self.args.clients} clients")
        if sample.kv_used > sample.kv_total:
            self.problems.append(f"KV blocks used {sample.kv_used:.0f} > total {sample.kv_total:.0f}")
        for client in clients:  # a request past its deadline whose client has not noticed
            current = client.current
            if current and time.monotonic() - current[1] > self.args.request_timeout + 30:
                self.tally.fail("hang", f"{client.name}: {current[0]} running for {time.monotonic() - current[1]:.0f} s")

    def check_at_rest(self, idle: Sample, load_end: Sample) -> None:
        for name, value in (("requests_in_flight", idle.in_flight), ("requests_running", idle.running),
                            ("requests_queued", idle.queued)):
            if value != 0:
                self.problems.append(f"hibana_{name} is {value:.0f} after {self.args.idle} s idle, not 0")
        busy = idle.tiers  # (tiers only; busy flags are read in check_baseline)
        del busy

    def check_counters(self) -> None:
        """The server's request counters against what the clients saw, endpoint by endpoint. A stream
        the client closed counts 499, or 200 where its reply was whole by then."""
        metrics = parse_metrics(self.get("/metrics").text)
        server = collections.Counter()
        for (name, labels), value in metrics.items():
            if name == "hibana_requests_total":
                labels = dict(labels)
                server[labels["endpoint"], labels["status"]] += int(value)
        expected = self.tally.server_statuses
        lost = sum(self.tally.failures[k] for k in ("hang", "exception", "5xx"))
        for endpoint in {e for e, _ in expected} | {e for e, _ in server}:
            want = {s: n for (e, s), n in expected.items() if e == endpoint}
            got = {s: n for (e, s), n in server.items() if e == endpoint}
            if want == got:
                continue
            # a closed stream whose reply had ended before the server saw the close: 200, not 499
            closed_whole = want.get("499", 0) - got.get("499", 0)
            if closed_whole > 0 and got.get("200", 0) - want.get("200", 0) == closed_whole and \
                    {s: n for s, n in got.items() if s not in ("200", "499")} == \
                    {s: n for s, n in want.items() if s not in ("200", "499")}:
                self.notes.append(f"{endpoint}: {closed_whole} closed streams counted 200 (whole before the close)")
                continue
            message = f"{endpoint}: the server counted {dict(sorted(got.items()))}, the clients saw {dict(sorted(want.items()))}"
            (self.notes if lost else self.problems).append(message)
        self.server_counts = server

    def check_leaks(self, started: float) -> None:
        load = [s for s in self.samples if s.t >= started]
        if len(load) < 3:
            self.notes.append("too few samples under load for a leak check")
            return
        warm = load[max(1, len(load) // 4)]  # after warm-up: a quarter into the run
        end = self.samples[-1]
        growth = end.rss_mb - warm.rss_mb
        allowed = max(self.args.rss_leak_mb, 0.25 * warm.rss_mb)
        if growth > allowed:
            self.problems.append(f"RSS grew {growth:.0f} MiB after warm-up ({warm.rss_mb:.0f} -> {end.rss_mb:.0f} MiB), "
                                 f"more than {allowed:.0f} MiB: a leak")
        later = [s for s in load if s.t >= warm.t]
        if len(later) >= 3:
            ts = [s.t - later[0].t for s in later]
            slope = statistics.linear_regression(ts, [s.rss_mb for s in later]).slope * 60
            self.rss_slope = slope
        for name in ("host_bytes", "disk_bytes"):
            peak = max(getattr(s, name) for s in load)
            if name == "host_bytes" and peak > parse_size(self.args.host_kv_bytes):
                self.problems.append(f"the host tier held {peak:.0f} bytes, past its {self.args.host_kv_bytes}")

    def check_baseline(self) -> None:
        """Every state deleted, the engine holds no block, no host or disk byte and no state."""
        import httpx

        states = self.get("/v1/hibana/states").json()["data"]
        self.states_at_end = len(states)
        busy = [s["id"] for s in states if s["busy"]]
        if busy:
            self.problems.append(f"states still busy after the idle wait: {busy[:5]}")
        for state in states:
            reply = httpx.delete(f"{self.url}/v1/hibana/states/{quote(state['id'])}", timeout=30)
            if reply.status_code not in (200, 404):
                self.problems.append(f"DELETE state {state['id']!r}: {reply.status_code} {reply.text[:200]}")
        time.sleep(1)
        after = self.sample()
        self.samples.append(after)
        self.baseline = after
        if after.kv_used or after.states or after.host_bytes or after.disk_bytes:
            self.problems.append(f"after every state was deleted: {after.kv_used:.0f} KV blocks used, {after.states:.0f} "
                                 f"states, host {after.host_bytes:.0f} B, disk {after.disk_bytes:.0f} B (all due 0)")

    def shutdown(self, state_dir: str) -> None:
        """Streams open, then SIGTERM (or SIGINT): the process ends within the shutdown timeout and a
        margin, status 0; each stream ends complete or with the shutting-down error event."""
        import openai

        a = self.args
        ends: list[str] = []
        first = threading.Barrier(a.shutdown_streams + 1, timeout=a.request_timeout)

        def stream(i: int) -> None:
            client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=a.request_timeout)
            got = 0
            try:
                for _ in client.chat.completions.create(
                        model=a.model, max_tokens=1500, stream=True, extra_body={"ignore_eos": True},
                        extra_headers={"X-Hibana-State": f"soak-shutdown-{i}"},
                        messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}]):
                    got += 1
                    if got == 1:
                        first.wait()
                ends.append("complete")
            except openai.APIError as exc:
                ends.append("shutting_down" if "server_shutting_down" in str(exc) or "shutting down" in str(exc).lower()
                            else f"error: {exc}"[:200])
            except Exception as exc:  # noqa: BLE001
                ends.append(f"{type(exc).__name__}: {exc}"[:200])
            finally:
                if got == 0:
                    first.abort()

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(a.shutdown_streams)]
        for thread in threads:
            thread.start()
        try:
            first.wait()
        except threading.BrokenBarrierError:
            self.problems.append("shutdown: the streams did not start")
        sig = signal.SIGINT if a.signal == "int" else signal.SIGTERM
        sent = time.monotonic()
        self.process.send_signal(sig)
        try:
            code = self.process.wait(a.shutdown_timeout + a.exit_margin)
        except subprocess.TimeoutExpired:
            code = None
        self.exit_seconds = time.monotonic() - sent
        for thread in threads:
            thread.join(10)
        self.shutdown_ends = ends
        self.exit_code = code
        if code is None:
            self.problems.append(f"shutdown: still running {a.shutdown_timeout + a.exit_margin:.0f} s after {sig.name}")
        elif code != 0:
            self.problems.append(f"shutdown: exit status {code} after {sig.name}")
        bad = [end for end in ends if end not in ("complete", "shutting_down")]
        if bad or len(ends) != a.shutdown_streams:
            self.problems.append(f"shutdown: the open streams ended {ends}")
        kept = [n for n in os.listdir(state_dir) if "soak-shutdown" in n] if os.path.isdir(state_dir) else []
        self.state_files = len(os.listdir(state_dir)) if os.path.isdir(state_dir) else 0
        if code == 0 and not kept and not any("soak-shutdown" in line for line in self.log_lines[-50:]):
            self.notes.append(f"shutdown: no file of the streams' named states in --state-dir ({os.listdir(state_dir)[:5]})")

    def check_log(self) -> None:
        time.sleep(0.2)
        bad, warnings = [], collections.Counter()
        for i, line in enumerate(self.log_lines):
            if line.startswith(("Traceback", "ERROR", "CRITICAL")) or ":ERROR:" in line[:40] or line.startswith("ERROR:"):
                bad.append("".join(self.log_lines[i:i + 12]))
            elif line.startswith("WARNING"):
                warnings[re.sub(r"\d+", "N", line.strip())[:200]] += 1
        self.log_warnings = warnings
        if bad:
            self.problems.append(f"{len(bad)} tracebacks / ERROR lines in the server's log; the first:\n{bad[0]}")

    # --- the report ---------------------------------------------------------------------------------------------

    def report(self, started: float) -> int:
        t = self.tally
        first, peak = self.samples[0], max(self.samples, key=lambda s: s.rss_mb)
        load = [s for s in self.samples if started <= s.t]
        rows = [
            ("minutes of load", f"{self.args.minutes:g}"),
            ("clients", str(self.args.clients)),
            ("requests", str(t.requests)),
            ("outcomes", ", ".join(f"{s}/{o}={n}" for (s, o), n in sorted(t.outcomes.items()))),
            ("failures", ", ".join(f"{k}={n}" for k, n in sorted(t.failures.items())) or "none"),
            ("409s waited out after a closed stream", str(t.conflicts_after_cancel)),
            ("RSS MiB start / peak / end", f"{first.rss_mb:.0f} / {peak.rss_mb:.0f} / {self.samples[-1].rss_mb:.0f}"),
            ("RSS slope after warm-up", f"{getattr(self, 'rss_slope', float('nan')):+.1f} MiB/min"),
            ("states start / max / after idle", f"{first.states:.0f} / {max(s.states for s in load):.0f} / "
                                                f"{getattr(self, 'states_at_end', -1)}"),
            ("KV blocks used start / max / idle / after delete",
             f"{first.kv_used:.0f} / {max(s.kv_used for s in load):.0f} / {self.samples[-2].kv_used:.0f} / "
             f"{self.baseline.kv_used:.0f} (of {first.kv_total:.0f})"),
            ("KV moves parks / resumes / spills / disk reads",
             f"{self.samples[-1].parks:.0f} / {self.samples[-1].resumes:.0f} / {self.samples[-1].spills:.0f} / "
             f"{self.samples[-1].disk_resumes:.0f}"),
            ("max in flight / running / queued", f"{max(s.in_flight for s in load):.0f} / {max(s.running for s in load):.0f}"
                                                 f" / {max(s.queued for s in load):.0f}"),
            ("continued turns: reuse >= 90% of previous prompt",
             f"{sum(c >= REUSE_FLOOR * p for p, c in t.reuse)} of {len(t.reuse)}"),
            ("latency p50 / p95 s", ", ".join(f"{k}={statistics.median(v):.2f}/{quantile(v, 0.95):.2f}"
                                              for k, v in sorted(t.latencies.items()) if v)),
            ("shutdown", f"{self.args.signal.upper()}: exit {getattr(self, 'exit_code', None)} in "
                         f"{getattr(self, 'exit_seconds', float('nan')):.1f} s; streams {getattr(self, 'shutdown_ends', [])}"),
            ("server log warnings", "; ".join(f"{n}x {w}" for w, n in self.log_warnings.most_common(5)) or "none"),
        ]
        width = max(len(k) for k, _ in rows)
        print("\nsoak of hibana serve " + self.args.model)
        for key, value in rows:
            print(f"  {key:<{width}}  {value}")
        print("  samples (t s, RSS MiB, in flight, running, queued, KV used, states, host KiB, disk KiB, tiers):")
        for s in self.samples:
            print(f"    {s.t - first.t:6.0f} {s.rss_mb:7.0f} {s.in_flight:3.0f} {s.running:3.0f} {s.queued:3.0f} "
                  f"{s.kv_used:5.0f} {s.states:4.0f} {s.host_bytes / 1024:7.0f} {s.disk_bytes / 1024:7.0f} {s.tiers}")
        for kind, example in sorted(t.examples.items()):
            print(f"  first {kind}: {example}")
        for note in self.notes:
            print(f"  note: {note}")
        failed = [k for k in t.failures if k not in self.args.tolerate and k not in REPORTED_ONLY]
        for problem in self.problems:
            print(f"  PROBLEM: {problem}")
        if self.args.json:
            with open(self.args.json, "w") as out:
                json.dump({"rows": dict(rows), "failures": dict(t.failures), "examples": t.examples, "details": t.details,
                           "problems": self.problems, "notes": self.notes,
                           "samples": [s.__dict__ for s in self.samples],
                           "server_counts": {f"{e} {s}": n for (e, s), n in getattr(self, "server_counts", {}).items()}},
                          out, indent=1, default=str)
        ok = not failed and not self.problems
        print("PASS" if ok else f"FAIL ({', '.join(failed + [p.split(':')[0] for p in self.problems])})")
        return 0 if ok else 1


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def quote(state_id: str) -> str:
    import urllib.parse

    return urllib.parse.quote(state_id, safe="")


def parse_size(text: str) -> float:
    found = re.fullmatch(r"\s*([\d.]+)\s*([KMG]i?B?|B)?\s*", str(text), re.I)
    if not found:
        return float("inf")
    unit = (found.group(2) or "B").upper().rstrip("B").rstrip("I")
    return float(found.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=8.0, help="minutes of load (default 8)")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients, one thread each (default 12)")
    p.add_argument("--model", default="demo", help="MODEL of `hibana serve` (default: the bundled demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-every", type=float, default=20.0, help="seconds between samples of /metrics and RSS")
    p.add_argument("--idle", type=float, default=20.0, help="seconds of idle after the load before the at-rest checks")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may take before it is a hang")
    p.add_argument("--kv-blocks", type=int, default=256, help="device KV blocks of the server (small: states are parked)")
    p.add_argument("--host-kv-bytes", default="4MiB", help="the host tier (small: parked states spill to disk)")
    p.add_argument("--max-named-states", type=int, default=8)
    p.add_argument("--max-unnamed-states", type=int, default=48)
    p.add_argument("--context", type=int, default=2048, help="the model's context (the demo's: 2048)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, help="the server's --shutdown-timeout")
    p.add_argument("--exit-margin", type=float, default=20.0, help="seconds past the shutdown timeout the exit may take")
    p.add_argument("--shutdown-streams", type=int, default=3, help="streams open when the stop signal is sent")
    p.add_argument("--signal", choices=("term", "int"), default="term")
    p.add_argument("--rss-leak-mb", type=float, default=150.0, help="RSS growth after warm-up that counts as a leak")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--tolerate", nargs="*", default=[], help="failure kinds reported but not failing the run")
    p.add_argument("--server-arg", action="append", default=[], help="another argument for `hibana serve`; repeatable")
    p.add_argument("--log", help="write the server's log here")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    return Soak(build_parser().parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
