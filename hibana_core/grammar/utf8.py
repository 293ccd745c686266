"""Which tokens' bytes can be part of UTF-8 text, and after which lead bytes a token spells no
character (`Utf8Rows`): what the masks clear where xgrammar 0.2.9 would let the output stop being
UTF-8."""

from __future__ import annotations

from typing import NamedTuple

import torch

def _whole_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_BAD_SECOND = {0xE0: (0x80, 0x9F), 0xED: (0xA0, 0xBF), 0xF0: (0x80, 0x8F), 0xF4: (0x90, 0xBF)}
"""Lead bytes after which a continuation byte in this range spells no character: an overlong
three- or four-byte form (E0, F0), a UTF-16 surrogate (ED), past U+10FFFF (F4). xgrammar 0.2.9
takes each as a character, and the text decodes them as U+FFFD (past a maxLength, outside a
pattern)."""


def _no_character_after(lead: int, piece: bytes) -> bool:
    """Whether a token's bytes start with a byte that spells no character after `lead`."""
    low, high = _BAD_SECOND[lead]
    return bool(piece) and low <= piece[0] <= high


def _never_utf8(piece: bytes) -> bool:
    """Whether `piece` can be part of no UTF-8 text, whatever comes before or after it: a byte no
    UTF-8 holds (C0, C1, F5-FF), a lead byte followed within it by a byte that does not continue
    it, or a continuation byte past the piece's start that no lead byte before it expects."""
    expected = None  # continuation bytes the current character still needs (None: not known yet)
    bad = None  # the range the next byte may not take (right after a lead byte of _BAD_SECOND)
    for byte in piece:
        if 0x80 <= byte <= 0xBF:
            if expected == 0 or (bad is not None and bad[0] <= byte <= bad[1]):
                return True  # a continuation byte no lead asked for, or one that spells no character
            bad = None
            if expected is not None:  # else at the start: a character begun before the piece
                expected -= 1
            continue
        if expected:
            return True  # a character cut short inside the piece
        if byte < 0x80:
            expected = 0
        elif 0xC2 <= byte <= 0xF4:
            expected, bad = _needs(byte), _BAD_SECOND.get(byte)
        else:
            return True  # C0, C1, F5-FF
    return False


def _needs(lead: int) -> int:
    """How many continuation bytes follow a lead byte."""
    return 1 if lead < 0xE0 else 2 if lead < 0xF0 else 3


class Utf8Rows(NamedTuple):
    """The tokens a grammar's output may not take for its text to stay UTF-8 (`Grammars.utf8_rows`)."""

    keep: torch.Tensor              # a bitmask row: every token but those in no UTF-8 text
    keep_after: dict[int, torch.Tensor]  # lead byte of _BAD_SECOND -> every token but those that
    # spell no character after it
    never_ids: frozenset[int]       # the tokens in no UTF-8 text
