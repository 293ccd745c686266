"""OpenAI's Responses API (`POST /v1/responses`) on the chat layer, no HTTP: the request is read
as the chat-completions request it means, and the reply written as a `response` object or as
the Responses stream's typed events.

    ResponsesRequest --chat_request()--> ChatRequest --chat_call--> ChatCall (as /v1/chat/completions)
    ChatDelta --ResponsesReply.chunks()--> response.output_text.delta, ...;  ChatResult --completion()--> response

Input items: messages (a string or text parts; `developer` is a system message), `function_call`
and `function_call_output` items, `reasoning` items (their text goes back to the model as the next
assistant turn's thinking). The conversation is kept on the server as KV, not as stored
responses: a client sends the whole input each turn (as with `store: false`), and the turn reuses
the resident prefix; `previous_response_id`, `conversation` and `background` are refused with
what to do instead.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from hibana_plugins.openai_api import (MAX_STATE_ID, ApiError, ChatRequest, Reply, in_order, joined, json_text,
                                       parse_request, total_usage)
from hibana_core.messages import escaped_surrogates
from hibana_core.turn import ChatDelta, ChatResult

if TYPE_CHECKING:
    from hibana_core.chat import Chat

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` entry that asks for the output text's token log-probabilities."""
INCLUDABLE = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results",
                        "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                        "computer_call_output.output.image_url", "code_interpreter_call.outputs"})
"""What `include` may name (OpenAI's values); all but the logprobs name what Hibana's responses
never hold (no hosted tools, no encrypted reasoning), so they add nothing."""

_REFUSED = {
    "previous_response_id": "responses are not stored here: send the whole conversation as input (the server keeps "
                            "its KV resident, so a turn computes only what is new)",
    "conversation": "conversations are not stored here: send the whole conversation as input (its KV stays resident)",
    "prompt": "prompt templates are not stored here: send the instructions and input themselves",
    "max_tool_calls": "max_tool_calls is not supported; parallel_tool_calls: false holds a response to one call",
}

_CHAT_FIELDS = (("max_completion_tokens", "max_output_tokens"), ("reasoning_effort", "reasoning.effort"),
                ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("tool_choice.function.name", "tool_choice.name"), ("tool_choice.allowed_tools", "tool_choice"))
"""The chat request's fields an error may name, and the Responses API's the client sent."""


def _renamed(param: str | None, message: str) -> tuple[str | None, str]:
    """An error's param and message in the Responses API's terms: the request is checked as the
    chat request it means, whose errors named fields this client never sent (max_completion_tokens
    for max_output_tokens, messages for input)."""
    if param is not None and re.match(r"messages\b", param):
        param = "input"  # (the message's "messages[i]" counts chat messages, not input items: left as it is)
    for chat, ours in _CHAT_FIELDS:
        if param is not None and re.match(rf"{re.escape(chat)}\b", param):
            param = ours + param[len(chat):]
        message = re.sub(rf"\b{re.escape(chat)}\b", ours, message)
    return param, message


def in_responses_terms(error: ApiError) -> ApiError:
    """`error` naming the Responses API's fields where the chat layer named its own (`_renamed`)."""
    param, message = _renamed(error.param, error.message)
    return ApiError(error.status, message, param, error.code, error.kind, error.retry)


class ResponsesRequest(BaseModel):
    """The fields of a Responses API request. As OpenAI does, a field the API does not know is
    refused; those it knows that change nothing here (metadata, store, service_tier, ...) are
    accepted, those Hibana cannot honour refused when given (`_REFUSED`, background: true)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None  # "disabled" (OpenAI's default); "auto" would drop input items: refused
    user: str | None = Field(None, max_length=MAX_STATE_ID)
    # refused unless null (`_REFUSED`), background unless false
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    background: bool | None = None
    # accepted, and nothing to do here
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    access_programs: dict[str, Any] | list[Any] | None = None
    image: dict[str, Any] | None = None

    def chat_request(self) -> ChatRequest:
        """The chat-completions request this one means; ApiError for what it cannot mean here."""
        for name, what in _REFUSED.items():
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name}: {what}", name)
        if self.truncation not in (None, "disabled"):
            raise ApiError(400, f"truncation={self.truncation!r:.40}: Hibana drops no input to fit the context "
                                "(\"disabled\", the default); shorten the input instead", "truncation")
        if self.background:
            raise ApiError(400, "background: true is not supported; ask in the foreground (stream: true to "
                                "read the response as it is written)", "background")
        unknown = sorted(set(self.include or ()) - INCLUDABLE)
        if unknown:
            raise ApiError(400, f"include: {unknown[0]!r:.80} is not a value of include; OpenAI's are "
                                f"{', '.join(sorted(INCLUDABLE))}", "include")
        logprobs = LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)
        effort = (self.reasoning or {}).get("effort")
        body: dict[str, Any] = {
            "model": self.model, "messages": _messages(self.instructions, self.input),
            "tools": _tools(self.tools), "tool_choice": _tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "response_format": _response_format(self.text), "reasoning_effort": effort,
            "logprobs": logprobs or None, "top_logprobs": self.top_logprobs if logprobs else None,
            "user": self.user, "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
        }
        return parse_request({k: v for k, v in body.items() if v is not None}, ChatRequest)

    def echoed(self) -> dict:
        """The request's settings as a `response` object repeats them."""
        text_format = (self.text or {}).get("format") or {"type": "text"}
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": (self.reasoning or {}).get("effort"), "summary": None},
                "store": False, "temperature": self.temperature if self.temperature is not None else 0.0,
                "text": {"format": text_format}, "tool_choice": self.tool_choice or "auto",
                "tools": self.tools or [], "top_p": self.top_p if self.top_p is not None else 1.0,
                "top_logprobs": self.top_logprobs or 0,
                "truncation": "disabled", "user": self.user, "metadata": self.metadata or {}}


