"""config.json variations that released checkpoints carry, each against transformers' generate:
fields written the way transformers 4.x wrote them (rope_theta beside rope_scaling) and options
the golden checkpoints (tiny_models.ARCH_CONFIGS) leave at one value."""

from __future__ import annotations

import random

import pytest

from hibana_core import SamplingParams
from tiny_models import EVERY_TENSOR_USED, assert_greedy_matches, edit_config, make_tiny_checkpoint

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


def greedy(engine, history: list[int], n: int) -> list[int]:
    c = engine.open_state(f"s{len(history)}").generate(SamplingParams(max_tokens=n, ignore_eos=True), prompt=history)
    return list(c.token_ids)


@pytest.mark.parametrize("arch, rope", [
    ("llama", dict(rope_theta=10000.0, rope_scaling=dict(type="dynamic", factor=2.0))),  # a 4.x config.json
    ("qwen2", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e6, factor=4.0))),
    ("gemma3", dict(rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                                     "full_attention": dict(rope_type="dynamic", rope_theta=1e6, factor=2.0)})),
])
def test_dynamic_ntk_rope_runs_as_transformers_does_within_the_context(arch, rope, tmp_path, make_engine):
    """Dynamic NTK scaling: transformers recomputes the frequencies only for a sequence longer than
    max_position_embeddings, which is the longest history Hibana holds, so every position it
    serves rotates by the unscaled frequencies (it refused rope type 'dynamic'). Histories run
    up to the last position."""
    path = make_tiny_checkpoint(arch, tmp_path / arch, max_position_embeddings=128)
    edit_config(path, drop=("rope_parameters", "partial_rotary_factor"), **rope)
    engine = make_engine(path)
    rng = random.Random(11)
    for length, n in ((40, 16), (100, 28)):
        history = [rng.randrange(1, 512) for _ in range(length)]
        assert_greedy_matches(path, history, greedy(engine, history, n))


@pytest.mark.parametrize("theta", [None, 0, "1e4"])
def test_a_rope_theta_that_is_no_positive_number_is_a_checkpoint_error(theta, tmp_path):
    """transformers reads these and fails in its first forward (None ** tensor), or rotates by
    nothing (0: every inverse frequency infinite). Hibana reported null as a broken plugin family
    (a TypeError from float()), ran 0 and read the text "1e4" as a number."""
    from hibana_core import CheckpointError
    from tiny_models import open_engine

    path = make_tiny_checkpoint("llama", tmp_path / "m")
    edit_config(path, drop=("rope_parameters",), rope_theta=theta, rope_scaling=None)
    with pytest.raises(CheckpointError, match=f"rope_theta is {theta!r}"):
        open_engine(path)


def test_sliding_layers_with_use_sliding_window_off_say_so(tmp_path):
    """A Qwen2 config.json whose layer_types name sliding layers while use_sliding_window is
    false: transformers' config drops the window (its generate then fails in the cache); the
    error said config.json's sliding_window is None where the file gives a number."""
    from hibana_core import CheckpointError
    from tiny_models import open_engine

    path = make_tiny_checkpoint("qwen2", tmp_path / "m", sliding_window=20)
    edit_config(path, use_sliding_window=False, layer_types=["full_attention"] + ["sliding_attention"] * 2)
    with pytest.raises(CheckpointError, match="use_sliding_window is false"):
        open_engine(path)


@pytest.mark.parametrize("fields", [
    dict(model_type="ministral", architectures=["MinistralForCausalLM"],
         layer_types=["full_attention", "sliding_attention"]),
    dict(model_type="ministral", architectures=["MinistralForCausalLM"]),  # its config windows every layer
    dict(layer_types=["full_attention", "sliding_attention"], attention_bias=True),  # read as a Ministral
], ids=["ministral", "ministral-no-layer-types", "mistral-with-layer-types-and-attention-bias"])
def test_ministral_runs_as_transformers_does(fields, tmp_path, make_engine):
    """Ministral (model_type ministral, as transformers saves a Ministral-8B fine-tune; a mistral
    config.json with layer_types is read as one too) is Mistral with per-layer windows and no
    attention biases whatever attention_bias says. model_type ministral was refused as
    unsupported, and attention_bias true asked for bias tensors the checkpoint has not."""
    path = make_tiny_checkpoint("mistral", tmp_path / "m", sliding_window=20)
    edit_config(path, drop=("layer_types",), **fields)
    engine = make_engine(path)
    rng = random.Random(13)
    for length in (40, 130):
        history = [rng.randrange(1, 512) for _ in range(length)]
        assert_greedy_matches(path, history, greedy(engine, history, 20))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_hidden_act_swish_is_silu_as_in_transformers(arch, tmp_path, make_engine):
    """transformers' ACT2FN reads "swish" as SiLU; it was refused as an unsupported activation."""
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    edit_config(path, hidden_act="swish")
    engine = make_engine(path)
    history = [random.Random(5).randrange(1, 512) for _ in range(40)]
    assert_greedy_matches(path, history, greedy(engine, history, 12))


@pytest.mark.parametrize("heads, kv_heads", [(4, 3), (2, 4)])
def test_query_heads_not_a_multiple_of_kv_heads_is_a_checkpoint_error(heads, kv_heads, tmp_path):
    """transformers saves such a model and fails in its first forward; Hibana loaded it and failed
    in its warm-up forward with a bare RuntimeError from the attention's view."""
    from hibana_core import CheckpointError
    from tiny_models import open_engine

    path = make_tiny_checkpoint("llama", tmp_path / "m", num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(CheckpointError, match=f"num_attention_heads {heads} is not a multiple of its "
                                              f"num_key_value_heads {kv_heads}"):
        open_engine(path)


def test_a_model_safetensors_is_read_alone_beside_other_safetensors(tmp_path, make_engine):
    """Without an index, model.safetensors is the checkpoint, as transformers reads it: Mistral's
    repos ship a consolidated.safetensors beside it (the same weights under other names) and a
    fine-tune may leave an adapter_model.safetensors; they were read too, and their tensors
    refused as unused."""
    from safetensors.torch import save_file
    import torch

    path = make_tiny_checkpoint("mistral", tmp_path / "mistral")
    assert (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(path / "consolidated.safetensors"))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)}, str(path / "adapter_model.safetensors"))
    history = random.Random(4).sample(range(3, 200), 12)
    assert_greedy_matches(path, history, greedy(make_engine(path), history, 8))
