"""The chat layer: OpenAI-style messages and tools in, text and tool calls out, on a state.

    messages, tools --render (the model's chat template)--> token ids --sync--> handle
    handle --generate (stop at the end-of-turn token)--> text --tool parser--> ChatResult

Rendering goes through the tokenizer's `apply_chat_template`, or through a chat format a plugin
registers for the model's `model_type` (which may also name the tool parser; "hermes" otherwise).
Every call syncs the handle to the freshly rendered prompt, so a re-rendered history costs only the
tokens that differ from what the state holds; where the model's own tokens spell the same text as
the re-rendered history, they are kept (`Chat.prompt_ids`). Tool calls are held to the offered
tools and their schemas by a grammar, which `tool_choice` decides: from the model's `<tool_call>`
on ("auto"), or from the first token ("required"/"any", a tool's name) (`hibana_core.turn`). Model
output never raises: malformed tool-call text comes back as text with finish_reason
"malformed_tool_call".

`Chat(engine, "agent-1")` works on one state; `Chat(engine)` only renders, and serves each call
on the state `chat.lease(prompt)` picks (what the framework adapters do). Messages, tools and
tool_choice are checked first (`hibana_core.messages`); message contents are tokenized so that they
never become control tokens (`hibana_core.prompt`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import logging
import re
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Sequence

from hibana_core import prompt, turn
from hibana_core.config import MAX_DRAFT_TOKENS, SamplingParams
from hibana_core.detokenizer import finished_end, token_bytes
from hibana_core.token_floor import TokenFloor, token_floor
from hibana_core.errors import (CheckpointError, ConfigError, ContextLengthError, HibanaError, InvalidTokenError,
                                StateBusyError, StateClosedError)
from hibana_core.messages import (KNOWN_ROLES, TOOL_CHOICE_MODES, ConversationError,  # noqa: F401 (re-exported)
                                  ToolChoiceError, ToolSchemaError, UnsupportedContentError, check_text,
                                  check_tool_results, clean_schema, clean_tool, json_text,
                                  normalize_messages, normalize_tool_choice, normalize_tools, one_call_a_message)
from hibana_core.turn import MALFORMED, ChatDelta, ChatResult, Usage  # noqa: F401 (re-exported)
from hibana_plugins.hookspecs import ParsedOutput, ToolCall, ToolCallDelta
from hibana_plugins.manager import PluginError, describe_registered, get_plugin_manager

if TYPE_CHECKING:
    from hibana_core.engine import Engine
    from hibana_core.state import StateHandle, TokenLogprob

logger = logging.getLogger("hibana.states")

DEFAULT_TOOL_PARSER = "hermes"
REASONING_HISTORY = ("template", "generated")
"""How a reasoning model's earlier turns are rendered: as the chat template does (Qwen3's drops
their thinking, so the state recomputes from the first dropped block), or as generated (the state's
own tokens are kept, thinking included: nothing is recomputed, but the model sees its old thinking)."""
ROLES_CACHED = 64
ROLE_CACHED_LENGTH = 64
"""What a chat layer remembers of roles outside KNOWN_ROLES (whether its template renders each):
at most this many, of at most this many characters, so that a server's clients sending ever new
roles never grow it."""
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "[e~[", "<seed:eos>")
"""Tokens that end an assistant turn, where the vocabulary has them (Llama 3's <|eom_id|> ends a
turn of calls that waits for their results; MiniMax-M2's [e~[ and Seed-OSS's <seed:eos> end each
message, their EOS)."""
RUN_PAST_STOP = 2 * (MAX_DRAFT_TOKENS + 1)
"""Tokens a request may generate past the stop a turn asked for: the step that saw it and the one
launched after it (async scheduling), each up to a verify's accepted drafts and its bonus token."""
LOSSY = "\ufffd"
"""What a tokenizer decodes bytes that are no UTF-8 as (a character a reply cut, byte-fallback
tokens out of order): held tokens whose text holds it may spell other bytes than the prompt's."""


class TokenIds(tuple):
    """A prompt given as token ids (OpenAI's completions take them): continued as it is, never
    rendered nor re-tokenized. Checked as `StateHandle.sync` checks ids (`Chat.prompt_tokens`):
    control tokens are the caller's markup, as the control-token text of a rendered prompt is."""

    def __new__(cls, ids: Sequence[int]) -> "TokenIds":
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
        if bad:
            raise InvalidTokenError(f"token ids must be integers, got {bad[0]!r:.40}; tokenize with this model's "
                                    "tokenizer")
        return super().__new__(cls, ids)


HEAD_TOKENS = 64
"""`Chat._spells` looks this far into a state's tokens for the first that spells more than whitespace."""


class LedText(str):
    """A prompt given as text that the tokenizer's lead tokens go before (its BOS, where it adds
    one: `prompt.leading_specials`; a completions prompt whose text does not write it): its tokens
    are the lead's, then the text's own, encoded alone as the tokenizer encodes it. Kept as text,
    not turned into those ids, so that a state is continued on the text its tokens spell, the
    lead left out, as a prompt without a lead is (`Chat.continues`, `Chat.prompt_ids`): a reply
    whose tokens the text re-tokenizes otherwise (a merge across the turn's seam, a byte-fallback
    piece) would otherwise leave its state unused."""

    lead: tuple[int, ...] = ()

    def __new__(cls, text: str, lead: Sequence[int]) -> "LedText":
        led = super().__new__(cls, text)
        led.lead = tuple(lead)
        return led


