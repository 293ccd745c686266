"""Mixture-of-experts layers: the plain-torch references (CPU path, oracle for Triton).

A sparse MoE block is routing (`moe_route`: router logits -> k expert ids and weights per token)
then the experts (`fused_moe`: each token through its k experts' MLPs, outputs weighted and
summed). The experts' weights come in one `MoEExperts`, stacked over the E experts:

    dense (any float dtype)
        w13  [E, 2I, H]    gate rows [0, I), then up rows [I, 2I): `x @ w13[e].T` is gate|up
        w2   [E, H, I]     the down projection, nn.Linear's [out, in] like w13
    mxfp4 (gpt-oss checkpoints' `*_blocks` / `*_scales`, loaded as they are)
        w13  uint8 [E, 2I, H // 32, 16]   32 e2m1 codes per block, two a byte: the even index in
        w2   uint8 [E, H, I // 32, 16]    the low nibble, the odd one in the high nibble
        w13_scales, w2_scales  uint8 [E, 2I, H // 32], [E, H, I // 32]
                                          e8m0: the block's values are code * 2^(scale - 127)
    int8 (surgery's w8: per output row, symmetric, as `hibana_kernels.quant`'s int8 linears)
        w13  int8 [E, 2I, H]    w2  int8 [E, H, I]
        w13_scales, w2_scales  float32 [E, 2I], [E, H]   w[e, n, k] = code[e, n, k] * scale[e, n]
    int4 (surgery's w4: per group of g inputs, asymmetric, as `hibana_kernels.quant`'s int4 linears)
        w13  uint8 [E, 2I, H // 2]   w2  uint8 [E, H, I // 2]   two codes a byte, k even in the low nibble
        w13_scales, w13_zeros  float16 [E, 2I, H // g13]         w[e, n, k] = (code - zero) * scale
        w2_scales, w2_zeros    float16 [E, H, I // g2]           of k's group (g from the shapes)
    biases (optional, either kind)  b13 [E, 2I] (gate then up), b2 [E, H]

gpt-oss interleaves gate and up (its gate_up_proj's output features alternate gate, up, gate,
...); `deinterleave_gate_up` puts a checkpoint's rows (blocks, scales or bias) into the
gate-then-up order w13 expects. Qwen3-MoE's gate_up_proj is already gate then up. As the
checkpoints store them:

    Qwen3-MoE   w13 = gate_up_proj [E, 2I, H]                 w2 = down_proj [E, H, I]
    gpt-oss     w13 = deinterleave_gate_up(gate_up_proj_blocks), w13_scales likewise,
    (MXFP4)     b13 = deinterleave_gate_up(gate_up_proj_bias); w2 = down_proj_blocks as stored
    gpt-oss     w13 = deinterleave_gate_up(gate_up_proj.transpose(1, 2))   ([E, H, 2I] there)
    (bf16)      w2 = down_proj.transpose(1, 2)                             ([E, I, H] there)

A layer is then `weights, ids = moe_route(router_logits, k, ...)` and
`fused_moe(x, experts, weights, ids)`; build the MoEExperts once at load (it checks shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hibana_kernels import norm
from hibana_kernels.quant import dequantize_int4, dequantize_int8

KINDS = ("dense", "mxfp4", "int8", "int4")
SCORINGS = ("softmax", "topk_softmax", "sigmoid")
ACTIVATIONS = ("silu", "swiglu_oai")
MXFP4_BLOCK = 32
"""Values per MXFP4 block, sharing one e8m0 scale."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 code (a nibble) -> its value: sign bit, two exponent bits, one mantissa bit."""


