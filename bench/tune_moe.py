"""Fused MoE on the GPU (issue 18): `fused_moe` at Qwen3-30B-A3B's expert shapes (H 2048, I 768,
E 128, top-8, bf16; int8 and int4 in groups of 128, as surgery's w8 and w4 pack them) and gpt-oss-20b's (H 2880, I 2880, E 32,
top-4, MXFP4 with biases, clamped SwiGLU), at T = 1, 8, 64, 512 tokens, against the torch
reference loop.

For every model and T: random router logits are routed by `moe_route` (Triton), the Triton
result is checked against the reference (relative error), then timed as the best of several
CUDA-event-timed replays of a CUDA graph that runs it over enough copies of the layer's experts
to overflow the L2 (so the weights come from memory, as in a model). Both expert paths are timed
(decode, grouped); "*" marks the one the dispatcher picks. Bytes are those a
layer must read: the distinct selected experts' weights, scales and biases, x and the output;
GB/s is given as a share of the H200's 4.8 TB/s. The reference (a Python loop over the hit
experts) is timed with events, without a graph (it syncs on the hit experts). --sweep also times each kind's SWEEP_TILES
(a few decode and grouped tiles; minutes, mostly compiling) and prints the fastest of each path.

    python3 bench/tune_moe.py [--tokens 1,8,64,512] [--models qwen3-30b-a3b,gpt-oss-20b,qwen3-30b-a3b-w8,...]
                              [--sweep] [--json PATH]
    TRITON_INTERPRET=1 python3 bench/tune_moe.py --tiny --sweep --tokens 1,8   # checks the script on a CPU

It imports hibana_kernels: install the checkout, or run it through bench/run_h200.sh (stage moe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import torch

from hibana_bench.tune_quant import time_graph
from hibana_kernels import moe, moe_triton
from hibana_kernels.moe import MoEExperts
from hibana_kernels.moe_triton import DecodeTiles, GroupedTiles

PEAK_BYTES_S = 4.8e12  # H200 HBM3e
ROTATE_BYTES = 1 << 30  # expert bytes cycled through per timing: the H200's L2 is 50 MB
MAX_REL_ERR = 2e-2
DEVICE = "cuda"


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    experts: int
    top_k: int
    kind: str  # "dense" (bf16), "mxfp4", "int8" (surgery's w8) or "int4" (w4, groups of 128)
    activation: str
    bias: bool
    scoring: str
    renormalize: bool


MODELS = {
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8, "dense", "silu", False, "softmax", True),
    "gpt-oss-20b": Shape(2880, 2880, 32, 4, "mxfp4", "swiglu_oai", True, "topk_softmax", False),
    "qwen3-30b-a3b-w8": Shape(2048, 768, 128, 8, "int8", "silu", False, "softmax", True),
    "qwen3-30b-a3b-w4": Shape(2048, 768, 128, 8, "int4", "silu", False, "softmax", True),
}
_D, _G = DecodeTiles, GroupedTiles
SWEEP_TILES = {  # per kind, a few besides choose_tiles' own (each compiles: the sweep stays within minutes)
    # narrow and wide (a whole 2048-wide row of Qwen3-30B-A3B's gate|up in one step, as the dense
    # GEMV reads its rows: every load of a program in flight at once; the same accumulator size
    # as 8 x 256's), not swept before 2026-12-02
    "dense": [_D(8, 256, 4, True), _D(16, 256, 4, True), _D(8, 512, 4, True), _D(1, 2048, 4, True),
              _D(2, 1024, 4, True), _D(2, 2048, 8, True), _D(4, 512, 4, True), _D(1, 1024, 2, True),
              _G(16, 128, 64, 4, 3)],
    # int8 rows are half bf16's bytes: wider K steps for the same bytes in flight
    "int8": [_D(8, 512, 4), _D(16, 512, 4, True), _D(8, 1024, 4, True), _D(16, 256, 4, True),
             _G(16, 64, 256, 4, 2), _G(16, 128, 128, 4, 3)],
    # 4-bit: words of 8 codes; more rows a thread share its x loads (16 rows, 4 warps)
    "int4": [_D(8, 512, 2, True), _D(16, 512, 4), _D(16, 512, 4, True), _D(16, 1024, 4, True), _D(32, 256, 4, True),
             _G(16, 64, 256, 4, 2), _G(16, 128, 128, 4, 3)],
}
# MXFP4: int4's tiles (words of 8 codes, as its GEMV reads them) and a few more (fewer registers:
# 8 x 256 in 2 warps, 78 registers on sm_90 (Triton 3.9), fits all 1440 gate|up programs of a
# gpt-oss-20b token in one wave)
SWEEP_TILES["mxfp4"] = SWEEP_TILES["int4"] + [_D(8, 256, 2, True), _D(16, 256, 2, True), _D(16, 128, 2, True),
                                               _D(8, 256, 1, True)]
# the 4-bit GEMVs' vector-input variant (`_gemv`'s X_VECTOR: a word's inputs in vector loads, its
# codes decoded as one tensor), at the tiles that won without it and two more
for _kind in ("int4", "mxfp4"):
    SWEEP_TILES[_kind] += [_D(8, 512, 2, True, True), _D(8, 256, 2, True, True), _D(16, 512, 4, True, True),
                           _D(4, 512, 2, True, True)]
# --wide: whole rows a program, or a row's steps written out (`unroll`: every step's load issued
# before the first product; 16-bit and int8), swept from 2026-12-03 (eighteenth session); a
# gpt-oss-20b row of 2880 codes is 360 words: a 4096-wide tile reads it in one step
WIDE_TILES = {
    "dense": [_D(2, 1024, 4, True, False, True), _D(2, 512, 4, True, False, True), _D(4, 512, 4, True, False, True),
              _D(1, 1024, 4, True, False, True), _D(2, 1024, 8, True, False, True), _D(1, 512, 2, True, False, True),
              _D(4, 1024, 8, True, False, True), _D(8, 512, 8, True, False, True), _D(4, 512, 8, True, False, True),
              _D(8, 1024, 8, True, False, True), _D(4, 2048, 8, True), _D(8, 256, 8, True, False, True),
              _D(4, 1024, 4, True, False, True), _D(8, 512, 4, True, False, True)],
    "int8": [_D(4, 1024, 4, True, False, True), _D(8, 512, 4, True, False, True), _D(2, 1024, 4, True, False, True),
             _D(4, 2048, 4, True)],
    "mxfp4": [_D(1, 4096, 4, True), _D(2, 4096, 4, True), _D(2, 4096, 8, True), _D(1, 4096, 2, True),
              _D(2, 2048, 4, True), _D(1, 2048, 2, True), _D(4, 1024, 2, True), _D(2, 1024, 1, True),
              _D(4, 4096, 8, True), _D(8, 1024, 4, True)],
}
WIDE_TILES["int4"] = WIDE_TILES["mxfp4"]
# --direct: MXFP4's codes straight into float32 bits, a block's 4 words in one load (`_gemv`'s DIRECT),
# from 2026-12-03 (nineteenth session)
DIRECT_TILES = {"mxfp4": [_D(n, k, w, True, direct=True) for n, k, w in (
    (8, 256, 1), (8, 512, 1), (4, 512, 1), (2, 1024, 1), (4, 1024, 1), (8, 1024, 1), (16, 1024, 1), (4, 1024, 2),
    (8, 1024, 2), (4, 2048, 2), (8, 2048, 2), (16, 2048, 4))]}
# --down: the down projection's own tiles beside the default gate|up's (DecodeTiles.down), from
# 2026-12-03: Qwen3-30B-A3B's down rows are 768 long, so a 1024-wide step leaves a quarter masked
_DENSE_BEFORE_DOWN = _D(4, 1024, 8, True, False, True)  # the bf16 default before DecodeTiles.down
DOWN_TILES = {"dense": [_DENSE_BEFORE_DOWN._replace(down=d) for d in (
    (4, 256, 4), (8, 256, 4), (4, 256, 2), (8, 256, 8), (4, 512, 4), (8, 512, 8), (2, 1024, 4), (2, 512, 2),
    (16, 256, 8), (1, 1024, 4), (2, 256, 2), (4, 128, 2))]}
# --split: split-K (DecodeTiles.split: a row shared among programs, the last to finish adding
# them), from 2026-12-03, for the MXFP4 GEMV's shortage of warps (bench/notes_decode.md); not yet timed
SPLIT_TILES = {"mxfp4": [_D(8, 256, 1, True, split=s) for s in (2, 3, 4)]
               + [_D(16, 256, 2, True, split=s) for s in (2, 3)] + [_D(8, 512, 2, True, split=3)]
               + [_D(8, 256, 1, True, direct=True, split=s) for s in (2, 3)],
               "dense": [moe_triton.DECODE_TILES["dense"]._replace(split=s) for s in (2, 3)]}
# --a8: MXFP4 against x and the activations as int8 codes per block of 32 (DecodeTiles.a8: e2m1
# table lookups and dp4a, ~2 instructions a weight), from 2026-12-03 (twenty-second session), the
# float GEMV's tiles and the long rows the dense x-int8 GEMV liked (2 rows x 2048 in 2 warps)
A8_TILES = {"mxfp4": [_D(n, k, w, True, a8=True) for n, k, w in (
    (8, 256, 1), (4, 256, 1), (8, 512, 2), (4, 512, 1), (2, 1024, 1), (4, 1024, 2), (2, 2048, 2), (1, 2048, 1),
    (4, 2048, 4), (2, 1024, 2), (1, 1024, 1), (8, 1024, 4))]
    + [_D(8, 256, 1, True, a8=True, split=s) for s in (2, 3)]}
TINY_MODELS = {  # --tiny: the same kinds at toy sizes, on the CPU through the Triton interpreter
    "tiny-bf16": Shape(128, 128, 4, 2, "dense", "silu", False, "softmax", True),
    "tiny-mxfp4": Shape(128, 128, 4, 2, "mxfp4", "swiglu_oai", True, "topk_softmax", False),
    "tiny-w8": Shape(128, 128, 4, 2, "int8", "silu", False, "softmax", True),
    "tiny-w4": Shape(128, 128, 4, 2, "int4", "silu", False, "softmax", True),
}
TINY_MAX_REL_ERR = 6e-2  # the interpreter truncates at each rounding to bfloat16 where CUDA rounds to nearest
A8_ERR_FACTOR = 2  # a8 tiles: x and the activations rounded to 8 bits a block cost ~1% more (tests: 1.1-1.3%)


def err_limit(row: dict, max_err: float) -> float:
    """The relative error a row may have against the reference: more for tiles that round x to int8."""
    return max_err * A8_ERR_FACTOR if row["tiles"] and row["tiles"].get("a8") else max_err


def make_experts(shape: Shape, gen: torch.Generator) -> MoEExperts:
    """One layer's experts with random weights on the GPU, outputs O(1) for unit-variance x."""
    e, h, i = shape.experts, shape.hidden, shape.inter
    dev = DEVICE
    if shape.kind == "dense":
        weights = dict(w13=(torch.randn(e, 2 * i, h, device=dev, generator=gen) / h ** 0.5).to(torch.bfloat16),
                       w2=(torch.randn(e, h, i, device=dev, generator=gen) / i ** 0.5).to(torch.bfloat16))
    elif shape.kind == "int8":
        def int8(n, k):  # codes uniform on [-127, 127] (std ~73): scales ~1 / (73 sqrt(k))
            codes = torch.randint(-127, 128, (e, n, k), dtype=torch.int8, device=dev, generator=gen)
            return codes, (0.5 + torch.rand(e, n, device=dev, generator=gen)) / (73 * k ** 0.5)
        (w13, s13), (w2, s2) = int8(2 * i, h), int8(h, i)
        weights = dict(w13=w13, w2=w2, w13_scales=s13, w2_scales=s2)
    elif shape.kind == "int4":
        def int4(n, k):  # codes uniform on 0..15 (std ~4.6) around zeros of 7.5: scales ~1 / (4.6 sqrt(k))
            packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
            scales = torch.full((e, n, k // 128), 1 / (4.6 * k ** 0.5), dtype=torch.float16, device=dev)
            return packed, scales, torch.full_like(scales, 7.5)
        (w13, s13, z13), (w2, s2, z2) = int4(2 * i, h), int4(h, i)
        weights = dict(w13=w13, w2=w2, w13_scales=s13, w2_scales=s2, w13_zeros=z13, w2_zeros=z2)
    else:
        def mxfp4(n, k):
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device=dev, generator=gen)
            scale = 127 - round(math.log2(k) / 2) - 2  # codes up to 6: about 1/sqrt(k) each
            return blocks, torch.randint(scale - 1, scale + 2, (e, n, k // 32), dtype=torch.uint8, device=dev,
                                         generator=gen)
        (w13, s13), (w2, s2) = mxfp4(2 * i, h), mxfp4(h, i)
        weights = dict(w13=w13, w2=w2, w13_scales=s13, w2_scales=s2)
    if shape.bias:
        weights.update(b13=torch.randn(e, 2 * i, device=dev, generator=gen) * 0.1,
                       b2=torch.randn(e, h, device=dev, generator=gen) * 0.1)
    return MoEExperts(shape.kind, activation=shape.activation, **weights)


def layer_bytes(experts: MoEExperts) -> int:
    return sum(t.numel() * t.element_size() for t in experts.tensors())


def bytes_read(experts: MoEExperts, ids: torch.Tensor, x: torch.Tensor) -> int:
    """The distinct selected experts' weights (scales, biases), x read and the output written."""
    return experts.bytes_per_token(1) * ids.unique().numel() + 2 * x.numel() * x.element_size()


def time_eager(fn, reps: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        if DEVICE == "cpu":
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def time_kernels(fn) -> float:
    """CUDA: the best replay of a CUDA graph of fn; CPU (--tiny, the interpreter): one call, to
    check the script, not to time anything."""
    return time_graph(fn) if DEVICE == "cuda" else time_eager(fn, reps=1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def measure(name: str, shape: Shape, tokens: int, copies: list[MoEExperts], sweep: bool,
            wide: bool = False, direct: bool = False, down: bool = False, split: bool = False,
            a8: bool = False) -> list[dict]:
    """Rows for one model and T: each path at its default tiles (and the sweep's), the reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, shape.experts, device=DEVICE, generator=gen)
    weights, ids = moe_triton.moe_route(logits, shape.top_k, scoring=shape.scoring, renormalize=shape.renormalize)
    ref_ids = moe.moe_route(logits, shape.top_k, scoring=shape.scoring, renormalize=shape.renormalize)[1]
    route_ok = torch.equal(ids.sort(dim=-1).values, ref_ids.sort(dim=-1).values)
    nbytes = bytes_read(copies[0], ids, x)
    expected = moe.fused_moe(x, copies[0], weights, ids)
    kind = copies[0].kind
    chosen = moe_triton.choose_tiles(tokens, kind)
    grouped_tokens = max(tokens, moe_triton.DECODE_MAX_TOKENS[kind] + 1)  # the grouped path's tiles at this T
    candidates = [moe_triton.choose_tiles(1, kind), moe_triton.choose_tiles(grouped_tokens, kind)]
    if sweep:
        candidates += SWEEP_TILES[kind]
    if wide:
        candidates += WIDE_TILES[kind]
    if direct:
        candidates += DIRECT_TILES.get(kind, [])
    if down:
        candidates += DOWN_TILES.get(kind, [])
    if split:
        candidates += SPLIT_TILES.get(kind, [])
    if a8:
        candidates += A8_TILES.get(kind, [])
    rows = []
    for tiles in dict.fromkeys(candidates):
        path = "grouped" if isinstance(tiles, GroupedTiles) else "decode"
        out = moe_triton.fused_moe_launch(x, copies[0], weights, ids, tiles)
        seconds = time_kernels(lambda: [moe_triton.fused_moe_launch(x, c, weights, ids, tiles) for c in copies])
        seconds /= len(copies)
        rows.append(dict(model=name, tokens=tokens, path=path, tiles=tiles._asdict(), picked=tiles == chosen,
                         us=seconds * 1e6, bytes=nbytes, gb_s=nbytes / seconds / 1e9,
                         peak_pct=100 * nbytes / seconds / PEAK_BYTES_S, rel_err=rel_err(out, expected),
                         route_matches_torch=route_ok))
    seconds = time_eager(lambda: [moe.fused_moe(x, c, weights, ids) for c in copies[:2]]) / 2
    rows.append(dict(model=name, tokens=tokens, path="torch reference", tiles=None, picked=False, us=seconds * 1e6,
                     bytes=nbytes, gb_s=nbytes / seconds / 1e9, peak_pct=100 * nbytes / seconds / PEAK_BYTES_S,
                     rel_err=0.0, route_matches_torch=route_ok))
    seconds = time_kernels(lambda: moe_triton.moe_route(logits, shape.top_k, scoring=shape.scoring,
                                                      renormalize=shape.renormalize))
    rows.append(dict(model=name, tokens=tokens, path="moe_route", tiles=None, picked=False, us=seconds * 1e6,
                     bytes=logits.numel() * 4, gb_s=0.0, peak_pct=0.0, rel_err=0.0, route_matches_torch=route_ok))
    block_m = moe_triton.choose_tiles(grouped_tokens, kind).block_m
    seconds = time_kernels(lambda: moe_triton.moe_align(ids, shape.experts, block_m))
    rows.append(dict(model=name, tokens=tokens, path="moe_align", tiles=None, picked=False, us=seconds * 1e6,
                     bytes=ids.numel() * 8, gb_s=0.0, peak_pct=0.0, rel_err=0.0, route_matches_torch=route_ok))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<15}{'T':>5}  {'path':<17}{'tiles':<24}{'us':>9}{'MB read':>9}{'GB/s':>8}{'% 4.8TB/s':>10}"
          f"{'rel err':>9}  route")
    for r in rows:
        tiles = ",".join(str(v) for v in r["tiles"].values()) if r["tiles"] else ""
        mark = "*" if r["picked"] else " "
        print(f"{r['model']:<15}{r['tokens']:>5} {mark}{r['path']:<17}{tiles:<24}{r['us']:>9.1f}"
              f"{r['bytes'] / 1e6:>9.1f}{r['gb_s']:>8.0f}{r['peak_pct']:>9.1f}%{r['rel_err']:>9.1e}  "
              f"{'ok' if r['route_matches_torch'] else 'DIFFERS'}")


def print_fastest(rows: list[dict], max_err: float) -> None:
    """The fastest tiles of each path per model and T, as choose_tiles' DECODE_TILES and GroupedTiles
    take them (the decode and grouped lines at one T also show which path should take that T)."""
    best = {}
    for r in rows:
        if r["tiles"] and r["rel_err"] <= err_limit(r, max_err):
            key = (r["model"], r["tokens"], r["path"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for (model, tokens, path), r in sorted(best.items()):
        tiles = (GroupedTiles if path == "grouped" else DecodeTiles)(**r["tiles"])
        print(f"fastest {path:<14} {model:<17} T={tokens:<4} {r['us']:8.1f} us {r['peak_pct']:5.1f}%  {tiles!r}")


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--models", help=f"default: all of {', '.join(MODELS)} (--tiny: of {', '.join(TINY_MODELS)})")
    parser.add_argument("--sweep", action="store_true", help="also time each kind's SWEEP_TILES")
    parser.add_argument("--wide", action="store_true", help="also time each kind's WIDE_TILES")
    parser.add_argument("--direct", action="store_true", help="also time each kind's DIRECT_TILES (MXFP4)")
    parser.add_argument("--down", action="store_true",
                        help="also time each kind's DOWN_TILES (the down projection's own)")
    parser.add_argument("--split", action="store_true", help="also time each kind's SPLIT_TILES (split-K)")
    parser.add_argument("--a8", action="store_true", help="also time each kind's A8_TILES (MXFP4 against int8 x)")
    parser.add_argument("--tiny", action="store_true",
                        help="toy shapes on the CPU through the Triton interpreter: checks the script, times nothing")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    models = TINY_MODELS if args.tiny else MODELS
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":  # read when triton is imported, before main
            raise SystemExit("--tiny runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        DEVICE = "cpu"
    rows = []
    for name in (args.models.split(",") if args.models else models):
        shape = models[name]
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        first = make_experts(shape, gen)
        copies = [first] + [make_experts(shape, gen) for _ in range(0 if args.tiny else
                                                                    max(1, ROTATE_BYTES // layer_bytes(first)))]
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows += measure(name, shape, tokens, copies, args.sweep, args.wide, args.direct, args.down, args.split,
                            args.a8)
        del copies, first
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print("* the path and tiles fused_moe picks; bytes: distinct selected experts + x + out")
    print_table(rows)
    max_err = TINY_MAX_REL_ERR if args.tiny else MAX_REL_ERR
    print_fastest(rows, max_err)
    bad = [r for r in rows if r["rel_err"] > err_limit(r, max_err) or not r["route_matches_torch"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", torch=torch.__version__,
                           shapes={k: asdict(v) for k, v in models.items()}, rows=rows), f, indent=1)
    if bad:
        raise SystemExit(f"{len(bad)} rows differ from the reference beyond {max_err} or in routing")


if __name__ == "__main__":
    main()
