"""Which launches of a one-row step (batch-1 decode) fold into a neighbouring kernel.

A small model's decode step is made of kernels of 2-3 us each, so their number sets its speed.
On the Triton path these run as one launch:

    rms_norm (+ residual add) -> linear   each GEMV program recomputes the row's scale from x
                                          (hidden-sized, in L2); program 0 writes the new residual
    silu_and_mul -> linear                the down GEMV applies silu(gate) * up to its input tiles
    linear -> silu_and_mul (or gelu)      or the gate/up GEMV writes act(gate) * up: a program owns
                                          both rows of its features (glu_silu_max_n, glu_gelu;
                                          the MLP then does not fold silu into the down GEMV)
    decode attention -> split merge       the last split of a KV head to finish merges them
                                          (an atomic counter per head, reset by that program)
    attention prologue -> decode          each program normalises and rotates its query rows; the
                                          split holding a new token's position stores its key and
                                          value first (a CTA barrier), then reads them as any key
    rms_norm -> router -> top-k           a sparse block's start: the router's programs each
                                          normalise the row; the last to finish picks the experts

Folding saves a launch but makes every GEMV program re-read (and re-normalise or re-activate)
its whole input row, which grows with the layer's width: free at a 0.6B model's 1024/3072,
not measured at an 8B model's 4096/12288. So the GEMV fusions are chosen by the input width;
the limits are first guesses, to be set from `bench/tune_decode.py --fusion` on the H200.
The results are those of the separate kernels either way (same roundings, same GEMV tiles).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Fusion:
    """A fusion policy: which one-row GEMVs take their prologue in, by input width."""

    norm_max_k: int
    """rms_norm folds into a GEMV over at most this many inputs (the hidden size)"""
    silu_max_k: int
    """silu_and_mul folds into a GEMV over at most this many inputs (the intermediate size)"""
    attention_merge: bool
    """split decode attention merges its splits in the same launch"""
    moe_norm_route: bool = False
    """a sparse block's norm, router GEMV and top-k in one launch (`moe_norm_route`: the last of
    the router's programs to finish picks the experts)"""
    glu_silu_max_n: int = 0
    """silu * up in the gate/up GEMV's epilogue for intermediate sizes above silu_max_k up to this"""
    glu_gelu: bool = False
    """tanh gelu * up in the gate/up GEMV's epilogue (it has no kernel of its own: torch's gelu and mul)"""
    attention_prologue: bool = False
    """decode attention runs the layer's prologue (q/k norms, rotary, the new keys and values into the
    cache: `qk_norm_rotary_store`) in its own programs (that launch goes)"""
    a8_fold: bool = False
    """the norm, SiLU-and-mul or decode attention's split merge before an int8 / int4 layer's x int8
    GEMV writes x's int8 codes too (the quantize launch goes; `hibana_kernels.folds_a8`), and the norm
    before a sparse block whose experts take int8 x (MXFP4's) writes them for the experts
    (`hibana_kernels.moe_folds_a8`)"""
    moe_combine: bool = False
    """the decode path's down projection, a program per route, sums a token's k rows itself: the last
    route to finish a tile adds them (an atomic count per token and tile; `_combine_kernel`'s launch goes)"""

    def norm_linear(self, k: int) -> bool:
        return k <= self.norm_max_k

    def silu_linear(self, k: int) -> bool:
        return k <= self.silu_max_k

    def glu_linear(self, n: int, activation: str) -> bool:
        """Whether a gate/up GEMV of n features takes `activation` in: each program owns the gate
        and up rows of its features and writes act(gate) * up (the activation's launch goes, and
        n values are written, not 2n)."""
        if activation == "silu":
            return self.silu_max_k < n <= self.glu_silu_max_n
        if activation == "gelu_tanh":
            return self.glu_gelu
        raise ValueError(f"no GLU epilogue for activation {activation!r}")


