"""MiniMax-M2 (model_type minimax_m2) on the shared decoder, against transformers on tiny seeded
checkpoints (the pattern of test_family_mixtral_granite.py):

    minimax_m2  3 layers, head_dim 16, rotary on 8 of 16 dims (rotary_dim 8), q/k norms over the
                whole projections; every layer top-4 of 16 experts (intermediate 32) by sigmoid
                score + the block's random correction bias, renormalised; router rows and biases
                tied in pairs (tiny_models.TIED_EXPERT_PAIRS); checkpoints name the block
                block_sparse_moe and its experts w1 / w3 / w2, as Mixtral's

Greedy token for token as `generate`, 3 agents x 3 turns batched with retention, speculation on,
loaded from disk or from transformers' in-memory model alike.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiny_models import (EVERY_TENSOR_USED, agent_turn_plan, assert_greedy_matches, greedy_turns_at_once,
                         make_tiny_checkpoint, random_tokens)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


@pytest.fixture(scope="module")
def minimax(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("minimax_m2", tmp_path_factory.mktemp("minimax_m2") / "m")


def test_minimax_m2_reads_its_config(minimax, make_engine):
    model = make_engine(minimax).model
    args = model.args
    assert args.moe.layers == (True,) * 3 and args.moe.top_k == 4 and not args.moe.round_weights
    assert args.qk_norm_whole and {rope.dim for rope in args.ropes} == {8}
    block = model.model.layers[0].mlp
    assert block.scoring == "sigmoid" and block.shared_experts is None and block.scale == 1.0


def test_minimax_m2_agents_batched_with_retention_match_transformers(minimax, make_engine):
    engine = make_engine(minimax)
    agents = greedy_turns_at_once(engine, "mm", [agent_turn_plan(9600 + a, turns=3) for a in range(3)])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(minimax, history, completion.token_ids)
    assert engine.stats().prompt_tokens_reused > 0, "later turns must reuse the retained KV"


def test_minimax_m2_with_speculation_matches_transformers(minimax, make_engine):
    rng = random.Random(9650)
    phrase = random_tokens(rng, 12)
    histories = [random_tokens(rng, 10) + phrase * 3 + random_tokens(rng, 5) + phrase[:4] for _ in range(3)]
    engine = make_engine(minimax, speculation={"method": "suffix", "k": 4})
    for turns in greedy_turns_at_once(engine, "spec", [[(h, 24)] for h in histories]):
        for history, completion in turns:
            assert_greedy_matches(minimax, history, completion.token_ids)
    assert engine.stats().draft_tokens_proposed > 0


def test_minimax_m2_loads_from_an_in_memory_model(minimax, make_engine):
    """transformers holds the block as mlp.* (its experts stacked, its bias a buffer), where the
    checkpoint on disk says block_sparse_moe.*: both load alike."""
    from hibana_core import Engine, SamplingParams
    from tiny_models import _hf_model

    hf_model = _hf_model(str(minimax))
    assert any(name.endswith("mlp.e_score_correction_bias") for name in hf_model.state_dict())
    history = random_tokens(random.Random(7), 50)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with Engine.from_hf_model(hf_model, None, device="cpu", dtype="float32", block_size=16, num_blocks=64,
                              progress=False) as engine:
        got = engine.open_state("mem").generate(params, prompt=history).token_ids
    assert list(got) == list(make_engine(minimax).open_state("disk").generate(params, prompt=history).token_ids)
    assert_greedy_matches(minimax, history, got)
