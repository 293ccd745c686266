"""Llama-family decoder (serves model_type llama, qwen2, qwen3, mistral) over a paged KV cache.

Module and parameter names follow Hugging Face's, so checkpoints load by name. The arithmetic
follows transformers' modelling code step by step (norms in float32, rotary as rotate_half), which
is what lets greedy output match `generate` token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class LlamaArgs:
    """The shapes and switches of one checkpoint, read from its Hugging Face config."""

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
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # rope_parameters minus theta, as sorted items
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention

    @classmethod
    def from_hf_config(cls, config: Any) -> "LlamaArgs":
        model_type = config.model_type
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope = _rope_parameters(config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = {"qwen2": True, "mistral": False}.get(model_type, attention_bias)
        o_bias = {"qwen2": False, "mistral": False}.get(model_type, attention_bias)
        num_layers = config.num_hidden_layers
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)),
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if k != "rope_theta")),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(config, num_layers),
        )


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers 5 names it rope_parameters; 4.x split it into rope_theta and rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if config.model_type == "mistral" or getattr(config, "use_sliding_window", False):
        first = getattr(config, "max_window_layers", 0) if config.model_type != "mistral" else 0
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (float32), with llama3 / linear scaling."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(args.rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
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
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual) in one pass."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


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

    def after_norm(self, norm: RMSNorm, x: torch.Tensor,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual); without a residual (self(norm(x)), x).
        A dense weight takes `kernels.rms_norm_linear`, one launch where the GEMV folds the norm in."""
        if self.kind == "dense":
            return kernels.rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        if residual is None:
            return self(norm(x)), x
        x, residual = norm(x, residual)
        return self(x), residual

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) of a fused gate/up output; one launch where a dense weight's GEMV
        folds the activation in (`kernels.silu_and_mul_linear`)."""
        if self.kind == "dense":
            return kernels.silu_and_mul_linear(gate_up, self.weight, self.bias)
        return self(kernels.silu_and_mul(gate_up))

    def extra_repr(self) -> str:
        packed = "" if self.kind == "dense" else f", {self.kind}" + (f" g{self.group_size}" if self.group_size else "") \
            + (f" block {self.block[0]}x{self.block[1]}" if self.block else "")
        return super().extra_repr() + packed


class RotaryTables:
    """cos/sin tables indexed by position, [max_positions, head_dim], always float32, which
    `kernels.qk_norm_rotary_store` reads. Built on first use on the device of the positions (the
    model is constructed on "meta"), shared by all layers."""

    def __init__(self, args: LlamaArgs) -> None:
        self.args = args
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def _build(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.args)
        positions = torch.arange(self.args.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.device != device:
            self._build(device)
        return self.cos, self.sin


class Attention(nn.Module):
    """Self-attention with a fused q/k/v projection (the checkpoint's three are loaded into it).
    After kv8 (`set_kv_scales`) its keys and values are stored in fp8 with the per-head scales
    of buffer `kv_scale` [2 (k, v), H_kv] float32 (None: stored in the compute dtype)."""

    def __init__(self, args: LlamaArgs, layer_idx: int, ctx: ForwardContext,
                 rotary: RotaryTables) -> None:
        super().__init__()
        self.layer_idx, self.ctx, self.rotary = layer_idx, ctx, rotary
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        self.sliding_window = args.sliding_windows[layer_idx]
        h, d = args.hidden_size, args.head_dim
        self.split = (args.num_heads * d, args.num_kv_heads * d, args.num_kv_heads * d)
        self.qkv_proj = Linear(h, sum(self.split), bias=args.qkv_bias)
        self.o_proj = Linear(args.num_heads * d, h, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
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
        q = q.view(tokens, self.num_heads, self.head_dim)      # [T, H, D]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)   # [T, H_kv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        batch = self.ctx.batch
        k_cache, v_cache = self.ctx.kv_cache.layer(self.layer_idx)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else (None, None, 0.0)
        q = kernels.qk_norm_rotary_store(positions, q, k, v, *self.rotary.tables(positions.device),
                                         k_cache, v_cache, batch.slot_mapping, *norms, self.kv_scale)
        o = kernels.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, batch.max_query_len, batch.max_seq_len,
                                    self.scale, self.sliding_window, batch.uniform_query_len, self.kv_scale)
        return self.o_proj(o.reshape(tokens, self.num_heads * self.head_dim)), residual


class MLP(nn.Module):
    """SwiGLU with a fused gate/up projection."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_up_proj = Linear(h, 2 * i, bias=args.mlp_bias)
        self.down_proj = Linear(i, h, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of norm(x + residual); returns (its output, x + residual)."""
        gate_up, residual = self.gate_up_proj.after_norm(norm, x, residual)
        return self.down_proj.after_silu_and_mul(gate_up), residual


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_idx: int, ctx: ForwardContext,
                 rotary: RotaryTables) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer_idx, ctx, rotary)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        """The residual stream is carried beside x (the stream is x + residual), so each add
        fuses with the norm after it, and both with the projection after that where the kernels
        can (`Linear.after_norm`): a batch-1 decode layer on the GPU can be six launches (norm +
        qkv, prologue, attention, o, norm + gate_up, silu + down)."""
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        return self.mlp(x, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, ctx: ForwardContext) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.rotary = RotaryTables(args)
        self.layers = nn.ModuleList(DecoderLayer(args, i, ctx, self.rotary) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


# checkpoint name -> (fused parameter, index of its part)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids, positions) -> hidden [T, hidden]`; `compute_logits` on chosen rows."""

    FUSED_LAYERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    """A fused linear layer -> the checkpoint layers it concatenates along its outputs, in order."""

    def __init__(self, args: LlamaArgs, ctx: ForwardContext) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, ctx)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tied_weight_names = ("lm_head.weight",) if args.tie_word_embeddings else ()
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor name a Hugging Face checkpoint holds -> where its values go (views into
        the fused q/k/v and gate/up parameters)."""
        a = self.args
        sizes = {"qkv_proj": (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                              a.num_kv_heads * a.head_dim),
                 "gate_up_proj": (a.intermediate_size, a.intermediate_size)}
        targets: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            module, _, kind = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            if proj not in sizes:
                targets[name] = param
                continue
            parts = param.data.split(sizes[proj], dim=0)
            for hf_proj, (fused, index) in _FUSED.items():
                if fused == proj:
                    targets[f"{parent}.{hf_proj}.{kind}"] = parts[index]
        return targets


def build(config: Any, ctx: ForwardContext) -> tuple[LlamaForCausalLM, LlamaArgs]:
    args = LlamaArgs.from_hf_config(config)
    return LlamaForCausalLM(args, ctx), args
