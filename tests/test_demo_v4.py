"""Corpus v4 (issue 15): tools chosen by reading, values mapped with world knowledge.

Fast: no model runs here. What v4 adds over v3 is checked on its conversations: every call
validates; a copied value is in what the user said; a mapped value is the right ISO code, unit,
clock time or number for the words; tools beside a called one share its noun or verb often enough
that choosing needs reading; nothing of the held-out set can be formed. The overlap with the
held-out set is also checked in test_demo_v2.py (TRAINING_CORPORA).
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from hibana_core.demo import (corpus_v2, corpus_v4, evaluate, heldout_v2, knowledge as K, reading, template,
                              tools_v4)
from hibana_core.demo.train import MAX_TOKENS_V4

N = 1500


def _own(n: int = N):
    """Corpus v4's own conversations among the first `n` (v3's, mixed in, are skipped)."""
    for i in range(n):
        c = corpus_v4.conversation(0, i)
        if c.tool_objects and isinstance(c.tool_objects[0], tools_v4.OpenTool):
            yield c


def _calls(c):
    """(what the user has said so far, call, tool) for each call."""
    tools = {t.name: t for t in c.tool_objects}
    said = []
    for m in c.messages:
        if m["role"] == "user":
            said.append(m["content"])
        for call in m.get("tool_calls") or []:
            yield " ".join(said), call["function"], tools[call["function"]["name"]]


def test_calls_validate_and_copied_values_come_from_the_user():
    calls = copied = 0
    for c in _own():
        for said, call, tool in _calls(c):
            calls += 1
            jsonschema.validate(call["arguments"], tool.schema["function"]["parameters"])
            for slot in tool.slots:
                if slot.mapped:
                    continue
                for name in slot.params:
                    value = call["arguments"].get(name)
                    for item in value if isinstance(value, list) else [value] if value is not None else []:
                        copied += 1
                        assert item in said, (item, said)
    assert calls > 1500 and copied > 1000


def test_mapped_values_are_the_standards():
    currencies, languages, countries = K.currencies(), K.languages(), K.countries()
    assert {"USD", "EUR", "JPY", "CHF", "GBP", "INR"} <= set(currencies) and "XAU" not in currencies
    assert "Swiss francs" in currencies["CHF"] and "Japanese yen" in currencies["JPY"]
    assert languages["de"] == "German" and languages["el"] == "Greek" and languages["es"] == "Spanish"
    assert countries["KR"] == "South Korea" and countries["PE"] == "Peru"
    assert all(len(c) == 2 and c.isupper() for c in countries) and "CA" in K.us_states()
    seen = collections.Counter()
    for c in _own():
        for _, call, tool in _calls(c):
            for slot in tool.slots:
                for name, schema in slot.params.items():
                    value = call["arguments"].get(name)
                    description = schema.get("description", "")
                    if value is None:
                        continue
                    if "ISO 4217" in description:
                        assert value in currencies, value
                        seen["currency"] += 1
                    elif "language code" in description:
                        assert value in languages, value
                        seen["language"] += 1
                    elif "alpha-2" in description:
                        assert value in countries, value
                        seen["country"] += 1
                    elif "HH:MM" in description:
                        assert re.fullmatch(r"([01]\d|2[0-3]):[0-5]\d", value), value
                        seen["time"] += 1
    assert min(seen.values()) > 20 and len(seen) == 4, seen


@pytest.mark.parametrize("kind, unit, integer, said, value", [
    ("duration", "minutes", True, "2 hours", 120), ("duration", "days", True, "a fortnight", 14),
    ("duration", "minutes", True, "an hour and a half", 90), ("weight", "grams", True, "half a kilo", 500),
    ("weight", "kilograms", False, "250 g", 0.25), ("length", "metres", False, "3 km", 3000),
    ("volume", "millilitres", True, "a litre", 1000), ("duration", "days", True, "3 weeks", 21)])
def test_quantities_convert_to_the_schemas_unit(kind, unit, integer, said, value):
    """Every (value, said) a generator gives is right: draw until `said` comes out, check its value."""
    rng = random.Random(0)
    for _ in range(200_000):
        v, s = K.quantity(rng, kind, unit, integer)
        if s == said:
            assert v == value
            return
    pytest.fail(f"{said!r} never drawn")


def test_quantities_money_and_clock_times_say_their_value():
    rng = random.Random(1)
    numbers = {w: i for i, w in enumerate(K.ONES)} | {K.number_words(n): n for n in range(20, 1000)}
    sizes = {name: (size, unit) for kind in K.QUANTITIES.values() for unit, (size, names) in kind[0].items()
             for name in names}
    for kind, (units, phrases) in K.QUANTITIES.items():
        for unit in units:
            for _ in range(300):
                integer = rng.random() < 0.5
                value, said = K.quantity(rng, kind, unit, integer)
                assert not integer or isinstance(value, int), (kind, unit, value, said)
                if any(said in p for p in phrases.values()):
                    continue
                name = next(n for n in sorted(sizes, key=len, reverse=True)
                            if said.endswith(" " + n) or len(n) > 3 and said.endswith(" " + n[:-1]))
                amount = said[:said.rindex(" " + name[:-1])]
                amount = float(amount) if amount[0].isdigit() else numbers[amount]
                size, said_unit = sizes[name]
                assert value == pytest.approx(amount * size / units[unit][0]), (kind, unit, value, said)
    for _ in range(500):
        amount, code, said = K.money(rng)
        assert str(amount).split(".")[0] in said.replace(",", "") and code in K.currencies()
        value, said = K.clock_time(rng)
        h, m = map(int, value.split(":"))
        match = re.fullmatch(r"(\d+)(?::(\d\d))?\s?([ap])\.?m\.?", said.lower())
        if match:
            assert (int(match[1]) % 12 + 12 * (match[3] == "p"), int(match[2] or 0)) == (h, m), (value, said)
    assert K.number_words(42) == "forty-two" and K.number_words(305) == "three hundred and five"


def test_choosing_needs_reading():
    """Most calls are made beside a tool sharing their noun or verb, and the question often says
    the noun or verb in another word of its group than the tool's name."""
    beside = synonym = total = 0
    for c in _own():
        for said, call, tool in _calls(c):
            if tool.kind == "compose":
                continue
            total += 1
            others = [t for t in c.tool_objects if t is not tool]
            beside += any(t.noun == tool.noun or t.name.split("_")[0] == tool.name.split("_")[0] for t in others)
            last = said.rsplit("?", 1)[0].lower()
            synonym += tool.noun[0] not in last and any(w in last for w in tool.noun[1:])
    assert beside / total > 0.4 and synonym / total > 0.1, (beside / total, synonym / total)


