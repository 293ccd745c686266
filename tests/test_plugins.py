"""Plugin manager, built-in registrations, tool parsers and `hibana plugins`.

Third-party plugins are real distributions: a module and a `*.dist-info` with an entry point,
written to a temporary directory put on sys.path, so loading goes through importlib.metadata
exactly as for a pip-installed package.
"""

from __future__ import annotations

import importlib
import json
import random
import re
import sys
import types
import warnings

import pytest

from hibana_plugins import hookimpl
from hibana_plugins.manager import (
    HibanaPluginManager,
    PluginError,
    PluginWarning,
    get_plugin_manager,
    parse_allow_list,
    reset_plugin_manager,
)
from hibana_plugins.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralArgsToolParser,
    MistralToolParser,
    ToolCallDelta,
)

BUILTIN_FAMILIES = {"llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma3_text", "phi3", "qwen3_moe", "gpt_oss"}


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("HIBANA_PLUGINS", raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture(autouse=True)
def model_families(monkeypatch):
    """hibana_core.models as the built-in family plugin; a stand-in while it is not written."""
    try:
        module = importlib.import_module("hibana_core.models")
    except ImportError:
        module = None
    if module is None or not hasattr(module, "register_model_families"):
        stand_in = types.ModuleType("hibana_core.models")

        @hookimpl
        def register_model_families(register):
            for model_type in sorted(BUILTIN_FAMILIES):
                register(model_type, stand_in)

        stand_in.register_model_families = register_model_families
        monkeypatch.setitem(sys.modules, "hibana_core.models", stand_in)


def parser_plugin(*names: str) -> str:
    registrations = "\n".join(f"    register({n!r}, object())" for n in names)
    return (
        "from hibana_plugins import hookimpl\n\n"
        f"@hookimpl\ndef register_tool_parsers(register):\n{registrations}\n"
    )


# -- the manager ---------------------------------------------------------------------------------


def test_builtins_are_registered_and_described():
    manager = HibanaPluginManager(entry_point_group=None)
    assert {"hermes", "llama3_json"} <= set(manager.tool_parsers())
    assert BUILTIN_FAMILIES <= set(manager.model_families())
    rows = {(i.plugin, i.kind, i.name) for i in manager.describe() if i.builtin}
    assert ("hibana_plugins.tool_parsers", "tool_parser", "hermes") in rows
    assert ("hibana_core.models", "model_family", "qwen3") in rows
    for kind in ("adapters", "chat_formats", "drafters", "surgery_passes"):
        assert isinstance(getattr(manager, kind)(), dict)


def test_missing_builtin_is_silent_but_a_broken_one_is_reported(make_dist):
    broken = make_dist("hibana-test-needs-dep", "unused", "import hibana_test_no_such_dependency\n")
    with pytest.warns(PluginWarning, match="hibana_test_no_such_dependency"):
        manager = HibanaPluginManager(
            builtins=("hibana_test_absent", "hibana_plugins.absent_adapter", broken),
            entry_point_group=None,
        )
    assert [e.plugin for e in manager.load_errors] == [broken]
    assert manager.load_errors[0].stage == "import"


def test_get_plugin_manager_is_one_manager_until_reset():
    first = get_plugin_manager()
    assert get_plugin_manager() is first
    reset_plugin_manager()
    assert get_plugin_manager() is not first


def test_allow_list_parsing():
    assert parse_allow_list(None) is None
    assert parse_allow_list("") == frozenset()
    assert parse_allow_list(" Alpha_Plugin, beta ,,") == {"alpha-plugin", "beta"}


@pytest.fixture
def alpha_and_beta(make_dist):
    make_dist("hibana-test-alpha", "alpha", parser_plugin("alpha_parser"))
    make_dist("hibana-test-beta", "beta", parser_plugin("beta_parser"))


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (None, {"alpha_parser", "beta_parser"}),
        ("alpha", {"alpha_parser"}),  # by entry-point name
        ("hibana-test-beta", {"beta_parser"}),  # by distribution name
        ("Hibana_Test_Alpha, beta", {"alpha_parser", "beta_parser"}),
        ("", set()),  # built-ins only
    ],
)
def test_hibana_plugins_selects_third_party_plugins(monkeypatch, alpha_and_beta, setting, expected):
    if setting is not None:
        monkeypatch.setenv("HIBANA_PLUGINS", setting)
    parsers = set(get_plugin_manager().tool_parsers())
    assert parsers & {"alpha_parser", "beta_parser"} == expected
    assert {"hermes", "llama3_json"} <= parsers
    if setting == "":
        assert not any(not info.builtin for info in get_plugin_manager().describe())


def test_hibana_plugins_is_read_once_when_the_manager_is_built(monkeypatch, alpha_and_beta):
    monkeypatch.setenv("HIBANA_PLUGINS", "alpha")
    manager = get_plugin_manager()
    monkeypatch.setenv("HIBANA_PLUGINS", "beta")
    assert get_plugin_manager() is manager
    assert "beta_parser" not in manager.tool_parsers()


