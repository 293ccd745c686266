"""Weight-only int8 / int4 / fp8 linears on the GPU against bf16 cuBLAS, at the Qwen3-8B layer
shapes and the row counts of decode (1), speculation's verify (4, 16) and prefill chunks (64, 256).
fp8 is e4m3 with 128x128 scale blocks, as Qwen3-8B-FP8 stores it (--fp8-block to change).

For every shape and row count: the Triton kernels are first checked against the torch
references (relative error of the output), then each of bf16 `F.linear`, `linear_int8`,
`linear_int4` and `linear_fp8` is timed as the best of several CUDA-event-timed replays of a CUDA graph that runs
it over enough weight copies to overflow the L2 (so weights come from memory, as in a model).
Bytes moved are the weight (with its scales and zeros), x and y; GB/s is given as a share of the
device copy bandwidth measured in the same run. At every row count the path the dispatcher did
not pick is timed too (the crossovers GEMV_MAX_ROWS and DEQUANT_MIN_ROWS). --sweep times tiles instead, for
choose_tiles (minutes: give it few rows and shapes).

    python3 bench/tune_quant.py [--json PATH] [--group-size 128] [--fp8-block 128,128] [--rows 1,4,16,64,256]
    python3 bench/tune_quant.py --sweep --rows 1,64 [--shapes o,down] [--json PATH]
    python3 bench/tune_quant.py --a8 [--shapes ...] [--json PATH]   # x int8 (dp4a) at one row, int4 and int8

It imports hibana_kernels and hibana_bench: install the checkout, or run it through
bench/run_h200.sh, which puts the checkout's folders on PYTHONPATH under those names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F
import triton

from hibana_bench.workloads import copy_bandwidth
from hibana_kernels import counters, quant, quant_triton
from hibana_kernels.quant_triton import A8GemvTiles, DotTiles, GemmTiles, GemvTiles

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
            "down": (4096, 12288), "lm_head": (151936, 4096)}  # name: (N, K) of the weight
ROTATE_BYTES = 256 << 20  # weight copies cycled through per timing: the H200's L2 is 50 MB
MAX_REL_ERR = 1e-2
DEQUANTIZE = "dequantize+cublas"  # as `tiles`: the path that dequantizes the weight first
FORMATS = ("bf16", "int8", "int4", "fp8")  # the table's columns; bf16 first, the baseline


def time_graph(fn, reps: int = 10) -> float:
    """Best seconds of one call of fn over `reps` CUDA-event-timed replays of a CUDA graph (no
    launch overhead from Python in the figure)."""
    fn()  # compiles the Triton kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    best = math.inf
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del graph
    return best


def make_weights(fmt: str, n: int, k: int, group_size: int, block: tuple[int, int] = (128, 128)) -> list[dict]:
    """Copies of a random weight in format fmt ("bf16", "int8", "int4", "fp8"), as keyword
    arguments of its linear (fp8: with its scale block), enough of them to fill ROTATE_BYTES."""
    dev = dict(device="cuda")

    def one() -> dict:
        if fmt == "bf16":
            return dict(weight=torch.randn(n, k, dtype=torch.bfloat16, **dev) / k ** 0.5)
        if fmt == "fp8":
            blocks = (-(-n // block[0]), -(-k // block[1]))
            return dict(qweight=(64 * torch.randn(n, k, **dev)).clamp(-448, 448).to(torch.float8_e4m3fn),
                        scales=(0.5 + torch.rand(*blocks, **dev)) / (64 * k ** 0.5), block=block)
        if fmt == "int8":
            return dict(qweight=torch.randint(-127, 128, (n, k), dtype=torch.int8, **dev),
                        scales=(0.5 + torch.rand(n, **dev)) / (73 * k ** 0.5))
        groups = (n, k // group_size)
        return dict(qweight=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, **dev),
                    scales=((0.5 + torch.rand(*groups, **dev)) / (4.6 * k ** 0.5)).half(),
                    zeros=(7.5 + 2 * torch.randn(*groups, **dev)).half())

    first = one()
    nbytes = weight_bytes(first)
    return [first] + [one() for _ in range(max(1, -(-ROTATE_BYTES // nbytes)) - 1)]


def weight_bytes(weights: dict) -> int:
    return sum(t.nbytes for t in weights.values() if isinstance(t, torch.Tensor))


def runner(fmt: str, group_size: int, tiles: GemvTiles | DotTiles | GemmTiles | None = None):
    """fn(x, weights) for format fmt: the dispatcher's kernel, or the one `tiles` names."""
    if fmt == "bf16":
        return lambda x, w: F.linear(x, w["weight"])
    if fmt == "fp8" and tiles is None:
        return lambda x, w: quant_triton.linear_fp8(x, w["qweight"], w["scales"], w["block"])
    if fmt == "fp8":  # DEQUANTIZE is the launcher's None
        tiles = None if tiles == DEQUANTIZE else tiles
        return lambda x, w: quant_triton.linear_fp8_launch(x, w["qweight"], w["scales"], w["block"], None, tiles)
    if tiles == DEQUANTIZE:
        tiles = None  # the launchers' None: dequantize, then cuBLAS
    elif tiles is None:
        return lambda x, w: (quant_triton.linear_int8(x, w["qweight"], w["scales"]) if fmt == "int8" else
                             quant_triton.linear_int4(x, w["qweight"], w["scales"], w["zeros"], group_size))
    if fmt == "int8":
        return lambda x, w: quant_triton.linear_int8_launch(x, w["qweight"], w["scales"], None, tiles)
    if tiles is None:
        return lambda x, w: quant_triton.linear_int4(x, w["qweight"], w["scales"], w["zeros"], group_size)
    return lambda x, w: quant_triton.linear_int4_launch(x, w["qweight"], w["scales"], w["zeros"],
                                                        group_size, None, tiles)


