"""Whether two subschemas exclude each other (`_exclusive`): xgrammar holds oneOf as anyOf, which
is oneOf only where they do (`_held_loosely` names a oneOf where they may not)."""

from __future__ import annotations

from typing import Any

from hibana_core.config import is_kind
from hibana_core.grammar.schema import _json_types, _pointed

def _held_loosely(schema: dict, root: Any) -> list[tuple[str, str]]:
    """(keyword, what to do) for a oneOf whose subschemas a value may meet two of: xgrammar holds
    oneOf as anyOf, which is oneOf where they exclude each other (`_exclusive`: types apart, or a
    required key with a const of its own in each, as pydantic's discriminated unions write it)."""
    found = []
    branches = schema.get("oneOf")
    if isinstance(branches, list):
        pair = next(((i, j) for j in range(len(branches)) for i in range(j)
                     if not _exclusive(branches[i], branches[j], root)), None)
        if pair is not None:
            found.append((f"oneOf whose subschemas {pair[0]} and {pair[1]} may both hold a value",
                          "the grammar holds oneOf as anyOf: write anyOf where a value may meet both, or tell "
                          "them apart, by type or by a required key with another const in each"))
    return found


EXCLUSIVE_DEPTH = 32
"""How deep `_exclusive` follows subschemas and $refs (a recursive schema's): past it, not exclusive."""


def _exclusive(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    """Whether no output the grammar writes for either schema is valid under the other (False
    where that cannot be told): a oneOf whose subschemas are pairwise so is its anyOf, as
    xgrammar holds it. Schemas no value meets both of are: by their kinds of value (type, const,
    enum), by listed values the other refuses, by a key one requires with a value the other
    refuses there; and objects the grammar writes with their declared keys alone, where each
    requires a key the other never writes."""
    if depth > EXCLUSIVE_DEPTH:
        return False
    a, b = _followed(a, root), _followed(b, root)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return _disjoint(a, b, root, depth) or (_unwritten(a, b) and _unwritten(b, a))


def _disjoint(a: dict, b: dict, root: Any, depth: int) -> bool:
    kinds_a, kinds_b = _kinds(a), _kinds(b)
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    for x, y in ((a, b), (b, a)):
        for key in ("anyOf", "oneOf"):  # each branch excludes the other schema
            if isinstance(x.get(key), list) and x[key] and all(_exclusive(s, y, root, depth + 1) for s in x[key]):
                return True
        if isinstance(x.get("allOf"), list) and any(_exclusive(s, y, root, depth + 1) for s in x["allOf"]):
            return True
        listed = [x["const"]] if "const" in x else x.get("enum")
        if isinstance(listed, list) and not any(_valid(value, y, root) for value in listed):
            return True
        # (an object alone: beside "type": ["object", "string"] any string meets both)
        required = x.get("required") if isinstance(x.get("required"), list) and _kinds(x) == {"object"} else []
        declared_x = x.get("properties") if isinstance(x.get("properties"), dict) else {}
        declared_y = y.get("properties") if isinstance(y.get("properties"), dict) else {}
        for key in required:
            if key in declared_y:
                there = declared_y[key]
            elif "patternProperties" in y:
                continue  # (which of them takes the key is not weighed)
            else:
                there = y.get("additionalProperties", True)
            if _exclusive(declared_x.get(key, True), there, root, depth + 1):
                return True
    return False


def _unwritten(x: dict, y: dict) -> bool:
    """Whether `y` requires a key that the grammar never writes in `x`'s output: an object alone,
    with its declared keys alone (additionalProperties false, or left out: `_opened`)."""
    declared = x.get("properties") if isinstance(x.get("properties"), dict) else {}
    fewest = x.get("minProperties", 0)
    closed = x.get("additionalProperties", False) is False and not (
        {"patternProperties", "unevaluatedProperties"} & x.keys()
        or (is_kind(fewest, int) and fewest > len(declared)))
    required = y.get("required") if isinstance(y.get("required"), list) else []
    return closed and _kinds(x) == {"object"} and any(key not in declared for key in required)


def _followed(schema: Any, root: Any) -> Any:
    """`schema`, or the schema its $ref points at (constraints beside a $ref are refused apart)."""
    for _ in range(EXCLUSIVE_DEPTH):
        if not isinstance(schema, dict) or not isinstance(schema.get("$ref"), str):
            return schema
        schema = _pointed(root, schema["$ref"])
    return None


def _kinds(schema: dict) -> set[str] | None:
    """The JSON types a schema's values may be of (an integer is a number too), None where any."""
    kinds = schema.get("type")
    if isinstance(kinds, str) or isinstance(kinds, list):
        found = {kinds} if isinstance(kinds, str) else set(kinds)
    elif "const" in schema:
        found = set(_json_types(schema["const"]))
    elif isinstance(schema.get("enum"), list):
        found = {kind for value in schema["enum"] for kind in _json_types(value)}
    else:
        return None
    return found | {"integer"} if "number" in found else found


def _valid(value: Any, schema: Any, root: Any) -> bool:
    """Whether `value` is valid under `schema`, a subschema of `root` (True where that cannot be told)."""
    import jsonschema

    try:
        return jsonschema.Draft202012Validator(root).evolve(schema=schema).is_valid(value)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot run (its metaschema check comes first)
        return True
