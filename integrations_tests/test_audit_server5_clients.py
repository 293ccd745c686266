"""`hibana serve` driven as agent frameworks drive it with the real `openai` client (sync and
async): a reply sent back as the next turn's history, and /metrics read while requests run. One
server on the bundled demo model (the conftest's), others of their own where a test needs one."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_plugins.server import ServerConfig, serving  # noqa: E402
from test_server_audit import forced_call_parser  # noqa: E402,F401 (a fixture: the call it forces)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_call_holding_half_a_surrogate_pair_goes_back_as_the_next_turns_history(engine, forced_call_parser):
    """The call's `arguments` held the lone surrogate itself (escaped only by the reply's JSON), so
    the openai client could not send the assistant message back (UnicodeEncodeError in the SDK),
    and the history a client that escapes it sends (LangChain's, any `ensure_ascii` encoder) was a
    400: the agent's tool loop ended at its second turn. The arguments are the JSON text the model
    wrote now, whole and streamed, and the next turn continues the state they left."""
    with serving(engine, ServerConfig("demo", tool_parser=forced_call_parser)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        asked = dict(model="demo", tools=[WEATHER], max_tokens=32, extra_headers={"X-Hibana-State": "half-pair"})
        reply = client.chat.completions.create(messages=messages, tool_choice="required", **asked)
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.arguments.encode()  # text a client can send (it held a lone surrogate)
        assert json.loads(call.function.arguments) == {"city": "Oslo \ud83d"}
        chunks = list(client.chat.completions.create(messages=messages, tool_choice="required", stream=True,
                                                     **{**asked, "extra_headers": {}}))
        streamed = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                           if c.choices and c.choices[0].delta.tool_calls)
        assert streamed == call.function.arguments
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = client.chat.completions.create(messages=messages, **asked)  # was a 400 (or the SDK's error)
        assert second.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_requests_in_flight_counts_a_request_of_n_choices_once_streamed_or_not(engine):
    """`hibana_requests_in_flight` ("chat requests being served") counted each choice of a
    request not streamed (3 for n=3), and the same request streamed once."""
    longer = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
        "type": "array", "items": {"type": "integer"}, "minItems": 200}}}  # 400 tokens at least
    with serving(engine, ServerConfig("demo")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            def ask() -> None:
                reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Count."}],
                                                       max_tokens=400, response_format=longer, n=3, stream=stream)
                if stream:
                    list(reply)
            asking = threading.Thread(target=ask)
            asking.start()
            seen = set()
            while asking.is_alive():
                seen.add(scrape(url)["hibana_requests_in_flight"])
                time.sleep(0.01)
            asking.join()
            assert seen <= {0.0, 1.0} and 1.0 in seen, (stream, seen)
