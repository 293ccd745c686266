"""One assistant turn: the requests that produce it on a state, and the result it comes to.

A turn is a plan of stages. A stage writes text into the turn, then generates; the runner sends
one request per stage on the same state, and reads everything written and generated through the
tool parser's stream, so a turn the chat layer helped write parses and streams like one the
model wrote alone.

    free ("auto", "none"):  [prefill] -> generate
    forced ("required"/"any", or a tool's name), hermes syntax shown:
        '<tool_call>\n{"name": "'      -> generate up to '"', snapped to a tool name  (unless named)
        'get_weather", "arguments":'   -> generate the arguments and the end of the call
      or, on a flat argument schema (`guided`), value by value:
        ' {"city": "'                  -> generate up to '"', parsed as the value's type
        'Paris"}}\n</tool_call>'       the value as JSON, the call's end and the end-of-turn token:
                                          synced, nothing generated

Small models then always produce a call that parses and has the schema's keys; the values are
still the model's. A parser whose call syntax is not in SYNTAX gets the tools rendered and decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Generator, Iterator, Sequence, TypeVar

from hibana_core.config import SamplingParams
from hibana_core.errors import ChatTimeoutError, HibanaError
from hibana_plugins.hookspecs import ParsedOutput, ToolCall, ToolCallDelta, ToolCallStream

if TYPE_CHECKING:
    from hibana_core.state import StateHandle, StreamEvent

MALFORMED = "malformed_tool_call"
NAME_TOKENS = 24                   # most tokens for a forced call's tool name


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int        # prompt tokens whose KV the state already held (SyncStats.reused)
    completion_tokens: int


@dataclass(frozen=True)
class ChatResult:
    text: str                 # content outside tool calls; a malformed call's text stays where it stood
    tool_calls: list[ToolCall]  # the calls that parsed, exactly those the stream sent
    finish_reason: str        # "tool_calls", "stop", "length", "malformed_tool_call", "cancelled"
    usage: Usage
    error: str | None = None  # what was malformed, when something was
    raw_text: str = ""        # the assistant's turn as generated (prefill and forced text included)


@dataclass(frozen=True)
class ChatDelta:
    """One streamed piece: a text delta, a tool-call delta, or (last) the whole result."""

    text: str = ""
    tool_call: ToolCallDelta | None = None
    result: ChatResult | None = None


# --- plans ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CallSyntax:
    """How a tool-call parser's format spells one call around its name and arguments."""

    open: str    # up to the name
    mid: str     # between the name and the arguments object
    close: str   # after the arguments object


SYNTAX = {  # by registered tool parser name
    "hermes": CallSyntax('<tool_call>\n{"name": "', '", "arguments":', '}\n</tool_call>'),
    "llama3_json": CallSyntax('{"name": "', '", "parameters":', "}"),
}


@dataclass(frozen=True)
class Stage:
    """One request of a turn: text written into the turn, then generation."""

    write: str = ""
    max_tokens: int = 0            # 0: no generation; the turn ends, held with its end-of-turn token
    stop: tuple[str, ...] = ()
    live: bool = False             # generated text is part of the turn; else it goes back to the plan


Plan = Generator[Stage, str, None]  # each yield receives the text its stage generated


@dataclass(frozen=True)
class Slot:
    """One required argument the model fills: what to write after `"key":`, when to stop, and how
    the generated text becomes a value."""

    key: str
    prompt: str                    # ' "' (strings), ' ' (numbers), '' (booleans): token boundaries
    stop: tuple[str, ...]
    max_tokens: int
    parse: Callable[[str], Any]

    def commit(self, raw: str) -> str:
        """The value's JSON text that follows the prompt already written."""
        return (" " + json.dumps(self.parse(raw), ensure_ascii=False))[len(self.prompt):]


def snap(text: str, choices: Sequence[str]) -> str:
    """The choice a constrained decoder would have reached from `text`: one that extends it, else
    the one sharing its longest prefix (the first among equals)."""
    text = text.strip()
    return next((c for c in choices if c.startswith(text)), None) or max(
        choices, key=lambda c: len(os.path.commonprefix([c, text])))


def _string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:  # an unescaped control character, or a cut escape
        return raw.rstrip("\\")


