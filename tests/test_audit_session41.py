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


# --- a request's speculation that names no drafter ---------------------------------------------

def test_a_requests_k_without_a_method_drafts_with_the_engines_drafter(tiny_checkpoints, make_engine, hf_greedy):
    """{"k": 2} names no drafter, as "adaptive" names none: it drafted with suffix on an engine
    whose drafter is a draft model (as "adaptive" did before); now with the engine's, 2 a step.
    A request naming its method keeps it."""
    import random

    import tiny_models
    from hibana_core import SamplingParams
    from hibana_core.config import SpeculationConfig

    assert SpeculationConfig.parse({"k": 2}).engines_drafter
    assert not SpeculationConfig.parse({"method": "suffix", "k": 2}).engines_drafter
    target = tiny_checkpoints["qwen3"]
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(target), "k": 4})
    history = tiny_models.random_tokens(random.Random(4), 16)
    h = engine.open_state("k2")
    h.sync(history)
    out = h.generate(SamplingParams(max_tokens=12, ignore_eos=True, speculation={"k": 2})).token_ids
    assert out == hf_greedy(target, history, 12)
    drafters = engine.stats().speculation["drafters"]
    assert "suffix" not in drafters, drafters
    own = drafters["draft_model"]
    assert own["calls"] > 0 and own["tokens_drafted"] <= 2 * own["calls"], own
    h.generate(SamplingParams(max_tokens=4, ignore_eos=True, speculation={"method": "suffix", "k": 2}))
    assert "suffix" in engine.stats().speculation["drafters"]
