"""The host tier: idle states' KV parked in host memory instead of dropped.

    device pool full ──make_room──▶ park(idle seq): its KV copied to the host, device blocks freed
    request on a parked state ──admit──▶ restore(seq): fresh device blocks, KV copied back

Without this tier an idle state evicted under memory pressure loses its KV and recomputes it
(from the prefix index where its blocks were not reused yet). With it, eviction copies the KV of
the state's computed tokens to host memory (pinned on a discrete GPU; on a CPU the copy leaves the
fixed-size pool for ordinary memory) and the next request on the state copies it back: a turn
then computes only its new tokens, whatever happened to the device blocks meanwhile.

A parked copy belongs to its `KVSequence` (`seq.parked`) and dies with it; this object keeps the
host budget, least recently parked dropped first (those states recompute, as without the tier).
A restore checks the copy against the state's history: where the history was edited since, only
the common prefix comes back. With `state_dir` set, what the host budget cannot hold goes to
disk (a spill folder under it, removed when the engine closes) instead of being dropped; a
restore reads it back, checked against the CRC-32 taken when it was written (a damaged or replaced
spill file costs its state a recompute, never wrong KV).

On a discrete GPU the copies run on a side stream (kv/transfers.py): a park enqueues the gather
and the device-to-host copy and returns, the state's blocks freed at once; a restore enqueues the
host-to-device copy and the compute stream waits for it before the scatter. Nothing waits on the
host but what reads a parked copy there: a spill file or a state file written from a copy still
in flight waits for it (`ParkedKV.host_copy`). On the CPU and on unified memory the copies are
synchronous, through the same code. A state due back from its tools is restored ahead of its
request (`prefetch`): while the engine is idle (`StateRegistry.prefetch`), and while it steps,
from host memory into free blocks, its copy overlapping the forward just launched
(`StateRegistry.prefetch_between_steps`).

`counters.seconds` is copy time: on a side stream the device-to-host and host-to-device copies
as CUDA events measure them (the gather and scatter on the compute stream are not in it), added
once each copy is done; elsewhere the wall time of the synchronous copies.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import time
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import safetensors.torch
import torch

from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.cache import KVCache
from hibana_core.kv.recurrent_cache import STATE_TENSORS, RecurrentCache, file_tensors, from_file_tensors
from hibana_core.kv.sequence import KVSequence, common_prefix_len
from hibana_core.kv.state_file import PRIVATE_DIR, save_private
from hibana_core.kv.transfers import CopyStream, PinnedReserve, Transfer, device_tensor

logger = logging.getLogger("hibana.states")

UNREADABLE_SPILL = (OSError, ValueError, safetensors.SafetensorError)
"""What reading back a spill file that is gone, truncated, damaged or replaced raises (`ParkedKV.host_copy`)."""


class HeldCopy(NamedTuple):
    nbytes: int   # as its tier counts it: pinned pages on a GPU, the file on disk
    holders: int  # states holding it: a fork shares its parent's


@dataclass(frozen=True)
class ParkedKV:
    tokens: list[int]             # the history whose KV this holds, in full
    kv: torch.Tensor | None       # [page_layers, 2, pages, block_size, H_kv, D] on the host; None: on disk
    path: Path | None = None      # the spill file holding it, when it is on disk
    size: int = 0                 # its bytes on disk
    rotated_long: bool = False    # under LongRoPE's long rotation (`KVSequence.rotated_long`)
    starts: tuple[int, ...] = (0,)  # each layer group's first block among the pages (`KVSequence.pages`)
    copy: Transfer | None = None  # the copy filling `kv`, maybe still in flight
    digest: tuple | None = None   # `spill_digest` of the KV its spill file was written with
    # a hybrid model's linear-attention state at len(tokens) (kv.state_file's "conv" and "ssm", on the host;
    # in the spill file beside the KV when on disk)
    recurrent: dict[str, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() if self.kv is not None else self.size

    @property
    def tier(self) -> str:
        return "host" if self.kv is not None else "disk"

    def host_copy(self) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """(the KV in host memory, its copy there waited for; a hybrid model's linear-attention
        state or None), read from the spill file when on disk (both checked against its digest)."""
        if self.kv is None:
            tensors = safetensors.torch.load_file(self.path)
            kv, recurrent = tensors["kv"], from_file_tensors(tensors)
            if spill_digest(kv, recurrent) != self.digest:
                raise ValueError(f"spill file {self.path} is damaged or was replaced (its checksum does not match)")
            return kv, recurrent
        if self.copy is not None:
            self.copy.wait()
        return self.kv, self.recurrent

    def page_index(self, n: int, seq: KVSequence) -> list[int]:
        """Which of the pages hold the KV of the first n tokens of `seq`'s layout (n <=
        len(tokens), and n's windows inside the pages: `KVSequence.pages_fit`), in
        `KVSequence.pages` order."""
        index, at = [], 0
        for (sinks, rest), (sinks_n, rest_n) in zip(seq.page_counts(self.starts, len(self.tokens)),
                                                    seq.page_counts(self.starts, n)):
            index.extend(range(at, at + sinks_n))
            index.extend(range(at + sinks, at + sinks + rest_n))
            at += sinks + rest
        return index

    def prefix(self, n: int, seq: KVSequence) -> tuple[int, torch.Tensor, tuple[int, ...], dict | None]:
        """(tokens, pages, starts, linear-attention state) of this copy's first n tokens, as a
        state file stores them; no tokens where n's windows were freed before parking, or where a
        hybrid model's state (held at the copy's end only) is not at n."""
        if not seq.pages_fit(self.starts, n) or (seq.recurrent is not None and n != len(self.tokens)):
            n = 0
        kv, recurrent = self.host_copy()
        return n, kv[:, :, self.page_index(n, seq)], self.starts, recurrent if n else None


@dataclass
class TierCounters:
    parks: int = 0
    resumes: int = 0
    dropped: int = 0            # parked copies dropped for the host budget (those states recompute)
    prefetches: int = 0         # restores made before the state's request came (its agent was due back)
    bytes_moved: int = 0        # both directions
    seconds: float = 0.0        # spent copying, both directions, once each copy is done (see the module)
    tokens_restored: int = 0    # prompt tokens whose recomputation a restore avoided
    spills: int = 0             # copies written to disk (the host budget was full, or there is none)
    disk_resumes: int = 0       # restores read from disk
    disk_bytes_moved: int = 0   # written and read, on disk
    disk_seconds: float = 0.0   # spent writing and reading spill files
    host_seconds: float = 0.0   # the caller's wall time in park and restore (the step loop's, in a step)


class HostTier:
    """Parked KV: in host memory within `budget_bytes`, and on disk under `spill_dir` (when
    given) for what the host budget cannot hold: the oldest host copies move there to make room,
    and a copy larger than the whole host budget (or any, with a budget of 0: unified memory,
    where disk is the only tier below the device) goes there directly."""

    def __init__(self, cache: KVCache, pool: BlockPool, budget_bytes: int, copies: CopyStream,
                 spill_dir: Path | None = None) -> None:
        self.cache, self.pool, self.budget_bytes = cache, pool, budget_bytes
        self.copies = copies  # where its copies run (a side stream on a discrete GPU)
        self._copying: list[Transfer] = []  # copies whose time is not counted yet (still in flight)
        self.spill_dir = spill_dir
        if spill_dir is not None:  # its files hold states' conversations: owner-only, as state files (PRIVATE_DIR)
            spill_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        self.pinned = cache.data.device.type == "cuda"
        self.reserve = PinnedReserve(budget_bytes) if self.pinned else None  # pinned off the step loop
        self._parked: OrderedDict[int, weakref.ref] = OrderedDict()  # id(seq) -> seq, least recent first
        self._bytes = _SharedBytes()  # host copies' bytes, by id(seq); a fork's shared tensor once
        # id(seq) -> (seq, its file's first path: hard links of a fork's share it, bytes on disk)
        self._spilled: dict[int, tuple[weakref.ref, Path, int]] = {}
        self._files = itertools.count()
        self._restoring: int | None = None  # id(seq) of the state being restored: its copy stays
        self._depth = 0  # `_timed` calls in progress
        # a hybrid model's recurrent cache and the scheduler's way to a slot (`Scheduler.recurrent_slot`),
        # set by the engine: its states park and come back with their linear layers' state
        self.recurrent_cache: RecurrentCache | None = None
        self.recurrent_slot: Callable[[KVSequence], bool] | None = None
        self.counters = TierCounters()
        self.phases: collections.Counter[str] = collections.Counter()  # seconds of `host_seconds` by phase

    @property
    def bytes_used(self) -> int:
        """Host memory the copies hold: a tensor shared by a fork and its parent counted once,
        pinned tensors at what they take from the reserve (page-aligned)."""
        return self._bytes.total

    def _held(self, nbytes: int) -> int:
        """The host memory a copy of `nbytes` holds (what it takes from the reserve, when pinned)."""
        return PinnedReserve.held(nbytes) if self.pinned else nbytes

    @property
    def disk_bytes_used(self) -> int:
        """Disk the spill files take: a file a fork hard-links counted once."""
        return sum({file: size for _, file, size in self._spilled.values()}.values())

    def held_copies(self) -> dict[int, HeldCopy]:
        """Each parked copy by id(seq): its bytes as `bytes_used` or `disk_bytes_used` counts
        them, and how many states hold it."""
        files = collections.Counter(file for _, file, _ in self._spilled.values())
        disk = {key: HeldCopy(size, files[file]) for key, (_, file, size) in self._spilled.items()}
        return self._bytes.held_copies() | disk

    @property
    def shared_bytes(self) -> int:
        """What of `bytes_used` more than one state holds (a fork and its parent), once."""
        return self._bytes.shared

    @property
    def disk_shared_bytes(self) -> int:
        """What of `disk_bytes_used` more than one state holds (a fork's hard link), once."""
        files = collections.Counter(file for _, file, _ in self._spilled.values())
        return sum({file: size for _, file, size in self._spilled.values() if files[file] > 1}.values())

    def destination(self, seq: KVSequence) -> str:
        """Where `park(seq)` would put its KV: "host", "disk", or "drop" (no copy it can take)."""
        n = min(seq.num_computed, len(seq.tokens))
        if n == 0:
            return "drop"
        if self._held(len(seq.pages(n)[0]) * self.cache.bytes_per_block_here) <= self.budget_bytes:
            return "host"
        return "disk" if self.spill_dir is not None else "drop"

    def park(self, seq: KVSequence) -> bool:
        """Copy the KV of `seq`'s computed tokens to the host (or, past the host budget, to disk)
        and free its device blocks. False (nothing copied, nothing freed) when neither takes it."""
        with self._timed():
            return self._park(seq)

    def _park(self, seq: KVSequence) -> bool:
        n = min(seq.num_computed, len(seq.tokens))
        recurrent = None
        if seq.recurrent is not None:  # its linear layers' state goes with its KV, which it must match
            if seq.recurrent.slot is None or seq.recurrent.position != n or self.recurrent_cache is None:
                return False
            recurrent = self.recurrent_cache.read(seq.recurrent.slot) if n else None
        pages, starts = seq.pages(n)
        blocks = len(pages)
        nbytes = blocks * self.cache.bytes_per_block_here
        to_host = n > 0 and self._room(self._held(nbytes))
        if not to_host and (n == 0 or self.spill_dir is None):
            return False
        with self._phase("gather"):
            index = device_tensor(pages, torch.long, self.cache.data.device)  # no wait for the step in flight
            device_kv = self.cache.gather(index)  # on the compute stream: before any later write of the blocks
        with self._phase("host memory"):
            host = (self.reserve.empty(device_kv.shape, device_kv.dtype) if self.pinned and to_host
                    else torch.empty(device_kv.shape, dtype=device_kv.dtype))
        with self._phase("to host"):
            copy = self._count(self.copies.to_host(device_kv, host))
        parked = ParkedKV(seq.tokens[:n], host, rotated_long=seq.rotated_long, starts=starts, copy=copy,
                          recurrent=recurrent)
        if to_host:
            self._hold(seq, parked)
        elif not self._spill(seq, parked):
            return False  # the disk takes nothing: the caller releases the KV
        c = self.counters
        c.parks += 1
        c.bytes_moved += nbytes
        seq.release()  # its blocks may be written at once: the gather came first on the compute stream
        logger.info("evicting an idle state's KV (%d blocks, %d tokens): parked in the %s tier (%d bytes)",
                    blocks, n, seq.parked.tier, nbytes)
        return True

    def restore(self, seq: KVSequence, make_room: Callable[[int], bool]) -> int:
        """Bring a parked state's KV back into fresh device blocks, as far as its history still
        starts with the parked tokens. Returns the tokens restored (0: nothing to do, or no room:
        the copy stays parked and the state catches up by computing). On a side stream the copy
        is enqueued, not done: the compute stream waits for it before its blocks are written.
        The states evicted for it (device blocks, a hybrid model's state slot) may be parked here,
        but never by pushing `seq`'s own copy out of the host budget: the restore reads it next (a
        state that cannot be parked then goes to disk, or recomputes later)."""
        self._restoring = id(seq)
        try:
            with self._timed():
                return self._restore(seq, make_room)
        finally:
            self._restoring = None

    @contextlib.contextmanager
    def _timed(self):
        """Count the wall time inside in `counters.host_seconds` (time the caller did not step),
        once: a restore parks the states it makes room from."""
        began, self._depth = time.perf_counter(), self._depth + 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.counters.host_seconds += time.perf_counter() - began

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Count the wall time inside in `phases[name]` (where `host_seconds` goes; a restore's
        "making room" includes the parks it makes, which count their own phases too)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] += time.perf_counter() - began

    def _restore(self, seq: KVSequence, make_room: Callable[[int], bool]) -> int:
        parked = seq.parked
        if parked is None or seq.num_computed:
            return 0
        n = common_prefix_len(seq.tokens, parked.tokens)
        diverged = n < min(seq.block_size, len(parked.tokens))  # within its first block
        # (not a hybrid state: its linear layers' state at n is in its copy alone)
        if not diverged and seq.recurrent is None and seq.index_match(n) >= n:
            # the index holds it all, maybe in blocks nobody holds (the state's own, freed by its
            # park): adopted now, before the copy goes, or the next allocation may take them
            seq.reuse_cached_blocks(n)
            self.forget(seq)
            return 0
        if (diverged or parked.rotated_long != seq.rotated_long or not seq.pages_fit(parked.starts, n)
                or (seq.recurrent is not None and n != len(parked.tokens))):
            self.forget(seq)  # diverged within its first block, under LongRoPE's other rotation, back into
            return 0          # freed windows, or short of a hybrid state's end: it recomputes
        if seq.recurrent is not None and not self.recurrent_slot(seq):
            return 0  # every slot is a running state's: the copy stays parked

        if parked.starts != (0,):  # layer groups: every page copied back
            return self._restore_pages(seq, n, make_room)
        blocks = -(-n // seq.block_size)
        with self._phase("prefix index"):
            seq.reuse_cached_blocks(n)  # what other states still hold (a shared system prompt) is not copied
        first = len(seq.block_ids)
        if not self._device_room(blocks - first, make_room):
            seq.release()
            return 0
        copy = self._read_copy(seq)
        if copy is None:
            return 0
        kv, recurrent = copy
        ids = self.pool.allocate(blocks - first)
        with self._phase("to device"):
            pages_kv = self._to_device(seq.parked, kv, list(range(first, blocks)))
        with self._phase("scatter"):
            self.cache.write_blocks(ids, pages_kv)
        seq.block_ids.extend(ids)
        seq.num_computed = n
        self._recurrent_back(seq, n, recurrent)
        self._restored(seq, n, n - first * seq.block_size, len(ids))
        return n

    def _recurrent_back(self, seq: KVSequence, n: int, recurrent: dict[str, torch.Tensor] | None) -> None:
        """A hybrid state's linear layers' state, parked with its KV (`_read_copy` read both), back
        into its slot (`_restore` took one): the state continues from n."""
        if seq.recurrent is None:
            return
        self.recurrent_cache.write(seq.recurrent.slot, recurrent)
        seq.recurrent.position = n

    def prefetch(self, seq: KVSequence) -> int:
        """`restore` ahead of the state's request (its agent is due back from its tools), into
        free device blocks only: nothing is evicted for it."""
        if seq.recurrent is not None and not seq.recurrent.slots.num_free:
            return 0  # a hybrid state's slot would be taken from an idle state (two due agents took turns)
        n = self.restore(seq, lambda blocks: False)
        self.counters.prefetches += n > 0
        return n

    def _restore_pages(self, seq: KVSequence, n: int, make_room: Callable[[int], bool]) -> int:
        """`restore` of a copy of several layer groups' pages: all of them come back (the prefix
        index is not consulted)."""
        parked = seq.parked
        index = parked.page_index(n, seq)
        if not self._device_room(len(index), make_room):
            return 0
        copy = self._read_copy(seq)
        if copy is None:
            return 0
        kv, recurrent = copy
        ids = self.pool.allocate(len(index))
        self.cache.write_blocks(ids, self._to_device(parked, kv, index))
        seq.place_pages(ids, parked.starts, n)
        self._recurrent_back(seq, n, recurrent)
        self._restored(seq, n, n, len(ids))
        return n

    def _device_room(self, blocks: int, make_room: Callable[[int], bool]) -> bool:
        """Free device blocks for `blocks` of a restore (`restore` keeps the restoring state's copy parked)."""
        if self.pool.can_allocate(blocks):
            return True
        with self._phase("making room"):
            return make_room(blocks)

    def _read_copy(self, seq: KVSequence) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None] | None:
        """The parked copy's KV in host memory, maybe still being copied there, and a hybrid
        model's linear-attention state beside it (a spill file read once and counted as a disk
        resume); None where the file cannot be read: the state then drops its KV and the copy, and
        recomputes (nobody else fails)."""
        parked = seq.parked
        began = time.perf_counter()
        try:
            copy = (parked.kv, parked.recurrent) if parked.kv is not None else parked.host_copy()
        except UNREADABLE_SPILL as exc:
            logger.warning("a parked state's spill file %s cannot be read (%s); its KV is recomputed", parked.path, exc)
            seq.release()
            self.forget(seq)
            return None
        if parked.kv is None:
            c = self.counters
            c.disk_resumes += 1
            c.disk_bytes_moved += parked.size
            c.disk_seconds += time.perf_counter() - began
        return copy

    def _to_device(self, parked: ParkedKV, kv: torch.Tensor, pages: list[int]) -> torch.Tensor:
        """`kv`'s pages for the compute stream to write into blocks, copied after the park that
        filled a host copy (on a side stream, the compute stream waits for them)."""
        pages_kv, copy = self.copies.to_device(kv, pages, parked.copy if parked.kv is not None else None)
        self._count(copy)
        return pages_kv

    def _count(self, copy: Transfer) -> Transfer:
        """Count a copy's time in `counters.seconds` once it is done."""
        self._copying.append(copy)
        self._settle()
        return copy

    def _settle(self) -> None:
        """Add the time of the copies done since to `counters.seconds` (none is waited for)."""
        copying = []
        for copy in self._copying:
            if copy.done:
                self.counters.seconds += copy.seconds()
            else:
                copying.append(copy)
        self._copying = copying

    def _restored(self, seq: KVSequence, n: int, tokens: int, blocks: int) -> None:
        """Bookkeeping of a restore of n tokens (`tokens` of them copied, into `blocks`)."""
        parked = seq.parked
        seq.commit_full_blocks()
        self.forget(seq)
        c = self.counters
        c.resumes += 1
        c.tokens_restored += tokens
        c.bytes_moved += blocks * self.cache.bytes_per_block_here
        logger.info("resumed a parked state from %s (%d tokens)", "disk" if parked.kv is None else "host memory", n)

    def adopt(self, seq: KVSequence, tokens: list[int], kv: torch.Tensor, starts: tuple[int, ...] = (0,),
              disk: bool = False, recurrent: dict[str, torch.Tensor] | None = None) -> bool:
        """Hold `kv` (on the host: a state file's pages; a hybrid model's `recurrent` state with
        it) as `seq`'s parked copy, restored at its next request like any other: in host memory,
        or with `disk` in a spill file. False when that tier cannot take it."""
        parked = ParkedKV(list(tokens), kv, rotated_long=seq.rotated_long, starts=starts, recurrent=recurrent)
        if disk:
            return self.spill_dir is not None and self._spill(seq, parked)
        if not self._room(self._held(parked.nbytes)):
            return False
        if self.pinned:
            parked = dataclasses.replace(parked, kv=self.reserve.empty(kv.shape, kv.dtype).copy_(kv))
        self._hold(seq, parked)
        return True

    def _hold(self, seq: KVSequence, parked: ParkedKV) -> None:
        """Make `parked` the copy of `seq`, counted against the budget until restored or dropped."""
        self.forget(seq)
        seq.parked = parked
        key = id(seq)
        self._parked[key] = weakref.ref(seq, lambda _, key=key, owner=weakref.ref(self): _gone(owner, key))
        self._bytes.add(key, parked.kv.data_ptr(), self._held(parked.nbytes))

    def share(self, seq: KVSequence, twin: KVSequence) -> None:
        """Give a fork of parked `seq` a parked copy of its own: the same host tensor (read-only,
        its bytes counted once however many states hold it), or a hard link to the spill file;
        where the link cannot be made, the fork has none and recomputes."""
        parked = seq.parked
        if parked.kv is not None:
            self._hold(twin, dataclasses.replace(parked))  # the same tensor: no more bytes
            return
        path = self.spill_dir / f"{next(self._files):08d}.kv"
        try:
            os.link(parked.path, path)
        except OSError:
            return
        self._track_spill(twin, dataclasses.replace(parked, kv=None, path=path), self._spilled[id(seq)][1])

    def _spill(self, seq: KVSequence, parked: ParkedKV) -> bool:
        """Write a host copy to a spill file and make that `seq`'s parked copy. False (nothing
        changed) when the file cannot be written: a full or unwritable disk. A copy still in
        flight to the host is waited for first."""
        kv, recurrent = parked.host_copy()
        began = time.perf_counter()
        path = self.spill_dir / f"{next(self._files):08d}.kv"
        kv = kv.contiguous()
        tensors = {"kv": kv, **(file_tensors(recurrent) if recurrent is not None else {})}
        try:
            self.spill_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)  # (removed meanwhile: made again)
            save_private(tensors, path)  # owner-only, as a state file: it holds the state's KV
        except Exception as exc:  # noqa: BLE001 - a disk that takes no more: the copy is dropped, not the step
            logger.warning("cannot write a spill file in %s (%s)", self.spill_dir, exc)
            _remove(path)
            return False
        size = path.stat().st_size
        self.forget(seq)
        self._track_spill(seq, dataclasses.replace(parked, kv=None, path=path, size=size, copy=None,
                                                   digest=spill_digest(kv, recurrent), recurrent=None))
        c = self.counters
        c.spills += 1
        c.disk_bytes_moved += size
        c.disk_seconds += time.perf_counter() - began
        return True

    def _track_spill(self, seq: KVSequence, parked: ParkedKV, file: Path | None = None) -> None:
        seq.parked = parked
        key = id(seq)
        self._spilled[key] = (weakref.ref(seq, lambda _, p=parked.path, key=key, owner=weakref.ref(self):
                                          _gone(owner, key, p)), file or parked.path, parked.size)

    def forget(self, seq: KVSequence) -> None:
        """Drop `seq`'s parked copy, if any (its spill file too)."""
        parked, seq.parked = seq.parked, None
        self._parked.pop(id(seq), None)
        self._bytes.pop(id(seq))
        self._spilled.pop(id(seq), None)
        if parked is not None and parked.path is not None:
            _remove(parked.path)

    def _room(self, nbytes: int) -> bool:
        """Whether `nbytes` fit the host budget, after moving the oldest host copies to disk
        (or, without a spill folder, dropping them: those states recompute); the copy of a state
        being restored is not one of them."""
        if nbytes > self.budget_bytes:
            return False
        while self.bytes_used + nbytes > self.budget_bytes:
            key = next((key for key in self._parked if key != self._restoring), None)
            if key is None:
                return False
            seq = self._parked[key]()
            if seq is None:
                self._parked.pop(key)
                self._bytes.pop(key)
                continue
            if self.spill_dir is None or not self._spill(seq, seq.parked):
                self.forget(seq)  # those states recompute
                self.counters.dropped += 1
        return True

    def close(self) -> None:
        """Drop every parked copy, spill files included, and the cache (the engine closes; named
        states were written to `state_dir` before)."""
        for ref in [*self._parked.values(), *(ref for ref, _, _ in self._spilled.values())]:
            seq = ref()
            if seq is not None:
                self.forget(seq)
        self._parked.clear()
        self._bytes.clear()
        self._spilled.clear()
        self._copying.clear()
        if self.reserve is not None:
            self.reserve.close()
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
        self.cache = None

    def summary(self) -> dict:
        self._settle()
        c = self.counters
        return {"budget_bytes": self.budget_bytes, "bytes_used": self.bytes_used, "states": len(self._parked),
                "parks": c.parks, "resumes": c.resumes, "prefetches": c.prefetches, "dropped": c.dropped,
                "bytes_moved": c.bytes_moved,
                "seconds": round(c.seconds, 4), "tokens_restored": c.tokens_restored,
                "disk_states": len(self._spilled), "disk_bytes_used": self.disk_bytes_used, "spills": c.spills,
                "disk_resumes": c.disk_resumes, "disk_bytes_moved": c.disk_bytes_moved,
                "disk_seconds": round(c.disk_seconds, 4), "host_seconds": round(c.host_seconds, 4),
                "pinned_cold": self.reserve.cold if self.reserve is not None else 0,
                "host_phases": {name: round(seconds, 4) for name, seconds in self.phases.most_common()}}