def _number(integer: bool) -> Callable[[str], int | float | None]:
    def parse(raw: str) -> int | float | None:
        found = re.match(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", raw.strip().strip('"'))
        if found is None:
            return None  # the model wrote no number: the tool's validation reports it
        value = float(found.group())
        return int(value) if integer or (value.is_integer() and not found.group(1)) else value
    return parse


def _boolean(raw: str) -> bool | None:
    word = raw.strip().lower()
    return True if word.startswith("t") else False if word.startswith("f") else None


def _slot(key: str, schema: dict) -> Slot | None:
    """How to fill one argument, or None when its schema is not a scalar one (or not a schema)."""
    if not isinstance(schema, dict):
        return None
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        if not isinstance(options, list) or not all(isinstance(o, dict) for o in options):
            return None
        options = [o for o in options if o.get("type") != "null"]
        return _slot(key, options[0]) if len(options) == 1 else None
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return Slot(key, ' "', ('"', "\n"), 48, lambda raw: snap(_string(raw), enum))
    if kind == "string":  # a raw newline: the model left the string without closing it
        return Slot(key, ' "', ('"', "\n"), 48, _string)
    if kind in ("integer", "number"):
        return Slot(key, " ", (",", "}", "\n"), 12, _number(kind == "integer"))
    if kind == "boolean":
        return Slot(key, "", (",", "}"), 4, _boolean)
    return None


def slots(parameters: dict) -> list[Slot] | None:
    """The required arguments of a flat object schema, in schema order; None for any other schema
    (nested objects, arrays, free-form objects): the model then writes the arguments itself."""
    properties, required = parameters.get("properties"), parameters.get("required", ())
    if (parameters.get("type", "object") != "object" or not isinstance(properties, dict)
            or not isinstance(required, (list, tuple))):
        return None
    found = [_slot(key, schema) for key, schema in properties.items() if key in required]
    return None if None in found else found


def plan(tools: Sequence[dict] | None, tool_choice: str, syntax: CallSyntax | None, *, prefill: str = "",
         guided: bool = True, budget: int) -> Plan:
    """The stages of a turn: one free stage, or a forced call when `tool_choice` asks for one and
    the parser's call syntax is known."""
    if not tools or tool_choice in ("auto", "none") or syntax is None:
        return _free_plan(prefill, budget)
    names = [t["function"]["name"] for t in tools]
    forced = tool_choice if tool_choice != "required" else names[0] if len(names) == 1 else None
    return _call_plan(syntax, tools, forced, prefill, guided, budget)


def _free_plan(prefill: str, budget: int) -> Plan:
    yield Stage(prefill, budget, live=True)


def _call_plan(syntax: CallSyntax, tools: Sequence[dict], forced: str | None, prefill: str, guided: bool,
               budget: int) -> Plan:
    names = [t["function"]["name"] for t in tools]
    write = prefill + syntax.open
    if forced is None:  # the model picks the tool
        forced = snap((yield Stage(write, NAME_TOKENS, ('"',))), names)
        write = ""
    write += json.dumps(forced, ensure_ascii=False)[1:-1] + syntax.mid
    parameters = tools[names.index(forced)]["function"].get("parameters") or {"properties": {}}
    found = slots(parameters) if guided else None
    if found is None:
        yield Stage(write, budget, live=True)
        return
    write += " {"
    for i, slot in enumerate(found):
        write += (", " if i else "") + json.dumps(slot.key, ensure_ascii=False) + ":" + slot.prompt
        raw = yield Stage(write, min(slot.max_tokens, budget), slot.stop)
        write = slot.commit(raw)
    yield Stage(write + "}" + syntax.close)


# --- running a plan ---------------------------------------------------------------------------------

class PlainText:
    """The parser stream's protocol with no tool parsing: the text is the content."""

    def __init__(self) -> None:
        self.text = ""

    def feed(self, delta: str) -> list[str]:
        self.text += delta
        return [delta]

    def close(self) -> list[str]:
        return []

    def finish(self) -> ParsedOutput:
        return ParsedOutput(self.text, [], None)


@dataclass(frozen=True)
class StageRequest:
    """What one stage of a turn asks the engine for: sync the state to `prompt`, then generate."""

    prompt: list[int]
    params: SamplingParams


class TurnRun:
    """Runs a plan on one state, one request per stage, without doing I/O itself (`run` and
    `arun` drive it). `max_calls` (1 for `parallel_tool_calls=False`): calls past it are dropped
    from the stream and the result alike, and once it is reached the request is stopped
    (`stop_now`): the turn ends with its calls, finish_reason "tool_calls"."""

    def __init__(self, prompt: list[int], plan: Plan, params: SamplingParams, stream: ToolCallStream,
                 encode: Callable[[str], list[int]], end_of_turn: Sequence[int], timeout: float | None,
                 max_calls: int | None = None) -> None:
        self.base, self.plan, self.params, self.stream = prompt, plan, params, stream
        self.encode, self.end_of_turn = encode, list(end_of_turn)
        self.deadline = time.monotonic() + timeout if timeout else None
        self.max_calls = max_calls
        self.calls = 0             # tool calls streamed so far
        self.text = ""             # the assistant turn so far
        self.raw = ""              # what the current (not live) stage generated
        self.stage = next(plan)
        self.usage: Usage | None = None
        self.generated = 0
        self.finish_reason = "stop"
        self.stopped = False       # the turn ended the current request itself (`stop_now`)

    def begin(self) -> tuple[list[ChatDelta], StageRequest]:
        stage, self.raw = self.stage, ""
        deltas = self._feed(stage.write)
        prompt = self.base + (self.encode(self.text) if self.text else [])
        if stage.max_tokens == 0:  # the turn was written to its end: hold it, end of turn included
            return deltas, StageRequest(prompt + self.end_of_turn, dataclasses.replace(self.params, max_tokens=0))
        stop = tuple(self.params.stop) + stage.stop if stage.live else stage.stop
        return deltas, StageRequest(prompt, dataclasses.replace(self.params, max_tokens=stage.max_tokens, stop=stop))

    def on_event(self, event: "StreamEvent") -> list[ChatDelta]:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ChatTimeoutError("the chat call ran past its timeout; raise the timeout or lower max_tokens")
        if event.completion is not None:
            stats = event.completion.stats
            if self.usage is None:  # the first request's prompt is the call's input
                self.usage = Usage(stats.prompt_tokens, stats.reused, 0)
            self.generated += len(event.completion.token_ids)
            if self.stage.live:  # a value stage that reaches its cap still completes the call
                reason = event.completion.finish_reason
                self.finish_reason = "stop" if self.stopped and reason == "cancelled" else reason
        if self.stage.live:
            return self._feed(event.text)
        self.raw += event.text
        return []

    def next_stage(self) -> bool:
        """Move to the next stage; False when the turn is complete."""
        try:
            self.stage = self.plan.send(self.raw)
        except StopIteration:
            return False
        return True

    def finish(self) -> list[ChatDelta]:
        deltas = self._deltas(self.stream.close())
        usage = dataclasses.replace(self.usage, completion_tokens=self.generated)
        parsed = self.stream.finish()
        if self.max_calls is not None:
            parsed = dataclasses.replace(parsed, tool_calls=parsed.tool_calls[:self.max_calls])
        return deltas + [ChatDelta(result=result(parsed, self.text, self.finish_reason, usage))]

    def stop_now(self) -> bool:
        """Whether the driver should stop the current request now (once): the turn holds all the
        calls it may, and what the model writes next would be dropped anyway."""
        if self.full and self.stage.live and not self.stopped:
            self.stopped = True
            return True
        return False

    @property
    def full(self) -> bool:
        """Whether the turn holds as many calls as it may; what follows is not parsed."""
        return self.max_calls is not None and self.calls >= self.max_calls

    def _feed(self, text: str) -> list[ChatDelta]:
        self.text += text
        return self._deltas(self.stream.feed(text)) if text and not self.full else []

    def _deltas(self, pieces: list) -> list[ChatDelta]:
        out = []
        for piece in pieces:
            if not isinstance(piece, ToolCallDelta):
                out.append(ChatDelta(text=piece))
            elif self.max_calls is None or piece.index < self.max_calls:
                self.calls += piece.id is not None
                out.append(ChatDelta(tool_call=piece))
        return out


def result(parsed: ParsedOutput, raw_text: str, finish_reason: str, usage: Usage) -> ChatResult:
    """What a turn comes to. Model output never raises: a malformed call is text, and says so.

    The calls that parsed are kept and a malformed or cut-off call stays in the text where it
    stood, in the result as in the stream (the parser streams a call only once it is decided).
    A LangGraph agent runs the calls it is streamed as they arrive: voiding every call of a turn
    because one is malformed would mean holding all calls back until the turn ends, and ending
    the agent (no calls) where it could run the good ones and let the model see its broken text."""
    if finish_reason in ("length", "cancelled"):
        reason = finish_reason
    else:
        reason = MALFORMED if parsed.error else "tool_calls" if parsed.tool_calls else finish_reason
    return ChatResult(parsed.content, parsed.tool_calls, reason, usage, parsed.error, raw_text)


# --- driving a turn: the only code that does I/O, once for threads and once for an event loop ------

Open = Callable[[contextlib.ExitStack], "tuple[TurnRun, StateHandle]"]
"""Starts a turn: enters what must stay held while it runs (a leased state) on the stack and
returns the turn and the state it runs on."""

T = TypeVar("T")


def _same(delta: ChatDelta) -> ChatDelta:
    return delta


def result_of(delta: ChatDelta) -> ChatResult | None:
    """The converter for callers that want the result only: `*_, result = run(open_turn, result_of)`."""
    return delta.result


def _converted(deltas: list[ChatDelta], convert: Callable[[ChatDelta], T | None]) -> list[T]:
    return [item for item in map(convert, deltas) if item is not None]


def _restore(handle: "StateHandle", tokens: list[int]) -> None:
    """Put a state back as it was before a turn that failed (a timeout, a later stage past the
    context): a failed call leaves its state unchanged. Usually a truncate."""
    with contextlib.suppress(HibanaError):  # a closed handle or engine has nothing to restore
        if handle.tokens != tokens:
            handle.sync(tokens)


def run(open_turn: Open, convert: Callable[[ChatDelta], T | None] = _same) -> Iterator[T]:
    """The turn's deltas, the result last, each through `convert` (None: nothing to send): the
    one place a framework's types are made from a turn. Closing the iterator early cancels the
    request and releases what `open_turn` held; a HibanaError puts the state back as it was."""
    with contextlib.ExitStack() as stack:
        turn, handle = open_turn(stack)
        held = handle.tokens
        try:
            yield from _run(turn, handle, convert)
        except HibanaError:
            _restore(handle, held)
            raise


def _run(turn: TurnRun, handle: "StateHandle", convert: Callable[[ChatDelta], T | None]) -> Iterator[T]:
    while True:
        deltas, request = turn.begin()
        yield from _converted(deltas, convert)
        with contextlib.closing(handle.stream(request.params, prompt=request.prompt)) as events:
            for event in events:
                yield from _converted(turn.on_event(event), convert)
                if turn.stop_now():
                    events.stop()
        if not turn.next_stage():
            break
    yield from _converted(turn.finish(), convert)


async def arun(open_turn: Open, convert: Callable[[ChatDelta], T | None] = _same) -> AsyncIterator[T]:
    """`run` on the caller's event loop: awaits the engine, never blocks the loop."""
    with contextlib.ExitStack() as stack:
        turn, handle = open_turn(stack)
        held = handle.tokens
        try:
            async with contextlib.aclosing(_arun(turn, handle, convert)) as items:  # closed early: cancelled
                async for item in items:
                    yield item
        except HibanaError:
            await asyncio.to_thread(_restore, handle, held)
            raise


async def _arun(turn: TurnRun, handle: "StateHandle", convert: Callable[[ChatDelta], T | None]) -> AsyncIterator[T]:
    while True:
        deltas, request = turn.begin()
        for item in _converted(deltas, convert):
            yield item
        async with contextlib.aclosing(handle.astream(request.params, prompt=request.prompt)) as events:
            async for event in events:
                for item in _converted(turn.on_event(event), convert):
                    yield item
                if turn.stop_now():
                    events.stop()
        if not turn.next_stage():
            break
    for item in _converted(turn.finish(), convert):
        yield item
