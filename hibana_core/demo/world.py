"""The made-up world the demo tools answer from.

Every answer is a pure function of the question's arguments (through a stable hash), so a tool
gives the same answer in the training corpus, in the evaluation and in `hibana demo`, and the
model can only learn to quote tool results, never to recall them.
"""

from __future__ import annotations

import random
import zlib

CITIES = ("Paris", "Lisbon", "Osaka", "Nairobi", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Quito",
          "Tunis", "Perth", "Zagreb", "Austin", "Bogota", "Dakar", "Kyoto", "Porto", "Seoul", "Turin",
          "Valencia", "Krakow", "Boston", "Munich", "Santiago", "Auckland", "Helsinki", "Manila",
          "Accra", "Reykjavik", "Montreal", "Florence", "Tbilisi", "Cusco", "Hobart", "Bergen")
FIRST_NAMES = ("Ana", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
               "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara",
               "Umar", "Vera", "Wei", "Ximena", "Yusuf", "Zoe", "Marta", "Felix", "Nadia", "Omar")
LAST_NAMES = ("Garcia", "Smith", "Tanaka", "Okafor", "Rossi", "Novak", "Silva", "Berg", "Kim",
              "Dubois", "Moreau", "Lopez", "Ivanova", "Khan", "Meyer", "Costa", "Sato", "Nagy",
              "Horvat", "Walsh", "Jensen", "Haddad", "Ortiz", "Fischer", "Kowalski", "Reyes")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy", "humid")
DOMAINS = ("example.com", "mail.org", "corp.net", "acme.io", "post.dev", "inbox.co")
TOPIC_NOUNS = ("pasta", "bicycles", "volcanoes", "jazz", "solar panels", "sourdough", "chess",
               "tea", "hiking boots", "coral reefs", "telescopes", "origami", "bees", "glaciers",
               "typewriters", "kites", "tomatoes", "lighthouses", "violins", "bridges", "mushrooms",
               "satellites", "yoga", "pottery", "rockets", "whales", "compilers", "databases")
TOPIC_TEMPLATES = ("best {n} in {c}", "history of {n}", "how to repair {n}", "{n} for beginners",
                   "cheap {n}", "{n} near {c}", "facts about {n}", "{n} prices {y}", "why {n} matter",
                   "{n} and {m}", "learn {n} online")
TITLE_TEMPLATES = ("{Q}: A Complete Guide", "Top 10 {Q}", "{Q} Explained", "The Truth About {Q}",
                   "{Q} ({y} Edition)", "Everything on {Q}", "{Q} - Wiki", "Notes on {Q}")
DIRS = ("notes", "docs", "src", "config", "data", "home/user", "projects/alpha", "tmp", "logs",
        "reports/2024", "app", "etc")
FILE_STEMS = ("todo", "readme", "settings", "report", "plan", "ideas", "budget", "meeting",
              "release", "changelog", "draft", "summary", "inventory", "schedule", "contacts")
FILE_EXTS = ("txt", "md", "yaml", "json", "csv", "log", "ini")
NOTE_WORDS = ("buy", "milk", "call", "the", "team", "ship", "version", "fix", "login", "bug",
              "review", "budget", "deploy", "on", "friday", "meet", "at", "noon", "update", "docs",
              "order", "parts", "backup", "server", "pay", "rent", "book", "flight", "to", "renew",
              "license", "clean", "cache", "send", "invoice", "plan", "sprint")


def _rng(*parts: object) -> random.Random:
    return random.Random(zlib.crc32("\x1f".join(map(str, parts)).encode()))


def fmt_number(x: float) -> int | float:
    """Integers stay integers; other values keep at most 4 decimals (as JSON prints them)."""
    if float(x).is_integer() and abs(x) < 1e15:
        return int(x)
    return round(float(x), 4)


def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def topic(rng: random.Random) -> str:
    return rng.choice(TOPIC_TEMPLATES).format(n=rng.choice(TOPIC_NOUNS), m=rng.choice(TOPIC_NOUNS),
                                              c=rng.choice(CITIES), y=rng.randint(2015, 2026))


def file_path(rng: random.Random) -> str:
    lead = "/" if rng.random() < 0.3 else ""
    return f"{lead}{rng.choice(DIRS)}/{rng.choice(FILE_STEMS)}.{rng.choice(FILE_EXTS)}"


def ticker(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(rng.randint(2, 4)))


# --- answers: pure functions of the arguments ---------------------------------------------------

def weather(city: str) -> dict:
    r = _rng("weather", city.lower())
    return {"temperature": r.randint(-12, 38), "condition": r.choice(CONDITIONS)}


def stock_price(symbol: str) -> dict:
    r = _rng("stock", symbol.upper())
    return {"symbol": symbol, "price": round(r.uniform(3, 900), 2)}


def email_of(name: str) -> dict:
    r = _rng("email", name.lower())
    local = ".".join(name.lower().split()) or "user"
    return {"email": f"{local}{r.choice(['', str(r.randint(1, 99))])}@{r.choice(DOMAINS)}"}


def population(city: str) -> dict:
    r = _rng("population", city.lower())
    return {"population": r.randint(50, 9000) * 1000 + r.randint(0, 999)}


def home_city(name: str) -> dict:
    return {"city": _rng("home", name.lower()).choice(CITIES)}


def search(query: str) -> dict:
    r = _rng("search", query.lower())
    q = " ".join(w[:1].upper() + w[1:] for w in query.split())
    slug = "-".join(query.lower().split())[:40]
    results = [{"title": r.choice(TITLE_TEMPLATES).format(Q=q, y=r.randint(2015, 2026)),
                "url": f"https://{r.choice(('wiki', 'news', 'blog', 'docs', 'www'))}.{r.choice(DOMAINS)}/{slug}"}
               for _ in range(2)]
    return {"results": results}


def find_file(query: str) -> dict:
    r = _rng("find", query.lower())
    stem = "-".join(w for w in query.lower().split() if w.isalnum())[:24] or "file"
    return {"path": f"{r.choice(DIRS)}/{stem}.{r.choice(FILE_EXTS)}"}


def file_contents(path: str) -> str:
    r = _rng("file", path)
    lines = [" ".join(r.choice(NOTE_WORDS) for _ in range(r.randint(3, 7))) for _ in range(r.randint(1, 2))]
    return "\n".join(line[:1].upper() + line[1:] + "." for line in lines)


def record_id(fields: dict) -> dict:
    r = _rng("record", *sorted(f"{k}={v}" for k, v in fields.items()))
    return {"status": "saved", "id": f"{r.choice(('rec', 'id', 'doc', 'obj'))}-{r.randint(1000, 9999)}"}
