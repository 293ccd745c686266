"""The chat layer: OpenAI-style messages and tools in, text and tool calls out, on one state.

    messages, tools --render (the model's chat template)--> token ids --sync--> handle
    handle --generate (stop at the end-of-turn token)--> text --tool parser--> ChatResult

Rendering goes through the tokenizer's `apply_chat_template`, or through a chat format a plugin
registers for the model's `model_type` (which may also name the tool parser; "hermes" otherwise).
Every call syncs the handle to the freshly rendered prompt, so a re-rendered history costs only the
tokens that differ from what the state holds; where the model's own tokens spell the same text as
the re-rendered history, they are kept (`Chat.prompt_ids`). Model output never raises: malformed tool-call text
comes back as text with finish_reason "malformed_tool_call".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Sequence

from hibana_core.config import SamplingParams
from hibana_core.errors import HibanaError
from hibana_plugins.manager import get_plugin_manager
from hibana_plugins.tool_parsers import ParsedOutput, ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from hibana_core.engine import Engine

DEFAULT_TOOL_PARSER = "hermes"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
MALFORMED = "malformed_tool_call"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int        # prompt tokens whose KV the state already held (SyncStats.reused)
    completion_tokens: int


@dataclass(frozen=True)
class ChatResult:
    text: str                 # content outside tool calls; the raw output when a call is malformed
    tool_calls: list[ToolCall]
    finish_reason: str        # "tool_calls", "stop", "length", "malformed_tool_call", "cancelled"
    usage: Usage
    error: str | None = None  # what was malformed, when finish_reason says so
    raw_text: str = ""        # the assistant's turn as generated (prefill included)


@dataclass(frozen=True)
class ChatDelta:
    """One streamed piece: a text delta, a tool-call delta, or (last) the whole result."""

    text: str = ""
    tool_call: ToolCallDelta | None = None
    result: ChatResult | None = None


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI-style messages as chat templates expect them: content as a string, tool-call
    arguments as dicts (so the template re-serialises them the way the model wrote them)."""
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):   # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        m["content"] = content if content is not None else ""
        if m.get("tool_calls"):
            m["tool_calls"] = [_normalize_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _normalize_call(call: Any) -> dict:
    if isinstance(call, ToolCall):
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    function = dict(call.get("function", call))
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # the template prints a string as it is
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function.get("name"), "arguments": arguments}}


def normalize_tools(tools: Sequence[dict] | None) -> list[dict] | None:
    """Tools as OpenAI function tools: {"type": "function", "function": {name, description, parameters}}."""
    if not tools:
        return None
    return [t if t.get("type") == "function" and "function" in t else {"type": "function", "function": t}
            for t in tools]


