"""`hibana serve` audited for OpenAI-API parity of the less common request fields, as a demanding
vLLM / OpenAI user drives it with the real `openai` client and raw HTTP: n, seed, logprobs,
logit_bias, stop, max_tokens beside max_completion_tokens, stream_options, response_format and
tool_choice streamed, legacy completions' echo / suffix / prompt forms, the error shapes, and
clients that leave. One server on the bundled demo model (the conftest's), another of its own
where a test needs a higher max_tokens limit."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_plugins.server import ServerConfig, serving  # noqa: E402

HELLO = [{"role": "user", "content": "Hello!"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def events(url: str, path: str, body: dict) -> list:
    """A raw SSE request's data events, "[DONE]" as it is."""
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(chunks: list, index: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c != "[DONE]" and c["choices"] and c["choices"][0]["index"] == index)


def wait_until_idle(engine, what: str) -> None:
    deadline = time.monotonic() + 30
    while any(info.busy for info in engine.states()) or engine.stats().requests_running:
        assert time.monotonic() < deadline, f"{what}: a state is still held after its client left"
        time.sleep(0.02)


# --- fields Hibana cannot serve are 400s naming them, not silently dropped --------------------------

def test_modalities_asking_for_audio_are_a_400_naming_the_field(client):
    """`modalities: ["text", "audio"]` asks for an audio reply (OpenAI's audio models); `audio` is
    refused, but modalities was taken and answered in text as if nothing were asked. Text only is
    served; any other modality is a 400 on `modalities`, as the openai client raises it."""
    ask = dict(model="demo", messages=HELLO, max_tokens=2)
    for modalities in (["text", "audio"], ["audio"]):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**ask, modalities=modalities)
        assert caught.value.body["param"] == "modalities" and "text only" in caught.value.body["message"]
        assert caught.value.body["type"] == "invalid_request_error"
    assert client.chat.completions.create(**ask, modalities=["text"]).choices[0].message.content