# --- the request as chat messages --------------------------------------------------------------------

_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


def _text_of(content: Any, where: str) -> str | list[dict]:
    """A message's content or a tool's output (`where` names it: "input[2].output"): a string, or
    its text parts as the chat layer's."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ApiError(400, f"{where}[{j}] has type {kind!r:.40}; Hibana reads text parts only "
                                "(input_text, output_text)", "input")
    return parts


def _messages(instructions: str | None, given: str | list[dict]) -> list[dict]:
    """The conversation as chat messages: instructions first (a system message), an input string
    as one user message; a function_call item joins the assistant message before it (or opens one),
    as does an assistant message after a function_call (text written after a call: one turn); a
    reasoning item's text goes to the assistant message after it, or where a user or system
    message comes first, to an assistant message of its own."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not given:
        raise ApiError(400, "input: give a string or at least one item", "input")
    thinking: list[str] = []  # reasoning items' text, for the next assistant message

    def assistant(content: Any) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["reasoning_content"] = "\n".join(thinking)
            thinking.clear()
        messages.append(message)
        return message

    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"{where}.role is {role!r:.40}; use user, system, developer or assistant", "input")
            content = _text_of(item.get("content"), f"{where}.content")
            if content == []:  # (as the chat endpoint refuses it, in this API's terms)
                raise ApiError(400, f"{where}.content is an empty list of parts; give at least one part, or a string",
                               "input")
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and last.get("tool_calls") and not thinking:
                # text the model wrote after a call (a message item after its function_call): the same turn
                last["content"] = _parts(last["content"]) + _parts(content) or None
            elif role == "assistant":
                assistant(content)
            else:
                if thinking:  # a turn of reasoning alone (max_output_tokens cut it there): not the next turn's
                    assistant(None)
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(400, f"{where} is a function_call without a call_id, name and arguments (strings)",
                               "input")
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or thinking:
                last = assistant(None)
            last.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where} is a function_call_output without the call_id it answers", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            for part in (item.get("content") or item.get("summary") or ()):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    thinking.append(part["text"])
        else:
            what = ("refers to a stored item; send the item itself" if kind == "item_reference"
                    else "is not an item Hibana reads (message, function_call, function_call_output, reasoning)")
            raise ApiError(400, f"{where} has type {kind!r:.40}: it {what}", "input")
    return messages


