"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of token ids (the prefix/read offsets of TGI and vLLM), so a
character split across tokens is emitted once complete, and a word-initial space survives because
the window starts a few tokens back in the history. Streamed text is held back only while its end
could still grow into a stop string (the longest end of the text that starts one), so a stop
string spanning tokens is never half-emitted and a long stop string holds back nothing it need not.

The text records where the model generated the tokenizer's added tokens, special or not
(`control_spans`, handed out with the text as `GeneratedText`): a tool parser reads a marker that is
such a token there only, never in the same characters spelled by ordinary tokens. An added token's
text is never split between deltas.
"""

from __future__ import annotations

import codecs
import functools
import json
import weakref
from typing import Any, Callable, Mapping, Sequence

from hibana_core.errors import CheckpointError
from hibana_plugins.hookspecs import GeneratedText, Span

_CONTEXT_TOKENS = 4


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """A token id's raw bytes, as OpenAI's logprobs give them ("bytes"): a token that holds part
    of a UTF-8 character gives its own bytes, so that the tokens' bytes joined are the text's
    (decoding it alone gives U+FFFD). Byte-level BPE (GPT-2, Qwen, Llama 3) maps each character
    of the token back to its byte (transformers' `bytes_to_unicode`); SentencePiece's byte
    fallback (Llama 2, Gemma, Phi-3) reads `<0xNN>` as that byte and "▁" as a space. Added tokens,
    and tokens of other tokenizers, give their decoded text's bytes."""
    def text(token_id: int) -> bytes:
        """A byte-fallback piece's byte (from any tokenizer, slow ones too), else the decoded text's."""
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if (token_id not in added and isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x")
                and piece.endswith(">") and all(c in "0123456789abcdefABCDEF" for c in piece[3:5])):
            return bytes([int(piece[3:5], 16)])
        return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or ())
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:  # the decoder's own JSON (the whole tokenizer's would serialize its vocabulary)
        kinds = _types(json.loads(decoder.__getstate__())) if decoder is not None else set()
    except (AttributeError, TypeError, ValueError):
        kinds = set()
    if "ByteLevel" in kinds:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

        def raw(token_id: int) -> bytes:
            token = tokenizer.convert_ids_to_tokens(token_id)
            if token_id in added or not isinstance(token, str) or any(c not in byte_of for c in token):
                return text(token_id)
            return bytes(byte_of[c] for c in token)
        return raw
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        def raw(token_id: int) -> bytes:
            token = tokenizer.convert_ids_to_tokens(token_id)
            if token_id in added or not isinstance(token, str) or token.startswith("<0x"):
                return text(token_id)
            return token.replace("\u2581", " ").encode("utf-8")
        return raw
    return text


def _types(node: Any) -> set[str]:
    """The "type" names anywhere in a tokenizer component's JSON (a Sequence's members too)."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        for value in node.values():
            found |= _types(value)
        return found
    if isinstance(node, list):
        return set().union(*(_types(v) for v in node)) if node else set()
    return set()


_DECODERS: "weakref.WeakKeyDictionary[Any, Callable[[Sequence[int]], str]]" = weakref.WeakKeyDictionary()


def text_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """`_text_decoder` of a tokenizer, decided once per tokenizer (its probe costs an encode and
    two decodes, a request's whole detokenization's worth on a short reply)."""
    try:
        return _DECODERS[tokenizer]
    except KeyError:
        decoder = _DECODERS[tokenizer] = _text_decoder(tokenizer)
        return decoder
    except TypeError:  # a tokenizer that cannot be a weak key
        return _text_decoder(tokenizer)


def _text_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=False)`, without transformers' wrapper where it
    adds nothing: a fast tokenizer that does not clean up spaces decodes as its Rust backend does,
    and the wrapper's Python cost most of the time (the detokenizer decodes twice a generated
    token: 6.66 against 2.65 us a token, `bench/detokenizer_cost.py`). Any other tokenizer (a slow
    one, cleanup on, a class with its own decode) goes through `decode`."""
    decode = tokenizer.decode
    backend = getattr(tokenizer, "backend_tokenizer", None)
    base = _fast_base()
    if backend is None or base is None or type(tokenizer).decode is not base.decode \
            or type(tokenizer)._decode is not base._decode:
        return lambda ids: decode(ids, skip_special_tokens=False)
    backend_decode = backend.decode
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):  # Llama 3's asks; transformers 5 skips
        # it for BPE models, 4.x does not: what this version does, told by text the cleanup changes
        probe = tokenizer.encode(_CLEANED_UP, add_special_tokens=False)
        if decode(probe, skip_special_tokens=False) != backend_decode(probe, skip_special_tokens=False):
            return lambda ids: decode(ids, skip_special_tokens=False)
    return lambda ids: backend_decode(ids, skip_special_tokens=False)


