"""`hibana serve`'s vLLM-style /tokenize and /detokenize, and the BOS a completions prompt given as
text takes where the model's tokenizer adds one (as vLLM's and llama.cpp's completions give it):
counted tokens equal what the endpoints feed the model (their usage), on the demo model and on a
tiny llama whose tokenizer writes a BOS."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_core import Engine  # noqa: E402
from hibana_core.prompt import leading_specials  # noqa: E402
from hibana_plugins.server import ServerConfig, serving  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import make_tiny_checkpoint, make_tokenizer  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def call(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def demo():
    with Engine.from_pretrained("demo") as engine, serving(engine, ServerConfig("demo")) as url:
        yield engine, url


def test_tokenize_counts_what_the_completions_and_chat_endpoints_feed_the_model(demo):
    engine, url = demo
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    prompt = "Once upon a time <|im_start|>"  # a completions prompt's control text is control tokens
    status, counted = call(url, "/tokenize", {"model": "demo", "prompt": prompt, "return_token_strs": True})
    assert status == 200 and counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == engine.max_model_len
    assert counted["tokens"] == engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert counted["token_strs"] == engine.tokenizer.convert_ids_to_tokens(counted["tokens"])
    completion = client.completions.create(model="demo", prompt=prompt, max_tokens=2)
    assert completion.usage.prompt_tokens == counted["count"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo? <|im_end|>"}]
    status, chat_counted = call(url, "/tokenize", {"messages": messages, "tools": [WEATHER]})  # model: optional
    assert status == 200 and chat_counted["token_strs"] is None
    reply = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=2)
    assert reply.usage.prompt_tokens == chat_counted["count"]
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in chat_counted["tokens"]  # the template's own
    user_text = engine.tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(user_text) == 1  # (the control token itself: the user's text must not become it)
    ends = chat_counted["tokens"].count(user_text[0])
    plain = [dict(m, content=m["content"].replace(" <|im_end|>", "")) for m in messages]
    assert ends == call(url, "/tokenize", {"messages": plain, "tools": [WEATHER]})[1]["tokens"].count(user_text[0])

    status, text = call(url, "/detokenize", {"model": "demo", "tokens": counted["tokens"]})
    assert status == 200 and text == {"prompt": prompt}


@pytest.mark.parametrize("body, status, param, says", [
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "messages", "either prompt"),
    ({}, 400, "prompt", "either prompt"),
    ({"prompt": "a", "tools": [WEATHER]}, 400, "tools", "goes with messages"),
    ({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True}, 400, "add_special_tokens",
     "chat template"),
    ({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}, 400,
     "add_generation_prompt", ""),
    ({"messages": []}, 400, "messages", ""),
    ({"prompt": "a", "model": "other"}, 404, "model", "does not exist"),
    ({"prompt": "a", "max_tokens": 3}, 400, "max_tokens", "Unrecognized"),
])
def test_tokenize_refuses_what_it_cannot_count(demo, body, status, param, says):
    got, reply = call(demo[1], "/tokenize", body)
    assert got == status and reply["error"]["param"] == param and says in reply["error"]["message"]


def test_a_whole_chat_body_counts_as_its_messages_and_tools(demo):
    """A client posts the chat request it is about to send: its sampling and output fields do not
    change the prompt and are left out, as vLLM's /tokenize leaves them; a field no chat request
    has (a misspelt one) is still refused."""
    engine, url = demo
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare = call(url, "/tokenize", {"messages": messages, "tools": [WEATHER]})
    whole = {"model": "demo", "messages": messages, "tools": [WEATHER], "tool_choice": "required", "temperature": 0.3,
             "max_tokens": 5, "stream": True, "response_format": {"type": "json_object"}, "parallel_tool_calls": False}
    assert call(url, "/tokenize", whole) == bare and bare[0] == 200
    got, reply = call(url, "/tokenize", dict(whole, temprature=0.3))
    assert got == 400 and reply["error"]["param"] == "temprature"


def test_detokenize_refuses_ids_outside_the_vocabulary(demo):
    engine, url = demo
    for tokens in ([engine.vocab_size], [-1], [1, "a"]):
        got, reply = call(url, "/detokenize", {"tokens": tokens})
        assert got == 400 and reply["error"]["param"].startswith("tokens")
    assert call(url, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A tiny llama whose tokenizer writes <s> before any text, as Llama's, Gemma's and Mistral's do."""
    from tokenizers import processors

    path = tmp_path_factory.mktemp("bos") / "llama"
    make_tiny_checkpoint("llama", path, vocab_size=513)
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save_pretrained(path)
    with Engine.from_pretrained(str(path), device="cpu") as engine, serving(engine, ServerConfig("tiny")) as url:
        assert leading_specials(engine.tokenizer) == (bos,)
        yield engine, url, bos


def test_a_text_completion_prompt_takes_the_tokenizers_bos_once(bos_model):
    engine, url, bos = bos_model
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    text = "Once upon a time"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    as_text = client.completions.create(model="tiny", prompt=text, max_tokens=8, extra_body={"ignore_eos": True})
    with_bos = client.completions.create(model="tiny", prompt=[bos] + ids, max_tokens=8, extra_body={"ignore_eos": True})
    without = client.completions.create(model="tiny", prompt=ids, max_tokens=8, extra_body={"ignore_eos": True})
    assert as_text.usage.prompt_tokens == len(ids) + 1 and as_text.choices[0].text == with_bos.choices[0].text
    assert without.usage.prompt_tokens == len(ids)  # token ids are the prompt as given
    written = client.completions.create(model="tiny", prompt="<s>" + text, max_tokens=8, extra_body={"ignore_eos": True})
    assert written.usage.prompt_tokens == len(ids) + 1  # not a second BOS
    assert written.choices[0].text == as_text.choices[0].text

    assert call(url, "/tokenize", {"prompt": text})[1]["tokens"] == [bos] + ids
    assert call(url, "/tokenize", {"prompt": text, "add_special_tokens": True})[1]["tokens"] == [bos] + ids
    assert call(url, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"] == ids
    assert call(url, "/tokenize", {"prompt": "<s>" + text})[1]["tokens"] == [bos] + ids


def test_a_sentencepiece_prompts_first_word_keeps_its_mark_after_the_bos(tmp_path):
    """Llama 2's, Mistral's and Phi-3's tokenizers (Metaspace, prepend "first") put "▁" before the
    text's first word only where the text starts the input: the BOS goes in as a token, not as text
    in front of it, so a completions prompt is tokenized as the tokenizer's own encode (vLLM's)."""
    from tokenizers import processors

    from test_audit_text_io import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                        special_tokens=[("<s>", bos)])
    path = make_tiny_checkpoint("llama", tmp_path / "sp", vocab_size=len(tokenizer))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(path)
    with Engine.from_pretrained(str(path), device="cpu") as engine, serving(engine, ServerConfig("sp")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert engine.tokenizer.convert_ids_to_tokens(engine.tokenizer.encode("the cat"))[:2] == ["<s>", "▁the"]
        for text in ("the cat", "\nthe", "<s>the cat"):
            expected = engine.tokenizer.encode(text, add_special_tokens="<s>" not in text)
            assert call(url, "/tokenize", {"prompt": text})[1]["tokens"] == expected, text
            assert expected[0] == bos
            reply = client.completions.create(model="sp", prompt=text, max_tokens=4, extra_body={"ignore_eos": True})
            by_ids = client.completions.create(model="sp", prompt=expected, max_tokens=4,
                                               extra_body={"ignore_eos": True})
            assert reply.usage.prompt_tokens == len(expected) and reply.choices[0].text == by_ids.choices[0].text
