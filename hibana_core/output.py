"""Output processing: from a request's accepted tokens to the events its caller reads.

Detokenizing, stop strings, timing and delivery live here. The scheduler only asks a request's
`stop_check` about each token; for a request with stop strings that is its `Detokenizer`.

    engine thread:  update_from_output -> OutputProcessor.process (token events)
                                       -> OutputProcessor.finish  (final event, per finished request)
    caller:         RequestEvents: `for ev in events` or `async for ev in events`

A request without stop strings is detokenized on the caller's side, as its events are read
(`RequestStream` holds its `Detokenizer`): the engine thread hands over token ids only, so that
decoding the text of every agent's tokens (~15 us a token: 4 ms a step of 32 agents verifying
drafts) does not lengthen the host's work between device steps. Stop strings must be found where
the request is ended, so a request with some is detokenized on the engine thread as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hibana_core.detokenizer import Detokenizer
from hibana_core.errors import ConfigError, HibanaError, hibana_error
from hibana_core.prompt import control_strings, markup_words
from hibana_core.scheduler import Request, RequestOutput
from hibana_core.state import Completion, RequestStats, StreamEvent
from hibana_plugins.hookspecs import GeneratedText

logger = logging.getLogger("hibana.requests")


@dataclass(frozen=True)
class _Token:
    """A token event whose text the caller's side decodes (`RequestStream.detokenizer`); `text`:
    whether the token is the text's (the stop token that ended the request is not)."""

    token_id: int
    logprob: Any
    text: bool


@dataclass(frozen=True)
class _Final:
    """The final event of such a request: its completion but for the text (and its spans)."""

    finish_reason: str
    completion: Completion


class RequestStream:
    """Events of one request, from the engine thread to the caller (a thread or an event loop).
    With a `detokenizer` the engine thread puts token ids (`_Token`, `_Final`) and the caller's
    reads decode them into the events a request with stop strings gets from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, detokenizer: Detokenizer | None = None) -> None:
        self._loop = loop
        self._queue: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()
        self.detokenizer = detokenizer

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
        return self._decoded(self._queue.get())

    async def aget(self) -> object:
        if asyncio.get_running_loop() is not self._loop:  # its events go to that loop alone: it would wait for good
            raise ConfigError("this stream's events go to the event loop it was made for (astream's loop, by default "
                              "the one running when it was called), and it is read on another; read it where it was "
                              "made, or call astream in the coroutine that reads it"
                              if self._loop is not None else
                              "this stream was made by stream() for a thread to read with `for`; read it so, or make "
                              "it with astream() to read it with `async for`")
        return self._decoded(await self._queue.get())

    def _decoded(self, item: object) -> object:
        """An event as the caller reads it, decoded here where the stream decodes (no stop strings);
        a tokenizer that fails on it fails the request with a HibanaError, as on the engine's thread."""
        try:
            return self._decode(item)
        except HibanaError:
            raise
        except Exception as exc:  # noqa: BLE001 - the tokenizer's
            raise HibanaError(f"decoding the generated text failed: {exc!r}") from exc

    def _decode(self, item: object) -> object:
        detok = self.detokenizer
        if isinstance(item, _Token):
            if item.text:
                detok.add(item.token_id)
            text = detok.take_delta()
            return StreamEvent(item.token_id, str(text), logprob=item.logprob, control_spans=text.control_spans)
        if isinstance(item, _Final):
            completion = dataclasses.replace(item.completion, text=detok.text,
                                             control_spans=tuple(detok.control_spans))
            tail = detok.take_delta(final=True)
            return StreamEvent(None, str(tail), item.finish_reason, completion, control_spans=tail.control_spans)
        return item

    def empty(self) -> bool:
        """Whether no event waits to be read (a read now would wait)."""
        return self._queue.empty()


