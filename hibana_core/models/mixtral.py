"""Mixtral (model_type mixtral: Mixtral-8x7B, Mixtral-8x22B and their fine-tunes) on the shared
decoder: Llama's attention (no biases), every layer windowed by sliding_window where the config
sets it (as transformers' Mixtral, like Mistral, reads neither layer_types nor
use_sliding_window), and a sparse block in place of every MLP: softmax over num_local_experts
in float32, the top num_experts_per_tok of those probabilities, renormalised over the k
(transformers' MixtralTopKRouter, in that order) and kept in float32: each expert's output times
its weight is rounded once (Qwen3-MoE rounds the weights to the model dtype first); SwiGLU experts.

Checkpoints on disk name the block and its experts their own way, read into the shared sparse
block's names (`DecoderArgs.checkpoint_renames`):

    block_sparse_moe.gate.weight             -> mlp.gate.weight
    block_sparse_moe.experts.{e}.w1.weight   -> mlp.experts.{e}.gate_proj.weight
    block_sparse_moe.experts.{e}.w3.weight   -> mlp.experts.{e}.up_proj.weight
    block_sparse_moe.experts.{e}.w2.weight   -> mlp.experts.{e}.down_proj.weight

(transformers 5 holds them stacked in memory, mlp.experts.gate_up_proj / down_proj, as Hibana
does: an in-memory model loads as it is.)
"""

from __future__ import annotations

from typing import Any

from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, activation_of, sliding_windows
from hibana_core.models.moe import MoEArgs

MODEL_TYPES = ("mixtral",)

CHECKPOINT_RENAMES = (("block_sparse_moe", "mlp"), ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def args_from_config(config: Any) -> DecoderArgs:
    if activation_of(config) != "silu":  # the experts' kernels compute SwiGLU
        raise UnsupportedModelError(f"mixtral with hidden_act {config.hidden_act!r} is not supported; "
                                    "its experts run SwiGLU (hidden_act 'silu')")
    moe = MoEArgs(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.intermediate_size, renormalize=True,
                  layers=(True,) * config.num_hidden_layers, round_weights=False)
    return DecoderArgs.from_config(config, qkv_bias=False, o_bias=False, mlp_bias=False, moe=moe,
                                   sliding_windows=sliding_windows(config, reads=()),
                                   checkpoint_renames=CHECKPOINT_RENAMES)


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
