"""Programmatic dependent launch (PDL): a kernel of the decode step starts while the one before it
finishes, not after.

A batch-1 decode step is a chain of a few hundred short kernels, each reading what the one
before wrote. Launched plainly, each waits for the previous grid to drain, then ramps up: on the
H200 about a microsecond per kernel in which memory is idle (bench/pdl_probe.py: a chain of
2048x2048 GEMVs 4.23 us a kernel plainly, 3.64 with PDL, 3.36 with PDL and the weight tile loaded
before the wait; a chain of tiny kernels 1.24 -> 0.88 us). With PDL (Hopper and later) the next
grid is launched as soon as every program of the current one has started (`gdc_launch_dependents`)
and its programs run up to `gdc_wait`, which returns once the previous grid has completed and its
writes are visible. What a program may do before the wait: read what no kernel of the step
writes (weights), nothing else, and write nothing.

Every kernel launched with PDL calls `gdc_wait` in every program, before its first read of an
activation and before any store (a grid whose programs all returned without waiting could
complete before its predecessor, and the kernel after it would then read too early). The kernels
take a `PDL` constexpr and are launched with `**launch_args(device)`; captured in a CUDA graph,
the dependency is a programmatic edge of the graph. Off on the CPU (the interpreter has no grid
dependency control), before Hopper, on a Triton without `gdc_wait`, and with HIBANA_PDL=0.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # a Triton before grid dependency control: PDL stays off, the names stay valid
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

_enabled = os.environ.get("HIBANA_PDL", "1") != "0"
_kinds: frozenset[str] | None = None  # the kinds of kernels that launch with PDL (None: all)
MAX_PROGRAMS = 4096
"""GEMV grids above this many programs launch plainly. Measured on the H200 (tune_decode.py --pdl,
batch 1, 512 keys, tok/s, 2026-12-02): PDL on every kernel against none: qwen3-0.6b 1045 -> 1170,
qwen3-30b-a3b 302 -> 327, but qwen3-8b 215 -> 206 and phi4-mini 348 -> 334; their multi-wave GEMVs
(8B's gate_up: 12,288 programs; the lm_heads: 76k-100k) lose with it. With GEMVs of at most 4096
programs: 1173, 327, 214 and 352 (1100: 1061, 322, 216, 352)."""
_max_programs: int | None = MAX_PROGRAMS  # a grid larger than this launches plainly (None: any)
KINDS = ("gemv", "attention", "moe", "other")


@functools.cache
def _device_supports(index: int) -> bool:
    return _HAS_GDC and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device, kind: str = "other", programs: int | None = None) -> bool:
    """Whether a kernel of `kind` (KINDS) with a grid of `programs` on `device` launches with PDL now."""
    if not _enabled or device.type != "cuda":
        return False
    if _kinds is not None and kind not in _kinds:
        return False
    if _max_programs is not None and programs is not None and programs > _max_programs:
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device, kind: str = "other", programs: int | None = None) -> dict[str, bool]:
    """The kernel's PDL constexpr and the launcher's launch_pdl, together."""
    on = enabled(device, kind, programs)
    return {"PDL": on, "launch_pdl": on}


@contextlib.contextmanager
def using(on: bool, kinds: tuple[str, ...] | None = None,
          max_programs: int | None = MAX_PROGRAMS) -> Iterator[None]:
    """Launch with PDL on or off inside the block, for the kernels of `kinds` only and grids of
    at most `max_programs` (benchmarks compare choices in one process; CUDA graphs captured
    inside keep them)."""
    global _enabled, _kinds, _max_programs
    previous = _enabled, _kinds, _max_programs
    _enabled, _kinds, _max_programs = on, None if kinds is None else frozenset(kinds), max_programs
    try:
        yield
    finally:
        _enabled, _kinds, _max_programs = previous


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """In a kernel launched with PDL: wait until the previous grid's writes are visible, then let
    the next grid launch (a no-op without PDL). Letting it launch before the wait instead (grids
    of several kernels ahead resident at once, their weight loads out early) measured no faster on
    the H200 (2026-12-05, A/B in separate processes, batch 1 at 512 keys: qwen3-0.6b 1206 / 1205
    against 1179 / 1210 tok/s, phi4-mini 376.1 against 374.9, qwen3-8b w4 491.3 both)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
