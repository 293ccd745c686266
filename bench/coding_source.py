"""Procedural Python modules, small edits to them and pytest output, for the coding-agent trace.

Everything is drawn from one `random.Random`, so a seed gives the same files, edits and test
runs. A module is a list of lines (docstring, imports, constants, a dataclass, a class and some
functions); an edit changes a few lines and says which, so that a failing test can quote them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DOMAINS = ("inventory", "billing", "schedule", "shipping", "ledger", "catalog", "payroll", "booking",
           "metrics", "routing", "accounts", "orders", "reports", "tickets", "storage", "pricing")
NOUNS = ("item", "order", "record", "entry", "batch", "account", "slot", "parcel", "invoice", "event",
         "line", "bucket", "region", "customer", "product", "task", "window", "shift", "route", "rate")
VERBS = ("load", "compute", "merge", "filter", "collect", "update", "validate", "normalize", "summarize",
         "find", "build", "apply", "split", "count", "resolve", "format", "check", "group", "rank", "sync")
ATTRS = ("amount", "quantity", "price", "weight", "count", "total", "score", "limit", "offset", "size",
         "duration", "priority", "balance", "discount", "capacity", "level")
TYPES = ("int", "float", "str", "bool")


@dataclass(frozen=True)
class Function:
    name: str
    start: int    # index of its `def` line
    end: int      # one past its last line


@dataclass
class Module:
    path: str
    test_path: str
    lines: list[str]
    functions: list[Function]

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass(frozen=True)
class Edit:
    summary: str          # what the agent says it changes
    line: int             # 0-based index of the main changed line in the new file


def _camel(*words: str) -> str:
    return "".join(w.capitalize() for w in words)


def _body(rng: random.Random, noun: str, args: list[str], indent: str, attrs: tuple[str, ...] = ATTRS) -> list[str]:
    """A few statements over `args` (objects with `attrs`) that read like real code."""
    attr, other = rng.sample(attrs, 2)
    const = rng.choice(("DEFAULT_LIMIT", "MAX_BATCH", "THRESHOLD", "SCALE"))
    first = args[0]
    shapes = [
        [f"total = 0", f"for {noun} in {first}:", f"    if {noun}.{attr} > {const}:",
         f"        total += {noun}.{attr} * {rng.choice(('2', '3', 'SCALE', '0.5'))}",
         f"    elif {noun}.{other} is not None:", f"        total += {noun}.{other}", "return total"],
        [f"if {first} is None:", f"    raise ValueError(\"{first} must be given\")",
         f"result = []", f"for index, {noun} in enumerate({first}):",
         f"    if index >= {const}:", "        break", f"    result.append({noun})", "return result"],
        [f"seen = set()", f"unique = []", f"for {noun} in {first}:", f"    key = ({noun}.{attr}, {noun}.{other})",
         "    if key in seen:", "        continue", "    seen.add(key)", f"    unique.append({noun})",
         f"return sorted(unique, key=lambda x: x.{attr})"],
        [f"groups: dict[str, list] = {{}}", f"for {noun} in {first}:",
         f"    groups.setdefault(str({noun}.{attr}), []).append({noun})",
         f"return {{key: len(value) for key, value in groups.items() if len(value) > {rng.randint(0, 3)}}}"],
        [f"if not {first}:", f"    return {rng.choice(('0', 'None', '[]', '{}'))}",
         f"values = [{noun}.{attr} for {noun} in {first} if {noun}.{other}]",
         f"mean = sum(values) / max(len(values), 1)",
         f"return round(mean * SCALE, {rng.randint(1, 4)})"],
    ]
    lines = rng.choice(shapes)
    if len(args) > 1 and rng.random() < 0.6:
        lines = [f"{args[1]} = {args[1]} or {const}"] + lines
    return [indent + line for line in lines]


def make_module(rng: random.Random) -> Module:
    domain = rng.choice(DOMAINS)
    noun = rng.choice(NOUNS)
    cls = _camel(noun, rng.choice(("store", "index", "planner", "tracker", "registry")))
    lines = [f'"""{domain.capitalize()}: {noun} records and the helpers that {rng.choice(VERBS)} them."""', "",
             "from __future__ import annotations", "", "import logging",
             *(["import math"] if rng.random() < 0.5 else []), "from dataclasses import dataclass, field", "",
             "log = logging.getLogger(__name__)", "",
             f"DEFAULT_LIMIT = {rng.randint(8, 512)}", f"MAX_BATCH = {rng.choice((16, 32, 64, 128))}",
             f"THRESHOLD = {rng.randint(1, 99)}", f"SCALE = {rng.choice(('1.0', '0.5', '100', '2.5'))}", "", "",
             "@dataclass", f"class {_camel(noun)}:"]
    fields = tuple(rng.sample(ATTRS, rng.randint(2, 4)))
    for attr in fields:
        lines.append(f"    {attr}: {rng.choice(TYPES[:2])} = 0")
    lines.append(f"    tags: list[str] = field(default_factory=list)")
    functions: list[Function] = []
    if rng.random() < 0.5:  # half the modules hold a class besides their functions
        lines += ["", "", f"class {cls}:", f'    """Holds {noun}s by key and answers queries over them."""', "",
                  "    def __init__(self) -> None:", f"        self._{noun}s: dict[str, {_camel(noun)}] = {{}}", ""]
        for k in range(2):  # methods
            name = f"{rng.choice(VERBS)}_{noun}s" if k else f"add_{noun}"
            start = len(lines)
            if k == 0:
                lines += [f"    def {name}(self, key: str, {noun}: {_camel(noun)}) -> None:",
                          f'        """Store {noun} under key, replacing any earlier one."""',
                          f"        self._{noun}s[key] = {noun}", f"        log.debug(\"added %s\", key)", ""]
            else:
                lines += [f"    def {name}(self, limit: int | None = None) -> object:",
                          f'        """{name.replace("_", " ").capitalize()} over the stored {noun}s."""',
                          f"        {noun}s = list(self._{noun}s.values())",
                          *_body(rng, noun, [f"{noun}s", "limit"], "        ", fields)]
            functions.append(Function(name, start, len(lines)))
    for _ in range(rng.randint(2, 3) - len(functions) // 2):  # module functions
        verb, other = rng.choice(VERBS), rng.choice(NOUNS)
        name = f"{verb}_{other}s"
        args = [f"{other}s", rng.choice(("limit", "threshold", "batch_size"))]
        lines += ["", ""]
        start = len(lines)
        lines += [f"def {name}({args[0]}: list, {args[1]}: int | None = None) -> object:",
                  f'    """{verb.capitalize()} {other}s{rng.choice(("", " in place", " by " + rng.choice(ATTRS)))};'
                  f' {rng.choice(("used by the report job", "called once per batch", "cheap: no I/O"))}."""',
                  *_body(rng, other, args, "    ")]
        functions.append(Function(name, start, len(lines)))
    path = f"src/{domain}/{noun}_{rng.choice(('core', 'utils', 'store', 'ops', 'model'))}.py"
    return Module(path, f"tests/test_{domain}_{noun}.py", lines, functions)


