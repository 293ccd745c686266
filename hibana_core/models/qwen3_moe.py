"""Qwen3-MoE (model_type qwen3_moe: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B) on the
shared decoder: Qwen3's attention (q/k norm) with a sparse block in place of the MLP, softmax
routing to the top num_experts_per_tok of num_experts, the top-k weights renormalised when
norm_topk_prob; no shared expert. A layer is sparse unless listed in mlp_only_layers and where
(layer + 1) is a multiple of decoder_sparse_step, as in transformers.
"""

from __future__ import annotations

from typing import Any

from hibana_core.errors import CheckpointError, UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, activation_of, sliding_windows
from hibana_core.models.moe import MoEArgs

MODEL_TYPES = ("qwen3_moe",)


def args_from_config(config: Any) -> DecoderArgs:
    if activation_of(config) != "silu":  # the experts' kernels compute SwiGLU
        raise UnsupportedModelError(f"qwen3_moe with hidden_act {config.hidden_act!r} is not supported; "
                                    "its experts run SwiGLU (hidden_act 'silu')")
    moe = MoEArgs(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                  layers=sparse_layers(config))
    return DecoderArgs.from_config(config, mlp_bias=False, qk_norm=True, moe=moe,
                                   sliding_windows=sliding_windows(config, reads=("use_sliding_window",)))


def sparse_layers(config: Any) -> tuple[bool, ...]:
    """Which layers are sparse, as transformers' Qwen3-MoE (and Qwen3-Next) choose: not in
    mlp_only_layers, and (layer + 1) a multiple of decoder_sparse_step."""
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = config.decoder_sparse_step
    if config.num_experts > 0 and (isinstance(step, bool) or not isinstance(step, int) or step <= 0):
        raise CheckpointError(f"config.json's decoder_sparse_step is {step!r}; it must be a positive integer "
                              "(every how many layers one is a MoE layer; 1: all)")
    return tuple(i not in dense_only and config.num_experts > 0 and (i + 1) % step == 0
                 for i in range(config.num_hidden_layers))


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
