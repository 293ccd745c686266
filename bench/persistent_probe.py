"""Would a persistent kernel a layer pay? A chain of dependent GEMVs (each link's input the
previous link's output, every link its own weight so the L2 does not serve them) run two ways:

    kernels      one launch a link, captured in a CUDA graph, programmatic dependent launch and the
                 first weight tile loaded before `gdc_wait` (the decode step's kernels today)
    persistent   one launch for the whole chain, one program an SM; each program loads its rows of
                 the next link's weight into registers before the grid barrier that waits for the
                 current link's output, so the barrier's wait overlaps the next weight's loads

and the barrier alone (a chain of empty phases) against a chain of tiny PDL kernels. Prints us a
link, the bandwidth that is, and whether each chain gives the torch chain's result.

    python3 bench/persistent_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from pdl_probe import _gemv, _tiny, chain_time, gdc_wait


@triton.jit
def _grid_arrive(counter_ptr):
    """A program's arrival at a grid barrier: its CTA's stores are ordered before it by the CTA
    barrier and the release. (A release also waits for the program's loads in flight: a weight
    prefetch goes out after the arrival, not before.)"""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _grid_wait(counter_ptr, target, POLL_ATOMIC: tl.constexpr):
    """Wait until `target` arrivals are counted (a monotonic counter: the i-th barrier of P
    programs waits for i * P); the acquire orders the loads after it."""
    if POLL_ATOMIC:
        while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
    else:
        while tl.load(counter_ptr, volatile=True) < target:
            pass
    tl.debug_barrier()


@triton.jit
def _grid_barrier(counter_ptr, target, POLL_ATOMIC: tl.constexpr):
    _grid_arrive(counter_ptr)
    _grid_wait(counter_ptr, target, POLL_ATOMIC)


@triton.jit
def _chain_kernel(x_ptr, w_ptr, counter_ptr, L, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  POLL_ATOMIC: tl.constexpr, AHEAD: tl.constexpr):
    """x[i + 1] = (W[i] @ x[i]) * 0.01 for i < L, each program owning BLOCK_N rows of every W. At
    each barrier the rows of the link AHEAD (1 or 2) past the current one go out, so a program has
    AHEAD links' weights in flight (registers for them all)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K)
    w_tile = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    w = tl.load(w_tile)
    if AHEAD == 2:
        w_next = tl.load(w_tile + N * K, mask=(offs_n < N)[:, None] & (L > 1), other=0.0)
    for i in range(L):
        x = tl.load(x_ptr + i * K + offs_k, cache_modifier=".cg")
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(x_ptr + (i + 1) * K + offs_n, (y * 0.01).to(x_ptr.dtype.element_ty))
        _grid_arrive(counter_ptr)
        if AHEAD == 2:
            w = w_next
            w_next = tl.load(w_tile + (i + 2) * N * K, mask=(offs_n < N)[:, None] & (i + 2 < L), other=0.0)
        elif i + 1 < L:  # the next link's rows: out while the barrier waits
            w = tl.load(w_tile + (i + 1) * N * K)
        _grid_wait(counter_ptr, (i + 1) * nprog, POLL_ATOMIC)


@triton.jit
def _barrier_chain_kernel(counter_ptr, L, POLL_ATOMIC: tl.constexpr):
    nprog = tl.num_programs(0)
    for i in range(L):
        _grid_barrier(counter_ptr, (i + 1) * nprog, POLL_ATOMIC)