def test_hibana_plugins_naming_nothing_installed_warns(monkeypatch, alpha_and_beta):
    monkeypatch.setenv("HIBANA_PLUGINS", "alpha,hibana-test-nowhere")
    with pytest.warns(PluginWarning, match="hibana-test-nowhere"):
        manager = get_plugin_manager()
    assert "alpha_parser" in manager.tool_parsers()


def test_a_distribution_whose_metadata_has_no_name_takes_nothing_down(make_dist, tmp_path):
    """One installed dist-info whose METADATA lacks its Name (a damaged or half-removed install) made
    every plugin manager, so every engine, fail with AttributeError: 'NoneType' object has no
    attribute 'strip'; pluggy loads such entry points, and so does Hibana."""
    make_dist("hibana-test-noname", "noname", parser_plugin("from_noname"))
    (tmp_path / "hibana_test_noname-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nVersion: 0.1\n")
    manager = HibanaPluginManager()
    assert {"from_noname", "hermes"} <= set(manager.tool_parsers())
    assert any(info.plugin == "noname" for info in manager.describe())
    assert "from_noname" in HibanaPluginManager(allow=parse_allow_list("noname")).tool_parsers()


def test_plugin_raising_on_import_is_skipped_with_a_warning_naming_it(make_dist, alpha_and_beta):
    make_dist("hibana-test-broken", "broken", "raise RuntimeError('boom at import')\n")
    with pytest.warns(PluginWarning, match=r"'broken' \(from hibana-test-broken\).*boom at import"):
        manager = get_plugin_manager()
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [("broken", "import")]
    assert "RuntimeError: boom at import" in manager.load_errors[0].error
    assert {"alpha_parser", "beta_parser", "hermes"} <= set(manager.tool_parsers())


def test_plugin_whose_hook_raises_is_skipped_with_a_warning(make_dist, alpha_and_beta):
    make_dist(
        "hibana-test-raises",
        "raises",
        """
        from hibana_plugins import hookimpl

        @hookimpl
        def register_tool_parsers(register):
            register("half_registered", object())
            raise ValueError("hook failed")
        """,
    )
    manager = get_plugin_manager()
    # named with its package, as a plugin that fails to import or register is
    # the warning says what is skipped: that hook's registrations, not the plugin ("It is skipped")
    with pytest.warns(PluginWarning, match=r"'raises' \(from hibana-test-raises\) raised in register_tool_parsers"
                                           r".*hook failed\. What its register_tool_parsers registers is skipped"):
        parsers = manager.tool_parsers()
    assert "half_registered" not in parsers  # nothing of a failed hook is kept
    assert {"alpha_parser", "beta_parser", "hermes"} <= set(parsers)
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [
        ("raises", "register_tool_parsers")
    ]


def test_duplicate_name_with_a_builtin_is_refused_naming_both(make_dist):
    make_dist("hibana-test-dup", "dup", parser_plugin("hermes"))
    manager = get_plugin_manager()
    with pytest.raises(PluginError) as caught:
        manager.tool_parsers()
    message = str(caught.value)
    assert "'hermes'" in message
    assert "hibana_plugins.tool_parsers" in message
    assert "'dup'" in message and "hibana-test-dup" in message


def test_duplicate_name_between_third_parties_is_refused_naming_both(make_dist):
    make_dist("hibana-test-one", "one", parser_plugin("shared"))
    make_dist("hibana-test-two", "two", parser_plugin("shared"))
    with pytest.raises(PluginError) as caught:
        get_plugin_manager().tool_parsers()
    message = str(caught.value)
    assert "'shared'" in message and "'one' (hibana-test-one 0.1)" in message
    assert "'two' (hibana-test-two 0.1)" in message


def test_registering_a_name_twice_in_one_plugin_is_a_reported_plugin_bug():
    manager = HibanaPluginManager(entry_point_group=None)
    plugin = types.SimpleNamespace(register_drafters=hookimpl(lambda register: [
        register("same", object()), register("same", object())
    ]))
    manager.register(plugin, name="twice")
    with pytest.warns(PluginWarning, match="registered twice"):
        assert "same" not in manager.drafters()


def test_misspelt_hook_and_wrong_hook_arguments_are_reported():
    manager = HibanaPluginManager(entry_point_group=None)
    misspelt = types.SimpleNamespace(register_tool_parser=hookimpl(lambda register: None),
                                     register_drafters=hookimpl(lambda register: register("half", object())))
    with pytest.warns(PluginWarning, match="unknown hook.*register_tool_parser.*It is skipped"):
        manager.register(misspelt, name="misspelt")
    assert "half" not in manager.drafters()  # skipped as the warning says, its known hooks too
    wrong_args = types.SimpleNamespace(register_drafters=hookimpl(lambda add: None))
    with pytest.warns(PluginWarning, match="'wrong-args' failed to register"):
        manager.register(wrong_args, name="wrong-args")
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [
        ("misspelt", "register"),
        ("wrong-args", "register"),
    ]


