"""The example plugin's adapter takes token ids in every form the README says the engine takes
(a list, a tensor, a tokenizer's BatchEncoding as `apply_chat_template(..., tokenize=True)`
returns it), as its `sync` does."""

from __future__ import annotations

import pytest
import torch

hibana_example_plugin = pytest.importorskip("hibana_example_plugin")  # pip install -e examples/hibana-example-plugin


@pytest.fixture(scope="module")
def engine():
    from hibana_core import Engine

    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off",
                                kv_device_blocks=64) as engine:
        yield engine


def test_example_adapter_takes_a_tokenizers_output_as_it_comes(engine):
    from hibana_example_plugin.adapter import ExampleAdapter

    messages = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    encoding = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(encoding["input_ids"]) if hasattr(encoding, "keys") else list(encoding)
    expected = ExampleAdapter(engine, state_id="as-list").complete(ids, max_tokens=4).token_ids
    for name, prompt in [("batch-encoding", encoding), ("tensor", torch.tensor([ids]))]:
        completion = ExampleAdapter(engine, state_id=name).complete(prompt, max_tokens=4)
        assert completion.token_ids == expected, name
        assert engine.open_state(name).tokens[:len(ids)] == ids
