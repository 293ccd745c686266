"""LangChain / LangGraph adapter: `ChatHibana`, a chat model whose agents keep their KV cache resident.

    from hibana_plugins.langchain import ChatHibana

    llm = ChatHibana(model="demo")          # or "Qwen/Qwen3-8B", a checkpoint directory, or engine=an Engine
    agent = create_react_agent(llm, tools, checkpointer=InMemorySaver())

Each call turns LangChain's messages into OpenAI-style dicts, renders them with the model's chat
template, and runs one assistant turn on one state (`hibana_core.chat.Chat`): only the tokens
that differ from what the state holds are computed. Which state serves a call:

    1. `state_id`: on the object, through `.bind(state_id=...)`, or as a call kwarg. A call on an
       id that is serving another call raises `hibana_core.StateBusyError` (an async call first
       waits, two seconds at most, for a stream its caller left: `options.lease_holder`).
    2. else LangGraph's `thread_id` and checkpoint namespace (task ids dropped): "t1/agent";
       while another call holds it (a Send fan-out of one node), the choice below. Outside a
       graph, `llm.invoke(..., config={"configurable": {"thread_id": "t1"}})` names "t1" the same way.
       A middleware's own model call in a node, which LangChain marks as internal
       (`LLMToolSelectorMiddleware`'s, in create_agent's "model" node), is another conversation,
       on a state of its own: "t1/model/tool_selection" (its `lc_source`).
    3. else a state made for an earlier call that named none, when the prompt goes on from its
       conversation (holds it up to its last reply) and no other call is using it; else a new
       state (`Chat.lease`).

Tool calls are valid by construction: a grammar holds every call to a bound tool's name and
(`guided_tool_arguments`) its argument schema, nested objects, arrays, enums and required keys
included. `tool_choice` "auto" lets the model answer in text and opens the grammar when it opens a
call; "any" / "required" / a tool's name and structured output (all three methods) hold the turn
to calls from its first token (`hibana_core.turn`). `bind_tools(..., strict=True)` makes the
schemas strict (no keys beyond the schema's), and the grammar enforces them as given.

langchain-core is optional: without it this module still imports (the plugin manager loads it on
every start) and `ChatHibana(...)` raises a MissingDependencyError (an ImportError) that says what to
install, as `HibanaLLM` does without llama-index.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import dataclasses
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from hibana_core import turn
from hibana_core.chat import (Chat, ChatDelta, ChatResult as TurnResult, ConversationError,  # noqa: F401
                              StreamedLogprobs, ToolSchemaError, UnsupportedContentError, Usage, clean_tool,
                              normalize_tool_choice, normalize_tools)
from hibana_core.config import SamplingParams
from hibana_core.errors import ConfigError, MissingDependencyError
from hibana_core.messages import response_format_schema, unheld
from hibana_plugins.options import (ALIASES, SAMPLING, EngineChoice, LeaseHolder, check_engine, check_engine_kwargs,
                                    check_given_engine, check_known, check_state_id, check_switches, choose_engine,
                                    lease_holder, resolve_aliases, sampling_params, sharing, unset_nones)

try:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, ChatMessage,
                                         FunctionMessage, HumanMessage, SystemMessage, ToolMessage,
                                         convert_to_messages)
    from langchain_core.messages.tool import invalid_tool_call, tool_call_chunk
    from langchain_core.exceptions import OutputParserException
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
    from langchain_core.tools import BaseTool
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import RunnableMap, RunnablePassthrough
    from langchain_core.runnables.config import ensure_config, var_child_runnable_config
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_core.utils.pydantic import is_basemodel_subclass

    def _noted(chunks: Iterator[Any], into: list) -> Iterator[Any]:
        """`chunks`, each also put `into` the list (what a parser's stream read)."""
        for chunk in chunks:
            into.append(chunk)
            yield chunk

    async def _anoted(chunks: AsyncIterator[Any], into: list) -> AsyncIterator[Any]:
        async for chunk in chunks:
            into.append(chunk)
            yield chunk

    class _CheckedAtEnd:
        """A parser whose stream, its partial answers yielded, raises at its end where `invoke`'s
        parse of the whole reply would (`_end_error`), as ChatOpenAI's stream of a structured
        answer raises LengthFinishReasonError at its end: a cut answer's stream ended without a word
        (nothing yielded where the cut call had sent no chunk)."""

        def _transform(self, input: Iterator[Any]) -> Iterator[Any]:
            chunks: list = []
            yield from super()._transform(_noted(input, chunks))
            self._raise_at_end(chunks)

        async def _atransform(self, input: AsyncIterator[Any]) -> AsyncIterator[Any]:
            chunks: list = []
            async for parsed in super()._atransform(_anoted(input, chunks)):
                yield parsed
            self._raise_at_end(chunks)

        def _raise_at_end(self, chunks: list) -> None:
            messages = [c for c in chunks if isinstance(c, BaseMessage)]
            if messages and self._checks_end:  # (include_raw's stream: an error there could not be caught)
                merged = messages[0]
                for message in messages[1:]:
                    merged = merged + message
                self._end_error(merged)

    class _WholeAnswer(_CheckedAtEnd):
        """An answer parser that refuses an answer max_tokens cut, as ChatOpenAI's `.parse()` raises
        LengthFinishReasonError: LangChain's JSON parser reads partial JSON, and a cut answer came
        back as a dict without its required keys. A stream's partial answers stay partial; its end
        raises as `parse_result` does."""

        def _end_error(self, message: Any) -> None:
            self.parse_result([ChatGeneration(message=message)])

        def parse_result(self, result: list, *, partial: bool = False) -> Any:
            message = getattr(result[0], "message", None) if result and not partial else None
            # the generation's text, as the parser reads it: output_version="v1" makes the content a
            # list of blocks
            text = result[0].text if message is not None else None
            if message is not None and message.response_metadata.get("finish_reason") == "length":
                raise OutputParserException(
                    "the structured answer was cut before its JSON ended (finish_reason 'length'): raise "
                    "max_tokens (or shorten the history, where the model's context ended it)", llm_output=text)
            if message is not None and not _whole_json(text):
                # a stop sequence or stop token cut it: the partial JSON read as a dict without its keys
                reason = message.response_metadata.get("finish_reason")
                raise OutputParserException(
                    f"the structured answer ended before its JSON did (finish_reason {reason!r}: a stop sequence "
                    "or stop token ended it): take that sequence out of stop", llm_output=text)
            return super().parse_result(result, partial=partial)

    class _WholeJson(_WholeAnswer, JsonOutputParser):
        _checks_end: bool = PrivateAttr(default=True)

    class _WholePydantic(_WholeAnswer, PydanticOutputParser):
        _checks_end: bool = PrivateAttr(default=True)

    class _WholeCall(_CheckedAtEnd):
        """A tool parser (function_calling) that refuses a forced call the reply ended inside:
        LangChain's returns None for a turn without a valid call, so a cut answer came back as None
        with no error, even with include_raw. A stream's end raises where the first call was cut:
        its chunks, merged, read as a whole call (the cut is then only `tool_call_error`)."""

        def _end_error(self, message: Any) -> None:
            reason = message.response_metadata.get("finish_reason")
            error = message.response_metadata.get("tool_call_error")  # the cut call is the reply's last
            chunks = getattr(message, "tool_call_chunks", None) or []
            later = any((c.get("index") or 0) > 0 for c in chunks)  # the first call was whole
            if (error and not later) or (reason == "length" and not chunks):
                raise OutputParserException(
                    f"the structured answer's call was not whole: "
                    f"{error or f'the reply ended before it (finish_reason {reason!r}): raise max_tokens'}")

        def parse_result(self, result: list, *, partial: bool = False) -> Any:
            parsed = super().parse_result(result, partial=partial)
            message = getattr(result[0], "message", None) if result and not partial else None
            if parsed is None and message is not None:
                invalid = getattr(message, "invalid_tool_calls", None) or []
                reason = message.response_metadata.get("finish_reason")
                if invalid or reason == "length":
                    why = invalid[0].get("error") if invalid else None
                    raise OutputParserException(
                        f"the structured answer's call was not whole: "
                        f"{why or f'the reply ended before it (finish_reason {reason!r}): raise max_tokens'}",
                        llm_output=invalid[0].get("args") if invalid else None)
            return parsed

    class _WholeKeyTools(_WholeCall, JsonOutputKeyToolsParser):
        _checks_end: bool = PrivateAttr(default=True)

    class _WholePydanticTools(_WholeCall, PydanticToolsParser):
        _checks_end: bool = PrivateAttr(default=True)
except ImportError as _missing:  # langchain-core is an optional dependency
    _IMPORT_ERROR: ImportError | None = _missing

    class BaseChatModel:  # type: ignore[no-redef]
        """Stands in for langchain-core's class so that this module imports without it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise MissingDependencyError(f"ChatHibana needs langchain-core ({_IMPORT_ERROR}); install it with "
                                         "`pip install 'hibana[langchain]'`") from _IMPORT_ERROR
else:
    _IMPORT_ERROR = None


PROVIDER = "hibana"
CALL_OPTIONS = frozenset({*SAMPLING, "tools", "tool_choice", "parallel_tool_calls", "state_id", "timeout", "model",
                          "reasoning", "reasoning_effort", "answer_tool", "ls_structured_output_format", "stream",
                          "response_format"})
"""What a call (`invoke(..., **kwargs)`, `.bind(**kwargs)`) may set; anything else is a ConfigError.
`stream` is LangChain's own per-call switch (`BaseChatModel._should_stream` reads it, then passes
it on): taken and left to LangChain. `response_format`: the answer's text held to a JSON schema, as
ChatOpenAI takes it (`_response_format`)."""
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_METHODS = ("function_calling", "json_schema", "json_mode")
_ANY_JSON = {"type": "function", "function": {"name": "json", "description": "Answer with a JSON object.",
                                              "parameters": {"type": "object"}}}
"""json_mode's answer tool when no schema is given."""
_MEDIA_BLOCKS = frozenset({"image", "image_url", "audio", "input_audio", "video", "file", "document"})


