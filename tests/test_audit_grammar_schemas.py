"""An outside audit of JSON-schema decoding: schemas as real tools write them (draft 4's boolean
exclusive bounds, an integer's bounds that are not whole, tiny number ranges) and the JSON
escapes the grammar lets a model write, on a random-weight tiny model."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from hibana_core import GrammarError, SamplingParams
from hibana_core.turn import parser_grammar
from hibana_plugins.tool_parsers import HermesToolParser
from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(600)

TEXT = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    from tiny_models import open_engine

    engine = open_engine(tiny_checkpoints["qwen3"], speculation="off")
    yield engine
    engine.close()


def _takes(engine, params: SamplingParams, text: str) -> bool:
    """Whether the grammar of `params` lets an output start with `text` (token by token)."""
    matcher = engine.grammars.matcher(params, ())
    return all(matcher.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False))


def _outputs(engine, schema, seeds: int = 4) -> list:
    values = []
    for seed in range(seeds):
        h = engine.open_state(f"audit-{seed}")
        try:
            out = h.generate(SamplingParams(max_tokens=60, temperature=1.0, seed=seed, json_schema=schema),
                             prompt=random_tokens(random.Random(seed), 8))
        finally:
            h.close()
        assert out.finish_reason == "stop", out.text
        values.append(json.loads(out.text))
        jsonschema.validate(values[-1], schema)
    return values


@pytest.mark.parametrize("where", ["json_schema", "tool call"])
def test_a_string_escape_is_a_character_never_a_lone_surrogate(engine, where):
    """"\\ud800" is a JSON escape json.loads reads as a lone surrogate, a str no UTF-8 holds: a
    call whose arguments held one made the next turn's history a ConversationError. A surrogate
    pair (an emoji) and every other \\u escape stay writable."""
    if where == "json_schema":
        params, head = SamplingParams(json_schema=TEXT), '{"k": "'
    else:
        tools = [{"type": "function", "function": {"name": "f", "parameters": TEXT}}]
        params = SamplingParams(grammar=parser_grammar(HermesToolParser(), "hermes", tools, "required"))
        head = '<tool_call>\n{"name": "f", "arguments": {"k": "'
    for escape in ('\\ud800"', '\\uDBFF x', "\\udc00", "\\ud83d\\u0041"):
        assert not _takes(engine, params, head + escape), escape
    for escape in ("\\ud83d\\ude00", "\\uDBFF\\uDFFF", "\\u00e9", "\\uffff", "\\ue000", "\\u0000", "\\n"):
        assert _takes(engine, params, head + escape + '"}'), escape


@pytest.mark.parametrize("schema, place", [
    ({"type": "number", "minimum": 1e-7, "maximum": 2e-7}, "[1e-07, 2e-07] at #"),
    ({"type": "object", "properties": {"tol": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-8}},
      "required": ["tol"]}, "(0, 1e-08] at #/properties/tol"),
    ({"type": ["number", "null"], "minimum": 0.1234561, "maximum": 0.1234569}, "at #"),
])
def test_a_number_range_xgrammar_writes_no_number_of_is_a_grammar_error(engine, schema, place):
    """xgrammar writes a bounded number with at most 6 digits after the point, and a range that
    holds none such it wrote as no value: the output was "" (no JSON), finished as "stop"."""
    h = engine.open_state("tiny-range")
    try:
        with pytest.raises(GrammarError, match="6 digits after the point") as caught:
            h.generate(SamplingParams(max_tokens=20, json_schema=schema), prompt=[5, 6, 7])
    finally:
        h.close()
    assert place in str(caught.value)


def test_tiny_ranges_that_hold_a_writable_number_are_held(engine):
    for value in _outputs(engine, {"type": "number", "minimum": 1e-7, "maximum": 1e-6}):
        assert value == 0.000001


@pytest.mark.parametrize("schema, values", [
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
      "minimum": 0, "exclusiveMinimum": True, "maximum": 2, "exclusiveMaximum": True}, {1}),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "properties": {"x": {
        "type": "integer", "minimum": 3, "exclusiveMinimum": False, "maximum": 3}}, "required": ["x"]}, {3}),
    ({"type": "integer", "exclusiveMinimum": 0.5, "maximum": 1.5}, {1}),
    ({"type": "integer", "minimum": -1.5, "exclusiveMaximum": -0.5}, {-1}),
])
def test_draft4_flags_and_fractional_integer_bounds_are_held(engine, schema, values):
    """Draft 4's boolean exclusiveMinimum/exclusiveMaximum (OpenAPI 3.0 writes them too) and an
    integer's bounds that are not whole are valid JSON Schema; xgrammar refused both ("Value must
    be a number", "Integer constraint must be a whole number"), and a tool that had them was
    left free JSON. Each output validates (jsonschema reads $schema's draft)."""
    got = _outputs(engine, schema)
    assert {v["x"] if isinstance(v, dict) else v for v in got} == values


def test_a_draft4_flag_without_its_draft_says_how_to_write_it(engine):
    h = engine.open_state("draft4-flag")
    try:
        with pytest.raises(GrammarError, match=r'draft 4\'s flag on minimum: write the bound itself, '
                                               r'"exclusiveMinimum": N, or name draft 4 in "\$schema"'):
            h.generate(SamplingParams(max_tokens=5, json_schema={"type": "integer", "minimum": 0,
                                                                 "exclusiveMinimum": True}), prompt=[5, 6])
    finally:
        h.close()


def test_a_regex_with_named_groups_is_held(engine):
    """A group's name matches nothing (Python's `(?P<name>...)`, ECMA's `(?<name>...)` in a
    schema's pattern); xgrammar refused both: "Group modifier flag is not supported yet"."""
    regex = r"(?P<year>\d{4})-(?P<month>0[1-9]|1[0-2])"
    pattern = {"type": "string", "pattern": r"^(?<y>[0-9]{2})-(?<m>[a-z])$"}
    for seed, params in enumerate([dict(regex=regex)] * 3 + [dict(json_schema=pattern)] * 2):
        h = engine.open_state(f"named-{seed}")
        try:
            out = h.generate(SamplingParams(max_tokens=20, temperature=1.0, seed=seed, **params),
                             prompt=random_tokens(random.Random(seed), 8))
        finally:
            h.close()
        held = regex if "regex" in params else r'"[0-9]{2}-[a-z]"'
        assert out.finish_reason == "stop" and re.fullmatch(held, out.text), out.text


@pytest.mark.parametrize("schema", [
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
     "items": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}], "additionalItems": False},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"p": {
        "type": "array", "items": [{"type": "boolean"}], "additionalItems": {"type": "null"}, "maxItems": 3}},
     "required": ["p"]},
])
def test_a_draft7_tuple_is_held(engine, schema):
    """Draft 7's tuple form, `items` as a list with `additionalItems` (2020-12's prefixItems and
    items): xgrammar refused it ("items must be a boolean or an object"). Each output validates
    under draft 7."""
    _outputs(engine, schema, seeds=3)
