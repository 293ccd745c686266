"""LangChain / LangGraph adapter: `ChatHibana`, a chat model whose agents keep their KV cache resident.

    from hibana_plugins.langchain import ChatHibana

    llm = ChatHibana(model="demo")          # or a checkpoint directory, or engine=an Engine
    agent = create_react_agent(llm, tools, checkpointer=InMemorySaver())

Each call renders the messages with the model's chat template (`hibana_core.chat`), syncs one
state to them (only the tokens that differ from what the state holds are computed), generates
and parses tool calls. Which state serves a call:

    1. `state_id`: on the object, through `.bind(state_id=...)`, or as a call kwarg. A call on an
       id that is serving another call raises `hibana_core.StateBusyError`.
    2. else LangGraph's `thread_id` and checkpoint namespace (task ids dropped): "t1/agent".
    3. else the resident state whose history shares the longest prefix with the prompt, when the
       prompt goes on from that conversation (holds it up to its last reply), the state is one
       this adapter made for such calls and no other call is using it; else a new state.

Forced tool calls (`tool_choice` "any" / "required" / a name, and structured output) constrain
the render rather than ask: the assistant turn is prefilled with the call's opening and, when one
tool is forced, its name. With a flat argument schema, the adapter also writes the JSON around
each required value and the model fills the values one request at a time (strings up to their
closing quote, numbers and booleans read from the continuation). Small models then always
produce a call that parses and has the schema's keys; the values are still the model's. This
needs the call format of the model's tool parser (hermes or llama3_json); with another parser
the tools are rendered and the model decides.

langchain-core is optional: without it this module still imports (the plugin manager loads it on
every start) and `ChatHibana(...)` raises an ImportError that says what to install.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal

from pydantic import Field, PrivateAttr

from hibana_core.chat import Chat, ChatDelta, ChatResult as TurnResult, Usage
from hibana_core.config import SamplingParams
from hibana_core.errors import HibanaError, StateBusyError
from hibana_plugins.hookspecs import hookimpl
from hibana_plugins.tool_parsers import ParsedOutput, ToolCallDelta

try:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage,
                                         FunctionMessage, HumanMessage, SystemMessage, ToolMessage)
    from langchain_core.messages.tool import tool_call_chunk
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import RunnableMap, RunnablePassthrough
    from langchain_core.runnables.config import ensure_config
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_core.utils.pydantic import is_basemodel_subclass
except ImportError as _missing:  # langchain-core is an optional dependency
    _IMPORT_ERROR: ImportError | None = _missing

    class BaseChatModel:  # type: ignore[no-redef]
        """Stands in for langchain-core's class so that this module imports without it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError("ChatHibana needs langchain-core: pip install 'hibana[langchain]'") from _IMPORT_ERROR
else:
    _IMPORT_ERROR = None


@hookimpl
def register_adapters(register) -> None:
    register("langchain", ChatHibana)


PROVIDER = "hibana"
_ANONYMOUS = "langchain-"          # prefix of the states this adapter makes for calls that name none
_NAME_TOKENS = 24                  # most tokens for a forced call's tool name
_MEDIA_BLOCKS = frozenset({"image", "image_url", "audio", "input_audio", "video", "file", "document"})


class UnsupportedContentError(HibanaError, ValueError):
    """A message carries content the model cannot read (an image, audio, a file)."""


# --- forced tool calls ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _CallSyntax:
    """How a tool-call parser's format spells one call around its name and arguments."""

    open: str    # up to the name
    mid: str     # between the name and the arguments object
    close: str   # after the arguments object


_SYNTAX = {
    "hermes": _CallSyntax('<tool_call>\n{"name": "', '", "arguments":', '}\n</tool_call>'),
    "llama3_json": _CallSyntax('{"name": "', '", "parameters":', "}"),
}


@dataclass(frozen=True)
class _Stage:
    """One request of an assistant turn: text the adapter writes into the turn, then generation."""

    write: str = ""
    max_tokens: int = 0            # 0: no generation; the turn ends after a sync
    stop: tuple[str, ...] = ()
    live: bool = False             # generated text is part of the turn; else it goes back to the plan


