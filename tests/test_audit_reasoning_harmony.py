"""Audit of the reasoning area, harmony (gpt-oss): what a stream makes of a turn does not depend on
where the engine's tokens cut its text."""

from __future__ import annotations

import random

import pytest

from hibana_plugins.harmony import HarmonyToolParser
from test_hostile_chat import chunkings, streamed



@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """test_harmony's tiny gpt_oss, its tokenizer knowing harmony's tokens."""
    from test_harmony import make_harmony_checkpoint
    from tiny_models import open_engine

    with open_engine(make_harmony_checkpoint(tmp_path_factory.mktemp("audit-harmony") / "gpt_oss")) as engine:
        yield engine


PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|>"


@pytest.mark.parametrize("body", [" It is sunny.", "\tIt is sunny.", " \n It is sunny.", "  "])
def test_a_message_body_that_opens_with_whitespace_streams_as_parsed_whole(body):
    """A preamble, then a final message whose body opens with whitespace: the line between the two
    went after that whitespace when it came in a piece of its own (char by char "Checking. \\nIt is
    sunny." against "Checking.\\n It is sunny." whole), so a streamed reply's content depended on
    how the tokens cut it."""
    text = f"{PREAMBLE}<|start|>assistant<|channel|>final<|message|>{body}<|return|>"
    whole = HarmonyToolParser().parse(text)
    assert whole.content.startswith("Checking.")
    for chunks in chunkings(random.Random(len(body)), text):
        content, calls, own = streamed(HarmonyToolParser(), chunks)
        assert content == own.content == whole.content, chunks
        assert not calls and own.error is None


def test_random_harmony_turns_stream_as_parsed_whole():
    """Random runs of harmony messages (markers, bodies, whitespace), whole, char by char and cut at
    random: the same content, calls, error and reasoning."""
    pieces = ["<|channel|>analysis<|message|>", "<|channel|>commentary<|message|>", "<|channel|>final<|message|>",
              "<|channel|>commentary to=functions.f <|constrain|>json<|message|>", "<|end|>", "<|start|>assistant",
              "<|call|>", "<|return|>", "hello", " world ", "\n", '{"a": 1}', " ", "\t"]

    def run(chunks):
        stream = HarmonyToolParser().stream()
        for chunk in chunks:
            stream.feed(chunk)
        stream.close()
        parsed = stream.finish()
        return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls], parsed.error, stream.reasoning

    for seed in range(400):
        rng = random.Random(seed)
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 10)))
        whole = run([text])
        for chunks in chunkings(rng, text):
            assert run(chunks) == whole, (text, chunks)


def test_reasoning_tokens_are_the_analysis_bodies_tokens(gpt_oss):
    """usage.reasoning_tokens of a turn of two analysis messages: their bodies' tokens, no markup.
    The line between the two was added to the reasoning with the second one's header, so its
    <|message|> token counted as reasoning (9 where the bodies are 8 tokens)."""
    from hibana_core import SamplingParams
    from test_chat import HELLO
    from test_harmony import forced_chat

    bodies = ["Think it over.", "Then more."]
    text = "<|start|>assistant".join(f"<|channel|>analysis<|message|>{b}<|end|>" for b in bodies)
    text += "<|start|>assistant<|channel|>final<|message|>Hi<|return|>"
    chat, n = forced_chat(gpt_oss, "two-analyses", text)
    deltas = list(chat.stream_respond(HELLO, params=SamplingParams(max_tokens=n)))
    result = deltas[-1].result
    assert result.reasoning == "\n".join(bodies) == "".join(d.reasoning for d in deltas[:-1])
    tokens = sum(len(gpt_oss.tokenizer.encode(b, add_special_tokens=False)) for b in bodies)
    assert result.usage.reasoning_tokens == tokens


def test_a_gpt_oss_conversation_stays_on_its_state_across_user_turns(gpt_oss):
    """Calls that name no state (the adapters' and the server's default) on gpt-oss: the next user
    turn renders the last reply without its analysis message, and the state's history was taken up
    to the turn's last end (<|return|>, <|call|>: <|end|> ends no turn), the analysis included, so
    the conversation no longer continued its own state: every user turn went to a new one, the old
    left resident and unused. It stays on its state (its last reply recomputed from the analysis)."""
    from hibana_core import SamplingParams
    from hibana_core.chat import Chat, assistant_message
    from hibana_core.speculation import force_outputs

    chat = Chat(gpt_oss)

    def turn(messages: list[dict], text: str) -> tuple[object, str]:
        prompt = chat.render_text(messages)
        with chat.lease(prompt) as leased:
            ids = gpt_oss.tokenizer.encode(text, add_special_tokens=False)
            force_outputs(leased.handle, ids)
            return leased.respond(prompt, params=SamplingParams(max_tokens=len(ids))), leased.handle.id

    reply = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>{}<|return|>"
    messages = [{"role": "user", "content": "hi"}]
    first, state = turn(messages, reply.format("Greet them.", "Hello."))
    messages += [assistant_message(first), {"role": "user", "content": "How are you?"}]
    second, again = turn(messages, reply.format("Answer.", "Fine."))
    assert (first.text, second.text, second.reasoning) == ("Hello.", "Fine.", "Answer.")
    assert again == state and second.usage.cached_tokens > len(chat.prompt_tokens(chat.render_text(messages[:1])))
    assert [s.id for s in gpt_oss.states() if s.id.startswith("auto-")] == [state]