class RequestEvents:
    """One request's events, read with `for` (a thread) or `async for` (an event loop); both
    drivers share `_take`. The final event ends the iteration; a failed request raises its error
    there. Closing early (`close`/`aclose`, or leaving the loop) cancels the request."""

    def __init__(self, request: Request, stream: RequestStream, cancel: Callable[..., None]) -> None:
        self.request, self._stream, self._cancel = request, stream, cancel
        self._done = False

    def _take(self, event: StreamEvent) -> StreamEvent:
        if event.token_id is None:
            self._done = True
            if self.request.error is not None:
                raise self.request.error
        return event

    def __iter__(self) -> "RequestEvents":
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        try:
            return self._take(self._stream.get())
        except BaseException:
            self.close()
            raise

    def __aiter__(self) -> "RequestEvents":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            return self._take(await self._stream.aget())
        except BaseException:
            self._close(wait=False)  # an event loop never waits for a step (its task cancelled, say)
            raise

    def ready(self) -> bool:
        """Whether reading on would not wait: the next event is here, or none is to come (the
        final event was read)."""
        return self._done or not self._stream.empty()

    def stop(self) -> None:
        """End the request now, as "cancelled", and keep reading: the events already made, then
        the final one with its completion (usage included), still come."""
        self._cancel(self.request)

    def close(self) -> None:
        """Cancel the request if it still runs; a no-op once it finished, which is known without
        the engine's lock (a step holds it: an event loop closing a finished stream must not wait)."""
        self._close(wait=True)

    async def aclose(self) -> None:
        """`close` on an event loop, which never waits for the engine's lock: where a step holds
        it, the request is marked, and ends at the next step or the state's next call."""
        self._close(wait=False)

    def _close(self, wait: bool) -> None:
        self._done = True
        if not self.request.finished:
            self._cancel(self.request, wait=wait)

    def __del__(self) -> None:  # an iterator dropped mid-way frees its request's blocks
        if not self._done and not self.request.finished:
            try:
                self._cancel(self.request, wait=False)  # a finalizer never waits for the engine's lock
            except Exception:
                pass


class CompilingEvents:
    """The events of a request whose grammar is new to the engine, asked for on an event loop:
    the grammar compiles in a worker thread at the first read (seconds for a big one; the loop
    serves others meanwhile), then the request is submitted and read as its `RequestEvents`.
    Closed before that, nothing is submitted; stopped, it is stopped once submitted (its final
    event, with the completion, still comes)."""

    def __init__(self, compile: Callable[[], object], submit: Callable[[], RequestEvents]) -> None:
        self._compile, self._submit = compile, submit
        self._events: RequestEvents | None = None
        self._done = self._stopped = False

    def __aiter__(self) -> "CompilingEvents":
        return self

    async def __anext__(self) -> StreamEvent:
        if self._events is None:
            if self._done:
                raise StopAsyncIteration
            try:
                await asyncio.to_thread(self._compile)  # the submission then finds it cached
                if self._done:  # closed while it compiled
                    raise StopAsyncIteration
                self._events = self._submit()
            except BaseException:
                self._done = True
                raise
            if self._stopped:
                self._events.stop()
        return await self._events.__anext__()

    def ready(self) -> bool:
        return self._done if self._events is None else self._events.ready()

    def stop(self) -> None:
        if self._events is None:
            self._stopped = True
        else:
            self._events.stop()

    def close(self) -> None:
        self._done = True
        if self._events is not None:
            self._events.close()

    async def aclose(self) -> None:
        self._done = True
        if self._events is not None:
            await self._events.aclose()


@dataclass
class OutputCounters:
    prompt_computed: int = 0
    prompt_reused: int = 0
    generated: int = 0


