"""CPU unit tests of speculation's parts (issue 13), without a model: the suffix and ngram drafters
and their per-state indexes, the controller's plan, acceptance statistics, SpeculationConfig."""

from __future__ import annotations

import random

import pytest

from hibana_core.config import EngineConfig, SamplingParams, SpeculationConfig
from hibana_core.errors import ConfigError
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.sequence import KVSequence
from hibana_core.speculation import DraftInput, NgramDrafter, SuffixDrafter
from hibana_core.speculation.controller import AcceptanceStats, Candidate, Controller, StepCostModel


class Key:
    """A state's identity for the drafters' per-state caches (weakly referenced)."""


def draft_input(tokens, key=None, version=0) -> DraftInput:
    return DraftInput(list(tokens), key if key is not None else Key(), version)


def distinct(rng: random.Random, n: int, lo: int = 100, hi: int = 10_000) -> list[int]:
    return rng.sample(range(lo, hi), n)


# --- the suffix drafter --------------------------------------------------------------------------


def test_suffix_drafter_continues_the_agents_own_earlier_text():
    rng = random.Random(1)
    x, y = distinct(rng, 20), distinct(rng, 10)
    drafter = SuffixDrafter()
    # the agent wrote x before; now it writes x's first 8 tokens again
    assert drafter.propose(draft_input(x + y + x[:8]), 5) == x[8:13]
    assert drafter.propose(draft_input(x + y + x[:8]), 2) == x[8:10], "k caps the draft"
    assert drafter.propose(draft_input(x + y), 4) == [], "nothing seen after y's context"


def test_suffix_drafter_continues_another_agents_output():
    rng = random.Random(2)
    context, output, own = distinct(rng, 40), distinct(rng, 12), distinct(rng, 30)
    drafter = SuffixDrafter()
    state = draft_input(own + context[-10:])
    assert drafter.propose(state, 4) == []
    drafter.finished(context, output)  # another agent answered `context` with `output`
    assert drafter.propose(state, 6) == output[:6]
    # and drafts run on into the output: a state already 3 tokens in gets the rest
    assert drafter.propose(draft_input(own + context[-10:] + output[:3]), 4) == output[3:7]


def test_suffix_drafter_stops_on_low_score_contexts():
    rng = random.Random(3)
    # token 7 was followed by 10 different tokens once each: no continuation scores over 0.1
    after = distinct(rng, 10)
    tokens = [t for a in after for t in (7, a)] + [7]
    assert SuffixDrafter().propose(draft_input(tokens), 4) == []
    assert len(SuffixDrafter(min_score=0.01).propose(draft_input(tokens), 1)) == 1, \
        "the score threshold is what stopped it"
    # a confident start and a split later: the draft stops where the running score falls
    x = distinct(rng, 12)
    branches = [x + [b] for b in distinct(rng, 8)]
    history = [t for branch in branches for t in branch] + x[:10]
    draft = SuffixDrafter().propose(draft_input(history), 8)
    assert draft == x[10:12], "drafts up to the split, not into it"


def test_suffix_index_catches_up_incrementally_and_is_rebuilt_after_edits():
    pool = BlockPool(64, 16)
    seq = KVSequence(pool, lambda src, dst: None)
    rng = random.Random(4)
    x, y = distinct(rng, 20), distinct(rng, 10)
    drafter = SuffixDrafter()

    def state():  # what the speculator hands a drafter
        return DraftInput(seq.tokens, seq, seq.edits)

    def index():
        return drafter.states._indexes[seq][1]

    seq.set_tokens(x + y)
    assert drafter.propose(state(), 3) == []
    first = index()
    extended = []
    original = first.extend
    first.extend = lambda tokens: (extended.append(len(tokens)), original(tokens))
    seq.append(x[:5])  # appending is no edit
    assert seq.edits == 0
    assert drafter.propose(state(), 3) == x[5:8]
    assert index() is first and extended == [5], "the index takes only the appended tokens"
    assert first.num_tokens == len(seq.tokens)

    # truncate (an edit): the index forgets x's first occurrence
    seq.trim(len(x) + len(y))
    seq.append(y[:6])
    assert seq.edits == 1 and len(seq.tokens) > first.num_tokens - 5
    assert drafter.propose(state(), 3) == y[6:9]
    assert index() is not first
    # a sync to a history of the same length but other tokens: rebuilt, not served stale
    z = distinct(rng, len(seq.tokens))
    seq.set_tokens(z)
    assert seq.edits == 2
    assert drafter.propose(state(), 3) == []
    assert index().num_tokens == len(z)


# --- the ngram drafter ---------------------------------------------------------------------------


