"""LlamaIndex adapter: `HibanaLLM`, a `FunctionCallingLLM` whose agents keep their KV cache resident.

    from hibana_plugins.llamaindex import HibanaLLM

    llm = HibanaLLM(model="demo")                       # or a Hugging Face checkpoint directory
    agent = FunctionAgent(tools=[...], llm=llm)         # FunctionAgent, ReActAgent, AgentWorkflow

One call, whatever the entry point (chat, complete, streamed, async, with tools):

    ChatMessages --openai_messages--> dicts --Chat.prompt_ids (chat template)--> token ids
    --handle.stream / astream (the state syncs: only the new tail is computed)--> text
    --tool parser--> ChatResponse: TextBlock + ToolCallBlocks, usage in raw / additional_kwargs

Which state serves a call: the `state_id` bound on the object (one HibanaLLM per agent, all on one
Engine, is the documented pattern), else the idle state with the longest common prefix
(`engine.match_state`) when the prompt continues its conversation, else a new state (which still
reuses every KV block it shares with others). Two concurrent calls never share a state.

A required tool call (`tool_required=True`, or `tool_choice` naming a tool) is forced by opening the
assistant turn with the tool-call syntax, cut where the tokenizer splits it in a real call, and
parsing the continuation. Without tools the reply is the model's text as generated: ReAct-style
agents parse it themselves.

Importing llama-index takes about a second and the plugin manager imports this module on every
start, so `HibanaLLM` is defined on first use; without llama-index it raises an error that says
what to install.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Optional, Sequence

from hibana_core.errors import HibanaError
from hibana_plugins.hookspecs import hookimpl

CALL_SYNTAX = {"hermes": '<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>',
               "llama3_json": '{{"name": "{name}", "parameters": {{}}}}'}
"""A complete tool call in each built-in parser's syntax: forced calls open with its start."""
MALFORMED = "malformed_tool_call"
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}

# State ids generating (or about to) per engine: match_state skips the states the scheduler runs,
# not those claimed by a call that has not submitted its request yet.
_BUSY: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()
_BUSY_LOCK = threading.Lock()


@hookimpl
def register_adapters(register) -> None:
    register("llamaindex", make_llm)


def make_llm(engine: Any = None, **options: Any) -> Any:
    """The adapter factory: `HibanaLLM(engine=engine, **options)`."""
    return llm_class()(engine=engine, **options)


def __getattr__(name: str) -> Any:
    if name == "HibanaLLM":  # `from hibana_plugins.llamaindex import HibanaLLM`
        return llm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- the engine side: which state, what prompt, what the model wrote --------------------------------

@dataclass(frozen=True)
class _Request:
    messages: list[dict] | None      # OpenAI-style; None: `raw_prompt` is continued as it is
    raw_prompt: str | None
    tools: list[dict] | None
    forced: str | None               # None: free; "": some tool call; a name: that tool's call
    parse: bool                      # read tool calls (else the reply is the text as generated)
    state_id: str | None             # the state bound on the LLM
    sampling: dict                   # SamplingParams fields


