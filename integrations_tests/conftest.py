"""Fixtures shared by the integration tests."""

from __future__ import annotations

import worker_threads  # noqa: F401  # isort: skip - before torch (tests/worker_threads.py)
import pytest


@pytest.fixture
def scripted(monkeypatch):
    """Every request on the engine streams the given text (one event per character) instead of
    the model's: what a model that ignores its instructions would write."""
    from hibana_core.state import StateHandle
    from scripted import ScriptedEvents

    def script(text: str) -> None:
        monkeypatch.setattr(StateHandle, "stream", lambda self, params, prompt=None: ScriptedEvents(list(text)))
        monkeypatch.setattr(StateHandle, "astream", lambda self, params, prompt=None, loop=None:
                            ScriptedEvents(list(text)))
    return script