def test_vllms_continuous_usage_stats_is_refused_not_ignored(client):
    """vLLM's `stream_options.continuous_usage_stats` (the usage in every chunk) was silently
    dropped: the client read no usage where it asked for it. It is a 400 naming it, as the README
    says vLLM's other extras are; OpenAI's own `include_obfuscation` is still taken."""
    ask = dict(model="demo", messages=HELLO, max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert caught.value.body["param"] == "stream_options.continuous_usage_stats"
    chunks = list(client.chat.completions.create(**ask, stream_options={"include_usage": True,
                                                                        "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-1].choices == []


# --- sampling fields ------------------------------------------------------------------------------

def test_a_seeded_reply_is_the_same_alone_streamed_with_logprobs_and_beside_other_requests(client):
    """`seed` with temperature > 0: the same seed samples the same reply whether it runs alone, a
    second time (its prompt reused from the resident state), streamed, with log-probabilities
    asked for, pinned by `user`, as choice 0 of n=2, or batched beside other sampled requests."""
    ask = dict(model="demo", messages=[{"role": "user", "content": "Tell me something odd."}], max_tokens=20,
               temperature=1.3, seed=11)
    alone = client.chat.completions.create(**ask).choices[0].message.content
    variants = [client.chat.completions.create(**ask).choices[0].message.content,
                "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                        if c.choices),
                client.chat.completions.create(**ask, logprobs=True, top_logprobs=5).choices[0].message.content,
                client.chat.completions.create(**ask, user="seeded-7").choices[0].message.content,
                client.chat.completions.create(**ask, n=2).choices[0].message.content]
    assert variants == [alone] * len(variants)

    def other(i: int) -> str:
        return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": f"About {i}."}],
                                              max_tokens=30, temperature=1.0, seed=i).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        beside = [pool.submit(other, i) for i in range(4)]
        mine = pool.submit(lambda: client.chat.completions.create(**ask).choices[0].message.content)
        assert mine.result(60) == alone
        [f.result(60) for f in beside]
    assert client.chat.completions.create(**{**ask, "seed": 12}).choices[0].message.content != alone


def test_logprobs_with_top_logprobs_0_and_20_are_log_probabilities(client):
    """top_logprobs 0: each token's entry with an empty list; 20: twenty alternatives, most likely
    first, whose probabilities sum to at most 1, the sampled token's value the same in its entry
    and among the alternatives (greedy: it is the first). Sampled, every entry is a log-probability
    of the raw distribution and the tokens spell the content."""
    ask = dict(model="demo", messages=HELLO, max_tokens=6, logprobs=True)
    zero = client.chat.completions.create(**ask, top_logprobs=0).choices[0].logprobs.content
    assert zero and all(entry.top_logprobs == [] and entry.logprob <= 0 for entry in zero)
    for temperature in (0.0, 1.5):
        reply = client.chat.completions.create(**ask, top_logprobs=20, temperature=temperature, seed=5).choices[0]
        content = reply.logprobs.content
        assert b"".join(bytes(e.bytes) for e in content).decode() == reply.message.content
        for entry in content:
            values = [top.logprob for top in entry.top_logprobs]
            assert len(values) == 20 and values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-4 and entry.logprob <= 0
            tops = {top.token: top.logprob for top in entry.top_logprobs}
            if entry.token in tops:
                assert tops[entry.token] == pytest.approx(entry.logprob, abs=1e-5)
            if temperature == 0.0:
                assert entry.top_logprobs[0].token == entry.token


def test_n_choices_carry_their_own_logprobs_and_the_usage_sums_them(client):
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Tell me something."}],
                                           max_tokens=8, temperature=1.5, seed=3, n=3, logprobs=True, top_logprobs=1)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    tokens = 0
    for choice in reply.choices:
        spelt = b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode("utf-8", "replace")
        assert spelt.startswith(choice.message.content.rstrip("\ufffd"))
        tokens += len(choice.logprobs.content) + (choice.finish_reason == "stop")
    assert reply.usage.completion_tokens == tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_logit_bias_plus_100_forces_a_token_on_both_endpoints(client, engine):
    """logit_bias ids as strings: +100 makes that token the reply's every token (greedy), as
    OpenAI's "exclusive selection"; on /v1/completions too."""
    token = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    piece = engine.tokenizer.decode([token])
    chat = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=4, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == piece * 4 and chat.choices[0].finish_reason == "length"
    text = client.completions.create(model="demo", prompt="Hello", max_tokens=4, logit_bias={str(token): 100})
    assert text.choices[0].text == piece * 4


def test_stop_strings_whole_and_streamed_spanning_tokens_and_released_when_unmatched(client, url):
    """A string, or a list of up to four; a stop spanning token boundaries cuts before it,
    whole and streamed alike; a stop matched only in part at the reply's end (EOS or max_tokens)
    gives the held-back text back; a stop at the very start answers an empty content."""
    base = dict(model="demo", messages=HELLO, max_tokens=30)
    full = client.chat.completions.create(**base).choices[0].message.content
    assert full.endswith("today?")  # the demo's greeting: "Hello! How can I help you today?"
    for stop, want, finish in (("How", full[:full.index("How")], "stop"),
                               (["x", "y", "z", "w can I"], full[:full.index("w can I")], "stop"),
                               (["today? Bye"], full, "stop"),
                               (["Hel"], "", "stop")):
        whole = client.chat.completions.create(**base, stop=stop).choices[0]
        chunks = events(url, "/v1/chat/completions", {**base, "stop": stop, "stream": True})
        assert (whole.message.content, whole.finish_reason) == (want, finish), stop
        assert streamed_text(chunks) == want, stop
    cut = client.chat.completions.create(**{**base, "max_tokens": 6}).choices[0].message.content
    held = client.chat.completions.create(**{**base, "max_tokens": 6}, stop=[cut[-4:] + "XYZ"]).choices[0]
    assert (held.message.content, held.finish_reason) == (cut, "length")


def test_max_completion_tokens_wins_over_max_tokens_when_both_are_given(client):
    ask = dict(model="demo", messages=HELLO)
    assert client.chat.completions.create(**ask, max_tokens=50, max_completion_tokens=2).usage.completion_tokens == 2
    assert client.chat.completions.create(**ask, max_tokens=2, max_completion_tokens=50).choices[0] \
        .finish_reason == "stop"
    # the deprecated field past the server's limit is not read where the newer one is given
    assert client.chat.completions.create(**ask, max_tokens=5000, max_completion_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, max_tokens=2, max_completion_tokens=5000)
    assert caught.value.body["param"] == "max_completion_tokens"


# --- streaming shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": HELLO}),
                                        ("/v1/completions", {"prompt": ["Hello", "Once"]})])
