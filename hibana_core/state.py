"""The stable public API of agent state: StateHandle, SyncStats, Completion (see DESIGN.md).

A handle is a thin, thread-safe front for one `KVSequence` inside its engine; every call goes
through the engine, which serialises edits with its step loop.
"""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Sequence

from hibana_core.config import SamplingParams

UNNAMED_PREFIX = "auto-"
"""Ids of the states `Engine.lease` makes for calls that name none start with this."""

if TYPE_CHECKING:
    from hibana_core.engine import Engine
    from hibana_core.kv.sequence import KVSequence
    from hibana_core.scheduler import Request


@dataclass(frozen=True)
class SyncStats:
    """What a sync cost: tokens whose KV was already there, and tokens computed."""

    reused: int
    computed: int


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    reused: int           # prompt tokens served from resident or shared KV
    computed: int         # prompt tokens this request computed
    generated: int
    time_to_first_token: float | None
    elapsed: float


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    finish_reason: str    # "stop" (stop token or string), "length", "cancelled"
    text: str             # decoded output, cut before a stop string ("" without a tokenizer)
    stats: RequestStats


@dataclass(frozen=True)
class StreamEvent:
    """One streamed token (text may be "" while characters are incomplete or held back), or the
    final event, which has token_id None, the finish reason and the completion."""

    token_id: int | None
    text: str
    finish_reason: str | None = None
    completion: Completion | None = None


@dataclass(frozen=True)
class StateInfo:
    id: str
    tokens: int
    computed: int         # tokens whose KV is resident
    blocks: int
    tier: str             # "device" while KV is resident, "none" once released
    last_use: float
    busy: bool


class RequestStream:
    """Events of one request, from the engine thread to the caller (a thread or an event loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()

    def put(self, item: object) -> bool:
        """Hand an event over; False when nobody can receive it any more (the caller's event
        loop is closed), so the engine cancels the request instead of failing its own thread."""
        if self._loop is None:
            self._queue.put(item)
            return True
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    def get(self) -> object:
        return self._queue.get()

    async def aget(self) -> object:
        return await self._queue.get()


class StateHandle:
    """One agent's resident state: its token history and the KV cache behind it."""

    def __init__(self, engine: "Engine", state_id: str, seq: "KVSequence") -> None:
        self._engine = engine
        self._id = state_id
        self._seq = seq
        self.closed = False
        self.last_use = 0.0

    @property
    def id(self) -> str:
        return self._id

    @property
    def engine(self) -> "Engine":
        return self._engine

    @property
    def tokens(self) -> list[int]:
        """A copy of the token ids the state holds."""
        with self._engine._lock:
            return self._seq.history

    def __len__(self) -> int:
        return self._seq.history_len

    def __repr__(self) -> str:
        return f"StateHandle(id={self._id!r}, tokens={len(self)}, closed={self.closed})"

    def sync(self, token_ids: Sequence[int]) -> SyncStats:
        """Hold exactly token_ids: keep the longest common prefix (own or shared blocks), drop the
        rest, prefill the remainder."""
        return self._engine._sync(self, token_ids)

    def append(self, token_ids: Sequence[int]) -> SyncStats:
        return self._engine._sync(self, token_ids, append=True)

    def generate(self, params: SamplingParams | None = None, *,
                 prompt: Sequence[int] | None = None) -> Completion:
        """Generate from the current history; the generated tokens are appended to the state.

        With `prompt`, the state is first synced to those token ids in the same request: the
        prefill's last position gives the first token, and `Completion.stats` tells what was
        reused and computed."""
        completion = None
        for event in self.stream(params, prompt=prompt):
            completion = event.completion
        assert completion is not None
        return completion

    def stream(self, params: SamplingParams | None = None, *,
               prompt: Sequence[int] | None = None) -> Iterator[StreamEvent]:
        """Token by token. Closing the iterator early cancels the request."""
        request, stream = self._engine._submit_generate(self, params or SamplingParams(), None, prompt)
        return self._engine._events(request, stream)

    async def agenerate(self, params: SamplingParams | None = None, *,
                        prompt: Sequence[int] | None = None) -> Completion:
        completion = None
        async for event in self.astream(params, prompt=prompt):
            completion = event.completion
        assert completion is not None
        return completion

    def astream(self, params: SamplingParams | None = None, *,
                prompt: Sequence[int] | None = None) -> AsyncIterator[StreamEvent]:
        request, stream = self._engine._submit_generate(
            self, params or SamplingParams(), asyncio.get_running_loop(), prompt)
        return self._engine._aevents(request, stream)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens."""
        self._engine._truncate(self, n)

    def fork(self, new_id: str) -> "StateHandle":
        """A new state with the same history, sharing every KV block copy-on-write."""
        return self._engine._fork(self, new_id)

    def save(self, path) -> None:
        """Write tokens and KV to a file that `engine.load_state` restores."""
        self._engine._save(self, path)

    def close(self) -> None:
        """Free the state's blocks; the handle is unusable afterwards. Idempotent."""
        self._engine._close_state(self)
