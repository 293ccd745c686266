"""One plugin manager per process: built-in plugins first, then installed entry points.

    manager = get_plugin_manager()
    parser = manager.tool_parsers()["hermes"]
    for info in manager.describe(): ...          # what `hibana plugins` prints

Built-ins are registered by module name and are always loaded. Third-party plugins come from the
`hibana` entry-point group; the `HIBANA_PLUGINS` environment variable, read once when the manager
is built, lists the only ones to load (by entry-point or distribution name; empty: none).

A plugin that fails to import (sys.exit() included), or whose hook raises, is reported with a
warning, recorded in `load_errors` and skipped: a broken plugin never takes Hibana down. So is what
would register nothing silently: a function named like a hook but not marked `@hookimpl`, an async
or generator hook, a hook without a plain `register` parameter, a wrapper hook, a hook that returns
its objects rather than calling `register`, a class whose hooks are methods, an entry point naming
a hook function or no module. A plugin that asks for the manager while it is being built (at import)
or for its own kind from its hook is told so (a PluginError, reported the same way). Two plugins registering the
same name within one kind is a `PluginError` naming both.

Each registry is collected on first use and cached. Every hook implementation is called on its
own (rather than through `pm.hook.<name>()`) so that one raising plugin cannot hide the others.

This module is a leaf: it imports the standard library, pluggy and `hibana_plugins.hookspecs`
alone, and finds every plugin, built-ins included, by module name or entry point. Importing it
does not load `hibana_core`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from hibana_plugins import hookspecs
from hibana_plugins.hookspecs import HibanaError

ENTRY_POINT_GROUP = "hibana"
ENV_VAR = "HIBANA_PLUGINS"

# Loaded first, in this order, by module name. A module that does not exist is skipped silently
# (a trimmed or partial install); any other failure to import one is reported. The adapters
# import without their framework and say what to install when they are used.
BUILTIN_MODULES = (
    "hibana_core.models",
    "hibana_core.speculation.drafters",
    "hibana_core.surgery.passes",
    "hibana_plugins.tool_parsers",
    "hibana_plugins.qwen_xml",
    "hibana_plugins.glm_xml",
    "hibana_plugins.minimax_xml",
    "hibana_plugins.seed_xml",
    "hibana_plugins.harmony",
    "hibana_plugins.langchain_plugin",  # (the adapter module itself is imported when adapters are asked for)
    "hibana_plugins.llamaindex",
)

# kind -> the hook that registers it
HOOKS = {
    "adapter": "register_adapters",
    "tool_parser": "register_tool_parsers",
    "chat_format": "register_chat_formats",
    "model_family": "register_model_families",
    "drafter": "register_drafters",
    "surgery_pass": "register_surgery_passes",
}


class PluginError(HibanaError):
    """Plugins conflict (two register one name), a registered name is missing, or what a plugin
    registered failed when used (a tool parser's stream: `hibana serve` answers it with a 500)."""


class PluginWarning(UserWarning):
    """A plugin failed to import or its hook raised; it was skipped."""


@dataclass(frozen=True)
class PluginInfo:
    """One row of `hibana plugins`: one registered name, or a plugin that registers nothing."""

    plugin: str
    """Name of the plugin: module name for built-ins, entry-point name otherwise."""
    kind: str | None
    """One of HOOKS' keys; None for a plugin that registers nothing."""
    name: str | None
    """The name it registered under that kind."""
    package: str | None
    """Distribution that ships the plugin, when known."""
    version: str | None
    """Version of that distribution, when known."""
    builtin: bool
    """Whether the plugin is one of Hibana's own."""


@dataclass(frozen=True)
class PluginLoadError:
    """A plugin that was skipped, and why."""

    plugin: str
    """Plugin (entry-point or module) name."""
    stage: str
    """"import", "register", or the name of the hook that raised."""
    error: str
    """The exception, as `Type: message`."""
    exception: BaseException | None = None


@dataclass(frozen=True)
class _Source:
    """Where a registered plugin came from; the module is resolved to a package on demand."""

    builtin: bool
    module: str | None = None
    package: str | None = None
    version: str | None = None


@dataclass(frozen=True)
class _Entry:
    obj: object
    plugin: str


def parse_allow_list(value: str | None) -> frozenset[str] | None:
    """HIBANA_PLUGINS' value -> the canonical names it allows, or None when it is unset."""
    if value is None:
        return None
    return frozenset(_canonical(item) for item in value.split(",") if item.strip())


def _canonical(name: str) -> str:
    # Distribution names compare like pip compares them (PEP 503).
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


# What a plugin's import or hook may raise and be skipped for. SystemExit too: a module that calls
# sys.exit() when imported (a version guard, argparse run at import) ended the whole process, silently,
# with the plugin's status, `hibana plugins` included. Ctrl+C (KeyboardInterrupt) still stops Hibana.
_PLUGIN_FAILURES = (Exception, SystemExit)


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit: it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def describe_registered(obj: object) -> str:
    """How an error names what a plugin registered: the class, function or instance, with the
    module it comes from (which tells the user whose plugin it is)."""
    if isinstance(obj, ModuleType):  # (model families are modules)
        return f"the module {obj.__name__}"
    if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")):
        kind = "the class" if isinstance(obj, type) else "the function"
        return f"{kind} {obj.__module__}.{obj.__qualname__}"
    return f"an instance of {type(obj).__module__}.{type(obj).__qualname__}"


def accepts(function: Callable[..., Any], *args: Any) -> bool:
    """Whether `function(*args)` binds to its signature: what a plugin registered is checked
    against the shape Hibana will call it with before it is called (a builtin, whose signature
    cannot be read, is given the benefit of the doubt)."""
    try:
        inspect.signature(function).bind(*args)
    except TypeError:
        return False
    except ValueError:
        pass
    return True


def _shown(value: object) -> str:
    """A value in a warning: its type, and its repr cut short."""
    return f"a {type(value).__name__} ({value!r:.60})"


def _misshapen(function: Callable[..., Any], hook: str, wrapper: bool, takes_register: bool) -> str | None:
    """What is wrong with a hook implementation Hibana cannot call to register anything, or None."""
    if wrapper:
        return (f"{hook} is marked as a wrapper (@hookimpl(wrapper=True) or hookwrapper=True), and Hibana calls"
                " each hook plainly: drop the option")
    if takes_register:
        return None
    try:
        signature = str(inspect.signature(function))
    except (TypeError, ValueError):
        signature = "(...)"
    return (f"{hook}{signature} does not take `register` as a plain parameter (no default, not keyword-only,"
            f" not *args), so it is given nothing to register through: define it as `def {hook}(register):`")


def _instance_hooks(plugin: type) -> list[str]:
    """The hooks a class (or a class it derives from) marks as plain methods (they need `self`; a
    staticmethod or classmethod does not)."""
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    return sorted({name for klass in plugin.__mro__ for name, attr in vars(klass).items()
                   if inspect.isfunction(attr) and hasattr(attr, marker)})


def _unbound(plugin: type, hooks: list[str]) -> str:
    """What is wrong with registering the class `plugin` itself, whose `hooks` are methods."""
    several = len(hooks) > 1
    return (f"the class {plugin.__module__}.{plugin.__qualname__}, whose hook{'s' if several else ''} "
            f"{', '.join(hooks)} {'are methods' if several else 'is a method'} with no instance to call "
            f"{'them' if several else 'it'} on")


def _dist_name(ep: importlib.metadata.EntryPoint) -> str | None:
    """The name of the distribution that declares `ep`; None where unknown (a dist-info whose
    METADATA has no Name, as a damaged or half-removed install leaves: pluggy loads its entry
    points all the same, and so does Hibana)."""
    if ep.dist is None:
        return None
    try:
        name = ep.dist.metadata["Name"]
    except (KeyError, OSError):  # Python 3.14 raises for a missing key
        return None
    return name if isinstance(name, str) and name.strip() else None


def _entry_point_module(ep: importlib.metadata.EntryPoint) -> str | None:
    """The module an entry point names; None where its value names none (`x = ` or `x = 1bad!`,
    which importlib.metadata reads without a word and fails on when asked)."""
    try:
        return ep.module
    except (AttributeError, ValueError):
        return None


def _entry_point_order(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    # sys.path scanning order is the file system's; sort so that runs agree
    return (_canonical(_dist_name(ep) or ""), ep.name)


def _is_missing(module_name: str, exc: ModuleNotFoundError) -> bool:
    """True when the module itself (or a package above it) does not exist, not a dependency."""
    missing = exc.name or ""
    return module_name == missing or module_name.startswith(missing + ".")


class HibanaPluginManager:
    """The registries of adapters, tool parsers, chat formats, model families, drafters and
    surgery passes, collected from built-in and installed plugins."""

    def __init__(
        self,
        builtins: Iterable[str] = BUILTIN_MODULES,
        allow: frozenset[str] | None = None,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> None:
        """`allow`: canonical names of the only third-party plugins to load (None: all).
        `entry_point_group`: None loads built-ins only (used by tests)."""
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.allow = allow
        self.load_errors: list[PluginLoadError] = []
        self.clashes: list[str] = []  # two installed plugins of one name: the second skipped (`hibana plugins`: 1)
        self._sources: dict[str, _Source] = {}
        self._registries: dict[str, dict[str, _Entry]] = {}
        self._lock = threading.RLock()
        self._module_packages: dict[str, list[str]] | None = None
        self._collecting: set[tuple[str, int]] = set()  # (kind, thread) whose hooks are being called

        builtins = tuple(builtins)
        for module_name in builtins:
            self._load_builtin(module_name)
        if entry_point_group is not None:
            self._load_entry_points(entry_point_group, skip_modules=frozenset(builtins))

    # -- loading ---------------------------------------------------------------------------------

    def _load_builtin(self, module_name: str) -> None:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not _is_missing(module_name, exc):
                self._report(module_name, "import", exc)
            return
        except _PLUGIN_FAILURES as exc:  # a plugin's import error must not take Hibana down
            self._report(module_name, "import", exc)
            return
        self._register(module, module_name, _Source(builtin=True, module=module_name))

    def _load_entry_points(self, group: str, skip_modules: frozenset[str]) -> None:
        # pluggy's load_setuptools_entrypoints(group), with the allow list applied and with each
        # entry point loaded on its own so that one that fails is reported and skipped.
        seen: set[tuple[str | None, str]] = set()
        matched: set[str] = set()
        for ep in sorted(importlib.metadata.entry_points(group=group), key=_entry_point_order):
            module = _entry_point_module(ep)
            if module in skip_modules and not ep.attr:
                continue  # Hibana's own pyproject declares its built-ins too
            dist_name = _dist_name(ep)
            version = ep.dist.version if ep.dist is not None and dist_name is not None else None
            if (dist_name, ep.name) in seen:
                continue  # the same distribution found twice on sys.path
            seen.add((dist_name, ep.name))
            if self.allow is not None:
                names = {_canonical(ep.name)} | ({_canonical(dist_name)} if dist_name else set())
                if not names & self.allow:
                    continue
                matched |= names & self.allow
            if module is None:  # ep.load() would say "'NoneType' object has no attribute 'group'"
                self._report(ep.name, "import", f"its entry point's value {ep.value!r} names no module (`{ep.name} ="
                             " package.module`, or `package.module:object`); fix it in the package's pyproject.toml",
                             package=dist_name)
                continue
            try:
                plugin = ep.load()
            except _PLUGIN_FAILURES as exc:
                self._report(ep.name, "import", exc, package=dist_name)
                continue
            try:
                self._register(plugin, ep.name, _Source(False, package=dist_name, version=version))
            except PluginError as exc:  # another package's plugin of that name came first: this one is skipped
                self.clashes.append(str(exc))
                warnings.warn(f"Hibana plugin {ep.name!r} (from {dist_name}) is skipped: {exc}", PluginWarning,
                              stacklevel=3)
        if self.allow:
            for name in sorted(self.allow - matched):
                warnings.warn(
                    f"{ENV_VAR} names {name!r}, but no installed package provides a Hibana plugin"
                    f" by that entry-point or distribution name",
                    PluginWarning,
                    stacklevel=3,
                )

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object or module at run time (as third-party, not built-in). The same
        plugin again does nothing; another under a name taken is a PluginError."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        module = plugin.__name__ if isinstance(plugin, ModuleType) else None
        hooks = _instance_hooks(plugin) if isinstance(plugin, type) else []
        if hooks:  # pluggy would call them unbound
            raise PluginError(f"{plugin.__qualname__} is {_unbound(plugin, hooks)}; register an instance: "
                              f"register({plugin.__qualname__}())")
        if inspect.isfunction(plugin) and plugin.__name__ in HOOKS.values():  # pluggy finds no hooks in it
            raise PluginError(f"{plugin.__module__}.{plugin.__qualname__} is a hook function, not a plugin; register"
                              " the module that holds it, or an object with it as an attribute:"
                              f" register(types.SimpleNamespace({plugin.__name__}={plugin.__name__}))")
        with self._lock:
            if self.pm.is_registered(plugin):
                return  # registered already (a notebook cell run twice): its hooks are in
            if self.pm.has_plugin(name):
                raise PluginError(
                    f"a plugin named {name!r} is registered already"
                    f" ({self._package_label(self._sources.get(name))}); register this one under"
                    f" another name: register(plugin, name=...)"
                )
            self._register(plugin, name, _Source(builtin=False, module=module))
            self._registries.clear()

    def _register(self, plugin: object, name: str, source: _Source) -> None:
        if self.pm.has_plugin(name):
            other = self._sources.get(name)
            raise PluginError(
                f"two plugins are named {name!r}: one from {self._package_label(other)}, one from"
                f" {self._package_label(source)}. Uninstall one, or set {ENV_VAR} to the"
                f" distribution name of the one to keep."
            )
        if self.pm.is_registered(plugin):
            return  # one module behind two entry points
        hooks = _instance_hooks(plugin) if isinstance(plugin, type) else []
        if hooks:  # pluggy would call them unbound
            self._report(
                name,
                "register",
                f"is {_unbound(plugin, hooks)}; point the entry point at a module, or at an instance"
                f" (`plugin = {plugin.__qualname__}()` in the module, the entry point `{plugin.__module__}:plugin`)",
                package=source.package,
            )
            return
        if inspect.isfunction(plugin) and plugin.__name__ in HOOKS.values():  # `my_plugin:register_tool_parsers`
            self._report(
                name,
                "register",
                f"is the hook function {plugin.__module__}.{plugin.__qualname__} itself, in which pluggy finds no"
                f" hooks; point the entry point at the module that holds it (`{name} = \"{plugin.__module__}\"`)",
                package=source.package,
            )
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy.PluginValidationError: a hook with wrong arguments
            self._report(name, "register", exc, package=source.package)
            return
        unknown = sorted(c.name for c in self.pm.get_hookcallers(plugin) or () if c.spec is None)
        if unknown:  # written for another Hibana: its other hooks may count on those; skipped whole
            self.pm.unregister(plugin)
            self._report(
                name,
                "register",
                f"implements unknown hook(s) {', '.join(unknown)};"
                f" the hooks are {', '.join(HOOKS.values())}",
                package=source.package,
            )
            return
        self._sources[name] = source
        hooked = {caller.name for caller in self.pm.get_hookcallers(plugin) or ()}
        unmarked = sorted(h for h in HOOKS.values() if h not in hooked and callable(getattr(plugin, h, None)))
        if unmarked:  # pluggy calls marked functions alone: these would register nothing, silently
            self._report(
                name,
                "register",
                f"defines {', '.join(unmarked)} without Hibana's @hookimpl (`from hibana_plugins import"
                f" hookimpl`, then `@hookimpl` above each), so Hibana never calls"
                f" {'it' if len(unmarked) == 1 else 'them'}",
                package=source.package,
                where="",
                skipped="Its marked hooks are used",
            )

    def _report(
        self,
        plugin: str,
        stage: str,
        error: BaseException | str,
        package: str | None = None,
        where: str | None = None,
        skipped: str | None = None,
    ) -> None:
        """Record a plugin's failure and warn, once a plugin and stage: the registries are collected
        again after a run-time registration, and a failure that recurs is not news. `where` and `skipped`
        replace the stage's own words ("failed to import: ...", "It is skipped")."""
        text = error if isinstance(error, str) else _describe_exception(error)
        exception = None if isinstance(error, str) else error
        if any((e.plugin, e.stage) == (plugin, stage) for e in self.load_errors):
            return
        self.load_errors.append(PluginLoadError(plugin, stage, text, exception))
        origin = f" (from {package})" if package else ""
        if where is None:
            where = {"import": "failed to import", "register": "failed to register"}.get(
                stage, f"raised in {stage}"
            ) + ":"
        if skipped is None:
            # a hook that raised loses what it registered; the plugin's other hooks stay
            skipped = "It is skipped" if stage in ("import", "register") else f"What its {stage} registers is skipped"
        warnings.warn(
            f"Hibana plugin {plugin!r}{origin}{' ' + where if where else ':'} {text}. {skipped}.",
            PluginWarning,
            stacklevel=4,
        )

    # -- registries ------------------------------------------------------------------------------

    def adapters(self) -> dict[str, object]:
        """Framework adapter factories by name."""
        return self.registry("adapter")

    def tool_parsers(self) -> dict[str, object]:
        """Tool-call parsers by name."""
        return self.registry("tool_parser")

    def chat_formats(self) -> dict[str, object]:
        """Chat formats by the model_type they apply to (the chat layer looks them up by it alone)."""
        return self.registry("chat_format")

    def model_families(self) -> dict[str, object]:
        """Model families by Hugging Face model_type."""
        return self.registry("model_family")

    def drafters(self) -> dict[str, object]:
        """Speculation drafter factories by name."""
        return self.registry("drafter")

    def surgery_passes(self) -> dict[str, object]:
        """Model surgery passes by name."""
        return self.registry("surgery_pass")

    def registry(self, kind: str) -> dict[str, object]:
        """Everything registered under one kind (a key of HOOKS), by name."""
        return {name: entry.obj for name, entry in self._entries(kind).items()}

    def lookup(self, kind: str, name: str) -> object:
        """One registered object; a PluginError that lists what exists when it is missing."""
        entries = self._entries(kind)
        if name not in entries:
            known = ", ".join(sorted(entries)) or "none"
            raise PluginError(
                f"no {kind.replace('_', ' ')} named {name!r} is registered (registered: {known})."
                f" Install the plugin that provides it, or check {ENV_VAR}."
            )
        return entries[name].obj

    def _entries(self, kind: str) -> dict[str, _Entry]:
        if kind not in HOOKS:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(HOOKS)}")
        with self._lock:
            if kind not in self._registries:
                self._registries[kind] = self._collect(kind)
            return self._registries[kind]

    def _collect(self, kind: str, conflicts: list[str] | None = None) -> dict[str, _Entry]:
        """The registrations of one kind; a name two plugins register is a PluginError, or, given
        `conflicts`, noted there and kept as the first registered it (`describe` lists the rest)."""
        collecting = (kind, threading.get_ident())
        if collecting in self._collecting:  # a hook that looks its own kind up: it recursed until RecursionError
            raise PluginError(f"the {kind.replace('_', ' ')} registry was asked for while its hooks run (a plugin's"
                              f" {HOOKS[kind]} looks it up); look registered objects up where they are used, not"
                              " in a hook")
        self._collecting.add(collecting)
        try:
            return self._call_hooks(kind, conflicts)
        finally:
            self._collecting.discard(collecting)

    def _call_hooks(self, kind: str, conflicts: list[str] | None) -> dict[str, _Entry]:
        caller = getattr(self.pm.hook, HOOKS[kind])
        label = kind.replace("_", " ")
        entries: dict[str, _Entry] = {}
        for impl in caller.get_hookimpls():  # registration order: built-ins first
            source = self._sources.get(impl.plugin_name)
            package = source.package if source else None
            misshapen = _misshapen(impl.function, caller.name, impl.hookwrapper or impl.wrapper,
                                   "register" in impl.argnames)
            if misshapen:  # pluggy takes such hooks, and calls them with nothing to register through
                self._report(impl.plugin_name, caller.name, misshapen, package=package, where="",
                             skipped="It registers nothing")
                continue
            offered: dict[str, object] = {}

            def register(name: str, obj: object, _offered: dict = offered) -> None:
                if not isinstance(name, str) or not name:
                    raise TypeError(f"a {label} name must be a non-empty string, not {name!r}")
                if obj is None:
                    raise TypeError(f"{label} {name!r} was registered as None")
                if name in _offered:
                    raise ValueError(f"{label} {name!r} is registered twice by the same plugin")
                _offered[name] = obj

            try:
                returned = impl.function(**{arg: register for arg in impl.argnames})
            except _PLUGIN_FAILURES as exc:
                self._report(impl.plugin_name, caller.name, exc, package=package)
                continue
            if inspect.iscoroutine(returned) or inspect.isgenerator(returned):  # `async def`, `yield`: its body never ran
                returned.close()
                what = ("is async (a coroutine function)" if inspect.iscoroutine(returned)
                        else "yields (a generator function)")
                undo = "drop its async" if inspect.iscoroutine(returned) else "call register where it yields"
                self._report(impl.plugin_name, caller.name, f"{caller.name} {what}, so its body never runs; hooks"
                             f" are plain functions that call register(name, obj): {undo}", package=package,
                             where="", skipped="It registers nothing")
                continue
            if returned is not None and not offered:  # pluggy's style elsewhere; here what a hook returns is lost
                self._report(impl.plugin_name, caller.name, f"{caller.name} returned {_shown(returned)} and"
                             " called register for nothing: Hibana ignores what a hook returns; it registers each"
                             " thing it provides by calling register(name, obj)", package=package, where="",
                             skipped="It registers nothing")
            for name, obj in offered.items():
                if name in entries:
                    first = entries[name].plugin
                    conflict = (
                        f"{label} {name!r} is registered by two plugins: {first!r}"
                        f" ({self._package_label(self._sources.get(first))}) and"
                        f" {impl.plugin_name!r}"
                        f" ({self._package_label(self._sources.get(impl.plugin_name))})."
                        f" Uninstall one of them, or leave one out of {ENV_VAR}."
                    )
                    if conflicts is None:
                        raise PluginError(conflict)
                    conflicts.append(conflict)
                    continue
                entries[name] = _Entry(obj, impl.plugin_name)
        return entries

    # -- description -----------------------------------------------------------------------------

    def describe(self, conflicts: list[str] | None = None) -> list[PluginInfo]:
        """Every registered plugin and each name it registers, in registration order. A name two
        plugins register is a PluginError, or, given `conflicts`, noted there (the first
        registration listed): `hibana plugins` shows everything, the conflict included."""
        registered: dict[str, list[tuple[str, str]]] = {plugin: [] for plugin in self._sources}
        for kind in HOOKS:
            try:
                entries = self._entries(kind)
            except PluginError:
                if conflicts is None:
                    raise
                entries = self._collect(kind, conflicts)
            for name, entry in sorted(entries.items()):
                registered.setdefault(entry.plugin, []).append((kind, name))
        infos = []
        for plugin, pairs in registered.items():
            package, version = self._package(self._sources.get(plugin))
            builtin = plugin in self._sources and self._sources[plugin].builtin
            for kind, name in pairs or [(None, None)]:
                infos.append(PluginInfo(plugin, kind, name, package, version, builtin))
        return infos

    def _package(self, source: _Source | None) -> tuple[str | None, str | None]:
        """(distribution, version) of a plugin, as far as the installed metadata knows."""
        if source is None:
            return None, None
        if source.package is not None:
            return source.package, source.version
        dists = []
        if source.module is not None:
            if self._module_packages is None:
                self._module_packages = importlib.metadata.packages_distributions()
            dists = self._module_packages.get(source.module.partition(".")[0], [])
        package = dists[0] if dists else ("hibana" if source.builtin else None)
        if package is None:
            return None, None
        try:
            return package, importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:  # running from a checkout
            return package, None

    def _package_label(self, source: _Source | None) -> str:
        if source is not None and source.builtin:
            return "built-in"
        package, version = self._package(source)
        if package is None:
            return "unknown package"
        return f"{package} {version}" if version else package


_manager: HibanaPluginManager | None = None
_manager_lock = threading.Lock()
_building = threading.local()  # `.active` while this thread builds the manager (imports the plugins)


def get_plugin_manager() -> HibanaPluginManager:
    """The process-wide manager, built on first use; HIBANA_PLUGINS is read then, once."""
    global _manager
    if getattr(_building, "active", False):  # a plugin's import asks for it: waiting on the lock hung for good
        raise PluginError("get_plugin_manager() was called while the plugin manager imports the plugins (a plugin"
                          " calls it when imported, or at the top of a module it imports); call it where what it"
                          " looks up is used (in a method of the object the plugin registers), not at import")
    with _manager_lock:
        if _manager is None:
            _building.active = True
            try:
                _manager = HibanaPluginManager(allow=parse_allow_list(os.environ.get(ENV_VAR)))
            finally:
                _building.active = False
        return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager; the next get_plugin_manager() builds a new one."""
    global _manager
    with _manager_lock:
        _manager = None
