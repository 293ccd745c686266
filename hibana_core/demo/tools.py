"""Tool families: what each tool does, its randomised JSON schema, and the Python behind it.

A `Family` is a kind of tool (add two numbers, look up the weather, read a file, ...); `make_tool`
draws one concrete tool of a family with a random name, description and argument names. The
arguments keep their family's order (first operand first, value before units), which is what lets
the model map values from the question to argument names it has never seen.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from dataclasses import dataclass
from typing import Any, Callable

from hibana_core.demo import names, world
from hibana_core.demo.world import fmt_number


@dataclass(frozen=True)
class Role:
    """One argument of a family: words its name is built from, JSON type, descriptions."""

    words: tuple[str, ...]
    type: str
    descriptions: tuple[str, ...]
    enum: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Family:
    key: str
    verbs: tuple[str, ...]
    nouns: tuple[str, ...]
    descriptions: tuple[str, ...]
    roles: tuple[Role, ...]
    run: Callable[..., Any]   # argument values in role order -> result (dict or text)
    named: bool = False       # run gets the tool's name first (each generic tool is its own function)


@dataclass(frozen=True)
class Tool:
    family: str
    schema: dict              # OpenAI style: {"type": "function", "function": {...}}
    arg_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def __call__(self, arguments: dict) -> str:
        """Run the tool on the model's arguments; bad arguments give an error result, not an exception."""
        missing = [n for n in self.arg_names if n not in arguments]
        if missing:
            return json.dumps({"error": f"missing argument {missing[0]!r}"})
        wrong = argument_type_error(self.schema, arguments)
        if wrong:
            return json.dumps({"error": wrong})
        try:
            family = FAMILIES[self.family]
            values = tuple(arguments[n] for n in self.arg_names)
            result = family.run(*((self.name,) + values if family.named else values))
        except (TypeError, ValueError, ZeroDivisionError, SyntaxError, KeyError) as exc:
            return json.dumps({"error": str(exc) or type(exc).__name__})
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {   # JSON Schema's type names; bool is no number here
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def argument_type_error(schema: dict, arguments: dict) -> str | None:
    """What is wrong with the JSON types of a call's arguments (list items included), or None. A
    model's call reaches a tool's function only through this: its functions assume their types."""
    properties = schema["function"]["parameters"].get("properties", {})
    for name, value in arguments.items():
        prop = properties.get(name, {})
        expected = prop.get("type")
        if expected in _JSON_TYPES and not _JSON_TYPES[expected](value):
            return f"argument {name!r} should be a {expected}, got {value!r}"
        item = prop.get("items", {}).get("type") if expected == "array" else None
        if item in _JSON_TYPES and not all(_JSON_TYPES[item](v) for v in value):
            return f"argument {name!r} should be a list of {item} values, got {value!r}"
    return None


def _num(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {x!r}")
    return x


def _binary(op: Callable[[float, float], float]) -> Callable[[Any, Any], dict]:
    return lambda a, b: {"result": fmt_number(op(_num(a), _num(b)))}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_expression(expression: str) -> dict:
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError("only numbers, + - * / and parentheses are allowed")
    return {"result": fmt_number(ev(ast.parse(str(expression), mode="eval").body))}


CONVERSIONS: dict[tuple[str, str], Callable[[float], float]] = {
    ("km", "miles"): lambda x: x * 0.621371, ("miles", "km"): lambda x: x * 1.609344,
    ("kg", "pounds"): lambda x: x * 2.204623, ("pounds", "kg"): lambda x: x * 0.453592,
    ("meters", "feet"): lambda x: x * 3.28084, ("feet", "meters"): lambda x: x * 0.3048,
    ("celsius", "fahrenheit"): lambda x: x * 9 / 5 + 32, ("fahrenheit", "celsius"): lambda x: (x - 32) * 5 / 9,
    ("liters", "gallons"): lambda x: x * 0.264172, ("gallons", "liters"): lambda x: x * 3.785412,
    ("inches", "cm"): lambda x: x * 2.54, ("cm", "inches"): lambda x: x / 2.54,
}


def convert(value: Any, source: str, target: str) -> dict:
    fn = CONVERSIONS.get((str(source).lower(), str(target).lower()))
    if fn is None:
        raise ValueError(f"cannot convert {source} to {target}")
    return {"value": round(fn(_num(value)), 2), "unit": target}


_A = Role(("a", "x", "first", "lhs", "num1", "left", "operand1", "n1", "value1", "m", "p"), "number",
          ("The first number.", "First operand.", "Left-hand value.", "The first value."))
_B = Role(("b", "y", "second", "rhs", "num2", "right", "operand2", "n2", "value2", "k", "q"), "number",
          ("The second number.", "Second operand.", "Right-hand value.", "The second value."))
_CITY = Role(("city", "location", "place", "town", "where", "loc", "city_name", "area"), "string",
             ("Name of the city.", "The city to look up.", "A city name, e.g. Paris."))
_PERSON = Role(("name", "person", "user", "contact", "who", "full_name", "employee", "member"), "string",
               ("Full name of the person.", "The person's name.", "Who to look up."))
_QUERY = Role(("query", "q", "text", "terms", "keywords", "search", "topic", "phrase"), "string",
              ("What to search for.", "The search query.", "Keywords to look up."))
_RECORD_DESC = ("Respond with a structured record of {what}.", "Store {what} as a structured record.",
                "Save {what}; call this to answer with structured data.", "Create a record for {what}.")


def _record(key: str, what: str, nouns: tuple[str, ...], roles: tuple[Role, ...]) -> Family:
    return Family(key, ("respond", "save", "record", "submit", "store", "create", "add"), nouns,
                  tuple(d.format(what=what) for d in _RECORD_DESC), roles,
                  lambda *values: world.record_id(dict(zip((r.words[0] for r in roles), values))))


def _s(words: tuple[str, ...], *descriptions: str) -> Role:
    return Role(words, "string", descriptions)


_LIST = (
    Family("add", ("add", "sum", "plus", "compute", "calc"), ("numbers", "values", "sum", "total", "two"),
           ("Add two numbers and return the sum.", "Returns the sum of two numbers.",
            "Adds the second number to the first."), (_A, _B), _binary(operator.add)),
    Family("subtract", ("subtract", "minus", "compute", "calc", "diff"), ("numbers", "difference", "values", "delta"),
           ("Subtract the second number from the first.", "Returns the difference of two numbers.",
            "Computes first minus second."), (_A, _B), _binary(operator.sub)),
    Family("multiply", ("multiply", "times", "compute", "calc", "mul"), ("numbers", "product", "values", "factors"),
           ("Multiply two numbers and return the product.", "Returns the product of two numbers.",
            "Multiplies the first number by the second."), (_A, _B), _binary(operator.mul)),
    Family("divide", ("divide", "split", "compute", "calc", "div"), ("numbers", "quotient", "ratio", "values"),
           ("Divide the first number by the second.", "Returns the quotient of two numbers.",
            "Computes first divided by second."), (_A, _B), _binary(operator.truediv)),
    Family("calc", ("eval", "evaluate", "calculate", "solve", "run"), ("expression", "math", "formula", "calculator"),
           ("Evaluate an arithmetic expression with + - * / and parentheses.", "A calculator: returns the value "
            "of a math expression.", "Computes the result of a formula."),
           (_s(("expression", "expr", "formula", "input", "math", "calc"), "The expression to evaluate."),),
           evaluate_expression),
    Family("weather", ("get", "fetch", "lookup", "check", "query", "current"),
           ("weather", "forecast", "conditions", "climate"),
           ("Get the current weather for a city.", "Returns temperature (degrees) and conditions in a city.",
            "Look up today's weather in a given city."), (_CITY,), world.weather),
    Family("stock", ("get", "fetch", "lookup", "quote", "check"), ("stock", "price", "quote", "ticker", "shares"),
           ("Get the latest stock price for a ticker symbol.", "Returns the share price of a company by symbol.",
            "Look up a stock quote."), (_s(("symbol", "ticker", "stock", "code", "sym"), "Ticker symbol, e.g. ACME."),),
           world.stock_price),
    Family("email", ("get", "find", "lookup", "search", "resolve"),
           ("email", "contact", "address", "mail", "directory"),
           ("Find the email address of a person.", "Look up someone's email in the company directory.",
            "Returns the email address for a full name."), (_PERSON,), world.email_of),
    Family("population", ("get", "fetch", "lookup", "count"), ("population", "inhabitants", "census", "people"),
           ("Get the population of a city.", "Returns how many people live in a city.",
            "Look up census data for a city."), (_CITY,), world.population),
    Family("home_city", ("get", "find", "lookup", "locate"), ("home", "residence", "city", "hometown", "address"),
           ("Find the city where a person lives.", "Returns the home city of a person.",
            "Look up where someone lives."), (_PERSON,), world.home_city),
    Family("convert", ("convert", "change", "transform", "to"), ("units", "unit", "measure", "conversion", "quantity"),
           ("Convert a value from one unit to another.", "Unit converter (length, weight, temperature, volume).",
            "Converts an amount between units."),
           (Role(("value", "amount", "quantity", "number", "n", "val", "size"), "number", ("The amount to convert.",)),
            _s(("from_unit", "source", "unit_in", "src", "from", "origin"), "Unit to convert from."),
            _s(("to_unit", "target", "unit_out", "dst", "to", "into"), "Unit to convert to.")), convert),
    Family("search", ("search", "find", "query", "browse", "lookup"), ("web", "internet", "online", "pages", "docs"),
           ("Search the web and return the top results.", "Web search: returns titles and links.",
            "Find pages about a topic."), (_QUERY,), world.search),
    Family("find_file", ("find", "locate", "search", "which"), ("file", "files", "document", "path"),
           ("Find the path of the file about a topic.", "Search the workspace for a file; returns its path.",
            "Locate a document by keywords."), (_QUERY,), world.find_file),
    Family("read_file", ("read", "open", "cat", "load", "get", "show"), ("file", "document", "contents", "text"),
           ("Read a text file and return its contents.", "Returns the contents of the file at a path.",
            "Open a file and read it."),
           (_s(("path", "file", "filename", "filepath", "location", "name"), "Path of the file."),),
           world.file_contents),
    _record("record_book", "a book", ("book", "record", "answer", "entry", "result"),
            (_s(("title", "book_title", "name"), "Title of the book."), _s(("author", "writer", "by"), "Who wrote it."),
             Role(("year", "published", "pub_year", "released"), "integer", ("Year of publication.",)))),
    _record("record_person", "a person", ("person", "contact", "record", "answer", "profile"),
            (_s(("name", "full_name", "person"), "The person's name."),
             Role(("age", "years", "years_old"), "integer", ("Age in years.",)),
             _s(("city", "home", "lives_in", "location"), "Where the person lives."))),
    _record("record_event", "an event", ("event", "meeting", "record", "answer", "calendar"),
            (_s(("name", "title", "event"), "Name of the event."),
             _s(("date", "day", "when", "on"), "Date, YYYY-MM-DD."),
             _s(("location", "venue", "place", "where"), "Where it happens."))),
    _record("record_product", "a product", ("product", "item", "record", "answer", "catalog"),
            (_s(("name", "product", "item"), "Product name."), Role(("price", "cost", "amount"), "number", ("Price.",)),
             Role(("in_stock", "available", "stocked"), "boolean", ("Whether it is in stock.",)))),
    _record("record_ticket", "a support ticket", ("ticket", "issue", "record", "answer", "task"),
            (_s(("summary", "title", "subject"), "Short summary."),
             Role(("priority", "urgency", "level"), "string", ("How urgent.",), ("low", "medium", "high")),
             _s(("assignee", "owner", "assigned_to"), "Who handles it."))),
)

# --- generic tools (run 3): functions named and described in general terms -----------------------
#
# "What is the value of frob_op(3)?": the question gives the value in call syntax and the tool
# says nothing but that it applies some function. Each tool of these families is its own
# function (the result hashes the tool's name and the arguments), so answers must be quoted.

# Names and descriptions of langchain-tests' tools: the corpus never uses them (no training on the test).
EXCLUDED_NAMES = frozenset(("magicfunction", "magicfunctionnoargs", "unicodecustomer", "greetinggenerator",
                            "myaddertool"))
EXCLUDED_DESCRIPTIONS = frozenset(("Apply a magic function to an input.", "Calculate a magic function."))


_MAGIC_VERBS = ("apply", "frobnicate", "transmute", "twist", "warp", "mangle", "scramble", "morph", "compute",
                "eval", "crunch", "munge", "magic", "mystic", "secret", "special", "hidden", "weird", "lucky",
                "cryptic", "arcane", "strange", "quirky", "shuffle", "fold")
_MAGIC_NOUNS = ("function", "fn", "func", "op", "operator", "thing", "transform", "map", "value", "number", "box",
                "gadget", "widget", "oracle", "machine", "trick", "routine")
_MAGIC_ADJ = ("a magic", "a secret", "a special", "a mysterious", "an arcane", "a hidden", "a custom", "a strange",
              "a fixed", "a private")
_MAGIC_KIND = ("function", "transformation", "operation", "formula", "mapping", "procedure")


def _magic_descriptions(objects: tuple[str, ...], nouns: tuple[str, ...]) -> tuple[str, ...]:
    """"Applies a secret mapping to an integer." and the like; a third in other words."""
    combined = [f"{verb} {adj} {kind} {prep} {obj}." for verb, prep in (
        ("Applies", "to"), ("Apply", "to"), ("Computes", "on"), ("Runs", "on"), ("Evaluates", "on"),
        ("Performs", "on")) for adj in _MAGIC_ADJ for kind in _MAGIC_KIND for obj in objects]
    other = [d for noun in nouns for d in (
        f"Returns the secret value of {noun}.", f"Maps {noun} to a result.", f"Frobnicates {noun} and returns "
        f"the result.", f"Transforms {noun} in a hidden way.", f"A mystery function of {noun}.",
        f"Give it {noun}, get a value back.")]
    out = combined + other * max(1, len(combined) // (2 * len(other)))
    return tuple(d for d in out if d not in EXCLUDED_DESCRIPTIONS)


def _magic(key: str, value: Callable[..., Any], roles: tuple[Role, ...], objects: tuple[str, ...],
           nouns: tuple[str, ...]) -> Family:
    return Family(key, _MAGIC_VERBS, _MAGIC_NOUNS, _magic_descriptions(objects, nouns), roles, value, named=True)


def _magic_value(*parts: Any) -> Any:
    r = world._rng("magic", *map(repr, parts))
    values = parts[1:]                                  # parts[0] is the tool's name
    for v in values:
        if isinstance(v, bool):
            raise TypeError(f"expected a value, got {v!r}")
    if values and isinstance(values[0], str):
        s = values[0]
        result: Any = r.choice((s[::-1], s.upper(), f"{s}-{r.randint(1, 99)}", f"{s}{s}", f"<{s}>"))
    elif values and any(isinstance(v, float) for v in values):
        result = round(r.uniform(-100, 1000), 2)
    else:
        result = r.randint(-999, 9999)
    return {"result": result} if r.random() < 0.6 else str(result)


def _magic_int(name: str, x: Any) -> Any:
    if not isinstance(x, int):
        raise TypeError(f"expected an integer, got {x!r}")
    return _magic_value(name, x)


def _magic_num(name: str, x: Any) -> Any:
    return _magic_value(name, float(_num(x)))


def _magic_str(name: str, x: Any) -> Any:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {x!r}")
    return _magic_value(name, x)


def _magic_pair(name: str, a: Any, b: Any) -> Any:
    if not (isinstance(a, int) and isinstance(b, int)):
        raise TypeError("expected two integers")
    return _magic_value(name, a, b)


_IN_INT = Role(("input", "x", "n", "value", "arg", "num", "number", "val", "inp", "param", "operand", "i", "k"),
               "integer", ("The input.", "An integer.", "The value to transform.", "Input to the function.",
                           "Any whole number."))
_IN_NUM = Role(("input", "x", "value", "arg", "num", "number", "val", "amount", "param", "r"), "number",
               ("The input.", "A number.", "The value to transform.", "Input to the function."))
_IN_STR = Role(("input", "text", "s", "word", "value", "string", "data", "arg", "msg", "token"), "string",
               ("The input.", "A string.", "The text to transform.", "Input to the function."))
_IN_A = Role(("a", "x", "first", "left", "m", "input1", "lhs", "p"), "integer", ("The first input.", "An integer."))
_IN_B = Role(("b", "y", "second", "right", "n", "input2", "rhs", "q"), "integer", ("The second input.", "An integer."))

_STYLES = ("formal", "casual", "cowboy", "robot", "poetic", "royal", "sleepy", "grumpy", "cheerful", "Shakespearean",
           "sailor", "wizard", "detective", "surfer", "knight", "viking", "butler", "hippie", "news anchor",
           "sports commentator", "medieval", "noir", "opera singer", "astronaut")
_OPENERS = ("Hello", "Greetings", "Well met", "Howdy", "Good day", "Hey there", "Salutations", "Hi")


def styled_text(style: Any) -> str:
    if not isinstance(style, str) or not style.strip():
        raise ValueError("style must be a non-empty string")
    r = world._rng("styled", style.lower())
    return f"{r.choice(_OPENERS)}, friend! ({style} style, take {r.randint(1, 9)})"


def register_customer(name: Any, description: Any) -> dict:
    if not isinstance(name, str) or not name:
        raise ValueError("the name must be a non-empty string")
    r = world._rng("customer", name, str(description))
    return {"status": "created", "customer_id": f"{r.choice(('cus', 'cli', 'acct'))}-{r.randint(1000, 9999)}"}


_LIST += (
    _magic("magic_int", _magic_int, (_IN_INT,),
           ("an integer", "a whole number", "the input", "an input", "its input"),
           ("an integer", "a number", "the input")),
    _magic("magic_num", _magic_num, (_IN_NUM,), ("a number", "a real number", "the given value", "an input"), ("a number", "a decimal value")),
    _magic("magic_str", _magic_str, (_IN_STR,), ("a string", "a piece of text", "a word", "its text input"), ("a string", "some text", "a word")),
    _magic("magic_pair", _magic_pair, (_IN_A, _IN_B), ("two integers", "a pair of numbers", "two inputs"),
           ("two integers", "a pair of numbers")),
    Family("magic_none", _MAGIC_VERBS, _MAGIC_NOUNS,
           ("Calculates a magic number.", "Returns a secret value.", "Computes the hidden constant.",
            "Gives a special number. Takes no arguments.", "Calculate a secret function.",
            "Produces the mystery value of the day.", "Runs a magic routine and returns its result."),
           (), lambda name: _magic_value(name), named=True),
    Family("styled", ("generate", "make", "write", "compose", "create", "produce", "say"),
           ("greeting", "toast", "farewell", "welcome", "salute", "message", "hello", "line"),
           ("Writes a short message in the requested style.", "Produce a greeting in a given tone of voice.",
            "Creates a short text, styled as asked.", "Generate a message in a particular manner of speech.",
            "Say hello in any style."),
           (Role(("style", "tone", "manner", "voice", "reply_style", "speaking_style", "mood", "flavor"), "string",
                 ("How it should sound.", "The style to write in.", "Tone of voice, e.g. formal.")),), styled_text),
    Family("customer", ("create", "add", "register", "new", "save", "onboard", "make"),
           ("customer", "client", "company", "org", "account", "organization", "partner"),
           ("Create a customer record.", "Register a new client organisation.", "Add a company to the customer "
            "list.", "Store a customer, its name written in its own language.", "Creates a client account with a "
            "name and a short description."),
           (_s(("customer_name", "name", "client_name", "company_name", "org_name", "company", "client", "legal_name"),
               "The customer's name as written in its own language.", "Name of the company.", "Native-script name."),
            _s(("description", "details", "about", "summary", "info", "notes", "desc", "profile"),
               "What the customer does.", "Short description.", "A few words about the company.")),
           register_customer),
)
FAMILIES: dict[str, Family] = {f.key: f for f in _LIST}
BASE_FAMILIES = tuple(f.key for f in _LIST[:19])
"""The families of runs 1 and 2; the others are drawn only on the side stream (world.with_extra)."""
EXTRA_FAMILIES = tuple(f.key for f in _LIST[19:])


def _tool_name(rng: random.Random, fam: Family) -> str:
    while True:
        name = names.tool_name(rng, fam.verbs, fam.nouns)
        if name.replace("_", "").lower() not in EXCLUDED_NAMES:
            return name


def make_tool(rng: random.Random, family: str, held_out: bool, taken: set[str]) -> Tool:
    """One concrete tool: a fresh name and argument names on the requested side of the split.

    With a side stream (world.with_extra), the schema sometimes takes the shapes LangChain's
    `convert_to_openai_tool` gives: no argument descriptions, the arguments described in a
    docstring, bounds on numbers, no "required" when there are no arguments."""
    fam = FAMILIES[family]
    name = names.pick(rng, lambda r: _tool_name(r, fam), held_out, taken)
    arg_taken: set[str] = set()
    properties: dict[str, dict] = {}
    arg_names = []
    for role in fam.roles:
        arg = names.pick(rng, lambda r: names.arg_name(r, role.words), held_out, arg_taken)
        prop: dict[str, Any] = {"type": role.type, "description": rng.choice(role.descriptions)}
        if role.enum:
            prop["enum"] = list(role.enum)
        properties[arg] = prop
        arg_names.append(arg)
    description = rng.choice(fam.descriptions)
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "required": list(arg_names)}
    side = world.extra(rng)
    if side is not None:
        description = _restyle(side, fam, description, parameters)
    schema = {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
    return Tool(family, schema, tuple(arg_names))


def _restyle(side: random.Random, fam: Family, description: str, parameters: dict) -> str:
    properties = parameters["properties"]
    style = side.random()
    if style < 0.22 and properties:               # bare: LangChain tools from functions without docstring args
        for prop in properties.values():
            del prop["description"]
    elif style < 0.32 and properties:            # docstring: the arguments described in the description
        lines = [f"        {arg}: {prop.pop('description')}" for arg, prop in properties.items()]
        description += "\n\n    Args:\n" + "\n".join(lines)
        if side.random() < 0.5:
            description += "\n\n    Returns:\n        " + side.choice(("The result.", "A confirmation message.",
                                                                        "What the tool found."))
    if not properties and side.random() < 0.6:
        del parameters["required"]
    if fam.named:
        for prop in properties.values():
            if prop["type"] in ("integer", "number") and side.random() < 0.35:
                bound = side.choice((1000, 10000, 100000))
                keys = side.choice((("exclusiveMaximum", "exclusiveMinimum"), ("maximum", "minimum")))
                prop.update({keys[0]: bound, keys[1]: -bound})
    return description