def test_a_hook_written_without_hookimpl_is_reported_not_ignored(make_dist):
    """A hook function the plugin forgot to mark `@hookimpl` (or marked with another project's
    marker) was never called and never reported: the plugin registered nothing, silently."""
    make_dist(
        "hibana-test-unmarked",
        "unmarked",
        """
        import pluggy

        from hibana_plugins import hookimpl

        def register_tool_parsers(register):
            register("unmarked_parser", object())

        register_drafters = pluggy.HookimplMarker("llm")(lambda register: register("other_marker", object()))

        @hookimpl
        def register_surgery_passes(register):
            register("marked_pass", object())
        """,
    )
    with pytest.warns(PluginWarning, match=r"'unmarked' \(from hibana-test-unmarked\).*register_drafters,"
                                           r" register_tool_parsers.*@hookimpl") as caught:
        manager = get_plugin_manager()
    assert len([w for w in caught if "unmarked" in str(w.message)]) == 1
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [("unmarked", "register")]
    assert "marked_pass" in manager.surgery_passes()  # its marked hooks still count


def test_a_hook_that_returns_what_it_should_register_is_reported():
    """A hook returning its objects (`return {"name": parser}`) rather than calling register, or an
    async hook (a coroutine never awaited), registered nothing without a word. (A hook that calls
    register may return what it likes: `lambda register: [register(...), ...]`.)"""
    manager = HibanaPluginManager(entry_point_group=None)

    async def register_drafters(register):
        register("never", object())

    plugin = types.SimpleNamespace(register_tool_parsers=hookimpl(lambda register: {"returned": object()}),
                                   register_drafters=hookimpl(register_drafters))
    manager.register(plugin, name="returns")
    with pytest.warns(PluginWarning, match=r"'returns': register_tool_parsers returned a dict.*register\(name,"):
        assert "returned" not in manager.tool_parsers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "never" not in manager.drafters()
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == []  # the coroutine is closed
    assert any("async" in str(w.message) for w in caught if w.category is PluginWarning)
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [
        ("returns", "register_tool_parsers"), ("returns", "register_drafters")]
    manager.registry("adapter")
    manager.register(types.SimpleNamespace(), name="another")  # the registries are collected again
    manager.tool_parsers()
    assert len(manager.load_errors) == 2  # a failure is recorded once, however often it recurs


def test_registering_a_plugin_twice_at_run_time():
    """The same plugin registered again (a notebook cell run twice) was a PluginError telling the user
    to uninstall one of two packages; another plugin under a taken name says to pick another name."""
    manager = HibanaPluginManager(entry_point_group=None)
    marker = object()
    plugin = types.SimpleNamespace(register_drafters=hookimpl(lambda register: register("mine", marker)))
    manager.register(plugin, name="mine")
    manager.register(plugin, name="mine")
    assert manager.drafters()["mine"] is marker
    other = types.SimpleNamespace(register_drafters=hookimpl(lambda register: register("theirs", object())))
    with pytest.raises(PluginError, match=r"a plugin named 'mine' is registered already.*name="):
        manager.register(other, name="mine")


def test_a_class_as_a_plugin_is_refused_with_what_to_point_at(make_dist):
    """An entry point naming a class whose hooks are methods: pluggy called them unbound, and each hook
    failed with "missing 1 required positional argument: 'self'"."""
    make_dist(
        "hibana-test-cls",
        "cls",
        """
        from hibana_plugins import hookimpl

        class Plugin:
            @hookimpl
            def register_tool_parsers(self, register):
                register("from_a_class", object())
        """,
    )
    sys.modules.pop("hibana_test_cls", None)
    import pathlib
    info = next(pathlib.Path(p) for p in sys.path if pathlib.Path(p, "hibana_test_cls-0.1.dist-info").is_dir())
    (info / "hibana_test_cls-0.1.dist-info" / "entry_points.txt").write_text("[hibana]\ncls = hibana_test_cls:Plugin\n")
    with pytest.warns(PluginWarning, match=r"'cls' .*is the class hibana_test_cls\.Plugin.*instance"):
        manager = get_plugin_manager()
    assert "from_a_class" not in manager.tool_parsers()
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [("cls", "register")]