def test_ngram_drafter_copies_what_followed_the_latest_earlier_occurrence():
    tokens = [5, 1, 2, 3, 10, 11, 5, 1, 2, 3, 20, 21, 5, 1, 2, 3]
    drafter = NgramDrafter()
    assert drafter.propose(draft_input(tokens), 2) == [20, 21]
    assert drafter.propose(draft_input(tokens), 8) == [20, 21, 5, 1, 2, 3], "no more than the history has"
    # the longest matching context wins over a later, shorter one
    tokens = [8, 1, 2, 30, 9, 1, 2, 40, 8, 1, 2]
    assert drafter.propose(draft_input(tokens), 1) == [30]
    assert drafter.propose(draft_input([1, 2, 3, 4, 1]), 3) == [], "one token is no context (min_n=2)"
    assert drafter.propose(draft_input([1, 2, 3, 4]), 3) == []


def test_ngram_index_is_rebuilt_after_edits():
    drafter, key = NgramDrafter(), Key()
    assert drafter.propose(draft_input([1, 2, 3, 1, 2], key, 0), 1) == [3]
    assert drafter.propose(draft_input([4, 5, 6, 1, 2], key, 1), 1) == [], "stale index served"
    assert drafter.propose(draft_input([4, 5, 6, 1, 2, 4, 5], key, 1), 1) == [6]


# --- the controller ------------------------------------------------------------------------------

# as profiled: a verifying step pays a tenth of a one-token step more (its tokens are read back
# before the next step is scheduled)
FLAT = StepCostModel([1, 8, 64], [1.0, 1.05, 1.5], sync_overhead=0.1)   # memory bound: extra tokens nearly free
STEEP = StepCostModel([1, 8, 64], [1.0, 8.0, 64.0], sync_overhead=0.1)  # compute bound: a token costs a step


def stats_with(rate: float, tries: int = 40) -> AcceptanceStats:
    stats = AcceptanceStats()
    rng = random.Random(0)
    for _ in range(tries):
        accepted = 0
        while accepted < 8 and rng.random() < rate:
            accepted += 1
        stats.record(8, accepted)
    return stats


def test_plan_drafts_nothing_at_low_acceptance():
    assert Controller(FLAT).plan([Candidate(stats_with(0.0), 8, None)], 1, 1) == [0]
    assert Controller(FLAT).plan([Candidate(stats_with(0.0), 8, None), Candidate(stats_with(0.0), 8, None)],
                                 2, 2) == [0, 0]


def test_plan_drafts_nothing_when_the_step_cost_grows_steeply():
    assert Controller(STEEP).plan([Candidate(stats_with(0.6), 8, None)], 8, 8) == [0]


def test_plan_drafts_long_at_high_acceptance():
    (k,) = Controller(FLAT).plan([Candidate(stats_with(0.95), 8, None)], 1, 1)
    assert k >= 6
    (k,) = Controller(FLAT).plan([Candidate(stats_with(0.95), 3, None)], 1, 1)
    assert k == 3, "never more than the drafter proposed"
    ks = Controller(FLAT).plan([Candidate(stats_with(0.3), 8, None), Candidate(stats_with(0.95), 8, None)], 2, 2)
    assert ks[1] > ks[0], "the agent whose drafts are accepted drafts longer"


def test_plan_honours_a_fixed_k():
    bad = stats_with(0.0)
    assert Controller(STEEP).plan([Candidate(bad, 8, 3), Candidate(bad, 2, 5), Candidate(bad, 8, 0)], 3, 3) == [3, 2, 0]


def test_acceptance_stats_decay_and_start_from_the_prior():
    stats = AcceptanceStats()
    for _ in range(60):
        stats.record(1, 1)
    assert stats.rate(0) > 0.9
    for _ in range(40):
        stats.record(1, 0)
    assert stats.rate(0) < 0.25, "40 recent misses should outweigh 60 older hits"
    assert stats.tries[0] < 1 / (1 - AcceptanceStats.DECAY) + 1e-9

    # proposed 4, accepted 2: drafts 1-2 hit, draft 3 missed, draft 4 was never reached
    stats = AcceptanceStats()
    stats.record(4, 2)
    assert stats.tries[:4] == [1.0, 1.0, 1.0, 0.0] and stats.accepted[:4] == [1.0, 1.0, 0.0, 0.0]

    prior = stats_with(0.9)
    fresh = AcceptanceStats(prior)
    assert fresh.rate(0) == pytest.approx(prior.rate(0)), "a new agent starts from the engine-wide figure"
    fresh.record(2, 0)
    assert fresh.rate(0) < prior.rate(0) and prior.tries[0] > stats_with(0.9).tries[0], \
        "an agent's tries feed the engine-wide figure too"


def test_step_cost_model_interpolates_and_extrapolates():
    model = StepCostModel([1, 8, 64], [1.0, 2.0, 4.0], sync_overhead=0.5)
    assert model.cost(1, False) == 1.0 and model.cost(1, True) == 1.5
    assert model.cost(36, False) == pytest.approx(3.0)
    assert model.cost(128, False) == pytest.approx(8.0), "beyond the profile: proportional"


