"""Test drafters for the speculation tests, registered as a plugin through `register_drafters`.

    OracleDrafter  proposes the known continuation of registered histories (from a run without
                   speculation), with chosen draft positions deliberately wrong: acceptances and
                   rejections both happen, whatever the model
    FixedDrafter   always proposes the same tokens (the distribution tests)
    DrawnDrafter   draws each token from a fixed distribution q and says so (`SampledDraft`)
    BrokenDrafter  a buggy plugin's: raises from a chosen call on, or proposes ids past the vocabulary
    ProposeOnly    another drafter's proposals through the one required method, `propose`

`registered(name=drafter, ...)` registers them on the process-wide plugin manager for the length
of a `with` block, each behind a factory; `registered_as_is(name=obj, ...)` registers the objects
themselves (a drafter, or a plugin's mistake). An engine built inside the block sees them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence

from hibana_plugins import hookimpl
from hibana_plugins.manager import get_plugin_manager, reset_plugin_manager


class OracleDrafter:
    """Drafts `continuations[history][pos:pos + k]` for a state holding history + the first pos
    tokens of that continuation; a draft at continuation position p is replaced by another token
    where `wrong(p)`. States holding anything else get no draft."""

    def __init__(self, vocab_size: int, wrong: Callable[[int], bool] = lambda p: False) -> None:
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.calls: list[tuple[int, int, list[int]]] = []  # (history length, k, draft)
        self.finished_outputs: list[list[int]] = []
        self.wrong_proposed = 0  # drafted tokens that differ from the continuation
        self.lock = threading.Lock()

    def add(self, history: Sequence[int], continuation: Sequence[int]) -> None:
        self.continuations[tuple(history)] = list(continuation)

    def propose(self, state, k: int) -> list[int]:
        tokens = list(state.tokens)
        draft: list[int] = []
        for history, continuation in self.continuations.items():
            n = len(history)
            pos = len(tokens) - n
            if 0 <= pos <= len(continuation) and tuple(tokens[:n]) == history \
                    and tokens[n:] == continuation[:pos]:
                draft = [(t + 1) % self.vocab_size if self.wrong(pos + i) else t
                         for i, t in enumerate(continuation[pos:pos + k])]
                wrong = sum(d != t for d, t in zip(draft, continuation[pos:]))
                break
        else:
            wrong = 0
        with self.lock:
            self.calls.append((len(tokens), k, draft))
            self.wrong_proposed += wrong
        return draft

    def finished(self, context: Sequence[int], output: Sequence[int]) -> None:
        with self.lock:
            self.finished_outputs.append(list(output))

    @property
    def proposed(self) -> int:
        return sum(len(d) for _, _, d in self.calls)


class FixedDrafter:
    """Always proposes `tokens[:k]`."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.calls = 0

    def propose(self, state, k: int) -> list[int]:
        self.calls += 1
        return self.tokens[:k]


class DrawnDrafter:
    """Draws k tokens, each from the fixed distribution `q` ([V] float32, summing to 1), with a
    seeded generator of its own, and returns them with q (a `SampledDraft`); where the state says
    not to draw, q's argmax k times (`drawn=False`). `draws`: the flag of each call."""

    def __init__(self, q, seed: int = 0) -> None:
        import torch

        self.q = q
        self.generator = torch.Generator().manual_seed(seed)
        self.calls = 0
        self.draws: list[bool] = []

    def propose(self, state, k: int):
        import torch

        from hibana_core.speculation import SampledDraft

        self.calls += 1
        self.draws.append(state.draw)
        if not state.draw:
            return SampledDraft([int(self.q.argmax())] * k, self.q.expand(k, -1), drawn=False)
        tokens = torch.multinomial(self.q, k, replacement=True, generator=self.generator).tolist()
        return SampledDraft(tokens, self.q.expand(k, -1))


class BrokenDrafter:
    """Proposes `tokens[:k]` for `fine_calls` calls, then raises; `finished` raises too."""

    def __init__(self, tokens: Sequence[int] = (), fine_calls: int = 10**9) -> None:
        self.tokens = list(tokens)
        self.fine_calls = fine_calls
        self.calls = 0

    def propose(self, state, k: int) -> list[int]:
        self.calls += 1
        if self.calls > self.fine_calls:
            raise RuntimeError("a drafter bug")
        return self.tokens[:k]

    def finished(self, context: Sequence[int], output: Sequence[int]) -> None:
        raise RuntimeError("a drafter bug in finished")


class ProposeOnly:
    """`drafter`'s proposals, and nothing else a drafter may have (no `finished`, no `summary`)."""

    def __init__(self, drafter) -> None:
        self._drafter = drafter

    def propose(self, state, k: int) -> list[int]:
        return self._drafter.propose(state, k)


class _Plugin:
    def __init__(self, objects: dict[str, object]) -> None:
        self.objects = objects

    @hookimpl
    def register_drafters(self, register) -> None:
        for name, obj in self.objects.items():
            register(name, obj)


@contextlib.contextmanager
def registered(**drafters) -> Iterator[None]:
    """Register `drafters` (name -> drafter instance; its factory returns that instance) as a
    third-party plugin for the block's length; the process-wide manager is rebuilt around it."""
    factories = {name: (lambda engine, _d=drafter, **options: _d) for name, drafter in drafters.items()}
    with registered_as_is(**factories):
        yield


@contextlib.contextmanager
def registered_as_is(**objects) -> Iterator[None]:
    """Register `objects` (name -> what a plugin passes to `register`) as a third-party plugin
    for the block's length; the process-wide manager is rebuilt around it."""
    reset_plugin_manager()
    get_plugin_manager().register(_Plugin(objects), name="hibana-test-drafters")
    try:
        yield
    finally:
        reset_plugin_manager()
