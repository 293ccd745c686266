"""Progress bars on stderr, and the stages of an engine's start, timed: one bar (off with
progress=False) and a line per stage under the `hibana.load` logger.

    hibana: loading demo:  33%|███▎      | 2/6 [00:06, weights]
    hibana: weights:  67%|██████▋   | 60/90 [00:00<00:00, 135.40tensor/s]    (nested, while it runs)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

logger = logging.getLogger("hibana.load")

LOG_REFRESH_SECONDS = 10.0
"""How often a bar is redrawn where stderr is a log file or a pipe, not a terminal."""


def bar(iterable: Iterable | None = None, **tqdm_args: Any) -> Any:
    """`tqdm(iterable, **tqdm_args)`, every Hibana bar's constructor. In a terminal a bar opened
    while another runs is drawn on the line below it; where stderr is a log or a pipe, tqdm's
    nesting writes cursor-movement codes into the file, so there every bar takes the first line
    (the one running draws over the one waiting) and is redrawn every LOG_REFRESH_SECONDS, not
    ten times a second. A notebook's bars are widgets: left to tqdm. TQDM_DISABLE=1 hides them all."""
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm as notebook_tqdm

    if os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        tqdm_args["disable"] = True  # tqdm reads TQDM_* only for arguments not given; Hibana gives `disable`
    if not issubclass(tqdm, notebook_tqdm) and not _is_terminal(tqdm_args.get("file") or sys.stderr):
        tqdm_args.setdefault("position", 0)
        tqdm_args.setdefault("mininterval", LOG_REFRESH_SECONDS)
    return tqdm(iterable, **tqdm_args)


def _is_terminal(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class LoadProgress:
    """Names the stages up front (the bar's length), then times them: `with stage(name)`, or
    `begin(name)`, which ends the stage running before. A stage run again adds to its time."""

    def __init__(self, model: str, stages: Sequence[str], enabled: bool = True) -> None:
        self.model = model
        self.times: dict[str, float] = {}
        """Seconds per stage, in the order they ran."""
        self._bar = bar(total=len(stages), desc=f"hibana: loading {model}", unit="stage", leave=False,
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
