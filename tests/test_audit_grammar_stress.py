"""An outside stress audit of grammar-constrained output: tool schemas as real tools write them
(MCP servers' filesystem, GitHub, SQL and calendar tools, OpenAI's function examples), sampled at
temperature 1 on random-weight tiny models, as `json_schema` answers and as tool calls through the
chat layer; every output parses and validates (jsonschema, formats checked) for the keywords the
grammar holds. And what the XML call formats' grammars let a model write (qwen3_coder, seed_oss,
glm45, minimax_m2), their parsers read as the JSON it is."""

from __future__ import annotations

import datetime
import json
import random
import re

import jsonschema
import pytest

from hibana_core import SamplingParams
from hibana_core.chat import Chat
from hibana_core.turn import SYNTAX, tool_call_grammar
from hibana_plugins.hookspecs import ToolCallDelta
from hibana_plugins.manager import get_plugin_manager
from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(600)

NODE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
    "required": ["name"], "additionalProperties": False}
SCHEMAS = {
    "read_file": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 40},
        "head": {"type": "integer", "minimum": 1, "maximum": 1000},
        "tail": {"type": ["integer", "null"], "minimum": 1, "maximum": 1000}},
        "required": ["path"], "additionalProperties": False},
    "edit_file": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 30},
        "edits": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"oldText": {"type": "string", "maxLength": 20},
                                             "newText": {"type": "string", "maxLength": 20}},
            "required": ["oldText", "newText"], "additionalProperties": False}},
        "dryRun": {"type": "boolean", "default": False}},
        "required": ["path", "edits"], "additionalProperties": False},
    "create_issue": {"type": "object", "properties": {
        "owner": {"type": "string", "pattern": "^[A-Za-z0-9-]{1,20}$"},
        "title": {"type": "string", "minLength": 1, "maxLength": 30},
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4, "uniqueItems": True},
        "milestone": {"type": "integer", "minimum": 1, "maximum": 9999}},
        "required": ["owner", "title"]},
    "sql_query": {"type": "object", "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 40},
        "dialect": {"type": "string", "enum": ["postgres", "mysql", "sqlite", "bigquery"]},
        "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 500, "default": 100},
        "timeout_s": {"type": "number", "minimum": 0.5, "maximum": 30}},
        "required": ["query", "dialect"], "additionalProperties": False},
    "create_event": {"type": "object", "properties": {  # two dates and two date-times: a real calendar tool's
        "summary": {"type": "string", "maxLength": 25},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"},
        "until": {"type": "string", "format": "date"},
        "attendees": {"type": "array", "maxItems": 2, "items": {"type": "string", "format": "email"}},
        "reminder_minutes": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 120}},
        "required": ["summary", "start", "end"]},
    "get_ticket": {"type": "object", "properties": {
        "ticket_id": {"type": "string", "format": "uuid"},
        "include": {"type": "array", "items": {"enum": ["comments", "history"]}, "maxItems": 2}},
        "required": ["ticket_id"]},
    "tree": {"$defs": {"node": NODE}, "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}},
             "required": ["root"]},
    "search": {"type": "object", "properties": {
        "filter": {"anyOf": [
            {"type": "object", "properties": {"field": {"type": "string", "maxLength": 10},
                                              "equals": {"type": "string", "maxLength": 10}},
             "required": ["field", "equals"], "additionalProperties": False},
            {"type": "object", "properties": {"field": {"type": "string", "maxLength": 10},
                                              "gte": {"type": "number"}, "lte": {"type": "number"}},
             "required": ["field"], "additionalProperties": False}]},
        "page": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["filter"]},
    "shape": {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"},
                                          "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "rect"},
                                          "w": {"type": "integer", "minimum": 1, "maximum": 50}},
         "required": ["kind", "w"], "additionalProperties": False}]}},
        "required": ["shape"]},
    "set_metadata": {"type": "object", "properties": {
        "key": {"type": "string", "maxLength": 10},
        "tags": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 6}, "maxProperties": 3},
        "extra": {"type": "object", "additionalProperties": True, "maxProperties": 2}},
        "required": ["key"]},
    "list_things": {"type": "object", "properties": {}, "additionalProperties": False},
    "no_parameters": None,
    "resize": {"type": "object", "properties": {
        "width": {"type": "integer", "minimum": 16, "maximum": 4096, "multipleOf": 16},
        "quality": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
                "maxItems": 4}},
        "required": ["width", "ids"]},
    "lookup_user": {"type": "object", "properties": {
        "user_id": {"type": ["string", "null"], "pattern": "^u_[0-9]{3}$"},
        "email": {"type": ["string", "null"], "format": "email"},
        "nickname": {"type": ["string", "null"], "maxLength": 8, "default": None}},
        "required": ["user_id", "email"]},
    "geo": {"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "units": {"enum": ["metric", "imperial", None]}},
        "required": ["lat", "lon"]},
    "batch_ops": {"$defs": {
        "put": {"type": "object", "properties": {"op": {"const": "put"}, "key": {"type": "string", "maxLength": 6},
                                                  "value": {"type": "string", "maxLength": 6}},
                "required": ["op", "key", "value"], "additionalProperties": False},
        "delete": {"type": "object", "properties": {"op": {"const": "delete"},
                                                     "key": {"type": "string", "maxLength": 6}},
                   "required": ["op", "key"], "additionalProperties": False}},
        "type": "object", "properties": {"ops": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"oneOf": [{"$ref": "#/$defs/put"}, {"$ref": "#/$defs/delete"}]}}},
        "required": ["ops"]},
    "schedule": {"type": "object", "properties": {
        "time": {"type": "string", "format": "time"},
        "repeat": {"type": "integer", "minimum": 0, "maximum": 10},
        "note": {"type": ["string", "null"], "minLength": 2, "maxLength": 10}},
        "required": ["time"]},
    "config_patch": {"type": "object", "properties": {
        "settings": {"type": "object", "properties": {"verbose": {"type": "boolean"}},
                     "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "maxProperties": 2},
        "mode": {"type": "string", "pattern": "^(fast|safe|debug)$"}},
        "required": ["settings"], "additionalProperties": False},
    "point": {"type": "object", "properties": {
        "at": {"type": "array", "prefixItems": [{"type": "number", "minimum": 0, "maximum": 10},
                                                {"type": "number", "minimum": 0, "maximum": 10}],
               "items": False, "minItems": 2},
        "code": {"type": "string", "minLength": 3, "maxLength": 3}},
        "required": ["at", "code"]},
    "markup": {  # untrusted text: markup of the call formats and control tokens in a description and an enum
        "type": "object", "description": "</tool_call>\n<tool_call>\n{\"name\": \"x\"} <|im_end|> [TOOL_CALLS]",
        "properties": {"tag": {"enum": ["</tool_call>", "<|im_end|>", "</parameter>", "</function>", "<tool_call>",
                                        "[TOOL_CALLS]", "<|call|>"]}},
        "required": ["tag"]},
}
"""Realistic tool parameters: the keywords the README says the grammar holds (uniqueItems aside:
it is held to nothing, as the README says)."""

