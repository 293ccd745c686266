"""CPU unit tests of speculation's parts (issue 13), without a model: the suffix and ngram drafters
and their per-state indexes, the controller's plan, acceptance statistics, SpeculationConfig."""

from __future__ import annotations

import gc
import json
import random

import pytest

from hibana_core.config import EngineConfig, SamplingParams, SpeculationConfig
from hibana_core.errors import ConfigError
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.sequence import KVSequence, common_prefix_len
from hibana_core.speculation import DraftInput, NgramDrafter, SuffixDrafter
from hibana_core.speculation.controller import AcceptanceStats, Candidate, Controller, StepCostModel
from hibana_core.speculation.index import CONTEXT_INDEX_BYTES_PER_TOKEN, LAST_SEEN_BYTES_PER_TOKEN


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


def test_suffix_index_catches_up_incrementally_and_is_rewound_or_rebuilt_after_edits():
    pool = BlockPool(64, 16)
    seq = KVSequence(pool, lambda src, dst: None)
    rng = random.Random(4)
    x, y = distinct(rng, 20), distinct(rng, 10)
    drafter = SuffixDrafter()

    def state():  # what the speculator hands a drafter
        return DraftInput(seq.tokens, seq, seq.edits)

    def index():
        return drafter.states._entries[seq].index

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

    # truncate (an edit): the index forgets x's second occurrence, undoing its 5 tokens
    seq.trim(len(x) + len(y))
    seq.append(y[:6])
    assert seq.edits == 1 and len(seq.tokens) > first.num_tokens - 5
    assert drafter.propose(state(), 3) == y[6:9]
    assert index() is first and extended == [5, 6], "rewound, then caught up with the new tokens"
    # a sync to a history of the same length but other tokens: rebuilt, not served stale
    z = distinct(rng, len(seq.tokens))
    seq.set_tokens(z)
    assert seq.edits == 2
    assert drafter.propose(state(), 3) == []
    assert index() is not first and index().num_tokens == len(z)


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


# --- bounded per-state indexes --------------------------------------------------------------------


def semi_repetitive(rng: random.Random, n: int, vocab: int, copy_share: float = 0.3) -> list[int]:
    """Random tokens with spans copied from earlier in the stream."""
    tokens: list[int] = []
    while len(tokens) < n:
        if len(tokens) > 8 and rng.random() < copy_share:
            at = rng.randrange(len(tokens) - 4)
            tokens += tokens[at:at + rng.randint(4, 40)]
        else:
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    return tokens[:n]


BOUNDED = [SuffixDrafter, NgramDrafter]


@pytest.mark.parametrize("make", BOUNDED, ids=lambda c: c.__name__)
@pytest.mark.parametrize("seed, vocab", [(0, 8), (1, 50), (2, 5000)])
def test_drafts_do_not_depend_on_the_window_for_histories_shorter_than_it(make, seed, vocab):
    rng = random.Random(seed)
    tokens = semi_repetitive(rng, 300, vocab)
    windowed, unbounded, key = make(state_window=300), make(state_window=1 << 30, max_tokens=1 << 31), Key()
    history: list[int] = []
    drafted = 0
    for t in tokens:  # the history grows token by token, with a proposal after each
        history.append(t)
        state = DraftInput(history, key, 0)
        draft = windowed.propose(state, 8)
        assert draft == unbounded.propose(state, 8), len(history)
        drafted += len(draft)
    assert drafted > 50, "the streams exercise drafting"
    assert windowed.summary()["indexed_tokens"] == len(tokens)


def grown(drafter, tokens, key, step: int = 16, k: int = 8) -> list[int]:
    """Feed `tokens` to `drafter` as a growing history, `step` tokens at a time; the last draft."""
    draft: list[int] = []
    for end in range(step, len(tokens) + step, step):
        draft = drafter.propose(DraftInput(tokens[:end], key, 0), k)
    return draft


