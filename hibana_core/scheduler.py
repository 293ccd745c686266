"""Continuous batching under a token budget.

The scheduler counts tokens, not phases (vLLM v1's design). Each request's state holds a history
of real tokens and the KV of its first `num_computed` positions; the request's target is its
history plus `num_output_placeholders`, the tokens sampled on the device and not yet read back.
Prefill chunks, prefix-cache hits, the recomputed last token and decode steps are all "catching
up" to that target; a request samples in the step whose chunk reaches it.

One step's bookkeeping happens at two points:
- `schedule` counts the chosen chunks' KV as computed and a placeholder per sampling request,
  so the next step can be scheduled before this one's tokens reach the host;
- `update_from_output` takes the tokens sampled for each request (any number: 0 for a prefill
  chunk, 1 for a decode, several once drafts are verified), appends them, checks stops per token,
  trims KV past the accepted tokens, and publishes blocks whose tokens are now final.

Admission runs up to `max_concurrent_agents`, in the order of `priority_strategy` (arrival,
priority or shortest first), and a request that waits past `queue_timeout_ms` fails alone with
QueueTimeoutError; eviction of idle states under memory pressure is a policy object of its own. The scheduler never detokenizes: a request's `stop_check` (set by the
output side) is asked about each token after the stop token ids.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

from hibana_core.config import SamplingParams, SchedulerConfig
from hibana_core.errors import GrammarError, HibanaError, MemoryBudgetError, QueueTimeoutError
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.policies import Eviction, StateUse
from hibana_core.kv.sequence import KVSequence, common_prefix_len
from hibana_core.speculation.drafters import SampledDraft, cut

logger = logging.getLogger("hibana.states")

if TYPE_CHECKING:
    import torch

    from hibana_core.grammar import Matcher
    from hibana_core.kv.tiers import HostTier
    from hibana_core.state import TokenLogprob
    from hibana_core.speculation.speculator import Speculator


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
    generator: Any = None                  # per-request torch.Generator (seeded sampling)
    stop_token_ids: frozenset[int] = frozenset()
    max_len: int = 0                       # the state may not grow past this many tokens
    stop_check: Callable[[int], bool] | None = None  # text stops, asked per token (output side)
    id: int = field(default_factory=lambda: next(_request_ids))
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    num_prompt: int = 0                    # len(seq) when submitted
    output: list[int] = field(default_factory=list)
    logprobs: "list[TokenLogprob]" = field(default_factory=list)  # per output token, where params ask
    computed: int = 0                      # prompt tokens whose KV this request computed
    reused: int = 0                        # prompt tokens whose KV it found already there (before any preemption)
    preemptions: int = 0                   # times it gave its KV back and waited again
    cancelled: bool = False
    num_output_placeholders: int = 0       # tokens sampled on the device, not yet read back
    suspect: bool = False                  # in a step that failed: runs alone until a step passes
    forced: Sequence[int] | None = None    # bench only: the tokens this request emits (trace replay)
    state_id: str = ""                     # the state it runs on, for logs
    grammar: "Matcher | None" = None       # its constraint (json_schema, regex, grammar), advanced per kept token
    queued_at: float = 0.0                 # time.monotonic() when it joined the queue
    front: bool = False                    # preempted, or admitted without room: first in line again
    started: bool = False                  # a chunk of it was scheduled: no queue timeout any more
    use: StateUse | None = None            # its state's use (the registry's): last used when the request ends
    snapshot_at: int = 0                   # a hybrid state's snapshot inside the prompt too (0: none)

    def __post_init__(self) -> None:
        self.num_prompt = len(self.seq)

    @property
    def samples(self) -> bool:
        return self.params is not None and self.params.max_tokens > 0

    @property
    def prompt(self) -> list[int]:
        """The history the request started from (what penalties count besides the output)."""
        return self.seq.tokens[: self.num_prompt]

    @property
    def num_tokens(self) -> int:
        """The length the state is catching up to: its history plus the tokens in flight (a sync's:
        `KVSequence.sync_length`)."""
        return (len(self.seq) if self.samples else self.seq.sync_length) + self.num_output_placeholders

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.seq.num_computed

    @property
    def num_to_compute(self) -> int:
        """`num_uncomputed` less the history a parked copy of the state's KV holds: admission
        copies that back instead of computing it, so a parked state's turn is as short as a
        resident one's (what "shortest_first" orders by)."""
        parked = self.seq.parked
        restorable = common_prefix_len(self.seq.tokens, parked.tokens) if parked is not None else 0
        return self.num_tokens - max(self.seq.num_computed, restorable)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int        # first position computed in this step
    num_tokens: int   # drafts included
    sample: bool      # the chunk reaches the end of the target and the request samples
    draft_token_ids: tuple[int, ...] = ()
    """Drafted tokens after the history, verified in this step (the chunk's last inputs)."""
    draft_probs: "torch.Tensor | None" = None
    """The drafter's distributions at the drafts ([k, V] on the device: a `SampledDraft`'s), or
    None for token ids alone, which the target keeps where its own draw equals them."""
    drafts_drawn: bool = False
    """Whether the drafts were drawn from `draft_probs` (kept at min(1, p/q)), not chosen."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    num_tokens: int

    @property
    def sampling(self) -> list[ScheduledChunk]:
        """The chunks that sample, in the order of the sampled rows."""
        return [c for c in self.chunks if c.sample]

    @property
    def verifies(self) -> bool:
        """Whether the step verifies drafts: its tokens are read back before the next step is
        scheduled, and a hybrid model's states take in the kept ones after sampling."""
        return any(c.draft_token_ids for c in self.chunks)


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced: the token ids sampled for each chunk, in chunk order (an empty
    list for a chunk that does not sample; several where drafts were verified)."""

    sampled_token_ids: list[list[int]]
    logprobs: "list[list[TokenLogprob]] | None" = None
    """Per chunk, the log-probabilities of its sampled tokens where its request asked for them."""
    draft_estimates: "list[tuple[float, float] | None] | None" = None
    """Per chunk whose drafts came with q: what drawing and choosing keep at its first draft
    (`Sampler.draft_estimates`)."""


@dataclass(frozen=True)
class RequestOutput:
    """What `update_from_output` accepted for one request."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: "Sequence[TokenLogprob]" = ()   # one per new token, when the request asked for them