def spill_digest(kv: torch.Tensor, recurrent: dict[str, torch.Tensor] | None = None) -> tuple:
    """What a spill file's KV (and a hybrid model's state beside it) is checked against when read
    back: dtype, shape and the CRC-32 of their bytes (zlib's, several GB/s: a fraction of the file
    write it guards)."""
    digest = ()
    for tensor in (kv, *(recurrent[name] for name in STATE_TENSORS if recurrent is not None)):
        tensor = tensor.contiguous()
        data = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
        digest += (str(tensor.dtype), tuple(tensor.shape), zlib.crc32(data))
    return digest



class _SharedBytes:
    """Bytes held by keys (id(seq)) whose copies may share a tensor (a fork and its parent): each
    tensor, by address, counted once, and the total kept as keys come and go, so that asking it
    costs nothing however many states are parked (the budget loop asks it once a copy moved)."""

    def __init__(self) -> None:
        self._of: dict[int, int] = {}                # key -> its tensor's address
        self._tensors: dict[int, list[int]] = {}     # address -> [keys holding it, bytes]
        self.total = 0

    def add(self, key: int, address: int, nbytes: int) -> None:
        self.pop(key)
        self._of[key] = address
        held = self._tensors.get(address)
        if held is None:
            self._tensors[address] = [1, nbytes]
            self.total += nbytes
        else:
            held[0] += 1

    def held_copies(self) -> dict[int, HeldCopy]:
        return {key: HeldCopy(self._tensors[address][1], self._tensors[address][0])
                for key, address in self._of.items()}

    @property
    def shared(self) -> int:
        """Bytes of the tensors more than one key holds, each once."""
        return sum(nbytes for holders, nbytes in self._tensors.values() if holders > 1)

    def pop(self, key: int) -> None:
        address = self._of.pop(key, None)
        if address is None:
            return
        held = self._tensors[address]
        held[0] -= 1
        if held[0] == 0:
            del self._tensors[address]
            self.total -= held[1]

    def clear(self) -> None:
        self._of.clear()
        self._tensors.clear()
        self.total = 0


def _gone(owner: "weakref.ref[HostTier]", key: int, path: Path | None = None) -> None:
    """A parked state's sequence was collected (its state closed): its copy is gone with it."""
    tier = owner()
    if tier is not None:
        tier._parked.pop(key, None)
        tier._bytes.pop(key)
        tier._spilled.pop(key, None)
    if path is not None:
        _remove(path)


def _remove(path: Path) -> None:
    """Delete a spill file that may be gone, or whose folder may be gone or no folder any more (a
    cleanup job, a disk turned read-only): the copy is dropped either way, and a file left behind
    must not fail the step, the close or the request that dropped it."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("cannot remove the spill file %s (%s); it is left behind", path, exc)


def default_host_budget() -> int:
    """Half the host memory available when the engine starts (4 GiB where unknown). Copies are
    made as states are parked, not reserved up front. A quarter of RAM capped at 16 GiB held 18 of
    64 agents' 8k-token states on a 128 GB machine; the rest were dropped and recomputed, so the
    tier cost more in copies than it saved."""
    available = _available_memory()
    return available // 2 if available else 4 << 30


def _available_memory() -> int | None:
    """Bytes of host memory available for new allocations: Linux's MemAvailable (free memory
    plus what the page cache gives back), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
