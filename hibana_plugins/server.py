"""`hibana serve`: Hibana behind OpenAI's HTTP API (FastAPI + uvicorn), an adapter like the others.

    POST /v1/chat/completions   messages, tools, tool_choice, response_format, stream (SSE)
    POST /v1/completions        a prompt (text or token ids) continued as it is (no chat template)
    POST /v1/responses          OpenAI's Responses API: input items, function tools, stream (typed events)
    POST /v1/messages           Anthropic's Messages API: content blocks, tool_use, stream (its events);
    POST /v1/messages/count_tokens   the prompt's tokens
    GET  /v1/models, /v1/models/{model}   GET /health   GET /metrics (Prometheus)
    GET  /v1/hibana/states   DELETE /v1/hibana/states/{id}   the engine's states; forget one

Every conversation keeps its KV resident between requests: a request is served on the state
whose conversation it continues (`Chat.lease`: the longest resident prefix), or on the state the
client names with an `X-Hibana-State` header (that state only: 409 while it is busy) or the
`user` field (another state while that one is busy). `usage.prompt_tokens_details.cached_tokens`
says how much of the prompt the state already held. At most `max_named_states` idle states that
clients named are kept (`NamedStates`: the least recently used are closed, written to the
state_dir first where there is one, and come back from it when named again).

A reasoning model thinks unless `reasoning_effort: "none"` or `chat_template_kwargs:
{"enable_thinking": false}` says otherwise; its thinking comes as `reasoning_content` in the
message and in stream deltas (vLLM's and DeepSeek's shape), never inside `content`.

Safe by default: binds 127.0.0.1; with an API key (`--api-key` or HIBANA_API_KEY) every endpoint
but /health wants it as a bearer token; bodies and max_tokens are bounded. The wire format lives
in `hibana_plugins.openai_api`; this module does the HTTP, the errors' status codes and metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hmac
import itertools
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from hibana_core import turn
from hibana_core.chat import Chat, LedText, TokenIds
from hibana_core.cli import add_device_arguments
from hibana_core.config import MAX_JSON_DEPTH, nests_deeper
from hibana_core.engine_core import STEP_TIME_BUCKETS
from hibana_core.errors import (ChatTimeoutError, ConfigError, ContextLengthError, EngineClosedError, GrammarError,
                                HibanaError, InvalidTokenError, QueueTimeoutError, StateBusyError)
from hibana_core.messages import (ConversationError, ToolChoiceError, ToolSchemaError, UnsupportedContentError,
                                  check_text)
from hibana_core.prompt import leading_specials
from hibana_core.turn import ChatDelta
from hibana_plugins.manager import PluginError, get_plugin_manager
from hibana_plugins.options import LeaseHolder, lease_holder
from hibana_plugins.openai_api import (STATE_HEADER, ApiError, ChatCall, ChatRequest, CompletionRequest,
                                       DetokenizeRequest, Reply, TextReply, TokenizeRequest, chat_call, choice_calls,
                                       context_exceeded, countable, json_text, named_state, parse_request, prompts_of,
                                       served_by_header, system_fingerprint, tokenize_call)
from hibana_plugins.openai_responses import ResponsesReply, ResponsesRequest, in_responses_terms
from hibana_plugins.anthropic_messages import (CountTokensRequest, MessagesReply, MessagesRequest, error_body,
                                               in_messages_terms)

if TYPE_CHECKING:
    import uvicorn

    from hibana_core.engine import Engine, EngineStats
    from hibana_core.state import StateHandle

log = logging.getLogger("hibana.server")

T = TypeVar("T")
API_KEY_ENV = "HIBANA_API_KEY"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/models", "/v1/hibana/states", "/tokenize", "/detokenize", "/health", "/metrics")
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
"""Anthropic's endpoints: their errors come in Anthropic's shape (`anthropic_messages.error_body`)."""


LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
"""Pages served from this machine may call the server from a browser (as Ollama allows by default);
others only where `ServerConfig.allowed_origins` names them."""
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP face allows; the engine's own options are the engine's."""

    model_name: str                       # the id /v1/models lists and requests must name
    api_key: str | None = None            # bearer token every endpoint but /health wants, when set
    max_body_bytes: int = 8 << 20         # request bodies larger than this are refused (413)
    max_tokens_limit: int | None = None   # most tokens one request may generate; None: the context
    request_timeout: float | None = None  # seconds a request may take, queue included; None: no limit
    shutdown_timeout: float | None = None  # seconds requests in flight may go on once the server is told
    #                                       to stop, then they are cancelled; None: until they finish
    max_named_states: int = 4096          # idle states named by clients (X-Hibana-State, `user`) kept open;
    #                                       past it the least recently used are closed (to the state_dir)
    tool_parser: str | None = None        # a registered tool parser by name; None: the chat format's or
    #                                       the one the chat template writes
    allowed_origins: tuple[str, ...] = ()  # web pages (origins) beside LOCAL_ORIGINS whose scripts may call
    #                                       the server from a browser (CORS); "*": any page

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("the served model name must not be empty")
        if self.api_key is not None and not self.api_key.strip():  # it would take an empty bearer token
            raise ConfigError("the API key must not be empty or blank; leave it unset to want none")
        for name, flag in (("max_body_bytes", "--max-body-bytes"), ("max_tokens_limit", "--max-tokens-limit"),
                           ("request_timeout", "--request-timeout")):
            limit = getattr(self, name)
            if limit is not None and not limit > 0:  # NaN is not positive either
                raise ConfigError(f"{name} ({flag}) must be positive, got {limit!r}")
        if self.shutdown_timeout is not None and not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be >= 0 seconds or None, got {self.shutdown_timeout!r}")
        if isinstance(self.allowed_origins, str) or any(
                not isinstance(o, str) or o != "*" and not ORIGIN.fullmatch(o) for o in self.allowed_origins):
            raise ConfigError(f"allowed_origins (--allowed-origins) takes origins such as https://app.example.com "
                              f"or http://localhost:3000 (scheme, host and port, no path), or '*'; got "
                              f"{self.allowed_origins!r}")
        if isinstance(self.max_named_states, bool) or not isinstance(self.max_named_states, int) \
                or self.max_named_states < 0:
            raise ConfigError(f"max_named_states (--max-named-states) must be an integer >= 0, got "
                              f"{self.max_named_states!r}")