class _Runner:
    """Serves one HibanaLLM's calls on its engine: picks and holds a state, renders the prompt,
    streams the generation through a `_Turn`."""

    def __init__(self, engine: Any, tool_parser: str | None) -> None:
        self.engine = engine
        self.tool_parser = tool_parser
        self.chats: dict[str, Any] = {}     # Chat per state id (building one reads the vocabulary)

    def generate(self, request: _Request) -> Iterator[tuple["_Turn", str]]:
        """(turn so far, text delta) whenever the text or the tool calls grew; the last is final."""
        with self._claim(request) as chat:
            prompt, turn = self._begin(chat, request)
            events = chat.handle.stream(self._params(chat, request), prompt=prompt)
            with contextlib.closing(events):  # closing early cancels the request
                for event in events:
                    delta = turn.feed(event)
                    if delta is not None:
                        yield turn, delta

    async def agenerate(self, request: _Request) -> AsyncIterator[tuple["_Turn", str]]:
        """`generate` on the caller's event loop."""
        with self._claim(request) as chat:
            prompt, turn = self._begin(chat, request)
            events = chat.handle.astream(self._params(chat, request), prompt=prompt)
            try:
                async for event in events:
                    delta = turn.feed(event)
                    if delta is not None:
                        yield turn, delta
            finally:
                await events.aclose()  # closing early cancels the request

    def _params(self, chat: Any, request: _Request) -> Any:
        from hibana_core import SamplingParams

        return SamplingParams(stop_token_ids=chat.stop_token_ids, **request.sampling)

    def _begin(self, chat: Any, request: _Request) -> tuple[list[int], "_Turn"]:
        """The prompt's token ids, and the turn that reads what the model generates after them."""
        tokenizer = self.engine.tokenizer
        if request.messages is None:
            return list(tokenizer.encode(request.raw_prompt, add_special_tokens=False)), _Turn(chat, None, "")
        prompt = chat.prompt_ids(request.messages, request.tools)
        prefill = ""
        syntax = CALL_SYNTAX.get(self._parser_name(chat))
        if request.forced is not None and syntax is not None:  # other syntaxes: the call is asked, not forced
            example = syntax.format(name=request.forced or request.tools[0]["function"]["name"])
            # a named tool: up to its arguments' key; any tool: up to where the name starts
            end = example.index(": {}") + 1 if request.forced else example.index('"name": "') + len('"name": "')
            ids = token_prefix(tokenizer, example[:end], example)
            prompt += ids
            prefill = tokenizer.decode(ids, skip_special_tokens=False)
        return prompt, _Turn(chat, chat.parser if request.parse else None, prefill)

    @staticmethod
    def _parser_name(chat: Any) -> str | None:
        from hibana_plugins.manager import get_plugin_manager

        return next((n for n, p in get_plugin_manager().tool_parsers().items() if p is chat.parser), None)

    @contextlib.contextmanager
    def _claim(self, request: _Request) -> Iterator[Any]:
        """The Chat of the state serving this call, held for the call."""
        with _BUSY_LOCK:
            busy = _BUSY.setdefault(self.engine, set())
            state_id = self._pick_state(request, busy)
            busy.add(state_id)
            chat = self._chat(state_id)
        try:
            yield chat
        finally:
            with _BUSY_LOCK:
                busy.discard(state_id)

    def _pick_state(self, request: _Request, busy: set[str]) -> str:
        if request.state_id is not None and request.state_id not in busy:
            return request.state_id
        new_id = f"llamaindex-{uuid.uuid4().hex[:12]}"
        chat = self._chat(new_id)
        text = request.raw_prompt if request.messages is None else chat.render_text(request.messages, request.tools)
        match = self.engine.match_state(self.engine.tokenizer.encode(text, add_special_tokens=False))
        if match is None or match.id in busy or not self._continues(match, text, chat.stop_token_ids):
            return new_id  # still served from any prefix blocks it shares; other states stay intact
        chat.handle.close()  # it was only opened to render
        del self.chats[new_id]
        return match.id

    def _continues(self, handle: Any, text: str, stop_token_ids: Sequence[int]) -> bool:
        """Whether the prompt continues the state's conversation (up to its last finished turn).
        Taking over a state that merely shares a prefix would throw away another agent's history."""
        held = handle.tokens
        ends = [i + 1 for i, token in enumerate(held) if token in stop_token_ids] or [len(held)]
        return text.startswith(self.engine.tokenizer.decode(held[:ends[-1]], skip_special_tokens=False))

    def _chat(self, state_id: str) -> Any:
        chat = self.chats.get(state_id)
        if chat is None or chat.handle.closed:
            from hibana_core.chat import Chat

            for closed in [k for k, c in self.chats.items() if c.handle.closed]:
                del self.chats[closed]
            chat = self.chats[state_id] = Chat(self.engine, state_id, self.tool_parser)
        return chat


