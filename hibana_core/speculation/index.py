"""Context indexes over token streams: what followed each recent context, updated per token.

Every context of the lengths in `ORDERS` ending at a position is hashed with a polynomial rolling
hash (mod a prime just under 2^30), so the hash of the last n tokens of any stream is O(1)
from its prefix hashes, and equal contexts hash alike in every stream (an agent's own history,
the engine-wide corpus, a draft being built). Appending a token costs one table update per order,
whatever the history's length. A hash collision can only make a draft worse, never an output
wrong: drafts are verified. The modulus keeps every hash one CPython digit (30 bits) and every
product two, which indexes a token in ~3.1 us against ~5.0 with the Mersenne prime 2^61 - 1 (the
coding trace, this machine's CPU); a window's 32k contexts of an order then meet an unseen one's
hash about once in 30,000 lookups, a wrong draft token at worst. Each step of a loaded engine
indexes and drafts for every agent on the host, between the device's steps.

    ContextIndex   context -> continuation counts (the suffix drafter's scores)
    LastSeenIndex  context -> where it last ended (prompt lookup: copy what followed)

A state's index covers only its recent tokens (`WindowedContextIndex`, `WindowedLastSeenIndex`):
two generations of `window` tokens each, the older dropped whole when the newer fills. An edit of
the history within the newer generation (a dropped tail) is undone token by token (`rewind`), at
a cost proportional to the tokens dropped, not to the window.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence, Union

from hibana_core.kv.sequence import common_prefix_len

Seen = Union[int, dict[int, int]]
"""What followed a context: one token (seen once), or {token: count}."""

CONTEXT_INDEX_BYTES_PER_TOKEN = 850
"""Host bytes a `ContextIndex` (all `ORDERS`) holds per indexed token, for reports: measured with
tracemalloc on 4k-36k tokens of random text with 30% copied spans, 790 to 870 depending on
where its dicts are in their doubling (with ten orders, 820 to 1040; less on more repetitive text,
whose contexts repeat). A windowed index adds 8 bytes per token for its copy of the tokens it
indexed (`WindowedIndex.tokens`), within that spread. `nbytes` counts table entries of one index
instead."""

LAST_SEEN_BYTES_PER_TOKEN = 550
"""The same for a `LastSeenIndex` of orders 2..8 (the ngram drafter's): 440 to 600 per token on
that text (about 460 at 200k tokens)."""

ORDERS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Context lengths indexed: short ones find scaffolds, long ones pin down where a copy is. Each
costs an update a token and a lookup a drafted position; 24 gave nothing beside 16 and 32 (16
conversations of each trace replayed at k 16: coding 39,991 accepted against 39,993 with it, demo
640 both; a proposal 84 against 95 us), (1, 2, 4, 8, 16, 32) 4% more steps on the coding trace."""

_MOD = (1 << 30) - 35  # prime
_BASE = 0x2F0B3A55  # any base in [2, MOD) works; large spreads short contexts
_POW = [1]
for _ in range(max(ORDERS) + 1):
    _POW.append(_POW[-1] * _BASE % _MOD)


def extend_hashes(prefix: list[int], tokens: Iterable[int]) -> None:
    """Append the prefix hashes of `tokens` to `prefix` (prefix[i]: hash of the first i tokens)."""
    h = prefix[-1]
    for t in tokens:
        h = (h * _BASE + t + 1) % _MOD
        prefix.append(h)


def context_keys(prefix: Sequence[int], end: int, orders: Sequence[int] = ORDERS) -> list[int | None]:
    """The hashes of the contexts of each order, longest first, that end at `end` (None for those
    longer than `end`): computed once, then looked up in every index of these orders (`lookup`)."""
    h = prefix[end]
    return [(h - prefix[end - n] * _POW[n]) % _MOD if n <= end else None for n in reversed(orders)]


class ContextIndex:
    """For each indexed context, the tokens that followed it and how often.

    A context seen once stores its continuation as a bare int (most long contexts are unique);
    a second continuation turns it into a {token: count} dict.
    """

    def __init__(self, orders: Sequence[int] = ORDERS) -> None:
        self.orders = tuple(orders)
        self.tables: list[dict[int, int | dict[int, int]]] = [{} for _ in self.orders]
        self.hashes = [0]  # prefix hashes of the stream indexed so far
        self._longest_first = tuple(zip(reversed(self.orders), reversed(self.tables)))
        self._steps = _steps(self.orders, self.tables)

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) - 1

    def extend(self, tokens: Iterable[int]) -> None:
        hashes, steps, top = self.hashes, self._steps, self.orders[-1] if self.orders else 0
        for t in tokens:
            end = len(hashes) - 1  # t sits at position `end`: contexts end just before it
            h = hashes[end]
            for n, table, power in (steps if end >= top else [s for s in steps if s[0] <= end]):
                key = (h - hashes[end - n] * power) % _MOD
                seen = table.get(key)
                if seen is None:
                    table[key] = t
                elif type(seen) is int:
                    table[key] = {seen: 2} if seen == t else {seen: 1, t: 1}
                else:
                    seen[t] = seen.get(t, 0) + 1
            hashes.append((h * _BASE + t + 1) % _MOD)

    def truncate(self, length: int, dropped: Sequence[int]) -> None:
        """Forget the tokens indexed from position `length` on (they were `dropped`): the tables
        become those of an index of the first `length` tokens, but that a continuation seen once
        may stay a {token: 1} dict (`_best` and `_merge` take it as the bare int). A dict's tokens
        keep the order of their first occurrence, which breaks ties, as in a fresh index."""
        hashes = self.hashes
        assert len(hashes) - 1 - length == len(dropped)
        for end, t in zip(range(length, len(hashes) - 1), dropped):
            for n, table in zip(self.orders, self.tables):
                if n > end:
                    break
                key = (hashes[end] - hashes[end - n] * _POW[n]) % _MOD
                seen = table[key]
                if type(seen) is int:  # seen once: here
                    del table[key]
                elif seen[t] > 1:
                    seen[t] -= 1
                elif len(seen) > 1:
                    del seen[t]
                else:
                    del table[key]
        del hashes[length + 1:]

    def continuations(self, prefix: Sequence[int], end: int) -> tuple[int, Seen | None]:
        """The longest indexed context ending at `end` of a stream with prefix hashes `prefix`:
        (its length, what followed it), or (0, None)."""
        return self.lookup(context_keys(prefix, end, self.orders))

    def lookup(self, keys: Sequence[int | None], at_least: int = 1) -> tuple[int, Seen | None]:
        """`continuations` of the contexts `keys` (`context_keys` of this index's orders), of
        `at_least` tokens or more."""
        if not self.tables[0]:
            return 0, None
        for (n, table), key in zip(self._longest_first, keys):
            if n < at_least:
                break
            if key is not None:
                seen = table.get(key)
                if seen is not None:
                    return n, seen
        return 0, None

    def nbytes(self) -> int:
        """A rough size: ~100 bytes per table entry (dicts of ints in CPython)."""
        return 100 * sum(len(t) for t in self.tables) + 8 * len(self.hashes)


