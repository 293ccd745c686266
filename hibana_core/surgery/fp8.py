"""FP8 checkpoints -> Hibana's fp8 layers: the e4m3 codes as stored, a float32 scale per block.

Two families write them (K = in_features, N = out_features; every format defines
w[n, k] = float(weight[n, k]) * scale[n // bn, k // bk], the last block of a row or column
possibly partial):

    transformers "fp8"  weight            float8_e4m3fn [N, K]
                        weight_scale_inv  float32 [ceil(N / bn), ceil(K / bk)] for
                                          weight_block_size [bn, bk]; a multiplier despite its
                                          name; scale_fmt "ue8m0": float8_e8m0fnu (or its bytes
                                          as uint8), powers of two
                        per tensor (no weight_block_size): one scale, named weight_scale_inv
                        (transformers) or weight_scale (AutoFP8, vLLM)
                        activation_scale / input_scale: static activation scales, unused here
    compressed-tensors  weight            float8_e4m3fn [N, K]
    "float-quantized"   weight_scale      the model's dtype: strategy "tensor" [1], "channel"
    (or "naive-")                         [N, 1], "group" [N, K / g], "block" [ceil(N / bn),
                                          ceil(K / bk)] for block_structure [bn, bk]
                        input_scale: the static activation scale of llm-compressor's FP8 scheme

Sources: transformers integrations/finegrained_fp8.py (`FP8Linear` parameters,
`Fp8Dequantize._dequantize_one` and `_dequantize_fp8_weight`: q * s broadcast per block) and
utils/quantization_config.py `FineGrainedFP8Config`; vLLM model_executor/layers/quantization/fp8.py
(`Fp8Config.from_config`, `Fp8LinearMethod.create_weights`: per-tensor `weight_scale`, block
`weight_scale_inv`); AutoFP8 auto_fp8/quantize.py (`per_tensor_quantize` stores the inverse scale
as weight_scale); compressed-tensors compressors/naive_quantized/base.py (weight, weight_scale)
and quantization/lifecycle/forward_helpers.py (`_dequantize`: x_q * scale; `_process_block`,
`_process_group`), quantization/quant_scheme.py (FP8, FP8_DYNAMIC, FP8_BLOCK).

Hibana computes weight-only: activations stay in the compute dtype, whatever activation scheme
(dynamic, static) the checkpoint was calibrated for, so its output is the dequantized weights'
(w8a16), not the W8A8 model's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hibana_core.errors import CheckpointError

SUPPORTED = ("FP8 e4m3 weights: transformers 'fp8' (weight_block_size blocks or per tensor, float or "
             "ue8m0 scales) and compressed-tensors 'float-quantized' (tensor, channel, group or block "
             "strategy, static symmetric weights)")

SCALES = {"fp8": ("weight_scale_inv", "weight_scale"), "compressed-tensors": ("weight_scale",)}
"""Per format, the names a layer's weight scale may have (exactly one is present)."""
UNUSED = ("input_scale", "activation_scale")
"""Static activation scales: a weight-only layer has no use for them."""
KV_SCALES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale", ".output_scale")
"""Checkpoint tensors of a quantized KV cache (vLLM, AutoFP8, compressed-tensors)."""


class Fp8Weight(NamedTuple):
    """One linear layer in the layout of `kernels.quant.dequantize_fp8` / `linear_fp8`."""

    qweight: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32 [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int]  # (bn, bk)


# ----------------------------------------------------------------------------------- config


