"""Corpus v4 (issue 15): tools chosen by reading them, arguments filled with what the question means.

Conversation `i` of seed `s` is drawn from `random.Random(f"v4:{s}:{i}")`:

    V3_SHARE of them: corpus v3's conversation (which keeps run 3's share), so copying stays
    the others: an optional system prompt, 1-8 tools of tools_v4 (of those after the first
    are siblings of an earlier one (60%): same noun or same verb), then 1-3 exchanges, each one of
        single       a question -> one call -> its result -> an answer quoting it
        parallel     two calls in one turn: one lookup for two things, or two questions
        follow_up    "What about X?" after a call: the same tool, one stated value changed
        clarify      a request missing a required value -> the assistant asks for it -> the call
        failed       the tool answers with an error -> the assistant says so
        no_tool      generated: greetings, thanks, "just say X", what the tools can do,
                     hand-offs ("Agent X is now handling the request"), never-minds

Questions are composed from parts (a lead, the core with the verb and noun in any of their words,
each stated slot's phrase in any order, a tail), so no template identifies a tool.
"""

from __future__ import annotations

import json
import random

from hibana_core.demo import corpus_v3
from hibana_core.demo.corpus_v2 import exchange_messages
from hibana_core.demo.corpus import SYSTEM_PROMPTS, Conversation
from hibana_core.demo.tools_v3 import person, pseudo_word, title
from hibana_core.demo.tools_v4 import OpenTool, open_tool, sibling

V3_SHARE = 0.2
MAX_TOOLS = 8
ASK_LEADS = ("", "", "", "", "Quick question: ", "Hey, ", "Tell me, ", "Hi! ", "Question - ")
DO_LEADS = ("", "", "", "Please ", "Could you ", "Can you ", "Hey, ", "I need you to ", "Would you ")
TAILS = ("", "", "", "", " Thanks!", " Thank you.", " Please.", " Cheers.")


def _tools(rng: random.Random) -> list[OpenTool]:
    n = rng.choices(range(1, MAX_TOOLS + 1), weights=(3, 4, 4, 3, 2, 2, 1, 1))[0]
    tools: list[OpenTool] = []
    while len(tools) < n:
        tool = sibling(rng, rng.choice(tools)) if tools and rng.random() < 0.6 else open_tool(rng)
        if distinct(tool, tools):
            tools.append(tool)
    rng.shuffle(tools)
    return tools


def distinct(tool: OpenTool, tools: list[OpenTool]) -> bool:
    """Neither the name nor what it does is already offered."""
    return all(tool.name != t.name and tool.meaning != t.meaning for t in tools)


def _sentence(rng: random.Random, core: str, phrases: list[str], lead: bool = True) -> str:
    question = core.endswith("?")
    text = " ".join([core.rstrip("?")] + phrases)
    asking = core.split(" ", 1)[0] in ("what", "what's", "who", "how", "when", "where", "which", "I")
    lead = rng.choice(ASK_LEADS if asking else DO_LEADS) if lead else ""
    if lead in ("Could you ", "Can you ", "Would you "):
        question = True
    text = lead + text if lead else text[0].upper() + text[1:]
    return text + ("?" if question else rng.choice((".", ".", "", "!"))) + rng.choice(TAILS)


def ask(rng: random.Random, tool: OpenTool, leave_out: int | None = None, lead: bool = True
        ) -> tuple[str, dict, dict[int, str]]:
    """A question for `tool`: its text, the call's arguments (schema order), the said words of each
    stated slot (by index). `leave_out`: a slot not stated (a clarification asks for it); `lead`:
    whether it may open with "Hey, " or "Could you " (not the second question of a message)."""
    core = rng.choice(tool.cores)
    arguments, said = {}, {}
    phrases = []
    for i, slot in enumerate(tool.slots):
        if i == leave_out or not (slot.required or rng.random() < 0.5):
            continue
        values, words = slot.gen(rng)
        arguments |= values
        said[i] = words
        if "{s}" in core and i == 0:
            core = core.replace("{s}", words)
        else:
            phrases.append(rng.choice(slot.forms).format(words))
    rng.shuffle(phrases)
    order = list(tool.schema["function"]["parameters"]["properties"])
    return _sentence(rng, core, phrases, lead), {k: arguments[k] for k in order if k in arguments}, said


