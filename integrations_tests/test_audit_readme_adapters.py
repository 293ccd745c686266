"""The README's promises about the adapters' options, checked as a new user meets them ("Options of
both adapters": values are checked at construction, not on the first call)."""

from __future__ import annotations

import pytest

from hibana_core import ConfigError
from hibana_plugins.langchain import ChatHibana
from hibana_plugins.llamaindex import HibanaLLM


@pytest.mark.parametrize("cls", [ChatHibana, HibanaLLM])
@pytest.mark.parametrize("timeout", [0, -1, float("nan"), True, "5"])
def test_a_timeout_no_call_could_keep_fails_at_construction(cls, timeout):
    # ChatHibana took 0, -1 and NaN and failed on the first call; both read True as 1 s
    with pytest.raises(ConfigError, match="timeout must be a number of seconds > 0"):
        cls(model="demo", timeout=timeout)
    with pytest.raises(ConfigError, match="timeout must be a number of seconds > 0"):
        cls(model="demo", request_timeout=timeout)   # Ollama's name for it


@pytest.mark.parametrize("option", ["format", "json_mode"])
def test_a_peers_json_option_points_to_this_adapters_own_way(option):
    # "Unknown options raise ... a ConfigError that names it": HibanaLLM(format=...) said to use
    # with_structured_output and ChatHibana(json_mode=...) structured_predict, each the other's method
    with pytest.raises(ConfigError, match=r"use with_structured_output\(") as lc:
        ChatHibana(model="demo", **{option: "json"})
    assert "structured_predict" not in str(lc.value)
    with pytest.raises(ConfigError, match="use structured_predict, or json_schema= on a call") as li:
        HibanaLLM(model="demo", **{option: "json"})
    assert "with_structured_output" not in str(li.value)
