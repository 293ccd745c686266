"""One assistant turn: the request that produces it on a state, and the result it comes to.

A turn writes its prefill (if any) into the assistant's turn and generates once; everything is
read through the tool parser's stream, so a turn streams and parses as the model wrote it.

Tool calls are constrained by a grammar built from the offered tools and the parser's call
syntax (`tool_call_grammar`; hermes shown):

    "auto":      free text; once the model opens a call (`<tool_call>`), the rest of the call is
                 held to '<tool_call>\n{"name": "<one of the tools>", "arguments": <JSON valid
                 under that tool's schema>}\n</tool_call>', then free text again
    "none":      the tools are listed all the same; free text that never opens a call (`no_call_grammar`)
    "required" / "any", or a tool's name:
                 calls only, from the first token (the named tool's, when one is named), one or
                 more separated by newlines, then the end of the turn
    parallel_tool_calls=False: the grammar ends after the first call
    a json_schema beside tools ("auto"): calls as "required" writes them, or a text answer that is
                 JSON valid under the schema (`answer_or_calls`, OpenAI's response_format)

The tool's name is one of those offered and its arguments follow its JSON schema (nested objects,
arrays, enums, required keys); a schema xgrammar cannot compile leaves that tool's arguments free
(any JSON object). A parser plugin supplies its own syntax as a `call_syntax` attribute (a
`CallSyntax`), or its whole grammar as `tool_call_grammar(tools, tool_choice, parallel)`
returning an xgrammar structural tag; a parser with neither gets the tools rendered and no
grammar.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Collection, Iterator, Sequence, TypeVar

from hibana_core.config import SamplingParams
from hibana_core.errors import ChatTimeoutError, ConfigError, ContextLengthError, GrammarError, HibanaError
from hibana_plugins.hookspecs import CutCall, GeneratedText, ParsedOutput, ToolCall, ToolCallDelta, ToolCallStream

if TYPE_CHECKING:
    from hibana_core.output import RequestEvents
    from hibana_core.state import StateHandle, StreamEvent, TokenLogprob

MALFORMED = "malformed_tool_call"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int        # prompt tokens whose KV the state already held (SyncStats.reused)
    completion_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens, those of the model's thinking (OpenAI's count)


@dataclass(frozen=True)
class ChatResult:
    text: str                 # content outside tool calls; a malformed call's text stays where it stood
    tool_calls: list[ToolCall]  # the calls that parsed, exactly those the stream sent
    finish_reason: str        # "tool_calls", "stop", "length", "malformed_tool_call", "cancelled"
    usage: Usage
    error: str | None = None  # what was malformed, when something was
    raw_text: str = ""        # the assistant's turn as generated (prefill included)
    logprobs: "list[TokenLogprob] | None" = None  # per generated token, when params.logprobs
    reasoning: str = ""       # the model's thinking (`<think>...</think>`), apart from `text`
    cut_call: str = ""        # the end of `text` that is a call max_tokens cut off (the parser's `CutCall`)
    stop_sequence: str | None = None  # the stop string (SamplingParams.stop) that ended the turn, if one did
    call_offsets: tuple[int, ...] = ()  # where each call stood in `text` (the text streamed before it):
    # a reply in blocks (Anthropic's, the Responses API's) keeps text written after a call after it, as streamed

    @property
    def content(self) -> str:
        """`text` without the markup of a call the reply ended inside: what an answer shows (the
        server's message content, the adapters' text)."""
        return self.text.removesuffix(self.cut_call)


@dataclass(frozen=True)
class ChatDelta:
    """One streamed piece: a text delta, a tool-call delta, or (last) the whole result."""

    text: str = ""
    tool_call: ToolCallDelta | None = None
    result: ChatResult | None = None
    reasoning: str = ""       # a piece of the model's thinking
    cut_call: bool = False    # `text` is a call max_tokens cut off (ChatResult.cut_call)
    logprobs: "tuple[TokenLogprob, ...]" = ()
    """With params.logprobs: those of the tokens generated since the last delta that carried any
    (the first delta a step's tokens made carries them; the result carries all of them)."""


# --- the tool-call grammar ----------------------------------------------------------------------------

@dataclass(frozen=True)
class CallSyntax:
    """How a tool-call parser's format spells one call around its name and arguments."""

    open: str           # up to the name
    mid: str            # between the name and the arguments object
    close: str          # after the arguments object
    trigger: str = ""   # where a call starts in free text (a prefix of `open`; "" means `open`)
    separator: str = "\n"  # between the calls of one turn
    closer: str = ""    # the markup that ends a call, never free text (a stray one closes no call)
    opener_token: str = ""  # a control token that may open the calls (Llama 3's <|python_tag|>), where the
    # vocabulary has it: the model's own way to begin them stays open to it
    anywhere: bool = True  # whether a call may start after text ("auto"); Llama 3's parser reads calls only at
    # the start of the turn (or after <|python_tag|>), so after text its grammar starts none
    arguments: str = "json"  # how the arguments are written: a JSON object, or "qwen_xml" (xgrammar's style of
    # Qwen3-Coder's `<parameter=KEY>VALUE</parameter>` lines: a string as it is, other values as JSON), or "glm_xml"
    # (GLM-4.5's `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`, alike), or "minimax_xml" (MiniMax-M2's
    # `<parameter name="KEY">VALUE</parameter>`, alike)
    block_open: str = ""   # the markup around all the calls of a block, where a format has one (MiniMax-M2's
    block_close: str = ""  # `<minimax:tool_call>` ... `</minimax:tool_call>`; "": each call carries its own,
    # `open` and `close`). A block opens at `trigger` in free text; what `block_open` holds before it is what the
    # template writes before a block where the calls come first (MiniMax-M2's newline): a forced call's first text


SYNTAX = {  # by registered tool parser name
    "hermes": CallSyntax('<tool_call>\n{"name": "', '", "arguments": ', '}\n</tool_call>', trigger="<tool_call>",
                         closer="</tool_call>"),
    "llama3_json": CallSyntax('{"name": "', '", "parameters": ', "}", opener_token="<|python_tag|>",
                              anywhere=False),
    "qwen3_coder": CallSyntax("<tool_call>\n<function=", ">\n", "\n</function>\n</tool_call>", trigger="<tool_call>",
                              closer="</tool_call>", arguments="qwen_xml"),
    # (the whitespace around `<arg_key>` and `<arg_value>` is the glm_xml style's: GLM-4.5's newlines, or none)
    "glm45": CallSyntax("<tool_call>", "", "</tool_call>", trigger="<tool_call>", closer="</tool_call>",
                        arguments="glm_xml"),
    # (a turn's calls in one block, an <invoke> each; the template writes a newline before the block)
    "minimax_m2": CallSyntax('<invoke name="', '">\n', "</invoke>\n", trigger="<minimax:tool_call>", separator="",
                             closer="</minimax:tool_call>", arguments="minimax_xml",
                             block_open="\n<minimax:tool_call>\n", block_close="</minimax:tool_call>"),
    # (Qwen3-Coder's calls in Seed's tags, a block a call, nothing around a value: the template writes
    # `<parameter=KEY>VALUE</parameter>` lines, a newline before each block and between them)
    "seed_oss": CallSyntax("<seed:tool_call>\n<function=", ">\n", "</function>\n</seed:tool_call>",
                           trigger="<seed:tool_call>", closer="</seed:tool_call>", arguments="qwen_xml"),
}

ANY_OBJECT = {"type": "object"}


def arguments_schema(function: dict, strict: bool = True) -> dict:
    """The schema a tool's arguments are held to: its parameters (none declared: `{}` only),
    or any JSON object when not `strict` or when xgrammar cannot compile them."""
    if not strict:
        return ANY_OBJECT
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    from hibana_core.grammar import json_schema_grammar

    try:
        json_schema_grammar(parameters)
    except GrammarError:
        return ANY_OBJECT
    return parameters


def tool_call_grammar(tools: Sequence[dict], tool_choice: str, syntax: CallSyntax, *, parallel: bool = True,
                      strict: bool = True, closer: bool = True, tokens: Collection[str] = ()) -> dict:
    """The structural tag (xgrammar's format) that holds a turn's calls to the offered tools
    (module docstring); `strict=False` leaves the arguments any JSON object; `closer=False` lets
    free text hold the syntax's closing tag (after a prefill, which may have opened a call the
    grammar never saw). `tokens`: the tokenizer's added tokens. Where the syntax's trigger is one
    of them (hermes' `<tool_call>` on Qwen), a call opens with that token, as the parser reads
    calls (`GeneratedText`): its text spelled by ordinary tokens is text, in free text too."""
    functions = [t["function"] for t in tools]
    if tool_choice not in ("auto", "required"):
        functions = [f for f in functions if f["name"] == tool_choice]
    style = getattr(syntax, "arguments", "json")  # a plugin's syntax may leave it out
    content = {"type": "json_schema"} if style == "json" else {"type": "json_schema", "style": style,
                                                                 "max_whitespace_cnt": 1}
    # (the qwen_xml and glm_xml templates write one newline around a value and between parameters; unbounded, a
    # model could write whitespace there for as long as max_tokens allows)
    spelt = (lambda name: json.dumps(name, ensure_ascii=False)[1:-1]) if style == "json" else str  # in a JSON string
    tags = [{"type": "tag", "begin": syntax.open + spelt(f["name"]) + syntax.mid,
             "content": {**content, "json_schema": arguments_schema(f, strict)}, "end": syntax.close}
            for f in functions]
    trigger = getattr(syntax, "trigger", "") or syntax.open  # a plugin's syntax may leave these out
    block_open = getattr(syntax, "block_open", "")
    by_token = trigger in tokens and getattr(syntax, "anywhere", True) and (
        trigger in block_open if block_open else syntax.open.startswith(trigger))
    if by_token and not block_open:
        tags = [_token_begun(tags, trigger)]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": getattr(syntax, "separator", "\n"),
             "at_least_one": True, "stop_after_first": not parallel}
    opened = tags  # what the trigger opens in free text: a call, or a block of them
    if block_open:  # the calls in a block (one, where not `parallel`): after what the template writes before it
        # where the calls come first (a forced call), or opened at the trigger in free text
        lead = block_open[:block_open.find(trigger)] if trigger in block_open else ""
        opened = [{"type": "tag", "begin": block_open[len(lead):], "content": calls,
                   "end": getattr(syntax, "block_close", "")}]
        if by_token:
            opened = [_token_begun(opened, trigger)]
        calls = opened[0] if not lead else {"type": "sequence", "elements": [
            {"type": "const_string", "value": lead}, opened[0]]}
    if tool_choice == "auto":
        excludes = _stray(syntax) if closer else []
        if by_token:  # free text until the model generates the token (a closing tag's token stays out of it)
            form = {"type": "token_triggered_tags", "trigger_tokens": [trigger], "tags": opened,
                    "exclude_tokens": [e for e in excludes if e in tokens], "stop_after_first": not parallel}
        elif getattr(syntax, "anywhere", True):
            form = {"type": "triggered_tags", "triggers": [trigger], "tags": opened, "stop_after_first": not parallel,
                    "excludes": excludes}
        else:  # calls from the start (after whitespace, as the parser reads them), or text that starts none but
            # after the opener token (Llama 3's <|python_tag|>, then calls)
            opener = getattr(syntax, "opener_token", "")
            text: dict = {"type": "any_text", "excludes": [trigger, *excludes]}
            if opener:
                text = {"type": "triggered_tags", "triggers": [opener], "excludes": [trigger, *excludes],
                        "tags": [{**tag, "begin": opener + tag["begin"]} for tag in tags],
                        "stop_after_first": not parallel}
            form = {"type": "or", "elements": [
                {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*"}, calls]}, text]}
    else:
        form = calls
    opener = getattr(syntax, "opener_token", "")
    if opener:  # or the turn opens with the token, and calls follow (a token the vocabulary lacks: nothing)
        opened = {"type": "sequence", "elements": [{"type": "token", "token": opener, "if_known": True}, calls]}
        form = {"type": "or", "elements": [form, opened]}
    return {"type": "structural_tag", "format": form}


def _token_begun(tags: list[dict], token: str) -> dict:
    """One tag for `tags`, which all begin with the text of `token` and end alike: that token, then
    what each one's begin writes after it and its content (xgrammar dispatches a token to one tag)."""
    def rest(tag: dict) -> dict:
        after = tag["begin"][len(token):]
        return tag["content"] if not after else {"type": "sequence", "elements": [
            {"type": "const_string", "value": after}, tag["content"]]}

    pieces = [rest(tag) for tag in tags]
    return {"type": "tag", "begin": {"type": "token", "token": token},
            "content": pieces[0] if len(pieces) == 1 else {"type": "or", "elements": pieces}, "end": tags[0]["end"]}


def parser_grammar(parser: Any, parser_name: str, tools: Sequence[dict] | None, tool_choice: str, *,
                   parallel: bool = True, strict: bool = True, closer: bool = True,
                   tokens: Collection[str] = ()) -> dict | None:
    """The tool-call grammar of a turn, from the parser's own `tool_call_grammar`, its
    `call_syntax`, or the built-in syntax of its name; None without tools or a known syntax.
    `closer` and `tokens`: as `tool_call_grammar`'s."""
    if not tools or tool_choice == "none":
        return None
    own = getattr(parser, "tool_call_grammar", None)
    if callable(own):  # not `strict`: the tools it is given take any JSON object as their arguments
        return own(tools if strict else [_any_arguments(t) for t in tools], tool_choice, parallel)
    syntax = getattr(parser, "call_syntax", None) or SYNTAX.get(parser_name)
    if syntax is None:
        return None
    return tool_call_grammar(tools, tool_choice, syntax, parallel=parallel, strict=strict, closer=closer,
                             tokens=tokens)


def _any_arguments(tool: dict) -> dict:
    """`tool` with any JSON object for its arguments."""
    return {**tool, "function": {**tool["function"], "parameters": ANY_OBJECT}}


def no_call_grammar(parser: Any, parser_name: str, closer: bool = True) -> dict | None:
    """The grammar of a turn with tool_choice "none" whose prompt lists the tools (as OpenAI's
    "none" keeps them, and with them the KV of a tool loop): any text without the start of a call
    (the parser's trigger), so that the model answers rather than writing a call as text. None
    for a parser without a known call syntax; a parser that builds its own grammar gives its
    own through `no_call_grammar()` (mistral's and granite's: their calls marker is a control token,
    which any grammar refuses where it does not name it), else None (harmony's channels)."""
    own = getattr(parser, "no_call_grammar", None)
    if callable(own):
        return own()
    if callable(getattr(parser, "tool_call_grammar", None)):
        return None
    syntax = getattr(parser, "call_syntax", None) or SYNTAX.get(parser_name)
    if syntax is None:
        return None
    trigger = getattr(syntax, "trigger", "") or syntax.open  # `closer`: as `tool_call_grammar`'s
    return {"type": "structural_tag", "format": {"type": "any_text",
                                                 "excludes": [trigger, *(_stray(syntax) if closer else [])]}}


def _stray(syntax: Any) -> list[str]:
    """Markup that free text never holds: a call's closing tag, which outside a call is the model
    ending a call it never opened (the demo wrote `...Lima"}}\n</tool_call>` into an answer)."""
    closer = getattr(syntax, "closer", "")  # a plugin's syntax may leave it out
    return [closer] if closer else []


def answer_or_calls(parser: Any, parser_name: str, tools: Sequence[dict], tool_choice: str, schema: Any, *,
                    parallel: bool = True, strict: bool = True, strict_schema: bool = True,
                    tokens: Collection[str] = ()) -> dict:
    """The grammar of a turn with tools whose text answer follows a JSON schema (OpenAI's
    response_format beside tools): with "auto", calls (as "required" writes them) or the answer,
    JSON valid under `schema`; with "required" or a tool's name, calls only, as without a schema.
    With "auto", a parser that builds its own grammar (harmony's channels) cannot take it, nor
    one without a grammar ever: ConfigError. `strict_schema=False`: keywords the grammar cannot
    hold are left to the model (SamplingParams.strict_schema). `tokens`: as `tool_call_grammar`'s."""
    from hibana_core.grammar import check_held

    if strict_schema:
        check_held(schema)
    if tool_choice != "auto":  # calls only, as without the schema: it has no text to hold
        calls = parser_grammar(parser, parser_name, tools, tool_choice, parallel=parallel, strict=strict,
                               tokens=tokens)
    else:
        own = callable(getattr(parser, "tool_call_grammar", None))
        calls = None if own else parser_grammar(parser, parser_name, tools, "required", parallel=parallel,
                                                strict=strict, tokens=tokens)
    if calls is None:
        raise ConfigError(f"the {parser_name} tool-call format cannot hold a text answer to a JSON schema beside "
                          "tool calls; either drop the tools (the answer follows the schema) or drop json_schema "
                          "(response_format) and read the answer yourself")
    if tool_choice != "auto":
        return calls
    answer = {"type": "json_schema", "json_schema": schema}
    return {"type": "structural_tag", "format": {"type": "or", "elements": [calls["format"], answer]}}


def after_thinking(grammar: dict, tool_choice: str, open_in_prompt: bool,
                   markers: "ThinkMarkers | None" = None, gap: str = "\n\n") -> dict:
    """A tool-call grammar held off while a reasoning model thinks: first its think block
    (optional, unless the template opened it), any text, then `grammar`, so that `<tool_call>`
    written while thinking is thinking. A forced call follows `gap` after the block: what the
    template writes there (Qwen3's blank line, GLM-4.5's newline; `Chat.answer_gap`).
    `markers`: the model's think markers (Qwen's `<think>` by default), named as the control
    tokens they are where they are (Mistral's `[THINK]`)."""
    markers = markers or QWEN_THINK
    # the block ends at the first </think>, as `Thinking` reads it (with "</think>\n\n" as its end, a
    # "</think> {...}" was thinking to the grammar and a free answer to the parser)
    think = {"type": "tag", "begin": "" if open_in_prompt else markers.spelt(markers.open),
             "content": {"type": "any_text"}, "end": markers.spelt(markers.close)}
    if tool_choice != "auto":
        think = {"type": "sequence", "elements": [think, {"type": "const_string", "value": gap}]}
    if not open_in_prompt:  # after whitespace, as `Thinking` reads it ("\n<think>" was free text, so a
        # <tool_call> in that thinking opened a call the parser never read)
        # (a few characters of ASCII whitespace: unbounded, a model could write whitespace up to max_tokens,
        # and xgrammar's \s takes characters str.lstrip keeps, U+FEFF, so that thinking was answer to `Thinking`)
        think = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[ \t\r\n]{0,8}"}, think]}
    first = think if open_in_prompt else {"type": "optional", "content": think}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [first, grammar["format"]]}}


# --- running a turn ----------------------------------------------------------------------------------

class PlainText:
    """The parser stream's protocol with no tool parsing: the text is the content."""

    def __init__(self) -> None:
        self.text = ""

    def feed(self, delta: str) -> list[str]:
        delta = str(delta)  # the text alone: a GeneratedText's spans are for parsers
        self.text += delta
        return [delta]

    def close(self) -> list[str]:
        return []

    def finish(self) -> ParsedOutput:
        return ParsedOutput(self.text, [], None)


@dataclass(frozen=True)
class ThinkMarkers:
    """The marks around a reasoning model's thinking."""

    open: str
    close: str
    control: bool = False  # special tokens of the vocabulary (a grammar names them as tokens), not text
    lead_ins: tuple[str, ...] = ()  # markup a generation prompt may write after `open`, the block still open
    # (Seed-OSS's <seed:cot_budget_reflect> where its thinking budget is 0): the thinking's first words

    def spelt(self, marker: str) -> "str | dict":
        """`marker` as a structural tag's begin or end: its text, or the control token."""
        return {"type": "token", "token": marker} if self.control else marker

    def opened(self, prompt: str) -> str | None:
        """What a prompt (its text, or its end) wrote of the thinking where it ends inside a think block
        it opened: "" after `open`, or a lead-in after it; None where it opened none."""
        end = prompt.rstrip()
        return next((lead for lead in ("", *self.lead_ins) if end.endswith(self.open + lead)), None)


QWEN_THINK = ThinkMarkers("<think>", "</think>")
"""Qwen3's, DeepSeek-R1's and most reasoning models' (added tokens that are text to a grammar)."""
MISTRAL_THINK = ThinkMarkers("[THINK]", "[/THINK]", control=True)
"""Magistral's and Ministral 3 Reasoning's: control tokens of their tokenizers."""
SEED_THINK = ThinkMarkers("<seed:think>", "</seed:think>", lead_ins=("<seed:cot_budget_reflect>",))
"""Seed-OSS's (added tokens that are text). Its thinking may reflect on its budget in
`<seed:cot_budget_reflect>` tags, thinking too; with a budget of 0 its generation prompt opens the
block and that tag (the model says it will not think, closes both and answers)."""


def think_markers(template: str, vocab: Collection[str]) -> ThinkMarkers:
    """The think markers a chat template writes: Mistral's where it writes `[/THINK]` and the
    vocabulary has both as tokens, Seed-OSS's where it writes `</seed:think>`, else Qwen's.
    Qwen's and Seed-OSS's are read as text, their tokens or not: as the end of a thinking, their
    tokens would need a think block of any tokens but `</think>`, which xgrammar 0.2.9 holds wrongly
    beside an answer without one (it refused `</think>` after a `<tool_call>` token in the thinking)."""
    if MISTRAL_THINK.close in template and MISTRAL_THINK.open in vocab and MISTRAL_THINK.close in vocab:
        return MISTRAL_THINK
    if SEED_THINK.close in template:
        return SEED_THINK
    return QWEN_THINK


class Thinking:
    """Splits a reasoning model's turn into its thinking and its answer, as text arrives:

        [whitespace] <think> thinking </think> [whitespace] answer
                     ^ or already open in the prompt (`open_in_prompt`: the template wrote it,
                       and maybe the thinking's first words, `written`: Seed-OSS's lead-in),
                       or written whole there (`closed_in_prompt`: the turn is all answer)

    (the model's `markers`: Mistral's are `[THINK]` and `[/THINK]`)

    Only a think block at the start of the turn is thinking; `<think>` later in the answer is
    answer text. Pieces of a tag split across deltas are held back until they are decided.
    The answer goes on to the tool parser, so tool-call parsing never sees the thinking."""

    def __init__(self, open_in_prompt: bool = False, closed_in_prompt: bool = False,
                 markers: ThinkMarkers = QWEN_THINK, written: str = "") -> None:
        self.markers = markers
        # start, thinking, after, answer; a template that closed the block (thinking switched off): all answer,
        # after the blank lines that follow a block (GLM's "<think></think>" leaves the model its "\n")
        self.mode = "thinking" if open_in_prompt else "after" if closed_in_prompt else "start"
        # (the prompt's lead-in: reasoning with the first piece, which keeps its provenance joined to it)
        self.held = GeneratedText(written) if open_in_prompt and written else ""
        self.reasoning = ""
        self._spaces = ""      # whitespace at the end of the thinking streamed so far, held back
        self._spoken = False   # whether any thinking was streamed (whitespace before it is dropped)

    def feed(self, delta: str) -> tuple[str, str]:
        """(thinking, answer) pieces of `delta`. A `GeneratedText`'s control spans go with the answer
        (the tool parser reads a format's control-token markers there only)."""
        text, self.held = _joined(self.held, delta), ""
        thinking = answer = ""
        if self.mode == "start":
            head = _cut(text, len(text) - len(text.lstrip()))
            opening = self.markers.open
            if self._marker_at(head, 0, opening):
                text, self.mode = _cut(head, len(opening)), "thinking"
            elif opening.startswith(head):  # undecided: whitespace, or part of the tag
                self.held = text
                return "", ""
            else:
                self.mode = "answer"
        if self.mode == "thinking":
            closing = self.markers.close
            at = next((i for i in _occurrences(text, closing) if self._marker_at(text, i, closing)), -1)
            if at >= 0:
                thinking, text = _cut(text, 0, at), _cut(text, at + len(closing))
                self.mode = "after"
            else:
                keep = _partial_suffix(text, closing)
                thinking, self.held, text = _cut(text, 0, len(text) - keep), _cut(text, len(text) - keep), ""
        if self.mode == "after":  # the blank lines between the thinking and the answer
            text = _cut(text, len(text) - len(text.lstrip()))
            if text:
                self.mode = "answer"
        if self.mode == "answer":
            answer = text
        self.reasoning += thinking
        return self._streamed(thinking, ended=self.mode != "thinking"), answer

    def _marker_at(self, text: str, at: int, marker: str) -> bool:
        """Whether `marker` stands at `at` as the marker: where the markers are control tokens
        (Magistral's [THINK]), at a control span of a `GeneratedText` only, so that the same
        characters spelled with ordinary tokens (a quoted tool result) are text."""
        if not text.startswith(marker, at):
            return False
        return not (self.markers.control and isinstance(text, GeneratedText)) or \
            (at, at + len(marker)) in text.control_spans

    def close(self) -> tuple[str, str]:
        """What was held back at the end of the turn (thinking cut off by max_tokens stays thinking)."""
        held, self.held = self.held, ""
        if self.mode == "thinking":
            self.reasoning += held
            return self._streamed(held, ended=True), ""
        return "", held if self.mode != "after" else ""

    def _streamed(self, thinking: str, ended: bool) -> str:
        """`thinking` as streamed: the pieces join to `text` (stripped), so a stream's reasoning
        equals the result's: leading whitespace dropped, trailing held until more text follows."""
        piece = self._spaces + thinking
        if not self._spoken:
            piece = piece.lstrip()
        kept = piece.rstrip()
        self._spaces = "" if ended else piece[len(kept):]
        self._spoken = self._spoken or bool(kept)
        return kept

    @property
    def text(self) -> str:
        return self.reasoning.strip()


def _occurrences(text: str, part: str) -> Iterator[int]:
    """Where `part` starts in `text`, in order."""
    at = text.find(part)
    while at >= 0:
        yield at
        at = text.find(part, at + 1)


def _joined(head: str, tail: str) -> str:
    """`head + tail`, a `GeneratedText` with both one's control spans where both are one (or one is
    empty): `+` makes a plain `str`, which a parser reads as the tokenizer would encode it, so a
    control token's text the model spelled with ordinary tokens (`[TOOL_CALLS]` quoted from a tool
    result) would read as the marker. A plain `str` beside a `GeneratedText` stays plain."""
    if not head:
        return tail
    if not tail:
        return head
    if isinstance(head, GeneratedText) and isinstance(tail, GeneratedText):
        return head.joined(tail)
    return str(head) + str(tail)


def _cut(text: str, start: int, end: int | None = None) -> str:
    """`text[start:end]`, a `GeneratedText`'s control spans within it moved to match."""
    return text.part(start, end) if isinstance(text, GeneratedText) else text[start:end]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag maybe cut across deltas)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class TurnRequest:
    """What a turn asks the engine for: sync the state to `prompt`, then generate (`snapshot_at`:
    `StateHandle.stream`'s, where the template's generation prompt starts)."""

    prompt: list[int]
    params: SamplingParams
    snapshot_at: int | None = None

    def hints(self) -> dict:
        """The stream call's options beyond params and prompt: only those given."""
        return {} if self.snapshot_at is None else {"snapshot_at": self.snapshot_at}


