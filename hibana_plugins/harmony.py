"""gpt-oss's harmony format: its tool parser, and its chat format (model_type gpt_oss).

An assistant turn in harmony is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
     ^ the header: role, channel, recipient (`to=`; before or after the channel), content type

The channel says who reads a message: "analysis" is the model's reasoning (never content),
"final" is the answer, "commentary" is a tool call when it has a recipient (its body the
arguments' JSON) and otherwise a preamble the user may see (content). A turn without any
harmony markup is all content. <|call|> and <|return|> end a turn (the engine stops there and
leaves them out of the text), <|end|> ends one message of it.

The markers are special tokens, and only those the model generated as such are markup: a message
body may quote a tool result that holds "<|call|>" or "<|channel|>commentary to=functions.x", and
those characters, spelled by ordinary tokens, stay in the body. The engine's text says which of
its spans are control tokens (`GeneratedText`); a plain `str` is read as its tokenizer would
encode it, every marker's text a marker (`_Markers`).

The chat format keeps the checkpoint's own template (gpt-oss checkpoints ship it; the chat layer
keeps message contents from turning into control tokens) and names the parser, and its turns end
at <|return|> and <|call|> only: <|end|> closes the analysis message in the middle of a turn.

Calls valid by construction (`HarmonyToolParser.tool_call_grammar`): the turn is held to harmony's
messages, its markers matched as the control tokens they are, by id (the grammar names them; no
text the grammar allows can spell one, and no other control token is allowed):

    "auto":      [analysis or commentary message, <|end|><|start|>assistant]*  then
                 a final message ending in <|return|>, or a call ending in <|call|>
    "required", or a tool's name:
                 [one analysis message of ANALYSIS_TOKENS at most, <|end|><|start|>assistant]  then a call
    a call:      <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>
                 (or the recipient first: " to=functions.NAME<|channel|>commentary ...", as the
                 template renders past calls; the space or <|constrain|> before "json" may be left
                 out, not both); NAME one of the tools, ARGUMENTS valid under its schema

Message bodies are free text. <|call|> ends the turn, so a turn holds one call whatever
`parallel` says.
"""

from __future__ import annotations

import re

from hibana_core.errors import ConversationError
from hibana_core.messages import ToolSchemaError, one_call_a_message
from hibana_core.turn import arguments_schema
from hibana_plugins.hookspecs import ParsedOutput, ToolCallStream, hookimpl
from hibana_plugins.tool_parsers import (_Decoded, _Stream, decode_arguments, partial_tag_length,
                                         tag_either as _either, tag_sequence as _sequence, tag_text as _text,
                                         tag_token as _token)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MESSAGE_ENDS = (END, CALL, RETURN)
END_OF_TURN_TOKENS = (RETURN, CALL)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_WORD = re.compile(r"\s*(\w+)")
ANALYSIS_TOKENS = 512
"""With a call required, the analysis message the model may write first ends within this many
tokens (then the call comes): gpt-oss is trained to reason before it calls, and a call from the
first token would be a turn it never saw; bounded, so that the call is not put off indefinitely."""


