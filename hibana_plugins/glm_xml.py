"""The "glm45" tool parser: the calls of GLM-4.5, GLM-4.5-Air and GLM-4.6 (model_type glm4_moe).

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7's template writes the same without the newlines (`<tool_call>NAME<arg_key>K</arg_key>
<arg_value>V</arg_value></tool_call>`); both are read. A value is text: the templates write a string
as it is and any other value as JSON (`v | tojson`). So a value's type is the tool's schema's, read
as the qwen3_coder parser reads it (`takes_tools`: a string parameter keeps what it spells, "007"
stays "007"); where the schema says no type (no tools, a parameter it does not declare), the value
is the JSON it spells, else its text.

The grammar (`hibana_core.turn.SYNTAX["glm45"]`) holds each call to an offered tool and its
arguments to the schema through xgrammar's `glm_xml` style, which writes them in this form.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, NamedTuple

from hibana_plugins.hookspecs import ToolCallStream, hookimpl
from hibana_plugins.qwen_xml import (_PADDING, SchemaTypedToolParser, _CallBlockStream, _json, _kinds, _plain_string,
                                      end_of_value, end_outside_values, parameter_types, typed_value)
from hibana_plugins.qwen_xml import _value_begun as _typed_value_begun
from hibana_plugins.tool_parsers import _accepted, _Decoded, _loads, partial_tag_length

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"[^<>\s]+")
_AFTER_VALUE = re.compile(r"\s*(?:<arg_key>|</tool_call>|\Z)")
"""What follows an argument's `</arg_value>`: the next argument, the call's end."""
_JSON_BEGUN = re.compile(r"-?\d*(\.\d*)?([eE][+-]?\d*)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")
"""What a JSON number, true, false or null cut short looks like."""


def glm_value(text: str, schema: Any) -> Any:
    """An argument's text as its value (module docstring): of the type its schema says, where it
    says one; else the JSON it spells, else the text."""
    if _kinds(schema):
        if not _plain_string(schema):  # the whitespace character the grammar allows each side of it
            text = text[1:] if text[:1] and text[0] in _PADDING else text
            text = text[:-1] if text[-1:] and text[-1] in _PADDING else text
        return typed_value(text, schema)
    try:
        return _loads(text)
    except ValueError:
        return text


class _Argument(NamedTuple):
    """One argument of a call's text, as `_arguments` reads it; or, with `error`, text that is none."""

    key: str = ""
    text: str = ""         # its value's text
    closed: bool = True    # False: the text ended inside it (`rest` says where)
    error: str | None = None
    rest: str = ""         # with `error`, or not `closed`: the text from where it is no whole argument


def _arguments(name: str, inner: str, schemas: dict[str, Any]) -> Iterator[_Argument]:
    """The arguments of a call's text after its name (`inner`), in order, until text that is no
    argument (`error`), or one the text ends inside (not `closed`)."""
    at = 0
    while True:
        start = inner.find(KEY_START, at)
        outside = inner[at:start if start >= 0 else len(inner)]
        if outside.strip():
            yield _Argument(error=f"text outside an argument in the call of {name!r}: {outside.strip()[:60]!r}",
                            rest=inner[at:])
            return
        if start < 0:
            return
        head = start + len(KEY_START)
        key_end = inner.find(KEY_END, head)
        if key_end < 0:
            yield _Argument(closed=False, error=f"an argument of {name!r} needs its {KEY_END}", rest=inner[start:])
            return
        key = inner[head:key_end]
        key = key if key in schemas else key.strip()
        if not key:
            yield _Argument(error=f"an argument of {name!r} needs a name: {inner[start:start + 60]!r}",
                            rest=inner[start:])
            return
        value = inner.find(VALUE_START, key_end + len(KEY_END))
        between = inner[key_end + len(KEY_END):value if value >= 0 else len(inner)]
        if value < 0 or between.strip():
            yield _Argument(key, closed=False, error=f"argument {key!r} of {name!r} needs its {VALUE_START}",
                            rest=inner[key_end + len(KEY_END):])
            return
        head = value + len(VALUE_START)
        end = end_of_value(inner, head, VALUE_END, _AFTER_VALUE)
        if end < 0:
            yield _Argument(key, inner[head:], closed=False, rest=inner[head:],
                            error=f"argument {key!r} of {name!r} needs its {VALUE_END}")
            return
        yield _Argument(key, inner[head:end])
        at = end + len(VALUE_END)


def _split_name(body: str) -> tuple[str, str]:
    """A call's text after `<tool_call>`: its name (as written, whitespace around it aside) and what
    follows it, from its first `<`."""
    cut = body.find("<")
    cut = len(body) if cut < 0 else cut
    return body[:cut].strip(), body[cut:]


