"""Rendered prompts whose message contents never become control tokens.

A chat template writes its own markup (`<|im_start|>user\\n`, `<|im_end|>`) around text that
comes from users, tools and tool schemas. Tokenizing the rendered text whole would read a
`<|im_end|>` inside a tool result as the real control token: the tool could end its turn and write
an assistant turn and a tool call. So contents are tokenized as plain text:

    messages --mask: a hostile string -> a sentinel--> template --> markup 0, S0, markup 1, S1, ...
    the real render == markup 0 + content 0 + markup 1 + ...  (content i: S_i's string, as the
                                                              template wrote it: as is, trimmed, JSON)
    tokens = encode(markup 0) + plain(content 0) + encode(markup 1) + ...

Control tokens are the tokenizer's special tokens (`control_strings`). Only strings that hold
one's text are masked; a conversation with none renders and
tokenizes exactly as before (one `encode` of the whole text), so KV reuse is untouched. The model's
own assistant turns are masked too, contents, reasoning and tool-call arguments: the model may copy a
tool's output into them, and control-token text it spelled with ordinary tokens (the parsers keep
such look-alikes as content, `hibana_plugins.harmony`) stays text when re-rendered (the state holds those
ordinary tokens, so reuse is kept); in a call's arguments, markup words are text too. Over HTTP a
client's assistant message is as untrusted as its user message.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable, Sequence

from hibana_core.errors import PromptMarkupError

Span = tuple[int, int]


class Prompt(str):
    """Rendered text that knows which of its character spans are untrusted contents holding
    control-token text (`spans`, in order, not overlapping), and which of those are a tool's,
    where markup words are text too (`word_spans`). A plain `str` has none."""

    spans: tuple[Span, ...] = ()
    word_spans: frozenset[Span] = frozenset()

    def __new__(cls, text: str, spans: Sequence[Span] = (), word_spans: Sequence[Span] = ()) -> "Prompt":
        prompt = super().__new__(cls, text)
        prompt.spans = tuple(spans)
        prompt.word_spans = frozenset(word_spans)
        return prompt


def spans_of(text: str) -> tuple[Span, ...]:
    return getattr(text, "spans", ())


UNTRUSTED_ROLES = frozenset({"tool"})
"""Roles whose contents hold no markup at all: the tokenizer's markup words (`markup_words`:
Qwen's `<tool_call>`, `<think>`) are plain text there too. A tool's result is a web page, a file,
another program's output. (A system or user message may show the model its markup: text-protocol
agents write their observations as user messages in `<tool_response>` blocks.)"""


def _pattern(strings: Sequence[str]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, sorted(strings, key=len, reverse=True)))) if strings else None


class Masker:
    """Swaps every string that holds a control token's text for a sentinel the template copies
    (in a tool's message, a markup word's text too)."""

    def __init__(self, control: Sequence[str], words: Sequence[str] = ()) -> None:
        self.pattern = _pattern(control)
        self.wide = _pattern([*control, *words]) if words else self.pattern  # in UNTRUSTED_ROLES' messages
        self.tag = "hibana" + uuid.uuid4().hex[:12]
        self.originals: dict[str, str] = {}
        self.wide_sentinels: set[str] = set()  # those of contents whose markup words are text too

    def hostile(self, text: str, wide: bool = False) -> bool:
        pattern = self.wide if wide else self.pattern
        return pattern is not None and pattern.search(text) is not None

    def mask(self, value: Any, each: bool = False, wide: bool = False) -> Any:
        """`value` (strings, dicts, lists) with each hostile string, dict keys too, a sentinel;
        with `each`, each control-token text within the string instead (the rest stays); `wide`:
        markup words are hostile too."""
        if isinstance(value, str):
            if not self.hostile(value, wide):
                return value
            pattern = self.wide if wide else self.pattern
            return pattern.sub(lambda m: self._sentinel(m.group(0), wide), value) if each else self._sentinel(value, wide)
        if isinstance(value, dict):
            return {self.mask(k, each, wide): self.mask(v, each, wide) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask(v, each, wide) for v in value]
        return value

    def _sentinel(self, original: str, wide: bool = False) -> str:
        sentinel = f"{self.tag}x{len(self.originals)}x"
        self.originals[sentinel] = original
        if wide:
            self.wide_sentinels.add(sentinel)
        return sentinel

    def mask_messages(self, messages: list[dict]) -> list[dict]:
        """Every field of every message is untrusted, an assistant's content and reasoning too.
        Those of every role but a tool's keep their text around each control-token text, since
        templates read it: reasoning templates split old answers at `</think>` (Qwen3's,
        DeepSeek-R1's), and Qwen3's takes a user message that starts and ends with its
        `<tool_response>` tags for a tool's result (which decides the reasoning it keeps), all of
        which a whole-string sentinel would hide. A tool's content (markup words masked too) is a
        sentinel whole, and so is each string of a past call's arguments that holds markup: data
        written inside the call's markup (a `</tool_call>` there would close the call and open a
        forged one; arguments another model wrote that do not parse are kept as their text)."""
        return [self._masked_message(message) for message in messages]

    def _masked_message(self, message: dict) -> dict:
        if message.get("role") in UNTRUSTED_ROLES:
            return self.mask(message, wide=True)
        return {self.mask(k, each=True): self._masked_calls(v) if k == "tool_calls" else self.mask(v, each=True)
                for k, v in message.items()}

    def _masked_calls(self, calls: Any) -> Any:
        """A message's tool calls masked as its other fields are, but for their arguments (`_masked_call`)."""
        if not isinstance(calls, list):
            return self.mask(calls, each=True)
        return [self._masked_call(call) if isinstance(call, dict) else self.mask(call, each=True) for call in calls]

    def _masked_call(self, call: dict) -> dict:
        """One past call, its arguments masked whole, markup words too: data inside the call's markup."""
        masked = {}
        for key, field in call.items():
            if key == "function" and isinstance(field, dict):
                field = {self.mask(name, each=True): self.mask(value, wide=True) if name == "arguments"
                         else self.mask(value, each=True) for name, value in field.items()}
            else:
                field = self.mask(field, each=True)
            masked[self.mask(key, each=True)] = field
        return masked


