"""OpenAI-style messages, tools and tool_choice, checked and normalised before rendering.

What frameworks send is checked whole before any state is touched: a message, tool or choice the
chat layer cannot render faithfully is a `HibanaError` subclass saying which one and what to pass
instead (never a silent drop, never a raw error from deep in a template). Tool schemas are laid out
as OpenAI-style schemas are, the layout small models trained on read best (`clean_tool`).
"""

from __future__ import annotations

import functools
import json
import re
import urllib.parse
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Sequence

from hibana_core.config import MAX_JSON_DEPTH, nests_deeper
from hibana_core.errors import (ConfigError, ConversationError, GrammarError, HibanaError, ToolChoiceError,
                                ToolSchemaError, UnsupportedContentError)
from hibana_plugins.hookspecs import ToolCall


KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MEDIA_PARTS = frozenset({"image", "image_url", "input_image", "audio", "input_audio", "video", "file",
                          "document"})


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI-style messages as chat templates expect them: content as a string, tool-call
    arguments as dicts (so the template re-serialises them the way the model wrote them; as JSON
    text where they hold a lone surrogate, which a template's tojson would write raw).
    "developer" is the system role. A message the template could not render faithfully is a
    ConversationError (UnsupportedContentError for images, audio, files)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ConversationError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ConversationError("messages is empty; give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConversationError(f"message {i} is a {type(message).__name__}, not a dict with a 'role' and "
                                    "a 'content'")
        m = dict(message)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ConversationError(f"message {i} has role {role!r}; give it one of {sorted(KNOWN_ROLES)}")
        m["role"] = "system" if role == "developer" else role
        m["content"] = _content(i, role, m.get("content"))
        if role == "assistant" and not m["content"] and isinstance(m.get("refusal"), str):
            m["content"] = m["refusal"]  # an OpenAI reply sent back as it came (content null): its refusal's text
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], (list, tuple)):
                raise ConversationError(f"message {i}'s tool_calls is a {type(m['tool_calls']).__name__}, "
                                        "not a list of calls")
            m["tool_calls"] = [_normalize_call(i, c) for c in m["tool_calls"]]
        else:  # no calls ([] as clients send it): templates that test `'tool_calls' in message` took it for calls
            m.pop("tool_calls", None)
        if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise ConversationError(f"message {i} has tool_call_id {m['tool_call_id']!r}; a call id is a string")
        out.append(m)
    return out


def _content(i: int, role: str, content: Any) -> str:
    """A message's content as one string: None is "", content parts are joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ConversationError(f"message {i}'s content is a {type(content).__name__}; give a string, None or "
                                "a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type", "text") if isinstance(part, Mapping) else None
        if isinstance(part, str):
            parts.append(part)
        elif kind in _MEDIA_PARTS:
            raise UnsupportedContentError(f"the model reads text only, and a {role} message (message {i}) holds "
                                          f"a {kind!r} part; describe it in text or use a multimodal model")
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])  # an OpenAI reply's refusal, sent back in the history: its text
        else:
            raise ConversationError(f"message {i} holds a content part {part!r:.80}; a part is a string or "
                                    "{'type': 'text', 'text': '...'}")
    return "".join(parts)


def _normalize_call(i: int, call: Any) -> dict:
    if isinstance(call, ToolCall):
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise ConversationError(f"message {i} holds a tool call {call!r:.80}; a call is {{'id': ..., 'function': "
                                "{'name': ..., 'arguments': ...}}")
    name, call_id, arguments = function.get("name"), call.get("id"), function.get("arguments", {})
    if not isinstance(name, str):
        raise ConversationError(f"message {i} holds a tool call named {name!r}; a call's name is a string")
    if _UNWRITABLE_NAME.search(name):  # as a tool's: written into the call's markup as it is, it forges calls
        raise ConversationError(f"message {i} holds a tool call named {name!r:.80}, with a quote, backslash, angle "
                                "bracket or control character that the chat template writes into the call's markup "
                                "as it is (forging other calls); name the tools it calls with letters, digits, '_', "
                                "'-' and '.'")
    if call_id is not None and not isinstance(call_id, str):
        raise ConversationError(f"message {i} holds a tool call with id {call_id!r}; a call id is a string")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            pass  # the template prints a string as it is
    if not isinstance(arguments, str):
        text = _check_json(arguments, lambda exc: ConversationError(
            f"message {i} holds a tool call whose arguments are not JSON ({exc}); pass a dict or a JSON string"))
        if nests_deeper(arguments, MAX_JSON_DEPTH):
            raise ConversationError(f"message {i} holds a tool call whose arguments nest objects and arrays more "
                                    f"than {MAX_JSON_DEPTH} levels deep, more than templates render; flatten them")
        if LONE_SURROGATE.search(text):  # half of an escaped pair the model wrote: a template's tojson would write
            arguments = escaped_surrogates(text)  # it raw, which no tokenizer reads; as JSON text, as it was written
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_json(value: Any, error: Callable[[Exception], HibanaError]) -> str:
    """`value` as JSON text (other scripts as they are); raise `error(exc)` where it does not
    serialise (what templates do with it)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)  # (NaN and Infinity are no JSON)
    except (ValueError, TypeError, RecursionError) as exc:  # a cycle, a non-JSON type, a huge integer
        raise error(exc) from None


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def escaped_surrogates(json_text: str) -> str:
    """JSON text with each lone surrogate, which UTF-8 cannot carry, written as its `\\uXXXX`
    escape (JSON for the same string): a tool call's arguments that decode to one (a model cut an
    escaped pair) stay text that a client can send back and a tokenizer can read."""
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def json_text(value: Any, **options: Any) -> str:
    """`value` as JSON text (`options`: json.dumps'): other scripts as they are, but a lone
    surrogate, which UTF-8 cannot carry, as its `\\uXXXX` escape (`escaped_surrogates`). A tool
    call's arguments decode to one where the model wrote half of an escaped pair (`"\\ud83d"`):
    written raw, a reply failed with a 500, a stream mid-way, and a client could not send it back."""
    text = json.dumps(value, ensure_ascii=False, **options)
    return text if text.isascii() else escaped_surrogates(text)


