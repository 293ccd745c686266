"""Llama family (serves model_type llama, qwen2, qwen3, mistral) on the shared decoder.

What tells these four apart is read from the config where the config says it; Qwen2's q/k/v
bias and Qwen3's q/k norm are fixed by their architecture, not written in their configs.
"""

from __future__ import annotations

from typing import Any

from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, Rope, rope_parameters, sliding_windows

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# model_type -> (q/k/v bias, o bias) where the architecture fixes them; else config.attention_bias
_FIXED_BIASES = {"qwen2": (True, False), "mistral": (False, False)}


def args_from_config(config: Any) -> DecoderArgs:
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias, o_bias = _FIXED_BIASES.get(config.model_type, (attention_bias, attention_bias))
    rope = Rope.from_parameters(rope_parameters(config), head_dim, config)
    return DecoderArgs(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        ropes=(rope,) * config.num_hidden_layers,
        sliding_windows=sliding_windows(config),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=config.model_type == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_scale=head_dim ** -0.5,
    )


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