@dataclass(frozen=True)
class _Slot:
    """One required argument the model fills: what to write after `"key":`, when to stop, and how
    the generated text becomes a value."""

    key: str
    prompt: str                    # ' "' (strings), ' ' (numbers), '' (booleans): token boundaries
    stop: tuple[str, ...]
    max_tokens: int
    parse: Callable[[str], Any]

    def commit(self, raw: str) -> str:
        """The value's JSON text that follows the prompt already written."""
        return (" " + json.dumps(self.parse(raw), ensure_ascii=False))[len(self.prompt):]


def _snap(text: str, choices: Sequence[str]) -> str:
    """The choice a constrained decoder would have reached from `text`: one that extends it, else
    the one sharing its longest prefix (the first among equals)."""
    text = text.strip()
    return next((c for c in choices if c.startswith(text)), None) or max(
        choices, key=lambda c: len(os.path.commonprefix([c, text])))


def _string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:  # an unescaped control character, or a cut escape
        return raw.rstrip("\\")


def _number(integer: bool) -> Callable[[str], int | float | None]:
    def parse(raw: str) -> int | float | None:
        found = re.match(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", raw.strip().strip('"'))
        if found is None:
            return None  # the model wrote no number: the tool's validation reports it
        value = float(found.group())
        return int(value) if integer or (value.is_integer() and not found.group(1)) else value
    return parse


def _boolean(raw: str) -> bool | None:
    word = raw.strip().lower()
    return True if word.startswith("t") else False if word.startswith("f") else None


def _slot(key: str, schema: dict) -> _Slot | None:
    """How to fill one argument, or None when its schema is not a scalar one."""
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        options = [o for o in options if o.get("type") != "null"]
        return _slot(key, options[0]) if len(options) == 1 else None
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) for v in enum):
        return _Slot(key, ' "', ('"', "\n"), 48, lambda raw: _snap(_string(raw), enum))
    if kind == "string":  # a raw newline: the model left the string without closing it
        return _Slot(key, ' "', ('"', "\n"), 48, _string)
    if kind in ("integer", "number"):
        return _Slot(key, " ", (",", "}", "\n"), 12, _number(kind == "integer"))
    if kind == "boolean":
        return _Slot(key, "", (",", "}"), 4, _boolean)
    return None


def _slots(parameters: dict) -> list[_Slot] | None:
    """The required arguments of a flat object schema, in schema order; None for any other schema
    (nested objects, arrays, free-form objects): the model then writes the arguments itself."""
    properties = parameters.get("properties")
    if parameters.get("type", "object") != "object" or properties is None:
        return None
    required = set(parameters.get("required", ()))
    slots = [_slot(key, schema) for key, schema in properties.items() if key in required]
    return None if None in slots else slots


def _call_plan(syntax: _CallSyntax, tools: list[dict], forced: str | None, guided: bool,
               budget: int) -> Generator[_Stage, str, None]:
    """The stages of a forced call: the name (unless given), then the arguments, value by value
    on a flat schema (`guided`), else written by the model. Each yield receives the text that
    stage generated."""
    names = [t["function"]["name"] for t in tools]
    write = syntax.open
    if forced is None:
        forced = _snap((yield _Stage(write, _NAME_TOKENS, ('"',))), names)
        write = ""
    write += json.dumps(forced, ensure_ascii=False)[1:-1] + syntax.mid
    parameters = tools[names.index(forced)]["function"].get("parameters") or {"properties": {}}
    slots = _slots(parameters) if guided else None
    if slots is None:
        yield _Stage(write, budget, live=True)
        return
    write += " {"
    for i, slot in enumerate(slots):
        write += (", " if i else "") + json.dumps(slot.key, ensure_ascii=False) + ":" + slot.prompt
        raw = yield _Stage(write, min(slot.max_tokens, budget), slot.stop)
        write = slot.commit(raw)
    yield _Stage(write + "}" + syntax.close)


def _free_plan(budget: int) -> Generator[_Stage, str, None]:
    yield _Stage("", budget, live=True)