def _steps(orders: Sequence[int], tables: Sequence[dict]) -> tuple[tuple[int, dict, int], ...]:
    """(order, its table, BASE^order) a token's update visits, shortest first (orders ascend)."""
    assert list(orders) == sorted(orders), "orders ascend"
    return tuple(zip(orders, tables, [_POW[n] for n in orders]))


def searched(indexes: Sequence[ContextIndex]) -> list[tuple[tuple[int, dict], ...]]:
    """What `longest_at` searches: each non-empty index's tables, longest order first. The
    indexes share their orders."""
    live = [index._longest_first for index in indexes if index.tables and index.tables[0]]
    orders = [n for n, _ in live[0]] if live else []
    if any([n for n, _ in firsts] != orders for firsts in live[1:]):
        raise ValueError("longest_at searches indexes of the same orders")
    return live


def longest_at(live: Sequence[tuple[tuple[int, dict], ...]], prefix: Sequence[int],
               end: int) -> tuple[int, Seen | None]:
    """The longest context ending at `end` of a stream with prefix hashes `prefix` that any of the
    indexes `live = searched(indexes)` holds, as (its length, what followed it), or (0, None):
    contexts of equal length add up their counts, the first index's continuations first (they
    win ties of `max`). The orders are tried longest first across every index, each order's key
    computed only when the search gets to it (where a draft copies, the longest: one key, not
    one per order)."""
    if not live:
        return 0, None
    h = prefix[end]
    for i, (n, _) in enumerate(live[0]):
        if n > end:
            continue
        key = (h - prefix[end - n] * _POW[n]) % _MOD
        best = None
        for firsts in live:
            seen = firsts[i][1].get(key)
            if seen is not None:
                best = seen if best is None else _merge(best, seen)
        if best is not None:
            return n, best
    return 0, None


