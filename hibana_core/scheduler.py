"""Continuous batching under a token budget.

The scheduler counts tokens, not phases: every request's state has `num_computed` tokens of KV and
a history of `len(tokens)`; prefill chunks, prefix-cache hits, the recomputed last token and decode
steps are all "catching up" to that length (vLLM v1's design). A request samples in the step whose
chunk reaches the end of the history. Admission is FIFO up to `max_concurrent_agents`; eviction of
idle states under memory pressure is a policy object of its own.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from hibana_core.config import SamplingParams, SchedulerConfig
from hibana_core.detokenizer import Detokenizer
from hibana_core.errors import MemoryBudgetError
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.sequence import PENDING, KVSequence


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_request_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One sync or generate call against a state."""

    seq: KVSequence
    params: SamplingParams | None          # None: make the state hold its tokens, sample nothing
    on_event: Callable[["Request", int | None], None]  # (request, token or None when finished)
    detokenizer: Detokenizer | None = None
    generator: Any = None
    stop_token_ids: frozenset[int] = frozenset()
    max_len: int = 0                        # the state may not grow past this many tokens
    id: int = field(default_factory=lambda: next(_request_ids))
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    num_prompt: int = 0                     # len(seq) when submitted
    output: list[int] = field(default_factory=list)
    computed: int = 0                       # prompt tokens whose KV this request computed
    reused: int = 0                         # prompt tokens whose KV it found already there
    cancelled: bool = False
    pending: tuple[int, int] | None = None  # (position, row) of a token still on the device

    def __post_init__(self) -> None:
        self.num_prompt = len(self.seq)

    @property
    def samples(self) -> bool:
        return self.params is not None and self.params.max_tokens > 0

    @property
    def history(self) -> list[int]:
        return self.seq.tokens[: self.num_prompt]


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int        # first position computed in this step
    num_tokens: int
    sample: bool      # the chunk reaches the end of the history and the request samples


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    num_tokens: int


class EvictionPolicy(Protocol):
    def make_room(self, num_blocks: int) -> bool:
        """Free KV of idle states until `num_blocks` can be allocated; False if impossible."""


