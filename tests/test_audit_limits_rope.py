"""Context limits of rope-scaled models (an outside tester of limits)."""

from __future__ import annotations

import random

import pytest

from hibana_core import ConfigError, SamplingParams
from tiny_models import assert_greedy_matches, make_tiny_checkpoint, random_tokens


def test_a_yarn_rope_serves_past_max_position_embeddings_as_transformers_does(tmp_path, make_engine):
    """Qwen's long-context recipe adds a YaRN rope_scaling (factor 4 over 32768) to config.json and
    leaves max_position_embeddings at 40960; max_model_len=131072 was refused as more than 40960
    positions (vLLM serves it). Up to original_max_position_embeddings x factor the engine now
    serves it, token for token as transformers, and refuses past that in those words."""
    path = make_tiny_checkpoint("qwen3", tmp_path / "yarn", max_position_embeddings=48,
                                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                     original_max_position_embeddings=40))
    with pytest.raises(ConfigError, match=r"max_model_len=161 is more than this model's context of 160 positions "
                                          r"\(its YaRN rope's original_max_position_embeddings x factor\)"):
        make_engine(path, max_model_len=161)
    assert make_engine(path).max_model_len == 48  # (the default stays the config's)
    engine = make_engine(path, max_model_len=160, speculation="off")
    handle = engine.open_state("long")
    history = random_tokens(random.Random(7), 120)
    out = handle.generate(SamplingParams(max_tokens=60, ignore_eos=True), prompt=history)
    assert out.finish_reason == "length" and len(handle) == 160
    assert_greedy_matches(path, history, out.token_ids)
