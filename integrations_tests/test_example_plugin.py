"""The example third-party plugin, installed with pip, found through its entry point and used.

Install it first: `pip install -e examples/hibana-example-plugin`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hibana_plugins.manager import HibanaPluginManager, reset_plugin_manager
from hibana_plugins.tool_parsers import ToolCallDelta

REPO = Path(__file__).resolve().parents[1]
INSTALL = "pip install -e examples/hibana-example-plugin"


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("HIBANA_PLUGINS", raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def manager():
    return HibanaPluginManager()


def example_entry_point():
    found = [ep for ep in importlib.metadata.entry_points(group="hibana") if ep.name == "example"]
    assert found, f"the example plugin is not installed: run `{INSTALL}`"
    return found[0]


def hibana_plugins_cli(**env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "HIBANA_PLUGINS"} | env
    done = subprocess.run(
        [sys.executable, "-m", "hibana_core.cli", "plugins"],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_example_plugin_is_declared_as_an_entry_point():
    ep = example_entry_point()
    assert ep.value == "hibana_example_plugin"
    assert ep.dist.metadata["Name"] == "hibana-example-plugin"


def test_example_plugin_is_loaded_through_its_entry_point(manager):
    example_entry_point()
    rows = {(i.plugin, i.kind, i.name, i.package, i.builtin) for i in manager.describe()}
    assert ("example", "tool_parser", "example_xml", "hibana-example-plugin", False) in rows
    assert ("example", "adapter", "example", "hibana-example-plugin", False) in rows
    assert [e for e in manager.load_errors if e.plugin == "example"] == []


def test_hibana_plugins_command_lists_the_example_plugin():
    example_entry_point()
    lines = hibana_plugins_cli().splitlines()
    example_rows = [line.split() for line in lines if line.startswith("example ")]
    assert ["example", "tool_parser", "example_xml", "hibana-example-plugin", "0.1.0", "no"] in (
        example_rows
    )
    assert ["example", "adapter", "example", "hibana-example-plugin", "0.1.0", "no"] in example_rows
    builtin = ["hibana_plugins.tool_parsers", "tool_parser", "hermes"]
    assert any(line.split()[:3] == builtin for line in lines)


def test_hibana_plugins_variable_filters_the_example_plugin():
    example_entry_point()
    assert "example_xml" not in hibana_plugins_cli(HIBANA_PLUGINS="")
    assert "example_xml" in hibana_plugins_cli(HIBANA_PLUGINS="hibana-example-plugin")
    assert "example_xml" not in hibana_plugins_cli(HIBANA_PLUGINS="some-other-plugin")


def test_example_parser_parses_text(manager):
    parser = manager.tool_parsers()["example_xml"]
    text = 'Checking. <call name="get_weather">{"city": "Paris"}</call>'
    output = parser.parse(text)
    assert output.content == "Checking." and output.error is None
    calls = [(c.name, c.arguments) for c in output.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]

    stream = parser.stream()
    deltas = [d for chunk in text for d in stream.feed(chunk)] + stream.close()
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert (calls[0].id, calls[0].name) == (stream.finish().tool_calls[0].id, "get_weather")
    assert json.loads("".join(d.arguments_fragment for d in calls)) == {"city": "Paris"}

    broken = parser.parse('<call name="f">{"city": }</call>')
    assert broken.tool_calls == [] and broken.error and "<call" in broken.content


class RecordingEngine:
    """Stands in for an Engine to show which handle calls the adapter makes (not a generation)."""

    def __init__(self):
        self.calls = []

    def open_state(self, state_id):
        self.calls.append(("open_state", state_id))
        return self

    def sync(self, token_ids):
        self.calls.append(("sync", token_ids))

    def generate(self, params):
        self.calls.append(("generate", params.max_tokens, params.temperature))
        return "completion"


def test_example_adapter_factory_is_registered_and_drives_a_handle(manager):
    factory = manager.adapters()["example"]
    engine = RecordingEngine()
    adapter = factory(engine=engine)
    assert adapter.engine is engine
    assert adapter.complete([1, 2, 3], max_tokens=5) == "completion"
    assert engine.calls == [("open_state", "example"), ("sync", [1, 2, 3]), ("generate", 5, 0.0)]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add_numbers", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}


@pytest.mark.parametrize("question, name, arguments", [
    ("What is the weather in Lisbon right now?", "get_weather", {"city": "Lisbon"}),
    ("What is 1234 plus 4321?", "add_numbers", {"a": 1234, "b": 4321}),
])
def test_example_adapter_and_parser_end_to_end_on_the_demo_model(manager, question, name, arguments):
    """Found through the entry point, the plugin's adapter drives the engine and its parser reads
    the demo model's real generation."""
    from hibana_core import Engine

    adapter_factory = manager.adapters()["example"]
    parser = manager.tool_parsers()["example_xml"]
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        prompt = engine.chat("render").prompt_ids([{"role": "user", "content": question}], [WEATHER, ADD])
        adapter = adapter_factory(engine)
        assert adapter.engine is engine
        completion = adapter.complete(prompt, max_tokens=64)
        parsed = parser.parse(completion.text)
        assert parsed.error is None, completion.text
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(name, arguments)]
        # the streaming form agrees, fed token by token as the engine streamed it
        stream = parser.stream()
        events = engine.open_state("streamed").stream(prompt=prompt)
        deltas = [d for ev in events if ev.text for d in stream.feed(ev.text)] + stream.close()
        calls = [d for d in deltas if isinstance(d, ToolCallDelta) and d.name]
        assert [c.name for c in calls] == [name]
        assert [(c.name, c.arguments) for c in stream.finish().tool_calls] == [(name, arguments)]


