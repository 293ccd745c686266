"""The attention kernels on an fp8 KV cache (kv8) against a bf16 one, at the shapes of issue 14's
32-agent run: where kv8's 9% fewer turns/h come from (bench/RESULTS.md, thirteenth session).

    python3 bench/kv8_attention.py [--json FILE]       # on the GPU

Qwen3-8B heads (32 query, 8 KV, head_dim 128), blocks of 16, block tables shuffled, several
layers' caches rotated so that the keys come from memory, not the L2. Decode: batch x keys,
the split count `paged_attention` picks; prefill: one sequence's chunk of new tokens at the end of
its context (an agent's turn: tool result and question, ~550 tokens, over ~4.5k cached). Each
shape: bf16 at its default tiles, fp8 at its own default and at a few others (the fp8 tile of a
step moves half the bytes); us per layer and the KV bytes' rate. Tiles that do not give the
default tile's result on the same cache within 2e-2 (relative) are reported WRONG and not timed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from tune_decode import copy_bandwidth, time_graph

from hibana_kernels import attention_triton as at
from hibana_kernels.attention import FP8

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 8, 32, 128, 16
DECODE_SHAPES = ((1, 8192), (8, 8192), (32, 4608))
PREFILL_SHAPES = ((553, 4608), (2048, 8192))
DECODE_TILES = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 3), (256, 8, 2), (128, 4, 4)]
PREFILL_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)]


def caches(batch: int, ctx: int, dtype: torch.dtype) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Enough layers' (k, v) caches to exceed the L2 several times, and the fp8 scales."""
    blocks = batch * -(-ctx // BLOCK)
    per_layer = 2 * blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(2, -(-(256 << 20) // per_layer))
    made = []
    for _ in range(layers):
        k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        made.append((k.to(dtype), v.to(dtype)))  # fp8: values within e4m3's range at scale 1
    scale = torch.ones(2, KV_HEADS, device="cuda", dtype=torch.float32) if dtype == FP8 else None
    return made, scale


def time_shape(batch: int, ctx: int, q_len: int, tiles: list[tuple[int, ...]], defaults: Callable,
               bandwidth: float) -> list[dict]:
    decode = q_len == 1
    blocks = batch * -(-ctx // BLOCK)
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    splits = at._num_splits(q.device, batch * KV_HEADS, ctx) if decode else 1
    rows = []
    bf16_default, fp8_default = defaults(torch.bfloat16, HEAD_DIM), defaults(torch.bfloat16, HEAD_DIM, True)
    for dtype, default, candidates in ((torch.bfloat16, bf16_default, [bf16_default]),
                                       (FP8, fp8_default, [fp8_default] + [t for t in tiles if t != fp8_default])):
        layers, scale = caches(batch, ctx, dtype)
        reference = None  # per cache dtype: the default tile's output
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * dtype.itemsize
        for tile in candidates:
            def run(tile=tile, layers=layers, scale=scale):
                out = None
                for k, v in layers:
                    out = at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, q_len, HEAD_DIM ** -0.5, None,
                                                    splits, tile, decode=decode, kv_scale=scale)
                return out

            out = run().float()
            if reference is None:
                reference = out
            err = ((out - reference).norm() / reference.norm()).item()
            label = f"{'decode' if decode else 'prefill'} {batch}x{ctx}" + ("" if decode else f" +{q_len}")
            if not err < 2e-2:
                print(f"{label:24s} {str(dtype):16s} {str(tile):18s} WRONG (relative error {err:.2e})", flush=True)
                continue
            us = time_graph(run) / len(layers) * 1e6
            row = dict(shape=label, dtype=str(dtype), tile=tile, splits=splits, us=round(us, 2),
                       kv_mb=round(kv_bytes / 1e6, 1), pct=round(kv_bytes / (us / 1e6) / bandwidth * 100, 1),
                       default=tile == default, err=err)
            rows.append(row)
            print(f"{label:24s} {str(dtype):16s} {str(tile):18s}{' *' if tile == default else '  '} {us:8.2f} us  "
                  f"{row['kv_mb']:7.1f} MB  {row['pct']:5.1f}% of copy bandwidth", flush=True)
        del layers
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; * each cache's default tiles", flush=True)
    rows = []
    for batch, ctx in DECODE_SHAPES:
        rows += time_shape(batch, ctx, 1, DECODE_TILES, at._decode_tiles, bandwidth)
    for q_len, ctx in PREFILL_SHAPES:
        rows += time_shape(1, ctx, q_len, PREFILL_TILES, at._prefill_tiles, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
