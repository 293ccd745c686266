"""Corpus v4's tools (issue 15): chosen by reading them, filled with what the question means.

v3 taught the model to copy unseen values (bench/notes_demo_training.md); on the independent
held-out set it still picked the right tool 42% of the time, and could not fill a value the
question states in other words. A v4 tool is built per conversation from general English:

    a lookup    (an attribute of a noun: "the capacity of the venue X") or an action (a verb on a
                noun, with arguments); the name and the description use one word of a synonym
                group, the question often another ("find" / "look up", "invoice" / "bill",
                "height" / "how tall"), and the tools beside it share its noun or its verb, so only
                reading both picks it
    slots       what a question states, each giving one or more arguments: copied values (names,
                titles, codes, "City, ST" places) and mapped ones (knowledge.py: "250 Swiss
                francs" -> amount 250 + currency "CHF", "in German" -> "de", "a fortnight" -> 14
                days, "3pm" -> "15:00", an enum value from its words, a boolean from a phrase)
    compose     a few tools whose values the model writes itself (a joke, a slogan): short, closed

Held-out domains' words (heldout_v2.HELD_OUT_DOMAINS) are in none of the lists; tests check it.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from hibana_core.demo import knowledge as K
from hibana_core.demo.tools_v2 import _h
from hibana_core.demo.tools_v3 import casing, code, person, phrase, place, pseudo_word, title

# --- lexicon: synonym groups of general English ----------------------------------------------------

NOUNS = (
    ("invoice", "bill"), ("customer", "client"), ("vendor", "supplier"), ("employee", "staff member", "worker"),
    ("document", "file", "doc"), ("photo", "picture", "image"), ("song", "tune", "piece of music"), ("album", "record"),
    ("meeting", "appointment"), ("task", "to-do item", "chore"), ("note", "memo"), ("message", "email"),
    ("contract", "agreement"), ("ticket", "support ticket", "case"), ("bug", "defect", "issue"),
    ("server", "host", "machine"), ("account", "profile"), ("basket", "shopping cart"), ("subscription", "membership"),
    ("coupon", "voucher", "promo code", "discount code"), ("donation", "contribution"), ("loan", "credit line"),
    ("budget", "spending plan"), ("expense", "expenditure", "outlay"), ("payment", "transaction"),
    ("project", "initiative"), ("repository", "repo", "codebase"), ("website", "site", "web page"),
    ("database", "data store"), ("backup", "snapshot"), ("device", "gadget"), ("printer", "copier"),
    ("lamp", "light"), ("thermostat", "heater"), ("door", "gate"), ("alarm", "siren"), ("student", "pupil", "learner"),
    ("course", "class", "lesson"), ("exam", "test", "quiz"), ("book", "novel"), ("article", "post", "blog post"),
    ("podcast", "episode"), ("video", "clip"), ("museum", "gallery"), ("painting", "artwork"),
    ("building", "property"), ("apartment", "flat"), ("tenant", "renter", "occupant"), ("company", "business", "firm"),
    ("warehouse", "depot", "storage site"), ("product", "item", "good"), ("pet", "animal"), ("dog", "puppy"),
    ("patient", "case file"), ("doctor", "physician"), ("prescription", "medication"), ("volunteer", "helper"),
    ("event", "gathering"), ("festival", "fair"), ("venue", "location"), ("mountain", "peak"), ("river", "stream"),
    ("lake", "pond"), ("island", "isle"), ("volcano", "crater"), ("bridge", "crossing"), ("castle", "fortress"),
    ("library", "archive room"), ("newsletter", "bulletin"), ("survey", "poll", "questionnaire"),
    ("badge", "pass", "access card"), ("locker", "cabinet"), ("bicycle", "bike"), ("boat", "vessel"),
    ("drone", "quadcopter"),
    ("robot", "bot"), ("sensor", "detector"), ("battery", "power cell"), ("password", "passcode"),
    ("certificate", "cert"), ("domain", "domain name"), ("playlist", "mix"), ("calendar", "agenda"),
    ("reminder", "nudge"), ("folder", "directory"), ("spreadsheet", "sheet"), ("presentation", "slide deck", "deck"),
    ("ballot", "vote"), ("petition", "appeal"), ("grant", "funding award"), ("warranty", "guarantee"),
    ("lease", "tenancy agreement"), ("mortgage", "home financing"), ("insurance policy", "policy"),
    ("claim", "insurance claim"),
    ("license", "permit"), ("vaccine", "shot"), ("lab sample", "specimen"), ("experiment", "trial run"),
    ("satchel", "bag"), ("umbrella", "brolly"), ("keyboard", "keypad"), ("monitor", "screen", "display"))
"""Each group: the words for one thing; a tool's name and description use one, a question any."""

