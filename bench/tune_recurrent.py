"""Gated DeltaNet's delta rule on the GPU, prefill-sized: the token-by-token kernel against the chunked
one, at a hybrid model's linear-attention layer (qwen3.5-35b-a3b's by default: 16 key heads, 32 value
heads, Dk = Dv = 128, bf16 rows, float32 states).

Steps: one sequence of 64 (CHUNKED_MIN_ROWS, where the engine switches), 256, 1024, 4096 and 8192
rows, and 8 sequences of 512. q, k and v are views of one fused row, as the layer splits its
convolution's output. Per step both kernels run from the same states; the chunked one's output and
final states are checked against the token-by-token one's (and both states against the torch
reference), then each is timed as the median of CUDA-graph replays: us a call and rows a us.
--sweep times the chunked kernel under other tiles (rows a chunk, Dv block, warps, stages).

    python3 bench/tune_recurrent.py [--model qwen3.5-27b] [--steps 1x4096,8x512] [--json PATH]
    python3 bench/tune_recurrent.py --sweep [--steps 1x4096,8x512]

It imports hibana_kernels and hibana_bench: install the checkout, or run it through
bench/run_h200.sh, which puts the checkout's folders on PYTHONPATH under those names.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from hibana_bench.models import PRESETS
from hibana_bench.tune_decode import time_graph
from hibana_kernels import recurrent, recurrent_triton as rt
from hibana_kernels.recurrent_triton import ChunkTiles

STEPS = "1x64,1x256,1x1024,1x4096,1x8192,8x512"  # sequences x rows each
MAX_REL_ERR = {"output": 1e-2, "state": 1e-4}
"""The chunked kernel's distance from the token-by-token one (norm of the difference over the
latter's norm): the outputs are bf16, a rounding apart (2^-9 an element); the states float32,
the same sums in another order."""
SWEEP = [ChunkTiles(chunk, 32, warps, 2) for chunk in (16, 32, 64) for warps in (4, 8)]
SWEEP += [ChunkTiles(16, 16, 8, 2), ChunkTiles(16, 64, 8, 2), ChunkTiles(16, 32, 8, 1), ChunkTiles(16, 32, 8, 3)]


def make_step(model: str, sequences: int, rows: int, seed: int = 0) -> dict:
    """The kernels' arguments for `sequences` sequences of `rows` rows each, continuing from random
    states, in the layer's layout: q, k, v views of the fused rows, g float32, beta in bf16."""
    p = PRESETS[model]
    hk, hv = p["linear_num_key_heads"], p["linear_num_value_heads"]
    dk, dv = p["linear_key_head_dim"], p["linear_value_head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sequences * rows
    dev = dict(device="cuda", generator=gen)
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, **dev).to(torch.bfloat16)  # [T, conv_dim]
    q, k, v = mixed.split((hk * dk, hk * dk, hv * dv), dim=-1)
    return dict(q=q.unflatten(-1, (hk, dk)), k=k.unflatten(-1, (hk, dk)), v=v.unflatten(-1, (hv, dv)),
                g=-F.softplus(torch.randn(tokens, hv, **dev) * 2 - 2),  # exp(g) mostly around 0.9
                beta=torch.rand(tokens, hv, **dev).to(torch.bfloat16),
                state=torch.randn(sequences, hv, dk, dv, **dev) * 0.1,
                slots=torch.arange(sequences, dtype=torch.int32, device="cuda"),
                has_state=torch.ones(sequences, dtype=torch.bool, device="cuda"),
                query_start_loc=torch.arange(0, tokens + 1, rows, dtype=torch.int32, device="cuda"))


def token_by_token(step: dict, state: torch.Tensor) -> torch.Tensor:
    return rt.gated_delta_rule(step["q"], step["k"], step["v"], step["g"], step["beta"], state, step["slots"],
                               step["has_state"], step["query_start_loc"])


def chunked(step: dict, state: torch.Tensor, tiles: ChunkTiles = rt.CHUNK_TILES) -> torch.Tensor:
    return rt.chunked_delta_rule(step["q"], step["k"], step["v"], step["g"], step["beta"], state, step["slots"],
                                 step["has_state"], step["query_start_loc"], tiles=tiles)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def timed(fn, step: dict) -> float:
    """us a call of fn(step, state) on a copy of the step's states (each call writes them)."""
    state = step["state"].clone()
    return time_graph(lambda: fn(step, state)) * 1e6


