"""Weights brought into the L2 ahead of the kernel that reads them, on a side stream of a CUDA
graph (an experiment: off unless HIBANA_L2_PREFETCH is set).

A batch-1 decode step is a chain of dependent kernels; the projections' GEMVs read the weights,
and between them the norms, the attention prologue, attention and its merge read next to
nothing. A small model's GEMVs (a few MB each) run at 26-50% of the copy bandwidth: each ramps up,
reads, and drains, and memory idles between them. The L2 (50 MB on the H100 and H200) holds a
small model's next projection several times over, so while the chain runs a side stream asks the
L2 for the next projection's weights (`l2_prefetch_triton`: requests only, no data into the
multiprocessors); the GEMV then finds them there. The bytes read from memory are the same; what
changes is that memory is busy while the chain is not reading.

In use: `session(plan)` around a forward captured in a CUDA graph (`DecodeGraphs`), where each
`Linear` calls `ahead(self)` as it starts: the side stream waits for the main stream's last
kernel, then asks for the weights of the projection after this one (the plan: the model's
projections in the order a layer runs them), at most `max_bytes` of them. The session joins the
side stream back before it ends, as a capture requires. Eagerly (outside a capture) nothing is
launched: a launch and two stream events a projection would cost more host time than they save.

HIBANA_L2_PREFETCH: "off" (default), or "lines[:MB[:programs]]" / "bulk[:MB[:programs[:unit KB]]]".
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

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
    """HIBANA_L2_PREFETCH's value as Settings; None for off."""
    if not text or text.strip().lower() in ("0", "off", "no", "false"):
        return None
    mode, *rest = text.strip().lower().split(":")
    if mode not in ("lines", "bulk"):
        raise ValueError(f"HIBANA_L2_PREFETCH={text!r}: the mode is 'lines' or 'bulk' (or 'off')")
    fields = [float(v) for v in rest]
    default = Settings()
    return Settings(bulk=mode == "bulk",
                    max_bytes=int(fields[0] * (1 << 20)) if fields else default.max_bytes,
                    programs=int(fields[1]) if len(fields) > 1 else default.programs,
                    unit=int(fields[2] * 1024) if len(fields) > 2 else default.unit)


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
    """Which tensors to ask for when each projection starts: those of the projection after it
    (under None, the first projection's, asked for as the step starts). `order`: the projections
    in the order a step runs them, each with the tensors it reads."""

    def __init__(self, order: Sequence[tuple[object, Sequence[torch.Tensor]]]) -> None:
        self.next: dict[int, tuple[torch.Tensor, ...]] = {id(None): tuple(order[0][1])} if order else {}
        for (module, _), (_, tensors) in zip(order, order[1:]):
            self.next[id(module)] = tuple(tensors)
        self.modules = [module for module, _ in order]  # keeps the ids valid while the plan lives


_streams: dict[torch.device, torch.cuda.Stream] = {}
_warm: set[tuple[Settings, torch.device]] = set()


def _compiled(chosen: Settings, device: torch.device) -> None:
    """Compile and load the prefetch kernel for `chosen` on `device` (a module load is not
    allowed inside a capture), once."""
    if (chosen, device) in _warm:
        return
    from hibana_kernels import l2_prefetch_triton as lt

    lt.prefetch(torch.zeros(chosen.unit, dtype=torch.uint8, device=device), chosen.unit, chosen.bulk,
                chosen.unit, 1)
    if device not in _streams:  # made here too, not first inside a capture
        _streams[device] = torch.cuda.Stream(device)
    _warm.add((chosen, device))


class _Session:
    def __init__(self, plan: Plan, chosen: Settings, device: torch.device) -> None:
        self.plan, self.settings = plan, chosen
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        self.stream = _streams[device]
        self.forked = False
        self.launches = 0
        self.last: object = self  # the module asked for last (its norm path may ask twice)

    def ahead(self, module: object) -> None:
        tensors = self.plan.next.get(id(module))
        if not tensors or module is self.last:
            return
        self.last = module
        from hibana_kernels import l2_prefetch_triton as lt

        self.stream.wait_stream(torch.cuda.current_stream())
        self.forked = True
        budget = self.settings.max_bytes
        with torch.cuda.stream(self.stream):
            for tensor in sorted(tensors, key=lambda t: t.numel() * t.element_size()):  # small ones whole
                if budget <= 0:
                    break
                asked = lt.prefetch(tensor, budget, self.settings.bulk, self.settings.unit, self.settings.programs)
                budget -= asked
                self.launches += asked > 0

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


_local = threading.local()  # the session of this thread's capture (engines capture on their step threads)


def ahead(module: object) -> None:
    """`module` (a projection of the plan) starts: ask the L2 for the next one's weights."""
    active = getattr(_local, "session", None)
    if active is not None:
        active.ahead(module)


@contextlib.contextmanager
def session(plan: Plan | None, device: torch.device) -> Iterator[_Session | None]:
    """Prefetch along `plan` for the forward inside the block, where it is being captured on a
    CUDA device and prefetching is on; the side stream is joined at the block's end."""
    chosen = _settings
    if plan is None or chosen is None or device.type != "cuda":
        yield None
        return
    if not torch.cuda.is_current_stream_capturing():
        _compiled(chosen, device)  # a capture's warm-up: the kernel is loaded before the capture
        yield None
        return
    previous = getattr(_local, "session", None)
    current = _local.session = _Session(plan, chosen, device)
    current.ahead(None)  # the first projection's, while the embedding runs
    try:
        yield current
    finally:
        current.join()
        _local.session = previous


def plan_of(modules: Iterable[object], tensors_of) -> Plan:
    """The plan of `modules` in their order, `tensors_of(module)` giving what each reads."""
    return Plan([(m, tuple(tensors_of(m))) for m in modules])