class IdleLRUEviction:
    """Releases the KV of idle states, least recently used first. Their tokens stay, and their full
    blocks stay findable in the prefix index until reused, so a resumed state often recomputes
    nothing. (The memory-manager issue adds host and disk tiers in front of this.)"""

    def __init__(self, pool: BlockPool, idle_states: Callable[[], Iterable[KVSequence]]) -> None:
        self.pool, self.idle_states = pool, idle_states

    def make_room(self, num_blocks: int) -> bool:
        for seq in self.idle_states():
            if self.pool.can_allocate(num_blocks):
                break
            seq.release()
        return self.pool.can_allocate(num_blocks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, eviction: EvictionPolicy) -> None:
        self.config, self.pool, self.eviction = config, pool, eviction
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def busy(self, seq: KVSequence) -> bool:
        return any(r.seq is seq for r in itertools.chain(self.running, self.waiting))

    def schedule(self) -> SchedulerOutput:
        """Running requests first (decodes before prefill chunks, so chunking keeps decodes
        flowing), then admit waiting ones in FIFO order while budget and blocks last."""
        self._drop_cancelled()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for request in sorted(self.running, key=lambda r: r.seq.num_uncomputed > 1):
            if budget == 0:
                break
            chunk = self._schedule_one(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_concurrent_agents:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._prepare(request)
            if request.status is not RequestStatus.RUNNING:
                continue
            chunk = self._schedule_one(request, budget)
            if chunk is None and request.status is RequestStatus.RUNNING:
                self._requeue(request)  # no room yet: it keeps its place at the head of the queue
                break
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        if not chunks and (self.running or self.waiting) and not self._any_pending():
            self._preempt_or_fail()
        return SchedulerOutput(tuple(chunks), sum(c.num_tokens for c in chunks))

    def _requeue(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _prepare(self, request: Request) -> None:
        """A sampling request needs the logits of its last token: if the state already holds its
        KV (a fully synced state), recompute that one token."""
        seq = request.seq
        if request.samples and seq.num_uncomputed == 0:
            last = seq.tokens[-1]
            seq.trim(len(seq) - 1)
            seq.append([last])
        request.reused = min(seq.num_computed, request.num_prompt)
        if not request.samples and seq.num_uncomputed == 0:
            self.finish(request, "length" if request.params is not None else "synced")

    def _any_pending(self) -> bool:
        return any(r.pending is not None for r in self.running)

    def _schedule_one(self, request: Request, budget: int) -> ScheduledChunk | None:
        seq = request.seq
        if request.pending is not None and (len(request.output) + 1 >= request.params.max_tokens
                                            or len(seq) >= request.max_len):
            return None  # its token in flight is its last: it finishes when that is read back
        before = seq.num_computed
        gained = seq.reuse_cached_blocks(len(seq) - (1 if request.samples else 0))
        if seq.num_uncomputed == 0:  # a sync fully served from the prefix index
            request.reused += gained
            self.finish(request, "synced")
            return None
        num = min(seq.num_uncomputed, budget, self.config.max_prefill_chunk)
        needed = seq.blocks_needed(num)
        if not self.pool.can_allocate(needed) and not self.eviction.make_room(needed):
            seq.trim_kv(before)  # give adopted blocks back: holding them would starve the others
            return None
        request.reused += gained
        start = seq.num_computed
        seq.prepare_write(num)
        sample = start + num == len(seq) and request.samples
        return ScheduledChunk(request, start, num, sample)

    def _preempt_or_fail(self) -> None:
        """Nothing fits: the newest running request gives its KV back and waits (it recomputes
        later, often from its blocks still in the prefix index); a request that cannot fit even
        alone fails."""
        if len(self.running) > 1:
            victim = self.running[-1]
            victim.seq.release()
            self._requeue(victim)
            return
        holders = [r for r in self.waiting if r.seq.block_ids]
        if holders:  # a queued request's resident KV goes first: it is not running anyway
            holders[-1].seq.release()
            return
        victim = self.running[-1] if self.running else self.waiting[0]
        victim.error = MemoryBudgetError(
            f"a history of {len(victim.seq)} tokens needs more KV blocks than the pool has "
            f"({self.pool.num_blocks} blocks of {self.pool.block_size}); raise memory_budget_bytes "
            "or num_blocks, or close idle states")
        self.finish(victim, "error")

    def update(self, output: SchedulerOutput, sampled: list[int]) -> None:
        """Both halves of a step's bookkeeping, for a step whose tokens are already known."""
        self.advance(output)
        self.finalize(output, sampled)

    def advance(self, output: SchedulerOutput) -> None:
        """The half of a step's bookkeeping that needs no sampled values, done as soon as the step
        is launched: the chunks' KV counts as written, and each request that samples holds a
        `PENDING` placeholder at its next position. The next step can then be scheduled and
        launched before this one's tokens reach the host (they reach its inputs on the device)."""
        row = 0
        for chunk in output.chunks:
            request, seq = chunk.request, chunk.request.seq
            seq.advance(chunk.num_tokens)
            request.computed += max(0, min(chunk.start + chunk.num_tokens, request.num_prompt) - chunk.start)
            if chunk.sample:
                if request.status is RequestStatus.RUNNING:
                    request.pending = (len(seq), row)
                    seq.append([PENDING])
                row += 1
            elif (request.status is RequestStatus.RUNNING and not request.samples
                  and seq.num_uncomputed == 0):
                self.finish(request, "synced")

    def finalize(self, output: SchedulerOutput, sampled: list[int]) -> None:
        """The other half, once the step's tokens are on the host: each takes its placeholder's
        place and goes out; stop conditions finish requests. A request that finished meanwhile
        (cancelled; or stopped, with this step computing one row past its end) drops its token."""
        for chunk, token in self._pair(output, sampled):
            request = chunk.request
            if token is None or request.pending is None or request.status is RequestStatus.FINISHED:
                continue
            position, _ = request.pending
            request.pending = None
            request.seq.tokens[position] = token
            self._accept_token(request, token)

    def fail(self, output: SchedulerOutput, error: BaseException) -> None:
        """The step's forward failed: its requests fail, and their states drop the blocks that
        were prepared for this step (the KV they had stays valid)."""
        for chunk in output.chunks:
            seq = chunk.request.seq
            seq.trim(len(seq))
            chunk.request.error = error
            self.finish(chunk.request, "error")

    @staticmethod
    def _pair(output: SchedulerOutput, sampled: list[int]):
        tokens = iter(sampled)
        for chunk in output.chunks:
            yield chunk, (next(tokens) if chunk.sample else None)

    def _accept_token(self, request: Request, token: int) -> None:
        params = request.params
        request.output.append(token)
        stopped_by_token = token in request.stop_token_ids
        stopped_by_text = (not stopped_by_token and request.detokenizer is not None
                           and request.detokenizer.add(token))
        request.on_event(request, token)
        if stopped_by_token or stopped_by_text:
            self.finish(request, "stop")
        elif len(request.output) >= params.max_tokens or len(request.seq) >= request.max_len:
            self.finish(request, "length")

    def _drop_cancelled(self) -> None:
        for request in [r for r in itertools.chain(self.running, self.waiting) if r.cancelled]:
            self.finish(request, "cancelled")

    def finish(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.pending is not None:  # its token in flight is dropped with its placeholder
            request.seq.trim(request.pending[0])
            request.pending = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.on_event(request, None)

    def abort_all(self, error: BaseException) -> None:
        for request in list(itertools.chain(self.running, self.waiting)):
            request.error = error
            self.finish(request, "error")
