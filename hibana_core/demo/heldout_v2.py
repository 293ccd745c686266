"""The independent held-out task set of demo model v2 (issue 15), written before v2 was trained.

Nothing here comes from the training generators (corpus.py, corpus_v2.py, tools.py, tasks.py,
world.py, names.py): its own tools, in domains no training tool covers (HELD_OUT_DOMAINS; a test
checks the split), its own phrasing, one task per line as a person would write it. Never tune on
it: it is the figure the issue's targets are measured on.

    Task        a conversation to answer: the messages so far (a follow-up carries an earlier
                exchange), the offered tools (1-8: the needed ones and distractors), the expected
                first-turn call(s), the tools' results, and what the final answer must contain
    TOOLS       name -> HeldOutTool: an OpenAI-style schema and a deterministic Python function

Kinds: "single" (one call), "parallel" (several calls in the first turn), "no_tool" (answer in
text, no call), "follow_up" (a second user turn after an earlier call and answer).
"""

from __future__ import annotations

import inspect
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from hibana_core.demo.tools import argument_type_error

HELD_OUT_DOMAINS = frozenset((
    "currency", "flights", "hotels", "nutrition", "recipes", "sports", "timezones", "cinema", "parcels",
    "transit", "car_rental", "fitness", "restaurants", "shipping_rates", "astronomy", "plants", "parking",
    "translation"))


def _h(*parts: Any) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def _one(options: tuple, *parts: Any) -> Any:
    return options[_h(*parts) % len(options)]


@dataclass(frozen=True)
class HeldOutTool:
    domain: str
    schema: dict                       # {"type": "function", "function": {...}}
    fn: Callable[..., dict]            # keyword arguments -> result
    keys: tuple[str, ...]              # result fields the final answer must quote

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def defaults(self) -> dict[str, Any]:
        """What the optional arguments are when a call leaves them out (the function's defaults)."""
        return {k: p.default for k, p in inspect.signature(self.fn).parameters.items() if p.default is not p.empty}

    def result(self, arguments: dict) -> dict:
        return self.fn(**arguments)

    def __call__(self, arguments: dict) -> str:
        """The tool as the evaluation runs it: bad arguments give an error result."""
        wrong = argument_type_error(self.schema, arguments)
        if wrong:
            return json.dumps({"error": wrong})
        try:
            return json.dumps(self.result(arguments), ensure_ascii=False)
        except (TypeError, ValueError, KeyError) as exc:
            return json.dumps({"error": str(exc) or type(exc).__name__})

    def answer_values(self, arguments: dict) -> tuple[str, ...]:
        out = self.result(arguments)
        return tuple(str(out[k]) for k in self.keys)


def _tool(domain: str, name: str, description: str, params: dict[str, dict], required: tuple[str, ...],
          keys: tuple[str, ...]) -> Callable[[Callable[..., dict]], HeldOutTool]:
    def wrap(fn: Callable[..., dict]) -> HeldOutTool:
        schema = {"type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": params, "required": list(required)}}}
        return HeldOutTool(domain, schema, fn, keys)
    return wrap


S = {"type": "string"}
I = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}


def _d(kind: dict, description: str, **extra: Any) -> dict:
    return {**kind, "description": description, **extra}


def _check(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise TypeError(f"{what} has the wrong type: {value!r}")
    return value


_RATES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.2, "CHF": 0.88, "CAD": 1.36, "AUD": 1.52, "INR": 83.1,
          "MXN": 17.05, "SEK": 10.4}


@_tool("currency", "convert_currency", "Convert an amount of money from one currency to another at today's rate.",
       {"amount": _d(N, "Amount of money to convert."),
        "from_currency": _d(S, "ISO 4217 code of the currency you have, e.g. USD."),
        "to_currency": _d(S, "ISO 4217 code of the currency you want.")},
       ("amount", "from_currency", "to_currency"), ("converted",))
def convert_currency(amount, from_currency, to_currency):
    a = _check(amount, (int, float), "amount")
    value = a / _RATES[str(from_currency).upper()] * _RATES[str(to_currency).upper()]
    return {"converted": f"{value:,.2f} {str(to_currency).upper()}", "rate_date": "today"}


_CABINS = ["economy", "premium_economy", "business", "first"]


@_tool("flights", "search_flights", "Find the cheapest flight between two airports on a date.",
       {"origin": _d(S, "Departure airport IATA code."), "destination": _d(S, "Arrival airport IATA code."),
        "date": _d(S, "Departure date, YYYY-MM-DD."), "cabin": _d(S, "Cabin class.", enum=_CABINS),
        "nonstop_only": _d(B, "Only direct flights.")},
       ("origin", "destination", "date"), ("fare", "flight"))
