"""Batch-1 decode on the GPU, taken apart: one device call that sweeps the GEMV's tiles against
cuBLAS, then times the engine's decode step with each fast-path piece switched on in turn, and
prints where the step's time goes. Notes and figures: bench/notes_decode.md.

    python3 bench/tune_decode.py [--model qwen3-8b] [--skip-sweep]
    python3 bench/tune_decode.py --model qwen3-0.6b --fusion

`--fusion` compares the kernel-fusion policies of `hibana_kernels.fusion` instead: each fold
against the separate kernels at the qwen3-0.6b and qwen3-8b shapes, then the model's decode step
under each policy (off: the launches as before; auto: folded by width; on: folded everywhere):
tok/s, share of the roofline, graph replay, and the kernels per step.

It imports hibana_bench and hibana_kernels: install the checkout (`pip install -e .`), or run it
through bench/run_h200.sh, which puts the checkout's folders on PYTHONPATH under those names.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import time
from collections import defaultdict

import torch
import triton
import triton.testing

from hibana_bench.models import PRESETS, load_bench_model
from hibana_bench.workloads import _read_bytes, copy_bandwidth, random_tokens
from hibana_core import SamplingParams
from hibana_kernels import fusion, pdl

OUT = os.environ.get("OUT", "bench/out")


def gemv_shapes(name: str) -> dict[str, tuple[int, int]]:
    p = PRESETS[name]
    h, i, d = p["hidden_size"], p["intermediate_size"], p.get("head_dim", p["hidden_size"] // p["num_attention_heads"])
    qkv = (p["num_attention_heads"] + 2 * p["num_key_value_heads"]) * d
    shapes = {"qkv": (qkv, h), "o": (h, p["num_attention_heads"] * d), "gate_up": (2 * i, h),
              "down": (h, i), "lm_head": (p["vocab_size"], h)}
    if "num_experts" in p or "num_local_experts" in p:  # the experts are fused_moe's (bench/tune_moe.py)
        del shapes["gate_up"], shapes["down"]
    return shapes


def time_graph(fn, reps: int = 20) -> float:
    """Median seconds of one call of fn, replayed from a CUDA graph."""
    return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median") / 1e3


def _gemv_configs(k: int, focused: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, warps, stages, unroll) to time at one row of K inputs: the full grid, or
    (focused) the default's neighbours and the row in 2-4 steps written out (`unroll`)."""
    if not focused:
        return [(bn, bk, w, st, False) for bn, bk, w, st in itertools.product(
            (1, 2, 4, 8, 16), (1024, 2048, 4096, 8192), (4, 8, 16), (1, 3))
            if 2048 <= bn * bk <= 32768 and (st == 1 or bk <= 2048) and bk <= triton.next_power_of_2(k)]
    configs = [(bn, bk, w, 1, False) for bn, bk, w in itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8))
               if bk <= triton.next_power_of_2(k)]
    configs += [(bn, bk, w, 1, True) for bn, bk, w in itertools.product((4,), (512, 1024, 2048), (4, 8))
                if 2 <= -(-k // bk) <= 4]
    return configs


def sweep_gemv(model: str, bandwidth: float, focused: bool = False) -> list[dict]:
    from hibana_kernels import matmul_triton

    rows = []
    for (label, (n, k)), m in itertools.product(gemv_shapes(model).items(), (1,)):
        configs = _gemv_configs(k, focused)
        nbytes = n * k * 2
        copies = max(1, -(-(256 << 20) // nbytes))  # rotate through > 256 MB: the L2 is 50 MB
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0])

        def cublas():
            for w in ws:
                torch.nn.functional.linear(x, w)

        t_cublas = time_graph(cublas) / copies
        best, results = None, []
        for cfg in configs:
            out = matmul_triton.linear_launch(x, ws[0], None, *cfg[:4], unroll=cfg[4])
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 1e-2:
                print(f"WRONG {label} m={m} {cfg}: rel err {err}")
                continue

            def ours(cfg=cfg):
                for w in ws:
                    matmul_triton.linear_launch(x, w, None, *cfg[:4], unroll=cfg[4])

            t = time_graph(ours) / copies
            results.append((round(t * 1e6, 1), cfg))
            if best is None or t < best[0]:
                best = (t, *cfg)
        print(label, "all:", sorted(results)[:8], flush=True)
        chosen = matmul_triton.gemv_config(m, n, k)
        t_chosen = time_graph(lambda: [matmul_triton.linear_launch(x, w, None, *chosen) for w in ws]) / copies
        rows.append(dict(shape=label, m=m, n=n, k=k, cublas_us=t_cublas * 1e6,
                         cublas_bw=nbytes / t_cublas / bandwidth, best_us=best[0] * 1e6,
                         best_bw=nbytes / best[0] / bandwidth, best=best[1:],
                         chosen=chosen, chosen_us=t_chosen * 1e6))
        r = rows[-1]
        print(f"{model} {label:8s} m={m} n={n} k={k} cublas {r['cublas_us']:8.1f} us ({r['cublas_bw']:.0%})  best {r['best_us']:8.1f} us "
              f"({r['best_bw']:.0%}) {r['best']}  chosen {r['chosen_us']:8.1f} us", flush=True)
        del ws
    return rows


def sweep_attention(bandwidth: float) -> list[dict]:
    """Decode attention (Qwen3-8B heads: 32 query, 8 KV, head_dim 128; blocks of 16) over tile
    sizes and split counts, at batch x context shapes of the benchmarks."""
    from hibana_kernels import attention_triton as at

    kv_heads, heads, d, bs = 8, 32, 128, 16
    tiles = [(32, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3)]
    rows = []
    for batch, ctx in ((1, 512), (1, 8192), (8, 8192), (32, 4096)):
        blocks = batch * ctx // bs
        kv_bytes = 2 * batch * ctx * kv_heads * d * 2
        layers = max(1, -(-(256 << 20) // kv_bytes))
        caches = [tuple(torch.randn(blocks, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                  for _ in range(layers)]
        tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, ctx // bs)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        ref = at.paged_attention_launch(q, *caches[0], tables, seq_lens, qsl, 1, d ** -0.5, None, 1, (16, 4, 2))
        default_splits = at._num_splits(q.device, batch * kv_heads, ctx)
        results = []
        for tile in tiles:
            for splits in sorted({1, 4, 8, 16, 32, 64, 128, default_splits}):
                if splits > -(-ctx // tile[0]):
                    continue
                out = at.paged_attention_launch(q, *caches[0], tables, seq_lens, qsl, 1, d ** -0.5, None, splits, tile)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    print(f"WRONG attention {batch}x{ctx} {tile} splits {splits}: {err}")
                    continue

                def run(tile=tile, splits=splits):
                    for k, v in caches:
                        at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, 1, d ** -0.5, None, splits, tile)

                t = time_graph(run) / layers
                results.append((round(t * 1e6, 1), tile, splits))
        results.sort()
        default_tile = at._decode_tiles(torch.bfloat16, d)
        default = [r for r in results if r[1] == default_tile and r[2] == default_splits]
        rows.append(dict(batch=batch, ctx=ctx, best=results[:6], default=default,
                         best_bw=kv_bytes / (results[0][0] / 1e6) / bandwidth))
        print(f"attention {batch}x{ctx}: {kv_bytes / 1e6:.1f} MB, floor {kv_bytes / bandwidth * 1e6:.1f} us; "
              f"default {default}; best {results[:5]}", flush=True)
        del caches
    return rows


def sweep_prefill(bandwidth: float) -> list[dict]:
    """Prefill attention (Qwen3-8B heads) for one chunk of q_len new tokens at the end of ctx."""
    from hibana_kernels import attention_triton as at

    kv_heads, heads, d, bs = 8, 32, 128, 16
    tiles = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2),
             (128, 32, 4, 3), (64, 128, 4, 2), (256, 64, 8, 3)]
    rows = []
    for q_len, ctx in ((512, 512), (512, 8192), (2048, 8192)):
        blocks = ctx // bs
        k, v = (torch.randn(blocks, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(1, blocks)
        seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
        q = torch.randn(q_len, heads, d, device="cuda", dtype=torch.bfloat16)
        flops = 4 * heads * d * sum(ctx - q_len + i + 1 for i in range(q_len))
        ref = at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, q_len, d ** -0.5, None, 1, (64, 64, 4, 2))
        results = []
        for tile in tiles:
            try:
                out = at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, q_len, d ** -0.5, None, 1, tile)
            except Exception as exc:  # out of shared memory or registers
                print(f"prefill {tile}: {type(exc).__name__}")
                continue
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 1e-2:
                print(f"WRONG prefill {q_len}@{ctx} {tile}: {err}")
                continue
            t = time_graph(lambda tile=tile: at.paged_attention_launch(
                q, k, v, tables, seq_lens, qsl, q_len, d ** -0.5, None, 1, tile))
            results.append((round(t * 1e6, 1), round(flops / t / 1e12), tile))
        sdpa_q = q.transpose(0, 1)[None]
        dense_k = k[tables[0].long()].reshape(ctx, kv_heads, d).transpose(0, 1)[None].repeat_interleave(4, 1)
        dense_v = v[tables[0].long()].reshape(ctx, kv_heads, d).transpose(0, 1)[None].repeat_interleave(4, 1)
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device="cuda").tril(ctx - q_len)
        t_sdpa = time_graph(lambda: torch.nn.functional.scaled_dot_product_attention(
            sdpa_q, dense_k, dense_v, attn_mask=mask if q_len != ctx else None, is_causal=q_len == ctx))
        results.sort()
        rows.append(dict(q_len=q_len, ctx=ctx, results=results, sdpa_us=t_sdpa * 1e6))
        print(f"prefill {q_len}@{ctx}: sdpa {t_sdpa * 1e6:.1f} us ({flops / t_sdpa / 1e12:.0f} TFLOP/s); "
              f"ours {results}", flush=True)
    return rows


def kernel_table(engine, label: str, top: int = 25) -> list[tuple[str, float, int]]:
    """GPU time per kernel name over 10 replays of the batch-1 decode graph."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs  # the batch-1 decode graph of the longest span captured
    graph, _ = graphs.graphs[max(k for k in graphs.graphs if k[:2] == (1, 1))]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type.name == "CUDA":
            t = totals[evt.name[:60]]
            t[0] += evt.device_time_total / 10
            t[1] += 1
    table = sorted(((name, us, n // 10) for name, (us, n) in totals.items()), key=lambda r: -r[1])
    total = sum(us for _, us, _ in table)
    print(f"\n[{label}] kernels per decode step: {sum(n for *_, n in table)}, busy {total:.0f} us")
    for name, us, n in table[:top]:
        print(f"  {us:8.1f} us  x{n:<4d} {name}")
    return table


def decode_figures(engine, prompts: dict[int, list[int]], generate: int) -> dict[int, dict]:
    """Per context: engine tok/s (wall, the bench's number) and the graph replay alone."""
    out = {}
    for ctx, prompt in prompts.items():
        h = engine.open_state(f"ctx{ctx}-{random.random()}")
        h.sync(prompt)
        res = h.generate(SamplingParams(max_tokens=generate, ignore_eos=True))
        wall = (res.stats.elapsed - (res.stats.time_to_first_token or 0.0)) / (generate - 1)
        g = engine.runner.graphs
        graph, _ = g.graphs[g.key(1, 1, ctx + generate - 1)]  # the graph the decode above ended on
        g.seq_lens[:1].fill_(ctx)  # the replay attends over ctx keys (the state's blocks)
        g.slot_mapping[:, :1].fill_(-1)  # and writes nowhere
        replay = triton.testing.do_bench(graph.replay, rep=300, return_mode="median") / 1e3
        out[ctx] = dict(wall_ms=wall * 1e3, replay_ms=replay * 1e3, tok_s=1 / wall)
        h.close()
    return out


def set_variant(engine, gemv: bool, prologue: bool, overlap: bool) -> None:
    """Switch the GEMV, the fused prologue and async scheduling on or off; recapture graphs."""
    import hibana_kernels.matmul_triton as mt
    import hibana_kernels.rotary_triton as rt
    from hibana_core.runner import DecodeGraphs

    mt.MAX_ROWS = 1 if gemv else 0
    if not hasattr(rt, "_fused"):
        rt._fused = rt.qk_norm_rotary_store
    rt.qk_norm_rotary_store = rt._fused if prologue else _unfused_prologue
    engine.core.async_scheduling = overlap
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner, runner.graphs.buckets[-1])


def _unfused_prologue(positions, q, k, v, cos, sin, k_cache, v_cache, slots, qw=None, kw=None, eps=0.0,
                      kv_scale=None, unit_offset=False):
    """The prologue as separate launches (q/k norms, rotary, the pass-through dims of a partial
    rotary joined back, KV store), as before the fused kernel; `kernels.qk_norm_rotary_store`'s
    signature, which the model calls."""
    import hibana_kernels as kernels

    if qw is not None:
        q, k = kernels.rms_norm(q, qw, eps, unit_offset), kernels.rms_norm(k, kw, eps, unit_offset)
    r = cos.shape[-1]
    q_rot, k_rot = kernels.rotary_embedding(positions, q[..., :r], k[..., :r], cos, sin)
    if r < q.shape[-1]:
        q_rot, k_rot = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
    kernels.store_kv(k_rot, v, k_cache, v_cache, slots, kv_scale)
    return q_rot


def _rotated(count_bytes: int, make) -> list:
    """Enough copies of make() to pass 256 MB, so the L2 (50 MB) serves none of them."""
    return [make() for _ in range(max(1, -(-(256 << 20) // count_bytes)))]


def _compare(label: str, separate, fused: dict, copies: int, nbytes: int, bandwidth: float,
             check) -> dict:
    """Time the separate launches and each fused variant (CUDA-graph replays, per copy)."""
    t_sep = time_graph(separate) / copies
    results = []
    for tiles, fn in fused.items():
        try:
            err = check(tiles)
        except Exception as exc:  # noqa: BLE001 - out of registers or shared memory for a tile
            print(f"  {label} {tiles}: {type(exc).__name__}")
            continue
        if not err < 1e-2:
            print(f"WRONG {label} {tiles}: rel err {err}")
            continue
        results.append((round(time_graph(fn) / copies * 1e6, 2), tiles))
    results.sort()
    row = dict(op=label, separate_us=t_sep * 1e6, fused=results,
               separate_bw=nbytes / t_sep / bandwidth,
               best_fused_bw=nbytes / (results[0][0] / 1e6) / bandwidth if results else None)
    best = f"{results[0][0]:7.2f} us {results[0][1]}" if results else "-"
    print(f"{label:34s} separate {t_sep * 1e6:7.2f} us ({row['separate_bw']:.0%})   fused best {best}   "
          f"all {results[:4]}", flush=True)
    return row


def sweep_fusion(models: list[str], bandwidth: float, dev: str = "cuda") -> list[dict]:
    """Each fold of `hibana_kernels.fusion` against the separate kernels it replaces, at one row
    and each model's shapes: fused_add_rms_norm + the qkv / gate_up GEMV, silu_and_mul + the
    down GEMV (the fused kernel at the GEMV's own tiles and a few wider ones), and split decode
    attention with the merge in its launch or in a second one, at 1 x 512 and 1 x 8192."""
    from hibana_kernels import activation_triton, attention_triton as at, matmul_triton as mt, norm_triton

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    rows = []
    bf16 = torch.bfloat16
    for model in models:
        shapes, p = gemv_shapes(model), PRESETS[model]
        for label in ("qkv", "gate_up", "down"):
            n, k = shapes[label]
            nbytes = n * k * 2
            ws = _rotated(nbytes, lambda: torch.randn(n, k, device=dev, dtype=bf16) / k ** 0.5)
            plain = mt.gemv_config(1, n, k)  # the separate kernels' GEMV
            chosen = mt.silu_gemv_config(k) if label == "down" else plain  # the fused one's default
            wide = triton.next_power_of_2(k) if k <= 4096 else 2048
            tiles = list(dict.fromkeys([chosen, (4, wide, 4), (4, wide, 8), (8, min(wide, 2048), 8)]))
            if label == "down":  # silu_and_mul + down
                gate_up = torch.randn(1, 2 * k, device=dev, dtype=bf16)

                def separate():
                    for w in ws:
                        mt.linear_launch(activation_triton.silu_and_mul(gate_up), w, None, *plain)

                def fused_fn(t):
                    return lambda: [mt.linear_launch(gate_up, w, None, *t, silu_input=True) for w in ws]

                ref = mt.linear_launch(activation_triton.silu_and_mul(gate_up), ws[0], None, *plain)

                def check(t, ref=ref):
                    return rel(mt.linear_launch(gate_up, ws[0], None, *t, silu_input=True), ref)

                name = f"{model} silu+down {n}x{k}"
            else:  # fused_add_rms_norm + qkv / gate_up
                x, res = (torch.randn(1, k, device=dev, dtype=bf16) for _ in range(2))
                nw = 1 + torch.randn(k, device=dev, dtype=bf16) / 4

                def separate():
                    for w in ws:
                        normed, _ = norm_triton.fused_add_rms_norm(x, res, nw, 1e-6)
                        mt.linear_launch(normed, w, None, *chosen)

                def fused_fn(t):
                    return lambda: [mt.rms_norm_linear_launch(x, res, nw, 1e-6, w, None, *t) for w in ws]

                ref = mt.linear_launch(norm_triton.fused_add_rms_norm(x, res, nw, 1e-6)[0], ws[0], None, *chosen)

                def check(t, ref=ref):
                    return rel(mt.rms_norm_linear_launch(x, res, nw, 1e-6, ws[0], None, *t)[0], ref)

                name = f"{model} norm+{label} {n}x{k}"
            rows.append(dict(model=model, n=n, k=k, **_compare(
                name, separate, {t: fused_fn(t) for t in tiles}, len(ws), nbytes, bandwidth, check)))
            del ws
        heads, kv_heads = p["num_attention_heads"], p["num_key_value_heads"]
        d, bs = p.get("head_dim", p["hidden_size"] // heads), 16
        for ctx in (512, 8192):
            blocks = ctx // bs
            kv_bytes = 2 * ctx * kv_heads * d * 2
            caches = _rotated(kv_bytes, lambda: tuple(
                torch.randn(blocks, bs, kv_heads, d, device=dev, dtype=bf16) for _ in range(2)))
            tables = torch.randperm(blocks, device=dev).to(torch.int32).view(1, blocks)
            seq_lens = torch.full((1,), ctx, dtype=torch.int32, device=dev)
            qsl = torch.arange(2, dtype=torch.int32, device=dev)
            q = torch.randn(1, heads, d, device=dev, dtype=bf16)
            splits = at._num_splits(q.device, kv_heads, ctx)

            def attend(merge, k, v):
                return at.paged_attention_launch(q, k, v, tables, seq_lens, qsl, 1, d ** -0.5, None, splits,
                                                 merge=merge)

            ref = attend(False, *caches[0])
            rows.append(dict(model=model, ctx=ctx, splits=splits, **_compare(
                f"{model} attention 1x{ctx} ({splits} splits)",
                lambda: [attend(False, k, v) for k, v in caches],
                {"merge in launch": lambda: [attend(True, k, v) for k, v in caches]},
                len(caches), kv_bytes, bandwidth, lambda _: rel(attend(True, *caches[0]), ref))))
            del caches
    return rows


def policy(spec: str) -> fusion.Fusion:
    """A fusion policy by name ("off", "auto", "on"), with "+field" switching a flag on over it
    ("auto+moe_norm_route") and "+field=N" setting a width limit ("auto+norm_max_k=3072")."""
    name, *changes = spec.split("+")
    fields = {}
    for change in changes:
        field, _, value = change.partition("=")
        fields[field] = int(value) if value else True
    return dataclasses.replace(fusion.POLICIES[name], **fields)


def variant(spec: str) -> contextlib.AbstractContextManager:
    """A decode variant by spec: a fusion policy (see `policy`), then optionally ";gemv=RULE" (one
    of matmul_triton.GEMV_RULES), ";moe=NxKxWARPS[xu]" (the bf16 experts' decode tiles, u:
    unrolled; the default's own down tiles kept, so before 2026-12-03 it set the down's too),
    ";moe_down=NxKxWARPS" (only their down projection's), ";mxfp4=NxKxWARPS[xd][xa][xsN]" (the
    MXFP4 experts', d: direct, a: against int8 x, sN: split-K in N), ";norm_gemv=NxKxWARPS" (the
    norm-then-GEMV's), ";splits=MAXxPERSM" (decode attention's most splits and programs an SM) and
    ";window_splits=0|1" (a sliding layer's decode split for its window's keys), e.g.
    "auto;gemv=whole_rows;moe=2x1024x4"."""
    from hibana_kernels import matmul_triton, moe_triton

    name, *options = spec.split(";")
    stack = contextlib.ExitStack()
    stack.enter_context(fusion.using(policy(name)))
    for option in options:
        key, _, value = option.partition("=")
        if key == "gemv":
            stack.enter_context(matmul_triton.using_gemv_rule(value))
        elif key in ("moe", "moe_down"):  # the bf16 experts' tiles, or only their down projection's
            n, k, warps, *unroll = value.split("x")
            tiles = moe_triton.DECODE_TILES["dense"]
            if key == "moe":
                tiles = moe_triton.DecodeTiles(int(n), int(k), int(warps), down_per_route=True, unroll=unroll == ["u"],
                                               down=tiles.down)
            else:
                tiles = tiles._replace(down=(int(n), int(k), int(warps)))
            stack.enter_context(moe_triton.using_decode_tiles("dense", tiles))
        elif key == "mxfp4":  # the MXFP4 experts' tiles, then d: the direct GEMV, a: int8 x, sN: split-K in N
            n, k, warps, *flags = value.split("x")
            split = next((int(f[1:]) for f in flags if f.startswith("s")), 1)
            tiles = moe_triton.DecodeTiles(int(n), int(k), int(warps), down_per_route=True, direct="d" in flags,
                                           split=split, a8="a" in flags)
            stack.enter_context(moe_triton.using_decode_tiles("mxfp4", tiles))
        elif key == "norm_gemv":
            stack.enter_context(matmul_triton.using_norm_gemv_tiles(tuple(int(v) for v in value.split("x"))))
        elif key == "splits":  # decode attention's MAX_SPLITS x DECODE_PROGRAMS_PER_SM
            from hibana_kernels import attention_triton

            most, per_sm = (int(v) for v in value.split("x"))
            before = attention_triton.MAX_SPLITS, attention_triton.DECODE_PROGRAMS_PER_SM
            attention_triton.MAX_SPLITS, attention_triton.DECODE_PROGRAMS_PER_SM = most, per_sm
            stack.callback(setattr, attention_triton, "MAX_SPLITS", before[0])
            stack.callback(setattr, attention_triton, "DECODE_PROGRAMS_PER_SM", before[1])
        elif key == "window_splits":  # decode attention's splits for a window's keys (1) or the sequence's (0)
            from hibana_kernels import attention_triton

            stack.callback(setattr, attention_triton, "WINDOW_SPLITS", attention_triton.WINDOW_SPLITS)
            attention_triton.WINDOW_SPLITS = value == "1"
        elif key == "merge_tile":  # decode attention's MERGE_TILE
            from hibana_kernels import attention_triton

            stack.callback(setattr, attention_triton, "MERGE_TILE", attention_triton.MERGE_TILE)
            attention_triton.MERGE_TILE = int(value)
        else:
            raise SystemExit(f"unknown variant option {option!r}")
    return stack


def fusion_ab(engine, prompts: dict[int, list[int]], generate: int, roofline: float,
              num_layers: int, policies: tuple[str, ...] = ("off", "auto", "on")) -> dict:
    """The engine's batch-1 decode under each fusion policy (or `variant` spec): graphs
    recaptured under it, tok/s and replay twice, then the kernels of one step."""
    from hibana_core.runner import DecodeGraphs

    out = {}
    for name in policies:
        with variant(name):
            runner = engine.runner
            runner.graphs = DecodeGraphs(runner, runner.graphs.buckets[-1])
            warm = engine.open_state("warm")
            warm.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=next(iter(prompts.values()))[:64])
            warm.close()
            runs = [decode_figures(engine, prompts, generate) for _ in range(2)]
            for figures in runs:
                for ctx, f in figures.items():
                    print(f"{name:5s} ctx {ctx:5d}: {f['tok_s']:7.1f} tok/s ({f['tok_s'] / roofline:.0%} of "
                          f"roofline), wall {f['wall_ms']:.3f} ms/token, graph replay {f['replay_ms']:.3f} ms, "
                          f"host {f['wall_ms'] - f['replay_ms']:.3f} ms", flush=True)
            table = kernel_table(engine, f"fusion={name}, ctx {max(prompts)}")
            launches = sum(n for *_, n in table)
            out[name] = dict(runs=runs, kernels=table, kernels_per_step=launches,
                             kernels_per_layer=sum(n // num_layers for *_, n in table))
    # per layer: each kernel's launches per step // layers (the embedding, the final norm and
    # the lm_head's GEMV are the step's only launches outside the layers)
    print(f"\n{'policy':8s}{'ctx':>7s}{'tok/s':>9s}{'% roof':>8s}{'replay ms':>11s}{'kernels/step':>14s}"
          f"{'per layer':>11s}")
    for name, r in out.items():
        per_layer = r["kernels_per_layer"]
        for ctx in prompts:
            best = max(run[ctx]["tok_s"] for run in r["runs"])
            replay = min(run[ctx]["replay_ms"] for run in r["runs"])
            print(f"{name:8s}{ctx:7d}{best:9.1f}{best / roofline:8.0%}{replay:11.3f}{r['kernels_per_step']:14d}"
                  f"{per_layer:11d}")
    return out


def surgery_options(args: argparse.Namespace) -> dict:
    """The engine options of --surgery (passes, no guard: these runs time, they do not judge)."""
    passes = [p for p in args.surgery.split(",") if p]
    return dict(surgery=passes, surgery_guard=False) if passes else {}


def main_fusion(args: argparse.Namespace, bandwidth: float) -> None:
    report: dict = {"bandwidth": bandwidth, "model": args.model}
    if not args.skip_sweep:
        report["sweep"] = sweep_fusion(list(dict.fromkeys([args.model, "qwen3-0.6b", "qwen3-8b"])), bandwidth)
    model = load_bench_model(args.model, torch.device("cuda"), torch.bfloat16)
    contexts = [int(c) for c in args.context.split(",")]
    rng = random.Random(0)
    prompts = {c: random_tokens(rng, c, model.vocab_size) for c in contexts}
    # no speculation: every step a plain decode step (random weights can repeat themselves,
    # and their drafts would mix verify steps in)
    engine = model.engine(max_model_len=max(contexts) + args.generate + 16, max_concurrent_agents=8,
                          speculation="off", **surgery_options(args))
    read = _read_bytes(engine) or model.weight_bytes  # MoE: the selected experts' bytes, not all
    roofline = bandwidth / read
    print(f"{args.model}: {model.weight_bytes / 1e9:.2f} GB, {read / 1e9:.2f} GB read a token, roofline "
          f"{roofline:.1f} tok/s", flush=True)
    report["roofline_tok_s"] = roofline
    report["policies"] = fusion_ab(engine, prompts, args.generate, roofline, PRESETS[args.model]["num_hidden_layers"],
                                   tuple(args.policies.split(",")))
    engine.close()
    with open(os.path.join(OUT, f"tune_decode_fusion_{args.model}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--context", default="512,8192")
    parser.add_argument("--generate", type=int, default=128)
    parser.add_argument("--skip-sweep", action="store_true", help="skip the GEMV sweep")
    parser.add_argument("--sweeps-only", action="store_true", help="stop after the kernel sweeps")
    parser.add_argument("--policies", default="off,auto,on",
                        help="--fusion: the policies compared, e.g. auto,auto+moe_norm_route,auto+norm_max_k=3072 (a field of "
                             "hibana_kernels.fusion.Fusion after +), each with ;gemv=RULE and ;moe=NxKxWARPS[xu] "
                             "(see variant), e.g. 'auto;gemv=whole_rows,auto'")
    parser.add_argument("--pdl", default="all",
                        help="programmatic dependent launch variants beside off, comma-separated: all, or "
                             "kinds of hibana_kernels.pdl.KINDS joined by + (gemv+attention), each with "
                             "<N for GEMV grids of at most N programs (all<1024; default pdl.MAX_PROGRAMS)")
    parser.add_argument("--gemv-sweep-only", action="store_true",
                        help="the GEMV tile sweep at the model's shapes, nothing else (--model may list several)")
    parser.add_argument("--focused", action="store_true",
                        help="--gemv-sweep-only: the default's neighbours and the unrolled rows, not the full grid")
    parser.add_argument("--step-only", action="store_true",
                        help="no kernel sweeps: the model's decode step alone (its variants and kernels)")
    parser.add_argument("--surgery", default="", help="--fusion: surgery passes of the engine (e.g. w4; no guard)")
    parser.add_argument("--fusion", action="store_true",
                        help="compare the fusion policies (hibana_kernels.fusion); --skip-sweep skips their sweep")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    if args.fusion:
        main_fusion(args, bandwidth)
        return
    report: dict = {"bandwidth": bandwidth}
    if args.gemv_sweep_only:
        report["gemv"] = [row for model in args.model.split(",") for row in sweep_gemv(model, bandwidth, args.focused)]
        with open(os.path.join(OUT, f"tune_decode_gemv_{args.model.replace(',', '_')}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        return
    if not (args.skip_sweep or args.step_only):
        report["gemv"] = sweep_gemv(args.model, bandwidth)
    if not args.step_only:
        report["attention"] = sweep_attention(bandwidth)
        report["prefill"] = sweep_prefill(bandwidth)
    if args.sweeps_only:
        with open(os.path.join(OUT, f"tune_decode_sweeps_{args.model}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        return

    t0 = time.time()
    model = load_bench_model(args.model, torch.device("cuda"), torch.bfloat16)
    contexts = [int(c) for c in args.context.split(",")]
    rng = random.Random(0)
    prompts = {c: random_tokens(rng, c, model.vocab_size) for c in contexts}
    # no speculation: every step a plain decode step (a random model's greedy output loops, and
    # its drafts would mix verify steps in)
    engine = model.engine(max_model_len=max(contexts) + args.generate + 16, max_concurrent_agents=8,
                          speculation="off", **surgery_options(args))
    read = _read_bytes(engine) or model.weight_bytes  # MoE: the selected experts' bytes, not all
    print(f"model built in {time.time() - t0:.0f} s; {model.weight_bytes / 1e9:.2f} GB, {read / 1e9:.2f} GB read "
          f"a token, roofline {bandwidth / read:.1f} tok/s", flush=True)
    warm = engine.open_state("warm")
    warm.generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=prompts[contexts[0]][:64])
    warm.close()
    report["variants"] = {}
    roofline = bandwidth / read
    # (GEMV, fused prologue, async scheduling, programmatic dependent launch: off, "all", or the
    # kinds of kernels that take it, "+" between, with "<N" for GEMV grids of at most N programs)
    variants = ((False, False, False, "off"), (True, True, False, "off"), (True, True, True, "off"),
                *((True, True, True, choice) for choice in args.pdl.split(",")))
    for gemv, prologue, overlap, dependent in variants[2:] if args.step_only else variants:
        label = (f"gemv={'on' if gemv else 'off'} prologue={'fused' if prologue else 'split'} "
                 f"async={'on' if overlap else 'off'} pdl={dependent}")
        kinds, _, most = dependent.partition("<")
        scope = dict(kinds=None if kinds == "all" else tuple(kinds.split("+")),
                     max_programs=int(most) if most else pdl.MAX_PROGRAMS)
        with pdl.using(dependent != "off", **scope):  # graphs captured (and kernels launched) under it
            set_variant(engine, gemv, prologue, overlap)
            warm = engine.open_state("warm")
            warm.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompts[contexts[0]][:64])
            warm.close()
            for rep in range(2):  # twice: the spread between runs of one version
                figures = decode_figures(engine, prompts, args.generate)
                report["variants"][f"{label} run {rep}"] = figures
                for ctx, f in figures.items():
                    print(f"{label:50s} ctx {ctx:5d}: {f['tok_s']:6.1f} tok/s ({f['tok_s'] / roofline:.0%} of "
                          f"roofline), wall {f['wall_ms']:.3f} ms/token, graph replay {f['replay_ms']:.3f} ms, "
                          f"host {f['wall_ms'] - f['replay_ms']:.3f} ms", flush=True)
    report["kernels"] = kernel_table(engine, "the last variant, ctx " + str(contexts[-1]))
    with open(os.path.join(OUT, "tune_decode.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    engine.close()


if __name__ == "__main__":
    main()