class TurnRun:
    """Runs one turn on one state without doing I/O itself (`run` and `arun` drive it): the
    prefill is written, then one request generates. `max_calls` (1 for
    `parallel_tool_calls=False`): calls past it are dropped from the stream and the result alike,
    and once it is reached the request is stopped (`stop_now`): the turn ends with its calls,
    finish_reason "tool_calls" (a tool-call grammar usually ends the turn there already).
    `calls_held`: a tool-call grammar holds the turn, so no call ends early but where a stop string
    or stop token cuts it (without one the model may end its turn inside malformed call text).
    `passed_ends`: the texts of end-of-turn tokens the turn runs past (ignore_eos); where the model
    generates them they stay in the raw text but are no content, as special tokens are not in
    vLLM's text."""

    def __init__(self, prompt: list[int], prefill: str, params: SamplingParams, stream: ToolCallStream,
                 encode: Callable[[str], list[int]], timeout: float | None, max_calls: int | None = None,
                 thinking: Thinking | None = None, calls_held: bool = False,
                 passed_ends: frozenset[str] = frozenset(), snapshot_at: int | None = None,
                 added_tokens: frozenset[str] | None = None) -> None:
        self.base, self.prefill, self.params, self.stream = prompt, prefill, params, stream
        self.added_tokens = added_tokens  # the tokenizer's (`GeneratedText.added_tokens`), where known
        self.snapshot_at = snapshot_at  # where the generation prompt starts (`TurnRequest`)
        self.calls_held = calls_held
        self.passed_ends = passed_ends
        self.thinking = thinking   # splits a reasoning model's thinking off before the tool parser
        self.encode = encode
        # (a timeout past what a timer can wait, 10**400 too: a deadline that never comes)
        self.deadline = time.monotonic() + min(timeout, threading.TIMEOUT_MAX) if timeout else None
        self.max_calls = max_calls
        self.calls = 0             # tool calls streamed so far
        self.call_offsets: list[int] = []  # the content streamed before each of them (`ChatResult.call_offsets`)
        self._streamed = 0         # characters of content streamed so far
        self.text = ""             # the assistant turn so far
        self.usage: Usage | None = None
        self.generated = 0
        self.finish_reason = "stop"
        self.stop_string: str | None = None  # the stop string that ended the request, if one did
        self.stopped = False       # the turn ended its request itself (`stop_now`)
        self.called_tools = False  # the turn ended in tool calls (set by `finish`)
        self.logprobs: "list[TokenLogprob] | None" = [] if params.logprobs else None
        self._logprobs_given = 0   # how many of them deltas carried (`_with_logprobs`)
        self._reasoned = 0         # how much of the parser's own reasoning (harmony's analysis) was streamed
        self.reasoning_tokens = 0  # generated tokens of the thinking (`_count_reasoning`)
        self._undecided = 0        # tokens before the turn showed whether it opens a think block

    def begin(self) -> tuple[list[ChatDelta], TurnRequest]:
        deltas = self._feed(self.prefill)
        prompt = self.base + (self.encode(self.text) if self.text else [])
        if not prompt:  # (the engine's own words speak of generate's prompt=, which a chat caller never gave)
            raise ContextLengthError("the chat prompt is empty (an empty string or no token ids): nothing to answer; "
                                     "give messages, or a rendered prompt of at least one token (the state is "
                                     "unchanged)")
        return deltas, TurnRequest(prompt, self.params, self.snapshot_at)

    def on_event(self, event: "StreamEvent") -> list[ChatDelta]:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ChatTimeoutError("the chat call ran past its timeout; raise the timeout or lower max_tokens")
        if event.logprob is not None and self.logprobs is not None:
            self.logprobs.append(event.logprob)
        if event.completion is not None:
            stats = event.completion.stats
            self.usage = Usage(stats.prompt_tokens, stats.reused, 0)
            self.generated = len(event.completion.token_ids)
            reason = event.completion.finish_reason
            self.finish_reason = "stop" if self.stopped and reason == "cancelled" else reason
            self.stop_string = event.completion.stop_string
        known = event.control_spans is not None  # an event relayed without them: markers read from text
        text = GeneratedText(event.text, event.control_spans, self.added_tokens) if known else event.text
        if event.token_id is None:
            return self._with_logprobs(self._feed(text))
        mode = self.thinking.mode if self.thinking is not None else None
        reasoned = len(getattr(self.stream, "reasoning", ""))
        deltas = self._feed(text)
        self._count_reasoning(mode, reasoned)
        return self._with_logprobs(deltas)

    def _with_logprobs(self, deltas: list[ChatDelta]) -> list[ChatDelta]:
        """`deltas` with the log-probabilities of the tokens since the last ones given on the
        first of them (none given where no delta came: they wait for the next one)."""
        if not deltas or not self.logprobs or self._logprobs_given == len(self.logprobs):
            return deltas
        given, self._logprobs_given = self.logprobs[self._logprobs_given:], len(self.logprobs)
        return [dataclasses.replace(deltas[0], logprobs=tuple(given)), *deltas[1:]]

    def _count_reasoning(self, mode: str | None, reasoned: int) -> None:
        """Count a generated token as thinking: one fed inside a think block (its closing tag's
        too), or before the block opened once it does; with a parser that keeps reasoning apart
        (harmony's analysis channel), one whose text grew that reasoning (`reasoned`: its length
        before; the channel's markup tokens are not counted). A count of tokens as their text
        arrives: tokens whose characters a detokenizer holds back count as one."""
        if self.thinking is None:
            self.reasoning_tokens += len(getattr(self.stream, "reasoning", "")) > reasoned
        elif mode == "thinking":
            self.reasoning_tokens += 1
        elif mode == "start":
            if self.thinking.mode in ("thinking", "after"):
                self.reasoning_tokens += self._undecided + 1
                self._undecided = 0
            elif self.thinking.mode == "start":
                self._undecided += 1

    def finish(self) -> list[ChatDelta]:
        deltas = []
        if self.thinking is not None:
            thought, answer = self.thinking.close()
            deltas = [ChatDelta(reasoning=thought)] if thought else []
            deltas += self._parsed(answer) if answer else []
        closing = self._deltas(self.stream.close())
        deltas += self._parser_reasoning() + closing
        usage = dataclasses.replace(self.usage, completion_tokens=self.generated,
                                    reasoning_tokens=min(self.reasoning_tokens, self.generated))
        parsed = self.stream.finish()
        if self.max_calls is not None:
            parsed = dataclasses.replace(parsed, tool_calls=parsed.tool_calls[:self.max_calls])
        self.called_tools = bool(parsed.tool_calls)
        # think blocks, or what the parser kept apart as reasoning (harmony's analysis channel)
        reasoning = self.thinking.text if self.thinking is not None else getattr(self.stream, "reasoning", "").strip()
        cut_call = "".join(d.text for d in closing if d.cut_call)
        return deltas + [ChatDelta(result=result(parsed, self.text, self.finish_reason, usage, self.logprobs,
                                                 reasoning, cut_call, self.stop_string,
                                                 tuple(self.call_offsets[:len(parsed.tool_calls)])))]

    def stop_now(self) -> bool:
        """Whether the driver should stop the current request now (once): the turn holds all the
        calls it may, and what the model writes next would be dropped anyway."""
        if self.full and not self.stopped:
            self.stopped = True
            return True
        return False

    @property
    def full(self) -> bool:
        """Whether the turn holds as many calls as it may; what follows is not parsed."""
        return self.max_calls is not None and self.calls >= self.max_calls

    def _feed(self, text: str) -> list[ChatDelta]:
        self.text += text
        if self.passed_ends and isinstance(text, GeneratedText):
            text = _without_spans(text, self.passed_ends)
        if not text or self.full:
            return []
        if self.thinking is None:
            return self._parsed(text)
        thought, answer = self.thinking.feed(text)
        deltas = [ChatDelta(reasoning=thought)] if thought else []
        return deltas + (self._parsed(answer) if answer else [])

    def _parsed(self, text: str) -> list[ChatDelta]:
        """The parser's deltas for `text`. With a call limit, `text` goes in a character at a time
        (a control token's text whole) and nothing after the call that reaches the limit: what
        follows it is no part of the turn (the request stops there), wherever the text's chunks
        happened to end (an event may carry several tokens' text: a stop string held back)."""
        deltas: list[ChatDelta] = []
        for part in [text] if self.max_calls is None else _characters(text):
            if self.full:
                break
            pieces = self.stream.feed(part)
            deltas += self._parser_reasoning() + self._deltas(pieces)
        return deltas

    def _parser_reasoning(self) -> list[ChatDelta]:
        """What the parser kept apart as reasoning since last asked (harmony's analysis), as it comes;
        the parser decides the channels, so it comes before the text it was fed with. The pieces
        join to the result's reasoning, which is stripped: whitespace before it is dropped, and
        whitespace at its end held until more reasoning follows."""
        reasoning = getattr(self.stream, "reasoning", "").strip()
        new, self._reasoned = reasoning[self._reasoned:], len(reasoning)
        return [ChatDelta(reasoning=new)] if new else []

    def _deltas(self, pieces: list) -> list[ChatDelta]:
        out = []
        for piece in pieces:
            if not isinstance(piece, ToolCallDelta):
                # a call max_tokens cut off, or a stop under the call grammar (which lets no call end early)
                cut = isinstance(piece, CutCall) and (self.finish_reason == "length"
                                                      or self.finish_reason == "stop" and self.calls_held)
                out.append(ChatDelta(text=piece, cut_call=cut))
                self._streamed += len(piece)
            elif self.max_calls is None or piece.index < self.max_calls:
                if piece.id is not None:
                    self.calls += 1
                    self.call_offsets.append(self._streamed)
                out.append(ChatDelta(tool_call=piece))
        return out


