"""Small defects audited: the adapters' error when their framework is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_both_adapters_say_what_to_install_with_one_kind_of_error():
    """Without its framework, `ChatHibana(...)` raised a bare ImportError and `HibanaLLM` a plain
    HibanaError: a caller's `except ImportError` (the usual guard of an optional dependency) missed
    the one, `except HibanaError` the other. Both raise MissingDependencyError, a HibanaError and
    an ImportError, naming the pip command (a subprocess: the frameworks' imports are blocked)."""
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("langchain_core", "langchain", "langgraph", "llama_index"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        from hibana_core import HibanaError, MissingDependencyError
        from hibana_plugins.langchain import ChatHibana
        for make in (lambda: ChatHibana(model="demo"), lambda: __import__("hibana_plugins.llamaindex").llamaindex.HibanaLLM):
            try:
                make()
            except ImportError as exc:
                assert isinstance(exc, MissingDependencyError) and isinstance(exc, HibanaError), repr(exc)
                print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert len(said) == 2, done.stdout
    assert "ChatHibana needs langchain-core" in said[0] and "pip install 'hibana[langchain]'" in said[0]
    assert "HibanaLLM needs llama-index-core" in said[1] and "pip install 'hibana[llamaindex]'" in said[1]
