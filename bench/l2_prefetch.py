"""Does asking the L2 for a GEMV's weights ahead of it make the GEMV faster? (`hibana_kernels.l2_prefetch`)

Each case is a CUDA graph: a write over 256 MB (the L2 is emptied of the weights), then a chain of
small dependent kernels standing for what runs between two projections in a decode step (norms,
attention's prologue, attention, its merge), then a one-row GEMV of the weight. Beside the chain,
on a side stream, the prefetch kernel asks for the weight ("lines", "bulk"), or nothing ("cold").
"warm" leaves the flush out: the weight is in the L2 from the replay before (where it fits). The
GEMV's time is the graph's minus the same graph without the GEMV (best replay of each,
`tune_quant.time_graph`).

    python3 bench/l2_prefetch.py [--chain 8] [--replays 100]
"""

from __future__ import annotations

import argparse

import torch

import hibana_kernels as kernels
from hibana_bench.tune_quant import time_graph
from hibana_kernels import l2_prefetch

SHAPES = {  # name: (N, K) of a one-row GEMV, bf16
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048), "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072), "qwen3-8b o": (4096, 4096), "qwen3-8b qkv": (6144, 4096),
}
VARIANTS = {"cold": None, "lines": l2_prefetch.parse("lines:64"), "bulk": l2_prefetch.parse("bulk:64"),
            "bulk-4p": l2_prefetch.parse("bulk:64:4"), "warm": None}


def _body(weight, x, flush, chain_state, chain: int, variant: str, gemv: bool):
    """One case's work: the flush (but "warm"), the prefetch on a side stream, the chain, the GEMV."""
    from hibana_kernels import l2_prefetch_triton as lt

    side, settings = torch.cuda.Stream(), VARIANTS[variant]

    def body():
        if variant != "warm":
            flush.add_(1)
        if settings is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                lt.prefetch(weight, settings.max_bytes, settings.bulk, settings.unit, settings.programs)
        for _ in range(chain):
            chain_state.mul_(1.0001)
        y = kernels.linear(x, weight) if gemv else None
        if settings is not None:
            torch.cuda.current_stream().wait_stream(side)
        return y

    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=8, help="small dependent kernels before the GEMV")
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    chain_state = torch.ones(1024, device=device)
    print(f"{'shape':22} {'MB':>6} " + " ".join(f"{v:>9}" for v in VARIANTS) + "   (GEMV us; chain of "
          f"{args.chain} kernels)")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        cells = []
        for variant in VARIANTS:
            with_gemv = time_graph(_body(weight, x, flush, chain_state, args.chain, variant, True), args.replays)
            without = time_graph(_body(weight, x, flush, chain_state, args.chain, variant, False), args.replays)
            cells.append((with_gemv - without) * 1e6)
        print(f"{name:22} {weight.numel() * 2 / 2**20:6.1f} " + " ".join(f"{c:9.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