def _characters(text: str) -> list[str]:
    """`text` a character at a time, but a control token's text (a `GeneratedText`'s span) whole,
    each piece a `GeneratedText` again where `text` is one (its spans moved to match)."""
    if len(text) <= 1:
        return [text]
    if not isinstance(text, GeneratedText):
        return list(text)
    pieces, at = [], 0
    for a, b in [*text.control_spans, (len(text), len(text))]:
        pieces += [text.part(i, i + 1) for i in range(at, a)]
        if b > a:
            pieces.append(text.part(a, b))
        at = b
    return pieces


def _without_spans(text: GeneratedText, dropped: frozenset[str]) -> GeneratedText:
    """`text` less the control tokens' spans that spell one of `dropped`, its other spans moved to match."""
    kept, spans, at, cut = [], [], 0, 0
    for a, b in text.control_spans:
        if text[a:b] in dropped:
            kept.append(text[at:a])
            at, cut = b, cut + b - a
        else:
            spans.append((a - cut, b - cut))
    return text if not cut else GeneratedText("".join(kept) + text[at:], tuple(spans), text.added_tokens)


def result(parsed: ParsedOutput, raw_text: str, finish_reason: str, usage: Usage,
           logprobs: "list[TokenLogprob] | None" = None, reasoning: str = "", cut_call: str = "",
           stop_sequence: str | None = None, call_offsets: tuple[int, ...] = ()) -> ChatResult:
    """What a turn comes to. Model output never raises: a malformed call is text, and says so.

    The calls that parsed are kept and a malformed or cut-off call stays in the text where it
    stood, in the result as in the stream (the parser streams a call only once it is decided);
    a call cut off by max_tokens, or by a stop where the call grammar held the turn, is `cut_call`
    too, which OpenAI's wire format leaves out.
    A LangGraph agent runs the calls it is streamed as they arrive: voiding every call of a turn
    because one is malformed would mean holding all calls back until the turn ends, and ending
    the agent (no calls) where it could run the good ones and let the model see its broken text."""
    if finish_reason in ("length", "cancelled"):
        reason = finish_reason
    else:
        reason = MALFORMED if parsed.error else "tool_calls" if parsed.tool_calls else finish_reason
    return ChatResult(parsed.content, parsed.tool_calls, reason, usage, parsed.error, raw_text, logprobs, reasoning,
                      cut_call, stop_sequence, call_offsets)