@dataclass(frozen=True)
class _Request:
    prompt: list[int]
    params: SamplingParams


class _TurnRun:
    """Runs a plan on one state, one request per stage, without doing I/O itself (the sync and
    async drivers share it). Written and generated text of the turn go through the tool parser's
    stream, so a forced call streams and parses like one the model wrote on its own."""

    def __init__(self, chat: Chat, prompt: list[int], plan: Generator[_Stage, str, None],
                 params: SamplingParams, tools: bool) -> None:
        self.chat, self.base, self.plan, self.params = chat, prompt, plan, params
        self.parser = chat.parser.stream() if tools else _PlainStream()
        self.text = ""             # the assistant turn so far
        self.raw = ""              # what the current (not live) stage generated
        self.stage = next(plan)
        self.usage: Usage | None = None
        self.generated = 0
        self.finish_reason = "stop"

    def begin(self) -> tuple[list[ChatDelta], _Request]:
        stage, self.raw = self.stage, ""
        deltas = self._feed(stage.write)
        prompt = self.base + self.chat.engine.tokenizer.encode(self.text, add_special_tokens=False)
        if stage.max_tokens == 0:  # the adapter wrote the turn's end: hold it, end of turn included
            return deltas, _Request(prompt + list(self.chat.stop_token_ids[:1]),
                                    dataclasses.replace(self.params, max_tokens=0))
        stop = stage.stop if not stage.live else tuple(self.params.stop) + stage.stop
        return deltas, _Request(prompt, dataclasses.replace(self.params, max_tokens=stage.max_tokens, stop=stop))

    def on_event(self, event) -> list[ChatDelta]:
        if event.completion is not None:
            stats = event.completion.stats
            if self.usage is None:  # the first request's prompt is the call's input
                self.usage = Usage(stats.prompt_tokens, stats.reused, 0)
            self.generated += len(event.completion.token_ids)
            if self.stage.live:  # a value stage that reaches its cap still completes the call
                self.finish_reason = event.completion.finish_reason
        if self.stage.live:
            return self._feed(event.text)
        self.raw += event.text
        return []

    def advance(self) -> bool:
        """Move to the next stage; False when the turn is complete."""
        try:
            self.stage = self.plan.send(self.raw)
        except StopIteration:
            return False
        return True

    def finish(self) -> list[ChatDelta]:
        deltas = self._pieces(self.parser.close())
        parsed = self.parser.finish()
        usage = dataclasses.replace(self.usage, completion_tokens=self.generated)
        if self.finish_reason in ("length", "cancelled") or not parsed.error:
            reason = "tool_calls" if parsed.tool_calls and self.finish_reason == "stop" else self.finish_reason
            text = self.text.strip() if parsed.error else parsed.content
            result = TurnResult(text, [] if parsed.error else parsed.tool_calls, reason, usage, parsed.error)
        else:
            result = TurnResult(self.text.strip(), [], "malformed_tool_call", usage, parsed.error)
        return deltas + [ChatDelta(result=result)]

    def _feed(self, text: str) -> list[ChatDelta]:
        self.text += text
        return self._pieces(self.parser.feed(text)) if text else []

    @staticmethod
    def _pieces(pieces: list) -> list[ChatDelta]:
        return [ChatDelta(tool_call=p) if isinstance(p, ToolCallDelta) else ChatDelta(text=p) for p in pieces]


