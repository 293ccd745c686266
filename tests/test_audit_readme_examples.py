"""The README's runnable LangChain example says what is wrong in one line, as the `hibana`
commands do, rather than with a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("langgraph")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "langchain_agent.py"


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300)


def test_langchain_example_names_a_missing_checkpoint_in_one_line(tmp_path):
    done = run_example("--model", str(tmp_path / "nowhere"))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("langchain_agent.py: checkpoint directory") and "does not exist" in done.stderr


def test_langchain_example_refuses_no_threads_as_a_usage_error():
    done = run_example("--threads", "0")
    assert done.returncode == 2
    assert "--threads must be at least 1" in done.stderr
