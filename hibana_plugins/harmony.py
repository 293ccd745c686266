"""gpt-oss's harmony format: its tool parser, and its chat format (model_type gpt_oss).

An assistant turn in harmony is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
     ^ the header: role, channel, recipient (`to=`; before or after the channel), content type

The channel says who reads a message: "analysis" is the model's reasoning (never content),
"final" is the answer, "commentary" is a tool call when it has a recipient (its body the
arguments' JSON) and otherwise a preamble the user may see (content). A turn without any
harmony markup is all content. <|call|> and <|return|> end a turn (the engine stops there and
leaves them out of the text), <|end|> ends one message of it.

The markers are special tokens, and only those the model generated as such are markup: a message
body may quote a tool result that holds "<|call|>" or "<|channel|>commentary to=functions.x", and
those characters, spelled by ordinary tokens, stay in the body. The engine's text says which of
its spans are control tokens (`GeneratedText`); a plain `str` is read as its tokenizer would
encode it, every marker's text a marker (`_Markers`).

The chat format keeps the checkpoint's own template (gpt-oss checkpoints ship it; the chat layer
keeps message contents from turning into control tokens) and names the parser, and its turns end
at <|return|> and <|call|> only: <|end|> closes the analysis message in the middle of a turn.
"""

from __future__ import annotations

import json
import re

from hibana_plugins.hookspecs import GeneratedText, ParsedOutput, Span, ToolCallDelta, ToolCallStream, hookimpl
from hibana_plugins.tool_parsers import _Decoded, _loads, _Stream, partial_tag_length

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
END_OF_TURN_TOKENS = ("<|return|>", "<|call|>")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_WORD = re.compile(r"\s*(\w+)")


class _Markers:
    """Where harmony's markers stand in the text a stream was fed (positions in all of it).

    A `GeneratedText` says so itself: at its control spans, nowhere else, so that a marker the
    model spelled with ordinary tokens (quoting a tool result) stays text. A plain `str` (a
    caller's prefill, a text handed to `parse`) is read as the tokenizer would encode it: a
    marker's text anywhere inside plain text fed in a row is the marker."""

    def __init__(self) -> None:
        self.fed = 0
        self._control: set[Span] = set()
        self._plain: list[Span] = []  # runs of plain text fed in a row

    def add(self, text: str) -> None:
        if isinstance(text, GeneratedText):
            self._control.update((self.fed + a, self.fed + b) for a, b in text.control_spans)
        elif self._plain and self._plain[-1][1] == self.fed:
            self._plain[-1] = (self._plain[-1][0], self.fed + len(text))
        else:
            self._plain.append((self.fed, self.fed + len(text)))
        self.fed += len(text)

    def at(self, start: int, end: int) -> bool:
        """Whether the characters [start, end) are a marker, not text that looks like one."""
        return (start, end) in self._control or any(a <= start and end <= b for a, b in self._plain)