def reference(fmt: str, group_size: int, x: torch.Tensor, w: dict) -> torch.Tensor:
    """The torch reference in float32 (the oracle; bf16 rounding of the output is the kernels')."""
    x = x.float()
    if fmt == "bf16":
        return F.linear(x, w["weight"].float())
    if fmt == "int8":
        return quant.linear_int8(x, w["qweight"], w["scales"])
    if fmt == "fp8":
        return quant.linear_fp8(x, w["qweight"], w["scales"], w["block"])
    return quant.linear_int4(x, w["qweight"], w["scales"], w["zeros"], group_size)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure(fmt: str, group_size: int, x: torch.Tensor, copies: list[dict], bandwidth: float,
            ref: torch.Tensor, tiles: GemvTiles | DotTiles | GemmTiles | None = None) -> dict:
    """Check one variant against `ref` (the reference's output on copies[0]), then time it
    over the weight copies."""
    fn = runner(fmt, group_size, tiles)
    err = rel_err(fn(x, copies[0]), ref)
    row = dict(format=fmt, rel_err=err, ok=err < MAX_REL_ERR,
               kernel=_kernel_name(fmt, x.shape[0], copies[0], group_size, tiles))
    if not row["ok"]:
        print(f"WRONG {fmt} {row['kernel']} m={x.shape[0]}: relative error {err:.3g}", flush=True)
        return row
    seconds = time_graph(lambda: [fn(x, w) for w in copies]) / len(copies)
    n = next(iter(copies[0].values())).shape[0]
    nbytes = weight_bytes(copies[0]) + x.nbytes + x.shape[0] * n * x.element_size()
    row.update(us=seconds * 1e6, bytes=nbytes, gb_s=nbytes / seconds / 1e9,
               of_copy_bw=nbytes / seconds / bandwidth)
    return row


def _kernel_name(fmt, rows, w, group_size, tiles) -> str:
    if fmt == "bf16":
        return "cublas"
    if tiles is None:
        n, k = w["qweight"].shape[0], w["qweight"].shape[1] * (2 if fmt == "int4" else 1)
        tiles = (quant_triton.choose_tiles_fp8(rows, n, k) if fmt == "fp8" else
                 quant_triton.choose_tiles(rows, n, k, group_size if fmt == "int4" else 1, torch.bfloat16,
                                           counters.sm_count(torch.device("cuda"))))
    return DEQUANTIZE if tiles in (None, DEQUANTIZE) else f"{type(tiles).__name__}{tuple(tiles)}"