def check_text(text: str, what: str, error: type[HibanaError] = ConversationError) -> None:
    """`error` (a ConversationError; a tool's: ToolSchemaError) unless `text` is valid Unicode (no
    lone surrogate): what tokenizers read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            f"{what} holds {text[exc.start]!r} at position {exc.start}: a lone surrogate, not text (a string "
            "decoded with errors='surrogateescape', or cut inside a surrogate pair); decode it with "
            "errors='replace' or remove it") from None


TOOL_CHOICE_MODES = ("auto", "none", "any", "required")
"""The tool_choice values that name a mode, not a tool."""

_UNWRITABLE_NAME = re.compile(r'["\\<>\x00-\x1f\x7f]')
"""What a tool's name may not hold: templates write names into JSON and markup unescaped."""


def normalize_tools(tools: Sequence[dict] | None) -> list[dict] | None:
    """Tools as OpenAI function tools: {"type": "function", "function": {name, description, parameters}}.
    ToolSchemaError for anything else."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ToolSchemaError(f"tools must be a list of tools, got {type(tools).__name__}")
    normalized = [_normalize_tool(i, t) for i, t in enumerate(tools)]
    counts = Counter(t["function"]["name"] for t in normalized)  # (names.count per name was quadratic)
    twice = sorted(name for name, count in counts.items() if count > 1)
    if twice:  # a call names its tool: which one would it be
        raise ToolSchemaError(f"tools {', '.join(map(repr, twice))} are offered twice; give each tool a name of its own")
    return normalized or None


def _normalize_tool(i: int, tool: Any) -> dict:
    if not isinstance(tool, Mapping):
        raise ToolSchemaError(f"tool {i} is a {type(tool).__name__}; a tool is {{'type': 'function', 'function': "
                              "{'name': ..., 'description': ..., 'parameters': {JSON schema}}}")
    wrapped = "function" in tool and "name" not in tool  # {"type": "function", "function": {...}}, else bare
    function = tool["function"] if wrapped else tool
    if not isinstance(function, Mapping):
        raise ToolSchemaError(f"tool {i}'s function is a {type(function).__name__}, not a dict with a name")
    name, parameters = function.get("name"), function.get("parameters")
    if not isinstance(name, str) or not name:
        raise ToolSchemaError(f"tool {i} has name {name!r}; every tool needs a name (a non-empty string)")
    if _UNWRITABLE_NAME.search(name):
        raise ToolSchemaError(f"tool name {name!r:.80} holds a quote, backslash, angle bracket or control character; "
                              "chat templates write a call's name into its markup as it is, so such a name breaks the "
                              "history it is written into: rename the tool (letters, digits, '_', '-' and '.' are safe)")
    if not isinstance(function.get("description") or "", str):
        raise ToolSchemaError(f"tool {name!r} has a description that is not a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):  # "yes" was read as not strict
        raise ToolSchemaError(f"tool {name!r} has strict = {function['strict']!r:.40}; strict is true or false")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ToolSchemaError(f"tool {name!r} has parameters of type {type(parameters).__name__}; give a JSON "
                              "schema object (a dict), or none")
    if parameters is not None and parameters.get("type", "object") != "object":
        raise ToolSchemaError(f"tool {name!r} has parameters of type {parameters.get('type')!r:.40}; a call's "
                              "arguments are a JSON object: give {'type': 'object', 'properties': {...}}")
    _check_json(dict(function), lambda exc: ToolSchemaError(
        f"tool {name!r} nests objects and arrays too deep to serialise; flatten them" if isinstance(exc, RecursionError)
        else f"tool {name!r} is not JSON ({exc}); a schema that refers to itself must do so with $ref"))
    if nests_deeper(parameters, MAX_JSON_DEPTH):
        raise ToolSchemaError(f"tool {name!r} has parameters nesting objects and arrays more than {MAX_JSON_DEPTH} "
                              "levels deep, more than the grammar's checks take; flatten them (a $ref to a shared "
                              "definition instead of nesting it again)")
    if parameters is not None:
        text = json.dumps(parameters, sort_keys=True)  # both checks are cached by it
        problem = schema_problem(text)
        if problem:
            raise ToolSchemaError(f"tool {name!r} has parameters that are not a valid JSON schema: {problem}; "
                                  "write them as JSON Schema defines its keywords")
        problem = _unsatisfiable(text)
        if problem:
            raise ToolSchemaError(f"tool {name!r} has parameters that no arguments can meet: {problem}; fix the "
                                  "schema (a call's arguments would not be held to it)")
    if function.get("strict") is True and parameters is not None:
        _check_enforceable(name, parameters)
    return tool if wrapped and tool.get("type") == "function" else {"type": "function", "function": function}


@functools.lru_cache(maxsize=256)
def schema_problem(schema_json: str) -> str | None:
    """Where a schema breaks JSON Schema's own metaschema (its draft's, by `$schema`; 2020-12 when
    it names none), checked by jsonschema, or None: "type": "strang", "required": "x" and
    "properties": [...] are mistakes, not keywords the grammar may leave free. (A tool's schema
    recurs at every turn: each one checked once.)"""
    import jsonschema

    schema = json.loads(schema_json)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    hint = ""
    if isinstance(error.instance, bool) and error.absolute_path and error.absolute_path[-1] in _DRAFT4_FLAGS:
        hint = (f" (draft 4's flag on {_DRAFT4_FLAGS[error.absolute_path[-1]]}: write the bound itself, "
                f'"{error.absolute_path[-1]}": N, or name draft 4 in "$schema")')
    return f"{error.message}" + (f" (at {where})" if where else "") + hint


_DRAFT4_FLAGS = {"exclusiveMinimum": "minimum", "exclusiveMaximum": "maximum"}


@functools.lru_cache(maxsize=256)
def _unsatisfiable(schema_json: str) -> str | None:
    """What the metaschema lets pass but no arguments could meet, where the grammar would not
    compile it and would have let arguments of any shape through: a `$ref` within the document
    to nothing there (a JSON pointer, percent-encoded or not, or an anchor not found), a property
    whose `enum` is empty. Only schema keywords are read (`default`, `const`, `examples` hold
    data), and references under a nested `$id` are left alone (their base is another)."""
    from hibana_core.grammar import subschemas

    schema = json.loads(schema_json)
    anchors: set[str] = set()
    refs: list[tuple[str, str]] = []

    def walk(node: Any, where: str, scoped: bool) -> None:
        if not isinstance(node, dict):
            return
        for key in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(key), str):
                anchors.add(node[key])
        own_id = node.get("$id")
        if isinstance(own_id, str) and own_id.startswith("#"):  # draft 7's anchors
            anchors.add(own_id[1:])
        scoped = scoped or (isinstance(own_id, str) and not own_id.startswith("#") and bool(where))
        if isinstance(node.get("$ref"), str) and not scoped:
            refs.append((node["$ref"], where))
        for _, _, sub, at in subschemas(node, where):
            walk(sub, at, scoped)

    walk(schema, "", False)
    for name, sub in (schema.get("properties") or {}).items() if isinstance(schema.get("properties"), dict) else ():
        if isinstance(sub, dict) and sub.get("enum") == []:
            return f"property {name!r} has an empty enum, which allows no value"
    for ref, where in refs:
        if not ref.startswith("#"):
            continue  # another document's: the grammar's own error says it cannot follow it
        fragment = urllib.parse.unquote(ref[1:])
        if fragment and not fragment.startswith("/"):
            found = fragment in anchors
        else:
            found, node = True, schema
            for part in (p.replace("~1", "/").replace("~0", "~") for p in fragment.split("/")[1:]):
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    found = False
                    break
        if not found:
            return f"$ref {ref!r} points at nothing in the schema (at {where or '/'})"
    return None


def check_enforceable(tool: Mapping) -> None:
    """ToolSchemaError where a (normalized) tool's arguments cannot be held to its schema, as
    for a strict tool: for structured output, whose answer must parse into the schema."""
    function = tool["function"]
    if function.get("parameters") is not None:
        _check_enforceable(function["name"], function["parameters"])


def unheld(schema: Mapping) -> list[str]:
    """What of `schema` the grammar cannot hold the output to: keywords it would drop, or why it
    does not compile; [] where every output it allows is valid under the schema."""
    from hibana_core.grammar import json_schema_grammar, unenforced_keywords

    unenforced = unenforced_keywords(dict(schema))
    if unenforced:  # refused already: compiling would only print xgrammar's own warnings about them
        return unenforced
    try:
        json_schema_grammar(dict(schema))
    except GrammarError as exc:
        unenforced.append(str(exc))
    return unenforced


def _check_enforceable(name: str, parameters: Mapping) -> None:
    """A strict tool's (`"strict": true`, OpenAI's and LangChain's `bind_tools(strict=True)`)
    arguments are held to its schema, so a schema the grammar cannot hold is refused, as OpenAI
    refuses it; other tools' arguments fall back to any JSON object (`turn.arguments_schema`)."""
    unenforced = unheld(parameters)
    if unenforced:
        raise ToolSchemaError(f"tool {name!r} is strict but its parameters cannot be held to its schema "
                              f"({'; '.join(unenforced)}); fix the schema, or bind it without strict")


