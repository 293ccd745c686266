"""Recurrent state of linear-attention layers (Qwen3.5's and Qwen3-Next's Gated DeltaNet), per agent.

A hybrid model keeps KV pages only for its full-attention layers; each linear-attention layer
carries a fixed-size state instead (a short convolution's last inputs and a [heads, Dk, Dv]
matrix), the whole history folded into it. States live in slots of one preallocated cache, so
that kernels (and CUDA graphs) address them by index:

    conv   [slots, conv_dim, kernel - 1]   model dtype, one tensor per linear layer
    ssm    [slots, Hv, Dk, Dv]             float32, one tensor per linear layer

A state is valid at one position only. Retention works as for KV: an agent's next turn continues
from where its last one ended. What KV does for free (keep the first n positions of a history),
a recurrent state cannot: it holds position p and nothing before. So each agent keeps a few
snapshots (copies of its state at the positions where its recent prompts ended, where re-rendered
histories usually diverge: templates that rewrite the last reply), and a history cut back to
position n continues from the latest snapshot at or before n, recomputing from there
(`RecurrentState.rewind`): exact, at the cost of the tokens between.

A verify step of speculative decoding runs the drafts through the layers without writing their
states (which drafts are kept is known only after sampling); the tokens kept are then applied to
the states (`commit`: the kernels' advance), so a rejected draft never touches a state.

Agents that share a prefix (a system prompt, tool schemas) share its KV blocks through the prefix
index; their linear layers' state at a position is published too, keyed by the prefix's chain
hash, at every `SHARE_STRIDE` tokens of a prefill (`RecurrentSlots.publish`): a new agent adopts
the KV up to the last published state its history reaches and copies that state.

Plain Python, like the block pool; the tensors are `kv.recurrent_cache.RecurrentCache`'s.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

SNAPSHOTS = 3
"""Snapshots an agent's state keeps (the ends of its last prompts, and where a chat template's
generation prompt started: `Request.snapshot_at`), oldest dropped first."""
STATE_SHARE = 0.5
"""The most of the memory left for agents (their KV and states) that the states' slots take
(`Engine._size_states`): a hybrid model's KV is a few layers' (Qwen3.5: one in four), its states
each a fixed size whatever the history (Qwen3.5-35B-A3B: 62 MB, Qwen3.5-27B: 151 MB)."""
MIN_STATE_SLOTS = 4
"""The fewest slots a recurrent cache has: two running agents, or one with its snapshots."""


SHARE_STRIDE = 512
"""Tokens between the published states of a prefill (`RecurrentSlots.publish`): a prompt's
chunks end at its multiples, and another agent whose history starts alike continues from the
last one its history reaches, recomputing fewer than this many tokens of the common prefix."""


def slots_within(wanted: int, agent_bytes: int | None, slot_bytes: int) -> int:
    """A recurrent cache's slots: `wanted`, or as many as `STATE_SHARE` of agent_bytes (the memory
    left for agents' KV and states; None: not known) holds beside the scratch slot, whichever is
    fewer, never fewer than `MIN_STATE_SLOTS`."""
    if agent_bytes is None:
        return wanted
    return min(wanted, max(MIN_STATE_SLOTS, int(agent_bytes * STATE_SHARE) // slot_bytes - 1))


class RecurrentSlots:
    """The free list of a `RecurrentCache`'s slots (plain Python, like the block pool)."""

    def __init__(self, num_slots: int, copy: Callable[[int, int], None], stride: int = SHARE_STRIDE) -> None:
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self.num_slots = num_slots
        self.copy = copy
        self.stride = stride  # tokens between a prefill's published states (a multiple of the block size)
        # prefix chain hash -> (position, slot) of a published state, least recently used first
        self.published: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None where none is left."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def publish(self, key: Hashable, position: int, source: int) -> None:
        """Keep a copy of slot `source`, the state after `position` tokens whose chain hash is
        `key`, for other states to start from (`adopt`), in a free slot if one is left."""
        if key in self.published:
            self.published.move_to_end(key)
            return
        slot = self.allocate()
        if slot is None:
            return
        self.copy(source, slot)
        self.published[key] = (position, slot)

    def find(self, key: Hashable) -> int | None:
        """The position of the published state of this prefix, or None."""
        held = self.published.get(key)
        return None if held is None else held[0]

    def adopt(self, key: Hashable, dst: int) -> None:
        """Slot dst := the published state of this prefix (`find` said it is there)."""
        self.published.move_to_end(key)
        self.copy(self.published[key][1], dst)

    def unpublish_oldest(self) -> bool:
        """Give back the least recently used published state's slot; False where none is left."""
        if not self.published:
            return False
        _, (_, slot) = self.published.popitem(last=False)
        self.free(slot)
        return True


