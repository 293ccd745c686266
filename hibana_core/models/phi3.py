"""Phi-3 and Phi-4-mini (model_type phi3) on the shared decoder.

Its differences: the checkpoint already holds q/k/v as one qkv_proj and gate/up as one
gate_up_proj (loaded as they are); rotary may cover only the first partial_rotary_factor of each
head (Phi-4-mini: 0.75); LongRoPE scaling, whose short/long factors apply per position (see
`Rope.angles`) and whose attention factor scales cos and sin; a sliding_window, where set, on
every layer.
"""

from __future__ import annotations

from typing import Any

from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, Rope, rope_parameters, sliding_windows

MODEL_TYPES = ("phi3",)


def args_from_config(config: Any) -> DecoderArgs:
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rope = Rope.from_parameters(rope_parameters(config), head_dim, config)
    return DecoderArgs(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=config.num_key_value_heads or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        ropes=(rope,) * config.num_hidden_layers,
        sliding_windows=sliding_windows(config),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_scale=head_dim ** -0.5,
        activation=config.hidden_act,
        fused_in_checkpoint=True,
    )


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