@pytest.mark.parametrize("make", BOUNDED, ids=lambda c: c.__name__)
def test_a_small_window_bounds_the_index_and_keeps_recent_copies(make):
    w = 64
    rng = random.Random(5)
    drafter, key = make(state_window=w), Key()
    history: list[int] = []
    for t in semi_repetitive(rng, 20 * w, 30):
        history.append(t)
        drafter.propose(DraftInput(history, key, 0), 4)
        index = drafter.states._entries[key].index
        assert min(len(history), w) <= index.indexed <= 2 * w, len(history)
        assert sum(g.num_tokens for g in index.generations) <= 2 * (w + index.seed), "seeds are hashes only"
        assert index.num_tokens == len(history)

    # a copy whose source spans a generation boundary (at 5w: a history grown from empty rolls
    # every w tokens): its first drafts come from the older generation, the rest from contexts
    # that end at or after the boundary, which only the newer one's seed lets it index
    noise, x = distinct(rng, 5 * w + 40), distinct(rng, 40, 20_000, 30_000)
    tokens = noise[:5 * w - 20] + x + noise[5 * w - 20:5 * w - 10] + x[:8]
    drafter, key = make(state_window=w), Key()
    k = 24
    assert grown(drafter, tokens, key, step=1, k=k) == x[8:8 + k]
    index = drafter.states._entries[key].index
    assert index.starts == [4 * w, 5 * w], "the source straddles the boundary between the two generations"

    # the context x[:8] ends right at the boundary: only the newer generation has its continuation
    tokens = noise[:5 * w - 8] + x + noise[:10] + x[:8]
    drafter, key = make(state_window=w), Key()
    assert grown(drafter, tokens, key, step=1, k=4) == x[8:12]
    assert drafter.states._entries[key].index.starts[-1] == 5 * w

    # a source older than two windows is forgotten (an unbounded index still has it)
    tokens = x + noise[:3 * w] + x[:8]
    assert grown(make(state_window=w), tokens, Key()) == []
    assert grown(make(state_window=1 << 20, max_tokens=1 << 21), tokens, Key()) == x[8:16]


def test_the_ngram_drafter_copies_from_the_whole_history_past_dropped_generations():
    w = 64
    rng = random.Random(6)
    noise, x = distinct(rng, 8 * w), distinct(rng, 30, 20_000, 30_000)
    tokens = noise[:6 * w - 20] + x + noise[6 * w - 20:6 * w] + x[:8]
    drafter, key = NgramDrafter(state_window=w), Key()
    assert grown(drafter, tokens, key, k=6) == x[8:14]
    index = drafter.states._entries[key].index
    assert index.starts == [5 * w, 6 * w] and index.latest(len(tokens)) == (8, 6 * w - 12), \
        "found in the older generation, at its position in the history"

    # x[:8] was followed by 5 (in the older generation), then by 6 (in the newer): the latest wins
    tokens = noise[:72] + x[:8] + [5] + noise[72:119] + x[:8] + [6] + noise[119:125] + x[:8]
    drafter, key = NgramDrafter(state_window=w), Key()
    assert grown(drafter, tokens, key, step=1, k=3) == [6] + noise[119:121]
    assert drafter.states._entries[key].index.starts == [w, 2 * w]
    # ... unless the newer occurrence is shorter: the longest wins
    tokens = noise[:72] + x[:8] + [5] + noise[72:121] + x[2:8] + [6] + noise[119:125] + x[:8]
    assert grown(NgramDrafter(state_window=w), tokens, Key(), step=1, k=3) == [5] + noise[72:74]


def test_suffix_drafts_add_up_the_counts_of_every_generation():
    w = 64
    rng = random.Random(10)
    noise, c, (a, b) = distinct(rng, 80), distinct(rng, 8, 20_000, 30_000), distinct(rng, 2, 30_000, 40_000)
    # c was followed by a twice in the older generation, by b once in the newer: a, 2 to 1
    tokens = noise[:10] + c + [a] + noise[10:20] + c + [a] + noise[20:75] + c + [b] + noise[75:80] + c
    drafter, key = SuffixDrafter(state_window=w), Key()
    assert grown(drafter, tokens, key, step=1, k=1) == [a]
    index = drafter.states._entries[key].index
    assert index.starts == [0, w]
    assert index.continuations(index.hashes, len(index.hashes) - 1) == (8, {b: 1, a: 2})


