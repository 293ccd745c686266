"""The decoder every dense family shares, over a paged KV cache: attention through the paged
kernels, rotary tables, norms, the MLP, the layer loop and the checkpoint's tensor names.

A family (llama.py, gemma3.py, phi3.py) only reads its Hugging Face config into `DecoderArgs`;
every difference between families is a field there, never a model_type test in this file.
Module and parameter names follow Hugging Face's, so checkpoints load by name. The arithmetic
follows transformers' modelling code step by step (norms in float32, rotary as rotate_half),
which is what lets greedy output match `generate` token for token.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import CheckpointError, UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.models.moe import Experts, MoEArgs, SparseMoE

if TYPE_CHECKING:
    from hibana_core.models.linear_attention import LinearAttentionArgs

SUPPORTED_ROPE_TYPES = ("default", "dynamic", "llama3", "linear", "longrope", "yarn")
NO_ROPE = "none"
"""`Rope.none`'s type: a layer without rotary embeddings (never a config's)."""
KERNEL_GLU = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # a config's hidden_act -> the kernels' glu name
ACTIVATIONS = tuple(KERNEL_GLU)
ACTIVATION_NAMES = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh"}
"""Other names transformers' ACT2FN gives one of ACTIVATIONS: its "swish" is SiLU, and "gelu_new"
and "gelu_fast" are the tanh approximation of GELU written out (the same function as torch's
`gelu(approximate="tanh")`, within float rounding)."""


def activation_of(config: Any) -> str:
    """The config's hidden_act as one of ACTIVATIONS names it (unknown names as they are)."""
    act = getattr(config, "hidden_act", None) or "silu"
    return ACTIVATION_NAMES.get(act, act)


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: what its cos/sin tables are computed from."""

    theta: float
    dim: int  # dims of each head it rotates: head_dim, or the first part of it (partial rotary)
    scaling: tuple[tuple[str, Any], ...]  # rope type and its parameters, sorted items (lists as tuples)

    @classmethod
    def from_parameters(cls, params: dict[str, Any], head_dim: int, config: Any,
                        partial_rotary: bool = False) -> "Rope":
        """`params`: a transformers 5 rope_parameters dict (one layer type's, where they differ).
        `partial_rotary`: the family's transformers code rotates only the first
        partial_rotary_factor of each head (Phi-3's); the others rotate whole heads, their default
        rope ignoring the factor and their scaled ropes failing on it (refused here)."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        partial = params.get("partial_rotary_factor", 1.0)
        if not partial_rotary and partial != 1.0:
            if rope_type != "default":
                raise UnsupportedModelError(
                    f"partial_rotary_factor {partial} with rope type {rope_type!r} is not supported for model_type "
                    f"{config.model_type!r}: its transformers code rotates whole heads and fails on this config; "
                    "remove partial_rotary_factor from config.json")
            partial = 1.0
        scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k != "rope_theta"}
        if rope_type == "longrope":
            scaling.update(_longrope_settings(params, config))
        if rope_type == "yarn":
            scaling.update(_yarn_settings(params, config))
        theta = params.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise CheckpointError(f"config.json's rope_theta is {theta!r}; rotary embeddings need a positive base "
                                  "(the model card gives it, e.g. 10000.0)")
        return cls(theta=float(theta),
                   dim=int(head_dim * partial),
                   scaling=tuple(sorted(scaling.items())))

    @classmethod
    def none(cls, head_dim: int) -> "Rope":
        """No rotation (a NoPE layer's: SmolLM3's): cos 1 and sin 0 at every position, which the
        rotary kernels apply as the identity, exactly."""
        return cls(theta=1.0, dim=head_dim, scaling=(("rope_type", NO_ROPE),))

    @property
    def rope_type(self) -> str:
        scaling = dict(self.scaling)
        return scaling.get("rope_type", scaling.get("type", "default"))

    def inv_freq(self, ext_factors: tuple[float, ...] | None = None) -> torch.Tensor:
        """Inverse frequencies as transformers computes them (float32), with llama3 / linear /
        YaRN scaling, or divided by LongRoPE's `ext_factors`."""
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        if ext_factors is not None:
            return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * self.theta ** exponents)
        inv_freq = 1.0 / (self.theta ** exponents)
        scaling = dict(self.scaling)
        if self.rope_type == "linear":
            return inv_freq / scaling["factor"]
        if self.rope_type == "llama3":
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
            return torch.where(is_medium, smoothed, scaled)
        if self.rope_type == "yarn":
            return _yarn_inv_freq(self.theta ** exponents, self.dim, self.theta, scaling)
        # dynamic NTK: transformers rescales only past max_position_embeddings, which no state reaches
        return inv_freq

    def angles(self, max_positions: int) -> torch.Tensor:
        """position * inv_freq, [max_positions, dim // 2] float32.

        LongRoPE: [max_positions + original, dim // 2] (original: its
        original_max_position_embeddings). The first max_positions rows rotate per position:
        short factors below original, long ones from there on; the last `original` rows are the
        long rotation of positions below original. A state under the long rotation reads those
        instead of the short rows (`hibana_core.kv.sequence.LongRope`, which says how this
        follows transformers)."""
        positions = torch.arange(max_positions, dtype=torch.float32)
        if self.rope_type == NO_ROPE:
            return torch.zeros(max_positions, self.dim // 2)
        if self.rope_type != "longrope":
            return torch.outer(positions, self.inv_freq())
        scaling = dict(self.scaling)
        split = scaling["original_max_position_embeddings"]
        long = torch.outer(positions, self.inv_freq(scaling["long_factor"]))
        return torch.cat((torch.outer(positions[:split], self.inv_freq(scaling["short_factor"])), long[split:],
                          long[:split]))

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (LongRoPE's and YaRN's attention scaling; 1 otherwise:
        transformers ignores an attention_factor in the other types' parameters)."""
        if self.rope_type not in ("longrope", "yarn"):
            return 1.0
        return float(dict(self.scaling)["attention_factor"])


def kv_layers(args: Any) -> int:
    """The layers with KV pages of a family's args: `DecoderArgs.num_kv_layers` (a hybrid
    model's attention layers), else every layer (a plugin family's args have num_layers only)."""
    return getattr(args, "num_kv_layers", args.num_layers)


def longrope_switch(args: Any) -> int | None:
    """original_max_position_embeddings of the model's LongRoPE (one per model: Phi-3's), where a
    layer's rope is LongRoPE; its cos/sin tables then hold the long rotation of the positions
    below it from row `RotaryTables.max_positions` on (`Rope.angles`; `rotary_positions` once the
    engine has sized them)."""
    for rope in dict.fromkeys(getattr(args, "ropes", ())):
        if rope.rope_type == "longrope":
            return dict(rope.scaling)["original_max_position_embeddings"]
    return None


def _longrope_settings(params: dict[str, Any], config: Any) -> dict[str, Any]:
    """LongRoPE's split point and attention factor, defaulted as transformers does."""
    original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"original_max_position_embeddings": int(original), "attention_factor": float(attention_factor)}


def _yarn_settings(params: dict[str, Any], config: Any) -> dict[str, Any]:
    """YaRN's parameters, defaulted as transformers' _compute_yarn_parameters does: the factor
    from the context lengths, the attention factor from the factor (or DeepSeek's mscale pair),
    beta_fast 32, beta_slow 1, truncation on (read from the config's own rope_parameters)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    truncate = (getattr(config, "rope_parameters", None) or params).get("truncate", True)
    return {"factor": factor, "attention_factor": float(attention_factor), "truncate": bool(truncate),
            "beta_fast": params.get("beta_fast") or 32, "beta_slow": params.get("beta_slow") or 1,
            "original_max_position_embeddings": original}


def _yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's blend of extrapolated (unscaled) and interpolated (divided by factor) inverse
    frequencies, ramped linearly between the dims that rotate beta_fast and beta_slow times over
    the original context; transformers' arithmetic step by step. `pos_freqs`: theta ** (2i / dim)."""
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return (1.0 / (scaling["factor"] * pos_freqs) * (1 - extrapolation_factor)
            + 1.0 / pos_freqs * extrapolation_factor)


def rope_parameters(config: Any) -> dict[str, Any]:
    """transformers 5 names it rope_parameters; 4.x split it into rope_theta and rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))  # Phi-4-mini: 0.75
    return params


def sliding_windows(config: Any, reads: Collection[str] = ("layer_types", "use_sliding_window")
                    ) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention): by layer_types where the config has them
    (Qwen2 and Qwen3 derive theirs from max_window_layers), else sliding_window on every layer
    unless use_sliding_window is off. Qwen3-MoE has no layer_types, and transformers windows all
    its layers when use_sliding_window is on, whatever max_window_layers says. `reads`: which of
    the two the family's transformers code follows (Phi-3's neither, Mistral's layer_types alone,
    Qwen3-MoE's use_sliding_window alone); one it does not read changes nothing where a
    config.json carries it."""
    window, num_layers = getattr(config, "sliding_window", None), config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) if "layer_types" in reads else None
    if layer_types:
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer_types {unknown} are not supported; Hibana runs 'full_attention' "
                                        "and 'sliding_attention' layers")
        if "sliding_attention" in layer_types:
            if window is None and "use_sliding_window" in reads \
                    and getattr(config, "use_sliding_window", None) is False:
                # (Qwen2 / Qwen3 configs drop sliding_window when use_sliding_window is off; a family
                # whose masks do not read use_sliding_window, SmolLM3's, meets the check below)
                raise CheckpointError("config.json's layer_types name sliding_attention layers while "
                                      "use_sliding_window is false, which leaves them no sliding_window "
                                      "(transformers' generate fails on it): set use_sliding_window to true, "
                                      "or make those layers full_attention")
            _check_window(window)
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if window is None or ("use_sliding_window" in reads and not getattr(config, "use_sliding_window", True)):
        return (None,) * num_layers
    _check_window(window)
    return (window,) * num_layers


