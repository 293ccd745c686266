"""Corpus v2's tools: natural names and descriptions from many domains (issue 15).

Each `Spec` is one tool as a person would write it (`create_event(title, date, time, ...)`), with
a few variants of its name and description, arguments of several types (string, integer, number,
boolean, enum, array), question templates that give the values (copied, or derived: "a week" ->
7), and a deterministic Python function. The domains (TRAINING_DOMAINS) are disjoint from those
of the independent held-out set (heldout_v2.HELD_OUT_DOMAINS); a test checks it.

A template names the arguments it gives as `{role}`; an argument a template leaves out is left
out of the call (optional ones), so the model learns to give what the question says, no more.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from hibana_core.demo.tools import argument_type_error

Gen = Callable[[random.Random], tuple[Any, str]]     # -> (JSON value, how the question says it)


@dataclass(frozen=True)
class Arg:
    names: tuple[str, ...]           # argument name variants, one drawn per tool
    type: str                        # JSON schema type ("array": of strings)
    description: str
    gen: Gen
    enum: tuple[str, ...] | None = None
    required: bool = True


@dataclass(frozen=True)
class Spec:
    domain: str
    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    args: dict[str, Arg]             # role -> argument
    questions: tuple[str, ...]       # templates over {role}
    run: Callable[..., dict]         # role values (keywords) -> result
    keys: tuple[str, ...]            # result fields an answer quotes


def _h(*parts: Any) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def pick(words: tuple[str, ...]) -> Gen:
    return lambda rng: (w := rng.choice(words), w)


def integer(lo: int, hi: int, spoken: dict[int, tuple[str, ...]] | None = None) -> Gen:
    def gen(rng: random.Random) -> tuple[int, str]:
        if spoken and rng.random() < 0.3:
            n = rng.choice(list(spoken))
            return n, rng.choice(spoken[n])
        n = rng.randint(lo, hi)
        return n, str(n)
    return gen


def number(lo: float, hi: float, digits: int = 2) -> Gen:
    def gen(rng: random.Random) -> tuple[float | int, str]:
        x = round(rng.uniform(lo, hi), rng.choice((0, 1, digits)))
        x = int(x) if x == int(x) else x
        return x, f"{x:,}" if isinstance(x, int) and x >= 10000 and rng.random() < 0.5 else str(x)
    return gen


def date(rng: random.Random) -> tuple[str, str]:
    d = f"20{rng.randint(25, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return d, d


def clock(rng: random.Random) -> tuple[str, str]:
    t = f"{rng.randint(6, 22):02d}:{rng.choice((0, 15, 30, 45)):02d}"
    return t, t


def flag(phrases: tuple[str, ...]) -> Gen:
    return lambda rng: (True, rng.choice(phrases))


def several(words: tuple[str, ...], lo: int = 2, hi: int = 4) -> Gen:
    def gen(rng: random.Random) -> tuple[list[str], str]:
        items = rng.sample(words, rng.randint(lo, min(hi, len(words))))
        said = ", ".join(items[:-1]) + (rng.choice((" and ", ", ")) + items[-1] if len(items) > 1 else items[0])
        return items, said
    return gen


def numbers(rng: random.Random) -> tuple[list[float], str]:
    xs = [rng.randint(1, 99) if rng.random() < 0.7 else round(rng.uniform(0, 99), 1) for _ in range(rng.randint(3, 6))]
    return xs, ", ".join(map(str, xs))


ROOMS = ("kitchen", "living room", "bedroom", "office", "hallway", "garage", "bathroom", "porch", "nursery")
SONGS = ("Clair de Lune", "Bohemian Rhapsody", "Take Five", "Hey Jude", "Blue in Green", "So What", "Yesterday",
         "Dancing Queen", "Wonderwall", "Heroes", "Imagine", "Respect", "Vogue", "Jolene")
ARTISTS = ("Miles Davis", "Nina Simone", "Radiohead", "ABBA", "Daft Punk", "Bach", "Adele", "Fela Kuti", "Björk")
CHORES = ("renew the car insurance", "water the tomatoes", "email the landlord", "pick up the dry cleaning",
          "book a dentist appointment", "pay the electricity bill", "call grandma", "return the library books",
          "order printer ink", "fix the bike chain", "submit the expense report", "buy a birthday card")
EVENTS = ("Team standup", "Dentist", "Quarterly review", "Yoga class", "Lunch with Priya", "Board meeting",
          "Parent-teacher night", "Code review", "1:1 with Sam", "Book club", "Sprint planning")
PEOPLE = ("Priya Natarajan", "Sam O'Neill", "Lucía Fernández", "Tomasz Kowal", "Aiko Mori", "Dev Patel",
          "Grace Liu", "Omar Haddad", "Nia Brooks", "Jan de Vries", "Keanu Ito", "Marta Ruiz")
WORDS = ("serendipity", "ephemeral", "ubiquitous", "quixotic", "laconic", "petrichor", "sonder", "liminal",
         "halcyon", "mellifluous", "obfuscate", "pragmatic", "zeitgeist", "verisimilitude")
COUNTRIES = ("Chile", "Vietnam", "Ghana", "Norway", "Peru", "Mongolia", "Portugal", "Nepal", "Canada", "Kenya",
             "Uruguay", "Finland", "Morocco", "Laos")
PRODUCTS = ("SKU-1042", "SKU-2210", "SKU-7781", "SKU-3307", "SKU-9051", "SKU-4420")
ITEMS = ("USB-C cable", "desk lamp", "notebook", "stapler", "webcam", "monitor arm", "label printer")
REPOS = ("acme/web", "acme/api", "octo/cli", "kite/runtime", "nova/docs", "lumen/ui")
TOPICS = ("renewable energy", "chess", "space launches", "urban farming", "electric bikes", "ocean plastics",
          "quantum computing", "marathon training", "jazz festivals", "board games")
COURSES = ("Algebra II", "Biology", "World History", "Chemistry", "Spanish 3", "Physics", "Art")
SENSORS = ("greenhouse-1", "server-room", "cellar", "attic", "lab-2", "freezer-b")
STATUS = ("open", "closed", "all")
PRIORITY = ("low", "normal", "high", "urgent")
TEXTS = ("the cat sat on the mat", "hello there general kenobi", "all that glitters is not gold",
         "to be or not to be", "measure twice cut once", "the early bird catches the worm")

_WEEK = {7: ("a week", "seven"), 14: ("two weeks", "a fortnight"), 3: ("three",), 2: ("two", "a couple of")}


def _id(prefix: str, *parts: Any) -> str:
    return f"{prefix}-{_h(*parts) % 90000 + 10000}"


S = "string"
SPECS: tuple[Spec, ...] = (
    Spec("calendar", ("create_event", "add_calendar_event", "schedule_event"),
         ("Add an event to the user's calendar.", "Create a calendar entry."),
         {"title": Arg(("title", "summary", "name"), S, "Event title.", pick(EVENTS)),
          "date": Arg(("date", "day"), S, "Date, YYYY-MM-DD.", date),
          "time": Arg(("start_time", "time"), S, "Start time, HH:MM.", clock),
          "minutes": Arg(("duration_minutes", "length_min"), "integer", "Duration in minutes.",
                         integer(15, 180), required=False)},
         ("Put {title} on my calendar for {date} at {time}.", "Schedule {title} on {date}, {time}, for {minutes} minutes.",
          "Add '{title}' on {date} at {time}.", "can you create an event {title} at {time} on {date}"),
         lambda **v: {"event_id": _id("EV", *v.values()), "status": "created"}, ("event_id",)),
    Spec("calendar", ("list_events", "get_agenda"), ("List the calendar events of a day.",),
         {"date": Arg(("date", "day"), S, "Date, YYYY-MM-DD.", date)},
         ("What's on my calendar on {date}?", "Show my agenda for {date}.", "Do I have anything on {date}?"),
         lambda date: {"events": 1 + _h(date) % 5, "first": EVENTS[_h(date, 1) % len(EVENTS)]}, ("events", "first")),
    Spec("reminders", ("set_reminder", "create_reminder", "remind_me"), ("Set a reminder.", "Remind the user later."),
         {"text": Arg(("text", "message", "what"), S, "What to be reminded of.", pick(CHORES)),
          "minutes": Arg(("in_minutes", "delay_minutes", "minutes_from_now"), "integer", "Minutes from now.",
                         integer(1, 240, {60: ("an hour", "sixty minutes"), 30: ("half an hour",), 120: ("two hours",)})),
          "priority": Arg(("priority",), S, "How important.", pick(PRIORITY), PRIORITY, required=False)},
         ("Remind me to {text} in {minutes} minutes.", "In {minutes} minutes, remind me: {text}. Priority {priority}.",
          "set a {priority} priority reminder to {text} in {minutes} min"),
         lambda **v: {"reminder_id": _id("RM", *v.values())}, ("reminder_id",)),
    Spec("smart_home", ("set_lights", "control_lights", "dim_lights"), ("Turn lights on or set their brightness.",),
         {"room": Arg(("room", "area", "zone"), S, "Which room.", pick(ROOMS)),
          "level": Arg(("brightness", "level", "percent"), "integer", "Brightness 0-100.",
                       integer(0, 100, {0: ("off", "zero"), 100: ("full",), 50: ("half",)}))},
         ("Set the {room} lights to {level} percent.", "Lights in the {room} at {level}%, please.",
          "dim the {room} to {level}"),
         lambda room, level: {"room": room, "brightness": f"{level}%"}, ("brightness",)),
    Spec("smart_home", ("set_thermostat", "thermostat_set_temperature"), ("Set the target temperature.",),
         {"temp": Arg(("temperature", "target", "degrees"), "number", "Target temperature.", number(15, 26, 1)),
          "unit": Arg(("unit", "scale"), S, "Temperature scale.", pick(("celsius", "fahrenheit")),
                      ("celsius", "fahrenheit")),
          "eco": Arg(("eco_mode", "eco"), "boolean", "Energy-saving mode.", flag(("in eco mode", "with eco on")),
                     required=False)},
         ("Set the heating to {temp} degrees {unit}.", "Thermostat to {temp} {unit} {eco}.",
          "make it {temp} degrees ({unit})"),
         lambda **v: {"target": f"{v['temp']}°{v['unit'][0].upper()}", "ok": True}, ("target",)),
    Spec("music", ("play_song", "play_track", "start_music"), ("Play a song on the speaker.", "Start playing music."),
         {"song": Arg(("song", "track", "title"), S, "Song title.", pick(SONGS)),
          "artist": Arg(("artist", "by"), S, "Performer.", pick(ARTISTS), required=False),
          "shuffle": Arg(("shuffle",), "boolean", "Shuffle afterwards.", flag(("then shuffle", "and shuffle after")),
                         required=False)},
         ("Play {song}.", "Play {song} by {artist}.", "put on {song} {shuffle}", "I want to hear {song} by {artist}"),
         lambda **v: {"now_playing": v["song"], "queue_id": _id("Q", *v.values())}, ("now_playing",)),
    Spec("music", ("create_playlist", "make_playlist"), ("Create a playlist from songs.",),
         {"name": Arg(("name", "playlist_name"), S, "Playlist name.", pick(("Morning", "Focus", "Road trip", "Chill"))),
          "songs": Arg(("songs", "tracks"), "array", "Song titles.", several(SONGS))},
         ("Make a playlist called {name} with {songs}.", "New playlist {name}: {songs}."),
         lambda name, songs: {"playlist_id": _id("PL", name, *songs), "tracks": len(songs)}, ("playlist_id",)),
    Spec("todo", ("add_task", "add_todo", "create_todo_item"), ("Add an item to the to-do list.",),
         {"task": Arg(("task", "item", "description"), S, "What needs doing.", pick(CHORES)),
          "due": Arg(("due_date", "due"), S, "Due date, YYYY-MM-DD.", date, required=False),
          "priority": Arg(("priority",), S, "Priority.", pick(PRIORITY), PRIORITY, required=False)},
         ("Add '{task}' to my to-do list.", "Todo: {task}, due {due}.", "Add a {priority} priority task to {task}."),
         lambda **v: {"todo_id": _id("T", *v.values())}, ("todo_id",)),
    Spec("banking", ("get_account_balance", "check_balance"), ("Current balance of one of the user's accounts.",),
         {"account": Arg(("account", "account_type"), S, "Which account.", pick(("checking", "savings", "credit")),
                         ("checking", "savings", "credit"))},
         ("What's my {account} balance?", "How much is in my {account} account?"),
         lambda account: {"balance": f"${_h(account) % 9000 + 100:,}.{_h(account, 1) % 100:02d}"}, ("balance",)),
    Spec("banking", ("transfer_money", "send_payment"), ("Move money to a saved payee.",),
         {"amount": Arg(("amount",), "number", "Amount in dollars.", number(5, 2000)),
          "payee": Arg(("payee", "recipient", "to"), S, "Saved payee name.", pick(PEOPLE)),
          "memo": Arg(("memo", "note"), S, "Note for the payee.", pick(("rent", "dinner", "tickets", "gift")),
                      required=False)},
         ("Send {amount} dollars to {payee}.", "Transfer ${amount} to {payee} for {memo}.", "pay {payee} {amount}"),
         lambda **v: {"transfer_id": _id("TR", *v.values()), "status": "sent"}, ("transfer_id",)),
    Spec("dictionary", ("define_word", "lookup_definition", "dictionary"), ("Dictionary definition of an English word.",),
         {"word": Arg(("word", "term"), S, "The word.", pick(WORDS))},
         ("What does {word} mean?", "Define {word}.", "meaning of the word {word}?"),
         lambda word: {"definition": f"({('noun', 'adjective', 'verb')[_h(word) % 3]}) sense {_h(word) % 4 + 1}"},
         ("definition",)),
    Spec("geography", ("country_info", "get_country_facts"), ("Capital and population of a country.",),
         {"country": Arg(("country", "name"), S, "Country name.", pick(COUNTRIES))},
         ("What is the capital of {country}?", "Tell me about {country}.", "facts about {country} please"),
         lambda country: {"capital": f"{country[:3]}ville", "population_millions": _h(country) % 200 + 1},
         ("capital",)),
    Spec("inventory", ("check_stock", "inventory_level"), ("How many units of a product are in the warehouse.",),
         {"sku": Arg(("sku", "product_id"), S, "Product SKU.", pick(PRODUCTS)),
          "warehouse": Arg(("warehouse", "site"), S, "Warehouse.", pick(("north", "south", "east")),
                           ("north", "south", "east"), required=False)},
         ("How many {sku} do we have?", "Stock of {sku} in the {warehouse} warehouse?"),
         lambda **v: {"units": _h(*v.values()) % 500}, ("units",)),
    Spec("inventory", ("order_supplies", "restock_items"), ("Order office supplies.",),
         {"items": Arg(("items", "products"), "array", "What to order.", several(ITEMS, 1, 3)),
          "quantity": Arg(("quantity", "count"), "integer", "How many of each.",
                          integer(1, 50, {12: ("a dozen",), 2: ("a pair of", "two")}))},
         ("Order {quantity} of each: {items}.", "We need {quantity} {items}, please order them."),
         lambda items, quantity: {"order_number": _id("PO", quantity, *items)}, ("order_number",)),
    Spec("hr", ("leave_balance", "get_vacation_days"), ("Remaining paid leave of an employee.",),
         {"employee": Arg(("employee", "employee_name", "person"), S, "Employee's full name.", pick(PEOPLE))},
         ("How many vacation days does {employee} have left?", "Leave balance for {employee}?"),
         lambda employee: {"days_left": _h(employee) % 30}, ("days_left",)),
    Spec("statistics", ("mean", "average", "compute_average"), ("Arithmetic mean of a list of numbers.",),
         {"values": Arg(("values", "numbers", "data"), "array_number", "The numbers.", numbers)},
         ("What's the average of {values}?", "Mean of {values}", "average these: {values}"),
         lambda values: {"mean": round(sum(values) / len(values), 3)}, ("mean",)),
    Spec("text_tools", ("word_count", "count_words"), ("Count the words in a text.",),
         {"text": Arg(("text", "input"), S, "The text.", pick(TEXTS))},
         ("How many words are in '{text}'?", "Count the words: {text}"),
         lambda text: {"words": len(text.split())}, ("words",)),
    Spec("dice", ("roll_dice", "dice_roll"), ("Roll dice.",),
         {"count": Arg(("count", "dice"), "integer", "Number of dice.", integer(1, 6, {2: ("two", "a pair of")})),
          "sides": Arg(("sides", "faces"), "integer", "Sides per die.", integer(4, 20))},
         ("Roll {count} dice with {sides} sides.", "roll {count} dice, {sides} sides each"),
         lambda count, sides: {"total": count + _h(count, sides) % (count * (sides - 1) + 1)}, ("total",)),
    Spec("github", ("list_issues", "search_issues"), ("List a repository's issues.",),
         {"repo": Arg(("repo", "repository"), S, "owner/name.", pick(REPOS)),
          "state": Arg(("state", "status"), S, "Which issues.", pick(STATUS), STATUS, required=False),
          "limit": Arg(("limit", "max_results"), "integer", "How many.", integer(1, 20), required=False)},
         ("List the {state} issues in {repo}.", "Show {limit} issues of {repo}.", "any {state} issues on {repo}?"),
         lambda **v: {"count": _h(*v.values()) % 40, "newest": f"#{_h(*v.values(), 1) % 900 + 100}"}, ("count", "newest")),
    Spec("news", ("get_headlines", "news_search"), ("Latest news headlines on a topic.",),
         {"topic": Arg(("topic", "query"), S, "Topic.", pick(TOPICS)),
          "limit": Arg(("limit", "count"), "integer", "How many headlines.", integer(1, 10), required=False)},
         ("Any news about {topic}?", "Give me {limit} headlines on {topic}."),
         lambda **v: {"top_headline": f"{v['topic'].title()} update #{_h(*v.values()) % 90 + 10}"}, ("top_headline",)),
    Spec("grades", ("get_grade", "course_grade"), ("A student's current grade in a course.",),
         {"student": Arg(("student", "student_name"), S, "Student name.", pick(PEOPLE)),
          "course": Arg(("course", "subject"), S, "Course.", pick(COURSES))},
         ("What's {student}'s grade in {course}?", "How is {student} doing in {course}?"),
         lambda student, course: {"grade": "ABCDF"[_h(student, course) % 5] + ("+", "", "-")[_h(course) % 3]},
         ("grade",)),
    Spec("sensors", ("read_sensor", "get_sensor_reading"), ("Latest reading of an IoT sensor.",),
         {"sensor": Arg(("sensor_id", "sensor", "device"), S, "Sensor id.", pick(SENSORS)),
          "metric": Arg(("metric",), S, "What to read.", pick(("humidity", "temperature", "co2")),
                        ("humidity", "temperature", "co2"))},
         ("What's the {metric} on {sensor}?", "Read {metric} from sensor {sensor}."),
         lambda sensor, metric: {"reading": f"{_h(sensor, metric) % 900 / 10}"}, ("reading",)),
)

TRAINING_DOMAINS = frozenset(s.domain for s in SPECS) | {"procedural"}


@dataclass(frozen=True)
class NaturalTool:
    """One concrete tool of a spec: the schema the prompt shows and role -> argument name."""

    spec: Spec
    schema: dict
    arg_of: dict[str, str]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def __call__(self, arguments: dict) -> str:
        role_of = {a: r for r, a in self.arg_of.items()}
        wrong = argument_type_error(self.schema, arguments)
        if wrong:
            return json.dumps({"error": wrong})
        try:
            result = self.spec.run(**{role_of[k]: v for k, v in arguments.items()})
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
            return json.dumps({"error": str(exc) or type(exc).__name__})
        return json.dumps(result, ensure_ascii=False)


def make_tool(rng: random.Random, spec: Spec) -> NaturalTool:
    properties, required, arg_of = {}, [], {}
    for role, arg in spec.args.items():
        name = rng.choice(arg.names)
        prop: dict[str, Any] = {"type": arg.type}
        if arg.type.startswith("array"):
            prop = {"type": "array", "items": {"type": "number" if arg.type == "array_number" else "string"}}
        if rng.random() < 0.85:
            prop["description"] = arg.description
        if arg.enum:
            prop["enum"] = list(arg.enum)
        properties[name], arg_of[role] = prop, name
        if arg.required:
            required.append(name)
    schema = {"type": "function", "function": {"name": rng.choice(spec.names), "description": rng.choice(
        spec.descriptions), "parameters": {"type": "object", "properties": properties, "required": required}}}
    return NaturalTool(spec, schema, arg_of)


# --- procedural tools: breadth beyond the hand-written specs ---------------------------------------
#
# "get_museum_director(museum)", "archive_invoice(invoice, reason, notify)": an entity, an attribute
# or a verb, and arguments from a typed pool, each with the phrase that states it in a question. A
# model that has only seen the specs above learns those tools; these make it read the schema.

ENTITIES = ("museum", "invoice", "vendor", "project", "server", "course", "river", "mountain", "painting",
            "dog breed", "bird", "mineral", "board game", "video game", "podcast", "app", "dataset", "printer",
            "meeting room", "locker", "voucher", "patent", "license", "repository", "warehouse", "bridge",
            "lighthouse", "castle", "violin", "telescope lens", "orchard", "beehive", "choir")
ATTRIBUTES = ("owner", "status", "size", "rating", "location", "manager", "version", "capacity", "color",
              "height", "founding year", "serial number", "category", "last update", "supervisor", "length")
VERBS = ("archive", "approve", "rename", "tag", "clone", "inspect", "reserve", "flag", "restart", "publish",
         "assign", "audit", "export", "share")
_NAME_PARTS = ("North", "Cedar", "Falcon", "Quartz", "Echo", "Saffron", "Juniper", "Atlas", "Cobalt", "Willow",
               "Harbor", "Ember", "Meridian", "Orchid", "Granite", "Sable", "Aurora", "Tundra")


def _entity_name(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.4:
        name = f"{rng.choice(_NAME_PARTS)} {rng.choice(_NAME_PARTS)}"
    elif r < 0.7:
        name = f"{rng.choice(('A', 'B', 'C', 'K', 'X', 'Z'))}{rng.randint(1, 999)}"
    else:
        name = f"{rng.choice(_NAME_PARTS).lower()}-{rng.randint(10, 99)}"
    return name, name


def _snake(words: str) -> str:
    return words.replace(" ", "_")


# (argument names, type, description, value generator, enum, phrases stating {v})
_EXTRAS = (
    (("count", "times", "copies"), "integer", "How many.", integer(1, 12, {2: ("twice",), 3: ("three",)}), None,
     ("{v} times", "with a count of {v}", "x{v}")),
    (("limit", "max_value", "threshold"), "number", "Upper bound.", number(1, 500), None,
     ("with a limit of {v}", "up to {v}")),
    (("notify", "send_alert", "announce"), "boolean", "Tell the team.", flag(("and notify the team",
                                                                                "and send an alert")), None, ("{v}",)),
    (("mode", "strategy"), "string", "How to do it.", pick(("fast", "careful", "default")), ("fast", "careful", "default"),
     ("in {v} mode", "using the {v} strategy")),
    (("tags", "labels"), "array", "Labels to add.", several(("urgent", "q3", "legal", "review", "backlog", "vip"),
                                                            1, 3), None, ("tagged {v}", "with labels {v}")),
    (("note", "reason", "comment"), "string", "Free text.", pick(("end of season", "duplicate entry",
                                                                  "requested by finance", "moved to phase two")),
     None, ("because of '{v}'", "with the note '{v}'")),
)


def procedural_spec(rng: random.Random) -> Spec:
    entity = rng.choice(ENTITIES)
    key = _snake(entity)
    subject = Arg((key, f"{key}_name", "name", f"{key}_id"), "string", f"Which {entity}.", _entity_name)
    if rng.random() < 0.5:
        attribute = rng.choice(ATTRIBUTES)
        a = _snake(attribute)
        names = (f"get_{key}_{a}", f"{key}_{a}", f"lookup_{key}_{a}", f"fetch_{a}_of_{key}")
        questions = (f"What is the {attribute} of the {entity} {{subject}}?", f"Look up the {attribute} of {{subject}}.",
                     f"{{subject}}: what's its {attribute}?", f"Find the {attribute} for {entity} {{subject}}")
        return Spec("procedural", names, (f"Returns the {attribute} of a {entity}.", f"Look up a {entity}'s {attribute}."),
                    {"subject": subject}, questions,
                    lambda subject, _a=a: {_a: f"{_NAME_PARTS[_h(subject, _a) % len(_NAME_PARTS)]}-{_h(subject) % 97}"},
                    (a,))
    verb = rng.choice(VERBS)
    extras = rng.sample(_EXTRAS, rng.randint(0, 3))
    args = {"subject": subject}
    base = rng.choice((f"{verb.capitalize()} the {entity} {{subject}}", f"please {verb} {entity} {{subject}}",
                       f"Can you {verb} {{subject}}"))
    questions = []
    for n in range(3):
        parts = [base]
        for i, (arg_names, kind, description, gen, enum, phrases) in enumerate(extras):
            role = f"x{i}"
            args[role] = Arg(arg_names, kind, description, gen, enum, required=i == 0)
            if i == 0 or (n + i) % 2:
                parts.append(rng.choice(phrases).replace("{v}", "{" + role + "}"))
        questions.append(" ".join(parts) + rng.choice((".", "", "?")))
    return Spec("procedural", (f"{verb}_{key}", f"{key}_{verb}"), (f"{verb.capitalize()} a {entity}.",
                f"{verb.capitalize()}s the given {entity}."), args, tuple(questions),
                lambda **v: {"status": "done", "reference": f"{verb[:3].upper()}-{_h(*map(str, v.values())) % 9000 + 1000}"},
                ("reference",))