@pytest.mark.parametrize("make", BOUNDED, ids=lambda c: c.__name__)
def test_all_states_together_stay_within_the_budget(make):
    w, budget = 32, 128
    rng = random.Random(7)
    drafter = make(state_window=w, max_tokens=budget)
    keys = [Key() for _ in range(6)]
    histories = []
    for _ in keys:
        y = distinct(rng, 10)
        histories.append(distinct(rng, 14) + y + distinct(rng, 2) + y[:4])  # 30 tokens, drafts y[4:]

    def propose(i: int, k: int = 4) -> list[int]:
        draft = drafter.propose(DraftInput(histories[i], keys[i], 0), k)
        assert drafter.summary()["indexed_tokens"] <= budget
        assert keys[i] in drafter.states._entries, "the state being served is never evicted"
        return draft

    for i in range(4):
        assert propose(i) == histories[i][18:22]
    assert drafter.summary()["indexed_tokens"] == 120 and drafter.summary()["evictions"] == 0
    propose(0)  # state 1 is now the least recently used, then 2, 3, 0
    propose(4)  # 150 tokens: dropped down to 3/4 of the budget, least recently used first
    assert set(drafter.states._entries.keys()) == {keys[0], keys[3], keys[4]}
    assert drafter.summary()["indexed_tokens"] == 90 and drafter.summary()["evictions"] == 2

    # an evicted state is rebuilt from its last window: as a fresh drafter sees it
    histories[1] = distinct(rng, 20) + histories[1]  # longer than the window now
    state = DraftInput(histories[1], keys[1], 0)
    assert propose(1) == make(state_window=w, max_tokens=budget).propose(state, 4) == histories[1][38:42]
    assert drafter.states._entries[keys[1]].index.indexed == w

    # the state being served grows to its largest index while the others are older
    for _ in range(3):
        histories[5] += distinct(rng, 30)
        propose(5)
    assert drafter.states._entries[keys[5]].index.indexed > w

    # the smallest budget (one state's largest index): serving a state that outgrows 3/4 of it
    # evicts every other state, never the served one
    small = make(state_window=w, max_tokens=2 * w)
    other, served, tokens = Key(), Key(), distinct(rng, 2 * w)
    small.propose(DraftInput(distinct(rng, 8), other, 0), 4)
    for end in range(w, 2 * w + 1, 4):
        small.propose(DraftInput(tokens[:end], served, 0), 4)
        assert served in small.states._entries and small.summary()["indexed_tokens"] <= 2 * w
    assert list(small.states._entries.keys()) == [served] and small.summary()["indexed_tokens"] == 2 * w

    # states that died leave the count without being evicted
    evictions = drafter.summary()["evictions"]
    del keys[:5], histories[:5], state
    gc.collect()
    assert drafter.summary()["states"] == 1
    fresh = [Key() for _ in range(2)]
    for key in fresh:
        drafter.propose(DraftInput(distinct(rng, 30), key, 0), 4)
    assert drafter.summary()["evictions"] == evictions and drafter.summary()["states"] == 3


@pytest.mark.parametrize("make", BOUNDED, ids=lambda c: c.__name__)
def test_an_edit_rebuilds_the_index_from_the_last_window_only(make):
    w = 64
    rng = random.Random(8)
    x, noise = distinct(rng, 20), distinct(rng, 4 * w)
    history = x + noise + x[:8]
    drafter, key = make(state_window=w), Key()
    assert drafter.propose(DraftInput(history, key, 0), 4) == [], "x lies before the last window"
    index = drafter.states._entries[key].index
    assert (index.indexed, index.starts[0]) == (w, len(history) - w)
    # an edit that keeps x in the last window: rebuilt, and x is found
    history = noise[:w - 28] + x + x[:8]
    assert drafter.propose(DraftInput(history, key, 1), 4) == x[8:12]
    assert drafter.states._entries[key].index is not index
    # a shorter history under the same version: rebuilt too
    history = x + noise[:20] + x[:8]
    index = drafter.states._entries[key].index
    assert drafter.propose(DraftInput(history[:30], key, 1), 4) == []
    assert drafter.states._entries[key].index is not index


