"""The L2 prefetch kernel: asks the L2 for a tensor's bytes and returns; nothing is read into
the SM and nothing is written (`hibana_kernels.l2_prefetch` says when and why).

Two ways to ask, both fire-and-forget:

    lines  `prefetch.global.L2::evict_last`, one 128-byte line an instruction (sm_80 and later)
    bulk   `cp.async.bulk.prefetch.L2.global`, one UNIT-byte run an instruction, handed to the
           multiprocessor's bulk copy engine (sm_90 and later)

Only whole units are asked for (a tensor's last partial unit is left out), so no request reaches
past the tensor. For bulk a unit is a multiple of 16 bytes at a 16-byte aligned address: the
settings check the unit, the launcher the base.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128


@triton.jit(do_not_specialize=["n_units"])
def _l2_prefetch_kernel(base_ptr, n_units, UNIT: tl.constexpr, BLOCK: tl.constexpr, BULK: tl.constexpr):
    """Program p asks for units p * BLOCK, ..., then every grid's worth after; lanes past the
    last unit ask for nothing (their request is predicated off)."""
    first = tl.program_id(0) * BLOCK
    stride = tl.num_programs(0) * BLOCK
    for start in range(first, n_units, stride):
        unit = start + tl.arange(0, BLOCK)
        live = (unit < n_units).to(tl.int32)
        address = base_ptr + tl.minimum(unit, n_units - 1).to(tl.int64) * UNIT
        if BULK:
            size = tl.full([BLOCK], UNIT, tl.int32)
            tl.inline_asm_elementwise(
                "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;"
                "\n\tmov.u32 $0, 0;\n\t}", "=r,l,r,r", [address, size, live], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $2, 0;\n\t@p prefetch.global.L2::evict_last [$1];"
                "\n\tmov.u32 $0, 0;\n\t}", "=r,l,r", [address, live], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(tensor: torch.Tensor, max_bytes: int, bulk: bool, unit: int, programs: int) -> int:
    """Ask the L2 for the first `max_bytes` of contiguous `tensor` on the current stream; returns
    the bytes asked for (0 where the tensor is smaller than one unit or, for bulk, misaligned)."""
    size = LINE if not bulk else unit
    nbytes = min(tensor.numel() * tensor.element_size(), max_bytes)
    n_units = nbytes // size
    if n_units == 0 or not tensor.is_contiguous() or (bulk and tensor.data_ptr() % 16):
        return 0
    block = 128 if bulk else 1024
    grid = (max(1, min(programs, triton.cdiv(n_units, block))),)
    _l2_prefetch_kernel[grid](tensor.view(-1).view(torch.uint8), n_units, UNIT=size, BLOCK=block, BULK=bulk,
                              num_warps=4 if not bulk else 1)
    return n_units * size
