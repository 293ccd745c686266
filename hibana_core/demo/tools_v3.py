"""Corpus v3's open world (issue 15): values, tool names and argument names from large sources.

Corpus v2's model memorised a closed world (493 call values reused ~60 times each, tool names from
a few templates) and could not copy an unseen word (bench/notes_demo_training.md). Here:

    values      pseudo-words from syllables over the whole alphabet (some accented), person names,
                place-like names, multi-word titles, codes mixing letters and digits; almost every
                value is new, so the only way to get it right is to copy it from the question
    open tools  `open_spec`: a verb and a noun (from large lists, or a pseudo-word) in several
                casings, or an opaque name; argument names from a list of nouns; the question names
                the tool's noun and attribute or verb, words that are in its *description*, in
                framings shared by every tool (no per-tool template)
    v2's specs  `reopened`: the hand-written tools with their pooled string values (songs, people,
                chores, ...) drawn from the open sources instead; enums and derived values stay
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Callable

from hibana_core.demo.tools_v2 import Arg, Gen, Spec, _h, clock, date

# --- open values ---------------------------------------------------------------------------------

ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "q", "r", "s", "t", "v", "w", "x", "y",
          "z", "br", "ch", "cl", "dr", "fl", "gr", "kh", "pl", "qu", "sh", "sk", "st", "th", "tr", "vr", "zh", "")
VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ie", "oo", "ou", "au")
CODAS = ("",) * 12 + ("n", "r", "l", "s", "m", "k", "x", "th", "nd", "rt", "sk", "z", "ng")   # mostly open
ACCENTS = {"a": "á", "e": "é", "i": "í", "o": "ö", "u": "ü", "n": "ñ"}
PLACE_FORMS = ("{w}", "{w}{s}", "Port {w}", "San {w}", "Lake {w}", "{w} Falls", "{w} Bay", "Nueva {w}",
               "{w}-on-{v}", "Upper {w}")
PLACE_SUFFIXES = ("ton", "burg", "ville", "abad", "pur", "grad", "holm", "ford", "stad", "polis", "wick", "mouth")
TITLE_WORDS = ("Garden", "River", "Night", "Song", "House", "Light", "Winter", "Road", "Stone", "Glass", "Paper",
               "Storm", "Silver", "Moon", "Harbor", "Letter", "Mirror", "Forest", "Engine", "Orchard", "Lantern",
               "Bridge", "Crown", "Echo", "Ember", "Meadow", "Signal", "Atlas", "Comet", "Thread")


def pseudo_word(rng: random.Random, lo: int = 1, hi: int = 3, accents: bool = True) -> str:
    """A pronounceable non-word from 1-3 syllables over the whole alphabet; 8% carry an accent
    (values only: names stay ASCII)."""
    word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(lo, hi)))
    if len(word) < 3:
        word += rng.choice(ONSETS[:20]) + rng.choice(VOWELS)
    if accents and rng.random() < 0.08:
        i = rng.randrange(len(word))
        word = word[:i] + ACCENTS.get(word[i], word[i]) + word[i + 1:]
    return word


def name_word(rng: random.Random, lo: int = 2, hi: int = 3) -> str:
    return pseudo_word(rng, lo, hi).capitalize()


def person(rng: random.Random) -> str:
    first, last = name_word(rng), name_word(rng)
    r = rng.random()
    if r < 0.15:
        return f"{first} {name_word(rng, 1, 2)} {last}"
    if r < 0.25:
        return f"{first} {rng.choice(('de ', 'van ', 'al-', 'da ', 'O'))}{last}".replace(" O", " O'")
    return f"{first} {last}"


def place(rng: random.Random) -> str:
    form = rng.choice(PLACE_FORMS)
    return form.format(w=name_word(rng), s=rng.choice(PLACE_SUFFIXES), v=name_word(rng, 1, 2))


def title(rng: random.Random) -> str:
    """A multi-word name: pseudo-words mixed with a few common words ("The Velmoran Garden")."""
    words = [name_word(rng, 1, 3) if rng.random() < 0.6 else rng.choice(TITLE_WORDS) for _ in range(rng.randint(1, 3))]
    if all(w in TITLE_WORDS for w in words):
        words.append(name_word(rng))
    return ("The " if rng.random() < 0.25 else "") + " ".join(words)


def phrase(rng: random.Random) -> str:
    """Lower-case free text of 2-5 pseudo-words ("brelo quansk vith")."""
    return " ".join(pseudo_word(rng) for _ in range(rng.randint(2, 5)))


def code(rng: random.Random) -> str:
    """Identifiers as people type them: "JD014600", "LQX", "ab-4471", "K7-ZP2", "zorbit_12"."""
    upper = lambda n: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n))
    digits = lambda n: "".join(rng.choice("0123456789") for _ in range(n))
    r = rng.random()
    if r < 0.25:
        return upper(rng.randint(1, 3)) + digits(rng.randint(3, 10))
    if r < 0.4:
        return upper(3)
    if r < 0.6:
        return f"{upper(2).lower()}-{digits(4)}"
    if r < 0.8:
        return f"{upper(1)}{digits(1)}-{upper(2)}{digits(1)}"
    return f"{pseudo_word(rng, 1, 2)}_{digits(2)}"


SOURCES: dict[str, Callable[[random.Random], str]] = {
    "person": person, "place": place, "title": title, "phrase": phrase, "code": code, "word": pseudo_word}


def open_value(kind: str) -> Gen:
    return lambda rng: (v := SOURCES[kind](rng), v)


def open_values(kind: str, lo: int = 1, hi: int = 3) -> Gen:
    def gen(rng: random.Random) -> tuple[list[str], str]:
        items = [SOURCES[kind](rng) for _ in range(rng.randint(lo, hi))]
        said = ", ".join(items[:-1]) + (" and " + items[-1] if len(items) > 1 else items[0])
        return items, said
    return gen


# --- v2's hand-written tools, reopened ------------------------------------------------------------

REOPEN = {"room": "word", "title": "title", "song": "title", "artist": "person", "name": "title", "songs": "title",
          "text": "phrase", "task": "phrase", "payee": "person", "memo": "word", "word": "word",
          "country": "place", "sku": "code", "items": "phrase", "repo": "code", "employee": "person",
          "topic": "phrase", "student": "person", "course": "title", "sensor": "code"}
"""Role -> open source for v2's string and array arguments that drew from a fixed pool."""