def test_a_disturbed_profile_point_does_not_make_drafting_look_free():
    """A busy machine timed the 2-token step at 265 ms and the 64-token one at 1.2 ms: the table
    is made monotone (a step never costs less than a smaller one), so at near-zero acceptance
    the controller still drafts nothing (it chose 16 drafts at 0.4% acceptance before)."""
    model = StepCostModel([1, 2, 4, 8, 16, 32, 64], [1e-3, 0.265, 1.1e-3, 1.1e-3, 1.15e-3, 1.2e-3, 1.2e-3],
                          sync_overhead=1e-4)
    costs = [model.cost(n, False) for n in range(1, 65)]
    assert costs == sorted(costs)
    assert Controller(model).plan([Candidate(stats_with(0.004), 16, None)], 1, 1) == [0]
    model.observe(64, 1e-4)  # a measurement below the smaller points pulls them down with it
    assert [model.cost(n, False) for n in (1, 8, 64)] == sorted(model.cost(n, False) for n in (1, 8, 64))


def test_a_profile_of_disturbed_multi_token_steps_does_not_stop_drafting():
    """A busy CPU timed every step of 2 to 256 tokens 50x too slow at start-up (0.5 s for 2 tokens
    against 10 ms for 1); no verify step then ran to correct it, and adaptive speculation drafted
    almost nothing. A step of n tokens costs at most n one-token steps, measured or profiled."""
    model = StepCostModel([1, 2, 4, 8, 16, 32, 64, 128, 256],
                          [0.0097, 0.499, 0.499, 0.572, 0.572, 0.572, 0.820, 1.040, 2.244], sync_overhead=0.0064)
    assert model.cost(2, False) == pytest.approx(2 * 0.0097) and model.cost(8, False) == pytest.approx(8 * 0.0097)
    model.observe(4, 0.06)  # measured: dearer than four one-token steps, kept to that bound
    assert model.cost(4, False) == pytest.approx(4 * 0.0097)


def test_the_start_up_profile_outlasts_a_burst_of_other_work(monkeypatch):
    """The profile times the whole ladder round after round: a burst that slows several timings
    in a row (here five, 40 ms each instead of 1 ms) leaves every count a clean timing. On a
    clock of the test's own, which only `forward` moves: with real sleeps a loaded machine could
    slow the clean timings too."""
    import types

    from hibana_core.speculation import speculator

    calls, clock = [], [0.0]

    def forward(n: int) -> None:
        calls.append(n)
        clock[0] += 0.04 if 12 <= len(calls) < 17 else 0.001

    monkeypatch.setattr(speculator, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = speculator.profile_step_costs(forward, 64, lambda: None)
    assert model.seconds == pytest.approx([0.001] * len(model.seconds)), model.seconds


# --- configuration -------------------------------------------------------------------------------


def test_speculation_config_parse():
    assert SpeculationConfig.parse("adaptive") == SpeculationConfig(True, "suffix", None)
    assert SpeculationConfig.parse("adaptive").adaptive
    assert SpeculationConfig.parse(True) == SpeculationConfig.parse("adaptive"), "True: on, as by default"
    assert EngineConfig(speculation=True).speculation.adaptive
    assert SamplingParams(speculation=True).speculation.adaptive
    for off in ("off", False):
        config = SpeculationConfig.parse(off)
        assert not config.enabled and not config.active and not config.adaptive
    assert SpeculationConfig.parse({"method": "ngram", "k": 4}) == SpeculationConfig(True, "ngram", 4)
    assert SpeculationConfig.parse({"method": "ngram"}).adaptive
    assert not SpeculationConfig.parse({"k": 0}).active
    config = SpeculationConfig(method="mine", k=2)
    assert SpeculationConfig.parse(config) is config
    assert SamplingParams(speculation={"k": 3}).speculation == SpeculationConfig(k=3)
    assert SamplingParams().speculation is None, "None: the engine's setting"
    assert EngineConfig(speculation="off").speculation == SpeculationConfig(enabled=False)
    assert EngineConfig().speculation.adaptive


@pytest.mark.parametrize("bad", [
    "fast", "on", None, 1, 0, 3, ["suffix"],
    {"method": "suffix", "k": -1}, {"k": 17}, {"k": True}, {"k": 2.0}, {"k": "4"},
    {"method": ""}, {"method": 3}, {"kk": 1}, {"method": "suffix", "k": 2, "extra": 1},
], ids=repr)
def test_speculation_config_rejects_bad_values(bad):
    with pytest.raises(ConfigError):
        SpeculationConfig.parse(bad)
    with pytest.raises(ConfigError):
        EngineConfig(speculation=bad)
    if bad is not None:  # None is SamplingParams' "the engine's"
        with pytest.raises(ConfigError):
            SamplingParams(speculation=bad)


def test_speculation_none_is_the_engines_setting_on_a_request_and_refused_for_the_engine():
    with pytest.raises(ConfigError, match=r"speculation=None means \"the engine's setting\" on a request"):
        EngineConfig(speculation=None)
    assert SamplingParams(speculation=None).speculation is None