def search_flights(origin, destination, date, cabin="economy", nonstop_only=False):
    base = 90 + _h(origin, destination, date) % 600
    fare = base * (1, 1.6, 3.4, 6.0)[_CABINS.index(cabin)] * (1.15 if _check(nonstop_only, bool, "nonstop_only") else 1)
    code = _one(("LH", "AF", "KL", "UA", "BA", "IB", "AZ", "SK"), origin, destination, cabin)
    return {"flight": f"{code}{100 + _h(origin, date) % 900}", "fare": f"${fare:,.0f}", "stops": 0 if nonstop_only else 1}


@_tool("hotels", "find_hotel", "Look for an available hotel room.",
       {"city": _d(S, "City to stay in."), "check_in": _d(S, "Arrival date, YYYY-MM-DD."),
        "nights": _d(I, "Number of nights.", minimum=1), "guests": _d(I, "Number of guests.", minimum=1),
        "max_price": _d(N, "Highest nightly price in US dollars.")},
       ("city", "check_in", "nights"), ("hotel", "total"))
def find_hotel(city, check_in, nights, guests=1, max_price=None):
    _check(nights, int, "nights"), _check(guests, int, "guests")
    nightly = 60 + _h(city, check_in) % 180 + 15 * (guests - 1)
    if max_price is not None:
        nightly = min(nightly, int(_check(max_price, (int, float), "max_price")))
    name = _one(("The Linden", "Hotel Marlow", "Casa Verde", "Harbourview Inn", "The Alder", "Pension Rosa",
                 "Grand Meridian", "Maple Court"), city, guests)
    return {"hotel": name, "nightly": f"${nightly}", "total": f"${nightly * nights}"}


@_tool("nutrition", "nutrition_facts", "Calories and macronutrients for a portion of a food.",
       {"food": _d(S, "The food, in plain words."), "grams": _d(N, "Portion size in grams.")},
       ("food", "grams"), ("calories",))
def nutrition_facts(food, grams):
    per100 = 40 + _h(str(food).lower()) % 500
    return {"calories": f"{round(per100 * _check(grams, (int, float), 'grams') / 100)} kcal",
            "protein_g": round(per100 / 40, 1)}


@_tool("recipes", "get_recipe", "Fetch a recipe scaled to a number of servings.",
       {"dish": _d(S, "Name of the dish."), "servings": _d(I, "How many people to cook for."),
        "diet": _d(S, "Dietary restriction.", enum=["none", "vegetarian", "vegan", "gluten_free"])},
       ("dish", "servings"), ("recipe_id", "minutes"))
def get_recipe(dish, servings, diet="none"):
    _check(servings, int, "servings")
    return {"recipe_id": f"R-{_h(str(dish).lower(), diet) % 90000 + 10000}", "minutes": 15 + _h(dish) % 90,
            "servings": servings}


_LEAGUES = ["premier_league", "la_liga", "serie_a", "bundesliga", "nba", "nhl", "mlb"]


@_tool("sports", "get_match_result", "Latest result of a team in a league.",
       {"team": _d(S, "Team name."), "league": _d(S, "League.", enum=_LEAGUES)}, ("team", "league"), ("score",))
def get_match_result(team, league):
    if league not in _LEAGUES:
        raise ValueError(f"unknown league {league!r}")
    a, b = _h(team, "for") % 5, _h(team, "against") % 4
    return {"score": f"{a}-{b}", "opponent": _one(("Rovers", "United", "Athletic", "City"), team)}


@_tool("timezones", "get_local_time", "Current local time in an IANA time zone.",
       {"timezone": _d(S, "IANA zone name, e.g. Europe/Madrid.")}, ("timezone",), ("time",))
def get_local_time(timezone):
    if "/" not in _check(timezone, str, "timezone"):
        raise ValueError("use an IANA zone name such as Asia/Tokyo")
    m = _h(timezone) % 1440
    return {"time": f"{m // 60:02d}:{m % 60:02d}", "timezone": timezone}


@_tool("cinema", "find_showtimes", "Showtimes of a film at cinemas near a postcode.",
       {"movie": _d(S, "Film title."), "postcode": _d(S, "Postcode or ZIP code."),
        "date": _d(S, "Day, YYYY-MM-DD.")}, ("movie", "postcode"), ("first_showing",))
def find_showtimes(movie, postcode, date="today"):
    m = 600 + _h(movie, postcode, date) % 720
    return {"first_showing": f"{m // 60:02d}:{m % 60 // 5 * 5:02d}",
            "cinema": _one(("Odeon", "Rex", "Plaza", "Electric"), postcode)}


