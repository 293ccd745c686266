"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors int4) loaded as they are.

`formats.py` reads each format's quantization_config and repacks one layer's tensors into
Hibana's int4 layout (`hibana_kernels.quant`); this module puts them into the model: a fused
layer of ours (q/k/v, gate/up) takes its checkpoint layers concatenated along the outputs, and a
layer quantized in activation order keeps that order as an input permutation (`Linear.perm`).
"""

from __future__ import annotations

from typing import Callable

import torch

from hibana_core.errors import CheckpointError
from hibana_core.surgery.formats import QuantFormat, parse_quantization_config, repack_layer

__all__ = ["load_packed_layers", "parse_quantization_config"]


def load_packed_layers(module: torch.nn.Module, names: set[str], read: Callable[[str], torch.Tensor],
                       fmt: QuantFormat, fused: dict[str, tuple[str, ...]], where: str) -> set[str]:
    """Give every linear layer whose checkpoint tensors are packed its packed weight; return the
    checkpoint names consumed. `fused`: a layer of ours -> the checkpoint layers it concatenates
    along its outputs (e.g. qkv_proj -> q_proj, k_proj, v_proj). A layer is packed exactly when
    its checkpoint holds the format's first tensor (`qweight`, `weight_packed`)."""
    first = fmt.tensor_names[0]
    consumed: set[str] = set()
    for name, layer in module.named_modules():
        if not hasattr(layer, "set_packed") or layer.kind != "dense":
            continue
        parent, _, own = name.rpartition(".")
        parts = [f"{parent}.{p}" if parent else p for p in fused.get(own, (own,))]
        present = [f"{p}.{first}" in names for p in parts]
        if not any(present):
            continue
        if not all(present):
            raise CheckpointError(f"{where}: {name} joins {', '.join(parts)}, of which only some are quantized; "
                                  "Hibana computes them as one layer and needs them alike")
        repacked = []
        for prefix in parts:
            tensors = {s: read(f"{prefix}.{s}") for s in fmt.tensor_names if f"{prefix}.{s}" in names}
            repacked.append(repack_layer(fmt, tensors, f"{where}: {prefix}"))
            consumed |= {f"{prefix}.{s}" for s in tensors}
        groups = {r.group_size for r in repacked}
        perms = [r.perm for r in repacked]
        if len(groups) != 1 or any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0]))
                                   for p in perms):
            raise CheckpointError(f"{where}: {', '.join(parts)} are quantized with different groups or input "
                                  f"orders; Hibana computes them as one layer ({name}) and needs them alike")
        device, expected = layer.weight.device, tuple(layer.weight.shape)
        qweight = torch.cat([r.qweight for r in repacked])
        if (qweight.shape[0], 2 * qweight.shape[1]) != expected:
            raise CheckpointError(f"{where}: {name} unpacks to {qweight.shape[0]}x{2 * qweight.shape[1]}, "
                                  f"the config implies {expected[0]}x{expected[1]}; config and weights disagree")
        layer.set_packed("int4", {"qweight": qweight.to(device),
                                  "scales": torch.cat([r.scales for r in repacked]).to(device),
                                  "zeros": torch.cat([r.zeros for r in repacked]).to(device)},
                         groups.pop(), None if perms[0] is None else perms[0].to(device))
    return consumed
