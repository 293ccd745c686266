"""CPU tests of the sampler: greedy is argmax, seeds are reproducible, the filters draw from the
distribution that Hugging Face's own logits processors define, and penalties match HF / OpenAI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hibana_core.config import SamplingParams
from hibana_core.sampler import DraftRow, Sampler, SamplingRow, apply_penalties, make_generator

CPU = torch.device("cpu")

# A small vocabulary with a spread of probabilities; 3 and 11 tie at the 6th place (top_k=6 keeps 7).
LOGITS = torch.tensor([1.2, -0.3, 2.0, 0.9, 0.1, -1.5, 1.6, -0.8, 0.4, 2.3, -2.0, 0.9, 0.0, -0.5, 1.0, -3.0])
N = 40_000


def row(params: SamplingParams, history=(), output=(), generator=None) -> SamplingRow:
    if generator is None and params.seed is not None:
        generator = make_generator(params.seed, CPU)
    return SamplingRow(params=params, generator=generator, prompt=list(history), output=list(output))


def hf_warped(params: SamplingParams, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`scores` after HF's warpers, in generate's order: temperature, top-k, top-p, min-p."""
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores


def reference_probs(params: SamplingParams) -> np.ndarray:
    """softmax after HF's warpers (`hf_warped`)."""
    scores = hf_warped(params, torch.zeros(1, 1, dtype=torch.long), LOGITS[None].clone())
    return scores.double().softmax(dim=-1)[0].numpy()


def check_distribution(tokens: torch.Tensor, expected: np.ndarray) -> None:
    counts = np.bincount(tokens.numpy(), minlength=len(expected)).astype(np.float64)
    support = expected > 0
    outside = np.flatnonzero(counts * ~support)
    assert outside.size == 0, f"drew tokens outside the support: {outside}"
    assert support.sum() >= 2, "a test distribution should not be a single token"
    freq = counts / counts.sum()
    tv = 0.5 * np.abs(freq - expected).sum()
    assert tv < 0.02, f"total variation {tv:.4f}"
    p_value = chisquare(counts[support], expected[support] / expected[support].sum() * counts.sum()).pvalue
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}; freq {freq.round(4)} vs {expected.round(4)}"


CONFIGS = {
    "temperature": SamplingParams(temperature=0.7),
    "plain": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=1.0, top_k=6),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.45),
    "combo": SamplingParams(temperature=1.3, top_k=10, top_p=0.9, min_p=0.05),
}


# --- greedy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(16, 1000) * 4).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins, as argmax's
    rows = [row(SamplingParams()) for _ in range(16)]
    tokens = Sampler(CPU)(logits, rows)
    assert tokens.dtype == torch.int64 and tokens.shape == (16,)
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    assert tokens[3] == 10


def test_all_greedy_batch_is_one_argmax():
    """The hot path: no float copy, no noise, no other op than argmax."""
    logits = torch.randn(8, 300, dtype=torch.bfloat16)
    sampler = Sampler(CPU, seed=1)
    state = sampler.generator.get_state()
    rows = [row(SamplingParams(top_k=3, top_p=0.5, min_p=0.2, seed=7)) for _ in range(8)]  # greedy

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        tokens = sampler(logits, rows)
    assert ops.names == ["argmax"]
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.equal(sampler.generator.get_state(), state)


def test_greedy_rows_in_a_sampled_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    rows = [row(SamplingParams()), row(SamplingParams(temperature=1.0)), row(SamplingParams(seed=3)),
            row(SamplingParams(temperature=2.0, seed=4, top_p=0.5)), row(SamplingParams()),
            row(SamplingParams(temperature=0.5, top_k=20))]
    sampler = Sampler(CPU)
    for _ in range(5):
        tokens = sampler(logits, rows)
        for i in (0, 2, 4):
            assert tokens[i] == torch.argmax(logits[i])


def test_logits_are_not_modified():
    logits = torch.randn(3, 50)
    before = logits.clone()
    rows = [row(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.5), history=[1, 2], output=[2, 3])
            for _ in range(3)]
    Sampler(CPU)(logits, rows)
    assert torch.equal(logits, before)


# --- seeds ----------------------------------------------------------------------------------

def test_seeded_row_is_independent_of_batch_and_position():
    torch.manual_seed(2)
    steps = [torch.randn(64) for _ in range(20)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(batch: int, position: int) -> list[int]:
        others = [SamplingParams(), SamplingParams(temperature=1.0),
                  SamplingParams(temperature=1.0, seed=99, top_k=5),
                  SamplingParams(temperature=1.5, min_p=0.1)]
        params_list = others[:position] + [params] + others[position:batch - 1]
        rows = [row(p) for p in params_list]
        sampler = Sampler(CPU, seed=position)  # another engine seed too
        out = []
        for step in steps:
            # The other rows see other logits; the seeded row always sees `step`.
            others_mask = (torch.arange(batch) != position)[:, None]
            logits = step[None].repeat(batch, 1) + torch.randn(batch, 64) * others_mask
            out.append(int(sampler(logits, rows)[position]))
        return out

    alone = run(1, 0)
    assert run(5, 3) == alone
    assert run(5, 0) == alone
    assert len(set(alone)) > 3, "the seeded row should actually sample"
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=1235)
    sampler = Sampler(CPU)
    assert [int(sampler(s[None], [row(other_seed)])[0]) for s in steps] != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.randn(32, 100)
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(32)]
    a = Sampler(CPU, seed=5)(logits, rows)
    assert torch.equal(a, Sampler(CPU, seed=5)(logits, rows))
    assert not torch.equal(a, Sampler(CPU, seed=6)(logits, rows))


