"""SiLU-and-multiply and the sigmoid gate: Triton kernels, same signatures as `hibana_kernels.activation`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hibana_kernels import pdl, quant_triton
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.quant_triton import a8_block_columns, store_a8_blocks
from hibana_kernels.recurrent_triton import _sigmoid

BLOCK = 1024
A8_SILU_BLOCKS = 32  # blocks of 32 columns an `_silu_and_mul_a8_kernel` program writes


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """silu(gate) * up of BLOCK columns of a row."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    tl.store(out_ptr + row * INTER + offs, _product(x_ptr + row * stride_x, offs, mask, INTER), mask=mask)


@triton.jit
def _product(x_row, offs, mask, INTER: tl.constexpr):
    """silu(gate) * up at columns offs of a row of gate | up, in the activations' dtype."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch rounds silu(gate) to the activations' dtype before the product
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_a8_kernel(x_ptr, out_ptr, q_ptr, d_ptr, stride_x, INTER: tl.constexpr, BLOCKS: tl.constexpr,
                            ORDER: tl.constexpr, PDL: tl.constexpr):
    """`_silu_and_mul_kernel` of BLOCKS blocks of 32 columns of a row, computed at the columns x's
    int8 codes take them in (`quant_triton.a8_block_columns`) and written as those codes too."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    blocks, col = a8_block_columns(tl.program_id(1) * BLOCKS, BLOCKS, ORDER)
    mask = (blocks < INTER // 32)[:, None, None, None]
    out = _product(x_ptr + row * stride_x, col, mask, INTER)
    tl.store(out_ptr + row * INTER + col, out, mask=mask)
    store_a8_blocks(out.to(tl.float32), blocks, q_ptr + row * (INTER // 4), d_ptr + row * (INTER // 16), INTER)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, gate_ptr, out_ptr, stride_gt, stride_gh, D: tl.constexpr, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """x * sigmoid(gate) of BLOCK columns of a row (x and out [T, H * D] contiguous, gate's heads
    strided), rounded as torch's two ops: sigmoid to x's dtype, then the product."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    x = tl.load(x_ptr + row * WIDTH + offs, mask=mask, other=0.0)
    g = tl.load(gate_ptr + row * stride_gt + (offs // D) * stride_gh + offs % D, mask=mask, other=0.0)
    s = _sigmoid(g.to(tl.float32), LIBDEVICE).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * WIDTH + offs, (x.to(tl.float32) * s).to(x.dtype), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """See `hibana_kernels.activation.sigmoid_gate`: x and gate [T, H, D] (gate's last dim
    contiguous, x made so), one launch for torch's gate copy, sigmoid and product."""
    if x.dim() != 3 or gate.shape != x.shape or gate.dtype != x.dtype or gate.stride(2) != 1:
        raise ValueError(f"sigmoid_gate wants x and gate [T, H, D] of one dtype, gate's last dim contiguous; "
                         f"got {tuple(x.shape)} {x.dtype} and {tuple(gate.shape)} {gate.dtype}, strides {gate.stride()}")
    x = x.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty_like(x)
    width = heads * dim
    block = min(BLOCK, triton.next_power_of_2(width))
    if tokens and width:
        _sigmoid_gate_kernel[(tokens, triton.cdiv(width, block))](
            x, gate, out, gate.stride(0), gate.stride(1), D=dim, WIDTH=width, BLOCK=block, LIBDEVICE=x.is_cuda,
            num_warps=4, **pdl.launch_args(x.device))
    return out


@triton.jit
def _add_sigmoid_gated_kernel(base_ptr, gate_ptr, x_ptr, out_ptr, stride_base, stride_gate, stride_x,
                              WIDTH: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                              PDL: tl.constexpr):
    """base + sigmoid(gate) * x of BLOCK columns of a row (gate: one value a row), rounded as
    torch's three ops."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    s = _sigmoid(tl.load(gate_ptr + row * stride_gate).to(tl.float32), LIBDEVICE).to(x.dtype).to(tl.float32)
    scaled = (s * x.to(tl.float32)).to(x.dtype).to(tl.float32)
    base = tl.load(base_ptr + row * stride_base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * WIDTH + offs, (base + scaled).to(x.dtype), mask=mask)


def add_sigmoid_gated(base: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """See `hibana_kernels.activation.add_sigmoid_gated`: one launch for torch's sigmoid, product and sum."""
    if (base.dim() != 2 or x.shape != base.shape or gate.shape != (base.shape[0], 1)
            or not base.dtype == x.dtype == gate.dtype or base.stride(1) != 1 or x.stride(1) != 1):
        raise ValueError(f"add_sigmoid_gated wants base and x [T, H] of one dtype with unit column strides and gate "
                         f"[T, 1]; got {tuple(base.shape)}, {tuple(gate.shape)}, {tuple(x.shape)}")
    tokens, width = base.shape
    out = torch.empty((tokens, width), dtype=x.dtype, device=x.device)
    block = min(BLOCK, triton.next_power_of_2(max(width, 1)))
    if tokens and width:
        _add_sigmoid_gated_kernel[(tokens, triton.cdiv(width, block))](
            base, gate, x, out, base.stride(0), gate.stride(0), x.stride(0), WIDTH=width, BLOCK=block,
            LIBDEVICE=x.is_cuda, num_warps=4, **pdl.launch_args(x.device))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See `hibana_kernels.activation.silu_and_mul`."""
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](
            x, out, x.stride(0), INTER=inter, BLOCK=BLOCK, num_warps=4, **pdl.launch_args(x.device))
    return out


def silu_and_mul_a8(gate_up: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu_and_mul(gate_up), q, d): the launch also writes the product as `quant_triton.quantize_a8`
    would in `order` (the intermediate size a multiple of 32)."""
    inter = gate_up.shape[-1] // 2
    if inter % quant_triton.A8_BLOCK:
        raise ValueError(f"rows of {inter} are no whole number of blocks of {quant_triton.A8_BLOCK}")
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    q, d = quant_triton.a8_codes(x.shape[0], inter, gate_up.device)
    if x.shape[0]:
        _silu_and_mul_a8_kernel[(x.shape[0], triton.cdiv(inter // quant_triton.A8_BLOCK, A8_SILU_BLOCKS))](
            x, out, q, d, x.stride(0), INTER=inter, BLOCKS=A8_SILU_BLOCKS, ORDER=order, num_warps=4,
            **pdl.launch_args(x.device))
    return out, q, d