def test_every_exchange_kind_is_drawn():
    kinds = collections.Counter()
    for c in _own(600):
        for m in c.messages:
            calls = m.get("tool_calls") or []
            if len(calls) > 1:
                kinds["parallel"] += 1
            if m["role"] == "tool" and '"error"' in m["content"]:
                kinds["failed"] += 1
            if m["role"] == "assistant" and not calls and m["content"].startswith(("Sure - what", "Which ", "I need the")):
                kinds["clarify"] += 1
            if m["role"] == "user" and m["content"].startswith(("What about", "And for", "How about", "Try ")):
                kinds["follow_up"] += 1
            if m["role"] == "user" and m["content"].startswith(("Agent ", "Please continue", "Just say", "Repeat after")):
                kinds["no_tool"] += 1
    assert all(kinds[k] >= 5 for k in ("parallel", "failed", "clarify", "follow_up", "no_tool")), kinds


def test_heldout_cannot_be_formed_from_v4s_words():
    flat = lambda name: name.replace("_", "").replace(" ", "").lower()
    verbs = {w for g in tools_v4.ACTIONS + tools_v4.LOOKUP_VERBS for w in g}
    nouns = {w for g in tools_v4.NOUNS for w in g}
    attributes = {w for g, _ in tools_v4.ATTRIBUTES for w in g}
    formed = {flat(v + n) for v in verbs for n in nouns} | {flat(n + a) for n in nouns for a in attributes}
    formed |= {flat(v + n + a) for v in verbs for n in nouns for a in attributes}
    assert not formed & {flat(name) for name in heldout_v2.TOOLS}
    held_words = {w for d in heldout_v2.HELD_OUT_DOMAINS for w in d.split("_")} | {
        w for name in heldout_v2.TOOLS for w in name.split("_") if len(w) > 3}
    assert not {n for n in nouns if set(n.split()) & held_words}
    questions = {t.question for t in heldout_v2.tasks()}
    assert not questions & {m["content"] for c in _own(400) for m in c.messages if m["role"] == "user"}


def test_conversations_render_within_the_training_length():
    tok = Tokenizer.from_file(str(Path(template.__file__).parent / "model" / "tokenizer.json"))
    lengths = [len(tok.encode(template.render(c.messages, c.tools)).ids) for c in _own(400)]
    assert sum(n > MAX_TOKENS_V4 for n in lengths) / len(lengths) < 0.03


def test_seeded():
    assert corpus_v4.conversation(3, 17).messages == corpus_v4.conversation(3, 17).messages
    assert corpus_v4.conversation(3, 17).messages != corpus_v4.conversation(3, 18).messages


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", text).lower()))


def test_gauge_words_are_in_no_training_conversation():
    """reading.py's unseen rows mean something only if no corpus (v4 with v3's and run 3's share, v2)
    ever shows their words: in names, descriptions, argument names or any message."""
    lex = tools_v4.GAUGE
    gauge = {w for g in lex.nouns + lex.actions + tuple(a for a, _ in lex.attributes) for p in g for w in p.split()
             if len(w) > 3}
    assert len(gauge) > 40
    seen = set()
    for make, n in ((corpus_v4.conversation, 1500), (corpus_v2.conversation, 500)):
        for i in range(n):
            c = make(0, i)
            for t in c.tools or []:
                f = t["function"]
                seen |= _words(f["name"].replace("_", " ")) | _words(f["description"])
                seen |= {w for k in f["parameters"]["properties"] for w in _words(k.replace("_", " "))}
            seen |= {w for m in c.messages for w in _words(m.get("content") or "")}
    assert not gauge & seen
    held = {w for name, t in heldout_v2.TOOLS.items() for w in _words(name.replace("_", " ") + " " +
                                                                    t.schema["function"]["description"])}
    assert not gauge & held


