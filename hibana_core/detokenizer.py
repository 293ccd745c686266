"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of token ids (the prefix/read offsets of TGI and vLLM), so a
character split across tokens is emitted once complete, and a word-initial space survives because
the window starts a few tokens back in the history. Streamed text is held back only while its end
could still grow into a stop string (the longest end of the text that starts one), so a stop
string spanning tokens is never half-emitted and a long stop string holds back nothing it need not.

The text records where the model generated control (special) tokens (`control_spans`, handed
out with the text as `GeneratedText`): a tool parser reads markup there only, never in the same
characters spelled by ordinary tokens. A control token's text is never split between deltas.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hibana_plugins.hookspecs import GeneratedText, Span

_CONTEXT_TOKENS = 4


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
    control tokens to their text, so that their spans are recorded (`control_spans`)."""

    def __init__(self, tokenizer: Any | None, history: Sequence[int], stop: Sequence[str],
                 control: Mapping[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._control_text = control or {}
        self.control_spans: list[Span] = []  # spans of `text` that are generated control tokens
        self._spans_emitted = 0  # how many of them were handed out
        self._ids = list(history[-_CONTEXT_TOKENS:]) if tokenizer is not None else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0
        self._matchers = [StopMatcher(s) for s in self.stop]
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Take one generated token; returns True when a stop string appeared (text is cut)."""
        if self.tokenizer is None or self.stopped:
            return self.stopped
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=False)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=False)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        new = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        for i, char in enumerate(new):
            done = [m for m in self._matchers if m.feed(char)]
            if done:  # the text ends before the stop string that completed first
                self.text = (self.text + new[:i + 1])[:len(self.text) + i + 1 - len(done[0].stop)]
                self.control_spans = [span for span in self.control_spans if span[1] <= len(self.text)]
                self.stopped = True
                return True
        self.text += new
        self._note_control(token_id)
        return False

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