@_tool("parcels", "track_parcel", "Where a parcel is, by its tracking number.",
       {"tracking_number": _d(S, "The carrier's tracking number."),
        "carrier": _d(S, "Delivery company.", enum=["ups", "fedex", "dhl", "usps", "royal_mail"])},
       ("tracking_number",), ("status",))
def track_parcel(tracking_number, carrier="ups"):
    status = _one(("in transit", "out for delivery", "delivered", "held at customs", "awaiting pickup"),
                  tracking_number, carrier)
    return {"status": status, "last_scan": _one(("Leipzig hub", "Memphis hub", "local depot"), tracking_number)}


@_tool("transit", "next_departures", "Next departures of a bus, tram or metro line from a stop.",
       {"stop": _d(S, "Stop or station name."), "line": _d(S, "Line number or name."),
        "count": _d(I, "How many departures to list.", minimum=1, maximum=5)}, ("stop", "line"), ("minutes",))
def next_departures(stop, line, count=1):
    _check(count, int, "count")
    first = 1 + _h(stop, line) % 14
    return {"minutes": ", ".join(str(first + 9 * i) for i in range(count)) + " min", "line": line}


@_tool("car_rental", "quote_car_rental", "Price a rental car.",
       {"pickup_location": _d(S, "Where to pick the car up."), "days": _d(I, "Rental length in days."),
        "car_class": _d(S, "Size of car.", enum=["mini", "compact", "midsize", "suv", "van"]),
        "extra_driver": _d(B, "Add a second driver.")}, ("pickup_location", "days", "car_class"), ("quote",))
def quote_car_rental(pickup_location, days, car_class, extra_driver=False):
    daily = {"mini": 28, "compact": 35, "midsize": 44, "suv": 61, "van": 75}[car_class]
    total = daily * _check(days, int, "days") + (12 * days if _check(extra_driver, bool, "extra_driver") else 0)
    return {"quote": f"${total}", "supplier": _one(("Avis", "Sixt", "Hertz", "Europcar"), pickup_location)}


@_tool("fitness", "log_workout", "Record a workout in the user's training log.",
       {"activity": _d(S, "Type of exercise.", enum=["run", "cycle", "swim", "row", "walk", "yoga"]),
        "minutes": _d(I, "Duration in minutes."), "distance_km": _d(N, "Distance covered, in kilometres.")},
       ("activity", "minutes"), ("entry_id",))
def log_workout(activity, minutes, distance_km=None):
    _check(minutes, int, "minutes")
    return {"entry_id": f"W{_h(activity, minutes, distance_km) % 9000 + 1000}", "saved": True}


@_tool("restaurants", "reserve_table", "Book a table at a restaurant.",
       {"restaurant": _d(S, "Restaurant name."), "party_size": _d(I, "Number of people."),
        "time": _d(S, "24-hour time, HH:MM."), "date": _d(S, "Date, YYYY-MM-DD."),
        "outdoor": _d(B, "Sit outside if possible.")}, ("restaurant", "party_size", "time"), ("confirmation",))
def reserve_table(restaurant, party_size, time, date="today", outdoor=False):
    _check(party_size, int, "party_size")
    return {"confirmation": f"TB-{_h(restaurant, party_size, time, date) % 900000 + 100000}"}


@_tool("shipping_rates", "estimate_shipping", "Cost to post a package abroad.",
       {"weight_kg": _d(N, "Package weight in kilograms."), "country": _d(S, "Destination country."),
        "express": _d(B, "Use express delivery.")}, ("weight_kg", "country"), ("cost",))
def estimate_shipping(weight_kg, country, express=False):
    w = _check(weight_kg, (int, float), "weight_kg")
    cost = (8 + _h(country) % 20 + 4.5 * w) * (1.8 if _check(express, bool, "express") else 1)
    return {"cost": f"€{cost:.2f}", "days": 2 if express else 6}


@_tool("astronomy", "sun_times", "Sunrise and sunset for a place and day.",
       {"place": _d(S, "Town or city."), "date": _d(S, "Day, YYYY-MM-DD.")}, ("place", "date"), ("sunrise", "sunset"))
def sun_times(place, date):
    r, s = 300 + _h(place, date, "r") % 240, 1020 + _h(place, date, "s") % 240
    return {"sunrise": f"{r // 60:02d}:{r % 60:02d}", "sunset": f"{s // 60:02d}:{s % 60:02d}"}


@_tool("plants", "plant_care", "Care advice for a house plant.",
       {"species": _d(S, "Common or Latin name of the plant.")}, ("species",), ("water_every",))
def plant_care(species):
    return {"water_every": f"{3 + _h(str(species).lower()) % 12} days",
            "light": _one(("bright indirect", "full sun", "shade"), species)}