_CLEANED_UP = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"
"""Text in which transformers' clean_up_tokenization changes every pattern it knows."""


@functools.cache
def _fast_base() -> Any:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover (transformers is a dependency)
        return None
    return PreTrainedTokenizerFast


def _context(tokenizer: Any, history: Sequence[int]) -> tuple[list[int], int]:
    """The last few history tokens the text is decoded after, and how many of them precede the
    generated text. The window begins where a character begins: one begun inside a character
    decodes its first bytes as U+FFFD, and a byte-fallback decoder (Llama 2, Mistral, Phi-3) then
    writes every byte of that run as U+FFFD, the generated ones too. A character the history
    leaves unfinished (a reply that max_tokens cut inside it) is text of the tokens that finish it."""
    start = max(0, len(history) - _CONTEXT_TOKENS)
    if "\ufffd" not in tokenizer.decode(history[start:], skip_special_tokens=False):
        return list(history[start:]), len(history) - start
    end = finished_end(history, token_bytes(tokenizer))
    for _ in range(3):  # a UTF-8 character has at most 3 bytes after its first
        if start == 0 or not tokenizer.decode(history[start:end], skip_special_tokens=False).startswith("\ufffd"):
            break
        start -= 1
    return list(history[start:]), end - start


def finished_end(history: Sequence[int], raw: Callable[[int], bytes]) -> int:
    """How many of `history`'s tokens there are up to its last finished character: the last few
    tokens left out where they hold the first bytes of a character they do not finish (a reply
    that max_tokens cut inside it), which decode as U+FFFD and are text only with the tokens that
    finish it. `raw`: a token id's bytes (`token_bytes`)."""
    pieces = [raw(t) for t in history[-3:]]  # an unfinished character has at most 3 bytes
    tail = b"".join(pieces)
    unfinished = 0  # bytes at the end of the history that begin a character they do not finish
    for back in range(1, min(4, len(tail)) + 1):
        byte = tail[-back]
        if byte & 0xC0 != 0x80:  # a character's first byte says how long it is
            length = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            unfinished = back if back < length else 0
            break
    end = len(history)  # the history tokens before those that hold these bytes
    while unfinished > 0:
        end -= 1
        unfinished -= len(pieces[end - len(history)])
    return end


def _undecodable(what: str, exc: Exception, remedy: str) -> CheckpointError:
    return CheckpointError(f"the tokenizer failed to decode {what} ({exc!r}): it does not cover the model's "
                           f"vocabulary or is damaged; fix the checkpoint's tokenizer, {remedy}")


