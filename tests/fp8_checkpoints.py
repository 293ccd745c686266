"""Tiny FP8 checkpoints with the real layouts, written from the formats' own conventions
(independent of Hibana's loader), beside a float checkpoint of the dequantized weights that the
FP8 one must compute exactly.

    scheme         config                                       per quantized layer
    fp8            quant_method "fp8", weight_block_size        weight e4m3 [N, K], weight_scale_inv
                   [bn, bk] (transformers' FineGrainedFP8)      float32 [ceil(N/bn), ceil(K/bk)]
    fp8-tensor     quant_method "fp8", no block                 weight, weight_scale_inv float32 []
    autofp8        quant_method "fp8", activation_scheme        weight, weight_scale float32 [],
                   "static", ignored_layers (AutoFP8, vLLM)     input_scale float32 []
    ue8m0          scale_fmt "ue8m0"                            weight_scale_inv float8_e8m0fnu
    ct-channel     compressed-tensors float-quantized,          weight, weight_scale bf16 [N, 1]
                   FP8_DYNAMIC (channel weights, token acts)
    ct-tensor      FP8 (tensor weights, static tensor acts)     weight, weight_scale [1], input_scale [1]
    ct-block       FP8_BLOCK (block_structure [bn, bk])         weight, weight_scale [ceil(N/bn), ceil(K/bk)]
    ct-group       weight-only group strategy, naive-quantized  weight, weight_scale [N, K / g]

The quantizer is transformers' Fp8Quantize convention: a block's scale is amax / 448 (the e4m3
maximum), codes are w / scale clamped to +-448 and cast to e4m3; the scale is stored (rounded to
the scheme's dtype first, as llm-compressor stores scales in the model's dtype), and the weight
the checkpoint defines is float(code) * float(stored scale).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
SCHEMES = ("fp8", "fp8-tensor", "autofp8", "ue8m0", "ct-channel", "ct-tensor", "ct-block", "ct-group")


def quantize(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32):
    """w [N, K] in blocks of (bn, bk) (partial at the ends) -> (codes e4m3 [N, K], scales
    [ceil(N/bn), ceil(K/bk)] in scale_dtype, the dequantized weight float32 [N, K])."""
    n, k = w.shape
    bn, bk = block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float()
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    if scale_dtype == torch.float8_e8m0fnu:  # ue8m0: the next power of two, so no code overflows
        scales = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / FP8_MAX))).to(scale_dtype)
    full = scales.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]  # [N, K]
    codes = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scales, codes.float() * full


def _config(scheme: str, block: tuple[int, int], skip: list[str]) -> dict:
    if scheme in ("fp8", "ue8m0"):
        cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": list(block), "modules_to_not_convert": skip}
        return {**cfg, "scale_fmt": "ue8m0"} if scheme == "ue8m0" else cfg
    if scheme == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": skip}
    if scheme == "autofp8":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": skip}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
               "block_structure": None, "strategy": scheme.removeprefix("ct-"), "observer": "minmax"}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    fmt = "float-quantized"
    if scheme == "ct-tensor":
        inputs = {**inputs, "dynamic": False, "strategy": "tensor", "observer": "static_minmax"}
    elif scheme == "ct-block":
        weights["block_structure"] = list(block)
        inputs = {**inputs, "strategy": "group", "group_size": block[1]}
    elif scheme == "ct-group":
        weights["group_size"] = block[1]
        inputs, fmt = None, "naive-quantized"  # weight-only: llm-compressor's fallback format
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": skip, "kv_cache_scheme": None}


def _layer(scheme: str, w: torch.Tensor, block: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One layer's checkpoint tensors (by suffix) and its dequantized weight."""
    n, k = w.shape
    per_tensor = scheme in ("fp8-tensor", "autofp8", "ct-tensor")
    shape = {"ct-channel": (1, k), "ct-group": (1, block[1])}.get(scheme, (n, k) if per_tensor else block)
    dtype = {"ue8m0": torch.float8_e8m0fnu, "ct-channel": torch.bfloat16, "ct-group": torch.bfloat16}
    codes, scales, dequantized = quantize(w, shape, dtype.get(scheme, torch.float32))
    if scheme in ("fp8-tensor", "autofp8"):
        scales = scales.reshape(())  # transformers' and AutoFP8's per-tensor scale is a scalar
    elif scheme == "ct-tensor":
        scales = scales.reshape(1)
    name = "weight_scale_inv" if scheme in ("fp8", "fp8-tensor", "ue8m0") else "weight_scale"
    tensors = {"weight": codes, name: scales}
    if scheme == "autofp8":
        tensors["input_scale"] = torch.tensor(0.02)
    if scheme == "ct-tensor":
        tensors["input_scale"] = torch.tensor([0.02])
    return tensors, dequantized


def write_fp8_checkpoint(src: Path, dst: Path, scheme: str, block: tuple[int, int] = (16, 16),
                         quantize_head: bool = False, seed: int = 0, linears: tuple[str, ...] = LINEARS,
                         skip: tuple[str, ...] = ()) -> Path:
    """`src` (a float tiny checkpoint) -> `dst` with its decoder linears (`linears`: the layers'
    names; and the output head if `quantize_head`) in fp8 `scheme`, the modules in `skip` listed
    as not converted; returns the float checkpoint of the dequantized weights (dst's sibling),
    which dst must compute exactly."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {SCHEMES}")
    shutil.copytree(src, dst)
    reference = dst.parent / f"{dst.name}-dequantized"
    shutil.copytree(src, reference)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, dict(tensors)
    gen = torch.Generator().manual_seed(seed)
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not (any(prefix.endswith(p) for p in linears) or (quantize_head and prefix == "lm_head")) \
                or not name.endswith(".weight"):
            quantized[name] = w
            continue
        w = w * (1 + 0.5 * torch.rand(w.shape, generator=gen))  # uneven magnitudes: blocks differ
        layer, dequantized[name] = _layer(scheme, w, block)
        quantized.update({f"{prefix}.{suffix}": t for suffix, t in layer.items()})
    for path, weights in ((dst, quantized), (reference, dequantized)):
        (path / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(scheme, block, list(skip) + ([] if quantize_head else ["lm_head"]))
    (dst / "config.json").write_text(json.dumps(config))
    return reference