class _HarmonyStream(_Stream):
    """Modes: "header" (collecting one message's header until <|message|>), "body" (inside a
    message; `_channel` and `_recipient` say where its body goes). The analysis bodies are kept
    apart as `reasoning`. Markers count where `_markers` says they are markers only."""

    def __init__(self, calls: bool = True) -> None:
        super().__init__()
        self._mode = "header"
        self._channel: str | None = None
        self._recipient: str | None = None
        self._calls_allowed = calls
        self.reasoning = ""
        """The analysis messages' bodies so far (one line break between two), as they come."""
        self._next_message = False  # a message began since content last came: its text goes a line apart
        self._next_reasoning = False  # an analysis message began since reasoning last came: a line apart

    def _advance(self, out: list, final: bool) -> None:
        while True:
            if self._mode == "header":
                at = self._find(MESSAGE)
                if at < 0:
                    if final:
                        self._end_in_header(out)
                    return
                self._read_header(at)
                self._take(at + len(MESSAGE))
                self._mode = "body"
                self._next_message = True
                self._next_reasoning = self._streams_reasoning()
            end, marker = self._first_end()
            if end < 0 and not final:  # the body as it comes, less what may begin an end marker
                keep = max(partial_tag_length(self._buffer, m) for m in MESSAGE_ENDS)
                if self._streams_text():
                    self._text(out, self._take(len(self._buffer) - keep))
                elif self._streams_reasoning():
                    self._reason(self._take(len(self._buffer) - keep))
                return
            body = self._take(len(self._buffer) if end < 0 else end)
            self._take(len(marker))
            self._end_message(out, body, cut=end < 0)
            self._mode = "header"
            if end < 0:
                return

    def _end_in_header(self, out: list) -> None:
        """The output ended before a header's <|message|> (max_tokens cut it). Text with no harmony
        markup before it is content; the header is dropped, but one that calls a function is a call
        cut off (`CUT_RECIPIENT`; named where the header had ended its name). A recipient written
        first (" to=functions.NAME<|channel|>...", which the grammar allows) is header, never
        content: it leaked into the content, and the cut call was no invalid call."""
        first = min((at for m in (START, CHANNEL) if (at := self._find(m)) >= 0), default=len(self._buffer))
        head = self._buffer[:first].strip()
        begin = 0
        while (at := self._find(START, begin)) >= 0:
            begin = at + len(START)
        before, header = self._buffer[:first], self._take(len(self._buffer))[begin:]
        recipient_first = (CUT_RECIPIENT + FUNCTIONS).startswith(head) or head.startswith(CUT_RECIPIENT)
        if not recipient_first:  # no harmony markup before it: plain content
            self._text(out, before)
            header = header[first:] if begin == 0 else header
        recipient = _RECIPIENT.search(header)
        target = recipient.group(1) if recipient else ""
        if not (self._calls_allowed and (target.startswith(FUNCTIONS) or FUNCTIONS.startswith(target))
                and (recipient or recipient_first and head)):
            return  # not a call's header (or calls are not allowed): dropped
        whole = recipient is not None and target.startswith(FUNCTIONS) and recipient.end() < len(header)
        name = target.removeprefix(FUNCTIONS) if whole else ""
        # (nameless: its text never reads as `to=functions.NAME`, whose name `cut_call_parts` would take)
        self._reject(out, f"{CUT_RECIPIENT}{target} " if name else header.strip().removeprefix(CUT_RECIPIENT),
                     f"the output ended inside the header of a call{f' of {name!r}' if name else ''}", cut=True)

    def _text(self, out: list, text: str, cut: bool = False) -> None:
        """Content, a message's one line apart from an earlier one's (a preamble, then the final
        answer), as analysis messages are in `reasoning`. The line break goes before the first
        piece of the message's body, whitespace or not, so that it stands where it would had the
        body come whole (a body's leading space streamed alone went out before it)."""
        if text and self._next_message and self._content.started:
            text = "\n" + text
        if text:
            self._next_message = False
        super()._text(out, text, cut)

    def _reason(self, text: str) -> None:
        """An analysis body's text, into `reasoning`: a message's one line apart from an earlier
        one's. The line break comes with the body's first piece, not with its header, so that the
        header's tokens are not counted as reasoning (`TurnRun._count_reasoning`)."""
        if text and self._next_reasoning and self.reasoning:
            text = "\n" + text
        if text:
            self._next_reasoning = False
        self.reasoning += text

    def _take(self, n: int) -> str:
        """The first `n` characters of `_buffer`, removed from it."""
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        return taken

    def _find(self, marker: str, begin: int = 0, end: int | None = None) -> int:
        """Where the first real `marker` in `_buffer[begin:end]` starts; -1 if none."""
        return self._markers.find(self._buffer, marker, begin, end)

    def _first_end(self) -> tuple[int, str]:
        """Where the first message end marker in `_buffer` is, and which; (-1, "") if none."""
        found = [(at, m) for m in MESSAGE_ENDS if (at := self._find(m)) >= 0]
        return min(found) if found else (-1, "")

    def _read_header(self, length: int) -> None:
        """The header in `_buffer[:length]`, from its last <|start|> on: the word after
        <|channel|>, and the recipient (`to=`)."""
        begin = 0
        while (at := self._find(START, begin, length)) >= 0:
            begin = at + len(START)
        channel_at = self._find(CHANNEL, begin, length)
        channel = _WORD.match(self._buffer, channel_at + len(CHANNEL), length) if channel_at >= 0 else None
        recipient = _RECIPIENT.search(self._buffer[begin:length])
        self._channel = channel.group(1) if channel else None
        self._recipient = recipient.group(1) if recipient else None

    def _streams_text(self) -> bool:
        return self._recipient is None and self._channel != "analysis"

    def _streams_reasoning(self) -> bool:
        """An analysis message that is no call of a function (a built-in's is reasoning too)."""
        return self._channel == "analysis" and not (self._recipient or "").startswith(FUNCTIONS)

    def _end_message(self, out: list, body: str, cut: bool = False) -> None:
        """One message's body, by its channel and recipient; `cut`: the generation ended inside it."""
        if self._recipient is not None:
            if not self._recipient.startswith(FUNCTIONS):  # gpt-oss's built-ins (python, browser.*): not offered
                error = f"a message to {self._recipient!r}, not to an offered function ({FUNCTIONS}NAME)"
                if self._channel == "analysis":  # the built-ins are called from the reasoning: it stays there
                    self._reason(body)
                    self._errors.append(error)
                else:
                    self._reject(out, body, error, cut)
                return
            name = self._recipient.removeprefix(FUNCTIONS)
            if not self._calls_allowed:
                self._reject(out, body, f"a call of {name!r}, where no tools may be called", cut)
                return
            # a body cut before its arguments began is a cut call: blank is {} only in a whole <|message|><|call|>
            decoded = _decode_arguments(name, body) if body.strip() or not cut else None
            if decoded is None:
                self._reject(out, f"{CUT_RECIPIENT}{self._recipient} ", f"the output ended before the arguments of "
                             f"{name!r}", cut)
            elif decoded.error is None:
                self._accept(out, decoded)
            else:  # a cut call keeps its recipient before its body: whom it called (`cut_call_parts`)
                self._reject(out, f"{CUT_RECIPIENT}{self._recipient} {body}" if cut else body, decoded.error, cut)
        elif self._channel == "analysis":
            self._reason(body)
        else:
            self._text(out, body)


