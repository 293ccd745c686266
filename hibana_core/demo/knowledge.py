"""World knowledge an agent model needs to fill tool arguments (corpus v4, issue 15).

A question says "250 Swiss francs", "in German", "for Peru", "half a kilo", "a fortnight", "3pm";
the tool wants `CHF`, `de`, `PE`, 500 (grams), 14 (days), "15:00". These tables and generators
give every such value with the ways people say it, from the standards themselves (ISO 4217, 639-1
and 3166 through pycountry, a well-kept copy of the ISO tables) plus the colloquial names and
symbols of the currencies people use most, number words, and units. Nothing here comes from the
held-out set: it is what any agent model is expected to know.

Each generator returns `(value, said)`: the JSON value the tool takes and the words that state it.
"""

from __future__ import annotations

import functools
import random
import re

import pycountry

# --- currencies (ISO 4217) -------------------------------------------------------------------------

COLLOQUIAL = {
    "USD": ("US dollars", "dollars", "American dollars", "U.S. dollars"), "EUR": ("euros",),
    "GBP": ("British pounds", "pounds sterling", "pounds"), "JPY": ("Japanese yen", "yen"),
    "CHF": ("Swiss francs",), "CAD": ("Canadian dollars",), "AUD": ("Australian dollars",),
    "NZD": ("New Zealand dollars",), "CNY": ("Chinese yuan", "yuan", "renminbi"), "INR": ("Indian rupees", "rupees"),
    "MXN": ("Mexican pesos",), "BRL": ("Brazilian reais", "reais"), "ZAR": ("South African rand", "rand"),
    "SEK": ("Swedish kronor",), "NOK": ("Norwegian kroner",), "DKK": ("Danish kroner",), "PLN": ("Polish zloty",),
    "TRY": ("Turkish lira",), "RUB": ("Russian rubles",), "KRW": ("South Korean won", "Korean won"),
    "THB": ("Thai baht", "baht"), "SGD": ("Singapore dollars",), "HKD": ("Hong Kong dollars",),
    "CZK": ("Czech koruna",), "HUF": ("Hungarian forint", "forints"), "ILS": ("Israeli shekels", "shekels"),
    "PHP": ("Philippine pesos",), "IDR": ("Indonesian rupiah", "rupiah"), "MYR": ("Malaysian ringgit", "ringgit"),
    "VND": ("Vietnamese dong",), "EGP": ("Egyptian pounds",), "NGN": ("Nigerian naira", "naira"),
    "KES": ("Kenyan shillings",), "ARS": ("Argentine pesos",), "CLP": ("Chilean pesos",), "COP": ("Colombian pesos",),
    "AED": ("UAE dirhams", "dirhams"), "SAR": ("Saudi riyals",), "PKR": ("Pakistani rupees",), "UAH": ("hryvnias",),
    "ISK": ("Icelandic krónur", "Icelandic kronur"), "RON": ("Romanian lei",), "TWD": ("Taiwan dollars",),
    "MAD": ("Moroccan dirhams",), "PEN": ("Peruvian soles", "soles"), "BDT": ("taka",)}
SYMBOLS = {"USD": ("$", "US$"), "EUR": ("€",), "GBP": ("£",), "JPY": ("¥",), "INR": ("₹",), "KRW": ("₩",),
           "RUB": ("₽",), "TRY": ("₺",), "ILS": ("₪",), "VND": ("₫",), "PHP": ("₱",), "THB": ("฿",), "UAH": ("₴",),
           "NGN": ("₦",), "BRL": ("R$",), "CAD": ("C$", "CA$"), "AUD": ("A$", "AU$"), "NZD": ("NZ$",),
           "HKD": ("HK$",), "SGD": ("S$",), "MXN": ("MX$",), "PLN": ("zł",)}
"""Symbols written before the amount ("€40", "R$ 12"); "¥" is the yen here (also the yuan's)."""
_PLURALS = {"Dollar", "Franc", "Peso", "Pound", "Rupee", "Dinar", "Rial", "Riyal", "Dirham", "Shilling", "Ruble"}
_FUNDS = re.compile(r"Unit|Unidad|Fund|SDR|reserved|no currency|Next day|Gold|Silver|Platinum|Palladium|WIR|Mvdol|Sucre")


@functools.cache
def currencies() -> dict[str, tuple[str, ...]]:
    """ISO 4217 code -> the names that say it: ISO's own name, the colloquial ones, the plural."""
    out = {}
    for c in pycountry.currencies:
        if _FUNDS.search(c.name):
            continue
        names = [c.name]
        if c.name.split()[-1] in _PLURALS:
            names.append(f"{c.name}s")
        out[c.alpha_3] = tuple(dict.fromkeys((*names, *COLLOQUIAL.get(c.alpha_3, ()))))
    return out


COMMON_CURRENCIES = tuple(COLLOQUIAL)


def currency(rng: random.Random) -> tuple[str, str, str]:
    """(code, how it is said, "name" | "symbol" | "code"): common currencies 70% of the time."""
    code = rng.choice(COMMON_CURRENCIES) if rng.random() < 0.7 else rng.choice(tuple(currencies()))
    r = rng.random()
    if r < 0.2 and code in SYMBOLS:
        return code, rng.choice(SYMBOLS[code]), "symbol"
    if r < 0.35:
        return code, code, "code"
    return code, rng.choice(currencies()[code]), "name"


