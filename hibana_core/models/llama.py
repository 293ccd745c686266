"""Llama family (serves model_type llama, qwen2, qwen3, mistral, ministral, ministral3, and the language
model of a multimodal mistral3 checkpoint: Mistral Small 3.1 / 3.2, Magistral Small 2509, Ministral 3,
whose vision tower is left unread) on the shared decoder.

Ministral 3 scales its queries by position past its rope's original_max_position_embeddings
(llama_4_scaling_beta); Hibana serves it below that (16,384 positions), where the scale is 1.

What tells these apart is read from the config where the config says it (the MLP's
activation too: hidden_act, as transformers' ACT2FN reads it); Qwen2's q/k/v bias and Qwen3's q/k
norm are fixed by their architecture, not written in their configs.
"""

from __future__ import annotations

from typing import Any

from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import (MULTIMODAL_PREFIXES, OTHER_TOWERS, DecoderArgs, DecoderForCausalLM,
                                        sliding_windows)

TEXT_TYPES = ("llama", "qwen2", "qwen3", "mistral", "ministral", "ministral3", "seed_oss")
MULTIMODAL_TEXT_TYPES = {"qwen3_vl_text": "qwen3"}
"""A multimodal checkpoint's own name for its language model -> the text family it is: Qwen3-VL's is
Qwen3's (its multimodal rope rotates a text-only prompt's tokens as Qwen3's rope does: the three
position rows are one)."""
MODEL_TYPES = (*TEXT_TYPES, "mistral3", "qwen3_vl")  # multimodal checkpoints whose text_config is one of these

# model_type -> (q/k/v bias, o bias) where the architecture fixes them; else config.attention_bias
_FIXED_BIASES = {"qwen2": (True, False), "mistral": (False, False), "ministral": (False, False),
                 "ministral3": (False, False)}

# transformers' Llama alone reads config.mlp_bias; Qwen2, Qwen3 and Mistral MLPs have no bias whatever
# a config.json says (their checkpoints hold none)
_MLP_BIAS_FROM_CONFIG = ("llama", "seed_oss")

# model_type -> the config field that switches its o_proj's bias apart from q/k/v's (Seed-OSS's)
_O_BIAS_FROM = {"seed_oss": "attention_out_bias"}

# transformers' Llama attends to the whole history: a sliding_window (or layer_types) that a
# llama config.json carries from elsewhere is not read there, so not here either
_FULL_ATTENTION_ONLY = ("llama", "seed_oss")

# transformers' Mistral windows every layer whenever sliding_window is set (use_sliding_window is
# no field of its config); a mistral config.json with layer_types is read as a Ministral (model_type
# ministral), whose layers window by layer_types (its config derives them from sliding_window).
# Ministral 3 reads neither: its mask windows every layer whenever sliding_window is set, whatever
# layer_types a config.json carries
_WINDOWING_READS = {"mistral": ("layer_types",), "ministral3": ()}


def args_from_config(config: Any) -> DecoderArgs:
    text = config.get_text_config()  # the config itself, but for a multimodal checkpoint's
    kind = MULTIMODAL_TEXT_TYPES.get(text.model_type, text.model_type) if text is not config else text.model_type
    if text is not config and kind not in TEXT_TYPES:  # (a plugin may build its own model_type as one of these)
        raise UnsupportedModelError(f"a {config.model_type} checkpoint whose language model is {text.model_type!r} "
                                    f"is not supported (its text_config must be one of "
                                    f"{', '.join((*TEXT_TYPES, *MULTIMODAL_TEXT_TYPES))})")
    attention_bias = bool(getattr(text, "attention_bias", False))
    qkv_bias, o_bias = _FIXED_BIASES.get(kind, (attention_bias, attention_bias))
    if kind in _O_BIAS_FROM:
        o_bias = bool(getattr(text, _O_BIAS_FROM[kind], False))
    windows = {"sliding_windows": (None,) * text.num_hidden_layers} if kind in _FULL_ATTENTION_ONLY else {}
    if kind in _WINDOWING_READS:
        windows = {"sliding_windows": sliding_windows(text, reads=_WINDOWING_READS[kind])}
    mlp_bias = bool(getattr(text, "mlp_bias", False)) and kind in _MLP_BIAS_FROM_CONFIG
    # a multimodal checkpoint: its language model's weights under their prefixes, the other towers left
    # unread, the model_type its own (chat formats and state fingerprints go by it)
    multimodal = {} if text is config else dict(model_type=config.model_type, checkpoint_prefixes=MULTIMODAL_PREFIXES,
                                                checkpoint_other_parts=OTHER_TOWERS,
                                                tie_word_embeddings=_tied(config, text))
    return DecoderArgs.from_config(text, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                                   qk_norm=kind == "qwen3", **_query_scaling(text), **windows, **multimodal)


# multimodal model_types whose head transformers ties by the top-level config's flag alone (Qwen3-VL's
# text config may carry one of its own, which it does not read)
_TIED_AT_TOP = ("qwen3_vl",)


def _tied(config: Any, text: Any) -> bool:
    """Whether a multimodal checkpoint's output head is its embedding, as transformers reads it: the
    top level's flag for Qwen3-VL, else the text config's where that has one (Mistral 3's top-level
    default says True of checkpoints that store their own head), else the top level's."""
    tied = None if config.model_type in _TIED_AT_TOP else getattr(text, "tie_word_embeddings", None)
    return bool(getattr(config, "tie_word_embeddings", False) if tied is None else tied)


def _query_scaling(config: Any) -> dict[str, Any]:
    """Ministral 3's queries scaled with position (its rope's llama_4_scaling_beta: 1 + beta *
    log(1 + floor(position / original_max_position_embeddings)), as transformers applies it to the
    rotated queries): DecoderArgs' query_scaling_from and query_scaling_beta; none where they are not."""
    params = getattr(config, "rope_parameters", None) or {}
    beta = params.get("llama_4_scaling_beta") if isinstance(params, dict) else None
    if not beta:
        return {}
    start = params.get("original_max_position_embeddings") or config.max_position_embeddings
    return dict(query_scaling_from=int(start), query_scaling_beta=float(beta))


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