@_tool("parking", "parking_availability", "Free spaces in car parks near an address.",
       {"address": _d(S, "Street address."), "ev_charging": _d(B, "Only spaces with a charger.")},
       ("address",), ("free_spaces",))
def parking_availability(address, ev_charging=False):
    return {"free_spaces": _h(address, ev_charging) % 120, "garage": _one(("Q-Park", "NCP", "Indigo"), address)}


@_tool("translation", "translate", "Translate text into another language.",
       {"text": _d(S, "What to translate."),
        "target_language": _d(S, "Language code.", enum=["es", "fr", "de", "it", "pt", "ja", "nl"])},
       ("text", "target_language"), ("translation",))
def translate(text, target_language):
    return {"translation": f"[{target_language}] {_check(text, str, 'text')}"}


@_tool("flights", "flight_status", "Live status of a flight by its number.",
       {"flight_number": _d(S, "Airline code and number, e.g. BA117.")}, ("flight_number",), ("status",))
def flight_status(flight_number):
    late = _h(flight_number) % 50
    return {"status": "on time" if late < 10 else f"delayed {late} min", "gate": f"B{_h(flight_number, 'g') % 40}"}


@_tool("fitness", "compare_prices", "Compare gym membership prices of several gyms.",
       {"gyms": {"type": "array", "items": {"type": "string"}, "description": "Gym names."},
        "months": _d(I, "Membership length in months.")}, ("gyms", "months"), ("cheapest",))
def compare_prices(gyms, months):
    _check(months, int, "months")
    if not isinstance(gyms, list) or not gyms:
        raise TypeError("gyms must be a non-empty list")
    best = min(gyms, key=lambda g: _h(g, months))
    return {"cheapest": best, "price": f"${20 + _h(best, months) % 40}/month"}


@_tool("sports", "league_table", "Top of a league's table.",
       {"league": _d(S, "League.", enum=_LEAGUES), "top": _d(I, "How many teams to list.")}, ("league",), ("leader",))
def league_table(league, top=3):
    if league not in _LEAGUES:
        raise ValueError(f"unknown league {league!r}")
    return {"leader": _one(("Arsenal", "Girona", "Inter", "Leverkusen", "Celtics", "Rangers", "Dodgers"), league),
            "shown": top}


@_tool("cinema", "movie_rating", "Audience rating of a film.",
       {"title": _d(S, "Film title."), "year": _d(I, "Release year, to tell remakes apart.")}, ("title",), ("rating",))
def movie_rating(title, year=None):
    return {"rating": f"{5 + _h(str(title).lower(), year) % 45 / 10:.1f}/10"}


@_tool("recipes", "pantry_recipes", "Suggest a dish that uses the given ingredients.",
       {"ingredients": {"type": "array", "items": {"type": "string"}, "description": "What is in the kitchen."},
        "max_minutes": _d(I, "Longest cooking time.")}, ("ingredients",), ("dish",))
def pantry_recipes(ingredients, max_minutes=60):
    if not isinstance(ingredients, list) or not all(isinstance(i, str) for i in ingredients):
        raise TypeError("ingredients must be a list of strings")
    return {"dish": _one(("frittata", "stir-fry", "risotto", "shakshuka", "curry", "gratin", "quesadilla"),
                         *sorted(ingredients)), "minutes": min(max_minutes, 20 + _h(*ingredients) % 40)}


TOOLS: dict[str, HeldOutTool] = {t.name: t for t in (
    convert_currency, search_flights, find_hotel, nutrition_facts, get_recipe, get_match_result, get_local_time,
    find_showtimes, track_parcel, next_departures, quote_car_rental, log_workout, reserve_table, estimate_shipping,
    sun_times, plant_care, parking_availability, translate, flight_status, compare_prices, league_table,
    movie_rating, pantry_recipes)}


# --- the tasks -----------------------------------------------------------------------------------
#
# (question, [(tool, arguments), ...], distractor count); arguments as the question gives them,
# some derived ("a dozen" -> 12, "a week" -> 7, "non-stop" -> true, "Tokyo" -> "Asia/Tokyo").