def _merge(a: Seen, b: Seen) -> dict[int, int]:
    merged = dict(a) if isinstance(a, dict) else {a: 1}
    for token, count in (b.items() if isinstance(b, dict) else [(b, 1)]):
        merged[token] = merged.get(token, 0) + count
    return merged


class LastSeenIndex:
    """For each indexed context, the position right after its latest occurrence."""

    def __init__(self, orders: Sequence[int]) -> None:
        self.orders = tuple(orders)
        self.tables: list[dict[int, int]] = [{} for _ in self.orders]
        self.hashes = [0]
        self._longest_first = tuple(zip(reversed(self.orders), reversed(self.tables)))
        self._steps = _steps(self.orders, self.tables)

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) - 1

    def extend(self, tokens: Iterable[int]) -> None:
        hashes, steps, top = self.hashes, self._steps, self.orders[-1] if self.orders else 0
        for t in tokens:
            end = len(hashes) - 1
            h = hashes[end]
            for n, table, power in (steps if end >= top else [s for s in steps if s[0] <= end]):
                table[(h - hashes[end - n] * power) % _MOD] = end
            hashes.append((h * _BASE + t + 1) % _MOD)

    def truncate(self, length: int, dropped: Sequence[int]) -> None:
        """Forget the tokens indexed from position `length` on (`dropped`, unused: the positions
        name the entries). A context whose latest occurrence was dropped is forgotten whole, its
        earlier occurrences with it (the index keeps no history of overwritten positions): that
        only makes drafts worse, never wrong; every position it still holds is its context's
        latest occurrence in the first `length` tokens."""
        hashes = self.hashes
        for end in range(length, len(hashes) - 1):
            for n, table in zip(self.orders, self.tables):
                if n <= end:
                    key = (hashes[end] - hashes[end - n] * _POW[n]) % _MOD
                    if table.get(key) == end:
                        del table[key]
        del hashes[length + 1:]

    def latest(self, end: int) -> tuple[int, int]:
        """Where the longest context ending at `end` (of the indexed stream itself) occurred
        before, as (its length, the position after it), or (0, -1). The context at `end` itself
        is not indexed yet, so a match is always an earlier occurrence."""
        return self.lookup(context_keys(self.hashes, end, self.orders))

    def lookup(self, keys: Sequence[int | None], at_least: int = 1) -> tuple[int, int]:
        """`latest` for the contexts `keys` (`context_keys` of this index's orders, of any stream),
        of `at_least` tokens or more: (the length, the position in this index's stream after its
        latest occurrence), or (0, -1)."""
        for (n, table), key in zip(self._longest_first, keys):
            if n < at_least:
                break
            if key is not None:
                at = table.get(key)
                if at is not None:
                    return n, at
        return 0, -1


