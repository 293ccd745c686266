"""How few tokens a text can make under a tokenizer, found without tokenizing it: what lets the
chat layer refuse a prompt that cannot fit the context (a multi-megabyte tool result) before it
spends seconds tokenizing it, with the same ContextLengthError the tokens would give.

The bound is certain or absent: each unit of the text (a byte under a byte-level BPE, else a
character) weighs 1 / the length of the longest token holding it, so no token's units weigh more
than 1 and a text makes at least its weight in tokens; tokenizers where a token can stand for a run
the bound does not see (WordPiece's [UNK], fused unknowns, pre-tokenizers that drop text) get none."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any


_COMPOSING = {"NFC": 4, "NFKC": 4}  # a composed character stands for at most 4 (U+1F82: 4 code points)
_LENGTHENING = {"NFD", "NFKD", "Lowercase", "Prepend"}  # normalizers that never shorten a text
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}  # pre-tokenizers that drop no character


@dataclasses.dataclass(frozen=True)
class TokenFloor:
    """The fewest tokens a text can make under one tokenizer (`token_floor`), found without
    tokenizing it: each unit of the text (a byte under a byte-level BPE, else a character) weighs
    1 / the length of the longest token holding it, so that no token's units weigh more than 1
    and a text makes at least its weight in tokens. A text the normalizer would change otherwise
    than character by character gets the coarser bound: its characters over `span`."""

    weights: Any                # byte-level: an array of 256 weights by byte; else {character: weight}
    byte_level: bool
    space: str | None           # what Metaspace writes for " " ("▁"), else None
    normalizer: Any             # the backend's normalizer, or None
    char_map: bool              # whether the normalizer maps character by character (Prepend, Replace of one)
    span: int                   # the most characters one token stands for, NFC's compositions counted

    def least(self, text: str) -> int:
        import numpy as np

        if self.normalizer is not None:
            normalized = self.normalizer.normalize_str(text)
            if not self.char_map and normalized != text:  # (NFC composing: not by character)
                return len(text) // self.span
            text = normalized
        if self.space is not None:
            text = text.replace(" ", self.space)
        if self.byte_level:
            counts = np.bincount(np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8), minlength=256)
            weight = float(counts @ self.weights)
        else:
            chars, counts = np.unique(np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32),
                                      return_counts=True)
            weight = sum(int(n) * self.weights.get(chr(c), 1.0) for c, n in zip(chars.tolist(), counts.tolist()))
        return int(weight * (1 - 1e-9))  # (float sums of fractions: rounded down)


def token_floor(tokenizer: Any) -> TokenFloor | None:
    """A tokenizer's `TokenFloor`, where it is certain: a fast BPE tokenizer whose every character
    (or byte) has a token or an unknown token of its own, whose pre-tokenizer drops nothing, whose
    normalizer maps characters or composes them (NFC) and drops none, and whose added tokens strip
    no whitespace. None for others: a WordPiece [UNK] stands for a whole word, BERT's
    pre-tokenizer drops whitespace, a fused unknown token stands for a run of characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
    except Exception:  # noqa: BLE001 - a backend that cannot be read: no bound
        return None
    model = (spec or {}).get("model") or {}
    vocab = model.get("vocab")
    if (model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    added = [a.get("content") or "" for a in spec.get("added_tokens") or ()]
    if any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or ()):  # (such a token takes
        return None  # the whitespace beside it)
    shrink, char_map = 1, True
    for part in _parts(spec.get("normalizer"), "normalizers"):
        kind = part.get("type")
        pattern, content = (part.get("pattern") or {}).get("String"), part.get("content")
        if kind == "Replace" and isinstance(pattern, str) and isinstance(content, str) and content:
            shrink *= -(-len(pattern) // len(content))
            char_map &= len(pattern) == len(content) == 1
        elif kind in _COMPOSING or kind in _LENGTHENING:
            shrink *= _COMPOSING.get(kind, 1)
            char_map &= kind == "Prepend"
        else:
            return None
    byte_level, space = False, None
    for part in _parts(spec.get("pre_tokenizer"), "pretokenizers"):
        kind = part.get("type")
        byte_level |= kind == "ByteLevel"
        if kind == "Metaspace":
            space = part.get("replacement") or "▁"
        if not (kind in _KEEPING or kind in ("Split", "Punctuation") and part.get("behavior") != "Removed"):
            return None
    byte_of = _byte_values() if byte_level else {}
    every_char = ((byte_level and byte_of.keys() <= vocab.keys())
                  or (model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)))
                  or (model.get("unk_token") in vocab and not model.get("fuse_unk")))
    if not every_char:  # a character with no token is dropped, or fused with its neighbours into one
        return None
    longest: dict = {}  # unit -> the longest token holding it, in units
    units = ([[byte_of[c] for c in token if c in byte_of] for token in vocab] + [list(a.encode()) for a in added]
             if byte_level else [*vocab, *(a.replace(" ", space) if space else a for a in added)])
    for token in units:
        for unit in set(token):
            longest[unit] = max(longest.get(unit, 1), len(token))
    if byte_level:
        import numpy as np

        weights: Any = np.array([1.0 / longest.get(b, 1) for b in range(256)])
    else:
        weights = {unit: 1.0 / n for unit, n in longest.items()}
    span = shrink * max(max(map(len, vocab)), max(map(len, added), default=1))
    return TokenFloor(weights, byte_level, space, backend.normalizer, char_map, span)


@functools.cache
def _byte_values() -> dict[str, int]:
    """The byte-level alphabet: the character that stands for each byte (GPT-2's), to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _parts(spec: dict | None, key: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's spec as the list of its steps (a Sequence's, flattened)."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [step for part in spec.get(key) or () for step in _parts(part, key)]
    return [spec]