# --- which state serves a call: an explicit id, else LangGraph's, else Chat.lease's choice ----------

def _graph_state_id(run_manager) -> str | None:
    """`thread_id/namespace` from the LangGraph run config, the namespace's task ids dropped
    ("agent:3f2c..." names one step of node "agent"; the state must outlive the step), then the
    source of a call LangChain marks as a middleware's own ("t1/model/tool_selection")."""
    config = ensure_config()
    configurable = config.get("configurable") or {}
    metadata = {**(getattr(run_manager, "metadata", None) or {}), **(config.get("metadata") or {})}
    thread = next((t for t in (configurable.get("thread_id"), metadata.get("thread_id")) if t not in (None, "")), None)
    if thread is None:  # (LangGraph takes any id: thread 0 names a state too)
        return None
    namespace = configurable.get("checkpoint_ns") or metadata.get("langgraph_checkpoint_ns") or ""
    path = [part.split(":")[0] for part in namespace.split("|") if part]
    if not path and metadata.get("langgraph_node"):
        path = [metadata["langgraph_node"]]
    if metadata.get("lc_internal_call"):  # a middleware's own call in the node (LangChain's tool selection):
        path.append(str(metadata.get("lc_source") or "internal"))  # another conversation, a state of its own
    return "/".join([str(thread), *path])


def _graph_step() -> tuple | None:
    """The LangGraph step making this call: the checkpoints it runs from (its checkpoint_map), the
    same for the calls of one step (Send's branches), another for each later step or run of the
    thread (`options.LeaseHolder.gone_for`); None outside a graph."""
    checkpoints = (ensure_config().get("configurable") or {}).get("checkpoint_map")
    return tuple(sorted(checkpoints.items())) if isinstance(checkpoints, dict) and checkpoints else None


@contextlib.contextmanager
def _call_config(config) -> Iterator[None]:
    """A direct call's `configurable` (its thread_id) where `_graph_state_id` reads it: LangGraph
    sets the run config of each node's calls; `llm.invoke(..., config=...)` passes only its
    callbacks, tags and metadata on to `_generate`."""
    configurable = (config or {}).get("configurable")
    if not configurable:
        yield
        return
    current = var_child_runnable_config.get() or {}
    token = var_child_runnable_config.set(
        {**current, "configurable": {**(current.get("configurable") or {}), **configurable}})
    try:
        yield
    finally:
        var_child_runnable_config.reset(token)


_CALLER: contextvars.ContextVar[asyncio.Task | None] = contextvars.ContextVar("hibana_langchain_caller", default=None)
"""The task that called `ainvoke`, for its call's `options.lease_holder`: LangChain runs
`_agenerate` in a task of its own (agenerate's gather), and a call waits only for a state that a
stream of its caller's still holds."""
_OPENED: contextvars.ContextVar[list | None] = contextvars.ContextVar("hibana_langchain_opened", default=None)
"""Where `_astream` leaves its call (and the engine stream), while `astream` awaits its first chunk."""


# --- messages ------------------------------------------------------------------------------------

def _text(message: BaseMessage, media_allowed: bool = False) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif block.get("type") == "json" and "json" in block:  # a tool's JSON result, as ToolNode passes it on
            parts.append(_json_text(block["json"], message))
        elif block.get("type") == "search_result":  # a tool's search result (a standard tool-result block)
            parts.append(_search_result_text(block, message))
        elif block.get("type") == "custom_tool_call_output":  # an OpenAI custom tool's output, as ToolNode passes it
            output = block.get("output")
            parts.append(output if isinstance(output, str) else _json_text(output, message))
        elif block.get("type") in _MEDIA_BLOCKS and not media_allowed:
            raise UnsupportedContentError(
                f"ChatHibana reads text only, and a {message.type} message holds a {block['type']!r} "
                "block; describe it in text or use a multimodal chat model")
        elif not media_allowed:  # another model's blocks in an AI message (tool_use, thinking) are not content
            raise ConversationError(f"a {message.type} message holds the block {block!r:.80}; ChatHibana reads "
                                    "strings and text, json, search_result and custom_tool_call_output blocks")
    return "".join(parts)  # tool_use / thinking blocks of AI messages: the calls come from tool_calls


