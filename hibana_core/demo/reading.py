"""The reading gauge (issue 15): does the model pick a tool by reading words it never saw in one?

Corpus v4 teaches choosing a tool by its name and description among siblings that share its noun
or verb. This gauge poses first turns whose tool, and the siblings beside it, are made of words
that appear in no training conversation (tools_v4.GAUGE: "kayak", "glossiness", "recalibrate";
tests/test_demo_v4.py checks), three ways:

    seen          tools of the training words (fresh values), as in training
    unseen        gauge words; the question uses the tool's own words ("recalibrate the kayak X")
    unseen_other  gauge words; the question may use another word of the group ("couch" for a
                  `sofa` tool): a model cannot know the pair, so this row shows the limit

Scored like perturb.py (the right tool; the right call). Nothing here comes from heldout_v2.py.
"""

from __future__ import annotations

import random

from hibana_core.demo import corpus_v4
from hibana_core.demo.perturb import Case, score
from hibana_core.demo.tools_v4 import GAUGE, TRAIN, open_tool, sibling

KINDS = ("seen", "unseen", "unseen_other")


def case(kind: str, index: int, seed: str = "reading") -> Case:
    rng = random.Random(f"reading:{seed}:{kind}:{index}")
    lex, synonyms = (TRAIN, True) if kind == "seen" else (GAUGE, kind == "unseen_other")
    target = open_tool(rng, lex, synonyms)
    tools, siblings, others = [target], rng.randint(1, 3), rng.randint(0, 2)
    while len(tools) < 1 + siblings:                   # tools sharing its noun or verb
        candidate = sibling(rng, rng.choice(tools), lex, synonyms)
        if corpus_v4.distinct(candidate, tools):
            tools.append(candidate)
    while len(tools) < 1 + siblings + others:          # and a tool or two of the training words
        candidate = open_tool(rng)
        if corpus_v4.distinct(candidate, tools):
            tools.append(candidate)
    rng.shuffle(tools)
    question, arguments, _ = corpus_v4.ask(rng, target)
    return Case(kind, [{"role": "user", "content": question}], [t.schema for t in tools], target.name, arguments)


def cases(n: int = 30, seed: str = "reading") -> list[Case]:
    return [case(kind, i, seed) for kind in KINDS for i in range(n)]


def evaluate(backend, n: int = 30, seed: str = "reading") -> dict[str, dict[str, int]]:
    """kind -> {"n", "tool_ok", "call_ok"} for the first turn (`backend`: evaluate.Backend)."""
    return score(backend, cases(n, seed), KINDS, "reading")
