"""Cancellation from every thread a caller's code (or the garbage collector) runs on: a stream left
to its finalizer, a step's failure path, timeouts. Each state stays usable afterwards: its next
greedy turn is transformers' on its whole history, and its blocks go back when it closes."""

from __future__ import annotations

import contextlib
import gc
import random
import threading

import pytest

from hibana_core import SamplingParams
from tiny_models import assert_greedy_matches, random_tokens

pytestmark = pytest.mark.timeout(120)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@contextlib.contextmanager
def no_automatic_collection():
    """The collector runs only where a test calls it (its finalizers run on that thread)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def dropped_in_a_cycle(events) -> None:
    """Leave `events` (read part-way) to the garbage collector, as a caller's traceback kept in a
    local does: only a collection finds it, on whatever thread that collection runs."""
    cycle = [events]
    cycle.append(cycle)


def assert_next_turn_is_transformers(path, handle, n: int = 6) -> None:
    history = handle.tokens
    assert_greedy_matches(path, history, handle.generate(greedy(n)).token_ids)


def test_a_stream_collected_on_the_grammar_worker_does_not_hang_the_engine(tiny_checkpoints, make_engine,
                                                                          monkeypatch):
    """A dropped stream's finalizer took the engine's lock; run by a collection on the grammar
    worker, which a step waits for while it holds that lock, it hung the engine for good."""
    from hibana_core.grammar import Grammars

    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, async_scheduling=True, speculation="off")  # masks filled beside the step
    constrained = SamplingParams(max_tokens=12, regex=r"[a-z]{3,40}")
    grammar = engine.open_state("grammar")
    grammar.generate(constrained, prompt=[4, 5])  # compiled: the next request's fill is the one watched
    victim = engine.open_state("victim")
    collected_meanwhile = threading.Event()  # while the fill, and the step, waited for the collection
    armed = threading.Event()
    fill = Grammars._fill

    def fill_after_a_collection(self, *args):
        if armed.is_set():
            armed.clear()
            # the collection runs in a thread of the fill's own, so that a finalizer that waits for
            # the lock fails this test rather than hanging it
            collector = threading.Thread(target=gc.collect, daemon=True)
            collector.start()
            collector.join(10)
            if not collector.is_alive():
                collected_meanwhile.set()
        return fill(self, *args)

    monkeypatch.setattr(Grammars, "_fill", fill_after_a_collection)
    with no_automatic_collection():
        events = victim.stream(greedy(500), prompt=random_tokens(random.Random(1), 12))
        next(events)
        dropped_in_a_cycle(events)
        del events
        armed.set()
        done = grammar.generate(constrained)
    assert collected_meanwhile.is_set(), "the dropped stream's finalizer waited for the engine's lock on the grammar worker"
    assert done.finish_reason in ("stop", "length")
    assert_next_turn_is_transformers(path, victim)
    victim.close()
    grammar.close()
    assert engine.stats().kv_blocks_used == 0


def test_a_stream_dropped_while_a_step_holds_the_lock_frees_its_state_for_the_next_call(tiny_checkpoints,
                                                                                         make_engine):
    """The finalizer no longer waits for the lock (a step's, or one a thread it interrupted
    holds): the request is marked, and the state's next call ends it, so that call finds the
    state free as it would after `close()`."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculation="off")
    h = engine.open_state("a")
    events = h.stream(greedy(500), prompt=random_tokens(random.Random(2), 20))
    next(events)
    held, released, let_go = threading.Event(), threading.Event(), threading.Event()

    def hold_the_lock() -> None:  # as a step does
        with engine.core.lock:
            held.set()
            released.wait(10)
            let_go.set()

    holder = threading.Thread(target=hold_the_lock, daemon=True)
    holder.start()
    assert held.wait(10)
    try:
        del events  # its finalizer runs here
        assert not let_go.is_set(), "the dropped stream's finalizer waited for the engine's lock"
    finally:
        released.set()
        holder.join(10)
    assert_next_turn_is_transformers(path, h)
    assert not any(info.busy for info in engine.states())
    h.close()
    assert engine.stats().kv_blocks_used == 0


