"""Decode attention at batch 1 by model shape: the split count, the decode tile and the split merge.

The decode graphs size their splits for the longest sequence a graph takes (its span: 1024, 2048
or max_model_len), so at 512 keys a layer runs the 1024 span's splits and at 8192 those of
max_model_len (8336 in `hibana bench decode`). Each variant is checked against one unsplit launch
and timed as a CUDA graph over enough layers' caches that they do not sit in L2; the table gives
us a layer and the floor that the layer's KV bytes set at the copy bandwidth.

These are the kernels alone, launch after launch. In a decode step they sit between the prologue
and the o projection, overlapped with both under programmatic dependent launch: a variant that
wins here by 1-2 us a layer gave nothing or lost in whole models (bench/RESULTS.md 2026-12-04:
qwen3-30b-a3b 2.3 us a layer faster here at 8192 keys, +0.5% tok/s in the model, -0.7% at
512). Judge a change by `tune_decode.py --fusion` with graphs recaptured.

    python3 bench/tune_attention.py             # every model at 1 x 512 and 1 x 8192, two at 8 x 8192 and 32 x 4096
    python3 bench/tune_attention.py --models qwen3-30b-a3b --shapes 1x8192 --batched ""
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from hibana_bench.tune_decode import time_graph
from hibana_bench.workloads import copy_bandwidth
from hibana_kernels import attention_triton as at

SHAPES = {  # query heads, KV heads, head_dim
    "qwen3-8b": (32, 8, 128),
    "qwen3-30b-a3b": (32, 4, 128),
    "gpt-oss-20b": (64, 8, 64),
    "qwen3-0.6b": (16, 8, 128),
    "phi4-mini": (24, 8, 128),
}
SPANS = {512: 1024, 8192: 8336}  # keys -> the span whose graph serves them
BLOCK_SIZE = 16


TILES = [(64, 4, 3), (64, 2, 3), (32, 4, 3), (32, 2, 3), (16, 2, 3)]
MERGES = [(16, 1), (32, 1), (32, 2), (64, 4)]


def sweep(model: str, batch: int, keys: int, bandwidth: float) -> dict:
    heads, kv_heads, d = SHAPES[model]
    head_dim_p = max(16, triton.next_power_of_2(d))
    span = SPANS.get(keys, keys) if batch == 1 else 8336
    per_seq = triton.cdiv(span, BLOCK_SIZE)
    blocks = batch * per_seq
    kv_bytes = 2 * batch * keys * kv_heads * d * 2
    cache_bytes = 2 * blocks * BLOCK_SIZE * kv_heads * d * 2
    layers = max(2, -(-(512 << 20) // cache_bytes))
    caches = [tuple(torch.randn(blocks, BLOCK_SIZE, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    ref = at.paged_attention_launch(q, *caches[0], tables, seq_lens, qsl, 1, scale, None, 1, (16, 4, 2))
    default_tile = at._decode_tiles(q.dtype, head_dim_p)
    default_min_split = max(at.DECODE_MIN_SPLIT, default_tile[0])
    default_key = (at._num_splits(q.device, batch * kv_heads, span, default_min_split), default_tile,
                   at._merge_tiles(head_dim_p))
    results, default = [], None
    for tile in TILES:
        min_split = tile[0]  # a split of whole tiles: as short as one
        by_length = triton.cdiv(span, min_split)
        # the split count as the engine picks it for this tile, then twice that and the powers of two
        pick = min(at.DECODE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
                   // (batch * kv_heads), by_length)
        wider = (16, 32, 64, 128, 256) if batch == 1 else (1,)
        splits_set = sorted({max(1, s) for s in (min(pick, at.MAX_SPLITS), pick, 2 * pick) + wider
                             if s <= min(by_length, 256)})
        keys_here = [(splits, tile, merge) for splits, merge in itertools.product(splits_set, MERGES)
                     if splits > 1 or merge == MERGES[0]]
        if tile == default_tile and default_key not in keys_here:
            keys_here.append(default_key)
        for key in keys_here:
            splits, _, merge_tiles = key
            saved, at.DECODE_MIN_SPLIT = at.DECODE_MIN_SPLIT, min_split
            try:
                def launch(k, v, splits=splits, tile=tile, merge_tiles=merge_tiles):
                    return at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, 1, scale, None, splits, tile,
                                                     decode=True, merge=False, merge_tiles=merge_tiles)
                out = launch(*caches[0])
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    print(f"  WRONG {model} {batch}x{keys} {key}: {err:.3g}")
                    continue

                def run(launch=launch):
                    for k, v in caches:
                        launch(k, v)
                us = time_graph(run) / layers * 1e6
            except Exception as exc:  # a tile that does not compile (registers, shared memory) is skipped
                print(f"  skipped {model} {batch}x{keys} {key}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                continue
            finally:
                at.DECODE_MIN_SPLIT = saved
            results.append(dict(us=round(us, 2), splits=splits, tile=tile, merge_tiles=merge_tiles))
            if key == default_key and min_split == default_min_split:
                default = results[-1]
    results.sort(key=lambda r: r["us"])
    floor = kv_bytes / bandwidth * 1e6
    best = results[0] if results else None
    print(f"{model:14s} {batch:2d} x {keys:5d} keys (span {span}): {kv_bytes / 1e6:6.1f} MB, floor {floor:6.2f} us | "
          f"default {default['us'] if default else '-':>6} us {default_key} | best {best}", flush=True)
    for r in results[1:5]:
        print(f"{'':50s} {r}")
    caches.clear()
    torch.cuda.empty_cache()
    return dict(model=model, batch=batch, keys=keys, span=span, kv_mb=kv_bytes / 1e6, floor_us=round(floor, 2),
                default=default, results=results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--shapes", default="1x512,1x8192", help="batch x keys, comma-separated")
    parser.add_argument("--batched", default="qwen3-8b,qwen3-30b-a3b",
                        help="models also swept at --batched-shapes")
    parser.add_argument("--batched-shapes", default="8x8192,32x4096")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us a layer (attention and its split merge)")
    runs = [(m, s) for m in args.models.split(",") for s in args.shapes.split(",")]
    runs += [(m, s) for m in args.batched.split(",") if m for s in args.batched_shapes.split(",")]
    rows = []
    for model, shape in runs:
        batch, keys = (int(x) for x in shape.split("x"))
        rows.append(sweep(model, batch, keys, bandwidth))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bandwidth, rows=rows), f)


if __name__ == "__main__":
    main()
