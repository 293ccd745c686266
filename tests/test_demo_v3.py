"""Corpus v3 (issue 15): an open world of values and tools, so copying is the only skill that pays.

Fast: no model runs here. The statistics are the point of v3 (corpus v2 reused 493 letter-only
values ~60 times each); the overlap with the held-out set is checked in test_demo_v2.py.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import jsonschema
from tokenizers import Tokenizer

from hibana_core.demo import corpus_v3, template, tools_v2
from hibana_core.demo.train import MAX_TOKENS

N = 3000


def _open_conversations(n: int = N):
    """Corpus v3's own conversations among the first `n` (run 3's, mixed in, are skipped)."""
    for i in range(n):
        c = corpus_v3.conversation(0, i)
        if c.tools and isinstance(c.tool_objects[0], tools_v2.NaturalTool):
            yield c


def _calls(c):
    """(question, call function, schema properties) for each call, the question being the last user turn."""
    props = {t["function"]["name"]: t["function"]["parameters"] for t in c.tools}
    question = ""
    for m in c.messages:
        if m["role"] == "user":
            question = m["content"]
        for call in m.get("tool_calls") or []:
            yield question, call["function"], props[call["function"]["name"]]


def test_values_are_open_and_handwritten_tools_a_minority():
    uses, enum_uses, handwritten, offered = collections.Counter(), 0, 0, 0
    for c in _open_conversations():
        handwritten += sum(t.spec.domain != "open" for t in c.tool_objects)
        offered += len(c.tool_objects)
        for _, fn, schema in _calls(c):
            for name, value in fn["arguments"].items():
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, str) and not re.search(r"\d", v):
                        if "enum" in schema["properties"][name]:
                            enum_uses += 1
                        else:
                            uses[v] += 1
    assert len(uses) > 4000 and uses.most_common(1)[0][1] <= 10, uses.most_common(5)
    assert len(uses) / sum(uses.values()) > 0.9
    assert enum_uses < 0.1 * sum(uses.values())
    assert 0.1 < handwritten / offered < 0.3
    names = {t["function"]["name"] for c in _open_conversations(500) for t in c.tools}
    assert len(names) > 1000


def test_calls_validate_and_copy_their_values_from_the_question():
    """Every string value (list items included) is in the question verbatim, or a follow-up
    ("And for X?") keeps it from an earlier call of the same tool; enum values are stated as they
    are. Derived values ("a week" -> 7, "then shuffle" -> true) are numbers and booleans only."""
    kinds = collections.Counter()
    for c in _open_conversations(1000):
        earlier = collections.defaultdict(list)          # (tool, argument) -> values of earlier calls
        for question, fn, schema in _calls(c):
            jsonschema.validate(fn["arguments"], schema)
            for name, value in fn["arguments"].items():
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, str):
                        assert v in question or value in earlier[fn["name"], name], (v, question)
                    kinds[type(v).__name__] += 1
            for name, value in fn["arguments"].items():
                earlier[fn["name"], name].append(value)
    assert {"str", "int", "bool"} <= set(kinds)


def test_conversations_render_within_the_training_length():
    """Measured with the bundled (v1) tokenizer, which spells pseudo-words in more tokens than one
    trained on v3 will: 5.1% of v3 is over MAX_TOKENS there, against 7.1% of corpus v2 (1.4% with
    v2's own tokenizer); train.py drops those."""
    tok = Tokenizer.from_file(str(Path(template.__file__).parent / "model" / "tokenizer.json"))
    texts = [template.render_with_spans(corpus_v3.conversation(0, i).messages, corpus_v3.conversation(0, i).tools)[0]
             for i in range(400)]
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    assert sum(n > MAX_TOKENS for n in lengths) <= 0.06 * len(lengths), sorted(lengths)[-10:]


def test_seeded():
    assert corpus_v3.conversation(0, 7).messages == corpus_v3.conversation(0, 7).messages
    assert corpus_v3.conversation(1, 7).messages != corpus_v3.conversation(0, 7).messages
