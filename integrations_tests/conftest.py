"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def scripted(monkeypatch):
    """Every request on the engine streams the given text (one event per character) instead of
    the model's: what a model that ignores its instructions would write."""
    from hibana_core.state import Completion, RequestStats, StateHandle, StreamEvent

    def script(text: str) -> None:
        def events():
            yield from (StreamEvent(0, c) for c in text)
            yield StreamEvent(None, "", "stop", Completion([0] * len(text), "stop", text,
                                                          RequestStats(1, 0, 1, len(text), None, 0.0)))

        async def aevents():
            for event in events():
                yield event
        monkeypatch.setattr(StateHandle, "stream", lambda self, params, prompt=None: events())
        monkeypatch.setattr(StateHandle, "astream", lambda self, params, prompt=None: aevents())
    return script
