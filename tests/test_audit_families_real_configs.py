"""config.json as the released checkpoints users run write it (transformers 4.x fields: rope_theta
beside rope_scaling, "type" for rope_type, torch_dtype, layer kinds left to sliding_window_pattern
or to the class defaults), field for field but for sizes scaled down to tiny_models' (2 layers,
hidden 64, vocab 512), each against transformers' generate: several agents at once, several
turns, histories past each sliding window and across LongRoPE's switch."""

from __future__ import annotations

import json
import random

import pytest

from hibana_core import SamplingParams
from tiny_models import EVERY_TENSOR_USED, assert_greedy_matches, greedy_turns_at_once, make_tiny_checkpoint

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]

SWITCH = 64  # original_max_position_embeddings of the scaled Phi configs (released: 4096)
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5]
LONG = [1.0, 2.0, 3.5, 6.0, 10.0, 16.0, 24.0, 32.0]

# name -> (arch, tiny_models overrides giving the checkpoint the same tensors, the released config.json scaled)
RELEASED = {
    "Qwen3-30B-A3B": ("qwen3_moe", dict(num_hidden_layers=2, head_dim=16, num_experts=8, mlp_only_layers=[]), {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "decoder_sparse_step": 1, "eos_token_id": 0, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 512}),
    "gpt-oss-20b": ("gpt_oss", dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=32), {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 0, "experts_per_token": 4, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 32,
        "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 4, "num_experts_per_tok": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "num_local_experts": 8, "output_router_logits": False, "pad_token_id": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 32, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0",
        "use_cache": True, "vocab_size": 512}),
    # no layer_types: sliding_window_pattern (released: 6 over 26 layers) makes every second layer global
    "gemma-3-1b-it": ("gemma3", dict(num_hidden_layers=2, num_key_value_heads=1, final_logit_softcapping=None,
                                     layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True), {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 128, "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1, "pad_token_id": 3,
        "query_pre_attn_scalar": 16, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 24, "sliding_window_pattern": 2, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 512}),
    # "type": "longrope", partial_rotary_factor and original_max_position_embeddings at the top, tied,
    # a sliding_window past the context
    "Phi-4-mini-instruct": ("phi3", dict(tie_word_embeddings=True, original_max_position_embeddings=SWITCH,
                                         max_position_embeddings=32 * SWITCH, rope_parameters=dict(
                                             rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                             short_factor=SHORT[:6], long_factor=LONG[:6])), {
        "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "embd_pdrop": 0.0, "eos_token_id": 0, "full_attn_mod": 1, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "interpolate_factor": 1,
        "lm_head_bias": False, "max_position_embeddings": 32 * SWITCH, "mlp_bias": False, "model_type": "phi3",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "original_max_position_embeddings": SWITCH, "pad_token_id": 0, "partial_rotary_factor": 0.75,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": LONG[:6], "short_factor": SHORT[:6], "type": "longrope"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 512}),
    "Phi-3.5-mini-instruct": ("phi3", dict(num_key_value_heads=4, sliding_window=None, original_max_position_embeddings=SWITCH,
                                           max_position_embeddings=32 * SWITCH, rope_parameters=dict(
                                               rope_type="longrope", rope_theta=10000.0, short_factor=SHORT,
                                               long_factor=LONG)), {
        "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 32 * SWITCH,
        "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
        "original_max_position_embeddings": SWITCH, "pad_token_id": 0, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": LONG, "short_factor": SHORT, "type": "longrope"}, "rope_theta": 10000.0,
        "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.3", "use_cache": True, "vocab_size": 512}),
    "Llama-3.2-1B-Instruct": ("llama", dict(num_hidden_layers=2, tie_word_embeddings=True), {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": [0, 2, 3], "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 512}),
    "Mistral-7B-v0.3": ("mistral", dict(num_hidden_layers=2, sliding_window=None), {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 512}),
    # a sliding_window shorter than the histories, with use_sliding_window false: full attention
    "Qwen2.5-7B-Instruct": ("qwen2", dict(num_hidden_layers=2), {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 24, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 512}),
    # YaRN as its model card adds it for long contexts (a factor unlike max / original positions)
    "Qwen3-8B-yarn": ("qwen3", dict(num_hidden_layers=2, tie_word_embeddings=False), {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 0, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 512}),
}


def released_checkpoint(name: str, path):
    arch, tensors, config = RELEASED[name]
    path = make_tiny_checkpoint(arch, path, **tensors)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def two_agents_two_turns(engine, checkpoint, seed: int) -> None:
    """2 agents at once, 2 turns each with retention (40-47 tokens and 28 generated, then 10 new
    and 8): the first generation crosses LongRoPE's switch, and histories pass every window."""
    plans = []
    for agent in range(2):
        rng = random.Random(seed + agent)
        plans.append([([rng.randrange(4, 512) for _ in range(new)], n) for new, n in ((40 + 7 * agent, 28), (10, 8))])
    for turns in greedy_turns_at_once(engine, "agent", plans):
        for history, completion in turns:
            assert_greedy_matches(checkpoint, history, completion.token_ids)


@pytest.mark.parametrize("name", RELEASED)
def test_released_configs_run_as_transformers_runs_them(name, tmp_path, make_engine):
    path = released_checkpoint(name, tmp_path / name)
    two_agents_two_turns(make_engine(path), path, seed=len(name))


def test_gpt_oss_saved_dequantized_with_its_mxfp4_config_loads_float_experts(tmp_path, make_engine):
    """gpt-oss experts saved dequantized (float gate_up_proj / down_proj) beside a config.json
    that still names quant_method mxfp4, as a conversion that keeps the released config leaves it:
    transformers loads it with Mxfp4Config(dequantize=True) (and on CPU, dequantizing anyway);
    Hibana asked for the MXFP4 blocks and scales the checkpoint has not (a CheckpointError)."""
    path = released_checkpoint("gpt-oss-20b", tmp_path / "gpt-oss-dequantized")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "dequantize": True, "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    engine = make_engine(path)
    experts = engine.model.model.layers[0].mlp.experts.kernel_experts()
    assert experts.kind == "dense"
    history = [random.Random(3).randrange(4, 512) for _ in range(50)]
    c = engine.open_state("a").generate(SamplingParams(max_tokens=16, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


def test_gemma3_4b_multimodal_config_with_its_text_defaults(tmp_path, make_engine):
    """gemma-3-4b-it's config.json: a multimodal gemma3 whose text_config names sizes, a sliding_window
    and rope_scaling linear 8 alone, leaving the rest to Gemma3TextConfig's defaults
    (sliding_window_pattern 6: layer 5 global, query_pre_attn_scalar 256, rope_theta 1e6 and
    rope_local_base_freq 1e4, no softcapping), tie_word_embeddings to Gemma3Config's (tied: the
    checkpoint holds no lm_head). 2 agents, 2 turns each."""
    from transformers import Gemma3Config, SiglipVisionConfig

    from tiny_models import _save_seeded, make_config

    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    text = make_config("gemma3", num_hidden_layers=6, layer_types=kinds, sliding_window=24, final_logit_softcapping=None)
    vision = dict(hidden_size=32, image_size=28, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
                  patch_size=14)
    path = _save_seeded(Gemma3Config(text_config=text.to_dict(), vision_config=SiglipVisionConfig(**vision).to_dict(),
                                     mm_tokens_per_image=4, boi_token_index=509, eoi_token_index=510,
                                     image_token_index=511, tie_word_embeddings=True), tmp_path / "gemma-3-4b-it", seed=5)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 509, "eoi_token_index": 510,
        "eos_token_id": [1, 106], "image_token_index": 511, "initializer_range": 0.02, "mm_tokens_per_image": 4,
        "model_type": "gemma3",
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text",
                        "num_hidden_layers": 6, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 24, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 512},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {**vision, "model_type": "siglip_vision_model", "vision_use_head": False}}))
    engine = make_engine(path)
    args = engine.model.args
    assert args.sliding_windows == (24,) * 5 + (None,) and args.tie_word_embeddings
    assert [r.rope_type for r in args.ropes] == ["default"] * 5 + ["linear"]
    two_agents_two_turns(engine, path, seed=11)
