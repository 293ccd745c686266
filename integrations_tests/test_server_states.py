"""`hibana serve`'s states as clients name them: `GET /v1/hibana/states`, `DELETE
/v1/hibana/states/{id}` and the `--max-named-states` bound, on the bundled demo model with a
state_dir. Prefix caching is off: a prompt's cached tokens come from its own state only."""

from __future__ import annotations

import time
import urllib.parse

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from hibana_core import Engine, SamplingParams  # noqa: E402
from hibana_plugins import server  # noqa: E402
from hibana_plugins.openai_api import STATE_HEADER  # noqa: E402
from hibana_plugins.options import RELEASE_WAIT  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with Engine.from_pretrained("demo", progress=False, state_dir=tmp_path_factory.mktemp("states"),
                                enable_prefix_caching=False) as engine:
        yield engine


def ask(client: httpx.Client, messages: list, user: str | None = None, header: str | None = None) -> dict:
    body = {"model": "demo", "messages": messages, "max_tokens": 12, **({"user": user} if user else {})}
    reply = client.post("/v1/chat/completions", json=body, headers={STATE_HEADER: header} if header else {})
    assert reply.status_code == 200, reply.text
    return reply.json()


def turn(client: httpx.Client, messages: list, **named) -> tuple[list, dict]:
    """One turn: the conversation with its reply, and the reply."""
    reply = ask(client, messages, **named)
    return messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""}], reply


def listed(client: httpx.Client) -> dict[str, dict]:
    reply = client.get("/v1/hibana/states")
    assert reply.status_code == 200 and reply.json()["object"] == "list"
    return {state["id"]: state for state in reply.json()["data"]}


def delete(client: httpx.Client, state_id: str) -> httpx.Response:
    return client.delete("/v1/hibana/states/" + urllib.parse.quote(state_id, safe=""))


def test_states_are_listed_and_deleted_by_id(engine):
    header_id, user_id = "team/a b%2F", "user-list-1"  # a "/", a space and a literal "%2F" in the id
    with serving(engine, ServerConfig("demo")) as url, httpx.Client(base_url=url, timeout=120) as client:
        # the header is percent-decoded: the literal "%" written "%25"
        ask(client, [{"role": "user", "content": "Weather in Oslo?"}], header="team/a b%252F")
        ask(client, [{"role": "user", "content": "Weather in Rome?"}], user=user_id)
        states = listed(client)
        for state_id in (header_id, user_id):
            assert states[state_id]["tokens"] > 0 and states[state_id]["object"] == "hibana.state"
            assert states[state_id]["client_named"] and not states[state_id]["busy"]
            assert states[state_id]["tier"] == "device" and states[state_id]["last_used_at"] > 1.6e9
        for state_id in (header_id, user_id):
            reply = delete(client, state_id)
            assert reply.status_code == 200 and reply.json() == {"id": state_id, "object": "hibana.state",
                                                                 "deleted": True}
            assert state_id not in listed(client) and state_id not in [info.id for info in engine.states()]
            again = delete(client, state_id)
            assert again.status_code == 404 and again.json()["error"]["code"] == "state_not_found"
            assert again.json()["error"]["type"] == "invalid_request_error"
        # the path as a client may write it, the "/" left as it is
        ask(client, [{"role": "user", "content": "Weather in Oslo?"}], header="team/x y")
        assert client.delete("/v1/hibana/states/team/x%20y").json()["deleted"] is True


def test_the_state_header_a_reply_names_reaches_that_state_when_sent_back(engine):
    """A reply's X-Hibana-State names the state that served it, percent-encoded as UTF-8 where it is
    not plain ASCII or holds a "%" or ","; the request header is percent-decoded, so the value sent
    back reaches that state (it made a state named by the encoding), and raw UTF-8 bytes in a
    request header are read as UTF-8 (they were read as Latin-1: 'Ã¼nÃ¯')."""
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    with serving(engine, ServerConfig("demo")) as url, httpx.Client(base_url=url, timeout=120) as client:
        for name in ["ユーザー", "x, y", "50%", " padded"]:
            body = {"model": "demo", "messages": question, "max_tokens": 4, "user": name}
            header = client.post("/v1/chat/completions", json=body).headers[STATE_HEADER]
            assert "," not in header and urllib.parse.unquote(header) == name
            history, _ = turn(client, question, header=header)
            _, again = turn(client, history + [{"role": "user", "content": "And tomorrow?"}], header=header)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert header not in listed(client) or header == name
            assert delete(client, name).status_code == 200
        raw = client.post("/v1/chat/completions", json={"model": "demo", "messages": question, "max_tokens": 4},
                          headers={STATE_HEADER: "ünï".encode()})
        assert raw.status_code == 200 and "ünï" in listed(client)
        bad = client.post("/v1/chat/completions", json={"model": "demo", "messages": question, "max_tokens": 4},
                          headers={STATE_HEADER: "%FF"})
        assert bad.status_code == 400 and "percent-encoded UTF-8" in bad.json()["error"]["message"]


