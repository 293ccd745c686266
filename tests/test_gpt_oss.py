"""gpt-oss beyond the golden tests: YaRN's tables as transformers computes them, and MXFP4
checkpoints (the released format) loaded as they are, matching transformers' dequantized model."""

from __future__ import annotations

import random

import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.models import gpt_oss
from tiny_models import (EVERY_TENSOR_USED, _hf_model, assert_greedy_matches, make_config, make_mxfp4_checkpoint,
                         random_tokens)

pytestmark = EVERY_TENSOR_USED


@pytest.mark.parametrize("rope", [
    {},  # the tiny checkpoint's: gpt-oss's own parameters
    dict(truncate=True, beta_fast=16.0, beta_slow=2.0),
    dict(factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=256),
    dict(attention_factor=1.25),
], ids=["gpt-oss", "truncated", "mscale", "given-attention-factor"])
def test_yarn_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**make_config("gpt_oss").rope_parameters, **rope}
    config = make_config("gpt_oss", rope_parameters={k: v for k, v in params.items() if v is not None})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = gpt_oss.args_from_config(config).ropes[0]
    assert torch.equal(ours.inv_freq(), inv_freq)
    assert ours.attention_factor == attention_factor
    kept = (ours.inv_freq() == 1.0 / ours.theta ** (torch.arange(0, 16, 2).float() / 16)).sum()
    assert 0 < kept < 8, "the tiny config should keep some frequencies and scale others"


def test_mxfp4_checkpoint_loads_as_is_and_matches_transformers_dequantized(tiny_checkpoints, make_engine, tmp_path):
    """The experts stay MXFP4 in the engine (blocks and scales, deinterleaved), and greedy output
    equals transformers' on the same checkpoint, which dequantizes the experts to float32 on CPU."""
    path = make_mxfp4_checkpoint(tiny_checkpoints["gpt_oss"], tmp_path / "mxfp4")
    hf_experts = _hf_model(str(path)).model.layers[0].mlp.experts
    assert hf_experts.gate_up_proj.dtype == torch.float32, "transformers should have dequantized"
    engine = make_engine(path)
    experts = engine.model.model.layers[0].mlp.experts.kernel_experts()
    assert experts.kind == "mxfp4" and experts.w13.dtype == torch.uint8
    assert torch.equal(experts.expert_weights(3, torch.float32)[0][:32],
                       hf_experts.gate_up_proj[3].t()[0::2])  # gate rows: the even ones there
    float_engine = make_engine(tiny_checkpoints["gpt_oss"])
    history = random_tokens(random.Random(7), 70)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = list(engine.open_state("q").generate(params, prompt=history).token_ids)
    assert_greedy_matches(path, history, got)
    unquantized = list(float_engine.open_state("f").generate(params, prompt=history).token_ids)
    assert got != unquantized, "MXFP4 rounding should change this tiny model's output"


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_decode_bytes_per_token_counts_routed_experts_only(tiny_checkpoints, make_engine, tmp_path, mxfp4):
    """The roofline numerator: all weights less the experts (weights, scales, biases) a token is
    not routed to and the other tokens' embedding rows (lm_head untied)."""
    path = tiny_checkpoints["gpt_oss"]
    engine = make_engine(make_mxfp4_checkpoint(path, tmp_path / "q") if mxfp4 else path)
    c = engine.hf_config
    e, i, h = c.num_local_experts, c.intermediate_size, c.hidden_size
    weights = 3 * i * h // 2 + 3 * i * h // 32 if mxfp4 else 3 * i * h * 4  # codes and scales, or float32
    per_expert = weights + (2 * i + h) * 4  # and the biases
    unrouted = c.num_hidden_layers * (e - c.num_experts_per_tok) * per_expert
    other_rows = (c.vocab_size - 1) * h * 4
    assert engine.model.decode_bytes_per_token() == engine.weight_bytes - unrouted - other_rows
