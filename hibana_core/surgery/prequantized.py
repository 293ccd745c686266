"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors int4; FP8) loaded as they are.

`formats.py` reads each format's quantization_config and repacks one layer's tensors into
Hibana's int4 layout (`hibana_kernels.quant`), `fp8.py` reads an FP8 layer's codes and scales;
this module puts them into the model: a fused layer of ours (q/k/v, gate/up) takes its
checkpoint layers concatenated along the outputs, and a layer quantized in activation order
keeps that order as an input permutation (`Linear.perm`). MoE experts stored one layer per
expert become int4 stacks (`StackedExperts.set_packed_stacks`); fp8 experts, which the fused-MoE
kernels do not read, are dequantized into the float stacks (`fp8_expert_readers`).
"""

from __future__ import annotations

from typing import Callable

import torch

from hibana_core.errors import CheckpointError
from hibana_core.surgery import fp8
from hibana_core.surgery.formats import QuantFormat, parse_quantization_config, repack_layer

__all__ = ["fp8_expert_readers", "load_packed_layers", "parse_quantization_config"]


def load_packed_layers(module: torch.nn.Module, names: set[str], read: Callable[[str], torch.Tensor],
                       fmt: QuantFormat, fused: dict[str, tuple[str, ...]], where: str,
                       device: torch.device, progress: bool,
                       checkpoint_name: Callable[[str], str] = lambda name: name) -> set[str]:
    """Give every linear layer whose checkpoint tensors are packed its packed weight; return the
    checkpoint names consumed. `fused`: a layer of ours -> the checkpoint layers it concatenates
    along its outputs (e.g. qkv_proj -> q_proj, k_proj, v_proj). A layer is packed exactly when
    its checkpoint holds the format's first tensor (`qweight`, `weight_packed`), or for fp8 a
    weight scale. `device`: where the packed tensors go (the model's, whose dense weights are still
    unallocated, on meta, as the loader calls this); `progress`: a bar of the layers read (a 70B
    checkpoint's take minutes, before the weights' own bar); `checkpoint_name`: the checkpoint's
    name of a tensor of ours (a multimodal checkpoint's language_model.model.* for our model.*)."""
    if fmt.kind == "fp8":
        return _load_fp8_layers(module, names, read, fmt, fused, where, device, progress)
    first = fmt.tensor_names[0]
    consumed: set[str] = set()
    for name, layer, parts in _bar(_linear_layers(module, fused), progress, "packed layers"):
        present = [f"{p}.{first}" in names for p in parts]
        if not any(present):
            continue
        if not all(present):
            raise CheckpointError(f"{where}: {name} joins {', '.join(parts)}, of which only some are quantized; "
                                  "Hibana computes them as one layer and needs them alike")
        # the config names modules as the checkpoint does (vLLM maps its patterns so) or as the model
        # does; a layer either name says is quantized is
        unquantized = [p for p in parts if not fmt.is_quantized(p)
                       and not fmt.is_quantized(checkpoint_name(f"{p}.{first}").removesuffix(f".{first}"))]
        if unquantized:
            raise CheckpointError(f"{where}: {unquantized[0]} is stored packed, and the quantization_config says it "
                                  "is not quantized (modules_to_not_convert, a dynamic '-:' pattern, lm_head or "
                                  "modules_in_block_to_quantize); the config and the weights disagree: re-export it")
        repacked = []
        for prefix in parts:
            tensors = {s: read(f"{prefix}.{s}") for s in fmt.tensor_names if f"{prefix}.{s}" in names}
            repacked.append(repack_layer(fmt, tensors, f"{where}: {prefix}"))
            consumed |= {f"{prefix}.{s}" for s in tensors}
            if getattr(layer, "bias", None) is None:
                consumed |= _zero_bias(prefix, names, read, where)
        groups = {r.group_size for r in repacked}
        perms = [r.perm for r in repacked]
        if len(groups) != 1 or any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0]))
                                   for p in perms):
            raise CheckpointError(f"{where}: {', '.join(parts)} are quantized with different groups or input "
                                  f"orders; Hibana computes them as one layer ({name}) and needs them alike")
        expected = tuple(layer.weight.shape)
        qweight = torch.cat([r.qweight for r in repacked])
        if (qweight.shape[0], 2 * qweight.shape[1]) != expected:
            raise CheckpointError(f"{where}: {name} unpacks to {qweight.shape[0]}x{2 * qweight.shape[1]}, "
                                  f"the config implies {expected[0]}x{expected[1]}; config and weights disagree")
        layer.set_packed("int4", {"qweight": qweight.to(device),
                                  "scales": torch.cat([r.scales for r in repacked]).to(device),
                                  "zeros": torch.cat([r.zeros for r in repacked]).to(device)},
                         groups.pop(), None if perms[0] is None else perms[0].to(device))
    return consumed | _load_packed_experts(module, names, read, fmt, where, device, progress)