class Metrics:
    """The Prometheus figures, in a registry of their own (two apps in one process do not clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hibana_requests", "HTTP requests served", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("hibana_time_to_first_token_seconds", "request received to first token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.in_flight = Gauge("hibana_requests_in_flight", "chat requests being served", registry=r)
        self.kv_blocks = Gauge("hibana_kv_blocks", "KV blocks of the engine's pool", ["kind"], registry=r)
        self.states = Gauge("hibana_states", "states the engine holds", registry=r)
        self.kv_bytes = Gauge("hibana_kv_bytes", "KV bytes per memory tier (device: blocks in use; host, "
                              "disk: idle states' KV parked there)", ["tier"], registry=r)
        self.moves = Gauge("hibana_kv_moves", "idle states' KV parked in the host tier and copied back, "
                           "spilled to disk and read back (since start)", ["kind"], registry=r)
        self.queue = Gauge("hibana_requests_queued", "requests waiting in the engine's queue for admission",
                           registry=r)
        self.running = Gauge("hibana_requests_running", "requests the engine has admitted (prefilling or "
                             "generating)", registry=r)
        self.steps = EngineFigures()
        r.register(self.steps)

    def scrape(self, engine: "Engine") -> bytes:
        stats = engine.stats()
        self.steps.stats = stats  # its tokens too (`EngineFigures.collect`)
        self.kv_blocks.labels("total").set(stats.kv_blocks_total)
        self.kv_blocks.labels("used").set(stats.kv_blocks_used)
        self.kv_blocks.labels("cached").set(stats.kv_blocks_cached)
        self.states.set(stats.states)
        memory = engine.memory()
        self.kv_bytes.labels("device").set(memory["device"]["kv_used"])
        self.kv_bytes.labels("host").set(memory["host"]["kv_parked"])
        self.kv_bytes.labels("disk").set(memory["disk"]["kv_parked"])
        self.moves.labels("parks").set(stats.parks)
        self.moves.labels("resumes").set(stats.resumes)
        tier = stats.host_tier or {}
        self.moves.labels("spills").set(tier.get("spills", 0))
        self.moves.labels("disk_resumes").set(tier.get("disk_resumes", 0))
        self.queue.set(stats.requests_waiting)
        self.running.set(stats.requests_running)
        self.steps.stats = stats
        return generate_latest(self.registry)


class EngineFigures:
    """The engine's step-time histogram, which the engine keeps (`EngineStats.step_time_buckets`),
    as a Prometheus histogram, and its prompt and generated token counts as counters (those of
    every request, cancelled and timed out too): read at each scrape, not counted from here."""

    HELP = "wall time of one engine step (schedule, launch, read back; under load the engine's cadence)"
    PROMPT_HELP = "prompt tokens, by whether their KV was reused from a resident state or computed"
    GENERATED_HELP = "completion tokens generated"

    def __init__(self) -> None:
        self.stats: "EngineStats | None" = None  # the last scrape's

    def describe(self) -> list:
        return [HistogramMetricFamily("hibana_step_seconds", self.HELP),
                CounterMetricFamily("hibana_prompt_tokens", self.PROMPT_HELP, labels=["kind"]),
                CounterMetricFamily("hibana_generated_tokens", self.GENERATED_HELP)]

    def collect(self) -> list:
        family = HistogramMetricFamily("hibana_step_seconds", self.HELP)
        prompt = CounterMetricFamily("hibana_prompt_tokens", self.PROMPT_HELP, labels=["kind"])
        generated = CounterMetricFamily("hibana_generated_tokens", self.GENERATED_HELP)
        if self.stats is not None:  # the engine's own counts: requests cancelled or timed out included
            prompt.add_metric(["reused"], self.stats.prompt_tokens_reused)
            prompt.add_metric(["computed"], self.stats.prompt_tokens_computed)
            generated.add_metric([], self.stats.generated_tokens)
            if self.stats.step_time_buckets:
                cumulative = list(itertools.accumulate(self.stats.step_time_buckets))
                bounds = [floatToGoString(b) for b in STEP_TIME_BUCKETS] + ["+Inf"]
                family.add_metric([], list(zip(bounds, cumulative)), self.stats.step_seconds)
        return [family, prompt, generated]


class JsonReply(JSONResponse):
    """A JSON reply written as Starlette writes one, a lone surrogate escaped (`json_text`)."""

    def render(self, content: Any) -> bytes:
        return json_text(content, allow_nan=False, separators=(",", ":")).encode()


# --- HibanaError -> HTTP ---------------------------------------------------------------------------

def api_error(exc: HibanaError, prompt_param: str = "messages") -> ApiError:
    """The OpenAI-shaped error for a failure the caller caused (or a busy/closed engine);
    `prompt_param` is the field that holds the prompt ("prompt" for legacy completions)."""
    message = str(exc)
    if isinstance(exc, ContextLengthError):
        return context_exceeded(message, prompt_param)
    if isinstance(exc, StateBusyError):
        return ApiError(409, message, None, "state_busy")
    if isinstance(exc, ChatTimeoutError):  # it would run as long again: not to be repeated as it is
        return ApiError(503, message, None, "timeout", "server_error", retry=False)
    if isinstance(exc, QueueTimeoutError):  # the server is full: retry later (as a rate limit)
        return ApiError(429, message, None, "queue_timeout", "requests")  # OpenAI types its rate limits so
    if isinstance(exc, EngineClosedError):
        return ApiError(503, message, None, "engine_closed", "server_error")
    if isinstance(exc, PluginError):  # a plugin of the server's failed (its tool parser): not the request's fault
        return ApiError(500, message, None, "plugin_error", "server_error", retry=False)  # it would fail again
    params = [(ToolChoiceError, "tool_choice"), (ToolSchemaError, "tools"), (ConversationError, prompt_param),
              (UnsupportedContentError, prompt_param), (GrammarError, "response_format"),
              (InvalidTokenError, getattr(exc, "field", None) or prompt_param)]
    return ApiError(400, message, next((p for kind, p in params if isinstance(exc, kind)), None))


# --- the app --------------------------------------------------------------------------------------

class Drain:
    """The server's shutdown as requests in flight see it: `begin` (uvicorn's shutdown started)
    sets `expired` a little before uvicorn's graceful-shutdown timeout runs out, so that each
    request still running ends itself with a 503 (a stream with an error event) rather than be
    cancelled by uvicorn mid-body, its connection cut and an ERROR traceback logged."""

    MARGIN = 0.25
    """Seconds (at most a quarter of the timeout) left for the last replies to go out."""

    def __init__(self) -> None:
        self.expired = False
        self._event: asyncio.Event | None = None

    def begin(self, timeout: float | None) -> None:
        """On the server's loop, as its shutdown starts; None: requests may take as long as they take."""
        if timeout is None:
            return
        asyncio.get_running_loop().call_later(max(0.0, timeout - min(self.MARGIN, timeout / 4)), self.expire)

    def expire(self) -> None:
        """End the requests still running now (on the server's loop): its timeout, or a second Ctrl+C."""
        self.expired = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Returns once the drain has expired."""
        if self._event is None:
            self._event = asyncio.Event()
            if self.expired:
                self._event.set()
        await self._event.wait()


def shutting_down() -> ApiError:
    """What a request still running when the `Drain` expires gets (the body of a stream's last event)."""
    return ApiError(503, "the server is shutting down and its --shutdown-timeout ran out before this request "
                         "ended; send it again (to this server once it is back, or another)",
                    code="server_shutting_down", kind="server_error")


def create_app(engine: "Engine", config: ServerConfig) -> FastAPI:
    """The HTTP face of one engine; the engine stays the caller's to close."""
    app = FastAPI(title="Hibana", docs_url=None, redoc_url=None, openapi_url=None)
    # browsers ask before a page's script may call (CORS): the answer comes before the API key's check,
    # which a preflight never carries; the key still guards every call that follows
    anyone = "*" in config.allowed_origins
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if anyone else list(config.allowed_origins),
                       allow_origin_regex=None if anyone else LOCAL_ORIGINS, allow_methods=["GET", "POST", "DELETE"],
                       allow_headers=["*"], expose_headers=[STATE_HEADER], max_age=600)
    app.engine = engine  # every adapter object exposes the engine it runs on (DESIGN.md)
    app.state.drain = Drain()
    chat = Chat(engine, tool_parser=config.tool_parser)
    text_chat = copy.copy(chat)  # legacy completions: the text as generated, a model's thinking left in it
    text_chat.thinks = False
    metrics = Metrics()
    app.state.metrics = metrics
    named = NamedStates(engine, config.max_named_states)
    app.state.named_states = named
    max_tokens_limit = min(config.max_tokens_limit or engine.max_model_len, engine.max_model_len)
    fingerprint = system_fingerprint(engine.fingerprint)

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY' (or 'x-api-key: "
                                "KEY')", code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        path = request.url.path  # any path a client sends would be a new time series
        metrics.requests.labels(path if path in ENDPOINTS else "other", str(exc.status)).inc()
        body = error_body(exc) if path in ANTHROPIC_PATHS else exc.body()
        return JsonReply(body, status_code=exc.status, headers=exc.headers())

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # no such route or method: say which, as OpenAI's "Invalid URL (...)"
            message = f"{message} ({request.method} {request.url.path:.200}); this server serves {', '.join(ENDPOINTS)}"
        return await on_api_error(request, ApiError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=exc)
        return await on_api_error(request, ApiError(500, "the server failed on this request; its log says why",
                                                    kind="server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and uptime checkers' probe
    async def health() -> JSONResponse:
        closed = engine.core.closed
        return JSONResponse({"status": "closed" if closed else "ok"}, status_code=503 if closed else 200)

    # created: when this server started serving the model (as vLLM's and Ollama's lists say); with the
    # fields of Anthropic's model object beside OpenAI's, so that either API's client reads the list
    started = int(time.time())
    served = {"id": config.model_name, "object": "model", "created": started, "owned_by": "hibana",
              "type": "model", "display_name": config.model_name,
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}

    def unknown_model(name: str) -> ApiError:
        return ApiError(404, f"the model {name!r:.80} does not exist here; this server serves {config.model_name!r}",
                        "model", "model_not_found")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [served], "has_more": False, "first_id": config.model_name,
                "last_id": config.model_name}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorized)])
    async def model(name: str) -> dict:  # the SDK's models.retrieve; a repo id as name holds a "/"
        if name != config.model_name:
            raise unknown_model(name)
        return served

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def prometheus() -> Response:
        return Response(await asyncio.to_thread(metrics.scrape, engine), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/hibana/states", dependencies=[Depends(authorized)])
    async def states() -> dict:
        """The engine's states, most recently used first."""
        infos = sorted(await asyncio.to_thread(engine.states), key=lambda info: info.last_use, reverse=True)
        return {"object": "list", "data": [
            {"id": info.id, "object": "hibana.state", "tokens": info.tokens, "computed": info.computed,
             "tier": info.tier, "busy": info.busy, "pinned": info.pinned, "last_used_at": round(info.last_use, 3),
             "client_named": named.holds(info.id)} for info in infos]}

    @app.delete("/v1/hibana/states/{state_id:path}", dependencies=[Depends(authorized)])
    async def delete_state(state_id: str) -> dict:
        """Close the state and remove its --state-dir file: neither comes back (an id holds a "/" as it is)."""
        try:
            found = await asyncio.to_thread(engine.registry.forget, state_id)
        except HibanaError as exc:
            raise api_error(exc) from None
        named.drop(state_id)
        if not found:
            kept = " nor kept in its --state-dir" if engine.config.cache.state_dir is not None else ""
            raise ApiError(404, f"no state {state_id!r:.300} is open on this server{kept}; GET /v1/hibana/states "
                                "lists those that are", None, "state_not_found")
        return {"id": state_id, "object": "hibana.state", "deleted": True}

    async def checked(request: Request, kind: type, model_optional: bool = False) -> Any:
        body = await read_body(request, config.max_body_bytes)
        parsed = await off_loop(len(body), lambda: parse_request(decode_json(body), kind))
        if parsed.model != config.model_name and not (model_optional and parsed.model is None):
            raise unknown_model(parsed.model)
        return parsed

    lead = leading_specials(engine.tokenizer)
    lead_text = "".join(engine.tokenizer.convert_ids_to_tokens(list(lead))) if lead else ""

    def with_lead(prompt: "str | TokenIds") -> "str | TokenIds":
        """A completions prompt given as text, with the tokenizer's BOS in front where it adds one and
        the text's tokens do not already start with it (as vLLM's and llama.cpp's completions do):
        a `LedText`, whose tokens are the BOS's, then the text's own (the text encoded alone, as the
        tokenizer would: after a BOS written as text, a SentencePiece tokenizer loses the first
        word's "▁"). Kept as text, so that the next turn's text continues the state on its text, as
        a prompt without a BOS does (as token ids, a reply that its text re-tokenizes otherwise left
        the state unused). A text whose tokens start with the BOS is the prompt as given, and so
        are token ids. Only the text's head is encoded to tell (the BOS's text, after any leading
        whitespace a special token may take): the turn encodes the whole prompt once, later."""
        if not lead or isinstance(prompt, TokenIds):
            return prompt
        head = prompt[:len(prompt) - len(prompt.lstrip()) + len(lead_text)]
        check_text(head, "the prompt")  # (the turn checks the rest)
        writes_lead = tuple(engine.tokenizer.encode(head, add_special_tokens=False)[:len(lead)]) == lead
        return prompt if writes_lead else LedText(prompt, lead)

    def chat_prompt(parsed: ChatRequest, state: str | None) -> tuple[ChatCall, str]:
        """A chat request's call and its rendered prompt (both chat endpoints')."""
        call = chat_call(parsed, state, max_tokens_limit)
        return call, chat.render_text(parsed.messages, call.listed_tools, call.reasoning, effort=call.effort)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request) -> Response:
        received = time.monotonic()
        parsed = await checked(request, ChatRequest)
        state = named_state(request.headers.get(STATE_HEADER))
        countable(parsed, engine.max_model_len)
        try:  # off the event loop: linear in the body, yet seconds for 8 MB
            call, prompt = await asyncio.to_thread(chat_prompt, parsed, state)
            choices = choice_calls(call)
        except HibanaError as exc:
            raise api_error(exc) from None
        servings = [Serving(chat, prompt, choice, config.request_timeout, named) for choice in choices]
        return await serve(request, received, servings, Reply(config.model_name, chat, call.n, fingerprint))

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def responses(request: Request) -> Response:
        """The Responses API: the request read as the chat request it means (`openai_responses`);
        an error the chat layer raised names the field this client sent (`in_responses_terms`)."""
        received = time.monotonic()
        parsed = await checked(request, ResponsesRequest)
        state = named_state(request.headers.get(STATE_HEADER))

        def prepared() -> tuple[ChatCall, str]:
            chat_request = parsed.chat_request()
            countable(chat_request, engine.max_model_len)
            return chat_prompt(chat_request, state)
        try:
            call, prompt = await asyncio.to_thread(prepared)
            servings = [Serving(chat, prompt, call, config.request_timeout, named)]
            return await serve(request, received, servings, ResponsesReply(config.model_name, chat, parsed))
        except HibanaError as exc:
            raise in_responses_terms(api_error(exc, "input")) from None
        except ApiError as exc:
            raise in_responses_terms(exc) from None

    @app.post("/v1/messages", dependencies=[Depends(authorized)])
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API: the request read as the chat request it means (`anthropic_messages`);
        errors in Anthropic's shape (`on_api_error`), naming the fields this client sent (`in_messages_terms`)."""
        received = time.monotonic()
        parsed: MessagesRequest | None = None
        try:
            parsed = await checked(request, MessagesRequest)
            state = named_state(request.headers.get(STATE_HEADER))

            def prepared() -> tuple[ChatCall, str]:
                chat_request = parsed.chat_request()
                countable(chat_request, engine.max_model_len)
                return chat_prompt(chat_request, state)
            call, prompt = await asyncio.to_thread(prepared)
            servings = [Serving(chat, prompt, call, config.request_timeout, named)]
            reply = MessagesReply(config.model_name, chat, call.params.max_tokens)
            return await serve(request, received, servings, reply)
        except HibanaError as exc:
            raise in_messages_terms(api_error(exc), parsed.origins if parsed else ()) from None
        except ApiError as exc:
            raise in_messages_terms(exc, parsed.origins if parsed else ()) from None

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorized)])
    async def count_tokens(request: Request) -> dict:
        """The tokens of the prompt a Messages request renders to (tools and system included)."""
        parsed: CountTokensRequest | None = None
        try:
            parsed = await checked(request, CountTokensRequest)

            def counted() -> int:
                chat_request = parsed.chat_request()
                countable(chat_request, engine.max_model_len)
                return len(chat.prompt_tokens(chat_prompt(chat_request, None)[1]))
            tokens = await asyncio.to_thread(counted)
        except HibanaError as exc:
            raise in_messages_terms(api_error(exc), parsed.origins if parsed else ()) from None
        except ApiError as exc:
            raise in_messages_terms(exc, parsed.origins if parsed else ()) from None
        metrics.requests.labels(request.url.path, "200").inc()
        return {"input_tokens": tokens}

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(request: Request) -> dict:
        """vLLM's: the tokens a completions prompt or a chat request's messages give the model."""
        parsed = await checked(request, TokenizeRequest, model_optional=True)

        def tokens() -> list[int]:
            chat_request, lead_in = tokenize_call(parsed)
            if chat_request is None:
                return text_chat.prompt_tokens(with_lead(parsed.prompt) if lead_in else parsed.prompt)
            countable(chat_request, engine.max_model_len)
            return chat.prompt_tokens(chat_prompt(chat_request, None)[1])
        try:
            ids = await asyncio.to_thread(tokens)
        except HibanaError as exc:
            raise api_error(exc, "prompt" if parsed.prompt is not None else "messages") from None
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if parsed.return_token_strs else None
        metrics.requests.labels(request.url.path, "200").inc()
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(request: Request) -> Response:
        """vLLM's: token ids as text, control tokens spelled out."""
        parsed = await checked(request, DetokenizeRequest, model_optional=True)
        bad = [t for t in parsed.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise ApiError(400, f"tokens: ids {bad[:5]} lie outside the vocabulary [0, {engine.vocab_size}); "
                                "give this model's token ids", "tokens")
        try:
            text = await asyncio.to_thread(engine.tokenizer.decode, parsed.tokens)
        except Exception as exc:  # noqa: BLE001 - ids of the model's vocabulary its tokenizer lacks
            raise ApiError(400, f"tokens: this model's tokenizer cannot decode them ({exc!s:.200})", "tokens") from None
        metrics.requests.labels(request.url.path, "200").inc()
        return JsonReply({"prompt": text})

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request) -> Response:
        received = time.monotonic()
        parsed = await checked(request, CompletionRequest)
        state = named_state(request.headers.get(STATE_HEADER))
        try:  # off the event loop, as a chat request's: linear in the body (2.5M stop_token_ids held every stream 4 s)
            prompts, call = await asyncio.to_thread(lambda: ([with_lead(p) for p in prompts_of(parsed, state)],
                                                             chat_call(parsed, state, max_tokens_limit)))
            choices = choice_calls(call)
        except HibanaError as exc:
            raise api_error(exc, "prompt") from None
        servings = [Serving(text_chat, prompt, choice, config.request_timeout, named)
                    for prompt in prompts for choice in choices]
        return await serve(request, received, servings, TextReply(config.model_name, call.n, text_chat, fingerprint))

    async def serve(request: Request, received: float, servings: "list[Serving]", reply: Reply) -> Response:
        """A request's turns (usually one; its n choices, its prompts), streamed or whole; errors up
        to their first tokens come as HTTP errors. A client that goes away cancels the turns
        (Starlette stops a streamed reply; `unless_gone` the rest)."""
        call = servings[0].call
        if len(servings) > 1 and not call.stream:
            return await serve_together(request, received, servings, reply)
        streams, firsts = await started(request, servings, reply)
        metrics.ttft.observe(time.monotonic() - received)
        headers = served_by_header([serving.state_id for serving in servings])
        if call.stream:
            return StreamingResponse(sse(request.url.path, reply, interleaved(firsts, streams), len(streams), call,
                                         metrics, request.app.state.drain),
                                     media_type="text/event-stream", headers=headers)
        with metrics.in_flight.track_inprogress():
            result = await unless_gone(request, rest(streams[0], firsts[0]), servings)
        metrics.requests.labels(request.url.path, "200").inc()
        return await whole_reply(reply, [result], headers)

    async def serve_together(request: Request, received: float, servings: "list[Serving]", reply: Reply) -> Response:
        """Several turns of one request (its prompts, its n choices), run at once and answered
        together; a turn's error fails the request once the others have ended (their states keep them)."""
        first_token = asyncio.Event()  # the request's first token is timed once, as a streamed request's is

        async def whole(serving: Serving) -> turn.ChatResult:
            deltas = serving.batches()
            first = await first_delta(deltas, reply)
            if not first_token.is_set():
                first_token.set()
                metrics.ttft.observe(time.monotonic() - received)
            return await rest(deltas, first)

        await all_held(request, servings)
        with metrics.in_flight.track_inprogress():  # the request once, however many turns it runs
            outcomes = await unless_gone(request, asyncio.gather(*map(whole, servings), return_exceptions=True),
                                         servings)
        failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failed:
            raise failed[0]
        metrics.requests.labels(request.url.path, "200").inc()
        return await whole_reply(reply, outcomes, served_by_header([serving.state_id for serving in servings]))

    async def whole_reply(reply: Reply, results: "list[turn.ChatResult]", headers: dict[str, str]) -> JsonReply:
        """The reply to a request not streamed, made and written as JSON in a worker thread: with
        log-probabilities it grows as tokens x top_logprobs x n (8 choices of 1,000 tokens, 20 each:
        11 MB, 4.5 s of CPU), and on the event loop every other client's stream stood still meanwhile."""
        return await asyncio.to_thread(lambda: JsonReply(reply.completion(*results), headers=headers))

    async def started(request: Request, servings: "list[Serving]",
                      reply: Reply) -> "tuple[list[AsyncIterator[list[ChatDelta]]], list[list[ChatDelta]]]":
        """The turns begun and their first deltas. A state the request names that a request whose
        client has gone still holds is waited for (`all_held`); one that a request still being read
        holds is a 409 at once (`X-Hibana-State`) or another state (`user`)."""
        await all_held(request, servings)
        streams = [serving.batches() for serving in servings]
        return streams, await unless_gone(request, first_deltas(streams, reply), servings)

    async def first_deltas(streams: "list[AsyncIterator[list[ChatDelta]]]", reply: Reply) -> list[list[ChatDelta]]:
        """Each turn's first deltas (`first_delta`), the turns started at once. If one fails, or the
        wait is cancelled, every turn is closed (its state let go) before the error goes on."""
        try:
            outcomes = await asyncio.gather(*(first_delta(stream, reply) for stream in streams),
                                            return_exceptions=True)
            failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if failed:
                raise failed[0]
            return outcomes
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise

    async def first_delta(deltas: AsyncIterator[list[ChatDelta]], reply: Reply) -> list[ChatDelta]:
        """The lease, the queue, the prefill and the first token(s), within the request timeout."""
        def busy() -> ApiError:
            return ApiError(503, f"no token within the server's request timeout ({config.request_timeout:g} s): "
                                 "it is busy; retry later", code="timeout", kind="server_error")
        try:
            return await asyncio.wait_for(anext(deltas), config.request_timeout)
        except ChatTimeoutError:  # no token yet, by the turn's clock
            raise busy() from None
        except HibanaError as exc:  # a QueueTimeoutError is a TimeoutError too: a 429 of its own
            raise api_error(exc, "prompt" if isinstance(reply, TextReply) else "messages") from None
        except asyncio.TimeoutError:  # no token yet, by this clock
            await deltas.aclose()
            raise busy() from None

    async def rest(deltas: AsyncIterator[list[ChatDelta]], first: list[ChatDelta]) -> turn.ChatResult:
        """The turn after its first deltas, to its result."""
        result = result_in(first)
        async with contextlib.aclosing(deltas):
            try:
                async for batch in deltas:
                    result = result_in(batch, result)
            except HibanaError as exc:
                raise api_error(exc) from None
        return result

    return app


