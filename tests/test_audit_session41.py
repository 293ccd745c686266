"""Checks from the audit of the forty-first session's changes (logit_bias, streamed logprobs,
adapters given an engine, a request's speculation="adaptive")."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from hibana_plugins.openai_api import ApiError, chat_call, parse_request  # noqa: E402


@pytest.mark.parametrize("key", ["\u00b2", "1_000", "+5", "x"])
def test_a_logit_bias_key_int_refuses_is_a_400_naming_the_field(key):
    """"²" is a digit to str.isdigit() and no number to int(): it was a ValueError (a 500)."""
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "logit_bias": {key: 1}})
    with pytest.raises(ApiError) as caught:
        chat_call(request, None, 512)
    assert caught.value.status == 400 and caught.value.param == "logit_bias"


def test_logit_bias_keys_as_json_writes_them_are_token_ids():
    request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "logit_bias": {"12": -100, " 7 ": 2.5}})
    assert chat_call(request, None, 512).params.logit_bias == {12: -100.0, 7: 2.5}
