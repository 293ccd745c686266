"""Audit of the reasoning area, harmony (gpt-oss): what a stream makes of a turn does not depend on
where the engine's tokens cut its text."""

from __future__ import annotations

import random

import pytest

from hibana_plugins.harmony import HarmonyToolParser
from test_hostile_chat import chunkings, streamed

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
