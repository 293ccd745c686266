"""OpenAI's chat-completions (and legacy completions) wire format on Hibana's chat layer, no HTTP.

    JSON body --ChatRequest / CompletionRequest (checked)--> ChatCall: tools, SamplingParams, state id
    ChatDelta --Reply.chunk()--> one `chat.completion.chunk` (SSE), its tokens' logprobs with it;  ChatResult --completion()--> the reply

`hibana_plugins.server` does the HTTP (FastAPI); this module only reads and writes the JSON, so
that what a request means can be tested without a server. A request the spec allows but Hibana
cannot serve (audio, web search) is an ApiError, as is every malformed one: each says which field
is wrong (`param`), as OpenAI's errors do.
"""

from __future__ import annotations

import codecs
import dataclasses
import string
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hibana_core.chat import REASONING_EFFORTS, StreamedLogprobs, TokenIds, assistant_message
from hibana_core.config import MAX_STOPS, SamplingParams, token_id_key
from hibana_core.errors import ConfigError
from hibana_core.messages import escaped_surrogates, normalize_tool_choice, normalize_tools, response_format_schema
from hibana_core.messages import json_text  # noqa: F401 (re-exported: the server's and the other APIs' replies)
from hibana_core.turn import ChatDelta, ChatResult, Usage, openai_finish_reason

if TYPE_CHECKING:
    from hibana_core.chat import Chat
    from hibana_plugins.hookspecs import ToolCall

STATE_HEADER = "X-Hibana-State"
MAX_STATE_ID = 256  # characters of an id a client names its state by
MAX_PROMPTS = 64    # turns one request may run at once: its prompts (legacy completions) times n


def served_by_header(state_ids: Sequence[str]) -> dict[str, str]:
    """The reply's `X-Hibana-State` header, naming the states that served it, comma-separated. A
    name is written as it is where a header carries it so (printable Latin-1, no space at its ends)
    and it holds no "%" or ","; any other is percent-encoded as UTF-8, the form `named_state` reads
    back, so that a client sending the header it got reaches that state, and every header names its
    states alone. (Written raw, a name past Latin-1 failed the reply after its turn ran.)"""
    def written(name: str) -> str:
        if (name.isprintable() and name == name.strip() and all(ord(c) < 256 for c in name)
                and not {"%", ","} & set(name)):
            return name
        return urllib.parse.quote(name, safe=string.punctuation.replace("%", "").replace(",", ""))
    return {STATE_HEADER: ", ".join(map(written, state_ids))}


def named_state(header: str | None) -> str | None:
    """The state a request's `X-Hibana-State` header names: percent-decoded as UTF-8 (a literal
    "%" is "%25"). Raw bytes past ASCII are read as UTF-8 where they are (Starlette hands a header
    over as Latin-1), else as Latin-1."""
    if header is None:
        return None
    try:
        text = header.encode("latin-1").decode("utf-8")
    except UnicodeError:
        text = header
    try:
        name = urllib.parse.unquote(text, errors="strict")
    except UnicodeDecodeError:
        raise ApiError(400, f"the {STATE_HEADER} header is percent-encoded UTF-8, and {text!r} decodes to no "
                            "UTF-8 text; encode the name's UTF-8 bytes (a literal % is %25)") from None
    if not 0 < len(name) <= MAX_STATE_ID:
        raise ApiError(400, f"the {STATE_HEADER} header must name a state in 1 to {MAX_STATE_ID} characters")
    return name


class ApiError(Exception):
    """An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry = retry
        """Whether a client should repeat the request: `x-should-retry`, which OpenAI's own SDKs
        read before their rule (retry 408, 409, 429 and 5xx); None: no header."""

    def headers(self) -> dict[str, str]:
        return {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# --- the request -------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM's: the usage in every chunk; refused (`chat_call`)


class SamplingRequest(BaseModel):
    """What both endpoints take alike: the model, streaming, how to sample, and the state to
    serve on (`user`). Strict: "5" is not a number here, as it is not for OpenAI."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # (JSON's 1e400 reads as inf)
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # what the sampler's int64 generator takes
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's extra sampling fields (OpenAI has none of them; clients send them in extra_body)
    top_k: int | None = Field(None, ge=-1, lt=2**63)  # -1 or 0: every token; past int64 the sampler's refusal
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)  # vLLM's: no upper bound
    user: str | None = Field(None, max_length=MAX_STATE_ID)
    logit_bias: dict[str, Any] | None = None  # token id (a string, as JSON's keys) -> bias in [-100, 100]
    ignore_eos: bool | None = None  # vLLM's too: run on past the end-of-sequence tokens
    stop_token_ids: list[int] | None = None  # vLLM's: token ids that end the reply as a stop string does