class _PlainStream:
    """The parser stream of a turn offered no tools: all of it is text."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def feed(self, text: str) -> list[str]:
        self.parts.append(text)
        return [text]

    def close(self) -> list[str]:
        return []

    def finish(self) -> ParsedOutput:
        return ParsedOutput("".join(self.parts).strip(), [])


def _run(turn: _TurnRun, deadline: float | None) -> Iterator[ChatDelta]:
    while True:
        deltas, request = turn.begin()
        yield from deltas
        events = turn.chat.handle.stream(request.params, prompt=request.prompt)
        with contextlib.closing(events):  # leaving early cancels the request
            for event in events:
                _check_deadline(deadline)
                yield from turn.on_event(event)
        if not turn.advance():
            break
    yield from turn.finish()


async def _arun(turn: _TurnRun, deadline: float | None) -> AsyncIterator[ChatDelta]:
    while True:
        deltas, request = turn.begin()
        for delta in deltas:
            yield delta
        events = turn.chat.handle.astream(request.params, prompt=request.prompt)
        try:
            async for event in events:
                _check_deadline(deadline)
                for delta in turn.on_event(event):
                    yield delta
        finally:
            await events.aclose()  # leaving early cancels the request
        if not turn.advance():
            break
    for delta in turn.finish():
        yield delta


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("the ChatHibana call ran past its timeout; raise `timeout` or lower `max_tokens`")


# --- which state serves a call -------------------------------------------------------------------

class _Claims:
    """State ids serving a call right now, per engine: two concurrent calls never share a state
    (between the requests of a forced call a state is idle to the engine, yet still taken)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._ids: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()

    def take(self, engine, state_id: str) -> bool:
        """Claim `state_id`; False when another call holds it. Call with `lock` held."""
        taken = self._ids.setdefault(engine, set())
        if state_id in taken:
            return False
        taken.add(state_id)
        return True

    def release(self, engine, state_id: str) -> None:
        with self.lock:
            self._ids.get(engine, set()).discard(state_id)


_CLAIMS = _Claims()


def _continues(history: list[int], prompt: list[int], end_of_turn: Sequence[int]) -> bool:
    """Whether the prompt goes on from a state's conversation: holds it up to its last reply (which
    a re-render may spell differently). Only then does it take the state over; a conversation that
    merely shares the system prompt and tools gets a new state, which still shares those blocks
    through the engine's prefix index."""
    ends = [i + 1 for i, token in enumerate(history) if token in end_of_turn]
    if ends and ends[-1] == len(history):
        ends.pop()  # the end of the last reply
    needed = ends[-1] if ends else len(history)
    return len(prompt) >= needed and prompt[:needed] == history[:needed]


def _graph_state_id(run_manager) -> str | None:
    """`thread_id/namespace` from the LangGraph run config, the namespace's task ids dropped
    ("agent:3f2c..." names one step of node "agent"; the state must outlive the step)."""
    config = ensure_config()
    configurable = config.get("configurable") or {}
    metadata = {**(getattr(run_manager, "metadata", None) or {}), **(config.get("metadata") or {})}
    thread = configurable.get("thread_id") or metadata.get("thread_id")
    if thread is None:
        return None
    namespace = configurable.get("checkpoint_ns") or metadata.get("langgraph_checkpoint_ns") or ""
    path = [part.split(":")[0] for part in namespace.split("|") if part]
    if not path and metadata.get("langgraph_node"):
        path = [metadata["langgraph_node"]]
    return "/".join([str(thread), *path])


# --- messages and tools --------------------------------------------------------------------------

_KEY_ORDER = ("type", "name", "description", "properties", "required", "enum")


