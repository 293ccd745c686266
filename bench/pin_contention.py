"""Does pinning host memory on one thread hold up CUDA work launched on another? (issue 17)

The memory run's step loop spent 28 s of 65 inside parks and restores whose copies took 13 s,
while a background thread pinned ~40 GB of spares. This times a loop shaped like an engine step
(a matmul, a small pinned index copy, a gather, an async device->host copy, an event wait) alone
and while another thread pins blocks, and times ways of getting page-locked memory.

    python3 bench/pin_contention.py
"""

from __future__ import annotations

import statistics
import threading
import time

import torch


def step_loop(seconds: float) -> list[float]:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(36, 2, 256, 16, 8, 128, device="cuda", dtype=torch.bfloat16)  # ~600 MB
    host = torch.empty(36, 2, 32, 16, 8, 128, dtype=torch.bfloat16, pin_memory=True)
    side = torch.cuda.Stream()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        idx = torch.arange(32, dtype=torch.long).pin_memory().to("cuda", non_blocking=True)
        g = pool.index_select(2, idx)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(g, non_blocking=True)
        g.record_stream(side)
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()
        times.append(time.perf_counter() - began)
    return times


def pinner(blocks: int, size: int, out: list) -> None:
    for _ in range(blocks):
        began = time.perf_counter()
        out.append((torch.empty(size, dtype=torch.uint8, pin_memory=True), time.perf_counter() - began))


def register(size: int, touch: bool) -> float:
    t = torch.empty(size, dtype=torch.uint8)
    if touch:
        t.fill_(0)
    began = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0)
    took = time.perf_counter() - began
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    assert rc == 0, rc
    return took


def main() -> None:
    torch.cuda.init()
    step_loop(1.0)
    base = step_loop(5.0)
    print(f"step alone: median {statistics.median(base) * 1e3:.2f} ms, p90 {sorted(base)[int(len(base) * .9)] * 1e3:.2f} ms, n={len(base)}")
    size = 1 << 30
    pinned: list = []
    th = threading.Thread(target=pinner, args=(6, size, pinned))
    th.start()
    busy = step_loop(5.0)
    th.join()
    print(f"step while another thread pins 6 x 1 GiB: median {statistics.median(busy) * 1e3:.2f} ms, "
          f"p90 {sorted(busy)[int(len(busy) * .9)] * 1e3:.2f} ms, max {max(busy) * 1e3:.1f} ms, n={len(busy)}")
    print("  each pin: " + ", ".join(f"{t:.2f}s" for _, t in pinned))
    from hibana_core.kv.transfers import pin_block
    registered: list = []
    th = threading.Thread(target=lambda: [registered.append(pin_block(size)) for _ in range(6)])
    th.start()
    busy = step_loop(5.0)
    th.join()
    print(f"step while another thread pins 6 x 1 GiB with pin_block (touch, then cudaHostRegister): median "
          f"{statistics.median(busy) * 1e3:.2f} ms, p90 {sorted(busy)[int(len(busy) * .9)] * 1e3:.2f} ms, "
          f"max {max(busy) * 1e3:.1f} ms, n={len(busy)}; pinned: {all(t.is_pinned() for t in registered)}")
    held = [t for t, _ in pinned]  # alive: a freed block would come back from torch's cache at no cost
    pinned.clear()
    for label, fn in [("torch.empty(pin_memory=True) 1 GiB", lambda: pinner(1, size, pinned) or pinned.pop()[1]),
                      ("cudaHostRegister of untouched 1 GiB", lambda: register(size, False)),
                      ("cudaHostRegister of touched 1 GiB", lambda: register(size, True))]:
        print(f"{label}: {fn():.3f} s")
    began = time.perf_counter()
    t = torch.empty(size, dtype=torch.uint8)
    t.fill_(0)
    print(f"page-faulting 1 GiB of pageable memory (fill): {time.perf_counter() - began:.3f} s")


if __name__ == "__main__":
    main()