def money(rng: random.Random) -> tuple[float | int, str, str]:
    """(amount, currency code, "250 Swiss francs" | "€40" | "USD 1,200.50")."""
    amount = round(rng.uniform(1, 5000), rng.choice((0, 0, 2))) if rng.random() < 0.8 else rng.randint(5000, 250000)
    amount = int(amount) if amount == int(amount) else amount
    written = f"{amount:,}" if amount >= 1000 and rng.random() < 0.5 else str(amount)
    if isinstance(amount, float) and rng.random() < 0.5:
        written = f"{amount:,.2f}" if "," in written else f"{amount:.2f}"
    code, said, form = currency(rng)
    if form == "symbol":
        return amount, code, f"{said}{written}" if rng.random() < 0.8 else f"{said} {written}"
    if form == "code" and rng.random() < 0.5:
        return amount, code, f"{code} {written}"
    return amount, code, f"{written} {said}"


# --- languages (ISO 639-1) and countries (ISO 3166-1) ------------------------------------------------

@functools.cache
def languages() -> dict[str, str]:
    """ISO 639-1 code -> its English name ("Modern Greek (1453-)" -> "Greek", "Spanish; Castilian" -> "Spanish")."""
    out = {}
    for lang in pycountry.languages:
        code = getattr(lang, "alpha_2", None)
        if code:
            name = re.sub(r"\s*\(.*\)", "", lang.name.split(";")[0]).removeprefix("Modern ").strip()
            out[code] = name
    return out


COMMON_LANGUAGES = ("en", "fr", "de", "es", "it", "pt", "nl", "sv", "no", "da", "fi", "pl", "cs", "ru", "uk", "el",
                    "tr", "ar", "he", "hi", "bn", "ur", "zh", "ja", "ko", "vi", "th", "id", "ms", "sw", "ro", "hu")


def language(rng: random.Random) -> tuple[str, str]:
    code = rng.choice(COMMON_LANGUAGES) if rng.random() < 0.6 else rng.choice(tuple(languages()))
    return code, languages()[code]


@functools.cache
def countries() -> dict[str, str]:
    """ISO 3166-1 alpha-2 code -> the name people use ("Korea, Republic of" -> "South Korea")."""
    out = {}
    for c in pycountry.countries:
        name = getattr(c, "common_name", None) or c.name
        if "," not in name and "(" not in name:
            out[c.alpha_2] = name
    return out


def country(rng: random.Random) -> tuple[str, str]:
    code = rng.choice(tuple(countries()))
    return code, countries()[code]


@functools.cache
def us_states() -> tuple[str, ...]:
    return tuple(sorted(s.code.removeprefix("US-") for s in pycountry.subdivisions.get(country_code="US")
                        if s.type == "State"))


# --- numbers, durations, quantities, clock times ---------------------------------------------------

ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
AMOUNT_WORDS = {2: ("a couple of", "a pair of"), 12: ("a dozen",), 6: ("half a dozen",), 24: ("two dozen",),
                100: ("a hundred",), 1000: ("a thousand",)}


