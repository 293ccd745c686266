"""A JSON schema compiled to an xgrammar Grammar for compact JSON (`json_schema_grammar`), after
the schema checks, with the repairs of xgrammar's EBNF it needs: strings without control
characters or lone surrogates, numbers of bounded digits, dates and times that exist. Structural
tags get the same compact JSON, and their XML styles' values the same repairs (`compact_json_tag`)."""

from __future__ import annotations

import json
import re
from typing import Any

from hibana_core.errors import GrammarError
from hibana_core.grammar.backend import _message, _xgrammar
from hibana_core.grammar.opened import _opened
from hibana_core.grammar.satisfiable import RANGE_DECIMALS, unsatisfiable, unwritable_ranges, without_finite_value

# xgrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n], which lets control
# characters through (json.loads refuses them); the unbounded string rule excludes \0-\x1f
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_JSON_CHARACTER = r'[^\0-\x1f\"\\]'
# and it writes a \u escape as any four hex digits, a lone UTF-16 surrogate among them ("\ud800"): json.loads
# reads it as a str that no UTF-8 holds, whose call the next turn's history refuses (a ConversationError)
_HEX = "[A-Fa-f0-9]"
_ANY_ESCAPE = f'("u" {_HEX} {_HEX} {_HEX} {_HEX})'
_CHARACTER_ESCAPE = (f'("u" (([0-9A-Ca-cEeFf] {_HEX} {_HEX} {_HEX}) | ([Dd] [0-7] {_HEX} {_HEX})'
                     f' | ([Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] {_HEX} {_HEX})))')
# xgrammar writes a number's digits as unbounded repetitions ([0-9]*, or a one-digit rule{n, -1}): a
# small model that starts repeating a digit never leaves the number (json_schema_grammar bounds them)
MAX_NUMBER_DIGITS = 18
"""Digits a JSON number may have after its first, before the point, and after the point (18 + the
first: every int64, such as the 19-digit ids some APIs use)."""
MAX_EXPONENT_DIGITS = 2
"""Digits of a JSON number's exponent: every number the grammar allows is then below 1e119, a
finite double (three digits let "429000888e906" through, which JSON readers take as infinity),
and every double from 1e-99 to 1e99 keeps a spelling."""
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)
# an exponent's digits: basic_number_digits, or a rule of its own where xgrammar writes a number apart (an XML
# style's number parameter: root_prop_0_digits)
_EXPONENT = re.compile(r"(\[eE\] \w+ \w+)\{1, -1\}")


def json_schema_grammar(schema: Any) -> Any:
    """An xgrammar Grammar for JSON valid under `schema`, compact (`json.dumps` spacing)."""
    xgr = _xgrammar()
    try:
        opened = _opened(schema)
        text, original = json.dumps(opened), json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the JSON schema is not plain JSON data ({exc})") from None
    impossible = unsatisfiable(schema)
    if impossible:
        raise GrammarError(f"the JSON schema allows no value at some places ({'; '.join(impossible)}); fix them "
                           "(an output would break the schema there)")
    unwritable = unwritable_ranges(opened)
    if unwritable:
        raise GrammarError(f"the JSON schema has number ranges that hold no number of at most {RANGE_DECIMALS} "
                           f"digits after the point ({'; '.join(unwritable)}), the only numbers xgrammar writes "
                           "between bounds (it would write no value there); widen them, or scale the value (in "
                           "millionths, say)")
    endless = without_finite_value(schema)
    if endless is not None:
        raise GrammarError(f"the JSON schema has no finite value: every value of {endless} holds another (through "
                           "required properties, or lists that may not be empty); make one of them optional or let "
                           "the list be empty")
    from hibana_core.messages import schema_problem

    problem = schema_problem(original)  # xgrammar reads `"maxLength": -1` as no bound, fails on `"minLength": -1`
    if problem:
        raise GrammarError(f"the JSON schema cannot be compiled: it breaks JSON Schema's metaschema: {problem}; "
                           "write it as JSON Schema defines its keywords")
    try:
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    except RuntimeError as exc:
        raise GrammarError(f"the JSON schema cannot be compiled: {_message(exc)}; fix the schema or "
                           "drop the keywords named") from None
    ebnf = str(grammar)
    repaired = _repaired(ebnf)
    return grammar if repaired == ebnf else xgr.Grammar.from_ebnf(_reparsable(repaired))


def _repaired(ebnf: str) -> str:
    """xgrammar's EBNF of JSON values with the repairs above: strings with min/maxLength without
    control characters, no lone surrogate escapes, numbers of bounded digits, dates and times
    that exist."""
    return _real_dates(_bound_numbers(ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER)
                                      .replace(_ANY_ESCAPE, _CHARACTER_ESCAPE)))


_BYTE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def _reparsable(ebnf: str) -> str:
    """xgrammar's printed EBNF as its parser reads it back: it prints U+0080..U+00FF (and control
    characters) as \\xHH, and reads as many hex digits as follow a \\x, so "\\xe9a" ("éa") came back
    as U+0E9A; \\u00HH takes exactly its four."""
    return _BYTE_ESCAPE.sub(lambda m: f"{m[1]}\\u00{m[2]}", ebnf)