class _Turn:
    """One assistant turn as it is generated: the text and tool calls so far, then the result."""

    def __init__(self, chat: Any, parser: Any, prefill: str) -> None:
        self.state_id = chat.handle.id
        self.stream = parser.stream() if parser is not None else None
        self.prefill = prefill
        self.content = ""
        self.calls: dict[int, dict] = {}        # streamed calls by index: id, name, arguments text
        self.final: list[Any] | None = None     # the parsed ToolCalls, once the turn is over
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.error: str | None = None
        if prefill:
            self._take(self.stream.feed(prefill) if self.stream else [prefill])

    def feed(self, event: Any) -> str | None:
        """The text delta of one engine event, or None when it changed nothing visible."""
        before = self._size()
        if self.stream is None:
            pieces = [event.text] if event.text else []
        else:
            pieces = self.stream.feed(event.text) if event.text else []
            if event.completion is not None:
                pieces += self.stream.close()
        delta = self._take(pieces)
        if event.completion is not None:
            self._finish(event.completion)
            return delta
        return delta if self._size() != before else None

    def _size(self) -> tuple[int, int, int]:
        return len(self.content), len(self.calls), sum(len(c["arguments"]) for c in self.calls.values())

    def _take(self, pieces: list) -> str:
        delta = ""
        for piece in pieces:
            if isinstance(piece, str):
                delta += piece
            elif piece.id is not None:
                self.calls[piece.index] = {"id": piece.id, "name": piece.name, "arguments": piece.arguments_fragment}
            else:
                self.calls[piece.index]["arguments"] += piece.arguments_fragment
        self.content += delta
        return delta

    def _finish(self, completion: Any) -> None:
        from hibana_core.chat import Usage

        stats = completion.stats
        self.usage = Usage(stats.prompt_tokens, stats.reused, len(completion.token_ids))
        self.finish_reason = completion.finish_reason
        if self.stream is None:
            self.content = self.prefill + completion.text
            return
        parsed = self.stream.finish()
        if parsed.error:  # the model's text stands as the reply, and raw says what went wrong
            self.content, self.final, self.error = self.prefill + completion.text, [], parsed.error
            if self.finish_reason == "stop":
                self.finish_reason = MALFORMED
            return
        self.content, self.final = parsed.content, parsed.tool_calls
        if parsed.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"

    def tool_calls(self) -> list[dict]:
        """Every call so far, OpenAI-style; arguments are partial JSON text while streaming."""
        if self.final is not None:
            return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in self.final]
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())]

    def usage_dict(self) -> dict:
        if self.usage is None:
            return {}
        u = self.usage
        return {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens}

    def raw(self, model: str) -> dict:
        raw: dict[str, Any] = {"model": model, "state_id": self.state_id}
        if self.usage is not None:
            raw |= {"finish_reason": self.finish_reason, "usage": self.usage_dict()}
        if self.error:
            raw["error"] = self.error
        return raw


# --- the LlamaIndex side ------------------------------------------------------------------------------