def _decode_arguments(name: str, body: str) -> _Decoded:
    """A call's body: its arguments' JSON object."""
    return decode_arguments(name, body, "a harmony tool call needs a recipient name", blank=True)


# --- the grammar of a turn ------------------------------------------------------------------------

def _message(channel: str, end: str, max_tokens: int | None = None) -> dict:
    """<|channel|>CHANNEL<|message|>free text END."""
    body = {"type": "any_text"} if max_tokens is None else {"type": "any_text", "max_tokens": max_tokens}
    return _sequence(_token(CHANNEL), _text(channel), _token(MESSAGE), body, _token(end))


def _then_next(message: dict) -> dict:
    """A message that ends with <|end|>, and the next one's start."""
    return _sequence(message, _token(START), _text("assistant"))


def _call(function: dict) -> dict:
    """A call to `function`, its recipient after the channel (as gpt-oss writes it) or before (as
    its template renders past calls), its arguments held to the function's schema. Between the
    header and "json" a space, <|constrain|> or both: never nothing, which would run the name on."""
    recipient = f"to={FUNCTIONS}{function['name']}"
    header = _either([_sequence(_token(CHANNEL), _text(f"commentary {recipient}")),
                      _sequence(_text(f" {recipient}"), _token(CHANNEL), _text("commentary"))])
    content_type = _either([_sequence(_text(" "), {"type": "optional", "content": _token(CONSTRAIN)}, _text("json")),
                            _sequence(_token(CONSTRAIN), _text("json"))])
    arguments = {"type": "json_schema", "json_schema": arguments_schema(function)}
    return _sequence(header, content_type, _token(MESSAGE), arguments, _token(CALL))


def _callable(function: dict) -> dict:
    """`function`, if its name can be a recipient (the header's `to=NAME` ends at whitespace or a marker)."""
    name = function["name"]
    if re.search(r"\s|<\|", name):
        raise ToolSchemaError(f"tool {name!r} cannot be called in harmony: a recipient's name holds no "
                              "whitespace and no '<|'; rename the tool")
    return function


CUT_RECIPIENT = "to="
"""A call max_tokens cut off is `to=functions.NAME BODY` (its header's recipient, then its body
so far): the text `HarmonyToolParser.cut_call_parts` reads its name and arguments from."""


