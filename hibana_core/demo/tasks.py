"""Tasks: a user question, the tool calls that solve it, and the answer that quotes the results.

Each maker takes a random generator and `tool(family)`, which returns this conversation's tool of
that family (created on first use). Calls run the real tool, so a chained call's arguments come
from the previous result exactly as they would in `hibana demo`. Values appear in the question in
the order of the tool's arguments.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

from hibana_core.demo import world
from hibana_core.demo.tools import CONVERSIONS, Tool


@dataclass(frozen=True)
class Call:
    tool: Tool
    arguments: dict
    result: str               # what the tool returned

    def message(self) -> dict:
        return {"type": "function", "function": {"name": self.tool.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Task:
    kind: str
    question: str
    turns: tuple[tuple[Call, ...], ...]   # assistant turns of tool calls, in order
    answer: str                           # the final assistant message
    answer_keys: tuple[str, ...]          # what the final answer must contain


GetTool = Callable[[str], Tool]


def call(tool: Tool, *values) -> Call:
    arguments = dict(zip(tool.arg_names, values))
    return Call(tool, arguments, tool(arguments))


def _result(c: Call) -> dict:
    return json.loads(c.result)


def _number(rng: random.Random, decimals: float = 0.15) -> int | float:
    if rng.random() < decimals:
        return round(rng.uniform(0, 500), rng.choice((1, 2)))
    return rng.choice((rng.randint(0, 20), rng.randint(0, 999), rng.randint(100, 99999), -rng.randint(1, 99)))


_OP_WORDS = {"add": ("plus", "+"), "subtract": ("minus", "-"), "multiply": ("times", "*"),
             "divide": ("divided by", "/")}
_OP_QUESTIONS = {
    "add": ("What is {a} plus {b}?", "Add {a} and {b}.", "What's {a} + {b}?", "Compute the sum of {a} and {b}.",
            "How much is {a} plus {b}?"),
    "subtract": ("What is {a} minus {b}?", "Compute {a} - {b}.", "How much is {a} minus {b}?",
                 "What's the difference between {a} and {b}?"),
    "multiply": ("What is {a} times {b}?", "Multiply {a} by {b}.", "What's {a} * {b}?",
                 "Compute the product of {a} and {b}."),
    "divide": ("What is {a} divided by {b}?", "Divide {a} by {b}.", "What's {a} / {b}?", "How much is {a} over {b}?"),
}


def arithmetic(rng: random.Random, tool: GetTool) -> Task:
    op = rng.choice(tuple(_OP_QUESTIONS))
    a, b = _number(rng), _number(rng)
    if op == "divide" and b == 0:
        b = rng.randint(1, 50)
    c = call(tool(op), a, b)
    r = _result(c)["result"]
    word, sym = _OP_WORDS[op]
    answer = rng.choice((f"{a} {word} {b} is {r}.", f"The answer is {r}.", f"The result is {r}.",
                         f"{a} {sym} {b} = {r}"))
    return Task(op, rng.choice(_OP_QUESTIONS[op]).format(a=a, b=b), ((c,),), answer, (str(r),))


def expression(rng: random.Random, tool: GetTool) -> Task:
    a, b, c = (rng.randint(1, 99) for _ in range(3))
    expr = rng.choice(("({a} + {b}) * {c}", "{a} * {b} - {c}", "{a} / ({b} + {c})", "{a} - {b} + {c}",
                       "({a} - {b}) / {c}", "{a} * ({b} + {c})")).format(a=a, b=b, c=c)
    q = rng.choice(("Calculate {e}.", "What is {e}?", "Evaluate {e}.", "Please compute {e}.")).format(e=expr)
    k = call(tool("calc"), expr)
    r = _result(k)["result"]
    return Task("calc", q, ((k,),), rng.choice((f"{expr} = {r}", f"The result is {r}.")), (str(r),))


def arithmetic_chain(rng: random.Random, tool: GetTool) -> Task:
    first, second = rng.choice((("add", "multiply"), ("multiply", "subtract"), ("subtract", "divide"), ("add", "add")))
    a, b, c = rng.randint(1, 200), rng.randint(1, 200), rng.randint(1, 30)
    q = f"{_OP_QUESTIONS[first][0].format(a=a, b=b)[:-1]}, then {_OP_WORDS[second][0]} {c}?"
    if rng.random() < 0.5:
        q = f"Take {a} {_OP_WORDS[first][0]} {b}, and then {_OP_WORDS[second][0]} {c}. What do you get?"
    k1 = call(tool(first), a, b)
    k2 = call(tool(second), _result(k1)["result"], c)
    r = _result(k2)["result"]
    return Task("chain_arith", q, ((k1,), (k2,)), f"The result is {r}.", (str(r),))


def weather(rng: random.Random, tool: GetTool) -> Task:
    city = rng.choice(world.CITIES)
    q = rng.choice(("What's the weather in {c}?", "How is the weather in {c} today?", "Is it cold in {c} right now?",
                    "Tell me the weather for {c}.", "Weather in {c}?")).format(c=city)
    k = call(tool("weather"), city)
    w = _result(k)
    t, cond = w["temperature"], w["condition"]
    answer = rng.choice((f"It is {t} degrees and {cond} in {city}.", f"In {city} it's {cond}, {t} degrees."))
    return Task("weather", q, ((k,),), answer, (str(t), cond))


def parallel_weather(rng: random.Random, tool: GetTool) -> Task:
    c1, c2 = rng.sample(world.CITIES, 2)
    q = rng.choice(("What's the weather in {a} and in {b}?", "Compare the weather in {a} and {b}.")).format(a=c1, b=c2)
    k1, k2 = call(tool("weather"), c1), call(tool("weather"), c2)
    w1, w2 = _result(k1), _result(k2)
    answer = (f"In {c1} it is {w1['temperature']} degrees and {w1['condition']}; "
              f"in {c2} it is {w2['temperature']} degrees and {w2['condition']}.")
    return Task("parallel_weather", q, ((k1, k2),), answer, (str(w1["temperature"]), str(w2["temperature"])))


def stock(rng: random.Random, tool: GetTool) -> Task:
    sym = world.ticker(rng)
    q = rng.choice(("What is the stock price of {s}?", "How much is {s} trading at?", "Get me a quote for {s}.",
                    "Price of {s} shares?")).format(s=sym)
    k = call(tool("stock"), sym)
    p = _result(k)["price"]
    answer = rng.choice((f"{sym} is trading at {p}.", f"One share of {sym} costs {p}."))
    return Task("stock", q, ((k,),), answer, (str(p),))


def email(rng: random.Random, tool: GetTool) -> Task:
    name = world.person(rng)
    q = rng.choice(("What is {n}'s email address?", "How can I email {n}?", "Find the email of {n}.",
                    "I need the email address of {n}.")).format(n=name)
    k = call(tool("email"), name)
    e = _result(k)["email"]
    answer = rng.choice((f"{name}'s email address is {e}.", f"You can reach {name} at {e}."))
    return Task("email", q, ((k,),), answer, (e,))


def population(rng: random.Random, tool: GetTool) -> Task:
    city = rng.choice(world.CITIES)
    q = rng.choice(("How many people live in {c}?", "What is the population of {c}?",
                    "Population of {c}?")).format(c=city)
    k = call(tool("population"), city)
    p = _result(k)["population"]
    answer = rng.choice((f"{city} has a population of {p}.", f"About {p} people live in {city}."))
    return Task("population", q, ((k,),), answer, (str(p),))


def home_weather(rng: random.Random, tool: GetTool) -> Task:
    name = world.person(rng)
    q = rng.choice(("What's the weather where {n} lives?", "Is it sunny where {n} lives?",
                    "How is the weather in {n}'s home town?")).format(n=name)
    k1 = call(tool("home_city"), name)
    city = _result(k1)["city"]
    k2 = call(tool("weather"), city)
    w = _result(k2)
    answer = f"{name} lives in {city}, where it is {w['temperature']} degrees and {w['condition']}."
    return Task("chain_home_weather", q, ((k1,), (k2,)), answer, (city, str(w["temperature"])))


def conversion(rng: random.Random, tool: GetTool) -> Task:
    src, dst = rng.choice(tuple(CONVERSIONS))
    v = rng.randint(1, 500) if rng.random() < 0.7 else round(rng.uniform(0, 100), 1)
    q = rng.choice(("Convert {v} {s} to {d}.", "How many {d} is {v} {s}?", "What is {v} {s} in {d}?",
                    "{v} {s} in {d}, please.")).format(v=v, s=src, d=dst)
    k = call(tool("convert"), v, src, dst)
    r = _result(k)["value"]
    return Task("convert", q, ((k,),), rng.choice((f"{v} {src} is {r} {dst}.", f"That is {r} {dst}.")), (str(r),))


def web_search(rng: random.Random, tool: GetTool) -> Task:
    query = world.topic(rng)
    q = rng.choice(("Search the web for {q}.", "Look up {q} online.", "Find me pages about {q}.",
                    "Can you search for \"{q}\"?")).format(q=query)
    k = call(tool("search"), query)
    top = _result(k)["results"][0]
    answer = rng.choice((f"The top result is \"{top['title']}\" ({top['url']}).",
                         f"I found \"{top['title']}\" at {top['url']}."))
    return Task("search", q, ((k,),), answer, (top["title"],))


def read_file(rng: random.Random, tool: GetTool) -> Task:
    path = world.file_path(rng)
    q = rng.choice(("Read the file {p}.", "What's in {p}?", "Show me the contents of {p}.",
                    "Open {p} and tell me what it says.")).format(p=path)
    k = call(tool("read_file"), path)
    answer = rng.choice((f"{path} says:\n{k.result}", f"The file contains:\n{k.result}"))
    return Task("read_file", q, ((k,),), answer, (k.result,))


def find_and_read(rng: random.Random, tool: GetTool) -> Task:
    topic = f"{rng.choice(world.FILE_STEMS)} {rng.choice(world.TOPIC_NOUNS).split()[0]}"
    q = rng.choice(("Find the file about {t} and tell me what it says.", "What does the {t} file say?",
                    "Locate the {t} document and read it to me.")).format(t=topic)
    k1 = call(tool("find_file"), topic)
    path = _result(k1)["path"]
    k2 = call(tool("read_file"), path)
    return Task("chain_find_read", q, ((k1,), (k2,)), f"{path} says:\n{k2.result}", (k2.result,))


_ADJ = ("Silent", "Golden", "Last", "Hidden", "Blue", "Broken", "Endless", "Little", "Iron", "Wild")
_NOUN = ("River", "Garden", "Harbor", "Clock", "Forest", "Engine", "Winter", "Mirror", "Road", "Star")


def record(rng: random.Random, tool: GetTool) -> Task:
    kind = rng.choice(("book", "person", "event", "product", "ticket"))
    if kind == "book":
        values = (f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)}", world.person(rng), rng.randint(1850, 2025))
        q = rng.choice(('Save the book "{0}" by {1}, published in {2}.', "Record this book: {0} by {1} ({2}).",
                        'Extract the book details: "{0}", written by {1} in {2}.'))
    elif kind == "person":
        values = (world.person(rng), rng.randint(18, 90), rng.choice(world.CITIES))
        q = rng.choice(("Save a contact: {0}, {1} years old, living in {2}.",
                        "{0} is {1} and lives in {2}; record this person."))
    elif kind == "event":
        values = (f"{rng.choice(_NOUN)} {rng.choice(('Meetup', 'Review', 'Party', 'Workshop', 'Launch'))}",
                  f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", rng.choice(world.CITIES))
        q = rng.choice(('Create an event "{0}" on {1} in {2}.', 'Schedule "{0}" for {1} at {2}.'))
    elif kind == "product":
        values = (f"{rng.choice(_ADJ)} {rng.choice(_NOUN)}", round(rng.uniform(1, 500), 2), rng.random() < 0.5)
        q = 'Add the product "{0}" at {1}, ' + ("in stock." if values[2] else "out of stock.")
    else:
        summary = " ".join(rng.choice(world.NOTE_WORDS) for _ in range(3)).capitalize()
        values = (summary, rng.choice(("low", "medium", "high")), world.person(rng))
        q = rng.choice(('Open a ticket "{0}" with {1} priority for {2}.',
                        'File a ticket: "{0}", {1} priority, assign {2}.'))
    k = call(tool(f"record_{kind}"), *values)
    rid = _result(k)["id"]
    return Task(f"record_{kind}", q.format(*values), ((k,),),
                rng.choice((f"Saved as {rid}.", f"Done. The record id is {rid}.")), (rid,))


TASK_MAKERS: dict[str, tuple[float, Callable[[random.Random, GetTool], Task]]] = {
    "arithmetic": (3.0, arithmetic), "expression": (1.0, expression), "arithmetic_chain": (1.0, arithmetic_chain),
    "weather": (1.5, weather), "parallel_weather": (0.5, parallel_weather), "stock": (1.0, stock),
    "email": (1.0, email), "population": (1.0, population), "home_weather": (1.0, home_weather),
    "conversion": (2.0, conversion), "search": (1.5, web_search), "read_file": (1.5, read_file),
    "find_and_read": (1.0, find_and_read), "record": (2.5, record),
}

# Tool families that would make a question ambiguous when offered together, and the task kinds
# that need them.
CONFLICTS = {frozenset(("calc", op)) for op in ("add", "subtract", "multiply", "divide")}
KIND_CONFLICTS = {frozenset(("expression", "arithmetic")), frozenset(("expression", "arithmetic_chain"))}


def conflicts(family: str, present: set[str]) -> bool:
    return any(frozenset((family, other)) in CONFLICTS for other in present)


def kind_conflicts(kind: str, chosen: list[str]) -> bool:
    return any(frozenset((kind, other)) in KIND_CONFLICTS for other in chosen)


def sample_kind(rng: random.Random) -> str:
    kinds = list(TASK_MAKERS)
    return rng.choices(kinds, weights=[TASK_MAKERS[k][0] for k in kinds])[0]


def make_task(rng: random.Random, kind: str, tool: GetTool) -> Task:
    return TASK_MAKERS[kind][1](rng, tool)