def _lead_of(prompt: "str | TokenIds") -> tuple[int, ...]:
    """The lead tokens before a prompt's text (`LedText`); none for any other prompt."""
    return getattr(prompt, "lead", ())


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""OpenAI's reasoning_effort levels: what a model that declares none of its own takes ("none":
thinking off; the others go to its template, which may read them)."""


class Chat:
    """The chat layer of an engine: `Chat(engine, "agent-1").respond(messages, tools=...)` on one
    state, or `Chat(engine)` to render and lease a state per call."""

    CANDIDATES = 8
    """How many of the states made for calls, those sharing the longest token prefixes with a
    call's prompt, `lease` asks whether the prompt continues their conversation."""

    def __init__(self, engine: "Engine", state_id: str | None = None, tool_parser: str | None = None) -> None:
        if engine.tokenizer is None:
            raise CheckpointError("the chat layer needs a tokenizer with a chat template, and this checkpoint "
                                  "has none; use state handles with token ids instead")
        self.engine = engine
        self.asked_parser = tool_parser  # the tool parser named (None: the format's or the template's)
        vocab = engine.tokenizer.get_vocab()
        model_type = getattr(engine.hf_config, "model_type", None)
        chat_format = get_plugin_manager().chat_formats().get(model_type)
        self._format: str | None = None  # how errors name the chat format in use, and its plugin
        if chat_format is not None:
            self._format = f"chat format {model_type!r} ({describe_registered(chat_format)})"
            _check_format(self._format, chat_format)
        ends = getattr(chat_format, "end_of_turn_tokens", None)
        if ends and not any(t in vocab for t in ends):
            chat_format = ends = self._format = None  # a tokenizer that does not speak the family's format:
            # its template's is used
        self.template: str | None = getattr(chat_format, "template", None)
        if self.template:
            self._check_compiles(self.template)
        self._efforts: tuple[str, ...] | None = getattr(chat_format, "reasoning_efforts", None)  # levels it reads
        self._always_thinks = bool(getattr(chat_format, "always_thinks", False))  # no switch for thinking
        named = None if tool_parser else getattr(chat_format, "tool_parser", None)  # the format's choice
        template = self.template or getattr(engine.tokenizer, "chat_template", None) or ""
        self.parser_name = tool_parser or named or _template_parser(str(template), vocab)
        self._id_length = _template_id_length(str(template))  # Mistral's: call ids of 9 letters and digits
        self._templated = bool(template)  # a tokenizer without a chat template renders no conversation
        self.one_call = _template_one_call(str(template))
        """Whether the chat template renders one call a message (Llama 3.x's raise on more): a turn
        makes at most one call, and a past turn of several is written as one call a message."""
        # a format's fixes to what its template refuses
        self._prepare: Callable[[list[dict]], list[dict]] = (getattr(chat_format, "prepare_messages", None)
                                                             or (one_call_a_message if self.one_call else list))
        try:
            registered = get_plugin_manager().lookup("tool_parser", self.parser_name)
        except PluginError as exc:
            if not named:
                raise
            raise PluginError(f"{self._format} names tool parser {named!r} (its tool_parser), and {exc} Or give "
                              "another: tool_parser=...") from exc
        self.parser = _checked_parser(self.parser_name, registered)
        self.stop_token_ids = tuple(vocab[t] for t in (END_OF_TURN_TOKENS if ends is None else ends)
                                    if t in vocab and vocab[t] < engine.vocab_size)  # a format's own (harmony:
        # <|end|> ends a message, not the turn); a token the tokenizer adds past the model's vocabulary never comes
        eos = engine.tokenizer.eos_token_id
        if (ends is None and "eos_token" in str(template) and isinstance(eos, int) and eos < engine.vocab_size
                and eos not in engine.eos_token_ids and eos not in self.stop_token_ids):
            # the template ends a reply with it (Mistral's, Llama 2's): a turn ends there even where the
            # model stops at no EOS (a generation_config.json naming none, as transformers reads it)
            self.stop_token_ids += (eos,)
        control = prompt.control_strings(engine.tokenizer)
        # the model's ends of sequence that its template writes to open the next message (GLM's <|user|> and
        # <|observation|>: a reply ends where the next message begins) end a turn too, so that a held reply
        # is kept (`prompt_ids`); they end no message (`continues`: a <|user|> opens one)
        opening = tuple(t for t in sorted(engine.eos_token_ids) if ends is None and t < engine.vocab_size
                        and t not in self.stop_token_ids and t != eos
                        and (text := engine.tokenizer.decode([t], skip_special_tokens=False)) in control
                        and text in str(template))
        self.stop_token_ids += opening
        # where a reply ends among a state's tokens: a turn's stop tokens, and the EOS the template ends a reply
        # with where the engine stops at it (Mistral's </s>: without it no held reply was ever kept)
        self._reply_ends = frozenset(self.stop_token_ids) | frozenset(
            (eos,) if ends is None and "eos_token" in str(template) and eos in engine.eos_token_ids else ())
        self._end_texts = tuple(engine.tokenizer.decode([t], skip_special_tokens=False) for t in self.stop_token_ids)
        self.closing_token_ids = frozenset(self.stop_token_ids) | frozenset(
            t for t in engine.eos_token_ids if t < engine.vocab_size)
        """Tokens that end a reply and are no text of it: a turn's stop tokens and the model's other ends of
        sequence, which its template does not write (Qwen2.5's <|endoftext|> beside <|im_end|>, Llama 3.1's
        <|end_of_text|>): a reply the engine ended at one leaves its log-probability out as its text, and a
        turn that runs past them (ignore_eos) keeps them out of its content."""
        self._message_ends = frozenset(self.stop_token_ids) - frozenset(opening) | frozenset(
            vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] < engine.vocab_size)
        """Tokens that end a message, a format's that end no turn too (harmony's <|end|>): where
        `continues` finds the messages of a state's last reply."""
        self.control = control  # what contents never turn into
        self.words = prompt.markup_words(engine.tokenizer)  # what tools' contents never turn into
        self.word_ids = frozenset(vocab[t] for t in self.words if t in vocab)
        self.control_ids = frozenset(vocab[t] for t in self.control if t in vocab)
        self.added_tokens = frozenset(t for t in (*self.control, *self.words) if t in vocab)
        """The text of every added token, special or not, that the detokenizer marks where the model
        generates it (`GeneratedText.added_tokens`: a call's opening tag is read there only)."""
        self._plain: dict[str, Callable[[str], list[int]]] = {}   # built on first hostile content, shared by `on`
        self._token_bytes: Callable[[int], bytes] | None = None  # a token id's raw bytes (`_raw_bytes`), once used
        self._spelt: dict[int, tuple[str, bytes]] = {}  # token id -> its text and bytes in logprobs, as first spelt
        self._roles: dict[str, bool] = {}     # roles outside KNOWN_ROLES: whether the template renders them
        self._tools_rendered: bool | None = None  # whether the template renders tools (probed on first use)
        self._results_rendered: bool | None = None  # whether it renders tool results (probed on first use)
        self._floor: list[TokenFloor | None] = []  # `token_floor` of the tokenizer, once found: shared by `on`
        self._lead: list[int | None] = []  # the special token markup past the text's start follows (`_resumed`), once
        self._opening: list[str] = []  # what the template writes before a reply (`_reply_opening`), once
        self._openings: list[tuple[str, ...]] = []  # where a reply starts (`_reply_openings`), once
        self._gap: list[str | None] = []  # what the template writes between a think block and the answer, once
        # found: a list that the copies `on` makes share
        self._unasked: list[bool] = []  # whether the template asks for thinking unswitched (`_thinks_unasked`), once
        self.handle: StateHandle | None = engine.open_state(state_id) if state_id is not None else None
        self.think_markers = turn.think_markers(str(template), vocab)
        """The marks of its think blocks: Qwen's `<think>`, or Mistral's `[THINK]` control tokens."""
        self.thinks = self.think_markers.close in str(template)
        """Whether the chat template knows think blocks (a reasoning model): turns are split into
        thinking and answer (`turn.Thinking`)."""
        self._switches_thinking = "enable_thinking" in str(template)  # Qwen3's switch: reasoning=False honoured
        # or a thinking budget, which a budget of 0 switches off (Seed-OSS's: its prompt then opens the block,
        # where the model says it will not think, and answers)
        self._budget_switch = not self._switches_thinking and "thinking_budget" in str(template)
        self._switches_thinking = self._switches_thinking or self._budget_switch
        self._prompted_thinking = _default_prompt_thinks(str(template), self.think_markers.open)

    def on(self, handle: "StateHandle") -> "Chat":
        """This chat layer on another state (template, parser and stop tokens shared)."""
        chat = copy.copy(self)
        chat.handle = handle
        return chat

    # --- which state serves a call ------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, prompt: "str | TokenIds", state_id: str | None = None, *, fallback: bool = False,
              reasoning_history: str = "template") -> Iterator["Chat"]:
        """This chat layer on the state that serves one call, held until the block ends, so that
        concurrent calls never share a state. `prompt` is the call's rendered text (or its token
        ids). The state:
          1. `state_id`, when given; StateBusyError while another call holds it, unless
             `fallback`: then the choice below;
          2. else an idle state made for an earlier call that named none, when the prompt
             continues its conversation (`continues`; of the `CANDIDATES` states sharing the
             longest token prefixes with it);
          3. else a new one, which still shares every full KV block of a common prefix."""
        ids = self.prompt_tokens(prompt)
        if len(ids) > self.engine.max_model_len:  # refused before a state is leased, or made
            raise ContextLengthError(f"{len(ids)} tokens exceed the model's context of {self.engine.max_model_len}; "
                                     "shorten the history")
        with contextlib.ExitStack() as stack:
            handle = self._lease(stack, state_id, busy_ok=fallback) if state_id is not None else None
            if handle is None and state_id is not None:  # (a fan-out's other calls) why it is not that one
                logger.info("state %s is serving another call; this call goes to another state", state_id)
            if handle is None:
                handle = self._lease_continued(stack, ids, prompt, reasoning_history)
            if handle is None:  # a new state: a call that fails leaves none behind
                handle = stack.enter_context(self.engine.lease())
                stack.callback(_close_if_empty, handle)
            yield self.on(handle)

    def _lease_continued(self, stack: contextlib.ExitStack, ids: list[int], prompt: "str | TokenIds",
                         reasoning_history: str) -> "StateHandle | None":
        """The first of the states sharing the longest token prefixes with `ids` whose conversation
        the prompt continues, leased; None if none. Not only the first: a re-rendered reply can
        tokenize otherwise than it was generated, so the state of this conversation may share
        fewer tokens than a branch of it that an edited turn made."""
        for match in self.engine.registry.matches(ids, self.CANDIDATES, unnamed=True):
            try:
                held, turn_start = self.engine.registry.held(match)
            except StateClosedError:  # closed meanwhile (unnamed states over their bound close)
                continue
            if self.continues(held, prompt, reasoning_history, turn_start):
                handle = self._lease(stack, match.id, busy_ok=True)
                if handle is not None:  # else taken meanwhile
                    return handle
        return None

    def _last_reply_start(self, held: Sequence[int]) -> int:
        """Where a state's last reply starts where no token ends a message (GLM-4.5's messages end where the next
        begins, at its <|user|> or <|observation|>): after the last reply opening among its tokens (GLM's
        <|assistant|>); the whole state where none is found."""
        opening = self._reply_opening()
        ids = self.engine.tokenizer.encode(opening, add_special_tokens=False) if opening else []
        for start in range(len(held) - len(ids), -1, -1) if ids else ():
            if held[start] == ids[0] and list(held[start:start + len(ids)]) == ids:
                return start + len(ids)
        return len(held)

    def _lease(self, stack: contextlib.ExitStack, state_id: str, busy_ok: bool) -> "StateHandle | None":
        try:
            return stack.enter_context(self.engine.lease(state_id=state_id))
        except StateBusyError:  # Engine.lease only raises; the proposed `if_busy` would not
            if busy_ok:
                return None
            raise

    def continues(self, held: Sequence[int], prompt: "str | TokenIds", reasoning_history: str = "template",
                  turn_start: int | None = None) -> bool:
        """Whether `prompt` (rendered text, text after its lead, or token ids) goes on from a state's
        conversation: holds it up to its last reply, which a re-render may spell differently (a
        `LedText`: the state's text past the lead it holds, which a re-tokenized reply's seam or
        byte-fallback pieces leave as it is). Taking over a state that merely shares the system
        prompt and tools would throw another conversation away. Replies whose thinking the
        template left out are this conversation's under either policy (under "template"
        `prompt_ids` recomputes from the first dropped block; a new state left this one behind,
        unused, at every user turn after a tool loop): `reasoning_history` changes nothing.

        Where no message ends before the last reply (a text completion's state), the prompt holds
        it up to where its last generation began (`turn_start`, `StateRegistry.held`): the reply
        is the client's to end, as it got it (its EOS, and a stop string's tokens, it never saw)
        or edited."""
        ends = [i + 1 for i, token in enumerate(held) if token in self._message_ends]
        if ends and ends[-1] == len(held):
            ends.pop()  # the end of the last reply
        opening = self._reply_opening().lstrip()
        decode = self.engine.tokenizer.decode
        while opening and len(ends) > 1 and decode(held[ends[-2]:ends[-1]], skip_special_tokens=False).lstrip() \
                .startswith(opening):
            ends.pop()  # an earlier message of the last reply (gpt-oss's analysis, which its template drops)
        needed = ends[-1] if ends else min(self._last_reply_start(held), len(held) if turn_start is None else turn_start)
        if isinstance(prompt, TokenIds):
            return list(prompt[:needed]) == list(held[:needed])
        lead = _lead_of(prompt)  # a text after its lead: the state's text is what follows the lead it holds
        if tuple(held[:len(lead)]) != lead:
            return False
        held_text = decode(held[len(lead):needed], skip_special_tokens=False)
        if needed == len(held) and held_text.endswith(LOSSY):  # a reply that max_tokens cut inside a character:
            # its text, as its client got it, ends before that character's first bytes
            held_text = decode(held[len(lead):finished_end(held, self._raw_bytes())], skip_special_tokens=False)
        if self._spells(held[len(lead):needed], prompt, held_text) >= 0:
            return True
        return self.thinks and self._without_thinking(prompt)[0].startswith(self._without_thinking(held_text)[0])

    # --- rendering ----------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               reasoning: bool | None = None) -> list[int]:
        """Prompt token ids: the conversation plus the assistant's generation prompt."""
        return self._encode(self.render_text(messages, tools, reasoning))

    def _refuse_thinking_off(self, asked_by_effort: bool) -> None:
        """Thinking off asked of a reasoning model whose chat template has no switch for it (reads no
        `enable_thinking`): the template would render the prompt as ever and the model think all the
        same, so the request is refused rather than quietly not done."""
        asked = "reasoning_effort 'none'" if asked_by_effort else "reasoning=False"
        how = (f"; its default system prompt asks for the thinking ({self.think_markers.open}...), and a system "
               "message of your own replaces it, which may make it think less but switches nothing off"
               if self._prompted_thinking else ", as it was trained to")
        raise ConfigError(f"{asked}: this model's chat template has no switch for thinking (it reads no "
                          f"enable_thinking), so the model would think all the same{how}. Leave reasoning unset: "
                          "the thinking comes apart from the answer as the reply's reasoning")

    def _thinks_unasked(self) -> bool:
        """Whether the chat template's prompt asks for the thinking where nothing switches it (its default
        system prompt, Magistral's; its generation prompt opening the block, DeepSeek-R1's): where it does
        not, as Granite 3.3's that asks only under its own `thinking` flag, the model does not think
        unless asked, and thinking off is what it does. A template that refuses the probe: assumed to."""
        if not self._unasked:
            text = self._probe([{"role": "user", "content": "hi"}], add_generation_prompt=True)
            self._unasked.append(text is None or self.think_markers.open in text)
        return self._unasked[0]

    def render_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    reasoning: bool | None = None, *, effort: str | None = None) -> prompt.Prompt:
        """The rendered prompt; message contents that hold control-token text are marked as such
        (`hibana_core.prompt`), so that they are tokenized as plain text. `reasoning` goes to the
        template as `enable_thinking` (Qwen3's switch), False to one that reads a `thinking_budget`
        instead as a budget of 0 (Seed-OSS's); None leaves the template's default.
        `effort` (OpenAI's reasoning_effort level) goes as `reasoning_effort`: gpt-oss's harmony
        template writes it into its system message; templates without it ignore it."""
        if not self._templated:
            raise ConversationError("this checkpoint's tokenizer has no chat template, so a conversation cannot be "
                                    "rendered; give it one (a chat_template.jinja, or chat_template in "
                                    "tokenizer_config.json), or pass a rendered prompt string or token ids")
        kwargs = {"chat_template": self.template} if self.template else {}
        if effort is not None:
            if not isinstance(effort, str):
                raise ConfigError(f"effort must be a reasoning_effort level (a string) or None, got {effort!r:.80}")
            if effort == "none" and not (self._efforts and "none" in self._efforts):  # OpenAI's: no reasoning
                if reasoning:
                    raise ConfigError("reasoning_effort 'none' and reasoning=True disagree; give one of them")
                reasoning = False
            elif self._efforts is not None and effort not in self._efforts:  # the template would write it as it is
                raise ConfigError(f"reasoning_effort {effort!r:.40} is no level of this model's; its levels are "
                                  f"{', '.join(self._efforts)}")
            elif self._efforts is None and effort not in REASONING_EFFORTS:
                raise ConfigError(f"reasoning_effort {effort!r:.40} is no reasoning_effort level; use one of "
                                  f"{', '.join(REASONING_EFFORTS)}")
            elif reasoning is False:  # a level asks for thinking (as `hibana serve` refuses the pair)
                raise ConfigError(f"reasoning_effort {effort!r:.40} and reasoning=False disagree; give one of them "
                                  "(reasoning_effort 'none' switches thinking off)")
            else:
                kwargs["reasoning_effort"] = effort
        if reasoning is not None:
            if not isinstance(reasoning, bool):
                raise ConfigError(f"reasoning must be True, False or None, got {reasoning!r:.80}")
            if not reasoning and self._always_thinks:  # the template would think at its default level
                raise ConfigError("this model always reasons; its thinking cannot be switched off"
                                  + (f" (its least reasoning_effort is {self._efforts[0]!r})" if self._efforts else ""))
            if not reasoning and self.thinks and not self._switches_thinking and self._thinks_unasked():
                self._refuse_thinking_off(asked_by_effort=effort == "none")
            kwargs["enable_thinking"] = reasoning
            if not reasoning and self._budget_switch:
                kwargs["thinking_budget"] = 0

        messages, tools = normalize_messages(messages), normalize_tools(tools)
        check_tool_results(messages)  # the caller's messages, before a format rewrites them, and on the ids
        messages = self._prepared(messages)  # the caller sent, before they take the template's length
        if self._id_length is not None:
            messages = _with_template_ids(messages, self._id_length)
        if tools:  # OpenAI's description is optional; templates (gpt-oss's) read it unguarded
            tools = [t if "description" in t["function"] else {**t, "function": {**t["function"], "description": ""}}
                     for t in tools]
        for i, role in enumerate(m["role"] for m in messages):
            if role not in KNOWN_ROLES and not self._renders_role(role):
                raise ConversationError(f"message {i} has role {role!r}, which the chat template does not render "
                                        f"(it would be dropped); use one of {sorted(KNOWN_ROLES)}")
        if any(m["role"] == "tool" for m in messages) and not self.renders_tool_results():
            raise ConversationError(
                "this model's chat template does not render tool results (Phi-3's drops them): the model would "
                "not see them. Send each result as a user message, or give the model a template that renders them")
        if tools and not self.renders_tools():
            raise ConversationError(
                "this model's chat template does not render tools (Gemma 3's and Phi-3's do not): the model would "
                "not see them, yet be made to call one. Give it a template that does (the tokenizer's "
                "chat_template, or a chat format registered through register_chat_formats for its model_type), "
                "or call without tools and describe them in the system message")
        for what, value, error in [*((f"message {i}", m, ConversationError) for i, m in enumerate(messages)),
                                   *((f"tool {i}", t, ToolSchemaError) for i, t in enumerate(tools or ()))]:
            try:
                dumped = json.dumps(value, ensure_ascii=False, default=str)
            except (ValueError, RecursionError) as exc:  # a cycle
                raise error(f"{what} is not plain data ({exc}); pass strings, lists and dicts") from None
            check_text(dumped, what, error)

        def template(messages: list[dict], tools: list[dict] | None) -> str:
            try:
                return self.engine.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
            except Exception as exc:  # jinja raises many types for a conversation it rejects
                whose = f"{self._format}'s template" if self._format and self.template else "the chat template"
                raise ConversationError(f"cannot render the conversation with {whose}: {exc}") from exc
        return prompt.render(template, messages, tools, self.control, self.words)

    def _prepared(self, messages: list[dict]) -> list[dict]:
        """`messages` after the chat format's prepare_messages; what it raises but a HibanaError (a
        refusal of the conversation is a ConversationError), or a result that is no list of
        messages, is a ConfigError naming the format."""
        try:
            prepared = self._prepare(messages)
        except HibanaError:
            raise
        except Exception as exc:
            raise ConfigError(f"{self._format} failed in prepare_messages: {exc!r}; fix its plugin") from exc
        if not isinstance(prepared, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in prepared):
            raise ConfigError(f"{self._format} returned {type(prepared).__name__} {prepared!r:.80} from "
                              "prepare_messages, not a list of messages (dicts with a role); fix its plugin")
        return prepared

    def _check_compiles(self, template: str) -> None:
        """A ConfigError naming the chat format unless its template compiles, in the Jinja
        environment transformers renders with: a probe is rendered (a template that refuses the
        probe's conversation compiled all the same)."""
        import jinja2

        try:
            self.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                                      add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"{self._format} has a template that is no valid Jinja ({exc.message}, line "
                              f"{exc.lineno}); fix its plugin") from exc
        except Exception:  # noqa: BLE001 - it compiled; what it says of the probe is no fault of its own
            pass

    def count_tokens(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                     reasoning: bool | None = None, *, effort: str | None = None) -> int:
        """Prompt tokens of a call on `messages` and `tools`, as the model's chat template renders
        them (the generation prompt included; `reasoning` and `effort` as `render_text` takes them).
        Part of a conversation that the template or the checks refuse (a tool result without its
        call, as `trim_messages` tries) counts each message's text and calls, plus the markup the
        template puts around one message, plus the tools as the template writes them."""
        try:
            return len(self._encode(self.render_text(messages, tools, reasoning, effort=effort)))
        except ConversationError:
            pass
        probe = [{"role": "user", "content": "x"}]
        overhead = len(self.render(probe)) - len(self._markup("x"))
        try:  # the template's own words around the schemas too (the demo's "# Tools ..." system block)
            tool_count = len(self.render(probe, tools)) - len(self.render(probe)) if tools else 0
        except ConversationError:  # a template that renders no tools: their JSON
            tool_count = len(self._markup(json.dumps(list(tools), ensure_ascii=False)))
        # (default=str: calls whose arguments JSON cannot hold, which a call refuses, still count)
        texts = [json.dumps(m.get("tool_calls"), ensure_ascii=False, default=str) + str(m.get("content") or "")
                 if m.get("tool_calls") else str(m.get("content") or "") for m in messages]
        return tool_count + sum(len(self._markup(t)) + overhead for t in texts)

    def renders_tools(self) -> bool:
        """Whether the chat template writes the tools it is given (templates without a tools
        section drop them without a word)."""
        if self._tools_rendered is None:
            probe = {"type": "function", "function": {"name": "hibana_tool_probe", "description": "A probe.",
                                                      "parameters": {"type": "object", "properties": {}}}}
            self._tools_rendered = self._writes("hibana_tool_probe", [{"role": "user", "content": "hi"}],
                                                tools=[probe], add_generation_prompt=True)
        return self._tools_rendered

    def renders_tool_results(self) -> bool:
        """Whether the chat template writes a tool's result (Phi-3's drops tool messages without a
        word). A template that refuses the probe is taken to render them: the call's own render
        then says what it refuses."""
        if self._results_rendered is None:
            call = {"id": "hibanaprb", "type": "function", "function": {"name": "hibana_tool_probe", "arguments": {}}}
            text = self._probe([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "hibanaprb", "content": "hibana-result-probe"}],
                               add_generation_prompt=True)
            self._results_rendered = text is None or "hibana-result-probe" in text
        return self._results_rendered

    def _renders_role(self, role: str) -> bool:
        """Whether the chat template writes a message of `role` (templates drop roles they do not
        know without a word)."""
        renders = self._roles.get(role)
        if renders is None:
            renders = self._writes("hibana-role-probe", [{"role": "user", "content": "hi"},
                                                         {"role": role, "content": "hibana-role-probe"}])
            if len(role) <= ROLE_CACHED_LENGTH:  # roles are the caller's words: a server's clients send any
                if len(self._roles) >= ROLES_CACHED:
                    self._roles.clear()
                self._roles[role] = renders
        return renders

    def _without_thinking(self, text: str) -> tuple[str, list[int]]:
        """`text` without the think blocks that open an assistant's reply (what a template that
        drops old thinking leaves out; a think block a user or a tool wrote stays: an edit in it
        is an edit of the conversation), and for each character left its index in `text`."""
        return _without_thinking(text, self._reply_openings(), self.think_markers)

    def _reply_opening(self) -> str:
        """What the template writes before an assistant's reply (Qwen's "<|im_start|>assistant\n"):
        the generation prompt, up to a think block it may open; "" where the template does not
        say (then no thinking is left out)."""
        if not self._opening:
            hello = [{"role": "user", "content": "hibana-opening-probe"}]
            bare, asked = (self._probe(hello, add_generation_prompt=g) or "" for g in (False, True))
            opening = asked[len(bare):] if bare and asked.startswith(bare) else ""
            self._opening[:] = [opening.split(self.think_markers.open)[0]]
        return self._opening[0]

    def _reply_openings(self) -> tuple[str, ...]:
        """Where an assistant's reply starts: after the generation prompt (`_reply_opening`), or where
        the template writes none (Mistral's: a reply follows [/INST] or [/TOOL_RESULTS]), after what it
        writes at the end of a user's message and of a tool's result; () where it does not say."""
        opening = self._reply_opening()
        if opening or not self.thinks:
            return (opening,) if opening else ()
        if not self._openings:
            call = {"id": "abcdefghi", "type": "function", "function": {"name": "f", "arguments": {}}}
            probes = [[{"role": "user", "content": "hibana-opening-probe"}],
                      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "abcdefghi", "content": "hibana-opening-probe"}]]
            texts = (self._probe(messages, add_generation_prompt=True) or "" for messages in probes)
            self._openings.append(tuple(dict.fromkeys(  # what follows the probe's text, up to a think block
                tail for text in texts if "hibana-opening-probe" in text
                for tail in [text.rsplit("hibana-opening-probe", 1)[1].split(self.think_markers.open)[0].strip()]
                if tail)))
        return self._openings[0]

    def answer_gap(self) -> str:
        """What the chat template writes between a reply's think block and its answer (Qwen3's blank
        line, GLM-4.5's newline; "\n\n" where it does not say: a template that renders no
        `reasoning_content`): what a forced call or a held answer follows, so that the reply is
        written as its history renders it."""
        gap = self._written_gap()
        return "\n\n" if gap is None else gap

    def _written_gap(self) -> str | None:
        """`answer_gap` as the template writes it; None where it does not say."""
        if not self._gap:
            probe = [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hibana-answer-probe", "reasoning_content": "hibana-think-probe"}]
            text, close = self._probe(probe) or "", self.think_markers.close
            end = text.find(close, text.find("hibana-think-probe")) if "hibana-think-probe" in text else -1
            answer = text.find("hibana-answer-probe", end) if end >= 0 else -1
            gap = text[end + len(close):answer] if answer >= 0 else None
            self._gap.append(gap if gap is not None and not gap.strip() else None)
        return self._gap[0]

    def _after_closed_block(self, prompt_end: str) -> str:
        """What the model writes first where the template closed the think block in the prompt
        (`prompt_end`: the prompt's last text): the gap the template writes after a block but what the
        prompt wrote of it; nothing where the template does not say (DeepSeek-V3.1's bare </think>,
        after which the answer follows at once)."""
        after, gap = prompt_end[len(prompt_end.rstrip()):], self._written_gap()
        return gap[len(after):] if gap is not None and gap.startswith(after) else ""

    def _writes(self, marker: str, messages: list[dict], **options: Any) -> bool:
        """Whether the chat template, rendering `messages` (and `options`), writes `marker`."""
        text = self._probe(messages, **options)
        return text is not None and marker in text

    def _probe(self, messages: list[dict], **options: Any) -> str | None:
        """The chat template's text of a probe's `messages` (and `options`); None where it refuses them."""
        kwargs = {"chat_template": self.template} if self.template else {}
        try:
            return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, **options, **kwargs)
        except Exception:  # noqa: BLE001 - a template that refuses the probe says nothing of it
            return None

    def prompt_ids(self, messages: "Sequence[dict] | str | TokenIds", tools: Sequence[dict] | None = None,
                   reasoning_history: str = "template") -> list[int]:
        """What `respond` syncs: the rendered prompt (`messages` may be rendered text already, or text
        after its lead, `LedText`; token ids are the prompt as they are), except that the state's
        own tokens are kept up to the last end-of-turn token where they still spell the prompt's
        text (a `LedText`'s past the lead the state holds), and only the rest is tokenized. A
        model may spell a word in other tokens than the tokenizer would (an unseen name copied
        piece by piece); re-tokenizing would recompute everything after it. Held tokens are never
        kept where one of their control tokens would stand for a message content's text.

        `reasoning_history="generated"`: held tokens are also kept where they spell the prompt's
        text once think blocks are left out of both (a template that drops old thinking), so the
        model's earlier thinking stays in the state (`REASONING_HISTORY`); not where a message
        content holds control-token text."""
        if isinstance(messages, TokenIds):
            return self.prompt_tokens(messages)
        if isinstance(messages, str):
            check_text(messages, "the prompt")
        text = messages if isinstance(messages, str) else self.render_text(messages, tools)
        lead = _lead_of(text)  # a text after its lead (`LedText`): the state's tokens past the lead it holds
        held = self.handle.tokens if self.handle is not None else []
        held = held[len(lead):] if tuple(held[:len(lead)]) == lead else []
        ends = [i + 1 for i, token in enumerate(held) if token in self._reply_ends]
        generated = reasoning_history == "generated" and self.thinks and not prompt.spans_of(text)
        stripped, positions = self._without_thinking(text) if generated else (text, [])
        for end in reversed(ends):  # usually the last one matches: the previous reply, unchanged
            held_text = self.engine.tokenizer.decode(held[:end], skip_special_tokens=False)
            if LOSSY in held_text:  # bytes no text holds (a character cut) decode as it: they spell another text
                continue
            at = self._spells(held[:end], text, held_text)
            if at >= 0 and self._controls_are_markup(held[:end], text):
                kept = end
                if end == ends[-1]:
                    kept, at = self._stopped_reply(held, end, text, at)
                return [*lead, *held[:kept], *self._encode_fitting(text, at, len(lead) + kept, held[kept - 1])]
            bare = self._without_thinking(held_text)[0] if generated else ""
            if bare and stripped.startswith(bare):  # the prompt left this reply's thinking out
                return [*lead, *held[:end], *self._encode_fitting(text, positions[len(bare) - 1] + 1, len(lead) + end,
                                                                  held[end - 1])]
        return [*lead, *self._encode_fitting(text, kept=len(lead))]

    def _spells(self, tokens: Sequence[int], text: str, spelled: str) -> int:
        """How much of `text` a state's `tokens` spell, `spelled` being their decoded text and the
        tokens a text's first (past its lead); -1 where the text does not begin with them. A decoder
        may drop whitespace from a text's start: SentencePiece's dummy prefix makes " the" and
        "the" both begin "▁the", which decodes as "the", and "  two" begin "▁", "▁t", which decodes
        as " two" (and " two" itself begins "▁t"). So where the text begins with whitespace, the
        tokens spell it only if its head, through its first piece of more than whitespace, encodes
        to their head again (a run of lone-space tokens would otherwise match a run one longer)."""
        if not tokens:
            return 0
        blank = len(text) - len(text.lstrip())
        extra = blank - (len(spelled) - len(spelled.lstrip()))  # whitespace the decoder dropped
        if extra < 0 or not text.startswith(spelled, extra):
            return -1
        if blank:  # the tokens up to the first that spells more than whitespace must be the text's own
            decode = functools.partial(self.engine.tokenizer.decode, skip_special_tokens=False)
            first = next((i for i in range(min(len(tokens), HEAD_TOKENS)) if decode(tokens[:i + 1]).strip()), None)
            if first is None and len(tokens) > HEAD_TOKENS:
                return -1  # (a run of whitespace that long: not worth the encoding)
            upto = len(tokens) if first is None else first + 1
            head_text = decode(tokens[:min(upto + 1, len(tokens))])  # one token more where there is one: the
            if self._encode(text[:extra + len(head_text)])[:upto] != list(tokens[:upto]):  # compared ones end inside
                return -1
        return extra + len(spelled)

    def _stopped_reply(self, held: Sequence[int], end: int, text: str, at: int) -> tuple[int, int]:
        """How many of the state's tokens to keep, and where in `text` the rest starts, when the
        state's last reply (past `end`) stopped before its end-of-turn token: after its one call
        (parallel_tool_calls=False) or at max_tokens. Its tokens are kept where they spell the
        prompt's text up to the end-of-turn token the prompt closes that reply with, the engine's
        few tokens past the stop left out; else `end` and `at`."""
        closes = [i for i in (text.find(t, at) for t in self._end_texts) if i >= 0]
        if end == len(held) or not closes:
            return end, at
        want = text[at:min(closes)]
        if LOSSY in want:  # a cut character's bytes decode as it, and spell another text than the prompt's
            return end, at
        for kept in range(len(held), max(end, len(held) - RUN_PAST_STOP - 1), -1):  # RUN_PAST_STOP tokens at most
            got = self.engine.tokenizer.decode(held[end:kept], skip_special_tokens=False)
            if got == want and self._controls_are_markup(held[:kept], text):
                return kept, min(closes)
            if not got.startswith(want):
                break
        return end, at

    def _controls_are_markup(self, tokens: Sequence[int], text: str) -> bool:
        """Whether no control token of `tokens` stands where the prompt `text`'s content spans are
        in their text, nor a markup word's token where its word spans (a tool's contents) are."""
        spans = prompt.spans_of(text)
        if not spans:
            return True
        words = getattr(text, "word_spans", frozenset())
        decode = self.engine.tokenizer.decode
        pos, run = 0, []
        for token in tokens:
            control = token in self.control_ids
            if not control and (not words or token not in self.word_ids):
                run.append(token)
                continue
            pos += len(decode(run, skip_special_tokens=False)) if run else 0
            run = []
            if any(a <= pos < b for a, b in (spans if control else words)):
                return False
            pos += len(decode([token], skip_special_tokens=False))
        return True

    def prompt_tokens(self, prompt: "str | TokenIds") -> list[int]:
        """A call's prompt as token ids: rendered text tokenized (`_encode`; a `LedText` after its
        lead), or token ids checked as `StateHandle.sync` checks them (InvalidTokenError outside
        the vocabulary)."""
        if not isinstance(prompt, TokenIds):
            check_text(prompt, "the prompt")
            lead = _lead_of(prompt)
            return [*lead, *self._encode_fitting(prompt, kept=len(lead))]
        if len(prompt) > self.engine.max_model_len:  # before each id is checked (10M ids: seconds, twice)
            raise ContextLengthError(f"{len(prompt)} tokens exceed the model's context of {self.engine.max_model_len}; "
                                     "shorten the history (the state is unchanged)")
        bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise InvalidTokenError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, "
                                    f"{self.engine.vocab_size}); tokenize with this model's tokenizer")
        return list(prompt)

    def _encode(self, text: str, start: int = 0, after: int | None = None) -> list[int]:
        """Token ids of `text[start:]`: the template's markup as `apply_chat_template(tokenize=True)`
        encodes it (control tokens included), a Prompt's content spans as plain text; a piece past
        the text's start as the tokenizer tokenizes it after what precedes it (`after`: the state's
        token before `start`)."""
        if prompt.spans_of(text) and not self._plain:
            self._plain["encode"] = prompt.plain_encoder(self.engine.tokenizer)
        if getattr(text, "word_spans", None) and "words" not in self._plain:  # a tool's content: no added token
            self._plain["words"] = prompt.plain_encoder(self.engine.tokenizer, words=True)
        ids = prompt.encode(text, start, self._markup, self._plain.get("encode"), self._plain.get("words"),
                            lambda encoder, at: self._resumed(encoder, after if at == start else None))
        if ids and max(ids) >= self.engine.vocab_size:  # the tokenizer and the checkpoint disagree
            past = sorted({t for t in ids if t >= self.engine.vocab_size})
            texts = self.engine.tokenizer.convert_ids_to_tokens(past[:5])
            raise InvalidTokenError(
                f"the prompt's text tokenizes to ids past the model's vocabulary of {self.engine.vocab_size}: "
                f"{', '.join(f'{t!r} ({i})' for t, i in zip(texts, past))}; the tokenizer has tokens the "
                "checkpoint's embeddings do not (a tokenizer from another checkpoint, or tokens added without "
                "resizing the model): give the checkpoint its own tokenizer")
        return ids

    def _encode_fitting(self, text: str, start: int = 0, kept: int = 0, after: int | None = None) -> list[int]:
        """`_encode(text, start)` for a prompt that follows `kept` tokens of the state; a text too
        long to fit the context whatever its tokens (`token_floor`) is refused before it is
        tokenized (a 6 MB tool result took seconds to tokenize only to be refused)."""
        limit = self.engine.max_model_len
        if len(text) - start > limit:  # (else no bound could refuse it)
            if not self._floor:
                self._floor.append(token_floor(self.engine.tokenizer))
            floor = self._floor[0]
            least = kept + floor.least(text[start:]) if floor is not None else 0
            if least > limit:
                raise ContextLengthError(f"the prompt is at least {least} tokens ({len(text) - start} characters), "
                                         f"more than the model's context of {limit}; shorten the history "
                                         "(the state is unchanged)")
        return self._encode(text, start, after)

    def _resumed(self, encoder: prompt.Encoder, after: int | None) -> prompt.Encoder:
        """`encoder` for a piece that follows other tokens (`prompt.resumed`): a plain encoder after
        its own lead token; the markup after `after` where that is a control token or markup word
        (so that its rstrip takes what it takes in the whole text), else after a special token
        that strips nothing."""
        if encoder != self._markup:
            return getattr(encoder, "resumed", encoder)
        if after not in self.control_ids and after not in self.word_ids:
            if not self._lead:
                decoder = getattr(self.engine.tokenizer, "added_tokens_decoder", None) or {}
                self._lead.append(next((i for i, t in sorted(decoder.items()) if t.special and not t.lstrip
                                        and not t.rstrip and self._markup(t.content) == [i]), None))
            after = self._lead[0]
        if after is None:
            return encoder
        return prompt.resumed(encoder, self.engine.tokenizer.decode([after], skip_special_tokens=False), [after])

    def ended_at_context(self, result: ChatResult) -> bool:
        """Whether the model's context, not max_tokens, ended a reply ("length"): what to say of a
        call it cut (shorten the history, rather than raise max_tokens)."""
        used = result.usage.prompt_tokens + result.usage.completion_tokens
        return result.finish_reason == "length" and used >= self.engine.max_model_len

    def cut_call_parts(self, cut_call: str, tools: list[dict] | None = None) -> tuple[str, str]:
        """(the name, the arguments) a call that max_tokens cut off had begun (`ChatResult.cut_call`,
        or a delta's text with `cut_call`), the arguments as JSON text so far, where the tool
        parser's call syntax is known (or the parser reads its own: mistral's, granite's and
        qwen3_coder's, `cut_call_parts`; a parser that `takes_tools` is given the turn's `tools`,
        which type its values): what an adapter reports as an invalid call, and a structured answer
        (the call's arguments as content) shows of a reply cut short; ("", "") for what it has not
        reached."""
        own = getattr(self.parser, "cut_call_parts", None)
        if callable(own):
            if not cut_call:
                return "", ""
            return own(cut_call, list(tools or ())) if getattr(self.parser, "takes_tools", False) else own(cut_call)
        syntax = getattr(self.parser, "call_syntax", None) or turn.SYNTAX.get(self.parser_name)
        if not cut_call or syntax is None:
            return "", ""
        opener = getattr(syntax, "opener_token", "")  # Llama 3's <|python_tag|> may open the calls
        head, mid, arguments = cut_call.lstrip().removeprefix(opener).partition(syntax.mid)
        if not head.startswith(syntax.open):
            return "", ""
        name = head.removeprefix(syntax.open)
        if not mid:  # cut inside the markup after the name: what of it was written goes
            written = next((k for k in range(len(syntax.mid), 0, -1) if name.endswith(syntax.mid[:k])), 0)
            name = name[:len(name) - written]
        return name, arguments

    def cut_arguments(self, cut_call: str, tools: list[dict] | None = None) -> str:
        """The arguments of `cut_call_parts`."""
        return self.cut_call_parts(cut_call, tools)[1]

    def openai_logprobs(self, result: ChatResult) -> list[dict] | None:
        """A result's token log-probabilities in OpenAI's shape (`choices[0].logprobs.content`):
        per token {"token", "bytes", "logprob", "top_logprobs": [{"token", "bytes", "logprob"}]};
        None when the call did not ask for them. The end-of-turn token that closed the reply is
        left out, as its text is."""
        if result.logprobs is None:
            return None
        logprobs = result.logprobs
        if logprobs and result.finish_reason != "length" and logprobs[-1].token_id in self.closing_token_ids:
            logprobs = logprobs[:-1]
        return self.openai_token_logprobs(logprobs)

    def openai_token_logprobs(self, logprobs: "Sequence[TokenLogprob]") -> list[dict]:
        """Token log-probabilities in OpenAI's shape, as `openai_logprobs` gives a result's (a
        streamed delta's: `ChatDelta.logprobs`)."""
        tokenizer = self.engine.tokenizer
        raw = self._raw_bytes()

        def entry(token_id: int, logprob: float) -> dict:
            if token_id not in self._spelt:  # (a decode each: 1,000 tokens' top 20 took 1.9 s of 2.6)
                self._spelt[token_id] = (tokenizer.decode([token_id], skip_special_tokens=False), raw(token_id))
            text, spelt = self._spelt[token_id]
            return {"token": text, "bytes": list(spelt), "logprob": logprob}
        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in logprobs]

    def _raw_bytes(self) -> Callable[[int], bytes]:
        """A token id's raw bytes (`token_bytes`), built on first use."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes(self.engine.tokenizer)
        return self._token_bytes

    def _markup(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    # --- one assistant turn -------------------------------------------------------------------

    def respond(self, messages: "Sequence[dict] | str | TokenIds", tools: Sequence[dict] | None = None,
                params: SamplingParams | None = None, **options: Any) -> ChatResult:
        """Render, sync the state, generate one assistant turn, parse its tool calls. `options`
        are those of `stream_respond`."""
        _check_turn_options(options)
        *_, last = turn.run(self.opener(messages, tools, params, **options), turn.result_of)
        return last

    async def arespond(self, messages: "Sequence[dict] | str | TokenIds", tools: Sequence[dict] | None = None,
                       params: SamplingParams | None = None, **options: Any) -> ChatResult:
        _check_turn_options(options)
        return [r async for r in turn.arun(self.opener(messages, tools, params, **options), turn.result_of)][-1]

    def stream_respond(self, messages: "Sequence[dict] | str | TokenIds", tools: Sequence[dict] | None = None,
                       params: SamplingParams | None = None, **options: Any) -> Iterator[ChatDelta]:
        """Text deltas and tool-call deltas as they are generated; the last item carries the
        ChatResult. Closing the iterator early cancels the generation. `options` are `opener`'s."""
        _check_turn_options(options)
        return turn.run(self.opener(messages, tools, params, **options))

    def astream_respond(self, messages: "Sequence[dict] | str | TokenIds", tools: Sequence[dict] | None = None,
                        params: SamplingParams | None = None, **options: Any) -> AsyncIterator[ChatDelta]:
        """`stream_respond` on the caller's event loop: awaits the engine, never blocks the loop."""
        _check_turn_options(options)
        return turn.arun(self.opener(messages, tools, params, **options))

    def opener(self, messages: "Sequence[dict] | str | TokenIds", tools: Sequence[dict] | None = None,
               params: SamplingParams | None = None, *, lease: bool = False, state_id: str | None = None,
               fallback: bool = False, prefill: str = "", parse_tools: bool = True, tool_choice: Any = "auto",
               parallel_tool_calls: bool = True, guided: bool = True, timeout: float | None = None,
               reasoning: bool | None = None, reasoning_effort: str | None = None,
               reasoning_history: str = "template") -> turn.Open:
        """How `turn.run` / `turn.arun` start one assistant turn: on this chat's state, or with
        `lease`, on the state `self.lease(messages, state_id, fallback=fallback)` picks (then
        `messages` is the rendered prompt), held until the turn ends.

        `messages` may be a rendered prompt, or token ids (`TokenIds`), continued as it is.
        `prefill` starts the assistant's turn with given text; `parse_tools=False` returns the text
        as generated (no grammar), as does a turn without tools: no call can name an offered tool.
        `tool_choice`: "auto" (the model may call), "none" (the tools are listed, a grammar keeps
        the model from opening a call, and the output is never read as calls), "required"/"any"
        (some call), or a tool's name (one call of it); a grammar holds every call to an offered tool
        and, with `guided` (the default), its arguments to the tool's schema (`hibana_core.turn`). A `params.json_schema` beside
        tools holds the text answer, as OpenAI's response_format does: with "auto" the model calls
        tools or answers in JSON valid under it (`turn.answer_or_calls`). `params` with a regex or a
        grammar keep it and get no tool-call grammar.
        `parallel_tool_calls=False`: at most one call, in the stream as in the result.
        `timeout`: seconds; at the deadline the request is stopped (queued, prefilling or generating) and
        the call raises ChatTimeoutError, its state put back. `reasoning`: the template's `enable_thinking`
        (messages as dicts; a rendered prompt already says), `reasoning_effort` OpenAI's level, to a
        template that reads it (gpt-oss's; `render_text`'s `effort`). A reasoning model's thinking comes
        apart from the answer (`ChatResult.reasoning`, `ChatDelta.reasoning`); `reasoning_history`:
        `REASONING_HISTORY`."""
        choice = normalize_tool_choice(tool_choice, normalize_tools(tools))  # options are refused before a lease
        if params is not None and not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be SamplingParams or None, got {type(params).__name__}; "
                              "build one: SamplingParams(max_tokens=..., temperature=...)")
        if params is not None and params.max_tokens == 0:
            raise ConfigError("max_tokens=0 leaves a chat turn no reply; give 1 or more (a state handle's "
                              "generate with max_tokens=0 only takes its prompt in)")
        if not isinstance(prefill, str):
            raise ConfigError(f"prefill must be a string, got {type(prefill).__name__}")
        check_text(prefill, "prefill")
        forced = bool(tools) and parse_tools and choice not in ("auto", "none")
        own = params is not None and (params.regex is not None or params.grammar is not None)
        if forced and own:
            raise ConfigError(f"tool_choice={tool_choice!r:.60} asks for a tool call, and params' "
                              f"{'regex' if params.regex is not None else 'grammar'} takes the whole output: "
                              "give one or the other")
        if prefill and (forced or (params is not None and params.constrained)):
            raise ConfigError("prefill with a grammar from the turn's first token (a json_schema, regex or grammar in "
                              "params, or a tool_choice that forces a call) is not supported: the grammar would "
                              "start after the prefill as if nothing were written; drop one of them")
        for name, value in (("lease", lease), ("fallback", fallback), ("parse_tools", parse_tools),
                            ("parallel_tool_calls", parallel_tool_calls), ("guided", guided)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r:.80}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ConfigError(f"timeout must be a number of seconds > 0, or None; got {timeout!r:.80}")
        if reasoning_history not in REASONING_HISTORY:
            raise ConfigError(f"reasoning_history must be one of {REASONING_HISTORY}, got {reasoning_history!r:.80}")
        if isinstance(messages, TokenIds):
            self.prompt_tokens(messages)  # refused before a lease
        elif not isinstance(messages, str):
            messages = self.render_text(messages, tools, reasoning, effort=reasoning_effort)

        def open_turn(stack: contextlib.ExitStack) -> "tuple[turn.TurnRun, StateHandle]":
            chat = (stack.enter_context(self.lease(messages, state_id, fallback=fallback,
                                                   reasoning_history=reasoning_history)) if lease else self)
            run = chat._turn(messages, tools, params, prefill, parse_tools, tool_choice, parallel_tool_calls,
                             guided, timeout, reasoning_history)
            return run, chat.handle
        return open_turn

    def _turn(self, messages: "str | TokenIds", tools: Sequence[dict] | None, params: SamplingParams | None,
              prefill: str, parse_tools: bool, tool_choice: Any, parallel_tool_calls: bool, guided: bool,
              timeout: float | None, reasoning_history: str = "template") -> turn.TurnRun:
        if self.handle is None:
            raise HibanaError("this Chat has no state: give it one (Chat(engine, 'agent-1')), or serve "
                              "each call on a leased one (`with chat.lease(prompt) as c: c.respond(...)`)")
        tools = normalize_tools(tools)
        tool_choice = normalize_tool_choice(tool_choice, tools)
        parallel_tool_calls = parallel_tool_calls and not self.one_call  # a template of one call a message
        # a named tool: that one call (vLLM's named function calling, OpenAI's forced function), by a
        # grammar that ends the turn after it (the model writes its end of turn, as after any call)
        one_call = not parallel_tool_calls or tool_choice not in TOOL_CHOICE_MODES
        listed = tools  # "none" still lists them in the prompt
        if tool_choice == "none" or not tools:  # no tool offered: a call would name none, its text is content
            tools, parse_tools = None, False
        params = params or SamplingParams(max_tokens=256)
        # ignore_eos: the turn runs on past the end-of-turn tokens that are the model's end of sequence (as the
        # engine's generate and vLLM's chat do; a grammar still ends there where it allows nothing else)
        passed = [t for t in sorted(self.closing_token_ids) if params.ignore_eos and t in self.engine.eos_token_ids]
        ends = tuple(t for t in self.stop_token_ids if t not in passed)
        params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(tuple(params.stop_token_ids) + ends)))
        # a template may open the think block itself (its generation prompt ends in "<think>")
        end = (self.engine.tokenizer.decode(list(messages[-4:]), skip_special_tokens=False)
               if isinstance(messages, TokenIds) else str(messages))
        markers = self.think_markers
        opened = markers.opened(end)  # (Seed-OSS's with a budget of 0 opens a budget reflection in it too)
        open_in_prompt = opened is not None
        # or closes it (Qwen3's with thinking switched off writes an empty block): no thinking to hold a grammar off
        closed_in_prompt = end.rstrip().endswith(markers.close)
        thinking = turn.Thinking(open_in_prompt, closed_in_prompt, markers, opened or "") if self.thinks else None
        # or a prefill writes the block whole ("<think>\n\n</think>\n\n": no thinking this turn), so the
        # grammar starts after it, in the answer
        closed_by_prefill = (thinking is not None and not closed_in_prompt and markers.close in prefill
                             and (open_in_prompt or prefill.lstrip().startswith(markers.open)))
        held_off = thinking is not None and not closed_in_prompt and not closed_by_prefill  # a grammar waits for it
        # the template closed the block (thinking off): what it writes after a block and the prompt does not
        # (GLM-4.5's "<think></think>" leaves the model its "\n") comes first in a grammar that holds the turn's
        # first token (a prefill writes what follows the block itself)
        lead = self._after_closed_block(end) if thinking is not None and closed_in_prompt and not prefill else ""
        answer = params.json_schema if parse_tools and tools else None  # the text answer's schema, beside calls
        calls_held = False  # a call grammar holds the turn
        if parse_tools and (answer is not None or not params.constrained):
            with _blamed_on(self.parser_name, self.parser, "building its call grammar"):
                if answer is None:
                    # a prefill may have opened a call the grammar never saw (it starts after the prefill,
                    # in free text): that call's closing tag stays writable
                    grammar = turn.parser_grammar(self.parser, self.parser_name, tools, tool_choice,
                                                  parallel=not one_call, strict=guided, closer=not prefill,
                                                  tokens=self.added_tokens)
                    if grammar is None and tool_choice != "auto":
                        raise ToolChoiceError(
                            f"tool_choice={tool_choice!r} asks for a call, and the {self.parser_name} tool parser "
                            f"({describe_registered(self.parser)}) has no call syntax Hibana can hold the turn to "
                            "(neither call_syntax nor tool_call_grammar): the model would be free to answer in "
                            "text; use tool_choice='auto', or give the parser a call_syntax")
                else:
                    grammar = turn.answer_or_calls(self.parser, self.parser_name, tools, tool_choice, answer,
                                                   parallel=not one_call, strict=guided,
                                                   strict_schema=params.strict_schema, tokens=self.added_tokens)
            from_start = answer is not None or tool_choice != "auto"  # the grammar holds the turn's first token
            if grammar is not None and held_off and grammar.get("type") == "structural_tag":
                # an answer in JSON follows the blank line after the think block, as a forced call does
                grammar = turn.after_thinking(grammar, "required" if answer is not None else tool_choice,
                                              open_in_prompt, markers, self.answer_gap())
            elif grammar is not None and from_start and lead and grammar.get("type") == "structural_tag":
                grammar = _led(grammar["format"], lead)
            if grammar is not None and prefill and not _free_start(grammar.get("format", {})):
                raise ConfigError(f"prefill with {self.parser_name}'s tool-call grammar is not supported: it holds the "
                                  "turn from its first token (a message header, a think block), and would start after "
                                  "the prefill as if nothing were written; drop the prefill, or the tools "
                                  "(parse_tools=False reads no calls)")
            if grammar is not None:
                params = dataclasses.replace(params, json_schema=None, grammar=grammar)
                calls_held = True
        elif tool_choice == "none" and listed and not params.constrained:  # the model sees tools it may not call
            with _blamed_on(self.parser_name, self.parser, "building its no-call grammar"):
                grammar = turn.no_call_grammar(self.parser, self.parser_name, closer=not prefill)
            if grammar is not None and held_off:  # the thinking stays free, as with "auto"
                grammar = turn.after_thinking(grammar, "auto", open_in_prompt, markers)
            params = dataclasses.replace(params, grammar=grammar)
        channels = getattr(self.parser, "splits_channels", False)  # harmony: its channels are the format, calls or not
        if params.json_schema is not None and answer is None and (channels or held_off or lead):
            # the answer's schema, held after the reasoning: a structural tag's JSON content, which drops
            # what the grammar cannot hold, so a strict schema is checked here as json_schema is
            if params.strict_schema:
                from hibana_core.grammar import check_held

                check_held(params.json_schema)
            if channels:
                with _blamed_on(self.parser_name, self.parser, "in answer_grammar"):
                    params = dataclasses.replace(params, json_schema=None,
                                                 grammar=self.parser.answer_grammar(params.json_schema))
            elif held_off:
                answer_only = {"type": "structural_tag",
                               "format": {"type": "json_schema", "json_schema": params.json_schema}}
                params = dataclasses.replace(params, json_schema=None, grammar=turn.after_thinking(
                    answer_only, "required", open_in_prompt, markers, self.answer_gap()))
            else:  # after what the template writes after its closed block
                params = dataclasses.replace(params, json_schema=None, grammar=_led(
                    {"type": "json_schema", "json_schema": params.json_schema}, lead))
        elif (held_off or lead) and not channels and (params.regex is not None or isinstance(params.grammar, str)) \
                and not calls_held:
            # a regex or an EBNF grammar of the caller's holds the answer after the thinking too, as vLLM
            # applies structured output after the reasoning (from the first token, the model could not think)
            own = ({"type": "regex", "pattern": params.regex} if params.regex is not None
                   else {"type": "grammar", "grammar": params.grammar})
            params = dataclasses.replace(params, regex=None, grammar=turn.after_thinking(
                {"type": "structural_tag", "format": own}, "required", open_in_prompt, markers, self.answer_gap())
                if held_off else _led(own, lead))
        if parse_tools or channels:
            options = {} if parse_tools else {"calls": False}
            if parse_tools and getattr(self.parser, "takes_tools", False):  # its values typed by the tools' schemas
                options["tools"] = list(tools or ())
            stream = _CheckedStream.open(self.parser_name, self.parser, options)
        else:
            stream = turn.PlainText()
        # one call where asked (parallel_tool_calls=False: the request is stopped after it), or where a
        # named tool's call is not held by the grammar that ends the turn after it
        max_calls = 1 if not parallel_tool_calls or (one_call and not calls_held) else None
        passed_ends = frozenset(self.engine.tokenizer.decode([t], skip_special_tokens=False) for t in passed)
        ids = self.prompt_ids(messages, tools, reasoning_history)
        encode = functools.partial(self._encode_fitting, kept=len(ids))  # (the prefill's text, after the prompt)
        hybrid = getattr(self.engine, "recurrent_slots", None) is not None  # (a state holding one position)
        snapshot_at = self._generation_prompt_start(ids, end) if hybrid and (open_in_prompt or closed_in_prompt) \
            else None
        return turn.TurnRun(ids, prefill, params, stream, encode, timeout, max_calls=max_calls, thinking=thinking,
                            calls_held=calls_held, passed_ends=passed_ends, snapshot_at=snapshot_at,
                            added_tokens=self.added_tokens)

    def _generation_prompt_start(self, ids: list[int], end: str) -> int | None:
        """Where in the prompt `ids` the think block its generation prompt writes (opened, or open
        and closed: thinking off) starts, which the template leaves out when it re-renders the
        reply: a hybrid model's state keeps a snapshot there (`StateHandle.stream`'s snapshot_at),
        so that the next turn continues from it rather than from far back. None where the block's
        tokens are not the prompt's last ones as the tokenizer spells them alone."""
        at = end.rfind(self.think_markers.open)
        tail = self.engine.tokenizer.encode(end[at:], add_special_tokens=False) if at >= 0 else []
        if not tail or len(tail) >= len(ids) or list(ids[-len(tail):]) != list(tail):
            return None
        return len(ids) - len(tail)


