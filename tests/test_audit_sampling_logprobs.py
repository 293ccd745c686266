"""Logprobs are the model's raw distribution, as documented: a logit bias, penalties, a tiny or a
huge temperature and top-k / top-p / min-p move the tokens drawn, never their reported logprobs."""

from __future__ import annotations

import random

import pytest

import tiny_models
from hibana_core import SamplingParams

GEN = 5


def test_logprobs_are_raw_under_bias_penalties_and_warpers(tiny_checkpoints, make_engine):
    qwen3 = tiny_checkpoints["qwen3"]
    engine = make_engine(qwen3)
    history = tiny_models.random_tokens(random.Random(8), 20)
    forced = 7
    settings = [  # the bias forces `forced` (its raw logprob stays what the model says)
        dict(temperature=0.0, logit_bias={forced: 100.0}),
        dict(temperature=1e-5, logit_bias={forced: 100.0}, repetition_penalty=1.5, presence_penalty=2.0),
        dict(temperature=1e30, top_k=3, top_p=0.5, min_p=0.5, frequency_penalty=-2.0, seed=1),
    ]
    for i, options in enumerate(settings):
        h = engine.open_state(f"s{i}")
        h.sync(history)
        got = h.generate(SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=True, top_logprobs=2, **options))
        if "logit_bias" in options:
            assert got.token_ids == [forced] * GEN, (options, got.token_ids)
        for j, lp in enumerate(got.logprobs):
            raw = tiny_models.hf_next_logits(qwen3, history + got.token_ids[:j]).log_softmax(dim=-1)
            assert lp.logprob == pytest.approx(float(raw[lp.token_id]), abs=1e-4), (options, j)
            values, ids = raw.topk(2)
            assert [t for t, _ in lp.top] == ids.tolist(), (options, j)
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