def _answer(rng: random.Random, tool: OpenTool, arguments: dict, result: dict, said: dict[int, str]) -> str:
    if "error" in result:
        return rng.choice(("Sorry, that didn't work: {e}.", "The tool returned an error: {e}.",
                           "I couldn't do that - {e}.")).format(e=result["error"].rstrip("."))
    if tool.kind == "compose":
        return " ".join(str(v) for v in arguments.values())
    thing = said.get(0, "")
    values = dict(result)
    if tool.kind == "lookup":
        key = tool.keys[0]
        value, attribute = values.pop(key), key.replace("_", " ")
        main = rng.choice((f"The {attribute} of {thing} is {value}", f"{thing}'s {attribute}: {value}",
                           f"It's {value}", f"The {attribute} is {value}")) if thing else f"{value}"
    else:
        status, reference = values.pop("status"), values.pop("reference")
        main = rng.choice((f"Status {status} - reference {reference}", f"All set ({status}). The reference is "
                           f"{reference}", f"It's {status}: {reference}", f"I've done that: {status}, "
                           f"reference {reference}"))
    if not values:
        return main + "."
    rest = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in values.items())
    return rng.choice((f"{main} ({rest}).", f"{main}; {rest}.", f"{main}. Also: {rest}."))


def _exchange(rng: random.Random, question: str, calls: list[tuple[OpenTool, dict, dict]],
              fail: bool = False) -> list[dict]:
    results = []
    for tool, arguments, _ in calls:
        result = tool.result(arguments)
        if fail:
            thing = next(iter(arguments.values()), tool.noun[0])
            result = {"error": rng.choice((f"{tool.noun[0]} '{thing}' not found", "permission denied",
                                           "service unavailable, try again later",
                                           f"invalid {next(iter(arguments), 'input')}"))}
        results.append(result)
    answer = " ".join(_answer(rng, t, a, r, s) for (t, a, s), r in zip(calls, results))
    return exchange_messages(question, [(t.name, a) for t, a, _ in calls],
                             [json.dumps(r, ensure_ascii=False) for r in results], answer)


def no_tool(rng: random.Random, tools: list[OpenTool]) -> tuple[str, str]:
    """A user turn that needs no tool, and its answer."""
    r = rng.random()
    if r < 0.25:
        return rng.choice((("Hi!", "Hello! How can I help?"), ("Hello there.", "Hi! What can I do for you?"),
                           ("Good evening!", "Good evening! How can I help?"), ("Thanks a lot!", "You're welcome!"),
                           ("Thank you, that's all.", "Glad I could help."), ("Great, cheers.", "Any time!"),
                           ("Bye for now.", "Goodbye!"), ("How are you today?", "I'm fine, thanks. What do you need?"),
                           ("Who are you?", "I'm a small assistant that can call the tools I was given."),
                           ("Are you a person?", "No, I'm a small language model with tools.")))
    if r < 0.45:
        word = rng.choice((pseudo_word(rng), title(rng), "OK", "yes", "ready", person(rng)))
        return rng.choice(((f"Just say {word}.", f"{word}"), (f"Reply with the word {word} and nothing else.", word),
                           (f"Repeat after me: {word}", word), (f"Answer with {word} only.", word)))
    if r < 0.6 and tools:
        shown = tools[:3]
        listing = "; ".join(f"{t.name} ({t.schema['function']['description'].rstrip('.')})" for t in shown)
        return (rng.choice(("What can you do?", "Which tools do you have?", "What are you able to help with?")),
                f"I can use these tools: {listing}." + (" And a few more." if len(tools) > 3 else ""))
    if r < 0.8:
        agent = rng.choice((pseudo_word(rng, 1, 2, False), "assistant", "helper", "research"))
        return (rng.choice(("Please continue.", "You are now in charge of this conversation.",
                            f"Agent {agent} is now handling the request. Please continue with the current request.",
                            "Go on.", "Carry on from where we were.")),
                rng.choice(("Understood. What would you like me to do next?", "Okay - how can I help?",
                            "Sure. What should I do?")))
    return rng.choice((("Forget about it, I'll sort it out myself.", "No problem."), ("Forget it.", "Okay."),
                       ("No need to look anything up, I was just thinking out loud.", "Sure, just let me know."),
                       ("Hold on, I'll come back to this later.", "Of course. I'm here when you need me.")))


