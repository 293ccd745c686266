"""The public names DESIGN.md fixes, checked from the outside as code written against them uses them."""

import inspect

import pytest

import tiny_models
from hibana_core import SamplingParams


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_models.make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("design_api") / "qwen3")


def test_sampling_params_signature_shows_its_fields_and_defaults():
    """SamplingParams' __new__ (which names a misspelt option) made inspect, help() and IDEs show
    (*args, **kwargs) instead of max_tokens=128, temperature=0.0, stop_token_ids=(), ..."""
    params = inspect.signature(SamplingParams).parameters
    assert list(params)[:3] == ["max_tokens", "temperature", "top_k"]
    assert params["max_tokens"].default == 128 and params["temperature"].default == 0.0
    assert params["stop_token_ids"].default == ()
    assert inspect.signature(SamplingParams).bind(max_tokens=4, stop_token_ids=[2])


def test_states_of_a_closed_engine_are_none(qwen3, make_engine):
    """engine.states() after close() was an AttributeError on the dropped KV cache (close frees
    everything; stats() after close already reported states=0)."""
    engine = make_engine(qwen3, speculation="off")
    engine.open_state("a").sync([1, 2, 3])
    assert [info.id for info in engine.states()] == ["a"]
    engine.close()
    assert engine.states() == [] and engine.stats().states == 0


def test_the_servers_app_exposes_its_engine(qwen3, make_engine):
    """DESIGN.md: every adapter object exposes the engine it runs on as `.engine`; the server (an
    adapter too) gave its FastAPI app none."""
    pytest.importorskip("fastapi")
    from hibana_plugins.server import ServerConfig, create_app

    engine = make_engine(qwen3, speculation="off")
    assert create_app(engine, ServerConfig(model_name="tiny")).engine is engine