@dataclass(frozen=True)
class MoEExperts:
    """The E experts of one MoE layer, in the layout the module docstring draws."""

    kind: str
    """"dense" (w13/w2 in a float dtype), "mxfp4" (packed blocks plus e8m0 scales), "int8"
    (codes plus per-row scales) or "int4" (packed codes plus per-group scales and zeros)."""
    w13: torch.Tensor
    """Gate then up projection: [E, 2I, H] (float or int8), mxfp4 blocks [E, 2I, H // 32, 16] or
    int4 bytes [E, 2I, H // 2]."""
    w2: torch.Tensor
    """Down projection: [E, H, I] (float or int8), mxfp4 blocks [E, H, I // 32, 16] or int4 bytes
    [E, H, I // 2]."""
    w13_scales: torch.Tensor | None = None
    """Scales of w13: mxfp4 e8m0 uint8 [E, 2I, H // 32], int8 float32 [E, 2I], int4 float16
    [E, 2I, H // g13]; dense None."""
    w2_scales: torch.Tensor | None = None
    """Scales of w2: mxfp4 e8m0 uint8 [E, H, I // 32], int8 float32 [E, H], int4 float16
    [E, H, I // g2]; dense None."""
    w13_zeros: torch.Tensor | None = None
    """int4 only: zero points of w13 (in code units), float16 like w13_scales."""
    w2_zeros: torch.Tensor | None = None
    """int4 only: zero points of w2, float16 like w2_scales."""
    b13: torch.Tensor | None = None
    """Bias of w13 [E, 2I] (gate then up), or None."""
    b2: torch.Tensor | None = None
    """Bias of w2 [E, H], or None."""
    activation: str = "silu"
    """"silu": silu(gate) * up (Qwen3-MoE, Mixtral). "swiglu_oai": gpt-oss's clamped SwiGLU."""
    swiglu_alpha: float = 1.702
    """swiglu_oai: out = (up + 1) * gate * sigmoid(alpha * gate)."""
    swiglu_limit: float = 7.0
    """swiglu_oai: gate is clamped to at most limit, up to [-limit, limit]."""
    round_weights: bool = True
    """The routing weights rounded to x's dtype before they scale the experts' outputs
    (transformers' Qwen3-MoE and gpt-oss routers return them in the logits' dtype); False: kept in
    float32, each product rounded once (transformers' Mixtral)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"MoEExperts kind must be one of {KINDS}, not {self.kind!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEExperts activation must be one of {ACTIVATIONS}, not {self.activation!r}")
        quantized = self.kind != "dense"
        if quantized != (self.w13_scales is not None and self.w2_scales is not None):
            raise ValueError(f"{self.kind} experts need w13_scales and w2_scales; dense experts take none")
        if (self.kind == "int4") != (self.w13_zeros is not None and self.w2_zeros is not None):
            raise ValueError("int4 experts need w13_zeros and w2_zeros; other kinds take none")
        e, i2, h = self.num_experts, 2 * self.intermediate_size, self.hidden_size
        if self.kind == "mxfp4":
            _check_mxfp4_shapes("w13", self.w13, self.w13_scales, (e, i2, h))
            _check_mxfp4_shapes("w2", self.w2, self.w2_scales, (e, h, i2 // 2))
        elif self.kind == "int8":
            _check_int8_shapes("w13", self.w13, self.w13_scales, (e, i2, h))
            _check_int8_shapes("w2", self.w2, self.w2_scales, (e, h, i2 // 2))
        elif self.kind == "int4":
            _check_int4_shapes("w13", self.w13, self.w13_scales, self.w13_zeros, (e, i2, h))
            _check_int4_shapes("w2", self.w2, self.w2_scales, self.w2_zeros, (e, h, i2 // 2))
        elif self.w13.shape != (e, i2, h) or self.w2.shape != (e, h, i2 // 2):
            raise ValueError(f"dense experts want w13 [E, 2I, H] and w2 [E, H, I], got "
                             f"{tuple(self.w13.shape)} and {tuple(self.w2.shape)}")
        if self.b13 is not None and self.b13.shape != (e, i2):
            raise ValueError(f"b13 must be [E, 2I] = {(e, i2)}, got {tuple(self.b13.shape)}")
        if self.b2 is not None and self.b2.shape != (e, h):
            raise ValueError(f"b2 must be [E, H] = {(e, h)}, got {tuple(self.b2.shape)}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def group_sizes(self) -> tuple[int, int]:
        """int4: the inputs a scale and zero cover in w13 and in w2 (others: 0, 0)."""
        if self.kind != "int4":
            return 0, 0
        return (self.hidden_size // self.w13_scales.shape[-1],
                self.intermediate_size // self.w2_scales.shape[-1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the experts hold (weights, scales, biases present)."""
        return tuple(t for t in (self.w13, self.w2, self.w13_scales, self.w2_scales, self.w13_zeros,
                                 self.w2_zeros, self.b13, self.b2)
                     if t is not None)

    def bytes_per_token(self, top_k: int) -> int:
        """The weight bytes one token reads: its k experts' weights, scales and biases (distinct
        experts; the roofline of a batch-1 decode step's MoE layer)."""
        per_expert = sum(t[0].numel() * t.element_size() for t in self.tensors())
        return top_k * per_expert

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of one expert in `dtype`, dequantized if quantized."""
        if self.kind == "dense":
            return self.w13[expert].to(dtype), self.w2[expert].to(dtype)
        if self.kind == "int8":
            return (dequantize_int8(self.w13[expert], self.w13_scales[expert], dtype),
                    dequantize_int8(self.w2[expert], self.w2_scales[expert], dtype))
        if self.kind == "int4":
            g13, g2 = self.group_sizes
            return (dequantize_int4(self.w13[expert], self.w13_scales[expert], self.w13_zeros[expert], g13, dtype),
                    dequantize_int4(self.w2[expert], self.w2_scales[expert], self.w2_zeros[expert], g2, dtype))
        return (mxfp4_dequantize(self.w13[expert], self.w13_scales[expert], dtype),
                mxfp4_dequantize(self.w2[expert], self.w2_scales[expert], dtype))


def _check_mxfp4_shapes(name: str, blocks: torch.Tensor, scales: torch.Tensor, dense: tuple[int, ...]):
    e, n, k = dense
    if k % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 {name}: the input size {k} is not a multiple of {MXFP4_BLOCK}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 {name}: blocks and scales must be uint8")
    groups = k // MXFP4_BLOCK
    if blocks.shape != (e, n, groups, MXFP4_BLOCK // 2) or scales.shape != (e, n, groups):
        raise ValueError(f"mxfp4 {name}: want blocks {(e, n, groups, MXFP4_BLOCK // 2)} and scales "
                         f"{(e, n, groups)}, got {tuple(blocks.shape)} and {tuple(scales.shape)}")


def _check_int8_shapes(name: str, codes: torch.Tensor, scales: torch.Tensor, dense: tuple[int, ...]):
    if codes.dtype != torch.int8 or scales.dtype != torch.float32:
        raise ValueError(f"int8 {name}: codes must be int8 and scales float32, got {codes.dtype} and {scales.dtype}")
    if codes.shape != dense or scales.shape != dense[:2]:
        raise ValueError(f"int8 {name}: want codes {dense} and scales {dense[:2]}, got {tuple(codes.shape)} "
                         f"and {tuple(scales.shape)}")


def _check_int4_shapes(name: str, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       dense: tuple[int, ...]):
    e, n, k = dense
    if packed.dtype != torch.uint8 or scales.dtype != torch.float16 or zeros.dtype != torch.float16:
        raise ValueError(f"int4 {name}: codes must be uint8, scales and zeros float16")
    groups = scales.shape[-1] if scales.dim() == 3 else 0
    if k % 2 or not groups or k % groups or (k // groups) % 2:
        raise ValueError(f"int4 {name}: the input size {k} must be even and split into groups of an even size, "
                         f"got scales {tuple(scales.shape)}")
    if packed.shape != (e, n, k // 2) or scales.shape != (e, n, groups) or zeros.shape != scales.shape:
        raise ValueError(f"int4 {name}: want codes {(e, n, k // 2)}, scales and zeros {(e, n, groups)}, got "
                         f"{tuple(packed.shape)}, {tuple(scales.shape)} and {tuple(zeros.shape)}")


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's interleaved gate/up rows (dim 1: gate 0, up 0, gate 1, ...) -> gate rows then up
    rows, the w13 order; for [E, 2I, ...] blocks or scales and [E, 2I] biases alike."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., G, 16] and e8m0 scales uint8 [..., G] -> [..., G * 32] in `dtype`:
    each value code * 2^(scale - 127), exact in float32 and rounded once to `dtype`."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
              renormalize: bool = False, correction_bias: torch.Tensor | None = None,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]).

    "softmax": softmax over all E experts in float32, top-k of those probabilities, divided by
    their sum when `renormalize` (Qwen3-MoE's norm_topk_prob, Mixtral). "topk_softmax": top-k of
    the raw logits, then softmax over the k (gpt-oss). "sigmoid" (GLM-4.5's, DeepSeek-V3's
    without expert groups): each expert's score is sigmoid(logit) in float32; the top-k of score
    + `correction_bias` [E] (float32, None: zeros) pick the experts, whose weights are their
    scores without the bias, divided by their sum (+ 1e-20) when `renormalize`, times `scale`
    (routed_scaling_factor). Each calls torch.topk on the same values transformers does, so
    tied logits pick the experts transformers picks on the same device.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route scoring must be one of {SCORINGS}, not {scoring!r}")
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"moe_route top_k must lie in [1, {router_logits.shape[-1]}], not {top_k}")
    if scoring != "sigmoid" and (correction_bias is not None or scale != 1.0):
        raise ValueError(f"a correction bias and a scale are sigmoid routing's, not {scoring!r}'s")
    if scoring == "softmax":
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scale, ids
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=torch.float32), ids


def norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int, *,
               scoring: str = "softmax", renormalize: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sparse block's start: (h, x + residual, weights, ids) where h = rms_norm(x + residual)
    (Llama's arithmetic) is the experts' input, the router's logits are `h @ router_weight^T (+
    bias)` in x's dtype, and weights and ids are `moe_route` of them."""
    if scoring == "sigmoid":  # (its router runs in float32 with a correction bias: moe_route)
        raise ValueError("norm_route takes softmax and topk_softmax routing; route sigmoid scores with moe_route")
    h, residual = norm.fused_add_rms_norm(x, residual, norm_weight, eps)
    logits = F.linear(h, router_weight, router_bias)
    weights, ids = moe_route(logits, top_k, scoring=scoring, renormalize=renormalize)
    return h, residual, weights, ids