@dataclass(eq=False)
class _Delivery:
    """The output side of one request."""

    stream: RequestStream
    detokenizer: Detokenizer | None  # on the engine thread (stop strings; else the stream's, if any)
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    text_tokens: int = 0  # decoded on the caller's side: tokens the scheduler asked `text_token` about
    delivered: int = 0    # and token events handed over

    def text_token(self, token: int) -> bool:
        """The scheduler's `stop_check` of a request without stop strings: never a stop, but it
        counts the tokens asked about, which are the text's (a stop token ending the request is
        not asked about: its text is left out, as the engine thread's detokenizer leaves it)."""
        self.text_tokens += 1
        return False


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.control = _control_tokens(tokenizer)
        self.counters = OutputCounters()
        self._deliveries: dict[int, _Delivery] = {}

    def track(self, request: Request, loop: asyncio.AbstractEventLoop | None) -> RequestStream:
        """Start delivering a request's events (before it reaches the scheduler)."""
        detokenizer = None
        if request.params is not None:
            detokenizer = Detokenizer(self.tokenizer, request.seq.tokens, request.params.stop, self.control)
        if detokenizer is not None and not request.params.stop and self.tokenizer is not None:
            delivery = _Delivery(RequestStream(loop, detokenizer), None)  # decoded as the caller reads
            request.stop_check = delivery.text_token
        else:
            delivery = _Delivery(RequestStream(loop), detokenizer)
            if detokenizer is not None:
                request.stop_check = detokenizer.add
        self._deliveries[request.id] = delivery
        return delivery.stream

    def process(self, outputs: list[RequestOutput]) -> list[tuple[Request, Exception]]:
        """One event per accepted token; the text decoded so far goes out with the first. Returns
        the requests whose delivery failed, with why (each fails alone: `EngineCore._deliver`)."""
        now = time.perf_counter()
        failed = []
        for out in outputs:
            try:
                self._process(out, now)
            except Exception as exc:  # noqa: BLE001 - a tokenizer's or a stream's fault, this request's alone
                failed.append((out.request, exc))
        return failed

    def _process(self, out: RequestOutput, now: float) -> None:
        delivery = self._deliveries.get(out.request.id)
        if delivery is None:
            return
        self.counters.generated += len(out.new_token_ids)
        logprobs = out.new_logprobs or [None] * len(out.new_token_ids)
        lazy = delivery.stream.detokenizer is not None
        for token, logprob in zip(out.new_token_ids, logprobs):
            if delivery.first_token is None:
                delivery.first_token = now - delivery.started
            if lazy:
                event: object = _Token(token, logprob, delivery.delivered < delivery.text_tokens)
                delivery.delivered += 1
            else:
                text = delivery.detokenizer.take_delta() if delivery.detokenizer else GeneratedText("")
                event = StreamEvent(token, str(text), logprob=logprob, control_spans=text.control_spans)
            if not delivery.stream.put(event):
                out.request.cancelled = True  # nobody listens: dropped at the next schedule

    def finish(self, request: Request) -> None:
        """The final event of a finished request: its completion and the text held back. Where that
        cannot be made, the request fails (its reader waits for a final event, whatever happened)."""
        delivery = self._deliveries.pop(request.id, None)
        if delivery is None:
            return
        try:
            self._finish(request, delivery)
        except Exception as exc:  # noqa: BLE001 - a tokenizer's or a stream's fault, this request's alone
            if request.error is None:
                request.error = hibana_error(exc, "delivering the end of the generated text failed")
            delivery.stream.put(StreamEvent(None, "", "error"))

    def _finish(self, request: Request, delivery: _Delivery) -> None:
        self.counters.prompt_computed += request.computed
        self.counters.prompt_reused += request.reused
        detok = delivery.detokenizer
        stats = RequestStats(request.num_prompt, request.reused, request.computed, len(request.output),
                             delivery.first_token, time.perf_counter() - delivery.started, request.preemptions)
        logger.info("state %s: %s %s, prompt %d tokens (%d reused, %d computed), %d generated in %.3f s",
                    request.state_id or "?", "generate" if request.params is not None else "sync",
                    request.finish_reason or "done", stats.prompt_tokens, stats.reused, stats.computed,
                    stats.generated, stats.elapsed)
        wanted = request.params is not None and request.params.logprobs
        completion = Completion(list(request.output), request.finish_reason or "", detok.text if detok else "",
                                stats, list(request.logprobs) if wanted else None,
                                tuple(detok.control_spans) if detok else (), detok.matched if detok else None)
        if delivery.stream.detokenizer is not None:  # the caller's read decodes the text
            delivery.stream.put(_Final(request.finish_reason, completion))
            return
        tail = detok.take_delta(final=True) if detok else GeneratedText("")
        delivery.stream.put(StreamEvent(None, str(tail), request.finish_reason, completion,
                                        control_spans=tail.control_spans))


def _control_tokens(tokenizer: Any | None) -> dict[int, str]:
    """Id -> text of the tokenizer's added tokens, special (`prompt.control_strings`) or not
    (`prompt.markup_words`: Qwen's `<tool_call>`), which the detokenizer marks in generated text:
    a parser tells the token the model generated from its text spelled by ordinary tokens."""
    if tokenizer is None:
        return {}
    vocab = tokenizer.get_vocab()
    return {vocab[text]: text for text in (*control_strings(tokenizer), *markup_words(tokenizer)) if text in vocab}
