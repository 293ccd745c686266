"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def scripted(monkeypatch):
    """Every request on the engine streams the given text (one event per character) instead of
    the model's: what a model that ignores its instructions would write."""
    from hibana_core.state import Completion, RequestStats, StateHandle, StreamEvent

    class Events:
        """One request: an event per character, then the final one; `stop()` ends it early as
        the engine's RequestEvents do (finish_reason "cancelled", the final event still comes)."""

        def __init__(self, text: str) -> None:
            self.text, self.stopped = text, False

        def __iter__(self):
            sent = 0
            for c in self.text:
                if self.stopped:
                    break
                sent += 1
                yield StreamEvent(0, c)
            reason = "cancelled" if self.stopped else "stop"
            yield StreamEvent(None, "", reason, Completion([0] * sent, reason, self.text[:sent],
                                                           RequestStats(1, 0, 1, sent, None, 0.0)))

        async def __aiter__(self):
            for event in self:
                yield event

        def stop(self) -> None:
            self.stopped = True

        def close(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    def script(text: str) -> None:
        monkeypatch.setattr(StateHandle, "stream", lambda self, params, prompt=None: Events(text))
        monkeypatch.setattr(StateHandle, "astream", lambda self, params, prompt=None: Events(text))
    return script
