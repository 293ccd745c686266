"""Turn a batch of logits into one token per row: grammar masks, penalties, greedy, temperature,
top-k/p, min-p.

The order follows Hugging Face and vLLM:

    (constrained rows: grammar mask) -> logit bias -> penalties -> (greedy rows: argmax) -> temperature
    -> top-k -> top-p -> min-p -> sample -> (rows verifying a drawn draft: kept at min(1, p/q))

A grammar mask (`TokenMasks`, filled on the host by `hibana_core.grammar`) sets the logits of the
tokens a row's grammar forbids to -inf, on the constrained rows only; a batch without one costs
nothing extra.

Every stage runs batched, with per-row parameters as [B, 1] tensors built once per call, and is
skipped when no row needs it: an all-greedy batch without penalties is a single argmax. Sampling
is the exponential race (argmax of probs / Exp(1) noise, as in gpt-fast's
`multinomial_sample_one_no_sync`), so nothing is read back to the host. A row with a seed draws its
noise from its own generator, so its tokens depend on nothing else in the batch; rows without one
share the sampler's generator.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch

from hibana_core.config import GREEDY_TEMPERATURE, SamplingParams, needs_history
from hibana_core.kv.transfers import device_tensor, small_to_device

_NEG_INF = float("-inf")
# Floor on the Exp(1) noise: exponential_ may return exactly 0 on some backends, and p / 0 gives
# inf (a biased pick) or, for a masked token, NaN, which argmax would pick.
_TINY = torch.finfo(torch.float32).tiny
_MAX = torch.finfo(torch.float32).max
# Bound on a penalised logit: divided by the least sampled temperature (GREEDY_TEMPERATURE), it
# stays finite (an inf logit makes its whole row NaN, and NaN rows draw token 0).
_PENALISED_MAX = _MAX * GREEDY_TEMPERATURE / 2


class DraftRow(NamedTuple):
    """The draft a sampling row verifies where the drafter said its distribution q."""

    token: int
    q: torch.Tensor
    """[V'] float32, V' <= the logits' width (a drafter's vocabulary may be narrower)."""
    drawn: bool
    """Drawn from q: the row's token is the draft with probability min(1, p(draft) / q(draft)),
    else a draw from max(0, p - q), in distribution p as any row's token (speculative sampling).
    False: chosen (q's argmax), kept where the row's own draw equals it; q is measured only."""
    position: int
    """Which of its chunk's drafts (0: the first, whose estimates the speculator reads)."""


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample this step."""

    params: SamplingParams
    generator: torch.Generator | None
    """Per-request generator when params.seed is set (see `make_generator`), else None."""
    prompt: Sequence[int]
    """Token ids before this request's generation (the repetition penalty also covers these)."""
    output: Sequence[int]
    """Tokens generated so far by this request (presence and frequency penalties count these)."""
    draw: int = 0
    """Which of the request's tokens this row samples (0: its first). A seeded row's noise
    depends on its seed and this index alone, so its tokens are the same whatever the batch
    and whether drafts were verified in between."""
    draft: DraftRow | None = None
    """The draft this row verifies, where the drafter said its distribution (None: no draft, or
    token ids alone, kept where the row's own draw equals them)."""


@dataclass(frozen=True)
class TokenMasks:
    """The grammar masks of one step's constrained rows, already on their way to the device."""

    bitmask: torch.Tensor
    """[R, ceil(V / 32)] int32: bit j of word w allows token 32 w + j (little-endian words)."""
    rows: torch.Tensor
    """[R] int64: the sampling row each mask applies to."""
    every_row: bool
    """Whether every row of the step is constrained (rows is then 0..R-1)."""


@dataclass(frozen=True)
class DraftEstimates:
    """What drawn and chosen drafts keep, where the target verified a draft with its q."""

    rows: list[int]
    """The sampling rows (each a chunk's first draft)."""
    kept: torch.Tensor
    """[D, 2] float32: sum(min(p, q)) (drawn) and p(argmax q) (chosen) at each."""


@dataclass(frozen=True)
class StepLogprobs:
    """Log-probabilities of the tokens sampled for the rows that asked for them (on the device)."""

    rows: list[int]
    """The sampling rows these are for."""
    chosen: torch.Tensor
    """[W] float32: each row's sampled token's log-probability."""
    top_values: torch.Tensor
    """[W, K] float32: the K most likely tokens' log-probabilities (K: the most any row asked for)."""
    top_ids: torch.Tensor
    """[W, K] int64: their token ids."""


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed`: one per seeded request, and the sampler's own."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Small and pure: turns a batch of logits into one token per row."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)
        """Noise for the rows that have no generator of their own."""
        self._bias_tables: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 masks: TokenMasks | None = None) -> torch.Tensor:
        """logits [B, V] (any float dtype) -> token ids [B] int64 on logits.device; `masks`: the
        grammar masks of the constrained rows."""
        return self.sample(logits, rows, masks)[0]

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               masks: TokenMasks | None = None) -> "tuple[torch.Tensor, DraftEstimates | None]":
        """The token ids, as `__call__` gives them, and what drawn and chosen drafts keep at each
        chunk's first draft whose drafter said q (`_draft_estimates`: None where none did)."""
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{len(rows)} sampling rows for {logits.shape[0]} rows of logits")
        if masks is not None:
            logits = self.apply_masks(logits, masks)
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]
        penalised = any(needs_history(p) for p in params)
        biased = any(p.logit_bias for p in params)
        if all(greedy) and not penalised and not biased:
            return logits.argmax(dim=-1), None  # the hot path: nothing else runs (a row with q samples)

        x = logits.float()  # [B, V]; may be `logits` itself, so every op below is out of place
        if biased:
            x = apply_logit_bias(x, params)
        if penalised:
            x = apply_penalties(x, rows)
        if all(greedy):
            return x.argmax(dim=-1), None
        probs = apply_warpers(x, params).softmax(dim=-1)
        estimates = self._draft_estimates(probs, rows)  # before the drawn drafts' rows become residuals
        drawn = (self._drawn_drafts(probs, rows) if any(row.draft is not None and row.draft.drawn for row in rows)
                 else None)
        sampled = self._race(probs, rows)
        if drawn is not None:
            at, drafts, keep = drawn
            sampled = sampled.index_copy(0, at, torch.where(keep, drafts, sampled.index_select(0, at)))
        if not any(greedy):
            return sampled, estimates
        return torch.where(device_tensor(greedy, torch.bool, x.device), x.argmax(dim=-1), sampled), estimates

    def logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 tokens: torch.Tensor) -> StepLogprobs | None:
        """The sampled tokens' log-probabilities under the model's raw distribution (before
        masks, penalties and warpers) for the rows whose params ask for them; None when none
        does. Reads `logits` and `tokens` only, so the tokens never depend on it."""
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs]
        if not wanted:
            return None
        index = device_tensor(wanted, torch.int64, logits.device)
        logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [W, V]
        chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0]  # [W]
        # a vocabulary smaller than the alternatives asked for (up to 20) gives all of its tokens
        k = min(max(rows[i].params.top_logprobs for i in wanted), logprobs.shape[-1])
        top_values, top_ids = logprobs.topk(k, dim=-1)  # [W, K], most likely first
        return StepLogprobs(wanted, chosen, top_values, top_ids)

    def apply_masks(self, logits: torch.Tensor, masks: TokenMasks, shift: bool | None = None) -> torch.Tensor:
        """logits with -inf where a constrained row's grammar forbids the token (a new tensor).

        On a GPU (`shift`, by default where the logits are on CUDA) each bit is shifted out of its
        word in one elementwise pass; on the CPU each byte of the bitmask indexes a table of 8
        additive biases (0 or -inf): one gather unpacks the whole mask, several times faster
        there than shifting, and on the H200 over ten times slower (367 us a step for 32 rows
        of a 151k vocabulary: `hibana bench grammar --profile`)."""
        rows, width = masks.bitmask.shape
        vocab = logits.shape[1]
        if logits.is_cuda if shift is None else shift:
            shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
            allowed = ((masks.bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, 32 * width)[:, :vocab]
            bias = torch.zeros((rows, vocab), dtype=logits.dtype, device=logits.device).masked_fill_(
                allowed == 0, _NEG_INF)
        else:
            table = self._bias_tables.get(logits.dtype)
            if table is None:
                bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]: bit j of byte b
                table = torch.where(bits.bool(), 0.0, _NEG_INF).to(device=logits.device, dtype=logits.dtype)
                self._bias_tables[logits.dtype] = table
            bytes_ = masks.bitmask.view(torch.uint8).view(rows, 4 * width).int()  # [R, 4 W]
            bias = torch.nn.functional.embedding(bytes_, table).view(rows, 32 * width)[:, :vocab]  # [R, V]
        if masks.every_row:
            return logits + bias
        return logits.index_add(0, masks.rows, bias)

    def _drawn_drafts(self, probs: torch.Tensor,
                      rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows that verify a drawn draft x (`SamplingRow.draft`: x and q): their
        indexes [D], drafts [D] and whether each is kept [D] (u q(x) < p(x), u uniform: with
        probability min(1, p(x) / q(x))); their rows of `probs` become the residual max(0, p - q),
        which the race then draws the token from where x is not kept (it never holds x then:
        p(x) < q(x)). Together a draw from p. The rows take the sampler's shared noise: drafts are
        drawn only for requests without a seed (`samples_drafts`)."""
        index = [i for i, row in enumerate(rows) if row.draft is not None and row.draft.drawn]
        at = device_tensor(index, torch.int64, probs.device)
        p = probs.index_select(0, at)  # [D, V]
        x = device_tensor([rows[i].draft.token for i in index], torch.int64, probs.device)[:, None]  # [D, 1]
        q = _stacked([rows[i].draft.q for i in index], p.shape[1])  # [D, V]
        u = torch.rand(len(index), 1, generator=self.generator, device=probs.device)
        keep = u * q.gather(1, x) < p.gather(1, x)  # [D, 1]
        residual = p.sub_(q).clamp_(min=0)  # in place: [D, V] buffers are a vocabulary each
        # where float rounding leaves no residual mass (p == q), the draft is kept: p(x) >= q(x) there
        keep |= residual.sum(dim=-1, keepdim=True) <= 0
        probs.index_copy_(0, at, residual)
        return at, x[:, 0], keep[:, 0]

    @staticmethod
    def _draft_estimates(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> "DraftEstimates | None":
        """At the first draft of each chunk whose drafter said q: what drawing from q would keep
        there, sum(min(p, q)), and what choosing q's argmax keeps, p(argmax q), with p the row of
        `probs`, the distribution after its warpers (such rows have no penalties or grammar:
        `samples_drafts`). Reads `probs` only; None where no row has such a draft."""
        index = [i for i, row in enumerate(rows) if row.draft is not None and row.draft.position == 0]
        if not index:
            return None
        p = probs.index_select(0, device_tensor(index, torch.int64, probs.device))  # [D, V]
        q = _stacked([rows[i].draft.q for i in index], p.shape[1])  # [D, V]
        chosen = p.gather(1, q.argmax(dim=-1, keepdim=True))[:, 0]
        return DraftEstimates(index, torch.stack([torch.minimum(p, q).sum(dim=-1), chosen], dim=1))

    def _race(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One draw per row from probs [B, V]: argmax(p / q), q ~ Exp(1)."""
        sampled = [not row.params.greedy for row in rows]
        seeded = [i for i, row in enumerate(rows) if sampled[i] and row.generator is not None]
        # Greedy rows' noise is thrown away: draw the shared noise only when some row uses it.
        if sum(sampled) > len(seeded):
            noise = torch.empty_like(probs).exponential_(generator=self.generator)  # [B, V]
        else:
            noise = torch.ones_like(probs)
        for i in seeded:
            # A whole row from the request's own generator, reseeded per token: the same draws
            # whatever the batch holds and however many tokens a step verifies.
            generator, seed = rows[i].generator, rows[i].params.seed
            if seed is not None:
                generator.manual_seed(draw_seed(seed, rows[i].draw))
            noise[i].exponential_(generator=generator)
        return (probs / noise.clamp_(min=_TINY)).argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [B, V] (any non-negative weights), the sampler's race: argmax(p / e),
    e ~ Exp(1) from `generator`. [B, 1] int64."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=_TINY)
    return torch.div(probs, noise, out=noise).argmax(dim=-1, keepdim=True)


def _stacked(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Distributions [V'] as one [len(rows), width] float32 tensor, zero past each row's own
    width (a drafter's vocabulary may be narrower than the logits); NaN or negative entries as 0,
    a guard only: a plugin's q reaches here made sound by the speculator (`speculator.sound_q`:
    normalised, and a draft its q gives no mass verified as a chosen one)."""
    widths = {row.shape[0] for row in rows}
    if len(widths) == 1:
        q = torch.stack(rows).float()
        if q.shape[1] < width:
            q = torch.nn.functional.pad(q, (0, width - q.shape[1]))
    else:
        q = torch.zeros(len(rows), width, dtype=torch.float32, device=rows[0].device)
        for j, row in enumerate(rows):
            q[j, :row.shape[0]] = row
    return q.nan_to_num_(0.0).clamp_(min=0.0)


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a seeded request's `draw`-th token (splitmix64 of both: nearby seeds and draws
    give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (draw + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def apply_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's `logit_bias` added to its logits (OpenAI's and vLLM's form: token id -> bias).

    x: float32 logits [B, V], not modified; the same x when no row has a bias. Ids at or past V
    are left out (the engine refuses them; a drafter's narrower vocabulary may not reach them).
    A request's bias is read into tensors once (`_bias_tensors`), whatever its size and however
    many rows (a step's drafts) share it."""
    rows = [(i, *_bias_tensors(p)) for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return x
    ids = torch.cat([r[1] for r in rows])
    values = torch.cat([r[2] for r in rows])
    row_ids = torch.repeat_interleave(torch.tensor([r[0] for r in rows]), torch.tensor([len(r[1]) for r in rows]))
    inside = ids < x.shape[1]
    if not bool(inside.all()):
        ids, values, row_ids = ids[inside], values[inside], row_ids[inside]
    bias = torch.zeros_like(x)
    bias.index_put_((small_to_device(row_ids, x.device), small_to_device(ids, x.device)),
                    small_to_device(values, x.device))
    return x + bias  # -inf (a grammar's mask) stays -inf


def _bias_tensors(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as host tensors (ids int64, biases float32), made on first use and
    kept on its params (a field-less attribute: equality and replace() ignore it)."""
    cached = params.__dict__.get("_logit_bias_tensors")
    if cached is None:
        bias = params.logit_bias
        cached = (torch.tensor(array.array("q", bias.keys()), dtype=torch.int64),  # (array: 10x list's speed)
                  torch.tensor(array.array("f", bias.values()), dtype=torch.float32))
        object.__setattr__(params, "_logit_bias_tensors", cached)
    return cached


def apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over history + output (HF), then presence/frequency over output (OpenAI).

    x: float32 logits [B, V], not modified. Rows without penalties come back bit-identical.
    """
    rep = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if rep:
        seen = _token_table(x, [(i, itertools.chain(rows[i].prompt, rows[i].output)) for i in rep],
                            torch.bool)  # [B, V]
        # (at least float32's least normal: a smaller one is 0 there, and 0 / 0 is NaN)
        penalty = _column([max(row.params.repetition_penalty, _TINY) for row in rows], x.device)  # [B, 1]
        penalised = torch.where(x < 0, x * penalty, x / penalty).clamp_(-_PENALISED_MAX, _PENALISED_MAX)
        # an extreme penalty would overflow to +-inf (NaN rows); ties then stand for the overflown.
        # A -inf (a grammar's mask) stays -inf.
        x = torch.where(seen & (x > _NEG_INF), penalised, x)
    pf = [i for i, row in enumerate(rows)
          if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0]
    if pf:
        counts = _token_table(x, [(i, rows[i].output) for i in pf], torch.float32)  # [B, V]
        presence = _column([row.params.presence_penalty for row in rows], x.device)  # [B, 1]
        frequency = _column([row.params.frequency_penalty for row in rows], x.device)  # [B, 1]
        x = x - (frequency * counts + presence * (counts > 0))
    return x


def apply_warpers(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, as HF's warpers: filtered entries become -inf.

    x: float32 logits [B, V], not modified. Greedy rows (temperature 0) pass through unchanged.
    """
    vocab = x.shape[1]
    sampled = [not p.greedy for p in params]
    # (past float32's range a temperature is inf there, and -inf / inf is NaN: its limit, all but
    # the masked tokens alike, is float32's largest)
    temps = [min(p.temperature, _MAX) if s else 1.0 for p, s in zip(params, sampled)]
    if any(t != 1.0 for t in temps):
        x = x / _column(temps, x.device)

    top_k = [min(p.top_k, vocab) if s else 0 for p, s in zip(params, sampled)]  # 0: off
    top_p = [p.top_p if s else 1.0 for p, s in zip(params, sampled)]
    use_k = any(0 < k < vocab for k in top_k)
    if any(p < 1.0 for p in top_p):
        # One ascending sort (as HF's TopPLogitsWarper) serves top-k too.
        sorted_x, order = x.sort(dim=-1)  # [B, V]
        if use_k:
            # The k-th largest sits at V - k; rows without top-k take the minimum: a no-op.
            index = device_tensor([vocab - (k or vocab) for k in top_k], torch.int64, x.device)
            kth = sorted_x.gather(1, index[:, None])  # [B, 1]
            x = x.masked_fill(x < kth, _NEG_INF)  # ties with the k-th are kept, as in HF
            sorted_x = sorted_x.masked_fill(sorted_x < kth, _NEG_INF)
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        drop = cumulative <= _column([1.0 - p for p in top_p], x.device)
        drop[:, -1] = False  # the most likely token always stays
        x = x.masked_fill(drop.scatter(1, order, drop), _NEG_INF)
    elif use_k:
        top = x.topk(max(top_k), dim=-1).values  # [B, k_max], descending
        kth = top.gather(1, device_tensor([max(k, 1) - 1 for k in top_k], torch.int64, x.device)[:, None])
        off = device_tensor([k == 0 for k in top_k], torch.bool, x.device)[:, None]  # [B, 1]
        x = x.masked_fill((x < kth) & ~off, _NEG_INF)

    min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
    if any(m > 0.0 for m in min_p):
        probs = x.softmax(dim=-1)  # [B, V]
        # min_p <= 1, so the top token always stays (HF's min_tokens_to_keep=1).
        threshold = _column(min_p, x.device) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        x = x.masked_fill(probs < threshold, _NEG_INF)
    return x


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return device_tensor(values, torch.float32, device)[:, None]  # [B, 1]


def _token_table(x: torch.Tensor, rows: list[tuple[int, Iterable[int]]], dtype: torch.dtype) -> torch.Tensor:
    """[B, V] count of each listed row's tokens (bool: whether they occur); other rows are zero.

    Ids outside [0, V) are ignored, as HF does when the embedding is larger than the LM head.
    """
    batch, vocab = x.shape
    token_ids: list[int] = []
    lengths: list[int] = []
    for _, tokens in rows:
        start = len(token_ids)
        token_ids.extend(tokens)
        lengths.append(len(token_ids) - start)
    table = torch.zeros(batch, vocab + 1, dtype=dtype, device=x.device)  # column V: ignored ids
    if token_ids:
        # Histories can be long: array -> tensor is several times faster than torch.tensor(list).
        ids = small_to_device(torch.frombuffer(array.array("q", token_ids), dtype=torch.int64), x.device)
        ids = ids.masked_fill((ids < 0) | (ids > vocab), vocab)
        row_ids = torch.repeat_interleave(device_tensor([i for i, _ in rows], torch.int64, x.device),
                                          device_tensor(lengths, torch.int64, x.device),
                                          output_size=len(token_ids))  # given size: no sync
        ones = torch.ones(len(token_ids), dtype=dtype, device=x.device)
        table.index_put_((row_ids, ids), ones, accumulate=dtype != torch.bool)
    return table[:, :vocab]
