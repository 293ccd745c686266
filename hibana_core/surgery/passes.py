"""The built-in surgery passes: weight-only int8 ("w8") and int4 ("w4"), and the fp8 KV cache
("kv8").

w8 and w4 rewrite every linear layer of the decoder (attention and MLP projections) that supports a
packed weight (`set_packed`); the output head and the embeddings keep their precision, as
AWQ and GPTQ checkpoints keep them (the head is one layer that every token's logits go through).
Both also pack the stacked float experts of MoE layers (`set_packed_stacks`: int8 per output
row, int4 in groups, by the linears' rules); the routers stay float, MXFP4 experts as loaded.
Experts w4 finds no even group size for stay float, named in the record's `experts_kept_float`.
kv8 gives every attention layer (`set_kv_scales`) per-head scales for an fp8 KV cache.
window switches the full-attention layers that matter least for long context to sink + window
attention (`hibana_core.surgery.window`).
w8 and w4 refuse a model loaded from an FP8 checkpoint: its weights are 8-bit already, so w8
saves nothing, and w4 from them would round twice (the unquantized checkpoint gives a better int4).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hibana_core.errors import ConfigError
from hibana_plugins.hookspecs import hookimpl

logger = logging.getLogger("hibana.surgery")

if TYPE_CHECKING:  # imported by the plugin manager, which must not pull torch in
    import torch


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class WeightQuantPass:
    """Pack the dense linear weights of the decoder layers."""

    rewrites = "the linear weights"  # w8 and w4 in one list: refused before the model loads

    def __init__(self, bits: int) -> None:
        self.bits = bits
        # the guard's default floors (hibana_core.surgery.guard): int8 should be all but free
        self.floors = {"ppl_ratio": 1.005} if bits == 8 else {"ppl_ratio": 1.05, "top1_agreement": 0.93}
        self.advice = ("keep the output head dense (lm_head: 'dense'), or the weights (leave w8 out)" if bits == 8
                       else "use a gentler pass (w8, or try w4 with a smaller group_size, which keeps more of "
                            "the model)")

    def check(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters with their defaults (w4: group_size 128, clip true; both: lm_head "int8",
        the output head in int8 per channel where it has its own weight, or "dense"), or a
        ConfigError."""
        allowed = {"group_size": 128, "clip": True, "lm_head": "int8"} if self.bits == 4 else {"lm_head": "int8"}
        unknown = set(params) - set(allowed)
        if unknown:
            raise ConfigError(f"surgery pass w{self.bits} takes {sorted(allowed)}, got {sorted(unknown)}")
        params = {**allowed, **params}
        if params["lm_head"] not in LM_HEAD_CHOICES:
            raise ConfigError(f"w{self.bits}: lm_head must be one of {LM_HEAD_CHOICES}, got {params['lm_head']!r}")
        if self.bits == 4:
            wanted = params["group_size"]
            if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 2 or wanted % 2:
                raise ConfigError(f"w4: group_size must be an even integer >= 2, got {wanted!r}")
            if not isinstance(params["clip"], bool):
                raise ConfigError(f"w4: clip must be true or false, got {params['clip']!r}")
        return params

    def refuse(self, model: "torch.nn.Module", params: dict[str, Any]) -> None:
        """A ConfigError where the linear layers are packed already (an earlier pass, the
        checkpoint's manifest or its quantization_config) or in fp8."""
        packed = [(name, m.kind) for name, m in model.named_modules() if getattr(m, "kind", None) in ("int8", "int4")]
        if packed:  # an earlier pass in the list, or the checkpoint's manifest
            raise ConfigError(f"surgery pass w{self.bits}: the linear layers are already {packed[0][1]} "
                              f"({len(packed)} layers, e.g. {packed[0][0]}: by an earlier pass, the checkpoint's "
                              "manifest or its quantization_config); give one weight pass, on the unquantized "
                              "checkpoint")
        fp8 = [name for name, m in model.named_modules() if getattr(m, "kind", None) == "fp8"]
        if fp8:  # requantizing fp8 codes rounds twice, and w8 would not even save a byte
            raise ConfigError(f"surgery pass w{self.bits} on an FP8 checkpoint ({len(fp8)} fp8 layers, e.g. "
                              f"{fp8[0]}): its weights are already 8-bit; load it without w{self.bits}, or "
                              "apply w4 to the unquantized checkpoint")

    def apply(self, model: "torch.nn.Module", params: dict[str, Any]) -> dict[str, Any]:
        from hibana_core.surgery import progress_bar
        from hibana_core.surgery.quantize import group_size_for, quantize_int4, quantize_int8

        params = self.check(params)
        wanted, clip = params.get("group_size"), params.get("clip")
        self.refuse(model, params)  # again: an earlier pass of the same list may have packed them
        layers = [(name, m) for name, m in model.named_modules() if _packable(name, m)]
        before = after = 0
        kept: list[str] = []
        groups: set[int] = set()  # the group sizes used: the asked one where it divides a layer's inputs
        for name, layer in progress_bar(layers, desc=f"surgery w{self.bits}", unit="layer", leave=False):
            weight = layer.weight.data
            group = 0
            if self.bits == 8:
                packed = quantize_int8(weight)
            else:
                group = group_size_for(weight.shape[1], wanted)
                if group is None:  # no even group size divides its inputs
                    kept.append(name)
                    continue
                packed = quantize_int4(weight, group, clip)
                groups.add(group)
            before += _tensor_bytes([weight])
            layer.set_packed(f"int{self.bits}", packed, group)
            after += _tensor_bytes(packed.values())
        if not layers or len(kept) == len(layers):
            raise ConfigError(f"surgery pass w{self.bits} found no linear layer it can pack in this model")
        head, head_bytes = _pack_lm_head(model, params["lm_head"])
        experts = self._pack_experts(model, wanted, clip)
        groups |= experts["groups"]  # an expert stack takes its own size where wanted does not divide its inputs
        used = {"group_sizes_used": sorted(groups)} if self.bits == 4 else {}
        if self.bits == 4 and groups - {wanted}:
            logger.warning("surgery w4: group_size %d does not divide every layer's inputs; those layers use groups "
                           "of %s (the largest even size up to %d that divides theirs)", wanted,
                           ", ".join(map(str, sorted(groups - {wanted}))), wanted)
        return {"layers": len(layers) - len(kept), "kept_dense": kept, **used, "lm_head": head,
                "experts": experts["experts"], "experts_kept_float": experts["experts_kept_float"],
                "bytes_before": before + head_bytes[0] + experts["bytes_before"],
                "bytes_after": after + head_bytes[1] + experts["bytes_after"]}

    def _pack_experts(self, model: "torch.nn.Module", wanted: int | None, clip: bool | None) -> dict[str, Any]:
        """Pack the float expert stacks of every MoE layer, each stack by the linears' rule; the
        record's expert fields, the bytes before and after, and the int4 group sizes used."""
        from hibana_core.models.moe import STACKS
        from hibana_core.surgery import progress_bar
        from hibana_core.surgery.quantize import group_size_for, quantize_stacked

        experts = [(name, m) for name, m in model.named_modules()
                   if hasattr(m, "set_packed_stacks") and m.has_float_stacks]
        before = after = 0
        kept: list[str] = []
        used: set[int] = set()  # w4: the group sizes the stacks took
        for name, module in progress_bar(experts, desc=f"surgery w{self.bits} experts", unit="layer", leave=False,
                                 disable=not experts):
            stacks = {stack: getattr(module, stack).data for stack in STACKS}  # each [E, N, K]
            groups = {stack: group_size_for(w.shape[2], wanted) if self.bits == 4 else 0
                      for stack, w in stacks.items()}
            if None in groups.values():  # no even group size divides an expert's inputs
                kept.append(name)
                continue
            packed = {stack: quantize_stacked(w, self.bits, groups[stack], clip) for stack, w in stacks.items()}
            used |= set(groups.values()) - {0}
            before += _tensor_bytes(stacks.values())
            module.set_packed_stacks(f"int{self.bits}", packed)
            after += _tensor_bytes(t for p in packed.values() for t in p.values())
        return {"experts": len(experts) - len(kept), "experts_kept_float": kept, "bytes_before": before,
                "bytes_after": after, "groups": used}


