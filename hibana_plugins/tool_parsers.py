"""Tool-call parsers: generated text -> content and tool calls, whole or streamed.

Built-ins, registered through `register_tool_parsers` like any plugin's:
- "hermes": Hermes / Qwen, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
  of blocks anywhere in the text.
- "llama3_json": Llama 3.x, `{"name": ..., "parameters": {...}}` at the start of the output or
  after `<|python_tag|>`, several separated by `;` or newlines.
- "mistral": Mistral's `[TOOL_CALLS]` control token, then a JSON array of `{"name": ...,
  "arguments": {...}}` objects (Mistral 7B v0.3, Nemo, Small 3; 9-character call ids, as their
  templates demand), or `NAME[ARGS]{...}` after each `[TOOL_CALLS]` (the templates that write
  `[ARGS]`: "mistral_args", which reads both forms and differs in its grammar only; and
  "mistral_call_id" for those that write `NAME[CALL_ID]ID[ARGS]{...}`).
- "granite": IBM Granite 3.x's `<|tool_call|>` control token, then a JSON array of call objects,
  as "mistral" reads it (OpenAI-style call ids).

All follow one contract:
- content is the text outside tool calls, without leading or trailing whitespace;
- malformed tool-call text stays in the content and `error` says what was wrong; nothing raises;
- `parse(text)` is `stream()` fed the whole text, so whole and streamed parsing agree;
- a stream is truthful: it emits a call only once the call is complete and decoded (hermes: its
  `</tool_call>` seen, or the end of the text; llama3: its object closed), as two deltas, id and
  name, then the arguments' JSON. So for every chunking of a text, the calls assembled from the
  deltas are `parse(text).tool_calls`, ids included, and a call that is cut off or malformed is
  never streamed. Text deltas concatenate to the final content.
- text let go at the end because the generation ended inside a call (a tag begun, a call not
  closed) comes as a `CutCall` (content like any other; a reply cut by max_tokens, or by a stop
  under the call grammar, leaves it out).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass

from hibana_plugins.hookspecs import (  # noqa: F401 (the protocol types, re-exported)
    CutCall,
    GeneratedText,
    ParsedOutput,
    Span,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    hookimpl,
)

ARGUMENT_KEYS = ("arguments", "parameters")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_SEPARATORS = " \t\r\n;"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`: text to hold back."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _loads(text: str):
    """json.loads, with every way model output can fail it as a ValueError: a number past
    Python's int-string limit raises ValueError, nesting past the recursion limit RecursionError.
    NaN, Infinity and numbers past a float's range (1e999) are no JSON (Python reads them as
    floats; the call's arguments would go out as no JSON, and come back refused in the history)."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is past a float's range")
    return value


@dataclass(frozen=True)
class _Decoded:
    name: str = ""
    arguments: dict | None = None
    error: str | None = None
    valid_json: bool = False
    arguments_json: str = "{}"  # as streamed
    call_id: object = None  # the call object's own "id", as written (a format may keep it)


def _decode_call(text: str, require_arguments: bool) -> _Decoded:
    """The authoritative reading of one call's JSON object."""
    try:
        obj = _loads(text)
    except ValueError as exc:  # JSONDecodeError, an over-long number, too deep a nesting
        return _Decoded(error=f"invalid JSON in tool call ({exc})")
    if not isinstance(obj, dict):
        return _Decoded(error="a tool call must be a JSON object", valid_json=True)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _Decoded(error='a tool call needs a string "name"', valid_json=True)
    key = next((k for k in obj if k in ARGUMENT_KEYS), None)  # first in the text, as streamed
    if key is None and require_arguments:
        return _Decoded(error='a tool call needs "parameters" or "arguments"', valid_json=True)
    arguments = obj.get(key) if key else None
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = _loads(arguments)
        except ValueError as exc:
            return _Decoded(error=f"invalid JSON in arguments of {name!r} ({exc})", valid_json=True)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return _Decoded(error=f"arguments of {name!r} must be a JSON object", valid_json=True)
    return _accepted(name, arguments, call_id=obj.get("id"))


