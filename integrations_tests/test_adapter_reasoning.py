"""Both adapters on a tiny Qwen3-style reasoning checkpoint (tests/reasoning_model.py, its outputs
forced so that it thinks): the thinking apart from the answer in invoke and stream, `reasoning`
reaching the template, and reuse across two user turns under both history policies."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage, ThinkingBlock

import tiny_models
from hibana_core.errors import ConfigError
from hibana_core.speculation import force_outputs
from hibana_plugins.langchain import ChatHibana
from hibana_plugins.llamaindex import HibanaLLM
from reasoning_model import make_reasoning_checkpoint

THOUGHT = "The user says hi. I should greet them."
ANSWER = "Hello there, friend."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    yield engine
    engine.close()


def force(engine, state_id: str, text: str = OUTPUT) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    force_outputs(engine.open_state(state_id), ids)
    return len(ids)


def test_chat_hibana_separates_thinking_in_invoke_and_stream(engine):
    llm = ChatHibana(engine=engine, state_id="lc-invoke", max_tokens=force(engine, "lc-invoke"))
    message = llm.invoke([HumanMessage("hi")])
    assert (message.content, message.additional_kwargs["reasoning_content"]) == (ANSWER, THOUGHT)
    assert message.content_blocks == [{"type": "reasoning", "reasoning": THOUGHT}, {"type": "text", "text": ANSWER}]
    thought = len(engine.tokenizer.encode(f"<think>\n{THOUGHT}\n</think>", add_special_tokens=False))
    assert message.usage_metadata["output_token_details"] == {"reasoning": thought}  # as ChatOpenAI reports it
    llm = ChatHibana(engine=engine, state_id="lc-stream", max_tokens=force(engine, "lc-stream"))
    chunks = list(llm.stream([HumanMessage("hi")]))
    thinking = [i for i, c in enumerate(chunks) if "reasoning_content" in c.additional_kwargs]
    answering = [i for i, c in enumerate(chunks) if c.content]
    assert thinking and answering and max(thinking) < min(answering)  # streamed, ahead of the answer
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.content == ANSWER and merged.additional_kwargs["reasoning_content"] == THOUGHT


def test_chat_hibana_reasoning_option(engine):
    off = ChatHibana(engine=engine, reasoning=False)
    on = ChatHibana(engine=engine)
    msgs = [HumanMessage("hi")]
    think_off = len(engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.get_num_tokens_from_messages(msgs) == on.get_num_tokens_from_messages(msgs) + think_off
    with pytest.raises(ConfigError):
        ChatHibana(engine=engine, reasoning_history="sometimes")
    with pytest.raises(ConfigError, match="reasoning must be"):
        on.invoke(msgs, reasoning="high")


@pytest.mark.parametrize("policy", ["template", "generated"])
def test_chat_hibana_reuse_across_user_turns(engine, policy):
    state = f"lc-{policy}"
    llm = ChatHibana(engine=engine, state_id=state, reasoning_history=policy, max_tokens=force(engine, state))
    history = [HumanMessage("hi")]
    first = llm.invoke(history)
    held = len(engine.open_state(state))
    second = llm.invoke(history + [first, HumanMessage("and how are you?")], max_tokens=2)
    reused = second.usage_metadata["input_token_details"]["cache_read"]
    print(f"ChatHibana, {policy}: turn 2 reused {reused} of the {held} tokens the state held")
    if policy == "generated":
        assert reused == held - 1          # all but the last generated token, whose KV the next call computes
    else:
        assert reused < held - len(engine.tokenizer.encode(THOUGHT, add_special_tokens=False))


def test_hibana_llm_thinking_blocks(engine):
    llm = HibanaLLM(engine=engine, state_id="li-chat", max_tokens=force(engine, "li-chat"))
    response = llm.chat([ChatMessage(role="user", content="hi")])
    blocks = response.message.blocks
    assert isinstance(blocks[0], ThinkingBlock) and blocks[0].content == THOUGHT
    thought = len(engine.tokenizer.encode(f"<think>\n{THOUGHT}\n</think>", add_special_tokens=False))
    assert response.raw["usage"]["reasoning_tokens"] == thought
    assert response.message.content == ANSWER
    llm = HibanaLLM(engine=engine, state_id="li-stream", max_tokens=force(engine, "li-stream"))
    responses = list(llm.stream_chat([ChatMessage(role="user", content="hi")]))
    growing = [r.message.blocks[0].content for r in responses if isinstance(r.message.blocks[0], ThinkingBlock)]
    # the thinking streams, ahead of the answer (in how many pieces is how far the engine ran
    # ahead of the reader: a loaded machine may hand it over in one)
    assert growing and all(THOUGHT.startswith(g) for g in growing) and THOUGHT in growing
    first_whole = next(r for r in responses if isinstance(r.message.blocks[0], ThinkingBlock)
                       and r.message.blocks[0].content == THOUGHT)
    assert not first_whole.message.content
    assert "".join(r.delta for r in responses) == ANSWER
    assert responses[-1].message.content == ANSWER and responses[-1].message.blocks[0].content == THOUGHT


def test_hibana_llm_reasoning_option(engine):
    think_off = len(engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    msgs = [ChatMessage(role="user", content="hey")]
    llm = HibanaLLM(engine=engine, max_tokens=1)
    default = llm.chat(msgs).raw["usage"]["prompt_tokens"]
    assert llm.chat(msgs, reasoning=False).raw["usage"]["prompt_tokens"] == default + think_off
    assert HibanaLLM(engine=engine, max_tokens=1, reasoning=False).complete("hey").raw["usage"]["prompt_tokens"] \
        == default + think_off
    with pytest.raises(ConfigError):
        HibanaLLM(engine=engine, reasoning_history="sometimes")


@pytest.mark.parametrize("policy", ["template", "generated"])
def test_hibana_llm_reuse_across_user_turns(engine, policy):
    state = f"li-{policy}"
    llm = HibanaLLM(engine=engine, state_id=state, reasoning_history=policy, max_tokens=force(engine, state))
    history = [ChatMessage(role="user", content="hello")]   # not the LangChain tests' prompt (shared blocks)
    first = llm.chat(history)
    held = len(engine.open_state(state))
    second = llm.chat(history + [first.message, ChatMessage(role="user", content="and how are you?")], max_tokens=2)
    reused = second.raw["usage"]["cached_tokens"]
    print(f"HibanaLLM, {policy}: turn 2 reused {reused} of the {held} tokens the state held")
    assert (reused == held - 1) == (policy == "generated")