class Chat:
    """Chat on one state of an engine: `Chat(engine, "agent-1").respond(messages, tools=...)`."""

    def __init__(self, engine: "Engine", state_id: str, tool_parser: str | None = None) -> None:
        if engine.tokenizer is None:
            raise HibanaError("the chat layer needs a tokenizer with a chat template, and this checkpoint "
                              "has none; use state handles with token ids instead")
        self.engine = engine
        self.handle = engine.open_state(state_id)
        chat_format = get_plugin_manager().chat_formats().get(getattr(engine.hf_config, "model_type", None))
        self.template: str | None = getattr(chat_format, "template", None)
        name = tool_parser or getattr(chat_format, "tool_parser", None) or DEFAULT_TOOL_PARSER
        self.parser = get_plugin_manager().lookup("tool_parser", name)
        vocab = engine.tokenizer.get_vocab()
        self.stop_token_ids = tuple(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt token ids: the conversation plus the assistant's generation prompt."""
        return self._encode(self.render_text(messages, tools))

    def render_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        kwargs = {"chat_template": self.template} if self.template else {}
        try:
            return self.engine.tokenizer.apply_chat_template(
                normalize_messages(messages), tools=normalize_tools(tools), add_generation_prompt=True,
                tokenize=False, **kwargs)
        except Exception as exc:  # jinja raises many types for a conversation it rejects
            raise HibanaError(f"cannot render the conversation with the chat template: {exc}") from exc

    def prompt_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """What `respond` syncs: the rendered prompt, except that the state's own tokens are kept up
        to the last end-of-turn token where they still spell the prompt's text, and only the rest
        is tokenized. A model may spell a word in other tokens than the tokenizer would (an unseen
        name copied piece by piece); re-tokenizing would recompute everything after it."""
        text = self.render_text(messages, tools)
        held = self.handle.tokens
        ends = [i + 1 for i, token in enumerate(held) if token in self.stop_token_ids]
        for end in reversed(ends):  # usually the last one matches: the previous reply, unchanged
            held_text = self.engine.tokenizer.decode(held[:end], skip_special_tokens=False)
            if text.startswith(held_text):
                return held[:end] + self._encode(text[len(held_text):])
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        # what apply_chat_template(tokenize=True) does: the template already wrote the special tokens
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams(max_tokens=256)
        stops = tuple(dict.fromkeys(tuple(params.stop_token_ids) + self.stop_token_ids))
        return dataclasses.replace(params, stop_token_ids=stops)

    def respond(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                params: SamplingParams | None = None, *, prefill: str = "",
                parse_tools: bool = True) -> ChatResult:
        """Render, sync the state, generate one assistant turn, parse its tool calls.

        `prefill` starts the assistant's turn with given text (`<tool_call>\n{"name": "` forces
        a call); `parse_tools=False` returns the text as generated."""
        result = None
        for delta in self.stream_respond(messages, tools, params, prefill=prefill, parse_tools=parse_tools):
            result = delta.result
        assert result is not None
        return result

    async def arespond(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                       params: SamplingParams | None = None, *, prefill: str = "",
                       parse_tools: bool = True) -> ChatResult:
        result = None
        async for delta in self.astream_respond(messages, tools, params, prefill=prefill,
                                                parse_tools=parse_tools):
            result = delta.result
        assert result is not None
        return result

    def stream_respond(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                       params: SamplingParams | None = None, *, prefill: str = "",
                       parse_tools: bool = True) -> Iterator[ChatDelta]:
        """Text deltas and tool-call deltas as they are generated; the last item carries the
        ChatResult. Closing the iterator early cancels the generation."""
        turn = _Turn(self, prefill, parse_tools)
        events = self.handle.stream(self._params(params), prompt=self._prompt(messages, tools, prefill))
        with contextlib.closing(events):  # an early close of this iterator cancels the request
            yield from turn.start()
            for event in events:
                yield from turn.feed(event)

    async def astream_respond(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                              params: SamplingParams | None = None, *, prefill: str = "",
                              parse_tools: bool = True) -> AsyncIterator[ChatDelta]:
        """`stream_respond` on the caller's event loop: awaits the engine, never blocks the loop."""
        turn = _Turn(self, prefill, parse_tools)
        events = self.handle.astream(self._params(params), prompt=self._prompt(messages, tools, prefill))
        try:
            for delta in turn.start():
                yield delta
            async for event in events:
                for delta in turn.feed(event):
                    yield delta
        finally:
            await events.aclose()  # an early close cancels the request

    def _prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None, prefill: str) -> list[int]:
        return self.prompt_ids(messages, tools) + (self._encode(prefill) if prefill else [])

    @staticmethod
    def _result(parsed, raw_text: str, completion, usage: Usage) -> ChatResult:
        if completion.finish_reason in ("length", "cancelled"):
            return ChatResult(raw_text if parsed.error else parsed.content,
                              [] if parsed.error else parsed.tool_calls, completion.finish_reason, usage,
                              parsed.error, raw_text)
        if parsed.error:
            return ChatResult(raw_text, [], MALFORMED, usage, parsed.error, raw_text)
        reason = "tool_calls" if parsed.tool_calls else completion.finish_reason
        return ChatResult(parsed.content, parsed.tool_calls, reason, usage, None, raw_text)


class _Turn:
    """Turns a generation's stream events into chat deltas through the tool parser (which first
    reads the prefill, so a forced call parses whole)."""

    def __init__(self, chat: Chat, prefill: str, parse_tools: bool) -> None:
        self.prefill = prefill
        self.stream = chat.parser.stream() if parse_tools else _PlainText()

    def start(self) -> Iterator[ChatDelta]:
        return self._deltas(self.stream.feed(self.prefill) if self.prefill else [])

    def feed(self, event) -> Iterator[ChatDelta]:
        pieces = self.stream.feed(event.text) if event.text else []
        if event.completion is not None:
            pieces += self.stream.close()
        yield from self._deltas(pieces)
        if event.completion is not None:
            completion = event.completion
            usage = Usage(completion.stats.prompt_tokens, completion.stats.reused, len(completion.token_ids))
            yield ChatDelta(result=Chat._result(self.stream.finish(), self.prefill + completion.text,
                                                completion, usage))

    @staticmethod
    def _deltas(pieces) -> Iterator[ChatDelta]:
        for piece in pieces:
            yield ChatDelta(tool_call=piece) if isinstance(piece, ToolCallDelta) else ChatDelta(text=piece)


class _PlainText:
    """The parser stream's protocol with no tool parsing: the text is the content."""

    def __init__(self) -> None:
        self.text = ""

    def feed(self, delta: str) -> list[str]:
        self.text += delta
        return [delta]

    def close(self) -> list[str]:
        return []

    def finish(self) -> ParsedOutput:
        return ParsedOutput(self.text, [], None)


def assistant_message(result: ChatResult) -> dict:
    """The OpenAI-style assistant message for a result, to append to the conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in result.tool_calls]
    return message
