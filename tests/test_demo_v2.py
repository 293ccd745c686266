"""Demo model v2's data (issue 15): the independent held-out set and the v2 (and v3) training corpus.

Fast: no model runs here. The held-out set must stay apart from everything the training code
can produce (domains, tool names), and every expected call must be one its tool accepts.
"""

from __future__ import annotations

import json

import jsonschema

from hibana_core.demo import (corpus, corpus_v2, corpus_v3, corpus_v4, evaluate, heldout_v2, perturb, template, tools,
                              tools_v2, tools_v3)


TRAINING_CORPORA = (corpus.conversation, corpus_v2.conversation, corpus_v3.conversation, corpus_v4.conversation)


def _training_tool_names(n: int = 400) -> set[str]:
    names = set()
    for i in range(n):
        for make in TRAINING_CORPORA:
            names |= {t["function"]["name"] for t in make(0, i).tools or []}
    return names


def test_heldout_set_loads_with_every_kind():
    tasks = heldout_v2.tasks()
    assert len(tasks) >= 100
    kinds = {t.kind for t in tasks}
    assert kinds == {"single", "parallel", "no_tool", "follow_up"}
    assert all(1 <= len(t.tools) <= 8 for t in tasks)
    assert [t.index for t in tasks] == list(range(len(tasks)))
    assert len({t.question for t in tasks if t.kind != "follow_up"}) == sum(t.kind != "follow_up" for t in tasks)
    types = {p["type"] for t in heldout_v2.TOOLS.values()
             for p in t.schema["function"]["parameters"]["properties"].values()}
    assert types == {"string", "integer", "number", "boolean", "array"}
    assert any("enum" in p for t in heldout_v2.TOOLS.values()
               for p in t.schema["function"]["parameters"]["properties"].values())


def test_heldout_calls_validate_and_answers_carry_the_results():
    for task in heldout_v2.tasks():
        offered = {t.name for t in task.tools}
        for call in task.turns[0]:
            assert call.tool.name in offered, task.question
            jsonschema.validate(call.arguments, call.tool.schema["function"]["parameters"])
            result = json.loads(call.result)
            assert "error" not in result, (task.question, result)
            assert all(str(result[k]) in task.answer_keys for k in call.tool.keys)
        assert bool(task.turns[0]) == bool(task.answer_keys), task.question
        template.render(list(task.messages), [t.schema for t in task.tools], add_generation_prompt=True)


def test_heldout_is_disjoint_from_training():
    training_domains = tools_v2.TRAINING_DOMAINS | set(tools.FAMILIES)
    assert not heldout_v2.HELD_OUT_DOMAINS & training_domains
    assert {t.domain for t in heldout_v2.TOOLS.values()} <= heldout_v2.HELD_OUT_DOMAINS
    spec_names = {n for s in tools_v2.SPECS for n in s.names}
    v1_names = {f"{v}_{n}" for f in tools.FAMILIES.values() for v in f.verbs for n in f.nouns}
    held = set(heldout_v2.TOOLS)
    assert not held & spec_names and not held & v1_names
    assert not held & _training_tool_names()
    questions = {t.question for t in heldout_v2.tasks()}
    assert not questions & {q for s in tools_v2.SPECS for q in s.questions}
    trained = {m["content"] for i in range(400) for make in TRAINING_CORPORA
               for m in make(0, i).messages if m["role"] == "user"}
    assert not questions & trained


def test_corpus_v3_cannot_name_a_heldout_tool():
    """Every name open_spec can form from its word lists, in any casing, is none of the held-out
    tools' (its pseudo-word names cannot be either: heldout names are English words)."""
    flat = lambda name: name.replace("_", "").lower()
    formed = {flat(v + n) for v in tools_v3.VERBS for n in tools_v3.NOUNS}
    formed |= {flat(n + a) for n in tools_v3.NOUNS for a in tools_v3.ATTRIBUTES}
    formed |= {flat(f + n + a) for f in tools_v3.FETCH for n in tools_v3.NOUNS for a in tools_v3.ATTRIBUTES}
    assert not formed & {flat(name) for name in heldout_v2.TOOLS}
    assert not {n for n in tools_v3.NOUNS if any(n in d for d in heldout_v2.HELD_OUT_DOMAINS)}


def test_scoring_counts_a_wrong_call_and_a_call_where_none_was_needed():
    tasks = heldout_v2.tasks()
    single = next(t for t in tasks if t.kind == "single")
    none = next(t for t in tasks if t.kind == "no_tool")
    call = single.turns[0][0]
    right = evaluate.Reply("", [(call.tool.name, call.arguments)])
    wrong = evaluate.Reply("", [(call.tool.name, {**call.arguments, "extra": 1})])
    quote = evaluate.Reply(" ".join(single.answer_keys), [])
    episodes = [evaluate.Episode(0, single, list(single.tools), [], [right, quote]),
                evaluate.Episode(1, single, list(single.tools), [], [wrong, quote]),
                evaluate.Episode(2, none, list(none.tools), [], [right, evaluate.Reply("hi", [])]),
                evaluate.Episode(3, none, list(none.tools), [], [evaluate.Reply("hi", [])])]
    result = evaluate.score(episodes, any_order=True)
    assert (result.tool_call_ok, result.answer_ok, result.tool_name_ok) == (2, 3, 3)


def test_parallel_calls_match_in_any_order():
    task = next(t for t in heldout_v2.tasks() if t.kind == "parallel")
    calls = [(c.tool.name, c.arguments) for c in task.turns[0]]
    assert evaluate.calls_match_any_order(calls[::-1], task.turns[0])
    assert not evaluate.calls_match_any_order(calls[:1], task.turns[0])