def decode_glm_call(body: str, types: dict[str, dict[str, Any]]) -> _Decoded:
    """One call's text between `<tool_call>` and `</tool_call>`: its name and arguments."""
    name, inner = _split_name(body)
    if not name:
        return _Decoded(error=f"a tool call needs a function name after {CALL_START}")
    if name not in types and not _NAME.fullmatch(name):  # (an offered tool's name may hold a space)
        return _Decoded(error=f"a tool call needs a function name, got {name[:60]!r}")
    schemas = types.get(name, {})
    arguments: dict[str, Any] = {}
    for argument in _arguments(name, inner, schemas):
        if argument.error is not None:
            return _Decoded(error=argument.error)
        if argument.key in arguments:
            return _Decoded(error=f"argument {argument.key!r} of {name!r} given twice")
        arguments[argument.key] = glm_value(argument.text, schemas.get(argument.key))
    return _accepted(name, arguments)


class _GlmStream(_CallBlockStream):
    """GLM-4.5's blocks: one cut inside its `</tool_call>` (from `</` on) is a call; one cut before it
    (its arguments may go on) is a cut call."""

    def _block_end(self, block: str) -> int:
        return end_outside_values(block, CALL_END, VALUE_START, VALUE_END, _AFTER_VALUE)

    def _decode(self, body: str) -> _Decoded:
        return decode_glm_call(body, self._types)

    def _ended_inside(self, out: list, raw: str) -> None:
        held = partial_tag_length(raw, CALL_END)  # ("<" alone may begin an <arg_key>)
        decoded = decode_glm_call(raw[:len(raw) - held], self._types)
        if decoded.error is None and held >= 2:
            self._accept(out, decoded)
        else:
            self._reject(out, CALL_START + raw, f"unclosed {CALL_START}: "
                                                f"{decoded.error or f'its arguments need {CALL_END}'}", cut=True)


class GlmToolParser(SchemaTypedToolParser):
    """GLM-4.5's `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`
    calls (module docstring). `takes_tools`: the chat layer opens its streams with the turn's tools,
    whose schemas type the values."""

    name = "glm45"

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        return _GlmStream(tools)

    def cut_call_parts(self, cut_call: str, tools: list[dict] | None = None) -> tuple[str, str]:
        """(the name, the arguments) a call cut off by max_tokens had begun (a `CutCall`'s text:
        `<tool_call>`, then the call): the name (what of it was written), then the arguments so
        far as JSON text, typed by the turn's `tools` as a whole call's are (`cut_arguments_json`);
        ("", "") for what it has not reached."""
        if not cut_call.lstrip().startswith(CALL_START):
            return "", ""
        name, inner = _split_name(cut_call.lstrip()[len(CALL_START):])
        return name, cut_arguments_json(name, inner, parameter_types(tools).get(name, {}))


def cut_arguments_json(name: str, inner: str, schemas: dict[str, Any]) -> str:
    """The arguments of a call max_tokens cut off (`inner`: what it wrote after its name) as the JSON
    text a hermes call's would be so far, what a client reads of a cut call (LangChain's invalid
    call, a structured answer's content): the arguments it closed, typed as a whole call's, then the
    one it was writing, its key and its value so far (`_value_begun`), the object left open; closed
    where the cut fell in `</tool_call>`; "" before any argument began."""
    members: dict[str, str] = {}  # the closed arguments: key -> the member's JSON text
    begun: str | None = None  # the member the cut fell in ("": only its tag begun)
    for argument in _arguments(name, inner, schemas):
        if argument.closed and argument.error is not None:
            rest = argument.rest.strip()
            if len(rest) >= 2 and CALL_END.startswith(rest):  # all written: the cut fell in </tool_call>
                return "{" + ", ".join(members.values()) + "}"
            if len(rest) > 1 and KEY_START.startswith(rest):  # ("<" alone may begin either tag)
                begun = ""
            break
        if not argument.key:  # cut inside a key
            key = argument.rest[len(KEY_START):]
            begun = json.dumps(key[:len(key) - partial_tag_length(key, KEY_END)], ensure_ascii=False)[:-1]
            break
        member = json.dumps(argument.key, ensure_ascii=False) + ": "
        if not argument.closed:  # cut inside its value, or before it
            text = argument.text[:len(argument.text) - partial_tag_length(argument.text, VALUE_END)]
            value = _value_begun(text, schemas.get(argument.key))
            begun = None if value is None else member + value
            break
        value = _json(glm_value(argument.text, schemas.get(argument.key)))
        if value is None or argument.key in members:
            break
        members[argument.key] = member + value
    if not members and begun is None:
        return ""
    text = "{" + ", ".join(members.values())
    return text if begun is None else text + (", " if members else "") + begun


def _value_begun(text: str, schema: Any) -> str | None:
    """A value max_tokens cut off, as JSON text so far: typed by its schema as qwen3_coder's are; where
    no schema types it, the JSON it spells, or its text where it begins an object, an array, a number,
    true, false or null, else an unclosed string; None where it nests too deeply."""
    if _kinds(schema):
        return _typed_value_begun(text, schema)
    value = glm_value(text, schema)
    if not isinstance(value, str):
        return _json(value)
    if text.lstrip()[:1] in ("{", "[") or _JSON_BEGUN.fullmatch(text.strip()):
        return text.strip()  # as written: what may become the value's JSON
    return json.dumps(text, ensure_ascii=False)[:-1]  # (unclosed)


@hookimpl
def register_tool_parsers(register) -> None:
    register(GlmToolParser.name, GlmToolParser())
