"""Mistral's reasoning models (Magistral, Ministral 3 Reasoning) think between the `[THINK]` and
`[/THINK]` control tokens: their turns split into reasoning and answer as Qwen3's `<think>` ones do,
and a grammar (tool_choice "required", a JSON schema) waits for the thinking, naming the markers
as the tokens they are."""

from __future__ import annotations

import json

import pytest

from hibana_core import SamplingParams, turn
from hibana_core.chat import Chat
from hibana_core.speculation import force_outputs
from magistral_model import SPECIAL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
                   "required": ["city"]}}}
HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]


def spelled(tokenizer, pieces: list[str]) -> list[int]:
    """The pieces' tokens: a marker's control token where a piece is one, ordinary tokens else."""
    return [t for piece in pieces
            for t in tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=piece not in SPECIAL)]


def test_the_markers_follow_the_template():
    assert turn.think_markers("...'[THINK]' + x + '[/THINK]'...", {"[THINK]": 1, "[/THINK]": 2}) == turn.MISTRAL_THINK
    assert turn.think_markers("...'[THINK]' + x + '[/THINK]'...", {"[THINK]": 1}) == turn.QWEN_THINK
    assert turn.think_markers("{{ '<think>' }}...</think>", {}) == turn.QWEN_THINK


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_reasoning_and_a_call_after_it_is_read(magistral, stream):
    from test_chat import streamed_turn

    chat = Chat(magistral, f"think-{stream}")
    assert chat.thinks and chat.think_markers == turn.MISTRAL_THINK
    eos = sorted(magistral.eos_token_ids)
    for n, (pieces, reasoning, text, calls) in enumerate([
        (["[THINK]", "The user greets me.", "[/THINK]", "Hello! How can I help?"],
         "The user greets me.", "Hello! How can I help?", []),
        (["[THINK]", "I need the weather tool.", "[/THINK]", "[TOOL_CALLS]", "get_weather", "[ARGS]",
          '{"city": "Paris"}'], "I need the weather tool.", "", [("get_weather", {"city": "Paris"})]),
        # "[THINK]" spelled by ordinary tokens, after text: answer text
        (["No thinking, and a [THINK] later is text."], "", "No thinking, and a [THINK] later is text.", []),
    ]):
        chat = Chat(magistral, f"think-{stream}-{n}")
        ids = spelled(magistral.tokenizer, pieces) + eos
        force_outputs(chat.handle, ids)
        params = SamplingParams(max_tokens=len(ids))
        if stream:
            deltas = list(chat.stream_respond(HELLO, [WEATHER], params))
            streamed_text, streamed_calls, result = streamed_turn(deltas)
            assert "".join(d.reasoning for d in deltas) == reasoning
            assert (streamed_text, [(name, a) for _, name, a in streamed_calls]) == (text, calls)
        else:
            result = chat.respond(HELLO, [WEATHER], params)
        assert (result.reasoning, result.text, [(c.name, c.arguments) for c in result.tool_calls]) == \
            (reasoning, text, calls)


@pytest.mark.parametrize("seed", range(3))
def test_a_held_call_waits_for_the_thinking(magistral, seed):
    """tool_choice="required" on a random model: the grammar lets it think first (between the
    control tokens, which it names as tokens: as text the grammar refused them) and then holds it
    to a call; the call is read, and any thinking is reasoning, not the call's text."""
    close = magistral.tokenizer.convert_tokens_to_ids("[/THINK]")  # (a random model thinks on and on)
    result = Chat(magistral, f"held-{seed}").respond(
        HELLO, [WEATHER], SamplingParams(max_tokens=300, temperature=1.0, seed=seed, logit_bias={close: 6.0}),
        tool_choice="required")
    assert result.tool_calls, (result.text, result.reasoning)
    for c in result.tool_calls:
        assert c.name == "get_weather" and c.arguments["city"] in ("Paris", "Lima")
    assert "[THINK]" not in result.reasoning and "[/THINK]" not in result.text


def test_a_json_answer_waits_for_the_thinking(magistral):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for seed in range(2):
        close = magistral.tokenizer.convert_tokens_to_ids("[/THINK]")
        result = Chat(magistral, f"json-{seed}").respond(HELLO, None, SamplingParams(
            max_tokens=300, temperature=1.0, seed=seed, json_schema=schema, logit_bias={close: 6.0}))
        assert result.finish_reason == "stop", (result.reasoning, result.text)
        assert isinstance(json.loads(result.text)["ok"], bool)


def test_thinking_off_is_refused_where_the_template_has_no_switch_for_it(magistral):
    """Magistral's template reads no enable_thinking: its default system prompt asks for the thinking
    ([THINK]...), so reasoning=False rendered the prompt as ever and the model thought all the same,
    silently. It is a ConfigError saying so and what to do (reasoning_effort "none", as the server's
    enable_thinking false is read, too), on a call before it touches the state; unset, and True, render
    as they did."""
    from hibana_core.errors import ConfigError

    chat = Chat(magistral, "think-off")
    default = chat.render_text(HELLO)
    assert "[SYSTEM_PROMPT]# HOW YOU SHOULD THINK" in default and chat.render_text(HELLO, reasoning=True) == default
    with pytest.raises(ConfigError, match=r"^reasoning=False: .*no switch for thinking.*default system prompt "
                                          r"asks for the thinking \(\[THINK\].*system message of your own.*"
                                          r"Leave reasoning unset"):
        chat.render_text(HELLO, reasoning=False)
    with pytest.raises(ConfigError, match=r"^reasoning_effort 'none': .*no switch for thinking"):
        chat.render_text(HELLO, effort="none")
    own_system = [{"role": "system", "content": "Answer briefly."}, *HELLO]
    with pytest.raises(ConfigError, match="no switch for thinking"):  # the template has none all the same
        chat.render_text(own_system, reasoning=False)
    with pytest.raises(ConfigError, match="no switch for thinking"):
        chat.respond(HELLO, None, SamplingParams(max_tokens=2), reasoning=False)
    assert chat.handle.tokens == []  # refused before the state was touched
