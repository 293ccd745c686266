"""What the shared golden runner (test_golden.py, every family of tiny_models.ARCHS) does not
reach: the language model of a multimodal gemma3 checkpoint, LongRoPE's per-position choice of
factors against transformers' rotary module, the options Hibana refuses, MoE experts loaded
from either of their layouts, and the bytes a decode token reads."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from hibana_core import SamplingParams, UnsupportedModelError
from hibana_core.models import phi3
from hibana_core.models.decoder import RotaryTables
from tiny_models import (agent_turn_plan, assert_greedy_matches, make_config, make_tiny_checkpoint,
                         make_tiny_gemma3_multimodal, open_engine)

pytestmark = pytest.mark.timeout(300)

AGENTS = TURNS = 3


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, make_engine):
    """3 agents x 3 turns at once on the text weights of a Gemma3ForConditionalGeneration
    checkpoint (vision tower left unread), each generation transformers' greedy on its history."""
    path = make_tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    engine = make_engine(path)
    results: dict[int, list[tuple[list[int], list[int]]]] = {}

    def run_agent(agent: int) -> None:
        h, history, turns = engine.open_state(f"mm-{agent}"), [], []
        for new, n in agent_turn_plan(7000 + agent, turns=TURNS):
            history = history + new
            h.append(new)
            c = h.generate(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            turns.append((history, list(c.token_ids)))
            history = history + list(c.token_ids)
        results[agent] = turns

    threads = [threading.Thread(target=run_agent, args=(a,)) for a in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert sorted(results) == list(range(AGENTS))
    assert engine.stats().prompt_tokens_reused > 0, "later turns must reuse the retained KV"
    for agent, turns in results.items():
        for history, generated in turns:
            assert_greedy_matches(path, history, generated)


def test_longrope_tables_pick_short_or_long_factors_per_position():
    """Rows below original_max_position_embeddings are transformers' rotary of a sequence that
    short (short factors), the rows from there on those of a longer one (long factors), both
    scaled by the attention factor; bit for bit."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = make_config("phi3")
    original = config.rope_parameters["original_max_position_embeddings"]
    rope = phi3.args_from_config(config).ropes[0]
    cos, sin = RotaryTables(rope, config.max_position_embeddings).tables(torch.device("cpu"))
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    short_cos, short_sin = hf(x, torch.arange(original)[None])
    long_cos, long_sin = hf(x, torch.arange(config.max_position_embeddings)[None])
    assert rope.dim == 12 and rope.attention_factor > 1.0
    assert torch.equal(cos[:original], short_cos[0]) and torch.equal(sin[:original], short_sin[0])
    assert torch.equal(cos[original:], long_cos[0, original:]) and torch.equal(sin[original:], long_sin[0, original:])
    assert not torch.equal(cos[:original], long_cos[0, :original]), "short and long factors must differ here"


@pytest.mark.parametrize("arch, override, message", [
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3", dict(hidden_activation="relu"), "activation 'relu'"),
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_options_are_refused(tmp_path, arch, override, message):
    path = make_tiny_checkpoint(arch, tmp_path / "m", **override)
    with pytest.raises(UnsupportedModelError, match=message):
        open_engine(path)


def test_moe_experts_load_stacked_or_one_tensor_per_expert(tiny_checkpoints, make_engine):
    """A qwen3_moe checkpoint on disk holds one tensor per expert; transformers 5 holds them
    stacked in memory (what `Engine.from_hf_model` copies): both load into the same experts."""
    from hibana_core import Engine
    from tiny_models import _hf_model, random_tokens

    path = tiny_checkpoints["qwen3_moe"]
    hf_model = _hf_model(str(path))
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in hf_model.state_dict())
    history = random_tokens(random.Random(3), 90)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    from_disk = make_engine(path).open_state("disk").generate(params, prompt=history)
    with Engine.from_hf_model(hf_model, None, device="cpu", dtype="float32", block_size=16,
                              num_blocks=64, progress=False) as engine:
        in_memory = engine.open_state("memory").generate(params, prompt=history)
    assert list(in_memory.token_ids) == list(from_disk.token_ids)
    assert_greedy_matches(path, history, list(from_disk.token_ids))


def test_decode_bytes_per_token_counts_only_routed_experts_and_one_embedding_row(tiny_checkpoints, make_engine):
    """The roofline numerator bench/ divides by: a MoE model's weights less the experts a token
    is not routed to, and (untied lm_head) less the other tokens' embedding rows."""
    engine = make_engine(tiny_checkpoints["qwen3_moe"])
    config, args = engine.hf_config, engine.model.args
    per_expert = 3 * config.moe_intermediate_size * config.hidden_size * 4  # gate, up, down; float32
    unrouted = sum(args.moe.layers) * (config.num_experts - config.num_experts_per_tok) * per_expert
    other_rows = (config.vocab_size - 1) * config.hidden_size * 4
    assert engine.model.decode_bytes_per_token() == engine.weight_bytes - unrouted - other_rows