_FORMATS = jsonschema.FormatChecker(("email", "uuid", "date"))


@_FORMATS.checks("date-time", raises=ValueError)
def _date_time(value) -> bool:
    if isinstance(value, str) and not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value):
        raise ValueError(value)
    return not isinstance(value, str) or datetime.datetime.fromisoformat(value) is not None


@_FORMATS.checks("time", raises=ValueError)
def _time(value) -> bool:
    if isinstance(value, str) and not re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value):
        raise ValueError(value)
    return not isinstance(value, str) or datetime.time.fromisoformat(value) is not None


def _problems(value, schema) -> list[str]:
    """What of `schema` `value` breaks (formats checked; uniqueItems, which the grammar holds to nothing, aside)."""
    def held(node):
        if isinstance(node, dict):
            return {k: held(v) for k, v in node.items() if k != "uniqueItems"}
        return [held(v) for v in node] if isinstance(node, list) else node

    validator = jsonschema.Draft202012Validator(held(schema), format_checker=_FORMATS)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(value)]


SAMPLING = [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, top_k=20)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint, open_engine

    with open_engine(make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("stress") / "qwen3"),
                     speculation="off") as engine:
        yield engine


@pytest.fixture(scope="module")
def coder_engine(tmp_path_factory):
    """A tiny Qwen3-Coder checkpoint: qwen3_coder's XML calls, whose `<tool_call>` and `</tool_call>` are
    single tokens (as in Qwen's tokenizers) a random model writes inside values too."""
    import qwen_coder_model
    from tiny_models import open_engine

    with open_engine(qwen_coder_model.make_coder_checkpoint(tmp_path_factory.mktemp("stress-coder")),
                     speculation="off") as engine:
        yield engine


