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
    city = world.city(rng)
    q = rng.choice(("What's the weather in {c}?", "How is the weather in {c} today?", "Is it cold in {c} right now?",
                    "Tell me the weather for {c}.", "Weather in {c}?")).format(c=city)
    k = call(tool("weather"), city)
    w = _result(k)
    t, cond = w["temperature"], w["condition"]
    answer = rng.choice((f"It is {t} degrees and {cond} in {city}.", f"In {city} it's {cond}, {t} degrees."))
    return Task("weather", q, ((k,),), answer, (str(t), cond))


def parallel_weather(rng: random.Random, tool: GetTool) -> Task:
    c1, c2 = rng.sample(world.CITIES, 2)
    c1, c2 = (world.swap(rng, c, world.UNICODE_SHARE["city"], lambda r: r.choice(world.UNICODE_CITIES))
              for c in (c1, c2))
    if c1 == c2:
        c2 = "Paris" if c1 != "Paris" else "Oslo"
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
    city = world.city(rng)
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
    topic = world.swap(rng, topic, world.UNICODE_SHARE["topic"],
                       lambda r: f"{r.choice(world.FILE_STEMS)} {world.unicode_word(r)}")
    q = rng.choice(("Find the file about {t} and tell me what it says.", "What does the {t} file say?",
                    "Locate the {t} document and read it to me.")).format(t=topic)
    k1 = call(tool("find_file"), topic)
    path = _result(k1)["path"]
    k2 = call(tool("read_file"), path)
    return Task("chain_find_read", q, ((k1,), (k2,)), f"{path} says:\n{k2.result}", (k2.result,))


_ADJ = ("Silent", "Golden", "Last", "Hidden", "Blue", "Broken", "Endless", "Little", "Iron", "Wild")
_NOUN = ("River", "Garden", "Harbor", "Clock", "Forest", "Engine", "Winter", "Mirror", "Road", "Star")


def _title(rng: random.Random, title: str) -> str:
    return world.swap(rng, title, world.UNICODE_SHARE["title"], world.unicode_title)


