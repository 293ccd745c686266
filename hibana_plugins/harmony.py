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

The chat format keeps the checkpoint's own template (gpt-oss checkpoints ship it; the chat layer
keeps message contents from turning into control tokens) and names the parser, and its turns end
at <|return|> and <|call|> only: <|end|> closes the analysis message in the middle of a turn.
"""

from __future__ import annotations

import json
import re

from hibana_plugins.hookspecs import ParsedOutput, ToolCallStream, hookimpl
from hibana_plugins.tool_parsers import _Decoded, _loads, _Stream, partial_tag_length

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
END_OF_TURN_TOKENS = ("<|return|>", "<|call|>")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class _HarmonyStream(_Stream):
    """Modes: "header" (collecting one message's header until <|message|>), "body" (inside a
    message; `_channel` and `_recipient` say where its body goes). The analysis bodies are kept
    apart as `reasoning`."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "header"
        self._channel: str | None = None
        self._recipient: str | None = None
        self.reasoning = ""

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if self._mode == "header":
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    if final:  # no harmony markup (or a header cut off): plain content
                        self._text(out, self._buffer)
                        self._buffer = ""
                    return
                self._read_header(self._buffer[:at])
                self._buffer = self._buffer[at + len(MESSAGE):]
                self._mode = "body"
            end, marker = _first_end(self._buffer)
            if end < 0 and not final:
                if self._streams_text():  # text as it comes, less what may begin an end marker
                    keep = max(partial_tag_length(self._buffer, m) for m in MESSAGE_ENDS)
                    cut = len(self._buffer) - keep
                    self._text(out, self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                return
            body = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(marker):]
            self._end_message(out, body)
            self._mode = "header"
            if end < 0:
                return

    def _read_header(self, header: str) -> None:
        header = header.split(START)[-1]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
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


def _first_end(text: str) -> tuple[int, str]:
    """Where the first message end marker in `text` is, and which; (-1, "") if none."""
    found = [(text.find(m), m) for m in MESSAGE_ENDS if m in text]
    return min(found) if found else (-1, "")


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
