"""Corpus v2 (issue 15): conversations with natural tools (tools_v2.py), mixed with run 3's corpus.

Conversation `i` of seed `s` is drawn from `random.Random(f"v2:{s}:{i}")`, as in corpus.py:

    V1_SHARE of them: run 3's conversation (corpus.conversation), so the old skills stay
    the others: system (optional) + 1-8 natural tools (hand-written specs and, PROCEDURAL_SHARE of
    them, procedural ones: tools_v2.procedural_spec), then 1-3
    exchanges, each one of
        single      a question -> one call -> its result -> an answer quoting it
        parallel    two questions in one message -> two calls in one turn -> an answer quoting both
        follow_up   "And for X?" after a call: the same tool, one value changed
        no_tool     chit-chat or an explicit no-lookup request, answered without a call
"""

from __future__ import annotations

import json
import random
import string
from typing import Callable

from hibana_core.demo import corpus
from hibana_core.demo.corpus import SYSTEM_PROMPTS, Conversation
from hibana_core.demo.tools_v2 import SPECS, NaturalTool, make_tool, procedural_spec

V1_SHARE = 0.3
PROCEDURAL_SHARE = 0.35
MAX_TOOLS = 8
ANSWERS = ("{vals}.", "Done - {vals}.", "Here it is: {vals}.", "The result: {vals}.", "It says {vals}.",
           "Sure! {vals}.", "I checked: {vals}.")
NO_TOOL = (("Thanks, that's all.", "You're welcome!"), ("No need to look anything up, just saying hi.", "Hi there!"),
           ("What can you help me with?", "I can use the tools I was given to look things up or take actions."),
           ("Never mind.", "No problem."), ("Ok, bye!", "Goodbye!"), ("Tell me a joke.",
            "Why did the function return early? It had no arguments."), ("Just say OK.", "OK."),
           ("How are you?", "I'm fine, thanks! What can I do for you?"))


def _fields(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f]


def _ask(rng: random.Random, tool: NaturalTool) -> tuple[str, dict, dict]:
    """A question for `tool`: its text, the call's arguments, the role values."""
    spec = tool.spec
    template = rng.choice(spec.questions)
    values, said = {}, {}
    for role in _fields(template):
        values[role], said[role] = spec.args[role].gen(rng)
    question = template.format(**said)
    if rng.random() < 0.3 and not template.startswith("{"):      # never lower-case a value ("Z158")
        question = question[0].lower() + question[1:]
    arguments = {tool.arg_of[r]: values[r] for r in spec.args if r in values}   # schema order
    return question, arguments, values


def _answer(rng: random.Random, results: list[dict], keys: list[tuple[str, ...]]) -> str:
    vals = "; ".join(", ".join(f"{k.replace('_', ' ')} {r[k]}" for k in ks) for r, ks in zip(results, keys))
    return rng.choice(ANSWERS).format(vals=vals)


def exchange_messages(question: str, calls: list[tuple[str, dict]], results: list[str], answer: str) -> list[dict]:
    """One exchange: the question, its calls (name, arguments) in one assistant turn, each call's
    result (JSON text), the answer (corpus v4's exchanges too)."""
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": a}} for name, a in calls]},
            *({"role": "tool", "name": name, "content": r} for (name, _), r in zip(calls, results)),
            {"role": "assistant", "content": answer}]


def _exchange(rng: random.Random, calls: list[tuple[NaturalTool, dict]], question: str) -> list[dict]:
    results = [tool(args) for tool, args in calls]
    answer = _answer(rng, [json.loads(r) for r in results], [t.spec.keys for t, _ in calls])
    return exchange_messages(question, [(t.name, a) for t, a in calls], results, answer)


def _tools(rng: random.Random) -> list[NaturalTool]:
    """1-8 tools of distinct specs whose names do not clash; PROCEDURAL_SHARE of them procedural."""
    n = rng.choices(range(1, MAX_TOOLS + 1), weights=(3, 4, 4, 3, 2, 2, 1, 1))[0]
    specs = [procedural_spec(rng) if rng.random() < PROCEDURAL_SHARE else None for _ in range(n)]
    fixed = iter(rng.sample(SPECS, sum(s is None for s in specs)))
    specs = [s if s is not None else next(fixed) for s in specs]
    out, names = [], set()
    for spec in specs:
        tool = make_tool(rng, spec)
        if tool.name not in names:
            out.append(tool)
            names.add(tool.name)
    return out


def make_conversation(rng: random.Random, choose_tools: Callable[[random.Random], list[NaturalTool]] = _tools
                      ) -> Conversation:
    """A conversation over the tools `choose_tools` draws (corpus v3 passes its open ones)."""
    system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
    tools = choose_tools(rng)
    messages, last = list(system), None
    for _ in range(rng.choices((1, 2, 3), weights=(5, 3, 2))[0]):
        r = rng.random()
        if r < 0.1:
            question, answer = rng.choice(NO_TOOL)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        elif r < 0.3 and last is not None:
            tool, arguments, values = last
            movable = [role for role in values if tool.spec.args[role].type != "boolean"]
            if movable:
                role = rng.choice(movable)
                value, text = tool.spec.args[role].gen(rng)
                if value != values[role]:
                    arguments = arguments | {tool.arg_of[role]: value}
                    values = values | {role: value}
                    question = rng.choice(("And for {x}?", "What about {x}?", "Now {x}.", "Same with {x}, please.",
                                           "And {x}?"))
                    messages += _exchange(rng, [(tool, arguments)], question.format(x=text))
                    last = (tool, arguments, values)
        elif r < 0.45 and len(tools) >= 1:
            a, b = rng.choice(tools), rng.choice(tools)
            qa, args_a, _ = _ask(rng, a)
            qb, args_b, _ = _ask(rng, b)
            qb = qb if qb[:2].isupper() or any(str(v).startswith(qb.split()[0]) for v in args_b.values()) \
                else qb[0].lower() + qb[1:]
            if args_a != args_b or a is not b:
                qa = qa if qa[-1] in ".?!" else qa + rng.choice((".", "?", ";"))
                messages += _exchange(rng, [(a, args_a), (b, args_b)], f"{qa} {rng.choice(('Also', 'And'))}, "
                                      f"{qb}")
        else:
            tool = rng.choice(tools)
            question, arguments, values = _ask(rng, tool)
            messages += _exchange(rng, [(tool, arguments)], question)
            last = (tool, arguments, values)
    if len(messages) == len(system):                   # every draw fell through: one plain question
        tool = rng.choice(tools)
        question, arguments, _ = _ask(rng, tool)
        messages += _exchange(rng, [(tool, arguments)], question)
    return Conversation(messages, [t.schema for t in tools], tool_objects=tools)


def conversation(seed: int | str, index: int) -> Conversation:
    """Conversation `index` of corpus v2."""
    rng = random.Random(f"v2:{seed}:{index}")
    if rng.random() < V1_SHARE:
        return corpus.conversation(seed, index)
    return make_conversation(rng)
