"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of token ids (the prefix/read offsets of TGI and vLLM), so a
character split across tokens is emitted once complete, and a word-initial space survives because
the window starts a few tokens back in the history. Streamed text is held back by the length of
the longest stop string minus one, so a stop string spanning tokens is never half-emitted.
"""

from __future__ import annotations

from typing import Any, Sequence

_CONTEXT_TOKENS = 4


class Detokenizer:
    def __init__(self, tokenizer: Any | None, history: Sequence[int], stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._ids = list(history[-_CONTEXT_TOKENS:]) if tokenizer is not None else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
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
        searched_from = max(0, len(self.text) - self._holdback)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        for stop in self.stop:
            at = self.text.find(stop, searched_from)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out, minus what could still become a stop string."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
