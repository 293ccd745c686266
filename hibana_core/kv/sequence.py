"""One state's token history and the KV blocks behind it.

    tokens:     t0 t1 ... t15 | t16 ... t31 | t32 ... t37          (the history the state holds)
    block_ids:  [    b7      ,     b2      ,    b9     ]           (KV of tokens[:num_computed])
    committed:  [    yes     ,     yes     ,    no     ]           (full blocks, in the prefix index)

`tokens` holds real token ids only. KV exists for the first `num_computed` positions; the rest
of the history is "catching up" (a prompt remainder, the last sampled token). While a request
runs, `num_computed` may run ahead of `tokens` by the tokens sampled on the device and not yet
read back (the scheduler counts those as placeholders; their KV is written by the next step).
A block enters the prefix index (`commit_full_blocks`) only once all its tokens are known.
Committed blocks are immutable and may be shared: writing into one first copies it
(copy-on-write), or, where this state alone holds it and the pool has no block to spare, takes it
out of the prefix index (`BlockPool.uncommit`) and writes in place. The protocol follows mlx-lm's caches: `set_tokens` (sync), `trim(n)`, `fork`,
`release`.

With a `KVLayout` of several groups (sliding-window models) the state holds one table per group,
all indexed by the same block positions. A window group frees the blocks that no query from
`num_computed` on can see and points them at NULL_BLOCK:

    tokens:        0 .. 15 | 16 .. 31 | 32 .. 47 | 48 .. 53      window 20, num_computed 54
    full group:    [  b7   ,    b2    ,    b9    ,   b4   ]
    window group:  [ NULL  ,    b5    ,    b1    ,   b8   ]      keys from 54 - 20 + 1 = 35 on

Such a state can only continue at positions whose window it still holds: cutting the history
back into the freed part (an edit, a rollback past it) drops its KV and recomputes, adopting what
the prefix index still holds (`reuse_cached_blocks`). Each group's blocks are published in the
prefix index under the chain hash salted by the group; a prefix hit needs every full group's
blocks and the window groups' blocks inside the window of the hit.
"""

from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Callable, Iterable, Sequence

from hibana_core.kv.block_pool import BlockHash, BlockPool, hash_block
from hibana_core.kv.layout import NULL_BLOCK, KVLayout
from hibana_core.kv.recurrent import RecurrentState


@dataclass(frozen=True)
class LongRope:
    """LongRoPE as transformers applies it. A request's prefill over a history of more than
    `switch` (original_max_position_embeddings) tokens rotates every position by the long
    factors, a shorter one by the short factors; a token generated at position p >= switch is
    rotated by the long ones. What the KV of the positions below the switch holds once
    generation crosses it is the family's:

        recompute     (Phi-3's generate) its cache is dropped at the token that crosses the
                      switch and the whole sequence recomputed under the long factors; so is a
                      state's here (`KVSequence.rotate_for`, once per state)
        otherwise     (llama's, qwen2's, ...: no such rule in their generate) it keeps the short
                      rotation until the next request's prefill, which recomputes the whole
                      history under the long factors (`KVSequence.begin_request`)

    A history that shrinks back below the switch goes back to the short rotation. The model's
    cos/sin tables hold a per-position rotation (short below the switch, long from there: what
    generation past the switch reads; a draft model's states hold its own LongRoPE alike) and, from row `offset` on,
    the long rotation of the positions below the switch (`rope_positions`)."""

    switch: int
    offset: int
    recompute: bool = True


_LONG_ROPE_SALT = b"long-rope"
"""The first block hash's parent under the long rotation: its blocks are other bytes than the
same tokens' per-position ones, so the prefix index keeps the two apart."""