class StreamedLogprobs:
    """One streamed reply's token log-probabilities, chunk by chunk, as OpenAI streams them: each
    chunk carries those of the tokens that arrived since the last chunk that carried any, so the
    chunks joined are the whole reply's (`Chat.openai_logprobs`). An end-of-turn token waits (the
    whole reply leaves it out where it ended the turn); the result's chunk carries what no chunk
    did. `add` every delta of the stream in order, `take` where a chunk is sent."""

    def __init__(self, chat: Chat) -> None:
        self.chat = chat
        self._streamed: list = []  # the deltas' TokenLogprobs so far
        self._given = 0             # how many of them chunks carried

    def add(self, delta: ChatDelta) -> None:
        self._streamed.extend(delta.logprobs)

    def take(self, result: ChatResult | None = None) -> list[dict] | None:
        """OpenAI's entries for the chunk being sent: those not given yet, or, for the result's
        chunk, the rest of the whole reply's (None: nothing to give; a result's without
        log-probabilities asked for: None as well)."""
        if result is not None:
            whole = self.chat.openai_logprobs(result)
            if whole is None or not self._given:
                return whole
            return whole[self._given:] or None
        streamed = self._streamed
        end = len(streamed) - bool(streamed and streamed[-1].token_id in self.chat.closing_token_ids)
        if end <= self._given:
            return None
        given, self._given = self._given, end
        return self.chat.openai_token_logprobs(streamed[given:end])