@dataclass
class RecurrentState:
    """One agent's recurrent state: the slot holding it live, the position it is at, and its
    snapshots. Invariant between steps: `position` equals its sequence's computed tokens."""

    slots: RecurrentSlots
    slot: int | None = None     # None: no slot yet (position 0) or given back
    position: int = 0           # tokens the live state has folded in
    pending: int | None = None  # a verify step ran from this position without writing the state
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (position, slot), oldest first

    @property
    def has_state(self) -> bool:
        """Whether the live slot holds a state to continue from (else the next chunk starts at 0)."""
        return self.slot is not None and self.position > 0

    def ensure_slot(self) -> bool:
        """A live slot to compute into: False where the cache has none free (the caller frees
        some, `evict`ing an idle state, and asks again)."""
        if self.slot is None:
            self.slot = self.slots.allocate()
            self.position = 0
        return self.slot is not None

    def advance(self, start: int, num_tokens: int, writes: bool) -> None:
        """A step was scheduled over positions start.. start + num_tokens - 1 of this state's
        sequence: one that writes the state leaves it past them; a verify step leaves it where it
        was, pending the commit of the tokens kept (`commit`)."""
        if start != self.position:
            raise RuntimeError(f"a recurrent state at position {self.position} was scheduled from {start}")
        if writes:
            self.position, self.pending = start + num_tokens, None
        else:
            self.pending = start

    def commit(self, computed: int, partial: bool = False) -> int:
        """After a verify step: its sequence keeps the KV of its first `computed` positions (the
        drafts accepted, the rest cut), which the state now folds in. Returns how many tokens past
        the pending position that is (0: no verify step pending). `partial`: the rows are folded
        in two parts (a prompt's end between them) and the rest is committed from here next."""
        if self.pending is None:
            return 0
        count = max(0, computed - self.pending)
        self.position = self.pending + count
        self.pending = self.position if partial else None
        return count

    def rewind(self, n: int) -> int:
        """Continue from at most position n: the live state where it is at n or before (n at or
        past it: nothing to do), else the latest snapshot at or before n copied into the live
        slot, else position 0. Returns the position the state now continues from."""
        self.pending = None  # a verify step's uncommitted drafts are dropped with it
        if n >= self.position:
            return self.position
        kept = [(p, s) for p, s in self.snapshots if p <= n]
        for p, s in self.snapshots:
            if p > n:  # snapshots of the history that was cut away
                self.slots.free(s)
        self.snapshots = kept
        if kept and self.slot is not None:
            position, slot = kept[-1]
            self.slots.copy(slot, self.slot)
            self.position = position
        else:
            self.position = 0
        return self.position

    def snapshot(self) -> None:
        """Keep a copy of the live state at its position (a prompt's end), in a free slot if one
        is left; the oldest snapshot's slot is reused past `SNAPSHOTS`."""
        if self.slot is None or self.position == 0 or any(p == self.position for p, _ in self.snapshots):
            return
        if len(self.snapshots) >= SNAPSHOTS:
            _, slot = self.snapshots.pop(0)
        else:
            slot = self.slots.allocate()
            if slot is None:
                return
        self.slots.copy(self.slot, slot)
        self.snapshots.append((self.position, slot))

    def fork(self) -> "RecurrentState":
        """A twin continuing from the same position (its own slot with a copy of the live state;
        no snapshots), or from 0 where no slot is free."""
        twin = RecurrentState(self.slots)
        if self.has_state and twin.ensure_slot():
            self.slots.copy(self.slot, twin.slot)
            twin.position = self.position
        return twin

    def drop_snapshots(self) -> None:
        """Give the snapshots' slots back (the live state stays)."""
        for _, slot in self.snapshots:
            self.slots.free(slot)
        self.snapshots = []

    def release(self) -> None:
        """Give every slot back: the state starts again from position 0."""
        self.drop_snapshots()
        if self.slot is not None:
            self.slots.free(self.slot)
        self.slot, self.position, self.pending = None, 0, None

    @property
    def num_slots(self) -> int:
        return (self.slot is not None) + len(self.snapshots)
