"""Mixture-of-experts layers in Triton, same signatures as `hibana_kernels.moe`.

A layer is routing, then one of two expert paths picked by the number of tokens:

    moe_route      one program per token: top-k of the router logits, the family's weights
    decode path    (up to DECODE_MAX_TOKENS[kind] tokens) one GEMV program per route (token, slot)
                   and tile of the intermediate size computes gate|up and the activation; then
                   the down projections, weighted: one program per token and tile of H summing
                   its k experts, or (DecodeTiles.down_per_route) one per route and tile of H,
                   whose rows `_combine_kernel` sums (k times the programs, a token's k experts
                   read at once rather than one after another). Only the selected experts' rows
                   are read.
    grouped path   `moe_align` sorts the routes by expert into blocks of BLOCK_M rows (each
                   block one expert's, padded); a grouped GEMM over those blocks computes
                   gate|up with the activation fused, a second one the down projection times the
                   routing weight into one row per route, and `_combine_kernel` sums each
                   token's k rows.

            routes t*k+j --moe_align--> [e0 e0 e0 pad | e3 e3 e3 e3 | e3 pad pad pad | e5 ...]
                                         block 0        block 1       block 2         ...
            grouped GEMM: program (block, n tile) reads x rows of its routes and expert e's
            weight tile once for BLOCK_M rows

Dense weights (fp32/bf16/fp16), MXFP4, int8 and int4 weights share the kernels. The grouped GEMM
dequantizes a tile in registers (`_weight_tile`: e2m1 codes, low nibble first, times 2^(e8m0 - 127)
a block of 32; int4 (code - zero) * scale a group; int8 codes, the row's scale times the finished
sum), so weights are read at 4.25, 4 + 32 / group and 8 bits. The decode GEMV (`_gemv`) does not
dequantize weight by weight: at one token every weight costs its own instructions, so the
4-bit formats are read as int32 words of 8 codes and their scales applied once a run of a group
(see `_gemv`; MXFP4's codes go two at a time, `_e2m1_pair_scaled`; with DecodeTiles.a8, not yet
the default, x and the activations are rounded to int8 codes per block of 32 and MXFP4's codes met
in integer dot products, `_gemv_mxfp4_a8`). Accumulation
is in float32; the roundings follow transformers' order (gate|up and the expert's output rounded
to x's dtype before the bias is added, the activation's steps rounded as torch's ops round them,
the weighted output rounded), except that a token's k outputs are summed in float32 and rounded
once, and the decode GEMV does not round int8 and int4 weights to x's dtype one by one (the
reference's dequantization does; the GEMV's sums are as exact or more).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
import triton
import triton.language as tl

from hibana_kernels import counters, fusion, moe, pdl, quant_triton
from hibana_kernels.matmul_triton import _normed_tile, _stream_tile  # the norm-then-GEMV's roundings
from hibana_kernels.moe import ExpertBlocks, MoEExperts
from hibana_kernels.pdl import wait_for_previous
from hibana_kernels.quant_triton import _as_float, _nibble_units, _signed_byte, _unit  # the int GEMVs' bit tricks

DECODE_MAX_TOKENS = {"dense": 4, "mxfp4": 4, "int8": 4, "int4": 4}
"""Tokens the decode path takes, per weight kind (H200, `bench/tune_moe.py --sweep --tokens 1,8`,
2026-12-01, after the int32-word GEMVs and down_per_route): at T=1 decode wins for every kind
(bf16 31 against 52 us, MXFP4 60 against 109, int8 26 against 50, int4 27 against 62); at T=8
the grouped GEMM does (bf16 138 against 148, MXFP4 266 against 342, int8 107 against 117, int4
136 against 141). The crossover between was not swept: 4 for all, where MXFP4's was measured."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATION = {"silu": 0, "swiglu_oai": 1}
_FORMAT = {"dense": 0, "mxfp4": 1, "int8": 2, "int4": 3}
"""The kernels' FORMAT constexpr: how `_weight_tile` reads a weight."""
class DecodeTiles(NamedTuple):
    block_n: int  # output features a program owns (gate_up: BLOCK_N gate rows and BLOCK_N up rows)
    block_k: int  # columns of K a step (MXFP4: a multiple of 32; int4: of 8)
    num_warps: int
    down_per_route: bool = False  # down projection: a program per route, then _combine_kernel (else per token)
    x_vector: bool = False  # 4-bit formats: a word's inputs in vector loads (`_gemv`'s X_VECTOR)
    unroll: bool = False  # 16-bit and int8: rows of at most 4 steps written out (`_gemv`'s TILES), longer ones loop
    direct: bool = False  # MXFP4, bf16 x: codes straight into float32 bits, a block's words a thread (`_gemv`'s DIRECT)
    down: tuple[int, int, int] | None = None  # the down's (block_n, block_k, num_warps), for rows of <= 4 of its steps
    split: int = 1  # split-K: programs a tile's row is shared among (the down projection: with down_per_route)
    a8: bool = False  # MXFP4, 16-bit x: x and the activations as int8 codes per block of 32, dp4a (`_gemv_mxfp4_a8`);
    # where x cannot take them (float32 x, HIBANA_A8_ROWS=0, sizes not whole blocks): FLOAT_TILES


class GroupedTiles(NamedTuple):
    block_m: int  # routes a block (rows of the grouped GEMM)
    block_n: int
    block_k: int  # MXFP4: a multiple of 32
    num_warps: int
    num_stages: int


DECODE_TILES = {
    "dense": DecodeTiles(4, 1024, 8, down_per_route=True, unroll=True, down=(4, 256, 4)),
    "int8": DecodeTiles(16, 256, 4, down_per_route=True),
    "int4": DecodeTiles(8, 512, 2, down_per_route=True),
    "mxfp4": DecodeTiles(2, 1024, 1, down_per_route=True, a8=True),
}
"""The decode path's tiles per weight kind, the fastest of the sweep at T=1 (H200, 2026-12-01,
one MoE layer of Qwen3-30B-A3B / gpt-oss-20b shape, % of 4.8 TB/s of the bytes read): bf16
31.2 us 50.3%, int8 26.2 us 30.1%, int4 27.0 us 15.5%, MXFP4 60.1 us 18.4%. A program per route
for the down projection (then `_combine_kernel`) won for every kind. MXFP4's GEMV decodes two
codes at once since (`_e2m1_pair_scaled`): 50.9 us on a gpt-oss-20b layer at T=1, where one code
at a time took 59.0 and the tensor cores (tl.dot_scaled against x broadcast to 16 columns) 97.1;
at T=8 287.8, 342.5 and 442.3, the grouped path 263.1 (bench/RESULTS.md, 2026-12-01). Since
2026-12-03 (PDL, the sweep's wide tiles): bf16 2 x 1024 in 4 warps, a whole row of the gate|up in
two steps, 28.5 us 55.1% where 8 x 256 took 35.7 us; MXFP4 8 x 256 in one warp 49.1 us (8 x 512
in 2: 52.5); int4 unchanged (25.7 us; its vector-input variant slower at every tile). Since
2026-12-03 (eighteenth session, `tune_moe.py --wide`): bf16 4 x 1024 in 8 warps with the row's
steps written out (`unroll`), 26.5 us 59.3% where 2 x 1024 took 31.8 in the same run; the whole
qwen3-30b-a3b decode step 336.7 -> 359.1 tok/s (`tune_decode.py --fusion --policies
'auto,auto;moe=4x1024x8xu'`). MXFP4 whole-row tiles (1-4 rows of 2048-4096 codes) were 1.1-3.5x
slower than 8 x 256; int8's unrolled tiles 1.1-1.2x slower. Since 2026-12-03 (nineteenth session,
`tune_moe.py --down`): the bf16 down projection on its own tiles, 4 x 256 in 4 warps (its 768-long
rows in three steps written out, where a 1024-wide step left a quarter masked): 28.4 -> 24.8 us a
layer, qwen3-30b-a3b decode 360.2 -> 366.6 tok/s. MXFP4's direct GEMV (`_gemv`'s DIRECT, 4.8-5.3
instructions a weight against 5.9) was no faster: 46.6 us at best (4 x 1024, 2 warps) against 49.0,
and gpt-oss-20b's decode 9% slower at 4 or 8 x 1024 in one warp; the fp16 pairs stay. Split-K
(twenty-first session, `tune_moe.py --split`): MXFP4 8 x 256 split in 2-4 48.3-51.8 us against 49.0
unsplit, the whole gpt-oss-20b decode 436.8 -> 439.6 tok/s at best: no split by default. Since
2026-12-04 (twenty-third session, `run_h200.sh moe_a8`): MXFP4 against int8 x (`a8`, dp4a), 2 x 1024
in one warp, 33.1 us a gpt-oss-20b layer at T=1 where 8 x 256 on 16-bit x took 49.4; the whole
gpt-oss-20b decode 438.3 -> 521.3 tok/s (8 x 256 a8: 442.0, 4 x 1024 in 2 warps: 497.9-502.0,
4 x 512: 504.7). float32 x keeps the float GEMV, on its own tiles (`FLOAT_TILES`)."""

FLOAT_TILES = {"mxfp4": DecodeTiles(8, 256, 1, down_per_route=True)}
"""The tiles of a kind whose DECODE_TILES are `a8` where x stays in floats: MXFP4's fastest on
16-bit x before a8 (49.1 us a gpt-oss-20b layer at T=1, where a8's 2 x 1024 in one warp would
run the float GEMV a program a route for whole rows)."""


