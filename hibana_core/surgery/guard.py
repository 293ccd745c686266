"""The surgery guard: what a pass cost in quality, measured against the unmodified model.

    before the passes:  teacher-forced log-probabilities of the held-out text (kept on the host)
                        and a greedy continuation of each document's opening
    after each pass:    the same text through the rewritten model ->
        perplexity ratio        exp(mean NLL after - mean NLL before)
        mean KL                 KL(before || after) per position, in nats
        top-1 agreement         share of positions whose most likely token is unchanged
        first divergence        the first generated token where free greedy output differs
                                (teacher-forcing the unmodified model's continuation finds it:
                                up to there both models saw the same history), one decode row
                                a step as generation runs, so kernels that only decode rows take
                                (the GPU's int8 x for packed weights) are in this figure
        tool calls valid        at each "<tool_call>" of the conversations the model writes the
                                call; the share that parses as {"name": ..., "arguments": {...}}

The held-out text is the demo agents' conversations (`heldout/agent_traces.txt`: system prompts
with tool schemas, questions, tool calls and results), tokenized by the model's tokenizer, or a
text file the user passes. A checkpoint without a tokenizer is measured on seeded random tokens
instead, one document per held-out conversation, cut as the text would be: the figures then
compare the two models on tokens that are no language, so they are relative only (the record
and the table say so). A pass may declare floors (`floors = {"ppl_ratio": 1.005, ...}`); one over
its floor is refused with a SurgeryGuardError unless it is forced.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from hibana_core.errors import ConfigError, HibanaError, SurgeryGuardError
from hibana_core.forward_context import ForwardBatch, ForwardContext
from hibana_core.kv.cache import KVCache, kv_cache_dtype
from hibana_core.kv.recurrent_cache import RecurrentCache
from hibana_core.models.decoder import kv_layers
from hibana_core.progress import bar as progress_bar

HELDOUT = Path(__file__).parent / "heldout" / "agent_traces.txt"
DOCUMENT_SEPARATOR = "\n\n<|hibana-guard-document|>\n\n"
MAX_TOKENS = 4096       # held-out tokens scored in all
MAX_DOCUMENT = 1024     # tokens per document at most
OPENING = 128           # tokens of each document that open its greedy continuation
CONTINUATION = 48       # tokens of greedy continuation compared
GREEDY_TAIL = 64        # most tokens written greedily after a document (ToolCalls.MAX_TOKENS)
LOGIT_ROWS = 512        # positions whose logits the scorer holds on the device at once (V floats each)
MIN_PAST = 256          # scored positions past a pass's reach (`guard_reach`) that its figures ask
CHARS_PER_TOKEN = 64    # characters of a guard text read per token scored: its start holds them all
RANDOM_SEED = "hibana-guard"  # without a tokenizer (not calibration.py's seed: never score on calibration)
RANDOM_TEXT = "seeded random ids (the checkpoint has no tokenizer: figures are relative only)"


@dataclass
class GuardReport:
    ppl_ratio: float
    mean_kl: float | None        # None: not measured (an own cost whose floors do not ask for it)
    top1_agreement: float
    first_divergence: float      # mean over documents; CONTINUATION where none diverged
    tokens: int                  # positions scored
    tool_calls: float | None = None  # share of tool calls generated after "<tool_call>" that parse
    tool_calls_before: float | None = None  # the same share for the unmodified model

    def as_dict(self) -> dict[str, float]:
        return {"ppl_ratio": round(self.ppl_ratio, 5),
                "mean_kl": None if self.mean_kl is None else round(self.mean_kl, 6),
                "top1_agreement": round(self.top1_agreement, 5),
                "first_divergence": round(self.first_divergence, 2), "tokens": self.tokens,
                "tool_calls_valid": self.tool_calls, "tool_calls_valid_before": self.tool_calls_before}


@dataclass
class Reference:
    """The unmodified model's figures on the held-out documents."""

    documents: list[list[int]]
    reach: int = 0                                                   # the passes' (`guard_reach`): `opening`
    log_probs: list[torch.Tensor] = field(default_factory=list)     # [T - 1, V] float16, host (for KL);
                                                                     # none kept: no KL against it
    nll: list[torch.Tensor] = field(default_factory=list)           # [T - 1] float32: of the text's tokens
    top1: list[torch.Tensor] = field(default_factory=list)          # [T - 1]: most likely tokens
    continuations: list[list[int]] = field(default_factory=list)    # greedy after each opening
    call_prefixes: list[list[int]] = field(default_factory=list)    # histories ending in "<tool_call>"
    tool_calls: float | None = None                                  # share valid, unmodified model