def test_reading_gauge_cases_and_scoring():
    cases = reading.cases(8)
    assert [c.kind for c in cases] == [k for k in reading.KINDS for _ in range(8)]
    for c in cases:
        names = [t["function"]["name"] for t in c.tools]
        assert names.count(c.name) == 1 and 2 <= len(names) <= 6
        schema = next(t for t in c.tools if t["function"]["name"] == c.name)["function"]["parameters"]
        jsonschema.validate(c.arguments, schema)
    unseen = [c for c in cases if c.kind == "unseen"]
    gauge = {w for g in tools_v4.GAUGE.nouns for w in g}
    assert sum(any(w in c.messages[0]["content"] for w in gauge) for c in unseen) >= 4  # (15% pseudo-word nouns)

    class Echo:
        """Calls what each case expects, with a wrong value on the unseen_other row."""
        def respond(self, batch):
            expected = {f"reading-{i}": c for i, c in enumerate(reading.cases(3))}
            return [evaluate.Reply("", [(c.name, c.arguments if c.kind != "unseen_other" else
                                         {k: [v] for k, v in c.arguments.items()})])
                    for c in (expected[key] for key, _, _ in batch)]
    result = reading.evaluate(Echo(), 3)
    assert result["seen"] == result["unseen"] == {"n": 3, "tool_ok": 3, "call_ok": 3}
    assert result["unseen_other"] == {"n": 3, "tool_ok": 3, "call_ok": 0}


def test_answers_quote_every_value_the_tools_returned():
    """What evaluate.py (and a user) checks: the final answer carries each field of each result."""
    answers = 0
    for c in _own(800):
        results = []
        for m in c.messages:
            if m["role"] == "tool":
                results.append(json.loads(m["content"]))
            elif m["role"] == "assistant" and results and not m.get("tool_calls"):
                for result in results:
                    if result != {"status": "shown"}:  # a compose tool's: the answer is what it wrote
                        assert all(str(v) in m["content"] for v in result.values()), (result, m["content"])
                answers += 1
                results = []
    assert answers > 500


def test_mixed_corpus_draws_each_share_from_its_corpus():
    from hibana_core.demo import corpus, corpus_v3
    from hibana_core.demo.train import conversation, mixed_name

    name = mixed_name("v4", "v1=0.3, v3=0.2")
    assert name == "v4+v1=0.3+v3=0.2"
    picked = {"v1": 0, "v3": 0, "v4": 0}
    for i in range(400):
        got = conversation(name, 0, i).messages
        source = [n for n, make in (("v1", corpus.conversation), ("v3", corpus_v3.conversation),
                                    ("v4", corpus_v4.conversation)) if make(0, i).messages == got]
        assert source, f"conversation {i} of the mix is none of its corpora's conversation {i}"
        picked[source[0]] += 1
    # v4 keeps its own v3 share (20%) and v3 its v1 share (10%): about 132 / 108 / 160 of 400
    assert 100 <= picked["v1"] <= 165 and 80 <= picked["v3"] <= 140 and 130 <= picked["v4"] <= 190, picked
    for bad in ("v9=0.1", "v1=1.2", "v1=0.6,v3=0.5", "v1"):
        with pytest.raises(SystemExit, match="--mix"):
            mixed_name("v4", bad)


def test_init_starts_from_a_checkpoints_weights(tmp_path, capsys):
    """--init loads a trained checkpoint (fine-tuning): at lr 0 its weights come back unchanged."""
    import torch
    from safetensors.torch import load_file

    from hibana_core.demo import train

    tiny = ["--shape", "v1", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "16", "--intermediate", "64", "--conversations", "60", "--workers", "1",
            "--tokenizer-conversations", "2000", "--eval-tasks", "0", "--batch-tokens", "4096", "--device", "cpu"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert train.main(tiny + ["--corpus", "v1", "--out", str(first), "--steps", "2"]) == 0
    assert train.main(tiny + ["--corpus", "v4", "--mix", "v1=0.5", "--out", str(second), "--steps", "1",
                              "--init", str(first), "--tokenizer", str(first), "--lr", "0"]) == 0
    assert f"weights: {first}" in capsys.readouterr().out
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((second / "training_report.json").read_text())
    assert report["corpus"] == "v4+v1=0.5" and report["init"] == str(first)
    with pytest.raises(SystemExit, match="--init"):
        train.main(tiny + ["--layers", "2", "--out", str(tmp_path / "third"), "--steps", "1",
                           "--init", str(first), "--tokenizer", str(first)])