ATTRIBUTES = (
    (("price", "cost"), ("how much does {x} cost", "what does {x} cost")),
    (("owner",), ("who owns {x}", "whose is {x}")),
    (("status", "state"), ("what state is {x} in", "how is {x} doing")),
    (("location", "address", "whereabouts"), ("where is {x}", "where can I find {x}")),
    (("rating", "score", "stars"), ("how well rated is {x}", "how many stars does {x} have")),
    (("capacity",), ("how many people fit in {x}", "how much can {x} hold")),
    (("age",), ("how old is {x}",)),
    (("height",), ("how tall is {x}", "how high is {x}")),
    (("weight", "mass"), ("how heavy is {x}", "how much does {x} weigh")),
    (("length",), ("how long is {x}",)),
    (("opening hours", "hours"), ("when is {x} open", "what are the hours of {x}")),
    (("phone number", "contact number"), ("what number reaches {x}", "how do I phone {x}")),
    (("email address",), ("what's the email address of {x}", "how do I email {x}")),
    (("manager", "supervisor", "boss"), ("who runs {x}", "who manages {x}", "who is in charge of {x}")),
    (("author", "creator"), ("who wrote {x}", "who made {x}", "who created {x}")),
    (("deadline", "due date"), ("when is {x} due",)),
    (("balance",), ("how much is left on {x}", "how much money is in {x}")),
    (("version", "release"), ("which version is {x} on", "what version of {x} is live")),
    (("temperature",), ("how warm is {x}", "how hot is {x}")),
    (("size", "dimensions"), ("how big is {x}",)),
    (("color", "colour"), ("what color is {x}",)),
    (("language",), ("what language is {x} in",)),
    (("founding year", "year founded"), ("when was {x} founded", "what year was {x} founded")),
    (("elevation", "altitude"), ("how high above sea level is {x}",)),
    (("stock level", "inventory"), ("how many of {x} are in stock", "how much of {x} do we have")),
    (("expiry date", "expiration date"), ("when does {x} expire", "when does {x} run out")),
    (("population", "number of residents"), ("how many people live in {x}",)),
    (("waiting list", "queue length"), ("how many people are waiting for {x}",)),
    (("nickname", "alias"), ("what is {x} called for short", "what do people call {x}")))
"""(words for the attribute, questions asking for it with {x} the thing)."""

LOOKUP_VERBS = (("get", "fetch", "retrieve"), ("find", "look up", "search for", "locate"), ("check", "show", "read"))
ACTIONS = (
    ("create", "add", "make", "set up"), ("delete", "remove", "erase", "get rid of"), ("cancel", "call off", "revoke"),
    ("archive", "file away", "shelve"), ("approve", "accept", "sign off on"), ("reject", "decline", "turn down"),
    ("rename", "retitle"), ("send", "email", "forward"), ("share", "give access to"), ("schedule", "plan", "arrange"),
    ("update", "edit", "modify", "change"), ("pause", "suspend", "put on hold"), ("resume", "unpause", "restart"),
    ("publish", "release", "make public"), ("export", "download"), ("print", "print out"),
    ("assign", "hand over", "allocate"), ("verify", "validate", "confirm"), ("renew", "extend"),
    ("refund", "reimburse"), ("buy", "purchase", "order"), ("sell", "list for sale"), ("lock", "secure"),
    ("unlock", "open up"), ("restore", "recover"), ("duplicate", "copy", "clone"), ("invite", "ask along"),
    ("subscribe", "sign up"), ("unsubscribe", "opt out"), ("rate", "review"), ("mute", "silence"),
    ("pin", "bookmark"), ("flag", "report"), ("tag", "label"), ("move", "relocate"), ("merge", "combine"),
    ("close", "shut"), ("start", "launch", "kick off"), ("stop", "halt"), ("charge", "bill"), ("pay", "settle"),
    ("upload", "attach"), ("sync", "synchronize"), ("inspect", "examine"), ("clean", "tidy up"), ("register", "enrol"),
    ("reserve", "hold"), ("request", "ask for"), ("submit", "file"), ("estimate", "work out"))
"""Verb groups; names and descriptions use the first words that are one word, questions any."""


@dataclass(frozen=True)
class Lexicon:
    nouns: tuple[tuple[str, ...], ...]
    attributes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
    actions: tuple[tuple[str, ...], ...]


GAUGE_NOUNS = (("kayak", "canoe"), ("trophy", "cup"), ("hammock", "swing bed"), ("scooter", "moped"),
               ("piano", "upright"), ("aquarium", "fish tank"), ("quilt", "blanket"), ("helmet", "headgear"),
               ("wardrobe", "closet"), ("chandelier", "ceiling fixture"), ("microscope", "magnifier"),
               ("sofa", "couch"), ("tractor", "farm vehicle"), ("harp", "lyre"))
