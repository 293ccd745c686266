"""EXAONE 4.0 (model_type exaone4) on the shared decoder, against transformers on tiny seeded
checkpoints (the pattern of test_family_mixtral_granite.py):

    exaone4  3 layers, head_dim 16, post-norm (an RMSNorm after attention and after the MLP, none
             before), q/k norms; layers sliding (window 20, rotary), sliding, full (NoPE: the
             full layers of a model with a sliding window are not rotated); without a window
             every layer is full and rotates

Greedy token for token as `generate`, 3 agents x 3 turns batched with retention past the window,
speculation on.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiny_models import (EVERY_TENSOR_USED, assert_greedy_matches, greedy_turns_at_once, make_tiny_checkpoint,
                         random_tokens, three_agents_three_turns)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


@pytest.fixture(scope="module")
def exaone4(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("exaone4", tmp_path_factory.mktemp("exaone4") / "e")


def test_exaone4_reads_its_layers(exaone4, make_engine):
    model = make_engine(exaone4).model
    args = model.args
    assert args.sliding_windows == (20, 20, None) and [r.rope_type for r in args.ropes] == ["default", "default", "none"]
    assert args.qk_norm and not args.pre_norms and args.sandwich_norms
    layer = model.model.layers[0]
    assert layer.input_layernorm.weight is None and layer.pre_feedforward_layernorm.weight is None  # none before


def test_exaone4_agents_batched_with_retention_match_transformers(exaone4, make_engine):
    three_agents_three_turns(make_engine(exaone4), exaone4, "ex", 9900)


def test_exaone4_without_a_window_rotates_every_layer(tmp_path, make_engine):
    path = make_tiny_checkpoint("exaone4", tmp_path / "full", sliding_window=None,
                                layer_types=["full_attention"] * 3)
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (None,) * 3
    assert {r.rope_type for r in engine.model.args.ropes} == {"default"}
    three_agents_three_turns(engine, path, "exf", 9950)


def test_exaone4_with_speculation_matches_transformers(exaone4, make_engine):
    rng = random.Random(9970)
    phrase = random_tokens(rng, 12)
    histories = [random_tokens(rng, 10) + phrase * 3 + random_tokens(rng, 5) + phrase[:4] for _ in range(3)]
    engine = make_engine(exaone4, speculation={"method": "suffix", "k": 4})
    for turns in greedy_turns_at_once(engine, "spec", [[(h, 24)] for h in histories]):
        for history, completion in turns:
            assert_greedy_matches(exaone4, history, completion.token_ids)
    assert engine.stats().draft_tokens_proposed > 0