def edit_module(rng: random.Random, module: Module) -> Edit:
    """Change `module` in place with one small, plausible edit; returns what changed."""
    func = rng.choice(module.functions)
    body = [i for i in range(func.start + 2, func.end) if module.lines[i].strip()]
    lines = module.lines
    kind = rng.choice(("constant", "guard", "operator", "log", "rename"))
    if kind == "constant":
        i = next(i for i, line in enumerate(lines) if line.startswith(("DEFAULT_LIMIT", "MAX_BATCH", "THRESHOLD")))
        name = lines[i].split(" = ")[0]
        lines[i] = f"{name} = {rng.randint(2, 1024)}"
        return Edit(f"change {name}", i)
    indent = " " * (len(lines[body[0]]) - len(lines[body[0]].lstrip()))
    if kind == "guard":
        arg = lines[func.start].split("(")[1].split(":")[0].replace("self, ", "").split(",")[0]
        arg = "limit" if arg == "self" else arg
        lines[func.start + 2:func.start + 2] = [f"{indent}if {arg} is None:",
                                                f"{indent}    raise TypeError(\"{func.name}: {arg} is required\")"]
        _shift(module, func.start + 2, 2)
        return Edit(f"make {func.name} refuse a missing {arg}", func.start + 2)
    if kind == "log":
        lines.insert(body[-1], f"{indent}log.info(\"{func.name}: done\")")
        _shift(module, body[-1], 1)
        return Edit(f"log when {func.name} finishes", body[-1])
    for i in body:  # operator, rename: the first line that has something to change
        line = lines[i]
        if kind == "operator" and (" > " in line or " >= " in line):
            lines[i] = line.replace(" > ", " >= ") if " > " in line else line.replace(" >= ", " > ")
            return Edit(f"fix the boundary check in {func.name}", i)
        if kind == "rename" and " = " in line and "==" not in line:
            old = line.split(" = ")[0].strip().split(":")[0]
            if old.isidentifier() and old != "self":
                new = f"{old}_{rng.choice(('all', 'acc', 'out', 'kept'))}"
                for j in range(func.start, func.end):
                    module.lines[j] = _rename(module.lines[j], old, new)
                return Edit(f"rename {old} to {new} in {func.name}", i)
    lines.insert(body[-1], f"{indent}# {rng.choice(VERBS)} before returning: callers rely on it")
    _shift(module, body[-1], 1)
    return Edit(f"document {func.name}", body[-1])