def other_kernel(fmt: str, rows: int, n: int, k: int, group_size: int) -> GemvTiles | GemmTiles | str:
    """The path the dispatcher did not pick at `rows`: the GEMM for the GEMV's rows, dequantizing
    for the GEMM's, the GEMM for dequantizing's."""
    group = group_size if fmt == "int4" else 1

    def choose(rows_: int):
        return quant_triton.choose_tiles_fp8(rows_, n, k) if fmt == "fp8" else \
            quant_triton.choose_tiles(rows_, n, k, group, torch.bfloat16, counters.sm_count(torch.device("cuda")))

    if rows <= quant_triton.GEMV_MAX_ROWS:
        return choose(quant_triton.GEMV_MAX_ROWS + 1)
    if rows >= quant_triton.DEQUANT_MIN_ROWS:
        return choose(quant_triton.DEQUANT_MIN_ROWS - 1)
    return DEQUANTIZE


def sweep(fmt: str, group_size: int, rows: int, n: int, k: int, bandwidth: float,
          block: tuple[int, int] = (128, 128), words_only: bool = False) -> list[dict]:
    """Tiles of the kernel for `rows` (GEMV at decode rows, GEMM above), best first. words_only
    (int4, groups of 128+): the words kernel's tiles alone (with and without PREFETCH; at batch
    rows beside the GEMM at its tiles), a few minutes for the four layers."""
    group = group_size if fmt == "int4" else 1
    if words_only and fmt == "int4" and group_size >= quant_triton.WORDS_MIN_GROUP:
        grid = [DotTiles(bn, sp, 8 if bn == 256 else 4, st, True, pre, bm) for bn, sp, st, pre, bm in
                itertools.product((128, 256), (2, 4, 8, 16), (3, 4), (False, True), (16, 32, 64))
                if sp <= k // group_size and bm <= max(16, triton.next_power_of_2(rows))
                and (rows <= quant_triton.GEMV_MAX_ROWS or st == 3)]
        if rows > quant_triton.GEMV_MAX_ROWS:
            grid.append(quant_triton._gemm_tiles(rows, triton.next_power_of_2(k), group_size))  # (not chosen there)
    elif rows <= quant_triton.GEMV_MAX_ROWS:
        grid = [GemvTiles(bn, bk, w, xv) for bn, bk, w, xv in itertools.product(
            (8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8), (False, True) if fmt == "int4" else (False,))
            if bk >= group and bn * bk <= 32768 and bk <= triton.next_power_of_2(k)]
        if fmt == "int4" and quant_triton.dot_fits(k, group_size):  # on tensor cores, K split or whole
            grid += [DotTiles(bn, sp, 8 if bn == 256 else 4, st, words, pre) for bn, sp, st, words, pre in
                     itertools.product((16, 32, 64, 128, 256), (1, 2, 4, 8, 16), (3, 4), (False, True), (False, True))
                     if sp <= k // group_size and (group_size >= 128 or not words) and (bn < 256 or words)
                     and (words or not pre) and (bn >= 64 or not pre)]
    else:
        grid = [GemmTiles(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product(
            (16, 32, 64, 128), (64, 128, 256), (64, 128), (4, 8), (3,))
            if bk >= group and bm <= max(16, triton.next_power_of_2(rows)) and bm * bn <= 128 * 256]
        if fmt == "int4" and group_size >= quant_triton.WORDS_MIN_GROUP and quant_triton.dot_fits(k, group_size):
            # the words kernel over batch rows: 16-64 rows a program (more programs over x's rows)
            grid += [DotTiles(bn, sp, 4, 3, True, pre, bm) for bn, sp, pre, bm in itertools.product(
                (64, 128), (1, 2, 4, 8), (False, True), (16, 32, 64))
                if sp <= k // group_size and bm <= max(16, triton.next_power_of_2(rows))]
    copies = make_weights(fmt, n, k, group_size, block)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    ref = reference(fmt, group_size, x, copies[0])
    results = []
    for tiles in grid:
        try:
            results.append(measure(fmt, group_size, x, copies, bandwidth, ref, tiles))
        except Exception as error:  # noqa: BLE001 - tiles too large for shared memory, or worse
            print(f"  {fmt} {tiles}: {type(error).__name__}: {str(error)[:120]}", flush=True)
    del copies
    return sorted((r for r in results if r["ok"]), key=lambda r: r["us"])


def sweep_a8(fmt: str, n: int, k: int, group_size: int, bandwidth: float, rows: int = 1) -> tuple[dict, list[dict]]:
    """`rows` rows of bf16 x: the x int8 GEMV's tiles (x's quantization included in each time) on
    int4 or int8 weights, checked against its own reference (x rounded to 8 bits a block of 32),
    beside the kernel the dispatcher takes without it (HIBANA_A8_ROWS=0) checked against the
    exact one; the x int8 GEMV's error against the exact product is reported, not judged.
    Returns (the other kernel's row, the GEMV's rows best first)."""
    copies = make_weights(fmt, n, k, group_size)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    exact = reference(fmt, group_size, x, copies[0])
    w0 = copies[0]
    group = group_size if fmt == "int4" else 1
    a8_ref = quant.reference_a8(x, w0["qweight"], w0["scales"], w0.get("zeros"), group).float()
    a8_rows, quant_triton.A8_MAX_ROWS = quant_triton.A8_MAX_ROWS, 0
    try:
        tiles = quant_triton.choose_tiles(rows, n, k, group, torch.bfloat16, counters.sm_count(x.device))
        base = measure(fmt, group_size, x, copies, bandwidth, exact, tiles)
    finally:
        quant_triton.A8_MAX_ROWS = a8_rows
    if rows == 1:
        grid = [A8GemvTiles(bn, bk, w, st) for bn, bk, w, st in itertools.product(
            (1, 2, 4, 8), (1024, 2048, 4096), (2, 4, 8), (1, 2))
            if bk <= triton.next_power_of_2(k) and (st == 1 or bk == 1024)]
    else:  # a program a row (each reads the weight again) or several (the weight's words once for them)
        grid = [A8GemvTiles(bn, bk, w, 1, bm) for bn, bk, w, bm in itertools.product(
            (1, 2, 4), (1024, 2048), (2, 4), sorted({1, 2, min(8, triton.next_power_of_2(rows))}))
            if bk <= triton.next_power_of_2(k) and bm <= triton.next_power_of_2(rows)]
    results = []
    for tiles in grid:
        try:
            row = measure(fmt, group_size, x, copies, bandwidth, a8_ref, tiles)
        except Exception as error:  # noqa: BLE001 - tiles too large, or worse
            print(f"  a8 {tiles}: {type(error).__name__}: {str(error)[:120]}", flush=True)
            continue
        row["rel_err_vs_exact"] = rel_err(runner(fmt, group_size, tiles)(x, w0), exact)
        results.append(row)
    del copies
    return base, sorted((r for r in results if r["ok"]), key=lambda r: r["us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size along K")
    parser.add_argument("--fp8-block", default="128,128", help="fp8 scale block: output rows,input columns")
    parser.add_argument("--rows", default="1,4,16,64,256", help="row counts M, comma-separated")
    parser.add_argument("--shapes", default=",".join(QWEN3_8B), help="layers, comma-separated")
    parser.add_argument("--formats", default=",".join(FORMATS[1:]), help="--sweep: the formats swept")
    parser.add_argument("--sweep", action="store_true",
                        help="sweep the tiles at each of --rows instead (minutes: use few rows and shapes)")
    parser.add_argument("--words-only", action="store_true",
                        help="--sweep of int4: the words kernel's tiles only (and the GEMM's default at batch rows)")
    parser.add_argument("--a8", action="store_true",
                        help="the x int8 (dp4a) GEMV's tiles on int4 and int8 weights against the 16-bit x kernels")
    parser.add_argument("--a8-rows", default="1", help="--a8: row counts, comma-separated (e.g. 1,2,4,8)")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    block = tuple(int(b) for b in args.fp8_block.split(","))
    shapes = {name: QWEN3_8B[name] for name in args.shapes.split(",")}
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"int4 group size {args.group_size}; fp8 block {block[0]}x{block[1]}; GEMV up to "
          f"{quant_triton.GEMV_MAX_ROWS} rows", flush=True)
    header = (f"{'layer':8s} {'M':>4s} | {'bf16 us':>9s} {'%bw':>4s} | {'int8 us':>9s} {'%bw':>4s} "
              f"{'x bf16':>6s} | {'int4 us':>9s} {'%bw':>4s} {'x bf16':>6s} | {'fp8 us':>9s} {'%bw':>4s} "
              f"{'x bf16':>6s} | other kernel (int8 / int4 / fp8 us)")
    results, sweeps = [], []
    if args.a8:
        for rows, name, fmt in itertools.product([int(r) for r in args.a8_rows.split(",")], args.shapes.split(","),
                                                 ("int4", "int8")):
            n, k = QWEN3_8B[name]
            base, best = sweep_a8(fmt, n, k, args.group_size, bandwidth, rows)
            sweeps.append(dict(layer=name, n=n, k=k, m=rows, format=f"{fmt}_a8", base=base, best=best[:12]))
            print(f"a8 {fmt} {name:8s} m={rows}: 16-bit x {base['kernel']} {base.get('us', float('nan')):.1f} us "
                  f"({base.get('of_copy_bw', 0):.0%}); a8 best: " + ", ".join(
                      f"{tuple(r['kernel'].split('(')[1].rstrip(')').split(', '))} {r['us']:.1f} us "
                      f"({r['of_copy_bw']:.0%}, err vs exact {r['rel_err_vs_exact']:.2%})" for r in best[:5]),
                  flush=True)
        args.sweep, shapes = True, {}
    if not args.sweep:
        print(header)
    for (name, (n, k)), fmt in itertools.product(shapes.items() if not args.sweep else (),
                                                 FORMATS):
        copies = make_weights(fmt, n, k, args.group_size, block)
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            ref = reference(fmt, args.group_size, x, copies[0])
            row = dict(layer=name, n=n, k=k, m=rows,
                       **measure(fmt, args.group_size, x, copies, bandwidth, ref))
            if fmt != "bf16":
                row["other_kernel"] = measure(fmt, args.group_size, x, copies, bandwidth, ref,
                                              other_kernel(fmt, rows, n, k, args.group_size))
            results.append(row)
        del copies
        torch.cuda.empty_cache()
        if fmt == FORMATS[-1]:
            _print_layer(results, name, rows_list)
    if args.sweep:
        for (name, (n, k)), fmt, rows in itertools.product(shapes.items(), args.formats.split(","), rows_list):
            best = sweep(fmt, args.group_size, rows, n, k, bandwidth, block, args.words_only)
            sweeps.append(dict(layer=name, n=n, k=k, m=rows, format=fmt, best=best[:8]))
            print(f"sweep {name:8s} {fmt} m={rows}: " + ", ".join(
                f"{r['kernel']} {r['us']:.1f} us ({r['of_copy_bw']:.0%})" for r in best[:4]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, copy_bandwidth=bandwidth,
                           group_size=args.group_size, fp8_block=list(block),
                           gemv_max_rows=quant_triton.GEMV_MAX_ROWS,
                           rows=results, sweeps=sweeps), f, indent=1)


def _print_layer(results: list[dict], name: str, rows_list: list[int]) -> None:
    """One table line per row count of layer `name`, once its three formats are measured."""
    for rows in rows_list:
        by_fmt = {r["format"]: r for r in results if r["layer"] == name and r["m"] == rows}
        base = by_fmt["bf16"].get("us")
        cells = []
        for fmt in FORMATS:
            r = by_fmt[fmt]
            if "us" not in r:
                cells.append(f"{'WRONG':>9s} {'':>4s}" + ("" if fmt == "bf16" else f" {'':>6s}"))
                continue
            cell = f"{r['us']:9.1f} {r['of_copy_bw']:4.0%}"
            if fmt != "bf16":
                cell += f" {base / r['us']:5.2f}x" if base else f" {'':>6s}"
            cells.append(cell)
        others = [by_fmt[f].get("other_kernel", {}).get("us") for f in FORMATS[1:]]
        other = " / ".join("-" if t is None else f"{t:.1f}" for t in others)
        print(f"{name:8s} {rows:4d} | " + " | ".join(cells) + f" | {other}", flush=True)


if __name__ == "__main__":
    main()