def openai_finish_reason(result: ChatResult) -> str:
    """OpenAI's finish reason for a turn, as the server and the adapters report it: "length" whenever
    max_tokens stopped the output, calls or not (as OpenAI and vLLM); "tool_calls" where it ended in
    calls; "stop" otherwise (a malformed call ends the turn as text; `ChatResult.error` says why)."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if result.tool_calls else "stop"


# --- driving a turn: the only code that does I/O, once for threads and once for an event loop ------

Open = Callable[[contextlib.ExitStack], "tuple[TurnRun, StateHandle]"]
"""Starts a turn: enters what must stay held while it runs (a leased state) on the stack and
returns the turn and the state it runs on."""

T = TypeVar("T")


def _same(delta: ChatDelta) -> ChatDelta:
    return delta


def result_of(delta: ChatDelta) -> ChatResult | None:
    """The converter for callers that want the result only: `*_, result = run(open_turn, result_of)`."""
    return delta.result


def _converted(deltas: list[ChatDelta], convert: Callable[[ChatDelta], T | None]) -> list[T]:
    return [item for item in map(convert, deltas) if item is not None]


def _restore(handle: "StateHandle", tokens: list[int]) -> None:
    """Put a state back as it was before a turn that failed (a timeout, a refused grammar, the
    context): a failed call leaves its state unchanged. Usually a truncate."""
    with contextlib.suppress(HibanaError):  # a closed handle or engine has nothing to restore
        if handle.tokens != tokens:
            handle.sync(tokens)


def run(open_turn: Open, convert: Callable[[ChatDelta], T | None] = _same) -> Iterator[T]:
    """The turn's deltas, the result last, each through `convert` (None: nothing to send): the
    one place a framework's types are made from a turn. Closing the iterator early cancels the
    request and releases what `open_turn` held; a HibanaError puts the state back as it was."""
    with contextlib.ExitStack() as stack:
        turn, handle = open_turn(stack)
        held = handle.tokens
        try:
            yield from _run(turn, handle, convert)
        except HibanaError:
            _restore(handle, held)
            raise


def _run(turn: TurnRun, handle: "StateHandle", convert: Callable[[ChatDelta], T | None]) -> Iterator[T]:
    deltas, request = turn.begin()
    yield from _converted(deltas, convert)
    with contextlib.closing(handle.stream(request.params, prompt=request.prompt, **request.hints())) as events, \
            _stopped_at(turn.deadline, events):
        for event in events:
            yield from _converted(turn.on_event(event), convert)
            if turn.stop_now():
                events.stop()
    finished = turn.finish()
    _turn_ended(handle, turn)
    yield from _converted(finished, convert)


async def arun(open_turn: Open, convert: Callable[[ChatDelta], T | None] = _same) -> AsyncIterator[T]:
    """`run` on the caller's event loop: awaits the engine, never blocks the loop. Opening the turn
    (the lease, the state's tokens) and ending it (the lease let go) wait on the engine's lock,
    which a step holds while it runs: they run in Hibana's own worker threads (`_LOCK_WAITS`), so
    that the loop goes on serving other turns meanwhile (a server's clients, one loop)."""
    async with contextlib.aclosing(arun_batches(open_turn, convert)) as batches:  # closed early: cancelled
        async for batch in batches:
            for item in batch:
                yield item


async def arun_batches(open_turn: Open, convert: Callable[[ChatDelta], T | None] = _same) -> AsyncIterator[list[T]]:
    """`arun`, its items in lists: each list what the engine had made by the time the loop read
    it (one step's tokens, or several steps' where the reader fell behind), the last one with the
    result. For a reader that pays per read rather than per item: a server writes one network
    send per list, not one per token."""
    stack = contextlib.ExitStack()
    try:
        turn, handle, held = await _opened(open_turn, stack)
        try:
            async with contextlib.aclosing(_arun(turn, handle, convert)) as batches:  # closed early: cancelled
                async for batch in batches:
                    yield batch
        except HibanaError:
            await _through(_restore, handle, held)
            raise
    finally:
        await _through(stack.close)  # a cut stream's too: its lease and the state's end callbacks


_LOCK_WAITS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="hibana-turn")
"""Threads for an async turn's calls that wait on the engine's lock: Hibana's own, not the loop's
default executor, which the application sizes (and may refuse to share)."""


async def _off_loop(call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` in one of `_LOCK_WAITS`' threads, in the caller's context."""
    context = contextvars.copy_context()
    call_in_context = functools.partial(context.run, call, *args)
    return await asyncio.get_running_loop().run_in_executor(_LOCK_WAITS, call_in_context)


async def _opened(open_turn: Open, stack: contextlib.ExitStack) -> "tuple[TurnRun, StateHandle, list[int]]":
    """`open_turn(stack)` in a worker thread, and the tokens its state holds. A caller cancelled
    meanwhile waits for the thread (a step at most), so that what it entered on `stack` is let go."""
    def opening() -> "tuple[TurnRun, StateHandle, list[int]]":
        turn, handle = open_turn(stack)
        return turn, handle, handle.tokens

    return await _through(opening)


async def _through(call: Callable[..., T], *args: Any) -> T:
    """`_off_loop(call, *args)` run to its end even where the caller is cancelled meanwhile (a client
    gone mid-stream): the caller waits for the thread, then is cancelled. (Cancelled plainly, a call
    not yet started in its thread never ran: a cut turn's clean-up was skipped.)"""
    work = asyncio.ensure_future(_off_loop(call, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(work)
        raise


async def _arun(turn: TurnRun, handle: "StateHandle",
                convert: Callable[[ChatDelta], T | None]) -> AsyncIterator[list[T]]:
    deltas, request = turn.begin()
    ready = _converted(deltas, convert)
    async with contextlib.aclosing(await _submitted(handle, request)) as events:
        with _stopped_at(turn.deadline, events, asyncio.get_running_loop()):
            try:
                async for event in events:
                    ready += _converted(turn.on_event(event), convert)
                    if turn.stop_now():  # (the stop waits on the engine's lock, which a step holds)
                        await _off_loop(events.stop)
                    # what was made goes out once nothing more is here (after the final event,
                    # with the result, below)
                    if ready and not events.ready():
                        yield ready
                        ready = []
            except HibanaError:
                if ready:  # what came before the failure still goes out, as it would item by item
                    yield ready
                raise
    finished = ready + _converted(turn.finish(), convert)
    await _off_loop(_turn_ended, handle, turn)
    yield finished


async def _submitted(handle: "StateHandle", request: TurnRequest) -> "RequestEvents":
    """`handle.astream(request)`, submitted from a worker thread: the submission waits on the
    engine's lock, which a step holds; the events still come to this loop."""
    loop = asyncio.get_running_loop()
    return await _off_loop(functools.partial(handle.astream, request.params, prompt=request.prompt, loop=loop,
                                             **request.hints()))


@contextlib.contextmanager
def _stopped_at(deadline: float | None, events: "RequestEvents",
                loop: asyncio.AbstractEventLoop | None = None) -> Iterator[None]:
    """Stop a turn's request at its deadline wherever it is: queued for an agent slot or in a long
    prefill, no token comes to check the deadline against (`TurnRun.on_event`), and the call
    waited for the generations ahead of it. Stopped, its final event comes, past the deadline.
    On an event loop the stop (it waits on the engine's lock) runs in `_LOCK_WAITS`."""
    delay = None if deadline is None else max(0.0, deadline - time.monotonic()) + 1e-3  # (the final event
    # is read past the deadline)
    if delay is None or delay > threading.TIMEOUT_MAX:  # (past ~292 years a Timer's thread dies of OverflowError)
        yield
        return
    if loop is not None:
        timer = loop.call_later(delay, lambda: loop.run_in_executor(_LOCK_WAITS, events.stop))
    else:
        timer = threading.Timer(delay, events.stop)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _turn_ended(handle: "StateHandle", turn: TurnRun) -> None:
    """Tell the engine whether the state now waits on tool calls (its eviction order uses it)."""
    with contextlib.suppress(HibanaError, AttributeError):
        handle._registry.note_turn(handle, turn.called_tools)
