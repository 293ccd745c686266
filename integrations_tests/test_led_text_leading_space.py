"""A BOS tokenizer's /v1/completions text prompt (`LedText`) that begins with whitespace: its next
turn continues its state, though the SentencePiece decoder drops the whitespace its dummy prefix
took (`Chat._spells`), and a text whose head tokenizes otherwise does not."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from test_audit_server_tokenize_families import GREEDY, servers  # noqa: F401,E402 - the module fixture

from hibana_core.chat import Chat, LedText  # noqa: E402
from hibana_core.prompt import leading_specials  # noqa: E402
from hibana_plugins.openai_api import STATE_HEADER  # noqa: E402


def _completion(client, prompt: str, state: str | None = None):
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=6, extra_body=GREEDY,
                                                      extra_headers={STATE_HEADER: state} if state else None)
    return raw.headers[STATE_HEADER], raw.parse()


@pytest.mark.parametrize("text", [" the cat sat on the mat and then", "  two spaces and then"])
def test_a_sentencepiece_led_text_that_begins_with_a_space_continues_its_state(servers, text):
    """A SentencePiece tokenizer folds a text's leading space into its dummy prefix ("▁the"), and
    its decoder strips that space again: `Chat.continues` decodes the state's tokens past the BOS
    as "the cat sat..." (" two spaces" for "  two spaces"), which the next turn's text, the same
    " the cat sat..." + reply + more, does not start with. The state is never continued (a new
    state each turn), which is what the commit sets out to fix for multi-turn completions.
    As for "the cat sat..." (test_a_multi_turn_text_conversation_reuses_the_resident_state), the
    second turn is served by the first turn's state."""
    engine, url, bos = servers("sentencepiece")
    chat, lead = Chat(engine), leading_specials(engine.tokenizer)
    held = chat.prompt_tokens(LedText(text, lead))
    assert chat.continues(held, LedText(text + " and more", lead)), \
        repr(engine.tokenizer.decode(held[len(lead):], skip_special_tokens=False))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    served, reply = _completion(client, text)
    state, _ = _completion(client, text + reply.choices[0].text + " and the")
    assert state == served


@pytest.mark.parametrize("held, asked, continued", [
    ("  two spaces", " two spaces and more", False),  # " two" begins "▁t", "  two" "▁", "▁t": both decode " two"
    (" two spaces", "  two spaces and more", False),
    ("\nthe cat", "\nthe cat and more", True),  # "▁", "\n", ...: the dummy prefix before a newline
    ("the cat", " the cat and more", True),  # " the" and "the" both tokenize "▁the"
    (" the cat", "the cat and more", True),
    ("the cat", "  the cat and more", False),
    ("   x y", "    x y and more", False),  # "▁" runs: lone-space tokens up to the word's
    ("    x y", "   x y and more", False),
])
def test_leading_whitespace_continues_only_where_the_tokens_are_the_texts(servers, held, asked, continued):
    """A state's text is continued by a prompt whose leading whitespace its decoder may have dropped
    only where the prompt's head tokenizes to the state's head (the same tokens a fresh state gets)."""
    engine, _, _ = servers("sentencepiece")
    chat, lead = Chat(engine), leading_specials(engine.tokenizer)
    tokens = chat.prompt_tokens(LedText(held, lead))
    fresh = chat.prompt_tokens(LedText(asked, lead))
    assert (fresh[:len(tokens) - 1] == tokens[:-1]) == continued  # what the tokenizer says (the seam aside)
    assert chat.continues(tokens, LedText(asked, lead)) == continued


@pytest.mark.parametrize("held, asked", [("   x y", "    x y and more"), ("x y", " x y and more")])
def test_a_byte_level_tokenizers_leading_whitespace_is_its_own(servers, held, asked):
    """Llama 3's byte-level decoder drops no whitespace: a prompt with other leading whitespace than
    the state's text (a run of lone-space tokens one longer) does not continue it."""
    engine, _, _ = servers("llama3")
    chat, lead = Chat(engine), leading_specials(engine.tokenizer)
    tokens = chat.prompt_tokens(LedText(held, lead))
    assert not chat.continues(tokens, LedText(asked, lead))


def test_a_completions_prompt_is_given_the_tokens_of_its_own_whitespace(servers):
    """Past an end-of-turn token the prompt holds too, `prompt_ids` keeps the state's tokens only
    where they spell the prompt's own leading whitespace: the model reads the prompt's text, and
    usage.prompt_tokens is /tokenize's count."""
    from test_audit_server_tokenize_families import call

    engine, url, _ = servers("llama3")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="tiny", prompt="   x y<|eot_id|>", max_tokens=3, extra_body={"ignore_eos": True})
    second = "    x y<|eot_id|> more"
    got = client.completions.create(model="tiny", prompt=second, max_tokens=3, extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == call(url, "/tokenize", {"prompt": second})[1]["count"]
