"""The "minimax_m2" tool parser: the calls of MiniMax-M2, M2.1 and M2.5 (model_type minimax_m2).

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    <parameter name="zone">CET</parameter>
    </invoke>
    </minimax:tool_call>

One block holds a turn's calls, an `<invoke>` each. A value is text: the template writes a string as
it is and any other value as JSON (`v | tojson`), nothing around it. So its type is the tool's
schema's, read as qwen3_coder reads it (`takes_tools`: a string parameter keeps what it spells,
"007" stays "007"; an integer's, a boolean's, an object's or an array's text becomes that value;
text not of its type, and a parameter the schema does not declare, stay strings), as MiniMax's own
reference parser types them. A value's text may hold the markup (code: `</invoke>`,
`</minimax:tool_call>`): a value ends at its first `</parameter>`, the block at the first
`</minimax:tool_call>` outside the values.

A block is decided whole: its calls, or, where any of it is malformed, its text as content with the
error. A generation that ends inside a block keeps the calls it closed (their `</invoke>` came); the
one it was writing is a cut call (`cut_call_parts`: its name and its arguments so far as JSON).

The grammar (`hibana_core.turn.SYNTAX["minimax_m2"]`) holds each call to an offered tool and its
parameters to the schema through xgrammar's `minimax_xml` style, the calls of a turn in one block,
as the template writes them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Collection, NamedTuple

from hibana_plugins.hookspecs import ToolCallStream, hookimpl
from hibana_plugins.qwen_xml import (_PADDING, SchemaTypedToolParser, _CallBlockStream, _json, _kinds,
                                      _plain_string, _value_begun, end_of_value, end_outside_values, parameter_types,
                                      typed_value)
from hibana_plugins.tool_parsers import _accepted, _Decoded, partial_tag_length

BLOCK_START, BLOCK_END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE_START, INVOKE_END = '<invoke name="', "</invoke>"
PARAMETER_START, PARAMETER_END = '<parameter name="', "</parameter>"
HEAD_END = '">'  # after a call's or a parameter's name
_NAME = re.compile(r'[^<>"\s]+')
_AFTER_PARAMETER = re.compile(r'\s*(?:<parameter name="|</invoke>|\Z)')
"""What follows a parameter's `</parameter>`: the next parameter, the call's end."""


def _unpadded(text: str, schema: Any) -> str:
    """A value's text less the whitespace character the grammar allows each side of a value whose
    schema is more than a plain string (" 3\\n" of an integer); a plain string's text is whole."""
    if _kinds(schema) and not _plain_string(schema):
        text = text[1:] if text[:1] and text[0] in _PADDING else text
        text = text[:-1] if text[-1:] and text[-1] in _PADDING else text
    return text


def minimax_value(text: str, schema: Any) -> Any:
    """A parameter's text as its value (module docstring)."""
    return typed_value(_unpadded(text, schema), schema)


def _head(text: str, at: int, names: Collection[str]) -> tuple[str, int] | None:
    """The name a tag's head spells from `at` (past its `name="`) and where the head ends (past its
    `">`): a name of `names` as the template writes it, whatever it holds (an offered tool's name
    may hold a space), else the text up to the first `">`; None where the head has not ended."""
    declared = [n for n in names if text.startswith(n + HEAD_END, at)]
    if declared:
        name = max(declared, key=len)
        return name, at + len(name) + len(HEAD_END)
    end = text.find(HEAD_END, at)
    return None if end < 0 else (text[at:end], end + len(HEAD_END))


class _Parameter(NamedTuple):
    key: str
    text: str             # its value's text, as written
    closed: bool = True   # False: the text ended inside its value (no </parameter>)


class _Invoke(NamedTuple):
    """One call's text after its `<invoke name="NAME">`, as `_invoke` reads it."""

    parameters: tuple[_Parameter, ...]  # in order; the last one not `closed` where the text ended in its value
    end: int = -1              # past its </invoke>; -1: it is no whole call
    error: str | None = None   # with end -1: why
    rest: str = ""             # and the text from where it is none


