"""SiLU-and-multiply: Triton kernel, same signature as `hibana_kernels.activation`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hibana_kernels import pdl, quant_triton
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.quant_triton import quantize_a8_blocks

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr, q_ptr=None, d_ptr=None, A8_ORDER: tl.constexpr = -1):
    """silu(gate) * up of BLOCK columns of a row; A8_ORDER >= 0: also as int8 codes per block of 32
    (BLOCK a multiple of 32: `quant_triton.quantize_a8_blocks` on what this program wrote)."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch rounds silu(gate) to the activations' dtype before the product
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * INTER + offs, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)
    if A8_ORDER >= 0:
        tl.debug_barrier()
        quantize_a8_blocks(out_ptr + row * INTER, q_ptr + row * (INTER // 4), d_ptr + row * (INTER // 16),
                           tl.program_id(1) * (BLOCK // 32), INTER, BLOCK // 32, A8_ORDER)


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
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, BLOCK))](
            x, out, x.stride(0), INTER=inter, BLOCK=BLOCK, q_ptr=q, d_ptr=d, A8_ORDER=order, num_warps=4,
            **pdl.launch_args(x.device))
    return out, q, d
