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


@pytest.mark.parametrize("bias", [{"1": 5, "01": -5}, {1: 5, " 1 ": -5}, {"7": 1, 7: 1}])
def test_logit_bias_keys_naming_one_token_twice_are_refused_not_overwritten(bias):
    """{"1": 5, "01": -5} became {1: -5.0}: the last key silently won."""
    with pytest.raises(ConfigError, match="logit_bias names token (1|7) twice .*give each token id once"):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={"1": 5, "2": -5}).logit_bias == {1: 5.0, 2: -5.0}


def test_the_server_refuses_logit_bias_keys_naming_one_token_twice():
    pytest.importorskip("pydantic")
    from hibana_plugins.openai_api import ApiError, chat_call, parse_request

    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "logit_bias": {"1": 5, "01": -5}})
    with pytest.raises(ApiError, match="names token 1 twice") as caught:
        chat_call(request, None, 512)
    assert caught.value.status == 400 and caught.value.param == "logit_bias"
