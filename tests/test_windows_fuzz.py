"""Random operation sequences on window-grouped `KVSequence`s over one `BlockPool` (seeded, CPU,
no torch): every block's bytes are modelled as "which token prefix, which group, which rotation"
per slot, so a prefix hit that adopts another history's block, a write into a shared or
committed block, a window read that lands on NULL_BLOCK or a page restored to the wrong place
shows up as a mismatch; pool reference counts must equal the tables' live references."""

from __future__ import annotations

import random

import pytest

from hibana_core.kv.block_pool import BlockPool, hash_block
from hibana_core.kv.layout import NULL_BLOCK, KVGroup, KVLayout
from hibana_core.kv.sequence import KVSequence, LongRope, page_counts
from hibana_core.kv.tiers import ParkedKV


class Bytes:
    """The cache's contents: per block, per slot, what wrote it (None: never written)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots = {b: [None] * block_size for b in range(num_blocks)}

    def copy(self, src: int, dst: int) -> None:
        self.slots[dst] = list(self.slots[src])


def identity(tokens, p, group, rotated):
    """What the KV of position p holds: it depends on every token up to p (lower layers)."""
    return (group, rotated, hash_block(None, tokens[:p + 1]))


LAYOUTS = {
    "plain": lambda bs: None,
    "full+window": lambda bs: KVLayout((KVGroup(None, (0,)), KVGroup(bs + bs // 2, (1,))), 1),
    "window-only": lambda bs: KVLayout((KVGroup(2 * bs + 3, (0,)),), 1),
    "full+sink": lambda bs: KVLayout((KVGroup(None, (0,)), KVGroup(bs + 1, (1,), sink_tokens=bs + 2)), 1),
    "gemma-like": lambda bs: KVLayout((KVGroup(None, (0,)), KVGroup(bs // 2 + 1, (1,)),
                                       KVGroup(3 * bs, (2,), sink_tokens=3)), 1),
    "tiny-window": lambda bs: KVLayout((KVGroup(None, (0,)), KVGroup(2, (1,), sink_tokens=1)), 1),
}


class World:
    def __init__(self, seed: int, layout_name: str, long_rope: bool) -> None:
        self.rng = random.Random(seed)
        self.bs = bs = self.rng.choice([4, 8])
        self.layout = LAYOUTS[layout_name](bs)
        self.pool = BlockPool(self.rng.choice([400, 40]), bs, reserve_null=self.layout is not None and self.layout.windowed)
        self.mem = Bytes(400, bs)
        self.null = self.layout is not None and self.layout.windowed  # NULL_BLOCK reserved
        self.long_rope = LongRope(switch=5 * bs + 3, offset=1000) if long_rope else None
        self.seqs: list[KVSequence] = []
        self.prompts = [[self.rng.randrange(5) for _ in range(self.rng.randrange(1, 6 * bs))] for _ in range(3)]

    def new(self) -> KVSequence:
        seq = KVSequence(self.pool, self.mem.copy, share=self.rng.random() < 0.9, long_rope=self.long_rope,
                         layout=self.layout)
        self.seqs.append(seq)
        return seq

    # --- what the engine does ------------------------------------------------------------------

    def write(self, seq: KVSequence, inputs: list[int]) -> bool:
        """One step's write of len(inputs) positions from num_computed (`inputs`: the tokens
        computed there: known ones, drafts or a placeholder's token). False: nothing written
        (no room, or LongRoPE's rotation dropped the KV)."""
        n = len(inputs)
        start = seq.num_computed
        if seq.rotate_for(start + n):
            return False
        needed = seq.blocks_needed(n)
        free_before = self.pool.num_free
        if not self.pool.can_allocate(needed):
            return False
        seq.prepare_write(n)
        assert free_before - self.pool.num_free <= max(needed, 0), "blocks_needed undercounts"
        history = seq.tokens[:start] + inputs
        assert len({len(t) for t in seq.tables}) == 1
        bs = self.bs
        for g, table in enumerate(seq.tables):
            for p in range(start, start + n):
                block = table[p // bs]
                assert not (self.null and block == NULL_BLOCK), "a write into NULL_BLOCK"
                assert self.pool.ref_count(block) == 1 and not self.pool.is_committed(block), \
                    "a write into a shared or committed block"
                self.mem.slots[block][p % bs] = identity(history, p, g, seq.rotated_long)
            self.check_reads(seq, g, history, start, start + n)
        seq.mark_computed(n)
        return True

    def check_reads(self, seq: KVSequence, g: int, history: list[int], start: int, end: int,
                    keys: int | None = None) -> None:
        """Every key (below `keys`, if given) the queries start..end-1 read holds the KV of
        `history` at its position."""
        window = seq.windows[g]
        sink = 0 if self.layout is None else self.layout.groups[g].sink_tokens
        for q in range(start, end):
            for j in range(q + 1 if keys is None else min(q + 1, keys)):
                if window is not None and not (q - j < window or j < sink):
                    continue
                block = seq.tables[g][j // self.bs]
                assert not (self.null and block == NULL_BLOCK), f"query {q} of group {g} reads key {j} from NULL_BLOCK"
                got = self.mem.slots[block][j % self.bs]
                assert got == identity(history, j, g, seq.rotated_long), \
                    f"query {q} of group {g} reads key {j} from block {block} holding other KV"

    def catch_up(self, seq: KVSequence, samples: bool, chunk: int) -> None:
        """A request: admission (`prefer_index`), prefix hits, chunked prefill up to the history
        (less the last token when it samples)."""
        if samples and seq.num_uncomputed == 0 and len(seq):
            seq.trim_kv(len(seq) - 1)
        seq.begin_request()
        target = len(seq) - (1 if samples else 0)
        seq.prefer_index(target)
        seq.rotate_for(len(seq))
        seq.reuse_cached_blocks(target)
        while seq.num_computed < target:
            before = seq.num_computed
            seq.reuse_cached_blocks(target)
            num = min(target - seq.num_computed, chunk)
            if num <= 0:
                break
            if self.rng.random() < 0.1:  # no room after the prefix hit: the scheduler gives it back
                seq.trim_kv(before)
                break
            if not self.write(seq, seq.tokens[seq.num_computed:seq.num_computed + num]):
                break  # no room (or a rotation: the next request recomputes)
            if self.rng.random() < 0.05:  # the step failed (`Scheduler.fail`)
                seq.trim_kv(seq.num_computed - num)
                break
            seq.commit_full_blocks()

    def decode(self, seq: KVSequence, steps: int, asynchronous: bool) -> None:
        """Sampling steps: each writes the last token and samples the next. Async: the step after
        is launched before the sampled token is known (num_computed one past the tokens)."""
        self.catch_up(seq, True, 3 * self.bs)
        if seq.num_computed != len(seq) - 1 or not len(seq):
            return
        for _ in range(steps):
            if seq.num_computed != len(seq) - 1 or not self.write(seq, [seq.tokens[-1]]):
                return
            token = self.rng.randrange(5)
            if asynchronous and self.rng.random() < 0.7:
                # the next step runs on the sampled token before the host reads it
                placeholder = self.write(seq, [token])
                seq.append([token])
                seq.commit_full_blocks()
                if placeholder:
                    if self.rng.random() < 0.3:  # that token ended the request: its KV goes
                        seq.trim_kv(len(seq))
                        seq.commit_full_blocks()
                        return
                    # the token sampled by that step: the position after it is the next input
                    token2 = self.rng.randrange(5)
                    seq.append([token2])
                    seq.commit_full_blocks()
            else:
                seq.append([token])
                seq.commit_full_blocks()

    def verify(self, seq: KVSequence) -> None:
        """A speculative verify step: the last token and k drafts, then the accepted prefix."""
        self.catch_up(seq, True, 3 * self.bs)
        if seq.num_computed != len(seq) - 1 or not len(seq):
            return
        k = self.rng.randrange(1, 2 * self.bs)
        drafts = [self.rng.randrange(5) for _ in range(k)]
        if not self.write(seq, [seq.tokens[-1]] + drafts):
            return
        end = seq.num_computed
        accepted = self.rng.randrange(k + 1)
        seq.append(drafts[:accepted] + [self.rng.randrange(5)])
        seq.trim_kv(min(end, len(seq) - 1))
        seq.commit_full_blocks()

    # --- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        refs: dict[int, int] = {}
        for seq in self.seqs:
            assert len({len(t) for t in seq.tables}) == 1
            assert len(seq.tables[0]) == -(-seq.num_computed // self.bs), (len(seq.tables[0]), seq.num_computed)
            held = list(seq.held_blocks())
            assert not (self.null and NULL_BLOCK in held)
            assert seq.num_blocks == len(held)
            for g, table in enumerate(seq.tables):
                nulls = [i for i, b in enumerate(table) if b == NULL_BLOCK]
                lo, hi = seq._gap(g)
                if self.null:
                    assert nulls == list(range(lo, hi)), (g, nulls, lo, hi)
            for b in held:
                refs[b] = refs.get(b, 0) + 1
            # what a continuation at num_computed reads is there and right
            n = seq.num_computed
            if n <= len(seq.tokens):
                for g in range(len(seq.tables)):
                    self.check_reads(seq, g, seq.tokens, n, n + 1, keys=n)
        for b in range(len(self.pool._blocks)):
            assert self.pool.ref_count(b) == refs.get(b, 0), (b, self.pool.ref_count(b), refs.get(b, 0))
        if self.null:
            assert self.pool.ref_count(NULL_BLOCK) == 0 and NULL_BLOCK not in self.pool._empty \
                and NULL_BLOCK not in self.pool._cached
        assert self.pool.num_free == self.pool.num_blocks - len(refs)
        # every cached (findable) block holds what its hash says, in its full slots
        for seq in self.seqs:
            for i in range(len(seq.tokens) // self.bs):
                for g in range(len(seq.tables)):
                    block = self.pool.lookup(seq._key(i, g))
                    if block is not None:
                        for p in range(i * self.bs, (i + 1) * self.bs):
                            assert self.mem.slots[block][p % self.bs] == \
                                identity(seq.tokens, p, g, seq.rotated_long), "the prefix index holds wrong KV"

    # --- parking -------------------------------------------------------------------------------

    def park_and_restore(self, seq: KVSequence) -> None:
        n = min(seq.num_computed, len(seq.tokens))
        if not n:
            return
        pages, starts = seq.pages(n)
        assert len(pages) == sum(a + b for a, b in page_counts(seq.sink_blocks, starts, n, self.bs))
        saved = [list(self.mem.slots[b]) for b in pages]
        tokens = list(seq.tokens[:n])
        rotated = seq.rotated_long
        seq.release()
        if self.rng.random() < 0.5:  # the history moved on or was cut meanwhile
            seq.set_tokens(tokens[:self.rng.randrange(1, n + 1)])
        m = min(len(seq.tokens), n)
        assert seq.tokens[:m] == tokens[:m]
        if seq.rotated_long != rotated or not seq.pages_fit(starts, m):
            return
        # `ParkedKV.page_index` and `place_pages`, as `HostTier.restore` uses them
        parked = ParkedKV(tokens, None, starts=starts)
        if m < self.bs or seq.index_match(m) >= m:
            return
        if tuple(starts) == (0,):  # `HostTier.restore` of a copy without gaps: prefix hits first
            blocks = -(-m // self.bs)
            seq.reuse_cached_blocks(m)
            first = len(seq.block_ids)
            if not self.pool.can_allocate(blocks - first):
                seq.release()
                return
            ids = self.pool.allocate(blocks - first)
            for block, i in zip(ids, range(first, blocks)):
                self.mem.slots[block] = list(saved[i])
            seq.block_ids.extend(ids)
            seq.num_computed = m
            seq.commit_full_blocks()
            return
        index = parked.page_index(m, seq)
        if not self.pool.can_allocate(len(index)):
            return
        ids = self.pool.allocate(len(index))
        for block, i in zip(ids, index):
            self.mem.slots[block] = list(saved[i])
        seq.place_pages(ids, starts, m)
        seq.commit_full_blocks()


OPS = ["grow", "decode", "verify", "sync", "trim", "fork", "release", "park", "close", "new"]


def run(seed: int, layout_name: str, long_rope: bool, steps: int) -> None:
    w = World(seed, layout_name, long_rope)
    rng = w.rng
    w.new()
    for _ in range(steps):
        if not w.seqs:
            w.new()
        seq = rng.choice(w.seqs)
        op = rng.choice(OPS)
        if op == "grow":
            seq.append([rng.randrange(5) for _ in range(rng.randrange(1, 3 * w.bs))])
            w.catch_up(seq, rng.random() < 0.5, rng.choice([w.bs, 3 * w.bs, 100]))
        elif op == "decode":
            w.decode(seq, rng.randrange(1, 2 * w.bs), asynchronous=rng.random() < 0.5)
        elif op == "verify":
            w.verify(seq)
        elif op == "sync":  # a new history sharing a prefix with a known prompt or this state
            base = rng.choice(w.prompts + [seq.tokens])
            cut = rng.randrange(len(base) + 1)
            seq.set_tokens(base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 2 * w.bs))])
            w.catch_up(seq, rng.random() < 0.5, rng.choice([w.bs, 100]))
        elif op == "trim":
            if len(seq):
                seq.trim(rng.randrange(len(seq) + 1))
        elif op == "fork":
            w.seqs.append(seq.fork())
        elif op == "release":
            seq.release()
        elif op == "park":
            w.park_and_restore(seq)
        elif op == "close":
            seq.release()
            w.seqs.remove(seq)
        elif op == "new":
            fresh = w.new()
            fresh.set_tokens(rng.choice(w.prompts) + [rng.randrange(5) for _ in range(rng.randrange(3))])
            w.catch_up(fresh, rng.random() < 0.5, 100)
        w.check()
    for seq in w.seqs:
        seq.release()
    assert w.pool.num_used == 0


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("long_rope", [False, True], ids=["rope", "longrope"])
def test_random_operations_keep_kv_and_ref_counts_exact(layout_name, long_rope):
    for seed in range(6):
        run(seed, layout_name, long_rope, 120)
