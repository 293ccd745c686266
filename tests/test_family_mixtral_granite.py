"""Mixtral and Granite on the shared decoder, against transformers on tiny seeded checkpoints
(the pattern of test_families.py): greedy token for token as `generate`, 3 agents x 3 turns
batched with retention, speculation on, the config variants Hibana refuses.

    mixtral  3 layers, head_dim 16, top-2 of 8 experts (intermediate 32), routers tied in pairs
             (tiny_models.TIED_EXPERT_PAIRS); checkpoints hold block_sparse_moe.experts.{e}.w1/w2/w3
    granite  3 layers, embedding_multiplier 3, attention_multiplier 0.09 (not head_dim ** -0.5),
             residual_multiplier 0.6, logits_scaling 2.5

Their configs are tiny_models.ARCH_CONFIGS' (not in ARCHS: the every-family tests leave them out);
bench/gpu_correctness.py's families check builds them with make_tiny_checkpoint too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tiny_models import (EVERY_TENSOR_USED, assert_greedy_matches, greedy_turns_at_once, make_tiny_checkpoint,
                         open_engine, random_tokens, three_agents_three_turns)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]

@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral") / "m")


def repeating_history(seed: int) -> list[int]:
    """A history that repeats itself, so the suffix drafter proposes (and some drafts pass)."""
    rng = random.Random(seed)
    phrase = random_tokens(rng, 12)
    return random_tokens(rng, 10) + phrase * 3 + random_tokens(rng, 5) + phrase[:4]


def speculated_agents(engine, path) -> None:
    agents = greedy_turns_at_once(engine, "spec", [[(repeating_history(50 + a), 24), (repeating_history(60 + a), 16)]
                                                   for a in range(3)])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    stats = engine.stats()
    assert stats.draft_tokens_proposed > 0 and stats.draft_tokens_accepted > 0, stats


# --- Mixtral ----------------------------------------------------------------------------------

def test_mixtral_checkpoint_names_its_experts_as_transformers_saves_them(mixtral):
    from safetensors import safe_open

    with safe_open(mixtral / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in names
    assert "model.layers.2.block_sparse_moe.gate.weight" in names


def test_mixtral_agents_batched_with_retention_match_transformers(mixtral, make_engine):
    engine = make_engine(mixtral)
    assert engine.model.args.moe.top_k == 2 and engine.model.args.moe.renormalize
    three_agents_three_turns(engine, mixtral, "mx", 7100)


def test_mixtral_with_speculation_matches_transformers(mixtral, make_engine):
    speculated_agents(make_engine(mixtral, speculation={"method": "suffix", "k": 4}), mixtral)


def test_mixtral_sliding_window_crossing_blocks_matches_transformers(tmp_path, make_engine):
    """transformers' Mixtral windows every layer by sliding_window (it reads no layer_types nor
    use_sliding_window): a window of 20 (it starts mid-block in 16-token blocks), histories far
    past it, 3 agents x 3 turns."""
    window = 20
    path = make_tiny_checkpoint("mixtral", tmp_path / "windowed", sliding_window=window, use_sliding_window=False)
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (window,) * 3
    three_agents_three_turns(engine, path, "w", 7200)


def test_mixtral_experts_load_stacked_or_one_tensor_per_expert(mixtral, make_engine):
    """transformers 5 holds the experts stacked in memory (mlp.experts.gate_up_proj, what
    `Engine.from_hf_model` copies); on disk they are w1 / w3 / w2 per expert: both load alike."""
    from hibana_core import Engine, SamplingParams
    from tiny_models import _hf_model

    hf_model = _hf_model(str(mixtral))
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in hf_model.state_dict())
    history = random_tokens(random.Random(3), 70)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    from_disk = make_engine(mixtral).open_state("disk").generate(params, prompt=history)
    with Engine.from_hf_model(hf_model, None, device="cpu", dtype="float32", block_size=16,
                              num_blocks=64, progress=False) as engine:
        assert list(engine.open_state("mem").generate(params, prompt=history).token_ids) == list(from_disk.token_ids)
    assert_greedy_matches(mixtral, history, from_disk.token_ids)


@pytest.mark.parametrize("edit, error, message", [
    ({"hidden_act": "gelu"}, "UnsupportedModelError", "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "CheckpointError", "num_experts_per_tok 9"),
])
def test_mixtral_configs_it_cannot_run_are_refused(mixtral, tmp_path, edit, error, message):
    import shutil

    import hibana_core

    path = Path(shutil.copytree(mixtral, tmp_path / "edited"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(getattr(hibana_core, error), match=message):
        open_engine(path)


# --- Granite ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def granite(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("granite", tmp_path_factory.mktemp("granite") / "g")


def test_granite_reads_its_multipliers(granite, make_engine):
    args = make_engine(granite).model.args
    assert (args.embed_scale, args.embed_scale_in_dtype, args.attention_scale, args.residual_multiplier,
            args.logits_scaling) == (3.0, False, 0.09, 0.6, 2.5)
    assert args.sliding_windows == (None,) * 3


def test_granite_agents_batched_with_retention_match_transformers(granite, make_engine):
    three_agents_three_turns(make_engine(granite), granite, "gr", 8100)


def test_granite_with_speculation_matches_transformers(granite, make_engine):
    speculated_agents(make_engine(granite, speculation={"method": "suffix", "k": 4}), granite)


def test_granite_logprobs_are_those_of_its_scaled_logits(granite, make_engine):
    """logits_scaling changes no greedy token, only the distribution: each generated token's
    log-probability and the top 5 are transformers' log_softmax of its logits (divided by 2.5)."""
    from hibana_core import SamplingParams
    from tiny_models import hf_next_logits

    history = random_tokens(random.Random(4), 40)
    c = make_engine(granite).open_state("lp").generate(
        SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=5), prompt=history)
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        want = hf_next_logits(granite, history + list(c.token_ids[:i])).log_softmax(-1)
        assert lp.token_id == token == int(want.argmax())
        assert lp.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert [t for t, _ in lp.top] == want.topk(5).indices.tolist()


