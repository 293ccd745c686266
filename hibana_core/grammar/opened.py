"""A JSON schema rewritten as xgrammar must read it to hold what JSON Schema says (`_opened`):
open objects that must hold more keys than they declare, oneOf as anyOf, draft 4's and
non-whole bounds as xgrammar reads bounds, a type for bounds of one kind of value, any items for
lists that name none, patterns as `held_regex` writes them, and the keywords xgrammar would drop
with a warning left out."""

from __future__ import annotations

import math
from typing import Any

from hibana_core.config import is_kind
from hibana_core.grammar.keywords import HELD_FORMATS, _multiple_of_dropped
from hibana_core.grammar.regex import held_regex, raw_in_json_string
from hibana_core.grammar.schema import subschemas

def _opened(schema: Any) -> Any:
    """`schema` with `additionalProperties: true` on each object that leaves it out yet asks for
    more keys (minProperties) than it declares. xgrammar's strict mode, which keeps an object to
    its declared keys where additionalProperties is left out (as OpenAI's strict outputs do),
    refuses such a schema, which JSON Schema's default (open objects) satisfies. A `oneOf` is
    written `anyOf`, as xgrammar holds it anyway (it says so on stderr at every compile; a strict
    schema's oneOf is one whose subschemas exclude each other, `_held_loosely`), and the
    keywords xgrammar ignores with a warning are left out."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, name, sub, _ in subschemas(schema, "#"):
        if not isinstance(sub, dict):
            continue
        if name is None:
            out[key] = _opened(sub)
        elif isinstance(out[key], dict):
            out[key] = {**out[key], name: _opened(sub)}
        else:
            out[key] = [_opened(s) if i == name else s for i, s in enumerate(out[key])]
    _numeric_bounds(out)
    if isinstance(out.get("items"), list):  # draft 7's tuple (xgrammar: "items must be a boolean or an object")
        out["prefixItems"] = out.pop("items")
        if "additionalItems" in out:
            out["items"] = out.pop("additionalItems")
    declared = schema.get("properties")
    declared = len(declared) if isinstance(declared, dict) else 0
    wanted = schema.get("minProperties")
    if (isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > declared
            and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & schema.keys()):
        out["additionalProperties"] = True
    if "oneOf" in out and "anyOf" not in out:  # held as anyOf, without xgrammar's stderr warning
        out["anyOf"] = out.pop("oneOf")
    # what xgrammar would drop with a warning on stderr at every compile, dropped here (a strict
    # schema was refused for them already, `check_held`; a loose one leaves them to the model)
    if "pattern" in out or out.get("format") in HELD_FORMATS:
        out.pop("minLength", None), out.pop("maxLength", None)
    if _multiple_of_dropped(schema):
        del out["multipleOf"]
    if isinstance(out.get("pattern"), str):
        if raw_in_json_string(out["pattern"]):  # (a strict schema was refused for it, `check_held`)
            del out["pattern"]
        else:
            out["pattern"] = held_regex(out["pattern"], json_pattern=True)
    if "type" not in out and not _TYPED_ELSEWHERE & out.keys():
        # bounds of one kind of value xgrammar drops without a "type" (any value passed
        # {"minimum": 3}); they hold only values of that kind, so holding the output to it is valid
        kinds = [kind for kind, keys in _TYPED_BOUNDS.items() if keys & out.keys()]
        if kinds:
            out["type"] = kinds[0] if len(kinds) == 1 else kinds
    # a list with no `items` that lists none, or must hold more items than it lists: any items, as JSON
    # Schema's default (xgrammar's strict mode allows none there: it refused {"type": "array", "minItems": 1},
    # and held {"type": "array", "maxItems": 3} and, in qwen_xml's style, {"type": "array"} to [])
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    fewest, listed = out.get("minItems"), out.get("prefixItems")
    listed = len(listed) if isinstance(listed, list) else 0
    if ("array" in types and (not listed or (isinstance(fewest, int) and not isinstance(fewest, bool)
                                             and fewest > listed))
            and not {"items", "additionalItems", "unevaluatedItems"} & out.keys()):
        out["items"] = True
    return out


def _numeric_bounds(out: dict) -> None:
    """`out`'s bounds as xgrammar reads them: draft 4's boolean exclusiveMinimum/exclusiveMaximum (a
    flag on minimum/maximum, which xgrammar refused: "Value must be a number") as the numbers later
    drafts write, and an integer's bounds that are not whole as the whole ones they allow (xgrammar
    refused {"type": "integer", "minimum": 0.5}: "Integer constraint must be a whole number")."""
    for inclusive, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(exclusive), bool):
            if out.pop(exclusive) and inclusive in out:
                out[exclusive] = out.pop(inclusive)
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "integer" not in kinds or "number" in kinds:
        return
    for key, bound, whole, tighter in (("minimum", "minimum", math.ceil, max),
                                       ("exclusiveMinimum", "minimum", math.ceil, max),
                                       ("maximum", "maximum", math.floor, min),
                                       ("exclusiveMaximum", "maximum", math.floor, min)):
        value = out.get(key)
        if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
            del out[key]  # more than 0.5 is 1 or more, as 0.5 or more is
            kept = out.get(bound)
            out[bound] = whole(value) if not is_kind(kept, float) else tighter(kept, whole(value))


_TYPED_BOUNDS = {"number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
                 "string": {"minLength", "maxLength", "pattern", "format"},
                 "array": {"minItems", "maxItems", "uniqueItems"}}
"""Keywords that bound one kind of value alone, which xgrammar ignores in a schema without a type."""
_TYPED_ELSEWHERE = frozenset({"enum", "const", "$ref", "anyOf", "oneOf", "allOf", "properties", "required",
                              "additionalProperties", "patternProperties", "propertyNames", "minProperties",
                              "maxProperties", "items", "prefixItems"})
"""Keywords beside which the value's kind is not the bounds' to say (an object's, a list's, the listed values')."""
