"""What a JSON schema asks that the grammar cannot hold the output to (`unenforced_keywords`;
`check_held` refuses a strict schema for them): keywords xgrammar 0.2.9 compiles but does not
enforce, keywords it drops beside others, formats it holds to nothing, a multipleOf it drops,
a oneOf it holds as a looser anyOf, a pattern it reads otherwise."""

from __future__ import annotations

import math
import re
from typing import Any

from hibana_core.config import is_kind
from hibana_core.errors import GrammarError
from hibana_core.grammar.one_of import _held_loosely
from hibana_core.grammar.regex import _RAW_TODO, raw_in_json_string, unenforced_regex
from hibana_core.grammar.schema import subschemas

UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                       "dependencies", "if", "then", "else", "not", "$dynamicRef", "$recursiveRef")
"""JSON-schema keywords xgrammar 0.2.9 compiles but does not hold the output to (as allOf with
more than one subschema): an output "valid by construction" could break them, so they are refused.
(oneOf is held as anyOf: refused where that is looser, `_held_loosely`. uniqueItems is held to
nothing, and taken: pydantic writes it for set fields, whose parsing drops repeated items.)"""


def unenforced_keywords(schema: Any, at: str = "#", root: Any = None) -> list[str]:
    """Where `schema` uses a keyword the grammar cannot hold ("contains at #/properties/xs"),
    and what to do instead where there is something; walking subschemas only (a property named
    "if" is no keyword). `root`: the whole schema, which its $refs point into (`schema` itself)."""
    if not isinstance(schema, dict):
        return []
    root = schema if root is None else root
    found = [f"{key} at {at}" for key in UNENFORCED_KEYWORDS if key in schema]
    if len(schema.get("allOf") or ()) > 1:
        found.append(f"allOf with {len(schema['allOf'])} subschemas at {at}")
    found += [f"{what} at {at} ({todo})" for what, todo in _dropped_beside_others(schema)]
    found += [f"{what} at {at} ({todo})" for what, todo in _held_loosely(schema, root)]
    for key, name, sub, where in subschemas(schema, at):
        if key == "patternProperties":  # its name is a regex too
            found += [f"{what} at {at}/{key} ({todo})" for what, todo in unenforced_regex(name, repr(name))]
            if raw_in_json_string(name):
                found.append(f"pattern {name!r:.80} at {at}/{key} ({_RAW_TODO})")
        found += unenforced_keywords(sub, where, root)
    return found


def check_held(schema: Any) -> None:
    """A GrammarError naming each keyword of `schema` that the grammar cannot hold the output to."""
    unenforced = unenforced_keywords(schema)
    if unenforced:
        raise GrammarError(f"the JSON schema uses keywords the grammar cannot hold the output to "
                           f"({'; '.join(unenforced)}): the output could break them; drop them, or "
                           "bound the values another way, and check the rest in your code")