def test_a_class_registered_at_run_time_is_refused_saying_to_register_an_instance():
    """manager.register(Plugin), a class whose hooks are methods, registered nothing and warned with
    advice for entry points ("point the entry point at a module"), though none was involved."""
    manager = HibanaPluginManager(entry_point_group=None)

    class Plugin:
        @hookimpl
        def register_drafters(self, register):
            register("from_a_class", object())

    class Derived(Plugin):  # its hook is its base's
        pass

    for cls in (Plugin, Derived):
        with pytest.raises(PluginError, match=r"is the class .*, whose hook register_drafters is a method .*"
                                              r"register an instance: register\(.*\(\)\)"):
            manager.register(cls)
    assert manager.load_errors == [] and "from_a_class" not in manager.drafters()
    manager.register(Plugin())
    assert "from_a_class" in manager.drafters()


def test_runtime_registration_refreshes_the_registries():
    manager = HibanaPluginManager(entry_point_group=None)
    assert "extra" not in manager.surgery_passes()
    marker = object()
    plugin = types.SimpleNamespace(
        register_surgery_passes=hookimpl(lambda register: register("extra", marker))
    )
    manager.register(plugin, name="extra-plugin")
    assert manager.surgery_passes()["extra"] is marker
    assert manager.lookup("surgery_pass", "extra") is marker
    with pytest.raises(PluginError, match="no surgery pass named 'missing'.*extra"):
        manager.lookup("surgery_pass", "missing")


def test_an_unknown_kind_is_a_plugin_error_listing_the_kinds():
    manager = HibanaPluginManager(entry_point_group=None)
    for call in (lambda: manager.lookup("parser", "hermes"), lambda: manager.registry("parser")):
        with pytest.raises(PluginError, match="unknown plugin kind 'parser'.*tool_parser"):
            call()


# -- tool parsers --------------------------------------------------------------------------------

HERMES_TEXT = (
    "I will look that up.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a \\"quoted\\" } and'
    ' </tool_call> inside"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": null}]}}\n</tool_call>'
)
LLAMA3_TEXT = (
    '<|python_tag|>{"name": "search", "parameters": {"query": "pluggy; hooks", "k": 3}}; '
    '{"name": "open", "parameters": {"url": "https://x.y/{a}"}}\n'
    '{"name": "noop", "arguments": {}}'
)


def stream_chunks(parser, chunks):
    """Feed chunks; return (text deltas joined, {index: [id, name, fragments]}, final output)."""
    stream = parser.stream()
    deltas = []
    for chunk in chunks:
        deltas += stream.feed(chunk)
    deltas += stream.close()
    output = stream.finish()
    calls = {}
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            if delta.id is not None:  # the first delta of a call carries id and name
                assert delta.index not in calls and delta.name
                calls[delta.index] = [delta.id, delta.name, ""]
            else:
                calls[delta.index][2] += delta.arguments_fragment
        else:
            assert isinstance(delta, str) and delta
    return "".join(d for d in deltas if isinstance(d, str)), calls, output


def check_stream(parser, text, chunks):
    whole = parser.parse(text)
    streamed_text, calls, output = stream_chunks(parser, chunks)
    assert streamed_text == output.content == whole.content
    assert output.error == whole.error
    assert [(c.name, c.arguments) for c in output.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    # the stream is truthful: it sent exactly the final calls, ids included, and nothing else
    assert [(call_id, name, json.loads(fragments)) for call_id, name, fragments in calls.values()] == [
        (c.id, c.name, c.arguments) for c in output.tool_calls
    ]


def all_chunkings(text):
    yield list(text)  # one character at a time
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), 5))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_hermes_parses_tool_calls():
    output = HermesToolParser().parse(HERMES_TEXT)
    assert output.content == "I will look that up."
    assert output.error is None
    assert [(c.name, c.arguments) for c in output.tool_calls] == [
        ("get_weather", {"city": "Paris", "note": 'a "quoted" } and </tool_call> inside'}),
        ("add", {"a": 1, "b": [2, {"c": None}]}),
    ]
    ids = [c.id for c in output.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize(
    "text",
    [
        HERMES_TEXT,
        "Just an answer, with <b>tags</b> and a < sign.",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1]}"}</tool_call>',  # string arguments
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call> after',  # name last
        '<tool_call>{"name": "now"}</tool_call>',  # no arguments
        'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> there',  # malformed
    ],
)
def test_hermes_streaming_matches_whole_parse_at_every_chunk_boundary(text):
    parser = HermesToolParser()
    for chunks in all_chunkings(text):
        check_stream(parser, text, chunks)


def test_hermes_malformed_json_is_content_with_an_error():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> there'
    output = HermesToolParser().parse(text)
    assert output.content == text and output.tool_calls == []
    assert "invalid JSON" in output.error


def test_hermes_keeps_good_calls_next_to_a_malformed_one():
    text = (
        '<tool_call>{"name": 3}</tool_call>\n'
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    )
    output = HermesToolParser().parse(text)
    assert output.content == '<tool_call>{"name": 3}</tool_call>'
    assert [c.name for c in output.tool_calls] == ["ok"]
    assert "name" in output.error


