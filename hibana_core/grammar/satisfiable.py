"""Schemas and grammars that xgrammar would compile though they allow no value, or no finite one:
an empty anyOf, oneOf or enum, listed values of another type, a number range that holds no
number xgrammar writes, a recursion with no way out (a schema's $refs, an EBNF's rules). Their
callers turn them into GrammarErrors."""

from __future__ import annotations

import fractions
import json
import math
import re
from typing import Any, Callable

from hibana_core.config import is_kind
from hibana_core.grammar.schema import _json_types, _pointed, subschemas

def unsatisfiable(schema: Any, at: str = "#") -> list[str]:
    """Where `schema` allows no value that xgrammar would still write one for ("anyOf with no
    subschema at #/properties/a"): an empty anyOf, oneOf or enum, and enum or const values of
    another type than the schema's (xgrammar writes the values, whatever the type says)."""
    if not isinstance(schema, dict):
        return []
    found = [f"{key} with no subschema at {at}" for key in ("anyOf", "oneOf")
             if isinstance(schema.get(key), list) and not schema[key]]
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
    if isinstance(schema.get("enum"), list):
        if not schema["enum"]:
            found.append(f"an empty enum at {at}")
        elif kinds is not None:
            wrong = [v for v in schema["enum"] if not set(_json_types(v)) & set(kinds)]
            if wrong:
                found.append(f"enum values {json.dumps(wrong)[:60]} at {at} are not of type {'/'.join(kinds)}")
    if "const" in schema and kinds is not None and not set(_json_types(schema["const"])) & set(kinds):
        found.append(f"const {json.dumps(schema['const'])[:40]} at {at} is not of type {'/'.join(kinds)}")
    for _, _, sub, where in subschemas(schema, at):
        found += unsatisfiable(sub, where)
    return found


RANGE_DECIMALS = 6
"""Digits after the point of the numbers xgrammar 0.2.9 writes for a `"type": "number"` with bounds
(0.1234565 is not written, 0.123457 is): a range that holds none of them, [1e-07, 2e-07], it
writes as no value at all, an empty output."""


def unwritable_ranges(schema: Any, at: str = "#") -> list[str]:
    """Where `schema` (as `_opened` writes it: numeric exclusive bounds) bounds a number to a range
    that holds no number of RANGE_DECIMALS digits after the point ("[1e-07, 2e-07] at #/properties/x")."""
    if not isinstance(schema, dict):
        return []
    found = []
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    low = _bound(schema, "minimum", "exclusiveMinimum", max)
    high = _bound(schema, "maximum", "exclusiveMaximum", min)
    if "number" in kinds and "integer" not in kinds and low is not None and high is not None:
        step = fractions.Fraction(1, 10 ** RANGE_DECIMALS)
        first = math.ceil(low[0] / step) * step
        first += step if low[1] and first == low[0] else 0
        if first > high[0] or (first == high[0] and high[1]):
            found.append(f"{'(' if low[1] else '['}{low[2]}, {high[2]}{')' if high[1] else ']'} at {at}")
    for _, _, sub, where in subschemas(schema, at):
        found += unwritable_ranges(sub, where)
    return found


def _bound(schema: dict, inclusive: str, exclusive: str,
           tighter: Callable[..., Any]) -> tuple[fractions.Fraction, bool, Any] | None:
    """A number's lower (`tighter` max) or upper (min) bound: (its value, read as the decimal its
    JSON spells, whether it is exclusive, the value as given), or None."""
    bounds = [(fractions.Fraction(repr(schema[key])), key == exclusive, schema[key]) for key in (inclusive, exclusive)
              if is_kind(schema.get(key), int) or (is_kind(schema.get(key), float) and math.isfinite(schema[key]))]
    if not bounds:
        return None
    # the tighter value; of two equal ones the exclusive
    return tighter(bounds, key=lambda b: (b[0], b[1] if tighter is max else not b[1]))