def _invoke(name: str, inner: str, schemas: dict[str, Any]) -> _Invoke:
    """The parameters of the call of `name` (`inner`: its text after the head), up to its `</invoke>`."""
    parameters: list[_Parameter] = []
    at = 0
    while True:
        stripped = inner[at:].lstrip()
        at = len(inner) - len(stripped)
        if stripped.startswith(INVOKE_END):
            return _Invoke(tuple(parameters), at + len(INVOKE_END))
        if not stripped.startswith(PARAMETER_START):
            error = (f"text outside a parameter in the call of {name!r}: {stripped[:60]!r}" if stripped
                     else f"the call of {name!r} needs its {INVOKE_END}")
            return _Invoke(tuple(parameters), error=error, rest=stripped)
        head = _head(inner, at + len(PARAMETER_START), schemas)
        if head is None:
            return _Invoke(tuple(parameters), error=f"a parameter of {name!r} needs its {HEAD_END}", rest=stripped)
        key, value = head
        if key not in schemas and not _NAME.fullmatch(key):
            return _Invoke(tuple(parameters), error=f"a parameter of {name!r} needs a name: {stripped[:60]!r}",
                           rest=stripped)
        if any(p.key == key for p in parameters):
            return _Invoke(tuple(parameters), error=f"parameter {key!r} of {name!r} given twice", rest=stripped)
        end = end_of_value(inner, value, PARAMETER_END, _AFTER_PARAMETER)
        if end < 0:
            return _Invoke((*parameters, _Parameter(key, inner[value:], closed=False)), rest=stripped,
                           error=f"parameter {key!r} of {name!r} needs its {PARAMETER_END}")
        parameters.append(_Parameter(key, inner[value:end]))
        at = end + len(PARAMETER_END)


class _Block(NamedTuple):
    """A block's text (between its tags), as `_read_block` reads it."""

    calls: tuple[_Decoded, ...]  # the whole calls it begins with
    cut: int                     # where the text that is none begins (its length: all are calls)
    error: str | None = None     # why that text is none (none: an error where it holds no call)


def _read_block(body: str, types: dict[str, dict[str, Any]]) -> _Block:
    """The calls of a block's text, in order, up to the first text that is no whole call."""
    calls: list[_Decoded] = []
    at = 0
    while True:
        stripped = body[at:].lstrip()
        start = len(body) - len(stripped)
        if not stripped:
            return _Block(tuple(calls), len(body),
                          None if calls else f"a {BLOCK_START} block needs an {INVOKE_START}NAME{HEAD_END}")
        if not stripped.startswith(INVOKE_START):
            return _Block(tuple(calls), start, f"{INVOKE_START}NAME{HEAD_END} begun, not written"
                          if INVOKE_START.startswith(stripped) else
                          f"text outside an invoke in a {BLOCK_START} block: {stripped[:60]!r}")
        head = _head(body, start + len(INVOKE_START), types)
        if head is None:
            return _Block(tuple(calls), start, f"an invoke needs its {HEAD_END} after the function name")
        name, inner = head
        if name not in types and not _NAME.fullmatch(name):
            return _Block(tuple(calls), start, f"a tool call needs a function name, got {name[:60]!r}")
        schemas = types.get(name, {})
        invoke = _invoke(name, body[inner:], schemas)
        if invoke.error is not None:
            return _Block(tuple(calls), start, invoke.error)
        decoded = _accepted(name, {p.key: minimax_value(p.text, schemas.get(p.key)) for p in invoke.parameters})
        if decoded.error is not None:
            return _Block(tuple(calls), start, decoded.error)
        calls.append(decoded)
        at = inner + invoke.end


class _MinimaxStream(_CallBlockStream):
    """MiniMax-M2's blocks, each decided whole at its `</minimax:tool_call>`; one the text ends inside
    keeps the calls it closed, and the rest is a cut call."""

    opener, closer = BLOCK_START, BLOCK_END

    def _block_end(self, block: str) -> int:
        return end_outside_values(block, BLOCK_END, PARAMETER_START, PARAMETER_END, _AFTER_PARAMETER)

    def _whole_block(self, out: list, body: str) -> None:
        block = _read_block(body, self._types)
        if block.error is not None:
            self._reject(out, BLOCK_START + body + BLOCK_END, block.error)
            return
        for decoded in block.calls:
            self._accept(out, decoded)

    def _ended_inside(self, out: list, raw: str) -> None:
        block = _read_block(raw, self._types)
        if not block.calls:
            self._reject(out, BLOCK_START + raw, f"unclosed {BLOCK_START}: {block.error}", cut=True)
            return
        for decoded in block.calls:
            self._accept(out, decoded)
        rest = raw[block.cut:].rstrip()  # after its closed calls: nothing, or the block's end tag begun, or
        if rest and not (len(rest) >= 2 and BLOCK_END.startswith(rest)):  # the call it was writing
            self._reject(out, rest, f"unclosed {BLOCK_START}: {block.error}", cut=True)


