"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat layer, no
HTTP: the request is read as the chat-completions request it means, and the reply written as a
`message` object or as the Messages stream's events.

    MessagesRequest --chat_request()--> ChatRequest --chat_call--> ChatCall (as /v1/chat/completions)
    ChatDelta --MessagesReply.chunks()--> content_block_start / _delta / _stop, ...
    ChatResult --MessagesReply.completion()--> message

Content blocks map onto chat messages: `text` blocks are a message's text (joined by newlines, as
vLLM joins text parts), an assistant's `thinking` its reasoning content (the template re-renders
it where it keeps thinking), its `tool_use` blocks its tool calls, a user's `tool_result` blocks
tool messages. What a text model cannot read (images, documents) and what Anthropic runs on its
own side (server tools, MCP servers) are refused with what to do instead. Errors come in
Anthropic's shape (`error_body`), naming the fields the client sent (`in_messages_terms`).
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from hibana_core.turn import ChatDelta, ChatResult
from hibana_plugins.openai_api import ApiError, ChatRequest, Reply, in_order, joined, json_text, parse_request

if TYPE_CHECKING:
    from hibana_core.chat import Chat

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}
"""Anthropic's error type for each HTTP status (others: 4xx invalid_request_error, 5xx api_error)."""

_REFUSED = {
    "container": "containers run Anthropic's code-execution tool; Hibana runs no tools itself: give the model "
                 "client tools and run them",
    "mcp_servers": "Hibana connects to no MCP servers; list the servers' tools in `tools` and call them yourself",
}

_CHAT_FIELDS = (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
                ("response_format.json_schema", "output_config.format"), ("response_format", "output_config.format"),
                ("reasoning_effort", "output_config.effort"), ("chat_template_kwargs.enable_thinking", "thinking"),
                ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
                ("tool_choice.function.name", "tool_choice.name"))
"""The chat request's fields an error may name, and the Messages API's the client sent ("stop", a
word as well, is renamed in a message only where it names the field: "stop:", "stop=")."""


_STREAM_STATUS = {"timeout": 504, "server_shutting_down": 503, "server_error": 500, "requests": 429}
"""The status an error mid-stream (by its code, else its OpenAI type) would have had, for its Anthropic type."""


def error_body(error: ApiError) -> dict:
    """`error` in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def in_messages_terms(error: ApiError, origins: list[str] | tuple[str, ...] = ()) -> ApiError:
    """`error` naming the Messages API's fields where the chat layer named its own; a chat message it
    names by its index ("message 3", "messages[3]") named by `origins`, where each chat message of the
    request came from (`MessagesRequest.origins`: the system prompt is one, each tool_result one)."""
    param, message = error.param, error.message
    for chat, ours in _CHAT_FIELDS:
        if param is not None and re.match(rf"{re.escape(chat)}\b", param):
            param = ours + param[len(chat):]
        named = r"(?=[:=\[])" if chat == "stop" else r"\b"
        message = re.sub(rf"(?<![\w.]){re.escape(chat)}{named}", ours, message)
    if origins:
        message = re.sub(r"(?<![\w.])(?:message (\d+)\b|messages\[(\d+)\])",
                         lambda m: origins[i] if (i := int(m[1] or m[2])) < len(origins) else m[0], message)
    return ApiError(error.status, message, param, error.code, error.kind, error.retry)


class MessagesRequest(BaseModel):
    """The fields of a Messages request. As Anthropic does, a field the API does not know is
    refused; those it knows that change nothing here (metadata, cache_control, service_tier, ...)
    are accepted, those Hibana cannot honour refused when given (`_REFUSED`)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's form of output_config.format
    # refused unless null (`_REFUSED`)
    container: str | dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    # accepted, and nothing to do here (metadata.user_id names no state: Claude Code's main agent and its
    # subagents share one, and each conversation is served on the state it continues all the same)
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    betas: list[str] | None = None
    _origins: list[str] = PrivateAttr(default_factory=list)

    @property
    def origins(self) -> list[str]:
        """Where each message of the chat request came from ("system", "messages[i]"), once it is read whole
        (`chat_request`); empty before."""
        return self._origins

    def chat_request(self) -> ChatRequest:
        """The chat-completions request this one means; ApiError for what it cannot mean here."""
        for name, what in _REFUSED.items():
            if getattr(self, name):
                raise ApiError(400, f"{name}: {what}", name)
        choice, parallel = _tool_choice(self.tool_choice)
        output = self.output_config or {}
        origins: list[str] = []
        messages = _messages(self.system, self.messages, origins)
        self._origins = origins  # read whole: the errors from here on count the chat request's messages
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "tools": _tools(self.tools),
            "tool_choice": choice, "parallel_tool_calls": parallel, "reasoning_effort": output.get("effort"),
            "response_format": _response_format(output.get("format") or self.output_format),
            "chat_template_kwargs": _thinking(self.thinking), "max_completion_tokens": self.max_tokens,
            "stop": self.stop_sequences or None, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "stream": self.stream,
        }
        return parse_request({k: v for k, v in body.items() if v is not None}, ChatRequest)


