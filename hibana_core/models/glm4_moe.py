"""GLM-4.5 / GLM-4.6 (model_type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6) on the shared decoder.

Attention is Llama's with q/k/v biases where `attention_bias` (never on o_proj), q/k norms where
`use_qk_norm`, and rotary on the first partial_rotary_factor (0.5) of each head, as rotate_half
over those dims (Phi-3's partial rotary). The first `first_k_dense_replace` layers keep a dense
MLP (intermediate_size); the others are a sparse block of `n_routed_experts` SwiGLU experts
(moe_intermediate_size) beside `n_shared_experts` always-on experts, one MLP of
moe_intermediate_size * n_shared_experts. Routing, as transformers' Glm4MoeTopkRouter:

    logits  = h @ gate.weight^T                  in float32 (router weight and bias kept in float32)
    scores  = sigmoid(logits)
    experts = top num_experts_per_tok of scores + gate.e_score_correction_bias
    weights = their scores (without the bias), / their sum where norm_topk_prob, * routed_scaling_factor

and each expert's output times its float32 weight is rounded once (Mixtral's order,
`MoEArgs.round_weights=False`); the shared experts' output is added to the routed sum.
Expert groups (DeepSeek-V3's n_group > 1 with topk_group < n_group) are not supported: every
GLM-4.x MoE checkpoint routes in one group.

The checkpoint's multi-token-prediction layers (`num_mtp_layers`, stored as layers
num_hidden_layers, ...) are left out, as transformers leaves them out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import CheckpointError, UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import MLP, DecoderArgs, DecoderForCausalLM, activation_of
from hibana_core.models.moe import Experts, ExpertsBlock, MoEArgs

MODEL_TYPES = ("glm4_moe",)


def args_from_config(config: Any) -> DecoderArgs:
    if activation_of(config) != "silu":  # the experts' kernels compute SwiGLU
        raise UnsupportedModelError(f"glm4_moe with hidden_act {config.hidden_act!r} is not supported; "
                                    "its experts run SwiGLU (hidden_act 'silu')")
    groups, kept = getattr(config, "n_group", 1) or 1, getattr(config, "topk_group", 1) or 1
    if kept < groups:
        raise UnsupportedModelError(f"glm4_moe routing within {kept} of {groups} expert groups (n_group, "
                                    "topk_group) is not supported; Hibana routes GLM-4.x MoE checkpoints in one "
                                    "group (n_group 1, or topk_group equal to n_group)")
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise CheckpointError(f"config.json's first_k_dense_replace is {dense!r}; it must be a non-negative "
                              "integer (how many first layers keep a dense MLP)")
    experts = config.n_routed_experts
    moe = MoEArgs(num_experts=experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                  layers=tuple(i >= dense and experts > 0 for i in range(config.num_hidden_layers)),
                  round_weights=False)
    layers = config.num_hidden_layers  # (the MTP layers: transformers 5's num_mtp_layers, GLM's config.json's name)
    extra = getattr(config, "num_mtp_layers", None) or getattr(config, "num_nextn_predict_layers", None) or 0
    left_out = tuple(f"model.layers.{layers + i}." for i in range(int(extra)))
    if not getattr(config, "n_shared_experts", 0):  # transformers saves an empty shared MLP: nothing to read
        left_out += tuple(f"model.layers.{i}.mlp.shared_experts." for i, sparse in enumerate(moe.layers) if sparse)
    return DecoderArgs.from_config(config, qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False,
                                   mlp_bias=False, qk_norm=bool(getattr(config, "use_qk_norm", False)), moe=moe,
                                   sliding_windows=(None,) * layers, partial_rotary=True,
                                   checkpoint_other_parts=left_out)


class SigmoidRouter(nn.Module):
    """GLM-4.5's router: weight [E, H] and e_score_correction_bias [E], both held in float32
    whatever the model's dtype (transformers keeps them so: `_keep_in_fp32_modules_strict`)."""

    float32_parameters = ("weight", "e_score_correction_bias")

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))


class Glm4MoE(ExpertsBlock):
    """GLM-4.5's sparse block: sigmoid routing with a correction bias and a scale (the module
    docstring), the routed experts and the shared ones."""

    scoring = "sigmoid"

    def __init__(self, moe: MoEArgs, config: Any) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        self.gate = SigmoidRouter(config.hidden_size, moe.num_experts)
        self.experts = Experts(moe, config.hidden_size)
        shared = (getattr(config, "n_shared_experts", 0) or 0) * moe.intermediate_size
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None

    def router_weights(self) -> tuple[torch.Tensor, None]:
        return self.gate.weight, None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = kernels.linear(h.float(), self.gate.weight)  # float32, as transformers' router
        return kernels.moe_route(logits, self.top_k, scoring="sigmoid", renormalize=self.renormalize,
                                 correction_bias=self.gate.e_score_correction_bias, scale=self.scale)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)
        weights, ids = self.route(h)
        out = kernels.fused_moe(h, self.experts.kernel_experts(), weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts.of_normed(h)
        return out, residual


class Glm4MoeForCausalLM(DecoderForCausalLM):
    """The shared decoder with GLM-4.5's sparse block in the layers its MoEArgs name."""

    def __init__(self, args: DecoderArgs, ctx: ForwardContext, config: Any) -> None:
        super().__init__(args, ctx)
        for layer, sparse in zip(self.model.layers, args.moe.layers):
            if sparse:
                layer.mlp = Glm4MoE(args.moe, config)


def build(config: Any, ctx: ForwardContext) -> tuple[Glm4MoeForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return Glm4MoeForCausalLM(args, ctx, config), args