def heldout_documents(tokenizer: Any, vocab_size: int, text_file: str | None = None,
                      max_positions: int | None = None, reach: int = 0) -> list[list[int]]:
    """The held-out text as token-id documents (at most MAX_TOKENS tokens in all), each short
    enough that the greedy text written after it stays within the model's `max_positions`.
    Without a tokenizer: seeded random tokens in the same documents (see `heldout_source`).

    `reach`: a pass changes nothing within a document's first `reach` tokens (the window pass:
    its sink and window); the documents are then consecutive parts of the text joined until they
    run `reach_margin(reach)` tokens past it (as far as the model's positions allow), and the
    total grows to three of them. A part of the user's `text_file` longer than a document is read
    as consecutive documents (a file need not mark its documents to be scored in full)."""
    path = guard_text_path(text_file)
    size = max(MAX_DOCUMENT, reach + reach_margin(reach)) if reach else MAX_DOCUMENT
    longest = size if max_positions is None else max(0, min(size, max_positions - GREEDY_TAIL))
    budget = max(MAX_TOKENS, 3 * longest) if reach else MAX_TOKENS
    try:  # the text's start alone: a corpus of gigabytes was read and tokenized whole for 4,096 tokens
        with path.open(encoding="utf-8") as file:
            text = file.read(CHARS_PER_TOKEN * budget)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"guard text {str(path)!r} cannot be read as UTF-8 text ({exc}); pass a UTF-8 text file") from None
    if tokenizer is None and text_file is not None:
        raise ConfigError(f"the surgery guard needs the model's tokenizer to read {str(path)!r}; this checkpoint "
                          "has none: leave surgery_guard_text out (the guard then measures on seeded random "
                          "tokens), add tokenizer files, or pass surgery_guard=False (`hibana surgery --no-guard`)")
    encode = _random_tokens(vocab_size) if tokenizer is None else \
        (lambda part: tokenizer(part, add_special_tokens=False)["input_ids"])
    joint = [] if tokenizer is None else [i for i in encode("\n\n") if i < vocab_size]
    documents, total, pending = [], 0, []
    parts = text.split(DOCUMENT_SEPARATOR)
    for n, part in enumerate(parts):
        ids = [i for i in encode(part) if i < vocab_size]
        if reach and pending:
            ids = pending + joint + ids
        pending = []
        if reach and len(ids) < longest and n + 1 < len(parts):
            pending = ids  # joined to the next part: a window pass is seen only past its reach
            continue
        for start in range(0, len(ids), longest) if text_file is not None and longest else [0]:
            piece = ids[start:start + longest][:budget - total]
            if len(piece) > OPENING + 1 and (len(piece) > reach or not documents):  # (within the reach: says nothing)
                documents.append(piece)
                total += len(piece)
            if total >= budget:
                break
        if total >= budget:
            break
    if not documents:
        short = "" if longest > OPENING + 1 else \
            f" (a model of {max_positions} positions leaves {longest} per document: skip what measures on it," \
            " surgery_guard=False (`hibana surgery --no-guard`), or use a drafter other than layer_skip)"
        if not short:
            short = (f"; give a longer text (documents are split at {DOCUMENT_SEPARATOR.strip()!r}; the guard scores "
                     f"up to {MAX_TOKENS} tokens), or leave surgery_guard_text out for the bundled agent traces")
        raise ConfigError(f"guard text {str(path)!r} holds no document longer than {OPENING + 1} tokens{short}")
    return documents


