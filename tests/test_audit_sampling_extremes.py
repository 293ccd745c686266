"""Sampling parameters at the ends of their ranges: values SamplingParams takes must never turn a
row of logits into NaN (NaN rows draw token 0, whatever the grammar's mask or the penalties say)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from hibana_core.config import SamplingParams
from hibana_core.errors import ConfigError
from hibana_core.sampler import Sampler, SamplingRow, TokenMasks, apply_penalties, apply_warpers

CPU = torch.device("cpu")
LOGITS = torch.tensor([0.0, 1.2, -0.3, 2.0, 0.9, 0.1, -1.5, 1.6, -0.8, 0.4, 2.3, -2.0])
V = LOGITS.shape[0]


def row(params: SamplingParams, history=()) -> SamplingRow:
    return SamplingRow(params=params, generator=None, prompt=list(history), output=[])


def all_but(token: int, rows: int) -> TokenMasks:
    """A grammar's masks that forbid `token` on every row."""
    bitmask = torch.full((rows, 1), -1, dtype=torch.int32)
    bitmask[:, token // 32] &= ~(1 << token)
    return TokenMasks(bitmask, torch.arange(rows), every_row=True)


def test_a_temperature_past_float32s_range_draws_the_allowed_tokens_alike():
    # 1e39 is a finite float (SamplingParams takes it) but inf in float32, where -inf / inf is NaN
    n = 12_000
    params = SamplingParams(temperature=1e39)
    tokens = Sampler(CPU, seed=0)(LOGITS[None].repeat(n, 1), [row(params)] * n, all_but(0, n))
    counts = np.bincount(tokens.numpy(), minlength=V)
    assert counts[0] == 0, "drew the token the grammar forbids"
    assert chisquare(counts[1:]).pvalue > 1e-3, counts  # its limit: uniform over the allowed


def test_extreme_repetition_penalties_leave_no_nan_or_inf():
    seen = [0, 1, 2, 5]  # logits 0.0, 1.2, -0.3, 0.1
    for penalty in (1e-50, 1e-40, 1e-35, 1e39, 1e50):
        for temperature in (1e-5, 0.5, 1.0, 1e39):
            params = SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, min_p=0.01)
            x = LOGITS[None].clone()
            x[0, 2] = float("-inf")  # a grammar's mask stays a mask
            x = apply_warpers(apply_penalties(x, [row(params, seen)]), [params])
            assert not x.isnan().any() and not x.isposinf().any(), (penalty, temperature, x)
            assert x[0, 2] == float("-inf")


def test_a_vanishing_repetition_penalty_draws_the_seen_tokens_with_positive_logits():
    # the limit of dividing positive logits by a penalty towards 0: those seen tokens outweigh all
    n = 2_000
    seen = [0, 1, 2, 5]  # 0.0 (0 / 0 would be NaN), 1.2, -0.3, 0.1
    sampler = Sampler(CPU, seed=0)
    for temperature in (0.0, 0.7):
        params = SamplingParams(temperature=temperature, repetition_penalty=1e-50)
        tokens = sampler(LOGITS[None].repeat(n, 1), [row(params, seen)] * n)
        assert set(tokens.tolist()) <= {1, 5}, (temperature, np.bincount(tokens.numpy(), minlength=V))


def test_an_out_of_range_penalty_is_refused_with_the_value_given():
    for option, value in (("repetition_penalty", -0.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0)):
        with pytest.raises(ConfigError, match=rf"{option} must .*, got {value}$"):
            SamplingParams(**{option: value})
