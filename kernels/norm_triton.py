"""RMSNorm: Triton kernels, same signatures as `hibana_kernels.norm`. One program per row; with x's
int8 codes (`rms_norm_a8`) a row's blocks of codes over several."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hibana_kernels import pdl, quant_triton
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.quant_triton import a8_block_columns, store_a8_blocks


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, stride_x, stride_res,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, CAST_LAST: tl.constexpr, PDL: tl.constexpr):
    """A row's (x + residual) and its RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    wait_for_previous(PDL)
    x = _with_residual(x_ptr + row * stride_x, res_ptr + row * stride_res, offs, mask, HAS_RESIDUAL)
    inv_rms = _inv_rms(x, eps, N)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    out = _normed(x, inv_rms, tl.load(w_ptr + offs, mask=mask, other=0.0), UNIT_OFFSET, CAST_LAST)
    tl.store(out_ptr + row * N + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _with_residual(x_row, res_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual) at offs, the sum rounded as torch's x + residual."""
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_row + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _inv_rms(x, eps, N: tl.constexpr):
    """1 / rms of a whole row x (zero past its N columns)."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)


@triton.jit
def _normed(x, inv_rms, w, UNIT_OFFSET: tl.constexpr, CAST_LAST: tl.constexpr):
    """x's RMSNorm in float32 (x in its own dtype, w the norm weight at x's columns)."""
    xf, w = x.to(tl.float32), w.to(tl.float32)
    if UNIT_OFFSET:  # Gemma: (1 + w) in float32, one rounding at the end
        return (xf * inv_rms) * (1.0 + w)
    if CAST_LAST:  # gpt-oss: w in float32, one rounding at the end
        return w * (xf * inv_rms)
    return w * (xf * inv_rms).to(x.dtype).to(tl.float32)  # HF: back to the input dtype first


@triton.jit
def _rms_norm_a8_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, d_ptr, eps, stride_x, stride_res,
                        N: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                        UNIT_OFFSET: tl.constexpr, CAST_LAST: tl.constexpr, ORDER: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (row, chunk): `_rms_norm_kernel`'s output at x's blocks chunk * BLOCKS onward, and
    those blocks as int8 codes (`quant_triton.store_a8_blocks`) for the x int8 GEMV that takes the
    row next. Every program of a row reads the whole row for its scale (from L2: a few KB) and
    computes its own blocks' values at the columns the codes' order wants, so no program waits on
    another and none re-reads what it wrote."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x_row, res_row = x_ptr + row * stride_x, res_ptr + row * stride_res
    wait_for_previous(PDL)
    inv_rms = _inv_rms(_with_residual(x_row, res_row, offs, mask, HAS_RESIDUAL), eps, N)
    blocks, col = a8_block_columns(tl.program_id(1) * BLOCKS, BLOCKS, ORDER)
    cmask = (blocks < N // 32)[:, None, None, None]
    x = _with_residual(x_row, res_row, col, cmask, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * N + col, x, mask=cmask)
    out = _normed(x, inv_rms, tl.load(w_ptr + col, mask=cmask, other=0.0), UNIT_OFFSET,
                  CAST_LAST).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + col, out, mask=cmask)
    store_a8_blocks(out.to(tl.float32), blocks, q_ptr + row * (N // 4), d_ptr + row * (N // 16), N)


# blocks of 32 columns an `_rms_norm_a8_kernel` program writes: H100, qwen3-8b w4 batch 1 at 512 keys, graph
# replay (bench/step_gaps.py, two runs each): 128 (one program a row) 2.51 ms, 32 2.42, 16 2.35, 8 2.29,
# 4 2.25-2.27, 2 2.27, 1 2.27; w8 3.40 at 16, 8 and 4 alike. (SiLU-and-mul's 32, 8 or 4: the same.)
A8_NORM_BLOCKS = 4


def _launch(x, residual, weight, eps, unit_offset, cast_last, a8_order=-1):
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
    out_dtype = x.dtype if unit_offset or cast_last else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    rows = x2.shape[0]
    q, d = quant_triton.a8_codes(rows, n, x.device) if a8_order >= 0 else (out, out)
    if rows:
        block = triton.next_power_of_2(n)
        common = dict(N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
                      CAST_LAST=cast_last, num_warps=min(max(block // 256, 1), 8))
        if a8_order < 0:
            _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, eps, x2.stride(0), res2.stride(0), **common,
                                      **pdl.launch_args(x.device))
        else:
            grid = (rows, triton.cdiv(n // quant_triton.A8_BLOCK, A8_NORM_BLOCKS))
            _rms_norm_a8_kernel[grid](x2, res2, weight, out, res_out, q, d, eps, x2.stride(0), res2.stride(0),
                                      BLOCKS=A8_NORM_BLOCKS, ORDER=a8_order, **common,
                                      **pdl.launch_args(x.device, "other", grid[0] * grid[1]))
    return (out, res_out) if a8_order < 0 else (out, res_out, q, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             cast_last: bool = False) -> torch.Tensor:
    """See `hibana_kernels.norm.rms_norm`."""
    return _launch(x, None, weight, eps, unit_offset, cast_last)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, unit_offset: bool = False,
                       cast_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.norm.fused_add_rms_norm`."""
    return _launch(x, residual, weight, eps, unit_offset, cast_last)


def rms_norm_a8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                unit_offset: bool, order: int,
                cast_last: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual, q, d): `fused_add_rms_norm` (`rms_norm` without a residual:
    x itself second) whose launch also writes the normed rows as `quant_triton.quantize_a8` would
    in `order` (x's width a multiple of 32)."""
    if x.shape[-1] % quant_triton.A8_BLOCK:
        raise ValueError(f"rows of {x.shape[-1]} are no whole number of blocks of {quant_triton.A8_BLOCK}")
    out, res_out, q, d = _launch(x, residual, weight, eps, unit_offset, cast_last, order)
    return out, (x if residual is None else res_out), q, d
