"""/v1/completions text and token-id turns continue the state of the turn before them whatever
ended its reply: its EOS and a stop string's tokens, which the client never got, are not what
the next prompt must spell (`Chat.continues` with `StateRegistry.held`'s turn start)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

STORY = "Once upon a time there was a little fox who lived near the river bank"


def _computed(reply) -> int:
    return reply.usage.prompt_tokens - reply.usage.prompt_tokens_details.cached_tokens


def _turn(client, prompt, **kw):
    """(the state that served the call, the reply)"""
    raw = client.completions.with_raw_response.create(model="demo", prompt=prompt, temperature=0, **kw)
    return raw.headers["X-Hibana-State"], raw.parse()


def test_a_reply_ended_by_its_eos_is_continued(client, engine):
    """The demo model ends this reply with its EOS (finish_reason "stop"): the next turn, the
    prompt, the reply's text and more words, is served by the same state and computes only its
    new words."""
    state, first = _turn(client, STORY, max_tokens=5)
    assert first.choices[0].finish_reason == "stop"
    more = " and then"
    again, second = _turn(client, STORY + first.choices[0].text + more, max_tokens=1)
    assert again == state
    assert _computed(second) <= len(engine.tokenizer.encode(more, add_special_tokens=False)) + 1


def test_a_reply_cut_by_a_stop_string_is_continued(client, engine):
    """The engine runs a few tokens past a stop string, and the client gets the text before it."""
    prompt = "The list: one, two, three, four, five, six, seven"
    _, whole = _turn(client, prompt, max_tokens=16)
    text = whole.choices[0].text
    at = next(i for i in range(len(text) // 2, len(text) - 3) if text.find(text[i:i + 3]) == i)
    state, first = _turn(client, prompt, max_tokens=16, stop=[text[at:at + 3]])
    assert first.choices[0].finish_reason == "stop" and first.choices[0].text == text[:at]
    more = " and more"
    again, second = _turn(client, prompt + text[:at] + more, max_tokens=1)
    assert again == state
    assert _computed(second) <= len(engine.tokenizer.encode(more, add_special_tokens=False)) + 2  # (a seam's merge)


def test_the_same_prompt_again_reuses_all_but_its_last_token(client):
    prompt = "A quiet prompt that is asked twice over by a client with no state name"
    state, _ = _turn(client, prompt, max_tokens=4)
    same, again = _turn(client, prompt, max_tokens=4)
    assert same == state and _computed(again) == 1


def test_token_id_prompts_continue_past_the_eos(client, engine):
    ids = engine.tokenizer.encode(STORY, add_special_tokens=False)
    first = client.completions.create(model="demo", prompt=ids, max_tokens=5, temperature=0, logprobs=0)
    assert first.choices[0].finish_reason == "stop"
    reply = engine.tokenizer.encode(first.choices[0].text, add_special_tokens=False)
    more = engine.tokenizer.encode(" and then", add_special_tokens=False)
    second = client.completions.create(model="demo", prompt=ids + reply + more, max_tokens=1, temperature=0)
    assert _computed(second) <= len(reply) + len(more)


def test_another_text_sharing_a_prefix_does_not_take_the_state_over(client, engine):
    """Two completions that share their first words are two conversations: the second gets a new
    state (sharing whole KV blocks), and the first's next turn still finds its own."""
    head = "Shared words at the start of two prompts, long enough to fill a block or two of the cache:"
    first = client.completions.create(model="demo", prompt=head + " apples", max_tokens=3, temperature=0)
    other = client.completions.create(model="demo", prompt=head + " pears and plums", max_tokens=3, temperature=0)
    assert _computed(other) >= 3
    then = head + " apples" + first.choices[0].text + " more"
    back = client.completions.create(model="demo", prompt=then, max_tokens=1, temperature=0)
    assert _computed(back) <= 4