class Serving:
    """One request's turn on the state `Chat.lease` picks (`turn.Open`); remembers that state."""

    def __init__(self, chat: Chat, prompt: "str | TokenIds", call: ChatCall, timeout: float | None,
                 named: "NamedStates | None" = None) -> None:
        self.chat, self.prompt, self.call, self.timeout, self.named = chat, prompt, call, timeout, named
        self.state_id = ""
        self.handle: "StateHandle | None" = None
        self.holder: LeaseHolder | None = None  # the note of the state it holds (`held`)

    async def held(self, caller: "asyncio.Task | None") -> None:
        """Once a request whose client has gone no longer holds the state this one names
        (`options.lease_holder`, as an adapter's async call: RELEASE_WAIT seconds at most): a client
        that closes a stream and at once sends its next turn finds its state, and its KV, again,
        rather than a 409 or, by `user`, a new state. A request still being read is not waited
        for. `caller`: the request's task, done once its reply is sent or given up."""
        self.holder = await lease_holder(self.chat.engine, self.call.state_id, caller)

    async def batches(self) -> AsyncIterator[list[ChatDelta]]:
        """The turn's deltas (`turn.arun_batches`), once `held`. Closed before its end (its client
        gone, the request timeout, the server's shutdown) the turn is marked left at once: it is
        cancelled, and its state let go in a worker thread, a moment later, which a request on
        that state meanwhile waits for."""
        deltas = turn.arun_batches(self.open)
        try:
            async for batch in deltas:
                yield batch
        finally:
            self.leave()  # (after the turn's end its lease is let go already: no one reads the mark)
            await deltas.aclose()

    def leave(self) -> None:
        """Mark the turn left by its client (`LeaseHolder.left`), before it is cancelled: a request
        on its state waits for the release from now on, not only once the cancel has reached it."""
        if self.holder is not None:
            self.holder.left = True

    def open(self, stack: contextlib.ExitStack) -> "tuple[turn.TurnRun, Any]":
        call = self.call
        if self.named is not None and call.state_id is not None:
            # on `stack` first: called last, once the lease has let the state go
            stack.callback(self.ended, self.named.in_process(call.state_id))
        open_turn = self.chat.opener(
            self.prompt, call.tools, call.params, lease=True, state_id=call.state_id, fallback=call.fallback,
            tool_choice=call.tool_choice, parse_tools=call.tools is not None,
            parallel_tool_calls=call.parallel_tool_calls, timeout=self.timeout)
        run, handle = self.holder.open(open_turn, stack)
        self.state_id, self.handle = handle.id, handle
        return run, handle

    def ended(self, in_process: bool) -> None:
        """The turn has ended (in a worker thread): the state its client named (not another one
        that served it while that one was busy) counts towards `NamedStates`' bound."""
        if self.handle is not None and self.handle.id == self.call.state_id and not in_process:
            try:
                self.named.served(self.handle)
            except Exception:  # noqa: BLE001 - the reply is made: housekeeping never fails it
                log.exception("the states clients named could not be bounded after a request on %r", self.handle.id)