def _search_result_text(block: dict, message: BaseMessage) -> str:
    """A {"type": "search_result"} block (title, source, text content, as Anthropic's search results
    are) as the text the model reads: its title, its source and its text, a line apart."""
    content = block.get("content")
    texts = [content] if isinstance(content, str) else [
        part["text"] for part in content or () if isinstance(part, dict) and isinstance(part.get("text"), str)]
    if not isinstance(content, (str, list, type(None))) or (isinstance(content, list) and len(texts) != len(content)):
        raise ConversationError(f"a {message.type} message holds a search_result block whose content is "
                                f"{content!r:.80}; its content is a string or a list of text blocks")
    head = [block[key] for key in ("title", "source") if isinstance(block.get(key), str) and block[key]]
    return "\n".join(head + ["".join(texts)])  # (text blocks joined as a message's are)


def _json_text(value: Any, message: BaseMessage) -> str:
    """A {"type": "json"} block's value as JSON text (the text a tool returning it as a string would give)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConversationError(f"a {message.type} message holds a json block JSON cannot hold ({exc}); "
                                "give it JSON values, or the result as text") from None


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
            # invalid calls (arguments that did not parse, from another model) are kept as the
            # model wrote them, their arguments as text: raising would end the conversation for good;
            # one cut before its name is none (it went back as a call named "", which Mistral's refused)
            calls = [(c.get("id"), c.get("name"), c["args"]) for c in m.tool_calls]
            calls += [(c.get("id"), c["name"], c.get("args") or "") for c in m.invalid_tool_calls if c.get("name")]
            legacy = m.additional_kwargs.get("function_call")  # OpenAI's deprecated functions form, which
            if not calls and isinstance(legacy, dict) and legacy.get("name"):  # a FunctionMessage answers
                calls = [(None, legacy["name"], legacy.get("arguments", ""))]  # JSON text, which normalize_messages
                # parses as any call's (kept as text where it spells no JSON)
            if calls:
                message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                         for i, n, a in calls]
            if m.additional_kwargs.get("reasoning_content"):  # the template decides whether it is rendered
                message["reasoning_content"] = m.additional_kwargs["reasoning_content"]
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


def _openai_tool(i: int, tool: Any, strict: bool | None) -> dict:
    """`convert_to_openai_tool`, its refusals (of many types) as ToolSchemaError. An OpenAI tool
    dict is converted from its function, which the conversion would return as it is, `strict`
    left out."""
    if (strict is not None and isinstance(tool, dict) and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict)):  # (OpenAI's parameters may be left out: none)
        tool = {"parameters": {"type": "object", "properties": {}}, **tool["function"]}
    try:
        return convert_to_openai_tool(tool, strict=strict)
    except Exception as exc:  # noqa: BLE001 - ValueError, TypeError, KeyError, pydantic's, ...
        raise ToolSchemaError(f"tool {i} ({tool!r:.80}) is not a tool LangChain can describe: {exc}; pass a "
                              "@tool function, a pydantic model or an OpenAI function dict") from exc


def _bound_tool(i: int, tool: Any, strict: bool | None) -> dict:
    """The tool as `bind_tools` and `with_structured_output` bind it: LangChain's conversion, cleaned,
    but a pydantic model (or a @tool's arguments) that holds itself keeps its own schema (the
    conversion writes {} where it recurs: any value, which the grammar let through)."""
    bound = clean_tool(_openai_tool(i, tool, strict))
    model = tool.tool_call_schema if isinstance(tool, BaseTool) else tool  # a @tool's arguments, as a model
    if isinstance(model, type) and is_basemodel_subclass(model) and hasattr(model, "model_json_schema"):
        own = model.model_json_schema()  # (pydantic 2; a v1 model keeps LangChain's conversion)
        if _refers_to_itself(own):
            bound["function"]["parameters"] = own
    return bound


def _structured_tool(schema: Any, strict: bool | None) -> dict:
    """The tool `with_structured_output` forces: LangChain's conversion, but a pydantic model that
    holds itself keeps its own schema (the conversion writes {} where it recurs: any value). As
    OpenAI's `strict` (unset: false), a keyword the grammar cannot hold (pydantic's HttpUrl,
    max_length beside a pattern) is left to the model and the answer checked as it is parsed;
    with strict=True such a schema is refused (ToolSchemaError). OpenAI's response formats
    ({"name", "schema"}, or it inside {"type": "json_schema", "json_schema": ...}), which
    ChatOpenAI takes, are their schema: the conversion read the first as a function without
    parameters (any object) and refused the second."""
    if isinstance(schema, dict) and schema.get("type") == "json_schema" and isinstance(schema.get("json_schema"), dict):
        schema = schema["json_schema"]
    if isinstance(schema, dict) and "name" in schema and "schema" in schema:
        schema = {"parameters": schema["schema"],
                  **{key: schema[key] for key in ("name", "description", "strict") if key in schema}}
    tool = _bound_tool(0, schema, strict)
    if strict is True:
        problems = unheld(normalize_tools([tool])[0]["function"].get("parameters") or {})
        if problems:
            raise ToolSchemaError(f"with_structured_output({tool['function']['name']!r}, strict=True): the grammar "
                                  f"cannot hold the answer to this schema ({'; '.join(problems)}); relax those "
                                  "fields, or leave strict unset to have them left to the model (the answer is "
                                  "then checked as it is parsed)")
    return tool


def _response_format(value: Any) -> tuple[dict | None, bool]:
    """A call's `response_format` as (the JSON schema the answer's text is held to, or None; strict),
    in the forms ChatOpenAI takes: OpenAI's ({"type": "text" | "json_object" | "json_schema", ...},
    `messages.response_format_schema`), or a schema (a pydantic class, a TypedDict, a JSON schema),
    not strict as OpenAI's default. Tools stay callable beside it: the schema holds the answer,
    not the calls (what LangChain's create_agent binds for `response_format=`)."""
    if isinstance(value, Mapping) and value.get("type") in _RESPONSE_FORMAT_TYPES:
        return response_format_schema(value)
    if isinstance(value, Mapping):  # a JSON schema itself
        return dict(value), False
    if not isinstance(value, type):
        raise ConfigError(f"a ChatHibana call: response_format must be OpenAI's {{'type': 'json_schema', "
                          f"'json_schema': {{...}}}}, a pydantic class, a TypedDict or a JSON schema, got {value!r:.80}")
    return _structured_tool(value, False)["function"].get("parameters") or {"type": "object"}, False


def _untitled_json_schema(schema: Any) -> bool:
    """Whether `schema` is a bare JSON schema without the title LangChain names a function by (not
    an OpenAI function or response format, which carry their names)."""
    return (isinstance(schema, dict) and not {"title", "name", "json_schema", "function"} & schema.keys()
            and ("properties" in schema or schema.get("type") == "object"))


def _whole_json(content: Any) -> bool:
    """Whether a structured answer's content is one whole JSON value (what the grammar writes)."""
    try:
        json.loads(content)
    except (TypeError, ValueError):
        return False
    return True


def _refers_to_itself(schema: dict) -> bool:
    """Whether a "$defs" entry of `schema` reaches itself through "#/$defs/..." references."""
    defs = schema.get("$defs") if isinstance(schema.get("$defs"), dict) else {}
    prefix = "#/$defs/"
    edges = {name: set(re.findall(re.escape(prefix) + r'([^"/]+)', json.dumps(sub))) for name, sub in defs.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False
    return any(reaches(name, name, {name}) for name in edges)


# --- the chat model ------------------------------------------------------------------------------

@dataclass
class _Call:
    """One model call: the turn to run, the state to run it on, and how its result reads in
    LangChain's types."""

    chat: Chat                    # renders; `run` leases the state
    prompt: str                   # the rendered conversation
    tools: list[dict] | None
    params: SamplingParams
    options: dict[str, Any]       # Chat.opener's: tool_choice, parallel_tool_calls, parse_tools, guided, timeout
    state_id: str | None          # an explicit or LangGraph id
    fallback: bool                # another state when state_id is busy (LangGraph ids only)
    model_name: str
    as_content: bool              # structured output by json_schema / json_mode: the arguments are the answer
    served_by: str = field(default="", init=False)
    answered: bool = field(default=False, init=False)  # a call's arguments streamed (as_content)
    holder: LeaseHolder | None = field(default=None, init=False)  # an async call's (`lease_holder`)
    stream: Any = field(default=None, init=False)  # `_astream`'s engine stream
    streamed_logprobs: StreamedLogprobs | None = field(default=None, init=False)  # a stream's, chunk by chunk

    def open(self, stack: contextlib.ExitStack) -> tuple[turn.TurnRun, Any]:
        """Starts the turn on the state `Chat.lease` picks (`turn.Open`)."""
        open_turn = self.chat.opener(self.prompt, self.tools, self.params, lease=True, state_id=self.state_id,
                                     fallback=self.fallback, **self.options)
        run, handle = open_turn(stack) if self.holder is None else self.holder.open(open_turn, stack)
        self.served_by = handle.id
        return run, handle

    async def held(self) -> "_Call":
        """This call, made async: once a stream its caller left is done with the state it names."""
        self.holder = await lease_holder(self.chat.engine, self.state_id, _CALLER.get(), _graph_step())
        return self

    async def close(self) -> None:
        """Close the engine's stream (its state let go) when `astream` is closed, before its end
        or after it."""
        self.holder.left = True  # a call on the state meanwhile waits for it
        await self.stream.aclose()

    def usage_metadata(self, usage: Usage) -> dict:
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                "input_token_details": {"cache_read": usage.cached_tokens},
                "output_token_details": {"reasoning": usage.reasoning_tokens}}

    def response_metadata(self, result: TurnResult) -> dict:
        reason = turn.openai_finish_reason(result)  # a malformed call's turn is "stop", as ChatOpenAI's
        if self.as_content and reason == "tool_calls":
            reason = "stop"  # the call's arguments are the content: the message has no tool calls
        metadata = {"model_name": self.model_name, "model_provider": PROVIDER,
                    "finish_reason": reason, "state_id": self.served_by}
        if result.error:  # a cut call's says what ended it and what to do, as its invalid call's error does
            metadata["tool_call_error"] = self.cut_call_error(result) if result.cut_call else result.error
        # streamed: the last chunk carries those no chunk did
        logprobs = (self.chat.openai_logprobs(result) if self.streamed_logprobs is None
                    else self.streamed_logprobs.take(result))
        if logprobs is not None:
            metadata["logprobs"] = {"content": logprobs}
        return metadata

    def chat_result(self, result: TurnResult) -> ChatResult:
        """The reply, and `llm_output` as ChatOpenAI's (`token_usage` in OpenAI's names, `model_name`),
        which callbacks written for it read in `on_llm_end` (the usage is on the message too)."""
        usage = result.usage
        token_usage = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                       "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                       "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
                       "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}
        return ChatResult(generations=[ChatGeneration(message=self.message(result))],
                          llm_output={"token_usage": token_usage, "model_name": self.model_name})

    def message(self, result: TurnResult) -> AIMessage:
        # the text as streamed: a reply without tools as generated, a malformed call as written
        calls, invalid = [], []
        if self.as_content:  # the first call's arguments are the answer
            # a reply cut at max_tokens (finish_reason "length"): the arguments it had begun, as
            # streaming sends them, never the call's markup
            content = (json.dumps(result.tool_calls[0].arguments, ensure_ascii=False) if result.tool_calls
                       else self.chat.cut_arguments(result.cut_call, self.tools))
        else:
            content = result.content
            calls = [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in result.tool_calls]
            if result.cut_call:  # an invalid call, as ChatOpenAI reports a cut one, not markup in the text
                name, arguments = self.chat.cut_call_parts(result.cut_call, self.tools)
                invalid = [invalid_tool_call(name=name or None, args=arguments, id=None,
                                             error=self.cut_call_error(result))]
        extra = {"reasoning_content": result.reasoning} if result.reasoning else {}
        return AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid,
                         usage_metadata=self.usage_metadata(result.usage),
                         response_metadata=self.response_metadata(result), additional_kwargs=extra)

    def cut_call_error(self, result: TurnResult) -> str:
        """What ended the reply inside a call, and what to do: max_tokens ("length"), else a stop
        (a stop string, or a stop token, where the call grammar held the turn)."""
        finish_reason = turn.openai_finish_reason(result)
        if self.chat.ended_at_context(result):
            return (f"the reply ended inside this call at the model's context of {self.chat.engine.max_model_len} "
                    "tokens (finish_reason 'length'): shorten the history")
        if finish_reason == "length":
            return "the reply ended inside this call (finish_reason 'length'): raise max_tokens"
        if self.params.stop:
            return (f"the reply ended inside this call at a stop sequence (stop={list(self.params.stop)!r}, "
                    f"finish_reason {finish_reason!r}): take that sequence out of stop")
        return f"the reply ended inside this call at a stop token (finish_reason {finish_reason!r})"

    def chunk(self, delta: ChatDelta) -> ChatGenerationChunk | None:
        """A delta as LangChain's chunk (None: none is sent). With logprobs, each chunk carries
        those of its tokens in `response_metadata["logprobs"]`, as ChatOpenAI's do; LangChain's
        sum of the chunks has the whole reply's."""
        if self.params.logprobs and self.streamed_logprobs is None:
            self.streamed_logprobs = StreamedLogprobs(self.chat)
        if self.streamed_logprobs is not None:
            self.streamed_logprobs.add(delta)
        message = self._chunk_message(delta)
        if message is None:
            return None  # its tokens' log-probabilities go with the next chunk sent
        if self.streamed_logprobs is not None and delta.result is None:
            logprobs = self.streamed_logprobs.take()
            if logprobs:
                message.response_metadata["logprobs"] = {"content": logprobs}
        return ChatGenerationChunk(message=message)

    def _chunk_message(self, delta: ChatDelta) -> AIMessageChunk | None:
        if delta.result is not None:  # usage and metadata once, on the last chunk
            message = AIMessageChunk(content="", usage_metadata=self.usage_metadata(delta.result.usage),
                                     response_metadata=self.response_metadata(delta.result), chunk_position="last")
        elif delta.reasoning:
            message = AIMessageChunk(content="", additional_kwargs={"reasoning_content": delta.reasoning})
        elif delta.tool_call is not None and self.as_content:
            if delta.tool_call.index or not delta.tool_call.arguments_fragment:
                return None  # the answer is the first call's arguments
            self.answered = True
            message = AIMessageChunk(content=delta.tool_call.arguments_fragment)
        elif delta.tool_call is not None:
            call = delta.tool_call
            message = AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(
                name=call.name, args=call.arguments_fragment, id=call.id, index=call.index)])
        elif delta.cut_call:
            # a call the reply ended inside: never its markup, nor a chunk, which LangChain's merge
            # would parse into a call the model never finished (invoke reports it as invalid); a
            # structured answer gets the arguments it had begun, as `message` has them
            arguments = self.chat.cut_arguments(delta.text, self.tools) if self.as_content and not self.answered else ""
            if not arguments:
                return None
            message = AIMessageChunk(content=arguments)
        elif self.as_content:
            return None  # text around the call is not part of a structured answer
        else:
            message = AIMessageChunk(content=delta.text)
        return message


