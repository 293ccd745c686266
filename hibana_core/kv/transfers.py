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

import bisect
import ctypes
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


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
    """Page-locked host memory for parked copies, pinned ahead of the parks that take it.

    Pinning is slow (`pin_block`) and a park runs inside an engine step: each pin there held up
    every agent. The reserve pins chunks (`CHUNK` bytes, or the largest copy asked for where that
    is more) on a background thread and carves tensors out of them: `empty` takes the smallest
    free range that fits (page-aligned, `held` bytes), and the range comes back, merged with free
    neighbours, when the last tensor on its memory dies (the storage: any view of it keeps it).
    The warmer keeps room for `SPARES` more copies of the largest size asked for, and one more
    for each `empty` that found none (bursts of parks as agents pile up), at most `MAX_SPARES`,
    never pinning past `limit` bytes in all. Only an `empty` that finds no room pins on the
    caller's thread, its own size (`cold` counts them). Chunks stay pinned until `close`.

    A range is reused as soon as its tensors die, without waiting for copies: every device copy
    from or to these tensors runs on the one copy stream, in order, and the host reads them only
    after waiting for their copy (`ParkedKV.host_copy`).
    """

    CHUNK = 2 << 30
    ALIGN = 4096
    SPARES = 2
    MAX_SPARES = 8

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes of chunks the warmer may bring the reserve to
        self.bytes = 0  # pinned, in use and free
        self.cold = 0  # `empty` calls that pinned on the caller's thread
        self._chunks: list[torch.Tensor | None] = []  # None: let go after `close`
        self._free: list[list[tuple[int, int]]] = []  # per chunk: free (offset, length), in order
        self._largest = 0  # the largest size asked for
        # re-entrant: a storage's finalizer (`_give_back`) may run inside a locked section of
        # this thread, when an allocation there sets off the garbage collector; it then only
        # queues its range (`_returned`), which the section merges when its edit is done
        self._lock = threading.RLock()
        self._editing = False
        self._returned: list[tuple[int, int, int]] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def held(cls, nbytes: int) -> int:
        """The bytes a tensor of `nbytes` takes from the reserve."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for ranges in self._free for _, length in ranges)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A pinned tensor of `shape` and `dtype` (contents undefined)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        size = self.held(nbytes)
        if not size:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            self._largest = max(self._largest, size)
            place = self._edit(self._take, size)
        if place is None:
            chunk = pin_block(size)
            with self._lock:
                self.cold += 1
                self._edit(self._add, chunk)
                place = self._edit(self._take, size)
        index, offset = place
        buffer = (ctypes.c_uint8 * size).from_address(self._chunks[index].data_ptr() + offset)
        weakref.finalize(buffer, self._give_back, index, offset, size)  # once no storage holds it
        self._ask()
        return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)

    def _edit(self, edit: Callable[..., T], *args: Any) -> T:
        """`edit(*args)` on the free ranges (under the lock), then the ranges whose storage died
        meanwhile given back: a finalizer run inside an edit (the garbage collector, set off by an
        allocation there) would move the ranges under it, and `_take` would hand out a range
        another tensor holds."""
        self._editing = True
        try:
            return edit(*args)
        finally:
            try:
                while self._returned:
                    self._merge(*self._returned.pop())
            finally:
                self._editing = False

    def _take(self, size: int) -> tuple[int, int] | None:
        """(chunk, offset) of the smallest free range of at least `size` bytes, taken (under the lock)."""
        best = None
        for index, ranges in enumerate(self._free):
            for at, (offset, length) in enumerate(ranges):
                if length >= size and (best is None or length < best[0]):
                    best = (length, index, at)
        if best is None:
            return None
        length, index, at = best
        offset = self._free[index][at][0]
        if length == size:
            del self._free[index][at]
        else:
            self._free[index][at] = (offset + size, length - size)
        return index, offset

    def _add(self, chunk: torch.Tensor) -> None:
        """(under the lock)"""
        self._chunks.append(chunk)
        self._free.append([(0, chunk.numel())])
        self.bytes += chunk.numel()

    def _give_back(self, index: int, offset: int, size: int) -> None:
        """A range whose storage died, merged with its free neighbours; queued where it runs inside
        an edit of this thread (`_edit`)."""
        with self._lock:
            if self._editing:
                self._returned.append((index, offset, size))
            else:
                self._edit(self._merge, index, offset, size)

    def _merge(self, index: int, offset: int, size: int) -> None:
        """(under the lock, in an edit)"""
        ranges = self._free[index]
        at = bisect.bisect(ranges, (offset, size))
        if at < len(ranges) and ranges[at][0] == offset + size:  # merged with the next
            size += ranges.pop(at)[1]
        if at and sum(ranges[at - 1]) == offset:  # and the previous
            offset, size = ranges[at - 1][0], ranges[at - 1][1] + size
            del ranges[at - 1]
            at -= 1
        ranges.insert(at, (offset, size))
        if self._closed and ranges == [(0, self._chunks[index].numel())]:
            self._let_go(index)

    def _let_go(self, index: int) -> None:
        """(under the lock)"""
        self.bytes -= self._chunks[index].numel()
        self._chunks[index] = None
        self._free[index] = []

    def _wanted(self) -> int:
        """Bytes of the next chunk the warmer should pin; 0: none (under the lock)."""
        if not self._largest or self._closed:
            return 0
        room = sum(length // self._largest for ranges in self._free for _, length in ranges)
        if room >= min(self.SPARES + self.cold, self.MAX_SPARES):
            return 0
        size = max(self.CHUNK, self._largest)
        return size if self.bytes + size <= self.limit else 0

    def _ask(self) -> None:
        with self._lock:
            if not self._wanted():
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._warm, name="hibana-pinned", daemon=True)
                self._thread.start()
        self._wake.set()

    def _warm(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                while True:
                    with self._lock:
                        size = self._wanted()
                    if not size:
                        break
                    chunk = pin_block(size)
                    with self._lock:
                        self._edit(self._add, chunk)
            except RuntimeError:  # out of page-lockable memory: a park pays (or fails) itself
                pass

    def close(self) -> None:
        """Stop the warmer and let the chunks go (those with tensors in use once they die)."""
        with self._lock:
            self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join()
            self._thread = None
        with self._lock:
            for index, chunk in enumerate(self._chunks):
                if chunk is not None and self._free[index] == [(0, chunk.numel())]:
                    self._let_go(index)
