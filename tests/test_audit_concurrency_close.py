"""Closing an engine from several threads at once (a server's shutdown beside a `with` block, an
atexit hook beside a script's own close)."""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_close_returns_once_a_close_under_way_has_freed_everything(tiny_checkpoints, make_engine):
    """`close` is idempotent; a second one, while the first still wrote states and freed memory,
    returned at once, and its caller went on (made the next engine, sized from the memory still
    held; exited while the states were being written)."""
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    engine.open_state("a").sync([1, 2, 3])
    freeing, go_on = threading.Event(), threading.Event()
    close_all = engine.registry.close_all

    def held_up_close_all() -> None:
        freeing.set()
        go_on.wait(10)
        close_all()

    engine.registry.close_all = held_up_close_all
    first = threading.Thread(target=engine.close)
    first.start()
    assert freeing.wait(10)
    freed_when_returned: list[bool] = []
    second = threading.Thread(target=lambda: (engine.close(), freed_when_returned.append(engine.kv_cache is None)))
    second.start()
    second.join(0.2)  # (a second close that returns at once has returned by now)
    go_on.set()
    first.join(10)
    second.join(10)
    assert freed_when_returned == [True], "the second close returned while the first was still freeing"
