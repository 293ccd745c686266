"""Llama family (serves model_type llama, qwen2, qwen3, mistral, ministral) on the shared decoder.

What tells these four apart is read from the config where the config says it (the MLP's
activation too: hidden_act, as transformers' ACT2FN reads it); Qwen2's q/k/v bias and Qwen3's q/k
norm are fixed by their architecture, not written in their configs.
"""

from __future__ import annotations

from typing import Any

from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, sliding_windows

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "ministral")

# model_type -> (q/k/v bias, o bias) where the architecture fixes them; else config.attention_bias
_FIXED_BIASES = {"qwen2": (True, False), "mistral": (False, False), "ministral": (False, False)}

# transformers' Llama alone reads config.mlp_bias; Qwen2, Qwen3 and Mistral MLPs have no bias whatever
# a config.json says (their checkpoints hold none)
_MLP_BIAS_FROM_CONFIG = ("llama",)

# transformers' Llama attends to the whole history: a sliding_window (or layer_types) that a
# llama config.json carries from elsewhere is not read there, so not here either
_FULL_ATTENTION_ONLY = ("llama",)

# transformers' Mistral windows every layer whenever sliding_window is set (use_sliding_window is
# no field of its config); a mistral config.json with layer_types is read as a Ministral (model_type
# ministral), whose layers window by layer_types (its config derives them from sliding_window)
_WINDOWING_READS = {"mistral": ("layer_types",)}


def args_from_config(config: Any) -> DecoderArgs:
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias, o_bias = _FIXED_BIASES.get(config.model_type, (attention_bias, attention_bias))
    windows = {"sliding_windows": (None,) * config.num_hidden_layers} if config.model_type in _FULL_ATTENTION_ONLY else {}
    if config.model_type in _WINDOWING_READS:
        windows = {"sliding_windows": sliding_windows(config, reads=_WINDOWING_READS[config.model_type])}
    mlp_bias = bool(getattr(config, "mlp_bias", False)) and config.model_type in _MLP_BIAS_FROM_CONFIG
    return DecoderArgs.from_config(config, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                                   qk_norm=config.model_type == "qwen3", **windows)


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