# --- distributions --------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_distribution_matches_hf_warpers(name):
    params = CONFIGS[name]
    tokens = Sampler(CPU, seed=0)(LOGITS[None].repeat(N, 1), [row(params)] * N)
    check_distribution(tokens, reference_probs(params))


def test_mixed_batch_applies_each_rows_parameters():
    """All configs (and greedy rows) in one batch: per-row parameters, stages shared."""
    names = list(CONFIGS)
    per = N // 2
    rows = [row(CONFIGS[name]) for name in names for _ in range(per)] + [row(SamplingParams())] * 100
    tokens = Sampler(CPU, seed=3)(LOGITS[None].repeat(len(rows), 1), rows)
    for j, name in enumerate(names):
        check_distribution(tokens[j * per:(j + 1) * per], reference_probs(CONFIGS[name]))
    assert (tokens[-100:] == LOGITS.argmax()).all()


def test_seeded_rows_sample_the_same_distribution():
    params = CONFIGS["combo"]
    rows = [row(params, generator=make_generator(seed, CPU)) for seed in range(4000)]
    tokens = Sampler(CPU)(LOGITS[None].repeat(len(rows), 1), rows)
    expected = reference_probs(params)
    counts = np.bincount(tokens.numpy(), minlength=len(expected))
    assert counts[expected == 0].sum() == 0
    assert 0.5 * np.abs(counts / counts.sum() - expected).sum() < 0.05


def test_masked_tokens_never_drawn_at_extreme_temperature():
    logits = torch.full((2000, 1000), -30.0)
    logits[:, 7] = 5.0
    logits[:, 8] = 4.0
    tokens = Sampler(CPU)(logits, [row(SamplingParams(temperature=0.01, top_k=2))] * 2000)
    assert set(tokens.tolist()) <= {7, 8}


def test_tiny_top_p_keeps_the_top_token():
    # 1 - 1e-9 rounds to 1.0 in float32: every cumulative probability is below it but the top token stays.
    logits = LOGITS[None].repeat(200, 1)
    tokens = Sampler(CPU)(logits, [row(SamplingParams(temperature=1.0, top_p=1e-9))] * 200)
    assert (tokens == LOGITS.argmax()).all()


# --- penalties ------------------------------------------------------------------------------

def test_repetition_penalty_matches_hf():
    torch.manual_seed(4)
    vocab = 50
    logits = torch.randn(4, vocab) * 3
    cases = [(1.3, [1, 2, 3, 2], [7, 8]), (0.7, [4, 9], [9, 10, 11]), (1.0, [1, 2], [3]),
             (2.0, [5, 60, 49], [])]  # 60 lies outside the LM head: ignored, as in HF
    rows = [row(SamplingParams(repetition_penalty=p), history=h, output=o) for p, h, o in cases]
    out = apply_penalties(logits.clone(), rows)
    for i, (penalty, history, output) in enumerate(cases):
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        expected = hf(torch.tensor([history + output]), logits[i:i + 1].clone())
        assert torch.equal(out[i], expected[0]), i
    # Greedy decoding follows the penalised logits, exactly.
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.8
    rows = [row(SamplingParams(repetition_penalty=1.2), history=[3])]
    assert int(Sampler(CPU)(logits, rows)[0]) == 4


def test_presence_and_frequency_penalties_touch_only_output_tokens():
    torch.manual_seed(5)
    logits = torch.randn(2, 40)
    rows = [row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
                history=[1, 2, 5], output=[5, 5, 7, 5]),
            row(SamplingParams(), history=[1], output=[5, 6])]
    out = apply_penalties(logits, rows)
    expected = logits.clone()
    expected[0, 5] -= 3 * 0.3 + 0.5
    expected[0, 7] -= 1 * 0.3 + 0.5
    touched = torch.zeros_like(logits, dtype=torch.bool)
    touched[0, [5, 7]] = True
    assert torch.allclose(out[touched], expected[touched], atol=1e-6, rtol=0)
    assert torch.equal(out[~touched], logits[~touched])  # history-only tokens and other rows: exact


def test_negative_presence_penalty_raises_logits():
    logits = torch.zeros(1, 10)
    rows = [row(SamplingParams(presence_penalty=-1.0), output=[3])]
    assert int(Sampler(CPU)(logits, rows)[0]) == 3


def test_rows_must_match_logits():
    with pytest.raises(ValueError):
        Sampler(CPU)(torch.zeros(2, 5), [row(SamplingParams())])


@pytest.mark.parametrize("name", ["plain", "top_k"])
def test_drawn_drafts_are_kept_at_min_1_p_over_q_and_tokens_follow_p(name):
    """Rows verifying a draft x drawn from q (`SamplingRow.draft`, here over the vocabulary
    but its last two ids: a drafter's narrower vocabulary) keep x with probability min(1, p/q),
    else draw from max(0, p - q): the tokens follow p, and the drafts kept are sum(min(p, q))."""
    params = CONFIGS[name]
    p = reference_probs(params)
    q = torch.linspace(1.0, 3.0, len(LOGITS) - 2)  # more mass where p has little, none on the last two
    q = q / q.sum()
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))
    rows = [row(params) for _ in range(N)]
    for r, x in zip(rows, drafts.tolist()):
        r.draft = DraftRow(x, q, True, 0)
    tokens = Sampler(CPU, seed=2)(LOGITS.expand(N, -1), rows)
    check_distribution(tokens, p)
    kept = (tokens == drafts).double().mean().item()
    want = np.minimum(p[:len(q)], q.double().numpy()).sum()
    assert abs(kept - want) < 4 * np.sqrt(want * (1 - want) / N), (kept, want)
