"""How many tokens to draft, per agent and per step: the most expected tokens per second.

Two measured inputs:
- `AcceptanceStats` per agent and drafter: for each draft position j, the rate at which draft j
  was accepted when drafts 1..j-1 were (decayed counts, so a change of behaviour shows within a
  few dozen tries). Verify steps and free "shadow" proposals (checked against the tokens that
  followed, without verifying anything) both feed it. A new agent starts from its drafter's
  engine-wide figures.
- `StepCostModel`: seconds per step against the tokens in it, profiled on the device at start-up
  and refined by every step the engine runs; a step that verifies drafts is costed apart from a
  plain one (it reads its tokens back before the next step is scheduled, losing the overlap).

The plan for a step: every candidate's marginal gains (draft j adds the chance that drafts 1..j
are all accepted) are merged, best first, and the number K of draft tokens that maximises

    (sequences sampling + expected accepted drafts among the K best) / cost(step tokens + K)

is taken. Gains shrink along each draft, so the K best form a prefix of each agent's draft.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

MAX_DRAFT = 16
"""Longest draft per sequence and step (verify graphs exist for 1 + 0, 1, 2, 4, 8, 16 tokens)."""


class AcceptanceStats:
    """Decayed counts of tries and acceptances per draft position (1-based in the docs, 0-based
    here)."""

    DECAY = 0.95
    PROBE_FIRST = 16   # tokens past the last try before a costly drafter's first probe
    PROBE_MOST = 1024  # the longest wait between probes (each missed probe doubles it)

    def __init__(self, prior: "AcceptanceStats | None" = None, max_draft: int = MAX_DRAFT) -> None:
        self.tries = [0.0] * max_draft
        self.accepted = [0.0] * max_draft
        self.prior = prior
        self.last_try: int | None = None  # the history's length at the last probe (None: since the last record)
        self.probe_after = self.PROBE_FIRST
        self.probing = False  # a probe is out, its verify not yet recorded
        self._rates: list[float] | None = None  # `rate` of every position, until the next record (here or in the prior)
        self._prior_rates: list[float] | None = None  # the prior's list those were computed from

    def record(self, proposed: int, accepted: int) -> None:
        """Drafts 1..proposed were tried; the first `accepted` of them were accepted."""
        for j in range(min(proposed, accepted + 1, len(self.tries))):
            self.tries[j] = self.tries[j] * self.DECAY + 1.0
            self.accepted[j] = self.accepted[j] * self.DECAY + (1.0 if j < accepted else 0.0)
        self._rates = None
        if self.probing:  # wait twice as long after a missed probe, half as long after a hit
            self.probe_after = min(2 * self.probe_after, self.PROBE_MOST) if accepted == 0 else \
                max(self.probe_after // 2, 1)
            self.probing = False
        self.last_try = None
        if self.prior is not None:
            self.prior.record(proposed, accepted)

    def probe_due(self, position: int) -> bool:
        """Whether an agent whose history is `position` tokens long should draft one token even
        where the plan gives it none. A costly drafter (a draft model) proposes only what the plan
        takes, so once its figures fall low enough for the plan to take nothing, nothing would be
        tried and measured again: the rate would stay where it fell while the agent moved on to
        text the draft model predicts well. `probe_after` tokens past the last try, one token is
        tried; a miss doubles the wait (up to `PROBE_MOST`), an acceptance halves it: a drafter
        that misses more often than it hits is soon probed once in hundreds of tokens (a draft
        forward and one verified token each), one that hits again often enough for its figures,
        and then the plan, to follow. Counted in tokens rather than steps: a step whose tokens
        were not on the host (async scheduling, no agent drafting) could not have probed."""
        if self.last_try is None or position < self.last_try:  # a state rewound starts counting again
            self.last_try = position
        return position - self.last_try >= self.probe_after

    def probe(self, position: int) -> bool:
        """`probe_due`, and if so, the probe is taken (the wait starts again until it records:
        steps run ahead of their results)."""
        if not self.probe_due(position):
            return False
        self.last_try, self.probing = position, True
        return True

    def rate(self, j: int) -> float:
        """Estimated chance that draft j+1 is accepted given the ones before it were, shrunk
        towards the engine-wide figure (two pseudo-tries) while this agent has few tries."""
        return self.rates()[j]

    def rates(self) -> list[float]:
        """`rate` of every draft position, computed once between records (the controller asks
        for every agent's at every step)."""
        prior = self.prior.rates() if self.prior is not None else None
        if self._rates is None or prior is not self._prior_rates:
            priors = prior if prior is not None else [0.5] * len(self.tries)
            self._rates = [(a + 2.0 * p) / (t + 2.0) for a, t, p in zip(self.accepted, self.tries, priors)]
            self._prior_rates = prior
        return self._rates

    def gains(self, length: int) -> list[float]:
        """Expected accepted tokens added by each of the first `length` drafts."""
        out, p = [], 1.0
        for r in self.rates()[:length]:
            p *= r
            out.append(p)
        return out

    def summary(self) -> list[float]:
        return [round(self.rate(j), 3) for j in range(len(self.tries))]


class StepCostModel:
    """Seconds per step by tokens in the step: the device's time for the step (linear between
    the measured points, proportional to tokens beyond them), and for a verifying step
    `sync_overhead` more: its tokens are read back before the next step is scheduled, so the
    host's work for that step no longer overlaps the device."""

    SMOOTH = 0.1  # weight of a new measurement
    DISTURBED = 0.25
    """A step timed below this share of its point's profiled time shows a disturbed start-up
    profile (other work only slows a timing; an engine step does more than the profile's forward)."""

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float], sync_overhead: float = 0.0) -> None:
        self.points = list(tokens)
        self.seconds = list(seconds)
        self.sync_overhead = sync_overhead
        self.timed = [False] * len(self.points)  # points a step of the engine has timed (`observe`)
        self.guessed = [False] * len(self.points)  # untimed points of a disturbed profile (`observe`)
        self._monotone()

    def _monotone(self) -> None:
        """Two bounds that noise breaks and a device never does, since noise on a busy machine
        only slows a measurement down. A step of more tokens never costs less: each point at most
        the cheapest point after it (a small step timed dearer than a larger one was disturbed;
        left so, drafting would look cheaper than not). And a step of n tokens never costs more
        than n steps of the first point's size: on a CPU whose other cores were busy the start-up
        profile timed 2- to 8-token steps at 0.5 s against 10 ms for one token, the controller
        stopped drafting, and no verify step ever ran to correct it (the demo trace at 1.11x
        where it gave 1.69x)."""
        first_per_token = self.seconds[0] / self.points[0]
        for i in range(len(self.seconds)):
            self.seconds[i] = min(self.seconds[i], first_per_token * self.points[i])
        for i in range(len(self.seconds) - 2, -1, -1):
            self.seconds[i] = min(self.seconds[i], self.seconds[i + 1])

    def cost(self, num_tokens: int, verify: bool) -> float:
        extra = self.sync_overhead if verify else 0.0
        return self._device(bisect.bisect_left(self.points, num_tokens), num_tokens) + extra

    def costs(self, first: int, count: int, verify: bool) -> list[float]:
        """`cost(n, verify)` for n = first .. first + count - 1, the profile walked once (the plan
        costs every draft count of a step: hundreds at 32 agents)."""
        out, points = [], self.points
        extra = self.sync_overhead if verify else 0.0
        i = bisect.bisect_left(points, first)
        for n in range(first, first + count):
            while i < len(points) and points[i] < n:  # bisect_left(points, n), walked
                i += 1
            out.append(self._device(i, n) + extra)
        return out

    def _device(self, i: int, num_tokens: int) -> float:
        """The device's time for a step of `num_tokens`, `i` being bisect_left(points, num_tokens)."""
        table = self.seconds
        if i == 0:
            return table[0]
        if i == len(self.points):
            # beyond the profile: proportional to tokens (the large-batch regime is compute bound)
            return table[-1] * num_tokens / self.points[-1]
        x0, x1 = self.points[i - 1], self.points[i]
        return table[i - 1] + (table[i] - table[i - 1]) * (num_tokens - x0) / (x1 - x0)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Pull the nearest profiled point towards a step's measured device time. A first timing
        far below the profile's (`DISTURBED`) replaces it, and the points no step has timed yet
        are then guesses (`_guess`) until a step times them. (A profile slowed throughout by other
        work, the one-token point too, was proportional to tokens once decode steps had corrected
        that point: no draft paid, so no verify step ran to time the others, and a drafter whose
        every draft was kept drafted nothing for good.)"""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        i = min(range(len(self.points)), key=lambda j: abs(self.points[j] - num_tokens))
        scale = self.points[i] / max(num_tokens, 1) if num_tokens > self.points[-1] else 1.0
        measured = seconds * scale
        if self.guessed[i] or (not self.timed[i] and measured < self.DISTURBED * self.seconds[i]):
            if not self.guessed[i]:  # the profile was disturbed: its untimed points are guesses from here
                self.guessed = [not timed for timed in self.timed]
            self.seconds[i], self.guessed[i] = measured, False
        else:
            self.seconds[i] += self.SMOOTH * (measured - self.seconds[i])
        self.timed[i] = True
        self._guess()
        self._monotone()

    def _guess(self) -> None:
        """A guessed point costs the least its timed neighbours allow: what the timed point below
        it costs (more tokens never cost less), its tokens' share of the timed point above it (nor
        less a token). Optimistic, so drafting that might pay is tried, and the step that tries
        it times the point."""
        timed = [j for j, t in enumerate(self.timed) if t]
        for j in (j for j, guessed in enumerate(self.guessed) if guessed):
            below = [self.seconds[t] for t in timed if t < j][-1:]
            above = [self.seconds[t] * self.points[j] / self.points[t] for t in timed if t > j][:1]
            self.seconds[j] = max(below + above)

    def observe_sync(self, seconds: float) -> None:
        """The host's time to schedule and launch a step (what a verifying step stops overlapping)."""
        if math.isfinite(seconds) and seconds >= 0:
            self.sync_overhead += self.SMOOTH * (seconds - self.sync_overhead)


