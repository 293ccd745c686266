"""OLMo 2 and OLMo 3 (model_type olmo2, olmo3: OLMo-2-1124-7B ... OLMo-3-32B) on the shared
decoder: post-norm layers (an RMSNorm after attention and after the MLP, none before:
`DecoderArgs.pre_norms`), q/k norms over the whole projections (all heads at once, before the
heads part: `qk_norm_whole`), q/k/v/o biases where `attention_bias`. OLMo 3 windows the layers
its layer_types name sliding_attention and gives each layer kind its own rope, as its
rope_parameters does per kind.
"""

from __future__ import annotations

from typing import Any

from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, Rope, sliding_windows

MODEL_TYPES = ("olmo2", "olmo3")


def args_from_config(config: Any) -> DecoderArgs:
    bias = bool(getattr(config, "attention_bias", False))
    per_kind = {}
    if config.model_type == "olmo3":  # (OLMo 2 has one rope and full attention everywhere)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        ropes = {kind: Rope.from_parameters(dict(config.rope_parameters[kind]), head_dim, config)
                 for kind in set(config.layer_types)}
        per_kind = dict(sliding_windows=sliding_windows(config, reads=("layer_types",)),
                        ropes=tuple(ropes[kind] for kind in config.layer_types))
    else:
        per_kind = dict(sliding_windows=(None,) * config.num_hidden_layers)
    return DecoderArgs.from_config(config, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                                   qk_norm_whole=True, sandwich_norms=True, pre_norms=False, **per_kind)


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
