"""GLM-4.5 / GLM-4.6 (model_type glm4_moe) on the shared decoder, against transformers on tiny
seeded checkpoints (the pattern of test_family_mixtral_granite.py):

    glm4_moe  3 layers, head_dim 16, rotary on 8 of 16 dims (partial_rotary_factor 0.5), q/k/v
              biases, q/k norms; layer 0 dense (first_k_dense_replace 1), layers 1-2 top-4 of 16
              experts by sigmoid score + a random correction bias, weights renormalised and
              scaled by 2.5, one shared expert; router rows and biases tied in pairs
              (tiny_models.TIED_EXPERT_PAIRS)

Greedy token for token as `generate`, 3 agents x 3 turns batched with retention, speculation on,
the router in float32 under a bfloat16 model, the multi-token-prediction layers a checkpoint
stores left out, the configs Hibana refuses.
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
def glm(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("glm4_moe", tmp_path_factory.mktemp("glm4_moe") / "g")


def test_glm4_moe_reads_its_config(glm, make_engine):
    args = make_engine(glm).model.args
    assert args.moe.layers == (False, True, True) and args.moe.top_k == 4 and args.moe.renormalize
    assert not args.moe.round_weights  # float32 weights, each product rounded (transformers' experts)
    assert args.qkv_bias and not args.o_bias and args.qk_norm
    assert {rope.dim for rope in args.ropes} == {8}  # half of head_dim 16
    assert args.sliding_windows == (None,) * 3


def test_glm4_moe_agents_batched_with_retention_match_transformers(glm, make_engine):
    three_agents_three_turns(make_engine(glm), glm, "glm", 9100)


@pytest.mark.parametrize("variant", [
    dict(n_shared_experts=2, first_k_dense_replace=0, attention_bias=False, use_qk_norm=False,
         norm_topk_prob=False, routed_scaling_factor=1.0),
    dict(n_shared_experts=0, num_experts_per_tok=1, n_group=2, topk_group=2),
], ids=["two-shared-all-sparse-plain-attention", "no-shared-top1-one-kept-group-of-two"])
def test_glm4_moe_variants_match_transformers(tmp_path, make_engine, variant):
    path = make_tiny_checkpoint("glm4_moe", tmp_path / "v", **variant)
    three_agents_three_turns(make_engine(path), path, "v", 9200)


def test_glm4_moe_with_speculation_matches_transformers(glm, make_engine):
    rng = random.Random(9300)
    phrase = random_tokens(rng, 12)
    histories = [random_tokens(rng, 10) + phrase * 3 + random_tokens(rng, 5) + phrase[:4] for _ in range(3)]
    engine = make_engine(glm, speculation={"method": "suffix", "k": 4})
    agents = greedy_turns_at_once(engine, "spec", [[(h, 24)] for h in histories])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(glm, history, completion.token_ids)
    assert engine.stats().draft_tokens_proposed > 0


def test_glm4_moe_loads_from_an_in_memory_model(glm, make_engine):
    """`Engine.from_hf_model` copies transformers' state dict, whose correction bias is a buffer."""
    from hibana_core import Engine, SamplingParams
    from tiny_models import _hf_model

    hf_model = _hf_model(str(glm))
    history = random_tokens(random.Random(5), 50)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    with Engine.from_hf_model(hf_model, None, device="cpu", dtype="float32", block_size=16, num_blocks=64,
                              progress=False) as engine:
        got = engine.open_state("mem").generate(params, prompt=history).token_ids
    assert list(got) == list(make_engine(glm).open_state("disk").generate(params, prompt=history).token_ids)
    assert_greedy_matches(glm, history, got)


def test_glm4_moe_routes_in_float32_under_a_bfloat16_model(glm):
    """transformers keeps the router's weight and correction bias in float32 and computes its
    logits there; a bf16 engine does the same: the same experts and weights as
    Glm4MoeTopkRouter on the same bf16 hidden states (a bias rounded to bf16 would move picks
    whose scores differ by less than its rounding)."""
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine

    hf = AutoModelForCausalLM.from_pretrained(str(glm), dtype=torch.bfloat16)
    router = hf.model.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    with Engine.from_pretrained(str(glm), device="cpu", dtype="bfloat16", block_size=16, num_blocks=16,
                                progress=False) as engine:
        block = engine.model.model.layers[1].mlp
        assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
        h = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        weights, ids = block.route(h)
    _, want_weights, want_ids = router(h)
    assert torch.equal(ids.sort(dim=-1).values, want_ids.sort(dim=-1).values)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=1e-6, atol=1e-7)


def _with_mtp_layer(glm: Path, path: Path, num_mtp_layers: int) -> Path:
    """A copy of `glm` whose safetensors also hold a multi-token-prediction layer (layer 3, as
    GLM-4.5-Air's layer 46), its config naming them as GLM's config.json does (num_nextn_predict_layers,
    transformers' num_mtp_layers)."""
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(glm, path))
    tensors = load_file(path / "model.safetensors")
    for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "self_attn.q_proj.weight", "mlp.gate.weight"):
        tensors[f"model.layers.3.{name}"] = torch.zeros(4, 4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": num_mtp_layers}))
    return path


def test_glm4_moe_leaves_the_checkpoints_mtp_layers_out(glm, tmp_path, make_engine):
    path = _with_mtp_layer(glm, tmp_path / "mtp", num_mtp_layers=1)
    history = random_tokens(random.Random(6), 40)
    from hibana_core import SamplingParams

    got = make_engine(path).open_state("m").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=history)
    assert_greedy_matches(glm, history, got.token_ids)


@pytest.mark.filterwarnings("default:.*does not use:UserWarning")
def test_layers_past_the_model_are_reported_where_the_config_names_no_mtp_layer(glm, tmp_path):
    path = _with_mtp_layer(glm, tmp_path / "mtp0", num_mtp_layers=0)
    with pytest.warns(UserWarning, match="6 tensors this model does not use"):
        open_engine(path).close()


@pytest.mark.parametrize("edit, error, message", [
    ({"hidden_act": "gelu"}, "UnsupportedModelError", "hidden_act 'gelu'"),
    ({"n_group": 4, "topk_group": 2}, "UnsupportedModelError", "within 2 of 4 expert groups"),
    ({"num_experts_per_tok": 17}, "CheckpointError", "num_experts_per_tok 17"),
    ({"first_k_dense_replace": -1}, "CheckpointError", "first_k_dense_replace is -1"),
])
def test_glm4_moe_configs_it_cannot_run_are_refused(glm, tmp_path, edit, error, message):
    import hibana_core

    path = Path(shutil.copytree(glm, tmp_path / "edited"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(getattr(hibana_core, error), match=message):
        open_engine(path)
