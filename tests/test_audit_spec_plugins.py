"""Outside audit of speculation (issue 13): plugin drafters that fail in ways a careful plugin
author does not expect, and what a request sees of them. Drafts change speed only: whatever a
drafter raises or returns, every request's output is the one without speculation, the engine
goes on serving, and the failure is a warning counted in `engine.stats().speculation`.
"""

from __future__ import annotations

import asyncio
import random
import threading
import warnings

import pytest

from hibana_core import SamplingParams
from hibana_plugins.manager import PluginWarning
from spec_drafters import registered
from tiny_models import random_tokens

pytestmark = pytest.mark.timeout(120)


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def generate_within(handle, params, prompt, seconds: float = 60.0):
    """handle.generate(params, prompt=prompt) on another thread; fails the test (rather than
    hanging it) where no answer comes within `seconds`."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = handle.generate(params, prompt=prompt)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "generate never returned: the engine stopped serving"
    if "error" in box:
        raise box["error"]
    return box["out"]


class Raising:
    """Proposes [5] for `fine_calls` calls, then raises `error` (a BaseException, not an Exception)."""

    def __init__(self, error: BaseException, fine_calls: int = 1) -> None:
        self.error = error
        self.fine_calls = fine_calls
        self.calls = 0

    def propose(self, state, k: int) -> list[int]:
        self.calls += 1
        if self.calls > self.fine_calls:
            raise self.error
        return [5][:k]

    def finished(self, context, output) -> None:
        raise self.error


@pytest.mark.parametrize("error", [asyncio.CancelledError(), SystemExit(3), KeyboardInterrupt()],
                         ids=lambda e: type(e).__name__)
def test_a_drafter_raising_a_base_exception_costs_speed_only(tiny_checkpoints, make_engine, error):
    """A plugin's drafter that lets a BaseException out (an asyncio.CancelledError from its own
    event loop, a sys.exit() in its error path, a KeyboardInterrupt on the engine's thread, where
    no Ctrl-C arrives) drafts nothing, as one raising an Exception does: it ended the engine's
    thread, and that request and every later one (a bystander's with speculation off too) waited
    for good."""
    path = tiny_checkpoints["qwen3"]
    drafter = Raising(error)
    with registered(raising=drafter):
        engine = make_engine(path, speculation={"method": "raising", "k": 3})
    history = random_tokens(random.Random(4), 20)
    want = engine.open_state("ref").generate(greedy(speculation="off"), prompt=history).token_ids
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate_within(engine.open_state("drafting"), greedy(), history)
        bystander = generate_within(engine.open_state("bystander"), greedy(speculation="off"), history)
    assert got.token_ids == want and bystander.token_ids == want
    assert drafter.calls > drafter.fine_calls
    assert any(issubclass(w.category, PluginWarning) and "drafter 'raising'" in str(w.message) for w in caught)
    assert engine.stats().speculation["drafter_errors"]["raising"] >= 1



def test_a_base_exception_out_of_a_step_fails_its_requests_not_the_engine(tiny_checkpoints, make_engine):
    """Whatever a step lets out (here a SystemExit from scheduling, where a plugin's code runs:
    drafters, grammars), the engine's thread fails that step's requests with a HibanaError and
    serves the next ones: it ended the thread, and every request waited for good."""
    from hibana_core.errors import HibanaError

    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, speculation="off")
    history = random_tokens(random.Random(5), 20)
    want = engine.open_state("ref").generate(greedy(), prompt=history).token_ids
    scheduler = engine.core.scheduler
    schedule = scheduler.schedule

    def once(*args, **kwargs):
        scheduler.schedule = schedule
        raise SystemExit(3)

    scheduler.schedule = once
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(HibanaError, match="SystemExit"):
            generate_within(engine.open_state("failing"), greedy(), history)
    assert generate_within(engine.open_state("later"), greedy(), history).token_ids == want


def test_a_draft_model_given_without_a_method_is_refused_in_the_users_own_terms():
    """speculation={"draft_model": path} names no method: the refusal says so and what to add
    (it said "got method 'suffix'", a method the caller never wrote)."""
    from hibana_core.config import SpeculationConfig
    from hibana_core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        SpeculationConfig.parse({"draft_model": "path/to/small"})
    message = str(info.value)
    assert "'suffix'" not in message and "no method" in message, message
    assert "{'method': 'draft_model', 'draft_model': path}" in message
    with pytest.raises(ConfigError, match="got method 'ngram'"):
        SpeculationConfig.parse({"method": "ngram", "draft_model": "path/to/small"})