def reopened(spec: Spec) -> Spec:
    """`spec` with each pooled string (or list of strings) argument drawn from an open source."""
    args = {}
    for role, arg in spec.args.items():
        if role in REOPEN and not arg.enum and arg.type in ("string", "array") and arg.gen not in (date, clock):
            kind = REOPEN[role]
            arg = dataclasses.replace(arg, gen=open_values(kind, 2, 4) if arg.type == "array" else open_value(kind))
        args[role] = arg
    return dataclasses.replace(spec, args=args)


# --- open tools --------------------------------------------------------------------------------------

VERBS = ("archive", "approve", "rename", "tag", "clone", "inspect", "reserve", "flag", "restart", "publish",
         "assign", "audit", "export", "share", "cancel", "renew", "register", "close", "open", "pause", "resume",
         "verify", "submit", "schedule", "transfer", "merge", "lock", "unlock", "rate", "review", "validate",
         "deploy", "sync", "backup", "restore", "delete", "update", "create", "book", "confirm", "notify", "ping",
         "mute", "pin", "star", "follow", "import", "print", "scan", "sign", "invite", "enroll", "refund", "ship")
# No held-out domain's nouns (recipes, parcels, astronomy, plants, sports, hotels, flights, car rental):
# tests/test_demo_v2.py checks that no name these lists can form is a held-out tool's.
NOUNS = ("invoice", "vendor", "project", "server", "course", "river", "painting", "bird", "mineral", "podcast",
         "dataset", "printer", "locker", "voucher", "patent", "license", "repository", "warehouse", "bridge",
         "castle", "violin", "orchard", "beehive", "choir", "ticket", "contract", "shipment", "album",
         "article", "badge", "boat", "campaign", "certificate", "channel", "client", "cluster", "coupon",
         "device", "document", "domain", "donation", "driver", "exhibit", "festival", "grant", "guest",
         "library", "listing", "machine", "mailbox", "member", "mission", "newsletter", "order", "patient",
         "pipeline", "playlist", "policy", "portfolio", "profile", "property", "puzzle", "quiz",
         "sculpture", "shelf", "sponsor", "statue", "store", "subscription", "supplier", "survey", "tenant",
         "trail", "tutor", "venue", "volunteer", "wallet", "webhook", "workshop", "yacht", "glacier",
         "volcano", "manuscript")
