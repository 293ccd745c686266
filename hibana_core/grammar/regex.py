"""Regexes as the grammar holds them: the parts xgrammar 0.2.9's regex reader skips or reads
otherwise than Python's `re` (`unenforced_regex`), a regex rewritten so that every output matches
it under Python's `re` and ECMA-262 alike (`held_regex`, with the code-point classes of \\w \\d
\\s), and a schema's pattern that xgrammar would write into a JSON string unescaped
(`raw_in_json_string`)."""

from __future__ import annotations

import functools
import json
import re
from typing import Callable, Iterable, Sequence

from hibana_core.grammar.backend import _xgrammar

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
