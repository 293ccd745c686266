"""Chat timeouts at their limits (an outside tester of limits, second pass)."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from hibana_core import ChatTimeoutError, Engine, SamplingParams

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def demo():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", max_model_len=128,
                                num_blocks=64) as engine:
        yield engine


@pytest.mark.parametrize("timeout", [math.inf, 1e308, 10**400], ids=["inf", "1e308", "10**400"])
def test_a_timeout_past_what_a_timer_waits_is_no_deadline(demo, monkeypatch, timeout):
    """timeout=float('inf') (or 1e308) started a threading.Timer whose thread died of
    OverflowError ('timestamp out of range for platform time_t', printed as an unhandled thread
    exception); 10**400 was an OverflowError of the call itself. They run as without a timeout."""
    died = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_type))
    chat = demo.chat("far-deadline")
    assert chat.respond(HELLO, params=SamplingParams(max_tokens=2), timeout=timeout).usage.completion_tokens == 2
    result = asyncio.run(chat.arespond(HELLO, params=SamplingParams(max_tokens=2), timeout=timeout))
    assert result.usage.completion_tokens == 2
    for thread in threading.enumerate():  # (a Timer still alive would die later)
        if isinstance(thread, threading.Timer):
            thread.join(1)
    assert not died
    with pytest.raises(ChatTimeoutError):  # a deadline that comes still stops the call
        chat.respond(HELLO, params=SamplingParams(max_tokens=2), timeout=1e-9)
