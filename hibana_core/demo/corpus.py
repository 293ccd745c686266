"""Synthetic conversations: tools with random names, tasks solved through tool calls, chit-chat.

Conversation `i` of a corpus with seed `s` is drawn from `random.Random(f"{s}:{i}")`, so a corpus
is the same whatever the number of worker processes that build it.

    system (optional) + tools: the task's tools and 0-4 distractors, shuffled (at most 7)
    then 1-3 tasks, each: [chit-chat] user question -> assistant <tool_call>(s) -> tool result(s)
                                      [-> a chained call -> its result] -> answer quoting the result
    or (10%): plain chat without tools

Since run 3 the generator carries a side stream (world.with_extra): 15% of the tasks are of the
new kinds (values in call syntax, generic tools, customers with non-ASCII names), some values are
non-ASCII, some schemas take LangChain's shapes, and a fifth of the tool sets get a generic tool as
a distractor. All of it is drawn from the side stream, so every other task is what run 2 saw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hibana_core.demo import tasks as T, world
from hibana_core.demo.tools import BASE_FAMILIES, EXTRA_FAMILIES, Tool, make_tool

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are an agent. Use the tools to answer.",
                  "Answer the user's questions. Call a tool when it helps.", "You are a concise assistant with tools.",
                  "Use the available functions to help the user. Quote tool results exactly.")
GREETINGS = (("Hi!", "Hello! How can I help you today?"), ("Hello", "Hi! What can I do for you?"),
             ("Hey there", "Hey! How can I help?"), ("Good morning!", "Good morning! How can I help you?"),
             ("Thanks!", "You're welcome!"), ("Thank you very much.", "You're welcome! Anything else?"),
             ("Great, thanks.", "Glad I could help."), ("Bye!", "Goodbye!"),
             ("Who are you?", "I am a small demo assistant trained for Hibana."),
             ("Are you a robot?", "I am a small language model that can call tools."))
REPEAT_PHRASES = ("the quick brown fox", "ship it on friday", "hello world", "tools make agents useful",
                  "keep the cache warm", "blue harbor clock", "seven silent rivers")


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None
    tasks: list[T.Task] = field(default_factory=list)
    tool_objects: list[Tool] = field(default_factory=list)


def _chit_chat(rng: random.Random, tools: list[Tool]) -> tuple[str, str]:
    r = rng.random()
    if r < 0.15:
        phrase = rng.choice(REPEAT_PHRASES) if rng.random() < 0.5 else " ".join(
            rng.choice(world.NOTE_WORDS) for _ in range(rng.randint(2, 5)))
        return f"Repeat after me: {phrase}", phrase
    if r < 0.3:
        if tools:
            return "What can you do?", "I can use these tools: " + ", ".join(t.name for t in tools) + "."
        return "What can you do?", "I can chat with you and answer simple questions."
    return rng.choice(GREETINGS)


class ToolBox:
    """This conversation's tools, one per family, made on first use."""

    def __init__(self, rng: random.Random, held_out: bool) -> None:
        self.rng, self.held_out = rng, held_out
        self.by_family: dict[str, Tool] = {}
        self._taken: set[str] = set()
        self._late: list[str] = []          # distractors drawn on the side stream

    def __call__(self, family: str) -> Tool:
        if family not in self.by_family:
            self.by_family[family] = make_tool(self.rng, family, self.held_out, self._taken)
        return self.by_family[family]

    def add_distractors(self, count: int, limit: int = 7) -> None:
        others = [f for f in BASE_FAMILIES if f not in self.by_family]
        self.rng.shuffle(others)
        for family in others:
            if count <= 0 or len(self.by_family) >= limit:
                break
            if not T.conflicts(family, set(self.by_family)):
                self(family)
                count -= 1
        side = world.extra(self.rng)
        if side is not None and side.random() < 0.2 and len(self.by_family) < limit:
            family = side.choice([f for f in EXTRA_FAMILIES if f not in self.by_family])
            self.by_family[family] = make_tool(side, family, self.held_out, self._taken)
            self._late.append(family)

    def tools(self) -> list[Tool]:
        tools = [t for f, t in self.by_family.items() if f not in self._late]
        self.rng.shuffle(tools)
        side = world.extra(self.rng)
        for family in self._late:
            tools.insert(side.randint(0, len(tools)), self.by_family[family])
        return tools


def pick_kinds(rng: random.Random, n: int) -> list[str]:
    kinds: list[str] = []
    while len(kinds) < n:
        kind = T.sample_kind(rng)
        if not T.kind_conflicts(kind, kinds):
            kinds.append(kind)
    return kinds


def task_messages(task: T.Task) -> list[dict]:
    messages: list[dict] = [{"role": "user", "content": task.question}]
    for turn in task.turns:
        messages.append({"role": "assistant", "content": "", "tool_calls": [c.message() for c in turn]})
        messages.extend({"role": "tool", "name": c.tool.name, "content": c.result} for c in turn)
    messages.append({"role": "assistant", "content": task.answer})
    return messages


def make_conversation(rng: random.Random, held_out: bool = False) -> Conversation:
    system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
    if rng.random() < 0.1:
        messages = list(system)
        for _ in range(rng.randint(1, 3)):
            question, answer = _chit_chat(rng, [])
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return Conversation(messages, None)
    box = ToolBox(rng, held_out)
    n = rng.choices((1, 2, 3), weights=(6, 3, 1))[0]
    task_list = [T.make_task(rng, kind, box) for kind in pick_kinds(rng, n)]
    box.add_distractors(rng.randint(0, 4))
    tools = box.tools()
    messages = list(system)
    for task in task_list:
        if rng.random() < 0.12:
            question, answer = _chit_chat(rng, tools)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        messages += task_messages(task)
    return Conversation(messages, [t.schema for t in tools], task_list, tools)


def _generator(key: str, extended: bool) -> random.Random:
    return world.with_extra(key) if extended else random.Random(key)


def conversation(seed: int | str, index: int, held_out: bool = False, extended: bool = True) -> Conversation:
    """Conversation `index` of the training corpus; `extended=False` gives run 2's corpus exactly."""
    return make_conversation(_generator(f"{seed}:{index}", extended), held_out)


def single_task(seed: int | str, index: int, held_out: bool = True, extended: bool = False) -> Conversation:
    """One task in a fresh conversation: what the held-out evaluation poses. By default the task
    set of runs 1 and 2 (the benchmark the committed weights were measured on); `extended=True`
    draws the side stream too (run 3's kinds, non-ASCII values, LangChain-shaped schemas)."""
    rng = _generator(f"task:{seed}:{index}", extended)
    system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.5 else []
    box = ToolBox(rng, held_out)
    task = T.make_task(rng, T.sample_kind(rng), box)
    box.add_distractors(rng.randint(0, 3))
    tools = box.tools()
    return Conversation(system + [{"role": "user", "content": task.question}], [t.schema for t in tools], [task], tools)