def record(rng: random.Random, tool: GetTool) -> Task:
    kind = rng.choice(("book", "person", "event", "product", "ticket"))
    if kind == "book":
        values = (_title(rng, f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)}"), world.person(rng),
                  rng.randint(1850, 2025))
        q = rng.choice(('Save the book "{0}" by {1}, published in {2}.', "Record this book: {0} by {1} ({2}).",
                        'Extract the book details: "{0}", written by {1} in {2}.'))
    elif kind == "person":
        values = (world.person(rng), rng.randint(18, 90), world.city(rng))
        q = rng.choice(("Save a contact: {0}, {1} years old, living in {2}.",
                        "{0} is {1} and lives in {2}; record this person."))
    elif kind == "event":
        values = (_title(rng, f"{rng.choice(_NOUN)} {rng.choice(('Meetup', 'Review', 'Party', 'Workshop', 'Launch'))}"),
                  f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", world.city(rng))
        q = rng.choice(('Create an event "{0}" on {1} in {2}.', 'Schedule "{0}" for {1} at {2}.'))
    elif kind == "product":
        values = (_title(rng, f"{rng.choice(_ADJ)} {rng.choice(_NOUN)}"), round(rng.uniform(1, 500), 2),
                  rng.random() < 0.5)
        q = 'Add the product "{0}" at {1}, ' + ("in stock." if values[2] else "out of stock.")
    else:
        summary = " ".join(rng.choice(world.NOTE_WORDS) for _ in range(3)).capitalize()
        summary = world.swap(rng, summary, world.UNICODE_SHARE["title"], lambda r: " ".join(
            (r.choice(world.NOTE_WORDS).capitalize(), world.unicode_word(r), r.choice(world.NOTE_WORDS))))
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


# --- run 3: values in call syntax, generic tools, non-ASCII values -------------------------------
#
# Drawn only on the side stream (world.with_extra), EXTRA_SHARE of the tasks.

EXTRA_SHARE = 0.15

_CALL_QUESTIONS = ("What is the value of {e}?", "What is {e}?", "What does {e} return?", "Compute {e}.",
                   "Evaluate {e}.", "What's {e}?", "I need the value of {e}.", "Find {e} for me.",
                   "Tell me the result of {e}.", "Use the tool to compute {e}.", "Use the tool to find {e}.",
                   "Using the tool, work out {e}.", "{e} = ?", "Please run {e}.", "Get the value of {e}.",
                   "what is {e}", "Can you tell me what {e} is?", "Calculate {e} with the tool.",
                   "What do you get for {e}?", "Work out {e}, please.")
_PLAIN_QUESTIONS = ("Call {f} with {v}.", "Run {f} on {v}.", "Apply {f} to {v}.", "Use {f} with the input {v}.",
                    "Pass {v} to {f}.", "Call {f} on the value {v}.", "Give {v} to {f} and tell me what comes back.",
                    "What does {f} return for {v}?", "What do I get from {f} for an input of {v}?",
                    "Use the tool {f} on {v}.", "call {f} with {v}")
_NAMED_QUESTIONS = ("Call {f} with {a} set to {v}.", "Run {f} with {a} = {v}.", "Use {f}, {a} is {v}.")
_NO_ARG_QUESTIONS = ("What is the value of {f}()?", "What is {f}()?", "Call {f}.", "Run {f} and tell me what it "
                     "returns.", "What does {f}() give?", "Use {f} to get its number.", "What's the current value "
                     "of {f}?", "Call {f}() please.", "What does {f} return?", "Evaluate {f}().")
_SUFFIXES = (" Use the tool.", " Use the tools.", " Please use the tool.", " Call the tool.", " Use the function.",
             " Don't guess, call it.", " Use your tool to find out.", " Use a tool for this.")


def literal(rng: random.Random, value) -> str:
    """A value as a user writes it in call syntax: numbers bare, strings quoted, booleans either way."""
    if isinstance(value, bool):
        return rng.choice((str(value), str(value).lower()))
    if isinstance(value, str):
        quote = '"' if "'" in value else "'" if '"' in value else rng.choice("'\"")
        return f"{quote}{value}{quote}"
    return str(value)


def call_expression(rng: random.Random, c: Call, keywords: bool | None = None) -> str:
    if keywords is None:
        keywords = rng.random() < 0.15
    parts = [f"{k}={literal(rng, v)}" if keywords else literal(rng, v) for k, v in c.arguments.items()]
    return f"{c.tool.name}({', '.join(parts)})"


def _word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.2:
        return world.unicode_word(rng) if rng.random() < 0.7 else world.unicode_person(rng)
    if r < 0.45:
        return rng.choice(world.NOTE_WORDS)
    if r < 0.6:
        return rng.choice(world.TOPIC_NOUNS)
    if r < 0.75:
        return world.person(rng)
    if r < 0.9:
        return " ".join(rng.choice(world.NOTE_WORDS) for _ in range(rng.randint(2, 3)))
    return rng.choice(_NOUN).lower() + str(rng.randint(1, 99))


def _magic_argument(rng: random.Random, prop: dict):
    if prop["type"] == "string":
        return _word(rng)
    if prop["type"] == "number":
        return round(rng.uniform(-50, 500), rng.choice((1, 2)))
    v = rng.choice((rng.randint(0, 20), rng.randint(0, 20), rng.randint(0, 999), -rng.randint(1, 99),
                    rng.randint(1000, 99999)))
    bound = prop.get("maximum", prop.get("exclusiveMaximum"))
    return rng.randint(0, 999) if bound is not None and abs(v) >= bound else v


def _shown(c: Call):
    """What a generic tool returned: the "result" of a JSON object, else the text itself."""
    try:
        value = json.loads(c.result)
    except ValueError:
        return c.result
    return value["result"] if isinstance(value, dict) and "result" in value else value


def call_syntax(rng: random.Random, tool: GetTool) -> Task:
    family = rng.choices(("magic_int", "magic_num", "magic_str", "magic_pair", "magic_none"),
                         weights=(4, 1.5, 2, 1.5, 1.5))[0]
    t = tool(family)
    props = t.schema["function"]["parameters"]["properties"]
    k = call(t, *(_magic_argument(rng, props[a]) for a in t.arg_names))
    f, e = t.name, call_expression(rng, k)
    r = rng.random()
    if not t.arg_names:
        q = rng.choice(_NO_ARG_QUESTIONS).format(f=f)
        e = f"{f}()"
    elif r < 0.55:
        q = rng.choice(_CALL_QUESTIONS).format(e=e)
    elif r < 0.9 or len(t.arg_names) > 1:
        e = call_expression(rng, k, keywords=False)
        v = " and ".join(literal(rng, x) if isinstance(x, str) and rng.random() < 0.7 else str(x)
                         for x in k.arguments.values())
        q = rng.choice(_PLAIN_QUESTIONS).format(f=f, v=v)
    else:
        e = call_expression(rng, k, keywords=False)
        q = rng.choice(_NAMED_QUESTIONS).format(f=f, a=t.arg_names[0], v=literal(rng, k.arguments[t.arg_names[0]]))
    if rng.random() < 0.35:
        q += rng.choice(_SUFFIXES)
    shown = _shown(k)
    answer = rng.choice((f"The value of {e} is {shown}.", f"{e} = {shown}", f"{f} returned {shown}.",
                         f"The result is {shown}.", f"It returned {shown}.", f"{e} is {shown}."))
    return Task("call_syntax", q, ((k,),), answer, (str(shown),))


_DIRECT_KINDS = ("arithmetic", "weather", "stock", "email", "population", "conversion", "search", "read_file",
                 "record")


def direct_call(rng: random.Random, tool: GetTool) -> Task:
    """A task of a base kind, asked as a call of its tool: "What does fetch_weather('Lima') return?"."""
    base = TASK_MAKERS[rng.choice(_DIRECT_KINDS)][1](rng, tool)
    (k,), = base.turns
    q = rng.choice(_CALL_QUESTIONS).format(e=call_expression(rng, k))
    if rng.random() < 0.3:
        q += rng.choice(_SUFFIXES)
    return Task("direct_call", q, base.turns, base.answer, base.answer_keys)


_STYLE_QUESTIONS = ("Using the tool, write a {s} greeting.", "Use the tool to make a {s} farewell.",
                    "With the tool, compose a welcome message in {art} {s} style.", "Generate a {s} toast using the "
                    "tool.", "Write me a greeting in {s} style.", "I want a {s}-style hello. Use the tool.",
                    "Say hi like {art} {s}, using your tool.", "Using the tool, produce a {s} message.",
                    "Make a greeting that sounds {s}.", "Using your tool, greet me in the manner of {art} {s}.")


def styled(rng: random.Random, tool: GetTool) -> Task:
    from hibana_core.demo.tools import _STYLES

    style = rng.choice(_STYLES)
    if rng.random() < 0.4:
        style = style[:1].upper() + style[1:]
    art = "an" if style[0].lower() in "aeiou" else "a"
    k = call(tool("styled"), style)
    text = k.result
    answer = rng.choice((f'Here it is: "{text}"', f"The tool wrote: {text}", text))
    return Task("styled", rng.choice(_STYLE_QUESTIONS).format(s=style, art=art), ((k,),), answer, (text,))


_CUSTOMER_QUESTIONS = ("Register a client called '{n}'{g} - {d}.", "Add the company '{n}'{g}, {d}, as a new client.",
                       "New customer: '{n}'{g}. It is {d}.", "Create a client record for '{n}'{g} — {d}.",
                       'Please set up a customer account named "{n}"{g}: {d}.', "Sign up '{n}'{g} as a customer - {d}",
                       "Onboard {n}{g}, {d}.", "Make a new customer entry: name '{n}', {d}.",
                       "We have a new client, '{n}'{g}, {d}. Save it.", 'Create a customer called "{n}"{g}; it is {d}',
                       "Save '{n}'{g} as a customer: {d}.", "Add a customer named '{n}'{g}, which is {d}.")


def customer(rng: random.Random, tool: GetTool) -> Task:
    name, gloss, description = world.organisation(rng)
    k = call(tool("customer"), name, description)
    g = f" ({gloss})" if gloss else ""
    q = rng.choice(_CUSTOMER_QUESTIONS).format(n=name, g=g, d=description)
    cid = _result(k)["customer_id"]
    answer = rng.choice((f"Created the customer '{name}' with id {cid}.", f"Done: {name} is registered as {cid}.",
                         f"{name} has been added (id {cid})."))
    return Task("customer", q, ((k,),), answer, (cid, name))


EXTRA_MAKERS: dict[str, tuple[float, Callable[[random.Random, GetTool], Task]]] = {
    "call_syntax": (4.0, call_syntax), "direct_call": (2.0, direct_call), "styled": (1.0, styled),
    "customer": (3.0, customer),
}

# Tool families that would make a question ambiguous when offered together, and the task kinds
# that need them.
CONFLICTS = {frozenset(("calc", op)) for op in ("add", "subtract", "multiply", "divide")}
KIND_CONFLICTS = {frozenset(("expression", "arithmetic")), frozenset(("expression", "arithmetic_chain")),
                  frozenset(("expression", "direct_call"))}


def conflicts(family: str, present: set[str]) -> bool:
    return any(frozenset((family, other)) in CONFLICTS for other in present)


def kind_conflicts(kind: str, chosen: list[str]) -> bool:
    return any(frozenset((kind, other)) in KIND_CONFLICTS for other in chosen)


def sample_kind(rng: random.Random) -> str:
    """A task kind; on the side stream (if any), EXTRA_SHARE of them a run 3 kind instead."""
    kinds = list(TASK_MAKERS)
    kind = rng.choices(kinds, weights=[TASK_MAKERS[k][0] for k in kinds])[0]
    side = world.extra(rng)
    if side is not None and side.random() < EXTRA_SHARE:
        extra = list(EXTRA_MAKERS)
        kind = side.choices(extra, weights=[EXTRA_MAKERS[k][0] for k in extra])[0]
    return kind


def make_task(rng: random.Random, kind: str, tool: GetTool) -> Task:
    return (TASK_MAKERS.get(kind) or EXTRA_MAKERS[kind])[1](rng, tool)