_SINGLE = [
    ("How much is 250 US dollars in euros?", [("convert_currency", {"amount": 250, "from_currency": "USD", "to_currency": "EUR"})], 2),
    ("I have 1,200 Swedish kronor left over. What's that in British pounds?", [("convert_currency", {"amount": 1200, "from_currency": "SEK", "to_currency": "GBP"})], 3),
    ("convert 89.99 CAD to USD please", [("convert_currency", {"amount": 89.99, "from_currency": "CAD", "to_currency": "USD"})], 0),
    ("What would ¥50000 be in Australian dollars?", [("convert_currency", {"amount": 50000, "from_currency": "JPY", "to_currency": "AUD"})], 5),
    ("My rent is 18,500 pesos (MXN). How many dollars is that?", [("convert_currency", {"amount": 18500, "from_currency": "MXN", "to_currency": "USD"})], 1),
    ("Roughly how many rupees do I get for 40 Swiss francs?", [("convert_currency", {"amount": 40, "from_currency": "CHF", "to_currency": "INR"})], 4),
    ("Find me a flight from LIS to AMS on 2027-03-14.", [("search_flights", {"origin": "LIS", "destination": "AMS", "date": "2027-03-14"})], 2),
    ("Cheapest business class seat JFK to LHR, 2027-01-09?", [("search_flights", {"origin": "JFK", "destination": "LHR", "date": "2027-01-09", "cabin": "business"})], 3),
    ("I need a non-stop flight from SFO to SEA on 2027-02-20.", [("search_flights", {"origin": "SFO", "destination": "SEA", "date": "2027-02-20", "nonstop_only": True})], 1),
    ("Any first class fares from DXB to SIN on 2027-05-02? Direct only.", [("search_flights", {"origin": "DXB", "destination": "SIN", "date": "2027-05-02", "cabin": "first", "nonstop_only": True})], 4),
    ("Look up premium economy from MAD to BOG for 2027-07-30.", [("search_flights", {"origin": "MAD", "destination": "BOG", "date": "2027-07-30", "cabin": "premium_economy"})], 6),
    ("Is BA117 on time?", [("flight_status", {"flight_number": "BA117"})], 2),
    ("what's the status of flight LH 400? (LH400)", [("flight_status", {"flight_number": "LH400"})], 0),
    ("Check whether UA885 is delayed.", [("flight_status", {"flight_number": "UA885"})], 5),
    ("Find a hotel in Vienna from 2027-04-10 for 3 nights.", [("find_hotel", {"city": "Vienna", "check_in": "2027-04-10", "nights": 3})], 2),
    ("We're two people looking for a room in Porto, checking in 2027-06-01, staying a week.", [("find_hotel", {"city": "Porto", "check_in": "2027-06-01", "nights": 7, "guests": 2})], 3),
    ("Hotel in Edinburgh, one night, 2027-08-15, nothing over 120 dollars a night.", [("find_hotel", {"city": "Edinburgh", "check_in": "2027-08-15", "nights": 1, "max_price": 120})], 1),
    ("Book-search: Valencia, 4 guests, 2 nights from 2027-09-09.", [("find_hotel", {"city": "Valencia", "check_in": "2027-09-09", "nights": 2, "guests": 4})], 7),
    ("How many calories are in 150 grams of salmon?", [("nutrition_facts", {"food": "salmon", "grams": 150})], 2),
    ("calories in 30g of almonds?", [("nutrition_facts", {"food": "almonds", "grams": 30})], 0),
    ("I ate half a kilo of watermelon. How many calories was that?", [("nutrition_facts", {"food": "watermelon", "grams": 500})], 3),
    ("Nutrition info for 85 grams of cheddar, please.", [("nutrition_facts", {"food": "cheddar", "grams": 85})], 4),
    ("Give me a lasagne recipe for 6 people.", [("get_recipe", {"dish": "lasagne", "servings": 6})], 2),
    ("I need a vegan chili recipe that serves four.", [("get_recipe", {"dish": "chili", "servings": 4, "diet": "vegan"})], 3),
    ("Gluten-free pancakes for 2?", [("get_recipe", {"dish": "pancakes", "servings": 2, "diet": "gluten_free"})], 1),
    ("Recipe for paella, a dozen guests.", [("get_recipe", {"dish": "paella", "servings": 12})], 5),
    ("I've got eggs, spinach and feta. What can I cook?", [("pantry_recipes", {"ingredients": ["eggs", "spinach", "feta"]})], 2),
    ("Suggest something with rice, chicken, peppers and onion that takes at most 30 minutes.", [("pantry_recipes", {"ingredients": ["rice", "chicken", "peppers", "onion"], "max_minutes": 30})], 3),
    ("How did Arsenal do in their last Premier League game?", [("get_match_result", {"team": "Arsenal", "league": "premier_league"})], 2),
    ("Score of the last Lakers game (NBA)?", [("get_match_result", {"team": "Lakers", "league": "nba"})], 1),
    ("Did Napoli win in Serie A last weekend?", [("get_match_result", {"team": "Napoli", "league": "serie_a"})], 4),
    ("Who's top of La Liga right now?", [("league_table", {"league": "la_liga"})], 2),
    ("Show me the top 5 of the Bundesliga.", [("league_table", {"league": "bundesliga", "top": 5})], 3),
    ("What time is it in Asia/Tokyo?", [("get_local_time", {"timezone": "Asia/Tokyo"})], 2),
    ("Current time in America/Chicago?", [("get_local_time", {"timezone": "America/Chicago"})], 0),
    ("Tell me the local time for the Europe/Madrid zone.", [("get_local_time", {"timezone": "Europe/Madrid"})], 5),
    ("When is Dune showing near postcode N1 9GU?", [("find_showtimes", {"movie": "Dune", "postcode": "N1 9GU"})], 2),
    ("Showtimes for Paddington near 94110 on 2027-02-06", [("find_showtimes", {"movie": "Paddington", "postcode": "94110", "date": "2027-02-06"})], 3),
    ("How well rated is the film Arrival?", [("movie_rating", {"title": "Arrival"})], 2),
    ("What's the audience rating of Solaris, the 1972 one?", [("movie_rating", {"title": "Solaris", "year": 1972})], 4),
    ("Where is my parcel 1Z999AA10123456784?", [("track_parcel", {"tracking_number": "1Z999AA10123456784"})], 2),
    ("Track DHL shipment JD014600003828.", [("track_parcel", {"tracking_number": "JD014600003828", "carrier": "dhl"})], 3),
    ("Has my FedEx package 7712 3456 7890 been delivered? Number is 771234567890.", [("track_parcel", {"tracking_number": "771234567890", "carrier": "fedex"})], 1),
    ("When's the next number 14 bus from Market Street?", [("next_departures", {"stop": "Market Street", "line": "14"})], 2),
    ("Next three U2 trains from Alexanderplatz?", [("next_departures", {"stop": "Alexanderplatz", "line": "U2", "count": 3})], 4),
    ("How much to rent an SUV at Denver airport for 5 days?", [("quote_car_rental", {"pickup_location": "Denver airport", "days": 5, "car_class": "suv"})], 2),
    ("Compact car from Faro, two weeks, with a second driver.", [("quote_car_rental", {"pickup_location": "Faro", "days": 14, "car_class": "compact", "extra_driver": True})], 3),
    ("Price a van in Glasgow for a weekend (2 days).", [("quote_car_rental", {"pickup_location": "Glasgow", "days": 2, "car_class": "van"})], 6),
    ("Log a 45 minute run, 8.2 km.", [("log_workout", {"activity": "run", "minutes": 45, "distance_km": 8.2})], 2),
    ("I just did an hour of yoga, please record it.", [("log_workout", {"activity": "yoga", "minutes": 60})], 1),
    ("Add a swim to my log: 30 minutes, 1.5 kilometres.", [("log_workout", {"activity": "swim", "minutes": 30, "distance_km": 1.5})], 3),
    ("Book a table for 4 at Nopa at 19:30.", [("reserve_table", {"restaurant": "Nopa", "party_size": 4, "time": "19:30"})], 2),
    ("Reserve Dishoom for two people, 20:15 on 2027-03-03, outside if they can.", [("reserve_table", {"restaurant": "Dishoom", "party_size": 2, "time": "20:15", "date": "2027-03-03", "outdoor": True})], 4),
    ("Table for six at Sushi Zen, 18:00.", [("reserve_table", {"restaurant": "Sushi Zen", "party_size": 6, "time": "18:00"})], 7),
    ("What does it cost to send a 2.5 kg box to Canada?", [("estimate_shipping", {"weight_kg": 2.5, "country": "Canada"})], 2),
    ("Express shipping for 0.8 kg to Japan - how much?", [("estimate_shipping", {"weight_kg": 0.8, "country": "Japan", "express": True})], 3),
    ("When does the sun rise in Tromsø on 2027-01-15?", [("sun_times", {"place": "Tromsø", "date": "2027-01-15"})], 2),
    ("Sunset time in Marrakesh on 2027-06-21?", [("sun_times", {"place": "Marrakesh", "date": "2027-06-21"})], 1),
    ("How often should I water a monstera?", [("plant_care", {"species": "monstera"})], 2),
    ("Care tips for my fiddle leaf fig?", [("plant_care", {"species": "fiddle leaf fig"})], 5),
    ("Any free parking near 221B Baker Street?", [("parking_availability", {"address": "221B Baker Street"})], 2),
    ("I need a spot with an EV charger near 1 Infinite Loop.", [("parking_availability", {"address": "1 Infinite Loop", "ev_charging": True})], 3),
    ("Translate 'where is the train station' into German.", [("translate", {"text": "where is the train station", "target_language": "de"})], 2),
    ("How do you say 'good luck tomorrow' in Japanese?", [("translate", {"text": "good luck tomorrow", "target_language": "ja"})], 1),
    ("Put 'the meeting moved to Friday' into French.", [("translate", {"text": "the meeting moved to Friday", "target_language": "fr"})], 4),
    ("Which is cheapest for 12 months: FitHub, IronWorks or Pulse?", [("compare_prices", {"gyms": ["FitHub", "IronWorks", "Pulse"], "months": 12})], 2),
    ("Compare a 6-month membership at Anytime and CityGym.", [("compare_prices", {"gyms": ["Anytime", "CityGym"], "months": 6})], 3),
]