def _bar(items, progress: bool, what: str):
    """`items` (listed) under a loading bar of their own, below the load's stages."""
    from hibana_core.progress import bar

    return bar(list(items), desc=f"hibana: {what}", unit="layer", disable=not progress, leave=False)


def _zero_bias(prefix: str, names: set[str], read: Callable[[str], torch.Tensor], where: str) -> set[str]:
    """`{prefix}.bias` where the checkpoint stores one for a layer of ours without a bias: AutoGPTQ
    writes zeros beside every packed layer, which change nothing (consumed); any other value the
    model would need (a CheckpointError)."""
    name = f"{prefix}.bias"
    if name not in names:
        return set()
    if torch.count_nonzero(read(name)):
        raise CheckpointError(f"{where}: {name} is not zero, and this model's {prefix} has no bias (config.json "
                              "says so: attention_bias / mlp_bias); the config and the weights disagree")
    return {name}


# the checkpoint layers of each expert that a stack of ours joins along its outputs (hibana_core.models.moe)
_EXPERT_STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _load_packed_experts(module: torch.nn.Module, names: set[str], read: Callable[[str], torch.Tensor],
                         fmt: QuantFormat, where: str, device: torch.device, progress: bool) -> set[str]:
    """The MoE experts a GPTQ / AWQ checkpoint stores packed (`{experts}.{e}.gate_proj.qweight`,
    ...) as int4 stacks (`set_packed_stacks`); return the checkpoint names consumed. The fused-MoE
    kernels take one group size per stack and no input permutation, so experts quantized in
    activation order are refused."""
    first = fmt.tensor_names[0]
    consumed: set[str] = set()
    stacks = [(name, m) for name, m in module.named_modules() if hasattr(m, "checkpoint_views") and m.has_float_stacks]
    for name, experts in _bar(stacks, progress and any(f"{name}.0.gate_proj.{first}" in names for name, _ in stacks),
                              "packed experts"):
        count = experts.gate_up_proj.shape[0]
        parts = {stack: [[f"{name}.{e}.{p}" for p in own] for e in range(count)] for stack, own in _EXPERT_STACKS.items()}
        present = [f"{p}.{first}" in names for per_expert in parts.values() for ps in per_expert for p in ps]
        if not any(present):
            continue
        if not all(present):
            raise CheckpointError(f"{where}: the experts of {name} are quantized only in part; Hibana computes "
                                  "them as stacks and needs every expert's layers alike")
        packed = {}
        for stack, per_expert in parts.items():
            repacked = []
            for prefixes in per_expert:
                layers = []
                for prefix in prefixes:
                    tensors = {s: read(f"{prefix}.{s}") for s in fmt.tensor_names if f"{prefix}.{s}" in names}
                    layers.append(repack_layer(fmt, tensors, f"{where}: {prefix}"))
                    consumed |= {f"{prefix}.{s}" for s in tensors} | _zero_bias(prefix, names, read, where)
                repacked += [layers]
            flat = [r for layers in repacked for r in layers]
            if any(r.perm is not None for r in flat) or len({r.group_size for r in flat}) != 1:
                raise CheckpointError(f"{where}: the experts of {name} are quantized in activation order or with "
                                      "different group sizes; Hibana's MoE kernels take contiguous groups of one size")
            packed[stack] = {part: torch.stack([torch.cat([getattr(r, part) for r in layers]) for layers in repacked])
                             for part in ("qweight", "scales", "zeros")}
            expected = tuple(getattr(experts, stack).shape)
            got = packed[stack]["qweight"].shape
            if (got[0], got[1], 2 * got[2]) != expected:
                raise CheckpointError(f"{where}: the experts of {name} unpack to {got[0]}x{got[1]}x{2 * got[2]} for "
                                      f"{stack}, the config implies {'x'.join(map(str, expected))}; config and weights disagree")
        experts.set_packed_stacks("int4", {stack: {part: t.to(device) for part, t in tensors.items()}
                                           for stack, tensors in packed.items()})
    return consumed


