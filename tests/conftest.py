"""Shared fixtures: tiny checkpoints (built once per session), the HF reference, engine factories."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

import worker_threads  # noqa: F401  # isort: skip - before torch: one thread a test worker
import pytest
import torch
from transformers.utils import logging as hf_logging

import tiny_models

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

# Triton interpreter cases of test_kernels.py that ran, and those of them that passed. On a Linux
# machine without CUDA (CI; triton is a test dependency there) a run in which they all skipped
# fails: a missing or broken triton must not leave CI green with no kernel checked. The CUDA
# cases may skip freely, and where CUDA runs the kernels compiled, the interpreter may be absent.
_interpreter_cases = {"ran": 0, "passed": 0}


def _is_interpreter_case(nodeid: str) -> bool:
    return nodeid.split("::")[0].endswith("test_kernels.py") and "[interpreter-" in nodeid


def pytest_runtest_logreport(report) -> None:
    if not _is_interpreter_case(report.nodeid):
        return
    if report.when == "setup":
        _interpreter_cases["ran"] += 1
    if report.when == "call" and report.passed:
        _interpreter_cases["passed"] += 1


def pytest_sessionfinish(session, exitstatus) -> None:
    cases = _interpreter_cases
    if (sys.platform.startswith("linux") and not torch.cuda.is_available() and cases["ran"]
            and not cases["passed"] and exitstatus == 0):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(f"FAILED: all {cases['ran']} Triton interpreter cases of test_kernels.py "
                                "were skipped; install triton (a test dependency on Linux) or fix its "
                                "interpreter", red=True)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """arch -> directory of its tiny seeded checkpoint (see tiny_models)."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {arch: tiny_models.make_tiny_checkpoint(arch, root / arch) for arch in tiny_models.ARCHS}


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(path, token_ids, max_new_tokens) -> list[int]: transformers' greedy continuation."""
    return tiny_models.hf_greedy


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """An engine on a tiny Qwen3-Coder-style checkpoint (tests/qwen_coder_model.py): its XML tool calls."""
    import qwen_coder_model

    path = qwen_coder_model.make_coder_checkpoint(tmp_path_factory.mktemp("coder"))
    with tiny_models.open_engine(path, max_model_len=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def magistral(tmp_path_factory):
    """An engine on a tiny Magistral-style checkpoint (tests/magistral_model.py): [THINK] reasoning."""
    import magistral_model

    path = magistral_model.make_magistral_checkpoint(tmp_path_factory.mktemp("magistral"))
    with tiny_models.open_engine(path, max_model_len=2048) as engine:
        yield engine


@pytest.fixture
def make_engine():
    """make_engine(path, **overrides) -> a fresh Engine, closed when the test ends."""
    engines = []

    def make(path, **overrides):
        engine = tiny_models.open_engine(path, **overrides)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def join_all():
    """join_all(threads, timeout): wait for every thread, and fail if one is still running after
    `timeout` seconds in all (a thread that deadlocked must not pass as one that finished)."""

    def join(threads: list[threading.Thread], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, f"threads still running after {timeout} s (deadlock?): {alive}"

    return join


@pytest.fixture
def make_dist(tmp_path, monkeypatch):
    """make_dist(dist_name, ep_name, source, attr=None, value=None): an installed plugin distribution
    whose entry point names its module (or `module:attr`, or `value` as written)."""
    modules = []

    def make(dist_name: str, ep_name: str, source: str, attr: str | None = None, value: str | None = None) -> str:
        module = dist_name.replace("-", "_")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
        target = value if value is not None else f"{module}:{attr}" if attr else module
        (info / "entry_points.txt").write_text(f"[hibana]\n{ep_name} = {target}\n")
        modules.append(module)
        return module

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for module in modules:
        sys.modules.pop(module, None)