_PARALLEL = [
    ("What time is it in Europe/Paris and in America/New_York?", [("get_local_time", {"timezone": "Europe/Paris"}), ("get_local_time", {"timezone": "America/New_York"})], 2),
    ("Convert 100 EUR to USD and 100 GBP to USD.", [("convert_currency", {"amount": 100, "from_currency": "EUR", "to_currency": "USD"}), ("convert_currency", {"amount": 100, "from_currency": "GBP", "to_currency": "USD"})], 1),
    ("Calories in 100 g of rice and 100 g of pasta?", [("nutrition_facts", {"food": "rice", "grams": 100}), ("nutrition_facts", {"food": "pasta", "grams": 100})], 3),
    ("Is KL1001 on time? And AF1680?", [("flight_status", {"flight_number": "KL1001"}), ("flight_status", {"flight_number": "AF1680"})], 2),
    ("Latest results for Celtic and Rangers? Both are... let's say Premier League for this app.", [("get_match_result", {"team": "Celtic", "league": "premier_league"}), ("get_match_result", {"team": "Rangers", "league": "premier_league"})], 0),
    ("Track parcels AB123 and CD456 for me.", [("track_parcel", {"tracking_number": "AB123"}), ("track_parcel", {"tracking_number": "CD456"})], 4),
    ("Flight LIS to MAD on 2027-04-04 and a hotel in Madrid that night for 1 night.", [("search_flights", {"origin": "LIS", "destination": "MAD", "date": "2027-04-04"}), ("find_hotel", {"city": "Madrid", "check_in": "2027-04-04", "nights": 1})], 3),
    ("Sunrise in Oslo and in Rome on 2027-03-20?", [("sun_times", {"place": "Oslo", "date": "2027-03-20"}), ("sun_times", {"place": "Rome", "date": "2027-03-20"})], 2),
    ("Translate 'thank you' into Spanish and into Italian.", [("translate", {"text": "thank you", "target_language": "es"}), ("translate", {"text": "thank you", "target_language": "it"})], 1),
    ("Care info for a snake plant and for a pothos, please.", [("plant_care", {"species": "snake plant"}), ("plant_care", {"species": "pothos"})], 5),
    ("Ratings for Heat and for Alien?", [("movie_rating", {"title": "Heat"}), ("movie_rating", {"title": "Alien"})], 3),
    ("Shipping 1 kg to Brazil and 1 kg to Kenya, standard.", [("estimate_shipping", {"weight_kg": 1, "country": "Brazil"}), ("estimate_shipping", {"weight_kg": 1, "country": "Kenya"})], 2),
]

