"""LlamaIndex adapter: `HibanaLLM`, a `FunctionCallingLLM` whose agents keep their KV cache resident.

    from hibana_plugins.llamaindex import HibanaLLM

    llm = HibanaLLM(model="demo")                       # or "Qwen/Qwen3-8B", or a checkpoint directory
    agent = FunctionAgent(tools=[...], llm=llm)         # FunctionAgent, ReActAgent, AgentWorkflow

One call, whatever the entry point (chat, complete, streamed, async, with tools):

    ChatMessages --openai_messages--> dicts --Chat.render_text (chat template)--> prompt
    --Chat.lease: the state that serves the call--> one assistant turn (only the new tail is
    computed) --> ChatDeltas --_Call.convert--> ChatResponse: TextBlock + ToolCallBlocks, usage in raw

Every entry point, sync or async, drives `turn.run` or `turn.arun` (the only loops) over
`_Call.open` and `_Call.convert`, so the conversion to LlamaIndex's types is written once. An async
call first waits for a stream its own task left to let go of the state it names
(`options.lease_holder`), and closing an async stream closes the engine's stream within at once.

Which state serves a call (`Chat.lease`): the `state_id` bound on the object (one HibanaLLM per
agent, all on one Engine, is the documented pattern; "<state_id>/structured" for a structured
program's call, whose prompt is its own) unless another call holds it; else a state
made for an earlier call that named none, when the prompt continues its conversation; else a new
state (which still reuses every KV block it shares with others). Two concurrent calls never share
a state.

Tool calls are valid by construction: a grammar holds each call to an offered tool and its
argument schema (`hibana_core.turn`). A required tool call (`tool_required=True`, or `tool_choice`
naming a tool; `structured_predict` and `as_structured_llm` call the output class as a tool this
way) holds the turn to calls from its first token; otherwise the grammar opens when the model opens
a call. Without tools the reply is the model's text as generated: ReAct-style agents parse it
themselves.

Importing llama-index takes about a second and the plugin manager imports this module on every
start, so `HibanaLLM` is defined on first use; without llama-index it raises a
MissingDependencyError (an ImportError, as `ChatHibana`'s) that says what to install.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Literal, Mapping, Optional, Sequence, Union

from hibana_core import turn
from hibana_core.chat import (Chat, ChatDelta, ChatResult, ConversationError, ToolChoiceError, ToolSchemaError,
                              UnsupportedContentError, clean_tool, normalize_tool_choice, normalize_tools)
from hibana_core.config import SamplingParams
from hibana_core.errors import ConfigError, ContextLengthError, GrammarError, MissingDependencyError
from hibana_plugins.hookspecs import hookimpl
from hibana_plugins.options import (SAMPLING, EngineChoice, LeaseHolder, check_engine, check_engine_kwargs,
                                    check_given_engine, check_known, check_state_id, check_switches, choose_engine,
                                    lease_holder, resolve_aliases, sampling_params, sharing, unset_nones)

COMPLETE_OPTIONS = frozenset({*SAMPLING, "reasoning", "reasoning_effort", "timeout", "json_schema"})
"""What `complete(..., **kwargs)` may set."""
CHAT_OPTIONS = COMPLETE_OPTIONS | {"tools", "tool_required", "tool_choice", "parallel_tool_calls", "structured_answer",
                                   "output_cls"}
"""What `chat(..., **kwargs)` (and `chat_with_tools` through it) may set. `structured_answer=True`
(the structured-output methods pass it): the answer's tool is called whatever the tool choice, and
a reply that max_tokens cuts before its answer is whole raises ValueError at its end, streamed or
not, rather than end as a reply without the answer (LlamaIndex's streaming programs offer the tool
as "auto" and turn a reply without a call into an object of empty fields). `output_cls` (they pass
it, `_check_structured`): the answer is read into the class at its end, streamed or not, and one
that does not read raises ValueError naming the fields (ToolSchemaError where the grammar could
hold the class's schema only in part, naming what it could not hold): LlamaIndex's streamed
programs ended on an unchecked partial object, which the class's own validators had refused."""
PROMPT_FORMATTERS = ("messages_to_prompt", "completion_to_prompt", "query_wrapper_prompt")
"""LlamaIndex's own prompt formatting options, which a chat-template model does not use (LlamaIndex's
LLM base accepts them all, and applies none of them to a chat model's calls: set, they were silently
ignored)."""
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}


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


# --- the engine side: one call on its state, as a reply that grows --------------------------------