def _check_window(window: Any) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise CheckpointError(f"config.json's sliding_window is {window!r}; sliding-window layers need a positive "
                              "number of tokens (the config is corrupt)")


# where a multimodal checkpoint (Gemma 3's, Mistral 3's) keeps its language model: transformers 5's names,
# then 4.x's; and the parts a text decoder leaves out of it on purpose
MULTIMODAL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."))
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                "model.visual.", "visual.")  # (Qwen3-VL's vision tower and its deepstack mergers: model.visual.*)


@dataclass(frozen=True)
class DecoderArgs:
    """The shapes and switches of one checkpoint, read from its Hugging Face config by its family."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    ropes: tuple[Rope, ...]  # per layer
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    attention_scale: float  # multiplies q.k: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5
    activation: str = "silu"  # of the gated MLP: one of ACTIVATIONS
    unit_offset_norms: bool = False  # norms scale by (1 + weight), in float32 (Gemma)
    cast_last_norms: bool = False  # norms scale by the weight in float32, then round (gpt-oss)
    sandwich_norms: bool = False  # norms after attention and MLP too, four per layer (Gemma)
    pre_norms: bool = True  # False: no norm before attention and MLP, only the sandwich's after (EXAONE 4)
    qk_norm_whole: bool = False  # the q/k norms over the whole projection, all heads at once (OLMo 2 / 3)
    embed_scale: float | None = None  # embeddings times this, rounded to the model dtype (Gemma)
    embed_scale_in_dtype: bool = True  # False: embed_scale multiplies as a Python float, unrounded
    # (Granite's embedding_multiplier)
    residual_multiplier: float = 1.0  # each block's output times this before its residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    fused_in_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj as we do (Phi-3)
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()  # (checkpoint name prefix, ours), e.g. a
    # multimodal checkpoint's language model
    checkpoint_other_parts: tuple[str, ...] = ()  # name prefixes of a checkpoint's parts this model
    # leaves out on purpose (a multimodal checkpoint's other towers): not reported as unused
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (a checkpoint name's dotted part, ours),
    # e.g. Mixtral's block_sparse_moe -> mlp and its experts' w1 / w3 / w2 -> gate_proj / up_proj / down_proj
    moe: MoEArgs | None = None  # sparse blocks in place of the MLP, in the layers it names
    attention_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    longrope_recompute: bool = False  # generate recomputes the whole cache once the sequence crosses
    # LongRoPE's switch (Phi-3's; `hibana_core.kv.sequence.LongRope`)
    query_scaling_from: int | None = None  # transformers scales the rotated queries by
    # 1 + query_scaling_beta * log(1 + floor(position / this)) (Ministral 3's llama_4_scaling_beta and its
    # rope's original_max_position_embeddings); 1 below this position (`Attention._scaled_queries`)
    query_scaling_beta: float = 0.0
    attention_output_gate: bool = False  # q_proj also gives a gate per head: o * sigmoid(gate) before
    # o_proj (Qwen3.5's gated attention; the checkpoint's q_proj interleaves each head's q and gate)
    linear_attention: "LinearAttentionArgs | None" = None  # a hybrid model's linear-attention layers
    # (Qwen3.5's Gated DeltaNet, models/linear_attention.py): no KV pages, a recurrent state each

    @property
    def num_kv_layers(self) -> int:
        """Layers with KV pages (the engine's KV cache): all but a hybrid model's linear ones."""
        linear = self.linear_attention
        return self.num_layers if linear is None else self.num_layers - sum(linear.layers)

    @classmethod
    def from_config(cls, config: Any, **differences: Any) -> "DecoderArgs":
        """What every family reads the same way from a (text) config, then the family's own
        `differences`. Defaults where a config may leave a field out: head_dim from the
        hidden size, as many KV heads as heads, one rope for every layer from the config's rope
        parameters, attention biases from `attention_bias` (q/k/v and o alike), no MLP bias
        unless `mlp_bias`, untied embeddings, head_dim ** -0.5 as the attention scale, the
        config's `hidden_act`. `partial_rotary=True` (not a field): the rope rotates the first
        partial_rotary_factor of each head, as Phi-3's does (`Rope.from_parameters`)."""
        num_heads, num_layers = config.num_attention_heads, config.num_hidden_layers
        head_dim = differences.pop("head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        common = dict(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=False,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_scale=head_dim ** -0.5,
            activation=activation_of(config),
        )
        if "sliding_windows" not in differences:  # (Llama, Mistral, Phi-3, Qwen3-MoE read theirs their own way)
            common["sliding_windows"] = sliding_windows(config)
        partial_rotary = differences.pop("partial_rotary", False)  # (Phi-3's; see Rope.from_parameters)
        if "ropes" not in differences:  # (Gemma gives one per layer kind)
            common["ropes"] = (Rope.from_parameters(rope_parameters(config), head_dim, config, partial_rotary),) * num_layers
        return cls(**{**common, **differences})

    def __post_init__(self) -> None:
        positions = self.max_position_embeddings
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise CheckpointError(f"config.json's max_position_embeddings is {positions!r}; a model holds at "
                                  "least one position: give the context length it was trained for")
        if self.num_heads % self.num_kv_heads:  # GQA: each KV head serves as many query heads
            raise CheckpointError(f"config.json's num_attention_heads {self.num_heads} is not a multiple of its "
                                  f"num_key_value_heads {self.num_kv_heads}; attention cannot share the KV heads "
                                  "among the query heads (transformers fails on it too): the config is corrupt")
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(f"MLP activation {self.activation!r} is not supported; "
                                        f"supported: {', '.join(ACTIVATIONS)}")
        per_layer = (self.ropes, self.sliding_windows) + ((self.moe.layers,) if self.moe else ()) \
            + ((self.linear_attention.layers,) if self.linear_attention else ())
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("a decoder without norms before its attention and MLP has them after (sandwich_norms)")
        if any(len(values) != self.num_layers for values in per_layer):
            raise ValueError(f"ropes, sliding_windows, moe.layers and linear_attention.layers need one entry per "
                             f"layer ({self.num_layers})")


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the fused kernels (`rms_norm_linear`, the attention prologue, the router's
    fold) take its weight."""

    fusable = True  # every fold takes it (`moe_norm_route` only Llama's)
    gemv_fold = True  # `rms_norm_linear` can fold it
    unit_offset = False  # Gemma's (1 + weight): UnitOffsetRMSNorm
    cast_last = False  # gpt-oss's product in float32: CastLastRMSNorm

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual) in one pass."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps, self.unit_offset, self.cast_last)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset, self.cast_last)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight) all in float32, then cast to
    x's dtype (Llama's casts before the product). `rms_norm_linear` and the attention prologue
    take both arithmetics, the router's fold only Llama's."""

    fusable = False
    unit_offset = True


class CastLastRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight in float32, then cast to x's dtype
    (Llama's casts before the product; in bf16 the two round differently). Neither
    `rms_norm_linear`, the router's fold nor the attention prologue takes it."""

    fusable = False
    gemv_fold = False
    cast_last = True
    float32_parameters_under_float16 = ("weight",)  # transformers' gpt-oss keeps its norms in float32
    # under float16 (`_keep_in_fp32_modules`; under bfloat16 they take the model's dtype)


class NoNorm(nn.Module):
    """Where a post-norm layer (EXAONE 4's) has no norm before its attention or its MLP: the
    stream as it is; with a residual, (x + residual, x + residual), as the norms' fused add gives."""

    fusable = False
    gemv_fold = False
    unit_offset = False
    cast_last = False
    weight = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return x
        x = x + residual
        return x, x


def make_norm(args: DecoderArgs, dim: int) -> RMSNorm:
    if args.unit_offset_norms:
        return UnitOffsetRMSNorm(dim, args.rms_norm_eps)
    return (CastLastRMSNorm if args.cast_last_norms else RMSNorm)(dim, args.rms_norm_eps)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed by `kernels.linear`, or,
    once surgery or a quantized checkpoint packed its weight (`set_packed`), by the kernel of
    that weight's kind:

        kind "int8": buffers qweight [N, K] int8, scales [N]
        kind "int4": buffers qweight [N, K // 2] uint8, scales and zeros [N, K // group_size]
        kind "fp8":  buffers qweight [N, K] float8_e4m3fn, scales [ceil(N / bn), ceil(K / bk)]
                     float32, with `block` = (bn, bk)
        (layouts: `hibana_kernels.quant`); `perm`, when set, reorders the input features first
        (GPTQ checkpoints quantized in activation order)
    """

    kind = "dense"
    group_size = 0
    block: tuple[int, int] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("perm", None)

    def set_packed(self, kind: str, tensors: dict[str, torch.Tensor], group_size: int = 0,
                   perm: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> None:
        """Replace the dense weight by a packed one (the bias stays)."""
        if kind not in ("int8", "int4", "fp8"):
            raise ValueError(f"unknown packed weight kind {kind!r}")
        if (kind == "fp8") != (block is not None):
            raise ValueError(f"a packed weight has a scale block exactly when it is fp8 ({kind}, block {block})")
        self.register_parameter("weight", None)
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.kind, self.group_size = kind, group_size
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.perm = perm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dense":
            return kernels.linear(x, self.weight, self.bias)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.kind == "int8":
            return kernels.linear_int8(x, self.qweight, self.scales, self.bias)
        if self.kind == "fp8":
            return kernels.linear_fp8(x, self.qweight, self.scales, self.block, self.bias)
        return kernels.linear_int4(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)

    def after_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                   glu: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual); without a residual (self(norm(x)), x).
        A dense weight after a norm `rms_norm_linear` takes (Llama's, Gemma's) goes there, one
        launch where the GEMV folds the norm in. `glu` (a dense fused gate/up weight): act(gate)
        * up of the projection (`kernels.linear`'s glu)."""
        if glu is not None and self.kind != "dense":
            raise ValueError(f"a {self.kind} weight has no GLU epilogue: apply the activation after it")
        if self.kind == "dense" and norm.gemv_fold:
            return kernels.rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias, glu,
                                           norm.unit_offset)
        # the norm's launch writes x's int8 codes for the GEMV (a norm weight of x's dtype: the
        # norm's output dtype is then x's, which the GEMV's output keeps)
        if norm.weight is not None and norm.weight.dtype == x.dtype and self.folds_a8(x, x.shape[-1]):
            _, residual, q, d = kernels.rms_norm_a8(x, residual, norm.weight, norm.eps, norm.unit_offset,
                                                    kernels.a8_order(self.kind), norm.cast_last)
            return self.from_codes(q, d, x), residual
        normed, residual = (norm(x), x) if residual is None else norm(x, residual)
        return (self(normed) if glu is None else kernels.linear(normed, self.weight, self.bias, glu)), residual

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) of a fused gate/up output; one launch where a dense weight's GEMV
        folds the activation in (`kernels.silu_and_mul_linear`), or where the activation's launch
        writes int8 codes for a packed weight's x int8 GEMV (`kernels.folds_a8`)."""
        if self.kind == "dense":
            return kernels.silu_and_mul_linear(gate_up, self.weight, self.bias)
        if self.folds_a8(gate_up, gate_up.shape[-1] // 2):
            _, q, d = kernels.silu_and_mul_a8(gate_up, kernels.a8_order(self.kind))
            return self.from_codes(q, d, gate_up)
        return self(kernels.silu_and_mul(gate_up))

    def folds_a8(self, source: torch.Tensor, k: int) -> bool:
        """Whether this int8 / int4 layer takes its k-wide input, made from `source`'s rows, as int8
        codes from the kernel that makes it (not with a column permutation: GPTQ's act order)."""
        return (self.kind in ("int8", "int4") and self.perm is None
                and kernels.folds_a8(source, k, self.group_size if self.kind == "int4" else 1))

    def from_codes(self, q: torch.Tensor, d: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        int4 = self.kind == "int4"
        return kernels.linear_a8(q, d, source.shape[:-1], source.dtype, self.qweight, self.scales,
                                 self.zeros if int4 else None, self.group_size if int4 else 1, self.bias)

    def extra_repr(self) -> str:
        packed = "" if self.kind == "dense" else f", {self.kind}" + (f" g{self.group_size}" if self.group_size else "") \
            + (f" block {self.block[0]}x{self.block[1]}" if self.block else "")
        return super().extra_repr() + packed


class RotaryTables:
    """cos/sin tables of one `Rope` indexed by position, [max_positions, rope.dim], always
    float32, which the rotary kernels read. Built on first use on the device of the positions
    (the model is constructed on "meta"), shared by the layers of that rope. max_positions is the
    config's max_position_embeddings until the engine sizes them to the positions it addresses
    (`size_rotary`).

    In a model with LongRoPE on some layers (`longrope_switch`), every table has the long
    rotation's rows past max_positions (`Rope.angles`), which a state under the long rotation
    reads on every layer: the other ropes' are their own rows of those positions again."""

    def __init__(self, rope: Rope, max_positions: int, longrope_switch: int | None = None) -> None:
        self.rope, self.max_positions, self.longrope_switch = rope, max_positions, longrope_switch
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """What cos and sin take once built, known before they are (the memory budget counts them
        in the workspace: a 128k-context model's are hundreds of MB)."""
        rows = self.max_positions  # and the long rotation's rows below the switch (`_build`)
        if self.rope.rope_type == "longrope":
            rows += min(dict(self.rope.scaling)["original_max_position_embeddings"], self.max_positions)
        elif self.longrope_switch is not None:
            rows += min(self.longrope_switch, self.max_positions)
        return 2 * rows * 2 * (self.rope.dim // 2) * 4

    def _build(self, device: torch.device) -> None:
        freqs = self.rope.angles(self.max_positions)
        if self.longrope_switch is not None and self.rope.rope_type != "longrope":
            freqs = torch.cat((freqs, freqs[:self.longrope_switch]))
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = self.rope.attention_factor
        self.cos, self.sin = (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.device != device:
            self._build(device)
        return self.cos, self.sin


MIN_ROTARY_POSITIONS = 4096
"""Positions the engine's rotary tables hold at least (all of a shorter model's): what it computes
besides its states stays within them (layer_skip scores the target's layers on the surgery
guard's documents, up to 1,088 positions); 4,096 rows take 4 MiB a rope at head_dim 128."""


def rotary_positions(max_model_len: int, args: Any) -> int:
    """The positions an engine's rotary tables hold (`size_rotary`): its max_model_len (past
    max_position_embeddings under a YaRN rope), at least MIN_ROTARY_POSITIONS of the config's;
    a LongRoPE model's long rows start there (`LongRope.offset`)."""
    return max(max_model_len, min(args.max_position_embeddings, MIN_ROTARY_POSITIONS))


def size_rotary(model: nn.Module, positions: int) -> None:
    """Size the rotary tables of `model`'s layers to `positions` positions (`rotary_positions`),
    not the config's max_position_embeddings, whose tables would take ~1 GB at a 1M-token context
    however short the engine's. Tables of another size are built anew on first use (the surgery
    guard may have built them at the config's)."""
    for module in model.modules():
        rotary = getattr(module, "rotary", None)
        if isinstance(rotary, RotaryTables) and rotary.max_positions != positions:
            rotary.max_positions, rotary.cos, rotary.sin = positions, None, None


def rotary_bytes(model: nn.Module) -> int:
    """What the rotary tables of `model`'s layers take once built (each table once)."""
    tables = {id(m.rotary): m.rotary for m in model.modules() if isinstance(getattr(m, "rotary", None), RotaryTables)}
    return sum(t.nbytes for t in tables.values())


class Attention(nn.Module):
    """Self-attention with a fused q/k/v projection (a checkpoint's three are loaded into it).
    After kv8 (`set_kv_scales`) its keys and values are stored in fp8 with the per-head scales
    of buffer `kv_scale` [2 (k, v), H_kv] float32 (None: stored in the compute dtype)."""

    def __init__(self, args: DecoderArgs, layer_idx: int, ctx: ForwardContext,
                 rotary: RotaryTables, kv_index: int | None = None) -> None:
        super().__init__()
        # its KV's layer in the cache: the model layer's index, or a hybrid model's count of attention layers before it
        self.layer_idx = layer_idx if kv_index is None else kv_index
        self.ctx, self.rotary = ctx, rotary
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.attention_scale
        self.sliding_window = args.sliding_windows[layer_idx]
        self.sink_tokens = 0  # under the window, first tokens every query still sees (the window surgery pass)
        self.surgery_window: tuple[int, int] | None = None  # (window, sink_tokens) the window pass set
        h, d = args.hidden_size, args.head_dim
        self.output_gate = args.attention_output_gate  # q_proj's rows: each head's q, then its gate
        self.split = (args.num_heads * d * (2 if self.output_gate else 1), args.num_kv_heads * d, args.num_kv_heads * d)
        self.qkv_proj = Linear(h, sum(self.split), bias=args.qkv_bias)
        self.qkv_proj.fused_sizes = self.split
        self.o_proj = Linear(args.num_heads * d, h, bias=args.o_bias)
        # q/k norms over each head (Qwen3's, Gemma's), or over the whole projection (OLMo 2 / 3's)
        self.qk_norm_whole = args.qk_norm_whole
        self.q_norm = make_norm(args, self.split[0] if args.qk_norm_whole else d) if args.qk_norm else None
        self.k_norm = make_norm(args, self.split[1] if args.qk_norm_whole else d) if args.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(args.num_heads)) if args.attention_sinks else None
        self.query_scaling = (args.query_scaling_from, args.query_scaling_beta) if args.query_scaling_from else None
        self.register_buffer("kv_scale", None)

    def set_kv_scales(self, kv_scale: torch.Tensor) -> None:
        """Store this layer's keys and values in fp8 with these scales ([2, H_kv] float32)."""
        if tuple(kv_scale.shape) != (2, self.num_kv_heads):
            raise ValueError(f"kv_scale has shape {tuple(kv_scale.shape)}, this layer wants (2, {self.num_kv_heads})")
        self.kv_scale = kv_scale.to(torch.float32).contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over norm(x + residual); returns (its output, x + residual)."""
        tokens = x.shape[0]
        qkv, residual = self.qkv_proj.after_norm(norm, x, residual)
        q, k, v = qkv.split(self.split, dim=-1)
        gate = None
        if self.output_gate:  # [T, H, 2D]: each head's q, then its gate (strided views: the kernels take them)
            q, gate = q.view(tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        if self.qk_norm_whole:  # [T, H * D] and [T, H_kv * D] normed whole, before the heads part
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(tokens, self.num_heads, self.head_dim)      # [T, H, D]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)   # [T, H_kv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        batch = self.ctx.batch
        k_cache, v_cache, group = self.ctx.kv_cache.layer(self.layer_idx)
        args = (q, k_cache, v_cache, batch.block_tables[group], batch.seq_lens, batch.query_start_loc,
                batch.max_query_len, batch.max_seq_len, self.scale, self.sliding_window, batch.uniform_query_len,
                self.kv_scale, self.sinks, self.sink_tokens)
        prologue = self._prologue(positions, k, v, batch.slot_mapping[group])
        if self._scales_queries():  # the prologue first, then the rotated queries scaled (transformers' order)
            rotated = kernels.attention_prologue(q, k_cache, v_cache, prologue, self.kv_scale)
            args = (self._scaled_queries(positions, rotated), *args[1:])
            prologue = None
        width = self.num_heads * self.head_dim
        if gate is not None:  # transformers' o * sigmoid(gate), in the activations' dtype, before o_proj
            o = kernels.paged_attention(*args, prologue=prologue)
            return self.o_proj(kernels.sigmoid_gate(o.view(tokens, self.num_heads, self.head_dim), gate)
                               .view(tokens, width)), residual
        if self.o_proj.folds_a8(x, width):  # its input as codes (from split decode's merge, else one launch)
            o, codes, d = kernels.paged_attention_a8(*args, kernels.a8_order(self.o_proj.kind), prologue=prologue)
            return self.o_proj.from_codes(codes, d, o.view(tokens, width)), residual
        o = kernels.paged_attention(*args, prologue=prologue)
        return self.o_proj(o.reshape(tokens, width)), residual

    def _scales_queries(self) -> bool:
        """Whether queries past `query_scaling_from` can come: the positions the rotary tables hold
        (the engine's max_model_len, `size_rotary`) reach it."""
        return self.query_scaling is not None and self.rotary.max_positions > self.query_scaling[0]

    def _scaled_queries(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Rotated q [T, H, D] times Ministral 3's 1 + beta * log(1 + floor(position / start)), computed
        in float32 and rounded to q's dtype as transformers' get_llama_4_attn_scale."""
        start, beta = self.query_scaling
        scale = 1 + beta * torch.log(1 + torch.floor(positions / start))
        return q * scale.to(q.dtype)[:, None, None]

    def _prologue(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> kernels.AttentionPrologue:
        """What runs before the attention: q/k norms (Llama's or Gemma's), rotary (on the first
        rope.dim dims of each head: the tables' width), k and v into the cache. One launch on the
        GPU (`kernels.qk_norm_rotary_store`), or none: folded into decode attention."""
        cos, sin = self.rotary.tables(positions.device)
        q_norm, k_norm = (None, None) if self.qk_norm_whole else (self.q_norm, self.k_norm)
        assert q_norm is None or not q_norm.cast_last, "the attention prologue takes Llama's and Gemma's q/k norms"
        norms = {} if q_norm is None else dict(q_weight=q_norm.weight, k_weight=k_norm.weight,
                                               eps=q_norm.eps, unit_offset=q_norm.unit_offset)
        return kernels.AttentionPrologue(positions, k, v, cos, sin, slot_mapping, **norms)


class MLP(nn.Module):
    """Gated MLP (SwiGLU, or GeGLU with tanh-approximated gelu) with a fused gate/up projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        h, i = hidden_size, intermediate_size
        self.activation = activation
        self.gate_up_proj = Linear(h, 2 * i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def of_normed(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP of h, already normed (GLM-4.5's shared experts, beside the routed ones)."""
        gate_up = self.gate_up_proj(h)
        if self.activation == "silu":
            return self.down_proj.after_silu_and_mul(gate_up)
        return self.down_proj(kernels.gelu_tanh_and_mul(gate_up))

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of norm(x + residual); returns (its output, x + residual). The activation runs
        in the gate/up GEMV's epilogue where `kernels.folds_glu` says, else after it (silu
        folded into the down GEMV where the fusion policy takes its width)."""
        gate_up_proj, glu = self.gate_up_proj, KERNEL_GLU[self.activation]
        if gate_up_proj.kind == "dense" and kernels.folds_glu(x, gate_up_proj.weight, glu):
            act, residual = gate_up_proj.after_norm(norm, x, residual, glu)
            return self.down_proj(act), residual
        gate_up, residual = gate_up_proj.after_norm(norm, x, residual)
        if self.activation == "silu":
            return self.down_proj.after_silu_and_mul(gate_up), residual
        return self.down_proj(kernels.gelu_tanh_and_mul(gate_up)), residual


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int, ctx: ForwardContext,
                 rotary: RotaryTables) -> None:
        super().__init__()
        linear = args.linear_attention
        self.linear = linear is not None and linear.layers[layer_idx]
        if self.linear:  # (a hybrid model's: the state's index among the linear layers)
            from hibana_core.models.linear_attention import GatedDeltaNet, InterleavedGatedDeltaNet

            kind = InterleavedGatedDeltaNet if linear.interleaved else GatedDeltaNet
            self.linear_attn = kind(args, linear, sum(linear.layers[:layer_idx]), ctx)
        else:
            kv_index = None if linear is None else layer_idx - sum(linear.layers[:layer_idx])
            self.self_attn = Attention(args, layer_idx, ctx, rotary, kv_index)
        sparse = args.moe is not None and args.moe.layers[layer_idx]
        self.mlp = (SparseMoE(args.moe, args.hidden_size) if sparse
                    else MLP(args.hidden_size, args.intermediate_size, args.activation, args.mlp_bias))
        self.input_layernorm = make_norm(args, args.hidden_size) if args.pre_norms else NoNorm()
        self.post_attention_layernorm = make_norm(args, args.hidden_size)
        self.sandwich = args.sandwich_norms
        self.residual_multiplier = args.residual_multiplier
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(args, args.hidden_size) if args.pre_norms else NoNorm()
            self.post_feedforward_layernorm = make_norm(args, args.hidden_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        """The residual stream is carried beside x (the stream is x + residual), so each add
        fuses with the norm after it, and both with the projection after that where the kernels
        can (`Linear.after_norm`): a batch-1 decode layer on the GPU can be six launches (norm +
        qkv, prologue, attention, o, norm + gate_up, silu + down). With sandwich norms
        post_attention_layernorm normalises the attention's output and pre_feedforward_layernorm
        comes before the MLP; without, post_attention_layernorm is the one before the MLP. A
        residual_multiplier (Granite's) scales each block's output before it joins the stream."""
        mixer = self.linear_attn if self.linear else self.self_attn
        x, residual = mixer(positions, x, residual, self.input_layernorm)
        if not self.sandwich:
            x, residual = self.mlp(self._scaled(x), residual, self.post_attention_layernorm)
            return self._scaled(x), residual
        x, residual = self.mlp(self._scaled(self.post_attention_layernorm(x)), residual,
                               self.pre_feedforward_layernorm)
        return self._scaled(self.post_feedforward_layernorm(x)), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' `residual + x * multiplier`: the product rounded to x's dtype, then added
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (a multiplier that acts as a tensor of the activations' dtype)."""
    return torch.tensor(value, dtype=dtype).item()


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs, ctx: ForwardContext) -> None:
        super().__init__()
        self.embed_scale, self.embed_scale_in_dtype = args.embed_scale, args.embed_scale_in_dtype
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        switch = longrope_switch(args)
        rotaries = {rope: RotaryTables(rope, args.max_position_embeddings, switch) for rope in dict.fromkeys(args.ropes)}
        self.layers = nn.ModuleList(DecoderLayer(args, i, ctx, rotaries[rope]) for i, rope in enumerate(args.ropes))
        self.norm = make_norm(args, args.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        if self.embed_scale is not None:  # Gemma's rounded to x's dtype first, Granite's not
            x = x * (_in_dtype(self.embed_scale, x.dtype) if self.embed_scale_in_dtype else self.embed_scale)
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                "in_proj": ("in_proj_qkv", "in_proj_z"), "in_proj_gates": ("in_proj_b", "in_proj_a")}
"""A fused linear layer -> the checkpoint layers it concatenates along its outputs, in order."""


class DecoderForCausalLM(nn.Module):
    """`forward(input_ids, positions) -> hidden [T, hidden]`; `compute_logits` on chosen rows."""

    def __init__(self, args: DecoderArgs, ctx: ForwardContext) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args, ctx)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tied_weight_names = ("lm_head.weight",) if args.tie_word_embeddings else ()
        self.fused_layers = {} if args.fused_in_checkpoint else FUSED_LAYERS
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @property
    def recurrent_shapes(self) -> list:
        """The state of each linear-attention layer (a hybrid model's; empty for others): what
        the engine's recurrent cache holds a slot of (`hibana_core.kv.recurrent`)."""
        linear = self.args.linear_attention
        return [] if linear is None else [linear.shape] * sum(linear.layers)

    def commit_recurrent(self, counts: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """After a verify step, each sequence's states fold in counts[b] of its rows: its first, or
        those after the first skip[b], which an earlier call folded in. (A CUDA graph's step has
        as many sequences as its batch bucket, the padding ones after the step's: they take 0.)"""
        records = [layer.linear_attn.verified for layer in self.model.layers if layer.linear]
        if not records or records[0] is None:
            return
        padding = records[0].slots.shape[0] - counts.shape[0]
        if padding:
            counts = torch.nn.functional.pad(counts, (0, padding))
            skip = None if skip is None else torch.nn.functional.pad(skip, (0, padding))
        for layer in self.model.layers:
            if layer.linear:
                layer.linear_attn.commit(counts, skip)

    @property
    def verified(self) -> list:
        """What each linear layer's last verify step left for `commit_recurrent` (a CUDA graph
        records it at capture and gives it back after each replay)."""
        return [layer.linear_attn.verified for layer in self.model.layers if layer.linear]

    @verified.setter
    def verified(self, records: list) -> None:
        for layer, record in zip((layer for layer in self.model.layers if layer.linear), records, strict=True):
            layer.linear_attn.verified = record

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.args.logits_scaling != 1.0:  # (Granite's: a division, as transformers')
            logits = logits / self.args.logits_scaling
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decode_bytes_per_token(self) -> int:
        """Weight bytes one batch-1 decode token reads (a roofline's numerator): every tensor
        (after surgery: packed weights and their scales) but the experts it is not routed to
        and, where lm_head has its own weight, the other tokens' embedding rows."""
        tensors = {t.data_ptr(): t for t in (*self.parameters(), *self.buffers())}  # tied ones once
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        total -= sum(m.unread_bytes_per_token() for m in self.modules() if hasattr(m, "unread_bytes_per_token"))
        embed = self.model.embed_tokens.weight
        if not self.args.tie_word_embeddings:
            total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
        return total

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as `checkpoint_tensors` spells it."""
        for theirs, ours in self.args.checkpoint_prefixes:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        if self.args.checkpoint_renames:
            renames = dict(self.args.checkpoint_renames)
            name = ".".join(renames.get(part, part) for part in name.split("."))
        return name

    @property
    def checkpoint_other_parts(self) -> tuple[str, ...]:
        """Name prefixes of the checkpoint's parts this model leaves out on purpose."""
        return self.args.checkpoint_other_parts

    def checkpoint_tensors(self, names: Collection[str]) -> dict[str, torch.Tensor]:
        """Every tensor name a Hugging Face checkpoint holds -> where its values go (views into
        the fused q/k/v and gate/up parameters where the checkpoint holds them apart, and into
        the stacked experts where it holds one tensor per expert). `names`: the checkpoint's."""
        targets: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            module, _, kind = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if proj not in self.fused_layers:
                targets[name] = param
                continue
            # the parts' widths: the layer's own (q/k/v, a linear-attention input), else halves (gate / up:
            # an MLP's own width, GLM's shared experts)
            sizes = getattr(self.get_submodule(module), "fused_sizes", None) or (param.shape[0] // 2,) * 2
            for part, view in zip(self.fused_layers[proj], param.data.split(sizes, dim=0)):
                targets[f"{parent}.{part}.{kind}"] = view
        for prefix, module in self.named_modules():
            if isinstance(module, Experts) and module.has_float_stacks and f"{prefix}.gate_up_proj" not in names:
                del targets[f"{prefix}.gate_up_proj"], targets[f"{prefix}.down_proj"]
                targets.update(module.checkpoint_views(prefix))
        return targets
