"""Options as code written for a peer gives them: None for a sampling option on the constructor is
its default, as it is per call and on ChatOpenAI / ChatOllama; a peer's name for something the
adapters do otherwise is refused saying what to write instead, not with a misleading close match."""

from __future__ import annotations

import pytest

from hibana_core import Engine
from hibana_core.errors import ConfigError
from hibana_plugins.langchain import ChatHibana
from hibana_plugins.llamaindex import HibanaLLM

NONES = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "seed": None,
         "repetition_penalty": None, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
         "stop": None, "logprobs": None, "top_logprobs": None, "speculation": None}


@pytest.fixture(scope="module")
def engine():
    return Engine.shared("demo")


@pytest.mark.parametrize("make", [ChatHibana, HibanaLLM], ids=["ChatHibana", "HibanaLLM"])
def test_none_for_a_sampling_option_on_the_constructor_is_its_default(engine, make):
    # ChatHibana(temperature=None) was a ConfigError of pydantic's ("Input should be a valid number")
    # while invoke(..., temperature=None) took the default
    plain, nones = make(engine=engine), make(engine=engine, max_tokens=None, **NONES)
    assert {name: getattr(nones, name) for name in NONES} == {name: getattr(plain, name) for name in NONES}
    assert nones.max_tokens is None  # (None still means no limit but the context)


@pytest.mark.parametrize("make", [ChatHibana, HibanaLLM], ids=["ChatHibana", "HibanaLLM"])
@pytest.mark.parametrize("option, says", [
    ({"response_format": {"type": "json_object"}}, "structured"),  # was "did you mean 'reasoning_effort'?"
    ({"generate_kwargs": {"temperature": 0.1}}, "by its own name"),  # was "did you mean 'engine_kwargs'?"
    ({"additional_kwargs": {"temperature": 0.1}}, "by its own name"),
    ({"thinking": False}, "reasoning=True / False"),
    ({"json_mode": True}, "for JSON output use"),  # (each adapter's own way: test_audit_readme_adapters)
    ({"is_function_calling_model": True}, "chat template"),
])
def test_a_peers_option_the_adapters_do_otherwise_says_what_to_write(make, option, says):
    with pytest.raises(ConfigError) as caught:
        make(model="demo", **option)
    assert says in str(caught.value) and "did you mean" not in str(caught.value)


@pytest.mark.parametrize("value", ["no", "false", 0])
def test_parallel_tool_calls_is_true_or_false_in_chathibana_as_in_hibanallm(engine, value):
    # "no" and 0 are not False: ChatHibana let the model make several calls where the caller asked for
    # one (HibanaLLM refused them already)
    llm = ChatHibana(engine=engine)
    with pytest.raises(ConfigError, match="parallel_tool_calls must be True or False"):
        llm.bind_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                       parallel_tool_calls=value)
    with pytest.raises(ConfigError, match="parallel_tool_calls must be True or False"):
        llm.invoke("hi", parallel_tool_calls=value)


@pytest.mark.parametrize("make", [ChatHibana, HibanaLLM], ids=["ChatHibana", "HibanaLLM"])
def test_an_engine_that_is_no_engine_is_a_config_error(make):
    # engine="demo" (a model's name where the engine goes) was an AttributeError of its .config
    with pytest.raises(ConfigError, match="model='demo'"):
        make(engine="demo")
    with pytest.raises(ConfigError, match="engine= takes a loaded hibana_core Engine"):
        make(engine=5)


def test_hibanallm_engine_kwargs_that_are_no_dict_are_a_config_error():
    with pytest.raises(ConfigError, match="engine_kwargs is a dict"):  # was a TypeError of **
        HibanaLLM(model="demo", engine_kwargs="w8")


def test_structured_output_into_what_is_no_pydantic_class_is_a_tool_schema_error(engine):
    from llama_index.core.prompts import PromptTemplate

    from hibana_core.chat import ToolSchemaError

    with pytest.raises(ToolSchemaError, match="pydantic model class"):  # was an AttributeError
        HibanaLLM(engine=engine).structured_predict({"name": str}, PromptTemplate("Extract: {t}"), t="Alice")
