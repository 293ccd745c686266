"""SmolLM3 (model_type smollm3) on the shared decoder, against transformers on tiny seeded
checkpoints (the pattern of test_family_mixtral_granite.py):

    smollm3  3 layers, layer 2 a NoPE layer (no_rope_layer_interval 3: its queries and keys are
             not rotated), q/k/v/o biases; windowed: the NoPE layer attends within 20 tokens
             (use_sliding_window, which transformers applies to the NoPE layers)

Greedy token for token as `generate`, 3 agents x 3 turns batched with retention, speculation on,
the NoPE layer's rotation the identity, a config Hibana refuses.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tiny_models import (EVERY_TENSOR_USED, assert_greedy_matches, greedy_turns_at_once, make_tiny_checkpoint,
                         open_engine, random_tokens, three_agents_three_turns)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("smollm3", tmp_path_factory.mktemp("smollm3") / "s")


def test_smollm3_reads_its_nope_layers(smollm3, make_engine):
    args = make_engine(smollm3).model.args
    assert [rope.rope_type for rope in args.ropes] == ["default", "default", "none"]
    assert args.qkv_bias and args.o_bias and args.sliding_windows == (None,) * 3


def test_a_nope_layers_rotation_is_the_identity(smollm3, make_engine):
    """cos 1 and sin 0 at every position: q * cos + rotate_half(q) * sin is q, bit for bit."""
    from hibana_core.models.decoder import RotaryTables

    layer = make_engine(smollm3).model.model.layers[2].self_attn
    cos, sin = RotaryTables(layer.rotary.rope, 64).tables(torch.device("cpu"))
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))


def test_smollm3_agents_batched_with_retention_match_transformers(smollm3, make_engine):
    three_agents_three_turns(make_engine(smollm3), smollm3, "sm", 9500)


def test_smollm3_windowed_nope_layers_match_transformers(tmp_path, make_engine):
    path = make_tiny_checkpoint("smollm3", tmp_path / "w", use_sliding_window=True, sliding_window=20)
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (None, None, 20)
    three_agents_three_turns(engine, path, "smw", 9600)


def test_smollm3_with_speculation_matches_transformers(smollm3, make_engine):
    rng = random.Random(9700)
    phrase = random_tokens(rng, 12)
    histories = [random_tokens(rng, 10) + phrase * 3 + random_tokens(rng, 5) + phrase[:4] for _ in range(3)]
    engine = make_engine(smollm3, speculation={"method": "suffix", "k": 4})
    for turns in greedy_turns_at_once(engine, "spec", [[(h, 24)] for h in histories]):
        for history, completion in turns:
            assert_greedy_matches(smollm3, history, completion.token_ids)
    assert engine.stats().draft_tokens_proposed > 0


def test_smollm3_with_a_no_rope_list_of_another_length_is_refused(smollm3, tmp_path):
    from hibana_core import CheckpointError

    path = Path(shutil.copytree(smollm3, tmp_path / "edited"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "no_rope_layers": [1, 0]}))
    with pytest.raises(CheckpointError, match="no_rope_layers has 2 entries for 3 layers"):
        open_engine(path)