class MinimaxToolParser(SchemaTypedToolParser):
    """MiniMax-M2's `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...`
    calls (module docstring). `takes_tools`: the chat layer opens its streams with the turn's tools,
    whose schemas type the values."""

    name = "minimax_m2"

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        return _MinimaxStream(tools)

    def cut_call_parts(self, cut_call: str, tools: list[dict] | None = None) -> tuple[str, str]:
        """(the name, the arguments) a call cut off by max_tokens had begun (a `CutCall`'s text: its
        block from `<minimax:tool_call>`, or, after calls the block closed, its `<invoke>`): the name
        (what of it was written), then the arguments so far as JSON text, typed by the turn's `tools`
        as a whole call's are (`cut_arguments_json`); ("", "") for what it has not reached."""
        text = cut_call.lstrip()
        text = text[len(BLOCK_START):].lstrip() if text.startswith(BLOCK_START) else text
        if not text.startswith(INVOKE_START):
            return "", ""
        types = parameter_types(tools)
        head = _head(text, len(INVOKE_START), types)
        if head is None:  # cut inside the name, or its `">`: what of the name was written
            written = text[len(INVOKE_START):]
            return written[:len(written) - partial_tag_length(written, HEAD_END)], ""
        name, inner = head
        return name, cut_arguments_json(name, text[inner:], types.get(name, {}))


def cut_arguments_json(name: str, inner: str, schemas: dict[str, Any]) -> str:
    """The arguments of a call max_tokens cut off (`inner`: what it wrote after its
    `<invoke name="NAME">`) as the JSON text a hermes call's would be so far, what a client reads of
    a cut call (LangChain's invalid call, a structured answer's content): the parameters it closed,
    typed as a whole call's, then the one it was writing, its name and its value so far (qwen3_coder's
    `_value_begun`), the object left open; closed where the cut fell in `</invoke>`; "" before any
    parameter's tag began."""
    invoke = _invoke(name, inner, schemas)
    members: list[str] = []
    for parameter in invoke.parameters:
        if not parameter.closed:
            break
        value = _json(minimax_value(parameter.text, schemas.get(parameter.key)))
        if value is None:
            return "{" + ", ".join(members)
        members.append(json.dumps(parameter.key, ensure_ascii=False) + ": " + value)
    rest = invoke.rest
    if invoke.end >= 0 or len(rest) >= 2 and INVOKE_END.startswith(rest):  # all written (cut in its end tag)
        return "{" + ", ".join(members) + "}"
    begun: str | None = None  # the member the cut fell in ("": only its tag begun)
    if invoke.parameters and not invoke.parameters[-1].closed:  # inside a value
        key, text, _ = invoke.parameters[-1]
        text = text[:len(text) - partial_tag_length(text, PARAMETER_END)]
        value = _value_begun(_unpadded(text, schemas.get(key)), schemas.get(key))
        begun = None if value is None else json.dumps(key, ensure_ascii=False) + ": " + value
    elif rest.startswith(PARAMETER_START) and HEAD_END not in rest:  # inside a parameter's name
        key = rest[len(PARAMETER_START):]
        begun = json.dumps(key[:len(key) - partial_tag_length(key, HEAD_END)], ensure_ascii=False)[:-1]
    elif len(rest) >= 2 and PARAMETER_START.startswith(rest):  # ("<" alone may begin either tag)
        begun = ""
    if not members and begun is None:
        return ""
    text = "{" + ", ".join(members)
    return text if begun is None else text + (", " if members else "") + begun


@hookimpl
def register_tool_parsers(register) -> None:
    register(MinimaxToolParser.name, MinimaxToolParser())
