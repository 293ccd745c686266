"""The sparse mixture-of-experts block MoE families put in place of a decoder layer's MLP:
a router, then each token through its top-k experts on the fused-MoE kernels
(`hibana_kernels.moe_route`, `hibana_kernels.fused_moe`).

The experts' weights are held stacked, as transformers 5 holds them in memory, so the kernels
read them as they are:

    experts.gate_up_proj  [E, 2I, H]   gate rows, then up rows (MoEExperts' w13)
    experts.down_proj     [E, H, I]    (MoEExperts' w2)
    gate.weight           [E, H]       the router

Checkpoints on disk keep one tensor per expert (experts.{e}.gate_proj / up_proj / down_proj),
which load into views of the stacked ones (`checkpoint_tensors`). Surgery's w8 and w4 swap the
float stacks for packed ones (`StackedExperts.set_packed_stacks`), in `hibana_kernels.moe`'s
int8 / int4 layouts:

    int8  experts.gate_up_proj_qweight  int8 [E, 2I, H]   experts.gate_up_proj_scales  float32 [E, 2I]
          experts.down_proj_qweight     int8 [E, H, I]    experts.down_proj_scales     float32 [E, H]
    int4  experts.{stack}_qweight       uint8 [E, N, K // 2]
          experts.{stack}_scales, experts.{stack}_zeros   float16 [E, N, K // group]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import CheckpointError


@dataclass(frozen=True)
class MoEArgs:
    """A sparse block's shape and routing, read from the config by its family."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # top-k weights divided by their sum (Qwen3-MoE's norm_topk_prob)
    layers: tuple[bool, ...]  # per decoder layer: a sparse block (True) or the dense MLP
    round_weights: bool = True  # top-k weights rounded to the model dtype before the experts' product
    # (transformers' Qwen3-MoE); False: float32 weights, each product rounded (Mixtral)

    def __post_init__(self) -> None:
        if any(self.layers):
            check_top_k(self.top_k, self.num_experts)


def check_top_k(top_k: int, num_experts: int) -> None:
    """A config whose tokens cannot be routed (top k outside [1, experts]) is a broken
    checkpoint, refused at load rather than by the router's kernel in the first forward."""
    if not 1 <= top_k <= num_experts:
        raise CheckpointError(f"the checkpoint's config.json sets num_experts_per_tok {top_k} with {num_experts} "
                              f"experts; it must lie in [1, {num_experts}]: fix config.json")


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


STACKS = ("gate_up_proj", "down_proj")
"""The stacked expert weights, w13 and w2 of `hibana_kernels.MoEExperts`."""


PACKED_PARTS = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}
"""The tensors of each stack once packed, by kind (buffers `{stack}_{part}`)."""