def compare(model: str, sequences: int, rows: int) -> dict:
    """Both kernels on one step: their agreement, then their times."""
    step = make_step(model, sequences, rows)
    states = {name: step["state"].clone() for name in ("token", "chunked", "torch")}
    out_token = token_by_token(step, states["token"])
    out_chunked = chunked(step, states["chunked"])
    recurrent.gated_delta_rule(step["q"], step["k"], step["v"], step["g"], step["beta"], states["torch"],
                               step["slots"], step["has_state"], step["query_start_loc"])
    row = dict(sequences=sequences, rows=rows, output_err=rel_err(out_chunked, out_token),
               state_err=rel_err(states["chunked"], states["token"]),
               token_state_err_torch=rel_err(states["token"], states["torch"]),
               chunked_state_err_torch=rel_err(states["chunked"], states["torch"]))
    row["ok"] = row["output_err"] < MAX_REL_ERR["output"] and row["state_err"] < MAX_REL_ERR["state"]
    if not row["ok"]:
        print(f"WRONG {sequences} x {rows}: output {row['output_err']:.3g}, state {row['state_err']:.3g}", flush=True)
        return row
    row.update(token_us=timed(token_by_token, step), chunked_us=timed(chunked, step))
    return row


def sweep(model: str, sequences: int, rows: int) -> list[dict]:
    """The chunked kernel under each of SWEEP's tiles: agreement with the default's, then its time."""
    step = make_step(model, sequences, rows)
    want_state = step["state"].clone()
    want = chunked(step, want_state)
    results = []
    for tiles in SWEEP:
        state = step["state"].clone()
        try:
            err = rel_err(chunked(step, state, tiles), want)
            state_err = rel_err(state, want_state)
            us = timed(functools.partial(chunked, tiles=tiles), step) if state_err < MAX_REL_ERR["state"] else None
        except Exception as exc:  # noqa: BLE001  a tile that does not compile (shared memory) is reported
            print(f"  {sequences} x {rows} {tiles}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            continue
        results.append(dict(sequences=sequences, rows=rows, tiles=tiles._asdict(), output_err=err,
                            state_err=state_err, us=us))
        mark = " (default)" if tiles == rt.CHUNK_TILES else ""
        shown = f"{us:9.1f} us {sequences * rows / us:7.2f} rows/us" if us else "WRONG"
        print(f"  {sequences} x {rows:5d} chunk {tiles.chunk:2d} block_dv {tiles.block_dv:2d} warps {tiles.num_warps} "
              f"stages {tiles.num_stages}: {shown}; output {err:.1e}, state {state_err:.1e}{mark}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.5-35b-a3b", help="a preset with linear-attention layers")
    parser.add_argument("--steps", default=STEPS, help="sequences x rows each, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="time the chunked kernel's tiles instead")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    steps = [tuple(int(x) for x in s.split("x")) for s in args.steps.split(",")]
    p = PRESETS[args.model]
    print(f"{torch.cuda.get_device_name()}: {args.model}'s delta rule, {p['linear_num_key_heads']} key heads, "
          f"{p['linear_num_value_heads']} value heads, Dk {p['linear_key_head_dim']}, Dv "
          f"{p['linear_value_head_dim']}, bf16 rows; chunked tiles {tuple(rt.CHUNK_TILES)}", flush=True)
    if args.sweep:
        results = [r for sequences, n in steps for r in sweep(args.model, sequences, n)]
    else:
        print(f"{'step':>10s} | {'token us':>9s} {'rows/us':>7s} | {'chunked us':>10s} {'rows/us':>7s} | "
              f"{'speed-up':>8s} | chunked vs token: output, state | state vs torch: token, chunked")
        results = []
        for sequences, n in steps:
            row = compare(args.model, sequences, n)
            results.append(row)
            if row["ok"]:
                tokens = sequences * n
                print(f"{sequences:2d} x {n:5d} | {row['token_us']:9.1f} {tokens / row['token_us']:7.2f} | "
                      f"{row['chunked_us']:10.1f} {tokens / row['chunked_us']:7.2f} | "
                      f"{row['token_us'] / row['chunked_us']:7.1f}x | {row['output_err']:.1e}, "
                      f"{row['state_err']:.1e} | {row['token_state_err_torch']:.1e}, "
                      f"{row['chunked_state_err_torch']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model=args.model,
                           tiles=rt.CHUNK_TILES._asdict(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
