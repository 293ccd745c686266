"""Grammar-constrained decoding: JSON schemas, regexes, grammars and tool calls as token masks.

    submit    SamplingParams(json_schema= | regex= | grammar=) -> Grammars.matcher: compiled once
              per grammar (cached), a Matcher per request; a bad one is a GrammarError for that call
    schedule  drafts are cut at the first token the request's matcher rejects (`Matcher.valid_prefix`)
    step N    forward N enqueued -> step N-1's tokens read back, each kept token advances its
              matcher -> `Grammars.masks`: one mask per constrained row of N (and per verified
              position of a draft) filled on the host, copied to the device -> the sampler adds
              -inf where a mask forbids -> `Matcher.done` ends the request
    (the masks are computed while the device runs the forward: no synchronisation is added)

A matcher allows the request's stop tokens (end of sequence, end of turn, the caller's) only where
its grammar is complete, so a constrained output ends complete unless max_tokens cuts it. A stop
token is never taken as text but where the grammar names it by a `token` format (harmony's
<|call|> is the text that ends its message, and the stop): "a" for regex "xa" would end the output
at "x"; where the grammar needs such a token, the request fails with a GrammarError. The tokenizer's
control tokens (its special tokens) are never allowed inside a grammar, except where a structural
tag names one by a `token` format (by id or by its text: harmony's markup, `hibana_plugins.harmony`):
then there, and nowhere else that text goes, since no text can spell it (`UNSPELLABLE`); the tag's
own token-level wildcards (`any_tokens`) take it too, as they take any token but the other control
tokens. JSON is compact, spaced as `json.dumps` writes it (", ", ": "): small models do not wander
into whitespace.

Where the grammar forces a string (a key, the JSON around values, a tool's name once chosen), the
mask allows only the first token of the tokenizer's own spelling of it: the model then reads the
tokens it was trained on, not a spelling of its choosing ('h' 'an' 'd' 'o' 'ff' for "handoff"),
which throws a small model off. The last token of a forced string stays free among the grammar's
(it may merge with what follows, as `{"` does).

Why xgrammar (and not llguidance). Both are maintained, both roll back (speculation) and both
take JSON schemas, regexes and grammars. Measured on this machine's CPU (2 cores,
`python -m hibana_bench.grammar_libs`, bench/RESULTS.md), mask time per token, mean:

    tokenizer             grammar         xgrammar   llguidance
    demo (4,096)          JSON schema       2.7 us      16.9 us
    demo (4,096)          tool calls        2.0 us      16.2 us
    qwen3-size (151,669)  JSON schema      67.5 us      33.7 us
    qwen3-size (151,669)  tool calls       63.6 us      36.9 us
    batch 32, one step:   demo 40-50 us against 500-750 us; 151k 1.7-2.8 ms against 1.4-1.9 ms

llguidance is ~2x faster per token on a Qwen3-size vocabulary and compiles nothing up front
(xgrammar: 28 ms for the schema, 120 ms for a four-tool grammar, once per distinct grammar, cached
and off the step loop: the compile drops the GIL); xgrammar is 6-8x faster on the demo workload,
where the CPU target (< 10% overhead) is tight. Fit decided it: xgrammar's structural tags say
"free text, and a tool call once `<tool_call>` appears" (or "calls only, from the first token";
at least one; stop after the first) in one declarative value that a tool-call parser plugin can
supply as it is; it has the completeness state (`is_completed`), the forced strings
(`find_jump_forward_string`) and the batched, multi-threaded mask filling the engine uses, and it
is what vLLM and SGLang use by default. On the GPU the per-token time hides under the forward
either way (measured there with `hibana bench grammar --model qwen3-8b`).

The masks are applied by the sampler (`Sampler.apply_masks`): each byte of a row's bitmask indexes
a table of eight 0 / -inf biases, one gather for the whole batch on CPU or GPU (up to 5x faster on the
CPU than xgrammar's own kernel, and no per-call host synchronisation).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import fractions
import functools
import json
import math
import os
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from hibana_core.config import SamplingParams, is_kind
from hibana_core.errors import GrammarError
from hibana_core.kv.transfers import device_tensor
from hibana_core.sampler import TokenMasks

if TYPE_CHECKING:
    from hibana_core.scheduler import SchedulerOutput

CACHE_SIZE = 256
"""Compiled grammars kept per engine (least recently used dropped)."""
CACHE_BYTES = 1 << 30
"""And their bytes at most (xgrammar's `memory_size_bytes`): a grammar's token masks grow with the
vocabulary and the schema, so 256 large schemas over a 151k vocabulary could hold gigabytes of host
memory; the one just compiled is kept whatever its size."""
BATCH_FILL_ROWS = 8
"""From this many rows without drafts, masks are filled by xgrammar's thread pool in one call."""
MAX_FILL_THREADS = 8
"""Threads of xgrammar's pool that fills a batch's masks: 32 rows of a 151k vocabulary under a JSON
schema took 5.9 ms serially on the H200 machine's host, 3.3 ms with 2 threads, 2.1 with 4, 2.0 with
8 and 2.3 with 16 (`python -m hibana_bench.grammar_libs --walks 32`)."""


def fill_threads() -> int:
    """Half the cores this process may run on (the engine's own threads and the callers' need
    the rest), at most MAX_FILL_THREADS. xgrammar's own "auto" takes half of the machine's hardware
    threads, which in a container limited to a few cores of a large host oversubscribes them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, min(MAX_FILL_THREADS, cores // 2))


STAGING_BUFFERS = 2
"""Pinned host bitmasks a CUDA engine fills in turn (one step's copy may still be queued while
the next is filled: never, as steps run, but two cost nothing)."""
SPELLINGS_CACHED = 4096
"""Forced strings whose tokens are kept (the table is emptied when full)."""
SPELLED_CHARS = 128
"""How much of a forced string is spelled to find its first token (`Matcher.spell_forced`): a
grammar may force a long text (a const of 200k characters), whose whole spelling each step
cost that row's step 100 ms, and every other agent's with it."""
FORCED_MAX_WORDS = 64
"""Where a row's mask allows tokens in more words of 32 than this, nothing is looked up as
forced (`Matcher.spell_forced`): a forced string fixes the next bytes, and the tokens that spell
its start are few (a 151k byte-level BPE's: under 20), while free text allows thousands. The rows
are counted at once and a spelled row rewritten through numpy: with torch's per-row calls the H200
host's batch-32 fill took 4.4 ms a step against 2.3 (qwen3-8b's 151k vocabulary, 2026-12-04)."""
VERIFY_MAX = 16
"""Allowed tokens of a row that are not whole UTF-8, each checked against its matcher, at most
(see `Matcher.drop_refused`): more are where text is free (a string's content: 551 of a 151k
byte-level BPE, 51 of the demo model's 4096), where they are right; where the mask was wrong
(an integer's start) there was one. Each check costs 2-12 us."""
UNSPELLABLE = b"\xff"
"""What a control token that a grammar names is spelled with, before its text, in the vocabulary
xgrammar reads: no UTF-8 text holds the byte 0xFF, so no text rule (JSON, a regex, free text) can
produce the token, and only the grammar's `token` format reaches it (by id)."""

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
_EXPONENT = "basic_number_4 basic_number_digits{1, -1}"
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _message(exc: BaseException) -> str:
    """xgrammar's error, without its time stamp and C++ source location."""
    return _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # a core dependency; a broken install says how to mend it
        raise GrammarError(f"constrained decoding needs xgrammar ({exc}); pip install 'xgrammar>=0.2.9'") from exc
    return xgrammar


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
    # strings with min/maxLength: no control characters
    bounded = _real_dates(_bound_numbers(ebnf.replace(_LOOSE_CHARACTER, _JSON_CHARACTER)
                                         .replace(_ANY_ESCAPE, _CHARACTER_ESCAPE)))
    return grammar if bounded == ebnf else xgr.Grammar.from_ebnf(_reparsable(bounded))


_BYTE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def _reparsable(ebnf: str) -> str:
    """xgrammar's printed EBNF as its parser reads it back: it prints U+0080..U+00FF (and control
    characters) as \\xHH, and reads as many hex digits as follow a \\x, so "\\xe9a" ("éa") came back
    as U+0E9A; \\u00HH takes exactly its four."""
    return _BYTE_ESCAPE.sub(lambda m: f"{m[1]}\\u00{m[2]}", ebnf)


_JSON_TYPES = {bool: ("boolean",), int: ("integer", "number"), float: ("number",), str: ("string",),
               type(None): ("null",), list: ("array",), dict: ("object",)}


def _json_types(value: Any) -> tuple[str, ...]:
    kinds = _JSON_TYPES.get(type(value), ())
    return ("integer", "number") if isinstance(value, float) and value.is_integer() else kinds


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


def _bound_numbers(ebnf: str) -> str:
    """`ebnf` with every run of digits bounded (MAX_NUMBER_DIGITS, MAX_EXPONENT_DIGITS): the numbers
    it allows that JSON readers hold exactly stay, an output cannot be one endless number, and no
    number overflows a double."""
    ebnf = ebnf.replace(_EXPONENT, _EXPONENT.replace("{1, -1}", f"{{1, {MAX_EXPONENT_DIGITS}}}"))
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
            for day in days:
                ebnf = ebnf.replace(f'{year}{{4, 4}} "-" {month} "-" {day}', f'{_YEAR} "-" ({_MONTH_DAY})')
    for second, fraction in _SECONDS_AND_FRACTION.findall(ebnf):  # hh ":" mm ":" ss fraction
        if rules.get(second) == _SECOND:
            ebnf = ebnf.replace(f"{second} ::= {_SECOND}", f"{second} ::= (([0-5] [0-9]))")
        digits = re.fullmatch(r'\(\"\" \| \("\." (\w+)\)\)', rules.get(fraction, ""))
        if digits and rules.get(digits[1]) == f"(([0-9] {digits[1]}) | ([0-9]))":
            ebnf = ebnf.replace(f"{digits[1]} ::= {rules[digits[1]]}",
                                f"{digits[1]} ::= (([0-9]{{1, {MAX_FRACTION_DIGITS}}}))")
    return ebnf


UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                       "dependencies", "if", "then", "else", "not", "$dynamicRef", "$recursiveRef")
"""JSON-schema keywords xgrammar 0.2.9 compiles but does not hold the output to (as allOf with
more than one subschema): an output "valid by construction" could break them, so they are refused.
(oneOf is held as anyOf: refused where that is looser, `_held_loosely`. uniqueItems is held to
nothing, and taken: pydantic writes it for set fields, whose parsing drops repeated items.)"""
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMAS = ("additionalProperties", "items", "not", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "contains", "if", "then", "else", "additionalItems")


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


_RAW_TODO = ("xgrammar writes its '\"', '\\' or control characters into the JSON string unescaped (the output "
             "would be no JSON): leave them out of the pattern, or check it in your code")
_JSON_SPECIALS = tuple(chr(c) for c in range(0x20)) + ('"', "\\")
_EBNF_PIECE = re.compile(r'"((?:[^"\\]|\\.)*)"|(\[\^?(?:[^\]\\]|\\.)*\])')


@functools.lru_cache(maxsize=1024)
def raw_in_json_string(pattern: str) -> bool:
    """Whether xgrammar 0.2.9 writes a schema's string `pattern` (as `held_regex` hands it over)
    into a JSON string unescaped where it could put '"', '\\' or a control character there: it keeps
    most patterns as a regex it escapes (`Regex(..., json_string=true)`), but spells some out as
    grammar rules without escaping them (`^a"b$` came out as "a"b", no JSON)."""
    held = held_regex(pattern, json_pattern=True)
    try:
        ebnf = str(_xgrammar().Grammar.from_json_schema(json.dumps({"type": "string", "pattern": held})))
    except Exception:  # noqa: BLE001 - the schema's own compile says what is wrong with it
        return False
    for line in ebnf.splitlines():
        name, _, body = line.partition(" ::= ")
        if not name.startswith("root_") or body.lstrip("(").startswith("Regex("):
            continue
        for literal, char_class in _EBNF_PIECE.findall(body):
            if literal and any(c in _JSON_SPECIALS for c in _ebnf_text(literal)):
                return True
            if char_class and any(_class_takes(char_class, c) for c in _JSON_SPECIALS):
                return True
    return False


def _ebnf_text(literal: str) -> str:
    """The characters an EBNF string literal's body spells (its escapes read as JSON's and Python's)."""
    try:
        return literal.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return literal


def _class_takes(char_class: str, char: str) -> bool:
    try:
        return re.fullmatch(char_class, char) is not None
    except re.error:
        return True  # a class Python cannot read: assume the worst


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


_REGEX_ESCAPES = frozenset("dDwWsSntrfvxuca")
"""Letters after a backslash that xgrammar 0.2.9's regex reader reads as Python's `re` does
(control characters, \\x.. and \\u....; the classes \\w \\d \\s and their negations as `held_regex`
writes them out); others it reads as the letter itself (\\A, \\q),
as nothing (\\0), or refuses (\\b, \\1, \\p{..}: a GrammarError from the compiler anyway)."""


def unenforced_regex(pattern: str, what: str = "regex") -> list[tuple[str, str]]:
    """(part, what to do) for each part of `pattern` xgrammar 0.2.9's regex reader skips with a
    warning or reads otherwise than Python's `re`, so that an output could break it: lookaheads,
    anchors but at its two ends, and escapes it reads as their letter (\\A, \\Z, \\z: anchors)
    or as nothing (\\0)."""
    found: dict[str, str] = {}
    i, in_class = 0, False
    flags = re.match(r"\(\?[aiLmsux]+\)", pattern)  # inline flags lead the pattern: a ^ after them starts it
    start = flags.end() if flags else 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1  # the escaped character is a literal, or a class or character it names
            escaped = pattern[i:i + 1]
            if escaped in ("A", "Z", "z"):
                found[f"an anchor \\{escaped} in {what}"] = "leave it out: the whole output matches the pattern"
            elif escaped.isascii() and escaped.isalnum() and escaped not in _REGEX_ESCAPES:
                found[f"an escape \\{escaped} in {what}"] = "xgrammar reads it otherwise than Python's re"
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += pattern.startswith("^", i + 1)  # a negation, and then a leading "]", end no class
            i += pattern.startswith("]", i + 1)
        elif pattern.startswith(("(?=", "(?!"), i):
            found[f"a lookahead {pattern[i:i + 3]} in {what}"] = "write it without lookaheads"
        elif (c == "^" and i > start) or (c == "$" and i < len(pattern) - 1):
            found[f"an anchor {c} inside {what}"] = "anchor it at its two ends alone: ^(a|b)$, not ^a$|^b$"
        i += 1
    return list(found.items())


def _code_point_runs(takes: Callable[[str], bool]) -> tuple[tuple[int, int], ...]:
    """The runs of code points for which `takes` holds, as (first, last) pairs."""
    runs, start = [], None
    for cp in range(0x110000):
        if takes(chr(cp)):
            start = cp if start is None else start
        elif start is not None:
            runs.append((start, cp - 1))
            start = None
    return tuple(runs + ([(start, 0x10FFFF)] if start is not None else []))


def _complement(runs: Sequence[tuple[int, int]], last: int) -> list[tuple[int, int]]:
    """The code points up to `last` that `runs` (sorted) leave out. Surrogates stay in: no UTF-8
    text holds them (the masks refuse their bytes), and a negated class must name them too to
    exclude everything ([^\\s\\S])."""
    out, at = [], 0
    for first, end in runs:
        if first > last:
            break
        if first > at:
            out.append((at, first - 1))
        at = end + 1
    if at <= last:
        out.append((at, last))
    return out


def _class_body(runs: Iterable[tuple[int, int]]) -> str:
    """Character-class text for code point runs (\\u escapes in the BMP, the characters beyond)."""
    def one(cp: int) -> str:
        return f"\\u{cp:04x}" if cp <= 0xFFFF else chr(cp)
    return "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in runs)


_SPACES_BOTH = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))
"""Whitespace to Python's `re` (str.isspace) and to ECMA-262 (JSON Schema's patterns) alike."""
_SPACES_EITHER = tuple(sorted(_SPACES_BOTH + ((0x1C, 0x1F), (0x85, 0x85), (0xFEFF, 0xFEFF))))
"""Whitespace to either."""