def test_hermes_unclosed_block_at_the_end():
    complete = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, c.arguments) for c in complete.tool_calls] == [("f", {"a": 1})]
    cut = HermesToolParser().parse('ok <tool_call>{"name": "f", "arguments": {"a": 1')
    assert cut.tool_calls == []
    assert cut.content == 'ok <tool_call>{"name": "f", "arguments": {"a": 1'
    assert "unclosed" in cut.error


def test_hermes_call_cut_inside_its_end_tag_is_complete():
    """Cut by max_tokens inside `</tool_call>`, a call whose JSON is whole is a call, as one whose
    end tag is missing altogether; a cut that is no end tag's start stays malformed text."""
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    for end_tag in ("", "<", "</tool_c", "</tool_call"):
        output = HermesToolParser().parse(call + end_tag)
        assert [(c.name, c.arguments) for c in output.tool_calls] == [("f", {"a": 1})] and not output.content, end_tag
    broken = HermesToolParser().parse(call + "<x")
    assert broken.tool_calls == [] and broken.content == call + "<x" and "unclosed" in broken.error


def test_hermes_stream_holds_back_a_possible_tag_until_decided():
    stream = HermesToolParser().stream()
    assert stream.feed("Hello <tool") == ["Hello"]
    assert stream.feed("box> is not a tag") == [" <toolbox> is not a tag"]
    assert stream.feed(" <tool_c") == []
    assert stream.feed('all>{"name": "f", "arguments": {"k": "v"}}') == []  # complete only at its end tag
    deltas = stream.feed("</tool_call>")
    assert deltas == [ToolCallDelta(0, deltas[0].id, "f", ""), ToolCallDelta(0, None, None, '{"k": "v"}')]
    assert stream.close() == []
    assert stream.finish().content == "Hello <toolbox> is not a tag"


def test_llama3_parses_several_calls():
    output = Llama3JsonToolParser().parse(LLAMA3_TEXT)
    assert output.content == "" and output.error is None
    assert [(c.name, c.arguments) for c in output.tool_calls] == [
        ("search", {"query": "pluggy; hooks", "k": 3}),
        ("open", {"url": "https://x.y/{a}"}),
        ("noop", {}),
    ]


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ('{"name": "get_time", "parameters": {"tz": "UTC"}}', "", ["get_time"]),
        (
            'Let me search.<|python_tag|>{"name": "s", "parameters": {"q": "x"}}',
            "Let me search.",
            ["s"],
        ),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call: an answer
        ("Plain text answer.", "Plain text answer.", []),
    ],
)
def test_llama3_call_positions_and_plain_answers(text, content, names):
    output = Llama3JsonToolParser().parse(text)
    assert output.content == content and output.error is None
    assert [c.name for c in output.tool_calls] == names


@pytest.mark.parametrize(
    "text",
    [
        LLAMA3_TEXT,
        'Let me search.<|python_tag|>{"name": "s", "parameters": {"q": "<|python_tag|>"}}',
        '{"answer": 42} and more',
        '<|python_tag|>{"name": "search", "parameters": {"query": }}',  # malformed
        'Sure <|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": 7}',
    ],
)
def test_llama3_streaming_matches_whole_parse_at_every_chunk_boundary(text):
    parser = Llama3JsonToolParser()
    for chunks in all_chunkings(text):
        check_stream(parser, text, chunks)


FUZZ_PIECES = [
    "<tool_call>", "</tool_call>", "<|python_tag|>", "<tool", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL",
    "{", "}", "[", "]", '"', "\\", ":",
    ",", ";", "\n", " ", "a", "1", "null", '"name"', '"arguments"', '"parameters"', '"f"',
    '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {"b": "x}"}}',
]


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser(), MistralToolParser()],
                         ids=lambda parser: type(parser).__name__)
def test_parsers_never_raise_and_streams_agree_on_random_text(parser):
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        check_stream(parser, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        check_stream(parser, text, list(text))


TRUTH_TEXTS = {
    "hermes": [
        HERMES_TEXT,
        '<tool_call>{"name":"f","arguments":"hello"}</tool_call>',  # arguments not an object
        'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}',  # unclosed, complete JSON
        '<tool_call>\n{"name": "ok", "arguments": {"x": [1, "}"]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bad", "arguments": {"a": }}\n</tool_call> tail',  # valid + malformed
        '<tool_call>{"name": "f", "arguments": {}} extra</tool_call>',  # junk after the object
    ],
    "llama3_json": [
        LLAMA3_TEXT,
        '{"name": "f", "parameters": "hello"}',
        'Hi <|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": 2}}',
        '{"name": "ok", "parameters": {}}\n{"name": "bad", "parameters": {"q": }}',
    ],
}


MISTRAL_TEXT = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "note": "] [TOOL_CALLS] }"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": [2]}, "id": "abcDEF123"}]'
)
TRUTH_TEXTS["mistral"] = [
    MISTRAL_TEXT,
    'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[CALL_ID]abcdefghi[ARGS]{}',
    '[TOOL_CALLS] [{"name": "ok", "arguments": {}}, {"name": "bad", "arguments": {"q": }}] tail',
    '[TOOL_CALLS]{"name": "f", "arguments": "hello"}',
    '[TOOL_CALLS] [3]',
    '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}',  # cut: calls kept
    '[TOOL_CALLS]f[ARGS]"{\\"a\\": 1}"',  # arguments as a string after [ARGS]: refused, alike streamed
]


