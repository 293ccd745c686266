"""The stable public API of agent state: StateHandle, SyncStats, Completion (see DESIGN.md).

A handle is a thin, thread-safe front for one state inside its engine: every call goes through
the engine's state registry (`hibana_core.registry`), which serialises edits with the step loop.
`stream` and `astream` return one event source (`RequestEvents`), read with `for` or `async for`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from hibana_core.config import SamplingParams
from hibana_core.errors import ConfigError, HibanaError

UNNAMED_PREFIX = "auto-"
"""Ids of the states `Engine.lease` makes for calls that name none start with this. The engine
marks those states itself: a user's own state is never taken for one, whatever its id."""

if TYPE_CHECKING:
    from hibana_core.engine import Engine
    from hibana_core.output import CompilingEvents, RequestEvents
    from hibana_core.registry import StateRegistry


@dataclass(frozen=True)
class SyncStats:
    """What a sync cost: tokens whose KV was already there, and tokens computed. Unpacks as the
    pair it reads as (`reused, computed = h.sync(tokens)`)."""

    reused: int
    computed: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.reused, self.computed))


@dataclass(frozen=True)
class RequestStats:
    """What a request cost. `reused` counts the prompt tokens whose KV was there when it started
    (never more than `prompt_tokens`); `computed` every prompt token it computed, so a request
    that was preempted and computed part of its prompt again has reused + computed above
    prompt_tokens (`preemptions` says how often it gave its KV back)."""

    prompt_tokens: int
    reused: int           # prompt tokens served from resident or shared KV
    computed: int         # prompt tokens this request computed, recomputation included
    generated: int
    time_to_first_token: float | None
    elapsed: float
    preemptions: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (`SamplingParams.logprobs`), and in
    `top` the most likely tokens at its position (as many as `SamplingParams.top_logprobs`, or
    every token of a smaller vocabulary), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, log-probability)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    finish_reason: str    # "stop" (stop token or string), "length", "cancelled"
    text: str             # decoded output, cut before a stop string ("" without a tokenizer)
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    control_spans: tuple[tuple[int, int], ...] | None = None  # (start, end) of `text` where the model
                                                              # generated added tokens (special or not)
    stop_string: str | None = None  # the stop string (SamplingParams.stop) that ended the text, if one did


@dataclass(frozen=True)
class StreamEvent:
    """One streamed token (text may be "" while characters are incomplete or held back), or the
    final event, which has token_id None, the finish reason and the completion."""

    token_id: int | None
    text: str
    finish_reason: str | None = None
    completion: Completion | None = None
    logprob: TokenLogprob | None = None   # the token's, when the request asked for logprobs
    control_spans: tuple[tuple[int, int], ...] | None = None  # (start, end) of `text` that are
                      # added tokens' text (special or not: Qwen's <tool_call>) (never split between events); None: not known (an event
                      # built elsewhere), and its text is read as its tokenizer would encode it


@dataclass(frozen=True)
class StateInfo:
    id: str
    tokens: int
    computed: int         # tokens whose KV is resident
    blocks: int           # its device KV, in the blocks kv_device_blocks counts (EngineStats' kv_blocks_*)
    tier: str             # "device" while KV is resident, "host" / "disk" while parked there, "none" once released
    last_use: float       # when a call last used it, in Unix seconds (time.time())
    busy: bool
    pinned: bool = False  # StateHandle.pin(): kept on the device within the pin budget
    priority: int = 0     # its last request's priority: lower-priority idle states leave the device first