def builds(drafter) -> list[int]:
    """Count the indexes `drafter` builds (fresh states and rebuilds): the list's one item."""
    count, make = [0], drafter.states._make

    def counting():
        count[0] += 1
        return make()

    drafter.states._make = counting
    return count


def normalised(table: dict) -> dict:
    """A ContextIndex table with each continuation as its (token, count) list, in dict order: a
    continuation seen once may be a bare int or a {token: 1} dict, which draft alike."""
    return {key: [(seen, 1)] if type(seen) is int else list(seen.items()) for key, seen in table.items()}


def brute_latest(history, start: int, orders) -> tuple[int, int]:
    """The longest suffix of `history` of `orders` tokens that also ends at an earlier position
    >= `start` (within an index whose first indexed token is at `start`), and its latest such
    position, or (0, -1)."""
    end = len(history)
    for n in sorted(orders, reverse=True):
        if n > end:
            continue
        suffix = history[end - n:]
        for at in range(end - 1, max(start, n) - 1, -1):
            if history[at - n:at] == suffix:
                return n, at
    return 0, -1


@pytest.mark.parametrize("make", BOUNDED, ids=lambda c: c.__name__)
@pytest.mark.parametrize("seed, vocab", [(11, 6), (12, 40)])
def test_an_edit_within_the_newest_generation_is_undone_as_a_fresh_build_would_index(make, seed, vocab):
    """Random edits of a history with repeats: after each, the index (rewound, or rebuilt when the
    edit reaches into the older generation) is the one a fresh build over its window gives, and
    so are the drafts (the ngram index may have forgotten a context's earlier occurrences along
    with a dropped latest one: it holds a subset of a fresh index's entries, all exact)."""
    w = 64
    rng = random.Random(seed)
    drafter, key = make(state_window=w), Key()
    built = builds(drafter)
    history = semi_repetitive(rng, 3 * w + 17, vocab)
    grown(drafter, history, key, step=13)
    version, rewound, rebuilt = 0, 0, 0
    for step in range(150):
        index = drafter.states._entries[key].index
        kind = rng.choices(range(6), [20, 20, 20, 10, 4, 26])[0]
        cut, added = len(history), semi_repetitive(rng, rng.randint(0, 40), vocab)
        if kind == 0:  # drop a tail of 1..50 tokens
            cut, added = len(history) - rng.randint(1, 50), []
        elif kind == 1:  # drop a tail, then other tokens
            cut = len(history) - rng.randint(1, 50)
        elif kind == 2:  # anywhere in the newest generation (its seed kept)
            cut = rng.randint(index.starts[-1], len(history))
        elif kind == 3:  # into the older generation, or the newest's seed
            cut = rng.randint(index.bases[0], max(index.bases[0], index.starts[-1] - 1))
        elif kind == 4:  # shorter than the seed
            cut = rng.randint(0, index.seed - 1)
        else:  # appended only: no edit
            added = semi_repetitive(rng, rng.randint(1, w), vocab)
        cut = max(0, cut)
        if kind != 5 and added and cut < len(history) and added[0] == history[cut]:
            added[0] = vocab + rng.randrange(3)  # a token the edit really changes
        before, history = history, history[:cut] + added
        version += kind != 5
        state = DraftInput(history, key, version)
        counted = built[0]
        drafts = [drafter.propose(state, k) for k in (1, 4, 8)]
        index = drafter.states._entries[key].index
        rebuilt += built[0] > counted
        rewound += kind != 5 and built[0] == counted
        assert index.num_tokens == len(history) and index.tokens == history[index.bases[0]:]
        assert drafter.states._total == drafter.summary()["indexed_tokens"] == index.indexed <= 2 * w

        fresh = drafter.states._make()  # a fresh build over the same window
        fresh.skip_to(history, index.starts[0])
        fresh.extend(history[index.starts[0]:])
        assert (fresh.bases, fresh.starts, fresh.tokens) == (index.bases, index.starts, index.tokens), step
        same = common_prefix_len(before, history)
        for ours, theirs, base in zip(index.generations, fresh.generations, index.bases):
            assert ours.num_tokens == theirs.num_tokens  # (a rolled one's prefix hashes start elsewhere)
            for table, table_fresh in zip(ours.tables, theirs.tables):
                if make is SuffixDrafter:
                    assert normalised(table) == normalised(table_fresh), step
                else:  # a subset, exact; what it lacks last occurred before the edit
                    assert table.items() <= table_fresh.items(), step
                    assert all(base + at < same for key_, at in table_fresh.items() if key_ not in table)
        other = make(state_window=w)
        other.states._entries[key] = type(drafter.states._entries[key])(version, fresh, 0)
        fresh_drafts = [other.propose(state, k) for k in (1, 4, 8)]
        if make is SuffixDrafter:
            assert drafts == fresh_drafts, step
        else:
            n, at = brute_latest(history, index.starts[0], fresh.orders)
            assert fresh.latest(len(history)) == (n, at), step
            assert fresh_drafts == [history[at:at + k] if n else [] for k in (1, 4, 8)]
            got_n, got_at = index.latest(len(history))
            assert got_n <= n and (got_n == 0 or history[got_at - got_n:got_at] == history[-got_n:]), step
            assert got_n == 0 or index.starts[0] <= got_at < len(history)
            assert drafts == [history[got_at:got_at + k] if got_n else [] for k in (1, 4, 8)]
    assert rewound > 30 and rebuilt > 20, (rewound, rebuilt)


