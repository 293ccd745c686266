"""Pre-quantized checkpoints (GPTQ, AWQ) loaded as they are, repacked into Hibana's int4 layout.

The formats, as their reference implementations write them (4 bits, groups of G inputs):

    GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"; quant_method "gptq"):
        qweight int32 [K / 8, N]    packed along K: row i holds k = 8i .. 8i + 7, k = 8i + j in
                                    bits 4j .. 4j + 3
        qzeros  int32 [K / G, N / 8] packed along N the same way; v1 stores zero - 1
                                    ("gptq_v2" stores the zero itself)
        scales  fp16  [K / G, N]
        g_idx   int32 [K]           the group of each input (k // G, or a permutation with
                                    desc_act: groups follow the activation order)
    AWQ (AutoAWQ "gemm" version; quant_method "awq"):
        qweight int32 [K, N / 8]    packed along N in the interleaved order [0, 2, 4, 6, 1, 3, 5, 7]:
                                    nibble i of a word holds output 8c + ORDER[i]
        qzeros  int32 [K / G, N / 8] the same packing; zeros as they are
        scales  fp16  [K / G, N]

    both: w[k, n] = (q[k, n] - zero[group(k), n]) * scale[group(k), n]; nn.Linear's weight is w.T

Hibana's layout (`hibana_kernels.quant`) groups contiguous inputs of each output row. A GPTQ
layer quantized in activation order (g_idx not k // G) is stored with its inputs sorted by group:
the layer then reorders its input by `perm` before the product, which gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hibana_core.errors import CheckpointError
from hibana_kernels.quant import pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED = "GPTQ (4-bit, checkpoint_format gptq or gptq_v2) and AWQ (4-bit, version gemm)"


@dataclass(frozen=True)
class QuantFormat:
    method: str                    # "gptq" | "awq"
    bits: int
    group_size: int                # -1: one group over all inputs
    zero_offset: int               # added to stored zeros (GPTQ v1: 1)
    skip: tuple[str, ...] = field(default_factory=tuple)  # module names kept dense


def parse_quantization_config(config: dict[str, Any], where: str) -> QuantFormat:
    method = str(config.get("quant_method", "")).lower()
    bits = config.get("bits", config.get("w_bit"))
    group = config.get("group_size", config.get("q_group_size", 128))
    skip = tuple(config.get("modules_to_not_convert") or ())
    if method not in ("gptq", "awq"):
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported; Hibana loads {SUPPORTED}, "
                              "or quantizes a float checkpoint itself (surgery=['w4'])")
    if bits != 4:
        raise CheckpointError(f"{where}: {method} with {bits} bits is not supported; Hibana loads {SUPPORTED}")
    if not isinstance(group, int) or (group != -1 and (group < 2 or group % 2)):
        raise CheckpointError(f"{where}: group_size {group!r} is not supported (an even size, or -1)")
    if method == "gptq":
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return QuantFormat("gptq", 4, group, 1 if fmt == "gptq" else 0, skip)
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"{where}: AWQ version {version!r} is not supported; Hibana loads the 'gemm' "
                              "packing (re-export with AutoAWQ's default version)")
    if config.get("zero_point", True) is not True:
        raise CheckpointError(f"{where}: AWQ without zero points is not supported")
    return QuantFormat("awq", 4, group, 0, skip)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed along R (8 a word, low bits first) -> [8R, C] in 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [R, 8, C]
    return values.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] packed along C -> [R, 8C] in 0..15; `order[i]`: the column of nibble i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C, 8]: nibble i
    if order is not None:
        values = values[:, :, torch.argsort(torch.tensor(order))]  # -> column order
    return values.reshape(packed.shape[0], -1)


def repack_layer(fmt: QuantFormat, tensors: dict[str, torch.Tensor], where: str):
    """One linear layer's checkpoint tensors -> (qweight uint8 [N, K/2], scales fp16 [N, K/G],
    zeros fp16 [N, K/G], group size, perm [K] or None)."""
    def need(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{where} lacks {name}; the {fmt.method} checkpoint is incomplete")
        return tensors[name]

    qweight, qzeros, scales = need("qweight"), need("qzeros"), need("scales").float()
    if fmt.method == "gptq":
        codes = _unpack_rows(qweight.to(torch.int32))  # [K, N]
        zeros = (_unpack_cols(qzeros.to(torch.int32)) + fmt.zero_offset) & 0xF  # [K/G, N]; v1: zero - 1 stored
    else:
        codes = _unpack_cols(qweight.to(torch.int32), AWQ_ORDER)
        zeros = _unpack_cols(qzeros.to(torch.int32), AWQ_ORDER)
    k, n = codes.shape
    groups = scales.shape[0]
    if scales.shape[1] != n or zeros.shape != (groups, n) or groups == 0 or k % groups:
        raise CheckpointError(f"{where}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                              f"scales {tuple(scales.shape)} do not fit one {fmt.method} layer")
    group = k // groups
    g_idx = tensors.get("g_idx")
    perm = None
    if g_idx is not None and fmt.method == "gptq":
        g_idx = g_idx.long()
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise CheckpointError(f"{where}: g_idx has shape {tuple(g_idx.shape)} or values outside 0..{groups - 1}")
        if not torch.equal(g_idx, torch.arange(k) // group):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], torch.arange(k) // group):
                raise CheckpointError(f"{where}: g_idx does not put {group} inputs in each group")
            codes = codes[perm]
    if group % 2:
        raise CheckpointError(f"{where}: groups of {group} inputs are not supported (an even size)")
    packed = pack_int4(codes.t().contiguous())            # [N, K/2]
    return packed, scales.t().contiguous().half(), zeros.t().contiguous().float().half(), group, perm


_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def load_packed_layers(module: torch.nn.Module, names: set[str], read: Callable[[str], torch.Tensor],
                       fmt: QuantFormat, fused: dict[str, tuple[str, ...]], where: str) -> set[str]:
    """Give every linear layer whose checkpoint tensors are packed its packed weight; return the
    checkpoint names consumed. `fused`: a layer of ours -> the checkpoint layers it concatenates
    along its outputs (e.g. qkv_proj -> q_proj, k_proj, v_proj)."""
    consumed: set[str] = set()
    for name, layer in module.named_modules():
        if not hasattr(layer, "set_packed") or layer.kind != "dense":
            continue
        parent, _, own = name.rpartition(".")
        parts = [f"{parent}.{p}" for p in fused.get(own, (own,))]
        if not all(f"{p}.qweight" in names for p in parts):
            continue
        repacked = []
        for prefix in parts:
            tensors = {s: read(f"{prefix}.{s}") for s in _SUFFIXES if f"{prefix}.{s}" in names}
            repacked.append(repack_layer(fmt, tensors, f"{where}: {prefix}"))
            consumed |= {f"{prefix}.{s}" for s in tensors}
        groups = {r[3] for r in repacked}
        perms = [r[4] for r in repacked]
        if len(groups) != 1 or any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0]))
                                   for p in perms):
            raise CheckpointError(f"{where}: {', '.join(parts)} are quantized with different groups or input "
                                  f"orders; Hibana computes them as one layer ({name}) and needs them alike")
        device, expected = layer.weight.device, tuple(layer.weight.shape)
        qweight = torch.cat([r[0] for r in repacked])
        if (qweight.shape[0], 2 * qweight.shape[1]) != expected:
            raise CheckpointError(f"{where}: {name} unpacks to {qweight.shape[0]}x{2 * qweight.shape[1]}, "
                                  f"the config implies {expected[0]}x{expected[1]}; config and weights disagree")
        layer.set_packed("int4", {"qweight": qweight.to(device),
                                  "scales": torch.cat([r[1] for r in repacked]).to(device),
                                  "zeros": torch.cat([r[2] for r in repacked]).to(device)},
                         groups.pop(), None if perms[0] is None else perms[0].to(device))
    return consumed