def _parts(content: str | list[dict] | None) -> list[dict]:
    """A message's content (`_text_of`) as text parts, which the chat layer joins as they are."""
    if content is None or isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return content


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses-API function tools ({"type": "function", "name", "parameters", ...}) as chat tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ApiError(400, f"tools[{i}] has type {tool.get('type')!r:.40}; Hibana calls function tools only: "
                                "{'type': 'function', 'name': ..., 'parameters': {...}}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    """The Responses API's allowed_tools form ({"type", "mode", "tools"}) as the chat API's; the
    other forms are the chat API's already ({"type": "function", "name"} is read there)."""
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and "allowed_tools" not in choice:
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": choice.get("tools")}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    """`text.format` as the chat API's response_format."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ApiError(400, "text.format must be an object: {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       "text.format")
    if spec.get("type") == "json_schema":
        inner = {k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}
        return {"type": "json_schema", "json_schema": inner}
    return dict(spec)


# --- the reply ---------------------------------------------------------------------------------------

class ResponsesReply(Reply):
    """A `response` object, or the Responses stream: response.created, then each output item
    (reasoning, message, function_call) added, its deltas and its done events in turn, then
    response.completed (response.incomplete where max_output_tokens cut it), every event numbered
    (`sequence_number`). One choice (the API has no n)."""

    def __init__(self, model: str, chat: "Chat", request: ResponsesRequest) -> None:
        super().__init__(model, chat)
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.echo = request.echoed()
        self._sequence = 0
        self._items: list[dict] = []   # the streamed output items, in order
        self._open: dict | None = None  # the item deltas go to (its "kind": "text", "reasoning", call index)

    done = ""  # the stream ends with response.completed (or .incomplete), no [DONE]

    def frame(self, chunk: dict) -> str:  # type: ignore[override]
        """An event named by its type, as OpenAI's Responses stream writes them. An error mid-stream
        (the server's `{"error": {...}}` body) is the stream's `error` event, numbered as the rest:
        {"type": "error", "code", "message", "param", "sequence_number"}, which clients read by its
        type (LangChain raises it), where the chat body has none."""
        if "type" not in chunk and isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            param, message = _renamed(error.get("param"), error.get("message") or "")
            chunk = self._event("error", code=error.get("code"), message=message, param=param)
        return f"event: {chunk['type']}\ndata: {json_text(chunk)}\n\n"

    def completion(self, *results: ChatResult) -> dict:
        result, = results
        return self._response(result, _output(result, self.chat))

    def _response(self, result: ChatResult | None, output: list[dict]) -> dict:
        status, details = "in_progress", None
        if result is not None:
            status = "incomplete" if result.finish_reason == "length" else "completed"
            details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": details, "model": self.model, "output": output,
                **self.echo, "usage": None if result is None else _usage(result)}

    # --- the stream

    def role_chunk(self, index: int = 0) -> dict:
        return self._event("response.created", response=self._response(None, []))

    def usage_chunk(self, *results: ChatResult) -> dict:  # (the usage is in response.completed)
        raise AssertionError("a Responses stream has no usage chunk")

    def chunks(self, deltas: list[ChatDelta], index: int = 0) -> list[dict]:
        final = next((delta.result for delta in deltas if delta.result is not None), None)
        drop = final is None or final.finish_reason == "length"  # (as the chat stream's: `Reply.chunks`)
        events: list[dict] = []
        if self._sequence == 1:  # after response.created (`role_chunk`), before the first output
            events.append(self._event("response.in_progress", response=self._response(None, [])))
        for delta in joined(deltas):
            if delta.cut_call and drop:
                continue
            logprobs = self._chunk_logprobs(delta, index)
            if delta.result is not None:
                cut = delta.result.finish_reason == "length"
                events += self._close("incomplete" if cut else "completed")
                kind = "response.incomplete" if cut else "response.completed"
                events.append(self._event(kind, response=self._response(delta.result, self._items)))
            elif delta.tool_call is not None:
                events += self._call(delta.tool_call)
            elif delta.reasoning:
                events += self._reasoning(delta.reasoning)
            elif delta.text:
                events += self._text(delta.text, (logprobs or {}).get("content") or [])
        return events

    def _event(self, kind: str, **fields: Any) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _begin(self, kind: Any, item: dict) -> list[dict]:
        events = self._close()
        self._items.append(item)
        self._open = {"kind": kind, "index": len(self._items) - 1}
        return events + [self._event("response.output_item.added", output_index=len(self._items) - 1,
                                     item={**item, **({"content": []} if "content" in item else {})})]

    def _text(self, text: str, logprobs: list[dict]) -> list[dict]:
        events = []
        if self._open is None or self._open["kind"] != "text":
            events += self._begin("text", {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                                           "role": "assistant",
                                           "content": [{"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []}]})
            events.append(self._event("response.content_part.added", item_id=self._items[-1]["id"],
                                      output_index=self._open["index"], content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        part = self._items[-1]["content"][0]
        if not part["text"]:  # the markup between thinking and text comes with the text's first tokens
            logprobs = _spanning(logprobs, text, whole=False)
        part["text"] += text
        part["logprobs"] += logprobs
        return events + [self._event("response.output_text.delta", item_id=self._items[-1]["id"],
                                     output_index=self._open["index"], content_index=0, delta=text,
                                     logprobs=logprobs)]

    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["kind"] != "reasoning":
            events += self._begin("reasoning", {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                                                "content": [{"type": "reasoning_text", "text": ""}]})
            events.append(self._event("response.content_part.added", item_id=self._items[-1]["id"],
                                      output_index=self._open["index"], content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))
        self._items[-1]["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", item_id=self._items[-1]["id"],
                                     output_index=self._open["index"], content_index=0, delta=text)]

    def _call(self, call: Any) -> list[dict]:
        events = []
        if call.id is not None:  # a call's first delta: its item
            events += self._begin(("call", call.index), {"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                                                         "call_id": call.id, "name": call.name or "",
                                                         "arguments": "", "status": "in_progress"})
        if call.arguments_fragment and self._open is not None:
            item = self._items[self._open["index"]]
            fragment = escaped_surrogates(call.arguments_fragment)  # as the whole response's (`_output`)
            item["arguments"] += fragment
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._open["index"], delta=fragment))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        """The done events of the item deltas went to, if one is open; `status`: "incomplete"
        where max_output_tokens cut it (a message's, as in the whole response)."""
        if self._open is None:
            return []
        at, kind = self._open["index"], self._open["kind"]
        item = self._items[at]
        self._open = None
        events = []
        if kind == "text":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                   content_index=0, part=part)]
        elif kind == "reasoning":  # (its text part opened and closed as a message's, OpenAI's reasoning_text part)
            part = item["content"][0]
            events += [self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                   content_index=0, text=part["text"]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                   content_index=0, part=part)]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                      name=item["name"], arguments=item["arguments"]))
        if "status" in item:  # (a reasoning item has none, as in the whole response)
            item["status"] = status if kind == "text" else "completed"
        return events + [self._event("response.output_item.done", output_index=at, item=item)]


