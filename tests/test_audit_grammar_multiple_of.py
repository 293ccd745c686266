"""An outside audit of an integer's multipleOf: xgrammar 0.2.9 holds it with no bounds or between
two bounds at most 10000 apart, a step of at most 1024; elsewhere it drops it with a warning on
stderr, so the schema must be refused by name (a loose one: left to the model) and a held one
must hold every output."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from hibana_core import GrammarError, SamplingParams
from hibana_core.grammar import unenforced_keywords
from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(600)

DROPPED = [
    {"type": "integer", "multipleOf": 7, "maximum": -1},  # one bound
    {"type": "integer", "multipleOf": 3, "exclusiveMinimum": 1},
    {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 10000},  # 10001 values
    {"type": "integer", "multipleOf": 1025},  # a step past 1024
    {"type": ["integer", "null"], "multipleOf": 5, "minimum": 0},
]

HELD = [
    {"type": "integer", "multipleOf": 7},
    {"type": "integer", "multipleOf": 7, "minimum": -50, "maximum": 100},
    {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 9999},
    {"type": "integer", "multipleOf": 3, "exclusiveMinimum": 0, "exclusiveMaximum": 10001},
    {"type": "integer", "multipleOf": 1024, "minimum": 0, "maximum": 5000},
]


def test_numbers_past_a_float_are_refused_not_an_overflow():
    """A bound or step JSON writes as an integer past a float's range (Python reads it whole) is no
    bound the grammar holds: the multipleOf is refused by name (it was an OverflowError)."""
    for schema in ({"type": "integer", "multipleOf": 7, "minimum": 10**400},
                   {"type": "integer", "multipleOf": 10**400}):
        assert any("multipleOf" in k for k in unenforced_keywords(schema))


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    from tiny_models import open_engine

    engine = open_engine(tiny_checkpoints["qwen3"], speculation="off")
    yield engine
    engine.close()


@pytest.mark.parametrize("schema", DROPPED, ids=lambda s: json.dumps(s)[:60])
def test_a_multiple_of_xgrammar_drops_is_refused_by_name(engine, schema):
    assert any("multipleOf" in k for k in unenforced_keywords(schema))
    h = engine.open_state("drop")
    try:
        with pytest.raises(GrammarError, match="multipleOf"):
            h.generate(SamplingParams(max_tokens=5, json_schema=schema), prompt=[5, 6])
    finally:
        h.close()


@pytest.mark.parametrize("schema", HELD, ids=lambda s: json.dumps(s)[:60])
def test_a_multiple_of_xgrammar_holds_is_taken_and_held(engine, schema):
    assert not unenforced_keywords(schema)
    for seed in range(2):
        h = engine.open_state(f"held-{seed}")
        try:
            out = h.generate(SamplingParams(max_tokens=20, temperature=1.0, seed=seed, json_schema=schema),
                             prompt=random_tokens(random.Random(seed), 8))
        finally:
            h.close()
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