def _written(original: str) -> list[str]:
    """How templates write a content string: as is, trimmed, or inside a JSON string."""
    return list(dict.fromkeys([original, original.strip(), json.dumps(original, ensure_ascii=False)[1:-1],
                               json.dumps(original)[1:-1], original.lstrip(), original.rstrip()]))


def locate(rendered: str, masked: str, masker: Masker) -> Prompt:
    """`rendered` with the spans where the masked render has sentinels, matched piece by piece."""
    pieces = re.split(f"({re.escape(masker.tag)}x\\d+x)", masked)  # markup, sentinel, markup, ...
    if not rendered.startswith(pieces[0]):
        raise PromptMarkupError("the chat template renders differently when message contents change")
    pos, spans, word_spans = len(pieces[0]), [], []
    for sentinel, markup in zip(pieces[1::2], pieces[2::2]):
        written = next((w for w in _written(masker.originals[sentinel])
                        if rendered.startswith(w + markup, pos)), None)
        if written is None:
            raise PromptMarkupError(
                "a message content holds control-token text and the chat template rewrites it in a way "
                "Hibana cannot follow, so it cannot be kept from forging turns; remove the control-token "
                "text from the content")
        spans.append((pos, pos + len(written)))
        if sentinel in masker.wide_sentinels:
            word_spans.append(spans[-1])
        pos += len(written) + len(markup)
    if pos != len(rendered):
        raise PromptMarkupError("the chat template renders differently when message contents change")
    return Prompt(rendered, [s for s in spans if s[0] < s[1]], word_spans)


def render(template: Callable[[list[dict], Any], str], messages: list[dict], tools: Any,
           control: Sequence[str], words: Sequence[str] = ()) -> Prompt:
    """`template(messages, tools)` as a Prompt that marks the contents holding control-token text
    (and, in a tool's message and in the tools, markup words: `Masker`)."""
    rendered = template(messages, tools)
    masker = Masker(control, words)
    # tools come from elsewhere as results do (an MCP server's descriptions): no markup in them either
    masked_messages, masked_tools = masker.mask_messages(messages), masker.mask(tools, wide=True)
    if not masker.originals:
        return Prompt(rendered)
    return locate(rendered, template(masked_messages, masked_tools), masker)


Encoder = Callable[[str], list[int]]


def encode(text: str, start: int, markup: Encoder, plain: Encoder, plain_words: Encoder | None = None,
           resume: Callable[[Encoder, int], Encoder] | None = None) -> list[int]:
    """Token ids of `text[start:]`: its spans through `plain` (no control tokens), its word spans
    through `plain_words` (no added token at all), the rest through `markup`. With no span from
    `start` on, `markup(text[start:])`, as before. A piece that begins past the text's start
    follows other tokens: `resume(encoder, at)` tokenizes it (`resumed`), where given."""
    out, pos = [], start

    def by(encoder: Encoder, at: int) -> Encoder:
        return resume(encoder, at) if resume is not None and at > 0 else encoder
    words = getattr(text, "word_spans", frozenset())
    for a, b in spans_of(text):
        if b <= pos:
            continue
        spelled = plain_words if (a, b) in words and plain_words is not None else plain
        a = max(a, pos)
        if a > pos:
            out += by(markup, pos)(text[pos:a])
        out += by(spelled, a)(text[a:b])
        pos = b
    if pos < len(text) or not out:
        out += by(markup, pos)(text[pos:])
    return out