ATTRIBUTES = ("owner", "status", "size", "rating", "location", "manager", "version", "capacity", "color", "height",
              "founding year", "serial number", "category", "last update", "supervisor", "length", "weight",
              "price", "origin", "nickname", "address", "sponsor", "curator", "altitude", "balance", "deadline",
              "language", "motto", "mascot", "region", "score", "temperature", "theme", "author", "genre", "age")
FETCH = ("get", "fetch", "lookup", "find", "read", "query", "describe", "show")
ARG_NOUNS = ("label", "owner", "region", "note", "code", "city", "contact", "reference", "alias", "team",
             "keyword", "category", "title", "recipient", "sender", "destination", "origin", "site", "branch",
             "handle", "account", "group", "project", "venue", "partner", "brand", "model", "series", "tag", "host")
ARG_SOURCES = {"label": "title", "owner": "person", "region": "place", "note": "phrase", "code": "code",
               "city": "place", "contact": "person", "reference": "code", "alias": "word", "team": "title",
               "keyword": "word", "category": "word", "title": "title", "recipient": "person", "sender": "person",
               "destination": "place", "origin": "place", "site": "place", "branch": "place", "handle": "code",
               "account": "code", "group": "title", "project": "title", "venue": "place", "partner": "person",
               "brand": "title", "model": "code", "series": "title", "tag": "word", "host": "code"}
STATES = ("{w} {v}", "with {w} {v}", "{w}: {v}", "for {w} {v}", "({w} {v})", "setting {w} to {v}")
SUBJECT_SOURCES = ("title", "person", "place", "code", "word")
ASK_LEADS = ("", "", "", "Hey, ", "Quick one: ", "Question: ", "Tell me: ")
DO_LEADS = ("", "", "", "Please ", "Could you ", "I need you to ", "Can you ", "Hey, ")


def casing(rng: random.Random, words: list[str], snake: float = 0.65, camel: float = 0.9) -> str:
    """`words` as one name: snake_case (`snake` of the time), camelCase (up to `camel`), or run together."""
    words = [w.replace(" ", "_") for w in words]
    r = rng.random()
    if r < snake:
        return "_".join(words)
    if r < camel:
        return words[0] + "".join(w.title().replace("_", "") for w in words[1:])
    return "".join(words).replace("_", "")


def _noun(rng: random.Random) -> str:
    return rng.choice(NOUNS) if rng.random() < 0.75 else pseudo_word(rng, 2, 3, accents=False)


def _tool_name(rng: random.Random, verb: str, noun: str, attribute: str | None) -> str:
    """Mostly the description's words; 15% an opaque pseudo-word, so only the description links."""
    if rng.random() < 0.15:
        words = [pseudo_word(rng, 2, 3, False)] + ([pseudo_word(rng, 1, 2, False)] if rng.random() < 0.5 else [])
        return casing(rng, words)
    words = [verb, noun] + ([attribute] if attribute else [])
    if attribute and rng.random() < 0.4:
        words = [noun, attribute]
    return casing(rng, words)


