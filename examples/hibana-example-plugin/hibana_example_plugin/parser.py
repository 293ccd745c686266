"""Tool calls written as `<call name="get_weather">{"city": "Paris"}</call>`.

Streaming is per call: text outside calls streams as it comes (holding back what may be the start
of `<call name="`), and each call is emitted whole once its `</call>` arrives.
"""

from __future__ import annotations

import json
import re

from hibana_plugins.tool_parsers import (
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    new_call_id,
    partial_tag_length,
)

OPEN, CLOSE = '<call name="', "</call>"
CALL = re.compile(r'<call name="([^"<>]+)"\s*>(.*)</call>', re.DOTALL)


class ExampleXmlToolParser:
    name = "example_xml"

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        stream.feed(text)
        return stream.finish()

    def stream(self) -> ExampleXmlStream:
        return ExampleXmlStream()


class ExampleXmlStream:
    def __init__(self) -> None:
        self._buffer = ""
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._errors: list[str] = []
        self._closed = False

    def feed(self, text_delta: str) -> list[str | ToolCallDelta]:
        self._buffer += text_delta
        return self._advance(final=False)

    def close(self) -> list[str | ToolCallDelta]:
        if self._closed:
            return []
        self._closed = True
        return self._advance(final=True)

    def finish(self) -> ParsedOutput:
        self.close()
        content = "".join(self._content).strip()
        return ParsedOutput(content, list(self._calls), "; ".join(self._errors) or None)

    def _advance(self, final: bool) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        while self._buffer:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else partial_tag_length(self._buffer, OPEN)
                self._text(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            self._text(out, self._buffer[:start])
            self._buffer = self._buffer[start:]
            end = self._buffer.find(CLOSE)
            if end < 0 and not final:
                break  # wait for the whole call
            block_end = len(self._buffer) if end < 0 else end + len(CLOSE)
            block, self._buffer = self._buffer[:block_end], self._buffer[block_end:]
            self._call(out, block)
        return out

    def _call(self, out: list, block: str) -> None:
        match = CALL.fullmatch(block)
        try:
            arguments = json.loads(match.group(2)) if match else None
        except json.JSONDecodeError as exc:
            arguments, reason = None, f"invalid JSON arguments ({exc})"
        else:
            reason = "arguments must be a JSON object" if match else 'expected <call name="...">'
        if not isinstance(arguments, dict):
            self._errors.append(reason)
            self._text(out, block)
            return
        call = ToolCall(new_call_id(), match.group(1), arguments)
        index = len(self._calls)
        self._calls.append(call)
        out.append(ToolCallDelta(index, call.id, call.name))
        out.append(ToolCallDelta(index, None, None, json.dumps(arguments)))

    def _text(self, out: list, text: str) -> None:
        if text:
            self._content.append(text)
            out.append(text)