def page_counts(sink_blocks: Sequence[int], starts: Sequence[int], n: int, block_size: int) -> list[tuple[int, int]]:
    """Per layer group, (sink pages, window pages) among the pages of the first n positions of
    a state whose pages resume at `starts` after the blocks its windows freed (`KVSequence.pages`):
    the group's first blocks up to its sink blocks, then blocks start..end-1."""
    end = -(-n // block_size)
    return [(min(sink, end), max(0, end - max(start, min(sink, end)))) for sink, start in zip(sink_blocks, starts)]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: list comparisons run in C, 4096 tokens at a time, then
    by halving within the first chunk that differs (log n slice comparisons), so no Python loop
    runs over the tokens and the copies stop at the first difference (an edit near the end of a
    long history copies what it must compare, no more)."""
    a = a if isinstance(a, list) else list(a)  # slices compare equal only between lists
    b = b if isinstance(b, list) else list(b)
    count = min(len(a), len(b))
    for lo in range(0, count, 4096):
        hi = min(lo + 4096, count)
        if a[lo:hi] != b[lo:hi]:
            break
    else:
        return count
    while hi - lo > 1:  # a[:lo] == b[:lo], and a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class KVSequence:
    def __init__(self, pool: BlockPool, copy_block: Callable[[int, int], None],
                 share: bool = True, long_rope: LongRope | None = None, layout: KVLayout | None = None,
                 recurrent: RecurrentState | None = None) -> None:
        self.pool = pool
        # a hybrid model's linear-attention state (kv/recurrent.py): valid at `num_computed` only,
        # so a cut continues from a snapshot (`_keep_kv`), and prefix blocks are adopted only as far
        # as a published state of the same prefix (`_shared_hit`)
        self.recurrent = recurrent
        self.long_rope = long_rope  # the model's LongRoPE, or None
        self.rotated_long = False   # the KV is under LongRoPE's long rotation at every position
        self.share = share  # False: never adopt or publish blocks through the prefix index
        self.block_size = pool.block_size
        self._copy_block = copy_block
        self.layout = layout
        # each group's window (None: full attention); a layout-less sequence has one full group
        self.windows: tuple[int | None, ...] = (None,) if layout is None else tuple(g.window for g in layout.groups)
        self._windowed = any(w is not None for w in self.windows)
        # per group: leading blocks a window group keeps whatever the window (its sink tokens')
        self._sinks = [0] * len(self.windows) if layout is None else list(layout.sink_blocks(self.block_size))
        self.tokens: list[int] = []
        self.tables: list[list[int]] = [[] for _ in self.windows]  # block ids per group
        self._floors = [0] * len(self.windows)  # per group: entries from its sink blocks to here are NULL_BLOCK
        self.num_computed = 0
        self.num_committed = 0           # leading blocks known to be in the prefix index
        self._hashes: list[BlockHash] = []  # chain hashes of tokens' leading full blocks
        self.edits = 0  # bumped when the history changes other than by appending (drafters' indexes)
        self.parked = None  # a copy of its KV in host memory (kv.tiers.ParkedKV) while evicted

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def block_ids(self) -> list[int]:
        """The first group's block table (the only one unless the layout has window groups)."""
        return self.tables[0]

    def _gap(self, group: int) -> tuple[int, int]:
        """The entries [lo, hi) of a group's table that left its window (NULL_BLOCK): from its
        sink blocks to its floor; empty (lo == hi) for most groups and states."""
        lo = min(self._sinks[group], len(self.tables[group]))
        return lo, max(lo, min(self._floors[group], len(self.tables[group])))

    def _gaps(self) -> list[tuple[int, int]]:
        """`_gap` of every group."""
        return [self._gap(g) for g in range(len(self.tables))]

    @property
    def num_blocks(self) -> int:
        """Device blocks this state holds, every group's (NULL_BLOCK entries not counted)."""
        if not any(self.tables):  # parked or released: the eviction scan meets many of these
            return 0
        return sum(len(t) - (hi - lo) for t, (lo, hi) in zip(self.tables, self._gaps()))

    def held_blocks(self) -> Iterable[int]:
        """The device blocks this state holds, every group's."""
        return itertools.chain.from_iterable(self._live(g, 0, len(t)) for g, t in enumerate(self.tables))

    def _live(self, group: int, start: int, end: int) -> list[int]:
        """The blocks a group's table holds at entries start..end-1 (the gap's skipped)."""
        lo, hi = self._gap(group)
        table = self.tables[group]
        return table[start:min(end, lo)] + table[max(start, hi):end]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def sync_length(self) -> int:
        """The tokens a request that samples nothing (a sync) computes: all, or a hybrid state's all
        but the last. Its linear layers' state cannot step back a token (`RecurrentState.rewind`
        goes back to a snapshot), and the next generation needs that token's logits: it computes
        the token then, rather than the history again."""
        return len(self.tokens) - (self.recurrent is not None and bool(self.tokens))

    def prefix_hash(self, index: int) -> BlockHash:
        """Chain hash of the tokens of full block `index` and all before it (lazily, cached)."""
        bs = self.block_size
        while len(self._hashes) <= index:
            i = len(self._hashes)
            parent = self._hashes[-1] if i else (_LONG_ROPE_SALT if self.rotated_long else None)
            self._hashes.append(hash_block(parent, self.tokens[i * bs:(i + 1) * bs]))
        return self._hashes[index]

    def _key(self, index: int, group: int) -> BlockHash:
        """The prefix index's key of block `index` of a group: its chain hash, salted past group 0."""
        digest = self.prefix_hash(index)
        return digest if group == 0 else digest + group.to_bytes(2, "little")

    def _window_start(self, group: int, position: int) -> int:
        """The first block of the window a query at `position` reads in `group` (0 for full
        attention); a window group with sink tokens also reads its first blocks."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def rope_positions(self, start: int, end: int) -> Iterable[int]:
        """The rotary tables' rows of positions start..end-1 (`LongRope`): the positions
        themselves, but under the long rotation those below the switch read its long rows."""
        if not self.rotated_long or start >= self.long_rope.switch:
            return range(start, end)
        switch, offset = self.long_rope.switch, self.long_rope.offset
        return itertools.chain(range(start + offset, min(end, switch) + offset), range(max(start, switch), end))

    def begin_request(self) -> bool:
        """A request on the history held now is about to compute: under LongRoPE, the rotation
        its length asks for (`rotate_for`). Returns whether KV was dropped."""
        long = self.long_rope is not None and len(self.tokens) > self.long_rope.switch
        return self._rotate(long)

    def hold_rotation(self, long: bool) -> bool:
        """Hold the KV under LongRoPE's long rotation or the per-position one, as another state
        does (a draft model's states follow their target's). Returns whether KV was dropped."""
        return self.long_rope is not None and self._rotate(long)

    def rotate_for(self, length: int) -> bool:
        """Under a recomputing LongRoPE (`LongRope.recompute`), before a step computes the
        positions up to `length`: once the sequence grows past the switch, its whole KV turns to
        the long rotation, as Phi-3's generate recomputes its cache at the token that crosses
        it. Returns whether KV was dropped."""
        if not self._recomputes_at_switch():
            return False  # positions past the switch read their long rows; the rest stays
        return self._rotate(self.rotated_long or length > self.long_rope.switch)

    def rotation_room(self, end: int) -> int:
        """Positions a step may compute from `end` on before a drafted chunk would cross a
        recomputing LongRoPE's switch under the short rotation (it would then be recomputed:
        `rotate_for`)."""
        if not self._recomputes_at_switch() or self.rotated_long:
            return 1 << 30
        return max(0, self.long_rope.switch - end)

    def _recomputes_at_switch(self) -> bool:
        """Whether crossing the LongRoPE switch recomputes the KV (`LongRope.recompute`)."""
        return self.long_rope is not None and self.long_rope.recompute

    def _rotate(self, long: bool) -> bool:
        """Hold KV under the long rotation or not; KV of the other one is dropped (recomputed)."""
        if long == self.rotated_long:
            return False
        self.rotated_long = long
        self._hashes.clear()
        self._keep_kv(0)
        return True

    # --- edits of the history ----------------------------------------------------------------

    def set_tokens(self, tokens: Sequence[int]) -> int:
        """Hold exactly `tokens`, keeping the KV of the common prefix. Returns the tokens kept."""
        same = common_prefix_len(self.tokens, tokens)
        self.edits += same < len(self.tokens)
        self.tokens = list(tokens)
        del self._hashes[same // self.block_size:]
        self._keep_kv(min(same, self.num_computed))
        return self.num_computed

    def trim(self, n: int) -> None:
        """Keep the first n tokens (rolls back drafts, truncates)."""
        self.set_tokens(self.tokens[:n])

    def append(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def trim_kv(self, n: int) -> None:
        """Keep the KV of the first n tokens only (the tokens stay)."""
        self._keep_kv(min(n, self.num_computed))

    def release(self) -> None:
        """Drop all KV (the tokens stay); full blocks remain findable in the prefix index. A
        recurrent state gives its slots back."""
        self._keep_kv(0)
        if self.recurrent is not None:
            self.recurrent.release()

    def fork(self) -> "KVSequence":
        twin = KVSequence(self.pool, self._copy_block, self.share, self.long_rope, self.layout)
        twin.rotated_long = self.rotated_long
        twin.tokens = list(self.tokens)
        twin.edits = self.edits
        twin._hashes = list(self._hashes)
        twin.tables = [list(t) for t in self.tables]
        twin._floors = list(self._floors)
        twin.num_computed, twin.num_committed = self.num_computed, self.num_committed
        for block in twin.held_blocks():
            self.pool.incref(block)
        if self.recurrent is not None:  # its own slot with a copy of the live state (from 0 where none is free)
            twin.recurrent = self.recurrent.fork()
            twin._keep_kv(min(twin.num_computed, twin.recurrent.position))
        return twin

    def _keep_kv(self, n: int) -> None:
        """Keep the KV of the first n positions; where a window group no longer holds the window
        of position n (freed while the history was longer), none."""
        if n and any(hi > max(lo, self._window_start(g, n)) for g, (lo, hi) in enumerate(self._gaps())):
            n = 0
        recurrent = self.recurrent
        if recurrent is not None and not (recurrent.pending is not None and n >= recurrent.pending):
            n = recurrent.rewind(n)  # (a verify step's cut of its drafts: the commit sets the state)
        self.num_computed = n
        keep_blocks = -(-n // self.block_size)
        for g, table in enumerate(self.tables):
            self.pool.free(reversed(self._live(g, keep_blocks, len(table))))  # tail first: evicted first
            del table[keep_blocks:]
            self._floors[g] = min(self._floors[g], keep_blocks)
        self.num_committed = min(self.num_committed, keep_blocks)

    def _outside_windows(self, position: int | None = None) -> Iterable[tuple[int, int]]:
        """(group, block) for each window group: its blocks before that one are read by no query
        from `position` (default `num_computed`) on."""
        position = self.num_computed if position is None else position
        return ((g, min(self._window_start(g, position), len(self.tables[g])))
                for g, window in enumerate(self.windows) if window is not None)

    def free_outside_windows(self, position: int | None = None) -> None:
        """Give back each window group's blocks that no query from `position` (default
        `num_computed`) on reads."""
        for g, start in self._outside_windows(position):
            self._free_below(g, start)

    def _free_below(self, group: int, start: int) -> None:
        """Free a group's blocks from its sink blocks to block `start`; they become NULL_BLOCK."""
        table, (_, hi) = self.tables[group], self._gap(group)
        if start > hi:
            self.pool.free(reversed(table[hi:start]))
            table[hi:start] = [NULL_BLOCK] * (start - hi)
            self._floors[group] = start

    def _freeable(self) -> int:
        """Blocks `free_outside_windows` would return to the pool now."""
        return sum(self.pool.ref_count(b) == 1 for g, start in self._outside_windows()
                   for b in self.tables[g][self._gap(g)[1]:start])

    # --- pages: a state's KV as one list of blocks (parking, state files) -----------------------

    def pages(self, n: int) -> tuple[list[int], tuple[int, ...]]:
        """The blocks holding the KV of the first n positions (n <= num_computed), group after
        group, and where each group's pages resume after the blocks its window freed (its sink
        blocks, if any, come first): what a parked copy or a state file stores."""
        end = -(-n // self.block_size)
        starts = tuple(min(max(self._gap(g)[1], min(self._sinks[g], end)), end) for g in range(len(self.tables)))
        return [b for g in range(len(self.tables)) for b in self._live(g, 0, end)], starts

    def page_counts(self, starts: Sequence[int], n: int) -> list[tuple[int, int]]:
        """`page_counts` of this state's layout."""
        return page_counts(self._sinks, starts, n, self.block_size)

    @property
    def sink_blocks(self) -> tuple[int, ...]:
        """Per group, the leading blocks its window keeps (its sink tokens' blocks)."""
        return tuple(self._sinks)

    def place_pages(self, ids: Sequence[int], starts: Sequence[int], n: int) -> None:
        """Take `ids` (`pages` order, for positions up to n: the caller allocated and filled them)
        as the KV of the first n positions of a state that holds none."""
        assert not self.num_computed and self.num_blocks == 0, "place_pages on a state holding KV"
        at, end = 0, -(-n // self.block_size)
        for g, ((sink, rest), start) in enumerate(zip(self.page_counts(starts, n), starts)):
            gap = max(0, min(start, end) - sink)
            self.tables[g] = list(ids[at:at + sink]) + [NULL_BLOCK] * gap + list(ids[at + sink:at + sink + rest])
            self._floors[g] = sink + gap
            at += sink + rest
        self.num_computed = n

    def pages_fit(self, starts: Sequence[int], n: int) -> bool:
        """Whether pages resuming at `starts` still hold the windows of position n."""
        end = -(-n // self.block_size)  # the copy's gap [sink, start) must miss n's window
        return all(start <= max(sink, self._window_start(g, n)) or end <= sink
                   for g, (sink, start) in enumerate(zip(self._sinks, starts)))

    # --- catching up --------------------------------------------------------------------------

    def index_match(self, limit: int) -> int:
        """Tokens of the longest prefix of tokens[:limit] that the prefix index holds, in full
        blocks (own committed blocks included)."""
        return self._index_hit(0, limit) * self.block_size if self.share else 0

    def _hit_window(self, group: int, limit_blocks: int) -> int:
        """The first block of `group`'s window that a prefix hit of `limit_blocks` blocks keeps:
        that of its last position, not the next one, since a request whose whole history was hit
        recomputes the last token (`trim_kv(len - 1)`) for its logits."""
        return self._window_start(group, max(0, limit_blocks * self.block_size - 1))

    def _needs(self, group: int, index: int, limit_blocks: int) -> bool:
        """Whether a prefix hit of `limit_blocks` blocks keeps block `index` of `group`: always
        under full attention; under a window, inside it or among the group's sink blocks."""
        return index < self._sinks[group] or index >= self._hit_window(group, limit_blocks)

    def _index_hit(self, first: int, limit: int) -> int:
        """The most blocks m (first <= m, m * block_size <= limit) such that the prefix index
        holds blocks first..m-1 of every full group and, of each window group, those of them
        that position m reads (`_needs`); `first` when none. Blocks before `first` are the
        state's own."""
        top, m = limit // self.block_size, first
        full = [g for g, w in enumerate(self.windows) if w is None]
        while m < top and all(self.pool.lookup(self._key(m, g)) is not None for g in full):
            m += 1
        if len(full) == len(self.windows):
            return m
        # window groups: walk down from m; a missing block i that m reads rules out every hit
        # from i + 1 to m (they all read it too), so the walk reads each block at most once
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        i = m - 1
        while i >= first:
            if all(self.pool.lookup(self._key(i, g)) is not None for g in windowed if self._needs(g, i, m)):
                i -= 1
            else:
                m, i = i, i - 1
        return m

    def prefer_index(self, limit: int) -> None:
        """Where the prefix index holds a longer prefix of the tokens than this state's own KV
        (the state shares a few tokens with the new history, the index many), drop the own KV
        down to its full blocks so that `reuse_cached_blocks` adopts the longer prefix."""
        if self.recurrent is not None:  # a hybrid state starts over where a published state reaches further
            if self.share and self._published_hit(0, self._index_hit(0, limit)) * self.block_size > self.num_computed:
                self._keep_kv(0)
            return
        if self.index_match(limit) > self.num_computed:
            self._keep_kv(self.num_computed - self.num_computed % self.block_size)

    def reuse_cached_blocks(self, limit: int) -> int:
        """Adopt full blocks of other states (or of our own past) from the prefix index, while
        num_computed sits on a block boundary and stays <= limit. Returns tokens gained."""
        bs = self.block_size
        if not self.share or self.num_computed % bs:
            return 0
        first = self.num_computed // bs
        m = self._index_hit(first, limit)
        if self.recurrent is not None:  # a hybrid state: as far as a published state of its history goes
            m = self._shared_hit(first, m)
        if m == first:
            return 0
        for g, table in enumerate(self.tables):
            start = self._hit_window(g, m)
            self._free_below(g, min(start, first))  # own blocks outside the new window
            for index in range(first, m):
                if not self._needs(g, index, m):
                    table.append(NULL_BLOCK)
                    continue
                block = self.pool.lookup(self._key(index, g))
                self.pool.incref(block)
                table.append(block)
            if start > self._sinks[g]:
                self._floors[g] = max(self._floors[g], start)
        self.num_computed = m * bs
        if self.recurrent is not None:
            self.recurrent.slots.adopt(self.prefix_hash(m - 1), self.recurrent.slot)
            self.recurrent.position = m * bs
        return (m - first) * bs

    def _shared_hit(self, first: int, m: int) -> int:
        """A hybrid state's: the most blocks (first < hit <= m) whose end a published state of its
        history sits at (`RecurrentSlots.publish`), where its live slot can take it; `first`
        where none does."""
        if self.recurrent.slot is None or self.recurrent.position != first * self.block_size:
            return first
        return self._published_hit(first, m)

    def _published_hit(self, first: int, m: int) -> int:
        """The most blocks (first < hit <= m) whose end a published state of this history sits at;
        `first` where none does."""
        slots = self.recurrent.slots
        if not slots.published:
            return first
        step = max(1, slots.stride // self.block_size)
        for hit in range(m - m % step, first, -step):
            if slots.find(self.prefix_hash(hit - 1)) == hit * self.block_size:
                return hit
        return first

    def publish_state(self) -> None:
        """A hybrid state at a multiple of the share stride of its known history, just computed
        (the step is enqueued): its state is published for others whose history starts alike."""
        recurrent, bs = self.recurrent, self.block_size
        at = recurrent.position
        if (self.share and at and at % recurrent.slots.stride == 0 and at % bs == 0 and at <= len(self.tokens)
                and recurrent.slot is not None):
            recurrent.slots.publish(self.prefix_hash(at // bs - 1), at, recurrent.slot)

    @property
    def windowed(self) -> bool:
        """Some of its layers attend within a sliding window (they give blocks back)."""
        return self._windowed

    def blocks_to_hold(self, length: int) -> int:
        """The fewest device blocks a history of `length` tokens holds at once: when the step
        that writes the first position of its last block runs, every full-attention group's
        blocks and each window group's from that position's window on (its widest: the window
        reaches furthest back there), its sink blocks too. More than the pool has, and the
        history can never be computed, however its chunks are cut."""
        first = max(0, (-(-length // self.block_size) - 1) * self.block_size)
        starts = [self._window_start(g, first) for g in range(len(self.windows))]
        return sum(sinks + rest for sinks, rest in self.page_counts(starts, length))

    def blocks_needed(self, num_tokens: int) -> int:
        """Fresh blocks a write of the next num_tokens tokens takes (copy-on-write included),
        less the blocks that leave the windows first."""
        end = -(-(self.num_computed + num_tokens) // self.block_size)
        shared = sum(self._last_block_is_shared(g) is True for g in range(len(self.tables)))
        needed = sum(end - len(t) for t in self.tables) + shared
        return needed - self._freeable() if self._windowed else needed

    def prepare_write(self, num_tokens: int) -> None:
        """Make the slots of the next num_tokens tokens writable: give back the blocks that left
        the windows, copy a shared or committed partial block, then append fresh blocks. The
        caller checked `blocks_needed`."""
        self.free_outside_windows()
        end = -(-(self.num_computed + num_tokens) // self.block_size)
        states = [self._last_block_is_shared(g) for g in range(len(self.tables))]
        spare = self.pool.num_free - sum(max(0, end - len(t)) for t in self.tables) - states.count(True)
        for g, table in enumerate(self.tables):
            shared = states[g]
            if shared is None and spare > 0:  # a copy keeps the published block, and the branch it ends, in the index
                shared, spare = True, spare - 1
            if shared is None:  # ours alone, only published, and no block to spare: taken out and written in place
                self.pool.uncommit(table[-1])
                self.num_committed = min(self.num_committed, len(table) - 1)
            elif shared:
                old = table[-1]
                (new,) = self.pool.allocate(1)
                self._copy_block(old, new)
                table[-1] = new
                self.pool.free([old])
                self.num_committed = min(self.num_committed, len(table) - 1)
            if end > len(table):
                table.extend(self.pool.allocate(end - len(table)))

    def _last_block_is_shared(self, group: int) -> bool | None:
        """Whether the next write lands in a block others hold (copied first), None where the
        block is only published in the prefix index with this state its one owner (a history
        trimmed back into a full block: its last token recomputed for its logits, or an edit):
        `prepare_write` copies it where the pool has a block to spare, so that the branch it
        ends stays in the index, and else takes it out of the index and writes in place (a pool
        that the history fills exactly has no block to copy into). `blocks_needed` counts None
        as no block: what the write needs at least."""
        table = self.tables[group]
        lo, hi = self._gap(group)
        if self.num_computed % self.block_size == 0 or not table or lo <= len(table) - 1 < hi:
            return False
        last = table[-1]
        if self.pool.ref_count(last) > 1:
            return True
        return None if self.pool.is_committed(last) else False

    def slot(self, position: int) -> int:
        """The cache slot of `position` in the first group (see `slots`)."""
        return self.tables[0][position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, start: int, end: int) -> list[list[int]]:
        """The cache slots of positions start..end-1, one list per group."""
        bs = self.block_size
        return [[table[p // bs] * bs + p % bs for p in range(start, end)] for table in self.tables]

    def mark_computed(self, num_tokens: int, writes_state: bool = True) -> None:
        """The KV of the next num_tokens positions is written by a launched step (some of those
        positions may hold tokens still on the device). `writes_state` False: a verify step, which
        leaves a recurrent state where it was until its kept tokens are committed."""
        if self.recurrent is not None:
            self.recurrent.advance(self.num_computed, num_tokens, writes_state)
        self.num_computed += num_tokens

    def commit_full_blocks(self) -> None:
        """Publish full blocks whose KV is counted and whose tokens are all known in the prefix
        index, each group's under its own key. A block whose tokens another state already
        committed is swapped for that one, so equal prefixes computed in the same step end up
        stored once."""
        full = min(self.num_computed, len(self.tokens)) // self.block_size
        if not self.share or full <= self.num_committed:
            return
        gaps = self._gaps()
        for index in range(self.num_committed, full):
            for g, table in enumerate(self.tables):
                if gaps[g][0] <= index < gaps[g][1]:
                    continue  # left the window before its tokens were known
                block = table[index]
                digest = self._key(index, g)
                if self.pool.block_hash(block) == digest:
                    continue
                holder = self.pool.commit(block, digest)
                if holder != block:
                    self.pool.incref(holder)
                    self.pool.free([block])
                    table[index] = holder
        self.num_committed = full