def _bound_numbers(ebnf: str) -> str:
    """`ebnf` with every run of digits bounded (MAX_NUMBER_DIGITS, MAX_EXPONENT_DIGITS): the numbers
    it allows that JSON readers hold exactly stay, an output cannot be one endless number, and no
    number overflows a double."""
    ebnf = _EXPONENT.sub(lambda m: f"{m[1]}{{1, {MAX_EXPONENT_DIGITS}}}", ebnf)
    ebnf = ebnf.replace("[0-9]*", f"[0-9]{{0, {MAX_NUMBER_DIGITS}}}")
    for rule in _DIGIT_RULE.findall(ebnf):
        ebnf = re.sub(rf"\b{rule}\{{(\d+), -1\}}",
                      lambda m: f"{rule}{{{m[1]}, {max(int(m[1]), MAX_NUMBER_DIGITS)}}}", ebnf)
    return ebnf


_MONTH = '(("0" [1-9]) | ("1" [0-2]))'
_DAY = '(("0" [1-9]) | ([1-2] [0-9]) | ("3" [01]))'
_MONTH_DAY = ('((("0" [13578]) | ("1" [02])) "-" (("0" [1-9]) | ([1-2] [0-9]) | ("3" [01])))'
              ' | ((("0" [469]) | ("11")) "-" (("0" [1-9]) | ([1-2] [0-9]) | ("30")))'
              ' | ("02" "-" (("0" [1-9]) | ("1" [0-9]) | ("2" [0-8])))')
_YEAR = '(([1-9] [0-9]{3}) | ("0" [1-9] [0-9]{2}) | ("00" [1-9] [0-9]) | ("000" [1-9]))'
_SECOND = '(([0-5] [0-9]) | ("6" "0"))'
_SECONDS_AND_FRACTION = re.compile(r'":" \[0-5\] \[0-9\] ":" (\w+) (\w+)')
MAX_FRACTION_DIGITS = 9
"""Digits of a second's fraction in a `format` of time or date-time (nanoseconds)."""


def _real_dates(ebnf: str) -> str:
    """`ebnf` with xgrammar's `format` date, time and date-time held to dates and times that
    exist (its grammars let through Feb 30, Apr 31, year 0000, second 60 at any minute and
    endless fractions of a second, which Python's datetime and so pydantic refuse): each month
    with its own days (February's 1-28: a year's leapness is more than a grammar should carry),
    years from 0001, seconds below 60, fractions of 1-9 digits."""
    rules = dict(re.findall(r"^(\w+) ::= (.*)$", ebnf, re.MULTILINE))
    months = [name for name, body in rules.items() if body == _MONTH]
    days = [name for name, body in rules.items() if body == _DAY]
    for year in [name for name, body in rules.items() if body == "(([0-9]))"]:
        for month in months:
            for day in days:  # whole names: a second date's day rule is the first's name and "_1"
                ebnf = re.sub(rf'\b{year}\{{4, 4\}} "-" {month} "-" {day}\b',
                              lambda _: f'{_YEAR} "-" ({_MONTH_DAY})', ebnf)
    for second, fraction in _SECONDS_AND_FRACTION.findall(ebnf):  # hh ":" mm ":" ss fraction
        if rules.get(second) == _SECOND:
            ebnf = ebnf.replace(f"{second} ::= {_SECOND}", f"{second} ::= (([0-5] [0-9]))")
        digits = re.fullmatch(r'\(\"\" \| \("\." (\w+)\)\)', rules.get(fraction, ""))
        if digits and rules.get(digits[1]) == f"(([0-9] {digits[1]}) | ([0-9]))":
            ebnf = ebnf.replace(f"{digits[1]} ::= {rules[digits[1]]}",
                                f"{digits[1]} ::= (([0-9]{{1, {MAX_FRACTION_DIGITS}}}))")
    return ebnf


def compact_json_tag(tag: dict) -> dict:
    """A structural tag with each `json_schema` content made a compact-JSON `grammar` content
    (xgrammar's own JSON in a structural tag allows any whitespace)."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if (node.get("type") == "json_schema" and node.get("style", "json") == "json"
                    and set(node) <= {"type", "json_schema", "style"}):
                return {"type": "grammar", "grammar": _reparsable(str(json_schema_grammar(node["json_schema"])))}
            if node.get("type") == "json_schema":  # another style (qwen_xml): its grammar, repaired as well
                return {"type": "grammar", "grammar": _style_grammar(node)}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(tag)


def _style_grammar(node: dict) -> str:
    """A structural tag's `json_schema` content of another style (qwen_xml, glm_xml, minimax_xml) as
    the EBNF xgrammar writes for it, from the schema as xgrammar must read it (`_opened`), with
    `_repaired`'s repairs: those styles write a parameter's object or array, a format's date or
    time and a number as xgrammar's JSON does (control characters in a bounded string, which the
    parsers' json.loads refuses, "8E367", "20:40:60Z")."""
    tag = {"type": "structural_tag", "format": {**node, "json_schema": _opened(node["json_schema"])}}
    try:
        ebnf = str(_xgrammar().Grammar.from_structural_tag(json.dumps(tag)))
    except (TypeError, ValueError, RuntimeError) as exc:  # not JSON data; xgrammar's C++ errors
        raise GrammarError(f"the structural tag's {node.get('style')} JSON schema cannot be compiled: "
                           f"{_message(exc)}; fix the schema") from None
    return _reparsable(_repaired(ebnf))
