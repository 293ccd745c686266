"""EXAONE 4.0 (model_type exaone4: EXAONE-4.0-32B, -1.2B) on the shared decoder: post-norm layers
(no norm before attention or MLP, an RMSNorm after each, before its residual add: the sandwich's
after-norms alone, `DecoderArgs.pre_norms`), q/k norms, and hybrid attention: the layers its
layer_types name sliding_attention attend within `sliding_window` and rotate, the full-attention
layers are NoPE where the config has a sliding window (all rotate where it has none), as
transformers' Exaone4Attention does.
"""

from __future__ import annotations

from typing import Any

from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, Rope, rope_parameters, sliding_windows

MODEL_TYPES = ("exaone4",)


def args_from_config(config: Any) -> DecoderArgs:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    windows = sliding_windows(config, reads=("layer_types",))
    rope = Rope.from_parameters(rope_parameters(config), head_dim, config)
    hybrid = config.sliding_window is not None
    return DecoderArgs.from_config(
        config, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, sandwich_norms=True, pre_norms=False,
        sliding_windows=windows,
        ropes=tuple(Rope.none(head_dim) if hybrid and window is None else rope for window in windows))


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