def check_tool_results(messages: Sequence[dict]) -> None:
    """Every tool message answers a call of the assistant message it follows (other tool messages
    between), and names one of its calls when both carry ids: as OpenAI's API requires. A
    template would render an orphan result as if some call had produced it, or drop it."""
    calls: list | None = None  # the calls of the assistant message being answered
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or None
        elif role == "tool":
            if calls is None:
                raise ConversationError(f"message {i} is a tool result but follows no assistant message with "
                                        "tool calls; give the assistant message its tool_calls, or send the "
                                        "result as a user message")
            call_id, ids = message.get("tool_call_id"), [_call_id(c) for c in calls]
            if call_id and all(ids) and call_id not in ids:
                raise ConversationError(f"message {i} answers tool call {call_id!r}, which the assistant message "
                                        f"before it did not make (its calls: {ids})")
        else:
            calls = None


def one_call_a_message(messages: list[dict]) -> list[dict]:
    """`messages` with every assistant turn of several calls written as a template that renders
    one call a message needs it (Llama 3.x's raise on more; gpt-oss's render the first alone):
    each call a message of its own (the first keeps the turn's content and reasoning), followed
    by its result (by tool_call_id, else in order); results that answer no call come last."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        turn = messages[i]
        i += 1
        calls = turn.get("tool_calls") or ()
        if turn.get("role") != "assistant" or len(calls) < 2:
            out.append(turn)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        ids = {_call_id(call) for call in calls} - {None}  # results without an id are matched in order
        by_id: dict[Any, list[dict]] = {}  # a call's results (a retried call may have two), in order
        for result in results:
            if result.get("tool_call_id") in ids:
                by_id.setdefault(result["tool_call_id"], []).append(result)
        unmatched = [r for r in results if r.get("tool_call_id") not in ids]
        for n, call in enumerate(calls):
            out.append({**turn, "tool_calls": [call]} if n == 0 else {"role": "assistant", "content": "",
                                                                        "tool_calls": [call]})
            answers = by_id.pop(_call_id(call), None) or ([unmatched.pop(0)] if unmatched else [])
            out.extend(answers)
        out.extend(unmatched)
    return out


def _call_id(call: Any) -> str | None:
    return call.id if isinstance(call, ToolCall) else call.get("id")


def normalize_tool_choice(choice: Any, tools: Sequence[dict] | None) -> str:
    """The spellings frameworks use, as "auto", "none", "required" or a tool's name: None/"auto",
    "none"/False, "any"/"required"/True, a name, or {"function": {"name": ...}} / {"name": ...} /
    {"type": "auto" | "none" | "any" | "required"}. `tools` are OpenAI function tools; forcing a
    call with none offered is a ToolChoiceError."""
    names = [t["function"]["name"] for t in tools or ()]
    if isinstance(choice, Mapping) and ("function" in choice or "name" in choice):
        function = choice.get("function", choice)
        choice = function.get("name") if isinstance(function, Mapping) else function
        if not isinstance(choice, str):
            raise ToolChoiceError(f"tool_choice names tool {choice!r:.80}; name one of {names}")
        if choice in TOOL_CHOICE_MODES and choice in names:
            raise ToolChoiceError(f"tool_choice names the tool {choice!r}, whose name is also a tool_choice mode and "
                                  "would be read as that mode; rename the tool to force it")
    elif isinstance(choice, Mapping):  # {"type": "function"} without a name is no choice, not "auto"
        if choice.get("type") not in TOOL_CHOICE_MODES:
            raise ToolChoiceError(f"tool_choice={choice!r:.80} names no tool and no mode; use "
                                  "{'type': 'function', 'function': {'name': ...}} or {'type': 'auto' | 'none' | "
                                  "'any' | 'required'}")
        choice = choice["type"]
    if choice is None or isinstance(choice, str) and choice == "auto":
        return "auto"
    if choice is False or isinstance(choice, str) and choice == "none":
        return "none"
    if choice is True or isinstance(choice, str) and choice in ("any", "required"):
        if not names:
            raise ToolChoiceError(f"tool_choice={choice!r} requires a tool call, and no tools are offered; pass "
                                  "tools or use 'auto'")
        return "required"
    if isinstance(choice, str) and choice in names:
        return choice
    raise ToolChoiceError(f"tool_choice={choice!r:.80} names no bound tool; use 'auto', 'none', 'any', "
                          f"'required' or one of {names}")


def response_format_schema(response_format: Any) -> tuple[dict | None, bool]:
    """OpenAI's `response_format` as (the JSON schema the reply's text is held to, or None for
    text; whether the schema is strict): {"type": "text"}, {"type": "json_object"} (any JSON object)
    or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. Strict:
    every keyword held, as OpenAI's structured outputs; not strict (OpenAI's default), keywords the
    grammar cannot hold are left to the model. A malformed one is a ConfigError whose `param` names
    the field (the server's 400 says it)."""
    def refuse(message: str, param: str) -> ConfigError:
        error = ConfigError(message)
        error.param = param
        return error

    if response_format is None:
        return None, False
    if not isinstance(response_format, Mapping):
        raise refuse(f"response_format must be an object such as {{'type': 'json_schema', 'json_schema': {{...}}}}, "
                     f"got {response_format!r:.80}", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None, False
    if kind == "json_object":
        return {"type": "object"}, False
    if kind != "json_schema":
        raise refuse(f"response_format.type={kind!r:.40}: use 'text', 'json_object' or 'json_schema'",
                     "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise refuse("response_format.json_schema must be an object: {'name': ..., 'schema': {...}}",
                     "response_format.json_schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise refuse(f"response_format.json_schema.strict must be a boolean, got {strict!r:.40}",
                     "response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # optional in OpenAI's spec: then any JSON object
    if not isinstance(schema, Mapping):
        raise refuse("response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema")
    return dict(schema), strict is True


_KEY_ORDER = ("type", "name", "properties", "description", "required", "enum")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def clean_schema(schema: Any) -> Any:
    """A JSON schema laid out as OpenAI-style tool schemas are (the layout small models trained on
    read best): without the `title`s pydantic adds, `type`, `properties`, `description` first.
    Argument names keep their order, a property called "title" included."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: clean_schema(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:  # one schema, or a list of them
        if isinstance(out.get(key), list):
            out[key] = [clean_schema(s) for s in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = clean_schema(out[key])
    order = sorted(out, key=lambda k: _KEY_ORDER.index(k) if k in _KEY_ORDER else len(_KEY_ORDER))
    return {k: out[k] for k in order}


def clean_tool(tool: dict) -> dict:
    """An OpenAI function tool (or a bare function) with its parameters' schema cleaned."""
    function = dict(_normalize_tool(0, tool)["function"])
    if isinstance(function.get("parameters"), dict):
        function["parameters"] = clean_schema(function["parameters"])
    return {"type": "function", "function": clean_schema(function)}