class NamedStates:
    """The states this server's clients named (`X-Hibana-State`, `user`), least recently used
    first. Once a request on one ends, past `limit` the least recently used idle ones are closed
    (`StateRegistry.put_away`: written to the engine's state_dir first where it has one, so that
    a client naming one again finds its history); one in use is kept. States the engine made for
    calls that named none have their own bound (`max_unnamed_states`); states opened in process
    are not counted. A request costs a move to the end of an ordered dict: no scan."""

    def __init__(self, engine: "Engine", limit: int) -> None:
        self.registry, self.limit = engine.registry, limit
        self._order: "OrderedDict[str, StateHandle]" = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, state_id: str) -> bool:
        return state_id in self._order

    def in_process(self, state_id: str) -> bool:
        """Before a request naming `state_id` leases it: whether it is open but not of a client's naming."""
        with self._lock:
            return state_id not in self._order and self.registry.is_open(state_id)

    def drop(self, state_id: str) -> None:
        with self._lock:
            self._order.pop(state_id, None)

    def served(self, handle: "StateHandle") -> None:
        """A request on `handle`, the state its client named, has ended and let it go."""
        if handle.closed or self.registry.is_unnamed(handle):
            return
        with self._lock:
            self._order[handle.id] = handle
            self._order.move_to_end(handle.id)
        kept = 0  # in use: put back at the end
        while True:
            with self._lock:
                if len(self._order) <= self.limit or kept >= len(self._order):
                    return
                state_id, oldest = self._order.popitem(last=False)
            if oldest.closed or self.registry.put_away(oldest):
                log.debug("state %r closed: more than --max-named-states=%d states named by clients", state_id,
                          self.limit)
                continue
            kept += 1
            with self._lock:  # in use (or not written): kept, as used now
                self._order.setdefault(state_id, oldest)


