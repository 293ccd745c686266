"""Agent states by id: open, match, lease, the bound on unnamed states, idle order, and what a
`StateHandle` asks for (sync, generate, truncate, fork, save, close) through public methods.

Every edit takes the engine's lock, so a state is never edited while a step uses it; a state with
a request in the scheduler is busy and refuses edits. Work that grows with a caller's input (checking
token lists, scanning states for a match) runs before the lock is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, Sequence

from hibana_core.config import CacheConfig, SamplingParams, is_kind, plain_token_ids
from hibana_core.errors import (ConfigError, ContextLengthError, EngineClosedError, GrammarError, HibanaError,
                                InvalidTokenError, MemoryBudgetError, StateBusyError, StateClosedError,
                                StateExistsError, StateFileError)
from hibana_core.kv import state_file
from hibana_core.kv.policies import POLICIES, PREFETCH_LEAD, StateUse, retention_order
from hibana_core.kv.recurrent import RecurrentSlots, RecurrentState
from hibana_core.kv.sequence import KVSequence, LongRope, common_prefix_len
from hibana_core.kv.tiers import UNREADABLE_SPILL
from hibana_core.output import CompilingEvents, RequestEvents
from hibana_core.sampler import make_generator
from hibana_core.scheduler import Request
from hibana_core.state import UNNAMED_PREFIX, StateHandle, StateInfo, SyncStats

logger = logging.getLogger("hibana.states")

if TYPE_CHECKING:
    import torch

    from hibana_core.engine_core import EngineCore
    from hibana_core.grammar import Grammars
    from hibana_core.kv.cache import KVCache
    from hibana_core.kv.recurrent_cache import RecurrentCache


def check_id(state_id: object) -> None:
    """A ConfigError where `state_id` can name no state (adapters check theirs when made)."""
    if not isinstance(state_id, str) or not state_id:
        raise ConfigError(f"state ids are non-empty strings, got {state_id!r}")
    if any("\ud800" <= c <= "\udfff" for c in state_id):  # (JSON can spell one) no UTF-8: no state file holds it
        raise ConfigError(f"state id {state_id!r} holds a lone surrogate, which no state file can hold; "
                          "use text that UTF-8 encodes")


@dataclass(frozen=True)
class ModelLimits:
    """What every history must respect, and what generation stops at."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    fingerprint: str
    has_tokenizer: bool
    device: "torch.device"
    long_rope: LongRope | None = None  # the model's LongRoPE switch (Phi-3), or None
    configuration: dict | None = None  # what `fingerprint` digests (surgery.configuration), for state files


class KVBytes(NamedTuple):
    """A state's KV where it lies (`Engine.memory`)."""

    own: int     # held by this state alone: what closing it frees
    shared: int  # held with other states too (a fork's blocks or parked copy, a common prefix's blocks)


@dataclass(eq=False)
class _Entry:
    handle: StateHandle
    seq: KVSequence
    use: StateUse          # last use, tool waits: what the eviction policy orders by
    unnamed: bool = False  # made by `lease` for a call that named no state (not the user's)
    forced: list[int] | None = None  # bench only: what its next generation emits (`force_outputs`)
    stored: tuple[int, int, int] | None = None  # the state_dir file it resumed from (`_file_key`), if any
    resumed: list[int] | None = None  # the tokens it resumed with from that file
    turn_start: int | None = None  # its history's length when its last generation began (that call's prompt)

    @property
    def last_use(self) -> float:
        return self.use.last_use


class _Candidate(NamedTuple):
    """A state `Registry._ranked` weighs for a history: the prefix it shares, then how recently used."""

    shared: int
    last_use: float
    entry: _Entry

    @property
    def rank(self) -> tuple[int, float]:
        return self.shared, self.last_use