def test_include_usage_ends_with_a_usage_chunk_of_no_choices(url, path, body):
    """With include_usage every chunk has `usage: null` but the last, which has no choices and the
    usage of every choice; without it no chunk has the field."""
    ask = {"model": "demo", **body, "max_tokens": 5, "stream": True, "n": 2, "temperature": 1.0, "seed": 1}
    chunks = events(url, path, {**ask, "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    last, before = chunks[-2], chunks[:-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5 * 2 * (2 if "prompt" in body else 1)
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    assert before and all(c["usage"] is None and c["choices"] for c in before)
    plain = events(url, path, {**ask, "stream_options": {"include_usage": False}})
    assert all("usage" not in c for c in plain[:-1]) and plain[-1] == "[DONE]"


def test_a_strict_json_schema_streams_to_json_that_holds_to_it(client, url):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
              "required": ["city", "n"], "additionalProperties": False}
    ask = {"model": "demo", "messages": [{"role": "user", "content": "A city as JSON"}], "max_tokens": 60,
           "response_format": {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": schema}}}
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = events(url, "/v1/chat/completions", {**ask, "stream": True})
    assert streamed_text(chunks) == whole.message.content and whole.finish_reason == "stop"
    value = json.loads(whole.message.content)
    assert set(value) == {"city", "n"} and isinstance(value["n"], int) and len(value["city"]) <= 12
    json_object = {**ask, "response_format": {"type": "json_object"}}
    whole = client.chat.completions.create(**json_object).choices[0].message.content
    streamed = streamed_text(events(url, "/v1/chat/completions", {**json_object, "stream": True}))
    assert whole.startswith("{") and streamed == whole


@pytest.mark.parametrize("choice", ["none", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forms_streamed_as_they_answer_whole(client, url, choice):
    ask = {"model": "demo", "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
           "tools": [WEATHER], "tool_choice": choice, "max_tokens": 60}
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = [c for c in events(url, "/v1/chat/completions", {**ask, "stream": True}) if c != "[DONE]"]
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls") or ()]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finish == [whole.finish_reason]
    if choice == "none":
        assert not calls and whole.message.tool_calls is None and streamed_text(chunks) == whole.message.content
        return
    assert calls[0]["id"] and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(call["function"]["arguments"] for call in calls)) == \
        json.loads(whole.message.tool_calls[0].function.arguments)
    assert whole.finish_reason == "tool_calls" and whole.message.content is None


def test_fields_that_change_nothing_are_taken_and_unknown_ones_are_400s(client):
    ask = dict(model="demo", messages=HELLO, max_tokens=2)
    reply = client.chat.completions.create(**ask, user="parity-user", metadata={"run": "7"}, store=False,
                                           service_tier="auto", prompt_cache_key="k", safety_identifier="s")
    assert reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, extra_body={"min_tokens": 3})  # vLLM's, not served
    assert caught.value.body["param"] == "min_tokens" and caught.value.body["message"].startswith("Unrecognized")


# --- legacy completions -------------------------------------------------------------------------

def test_completions_prompt_forms_and_what_is_refused_names_its_field(client, engine):
    ids = engine.tokenizer.encode("Hello", add_special_tokens=False)
    as_text = client.completions.create(model="demo", prompt="Hello", max_tokens=4).choices[0].text
    assert client.completions.create(model="demo", prompt=ids, max_tokens=4).choices[0].text == as_text
    several = client.completions.create(model="demo", prompt=[ids, ids], max_tokens=4)
    assert [c.text for c in several.choices] == [as_text, as_text] and several.usage.prompt_tokens == 2 * len(ids)
    strings = client.completions.create(model="demo", prompt=["Hello", "Hello"], max_tokens=4)
    assert [c.text for c in strings.choices] == [as_text, as_text] and [c.index for c in strings.choices] == [0, 1]
    assert client.completions.create(model="demo", prompt="Hello", max_tokens=4, echo=False, best_of=1).choices
    for fields, param in (({"echo": True}, "echo"), ({"suffix": "!"}, "suffix"), ({"best_of": 2}, "best_of"),
                          ({"prompt": []}, "prompt"), ({"prompt": [""]}, "prompt"), ({"logprobs": 6}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**{"model": "demo", "prompt": "Hello", "max_tokens": 4, **fields})
        assert caught.value.body["param"] == param, fields


# --- errors as the openai client raises them ------------------------------------------------------

def test_errors_are_the_clients_typed_errors_in_openais_shape(client, url, engine):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert caught.value.body == {"message": caught.value.body["message"], "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="demo", input="x")
    assert set(caught.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as caught:  # streamed: refused before the stream
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "word " * 3000}],
                                       stream=True)
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt=[5] * engine.max_model_len, max_tokens=1)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "prompt"
    assert client.completions.create(model="demo", prompt=[5] * (engine.max_model_len - 1), max_tokens=5) \
        .choices[0].finish_reason == "length"  # the one token of room left, then "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=HELLO, temperature=2.5, stream=True)
    assert caught.value.body["param"] == "temperature"
    assert httpx.get(url + "/health").json() == {"status": "ok"} and httpx.head(url + "/health").status_code == 200
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "hibana_requests_total" in metrics.text


# --- clients that leave ----------------------------------------------------------------------------

def test_clients_gone_from_a_responses_stream_or_several_prompts_let_every_state_go(engine):
    """A Responses stream left early, and a legacy request of several prompts times n whose client
    timed out before its whole reply, cancel every turn they ran: no state stays busy, no request
    keeps running, and far fewer tokens are generated than asked for."""
    long_list = {"type": "array", "items": {"type": "integer"}, "minItems": 900}
    with serving(engine, ServerConfig("demo", max_tokens_limit=1500)) as url:
        before = engine.stats().generated_tokens
        body = {"model": "demo", "input": "Count.", "max_output_tokens": 1500, "stream": True,
                "text": {"format": {"type": "json_schema", "name": "numbers", "schema": long_list}}}
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i > 12:
                    break
        wait_until_idle(engine, "a Responses stream")
        assert engine.stats().generated_tokens - before < 1500
        impatient = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.5)
        before = engine.stats().generated_tokens
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="demo", prompt=["Count: 1, 2,", "Numbers:"], n=2, max_tokens=1500,
                                         extra_body={"ignore_eos": True})
        wait_until_idle(engine, "several prompts times n")
        assert engine.stats().generated_tokens - before < 4 * 1500
