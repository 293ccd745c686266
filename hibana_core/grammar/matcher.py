"""One request's place in its grammar (`Matcher`): it accepts the tokens the request keeps, cuts
drafts at the first token the grammar refuses, and fills the request's rows of a step's bitmask,
held tighter than xgrammar holds them (stop tokens only where the grammar is complete, forced
strings spelled as the tokenizer spells them, tokens xgrammar's mask allows but refuses, UTF-8)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from hibana_core.grammar.backend import _xgrammar
from hibana_core.grammar.bitmask import _bit, _clear_unless_alone, allowed_tokens
from hibana_core.grammar.utf8 import _BAD_SECOND, Utf8Rows, _no_character_after

SPELLED_CHARS = 128
"""How much of a forced string is spelled to find its first token (`Matcher.spell_forced`): a
grammar may force a long text (a const of 200k characters), whose whole spelling each step
cost that row's step 100 ms, and every other agent's with it."""
FORCED_MAX_WORDS = 64
"""Where a row's mask allows tokens in more words of 32 than this, nothing is looked up as
forced (`Matcher.spell_forced`): a forced string fixes the next bytes, and the tokens that spell
its start are few (a 151k byte-level BPE's: under 20), while free text allows thousands. The rows
are counted at once and a spelled row rewritten through numpy: with torch's per-row calls the H200
host's batch-32 fill took 4.4 ms a step against 2.3 (qwen3-8b's 151k vocabulary, 2026-12-04)."""
VERIFY_MAX = 16
"""Allowed tokens of a row that are not whole UTF-8, each checked against its matcher, at most
(see `Matcher.drop_refused`): more are where text is free (a string's content: 551 of a 151k
byte-level BPE, 51 of the demo model's 4096), where they are right; where the mask was wrong
(an integer's start) there was one. Each check costs 2-12 us."""


class Matcher:
    """One request's place in its grammar. Advanced by the tokens the request keeps; masks for
    drafts are filled by accepting the drafts and rolling them back."""

    __slots__ = ("_matcher", "_spell", "_refused", "_token_bytes", "_forced", "_last_resort", "_ends", "_utf8",
                 "_lead")

    def __init__(self, compiled: Any, stop_token_ids: Iterable[int],
                 spell: Callable[[str], Sequence[int]] = lambda text: (),
                 control_token_ids: frozenset[int] = frozenset(), token_bytes: Sequence[bytes] = (),
                 last_resort: Iterable[int] = (), utf8: "Utf8Rows | None" = None,
                 own: frozenset[int] = frozenset()) -> None:
        xgr = _xgrammar()
        # `last_resort` (the end-of-sequence tokens of an ignore_eos request): stop tokens allowed
        # only where the grammar allows nothing else, so that the output runs on while it can
        self._last_resort = sorted(set(last_resort) - set(stop_token_ids))
        stops = sorted(set(stop_token_ids) | set(self._last_resort))
        # the stop tokens that xgrammar would also take as text, the grammar's own end tokens aside
        # (`own`: harmony's <|call|>, its text's end): ends only, allowed where the grammar is
        # complete (see `hold_stops`); as text, one would end the output short of a whole match
        self._ends = frozenset(stops) - frozenset(own) - control_token_ids
        self._spell = spell  # the tokenizer's tokens of a forced string
        self._token_bytes = token_bytes  # each token's bytes (xgrammar's reading): what it takes of a forced string
        self._forced: bytes | None = None  # the string forced from here, where known (`spell_forced`)
        self._utf8 = utf8  # see `hold_utf8`
        self._lead: int | None = None  # the kept bytes end with this lead byte of _BAD_SECOND
        # control tokens this grammar does not name, refused here (xgrammar would log a warning for each)
        self._refused = control_token_ids - set(stops)
        # without stop tokens the matcher ends as soon as its grammar is complete
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)

    def accept(self, token: int) -> bool:
        """Advance by one kept token; False if the grammar forbids it (the matcher is unchanged)."""
        piece = self._token_bytes[token] if token < len(self._token_bytes) else b""
        if self._lead is not None and _no_character_after(self._lead, piece):
            return False  # no character (`hold_utf8`)
        if self._utf8 is not None and token in self._utf8.never_ids:
            return False
        if token in self._ends and not self._matcher.is_completed():
            return False  # (xgrammar 0.2.9 took "a" as the text ending regex "xa", then as the stop)
        if token in self._refused or not self._matcher.accept_token(token):
            return False
        self._lead = piece[-1] if piece and piece[-1] in _BAD_SECOND else None
        forced = self._forced
        if forced is not None:  # what the grammar forced here, less what the token took of it, is
            # forced next; where nothing was forced (b""), nothing is known of the next state
            self._forced = forced[len(piece):] if piece and len(piece) < len(forced) and forced.startswith(piece) \
                else None
        return True

    def last_resort(self, token: int) -> bool:
        """Whether `token` is one of the stop tokens allowed only where nothing else is (it then
        ends the output as a stop token does: not part of its text)."""
        return token in self._last_resort

    @property
    def done(self) -> bool:
        """The grammar ended: a stop token was accepted, or (without stop tokens) it is complete."""
        return self._matcher.is_terminated()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the grammar allows in a row; the matcher is unchanged."""
        n, forced, lead = 0, self._forced, self._lead
        for token in tokens:
            if self._matcher.is_terminated() or not self.accept(token):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
            self._forced, self._lead = forced, lead
        return n

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = (),
             suspects: torch.Tensor | None = None) -> None:
        """Masks at `row` (the next token) and, for a verify step, at row + i + 1 after the first
        i + 1 drafts (all allowed: `valid_prefix` cut them); the matcher ends where it began.
        `suspects`: see `drop_refused`."""
        matcher = self._matcher
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
            self.hold_stops(bitmask, row)
            self.spell_forced(bitmask, row)
            self.drop_refused(bitmask, row, suspects)
            self.hold_back(bitmask, row)
            self.hold_utf8(bitmask, row)
        accepted, forced, lead = 0, self._forced, self._lead
        for i, token in enumerate(drafts):
            if matcher.is_terminated() or not self.accept(token):
                break  # rows after a stop or a rejected draft stay all-allowed: they are dropped
            accepted += 1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row + i + 1)
                self.hold_stops(bitmask, row + i + 1)
                self.spell_forced(bitmask, row + i + 1)
                self.drop_refused(bitmask, row + i + 1, suspects)
                self.hold_back(bitmask, row + i + 1)
                self.hold_utf8(bitmask, row + i + 1)
        if accepted:
            matcher.rollback(accepted)
            self._forced, self._lead = forced, lead

    def hold_utf8(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the tokens that would make the text other than UTF-8, which xgrammar 0.2.9 allows:
        those that can be in no UTF-8 text, and after a lead byte of _BAD_SECOND those that start
        with a byte that spells no character there. The text would decode them as U+FFFD (past a
        maxLength, outside a pattern)."""
        if self._utf8 is None:
            return
        bitmask[row] &= self._utf8.keep
        self.hold_after_lead(bitmask, row)

    def hold_after_lead(self, bitmask: torch.Tensor, row: int) -> None:
        """`hold_utf8`'s part that depends on the kept bytes: after a lead byte of _BAD_SECOND."""
        if self._lead is not None and self._utf8 is not None:
            bitmask[row] &= self._utf8.keep_after[self._lead]

    def hold_stops(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the stop tokens that are ends only (`_ends`) where the grammar is not complete:
        xgrammar 0.2.9 allows a stop token whose text continues the grammar. Where nothing else
        is left the row stays as it was: the grammar needs the stop token as text, and the request
        fails on it with a GrammarError that says to take it out of stop_token_ids."""
        if self._ends and not self._matcher.is_completed():
            _clear_unless_alone(bitmask, row, self._ends)

    def hold_back(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear the last-resort stop tokens' bits where the row allows any other token."""
        if self._last_resort and self._matcher.is_completed():  # (stops are allowed only there)
            _clear_unless_alone(bitmask, row, self._last_resort)

    def drop_refused(self, bitmask: torch.Tensor, row: int, suspects: torch.Tensor | None) -> None:
        """Clear the bits of allowed tokens the matcher would refuse, among those that are not whole
        UTF-8 (`suspects`, a bitmask row): xgrammar's mask can allow a token that its accept_token
        then refuses (0.2.9: after '-' where an integer starts, the token '-' + the first byte of a
        two-byte character), and a sampled token the grammar refuses fails its request. Each such
        token is accepted and rolled back; a row with more than VERIFY_MAX of them is left as it
        is (free text: a string's content, where they are right)."""
        if suspects is None:
            return
        tokens = allowed_tokens(bitmask[row] & suspects, VERIFY_MAX)
        if not tokens or len(tokens) > VERIFY_MAX:
            return
        matcher = self._matcher
        refused = []
        for token in tokens:
            if matcher.accept_token(token):
                matcher.rollback(1)
            else:
                refused.append(token)
        if not refused:
            return
        before = bitmask[row].clone()
        for token in refused:
            word, bit = divmod(token, 32)
            bitmask[row, word] &= ~_bit(bit)
        if not bitmask[row].any():  # nothing left: the row as it was (the request fails on its
            bitmask[row] = before   # token with a GrammarError rather than sampling from nothing)

    def spell_forced(self, bitmask: torch.Tensor, row: int, free: bool | None = None) -> None:
        """Where the grammar forces a string of two tokens or more, allow only its first (the
        first of its first SPELLED_CHARS characters' spelling). The forced string is found once
        and then followed token by token (`accept`): xgrammar's search for it reads all of it,
        each time (a const of 1M characters cost every step 58 ms, a 10k-value enum 1.7 ms).
        Only looked for where the mask allows few tokens (FORCED_MAX_WORDS): what is allowed
        there depends on the state alone, as speculation's verify rows need. `free`: whether the
        row allows tokens in more words than that, where the caller counted them (`Grammars._fill`,
        for all its rows at once)."""
        if self._matcher.is_completed():  # where the output may also end, nothing is forced
            return
        words = bitmask.numpy()  # (rows through numpy: torch's indexing costs ~10 us a call)
        if free if free is not None else np.count_nonzero(words[row]) > FORCED_MAX_WORDS:
            return  # free text here (a function of the mask, so of the state, whatever is cached)
        forced = self._forced
        if forced is None or (forced and 0x80 <= forced[0] < 0xC0):  # (a token ended inside a character)
            forced = self._forced = self._matcher.find_jump_forward_string().encode()
        if not forced:
            return
        tokens = self._spell(forced[:4 * SPELLED_CHARS].decode("utf-8", errors="ignore")[:SPELLED_CHARS])
        if len(tokens) < 2:
            return
        first = tokens[0]
        word, bit = divmod(first, 32)
        if not (int(words[row, word]) >> bit) & 1:  # the grammar forbids it (a control token)
            return
        words[row] = 0
        words[row, word] = _bit(bit)
