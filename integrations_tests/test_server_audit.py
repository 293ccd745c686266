"""`hibana serve` as a demanding OpenAI-client user drives it: what a model writes that the wire
must still carry, and requests whose errors must name the field at fault."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_plugins.server import ServerConfig, serving  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture
def forced_call_parser():
    """The hermes parser, its grammar forcing one call whose arguments hold half of an escaped
    surrogate pair, as a model that writes emoji as `\\ud83d\\ude00` may cut one."""
    from hibana_plugins import hookimpl
    from hibana_plugins.manager import get_plugin_manager, reset_plugin_manager
    from hibana_plugins.tool_parsers import HermesToolParser

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo \\ud83d"}}\n</tool_call>'

    class Forced(HermesToolParser):
        def tool_call_grammar(self, tools, tool_choice, parallel):
            return {"type": "structural_tag", "format": {"type": "const_string", "value": call}}

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            register("hibana_test_forced_call", Forced())

    reset_plugin_manager()
    get_plugin_manager().register(Plugin(), name="hibana-test-forced-call")
    try:
        yield "hibana_test_forced_call"
    finally:
        reset_plugin_manager()


def test_a_call_whose_arguments_hold_a_lone_surrogate_is_carried_whole_and_streamed(engine, forced_call_parser):
    """Arguments that decode to a lone surrogate (which UTF-8 cannot carry) come as its JSON
    escape: the reply was a 500 and the stream broke off mid-way (UnicodeEncodeError)."""
    with serving(engine, ServerConfig("demo", tool_parser=forced_call_parser)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        asked = dict(model="demo", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                     tool_choice="required", max_tokens=64)
        reply = client.chat.completions.create(**asked)
        call = reply.choices[0].message.tool_calls[0]
        assert json.loads(call.function.arguments) == {"city": "Oslo \ud83d"}
        assert reply.choices[0].finish_reason == "tool_calls"
        chunks = list(client.chat.completions.create(**asked, stream=True))
        arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                            if c.choices and c.choices[0].delta.tool_calls)
        assert json.loads(arguments) == {"city": "Oslo \ud83d"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


MAX_STOPS = 64


def test_stop_strings_are_bounded(client):
    """Each stop string is matched at every generated character on the engine's thread: one
    request with 100,000 of them slowed a client beside it 23-fold. Past 64, a 400 on `stop`."""
    asked = dict(model="demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    reply = client.chat.completions.create(**asked, stop=[f"never {i}" for i in range(MAX_STOPS)])
    assert reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**asked, stop=[f"never {i}" for i in range(MAX_STOPS + 1)])
    assert caught.value.body["param"] == "stop" and str(MAX_STOPS) in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt="Hello", max_tokens=4, stop=["x"] * (MAX_STOPS + 1))
    assert caught.value.body["param"] == "stop"


def test_a_legacy_prompt_that_is_no_text_is_a_400_on_prompt(client):
    """A completions prompt holding a lone surrogate (JSON's "\\ud83d") is refused on `prompt`:
    the 400 named `messages`, a field that endpoint has not."""
    def refused(path: str, body: str) -> tuple[int, dict]:  # (the openai client cannot send a lone surrogate)
        reply = httpx.post(f"{client.base_url}{path}", content=body, headers={"Content-Type": "application/json"})
        return reply.status_code, reply.json()["error"]

    status, error = refused("completions", '{"model": "demo", "prompt": "Hello \\ud83d", "max_tokens": 2}')
    assert status == 400 and error["param"] == "prompt" and "surrogate" in error["message"], error
    status, error = refused("chat/completions",
                            '{"model": "demo", "messages": [{"role": "user", "content": "\\ud83d"}]}')
    assert status == 400 and error["param"] == "messages", error  # the chat endpoint's is on messages still


def test_allowed_tools_take_the_responses_api_entries_as_a_named_choice_does():
    """`allowed_tools` naming a tool as the Responses API writes it ({"type": "function", "name":
    ...}), which a named tool_choice takes: it was a 400 saying the entry "names None"."""
    from hibana_plugins.openai_api import ApiError, ChatRequest, chat_call, parse_request

    tools = [{"type": "function", "function": {"name": name}} for name in ("get_weather", "get_time")]
    for entry in ({"type": "function", "function": {"name": "get_time"}}, {"type": "function", "name": "get_time"}):
        request = parse_request({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                 "tool_choice": {"type": "allowed_tools",
                                                 "allowed_tools": {"mode": "required", "tools": [entry]}}},
                                ChatRequest)
        call = chat_call(request, None, 64)
        assert call.tool_choice == "required" and [t["function"]["name"] for t in call.tools] == ["get_time"]
        assert [t["function"]["name"] for t in call.listed_tools] == ["get_weather", "get_time"]
    request = parse_request({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                             "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                                 "mode": "auto", "tools": [{"type": "function", "name": "rm_rf"}]}}}, ChatRequest)
    with pytest.raises(ApiError) as caught:
        chat_call(request, None, 64)
    assert caught.value.param == "tool_choice" and "'rm_rf'" in caught.value.message


def test_a_large_body_is_decoded_and_checked_off_the_event_loop(client, monkeypatch):
    """Decoding 8 MB of JSON, walking it for its depth, validating it and normalising 140,000
    tools took seconds on the event loop, every other client's stream standing still (a 4 s gap
    in a stream beside a 7 MB request, 13 s beside one of tools). Now a large body is decoded in a
    worker thread, and every chat request is checked and rendered in one; a small body is decoded
    in place."""
    import threading

    from hibana_plugins import server

    threads: dict[str, list[str]] = {"decode": [], "call": []}

    def recorded(name, work):
        def run(*args, **kwargs):
            threads[name].append(threading.current_thread().name)
            return work(*args, **kwargs)
        return run

    monkeypatch.setattr(server, "decode_json", recorded("decode", server.decode_json))
    monkeypatch.setattr(server, "chat_call", recorded("call", server.chat_call))
    large = {"role": "system", "content": "x", "name": "n" * (server.OFF_LOOP_BYTES + 1)}
    for messages in ([{"role": "user", "content": "Hello!"}], [large, {"role": "user", "content": "Hello!"}]):
        reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
        assert reply.choices[0].message.content
    loop = "hibana-serve"  # the thread `serving` runs the server's event loop in
    assert threads["decode"][0] == loop and threads["decode"][1] != loop, threads
    assert loop not in threads["call"] and len(threads["call"]) == 2, threads


def test_more_messages_or_tools_than_the_context_holds_are_refused_before_rendering(client, monkeypatch):
    """Each message or tool is a token of the prompt at least: more of them than the context holds
    (the demo's 2,048) is a context_length_exceeded 400 before the chat template runs, which took
    ~0.2 ms a message and 100 s of CPU for 140,000 tools before the same 400."""
    from hibana_core.chat import Chat

    rendered = []
    render_text = Chat.render_text
    monkeypatch.setattr(Chat, "render_text", lambda self, *args, **kwargs: rendered.append(1) or
                        render_text(self, *args, **kwargs))
    hi = {"role": "user", "content": "hi"}
    tools = [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(2049)]
    for asked, param in (({"messages": [hi] * 2049}, "messages"), ({"messages": [hi], "tools": tools}, "tools")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="demo", max_tokens=2, **asked)
        error = caught.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == param, error
        assert f"2049 {param}" in error["message"], error
    assert not rendered
    client.chat.completions.create(model="demo", messages=[hi], max_tokens=2)  # and the next is served
    assert rendered


def test_browser_pages_on_this_machine_may_call_others_only_where_allowed(engine):
    """CORS: a page served from localhost (any port) gets the browser's preflight answered, as Ollama
    allows; another origin only where --allowed-origins names it, or '*'. The API key still guards
    every call, though a preflight (which never carries it) is answered without it."""
    from hibana_core.errors import ConfigError

    def preflight(url: str, origin: str) -> httpx.Response:
        return httpx.options(f"{url}/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-hibana-state"})

    with serving(engine, ServerConfig("demo", api_key="k", allowed_origins=("https://app.example.com",))) as url:
        for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "https://app.example.com"):
            reply = preflight(url, origin)
            assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin, origin
        reply = preflight(url, "https://elsewhere.example")
        assert reply.status_code == 400 and "access-control-allow-origin" not in reply.headers
        page = {"Origin": "https://app.example.com"}
        assert httpx.get(f"{url}/v1/models", headers=page).status_code == 401
        reply = httpx.get(f"{url}/v1/models", headers={**page, "Authorization": "Bearer k"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "x-hibana-state" in reply.headers["access-control-expose-headers"].lower()
    with serving(engine, ServerConfig("demo", allowed_origins=("*",))) as url:
        assert preflight(url, "https://elsewhere.example").headers["access-control-allow-origin"] == "*"
    for wrong in (("app.example.com",), ("https://app.example.com/path",), "https://app.example.com"):
        with pytest.raises(ConfigError, match="allowed_origins"):
            ServerConfig("demo", allowed_origins=wrong)