def _done_reason(request: Request) -> str:
    """How a request that samples nothing ends once its state holds its tokens."""
    return "synced" if request.params is None else "length"


class EvictionPolicy(Protocol):
    tier: "HostTier | None"  # where evicted KV is parked, and restored from at admission

    def plan(self, num_blocks: int) -> "list[Eviction]":
        """Which idle states would leave the device, and where, for `num_blocks` (nothing moves)."""

    def make_room(self, num_blocks: int, partial: bool = True) -> bool:
        """Carry out `plan(num_blocks)`; whether `num_blocks` can now be allocated. With
        `partial` False nothing moves unless the plan frees all of it."""

    def evict(self, seq: KVSequence) -> None:
        """Free one sequence's device blocks (parked or released)."""


class IdleLRUEviction:
    """Makes room on the device from idle states' KV, in the retention order (the policy's,
    refined by priorities and pins): first a plan (`plan`: which states leave and where), then
    the moves. A state leaves for the host tier when it takes the copy, for disk past it (with a
    state_dir), else its KV is released. Tokens stay, and released full blocks stay findable in
    the prefix index until reused, so even a released state often recomputes little."""

    def __init__(self, pool: BlockPool, idle_states: Callable[[], Iterable[KVSequence]],
                 tier: "HostTier | None" = None) -> None:
        self.pool, self.idle_states, self.tier = pool, idle_states, tier

    def plan(self, num_blocks: int) -> list[Eviction]:
        """The fewest idle states, from the front of the retention order, whose leaving lets
        `num_blocks` be allocated (all of them when that is not enough), each with where it
        goes. A block shared with a state that stays is not counted as freed. Nothing moves."""
        return self._plan(num_blocks)[0]

    def _plan(self, num_blocks: int) -> tuple[list[Eviction], bool]:
        """`plan`, and whether it frees enough."""
        short = num_blocks - self.pool.num_free
        plan: list[Eviction] = []
        holders: collections.Counter[int] = collections.Counter()
        for seq in self.idle_states():
            if short <= 0:
                break
            plan.append(self._move(seq))
            for block in seq.held_blocks():
                holders[block] += 1
                short -= holders[block] == self.pool.ref_count(block)
        return plan, short <= 0

    def make_room(self, num_blocks: int, partial: bool = True) -> bool:
        """`partial` False: a restore's room, all of it or no move (parking every idle state
        for a restore that still cannot run only sends them after it, to be copied back later)."""
        plan, enough = self._plan(num_blocks)
        if not enough and not partial:
            return False
        for move in plan:
            self.carry_out(move)
        return self.pool.can_allocate(num_blocks)

    def evict(self, seq: KVSequence) -> None:
        """Free one sequence's device blocks (preemption), parked where the tier takes it."""
        self.carry_out(self._move(seq))

    def _move(self, seq: KVSequence) -> Eviction:
        """Where `seq`'s KV goes when it leaves the device."""
        return Eviction(seq, self.tier.destination(seq) if self.tier is not None else "drop")

    def carry_out(self, move: Eviction) -> None:
        """One move of a plan. A step in flight that still writes the state's KV comes first in
        stream order, on the device as before any later reuse of the blocks."""
        if move.to != "drop" and self.tier.park(move.seq):
            return
        logger.info("evicting an idle state's KV (%d blocks, %d tokens)", move.seq.num_blocks, len(move.seq))
        move.seq.release()