def test_a_busy_state_is_not_deleted(engine):
    with serving(engine, ServerConfig("demo")) as url, httpx.Client(base_url=url, timeout=120) as client:
        ask(client, [{"role": "user", "content": "Weather in Oslo?"}], header="busy-1")
        handle = engine.open_state("busy-1")
        events = handle.stream(SamplingParams(max_tokens=engine.max_model_len // 4, ignore_eos=True))
        next(events)  # generating on it
        assert listed(client)["busy-1"]["busy"]
        reply = delete(client, "busy-1")
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "state_busy"
        for event in events:
            pass
        assert event.completion.finish_reason == "length" and not handle.closed  # intact, its turn whole
        assert listed(client)["busy-1"]["tokens"] == len(handle.tokens) > event.completion.stats.generated
        assert delete(client, "busy-1").status_code == 200 and handle.closed


def test_a_request_naming_a_state_held_in_process_is_a_409_at_once(engine):
    """A state a stream in process holds is no request whose client has gone (`options.lease_holder`):
    a request naming it is a 409 `state_busy` at once, not after RELEASE_WAIT seconds; closed, the
    stream lets the state serve again. (A stream its HTTP client closed is waited for:
    test_server_busy_release.py.)"""
    with serving(engine, ServerConfig("demo")) as url, httpx.Client(base_url=url, timeout=120) as client:
        question = [{"role": "user", "content": "Weather in Oslo?"}]
        ask(client, question, header="held-1")
        handle = engine.open_state("held-1")
        events = handle.stream(SamplingParams(max_tokens=engine.max_model_len // 4, ignore_eos=True))
        next(events)  # generating on it
        try:
            started = time.monotonic()
            body = {"model": "demo", "messages": question, "max_tokens": 4}
            reply = client.post("/v1/chat/completions", json=body, headers={STATE_HEADER: "held-1"})
            assert reply.status_code == 409 and reply.json()["error"]["code"] == "state_busy"
            assert time.monotonic() - started < RELEASE_WAIT / 2
        finally:
            events.close()
        ask(client, question, header="held-1")


def test_past_the_bound_the_least_recently_used_named_state_is_put_away_and_comes_back(engine):
    with serving(engine, ServerConfig("demo", max_named_states=2)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        history, first = {}, {}
        for user in ["bound-1", "bound-2", "bound-3"]:
            history[user], first[user] = turn(client, [{"role": "user", "content": f"Weather in {user}?"}], user=user)
        ask(client, [{"role": "user", "content": "Weather in Lima?"}])  # names no state: not counted
        states = listed(client)
        assert "bound-1" not in states and "bound-1" not in [info.id for info in engine.states()]
        assert states["bound-2"]["tier"] == states["bound-3"]["tier"] == "device"
        assert engine.registry.persisted_path("bound-1").exists()  # written before it was closed
        later = [{"role": "user", "content": "And tomorrow?"}]
        for user in ["bound-2", "bound-3", "bound-1"]:  # resident, resident, read back from the state_dir
            _, reply = turn(client, history[user] + later, user=user)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= first[user]["usage"]["prompt_tokens"], user  # its history's KV was there
            fresh = ask(client, history[user] + later)  # the same history, computed (a state named by none)
            assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert reply["choices"][0]["message"] == fresh["choices"][0]["message"], user
        named = {state_id for state_id, state in listed(client).items() if state["client_named"]}
        assert named == {"bound-3", "bound-1"}  # bound-2 put away by bound-1's return


def test_named_states_whose_streams_the_client_cut_are_counted_against_the_bound(engine):
    """A client gone mid-stream cancelled the turn's clean-up before its thread had run it: the state
    stayed open, never counted as client-named, past --max-named-states for good (an outside audit:
    4 of 6 cut streams' states)."""
    with serving(engine, ServerConfig("demo", max_named_states=2)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 300,
                "temperature": 1, "stream": True}
        for k in range(6):
            with client.stream("POST", "/v1/chat/completions", json=body, headers={STATE_HEADER: f"cut-{k}"}) as reply:
                assert reply.status_code == 200
                for i, _ in enumerate(reply.iter_lines()):
                    if i == 2:
                        break
        for _ in range(100):  # the server sees each client go when it next writes
            cut = {state_id: state for state_id, state in listed(client).items() if state_id.startswith("cut-")}
            if not any(state["busy"] for state in cut.values()) and len(cut) <= 2:
                break
            time.sleep(0.1)
        assert {state_id: state["client_named"] for state_id, state in cut.items()} == {"cut-4": True, "cut-5": True}


def test_deleting_a_put_away_state_removes_its_file(engine):
    with serving(engine, ServerConfig("demo", max_named_states=1)) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        messages = [{"role": "user", "content": "Weather in Cairo?"}]
        history, _ = turn(client, messages, user="filed-1")
        ask(client, [{"role": "user", "content": "Weather in Quito?"}], user="filed-2")  # puts filed-1 away
        path = engine.registry.persisted_path("filed-1")
        assert path.exists() and "filed-1" not in listed(client)
        reply = delete(client, "filed-1")  # not open, kept in the state_dir: forgotten
        assert reply.status_code == 200 and reply.json()["deleted"] is True and not path.exists()
        assert delete(client, "filed-1").status_code == 404
        again = ask(client, history + [{"role": "user", "content": "And tomorrow?"}], user="filed-1")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # its history did not come back


def test_max_named_states_must_be_a_whole_number_of_zero_or_more(capsys):
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit) as exited:
            server.build_parser().parse_args(["demo", "--max-named-states", bad])
        assert exited.value.code == 2
        assert "--max-named-states" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server.build_parser().parse_args(["demo", "--max-named-states", "-3"])
    assert "a number of states is 0 or more, got -3" in capsys.readouterr().err
    assert server.build_parser().parse_args(["demo", "--max-named-states", "0"]).max_named_states == 0
    assert server.build_parser().parse_args(["demo"]).max_named_states == 4096
    with pytest.raises(server.ConfigError, match=r"max_named_states \(--max-named-states\) must be an integer >= 0"):
        ServerConfig("demo", max_named_states=-1)