@functools.cache
def llm_class() -> type:
    """HibanaLLM, defined on first use (see the module docstring)."""
    try:
        from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, CompletionResponse,
                                                      LLMMetadata, MessageRole, TextBlock, ToolCallBlock)
        from llama_index.core.bridge.pydantic import Field, PrivateAttr
        from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
        from llama_index.core.llms.function_calling import FunctionCallingLLM
        from llama_index.core.llms.llm import ToolSelection
        from llama_index.core.llms.utils import parse_partial_json
    except ImportError as exc:
        raise HibanaError(f"HibanaLLM needs llama-index-core 0.14 or later ({exc}); install it with "
                          "`pip install 'hibana[llamaindex]'`") from exc

    class HibanaLLM(FunctionCallingLLM):
        """A LlamaIndex LLM on a Hibana engine. `HibanaLLM(model="demo")` shares one engine per
        model and options in the process (`Engine.shared`); `HibanaLLM(engine=engine,
        state_id="agent-1")` binds an agent to its own resident state."""

        model: str = Field(default="demo", description="Checkpoint directory, or \"demo\".")
        engine_kwargs: dict = Field(default_factory=dict, description="Engine options for Engine.shared.")
        state_id: Optional[str] = Field(default=None, description="The state serving every call; None: the "
                                        "state whose conversation the prompt continues, else a new one.")
        temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy.")
        max_tokens: int = Field(default=256, gt=0, description="Most tokens per reply.")
        top_p: float = Field(default=1.0, gt=0.0, le=1.0)
        top_k: int = Field(default=0, ge=0, description="0 keeps every token.")
        seed: Optional[int] = Field(default=None, description="Per-request sampling seed.")
        tool_parser: Optional[str] = Field(default=None, description="A registered tool parser; None: the "
                                           "model's chat format's, else hermes.")
        clean_tool_schemas: bool = Field(default=True, description="Drop the `title` pydantic puts on "
                                         "every argument schema: noise no chat template was trained with.")

        _runner: _Runner = PrivateAttr()

        def __init__(self, model: str = "demo", engine: Any = None, **kwargs: Any) -> None:
            if engine is None:
                from hibana_core import Engine

                engine = Engine.shared(model, **kwargs.get("engine_kwargs", {}))
            else:
                model = str(engine.config.model)
            super().__init__(model=model, **kwargs)
            self._runner = _Runner(engine, self.tool_parser)

        @classmethod
        def class_name(cls) -> str:
            return "HibanaLLM"

        @property
        def engine(self) -> Any:
            return self._runner.engine

        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(context_window=self.engine.max_model_len, num_output=self.max_tokens,
                               is_chat_model=True, is_function_calling_model=True, model_name=self.model)

        # --- entry points -----------------------------------------------------------------------

        @llm_chat_callback()
        def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
            *_, last = self._runner.generate(self._chat_request(messages, kwargs))
            return self._chat_response(*last)

        @llm_chat_callback()
        def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Iterator[ChatResponse]:
            request = self._chat_request(messages, kwargs)
            return (self._chat_response(turn, delta) for turn, delta in self._runner.generate(request))

        @llm_chat_callback()
        async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
            async for last in self._runner.agenerate(self._chat_request(messages, kwargs)):
                pass
            return self._chat_response(*last)

        @llm_chat_callback()
        async def astream_chat(self, messages: Sequence[ChatMessage],
                               **kwargs: Any) -> AsyncIterator[ChatResponse]:
            request = self._chat_request(messages, kwargs)

            async def chunks() -> AsyncIterator[ChatResponse]:
                async for turn, delta in self._runner.agenerate(request):
                    yield self._chat_response(turn, delta)
            return chunks()

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            *_, last = self._runner.generate(self._completion_request(prompt, formatted))
            return self._completion_response(*last)

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False,
                            **kwargs: Any) -> Iterator[CompletionResponse]:
            request = self._completion_request(prompt, formatted)
            return (self._completion_response(turn, delta) for turn, delta in self._runner.generate(request))

        @llm_completion_callback()
        async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            async for last in self._runner.agenerate(self._completion_request(prompt, formatted)):
                pass
            return self._completion_response(*last)

        @llm_completion_callback()
        async def astream_complete(self, prompt: str, formatted: bool = False,
                                   **kwargs: Any) -> AsyncIterator[CompletionResponse]:
            request = self._completion_request(prompt, formatted)

            async def chunks() -> AsyncIterator[CompletionResponse]:
                async for turn, delta in self._runner.agenerate(request):
                    yield self._completion_response(turn, delta)
            return chunks()

        # --- tool calling -----------------------------------------------------------------------

        def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                     chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                     allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                     tool_choice: str | dict | None = None, **kwargs: Any) -> dict[str, Any]:
            messages = list(chat_history or [])
            if user_msg is not None:
                messages.append(ChatMessage(role=MessageRole.USER, content=user_msg)
                                if isinstance(user_msg, str) else user_msg)
            specs = [self._tool_spec(tool) for tool in tools]
            return {"messages": messages, "tools": specs, "tool_required": tool_required,
                    "tool_choice": tool_choice, **kwargs}

        def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[Any],
                                               allow_parallel_tool_calls: bool = False,
                                               **kwargs: Any) -> ChatResponse:
            if not allow_parallel_tool_calls:  # keep the first call, as a single-call API would
                message = response.message
                extra = [b for b in message.blocks if isinstance(b, ToolCallBlock)][1:]
                message.blocks = [b for b in message.blocks if b not in extra]
                if extra:
                    message.additional_kwargs["tool_calls"] = message.additional_kwargs["tool_calls"][:1]
            return response

        def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                         **kwargs: Any) -> list[ToolSelection]:
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            if not calls and error_on_no_tool_call:
                raise ValueError(f"expected at least one tool call, got none: {response.message.content!r}")
            selections = []
            for call in calls:
                arguments = call.tool_kwargs
                if isinstance(arguments, str):  # a call still streaming: partial JSON
                    try:
                        arguments = parse_partial_json(arguments) if arguments.strip() else {}
                    except (ValueError, TypeError):
                        arguments = {}
                selections.append(ToolSelection(tool_id=call.tool_call_id or "", tool_name=call.tool_name,
                                                tool_kwargs=arguments))
            return selections

        def _tool_spec(self, tool: Any) -> dict:
            spec = tool.metadata.to_openai_tool(skip_length_check=True)
            if self.clean_tool_schemas:
                spec["function"]["parameters"] = clean_schema(spec["function"].get("parameters") or {})
            return spec

        # --- requests and responses -------------------------------------------------------------

        def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict) -> _Request:
            tools = kwargs.get("tools") or None
            choice = kwargs.get("tool_choice")
            name = choice.get("function", choice).get("name") if isinstance(choice, dict) else choice
            if name == "none":
                tools = None
            forced = None
            if tools and name not in (None, "auto", "none"):
                forced = "" if name in ("required", "any") else name
            elif tools and kwargs.get("tool_required"):
                forced = ""
            return _Request(openai_messages(messages), None, tools, forced, tools is not None,
                            self.state_id, self._sampling())

        def _completion_request(self, prompt: str, formatted: bool) -> _Request:
            if formatted:  # the caller applied the chat template: continue the text as it is
                return _Request(None, prompt, None, None, False, self.state_id, self._sampling())
            return _Request([{"role": "user", "content": prompt}], None, None, None, False, self.state_id,
                            self._sampling())

        def _sampling(self) -> dict:
            return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "seed": self.seed}

        def _chat_response(self, turn: _Turn, delta: str) -> ChatResponse:
            calls = turn.tool_calls()
            blocks: list[Any] = [TextBlock(text=turn.content)]
            blocks += [ToolCallBlock(tool_call_id=c["id"], tool_name=c["function"]["name"],
                                     tool_kwargs=c["function"]["arguments"]) for c in calls]
            # the calls also in OpenAI form: structured streaming and older code read them there
            extra = {"tool_calls": [_openai_call(c) for c in calls]} if calls else {}
            message = ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)
            return ChatResponse(message=message, delta=delta, raw=turn.raw(self.model),
                                additional_kwargs=turn.usage_dict())

        def _completion_response(self, turn: _Turn, delta: str) -> CompletionResponse:
            return CompletionResponse(text=turn.content, delta=delta, raw=turn.raw(self.model),
                                      additional_kwargs=turn.usage_dict())

    HibanaLLM.__qualname__ = "HibanaLLM"  # pickles and prints as hibana_plugins.llamaindex.HibanaLLM
    return HibanaLLM


