"""The built-in drafters: suffix (the default) and ngram (prompt lookup, the baseline).

A drafter proposes tokens that may follow a state's history; the engine verifies them in its
ordinary batched step, so a drafter only affects speed, never output. Drafters are registered
through the `register_drafters` hook like any plugin's: `register(name, factory)` with
`factory(engine) -> Drafter`, or `register(name, drafter)` with the drafter object itself.

Both built-ins keep one index per state, caught up lazily with the tokens appended since their
last proposal (one table update per token and order: the cost does not grow with the history)
and rebuilt when the history was edited (a sync that dropped a tail, a truncate).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from hibana_core.speculation.index import ORDERS, ContextIndex, LastSeenIndex, extend_hashes
from hibana_plugins.hookspecs import hookimpl


@dataclass(frozen=True)
class DraftInput:
    """What a drafter sees of one state: its history (read-only) and its identity."""

    tokens: Sequence[int]
    key: object
    """The state (per-state caches key on it; it is only weakly referenced)."""
    version: int
    """Changes whenever the history was edited other than by appending."""


@runtime_checkable
class Drafter(Protocol):
    def propose(self, state: DraftInput, k: int) -> list[int]:
        """Up to k tokens that may follow `state.tokens` (fewer, or none, when unsure)."""

    # Optional, each used when a drafter has it: `finished(context: Sequence[int], output:
    # Sequence[int])`, a request generated `output` after `context` (its last tokens), for drafters
    # that learn across agents (the suffix drafter's shared corpus). `propose_many(states:
    # list[DraftInput], ks: list[int]) -> list[list[int]]`, the proposals for several states in
    # one call (a draft model batches its forwards). `shadows = False`: proposals are costly, so
    # the controller learns acceptance from verify steps only (no free shadow proposals).
    # `summary()`: figures for engine.stats().speculation["drafters"]. `resident_bytes()`: device
    # bytes it holds. `close()`: called when the engine closes.


class _PerState:
    """One index per state, caught up with its history on use, rebuilt after edits."""

    def __init__(self, make) -> None:
        self._make = make
        self._indexes: "weakref.WeakKeyDictionary[object, tuple[int, Any]]" = weakref.WeakKeyDictionary()

    def get(self, state: DraftInput):
        version, index = self._indexes.get(state.key, (None, None))
        if index is None or version != state.version or index.num_tokens > len(state.tokens):
            index = self._make()
            self._indexes[state.key] = (state.version, index)
        if index.num_tokens < len(state.tokens):
            index.extend(state.tokens[index.num_tokens:])
        return index


class _Corpus:
    """Recent outputs of all agents, bounded: two generations of `capacity / 2` tokens each; when
    the newer fills, the older is dropped whole (O(1) per token, no per-entry eviction)."""

    def __init__(self, capacity: int) -> None:
        self.half = max(1, capacity // 2)
        self.old, self.new = ContextIndex(), ContextIndex()
        self.size = 0

    def add(self, context: Sequence[int], output: Sequence[int]) -> None:
        if self.size >= self.half:
            self.old, self.new, self.size = self.new, ContextIndex(), 0
        self.new.extend(list(context) + list(output))  # contexts spanning into the output count
        self.size += len(context) + len(output)

    def continuations(self, prefix: Sequence[int], end: int) -> tuple[int, dict[int, int] | int | None]:
        n_new, new = self.new.continuations(prefix, end)
        n_old, old = self.old.continuations(prefix, end)
        if n_old > n_new:
            return n_old, old
        if n_old == n_new and old is not None and new is not None:
            return n_new, _merge(new, old)
        return n_new, new


def _merge(a: dict[int, int] | int, b: dict[int, int] | int) -> dict[int, int]:
    merged = dict(a) if isinstance(a, dict) else {a: 1}
    for token, count in (b.items() if isinstance(b, dict) else [(b, 1)]):
        merged[token] = merged.get(token, 0) + count
    return merged


def _best(seen: dict[int, int] | int) -> tuple[int, float]:
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
    """

    def __init__(self, engine: Any = None, corpus_tokens: int = 1 << 16, min_score: float = 0.1) -> None:
        self.states = _PerState(ContextIndex)
        self.corpus = _Corpus(corpus_tokens)
        self.min_score = min_score
        self.context = max(ORDERS)

    def propose(self, state: DraftInput, k: int) -> list[int]:
        index = self.states.get(state)
        # prefix hashes of the last `context` tokens, then of the drafts: a context's hash depends
        # on its tokens alone, so this window serves every lookup
        prefix = index.hashes[-self.context - 1:]
        draft: list[int] = []
        score = 1.0
        while len(draft) < k:
            end = len(prefix) - 1
            n_own, own = index.continuations(prefix, end)
            n_all, shared = self.corpus.continuations(prefix, end)
            if own is None and shared is None:
                break
            if n_all > n_own:
                n, seen = n_all, shared
            elif n_all == n_own and shared is not None:
                n, seen = n_own, _merge(own, shared)
            else:
                n, seen = n_own, own
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


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix of the history (of
    `min_n`..`max_n` tokens) and copy the k tokens that followed it."""

    def __init__(self, engine: Any = None, min_n: int = 2, max_n: int = 8) -> None:
        orders = tuple(range(min_n, max_n + 1))
        self.states = _PerState(lambda: LastSeenIndex(orders))

    def propose(self, state: DraftInput, k: int) -> list[int]:
        index = self.states.get(state)
        n, at = index.latest(index.num_tokens)
        if n == 0:
            return []
        return list(state.tokens[at:at + k])


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