class CountTokensRequest(MessagesRequest):
    """A count_tokens request: a Messages request's fields, max_tokens optional (the prompt alone is counted)."""

    max_tokens: int | None = Field(None, ge=1)


# --- the request as chat messages --------------------------------------------------------------------

_MEDIA = {"image", "document", "search_result", "container_upload"}


def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (`system`, a tool_result's content)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks", where.split("[")[0])
    return "\n".join(_block_text(block, f"{where}[{j}]") for j, block in enumerate(blocks))


def _block_text(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text" and isinstance(block.get("text"), str):
        return block["text"]
    if kind == "text":
        raise ApiError(400, f"{where} is a text block without its text (a string)", where.split("[")[0])
    raise _unreadable(kind, where)


def _unreadable(kind: Any, where: str) -> ApiError:
    field = where.split("[")[0]
    if kind in _MEDIA:
        article = "an" if kind[0] in "aeiou" else "a"
        return ApiError(400, f"{where} is {article} {kind} block: Hibana serves text models, which cannot read it; "
                             "send its content as text", field)
    return ApiError(400, f"{where} has type {kind!r:.40}, which is no block Hibana reads here (text, and in "
                         "messages thinking, tool_use, tool_result)", field)


def _messages(system: str | list | None, given: list[dict], origins: list[str]) -> list[dict]:
    """The conversation as chat messages: `system` first, then each message's blocks in order (a
    user message's tool_result blocks become tool messages, its text a user message beside them);
    `origins` gets where each came from ("system", "messages[i]")."""
    messages: list[dict] = []
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
        origins.append("system")
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise ApiError(400, f"{where}.role is {role!r:.40}; use user or assistant", "messages")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ApiError(400, f"{where}.content must be a string or a list of content blocks", "messages")
        if role == "assistant":
            messages.append(_assistant(content, where))
        elif role == "system":
            messages.append({"role": "system", "content": _text(content, f"{where}.content")})
        else:
            messages += _user(content, where)
        origins += [where] * (len(messages) - len(origins))
    if messages[-1]["role"] == "assistant":
        raise ApiError(400, "the last message is the assistant's: Hibana does not continue a prefilled reply; end "
                            "with a user message (a tool_result, or the text the reply should follow)", "messages")
    return messages


def _assistant(blocks: list, where: str) -> dict:
    """An assistant message: its text, its thinking (reasoning content) and its tool_use blocks (calls)."""
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise ApiError(400, f"{at} is a thinking block without its thinking (a string)", "messages")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic's models: nothing a template could render
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise ApiError(400, f"{at} is a tool_use block without an id, a name (strings) and an input "
                                    "(an object)", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        else:
            raise _unreadable(kind, at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list, where: str) -> list[dict]:
    """A user message's blocks as chat messages, in order: each tool_result a tool message, each
    run of text blocks one user message."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, f"{at} is a tool_result without the tool_use_id it answers", "messages")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = _text(block.get("content") or "", f"{at}.content")
            if block.get("is_error"):  # the template has no mark for it: the model reads it in the text
                result = f"Error: {result}" if result else "Error"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            texts.append(_block_text(block, at))
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's client tools ({"name", "description", "input_schema"}) as chat tools; server tools
    (web search, code execution, ...), which Anthropic runs, are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise ApiError(400, f"tools[{i}] has type {kind!r:.60}, a tool Anthropic runs on its side; Hibana calls "
                                "client tools only: {'name': ..., 'description': ..., 'input_schema': {...}}", "tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"tools[{i}] needs a name (a string) and an input_schema (a JSON schema object)",
                           "tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        function.update({k: tool[k] for k in ("description", "strict") if tool.get(k) is not None})
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """`tool_choice` ({"type": "auto" | "any" | "tool" | "none"}) as the chat API's, and whether
    parallel calls are allowed (`disable_parallel_tool_use`)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ApiError(400, f"tool_choice has type {kind!r:.40}; use auto, any, none or {{'type': 'tool', 'name': ...}}",
                   "tool_choice")


def _thinking(thinking: dict | None) -> dict | None:
    """`thinking` as the chat template's switch (`enable_thinking`): "enabled" on, "disabled" off;
    "adaptive" (the model decides) and none given leave the template's default. budget_tokens is
    taken, not enforced: max_tokens bounds the thinking and the answer together."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ApiError(400, "thinking.budget_tokens: give a whole number of tokens (1 or more)", "thinking")
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind in ("adaptive", "between_tools"):
        return None
    raise ApiError(400, f"thinking has type {kind!r:.40}; use enabled (with budget_tokens), disabled or adaptive",
                   "thinking")


def _response_format(spec: Any) -> dict | None:
    """`output_config.format` ({"type": "json_schema", "schema"}) as the chat API's response_format."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "output_config.format: give {'type': 'json_schema', 'schema': {...}}",
                       "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"], "strict": True}}


# --- the reply ---------------------------------------------------------------------------------------

