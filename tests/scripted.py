"""A request's events from a script, for tests of the layers above the engine: what a model that
ignores its instructions would write, chunk by chunk."""

from __future__ import annotations

from hibana_core.state import Completion, RequestStats, StreamEvent


class ScriptedEvents:
    """One event per chunk, then the final one. `stop()` ends it as the engine's RequestEvents do:
    the final event still comes, with finish_reason "cancelled"."""

    def __init__(self, chunks: list[str], reason: str = "stop") -> None:
        self.chunks, self.reason, self.stopped, self.sent = chunks, reason, False, 0

    def __iter__(self):
        for chunk in self.chunks:
            if self.stopped:
                break
            self.sent += 1
            yield StreamEvent(0, chunk)
        reason = "cancelled" if self.stopped else self.reason
        stats = RequestStats(3, 1, 2, self.sent, None, 0.0)
        yield StreamEvent(None, "", reason,
                          Completion([0] * self.sent, reason, "".join(self.chunks[:self.sent]), stats))

    async def __aiter__(self):
        for event in self:
            yield event

    def ready(self) -> bool:
        """Events come one at a time, as from a step loop that makes one per step."""
        return False

    def stop(self) -> None:
        self.stopped = True

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
