"""Walking a JSON schema: its subschemas (`subschemas`), the targets of its "#/..." pointers, and
the JSON types a value is of."""

from __future__ import annotations

from typing import Any, Iterator

_JSON_TYPES = {bool: ("boolean",), int: ("integer", "number"), float: ("number",), str: ("string",),
               type(None): ("null",), list: ("array",), dict: ("object",)}


def _json_types(value: Any) -> tuple[str, ...]:
    kinds = _JSON_TYPES.get(type(value), ())
    return ("integer", "number") if isinstance(value, float) and value.is_integer() else kinds


def _pointed(schema: Any, ref: str) -> Any:
    """The subschema a "#/..." JSON pointer names, or None (another document, a missing key)."""
    if ref == "#":
        return schema
    if not ref.startswith("#/"):
        return None
    node = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMAS = ("additionalProperties", "items", "not", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "contains", "if", "then", "else", "additionalItems")


def subschemas(schema: dict, at: str) -> Iterator[tuple[str, Any, Any, str]]:
    """Each subschema of `schema` (where a keyword takes one: a property named "if" is none): its
    keyword, its name or index under it (None for a single subschema), it, and its place
    ("#/properties/a")."""
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield key, name, sub, f"{at}/{key}/{name}"
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield key, i, sub, f"{at}/{key}/{i}"
    for key in _SUBSCHEMAS:
        yield key, None, schema.get(key), f"{at}/{key}"
