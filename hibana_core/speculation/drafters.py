"""The built-in drafters: suffix (the default) and ngram (prompt lookup, the baseline).

A drafter proposes tokens that may follow a state's history; the engine verifies them in its
ordinary batched step, so a drafter only affects speed, never output. Drafters are registered
through the `register_drafters` hook like any plugin's: `register(name, factory)` with
`factory(engine) -> Drafter`, or `register(name, drafter)` with the drafter object itself.

Both built-ins keep one index per state, caught up lazily with the tokens appended since their
last proposal (one table update per token and order: the cost does not grow with the history).
When the history was edited (a sync that dropped a tail, a truncate), the tokens it dropped are
undone the same way if they all lie in the index's newest generation, else the index is rebuilt
from the last window (`WindowedIndex.rewind`). Host memory is
bounded twice: a state's index covers its last `state_window` to `2 * state_window` tokens only
(generations dropped whole, `WindowedIndex`), and all states' indexes together hold at most
`max_tokens` tokens (the least recently used states' indexes are dropped whole, and rebuilt from
their last window when next used). `summary()` reports both (engine.stats().speculation).
"""

from __future__ import annotations

import collections.abc
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

from hibana_core.config import needs_history
from hibana_core.errors import ConfigError
from hibana_core.speculation.index import (CONTEXT_INDEX_BYTES_PER_TOKEN, LAST_SEEN_BYTES_PER_TOKEN, ORDERS,
                                           ContextIndex, Seen, WindowedContextIndex, WindowedIndex,
                                           WindowedLastSeenIndex, extend_hashes, longest_at,
                                           searched)
from hibana_plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch

    from hibana_core.config import SamplingParams


class TokensView(collections.abc.Sequence):
    """A token list as drafters read it, without a copy: indexing, slices (new lists), len and
    iteration, and nothing that changes it. (A plugin's drafter that extended the live history
    it was handed changed the state's tokens and its greedy output.)"""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i):
        return self._tokens[i]

    def __iter__(self):
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"TokensView({self._tokens!r:.200})"


@dataclass(frozen=True)
class DraftInput:
    """What a drafter sees of one state: its history (read-only: a `TokensView`) and its identity."""

    tokens: Sequence[int]
    key: object
    """The state (per-state caches key on it; it is only weakly referenced)."""
    version: int
    """Changes whenever the history was edited other than by appending."""
    params: "SamplingParams | None" = None
    """The request's sampling parameters (None: unknown), for a drafter that samples its drafts
    from a distribution of its own (`SampledDraft`)."""
    draw: bool = True
    """Whether such a drafter should draw its drafts from q (else choose q's argmax, and still
    return q: `SampledDraft.drawn`). The speculator picks per state whichever keeps more, from
    what the target measures of both at each verified draft."""


@dataclass(frozen=True)
class SampledDraft:
    """A proposal drawn from the drafter's own distribution q rather than chosen: `tokens[i]` was
    sampled from `probs[i]` ([len(tokens), V] float32 on the engine's device, each row summing to
    1 over the vocabulary's first V ids; the engine moves a plugin's q to its device and rescales
    its rows, and a row with no mass on its own token has that draft verified as a chosen one:
    `speculator.sound_q`). The target then keeps draft i with probability
    min(1, p(x) / q(x)) and, at the first it rejects, draws from the residual max(0, p - q)
    (Leviathan et al. 2023; Chen et al. 2023): output in the target's distribution, with more
    drafts kept than a draft chosen greedily gets where q is close to p. A plain list of tokens is
    the deterministic proposal (kept exactly when the target's own draw equals it).

    Only for sampled requests without a seed, history penalties or a grammar (`samples_drafts`,
    and `Speculator._input` hands no params under a grammar): a seeded request's tokens are its
    own draws, the same with speculation on or off; penalties at a draft depend on the drafts
    before it, which a batched drafter has not read back; and a grammar cuts drafts by their values
    (a forbidden draft is rejected, so its position would need the residual, not p).

    `drawn=False`: the tokens are q's argmax (`DraftInput.draw` was False), kept as chosen ones
    are; q then only serves the measurement: at each verified draft the target reckons what both
    would keep, sum(min(p, q)) drawn and p(argmax q) chosen, and the speculator draws for a state
    where drawing keeps more (a confident target and a looser drafter keep more chosen)."""

    tokens: list[int]
    probs: "torch.Tensor"
    drawn: bool = True

    def __len__(self) -> int:
        return len(self.tokens)


