"""The Hibana systems that differ only in speculation, and the draft counters a run reports.

- `hibana_spec_off`: no drafting (`speculation="off"`).
- `hibana_spec_k4`: suffix drafts of a fixed 4 tokens (`{"method": "suffix", "k": 4}`).
- `hibana`: the engine's default, adaptive speculation (no override).

The counters come from `engine.stats()` before and after a run; an engine without the
speculation counters (before issue 13) reports them as None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPEC_SYSTEMS: dict[str, Any] = {
    "hibana_spec_off": "off",
    "hibana_spec_k4": {"method": "suffix", "k": 4},
    "hibana": None,  # the engine's default: adaptive
}
BASELINE = "hibana_spec_off"


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked; the message says what to change."""


def spec_overrides(system: str) -> dict:
    """Engine keyword arguments for one of SPEC_SYSTEMS."""
    value = SPEC_SYSTEMS[system]
    return {} if value is None else {"speculation": value}


def open_engine(model, system: str, **overrides):
    """`model.engine(...)` for a speculation system, with a clear error on an engine that does
    not take the speculation option yet."""
    spec = spec_overrides(system)
    try:
        return model.engine(**overrides, **spec)
    except Exception as exc:  # the engine's ConfigError for an unknown option
        if spec and "speculation" in str(exc):
            raise BenchError(f"{system} needs Engine(..., speculation=...) (issue 13), which this engine does "
                             f"not take ({exc}); run only the system 'hibana'") from exc
        raise


def capture_graphs(engine, sequences: int) -> int:
    """Capture before timing every CUDA graph the workload's steps may take: up to `sequences`
    sequences a step, the draft lengths of the engine's speculation, every span (the engine
    captures one sequence's at start-up; others are otherwise captured by the first step of their
    shape, tens of milliseconds each inside the timed run, more of them the more draft lengths a
    system uses). 0 on an engine without graphs or without this call."""
    capture = getattr(getattr(engine, "core", None), "capture_graphs", None)
    if capture is None:
        return 0
    return capture(sequences, engine.config.speculation.max_drafts)


def force_outputs_fn():
    """The bench-only hook that makes the next generate on a state emit given tokens."""
    try:
        from hibana_core.speculation import force_outputs
    except ImportError:
        raise BenchError("trace-driven replay with forced outputs needs hibana_core.speculation.force_outputs "
                         "(issue 13), which this engine lacks; update the engine or pass --real-outputs") from None
    return force_outputs


COUNTERS = ("steps", "generated_tokens", "draft_tokens_proposed", "draft_tokens_accepted", "verify_steps",
            "verified_sequences", "verified_tokens")


def snapshot(engine) -> dict:
    """The engine's counters now. `verified_sequences` / `verified_tokens` ((sequence, step)
    pairs that verified drafts, and the tokens those emitted) are read from EngineStats when it
    has them, else from the speculator's counters; None where the engine has neither."""
    stats = engine.stats()
    inner = getattr(getattr(getattr(engine, "scheduler", None), "speculation", None), "counters", None)
    return {name: getattr(stats, name, getattr(inner, name, None)) for name in COUNTERS} | {
        "speculation": getattr(stats, "speculation", None)}


@dataclass(frozen=True)
class SpecCounters:
    """What an engine did between two snapshots (None: the engine does not count it)."""

    steps: int
    generated_tokens: int
    draft_tokens_proposed: int | None
    draft_tokens_accepted: int | None
    verify_steps: int | None           # engine steps that verified drafts (batched: many sequences each)
    verified_sequences: int | None     # (sequence, step) pairs that verified drafts
    verified_tokens: int | None        # tokens those emitted: accepted drafts + one each
    engine_summary: dict | None = None  # the engine's own figures at the end (whole engine life, warm-up included)

    @classmethod
    def between(cls, before: dict, after: dict) -> "SpecCounters":
        def delta(name: str) -> int | None:
            a, b = after.get(name), before.get(name)
            return None if a is None or b is None else a - b
        return cls(*(delta(name) for name in COUNTERS), engine_summary=after.get("speculation"))

    def summary(self) -> dict:
        """The counters plus rates. `tokens_per_verify` is the mean number of tokens a sequence
        emits in a step that verifies its drafts (verified_tokens / verified_sequences); where the
        engine does not count those, accepted / verify_steps + 1, which is per sequence only at
        batch 1 and is marked by `tokens_per_verify_estimated`."""
        proposed, accepted = self.draft_tokens_proposed, self.draft_tokens_accepted
        estimated = not self.verified_sequences and bool(self.verify_steps) and accepted is not None
        if self.verified_sequences:
            per_verify = self.verified_tokens / self.verified_sequences
        else:
            per_verify = accepted / self.verify_steps + 1 if estimated else None
        return {
            "engine_steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "draft_tokens_proposed": proposed,
            "draft_tokens_accepted": accepted,
            "verify_steps": self.verify_steps,
            "verified_sequences": self.verified_sequences,
            "verified_tokens": self.verified_tokens,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_verify": per_verify,
            "tokens_per_verify_estimated": estimated,
            "engine_speculation": self.engine_summary,
        }
