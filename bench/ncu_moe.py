"""A target for Nsight Compute: one token's MoE experts (`fused_moe` at T=1, the decode path) at
gpt-oss-20b's shape (MXFP4) and Qwen3-30B-A3B's (bf16), a few calls over copies of the layer
(weights from HBM, as in a model), inside cudaProfilerStart/Stop so that ncu sees only these.

    ncu --profile-from-start off --clock-control none --set full -k regex:decode_kernel \\
        python3 bench/ncu_moe.py --models gpt-oss-20b

Without ncu it prints each call's time (CUDA events), to check the target."""

from __future__ import annotations

import argparse

import torch

from hibana_bench.tune_moe import MODELS, make_experts
from hibana_kernels import moe_triton
from hibana_kernels.moe_triton import DecodeTiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b")
    parser.add_argument("--calls", type=int, default=2, help="profiled calls per model")
    parser.add_argument("--tiles", help="block_n,block_k,warps[,d]: decode tiles to use instead of DECODE_TILES' "
                        "(d: the direct MXFP4 GEMV)")
    args = parser.parse_args()
    for name in args.models.split(","):
        shape = MODELS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        copies = [make_experts(shape, gen) for _ in range(4)]
        x = torch.randn(1, shape.hidden, device="cuda", generator=gen).to(torch.bfloat16)
        logits = torch.randn(1, shape.experts, device="cuda", generator=gen)
        weights, ids = moe_triton.moe_route(logits, shape.top_k, scoring=shape.scoring, renormalize=shape.renormalize)
        tiles = moe_triton.choose_tiles(1, shape.kind)
        if args.tiles:
            n, k, w = (int(v) for v in args.tiles.split(",")[:3])
            tiles = DecodeTiles(n, k, w, down_per_route=True, direct=args.tiles.endswith(",d"))
        for c in copies:  # compiled and warm before the profiled range
            moe_triton.fused_moe_launch(x, c, weights, ids, tiles)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for i in range(args.calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            moe_triton.fused_moe_launch(x, copies[i % len(copies)], weights, ids, tiles)
            end.record()
            end.synchronize()
            print(f"{name} {tiles}: call {i} {start.elapsed_time(end) * 1e3:.1f} us (events, eager)", flush=True)
        torch.cuda.profiler.stop()
        del copies


if __name__ == "__main__":
    main()