class ChatRequest(SamplingRequest):
    """The fields of a chat-completions request. As OpenAI does, a field the API does not know is
    refused; fields it knows that change nothing here (metadata, store, ...) are accepted, and
    those Hibana cannot honour (audio, web search) are refused when asked for."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # OpenAI's levels (`hibana_core.chat`)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and SGLang's; enable_thinking only
    prediction: dict[str, Any] | None = None  # predicted output: a speed hint, never the output
    # known, and refused unless null (`unsupported`)
    audio: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # accepted, and nothing to do here
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    safety_identifier: str | None = None


class CompletionRequest(SamplingRequest):
    """A legacy completions request: a prompt continued as it is, no chat template; as text or as
    token ids (OpenAI's four forms: a string, strings, ids, lists of ids)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)  # a list: a choice per prompt
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for this endpoint
    echo: Literal[False] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # the alternatives at each token (OpenAI's: up to 5)
    best_of: Literal[1] | None = None
    suffix: None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completions prompt (`prompt`), or a chat request's messages and tools
    as the chat endpoint renders them (`messages`): the tokens the model would be given."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # vLLM's own clients may leave it out
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Literal[True] | None = None  # the chat endpoint's prompt always ends with it
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_body(cls, body: Any) -> Any:
        """A whole chat request's body counts as its messages and tools: its other fields (sampling,
        tool_choice, response_format, stream...) do not change the prompt, and are left out, as
        vLLM's /tokenize leaves them; a field no chat request has is still refused."""
        if isinstance(body, dict) and "messages" in body:
            return {k: v for k, v in body.items() if k in cls.model_fields or k not in ChatRequest.model_fields}
        return body


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text, control tokens spelled out."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def tokenize_call(request: TokenizeRequest) -> tuple[ChatRequest | None, bool]:
    """What a /tokenize request asks for: the chat request its messages mean (None for a prompt),
    and whether a prompt takes the tokenizer's BOS in front (as /v1/completions gives it)."""
    if (request.prompt is None) == (request.messages is None):
        raise ApiError(400, "give either prompt (a completions prompt) or messages (a chat request's)",
                       "prompt" if request.prompt is None else "messages")
    if request.prompt is not None:
        chat_fields = [f for f in ("tools", "reasoning_effort", "chat_template_kwargs", "add_generation_prompt")
                       if getattr(request, f) is not None]
        if chat_fields:
            raise ApiError(400, f"{chat_fields[0]} goes with messages, not with a prompt", chat_fields[0])
        return None, request.add_special_tokens is not False
    if request.add_special_tokens:  # the chat template writes the BOS where the model takes one
        raise ApiError(400, "add_special_tokens: the chat template writes the special tokens of a chat request; "
                            "leave it out (or false) with messages", "add_special_tokens")
    fields = {"model": request.model or "", "messages": request.messages, "tools": request.tools,
              "reasoning_effort": request.reasoning_effort, "chat_template_kwargs": request.chat_template_kwargs}
    return parse_request({k: v for k, v in fields.items() if v is not None}, ChatRequest), False


R = TypeVar("R", bound=BaseModel)


def parse_request(body: Any, kind: "type[R]" = ChatRequest) -> "R":
    """The checked request; an ApiError naming the first wrong field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(map(str, _field_path(body, first["loc"]))) or None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param) from None
        if first["type"] in ("literal_error", "none_required") and param in ("echo", "best_of", "suffix"):
            raise ApiError(400, f"{param}: Hibana does not support this yet; leave it out", param) from None
        raise ApiError(400, f"{param}: {first['msg']}", param) from None


def _field_path(body: Any, loc: tuple) -> list:
    """The part of a pydantic error location that names the request's own fields and items
    (past it come the names of a union's branches: "tool_choice.literal[...]" is "tool_choice")."""
    path = []
    for part in loc:
        if isinstance(body, dict) and part in body or isinstance(body, list) and isinstance(part, int) \
                and 0 <= part < len(body):
            path.append(part)
            body = body[part]
        else:
            break
    return path or list(loc[:1])


@dataclass(frozen=True)
class ChatCall:
    """What one request asks of the chat layer (`Chat.opener`'s arguments)."""

    listed_tools: list[dict] | None  # the tools the prompt lists
    tools: list[dict] | None    # those the calls are held to (`allowed_tools` may name fewer)
    tool_choice: str            # "auto", "none", "required" or a tool's name
    parallel_tool_calls: bool
    params: SamplingParams
    state_id: str | None        # the state the client pinned, if any
    fallback: bool              # another state when the pinned one is busy (`user`, not the header)
    stream: bool
    include_usage: bool
    n: int = 1                     # choices per prompt, each its own turn (`choice_calls`)
    reasoning: bool | None = None  # a reasoning model's thinking on or off; None: the template's default
    effort: str | None = None      # reasoning_effort's level, for a template that reads it (gpt-oss's)


def chat_call(request: ChatRequest | CompletionRequest, state_header: str | None,
              max_tokens_limit: int) -> ChatCall:
    """The call a checked request makes; ApiError for what Hibana refuses (too many choices or tokens)."""
    n = request.n or 1
    if n > MAX_PROMPTS:
        raise ApiError(400, f"n={n}: at most {MAX_PROMPTS} choices per request", "n")
    if n > 1 and state_header is not None:
        raise ApiError(400, f"n={n}: the {STATE_HEADER} header pins one state, and each choice is a turn on a state "
                            "of its own; ask n=1 with it", "n")
    if request.stop_token_ids and not all(0 <= t < 2**63 for t in request.stop_token_ids):
        raise ApiError(400, "stop_token_ids: token ids are 0 or more, ids of this model's tokenizer", "stop_token_ids")
    chat = isinstance(request, ChatRequest)
    if chat:
        unsupported(request)
    max_tokens = (chat and request.max_completion_tokens) or request.max_tokens
    if max_tokens is not None and max_tokens > max_tokens_limit:
        param = "max_completion_tokens" if chat and request.max_completion_tokens else "max_tokens"
        raise ApiError(400, f"{param}={max_tokens} is more than this server allows ({max_tokens_limit}); "
                            "ask for fewer tokens", param)
    if chat:
        contents_given(request.messages)
    listed = normalize_tools(function_tools(request.tools)) if chat else None
    choice, tools = tool_choice(request.tool_choice, listed) if chat else ("none", None)
    # chat: logprobs (a switch) and top_logprobs; legacy completions: logprobs, the alternatives' count
    logprobs = bool(request.logprobs) if chat else request.logprobs is not None
    schema, strict = response_schema(request.response_format) if chat else (None, True)
    top_logprobs = (request.top_logprobs or 0) if chat else (request.logprobs or 0)
    if chat and request.top_logprobs and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if isinstance(request.stop, list) and not all(request.stop):  # (a lone "" is no stop, as `stop or ()` reads it)
        raise ApiError(400, "stop: each stop string needs at least one character", "stop")
    if isinstance(request.stop, list) and len(request.stop) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings per request, got {len(request.stop)}", "stop")
    if request.stream_options is not None and not request.stream:  # as OpenAI refuses it
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        raise ApiError(400, "stream_options.continuous_usage_stats (vLLM's usage in every chunk) is not supported; "
                            "include_usage: true sends the usage in the last chunk",
                       "stream_options.continuous_usage_stats")
    params = SamplingParams(
        max_tokens=max_tokens or max_tokens_limit,
        temperature=_given(request.temperature, 0.0),  # greedy unless asked: as in-process
        top_p=_given(request.top_p, 1.0), seed=request.seed, stop=request.stop or (),
        presence_penalty=_given(request.presence_penalty, 0.0),
        frequency_penalty=_given(request.frequency_penalty, 0.0),
        top_k=max(_given(request.top_k, 0), 0), min_p=_given(request.min_p, 0.0),
        repetition_penalty=_given(request.repetition_penalty, 1.0),
        ignore_eos=bool(request.ignore_eos), stop_token_ids=tuple(request.stop_token_ids or ()),
        json_schema=schema, strict_schema=strict if chat else True,  # (completions have none)
        logprobs=logprobs, top_logprobs=top_logprobs if logprobs else 0,
        logit_bias=logit_bias(request.logit_bias))
    explicit = state_header or request.user or None  # an empty user names no one (OpenAI takes it)
    return ChatCall(listed, tools, choice, not chat or request.parallel_tool_calls is not False, params, explicit,
                    fallback=state_header is None, stream=bool(request.stream),
                    include_usage=bool(request.stream_options and request.stream_options.include_usage), n=n,
                    reasoning=thinking_switch(request) if chat else None,
                    effort=reasoning_level(request) if chat else None)


def logit_bias(given: dict[str, Any] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, the bias in [-100, 100]) as SamplingParams takes
    it; ApiError for a key that is no token id or a bias out of range (ids past the model's
    vocabulary are the engine's InvalidTokenError, a 400 naming the field too)."""
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        token = token_id_key(key)  # ids past the vocabulary are the engine's InvalidTokenError
        if token is None:
            raise ApiError(400, f"logit_bias: keys are token ids of this model's tokenizer (\"1234\"), got "
                                f"{key!r:.40}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{token}]: a bias is a number in [-100, 100], got {value!r:.40}",
                           "logit_bias")
        if token in bias:  # ("1" and "01": the last one silently won)
            first = next(k for k in given if token_id_key(k) == token)
            raise ApiError(400, f"logit_bias names token {token} twice (keys {first!r:.40} and {key!r:.40}); "
                                "give each token id once", "logit_bias")
        bias[token] = float(value)
    return bias


def choice_calls(call: ChatCall) -> list[ChatCall]:
    """The call of each of the n choices, each its own turn: a seeded request's choice i samples
    with seed + i (one seed samples the same tokens), so that choice 0 is the reply to n=1."""
    seed = call.params.seed
    return [call if i == 0 or seed is None else dataclasses.replace(
        call, params=dataclasses.replace(call.params, seed=_int64(seed + i))) for i in range(call.n)]


def _int64(seed: int) -> int:
    """`seed` wrapped into the signed 64-bit range the sampler takes (choice i of a seed near its top)."""
    return (seed + 2**63) % 2**64 - 2**63


_UNSUPPORTED = {
    "audio": "audio output is not supported by Hibana (text only); leave it out",
    "functions": "functions (OpenAI's deprecated form) is not supported; give the same functions as tools: "
                 "[{'type': 'function', 'function': {...}}]",
    "function_call": "function_call (OpenAI's deprecated form) is not supported; use tool_choice",
    "web_search_options": "web search is not supported by Hibana; give the model a search tool instead",
}


def unsupported(request: ChatRequest) -> None:
    """OpenAI's fields that Hibana knows and cannot honour: accepted as null (clients that send
    every field), refused with what to do otherwise. `modalities` may name text only (it asks for
    audio output beside the `audio` options: served as text, that request was silently dropped)."""
    for name, what in _UNSUPPORTED.items():
        if getattr(request, name) is not None:
            raise ApiError(400, what, name)
    other = [m for m in request.modalities or () if m != "text"]
    if other:
        raise ApiError(400, f"modalities: Hibana writes text only, and {other[0]!r:.40} was asked for; leave "
                            "modalities out or give [\"text\"]", "modalities")


def countable(request: ChatRequest, context: int) -> None:
    """A context-length error, before any rendering, for more messages or tools than the model's
    `context` holds tokens: each renders to a token at least (its role's markup, its name). Rendering
    costs ~0.2 ms a message, a tool more: 140,000 tools (7.6 MB) took 100 s of CPU before their 400."""
    for name, items in (("messages", request.messages), ("tools", request.tools or ())):
        if len(items) > context:
            raise context_exceeded(f"{len(items)} {name} cannot fit in the model's context of {context} tokens (each "
                                   "takes one at least); shorten the history", name)


def context_exceeded(message: str, param: str | None) -> ApiError:
    """A prompt past the model's context: a 400 `context_length_exceeded` whose message opens with
    OpenAI's words for it. Clients tell an overflow from another bad request by those words: the
    openai client's error text is the message alone, and LangChain's ChatOpenAI raises its
    ContextOverflowError (on which SummarizationMiddleware retries a shorter prompt) only where
    the message says so; Hibana's own words made it a plain invalid request."""
    return ApiError(400, f"Input tokens exceed the configured limit: {message}", param, "context_length_exceeded")


def contents_given(messages: list[dict]) -> None:
    """OpenAI's rules: a system, developer, user or tool message has content (an assistant's may
    hold calls only), rendered without it the model would read an empty turn; a tool message
    names the call it answers (`tool_call_id`)."""
    for i, message in enumerate(messages):
        if message.get("role") in ("system", "developer", "user", "tool") and message.get("content") is None:
            raise ApiError(400, f"messages[{i}] is a {message['role']} message without content; give it a string "
                                "or a list of text parts", "messages")
        if message.get("content") == []:  # OpenAI's: an array of at least one part
            raise ApiError(400, f"messages[{i}].content is an empty list of parts; give at least one part, or a "
                                "string (an assistant message holding only calls: null)", f"messages[{i}].content")
        if message.get("role") == "tool" and not message.get("tool_call_id"):
            raise ApiError(400, f"messages[{i}] is a tool message without tool_call_id; give the id of the call "
                                "it answers", "messages")


def function_tools(tools: list[dict] | None) -> list[dict] | None:
    """The request's tools, each a function tool: OpenAI's custom (free-text) tools are refused."""
    for i, tool in enumerate(tools or ()):
        if tool.get("type", "function") != "function":
            raise ApiError(400, f"tools[{i}] has type {tool.get('type')!r:.40}; Hibana calls function tools only: "
                                "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}", "tools")
    return tools or None


def tool_choice(choice: str | dict | None, tools: list[dict] | None) -> tuple[str, list[dict] | None]:
    """`tool_choice` in each of OpenAI's forms, as the chat layer's choice ("auto", "none",
    "required" or a tool's name) and the tools the calls are held to: "none" / "auto" /
    "required"; {"type": "function", "function": {"name": ...}} (or the Responses API's
    {"type": "function", "name": ...}): that tool; {"type":
    "allowed_tools", "allowed_tools": {"mode", "tools"}}: the prompt still lists every tool (its
    KV stays reused while the allowed set changes) and the calls are held to those named."""
    if not isinstance(choice, dict):
        return normalize_tool_choice(choice, tools), tools
    kind = choice.get("type")
    if kind == "function":
        name = _named_tool(choice)  # (the Responses API's form names the tool at the top level)
        offered = [t["function"]["name"] for t in tools or ()]
        if name not in offered:  # "none" or "auto" here names a tool, not a mode
            raise ApiError(400, f"tool_choice.function.name is {name!r:.80}; name one of the tools offered: "
                                f"{offered}", "tool_choice")
        return name, tools
    if kind == "allowed_tools":
        return allowed_tools(choice.get("allowed_tools"), tools)
    raise ApiError(400, f"tool_choice has type {kind!r:.40}; use 'function' (one tool) or 'allowed_tools' "
                        "(Hibana calls function tools only)", "tool_choice")


def allowed_tools(spec: Any, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """The mode and the offered tools that `tool_choice.allowed_tools` names."""
    mode = spec.get("mode") if isinstance(spec, dict) else None
    named = spec.get("tools") if isinstance(spec, dict) else None
    if mode not in ("auto", "required") or not isinstance(named, list) or not named:
        raise ApiError(400, "tool_choice.allowed_tools needs a mode ('auto' or 'required') and a non-empty list of "
                            "tools: [{'type': 'function', 'function': {'name': ...}}]", "tool_choice")
    offered = [t["function"]["name"] for t in tools or ()]
    names = [_named_tool(t) for t in named]
    unknown = [name for name in names if name not in offered]
    if unknown:
        raise ApiError(400, f"tool_choice.allowed_tools names {unknown[0]!r:.80}, which is not one of the tools "
                            f"offered ({offered})", "tool_choice")
    return mode, [t for t in tools if t["function"]["name"] in names]


def _named_tool(entry: Any) -> Any:
    """The name in a named tool_choice or an `allowed_tools` entry: {"type": "function", "function":
    {"name": ...}}, or the Responses API's {"type": "function", "name": ...}."""
    if not isinstance(entry, dict):
        return None
    function = entry.get("function", entry)
    return function.get("name") if isinstance(function, dict) else None


def prompts_of(request: CompletionRequest, state_header: str | None) -> list[str | TokenIds]:
    """A completions request's prompts: its string or token ids, or its list of either, each
    prompt its own turns (n) and choices, each on the state it continues. Token ids are the
    prompt as given (`TokenIds`)."""
    given = request.prompt
    if isinstance(given, str) or isinstance(given[0], int):
        given = [given]
    prompts = [p if isinstance(p, str) else TokenIds(p) for p in given]
    if len(prompts) > 1 and state_header is not None:
        raise ApiError(400, f"prompt: the {STATE_HEADER} header pins one state, and {len(prompts)} prompts were given; "
                            "give one prompt with it", "prompt")
    if len(prompts) * (request.n or 1) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: at most {MAX_PROMPTS} prompts per request (times n), got {len(prompts)}"
                            f"{f' times n={request.n}' if (request.n or 1) > 1 else ''}", "prompt")
    if not all(prompts):
        raise ApiError(400, "prompt: every prompt needs at least one character (or token)", "prompt")
    return prompts


def thinking_switch(request: ChatRequest) -> bool | None:
    """Whether a reasoning model thinks (the chat template's `enable_thinking`, Qwen3's switch):
    `chat_template_kwargs.enable_thinking` as vLLM and SGLang take it; None leaves the template's
    default. `reasoning_effort` goes to the chat layer as it is (`reasoning_level`), which reads
    "none" as thinking off, unless the model's chat format declares "none" as a level of its own
    (`Chat.render_text`); the two disagreeing is a 400. A model without thinking ignores both,
    as OpenAI's non-reasoning models do."""
    kwargs = request.chat_template_kwargs or {}
    other = sorted(set(kwargs) - {"enable_thinking"})
    if other:
        raise ApiError(400, f"chat_template_kwargs.{other[0]:.80}: Hibana passes only enable_thinking to the chat "
                            "template", f"chat_template_kwargs.{other[0]:.80}")
    enabled = kwargs.get("enable_thinking")
    if enabled is not None and not isinstance(enabled, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       "chat_template_kwargs.enable_thinking")
    effort = None if request.reasoning_effort is None else request.reasoning_effort != "none"
    if None not in (enabled, effort) and enabled != effort:
        raise ApiError(400, f"reasoning_effort={request.reasoning_effort!r} and chat_template_kwargs.enable_thinking="
                            f"{str(enabled).lower()} disagree; give one of them", "reasoning_effort")
    return enabled


def reasoning_level(request: ChatRequest) -> str | None:
    """`reasoning_effort` as the chat layer takes it: a level a template may read (gpt-oss's writes
    "Reasoning: high" into its system message), or "none": thinking off, or the level "none" of a
    chat format that declares one (`Chat.render_text`)."""
    return request.reasoning_effort


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def response_schema(response_format: dict | None) -> tuple[dict | None, bool]:
    """The JSON schema `response_format` holds the reply to (through the grammar; None for text)
    and whether it is strict (`messages.response_format_schema`), its refusals as 400s."""
    try:
        return response_format_schema(response_format)
    except ConfigError as exc:
        raise ApiError(400, str(exc), getattr(exc, "param", "response_format")) from None


# --- the reply ---------------------------------------------------------------------------------

class Reply:
    """The id, time, model and system fingerprint that every chunk of one reply carries."""

    def __init__(self, model: str, chat: "Chat | None" = None, n: int = 1, fingerprint: str | None = None) -> None:
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint  # `system_fingerprint`: None leaves the field out
        self.chat = chat  # writes token log-probabilities in OpenAI's shape (None: no request asks for them)
        self.n = n        # choices per prompt
        self._streamed: dict[int, StreamedLogprobs] = {}  # choice -> its chunks' log-probabilities

    def _logprobs(self, result: ChatResult) -> dict | None:
        content = None if self.chat is None else self.chat.openai_logprobs(result)
        return None if content is None else {"content": content, "refusal": None}

    def _chunk_logprobs(self, delta: ChatDelta, index: int) -> dict | None:
        """A chunk's log-probabilities, as OpenAI streams them (`StreamedLogprobs`): the chunks'
        join is the whole reply's."""
        if self.chat is None:
            return None
        streamed = self._streamed.setdefault(index, StreamedLogprobs(self.chat))
        streamed.add(delta)
        content = streamed.take(delta.result)
        return None if content is None else {"content": content, "refusal": None}

    def completion(self, *results: ChatResult) -> dict:
        """The whole reply: one choice per result (the request's n)."""
        return {**self._head("chat.completion"), "choices": [self._choice(i, r) for i, r in enumerate(results)],
                "usage": usage(total_usage(results, self.n))}

    def _choice(self, index: int, result: ChatResult) -> dict:
        message = assistant_message(result)  # the thinking as reasoning_content, never inside the content
        message["content"] = _answer(result)
        if result.tool_calls and not message["content"]:
            message["content"] = None  # OpenAI's shape for a turn of calls only
        return {"index": index, "message": message, "logprobs": self._logprobs(result),
                "finish_reason": openai_finish_reason(result)}

    def chunk(self, delta: ChatDelta, index: int = 0) -> dict:
        """The chunk for one delta of choice `index`; the result's chunk carries the finish reason."""
        logprobs = self._chunk_logprobs(delta, index)
        if delta.result is not None:
            return self._chunk({}, openai_finish_reason(delta.result), logprobs, index)
        if delta.tool_call is not None:
            call = delta.tool_call
            piece: dict[str, Any] = {"index": call.index}  # (its text as the whole reply's: `assistant_message`)
            function: dict[str, str] = {"arguments": escaped_surrogates(call.arguments_fragment)}
            if call.id is not None:  # the call's first delta
                piece.update(id=call.id, type="function")
                function = {"name": call.name or "", **function}
            return self._chunk({"tool_calls": [{**piece, "function": function}]}, logprobs=logprobs, index=index)
        if delta.reasoning:
            return self._chunk({"reasoning_content": delta.reasoning}, logprobs=logprobs, index=index)
        return self._chunk({"content": delta.text}, logprobs=logprobs, index=index)

    def chunks(self, deltas: Sequence[ChatDelta], index: int = 0) -> list[dict]:
        """The chunks for deltas made at once: a run of text (or of thinking) is one chunk, as
        OpenAI's own deltas of several tokens; a tool-call delta or the result, one chunk each. The
        markup of a call max_tokens cut off is left out, as from the whole reply's content (`_answer`)."""
        final = next((delta.result for delta in deltas if delta.result is not None), None)
        drop = final is None or final.finish_reason == "length"  # (its log-probabilities go with the result's)
        return [self.chunk(delta, index) for delta in joined(deltas) if not (delta.cut_call and drop)]

    def role_chunk(self, index: int = 0) -> dict | None:
        """Choice `index`'s first chunk, before any text (None: the format has none)."""
        return self._chunk({"role": "assistant", "content": ""}, index=index)

    @staticmethod
    def opening(role: dict | None, chunks: list[dict]) -> list[dict]:
        """A choice's first chunks: its `role_chunk`, then `chunks`; a reply that opens with a tool
        call has the role in that call's chunk instead, with content null, as OpenAI's has (no
        content "" in a reply of calls only, whose whole message has content null). That chunk
        carries no log-probabilities, as no first chunk of OpenAI's does: its tokens' come with the
        call's arguments in the next (the openai client's stream helper takes a later choice's first
        chunk's into that choice and then adds them again: choice 1 of n=2 held them twice)."""
        choices = chunks[0].get("choices") if chunks and role is not None else None
        delta = choices[0].get("delta", {}) if choices else {}
        if "tool_calls" in delta:
            choices[0]["delta"] = {"role": "assistant", "content": None, **delta}
            if choices[0]["logprobs"] is None:
                return chunks
            call = delta["tool_calls"][0]
            head = {**call, "function": {**call["function"], "arguments": ""}}  # its id, type and name
            rest = {"index": call["index"], "function": {"arguments": call["function"]["arguments"]}}
            first = {**choices[0], "delta": {**choices[0]["delta"], "tool_calls": [head]}, "logprobs": None}
            return [{**chunks[0], "choices": [first]},
                    {**chunks[0], "choices": [{**choices[0], "delta": {"tool_calls": [rest]}}]}, *chunks[1:]]
        return chunks if role is None else [role, *chunks]

    def usage_chunk(self, *results: ChatResult) -> dict:
        """The last chunk with `stream_options.include_usage`: no choices, the usage."""
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(total_usage(results, self.n))}

    done = "data: [DONE]\n\n"
    """What ends the stream after the last chunk."""

    @staticmethod
    def frame(chunk: dict) -> str:
        """One chunk as a server-sent event."""
        return f"data: {json_text(chunk)}\n\n"

    def _chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def _head(self, kind: str) -> dict:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            head["system_fingerprint"] = self.fingerprint
        return head


def joined(deltas: Sequence[ChatDelta]) -> list[ChatDelta]:
    """`deltas` with each run of text-only deltas, and each run of thinking-only ones, made one."""
    out: list[ChatDelta] = []
    for delta in deltas:
        kind = _piece_kind(delta)
        if kind is not None and out and _piece_kind(out[-1]) == kind:
            out[-1] = ChatDelta(text=out[-1].text + delta.text, reasoning=out[-1].reasoning + delta.reasoning,
                                logprobs=out[-1].logprobs + delta.logprobs)
        else:
            out.append(delta)
    return out


def _piece_kind(delta: ChatDelta) -> str | None:
    """"text" or "reasoning" for a delta of that alone, None for any other."""
    if delta.tool_call is not None or delta.result is not None or delta.cut_call \
            or bool(delta.text) == bool(delta.reasoning):
        return None
    return "text" if delta.text else "reasoning"


def _answer(result: ChatResult) -> str:
    """A reply's message content: the markup of a call max_tokens cut off is left out (finish
    "length" says why there is no call); that of a call a stop sequence cut stays, as vLLM's
    parsers leave a call they cannot parse, so that the reply does not come back empty with
    finish "stop" and nothing to say a call was begun."""
    return result.content if result.finish_reason == "length" else result.text


def in_order(result: ChatResult) -> list[str | ToolCall]:
    """A reply's answer (`_answer`) and its calls in the order they were written, as its stream
    sent them: the text before each call, the call, the text after the last one. A reply in
    blocks (Anthropic's content, the Responses API's output items) keeps that order, so that a
    streamed reply assembles to the whole one; a result that says nothing of where its calls
    stood (`ChatResult.call_offsets`) has its calls after its text."""
    text, pieces, at = _answer(result), [], 0
    offsets = result.call_offsets if len(result.call_offsets) == len(result.tool_calls) else ()
    for call, offset in zip(result.tool_calls, offsets or (len(text),) * len(result.tool_calls)):
        offset = min(max(offset, at), len(text))
        pieces += [text[at:offset], call] if offset > at else [call]
        at = offset
    return pieces + [text[at:]] if text[at:] else pieces


def total_usage(results: Sequence[ChatResult], n: int) -> Usage:
    """The usage of a request's results, n choices per prompt: each prompt counted once, as
    OpenAI counts it for n choices (with what its first choice's state held), every choice's
    completion tokens."""
    firsts = results[::n]
    return Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in firsts),
                 cached_tokens=sum(r.usage.cached_tokens for r in firsts),
                 completion_tokens=sum(r.usage.completion_tokens for r in results),
                 reasoning_tokens=sum(r.usage.reasoning_tokens for r in results))


