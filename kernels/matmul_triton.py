"""Linear layers at batch 1: a Triton GEMV, same signatures as `hibana_kernels.matmul`.

At one row (a single agent decoding) a linear layer is a pass over its weight and nothing else:
the time is the weight's bytes over memory bandwidth, and cuBLAS reaches 59-80% of it on the
4096-wide layers of an 8B model. Each program owns BLOCK_N output features and streams their rows
of W (contiguous along K) in tiles as wide as the row allows, so all its loads are in flight at
once; the input row stays in the caches; accumulation is in float32 and the output is rounded
once, as cuBLAS does. The kernel is correct for a few rows too (the tests run it so), but from two
rows on cuBLAS wins and gets them, as it gets float32 (the exactness path).

The GEMV can also compute its input from the kernel's output before it (`hibana_kernels.fusion`
says where): silu(gate) * up of a gate/up projection, or the RMSNorm of x + residual, each
program re-deriving the row it needs (the statistic over the whole row first) with the roundings
of the separate kernels, so the fused result is theirs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hibana_kernels import activation, fusion, norm_triton, pdl
from hibana_kernels.activation_triton import silu_and_mul
from hibana_kernels.pdl import wait_for_previous

MAX_ROWS = 1  # rows the GEMV takes; measured in bench/notes_decode.md


@triton.jit
def _silu_mul(x_rows, offs_k, mask, K):
    """silu(gate) * up of a [gate | up] row tile, rounded as `_silu_and_mul_kernel` does."""
    gate = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)
    up = tl.load(x_rows + K + offs_k[None, :], mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up.to(tl.float32)).to(gate.dtype)


GLU_SILU = tl.constexpr(1)
GLU_GELU_TANH = tl.constexpr(2)
GLU_CODES = {"silu": GLU_SILU.value, "gelu_tanh": GLU_GELU_TANH.value}
"""The GEMVs' GLU constexpr by activation (0: none): the output is act(gate) * up of a fused
gate/up weight."""


@triton.jit
def _output_rows(pid, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """A program's weight rows and their mask. With a GLU epilogue (N the output's width, the
    weight [gate | up] 2N rows) it owns BLOCK_N // 2 features, gate row f and up row N + f of
    each interleaved (row 2j + h: gate for h = 0, up for 1), so the pairs meet in registers."""
    r = tl.arange(0, BLOCK_N)
    if GLU:
        feature = pid * (BLOCK_N // 2) + r // 2
        return feature + (r % 2) * N, feature < N
    rows = pid * BLOCK_N + r
    return rows, rows < N


@triton.jit
def _tanh(u):
    """tanh in float32 through exp (libdevice's is not in the interpreter): within a few ulps of
    tanhf in absolute terms, which is all 1 + tanh(u) sees."""
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * u))


@triton.jit
def _store_output(y_ptr, acc, pid, offs_m, m_mask, stride_ym, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """The float32 sums `acc` [BLOCK_M, BLOCK_N] (bias added) rounded to y's dtype and stored;
    with a GLU epilogue, act(gate) * up of each interleaved pair with the roundings of the
    separate kernels: the gate/up output rounded, silu (or torch's tanh gelu) rounded, the
    product rounded (`_silu_and_mul_kernel`; torch's gelu then mul)."""
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    if GLU:
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [acc.shape[0], BLOCK_N // 2, 2]))
        if GLU == GLU_SILU:
            act = gate / (1.0 + tl.exp(-gate))
        else:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), torch's order
            act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))))
        out = act.to(dtype).to(tl.float32) * up
        offs_n = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        out = acc
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out.to(dtype),
             mask=m_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _weight_tile(w_rows, offs_k, n_mask, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None], other=0.0)
    return tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, w, x_rows, offs_k, m_mask, K, EVEN_K: tl.constexpr, SILU_INPUT: tl.constexpr):
    """acc + the products of one weight tile with its input tile."""
    if EVEN_K:
        x_mask = m_mask[:, None]
    else:
        x_mask = m_mask[:, None] & (offs_k < K)[None, :]
    if SILU_INPUT:
        x = _silu_mul(x_rows, offs_k, x_mask, K)
    else:
        x = tl.load(x_rows + offs_k[None, :], mask=x_mask, other=0.0)
    return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SILU_INPUT: tl.constexpr,
                 TILES: tl.constexpr, PDL: tl.constexpr, GLU: tl.constexpr = 0):
    # SILU_INPUT: x rows are [gate | up], 2 * K wide; the product's input is silu(gate) * up.
    # TILES (1-4, K <= TILES * BLOCK_K): the row's steps written out, their loads issued together
    # (a row that is not a power of two long, e.g. 3072, without the masked lanes of one wider
    # tile); 0: a loop over K. GLU (see GLU_CODES): y [M, N] = act(gate) * up of a [2N, K] weight.
    pid = tl.program_id(0)
    rows, n_mask = _output_rows(pid, N, BLOCK_N, GLU)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TILES > 0:  # the row in TILES steps, every step's load out before the wait and the first product
        w0 = _weight_tile(w_rows, offs_k, n_mask, K, EVEN_K)
        if TILES > 1:
            w1 = _weight_tile(w_rows, BLOCK_K + offs_k, n_mask, K, EVEN_K)
        if TILES > 2:
            w2 = _weight_tile(w_rows, 2 * BLOCK_K + offs_k, n_mask, K, EVEN_K)
        if TILES > 3:
            w3 = _weight_tile(w_rows, 3 * BLOCK_K + offs_k, n_mask, K, EVEN_K)
        wait_for_previous(PDL)
        acc = _accumulate(acc, w0, x_rows, offs_k, m_mask, K, EVEN_K, SILU_INPUT)
        if TILES > 1:
            acc = _accumulate(acc, w1, x_rows, BLOCK_K + offs_k, m_mask, K, EVEN_K, SILU_INPUT)
        if TILES > 2:
            acc = _accumulate(acc, w2, x_rows, 2 * BLOCK_K + offs_k, m_mask, K, EVEN_K, SILU_INPUT)
        if TILES > 3:
            acc = _accumulate(acc, w3, x_rows, 3 * BLOCK_K + offs_k, m_mask, K, EVEN_K, SILU_INPUT)
    else:
        w = _weight_tile(w_rows, offs_k, n_mask, K, EVEN_K)  # the first tile's load goes out before the wait
        wait_for_previous(PDL)
        acc = _accumulate(acc, w, x_rows, offs_k, m_mask, K, EVEN_K, SILU_INPUT)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            acc = _accumulate(acc, _weight_tile(w_rows, offs_k, n_mask, K, EVEN_K), x_rows, offs_k, m_mask, K,
                              EVEN_K, SILU_INPUT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_output(y_ptr, acc, pid, offs_m, m_mask, stride_ym, N, BLOCK_N, GLU)


@triton.jit
def _stream_tile(x_ptr, res_ptr, offs_m, offs_k, mask, stride_xm, stride_rm,
                 HAS_RESIDUAL: tl.constexpr):
    """x + residual over one row tile, rounded to x's dtype as torch's add (x alone without)."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _normed_tile(s, inv_rms, nw_ptr, offs_k, k_mask, UNIT_OFFSET: tl.constexpr):
    """The RMSNorm of a row tile given its scale, rounded as `_rms_norm_kernel` does: to the
    input dtype, then times the weight (of that dtype) and rounded again; UNIT_OFFSET (Gemma's):
    times 1 + weight in float32, rounded once."""
    nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return ((s.to(tl.float32) * inv_rms[:, None]) * (1.0 + nw[None, :])).to(s.dtype).to(tl.float32)
    normed = (s.to(tl.float32) * inv_rms[:, None]).to(s.dtype).to(tl.float32)
    return (nw[None, :] * normed).to(s.dtype).to(tl.float32)


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, eps,
                      M, N, K, stride_xm, stride_rm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                      ONE_TILE: tl.constexpr, PDL: tl.constexpr, GLU: tl.constexpr = 0,
                      UNIT_OFFSET: tl.constexpr = False):
    """y = rms_norm(x + residual) @ W^T + b (GLU: act(gate) * up of it, y [M, N] of a [2N, K]
    weight; UNIT_OFFSET: Gemma's norm); program 0 also writes x + residual [M, K]."""
    pid = tl.program_id(0)
    rows, n_mask = _output_rows(pid, N, BLOCK_N, GLU)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ONE_TILE:  # the whole row in one tile: the weight's load goes out before the norm's work
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = (offs_k < K) | EVEN_K  # EVEN_K: a mask the compiler sees is all true
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        wait_for_previous(PDL)
        mask = m_mask[:, None] & k_mask[None, :]
        s = _stream_tile(x_ptr, res_ptr, offs_m, offs_k, mask, stride_xm, stride_rm, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(res_out_ptr + offs_m[:, None] * K + offs_k[None, :], s, mask=mask)
        sf = s.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(sf * sf, 1) / K + eps)
        x = _normed_tile(s, inv_rms, nw_ptr, offs_k, k_mask, UNIT_OFFSET)
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:  # the statistic in a first pass over the row, from the caches
        wait_for_previous(PDL)
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (offs_k < K)[None, :]
            sf = _stream_tile(x_ptr, res_ptr, offs_m, offs_k, mask, stride_xm, stride_rm,
                              HAS_RESIDUAL).to(tl.float32)
            sumsq += tl.sum(sf * sf, 1)
        inv_rms = tl.rsqrt(sumsq / K + eps)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = (offs_k < K) | EVEN_K
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            mask = m_mask[:, None] & k_mask[None, :]
            s = _stream_tile(x_ptr, res_ptr, offs_m, offs_k, mask, stride_xm, stride_rm, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if pid == 0:
                    tl.store(res_out_ptr + offs_m[:, None] * K + offs_k[None, :], s, mask=mask)
            x = _normed_tile(s, inv_rms, nw_ptr, offs_k, k_mask, UNIT_OFFSET)
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_output(y_ptr, acc, pid, offs_m, m_mask, stride_ym, N, BLOCK_N, GLU)


def _whole_rows_config(n: int, k: int) -> tuple[int, int, int]:
    """The first rule (2026-11-30, qwen3-8b's shapes before PDL): rows up to 4096 long in one tile
    of two rows (every load of a program in flight at once), longer rows in 2048-wide steps over
    four. The norm-then-GEMV kernel keeps it (its one-tile path reads the row once)."""
    if k <= 4096:
        return 2, triton.next_power_of_2(k), 4
    return 4, 2048, 4


def _by_grid_config(n: int, k: int) -> tuple[int, int, int]:
    """The rule of the 2026-12-03 sweep (H200, PDL on, `tune_decode.py --gemv-sweep-only --focused`
    at eight presets' shapes, bench/RESULTS.md): large grids (gate_up, lm_head) read whole rows
    (four of a program from 65,536 rows on); the rest own four rows and step 1024 inputs at a time
    up to 3072 (qwen3-30b-a3b's qkv 8.2 -> 6.3 us, phi4-mini's 12.2 -> 9.7) and 2048 up to 4096;
    rows longer than 4096 step 4096 (qwen3-8b's down 31.7 -> 28.4 us, gemma3-12b's 39.1 -> 35.8).
    Layers of fewer than 2048 rows and at most 4096 inputs keep whole rows (qwen3-0.6b's o: its
    decode 2.8% slower in four rows a program)."""
    if k > 4096:
        return 4, 4096, 4
    if n < 2048:  # under 512 programs of four rows: two-row programs over whole rows keep the SMs busier
        return _whole_rows_config(n, k)
    if n >= 20000:
        return (4 if n >= 65536 else 2), triton.next_power_of_2(k), 4
    if k <= 3072:
        return 4, min(1024, triton.next_power_of_2(k)), 4
    return 2, 2048, 4


GEMV_RULES = {"whole_rows": _whole_rows_config, "by_grid": _by_grid_config}
_gemv_rule = "by_grid"
_norm_gemv_tiles: tuple[int, int, int] | None = None  # the norm-then-GEMV's tiles, if not _whole_rows_config's


@contextlib.contextmanager
def using_norm_gemv_tiles(tiles: tuple[int, int, int]) -> Iterator[None]:
    """The norm-then-GEMV kernel on these (BLOCK_N, BLOCK_K, num_warps) inside the block, for every
    shape (bench/tune_decode.py compares whole models)."""
    global _norm_gemv_tiles
    previous, _norm_gemv_tiles = _norm_gemv_tiles, tiles
    try:
        yield
    finally:
        _norm_gemv_tiles = previous


@contextlib.contextmanager
def using_gemv_rule(name: str) -> Iterator[None]:
    """gemv_config by another of GEMV_RULES inside the block (bench/tune_decode.py compares them)."""
    global _gemv_rule
    if name not in GEMV_RULES:
        raise ValueError(f"no GEMV rule {name!r}: one of {', '.join(GEMV_RULES)}")
    previous, _gemv_rule = _gemv_rule, name
    try:
        yield
    finally:
        _gemv_rule = previous


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product (see GEMV_RULES)."""
    return GEMV_RULES[_gemv_rule](n, k)


def silu_gemv_config(k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for the GEMV that applies silu(gate) * up to its input: each
    program recomputes the activation over its whole input row, so it owns more rows and runs
    more warps than the plain GEMV. H200, `tune_decode.py --fusion` (results/
    tune_decode_fusion_qwen3-0.6b_19c7f60.json): qwen3-0.6b's down (K 3072) 4.80 us at (4, 4096, 8)
    against 5.58 at the plain GEMV's (2, 4096, 4); qwen3-8b's (K 12288) 28.0 at (8, 2048, 8)
    against 34.9 at (4, 2048, 4)."""
    if k <= 4096:
        return 4, triton.next_power_of_2(k), 8
    return 8, 2048, 8


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as [rows, k] with unit stride along k (a view where it can be)."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _glu_width(n: int, block_n: int, glu: str | None) -> int:
    """The output's width: n, or with a GLU epilogue n // 2 of a [gate | up] weight's n rows
    (its programs then own block_n // 2 features each)."""
    if glu is None:
        return n
    if glu not in GLU_CODES:
        raise ValueError(f"unknown GLU activation {glu!r}: one of {', '.join(GLU_CODES)}")
    if n % 2 or block_n < 2:
        raise ValueError(f"a GLU epilogue takes an even number of weight rows and two or more a program "
                         f"(rows {n}, BLOCK_N {block_n})")
    return n // 2


def linear_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  block_n: int, block_k: int, num_warps: int, num_stages: int = 1,
                  silu_input: bool = False, unroll: bool = False, glu: str | None = None) -> torch.Tensor:
    """The GEMV with its tiles chosen by the caller (the tuning script sweeps them).
    `silu_input`: x is a gate/up output [..., 2 * K] and the product's input silu(gate) * up.
    `unroll`: the row's steps (at most 4) written out, all their loads issued before the first
    product, instead of a loop. `glu` ("silu", "gelu_tanh"): the weight is a fused [gate | up]
    [2I, K] and the output act(gate) * up [..., I], the activation in the GEMV's epilogue."""
    n, k = weight.shape
    tiles = triton.cdiv(k, block_k) if unroll else 0
    if tiles > 4:
        raise ValueError(f"unroll takes rows of at most 4 steps: K {k} is {tiles} steps of {block_k}")
    width = _glu_width(n, block_n, glu)
    x2 = _rows(x, 2 * k if silu_input else k)
    m = x2.shape[0]
    y = torch.empty((m, width), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, width, k, x2.stride(0),
        weight.stride(0), y.stride(0), BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_K=k > 0 and k % block_k == 0,
        SILU_INPUT=silu_input, TILES=tiles, GLU=GLU_CODES.get(glu, 0), num_warps=num_warps, num_stages=num_stages,
        **pdl.launch_args(x.device, "gemv", triton.cdiv(n, block_n)))
    return y.view(*x.shape[:-1], width)


def rms_norm_linear_launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                           eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                           block_n: int, block_k: int, num_warps: int, glu: str | None = None,
                           unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm-then-GEMV kernel with its tiles chosen by the caller (tests, tuning); `glu` as
    `linear_launch`'s; `unit_offset`: Gemma's norm."""
    n, k = weight.shape
    width = _glu_width(n, block_n, glu)
    x2 = _rows(x, k)
    res2 = x2 if residual is None else _rows(residual, k)
    m = x2.shape[0]
    y = torch.empty((m, width), dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, res2, norm_weight, weight, bias if bias is not None else weight, y, res_out, eps,
        m, width, k, x2.stride(0), res2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, EVEN_K=k > 0 and k % block_k == 0,
        ONE_TILE=k <= block_k, GLU=GLU_CODES.get(glu, 0), UNIT_OFFSET=unit_offset, num_warps=num_warps,
        **pdl.launch_args(x.device, "gemv", triton.cdiv(n, block_n)))
    return y.view(*x.shape[:-1], width), res_out


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """One bf16/fp16 row of x's [..., k] against a weight of its dtype with unit stride along K."""
    rows = x.numel() // k if k else 0
    return (0 < rows <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(-1) == 1)


def _activated(gate_up: torch.Tensor, glu: str | None) -> torch.Tensor:
    """The separate activation after a gate/up GEMV (None: the GEMV's output as it is)."""
    if glu is None:
        return gate_up
    return silu_and_mul(gate_up) if glu == "silu" else activation.gelu_tanh_and_mul(gate_up)


def folds_glu(x: torch.Tensor, weight: torch.Tensor, glu: str) -> bool:
    """Whether the gate/up GEMV of x takes its activation in (`linear(..., glu=)`): one row the
    GEMV takes, where the fusion policy takes the activation at the layer's width."""
    return _gemv_takes(x, weight, weight.shape[1]) and fusion.policy().glu_linear(weight.shape[0] // 2, glu)


def _inside(glu: str | None, n: int, block_n: int) -> str | None:
    """The GLU a one-row GEMV of n weight rows, BLOCK_N a program, takes in under the policy
    (None: none, or it is applied after: also where a program owns fewer than a gate/up pair)."""
    return glu if glu is not None and block_n >= 2 and fusion.policy().glu_linear(n // 2, glu) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           glu: str | None = None) -> torch.Tensor:
    """See `hibana_kernels.matmul.linear`."""
    if not _gemv_takes(x, weight, x.shape[-1]):
        return _activated(F.linear(x, weight, bias), glu)
    n, k = weight.shape
    tiles = gemv_config(1, n, k)
    inside = _inside(glu, n, tiles[0])
    return _activated(linear_launch(x, weight, bias, *tiles, glu=inside), None if inside else glu)


def folds_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether `rms_norm_linear` of x (and a residual of its shape and dtype) runs as one launch."""
    k = weight.shape[1]
    return _gemv_takes(x, weight, k) and fusion.policy().norm_linear(k) and norm_weight.dtype == x.dtype


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    glu: str | None = None, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.matmul.rms_norm_linear`: one launch for one row where the fusion
    policy takes the layer's width, else the norm kernel and `linear`."""
    n, k = weight.shape
    if (folds_norm(x, weight, norm_weight)
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))):
        tiles = _norm_gemv_tiles or _whole_rows_config(n, k)
        inside = _inside(glu, n, tiles[0])
        y, residual = rms_norm_linear_launch(x, residual, norm_weight, eps, weight, bias, *tiles, glu=inside,
                                             unit_offset=unit_offset)
        return _activated(y, None if inside else glu), residual
    if residual is None:
        return linear(norm_triton.rms_norm(x, norm_weight, eps, unit_offset), weight, bias, glu), x
    normed, residual = norm_triton.fused_add_rms_norm(x, residual, norm_weight, eps, unit_offset)
    return linear(normed, weight, bias, glu), residual


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """See `hibana_kernels.matmul.silu_and_mul_linear`: one launch for one row where the fusion
    policy takes the layer's width, else `silu_and_mul` and `linear`."""
    n, k = weight.shape
    if gate_up.shape[-1] == 2 * k and _gemv_takes(gate_up, weight, 2 * k) and fusion.policy().silu_linear(k):
        return linear_launch(gate_up, weight, bias, *silu_gemv_config(k), silu_input=True)
    return linear(silu_and_mul(gate_up), weight, bias)
