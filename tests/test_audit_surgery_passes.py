"""Audit of the surgery passes' parameters from outside: what a user who mistypes them is told."""

from __future__ import annotations

import pytest

from hibana_core.errors import ConfigError
from tiny_models import EVERY_TENSOR_USED

pytestmark = EVERY_TENSOR_USED


def test_sink_tokens_past_the_positions_are_told_to_shrink_not_the_window(tiny_checkpoints, make_engine):
    """sink_tokens at or past the model's positions advised "take a window under -999998976"."""
    with pytest.raises(ConfigError, match=r"covers all 1024 positions.*take sink_tokens under 1023") as refused:
        make_engine(tiny_checkpoints["qwen3"], surgery=[{"name": "window", "sink_tokens": 10 ** 9}],
                    surgery_guard=False, speculation="off")
    assert "window under -" not in str(refused.value)


def test_a_large_guard_text_is_read_only_as_far_as_the_guard_scores(tmp_path, monkeypatch):
    """The guard scores a text's first 4,096 tokens; a corpus given as surgery_guard_text was read
    and tokenized whole first (38 MB: 35 s and 5 GB of memory with the demo's tokenizer)."""
    from hibana_core.surgery import guard

    encoded = []

    def tokenizer(text, add_special_tokens=False):  # one token a word
        encoded.append(len(text))
        return {"input_ids": [len(word) % 50 for word in text.split()]}

    big = tmp_path / "corpus.txt"
    big.write_text("the agent called a tool and read its result\n" * 100_000)  # 4.4 MB, no document marks
    documents = guard.heldout_documents(tokenizer, 50, str(big))
    assert sum(map(len, documents)) == guard.MAX_TOKENS
    assert max(encoded) <= guard.CHARS_PER_TOKEN * guard.MAX_TOKENS
    monkeypatch.setattr(guard, "CHARS_PER_TOKEN", 10_000)  # the whole text (4.4 MB): the same documents
    assert guard.heldout_documents(tokenizer, 50, str(big)) == documents
