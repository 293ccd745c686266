"""RMSNorm: Triton kernels, same signatures as `hibana_kernels.norm`. One program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hibana_kernels import pdl, quant_triton
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.quant_triton import quantize_a8_blocks


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, stride_x, stride_res,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr, q_ptr=None, d_ptr=None,
                     A8_ORDER: tl.constexpr = -1):
    """A row's (x + residual) and its RMSNorm; A8_ORDER >= 0: also the normed row as int8 codes
    per block of 32 (`quant_triton.quantize_a8_blocks`, re-read after a barrier: the writes of this
    program are visible to it), for the x int8 GEMV that takes it next."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as torch's x + residual
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: (1 + w) in float32, one rounding at the end
        out = (xf * inv_rms) * (1.0 + w)
    else:
        out = w * (xf * inv_rms).to(x.dtype).to(tl.float32)  # HF: back to the input dtype first
    tl.store(out_ptr + row * N + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    if A8_ORDER >= 0:
        tl.debug_barrier()
        quantize_a8_blocks(out_ptr + row * N, q_ptr + row * (N // 4), d_ptr + row * (N // 16), 0, N, BLOCK // 32,
                           A8_ORDER)


def _launch(x, residual, weight, eps, unit_offset, a8_order=-1):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # a view whenever rows are evenly strided
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    res2 = x2
    if residual is not None:
        if residual.dtype != x.dtype or residual.shape != x.shape:
            raise ValueError("fused_add_rms_norm wants x and residual of one shape and dtype")
        res2 = residual.reshape(-1, n)
        if res2.stride(1) != 1:
            res2 = res2.contiguous()
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x2.shape[0]
    q, d = quant_triton.a8_codes(rows, n, x.device) if a8_order >= 0 else (out, out)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, eps, x2.stride(0), res2.stride(0),
                                  N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
                                  UNIT_OFFSET=unit_offset, q_ptr=q, d_ptr=d, A8_ORDER=a8_order,
                                  num_warps=min(max(block // 256, 1), 8), **pdl.launch_args(x.device))
    return (out, res_out) if a8_order < 0 else (out, res_out, q, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """See `hibana_kernels.norm.rms_norm`."""
    return _launch(x, None, weight, eps, unit_offset)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.norm.fused_add_rms_norm`."""
    return _launch(x, residual, weight, eps, unit_offset)


def rms_norm_a8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                unit_offset: bool, order: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual, q, d): `fused_add_rms_norm` (`rms_norm` without a residual:
    x itself second) whose launch also writes the normed rows as `quant_triton.quantize_a8` would
    in `order` (x's width a multiple of 32)."""
    if x.shape[-1] % quant_triton.A8_BLOCK:
        raise ValueError(f"rows of {x.shape[-1]} are no whole number of blocks of {quant_triton.A8_BLOCK}")
    out, res_out, q, d = _launch(x, residual, weight, eps, unit_offset, order)
    return out, (x if residual is None else res_out), q, d