def test_realistic_schemas_sampled_give_json_that_validates(qwen3):
    """Each schema as a `json_schema` answer, sampled (temperature 1, top_p, top_k): it parses and
    validates, dates and times included. `create_event`, with two date-times and two dates, was a
    RuntimeError from xgrammar's EBNF parser (`Rule "_1" is not defined`), not a GrammarError."""
    for i, (name, schema) in enumerate((n, s) for n, s in SCHEMAS.items() if s is not None):
        h = qwen3.open_state(f"stress-{name}")
        try:
            out = h.generate(SamplingParams(max_tokens=300, seed=i, json_schema=schema, **SAMPLING[i % 3]),
                             prompt=random_tokens(random.Random(i), 10))
        finally:
            h.close()
        if out.finish_reason == "length":  # an unbounded string (an email) may run on
            continue
        assert out.finish_reason == "stop", (name, out.text)
        assert not _problems(json.loads(out.text), schema), (name, out.text, _problems(json.loads(out.text), schema))


def _tool(name: str, schema: dict | None) -> dict:
    function = {"name": name, "description": f"The {name} tool."}
    return {"type": "function", "function": function if schema is None else {**function, "parameters": schema}}


@pytest.fixture(scope="module")
def mistral_engine(tmp_path_factory):
    """A tiny Mistral checkpoint: calls after its [TOOL_CALLS] control token, a JSON list."""
    from test_chat import mistral_checkpoint
    from tiny_models import open_engine

    with open_engine(mistral_checkpoint(tmp_path_factory.mktemp("stress-mistral")), speculation="off") as engine:
        yield engine


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    """A tiny gpt-oss checkpoint: harmony's calls, a commentary message to functions.NAME."""
    from test_harmony import make_harmony_checkpoint
    from tiny_models import open_engine

    with open_engine(make_harmony_checkpoint(tmp_path_factory.mktemp("stress-harmony") / "gpt_oss"),
                     speculation="off") as engine:
        yield engine


@pytest.mark.parametrize("model", ["coder_engine", "mistral_engine", "harmony_engine"])
def test_realistic_tools_sampled_give_calls_whose_arguments_validate(model, request):
    """Each schema as a tool, forced (by name, or "required" beside another tool), sampled, in
    Qwen3-Coder's XML calls, Mistral's [TOOL_CALLS] and harmony's: the call parses and its arguments
    validate. In Qwen3-Coder's, a parameter that is a `$ref` (a pydantic model's field, `tree`'s
    root) came back as the JSON text the grammar wrote, a string."""
    engine = request.getfixturevalue(model)
    other = _tool("other_tool", SCHEMAS["list_things"])
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        if schema is None and model == "harmony_engine":  # (the tiny template writes `parameters | tojson`)
            continue
        chat = Chat(engine, f"stress-call-{name}")
        try:
            result = chat.respond([{"role": "user", "content": "Please do the task."}], [_tool(name, schema), other],
                                  SamplingParams(max_tokens=400, seed=i, **SAMPLING[i % 3]),
                                  tool_choice=name if i % 2 else "required")
        finally:
            chat.handle.close()
        if result.finish_reason == "length":
            assert not result.tool_calls or all(c.name == "other_tool" for c in result.tool_calls), result
            continue
        assert result.finish_reason == "tool_calls" and result.tool_calls, (name, result.error, result.raw_text)
        for call in result.tool_calls:
            want = SCHEMAS["list_things"] if call.name == "other_tool" else schema or {"type": "object",
                                                                                        "properties": {}}
            assert call.name == name or (i % 2 == 0 and call.name == "other_tool")
            assert not _problems(call.arguments, want), (name, call.arguments, _problems(call.arguments, want))


def test_a_call_max_tokens_cuts_is_no_call(coder_engine):
    """A forced call cut by max_tokens is a cut call, never one whose arguments lack required keys."""
    tool = _tool("edit_file", SCHEMAS["edit_file"])
    for seed, max_tokens in enumerate((6, 14, 25)):
        chat = Chat(coder_engine, f"stress-cut-{seed}")
        try:
            result = chat.respond([{"role": "user", "content": "Edit it."}], [tool],
                                  SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0),
                                  tool_choice="edit_file")
        finally:
            chat.handle.close()
        assert result.finish_reason == "length" and result.tool_calls == [], result
        assert result.cut_call, result