def guard_text_path(text_file: str | None) -> Path:
    """The held-out text's path (`text_file`, or the bundled agent traces), or a ConfigError where
    it is no regular file: the engine asks before the weights load, so that a wrong path is said
    at once rather than after minutes of loading."""
    path = Path(text_file) if text_file is not None else HELDOUT
    if not path.is_file():
        what = ("is a directory" if path.is_dir() else "is not a regular file" if path.exists()
                else "does not exist")
        raise ConfigError(f"guard text {str(path)!r} {what}; pass a UTF-8 text file")
    if text_file is not None:  # its bytes too (a binary or empty file was said only after the weights loaded)
        try:  # up to its first character that is no space, not the whole of a large corpus
            with path.open(encoding="utf-8") as file:
                while (chunk := file.read(1 << 20)) and not chunk.strip():
                    pass
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"guard text {str(path)!r} cannot be read as UTF-8 text ({exc}); "
                              "pass a UTF-8 text file") from None
        if not chunk.strip():
            raise ConfigError(f"guard text {str(path)!r} is empty: it holds no document longer than {OPENING + 1} "
                              f"tokens; give a longer text (the guard scores up to {MAX_TOKENS} tokens), or leave "
                              "surgery_guard_text out for the bundled agent traces")
    return path


def reach_margin(reach: int) -> int:
    """Tokens the guard's documents run past a pass's reach: half the reach, at least 128."""
    return max(128, reach // 2)


def _random_tokens(vocab_size: int):
    """A stand-in tokenizer that reads every document as MAX_DOCUMENT seeded random token ids
    (cut to the same lengths as real text that long): the same documents on every call."""
    rng = random.Random(RANDOM_SEED)
    return lambda part: [rng.randrange(vocab_size) for _ in range(MAX_DOCUMENT)]


def heldout_source(tokenizer: Any, text_file: str | None = None) -> str:
    """What `heldout_documents` measures on: the held-out file's name, or RANDOM_TEXT."""
    if tokenizer is None:
        return RANDOM_TEXT
    return HELDOUT.name if text_file is None else str(text_file)


class Scorer:
    """Whole-sequence forwards of the engine's model on a scratch KV cache (before the engine's
    own cache exists): logits at every position, and greedy continuations. The scratch cache
    follows the model's KV dtype as passes change it (after kv8 it is fp8, as the engine's
    will be, so the guard measures the fp8 cache too)."""

    def __init__(self, model: torch.nn.Module, ctx: ForwardContext, args: Any, dtype: torch.dtype,
                 device: torch.device, max_len: int, block_size: int = 16) -> None:
        self.model, self.ctx, self.device, self.block_size = model, ctx, device, block_size
        self.args, self.dtype = args, dtype
        self.blocks = -(-max_len // block_size)
        self.max_len = self.blocks * block_size
        self.cache = self._new_cache()
        shapes = getattr(model, "recurrent_shapes", None)  # a hybrid model's: its scratch slot, continued in order
        self.recurrent = RecurrentCache(shapes, 0, dtype, device) if shapes else None

    def _new_cache(self) -> KVCache:
        a = self.args
        return KVCache(kv_layers(a), self.blocks, self.block_size, a.num_kv_heads, a.head_dim,
                       kv_cache_dtype(self.model, self.dtype), self.device)

    def kv(self, tokens: Sequence[int]) -> torch.Tensor:
        """[num_layers, 2, len(tokens), H_kv, D]: the keys and values the model stores for
        `tokens`, one forward from position 0 (a view into the scratch cache)."""
        self._forward(tokens, 0, logits=False)
        return self.cache.data.flatten(2, 3)[:, :, :len(tokens)]

    def _forward(self, tokens: Sequence[int], start: int, logits: bool = True,
                 last: bool = False, hidden_only: bool = False) -> torch.Tensor | None:
        """Logits of tokens[start:] given the cache holds tokens[:start]; `last`: of the last
        token only (as generation asks the head for one row: [1, V]); `hidden_only`: the final
        hidden states instead (the head's input)."""
        n, bs = len(tokens), self.block_size
        new = n - start
        tensor = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype, device=self.device)  # noqa: E731
        batch = ForwardBatch(slot_mapping=tensor([list(range(start, n))]),  # one layer group
                             block_tables=tensor([[list(range(-(-n // bs)))]], torch.int32),
                             seq_lens=tensor([n], torch.int32), query_start_loc=tensor([0, new], torch.int32),
                             max_query_len=new, max_seq_len=n, **self._recurrent_fields(start))
        if self.cache.dtype != kv_cache_dtype(self.model, self.dtype):  # a pass changed it (kv8)
            self.cache = self._new_cache()
        saved, self.ctx.kv_cache = self.ctx.kv_cache, self.cache
        saved_recurrent, self.ctx.recurrent = self.ctx.recurrent, self.recurrent
        try:
            with torch.inference_mode(), self.ctx.forward_batch(batch):
                hidden = self.model(tensor(list(tokens[start:])), tensor(list(range(start, n))))
                if hidden_only:
                    return hidden
                return self.model.compute_logits(hidden[-1:] if last else hidden).float() if logits else None
        finally:
            self.ctx.kv_cache, self.ctx.recurrent = saved, saved_recurrent

    def _recurrent_fields(self, start: int) -> dict:
        """A hybrid model's batch fields: the scratch slot, holding the state of tokens[:start]
        (every forward here continues the one before it, or starts at 0)."""
        if self.recurrent is None:
            return {}
        return dict(state_slots=torch.tensor([self.recurrent.scratch], dtype=torch.int32, device=self.device),
                    has_state=torch.tensor([start > 0], device=self.device))

    def log_probs(self, tokens: Sequence[int]) -> torch.Tensor:
        """[T - 1, V] float32 on the host: log-probabilities of the token after each position but
        the last. The head runs LOGIT_ROWS positions at a time, so a long document (a window
        pass's, thousands of tokens) never holds its whole [T, V] logits on the device."""
        return torch.cat([logp.cpu() for _, logp in self._log_prob_rows(tokens)])

    def nll(self, tokens: Sequence[int]) -> float:
        """The summed negative log-likelihood of tokens[1:], on the device (`_log_prob_rows`)."""
        target = torch.tensor(list(tokens[1:]), device=self.device)
        return -sum(logp.gather(1, target[i:i + len(logp), None]).sum().item()
                    for i, logp in self._log_prob_rows(tokens))

    def _log_prob_rows(self, tokens: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """(first position, [<= LOGIT_ROWS, V] float32 log-probabilities on the device) for the
        token after each position but the last: one forward, the head a few hundred rows at a time."""
        hidden = self.hidden(tokens)[:-1]
        with torch.inference_mode():
            for i in range(0, hidden.shape[0], LOGIT_ROWS):
                yield i, torch.log_softmax(self.model.compute_logits(hidden[i:i + LOGIT_ROWS]).float(), dim=-1)

    def hidden(self, tokens: Sequence[int]) -> torch.Tensor:
        """The final hidden states of `tokens` ([T, hidden]): one forward, no head."""
        return self._forward(tokens, 0, hidden_only=True)

    def forced_greedy(self, opening: Sequence[int], continuation: Sequence[int]) -> list[int]:
        """This model's greedy choices along `continuation`, computed as generation computes them:
        the first from the opening's forward (a prefill whose head takes its last row alone),
        each next from a one-row forward (a decode step; on the GPU the int8-x kernels of packed
        weights take such rows); up to and
        including the first that differs from `continuation` (free greedy output is the same up
        to there)."""
        tokens = list(opening)
        logits = self._forward(tokens, 0, last=True)[-1]
        out: list[int] = []
        for token in continuation:
            out.append(int(logits.argmax()))
            if out[-1] != token or len(out) == len(continuation):
                break
            tokens.append(token)
            logits = self._forward(tokens, len(tokens) - 1, last=True)[-1]
        return out

    def greedy(self, opening: Sequence[int], n: int, stop: int | None = None) -> list[int]:
        tokens = list(opening)
        logits = self._forward(tokens, 0, last=True)[-1]
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            if out[-1] == stop or len(out) == n:
                break
            tokens.append(out[-1])
            logits = self._forward(tokens, len(tokens) - 1, last=True)[-1]
        return out


class ToolCalls:
    """Tool-call validity on agent turns: at each "<tool_call>" of the held-out conversations
    the model writes the call itself (greedy, up to "</tool_call>"); a call is valid when it is
    JSON with a string "name" and an object "arguments"."""

    MAX_CALLS = 12
    MAX_TOKENS = GREEDY_TAIL

    def __init__(self, tokenizer: Any, documents: list[list[int]]) -> None:
        ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")] \
            if tokenizer is not None and hasattr(tokenizer, "convert_tokens_to_ids") else [None, None]
        self.tokenizer, (self.open, self.close) = tokenizer, ids
        unknown = getattr(tokenizer, "unk_token_id", None)
        self.prefixes = [] if None in ids or unknown in ids else [
            doc[:i + 1] for doc in documents for i, t in enumerate(doc) if t == self.open][:self.MAX_CALLS]

    def validity(self, scorer: "Scorer") -> float | None:
        if not self.prefixes:
            return None
        valid = 0
        for prefix in self.prefixes:
            out = scorer.greedy(prefix, self.MAX_TOKENS, stop=self.close)
            if out and out[-1] == self.close:
                valid += _is_call(self.tokenizer.decode(out[:-1]))
        return valid / len(self.prefixes)


def _is_call(text: str) -> bool:
    try:
        call = json.loads(text.strip())
    except ValueError:
        return False
    return isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)


def opening(doc: Sequence[int], reach: int) -> list[int]:
    """The tokens of `doc` its greedy continuation starts from: its first OPENING, or past the
    passes' reach (a window pass changes nothing within it: a continuation from there never
    diverged, whatever the pass did past it)."""
    return list(doc[:max(OPENING, min(reach + 1, len(doc)))])


def measure_reference(scorer: Scorer, documents: list[list[int]], progress: bool,
                      calls: ToolCalls | None = None, reach: int = 0) -> Reference:
    reference = Reference(documents, reach)
    for doc in progress_bar(documents, desc="guard: unmodified model", unit="doc", disable=not progress, leave=False):
        _keep(reference, scorer, doc, scorer.log_probs(doc).cpu())
    if calls is not None:
        reference.tool_calls = calls.validity(scorer)
    return reference


def _keep(reference: Reference, scorer: Scorer, doc: list[int], log_probs: torch.Tensor,
          distributions: bool = True) -> None:
    """One document's figures of the model `scorer` runs, added to `reference` (its whole
    distributions with `distributions`: V numbers a position, for the KL against it)."""
    reference.nll.append(-log_probs.gather(1, torch.tensor(doc[1:])[:, None])[:, 0])
    reference.top1.append(log_probs.argmax(-1))
    if distributions:
        reference.log_probs.append(log_probs.half())
    reference.continuations.append(scorer.greedy(opening(doc, reference.reach), CONTINUATION))


@dataclass
class _Totals:
    """Sums over the documents of one comparison."""

    nll_ref: float = 0.0
    nll_new: float = 0.0
    kl: float | None = 0.0
    agree: float = 0.0
    divergences: list[int] = field(default_factory=list)


def measure(scorer: Scorer, references: Sequence[Reference], progress: bool, desc: str = "guard",
            calls: ToolCalls | None = None, keep: str | None = None) -> tuple[list[GuardReport], Reference | None]:
    """The model `scorer` runs, measured against each of `references` in one pass over the
    documents (the KL only against those that kept their distributions), and with `keep` its
    own figures as a Reference for the next pass's own cost: "distributions" with the KL's
    log-probabilities (as many bytes as the first reference's: V numbers a position), "light"
    without them."""
    documents = references[0].documents
    totals = [_Totals(kl=0.0 if r.log_probs else None) for r in references]
    kept = Reference(documents, references[0].reach) if keep else None
    positions = 0
    for i, doc in enumerate(progress_bar(documents, desc=desc, unit="doc", disable=not progress, leave=False)):
        new_lp = scorer.log_probs(doc).cpu()
        nll_new = -new_lp.gather(1, torch.tensor(doc[1:])[:, None]).sum().item()
        top1 = new_lp.argmax(-1)
        positions += len(doc) - 1
        for j, (r, total) in enumerate(zip(references, totals)):
            if total.kl is not None:
                ref = r.log_probs[i].float()
                if j:
                    r.log_probs[i] = None  # an earlier pass's model: read once
                total.kl += (ref.exp() * (ref - new_lp)).sum().item()
            total.nll_ref += r.nll[i].sum().item()
            total.nll_new += nll_new
            total.agree += (r.top1[i] == top1).sum().item()
            cont = r.continuations[i]
            forced = scorer.forced_greedy(opening(doc, r.reach), cont)
            total.divergences.append(next((k for k, (a, b) in enumerate(zip(forced, cont)) if a != b), len(cont)))
        if kept is not None:
            _keep(kept, scorer, doc, new_lp, distributions=keep == "distributions")
    valid = None if calls is None else calls.validity(scorer)
    if kept is not None:
        kept.tool_calls = valid
    # (KL is >= 0; its sum against the reference's float16 log-probabilities rounds to -1e-6 where nothing changed)
    reports = [GuardReport(math.exp((t.nll_new - t.nll_ref) / positions), None if t.kl is None else max(0.0, t.kl / positions),
                           t.agree / positions, sum(t.divergences) / len(t.divergences), positions,
                           valid, r.tool_calls)
               for r, t in zip(references, totals)]
    return reports, kept


def violations(report: GuardReport, floors: dict[str, float]) -> list[str]:
    """The floors `report` breaks: ceilings for ppl_ratio and mean_kl, floors for the rest. A
    perplexity ratio or KL that is not finite (a pass that wrote NaN or inf into the model) breaks
    every pass's floors, a pass without floors too: no bound holds it, and the model it leaves
    computes nothing."""
    broken = [f"{name} {getattr(report, name)}: the model's outputs are not finite numbers"
              for name in ("ppl_ratio", "mean_kl")
              if getattr(report, name) is not None and not math.isfinite(getattr(report, name))]
    for name, bound in floors.items():
        value = getattr(report, name)
        upper = name in ("ppl_ratio", "mean_kl")
        if value is None or not math.isfinite(value):
            continue  # said above (a figure not measured bounds nothing: `Guard` measures what floors ask)
        if (value > bound) if upper else (value < bound):
            broken.append(f"{name} {value:.4g} {'>' if upper else '<'} {bound:g}")
    return broken


def table(rows: list[tuple[str, GuardReport, str]]) -> str:
    width = max(24, *(len(name) + 2 for name, _, _ in rows))
    lines = [f"{'pass':<{width}}{'ppl ratio':>11}{'mean KL':>10}{'top-1':>8}{'diverges at':>13}"
             f"{'tool calls ok':>20}  decision"]
    never = f"never ({CONTINUATION})"  # no document's greedy continuation diverged within CONTINUATION tokens
    for name, r, decision in rows:
        calls = "-" if r.tool_calls is None else f"{r.tool_calls:.0%} (was {r.tool_calls_before:.0%})"
        shown = r.as_dict()  # the record's figures, which the command's summary prints too
        kl = "-" if shown["mean_kl"] is None else f"{shown['mean_kl']:.5f}"
        diverges = never if shown["first_divergence"] >= CONTINUATION else f"{shown['first_divergence']:.1f}"
        lines.append(f"{name:<{width}}{shown['ppl_ratio']:>11.4f}{kl:>10}{shown['top1_agreement']:>8.1%}"
                     f"{diverges:>13}{calls:>20}  {decision}")
    return "\n".join(lines)


class Guard:
    """Measures the unmodified model once (`measure_reference`, which the passes' runner calls
    after every pass has said it applies and before the first one changes the model), then after
    each pass its cumulative effect against it (the record's and the table's figures) and, for a
    pass after others, its own cost: against the model the earlier passes left, which is what
    the pass's floors bound (a forced w4 before kv8 does not make kv8 over its floors; the floors
    do not bound the passes' total). `source` names what the documents are
    (`heldout_source`); each record and the table say it."""

    def __init__(self, scorer: Scorer, documents: list[list[int]], progress: bool, tokenizer: Any = None,
                 source: str = HELDOUT.name, reach: int = 0) -> None:
        need = scorer_length(documents)
        if scorer.max_len < need:  # greedy text is generated past a document's end
            raise ValueError(f"the guard's scorer holds {scorer.max_len} tokens; it needs {need}")
        self.scorer, self.progress, self.source, self.documents = scorer, progress, source, documents
        self.reach = reach  # the passes' longest: greedy continuations start past it (`opening`)
        self.calls = ToolCalls(tokenizer, documents)
        self.reference: Reference | None = None
        self.before: Reference | None = None  # the model after the passes checked so far
        self.passes: list[str] = []           # those passes
        self.rows: list[tuple[str, GuardReport, str]] = []

    def measure_reference(self) -> None:
        """The unmodified model's figures (once): call it before any pass changes the model."""
        if self.reference is None:
            self.reference = measure_reference(self.scorer, self.documents, self.progress, self.calls, self.reach)

    def check(self, name: str, surgery_pass: Any, force: bool, *, later: Sequence[Any],
              params: dict[str, Any] | None = None) -> dict[str, Any]:
        """The pass's record figures; a SurgeryGuardError where its own cost is over its floors,
        or cannot be seen on the documents (fewer than MIN_PAST scored positions past the pass's
        `guard_reach(params)`), and it is not forced. `later`: the passes that follow; the next one's own cost is measured
        against this pass's model (its distributions kept only where that pass's floors bound the KL)."""
        if self.reference is None:
            raise RuntimeError("Guard.check before measure_reference: the reference must be the unmodified model")
        if self.passes and self.before is None:
            raise RuntimeError(f"Guard.check of {name!r}: the check of {self.passes[-1]!r} was told no pass follows")
        references = [self.reference] if self.before is None else [self.reference, self.before]
        kl = bool(later) and "mean_kl" in (getattr(later[0], "floors", None) or {})  # the next one's own cost
        keep = None if not later else "distributions" if kl else "light"
        reports, self.before = measure(self.scorer, references, self.progress, desc=f"guard: after {name}",
                                       calls=self.calls, keep=keep)
        report, own = reports[0], reports[-1]
        floors = dict(getattr(surgery_pass, "floors", {}) or {})
        broken = violations(own, floors)
        reach, longest = guard_reach(surgery_pass, params), max(map(len, self.documents))
        past = sum(max(0, len(d) - 1 - reach) for d in self.documents) if reach else None
        unseen = past is not None and past < MIN_PAST  # figures of ~1.0 from positions it cannot change
        if unseen:
            broken.insert(0, f"not measured: the guard's documents reach {longest} tokens and the pass changes "
                             f"nothing within {reach} ({past} scored positions past it, {MIN_PAST} asked)")
        decision = "ok" if not broken else ("forced: " if force else "refused: ") + "; ".join(broken)
        after = " + ".join(self.passes)
        if after:
            self.rows += [(f"{name} (after {after})", report, ""), (f"  {name}'s own cost", own, decision)]
        else:
            self.rows.append((name, report, decision))
        if broken and not force and unseen:
            raise SurgeryGuardError(
                f"surgery pass {name!r} cannot be measured on {self.source}: its documents reach {longest} "
                f"tokens (all the text holds, within the model's positions) and the pass changes nothing within "
                f"{reach}: {past} scored positions lie past it, {MIN_PAST} are asked; give a longer guard text "
                f"(surgery_guard_text=PATH, `hibana surgery --guard-text PATH`), {_advice(surgery_pass)}, or force it: surgery=[{{'name': {name!r}, 'force': True}}]")
        if broken and not force:
            against = f"the model {after} left" if after else "the unmodified model"
            raise SurgeryGuardError(
                f"surgery pass {name!r} costs more quality than its floors allow ({'; '.join(broken)}), "
                f"measured on {report.tokens} tokens of {self.source} against {against}:\n"
                f"{table(self.rows)}\n{_advice(surgery_pass)}, "
                f"or force it: surgery=[{{'name': {name!r}, 'force': True}}]")
        self.passes.append(name)
        record = {**report.as_dict(), "text": self.source, "floors": floors, "decision": decision}
        if after:
            record["own_cost"] = {**own.as_dict(), "after": list(self.passes[:-1])}
        return record

    def summary(self) -> str:
        tokens = sum(len(d) - 1 for d in self.documents)
        return f"surgery guard, {tokens} tokens of {self.source}:\n{table(self.rows)}"


def guard_reach(surgery_pass: Any, params: dict[str, Any] | None) -> int:
    """Tokens at the start of a document within which the pass changes nothing (its optional
    `guard_reach(params)`; 0 without one)."""
    reach = getattr(surgery_pass, "guard_reach", None)
    if not callable(reach) or params is None:
        return 0
    try:
        value = reach(params)
    except HibanaError:
        raise
    except Exception as exc:  # a plugin's bug: named, as the passes' runner names its others
        from hibana_plugins.manager import describe_registered

        raise ConfigError(f"surgery pass {describe_registered(surgery_pass)} raised {type(exc).__name__} from "
                          f"guard_reach ({exc}); fix the pass, or leave it out of surgery") from exc
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _advice(surgery_pass: Any) -> str:
    """What to do about a refused pass: its own `advice` where it gives one."""
    advice = getattr(surgery_pass, "advice", None)
    return advice if isinstance(advice, str) and advice else "leave the pass out"


def scorer_length(documents: list[list[int]]) -> int:
    """Tokens a guard's scorer must hold: the longest document and a greedy text after it."""
    return max(len(d) for d in documents) + max(CONTINUATION, ToolCalls.MAX_TOKENS)