def _extra(rng: random.Random, taken: set[str]) -> tuple[str, Arg, str]:
    """An optional argument with an open value: (role word, Arg, how a question states it)."""
    word = rng.choice([w for w in ARG_NOUNS if w not in taken])
    kind = ARG_SOURCES[word]
    said = rng.choice(STATES).replace("{w}", word)
    arg = Arg((casing(rng, [word]) if rng.random() < 0.8 else casing(rng, [word, rng.choice(("name", "id"))]),),
              "string", f"The {word}.", open_value(kind), required=False)
    return word, arg, said


def _question(rng: random.Random, core: str, states: list[str], leads: tuple[str, ...]) -> str:
    """A lead, the core, and each optional argument's statement with probability 1/2."""
    end = core[-1] if core[-1] in ".?" else rng.choice((".", "", "!"))
    said = [s for s in states if rng.random() < 0.5]
    text = " ".join([core.rstrip(".?")] + said) + end
    lead = rng.choice(leads)
    return lead + text if lead else text[0].upper() + text[1:]


def _lookup_result(key: str, **values: str) -> dict:
    """The attribute, derived from the arguments: the same call always gets the same answer."""
    h = _h(*values.values())
    return {key: f"{pseudo_word(random.Random(h))}-{h % 97}"}


def _action_result(verb: str, **values: str) -> dict:
    return {"status": "done", "reference": f"{verb[:3].upper()}-{_h(*values.values()) % 9000 + 1000}"}


def open_spec(rng: random.Random, noun: str | None = None) -> Spec:
    """A tool nobody wrote: a lookup of a noun's attribute or an action on a noun, with 0-2 extras.

    The question says the noun and the attribute or verb, words of the description; the tool's
    name may use them, other casings of them, or none (a pseudo-word)."""
    noun = noun or _noun(rng)
    subject_kind = rng.choice(SUBJECT_SOURCES)
    key = rng.choice((noun, "name", "id", "target", "query", f"{noun} id"))
    subject = Arg((casing(rng, key.split()),), "string", f"Which {noun}.", open_value(subject_kind))
    args, states = {"subject": subject}, []
    if rng.random() < 0.5:
        attribute, verb = rng.choice(ATTRIBUTES), rng.choice(FETCH)
        description = rng.choice((f"Returns the {attribute} of a {noun}.", f"Look up a {noun}'s {attribute}.",
                                  f"Gives the current {attribute} for the given {noun}."))
        cores = (f"what is the {attribute} of the {noun} {{subject}}?",
                 f"look up the {attribute} of {{subject}}, a {noun}.",
                 f"{{subject}} is a {noun}: what's its {attribute}?", f"find the {attribute} for {noun} {{subject}}.")
        name = _tool_name(rng, verb, noun, attribute)
        key = attribute.replace(" ", "_")
        run, keys, leads = functools.partial(_lookup_result, key), (key,), ASK_LEADS
    else:
        verb = rng.choice(VERBS)
        description = rng.choice((f"{verb.capitalize()} a {noun}.", f"{verb.capitalize()}s the given {noun}.",
                                  f"Use this to {verb} one {noun}."))
        for _ in range(rng.choice((0, 1, 1, 2))):
            word, arg, said = _extra(rng, set(args))
            args[word] = arg
            states.append(said.replace("{v}", "{" + word + "}"))
        cores = (f"{verb} the {noun} {{subject}}", f"{verb} {noun} {{subject}}", f"{verb} {{subject}} (a {noun})")
        name = _tool_name(rng, verb, noun, None)
        run, keys, leads = functools.partial(_action_result, verb), ("reference",), DO_LEADS
    questions = tuple(_question(rng, core, states, leads) for core in cores)
    return Spec("open", (name,), (description,), args, questions, run, keys)