_SHORTHAND_BOTH = {"w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)), "d": ((0x30, 0x39),),
                   "s": _SPACES_BOTH}
"""Shorthand letter -> the code points both Python's `re` and ECMA-262 take it to match (words and
digits are ASCII to ECMA, Unicode to Python)."""


@functools.cache
def _shorthand_either(letter: str) -> tuple[tuple[int, int], ...]:
    """The code points either reading takes the shorthand to match (a scan of every code point
    for \\w and \\d, once)."""
    if letter == "s":
        return _SPACES_EITHER
    return _code_point_runs((lambda c: c.isalnum() or c == "_") if letter == "w" else str.isdecimal)


@functools.cache
def _shorthand(letter: str, negated_class: bool, pattern: bool) -> str:
    """Class text for a shorthand (`held_regex`): \\w \\d \\s the characters both readings take
    (either, inside a negated class: it excludes them), \\W \\S \\D those neither takes. In a
    schema's pattern, characters past the BMP are left out (xgrammar's JSON strings break on them)."""
    if letter.islower():
        return _class_body(_shorthand_either(letter) if negated_class else _SHORTHAND_BOTH[letter])
    return _class_body(_complement(_shorthand_either(letter.lower()), 0xFFFF if pattern else 0x10FFFF))


_ANY_BUT_BREAKS = "\\n\\r\\u2028\\u2029"
"""Line breaks to ECMA-262's `.`, which Python's leaves out too (it takes all but \\n)."""