def parse_fp8(cfg: dict) -> tuple[tuple[int, int], tuple[str, ...] | None]:
    """transformers' (and vLLM's, AutoFP8's) "fp8" quantization_config -> (block, the names of
    modules left unconverted or None). Block (0, 0): one scale per tensor."""
    fmt = str(cfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise CheckpointError(f"fp8 checkpoint with fmt {cfg.get('fmt')!r}: Hibana loads e4m3 weights only; "
                              f"supported: {SUPPORTED}")
    if str(cfg.get("scale_fmt", "float")).lower() not in ("float", "ue8m0"):
        raise CheckpointError(f"fp8 scale_fmt {cfg.get('scale_fmt')!r} is not supported; Hibana reads "
                              "'float' and 'ue8m0' scales")
    if cfg.get("modules_to_convert"):
        raise CheckpointError(f"fp8 checkpoint converts {cfg['modules_to_convert']} beyond the linear "
                              "layers (fp8 embeddings), which Hibana does not load")
    if str(cfg.get("expert_dtype", "fp8")).lower() != "fp8":
        raise CheckpointError(f"fp8 checkpoint with expert_dtype {cfg.get('expert_dtype')!r}: fp4 experts "
                              "are not supported")
    if cfg.get("kv_cache_scheme"):
        raise kv_cache_error("fp8 quantization_config has a kv_cache_scheme")
    block = cfg.get("weight_block_size")
    if block is None:
        block = (0, 0)
    elif (not isinstance(block, (list, tuple)) or len(block) != 2
          or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"fp8 weight_block_size {block!r} is not two positive integers")
    skip = cfg.get("modules_to_not_convert")
    if skip is None:  # vLLM's and AutoFP8's name; transformers reads it as an alias too
        skip = cfg.get("ignored_layers")
    return tuple(block), skip


def ct_block(weights, what: str) -> tuple[int, int]:
    """A compressed-tensors scheme's 8-bit float weights (QuantizationArgs) -> their block
    (0: the whole dimension), or CheckpointError."""
    strategy = str(getattr(weights.strategy, "value", weights.strategy))
    if not weights.symmetric or weights.dynamic:
        raise CheckpointError(f"{what}: fp8 weights that are {'asymmetric' if not weights.symmetric else 'dynamic'} "
                              f"are not supported; supported: {SUPPORTED}")
    if strategy == "tensor":
        return (0, 0)
    if strategy == "channel":
        return (1, 0)
    if strategy == "group" and weights.group_size and weights.group_size > 0:
        return (1, weights.group_size)
    if strategy == "block" and weights.block_structure and len(weights.block_structure) == 2:
        return tuple(int(b) for b in weights.block_structure)
    raise CheckpointError(f"{what}: fp8 weights with strategy {strategy!r} are not supported; "
                          f"supported: {SUPPORTED}")


def kv_cache_error(what: str) -> CheckpointError:
    return CheckpointError(f"{what}: the checkpoint quantizes the KV cache (fp8 KV scales), which Hibana "
                           "does not load (kv_dtype='fp8', the kv8 pass, gives an fp8 KV cache with "
                           f"Hibana's own scales). Supported: {SUPPORTED}, without KV-cache quantization")


# ----------------------------------------------------------------------------------- layers


def scale_name(method: str, prefix: str, names: set[str]) -> str | None:
    """The name of layer `prefix`'s weight scale in the checkpoint, or None: not stored fp8."""
    present = [s for s in SCALES[method] if f"{prefix}.{s}" in names]
    if len(present) > 1:
        raise CheckpointError(f"{prefix} has both {' and '.join(present)}; the checkpoint is damaged")
    return present[0] if present else None


def read_layer(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> Fp8Weight:
    """One layer's checkpoint `weight` and its scale -> Fp8Weight, the block's zeros (whole
    dimension) made concrete. `name` is used in error messages."""
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{name}: weight is {weight.dtype}; Hibana loads float8_e4m3fn (e4m3) weights "
                              "(not e5m2, not AMD's e4m3fnuz)")
    if weight.dim() != 2:
        raise CheckpointError(f"{name}: weight has shape {list(weight.shape)}, expected [out_features, in_features]")
    n, k = weight.shape
    bn, bk = block[0] or n, block[1] or k
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    accepted = [grid] + ([(grid[0],)] if grid[1] == 1 else []) + ([(), (1,)] if grid == (1, 1) else [])
    if tuple(scale.shape) not in accepted:
        raise CheckpointError(f"{name}: weight scale has shape {list(scale.shape)}, expected {list(grid)} for "
                              f"a {n}x{k} weight in blocks of {bn}x{bk}; config and weights disagree")
    if scale.dtype == torch.uint8:  # ue8m0 exponents as bytes (transformers' Fp8Dequantize reads them so)
        scale = torch.exp2(scale.float() - 127.0).masked_fill(scale == 255, float("nan"))
    elif not scale.dtype.is_floating_point:
        raise CheckpointError(f"{name}: weight scale is {scale.dtype}, not a float")
    scale = scale.float().reshape(grid)  # exact from any float dtype a checkpoint uses
    if not torch.isfinite(scale).all():
        raise CheckpointError(f"{name}: weight scales are not finite; the checkpoint is damaged")
    return Fp8Weight(weight.contiguous(), scale.contiguous(), (bn, bk))


def fuse(parts: list[Fp8Weight]) -> Fp8Weight:
    """Layers fused along N (q/k/v, gate/up) as one Fp8Weight. Their scales concatenate as they
    are when the parts share a block and every part but the last fills whole blocks of rows;
    otherwise each part's scales expand to one row per output (block (1, bk), bk the parts'
    common divisor of block widths): exact, at 4 / bk bytes per weight byte. A per-tensor scale
    thus becomes per-channel, and 128x128 blocks over parts whose N is no multiple of 128 stay
    loadable (vLLM refuses those)."""
    if len(parts) == 1:
        return parts[0]
    qweight = torch.cat([p.qweight for p in parts])
    blocks = {p.block for p in parts}
    if len(blocks) == 1:
        ((bn, bk),) = blocks
        if all(p.qweight.shape[0] % bn == 0 for p in parts[:-1]):
            return Fp8Weight(qweight, torch.cat([p.scales for p in parts]), (bn, bk))
    bk = math.gcd(*(p.block[1] for p in parts))
    return Fp8Weight(qweight, torch.cat([_per_row(p, bk) for p in parts]), (1, bk))


def _per_row(part: Fp8Weight, bk: int) -> torch.Tensor:
    """part's scales as [N, ceil(K / bk)], bk dividing part's block width."""
    n, k = part.qweight.shape
    rows = part.scales.repeat_interleave(part.block[0], dim=0)[:n]  # [N, ceil(K / part bk)]
    columns = torch.arange(math.ceil(k / bk)) * bk // part.block[1]  # each inside one old block
    return rows[:, columns.to(rows.device)]