async def all_held(request: Request, servings: "list[Serving]") -> None:
    """`Serving.held` for each of a request's turns, all before any of them leases a state: its turns
    (n choices, prompts) name one state, and a turn's note of it is no request gone to wait for. The
    notes name the request's task (the wait runs in a task of its own, `unless_gone`'s, which is
    done once it ends); a client that leaves meanwhile is gone at once."""
    caller = asyncio.current_task()
    await unless_gone(request, asyncio.gather(*(serving.held(caller) for serving in servings)))


def result_in(batch: list[ChatDelta], result: turn.ChatResult | None = None) -> turn.ChatResult | None:
    """The turn's result if `batch` brings it, else `result`."""
    return next((delta.result for delta in batch if delta.result is not None), result)


async def sse(endpoint: str, reply: Reply, choices: AsyncIterator[tuple[int, list[ChatDelta]]], turns: int,
              call: ChatCall, metrics: Metrics, drain: Drain) -> AsyncIterator[str]:
    """The reply as server-sent events, one write per batch of deltas the engine made at once for
    one of the request's `turns` (`interleaved`: each choice's chunks carry its index; its role
    goes with its first batch, the usage and [DONE] with the last result): each write is a send on
    the socket, and the GIL taken from the engine's step loop. A client that goes away closes
    this generator, which cancels the turns (their states keep what was generated so far); so
    does the server's shutdown when its timeout is near (`Drain`), after a last, error event."""
    def events(*chunks: dict) -> str:
        return "".join(map(reply.frame, chunks))

    def reply_events(*chunks: dict) -> str:
        """The reply's chunks; with include_usage each has the field, null but in the last (OpenAI's rule)."""
        return events(*({**chunk, "usage": None} for chunk in chunks)) if call.include_usage else events(*chunks)

    def batch_events(index: int, batch: list[ChatDelta]) -> str:
        """A batch's chunks; a turn's first opens with its role (`Reply.opening`)."""
        if index in opened:
            return reply_events(*reply.chunks(batch, index))
        opened.add(index)
        role = reply.role_chunk(index)  # (before the chunks: a Responses stream's response.created)
        return reply_events(*reply.opening(role, reply.chunks(batch, index)))

    opened: set[int] = set()  # the turns whose role is sent
    pending, results = "", {}
    with metrics.in_flight.track_inprogress():
        async with contextlib.aclosing(choices):
            try:
                async for index, batch in choices:
                    result = result_in(batch)
                    if result is None:
                        pending += batch_events(index, batch)
                    else:  # the whole turn's log-probabilities, a Responses stream's done events repeating each
                        #      item: in a worker thread (2,000 tokens' top 20 held every other stream 1.7 s)
                        pending += await asyncio.to_thread(batch_events, index, batch)
                        results[index] = result
                    if len(results) < turns and drain.expired:  # the turns cancelled on leaving
                        metrics.requests.labels(endpoint, "stream_error").inc()
                        yield pending + events(shutting_down().body())
                        return
                    if len(results) < turns:  # the last result's batch goes out with the usage and [DONE]
                        yield pending
                        pending = ""
            except HibanaError as exc:  # mid-stream: the status is sent; the error is the last event
                metrics.requests.labels(endpoint, "stream_error").inc()
                yield pending + events(api_error(exc).body())
                return
            except (GeneratorExit, asyncio.CancelledError):  # the client went away: counted as when not streamed
                metrics.requests.labels(endpoint, "499").inc()
                raise
    if len(results) == turns:
        ordered = [results[index] for index in range(turns)]
        if call.include_usage:
            pending += events(reply.usage_chunk(*ordered))
    metrics.requests.labels(endpoint, "200").inc()
    yield pending + reply.done


