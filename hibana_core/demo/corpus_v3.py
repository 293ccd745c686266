"""Corpus v3 (issue 15): corpus v2's conversations over an open world of values and tools.

Conversation `i` of seed `s` is drawn from `random.Random(f"v3:{s}:{i}")`:

    V1_SHARE of them: run 3's conversation (corpus.conversation), so the old skills stay
    the others: corpus_v2.make_conversation (single, parallel, follow-up and no-tool exchanges)
    over 1-8 tools, each one
        HANDWRITTEN_SHARE   one of v2's hand-written specs, its pooled values reopened
        otherwise           an open tool (tools_v3.open_spec); after the first, SIBLING_SHARE of
                            them share its noun ("get_vendor_owner" beside "archive_vendor"), so
                            choosing the tool needs reading the attribute or verb

Every string value in a call is copied verbatim from the question (enum values are stated as
themselves; follow-ups state the new value). Values almost never repeat: tests/test_demo_v3.py
measures it.
"""

from __future__ import annotations

import random

from hibana_core.demo import corpus, corpus_v2
from hibana_core.demo.corpus import Conversation
from hibana_core.demo.tools_v2 import SPECS, NaturalTool, make_tool
from hibana_core.demo.tools_v3 import open_spec, reopened

V1_SHARE = 0.1
HANDWRITTEN_SHARE = 0.2
SIBLING_SHARE = 0.3
HANDWRITTEN = tuple(reopened(s) for s in SPECS)


def _tools(rng: random.Random) -> list[NaturalTool]:
    """1-8 tools with distinct names: HANDWRITTEN_SHARE of them v2's specs reopened, the rest open."""
    n = rng.choices(range(1, corpus_v2.MAX_TOOLS + 1), weights=(3, 4, 4, 3, 2, 2, 1, 1))[0]
    kinds = [rng.random() < HANDWRITTEN_SHARE for _ in range(n)]
    fixed = iter(rng.sample(HANDWRITTEN, sum(kinds)))
    out, names, noun = [], set(), None
    for handwritten in kinds:
        if handwritten:
            spec = next(fixed)
        else:
            spec = open_spec(rng, noun if noun and rng.random() < SIBLING_SHARE else None)
            noun = noun or spec.args["subject"].description.removeprefix("Which ").rstrip(".")
        tool = make_tool(rng, spec)
        if tool.name not in names:
            out.append(tool)
            names.add(tool.name)
    return out


def conversation(seed: int | str, index: int) -> Conversation:
    """Conversation `index` of corpus v3."""
    rng = random.Random(f"v3:{seed}:{index}")
    if rng.random() < V1_SHARE:
        return corpus.conversation(seed, index)
    return corpus_v2.make_conversation(rng, _tools)
