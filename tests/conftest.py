"""Shared fixtures: tiny checkpoints (built once per session), the HF reference, engine factories."""

from __future__ import annotations

import threading
import time

import pytest
from transformers.utils import logging as hf_logging

import tiny_models

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """arch -> directory of its tiny seeded checkpoint (see tiny_models)."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {arch: tiny_models.make_tiny_checkpoint(arch, root / arch) for arch in tiny_models.ARCHS}


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(path, token_ids, max_new_tokens) -> list[int]: transformers' greedy continuation."""
    return tiny_models.hf_greedy


@pytest.fixture
def make_engine():
    """make_engine(path, **overrides) -> a fresh Engine, closed when the test ends."""
    engines = []

    def make(path, **overrides):
        engine = tiny_models.open_engine(path, **overrides)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def join_all():
    """join_all(threads, timeout): wait for every thread, and fail if one is still running after
    `timeout` seconds in all (a thread that deadlocked must not pass as one that finished)."""

    def join(threads: list[threading.Thread], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, f"threads still running after {timeout} s (deadlock?): {alive}"

    return join
