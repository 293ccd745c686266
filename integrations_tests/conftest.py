"""Fixtures shared by the integration tests."""

from __future__ import annotations

import worker_threads  # noqa: F401  # isort: skip - before torch (tests/worker_threads.py)
import pytest


@pytest.fixture
def scripted(monkeypatch):
    """Every request on the engine streams the given text (one event per character) instead of
    the model's: what a model that ignores its instructions would write."""
    from hibana_core.state import StateHandle
    from scripted import ScriptedEvents

    def script(text: str) -> None:
        monkeypatch.setattr(StateHandle, "stream", lambda self, params, prompt=None: ScriptedEvents(list(text)))
        monkeypatch.setattr(StateHandle, "astream", lambda self, params, prompt=None, loop=None:
                            ScriptedEvents(list(text)))
    return script


# The server tests' demo model behind `hibana serve` (max_tokens_limit 64) and an `openai` client of it,
# each module its own engine; a module that needs another engine or server defines its own fixture.

@pytest.fixture(scope="module")
def engine():
    from hibana_core import Engine

    with Engine.from_pretrained("demo", progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(engine):
    from hibana_plugins.server import ServerConfig, serving

    with serving(engine, ServerConfig("demo", max_tokens_limit=64)) as url:
        yield url


@pytest.fixture
def client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