def _led(format_: dict, lead: str) -> dict:
    """A structural tag of `format_` after the text `lead`."""
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": lead}, format_]}}


@contextlib.contextmanager
def _blamed_on(name: str, parser: Any, what: str) -> Iterator[None]:
    """What a tool parser's hooks raise but a HibanaError, as a HibanaError that names it."""
    try:
        yield
    except HibanaError:
        raise
    except Exception as exc:
        raise _parser_failed(name, parser, what, exc) from exc


def _template_parser(template: str, vocab: dict) -> str:
    """The built-in parser of the calls the chat template writes: Llama 3.x's templates write past
    calls as `{"name": ..., "parameters": ...}` (its tokenizer has `<|python_tag|>`) and no
    `<tool_call>`; Mistral's after its `[TOOL_CALLS]` token, as an array, or `NAME[ARGS]{...}` where
    the template writes `[ARGS]` (a token of its tokenizer too), `NAME[CALL_ID]ID[ARGS]{...}` where it
    also writes `[CALL_ID]`; Granite 3.x's after its `<|tool_call|>` token; Qwen3-Coder's (Qwen3.5's,
    Nemotron 3's) `<function=NAME>` with `<parameter=KEY>` lines; GLM-4.5's `<arg_key>` and `<arg_value>`
    tags; MiniMax-M2's `<invoke name="NAME">` in `<minimax:tool_call>` blocks; Seed-OSS's
    `<function=NAME>` in `<seed:tool_call>` blocks (before Qwen3-Coder's, whose syntax it writes);
    hermes otherwise."""
    if "<minimax:tool_call>" in template and "<invoke name=" in template:
        return "minimax_m2"
    if "<seed:tool_call>" in template and "<function=" in template:
        return "seed_oss"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<arg_key>" in template and "<arg_value>" in template:
        return "glm45"
    if "<tool_call>" not in template and "<|tool_call|>" in template and "<|tool_call|>" in vocab:
        return "granite"
    if "<tool_call>" not in template and "[TOOL_CALLS]" in template and "[TOOL_CALLS]" in vocab:
        if "[ARGS]" not in template or "[ARGS]" not in vocab:
            return "mistral"
        return "mistral_call_id" if "[CALL_ID]" in template and "[CALL_ID]" in vocab else "mistral_args"
    if "<tool_call>" not in template and '"parameters"' in template and "<|python_tag|>" in vocab:
        return "llama3_json"
    return DEFAULT_TOOL_PARSER