def _canonical(schema: Any) -> Any:
    """JSON schema with type, name and description first: the layout of OpenAI's and Qwen's
    examples, which small models trained on it read best (key order means nothing to JSON).
    Argument names under "properties" keep their order: it is the order of the arguments."""
    if isinstance(schema, list):
        return [_canonical(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    order = sorted(schema, key=lambda k: _KEY_ORDER.index(k) if k in _KEY_ORDER else len(_KEY_ORDER))
    return {k: ({name: _canonical(v) for name, v in schema[k].items()}
                if k in ("properties", "$defs") and isinstance(schema[k], dict) else _canonical(schema[k]))
            for k in order}


def _text(message: BaseMessage, media_allowed: bool = False) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif block.get("type") in _MEDIA_BLOCKS and not media_allowed:
            raise UnsupportedContentError(
                f"ChatHibana reads text only, and a {message.type} message holds a {block['type']!r} "
                "block; describe it in text or use a multimodal chat model")
    return "".join(parts)  # tool_use / thinking blocks of AI messages: the calls come from tool_calls


def _to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages as the OpenAI-style dicts `hibana_core.chat` renders."""
    out: list[dict] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text(m)})
        elif isinstance(m, AIMessage):
            message: dict[str, Any] = {"role": "assistant", "content": _text(m, media_allowed=True)}
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in m.tool_calls]
            out.append(message)
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": _text(m)})
        elif isinstance(m, FunctionMessage):
            out.append({"role": "tool", "name": m.name, "content": _text(m)})
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": _text(m)})
        else:
            raise UnsupportedContentError(f"ChatHibana cannot render a message of type {type(m).__name__}")
    return out


def _tool_choice(choice: Any, names: list[str]) -> str:
    """LangChain's tool_choice values as "auto", "none", "required" or a tool name."""
    if choice in (None, "auto"):
        return "auto"
    if choice in ("none", False):
        return "none"
    if choice in ("any", "required", True):
        return "required"
    if isinstance(choice, dict):
        choice = (choice.get("function") or choice).get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise ValueError(f"tool_choice={choice!r} names no bound tool; use 'auto', 'none', 'any', "
                     f"'required' or one of {names}")


# --- the chat model ------------------------------------------------------------------------------

@dataclass
class _Call:
    """What one model call runs on and how its result reads in LangChain's types; `with call:`
    holds the state's claim for the call's duration."""

    chat: Chat
    turn: _TurnRun
    model_name: str
    as_content: bool              # structured output by json_schema / json_mode: the arguments are the answer
    deadline: float | None

    def usage_metadata(self, usage: Usage) -> dict:
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_token_details": {"cache_read": usage.cached_tokens}}

    def response_metadata(self, result: TurnResult) -> dict:
        metadata = {"model_name": self.model_name, "model_provider": PROVIDER,
                    "finish_reason": result.finish_reason, "state_id": self.chat.handle.id}
        if result.error:
            metadata["tool_call_error"] = result.error
        return metadata

    def message(self, result: TurnResult) -> AIMessage:
        if self.as_content:  # the first call's arguments are the answer
            calls = []
            content = (json.dumps(result.tool_calls[0].arguments, ensure_ascii=False) if result.tool_calls
                       else result.text)
        else:
            content = result.text
            calls = [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in result.tool_calls]
        return AIMessage(content=content, tool_calls=calls, usage_metadata=self.usage_metadata(result.usage),
                         response_metadata=self.response_metadata(result))

    def chunk(self, delta: ChatDelta) -> ChatGenerationChunk | None:
        if delta.result is not None:  # usage and metadata once, on the last chunk
            message = AIMessageChunk(content="", usage_metadata=self.usage_metadata(delta.result.usage),
                                     response_metadata=self.response_metadata(delta.result), chunk_position="last")
        elif delta.tool_call is not None and self.as_content:
            if delta.tool_call.index or not delta.tool_call.arguments_fragment:
                return None  # the answer is the first call's arguments
            message = AIMessageChunk(content=delta.tool_call.arguments_fragment)
        elif delta.tool_call is not None:
            call = delta.tool_call
            message = AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(
                name=call.name, args=call.arguments_fragment, id=call.id, index=call.index)])
        elif self.as_content:
            return None  # text around the call is not part of a structured answer
        else:
            message = AIMessageChunk(content=delta.text)
        return ChatGenerationChunk(message=message)

    def __enter__(self) -> "_Call":
        return self

    def __exit__(self, *exc) -> None:  # the state is free for other calls
        _CLAIMS.release(self.chat.engine, self.chat.handle.id)


