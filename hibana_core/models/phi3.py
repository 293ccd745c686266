"""Phi-3 and Phi-4-mini (model_type phi3) on the shared decoder.

Its differences: the checkpoint already holds q/k/v as one qkv_proj and gate/up as one
gate_up_proj (loaded as they are); rotary may cover only the first partial_rotary_factor of each
head (Phi-4-mini: 0.75); LongRoPE scaling, whose short/long factors apply per position (see
`Rope.angles`), whose attention factor scales cos and sin, and whose crossing of the switch
recomputes the whole cache under the long factors (transformers' Phi-3 generate does); a
sliding_window, where set, on every layer.
"""

from __future__ import annotations

from typing import Any

from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, sliding_windows

MODEL_TYPES = ("phi3",)


def args_from_config(config: Any) -> DecoderArgs:
    return DecoderArgs.from_config(config, qkv_bias=False, o_bias=False, mlp_bias=False, fused_in_checkpoint=True,
                                   longrope_recompute=True, partial_rotary=True,
                                   sliding_windows=sliding_windows(config, reads=()))


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