def held_regex(pattern: str, *, json_pattern: bool = False) -> str:
    """`pattern` as xgrammar 0.2.9 must read it for every output to match it under Python's `re`
    (`regex=`) and under ECMA-262 (a JSON schema's `pattern`, `json_pattern`) alike. xgrammar's `.`
    takes any character (a line break too), its \\W \\S \\D any that is not an ASCII word
    character, digit or one of its few spaces: Python's \\W refuses a CJK ideograph, its \\S the
    control character \\x1f. So `.` is any character but line breaks, \\W \\S \\D the characters
    no reading takes as word, space or digit, and \\w \\d \\s those both readings take (those
    either takes, in a negated class). In a schema's pattern a negated class keeps xgrammar's
    (ECMA's) reading: it cannot name the characters past the BMP it would exclude."""
    out, i, in_class, negated = [], 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped in "wdsWDS" and not (json_pattern and in_class and negated):
                text = _shorthand(escaped, in_class and negated, json_pattern)
                out.append(text if in_class else f"[{text}]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, negated = True, pattern.startswith("^", i + 1)
            skip = 1 + negated + pattern.startswith("]", i + 1 + negated)  # a leading "]" is a literal
            out.append(pattern[i:i + skip])
            i += skip
            continue
        elif c == ".":
            c = f"[^{_ANY_BUT_BREAKS}]"
        elif _NAMED_GROUP.match(pattern, i):  # a group's name matches nothing: xgrammar refused it
            i = _NAMED_GROUP.match(pattern, i).end()
            out.append("(")
            continue
        out.append(c)
        i += 1
    return "".join(out)


_NAMED_GROUP = re.compile(r"\(\?P?<(?![=!])\w+>")
"""A named group's opening, Python's `(?P<name>` or ECMA's `(?<name>` (not a lookbehind)."""


def compact_json_tag(tag: dict) -> dict:
    """A structural tag with each `json_schema` content made a compact-JSON `grammar` content
    (xgrammar's own JSON in a structural tag allows any whitespace)."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if (node.get("type") == "json_schema" and node.get("style", "json") == "json"
                    and set(node) <= {"type", "json_schema", "style"}):
                return {"type": "grammar", "grammar": _reparsable(str(json_schema_grammar(node["json_schema"])))}
            if node.get("type") == "json_schema":  # another style (qwen_xml): the schema as xgrammar reads it too
                return {**node, "json_schema": _opened(node["json_schema"])}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node
    return walk(tag)


_POPCOUNT16 = np.array([bin(i).count("1") for i in range(1 << 16)], dtype=np.int32)
"""Bits set in each 16-bit value."""


def _whole_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_BAD_SECOND = {0xE0: (0x80, 0x9F), 0xED: (0xA0, 0xBF), 0xF0: (0x80, 0x8F), 0xF4: (0x90, 0xBF)}
"""Lead bytes after which a continuation byte in this range spells no character: an overlong
three- or four-byte form (E0, F0), a UTF-16 surrogate (ED), past U+10FFFF (F4). xgrammar 0.2.9
takes each as a character, and the text decodes them as U+FFFD (past a maxLength, outside a
pattern)."""


def _no_character_after(lead: int, piece: bytes) -> bool:
    """Whether a token's bytes start with a byte that spells no character after `lead`."""
    low, high = _BAD_SECOND[lead]
    return bool(piece) and low <= piece[0] <= high


def _never_utf8(piece: bytes) -> bool:
    """Whether `piece` can be part of no UTF-8 text, whatever comes before or after it: a byte no
    UTF-8 holds (C0, C1, F5-FF), a lead byte followed within it by a byte that does not continue
    it, or a continuation byte past the piece's start that no lead byte before it expects."""
    expected = None  # continuation bytes the current character still needs (None: not known yet)
    bad = None  # the range the next byte may not take (right after a lead byte of _BAD_SECOND)
    for byte in piece:
        if 0x80 <= byte <= 0xBF:
            if expected == 0 or (bad is not None and bad[0] <= byte <= bad[1]):
                return True  # a continuation byte no lead asked for, or one that spells no character
            bad = None
            if expected is not None:  # else at the start: a character begun before the piece
                expected -= 1
            continue
        if expected:
            return True  # a character cut short inside the piece
        if byte < 0x80:
            expected = 0
        elif 0xC2 <= byte <= 0xF4:
            expected, bad = _needs(byte), _BAD_SECOND.get(byte)
        else:
            return True  # C0, C1, F5-FF
    return False


def _needs(lead: int) -> int:
    """How many continuation bytes follow a lead byte."""
    return 1 if lead < 0xE0 else 2 if lead < 0xF0 else 3


def _bit(bit: int) -> int:
    """1 << bit as the value of a signed 32-bit word (a bitmask's int32 elements)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def _clear_unless_alone(bitmask: torch.Tensor, row: int, tokens: Iterable[int]) -> None:
    """Clear `tokens`' bits in a bitmask row, unless nothing else is allowed there (the row is then
    left as it was)."""
    held = bitmask[row].clone()
    for token in tokens:
        word, bit = divmod(token, 32)
        held[word] &= ~_bit(bit)
    if held.any():
        bitmask[row] = held


def allowed_tokens(words: torch.Tensor, most: int) -> list[int]:
    """The token ids whose bits are set in a bitmask row (int32 words), or any `most` + 1 of
    them where there are more."""
    found: list[int] = []
    for word in words.nonzero().flatten().tolist():
        value = int(words[word]) & 0xFFFFFFFF
        while value:
            low = value & -value
            found.append(32 * word + low.bit_length() - 1)
            if len(found) > most:
                return found
            value ^= low
    return found


class Utf8Rows(NamedTuple):
    """The tokens a grammar's output may not take for its text to stay UTF-8 (`Grammars.utf8_rows`)."""

    keep: torch.Tensor              # a bitmask row: every token but those in no UTF-8 text
    keep_after: dict[int, torch.Tensor]  # lead byte of _BAD_SECOND -> every token but those that
    # spell no character after it
    never_ids: frozenset[int]       # the tokens in no UTF-8 text


