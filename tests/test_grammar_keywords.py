"""JSON-schema keywords xgrammar holds more loosely than they say: oneOf, which it holds as anyOf
(`hibana_core.grammar.one_of._held_loosely`), and uniqueItems, which it holds to nothing. A strict schema
(the default) is held whole or refused up front by name; oneOf is accepted where its subschemas
exclude each other, and then every sampled output of a random-weight tiny model validates under it;
uniqueItems is taken (pydantic's set fields write it, and their parsing drops repeated items)."""

from __future__ import annotations

import json
import random
import re
from typing import Literal, Union

import jsonschema
import pydantic
import pytest
from typing_extensions import Annotated

from hibana_core import GrammarError, SamplingParams
from hibana_core.grammar import unenforced_keywords
from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    from tiny_models import open_engine

    engine = open_engine(tiny_checkpoints["qwen3"], speculation="off")
    yield engine
    engine.close()


def _generate(engine, schema, seed: int = 0, **params):
    h = engine.open_state("keywords")
    try:
        return h.generate(SamplingParams(max_tokens=120, json_schema=schema, temperature=1.0, seed=seed, **params),
                          prompt=random_tokens(random.Random(seed), 8))
    finally:
        h.close()


def _assert_valid_outputs(engine, schema) -> None:
    for seed in range(4):
        out = _generate(engine, schema, seed)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 3}


class _Tagged(pydantic.BaseModel):
    tags: set[Annotated[int, pydantic.Field(ge=0, le=3)]] = pydantic.Field(max_length=3)


def test_unique_items_is_taken_and_a_pydantic_set_parses(engine):
    """xgrammar holds uniqueItems to nothing ('[1, 1]' passes the grammar), and it is taken, not
    refused: pydantic writes it for set fields, whose parsing drops repeated items, so a structured
    output with a set field parses (README: "uniqueItems not at all")."""
    unique = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
    assert not unenforced_keywords(unique) and not unenforced_keywords(_Tagged.model_json_schema())
    out = _generate(engine, unique)
    assert all(v in (1, 2) for v in json.loads(out.text))
    for seed in range(3):
        out = _generate(engine, _Tagged, seed)
        assert out.finish_reason == "stop", out.text
        assert _Tagged.model_validate_json(out.text).tags <= {0, 1, 2, 3}


class _Cat(pydantic.BaseModel):
    pet_type: Literal["cat"]
    lives: int = pydantic.Field(ge=0, le=9)


class _Dog(pydantic.BaseModel):
    pet_type: Literal["dog"]
    name: str = pydantic.Field(max_length=3)


class _Owner(pydantic.BaseModel):
    pet: Union[_Cat, _Dog] = pydantic.Field(discriminator="pet_type")


OVERLAPPING = {
    # 3 is an integer and a number
    "#": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    # 2 is listed twice; $refs are followed
    "#/properties/v": {"type": "object", "properties": {"v": {"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]}},
                       "required": ["v"]},
    "#/$defs/V": {"$defs": {"V": {"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
                            "A": {"type": "integer"}, "B": {"type": "integer", "minimum": 5}},
                  "$ref": "#/$defs/V"},
    # {} meets both
    "#/items": {"type": "array", "items": {"oneOf": [{"type": "object", "properties": {"a": DIGIT}},
                                                     {"type": "object", "properties": {"b": DIGIT}}]}},
    # "a" meets both: required keys hold objects alone
    "#/properties/s": {"type": "object", "properties": {"s": {"oneOf": [
        {"type": ["object", "string"], "properties": {"k": {"const": 1}}, "required": ["k"]},
        {"type": ["object", "string"], "properties": {"k": {"const": 2}}, "required": ["k"]}]}}},
    # the first takes any key: {"id": 1, "name": "x"} meets both
    "#/properties/who": {"type": "object", "properties": {"who": {"oneOf": [
        {"type": "object", "properties": {"id": DIGIT}, "required": ["id"], "additionalProperties": True},
        {"type": "object", "properties": {"name": SHORT}, "required": ["name"]}]}}},
}


@pytest.mark.parametrize("where", OVERLAPPING)
def test_a_one_of_whose_subschemas_a_value_may_meet_two_of_is_refused_by_name(engine, where):
    """xgrammar holds oneOf as anyOf: where a value may meet two subschemas, an output it allows
    breaks the schema (3 under oneOf integer / number). A GrammarError that names the oneOf and
    its place and says to write anyOf or tell them apart; left to the model with
    strict_schema=False."""
    schema = OVERLAPPING[where]
    refused = rf"oneOf whose subschemas 0 and 1 may both hold a value at {re.escape(where)} \(the grammar holds oneOf"
    with pytest.raises(GrammarError, match=refused + r" as anyOf: write anyOf"):
        _generate(engine, schema)
    json.loads(_generate(engine, schema, strict_schema=False).text)


EXCLUSIVE = [
    {"oneOf": [DIGIT, SHORT]},
    {"oneOf": [SHORT, {"type": "null"}]},
    {"oneOf": [{"enum": [1, 2]}, {"enum": [3, "a"]}, {"const": None}]},
    {"oneOf": [{"const": 1.5}, DIGIT]},
    # a required key with a const of its own in each
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": DIGIT}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"const": "b"}, "y": SHORT}, "required": ["k", "y"]}]},
    # objects written with their declared keys alone, each requiring one the other never writes
    {"oneOf": [{"type": "object", "properties": {"id": DIGIT}, "required": ["id"]},
               {"type": "object", "properties": {"name": SHORT}, "required": ["name"],
                "additionalProperties": False}]},
    # a subschema that is an anyOf, each of whose subschemas excludes the others
    {"oneOf": [{"anyOf": [SHORT, {"type": "boolean"}]}, DIGIT]},
    _Owner.model_json_schema(),
]


@pytest.mark.parametrize("schema", EXCLUSIVE, ids=lambda s: json.dumps(s)[:50])
def test_a_one_of_whose_subschemas_exclude_each_other_is_held(engine, schema):
    """Held as anyOf, a oneOf whose subschemas no output meets two of is held whole: by type, by
    listed values, by a required key with another const in each (pydantic's discriminated
    unions), by keys one requires that the other's output never holds. Every sampled output
    validates under the real oneOf."""
    assert "oneOf" in json.dumps(schema)
    assert not unenforced_keywords(schema)
    _assert_valid_outputs(engine, schema)