class WindowedIndex:
    """One stream's last `window` to `2 * window` tokens, indexed in generations: when the newest
    has indexed `window` tokens a new one starts, and the older of the previous two is dropped
    whole (O(1) amortised per token, no per-entry eviction).

        stream            dropped | older: window tokens | newest: up to window tokens
        newest's hashes                           [ seed ]+ one per token it indexed
        tokens                  [ seed ]+ every token of both generations (for `rewind`)

    A new generation starts with the prefix hashes of the stream's last `seed` (the longest
    order) tokens and indexes none of them, so a context that spans the boundary is indexed by
    the new generation and no context twice. A context's hash depends on its tokens alone, so the
    newest generation's prefix hashes (`hashes`) serve lookups in every generation. Positions are
    absolute: the stream's, from its first token, indexed or not.

    An edit of the stream (`rewind`) that keeps the newest generation's seed undoes the entries
    of the tokens it dropped, in that generation only; an older edit rebuilds the index.
    """

    def __init__(self, make: Callable[[], ContextIndex | LastSeenIndex], window: int) -> None:
        self._make = make
        self.window = window
        self.generations = [make()]  # oldest first, at most two
        self.bases = [0]  # the stream position of each generation's local position 0 (its seed's start)
        self.starts = [0]  # the stream position of each generation's first indexed token
        self.seed = max(self.generations[0].orders, default=0)
        self.orders = self.generations[0].orders
        self.num_tokens = 0
        """The stream's length (indexed or not)."""
        self.tokens: list[int] = []
        """The stream's tokens from `bases[0]` on (the oldest seed, then every indexed token)."""

    @property
    def hashes(self) -> list[int]:
        """Prefix hashes of the newest generation: at least the stream's last `seed` tokens'."""
        return self.generations[-1].hashes

    @property
    def indexed(self) -> int:
        """Tokens indexed (seeds excluded): at most `2 * window`."""
        return self.num_tokens - self.starts[0]

    def skip_to(self, history: Sequence[int], start: int) -> None:
        """On an empty index: index `history` from `start` on only (the tokens before it are the
        first generation's seed); `extend(history[start:])` follows."""
        assert self.num_tokens == 0, "skip_to starts an empty index"
        seed = history[max(0, start - self.seed):start]
        extend_hashes(self.hashes, seed)
        self.tokens = list(seed)
        self.bases[0], self.starts[0], self.num_tokens = start - len(seed), start, start

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        done, count = 0, len(tokens)
        while done < count:
            room = self.window - (self.num_tokens - self.starts[-1])
            if room <= 0:
                self._roll()
                room = self.window
            take = min(count - done, room)
            self.generations[-1].extend(tokens if take == count else tokens[done:done + take])
            done += take
            self.num_tokens += take

    def _roll(self) -> None:
        fresh = self._make()
        fresh.hashes[:] = self.hashes[-self.seed - 1:]  # the seed: prefix hashes only, nothing indexed
        end = self.num_tokens
        self.generations.append(fresh)
        self.bases.append(end - fresh.num_tokens)
        self.starts.append(end)
        if len(self.generations) > 2:
            del self.tokens[:self.bases[1] - self.bases[0]]
            del self.generations[0], self.bases[0], self.starts[0]

    def rewind(self, history: Sequence[int]) -> bool:
        """After an edit, make this the index of `history` (which `extend` then catches up with)
        by undoing the tokens it no longer has, if that is cheaper than a rebuild and leaves the
        index what a rebuild from the same first generation would be; False: rebuild it.

        Undone: the tokens after the longest common prefix of the indexed tokens and `history`,
        when they all lie in the newest generation (its seed kept), when undoing them and
        indexing the new ones costs less than indexing a fresh window, and when the index keeps
        half a window (or the whole history) of tokens that `history` still has."""
        base, old = self.bases[0], self.tokens
        same = base + common_prefix_len(old, history[base:])
        if (same < self.starts[-1] or same - self.starts[0] < min(self.window // 2, same)
                or (self.num_tokens - same) + (len(history) - same) >= min(len(history), self.window)):
            return False
        if same < self.num_tokens:
            self.generations[-1].truncate(same - self.bases[-1], old[same - base:])
            del old[same - base:]
            self.num_tokens = same
            if same == self.starts[-1] and len(self.generations) > 1:  # left empty: the next token rolls
                del self.generations[-1], self.bases[-1], self.starts[-1]
        return True


class WindowedContextIndex(WindowedIndex):
    """A `ContextIndex` of a stream's recent tokens (see `WindowedIndex`)."""

    def __init__(self, window: int, orders: Sequence[int] = ORDERS) -> None:
        super().__init__(lambda: ContextIndex(orders), window)

    def continuations(self, prefix: Sequence[int], end: int) -> tuple[int, Seen | None]:
        """As `ContextIndex.continuations`, over every generation: the longest context wins, equal
        lengths add up their counts."""
        return longest_at(searched(self.newest_first()), prefix, end)

    def newest_first(self) -> list[ContextIndex]:
        """The generations, for `searched` (with other indexes)."""
        return self.generations[::-1]


class WindowedLastSeenIndex(WindowedIndex):
    """A `LastSeenIndex` of a stream's recent tokens (see `WindowedIndex`)."""

    def __init__(self, orders: Sequence[int], window: int) -> None:
        super().__init__(lambda: LastSeenIndex(orders), window)

    def latest(self, end: int) -> tuple[int, int]:
        """As `LastSeenIndex.latest` (`end` and the position returned are the stream's): the
        longest context wins, and of equal ones the most recent occurrence."""
        keys = context_keys(self.hashes, end - self.bases[-1], self.orders)
        best_n, best_at = 0, -1
        for generation, base in zip(reversed(self.generations), reversed(self.bases)):
            n, at = generation.lookup(keys, best_n + 1)  # an older occurrence must be longer
            if n > best_n:
                best_n, best_at = n, base + at
        return best_n, best_at
