"""What one request costs the server before it reaches the engine: a large body must cost time in
proportion to its size, never its square (a request is checked while other clients wait)."""

from __future__ import annotations

from hibana_core.messages import normalize_tools


class CountedName(str):
    """A tool name that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_duplicate_tool_names_are_found_in_linear_time():
    """Each name was counted in the list of every name (`names.count`): 20,000 tools, 1 MB of
    JSON, took 77 s of a server's CPU before its 400, the event loop held for part of it."""
    tools = [{"type": "function", "function": {"name": CountedName(f"tool_{i}")}} for i in range(400)]
    CountedName.compared = 0
    assert len(normalize_tools(tools)) == 400
    assert CountedName.compared < 400, CountedName.compared  # quadratic: 400 * 399