def test_grammar_masks_that_fail_to_start_fail_their_request_with_their_own_error(tiny_checkpoints, make_engine,
                                                                                  monkeypatch):
    """The error of masks that could not start filling was raised from a closure over the
    except clause's name, which Python unbinds when the clause ends: the request failed with a
    NameError ("model step failed: NameError(...)") instead of its own error. An agent beside it
    goes on unchanged."""
    from hibana_core.errors import GrammarError
    from hibana_core.grammar import Grammars

    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, async_scheduling=True, speculation="off")  # masks filled beside the step
    start_masks = Grammars.start_masks

    def refused(self, scheduled, total_rows, background=True):
        if background:
            raise GrammarError("the masks could not be filled (a test's refusal)")
        return start_masks(self, scheduled, total_rows, background)

    bystander = engine.open_state("bystander")
    history = random_tokens(random.Random(3), 16)
    events = bystander.stream(greedy(40), prompt=history)
    next(events)
    monkeypatch.setattr(Grammars, "start_masks", refused)
    with pytest.raises(GrammarError, match="a test's refusal"):
        engine.open_state("constrained").generate(SamplingParams(max_tokens=12, regex=r"[a-z]{3,40}"),
                                                  prompt=[4, 5])
    monkeypatch.setattr(Grammars, "start_masks", start_masks)
    *_, final = events
    assert_greedy_matches(path, history, final.completion.token_ids)


@pytest.mark.filterwarnings("ignore:Hibana engine:UserWarning")
def test_a_failure_while_the_engine_is_idle_does_not_end_its_step_loop(tiny_checkpoints, make_engine):
    """What the engine does while idle (bring parked states back ahead of their agents) ran
    outside the loop's guard: an error there (a device out of memory for the copy) ended the
    engine's thread, and every later request waited for good."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculation="off")
    failed = threading.Event()

    def failing_idle() -> float:
        failed.set()
        raise RuntimeError("out of memory bringing a parked state back (a test's)")

    with engine.core.lock:  # (the loop waits on it: it sees the new idle work at once)
        engine.core.idle = failing_idle
        engine.core.work.notify_all()
    assert failed.wait(10)
    engine.core.idle = None
    history = random_tokens(random.Random(5), 12)
    done: list = []
    caller = threading.Thread(target=lambda: done.append(engine.open_state("a").generate(greedy(6), prompt=history)),
                              daemon=True)
    caller.start()
    caller.join(30)
    assert done, "the request waited for an engine thread that had ended"
    assert_greedy_matches(path, history, done[0].token_ids)


@pytest.mark.filterwarnings("ignore:Hibana engine:UserWarning")
def test_a_failure_between_steps_fails_no_request(tiny_checkpoints, make_engine):
    """What the engine does between steps (bring a parked state back under a step's forward)
    failed the whole step: every agent's request ended in "engine step failed"."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculation="off")
    failed = threading.Event()

    def failing_between_steps() -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("out of memory bringing a parked state back (a test's)")

    with engine.core.lock:
        engine.core.between_steps = failing_between_steps
    plans = [random_tokens(random.Random(6 + agent), 10) for agent in range(2)]
    events = [engine.open_state(f"agent-{agent}").stream(greedy(8), prompt=plan) for agent, plan in enumerate(plans)]
    finals = [list(stream)[-1] for stream in events]
    assert failed.is_set()
    for plan, final in zip(plans, finals):
        assert_greedy_matches(path, plan, final.completion.token_ids)


@contextlib.contextmanager
def lock_held_elsewhere(engine):
    """The engine's lock held by another thread (as a long step holds it) until the block ends;
    yields an Event set if that thread let go on its own, after 10 s (something waited for it)."""
    held, leave, let_go = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:
        with engine.core.lock:
            held.set()
            if not leave.wait(10):
                let_go.set()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    try:
        yield let_go
    finally:
        leave.set()
        holder.join(10)


@pytest.mark.parametrize("how", ["aclose", "task-cancelled"])
def test_an_event_loop_ending_a_stream_does_not_wait_for_a_step(tiny_checkpoints, make_engine, how):
    """`aclose()` of a stream still running, or its reader's task cancelled (a server's client
    gone), waited on the event loop for the engine's lock, which a step holds: every other task
    on the loop stood still meanwhile (a step on a CPU takes up to seconds)."""
    import asyncio

    path = tiny_checkpoints["llama"]
    engine = make_engine(path, speculation="off")
    h = engine.open_state("a")

    async def main() -> bool:
        events = h.astream(greedy(500), prompt=random_tokens(random.Random(7), 12))
        await events.__anext__()
        with lock_held_elsewhere(engine) as let_go:  # no step runs now: no event comes
            for _ in range(3):  # those handed over before land in the stream
                await asyncio.sleep(0)
            while events.ready():
                await events.__anext__()
            if how == "task-cancelled":
                reader = asyncio.ensure_future(events.__anext__())
                await asyncio.sleep(0)  # it waits for an event
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            else:
                await events.aclose()
            return not let_go.is_set()

    assert asyncio.run(main()), "the event loop waited for the engine's lock"
    assert_next_turn_is_transformers(path, h)
    assert not any(info.busy for info in engine.states())
