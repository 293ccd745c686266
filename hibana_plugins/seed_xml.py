"""The "seed_oss" tool parser: the calls of ByteDance's Seed-OSS (model_type seed_oss).

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    <parameter=days>3</parameter>
    </function>
    </seed:tool_call>
    <seed:tool_call>
    <function=get_time>
    <parameter=zone>CET</parameter>
    </function>
    </seed:tool_call>

Qwen3-Coder's function and parameter syntax in Seed's own block tags, one call a block as its
template writes a turn's calls (a block of several calls is read too). A value is text, nothing
around it: the template writes a string as it is and any other value as Python writes it
(`value | string`: `True`, `{'a': 1}`). So its type is the tool's schema's, read as qwen3_coder reads
it (`takes_tools`: a string parameter keeps what it spells, "007" stays "007", a newline that begins it
too; an integer's, a boolean's, an object's or an array's text becomes that value; text not of its
type, and a parameter the schema does not declare, stay strings).

A block is decided at its `</seed:tool_call>`, the first after a call's `</function>` (a value's
text, code, may hold the tags): its calls, or, where any of it is malformed, its text as content
with the error. A generation that ends inside a block keeps the calls it closed; the one it was
writing is a cut call (`cut_call_parts`: its name and its arguments so far as JSON).

The grammar (`hibana_core.turn.SYNTAX["seed_oss"]`) holds each call to an offered tool and its
parameters to the schema through xgrammar's `qwen_xml` style, a block a call, as the template
writes them. Seed's thinking (`<seed:think>...</seed:think>`) is the chat layer's
(`hibana_core.turn.SEED_THINK`), apart before the text reaches this parser.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from hibana_plugins.hookspecs import ToolCallStream, hookimpl
from hibana_plugins.qwen_xml import (FUNCTION_START, SchemaTypedToolParser, _CallBlockStream, cut_call_body_parts,
                                      decode_xml_call)
from hibana_plugins.qwen_xml import _block_end as _xml_block_end
from hibana_plugins.tool_parsers import _Decoded, partial_tag_length

BLOCK_START, BLOCK_END = "<seed:tool_call>", "</seed:tool_call>"
_NEXT_CALL = re.compile(r"</function>\s*(?=<function=)")
"""Where a call may end in a block of several: at a `</function>` that the next call's tag follows."""


class _Block(NamedTuple):
    """A block's text (between its tags), as `_read_block` reads it."""

    calls: tuple[_Decoded, ...]  # the whole calls it begins with
    cut: int                     # where the text that is none begins (its length: all are calls)
    error: str | None = None     # why that text is none


def _decode(body: str, types: dict[str, dict[str, Any]]) -> _Decoded:
    """One call's text: qwen3_coder's, its values unpadded (Seed's template writes none around them)."""
    return decode_xml_call(body, types, padded=False, opener=BLOCK_START)


def _read_block(body: str, types: dict[str, dict[str, Any]]) -> _Block:
    """The calls of a block's text, in order, up to the first text that is no whole call: the rest
    of it as one call where it reads as one (a value may hold `</function>`), else the first call
    that reads up to a `</function>` the next call's tag follows."""
    calls: list[_Decoded] = []
    at = 0
    while True:
        rest = body[at:]
        if not rest.strip():
            return _Block(tuple(calls), len(body),
                          None if calls else f"a {BLOCK_START} block needs {FUNCTION_START}NAME>")
        whole = _decode(rest, types)
        if whole.error is None:
            return _Block((*calls, whole), len(body))
        for end in (m.end() for m in _NEXT_CALL.finditer(rest)):
            decoded = _decode(rest[:end], types)
            if decoded.error is None:
                calls.append(decoded)
                at += end
                break
        else:
            return _Block(tuple(calls), at, whole.error)


class _SeedStream(_CallBlockStream):
    """Seed-OSS's blocks, each decided whole at its `</seed:tool_call>`; one the text ends inside keeps
    the calls it closed, and the rest is a cut call."""

    opener, closer = BLOCK_START, BLOCK_END

    def _block_end(self, block: str) -> int:
        return _xml_block_end(block, BLOCK_START, BLOCK_END, self._opener_at(block))

    def _whole_block(self, out: list, body: str) -> None:
        block = _read_block(body, self._types)
        if block.error is not None:
            self._reject(out, BLOCK_START + body + BLOCK_END, block.error)
            return
        for decoded in block.calls:
            self._accept(out, decoded)

    def _ended_inside(self, out: list, raw: str) -> None:
        # (cut in its end tag: its calls are whole)
        block = _read_block(raw[:len(raw) - partial_tag_length(raw, BLOCK_END)], self._types)
        if not block.calls:
            self._reject(out, BLOCK_START + raw, f"unclosed {BLOCK_START}: {block.error}", cut=True)
            return
        for decoded in block.calls:
            self._accept(out, decoded)
        if block.error is not None:  # after its closed calls, the call it was writing
            self._reject(out, raw[block.cut:], f"unclosed {BLOCK_START}: {block.error}", cut=True)


class SeedOssToolParser(SchemaTypedToolParser):
    """Seed-OSS's `<seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter>...` calls (module
    docstring). `takes_tools`: the chat layer opens its streams with the turn's tools, whose schemas
    type the values."""

    name = "seed_oss"

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        return _SeedStream(tools)

    def cut_call_parts(self, cut_call: str, tools: list[dict] | None = None) -> tuple[str, str]:
        """(the name, the arguments) a call cut off by max_tokens had begun (a `CutCall`'s text: its
        block from `<seed:tool_call>`, or, after calls the block closed, its `<function=`): the name
        (what of it was written), then the arguments so far as JSON text, typed by the turn's `tools`
        as a whole call's are (qwen3_coder's `cut_arguments_json`); ("", "") for what it has not
        reached."""
        text = cut_call.lstrip()
        if not text.startswith((BLOCK_START, FUNCTION_START)):
            return "", ""
        return cut_call_body_parts(text.removeprefix(BLOCK_START), tools, padded=False)


@hookimpl
def register_tool_parsers(register) -> None:
    register(SeedOssToolParser.name, SeedOssToolParser())