_ONE_CALL_CHECK = re.compile(r"tool_calls\s*\|\s*length\s*(?:!=|==|>)\s*1\b")


def _template_one_call(template: str) -> bool:
    """Whether the chat template refuses an assistant message of several calls (Llama 3.1-3.3's
    `{% if not message.tool_calls|length == 1 %}{{ raise_exception(...) }}`)."""
    return "raise_exception" in template and _ONE_CALL_CHECK.search(template) is not None


_ID_LENGTH_CHECK = re.compile(r"id\s*\|\s*length\s*!=\s*(\d+)")
_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _default_prompt_thinks(template: str, think_open: str) -> bool:
    """Whether a chat template's default system prompt (used where the conversation gives none) asks for
    the thinking in its think markers, as Magistral's and Ministral 3 Reasoning's do: their only way in."""
    return any(think_open in m.group(2) for m in
               re.finditer(r"default_system_message\s*=\s*(['\"])((?:\\.|(?!\1).)*)\1", template, re.S))


def _template_id_length(template: str) -> int | None:
    """The length the chat template demands of call ids (Mistral's raise unless a call's id and a
    result's tool_call_id are 9 letters and digits), or None."""
    found = _ID_LENGTH_CHECK.search(template)
    return int(found.group(1)) if found and 0 < int(found.group(1)) <= 40 else None