class HarmonyToolParser:
    """gpt-oss's tool calls (commentary messages to `functions.NAME`), its answer (final and
    recipient-less commentary messages) as content, its analysis messages left out of the
    content (a stream's `reasoning`)."""

    name = "harmony"

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        stream.feed(text)
        return stream.finish()

    splits_channels = True
    """Its stream is the format's reader, not only the calls' (the chat layer uses it without
    tools too, with `calls=False`, and holds a response_format's answer by `answer_grammar`)."""

    def stream(self, calls: bool = True) -> ToolCallStream:
        """`calls=False`: no tools were offered (or none may be called): a message to a function
        is content with an error, not a call."""
        return _HarmonyStream(calls)

    def cut_call_parts(self, cut_call: str) -> tuple[str, str]:
        """(the name, the arguments so far) of a call max_tokens cut off (`CUT_RECIPIENT`), as a
        cut hermes call's: its JSON as far as it was written (none: cut before its body); ("", "") for
        other text."""
        head, _, body = cut_call.lstrip().partition(" ")
        if not head.startswith(CUT_RECIPIENT + FUNCTIONS):
            return "", ""
        return head.removeprefix(CUT_RECIPIENT + FUNCTIONS), body

    def answer_grammar(self, schema: dict) -> dict:
        """A turn whose answer follows a JSON schema (response_format, no tools): one analysis
        message of ANALYSIS_TOKENS at most, as before a required call, then the answer as the
        final message (held from the first token, gpt-oss would answer in a form it never saw)."""
        analysis = _then_next(_message("analysis", END, ANALYSIS_TOKENS))
        answer = _sequence(_token(CHANNEL), _text("final"), _token(MESSAGE),
                           {"type": "json_schema", "json_schema": schema}, _token(RETURN))
        return {"type": "structural_tag", "format": _sequence({"type": "optional", "content": analysis}, answer)}

    def tool_call_grammar(self, tools: list[dict], tool_choice: str, parallel: bool) -> dict:
        """The turn's grammar (module docstring): "auto" leaves the model its messages and holds a
        call it writes; "required" or a tool's name: a call (the named tool's), after one bounded
        analysis message at most. `parallel` changes nothing: <|call|> ends the turn."""
        functions = [_callable(t["function"]) for t in tools
                     if tool_choice in ("auto", "required") or t["function"]["name"] == tool_choice]
        calls = _either([_call(f) for f in functions])
        if tool_choice == "auto":
            messages = {"type": "star", "content": _either([_then_next(_message("analysis", END)),
                                                             _then_next(_message("commentary", END))])}
            form = _sequence(messages, _either([_message("final", RETURN), calls]))
        else:
            analysis = _then_next(_message("analysis", END, ANALYSIS_TOKENS))
            form = _sequence({"type": "optional", "content": analysis}, calls)
        return {"type": "structural_tag", "format": form}


# the names a message's reasoning goes by; transformers hands any of them to templates as `thinking`
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
INSTRUCTION_ROLES = ("system", "developer")


class HarmonyChatFormat:
    """gpt_oss: the checkpoint's own template (`template` None), the harmony parser, turns that
    end at <|return|> or <|call|>, reasoning always on at one of three levels."""

    template = None
    tool_parser = HarmonyToolParser.name
    end_of_turn_tokens = END_OF_TURN_TOKENS
    reasoning_efforts = ("low", "medium", "high")  # what gpt-oss was trained on (its template writes any string)
    always_thinks = True  # the analysis channel is the format: no switch turns it off

    @staticmethod
    def prepare_messages(messages: list[dict]) -> list[dict]:
        """What gpt-oss's template would render unfaithfully, made faithful or refused:

        - a call's turn that wrote analysis and a preamble (content) both: the template renders
          one analysis message before a call and refuses the two, so the preamble is left out and
          the analysis kept (the model's own tokens up to the call, reused as they are);
        - a turn of several calls (another model's, or a client's): the template renders the first
          call alone and names every result after the last call, so each call becomes a message of
          its own followed by its result (by tool_call_id, else in order), as harmony writes them;
        - system and developer messages: the template renders the first message alone as the
          instructions, so leading ones are joined into it (a line apart) and a later one, which it
          would drop, is a ConversationError."""
        out: list[dict] = []
        for i, m in enumerate(messages):
            if m.get("role") in INSTRUCTION_ROLES:
                _join_instructions(out, i, m)
            elif m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") \
                    and any(m.get(key) for key in REASONING_KEYS):
                out.append({**m, "content": ""})
            else:
                out.append(m)
        return one_call_a_message(out)


def _join_instructions(out: list[dict], i: int, message: dict) -> None:
    """Message `i`, a system or developer one, joined into the first of `out` (the messages
    prepared so far), or refused where the template would drop it."""
    if len(out) > 1 or out and out[0].get("role") not in INSTRUCTION_ROLES:
        raise ConversationError(f"message {i} is a {message['role']} message after the conversation began, "
                                "which gpt-oss's template drops; put system messages first")
    if not out:
        out.append(message)
    elif isinstance(out[0].get("content"), str) and isinstance(message.get("content"), str):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + message["content"]}
    else:
        raise ConversationError(f"message {i} is a second {message['role']} message, which gpt-oss's "
                                "template drops; give one system message")


@hookimpl
def register_tool_parsers(register) -> None:
    register(HarmonyToolParser.name, HarmonyToolParser())


@hookimpl
def register_chat_formats(register) -> None:
    register("gpt_oss", HarmonyChatFormat())