@contextlib.contextmanager
def using_decode_tiles(kind: str, tiles: DecodeTiles) -> Iterator[None]:
    """DECODE_TILES[kind] replaced inside the block (bench/tune_decode.py compares whole models)."""
    previous, DECODE_TILES[kind] = DECODE_TILES[kind], tiles
    try:
        yield
    finally:
        DECODE_TILES[kind] = previous


# ------------------------------------------------------------------------------------- routing


@triton.jit
def _top_k(logits, bias, scale, offs, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr, SCORING: tl.constexpr,
           RENORMALIZE: tl.constexpr):
    """(ids int64 [K_PAD], weights float32 [K_PAD]) of float32 logits [E_PAD] (-inf past E): k
    rounds of argmax (the largest; among equals the lowest index, the experts torch.topk picks on
    CUDA), then the weights (SCORING: `SCORING_CODES`). Softmax is monotone, so the top-k of the
    probabilities is the top-k of the logits, picked exactly on the logits; sigmoid scores pick
    on score + bias [E_PAD] and weigh by the score."""
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    if SCORING == 2:  # sigmoid
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = tl.where(offs < E, scores + bias, -float("inf"))
    else:
        scores = logits
        choice = logits
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        expert = tl.min(tl.where(choice == best, offs, offs.shape[0]), axis=0)
        expert = tl.minimum(expert, E - 1)  # NaN logits match nothing: stay in bounds (the output is NaN)
        ids = tl.where(slots == j, expert.to(tl.int64), ids)
        if SCORING == 2:
            picked = tl.sum(tl.where(offs == expert, scores, 0.0), axis=0)
        else:
            picked = best
        chosen = tl.where(slots == j, picked, chosen)
        choice = tl.where(offs == expert, -float("inf"), choice)
    in_k = slots < TOP_K
    if SCORING == 2:  # the chosen scores, over their sum, times the scale
        weights = chosen
        if RENORMALIZE:
            weights = weights / (tl.sum(tl.where(in_k, weights, 0.0), axis=0) + 1e-20)
        weights = weights * scale
    elif SCORING == 0:  # softmax over all E, then the chosen ones' probabilities
        top = tl.max(logits, axis=0)
        total = tl.sum(tl.where(offs < E, tl.exp(logits - top), 0.0), axis=0)
        weights = tl.exp(chosen - top) / total
        if RENORMALIZE:
            weights = weights / tl.sum(tl.where(in_k, weights, 0.0), axis=0)
    else:  # over the k chosen logits; the first is their largest
        top = tl.max(tl.where(in_k, chosen, -float("inf")), axis=0)
        e = tl.where(in_k, tl.exp(chosen - top), 0.0)
        weights = e / tl.sum(e, axis=0)
    return ids, weights


SCORING_CODES = {"softmax": 0, "topk_softmax": 1, "sigmoid": 2}
"""`hibana_kernels.moe.SCORINGS` -> the kernels' SCORING."""


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, scale, E, stride_t, TOP_K: tl.constexpr,
                  E_PAD: tl.constexpr, K_PAD: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One token's `_route_row`."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    _route_row(logits_ptr + t * stride_t, bias_ptr, scale, ids_ptr + t * TOP_K, weights_ptr + t * TOP_K, E, TOP_K,
               E_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE)