def _linear_layers(module: torch.nn.Module, fused: dict[str, tuple[str, ...]]):
    """(name, layer, the checkpoint layers it joins) for each dense linear layer of `module`."""
    for name, layer in module.named_modules():
        if not hasattr(layer, "set_packed") or layer.kind != "dense":
            continue
        parent, _, own = name.rpartition(".")
        yield name, layer, [f"{parent}.{p}" if parent else p for p in fused.get(own, (own,))]


def _load_fp8_layers(module: torch.nn.Module, names: set[str], read: Callable[[str], torch.Tensor],
                     fmt: QuantFormat, fused: dict[str, tuple[str, ...]], where: str,
                     device: torch.device, progress: bool) -> set[str]:
    """load_packed_layers for FP8 checkpoints: codes and scales kept, fused layers joined by
    `fp8.fuse`; a layer is fp8 exactly when its checkpoint holds a weight scale."""
    kv = sorted(n for n in names if n.endswith(fp8.KV_SCALES))
    if kv:
        raise fp8.kv_cache_error(f"{where} holds {', '.join(kv[:3])}{' ...' if len(kv) > 3 else ''}")
    consumed: set[str] = set()
    for name, layer, parts in _bar(_linear_layers(module, fused), progress, "fp8 layers"):
        scales = [fp8.scale_name(fmt.method, p, names) for p in parts]
        if all(s is None for s in scales):
            continue
        if any(s is None for s in scales):
            raise CheckpointError(f"{where}: {name} joins {', '.join(parts)}, of which only some are fp8; "
                                  "Hibana computes them as one layer and needs them alike")
        expected = tuple(layer.weight.shape)
        weights = []
        for prefix, scale in zip(parts, scales):
            if f"{prefix}.weight" not in names:
                raise CheckpointError(f"{where}: {prefix} has a {scale} but no weight; the checkpoint is incomplete")
            weights.append(fp8.read_layer(read(f"{prefix}.weight"), read(f"{prefix}.{scale}"), fmt.block,
                                          f"{where}: {prefix}"))
            consumed |= {f"{prefix}.weight", f"{prefix}.{scale}"}
            consumed |= {f"{prefix}.{u}" for u in fp8.UNUSED if f"{prefix}.{u}" in names}
        shapes = [tuple(w.qweight.shape) for w in weights]
        if any(k != expected[1] for _, k in shapes) or sum(n for n, _ in shapes) != expected[0]:
            raise CheckpointError(f"{where}: {', '.join(parts)} have shapes {shapes}, the config implies "
                                  f"{expected[0]}x{expected[1]} for {name}; config and weights disagree")
        w = fp8.fuse(weights)
        layer.set_packed("fp8", {"qweight": w.qweight.to(device), "scales": w.scales.to(device)}, block=w.block)
    return consumed


def fp8_expert_readers(module: torch.nn.Module, names: set[str], read: Callable[[str], torch.Tensor],
                       fmt: QuantFormat, where: str) -> tuple[dict[str, Callable[[], torch.Tensor]], set[str]]:
    """For an FP8 checkpoint's MoE experts (`{experts}.{e}.gate_proj.weight` with a weight scale):
    checkpoint weight name -> a reader of that weight dequantized to float32, which the loader
    copies into the float expert stacks in place of the codes. The fused-MoE kernels read float,
    int8, int4 and MXFP4 experts, not fp8: the experts take the compute dtype's bytes (the dense
    layers keep their fp8 codes). Also the names those readers read beside the weights (the
    scales), and the static activation scales they leave unused."""
    from hibana_kernels.quant import dequantize_fp8

    def reader(prefix: str, scale: str) -> Callable[[], torch.Tensor]:
        def dequantized() -> torch.Tensor:
            w = fp8.read_layer(read(f"{prefix}.weight"), read(f"{prefix}.{scale}"), fmt.block, f"{where}: {prefix}")
            return dequantize_fp8(w.qweight, w.scales, w.block, torch.float32)
        return dequantized

    readers: dict[str, Callable[[], torch.Tensor]] = {}
    beside: set[str] = set()
    for name, experts in module.named_modules():
        if not hasattr(experts, "checkpoint_views") or not experts.has_float_stacks:
            continue
        for view in experts.checkpoint_views(name):  # {name}.{e}.{gate,up,down}_proj.weight
            prefix = view.removesuffix(".weight")
            scale = fp8.scale_name(fmt.method, prefix, names)
            if scale is not None and view in names:
                readers[view] = reader(prefix, scale)
                beside |= {f"{prefix}.{s}" for s in (scale, *fp8.UNUSED) if f"{prefix}.{s}" in names}
    return readers, beside