@pytest.mark.parametrize("field, value, error, message", [
    ("logits_scaling", 0, "CheckpointError", "logits_scaling is 0"),
    ("residual_multiplier", float("nan"), "CheckpointError", "residual_multiplier is nan"),
    ("hidden_act", "relu", "UnsupportedModelError", "activation 'relu'"),
])
def test_granite_configs_it_cannot_run_are_refused(granite, tmp_path, field, value, error, message):
    import shutil

    import hibana_core

    path = Path(shutil.copytree(granite, tmp_path / "edited"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(getattr(hibana_core, error), match=message):
        open_engine(path)


def test_granite_embeddings_scale_by_the_unrounded_multiplier(tmp_path):
    """transformers multiplies bf16 embeddings by the Python float embedding_multiplier (1.7 here),
    not by it rounded to bf16 first as Gemma's normaliser is: the first layer's input is bit for
    bit transformers' `embed_tokens(ids) * embedding_multiplier`."""
    import torch
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine, SamplingParams

    path = make_tiny_checkpoint("granite", tmp_path / "g", num_hidden_layers=1, embedding_multiplier=1.7)
    ids = random_tokens(random.Random(6), 20)
    seen = []
    with Engine.from_pretrained(str(path), device="cpu", dtype="bfloat16", block_size=16, num_blocks=16,
                                progress=False) as engine:
        engine.model.model.layers[0].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[1].clone()))
        engine.open_state("e").generate(SamplingParams(max_tokens=1, ignore_eos=True), prompt=ids)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    want = hf.model.embed_tokens(torch.tensor(ids)) * hf.config.embedding_multiplier
    assert seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], want)


def test_mixtral_gptq_checkpoint_loads_its_experts_as_int4_stacks(mixtral, tmp_path, monkeypatch, make_engine):
    """A GPTQ Mixtral (block_sparse_moe.experts.{e}.w1.qweight, ...) reads its experts' names
    through the same renames into the int4 stacks, and computes its dequantized weights."""
    import test_prequantized
    from hibana_core import SamplingParams

    monkeypatch.setattr(test_prequantized, "LINEARS", test_prequantized.LINEARS + ("w1", "w2", "w3"))
    reference = test_prequantized.write_quantized(mixtral, tmp_path / "gptq", "gptq")
    packed = make_engine(tmp_path / "gptq", speculation="off")
    assert {m.experts_kind for m in packed.model.modules() if hasattr(m, "experts_kind")} == {"int4"}
    prompt, params = random_tokens(random.Random(2), 40), SamplingParams(max_tokens=16, ignore_eos=True)
    assert list(packed.open_state("a").generate(params, prompt=prompt).token_ids) == \
        list(make_engine(reference, speculation="off").open_state("a").generate(params, prompt=prompt).token_ids)