def _to_share_stride(seq: KVSequence, num: int) -> int:
    """A hybrid state's prompt chunk of `num` tokens, cut at the next multiple of the share
    stride within its known history (where its state is published, `KVSequence.publish_state`)."""
    start, stride = seq.num_computed, seq.recurrent.slots.stride
    boundary = (start // stride + 1) * stride
    return boundary - start if start + num > boundary and boundary <= len(seq.tokens) else num


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, eviction: EvictionPolicy,
                 speculation: "Speculator | None" = None) -> None:
        self.config, self.pool, self.eviction = config, pool, eviction
        self.speculation = speculation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished: list[Request] = []  # finished since the last `take_finished`
        self.pool_limited = 0  # requests ended "length" because their history outgrew the device pool

    def add(self, request: Request) -> None:
        request.queued_at = time.monotonic()
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> Iterable[Request]:
        return itertools.chain(self.running, self.waiting)

    def busy(self, seq: KVSequence) -> bool:
        return any(r.seq is seq for r in self.requests())

    # --- schedule -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Running requests first (decodes before prefill chunks, so chunking keeps decodes
        flowing), then admit waiting ones in FIFO order while budget and blocks last."""
        self._drop_cancelled()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        suspects = [r for r in self.running if r.suspect]
        if suspects:  # a step failed with several requests: find the one that fails it
            chunk = self._schedule_one(suspects[0], budget)
            if chunk is not None:
                self._expire_waiting()  # no admission on this path: the waiting may still time out
                return self._scheduled([chunk])
        for request in sorted(self.running, key=lambda r: r.num_uncomputed > 1):
            if budget == 0:
                break
            chunk = self._schedule_one(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_concurrent_agents:
            request = self._next_waiting()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if not self._admit(request):
                self._requeue(request)  # its parked KV waits for room: running requests make it
                break
            if request.finished:
                continue
            chunk = self._schedule_one(request, budget)
            if chunk is None and not request.finished:
                self._requeue(request)  # no room yet: it keeps its place at the head of the queue
                break
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        # after admission: a request that could run now is admitted, whatever the step loop's delay;
        # only one still waiting for a slot or for room has waited too long
        self._expire_waiting()
        if not chunks and self.has_work() and not self._awaiting_update():
            self._preempt_or_fail()
        if self.speculation is not None and chunks and budget > 0:
            # the rows that sample (each draft is one) stay within what the workspace was sized for
            slots = self.config.max_concurrent_agents
            rows = slots + self.speculation.default.draft_rows(slots)
            budget = min(budget, rows - sum(c.sample for c in chunks))
            if budget > 0:
                chunks = self._add_drafts(chunks, budget)
        return self._scheduled(chunks)

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> list[ScheduledChunk]:
        """Chunks that sample at the end of a known history may verify drafts too: as many as
        the speculation policy picks, the budget, the KV pool, max_tokens and the context allow
        (drafts never evict anything)."""
        def room(chunk: ScheduledChunk, k: int) -> int:
            request, seq = chunk.request, chunk.request.seq
            k = min(k, budget, request.params.max_tokens - len(request.output) - 1,
                    request.max_len - len(seq) - 1, seq.rotation_room(chunk.start + chunk.num_tokens))
            while k > 0 and not self.pool.can_allocate(seq.blocks_needed(chunk.num_tokens + k)):
                k -= 1
            return k

        step_tokens = sum(c.num_tokens for c in chunks)
        drafts = self.speculation.draft(chunks, step_tokens, room)
        for i, draft in sorted(drafts.items()):
            chunk = chunks[i]
            draft = cut(draft, room(chunk, min(len(draft), budget)))  # earlier chunks took their share
            if draft:
                chunk.request.seq.prepare_write(chunk.num_tokens + len(draft))
                with_q = isinstance(draft, SampledDraft)
                chunks[i] = ScheduledChunk(chunk.request, chunk.start, chunk.num_tokens + len(draft), True,
                                           tuple(draft.tokens if with_q else draft), draft.probs if with_q else None,
                                           with_q and draft.drawn)
                budget -= len(draft)
        return chunks

    @staticmethod
    def _scheduled(chunks: list[ScheduledChunk]) -> SchedulerOutput:
        out = SchedulerOutput(tuple(chunks), sum(c.num_tokens for c in chunks))
        writes_state = not out.verifies  # (a verify step's states take in the kept tokens after sampling)
        for chunk in chunks:  # the chunks' KV counts as written from here (see `fail`)
            chunk.request.seq.mark_computed(chunk.num_tokens, writes_state)
            chunk.request.num_output_placeholders += chunk.sample
        return out

    def _awaiting_update(self) -> bool:
        """Whether a step in flight will move a running request on (a token to read back, or
        the last chunk of a sync): then an empty schedule is no reason to preempt."""
        return any(r.num_output_placeholders or r.num_uncomputed == 0 for r in self.running)

    def _requeue(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.front = True
        self.waiting.appendleft(request)

    def _next_waiting(self) -> Request:
        """Take the waiting request to admit next: those back in line (`front`) first, then by
        the strategy; arrival order breaks ties (the queue is in arrival order, `min` is stable)."""
        strategy = self.config.priority_strategy
        if strategy == "fifo":
            request = self.waiting[0]
        elif strategy == "priority":
            request = min(self.waiting, key=lambda r: (not r.front, -(r.params.priority if r.params else 0)))
        else:  # shortest_first
            request = min(self.waiting, key=lambda r: (not r.front, r.num_to_compute))
        self.waiting.remove(request)
        return request

    def _expire_waiting(self) -> None:
        """Fail the requests that waited for admission longer than `queue_timeout_ms`."""
        timeout = self.config.queue_timeout_ms
        if timeout is None or not self.waiting:
            return
        now = time.monotonic()
        for request in [r for r in self.waiting if not r.started and now - r.queued_at > timeout / 1e3]:
            waited = now - request.queued_at
            request.error = QueueTimeoutError(
                f"the request waited {waited:.2f} s for admission, past queue_timeout_ms={timeout:g} "
                f"({len(self.running)} running of max_concurrent_agents={self.config.max_concurrent_agents}, "
                f"{len(self.waiting)} waiting); call again, raise queue_timeout_ms or max_concurrent_agents")
            logger.info("queue timeout after %.2f s (state %r)", waited, request.state_id)
            self.finish(request, "error")

    def _admit(self, request: Request) -> bool:
        """A parked state's KV comes back from the host tier first: when the device has no room
        for it while other requests run, or queued ones hold resident KV (idle, for all the room
        they take: `_preempt_or_fail` evicts it), False (the request waits for that room, rather
        than recompute a history it has a copy of). A sampling request needs the
        logits of its last token: if the state already holds its KV (a fully synced state),
        recompute that one token. Where the prefix index holds more of
        the history than the state's own KV, the state switches to the index's blocks."""
        seq = request.seq
        if self.eviction.tier is not None and seq.parked is not None:
            self.eviction.tier.restore(seq, lambda blocks: self.eviction.make_room(blocks, partial=False))
            if seq.parked is not None and not seq.num_computed and (
                    len(self.running) > 1 or any(r.seq.num_blocks for r in self.waiting)):
                return False  # the copy stayed parked for want of room
        if request.samples and seq.num_uncomputed == 0:
            seq.trim_kv(len(seq) - 1)
        seq.prefer_index(len(seq) - (1 if request.samples else 0))
        if not request.preemptions:  # after one, what is there is what the request computed itself
            request.reused = min(seq.num_computed, request.num_prompt)
        if not request.samples and request.num_uncomputed <= 0:
            self.finish(request, _done_reason(request))
        return True

    def _schedule_one(self, request: Request, budget: int) -> ScheduledChunk | None:
        seq = request.seq
        if request.num_output_placeholders:
            if (len(request.output) + request.num_output_placeholders >= request.params.max_tokens
                    or request.num_tokens >= request.max_len):
                return None  # its token in flight is its last: it finishes when that is read back
        elif request.num_uncomputed <= 0:
            return None  # a sync whose last chunk is in flight: it finishes at that step's update
        if seq.rotate_for(request.num_tokens) and seq.parked is not None:  # LongRoPE: past its switch
            self.eviction.tier.forget(seq)  # the whole history is recomputed; a parked copy is of the old one
        before = seq.num_computed
        if seq.recurrent is not None and not self.recurrent_slot(seq):
            return None  # every slot is a running state's: it waits (or is preempted)
        gained = seq.reuse_cached_blocks(request.num_tokens - (1 if request.samples else 0))
        if request.num_uncomputed <= 0:  # a sync fully served from the prefix index
            self._count_reused(request, gained)
            self.finish(request, _done_reason(request))
            return None
        num = min(request.num_uncomputed, budget, self.config.max_prefill_chunk)
        if seq.recurrent is not None and seq.share:  # a prompt's chunks end where its states are published
            num = _to_share_stride(seq, num)
        if seq.recurrent is not None and seq.num_computed < request.snapshot_at < seq.num_computed + num:
            num = request.snapshot_at - seq.num_computed  # and where it keeps a snapshot (`keep_prompt_state`)
        needed = seq.blocks_needed(num)
        if not self.pool.can_allocate(needed) and not self.eviction.make_room(needed):
            num = self._chunk_that_fits(seq, num)
            if not num:
                seq.trim_kv(before)  # give adopted blocks back: holding them would starve the others
                return None
        self._count_reused(request, gained)
        request.started = True
        start = seq.num_computed
        seq.prepare_write(num)
        request.computed += max(0, min(start + num, request.num_prompt) - start)
        sample = start + num == request.num_tokens and request.samples
        return ScheduledChunk(request, start, num, sample)

    def recurrent_slot(self, seq: KVSequence) -> bool:
        """A hybrid model's state computes in a slot of the recurrent cache. Where none is free,
        idle states give theirs back in the retention order: their snapshots first, then the
        published states of shared prefixes (least recently used first), then whole states
        (evicted: parked with their state, or dropped and recomputed when their agents return)."""
        idle = [s for s in getattr(self.eviction, "idle_states", lambda: ())() if s.recurrent is not None]
        for victim in idle:
            if seq.recurrent.ensure_slot():
                return True
            victim.recurrent.drop_snapshots()
        while not seq.recurrent.ensure_slot():
            if not seq.recurrent.slots.unpublish_oldest():
                break
        for victim in idle:
            if seq.recurrent.ensure_slot():
                return True
            if victim.recurrent.num_slots:
                self.eviction.evict(victim)
        return seq.recurrent.ensure_slot()

    def _chunk_that_fits(self, seq: KVSequence, num: int) -> int:
        """The longest chunk shorter than `num` whose blocks the pool has, for a sequence over
        sliding windows (0 for any other): its KV need is bounded by its windows and the chunk,
        so smaller chunks make progress where the whole one would not fit. A sequence of full
        attention needs all its blocks in the end: it waits (or is preempted) instead."""
        if not seq.windowed:
            return 0
        low, high = 0, num - 1  # blocks_needed grows with the chunk: the last n that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self.pool.can_allocate(seq.blocks_needed(mid)):
                low = mid
            else:
                high = mid - 1
        return low

    @staticmethod
    def _count_reused(request: Request, gained: int) -> None:
        """Prompt tokens a request found in the prefix index: before a preemption only (after,
        the index gives back what the request itself computed), never more than its prompt."""
        if not request.preemptions:
            request.reused = min(request.reused + gained, request.num_prompt)

    def _preempt_or_fail(self) -> None:
        """Nothing fits: the newest running request gives its KV back and waits (parked in the
        host tier when there is one, so it resumes without recomputing; otherwise it recomputes
        later, often from its blocks still in the prefix index). A request that cannot fit even
        alone ends: with finish reason "length" and its output where it has generated some (the
        pool is then its context limit; `pool_limited` counts them), else it fails."""
        if len(self.running) > 1:
            victim = self.running[-1]
            self.eviction.evict(victim.seq)
            victim.preemptions += 1
            self._requeue(victim)
            return
        # with nothing running, the head of the queue is the request that found no room: parking
        # its own KV frees nothing for it (its restore brings the same blocks back), so it fails
        stuck = None if self.running else self.waiting[0]
        holders = [r for r in self.waiting if r.seq.num_blocks and r is not stuck]
        if holders:  # a queued request's resident KV goes first: it is not running anyway
            self.eviction.evict(holders[-1].seq)
            return
        victim = self.running[-1] if self.running else self.waiting[0]
        if victim.output:
            # its own history outgrew the pool while it generated: it ends as at the context
            # limit, with what it generated (the state holds it), rather than failing and losing it
            self.pool_limited += 1
            self.finish(victim, "length")
            return
        pool = self.pool.num_blocks if victim.seq.layout is None else victim.seq.layout.counted(self.pool.num_blocks)
        victim.error = MemoryBudgetError(
            f"a history of {len(victim.seq)} tokens needs more KV blocks than the pool's {pool} blocks of "
            f"{self.pool.block_size} tokens can give it; raise memory_budget "
            "or kv_device_blocks, shorten the history (h.truncate(n)), or close or unpin the "
            "states pinned to the device")
        self.finish(victim, "error")

    # --- update ---------------------------------------------------------------------------------

    def update_from_output(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[RequestOutput]:
        """Take a step's sampled tokens: per request, append them one by one and stop at the first
        that ends the request (stop token, `stop_check`, max_tokens, context limit); KV computed
        past the tokens kept is dropped; full blocks whose tokens are now known are published.
        A request that finished while the step ran (cancelled, stopped a step earlier) takes
        nothing."""
        results = []
        logprobs = output.logprobs or [()] * len(scheduled.chunks)
        estimates = output.draft_estimates or [None] * len(scheduled.chunks)
        for chunk, sampled, sampled_logprobs, estimate in zip(scheduled.chunks, output.sampled_token_ids, logprobs,
                                                              estimates, strict=True):
            request, seq = chunk.request, chunk.request.seq
            if request.finished:
                continue
            request.num_output_placeholders -= chunk.sample
            request.suspect = False
            history = len(seq)
            accepted, reason = self._accept(request, sampled)
            if chunk.draft_token_ids:  # KV of rejected drafts goes: the last accepted token is
                seq.trim_kv(min(chunk.end, len(seq) - 1))  # the next input, as after any decode
                # and the windows hold what one token a step would have left them (its last write
                # freed the blocks no query from the token before the next input reads)
                seq.free_outside_windows(max(seq.num_computed - 1, 0))
                if self.speculation is not None:
                    self.speculation.verified(chunk, sampled, len(accepted), estimate)
            elif chunk.end > history:  # inputs past the known history are not known to be kept
                seq.trim_kv(history)
            seq.commit_full_blocks()
            if chunk.sample:
                kept = list(sampled_logprobs[:len(accepted)])
                request.logprobs.extend(kept)
                results.append(RequestOutput(request, accepted, kept))
            if reason is not None:
                self.finish(request, reason)
            elif not request.samples and request.num_uncomputed <= 0:
                self.finish(request, _done_reason(request))
        return results

    def _accept(self, request: Request, sampled: Sequence[int]) -> tuple[list[int], str | None]:
        """Append tokens until one ends the request; returns those kept and the finish reason.
        A constrained request's matcher takes each token; its grammar ending stops the request."""
        accepted: list[int] = []
        for token in sampled:
            if request.grammar is not None and not request.grammar.accept(token):
                # a stop token is allowed only where the grammar is complete: one the grammar needs
                # as text leaves it nothing to continue with (the mask allows it there alone)
                stops = request.params.stop_token_ids
                rule = f"({list(stops)[:8]}: a stop token ends a constrained output only where its grammar is complete)"
                if token in stops:
                    request.error = GrammarError(
                        f"the grammar needs the stop token {token} as text here (it cannot be completed without "
                        f"it, and a stop would end the output short of a whole match); take it out of "
                        f"stop_token_ids {rule}")
                    return accepted, "error"
                hint = f", or take the tokens it needs out of stop_token_ids {rule}" if stops else ""
                request.error = GrammarError(
                    f"the model's token {token} does not continue the request's grammar (a grammar the "
                    f"vocabulary cannot complete from here); loosen the schema or grammar{hint}")
                return accepted, "error"
            request.seq.append([token])
            request.output.append(token)
            accepted.append(token)
            if request.grammar is not None and request.grammar.done and request.grammar.last_resort(token):
                return accepted, "stop"  # an ignore_eos grammar's end: a stop token, not text
            try:
                stopped = token in request.stop_token_ids or (request.stop_check is not None
                                                              and request.stop_check(token))
            except HibanaError as exc:  # a tokenizer that cannot decode the token (`Detokenizer.add`):
                request.error = exc     # this request fails alone (raised out of the step, it failed them all)
                return accepted, "error"
            if stopped:
                return accepted, "stop"
            if request.grammar is not None and request.grammar.done:
                return accepted, "stop"
            if len(request.output) >= request.params.max_tokens or len(request.seq) >= request.max_len:
                return accepted, "length"
        return accepted, None

    def fail(self, scheduled: SchedulerOutput, error: BaseException) -> None:
        """The step failed. Its requests give back the KV it was to write (what they had stays
        valid). A request alone in its step fails; several run again one at a time (`suspect`)
        until the one that makes the step fail is found, and the others go on."""
        live = [c for c in scheduled.chunks if not c.request.finished]
        self._give_back(scheduled)
        for chunk in live:
            chunk.request.suspect = len(live) > 1
        if len(live) == 1:
            live[0].request.error = error
            self.finish(live[0].request, "error")

    def revert(self, scheduled: SchedulerOutput) -> None:
        """A step that will not run, or ran on wrong inputs: its requests give back the KV it was
        to write and its placeholders, and are scheduled again (nobody is blamed). Any order of
        reverting overlapping steps gives the same state (KV is kept up to the earliest start).
        What speculation recorded of the step's drafts stays (statistics only)."""
        self._give_back(scheduled)

    @staticmethod
    def _give_back(scheduled: SchedulerOutput) -> None:
        for chunk in scheduled.chunks:
            request = chunk.request
            if request.finished:
                continue
            request.num_output_placeholders -= chunk.sample
            request.seq.trim_kv(chunk.start)
            request.computed -= max(0, min(chunk.end, request.num_prompt) - chunk.start)

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.requests() if r.cancelled]:
            self.finish(request, "cancelled")

    def finish(self, request: Request, reason: str) -> None:
        """The request leaves the scheduler. Tokens still in flight are dropped with their
        placeholders (a step already launched may still write their KV: stream order keeps that
        write before any later step's); the state keeps the KV of its history and publishes its
        full blocks."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.num_output_placeholders = 0
        request.seq.trim_kv(len(request.seq))
        request.seq.commit_full_blocks()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.use is not None:  # a long generation used its state until now, not only at its call
            request.use.last_use = time.monotonic()
        self._finished.append(request)
        if self.speculation is not None:
            self.speculation.finished(request)

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call, in the order they finished."""
        finished, self._finished = self._finished, []
        return finished

    def abort_all(self, error: BaseException) -> None:
        for request in list(self.requests()):
            request.error = error
            self.finish(request, "error")
