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
(copy-on-write). The protocol follows mlx-lm's caches: `set_tokens` (sync), `trim(n)`, `fork`,
`release`.
"""

from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Callable, Iterable, Sequence

from hibana_core.kv.block_pool import BlockHash, BlockPool, hash_block


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (Phi-3, Phi-4-mini) as transformers applies it: a sequence up to `switch`
    (original_max_position_embeddings) tokens long is rotated by the short factors; once it is
    longer, every position by the long factors: transformers' generate drops its cache at the
    token that crosses the switch and recomputes the whole sequence, and so does a state here
    (`KVSequence.rotate_for`, once per state; a history that shrinks back below the switch goes
    back to the short rotation). The model's cos/sin tables hold a per-position rotation (short
    below the switch, long from there: what a draft model's states read) and, from row `offset`
    on, the long rotation of the positions below the switch (`rope_positions`)."""

    switch: int
    offset: int


_LONG_ROPE_SALT = b"long-rope"
"""The first block hash's parent under the long rotation: its blocks are other bytes than the
same tokens' per-position ones, so the prefix index keeps the two apart."""


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix: list comparisons run in C, so it is found by halving
    (log n slice comparisons) rather than by a Python loop over every token."""
    a = a if isinstance(a, list) else list(a)  # slices compare equal only between lists
    b = b if isinstance(b, list) else list(b)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is <= hi
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if hi == lo or a[lo] != b[lo] else hi


class KVSequence:
    def __init__(self, pool: BlockPool, copy_block: Callable[[int, int], None],
                 share: bool = True, long_rope: LongRope | None = None) -> None:
        self.pool = pool
        self.long_rope = long_rope  # the model's LongRoPE, or None
        self.rotated_long = False   # the KV is under LongRoPE's long rotation at every position
        self.share = share  # False: never adopt or publish blocks through the prefix index
        self.block_size = pool.block_size
        self._copy_block = copy_block
        self.tokens: list[int] = []
        self.block_ids: list[int] = []
        self.num_computed = 0
        self.num_committed = 0           # leading blocks known to be in the prefix index
        self._hashes: list[BlockHash] = []  # chain hashes of tokens' leading full blocks
        self.edits = 0  # bumped when the history changes other than by appending (drafters' indexes)
        self.parked = None  # a copy of its KV in host memory (kv.tiers.ParkedKV) while evicted

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    def prefix_hash(self, index: int) -> BlockHash:
        """Chain hash of the tokens of full block `index` and all before it (lazily, cached)."""
        bs = self.block_size
        while len(self._hashes) <= index:
            i = len(self._hashes)
            parent = self._hashes[-1] if i else (_LONG_ROPE_SALT if self.rotated_long else None)
            self._hashes.append(hash_block(parent, self.tokens[i * bs:(i + 1) * bs]))
        return self._hashes[index]

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

    def rotate_for(self, length: int) -> bool:
        """Under LongRoPE, before a step computes the positions up to `length`: once the sequence
        grows past the switch, its whole KV turns to the long rotation, as transformers' generate
        recomputes its cache at the token that crosses it. Returns whether KV was dropped."""
        return self._rotate(self.rotated_long or (self.long_rope is not None and length > self.long_rope.switch))

    def rotation_room(self, end: int) -> int:
        """Positions a step may compute from `end` on before a drafted chunk would cross
        LongRoPE's switch under the short rotation (it would then be recomputed: `rotate_for`)."""
        if self.long_rope is None or self.rotated_long:
            return 1 << 30
        return max(0, self.long_rope.switch - end)

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
        """Drop all KV (the tokens stay); full blocks remain findable in the prefix index."""
        self._keep_kv(0)

    def fork(self) -> "KVSequence":
        twin = KVSequence(self.pool, self._copy_block, self.share, self.long_rope)
        twin.rotated_long = self.rotated_long
        twin.tokens = list(self.tokens)
        twin.edits = self.edits
        twin._hashes = list(self._hashes)
        twin.block_ids = list(self.block_ids)
        twin.num_computed, twin.num_committed = self.num_computed, self.num_committed
        for block in twin.block_ids:
            self.pool.incref(block)
        return twin

    def _keep_kv(self, n: int) -> None:
        self.num_computed = n
        keep_blocks = -(-n // self.block_size)
        self.pool.free(reversed(self.block_ids[keep_blocks:]))  # tail first: evicted first
        del self.block_ids[keep_blocks:]
        self.num_committed = min(self.num_committed, keep_blocks)

    # --- catching up --------------------------------------------------------------------------

    def index_match(self, limit: int) -> int:
        """Tokens of the longest prefix of tokens[:limit] that the prefix index holds, in full
        blocks (own committed blocks included)."""
        bs, index = self.block_size, 0
        while self.share and (index + 1) * bs <= limit and self.pool.lookup(self.prefix_hash(index)) is not None:
            index += 1
        return index * bs

    def prefer_index(self, limit: int) -> None:
        """Where the prefix index holds a longer prefix of the tokens than this state's own KV
        (the state shares a few tokens with the new history, the index many), drop the own KV
        down to its full blocks so that `reuse_cached_blocks` adopts the longer prefix."""
        if self.index_match(limit) > self.num_computed:
            self._keep_kv(self.num_computed - self.num_computed % self.block_size)

    def reuse_cached_blocks(self, limit: int) -> int:
        """Adopt full blocks of other states (or of our own past) from the prefix index, while
        num_computed sits on a block boundary and stays <= limit. Returns tokens gained."""
        bs, gained = self.block_size, 0
        while self.share and self.num_computed % bs == 0 and self.num_computed + bs <= limit:
            index = self.num_computed // bs
            block = self.pool.lookup(self.prefix_hash(index))
            if block is None:
                break
            self.pool.incref(block)
            self.block_ids.append(block)
            self.num_computed += bs
            gained += bs
        return gained

    def blocks_needed(self, num_tokens: int) -> int:
        """Fresh blocks a write of the next num_tokens tokens takes (copy-on-write included)."""
        end = self.num_computed + num_tokens
        needed = -(-end // self.block_size) - len(self.block_ids)
        return needed + (1 if self._last_block_is_shared() else 0)

    def prepare_write(self, num_tokens: int) -> None:
        """Make the slots of the next num_tokens tokens writable: copy a shared or committed
        partial block, then append fresh blocks. The caller checked `blocks_needed`."""
        if self._last_block_is_shared():
            old = self.block_ids[-1]
            (new,) = self.pool.allocate(1)
            self._copy_block(old, new)
            self.block_ids[-1] = new
            self.pool.free([old])
            self.num_committed = min(self.num_committed, len(self.block_ids) - 1)
        end = self.num_computed + num_tokens
        fresh = -(-end // self.block_size) - len(self.block_ids)
        if fresh > 0:
            self.block_ids.extend(self.pool.allocate(fresh))

    def _last_block_is_shared(self) -> bool:
        if self.num_computed % self.block_size == 0 or not self.block_ids:
            return False
        last = self.block_ids[-1]
        return self.pool.ref_count(last) > 1 or self.pool.is_committed(last)

    def slot(self, position: int) -> int:
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def mark_computed(self, num_tokens: int) -> None:
        """The KV of the next num_tokens positions is written by a launched step (some of those
        positions may hold tokens still on the device)."""
        self.num_computed += num_tokens

    def commit_full_blocks(self) -> None:
        """Publish full blocks whose KV is counted and whose tokens are all known in the prefix
        index. A block whose tokens another state already committed is swapped for that one,
        so equal prefixes computed in the same step end up stored once."""
        full = min(self.num_computed, len(self.tokens)) // self.block_size
        if not self.share or full <= self.num_committed:
            return
        for index in range(self.num_committed, full):
            block, digest = self.block_ids[index], self.prefix_hash(index)
            if self.pool.block_hash(block) == digest:
                continue
            holder = self.pool.commit(block, digest)
            if holder != block:
                self.pool.incref(holder)
                self.pool.free([block])
                self.block_ids[index] = holder
        self.num_committed = full
