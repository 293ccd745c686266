"""Bits of xgrammar's token bitmasks (a row of int32 words, 32 tokens a word): a token's bit,
clearing tokens from a row, listing the tokens a row allows, counting bits."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

_POPCOUNT16 = np.array([bin(i).count("1") for i in range(1 << 16)], dtype=np.int32)
"""Bits set in each 16-bit value."""


def _bit(bit: int) -> int:
    """1 << bit as the value of a signed 32-bit word (a bitmask's int32 elements)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def _clear_unless_alone(bitmask: torch.Tensor, row: int, tokens: Iterable[int]) -> None:
    """Clear `tokens`' bits in a bitmask row, unless nothing else is allowed there (the row is then
    left as it was)."""
    held = bitmask[row].clone()
    for token in tokens:
        word, bit = divmod(token, 32)
        held[word] &= ~_bit(bit)
    if held.any():
        bitmask[row] = held


def allowed_tokens(words: torch.Tensor, most: int) -> list[int]:
    """The token ids whose bits are set in a bitmask row (int32 words), or any `most` + 1 of
    them where there are more."""
    found: list[int] = []
    for word in words.nonzero().flatten().tolist():
        value = int(words[word]) & 0xFFFFFFFF
        while value:
            low = value & -value
            found.append(32 * word + low.bit_length() - 1)
            if len(found) > most:
                return found
            value ^= low
    return found
