"""Context limits and odd text through the chat layer (an outside tester of limits)."""

from __future__ import annotations

import pytest

from hibana_core import ContextLengthError, Engine, SamplingParams
from hibana_core.chat import TokenIds


@pytest.fixture(scope="module")
def demo():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", max_model_len=128,
                                num_blocks=64) as engine:
        yield engine


@pytest.mark.parametrize("prompt", ["", TokenIds([])], ids=["empty string", "no token ids"])
def test_an_empty_chat_prompt_is_refused_in_chat_words_and_the_state_is_kept(demo, prompt):
    """respond("") on a state holding a conversation said "prompt=[] would make state ... an empty
    history ... leave prompt out to continue the state": generate's words, for an argument the
    chat caller never gave."""
    chat = demo.chat("empty-prompt")
    chat.respond([{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=3))
    held = demo.open_state("empty-prompt").tokens
    with pytest.raises(ContextLengthError, match="the chat prompt is empty") as error:
        chat.respond(prompt, params=SamplingParams(max_tokens=3))
    assert "prompt=[]" not in str(error.value)
    assert demo.open_state("empty-prompt").tokens == held
    with pytest.raises(ContextLengthError, match="the chat prompt is empty"):
        chat.respond(prompt, params=SamplingParams(max_tokens=3), lease=True)
    assert chat.respond([{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=3)).usage.completion_tokens
