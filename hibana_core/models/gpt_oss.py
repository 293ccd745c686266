"""gpt-oss (model_type gpt_oss: gpt-oss-20b, gpt-oss-120b) on the shared decoder.

Its differences, each read from the config as transformers' GptOss modelling code uses them:
attention with biases and sinks (a learned logit per head in each softmax's denominator),
sliding-window and full layers alternating (layer_types), YaRN rotary scaling, and a sparse
block in every layer: a router with a bias picking the top num_experts_per_tok of
num_local_experts by raw logit (softmax over those k), experts with biases and the clamped
SwiGLU (`hibana_kernels.MoEExperts` activation "swiglu_oai").

The experts load as the checkpoint holds them, converted once to the kernels' layout (gate
rows, then up rows; `hibana_kernels.moe` draws both):

    MXFP4 checkpoints (quantization_config quant_method "mxfp4", the released ones)
        experts.gate_up_proj_blocks / _scales   interleaved rows -> deinterleave_gate_up
        experts.down_proj_blocks / _scales      as they are
    float checkpoints (also one saved dequantized whose config still names MXFP4)
        experts.gate_up_proj [E, H, 2I]         transposed, deinterleaved -> [E, 2I, H]
        experts.down_proj    [E, I, H]          transposed -> [E, H, I]
    both: experts.gate_up_proj_bias [E, 2I] deinterleaved, experts.down_proj_bias [E, H]
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.errors import UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.loader import ConvertedTensor
from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM
from hibana_core.models.moe import ExpertsBlock, StackedExperts, check_top_k
from hibana_kernels.moe import MXFP4_BLOCK, deinterleave_gate_up

MODEL_TYPES = ("gpt_oss",)


def is_mxfp4(config: Any) -> bool:
    """The checkpoint stores its experts in MXFP4 (blocks and scales)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = (quantization or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise UnsupportedModelError(f"gpt_oss with quant_method {method!r} is not supported; "
                                    "gpt-oss checkpoints load in MXFP4 or a float dtype")
    return method == "mxfp4"


def args_from_config(config: Any) -> DecoderArgs:
    attention_bias = bool(getattr(config, "attention_bias", True))  # gpt-oss's projections have biases
    return DecoderArgs.from_config(config, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False,
                                   activation="silu", attention_sinks=True,  # (its experts replace the MLP)
                                   cast_last_norms=True)


def _uint8(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class GptOssExperts(StackedExperts):
    """The E experts in the kernels' layout: dense `gate_up_proj` [E, 2I, H] and `down_proj`
    [E, H, I] (w8 / w4 pack them to int8 / int4), or MXFP4 blocks and scales; biases `gate_up_proj_bias`
    [E, 2I] (gate then up), `down_proj_bias` [E, H]."""

    def __init__(self, config: Any, mxfp4: bool) -> None:
        super().__init__()
        e, i, h = config.num_local_experts, config.intermediate_size, config.hidden_size
        self.mxfp4 = mxfp4
        # released configs name the limit only; transformers fixes alpha at 1.702 (and limit at 7)
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        if mxfp4:
            half = MXFP4_BLOCK // 2  # bytes of a block: two codes a byte
            self.gate_up_proj_blocks = _uint8(e, 2 * i, h // MXFP4_BLOCK, half)
            self.gate_up_proj_scales = _uint8(e, 2 * i, h // MXFP4_BLOCK)
            self.down_proj_blocks = _uint8(e, h, i // MXFP4_BLOCK, half)
            self.down_proj_scales = _uint8(e, h, i // MXFP4_BLOCK)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def hold_float_stacks(self) -> None:
        """Hold float `gate_up_proj` and `down_proj` (of the biases' dtype and device) in place of
        the MXFP4 blocks and scales: a checkpoint whose config names MXFP4 but whose experts were
        saved dequantized (transformers loads it as float, with Mxfp4Config(dequantize=True))."""
        e, i2, h = self.gate_up_proj_bias.shape[0], self.gate_up_proj_bias.shape[1], self.down_proj_bias.shape[1]
        like = dict(dtype=self.gate_up_proj_bias.dtype, device=self.gate_up_proj_bias.device)
        for stack in ("gate_up_proj", "down_proj"):
            for part in ("blocks", "scales"):
                delattr(self, f"{stack}_{part}")
        self.gate_up_proj = nn.Parameter(torch.empty(e, i2, h, **like), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i2 // 2, **like), requires_grad=False)
        self.mxfp4 = False

    def kernel_experts(self) -> kernels.MoEExperts:
        common = dict(b13=self.gate_up_proj_bias, b2=self.down_proj_bias, activation="swiglu_oai",
                      swiglu_alpha=self.alpha, swiglu_limit=self.limit)
        if self.mxfp4:
            return kernels.MoEExperts("mxfp4", self.gate_up_proj_blocks, self.down_proj_blocks,
                                      self.gate_up_proj_scales, self.down_proj_scales, **common)
        return kernels.MoEExperts(**self.stacked_weights(), **common)

    def checkpoint_targets(self, prefix: str) -> dict[str, ConvertedTensor | torch.Tensor]:
        """The checkpoint's expert tensor names (module docstring) -> where they load."""
        deinterleave = deinterleave_gate_up

        def into(param: torch.Tensor, shape: tuple[int, ...],
                 convert: Callable[[torch.Tensor], torch.Tensor]) -> ConvertedTensor:
            return ConvertedTensor(shape, lambda t: param.data.copy_(convert(t)))

        gate_up_bias = self.gate_up_proj_bias
        targets: dict[str, ConvertedTensor | torch.Tensor] = {
            f"{prefix}.gate_up_proj_bias": into(gate_up_bias, tuple(gate_up_bias.shape), deinterleave),
            f"{prefix}.down_proj_bias": self.down_proj_bias}
        if self.mxfp4:
            for part in ("blocks", "scales"):
                param = getattr(self, f"gate_up_proj_{part}")
                targets[f"{prefix}.gate_up_proj_{part}"] = into(param, tuple(param.shape), deinterleave)
                targets[f"{prefix}.down_proj_{part}"] = getattr(self, f"down_proj_{part}")
            return targets
        e, i2, h = self.gate_up_proj.shape
        targets[f"{prefix}.gate_up_proj"] = into(self.gate_up_proj, (e, h, i2),
                                                 lambda t: deinterleave(t.transpose(1, 2)))
        targets[f"{prefix}.down_proj"] = into(self.down_proj, (e, i2 // 2, h), lambda t: t.transpose(1, 2))
        return targets


class GptOssRouter(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_local_experts))


class GptOssMoE(ExpertsBlock):
    """gpt-oss's block: a router with a bias, the top k of the logits, softmax over those k."""

    scoring = "topk_softmax"

    def __init__(self, config: Any, mxfp4: bool) -> None:
        super().__init__()
        check_top_k(config.num_experts_per_tok, config.num_local_experts)
        self.top_k = config.num_experts_per_tok
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config, mxfp4)

    def router_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router.weight, self.router.bias


class GptOssForCausalLM(DecoderForCausalLM):
    """The shared decoder with gpt-oss's sparse block as every layer's MLP."""

    def __init__(self, args: DecoderArgs, ctx: ForwardContext, config: Any) -> None:
        super().__init__(args, ctx)
        mxfp4 = is_mxfp4(config)
        for layer in self.model.layers:
            layer.mlp = GptOssMoE(config, mxfp4)

    def checkpoint_tensors(self, names: Collection[str]) -> dict[str, torch.Tensor | ConvertedTensor]:
        for prefix, module in self.named_modules():
            if (isinstance(module, GptOssExperts) and module.mxfp4 and f"{prefix}.gate_up_proj" in names
                    and f"{prefix}.gate_up_proj_blocks" not in names):  # saved dequantized: float experts
                module.hold_float_stacks()
        targets = super().checkpoint_tensors(names)
        for prefix, module in self.named_modules():
            if isinstance(module, GptOssExperts):
                for name in [n for n in targets if n.startswith(prefix + ".")]:
                    del targets[name]
                targets.update(module.checkpoint_targets(prefix))
        return targets


def build(config: Any, ctx: ForwardContext) -> tuple[GptOssForCausalLM, DecoderArgs]:
    args = args_from_config(config)
    return GptOssForCausalLM(args, ctx, config), args
