"""Engine facade: loads the model, owns the step loop, hands out state handles.

One background thread runs `step()` while there is work: schedule, run, update. Handles submit
requests from any thread or event loop and wait on their own event stream. One lock serialises the
step with edits of states, so a handle never sees a half-applied step.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import contextmanager
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Sequence

import torch

from hibana_core.kv import state_file
from hibana_core.config import EngineConfig, SamplingParams
from hibana_core.detokenizer import Detokenizer
from hibana_core.errors import (ConfigError, ContextLengthError, EngineClosedError, HibanaError, InvalidTokenError,
                                MemoryBudgetError, StateBusyError, StateClosedError, StateExistsError)
from hibana_core.forward_context import ForwardContext
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.cache import KVCache
from hibana_core.kv.sequence import KVSequence, common_prefix_len
from hibana_core.loader import load_from_hf_model, load_model
from hibana_core.runner import ModelRunner, SampledTokens
from hibana_core.sampler import Sampler, make_generator, needs_history
from hibana_core.scheduler import IdleLRUEviction, Request, RequestStatus, Scheduler, SchedulerOutput
from hibana_core.state import (UNNAMED_PREFIX, Completion, RequestStats, RequestStream, StateHandle,
                               StateInfo, StreamEvent, SyncStats)

if TYPE_CHECKING:
    from hibana_core.chat import Chat

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_SHARED: dict[tuple, "Engine"] = {}
_SHARED_LOCK = threading.Lock()


@dataclass(frozen=True)
class EngineStats:
    prompt_tokens_computed: int
    prompt_tokens_reused: int
    generated_tokens: int
    steps: int
    multi_sequence_steps: int     # steps that batched more than one sequence
    max_batch_sequences: int
    kv_blocks_total: int
    kv_blocks_used: int           # referenced by at least one state
    kv_blocks_cached: int         # unreferenced but still findable by prefix
    states: int


class _Counters:
    def __init__(self) -> None:
        self.prompt_computed = self.prompt_reused = self.generated = 0
        self.steps = self.multi_steps = self.max_batch = 0


def _run_loop(ref: "weakref.ReferenceType[Engine]") -> None:
    """The engine thread: step while there is work, sleep on the condition otherwise."""
    while True:
        engine = ref()
        if engine is None:
            return
        work = engine._work
        with work:
            if engine._closed:
                return
            if not engine.scheduler.has_work():
                del engine  # never wait while holding the engine alive
                work.wait(timeout=1.0)
                continue
            try:
                engine.step()
            except Exception as exc:  # a scheduling bug fails the pending requests, not the engine
                warnings.warn(f"Hibana engine step failed, its requests fail: {exc!r}")
                engine.scheduler.abort_all(HibanaError(f"engine step failed: {exc!r}"))
        del engine
        time.sleep(0)  # let threads waiting for the lock in (the lock is not fair)


def _raise_failure(request: Request, event: StreamEvent) -> StreamEvent:
    """The final event of a failed request raises its error instead of being delivered."""
    if event.token_id is None and request.error is not None:
        raise request.error
    return event


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class Engine:
    def __init__(self, config: EngineConfig, hf_model: torch.nn.Module | None = None,
                 tokenizer=None) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self._ctx = ForwardContext()
        if hf_model is None:
            loaded = load_model(config.model, self.device, config.dtype, self._ctx, config.progress)
        else:
            loaded = load_from_hf_model(hf_model, self.device, config.dtype, self._ctx, tokenizer)
        self.model, self.model_args, self.tokenizer = loaded.model, loaded.args, loaded.tokenizer
        self.hf_config, self.fingerprint, self.dtype = loaded.hf_config, loaded.fingerprint, loaded.dtype
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.vocab_size = loaded.args.vocab_size
        self.max_model_len = min(config.max_model_len or loaded.args.max_position_embeddings,
                                 loaded.args.max_position_embeddings)
        kv_dtype = loaded.dtype if config.cache.kv_dtype == "auto" else _DTYPES[config.cache.kv_dtype]
        num_blocks = self._num_blocks(loaded.weight_bytes, kv_dtype)
        a, bs = loaded.args, config.cache.block_size
        self.kv_cache = KVCache(a.num_layers, num_blocks, bs, a.num_kv_heads, a.head_dim, kv_dtype, self.device)
        self._ctx.kv_cache = self.kv_cache
        self.pool = BlockPool(num_blocks, bs)
        self._states: dict[str, StateHandle] = {}
        self._leased: set[str] = set()  # states held by a call (see `lease`)
        self.scheduler = Scheduler(config.scheduler, self.pool, IdleLRUEviction(self.pool, self._idle_sequences))
        self.runner = ModelRunner(self.model, self._ctx, Sampler(self.device, config.seed), self.device,
                                  self.max_model_len, config.scheduler.max_concurrent_agents,
                                  config.cuda_graphs)
        self._counters = _Counters()
        self._async = self.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, SampledTokens] | None = None
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._closed = False
        # the loop holds the engine weakly, so an engine nobody closed is still collected
        self._thread = threading.Thread(target=_run_loop, args=(weakref.ref(self),),
                                        name="hibana-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "demo", **overrides) -> "Engine":
        """Load a Hugging Face checkpoint directory (or "demo"); overrides go to EngineConfig."""
        return cls(EngineConfig.from_overrides(str(model), **overrides))

    @classmethod
    def from_hf_model(cls, hf_model: torch.nn.Module, tokenizer=None, **overrides) -> "Engine":
        """An engine on the weights of an in-memory transformers model (copied, not shared)."""
        name = getattr(hf_model.config, "name_or_path", "") or hf_model.config.model_type
        return cls(EngineConfig.from_overrides(str(name), **overrides), hf_model, tokenizer)

    @classmethod
    def shared(cls, model: str | os.PathLike = "demo", **overrides) -> "Engine":
        """One engine per (model, overrides) per process: what adapters use, so several chat
        model objects on one checkpoint share weights, KV pool and step loop."""
        key = (str(model), tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        with _SHARED_LOCK:
            engine = _SHARED.get(key)
            if engine is None or engine._closed:
                engine = _SHARED[key] = cls.from_pretrained(model, **overrides)
            return engine

    def _num_blocks(self, weight_bytes: int, kv_dtype: torch.dtype) -> int:
        cache, a = self.config.cache, self.model_args
        per_block = KVCache.bytes_per_block(a.num_layers, cache.block_size, a.num_kv_heads, a.head_dim, kv_dtype)
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.memory_budget_bytes is not None:
            kv_bytes = cache.memory_budget_bytes - weight_bytes
            if kv_bytes < 2 * per_block:
                raise MemoryBudgetError(
                    f"memory_budget_bytes={cache.memory_budget_bytes:,} cannot hold the weights "
                    f"({weight_bytes:,} bytes) plus two KV blocks ({2 * per_block:,} bytes); raise it "
                    "to at least their sum, or pick a smaller model")
            return kv_bytes // per_block
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            kv_bytes = int(free * cache.memory_fraction)
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            kv_bytes = min(cache.max_kv_bytes_cpu, int(available * cache.memory_fraction))
            # on the CPU, never more than every admitted agent at full context (zeroed RAM is slow)
            full = self.config.scheduler.max_concurrent_agents * -(-self.max_model_len // cache.block_size)
            kv_bytes = min(kv_bytes, 2 * full * per_block)
        if kv_bytes < 2 * per_block:
            raise MemoryBudgetError("too little memory is free for the KV cache; free memory or "
                                    "set memory_budget_bytes / num_blocks")
        return kv_bytes // per_block

    # --- the step loop ------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine step: schedule, launch the model, post-process. False when idle.

        With async scheduling (on for CUDA), a step's tokens are read back during the next step:
        its bookkeeping that needs no token values (`Scheduler.advance`) runs at once, so the
        next step is scheduled and launched first, and the host work of one step overlaps the
        device work of the next. Requests whose sampling reads earlier tokens on the host
        (penalties) make their step wait for its tokens."""
        with self._lock:
            output = self.scheduler.schedule()
            if not output.chunks:
                return self._finish_in_flight()
            previous = self._in_flight[1].device if self._in_flight else None
            try:
                sampled = self.runner.launch(output, previous)
            except Exception as exc:  # fails this step's requests; their states keep their KV
                self._finish_in_flight()
                error = exc if isinstance(exc, HibanaError) else HibanaError(f"model step failed: {exc!r}")
                self.scheduler.fail(output, error)
                return True
            self._finish_in_flight()
            self.scheduler.advance(output)
            self._in_flight = (output, sampled)
            if not self._async or any(c.sample and needs_history(c.request.params) for c in output.chunks):
                self._finish_in_flight()
            c = self._counters
            c.steps += 1
            c.multi_steps += len(output.chunks) > 1
            c.max_batch = max(c.max_batch, len(output.chunks))
            return True

    def _finish_in_flight(self) -> bool:
        """Read the launched step's tokens back and hand them on. False if none was in flight."""
        if self._in_flight is None:
            return False
        output, sampled = self._in_flight
        self._in_flight = None
        try:
            tokens = sampled.tolist()
        except Exception as exc:  # the device failed under this step
            self.scheduler.fail(output, HibanaError(f"model step failed: {exc!r}"))
            return True
        self.scheduler.finalize(output, tokens)
        return True

    # --- states -------------------------------------------------------------------------------

    def open_state(self, state_id: str) -> StateHandle:
        """Get or create the state with this id."""
        if not isinstance(state_id, str) or not state_id:
            raise ConfigError(f"state ids are non-empty strings, got {state_id!r}")
        with self._lock:
            self._check_open()
            handle = self._states.get(state_id)
            if handle is None:
                handle = self._new_handle(state_id, self._new_sequence())
            return handle

    def _new_sequence(self) -> KVSequence:
        return KVSequence(self.pool, self.kv_cache.copy_block, self.config.cache.enable_prefix_caching)

    def _new_handle(self, state_id: str, seq: KVSequence) -> StateHandle:
        handle = StateHandle(self, state_id, seq)
        handle.last_use = time.monotonic()
        self._states[state_id] = handle
        return handle

    def load_state(self, path: str | os.PathLike, state_id: str | None = None) -> StateHandle:
        """Restore a state written by `StateHandle.save` (same model and tokenizer only)."""
        saved = state_file.read(Path(path), self.fingerprint)
        with self._lock:
            self._check_open()
            state_id = state_id or saved.state_id
            if state_id in self._states:
                raise StateExistsError(f"a state with id {state_id!r} is open; close it or pass "
                                       "load_state(path, state_id=...) with another id")
            self._validate(saved.tokens)
            seq = self._new_sequence()
            seq.tokens = list(saved.tokens)
            layout_matches = (saved.block_size == self.pool.block_size
                              and saved.kv.shape[3:] == self.kv_cache.data.shape[3:])
            if layout_matches and saved.num_computed:
                blocks = saved.kv.shape[2]
                if not self.pool.can_allocate(blocks):
                    self.scheduler.eviction.make_room(blocks)
                seq.block_ids = self.pool.allocate(blocks)
                self.kv_cache.write_blocks(seq.block_ids, saved.kv)
                seq.advance(saved.num_computed)  # commits (and dedupes) its full blocks
            return self._new_handle(state_id, seq)

    def chat(self, state_id: str) -> "Chat":
        """The chat layer on one state: OpenAI-style messages and tools in, text and tool calls out."""
        from hibana_core.chat import Chat

        return Chat(self, state_id)

    def match_state(self, token_ids: Sequence[int], *, min_shared: float = 0.0) -> StateHandle | None:
        """The idle, unleased state whose history shares the longest prefix with token_ids (the
        most recently used among equals), or None. The shared prefix must cover at least
        `min_shared` of the state's own tokens (1.0: token_ids continue its whole history)."""
        with self._lock:
            best, best_len = None, 0
            for handle in self._states.values():
                seq = handle._seq
                if self._taken(handle):
                    continue
                same = common_prefix_len(seq.tokens, token_ids)
                if same == 0 or same < min_shared * len(seq):
                    continue
                if same > best_len or (same == best_len and handle.last_use > best.last_use):
                    best, best_len = handle, same
            return best

    def _taken(self, handle: StateHandle) -> bool:
        """Held by a call (leased) or generating: not to be handed to another call."""
        return handle.id in self._leased or self.scheduler.busy(handle._seq)

    @contextmanager
    def lease(self, token_ids: Sequence[int] = (), state_id: str | None = None, *,
              min_shared: float = 1.0) -> Iterator[StateHandle]:
        """One state held for one call, so concurrent calls never share a state (adapters serve
        every framework call this way). With `state_id`, that state (StateBusyError while another
        call holds it or it generates); otherwise the idle state that `match_state(token_ids,
        min_shared=...)` finds (by default only one whose whole history the call continues, so
        a call never takes over another conversation for a shared system prompt), else a new
        one, which still shares full prefix blocks with every other state."""
        with self._lock:
            if state_id is not None:
                handle = self.open_state(state_id)
                if self._taken(handle):
                    raise StateBusyError(f"state {state_id!r} is serving another call; give concurrent "
                                         "calls different state ids")
            else:
                handle = self.match_state(token_ids, min_shared=min_shared)
                if handle is None:
                    self._close_unnamed(keep=self.config.cache.max_unnamed_states - 1)
                    handle = self.open_state(f"{UNNAMED_PREFIX}{uuid.uuid4().hex[:12]}")
            self._leased.add(handle.id)
        try:
            yield handle
        finally:
            with self._lock:
                self._leased.discard(handle.id)

    def _close_unnamed(self, keep: int) -> None:
        """Close the least recently used idle states that `lease` named, all but `keep`."""
        idle = sorted((h for h in self._states.values()
                       if h.id.startswith(UNNAMED_PREFIX) and not self._taken(h)),
                      key=lambda h: h.last_use)
        for handle in idle[:max(0, len(idle) - keep)]:
            self._close_state(handle)

    def states(self) -> list[StateInfo]:
        with self._lock:
            return [StateInfo(h.id, h._seq.history_len, h._seq.num_computed, len(h._seq.block_ids),
                              "device" if h._seq.block_ids else "none", h.last_use,
                              self.scheduler.busy(h._seq)) for h in self._states.values()]

    def stats(self) -> EngineStats:
        with self._lock:
            c = self._counters
            return EngineStats(c.prompt_computed, c.prompt_reused, c.generated, c.steps, c.multi_steps,
                               c.max_batch, self.pool.num_blocks, self.pool.num_used,
                               self.pool.num_cached, len(self._states))

    def _idle_sequences(self) -> list[KVSequence]:
        handles = sorted(self._states.values(), key=lambda h: h.last_use)
        return [h._seq for h in handles if h._seq.block_ids and not self.scheduler.busy(h._seq)]

    # --- what handles call --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new one with Engine.from_pretrained")

    def _check_handle(self, handle: StateHandle) -> None:
        self._check_open()
        if handle.closed:
            raise StateClosedError(f"state {handle.id!r} is closed; open a new one with engine.open_state")
        if self.scheduler.busy(handle._seq):
            raise StateBusyError(f"state {handle.id!r} is generating; wait for that request to finish "
                                 "or cancel its stream first")
        handle.last_use = time.monotonic()

    def _validate(self, tokens: Sequence[int]) -> list[int]:
        try:
            tokens = [int(t) for t in tokens]
        except (TypeError, ValueError) as exc:
            raise InvalidTokenError(f"token ids must be integers: {exc}") from None
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidTokenError(f"token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab_size}); "
                                    "tokenize with this model's tokenizer")
        if len(tokens) > self.max_model_len:
            raise ContextLengthError(f"{len(tokens)} tokens exceed the model's context of "
                                     f"{self.max_model_len}; shorten the history (the state is unchanged)")
        return tokens

    def _sync(self, handle: StateHandle, token_ids: Sequence[int], append: bool = False) -> SyncStats:
        with self._lock:
            self._check_handle(handle)
            tokens = self._validate(list(handle._seq.tokens) + list(token_ids) if append else token_ids)
            handle._seq.set_tokens(tokens)
            if handle._seq.num_uncomputed == 0:
                self._counters.prompt_reused += len(tokens)
                return SyncStats(reused=len(tokens), computed=0)
            request, stream = self._submit(handle, None, None)
        for _ in self._events(request, stream):
            pass
        return SyncStats(reused=request.reused, computed=request.computed)

    def _submit_generate(self, handle: StateHandle, params: SamplingParams,
                         loop: asyncio.AbstractEventLoop | None,
                         prompt: Sequence[int] | None = None) -> tuple[Request, RequestStream]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        with self._lock:
            self._check_handle(handle)
            if prompt is not None:
                handle._seq.set_tokens(self._validate(prompt))
            if not len(handle._seq):
                raise ContextLengthError(f"state {handle.id!r} holds no tokens; sync a prompt first")
            return self._submit(handle, params, loop)

    def _submit(self, handle: StateHandle, params: SamplingParams | None,
                loop: asyncio.AbstractEventLoop | None) -> tuple[Request, RequestStream]:
        stream = RequestStream(loop)
        seq = handle._seq
        stops: frozenset[int] = frozenset()
        detokenizer = None
        generator = None
        if params is not None:
            stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            if params.stop and self.tokenizer is None:
                raise HibanaError("stop strings need a tokenizer, and this checkpoint has none; "
                                  "use stop_token_ids instead")
            detokenizer = Detokenizer(self.tokenizer, seq.tokens, params.stop)
            if params.seed is not None:
                generator = make_generator(params.seed, self.device)
        started = time.perf_counter()
        timing = {"start": started, "first": None}

        def on_event(request: Request, token: int | None) -> None:
            if token is not None:
                if timing["first"] is None:
                    timing["first"] = time.perf_counter() - started
                self._counters.generated += 1
                text = request.detokenizer.take_delta() if request.detokenizer else ""
                if not stream.put(StreamEvent(token, text)):
                    request.cancelled = True  # dropped at the next schedule
                return
            self._counters.prompt_computed += request.computed
            self._counters.prompt_reused += request.reused
            stream.put(self._final_event(request, timing["first"], time.perf_counter() - started))

        request = Request(seq, params, on_event, detokenizer, generator, stops, self.max_model_len)
        self.scheduler.add(request)
        self._work.notify()
        return request, stream

    def _final_event(self, request: Request, ttft: float | None, elapsed: float) -> StreamEvent:
        detok = request.detokenizer
        stats = RequestStats(request.num_prompt, request.reused, request.computed, len(request.output),
                             ttft, elapsed)
        completion = Completion(list(request.output), request.finish_reason or "", detok.text if detok else "",
                                stats)
        tail = detok.take_delta(final=True) if detok else ""
        return StreamEvent(None, tail, request.finish_reason, completion)

    def _events(self, request: Request, stream: RequestStream) -> Iterator[StreamEvent]:
        try:
            while True:
                event = _raise_failure(request, stream.get())
                yield event
                if event.token_id is None:
                    return
        finally:
            self._cancel(request)  # an iterator closed early; a no-op once finished

    async def _aevents(self, request: Request, stream: RequestStream) -> AsyncIterator[StreamEvent]:
        try:
            while True:
                event = _raise_failure(request, await stream.aget())
                yield event
                if event.token_id is None:
                    return
        finally:
            self._cancel(request)

    def _cancel(self, request: Request) -> None:
        with self._lock:
            if request.status is not RequestStatus.FINISHED:
                request.cancelled = True
                self.scheduler.finish(request, "cancelled")

    def _truncate(self, handle: StateHandle, n: int) -> None:
        with self._lock:
            self._check_handle(handle)
            if not 0 <= n:
                raise ContextLengthError(f"truncate needs n >= 0, got {n}")
            handle._seq.trim(min(n, len(handle._seq)))

    def _fork(self, handle: StateHandle, new_id: str) -> StateHandle:
        with self._lock:
            self._check_handle(handle)
            if new_id in self._states:
                raise StateExistsError(f"a state with id {new_id!r} is open; fork under another id")
            return self._new_handle(new_id, handle._seq.fork())

    def _save(self, handle: StateHandle, path: str | os.PathLike) -> None:
        with self._lock:
            self._check_handle(handle)
            seq = handle._seq
            kv = self.kv_cache.read_blocks(seq.block_ids)
            state_file.write(Path(path), handle.id, seq.tokens, seq.num_computed, self.pool.block_size,
                             kv, self.fingerprint)

    def _close_state(self, handle: StateHandle) -> None:
        with self._lock:
            if handle.closed:
                return
            for request in [r for r in self.scheduler.running + list(self.scheduler.waiting)
                            if r.seq is handle._seq]:
                request.cancelled = True
                self.scheduler.finish(request, "cancelled")
            handle._seq.release()
            handle.closed = True
            self._states.pop(handle.id, None)

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop, fail pending requests, free every state. Idempotent."""
        with self._work:
            if self._closed:
                return
            self._closed = True
            self.scheduler.abort_all(EngineClosedError("the engine was closed while this request ran"))
            for handle in list(self._states.values()):
                handle._seq.release()
                handle.closed = True
            self._states.clear()
            # drop the big tensors now, not when the last handle is collected
            self.model = self.runner = self.kv_cache = self._ctx.kv_cache = None
            self._work.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
