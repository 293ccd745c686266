"""LangGraph agents on ChatHibana as their users build them: a thread whose run was cancelled
keeps its state for the run that follows (`hibana_plugins.options.lease_holder`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from types import SimpleNamespace

import pytest

from hibana_plugins.options import LeaseHolder, _holders, lease_holder


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11's")
async def test_a_call_waits_for_a_state_whose_callers_task_is_being_cancelled():
    """A run cancelled mid-call (a chat UI's "stop", a client gone) holds its state until its
    cancellation reaches the engine, a few loop turns later; the next run on that thread, started
    meanwhile, found the state busy: a StateBusyError for a state_id, another state (all of its
    prompt recomputed) for a LangGraph thread_id. Only a caller whose task was done was waited for."""
    engine = SimpleNamespace()  # lease_holder knows an engine by its id only
    caller = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    stack = contextlib.ExitStack()
    LeaseHolder(engine, caller).open(lambda stack: (None, SimpleNamespace(id="t1/model")), stack)
    caller.cancel()  # asked to stop, not yet stopped: its call lets the state go a few turns later
    asyncio.get_running_loop().call_later(0.05, stack.close)
    await lease_holder(engine, "t1/model")
    assert (id(engine), "t1/model") not in _holders  # waited for the release
    assert caller.cancelled()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11's")
async def test_a_call_waits_for_a_state_whose_cancelled_call_is_still_setting_up_its_turn():
    """The state a call names was noted only once its turn was set up, after the lease (a new tool
    set's grammar is built under it the first time, 0.2 s on the demo): a run cancelled meanwhile
    held its state unnoted, and the next run on the thread went to another state (its whole prompt
    recomputed), or, on a state_id, raised StateBusyError."""
    engine = SimpleNamespace()
    caller = asyncio.create_task(asyncio.sleep(60))
    leased, set_up = threading.Event(), threading.Event()

    def open_turn(stack):  # leased, then the turn set up until told
        leased.set()
        set_up.wait(5)
        return None, SimpleNamespace(id="t1/model")

    holder = await lease_holder(engine, "t1/model", caller)
    stack = contextlib.ExitStack()
    opening = asyncio.get_running_loop().run_in_executor(None, holder.open, open_turn, stack)
    await asyncio.get_running_loop().run_in_executor(None, leased.wait, 5)
    caller.cancel()

    async def let_go():  # the turn set up, then let go as the cancelled call ends
        await asyncio.sleep(0.05)
        set_up.set()
        await opening
        stack.close()
    letting_go = asyncio.create_task(let_go())
    await lease_holder(engine, "t1/model")
    assert letting_go.done() and (id(engine), "t1/model") not in _holders  # waited for the release