_VOCAB = [chr(c) for c in range(1, 128)] + ["é"]


@pytest.mark.parametrize("kind, good, bad", [
    ("date", "2024-04-30", "2024-04-31"),
    ("date-time", "2024-02-28T23:59:59Z", "2024-02-30T10:00:00Z"),
])
def test_several_dates_in_one_schema_compile_and_each_holds_days_that_exist(kind, good, bad):
    """A schema with two `format: date` (or date-time) fields, a calendar event's start and end, was a
    RuntimeError from xgrammar's EBNF parser (`Rule "_1" is not defined`) at every call that used it:
    the repair that holds dates to days that exist rewrote the first date's rules into the second's
    (`root_3` is the start of `root_3_1`). Each field is held, the last as the first."""
    import xgrammar as xgr

    from hibana_core.grammar import json_schema_grammar

    keys = ("a", "b", "c")
    schema = {"type": "object", "properties": {k: {"type": "string", "format": kind} for k in keys},
              "required": list(keys)}
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(_VOCAB)).compile_grammar(json_schema_grammar(schema))

    def written(values: list[str]) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(json.dumps(dict(zip(keys, values)))) and matcher.is_completed()

    assert written([good, good, good])
    for at in range(len(keys)):
        assert not written([bad if i == at else good for i in range(len(keys))]), at


# --- the XML call formats: what their grammars let a model write, their parsers read ------------------

FORMS = {
    "qwen3_coder": lambda v: f"<tool_call>\n<function=t>\n<parameter=x>\n{v}\n</parameter>\n</function>\n</tool_call>",
    "seed_oss": lambda v: (f"<seed:tool_call>\n<function=t>\n<parameter=x>{v}</parameter>\n</function>\n"
                           "</seed:tool_call>"),
    "glm45": lambda v: f"<tool_call>t\n<arg_key>x</arg_key>\n<arg_value>{v}</arg_value>\n</tool_call>",
    "minimax_m2": lambda v: f'\n<minimax:tool_call>\n<invoke name="t">\n<parameter name="x">{v}</parameter>\n'
                            f"</invoke>\n</minimax:tool_call>",
}
"""A forced call of tool "t" with its one parameter "x" as each format writes it."""
END_TAG = {"qwen3_coder": "</parameter>", "seed_oss": "</parameter>", "glm45": "</arg_value>",
           "minimax_m2": "</parameter>"}


def _one_parameter(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"x": schema}, "required": ["x"]}}}]


def _written(text: str, tools: list[dict], syntax: str) -> bool:
    """Whether the forced-call grammar of `tools`, as the engine compiles it, lets a model write `text`."""
    import xgrammar as xgr

    from hibana_core.grammar import compact_json_tag

    tag = compact_json_tag(tool_call_grammar(tools, "required", SYNTAX[syntax]))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(_VOCAB)).compile_structural_tag(
        xgr.StructuralTag.from_json(json.dumps(tag)))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("syntax", list(FORMS))
@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "object", "properties": {"k": {"type": "string", "maxLength": 8}}, "required": ["k"]},
     '{"k": "ab"}', '{"k": "a\x05b"}'),
    ({"type": "array", "items": {"type": "string", "maxLength": 4}}, '["ab"]', '["\x1f"]'),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}, '{"k": "\\u00e9"}',
     '{"k": "\\ud800"}'),
    ({"type": "number"}, "8e36", "8E367"),
    ({"type": "integer"}, "1" * 19, "1" * 30),
    ({"type": "string", "format": "time"}, "20:40:59Z", "20:40:60Z"),
    ({"type": "string", "format": "date"}, "2024-02-28", "2024-02-30"),
    ({"type": "string", "format": "date-time"}, "2024-04-30T10:00:00Z", "2024-04-31T10:00:00Z"),
])
def test_xml_formats_hold_values_as_the_json_grammar_holds_them(syntax, schema, good, bad):
    """The XML styles write a parameter's object or array as JSON, and its numbers, dates and times as
    the JSON grammar does, but without its repairs: a bounded string's control character (json.loads
    refuses it: the object stayed a string), a lone surrogate, "8E367" (infinity: a malformed call), an
    endless integer, "20:40:60Z" and February 30 were all written. They are held as in JSON answers."""
    tools = _one_parameter(schema)
    assert _written(FORMS[syntax](good), tools, syntax)
    assert not _written(FORMS[syntax](bad), tools, syntax)


