"""Weights brought into the L2 ahead of the kernel that reads them, on a side stream of a CUDA
graph (an experiment: off unless HIBANA_L2_PREFETCH is set).

A batch-1 decode step is a chain of dependent kernels; the projections' GEMVs read the weights,
and between them the norms, the attention prologue, attention and its merge read next to
nothing. A small model's GEMVs (a few MB each) run at 26-50% of the copy bandwidth: each ramps up,
reads, and drains, and memory idles between them. The L2 (50 MB on the H100, 60 on the H200) holds a
small model's next projection several times over, so while the chain runs a side stream asks the
L2 for the next projection's weights (`l2_prefetch_triton`: requests only, no data into the
multiprocessors); the GEMV then finds them there. The bytes read from memory are the same; what
changes is that memory is busy while the chain is not reading.

In use: `session(plan)` around the forwards of a CUDA graph's warm-up and capture
(`DecodeGraphs`), where each `Linear` calls `ahead(self)` as it starts: the side stream waits for
the main stream's last kernel, then asks for the weights of the projection after this one, at
most `max_bytes` of them. The plan learns which one comes next from the first forward it sees
(the order the step runs them in, whatever the family); the second (the warm-up's other) launches
every prefetch eagerly, so that Triton has compiled each before the capture, where a module load
is not allowed. The session joins the side stream back before it ends, as a capture requires. A
step that runs eagerly (no graph) prefetches nothing: a launch and two stream events a projection
would cost more host time than they save.

HIBANA_L2_PREFETCH: "off" (default), or "lines[:MB[:programs]]" / "bulk[:MB[:programs[:unit KB]]]".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class Settings:
    bulk: bool = False
    """cp.async.bulk.prefetch (sm_90) in units of `unit` bytes, else one prefetch a 128-byte line"""
    max_bytes: int = 16 << 20
    """at most this many bytes of the next projection's weights are asked for"""
    programs: int = 16
    """the prefetch kernel's grid (it issues requests only: a few programs suffice)"""
    unit: int = 64 << 10


def parse(text: str | None) -> Settings | None:
    """HIBANA_L2_PREFETCH's value as Settings; None for off. ValueError names what is wrong."""
    if not text or text.strip().lower() in ("0", "off", "no", "false"):
        return None
    mode, *rest = text.strip().lower().split(":")
    if mode not in ("lines", "bulk"):
        raise ValueError(f"{text!r}: the mode is 'lines' or 'bulk' (or 'off')")
    if len(rest) > (3 if mode == "bulk" else 2):
        raise ValueError(f"{text!r}: lines[:MB[:programs]] or bulk[:MB[:programs[:unit KB]]]")
    try:
        fields = [float(v) for v in rest]
    except ValueError:
        raise ValueError(f"{text!r}: MB, programs and unit KB are numbers") from None
    if not all(math.isfinite(f) and f > 0 for f in fields):
        raise ValueError(f"{text!r}: MB, programs and unit KB are finite and above 0")
    default = Settings()
    chosen = Settings(bulk=mode == "bulk",
                      max_bytes=int(fields[0] * (1 << 20)) if fields else default.max_bytes,
                      programs=max(1, int(fields[1])) if len(fields) > 1 else default.programs,
                      unit=int(fields[2] * 1024) if len(fields) > 2 else default.unit)
    if chosen.bulk and (chosen.unit < 16 or chosen.unit % 16):
        raise ValueError(f"{text!r}: a bulk unit is a whole multiple of 16 bytes ({chosen.unit} is not)")
    return chosen


_settings: Settings | None = parse(os.environ.get("HIBANA_L2_PREFETCH"))


def settings() -> Settings | None:
    return _settings


@contextlib.contextmanager
def using(choice: Settings | None) -> Iterator[None]:
    """Prefetch under `choice` (None: off) inside the block (graphs captured inside keep it)."""
    global _settings
    previous, _settings = _settings, choice
    try:
        yield
    finally:
        _settings = previous