def _file_key(path: Path) -> tuple[int, int, int] | None:
    """What tells a file from one written over it (inode, size, modification time), or None
    where there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _drop_stored(entry: _Entry, path: Path) -> None:
    """Remove the state_dir file `entry` resumed from, where it is still that file: an engine
    sharing the folder may have written the id since, and a state that resumed nothing has no
    file of its own to remove."""
    if entry.stored is not None and _file_key(path) == entry.stored:
        with contextlib.suppress(OSError):
            path.unlink()


class StateRegistry:
    def __init__(self, core: "EngineCore", kv_cache: "KVCache", config: CacheConfig, limits: ModelLimits,
                 grammars: "Grammars | None" = None, recurrent: RecurrentSlots | None = None,
                 recurrent_cache: "RecurrentCache | None" = None) -> None:
        self.core, self.kv_cache, self.config, self.limits = core, kv_cache, config, limits
        self.grammars = grammars
        # a hybrid model's recurrent cache and its slots
        self.recurrent, self.recurrent_cache = recurrent, recurrent_cache
        self.pool = core.scheduler.pool
        self.lock = core.lock
        self._entries: dict[str, _Entry] = {}
        self._leased: set[str] = set()  # states held by a call (see `lease`)
        # states whose last turn ended in tool calls, kept apart so that a step's prefetch looks at
        # those alone, not at every state the engine ever kept (see `_waiting_on_tools`)
        self._tool_waits: set[_Entry] = set()
        # states a named lease opened (an adapter's thread id, a server client's name), least recently
        # used first: at most `max_named_states` of them idle (see `_put_away_named`)
        self._named: OrderedDict[str, None] = OrderedDict()
        self.engine_ref: "weakref.ReferenceType | None" = None  # the Engine, for `StateHandle.engine`
        self.policy = POLICIES[config.eviction_policy]  # which idle state is evicted first (kv/policies.py)

    # --- finding states -------------------------------------------------------------------------

    def open(self, state_id: str) -> StateHandle:
        """Get or create the state with this id; with a `state_dir`, one persisted there by an
        earlier engine comes back (tokens and KV, nothing recomputed). Its file is read and
        verified outside the engine's lock: other agents' steps go on meanwhile."""
        check_id(state_id)
        with self.lock:
            self._check_open()
            entry = self._entries.get(state_id)
            if entry is not None:
                return entry.handle
            cache, path = self.kv_cache, self.persisted_path(state_id)
        stored = _file_key(path) if path is not None else None
        saved = self._read_persisted(state_id, path, cache) if stored is not None else None
        with self.lock:
            self._check_open()
            entry = self._entries.get(state_id)
            if entry is not None:  # another call opened it meanwhile
                return entry.handle
            seq = self._new_sequence()
            if saved is not None:
                self._resume(seq, saved, path)
            return self._add(state_id, seq, stored=stored, resumed=list(seq.tokens) if stored is not None else None)

    # --- persistence (state_dir) ----------------------------------------------------------------

    def persisted_path(self, state_id: str) -> Path | None:
        """Where `state_dir` keeps the state with this id (any string: the file is named by its hash)."""
        if self.config.state_dir is None:
            return None
        digest = hashlib.blake2b(state_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
        return Path(self.config.state_dir) / f"{digest}.state"

    def _read_persisted(self, state_id: str, path: Path, cache: "KVCache") -> state_file.SavedState:
        """The state this id persisted in `path`, read and verified (StateFileError if it is not)."""
        try:
            saved = state_file.read(path, self.limits.fingerprint, cache.data.shape, cache.dtype, cache.layout,
                                        self.limits.configuration, self._recurrent_shapes())
        except StateFileError as exc:  # the id stays unopenable while the file is there: say so
            raise StateFileError(f"{exc} (or remove it to open {state_id!r} afresh)") from None
        if saved.state_id != state_id:
            raise StateFileError(f"{path} holds state {saved.state_id!r}, not {state_id!r}; remove the file "
                                 "or open that id")
        self._check_saved_length(saved, path, f" (or remove it to open {state_id!r} afresh)")
        return self._in_this_pool(saved)

    def _check_saved_length(self, saved: state_file.SavedState, path: Path, advice: str = "") -> None:
        """A ContextLengthError where a saved history is longer than this engine's context (an
        engine of a shorter max_model_len): the file is sound, and shortening is no remedy."""
        if len(saved.tokens) > self.limits.max_model_len:
            raise ContextLengthError(
                f"{path} holds a history of {len(saved.tokens)} tokens, more than this engine's context of "
                f"{self.limits.max_model_len}; open it in an engine with max_model_len >= {len(saved.tokens)}{advice}")

    def _resume(self, seq: KVSequence, saved: state_file.SavedState, path: Path) -> None:
        """Fill `seq` from its persisted state: its KV parked in the host tier (copied to the
        device at its next request), else on the device now, else (running requests hold the
        blocks) parked on disk."""
        seq.tokens = self._saved_tokens(saved, path)
        if not self._kv_fits(seq, saved):
            return  # tokens only: the KV is recomputed on next use
        seq.rotated_long = saved.rotated_long
        tier = self.core.scheduler.eviction.tier
        in_host = tier is not None and tier.adopt(seq, seq.tokens[:saved.num_computed], saved.kv, saved.starts,
                                                  recurrent=saved.recurrent)
        if not in_host and not self._parked_for_room(seq, saved, host=False):
            self._place(seq, saved, path)
        logger.info("state %r resumed from %s (%d tokens, %d with KV)", saved.state_id, path, len(seq.tokens),
                    saved.num_computed)

    def persist_all(self) -> None:
        """Write every open named state to `state_dir` (the engine closes); an empty one leaves no
        file (an earlier one of its id would bring back the history it no longer holds). A parked
        state whose copy cannot be read (its spill file gone) is written as its tokens; a state
        that cannot be written is logged and skipped; the others are still written."""
        for state_id, entry in self._entries.items():
            if entry.unnamed:
                continue
            try:
                self._persist(state_id, entry)
            except Exception as exc:  # noqa: BLE001 - one state's file (a spill file gone, a full disk) never stops the rest
                logger.warning("state %r was not persisted: %s", state_id, exc)

    def _persist(self, state_id: str, entry: _Entry) -> None:
        """Write one named state to `state_dir` (see `persist_all`)."""
        path = self.persisted_path(state_id)
        if entry.seq.tokens == entry.resumed and _file_key(path) != entry.stored:
            return  # unchanged since it resumed; an engine sharing the folder wrote or closed it since
        if not entry.seq.tokens:
            _drop_stored(entry, path)
            return
        self._write(entry.seq, state_id, path)

    def put_away(self, handle: StateHandle) -> bool:
        """Close an idle named state, written to `state_dir` first (where there is one) so that
        opening its id again brings its history back (a server's bound on the states its clients
        name). False, the state left as it is, where it is leased, busy, unnamed or closed, or
        could not be written (logged)."""
        with self.lock:
            entry = self._live(handle)
            if entry is None or entry.unnamed or self._taken(entry):
                return False
            if self.config.state_dir is not None:
                try:
                    self._persist(handle.id, entry)
                except Exception as exc:  # noqa: BLE001 - kept open rather than its history lost
                    logger.warning("state %r was not put away (kept open): %s", handle.id, exc)
                    return False
                entry.stored = None  # its file stays: `close_state` removes only the one it resumed from
            self.close_state(handle)
            return True

    def forget(self, state_id: str) -> bool:
        """Close the state with this id and remove its `state_dir` file, so that neither comes back
        (a server's DELETE). False where there was neither; StateBusyError, nothing changed,
        while a call holds the state or a request runs on it."""
        check_id(state_id)
        with self.lock:
            self._check_open()
            entry = self._entries.get(state_id)
            if entry is not None and self._taken(entry):
                raise StateBusyError(f"state {state_id!r} is serving a call; close it once the call has ended")
            if entry is not None:
                self.close_state(entry.handle)
            path = self.persisted_path(state_id)
            try:
                if path is not None:
                    path.unlink()
                    return True
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise StateFileError(f"state {state_id!r} is closed, but its file {path} could not be removed "
                                     f"({exc.strerror or exc}); remove it, or it comes back when the id is opened") from None
            return entry is not None

    def _refuse_stored(self, state_id: str, advice: str) -> None:
        """A StateExistsError where `state_dir` keeps a state of this id that is not open: a new
        state of the id would replace its history when the engine closes (`open_state` brings
        it back)."""
        path = self.persisted_path(state_id)
        if path is not None and path.exists():
            raise StateExistsError(f"state_dir keeps a state with id {state_id!r} ({path}); open_state({state_id!r}) "
                                   f"brings it back (closing it removes it; a file it finds damaged or foreign, "
                                   f"a StateFileError, you remove), or {advice}")

    def _new_sequence(self) -> KVSequence:
        recurrent = None if self.recurrent is None else RecurrentState(self.recurrent)
        return KVSequence(self.pool, self.kv_cache.copy_block, self.config.enable_prefix_caching,
                          self.limits.long_rope, self.kv_cache.layout, recurrent)

    def _add(self, state_id: str, seq: KVSequence, unnamed: bool = False,
             stored: tuple[int, int, int] | None = None, resumed: list[int] | None = None) -> StateHandle:
        handle = StateHandle(self, state_id)
        self._entries[state_id] = _Entry(handle, seq, StateUse(time.monotonic()), unnamed, stored=stored,
                                         resumed=resumed)
        return handle

    def _live(self, handle: StateHandle) -> _Entry | None:
        """The handle's entry while the handle is open (an id reused after a close is another)."""
        entry = self._entries.get(handle.id)
        return entry if entry is not None and entry.handle is handle and not handle.closed else None

    def is_open(self, state_id: str) -> bool:
        """Whether a state with this id is open (an O(1) look-up)."""
        return state_id in self._entries

    def is_unnamed(self, handle: StateHandle) -> bool:
        """Whether the engine made this state for a call that named none (a user's state never
        is, whatever its id)."""
        entry = self._live(handle)
        return entry is not None and entry.unnamed

    def match(self, token_ids: Sequence[int], *, min_shared: float = 0.0) -> StateHandle | None:
        """The idle, unleased state whose history shares the longest prefix with token_ids (the
        most recently used among equals), or None. The shared prefix must cover at least
        `min_shared` of the state's own tokens (1.0: token_ids continue its whole history).

        The states are scanned outside the engine's lock (a server may hold thousands: the
        steps of other agents must not wait on the scan), so the answer may be a moment old;
        `lease` checks it again under the lock."""
        return self._match(self._validate(token_ids), min_shared)

    def matches(self, token_ids: Sequence[int], limit: int, *, unnamed: bool = False) -> list[StateHandle]:
        """`match`'s candidates, best first: at most `limit` idle, unleased states that share a
        prefix with token_ids, by its length (then the most recently used); `unnamed`: only states
        `lease` made for calls that named none."""
        if not is_kind(limit, int) or limit < 1:
            raise ConfigError(f"limit is a count of states (an int, at least 1), got {limit!r}")
        return self._ranked(self._validate(token_ids), 0.0, limit, unnamed)

    def _match(self, token_ids: list[int], min_shared: float) -> StateHandle | None:
        """`match` on token ids already checked."""
        best = self._ranked(token_ids, min_shared, 1)
        return best[0] if best else None

    def _ranked(self, token_ids: list[int], min_shared: float, limit: int,
                unnamed: bool = False) -> list[StateHandle]:
        """The `limit` best idle, unleased states for token_ids (`match`, `matches`), best first."""
        if not is_kind(min_shared, float) or not 0 <= min_shared <= 1:
            raise ConfigError(f"min_shared is a fraction in [0, 1], got {min_shared!r}")
        if not token_ids:
            return []
        with self.lock:
            self.core.end_cancelled()
            entries = list(self._entries.values())
            taken = set(self._leased) | self._busy()
        best: list[_Candidate] = []  # the `limit` best so far, best first
        for entry in entries:
            tokens = entry.seq.tokens
            # cheap rejections first
            floor = best[-1].shared if len(best) == limit else 0
            if not tokens or tokens[0] != token_ids[0] or min(len(tokens), len(token_ids)) < floor:
                continue
            if entry.handle.id in taken or id(entry.seq) in taken or (unnamed and not entry.unnamed):
                continue
            same = self._shared(tokens, token_ids, min_shared)
            if not same:
                continue
            candidate = _Candidate(same, entry.last_use, entry)
            if len(best) < limit or candidate.rank > best[-1].rank:
                best.append(candidate)
                best.sort(key=lambda c: c.rank, reverse=True)
                del best[limit:]
        return [c.entry.handle for c in best]

    @staticmethod
    def _shared(tokens: list[int], token_ids: list[int], min_shared: float) -> int:
        """The common prefix's length if it covers `min_shared` of `tokens`, else 0."""
        if min_shared == 1:  # adapters' case: one comparison in C
            return len(tokens) if token_ids[:len(tokens)] == tokens else 0
        same = common_prefix_len(tokens, token_ids)
        return same if same >= min_shared * len(tokens) else 0

    def _taken(self, entry: _Entry, busy: set[int] | None = None) -> bool:
        """Held by a call (leased) or generating: not to be handed to another call. `busy`: the
        `_busy()` of a caller that asks of many states (one look at the requests, not one a state)."""
        if entry.handle.id in self._leased:
            return True
        return id(entry.seq) in busy if busy is not None else self.core.scheduler.busy(entry.seq)

    def _busy(self) -> set[int]:
        """id() of the sequences that requests (running or queued) are on."""
        return {id(r.seq) for r in self.core.scheduler.requests()}

    @contextmanager
    def lease(self, token_ids: Sequence[int] = (), state_id: str | None = None, *,
              min_shared: float = 1.0) -> Iterator[StateHandle]:
        """See `Engine.lease`."""
        named = state_id is not None
        if not named:  # the scan runs before the lock is taken
            token_ids = self._validate(token_ids)
            candidate = self._match(token_ids, min_shared)
        with self.lock:
            self.core.end_cancelled()
            if state_id is not None:
                opened = not (isinstance(state_id, str) and self.is_open(state_id))  # `open` refuses a bad id
                handle = self.open(state_id)
                if opened:  # the call's own: bounded by max_named_states (a state of open_state never is)
                    self._named[state_id] = None
                if self._taken(self._entries[state_id]):
                    raise StateBusyError(f"state {state_id!r} is serving another call; give concurrent "
                                         "calls different state ids")
                entry = self._entries[state_id]
                # the chat layer leases a state made for an earlier call by its id once the prompt continues it
                how = (f"{'continues its conversation' if entry.unnamed else 'named by the call'}, "
                       f"{len(entry.seq)} tokens held")
            else:
                entry = self._live(candidate) if candidate is not None else None
                handle = candidate
                if (entry is None or self._taken(entry)
                        or not self._shared(entry.seq.tokens, token_ids, min_shared)):
                    handle = None  # taken or changed since the scan: a new state
                if handle is None:
                    self._check_open()
                    self._close_unnamed(keep=self.config.max_unnamed_states - 1)
                    state_id = f"{UNNAMED_PREFIX}{uuid.uuid4().hex[:12]}"
                    while state_id in self._entries:  # a user may have taken the name
                        state_id = f"{UNNAMED_PREFIX}{uuid.uuid4().hex[:12]}"
                    handle = self._add(state_id, self._new_sequence(), unnamed=True)
                    how = "new: no idle state holds the start of this conversation"
                else:
                    how = f"continues its conversation ({len(entry.seq)} tokens held)"
            self._leased.add(handle.id)
        if not named and token_ids:
            logger.info("state %s serves a call of %d tokens (%s)", handle.id, len(token_ids), how)
        else:  # a named call's tokens are not known here, nor those of one the chat layer leases a new state for
            logger.info("state %s serves a call (%s)", handle.id, how)
        try:
            yield handle
        finally:
            with self.lock:
                self._leased.discard(handle.id)
                if self.is_unnamed(handle):  # calls at once may have held more than the bound
                    self._close_unnamed(keep=self.config.max_unnamed_states)
                elif handle.id in self._named and self._live(handle) is not None:
                    self._named.move_to_end(handle.id)
                    self._put_away_named()

    def _close_unnamed(self, keep: int) -> None:
        """Close the least recently used idle states that `lease` named, all but `keep`."""
        busy = self._busy()
        idle = sorted((e for e in self._entries.values() if e.unnamed and not self._taken(e, busy)),
                      key=lambda e: e.last_use)
        for entry in idle[:max(0, len(idle) - keep)]:
            logger.debug("closing idle state %s: more than max_unnamed_states=%d states made for calls "
                         "that named none", entry.handle.id, self.config.max_unnamed_states)
            self.close_state(entry.handle)

    def _put_away_named(self) -> None:
        """Put away the least recently used idle states that named leases opened, all but
        `max_named_states` (`put_away`: written to state_dir first where there is one); one in
        use, or that could not be written, is kept. A call costs a move in an ordered dict, and
        a look at the states beyond the bound only."""
        kept = []
        while self._named and len(self._named) + len(kept) > self.config.max_named_states:
            state_id, _ = self._named.popitem(last=False)
            entry = self._entries.get(state_id)
            if entry is None:
                continue
            if self.put_away(entry.handle):
                logger.debug("state %r put away: more than max_named_states=%d states opened by calls that named "
                             "them", state_id, self.config.max_named_states)
            else:
                kept.append(state_id)
        for state_id in reversed(kept):  # in use: kept, among the least recently used
            self._named[state_id] = None
            self._named.move_to_end(state_id, last=False)

    def infos(self) -> list[StateInfo]:
        with self.lock:  # the requests looked at once, not once a state (a server's /metrics lists thousands)
            self.core.end_cancelled()
            busy = self._busy()
            since = time.time() - time.monotonic()  # last uses are kept on the monotonic clock
            if not self._entries:  # a closed engine holds none (and has dropped its cache)
                return []
            blocks = self.kv_cache.layout.in_blocks  # its pages, in the blocks kv_device_blocks counts
            return [StateInfo(e.handle.id, len(e.seq), min(e.seq.num_computed, len(e.seq)),
                              blocks(e.seq.num_blocks, up=True), _tier(e.seq),
                              since + e.last_use, id(e.seq) in busy, e.use.pinned_at is not None,
                              e.use.priority)
                    for e in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def acceptance(self, speculation: Any) -> dict[str, dict[str, list[float]]]:
        """Each open state's acceptance by draft position and drafter (`Speculator.acceptance`), by
        state id; {} for a state that never drafted (speculation off, or nothing to draft yet)."""
        with self.lock:
            return {e.handle.id: speculation.acceptance(e.seq) for e in self._entries.values()}

    def held_bytes(self, per_block: int, slot_bytes: int = 0) -> dict[str, KVBytes]:
        """Each state's KV bytes where it lies (its device blocks, or its parked copy as the host
        tier counts it), what it holds alone apart from what other states hold too; a hybrid
        model's states (`slot_bytes` a slot) also hold their recurrent slots alone (the live one and
        its snapshots: closing the state frees them)."""
        tier = self.core.scheduler.eviction.tier
        copies = tier.held_copies() if tier is not None else {}
        ref_count = self.pool.ref_count
        found = {}
        with self.lock:
            for e in self._entries.values():
                seq = e.seq
                slots = seq.recurrent.num_slots * slot_bytes if seq.recurrent is not None else 0
                if seq.num_blocks:
                    shared = sum(ref_count(block) > 1 for block in seq.held_blocks()) * per_block
                    found[e.handle.id] = KVBytes(seq.num_blocks * per_block - shared + slots, shared)
                    continue
                copy = copies.get(id(seq))
                if copy is None:
                    found[e.handle.id] = KVBytes(slots, 0)
                else:
                    found[e.handle.id] = (KVBytes(slots, copy.nbytes) if copy.holders > 1
                                          else KVBytes(copy.nbytes + slots, 0))
        return found

    def idle_sequences(self) -> list[KVSequence]:
        """Sequences holding KV (or a hybrid model's recurrent slots) and serving no request,
        first to evict first (the policy's order)."""
        busy = self._busy()
        idle = [(e.seq, e.use, e.seq.num_blocks) for e in self._entries.values()
                if (e.seq.num_blocks or (e.seq.recurrent is not None and e.seq.recurrent.num_slots))
                and id(e.seq) not in busy]
        pin_blocks = int(self.config.pin_budget * self.core.scheduler.pool.num_blocks)
        return retention_order(self.policy, idle, time.monotonic(), pin_blocks)

    def sequences(self) -> list[KVSequence]:
        """Every open state's sequence."""
        with self.lock:
            return [e.seq for e in self._entries.values()]

    def prefetch(self) -> float:
        """While the engine is idle: bring back the parked states whose agents are due from their
        tools (tool_aware's expectation), into free device blocks only (nothing is evicted for
        it), soonest due first. Returns how long the engine may sleep before the next is due."""
        tier = self.core.scheduler.eviction.tier
        now = time.monotonic()
        parked = self._waiting_on_tools()
        if tier is None or not parked:
            return 1.0
        for entry in parked:
            if entry.use.due(now, PREFETCH_LEAD) and not self.core.scheduler.busy(entry.seq):
                self._prefetch(entry)
        later = [e.use.expected_back() - PREFETCH_LEAD - now for e in parked if e.seq.parked is not None]
        return min([1.0] + [max(0.01, t) for t in later if t > 0])

    def prefetch_between_steps(self) -> None:
        """While the engine steps (a step was just launched): bring back from host memory the
        parked state due soonest from its tools, its copy overlapping that step's forward on a
        discrete GPU. Only where no request waits for admission, and into free blocks beyond
        one per running request (what their next decode may take): a prefetch never makes a
        running request evict. One state per step, so that the forward after it does not wait
        on many copies; disk is read only while the engine is idle (a file read would hold the
        step loop)."""
        scheduler = self.core.scheduler
        if scheduler.eviction.tier is None or scheduler.waiting:
            return
        now = time.monotonic()
        per_block = self.kv_cache.bytes_per_block_here
        for entry in self._waiting_on_tools():
            parked = entry.seq.parked
            if parked.tier != "host" or not entry.use.due(now, PREFETCH_LEAD) or scheduler.busy(entry.seq):
                continue
            blocks = -(-parked.nbytes // per_block)  # at most: blocks another state holds are not copied
            if self.pool.can_allocate(blocks + len(scheduler.running)):
                self._prefetch(entry)
            return

    def _waiting_on_tools(self) -> list[_Entry]:
        """States parked off the device whose agents wait on tools, soonest expected back first.
        Those past the window they are kept for are never due again (until another turn ends in
        tool calls) and are dropped from `_tool_waits`."""
        now = time.monotonic()
        self._tool_waits = {e for e in self._tool_waits if e.use.tool_since is not None and now <= e.use.kept_until()}
        parked = [e for e in self._tool_waits if e.seq.parked is not None and not e.seq.num_blocks]
        return sorted(parked, key=lambda e: e.use.expected_back())

    def _prefetch(self, entry: _Entry) -> None:
        where = entry.seq.parked.tier
        if self.core.scheduler.eviction.tier.prefetch(entry.seq):
            logger.info("state %r brought back from %s before its agent's next turn", entry.handle.id, where)

    def pin(self, handle: StateHandle, pinned: bool) -> None:
        """Pin (or unpin) a state's KV on the device, within the pin budget (`retention_order`)."""
        with self.lock:
            use = self._entry(handle).use
            if not pinned:
                use.pinned_at = None
            elif use.pinned_at is None:
                use.pinned_at = time.monotonic()

    def note_turn(self, handle: StateHandle, called_tools: bool) -> None:
        """The chat layer's word that a turn on this state ended, in tool calls or not (the
        tool-aware eviction order keeps a state while its agent's tools run)."""
        with self.lock:
            entry = self._live(handle)
            if entry is not None:
                entry.use.turn_ended(time.monotonic(), called_tools)
                if called_tools:
                    self._tool_waits.add(entry)
                else:
                    self._tool_waits.discard(entry)

    # --- what a handle asks for -----------------------------------------------------------------

    def tokens(self, handle: StateHandle) -> list[int]:
        """The state's history (StateClosedError once closed: a closed state holds nothing to read)."""
        with self.lock:
            return list(self._entry(handle).seq.tokens)

    def held(self, handle: StateHandle) -> tuple[list[int], int | None]:
        """The state's history, and how much of it was the prompt of its last generation (None where
        it has generated nothing since it was made or loaded): where that generation's reply begins,
        which a text completion's next turn need not spell as the model did (`Chat.continues`)."""
        with self.lock:
            entry = self._entry(handle)
            tokens = list(entry.seq.tokens)
            return tokens, None if entry.turn_start is None else min(entry.turn_start, len(tokens))

    def length(self, handle: StateHandle) -> int:
        return len(self._entry(handle).seq)

    def sync(self, handle: StateHandle, token_ids: Sequence[int], append: bool = False) -> SyncStats:
        tokens = self._validate(token_ids)  # outside the lock: a huge list stalls nobody else
        with self.lock:
            entry = self._editable(handle)
            seq = entry.seq
            tokens = self._check_length(seq.tokens + tokens if append else tokens)
            self._check_fits(seq, len(tokens))
            seq.set_tokens(tokens)
            self._drop_empty_copy(seq)
            if seq.num_computed >= seq.sync_length:
                reused = min(seq.num_computed, len(seq))
                self.core.outputs.counters.prompt_reused += reused
                return SyncStats(reused=reused, computed=0)
            events = self.core.submit(Request(seq, None, max_len=self.limits.max_model_len, state_id=handle.id,
                                              use=entry.use), None)
        for _ in events:
            pass
        with self.lock:  # close_state cancels, frees and marks the handle under it: all or none seen
            closed = events.request.cancelled and handle.closed
        if closed:  # closed meanwhile: it holds nothing now
            raise StateClosedError(f"state {handle.id!r} was closed while it synced; open a new one with "
                                   "engine.open_state")
        return SyncStats(reused=events.request.reused, computed=events.request.computed)

    def generate(self, handle: StateHandle, params: SamplingParams, prompt: Sequence[int] | None,
                 loop: asyncio.AbstractEventLoop | None,
                 snapshot_at: int | None = None) -> RequestEvents | CompilingEvents:
        """Submit a generation on the state (synced to `prompt` first, when given; `snapshot_at` as
        `StateHandle.stream`'s). Everything is checked before the state changes: a refused call
        leaves it as it was. Called on an event loop with a grammar not compiled yet, the compile
        and the submission wait for the first read (`CompilingEvents`)."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams, got {type(params).__name__}; "
                              "build one: SamplingParams(max_tokens=..., temperature=...)")
        if params.stop and not self.limits.has_tokenizer:
            raise HibanaError("stop strings need a tokenizer, and this checkpoint has none; "
                              "use stop_token_ids instead")
        outside = [t for t in params.stop_token_ids if not 0 <= t < self.limits.vocab_size]
        if outside:
            raise InvalidTokenError(f"stop_token_ids {outside[:5]} lie outside the vocabulary [0, "
                                    f"{self.limits.vocab_size}): the model never emits them; give ids of this "
                                    "model's tokenizer", field="stop_token_ids")
        outside = [t for t in params.logit_bias or () if t >= self.limits.vocab_size]
        if outside:
            raise InvalidTokenError(f"logit_bias names token ids {outside[:5]} outside the vocabulary [0, "
                                    f"{self.limits.vocab_size}); give ids of this model's tokenizer",
                                    field="logit_bias")
        if loop is not None and self._compiles_on_loop(params):
            return CompilingEvents(functools.partial(self.grammars.compile, params),
                                   functools.partial(self.generate, handle, params, prompt, loop, snapshot_at))
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.limits.eos_token_ids)
        grammar = None
        if params.constrained:  # compiled here, outside the lock: a new grammar may take 100 ms
            if self.grammars is None:
                raise GrammarError("this engine has no grammar support; build it with Engine.from_pretrained")
            grammar = self.grammars.matcher(params, stops)
        tokens = self._validate(prompt) if prompt is not None else None
        with self.lock:
            if params.speculation is not None and self.core.speculation is not None:
                # a closed engine or state says so first: the drafters went with the engine, and
                # one built again for it loaded a draft model's weights and failed as its factory
                self._entry(handle)
                # between steps: a drafter named for the first time is built here, and building
                # one may run the model (layer_skip ranks its layers) or take pool blocks
                self.core.speculation.check(params.speculation)
            entry = self._editable(handle)
            seq = entry.seq
            length = len(tokens if tokens is not None else seq)
            if not length:
                if tokens is None or not seq:
                    given = "the prompt given is empty and " if tokens is not None else ""
                    raise ContextLengthError(f"{given}state {handle.id!r} holds no tokens: nothing to continue "
                                             "from; give a prompt of at least one token (or sync a history first)")
                raise ContextLengthError(f"prompt=[] would make state {handle.id!r} (holding {len(seq)} tokens) an "
                                         "empty history: nothing to continue from; leave prompt out to continue the "
                                         "state, or give at least one token (the state is unchanged)")
            if params.max_tokens > 0 and length >= self.limits.max_model_len:
                raise ContextLengthError(
                    f"the history holds {length} tokens, the model's whole context of "
                    f"{self.limits.max_model_len}: no room to generate; truncate or shorten it "
                    "(the state is unchanged)")
            self._check_fits(seq, length)  # (a loaded state may hold more than this pool: refused before it evicts)
            if tokens is not None:
                seq.set_tokens(tokens)
            entry.use.priority = params.priority  # also how long its KV is kept once idle
            entry.turn_start = length
            generator = make_generator(params.seed, self.limits.device) if params.seed is not None else None
            request = Request(seq, params, generator, stops, self.limits.max_model_len, state_id=handle.id,
                              grammar=grammar, use=entry.use,
                              snapshot_at=snapshot_at if snapshot_at and 0 < snapshot_at < length else 0)
            request.forced, entry.forced = entry.forced, None
            return self.core.submit(request, loop)

    def _compiles_on_loop(self, params: SamplingParams) -> bool:
        """Whether submitting `params` now would compile a new grammar on a running event loop."""
        if not params.constrained or self.grammars is None or self.grammars.cached(params):
            return False
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False  # a worker thread (`turn.arun` submits from one): it may wait
        return True

    def force_outputs(self, handle: StateHandle, token_ids: Sequence[int]) -> None:
        """Bench only (trace replay): the state's next generation emits `token_ids`."""
        tokens = self._validate(token_ids)
        with self.lock:
            self._editable(handle).forced = tokens

    def truncate(self, handle: StateHandle, n: int) -> None:
        if not is_kind(n, int) or n < 0:
            raise ConfigError(f"truncate needs a token count n >= 0, got {n!r}")
        with self.lock:
            seq = self._editable(handle).seq
            seq.trim(min(n, len(seq)))
            self._drop_empty_copy(seq)

    def _drop_empty_copy(self, seq: KVSequence) -> None:
        """An emptied state lets its parked copy go (host memory, a spill file): nothing of it can
        come back, and it would stay until the state's next request."""
        if not seq.tokens and seq.parked is not None:
            self.core.scheduler.eviction.tier.forget(seq)

    def fork(self, handle: StateHandle, new_id: str) -> StateHandle:
        check_id(new_id)
        with self.lock:
            entry = self._editable(handle)
            seq = entry.seq
            if new_id in self._entries:
                raise StateExistsError(f"a state with id {new_id!r} is open; fork under another id")
            self._refuse_stored(new_id, "fork under another id")
            twin = seq.fork()
            tier = self.core.scheduler.eviction.tier
            if seq.parked is not None and tier is not None:
                tier.share(seq, twin)  # a parked copy of its own (a hard link on disk), or none
            forked = self._add(new_id, twin)
            self._entries[new_id].turn_start = entry.turn_start
            return forked

    def save(self, handle: StateHandle, path: str | os.PathLike) -> None:
        path = state_file.as_path(path)
        with self.lock:  # the state's tokens and a host copy of its KV, as they are now
            snapshot = self._snapshot(self._editable(handle).seq, handle.id)
        state_file.write(path, **snapshot)  # written outside the lock: the other agents keep stepping

    def _write(self, seq: KVSequence, state_id: str, path: Path) -> None:
        """Write `seq` as a state file (from its parked copy when it is parked)."""
        state_file.write(path, **self._snapshot(seq, state_id))

    def _snapshot(self, seq: KVSequence, state_id: str) -> dict:
        """`state_file.write`'s arguments for `seq` but the path: its tokens and a host copy of
        its KV (of its parked copy when it is parked), which later steps do not change; a hybrid
        model's, its linear layers' state too (`KVSequence.recurrent`). A parked copy that cannot
        be read (its spill file gone or damaged) is dropped: its tokens alone are written, and the
        KV is computed again when the state is next used."""
        computed, kv, rotated_long, recurrent = seq.num_computed, None, seq.rotated_long, None
        if not seq.num_blocks and seq.parked is not None:  # parked in host memory or on disk: its copy
            try:
                computed, kv, starts, recurrent = seq.parked.prefix(common_prefix_len(seq.tokens, seq.parked.tokens),
                                                                    seq)
                rotated_long = seq.parked.rotated_long
            except UNREADABLE_SPILL as exc:  # a spill file gone or damaged: its history still is sound
                logger.warning("state %r: its parked KV could not be read (%s); its tokens are written, and its KV "
                               "is computed again at its next request", state_id, exc)
                self.core.scheduler.eviction.tier.forget(seq)
        if seq.recurrent is not None and kv is None:  # a hybrid model's: its linear layers' state, at num_computed
            computed = seq.recurrent.position if seq.recurrent.slot is not None else 0
            recurrent = self.recurrent_cache.read(seq.recurrent.slot) if computed else None
        if kv is None:
            pages, starts = seq.pages(computed)
            kv = self.kv_cache.read_blocks(pages)
        return dict(state_id=state_id, tokens=list(seq.tokens), num_computed=computed,
                    block_size=self.pool.block_size, kv=kv, fingerprint=self.limits.fingerprint,
                    rotated_long=rotated_long, starts=starts, layout=self.kv_cache.layout,
                    configuration=self.limits.configuration, recurrent=recurrent)

    def _recurrent_shapes(self) -> dict | None:
        """What a state file of a hybrid model holds of its linear layers (None for other models)."""
        return None if self.recurrent_cache is None else self.recurrent_cache.slot_shapes()

    def load(self, path: str | os.PathLike, state_id: str | None = None, *, share: bool = False) -> StateHandle:
        """Restore a state written by `save` (same model and tokenizer only). The file is read and
        verified whole before anything is allocated. Its KV blocks stay private to the state
        (`share=True` publishes them in the prefix index, for files the caller trusts)."""
        if state_id is not None:
            check_id(state_id)
        if not isinstance(share, bool):
            raise ConfigError(f"share is True or False, got {share!r}")
        with self.lock:  # the file is read without the lock, against the cache as it was (close drops it)
            self._check_open()
            cache = self.kv_cache
        path = state_file.as_path(path)
        saved = self._in_this_pool(state_file.read(path, self.limits.fingerprint, cache.data.shape, cache.dtype,
                                                   cache.layout, self.limits.configuration, self._recurrent_shapes()))
        self._check_saved_length(saved, path)
        tokens = self._saved_tokens(saved, path)
        with self.lock:
            self._check_open()
            state_id = state_id or saved.state_id
            if state_id in self._entries:
                raise StateExistsError(f"a state with id {state_id!r} is open; close it or pass "
                                       "load_state(path, state_id=...) with another id")
            self._refuse_stored(state_id, "pass load_state(path, state_id=...) with another id")
            seq = self._new_sequence()
            seq.share = self.config.enable_prefix_caching and share
            seq.tokens = tokens
            if self._kv_fits(seq, saved):
                seq.rotated_long = saved.rotated_long
                if not self._parked_for_room(seq, saved):
                    self._place(seq, saved, path)
            return self._add(state_id, seq)

    def _saved_tokens(self, saved: state_file.SavedState, path: Path) -> list[int]:
        """A saved history's token ids, checked as a caller's are; ids this vocabulary lacks make the
        file a StateFileError (another model's, or made by hand: its checksum proves no origin)."""
        try:
            return self._validate(saved.tokens)
        except InvalidTokenError as exc:
            raise StateFileError(f"{path} holds token ids this model cannot read ({exc}); it was saved by "
                                 "another model or damaged") from None

    def _parked_for_room(self, seq: KVSequence, saved: state_file.SavedState, host: bool = True) -> bool:
        """Where running requests hold the device blocks a saved state's KV needs, that KV parked
        in the host tier (unless `host` is False: the caller tried it), else on disk: restored at
        the state's next request. False where the device has room (idle states evicted for it) or
        no tier takes it."""
        tier = self.core.scheduler.eviction.tier
        if tier is None or self._device_room(saved.kv.shape[2]):
            return False
        computed = seq.tokens[:saved.num_computed]
        return ((host and tier.adopt(seq, computed, saved.kv, saved.starts, recurrent=saved.recurrent))
                or tier.adopt(seq, computed, saved.kv, saved.starts, disk=True, recurrent=saved.recurrent))

    def _in_this_pool(self, saved: state_file.SavedState) -> state_file.SavedState:
        """A saved state in this pool's block size: re-cut, group by group (else left as it is,
        and `_kv_fits` says its KV is recomputed)."""
        if saved.block_size != self.pool.block_size and saved.num_computed:
            return state_file.reblocked(saved, self.pool.block_size, self.kv_cache.layout) or saved
        return saved

    def _kv_fits(self, seq: KVSequence, saved: state_file.SavedState) -> bool:
        """Whether a saved state's KV can be restored into `seq` (else its tokens only are, and
        the KV is recomputed on next use): it has some, in this pool's block size, and its pages
        still hold the windows of its last position."""
        return (saved.block_size == self.pool.block_size and saved.num_computed > 0
                and seq.pages_fit(saved.starts, saved.num_computed))

    def _device_room(self, blocks: int) -> bool:
        """Whether `blocks` device blocks are free, once idle states are evicted for them (none is
        where that would still not free them all: the saved KV then waits elsewhere)."""
        return self.pool.can_allocate(blocks) or self.core.scheduler.eviction.make_room(blocks, partial=False)

    def _place(self, seq: KVSequence, saved: state_file.SavedState, path: object) -> None:
        """A saved state's KV into device blocks now (idle states evicted for room). Where running
        requests hold the blocks and no tier took the KV, the state keeps its tokens alone: its KV
        is recomputed at its next request, which waits for room as any request does (it was a
        MemoryBudgetError that sent the caller to idle states there were none of)."""
        blocks = saved.kv.shape[2]
        if not self._device_room(blocks):
            seq.rotated_long = False  # (as a state of tokens alone)
            return
        if seq.recurrent is not None and not self.core.scheduler.recurrent_slot(seq):
            return  # every slot is a running state's: its history is recomputed at its next request
        ids = self.pool.allocate(blocks)
        seq.place_pages(ids, saved.starts, saved.num_computed)
        try:
            self.kv_cache.write_blocks(ids, saved.kv)
            if seq.recurrent is not None:  # its linear layers' state, at the same position
                self.recurrent_cache.write(seq.recurrent.slot, saved.recurrent)
                seq.recurrent.position = saved.num_computed
        except Exception as exc:
            seq.release()
            raise StateFileError(f"state file {path} does not fit this engine's KV cache ({exc})") from exc
        seq.commit_full_blocks()  # with share=True: published (and deduped)

    def close_state(self, handle: StateHandle) -> None:
        with self.lock:
            entry = self._live(handle)
            if entry is None:
                return
            for request in [r for r in self.core.scheduler.requests() if r.seq is entry.seq]:
                self.core.cancel(request)
            self._free(entry.seq)
            handle.closed = True
            del self._entries[handle.id]
            self._tool_waits.discard(entry)
            self._named.pop(handle.id, None)
            path = self.persisted_path(handle.id)
            if path is not None:  # closed: the user is done with it, after a restart too
                _drop_stored(entry, path)

    def close_all(self) -> None:
        with self.lock:
            for entry in self._entries.values():
                self._free(entry.seq)
                entry.handle.closed = True
            self._entries.clear()
            self._tool_waits.clear()
            self._named.clear()

    def _free(self, seq: KVSequence) -> None:
        """A closed state's KV, on the device and parked: gone now, not when the last reference to
        its sequence (a finished stream's, say) is collected."""
        seq.release()
        tier = self.core.scheduler.eviction.tier
        if tier is not None:
            tier.forget(seq)

    # --- checks ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.core.closed:
            raise EngineClosedError("the engine is closed; create a new one with Engine.from_pretrained")

    def _entry(self, handle: StateHandle) -> _Entry:
        self._check_open()
        entry = self._live(handle)
        if entry is None:
            raise StateClosedError(f"state {handle.id!r} is closed; open a new one with engine.open_state")
        return entry

    def _editable(self, handle: StateHandle) -> _Entry:
        """The handle's entry, when no request uses its state; marks it used now."""
        entry = self._entry(handle)
        self.core.end_cancelled()
        if self.core.scheduler.busy(entry.seq):
            raise StateBusyError(f"state {handle.id!r} is busy with a request (a generation, or a sync's "
                                 "prefill); wait for it to finish or cancel its stream first")
        now = time.monotonic()
        entry.use.request_came(now)  # a wait on tools ends here: one observation of its length
        self._tool_waits.discard(entry)
        entry.use.last_use = now
        return entry

    def _validate(self, tokens: Sequence[int]) -> list[int]:
        """Token ids as a list of ints in the vocabulary, no longer than the context. A tokenizer's
        output is taken as it comes: its `input_ids` (a BatchEncoding: transformers 5's
        apply_chat_template(tokenize=True)), a batch of one sequence (return_tensors="pt")."""
        if isinstance(tokens, Mapping) and "input_ids" in tokens:
            tokens = tokens["input_ids"]
        if hasattr(tokens, "tolist"):  # a tensor or an array
            tokens = tokens.tolist()
        if isinstance(tokens, list) and tokens and all(isinstance(t, (list, tuple)) for t in tokens):
            if len(tokens) != 1:
                raise InvalidTokenError(f"token ids must be one sequence, got a batch of {len(tokens)}; give "
                                        "each state its own")
            tokens = tokens[0]
        if isinstance(tokens, (str, bytes, bytearray, Mapping, AbstractSet)) or not isinstance(tokens, Iterable):
            raise InvalidTokenError(f"token ids must be a list of integers, got {type(tokens).__name__}"
                                    + (" (unordered: give them in order)" if isinstance(tokens, AbstractSet) else "")
                                    + ("; tokenize text first (engine.tokenizer.encode(text)), or give messages to "
                                       "engine.chat(state_id)" if isinstance(tokens, (str, bytes, bytearray)) else ""))
        tokens = list(tokens)
        # plain ints of the vocabulary, as callers pass them, checked by C-speed builtins (an agent's
        # whole history every turn, on the caller's thread but under the GIL the step loop needs)
        if not plain_token_ids(tokens, self.limits.vocab_size):
            bad = [t for t in tokens if not is_kind(t, int)]
            if bad:
                raise InvalidTokenError(f"token ids must be integers, got {bad[0]!r}; tokenize with this "
                                        "model's tokenizer")
            tokens = [int(t) for t in tokens]
            bad = [t for t in tokens if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise InvalidTokenError(f"token ids {bad[:5]} lie outside the vocabulary "
                                        f"[0, {self.limits.vocab_size}); tokenize with this model's tokenizer")
        return self._check_length(tokens)

    def _check_fits(self, seq: KVSequence, length: int) -> None:
        """A history of `length` tokens whose KV the whole device pool could not hold is refused
        before the state takes it (the scheduler would fail it later, the history set): each of
        its blocks must be there at once, but those sliding windows free (`blocks_to_hold`)."""
        blocks = seq.blocks_to_hold(length)
        if blocks > self.pool.num_blocks:
            said = self.kv_cache.layout.counted  # (in the blocks kv_device_blocks counts)
            raise MemoryBudgetError(
                f"a history of {length} tokens needs {said(blocks, fewest=True)} KV blocks of {seq.block_size} "
                f"tokens, more than the device pool's {said(self.pool.num_blocks)}; raise memory_budget or "
                "kv_device_blocks, or shorten the history (the state is unchanged)")

    def _check_length(self, tokens: list[int]) -> list[int]:
        if len(tokens) > self.limits.max_model_len:
            raise ContextLengthError(f"{len(tokens)} tokens exceed the model's context of "
                                     f"{self.limits.max_model_len}; shorten the history (the state is unchanged)")
        return tokens


def _tier(seq: KVSequence) -> str:
    """Where a state's KV is: "device" (resident blocks), "host" or "disk" (parked), "none" (recomputed)."""
    return "device" if seq.num_blocks else seq.parked.tier if seq.parked is not None else "none"
