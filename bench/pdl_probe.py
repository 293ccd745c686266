"""Does programmatic dependent launch (PDL) pay in a decode step? A chain of dependent GEMVs
(each one's input the previous one's output), captured in one CUDA graph, launched plainly,
with PDL (`gdc_wait` before the first read of the input), and with PDL and the first weight
tile loaded before the wait; then a chain of tiny kernels (launch-bound). Prints us per kernel.

    python3 bench/pdl_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: no grid dependency control
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    if PREFETCH:
        w0 = tl.load(w_rows + offs_k[None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if PREFETCH:
        acc += tl.load(x_ptr + offs_k).to(tl.float32)[None, :] * w0.to(tl.float32)
        start = BLOCK_K
    else:
        start = 0
    for k0 in range(start, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        w = tl.load(w_rows + k0 + offs_k[None, :]).to(tl.float32)
        acc += x[None, :] * w
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + offs_n, (y * 0.01).to(y_ptr.dtype.element_ty))


@triton.jit
def _tiny(x_ptr, y_ptr, PDL: tl.constexpr):
    offs = tl.arange(0, 1024)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1)


def chain_time(launch, n: int) -> float:
    """us per kernel of n launches replayed from one graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            launch()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, rep=200, return_mode="median") * 1e3 / n


def main() -> None:
    print("triton", triton.__version__, "gdc:", gdc_wait is not None, flush=True)
    if gdc_wait is None:
        return
    dev = torch.device("cuda")
    n_kernels = 64
    for n, k in ((2048, 2048), (4096, 4096), (1536, 2048), (12288, 4096)):
        copies = max(4, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        xs = [torch.randn(max(n, k), device=dev, dtype=torch.bfloat16) for _ in range(2)]
        rows = {}
        for label, pdl, prefetch in (("plain", False, False), ("pdl", True, False), ("pdl+prefetch", True, True)):
            for bn, bk, warps in ((4, 1024, 4), (8, 512, 4), (2, 2048, 4), (16, 256, 4)):
                def launch(pdl=pdl, prefetch=prefetch, bn=bn, bk=bk, warps=warps):
                    for i in range(n_kernels):
                        src, dst = xs[i % 2], xs[(i + 1) % 2]
                        _gemv[(n // bn,)](src, ws[i % copies], dst, n, k, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                                          PREFETCH=prefetch, num_warps=warps, launch_pdl=pdl)
                try:
                    us = chain_time(launch, n_kernels)
                except Exception as exc:  # noqa: BLE001
                    print(f"{n}x{k} {label} {bn}x{bk}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                rows[(label, bn, bk)] = us
        best = {}
        for (label, bn, bk), us in rows.items():
            if label not in best or us < best[label][0]:
                best[label] = (us, bn, bk)
        nbytes = n * k * 2
        for label, (us, bn, bk) in best.items():
            print(f"gemv {n}x{k} ({nbytes / 1e6:.1f} MB) {label:13s} {us:7.2f} us/kernel "
                  f"({nbytes / us / 1e6:.2f} TB/s) tiles {bn}x{bk}", flush=True)
        del ws
    xs = [torch.zeros(1024, device=dev, dtype=torch.float32) for _ in range(2)]
    for label, pdl in (("plain", False), ("pdl", True)):
        def tiny(pdl=pdl):
            for i in range(256):
                _tiny[(1,)](xs[i % 2], xs[(i + 1) % 2], PDL=pdl, launch_pdl=pdl)
        print(f"tiny kernel chain {label:6s} {chain_time(tiny, 256):6.2f} us/kernel", flush=True)
    # correctness: a PDL chain gives the plain chain's result
    x0 = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    w = [torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    outs = []
    for pdl in (False, True):
        bufs = [x0.clone(), torch.empty_like(x0)]
        stream = torch.cuda.Stream()

        def run(pdl=pdl, bufs=bufs):
            for i in range(32):
                _gemv[(512,)](bufs[i % 2], w[i % 4], bufs[(i + 1) % 2], 2048, 2048, BLOCK_N=4, BLOCK_K=1024,
                              PDL=pdl, PREFETCH=pdl, num_warps=4, launch_pdl=pdl)
        with torch.cuda.stream(stream):
            run()
            torch.cuda.synchronize()
            bufs[0].copy_(x0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                run()
        torch.cuda.synchronize()
        bufs[0].copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(bufs[0].clone())
    print("pdl chain equals plain chain:", torch.equal(outs[0], outs[1]), flush=True)


if __name__ == "__main__":
    main()
