"""`hibana serve` audited as a user of the `openai` client drives it (chat, legacy completions,
the Responses API): where the work a request's size sets is done, and the wire's shapes as the
installed client's types declare them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_plugins import server  # noqa: E402

HELLO = [{"role": "user", "content": "Hello!"}]


def test_a_legacy_requests_checks_run_off_the_event_loop(client, monkeypatch):
    """A legacy completion's fields were checked on the server's event loop, in time linear in the
    body (2.5M stop_token_ids, 7.5 MB: 4 s in which every other client's stream stood still); a
    chat request's are checked in a worker thread. Both are now: no loop runs where they are."""
    loops = []

    def checked_where(*args, **kwargs):
        try:
            loops.append(asyncio.get_running_loop())
        except RuntimeError:  # a worker thread: no event loop
            loops.append(None)
        return chat_call(*args, **kwargs)

    chat_call = server.chat_call
    monkeypatch.setattr(server, "chat_call", checked_where)
    client.chat.completions.create(model="demo", messages=HELLO, max_tokens=2)
    client.completions.create(model="demo", prompt="Hello", max_tokens=2, extra_body={"stop_token_ids": [5] * 1000})
    with pytest.raises(openai.BadRequestError):  # its refusals still come as 400s naming the field
        client.completions.create(model="demo", prompt="Hello", max_tokens=2, extra_body={"stop_token_ids": [-1]})
    assert loops == [None, None, None]
    reply = httpx.post(f"{client.base_url}completions", json={"model": "demo", "prompt": ["a", ""], "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


def events(url: str, path: str, body: dict) -> list[dict]:
    """A streamed reply's events, as JSON (the chat stream's [DONE] left out)."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as reply:
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]


def test_replies_and_events_validate_as_the_installed_clients_types(url):
    """Each object the server sends is what the `openai` package's types declare, checked by
    pydantic (the client builds them unchecked): the Responses usage left out
    `input_tokens_details.cache_write_tokens`, which they require. It is the input tokens computed,
    which the state keeps for the next turn: the input less those read from it."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    chat = {"model": "demo", "messages": HELLO, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    ChatCompletion.model_validate(httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json())
    for chunk in events(url, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}):
        ChatCompletionChunk.model_validate(chunk)
    asked = {"model": "demo", "input": "Hello!", "max_output_tokens": 4}
    first = Response.model_validate(httpx.post(url + "/v1/responses", json=asked, timeout=60).json())
    streamed = [TypeAdapter(ResponseStreamEvent).validate_python(event)
                for event in events(url, "/v1/responses", asked)]
    again = streamed[-1].response.usage  # the same input again: read from the state this time
    for usage in (first.usage, again):
        details = usage.input_tokens_details
        assert details.cached_tokens + details.cache_write_tokens == usage.input_tokens, usage
    assert again.input_tokens_details.cached_tokens > 0


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a worker thread: no event loop
        return None


def test_a_whole_reply_is_made_off_the_event_loop(client, monkeypatch):
    """A reply not streamed was made and written as JSON on the event loop: with top_logprobs its
    size is tokens x 20 x n (8 choices of 1,000 tokens: 11 MB, 4.5 s of CPU, in which another
    client's stream stood still 4.9 s). Now in a worker thread, for every endpoint."""
    from hibana_plugins.openai_api import Reply, TextReply
    from hibana_plugins.openai_responses import ResponsesReply

    loops = []
    for kind in (Reply, TextReply, ResponsesReply):
        def made_where(self, *results, _made=kind.completion):
            loops.append(running_loop())
            return _made(self, *results)
        monkeypatch.setattr(kind, "completion", made_where)
    asked = dict(model="demo", max_tokens=3, logprobs=True, top_logprobs=20)
    assert client.chat.completions.create(**asked, messages=HELLO).choices[0].logprobs.content
    assert len(client.chat.completions.create(**asked, messages=HELLO, n=2).choices) == 2  # (its turns together)
    assert client.completions.create(model="demo", prompt="Hello", max_tokens=3, logprobs=5).choices[0].logprobs
    assert client.responses.create(model="demo", input="Hello!", max_output_tokens=3).output_text
    assert loops == [None] * 4


def scrape(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics", timeout=60).text.splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines if line[:1] != "#")}


@pytest.mark.parametrize("framing", [b"Content-Length: 1000\r\n\r\n", b"Transfer-Encoding: chunked\r\n\r\n9\r\n"])
def test_a_client_gone_while_sending_its_body_is_a_499_not_the_servers_failure(url, framing, caplog):
    """A client that closes its connection mid-body (its own timeout, a Ctrl+C) was counted as a
    500 in /metrics, and its ClientDisconnect logged as an error with a traceback."""
    import logging
    import socket
    import time

    closed, failed = (f'hibana_requests_total{{endpoint="/v1/chat/completions",status="{s}"}}' for s in ("499", "500"))
    before = scrape(url)
    host, port = url.removeprefix("http://").split(":")
    with caplog.at_level(logging.ERROR, logger="hibana.server"), socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: hibana\r\nContent-Type: application/json\r\n"
                     + framing + b'{"model":')
    deadline = time.monotonic() + 30
    while scrape(url).get(closed, 0) != before.get(closed, 0) + 1:
        assert time.monotonic() < deadline, "the request was never counted as a 499"
        time.sleep(0.02)
    assert scrape(url).get(failed, 0) == before.get(failed, 0) and not caplog.records


def test_a_streams_last_chunks_are_made_off_the_event_loop(client, monkeypatch):
    """A turn's last batch brings its whole log-probabilities and, in a Responses stream, done
    events that repeat each item (logprobs and all: 2,000 tokens' top 20 made 12 MB), which were
    made on the event loop: another client's stream stood still 1.7 s (0.9 s now). The other
    batches, a few tokens each, stay on the loop."""
    from hibana_plugins.openai_api import Reply
    from hibana_plugins.openai_responses import ResponsesReply

    made = []
    for kind in (Reply, ResponsesReply):
        def made_where(self, deltas, index=0, _made=kind.chunks):
            made.append((any(delta.result is not None for delta in deltas), running_loop() is None))
            return _made(self, deltas, index)
        monkeypatch.setattr(kind, "chunks", made_where)
    asked = dict(model="demo", max_tokens=4, logprobs=True, top_logprobs=20, stream=True)
    assert len(list(client.chat.completions.create(**asked, messages=HELLO, n=2))) > 2
    assert len(list(client.completions.create(model="demo", prompt="Hello", max_tokens=4, logprobs=5, stream=True))) > 1
    events = list(client.responses.create(model="demo", input="Hello!", max_output_tokens=4, top_logprobs=20,
                                          include=["message.output_text.logprobs"], stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].content[0].logprobs
    assert {last for last, _ in made} == {True, False}
    assert all(off == last for last, off in made), made


def test_legacy_text_offsets_count_the_texts_characters(client, engine):
    """`text_offset` is where each token starts in the text. It added up each token's own text,
    which spells a piece of a character as "\\ufffd": after the two tokens of "é" every offset was
    one past its token (vLLM's error too). Whole and streamed (a stream's offsets go on from its
    last chunk's); a token that ends a character starts at it, as the one that began it."""
    from hibana_core.detokenizer import token_bytes
    from hibana_core.speculation import force_outputs

    text = "héllo 日本"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    spelt = token_bytes(engine.tokenizer)
    starts = [len(b"".join(map(spelt, ids[:i])).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert starts[1:3] == [1, 1]  # (the demo's tokenizer writes "é" as two byte tokens)
    for stream in (False, True):
        state = f"offsets-{stream}"
        force_outputs(engine.open_state(state), ids)
        reply = client.completions.create(model="demo", prompt="Hi", max_tokens=len(ids), logprobs=1, stream=stream,
                                          extra_headers={"X-Hibana-State": state})
        choices = [chunk.choices[0] for chunk in reply] if stream else reply.choices
        assert "".join(choice.text for choice in choices) == text
        assert [at for choice in choices if choice.logprobs for at in choice.logprobs.text_offset] == starts


def test_logprob_entries_spell_each_token_once(engine, monkeypatch):
    """Each entry of a reply's log-probabilities (the token and every alternative) decoded its
    token anew: 1,000 tokens' top 20 took 1.9 s of the 2.6 s their JSON took to make. A token is
    spelt once per Chat (and its copies: the server's legacy one)."""
    import copy

    from hibana_core.chat import Chat
    from hibana_core.state import TokenLogprob

    decoded = []
    decode = engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids, **kw: decoded.append(list(ids)) or decode(ids, **kw))
    chat = Chat(engine)
    tokens = [TokenLogprob(t, -1.0, tuple((a, -2.0) for a in range(20))) for t in (5, 6, 5, 7)]
    first = chat.openai_token_logprobs(tokens)
    assert {tuple(ids) for ids in decoded} == {(t,) for t in {5, 6, 7, *range(20)}}  # (84 entries)
    spelt = len(decoded)
    assert copy.copy(chat).openai_token_logprobs(tokens) == first and len(decoded) == spelt
    assert first[1]["token"] == decode([6]) and first[0]["top_logprobs"][3]["bytes"] == list(decode([3]).encode())