_NO_TOOL = [
    ("Thanks, that's all I needed!", 3),
    ("Can you explain in one sentence what a time zone is?", 2),
    ("Hello! Who am I talking to?", 4),
    ("What's your favourite colour?", 1),
    ("Never mind, I'll check later.", 5),
    ("Just say OK if you can read this.", 2),
    ("Good night!", 3),
    ("Do I need a passport to fly within the Schengen area? Just answer generally, no lookup.", 6),
    ("Tell me a short joke.", 0),
    ("Please don't look anything up, I just wanted to say hi.", 7),
]

# (earlier question, its call, follow-up question, the follow-up's call)
_FOLLOW_UP = [
    ("What time is it in Asia/Seoul?", ("get_local_time", {"timezone": "Asia/Seoul"}),
     "And in Australia/Sydney?", ("get_local_time", {"timezone": "Australia/Sydney"})),
    ("Convert 60 EUR to GBP.", ("convert_currency", {"amount": 60, "from_currency": "EUR", "to_currency": "GBP"}),
     "What about 60 EUR in CHF?", ("convert_currency", {"amount": 60, "from_currency": "EUR", "to_currency": "CHF"})),
    ("Calories in 200 g of oats?", ("nutrition_facts", {"food": "oats", "grams": 200}),
     "Now 200 g of banana.", ("nutrition_facts", {"food": "banana", "grams": 200})),
    ("Is DL42 on time?", ("flight_status", {"flight_number": "DL42"}),
     "Check EK7 as well.", ("flight_status", {"flight_number": "EK7"})),
    ("Find a hotel in Lyon from 2027-05-05 for 2 nights.", ("find_hotel", {"city": "Lyon", "check_in": "2027-05-05", "nights": 2}),
     "Make it 4 nights instead.", ("find_hotel", {"city": "Lyon", "check_in": "2027-05-05", "nights": 4})),
    ("Translate 'see you soon' into Dutch.", ("translate", {"text": "see you soon", "target_language": "nl"}),
     "And into Portuguese?", ("translate", {"text": "see you soon", "target_language": "pt"})),
    ("How did Juventus do in Serie A?", ("get_match_result", {"team": "Juventus", "league": "serie_a"}),
     "And Milan?", ("get_match_result", {"team": "Milan", "league": "serie_a"})),
    ("Quote a mini car in Nice for 3 days.", ("quote_car_rental", {"pickup_location": "Nice", "days": 3, "car_class": "mini"}),
     "What if I take a midsize instead?", ("quote_car_rental", {"pickup_location": "Nice", "days": 3, "car_class": "midsize"})),
    ("Where is parcel ZX81?", ("track_parcel", {"tracking_number": "ZX81"}),
     "Thanks. Also parcel QL2000?", ("track_parcel", {"tracking_number": "QL2000"})),
    ("Log a 20 minute walk.", ("log_workout", {"activity": "walk", "minutes": 20}),
     "Also a 50 minute cycle, 18 km.", ("log_workout", {"activity": "cycle", "minutes": 50, "distance_km": 18})),
    ("Sunset in Reykjavik on 2027-06-21?", ("sun_times", {"place": "Reykjavik", "date": "2027-06-21"}),
     "Same place on 2027-12-21?", ("sun_times", {"place": "Reykjavik", "date": "2027-12-21"})),
    ("Table for 2 at Lupa at 19:00.", ("reserve_table", {"restaurant": "Lupa", "party_size": 2, "time": "19:00"}),
     "Great, thanks! That's everything.", None),
    ("Rating of the film Amélie?", ("movie_rating", {"title": "Amélie"}),
     "Cool. Bye!", None),
]