def system_fingerprint(engine_fingerprint: str) -> str:
    """OpenAI's `system_fingerprint`, "the backend configuration the model runs with", which a
    client reads beside `seed` to know when seeded replies may change: the engine's fingerprint
    (checkpoint, dtype, KV dtype and load-time passes), in OpenAI's form ("fp_" and 10 hex digits)."""
    return "fp_" + engine_fingerprint[:10]


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


class TextReply(Reply):
    """A legacy completion: the text as generated, in `text_completion` objects; log-probabilities,
    where asked, in that endpoint's shape (`_legacy`)."""

    def __init__(self, model: str, n: int = 1, chat: "Chat | None" = None, fingerprint: str | None = None) -> None:
        super().__init__(model, chat, n=n, fingerprint=fingerprint)
        self.id = "cmpl-" + uuid.uuid4().hex
        self._offsets: dict[int, int] = {}  # choice -> characters its streamed logprobs' tokens spelt
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}  # choice -> its tokens' UTF-8 so far

    def completion(self, *results: ChatResult) -> dict:
        """The reply to one prompt, or to several (n choices each, in order; their usage summed)."""
        choices = [{"index": i, "text": r.text, "logprobs": self._legacy(self._logprobs(r), i),
                    "finish_reason": openai_finish_reason(r)} for i, r in enumerate(results)]
        return {**self._head("text_completion"), "choices": choices, "usage": usage(total_usage(results, self.n))}

    def chunk(self, delta: ChatDelta, index: int = 0) -> dict:
        finish = openai_finish_reason(delta.result) if delta.result is not None else None
        logprobs = self._legacy(self._chunk_logprobs(delta, index), index)
        choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def _legacy(self, logprobs: dict | None, index: int) -> dict | None:
        """Chat-shaped log-probabilities as the completions endpoint gives them: `tokens`,
        `token_logprobs`, `top_logprobs` (a dict a token, None where no alternatives were asked)
        and `text_offset` (where each token starts in the text; a stream's go on from its last)."""
        if logprobs is None:
            return None
        entries = logprobs["content"]
        offsets = []
        at = self._offsets.get(index, 0)
        decoder = self._decoders.setdefault(index, codecs.getincrementaldecoder("utf-8")("replace"))
        for entry in entries:  # a token's characters are those its bytes complete: the two of "é" both start at it
            offsets.append(at)  # (each token's own text spelt it as two "\ufffd", shifting every offset after)
            at += len(decoder.decode(bytes(entry["bytes"])))
        self._offsets[index] = at
        asked = any(entry["top_logprobs"] for entry in entries)
        return {"tokens": [entry["token"] for entry in entries],
                "token_logprobs": [entry["logprob"] for entry in entries],
                "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries]
                if asked else None,
                "text_offset": offsets}

    def role_chunk(self, index: int = 0) -> None:
        return None

    def usage_chunk(self, *results: ChatResult) -> dict:
        return {**self._head("text_completion"), "choices": [], "usage": usage(total_usage(results, self.n))}