def torch_chain(x0: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    x = x0
    for w in ws:
        x = ((w.float() @ x.float()) * 0.01).to(x0.dtype)
    return x


def main() -> None:
    print("triton", triton.__version__, "gdc:", gdc_wait is not None, torch.cuda.get_device_name(), flush=True)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_ms = triton.testing.do_bench(lambda dst=big[: 1 << 29], src=big[1 << 29:]: dst.copy_(src), rep=100,
                                      return_mode="median")
    bandwidth = 2 * (1 << 29) / copy_ms / 1e9  # TB/s, read + write
    print(f"SMs {sms}, copy bandwidth {bandwidth:.2f} TB/s", flush=True)
    del big
    links = 64
    torch.manual_seed(0)
    for n, k in ((2048, 2048), (4096, 1024), (1024, 4096), (1024, 2048), (1024, 1024)):
        ws = torch.randn(links, n, k, device=dev, dtype=torch.bfloat16) * (k ** -0.5) * 100
        nbytes = n * k * 2
        ideal = nbytes / bandwidth / 1e6
        # kernels: the PDL chain with the weight tile before the wait, its best tile
        xs = [torch.randn(max(n, k), device=dev, dtype=torch.bfloat16) for _ in range(2)]
        best = None
        for bn, bk, warps in ((4, 1024, 4), (8, 512, 4), (2, 2048, 4), (16, 256, 4), (4, 2048, 8)):
            if bk > k:
                continue

            def launch(bn=bn, bk=bk, warps=warps, ws=ws):
                for i in range(links):
                    _gemv[(n // bn,)](xs[i % 2], ws[i], xs[(i + 1) % 2], n, k, BLOCK_N=bn, BLOCK_K=bk, PDL=True,
                                      PREFETCH=True, num_warps=warps, launch_pdl=True)
            try:
                us = chain_time(launch, links)
            except Exception as exc:  # noqa: BLE001
                print(f"  kernels {bn}x{bk}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            if best is None or us < best[0]:
                best = (us, f"{bn}x{bk}/{warps}w")
        print(f"gemv {n}x{k} ({nbytes / 1e6:.1f} MB, {ideal:.2f} us at copy bandwidth)", flush=True)
        if best:
            print(f"  kernels     {best[0]:6.2f} us a link ({nbytes / best[0] / 1e6:.2f} TB/s) tiles {best[1]}", flush=True)
        # persistent
        one = n // sms_floor(n, sms)
        # Every program must be resident at once (a grid barrier spins): one an SM, or two small ones.
        # Two programs an SM holding two links' weights each (AHEAD=2 at one // 2 rows) are not all
        # resident on an H100 and hang.
        for ahead, block_n, warps, poll in ((1, one, 8, True), (1, one // 2, 4, True), (2, one, 8, True),
                                            (2, one, 16, True)):
            programs = n // block_n
            act = torch.zeros(links + 1, max(n, k), device=dev, dtype=torch.bfloat16)
            counter = torch.zeros(1, device=dev, dtype=torch.int32)

            def run(block_n=block_n, warps=warps, poll=poll, act=act, counter=counter, programs=programs,
                    ahead=ahead, ws=ws):
                counter.zero_()
                _chain_kernel[(programs,)](act, ws, counter, links, N=n, K=k, BLOCK_N=block_n, POLL_ATOMIC=poll,
                                           AHEAD=ahead, num_warps=warps)
            try:
                if n == k:  # correctness against torch before timing (a chain of other shapes is timed only)
                    act[0] = torch.randn(k, device=dev, dtype=torch.bfloat16)
                    run()
                    torch.cuda.synchronize()
                    want = torch_chain(act[0], ws)
                    got = act[links]
                    ok = torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.05 * want.float().abs().max().item())
                    ok = f"equal to torch: {ok} (counter {counter.item()} of {links * programs})"
                else:
                    ok = ""
                us = chain_time(run, links)
            except Exception as exc:  # noqa: BLE001
                print(f"  persistent{ahead} {block_n} rows/{warps}w: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            print(f"  persistent{'2' if ahead == 2 else ' '} {us:6.2f} us a link ({nbytes / us / 1e6:.2f} TB/s) {programs} programs x {block_n} rows,"
                  f" {warps} warps, poll {'atomic' if poll else 'volatile'} {ok}", flush=True)
        del ws
    # the barrier alone against the tiny PDL kernel chain
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    for poll in (True, False):
        for programs in (sms, sms // 2, 32):
            def barriers(poll=poll, programs=programs):
                counter.zero_()
                _barrier_chain_kernel[(programs,)](counter, 256, POLL_ATOMIC=poll, num_warps=4)
            print(f"grid barrier, {programs} programs, poll {'atomic' if poll else 'volatile'}: "
                  f"{chain_time(barriers, 256):6.2f} us a barrier", flush=True)
    xs = [torch.zeros(1024, device=dev, dtype=torch.float32) for _ in range(2)]

    def tiny():
        for i in range(256):
            _tiny[(1,)](xs[i % 2], xs[(i + 1) % 2], PDL=True, launch_pdl=True)
    print(f"tiny PDL kernel chain: {chain_time(tiny, 256):6.2f} us a kernel", flush=True)


def sms_floor(n: int, sms: int) -> int:
    """The most programs (a power of two dividing n) that fit one an SM."""
    p = 1
    while p * 2 <= sms and n % (p * 2) == 0:
        p *= 2
    return p


if __name__ == "__main__":
    main()
