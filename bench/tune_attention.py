"""Decode attention at batch 1 by model shape: the split count, the decode tile and the split merge.

The decode graphs size their splits for the longest sequence a graph takes (its span: 1024, 2048
or max_model_len), so at 512 keys a layer runs the 1024 span's splits and at 8192 those of
max_model_len (8336 in `hibana bench decode`). Each variant is checked against one unsplit launch
and timed as a CUDA graph over enough layers' caches that they do not sit in L2; the table gives
us a layer and the share of the copy bandwidth that the layer's KV bytes would take.

    python3 bench/tune_attention.py                       # every shape, 512 and 8192 keys
    python3 bench/tune_attention.py --models qwen3-30b-a3b --contexts 8192
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

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


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def time_graph(fn, reps: int = 30) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def variants(head_dim_p: int, by_length: int, default_splits: int):
    splits = sorted({s for s in (default_splits, 16, 32, 64, 128, 256) if s <= by_length})
    tiles = [(64, 4, 3), (32, 4, 3), (64, 8, 3), (64, 2, 3)]
    merges = [("sep", (head_dim_p, 4)), ("sep", (head_dim_p, 8)), ("sep", (64, 4)), ("sep", (32, 4)),
              ("sep", (32, 2)), ("sep", (16, 1)), ("in", None)]
    return [(s, t, m) for s, t, m in itertools.product(splits, tiles, merges) if s > 1 or m[0] == "sep"]


def sweep(model: str, keys: int, bandwidth: float, quick: bool) -> dict:
    heads, kv_heads, d = SHAPES[model]
    head_dim_p = max(16, triton.next_power_of_2(d))
    span = SPANS.get(keys, keys)
    blocks = triton.cdiv(span, BLOCK_SIZE)
    kv_bytes = 2 * keys * kv_heads * d * 2
    cache_bytes = 2 * blocks * BLOCK_SIZE * kv_heads * d * 2
    layers = max(2, -(-(512 << 20) // cache_bytes))
    caches = [tuple(torch.randn(blocks, BLOCK_SIZE, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, blocks)
    seq_lens = torch.full((1,), keys, dtype=torch.int32, device="cuda")
    qsl = torch.arange(2, dtype=torch.int32, device="cuda")
    q = torch.randn(1, heads, d, device="cuda", dtype=torch.bfloat16)
    scale = d ** -0.5
    ref = at.paged_attention_launch(q, *caches[0], tables, seq_lens, qsl, 1, scale, None, 1, (16, 4, 2))
    min_split = max(at.DECODE_MIN_SPLIT, at._decode_tiles(q.dtype, head_dim_p)[0])
    default_splits = at._num_splits(q.device, kv_heads, span, min_split)
    by_length = triton.cdiv(span, 32)
    candidates = variants(head_dim_p, by_length, default_splits)
    default_key = (default_splits, at._decode_tiles(q.dtype, head_dim_p), ("sep", at._merge_tiles(head_dim_p)))
    if quick:
        candidates = [c for c in candidates if c[1] == default_key[1]]
    results = []
    for splits, tile, (kind, merge_tiles) in candidates:
        min_split = min(at.DECODE_MIN_SPLIT, tile[0]) if tile[0] < 64 else at.DECODE_MIN_SPLIT
        if splits > triton.cdiv(span, max(min_split, tile[0])):
            continue  # splits past the span's keys hold none
        saved, at.DECODE_MIN_SPLIT = at.DECODE_MIN_SPLIT, min_split  # 32-key tiles: 32-key splits
        try:
            def launch(k, v, splits=splits, tile=tile, kind=kind, merge_tiles=merge_tiles):
                return at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, 1, scale, None, splits, tile,
                                                 decode=True, merge=kind == "in", merge_tiles=merge_tiles)
            out = launch(*caches[0])
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 1e-2:
                print(f"  WRONG {model} {keys} splits {splits} tile {tile} merge {kind} {merge_tiles}: {err:.3g}")
                continue

            def run(launch=launch):
                for k, v in caches:
                    launch(k, v)
            us = time_graph(run) / layers * 1e6
        except Exception as exc:  # a tile that does not compile (registers, shared memory) is skipped
            print(f"  skipped {model} {keys} splits {splits} tile {tile} merge {kind} {merge_tiles}: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        finally:
            at.DECODE_MIN_SPLIT = saved
        results.append(dict(us=round(us, 2), splits=splits, tile=tile, merge=kind, merge_tiles=merge_tiles,
                            key=(splits, tile, (kind, merge_tiles))))
    results.sort(key=lambda r: r["us"])
    default = next((r for r in results if r["key"] == default_key), None)
    for r in results:
        del r["key"]
    floor = kv_bytes / bandwidth * 1e6
    row = dict(model=model, keys=keys, span=span, kv_mb=kv_bytes / 1e6, floor_us=round(floor, 2),
               default=default, best=results[:8])
    best = results[0] if results else None
    print(f"{model:14s} {keys:5d} keys (span {span}): {kv_bytes / 1e6:5.1f} MB, floor {floor:5.2f} us | default "
          f"{default['us'] if default else '-':>6} us ({default_splits} splits) | best {best['us'] if best else '-':>6} us: "
          f"{best}", flush=True)
    for r in results[1:6]:
        print(f"{'':40s} {r}")
    caches.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--contexts", default="512,8192")
    parser.add_argument("--quick", action="store_true", help="the default decode tile only")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us a layer, batch 1")
    rows = [sweep(m, int(c), bandwidth, args.quick) for m in args.models.split(",")
            for c in args.contexts.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