def _accepted(name: str, arguments: dict, call_id: object = None) -> _Decoded:
    """A decoded call with its arguments' JSON as the stream sends it, or the error where nesting
    deep enough fails the encoder."""
    try:
        arguments_json = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return _Decoded(error=f"arguments of {name!r} nested too deeply", valid_json=True)
    return _Decoded(name, arguments, None, valid_json=True, arguments_json=arguments_json, call_id=call_id)


class _ObjectScanner:
    """Follows one JSON object character by character: where it ends, and its "name" string
    (which tells a malformed call from output that merely starts with "{").

    It tracks structure only (depth, strings, top-level keys); json.loads decides validity at the
    end. With a terminator (hermes' `</tool_call>`), scanning stops where the terminator appears
    outside a string, or waits where the text so far may be its start.
    """

    def __init__(self, terminator: str | None = None) -> None:
        self.terminator = terminator
        self.pos = 0  # next character to scan
        self.depth = 0
        self.in_string = False
        self.complete = False  # the top-level object closed
        self.broken = False  # not a JSON object; stop following structure
        self.end: int | None = None  # one past the closing brace
        self.terminated_at: int | None = None
        self.name: str | None = None
        self._escape = False
        self._expect = "open"  # open, key, key_string, colon, value, in_value, scalar, comma
        self._key: str | None = None
        self._token_start = 0
        self._scalar_end = 0

    def scan(self, text: str) -> None:
        term = self.terminator
        while self.pos < len(text):
            if term is None:
                if self.complete:
                    return
            elif not self.in_string and text[self.pos] == term[0]:
                ahead = text[self.pos : self.pos + len(term)]
                if ahead == term:
                    self.terminated_at = self.pos
                    return
                if len(ahead) < len(term) and term.startswith(ahead):
                    return  # may be the terminator: wait for more text
            self._step(text, self.pos)
            self.pos += 1

    def _step(self, text: str, i: int) -> None:
        if self.complete or self.broken:
            return
        c = text[i]
        if self.in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_ended(text, i + 1)
            return
        if c in " \t\r\n":
            return
        if self.depth == 0:
            if c == "{" and self._expect == "open":
                self.depth, self._expect = 1, "key"
            else:
                self._break()
            return
        if c == '"':
            self.in_string = True
            if self.depth == 1:
                self._start(text, i)
        elif c in "{[":
            if self.depth == 1:
                self._start(text, i)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_ended(text, i + 1)
            elif self.depth == 0:
                if self._expect == "scalar":
                    self._value_ended(text, self._scalar_end)
                self.complete, self.end = c == "}", i + 1
                self.broken = c != "}"
        elif self.depth > 1:
            return
        elif c == ":":
            if self._expect != "colon":
                return self._break()
            self._expect = "value"
        elif c == ",":
            if self._expect == "scalar":
                self._value_ended(text, self._scalar_end)
            self._expect = "key"
        else:  # a number, true, false or null at the top level
            if self._expect == "value":
                self._start(text, i)
                self._expect = "scalar"
            self._scalar_end = i + 1

    def _break(self) -> None:
        self.broken, self.in_string = True, False

    def _start(self, text: str, i: int) -> None:
        if self._expect == "key":
            if text[i] != '"':
                return self._break()
            self._token_start, self._expect = i, "key_string"
        elif self._expect == "value":
            self._token_start, self._expect = i, "in_value"

    def _string_ended(self, text: str, end: int) -> None:
        if self._expect == "key_string":
            try:
                self._key = _loads(text[self._token_start : end])
            except ValueError:
                return self._break()
            self._expect = "colon"
        elif self._expect == "in_value":
            self._value_ended(text, end)

    def _value_ended(self, text: str, end: int) -> None:
        if self._key == "name" and self.name is None:
            try:
                value = _loads(text[self._token_start : end])
            except ValueError:
                value = None
            if isinstance(value, str) and value:
                self.name = value
        self._expect = "comma"