@pytest.mark.parametrize("make", BOUNDED, ids=lambda c: c.__name__)
def test_an_edit_near_the_end_rewinds_the_index_and_an_older_one_rebuilds_it(make):
    w = 64
    rng = random.Random(13)
    drafter, key = make(state_window=w), Key()
    built = builds(drafter)
    x, history = distinct(rng, 20), distinct(rng, 3 * w)
    history = history[:w + 10] + x + history[w + 10:2 * w + 20]
    grown(drafter, history, key, step=8)
    index = drafter.states._entries[key].index
    assert built == [1] and index.starts == [w, 2 * w]
    # the last turn's reasoning dropped and its answer re-rendered: undone, not rebuilt
    history = history[:-20] + x[:8]
    assert drafter.propose(DraftInput(history, key, 1), 4) == x[8:12]
    assert built == [1] and drafter.states._entries[key].index is index
    assert drafter.summary()["indexed_tokens"] == index.indexed == len(history) - w
    # the same version with a shorter history is an edit too
    history = history[:-8]
    assert drafter.propose(DraftInput(history, key, 1), 4) == []
    assert built == [1] and index.num_tokens == len(history)
    # back to the newest generation's first token: it is dropped, the next token starts another
    history = history[:2 * w]
    drafter.propose(DraftInput(history, key, 2), 4)
    assert built == [1] and index.starts == [w] and index.indexed == w
    history = history + x
    drafter.propose(DraftInput(history, key, 2), 4)
    assert built == [1] and index.starts == [w, 2 * w]
    # an edit in the older generation (or the newest's seed): rebuilt from the last window
    for cut in (2 * w - 1, w + 10):
        history = history[:cut] + distinct(rng, 20, 20_000, 30_000)
        drafter.propose(DraftInput(history, key, cut), 4)
        assert drafter.states._entries[key].index is not index and built[0] > 1
        index = drafter.states._entries[key].index
        assert index.starts == [max(0, len(history) - w)]
        drafter.propose(DraftInput(history + x, key, cut), 4)  # an append rolls: two generations
        index, history = drafter.states._entries[key].index, history + x

    # an edit in the newest generation that undoes more than a rebuild indexes: rebuilt
    key, history = Key(), distinct(rng, 50)
    drafter.propose(DraftInput(history, key, 0), 4)
    count = built[0]
    drafter.propose(DraftInput(history[:45] + x[:2], key, 1), 4)
    assert built[0] == count, "5 undone and 2 indexed: cheaper than indexing 47"
    drafter.propose(DraftInput(history[:5] + x[:2], key, 2), 4)
    assert built[0] == count + 1, "45 undone: dearer than indexing 7"
    # nor is a rebuilt index (one generation, from a window back) left to cover under half a window
    key, history = Key(), distinct(rng, 3 * w)
    drafter.propose(DraftInput(history, key, 0), 4)
    assert drafter.states._entries[key].index.starts == [2 * w]
    count = built[0]
    drafter.propose(DraftInput(history[:2 * w + 40] + x[:2], key, 1), 4)
    assert built[0] == count, "40 tokens of the window kept"
    drafter.propose(DraftInput(history[:2 * w + 20] + x[:2], key, 2), 4)
    assert built[0] == count + 1, "20 tokens kept: rebuilt from the last window"
    assert drafter.states._entries[key].index.starts == [2 * w + 22 - w]