class ChatHibana(BaseChatModel):
    """Hibana as a LangChain chat model: local inference with the agent's KV cache kept resident.

    Objects on the same `model` and `engine_kwargs` share one engine per process
    (`Engine.shared`); pass `engine=` to use one you built. The engine loads on first use;
    `.engine` returns it.

    Copies: a copy runs on the engine of its own `model` and `engine_kwargs`. One made with
    another (`model_copy(update={"model": ...})`, a configurable field) runs on
    `Engine.shared(model, **engine_kwargs)`, whether or not the original was given `engine=`:
    a given engine serves only the `model` and `engine_kwargs` it was given with, since options
    that ask for another engine must not run silently on this one. `copy.deepcopy` shares the
    engine. A pickle carries no engine (it does not pickle), not even a given one: the unpickled
    object loads or finds `Engine.shared(model, **engine_kwargs)` on first use. So does one that
    LangChain's `dumps` wrote and `loads` read back (`to_json`).
    """

    model: str = "demo"
    """A Hugging Face repo id ("Qwen/Qwen3-8B", "org/name@revision"; from the local cache, else
    downloaded), a checkpoint directory, or "demo" for the bundled demo model."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Options for `Engine.shared` (device, dtype, max_model_len, ...), when no engine is passed."""
    state_id: str | None = None
    """The state that serves every call of this object; None picks one per call (module docstring)."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    max_tokens: int | None = 256
    """Most tokens one call generates; None: no limit but the model's context (as ChatOpenAI's None)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    seed: int | None = None
    """Per-call sampling seed: same seed, same tokens, whatever shares the batch."""
    repetition_penalty: float = 1.0
    """HF-style, over the prompt and the output; alias `repeat_penalty` (Ollama, llama.cpp)."""
    presence_penalty: float = 0.0
    """OpenAI-style, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI-style, in [-2, 2]."""
    logit_bias: dict[int, float] | None = None
    """OpenAI-style: token id -> bias in [-100, 100] added to its logit (-100 bans the token)."""
    logprobs: bool = False
    """Return each generated token's log-probability in `response_metadata["logprobs"]`
    (OpenAI's shape: {"content": [{"token", "bytes", "logprob", "top_logprobs"}]})."""
    top_logprobs: int = 0
    """With logprobs: also this many most likely tokens at each position (0 to 20)."""
    speculation: Any = None
    """Speculative decoding of this model's calls: "adaptive" (or True), "off" (or False) or
    {"method": ..., "k": ...}; None: the engine's (set it engine-wide with
    engine_kwargs={"speculation": ...}). Speed only. Checked by SamplingParams, not by pydantic,
    which would read 1 and 0 as True and False where the engine refuses them."""
    stop: list[str] | None = None
    """Strings that end the generation (cut from the output); one string is a list of one, as in a call."""
    timeout: float | None = None
    """Seconds one call may take; checked as tokens arrive."""
    max_retries: int = 0
    """Accepted for drop-in use with remote chat models; a local engine has nothing to retry."""
    streaming: bool = False
    """`invoke` streams underneath (callbacks see tokens)."""
    reasoning: bool | None = None
    """A reasoning model's thinking (Qwen3): True / False go to the chat template as
    `enable_thinking`; None leaves the template's default. The thinking comes apart from the
    answer, in `additional_kwargs["reasoning_content"]` (streamed too)."""
    reasoning_effort: str | None = None
    """OpenAI's reasoning_effort level ("low", "medium", "high"), to a chat template that reads it
    (gpt-oss's harmony writes "Reasoning: high"); a level the model lacks is a ConfigError. Also
    per call: `invoke(..., reasoning_effort=...)`."""
    reasoning_history: Literal["template", "generated"] = "template"
    """Earlier turns' thinking: rendered as the template does (Qwen3's drops it, and the state
    recomputes from there), or kept as generated (nothing recomputed; the model sees it)."""
    guided_tool_arguments: bool = True
    """Hold tool-call arguments to the tool's JSON schema (the grammar); False: any JSON object
    (the call is still held to a bound tool's name)."""
    tool_parser: str | None = None
    """A registered tool parser by name (`hibana plugins` lists them; a plugin's too): how calls are
    written and read. None: the model's chat format's, else the one its chat template writes."""
    given_engine: Any = Field(default=None, exclude=True, repr=False)
    """The engine passed as `engine=`, with the options it serves (an `EngineChoice`). A field,
    left out of dumps, so that LangChain's rebuilt objects (`configurable_fields`) get it back."""

    _engine: Any = PrivateAttr(default=None)  # the EngineChoice in use
    _chat: Any = PrivateAttr(default=None)    # the chat layer of its engine

    def __init__(self, *, engine: Any = None, **kwargs: Any) -> None:
        """Unknown options raise a ConfigError and values are checked here, not on the first call
        (`hibana_plugins.options`); `num_ctx` is `engine_kwargs={"max_model_len": ...}`."""
        if _IMPORT_ERROR is not None:  # the stand-in raises the MissingDependencyError that says what to install
            super().__init__()
        kwargs = unset_nones(resolve_aliases(kwargs, "ChatHibana"))  # temperature=None: the default
        if "max_model_len" in kwargs:
            kwargs["engine_kwargs"] = {**kwargs.get("engine_kwargs", {}), "max_model_len": kwargs.pop("max_model_len")}
        given = kwargs.pop("given_engine", None)  # a rebuilt object's; users pass engine=
        if given is not None and not isinstance(given, EngineChoice):
            raise ConfigError("ChatHibana: given_engine is ChatHibana's own record of the engine passed; pass "
                              "your engine as engine=")
        check_known(kwargs, set(type(self).model_fields) - {"given_engine"} | {"engine"}, "ChatHibana")
        check_engine(engine, "ChatHibana")
        if engine is not None and "model" not in kwargs:
            kwargs["model"] = engine.config.model
        if isinstance(kwargs.get("model"), os.PathLike):  # a checkpoint's Path, as Engine.from_pretrained takes
            kwargs["model"] = os.fspath(kwargs["model"])
        # the values as given, before pydantic reads True as 1 and "5" as 5
        sampling_params(kwargs, "ChatHibana")
        check_switches(kwargs, "ChatHibana")
        try:
            super().__init__(given_engine=given, **kwargs)
        except ValidationError as exc:
            raise ConfigError(f"ChatHibana: {exc}") from None
        if engine is not None:
            check_given_engine(engine, self.engine_kwargs, "ChatHibana")
            self.given_engine = EngineChoice(engine, self.model, dict(self.engine_kwargs))
            if "profile" not in kwargs:  # resolved before the engine was recorded: now with its context
                self.profile = self._resolve_model_profile()
        check_state_id(vars(self), "ChatHibana")
        check_engine_kwargs(self.model, self.engine_kwargs)

    def _resolve_model_profile(self) -> dict[str, Any]:
        """What LangChain reads of this model (`model.profile`, langchain-core 1.1+): text in and out,
        tool calling with tool_choice and streamed call chunks, and the context (`max_input_tokens`,
        which the summarization middleware reads) where it is known without loading the model: an
        engine given, or `max_model_len` set.

        `structured_output` is left unsaid, though a call's `response_format` is held by the grammar:
        where a profile says it, `create_agent(response_format=...)` leaves the answer to the model
        as JSON text beside the tools (ProviderStrategy), and a small model keeps calling tools or
        writes the JSON badly; left unsaid, the agent forces a call to an answer tool, which the
        grammar holds (ToolStrategy, what LangChain gives open models through ChatOpenAI too).
        `ProviderStrategy(schema)` asks for the native form explicitly."""
        profile = {"text_inputs": True, "image_inputs": False, "audio_inputs": False, "video_inputs": False,
                   "pdf_inputs": False, "text_outputs": True, "image_outputs": False, "audio_outputs": False,
                   "video_outputs": False, "tool_calling": True, "tool_choice": True, "tool_call_streaming": True,
                   "temperature": True, "open_weights": True}
        context = (self.given_engine.engine.max_model_len if self.given_engine is not None
                   else self.engine_kwargs.get("max_model_len"))
        if context:
            profile["max_input_tokens"] = context
        return profile

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # ChatHibana(stop="...") as invoke(stop="...")

    def bind(self, **kwargs: Any):
        """`Runnable.bind`, its options checked now rather than on the first call."""
        _call_options(kwargs)
        return super().bind(**kwargs)

    @property
    def engine(self):
        """The `hibana_core.Engine` this model runs on (loaded on first use): the one passed while
        `model` and `engine_kwargs` are those it was passed with, else `Engine.shared`'s."""
        self._engine = choose_engine(self.model, self.engine_kwargs, self._engine, self.given_engine)
        return self._engine.engine

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> "ChatHibana":
        """A deep copy on the same engine (weights, KV pool and step loop are not copied)."""
        return super().__deepcopy__(sharing(memo, self.given_engine, self._engine, self._chat))

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """False, though `dumps` writes this object and `loads` reads it back (`to_json`): what
        LangChain asks of a class that says True is to load under allowed_objects="all", which
        admits the classes of LangChain's own mappings alone (langchain-tests' test_serdes would
        fail for any package outside them; it skips a class that says False)."""
        return False

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """The module `loads` imports the class from (a namespace it takes only where the caller
        lists "hibana_plugins" in valid_namespaces)."""
        return ["hibana_plugins", "langchain"]

    def to_json(self) -> dict[str, Any]:
        """LangChain's serialised form, as `dumps` / `dumpd` write it: the options this object was
        made with, never its engine (which does not serialise, not even a given one), so that
        `loads(text, allowed_objects=[ChatHibana], valid_namespaces=["hibana_plugins"])` makes it
        again; the loaded object finds or loads `Engine.shared(model, **engine_kwargs)` on first
        use, as an unpickled one does. A path in an option is written as its text; another value
        JSON cannot hold (an engine config given whole) gets LangChain's marker from `dumps`,
        which `loads` refuses naming it (LangChain writes this form for its callbacks on every
        call, which must not fail for it)."""
        fields = type(self).model_fields
        kwargs = {name: _paths_as_text(getattr(self, name)) for name in sorted(self.model_fields_set)
                  if name in fields and not fields[name].exclude}
        return {"lc": 1, "type": "constructor", "id": self.lc_id(), "kwargs": kwargs}

    def _get_llm_string(self, stop: list[str] | None = None, **kwargs: Any) -> str:
        """LangChain's cache key, as for a model that does not serialise (LangChain keys one that
        does on its serialised form): from `_identifying_params`, which name the engine passed
        (the serialised form does not: objects on two engines of one model would share replies),
        and the stop strings that apply, the object's or the call's alike."""
        return str(sorted({**self._get_invocation_params(stop=stop, **kwargs), **kwargs}.items()))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its engine, which does not pickle: the copy loads or finds
        `Engine.shared(model, **engine_kwargs)` on first use, also where an engine was passed."""
        state = super().__getstate__()
        private = {**(state["__pydantic_private__"] or {}), "_engine": None, "_chat": None}
        return {**state, "__dict__": {**state["__dict__"], "given_engine": None}, "__pydantic_private__": private}

    def _combine_llm_outputs(self, llm_outputs: list[dict | None]) -> dict:
        """`generate`'s `llm_output` over several prompts: their token usage summed, as ChatOpenAI's."""
        def added(total: dict, more: dict) -> dict:
            for key, value in more.items():
                total[key] = added(dict(total.get(key) or {}), value) if isinstance(value, dict) \
                    else total.get(key, 0) + value
            return total
        usage: dict = {}
        for output in llm_outputs:
            if output and output.get("token_usage"):
                usage = added(usage, output["token_usage"])
        return {"token_usage": usage, "model_name": self.model}

    @property
    def _llm_type(self) -> str:
        return "hibana-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """Every option that changes a reply. LangChain's cache keys on these and on the call's
        options (`_get_invocation_params`): objects that differ in any never share a cached reply."""
        params = {"model": self.model, **{name: getattr(self, name) for name in SAMPLING if name != "stop"},
                  "engine_kwargs": dict(sorted(self.engine_kwargs.items())), "reasoning": self.reasoning,
                  "reasoning_effort": self.reasoning_effort, "reasoning_history": self.reasoning_history,
                  "guided_tool_arguments": self.guided_tool_arguments, "state_id": self.state_id,
                  "tool_parser": self.tool_parser}
        if self.output_version is not None:  # the cache stores a reply converted to it (v1: content blocks)
            params["output_version"] = self.output_version
        if self.given_engine is not None and self.given_engine.serves(self.model, self.engine_kwargs):
            params["engine"] = repr(self.given_engine.engine.config)  # what another engine of `model` may differ in
        return params

    def _get_invocation_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """LangChain's, its "stop" the stop strings that apply: the call's, else the object's."""
        return super()._get_invocation_params(stop=self.stop if stop is None else stop, **kwargs)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """LangSmith's params: the values the call runs with, as `_params` reads them (the peers'
        aliases, `num_predict`, as their own names; None, the object's value)."""
        call = {ALIASES.get(name, name): value for name, value in kwargs.items() if value is not None}
        params = {"ls_provider": PROVIDER, "ls_model_name": call.get("model") or self.model,
                  "ls_model_type": "chat", "ls_temperature": call.get("temperature", self.temperature),
                  "ls_max_tokens": call.get("max_tokens", self.max_tokens)}
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # -- token counting: the model's own tokenizer and chat template ----------------------------------

    def get_token_ids(self, text: str) -> list[int]:
        """The model's token ids of `text` (no special tokens added); `custom_get_token_ids` wins."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Prompt tokens of a call on `messages` with `tools` bound: rendered by the chat template,
        tool schemas, the reasoning options and the generation prompt included (`Chat.count_tokens`)."""
        schemas = [_bound_tool(i, t, None) for i, t in enumerate(tools)] if tools else None  # as bind_tools binds
        messages = convert_to_messages(messages)  # ("user", "hi") tuples and dicts, as invoke takes them
        # (reasoning_effort "none" switches thinking off: Qwen3's template then writes an empty think block)
        return self._chat_layer(self.model).count_tokens(_to_chat_messages(messages), schemas, self.reasoning,
                                                         effort=self.reasoning_effort)

    # -- tools and structured output --------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, strict: bool | None = None,
                   **kwargs: Any):
        """Tools as OpenAI function schemas; tool_choice "auto" (default), "none", "any" /
        "required" (some call), or a tool name (that call). Every call is held to a bound tool
        and its schema by a grammar (module docstring); `strict=True` makes the schemas strict
        as OpenAI does (no extra keys, every key listed as required)."""
        if isinstance(tools, (str, Mapping, type, BaseModel)) or not isinstance(tools, Iterable):
            # one tool: iterated, a @tool's fields or a dict's keys would read as tools
            one = tools.__name__ if isinstance(tools, type) else type(tools).__name__
            raise ToolSchemaError(f"bind_tools takes a list of tools, got one {one}; pass [tool]")
        formatted = [_bound_tool(i, t, strict) for i, t in enumerate(tools)]
        return self.bind(tools=formatted, tool_choice=normalize_tool_choice(tool_choice, formatted), **kwargs)

    def with_structured_output(self, schema: Any = None, *,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               include_raw: bool = False, strict: bool | None = None, **kwargs: Any):
        """A runnable returning `schema` (pydantic class) or a dict (TypedDict, JSON schema).

        "function_calling" forces a call to a tool made from the schema; "json_schema" and
        "json_mode" force the same call and return its arguments as the message's JSON content
        (json_mode without a schema lets the model write any JSON object). The grammar holds
        the answer to the whole schema: lists, nested models, enums, optional fields; `strict`
        as for `bind_tools`. Refusals are HibanaErrors (ConfigError, ToolSchemaError)."""
        if method not in STRUCTURED_METHODS:
            raise ConfigError(f"with_structured_output: method must be one of {', '.join(STRUCTURED_METHODS)}, "
                              f"got {method!r:.80}")
        if kwargs:
            raise ConfigError(f"with_structured_output does not take {', '.join(map(repr, kwargs))}; bind call "
                              "options first (llm.bind(...).with_structured_output is LangChain's own)")
        if schema is None and method != "json_mode":
            raise ConfigError(f"with_structured_output: method={method!r} needs a schema (a pydantic class, a "
                              "TypedDict or a JSON schema); json_mode alone takes none")
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema} if schema is not None else None
        if method == "json_mode" and _untitled_json_schema(schema):
            # json_mode's schema names no function (ChatOpenAI's only parses by it): its answer tool's name
            schema = {"title": _ANY_JSON["function"]["name"], **schema}
        tool = _structured_tool(schema, strict) if schema is not None else _ANY_JSON
        pydantic_schema = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            llm = self.bind(tools=[tool], tool_choice="required", ls_structured_output_format=trace)
            parser = (_WholePydanticTools(tools=[schema], first_tool_only=True) if pydantic_schema else
                      _WholeKeyTools(key_name=tool["function"]["name"], first_tool_only=True))
        else:
            llm = self.bind(answer_tool=tool, ls_structured_output_format=trace)
            parser = _WholePydantic(pydantic_object=schema) if pydantic_schema else _WholeJson()
        if not include_raw:
            return llm | parser
        # the stream yields raw chunks before the parse ends: an error raised at its end would pass
        # parsing_error by (LangChain's fallbacks catch only one raised before the first chunk)
        parser._checks_end = False
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # -- calls: thin drivers over one conversion (`_Call.chunk`, `_Call.chat_result`) -------------------

    def invoke(self, input, config=None, **kwargs):
        with _call_config(config):
            return super().invoke(input, config, **kwargs)

    async def ainvoke(self, input, config=None, **kwargs):
        caller = _CALLER.set(asyncio.current_task())
        try:
            with _call_config(config):
                return await super().ainvoke(input, config, **kwargs)
        finally:
            _CALLER.reset(caller)

    # A stream's thread_id is in the context only while LangChain runs towards its next chunk, never
    # across a yield: the consumer's code between chunks (a graph, another call) must not see it, and
    # a stream left early is closed later from another context, where no reset could undo it.

    def stream(self, input, config=None, **kwargs):
        with contextlib.closing(super().stream(input, config, **kwargs)) as chunks:
            while True:
                with _call_config(config):
                    chunk = next(chunks, None)
                if chunk is None:
                    return
                yield chunk

    async def astream(self, input, config=None, **kwargs):
        # closed, closes the engine's stream and LangChain's astream at once, in that order:
        # LangChain's never closes `_astream`, which the event loop's finalizer would close later
        # (the state leased until then) in a task of its own (`yield from` does this for `stream`)
        opened: list[_Call] = []  # `_astream`'s call, which it leaves here
        chunks = super().astream(input, config, **kwargs)
        try:
            token = _OPENED.set(opened)
            try:  # the first chunk: `_astream` opens the engine's stream meanwhile
                with _call_config(config):
                    chunk = await anext(chunks, None)
            finally:
                _OPENED.reset(token)
            while chunk is not None:
                yield chunk
                with _call_config(config):
                    chunk = await anext(chunks, None)
        finally:
            for call in opened:
                await call.close()
            await chunks.aclose()

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> ChatResult:
        call = self._prepare(messages, stop, run_manager, kwargs)
        *_, result = turn.run(call.open, turn.result_of)
        return call.chat_result(result)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> ChatResult:
        call = await self._prepare(messages, stop, run_manager, kwargs).held()
        return call.chat_result([r async for r in turn.arun(call.open, turn.result_of)][-1])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, run_manager, kwargs)
        with contextlib.closing(turn.run(call.open, call.chunk)) as chunks:
            for chunk in chunks:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        # closing the generator at once cancels the request (left to the collector, it would run on)
        call = await self._prepare(messages, stop, run_manager, kwargs).held()
        call.stream = turn.arun(call.open, call.chunk)
        if _OPENED.get() is not None:  # `astream` closes it when it is closed
            _OPENED.get().append(call)
        async with contextlib.aclosing(call.stream) as chunks:
            async for chunk in chunks:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, run_manager,
                 kwargs: dict[str, Any]) -> _Call:
        """Pick the engine, render, and say which state and which turn (module docstring)."""
        kwargs = _call_options(kwargs)
        model = kwargs.get("model") or self.model
        chat = self._chat_layer(model)
        tools, choice = kwargs.get("tools") or None, kwargs.get("tool_choice", "auto")
        if isinstance(tools, Sequence) and not isinstance(tools, (str, bytes)):
            # tools given per call (invoke(..., tools=[...])) are taken as bind_tools takes them: a
            # @tool, a pydantic model or a function is described as it binds; dicts are as given
            tools = [t if isinstance(t, Mapping) else _bound_tool(i, t, None) for i, t in enumerate(tools)]
        answer_tool = kwargs.get("answer_tool")  # from with_structured_output(method="json_schema"/"json_mode")
        answer_schema = None
        if answer_tool is not None and not chat.renders_tools():
            # a template without tools (Gemma 3's, Phi-3's): the answer itself held to the schema, as
            # response_format holds it, rather than a call the template could not show the model
            answer_schema, answer_tool = answer_tool["function"].get("parameters") or {"type": "object"}, None
        elif answer_tool is not None:
            tools, choice = [answer_tool], answer_tool["function"]["name"]
        tools = normalize_tools(tools)
        choice = normalize_tool_choice(choice, tools)  # refused before a state is leased
        # "none": the tools stay listed in the prompt, as OpenAI keeps them; the chat layer's
        # grammar keeps the model from calling them
        reasoning = kwargs["reasoning"] if "reasoning" in kwargs else self.reasoning
        effort = kwargs["reasoning_effort"] if "reasoning_effort" in kwargs else self.reasoning_effort
        prompt = chat.render_text(_to_chat_messages(messages), tools, reasoning, effort=effort)
        explicit = kwargs["state_id"] if kwargs.get("state_id") is not None else self.state_id  # "" is refused
        options = {"tool_choice": choice, "parse_tools": tools is not None, "guided": self.guided_tool_arguments,
                   "parallel_tool_calls": kwargs.get("parallel_tool_calls") is not False,
                   "timeout": kwargs.get("timeout", self.timeout), "reasoning_history": self.reasoning_history}
        params = self._params(stop, kwargs, chat.engine.max_model_len)
        if answer_schema is not None:
            params = dataclasses.replace(params, json_schema=answer_schema,
                                         strict_schema=kwargs["answer_tool"]["function"].get("strict") is True)
        if kwargs.get("response_format") is not None:
            if answer_tool is not None or answer_schema is not None:
                raise ConfigError("a ChatHibana call: response_format and with_structured_output both hold the "
                                  "answer; use one")
            schema, strict = kwargs["response_format"]  # read by _call_options
            if schema is not None:
                params = dataclasses.replace(params, json_schema=schema, strict_schema=strict)
        return _Call(chat, prompt, tools, params, options,
                     _graph_state_id(run_manager) if explicit is None else explicit, explicit is None, model,
                     answer_tool is not None)

    def _chat_layer(self, model: str) -> Chat:
        """The chat layer of this object's engine (built once per engine), or of another model's."""
        if model != self.model:
            from hibana_core import Engine

            return Chat(Engine.shared(model, **self.engine_kwargs), tool_parser=self.tool_parser)
        engine = self.engine
        if self._chat is None or self._chat.engine is not engine or self._chat.asked_parser != self.tool_parser:
            self._chat = Chat(engine, tool_parser=self.tool_parser)
        return self._chat

    def _params(self, stop: list[str] | None, kwargs: dict[str, Any], context: int) -> SamplingParams:
        """The object's sampling options, overridden by the call's (`stop` as LangChain passes it);
        `context`: the model's, the most tokens a call without max_tokens may generate."""
        values = {name: getattr(self, name) for name in SAMPLING}
        values |= {name: kwargs[name] for name in SAMPLING if kwargs.get(name) is not None}
        if stop is not None:
            values["stop"] = stop
        return sampling_params(values, "ChatHibana call", context)


def _paths_as_text(value: Any) -> Any:
    """An option's value with every path in it as its text (a copy: the option is left as it is)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_paths_as_text(v) for v in value]
    if isinstance(value, dict):
        return {k: _paths_as_text(v) for k, v in value.items()}
    return value


def _call_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's kwargs with the peers' aliases renamed; unknown ones raise a ConfigError.
    `response_format` comes back read (`_response_format`'s (schema, strict)), refused at bind."""
    kwargs = resolve_aliases(kwargs, "ChatHibana call")
    check_known(kwargs, CALL_OPTIONS, "a ChatHibana call")
    parallel = kwargs.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):  # "no" (or 0) allowed several calls: not False
        raise ConfigError(f"a ChatHibana call: parallel_tool_calls must be True or False, got {parallel!r:.40}")
    if kwargs.get("response_format") is not None:
        kwargs = {**kwargs, "response_format": _response_format(kwargs["response_format"])}
    return kwargs
