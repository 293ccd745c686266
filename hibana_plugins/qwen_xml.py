"""The "qwen3_coder" tool parser: Qwen3-Coder's XML calls (also Qwen3.5's and Nemotron 3's templates).

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text: the templates write a string as it is and any other value as JSON
(`args_value | tojson` for objects and arrays, `| string` for the rest). So the value's type comes
from the tool's schema, as vLLM's `qwen3_coder` parser reads it: the parser is given the turn's
tools (`takes_tools`), a string parameter keeps its text whatever it spells ("007" stays "007"),
an integer's or a boolean's text becomes that value, an object's or an array's is decoded. A
value whose text is not of its declared type, and a parameter the schema does not declare, stay
strings (text the schema cannot read is not guessed at). A block in the hermes form
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which these models write at times when
no grammar holds them, is read as the hermes parser reads it.

The grammar (`hibana_core.turn.SYNTAX["qwen3_coder"]`) holds each call to an offered tool and its
parameters to the schema through xgrammar's `qwen_xml` style, which writes them in this form.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable, Iterator, NamedTuple

from hibana_plugins.hookspecs import ParsedOutput, ToolCallStream, hookimpl
from hibana_plugins.tool_parsers import _accepted, _decode_call, _Decoded, _loads, _Stream, partial_tag_length

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.S)
_NAME = re.compile(r"[^<>\s]+")
_CALL_BEGUN = re.compile(r"\s*(?:<function=|\{)")
"""What follows a block's tag where a call begins: its function, or a call in the hermes form."""
_AFTER_PARAMETER = re.compile(r"\s*(?:<parameter=|</function>|\Z)")
"""What follows a parameter's `</parameter>` in a call's text: the next parameter, the call's end."""


def parameter_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{tool name: {parameter name: its schema}} of OpenAI-style `tools`, each schema's `$ref`s
    followed (`_followed`)."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found[function["name"]] = ({key: _followed(schema, parameters) for key, schema in properties.items()}
                                       if isinstance(properties, dict) else {})
    return found


_REF_DEPTH = 8
"""How many `$ref`s `_followed` follows one after another (a schema may point at itself)."""


def _followed(schema: Any, root: Any, depth: int = 0) -> Any:
    """A parameter's schema with the `$ref`s that say its type followed into `root` (the tool's
    parameters): its own and its anyOf/oneOf options'. Pydantic writes a nested model as
    {"$ref": "#/$defs/Model"} (an optional one as an anyOf of that and null), which the grammar
    writes as a JSON object; unfollowed, its text stayed a string."""
    if not isinstance(schema, dict) or depth > _REF_DEPTH:
        return schema
    if isinstance(schema.get("$ref"), str):
        from hibana_core.grammar.schema import _pointed  # here: the plugin manager imports this module without torch

        target = _pointed(root, schema["$ref"])
        return _followed(target, root, depth + 1) if isinstance(target, dict) else schema
    options = {key: [_followed(option, root, depth + 1) for option in schema[key]]
               for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list)}
    return {**schema, **options}


def _kinds(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (empty: not said)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} if isinstance(kind, list) \
        else set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            kinds |= _kinds(option)
    for value in schema.get("enum") or (() if "const" not in schema else (schema["const"],)):
        kinds.add(_type_of(value))
    return kinds


