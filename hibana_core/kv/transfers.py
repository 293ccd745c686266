"""Copies of parked KV between device and host memory, on a side stream of a discrete GPU.

    compute stream:  ... forward N ── gather ─────────────────── wait(restore) ── scatter ── forward N+1
    copy stream:                        └─wait─ device→host (park)    host→device (restore) ─┘

A park gathers a state's blocks on the compute stream and copies them to pinned host memory on
the copy stream, which waits for the gather and nothing after it: the host goes on at once, the
state's blocks may be freed at once (whatever writes them next is ordered after the gather on the
compute stream), and the gathered tensor is kept until the copy reads it (`record_stream`). A
restore copies host pages into a staging tensor on the copy stream; the compute stream waits for
that copy before it scatters them into blocks, and the host never waits.

The destination of a copy in flight is read only after the copy: the host waits on its
`Transfer` (a spill file or a state file is written from it), or a stream does (a restore after
a park still in flight). On the CPU and on unified memory there is no side stream: every copy is
synchronous and its `Transfer` done when made, so the same code runs with the waits as no-ops.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref

import torch


class Transfer:
    """One copy between host and device memory. Its destination may be read once `done`; `wait`
    blocks the host until then. `seconds` (once done): the copy's time, measured by CUDA events
    on the copy stream, or the wall time of a synchronous copy."""

    def __init__(self, seconds: float = 0.0, began: torch.cuda.Event | None = None,
                 ended: torch.cuda.Event | None = None) -> None:
        self._seconds, self._began, self.ended = seconds, began, ended

    @property
    def done(self) -> bool:
        return self.ended is None or self.ended.query()

    def wait(self) -> None:
        if self.ended is not None:
            self.ended.synchronize()

    def seconds(self) -> float:
        if self._began is not None:
            return self._began.elapsed_time(self.ended) / 1e3
        return self._seconds


class CopyStream:
    """Where `HostTier` copies run: a side stream on a discrete GPU (`side`), else synchronously
    on the caller's thread (the CPU, unified memory)."""

    def __init__(self, device: torch.device, side: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if side else None

    def to_host(self, device_kv: torch.Tensor, host: torch.Tensor) -> Transfer:
        """Copy `device_kv` (just gathered on the compute stream) into `host`, after the compute
        stream's work so far. Read `host` once the returned transfer is done."""
        if self.stream is None:
            began = time.perf_counter()
            host.copy_(device_kv)
            return Transfer(time.perf_counter() - began)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            began = _timing_event()
            host.copy_(device_kv, non_blocking=host.is_pinned())
            transfer = Transfer(0.0, began, _timing_event())
        device_kv.record_stream(self.stream)  # its memory is not reused before the copy read it
        return transfer

    def to_device(self, host: torch.Tensor, pages: list[int], after: Transfer | None) -> tuple[torch.Tensor, Transfer]:
        """`host[:, :, pages]` for the compute stream to scatter: [page_layers, 2, len(pages),
        block_size, H_kv, D]. On a side stream it is copied there after `after` (the copy that
        filled `host`, maybe still in flight), into a staging tensor the compute stream waits for;
        elsewhere `after` is waited on and the pages are selected on the host."""
        if self.stream is None:
            if after is not None:
                after.wait()
            began = time.perf_counter()
            pages_kv = host[:, :, pages]
            return pages_kv, Transfer(time.perf_counter() - began)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if after is not None and after.ended is not None:
                self.stream.wait_event(after.ended)
            # allocated on the copy stream: its memory is ordered after that stream's earlier use
            staging = torch.empty(host.shape[:2] + (len(pages),) + host.shape[3:], dtype=host.dtype,
                                  device=self.device)
            began = _timing_event()
            _copy_pages(staging, host, pages)
            transfer = Transfer(0.0, began, _timing_event())
        compute.wait_event(transfer.ended)
        staging.record_stream(compute)  # the scatter reads it on the compute stream
        return staging, transfer


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device."""
    return small_to_device(torch.tensor(values, dtype=dtype), device)


def small_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small tensor (indices, per-row parameters) to `device` without waiting for it:
    `torch.tensor(..., device="cuda")` synchronizes the stream after its copy, so the host would
    wait for the step in flight (a park or restore inside scheduling waited a whole forward)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _timing_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _copy_pages(staging: torch.Tensor, host: torch.Tensor, pages: list[int]) -> None:
    """staging[:, :, i] = host[:, :, pages[i]], as copies of contiguous host memory: a strided
    host source would be made contiguous in pageable memory first, synchronously. All the pages:
    one copy; otherwise one per layer slot, k or v, and run of consecutive pages."""
    if not host.is_contiguous():
        host = host.contiguous()
    pinned = host.is_pinned()  # a driver query: once, not per copy
    if pages == list(range(host.shape[2])):
        staging.copy_(host, non_blocking=pinned)
        return
    rows_in, rows_out = host.flatten(0, 1), staging.flatten(0, 1)  # [page_layers * 2, pages, ...]
    at = 0
    for first, count in _runs(pages):
        for row in range(rows_in.shape[0]):
            rows_out[row, at:at + count].copy_(rows_in[row, first:first + count], non_blocking=pinned)
        at += count


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive page indices, in order."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def pinned_size(nbytes: int) -> int:
    """The bytes of the block `PinnedReserve` holds for a tensor of `nbytes`: rounded up to one
    of four classes per power of two (at most a quarter more than asked; torch's own pinned
    allocator rounds to a power of two, up to twice)."""
    if nbytes <= 4:
        return max(nbytes, 1)
    step = 1 << (nbytes - 1).bit_length() - 3  # a quarter of the power of two below
    return -(-nbytes // step) * step


def pin_block(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory (uint8). The pages are touched here first and then
    registered with the driver (`cudaHostRegister`): on the H200 box 0.11 s a GiB, against 0.41 s
    for `torch.empty(..., pin_memory=True)` (`cudaHostAlloc`), and only the registering (0.05 s)
    holds the driver: while another thread pinned with `cudaHostAlloc`, a step's CUDA calls
    waited up to 1.9 s (bench/pin_contention.py). Falls back to torch's allocator where
    registering fails. The memory is unregistered when the block is collected (`PinnedReserve`
    keeps its blocks until it closes)."""
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.fill_(0)  # faults the pages in, off the driver (parallel over torch's threads)
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(block.data_ptr(), nbytes, 0) != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(block, cudart.cudaHostUnregister, block.data_ptr())
    return block


class PinnedReserve:
    """Page-locked host memory for parked copies, pinned before the parks that take it.

    Pinning new memory is slow (`pin_block`), and a park runs inside an engine step: each new pin
    there held up every agent. This keeps blocks of a few sizes (`pinned_size`) for the life of
    the tier: `empty` hands out a free block of the tensor's class or the next one up (a view of
    its first bytes), which comes back when the tensor dies, and a background thread pins spares ahead of demand,
    one per class and one more for each `empty` of it that found none (bursts of parks as agents
    pile up), at most `MAX_SPARES` a class and never past `limit` bytes in all. Only an `empty`
    that finds no free block pins on the caller's thread (`cold` counts them).

    A block is reused as soon as the tensor handed out dies, without waiting for copies: every
    device copy from or to these tensors runs on the one copy stream, in order, and the host
    reads them only after waiting for their copy (`ParkedKV.host_kv`).
    """

    MAX_SPARES = 8

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes of blocks the warmer may bring the reserve to
        self.free: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self.bytes = 0  # of all blocks, in use and free
        self._cold: collections.Counter[int] = collections.Counter()  # per class
        # re-entrant: a tensor's finalizer (`_give_back`) may run inside a locked section of this
        # thread, when an allocation there sets off the garbage collector
        self._lock = threading.RLock()
        self._asked: set[int] = set()  # classes the warmer is making spares of
        self._todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def cold(self) -> int:
        """Blocks pinned on the caller's thread (no free one of their class)."""
        return sum(self._cold.values())

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A pinned tensor of `shape` and `dtype` (contents undefined), a view of a free block of
        its class or else of the next class up (at most `largest_block(nbytes)` bytes held)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size = pinned_size(nbytes)
        with self._lock:
            fits = next((c for c in (size, pinned_size(size + 1)) if self.free[c]), None)
            block = self.free[fits].pop() if fits is not None else None
            if block is None:
                self._cold[size] += 1
        if block is None:
            block = pin_block(size)
            with self._lock:
                self.bytes += size
        tensor = block[:nbytes].view(dtype).view(shape)
        weakref.finalize(tensor, self._give_back, block)
        self._ask(size)
        return tensor

    @staticmethod
    def largest_block(nbytes: int) -> int:
        """The most bytes `empty` may hold for a tensor of `nbytes`."""
        return pinned_size(pinned_size(nbytes) + 1)

    def _give_back(self, block: torch.Tensor) -> None:
        with self._lock:
            if not self._closed:  # after `close` the block goes (unregistered once collected)
                self.free[block.numel()].append(block)

    def _wanted(self, size: int) -> int:
        """Spares of class `size` still to pin (under the lock)."""
        room = (self.limit - self.bytes) // size
        return min(min(self.MAX_SPARES, 1 + self._cold[size]) - len(self.free[size]), room)

    def _ask(self, size: int) -> None:
        with self._lock:
            if self._wanted(size) <= 0 or size in self._asked:
                return
            self._asked.add(size)
            if self._thread is None:
                self._thread = threading.Thread(target=self._warm, name="hibana-pinned", daemon=True)
                self._thread.start()
        self._todo.put(size)

    def _warm(self) -> None:
        while (size := self._todo.get()) is not None:
            try:
                while True:
                    with self._lock:
                        if self._wanted(size) <= 0:
                            break
                    block = pin_block(size)
                    with self._lock:
                        self.bytes += size
                        self.free[size].append(block)
            except RuntimeError:  # out of page-lockable memory: a park pays (or fails) itself
                pass
            finally:
                with self._lock:
                    self._asked.discard(size)

    def close(self) -> None:
        """Stop the warmer and let the free blocks go (tensors handed out keep theirs)."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None
        with self._lock:
            self._closed = True
            self.free.clear()