def resumed(encoder: Encoder, lead: str, lead_ids: Sequence[int]) -> Encoder:
    """`encoder` for text that follows a token (`lead`, its text, which `encoder` makes `lead_ids`)
    instead of beginning the input: as the tokenizer tokenizes the text there within one whole
    text. A SentencePiece tokenizer (a Metaspace with prepend_scheme "first": Llama's, Mistral's,
    Phi-3's under transformers 5) writes "▁" before the input's first word only, and a token
    with rstrip takes the whitespace after it; a piece tokenized alone got a "▁" the whole text
    does not have. Where `lead` does not tokenize apart from the text, the text alone."""
    lead_ids = list(lead_ids)

    def encode(text: str) -> list[int]:
        ids = encoder(lead + text)
        return ids[len(lead_ids):] if ids[:len(lead_ids)] == lead_ids else encoder(text)
    return encode


def plain_encoder(tokenizer: Any, words: bool = False) -> Callable[[str], list[int]]:
    """Tokenizes text as text: a copy of a fast tokenizer's backend that encodes its special
    tokens' strings as ordinary text (`encode_special_tokens`), so no control-token string
    becomes its id (`<tool_call>`-like vocabulary words still do, as in `control_strings`). A
    copy: the flag is the backend's, which every thread's encode shares. (Dropping the special
    tokens from a copy instead renumbered the added tokens after them: Qwen's `<think>` became
    `<|im_start|>`.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its own switch
        return lambda text: list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    from tokenizers import Tokenizer

    if words:  # markup words (`<tool_call>`) as text too: flagged special in this copy alone, ids unchanged
        spec = json.loads(backend.to_str())
        for added in spec.get("added_tokens") or ():
            added["special"] = True
        backend = Tokenizer.from_str(json.dumps(spec))
    else:
        backend = Tokenizer.from_str(backend.to_str())
    backend.encode_special_tokens = True
    return _Plain(backend)


class _Plain:
    """`plain_encoder`'s encoder; `resumed` tokenizes text that follows other tokens, after a lead
    token of its own that no text spells (an added token that is not special: the copy makes it,
    and encodes special tokens' text as text)."""

    def __init__(self, backend: Any) -> None:
        from tokenizers import AddedToken

        self.backend = backend
        self.lead = f"<hibana-lead-{uuid.uuid4().hex}>"
        backend.add_tokens([AddedToken(self.lead, special=False, normalized=False)])
        self.resumed = resumed(self, self.lead, [backend.token_to_id(self.lead)])

    def __call__(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def markup_words(tokenizer: Any) -> list[str]:
    """The text of every added token that is not special (Qwen's `<tool_call>`, `</tool_call>`,
    `<tool_response>`, `<think>`): vocabulary words the tokenizer makes from text by design, and
    the markup of calls and thinking. System and user messages may show them to the model (a
    hand-written tool prompt, a text-protocol agent's observations); in a tool's message they are
    text (`UNTRUSTED_ROLES`), so that a tool result cannot hand the model the tokens of a call to copy."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    control = set(control_strings(tokenizer))
    return sorted(t.content for t in decoder.values() if t.content and t.content not in control)


def control_strings(tokenizer: Any) -> list[str]:
    """The text of every special token: what no content turns into. Added tokens that are not
    special are `markup_words`, text in untrusted contents only."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {t.content for t in decoder.values() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_tokens", ()))
    return sorted(t for t in special if t)


def leading_specials(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens a tokenizer writes before any text it encodes with its defaults: its BOS
    where it adds one (Llama's `<|begin_of_text|>`, Gemma's `<bos>`, Mistral's `<s>`), none where it
    adds none (Qwen's). What vLLM's and llama.cpp's completions put in front of a prompt given as
    text (`add_special_tokens`), which a model trained with it needs. Ids, to go before the text's
    own tokens: written as text in front of it, a SentencePiece tokenizer would encode the first
    word without its leading "▁"."""
    if tokenizer is None:
        return ()
    probe = "a"
    try:
        plain = list(tokenizer.encode(probe, add_special_tokens=False))
        full = list(tokenizer.encode(probe, add_special_tokens=True))
    except Exception:  # noqa: BLE001 - a tokenizer without the switch adds nothing that Hibana knows of
        return ()
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
    if not plain or not at:
        return ()
    lead = full[:at]
    control = set(control_strings(tokenizer))
    return tuple(lead) if all(text in control for text in tokenizer.convert_ids_to_tokens(lead)) else ()