def _template_id(call_id: Any, length: int) -> Any:
    """`call_id` as an id of `length` letters and digits: itself where it is one, else derived from
    it (the same each time, so the call and its result still pair, and a conversation renders to
    the same tokens on every turn)."""
    if not isinstance(call_id, str) or (len(call_id) == length and call_id.isascii() and call_id.isalnum()):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest(), "big")
    digits = []
    for _ in range(length):
        number, digit = divmod(number, len(_ID_ALPHABET))
        digits.append(_ID_ALPHABET[digit])
    return "".join(digits)


def _with_template_ids(messages: list[dict], length: int) -> list[dict]:
    """The messages with every call id and tool_call_id as the template takes them (`_template_id`).
    A call without an id gets one derived from the call and its place among its message's calls
    (the same on every turn, a history trimmed at its start too), and a result without a
    tool_call_id the id of the first call before it it does not yet answer: Mistral's templates
    raise on a missing id (a Jinja TypeError, not a word of why)."""
    out = []
    unanswered: list[Any] = []  # the ids of the last calls that no result has named yet, in order
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "id": _template_id(c["id"] if c.get("id") is not None else _derived_id(c, j), length)}
                     if isinstance(c, dict) else c for j, c in enumerate(m["tool_calls"])]
            m = {**m, "tool_calls": calls}
            unanswered = [c["id"] for c in calls if isinstance(c, dict)]
        elif m.get("role") == "tool":
            if m.get("tool_call_id") is not None:
                m = {**m, "tool_call_id": _template_id(m["tool_call_id"], length)}
            elif unanswered:
                m = {**m, "tool_call_id": unanswered[0]}
            if m.get("tool_call_id") in unanswered:
                unanswered.remove(m["tool_call_id"])
        else:
            unanswered = []
        out.append(m)
    return out