def test_drafter_summaries_report_what_is_indexed():
    rng = random.Random(9)
    suffix, ngram = SuffixDrafter(state_window=64, max_tokens=1024), NgramDrafter(state_window=64, max_tokens=1024)
    keys = [Key() for _ in range(3)]
    for key, n in zip(keys, (10, 100, 300)):
        history = distinct(rng, n)
        suffix.propose(DraftInput(history, key, 0), 4)
        ngram.propose(DraftInput(history, key, 0), 4)
    suffix.finished(distinct(rng, 40), distinct(rng, 12))  # the last 32 tokens of the context, and the output
    indexed = 10 + 64 + 64  # rebuilt from the last window: fresh states see a window, no more
    assert suffix.summary() == {"states": 3, "indexed_tokens": indexed, "state_window": 64, "max_tokens": 1024,
                                "evictions": 0, "corpus_tokens": 44,
                                "host_bytes": (indexed + 44) * CONTEXT_INDEX_BYTES_PER_TOKEN}
    assert ngram.summary() == {"states": 3, "indexed_tokens": indexed, "state_window": 64, "max_tokens": 1024,
                               "evictions": 0, "host_bytes": indexed * LAST_SEEN_BYTES_PER_TOKEN}
    assert all(type(v) is int for v in [*suffix.summary().values(), *ngram.summary().values()])
    json.dumps(suffix.summary())
    defaults = SuffixDrafter().summary()
    assert (defaults["state_window"], defaults["max_tokens"], defaults["states"]) == (1 << 14, 1 << 19, 0)
    assert NgramDrafter().summary()["max_tokens"] == 1 << 20


@pytest.mark.parametrize("make, options, message", [
    (SuffixDrafter, {"state_window": 0}, r"state_window=0 is not a positive int; pass"),
    (SuffixDrafter, {"state_window": -64}, r"state_window=-64 is not a positive int"),
    (SuffixDrafter, {"state_window": 64.0}, r"state_window=64\.0 is not a positive int"),
    (SuffixDrafter, {"state_window": True}, r"state_window=True is not a positive int"),
    (SuffixDrafter, {"max_tokens": "1024"}, r"max_tokens='1024' is not a positive int"),
    (SuffixDrafter, {"state_window": 16}, r"shorter than the longest context it indexes \(32 tokens\); "
                                          r"pass state_window >= 32"),
    (NgramDrafter, {"state_window": 4}, r"pass state_window >= 8"),
    (NgramDrafter, {"max_tokens": 0}, r"max_tokens=0 is not a positive int"),
    (SuffixDrafter, {"state_window": 64, "max_tokens": 100}, r"pass max_tokens >= 128"),
    (NgramDrafter, {"max_tokens": 1 << 14}, r"pass max_tokens >= 32768"),
])
def test_drafter_bounds_reject_bad_values(make, options, message):
    with pytest.raises(ConfigError, match=message):
        make(**options)


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


def test_probes_after_a_wait_that_doubles_on_misses_and_halves_on_hits():
    """A costly drafter planned at k=0 is tried once `probe_after` tokens past its last try: its
    figures would otherwise freeze where they fell."""
    stats = AcceptanceStats(AcceptanceStats())
    first = AcceptanceStats.PROBE_FIRST
    assert not any(stats.probe(100 + t) for t in range(first))  # counting starts at the first ask
    assert stats.probe(100 + first) and stats.probing
    assert not stats.probe(100 + first + 1)  # out: the wait starts again
    stats.record(1, 0)  # the probe missed
    assert stats.probe_after == 2 * first and not stats.probing
    assert not stats.probe_due(500) and not stats.probe_due(500 + 2 * first - 1) and stats.probe(500 + 2 * first)
    stats.record(1, 1)  # hit: half the wait
    assert stats.probe_after == first
    for _ in range(20):  # misses: the wait grows to its bound and stays there
        stats.probe_after = min(stats.probe_after, AcceptanceStats.PROBE_MOST)
        stats.probing = True
        stats.record(1, 0)
    assert stats.probe_after == AcceptanceStats.PROBE_MOST
    for _ in range(20):  # hits: down to a probe a token
        stats.probing = True
        stats.record(1, 1)
    assert stats.probe_after == 1
    stats.record(4, 2)  # an ordinary verify restarts the count and leaves the wait as it is
    assert stats.last_try is None and stats.probe_after == 1 and not stats.probe_due(7) and stats.probe_due(8)
    assert not stats.probe_due(3) and stats.probe_due(4)  # a rewound state counts from where it is


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


