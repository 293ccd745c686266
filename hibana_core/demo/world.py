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
    return swap(rng, f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}", UNICODE_SHARE["person"], unicode_person)


def city(rng: random.Random) -> str:
    return swap(rng, rng.choice(CITIES), UNICODE_SHARE["city"], lambda r: r.choice(UNICODE_CITIES))


def topic(rng: random.Random) -> str:
    text = rng.choice(TOPIC_TEMPLATES).format(n=rng.choice(TOPIC_NOUNS), m=rng.choice(TOPIC_NOUNS),
                                              c=rng.choice(CITIES), y=rng.randint(2015, 2026))
    return swap(rng, text, UNICODE_SHARE["topic"], unicode_topic)


# --- the side stream: additions that leave the base draws alone ---------------------------------
#
# Corpus and held-out generators attach a second generator to their main one (`with_extra`). Every
# addition made after run 2 (non-ASCII values, the call-syntax and customer tasks, schema styles)
# draws from that side stream only, so the main stream, and with it every task that gets no
# addition, is exactly what it was. A plain `random.Random` (`hibana demo`, tests) has no side
# stream and gets the base tasks unchanged.

UNICODE_SHARE = {"person": 0.08, "city": 0.06, "topic": 0.05, "title": 0.08, "word": 0.2}


def with_extra(key: str) -> random.Random:
    rng = random.Random(key)
    rng.extra = random.Random(f"{key}:extra")  # type: ignore[attr-defined]
    return rng


def extra(rng: random.Random) -> random.Random | None:
    return getattr(rng, "extra", None)


def swap(rng: random.Random, value, share: float, make):
    """`value`, or with probability `share` on the side stream (when there is one) `make(side)`."""
    side = extra(rng)
    return make(side) if side is not None and side.random() < share else value


# Non-ASCII values (CJK, Korean, accented Latin, a little Cyrillic and Greek; no emoji). Names are
# put together from parts, so the model learns to copy bytes, not to recall a list.
ZH_SURNAMES = tuple("王李张刘陈杨黄赵吴周徐孙马朱胡郭何林高罗郑梁谢宋唐许韩冯邓曹彭曾萧田董袁潘蒋蔡余杜叶程苏魏吕丁沈")
ZH_GIVEN = tuple("伟芳娜敏静丽强磊军洋勇艳杰涛明超秀霞平刚华玲晨宇欣怡浩然梓涵思睿博文雅婷志鹏佳琪嘉慧俊凯")
JA_SURNAMES = ("佐藤", "鈴木", "高橋", "田中", "渡辺", "伊藤", "山本", "中村", "小林", "加藤", "吉田", "山口",
               "松本", "井上", "木村", "清水", "森", "池田", "橋本", "石川")
JA_GIVEN = ("さくら", "ゆき", "はると", "あおい", "翔太", "美咲", "健太", "陽菜", "蓮", "結衣", "大翔", "ひなた",
            "かなで", "そら", "悠真", "りん", "真央", "ゆうと", "ことね", "湊")
KO_SURNAMES = ("김", "이", "박", "최", "정", "강", "조", "윤", "장", "임")
KO_GIVEN = ("민준", "서연", "지우", "하은", "도윤", "서준", "지민", "수아", "예준", "하린", "유진", "현우")
LATIN_FIRST = ("José", "María", "Zoë", "Chloé", "François", "Søren", "Åsa", "Björn", "Jürgen", "Łukasz",
               "Małgorzata", "Renée", "Inês", "João", "Ondřej", "Héctor", "Sébastien", "Noémie", "Íñigo",
               "Dagný", "Gülşen", "Mária", "Tomáš", "Anaïs", "Raúl", "Zoltán", "Mélanie", "Ståle")
LATIN_LAST = ("Muñoz", "Núñez", "Müller", "Sørensen", "Lefèvre", "Wójcik", "Dvořák", "Gonçalves", "Ångström",
              "Kovačević", "Şahin", "Pérez", "Görög", "Brontë", "Jäger", "Nørgaard", "Ibáñez", "Ferrão",
              "Čapek", "Ólafsdóttir", "Strauß", "Hernández", "Łęcki", "Blanchère", "Gómez", "Öztürk")