def _output(result: ChatResult, chat: "Chat") -> list[dict]:
    """A result's output items: its thinking, then its text and its calls in the order they were
    written (`in_order`: a message after a call where the model wrote text after it, as streamed)."""
    items: list[dict] = []
    if result.reasoning:
        items.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                      "content": [{"type": "reasoning_text", "text": result.reasoning}]})
    pieces = in_order(result)
    tokens = (chat.openai_logprobs(result) or []) if any(isinstance(piece, str) for piece in pieces) else []
    ends = {id(entry): end for entry, end in zip(tokens, itertools.accumulate(len(t["bytes"]) for t in tokens))}
    since = 0  # bytes of the tokens' text up to the end of the last message's
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            logprobs = _spanning(tokens, piece, after=result.reasoning if not since else "", since=since)
            since = ends[id(logprobs[-1])] if logprobs and logprobs is not tokens else since
            # as the response's, where max_output_tokens cut this message (the last item; one a call followed ended)
            status = "incomplete" if result.finish_reason == "length" and i == len(pieces) - 1 else "completed"
            items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
                          "content": [{"type": "output_text", "text": piece, "annotations": [],
                                       "logprobs": logprobs}]})
        else:
            items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": piece.id,
                          "name": piece.name,  # (a lone surrogate escaped: text a client can send back as input)
                          "arguments": json_text(piece.arguments),
                          "status": "completed"})
    return items


def _spanning(logprobs: list[dict], text: str, after: str = "", whole: bool = True, since: int = 0) -> list[dict]:
    """Of tokens' log-probabilities (OpenAI's shape, each with its `bytes`), those of `text`, an
    output_text part, where it stands in their join past `after` (the thinking) and past byte
    `since` (the end of a message before it): a reasoning
    model's thinking, its markup and that of calls are no part of the text (a chat reply's
    logprobs hold every token: the message held 40 for an answer of 10). Not
    `whole`: only the tokens before the text are left out (a streamed delta's text may hold back
    the end of its tokens'). Text after a call begins with whitespace written before the call
    (held until text followed): found without it, it takes the whitespace just before it. All
    of them where the text is not found."""
    joined = b"".join(bytes(entry["bytes"]) for entry in logprobs)
    found = joined.find(after.encode(), since) if after else -1
    start = found + len(after.encode()) if found >= 0 else since
    body = text.encode()
    begin = joined.find(body, start)
    if begin < 0:
        body = text.lstrip().encode()
        begin = joined.find(body, start)
    if begin < 0:
        return logprobs
    end = begin + len(body) if whole else len(joined)
    gap = joined[start:begin]
    start = begin - min(len(text.encode()) - len(body), len(gap) - len(gap.rstrip()))
    kept, at = [], 0
    for entry in logprobs:
        if at < end and at + len(entry["bytes"]) > start:
            kept.append(entry)
        at += len(entry["bytes"])
    return kept


def _usage(result: ChatResult) -> dict:
    """The Responses API's usage: the input tokens read from the state's KV (`cached_tokens`) and
    those computed, which the state keeps for the next turn (`cache_write_tokens`, a field the
    client's types require)."""
    u = total_usage([result], 1)
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {
                "cached_tokens": u.cached_tokens, "cache_write_tokens": u.prompt_tokens - u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}
