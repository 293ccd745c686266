"""Cold start: the time from a process's start to its first generated token, imports included.

    startup      the interpreter and imports, until Engine.from_pretrained is called
    load         Engine.from_pretrained, by stage (`Engine.load_times`)
    first token  a one-token generation on a fresh state (a few prompt tokens)

`hibana demo` reports its own; `hibana bench` measures it in a fresh process per system
(`hibana_bench.coldstart`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from hibana_core.config import SamplingParams

if TYPE_CHECKING:
    from hibana_core.engine import Engine

PROBE_STATE = "hibana-cold-start"


@dataclass(frozen=True)
class ColdStart:
    startup_s: float
    load_s: float
    first_token_s: float
    stages: dict[str, float] = field(default_factory=dict)
    """The load's stages (`Engine.load_times`)."""

    @property
    def total_s(self) -> float:
        return self.startup_s + self.load_s + self.first_token_s

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}

    def describe(self) -> str:
        stages = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.stages.items())
        return (f"cold start {self.total_s:.2f} s to the first token: startup {self.startup_s:.2f} s "
                f"(Python and imports), load {self.load_s:.2f} s ({stages}), first token "
                f"{self.first_token_s:.2f} s")


def process_start_time() -> float | None:
    """When this process started (time.time() scale), where the OS says (Linux); else None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - int(fields[19]) / ticks  # field 22 of stat: start time in clock ticks since boot
    return time.time() - age if 0 <= age < 86400 * 365 else None


def first_token_seconds(engine) -> float:
    """Seconds until the first token of a one-token generation on a fresh state, which is
    closed again (a prompt shorter than a KV block leaves nothing in the prefix index)."""
    prompt = engine.tokenizer.encode("Hello") if engine.tokenizer is not None else []
    prompt = [t for t in prompt if 0 <= t < engine.vocab_size][:8] or [1 % engine.vocab_size]
    started = time.perf_counter()
    handle = engine.open_state(PROBE_STATE)
    first = None
    try:
        for event in handle.stream(SamplingParams(max_tokens=1, ignore_eos=True), prompt=prompt):
            if first is None and event.token_id is not None:
                first = time.perf_counter() - started
        return first if first is not None else time.perf_counter() - started
    finally:
        handle.close()


def measure(model: str, started: float, **overrides) -> tuple[ColdStart, "Engine"]:
    """Load `model` (overrides: Engine options) and generate its first token; `started`: when the
    process started (time.time()). Returns the figures and the engine, still open."""
    from hibana_core.engine import Engine

    loading = time.time()
    engine = Engine.from_pretrained(model, **overrides)
    load = time.time() - loading
    try:
        return ColdStart(loading - started, load, first_token_seconds(engine), dict(engine.load_times)), engine
    except BaseException:
        engine.close()
        raise