def test_an_optional_argument_at_its_default_is_the_same_call():
    tasks = heldout_v2.tasks()
    plain = next(t for t in tasks if t.question.startswith("Find me a flight from LIS to AMS"))
    business = next(t for t in tasks if t.question.startswith("Cheapest business class seat"))
    call, asked = plain.turns[0][0], business.turns[0][0]
    assert "cabin" not in call.arguments and asked.arguments["cabin"] == "business"
    match = lambda args, e: evaluate.calls_match([(e.tool.name, args)], (e,))
    assert match({**call.arguments, "cabin": "economy", "nonstop_only": False}, call)
    assert not match({**call.arguments, "cabin": "business"}, call)
    assert not match({k: v for k, v in asked.arguments.items() if k != "cabin"}, asked)
    assert not match({**call.arguments, "seat": "aisle"}, call)
    parcels = next(t for t in tasks if t.question.startswith("Track parcels AB123 and CD456"))
    first, second = parcels.turns[0]
    calls = [(second.tool.name, {**second.arguments, "carrier": "ups"}), (first.tool.name, first.arguments)]
    assert evaluate.calls_match_any_order(calls, parcels.turns[0])
    assert not evaluate.calls_match_any_order(calls + calls[:1], parcels.turns[0])


def test_perturbed_calls_change_one_thing_to_words_training_never_uses():
    posed = perturb.cases(6)
    by_kind = {kind: [c for c in posed if c.kind == kind] for kind in perturb.KINDS}
    assert all(len(cs) == 6 for cs in by_kind.values())
    unseen = perturb.UNSEEN_VALUES + perturb.UNSEEN_TOOL_NAMES + perturb.UNSEEN_ARG_NAMES
    training = "\n".join(template.render(make(0, i).messages, make(0, i).tools)
                         for i in range(400) for make in TRAINING_CORPORA)
    assert not [w for w in unseen if w in training]
    for base, values, renamed, args in zip(*by_kind.values()):
        question = values.messages[-1]["content"]
        assert values.arguments != base.arguments and values.name == base.name
        assert all(v in question for v in values.arguments.values() if isinstance(v, str))
        assert renamed.name in perturb.UNSEEN_TOOL_NAMES and renamed.arguments == base.arguments
        names = lambda case: {t["function"]["name"] for t in case.tools}
        assert names(renamed) - names(base) == {renamed.name}
        assert list(args.arguments.values()) == list(base.arguments.values()) and set(args.arguments) <= set(
            perturb.UNSEEN_ARG_NAMES)
        for case in (base, values, renamed, args):
            schema = next(t for t in case.tools if t["function"]["name"] == case.name)["function"]["parameters"]
            jsonschema.validate(case.arguments, schema)


def test_perturbed_scoring_counts_first_turns():
    class Echo:
        """Calls what each case expects, except a wrong value on renamed tools."""
        def respond(self, batch):
            expected = {f"perturb-{i}": c for i, c in enumerate(perturb.cases(3))}
            return [evaluate.Reply("", [(c.name, c.arguments if c.kind != "tool_name" else
                                         {k: f"{v}!" for k, v in c.arguments.items()})])
                    for c in (expected[key] for key, _, _ in batch)]
    result = perturb.evaluate(Echo(), 3)
    assert result["original"] == result["values"] == result["arg_names"] == {"n": 3, "tool_ok": 3, "call_ok": 3}
    assert result["tool_name"] == {"n": 3, "tool_ok": 3, "call_ok": 0}


def test_v2_corpus_smoke():
    """Natural tools, 1-8 a prompt, parallel calls and follow-ups, arguments that validate and
    values the question states; seeded; the template renders every conversation."""
    counts = {"parallel": 0, "follow_up": 0, "no_tool": 0, "v1": 0}
    sizes = set()
    for i in range(300):
        c = corpus_v2.conversation(0, i)
        assert c.messages == corpus_v2.conversation(0, i).messages
        template.render_with_spans(c.messages, c.tools)
        if not c.tools or not isinstance(c.tool_objects[0], tools_v2.NaturalTool):   # run 3's, mixed in
            counts["v1"] += 1
            continue
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in c.tools}
        sizes.add(len(schemas))
        user = ""
        for m in c.messages:
            if m["role"] == "user":
                user = m["content"]
                counts["follow_up"] += user.startswith(("And ", "What about", "Now ", "Same with"))
            if m["role"] == "assistant" and m.get("tool_calls"):
                counts["parallel"] += len(m["tool_calls"]) > 1
                for call in m["tool_calls"]:
                    fn = call["function"]
                    jsonschema.validate(fn["arguments"], schemas[fn["name"]])
                    for value in fn["arguments"].values():
                        if isinstance(value, str):
                            assert value in user or user.startswith(("And ", "What about", "Now ", "Same")), user
            if m["role"] == "assistant" and not m.get("tool_calls") and m["content"] in dict(corpus_v2.NO_TOOL).values():
                counts["no_tool"] += 1
    assert all(counts.values()), counts
    assert min(sizes) == 1 and max(sizes) == 8
    assert corpus_v2.conversation(1, 5).messages != corpus_v2.conversation(0, 5).messages


def test_train_shape_v2_fits_the_budget():
    from hibana_core.demo.train import SHAPES

    s = SHAPES["v2"]
    per_layer = 2 * s.hidden * s.heads * s.head_dim + 2 * s.hidden * s.kv_heads * s.head_dim + 3 * s.hidden * s.intermediate
    params = s.layers * per_layer + s.vocab * s.hidden
    assert params * 2 <= 40_000_000