class Plan:
    """Which projection comes after which in a step: learned from the first forward a session
    sees (`ahead` calls in their order; None, before the first, stands for the step's start).
    Holds the modules, never their tensors (`read_tensors()` is asked at each prefetch, so packed
    weights released at close are not kept), and the side stream of its engine's captures."""

    def __init__(self) -> None:
        self.next: dict[int, object] | None = None  # id(module) -> the module after it
        self.seen: list[object] = []
        self.warm = False  # a forward has launched every prefetch (compiled them) outside a capture
        self.stream: torch.cuda.Stream | None = None

    def learn(self, module: object) -> None:
        if not self.seen or self.seen[-1] is not module:
            self.seen.append(module)

    def learned(self) -> None:
        order = [None, *self.seen]
        self.next = {id(a): b for a, b in zip(order, order[1:])}  # every module a value: their ids stay valid
        self.seen = []


class _Session:
    def __init__(self, plan: Plan, chosen: Settings, stream: torch.cuda.Stream) -> None:
        self.plan, self.settings, self.stream = plan, chosen, stream
        self.forked = False
        self.launches = 0
        self.last: object = self  # the module asked for last (its norm path may ask twice)

    def ahead(self, module: object) -> None:
        if module is self.last:
            return
        self.last = module
        after = self.plan.next.get(id(module))
        if after is None:
            return
        from hibana_kernels import l2_prefetch_triton as lt

        self.stream.wait_stream(torch.cuda.current_stream())
        self.forked = True
        budget = self.settings.max_bytes
        with torch.cuda.stream(self.stream):
            for tensor in sorted(after.read_tensors(), key=lambda t: t.numel() * t.element_size()):  # small ones whole
                if budget <= 0:
                    break
                asked = lt.prefetch(tensor, budget, self.settings.bulk, self.settings.unit, self.settings.programs)
                budget -= asked
                self.launches += asked > 0

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


class _Learning:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def ahead(self, module: object) -> None:
        self.plan.learn(module)


_local = threading.local()  # the session of this thread's forward (engines capture on their step threads)


def ahead(module: object) -> None:
    """`module` (a projection with `read_tensors()`) starts: ask the L2 for the next one's weights."""
    active = getattr(_local, "session", None)
    if active is not None:
        active.ahead(module)


@contextlib.contextmanager
def session(plan: Plan | None, device: torch.device) -> Iterator[_Session | None]:
    """Prefetch along `plan` for the forward inside the block (a CUDA graph's warm-up or capture),
    where prefetching is on and the device takes the chosen kind of request: the first forward
    learns the order, the next (not captured) compiles, later ones capture. The side stream is
    joined at the block's end."""
    chosen = _settings
    if plan is None or chosen is None or device.type != "cuda":
        yield None
        return
    if chosen.bulk and torch.cuda.get_device_capability(device)[0] < 9:  # cp.async.bulk is sm_90's
        chosen = dataclasses.replace(chosen, bulk=False)
    capturing = torch.cuda.is_current_stream_capturing()
    previous = getattr(_local, "session", None)
    if plan.next is None:
        if capturing:  # nothing learned yet: nothing to ask for in this graph
            yield None
            return
        _local.session = _Learning(plan)
        try:
            yield None
        finally:
            _local.session = previous
        plan.learned()
        return
    if plan.stream is None:
        if capturing:
            yield None
            return
        # of the high-priority pool: never the default-priority pool stream a capture runs on
        plan.stream = torch.cuda.Stream(device, priority=-1)
    if plan.stream == torch.cuda.current_stream() or (capturing and not plan.warm):
        yield None
        return
    current = _local.session = _Session(plan, chosen, plan.stream)
    current.ahead(None)  # the first projection's, while the embedding runs
    try:
        yield current
    finally:
        current.join()
        _local.session = previous
    if not capturing:
        plan.warm = True