GAUGE_ATTRIBUTES = ((("glossiness", "sheen"), ("how glossy is {x}",)),
                    (("thickness", "depth"), ("how thick is {x}",)),
                    (("dampness", "moisture"), ("how damp is {x}",)),
                    (("wingspan", "span"), ("how wide are the wings of {x}",)))
GAUGE_ACTIONS = (("varnish", "lacquer"), ("repaint", "recolor"), ("sharpen", "hone"), ("inflate", "pump up"),
                 ("recharge", "refill"), ("calibrate", "recalibrate"))
"""Words of no training conversation (tests/test_demo_v4.py checks): the reading gauge (reading.py)
asks for tools made of them, so its figures are on words the model never saw in a tool's place."""

TRAIN = Lexicon(NOUNS, ATTRIBUTES, ACTIONS)
GAUGE = Lexicon(GAUGE_NOUNS, GAUGE_ATTRIBUTES, GAUGE_ACTIONS)


def _one_word(group: tuple[str, ...]) -> list[str]:
    return [w for w in group if " " not in w and "-" not in w]


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


# --- slots: what a question states -----------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """Something a question states, setting one or more arguments.

    `gen(rng) -> (arguments, said)`; a question weaves `said` in with one of `forms` ("for {}").
    `mapped` slots' values are not the question's words (codes, units, numbers from words)."""

    params: dict[str, dict]
    gen: Callable[[random.Random], tuple[dict, str]]
    forms: tuple[str, ...]
    required: bool = False
    mapped: bool = False


def _casing(rng: random.Random, words: list[str]) -> str:
    return casing(rng, [w.replace("-", "_") for w in words], snake=0.7, camel=0.92)


def _described(rng: random.Random, schema: dict, description: str) -> dict:
    """Real tool schemas describe almost every argument (90%)."""
    return schema | {"description": description} if rng.random() < 0.9 else schema


def subject_slot(rng: random.Random, noun: str) -> Slot:
    kind = rng.choice((person, place, title, code, pseudo_word, title, code))
    key = rng.choice((noun, f"{noun} name", f"{noun} id", "name", "id", noun))
    name = _casing(rng, key.split())
    schema = _described(rng, {"type": "string"}, rng.choice((f"Which {noun}.", f"The {noun}'s name or id.",
                                                            f"Name or identifier of the {noun}.")))

    def gen(r):
        value = kind(r)
        return {name: value}, value
    return Slot({name: schema}, gen, ("{}",), required=True)


def money_slot(rng: random.Random) -> Slot:
    amount = _casing(rng, rng.choice(("amount", "total", "sum", "value", "amount")).split())
    cur = _casing(rng, rng.choice(("currency", "currency code", "currency")).split())
    params = {amount: _described(rng, {"type": "number"}, "The amount of money."),
              cur: {"type": "string", "description": rng.choice(("ISO 4217 currency code, e.g. USD.",
                                                                 "Three-letter currency code (ISO 4217).",
                                                                 "Currency, as an ISO code like EUR."))}}

    def gen(r):
        value, code_, said = K.money(r)
        return {amount: value, cur: code_}, said
    return Slot(params, gen, ("for {}", "of {}", "worth {}", "totalling {}", "({})"), mapped=True)


def currency_slot(rng: random.Random) -> Slot:
    name = _casing(rng, rng.choice(("currency", "currency code", "report currency", "target currency")).split())

    def gen(r):
        code_, said, _ = K.currency(r)
        return {name: code_}, said
    return Slot({name: {"type": "string", "description": "ISO 4217 currency code, e.g. GBP."}}, gen,
                ("in {}", "with amounts in {}", "({})"), mapped=True)


def language_slot(rng: random.Random) -> Slot:
    name = _casing(rng, rng.choice(("language", "lang", "language code", "locale")).split())

    def gen(r):
        code_, said = K.language(r)
        return {name: code_}, said
    return Slot({name: {"type": "string", "description": rng.choice(("ISO 639-1 language code, e.g. 'fr'.",
                                                                     "Two-letter language code."))}},
                gen, ("in {}", "with the language set to {}", "({})"), mapped=True)


def country_slot(rng: random.Random) -> Slot:
    name = _casing(rng, rng.choice(("country", "country code", "market", "region")).split())
    as_code = rng.random() < 0.7

    def gen(r):
        code_, said = K.country(r)
        return {name: code_ if as_code else said}, said
    description = "ISO 3166-1 alpha-2 country code, e.g. 'DE'." if as_code else "Country name."
    return Slot({name: {"type": "string", "description": description}}, gen, ("in {}", "for {}", "({})"),
                mapped=as_code)


COUNTED = ("copies", "seats", "people", "units", "attendees", "participants", "licenses", "boxes", "samples",
           "volunteers", "slots", "reminders", "labels")


def count_slot(rng: random.Random) -> Slot:
    thing = rng.choice(COUNTED)
    name = _casing(rng, rng.choice((thing, "quantity", "count", f"number of {thing}")).split())

    def gen(r):
        n, said = K.count(r, 1, 60)
        return {name: n}, f"{said} {thing}"
    return Slot({name: _described(rng, {"type": "integer", "minimum": 1}, f"How many {thing}.")}, gen,
                ("for {}", "with {}", "{}"), mapped=True)


_QUANTITY_ARGS = {"duration": (("minutes", "duration minutes", "length minutes", "timeout minutes"),
                               ("hours", "duration hours"), ("days", "duration days", "period days", "days"),
                               ("seconds", "timeout seconds"), ("weeks", "weeks")),
                  "weight": (("grams", "weight grams", "mass g"), ("kilograms", "weight kg", "kg")),
                  "length": (("metres", "length m", "distance m", "meters"), ("centimetres", "length cm", "width cm"),
                             ("kilometres", "distance km", "km")),
                  "volume": (("millilitres", "volume ml", "ml"), ("litres", "volume liters", "liters"))}
_QUANTITY_FORMS = {"duration": ("for {}", "lasting {}", "over {}"), "weight": ("weighing {}", "of {}"),
                   "length": ("{} long", "of {}", "spanning {}"), "volume": ("holding {}", "of {}")}


def quantity_slot(rng: random.Random) -> Slot:
    kind = rng.choice(("duration", "duration", "weight", "length", "volume"))
    unit, *names = rng.choice(_QUANTITY_ARGS[kind])
    name = _casing(rng, rng.choice(names).split())
    integer = kind == "duration" or rng.random() < 0.5
    schema = {"type": "integer" if integer else "number", "description": rng.choice(
        (f"{kind.capitalize()} in {unit}.", f"In {unit}.", f"The {kind}, in {unit}."))}

    def gen(r):
        value, said = K.quantity(r, kind, unit, integer)
        return {name: value}, said
    return Slot({name: schema}, gen, _QUANTITY_FORMS[kind], mapped=True)


MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")


def date_slot(rng: random.Random) -> Slot:
    name = _casing(rng, rng.choice(("date", "day", "start date", "due date", "on date", "deadline")).split())

    def gen(r):
        y, m, d = r.randint(2025, 2030), r.randint(1, 12), r.randint(1, 28)
        value = f"{y}-{m:02d}-{d:02d}"
        said = r.choice((value, value, f"{MONTHS[m - 1]} {d}, {y}", f"{d} {MONTHS[m - 1]} {y}",
                         f"{MONTHS[m - 1][:3]} {d} {y}"))
        return {name: value}, said
    return Slot({name: {"type": "string", "description": "Date, YYYY-MM-DD."}}, gen, ("on {}", "for {}", "by {}"),
                mapped=True)


def time_slot(rng: random.Random) -> Slot:
    name = _casing(rng, rng.choice(("time", "start time", "at", "time of day")).split())

    def gen(r):
        value, said = K.clock_time(r)
        return {name: value}, said
    return Slot({name: {"type": "string", "description": rng.choice(("Time, HH:MM (24-hour).", "24h time HH:MM."))}},
                gen, ("at {}",), mapped=True)


ENUM_WORDS = ("basic", "standard", "premium", "gold", "silver", "bronze", "family", "business", "personal", "public",
              "private", "internal", "draft", "final", "low", "medium", "high", "critical", "daily", "weekly",
              "monthly", "yearly", "compact", "full", "lite", "pro", "plus", "extra", "large", "small", "dark", "light",
              "quiet", "night", "eco", "turbo", "manual", "automatic", "plain", "rich", "raw", "summary", "detailed",
              "green", "blue", "red", "north", "south", "indoor", "outdoor", "team", "solo", "guest", "admin")
ENUM_PARAMS = ("plan", "tier", "mode", "category", "kind", "level", "style", "format", "visibility", "priority",
               "frequency", "theme", "access level", "edition", "size class", "report type")


def _enum_option(rng: random.Random) -> list[str]:
    words = [rng.choice(ENUM_WORDS) if rng.random() < 0.75 else pseudo_word(rng, 1, 2, accents=False)
             for _ in range(rng.choice((1, 1, 2, 2, 3)))]
    return words


def enum_slot(rng: random.Random) -> Slot:
    label = rng.choice(ENUM_PARAMS)
    name = _casing(rng, label.split())
    options: dict[str, list[str]] = {}
    while len(options) < rng.randint(3, 6):
        words = _enum_option(rng)
        options["_".join(words)] = words
    upper = rng.random() < 0.1
    values = {k.upper() if upper else k: w for k, w in options.items()}

    def gen(r):
        value, words = r.choice(list(values.items()))
        joined = r.choice((" ".join(words), " ".join(words), "-".join(words), " ".join(w.title() for w in words)))
        return {name: value}, joined
    forms = (f"with {label} {{}}", f"{label}: {{}}", f"on the {{}} {label}", "as {}", "set to {}")
    return Slot({name: _described(rng, {"type": "string", "enum": list(values)}, f"The {label}.")}, gen, forms,
                mapped=True)


FLAG_KINDS = (
    ("include {x}", ("attachments", "archived items", "drafts", "comments", "photos", "weekends", "history",
                     "subfolders", "replies", "tax", "tips", "old versions", "hidden files", "guests"),
     ("including {x}", "with {x} included", "and include the {x}"), ("without {x}", "excluding {x}", "leaving out {x}"),
     "Whether to include {x}."),
    ("{x} only", ("verified", "active", "unread", "public", "refundable", "recent", "local", "free", "open", "starred",
                  "paid", "available"),
     ("{x} ones only", "only the {x} ones", "just the {x} ones"), ("not only {x} ones", "{x} or not"),
     "Only {x} ones."),
    ("notify {x}", ("owner", "team", "customer", "manager", "members", "admin", "sender", "tenant", "reviewers"),
     ("and notify the {x}", "and let the {x} know", "and tell the {x}"),
     ("without notifying the {x}", "and don't tell the {x}", "quietly, no message to the {x}"),
     "Send the {x} a notification."),
    ("is {x}", ("urgent", "private", "recurring", "confidential", "anonymous", "permanent", "featured", "billable",
                "pinned", "shared"),
     ("and mark it {x}", "as {x}", "make it {x}"), ("and make it not {x}", "as non-{x}", "not {x}"),
     "Mark it as {x}."),
    ("{x}", ("dry run", "overwrite", "force", "async", "verbose", "recursive", "compress", "encrypt"),
     ("as a {x}", "with {x} on", "({x})"), ("with {x} off", "no {x}", "without {x}"), "Turn on {x}."))


def flag_slot(rng: random.Random) -> Slot:
    pattern, xs, yes, no, description = rng.choice(FLAG_KINDS)
    x = rng.choice(xs)
    name = _casing(rng, pattern.replace("{x}", x).split())
    if rng.random() < 0.3 and name.startswith("is"):
        name = _casing(rng, [x])

    def gen(r):
        value = r.random() < 0.7
        return {name: value}, r.choice(yes if value else no).replace("{x}", x)
    return Slot({name: _described(rng, {"type": "boolean"}, description.replace("{x}", x))}, gen, ("{}",),
                mapped=True)


def city_slot(rng: random.Random) -> Slot:
    """A place as one value, "City, ST" or "City, Country" included: one call, not two."""
    name = _casing(rng, rng.choice(("city", "location", "place", "area", "destination", "address city")).split())

    def gen(r):
        base = place(r)
        s = r.random()
        if s < 0.25:
            base = f"{base}, {r.choice(K.us_states())}"
        elif s < 0.45:
            base = f"{base}, {K.country(r)[1]}"
        return {name: base}, base
    return Slot({name: _described(rng, {"type": "string"}, "City name, with its state or country if needed.")}, gen,
                ("in {}", "near {}", "for {}", "at {}"))


def email(rng: random.Random) -> str:
    return f"{pseudo_word(rng, 1, 2, False)}{rng.choice(('.', '_', ''))}{pseudo_word(rng, 1, 2, False)}@" \
           f"{pseudo_word(rng, 1, 2, False)}.{rng.choice(('com', 'org', 'io', 'net', 'dev'))}"


def list_slot(rng: random.Random) -> Slot:
    thing, source = rng.choice((("tags", pseudo_word), ("labels", pseudo_word), ("recipients", email),
                                ("members", person), ("keywords", pseudo_word), ("items", title)))
    name = _casing(rng, [thing])

    def gen(r):
        items = [source(r) for _ in range(r.randint(1, 4))]
        said = ", ".join(items[:-1]) + (r.choice((" and ", ", ")) + items[-1] if len(items) > 1 else items[0])
        return {name: items}, said
    forms = {"tags": ("tagged {}",), "labels": ("labelled {}", "with labels {}"), "recipients": ("to {}", "cc {}"),
             "members": ("with {}", "for {}"), "keywords": ("with keywords {}", "matching {}"), "items": ("with {}",)}
    return Slot({name: _described(rng, {"type": "array", "items": {"type": "string"}}, f"The {thing}.")}, gen,
                forms[thing])


def text_slot(rng: random.Random) -> Slot:
    word, source, forms = rng.choice((
        ("title", title, ("called '{}'", "titled {}", "named {}")), ("note", phrase, ("with the note '{}'",
                                                                                      "noting '{}'")),
        ("message", phrase, ("saying '{}'", "with the message \"{}\"")), ("reason", phrase, ("because '{}'",
                                                                                              "reason: {}")),
        ("owner", person, ("for {}", "owned by {}")), ("contact", person, ("with {}", "contact {}")),
        ("recipient", person, ("to {}",)), ("email", email, ("at {}", "email {}")), ("reference", code,
                                                                                     ("with reference {}", "ref {}")),
        ("label", title, ("labelled {}",)), ("code", code, ("with code {}",))))
    named = f"{word} name" if word in ("owner", "contact", "recipient") else word
    name = _casing(rng, rng.choice((word, named)).split())
    return Slot({name: _described(rng, {"type": "string"}, f"The {word}.")}, lambda r: ({name: (v := source(r))}, v),
                forms)


EXTRA_SLOTS = ((money_slot, 3), (currency_slot, 1), (language_slot, 2), (country_slot, 2), (count_slot, 3),
               (quantity_slot, 3), (date_slot, 3), (time_slot, 2), (enum_slot, 3), (flag_slot, 4), (city_slot, 2),
               (list_slot, 2), (text_slot, 5))


def extra_slots(rng: random.Random, n: int) -> list[Slot]:
    """`n` slots of different kinds (one date, one amount of money, ...) with distinct argument names."""
    makers, weights = zip(*EXTRA_SLOTS)
    out, names, used = [], set(), set()
    while len(out) < n:
        make = rng.choices(makers, weights)[0]
        slot = make(rng)
        if make not in used and not names & set(slot.params):
            out.append(slot)
            names |= set(slot.params)
            used.add(make)
    return out


# --- tools ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OpenTool:
    """One tool of a conversation: its schema, how questions ask for it, its deterministic result."""

    schema: dict
    noun: tuple[str, ...]
    cores: tuple[str, ...]                 # "{s}" marks the subject's words (or none)
    slots: tuple[Slot, ...]                # the subject first, where there is one
    keys: tuple[str, ...]
    result: Callable[[dict], dict]
    kind: str                              # "lookup", "action", "compose"
    verbs: tuple[str, ...] = ()            # an action's verb group, a lookup's attribute words

    @property
    def meaning(self) -> tuple[str, str, str]:
        """What the tool does: two tools of one meaning in a prompt would make the right one a guess."""
        return self.kind, self.noun[0], self.verbs[0] if self.verbs else ""

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def __call__(self, arguments: dict) -> str:
        return json.dumps(self.result(arguments), ensure_ascii=False)


def _schema(name: str, description: str, slots: list[Slot]) -> dict:
    properties = {k: v for s in slots for k, v in s.params.items()}
    required = [k for s in slots if s.required for k in s.params]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def _name(rng: random.Random, words: list[str]) -> str:
    """The description's words in some casing; 12% an opaque pseudo-word name, so only the description links."""
    if rng.random() < 0.12:
        return _casing(rng, [pseudo_word(rng, 2, 3, False)] + ([pseudo_word(rng, 1, 2, False)] if rng.random() < 0.5
                                                                else []))
    return _casing(rng, words)