class _Call:
    """One call: the turn to run, then the reply as it is generated (text and tool calls so far,
    then the result). `convert` makes the one conversion the sync and async entry points share."""

    def __init__(self, chat: Chat, prompt: str, tools: list[dict] | None, params: SamplingParams,
                 options: dict[str, Any], state_id: str | None, structured: bool = False,
                 output_cls: Any = None) -> None:
        self.chat, self.prompt, self.tools, self.params = chat, prompt, tools, params
        self.options = options                  # Chat.opener's: tool_choice, parallel_tool_calls, ...
        self.state_id = state_id                # the state bound on the LLM, then the one serving
        self.content = ""
        self.reasoning = ""                     # a reasoning model's thinking so far
        self.thinking_delta = ""                # the thinking the last delta added
        self.calls: dict[int, dict] = {}        # streamed calls by index: id, name, arguments text
        self.result: ChatResult | None = None
        self.holder: LeaseHolder | None = None  # an async call's (`lease_holder`)
        self.stream: AsyncIterator | None = None  # an async call's engine stream
        self.structured = structured            # a structured answer: cut, it raises (CHAT_OPTIONS)
        self.output_cls = output_cls            # a structured answer's class: read into it at its end

    def open(self, stack: contextlib.ExitStack) -> tuple[turn.TurnRun, Any]:
        """Starts the turn on the state `Chat.lease` picks (`turn.Open`)."""
        open_turn = self.chat.opener(self.prompt, self.tools, self.params, lease=True, state_id=self.state_id,
                                     fallback=True, **self.options)
        try:
            run, handle = open_turn(stack) if self.holder is None else self.holder.open(open_turn, stack)
        except ContextLengthError as exc:
            raise ContextLengthError(f"{exc}{_packing_hint(self.chat.engine)}") from exc
        self.state_id = handle.id
        return run, handle

    def run(self, respond: Callable[["_Call", str], Any]) -> Iterator[Any]:
        """`turn.run` over the call: `respond(self, text delta)` whenever the reply grew visibly."""
        return turn.run(self.open, self.convert(respond))

    async def arun(self, respond: Callable[["_Call", str], Any]) -> AsyncIterator[Any]:
        """`run` for the event loop (`turn.arun`), once a stream its caller left is done with the
        state the call names."""
        self.holder = await lease_holder(self.chat.engine, self.state_id)
        self.stream = turn.arun(self.open, self.convert(respond))
        return self.stream

    async def close(self) -> None:
        """Close the engine's stream (its state let go) when the stream handed out is closed,
        before its end or after it."""
        self.holder.left = True  # a call on the state meanwhile waits for it
        await self.stream.aclose()

    def convert(self, respond: Callable[["_Call", str], Any]) -> Callable[[ChatDelta], Any]:
        """A `turn.run` converter: `respond(self, text delta)` whenever the reply grew visibly."""
        def convert(delta: ChatDelta) -> Any:
            text = self.take(delta)
            return None if text is None else respond(self, text)
        return convert

    def take(self, delta: ChatDelta) -> str | None:
        """The text delta of a chat delta ("" at the end, or when the calls grew), or None when
        it changed nothing visible."""
        call, self.thinking_delta = delta.tool_call, delta.reasoning
        if delta.result is not None:  # a call the reply ended inside is no part of its text (the server's rule)
            self.result, self.reasoning = delta.result, delta.result.reasoning
            self.content = delta.result.content
            return ""
        if delta.reasoning:
            self.reasoning += delta.reasoning
            return ""
        if call is None and delta.cut_call:
            return None
        if call is None:
            self.content += delta.text
            return delta.text or None
        if call.id is not None:
            self.calls[call.index] = {"id": call.id, "name": call.name, "arguments": call.arguments_fragment}
            return ""
        self.calls[call.index]["arguments"] += call.arguments_fragment
        return "" if call.arguments_fragment else None

    def tool_calls(self) -> list[dict]:
        """Every call so far, OpenAI-style; arguments are JSON text while streaming."""
        if self.result is not None:
            return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in self.result.tool_calls]
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())]

    def usage_dict(self) -> dict:
        if self.result is None:
            return {}
        u = self.result.usage
        return {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                "completion_tokens": u.completion_tokens, "reasoning_tokens": u.reasoning_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def raw(self, model: str) -> dict:
        raw: dict[str, Any] = {"model": model, "state_id": self.state_id}
        if self.result is not None:
            raw |= {"finish_reason": turn.openai_finish_reason(self.result), "usage": self.usage_dict()}
            if self.result.error:
                raw["error"] = self.result.error
            if self.chat.ended_at_context(self.result):
                raw["context_full"] = True  # the model's context ended the reply, not max_tokens
        return raw


async def _closing_both(outer: AsyncIterator, call: _Call) -> AsyncIterator:
    """`outer`'s items, `outer` reading `call`'s stream; closed, closes the call's stream and
    then `outer`."""
    try:
        async for item in outer:
            yield item
    finally:
        await call.close()
        await outer.aclose()


def _packing_hint(engine: Any) -> str:
    """What to do about a prompt past the context that LlamaIndex may have packed (a query
    engine's response synthesis, chat memory): it counts with `Settings.tokenizer`, tiktoken's
    unless set, which can count far fewer tokens than the model's; "" where it is the model's."""
    import llama_index.core

    counter = llama_index.core.global_tokenizer
    counter = getattr(counter, "func", counter)  # Settings.tokenizer = a HF tokenizer: a partial of its encode
    if getattr(counter, "__self__", None) is engine.tokenizer:
        return ""
    return ("; where LlamaIndex packed the prompt (a query engine, chat memory), it counted its tokens with "
            "Settings.tokenizer (tiktoken's unless set), not the model's: set Settings.tokenizer = "
            "llm.engine.tokenizer")


def _no_call_message(response: Any) -> str:
    """Why a response holds no tool call: the reply's text, and the engine's finish reason and
    parse error from `raw` (a call that max_tokens cut parses as none)."""
    raw = response.raw if isinstance(response.raw, dict) else {}
    reason, error = raw.get("finish_reason"), raw.get("error")
    why = f"finish_reason {reason!r}" + (f", {error}" if error else "")
    hint = ("" if reason != "length" or not error else "; the reply ended inside a call at the model's context: "
            "shorten the history" if raw.get("context_full") else "; the reply ended inside a call: raise max_tokens")
    return f"expected at least one tool call, got none ({why}){hint}: {response.message.content!r:.200}"


CALL_SWITCHES = ("tool_required", "parallel_tool_calls", "allow_parallel_tool_calls", "structured_answer")
"""Per-call options that are True or False (None: the default)."""


def _check_switches(options: dict[str, Any], where: str) -> None:
    """A ConfigError for a per-call switch that is not True, False or None: 'no' is a true string,
    and tool_required='no' forced a call (as the constructor's switches, `options.check_switches`)."""
    for name in CALL_SWITCHES:
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise ConfigError(f"{where}: {name} must be True or False, got {options[name]!r:.40}")


@functools.lru_cache(maxsize=256)
def _unheld(parameters: str) -> tuple[tuple[str, ...], str | None]:
    """What of a schema (its JSON text) the grammar holds the output to only in part (its keywords
    `grammar.unenforced_keywords` names: the grammar holds the nearest schema it can, as
    `SamplingParams.strict_schema=False` does), and why it does not compile at all (None where it
    does); once per schema."""
    from hibana_core.grammar import json_schema_grammar, unenforced_keywords

    schema = json.loads(parameters)
    try:
        json_schema_grammar(schema)
    except GrammarError as exc:
        return (), str(exc)
    return tuple(unenforced_keywords(schema)), None


def _last_answer(output_cls: Any, answers: list) -> Any:
    """A streamed structured program's answer: its last object (`_ending_on_the_class`)."""
    if not answers:
        raise ValueError(f"the structured answer into {getattr(output_cls, '__name__', output_cls)} came back empty")
    return answers[-1]


def _as_the_class(output_cls: Any, last: Any) -> Any:
    """The class's own object of a streamed program's last one, where that is a partial object
    (LlamaIndex's streamed programs read the answer in python mode, which a strict class refuses
    for a date or an enum written as JSON); None where it is the class's already, or a list."""
    if last is None or isinstance(last, (output_cls, list)) or not hasattr(last, "model_dump_json"):
        return None
    return output_cls.model_validate_json(last.model_dump_json())  # (JSON mode: the answer was JSON)


def _ending_on_the_class(output_cls: Any, answers: Iterator) -> Iterator:
    """A streamed program's objects, then the class's own object of the last one where that was
    a partial object (`_as_the_class`): the stream ends on the class's object."""
    last = None
    try:
        for last in answers:
            yield last
    finally:
        getattr(answers, "close", lambda: None)()
    whole = _as_the_class(output_cls, last)
    if whole is not None:
        yield whole


async def _aending_on_the_class(output_cls: Any, answers: AsyncIterator) -> AsyncIterator:
    """`_ending_on_the_class` for an async stream."""
    last = None
    try:
        async for last in answers:
            yield last
    finally:
        await answers.aclose()
    whole = _as_the_class(output_cls, last)
    if whole is not None:
        yield whole


def _breaks_schema(output_cls: Any, problems: Sequence[str], exc: Exception, answer: str) -> ValueError:
    """The error of a structured answer that does not read into its class: which fields it breaks,
    and what the grammar could not hold (a ToolSchemaError), or that the class's own validators
    refused it (a ValueError, as LlamaIndex's programs raise: the grammar held its whole schema)."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    broken = "; ".join(f"{'.'.join(str(part) for part in e.get('loc', ())) or 'the answer'}: {e.get('msg')}"
                       for e in errors) or str(exc)
    message = f"the structured answer does not read into {getattr(output_cls, '__name__', output_cls)} ({broken}): " \
              f"{answer!r:.200}"
    if not problems:
        return ValueError(f"{message}; its JSON schema held, the class's own validation refused it: ask again (a "
                          "sampled answer may differ), or say in the prompt what the class requires")
    return ToolSchemaError(f"{message}. The grammar held it to the nearest schema it can hold, not to "
                           f"{'; '.join(problems)}; relax those fields (or bound them as said), or ask again (a "
                           "sampled answer may differ)")


# --- the LlamaIndex side ------------------------------------------------------------------------------

@functools.cache
def llm_class() -> type:
    """HibanaLLM, defined on first use (see the module docstring)."""
    try:
        from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, CompletionResponse,
                                                      LLMMetadata, LogProb, MessageRole, TextBlock, ThinkingBlock,
                                                      ToolCallBlock)
        from llama_index.core.bridge.pydantic import Field, PrivateAttr
        from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
        from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
        from llama_index.core.llms.function_calling import FunctionCallingLLM
        from llama_index.core.llms.llm import (ToolSelection, default_completion_to_prompt,
                                               generic_messages_to_prompt)
        from llama_index.core.llms.utils import parse_partial_json
        from llama_index.core.types import PydanticProgramMode
    except ImportError as exc:
        raise MissingDependencyError(f"HibanaLLM needs llama-index-core 0.14 or later ({exc}); install it with "
                                     "`pip install 'hibana[llamaindex]'`") from exc

    # LlamaIndex's defaults, which its unpickling passes back to __init__: not the user's
    defaults = dict(zip(PROMPT_FORMATTERS, (generic_messages_to_prompt, default_completion_to_prompt, None)))

    def refuse_formatter(name: str, value: Any) -> None:
        """A ConfigError for a prompt formatter of one's own (`PROMPT_FORMATTERS`): the chat
        template renders every prompt, so it would go unused."""
        if value is not None and value is not defaults[name]:
            raise ConfigError(f"HibanaLLM does not use {name}: it renders every prompt with the model's chat "
                              "template (tools included); drop it, or pass your own formatted text to "
                              "complete(prompt, formatted=True)")

    class HibanaLLM(FunctionCallingLLM):
        """A LlamaIndex LLM on a Hibana engine. `HibanaLLM(model="demo")` shares one engine per
        model and options in the process (`Engine.shared`); `HibanaLLM(engine=engine,
        state_id="agent-1")` binds an agent to its own resident state.

        Copies: a copy runs on the engine of its own `model` and `engine_kwargs`; one made with
        another (`model_copy(update={"model": ...})`) runs on `Engine.shared(model,
        **engine_kwargs)`, whether or not the original was given `engine=`: a given engine serves
        only the `model` and `engine_kwargs` it was given with. `copy.deepcopy` shares the engine.
        A pickle carries no engine (it does not pickle), not even a given one: unpickling
        (LlamaIndex's, which runs `__init__` again) loads or finds `Engine.shared(model,
        **engine_kwargs)`."""

        model: str = Field(default="demo", description="A Hugging Face repo id (\"Qwen/Qwen3-8B\", "
                           "\"org/name@revision\"), a checkpoint directory, or \"demo\".")
        engine_kwargs: dict = Field(default_factory=dict, description="Engine options for Engine.shared.")
        state_id: Optional[str] = Field(default=None, description="The state serving every call (another "
                                        "while it is busy; a structured call's: \"<state_id>/structured\"); "
                                        "None: the one `Chat.lease` picks.")
        temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy.")
        max_tokens: Optional[int] = Field(default=256, gt=0, description="Most tokens per reply; None: no limit "
                                          "but the model's context.")
        top_p: float = Field(default=1.0, gt=0.0, le=1.0)
        top_k: int = Field(default=0, ge=0, description="0 keeps every token.")
        min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p "
                             "times the most likely one.")
        seed: Optional[int] = Field(default=None, description="Per-request sampling seed.")
        repetition_penalty: float = Field(default=1.0, gt=0.0, description="HF-style, over prompt and output; "
                                          "alias repeat_penalty.")
        presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI-style.")
        frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI-style.")
        logit_bias: Optional[dict[int, float]] = Field(default=None, description="OpenAI-style: token id -> "
                                                       "bias in [-100, 100] added to its logit (-100 bans it).")
        stop: Optional[list[str]] = Field(default=None, description="Strings that end the reply (cut from it).")
        timeout: Optional[float] = Field(default=None, gt=0, description="Seconds one call may take, checked as "
                                         "tokens arrive (ChatTimeoutError); alias request_timeout (Ollama's).")
        logprobs: bool = Field(default=False, description="Return each generated token's log-probability "
                               "(ChatResponse.logprobs / CompletionResponse.logprobs).")
        top_logprobs: int = Field(default=0, ge=0, le=20, description="With logprobs: also this many most "
                                  "likely tokens at each position.")
        speculation: Optional[Union[bool, str, dict]] = Field(
            default=None, description="Speculative decoding: \"adaptive\" (or True), \"off\" (or False) or "
            "{\"method\": ..., \"k\": ...}; None: the engine's (engine_kwargs={\"speculation\": ...}). Speed only.")
        tool_parser: Optional[str] = Field(default=None, description="A registered tool parser; None: the "
                                           "model's chat format's, else hermes.")
        clean_tool_schemas: bool = Field(default=True, description="Lay tool schemas out as OpenAI's "
                                         "(`hibana_core.chat.clean_tool`): no pydantic titles, type first.")
        reasoning: Optional[bool] = Field(default=None, description="A reasoning model's thinking (Qwen3): "
                                          "True / False go to the chat template as enable_thinking; None: the "
                                          "template's default. The thinking comes as a ThinkingBlock.")
        reasoning_effort: Optional[str] = Field(default=None, description="OpenAI's reasoning_effort level "
                                                "(low, medium, high) to a chat template that reads it (gpt-oss's); "
                                                "a level the model lacks is a ConfigError. Also per call.")
        reasoning_history: Literal["template", "generated"] = Field(
            default="template", description="Earlier turns' thinking: rendered as the template does, or kept as "
            "generated (nothing recomputed).")
        guided_tool_arguments: bool = Field(default=True, description="Hold tool-call arguments to the tool's "
                                            "JSON schema (the grammar); False: any JSON object.")

        _given: Any = PrivateAttr(default=None)   # the EngineChoice of the engine passed, if one was
        _engine: Any = PrivateAttr(default=None)  # the EngineChoice in use
        _chat: Any = PrivateAttr(default=None)    # the chat layer of its engine
        _chat_parser: Any = PrivateAttr(default=None)  # the tool_parser `_chat` was built with

        def __init__(self, model: str = "demo", engine: Any = None, **kwargs: Any) -> None:
            # unknown options and bad values are refused before an engine loads (`hibana_plugins.options`)
            kwargs = unset_nones(resolve_aliases(kwargs, "HibanaLLM"))  # temperature=None: the default
            if kwargs.get("class_name") == "HibanaLLM":  # the key to_dict / model_dump add (from_dict drops it)
                del kwargs["class_name"]
            if "max_model_len" in kwargs:
                kwargs["engine_kwargs"] = {**kwargs.get("engine_kwargs", {}),
                                           "max_model_len": kwargs.pop("max_model_len")}
            check_known(kwargs, type(self).model_fields, "HibanaLLM")
            for name in PROMPT_FORMATTERS:
                refuse_formatter(name, kwargs.get(name))
                kwargs.pop(name, None)  # (None or LlamaIndex's default: the base class sets its own)
            if isinstance(kwargs.get("stop"), str):  # HibanaLLM(stop="...") as chat(..., stop="...")
                kwargs["stop"] = [kwargs["stop"]]
            sampling_params(kwargs, "HibanaLLM")
            check_switches(kwargs, "HibanaLLM")
            check_state_id(kwargs, "HibanaLLM")
            check_engine(engine, "HibanaLLM")
            if engine is not None:
                model = str(engine.config.model)
            elif isinstance(model, os.PathLike):  # a checkpoint's Path, as Engine.from_pretrained takes
                model = os.fspath(model)
            # a given engine does not read them, but a mistake in them is one all the same (ChatHibana's check)
            check_engine_kwargs(model, kwargs.get("engine_kwargs") or {})
            try:
                super().__init__(model=model, **kwargs)
            except ValueError as exc:  # pydantic's ValidationError
                raise ConfigError(f"HibanaLLM: {exc}") from None
            if engine is not None:
                check_given_engine(engine, self.engine_kwargs, "HibanaLLM")
                self._given = EngineChoice(engine, self.model, dict(self.engine_kwargs))
            self._chat_layer()  # the engine loads here: a model that does not load fails at construction

        @classmethod
        def class_name(cls) -> str:
            return "HibanaLLM"

        def __setattr__(self, name: str, value: Any) -> None:
            # one assigned after construction (llm.messages_to_prompt = fn) went unused as well
            if name in PROMPT_FORMATTERS:
                refuse_formatter(name, value)
            super().__setattr__(name, value)

        def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> "HibanaLLM":
            for name in PROMPT_FORMATTERS:  # (pydantic's copy sets fields without __setattr__)
                if update and name in update:
                    refuse_formatter(name, update[name])
            return super().model_copy(update=update, deep=deep)

        @property
        def engine(self) -> Any:
            """The engine this LLM runs on: the one passed while `model` and `engine_kwargs` are
            those it was passed with, else `Engine.shared`'s."""
            self._engine = choose_engine(self.model, self.engine_kwargs, self._engine, self._given)
            return self._engine.engine

        def _chat_layer(self) -> Chat:
            """The chat layer of this LLM's engine and tool parser (built once for them)."""
            engine = self.engine
            if self._chat is None or self._chat.engine is not engine or self._chat_parser != self.tool_parser:
                self._chat, self._chat_parser = Chat(engine, tool_parser=self.tool_parser), self.tool_parser
            return self._chat

        def __deepcopy__(self, memo: dict[int, Any] | None = None) -> "HibanaLLM":
            """A deep copy on the same engine (weights, KV pool and step loop are not copied)."""
            return super().__deepcopy__(sharing(memo, self._given, self._engine, self._chat))

        def __getstate__(self) -> dict[str, Any]:
            """LlamaIndex's pickled state (the fields that pickle; unpickling runs `__init__` on
            them), without the engine: an engine does not pickle, and LlamaIndex's trial pickling
            of each attribute would walk its weights to find that out."""
            bare = self.model_copy()
            bare._given = bare._engine = bare._chat = None
            return super(HibanaLLM, bare).__getstate__()

        @property
        def metadata(self) -> LLMMetadata:
            context = self.engine.max_model_len
            # None, or the whole context or more (no limit but the context, as None): reserve the usual;
            # LlamaIndex packs prompts into context_window - num_output, which was then below zero
            limited = self.max_tokens is not None and self.max_tokens < context
            return LLMMetadata(context_window=context,
                               num_output=self.max_tokens if limited else DEFAULT_NUM_OUTPUTS,
                               is_chat_model=True, model_name=self.model,
                               # a template without tools (Gemma 3's, Phi-3's) cannot show the model a tool:
                               # structured_predict then asks for the answer as JSON, held to the schema
                               is_function_calling_model=self._chat_layer().renders_tools())

        # --- entry points -----------------------------------------------------------------------

        @llm_chat_callback()
        def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
            *_, last = self._chat_call(messages, kwargs).run(self._chat_response)
            return last

        @llm_chat_callback()
        def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Iterator[ChatResponse]:
            return self._chat_call(messages, kwargs).run(self._chat_response)

        @llm_chat_callback()
        async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
            return [r async for r in await self._chat_call(messages, kwargs).arun(self._chat_response)][-1]

        async def astream_chat(self, messages: Sequence[ChatMessage],
                               **kwargs: Any) -> AsyncIterator[ChatResponse]:
            return await self._closing(llm_chat_callback(), (messages,), kwargs,
                                       lambda: self._chat_call(messages, kwargs), self._chat_response)

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            *_, last = self._completion_call(prompt, formatted, kwargs).run(self._completion_response)
            return last

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False,
                            **kwargs: Any) -> Iterator[CompletionResponse]:
            return self._completion_call(prompt, formatted, kwargs).run(self._completion_response)

        @llm_completion_callback()
        async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            call = self._completion_call(prompt, formatted, kwargs)
            return [r async for r in await call.arun(self._completion_response)][-1]

        async def astream_complete(self, prompt: str, formatted: bool = False,
                                   **kwargs: Any) -> AsyncIterator[CompletionResponse]:
            return await self._closing(llm_completion_callback(), (prompt, formatted), kwargs,
                                       lambda: self._completion_call(prompt, formatted, kwargs),
                                       self._completion_response)

        async def _closing(self, callback: Callable, args: tuple, kwargs: dict, make: Callable[[], _Call],
                           respond: Callable[[_Call, str], Any]) -> AsyncIterator:
            """An async stream entry point: the stream of the call `make()` makes, under LlamaIndex's
            `callback` decorator (its events and callbacks), in a stream that closes both when it
            is closed. The decorator's wrapper never closes the stream it reads: left to the event
            loop's finalizer, the engine's would hold its state a while longer."""
            made: list[_Call] = []

            async def started(_self: Any, *_args: Any, **_kwargs: Any) -> AsyncIterator:
                made.append(make())
                return await made[0].arun(respond)
            return _closing_both(await callback(started)(self, *args, **kwargs), made[0])

        # --- tool calling -----------------------------------------------------------------------

        def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                     chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                     allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                     tool_choice: str | dict | None = None, **kwargs: Any) -> dict[str, Any]:
            messages = list(chat_history or [])
            if user_msg is not None:
                messages.append(ChatMessage(role=MessageRole.USER, content=user_msg)
                                if isinstance(user_msg, str) else user_msg)
            _check_switches({"allow_parallel_tool_calls": allow_parallel_tool_calls, "tool_required": tool_required},
                            "HibanaLLM.chat_with_tools")
            if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Iterable):
                raise ToolSchemaError(f"chat_with_tools takes a list of tools, got one {type(tools).__name__}; "
                                      "pass [tool]")
            specs = [self._tool_spec(tool) for tool in tools]
            return {"messages": messages, "tools": specs, "tool_required": tool_required,
                    "tool_choice": tool_choice, "parallel_tool_calls": bool(allow_parallel_tool_calls), **kwargs}

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
                raise ValueError(_no_call_message(response))
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

        # --- structured output: the answer must parse into the class ----------------------------

        def structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict | None = None,
                               **prompt_args: Any) -> Any:
            llm_kwargs = self._check_structured(output_cls, llm_kwargs)
            if self._streams_instead(output_cls, llm_kwargs):
                answers = self.stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
                return _last_answer(output_cls, list(answers))
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

        async def astructured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict | None = None,
                                      **prompt_args: Any) -> Any:
            llm_kwargs = self._check_structured(output_cls, llm_kwargs)
            if self._streams_instead(output_cls, llm_kwargs):
                answers = await self.astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
                return _last_answer(output_cls, [answer async for answer in answers])
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

        def _streams_instead(self, output_cls: Any, llm_kwargs: dict) -> bool:
            """Whether a non-streamed structured call reads the answer from the streamed program:
            LlamaIndex's non-streamed one calls the class as a tool through `call_tool`, which reads
            the tool's parameters' "properties", and a class that holds itself (class Tree: kids:
            list["Tree"]) has only "$defs" there: it failed with "Error: 'properties'" on a right
            answer; and the tool makes the class in python mode, where a strict class
            (ConfigDict(strict=True)) refuses a date or an enum written as JSON. The streamed one
            reads the call's arguments into the class itself (`_ending_on_the_class`)."""
            from llama_index.core.program.function_program import get_function_tool

            if "json_schema" in llm_kwargs:  # the text program (`_check_structured`): no tool
                return False
            return (bool(getattr(output_cls, "model_config", {}).get("strict"))
                    or "properties" not in get_function_tool(output_cls).metadata.get_parameters_dict())

        def stream_structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict | None = None,
                                      **prompt_args: Any) -> Any:
            llm_kwargs = self._check_structured(output_cls, llm_kwargs)
            answers = super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
            return _ending_on_the_class(output_cls, answers)

        async def astream_structured_predict(self, output_cls: Any, prompt: Any, llm_kwargs: dict | None = None,
                                             **prompt_args: Any) -> Any:
            llm_kwargs = self._check_structured(output_cls, llm_kwargs)
            answers = await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
            return _aending_on_the_class(output_cls, answers)

        def _check_structured(self, output_cls: Any, llm_kwargs: dict | None) -> dict | None:
            """A ToolSchemaError, before any token, where the grammar cannot compile the output
            class's schema (no value meets it, ...). Where it holds the schema only in part (pydantic's
            HttpUrl: a length beside a format; `maxLength` beside a `pattern`), the grammar holds the
            nearest schema it can, as LlamaIndex's OpenAI LLM (strict=False, its default) leaves the
            whole schema to the model. Every answer is read into the class at its end (CHAT_OPTIONS'
            output_cls): one that does not read raises, from every entry point, streamed ones too
            (LlamaIndex's end on an unchecked partial object). (as_structured_llm
            comes here too: StructuredLLM calls these methods.) Returns the calls' llm_kwargs: where
            LlamaIndex asks for JSON in the prompt, not a call (a template that renders no tools,
            or pydantic_program_mode="llm": its LLMTextCompletionProgram), with the class's
            schema, so that the grammar holds the answer all the same."""
            from llama_index.core.program.function_program import get_function_tool

            if not (isinstance(output_cls, type) and hasattr(output_cls, "model_json_schema")):  # (an AttributeError)
                raise ToolSchemaError(f"structured output into {output_cls!r:.60}: the output class is a pydantic "
                                      "model class (class Answer(BaseModel): ...)")
            parameters = self._tool_spec(get_function_tool(output_cls))["function"].get("parameters") or {}
            problems, broken = _unheld(json.dumps(parameters, sort_keys=True, default=str))
            if broken:
                raise ToolSchemaError(f"structured output into {getattr(output_cls, '__name__', output_cls)!r}: the "
                                      f"grammar cannot hold an answer to its schema ({broken})")
            llm_kwargs = {"structured_answer": True, **(llm_kwargs or {})}
            # read into the class at its end (the nearest schema the grammar holds, where it holds it in part)
            llm_kwargs["output_cls"] = output_cls
            mode = self.pydantic_program_mode  # which program LlamaIndex picks (`get_program_for_llm`)
            as_text = mode == PydanticProgramMode.LLM or (mode == PydanticProgramMode.DEFAULT
                                                         and not self._chat_layer().renders_tools())
            if not as_text:
                return llm_kwargs
            return {"json_schema": parameters, **llm_kwargs}

        def _tool_spec(self, tool: Any) -> dict:
            """The tool as an OpenAI function schema, under the tool's own name; a tool LlamaIndex
            cannot describe (no JSON schema for an argument's type, or no tool at all) is a
            ToolSchemaError."""
            try:
                spec = tool.metadata.to_openai_tool(skip_length_check=True)
            except Exception as exc:  # noqa: BLE001 - pydantic's schema errors, AttributeError, ...
                name = (getattr(getattr(tool, "metadata", None), "name", None) or getattr(tool, "__name__", None)
                        or repr(tool))
                raise ToolSchemaError(f"tool '{name:.80}' is not a tool LlamaIndex can describe: {exc}; pass a "
                                      "FunctionTool (FunctionTool.from_defaults(fn)) whose arguments are JSON "
                                      "types") from exc
            # LlamaIndex writes OpenAI's name pattern ("calc.add" as "calc_add", a class Pair[int] as
            # "Pair_int_"), but looks the called tool up by its own name: agents found no tool
            # "calc_add", predict_and_call and structured_predict raised KeyError
            if isinstance(tool.metadata.name, str) and tool.metadata.name:
                spec["function"]["name"] = tool.metadata.name
            parameters = spec["function"].get("parameters")
            own = getattr(getattr(tool, "metadata", None), "fn_schema", None)
            if (isinstance(parameters, dict) and "$ref" not in parameters and "properties" not in parameters
                    and hasattr(own, "model_json_schema")):
                own = own.model_json_schema()  # LlamaIndex drops a self-referring model's root "$ref":
                if "$ref" in own:              # its "$defs" alone take any object
                    spec["function"]["parameters"] = own
            return clean_tool(spec) if self.clean_tool_schemas else spec

        # --- requests and responses -------------------------------------------------------------

        def _chat_call(self, messages: Sequence[ChatMessage], kwargs: dict) -> _Call:
            kwargs = resolve_aliases(kwargs, "HibanaLLM.chat")
            check_known(kwargs, CHAT_OPTIONS, "HibanaLLM.chat")
            _check_switches(kwargs, "HibanaLLM.chat")
            given = kwargs.get("tools")
            if isinstance(given, (list, tuple)) and any(hasattr(t, "metadata") and hasattr(t, "call") for t in given):
                raise ToolSchemaError("chat(tools=...) takes OpenAI tool dicts; pass LlamaIndex tools (FunctionTool, "
                                      "...) to chat_with_tools(tools, ...) or predict_and_call(tools, ...)")
            tools = normalize_tools(given)
            choice = kwargs.get("tool_choice")
            if kwargs.get("tool_required") and not tools:
                raise ToolChoiceError("tool_required=True with no tools: there is no call to make; pass tools "
                                      "or drop tool_required")
            if (kwargs.get("tool_required") or kwargs.get("structured_answer") and tools) and choice in (None, "auto"):
                choice = "required"  # (LlamaIndex's streaming programs ask for the answer's call as "auto")
            choice = normalize_tool_choice(choice, tools)
            # "none": the tools stay listed in the prompt, as OpenAI keeps them; the chat layer's
            # grammar keeps the model from calling them
            prompt = self._chat_layer().render_text(openai_messages(messages), tools,
                                                    kwargs.get("reasoning", self.reasoning),
                                                    effort=kwargs.get("reasoning_effort", self.reasoning_effort))
            return self._call(prompt, tools, choice, kwargs,  # as OpenAI reads it: None is the default
                              kwargs.get("parallel_tool_calls") is not False)

        def _completion_call(self, prompt: str, formatted: bool, kwargs: dict) -> _Call:
            kwargs = resolve_aliases(kwargs, "HibanaLLM.complete")
            check_known(kwargs, COMPLETE_OPTIONS, "HibanaLLM.complete")
            if not isinstance(prompt, str):
                raise ConversationError(f"the prompt is a {type(prompt).__name__}; complete() takes a string")
            if not formatted:  # else the caller applied the chat template: continue the text as it is
                prompt = self._chat_layer().render_text(
                    [{"role": "user", "content": prompt}], reasoning=kwargs.get("reasoning", self.reasoning),
                    effort=kwargs.get("reasoning_effort", self.reasoning_effort))
            return self._call(prompt, None, "auto", kwargs)

        def _call(self, prompt: str, tools: list[dict] | None, choice: str, kwargs: dict,
                  parallel: bool = True) -> _Call:
            if kwargs.get("output_cls") is not None and not hasattr(kwargs["output_cls"], "model_validate_json"):
                raise ConfigError(f"output_cls must be a pydantic model class, got {kwargs['output_cls']!r:.60}")
            values = {name: getattr(self, name) for name in SAMPLING}
            values |= {name: kwargs[name] for name in SAMPLING if kwargs.get(name) is not None}
            params = sampling_params(values, "HibanaLLM call", self.engine.max_model_len)
            if kwargs.get("json_schema") is not None:  # the reply held to it (beside tools: the text answer)
                # a structured answer: the nearest schema the grammar holds, then read into its class
                params = dataclasses.replace(params, json_schema=kwargs["json_schema"],
                                             strict_schema=kwargs.get("output_cls") is None)
            options = {"tool_choice": choice, "parse_tools": tools is not None, "guided": self.guided_tool_arguments,
                       "parallel_tool_calls": parallel, "reasoning_history": self.reasoning_history,
                       "timeout": kwargs.get("timeout", self.timeout)}
            state_id = self.state_id
            if state_id is not None and kwargs.get("structured_answer"):
                # a structured program's prompt is a conversation of its own (an agent's output_cls extraction
                # rewrites the agent's as XML): on the bound state it replaced the agent's history every run
                state_id = f"{state_id}/structured"
            return _Call(self._chat_layer(), prompt, tools, params, options, state_id,
                         structured=bool(kwargs.get("structured_answer")), output_cls=kwargs.get("output_cls"))

        def _chat_response(self, reply: _Call, delta: str) -> ChatResponse:
            calls = reply.tool_calls()
            blocks: list[Any] = [ThinkingBlock(content=reply.reasoning)] if reply.reasoning else []
            blocks.append(TextBlock(text=reply.content))
            blocks += [ToolCallBlock(tool_call_id=c["id"], tool_name=c["function"]["name"],
                                     tool_kwargs=c["function"]["arguments"]) for c in calls]
            # the calls also in OpenAI form: structured streaming and older code read them there
            extra = {"tool_calls": [_openai_call(c) for c in calls]} if calls else {}
            message = ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)
            # a thinking piece where LlamaIndex's agents read it (AgentStream.thinking_delta), as Ollama's
            # and Anthropic's LLMs put it
            thinking = {"thinking_delta": reply.thinking_delta} if reply.thinking_delta else {}
            response = ChatResponse(message=message, delta=delta, raw=reply.raw(self.model),
                                    additional_kwargs=reply.usage_dict() | thinking, logprobs=self._logprobs(reply))
            if reply.structured and reply.result is not None and response.raw.get("finish_reason") == "length":
                if reply.tools and not calls:
                    raise ValueError(_no_call_message(response))
                if not reply.tools:  # the answer held to the schema as text, cut before it closed
                    remedy = ("at the model's context: shorten the history" if response.raw.get("context_full")
                              else "at max_tokens: raise max_tokens")
                    raise ValueError(f"the structured answer ended before it was whole, {remedy}: "
                                     f"{reply.content!r:.200}")
            if reply.output_cls is not None and reply.result is not None:
                self._read_answer(reply, calls)
            return response

        def _read_answer(self, reply: _Call, calls: list[dict]) -> None:
            """A ValueError where a structured answer does not read into its class (`_breaks_schema`;
            `_check_structured`): its calls' arguments, or its text."""
            from llama_index.core.program.function_program import get_function_tool

            answers = [c["function"]["arguments"] for c in calls] if reply.tools else [reply.content]
            for answer in answers:
                text = answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)
                try:  # in JSON mode, as the answer is JSON (a strict class takes a date as text there alone)
                    reply.output_cls.model_validate_json(text)
                except ValueError as exc:  # pydantic's ValidationError
                    parameters = self._tool_spec(get_function_tool(reply.output_cls))["function"].get("parameters")
                    problems, _ = _unheld(json.dumps(parameters or {}, sort_keys=True, default=str))
                    raise _breaks_schema(reply.output_cls, problems, exc, text) from exc

        def _completion_response(self, reply: _Call, delta: str) -> CompletionResponse:
            # a completion has no blocks: the thinking so far as "thinking" (where LlamaIndex's
            # chat_to_completion_decorator leaves a message's), and the piece as chat's thinking_delta
            thinking = {"thinking": reply.reasoning} if reply.reasoning else {}
            thinking |= {"thinking_delta": reply.thinking_delta} if reply.thinking_delta else {}
            return CompletionResponse(text=reply.content, delta=delta, raw=reply.raw(self.model),
                                      additional_kwargs=reply.usage_dict() | thinking, logprobs=self._logprobs(reply))

        def _logprobs(self, reply: _Call) -> list[list[LogProb]] | None:
            """Per generated token, the token itself then its top_logprobs alternatives (the
            result's, so on the last streamed response)."""
            entries = reply.chat.openai_logprobs(reply.result) if reply.result is not None else None
            if entries is None:
                return None
            return [[LogProb(token=e["token"], logprob=e["logprob"], bytes=e["bytes"])
                     for e in [entry, *entry["top_logprobs"]]] for entry in entries]

    HibanaLLM.__qualname__ = "HibanaLLM"  # pickles and prints as hibana_plugins.llamaindex.HibanaLLM
    return HibanaLLM


# --- conversions ------------------------------------------------------------------------------------

def openai_messages(messages: Sequence[Any]) -> list[dict]:
    """LlamaIndex ChatMessages as the OpenAI-style dicts `hibana_core.chat` renders. Tool calls come
    from ToolCallBlocks, else from `additional_kwargs["tool_calls"]` (older integrations)."""
    from llama_index.core.base.llms.types import (AudioBlock, ChatMessage, CitableBlock, CitationBlock, DocumentBlock,
                                                  ImageBlock, TextBlock, ThinkingBlock, ToolCallBlock, VideoBlock)

    def text_of(blocks: Sequence[Any]) -> str:
        """The text of a message's blocks as LlamaIndex's `ChatMessage.content` reads it: text blocks
        a line apart (a citable source's content is one of them); a citation's text inline, in its place."""
        out: list[str] = []
        after_block = False  # the last piece was a text block's (a line apart from the next one)
        for block in blocks:
            if isinstance(block, (TextBlock, CitableBlock)):
                if after_block:
                    out.append("\n")
                out.append(block.text if isinstance(block, TextBlock) else text_of(block.content))
                after_block = True
            elif isinstance(block, CitationBlock):
                out.append(text_of([block.cited_content]))
                after_block = False
        return "".join(out)

    def flat(blocks: Sequence[Any]) -> Iterator[Any]:
        """The blocks, a citable source's or a citation's content in their place (a tool may return
        a CitableBlock: its text is the tool's result)."""
        for block in blocks:
            if isinstance(block, CitableBlock):
                yield from flat(block.content)
            elif isinstance(block, CitationBlock):
                yield from flat([block.cited_content])
            else:
                yield block

    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise ConversationError(f"message {i} is a {type(message).__name__}, not a LlamaIndex ChatMessage; pass "
                                    "ChatMessage(role='user', content='...')")
        role = getattr(message.role, "value", message.role)
        role = _ROLES.get(role, role)
        media = [b for b in flat(message.blocks) if isinstance(b, (ImageBlock, AudioBlock, VideoBlock, DocumentBlock))]
        if media:  # dropping it would answer as if the user had sent none
            raise UnsupportedContentError(f"HibanaLLM reads text only, and a {role} message holds a "
                                          f"{media[0].block_type!r} block; describe it in text or use a multimodal LLM")
        item: dict[str, Any] = {"role": role, "content": text_of(message.blocks)}
        thinking = "".join(b.content or "" for b in message.blocks if isinstance(b, ThinkingBlock))
        if thinking:  # the template decides whether it is rendered
            item["reasoning_content"] = thinking
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


def _call_dict(call: Any) -> Any:
    """An OpenAI SDK call object as a dict; anything else as it is (`hibana_core.chat` judges it)."""
    return call.model_dump() if not isinstance(call, dict) and hasattr(call, "model_dump") else call


def _openai_call(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": text}}

