"""The dependency direction of ../shared/DESIGN.md and the names the package installs.

- `hibana_plugins.hookspecs` and `hibana_plugins.manager` are leaves: importing them loads neither
  `hibana_core` nor anything outside the standard library and pluggy.
- `hibana_core` imports no concrete plugin (tool parsers, adapters), no agent framework and not
  the benchmark harness.
- Every top-level name the `hibana` distribution installs is Hibana's own (`hibana_*`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Repository folder -> the name it is installed (and imported) as.
INSTALLED_AS = {
    "hibana_core": "hibana_core",
    "hibana_plugins": "hibana_plugins",
    "kernels": "hibana_kernels",
    "bench": "hibana_bench",
}

# What hibana_core must never import: concrete plugins, frameworks, the benchmark harness.
CORE_FORBIDDEN = (
    "hibana_plugins.tool_parsers", "hibana_plugins.harmony", "hibana_plugins.langchain", "hibana_plugins.langchain_plugin",
    "hibana_plugins.llamaindex",
    "hibana_plugins.server", "hibana_plugins.openai_api", "fastapi", "uvicorn", "hibana_bench", "bench",
    "langchain", "langchain_core",
    "langgraph", "llama_index",
)


def _run(script: str) -> None:
    """Run `script` in a fresh interpreter from the repository root (this checkout's modules)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_plugin_manager_is_a_leaf():
    _run("""
        import hibana_plugins.manager, sys
        loaded = sorted(m for m in sys.modules if m.startswith("hibana_core"))
        assert not loaded, f"importing hibana_plugins.manager loaded {loaded}"
    """)


def test_hookspecs_import_the_standard_library_and_pluggy_alone():
    _run("""
        import sys
        before = set(sys.modules)
        import hibana_plugins.hookspecs
        new = {m.partition(".")[0] for m in set(sys.modules) - before}
        other = sorted(new - set(sys.stdlib_module_names) - {"pluggy", "hibana_plugins"})
        assert not other, f"importing hibana_plugins.hookspecs loaded {other}"
    """)


def test_errors_share_one_base_class():
    import hibana_core
    from hibana_plugins import hookspecs, manager

    assert hibana_core.HibanaError is hookspecs.HibanaError
    assert issubclass(manager.PluginError, hibana_core.HibanaError)


def test_tool_call_types_are_the_contract_and_re_exported_by_the_parsers():
    from hibana_plugins import hookspecs, tool_parsers

    for name in ("ToolCall", "ParsedOutput", "ToolCallDelta", "ToolCallStream", "ToolParser"):
        assert getattr(tool_parsers, name) is getattr(hookspecs, name)


# -- imports, read from the source -----------------------------------------------------------------


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement (or importlib.import_module("literal")) in `path` names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                folder, *rest = path.parent.relative_to(ROOT).parts
                package = (INSTALLED_AS.get(folder, folder), *rest)
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ((node.module,) if node.module else ()))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_core_imports_no_concrete_plugin_framework_or_benchmark():
    bad = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _python_files("hibana_core")
        for name in _imported_modules(path)
        if any(_matches(name, prefix) for prefix in CORE_FORBIDDEN)
    }
    assert not bad, sorted(bad)


def test_nothing_imports_the_folders_by_their_uninstalled_names():
    # `kernels` and `bench` are other projects' packages: importing them by these names would
    # load whatever is installed under them, not Hibana's.
    files = _python_files("hibana_core", "hibana_plugins", "kernels", "bench", "tests",
                          "integrations_tests", "examples")
    bad = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if _matches(name, "kernels") or _matches(name, "bench")
    }
    assert not bad, sorted(bad)


def test_the_kernels_folder_yields_its_name_to_the_package_installed_under_it(tmp_path):
    """Run from the repository's root (`python -m`, pytest), `import kernels` finds this folder
    first; it is another project's name (Hugging Face's `kernels`, which transformers imports
    when installed): the import gets that package."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'theirs'\n")
    _run(f"""
        import sys
        sys.path.insert(1, {str(tmp_path / "site")!r})  # after the root (""), before site-packages
        import kernels, hibana_kernels
        assert kernels.CUDAProperties == "theirs", kernels.__file__
        assert hasattr(hibana_kernels, "paged_attention")
    """)


# Hides an installed Hugging Face `kernels` (its module and its metadata) from a fresh interpreter.
_NO_KERNELS_INSTALLED = """
    import importlib.machinery, importlib.metadata, sys
    from pathlib import Path
    ROOT = Path({root!r})
    find_spec = importlib.machinery.PathFinder.find_spec.__func__
    def in_root_only(cls, name, path=None, target=None):
        if name == "kernels":
            path = [entry for entry in (path or sys.path) if Path(entry or ".").resolve() == ROOT]
        return find_spec(cls, name, path, target)
    importlib.machinery.PathFinder.find_spec = classmethod(in_root_only)
    version = importlib.metadata.version
    def no_kernels(name):
        if name == "kernels":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)
    importlib.metadata.version = no_kernels
