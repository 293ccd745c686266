"""The chat layer: OpenAI-style messages and tools in, text and tool calls out, on a state.

    messages, tools --render (the model's chat template)--> token ids --sync--> handle
    handle --generate (stop at the end-of-turn token)--> text --tool parser--> ChatResult

Rendering goes through the tokenizer's `apply_chat_template`, or through a chat format a plugin
registers for the model's `model_type` (which may also name the tool parser; "hermes" otherwise).
Every call syncs the handle to the freshly rendered prompt, so a re-rendered history costs only the
tokens that differ from what the state holds; where the model's own tokens spell the same text as
the re-rendered history, they are kept (`Chat.prompt_ids`). A turn that `tool_choice` forces to
call a tool runs as several requests (`hibana_core.turn`). Model output never raises: malformed
tool-call text comes back as text with finish_reason "malformed_tool_call".

`Chat(engine, "agent-1")` works on one state; `Chat(engine)` only renders, and serves each call
on the state `chat.lease(prompt)` picks (what the framework adapters do).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Sequence

from hibana_core import prompt, turn
from hibana_core.config import SamplingParams
from hibana_core.errors import ConfigError, ContextLengthError, HibanaError, StateBusyError
from hibana_core.turn import MALFORMED, ChatDelta, ChatResult, Usage  # noqa: F401 (re-exported)
from hibana_plugins.manager import get_plugin_manager
from hibana_plugins.hookspecs import ToolCall

if TYPE_CHECKING:
    from hibana_core.engine import Engine
    from hibana_core.state import StateHandle

DEFAULT_TOOL_PARSER = "hermes"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MEDIA_PARTS = frozenset({"image", "image_url", "input_image", "audio", "input_audio", "video", "file",
                          "document"})


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI-style messages as chat templates expect them: content as a string, tool-call
    arguments as dicts (so the template re-serialises them the way the model wrote them).
    "developer" is the system role. A message the template could not render faithfully is a
    ConversationError (UnsupportedContentError for images, audio, files)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ConversationError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ConversationError("messages is empty; give at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConversationError(f"message {i} is a {type(message).__name__}, not a dict with a 'role' and "
                                    "a 'content'")
        m = dict(message)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ConversationError(f"message {i} has role {role!r}; give it one of {sorted(KNOWN_ROLES)}")
        m["role"] = "system" if role == "developer" else role
        m["content"] = _content(i, role, m.get("content"))
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], (list, tuple)):
                raise ConversationError(f"message {i}'s tool_calls is a {type(m['tool_calls']).__name__}, "
                                        "not a list of calls")
            m["tool_calls"] = [_normalize_call(i, c) for c in m["tool_calls"]]
        if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise ConversationError(f"message {i} has tool_call_id {m['tool_call_id']!r}; a call id is a string")
        out.append(m)
    return out


def _content(i: int, role: str, content: Any) -> str:
    """A message's content as one string: None is "", content parts are joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ConversationError(f"message {i}'s content is a {type(content).__name__}; give a string, None or "
                                "a list of content parts")
    parts = []
    for part in content:
        kind = part.get("type", "text") if isinstance(part, Mapping) else None
        if isinstance(part, str):
            parts.append(part)
        elif kind in _MEDIA_PARTS:
            raise UnsupportedContentError(f"the model reads text only, and a {role} message (message {i}) holds "
                                          f"a {kind!r} part; describe it in text or use a multimodal model")
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise ConversationError(f"message {i} holds a content part {part!r:.80}; a part is a string or "
                                    "{'type': 'text', 'text': '...'}")
    return "".join(parts)