def test_the_start_up_profile_keeps_to_its_time(monkeypatch):
    """A model whose steps take seconds (a large model on a CPU, or a busy one) is profiled in about
    PROFILE_SECONDS of timed steps: the ladder stops growing once its timings, taken three times,
    would outlast them, the rounds once they are spent; the counts left untimed follow the line
    through the last two timings (a step that reads its weights once: a few tokens more cost
    little more). (The whole ladder, four times over, took minutes.) A warm-up's time (kernels
    compiling) is not counted: a first step of seconds must not cut the ladder to one count. The
    clock is the test's own, moved by `forward`."""
    import types

    from hibana_core.speculation import speculator

    calls, clock = [], [0.0]

    def forward(n: int) -> None:
        calls.append(n)
        clock[0] += 0.5 + 0.01 * n  # the weights' read, and a little a token

    monkeypatch.setattr(speculator, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    model = speculator.profile_step_costs(forward, 256, lambda: None, budget=2.0)
    # 1.03 s timed by 2 tokens, three times over: past 2 s
    assert calls == [1, 1, 2, 2, 1, 2], "warm-up and timing a count, then a round to 2.06 s"
    assert model.points == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for n in (1, 2, 5, 64, 256):
        assert model.cost(n, False) == pytest.approx(0.5 + 0.01 * n), n

    def compiling(n: int) -> None:  # the first step takes 30 s (kernels compile), then 1 ms each
        clock[0] += 30.0 if n not in seen else 0.001
        seen.add(n)

    seen: set[int] = set()
    assert speculator.profile_step_costs(compiling, 256, lambda: None, budget=2.0).points[-1] == 256


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


def test_valid_draft_keeps_the_prefix_of_vocabulary_ids():
    """A drafter's proposal is cut at the first entry that is no token id of the vocabulary (a
    bool, a negative or too large id, a float), at k tokens; lists of ints (the built-ins'), numpy
    arrays and tensors alike."""
    import numpy as np
    import torch

    from hibana_core.speculation.speculator import valid_draft

    assert valid_draft([5, 6, 7], 2, 10) == [5, 6] and valid_draft([], 4, 10) == [] and valid_draft(None, 4, 10) == []
    for bad in (True, -1, 10, 2.0, "3"):
        assert valid_draft([4, bad, 5], 3, 10) == [4], bad
    assert valid_draft(np.array([1, 2, 11]), 3, 10) == [1, 2] and valid_draft(torch.tensor([9, 0]), 2, 10) == [9, 0]
    assert valid_draft([np.int64(3), 4], 2, 10) == [3, 4] and valid_draft(iter([1, 2, 3]), 2, 10) == [1, 2]
    assert valid_draft([12, 4], 2, 10) == []  # an id past the vocabulary: no draft, no error
    # no token id at all is a drafter's bug: a TypeError, which the speculator warns of once
    for wrong in ("12", [1.0, 2.0], ["a"], [None]):
        with pytest.raises(TypeError, match="where token ids"):
            valid_draft(wrong, 2, 10)


def test_a_sampled_draft_is_cut_with_its_distributions_and_taken_only_where_the_request_may():
    import numpy as np
    import pytest
    import torch

    from hibana_core.config import SamplingParams
    from hibana_core.speculation import SampledDraft
    from hibana_core.speculation.drafters import samples_drafts
    from hibana_core.speculation.speculator import valid_draft

    q = torch.rand(4, 10).softmax(dim=-1)
    kept = valid_draft(SampledDraft([1, 2, 12, 3], q), 4, 10, sampled=True)  # 12: past the vocabulary
    assert isinstance(kept, SampledDraft) and kept.tokens == [1, 2] and torch.allclose(kept.probs, q[:2], atol=1e-6)
    assert valid_draft(SampledDraft([1, 2, 3], q), 2, 10, sampled=False) == [1, 2]  # chosen, for this request
    # drawn (kept at min(1, p/q)) only where the engine asked for a draw and the drafter says True
    assert not valid_draft(SampledDraft([1, 2], q), 2, 10, sampled=True, draw=False).drawn
    for falsy in (np.False_, 0, torch.tensor(False)):
        assert not valid_draft(SampledDraft([1, 2], q, drawn=falsy), 2, 10, sampled=True).drawn, falsy
    with pytest.raises(TypeError, match="probs of shape"):
        valid_draft(SampledDraft([1, 2, 3], q[:2]), 3, 10, sampled=True)
    assert samples_drafts(SamplingParams(temperature=0.8))
    assert not any(samples_drafts(p) for p in (None, SamplingParams(), SamplingParams(temperature=0.8, seed=1),
                                               SamplingParams(temperature=0.8, repetition_penalty=1.1),
                                               SamplingParams(temperature=0.8, presence_penalty=0.5)))


def _longest_reference(indexes, keys):
    """The search `longest_at` makes, written plainly: each index's own longest context of `keys`
    (every order's, `context_keys`), the longest of those, equal ones' counts added in index order."""
    from hibana_core.speculation.index import _merge

    best_n, best = 1, None
    for index in indexes:
        n, seen = index.lookup(keys, best_n)
        if seen is not None:
            best = seen if best is None or n > best_n else _merge(best, seen)
            best_n = n
    return (best_n, best) if best is not None else (0, None)


def test_longest_at_finds_what_longest_finds():
    """The suffix drafter's search (`longest_at`: orders longest first across the indexes, each
    key computed when reached) gives the plain search's answer over every order's keys: the
    longest context any index holds, equal lengths' counts added in index order; empty indexes
    and positions shorter than the longest order included."""
    from hibana_core.speculation.index import ContextIndex, context_keys, extend_hashes, longest_at, searched

    rng = random.Random(5)
    for _ in range(40):
        indexes = [ContextIndex() for _ in range(rng.randint(1, 3))]
        for index in indexes:
            index.extend([rng.randrange(6) for _ in range(rng.choice([0, 5, 60, 300]))])
        prefix = [0]
        extend_hashes(prefix, [rng.randrange(6) for _ in range(rng.randint(1, 40))])
        for end in range(1, len(prefix)):
            assert longest_at(searched(indexes), prefix, end) == _longest_reference(indexes, context_keys(prefix, end))


def test_rates_are_computed_once_between_records_and_follow_the_prior():
    """The controller reads every agent's rates at every step: they are kept until a record (the
    agent's own, or any agent's through the shared prior), and equal the formula then."""
    prior = AcceptanceStats()
    a, b = AcceptanceStats(prior), AcceptanceStats(prior)
    a.record(4, 2)
    first = a.rates()
    assert a.rates() is first  # kept
    b.record(8, 8)  # through the prior: a's shrinkage target moved
    assert a.rates() is not first
    for stats in (a, b, prior):
        base = [0.5] * len(stats.tries) if stats.prior is None else stats.prior.rates()
        assert stats.rates() == [(x + 2 * p) / (t + 2) for x, t, p in zip(stats.accepted, stats.tries, base)]


def test_the_cost_of_a_run_of_step_sizes_is_each_ones_cost():
    from hibana_core.speculation.controller import StepCostModel

    costs = StepCostModel([1, 2, 4, 8, 16, 64], [0.01, 0.011, 0.012, 0.02, 0.03, 0.09], sync_overhead=0.002)
    for first in (0, 1, 3, 15, 60, 64, 100):
        for verify in (False, True):
            assert costs.costs(first, 30, verify) == [costs.cost(n, verify) for n in range(first, first + 30)]