HELD_FORMATS = frozenset({"email", "hostname", "date", "time", "date-time", "duration", "ipv4", "ipv6", "uuid",
                          "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
"""The formats xgrammar 0.2.9 holds a string to (beside them it ignores minLength/maxLength; beside
any other format it holds the lengths)."""

UNHELD_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
"""The formats JSON Schema defines (2020-12, which validators check) that xgrammar 0.2.9 holds to
nothing: any string. Others it holds (email, hostname, date, time, date-time, duration, ipv4,
ipv6, uuid, uri, uri-reference, uri-template, json-pointer, relative-json-pointer); a format
JSON Schema does not define (pydantic's "password", "path", "binary") is an annotation, which
any string meets."""


_BOUNDS = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
           "exclusiveMaximum", "minItems", "maxItems", "minProperties", "maxProperties", "required")
"""Keywords that bound a value; beside an enum or a const xgrammar writes the listed values alone."""


_VALIDATION = ("type", "enum", "const", *_BOUNDS, "multipleOf", "properties", "patternProperties",
               "additionalProperties", "propertyNames", "items", "prefixItems", "unevaluatedItems",
               "unevaluatedProperties", "anyOf", "oneOf", "allOf", "uniqueItems")
"""Keywords that constrain a value (annotations such as description or default do not); beside a
$ref xgrammar holds the referenced schema alone and drops them."""


def _dropped_beside_others(schema: dict) -> list[tuple[str, str]]:
    """(keyword, what to do) for each keyword of one schema that xgrammar 0.2.9 drops, with a
    warning on stderr or none: a length beside a pattern or a format, a multipleOf but an
    integer's by an integer, a bound beside an enum or a const (`{"enum": ["abcdef"], "maxLength":
    2}` allows "abcdef"), a required key that properties does not declare, a $ref that is no
    JSON pointer into the schema (an anchor, another document: any value passes) or that has
    constraints beside it, and the parts of a pattern its regex reader skips."""
    found = []
    listed = next((key for key in ("enum", "const") if key in schema), None)
    bounds = "/".join(key for key in _VALIDATION if key in schema and key not in ("type", "enum", "const"))
    if listed and bounds:
        found.append((f"{bounds} beside {listed}", f"list only the values that meet {bounds}, and drop it"))
    branched = next((key for key in ("anyOf", "oneOf", "allOf") if key in schema), None)
    beside = "/".join(key for key in _VALIDATION if key in schema and key not in ("anyOf", "oneOf", "allOf"))
    if branched and beside and not listed:  # xgrammar holds the branches alone (`"type"` too)
        found.append((f"{beside} beside {branched}", f"move them into each subschema of {branched}"))
    lengths = "/".join(key for key in ("minLength", "maxLength") if key in schema)
    if lengths and "pattern" in schema:
        found.append((f"{lengths} beside pattern", "bound the length in the pattern, as ^[a-z]{1,8}$"))
    if lengths and schema.get("format") in HELD_FORMATS:
        found.append((f"{lengths} beside format", "drop one of them and check the other in your code"))
    if "pattern" in schema and schema.get("format") in HELD_FORMATS:  # the format's grammar is written alone
        found.append(("pattern beside format", "drop one of them (a pattern can say the format too) and check the "
                                               "other in your code"))
    properties = schema.get("properties")
    if isinstance(properties, dict) and properties:  # xgrammar holds these on undeclared keys alone
        barred = _barred_names(schema.get("propertyNames"), properties)
        if barred:
            found.append((f"propertyNames barring declared {barred[:3]}", "it is held on keys properties does not "
                                                                          "declare alone: declare only keys it allows"))
        overlapping = [key for key in properties if isinstance(key, str) and any(
            _matches(pattern, key) for pattern in schema.get("patternProperties") or {})]
        if overlapping:
            found.append((f"patternProperties matching declared {overlapping[:3]}",
                          "a declared key is held to its properties schema alone: put the pattern's constraints "
                          "into it"))
    if schema.get("format") in UNHELD_FORMATS:
        found.append((f"format {schema['format']!r}", "xgrammar writes any string for it: give a pattern, or "
                                                      "check it in your code"))
    if _multiple_of_dropped(schema):
        found.append(("multipleOf", f'held on {{"type": "integer"}} by an integer of at most {MULTIPLE_OF_MOST} '
                                    "alone, with no bounds or with both a minimum and a maximum at most "
                                    f"{MULTIPLE_OF_RANGE_MOST} integers apart; bound the value so, or check it "
                                    "in your code"))
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append((f"$ref {ref!r}", "point it into this schema, as #/$defs/Name: anchors and other documents "
                                       "are not followed"))
    beside_ref = "/".join(key for key in _VALIDATION if key in schema) if "$ref" in schema else ""
    if beside_ref:
        found.append((f"{beside_ref} beside $ref", "the referenced schema is held alone: move them into it"))
    undeclared = _undeclared_required(schema)
    if undeclared:
        found.append((f"required {undeclared} not under properties", "declare each required key under properties"))
    if isinstance(schema.get("pattern"), str):
        found += unenforced_regex(schema["pattern"], "pattern")
        if raw_in_json_string(schema["pattern"]):
            found.append((f"pattern {schema['pattern']!r:.80}", _RAW_TODO))
    return found


def _barred_names(names: Any, properties: dict) -> list[str]:
    """The declared keys a propertyNames schema refuses (all of them where it cannot be read)."""
    if names is None:
        return []
    import jsonschema

    try:
        validator = jsonschema.Draft202012Validator(names)
        return [key for key in properties if not validator.is_valid(key)]
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot run (its metaschema check comes first)
        return list(properties)


def _matches(pattern: Any, key: str) -> bool:
    """Whether a patternProperties regex (ECMA, read here as Python's re: True where unsure) matches `key`."""
    try:
        return re.search(pattern, key) is not None
    except (re.error, TypeError):
        return True


MULTIPLE_OF_MOST, MULTIPLE_OF_RANGE_MOST = 1024, 10000
"""xgrammar 0.2.9 holds an integer's multipleOf of at most this step, with no bounds or between two
bounds that hold at most this many integers; elsewhere it drops it with a warning on stderr (any
value passed {"type": "integer", "multipleOf": 7, "maximum": -1})."""


def _multiple_of_dropped(schema: dict) -> bool:
    """Whether xgrammar drops the schema's multipleOf: it holds an integer's by an integer alone,
    with no bounds or between two close ones (`MULTIPLE_OF_MOST`)."""
    step, kind = schema.get("multipleOf"), schema.get("type")
    integers = kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind)
    if step is None:
        return False
    if not (integers and is_kind(step, float) and float(step).is_integer() and 0 < step <= MULTIPLE_OF_MOST):
        return True
    if not any(key in schema and not isinstance(schema[key], bool)  # (draft 4's flags bound nothing alone)
               for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return False
    low, high = _integer_range(schema)  # a bound it cannot read (past a float) counts as none that way
    return low is None or high is None or high - low + 1 > MULTIPLE_OF_RANGE_MOST


def _integer_range(schema: dict) -> tuple[int | None, int | None]:
    """The least and the greatest integer `schema`'s bounds allow (None: unbounded that way), with
    draft 4's boolean exclusiveMinimum/exclusiveMaximum as flags on minimum/maximum."""
    def number(key: str) -> float | None:
        value = schema.get(key)
        return value if is_kind(value, float) else None

    lows, highs = [], []
    low, high = number("minimum"), number("maximum")
    if low is not None:
        lows.append(math.floor(low) + 1 if schema.get("exclusiveMinimum") is True else math.ceil(low))
    if high is not None:
        highs.append(math.ceil(high) - 1 if schema.get("exclusiveMaximum") is True else math.floor(high))
    low, high = number("exclusiveMinimum"), number("exclusiveMaximum")
    if low is not None:
        lows.append(math.floor(low) + 1)
    if high is not None:
        highs.append(math.ceil(high) - 1)
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _undeclared_required(schema: dict) -> list[str]:
    """The keys `required` names that `properties` does not declare: xgrammar writes the declared
    keys alone, so `{"required": ["a"]}` allowed `{}`."""
    required = schema.get("required")
    if not isinstance(required, list):
        return []
    declared = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return [key for key in required if key not in declared]