def _attribute_value(attribute: str, key: str) -> Any:
    h = _h(attribute, key)
    r = random.Random(h)
    values = {"price": lambda: f"{r.randint(2, 900)}.{r.randint(0, 99):02d} {r.choice(K.COMMON_CURRENCIES)}",
              "owner": lambda: person(r), "manager": lambda: person(r), "author": lambda: person(r),
              "location": lambda: place(r), "age": lambda: r.randint(1, 120), "capacity": lambda: r.randint(2, 5000),
              "height": lambda: f"{r.randint(2, 900)} m", "weight": lambda: f"{r.randint(1, 900)} kg",
              "length": lambda: f"{r.randint(1, 900)} m", "rating": lambda: round(r.uniform(1, 5), 1),
              "status": lambda: r.choice(("active", "pending", "closed", "on hold", "in review")),
              "deadline": lambda: f"20{r.randint(26, 30)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
              "expiry date": lambda: f"20{r.randint(26, 30)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
              "phone number": lambda: f"+{r.randint(1, 99)} {r.randint(100, 999)} {r.randint(1000, 9999)}",
              "email address": lambda: email(r), "version": lambda: f"v{r.randint(0, 9)}.{r.randint(0, 30)}",
              "founding year": lambda: r.randint(1200, 2024), "population": lambda: r.randint(50, 9_000_000)}
    return values.get(attribute, lambda: f"{pseudo_word(r)}-{h % 97}")()


