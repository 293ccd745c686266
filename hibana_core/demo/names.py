"""Randomised tool and argument names, split between training and held-out use.

The split is by a stable hash of the exact name: a name whose CRC32 falls in the held-out bucket
never appears as a tool or argument name in the training corpus, so the held-out evaluation
measures whether the model copies names from the schema rather than recalling them.
"""

from __future__ import annotations

import random
import zlib

HELD_OUT_BUCKETS = 8
"""One name in HELD_OUT_BUCKETS (by CRC32) is reserved for the held-out evaluation."""

_SYLLABLES = ("ka", "lo", "mi", "ru", "ze", "po", "ta", "vi", "no", "sa", "qu", "bre", "dro", "fin",
              "gal", "hum", "jor", "kel", "lum", "mav", "nix", "orb", "pel", "quo", "rix", "sol",
              "tor", "ul", "vex", "wim", "yar", "zon")


def is_held_out(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELD_OUT_BUCKETS == 0


def pseudo_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(*syllables)))


def _join(rng: random.Random, words: list[str]) -> str:
    words = [w for w in words if w]
    style = rng.random()
    if style < 0.6 or len(words) == 1:
        return "_".join(words)
    if style < 0.85:
        return words[0] + "".join(w[:1].upper() + w[1:] for w in words[1:])
    return "".join(words)


_GENERIC = ("alpha", "beta", "delta", "omega", "blue", "red", "quick", "smart", "helper", "util", "main",
            "core", "zeta", "nova", "atlas", "orbit", "pixel", "spark", "echo", "nimbus", "magic", "simple")


def tool_name(rng: random.Random, verbs: tuple[str, ...], nouns: tuple[str, ...]) -> str:
    """A function name in one of the styles seen in real tool sets; a third of them say nothing
    about what the tool does, so the model must read the description and copy the name."""
    r = rng.random()
    if r < 0.35:
        words = [rng.choice(verbs), rng.choice(nouns)]
    elif r < 0.45:
        words = [rng.choice(nouns)]
    elif r < 0.55:
        words = [rng.choice(("tool", "fn", "api", "svc", "my", "do")), rng.choice(verbs), rng.choice(nouns)]
    elif r < 0.65:
        words = [rng.choice(verbs), rng.choice(nouns), rng.choice(("v2", "tool", "fn", "now", "data", "info"))]
    elif r < 0.8:
        words = rng.sample(_GENERIC, rng.randint(1, 2)) + ([str(rng.randint(1, 99))] if rng.random() < 0.3 else [])
    else:
        words = [pseudo_word(rng)] + ([rng.choice(nouns + _GENERIC)] if rng.random() < 0.5 else [])
    return _join(rng, words)


def arg_name(rng: random.Random, words: tuple[str, ...]) -> str:
    """An argument name built from words that fit its role, or an opaque one."""
    r = rng.random()
    if r < 0.45:
        return rng.choice(words)
    if r < 0.7:
        extra = rng.choice(("value", "input", "name", "param", "arg", "the", "in", "req", "str", "val"))
        parts = [extra, rng.choice(words)] if rng.random() < 0.5 else [rng.choice(words), extra]
        return _join(rng, parts)
    if r < 0.85:
        return _join(rng, [rng.choice(words), str(rng.randint(1, 9))])
    return pseudo_word(rng, (1, 3))


def pick(rng: random.Random, make, held_out: bool, taken: set[str]) -> str:
    """Draw names from `make(rng)` until one lies on the requested side of the split and is free."""
    for _ in range(1000):
        name = make(rng)
        if is_held_out(name) == held_out and name not in taken:
            taken.add(name)
            return name
    raise RuntimeError("no free name after 1000 draws; widen the name generators")