def test_a_parser_plugin_supplies_its_own_tool_call_grammar():
    """The chat layer holds calls to the grammar the plugin's parser gives (`tool_call_grammar`)."""
    import importlib.util

    from hibana_core import Engine
    from hibana_core.chat import Chat

    # this checkout's parser (an installed copy of the plugin may be another checkout's)
    spec = importlib.util.spec_from_file_location(
        "example_parser_under_test", REPO / "examples/hibana-example-plugin/hibana_example_plugin/parser.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = module.ExampleXmlToolParser()
    grammar = parser.tool_call_grammar([WEATHER, ADD], "add_numbers", False)
    assert grammar["format"]["type"] == "tags_with_separator" and len(grammar["format"]["tags"]) == 1
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        chat = Chat(engine, "plugin-grammar")
        chat.parser, chat.parser_name = parser, parser.name
        result = chat.respond([{"role": "user", "content": "Hello!"}], [WEATHER, ADD], tool_choice="add_numbers")
        assert [c.name for c in result.tool_calls] == ["add_numbers"]
        assert set(result.tool_calls[0].arguments) == {"a", "b"}


def test_users_name_a_plugins_tool_parser(manager):
    """A plugin's tool parser could be named only through `Chat(..., tool_parser=)` and HibanaLLM; the
    README promised it as an equal of the built-ins. `engine.chat`, ChatHibana and `hibana serve`
    name one now; a name nothing registers is a PluginError listing those that are."""
    from hibana_core import Engine
    from hibana_plugins.langchain import ChatHibana
    from hibana_plugins.manager import PluginError
    from hibana_plugins.server import ServerConfig, build_parser, serving

    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        chat = engine.chat("named-parser", tool_parser="example_xml")
        assert chat.parser_name == "example_xml" and engine.chat("default").parser_name == "hermes"
        result = chat.respond(question, [WEATHER, ADD], tool_choice="add_numbers")
        assert [c.name for c in result.tool_calls] == ["add_numbers"]  # (its grammar writes the hermes form)
        with pytest.raises(PluginError, match="no tool parser named 'nope' is registered .*example_xml"):
            engine.chat("unknown", tool_parser="nope")

        llm = ChatHibana(engine=engine, tool_parser="example_xml")
        reply = llm.bind_tools([ADD], tool_choice="add_numbers").invoke("What is 2 plus 3?")
        assert [call["name"] for call in reply.tool_calls] == ["add_numbers"]
        assert llm._identifying_params["tool_parser"] == "example_xml"  # LangChain's cache keys on it

        pytest.importorskip("fastapi")
        httpx = pytest.importorskip("httpx")
        assert build_parser().parse_args(["demo", "--tool-parser", "example_xml"]).tool_parser == "example_xml"
        with serving(engine, ServerConfig("demo", tool_parser="example_xml")) as url:
            body = {"model": "demo", "messages": question, "tools": [WEATHER, ADD], "max_tokens": 64,
                    "tool_choice": {"type": "function", "function": {"name": "add_numbers"}}}
            served = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            assert served["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "add_numbers"