class ChatHibana(BaseChatModel):
    """Hibana as a LangChain chat model: local inference with the agent's KV cache kept resident.

    Objects on the same `model` and `engine_kwargs` share one engine per process
    (`Engine.shared`); pass `engine=` to use one you built. The engine loads on first use;
    `.engine` returns it.
    """

    model: str = "demo"
    """Hugging Face checkpoint directory, or "demo" for the bundled demo model."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Options for `Engine.shared` (device, dtype, max_model_len, ...), when no engine is passed."""
    state_id: str | None = None
    """The state that serves every call of this object; None picks one per call (module docstring)."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    max_tokens: int = 256
    """Most tokens one call generates."""
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    """Strings that end the generation (cut from the output)."""
    timeout: float | None = None
    """Seconds one call may take; checked as tokens arrive."""
    max_retries: int = 0
    """Accepted for drop-in use with remote chat models; a local engine has nothing to retry."""
    streaming: bool = False
    """`invoke` streams underneath (callbacks see tokens)."""
    guided_tool_arguments: bool = True
    """In a forced call with a flat argument schema, write the JSON and let the model fill values."""

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, *, engine: Any = None, **kwargs: Any) -> None:
        if engine is not None and "model" not in kwargs:
            kwargs["model"] = engine.config.model
        super().__init__(**kwargs)
        self._engine = engine

    @property
    def engine(self):
        """The `hibana_core.Engine` this model runs on (loaded on first use)."""
        if self._engine is None:
            from hibana_core import Engine

            self._engine = Engine.shared(self.model, **self.engine_kwargs)
        return self._engine

    @property
    def _llm_type(self) -> str:
        return "hibana-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        params = {"ls_provider": PROVIDER, "ls_model_name": kwargs.get("model") or self.model,
                  "ls_model_type": "chat", "ls_temperature": kwargs.get("temperature", self.temperature),
                  "ls_max_tokens": kwargs.get("max_tokens", self.max_tokens)}
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # -- tools and structured output --------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, strict: bool | None = None,
                   **kwargs: Any):
        """Tools as OpenAI function schemas; tool_choice "auto" (default), "none", "any" /
        "required" (some call), or a tool name (that call). Forced calls constrain the render
        (module docstring)."""
        formatted = [_canonical(convert_to_openai_tool(t, strict=strict)) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        return self.bind(tools=formatted, tool_choice=_tool_choice(tool_choice, names), **kwargs)

    def with_structured_output(self, schema: Any = None, *,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               include_raw: bool = False, strict: bool | None = None, **kwargs: Any):
        """A runnable returning `schema` (pydantic class) or a dict (TypedDict, JSON schema).

        "function_calling" forces a call to a tool made from the schema; "json_schema" and
        "json_mode" force the same call and return its arguments as the message's JSON content
        (json_mode without a schema lets the model write any JSON object)."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be function_calling, json_schema or json_mode, got {method!r}")
        if kwargs:
            raise ValueError(f"unsupported arguments {kwargs}")
        if schema is None and method == "json_schema":
            raise ValueError("method='json_schema' needs a schema")
        tool = (_canonical(convert_to_openai_tool(schema)) if schema is not None else
                {"type": "function", "function": {"name": "json", "description": "Answer with a JSON object.",
                                                  "parameters": {"type": "object"}}})
        trace = {"kwargs": {"method": method}, "schema": schema} if schema is not None else None
        llm = self.bind(answer_tool=tool, ls_structured_output_format=trace)
        pydantic_schema = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic_schema else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # -- calls --------------------------------------------------------------------------------------

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> ChatResult:
        with self._prepare(messages, stop, run_manager, kwargs) as call, \
                contextlib.closing(_run(call.turn, call.deadline)) as deltas:
            result = [d.result for d in deltas if d.result is not None][-1]
        return ChatResult(generations=[ChatGeneration(message=call.message(result))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> ChatResult:
        with self._prepare(messages, stop, run_manager, kwargs) as call:
            async with contextlib.aclosing(_arun(call.turn, call.deadline)) as deltas:
                result = [d.result async for d in deltas if d.result is not None][-1]
        return ChatResult(generations=[ChatGeneration(message=call.message(result))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        with self._prepare(messages, stop, run_manager, kwargs) as call, \
                contextlib.closing(_run(call.turn, call.deadline)) as deltas:
            for delta in deltas:
                chunk = call.chunk(delta)
                if chunk is not None:
                    if run_manager is not None:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        # closing the generators at once cancels the request (left to the collector, it would run on)
        with self._prepare(messages, stop, run_manager, kwargs) as call:
            async with contextlib.aclosing(_arun(call.turn, call.deadline)) as deltas:
                async for delta in deltas:
                    chunk = call.chunk(delta)
                    if chunk is not None:
                        if run_manager is not None:
                            await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                        yield chunk

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, run_manager,
                 kwargs: dict[str, Any]) -> _Call:
        """Pick the engine and the state, render, and plan the turn."""
        from hibana_core import Engine

        model = kwargs.get("model") or self.model
        engine = self.engine if model == self.model else Engine.shared(model, **self.engine_kwargs)
        chat_messages = _to_chat_messages(messages)
        tools, choice = kwargs.get("tools") or None, kwargs.get("tool_choice", "auto")
        answer_tool = kwargs.get("answer_tool")  # from with_structured_output(method="json_schema"/"json_mode")
        if answer_tool is not None:
            tools, choice = [answer_tool], answer_tool["function"]["name"]
        if choice == "none":
            tools = None
        chat = self._select_state(engine, chat_messages, tools, kwargs.get("state_id"), run_manager)
        try:
            params = self._params(chat, stop, kwargs)
            syntax = _SYNTAX.get(getattr(chat.parser, "name", None))
            if tools and choice not in ("auto", "none") and syntax is not None:
                if choice != "required":
                    name = choice
                elif len(tools) == 1:
                    name = tools[0]["function"]["name"]
                else:
                    name = None  # the model picks the tool
                plan = _call_plan(syntax, tools, name, self.guided_tool_arguments, params.max_tokens)
            else:
                plan = _free_plan(params.max_tokens)
            turn = _TurnRun(chat, chat.prompt_ids(chat_messages, tools), plan, params, tools is not None)
        except BaseException:
            _CLAIMS.release(engine, chat.handle.id)
            raise
        timeout = kwargs.get("timeout", self.timeout)
        deadline = time.monotonic() + timeout if timeout else None
        return _Call(chat, turn, model, answer_tool is not None, deadline)

    def _params(self, chat: Chat, stop: list[str] | None, kwargs: dict[str, Any]) -> SamplingParams:
        option = lambda name: kwargs[name] if kwargs.get(name) is not None else getattr(self, name)  # noqa: E731
        stops = stop if stop is not None else self.stop
        return SamplingParams(max_tokens=option("max_tokens"), temperature=option("temperature"),
                              top_p=option("top_p"), top_k=option("top_k"), seed=option("seed"),
                              repetition_penalty=option("repetition_penalty"), stop=tuple(stops or ()),
                              stop_token_ids=chat.stop_token_ids)

    def _select_state(self, engine, messages: list[dict], tools: list[dict] | None, state_id: str | None,
                      run_manager) -> Chat:
        """The state that serves this call, claimed until the call ends (module docstring)."""
        explicit = state_id or self.state_id
        if explicit:
            with _CLAIMS.lock:
                if not _CLAIMS.take(engine, explicit):
                    raise StateBusyError(f"state {explicit!r} is serving another call; give concurrent "
                                         "calls different state ids (or LangGraph thread ids)")
            return self._open(engine, explicit)
        graph_id = _graph_state_id(run_manager)
        if graph_id is not None:
            with _CLAIMS.lock:
                taken = _CLAIMS.take(engine, graph_id)
            if taken:  # else a concurrent task of the same node (Send fan-out): pick as below
                return self._open(engine, graph_id)
        fresh = engine.chat(f"{_ANONYMOUS}{uuid.uuid4().hex[:16]}")
        try:
            ids = engine.tokenizer.encode(fresh.render_text(messages, tools), add_special_tokens=False)
        except BaseException:
            fresh.handle.close()
            raise
        with _CLAIMS.lock:
            match = engine.match_state(ids)
            if (match is not None and match.id.startswith(_ANONYMOUS)
                    and _continues(match.tokens, ids, fresh.stop_token_ids) and _CLAIMS.take(engine, match.id)):
                chosen = match.id
            else:
                chosen = fresh.handle.id
                _CLAIMS.take(engine, chosen)
        if chosen == fresh.handle.id:
            return fresh
        fresh.handle.close()
        return self._open(engine, chosen)

    @staticmethod
    def _open(engine, state_id: str) -> Chat:
        try:
            return engine.chat(state_id)
        except BaseException:
            _CLAIMS.release(engine, state_id)
            raise