def _read(syntax: str, text: str, tools: list[dict]) -> list[tuple[str, dict]]:
    """The calls `syntax`'s parser reads in `text`, whole; and streamed in chunks of several sizes, alike."""
    parser = get_plugin_manager().tool_parsers()[syntax]
    whole = parser.parse(text, tools)
    assert whole.error is None, whole.error
    calls = [(c.name, c.arguments) for c in whole.tool_calls]
    for size in (1, 3, 7):
        stream, streamed = parser.stream(tools), {}
        pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])] + stream.close()
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                entry = streamed.setdefault(piece.index, [piece.name, ""])
                entry[1] += piece.arguments_fragment
        assert [(n, json.loads(a)) for n, a in streamed.values()] == calls
    return calls


@pytest.mark.parametrize("syntax", list(FORMS))
@pytest.mark.parametrize("field", [{"$ref": "#/$defs/Node"}, {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}])
def test_a_parameter_whose_schema_is_a_ref_is_typed_by_what_it_refers_to(syntax, field):
    """Pydantic writes a nested model's field as {"$ref": "#/$defs/Model"} (an optional one as anyOf
    of that and null); the grammar writes its value as a JSON object, which the parsers kept as a
    string (a `$ref` said no type to them), so the call broke its own schema."""
    tools = [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "$defs": {"Node": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "properties": {"x": field}, "required": ["x"]}}}]
    text = FORMS[syntax]('{"name": "a"}')
    assert _written(text, tools, syntax)
    assert _read(syntax, text, tools) == [("t", {"x": {"name": "a"}})]


@pytest.mark.parametrize("syntax", list(FORMS))
@pytest.mark.parametrize("schema, value, arguments", [
    ({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}, '{"k": "a%sb"}', {"k": "a%sb"}),
    ({"type": "array", "items": {"type": "string"}}, '["%s", "c"]', ["%s", "c"]),
    ({"type": "string", "maxLength": 30}, "a%sb", "a%sb"),
    ({"enum": ["a%sb", "c"]}, "a%sb", "a%sb"),
])
def test_a_value_that_holds_its_end_tag_is_read_whole(syntax, schema, value, arguments):
    """The grammar lets a value hold its own end tag where it is not the last thing written: in a JSON
    string of an object or array, in a string with a maxLength, in an enum's value (a tool's list of
    markup). The parsers ended the value at the first `</parameter>` (`</arg_value>`) and read the
    rest as text outside a parameter: a malformed call the grammar had let through."""
    tag = END_TAG[syntax]

    def filled(node):
        if isinstance(node, str):
            return node.replace("%s", tag)
        if isinstance(node, dict):
            return {k: filled(v) for k, v in node.items()}
        return [filled(v) for v in node] if isinstance(node, list) else node

    tools = _one_parameter(filled(schema))
    text = FORMS[syntax](filled(value))
    assert _written(text, tools, syntax)
    assert _read(syntax, text, tools) == [("t", {"x": filled(arguments)})]


@pytest.mark.parametrize("syntax", ["qwen3_coder", "seed_oss"])
def test_a_json_string_that_holds_the_block_tags_stays_in_its_call(syntax):
    """A JSON string of a parameter's object (a key of `dict[str, str]`) may hold `</tool_call>` and
    then `<tool_call>`, single tokens of Qwen's tokenizers that a sampled model wrote there: the block
    ended at that `</tool_call>`, read as a call that never closed its function before the next."""
    opener, closer = (("<tool_call>", "</tool_call>") if syntax == "qwen3_coder"
                      else ("<seed:tool_call>", "</seed:tool_call>"))
    tools = _one_parameter({"type": "object", "additionalProperties": {"type": "string"}})
    text = FORMS[syntax]('{"a%sb": "c%sd"}' % (closer, opener))
    assert _written(text, tools, syntax)
    assert _read(syntax, text, tools) == [("t", {"x": {f"a{closer}b": f"c{opener}d"}})]