class Matcher:
    """One request's place in its grammar. Advanced by the tokens the request keeps; masks for
    drafts are filled by accepting the drafts and rolling them back."""

    __slots__ = ("_matcher", "_spell", "_refused", "_token_bytes", "_forced", "_last_resort", "_ends", "_utf8",
                 "_lead")

    def __init__(self, compiled: Any, stop_token_ids: Iterable[int],
                 spell: Callable[[str], Sequence[int]] = lambda text: (),
                 control_token_ids: frozenset[int] = frozenset(), token_bytes: Sequence[bytes] = (),
                 last_resort: Iterable[int] = (), utf8: "Utf8Rows | None" = None,
                 own: frozenset[int] = frozenset()) -> None:
        xgr = _xgrammar()
        # `last_resort` (the end-of-sequence tokens of an ignore_eos request): stop tokens allowed
        # only where the grammar allows nothing else, so that the output runs on while it can
        self._last_resort = sorted(set(last_resort) - set(stop_token_ids))
        stops = sorted(set(stop_token_ids) | set(self._last_resort))
        # the stop tokens that xgrammar would also take as text, the grammar's own end tokens aside
        # (`own`: harmony's <|call|>, its text's end): ends only, allowed where the grammar is
        # complete (see `hold_stops`); as text, one would end the output short of a whole match
        self._ends = frozenset(stops) - frozenset(own) - control_token_ids
        self._spell = spell  # the tokenizer's tokens of a forced string
        self._token_bytes = token_bytes  # each token's bytes (xgrammar's reading): what it takes of a forced string
        self._forced: bytes | None = None  # the string forced from here, where known (`spell_forced`)
        self._utf8 = utf8  # see `hold_utf8`
        self._lead: int | None = None  # the kept bytes end with this lead byte of _BAD_SECOND
        # control tokens this grammar does not name, refused here (xgrammar would log a warning for each)
        self._refused = control_token_ids - set(stops)
        # without stop tokens the matcher ends as soon as its grammar is complete
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)

    def accept(self, token: int) -> bool:
        """Advance by one kept token; False if the grammar forbids it (the matcher is unchanged)."""
        piece = self._token_bytes[token] if token < len(self._token_bytes) else b""
        if self._lead is not None and _no_character_after(self._lead, piece):
            return False  # no character (`hold_utf8`)
        if self._utf8 is not None and token in self._utf8.never_ids:
            return False
        if token in self._ends and not self._matcher.is_completed():
            return False  # (xgrammar 0.2.9 took "a" as the text ending regex "xa", then as the stop)
        if token in self._refused or not self._matcher.accept_token(token):
            return False
        self._lead = piece[-1] if piece and piece[-1] in _BAD_SECOND else None
        forced = self._forced
        if forced is not None:  # what the grammar forced here, less what the token took of it, is
            # forced next; where nothing was forced (b""), nothing is known of the next state
            self._forced = forced[len(piece):] if piece and len(piece) < len(forced) and forced.startswith(piece) \
                else None
        return True

    def last_resort(self, token: int) -> bool:
        """Whether `token` is one of the stop tokens allowed only where nothing else is (it then
        ends the output as a stop token does: not part of its text)."""
        return token in self._last_resort

    @property
    def done(self) -> bool:
        """The grammar ended: a stop token was accepted, or (without stop tokens) it is complete."""
        return self._matcher.is_terminated()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the grammar allows in a row; the matcher is unchanged."""
        n, forced, lead = 0, self._forced, self._lead
        for token in tokens:
            if self._matcher.is_terminated() or not self.accept(token):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
            self._forced, self._lead = forced, lead
        return n

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = (),
             suspects: torch.Tensor | None = None) -> None:
        """Masks at `row` (the next token) and, for a verify step, at row + i + 1 after the first
        i + 1 drafts (all allowed: `valid_prefix` cut them); the matcher ends where it began.
        `suspects`: see `drop_refused`."""
        matcher = self._matcher
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
            self.hold_stops(bitmask, row)
            self.spell_forced(bitmask, row)
            self.drop_refused(bitmask, row, suspects)
            self.hold_back(bitmask, row)
            self.hold_utf8(bitmask, row)
        accepted, forced, lead = 0, self._forced, self._lead
        for i, token in enumerate(drafts):
            if matcher.is_terminated() or not self.accept(token):
                break  # rows after a stop or a rejected draft stay all-allowed: they are dropped
            accepted += 1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row + i + 1)
                self.hold_stops(bitmask, row + i + 1)
                self.spell_forced(bitmask, row + i + 1)
                self.drop_refused(bitmask, row + i + 1, suspects)
                self.hold_back(bitmask, row + i + 1)
                self.hold_utf8(bitmask, row + i + 1)
        if accepted:
            matcher.rollback(accepted)
            self._forced, self._lead = forced, lead

    def hold_utf8(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the tokens that would make the text other than UTF-8, which xgrammar 0.2.9 allows:
        those that can be in no UTF-8 text, and after a lead byte of _BAD_SECOND those that start
        with a byte that spells no character there. The text would decode them as U+FFFD (past a
        maxLength, outside a pattern)."""
        if self._utf8 is None:
            return
        bitmask[row] &= self._utf8.keep
        self.hold_after_lead(bitmask, row)

    def hold_after_lead(self, bitmask: torch.Tensor, row: int) -> None:
        """`hold_utf8`'s part that depends on the kept bytes: after a lead byte of _BAD_SECOND."""
        if self._lead is not None and self._utf8 is not None:
            bitmask[row] &= self._utf8.keep_after[self._lead]

    def hold_stops(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the stop tokens that are ends only (`_ends`) where the grammar is not complete:
        xgrammar 0.2.9 allows a stop token whose text continues the grammar. Where nothing else
        is left the row stays as it was: the grammar needs the stop token as text, and the request
        fails on it with a GrammarError that says to take it out of stop_token_ids."""
        if self._ends and not self._matcher.is_completed():
            _clear_unless_alone(bitmask, row, self._ends)

    def hold_back(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the last-resort stop tokens' bits where the row allows any other token."""
        if self._last_resort and self._matcher.is_completed():  # (stops are allowed only there)
            _clear_unless_alone(bitmask, row, self._last_resort)

    def drop_refused(self, bitmask: torch.Tensor, row: int, suspects: torch.Tensor | None) -> None:
        """Clear the bits of allowed tokens the matcher would refuse, among those that are not whole
        UTF-8 (`suspects`, a bitmask row): xgrammar's mask can allow a token that its accept_token
        then refuses (0.2.9: after '-' where an integer starts, the token '-' + the first byte of a
        two-byte character), and a sampled token the grammar refuses fails its request. Each such
        token is accepted and rolled back; a row with more than VERIFY_MAX of them is left as it
        is (free text: a string's content, where they are right)."""
        if suspects is None:
            return
        tokens = allowed_tokens(bitmask[row] & suspects, VERIFY_MAX)
        if not tokens or len(tokens) > VERIFY_MAX:
            return
        matcher = self._matcher
        refused = []
        for token in tokens:
            if matcher.accept_token(token):
                matcher.rollback(1)
            else:
                refused.append(token)
        if not refused:
            return
        before = bitmask[row].clone()
        for token in refused:
            word, bit = divmod(token, 32)
            bitmask[row, word] &= ~_bit(bit)
        if not bitmask[row].any():  # nothing left: the row as it was (the request fails on its
            bitmask[row] = before   # token with a GrammarError rather than sampling from nothing)

    def spell_forced(self, bitmask: torch.Tensor, row: int, free: bool | None = None) -> None:
        """Where the grammar forces a string of two tokens or more, allow only its first (the
        first of its first SPELLED_CHARS characters' spelling). The forced string is found once
        and then followed token by token (`accept`): xgrammar's search for it reads all of it,
        each time (a const of 1M characters cost every step 58 ms, a 10k-value enum 1.7 ms).
        Only looked for where the mask allows few tokens (FORCED_MAX_WORDS): what is allowed
        there depends on the state alone, as speculation's verify rows need. `free`: whether the
        row allows tokens in more words than that, where the caller counted them (`Grammars._fill`,
        for all its rows at once)."""
        if self._matcher.is_completed():  # where the output may also end, nothing is forced
            return
        words = bitmask.numpy()  # (rows through numpy: torch's indexing costs ~10 us a call)
        if free if free is not None else np.count_nonzero(words[row]) > FORCED_MAX_WORDS:
            return  # free text here (a function of the mask, so of the state, whatever is cached)
        forced = self._forced
        if forced is None or (forced and 0x80 <= forced[0] < 0xC0):  # (a token ended inside a character)
            forced = self._forced = self._matcher.find_jump_forward_string().encode()
        if not forced:
            return
        tokens = self._spell(forced[:4 * SPELLED_CHARS].decode("utf-8", errors="ignore")[:SPELLED_CHARS])
        if len(tokens) < 2:
            return
        first = tokens[0]
        word, bit = divmod(first, 32)
        if not (int(words[row, word]) >> bit) & 1:  # the grammar forbids it (a control token)
            return
        words[row] = 0
        words[row, word] = _bit(bit)


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    """A grammar compiler over the vocabulary as one set of grammars sees it: the control tokens
    they name (`Grammars.compile`) spelled for `token` formats alone, every other one blanked
    (`refused`: xgrammar then never allows it, stop tokens aside)."""

    compiler: Any
    refused: frozenset[int]


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A compiled grammar, the control tokens its matchers refuse (`_Vocabulary.refused`), and the
    tokens it names by `token` formats (`own`: a stop token among them is text that ends it)."""

    grammar: Any
    refused: frozenset[int]
    own: frozenset[int] = frozenset()


def _size(compiled: _Compiled) -> int:
    """A cached grammar's host bytes, as xgrammar counts them."""
    return int(getattr(compiled.grammar, "memory_size_bytes", 0) or 0)


class Grammars:
    """The engine's grammar side: one tokenizer description, a cache of compiled grammars, and
    the masks of each step. The tokenizer is described on first use (0.6 s for a 151k
    vocabulary), so engines that never constrain pay nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self.eos_token_ids = sorted(eos_token_ids)
        self.width = -(-vocab_size // 32)
        self._detected: Any = None  # xgrammar's reading of the tokenizer
        self._bytes: list[bytes] = []  # each token's bytes in that reading (its decoded_vocab, read once)
        self._control: dict[int, str] = {}  # id -> text of the tokenizer's control tokens
        self._vocabularies: dict[frozenset[int], _Vocabulary] = {}  # by the control tokens named
        self._batch: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, _Compiled] = collections.OrderedDict()
        self._cache_bytes = 0  # of the grammars in it (`CACHE_BYTES`)
        self._compiling: dict[tuple, concurrent.futures.Future] = {}  # compiles under way: one per grammar
        self._spellings: dict[str, tuple[int, ...]] = {}
        self._suspects: torch.Tensor | None = None  # see `suspects`
        self._utf8: Utf8Rows | None = None  # see `utf8_rows`
        self._suspect_words: tuple[np.ndarray, np.ndarray] | None = None  # see `_suspects_allowed`
        self._staging: list[tuple[torch.Tensor, Any]] = []  # pinned host bitmasks and their copies' events
        self._next_staging = 0
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # fills masks beside the step loop
        self._filling: concurrent.futures.Future | None = None

    def spell(self, text: str) -> tuple[int, ...]:
        """The tokenizer's tokens of a forced string (cached: grammars force the same keys and
        names again and again)."""
        tokens = self._spellings.get(text)
        if tokens is None:
            if len(self._spellings) >= SPELLINGS_CACHED:
                self._spellings.clear()
            tokens = self._spellings[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return tokens

    # --- compiling ----------------------------------------------------------------------------

    def _vocabulary(self, named: frozenset[int] = frozenset()) -> _Vocabulary:
        """The compiler of grammars that name the control tokens `named` (most name none)."""
        detected = self._describe()
        with self._lock:
            vocabulary = self._vocabularies.get(named)
            if vocabulary is None:
                xgr = _xgrammar()
                info = self._tokenizer_info(xgr, detected, named)
                vocabulary = self._vocabularies[named] = _Vocabulary(
                    xgr.GrammarCompiler(info, cache_enabled=False), frozenset(info.special_token_ids))
                self._batch = self._batch or xgr.BatchGrammarMatcher(max_threads=fill_threads())
            return vocabulary

    def _describe(self) -> Any:
        """xgrammar's reading of the tokenizer (each token's bytes), and its control tokens
        (`_control`); made once."""
        with self._lock:
            if self._detected is None:
                if self.tokenizer is None:
                    raise GrammarError("constrained decoding needs the model's tokenizer, and this checkpoint has "
                                       "none; load a checkpoint with tokenizer files")
                from hibana_core.prompt import control_strings

                vocab = self.tokenizer.get_vocab()
                self._control = {vocab[text]: text for text in control_strings(self.tokenizer)
                                 if vocab.get(text, self.vocab_size) < self.vocab_size}
                detected = _xgrammar().TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
                self._bytes = list(detected.decoded_vocab)  # (the property builds a new list each read)
                self._detected = detected
            return self._detected

    def _tokenizer_info(self, xgr, detected: Any, named: frozenset[int]) -> Any:
        """The vocabulary as xgrammar reads it, with the control tokens blanked (xgrammar then
        treats them as special and allows them nowhere but as a matcher's stop tokens) but those in `named`,
        spelled `UNSPELLABLE` + their text: reached by a `token` format only."""
        vocab = list(self._bytes)
        for index, text in self._control.items():
            vocab[index] = UNSPELLABLE + text.encode() if index in named else b""
        metadata = json.loads(detected.dump_metadata())
        metadata["vocab_type"] = xgr.VocabType.RAW.value  # the bytes above, taken as they are
        # no stop tokens of its own: each matcher names its request's; a blank stop token here would
        # not be special, and a blank token that is not special is allowed anywhere, as nothing
        metadata["stop_token_ids"] = []
        return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, json.dumps(metadata))

    @staticmethod
    def _key(params: SamplingParams) -> tuple[str, str]:
        """A request's constraint as the cache knows it: its kind and its text."""
        if params.json_schema is not None:
            try:  # a loose schema compiles what a strict one refuses: apart in the cache
                return ("json_schema" if params.strict_schema else "json_schema_loose",
                        json.dumps(params.json_schema, sort_keys=False))
            except (TypeError, ValueError) as exc:
                raise GrammarError(f"the JSON schema is not plain JSON data ({exc})") from None
        if params.regex is not None:
            return "regex", params.regex
        if isinstance(params.grammar, str):
            return "ebnf", params.grammar
        return "structural_tag", json.dumps(params.grammar, sort_keys=False, default=str)

    def cached(self, params: SamplingParams) -> bool:
        """Whether `compile(params)` would return at once: the grammar is compiled already."""
        key = self._key(params)
        with self._lock:
            return key in self._cache

    def compile(self, params: SamplingParams) -> _Compiled:
        """The compiled grammar of a request's constraint (cached); GrammarError if it has none
        that compiles."""
        key = self._key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            running = self._compiling.get(key)
            if running is None:  # this call compiles; the same grammar asked meanwhile waits for it
                running = self._compiling[key] = concurrent.futures.Future()
                mine = True
            else:
                mine = False
        if not mine:
            return running.result()  # its GrammarError too
        try:
            compiled = self._compile(key[0], params)  # outside the lock: it may take seconds
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            running.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._cache[key] = compiled
            self._cache_bytes += _size(compiled)
            while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_BYTES):
                self._cache_bytes -= _size(self._cache.popitem(last=False)[1])
        running.set_result(compiled)
        return compiled

    def _compile(self, kind: str, params: SamplingParams) -> _Compiled:
        """A request's constraint compiled over the vocabulary its grammar sees: a structural
        tag's with the control tokens it names (`_named_tokens`), every other one's with none."""
        tag, named = None, frozenset()
        if kind == "structural_tag":
            tag, named = self._named_tokens(compact_json_tag(params.grammar))
        vocabulary = self._vocabulary(frozenset(t for t in named if t in self._control))
        compiled = self._compiled(vocabulary.compiler, kind, params, tag)
        if kind in ("regex", "ebnf"):
            self._check_startable(compiled, kind)
        return _Compiled(compiled, vocabulary.refused, named)

    def _check_startable(self, compiled: Any, kind: str) -> None:
        """A GrammarError where the grammar allows no first token and not the empty output (a
        regex of an empty class, `[^\\s\\S]`): the request would fail at its first step, after
        its prompt was computed, blaming the model's token."""
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not matcher.is_completed() and not bitmask.any():
            what = {"regex": "regex", "ebnf": "grammar"}[kind]
            raise GrammarError(f"the {what} matches no output: no character can start it (an empty character "
                               f"class such as [^\\s\\S]?); fix the {what}")

    @staticmethod
    def _compiled(compiler: Any, kind: str, params: SamplingParams, tag: dict | None) -> Any:
        xgr = _xgrammar()
        if kind == "json_schema":
            check_held(params.json_schema)
        if kind in ("json_schema", "json_schema_loose"):
            return compiler.compile_grammar(json_schema_grammar(params.json_schema))
        unheld = unenforced_regex(params.regex) if kind == "regex" else []
        if unheld:
            raise GrammarError(f"the regex has parts the grammar cannot hold the output to "
                               f"({'; '.join(f'{part}: {todo}' for part, todo in unheld)}): the output could "
                               "break them")
        what = {"regex": "regex", "ebnf": "grammar", "structural_tag": "structural tag"}[kind]
        try:
            if kind == "regex":
                compiled = compiler.compile_regex(held_regex(params.regex))
                try:  # the output is held as Python's re reads the regex: xgrammar took "[\d-z]", which re refuses
                    re.compile(params.regex)
                except re.error as exc:
                    raise GrammarError(f"the regex is no regex Python's re reads ({exc}); fix it") from None
                return compiled
            if kind == "ebnf":
                grammar = xgr.Grammar.from_ebnf(params.grammar)
                endless = rules_without_finite_string(str(grammar))
                if "root" in endless:
                    raise GrammarError(f"the grammar has no finite string: its rules {', '.join(endless)} never end "
                                       "(every alternative leads back to one of them); give each a way out")
                return compiler.compile_grammar(grammar)
            return compiler.compile_structural_tag(xgr.StructuralTag.from_json(json.dumps(tag)))
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - RuntimeError from C++, pydantic's ValidationError
            raise GrammarError(f"the {what} cannot be compiled: {_message(exc)}; fix it (xgrammar's "
                               "syntax) or drop the constraint") from None

    def _named_tokens(self, tag: Any) -> tuple[Any, frozenset[int]]:
        """`tag` with each `token` format's token as an id (a text is looked up in the
        tokenizer's vocabulary), and the ids of those tokens. JSON schemas are content,
        not formats: they are left as they are. A token format marked `"if_known": true` that
        names no token of the vocabulary is nothing (an empty string): a format's optional marker
        (Llama 3's <|python_tag|>) on a model without it."""
        self._describe()  # the control tokens
        vocab = self.tokenizer.get_vocab()
        named: set[int] = set()

        def walk(node: Any) -> Any:
            if isinstance(node, list):
                return [walk(v) for v in node]
            if not isinstance(node, dict):
                return node
            if node.get("type") != "token":
                return {k: v if k == "json_schema" else walk(v) for k, v in node.items()}
            token = node.get("token")
            if isinstance(token, str):
                token = vocab.get(token, token)
            if node.get("if_known") is True and (not isinstance(token, int) or not 0 <= token < self.vocab_size):
                return {"type": "const_string", "value": ""}  # a token the format names only where it exists
            node = {k: v for k, v in node.items() if k != "if_known"}
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise GrammarError(f"the structural tag names the token {node.get('token')!r:.80}, which is no "
                                   f"token of this model's vocabulary ({self.vocab_size} tokens); name a token "
                                   "by its id or by its text in the tokenizer")
            named.add(token)
            return {**node, "token": token}

        return walk(tag), frozenset(named)

    def matcher(self, params: SamplingParams, stop_token_ids: Iterable[int]) -> Matcher | None:
        """A matcher for one request (None when it is not constrained); its stop tokens are the
        request's, allowed only where the grammar is complete. With ignore_eos the end-of-sequence
        tokens stay the grammar's last resort: the output goes on past a complete grammar while it
        allows more (`[a-z]+` runs to max_tokens) and ends where it allows nothing else."""
        if not params.constrained:
            return None
        compiled = self.compile(params)
        self.suspects()  # made here, on the caller's thread, not in a step's fill
        last_resort = self.eos_token_ids if params.ignore_eos else ()
        return Matcher(compiled.grammar, stop_token_ids, self.spell, compiled.refused, self._bytes, last_resort,
                       self.utf8_rows(), compiled.own)

    # --- one step's masks ---------------------------------------------------------------------

    def masks(self, scheduled: "SchedulerOutput", total_rows: int) -> TokenMasks | None:
        """The masks of a step's constrained rows (None when none is): a row per sampling chunk,
        and one per draft it verifies. Rows of a request that finished meanwhile, or whose
        grammar ended, allow everything: their tokens are dropped."""
        return self.start_masks(scheduled, total_rows, background=False)()

    def start_masks(self, scheduled: "SchedulerOutput", total_rows: int,
                    background: bool = True) -> Callable[[], TokenMasks | None]:
        """`masks`, filled on the grammar's worker thread while the caller goes on (the engine
        processes the previous step's outputs meanwhile: xgrammar's fills release the GIL); the
        function returned waits for the fill and copies the masks to the device. Which rows are
        live is read now; until the function returns, only the fill touches the matchers."""
        constrained: list[tuple[Matcher | None, tuple[int, ...]]] = []
        rows: list[int] = []
        row = 0
        for chunk in scheduled.sampling:
            request, n = chunk.request, 1 + len(chunk.draft_token_ids)
            if request.grammar is not None:
                live = not request.finished and not request.grammar.done
                constrained.append((request.grammar if live else None, chunk.draft_token_ids))
                rows.extend(range(row, row + n))
            row += n
        if not constrained:
            return lambda: None
        self.wait_fill()  # a fill whose step failed meanwhile: never two on one buffer
        bitmask, copied = self._host_bitmask(len(rows))  # not initialized: xgrammar writes a live row whole

        def finish() -> TokenMasks:
            every = len(rows) == total_rows
            on_device = bitmask.to(self.device, non_blocking=True)
            if copied is not None:
                copied.record()  # the copy's end: when the buffer is free again
            return TokenMasks(on_device, device_tensor(rows, torch.int64, self.device), every)

        if not background:
            self._fill(constrained, bitmask)
            return finish
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hibana-grammar")
        self._filling = self._worker.submit(self._fill, constrained, bitmask)

        def wait() -> TokenMasks:
            filling, self._filling = self._filling, None
            filling.result()  # the fill's error, if any, is the step's
            return finish()

        return wait

    def _fill(self, constrained: list[tuple[Matcher | None, tuple[int, ...]]], bitmask: torch.Tensor) -> None:
        suspects = self.suspects()
        batch: list[tuple[Matcher, int]] = []
        at = 0
        for matcher, drafts in constrained:
            if matcher is None or drafts:  # all allowed, but where a verify step's matcher reaches
                for i in range(at, at + 1 + len(drafts)):
                    bitmask[i].fill_(-1)  # a row at a time: below the size torch spreads over threads
                if matcher is not None:
                    matcher.fill(bitmask, at, drafts, suspects)
            else:
                batch.append((matcher, at))
            at += 1 + len(drafts)
        if len(batch) >= BATCH_FILL_ROWS:
            rows = [i for _, i in batch]
            self._batch.batch_fill_next_token_bitmask([m._matcher for m, _ in batch], bitmask, rows)
            for matcher, i in batch:  # first, as `Matcher.fill` does: a forced string's first token may be one
                matcher.hold_stops(bitmask, i)
            free = np.count_nonzero(bitmask.numpy()[rows], axis=1) > FORCED_MAX_WORDS  # all rows at once
            for (matcher, i), row_free in zip(batch, free.tolist()):
                matcher.spell_forced(bitmask, i, free=row_free)
            # the rows that allow a few suspects, found for all at once (most allow none, or
            # hundreds: a string's content)
            for (matcher, i), count in zip(batch, self._suspects_allowed(bitmask, rows)):
                if 0 < count <= VERIFY_MAX:
                    matcher.drop_refused(bitmask, i, suspects)
            bitmask[rows] &= self.utf8_rows().keep  # all rows at once (`Matcher.hold_utf8`)
            for matcher, i in batch:  # last, as `Matcher.fill` does: a row's mask is one function of its state
                matcher.hold_back(bitmask, i)
                matcher.hold_after_lead(bitmask, i)
        else:
            for matcher, i in batch:
                matcher.fill(bitmask, i, suspects=suspects)

    def suspects(self) -> torch.Tensor:
        """A bitmask row of the tokens whose bytes, as xgrammar reads them, are not whole UTF-8 (a
        character cut at an end, or bytes that are none): the tokens `Matcher.drop_refused` checks."""
        if self._suspects is None:
            self._suspects = self._row(lambda text: not _whole_utf8(text))
        return self._suspects

    def utf8_rows(self) -> "Utf8Rows":
        """The bitmask rows `Matcher.hold_utf8` clears: tokens in no UTF-8 text, and those that
        start with a byte that spells no character after each lead byte of _BAD_SECOND."""
        if self._utf8 is None:
            never = self._row(_never_utf8)
            self._utf8 = Utf8Rows(~never, {lead: ~self._row(functools.partial(_no_character_after, lead))
                                           for lead in _BAD_SECOND},
                                  frozenset(allowed_tokens(never, self.vocab_size)))
        return self._utf8

    def _row(self, takes: Callable[[bytes], bool]) -> torch.Tensor:
        """A bitmask row with the bits of the tokens whose bytes (xgrammar's reading) `takes`."""
        words = [0] * self.width
        self._describe()
        for token, text in enumerate(self._bytes[:self.vocab_size]):
            if takes(text):
                words[token // 32] |= _bit(token % 32)
        return torch.tensor(words, dtype=torch.int32)

    def _suspects_allowed(self, bitmask: torch.Tensor, rows: list[int]) -> list[int]:
        """How many suspect tokens each of `rows` allows: the bits set in the row and in
        `suspects`, counted over the few words that hold any (389 of 4,740 for a 151k byte-level
        BPE), 16 bits a lookup (0.7 ms less a batch-32 fill than a test per row)."""
        if self._suspect_words is None:
            words = self.suspects().numpy().view(np.uint32)
            held = np.flatnonzero(words)
            self._suspect_words = held, words[held]
        held, bits = self._suspect_words
        found = np.ascontiguousarray(bitmask.numpy().view(np.uint32)[np.ix_(rows, held)] & bits)
        return _POPCOUNT16[found.view(np.uint16)].sum(axis=1).tolist()

    def wait_fill(self) -> None:
        """Wait for a fill started by `start_masks` whose result nobody will take (its step
        failed): until it ends, it owns the matchers."""
        if self._filling is not None:
            self._filling.exception()
            self._filling = None

    def close(self) -> None:
        """Stop the worker thread (an engine's close)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    def _host_bitmask(self, rows: int) -> tuple[torch.Tensor, Any]:
        """`rows` rows of a host bitmask, not initialized (filling 600 KB a step with -1 cost up to
        a millisecond where torch spread it over busy cores). Off CUDA a new tensor; on CUDA one of
        STAGING_BUFFERS pinned buffers taken in turn (pinning one per step went to the driver while
        the forward ran), once the copy that last read it has ended (long done: a step's masks are
        filled after the previous step's tokens, sampled after its copy, came back). With it the
        event to record once the copy is enqueued (None off CUDA)."""
        if self.device.type != "cuda":
            return torch.empty((rows, self.width), dtype=torch.int32), None
        if len(self._staging) < STAGING_BUFFERS:
            self._staging.append((torch.empty(0, self.width, dtype=torch.int32), torch.cuda.Event()))
        slot = self._next_staging % len(self._staging)
        buffer, copied = self._staging[slot]
        copied.synchronize()  # returns at once for an event never recorded
        if buffer.shape[0] < rows:  # room for the largest step so far
            buffer = torch.empty(max(rows, 2 * buffer.shape[0]), self.width, dtype=torch.int32, pin_memory=True)
            self._staging[slot] = (buffer, copied)
        self._next_staging = slot + 1
        return buffer[:rows], copied