async def interleaved(firsts: list[list[ChatDelta]], streams: "list[AsyncIterator[list[ChatDelta]]]"
                      ) -> AsyncIterator[tuple[int, list[ChatDelta]]]:
    """The turns' batches, each with its turn's index: the first ones, then each as it comes, the
    next one of its turn awaited meanwhile. Closing this closes every turn."""
    waiting: dict[asyncio.Future, int] = {}
    try:
        for index, first in enumerate(firsts):
            yield index, first
        if len(streams) == 1:  # the usual request: no task per batch
            async for batch in streams[0]:
                yield 0, batch
            return
        waiting = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.__getitem__):
                index = waiting.pop(future)
                try:
                    batch = future.result()
                except StopAsyncIteration:  # that turn has ended
                    continue
                waiting[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, batch
    finally:
        for future in waiting:
            future.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def unless_gone(request: Request, work: Awaitable[T], servings: "Sequence[Serving]" = ()) -> T:
    """`work`, cancelled if the client closes its connection first (Starlette stops a streamed
    reply whose client left, not a handler still computing): the turn is cancelled and its state
    let go before this raises a 499 (nginx's "client closed request", for the metrics only). The
    turns of `servings` that `work` runs are marked left first (`Serving.leave`): the next turn a
    client sends at once on their state waits for it (the cancel reaches the turn, and its lease
    is let go, only after the turn's current wait, in a worker thread)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    drain: Drain = request.app.state.drain
    drained = asyncio.ensure_future(drain.wait())
    try:
        await asyncio.wait((task, gone, drained), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        drained.cancel()
        if not task.done():
            for serving in servings:
                serving.leave()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    # (a gather cancelled ends with a CancelledError set rather than cancelled: a request of several turns)
    if task.cancelled() or isinstance(task.exception(), asyncio.CancelledError):
        if drain.expired:
            raise shutting_down()
        raise ApiError(499, "the client closed the connection before the reply", code="client_closed")
    return task.result()


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (called once the body is read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read up to `limit` bytes (413 past it; 499 where the client leaves before its end,
    which was a 500 and a traceback logged as the server's failure)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes, more than this server's limit of {limit}",
                       code="request_too_large")
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise ApiError(413, f"the request body is more than this server's limit of {limit} bytes",
                               code="request_too_large")
    except ClientDisconnect:
        raise ApiError(499, "the client closed the connection before its request's body was sent",
                       code="client_closed") from None
    return bytes(body)


OFF_LOOP_BYTES = 1 << 16
"""A body larger than this is decoded and checked in a worker thread: 8 MB of JSON took seconds
to decode, walk for its depth and validate, and on the event loop every other client's stream
stood still meanwhile. A usual request's body is decoded in place (no thread hop)."""


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """`work()`, in a worker thread where it handles `size` bytes past `OFF_LOOP_BYTES`."""
    return await asyncio.to_thread(work) if size > OFF_LOOP_BYTES else work()


def decode_json(body: bytes) -> Any:
    """The body as JSON (400 for what is not JSON, or nests too deep)."""
    too_deep = ApiError(400, f"the request body nests objects and arrays more than {MAX_JSON_DEPTH} levels deep, "
                             "more than this server takes; flatten it")
    try:
        value = json.loads(body, parse_constant=not_json)
    except RecursionError:  # deeper than Python's json decodes
        raise too_deep from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    if nests_deeper(value, MAX_JSON_DEPTH):
        raise too_deep
    return value


def not_json(name: str) -> Any:
    """Python's json reads NaN and Infinity, which JSON has not (a NaN temperature passed the range
    checks' wording as "less than or equal to 2"): refused as the invalid JSON they are."""
    raise ValueError(f"{name} is not a JSON value")


# --- hibana serve ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hibana serve", description="Serve a model over OpenAI's chat completions, responses and completions "
                                         "APIs and Anthropic's messages API, every conversation's KV kept resident. "
                                         "Example: hibana serve demo --port 8000")
    parser.add_argument("model", help="checkpoint directory, Hugging Face repo id (org/name[@revision]), or demo")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=port_number, default=8000,
                        help="port to listen on (default 8000; 0: a free one)")
    parser.add_argument("--served-model-name", help="the model id clients name (default: MODEL as given)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"bearer token clients must send (default: ${API_KEY_ENV}; unset or empty: none wanted)")
    parser.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes,
                        help="largest request body accepted (default 8 MiB)")
    parser.add_argument("--max-tokens-limit", type=int,
                        help="most tokens one request may generate (default: the model's context)")
    parser.add_argument("--request-timeout", type=float,
                        help="seconds a request may take, waiting in the queue included (default: no limit)")
    parser.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="web pages whose scripts may call the server from a browser (CORS), e.g. "
                             "https://app.example.com, or '*' for any (default: pages on localhost only)")
    add_device_arguments(parser)
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument("--state-dir", help="folder where named states (X-Hibana-State) persist across "
                        "restarts: written when the server stops, found again by id after it starts")
    parser.add_argument("--max-named-states", type=state_count, default=ServerConfig.max_named_states, metavar="N",
                        help="states named by clients (X-Hibana-State, user) kept open between requests; past N "
                             "the least recently used idle ones are closed, written to --state-dir first where "
                             "given (a request naming one again resumes its history), else forgotten (default "
                             "%(default)s; 0: none kept between requests). DELETE /v1/hibana/states/ID forgets one")
    parser.add_argument("--tool-parser", metavar="NAME",
                        help="the registered tool parser that writes and reads tool calls (`hibana plugins` lists "
                             "them; a plugin's too); default: the model's chat format's, else the one its chat "
                             "template writes (vLLM's --tool-call-parser)")
    parser.add_argument("--memory-budget", type=_number_or_text, help="the engine's memory: weights, KV and workspace in bytes "
                        "(\"20GB\") or a fraction of the device (\"80%%\"); unified memory keeps headroom for the OS")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other engine option (EngineConfig), VALUE as JSON where it parses: "
                             "--option max_concurrent_agents=32 --option kv_dtype=fp8; repeatable")
    parser.add_argument("--shutdown-timeout", type=float,
                        help="seconds requests in flight may go on after SIGINT/SIGTERM before they are cancelled "
                             "(default: until they finish); named states are written to --state-dir after them")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="what the server logs (default info: one line per request)")
    return parser


