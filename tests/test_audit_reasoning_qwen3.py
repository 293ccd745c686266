"""Audit of the reasoning area on the tiny Qwen3-style checkpoint (tests/reasoning_model.py), its
outputs forced so that it thinks."""

from __future__ import annotations

import pytest

from hibana_core import SamplingParams
from hibana_core.chat import Chat
from hibana_core.errors import GrammarError
from hibana_core.speculation import force_outputs
from reasoning_model import make_reasoning_checkpoint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import tiny_models

    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("audit-reasoning") / "m"))
    yield engine
    engine.close()


def forced(engine, state_id: str, text: str) -> tuple[Chat, int]:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    chat = Chat(engine, state_id)
    force_outputs(chat.handle, ids)
    return chat, len(ids)


def test_tool_choice_none_leaves_the_thinking_free(engine):
    """tool_choice="none" keeps calls out of the answer; the thinking may still name the markup (as
    with "auto", whose grammar opens after the think block). The no-call grammar held the whole
    turn: a model thinking "<tool_call> is not allowed" was refused its thinking (a GrammarError
    for these forced tokens)."""
    thought = "A <tool_call> is not allowed here, nor a </tool_call>."
    chat, n = forced(engine, "none-thinks", f"<think>\n{thought}\n</think>\n\nIt is sunny.<|im_end|>")
    result = chat.respond(ASK, [WEATHER], SamplingParams(max_tokens=n), tool_choice="none")
    assert (result.reasoning, result.text, result.tool_calls) == (thought, "It is sunny.", [])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chat, n = forced(engine, "none-calls", f"<think>\nHm.\n</think>\n\n{call}<|im_end|>")
    with pytest.raises(GrammarError):  # after the think block, the answer still opens no call
        chat.respond(ASK, [WEATHER], SamplingParams(max_tokens=n), tool_choice="none")


def test_a_think_block_after_leading_whitespace_is_thinking_to_the_grammar_too(engine):
    """`Thinking` takes a think block after leading whitespace ("\\n<think>") as the thinking; the
    tool-call grammar took it for free text, so `<tool_call>` in that thinking opened a call the
    grammar held (these forced tokens were a GrammarError) and the parser never read."""
    thought = "Maybe <tool_call> is what I need."
    chat, n = forced(engine, "ws-think", f"\n<think>\n{thought}\n</think>\n\nIt is sunny.<|im_end|>")
    result = chat.respond(ASK, [WEATHER], SamplingParams(max_tokens=n))
    assert (result.reasoning, result.text, result.tool_calls) == (thought, "It is sunny.", [])


def test_a_user_turn_after_a_tool_loop_stays_on_its_conversations_state(engine):
    """Calls that name no state (the adapters' and the server's default): after a tool loop, the
    next user turn re-renders the loop's replies without their thinking (the template drops it),
    so under reasoning_history "template" the conversation's state was taken for another
    conversation's and the turn went to a new state, the old one left resident and unused after
    every tool loop. It stays on its state (recomputed from the first dropped think block, as
    with a named state)."""
    from hibana_core.chat import assistant_message

    chat = Chat(engine)

    def turn(messages: list[dict], text: str) -> tuple[object, str]:
        prompt = chat.render_text(messages, [WEATHER])
        with chat.lease(prompt) as leased:
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            force_outputs(leased.handle, ids)
            return leased.respond(prompt, [WEATHER], SamplingParams(max_tokens=len(ids))), leased.handle.id

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    messages = list(ASK)
    first, state = turn(messages, f"<think>\nNeed the weather.\n</think>\n\nLet me look.\n{call}<|im_end|>")
    messages += [assistant_message(first), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"}]
    second, again = turn(messages, "<think>\nIt is sunny.\n</think>\n\nSunny.<|im_end|>")
    assert again == state and second.text == "Sunny."
    messages += [assistant_message(second), {"role": "user", "content": "And tomorrow?"}]
    third, last = turn(messages, "<think>\nNo idea.\n</think>\n\nNo idea.<|im_end|>")
    assert last == state and third.text == "No idea."
    assert [s.id for s in engine.states() if s.id.startswith("auto-")] == [state]