class StopMatcher:
    """Knuth-Morris-Pratt over streamed text: `matched` is the length of the longest end of the
    text fed so far that starts `stop`. The failure table grows only as far as a match has gone,
    so each character costs amortised O(1), however long the stop string."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._fail = [0]  # _fail[i]: longest proper border of stop[:i + 1]

    def _border(self, i: int) -> int:
        while len(self._fail) <= i:
            j, n = self._fail[-1], len(self._fail)
            while j and self.stop[n] != self.stop[j]:
                j = self._fail[j - 1]
            self._fail.append(j + (self.stop[n] == self.stop[j]))
        return self._fail[i]

    def feed(self, char: str) -> bool:
        """Take one character; True when the stop string is complete."""
        k = self.matched
        while k and (k == len(self.stop) or self.stop[k] != char):
            k = self._border(k - 1)
        self.matched = k + (self.stop[k] == char)
        return self.matched == len(self.stop)


class Detokenizer:
    """One request's generated text, token by token; `control` maps the ids of the tokenizer's
    added tokens to their text, so that their spans are recorded (`control_spans`)."""

    def __init__(self, tokenizer: Any | None, history: Sequence[int], stop: Sequence[str],
                 control: Mapping[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer) if tokenizer is not None else None
        self.stop = tuple(stop)
        self._control_text = control or {}
        self.control_spans: list[Span] = []  # spans of `text` that are generated added tokens
        self._spans_emitted = 0  # how many of them were handed out
        try:
            self._ids, self._read_offset = _context(tokenizer, history) if tokenizer is not None else ([], 0)
        except Exception as exc:  # the request is refused before it is queued; its state is unchanged
            raise _undecodable("the end of the state's history", exc,
                               "or leave the ids it cannot decode out of the history") from exc
        self._prefix_offset = 0
        self._history_end = len(self._ids)  # past _read_offset where the history ends inside a character
        self.text = ""
        self._emitted = 0
        self._matchers = [StopMatcher(s) for s in self.stop]
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one has
        self._bytes: Callable[[int], bytes] | None = None  # token id -> its bytes, made when first needed

    def add(self, token_id: int) -> bool:
        """Take one generated token; returns True when a stop string appeared (text is cut). A
        tokenizer that fails to decode it (an id past a slow tokenizer's pieces, where the model's
        vocabulary is padded) is a CheckpointError: that request fails, on whichever thread decodes."""
        if self.tokenizer is None or self.stopped:
            return self.stopped
        try:
            return self._add(token_id)
        except Exception as exc:
            raise _undecodable(f"the generated token {token_id}", exc,
                               f"or forbid the token with logit_bias={{{token_id}: -100}}") from exc

    def _add(self, token_id: int) -> bool:
        self._ids.append(token_id)
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full, read = decode(self._ids[self._prefix_offset:]), len(self._ids)
        if full.endswith("\ufffd"):  # the text may end inside a character: read up to it
            read = self._complete_end()
            full = decode(self._ids[self._prefix_offset:read]) if read < len(self._ids) else full
        if len(full) <= len(prefix) or read <= self._read_offset:
            return False  # an incomplete character: wait for the next token
        new = full[len(prefix):]
        if self._read_offset < self._history_end:  # the first text after a history cut inside a character
            if new.startswith("\ufffd"):  # which the model did not finish: it stays the history's
                new = full[len(decode(self._ids[self._prefix_offset:self._history_end])):]
            self._history_end = 0
        self._prefix_offset, self._read_offset = self._read_offset, read
        for i, char in enumerate(new):
            done = [m for m in self._matchers if m.feed(char)]
            if done:  # the text ends before the stop string that completed first; of several
                # completing at this character ("b" and "ab"), the longest began first
                self.matched = max((m.stop for m in done), key=len)
                stop = len(self.matched)
                self.text = (self.text + new[:i + 1])[:len(self.text) + i + 1 - stop]
                self.control_spans = [span for span in self.control_spans if span[1] <= len(self.text)]
                self.stopped = True
                return True
        self.text += new
        self._note_control(token_id)
        return False

    def _complete_end(self) -> int:
        """Where the tokens not yet read stop making whole characters: before the last few when
        their bytes end inside a character whose next bytes may still come, else at the end (bytes
        no later byte can make a character, such as a lone continuation byte, are U+FFFD now, as
        the tokenizer decodes them; waiting for them held back the whole rest of the reply)."""
        if self._bytes is None:
            self._bytes = token_bytes(self.tokenizer)
        pieces = [self._bytes(t) for t in self._ids[self._read_offset:]]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(pieces), final=False)
        unfinished, end = len(decoder.getstate()[0]), len(self._ids)
        while unfinished > 0:
            end -= 1
            unfinished -= len(pieces[end - len(self._ids)])
        return end

    def _note_control(self, token_id: int) -> None:
        """Record the text's end as a control token's span when `token_id` is one. Its text ends
        what was just decoded (characters that waited for their last byte come before it)."""
        text = self._control_text.get(token_id)
        if text and self.text.endswith(text):
            self.control_spans.append((len(self.text) - len(text), len(self.text)))

    def take_delta(self, final: bool = False) -> GeneratedText:
        """Text not yet handed out, minus what could still become a stop string (and all of a
        control token whose text that would cut)."""
        held = max((m.matched for m in self._matchers), default=0)
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - held)
        spans = []
        for a, b in self.control_spans[self._spans_emitted:]:
            if b > end:
                end = min(end, a)
                break
            spans.append((a - self._emitted, b - self._emitted))
        delta = self.text[self._emitted:end]
        self._emitted = end
        self._spans_emitted += len(spans)
        return GeneratedText(delta, tuple(spans))