def _follow_up(rng: random.Random, last: tuple[OpenTool, dict, dict[int, str]]) -> tuple[str, dict, dict] | None:
    tool, arguments, said = last
    changeable = [i for i in said if tool.kind != "compose" and not (
        len(tool.slots[i].params) == 1 and next(iter(tool.slots[i].params.values()))["type"] == "boolean")]
    if not changeable:
        return None
    i = rng.choice(changeable)
    values, words = tool.slots[i].gen(rng)
    if all(arguments.get(k) == v for k, v in values.items()):
        return None
    form = "{}" if i == 0 else rng.choice(tool.slots[i].forms)
    question = rng.choice(("And for {x}?", "What about {x}?", "How about {x}?", "Do the same for {x}.",
                           "Now {p}.", "Same again {p}, please.", "And {p}?", "Try {x} instead."))
    question = question.format(x=words, p=form.format(words))
    return question, arguments | values, said | {i: words}


def make_conversation(rng: random.Random) -> Conversation:
    system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.4 else []
    tools = _tools(rng)
    messages, last = list(system), None
    for _ in range(rng.choices((1, 2, 3), weights=(5, 3, 2))[0]):
        r = rng.random()
        tool = rng.choice(tools)
        if r < 0.12:
            question, answer = no_tool(rng, tools)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        elif r < 0.25 and last is not None and (step := _follow_up(rng, last)):
            question, arguments, said = step
            messages += _exchange(rng, question, [(last[0], arguments, said)])
            last = (last[0], arguments, said)
        elif r < 0.37:
            if tool.kind == "lookup" and rng.random() < 0.5:             # one lookup for two things
                q, a1, s1 = ask(rng, tool)
                if 0 not in s1:
                    continue
                other = tool.slots[0].gen(rng)[1]
                question = q.replace(s1[0], f"{s1[0]} and {other}", 1)
                a2 = a1 | {next(iter(tool.slots[0].params)): other}
                calls = [(tool, a1, s1), (tool, a2, s1 | {0: other})]
            else:
                second = rng.choice(tools)
                qa, aa, sa = ask(rng, tool)
                qb, ab, sb = ask(rng, second, lead=False)
                if (tool, aa) == (second, ab):
                    continue
                question = f"{qa} {rng.choice(('Also', 'And', 'Then'))}, {qb[0].lower() + qb[1:]}"
                calls = [(tool, aa, sa), (second, ab, sb)]
            messages += _exchange(rng, question, calls)
        elif r < 0.42 and (needed := [i for i, s in enumerate(tool.slots) if s.required and i and s.forms != ("{}",)]):
            i = rng.choice(needed)
            question, arguments, said = ask(rng, tool, leave_out=i)
            values, words = tool.slots[i].gen(rng)
            what = " and ".join(k.replace("_", " ") for k in tool.slots[i].params)
            messages += [{"role": "user", "content": question},
                         {"role": "assistant", "content": rng.choice((f"Sure - what {what} should I use?",
                                                                      f"Which {what}?", f"I need the {what} first."))}]
            arguments = {k: (arguments | values)[k] for k in tool.schema["function"]["parameters"]["properties"]
                         if k in arguments or k in values}
            reply = rng.choice(("{}", "{}.", "Use {}.", rng.choice(tool.slots[i].forms).format("{}")))
            messages += _exchange(rng, reply.format(words), [(tool, arguments, said | {i: words})])
            last = (tool, arguments, said | {i: words})
        else:
            question, arguments, said = ask(rng, tool)
            fail = tool.kind != "compose" and rng.random() < 0.05
            messages += _exchange(rng, question, [(tool, arguments, said)], fail=fail)
            last = None if fail else (tool, arguments, said)
    if len(messages) == len(system):
        question, arguments, said = ask(rng, tools[0])
        messages += _exchange(rng, question, [(tools[0], arguments, said)])
    return Conversation(messages, [t.schema for t in tools], tool_objects=tools)


def conversation(seed: int | str, index: int) -> Conversation:
    """Conversation `index` of corpus v4."""
    rng = random.Random(f"v4:{seed}:{index}")
    if rng.random() < V3_SHARE:
        return corpus_v3.conversation(seed, index)
    return make_conversation(rng)
