"""SmolLM3 (model_type smollm3: SmolLM3-3B) on the shared decoder: Llama's layers, q/k/v and o
biases where `attention_bias`, MLP biases where `mlp_bias`, and NoPE layers: `no_rope_layers[i]`
0 leaves layer i's queries and keys unrotated (every `no_rope_layer_interval`-th layer by
default, as transformers derives it). The layers its layer_types name sliding_attention attend
within `sliding_window`: transformers derives them (the NoPE ones) where `use_sliding_window`, and
its masks window the layers a config.json's own layer_types name whatever use_sliding_window says.
"""

from __future__ import annotations

from typing import Any

from hibana_core.errors import CheckpointError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM, Rope, rope_parameters, sliding_windows

MODEL_TYPES = ("smollm3",)


def args_from_config(config: Any) -> DecoderArgs:
    layers = config.num_hidden_layers
    uses_rope = list(getattr(config, "no_rope_layers", None) or ())
    if len(uses_rope) != layers:
        raise CheckpointError(f"config.json's no_rope_layers has {len(uses_rope)} entries for {layers} layers; it "
                              "needs one per layer (1: rotary, 0: none)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = Rope.from_parameters(rope_parameters(config), head_dim, config)
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderArgs.from_config(
        config, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
        ropes=tuple(rope if use else Rope.none(head_dim) for use in uses_rope),
        sliding_windows=sliding_windows(config, reads=("layer_types",)))


def build(config: Any, ctx: ForwardContext) -> tuple[DecoderForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return DecoderForCausalLM(args, ctx), args