def cut(proposal: "list[int] | SampledDraft", n: int) -> "list[int] | SampledDraft":
    """A proposal's first n tokens (a sampled one's with their distributions)."""
    if isinstance(proposal, SampledDraft):
        return SampledDraft(proposal.tokens[:n], proposal.probs[:n], proposal.drawn)
    return proposal[:n]


def samples_drafts(params: "SamplingParams | None") -> bool:
    """Whether a request's drafts may be a `SampledDraft`: it samples (temperature > 0), has no
    seed and no penalty that reads its history."""
    return params is not None and not params.greedy and params.seed is None and not needs_history(params)


@runtime_checkable
class Drafter(Protocol):
    def propose(self, state: DraftInput, k: int) -> "list[int] | SampledDraft":
        """Up to k tokens that may follow `state.tokens` (fewer, or none, when unsure): token ids,
        or a `SampledDraft` (the tokens with the distributions they were drawn from) where
        `samples_drafts(state.params)`."""

    # Optional, each used when a drafter has it: `finished(context: Sequence[int], output:
    # Sequence[int])`, a request generated `output` after `context` (its last tokens), for drafters
    # that learn across agents (the suffix drafter's shared corpus). `propose_many(states:
    # list[DraftInput], ks: list[int]) -> list[proposal]`, the proposals for several states in one
    # call (a draft model batches its forwards). `shadows = False`: proposals are costly, so
    # the controller learns acceptance from verify steps only (no free shadow proposals).
    # `summary()`: figures for engine.stats().speculation["drafters"]. `resident_bytes()`: device
    # bytes it holds. `close()`: called when the engine closes.


STATE_WINDOW = 1 << 14
"""Tokens of each state's history its index covers at least (at most twice that)."""


class _Entry:
    __slots__ = ("version", "index", "used")

    def __init__(self, version: int, index: WindowedIndex, used: int) -> None:
        self.version, self.index, self.used = version, index, used


class _PerState:
    """One windowed index per state, caught up with its history on use, rewound or rebuilt after
    edits; all of them together hold at most `max_tokens` indexed tokens.

    The running total counts what `get` indexed and dropped, not the indexes of states that died
    (they leave the weak dictionary unseen): when it says "over budget" the exact total is taken
    over the live entries and, if still over, the least recently used indexes are dropped whole
    down to 3/4 of the budget, so that eviction is amortised over many tokens.
    """

    def __init__(self, make: Callable[[], WindowedIndex], window: int, max_tokens: int) -> None:
        self._make = make
        self.window = window
        self.max_tokens = max_tokens
        self._entries: "weakref.WeakKeyDictionary[object, _Entry]" = weakref.WeakKeyDictionary()
        self._total = 0  # indexed tokens: exact, or over by the indexes of states that died
        self._clock = 0
        self.evictions = 0

    def get(self, state: DraftInput) -> WindowedIndex:
        tokens = state.tokens
        self._clock += 1
        entry = self._entries.get(state.key)
        counted = 0 if entry is None else entry.index.indexed
        if entry is not None and (entry.version != state.version or entry.index.num_tokens > len(tokens)):
            if entry.index.rewind(tokens):
                entry.version = state.version
            else:
                entry = None
        if entry is None:
            index = self._make()
            index.skip_to(tokens, max(0, len(tokens) - self.window))  # a rebuild takes the last window
            entry = self._entries[state.key] = _Entry(state.version, index, self._clock)
        index, entry.used = entry.index, self._clock
        if index.num_tokens < len(tokens):
            index.extend(tokens[index.num_tokens:])
        self._total += index.indexed - counted
        if self._total > self.max_tokens:
            self._shrink(state.key)
        return index

    def _shrink(self, serving: object) -> None:
        live = list(self._entries.items())
        self._total = sum(entry.index.indexed for _, entry in live)
        if self._total <= self.max_tokens:
            return
        for key, entry in sorted(live, key=lambda item: item[1].used):
            if self._total <= self.max_tokens * 3 // 4:
                break
            if key is not serving:  # it fits alone: max_tokens >= 2 * window
                del self._entries[key]
                self._total -= entry.index.indexed
                self.evictions += 1

    def indexed(self) -> int:
        return sum(entry.index.indexed for entry in list(self._entries.values()))

    def summary(self, bytes_per_token: int) -> dict:
        indexed = self.indexed()
        return {"states": len(self._entries), "indexed_tokens": indexed, "host_bytes": indexed * bytes_per_token,
                "state_window": self.window, "max_tokens": self.max_tokens, "evictions": self.evictions}