def _normalize_call(i: int, call: Any) -> dict:
    if isinstance(call, ToolCall):
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise ConversationError(f"message {i} holds a tool call {call!r:.80}; a call is {{'id': ..., 'function': "
                                "{'name': ..., 'arguments': ...}}")
    name, call_id, arguments = function.get("name"), call.get("id"), function.get("arguments", {})
    if not isinstance(name, str):
        raise ConversationError(f"message {i} holds a tool call named {name!r}; a call's name is a string")
    if call_id is not None and not isinstance(call_id, str):
        raise ConversationError(f"message {i} holds a tool call with id {call_id!r}; a call id is a string")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            pass  # the template prints a string as it is
    else:
        _check_json(arguments, lambda exc: ConversationError(
            f"message {i} holds a tool call whose arguments are not JSON ({exc}); pass a dict or a JSON string"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _check_json(value: Any, error: Callable[[Exception], HibanaError]) -> None:
    """Raise `error(exc)` unless `value` serialises as JSON (what templates do with it)."""
    try:
        json.dumps(value)
    except (ValueError, TypeError, RecursionError) as exc:  # a cycle, a non-JSON type, a huge integer
        raise error(exc) from None


def check_text(text: str, what: str) -> None:
    """ConversationError unless `text` is valid Unicode (no lone surrogate): what tokenizers read."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConversationError(
            f"{what} holds {text[exc.start]!r} at position {exc.start}: a lone surrogate, not text (a string "
            "decoded with errors='surrogateescape', or cut inside a surrogate pair); decode it with "
            "errors='replace' or remove it") from None


def normalize_tools(tools: Sequence[dict] | None) -> list[dict] | None:
    """Tools as OpenAI function tools: {"type": "function", "function": {name, description, parameters}}.
    ToolSchemaError for anything else."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ToolSchemaError(f"tools must be a list of tools, got {type(tools).__name__}")
    return [_normalize_tool(i, t) for i, t in enumerate(tools)] or None


def _normalize_tool(i: int, tool: Any) -> dict:
    if not isinstance(tool, Mapping):
        raise ToolSchemaError(f"tool {i} is a {type(tool).__name__}; a tool is {{'type': 'function', 'function': "
                              "{'name': ..., 'description': ..., 'parameters': {JSON schema}}}")
    wrapped = "function" in tool and "name" not in tool  # {"type": "function", "function": {...}}, else bare
    function = tool["function"] if wrapped else tool
    if not isinstance(function, Mapping):
        raise ToolSchemaError(f"tool {i}'s function is a {type(function).__name__}, not a dict with a name")
    name, parameters = function.get("name"), function.get("parameters")
    if not isinstance(name, str) or not name:
        raise ToolSchemaError(f"tool {i} has name {name!r}; every tool needs a name (a non-empty string)")
    if not isinstance(function.get("description") or "", str):
        raise ToolSchemaError(f"tool {name!r} has a description that is not a string")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ToolSchemaError(f"tool {name!r} has parameters of type {type(parameters).__name__}; give a JSON "
                              "schema object (a dict), or none")
    _check_json(dict(function), lambda exc: ToolSchemaError(f"tool {name!r} is not JSON ({exc}); a schema that "
                                                            "refers to itself must do so with $ref"))
    return tool if wrapped and tool.get("type") == "function" else {"type": "function", "function": function}


class ToolChoiceError(HibanaError, ValueError):
    """A tool_choice that names no offered tool, or requires a call with no tools offered."""


class UnsupportedContentError(HibanaError, ValueError):
    """A message carries content the model cannot read (an image, audio, a file)."""


class ConversationError(HibanaError, ValueError):
    """A conversation that cannot be rendered faithfully: a tool result answering no call, a
    message that is not a message, a role the chat template drops, text that is not Unicode."""


class ToolSchemaError(HibanaError, ValueError):
    """A tool that is not an OpenAI function tool: no name, parameters that are not a schema."""


def check_tool_results(messages: Sequence[dict]) -> None:
    """Every tool message answers a call of the assistant message it follows (other tool messages
    between), and names one of its calls when both carry ids: as OpenAI's API requires. A
    template would render an orphan result as if some call had produced it, or drop it."""
    calls: list | None = None  # the calls of the assistant message being answered
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or None
        elif role == "tool":
            if calls is None:
                raise ConversationError(f"message {i} is a tool result but follows no assistant message with "
                                        "tool calls; give the assistant message its tool_calls, or send the "
                                        "result as a user message")
            call_id, ids = message.get("tool_call_id"), [_call_id(c) for c in calls]
            if call_id and all(ids) and call_id not in ids:
                raise ConversationError(f"message {i} answers tool call {call_id!r}, which the assistant message "
                                        f"before it did not make (its calls: {ids})")
        else:
            calls = None


def _call_id(call: Any) -> str | None:
    return call.id if isinstance(call, ToolCall) else call.get("id")


def normalize_tool_choice(choice: Any, tools: Sequence[dict] | None) -> str:
    """The spellings frameworks use, as "auto", "none", "required" or a tool's name: None/"auto",
    "none"/False, "any"/"required"/True, a name, or {"function": {"name": ...}} / {"name": ...} /
    {"type": "auto" | "none" | "any" | "required"}. `tools` are OpenAI function tools; forcing a
    call with none offered is a ToolChoiceError."""
    names = [t["function"]["name"] for t in tools or ()]
    if isinstance(choice, Mapping) and ("function" in choice or "name" in choice):
        function = choice.get("function", choice)
        choice = function.get("name") if isinstance(function, Mapping) else function
        if not isinstance(choice, str):
            raise ToolChoiceError(f"tool_choice names tool {choice!r:.80}; name one of {names}")
    elif isinstance(choice, Mapping):
        choice = choice.get("type")
    if choice is None or isinstance(choice, str) and choice == "auto":
        return "auto"
    if choice is False or isinstance(choice, str) and choice == "none":
        return "none"
    if choice is True or isinstance(choice, str) and choice in ("any", "required"):
        if not names:
            raise ToolChoiceError(f"tool_choice={choice!r} requires a tool call, and no tools are offered; pass "
                                  "tools or use 'auto'")
        return "required"
    if isinstance(choice, str) and choice in names:
        return choice
    raise ToolChoiceError(f"tool_choice={choice!r:.80} names no bound tool; use 'auto', 'none', 'any', "
                          f"'required' or one of {names}")


_KEY_ORDER = ("type", "name", "properties", "description", "required", "enum")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def clean_schema(schema: Any) -> Any:
    """A JSON schema laid out as OpenAI-style tool schemas are (the layout small models trained on
    read best): without the `title`s pydantic adds, `type`, `properties`, `description` first.
    Argument names keep their order, a property called "title" included."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: clean_schema(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:  # one schema, or a list of them
        if isinstance(out.get(key), list):
            out[key] = [clean_schema(s) for s in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = clean_schema(out[key])
    order = sorted(out, key=lambda k: _KEY_ORDER.index(k) if k in _KEY_ORDER else len(_KEY_ORDER))
    return {k: out[k] for k in order}


def clean_tool(tool: dict) -> dict:
    """An OpenAI function tool (or a bare function) with its parameters' schema cleaned."""
    function = dict(_normalize_tool(0, tool)["function"])
    if isinstance(function.get("parameters"), dict):
        function["parameters"] = clean_schema(function["parameters"])
    return {"type": "function", "function": clean_schema(function)}


class Chat:
    """The chat layer of an engine: `Chat(engine, "agent-1").respond(messages, tools=...)` on one
    state, or `Chat(engine)` to render and lease a state per call."""

    def __init__(self, engine: "Engine", state_id: str | None = None, tool_parser: str | None = None) -> None:
        if engine.tokenizer is None:
            raise HibanaError("the chat layer needs a tokenizer with a chat template, and this checkpoint "
                              "has none; use state handles with token ids instead")
        self.engine = engine
        chat_format = get_plugin_manager().chat_formats().get(getattr(engine.hf_config, "model_type", None))
        self.template: str | None = getattr(chat_format, "template", None)
        self.parser_name = tool_parser or getattr(chat_format, "tool_parser", None) or DEFAULT_TOOL_PARSER
        self.parser = get_plugin_manager().lookup("tool_parser", self.parser_name)
        vocab = engine.tokenizer.get_vocab()
        self.stop_token_ids = tuple(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        self.control = prompt.control_strings(engine.tokenizer)  # what contents never turn into
        self.control_ids = frozenset(vocab[t] for t in self.control if t in vocab)
        self._plain: dict[str, Callable[[str], list[int]]] = {}   # built on first hostile content, shared by `on`
        self._roles: dict[str, bool] = {}     # roles outside KNOWN_ROLES: whether the template renders them
        self.handle: StateHandle | None = engine.open_state(state_id) if state_id is not None else None

    def on(self, handle: "StateHandle") -> "Chat":
        """This chat layer on another state (template, parser and stop tokens shared)."""
        chat = copy.copy(self)
        chat.handle = handle
        return chat

    # --- which state serves a call ------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, prompt: str, state_id: str | None = None, *, fallback: bool = False) -> Iterator["Chat"]:
        """This chat layer on the state that serves one call, held until the block ends, so that
        concurrent calls never share a state. `prompt` is the call's rendered text. The state:
          1. `state_id`, when given; StateBusyError while another call holds it, unless
             `fallback`: then the choice below;
          2. else an idle state made for an earlier call that named none, when the prompt
             continues its conversation (`continues`);
          3. else a new one, which still shares every full KV block of a common prefix."""
        check_text(prompt, "the prompt")
        ids = self._encode(prompt)
        if len(ids) > self.engine.max_model_len:  # refused before a state is leased, or made
            raise ContextLengthError(f"{len(ids)} tokens exceed the model's context of {self.engine.max_model_len}; "
                                     "shorten the history")
        with contextlib.ExitStack() as stack:
            handle = self._lease(stack, state_id, busy_ok=fallback) if state_id is not None else None
            if handle is None:
                match = self.engine.match_state(ids)
                if (match is not None and self.engine.registry.is_unnamed(match)
                        and self.continues(match.tokens, prompt)):
                    handle = self._lease(stack, match.id, busy_ok=True)  # None if taken meanwhile
            if handle is None:  # a new state: a call that fails leaves none behind
                handle = stack.enter_context(self.engine.lease())
                stack.callback(_close_if_empty, handle)
            yield self.on(handle)

    def _lease(self, stack: contextlib.ExitStack, state_id: str, busy_ok: bool) -> "StateHandle | None":
        try:
            return stack.enter_context(self.engine.lease(state_id=state_id))
        except StateBusyError:  # Engine.lease only raises; the proposed `if_busy` would not
            if busy_ok:
                return None
            raise

    def continues(self, held: Sequence[int], prompt: str) -> bool:
        """Whether `prompt` (rendered text) goes on from a state's conversation: holds it up to its
        last reply, which a re-render may spell differently. Taking over a state that merely
        shares the system prompt and tools would throw another conversation away."""
        ends = [i + 1 for i, token in enumerate(held) if token in self.stop_token_ids]
        if ends and ends[-1] == len(held):
            ends.pop()  # the end of the last reply
        needed = ends[-1] if ends else len(held)
        return prompt.startswith(self.engine.tokenizer.decode(held[:needed], skip_special_tokens=False))

    # --- rendering ----------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt token ids: the conversation plus the assistant's generation prompt."""
        return self._encode(self.render_text(messages, tools))

    def render_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> prompt.Prompt:
        """The rendered prompt; message contents that hold control-token text are marked as such
        (`hibana_core.prompt`), so that they are tokenized as plain text."""
        kwargs = {"chat_template": self.template} if self.template else {}

        messages, tools = normalize_messages(messages), normalize_tools(tools)
        check_tool_results(messages)
        for i, role in enumerate(m["role"] for m in messages):
            if role not in KNOWN_ROLES and not self._renders_role(role):
                raise ConversationError(f"message {i} has role {role!r}, which the chat template does not render "
                                        f"(it would be dropped); use one of {sorted(KNOWN_ROLES)}")
        for what, value in [*((f"message {i}", m) for i, m in enumerate(messages)),
                            *((f"tool {i}", t) for i, t in enumerate(tools or ()))]:
            try:
                dumped = json.dumps(value, ensure_ascii=False, default=str)
            except (ValueError, RecursionError) as exc:  # a cycle
                raise ConversationError(f"{what} is not plain data ({exc}); pass strings, lists and dicts") from None
            check_text(dumped, what)

        def template(messages: list[dict], tools: list[dict] | None) -> str:
            try:
                return self.engine.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
            except Exception as exc:  # jinja raises many types for a conversation it rejects
                raise ConversationError(f"cannot render the conversation with the chat template: {exc}") from exc
        return prompt.render(template, messages, tools, self.control)

    def _renders_role(self, role: str) -> bool:
        """Whether the chat template writes a message of `role` (templates drop roles they do not
        know without a word)."""
        if role not in self._roles:
            marker = "hibana-role-probe"
            kwargs = {"chat_template": self.template} if self.template else {}
            try:
                text = self.engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}, {"role": role, "content": marker}], tokenize=False, **kwargs)
            except Exception:  # noqa: BLE001 - a template that refuses the role does not render it
                text = ""
            self._roles[role] = marker in text
        return self._roles[role]

    def prompt_ids(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None = None) -> list[int]:
        """What `respond` syncs: the rendered prompt (`messages` may be rendered text already),
        except that the state's own tokens are kept up to the last end-of-turn token where they
        still spell the prompt's text, and only the rest is tokenized. A model may spell a word in
        other tokens than the tokenizer would (an unseen name copied piece by piece);
        re-tokenizing would recompute everything after it. Held tokens are never kept where one
        of their control tokens would stand for a message content's text."""
        if isinstance(messages, str):
            check_text(messages, "the prompt")
        text = messages if isinstance(messages, str) else self.render_text(messages, tools)
        held = self.handle.tokens if self.handle is not None else []
        ends = [i + 1 for i, token in enumerate(held) if token in self.stop_token_ids]
        for end in reversed(ends):  # usually the last one matches: the previous reply, unchanged
            held_text = self.engine.tokenizer.decode(held[:end], skip_special_tokens=False)
            if text.startswith(held_text) and self._controls_are_markup(held[:end], prompt.spans_of(text)):
                return held[:end] + self._encode(text, len(held_text))
        return self._encode(text)

    def _controls_are_markup(self, tokens: Sequence[int], spans: Sequence[prompt.Span]) -> bool:
        """Whether no control token of `tokens` stands where `spans` (content) are in their text."""
        if not spans:
            return True
        decode = self.engine.tokenizer.decode
        pos, run = 0, []
        for token in tokens:
            if token not in self.control_ids:
                run.append(token)
                continue
            pos += len(decode(run, skip_special_tokens=False)) if run else 0
            run = []
            if any(a <= pos < b for a, b in spans):
                return False
            pos += len(decode([token], skip_special_tokens=False))
        return True

    def _encode(self, text: str, start: int = 0) -> list[int]:
        """Token ids of `text[start:]`: the template's markup as `apply_chat_template(tokenize=True)`
        encodes it (control tokens included), a Prompt's content spans as plain text."""
        if prompt.spans_of(text) and not self._plain:
            self._plain["encode"] = prompt.plain_encoder(self.engine.tokenizer)
        return prompt.encode(text, start, self._markup, self._plain.get("encode"))

    def _markup(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    # --- one assistant turn -------------------------------------------------------------------

    def respond(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None = None,
                params: SamplingParams | None = None, **options: Any) -> ChatResult:
        """Render, sync the state, generate one assistant turn, parse its tool calls. `options`
        are those of `stream_respond`."""
        *_, last = turn.run(self.opener(messages, tools, params, **options), turn.result_of)
        return last

    async def arespond(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None = None,
                       params: SamplingParams | None = None, **options: Any) -> ChatResult:
        return [r async for r in turn.arun(self.opener(messages, tools, params, **options), turn.result_of)][-1]

    def stream_respond(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None = None,
                       params: SamplingParams | None = None, **options: Any) -> Iterator[ChatDelta]:
        """Text deltas and tool-call deltas as they are generated; the last item carries the
        ChatResult. Closing the iterator early cancels the generation. `options` are `opener`'s."""
        return turn.run(self.opener(messages, tools, params, **options))

    def astream_respond(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None = None,
                        params: SamplingParams | None = None, **options: Any) -> AsyncIterator[ChatDelta]:
        """`stream_respond` on the caller's event loop: awaits the engine, never blocks the loop."""
        return turn.arun(self.opener(messages, tools, params, **options))

    def opener(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None = None,
               params: SamplingParams | None = None, *, lease: bool = False, state_id: str | None = None,
               fallback: bool = False, prefill: str = "", parse_tools: bool = True, tool_choice: Any = "auto",
               parallel_tool_calls: bool = True, guided: bool = True, timeout: float | None = None) -> turn.Open:
        """How `turn.run` / `turn.arun` start one assistant turn: on this chat's state, or with
        `lease`, on the state `self.lease(messages, state_id, fallback=fallback)` picks (then
        `messages` is the rendered prompt), held until the turn ends.

        `messages` may be a rendered prompt, continued as it is. `prefill` starts the assistant's
        turn with given text; `parse_tools=False` returns the text as generated. `tool_choice`:
        "auto", "none" (the tools are not offered and the output is never read as calls),
        "required"/"any" (some call), or a tool's name (that call): forced calls are written
        around the model's choices (`hibana_core.turn`), with `guided` argument values on flat
        schemas. `parallel_tool_calls=False`: at most one call, in the stream as in the result.
        `timeout`: seconds, checked per token."""
        normalize_tool_choice(tool_choice, normalize_tools(tools))  # options are refused before a lease
        if not isinstance(prefill, str):
            raise ConfigError(f"prefill must be a string, got {type(prefill).__name__}")
        check_text(prefill, "prefill")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ConfigError(f"timeout must be a number of seconds > 0, or None; got {timeout!r:.80}")

        def open_turn(stack: contextlib.ExitStack) -> "tuple[turn.TurnRun, StateHandle]":
            chat = stack.enter_context(self.lease(messages, state_id, fallback=fallback)) if lease else self
            run = chat._turn(messages, tools, params, prefill, parse_tools, tool_choice, parallel_tool_calls,
                             guided, timeout)
            return run, chat.handle
        return open_turn

    def _turn(self, messages: Sequence[dict] | str, tools: Sequence[dict] | None, params: SamplingParams | None,
              prefill: str, parse_tools: bool, tool_choice: Any, parallel_tool_calls: bool, guided: bool,
              timeout: float | None) -> turn.TurnRun:
        if self.handle is None:
            raise HibanaError("this Chat has no state: give it one (Chat(engine, 'agent-1')), or serve "
                              "each call on a leased one (`with chat.lease(prompt) as c: c.respond(...)`)")
        tools = normalize_tools(tools)
        tool_choice = normalize_tool_choice(tool_choice, tools)
        if tool_choice == "none":
            tools, parse_tools = None, False
        params = params or SamplingParams(max_tokens=256)
        params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(
            tuple(params.stop_token_ids) + self.stop_token_ids)))
        plan = turn.plan(tools, tool_choice, turn.SYNTAX.get(self.parser_name), prefill=prefill, guided=guided,
                         budget=params.max_tokens)
        stream = self.parser.stream() if parse_tools else turn.PlainText()
        return turn.TurnRun(self.prompt_ids(messages, tools), plan, params, stream, self._encode,
                            self.stop_token_ids[:1], timeout, max_calls=None if parallel_tool_calls else 1)


def _close_if_empty(handle: "StateHandle") -> None:
    """Close a state made for a call that left nothing in it (it failed before its prompt was synced)."""
    with contextlib.suppress(HibanaError):
        if not handle.tokens:
            handle.close()


def assistant_message(result: ChatResult) -> dict:
    """The OpenAI-style assistant message for a result, to append to the conversation."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in result.tool_calls]
    return message