class MessagesReply(Reply):
    """A `message` object, or the Messages stream: message_start (and a ping), then each content block
    (thinking, text, tool_use) started, its deltas and its stop in turn, then message_delta (the
    stop reason and the usage) and message_stop. One choice (the API has no n)."""

    def __init__(self, model: str, chat: "Chat", max_tokens: int) -> None:
        super().__init__(model, chat)
        self.id = "msg_" + uuid.uuid4().hex
        self.max_tokens = max_tokens
        self._blocks = 0                 # content blocks started so far
        self._open: tuple | None = None  # the block deltas go to: ("text",), ("thinking",) or ("tool", call index)

    done = ""  # the stream ends with message_stop, no [DONE]

    def frame(self, chunk: dict) -> str:  # type: ignore[override]
        """An event named by its type. An error mid-stream (the server's `{"error": {...}}` body) is
        the stream's `error` event in Anthropic's shape."""
        if "type" not in chunk and isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            status = _STREAM_STATUS.get(error.get("code"), _STREAM_STATUS.get(error.get("type"), 400))
            chunk = error_body(in_messages_terms(ApiError(status, error.get("message") or "")))
        return f"event: {chunk['type']}\ndata: {json_text(chunk)}\n\n"

    def completion(self, *results: ChatResult) -> dict:
        result, = results
        content: list[dict] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        for piece in in_order(result):  # text written after a call stays after it, as streamed
            if isinstance(piece, str):
                content.append({"type": "text", "text": piece})
            else:
                content.append({"type": "tool_use", "id": tool_use_id(piece.id), "name": piece.name,
                                "input": piece.arguments})
        return self._message(content, result)

    def _message(self, content: list[dict], result: ChatResult | None) -> dict:
        usage = _usage(result) if result is not None else {
            "input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": None if result is None else self._stop_reason(result),
                "stop_sequence": None if result is None else result.stop_sequence, "usage": usage}

    def _stop_reason(self, result: ChatResult) -> str:
        if result.finish_reason == "length":  # short of max_tokens: the context had no room for more
            full = result.usage.completion_tokens >= self.max_tokens
            return "max_tokens" if full else "model_context_window_exceeded"
        if result.tool_calls:
            return "tool_use"
        return "stop_sequence" if result.stop_sequence is not None else "end_turn"

    # --- the stream

    def role_chunk(self, index: int = 0) -> dict:
        """message_start: the usage is the result's, in message_delta (the turn's counts come with its end)."""
        return {"type": "message_start", "message": self._message([], None)}

    @staticmethod
    def opening(role: dict | None, chunks: list[dict]) -> list[dict]:
        return [role, {"type": "ping"}, *chunks] if role is not None else chunks

    def usage_chunk(self, *results: ChatResult) -> dict:  # (the usage is in message_delta)
        raise AssertionError("a Messages stream has no usage chunk")

    def chunks(self, deltas: list[ChatDelta], index: int = 0) -> list[dict]:
        final = next((delta.result for delta in deltas if delta.result is not None), None)
        drop = final is None or final.finish_reason == "length"  # (as the chat stream's: `Reply.chunks`)
        events: list[dict] = []
        for delta in joined(deltas):
            if delta.cut_call and drop:
                continue
            if delta.result is not None:
                result = delta.result
                events += self._close()
                events.append({"type": "message_delta", "usage": _usage(result), "delta": {
                    "stop_reason": self._stop_reason(result), "stop_sequence": result.stop_sequence}})
                events.append({"type": "message_stop"})
            elif delta.tool_call is not None:
                events += self._call(delta.tool_call)
            elif delta.reasoning:
                events += self._piece("thinking", delta.reasoning)
            elif delta.text:
                events += self._piece("text", delta.text)
        return events

    def _start(self, kind: tuple, block: dict) -> list[dict]:
        events = self._close()
        self._open = kind
        self._blocks += 1
        return events + [{"type": "content_block_start", "index": self._blocks - 1, "content_block": block}]

    def _piece(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open != (kind,):
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            events += self._start((kind,), block)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta",
                                                                              "thinking": text}
        return events + [{"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}]

    def _call(self, call: Any) -> list[dict]:
        events = []
        if call.id is not None:  # a call's first delta: its block
            events += self._start(("tool", call.index), {"type": "tool_use", "id": tool_use_id(call.id),
                                                         "name": call.name or "", "input": {}})
        if call.arguments_fragment and self._open == ("tool", call.index):
            events.append({"type": "content_block_delta", "index": self._blocks - 1,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments_fragment}})
        return events

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic's tool_use ids look ("toolu_..."): Hibana's own "call_..." ids
    renamed; an id the model's format writes into its markup (Mistral's nine characters) kept as
    it is, so that the history the client sends back renders as it was generated."""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def _usage(result: ChatResult) -> dict:
    """Anthropic's usage: the prompt tokens read from the state's resident KV (cache_read_input_tokens)
    and those computed (input_tokens), which add up to the prompt; every computed token stays
    resident for the next turn, without a write of its own to count (cache_creation_input_tokens 0)."""
    u = result.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}
