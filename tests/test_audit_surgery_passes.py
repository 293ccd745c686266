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
