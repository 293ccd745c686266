"""Which idle state's KV leaves the device first: eviction policies as named objects.

A policy orders the idle states (no request running on them); eviction takes them in that order
until the room it needs is free (each parked in the host tier, or released without one).

    lru          least recently used first.
    tool_aware   (default) like lru, except that a state whose last turn ended in tool calls is
                 kept while its agent is expected back: its tool calls take about as long as that
                 agent's earlier ones did (a running mean, `DEFAULT_TOOL_SECONDS` before the first),
                 and until `PATIENCE` times that has passed since the turn ended it is evicted only
                 after every other idle state, those expected back latest first. Past that window
                 (the agent is slower than usual, or gone) it is an ordinary idle state again.

An agent's next turn arrives when its tools return; a state whose conversation ended, or waits on
a person, may not come back for minutes. Evicting the latter first keeps the device for the
turns that are about to run (the memory manager's tool-call-aware retention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, TypeVar

DEFAULT_TOOL_SECONDS = 5.0
"""Expected tool time of an agent before any of its tool calls was observed."""
PATIENCE = 2.0
"""A state waiting on tools is kept for this many times its agent's expected tool time."""
SMOOTHING = 0.3
"""Weight of the newest observation in an agent's running mean of tool times."""
PREFETCH_LEAD = 1.0
"""Seconds before an agent's expected return that its parked KV is brought back, into free device
blocks: while the engine is idle, and from host memory between its steps (`StateRegistry.prefetch`)."""


@dataclass
class StateUse:
    """What a policy knows of one state's use."""

    last_use: float                    # time.monotonic() of its last call
    tool_since: float | None = None    # when its last turn ended in tool calls (None: it did not)
    tool_seconds: float | None = None  # running mean of its agent's observed tool times
    priority: int = 0                  # its last request's SamplingParams.priority
    pinned_at: float | None = None     # when `StateHandle.pin()` was called (None: not pinned)

    def turn_ended(self, now: float, called_tools: bool) -> None:
        self.tool_since = now if called_tools else None

    def request_came(self, now: float) -> None:
        """A new request on the state: if it waited on tools, that wait is one observation."""
        if self.tool_since is not None:
            took = max(0.0, now - self.tool_since)
            mean = self.tool_seconds
            self.tool_seconds = took if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * took
            self.tool_since = None

    def expected_back(self) -> float | None:
        """When its agent should send the next turn, if it waits on tools."""
        if self.tool_since is None:
            return None
        return self.tool_since + (self.tool_seconds if self.tool_seconds is not None else DEFAULT_TOOL_SECONDS)

    def due(self, now: float, lead: float) -> bool:
        """Whether its agent is expected back within `lead` seconds (or already, and still within
        the window it is kept for): the time to bring its KV back before the request comes."""
        back, kept = self.expected_back(), self.kept_until()
        return back is not None and back - lead <= now <= kept

    def kept_until(self) -> float | None:
        if self.tool_since is None:
            return None
        wait = self.tool_seconds if self.tool_seconds is not None else DEFAULT_TOOL_SECONDS
        return self.tool_since + PATIENCE * max(wait, 0.05)


T = TypeVar("T")


@dataclass(frozen=True)
class Eviction:
    """One move of an eviction plan: a state's KV leaves the device for `to`: "host" (memory),
    "disk" (a spill file under state_dir) or "drop" (released; recomputed when it comes back)."""

    seq: Any
    to: str


class EvictionOrder(Protocol):
    name: str

    def order(self, states: Iterable[tuple[T, StateUse]], now: float) -> list[T]:
        """The idle states, first to evict first."""


class LRUOrder:
    name = "lru"

    def order(self, states, now):
        return [s for s, _ in sorted(states, key=lambda su: su[1].last_use)]


class ToolAwareOrder:
    name = "tool_aware"

    def order(self, states, now):
        def key(item):
            use = item[1]
            kept = use.kept_until()
            if kept is None or now > kept:
                return (0, use.last_use)         # ordinary idle state: least recently used first
            return (1, -use.expected_back())     # waiting on tools: expected back latest, first
        return [s for s, _ in sorted(states, key=key)]


POLICIES: dict[str, EvictionOrder] = {p.name: p for p in (LRUOrder(), ToolAwareOrder())}


def retention_order(policy: EvictionOrder, states: list[tuple[T, StateUse, int]], now: float,
                    pin_blocks: int) -> list[T]:
    """The idle states (each with its use and its device blocks), first to evict first: the
    policy's order, refined by what users asked for, in three tiers of protection.

    1. Unpinned states: lower `priority` first, the policy's order among equals.
    2. Pins beyond the pin budget: they degrade to a priority above every unpinned state (same
       order within).
    3. Pins within the budget (`pin_blocks` device blocks, given to pins in the order they were
       made): last of all, so they leave the device only when a request could not run otherwise.
       The budget leaves the rest of the pool to everyone else, and even a pin gives way before
       a request fails: pins never deadlock the engine.
    """
    honoured: set[int] = set()
    held = 0
    for state, use, blocks in sorted((x for x in states if x[1].pinned_at is not None),
                                     key=lambda x: x[1].pinned_at):
        if held + blocks <= pin_blocks:
            honoured.add(id(state))
            held += blocks
    uses = {id(state): use for state, use, _ in states}
    ordered = policy.order([(state, use) for state, use, _ in states], now)

    def protection(state) -> tuple[int, int]:
        use = uses[id(state)]
        tier = 2 if id(state) in honoured else 1 if use.pinned_at is not None else 0
        return tier, use.priority
    return sorted(ordered, key=protection)  # stable: the policy's order within each