class _Content:
    """Text outside tool calls, stripped as it streams: leading whitespace is dropped, trailing
    whitespace held back until more text follows it."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._held = ""
        self._started = False

    @property
    def started(self) -> bool:
        """Whether any content came (past leading whitespace)."""
        return self._started

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            self.parts.append(body)
        return body


class _Markers:
    """Where a format's markers stand in the text a stream was fed (positions in all of it).

    A `GeneratedText` says so itself: a marker is where the model generated its token (a control
    span), so that the same characters spelled with ordinary tokens (quoting a tool result) stay
    text. Markers that are control tokens (harmony's, Mistral's) count there only. Markers a
    format writes as text (`textual`: hermes' `<tool_call>`) count there only where they are
    added tokens of the tokenizer (`GeneratedText.added_tokens`), and anywhere where they are not
    (or where that is not known). A plain `str` (a caller's prefill, a text handed to `parse`)
    is read as the tokenizer would encode it: a marker's text anywhere inside plain text fed in a
    row is the marker."""

    def __init__(self, textual: bool = False) -> None:
        self.fed = 0
        self.textual = textual
        self._control: set[Span] = set()
        self._plain: list[Span] = []  # runs of plain text fed in a row
        self._added: frozenset[str] | None = None  # the tokenizer's added tokens, once a GeneratedText told

    def add(self, text: str) -> None:
        if isinstance(text, GeneratedText):
            self._control.update((self.fed + a, self.fed + b) for a, b in text.control_spans)
            if text.added_tokens is not None:
                self._added = text.added_tokens
        elif self._plain and self._plain[-1][1] == self.fed:
            self._plain[-1] = (self._plain[-1][0], self.fed + len(text))
        else:
            self._plain.append((self.fed, self.fed + len(text)))
        self.fed += len(text)

    def at(self, start: int, end: int, marker: str = "") -> bool:
        """Whether the characters [start, end) (`marker`'s text) are the marker, not text that looks like one."""
        if (start, end) in self._control or any(a <= start and end <= b for a, b in self._plain):
            return True
        return self.textual and (self._added is None or marker not in self._added)

    def find(self, tail: str, marker: str, begin: int = 0, end: int | None = None) -> int:
        """Where `marker` stands in `tail[begin:end]` (`tail`: the end of all that was fed) as a
        marker, as an index of `tail` (-1: nowhere)."""
        start, at = self.fed - len(tail), tail.find(marker, begin, end)
        while at >= 0 and not self.at(start + at, start + at + len(marker), marker):
            at = tail.find(marker, at + 1, end)
        return at


class _Stream:
    """What every built-in stream shares: content, calls, errors, where the format's markers stand
    (`_markers`; `textual_markers`: as `_Markers.textual`), and the feed/close/finish API.
    Subclasses implement `_advance(out, final)` over `self._buffer`."""

    textual_markers = False

    def __init__(self) -> None:
        self._markers = _Markers(self.textual_markers)
        self._buffer = ""
        self._content = _Content()
        self._calls: list[ToolCall] = []
        self._errors: list[str] = []
        self._closed = False

    def feed(self, text_delta: str) -> list[str | ToolCallDelta]:
        """Text deltas outside tool calls and tool-call deltas decided by this piece of text."""
        if self._closed:
            raise RuntimeError("feed() after close(): use a new stream() per generation")
        self._markers.add(text_delta)
        self._buffer += text_delta
        out: list[str | ToolCallDelta] = []
        self._advance(out, final=False)
        return out

    def close(self) -> list[str | ToolCallDelta]:
        """End of the generation: the deltas that were held back until it was decided."""
        if self._closed:
            return []
        self._closed = True
        out: list[str | ToolCallDelta] = []
        self._advance(out, final=True)
        return out

    def finish(self) -> ParsedOutput:
        """The authoritative result (closes the stream; call close() first for its deltas)."""
        self.close()
        return ParsedOutput("".join(self._content.parts), list(self._calls), self._error())

    def _error(self) -> str | None:
        return "; ".join(self._errors) or None

    def _text(self, out: list, text: str, cut: bool = False) -> None:
        """Content; `cut`: a call the generation ended inside (`CutCall`)."""
        emitted = self._content.add(text)
        if emitted:
            out.append(CutCall(emitted) if cut else emitted)

    def _text_before(self, out: list, tag: str, final: bool) -> None:
        """The buffer (which holds no `tag`) as content but for a tail that may begin it, kept
        until what follows decides; at the end of the output that tail is a cut call too."""
        begun = len(self._buffer) - partial_tag_length(self._buffer, tag)
        self._text(out, self._buffer[:begun])
        self._buffer = self._buffer[begun:]
        if final:
            self._text(out, self._buffer, cut=True)
            self._buffer = ""

    _new_call_id = staticmethod(new_call_id)  # a call's id where the format's text gives none

    def _accept(self, out: list, decoded: _Decoded, call_id: str | None = None) -> None:
        """A complete, well-formed call: streamed now, whole, and kept for the result. The
        format's own id (`call_id`) is kept unless an earlier call of the turn has it: ids are
        unique per call, as the results that answer them are paired by id."""
        if not call_id or any(call.id == call_id for call in self._calls):
            call_id = self._new_call_id()
        call = ToolCall(call_id, decoded.name, decoded.arguments or {})
        index = len(self._calls)
        self._calls.append(call)
        out.append(ToolCallDelta(index, call.id, call.name))
        out.append(ToolCallDelta(index, None, None, decoded.arguments_json))

    def _reject(self, out: list, raw: str, error: str, cut: bool = False) -> None:
        self._errors.append(error)
        self._text(out, raw, cut)

    def _advance(self, out: list, final: bool) -> None:
        raise NotImplementedError


class _HermesStream(_Stream):
    textual_markers = True  # a call opens where the model generated the <tool_call> token, where it is one

    def __init__(self) -> None:
        super().__init__()
        self._call: _ObjectScanner | None = None  # inside a block: _buffer is its body

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if self._call is None:
                start = self._markers.find(self._buffer, HERMES_START)
                if start < 0:
                    self._text_before(out, HERMES_START, final)
                    return
                self._text(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(HERMES_START) :]
                self._call = _ObjectScanner(HERMES_END)
                continue
            self._call.scan(self._buffer)
            end = self._call.terminated_at
            if end is None and not final:
                return  # the call is decided at its </tool_call> or at the end of the text
            body = self._buffer if end is None else self._buffer[:end]
            if end is None and HERMES_END.startswith(body[self._call.pos:]):  # the text ended inside its end tag
                body = body[:self._call.pos]
            raw, self._buffer = (self._buffer, "") if end is None else (body, self._buffer[end + len(HERMES_END):])
            self._call = None
            decoded = _decode_call(body, require_arguments=False)
            if decoded.error is None:
                self._accept(out, decoded)
            elif end is None:
                self._reject(out, HERMES_START + raw, f"unclosed {HERMES_START}: {decoded.error}", cut=True)
            else:
                self._reject(out, HERMES_START + body + HERMES_END, decoded.error)


class HermesToolParser:
    """Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    A block left unclosed at the end of the generation (or cut inside its end tag) is accepted
    when its JSON is complete.
    """

    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        return _parse_whole(self.stream(), text)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _Llama3Stream(_Stream):
    """Modes: "start" (only whitespace so far), "text" (content), "calls" (between calls: skip
    separators), "call" (inside one JSON object; _buffer starts with it).
    `<|python_tag|>` counts where `_markers` says it is the control token only: the same text
    spelled by ordinary tokens (quoting a tool result) is content, as Mistral's markers are."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        self._bare = False  # the calls began with "{" rather than after <|python_tag|>
        self._region_calls = 0  # objects read since the calls region began
        self._call: _ObjectScanner | None = None

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if self._mode == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    return
                self._buffer = stripped
                self._bare = stripped.startswith("{")
                self._mode = "calls" if self._bare else "text"
            elif self._mode == "text":
                tag = self._markers.find(self._buffer, PYTHON_TAG)
                if tag < 0:
                    self._text_before(out, PYTHON_TAG, final)
                    return
                self._text(out, self._buffer[:tag])
                self._buffer = self._buffer[tag + len(PYTHON_TAG) :]
                self._mode, self._bare, self._region_calls = "calls", False, 0
            elif self._mode == "calls":
                rest = self._buffer.lstrip(LLAMA3_SEPARATORS)
                if not rest:
                    self._buffer = ""
                    return
                self._buffer = rest
                if rest[0] == "{":
                    self._mode, self._call = "call", _ObjectScanner()
                else:  # text after the calls (or <|python_tag|> before code): content again
                    if self._region_calls == 0 and not self._bare:
                        self._text(out, PYTHON_TAG)
                    self._mode = "text"
            elif not self._read_call(out, final):
                return

    def _read_call(self, out: list, final: bool) -> bool:
        """Scan the object at the start of _buffer; True once it is decided."""
        scanner = self._call
        scanner.scan(self._buffer)
        if not scanner.complete:
            if not final:
                return False  # the call is decided when its object closes or the text ends
            text, self._buffer = self._buffer, ""
        else:
            text, self._buffer = self._buffer[: scanner.end], self._buffer[scanner.end :]
        self._call, self._mode = None, "calls"
        self._region_calls += 1
        decoded = _decode_call(text, require_arguments=True)
        if decoded.error is None:
            self._accept(out, decoded)
        elif self._bare and self._region_calls == 1 and (decoded.valid_json or scanner.name is None):
            # output that merely starts with "{": an answer, not a call; but one cut before its
            # name was read whose first key is (or may yet be) "name" is a call being written
            self._text(out, text, cut=not scanner.complete and _begins_call(text))
            self._mode = "text"
        else:
            tag = PYTHON_TAG if not self._bare and self._region_calls == 1 else ""
            self._reject(out, tag + text, decoded.error, cut=not scanner.complete)
        return True


def _begins_call(text: str) -> bool:
    """Whether an object cut short opens as a call does: its first key is "name" or a start of it."""
    head = text.lstrip()[1:].lstrip()[:len('"name"')]
    return '"name"'.startswith(head)


class Llama3JsonToolParser:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` at the start of the output
    or after `<|python_tag|>`, several separated by `;` or newlines ("arguments" is accepted for
    "parameters"). Output starting with a JSON object that is not a call is plain content."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        return _parse_whole(self.stream(), text)

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()


def _parse_whole(stream: ToolCallStream, text: str) -> ParsedOutput:
    stream.feed(text)
    return stream.finish()


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MISTRAL_ID_LENGTH = 9


def mistral_call_id() -> str:
    """A call id as Mistral's templates take them: 9 letters and digits."""
    return uuid.uuid4().hex[:MISTRAL_ID_LENGTH]


class _MistralStream(_Stream):
    """Modes: "text" (content; `[TOOL_CALLS]` starts calls), "calls" (just after it: `[` opens an
    array of call objects, `{` is one call object, else a name up to `[ARGS]`), "array" (between
    the array's objects), "object" (inside a call object; _buffer starts with it), "name" (a
    name, perhaps `[CALL_ID]id`, then `[ARGS]`), "arguments" (the named call's object).
    `[TOOL_CALLS]` and `[ARGS]` count where `_markers` says they are the control tokens only: the
    same text spelled by ordinary tokens (quoting a tool result) is content, as the grammar left it.
    A subclass may take another calls marker (`calls_marker`), read no named calls (`named_calls`)
    and make its own ids (`_new_call_id`, `_own_id`: the model's own id kept, else None)."""

    calls_marker = MISTRAL_CALLS
    named_calls = True  # `NAME[ARGS]{...}` after the marker is a call
    _new_call_id = staticmethod(mistral_call_id)

    def __init__(self) -> None:
        super().__init__()
        self._mode = "text"
        self._in_array = False  # the call object being read is an array's (else [TOOL_CALLS]'s alone)
        self._scanner: _ObjectScanner | None = None
        self._name = ""
        self._id: str | None = None
        self._raw = ""  # what the calls being read came as, for content if they are malformed

    def _find(self, marker: str) -> int:
        """Where `marker` stands in the buffer as a marker (-1: nowhere)."""
        return self._markers.find(self._buffer, marker)

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if self._mode == "text":
                marker = self.calls_marker
                start = self._find(marker)
                if start < 0:
                    self._text_before(out, marker, final)
                    return
                self._text(out, self._buffer[:start])
                self._buffer = self._buffer[start + len(marker):]
                self._mode, self._raw = "calls", marker
            elif self._mode in ("calls", "array"):
                rest = self._buffer.lstrip() if self._mode == "calls" else self._buffer.lstrip(" \t\r\n,")
                self._raw += self._buffer[:len(self._buffer) - len(rest)]
                self._buffer = rest
                if not rest:
                    if final and self._mode == "calls":
                        self._malformed(out, f"{self.calls_marker} without its calls", cut=True)
                    return  # (an array the generation ended in keeps the calls it closed)
                if self._mode == "array" and rest[0] == "]":
                    self._buffer, self._mode = rest[1:], "text"
                elif rest[0] == "[" and self._mode == "calls":
                    self._raw += "["
                    self._buffer, self._mode = rest[1:], "array"
                elif rest[0] == "{":
                    self._in_array = self._mode == "array"
                    self._mode, self._scanner = "object", _ObjectScanner()
                elif self._mode == "array":
                    self._malformed(out, f"a {self.calls_marker} array holds call objects only")
                elif not self.named_calls:
                    self._malformed(out, f"{self.calls_marker} is followed by a JSON array of call objects")
                else:
                    self._mode, self._name, self._id = "name", "", None
            elif self._mode == "name":
                if not self._read_name(out, final):
                    return
            elif not self._read_object(out, final):
                return

    def _read_name(self, out: list, final: bool) -> bool:
        """The name before [ARGS] (and the id after [CALL_ID], where the template writes one)."""
        end = self._find(MISTRAL_ARGS)
        if end < 0:
            if final:
                self._malformed(out, f"a call after {MISTRAL_CALLS} needs {MISTRAL_ARGS} and its arguments", cut=True)
                return True
            return False
        head, self._raw = self._buffer[:end], self._raw + self._buffer[:end + len(MISTRAL_ARGS)]
        name, _, call_id = head.partition(MISTRAL_CALL_ID)
        self._name, self._id = name.strip(), call_id.strip() or None
        rest = self._buffer[end + len(MISTRAL_ARGS):]
        arguments = rest.lstrip()
        self._raw += rest[:len(rest) - len(arguments)]  # a malformed call's content keeps its whitespace
        self._buffer, self._mode, self._scanner = arguments, "arguments", None
        return True

    def _read_object(self, out: list, final: bool) -> bool:
        """A call object, or a named call's arguments object, once decided."""
        if self._scanner is None:
            if not self._buffer and not final:
                return False
            self._scanner = _ObjectScanner()
        scanner = self._scanner
        scanner.scan(self._buffer)
        if not scanner.complete and not final:
            return False  # decided when its object closes or the text ends (a broken one at the end, as llama3's)
        end = scanner.end if scanner.complete else len(self._buffer)
        text, self._buffer = self._buffer[:end], self._buffer[end:]
        self._raw += text
        self._scanner = None
        if self._mode == "object":
            decoded = _decode_call(text, require_arguments=True)
            call_id = self._own_id(decoded.call_id)
            self._mode = "array" if self._in_array else "text"
        else:
            decoded = decode_arguments(self._name, text,
                                       f"a call after {MISTRAL_CALLS} needs a name before {MISTRAL_ARGS}")
            call_id = self._own_id(self._id)
            self._mode = "text"
        if decoded.error is not None:
            self._mode = "text"
            self._malformed(out, decoded.error, cut=not scanner.complete)
        else:
            self._accept(out, decoded, call_id)
            self._raw = ""
        return True

    def _malformed(self, out: list, error: str, cut: bool = False) -> None:
        """The calls' text read so far back to content, with `error`; what follows it is read as
        text again (a later marker may start calls), so that where the stream was cut into
        pieces changes nothing. `cut`: the generation ended inside the calls (all of it goes)."""
        raw, self._raw, self._mode = self._raw + (self._buffer if cut else ""), "", "text"
        if cut:
            self._buffer = ""
        self._reject(out, raw, error, cut)

    @staticmethod
    def _own_id(value: object) -> str | None:
        """The model's own call id where it wrote one the templates take back (9 letters and digits)."""
        ok = isinstance(value, str) and len(value) == MISTRAL_ID_LENGTH and value.isascii() and value.isalnum()
        return value if ok else None


GRANITE_CALLS = "<|tool_call|>"


class _GraniteStream(_MistralStream):
    """Granite 3.x's calls: its `<|tool_call|>` control token, then a JSON array of call objects
    (or one object); its templates write no call ids, so a call's id is OpenAI's usual form."""

    calls_marker = GRANITE_CALLS
    named_calls = False
    _new_call_id = staticmethod(new_call_id)

    @staticmethod
    def _own_id(value: object) -> str | None:
        return None


def decode_arguments(name: str, body: str, no_name: str, blank: bool = False) -> _Decoded:
    """A named call's body, its arguments' JSON object (`blank`: an empty body is `{}`); `no_name`
    is the error where the name is missing."""
    if not name:
        return _Decoded(error=no_name)
    try:
        arguments = _loads(body) if body.strip() or not blank else {}
    except ValueError as exc:
        return _Decoded(error=f"invalid JSON in arguments of {name!r} ({exc})")
    if not isinstance(arguments, dict):
        return _Decoded(error=f"arguments of {name!r} must be a JSON object", valid_json=True)
    return _accepted(name, arguments)


# structural-tag pieces (xgrammar's format) for the grammars of formats whose markup is tokens

def tag_token(marker: str) -> dict:
    """A marker as the control token it is (the engine looks its text up in the vocabulary)."""
    return {"type": "token", "token": marker}


def tag_text(value: str) -> dict:
    return {"type": "const_string", "value": value}


def tag_sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def tag_either(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _arguments(function: dict) -> dict:
    """A call's arguments held to the function's schema (`hibana_core.turn.arguments_schema`)."""
    from hibana_core.turn import arguments_schema

    return {"type": "json_schema", "json_schema": arguments_schema(function)}


class MistralToolParser:
    """Mistral's tool calls: `[TOOL_CALLS]` then `[{"name": ..., "arguments": {...}}, ...]`, or
    `NAME[ARGS]{...}` after each `[TOOL_CALLS]`; both are read. Ids are 9 letters and digits (the
    model's own where it wrote one), as Mistral's templates require. Its grammar holds the calls
    to the array form; `MistralArgsToolParser`'s to the [ARGS] form."""

    name = "mistral"
    _stream_type: type[_MistralStream] = _MistralStream

    def parse(self, text: str) -> ParsedOutput:
        return _parse_whole(self.stream(), text)

    def stream(self) -> ToolCallStream:
        return self._stream_type()

    def _call(self, function: dict) -> dict:
        """`{"name": NAME, "arguments": {...}}`, or with the 9-character `"id"` after the arguments
        that Mistral's templates write into past calls (Nemo writes its own: kept, as the parser
        keeps it, the call re-renders as generated)."""
        name = json.dumps(function["name"], ensure_ascii=False)
        own_id = tag_sequence(tag_text(', "id": "'), {"type": "regex", "pattern": f"[0-9A-Za-z]{{{MISTRAL_ID_LENGTH}}}"},
                              tag_text('"'))
        return tag_sequence(tag_text('{"name": ' + name + ', "arguments": '), _arguments(function),
                            {"type": "optional", "content": own_id}, tag_text("}"))

    def _calls(self, calls: list[dict], parallel: bool) -> dict:
        call = tag_either(calls)
        more = {"type": "star", "content": tag_sequence(tag_text(", "), call)}
        items = tag_sequence(call, more) if parallel else call
        opening = tag_either([tag_text("["), tag_text(" [")])
        return tag_sequence(tag_token(self._stream_type.calls_marker), opening, items, tag_text("]"))

    def tool_call_grammar(self, tools: list[dict], tool_choice: str, parallel: bool) -> dict:
        """The turn's calls held to the offered tools and their schemas (`tool_choice` "required"
        or a tool's name: calls only; "auto": text, or text then calls: the control token
        [TOOL_CALLS] (the calls marker) is reachable only as the calls' start)."""
        functions = [t["function"] for t in tools
                     if tool_choice in ("auto", "required") or t["function"]["name"] == tool_choice]
        calls = self._calls([self._call(f) for f in functions], parallel)
        if tool_choice == "auto":
            calls = tag_sequence({"type": "any_text"}, {"type": "optional", "content": calls})
        return {"type": "structural_tag", "format": calls}

    def cut_call_parts(self, cut_call: str) -> tuple[str, str]:
        """(the name, the arguments) a call cut off by max_tokens had begun (a `CutCall`'s text:
        the calls marker, or the `, ` before an array's next call, then the call), as
        `Chat.cut_call_parts` reads a `call_syntax`'s; ("", "") for what it has not reached."""
        marker = self._stream_type.calls_marker
        text = cut_call.lstrip()
        if text.startswith(marker):
            text = text[len(marker):].lstrip().removeprefix("[").lstrip()
        elif text.startswith(","):  # the next call of an array whose earlier calls were read
            text = text[1:].lstrip()
        else:
            return "", ""
        if text.startswith("{"):  # a call object: its "name", then its "arguments" as written
            name = re.match(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)', text)
            if name is None:
                return "", ""
            key = re.match(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*', text[name.end():]) if name[2] else None
            arguments = text[name.end() + key.end():] if key else ""
        elif self._stream_type.named_calls:  # NAME[ARGS]{...}, perhaps NAME[CALL_ID]ID[ARGS]{...}
            head, args_marker, arguments = text.partition(MISTRAL_ARGS)
            head = head.partition(MISTRAL_CALL_ID)[0]
            if not args_marker:  # cut inside the markup after the name: what of it was written goes
                head = head[:len(head) - max(partial_tag_length(head, MISTRAL_ARGS),
                                             partial_tag_length(head, MISTRAL_CALL_ID))]
            return head.strip(), arguments.lstrip()
        else:
            return "", ""
        scanner = _ObjectScanner()  # an arguments object closed, then the rest of the call object cut: the object
        scanner.scan(arguments)
        return name[1], arguments[:scanner.end] if scanner.complete else arguments

    def no_call_grammar(self) -> dict:
        """tool_choice "none" (the tools listed all the same): any text, which never holds the calls
        marker, a control token the grammar does not name (so refused), as hermes' grammar refuses
        its `<tool_call>`: the model answers rather than writing calls that would be read as text."""
        return {"type": "structural_tag", "format": {"type": "any_text"}}


class MistralArgsToolParser(MistralToolParser):
    """Mistral's later templates' calls, `[TOOL_CALLS]NAME[ARGS]{...}` a call (Mistral Small 3.2,
    Magistral, Devstral): read as "mistral" reads them, held to this form by its grammar."""

    name = "mistral_args"

    def _call(self, function: dict) -> dict:
        return tag_sequence(tag_token(MISTRAL_CALLS), tag_text(function["name"]), tag_token(MISTRAL_ARGS),
                            _arguments(function))

    def _calls(self, calls: list[dict], parallel: bool) -> dict:
        call = tag_either(calls)
        return tag_sequence(call, {"type": "star", "content": call}) if parallel else call


class MistralCallIdToolParser(MistralArgsToolParser):
    """The templates that write each call as `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` (Magistral,
    Devstral 2507): read as "mistral" reads them (the model's id kept), held to this form by its
    grammar, the id 9 letters and digits."""

    name = "mistral_call_id"

    def _call(self, function: dict) -> dict:
        call_id = {"type": "regex", "pattern": f"[0-9A-Za-z]{{{MISTRAL_ID_LENGTH}}}"}
        return tag_sequence(tag_token(MISTRAL_CALLS), tag_text(function["name"]), tag_token(MISTRAL_CALL_ID),
                            call_id, tag_token(MISTRAL_ARGS), _arguments(function))


class GraniteToolParser(MistralToolParser):
    """IBM Granite 3.x's tool calls: `<|tool_call|>` (a control token of its tokenizer) then
    `[{"name": ..., "arguments": {...}}, ...]`, as vLLM's `granite` parser reads them; read and
    held by its grammar as "mistral"'s array form, with OpenAI-style ids (`call_...`)."""

    name = "granite"
    _stream_type = _GraniteStream

    def _call(self, function: dict) -> dict:
        name = json.dumps(function["name"], ensure_ascii=False)
        return tag_sequence(tag_text('{"name": ' + name + ', "arguments": '), _arguments(function), tag_text("}"))


@hookimpl
def register_tool_parsers(register) -> None:
    register(HermesToolParser.name, HermesToolParser())
    register(Llama3JsonToolParser.name, Llama3JsonToolParser())
    register(MistralToolParser.name, MistralToolParser())
    register(MistralArgsToolParser.name, MistralArgsToolParser())
    register(MistralCallIdToolParser.name, MistralCallIdToolParser())
    register(GraniteToolParser.name, GraniteToolParser())