class ExpertBlocks(NamedTuple):
    """A batch's routes (token t's slot j is route t * k + j) grouped by expert into blocks of
    block_m rows, each block all one expert's, for the grouped GEMM:

        routes        int32 [max_blocks * block_m]   route ids, expert by expert in id order,
                                                     each expert's in route order, its last
                                                     block padded with T * k (no route)
        block_expert  int32 [max_blocks]              the expert of each block; -1 past the last

    max_blocks = cdiv(T * k, block_m) + E bounds the blocks of any routing, so the sizes depend on
    T alone (a CUDA graph can capture them)."""

    routes: torch.Tensor
    block_expert: torch.Tensor


def max_expert_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: each expert's count rounds up by less than one block."""
    return -(-num_routes // block_m) + num_experts


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Expert ids [T, k] -> their routes grouped into blocks of `block_m` rows per expert."""
    flat = ids.flatten()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = -(-counts // block_m)  # [E]
    max_blocks = max_expert_blocks(n, num_experts, block_m)
    order = torch.argsort(flat, stable=True)  # routes, expert by expert
    first_route = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    first_row = (torch.cumsum(blocks, 0) - blocks) * block_m  # ... and in the padded layout
    experts = flat[order]
    rows = first_row[experts] + torch.arange(n, device=ids.device) - first_route[experts]
    routes = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    routes[rows] = order.to(torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=ids.device)
    used = torch.repeat_interleave(torch.arange(num_experts, device=ids.device), blocks)
    block_expert[:used.numel()] = used.to(torch.int32)
    return ExpertBlocks(routes, block_expert)


def expert_activation(gate_up: torch.Tensor, experts: MoEExperts) -> torch.Tensor:
    """The experts' activation of a gate-then-up [..., 2I] -> [..., I], in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    if experts.activation == "silu":
        return F.silu(gate) * up
    limit = experts.swiglu_limit
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * experts.swiglu_alpha))


