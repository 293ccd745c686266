"""Dequantizing linear layers: Triton kernels with the signatures of `hibana_kernels.quant`.

One kernel serves int8 (per-channel scales) and int4 (group-wise scales and zeros), at any
number of rows. Each program owns BLOCK_N output features and BLOCK_M rows and walks K in tiles:
it loads the packed weight tile once, dequantizes it in registers (int4: two codes a byte, the
group's scale and zero gathered per element) and accumulates in float32.

    decode (rows <= 4):   no tensor cores; the product is a broadcast multiply and a sum over K,
                          so the weight is streamed once and nothing is padded to 16 rows
    batches (rows > 4):   tl.dot on tiles of 16+ rows, the dequantized weight rounded to the
                          input's dtype first (as the reference does: F.linear on the
                          dequantized weight in x's dtype), then multiplied in tf32, which holds
                          bf16 and fp16 values exactly

int8's per-channel scale is applied once, to the finished row, not to every weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_ROWS = 4


@triton.jit
def _qlinear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn,
                    stride_ym, GROUP: tl.constexpr, INT4: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DOT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, m_mask = offs_n < N, offs_m < M
    rows_n = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        if INT4:
            byte = tl.load(q_ptr + rows_n * stride_qn + offs_k[None, :] // 2, mask=w_mask, other=0).to(tl.int32)
            code = (byte >> ((offs_k[None, :] % 2) * 4)) & 0xF
            group = offs_k[None, :] // GROUP
            scale = tl.load(s_ptr + rows_n * stride_sn + group, mask=w_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + rows_n * stride_sn + group, mask=w_mask, other=0.0).to(tl.float32)
            w = (code.to(tl.float32) - zero) * scale  # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(q_ptr + rows_n * stride_qn + offs_k[None, :], mask=w_mask, other=0).to(tl.float32)
        if DOT:
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # the weight rounded to x's dtype, as the reference has it; tf32 holds both exactly
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    if not INT4:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            group_size: int, bias: torch.Tensor | None, int4: bool) -> torch.Tensor:
    k = x.shape[-1]
    n = qweight.shape[0]
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    dot = m > GEMV_ROWS
    if dot:
        block_m, block_n, block_k = (16 if m <= 16 else 32 if m <= 32 else 64), 64, 64
    else:
        block_m, block_n, block_k = triton.next_power_of_2(m), 32, 128
    if int4 and group_size % 2:
        raise ValueError(f"int4 group_size must be even, got {group_size}")
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _qlinear_kernel[grid](
        x2, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, y,
        m, n, k, x2.stride(0), qweight.stride(0), scales.stride(0) if int4 else 0, y.stride(0),
        GROUP=max(group_size, 1), INT4=int4, HAS_BIAS=bias is not None, DOT=dot,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4)
    return y.reshape(*x.shape[:-1], n)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(x, qweight, scales, None, 0, bias, int4=False)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(x, qweight, scales, zeros, group_size, bias, int4=True)
