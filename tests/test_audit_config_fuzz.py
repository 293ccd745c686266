"""An outside-in fuzz of model configs against transformers: tiny seeded checkpoints with legal but
awkward config values (windows, layer kinds, rope types, head shapes), each held to transformers'
greedy output token for token; several agents at once with retention where a case is cheap."""

from __future__ import annotations

import json
import random

import pytest

from hibana_core import CheckpointError
from tiny_models import EVERY_TENSOR_USED, assert_greedy_matches, greedy_turns_at_once, make_tiny_checkpoint

pytestmark = [pytest.mark.timeout(120), EVERY_TENSOR_USED]


def edit_config(path, **fields) -> None:
    """Set `fields` in path/config.json, as a hand-edited or converted config.json carries them."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


def agents_match_transformers(engine, path, seed: int, agents: int = 3, turns: int = 2) -> None:
    """`agents` at once, `turns` each with retention (30-50 new tokens, then 8-16 generated): every
    generation transformers' greedy on its full history."""
    plans = []
    for agent in range(agents):
        rng = random.Random(seed + agent)
        plans.append([([rng.randrange(1, 512) for _ in range(rng.randint(30, 50))], rng.randint(8, 16))
                      for _ in range(turns)])
    for per_agent in greedy_turns_at_once(engine, "fuzz", plans):
        for history, completion in per_agent:
            assert_greedy_matches(path, history, completion.token_ids)


def test_ministral3_windows_every_layer_whatever_layer_types_say(tmp_path, make_engine):
    """transformers' Ministral 3 masks every layer by sliding_window (its config has no layer_types,
    and a config.json's are not read); Hibana followed layer_types all full_attention there and
    attended to the whole history (generated token 0 differed, HF's top-2 gap 0.08)."""
    path = make_tiny_checkpoint("ministral3", tmp_path / "ministral3", sliding_window=9)
    edit_config(path, layer_types=["full_attention", "full_attention"])
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (9, 9)
    agents_match_transformers(engine, path, seed=31)


def test_smollm3_windows_the_layers_its_layer_types_name_whatever_use_sliding_window_says(tmp_path, make_engine):
    """transformers' SmolLM3 reads use_sliding_window only to derive layer_types; its masks window
    the sliding_attention layers a config.json names whenever sliding_window is set. Hibana asked
    use_sliding_window too, and attended to the whole history there (token 0 differed, gap 0.45)."""
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    path = make_tiny_checkpoint("smollm3", tmp_path / "smollm3", layer_types=kinds, sliding_window=9,
                                use_sliding_window=False)
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (9, None, 9)
    agents_match_transformers(engine, path, seed=37)


def test_smollm3_sliding_layers_without_a_window_are_a_checkpoint_error(tmp_path):
    """Sliding layers named with no sliding_window: transformers' generate fails (a None window in
    its cache); Hibana ran them as full attention."""
    from tiny_models import open_engine

    path = make_tiny_checkpoint("smollm3", tmp_path / "smollm3", sliding_window=None, use_sliding_window=False,
                                layer_types=["sliding_attention", "full_attention", "full_attention"])
    with pytest.raises(CheckpointError, match="sliding_window is None"):
        open_engine(path)


def test_a_dynamic_rope_beside_a_yarn_one_keeps_the_context_at_max_position_embeddings(tmp_path, make_engine):
    """Gemma 3 gives each layer kind its own rope: dynamic NTK on the sliding layers, YaRN (factor 4
    over 64) on the global ones. The YaRN layer stretched the context to 256 positions, where
    transformers rescales the dynamic layers by the length of each forward (its cache keeping keys
    rotated as they were) and Hibana rotated them unscaled: max_model_len=200 on a 100-token history
    left transformers at generated token 6 (top-2 gap 0.2). It is refused now, as for LongRoPE;
    within max_position_embeddings both layer kinds match."""
    from hibana_core import ConfigError, SamplingParams

    ropes = {"sliding_attention": dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
             "full_attention": dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64)}
    path = make_tiny_checkpoint("gemma3", tmp_path / "gemma3", max_position_embeddings=64, rope_parameters=ropes)
    with pytest.raises(ConfigError, match="context of 64 positions"):
        make_engine(path, max_model_len=200)
    engine = make_engine(path)
    assert engine.max_model_len == 64
    history = [random.Random(41).randrange(1, 512) for _ in range(40)]
    c = engine.open_state("a").generate(SamplingParams(max_tokens=24, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)
