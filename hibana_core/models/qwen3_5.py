"""Qwen3.5 (model_type qwen3_5, and its language model alone, qwen3_5_text; the mixture-of-experts
releases qwen3_5_moe / qwen3_5_moe_text: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B) and Qwen3-Next
(qwen3_next: Qwen3-Next-80B-A3B, Qwen3-Coder-Next): hybrids of Gated DeltaNet linear-attention
layers and gated full-attention layers (three to one by default), on the shared decoder.

- linear_attention layers: `models/linear_attention.py`; their states live in the engine's
  recurrent cache, not in KV pages;
- full_attention layers: Qwen3's attention (q/k norms) whose q_proj also gives a sigmoid gate per
  head on the output, rotary on the first partial_rotary_factor (a quarter) of each head;
- every norm scales by 1 + weight in float32 (Gemma's arithmetic), the gated norm inside the
  linear layers by its weight;
- the MoE releases: every layer's MLP a sparse block, softmax routing to the top
  num_experts_per_tok, weights renormalised (Qwen3-MoE's router), beside one shared expert whose
  output is scaled by sigmoid(shared_expert_gate(h));
- Qwen3-Next: the same layers; its checkpoint's linear-attention input projections interleave
  each key head's q, k, v and z (`InterleavedGatedDeltaNet`), and its sparse layers follow
  Qwen3-MoE's mlp_only_layers / decoder_sparse_step and norm_topk_prob.

A Qwen3.5 checkpoint is multimodal (its language model under model.language_model.); the vision
tower is left unread and text prompts only are served. With all position rows equal, its
interleaved multimodal rope is the plain rope of the rotated dims. The multi-token-prediction
head (mtp.*) is not used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import (MLP, MULTIMODAL_PREFIXES, OTHER_TOWERS, DecoderArgs, DecoderForCausalLM,
                                        Linear, activation_of)
from hibana_core.models.linear_attention import LinearAttentionArgs
from hibana_core.models.moe import MoEArgs, SparseMoE

TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", *TEXT_TYPES)
LAYER_TYPES = ("linear_attention", "full_attention")
OTHER_PARTS = (*OTHER_TOWERS, "mtp.")


def args_from_config(config: Any) -> DecoderArgs:
    text = config.get_text_config()
    if text.model_type not in TEXT_TYPES:
        raise UnsupportedModelError(f"a {config.model_type} checkpoint whose language model is {text.model_type!r} "
                                    f"is not supported (its text_config must be one of {', '.join(TEXT_TYPES)})")
    if activation_of(text) != "silu":
        raise UnsupportedModelError(f"{config.model_type} with hidden_act {text.hidden_act!r} is not supported; its "
                                    "layers' gated MLPs and convolutions run SiLU (hidden_act 'silu')")
    layer_types = list(text.layer_types)
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"layer_types {unknown} are not supported; Qwen3.5 models have "
                                    f"{' and '.join(LAYER_TYPES)} layers")
    if "full_attention" not in layer_types:  # (the KV cache, its blocks and prefix index, needs a layer)
        raise UnsupportedModelError(f"{config.model_type} with no full_attention layer (layer_types all "
                                    "linear_attention) is not supported; Hibana serves hybrids with at least one")
    linear = LinearAttentionArgs(layers=tuple(kind == "linear_attention" for kind in layer_types),
                                 num_key_heads=text.linear_num_key_heads, num_value_heads=text.linear_num_value_heads,
                                 key_head_dim=text.linear_key_head_dim, value_head_dim=text.linear_value_head_dim,
                                 conv_kernel=text.linear_conv_kernel_dim, interleaved=text.model_type == "qwen3_next")
    if linear.num_value_heads % linear.num_key_heads:
        raise UnsupportedModelError(f"linear_num_value_heads {linear.num_value_heads} is not a multiple of "
                                    f"linear_num_key_heads {linear.num_key_heads}; each key head serves as many value "
                                    "heads (transformers fails on it too)")
    moe = None
    if text.model_type == "qwen3_5_moe_text":  # every layer sparse; the top-k weights always renormalised
        moe = MoEArgs(num_experts=text.num_experts, top_k=text.num_experts_per_tok,
                      intermediate_size=text.moe_intermediate_size, renormalize=True,
                      layers=(True,) * text.num_hidden_layers)
    elif text.model_type == "qwen3_next":  # Qwen3-MoE's choice of sparse layers and renormalisation
        from hibana_core.models.qwen3_moe import sparse_layers

        moe = MoEArgs(num_experts=text.num_experts, top_k=text.num_experts_per_tok,
                      intermediate_size=text.moe_intermediate_size, renormalize=bool(text.norm_topk_prob),
                      layers=sparse_layers(text))
    multimodal = {} if text is config else dict(model_type=config.model_type, checkpoint_prefixes=MULTIMODAL_PREFIXES,
                                                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    return DecoderArgs.from_config(text, mlp_bias=False, qk_norm=True,  # attention biases: attention_bias's
                                   unit_offset_norms=True, attention_output_gate=True, partial_rotary=True,
                                   sliding_windows=(None,) * text.num_hidden_layers, linear_attention=linear,
                                   checkpoint_other_parts=OTHER_PARTS, moe=moe, **multimodal)


class SharedExpertMoE(SparseMoE):
    """Qwen3.5-MoE's sparse block: Qwen3-MoE's routed experts, plus a shared expert (an MLP of
    shared_expert_intermediate_size) gated per token by sigmoid(shared_expert_gate(h)), added to
    their sum, as transformers' Qwen3_5MoeSparseMoeBlock."""

    def __init__(self, moe: MoEArgs, hidden_size: int, shared_size: int) -> None:
        super().__init__(moe, hidden_size)
        self.shared_expert = MLP(hidden_size, shared_size)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = norm(x, residual)  # [T, hidden]
        weights, ids = self.route(h)
        out = kernels.fused_moe(h, self.experts.kernel_experts(), weights, ids)
        return kernels.add_sigmoid_gated(out, self.shared_expert_gate(h), self.shared_expert.of_normed(h)), residual


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    model = DecoderForCausalLM(args, ctx)
    if args.moe is not None:
        shared = config.get_text_config().shared_expert_intermediate_size
        for layer, sparse in zip(model.model.layers, args.moe.layers):
            if sparse:
                layer.mlp = SharedExpertMoE(args.moe, args.hidden_size, shared)
    return model, args