"""


def test_where_no_kernels_package_is_installed_the_folder_reads_as_nothing_installed():
    """transformers (5.25) finds this folder by find_spec, finds no metadata, and imports the name to
    tell an editable install from a stray folder: an ImportError there failed every model load
    (CI on 2026-12-04: 65 failed, 562 errors). What it imports must read as nothing installed."""
    _run(_NO_KERNELS_INSTALLED.format(root=str(ROOT)) + """
    import kernels
    assert getattr(kernels, "__file__", None) is None and not hasattr(kernels, "__version__")
    assert not hasattr(kernels, "CUDAProperties")
    try:
        from kernels import CUDAProperties
    except ImportError as error:
        assert "hibana_kernels" in str(error) or "CUDAProperties" in str(error), error
    else:
        raise AssertionError("from kernels import CUDAProperties succeeded")
    import hibana_kernels
    assert hasattr(hibana_kernels, "paged_attention")
    """)
    transformers = pytest.importorskip("transformers")
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    checks = getattr(import_utils, "_is_package_available", None)
    if checks is None:
        pytest.skip(f"transformers {transformers.__version__} has no _is_package_available")
    _run(_NO_KERNELS_INSTALLED.format(root=str(ROOT)) + """
    import transformers
    from transformers.utils import import_utils
    available = import_utils._is_package_available("kernels", return_version=True)[0]
    assert not available, available
    transformers.LlamaConfig()  # what failed: every model load
    """)


# -- installed names -------------------------------------------------------------------------------


def test_pyproject_installs_every_package_folder_under_hibana_names():
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert isinstance(setuptools.get("packages"), list), (
        "[tool.setuptools] packages must list the packages (packages.find cannot install a folder"
        " under another name)")
    listed = set(setuptools["packages"])
    package_dir = setuptools.get("package-dir", {})
    assert all(name.startswith("hibana_") for name in listed), sorted(listed)
    expected = set()
    for folder, name in INSTALLED_AS.items():
        assert package_dir.get(name, name) == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            expected.add(".".join((name, *parts)))
    assert listed == expected, (
        f"pyproject's [tool.setuptools] packages misses {sorted(expected - listed)}"
        f" or lists {sorted(listed - expected)} that has no folder"
    )


def _installed_top_level_names(dist: importlib.metadata.Distribution) -> set[str]:
    """Top-level importable names the distribution installs: its top_level.txt, the modules and
    packages among its files, and for an editable install, the names its finder maps."""
    names = set((dist.read_text("top_level.txt") or "").split())
    for file in dist.files or ():
        parts = file.parts
        if parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".data")):
            continue
        if parts[0].startswith("__editable__"):  # setuptools' editable machinery
            if parts[0].endswith("_finder.py"):
                names |= _editable_finder_names(Path(dist.locate_file(file)))
            continue
        names.add(parts[0].removesuffix(".py") if len(parts) == 1 else parts[0])
    names.discard("")
    return {name for name in names if not name.endswith(".pth")}


def _editable_finder_names(finder: Path) -> set[str]:
    """Top-level names in the MAPPING of setuptools' editable finder module (read, not imported)."""
    for node in ast.parse(finder.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "MAPPING":
            return {name.partition(".")[0] for name in ast.literal_eval(node.value)}
    return set()


def test_installed_distribution_has_hibana_names_only():
    # The first one an installer wrote (it has a RECORD): a checkout's hibana.egg-info, left by
    # a build and found through the current directory, is not what is installed.
    dist = next((d for d in importlib.metadata.distributions(name="hibana")
                 if d.read_text("RECORD") is not None), None)
    if dist is None:
        pytest.skip("hibana is not installed (running from a checkout)")
    names = _installed_top_level_names(dist)
    assert "hibana_core" in names, names
    foreign = sorted(name for name in names if not name.startswith("hibana"))
    assert not foreign, (
        f"the installed hibana distribution ({dist.locate_file('')}) installs {foreign};"
        f" every name must be Hibana's own. If pyproject.toml is right, reinstall: pip install -e ."
    )


# -- hibana <command> ------------------------------------------------------------------------------


def test_cli_help_lists_bench_and_demo(capsys):
    from hibana_core.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "bench" in out and "demo" in out


def test_cli_bench_without_its_entry_point_says_what_to_do(monkeypatch, capsys):
    from hibana_core import cli

    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda **selection: ())
    assert cli.main(["bench", "decode"]) == 2
    err = capsys.readouterr().err
    assert "hibana.commands" in err and "pip install" in err


def test_cli_bench_runs_the_harness_through_its_entry_point(capsys):
    if not importlib.metadata.entry_points(group="hibana.commands", name="bench"):
        pytest.skip("hibana is not installed with its entry points (pip install -e .)")
    from hibana_core.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    assert "decode" in capsys.readouterr().out
    assert os.path.realpath(sys.modules["hibana_bench.cli"].__file__).startswith(str(ROOT))


def test_an_engine_that_serves_no_langchain_call_never_imports_langchain():
    """The plugin manager imports every built-in at an engine's start; the LangChain adapter's
    module imports langchain-core (0.3-1 s of every start, for the server, LlamaIndex and the demo
    too). Its registration lives apart (`hibana_plugins.langchain_plugin`) and imports the adapter
    only when the adapters are asked for."""
    _run("""
        import sys
        from hibana_core import Engine
        from hibana_plugins.manager import get_plugin_manager

        with Engine.from_pretrained("demo", progress=False) as engine:
            engine.chat("a").respond([{"role": "user", "content": "hi"}])
        assert "langchain_core" not in sys.modules and "hibana_plugins.langchain" not in sys.modules
        from hibana_plugins.langchain import ChatHibana
        assert get_plugin_manager().adapters()["langchain"] is ChatHibana
    """)