def _derived_id(call: dict, index: int) -> str:
    """An id for a call that came without one: of its function and arguments, and its place among
    its message's calls (two equal calls of one message differ)."""
    return f"call-{index}-" + json.dumps(call.get("function"), sort_keys=True, ensure_ascii=False, default=str)


def _parser_failed(name: str, parser: Any, what: str, exc: Exception) -> PluginError:
    """A tool parser's failure: a PluginError (the server's, not the request's: a 500 from `hibana serve`)."""
    return PluginError(f"tool parser {name!r} ({describe_registered(parser)}) failed {what}: {exc!r}; "
                       "fix its plugin, or name another tool_parser")


def _checked_parser(name: str, parser: Any) -> Any:
    """The registered tool parser `name`, a ConfigError where it cannot be one: a class registered
    in place of its instance, an object without parse and stream."""
    if isinstance(parser, type) or not all(callable(getattr(parser, m, None)) for m in ("parse", "stream")):
        raise ConfigError(f"tool parser {name!r} is registered as {describe_registered(parser)}, which is no tool "
                          "parser object with parse(text) and stream() methods (an instance, not its class); "
                          "fix its plugin, or name another tool_parser")
    return parser


def _check_format(described: str, chat_format: Any) -> None:
    """A ConfigError naming the chat format where an attribute `Chat` reads is of another type
    than register_chat_formats says (each may be left out, or None)."""
    def is_strings(value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)

    expected = {"template": ("a Jinja template (str)", lambda v: isinstance(v, str)),
                "tool_parser": ("a registered tool parser's name (str)", lambda v: isinstance(v, str)),
                "end_of_turn_tokens": ("a list of token texts", is_strings),
                "reasoning_efforts": ("a list of reasoning_effort levels (str)", is_strings),
                "prepare_messages": ("a function of the messages", callable),
                "always_thinks": ("True or False", lambda v: isinstance(v, bool))}
    for attribute, (what, fits) in expected.items():
        value = getattr(chat_format, attribute, None)
        if value is not None and not fits(value):
            raise ConfigError(f"{described} has {attribute} = {type(value).__name__} {value!r:.80}, where "
                              f"{what} or None belongs; fix its plugin")