OTHER_NAMES = ("Иван Петров", "Ольга Смирнова", "Дмитрий Орлов", "Анна Волкова", "Νίκος Παππάς",
               "Ελένη Γεωργίου", "Σοφία Νικολάου", "Мария Соколова")
UNICODE_CITIES = ("Zürich", "São Paulo", "Kraków", "Malmö", "Reykjavík", "Bogotá", "Düsseldorf", "Córdoba",
                  "Genève", "Brașov", "Tromsø", "Mérida", "Göteborg", "Łódź", "Curaçao", "Örebro", "Málaga",
                  "Besançon", "東京", "北京", "上海", "大阪", "京都", "札幌", "台北", "广州", "名古屋", "福岡",
                  "杭州", "成都", "서울", "부산", "인천", "Москва", "Казань", "Αθήνα", "Θεσσαλονίκη")
ZH_WORDS = ("茶", "咖啡", "面条", "熊猫", "长城", "书法", "太极", "饺子", "火锅", "京剧", "丝绸", "瓷器",
            "围棋", "风筝", "月饼", "竹子", "龙舟", "剪纸")
JA_WORDS = ("寿司", "桜", "ラーメン", "折り紙", "抹茶", "温泉", "漫画", "着物", "花火", "富士山", "てんぷら",
            "おにぎり", "こけし", "すし", "盆栽", "将棋", "俳句", "うどん")
KO_WORDS = ("김치", "한글", "비빔밥", "태권도", "한복", "떡볶이")
LATIN_WORDS = ("café", "crème brûlée", "smörgåsbord", "jalapeño", "piñata", "fjörd", "façade", "naïve art",
               "über", "açaí", "pâté", "déjà vu", "Fußball", "Käse", "müsli", "señor", "crêpes", "São João")
UNICODE_WORDS = ZH_WORDS + JA_WORDS + KO_WORDS + LATIN_WORDS