def truth_cases():
    for name, texts in TRUTH_TEXTS.items():
        for i, text in enumerate(texts):
            yield pytest.param(name, text, id=f"{name}-{i}")


@pytest.mark.parametrize(("parser_name", "text"), list(truth_cases()))
def test_streamed_calls_are_the_final_calls_for_every_cut_and_chunking(parser_name, text):
    """Defect 1 (issue 11): a stream never emits a call that parse() rejects, cut off or malformed;
    for every prefix of the text (a generation cut at any character) and every chunking, the calls
    assembled from the deltas are parse(prefix).tool_calls."""
    parser = {"hermes": HermesToolParser(), "llama3_json": Llama3JsonToolParser(),
              "mistral": MistralToolParser()}[parser_name]
    rng = random.Random(11)
    for end in range(len(text) + 1):
        prefix = text[:end]
        chunkings = [list(prefix), [prefix]]
        for _ in range(2):
            cuts = sorted(rng.sample(range(len(prefix) + 1), min(4, len(prefix) + 1)))
            chunkings.append([prefix[a:b] for a, b in zip([0, *cuts], [*cuts, len(prefix)])])
        for chunks in chunkings:
            check_stream(parser, prefix, chunks)


def test_mistral_reads_both_call_forms_with_ids_its_templates_take():
    """Mistral's [TOOL_CALLS] then an array of call objects (7B v0.3, Nemo, Small 3), or NAME[ARGS]
    {...} a call (the later templates); ids of 9 letters and digits (the templates refuse others),
    the model's own where it wrote one; text before the calls is content."""
    output = MistralToolParser().parse(MISTRAL_TEXT)
    assert output.content == "" and output.error is None
    assert [(c.name, c.arguments) for c in output.tool_calls] == [
        ("get_weather", {"city": "Paris", "note": "] [TOOL_CALLS] }"}), ("add", {"a": 1, "b": [2]})]
    assert re.fullmatch(r"[0-9a-f]{9}", output.tool_calls[0].id) and output.tool_calls[1].id == "abcDEF123"
    named = MistralArgsToolParser().parse('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
                                          '[TOOL_CALLS]now[CALL_ID]Q1w2E3r4T[ARGS]{}')
    assert named.content == "Let me check." and named.error is None
    assert [(c.id[:0] or c.name, c.arguments) for c in named.tool_calls] == [("get_weather", {"city": "Oslo"}),
                                                                            ("now", {})]
    assert named.tool_calls[1].id == "Q1w2E3r4T"
    for text, error in [('[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}]', "invalid JSON"),
                        ("[TOOL_CALLS]", "without its calls"), ('[TOOL_CALLS]f{"a": 1}', "[ARGS]"),
                        ('[TOOL_CALLS] ["f"]', "call objects only")]:
        output = MistralToolParser().parse(text)
        assert output.tool_calls == [] and output.content == text and error in output.error, text
    cut = MistralToolParser().parse('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, ')
    assert [c.name for c in cut.tool_calls] == ["f"] and cut.error is None and cut.content == ""


@pytest.mark.parametrize("text", TRUTH_TEXTS["mistral"])
def test_mistral_streaming_matches_whole_parse_at_every_chunk_boundary(text):
    parser = MistralToolParser()
    for chunks in all_chunkings(text):
        check_stream(parser, text, chunks)


@pytest.mark.parametrize("parser", [MistralToolParser(), MistralArgsToolParser()], ids=lambda parser: parser.name)
def test_mistral_markers_spelled_by_ordinary_tokens_are_content(parser):
    """[TOOL_CALLS] and [ARGS] are control tokens: spelled by ordinary tokens (the model quoting a
    tool result that holds them; the grammar's free text allows that spelling, and holds no call
    in it to an offered tool or its schema) they are content, streamed or whole; a call comes
    where the model generated the tokens themselves."""
    from hibana_plugins.hookspecs import GeneratedText

    quoted = 'It says [TOOL_CALLS][{"name": "rm", "arguments": {}}] and [TOOL_CALLS]rm[ARGS]{"all": true}'
    for text in [GeneratedText(quoted, ()), GeneratedText(quoted, ((8, 20),))]:  # [ARGS] spelled, too
        output = parser.parse(text)
        assert [c.name for c in output.tool_calls] == (["rm"] if text.control_spans else []), text.control_spans
        assert "[TOOL_CALLS]rm[ARGS]" in output.content
        stream, cuts = parser.stream(), [0, 3, 8, 20, 27, 50, 63, len(text)]  # a control token comes whole
        pieces = [p for a, b in zip(cuts, cuts[1:]) for p in stream.feed(GeneratedText(text[a:b], tuple(
            (s - a, e - a) for s, e in text.control_spans if a <= s and e <= b)))]
        pieces += stream.close()
        assert "".join(p for p in pieces if isinstance(p, str)) == output.content
    text = GeneratedText('[TOOL_CALLS]rm[ARGS]{"all": true}', ((0, 12), (14, 20)))
    assert [(c.name, c.arguments) for c in parser.parse(text).tool_calls] == [("rm", {"all": True})]