@triton.jit
def _route_row(logits_row, bias_ptr, scale, ids_row, weights_row, E, TOP_K: tl.constexpr, E_PAD: tl.constexpr,
               K_PAD: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
    """A token's E logits (in the model's dtype, or float32) -> its k expert ids and weights
    (`_top_k`; HAS_BIAS: sigmoid scoring's correction bias, float32 [E])."""
    offs = tl.arange(0, E_PAD)
    logits = tl.load(logits_row + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=offs < E, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([E_PAD], dtype=tl.float32)
    ids, weights = _top_k(logits, bias, scale, offs, E, TOP_K, K_PAD, SCORING, RENORMALIZE)
    slots = tl.arange(0, K_PAD)
    tl.store(ids_row + slots, ids, mask=slots < TOP_K)
    tl.store(weights_row + slots, weights, mask=slots < TOP_K)


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
              renormalize: bool = False, correction_bias: torch.Tensor | None = None,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.moe.moe_route`; tied logits pick the lowest expert ids."""
    e = router_logits.shape[-1]
    if (scoring not in moe.SCORINGS or not 1 <= top_k <= e
            or (scoring != "sigmoid" and (correction_bias is not None or scale != 1.0))
            or (correction_bias is not None and tuple(correction_bias.shape) != (e,))):
        return moe.moe_route(router_logits, top_k, scoring=scoring, renormalize=renormalize,
                             correction_bias=correction_bias, scale=scale)  # its error
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    bias = None if correction_bias is None else correction_bias.contiguous()
    t = logits.shape[0]
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, bias if bias is not None else logits, weights, ids, float(scale), e,
                            logits.stride(0), TOP_K=top_k, E_PAD=triton.next_power_of_2(e),
                            K_PAD=triton.next_power_of_2(top_k), SCORING=SCORING_CODES[scoring],
                            HAS_BIAS=bias is not None, RENORMALIZE=renormalize, num_warps=4,
                            **pdl.launch_args(logits.device, "moe"))
    return weights, ids


@triton.jit
def _norm_route_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, h_ptr, res_out_ptr, logits_ptr, counter_ptr,
                       weights_ptr, ids_ptr, eps, E, K, stride_xm, stride_rm, stride_wn,
                       TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SCORING: tl.constexpr,
                       RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """A sparse block's start for token t (program (t, i)): h = rms_norm(x + residual) over the
    whole row (program 0 writes h and x + residual), the router's logits of experts
    [i BLOCK_E, (i + 1) BLOCK_E) over h, rounded to x's dtype; then the last program of the token
    to finish (a CTA barrier and an acq_rel count: `hibana_kernels.counters`) reads all E
    logits and routes them (`_route_row`), and zeroes the count for the next launch."""
    t = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                mask=e_mask[:, None] & k_mask[None, :], other=0.0)  # the router's rows: before the wait
    wait_for_previous(PDL)
    offs_m = tl.arange(0, 1)
    mask = k_mask[None, :]
    s = _stream_tile(x_ptr + t * stride_xm, res_ptr + t * stride_rm, offs_m, offs_k, mask, 0, 0, True)  # [1, K]
    sf = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(sf * sf, 1) / K + eps)
    h = _normed_tile(s, inv_rms, nw_ptr, offs_k, k_mask, False)  # float32 of the rounded (Llama) norm
    if pid == 0:
        tl.store(res_out_ptr + t * K + offs_m[:, None] * K + offs_k[None, :], s, mask=mask)
        tl.store(h_ptr + t * K + offs_m[:, None] * K + offs_k[None, :], h.to(s.dtype), mask=mask)
    logits = tl.sum(h * w.to(tl.float32), axis=1)  # [BLOCK_E]
    if HAS_BIAS:
        logits += tl.load(b_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
    tl.store(logits_ptr + t * E + offs_e, logits.to(s.dtype), mask=e_mask)
    tl.debug_barrier()  # every thread's logits are written before the count releases them
    arrived = tl.atomic_add(counter_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        _route_row(logits_ptr + t * E, logits_ptr, 1.0, ids_ptr + t * TOP_K, weights_ptr + t * TOP_K, E, TOP_K,
                   E_PAD, K_PAD, SCORING, False, RENORMALIZE)
        tl.atomic_xchg(counter_ptr + t, 0, sem="relaxed", scope="gpu")


NORM_ROUTE_MAX_K = 8192
"""Hidden sizes `norm_route` takes in one launch: each program holds the whole row."""
NORM_ROUTE_MAX_TOKENS = 16
"""Rows `norm_route` takes in one launch (an arrival count each: `hibana_kernels.counters`)."""


def norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int, *,
               scoring: str = "softmax", renormalize: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `hibana_kernels.moe.norm_route`: one launch for a few bf16/fp16 rows where the fusion
    policy says (`moe_norm_route`), else the norm, the router's linear and `moe_route`."""
    t, k = x.shape[0] if x.dim() == 2 else -1, x.shape[-1]
    e = router_weight.shape[0]
    takes = (fusion.policy().moe_norm_route and x.dim() == 2 and 0 < t <= NORM_ROUTE_MAX_TOKENS
             and k <= NORM_ROUTE_MAX_K and x.dtype in (torch.bfloat16, torch.float16)
             and residual.shape == x.shape and residual.dtype == x.dtype
             and norm_weight.dtype == x.dtype and router_weight.dtype == x.dtype
             and router_weight.stride(-1) == 1  # read before the PDL wait: never a copy made here
             and scoring in ("softmax", "topk_softmax") and 1 <= top_k <= e)
    if scoring == "sigmoid":
        return moe.norm_route(x, residual, norm_weight, eps, router_weight, router_bias, top_k, scoring=scoring,
                              renormalize=renormalize)  # its error
    if not takes:
        from hibana_kernels import matmul_triton, norm_triton

        h, residual = norm_triton.fused_add_rms_norm(x, residual, norm_weight, eps)
        weights, ids = moe_route(matmul_triton.linear(h, router_weight, router_bias), top_k, scoring=scoring,
                                 renormalize=renormalize)
        return h, residual, weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    h, res_out = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty((t, e), dtype=x.dtype, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=x.device)
    block_e = 2
    _norm_route_kernel[(t, triton.cdiv(e, block_e))](
        x, residual, norm_weight, router_weight, router_bias if router_bias is not None else router_weight,
        h, res_out, logits, counters.counters("norm_route", NORM_ROUTE_MAX_TOKENS, x.device), weights, ids, eps, e,
        k, x.stride(0), residual.stride(0), router_weight.stride(0), TOP_K=top_k, E_PAD=triton.next_power_of_2(e),
        K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
        HAS_BIAS=router_bias is not None, SCORING=SCORING_CODES[scoring], RENORMALIZE=renormalize, num_warps=4,
        **pdl.launch_args(x.device, "moe"))
    return h, res_out, weights, ids


# ----------------------------------------------------------------------------------- alignment


@triton.jit
def _align_kernel(ids_ptr, routes_ptr, block_expert_ptr, N, E, MAX_BLOCKS,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """One program: count the routes per expert, lay out each expert's blocks in id order, then
    place the routes chunk by chunk, each at its expert's cursor plus its rank among the chunk's
    routes to that expert (so routes keep their order within an expert, as the reference's
    stable sort)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < N, other=E_PAD).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.cumsum(blocks, axis=0) - blocks  # [E_PAD]
    for b0 in range(0, MAX_BLOCKS, CHUNK):
        offs_b = b0 + tl.arange(0, CHUNK)
        inside = (offs_b[:, None] >= first_block[None, :]) & \
            (offs_b[:, None] < (first_block + blocks)[None, :])  # [CHUNK, E_PAD]
        owner = tl.max(tl.where(inside, experts[None, :], -1), axis=1)
        tl.store(block_expert_ptr + offs_b, owner, mask=offs_b < MAX_BLOCKS)
    for r0 in range(0, MAX_BLOCKS * BLOCK_M, CHUNK):
        offs_r = r0 + tl.arange(0, CHUNK)
        tl.store(routes_ptr + offs_r, N + offs_r * 0, mask=offs_r < MAX_BLOCKS * BLOCK_M)
    tl.debug_barrier()  # the padding is written before routes land on it
    cursor = first_block * BLOCK_M
    lanes = tl.arange(0, CHUNK)
    for c0 in range(0, N, CHUNK):
        offs = c0 + lanes
        valid = offs < N
        e = tl.load(ids_ptr + offs, mask=valid, other=E_PAD).to(tl.int32)
        hit = e[:, None] == experts[None, :]  # [CHUNK, E_PAD]
        same = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])  # earlier, same expert
        rank = tl.sum(same.to(tl.int32), axis=1)
        row = tl.sum(tl.where(hit, cursor[None, :], 0), axis=1) + rank
        tl.store(routes_ptr + row, offs, mask=valid)
        cursor += tl.sum(hit.to(tl.int32), axis=0)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """See `hibana_kernels.moe.moe_align`."""
    flat = ids.reshape(-1)
    n = flat.numel()
    max_blocks = moe.max_expert_blocks(n, num_experts, block_m)
    routes = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](flat, routes, block_expert, n, num_experts, max_blocks, BLOCK_M=block_m,
                        E_PAD=triton.next_power_of_2(num_experts), CHUNK=64, num_warps=8)
    return ExpertBlocks(routes, block_expert)


# ------------------------------------------------------------------------------------- weights


@triton.jit
def _e2m1_scaled(codes):
    """e2m1 codes (int32, 0..15: sign, 2 exponent bits, 1 mantissa bit) as float32 values over
    2^14, exactly and in a few integer ops: the three magnitude bits become an fp16's lowest
    exponent bits and top mantissa bit (exponent 0 lands on fp16's subnormals: 0 and 0.5 come out
    right), the sign its sign bit; fp16 -> float32 is exact."""
    half = ((codes & 7) << 9) | ((codes & 8) << 12)
    return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _shift_left(v, n: tl.constexpr):
    """v << n, or v >> -n for a negative n (arithmetic: callers mask the bits they keep)."""
    if n >= 0:
        return v << n
    else:
        return v >> -n


_E2M1_MAGNITUDES = tl.constexpr(0x0E000E00)  # a pair's magnitude bits: 9..11 of each fp16 half
_E2M1_SIGNS = tl.constexpr(-0x7FFF8000)  # its sign bits, 15 and 31 (0x80008000 as an int32)


@triton.jit
def _e2m1_pair_scaled(words, p: tl.constexpr):
    """`_e2m1_scaled` of nibbles p and p + 4 of int32 words at once: they sit 16 bits apart, as
    the two halves of an fp16x2, so one pair of shifts and masks places both (the magnitude bits
    at 9..11 of each half, the sign at 15); each half then converts to float32 on its own."""
    return _fp16_halves((_shift_left(words, 9 - 4 * p) & _E2M1_MAGNITUDES)
                        | (_shift_left(words, 12 - 4 * p) & _E2M1_SIGNS))


@triton.jit
def _e2m1_pairs_scaled(words):
    """`_e2m1_pair_scaled` for p = 0..3 at once, along a new last axis: each word shifted right
    by 4p brings nibbles p and p + 4 to bits 0..3 and 16..19 (the shifted-in bits are masked)."""
    shifted = tl.expand_dims(words, len(words.shape)) >> (4 * tl.arange(0, 4))
    return _fp16_halves(((shifted << 9) & _E2M1_MAGNITUDES) | ((shifted << 12) & _E2M1_SIGNS))


_E2M1_FP32 = tl.constexpr(-0x7E400000)  # 0x81C00000 as an int32: float32's sign bit and bits 22..24
_HIGH_HALF = tl.constexpr(-0x10000)  # 0xFFFF0000 as an int32
_X_EXPONENT = tl.constexpr(64 << 23)
"""x's scale in `_gemv`'s DIRECT path, 2^64, as an add to float32 bits: `_e2m1_fp32`'s values are
e2m1 * 2^-126, x * 2^64 brings their products to x * w * 2^-62, normal (so exact) for |x * w| >=
2^-64; a block's sum times 2^48 is then what `_e2m1_pair_scaled`'s products sum to (x * w * 2^-14),
which `_e8m0_scale` scales."""


@triton.jit
def _x_scaled(bits):
    """A bf16 input already in the top half of int32 `bits` (as float32) times 2^64, by an
    integer add to its exponent: exact for normal inputs below 2^64; zeros and bf16 subnormals
    (under 2^-126) come out as 2^-63-ish values whose products with `_e2m1_fp32`'s (at most 6 *
    2^-126) fall under float32's smallest subnormal and round away, as the true products do. Not
    passed on: inf, NaN and |x| >= 2^64 (the add carries into the sign bit) give wrong finite
    values, where the fp16-pair GEMV gives inf or NaN."""
    return (bits + _X_EXPONENT).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_fp32(words, p: tl.constexpr):
    """Nibble p of int32 words as float32 e2m1 values times 2^-126, in three integer ops (two for
    p = 7): shifted to the top, the nibble's sign is bit 31 and its magnitude bits 28..30; an
    arithmetic shift right by 6 takes the magnitude to 22..24 (float32's lowest exponent bits and
    top mantissa bit) and copies the sign over the bits between, which the mask clears. Exponent
    0 lands on float32's subnormals (0 and 0.5 * 2^-126 come out right): FMAs keep them, as
    Triton compiles them (no flush to zero)."""
    if p == 7:
        top = words
    else:
        top = words << (28 - 4 * p)
    return ((top >> 6) & _E2M1_FP32).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_halves(pair):
    """The two fp16 halves of int32 `pair` (low, high) as float32."""
    lo = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _e8m0_scale(e8m0):
    """2^(e8m0 - 127) * 2^14 in float32, the exponent field e8m0 + 14 (inf above 2^113): times
    `_e2m1_scaled`'s values, an MXFP4 block's weights."""
    return (tl.minimum(e8m0.to(tl.int32) + 14, 255) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, expert, offs_n, n_mask, k0, K, stride_we, stride_wn, stride_se,
                 stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr,
                 GROUP: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of one expert's weight rows offs_n, zero outside the weight, for
    the grouped GEMM: dense (FORMAT 0) as stored; MXFP4 (1, strides of packed bytes and of
    scales) and int4 (3, (code - zero) * scale of its group of GROUP inputs, zeros strided as
    scales) dequantized to float32; int8 (2) as its codes in float32 (the row's scale multiplies
    the finished sum). A scale covers a run of SUB = min(BLOCK_K, GROUP) columns of the tile:

        codes [BLOCK_N, BLOCK_K] -> view [BLOCK_N, BLOCK_K // SUB, SUB] * scales[:, :, None]"""
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    sz_rows = expert.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    SUB: tl.constexpr = min(BLOCK_K, GROUP)
    if FORMAT == 1 or FORMAT == 3:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_rows + offs_b[None, :], mask=n_mask[:, None] & (offs_b < K // 2)[None, :],
                         other=0).to(tl.int32)
        codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, BLOCK_K], k in order
        offs_g = (k0 + SUB * tl.arange(0, BLOCK_K // SUB)) // GROUP  # each run's group
        g_mask = n_mask[:, None] & (offs_g * GROUP < K)[None, :]
        if FORMAT == 1:
            scale = _e8m0_scale(tl.load(s_ptr + sz_rows + offs_g[None, :], mask=g_mask, other=0))
            w = tl.reshape(_e2m1_scaled(codes), [BLOCK_N, BLOCK_K // SUB, SUB]) * scale[:, :, None]
        else:
            scale = tl.load(s_ptr + sz_rows + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + sz_rows + offs_g[None, :], mask=g_mask, other=0.0).to(tl.float32)
            w = (tl.reshape(_as_float(codes), [BLOCK_N, BLOCK_K // SUB, SUB]) - zero[:, :, None]) \
                * scale[:, :, None]
        return tl.reshape(w, [BLOCK_N, BLOCK_K])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0)
        if FORMAT == 2:
            w = _int8_as_float(w)
        return w


@triton.jit
def _int8_as_float(codes):
    """int8 codes as float32, exactly and without I2F (a quarter-rate conversion): code + 128 in
    the low mantissa bits of 2^23, then less 2^23 + 128."""
    return _as_float(codes.to(tl.int32) + 128) - 128.0


@triton.jit
def _int8_scales(s_ptr, expert, offs_n, n_mask, stride_se, stride_sn):
    """int8 rows' float32 scales: they multiply a row's finished sum of x times codes."""
    return tl.load(s_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn, mask=n_mask, other=0.0)


@triton.jit
def _mxfp4_dequantize_kernel(w_ptr, s_ptr, out_ptr, R, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    k0 = tl.program_id(1) * BLOCK_K
    w = _weight_tile(w_ptr, s_ptr, s_ptr, tl.program_id(0) * 0, offs_n, n_mask, k0, K, 0, K // 2, 0, K // 32,
                     BLOCK_N, BLOCK_K, 1, 32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (offs_k < K)[None, :])


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """See `hibana_kernels.moe.mxfp4_dequantize` (scales above 2^113 read as inf: real ones are
    near 2^0)."""
    *lead, groups, _ = blocks.shape
    k = groups * moe.MXFP4_BLOCK
    rows = blocks.numel() // (k // 2) if k else 0
    out = torch.empty((*lead, k), dtype=dtype, device=blocks.device)
    if rows and k:
        block_n, block_k = 16, 128
        _mxfp4_dequantize_kernel[(triton.cdiv(rows, block_n), triton.cdiv(k, block_k))](
            blocks.contiguous(), scales.contiguous(), out, rows, k, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4)
    return out


# ---------------------------------------------------------------------------------- activation


@triton.jit
def _round(v, dtype: tl.constexpr):
    """float32 v rounded to `dtype` (as a torch op in that dtype rounds), back in float32."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _bias(b_ptr, expert, offs_n, n_mask, stride_be, dtype: tl.constexpr):
    """An expert's bias at offs_n, rounded to `dtype` as the reference casts it, in float32."""
    bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_mask, other=0.0)
    return _round(bias.to(tl.float32), dtype)


@triton.jit
def _gate_up_activation(gate, up, b_ptr, expert, offs_n, n_mask, I, stride_be, alpha, limit,
                        dtype: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr):
    """silu(gate) * up or gpt-oss's clamped SwiGLU from float32 sums gate, up [..., BLOCK_N],
    each step rounded to `dtype` as transformers' ops in that dtype round it."""
    gate = _round(gate, dtype)
    up = _round(up, dtype)
    if HAS_BIAS:
        gate = _round(gate + _bias(b_ptr, expert, offs_n, n_mask, stride_be, dtype), dtype)
        up = _round(up + _bias(b_ptr, expert, I + offs_n, n_mask, stride_be, dtype), dtype)
    if ACTIVATION == 0:
        act = _round(gate / (1.0 + tl.exp(-gate)), dtype) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.maximum(tl.minimum(up, limit), -limit)
        sig = _round(1.0 / (1.0 + tl.exp(-_round(gate * alpha, dtype))), dtype)
        act = _round(up + 1.0, dtype) * _round(gate * sig, dtype)
    return act


@triton.jit
def _weighted_output(acc, weight, b_ptr, expert, offs_n, n_mask, stride_be, dtype: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ROUND_WEIGHT: tl.constexpr):
    """An expert's float32 output `acc` (+ bias) times its route's float32 `weight` (rounded to
    `dtype` first where ROUND_WEIGHT: `MoEExperts.round_weights`), with transformers' roundings
    to `dtype`, back in float32."""
    y = _round(acc, dtype)
    if HAS_BIAS:
        y = _round(y + _bias(b_ptr, expert, offs_n, n_mask, stride_be, dtype), dtype)
    if ROUND_WEIGHT:
        weight = _round(weight, dtype)
    return _round(y * weight, dtype)


# ---------------------------------------------------------------------------------- decode path


@triton.jit
def _row_tile(w_ptr, w_rows, r_mask, k0, K, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of a 16-bit or int8 tile's rows, zero past K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=r_mask[:, None] & (offs_k < K)[None, :], other=0)


@triton.jit
def _row_products(acc, x_row, w, k0, K, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr):
    """acc + x[k0 .. k0 + BLOCK_K] * w elementwise in float32 (int8 codes as they are; 16-bit
    weights rounded to x's dtype as the reference casts them)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    if FORMAT == 2:
        w = _int8_as_float(w)
    else:
        w = w.to(x_row.dtype.element_ty).to(tl.float32)
    return acc + x[None, :] * w


_E2M1_INT8_ASM = tl.constexpr("""{
    .reg .b32 s0, s1, h, c0, c1, p0, p1, n0, n1, v0, v1, t;
    and.b32 s0, $1, 0x7777;
    shr.u32 h, $1, 16;
    and.b32 s1, h, 0x7777;
    prmt.b32 p0, $4, $5, s0;
    prmt.b32 n0, $6, $7, s0;
    prmt.b32 p1, $4, $5, s1;
    prmt.b32 n1, $6, $7, s1;
    shr.u32 c0, $1, 1;
    lop3.b32 c0, c0, 0x4444, 0x3210, 0xEA;
    shr.u32 c1, h, 1;
    lop3.b32 c1, c1, 0x4444, 0x3210, 0xEA;
    prmt.b32 v0, p0, n0, c0;
    prmt.b32 v1, p1, n1, c1;
    dp4a.s32.s32 t, v0, $2, 0;
    dp4a.s32.s32 $0, v1, $3, t;
}""")  # word $1 of eight e2m1 codes (nibble p: column 8i + p) -> each code's value times 2 as an int8
#        (0, 1, 2, 3, 4, 6, 8, 12 and their negatives): its magnitude bits index a byte of the positive
#        table ($4 $5) and of the negative one ($6 $7) (a selector nibble's bit 3 would ask prmt for
#        a sign fill, so the selectors keep three bits), then its sign bit picks one of the two (byte
#        i or 4 + i); nibbles 0-3 against x's codes $2, 4-7 against $3 in two dp4a


@triton.jit
def _dp4a_e2m1(words, x_lo, x_hi, ASM: tl.constexpr):
    """Sum over a word's eight e2m1 codes of 2 * value * x's code (an int8 code each: nibbles 0-3
    against x_lo's bytes, 4-7 against x_hi's): table lookups and dp4a through inline PTX (ASM),
    else the same integer sum nibble by nibble (the interpreter)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            _E2M1_INT8_ASM, "=r,r,r,r,r,r,r,r",
            [words, x_lo, x_hi, tl.full(words.shape, 0x03020100, tl.int32), tl.full(words.shape, 0x0C080604, tl.int32),
             tl.full(words.shape, -0x02010100, tl.int32), tl.full(words.shape, -0x0B070504, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.zeros(words.shape, tl.int32)
        for p in tl.static_range(8):
            code = (words >> (4 * p)) & 0xF
            magnitude = code & 7
            twice = tl.where(magnitude <= 4, magnitude, tl.where(magnitude == 5, 6, tl.where(magnitude == 6, 8, 12)))
            value = tl.where(code >= 8, -twice, twice)
            out += value * _signed_byte(x_lo if p < 4 else x_hi, p % 4)
    return out


@triton.jit
def _gemv_mxfp4_a8(q_row, d_row, w_ptr, s_ptr, w_rows, sz_rows, r_mask, K, R: tl.constexpr, BLOCK_K: tl.constexpr,
                   ASM: tl.constexpr):
    """`_gemv` of MXFP4 weights against x as int8 codes per block of 32 (q_row: the row's words in
    quant_triton's A8_HALVES order, d_row: its blocks' (d, d * sum)): a thread a block of a row (4
    words of codes, 16 bytes), each word's codes against x's in two dp4a after table lookups
    (`_dp4a_e2m1`, ~2 instructions a weight where the float GEMVs take 5-6), exact in int32; per
    block 2^(e - 128) * d * the sum (the codes' values count twice)."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    offs_blk = tl.arange(0, BLOCKS)
    offs_w = tl.arange(0, 4)
    acc = tl.zeros([R, BLOCKS], dtype=tl.float32)
    for kb in range(0, K // 32, BLOCKS):
        blk = kb + offs_blk
        b_mask = blk < K // 32
        wb_mask = r_mask[:, None] & b_mask[None, :]
        words = tl.load(w_ptr + w_rows[:, None, None] + (4 * blk)[None, :, None] + offs_w[None, None, :],
                        mask=wb_mask[:, :, None], other=0)  # [R, BLOCKS, 4]
        # x's codes and d loaded for every row (the same addresses: the L1 serves them), in the
        # words' layout (a narrower one would be converted through shared memory)
        rows_blk = blk[None, :] + 0 * sz_rows[:, None]  # [R, BLOCKS]
        x_words = q_row + 8 * rows_blk[:, :, None] + offs_w[None, None, :]
        x_lo = tl.load(x_words, mask=b_mask[None, :, None], other=0)
        x_hi = tl.load(x_words + 4, mask=b_mask[None, :, None], other=0)
        d = tl.load(d_row + 2 * rows_blk, mask=b_mask[None, :], other=0.0)
        dots = tl.sum(_dp4a_e2m1(words, x_lo, x_hi, ASM), axis=2)
        e8m0 = tl.load(s_ptr + sz_rows[:, None] + blk[None, :], mask=wb_mask, other=0)
        acc += (_e8m0_scale(e8m0) * 2.0 ** -15) * (dots.to(tl.float32) * d)
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv(x_row, w_ptr, s_ptr, z_ptr, w_rows, sz_rows, r_mask, K, R: tl.constexpr, BLOCK_K: tl.constexpr,
          FORMAT: tl.constexpr, GROUP: tl.constexpr, X_VECTOR: tl.constexpr, TILES: tl.constexpr,
          DIRECT: tl.constexpr):
    """x[:K] . w[r, :K] in float32 [R] for R weight rows at element offsets w_rows (int64; int32
    words for the 4-bit formats) with scales (and zeros) at sz_rows. Products stay per column of
    the tile until the loop ends (a sum across threads each step costs more than the step), and
    each format takes the cheapest exact order (a weight costs a few integer ops and one FMA):

        dense   x . w, w rounded to x's dtype as the reference casts it
        int8    scale * (x . code), codes made float by a bit trick, not I2F (quarter rate)
        int4    words of 8 codes, each the unit 1 + code / 16 (a shift and a logic op); per run of
                SUB columns inside one group: scale * (16 x . unit - (16 + zero) sum x)
        MXFP4   words of 8 codes, two at a time e2m1 * 2^-14 through fp16x2 (`_e2m1_pair_scaled`);
                per block: 2^(e + 14 - 127) (x . v)

    x at column 8i + p meets nibble p of word i; a 4-bit tile is [R, BLOCK_K // SUB, SUB // 8]
    words, SUB = min(BLOCK_K, GROUP), so scales load once a run, not once a code. The quantized
    weights are not rounded to x's dtype one by one as the reference dequantizes them: the sums
    are as exact or more.

    TILES (16-bit and int8, 1-4 with K <= TILES * BLOCK_K): the row's steps written out, all their
    loads issued before the first product; 0: a loop over K.

    X_VECTOR (4-bit formats): a word's inputs come in vector loads (int4: its 8 as [.., 8]; MXFP4:
    the 4 of its low halves and the 4 of its high halves) and its codes are decoded as one tensor
    along them, summed inside each thread, where the default loads the input of nibble p of every
    word, strided, once per p (which is faster: bench/tune_moe.py --sweep).

    DIRECT (MXFP4, bf16 x): a thread takes whole blocks (a block's 4 words, its 32 codes and one
    scale), masked by whole blocks; each code goes straight into float32 bits (`_e2m1_fp32`:
    three integer ops, no fp16 conversion) against x * 2^64 (`_x_scaled`, x read two at a time);
    per block, its scale times the sum of its 32 products."""
    if FORMAT == 1 and DIRECT:
        BLOCKS: tl.constexpr = BLOCK_K // 32
        offs_blk = tl.arange(0, BLOCKS)
        x_pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True)  # x (bf16) two at a time
        acc = tl.zeros([R, BLOCKS], dtype=tl.float32)
        for kb in range(0, K // 32, BLOCKS):
            blk = kb + offs_blk
            b_mask = blk < K // 32
            wb_mask = r_mask[:, None] & b_mask[None, :]
            block_sum = tl.zeros([R, BLOCKS], dtype=tl.float32)
            for j in tl.static_range(4):  # a block's words: the thread of a block reads all four
                words = tl.load(w_ptr + w_rows[:, None] + (4 * blk + j)[None, :], mask=wb_mask, other=0)  # [R, BLOCKS]
                for q in tl.static_range(4):  # inputs 2q and 2q + 1 of the word's 8, one 32-bit load
                    pair = tl.load(x_pairs + 16 * blk + 4 * j + q, mask=b_mask, other=0)
                    block_sum += _x_scaled(pair << 16)[None, :] * _e2m1_fp32(words, 2 * q)
                    block_sum += _x_scaled(pair & _HIGH_HALF)[None, :] * _e2m1_fp32(words, 2 * q + 1)
            e8m0 = tl.load(s_ptr + sz_rows[:, None] + blk[None, :], mask=wb_mask, other=0)
            acc += _e8m0_scale(e8m0) * (block_sum * 2.0 ** 48)
        return tl.sum(acc, axis=1)
    elif FORMAT == 0 or FORMAT == 2:
        acc = tl.zeros([R, BLOCK_K], dtype=tl.float32)
        if TILES > 0:  # the row's steps written out: every step's load issued before the first product
            w0 = _row_tile(w_ptr, w_rows, r_mask, 0, K, BLOCK_K)
            if TILES > 1:
                w1 = _row_tile(w_ptr, w_rows, r_mask, BLOCK_K, K, BLOCK_K)
            if TILES > 2:
                w2 = _row_tile(w_ptr, w_rows, r_mask, 2 * BLOCK_K, K, BLOCK_K)
            if TILES > 3:
                w3 = _row_tile(w_ptr, w_rows, r_mask, 3 * BLOCK_K, K, BLOCK_K)
            acc = _row_products(acc, x_row, w0, 0, K, BLOCK_K, FORMAT)
            if TILES > 1:
                acc = _row_products(acc, x_row, w1, BLOCK_K, K, BLOCK_K, FORMAT)
            if TILES > 2:
                acc = _row_products(acc, x_row, w2, 2 * BLOCK_K, K, BLOCK_K, FORMAT)
            if TILES > 3:
                acc = _row_products(acc, x_row, w3, 3 * BLOCK_K, K, BLOCK_K, FORMAT)
        else:
            for k0 in range(0, K, BLOCK_K):
                acc = _row_products(acc, x_row, _row_tile(w_ptr, w_rows, r_mask, k0, K, BLOCK_K), k0, K, BLOCK_K,
                                    FORMAT)
        total = tl.sum(acc, axis=1)
        if FORMAT == 2:
            total *= tl.load(s_ptr + sz_rows, mask=r_mask, other=0.0)
        return total
    else:  # the 4-bit formats (a static branch: GROUP is 1 for the others)
        SUB: tl.constexpr = min(BLOCK_K, GROUP)
        RUNS: tl.constexpr = BLOCK_K // SUB
        WORDS: tl.constexpr = SUB // 8
        offs_run = SUB * tl.arange(0, RUNS)
        offs_word = offs_run[:, None] + 8 * tl.arange(0, WORDS)[None, :]  # [RUNS, WORDS]: a word's first column
        acc = tl.zeros([R, RUNS, WORDS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_word = k0 + offs_word
            k_mask = k_word < K  # K is a whole number of groups: words are in or out
            words = tl.load(w_ptr + w_rows[:, None, None] + (k_word // 8)[None, :, :],
                            mask=r_mask[:, None, None] & k_mask[None, :, :], other=0)  # [R, RUNS, WORDS]
            k_run = k0 + offs_run
            sz = sz_rows[:, None] + (k_run // GROUP)[None, :]  # [R, RUNS]: each run's group
            sz_mask = r_mask[:, None] & (k_run < K)[None, :]
            if FORMAT == 3:
                if X_VECTOR:
                    x8 = tl.load(x_row + k_word[:, :, None] + tl.arange(0, 8)[None, None, :], mask=k_mask[:, :, None],
                                 other=0.0).to(tl.float32)  # [RUNS, WORDS, 8]
                    units = tl.sum(x8[None, :, :, :] * _nibble_units(words), axis=3)
                    x_sum = tl.sum(x8, axis=2)
                else:
                    units = tl.zeros([R, RUNS, WORDS], dtype=tl.float32)
                    x_sum = tl.zeros([RUNS, WORDS], dtype=tl.float32)
                    for p in tl.static_range(8):
                        x = tl.load(x_row + k_word + p, mask=k_mask, other=0.0).to(tl.float32)
                        units += x[None, :, :] * _unit(words, 4 * p, 4)
                        x_sum += x
                scale = tl.load(s_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + sz, mask=sz_mask, other=0.0).to(tl.float32)
                acc += (16.0 * scale)[:, :, None] * units - (scale * (16.0 + zero))[:, :, None] * x_sum[None, :, :]
            else:
                if X_VECTOR:  # the low halves' 4 inputs and the high halves' 4 in vector loads
                    offs_p = tl.arange(0, 4)
                    x_lo = tl.load(x_row + k_word[:, :, None] + offs_p[None, None, :], mask=k_mask[:, :, None],
                                   other=0.0).to(tl.float32)  # [RUNS, WORDS, 4]
                    x_hi = tl.load(x_row + k_word[:, :, None] + 4 + offs_p[None, None, :], mask=k_mask[:, :, None],
                                   other=0.0).to(tl.float32)
                    lo, hi = _e2m1_pairs_scaled(words)  # [R, RUNS, WORDS, 4]
                    values = tl.sum(x_lo[None, :, :, :] * lo + x_hi[None, :, :, :] * hi, axis=3)
                else:
                    values = tl.zeros([R, RUNS, WORDS], dtype=tl.float32)
                    for p in tl.static_range(4):
                        x_lo = tl.load(x_row + k_word + p, mask=k_mask, other=0.0).to(tl.float32)
                        x_hi = tl.load(x_row + k_word + p + 4, mask=k_mask, other=0.0).to(tl.float32)
                        lo, hi = _e2m1_pair_scaled(words, p)
                        values += x_lo[None, :, :] * lo  # two FMAs: a sum of both products first costs a third op
                        values += x_hi[None, :, :] * hi
                acc += _e8m0_scale(tl.load(s_ptr + sz, mask=sz_mask, other=0))[:, :, None] * values
        return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _split_range(K, split_k, FORMAT: tl.constexpr, GROUP: tl.constexpr):
    """Program axis 2's share of a row of K inputs in `split_k` columns a split (a whole number
    of steps and of groups): its first column, its length, and the offsets of its first weight
    (an int32 word of 8 codes for the 4-bit formats) and first scale (0 for int8: one a row)."""
    k_start = tl.program_id(2) * split_k
    k_len = tl.minimum(K - k_start, split_k)
    if FORMAT == 1 or FORMAT == 3:
        return k_start, k_len, k_start // 8, k_start // GROUP
    else:
        return k_start, k_len, k_start, 0


@triton.jit
def _last_split(sums, part_ptr, counter_ptr, group, offs, SPLITS_ROWS: tl.constexpr):
    """Split-K's meeting point: this program's float32 `sums` [SPLITS_ROWS] go to its slot of the
    group's partials, a CTA barrier and an acq_rel count (`hibana_kernels.counters`) follow;
    (True, the partials added in split order) for the program that arrives last, which zeroes the
    count for the next launch, (False, sums) for the others. The order is fixed, so results do not
    depend on which split finishes last."""
    splits = tl.num_programs(2)
    base = part_ptr + group.to(tl.int64) * splits * SPLITS_ROWS
    tl.store(base + tl.program_id(2) * SPLITS_ROWS + offs, sums)
    tl.debug_barrier()  # every thread's partials are written before the count releases them
    arrived = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    last = arrived == splits - 1
    if last:
        sums = tl.load(base + offs)
        for i in range(1, splits):
            sums += tl.load(base + i * SPLITS_ROWS + offs)
        tl.atomic_xchg(counter_ptr + group, 0, sem="relaxed", scope="gpu")
    return last, sums


@triton.jit
def _gate_up_decode_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, z_ptr, b_ptr, act_ptr, H, I, TOP_K,
                           stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be,
                           alpha, limit, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           FORMAT: tl.constexpr, GROUP: tl.constexpr, ACTIVATION: tl.constexpr,
                           HAS_BIAS: tl.constexpr, X_VECTOR: tl.constexpr, TILES: tl.constexpr,
                           PDL: tl.constexpr, DIRECT: tl.constexpr = False, part_ptr=None, counter_ptr=None,
                           split_k=0, SPLIT: tl.constexpr = False, q_ptr=None, d_ptr=None, stride_qm=0, stride_dm=0,
                           A8: tl.constexpr = False, ASM: tl.constexpr = False):
    """act[route, n] for one route and BLOCK_N intermediate features: its expert's gate rows n
    and up rows I + n as one tile of 2 BLOCK_N rows (row 2j + h: gate j for h = 0, up j for 1),
    streamed along H together. SPLIT: program (route, tile, s) takes split s of H (`split_k`
    columns), and the last of a tile's splits to finish adds their sums (`_last_split`) and
    writes the activation. A8 (MXFP4): x as int8 codes (q_ptr, d_ptr: `_gemv_mxfp4_a8`)."""
    wait_for_previous(PDL)  # the expert is the router's output: nothing to read before
    route = tl.program_id(0)
    expert = tl.load(ids_ptr + route).to(tl.int64)
    r = tl.arange(0, 2 * BLOCK_N)
    feature = tl.program_id(1) * BLOCK_N + r // 2
    rows = (feature + (r % 2) * I).to(tl.int64)
    token = (route // TOP_K).to(tl.int64)
    x_row = x_ptr + token * stride_xm
    w_rows = expert * stride_we + rows * stride_wn
    sz_rows = expert * stride_se + rows * stride_sn
    if SPLIT:
        k_start, k_len, w_off, sz_off = _split_range(H, split_k, FORMAT, GROUP)
        if A8:
            sums = _gemv_mxfp4_a8(q_ptr + token * stride_qm + k_start // 4, d_ptr + token * stride_dm + k_start // 16,
                                  w_ptr, s_ptr, w_rows + w_off, sz_rows + sz_off, feature < I, k_len, 2 * BLOCK_N,
                                  BLOCK_K, ASM)
        else:
            sums = _gemv(x_row + k_start, w_ptr, s_ptr, z_ptr, w_rows + w_off, sz_rows + sz_off, feature < I, k_len,
                         2 * BLOCK_N, BLOCK_K, FORMAT, GROUP, X_VECTOR, TILES, DIRECT)
        last, sums = _last_split(sums, part_ptr, counter_ptr, route * tl.num_programs(1) + tl.program_id(1), r,
                                 2 * BLOCK_N)
        if last:
            _gate_up_store(sums, b_ptr, act_ptr, expert, route, I, stride_be, alpha, limit,
                           x_ptr.dtype.element_ty, BLOCK_N, ACTIVATION, HAS_BIAS)
    else:
        if A8:
            sums = _gemv_mxfp4_a8(q_ptr + token * stride_qm, d_ptr + token * stride_dm, w_ptr, s_ptr, w_rows, sz_rows,
                                  feature < I, H, 2 * BLOCK_N, BLOCK_K, ASM)
        else:
            sums = _gemv(x_row, w_ptr, s_ptr, z_ptr, w_rows, sz_rows, feature < I, H,
                         2 * BLOCK_N, BLOCK_K, FORMAT, GROUP, X_VECTOR, TILES, DIRECT)
        _gate_up_store(sums, b_ptr, act_ptr, expert, route, I, stride_be, alpha, limit,
                       x_ptr.dtype.element_ty, BLOCK_N, ACTIVATION, HAS_BIAS)


@triton.jit
def _gate_up_store(sums, b_ptr, act_ptr, expert, route, I, stride_be, alpha, limit, dtype: tl.constexpr,
                   BLOCK_N: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A gate|up tile's float32 sums [2 BLOCK_N] (gate and up interleaved) to act[route, n]."""
    gate, up = tl.split(tl.reshape(sums, [BLOCK_N, 2]))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    act = _gate_up_activation(gate, up, b_ptr, expert, offs_n, n_mask, I, stride_be, alpha, limit, dtype,
                              ACTIVATION, HAS_BIAS)
    tl.store(act_ptr + route.to(tl.int64) * I + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_decode_kernel(act_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, H, I,
                        stride_om, stride_we, stride_wn, stride_se, stride_sn, stride_be,
                        ROUTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        X_VECTOR: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
                        DIRECT: tl.constexpr = False, part_ptr=None, counter_ptr=None, split_k=0,
                        SPLIT: tl.constexpr = False, q_ptr=None, d_ptr=None, stride_qm=0, stride_dm=0,
                        A8: tl.constexpr = False, ASM: tl.constexpr = False,
                        ROUND_WEIGHT: tl.constexpr = True, sum_ptr=None, sum_counter_ptr=None, stride_sm=0,
                        TOP_K: tl.constexpr = 1, COMBINE: tl.constexpr = False):
    """out[program 0, n] for BLOCK_N hidden features and ROUTES consecutive routes: each route's
    expert's down rows against that route's activation, weighted, summed over the ROUTES in
    float32. ROUTES = k: out is the layer's output, one program per token; ROUTES = 1: out holds
    one row per route, summed by `_combine_kernel` (k times the programs: a token's k experts
    are read at once, not one after another). SPLIT (ROUTES = 1): program (route, tile, s) takes
    split s of I, the last of a tile's splits to finish adds their sums and writes the row. A8
    (MXFP4): the activations as int8 codes, a row a route (q_ptr, d_ptr: `_gemv_mxfp4_a8`).
    COMBINE (ROUTES = 1, no split): the last of a token's TOP_K routes to finish a tile also sums
    their rows into sum_ptr (`_combine_last`: `_combine_kernel`'s work, without its launch)."""
    wait_for_previous(PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    if SPLIT:
        route = tl.program_id(0)
        expert = tl.load(ids_ptr + route).to(tl.int64)
        k_start, k_len, w_off, sz_off = _split_range(I, split_k, FORMAT, GROUP)
        w_rows = expert * stride_we + offs_n * stride_wn + w_off
        sz_rows = expert * stride_se + offs_n * stride_sn + sz_off
        if A8:
            acc = _gemv_mxfp4_a8(q_ptr + route.to(tl.int64) * stride_qm + k_start // 4,
                                 d_ptr + route.to(tl.int64) * stride_dm + k_start // 16, w_ptr, s_ptr, w_rows, sz_rows,
                                 n_mask, k_len, BLOCK_N, BLOCK_K, ASM)
        else:
            acc = _gemv(act_ptr + route.to(tl.int64) * I + k_start, w_ptr, s_ptr, z_ptr, w_rows, sz_rows, n_mask, k_len,
                        BLOCK_N, BLOCK_K, FORMAT, GROUP, X_VECTOR, TILES, DIRECT)
        last, acc = _last_split(acc, part_ptr, counter_ptr, route * tl.num_programs(1) + tl.program_id(1),
                                tl.arange(0, BLOCK_N), BLOCK_N)
        if last:
            total = _weighted_output(acc, tl.load(weights_ptr + route), b_ptr, expert, offs_n, n_mask, stride_be,
                                     act_ptr.dtype.element_ty, HAS_BIAS, ROUND_WEIGHT)
            tl.store(out_ptr + route.to(tl.int64) * stride_om + offs_n, total.to(out_ptr.dtype.element_ty),
                     mask=n_mask)
    else:
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(ROUTES):  # (ROUTES = 1: one route, program 0's)
            route = tl.program_id(0) * ROUTES + j
            expert = tl.load(ids_ptr + route).to(tl.int64)
            w_rows = expert * stride_we + offs_n * stride_wn
            sz_rows = expert * stride_se + offs_n * stride_sn
            if A8:
                acc = _gemv_mxfp4_a8(q_ptr + route.to(tl.int64) * stride_qm, d_ptr + route.to(tl.int64) * stride_dm,
                                     w_ptr, s_ptr, w_rows, sz_rows, n_mask, I, BLOCK_N, BLOCK_K, ASM)
            else:
                acc = _gemv(act_ptr + route.to(tl.int64) * I, w_ptr, s_ptr, z_ptr, w_rows, sz_rows, n_mask, I, BLOCK_N,
                            BLOCK_K, FORMAT, GROUP, X_VECTOR, TILES, DIRECT)
            total += _weighted_output(acc, tl.load(weights_ptr + route), b_ptr, expert, offs_n, n_mask, stride_be,
                                      act_ptr.dtype.element_ty, HAS_BIAS, ROUND_WEIGHT)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_om + offs_n, total.to(out_ptr.dtype.element_ty),
                 mask=n_mask)
        if COMBINE:
            _combine_last(out_ptr, sum_ptr, sum_counter_ptr, tl.program_id(0) // TOP_K, offs_n, n_mask, stride_om,
                          stride_sm, TOP_K)


@triton.jit
def _combine_last(y_ptr, out_ptr, counter_ptr, token, offs, mask, stride_ym, stride_om, TOP_K: tl.constexpr):
    """The down projection's meeting point (`Fusion.moe_combine`): this program's row of y is
    written; a CTA barrier and an acq_rel count per (token, tile) follow, and the program that
    arrives last adds the token's TOP_K rows in route order in float32 (as `_combine_kernel`: the
    result does not depend on which route finishes last), writes out and zeroes the count."""
    tl.debug_barrier()  # every thread's part of the row is written before the count releases it
    group = token * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:
        total = tl.zeros(offs.shape, dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(y_ptr + (token * TOP_K + j).to(tl.int64) * stride_ym + offs, mask=mask,
                             other=0.0).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr + group, 0, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------- grouped path


@triton.jit
def _gate_up_grouped_kernel(x_ptr, routes_ptr, block_expert_ptr, w_ptr, s_ptr, z_ptr, b_ptr, act_ptr,
                            NUM_ROUTES, H, I, TOP_K, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                            stride_be, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                            ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
    """act[route, n] for one block's BLOCK_M routes (one expert) and BLOCK_N intermediate
    features: x rows of the routes' tokens against the expert's gate and up tiles."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    routes = tl.load(routes_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = routes < NUM_ROUTES
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    x_rows = x_ptr + (routes // TOP_K).to(tl.int64)[:, None] * stride_xm
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < H)[None, :], other=0.0)
        wg = _weight_tile(w_ptr, s_ptr, z_ptr, expert, offs_n, n_mask, k0, H, stride_we, stride_wn, stride_se,
                          stride_sn, BLOCK_N, BLOCK_K, FORMAT, GROUP).to(x.dtype)
        wu = _weight_tile(w_ptr, s_ptr, z_ptr, expert, I + offs_n, n_mask, k0, H, stride_we, stride_wn, stride_se,
                          stride_sn, BLOCK_N, BLOCK_K, FORMAT, GROUP).to(x.dtype)
        if UPCAST:  # exact: products of 16-bit floats are exact in float32
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        # float32 x: exact products ("ieee"), not tf32
        gate = tl.dot(x, tl.trans(wg), gate, input_precision="ieee")
        up = tl.dot(x, tl.trans(wu), up, input_precision="ieee")
    if FORMAT == 2:  # int8: the rows' scales times the sums of codes (exact in x's dtype)
        gate *= _int8_scales(s_ptr, expert, offs_n, n_mask, stride_se, stride_sn)[None, :]
        up *= _int8_scales(s_ptr, expert, I + offs_n, n_mask, stride_se, stride_sn)[None, :]
    act = _gate_up_activation(gate, up, b_ptr, expert, offs_n[None, :], n_mask[None, :], I, stride_be,
                              alpha, limit, x_ptr.dtype.element_ty, ACTIVATION, HAS_BIAS)
    tl.store(act_ptr + routes.to(tl.int64)[:, None] * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_grouped_kernel(act_ptr, routes_ptr, block_expert_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, b_ptr,
                         y_ptr, NUM_ROUTES, H, I, stride_we, stride_wn, stride_se, stride_sn, stride_be,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         UPCAST: tl.constexpr, ROUND_WEIGHT: tl.constexpr = True):
    """y[route, n] = weight * (act[route] @ w2[e][n]^T + b2[e][n]) for one block's routes."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    routes = tl.load(routes_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = routes < NUM_ROUTES
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    a_rows = act_ptr + routes.to(tl.int64)[:, None] * I
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < I)[None, :], other=0.0)
        w = _weight_tile(w_ptr, s_ptr, z_ptr, expert, offs_n, n_mask, k0, I, stride_we, stride_wn, stride_se,
                         stride_sn, BLOCK_N, BLOCK_K, FORMAT, GROUP).to(a.dtype)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    if FORMAT == 2:
        acc *= _int8_scales(s_ptr, expert, offs_n, n_mask, stride_se, stride_sn)[None, :]
    weight = tl.load(weights_ptr + routes, mask=m_mask, other=0.0)[:, None]
    y = _weighted_output(acc, weight, b_ptr, expert, offs_n[None, :], n_mask[None, :], stride_be,
                         act_ptr.dtype.element_ty, HAS_BIAS, ROUND_WEIGHT)
    tl.store(y_ptr + routes.to(tl.int64)[:, None] * H + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, stride_om, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """out[t] = the sum of its k routes' rows, in float32, rounded once."""
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(y_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------- launches


class _Weights(NamedTuple):
    """One projection's kernel arguments: weight (MXFP4 and int4 as bytes, or as int32 words of
    8 codes for the decode kernels' FMA GEMVs), scales (the weight again when dense), zeros (int4;
    the scales again otherwise), bias (the weight again when absent), the inputs a scale covers
    (GROUP) and the strides the kernels take."""

    w: torch.Tensor
    s: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    group: int
    strides: tuple[int, int, int, int, int]  # expert and row of w, of s (and z), expert of b


def _weights(w: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None,
             bias: torch.Tensor | None, group: int, words: bool) -> _Weights:
    if scales is not None:  # MXFP4 blocks [E, N, G, 16] -> bytes [E, N, G * 16]; int8 and int4 as they are
        w = w.contiguous().flatten(2)
        scales = scales.contiguous()
    elif w.stride(-1) != 1:
        w = w.contiguous()
    if words:  # rows of K / 2 bytes, K a whole number of groups of 8 or more: whole words
        w = (w.clone() if w.storage_offset() % 4 else w).view(torch.int32)
    s = scales if scales is not None else w
    z = zeros.contiguous() if zeros is not None else s
    b = bias.contiguous() if bias is not None else w
    strides = (w.stride(0), w.stride(1), s.stride(0), s.stride(1), b.stride(0))
    return _Weights(w, s, z, b, group, strides)


SPLIT_GROUPS = 1 << 16
"""Tiles (routes x output tiles) a split-K decode launch may count arrivals for: past it, no split."""


class _Split(NamedTuple):
    count: int  # programs a tile's row is shared among (1: no split)
    columns: int  # inputs a split reads (0 when count is 1: the whole row)
    partials: torch.Tensor | None  # float32 scratch, groups x count x rows, flat
    counters: torch.Tensor | None  # arrival counts, zero between launches


def _or(tensor: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel does not read without split-K: another tensor stands in (as
    an absent bias's does), not None."""
    return stand_in if tensor is None else tensor


def _split(k: int, block_k: int, group: int, split: int, groups: int, rows: int, device: torch.device) -> _Split:
    """A row of k inputs shared among up to `split` programs: each takes a whole number of steps
    and of groups (so its first scale is a whole group's), the last what is left. Not split
    (columns 0: the kernels read the whole row) for one program or more groups than the counts."""
    unit = max(block_k, group)
    columns = triton.cdiv(triton.cdiv(k, unit), max(split, 1)) * unit
    count = triton.cdiv(k, columns) if k else 1
    if count <= 1 or groups > SPLIT_GROUPS:
        return _Split(1, 0, None, None)
    partials = torch.empty((groups * count * rows,), dtype=torch.float32, device=device)
    return _Split(count, columns, partials, counters.counters("moe decode split", SPLIT_GROUPS, device))


def supports(experts: MoEExperts) -> bool:
    """Whether the kernels take these experts: int4 groups must be a power of two of at least 8
    inputs (whole int32 words; the tiles' aranges), as checkpoints' 32, 64 and 128 are."""
    return experts.kind != "int4" or all(g >= 8 and g & (g - 1) == 0 for g in experts.group_sizes)


def choose_tiles(tokens: int, kind: str = "dense") -> DecodeTiles | GroupedTiles:
    """The path and its tiles for `tokens` tokens of `kind` experts: the fastest of
    bench/tune_moe.py --sweep on the H200 at Qwen3-30B-A3B (bf16, int8, int4) and gpt-oss-20b
    (MXFP4) shapes. HIBANA_A8_ROWS=0 (`quant_triton.A8_MAX_ROWS`) keeps x in 16 bits here too."""
    if tokens <= DECODE_MAX_TOKENS[kind]:
        tiles = DECODE_TILES[kind]
        return _float_x(tiles, kind) if tiles.a8 and quant_triton.A8_MAX_ROWS == 0 else tiles
    if tokens >= 256:
        return GroupedTiles(64, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return GroupedTiles(16, block_n=64, block_k=128, num_warps=4, num_stages=2)


def _float_x(tiles: DecodeTiles, kind: str) -> DecodeTiles:
    """Decode tiles measured with int8 x, for x kept in floats: the float GEMV's own
    (`FLOAT_TILES`) where they were measured apart, the same tiles otherwise."""
    return FLOAT_TILES.get(kind, tiles._replace(a8=False))


def _takes_a8(tiles: DecodeTiles | GroupedTiles, experts: MoEExperts, x: torch.Tensor) -> bool:
    """Whether the decode path meets these experts with x (and the activations) as int8 codes:
    a8 tiles, MXFP4 experts, 16-bit x, whole blocks of 32 along both widths."""
    return (isinstance(tiles, DecodeTiles) and tiles.a8 and experts.kind == "mxfp4"
            and x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] % moe.MXFP4_BLOCK == 0
            and experts.intermediate_size % moe.MXFP4_BLOCK == 0)


def takes_a8(x: torch.Tensor, experts: MoEExperts) -> bool:
    """Whether `fused_moe` of x's rows would quantize x to int8 codes first (`_takes_a8` on the
    tiles `choose_tiles` picks): then the norm writing x may hand its codes over (`fused_moe_a8`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == "cuda" and rows > 0 and supports(experts)
            and _takes_a8(choose_tiles(rows, experts.kind), experts, x))


COMBINE_GROUPS = 1 << 16
"""(token, output tile) pairs a combining down launch (`Fusion.moe_combine`) may count arrivals
for: past it, `_combine_kernel` runs."""


def fused_moe_launch(x: torch.Tensor, experts: MoEExperts, weights: torch.Tensor, ids: torch.Tensor,
                     tiles: DecodeTiles | GroupedTiles,
                     x_codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """fused_moe on the path and tiles chosen by the caller (tests, the tuning script). x_codes:
    x's int8 codes (q, d) as `quant_triton.quantize_a8` writes them in A8_HALVES order, for a8
    tiles (else unused), which then do not quantize x themselves."""
    moe.check_moe_inputs(x, experts, weights, ids)
    if isinstance(tiles, DecodeTiles) and experts.kind in ("mxfp4", "int4"):
        step = 32 if experts.kind == "mxfp4" else 8  # whole MXFP4 blocks; whole int32 words of codes
        if any(k % step for k in (tiles.block_k, *(tiles.down[1:2] if tiles.down else ()))):
            raise ValueError(f"{experts.kind} decode tiles step a multiple of {step} inputs, not {tiles}")
    if not supports(experts):
        raise ValueError(f"int4 groups of {experts.group_sizes} inputs: the kernels want powers of two from 8")
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous()
    t, h = x.shape
    top_k = ids.shape[1]
    inter = experts.intermediate_size
    weight_format = _FORMAT[experts.kind]
    decode = isinstance(tiles, DecodeTiles)
    words = decode and experts.kind in ("mxfp4", "int4")
    g13, g2 = experts.group_sizes if experts.kind == "int4" else (moe.MXFP4_BLOCK,) * 2
    w13 = _weights(experts.w13, experts.w13_scales, experts.w13_zeros, experts.b13, g13, words)
    w2 = _weights(experts.w2, experts.w2_scales, experts.w2_zeros, experts.b2, g2, words)
    out = torch.empty_like(x)
    if t == 0:
        return out
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    swiglu = (experts.swiglu_alpha, experts.swiglu_limit)
    has_b13, has_b2 = experts.b13 is not None, experts.b2 is not None
    combine_block = min(1024, triton.next_power_of_2(h))
    launch = pdl.launch_args(x.device, "moe")
    if decode:
        x_vector = tiles.x_vector and words  # a variant of the 4-bit GEMVs only
        unroll = tiles.unroll and not words  # a variant of the 16-bit and int8 GEMVs only
        # the direct GEMV reads x as pairs of bf16 in int32 loads: bf16 rows starting on 4 bytes only
        direct = (tiles.direct and experts.kind == "mxfp4" and x.dtype == torch.bfloat16
                  and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0)
        a8 = _takes_a8(tiles, experts, x)
        if tiles.a8 and not a8:
            tiles = _float_x(tiles, experts.kind)
        if a8:
            q13, d13 = x_codes if x_codes is not None else quant_triton.quantize_a8(x, quant_triton.A8_HALVES)
        else:
            q13, d13 = x, x
        asm = x.device.type == "cuda"
        # the down projection's own tiles where its rows take at most 4 of their steps (as measured:
        # Qwen3-30B-A3B's 768 in 3 of 256); longer rows, a larger model's, take the gate|up's
        own = tiles.down is not None and triton.cdiv(inter, tiles.down[1]) <= 4
        down_n, down_k, down_warps = tiles.down if own else (tiles.block_n, tiles.block_k, tiles.num_warps)
        routes = 1 if tiles.down_per_route else top_k
        tiles_n13, tiles_n2 = triton.cdiv(inter, tiles.block_n), triton.cdiv(h, down_n)
        split13 = _split(h, tiles.block_k, w13.group, tiles.split, t * top_k * tiles_n13, 2 * tiles.block_n, x.device)
        split2 = _split(inter, down_k, w2.group, tiles.split if routes == 1 else 1, t * top_k * tiles_n2, down_n,
                        x.device)
        # rows (a split's share) of at most 4 steps written out; longer rows (a larger model's) loop
        tiles13, tiles2 = ((steps if unroll and steps <= 4 else 0)
                           for steps in (triton.cdiv(split13.columns or h, tiles.block_k),
                                         triton.cdiv(split2.columns or inter, down_k)))
        _gate_up_decode_kernel[(t * top_k, tiles_n13, split13.count)](
            x, ids, w13.w, w13.s, w13.z, w13.b, act, h, inter, top_k, x.stride(0), *w13.strides, *swiglu,
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, FORMAT=weight_format, GROUP=w13.group,
            ACTIVATION=_ACTIVATION[experts.activation], HAS_BIAS=has_b13, X_VECTOR=x_vector, TILES=tiles13,
            DIRECT=direct, part_ptr=_or(split13.partials, x), counter_ptr=_or(split13.counters, ids),
            split_k=split13.columns, SPLIT=split13.count > 1, q_ptr=q13, d_ptr=d13, stride_qm=q13.stride(0),
            stride_dm=d13.stride(0), A8=a8, ASM=asm, num_warps=tiles.num_warps, **launch)
        q2, d2 = quant_triton.quantize_a8(act, quant_triton.A8_HALVES) if a8 else (act, act)
        y = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device) if routes == 1 else out
        # the last route of a token to finish a tile sums its rows (the combine launch goes)
        combine = (routes == 1 and split2.count == 1 and fusion.policy().moe_combine
                   and t * tiles_n2 <= COMBINE_GROUPS)
        sum_counts = counters.counters("moe decode combine", COMBINE_GROUPS, x.device) if combine else ids
        _down_decode_kernel[(t * top_k // routes, tiles_n2, split2.count)](
            act, ids, weights, w2.w, w2.s, w2.z, w2.b, y, h, inter, y.stride(0), *w2.strides, ROUTES=routes,
            BLOCK_N=down_n, BLOCK_K=down_k, FORMAT=weight_format, GROUP=w2.group, HAS_BIAS=has_b2,
            X_VECTOR=x_vector, TILES=tiles2, DIRECT=direct, part_ptr=_or(split2.partials, x),
            counter_ptr=_or(split2.counters, ids), split_k=split2.columns, SPLIT=split2.count > 1, q_ptr=q2,
            d_ptr=d2, stride_qm=q2.stride(0), stride_dm=d2.stride(0), A8=a8, ASM=asm,
            ROUND_WEIGHT=experts.round_weights, sum_ptr=out, sum_counter_ptr=sum_counts, stride_sm=out.stride(0),
            TOP_K=top_k, COMBINE=combine, num_warps=down_warps, **launch)
        if routes == 1 and not combine:
            _combine_kernel[(t, triton.cdiv(h, combine_block))](y, out, h, out.stride(0), TOP_K=top_k,
                                                                BLOCK=combine_block, num_warps=4, **launch)
        return out
    blocks = moe_align(ids, experts.num_experts, tiles.block_m)
    num_blocks = blocks.block_expert.numel()
    upcast = x.device.type == "cpu" and x.dtype != torch.float32  # the interpreter's 16-bit tl.dot is wrong
    _gate_up_grouped_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        x, blocks.routes, blocks.block_expert, w13.w, w13.s, w13.z, w13.b, act, t * top_k, h, inter, top_k,
        x.stride(0), *w13.strides, *swiglu, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, FORMAT=weight_format, GROUP=w13.group, ACTIVATION=_ACTIVATION[experts.activation],
        HAS_BIAS=has_b13, UPCAST=upcast, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    y = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device)
    _down_grouped_kernel[(num_blocks, triton.cdiv(h, tiles.block_n))](
        act, blocks.routes, blocks.block_expert, weights, w2.w, w2.s, w2.z, w2.b, y, t * top_k, h, inter,
        *w2.strides, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        FORMAT=weight_format, GROUP=w2.group, HAS_BIAS=has_b2, UPCAST=upcast, ROUND_WEIGHT=experts.round_weights,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _combine_kernel[(t, triton.cdiv(h, combine_block))](y, out, h, out.stride(0), TOP_K=top_k,
                                                        BLOCK=combine_block, num_warps=4, PDL=False)
    return out


def fused_moe_a8(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, experts: MoEExperts, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe` of x whose int8 codes (q, d) a norm wrote (where `takes_a8`)."""
    return fused_moe_launch(x, experts, weights, ids, choose_tiles(x.shape[0], experts.kind), x_codes=(q, d))


def fused_moe(x: torch.Tensor, experts: MoEExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """See `hibana_kernels.moe.fused_moe`."""
    if x.dtype not in _DTYPES or (experts.kind == "dense" and experts.w13.dtype not in _DTYPES) \
            or not supports(experts):
        return moe.fused_moe(x, experts, weights, ids)
    return fused_moe_launch(x, experts, weights, ids, choose_tiles(x.shape[0], experts.kind))