def _listed(schema: Any) -> list:
    """The string values an `enum` or `const` allows."""
    if not isinstance(schema, dict):
        return []
    values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
    return [v for v in values if isinstance(v, str)]


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema declares (module docstring)."""
    kinds = _kinds(schema)
    listed = _listed(schema)
    if listed and text not in listed and text.strip() in listed:  # a grammar pads an enum's value with whitespace
        return text.strip()
    if not kinds or kinds == {"string"}:
        return text
    stripped = text.strip()
    value: Any = text
    if stripped in _WORDS:  # the templates write Python's True / False / None for these (`| string`)
        value = _WORDS[stripped]
    else:
        try:
            value = _loads(stripped)
        except ValueError:
            if stripped[:1] in "[{":  # a Python literal (single-quoted strings) decoded as a model may write one
                try:
                    value = ast.literal_eval(stripped)
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    value = text
    kind = _type_of(value)
    if kind in kinds or (kind == "integer" and "number" in kinds):
        return value
    if kind == "number" and "integer" in kinds and float(value).is_integer():
        return int(value)
    return text


_PADDING = " \t\r\n"  # the whitespace xgrammar's qwen_xml style allows around a value (max_whitespace_cnt 1)
_ANNOTATIONS = frozenset({"type", "description", "title", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly"})


def _plain_string(schema: Any) -> bool:
    """Whether the grammar writes a parameter of `schema` as bare text (no whitespace around it): a
    string with no keyword that constrains it."""
    return isinstance(schema, dict) and schema.get("type") == "string" and schema.keys() <= _ANNOTATIONS


class _Parameter(NamedTuple):
    """One parameter of a call's text, as `_parameters` reads it; or, with `error`, text that is none."""

    key: str = ""
    text: str = ""             # its value's text, the padding around it taken off
    closed: bool = True        # False: it runs to the end of the text (no </parameter>, no parameter after it)
    error: str | None = None
    rest: str = ""             # with `error`: the text from where it is no parameter


def _parameters(name: str, inner: str, schemas: dict[str, Any], cut: bool = False,
                padded: bool = True) -> Iterator[_Parameter]:
    """The parameters of a call's text between `<function=NAME>` and `</function>` (`inner`), in order,
    until text that is none (`error`). `cut`: the text is all the model wrote, cut off; a tail of the last
    value that begins its `</parameter>` is no part of the value. `padded`: the template writes a newline
    each side of a value (Qwen3-Coder's; Seed-OSS's writes none, so a string's text is all its value)."""
    at = 0
    while True:
        start = inner.find(PARAMETER_START, at)
        if inner[at:start if start >= 0 else len(inner)].strip():
            outside = inner[at:start if start >= 0 else len(inner)]
            yield _Parameter(error=f"text outside a parameter in the call of {name!r}: {outside.strip()[:60]!r}",
                             rest=inner[at:])
            return
        if start < 0:
            return
        head = start + len(PARAMETER_START)
        declared = [k for k in schemas if inner.startswith(f"{k}>", head)]
        if declared:  # as the template and the grammar write it, whatever it holds (a space, a '>'): the longest
            key = max(declared, key=len)
            head_end = head + len(key)
        else:
            head_end = inner.find(">", head)
            key = inner[head:head_end].strip() if head_end >= 0 else ""
            if head_end < 0 or not _NAME.fullmatch(key):
                yield _Parameter(error=f"a parameter of {name!r} needs a name: {inner[start:start + 60]!r}",
                                 rest=inner[start:])
                return
        end = end_of_value(inner, head_end, PARAMETER_END, _AFTER_PARAMETER)
        # its </parameter> left out: the value runs to the next parameter, on a line of its own as the template
        # writes it (a value's text may hold "<parameter=" elsewhere: code)
        following = inner.find("\n" + PARAMETER_START, head_end)
        closed = True
        if end < 0 or 0 <= following < end:
            end = following if following >= 0 else len(inner)
            after = end
            closed = following >= 0 or not cut
        else:
            after = end + len(PARAMETER_END)
        value = inner[head_end + 1:end]
        if not closed:
            value = value[:len(value) - partial_tag_length(value, PARAMETER_END)]
        # the template's newlines around a value; where the schema is more than a plain string, the grammar's
        # whitespace (a character of it each side: " Paris\t" was kept, past a maxLength)
        pad = ("\n" if padded else "") if key not in schemas or _plain_string(schemas[key]) else _PADDING
        value = value[1:] if value[:1] and value[0] in pad else value
        value = value[:-1] if value[-1:] and value[-1] in pad else value
        yield _Parameter(key, value, closed)
        at = after