def _check_bounds(drafter: str, state_window: Any, max_tokens: Any, longest_context: int) -> None:
    for name, value in (("state_window", state_window), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{drafter}: {name}={value!r} is not a positive int; pass a token count "
                              f"(state_window >= {longest_context}, max_tokens >= 2 * state_window)")
    if state_window < longest_context:
        raise ConfigError(f"{drafter}: state_window={state_window} is shorter than the longest context it "
                          f"indexes ({longest_context} tokens); pass state_window >= {longest_context}")
    if max_tokens < 2 * state_window:
        raise ConfigError(f"{drafter}: max_tokens={max_tokens} cannot hold even one state's index (up to "
                          f"2 * state_window = {2 * state_window} tokens); pass max_tokens >= {2 * state_window} "
                          f"or a smaller state_window")


class _Corpus:
    """Recent outputs of all agents, bounded: two generations of `capacity / 2` tokens each; when
    an output would overfill the newer, the older is dropped whole and the output starts a new one
    (O(1) per token, no per-entry eviction). An output longer than a generation is indexed by its
    last `capacity / 2` tokens (added whole, a file an agent rewrote held the corpus at several
    times its bound)."""

    def __init__(self, capacity: int) -> None:
        self.half = max(1, capacity // 2)
        self.old, self.new = ContextIndex(), ContextIndex()
        self.size = 0

    @property
    def num_tokens(self) -> int:
        return self.old.num_tokens + self.new.num_tokens

    def add(self, context: Sequence[int], output: Sequence[int]) -> None:
        tokens = [*context, *output][-self.half:]  # contexts spanning into the output count
        if self.size and self.size + len(tokens) > self.half:
            self.old, self.new, self.size = self.new, ContextIndex(), 0
        self.new.extend(tokens)
        self.size += len(tokens)

    def newest_first(self) -> tuple[ContextIndex, ContextIndex]:
        """The generations, for `searched` (with other indexes)."""
        return self.new, self.old


def _best(seen: Seen) -> tuple[int, float]:
    """The most frequent continuation and its share of all continuations of that context."""
    if not isinstance(seen, dict):
        return seen, 1.0
    token = max(seen, key=seen.__getitem__)
    return token, seen[token] / sum(seen.values())


class SuffixDrafter:
    """Drafts from what this agent already wrote or read, and from what all agents wrote lately.

    At each drafted position the longest indexed context that ends there is looked up in the
    state's own index and in the shared corpus (the longer match wins; on a tie the counts add
    up); its most frequent continuation is drafted. Each token's score is its share of that
    context's continuations, discounted for short matches (n / (n + 1)); drafting stops once the
    running product of scores falls below `min_score`, so unsure drafts stay short.

    Each state's index covers its last `state_window` to `2 * state_window` tokens, and all of
    them together at most `max_tokens` (about 850 bytes of host memory per token: 1 << 19 tokens,
    some 450 MB, hold 16 to 32 agents' windows).
    """

    def __init__(self, engine: Any = None, corpus_tokens: int = 1 << 16, min_score: float = 0.1, *,
                 state_window: int = STATE_WINDOW, max_tokens: int = 1 << 19) -> None:
        self.context = max(ORDERS)
        _check_bounds("the suffix drafter", state_window, max_tokens, self.context)
        self.states = _PerState(lambda: WindowedContextIndex(state_window), state_window, max_tokens)
        self.corpus = _Corpus(corpus_tokens)
        self.min_score = min_score

    def propose(self, state: DraftInput, k: int) -> list[int]:
        index = self.states.get(state)
        # prefix hashes of the last `context` tokens, then of the drafts: a context's hash depends
        # on its tokens alone, so this window serves every lookup
        prefix = index.hashes[-self.context - 1:]
        tables = searched(index.newest_first() + list(self.corpus.newest_first()))  # own first: they win ties
        draft: list[int] = []
        score = 1.0
        while len(draft) < k:
            end = len(prefix) - 1
            n, seen = longest_at(tables, prefix, end)
            if seen is None:
                break
            token, share = _best(seen)
            score *= share * n / (n + 1)
            if score < self.min_score:
                break
            draft.append(token)
            extend_hashes(prefix, (token,))
        return draft

    def finished(self, context: Sequence[int], output: Sequence[int]) -> None:
        if output:
            self.corpus.add(context[-self.context:], output)

    def summary(self) -> dict:
        """Indexed states and tokens, the window and budget, the shared corpus's tokens, and the
        host bytes all of it holds (an estimate: `CONTEXT_INDEX_BYTES_PER_TOKEN`)."""
        figures = self.states.summary(CONTEXT_INDEX_BYTES_PER_TOKEN)
        figures["corpus_tokens"] = self.corpus.num_tokens
        figures["host_bytes"] += self.corpus.num_tokens * CONTEXT_INDEX_BYTES_PER_TOKEN
        return figures


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix of the history (of
    `min_n`..`max_n` tokens) and copy the k tokens that followed it.

    Bounded like the suffix drafter's: each state's last `state_window` to `2 * state_window`
    tokens, all states together at most `max_tokens`. Its index costs about 550 bytes per token
    against the suffix drafter's 850, so its default budget holds twice the tokens (1 << 20, some
    580 MB): the same order of host memory, and twice the agents' windows.
    """

    def __init__(self, engine: Any = None, min_n: int = 2, max_n: int = 8, *,
                 state_window: int = STATE_WINDOW, max_tokens: int = 1 << 20) -> None:
        orders = tuple(range(min_n, max_n + 1))
        _check_bounds("the ngram drafter", state_window, max_tokens, max(orders, default=0))
        self.states = _PerState(lambda: WindowedLastSeenIndex(orders, state_window), state_window, max_tokens)

    def propose(self, state: DraftInput, k: int) -> list[int]:
        index = self.states.get(state)
        n, at = index.latest(index.num_tokens)  # `at`: a position in the whole history
        if n == 0:
            return []
        return list(state.tokens[at:at + k])

    def summary(self) -> dict:
        """Indexed states and tokens, the window and budget, and the host bytes the indexes hold
        (an estimate: `LAST_SEEN_BYTES_PER_TOKEN`)."""
        return self.states.summary(LAST_SEEN_BYTES_PER_TOKEN)


def _draft_model(engine: Any, **options: Any) -> Drafter:
    """The draft-model drafter, imported on first use (it brings the loader and the KV cache)."""
    from hibana_core.speculation.draft_model import DraftModelDrafter

    return DraftModelDrafter(engine, **options)


def _layer_skip(engine: Any, **options: Any) -> Drafter:
    """The layer-skip self-draft (`hibana_core.surgery.layer_skip`), imported on first use."""
    from hibana_core.surgery.layer_skip import LayerSkipDrafter

    return LayerSkipDrafter(engine, **options)


@hookimpl
def register_drafters(register) -> None:
    register("suffix", SuffixDrafter)
    register("ngram", NgramDrafter)
    register("draft_model", _draft_model)
    register("layer_skip", _layer_skip)