def test_llama3_malformed_json_is_content_with_an_error():
    text = '<|python_tag|>{"name": "search", "parameters": {"query": }}'
    output = Llama3JsonToolParser().parse(text)
    assert output.content == text and output.tool_calls == []
    assert "invalid JSON" in output.error


# -- hibana plugins ------------------------------------------------------------------------------


def test_cli_plugins_lists_the_builtins(capsys):
    from hibana_core.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)  # other installed plugins are not ours
        assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header == ["plugin", "kind", "name", "package", "version", "builtin"]
    for word in ("hibana_plugins.tool_parsers", "hermes", "llama3_json", "hibana_core.models"):
        assert word in out
    assert re.search(r"hibana_core\.models\s+model_family\s+qwen2\s", out)


def test_cli_plugins_json(capsys):
    from hibana_core.cli import main

    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plugins"]
    hermes = next(r for r in rows if r["name"] == "hermes")
    assert (hermes["plugin"], hermes["kind"], hermes["builtin"]) == (
        "hibana_plugins.tool_parsers",
        "tool_parser",
        True,
    )


def test_cli_plugins_lists_everything_and_the_conflict_where_two_plugins_take_one_name(make_dist, capsys):
    """A plugin that registers a built-in's name is a PluginError where the name is used; `hibana
    plugins`, the command that diagnoses it, printed that alone (exit 1) and listed nothing. It
    lists every plugin, the first registration of the name, and the conflict (exit 1)."""
    from hibana_core.cli import main

    make_dist("hibana-test-dup", "dup", parser_plugin("hermes"))
    assert main(["plugins", "--json"]) == 1
    listed = json.loads(capsys.readouterr().out)
    hermes = [r for r in listed["plugins"] if r["name"] == "hermes"]
    assert [r["plugin"] for r in hermes] == ["hibana_plugins.tool_parsers"]
    assert any(r["name"] == "llama3_json" for r in listed["plugins"])
    (conflict,) = listed["conflicts"]
    assert "'hermes'" in conflict and "'dup'" in conflict and "hibana-test-dup" in conflict
    assert main(["plugins"]) == 1
    out = capsys.readouterr().out
    assert "llama3_json" in out and "conflict: tool parser 'hermes'" in out


def test_two_packages_naming_their_plugins_alike_skip_the_second_not_hibana(make_dist, capsys):
    """Two packages whose entry points share a name (a generic "plugin") made every engine fail to
    load, even the demo, and `hibana plugins` print a traceback: the second is skipped with a
    warning, and `hibana plugins` lists the clash (exit status 1)."""
    from hibana_core.cli import main

    make_dist("hibana-test-first", "samename", parser_plugin("first_parser"))
    make_dist("hibana-test-second", "samename", parser_plugin("second_parser"))
    with pytest.warns(PluginWarning, match=r"'samename' \(from hibana-test-second\) is skipped: two plugins"):
        manager = HibanaPluginManager()
    assert "first_parser" in manager.tool_parsers() and "second_parser" not in manager.tool_parsers()
    assert len(manager.clashes) == 1 and "hibana-test-first" in manager.clashes[0]
    reset_plugin_manager()
    with pytest.warns(PluginWarning):
        assert main(["plugins", "--json"]) == 1
    listed = json.loads(capsys.readouterr().out)
    assert any("two plugins are named 'samename'" in c for c in listed["conflicts"])
    assert any(r["name"] == "first_parser" for r in listed["plugins"])


def test_cli_plugins_fails_where_a_plugin_does_not_load(make_dist, capsys):
    """A plugin that fails to import is listed as skipped, the others still listed, and the exit
    status is 1 (it was 0: a plugin author's CI step `hibana plugins` passed on a broken plugin)."""
    from hibana_core.cli import main

    make_dist("hibana-test-fine", "fine", parser_plugin("fine_parser"))
    make_dist("hibana-test-broken", "broken", "raise ImportError('needs acme-sdk')\n")
    reset_plugin_manager()
    with pytest.warns(PluginWarning, match="'broken'"):
        assert main(["plugins", "--json"]) == 1
    listed = json.loads(capsys.readouterr().out)
    assert [e["plugin"] for e in listed["load_errors"]] == ["broken"]
    assert any(r["name"] == "fine_parser" for r in listed["plugins"]) and not listed["conflicts"]
    assert main(["plugins"]) == 1
    assert "skipped broken" in capsys.readouterr().out


