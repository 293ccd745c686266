"""One batch whose rows each combine several sampling parameters (penalties over a history, logit
bias, a grammar's mask on some rows, seeds, greedy rows, the warpers) draws each row from the
distribution transformers' logits processors define, computed in float64: rows are shuffled
together, so a stage that reads another row's parameters or mask moves some distribution."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from scipy.stats import chisquare
from transformers import RepetitionPenaltyLogitsProcessor

from hibana_core.config import SamplingParams
from hibana_core.sampler import Sampler, SamplingRow, TokenMasks, make_generator
from test_sampler import hf_warped

CPU = torch.device("cpu")
V = 40
HISTORY = [1, 2, 3, 5, 8, 13]
OUTPUT = [2, 2, 7, 30]
FORBIDDEN = [0, 3, 10, 11, 20, 21, 22]  # by the grammar of the masked rows
PER = 8_000  # rows per setting
SETTINGS = [  # (params, masked)
    (SamplingParams(temperature=0.8, repetition_penalty=1.5, top_k=12), False),
    (SamplingParams(temperature=1.2, presence_penalty=0.8, frequency_penalty=-0.6, top_p=0.8), True),
    (SamplingParams(temperature=1.0, logit_bias={4: 2.5, 9: -100, 30: 1.0}, min_p=0.1), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 1.0}), True),
    (SamplingParams(temperature=0.6, top_k=100, top_p=0.95, min_p=0.02, repetition_penalty=0.8,
                    frequency_penalty=1.0, logit_bias={0: -3}), True),
    (SamplingParams(temperature=0.9, seed=0, top_p=0.7, presence_penalty=-1), False),  # a seed per row
    (SamplingParams(temperature=1.5, top_k=5), True),
]


def reference(params: SamplingParams, logits: torch.Tensor, masked: bool) -> np.ndarray:
    """The distribution HF's processors give, in float64: mask, bias, penalties, warpers."""
    x = logits[None].double().clone()
    if masked:
        x[0, FORBIDDEN] = float("-inf")
    ids = torch.tensor([HISTORY + OUTPUT])
    for token, bias in (params.logit_bias or {}).items():
        x[0, token] += bias
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=V).double()
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.greedy:
        return np.eye(V)[int(x.argmax())]
    return hf_warped(params, ids, x).softmax(dim=-1)[0].numpy()


def grammar_masks(rows: list[int]) -> TokenMasks:
    allowed = np.ones(32 * 2, dtype=bool)
    allowed[FORBIDDEN] = False
    words = [int(sum(1 << j for j in range(32) if allowed[32 * w + j])) for w in range(2)]
    words = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32
    return TokenMasks(torch.tensor([words] * len(rows), dtype=torch.int32), torch.tensor(rows), every_row=False)


def test_a_shuffled_batch_of_combined_parameters_draws_each_rows_distribution():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 1.5
    rows, setting = [], []
    for j, (params, _) in enumerate(SETTINGS):
        for i in range(PER):
            if params.seed is not None:  # one seed per row: rows of one seed draw one token
                params_i = dataclasses.replace(params, seed=1000 * j + i)
                rows.append(SamplingRow(params_i, make_generator(params_i.seed, CPU), HISTORY, OUTPUT))
            else:
                rows.append(SamplingRow(params, None, HISTORY, OUTPUT))
            setting.append(j)
    order = np.random.RandomState(0).permutation(len(rows))
    rows = [rows[i] for i in order]
    setting = np.asarray(setting)[order]
    masked = [i for i in range(len(rows)) if SETTINGS[setting[i]][1]]
    tokens = Sampler(CPU, seed=1)(logits[None].repeat(len(rows), 1), rows, grammar_masks(masked)).numpy()

    for j, (params, is_masked) in enumerate(SETTINGS):
        drawn = tokens[setting == j]
        expected = reference(params, logits, is_masked)
        counts = np.bincount(drawn, minlength=V)
        support = expected > 1e-12
        assert counts[~support].sum() == 0, (j, np.flatnonzero(counts * ~support))
        tv = 0.5 * np.abs(counts / len(drawn) - expected).sum()
        assert tv < 0.025, (j, tv)
        if support.sum() > 1:  # a chi-square test, cells expecting fewer than 5 draws pooled
            big = support & (expected * len(drawn) >= 5)
            observed = np.append(counts[big], counts[support & ~big].sum())
            wanted = np.append(expected[big], expected[support & ~big].sum()) * len(drawn)
            keep = wanted > 0
            p_value = chisquare(observed[keep], wanted[keep] * observed[keep].sum() / wanted[keep].sum()).pvalue
            assert p_value > 1e-4, (j, p_value, tv)
