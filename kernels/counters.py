"""Arrival counts for kernels whose last program to finish does the rest (split decode attention
merging its splits; a sparse block's router picking the experts): a CTA barrier, then an acq_rel
atomic increment per group of programs; the program that arrives last reads what the others
wrote and sets the count back to zero.

The counts are zero between launches, so one buffer serves every launch on a stream, in order,
and every replay of a graph captured there; buffers are never freed (graphs hold their
addresses). One per kernel, device and stream: launches on two streams may run at once.
"""

from __future__ import annotations

import functools

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}


def counters(kernel: str, size: int, device: torch.device) -> torch.Tensor:
    """`size` int32 counts, zero, for `kernel`'s launches on the current stream of `device`."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (kernel, device, stream)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    buffer = _BUFFERS[key]
    if buffer.numel() < size:  # a kernel asks one size always; a larger one would index past it
        raise ValueError(f"{kernel}'s counts were made for {buffer.numel()} groups, {size} asked")
    return buffer


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors, which split launches size their grids by; 4 for the
    interpreter on the CPU (a small number exercises both the split and the whole paths)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
