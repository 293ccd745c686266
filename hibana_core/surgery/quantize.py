"""Weight-only quantization into the packed layouts of `hibana_kernels.quant`.

int8: per output channel, symmetric, round to nearest.
int4: per group of inputs, asymmetric, with two calibration-free improvements over min/max
rounding (no data needed, so it runs at load time on any checkpoint):
  1. clipping search: each group's range is shrunk by the ratio (from 1.0 down to 0.75) that
     minimises the group's squared reconstruction error, as AWQ's clip search does without
     activations;
  2. zero refinement (the half-quadratic idea of HQQ, in its L2 form): with the codes fixed, the
     zero point that minimises the squared error is the mean of (code - w / scale) over the
     group; codes and zero are refined in turn a few times. Zeros stay fractional (stored as
     float16), which the kernels take as they are.
"""

from __future__ import annotations

import torch

from hibana_kernels.quant import pack_int4

CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(11))  # 1.0 ... 0.75
ZERO_STEPS = 3
_CHUNK_ELEMENTS = 1 << 24  # rows are quantized in chunks of about this many weights


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dense [N, K] -> {"qweight": int8 [N, K], "scales": float32 [N]}, in chunks of rows (an
    output head of 150k x 4k weights would take 12 bytes a weight in float32 temporaries at once)."""
    n, k = weight.shape
    q = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        w = weight[start:start + step].float()
        s = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q[start:start + step] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        scales[start:start + step] = s
    return {"qweight": q, "scales": scales}


def quantize_stacked(weights: torch.Tensor, bits: int, group_size: int = 0,
                     clip: bool = True) -> dict[str, torch.Tensor]:
    """Stacked [E, N, K] (an MoE layer's experts) -> quantize_int8's or quantize_int4's tensors,
    each stacked over the E experts; one expert at a time (a float32 copy of one expert, not of
    all E, is the peak)."""
    parts = [quantize_int8(w) if bits == 8 else quantize_int4(w, group_size, clip) for w in weights]
    return {name: torch.stack([part[name] for part in parts]) for name in parts[0]}


def group_size_for(in_features: int, wanted: int) -> int | None:
    """The largest even group size <= `wanted` that divides `in_features` (None: none does)."""
    for g in range(min(wanted, in_features), 1, -1):
        if g % 2 == 0 and in_features % g == 0:
            return g
    return None


def quantize_int4(weight: torch.Tensor, group_size: int, clip: bool = True) -> dict[str, torch.Tensor]:
    """Dense [N, K] -> {"qweight": uint8 [N, K // 2], "scales", "zeros": float16 [N, K // g]}."""
    n, k = weight.shape
    rows = max(1, _CHUNK_ELEMENTS // k)
    parts = [_quantize_int4_rows(weight[i:i + rows], group_size, clip) for i in range(0, n, rows)]
    return {name: torch.cat([p[name] for p in parts]) for name in ("qweight", "scales", "zeros")}


def _quantize_int4_rows(weight: torch.Tensor, group_size: int, clip: bool) -> dict[str, torch.Tensor]:
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    best = None
    for ratio in CLIP_RATIOS if clip else (1.0,):
        scale, zero = _range_to_affine(low * ratio, high * ratio)
        err = _error(w, scale, zero)
        if best is None:
            best = [err, scale, zero]
        else:
            better = err < best[0]
            for i, value in enumerate((err, scale, zero)):
                best[i] = torch.where(better, value, best[i])
    _, scale, zero = best
    scale = scale.half().float()
    for _ in range(ZERO_STEPS):
        codes = _codes(w, scale, zero)
        zero = (codes - w / scale[..., None]).mean(dim=-1).half().float()
    codes = _codes(w, scale, zero)
    return {"qweight": pack_int4(codes.view(n, k)), "scales": scale.half(), "zeros": zero.half()}


def _range_to_affine(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = low.clamp(max=0), high.clamp(min=0)  # the range holds 0: zero weights stay exact-ish
    scale = ((high - low) / 15).clamp(min=2 ** -14)  # float16 normal range: stored scales stay > 0
    return scale, torch.round(-low / scale)


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15)


def _error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    codes = _codes(w, scale, zero)
    return ((codes - zero[..., None]) * scale[..., None] - w).square().sum(dim=-1)