def decode_xml_call(body: str, types: dict[str, dict[str, Any]], padded: bool = True,
                    opener: str = CALL_START) -> _Decoded:
    """One call's text between `<tool_call>` and `</tool_call>` (`opener`: the block tag, as errors
    name it): its function and parameters (`padded`: `_parameters`')."""
    if body.lstrip().startswith("{"):  # the hermes form, which these models write at times unless held
        return _decode_call(body, require_arguments=False)
    match = _FUNCTION.fullmatch(body)
    if match is None:
        if FUNCTION_START not in body:
            return _Decoded(error=f"a tool call needs {FUNCTION_START}NAME> after {opener}")
        return _Decoded(error=f"a tool call's {FUNCTION_START}...> needs its {FUNCTION_END}, and nothing "
                              "else in its tool_call block")
    name, inner = match.group(1).strip(), match.group(2)
    if name not in types and not _NAME.fullmatch(name):  # (an offered tool's name may hold a space)
        return _Decoded(error=f"a tool call needs a function name, got {match.group(1)!r}")
    schemas = types.get(name, {})
    arguments: dict[str, Any] = {}
    for parameter in _parameters(name, inner, schemas, padded=padded):
        if parameter.error is not None:
            return _Decoded(error=parameter.error)
        if parameter.key in arguments:
            return _Decoded(error=f"parameter {parameter.key!r} of {name!r} given twice")
        arguments[parameter.key] = typed_value(parameter.text, schemas.get(parameter.key))
    return _accepted(name, arguments)


def cut_arguments_json(name: str, inner: str, schemas: dict[str, Any], padded: bool = True) -> str:
    """The arguments of a call max_tokens cut off (`inner`: what it wrote after `<function=NAME>`) as the
    JSON text a hermes call's would be so far, which is what a client reads of a cut call (LangChain's
    invalid call, a structured answer's content): the parameters it closed, typed by their schemas, then
    the one it was writing, its name and its value so far (a string's text, an unclosed string; another
    type's value once it decodes, or the JSON text of an object or array begun), the object left open;
    closed where the cut fell in `</function>`; "" before any parameter began. `padded`: `_parameters`'."""
    if not inner.strip():
        return ""
    keys: set[str] = set()
    members: list[str] = []  # the closed parameters, as the object's members
    begun: str | None = None  # the member the cut fell in ("": only its tag begun)
    for parameter in _parameters(name, inner, schemas, cut=True, padded=padded):
        if parameter.error is not None:
            rest = parameter.rest.strip()
            if rest.startswith("</") and (FUNCTION_END.startswith(rest) or rest.startswith(FUNCTION_END)):
                return "{" + ", ".join(members) + "}"  # all written: the cut fell in the function's end tag
            if rest.startswith(PARAMETER_START) and ">" not in rest:  # cut inside a parameter's name
                begun = json.dumps(rest[len(PARAMETER_START):], ensure_ascii=False)[:-1]
            elif len(rest) > 1 and PARAMETER_START.startswith(rest):  # ("<" alone may begin either tag)
                begun = ""
            break
        schema = schemas.get(parameter.key)
        value = (_json(typed_value(parameter.text, schema)) if parameter.closed
                 else _value_begun(parameter.text, schema))
        if parameter.key in keys or value is None:
            break
        keys.add(parameter.key)
        member = json.dumps(parameter.key, ensure_ascii=False) + ": " + value
        if not parameter.closed:
            begun = member
            break
        members.append(member)
    text = "{" + ", ".join(members)
    return text if begun is None else text + (", " if members else "") + begun


def _value_begun(text: str, schema: Any) -> str | None:
    """A value max_tokens cut off, as JSON text so far (`cut_arguments_json`); None where nested too deeply."""
    if not text:
        return ""
    value = typed_value(text, schema)
    if not isinstance(value, str):
        return _json(value)
    kinds = _kinds(schema)
    if not kinds or "string" in kinds:
        return json.dumps(text, ensure_ascii=False)[:-1]  # (unclosed)
    return text.strip() if text.lstrip()[:1] in ("{", "[") else ""  # an object or array begun, as written


