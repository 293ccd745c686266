"""Gemma 3 (model_type gemma3_text, and the language model of a multimodal gemma3 checkpoint,
whose vision tower is left unread) on the shared decoder.

Its differences, each read from the config as transformers' Gemma3 modelling code uses it:
norms that scale by (1 + weight) in float32, four per layer; q/k norms; embeddings times
sqrt(hidden) rounded to the model dtype; a gelu-tanh gated MLP; attention scaled by
query_pre_attn_scalar ** -0.5; sliding-window and global layers (layer_types), each kind with its
own rotary parameters (rope_parameters["sliding_attention"] / ["full_attention"]).
"""

from __future__ import annotations

from typing import Any

from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import (MULTIMODAL_PREFIXES, OTHER_TOWERS, DecoderArgs, DecoderForCausalLM, Rope,
                                        sliding_windows)

MODEL_TYPES = ("gemma3_text", "gemma3")



def args_from_config(config: Any) -> DecoderArgs:
    text = config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("Gemma attention logit softcapping (attn_logit_softcapping) is not "
                                    "supported; Gemma 3 checkpoints leave it unset")
    if getattr(text, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional Gemma 3 text models (use_bidirectional_attention) are "
                                    "encoders, not generators; Hibana serves causal decoders")
    sliding_windows(text)  # refuses layer kinds and windows it cannot run, before their ropes are looked up
    head_dim = text.head_dim
    # only the layer kinds' entries: a flat rope_parameters given to the config stays beside
    # them, and transformers' Gemma 3 reads the per-kind ones alone
    rope_by_kind = {kind: Rope.from_parameters(dict(text.rope_parameters[kind]), head_dim, text)
                    for kind in set(text.layer_types)}
    return DecoderArgs.from_config(
        text,
        model_type=config.model_type,
        head_dim=head_dim,
        ropes=tuple(rope_by_kind[kind] for kind in text.layer_types),
        mlp_bias=False,
        qk_norm=True,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        attention_scale=text.query_pre_attn_scalar ** -0.5,
        activation=text.hidden_activation,
        unit_offset_norms=True,
        sandwich_norms=True,
        embed_scale=text.hidden_size ** 0.5,
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        checkpoint_prefixes=() if text is config else MULTIMODAL_PREFIXES,
        checkpoint_other_parts=() if text is config else OTHER_TOWERS,
    )


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