RESULT_FIELDS = {  # more of what a real tool returns, each field's value from the call's hash
    "updated": lambda r: f"20{r.randint(25, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "source": title, "confidence": lambda r: r.choice(("high", "medium", "low")), "region": place,
    "contact": person, "eta": lambda r: f"{r.randint(1, 48)} hours", "queue_position": lambda r: r.randint(1, 40),
    "expires": lambda r: f"20{r.randint(26, 30)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "note": phrase, "items": lambda r: r.randint(0, 300), "cost": lambda r: f"{r.randint(1, 400)} EUR"}
STATUSES = ("done", "scheduled", "queued", "confirmed", "submitted", "accepted", "ok")


def _result(main: dict, fields: tuple[str, ...], arguments: dict) -> dict:
    """`main` and the tool's other `fields`, their values fixed by the call: the same call always gets
    the same answer."""
    r = random.Random(_h(*main.values(), json.dumps(arguments, sort_keys=True)))
    return main | {f: RESULT_FIELDS[f](r) for f in fields}


def _fields(rng: random.Random) -> tuple[str, ...]:
    return tuple(rng.sample(sorted(RESULT_FIELDS), rng.choice((0, 0, 1, 1, 2))))


def lookup_tool(rng: random.Random, noun_group: tuple[str, ...], lex: Lexicon = TRAIN, synonyms: bool = True
                ) -> OpenTool:
    """A lookup of an attribute of `noun_group`'s thing; `synonyms=False`: questions use only the
    tool's own words."""
    words, asks = rng.choice(lex.attributes)
    verbs = rng.choice(LOOKUP_VERBS)
    noun, attribute, verb = noun_group[0], words[0], rng.choice(_one_word(verbs))
    name = _name(rng, [verb, noun, attribute] if rng.random() < 0.6 else [noun, attribute])
    description = rng.choice((f"Returns the {attribute} of {_article(noun)} {noun}.",
                              f"Look up {_article(noun)} {noun}'s {attribute}.",
                              f"Gives the current {attribute} for the given {noun}.",
                              f"{verb.capitalize()} the {attribute} of one {noun}. Use it when the user asks about "
                              f"{_article(noun)} {noun}'s {rng.choice(words)}."))
    slots = [subject_slot(rng, noun)] + extra_slots(rng, rng.choice((0, 0, 0, 1)))
    x = ("the {noun} {s}", "{s}", "{s} ({art} {noun})", "{noun} {s}")
    cores = []
    for _ in range(4):
        said_noun = rng.choice(noun_group) if synonyms else noun
        thing = rng.choice(x).replace("{noun}", said_noun).replace("{art}", _article(said_noun))
        attr = rng.choice(words) if synonyms else attribute
        cores.append(rng.choice((f"what is the {attr} of {thing}?", f"what's {thing}'s {attr}?",
                                 f"{rng.choice(verbs)} the {attr} of {thing}", f"I need the {attr} for {thing}",
                                 rng.choice(asks).replace("{x}", thing) + "?" if synonyms else
                                 f"what is the {attr} of {thing}?")))
    key, fields = attribute.replace(" ", "_"), _fields(rng)
    return OpenTool(_schema(name, description, slots), noun_group, tuple(cores), tuple(slots), (key, *fields),
                    lambda a, _attr=attribute: _result({key: _attribute_value(_attr, json.dumps(a, sort_keys=True))},
                                                       fields, a), "lookup", words)


def action_tool(rng: random.Random, noun_group: tuple[str, ...], verbs: tuple[str, ...] | None = None,
                lex: Lexicon = TRAIN, synonyms: bool = True) -> OpenTool:
    """An action (`verbs`, or a group drawn from `lex`) on `noun_group`'s thing."""
    verbs = verbs or rng.choice(lex.actions)
    noun, verb = noun_group[0], rng.choice(_one_word(verbs))
    name = _name(rng, [verb, noun])
    description = rng.choice((f"{verb.capitalize()} {_article(noun)} {noun}.",
                              f"{verb.capitalize()}s the given {noun}.", f"Use this to {verb} one {noun}.",
                              f"{verb.capitalize()} {_article(noun)} {noun}. Returns a reference "
                              f"number for the {rng.choice(noun_group)}."))
    with_subject = verb not in ("create", "register", "request", "buy", "estimate") or rng.random() < 0.3
    extras = extra_slots(rng, rng.choice((0, 1, 1, 2, 2, 3)) + (not with_subject))
    needed = 1 + (not with_subject)                     # the first extra (two without a subject) required
    extras = [dataclasses.replace(s, required=True) if i < needed else s for i, s in enumerate(extras)]
    slots = ([subject_slot(rng, noun)] if with_subject else []) + extras
    cores = []
    for _ in range(4):
        said_verb, said_noun = (rng.choice(verbs), rng.choice(noun_group)) if synonyms else (verb, noun)
        if with_subject:
            cores.append(rng.choice((f"{said_verb} the {said_noun} {{s}}", f"{said_verb} {said_noun} {{s}}",
                                     f"{said_verb} {{s}} (the {said_noun})", f"{said_verb} {{s}}, a {said_noun},")))
        else:
            cores.append(rng.choice((f"{said_verb} {_article(said_noun)} {said_noun}", f"{said_verb} a new {said_noun}",
                                     f"{said_verb} {_article(said_noun)} {said_noun} for me")))
    status, fields = rng.choice(STATUSES), _fields(rng)

    def result(a: dict) -> dict:
        reference = f"{verb[:3].upper()}-{_h(verb, json.dumps(a, sort_keys=True)) % 90000 + 10000}"
        return _result({"status": status, "reference": reference}, fields, a)
    return OpenTool(_schema(name, description, slots), noun_group, tuple(cores), tuple(slots),
                    ("status", "reference", *fields), result, "action", verbs)


COMPOSE = (  # (name words, description, fields, topic question forms, writer)
    (("joke",), "A joke to tell the user.", ("setup", "punchline"), ("tell me a joke about {t}",
                                                                     "a joke about {t}, please",
                                                                     "make me laugh with a {t} joke"),
     lambda t, r: {"setup": r.choice((f"Why did the {t} cross the road?", f"What do you call a sleepy {t}?",
                                      f"Why was the {t} so calm?")),
                   "punchline": r.choice(("To get to the other side.", "A nap-kin.", "It had nothing to prove.",
                                          "It was well rested."))}),
    (("slogan",), "A short slogan.", ("text",), ("write a slogan for {t}", "give me a catchy slogan about {t}"),
     lambda t, r: {"text": r.choice((f"{t.capitalize()}: simply better.", f"Think {t}.", f"Your {t}, your way."))}),
    (("title", "suggestion"), "Suggest a title.", ("title",), ("suggest a title for a story about {t}",
                                                             "what's a good title for a talk on {t}"),
     lambda t, r: {"title": r.choice((f"The {t.title()} Years", f"All About {t.title()}", f"{t.title()} Rising"))}),
    (("greeting",), "A greeting message.", ("message",), ("write a short greeting for {t}", "greet {t} for me"),
     lambda t, r: {"message": r.choice((f"Hello, {t}!", f"Warm greetings to {t}.", f"Hi {t}, welcome!"))}))


def compose_tool(rng: random.Random) -> OpenTool:
    words, description, fields, asks, write = rng.choice(COMPOSE)
    name = rng.choice((_casing(rng, list(words)), "".join(w.title() for w in words), f"respond_with_{words[0]}"))
    topic_gen = lambda r: r.choice((pseudo_word(r, 1, 2, False), rng.choice(TRAIN.nouns)[0]))

    def gen(r):
        topic = topic_gen(r)
        return write(topic, random.Random(_h(name, topic))), topic
    slot = Slot({f: {"type": "string"} for f in fields}, gen, ("{}",), required=True, mapped=True)
    cores = tuple(a.replace("{t}", "{s}") for a in asks)
    return OpenTool(_schema(name, description, [slot]), (words[0],), cores, (slot,), (), lambda a: {"status": "shown"},
                    "compose")


def sibling(rng: random.Random, tool: OpenTool, lex: Lexicon = TRAIN, synonyms: bool = True) -> OpenTool:
    """A distractor sharing the tool's noun (another verb or attribute) or its verb (another noun)."""
    if tool.kind != "action" or rng.random() < 0.5:
        noun = tool.noun if tool.kind != "compose" else rng.choice(lex.nouns)
        return lookup_tool(rng, noun, lex, synonyms) if rng.random() < 0.5 else action_tool(rng, noun, None, lex,
                                                                                             synonyms)
    return action_tool(rng, rng.choice(lex.nouns), tool.verbs, lex, synonyms)


def open_tool(rng: random.Random, lex: Lexicon = TRAIN, synonyms: bool = True) -> OpenTool:
    r = rng.random()
    if r < 0.04 and lex is TRAIN:
        return compose_tool(rng)
    noun = rng.choice(lex.nouns) if rng.random() < 0.85 else (pseudo_word(rng, 2, 3, False),)
    return lookup_tool(rng, noun, lex, synonyms) if r < 0.45 else action_tool(rng, noun, None, lex, synonyms)
