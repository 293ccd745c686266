"""A chat call's `timeout` while its request cannot make a token: queued behind other agents for
an agent slot (or in a long prefill). It was checked only as tokens arrived, so a call with
timeout=0.5 waited for the whole generation ahead of it (33 s on a CPU) before it raised."""

from __future__ import annotations

import asyncio

import pytest

from hibana_core import Engine, SamplingParams
from hibana_core.errors import ChatTimeoutError

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def one_slot():
    """The demo model with one agent slot: a second request waits until the first ends."""
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", num_blocks=160,
                                max_concurrent_agents=1) as engine:
        yield engine


def occupy(engine):
    """A generation that holds the only slot far longer than any test waits (cancelled at the end)."""
    events = engine.open_state("occupant").stream(SamplingParams(max_tokens=1900, ignore_eos=True), prompt=[5, 6, 7])
    next(events)  # admitted: it holds the slot
    return events


@pytest.mark.parametrize("driver", ["respond", "arespond"])
def test_a_chat_timeout_ends_a_call_still_queued_for_a_slot(one_slot, driver):
    occupant = occupy(one_slot)
    chat = one_slot.chat(f"queued-{driver}")
    try:
        with pytest.raises(ChatTimeoutError, match="raise the timeout"):
            if driver == "respond":
                chat.respond(HELLO, timeout=0.5)
            else:
                asyncio.run(chat.arespond(HELLO, timeout=0.5))
        assert not occupant.request.finished, "the call waited for the generation ahead of it"
    finally:
        occupant.close()
    assert chat.handle.tokens == []  # a failed call leaves its state as it was
    assert not any(info.busy for info in one_slot.states())
    assert chat.respond(HELLO, params=SamplingParams(max_tokens=4), timeout=60).usage.completion_tokens > 0

