"""Linear layers at batch 1: a Triton GEMV, same signature as `hibana_kernels.matmul`.

At one row (a single agent decoding) a linear layer is a pass over its weight and nothing else:
the time is the weight's bytes over memory bandwidth, and cuBLAS reaches 59-80% of it on the
4096-wide layers of an 8B model. Each program owns BLOCK_N output features and streams their rows
of W (contiguous along K) in tiles as wide as the row allows, so all its loads are in flight at
once; the input row stays in the caches; accumulation is in float32 and the output is rounded
once, as cuBLAS does. The kernel is correct for a few rows too (the tests run it so), but from two
rows on cuBLAS wins and gets them, as it gets float32 (the exactness path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 1  # rows the GEMV takes; measured in bench/notes_decode.md


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product, from the H200 sweep in
    bench/notes_decode.md: rows up to 4096 long in one tile of two rows (every load of a program
    in flight at once), longer rows in 2048-wide steps over four."""
    if k <= 4096:
        return 2, triton.next_power_of_2(k), 4
    return 4, 2048, 4


def linear_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  block_n: int, block_k: int, num_warps: int, num_stages: int = 1) -> torch.Tensor:
    """The GEMV with its tiles chosen by the caller (the tuning script sweeps them)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0),
        weight.stride(0), y.stride(0), BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, num_warps=num_warps,
        num_stages=num_stages)
    return y.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.matmul.linear`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not 0 < rows <= MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16)
            or weight.dtype != x.dtype or weight.stride(-1) != 1):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    return linear_launch(x, weight, bias, *gemv_config(rows, n, k))