class _HarmonyStream(_Stream):
    """Modes: "header" (collecting one message's header until <|message|>), "body" (inside a
    message; `_channel` and `_recipient` say where its body goes). The analysis bodies are kept
    apart as `reasoning`. Markers count where `_markers` says they are markers only."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "header"
        self._channel: str | None = None
        self._recipient: str | None = None
        self._markers = _Markers()
        self._start = 0  # where `_buffer` starts in the text fed
        self.reasoning = ""

    def feed(self, text_delta: str) -> list[str | ToolCallDelta]:
        self._markers.add(text_delta)
        return super().feed(text_delta)

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if self._mode == "header":
                at = self._find(MESSAGE)
                if at < 0:
                    if final:  # no harmony markup (or a header cut off): plain content
                        self._text(out, self._take(len(self._buffer)))
                    return
                self._read_header(at)
                self._take(at + len(MESSAGE))
                self._mode = "body"
            end, marker = self._first_end()
            if end < 0 and not final:
                if self._streams_text():  # text as it comes, less what may begin an end marker
                    keep = max(partial_tag_length(self._buffer, m) for m in MESSAGE_ENDS)
                    self._text(out, self._take(len(self._buffer) - keep))
                return
            body = self._take(len(self._buffer) if end < 0 else end)
            self._take(len(marker))
            self._end_message(out, body)
            self._mode = "header"
            if end < 0:
                return

    def _take(self, n: int) -> str:
        """The first `n` characters of `_buffer`, removed from it."""
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        self._start += n
        return taken

    def _find(self, marker: str, begin: int = 0, end: int | None = None) -> int:
        """Where the first real `marker` in `_buffer[begin:end]` starts; -1 if none."""
        at = self._buffer.find(marker, begin, end)
        while at >= 0 and not self._markers.at(self._start + at, self._start + at + len(marker)):
            at = self._buffer.find(marker, at + 1, end)
        return at

    def _first_end(self) -> tuple[int, str]:
        """Where the first message end marker in `_buffer` is, and which; (-1, "") if none."""
        found = [(at, m) for m in MESSAGE_ENDS if (at := self._find(m)) >= 0]
        return min(found) if found else (-1, "")

    def _read_header(self, length: int) -> None:
        """The header in `_buffer[:length]`, from its last <|start|> on: the word after
        <|channel|>, and the recipient (`to=`)."""
        begin = 0
        while (at := self._find(START, begin, length)) >= 0:
            begin = at + len(START)
        channel_at = self._find(CHANNEL, begin, length)
        channel = _WORD.match(self._buffer, channel_at + len(CHANNEL), length) if channel_at >= 0 else None
        recipient = _RECIPIENT.search(self._buffer[begin:length])
        self._channel = channel.group(1) if channel else None
        self._recipient = recipient.group(1) if recipient else None

    def _streams_text(self) -> bool:
        return self._recipient is None and self._channel != "analysis"

    def _end_message(self, out: list, body: str) -> None:
        if self._recipient is not None:
            if not self._recipient.startswith(FUNCTIONS):  # gpt-oss's built-ins (python, browser.*): not offered
                self._reject(out, body, f"a message to {self._recipient!r}, not to an offered function "
                                        f"({FUNCTIONS}NAME)")
                return
            name = self._recipient.removeprefix(FUNCTIONS)
            decoded = _decode_arguments(name, body)
            if decoded.error is None:
                self._accept(out, decoded)
            else:
                self._reject(out, body, decoded.error)
        elif self._channel == "analysis":
            self.reasoning += body
        else:
            self._text(out, body)


def _decode_arguments(name: str, body: str) -> _Decoded:
    """A call's body: its arguments' JSON object."""
    if not name:
        return _Decoded(error="a harmony tool call needs a recipient name")
    try:
        arguments = _loads(body) if body.strip() else {}
    except ValueError as exc:
        return _Decoded(error=f"invalid JSON in arguments of {name!r} ({exc})")
    if not isinstance(arguments, dict):
        return _Decoded(error=f"arguments of {name!r} must be a JSON object", valid_json=True)
    try:
        arguments_json = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return _Decoded(error=f"arguments of {name!r} nested too deeply", valid_json=True)
    return _Decoded(name, arguments, None, valid_json=True, arguments_json=arguments_json)


class HarmonyToolParser:
    """gpt-oss's tool calls (commentary messages to `functions.NAME`), its answer (final and
    recipient-less commentary messages) as content, its analysis messages left out of the
    content (a stream's `reasoning`)."""

    name = "harmony"

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        stream.feed(text)
        return stream.finish()

    def stream(self) -> ToolCallStream:
        return _HarmonyStream()


class HarmonyChatFormat:
    """gpt_oss: the checkpoint's own template (`template` None), the harmony parser, and turns
    that end at <|return|> or <|call|>."""

    template = None
    tool_parser = HarmonyToolParser.name
    end_of_turn_tokens = END_OF_TURN_TOKENS


@hookimpl
def register_tool_parsers(register) -> None:
    register(HarmonyToolParser.name, HarmonyToolParser())


@hookimpl
def register_chat_formats(register) -> None:
    register("gpt_oss", HarmonyChatFormat())
