"""OLMo 2 and OLMo 3 (model_type olmo2, olmo3) on the shared decoder, against transformers on tiny
seeded checkpoints (the pattern of test_family_mixtral_granite.py):

    olmo2  2 layers: post-norm (an RMSNorm after attention and after the MLP, none before), q/k
           norms over the whole projections (64 and 32 wide: all heads at once)
    olmo3  3 layers as OLMo 2's, sliding (window 20, rope theta 1e4), sliding, full (theta 5e5,
           linear factor 2): each layer kind its own rope

Greedy token for token as `generate`, 3 agents x 3 turns batched with retention past the window,
speculation on.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiny_models import (EVERY_TENSOR_USED, agent_turn_plan, assert_greedy_matches, greedy_turns_at_once,
                         make_tiny_checkpoint, random_tokens)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def olmo(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "o")


def test_olmo_reads_its_layers(olmo, make_engine):
    arch, path = olmo
    model = make_engine(path).model
    attention = model.model.layers[0].self_attn
    assert model.args.qk_norm_whole and not model.args.pre_norms
    assert attention.q_norm.weight.shape == (64,) and attention.k_norm.weight.shape == (32,)  # 4 x 16, 2 x 16
    if arch == "olmo3":
        assert model.args.sliding_windows == (20, 20, None)
        assert [(r.rope_type, r.theta) for r in model.args.ropes] == [("default", 1e4), ("default", 1e4),
                                                                      ("linear", 5e5)]


def test_olmo_agents_batched_with_retention_match_transformers(olmo, make_engine):
    arch, path = olmo
    engine = make_engine(path)
    agents = greedy_turns_at_once(engine, arch, [agent_turn_plan(9990 + a, turns=3) for a in range(3)])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    assert engine.stats().prompt_tokens_reused > 0, "later turns must reuse the retained KV"


def test_olmo_with_speculation_matches_transformers(olmo, make_engine):
    arch, path = olmo
    rng = random.Random(9995)
    phrase = random_tokens(rng, 12)
    histories = [random_tokens(rng, 10) + phrase * 3 + random_tokens(rng, 5) + phrase[:4] for _ in range(3)]
    engine = make_engine(path, speculation={"method": "suffix", "k": 4})
    for turns in greedy_turns_at_once(engine, "spec", [[(h, 24)] for h in histories]):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    assert engine.stats().draft_tokens_proposed > 0