class _CheckedStream:
    """A tool parser's stream whose failures, a plugin's bug or a result of the wrong type, are
    PluginErrors naming the parser (the engine goes on; the turn fails, its state put back)."""

    def __init__(self, name: str, parser: Any, stream: Any) -> None:
        self._name, self._parser, self._stream = name, parser, stream

    @classmethod
    def open(cls, name: str, parser: Any, options: dict) -> "_CheckedStream":
        with _blamed_on(name, parser, "in stream"):
            return cls(name, parser, parser.stream(**options))

    def _checked(self, method: str, out: Any, kind: type) -> Any:
        if not isinstance(out, kind):
            self._returned(f"{type(out).__name__}", method, f"not a {kind.__name__}")
        return out

    def _returned(self, what: str, method: str, instead: str) -> None:
        raise PluginError(f"tool parser {self._name!r} ({describe_registered(self._parser)}) returned {what} from "
                          f"{method}, {instead}; fix its plugin, or name another tool_parser")

    def _pieces(self, method: str, out: Any) -> list:
        """`out`, checked to be a list of text (str) and ToolCallDelta pieces."""
        self._checked(method, out, list)
        for piece in out:
            if isinstance(piece, str):
                continue
            if not isinstance(piece, ToolCallDelta):
                self._returned(f"a list holding {type(piece).__name__} {piece!r:.60}", method,
                               "where text (str) and ToolCallDelta pieces belong")
            if not (isinstance(piece.arguments_fragment, str) and all(isinstance(v, (str, type(None)))
                                                                       for v in (piece.id, piece.name))):
                self._returned(f"{piece!r:.100}", method, "whose id and name are str or None and "
                               "arguments_fragment a str (JSON text)")
        return out

    def feed(self, text: str) -> list:
        try:  # (per token: no context manager's frames here)
            out = self._stream.feed(text)
        except HibanaError:
            raise
        except Exception as exc:
            raise _parser_failed(self._name, self._parser, "in feed", exc) from exc
        return out if type(out) is list and not out else self._pieces("feed", out)

    def close(self) -> list:
        with _blamed_on(self._name, self._parser, "in close"):
            out = self._stream.close()
        return self._pieces("close", out)

    def finish(self) -> ParsedOutput:
        with _blamed_on(self._name, self._parser, "in finish"):
            out = self._stream.finish()
        self._checked("finish", out, ParsedOutput)
        if not isinstance(out.content, str):
            self._returned(f"a ParsedOutput whose content is {type(out.content).__name__}", "finish", "not a str")
        if not isinstance(out.error, (str, type(None))):
            self._returned(f"a ParsedOutput whose error is {type(out.error).__name__}", "finish", "not a str or None")
        if not isinstance(out.tool_calls, list):
            self._returned(f"a ParsedOutput whose tool_calls is {type(out.tool_calls).__name__}", "finish",
                           "not a list")
        for call in out.tool_calls:
            if not isinstance(call, ToolCall):
                self._returned(f"a tool call that is {type(call).__name__} {call!r:.60}", "finish",
                               "not a ToolCall(id, name, arguments)")
            if not (isinstance(call.id, str) and isinstance(call.name, str) and isinstance(call.arguments, dict)):
                self._returned(f"{call!r:.100}", "finish", "where a ToolCall's id and name are str and its "
                               "arguments a dict (the JSON decoded)")
        return out

    def __getattr__(self, attribute: str) -> Any:  # what else the turn reads of it (its reasoning)
        return getattr(self._stream, attribute)


def _close_if_empty(handle: "StateHandle") -> None:
    """Close a state made for a call that left nothing in it (it failed before its prompt was synced)."""
    with contextlib.suppress(HibanaError):
        if not handle.tokens:
            handle.close()


def _without_thinking(text: str, opening: "str | tuple[str, ...]",
                      markers: turn.ThinkMarkers = turn.QWEN_THINK) -> tuple[str, list[int]]:
    """`text` without the think blocks (and the blank lines after them) right after an `opening`
    (an assistant reply's; or any of several), and for each character left its index in `text`."""
    kept, positions, pos = [], [], 0
    openings = tuple(o.rstrip() for o in ((opening,) if isinstance(opening, str) else opening) if o.rstrip())
    blocks = re.compile(re.escape(markers.open) + ".*?" + re.escape(markers.close) + r"\s*", re.S)
    for block in blocks.finditer(text):
        if not openings or not text[:block.start()].rstrip().endswith(openings):
            continue
        kept.append(text[pos:block.start()])
        positions.extend(range(pos, block.start()))
        pos = block.end()
    kept.append(text[pos:])
    positions.extend(range(pos, len(text)))
    return "".join(kept), positions


def assistant_message(result: ChatResult) -> dict:
    """The OpenAI-style assistant message for a result, to append to the conversation (its
    thinking as `reasoning_content`, which reasoning models' templates read)."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:  # arguments holding a lone surrogate escape it: text a client can send back
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json_text(c.arguments)}}
            for c in result.tool_calls]
    return message


FREE_START = ("triggered_tags", "token_triggered_tags", "any_text")
"""Tool-call grammars (xgrammar structural tags) that let a turn begin anywhere in free text, so
that a prefill may come first: calls opened by a trigger (hermes' <tool_call>), or none."""


def _free_start(form: dict) -> bool:
    """Whether a structural tag's format lets the turn begin in free text (`FREE_START`), itself or
    as a branch of an "or" (llama3_json's: free text with calls, or <|python_tag|> then calls)."""
    if form.get("type") == "or":
        return any(_free_start(e) for e in form.get("elements") or () if isinstance(e, dict))
    return form.get("type") in FREE_START


@functools.cache
def _turn_option_names() -> tuple[tuple[str, ...], frozenset[str]]:
    """`Chat.opener`'s keywords, and SamplingParams' fields (read once, not at every turn)."""
    known = tuple(name for name, p in inspect.signature(Chat.opener).parameters.items() if p.kind is p.KEYWORD_ONLY)
    return known, frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _check_turn_options(options: dict) -> None:
    """A turn's options are `Chat.opener`'s keywords: another name is a ConfigError that says
    where it belongs (a sampling option goes in `params`), not Python's bare TypeError."""
    known, sampling = _turn_option_names()
    for name in options:
        if name in known:
            continue
        if name in sampling:
            raise ConfigError(f"{name!r} is a sampling option: pass params=SamplingParams({name}=...)")
        close = difflib.get_close_matches(name, known, n=1)
        raise ConfigError(f"a chat turn has no option {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                          f"its options: {', '.join(known)}, and params=SamplingParams(...)")
