"""A generalisation gauge that leaves the independent held-out set alone (issue 15).

Fresh corpus v2 conversations are cut before their first call (one call, a string value the
question states), then posed four ways, one thing changed at a time:

    original    as generated
    values      the call's string values (enum ones aside) replaced, in the question and in the
                call, by words no training generator produces
    tool_name   the called tool renamed to such a name (its description kept)
    arg_names   the called tool's arguments renamed

Only the first turn is scored: the right tool, and the right call. A model that reads the schema
and copies from the question scores about the same four times; v2's first checkpoint (4000 steps)
scored 29, 7, 16 and 22 of 30: it recalls corpus v2's closed set of values and tool names
(bench/notes_demo_training.md). Cheap enough for train.py's evaluation, and nothing here comes
from heldout_v2.py.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

from hibana_core.demo import corpus_v2
from hibana_core.demo.evaluate import _same

KINDS = ("original", "values", "tool_name", "arg_names")
UNSEEN_VALUES = ("Wexford Mill", "Calloway", "Brisbane", "tamarind", "Okonkwo Adebayo", "Pemberley Hall",
                 "Quillfeather", "Marrow Lane", "gazpacho", "Ulaanbaatar", "Thistlewood", "Kestrel Bay")
UNSEEN_TOOL_NAMES = ("arrange_item", "obtain_record", "dispatch_order", "retrieve_details", "register_entry",
                     "query_service")
UNSEEN_ARG_NAMES = ("payload", "specifier", "descriptor", "selector", "qualifier", "designation")


@dataclass(frozen=True)
class Case:
    """One first turn to pose: the conversation so far, the offered schemas, the expected call."""

    kind: str
    messages: list[dict]
    tools: list[dict]
    name: str
    arguments: dict


def _base(index: int, seed: str) -> Case | None:
    """Conversation `index` cut before its first call, if that call is single and copies a string."""
    rng = random.Random(f"v2:{seed}:{index}")
    if rng.random() < corpus_v2.V1_SHARE:               # the same draw corpus_v2.conversation makes
        return None
    c = corpus_v2.make_conversation(rng)
    k = next((j for j, m in enumerate(c.messages) if m["role"] == "assistant" and m.get("tool_calls")), None)
    if k is None or len(c.messages[k]["tool_calls"]) != 1:
        return None
    call = c.messages[k]["tool_calls"][0]["function"]
    case = Case("original", c.messages[:k], c.tools, call["name"], call["arguments"])
    return case if _copied(case) else None


def _schema(case: Case) -> dict:
    return next(t for t in case.tools if t["function"]["name"] == case.name)["function"]["parameters"]


def _copied(case: Case) -> list[str]:
    """The call's arguments whose value is a string of letters the question states (no enum)."""
    question, properties = case.messages[-1]["content"], _schema(case)["properties"]
    return [a for a, v in case.arguments.items() if isinstance(v, str) and v in question
            and "enum" not in properties[a] and not any(ch.isdigit() for ch in v)]


def perturb(case: Case, kind: str, i: int) -> Case:
    """`case` with one thing changed (KINDS); `i` picks the unseen words."""
    c = copy.deepcopy(case)
    name, arguments = c.name, c.arguments
    if kind == "values":
        for a in _copied(c):
            new = UNSEEN_VALUES[(i + len(a)) % len(UNSEEN_VALUES)]
            c.messages[-1]["content"] = c.messages[-1]["content"].replace(arguments[a], new)
            arguments[a] = new
    elif kind == "tool_name":
        name = UNSEEN_TOOL_NAMES[i % len(UNSEEN_TOOL_NAMES)]
        next(t for t in c.tools if t["function"]["name"] == c.name)["function"]["name"] = name
    elif kind == "arg_names":
        schema = _schema(c)
        renamed = {a: UNSEEN_ARG_NAMES[(i + n) % len(UNSEEN_ARG_NAMES)] for n, a in enumerate(schema["properties"])}
        schema["properties"] = {renamed[a]: p for a, p in schema["properties"].items()}
        schema["required"] = [renamed[a] for a in schema["required"]]
        arguments = {renamed[a]: v for a, v in arguments.items()}
    return Case(kind, c.messages, c.tools, name, arguments)


def cases(n: int = 30, seed: str = "perturb") -> list[Case]:
    """`n` base cases, each posed the four ways (KINDS order, then case order)."""
    base, index = [], 0
    while len(base) < n:
        index += 1
        case = _base(index, seed)
        if case is not None:
            base.append(case)
    return [perturb(c, kind, i) for kind in KINDS for i, c in enumerate(base)]


def evaluate(backend, n: int = 30, seed: str = "perturb") -> dict[str, dict[str, int]]:
    """kind -> {"n", "tool_ok", "call_ok"} for the first turn (`backend`: evaluate.Backend)."""
    return score(backend, cases(n, seed), KINDS, "perturb")


def score(backend, posed: list[Case], kinds: tuple[str, ...], key: str) -> dict[str, dict[str, int]]:
    """Pose each case's first turn; kind -> {"n", "tool_ok", "call_ok"} (reading.py scores the same way)."""
    replies = backend.respond([(f"{key}-{i}", c.messages, c.tools) for i, c in enumerate(posed)])
    out = {kind: {"n": 0, "tool_ok": 0, "call_ok": 0} for kind in kinds}
    for c, reply in zip(posed, replies):
        named = len(reply.calls) == 1 and reply.calls[0][0] == c.name
        args = reply.calls[0][1] if named else {}
        row = out[c.kind]
        row["n"] += 1
        row["tool_ok"] += named
        row["call_ok"] += named and args.keys() == c.arguments.keys() and all(
            _same(args[k], v) for k, v in c.arguments.items())
    return out


def summary(result: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {kind:<10} right tool {r['tool_ok']}/{r['n']}, right call {r['call_ok']}/{r['n']}"
                     for kind, r in result.items())