@dataclass(frozen=True)
class ExpectedCall:
    tool: HeldOutTool
    arguments: dict
    result: str

    def message(self) -> dict:
        return {"type": "function", "function": {"name": self.tool.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Task:
    index: int
    kind: str
    question: str
    messages: tuple[dict, ...]                 # the conversation up to the user's (last) question
    tools: tuple[HeldOutTool, ...]             # offered, in prompt order
    turns: tuple[tuple[ExpectedCall, ...], ...]  # the expected first turn's calls (empty: no call)
    answer_keys: tuple[str, ...]               # what the final answer must contain


def _call(name: str, arguments: dict) -> ExpectedCall:
    tool = TOOLS[name]
    return ExpectedCall(tool, arguments, tool(arguments))


def _offer(index: int, needed: list[str], distractors: int) -> tuple[HeldOutTool, ...]:
    rng = random.Random(f"heldout-v2:{index}")
    others = sorted(set(TOOLS) - set(needed))
    names = list(dict.fromkeys(needed)) + rng.sample(others, min(distractors, 8 - len(set(needed))))
    rng.shuffle(names)
    return tuple(TOOLS[n] for n in names)


def _keys(calls: tuple[ExpectedCall, ...]) -> tuple[str, ...]:
    return tuple(v for c in calls for v in c.tool.answer_values(c.arguments))


def tasks() -> list[Task]:
    """Every task, in a fixed order (single, parallel, no tool, follow-up)."""
    out: list[Task] = []
    for question, calls, distractors in _SINGLE + _PARALLEL:
        expected = tuple(_call(n, a) for n, a in calls)
        kind = "parallel" if len(expected) > 1 else "single"
        out.append(Task(len(out), kind, question, ({"role": "user", "content": question},),
                        _offer(len(out), [n for n, _ in calls], distractors), (expected,), _keys(expected)))
    for question, distractors in _NO_TOOL:
        out.append(Task(len(out), "no_tool", question, ({"role": "user", "content": question},),
                        _offer(len(out), [], max(1, distractors)), ((),), ()))
    for first_q, first_call, question, call in _FOLLOW_UP:
        earlier = _call(*first_call)
        expected = (_call(*call),) if call else ()
        answer = "Here you go: " + ", ".join(_keys((earlier,))) + "."
        messages = ({"role": "user", "content": first_q},
                    {"role": "assistant", "content": "", "tool_calls": [earlier.message()]},
                    {"role": "tool", "name": earlier.tool.name, "content": earlier.result},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": question})
        needed = [first_call[0]] + ([call[0]] if call else [])
        out.append(Task(len(out), "follow_up", question, messages, _offer(len(out), needed, 2), (expected,),
                        _keys(expected)))
    return out
