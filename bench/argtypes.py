"""argparse types of the bench's options: a bad value is a usage error (status 2, one line),
never a traceback after the model loaded."""

from __future__ import annotations

import argparse
import math


def count(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated integers >= 1."""
    return [count(part.strip()) for part in text.split(",") if part.strip()] or [count(text)]


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (sys.setswitchinterval refuses 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def latency(text: str) -> tuple[float, float]:
    """"LO" or "LO,HI" seconds, 0 <= LO <= HI."""
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO or LO,HI in seconds") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else parts if len(parts) == 2 else (-1.0, -1.0)
    if not 0 <= lo <= hi or hi != hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO or LO,HI seconds with 0 <= LO <= HI")
    return lo, hi