def number_words(n: int) -> str:
    """0-999 in words: 42 -> "forty-two", 305 -> "three hundred and five"."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + (f"-{ONES[n % 10]}" if n % 10 else "")
    rest = n % 100
    return f"{ONES[n // 100]} hundred" + (f" and {number_words(rest)}" if rest else "")


def count(rng: random.Random, lo: int = 1, hi: int = 40) -> tuple[int, str]:
    """A count as digits (60%), in words, or an amount phrase ("a dozen")."""
    r = rng.random()
    if r < 0.15:
        choices = [n for n in AMOUNT_WORDS if lo <= n <= hi]
        if choices:
            n = rng.choice(choices)
            return n, rng.choice(AMOUNT_WORDS[n])
    n = rng.randint(lo, hi)
    return n, number_words(n) if r < 0.4 and n < 1000 else str(n)


# unit -> (size in the base unit, names); the base units are minutes, grams, metres, millilitres. Only
# metric units and time: a conversion is a whole multiple or a shift of the decimal point.
DURATION_UNITS = {"seconds": (1 / 60, ("seconds", "secs", "s")), "minutes": (1, ("minutes", "mins", "min")),
                  "hours": (60, ("hours", "hrs", "h")), "days": (1440, ("days",)), "weeks": (10080, ("weeks",))}
DURATION_PHRASES = {  # minutes -> ways to say it
    30: ("half an hour", "thirty minutes"), 60: ("an hour", "one hour", "sixty minutes"), 90: ("an hour and a half",
    "ninety minutes", "1.5 hours"), 15: ("a quarter of an hour", "fifteen minutes"), 45: ("three quarters of an hour",),
    120: ("two hours", "a couple of hours"), 1440: ("a day", "one day", "24 hours"), 2880: ("two days", "48 hours"),
    10080: ("a week", "one week", "seven days"), 20160: ("two weeks", "a fortnight", "fourteen days"),
    4320: ("three days",), 30240: ("three weeks",), 720: ("twelve hours", "half a day")}
WEIGHT_UNITS = {"grams": (1, ("grams", "g")), "kilograms": (1000, ("kilograms", "kg", "kilos")),
                "tonnes": (1_000_000, ("tonnes", "metric tons", "t"))}
WEIGHT_PHRASES = {500: ("half a kilo", "half a kilogram"), 250: ("a quarter kilo",), 1000: ("a kilo", "one kilogram"),
                  1500: ("a kilo and a half", "1.5 kilos"), 2000: ("two kilos",)}
LENGTH_UNITS = {"metres": (1, ("metres", "meters", "m")), "centimetres": (0.01, ("centimetres", "centimeters", "cm")),
                "kilometres": (1000, ("kilometres", "kilometers", "km")), "millimetres": (0.001, ("mm",))}
LENGTH_PHRASES = {500: ("half a kilometre", "half a kilometer"), 1000: ("a kilometre", "one kilometer"),
                  100: ("a hundred metres",), 0.5: ("half a metre", "50 cm")}
VOLUME_UNITS = {"millilitres": (1, ("millilitres", "milliliters", "ml")), "litres": (1000, ("litres", "liters", "l"))}
VOLUME_PHRASES = {500: ("half a litre", "half a liter"), 1000: ("a litre", "one liter"), 250: ("a quarter litre",),
                  1500: ("a litre and a half",), 330: ("a can's worth (330 ml)",)}
QUANTITIES = {"duration": (DURATION_UNITS, DURATION_PHRASES), "weight": (WEIGHT_UNITS, WEIGHT_PHRASES),
              "length": (LENGTH_UNITS, LENGTH_PHRASES), "volume": (VOLUME_UNITS, VOLUME_PHRASES)}


def _clean(x: float) -> int | float:
    x = round(x, 3)
    return int(x) if x == int(x) else x


def quantity(rng: random.Random, kind: str, unit: str, integer: bool) -> tuple[int | float, str]:
    """A quantity in the schema's `unit`, said in the same unit, another one, or a phrase.

    "2 hours" for minutes -> 120; "half a kilo" for grams -> 500; "1.5 kg" for grams -> 1500. Only
    values that are whole in `unit` when the schema wants an integer."""
    units, phrases = QUANTITIES[kind]
    size = units[unit][0]
    r = rng.random()
    whole = [b for b in phrases if (b / size) == int(b / size) or not integer]
    if r < 0.25 and whole:
        base = rng.choice(whole)
        return _clean(base / size), rng.choice(phrases[base])
    if r < 0.55:                                        # another unit: a whole number of it
        other = rng.choice(tuple(units))
        osize, names = units[other]
        n = rng.choice((1, 2, 3, 5, 10, 15, 20, 30, 45, 90, 100, 250, 500, 750)) if osize < size else rng.randint(1, 12)
        value = n * osize / size
        exact = value == int(value) if integer else abs(value - round(value, 3)) < 1e-9
        if exact and value >= (1 if integer else 0.001):
            name = rng.choice(names)
            name = name[:-1] if n == 1 and len(name) > 3 else name          # "1 litre", "one week"
            return _clean(value), f"{n} {name}" if rng.random() < 0.8 else f"{number_words(n)} {name}"
    n = rng.randint(1, 300) if integer or rng.random() < 0.6 else round(rng.uniform(0.1, 300), 1)
    name = rng.choice(units[unit][1])
    name = name[:-1] if n == 1 and len(name) > 3 else name
    return _clean(n), f"{number_words(n)} {name}" if isinstance(n, int) and rng.random() < 0.15 else f"{n} {name}"


def clock_time(rng: random.Random) -> tuple[str, str]:
    """("HH:MM" on 24 hours, how it is said: "15:00", "3pm", "3:30 p.m.", "half past seven in the evening", "noon")."""
    h, m = rng.randint(0, 23), rng.choice((0, 0, 0, 15, 30, 45, 5, 10, 20, 40, 50))
    value = f"{h:02d}:{m:02d}"
    r = rng.random()
    if r < 0.3:
        return value, value
    if (h, m) == (12, 0) and r < 0.5:
        return value, "noon"
    h12, half = h % 12 or 12, "am" if h < 12 else "pm"
    if r < 0.75:
        suffix = rng.choice((half, half.upper(), f"{half[0]}.m.", f" {half}", f" {half[0]}.m."))
        return value, f"{h12}{suffix}" if m == 0 else f"{h12}:{m:02d}{suffix}"
    if m in (0, 15, 30, 45) and 6 <= h <= 22:
        part = "in the morning" if h < 12 else "in the afternoon" if h < 18 else "in the evening"
        words = {0: f"{ONES[h12]} o'clock", 15: f"quarter past {ONES[h12]}", 30: f"half past {ONES[h12]}",
                 45: f"quarter to {ONES[h12 % 12 + 1]}"}[m]
        if m == 45 and (h + 1) % 12 == 0:               # "quarter to twelve": noon or midnight
            return value, value
        return value, f"{words} {part}"
    return value, value
