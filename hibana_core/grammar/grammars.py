"""The engine's grammar side (`Grammars`): the tokenizer as xgrammar reads it, a cache of
compiled grammars (one compile per distinct constraint, bounded by count and by bytes), a
`Matcher` per request, and each step's masks, filled on a worker thread and copied to the
device."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch

from hibana_core.config import SamplingParams
from hibana_core.errors import GrammarError
from hibana_core.grammar.backend import _message, _xgrammar
from hibana_core.grammar.bitmask import _POPCOUNT16, _bit, allowed_tokens
from hibana_core.grammar.json_schema import compact_json_tag, json_schema_grammar
from hibana_core.grammar.keywords import check_held
from hibana_core.grammar.matcher import FORCED_MAX_WORDS, VERIFY_MAX, Matcher
from hibana_core.grammar.regex import held_regex, unenforced_regex
from hibana_core.grammar.satisfiable import rules_without_finite_string
from hibana_core.grammar.utf8 import _BAD_SECOND, Utf8Rows, _never_utf8, _no_character_after, _whole_utf8
from hibana_core.kv.transfers import device_tensor
from hibana_core.sampler import TokenMasks

if TYPE_CHECKING:
    from hibana_core.scheduler import SchedulerOutput

CACHE_SIZE = 256
"""Compiled grammars kept per engine (least recently used dropped)."""
CACHE_BYTES = 1 << 30
"""And their bytes at most (xgrammar's `memory_size_bytes`): a grammar's token masks grow with the
vocabulary and the schema, so 256 large schemas over a 151k vocabulary could hold gigabytes of host
memory; the one just compiled is kept whatever its size."""
BATCH_FILL_ROWS = 8
"""From this many rows without drafts, masks are filled by xgrammar's thread pool in one call."""
MAX_FILL_THREADS = 8
"""Threads of xgrammar's pool that fills a batch's masks: 32 rows of a 151k vocabulary under a JSON
schema took 5.9 ms serially on the H200 machine's host, 3.3 ms with 2 threads, 2.1 with 4, 2.0 with
8 and 2.3 with 16 (`python -m hibana_bench.grammar_libs --walks 32`)."""


def fill_threads() -> int:
    """Half the cores this process may run on (the engine's own threads and the callers' need
    the rest), at most MAX_FILL_THREADS. xgrammar's own "auto" takes half of the machine's hardware
    threads, which in a container limited to a few cores of a large host oversubscribes them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, min(MAX_FILL_THREADS, cores // 2))


STAGING_BUFFERS = 2
"""Pinned host bitmasks a CUDA engine fills in turn (one step's copy may still be queued while
the next is filled: never, as steps run, but two cost nothing)."""
SPELLINGS_CACHED = 4096
"""Forced strings whose tokens are kept (the table is emptied when full)."""


TOKEN_LISTS = frozenset({"trigger_tokens", "exclude_tokens"})
"""A structural tag's fields that list tokens (ids, or texts of the vocabulary)."""
UNSPELLABLE = b"\xff"
"""What a control token that a grammar names is spelled with, before its text, in the vocabulary
xgrammar reads: no UTF-8 text holds the byte 0xFF, so no text rule (JSON, a regex, free text) can
produce the token, and only the grammar's `token` format reaches it (by id)."""


@dataclasses.dataclass(frozen=True)
class _Vocabulary:
    """A grammar compiler over the vocabulary as one set of grammars sees it: the control tokens
    they name (`Grammars.compile`) spelled for `token` formats alone, every other one blanked
    (`refused`: xgrammar then never allows it, stop tokens aside)."""

    compiler: Any
    refused: frozenset[int]


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A compiled grammar, the control tokens its matchers refuse (`_Vocabulary.refused`), and the
    tokens it names by `token` formats (`own`: a stop token among them is text that ends it)."""

    grammar: Any
    refused: frozenset[int]
    own: frozenset[int] = frozenset()


def _size(compiled: _Compiled) -> int:
    """A cached grammar's host bytes, as xgrammar counts them."""
    return int(getattr(compiled.grammar, "memory_size_bytes", 0) or 0)


class Grammars:
    """The engine's grammar side: one tokenizer description, a cache of compiled grammars, and
    the masks of each step. The tokenizer is described on first use (0.6 s for a 151k
    vocabulary), so engines that never constrain pay nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.device = tokenizer, vocab_size, device
        self.eos_token_ids = sorted(eos_token_ids)
        self.width = -(-vocab_size // 32)
        self._detected: Any = None  # xgrammar's reading of the tokenizer
        self._bytes: list[bytes] = []  # each token's bytes in that reading (its decoded_vocab, read once)
        self._control: dict[int, str] = {}  # id -> text of the tokenizer's control tokens
        self._vocabularies: dict[frozenset[int], _Vocabulary] = {}  # by the control tokens named
        self._batch: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, _Compiled] = collections.OrderedDict()
        self._cache_bytes = 0  # of the grammars in it (`CACHE_BYTES`)
        self._compiling: dict[tuple, concurrent.futures.Future] = {}  # compiles under way: one per grammar
        self._spellings: dict[str, tuple[int, ...]] = {}
        self._suspects: torch.Tensor | None = None  # see `suspects`
        self._utf8: Utf8Rows | None = None  # see `utf8_rows`
        self._suspect_words: tuple[np.ndarray, np.ndarray] | None = None  # see `_suspects_allowed`
        self._staging: list[tuple[torch.Tensor, Any]] = []  # pinned host bitmasks and their copies' events
        self._next_staging = 0
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # fills masks beside the step loop
        self._filling: concurrent.futures.Future | None = None

    def spell(self, text: str) -> tuple[int, ...]:
        """The tokenizer's tokens of a forced string (cached: grammars force the same keys and
        names again and again)."""
        tokens = self._spellings.get(text)
        if tokens is None:
            if len(self._spellings) >= SPELLINGS_CACHED:
                self._spellings.clear()
            tokens = self._spellings[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return tokens

    # --- compiling ----------------------------------------------------------------------------

    def _vocabulary(self, named: frozenset[int] = frozenset()) -> _Vocabulary:
        """The compiler of grammars that name the control tokens `named` (most name none)."""
        detected = self._describe()
        with self._lock:
            vocabulary = self._vocabularies.get(named)
            if vocabulary is None:
                xgr = _xgrammar()
                info = self._tokenizer_info(xgr, detected, named)
                vocabulary = self._vocabularies[named] = _Vocabulary(
                    xgr.GrammarCompiler(info, cache_enabled=False), frozenset(info.special_token_ids))
                self._batch = self._batch or xgr.BatchGrammarMatcher(max_threads=fill_threads())
            return vocabulary

    def _describe(self) -> Any:
        """xgrammar's reading of the tokenizer (each token's bytes), and its control tokens
        (`_control`); made once."""
        with self._lock:
            if self._detected is None:
                if self.tokenizer is None:
                    raise GrammarError("constrained decoding needs the model's tokenizer, and this checkpoint has "
                                       "none; load a checkpoint with tokenizer files")
                from hibana_core.prompt import control_strings

                vocab = self.tokenizer.get_vocab()
                self._control = {vocab[text]: text for text in control_strings(self.tokenizer)
                                 if vocab.get(text, self.vocab_size) < self.vocab_size}
                detected = _xgrammar().TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
                self._bytes = list(detected.decoded_vocab)  # (the property builds a new list each read)
                self._detected = detected
            return self._detected

    def _tokenizer_info(self, xgr, detected: Any, named: frozenset[int]) -> Any:
        """The vocabulary as xgrammar reads it, with the control tokens blanked (xgrammar then
        treats them as special and allows them nowhere but as a matcher's stop tokens) but those in `named`,
        spelled `UNSPELLABLE` + their text: reached by a `token` format only."""
        vocab = list(self._bytes)
        for index, text in self._control.items():
            vocab[index] = UNSPELLABLE + text.encode() if index in named else b""
        metadata = json.loads(detected.dump_metadata())
        metadata["vocab_type"] = xgr.VocabType.RAW.value  # the bytes above, taken as they are
        # no stop tokens of its own: each matcher names its request's; a blank stop token here would
        # not be special, and a blank token that is not special is allowed anywhere, as nothing
        metadata["stop_token_ids"] = []
        return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, json.dumps(metadata))

    @staticmethod
    def _key(params: SamplingParams) -> tuple[str, str]:
        """A request's constraint as the cache knows it: its kind and its text."""
        if params.json_schema is not None:
            try:  # a loose schema compiles what a strict one refuses: apart in the cache
                return ("json_schema" if params.strict_schema else "json_schema_loose",
                        json.dumps(params.json_schema, sort_keys=False))
            except (TypeError, ValueError) as exc:
                raise GrammarError(f"the JSON schema is not plain JSON data ({exc})") from None
        if params.regex is not None:
            return "regex", params.regex
        if isinstance(params.grammar, str):
            return "ebnf", params.grammar
        return "structural_tag", json.dumps(params.grammar, sort_keys=False, default=str)

    def cached(self, params: SamplingParams) -> bool:
        """Whether `compile(params)` would return at once: the grammar is compiled already."""
        key = self._key(params)
        with self._lock:
            return key in self._cache

    def compile(self, params: SamplingParams) -> _Compiled:
        """The compiled grammar of a request's constraint (cached); GrammarError if it has none
        that compiles."""
        key = self._key(params)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            running = self._compiling.get(key)
            if running is None:  # this call compiles; the same grammar asked meanwhile waits for it
                running = self._compiling[key] = concurrent.futures.Future()
                mine = True
            else:
                mine = False
        if not mine:
            return running.result()  # its GrammarError too
        try:
            compiled = self._compile(key[0], params)  # outside the lock: it may take seconds
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            running.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._cache[key] = compiled
            self._cache_bytes += _size(compiled)
            while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_BYTES):
                self._cache_bytes -= _size(self._cache.popitem(last=False)[1])
        running.set_result(compiled)
        return compiled

    def _compile(self, kind: str, params: SamplingParams) -> _Compiled:
        """A request's constraint compiled over the vocabulary its grammar sees: a structural
        tag's with the control tokens it names (`_named_tokens`), every other one's with none."""
        tag, named = None, frozenset()
        if kind == "structural_tag":
            tag, named = self._named_tokens(compact_json_tag(params.grammar))
        vocabulary = self._vocabulary(frozenset(t for t in named if t in self._control))
        compiled = self._compiled(vocabulary.compiler, kind, params, tag)
        if kind in ("regex", "ebnf"):
            self._check_startable(compiled, kind)
        return _Compiled(compiled, vocabulary.refused, named)

    def _check_startable(self, compiled: Any, kind: str) -> None:
        """A GrammarError where the grammar allows no first token and not the empty output (a
        regex of an empty class, `[^\\s\\S]`): the request would fail at its first step, after
        its prompt was computed, blaming the model's token."""
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not matcher.is_completed() and not bitmask.any():
            what = {"regex": "regex", "ebnf": "grammar"}[kind]
            raise GrammarError(f"the {what} matches no output: no character can start it (an empty character "
                               f"class such as [^\\s\\S]?); fix the {what}")

    @staticmethod
    def _compiled(compiler: Any, kind: str, params: SamplingParams, tag: dict | None) -> Any:
        xgr = _xgrammar()
        if kind == "json_schema":
            check_held(params.json_schema)
        if kind in ("json_schema", "json_schema_loose"):
            return compiler.compile_grammar(json_schema_grammar(params.json_schema))
        unheld = unenforced_regex(params.regex) if kind == "regex" else []
        if unheld:
            raise GrammarError(f"the regex has parts the grammar cannot hold the output to "
                               f"({'; '.join(f'{part}: {todo}' for part, todo in unheld)}): the output could "
                               "break them")
        what = {"regex": "regex", "ebnf": "grammar", "structural_tag": "structural tag"}[kind]
        try:
            if kind == "regex":
                compiled = compiler.compile_regex(held_regex(params.regex))
                try:  # the output is held as Python's re reads the regex: xgrammar took "[\d-z]", which re refuses
                    re.compile(params.regex)
                except re.error as exc:
                    raise GrammarError(f"the regex is no regex Python's re reads ({exc}); fix it") from None
                return compiled
            if kind == "ebnf":
                grammar = xgr.Grammar.from_ebnf(params.grammar)
                endless = rules_without_finite_string(str(grammar))
                if "root" in endless:
                    raise GrammarError(f"the grammar has no finite string: its rules {', '.join(endless)} never end "
                                       "(every alternative leads back to one of them); give each a way out")
                return compiler.compile_grammar(grammar)
            return compiler.compile_structural_tag(xgr.StructuralTag.from_json(json.dumps(tag)))
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - RuntimeError from C++, pydantic's ValidationError
            raise GrammarError(f"the {what} cannot be compiled: {_message(exc)}; fix it (xgrammar's "
                               "syntax) or drop the constraint") from None

    def _named_tokens(self, tag: Any) -> tuple[Any, frozenset[int]]:
        """`tag` with each `token` format's token as an id (a text is looked up in the
        tokenizer's vocabulary), and the ids of those tokens. JSON schemas are content,
        not formats: they are left as they are. A token format marked `"if_known": true` that
        names no token of the vocabulary is nothing (an empty string): a format's optional marker
        (Llama 3's <|python_tag|>) on a model without it."""
        self._describe()  # the control tokens
        vocab = self.tokenizer.get_vocab()
        named: set[int] = set()

        def known(token: Any) -> int:
            """`token` (an id, or a text of the vocabulary) as an id, named."""
            token = vocab.get(token, token) if isinstance(token, str) else token
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise GrammarError(f"the structural tag names the token {token!r:.80}, which is no token of this "
                                   f"model's vocabulary ({self.vocab_size} tokens); name a token by its id or by "
                                   "its text in the tokenizer")
            named.add(token)
            return token

        def walk(node: Any) -> Any:
            if isinstance(node, list):
                return [walk(v) for v in node]
            if not isinstance(node, dict):
                return node
            if node.get("type") != "token":  # (token_triggered_tags' lists of tokens too)
                return {k: v if k == "json_schema" else [known(t) for t in v] if k in TOKEN_LISTS
                        and isinstance(v, list) else walk(v) for k, v in node.items()}
            token = node.get("token")
            if isinstance(token, str):
                token = vocab.get(token, token)
            if node.get("if_known") is True and (not isinstance(token, int) or not 0 <= token < self.vocab_size):
                return {"type": "const_string", "value": ""}  # a token the format names only where it exists
            node = {k: v for k, v in node.items() if k != "if_known"}
            return {**node, "token": known(node.get("token"))}

        return walk(tag), frozenset(named)

    def matcher(self, params: SamplingParams, stop_token_ids: Iterable[int]) -> Matcher | None:
        """A matcher for one request (None when it is not constrained); its stop tokens are the
        request's, allowed only where the grammar is complete. With ignore_eos the end-of-sequence
        tokens stay the grammar's last resort: the output goes on past a complete grammar while it
        allows more (`[a-z]+` runs to max_tokens) and ends where it allows nothing else."""
        if not params.constrained:
            return None
        compiled = self.compile(params)
        self.suspects()  # made here, on the caller's thread, not in a step's fill
        last_resort = self.eos_token_ids if params.ignore_eos else ()
        return Matcher(compiled.grammar, stop_token_ids, self.spell, compiled.refused, self._bytes, last_resort,
                       self.utf8_rows(), compiled.own)

    # --- one step's masks ---------------------------------------------------------------------

    def masks(self, scheduled: "SchedulerOutput", total_rows: int) -> TokenMasks | None:
        """The masks of a step's constrained rows (None when none is): a row per sampling chunk,
        and one per draft it verifies. Rows of a request that finished meanwhile, or whose
        grammar ended, allow everything: their tokens are dropped."""
        return self.start_masks(scheduled, total_rows, background=False)()

    def start_masks(self, scheduled: "SchedulerOutput", total_rows: int,
                    background: bool = True) -> Callable[[], TokenMasks | None]:
        """`masks`, filled on the grammar's worker thread while the caller goes on (the engine
        processes the previous step's outputs meanwhile: xgrammar's fills release the GIL); the
        function returned waits for the fill and copies the masks to the device. Which rows are
        live is read now; until the function returns, only the fill touches the matchers."""
        constrained: list[tuple[Matcher | None, tuple[int, ...]]] = []
        rows: list[int] = []
        row = 0
        for chunk in scheduled.sampling:
            request, n = chunk.request, 1 + len(chunk.draft_token_ids)
            if request.grammar is not None:
                live = not request.finished and not request.grammar.done
                constrained.append((request.grammar if live else None, chunk.draft_token_ids))
                rows.extend(range(row, row + n))
            row += n
        if not constrained:
            return lambda: None
        self.wait_fill()  # a fill whose step failed meanwhile: never two on one buffer
        bitmask, copied = self._host_bitmask(len(rows))  # not initialized: xgrammar writes a live row whole

        def finish() -> TokenMasks:
            every = len(rows) == total_rows
            on_device = bitmask.to(self.device, non_blocking=True)
            if copied is not None:
                copied.record()  # the copy's end: when the buffer is free again
            return TokenMasks(on_device, device_tensor(rows, torch.int64, self.device), every)

        if not background:
            self._fill(constrained, bitmask)
            return finish
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hibana-grammar")
        self._filling = self._worker.submit(self._fill, constrained, bitmask)

        def wait() -> TokenMasks:
            filling, self._filling = self._filling, None
            filling.result()  # the fill's error, if any, is the step's
            return finish()

        return wait

    def _fill(self, constrained: list[tuple[Matcher | None, tuple[int, ...]]], bitmask: torch.Tensor) -> None:
        suspects = self.suspects()
        batch: list[tuple[Matcher, int]] = []
        at = 0
        for matcher, drafts in constrained:
            if matcher is None or drafts:  # all allowed, but where a verify step's matcher reaches
                for i in range(at, at + 1 + len(drafts)):
                    bitmask[i].fill_(-1)  # a row at a time: below the size torch spreads over threads
                if matcher is not None:
                    matcher.fill(bitmask, at, drafts, suspects)
            else:
                batch.append((matcher, at))
            at += 1 + len(drafts)
        if len(batch) >= BATCH_FILL_ROWS:
            rows = [i for _, i in batch]
            self._batch.batch_fill_next_token_bitmask([m._matcher for m, _ in batch], bitmask, rows)
            for matcher, i in batch:  # first, as `Matcher.fill` does: a forced string's first token may be one
                matcher.hold_stops(bitmask, i)
            free = np.count_nonzero(bitmask.numpy()[rows], axis=1) > FORCED_MAX_WORDS  # all rows at once
            for (matcher, i), row_free in zip(batch, free.tolist()):
                matcher.spell_forced(bitmask, i, free=row_free)
            # the rows that allow a few suspects, found for all at once (most allow none, or
            # hundreds: a string's content)
            for (matcher, i), count in zip(batch, self._suspects_allowed(bitmask, rows)):
                if 0 < count <= VERIFY_MAX:
                    matcher.drop_refused(bitmask, i, suspects)
            bitmask[rows] &= self.utf8_rows().keep  # all rows at once (`Matcher.hold_utf8`)
            for matcher, i in batch:  # last, as `Matcher.fill` does: a row's mask is one function of its state
                matcher.hold_back(bitmask, i)
                matcher.hold_after_lead(bitmask, i)
        else:
            for matcher, i in batch:
                matcher.fill(bitmask, i, suspects=suspects)

    def suspects(self) -> torch.Tensor:
        """A bitmask row of the tokens whose bytes, as xgrammar reads them, are not whole UTF-8 (a
        character cut at an end, or bytes that are none): the tokens `Matcher.drop_refused` checks."""
        if self._suspects is None:
            self._suspects = self._row(lambda text: not _whole_utf8(text))
        return self._suspects

    def utf8_rows(self) -> "Utf8Rows":
        """The bitmask rows `Matcher.hold_utf8` clears: tokens in no UTF-8 text, and those that
        start with a byte that spells no character after each lead byte of _BAD_SECOND."""
        if self._utf8 is None:
            never = self._row(_never_utf8)
            self._utf8 = Utf8Rows(~never, {lead: ~self._row(functools.partial(_no_character_after, lead))
                                           for lead in _BAD_SECOND},
                                  frozenset(allowed_tokens(never, self.vocab_size)))
        return self._utf8

    def _row(self, takes: Callable[[bytes], bool]) -> torch.Tensor:
        """A bitmask row with the bits of the tokens whose bytes (xgrammar's reading) `takes`."""
        words = [0] * self.width
        self._describe()
        for token, text in enumerate(self._bytes[:self.vocab_size]):
            if takes(text):
                words[token // 32] |= _bit(token % 32)
        return torch.tensor(words, dtype=torch.int32)

    def _suspects_allowed(self, bitmask: torch.Tensor, rows: list[int]) -> list[int]:
        """How many suspect tokens each of `rows` allows: the bits set in the row and in
        `suspects`, counted over the few words that hold any (389 of 4,740 for a 151k byte-level
        BPE), 16 bits a lookup (0.7 ms less a batch-32 fill than a test per row)."""
        if self._suspect_words is None:
            words = self.suspects().numpy().view(np.uint32)
            held = np.flatnonzero(words)
            self._suspect_words = held, words[held]
        held, bits = self._suspect_words
        found = np.ascontiguousarray(bitmask.numpy().view(np.uint32)[np.ix_(rows, held)] & bits)
        return _POPCOUNT16[found.view(np.uint16)].sum(axis=1).tolist()

    def wait_fill(self) -> None:
        """Wait for a fill started by `start_masks` whose result nobody will take (its step
        failed): until it ends, it owns the matchers."""
        if self._filling is not None:
            self._filling.exception()
            self._filling = None

    def close(self) -> None:
        """Stop the worker thread (an engine's close)."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    def _host_bitmask(self, rows: int) -> tuple[torch.Tensor, Any]:
        """`rows` rows of a host bitmask, not initialized (filling 600 KB a step with -1 cost up to
        a millisecond where torch spread it over busy cores). Off CUDA a new tensor; on CUDA one of
        STAGING_BUFFERS pinned buffers taken in turn (pinning one per step went to the driver while
        the forward ran), once the copy that last read it has ended (long done: a step's masks are
        filled after the previous step's tokens, sampled after its copy, came back). With it the
        event to record once the copy is enqueued (None off CUDA)."""
        if self.device.type != "cuda":
            return torch.empty((rows, self.width), dtype=torch.int32), None
        if len(self._staging) < STAGING_BUFFERS:
            self._staging.append((torch.empty(0, self.width, dtype=torch.int32), torch.cuda.Event()))
        slot = self._next_staging % len(self._staging)
        buffer, copied = self._staging[slot]
        copied.synchronize()  # returns at once for an event never recorded
        if buffer.shape[0] < rows:  # room for the largest step so far
            buffer = torch.empty(max(rows, 2 * buffer.shape[0]), self.width, dtype=torch.int32, pin_memory=True)
            self._staging[slot] = (buffer, copied)
        self._next_staging = slot + 1
        return buffer[:rows], copied
