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


def force_outputs_fn():
    """The bench-only hook that makes the next generate on a state emit given tokens."""
    try:
        from hibana_core.speculation import force_outputs
    except ImportError:
        raise BenchError("trace-driven replay with forced outputs needs hibana_core.speculation.force_outputs "
                         "(issue 13), which this engine lacks; update the engine or pass --real-outputs") from None
    return force_outputs


@dataclass(frozen=True)
class SpecCounters:
    """What an engine did between two `stats()` snapshots."""

    steps: int
    generated_tokens: int
    draft_tokens_proposed: int | None
    draft_tokens_accepted: int | None
    verify_steps: int | None

    @classmethod
    def between(cls, before, after) -> "SpecCounters":
        def delta(name: str) -> int | None:
            a, b = getattr(after, name, None), getattr(before, name, None)
            return None if a is None or b is None else a - b
        return cls(after.steps - before.steps, after.generated_tokens - before.generated_tokens,
                   delta("draft_tokens_proposed"), delta("draft_tokens_accepted"), delta("verify_steps"))

    def summary(self) -> dict:
        """The counters plus the rates derived from them. `tokens_per_verify_step` is
        accepted / verify_steps + 1: a verify step emits its accepted drafts and one token of its
        own (the engine does not count the tokens of verify steps separately; a step cut short
        by max_tokens emits fewer, so this slightly overstates). Whether it is per sequence or per
        batched step follows the engine's count of verify_steps."""
        proposed, accepted, verify = self.draft_tokens_proposed, self.draft_tokens_accepted, self.verify_steps
        return {
            "engine_steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "draft_tokens_proposed": proposed,
            "draft_tokens_accepted": accepted,
            "verify_steps": verify,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_verify_step": accepted / verify + 1 if verify else None,
        }
