"""MiniMax-M2 (model_type minimax_m2: MiniMax-M2, M2.1, M2.5) on the shared decoder: attention with
q/k norms over the whole projections (OLMo's, `qk_norm_whole`) and rotary on the first rotary_dim
of each head (its config's partial_rotary_factor); every layer a sparse block of
`num_local_experts` SwiGLU experts routed as GLM-4.5 routes (sigmoid scores, the top k of score +
the block's e_score_correction_bias, weights the scores renormalised), with the router and the
bias in the model's dtype and no shared expert, as transformers' MiniMaxM2SparseMoeBlock.

Checkpoints name the block and its experts as Mixtral's do, read into the shared names
(`DecoderArgs.checkpoint_renames`): block_sparse_moe.gate.weight, block_sparse_moe.e_score_correction_bias,
block_sparse_moe.experts.{e}.w1 / w3 / w2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, activation_of
from hibana_core.models.glm4_moe import Glm4MoE
from hibana_core.models.mixtral import CHECKPOINT_RENAMES
from hibana_core.models.moe import Experts, ExpertsBlock, MoEArgs, Router

MODEL_TYPES = ("minimax_m2",)


def args_from_config(config: Any) -> DecoderArgs:
    if activation_of(config) != "silu":  # the experts' kernels compute SwiGLU
        raise UnsupportedModelError(f"minimax_m2 with hidden_act {config.hidden_act!r} is not supported; "
                                    "its experts run SwiGLU (hidden_act 'silu')")
    layers = config.num_hidden_layers
    moe = MoEArgs(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.intermediate_size, renormalize=True, layers=(True,) * layers,
                  round_weights=False)
    return DecoderArgs.from_config(config, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True,
                                   qk_norm_whole=True, partial_rotary=True, moe=moe,
                                   sliding_windows=(None,) * layers, checkpoint_renames=CHECKPOINT_RENAMES)


class MiniMaxM2MoE(Glm4MoE):
    """GLM-4.5's block (its forward), routed by a router of the model's dtype and the block's own
    correction bias, with no shared expert and no scale."""

    def __init__(self, moe: MoEArgs, hidden_size: int) -> None:
        ExpertsBlock.__init__(self)
        self.top_k, self.renormalize, self.scale = moe.top_k, moe.renormalize, 1.0
        self.gate = Router(hidden_size, moe.num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))
        self.experts = Experts(moe, hidden_size)
        self.shared_experts = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = kernels.linear(h, self.gate.weight)  # the model's dtype; scored in float32
        return kernels.moe_route(logits, self.top_k, scoring="sigmoid", renormalize=self.renormalize,
                                 correction_bias=self.e_score_correction_bias)


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    """The shared decoder with MiniMax-M2's sparse block in every layer."""

    def __init__(self, args: DecoderArgs, ctx: ForwardContext) -> None:
        super().__init__(args, ctx)
        for layer in self.model.layers:
            layer.mlp = MiniMaxM2MoE(args.moe, args.hidden_size)


def build(config: Any, ctx: ForwardContext) -> tuple[MiniMaxM2ForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return MiniMaxM2ForCausalLM(args, ctx), args
