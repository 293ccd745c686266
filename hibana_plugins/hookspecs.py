"""The hooks a Hibana plugin implements.

Every hook is a plain function marked `@hookimpl` (Hibana's marker, below) that takes one argument,
`register`, a callback the plugin calls once per thing it provides: `register(name, obj)`. What a
hook returns is ignored (one that registers nothing and returns something, an async or generator
hook, one that does not take `register` as a plain parameter, a wrapper, or an unmarked function
named like a hook is reported with a PluginWarning). Built-ins use the same hooks, so a third-party tool parser or
model family is an equal of Hibana's own. Names are unique within one kind: a second plugin that
registers a name already taken is refused with an error naming both plugins.

    from hibana_plugins import hookimpl

    @hookimpl
    def register_tool_parsers(register):
        register("my_format", MyToolParser())

The types a plugin's objects exchange with the core (the tool-call protocol) are defined here too,
so that the core depends on this contract and never on a concrete plugin.

This module is a leaf: it imports the standard library and pluggy alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pluggy

PROJECT_NAME = "hibana"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class HibanaError(Exception):
    """Base class of every error Hibana raises on purpose; its message says what to do.

    Defined in this leaf so that the plugin manager (and any plugin) can raise Hibana's errors
    without importing the engine; `hibana_core.HibanaError` is this class.
    """


@hookspec
def register_adapters(register) -> None:
    """Register framework adapters: `register(name, factory)`.

    `factory(engine=engine, **options)` returns the framework-facing object (a LangChain chat
    model, a LlamaIndex LLM, ...) running on that `hibana_core.Engine`. The object exposes the
    engine as `.engine`, turns the framework's messages into tokens through `hibana_core.chat`,
    and always `sync`s a state handle before it generates. A class whose constructor accepts
    `engine=` is a valid factory.
    """


@hookspec
def register_tool_parsers(register) -> None:
    """Register tool-call parsers: `register(name, parser)`.

    `parser` turns generated text into content and tool calls (a `ToolParser`; the types are
    defined below):
    - `parser.parse(text) -> ParsedOutput(content, tool_calls, error)`. Malformed tool-call text
      is returned as content with `error` set; parse never raises on model output.
    - `parser.stream()` returns a fresh object for one generation with
      `feed(text_delta) -> list[str | ToolCallDelta]` (text outside tool calls, and tool-call
      deltas: id and name first, then argument fragments), `close() -> list[...]` (what was held
      back, at the end of the generation) and `finish() -> ParsedOutput` (authoritative).
      The argument fragments of one call concatenate to JSON equal to its final arguments.
      Text that `close()` lets go because the generation ended inside a call (a tag begun, a
      call unfinished) may come as a `CutCall`: content all the same, and left out of an
      OpenAI-shaped reply when max_tokens stopped the generation there (or a stop string or
      token, where the call grammar held the turn).
    - Generated text comes as a `GeneratedText` (a `str`; `parse` and `feed` take either): its
      `control_spans` are where the model generated the tokenizer's added tokens (special ones,
      and markup words such as Qwen's `<tool_call>`), and `added_tokens` (where known) is the
      text of all of them. A parser whose markup is made of special tokens (harmony's `<|call|>`)
      splits at those spans only; one whose calls open at a markup word (hermes' `<tool_call>`)
      opens them where the model generated that token, or anywhere where the tokenizer has no
      such token: the same characters spelled by ordinary tokens (a quoted tool result) are
      content. A plain `str` is read as its tokenizer would encode it: every marker's text is
      the marker.
    - Optional: `parser.takes_tools = True` asks for the turn's OpenAI-style tools, as
      `parser.stream(tools=tools)` (a format whose values are text typed by the tools' schemas:
      "qwen3_coder").
    - The chat layer checks what a stream returns: pieces that are `str` or `ToolCallDelta`, and a
      `ParsedOutput` whose content is a `str`, error a `str` or None, and tool_calls a list of
      `ToolCall` with a `str` id and name and `dict` arguments (decoded, not JSON text). Anything
      else, or an exception (but a HibanaError), fails the turn with a HibanaError naming the
      parser.

    Optional, for calls valid by construction (grammar-constrained; otherwise the hermes and
    llama3_json syntaxes are known by name and other parsers get no grammar, so tool_choice
    "required" or a tool's name is not held either: the model may answer in text):
    - `parser.call_syntax`: an object with `open`, `mid`, `close` (the text around a call's name
      and its arguments object), and optionally `trigger` (where a call starts in free text),
      `separator` (between calls), `closer` (markup that ends a call and never stands in free
      text: hermes' `</tool_call>`), `opener_token` (a control token that may open the calls
      where the vocabulary has it: Llama 3's `<|python_tag|>`) and `block_open` / `block_close`
      (markup around a block of calls, opened at `trigger`: MiniMax-M2's `<minimax:tool_call>`);
      `hibana_core.turn.CallSyntax` is one. Or
    - `parser.tool_call_grammar(tools, tool_choice, parallel) -> dict`: the whole grammar, an
      xgrammar structural tag (`{"type": "structural_tag", "format": ...}`), for OpenAI-style
      `tools`, `tool_choice` "auto", "required" or a tool's name, and whether several calls
      may follow one another. Markup that is control tokens is named by `token` formats (by
      text or id; harmony's is): the grammar allows those tokens there and nowhere else (with
      `"if_known": true`, a token the vocabulary lacks is nothing rather than an error).
      Beside it, `parser.no_call_grammar() -> dict`: the structural tag of a turn with
      tool_choice "none" (without one, no grammar holds the output under "none").
    """


@hookspec
def register_chat_formats(register) -> None:
    """Register chat-template overrides or fixes: `register(name, chat_format)`.

    `name` is the Hugging Face `model_type` the format applies to: the chat layer looks a format
    up by the checkpoint's model_type alone (no option selects one by another name).
    `chat_format` provides `template: str`, a Jinja chat template used instead of the
    checkpoint's own (same variables as transformers' `apply_chat_template`: messages, tools,
    add_generation_prompt; None keeps the checkpoint's), and may provide `tool_parser: str`, the
    registered name of the tool parser that reads its output, `end_of_turn_tokens`, the tokens
    that end an assistant turn (where the tokenizer has none of them, the format is not used at
    all, its template and tool_parser included: it is another tokenizer's), `prepare_messages(messages) -> messages`, applied to the
    normalised OpenAI-style messages before the template renders them (to leave out what the
    template would refuse; a ConversationError refuses the conversation), `reasoning_efforts`,
    the reasoning_effort levels its template reads (another is refused), and `always_thinks`,
    true where thinking cannot be switched off (reasoning=False is refused).
    `hibana_core.chat.Chat` reads these attributes alone. One of another type, a template that is
    no valid Jinja or a tool_parser no plugin registers is an error naming the format when the
    chat layer is made; a prepare_messages that raises (but a HibanaError) or returns no list of
    messages is a ConfigError naming it when a conversation is rendered.
    """


@hookspec
def register_model_families(register) -> None:
    """Register model architectures: `register(model_type, family)`.

    `model_type` is the value of `model_type` in a checkpoint's config.json. The family, a module
    or an object (an instance, not its class, unless its `build` is a staticmethod), provides
    `build(hf_config, ctx) -> (model, args)`: the model is an `nn.Module` with
    `forward(input_ids, positions) -> hidden` and `compute_logits(hidden)` whose parameter names
    match the checkpoint's; args carries num_layers, num_kv_heads, head_dim, vocab_size and
    max_position_embeddings, positive integers (see `hibana_core.models`). A build that raises
    (but a HibanaError) or returns another shape is a ConfigError naming the family.
    """


@hookspec
def register_drafters(register) -> None:
    """Register speculation drafters: `register(name, factory)` or `register(name, drafter)`.

    `factory(engine)` returns a drafter (the `hibana_core.speculation.Drafter` protocol); a
    drafter object may be registered as it is instead (anything with `propose`, not a class).
    Required: `propose(state, k) -> list[int]`, up to k tokens that may follow `state.tokens`
    (`state.key` identifies the agent for per-agent caches, `state.version` changes when its
    history was edited other than by appending). Optional: `finished(context, output)`, a
    request's generated tokens; `propose_many(states, ks)` (several states in one call),
    `shadows = False` (proposals are costly), `summary()`, `resident_bytes()`, `close()`.
    Anything else registered is a ConfigError when the drafter is first named (at engine build
    for the engine's default). A request uses it when it or the engine names it:
    `speculation={"method": name, "k": 4}`. Drafts change speed only: the engine
    keeps the tokens its own model samples, ends a proposal at its first id outside the
    vocabulary, and lets a drafter that raises draft nothing (with a PluginWarning).
    """


@hookspec
def register_surgery_passes(register) -> None:
    """Register model surgery passes: `register(name, surgery_pass)`.

    A pass rewrites the loaded model in place to cut the bytes each token reads:
    `surgery_pass.apply(model, params) -> dict`, a JSON-able record of what it changed, raising
    ConfigError for parameters it cannot take. `hibana surgery` prints the record's `layers` (a
    count) and `bytes_before` / `bytes_after` (the weights' bytes); the whole record goes in a
    written checkpoint's manifest. Register the pass
    object itself, not its class (a class, an object without `apply`, an `apply` that cannot take
    `(model, params)` (`(model, params, calibration)` when calibrated), or one that returns no dict
    is a ConfigError). Optional: `refuse(model, params)`, raising a ConfigError where the pass cannot
    apply to the model as loaded, changing nothing (it runs for every pass of a list before the
    guard measures the unmodified model); `rewrites`, a str naming what the pass rewrites ("the
    linear weights" for w8 and w4): a list with two passes that rewrite the same thing is refused
    before the model loads. A linear layer that supports packed weights has
    `set_packed(kind, tensors, group_size)` (kinds and layouts:
    `hibana_kernels.quant`); an attention layer that can store its KV in fp8 has
    `set_kv_scales(kv_scale)`. A pass with `calibrated = True` is called as
    `apply(model, params, calibration)` and may run the model on calibration text
    (`hibana_core.surgery.calibration.Calibration`). Engines apply passes by name, in order:
    `Engine.from_pretrained(path, surgery=["w8"])` or `surgery=[{"name": "w4", "group_size": 64}]`;
    the passes, their parameters and a record's "digest" (what a pass derived from data) are part
    of the model fingerprint that state files carry. Built in: "w8" (int8 per channel), "w4"
    (int4, group-wise, clipping search), "kv8" (fp8 KV cache, per-head scales calibrated at load),
    "window" (sink + window attention on the full-attention layers that matter least).
    """


# -- the tool-call protocol: what a registered tool parser exchanges with the core --------------


Span = tuple[int, int]


class GeneratedText(str):
    """Generated text that knows which of its characters are added tokens' text:
    `control_spans`, the (start, end) character spans of the tokenizer's added tokens (special
    ones, and the markup words that are not: Qwen's `<tool_call>`) that the model generated, in
    order. Outside them every character came from ordinary tokens, whatever it spells.
    `added_tokens`, where known, is the text of every added token of the tokenizer: a marker
    among them that stands outside a span was spelled by ordinary tokens (a quoted tool result),
    and one that is none of them (a format's tag the tokenizer writes in pieces) is text wherever
    it stands. It is a `str` (parsers that need no provenance read it as one); slicing or joining
    gives a plain `str` (`part` and `joined` keep the provenance)."""

    control_spans: tuple[Span, ...] = ()
    added_tokens: frozenset[str] | None = None

    def __new__(cls, text: str, control_spans: tuple[Span, ...] = (),
                added_tokens: frozenset[str] | None = None) -> "GeneratedText":
        generated = super().__new__(cls, text)
        generated.control_spans = tuple(control_spans)
        generated.added_tokens = added_tokens
        return generated

    def part(self, start: int, end: int | None = None) -> "GeneratedText":
        """`self[start:end]`, with the spans inside it moved to match."""
        end = len(self) if end is None else end
        return GeneratedText(str(self)[start:end], tuple((a - start, b - start) for a, b in self.control_spans
                                                         if start <= a and b <= end), self.added_tokens)

    def joined(self, tail: "GeneratedText") -> "GeneratedText":
        """`self + tail` with both one's spans."""
        shift = len(self)
        return GeneratedText(str(self) + str(tail), (*self.control_spans, *((a + shift, b + shift)
                                                                            for a, b in tail.control_spans)),
                             self.added_tokens if self.added_tokens is not None else tail.added_tokens)


class CutCall(str):
    """Text a tool-call stream lets go at `close()` because the generation ended inside a call
    (a tag begun, a call's JSON unfinished): content, as a malformed call's text is, and, when
    max_tokens ended the generation there (or a stop, where the call grammar held the turn), the
    markup of a call cut off (`ChatResult.cut_call`)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call."""

    id: str
    """Unique per call: "call_" + 24 hex digits (`new_call_id()`), or the id the format's own
    text carries or needs (Mistral's parsers: 9 letters and digits, as its templates take them)."""
    name: str
    """The function the model calls."""
    arguments: dict
    """Its arguments, decoded from JSON."""


@dataclass(frozen=True)
class ParsedOutput:
    """A generation split into content and tool calls."""

    content: str
    """Text outside tool calls (malformed tool-call text included), stripped."""
    tool_calls: list[ToolCall]
    """Well-formed tool calls, in order."""
    error: str | None = None
    """What was malformed, when something was; None otherwise."""


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call: first id and name, then argument fragments."""

    index: int
    """Position of the call among this generation's streamed calls."""
    id: str | None
    """Set on the first delta of a call only."""
    name: str | None
    """Set on the first delta of a call only."""
    arguments_fragment: str = ""
    """The next piece of the arguments' JSON text."""


class ToolCallStream(Protocol):
    """Incremental parsing of one generation."""

    def feed(self, text_delta: str) -> list[str | ToolCallDelta]: ...

    def close(self) -> list[str | ToolCallDelta]: ...

    def finish(self) -> ParsedOutput: ...


class ToolParser(Protocol):
    """What `register_tool_parsers` registers."""

    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> ToolCallStream: ...