def _json(value: Any) -> str | None:
    """`value` as JSON text, as a call's arguments are sent; None where it nests too deeply to encode."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def _block_end(block: str, opener: str = CALL_START, closer: str = CALL_END,
               opens: Callable[[int], bool] = lambda at: True) -> int:
    """Where the `</tool_call>` (`closer`) that ends a call block (`block`: what follows its `<tool_call>`,
    `opener`) is, -1 while it is not there yet: the first after a call's `</function>`, so that a value's
    text (code) may hold `</tool_call>`, as the grammar lets it; the first one where the block is no call
    in this form, or where a call begins after it before that (a call that never closed its function: a
    `<tool_call>` and its `<function=`; a value's text may hold `<tool_call>` alone, as a JSON string's).
    `opens(at)`: whether the `opener` text at `at` is the opener (the stream's `_opener_at`: its token,
    where the tokenizer has one), not a value quoting call markup in ordinary tokens."""
    first = block.find(closer)
    if first < 0 or not block.lstrip().startswith(FUNCTION_START):
        return first
    next_call = block.find(opener, first)
    while next_call >= 0 and not (opens(next_call) and _CALL_BEGUN.match(block, next_call + len(opener))):
        next_call = block.find(opener, next_call + 1)
    at = first
    while at >= 0 and (next_call < 0 or at < next_call):
        if block[:at].rstrip().endswith(FUNCTION_END):
            return at
        at = block.find(closer, at + 1)
    return first if next_call >= 0 else -1


def end_of_value(text: str, start: int, value_end: str, follows: re.Pattern) -> int:
    """Where the end tag (`value_end`) of the value that begins at `start` is, -1 while it is not
    there: the first after which the text goes on as the format writes a call (`follows`: the next
    parameter, the call's end), else the first. A value's text holds its end tag where the grammar
    lets it, in a JSON string of an object's value, a string with a maxLength or an enum's value
    ('{"k": "a</parameter>b"}'); read as the end, the rest was text outside a parameter."""
    first = at = text.find(value_end, start)
    while at >= 0 and not follows.match(text, at + len(value_end)):
        at = text.find(value_end, at + 1)
    return first if at < 0 else at


def end_outside_values(block: str, closer: str, value_start: str, value_end: str, follows: re.Pattern) -> int:
    """Where the first `closer` of `block` outside every value (from `value_start` to its
    `value_end`, `end_of_value`'s with `follows`) is, -1 while it is not there yet: the end tag of a
    format whose values' text (code) may hold that tag, as the grammar lets it (GLM-4.5's
    `</tool_call>` beside its `<arg_value>`s, MiniMax-M2's `</minimax:tool_call>` beside its
    `<parameter name=...>`s)."""
    at = 0
    while True:
        end, value = block.find(closer, at), block.find(value_start, at)
        if value < 0 or 0 <= end < value:
            return end
        closed = end_of_value(block, value + len(value_start), value_end, follows)
        if closed < 0:
            return -1
        at = closed + len(value_end)


class _CallBlockStream(_Stream):
    """Calls open at the format's block tag (`opener`: `<tool_call>`) anywhere in the text and are
    decided at the end tag (`closer`) that `_block_end` finds (a format whose values may hold that
    tag: Qwen3-Coder's, GLM-4.5's, MiniMax-M2's), or at the end of the text (`_ended_inside`). The
    tools' schemas type the values (`_decode`)."""

    opener, closer = CALL_START, CALL_END
    textual_markers = True  # a block opens where the model generated the `opener` token, where it is one

    def __init__(self, tools: list[dict] | None) -> None:
        super().__init__()
        self._types = parameter_types(tools)
        self._in_call = False  # _buffer holds a block's body

    def _block_end(self, block: str) -> int:
        """Where the `closer` ending `block` (what follows its `opener`) is; -1: not yet."""
        raise NotImplementedError

    def _opener_at(self, block: str) -> Callable[[int], bool]:
        """Whether the `opener` text at a position of `block` (the end of the text fed) is the opener."""
        start = self._markers.fed - len(block)
        return lambda at: self._markers.at(start + at, start + at + len(self.opener), self.opener)

    def _decode(self, body: str) -> _Decoded:
        """A whole block's call (`body`: between its tags)."""
        raise NotImplementedError

    def _whole_block(self, out: list, body: str) -> None:
        """A block that ended at its `closer` (`body`: between its tags): its call, or its text with
        the error (a format whose block holds several calls decides them here)."""
        decoded = self._decode(body)
        if decoded.error is None:
            self._accept(out, decoded)
        else:
            self._reject(out, self.opener + body + self.closer, decoded.error)

    def _ended_inside(self, out: list, raw: str) -> None:
        """The text ended inside a block (`raw`: all after its `opener`): a call, or a cut one."""
        raise NotImplementedError

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if not self._in_call:
                start = self._markers.find(self._buffer, self.opener)
                if start < 0:
                    self._text_before(out, self.opener, final)
                    return
                self._text(out, self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(self.opener):], True
                continue
            end = self._block_end(self._buffer)
            if end < 0 and not final:
                return
            end = self._buffer.find(self.closer) if end < 0 else end  # the format's end never came: the first
            raw = self._buffer if end < 0 else self._buffer[:end]
            self._buffer, self._in_call = "" if end < 0 else self._buffer[end + len(self.closer):], False
            if end < 0:
                self._ended_inside(out, raw)
            else:
                self._whole_block(out, raw)


class _QwenXmlStream(_CallBlockStream):
    """Qwen3-Coder's blocks: a block whose `</function>` came, cut in its end tag or before it, is a
    call; one cut before its `</function>` is a cut call."""

    def _block_end(self, block: str) -> int:
        return _block_end(block, opens=self._opener_at(block))

    def _decode(self, body: str) -> _Decoded:
        return decode_xml_call(body, self._types)

    def _ended_inside(self, out: list, raw: str) -> None:
        held = next((n for n in range(min(len(CALL_END) - 1, len(raw)), 0, -1) if raw.endswith(CALL_END[:n])), 0)
        decoded = decode_xml_call(raw[:len(raw) - held], self._types)
        if decoded.error is None:
            self._accept(out, decoded)
        else:
            self._reject(out, CALL_START + raw, f"unclosed {CALL_START}: {decoded.error}", cut=True)


class SchemaTypedToolParser:
    """What the XML call formats' parsers share (qwen3_coder, glm45, minimax_m2, seed_oss): values are
    text, typed by the turn's tools' schemas (`takes_tools`: the chat layer opens their streams with
    the tools), and a parse is the stream fed the whole text."""

    takes_tools = True

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        stream = self.stream(tools)
        stream.feed(text)
        return stream.finish()


class QwenXmlToolParser(SchemaTypedToolParser):
    """Qwen3-Coder's `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...` calls (module
    docstring). `takes_tools`: the chat layer opens its streams with the turn's tools, whose
    schemas type the parameters' values."""

    name = "qwen3_coder"

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        return _QwenXmlStream(tools)

    def cut_call_parts(self, cut_call: str, tools: list[dict] | None = None) -> tuple[str, str]:
        """(the name, the arguments) a call cut off by max_tokens had begun (a `CutCall`'s text:
        `<tool_call>`, then the call), as `Chat.cut_call_parts` reads a `call_syntax`'s: the name
        (what of it was written), then the arguments so far as JSON text, the parameters typed by
        the turn's `tools` as a whole call's are (`cut_arguments_json`: what a cut hermes call gives,
        not the parameters' markup); a block in the hermes form, its "name" and "arguments" as
        written; ("", "") for what it has not reached."""
        if not cut_call.lstrip().startswith(CALL_START):
            return "", ""
        return cut_call_body_parts(cut_call.lstrip()[len(CALL_START):], tools)


def cut_call_body_parts(body: str, tools: list[dict] | None, padded: bool = True) -> tuple[str, str]:
    """(the name, the arguments so far) of a cut call's text after its block tag (`body`):
    `QwenXmlToolParser.cut_call_parts`' (`padded`: `_parameters`')."""
    body = body.lstrip()
    if body.startswith("{"):
        name = re.match(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)', body)
        if name is None:
            return "", ""
        key = re.match(r'\s*,\s*"arguments"\s*:\s*', body[name.end():]) if name[2] else None
        return name[1], body[name.end() + key.end():] if key else ""
    if not body.startswith(FUNCTION_START):
        return "", ""
    head, closed, inner = body[len(FUNCTION_START):].partition(">")
    name = head.strip()
    return name, cut_arguments_json(name, inner, parameter_types(tools).get(name, {}), padded) if closed else ""


@hookimpl
def register_tool_parsers(register) -> None:
    register(QwenXmlToolParser.name, QwenXmlToolParser())
