"""Tool calls written as `<call name="get_weather">{"city": "Paris"}</call>`, or in the hermes form
`<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`: a parser for a
model family fine-tuned on both (the bundled demo model writes the second).

Streaming is per call: text outside calls streams as it comes (holding back what may be the start
of a call tag), and each call is emitted whole once its closing tag arrives. `tool_call_grammar`
gives Hibana the grammar that holds the model's calls to the offered tools.
"""

from __future__ import annotations

import json
import re

from hibana_plugins.hookspecs import ParsedOutput, ToolCall, ToolCallDelta
from hibana_plugins.tool_parsers import new_call_id, partial_tag_length

TAGS = {'<call name="': "</call>", "<tool_call>": "</tool_call>"}  # open -> close
CALL = re.compile(r'<call name="([^"<>]+)"\s*>(.*)</call>', re.DOTALL)
HERMES = re.compile(r"<tool_call>(.*)</tool_call>", re.DOTALL)


class ExampleXmlToolParser:
    name = "example_xml"

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        stream.feed(text)
        return stream.finish()

    def stream(self) -> ExampleXmlStream:
        return ExampleXmlStream()

    def tool_call_grammar(self, tools: list[dict], tool_choice: str, parallel: bool) -> dict:
        """The calls this parser reads, as a grammar (xgrammar's structural tag format) that
        Hibana holds the model to: the hermes form, which this model family writes, with each
        tool's name and argument schema. "auto": calls open at `<tool_call>` in free text;
        "required" or a tool's name: calls only, from the first token."""
        functions = [t["function"] for t in tools if tool_choice in ("auto", "required")
                     or t["function"]["name"] == tool_choice]
        tags = [{"type": "tag", "begin": '<tool_call>\n{"name": ' + json.dumps(f["name"]) + ', "arguments": ',
                 "content": {"type": "json_schema",
                             "json_schema": f.get("parameters") or {"type": "object", "properties": {}}},
                 "end": "}\n</tool_call>"} for f in functions]
        if tool_choice == "auto":
            form = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                    "stop_after_first": not parallel}
        else:
            form = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                    "stop_after_first": not parallel}
        return {"type": "structural_tag", "format": form}


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
            found = [(self._buffer.find(tag), tag) for tag in TAGS if tag in self._buffer]
            if not found:
                keep = 0 if final else max(partial_tag_length(self._buffer, tag) for tag in TAGS)
                self._text(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            start, tag = min(found)
            self._text(out, self._buffer[:start])
            self._buffer = self._buffer[start:]
            end = self._buffer.find(TAGS[tag])
            if end < 0 and not final:
                break  # wait for the whole call
            block_end = len(self._buffer) if end < 0 else end + len(TAGS[tag])
            block, self._buffer = self._buffer[:block_end], self._buffer[block_end:]
            self._call(out, block)
        return out

    def _call(self, out: list, block: str) -> None:
        name, arguments, reason = _read_call(block)
        if name is None:
            self._errors.append(reason)
            self._text(out, block)
            return
        call = ToolCall(new_call_id(), name, arguments)
        index = len(self._calls)
        self._calls.append(call)
        out.append(ToolCallDelta(index, call.id, call.name))
        out.append(ToolCallDelta(index, None, None, json.dumps(arguments)))

    def _text(self, out: list, text: str) -> None:
        if text:
            self._content.append(text)
            out.append(text)


def _read_call(block: str) -> tuple[str | None, dict | None, str]:
    """(name, arguments, "") for a well-formed call block, else (None, None, why)."""
    xml, hermes = CALL.fullmatch(block), HERMES.fullmatch(block)
    if not (xml or hermes):
        return None, None, 'expected <call name="...">...</call> or <tool_call>...</tool_call>'
    try:
        payload = json.loads(xml.group(2) if xml else hermes.group(1))
    except json.JSONDecodeError as exc:
        return None, None, f"invalid JSON ({exc})"
    if xml:
        name, arguments = xml.group(1), payload
    elif isinstance(payload, dict):
        name, arguments = payload.get("name"), payload.get("arguments", {})
    else:
        name, arguments = None, None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None, None, "a call needs a name and a JSON object of arguments"
    return name, arguments, ""