def _rename(line: str, old: str, new: str) -> str:
    import re

    return re.sub(rf"\b{re.escape(old)}\b", new, line)


def _shift(module: Module, at: int, n: int) -> None:
    """Keep function spans right after `n` lines were inserted at index `at`."""
    module.functions = [Function(f.name, f.start + (n if f.start >= at else 0), f.end + (n if f.end >= at else 0))
                        for f in module.functions]


def pytest_output(rng: random.Random, module: Module, failing: Edit | None) -> str:
    """What `pytest tests/...` prints: all passed, or one failure quoting the edited lines."""
    n = rng.randint(4, 12)
    name = module.test_path
    secs = f"{rng.uniform(0.05, 2.5):.2f}s"
    head = ["============================= test session starts ==============================",
            "platform linux -- Python 3.11.7, pytest-8.3.3, pluggy-1.5.0",
            "rootdir: /workspace", f"collected {n} items", ""]
    if failing is None:
        return "\n".join(head + [f"{name} {'.' * n}{'[100%]':>{max(8, 70 - len(name) - n)}}", "",
                                 f"============================== {n} passed in {secs} =============================="])
    bad = rng.randrange(n)
    test = f"test_{rng.choice(VERBS)}_{rng.choice(NOUNS)}_{rng.choice(('basic', 'empty', 'limit', 'order'))}"
    got, want = rng.randint(0, 500), rng.randint(0, 500)
    quoted = module.lines[max(0, failing.line - 2):failing.line + 2]
    marked = [(">   " if i == min(2, failing.line) else "    ") + line for i, line in enumerate(quoted)]
    dots = "." * bad + "F" + "." * (n - bad - 1)
    return "\n".join(head + [
        f"{name} {dots}{'[100%]':>{max(8, 70 - len(name) - n)}}", "",
        "=================================== FAILURES ===================================",
        f"{'_' * 20} {test} {'_' * 20}", "", f"    def {test}():",
        f"        store = make_store({rng.randint(1, 9)})",
        f">       assert store.total() == {want}", f"E       assert {got} == {want}", "",
        f"{name}:{rng.randint(10, 200)}: ", "", *marked,
        f"E   AssertionError: {failing.summary} changed the result", "",
        f"{module.path}:{failing.line + 1}: AssertionError",
        "=========================== short test summary info ============================",
        f"FAILED {name}::{test} - AssertionError: assert {got} == {want}",
        f"========================= 1 failed, {n - 1} passed in {secs} ========================="])