class StateHandle:
    """One agent's resident state: its token history and the KV cache behind it."""

    def __init__(self, registry: "StateRegistry", state_id: str) -> None:
        self._registry = registry
        self._id = state_id
        self.closed = False

    @property
    def id(self) -> str:
        return self._id

    @property
    def engine(self) -> "Engine":
        return self._registry.engine_ref()

    @property
    def tokens(self) -> list[int]:
        """A copy of the token ids the state holds (StateClosedError once the handle is closed,
        EngineClosedError once its engine is)."""
        return self._registry.tokens(self)

    def __len__(self) -> int:
        return self._registry.length(self)

    def __repr__(self) -> str:
        if self.closed:
            return f"StateHandle(id={self._id!r}, closed=True)"
        try:
            return f"StateHandle(id={self._id!r}, tokens={len(self)}, closed=False)"
        except HibanaError:  # its engine closed
            return f"StateHandle(id={self._id!r}, closed=True)"

    def sync(self, token_ids: Sequence[int]) -> SyncStats:
        """Hold exactly token_ids: keep the longest common prefix (own or shared blocks), drop the
        rest, prefill the remainder."""
        return self._registry.sync(self, token_ids)

    def append(self, token_ids: Sequence[int]) -> SyncStats:
        return self._registry.sync(self, token_ids, append=True)

    def generate(self, params: SamplingParams | None = None, *,
                 prompt: Sequence[int] | None = None) -> Completion:
        """Generate from the current history; the generated tokens are appended to the state.

        With `prompt`, the state is first synced to those token ids in the same request: the
        prefill's last position gives the first token, and `Completion.stats` tells what was
        reused and computed."""
        event = None
        for event in self.stream(params, prompt=prompt):
            pass
        return event.completion

    def stream(self, params: SamplingParams | None = None, *, prompt: Sequence[int] | None = None,
               snapshot_at: int | None = None) -> "RequestEvents":
        """Token by token; the last event carries the completion. Closing the iterator early
        cancels the request at the engine's next step: the state keeps the tokens generated until
        then, which may be more than were read (the engine runs ahead of a slow reader; `tokens`
        says what it holds). `events.stop()`, then reading on, ends it so and still delivers the
        completion with all of them.

        `snapshot_at`: a position inside `prompt` where a hybrid model's state also keeps a copy
        of itself (the chat layer gives where the template's generation prompt starts: a template
        that re-renders the reply without the think block its generation prompt opened cuts the
        history there, and the next turn continues from the copy); other models ignore it."""
        return self._registry.generate(self, params or SamplingParams(), prompt, None, snapshot_at)

    async def agenerate(self, params: SamplingParams | None = None, *,
                        prompt: Sequence[int] | None = None) -> Completion:
        event = None
        async for event in self.astream(params, prompt=prompt):
            pass
        return event.completion

    def astream(self, params: SamplingParams | None = None, *, prompt: Sequence[int] | None = None,
                loop: asyncio.AbstractEventLoop | None = None,
                snapshot_at: int | None = None) -> "RequestEvents | CompilingEvents":
        """`stream` for `async for` on an event loop: `loop`, by default the running one. The
        call itself waits for the engine's lock, which a step holds: a loop that must not wait
        makes it from a worker thread, naming itself as `loop` (as `turn.arun` does). A grammar
        the engine has not compiled yet (seconds for a big one) never compiles on the loop: the
        call returns at once, and the compile, in a worker thread, and the submission, with its
        refusals, come at the first read (`CompilingEvents`)."""
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ConfigError("astream wants an event loop: call it inside a coroutine, name one with "
                                  "loop=, or use stream() from synchronous code") from None
        return self._registry.generate(self, params or SamplingParams(), prompt, loop, snapshot_at)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (every one where the state holds n or fewer, as a slice does)."""
        self._registry.truncate(self, n)

    def fork(self, new_id: str) -> "StateHandle":
        """A new state with the same history, sharing every KV block copy-on-write."""
        return self._registry.fork(self, new_id)

    def save(self, path) -> None:
        """Write tokens and KV to a file that `engine.load_state` restores, owner-only (0600: it
        holds the conversation; `state_file.save_private`)."""
        self._registry.save(self, path)

    def pin(self) -> None:
        """Keep this state's KV on the device while it is idle: within `pin_budget` (a share of
        the device pool, first pinned first served) it is evicted only when a request could not
        run otherwise; beyond the budget it is kept ahead of every unpinned state."""
        self._registry.pin(self, True)

    def unpin(self) -> None:
        """Undo `pin()`: the state is an ordinary idle state again."""
        self._registry.pin(self, False)

    def close(self) -> None:
        """Free the state's blocks; the handle is unusable afterwards. Idempotent."""
        self._registry.close_state(self)
