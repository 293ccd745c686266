"""Sampling parameters at their limits (an outside tester of limits, second pass): refused with a
ConfigError that says what to do, as the OpenAI server refuses them."""

from __future__ import annotations

import pytest

from hibana_core import ConfigError, SamplingParams
from hibana_core.config import MAX_STOPS


def test_more_stop_strings_than_the_cap_are_refused_in_process_as_the_server_refuses_them():
    """100,000 stop strings were taken by SamplingParams (the server caps them at 64): the engine's
    thread matched each at every character, slowing every other agent's steps."""
    assert len(SamplingParams(stop=[f"never {i}" for i in range(MAX_STOPS)]).stop) == MAX_STOPS
    with pytest.raises(ConfigError, match=f"at most {MAX_STOPS} stop strings per request, got {MAX_STOPS + 1}"):
        SamplingParams(stop=[f"never {i}" for i in range(MAX_STOPS + 1)])
    with pytest.raises(ConfigError, match="at most"):
        SamplingParams(stop=["x"] * 100_000)
