"""`hibana serve` and a state that another request holds (`options.lease_holder`, as the adapters'
async calls): a request whose client closed its stream is waited for, so that the next turn sent at
once finds its state (and its KV) again, by the `X-Hibana-State` header or the `user` field; a
request still being read is not, so an overlapping request on the state is refused (or, for `user`,
served by another state) at once rather than after `options.RELEASE_WAIT` seconds. On the bundled
demo model, prefix caching off: a prompt's cached tokens come from its own state only."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from hibana_core import Engine  # noqa: E402
from hibana_plugins.openai_api import STATE_HEADER  # noqa: E402
from hibana_plugins.options import RELEASE_WAIT  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402

STEP_DELAY = 0.01
"""Seconds each engine step takes beside the demo model's own (a larger model's step): a turn of
`LONG` lasts seconds, still generating when the test's next request comes."""
RELEASE_DELAY = 0.3
"""Seconds the engine takes to let a state go (`slow_release`): a cut turn that ends at a large
model's next step. The next request then always finds the state still held, as it may on a real
machine, rather than only when the timing happens to fall so."""
QUESTION = [{"role": "user", "content": "Tell me about Oslo."}]
LONG = {"model": "demo", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", progress=False, enable_prefix_caching=False) as engine:
        yield engine


@pytest.fixture
def client(engine, monkeypatch):
    """A client of the server, its engine's steps `STEP_DELAY` seconds longer."""
    step = engine.core.step

    def slow_step() -> bool:
        time.sleep(STEP_DELAY)
        return step()
    monkeypatch.setattr(engine.core, "step", slow_step)
    with serving(engine, ServerConfig("demo")) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


@pytest.fixture
def slow_release(engine, monkeypatch):
    """Every lease on the engine lets its state go `RELEASE_DELAY` seconds late."""
    lease = engine.lease

    @contextlib.contextmanager
    def slow_lease(*args, **kwargs):
        with lease(*args, **kwargs) as handle:
            try:
                yield handle
            finally:
                time.sleep(RELEASE_DELAY)
    monkeypatch.setattr(engine, "lease", slow_lease)


def streamed_then_cut(client: httpx.Client, **named) -> str:
    """A long streamed turn on QUESTION, its connection closed by the client after a few chunks of
    its reply; the reply's text so far."""
    body = {**LONG, "messages": QUESTION, "stream": True, **({"user": named["user"]} if "user" in named else {})}
    headers = {STATE_HEADER: named["header"]} if "header" in named else {}
    text, chunks = "", 0
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
                chunks += 1
                if chunks == 4:
                    break
    return text


def next_turn(client: httpx.Client, text: str, **named) -> httpx.Response:
    messages = QUESTION + [{"role": "assistant", "content": text}, {"role": "user", "content": "And Rome?"}]
    body = {"model": "demo", "messages": messages, "max_tokens": 4,
            **({"user": named["user"]} if "user" in named else {})}
    headers = {STATE_HEADER: named["header"]} if "header" in named else {}
    return client.post("/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize("by", ["header", "user"])
def test_the_next_turn_after_a_stream_its_client_closed_gets_its_state(client, slow_release, by):
    """The client closes a stream on the state its header (or its `user` field) names and at once
    sends the next turn: the request waits for the cut turn to let the state go, and reuses its KV
    (by `user`, rather than going to a new state, whose prompt is all computed again)."""
    name = f"cut-{by}-1"
    text = streamed_then_cut(client, **{by: name})
    reply = next_turn(client, text, **{by: name})
    assert reply.status_code == 200, reply.text
    assert reply.headers[STATE_HEADER] == name
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_next_turn_after_a_whole_reply_its_client_gave_up_gets_the_users_state(client, slow_release):
    """Not streamed: the client's timeout closes the connection while the turn generates; the next
    turn of its user, sent at once, waits for that turn to let the state go."""
    body = {**LONG, "messages": QUESTION, "user": "gave-up-user-1"}
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    reply = next_turn(client, "", user="gave-up-user-1")
    assert reply.status_code == 200, reply.text
    assert reply.headers[STATE_HEADER] == "gave-up-user-1"
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@contextlib.contextmanager
def streaming(client: httpx.Client, **named):
    """A long streamed turn on QUESTION, still read (its first chunk) while the block runs."""
    body = {**LONG, "messages": QUESTION, "stream": True, **({"user": named["user"]} if "user" in named else {})}
    headers = {STATE_HEADER: named["header"]} if "header" in named else {}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()  # (kept: an iterator collected would close the connection)
        next(lines)
        yield


def test_a_request_on_a_state_a_live_request_holds_is_refused_at_once(client):
    """Two requests on one `X-Hibana-State` that overlap: the second gets its 409 at once; the first,
    whose client still reads it, is not waited for."""
    with streaming(client, header="live-header-1"):
        started = time.monotonic()
        reply = next_turn(client, "", header="live-header-1")
        elapsed = time.monotonic() - started
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "state_busy"
    assert elapsed < RELEASE_WAIT / 2, elapsed


def test_a_request_of_a_user_whose_state_a_live_request_holds_goes_to_another_state_at_once(client):
    with streaming(client, user="live-user-1"):
        started = time.monotonic()
        reply = next_turn(client, "", user="live-user-1")
        elapsed = time.monotonic() - started
    assert reply.status_code == 200 and reply.headers[STATE_HEADER] != "live-user-1"
    assert elapsed < RELEASE_WAIT / 2, elapsed