def check_moe_inputs(x: torch.Tensor, experts: MoEExperts, weights: torch.Tensor, ids: torch.Tensor):
    """Shapes only (the ids' range would cost a device sync): x [T, H], weights and ids [T, k]."""
    if x.dim() != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"fused_moe wants x [T, {experts.hidden_size}], got {tuple(x.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe wants weights and ids [T, k] for T = {x.shape[0]}, got "
                         f"{tuple(weights.shape)} and {tuple(ids.shape)}")


def fused_moe(x: torch.Tensor, experts: MoEExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] through each token's experts `ids` [T, k], weighted by `weights` [T, k] -> [T, H]
    in x's dtype.

    transformers' order of arithmetic: expert by expert in id order, each expert's MLP in x's
    dtype (bias added after its matmul), its output times the routing weight (rounded to x's dtype
    first where `experts.round_weights`, as transformers' Qwen3-MoE rounds them to the logits'
    dtype; else the float32 weight, as Mixtral's) rounded to x's dtype, summed into x's dtype.
    """
    check_moe_inputs(x, experts, weights, ids)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        slot, token = torch.where(ids.t() == expert)  # transformers' row order: by slot, then token
        w13, w2 = experts.expert_weights(expert, x.dtype)
        gate_up = F.linear(x[token], w13)  # [n, 2I]
        if experts.b13 is not None:
            gate_up = gate_up + experts.b13[expert].to(x.dtype)
        y = F.linear(expert_activation(gate_up, experts), w2)  # [n, H]
        if experts.b2 is not None:
            y = y + experts.b2[expert].to(x.dtype)
        weight = weights[token, slot, None]
        weight = weight.to(x.dtype) if experts.round_weights else weight.float()
        out.index_add_(0, token, (y * weight).to(x.dtype))
    return out