def port_number(text: str) -> int:
    """A TCP port, refused at parsing rather than as a traceback from the socket's bind."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port


def state_count(text: str) -> int:
    """--max-named-states: a whole number >= 0, refused at parsing."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"a number of states is 0 or more, got {count}")
    return count


def _json_or_text(text: str) -> Any:
    """A command-line value as JSON where it parses, else the text itself (a bare word)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _number_or_text(text: str) -> float | int | str:
    """A command-line value as a number where it is one (`--memory-budget 0.8` is the fraction
    0.8, as in Python), else the text itself ("20GB", "80%")."""
    value = _json_or_text(text)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else text


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig overrides the command line names."""
    options: dict[str, Any] = {"device": args.device, "dtype": args.dtype,
                               "max_named_states": args.max_named_states}  # the engine's bound, no tighter
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if args.state_dir is not None:
        options["state_dir"] = args.state_dir
    if args.memory_budget is not None:
        options["memory_budget"] = args.memory_budget
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: write KEY=VALUE")
        options[key] = _json_or_text(value)
    return options


@contextlib.contextmanager
def serving(engine: "Engine", config: ServerConfig, host: str = "127.0.0.1", port: int = 0,
            startup_timeout: float = 30.0) -> Iterator[str]:
    """The server in a thread of this process (a notebook, a test, a benchmark), on `port` (0: a
    free one); yields its URL and stops it on leaving as `hibana serve` stops on a signal:
    requests in flight finish (within `config.shutdown_timeout`). The engine stays the caller's
    to close."""
    sock = bind(host, port)
    server = uvicorn_server(create_app(engine, config), config, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hibana-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise HibanaError(f"the server did not start on {host}:{port} within {startup_timeout:g} s")
            time.sleep(0.02)
        bound = sock.getsockname()[1]
        yield f"http://{f'[{host}]' if ':' in host else host}:{bound}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`hibana serve` (an entry point of `hibana.commands`); returns the exit status."""
    from hibana_core import Engine

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    sock = None
    try:
        config = ServerConfig(args.served_model_name or args.model, args.api_key, args.max_body_bytes,
                              args.max_tokens_limit, args.request_timeout, args.shutdown_timeout,
                              args.max_named_states, args.tool_parser, tuple(args.allowed_origins))
        if args.tool_parser is not None:  # before the load, as the address: a wrong name is said at once
            get_plugin_manager().lookup("tool_parser", args.tool_parser)
        sock = bind(args.host, args.port)  # before the load: an address in use is said at once
        engine = Engine.from_pretrained(args.model, **engine_options(args))
    except HibanaError as exc:
        if sock is not None:
            sock.close()
        print(f"hibana serve: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(engine, config)
    except HibanaError as exc:  # the chat layer's: a tool parser that is not registered, a template that breaks
        engine.close()
        sock.close()
        print(f"hibana serve: {exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        log.warning("serving on %s with no API key: anyone who can reach it can use the model", args.host)
    server = uvicorn_server(app, config, host=args.host, port=args.port,
                            log_level=args.log_level)
    host, port = sock.getsockname()[:2]  # uvicorn names no address for sockets it is given
    log.info("serving %s on http://%s:%d/v1 (Ctrl+C to stop)", config.model_name, f"[{host}]" if ":" in host
             else host, port)
    with stop_signals_unwind() as stopping, engine, sock:  # the handlers outlast the engine's close
        server.run(sockets=[sock])
        stopping.append("closing")  # a stop signal from here on waits for the named states
    return 0 if server.started else 1


def uvicorn_server(app: FastAPI, config: ServerConfig, **options: Any) -> "uvicorn.Server":
    """uvicorn's server for `app`, whose shutdown starts the app's `Drain` (the requests in flight
    end themselves just before `config.shutdown_timeout` runs out)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: "list[socket.socket] | None" = None) -> None:
            app.state.drain.begin(config.shutdown_timeout)
            await super().shutdown(sockets=sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn's force quit (a second Ctrl+C) left the requests in flight and the lifespan
            # to asyncio.run's cancelling, each logged as an ERROR traceback: the drain expires now
            # instead, so they end themselves at once (a 503) and the shutdown ends as it does
            if self.should_exit and sig == signal.SIGINT:
                self._captured_signals.append(sig)  # (raised again once uvicorn is done: `stop_signals_unwind`)
                log.warning("SIGINT while stopping: the requests in flight end now")
                asyncio.get_running_loop().call_soon_threadsafe(app.state.drain.expire)
                return
            super().handle_exit(sig, frame)

    return DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=config.shutdown_timeout, **options))


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound to `host`:`port`; a ConfigError where it cannot be (in use, no
    such address)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port "
                          "(0: a free one) or --host") from None
    return sock


class Stopped(Exception):
    """SIGINT or SIGTERM, once uvicorn has shut down on it."""


@contextlib.contextmanager
def stop_signals_unwind() -> Iterator[list]:
    """After its graceful shutdown uvicorn raises the stop signal again, for the handler it found:
    Python's default for SIGTERM ends the process at once, before the engine closes and writes
    the named states to --state-dir. With this handler the first signal unwinds the stack instead
    (the engine closes) and the process ends normally; a later one, or one after the caller has
    put something in the list this yields (its server stopped), is logged and waits: a second
    Ctrl+C or a supervisor's repeated SIGTERM once killed the process among the states' writes."""
    stopping: list = []

    def stop(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stopping:
            log.warning("%s while stopping: the engine is closing and writing the named states; wait", name)
            return
        stopping.append(name)
        raise Stopped(name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopping
    except Stopped as exc:
        log.info("stopped on %s", exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":  # python -m hibana_plugins.server MODEL ...: `hibana serve`
    sys.exit(main())