def test_cli_usage_errors_show_the_commands_own_usage(capsys):
    from hibana_core.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["plugins", "--bogus"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("usage: hibana plugins") and "--bogus" in err


def test_cli_surgery_asks_for_its_passes(capsys):
    from hibana_core.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["surgery", "demo"])
    assert exit.value.code == 2 and "--passes" in capsys.readouterr().err


# -- model families from plugins -----------------------------------------------------------------


class QwenUnderAnotherName:
    """A plugin's family: the qwen3 decoder for a model_type transformers does not know."""

    def build(self, hf_config, ctx):
        from transformers import Qwen3Config

        from hibana_core.models import llama

        return llama.build(Qwen3Config(**{k: v for k, v in hf_config.to_dict().items() if k != "model_type"}), ctx)


def checkpoint_as(tmp_path, model_type: str):
    """A tiny qwen3 checkpoint whose config.json names `model_type`."""
    import tiny_models

    path = tiny_models.make_tiny_checkpoint("qwen3", tmp_path / model_type)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    config.pop("architectures", None)
    (path / "config.json").write_text(json.dumps(config))
    return path


def register_families(**families) -> None:
    plugin = types.ModuleType("hibana_test_families")
    plugin.register_model_families = hookimpl(lambda register: [register(n, f) for n, f in families.items()])
    get_plugin_manager().register(plugin)


def test_a_family_whose_build_raises_or_returns_another_shape_is_a_config_error_naming_it(tmp_path):
    """A family's build that raises, or returns something else than (model, args), was a bare
    ValueError ("too many values to unpack") or the plugin's own exception, naming no plugin: a
    ConfigError naming the family and its plugin, the plugin's exception chained, at load and
    when a draft model is planned (`planned_model`)."""
    import torch

    from hibana_core import loader
    from hibana_core.errors import ConfigError
    from hibana_core.forward_context import ForwardContext
    from hibana_core.models import llama

    class Raises:
        def build(self, hf_config, ctx):
            raise RuntimeError("a bug in the plugin's build")

    class Returns:
        def __init__(self, built):
            self.built = built

        def build(self, hf_config, ctx):
            return self.built(hf_config, ctx) if callable(self.built) else self.built

    def without(field):
        def built(hf_config, ctx):
            module, args = QwenUnderAnotherName().build(hf_config, ctx)
            return module, types.SimpleNamespace(**{k: v for k, v in vars(args).items() if k != field})
        return built

    cases = {
        "raises": (Raises(), r"failed in build: RuntimeError\(.a bug in the plugin's build"),
        "a_string": (Returns("not a pair"), r"returned str 'not a pair' from build, which must return \(model, args\)"),
        "a_triple": (Returns((1, 2, 3)), "returned tuple .* from build"),
        "no_module": (Returns(lambda c, ctx: (object(), llama.build(c, ctx)[1])), "returned object .* as the model"),
        "no_logits": (Returns(lambda c, ctx: (torch.nn.Linear(2, 2), llama.build(c, ctx)[1])), "as the model"),
        "no_head_dim": (Returns(without("head_dim")), "args whose head_dim is missing or no positive integer"),
        "no_build": (object(), "has no build"),
    }
    register_families(**{name: family for name, (family, _) in cases.items()})
    for name, (family, says) in cases.items():
        path = checkpoint_as(tmp_path, name)
        for load in (lambda: loader.load_model(str(path), torch.device("cpu"), "float32", ForwardContext(),
                                               progress=False),
                     lambda: loader.planned_model(str(path), torch.float32)):
            with pytest.raises(ConfigError, match=rf"model family '{name}' \(an instance of .*\) .*{says}") as caught:
                load()
            if name == "raises":
                assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_plugin_family_of_a_model_type_transformers_does_not_know_loads_without_its_warning(tmp_path):
    """transformers read such a checkpoint's config again to load its tokenizer, and warned "You are
    using a model of type `myqwen` to instantiate a model of type ``": the config the loader read
    goes to the tokenizer, which reads none (the model loads and serves as it did)."""
    import logging

    import tiny_models
    from transformers.utils import logging as hf_logging

    register_families(myqwen=QwenUnderAnotherName())
    path = checkpoint_as(tmp_path, "myqwen")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # (the tests' conftest lets errors alone through)
    hf_logging.get_logger().addHandler(handler)
    try:
        engine = tiny_models.open_engine(path)
        try:
            assert engine.tokenizer is not None and len(engine.tokenizer.encode("hello")) > 0
        finally:
            engine.close()
    finally:
        hf_logging.get_logger().removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    assert not [r for r in records if "to instantiate a model of type" in r.getMessage()]

