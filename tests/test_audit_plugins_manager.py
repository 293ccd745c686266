"""A third-party plugin author's mistakes the manager must name rather than die of or swallow:
a module that calls sys.exit() when imported or in a hook, hooks pluggy accepts but that are
given nothing to register through, and an entry point naming the hook function itself.

Plugins are real distributions (a module and a `*.dist-info` with an entry point on sys.path), as
in tests/test_plugins.py."""

from __future__ import annotations

import types
import warnings

import pytest

from hibana_plugins import hookimpl
from hibana_plugins.manager import HibanaPluginManager, PluginWarning, reset_plugin_manager

HOOK = "from hibana_plugins import hookimpl\n\n"


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("HIBANA_PLUGINS", raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def third_party_manager() -> HibanaPluginManager:
    return HibanaPluginManager(builtins=("hibana_plugins.tool_parsers",))


def test_a_plugin_calling_sys_exit_on_import_or_in_a_hook_is_skipped_not_the_end_of_hibana(make_dist):
    """SystemExit is no Exception: a plugin that exits when imported (a version guard, argparse at
    import) ended the process with its status and no word, `hibana plugins` included."""
    make_dist("acme-exits", "exits", "import sys\nsys.exit('acme needs torch 9')\n")
    make_dist("acme-hook-exits", "hook_exits", HOOK + "@hookimpl\ndef register_drafters(register):\n"
                                                      "    raise SystemExit(3)\n")
    make_dist("acme-good", "good", HOOK + "@hookimpl\ndef register_tool_parsers(register):\n"
                                          "    register('acme', object())\n")
    with pytest.warns(PluginWarning, match=r"'exits' \(from acme-exits\) failed to import: SystemExit: it called "
                                           r"sys\.exit\('acme needs torch 9'\)"):
        manager = third_party_manager()
    assert {"hermes", "acme"} <= set(manager.tool_parsers())
    with pytest.warns(PluginWarning, match=r"'hook_exits' .*raised in register_drafters: SystemExit"):
        assert "suffix" in manager.drafters()
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [("exits", "import"),
                                                                  ("hook_exits", "register_drafters")]


def test_hooks_given_nothing_to_register_through_are_reported_not_silent():
    """pluggy accepts a hook that declares no `register` (or takes it with a default, keyword-only,
    through *args) and calls it with nothing: it registered nothing without a word. A wrapper hook
    was skipped without one; a generator hook was told it 'returned' its objects."""

    def no_args():
        pass

    def keyword_only(*, register):
        register("k", object())

    def star_args(*args, **kwargs):
        args[0]("s", object())

    def defaulted(register=None):
        register("d", object())

    def wrapper(register):
        register("w", object())
        return (yield)

    def generator(register):
        yield register("g", object())

    manager = HibanaPluginManager(builtins=(), entry_point_group=None)
    plugins = {"no_args": ("register_tool_parsers", no_args, {}), "kw": ("register_adapters", keyword_only, {}),
               "star": ("register_chat_formats", star_args, {}), "dflt": ("register_drafters", defaulted, {}),
               "wrap": ("register_surgery_passes", wrapper, {"wrapper": True}),
               "gen": ("register_model_families", generator, {})}
    for name, (hook, function, options) in plugins.items():
        function.__name__ = hook
        manager.register(types.SimpleNamespace(**{hook: hookimpl(**options)(function)}), name=name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in ("tool_parser", "adapter", "chat_format", "drafter", "surgery_pass", "model_family"):
            assert manager.registry(kind) == {}
    said = {e.plugin: e.error for e in manager.load_errors}
    assert set(said) == set(plugins), said
    for name in ("no_args", "kw", "star", "dflt"):
        hook = plugins[name][0]
        assert "does not take `register` as a plain parameter" in said[name], said[name]
        assert f"def {hook}(register):" in said[name]
    assert "register_tool_parsers()" in said["no_args"] and "(*, register)" in said["kw"]
    assert "(register=None)" in said["dflt"] and "(*args, **kwargs)" in said["star"]
    assert "marked as a wrapper" in said["wrap"]
    assert "yields (a generator function)" in said["gen"] and "returned" not in said["gen"]
    assert [str(w.message) for w in caught if w.category is not PluginWarning] == []  # no TypeError, no leak
    assert len([w for w in caught if w.category is PluginWarning]) == len(plugins)


def test_an_entry_point_naming_the_hook_function_says_to_name_its_module(make_dist):
    """`func = "acme_func:register_tool_parsers"`: pluggy registers the function as a plugin and
    finds no hooks in it; `hibana plugins` listed it as registering nothing, and no warning said why."""
    make_dist("acme-func", "func", HOOK + "@hookimpl\ndef register_tool_parsers(register):\n"
                                          "    register('acme_func', object())\n", attr="register_tool_parsers")
    with pytest.warns(PluginWarning, match=r"'func' \(from acme-func\) failed to register: is the hook function "
                                           r"acme_func\.register_tool_parsers itself.*`func = \"acme_func\"`"):
        manager = third_party_manager()
    assert "acme_func" not in manager.tool_parsers()
    assert [(e.plugin, e.stage) for e in manager.load_errors] == [("func", "register")]
    assert "func" not in {info.plugin for info in manager.describe()}


def test_a_clash_between_surgery_passes_leaves_engines_without_surgery_alone():
    """Every engine read the surgery pass registry, surgery or not: two plugins registering one
    pass name (a third-party "w8") made every load a PluginError, while a drafter clash reaches only
    engines that speculate."""
    from hibana_core import Engine, PluginError as CorePluginError
    from hibana_plugins.manager import PluginError, get_plugin_manager

    class Pass:
        def apply(self, model, params):
            return {"layers": 0}

    get_plugin_manager().register(types.SimpleNamespace(
        register_surgery_passes=hookimpl(lambda register: register("w8", Pass()))), name="acme_w8")
    with Engine.from_pretrained("demo", progress=False, speculation="off") as engine:
        assert engine.surgery == []
    with pytest.raises(PluginError, match=r"surgery pass 'w8' is registered by two plugins: "
                                          r"'hibana_core\.surgery\.passes' \(built-in\) and 'acme_w8'"):
        Engine.from_pretrained("demo", progress=False, speculation="off", surgery=["w8"])
    assert CorePluginError is PluginError


def test_an_entry_point_whose_value_names_no_module_is_skipped_not_a_traceback(make_dist):
    """`x = ` or `x = my plugin` in a package's [project.entry-points.hibana]: importlib.metadata
    reads it, and asking it for the module raised AttributeError out of every engine's start
    and of `hibana plugins`."""
    make_dist("acme-empty-value", "empty_value", "", value="")
    make_dist("acme-spaced", "spaced", "", value="acme spaced plugin")
    make_dist("acme-good", "good", HOOK + "@hookimpl\ndef register_tool_parsers(register):\n"
                                          "    register('acme', object())\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = third_party_manager()
    assert "acme" in manager.tool_parsers()
    said = {e.plugin: e.error for e in manager.load_errors}
    assert said == {"empty_value": "its entry point's value '' names no module (`empty_value = package.module`, or "
                                   "`package.module:object`); fix it in the package's pyproject.toml",
                    "spaced": "its entry point's value 'acme spaced plugin' names no module (`spaced = package.module`,"
                              " or `package.module:object`); fix it in the package's pyproject.toml"}
    assert any("(from acme-spaced)" in str(w.message) for w in caught if w.category is PluginWarning)


def test_a_plugin_asking_for_the_manager_at_import_or_its_own_kind_in_a_hook_is_reported_not_a_hang(
        make_dist, monkeypatch):
    """A plugin that wraps a built-in parser, looking it up when imported (`HERMES =
    get_plugin_manager().tool_parsers()["hermes"]`), hung every engine's start and `hibana plugins`
    for good (the manager's lock, held while it imports the plugins); a hook that looks up its own
    kind recursed until RecursionError."""
    import threading

    from hibana_plugins import manager as manager_module
    from hibana_plugins.manager import get_plugin_manager

    make_dist("acme-wraps", "wraps", HOOK + "from hibana_plugins.manager import get_plugin_manager\n"
                                            "HERMES = get_plugin_manager().tool_parsers()['hermes']\n\n"
                                            "@hookimpl\ndef register_tool_parsers(register):\n"
                                            "    register('hermes_too', HERMES)\n")
    make_dist("acme-asks", "asks", HOOK + "from hibana_plugins.manager import get_plugin_manager\n\n"
                                          "@hookimpl\ndef register_drafters(register):\n"
                                          "    register('acme', get_plugin_manager().drafters()['suffix'])\n")
    monkeypatch.setenv("HIBANA_PLUGINS", "acme-wraps,acme-asks")
    built: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=lambda: built.append(get_plugin_manager()), daemon=True)
        thread.start()
        thread.join(timeout=20)
        if not built:  # the hung thread holds the manager's lock: a fresh one lets the next tests run
            manager_module._manager_lock = threading.Lock()
        assert built, "get_plugin_manager() hung"
        manager = built[0]
        assert "hermes" in manager.tool_parsers() and "hermes_too" not in manager.tool_parsers()
        assert "suffix" in manager.drafters() and "acme" not in manager.drafters()
    said = {(e.plugin, e.stage): e.error for e in manager.load_errors}
    assert set(said) == {("wraps", "import"), ("asks", "register_drafters")}, said
    assert "get_plugin_manager() was called while the plugin manager imports the plugins" in said["wraps", "import"]
    assert "the drafter registry was asked for while its hooks run" in said["asks", "register_drafters"]
    assert "RecursionError" not in said["asks", "register_drafters"]
    assert any("'wraps' (from acme-wraps) failed to import" in str(w.message) for w in caught)


def test_registering_a_hook_function_at_run_time_is_refused_saying_what_to_register():
    """manager.register(register_tool_parsers): pluggy took the function as a plugin with no hooks,
    and it registered nothing."""
    from hibana_plugins.manager import PluginError

    @hookimpl
    def register_tool_parsers(register):
        register("acme_rt", object())

    manager = HibanaPluginManager(builtins=(), entry_point_group=None)
    with pytest.raises(PluginError, match=r"register_tool_parsers is a hook function, not a plugin; register the "
                                          r"module that holds it, or an object with it as an attribute: register\("
                                          r"types\.SimpleNamespace\(register_tool_parsers=register_tool_parsers\)\)"):
        manager.register(register_tool_parsers)
    manager.register(types.SimpleNamespace(register_tool_parsers=register_tool_parsers), name="acme")
    assert "acme_rt" in manager.tool_parsers()
