"""`hibana serve` as a demanding client of OpenAI's API drives it (the `openai` client, raw
bodies): numbers past what the sampler takes, stop strings across tokens in a stream, the
reply's shape field by field."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


HELLO = [{"role": "user", "content": "Hello!"}]


def refused(url: str, body: str, path: str = "/v1/chat/completions") -> dict:
    """The error of a raw body (JSON's 1e400 reads as infinity; the openai client cannot send it)."""
    reply = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize("field, value", [("top_k", "9223372036854775808"), ("repetition_penalty", "1e400"),
                                          ("logit_bias", '{"100000000000000000000000": 5}'),
                                          ("stop_token_ids", "[100000000000000000000000]")])
def test_numbers_past_what_the_sampler_takes_are_400s_on_their_field(url, field, value):
    """vLLM's extras and logit_bias past int64 or infinite were 400s with `param: null`, their
    message naming `SamplingParams.top_k` (Hibana's Python class, not the field sent)."""
    for path, prompt in (("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]'),
                         ("/v1/completions", '"prompt": "Hi"')):
        error = refused(url, f'{{"model": "demo", {prompt}, "max_tokens": 2, "{field}": {value}}}', path)
        assert error["param"] == field and "SamplingParams" not in error["message"], error


@pytest.mark.parametrize("key", ["1" * 5000, "\u0661\u0662", ""])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400(url, key):
    """A key of 5,000 digits was a 500 (Python's int() refuses more than 4,300); "١٢" (Arabic-Indic
    digits, decimal to Python) biased token 12."""
    error = refused(url, f'{{"model": "demo", "messages": {HELLO!r}, "max_tokens": 2, "logit_bias": {{"{key}": 1}}}}'
                    .replace("'", '"'))
    assert error["param"] == "logit_bias", error


def test_every_reply_names_the_backend_it_ran_on_as_openai_does(client, engine):
    """OpenAI's `system_fingerprint` (a client reads it beside `seed` to know when seeded replies
    may change) was left out of chat and legacy completions, whole and streamed: here it is the
    engine's fingerprint (checkpoint, dtype, KV dtype, passes), in OpenAI's form."""
    fingerprint = "fp_" + engine.fingerprint[:10]
    whole = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=4, seed=1, temperature=1.0)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion" and isinstance(whole.created, int)
    assert whole.system_fingerprint == fingerprint
    chunks = list(client.chat.completions.create(model="demo", messages=HELLO, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert {(c.id, c.object, c.system_fingerprint) for c in chunks} == {(chunks[0].id, "chat.completion.chunk",
                                                                        fingerprint)}
    text = client.completions.create(model="demo", prompt="Hello", max_tokens=2)
    assert text.id.startswith("cmpl-") and text.object == "text_completion" and text.system_fingerprint == fingerprint
    assert all(c.system_fingerprint == fingerprint
               for c in client.completions.create(model="demo", prompt="Hello", max_tokens=2, stream=True))


@pytest.mark.parametrize("stop", [["w can"], ["lo! H"], "you x"])
def test_a_streamed_stop_string_across_tokens_never_shows_a_piece_of_itself(client, stop):
    """A stop string spanning tokens (" How" + " can"), one that starts a token and ends in the
    next, and one whose start ("you") comes but never its end: each chunk of each choice holds
    only text the whole reply holds, joined to it, as vLLM's and OpenAI's streams."""
    ask = dict(model="demo", messages=HELLO, max_tokens=12, stop=stop)
    whole = client.chat.completions.create(**ask).choices[0]
    seen: dict[int, str] = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**ask, stream=True, n=2):
        for choice in chunk.choices:
            seen[choice.index] += choice.delta.content or ""
            assert whole.message.content.startswith(seen[choice.index]), (stop, seen)
    assert seen == {0: whole.message.content, 1: whole.message.content}


def test_the_developer_role_is_the_system_message(client):
    """OpenAI's `developer` role (its reasoning models' name for system) is a system message."""
    replies = [client.chat.completions.create(model="demo", max_tokens=6, messages=[
        {"role": role, "content": [{"type": "text", "text": "Answer in French."}]}, *HELLO]) for role in
        ("system", "developer")]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


def test_a_function_call_outputs_error_names_its_output(url):
    """A Responses-API tool output that is no text named `input[2].content`, a field the item
    has not (its text is `output`)."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    for output, named in (([{"type": "input_image", "image_url": "data:,"}], "input[2].output[0] has type"),
                          ({"temp": 12}, "input[2].output must be")):
        reply = httpx.post(url + "/v1/responses", timeout=60, json={"model": "demo", "max_output_tokens": 2, "input": [
            {"role": "user", "content": "Weather?"}, call, {"type": "function_call_output", "call_id": "c1",
                                                            "output": output}]})
        assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text