class StackedExperts(nn.Module):
    """Experts held as stacked float `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], which
    surgery's w8 / w4 may swap for int8 / int4 (the module docstring's buffers)."""

    experts_kind = "dense"
    """"dense" while the float stacks are here, else what they were packed to: "int8", "int4"."""

    @property
    def has_float_stacks(self) -> bool:
        """Whether float stacks are here to pack (not packed already, not a checkpoint's MXFP4)."""
        return getattr(self, "gate_up_proj", None) is not None

    def set_packed_stacks(self, kind: str, packed: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace each float stack by its packed tensors: `packed` maps gate_up_proj and
        down_proj to {part: tensor stacked over the experts}, the parts of PACKED_PARTS[kind]."""
        if kind not in PACKED_PARTS:
            raise ValueError(f"experts pack to one of {tuple(PACKED_PARTS)}, not {kind!r}")
        for name in STACKS:
            self.register_parameter(name, None)
            for part in PACKED_PARTS[kind]:
                self.register_buffer(f"{name}_{part}", packed[name][part])
        self.experts_kind = kind

    def stacked_weights(self) -> dict[str, Any]:
        """MoEExperts' kind, w13 and w2 (packed: and their scales, zeros) as this module holds them."""
        if self.experts_kind == "dense":
            return dict(kind="dense", w13=self.gate_up_proj, w2=self.down_proj)
        weights = dict(kind=self.experts_kind, w13=self.gate_up_proj_qweight, w2=self.down_proj_qweight,
                       w13_scales=self.gate_up_proj_scales, w2_scales=self.down_proj_scales)
        if self.experts_kind == "int4":
            weights.update(w13_zeros=self.gate_up_proj_zeros, w2_zeros=self.down_proj_zeros)
        return weights


class Experts(StackedExperts):
    def __init__(self, moe: MoEArgs, hidden_size: int) -> None:
        super().__init__()
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        self.round_weights = moe.round_weights
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def kernel_experts(self) -> kernels.MoEExperts:
        return kernels.MoEExperts(**self.stacked_weights(), round_weights=self.round_weights)

    def checkpoint_views(self, prefix: str) -> dict[str, torch.Tensor]:
        """A per-expert checkpoint's names (`{prefix}.{e}.gate_proj.weight`, ...) -> views."""
        i = self.down_proj.shape[2]
        views: dict[str, torch.Tensor] = {}
        for e in range(self.gate_up_proj.shape[0]):
            views[f"{prefix}.{e}.gate_proj.weight"] = self.gate_up_proj.data[e, :i]
            views[f"{prefix}.{e}.up_proj.weight"] = self.gate_up_proj.data[e, i:]
            views[f"{prefix}.{e}.down_proj.weight"] = self.down_proj.data[e]
        return views


class ExpertsBlock(nn.Module):
    """A sparse block in place of the MLP: forward(x, residual, norm) like the dense MLP's. A
    family gives its router (`route`) and its experts (`self.experts`, with `kernel_experts()`)."""

    top_k: int
    scoring: str  # `hibana_kernels.moe_route`'s
    renormalize: bool = False

    def router_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The router's weight [E, hidden] and bias (or None)."""
        raise NotImplementedError

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [T, top_k], for the normed hidden states h [T, hidden]: the
        router's logits in the model dtype, as transformers, then the family's top-k."""
        weight, bias = self.router_weights()
        return kernels.moe_route(kernels.linear(h, weight, bias), self.top_k, scoring=self.scoring,
                                 renormalize=self.renormalize)

    def unread_bytes_per_token(self) -> int:
        """Weight bytes of the experts one token is not routed to."""
        experts = self.experts.kernel_experts()
        return experts.bytes_per_token(experts.num_experts - self.top_k)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' output for norm(x + residual); returns (it, x + residual)."""
        experts = self.experts.kernel_experts()
        if norm.fusable and residual is not None:  # Llama's norm: one launch with the router where it pays
            weight, bias = self.router_weights()
            h, residual, weights, ids = kernels.moe_norm_route(x, residual, norm.weight, norm.eps, weight, bias,
                                                               self.top_k, scoring=self.scoring,
                                                               renormalize=self.renormalize)
            return kernels.fused_moe(h, experts, weights, ids), residual
        # where the experts take int8 x, the norm's launch writes h's codes too (a norm weight of x's
        # dtype: the norm's output dtype is then x's)
        if norm.weight is not None and norm.weight.dtype == x.dtype and kernels.moe_folds_a8(x, experts):
            h, residual, q, d = kernels.rms_norm_a8(x, residual, norm.weight, norm.eps, norm.unit_offset,
                                                    kernels.a8_order(experts.kind), norm.cast_last)
            return kernels.fused_moe_a8(h, q, d, experts, *self.route(h)), residual
        h, residual = norm(x, residual)  # [T, hidden]
        return kernels.fused_moe(h, experts, *self.route(h)), residual


class SparseMoE(ExpertsBlock):
    """Qwen3-MoE's block: a bias-free router, softmax over all experts, then the top k."""

    scoring = "softmax"

    def __init__(self, moe: MoEArgs, hidden_size: int) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Router(hidden_size, moe.num_experts)
        self.experts = Experts(moe, hidden_size)

    def router_weights(self) -> tuple[torch.Tensor, None]:
        return self.gate.weight, None