# --- conversions ------------------------------------------------------------------------------------

def openai_messages(messages: Sequence[Any]) -> list[dict]:
    """LlamaIndex ChatMessages as the OpenAI-style dicts `hibana_core.chat` renders. Tool calls come
    from ToolCallBlocks, else from `additional_kwargs["tool_calls"]` (older integrations)."""
    from llama_index.core.base.llms.types import TextBlock, ToolCallBlock

    out = []
    for message in messages:
        role = getattr(message.role, "value", message.role)
        role = _ROLES.get(role, role)
        text = "".join(b.text for b in message.blocks if isinstance(b, TextBlock))
        item: dict[str, Any] = {"role": role, "content": text}
        blocks = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
        if blocks:
            item["tool_calls"] = [{"id": b.tool_call_id, "type": "function",
                                   "function": {"name": b.tool_name, "arguments": b.tool_kwargs}} for b in blocks]
        elif message.additional_kwargs.get("tool_calls"):
            item["tool_calls"] = [_call_dict(c) for c in message.additional_kwargs["tool_calls"]]
        if role == "tool":
            item["tool_call_id"] = message.additional_kwargs.get("tool_call_id")
            if message.additional_kwargs.get("name"):
                item["name"] = message.additional_kwargs["name"]
        out.append(item)
    return out


def _call_dict(call: Any) -> dict:
    if not isinstance(call, dict):  # an OpenAI SDK object
        call = call.model_dump() if hasattr(call, "model_dump") else vars(call)
    return call


def _openai_call(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": text}}


def clean_schema(schema: dict) -> dict:
    """A JSON schema without pydantic's `title`s, `type` and `properties` first (as OpenAI-style tool
    schemas are written); property names are kept, a property called "title" included."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: clean_schema(s) for name, s in out[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = clean_schema(out[key])
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [clean_schema(s) for s in out[key]]
    first = {k: out.pop(k) for k in ("type", "properties") if k in out}
    return first | out


def token_prefix(tokenizer: Any, text: str, example: str) -> list[int]:
    """Token ids of the longest start of `text` that ends where the tokenizer splits `example`, a
    typical full text beginning with it: a prefill tokenized as the model saw such text in training."""
    ids = list(tokenizer.encode(example, add_special_tokens=False))
    for n in range(len(ids), 0, -1):
        if text.startswith(tokenizer.decode(ids[:n], skip_special_tokens=False)):
            return ids[:n]
    return []
