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
        try:
            result = FAMILIES[self.family].run(*(arguments[n] for n in self.arg_names))
        except (TypeError, ValueError, ZeroDivisionError, SyntaxError, KeyError) as exc:
            return json.dumps({"error": str(exc) or type(exc).__name__})
        return result if isinstance(result, str) else json.dumps(result)


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
FAMILIES: dict[str, Family] = {f.key: f for f in _LIST}


def make_tool(rng: random.Random, family: str, held_out: bool, taken: set[str]) -> Tool:
    """One concrete tool: a fresh name and argument names on the requested side of the split."""
    fam = FAMILIES[family]
    name = names.pick(rng, lambda r: names.tool_name(r, fam.verbs, fam.nouns), held_out, taken)
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
    schema = {"type": "function", "function": {
        "name": name, "description": rng.choice(fam.descriptions),
        "parameters": {"type": "object", "properties": properties, "required": list(arg_names)}}}
    return Tool(family, schema, tuple(arg_names))