def unicode_person(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.25:
        return rng.choice(ZH_SURNAMES) + "".join(rng.choice(ZH_GIVEN) for _ in range(rng.randint(1, 2)))
    if r < 0.45:
        return rng.choice(JA_SURNAMES) + rng.choice(("", " ")) + rng.choice(JA_GIVEN)
    if r < 0.55:
        return rng.choice(KO_SURNAMES) + rng.choice(KO_GIVEN)
    if r < 0.92:
        return f"{rng.choice(LATIN_FIRST)} {rng.choice(LATIN_LAST)}"
    return rng.choice(OTHER_NAMES)


def unicode_word(rng: random.Random) -> str:
    return rng.choice(UNICODE_WORDS)


def unicode_topic(rng: random.Random) -> str:
    w = unicode_word(rng)
    return rng.choice(("{w}", "{w} recipes", "history of {w}", "best {w} in {c}", "{w} for beginners",
                       "facts about {w}", "{w} {y}")).format(w=w, c=rng.choice(CITIES + UNICODE_CITIES),
                                                             y=rng.randint(2015, 2026))


def unicode_title(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return "".join(rng.choice(ZH_GIVEN + ZH_WORDS) for _ in range(rng.randint(2, 4)))
    if r < 0.55:
        return rng.choice(JA_WORDS) + rng.choice(("の", "と")) + rng.choice(JA_WORDS + JA_GIVEN)
    if r < 0.65:
        return rng.choice(KO_WORDS) + " " + rng.choice(KO_WORDS)
    return rng.choice(("Le", "La", "Der", "Die", "El", "O")) + " " + rng.choice(
        ("Château", "Jardín", "Mädchen", "Forêt", "Größe", "Niño", "Coração", "Lumière", "Straße", "Señal",
         "Éclair", "Sjö", "Fénix", "Måne")) + rng.choice(("", " " + rng.choice(LATIN_LAST)))


ZH_ORG_PARTS = tuple("华星长江明日天元东方金龙新宏泰安信达盛恒瑞丰光远海山云中联合创博文飞腾嘉")
ZH_ORG_SUFFIXES = ("集团", "公司", "科技", "有限公司", "银行", "贸易", "实业", "传媒", "书局", "食品")
JA_ORG_HEADS = ("さくら", "ひかり", "みどり", "あおば", "つばさ", "かえで", "やまと", "なごみ", "はなび", "こだま",
                "すずらん", "山田", "東洋", "大和", "富士", "三つ星", "北斗", "日之出", "青空", "旭")
JA_ORG_SUFFIXES = ("株式会社", "商事", "工業", "書店", "製作所", "銀行", "電機", "食品", "出版", "物産")
KO_ORG = ("한빛", "새벽", "푸른", "다온", "하늘", "누리", "별빛")
KO_ORG_SUFFIXES = ("상사", "전자", "은행", "식품", "출판")
LATIN_ORGS = ("Café Lumière", "Müller & Söhne", "Pâtisserie Étoile", "Łódź Logistyka", "Brød og Smør",
              "Ñandú Diseño", "Håndverk Ås", "Örnsköld Byggnad", "Peña Hermanos", "Crème Atelier",
              "Dvořák Strojírny", "Gonçalves Têxteis", "Bäckerei Kühn", "Éditions Légère", "Søndergård Fisk",
              "Şahin Tekstil", "Čokoláda Brno", "Jäger Maschinenbau")
ASCII_ORGS = ("Blue Harbor", "Northwind", "Iron Clock", "Silver Road", "Golden Kite", "Quiet Forest",
              "Bright Mirror", "Acme", "Redwood", "Tidewater")
ASCII_ORG_SUFFIXES = ("Ltd", "Inc", "Group", "Labs", "Co", "Partners", "Studio", "Foods")
GLOSS_HEADS = ("Star", "River", "Dawn", "Golden", "East", "Bright", "Cloud", "Sun", "Blue Sky", "Cherry",
               "Light", "Green Leaf", "Dragon", "Harbor", "Maple", "Morning")
GLOSS_TAILS = ("Group", "Company", "Corporation", "Trading", "Bank", "Industries", "Books", "Foods",
               "Electric", "Media", "Holdings", "Works")
NATIONS = {"zh": ("Chinese", "Taiwanese", "Shanghai-based", "Beijing"), "ja": ("Japanese", "Osaka-based", "Tokyo"),
           "ko": ("Korean", "Seoul-based"), "latin": ("French", "German", "Polish", "Norwegian", "Spanish",
                                                       "Portuguese", "Czech", "Turkish", "Danish", "Swedish"),
           "ascii": ("British", "American", "Canadian", "Australian", "local")}
INDUSTRIES = ("technology", "shipping", "food", "publishing", "textile", "banking", "software", "robotics",
              "retail", "design", "logistics", "tea", "furniture", "toy", "bicycle", "energy", "media", "farming")
FIRMS = ("company", "firm", "startup", "group", "business", "cooperative", "studio", "maker", "supplier")


def organisation(rng: random.Random) -> tuple[str, str | None, str]:
    """(name as written in its language, an English gloss or None, a short description)."""
    r = rng.random()
    if r < 0.3:
        lang, name = "zh", "".join(rng.sample(ZH_ORG_PARTS, rng.randint(2, 3))) + rng.choice(ZH_ORG_SUFFIXES)
    elif r < 0.55:
        head, tail = rng.choice(JA_ORG_HEADS), rng.choice(JA_ORG_SUFFIXES)
        lang, name = "ja", (tail + head if tail == "株式会社" and rng.random() < 0.3 else head + tail)
    elif r < 0.62:
        lang, name = "ko", rng.choice(KO_ORG) + rng.choice(KO_ORG_SUFFIXES)
    elif r < 0.8:
        lang, name = "latin", rng.choice(LATIN_ORGS)
    else:
        lang, name = "ascii", f"{rng.choice(ASCII_ORGS)} {rng.choice(ASCII_ORG_SUFFIXES)}"
    gloss = None
    if lang in ("zh", "ja", "ko") and rng.random() < 0.7:
        gloss = f"{rng.choice(GLOSS_HEADS)} {rng.choice(GLOSS_TAILS)}"
    nation = rng.choice(NATIONS[lang])
    article = "an" if nation[0] in "AEIOU" else "a"
    return name, gloss, f"{article} {nation} {rng.choice(INDUSTRIES)} {rng.choice(FIRMS)}"


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
