"""Context indexes over token streams: what followed each recent context, updated per token.

Every context of the lengths in `ORDERS` ending at a position is hashed with a polynomial rolling
hash (mod the Mersenne prime 2^61 - 1), so the hash of the last n tokens of any stream is O(1)
from its prefix hashes, and equal contexts hash alike in every stream (an agent's own history,
the engine-wide corpus, a draft being built). Appending a token costs one table update per order,
whatever the history's length. A hash collision can only make a draft worse, never an output
wrong: drafts are verified.

    ContextIndex   context -> continuation counts (the suffix drafter's scores)
    LastSeenIndex  context -> where it last ended (prompt lookup: copy what followed)
"""

from __future__ import annotations

from typing import Iterable, Sequence

ORDERS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
"""Context lengths indexed: short ones find scaffolds, long ones pin down where a copy is."""

_MOD = (1 << 61) - 1
_BASE = 0x5DEECE66D1  # any base in [2, MOD) works; odd and large spreads short contexts
_POW = [1]
for _ in range(max(ORDERS) + 1):
    _POW.append(_POW[-1] * _BASE % _MOD)


def extend_hashes(prefix: list[int], tokens: Iterable[int]) -> None:
    """Append the prefix hashes of `tokens` to `prefix` (prefix[i]: hash of the first i tokens)."""
    h = prefix[-1]
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        prefix.append(h)


def context_hash(prefix: Sequence[int], end: int, n: int) -> int:
    """Hash of the n tokens before position `end`, from the prefix hashes."""
    return (prefix[end] - prefix[end - n] * _POW[n]) % _MOD


class ContextIndex:
    """For each indexed context, the tokens that followed it and how often.

    A context seen once stores its continuation as a bare int (most long contexts are unique);
    a second continuation turns it into a {token: count} dict.
    """

    def __init__(self, orders: Sequence[int] = ORDERS) -> None:
        self.orders = tuple(orders)
        self.tables: list[dict[int, int | dict[int, int]]] = [{} for _ in self.orders]
        self.hashes = [0]  # prefix hashes of the stream indexed so far

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) - 1

    def extend(self, tokens: Iterable[int]) -> None:
        hashes = self.hashes
        for t in tokens:
            end = len(hashes) - 1  # t sits at position `end`: contexts end just before it
            for n, table in zip(self.orders, self.tables):
                if n > end:
                    break
                key = (hashes[end] - hashes[end - n] * _POW[n]) % _MOD
                seen = table.get(key)
                if seen is None:
                    table[key] = t
                elif type(seen) is int:
                    table[key] = {seen: 2} if seen == t else {seen: 1, t: 1}
                else:
                    seen[t] = seen.get(t, 0) + 1
            hashes.append((hashes[end] * _BASE + t + 1) % _MOD)

    def continuations(self, prefix: Sequence[int], end: int) -> tuple[int, dict[int, int] | int | None]:
        """The longest indexed context ending at `end` of a stream with prefix hashes `prefix`:
        (its length, what followed it), or (0, None)."""
        for n, table in zip(reversed(self.orders), reversed(self.tables)):
            if n <= end:
                seen = table.get((prefix[end] - prefix[end - n] * _POW[n]) % _MOD)
                if seen is not None:
                    return n, seen
        return 0, None

    def nbytes(self) -> int:
        """A rough size: ~100 bytes per table entry (dicts of ints in CPython)."""
        return 100 * sum(len(t) for t in self.tables) + 8 * len(self.hashes)


class LastSeenIndex:
    """For each indexed context, the position right after its latest occurrence."""

    def __init__(self, orders: Sequence[int]) -> None:
        self.orders = tuple(orders)
        self.tables: list[dict[int, int]] = [{} for _ in self.orders]
        self.hashes = [0]

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) - 1

    def extend(self, tokens: Iterable[int]) -> None:
        hashes = self.hashes
        for t in tokens:
            end = len(hashes) - 1
            for n, table in zip(self.orders, self.tables):
                if n <= end:
                    table[(hashes[end] - hashes[end - n] * _POW[n]) % _MOD] = end
            hashes.append((hashes[end] * _BASE + t + 1) % _MOD)

    def latest(self, end: int) -> tuple[int, int]:
        """Where the longest context ending at `end` (of the indexed stream itself) occurred
        before, as (its length, the position after it), or (0, -1). The context at `end` itself
        is not indexed yet, so a match is always an earlier occurrence."""
        for n, table in zip(reversed(self.orders), reversed(self.tables)):
            if n <= end:
                at = table.get(context_hash(self.hashes, end, n))
                if at is not None:
                    return n, at
        return 0, -1
