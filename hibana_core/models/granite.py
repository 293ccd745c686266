"""Granite (model_type granite: IBM Granite 3.x dense models, e.g. granite-3.1-8b-instruct) on the
shared decoder: Llama's layers with four multipliers, each read from the config as transformers'
Granite modelling code uses it:

    embedding_multiplier   the embeddings times it (a Python float: not rounded to the dtype first)
    attention_multiplier   the attention scale, in place of head_dim ** -0.5
    residual_multiplier    each block's output (attention, MLP) times it before its residual add
    logits_scaling         the logits divided by it

All four are plain tensor arithmetic or the attention kernels' scale argument, so the CUDA path
(Triton kernels, CUDA graphs) takes them as the CPU path does. Full attention on every layer:
transformers' Granite reads no sliding_window.
"""

from __future__ import annotations

import math
from typing import Any

from hibana_core.errors import CheckpointError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM

MODEL_TYPES = ("granite",)


def _multiplier(config: Any, name: str) -> float:
    value = getattr(config, name, 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (name == "logits_scaling" and value == 0):
        raise CheckpointError(f"config.json's {name} is {value!r}; Granite needs a finite number there"
                              f"{' other than 0 (the logits are divided by it)' if name == 'logits_scaling' else ''} "
                              "(the model card's config.json gives it)")
    return float(value)


def args_from_config(config: Any) -> DecoderArgs:
    return DecoderArgs.from_config(
        config,
        sliding_windows=(None,) * config.num_hidden_layers,
        attention_scale=_multiplier(config, "attention_multiplier"),
        embed_scale=_multiplier(config, "embedding_multiplier"),
        embed_scale_in_dtype=False,
        residual_multiplier=_multiplier(config, "residual_multiplier"),
        logits_scaling=_multiplier(config, "logits_scaling"),
    )


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