@dataclass
class Candidate:
    """A sequence that may draft this step."""

    stats: AcceptanceStats
    available: int      # tokens its drafter proposed (the most it can verify)
    fixed: int | None   # a fixed draft length asked for ({"k": ...}); None: adaptive


class Controller:
    def __init__(self, costs: StepCostModel) -> None:
        self.costs = costs

    def plan(self, candidates: Sequence[Candidate], step_tokens: int, num_sampling: int) -> list[int]:
        """Draft tokens to verify per candidate, for a step of `step_tokens` tokens (without
        drafts) in which `num_sampling` sequences sample."""
        ks = [min(c.fixed, c.available) if c.fixed is not None else 0 for c in candidates]
        gains = []  # (gain, candidate index) for each adaptive draft token
        for i, c in enumerate(candidates):
            if c.fixed is None:
                gains.extend((g, i) for g in c.stats.gains(c.available))
        fixed = sum(ks)
        gains.sort(reverse=True)
        expected = num_sampling + sum(g for c, k in zip(candidates, ks) if c.fixed is not None
                                      for g in c.stats.gains(k))
        verify = fixed > 0
        best_rate = expected / self.costs.cost(step_tokens + fixed, verify)
        best_k, total = 0, expected
        for n, ((gain, _), cost) in enumerate(zip(gains, self.costs.costs(step_tokens + fixed + 1, len(gains), True)),
                                              start=1):
            total += gain
            rate = total / cost
            if rate > best_rate:
                best_rate, best_k = rate, n
        for _, i in gains[:best_k]:
            ks[i] += 1
        return ks

    def ceiling(self, stats: AcceptanceStats, step_tokens: int, num_sampling: int, most: int) -> int:
        """The drafts (at most `most`) this agent alone would be given in a step like this one:
        what a costly drafter's candidate offers the step's plan, plus one (to see whether one
        more pays beside the others), rather than `most` (the drafter then drafts what the plan
        took: `Speculator.draft`)."""
        return self.plan([Candidate(stats, most, None)], step_tokens, num_sampling)[0]

    def promising(self, stats: AcceptanceStats, step_tokens: int, num_sampling: int) -> bool:
        """Whether drafting one token for this agent could pay in a step like the last one:
        worth reading the step's tokens back before scheduling the next."""
        gain = stats.gains(1)[0]
        now = num_sampling / self.costs.cost(step_tokens, False)
        return (num_sampling + gain) / self.costs.cost(step_tokens + 1, True) > now