class KVQuantPass:
    """kv8: keys and values stored in fp8 (e4m3), one byte per element instead of two (bf16), so
    the same memory holds twice the KV blocks: twice the resident agents per GB.

    Scales: static, one per (layer, KV head) for keys and one for values, calibrated at load.
    The calibration text runs through the model (as rewritten by the passes before this one);
    a head's scale is the power of two at or above MARGIN * amax / 448, amax being the largest
    magnitude its keys (or values) reached. Static per-head scales cost nothing per block or
    per step, keep blocks position-independent (prefix sharing, forks, speculation's rollback and
    state files move fp8 blocks as they are), and let the attention kernels fold a head's scale
    into its scores and output. fp8 is a floating-point format: its relative precision (3
    mantissa bits) is the same across its range, so the headroom of MARGIN (2 to 4 times, with
    the rounding up to a power of two) costs precision only for values below amax / 7000 or so,
    while values past the calibrated range saturate at +-448 * scale instead of overflowing.
    Powers of two make dequantization exact in bf16/fp16/fp32 and the scales insensitive to
    the last bits of the calibration run (another device's rounding changes a scale only where
    a head's amax lies within that rounding of a power of two); a digest of the scales joins the
    fingerprint, so a state never loads under other scales. Attention layers are found by
    `set_kv_scales` and indexed by their `layer_idx` (their layer of the KV cache).
    """

    calibrated = True
    MARGIN = 2.0
    FP8_MAX = 448.0

    def __init__(self) -> None:
        # the guard's default floors: fp8's 3 mantissa bits cost the demo model a perplexity ratio
        # of ~1.005, top-1 agreement ~97% and mean KL ~0.005 (any margin, any power of two: the
        # rounding, not the range, is the cost); between w8's floor and w4's
        self.floors = {"ppl_ratio": 1.02, "top1_agreement": 0.95}
        self.advice = "keep the KV cache in the model's dtype (leave kv8 out)"

    def check(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters (none), or a ConfigError before the model loads."""
        if params:
            raise ConfigError(f"surgery pass kv8 takes no parameters, got {sorted(params)}")
        return params

    def refuse(self, model: "torch.nn.Module", params: dict[str, Any]) -> None:
        """A ConfigError for parameters, a model without attention layers that take KV scales, a
        GPU without fp8, or a KV cache in fp8 already."""
        import torch

        from hibana_core.kv.layout import attention_layers

        self.check(params)
        layers = attention_layers(model)
        if not layers:
            raise ConfigError(f"surgery pass kv8 found no attention layer that takes KV scales in "
                              f"{type(model).__name__}")
        device = next(model.parameters()).device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError("kv8 needs a GPU with fp8 support (compute capability 8.9 or newer: Ada, Hopper "
                              f"and later); {torch.cuda.get_device_name(device)} has none; leave kv8 out")
        if any(m.kv_scale is not None for m in layers):
            raise ConfigError("this model already stores its KV cache in fp8 (kv8 was applied, e.g. by "
                              "`hibana surgery`); leave kv8 out of surgery (kv_dtype 'auto' or 'fp8' keeps "
                              "its fp8 cache)")

    def apply(self, model: "torch.nn.Module", params: dict[str, Any], calibration: Any) -> dict[str, Any]:
        import hashlib

        import torch

        from hibana_core.kv.layout import attention_layers

        self.refuse(model, params)
        layers = [(m.layer_idx, m) for m in attention_layers(model)]
        amax = None
        for doc in calibration.documents:
            kv = calibration.kv(doc)  # [num_layers, 2, T, H_kv, D]
            doc_amax = kv.float().abs().amax(dim=(2, 4)).cpu()  # [num_layers, 2, H_kv]
            amax = doc_amax if amax is None else torch.maximum(amax, doc_amax)
        exponents = torch.ceil(torch.log2(amax * self.MARGIN / self.FP8_MAX)).clamp(-64, 64)
        exponents = torch.nan_to_num(exponents, nan=0.0)  # (a NaN activation: the model is broken anyway)
        scales = torch.pow(2.0, exponents)  # [num_layers, 2, H_kv] float32
        for index, layer in layers:
            layer.set_kv_scales(scales[index].to(calibration.device))
        per_token = 2 * len(layers) * calibration.args.num_kv_heads * calibration.args.head_dim  # elements
        compute = calibration.dtype.itemsize
        return {"layers": len(layers), "calibration": calibration.source, "margin": self.MARGIN,
                "kv_bytes_per_token_before": per_token * compute, "kv_bytes_per_token_after": per_token,
                "scale_log2": [int(exponents.min()), int(exponents.max())],
                "digest": hashlib.sha256(exponents.to(torch.int8).numpy().tobytes()).hexdigest()}


LM_HEAD_CHOICES = ("int8", "dense")


def _pack_lm_head(model: "torch.nn.Module", wanted: str) -> tuple[str, tuple[int, int]]:
    """The output head in int8 per channel when `wanted` and it has its own weight (a head tied to
    the embedding stays: packing it would keep both, more bytes held for fewer read). Every
    decode step reads the whole head (Qwen3-8B's: 1.2 GB in bf16, a fifth of what w4 leaves);
    llama.cpp's 4-bit types keep theirs at 6 bits, int8 is as close. What it did, and the bytes
    before and after."""
    from hibana_core.surgery.quantize import quantize_int8

    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "kind", None) != "dense" or not hasattr(head, "set_packed"):
        return "none" if head is None else str(getattr(head, "kind", "dense")), (0, 0)
    if wanted == "dense":
        return "dense", (0, 0)
    weight = head.weight
    shared = any(p.data_ptr() == weight.data_ptr() for name, p in model.named_parameters(remove_duplicate=False)
                 if not name.startswith("lm_head."))
    if shared or weight.dim() != 2:
        return "dense (tied to the embedding)", (0, 0)
    packed = quantize_int8(weight.data)
    head.set_packed("int8", packed, 0)
    return "int8", (_tensor_bytes([weight]), _tensor_bytes(packed.values()))


def _packable(name: str, module: "torch.nn.Module") -> bool:
    return (hasattr(module, "set_packed") and getattr(module, "kind", None) == "dense"
            and not name.endswith("lm_head") and module.weight is not None and module.weight.dim() == 2)


@hookimpl
def register_surgery_passes(register) -> None:
    register("w8", WeightQuantPass(8))
    register("w4", WeightQuantPass(4))
    register("kv8", KVQuantPass())
    from hibana_core.surgery.window import SinkWindowPass  # no torch at import: the manager loads this module

    register("window", SinkWindowPass())