# Measured on the H200 (bench/tune_decode.py --fusion, RESULTS.md 2026-12-01 second session):
# at Qwen3-0.6B widths the folds save about a sixth of each pair (norm + qkv 6.3 -> 5.1 us,
# silu + down 5.8 -> 4.8 us); at 8B widths the folded norm costs more than its launch (16.9 ->
# 17.5 us for qkv) and so stays separate. Merging the splits in the attention launch is slower
# at both sizes (0.6B, 8192 keys: 16.8 -> 19.9 us; 8B: 15.1 -> 23.0 us): the last split waits
# for the others and merges alone, where the separate merge runs wide. So AUTO leaves it off.
# moe_norm_route (H200, 2026-12-03, `tune_decode.py --fusion --policies auto,auto+moe_norm_route`,
# batch 1, 512 keys): qwen3-30b-a3b 360.6 -> 359.1 tok/s (96 launches a step fewer, no faster),
# gpt-oss-20b 437.7 -> 361.7 (each of its 32 router programs normalises a 2880-wide row, and
# the last one picks the experts alone). AUTO leaves it off.
# The GLU epilogue (H200, 2026-12-03, `tune_decode.py --fusion`, batch 1, 512 keys, two A/B runs
# of the epilogue on every gated MLP against AUTO without it): phi4-mini (silu, I 8192) 372.4 ->
# 376.3 and 369.1 -> 376.2 tok/s; gemma3-12b (tanh gelu, I 15360; two torch launches a layer
# fewer) 136.6 -> 138.1 and 135.0 -> 138.0; qwen3-8b (silu, I 12288) 222.9 -> 219.9 and 221.4 ->
# 219.6; qwen3-0.6b (I 3072, the epilogue in place of its silu folded into the down GEMV) 1226.7
# -> 1201.0. Gains of 1-2%, about the runs' spread but of one sign. AUTO takes silu above
# silu_max_k up to 8192, and gelu.
# a8_fold (H100, 2026-12-05, `run_h200.sh a8_fold`, qwen3-8b batch 1 at 512 keys, graph replay): once the
# norm's codes were written by several programs a row (one program had quantized the whole row alone)
# w4 415.6 -> 425.4 tok/s, w8 288.8 -> 294.6, 508 -> 400 kernels a step (before, a tie on the H200); with
# 4 blocks a norm program and the attention merge's codes (be434ad) 364 kernels, w4 447.8, w8 294.7.
# attention_prologue (H100, 2026-12-05, `run_h200.sh policies`, `POLICIES="auto,auto+attention_prologue"`, graph
# replay): qwen3-0.6b 0.866 -> 0.864 ms at 512 keys, 1.217 -> 1.238 at 8192; qwen3-8b 5.716 -> 5.762, 6.159 ->
# 6.154; with PDL off, qwen3-0.6b 1.049 -> 1.033, 1.384 -> 1.393. 28-36 launches fewer, no faster: AUTO leaves it off.
# The sparse block's folds (H100, 2026-12-07, `MODEL=gpt-oss-20b POLICIES="auto+a8_fold=0,auto,auto+moe_combine" x2
# bash bench/run_h200.sh policies`, batch 1, 512 keys, graph replay): the norm writing MXFP4's int8 x (a8_fold)
# 2.111 / 2.106 -> 2.092 / 2.095 ms (339 -> 315 kernels a step, 464-466 -> 468 tok/s); the down projection
# summing the routes (moe_combine) 2.092 / 2.095 -> 2.133 / 2.126 ms (291 kernels): every route's program
# counts its arrival, and the down launch grew by more than the combine launch it replaced. AUTO leaves it off.
AUTO = Fusion(norm_max_k=2048, silu_max_k=6144, attention_merge=False, moe_norm_route=False, glu_silu_max_n=8192,
              glu_gelu=True, a8_fold=True)
ON = Fusion(norm_max_k=sys.maxsize, silu_max_k=sys.maxsize, attention_merge=True, moe_norm_route=True,
            glu_gelu=True, attention_prologue=True, a8_fold=True, moe_combine=True)
OFF = Fusion(norm_max_k=0, silu_max_k=0, attention_merge=False)  # the launches as before
POLICIES = {"auto": AUTO, "on": ON, "off": OFF}

_policy = AUTO


def policy() -> Fusion:
    """The policy kernels launch (and CUDA graphs capture) under."""
    return _policy


@contextlib.contextmanager
def using(choice: Fusion | str) -> Iterator[Fusion]:
    """Run a block under another policy ("auto", "on", "off" or a `Fusion`): for benchmarks
    and tuning, which compare policies in one process. Graphs captured inside keep it."""
    global _policy
    chosen = POLICIES[choice] if isinstance(choice, str) else choice
    previous, _policy = _policy, chosen
    try:
        yield chosen
    finally:
        _policy = previous