def without_finite_value(schema: Any) -> str | None:
    """The first `$ref` target of `schema` ("#/$defs/Node") whose every value contains another
    value of it (a required property or a non-empty list leading back), where the whole schema
    has no finite value; else None. xgrammar's forced-string search (`find_jump_forward_string`)
    never ends on such a grammar. A fixpoint over the $ref targets: one is finite once a value
    of it needs only targets already known finite. Unsure cases count as finite."""
    found: dict[str, None] = {}  # $ref targets met, in order
    finite: set[str] = set()

    def ok(node: Any) -> bool:
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.setdefault(ref)
            return ref in finite or _pointed(schema, ref) is None
        if "enum" in node or "const" in node:
            return True
        branches = node.get("anyOf", node.get("oneOf"))
        if isinstance(branches, list) and branches and not any(ok(b) for b in branches):
            return False
        if isinstance(node.get("allOf"), list) and not all(ok(b) for b in node["allOf"]):
            return False
        kinds = node.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        return not isinstance(kinds, list) or any(kind_ok(kind, node) for kind in kinds)

    def kind_ok(kind: Any, node: dict) -> bool:
        if kind == "object":
            properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = node.get("required") if isinstance(node.get("required"), list) else []
            return all(ok(properties.get(key, True)) for key in required if isinstance(key, str))
        if kind == "array":
            least = node.get("minItems", 0) if is_kind(node.get("minItems", 0), int) else 0
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            return all(ok(p) for p in prefix[:least]) and (least <= len(prefix) or ok(node.get("items", True)))
        return True

    root_ok, grew = ok(schema), True
    while not root_ok and grew:
        met = len(found)  # a pass meets targets too (b, met while a was weighed): they are weighed next
        grew = False
        for ref in list(found):
            if ref not in finite and ok(_pointed(schema, ref)):
                finite.add(ref)
                grew = True
        grew = grew or len(found) > met
        root_ok = ok(schema)
    return None if root_ok else next((ref for ref in found if ref not in finite), "#")


_EBNF_TOKEN = re.compile(r'\s*("(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\(=|'
                         r'\{\s*\d+\s*,\s*-?\d+\s*\}|[()|*+?])')


def rules_without_finite_string(ebnf: str) -> list[str]:
    """The rules of xgrammar's normalized EBNF (`str(Grammar)`) that derive no finite string (a
    fixpoint: a rule is finite once one alternative needs only finite rules); xgrammar's
    forced-string search never ends on them. Text this reader does not follow leaves every rule
    counted finite."""
    rules = {}
    for line in ebnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            return []
        tokens = _EBNF_TOKEN.findall(body)
        if re.sub(r"\s+", "", "".join(tokens)) != re.sub(r"\s+", "", body):
            return []
        rules[name.strip()] = tokens
    finite: set[str] = set()

    def expression(tokens: list[str], at: int) -> tuple[bool, int]:
        ok, at = sequence(tokens, at)
        while at < len(tokens) and tokens[at] == "|":
            more, at = sequence(tokens, at + 1)
            ok = ok or more
        return ok, at

    def sequence(tokens: list[str], at: int) -> tuple[bool, int]:
        ok = True
        while at < len(tokens) and tokens[at] not in ("|", ")"):
            token = tokens[at]
            if token in ("(", "(="):
                item, at = expression(tokens, at + 1)
                item = item or token == "(="  # a lookahead reads nothing
                at += 1  # the closing parenthesis
            else:
                item, at = (token in finite) if token[0].isalpha() or token[0] == "_" else True, at + 1
            if at < len(tokens) and (tokens[at] in ("*", "?", "+") or tokens[at].startswith("{")):
                suffix = tokens[at]
                item = item or suffix in ("*", "?") or (suffix.startswith("{") and int(suffix[1:].split(",")[0]) == 0)
                at += 1
            ok = ok and item
        return ok, at

    grew = True
    while grew:
        grew = False
        for name, tokens in rules.items():
            if name not in finite and expression(tokens, 0)[0]:
                finite.add(name)
                grew = True
    return [name for name in rules if name not in finite]
