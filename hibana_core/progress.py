"""The stages of an engine's start, timed: one progress bar on stderr (off with progress=False)
and a line per stage under the `hibana.load` logger.

    hibana: loading demo:  33%|███▎      | 2/6 [00:06, weights]
    hibana: weights:  67%|██████▋   | 60/90 [00:00<00:00, 135.40tensor/s]    (nested, while it runs)
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

logger = logging.getLogger("hibana.load")


class LoadProgress:
    """Names the stages up front (the bar's length), then times them: `with stage(name)`, or
    `begin(name)`, which ends the stage running before. A stage run again adds to its time."""

    def __init__(self, model: str, stages: Sequence[str], enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.model = model
        self.times: dict[str, float] = {}
        """Seconds per stage, in the order they ran."""
        self._bar = tqdm(total=len(stages), desc=f"hibana: loading {model}", unit="stage", leave=False,
                         disable=not enabled, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        self._running: tuple[str, float] | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end()

    def begin(self, name: str) -> None:
        self.end()
        self._bar.set_postfix_str(name, refresh=True)
        self._running = (name, time.perf_counter())

    def end(self) -> None:
        if self._running is None:
            return
        name, started = self._running
        self._running = None
        seconds = time.perf_counter() - started
        self.times[name] = self.times.get(name, 0.0) + seconds
        self._bar.update()
        logger.debug("%s: %s took %.3f s", self.model, name, seconds)

    def close(self) -> None:
        self.end()
        self._bar.close()

    @property
    def total(self) -> float:
        return sum(self.times.values())

    def summary(self) -> str:
        """'resolve 0.00 s, config 0.02 s, ...'"""
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.times.items())
