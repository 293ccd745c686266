"""bench/models.py's random presets: built without a second copy of the weights, the engine loads
them one tensor at a time and the transformers peer runs the very same values."""

from __future__ import annotations

import random

import pytest
import torch

from tiny_models import _COMMON, ARCH_CONFIGS, random_tokens

CPU = torch.device("cpu")
ENGINE = dict(device="cpu", dtype="float32", block_size=16, num_blocks=32)


@pytest.fixture
def tiny_preset(monkeypatch):
    """preset(arch, **extra) -> the name of a tiny preset of tiny_models' `arch` config."""
    from hibana_bench import models

    def preset(arch: str, **extra) -> str:
        spec = {k: v for k, v in {**_COMMON, **ARCH_CONFIGS[arch], **extra}.items() if k != "dtype"}
        name = f"tiny-{arch}"
        monkeypatch.setitem(models.PRESETS, name, dict(model_type=arch, **spec))
        return name

    return preset


def _engine_greedy(engine, prompt: list[int], n: int) -> list[int]:
    from hibana_core import SamplingParams

    h = engine.open_state("a")
    return list(h.generate(SamplingParams(max_tokens=n, ignore_eos=True), prompt=prompt).token_ids)


def _matrices(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.dim() >= 2}


@pytest.mark.parametrize("arch, extra", [("qwen3_moe", {}), ("qwen3", dict(tie_word_embeddings=True))])
def test_preset_engine_and_peer_run_the_same_weights_one_copy_at_a_time(arch, extra, tiny_preset):
    from hibana_bench.models import load_bench_model
    from hibana_bench.peers import HFPeer

    model = load_bench_model(tiny_preset(arch, **extra), CPU, torch.float32)
    assert all(p.is_meta for p in _matrices(model.hf_model).values())  # only vectors and buffers are real
    prompt = random_tokens(random.Random(7), 40)
    with model.engine(**ENGINE) as engine:
        got = _engine_greedy(engine, prompt, 12)
    with model.peer_model() as hf_model:
        assert not any(p.is_meta for p in hf_model.parameters())
        if extra.get("tie_word_embeddings"):
            assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
        std = float(hf_model.model.layers[0].self_attn.q_proj.weight.std())
        want, _ = HFPeer(hf_model).generate(prompt, 12)
    assert got == want
    assert std == pytest.approx(_COMMON["initializer_range"], rel=0.1)  # the config's init, not torch.empty's
    assert all(p.is_meta for p in _matrices(model.hf_model).values())  # the peer's copy is gone


def test_mxfp4_preset_engine_loads_the_experts_as_from_the_model_built_on_the_device(tiny_preset):
    """The old path (`Engine.from_hf_model` on the whole model, MXFP4 experts and all, on the
    device) and the new one (each weight made as the loader reads it) give the same engine."""
    from hibana_bench.models import load_bench_model
    from hibana_core import Engine

    model = load_bench_model(tiny_preset("gpt_oss", mxfp4_experts=True), CPU, torch.float32)
    prompt = random_tokens(random.Random(8), 40)
    with model.engine(**ENGINE) as engine:
        got = _engine_greedy(engine, prompt, 12)
    with model.peer_model() as hf_model:
        experts = hf_model.model.layers[0].mlp.experts
        assert bool((experts.gate_up_proj_scales == 127 - 6).all()) and len(experts.down_proj_blocks.unique()) > 200
        with Engine.from_hf_model(hf_model, **ENGINE, progress=False) as engine:
            want = _engine_greedy(engine, prompt, 12)
    assert got == want
    assert len(set(got)) > 1


def test_decode_rows_count_the_kv_bytes_a_token_reads_at_their_context(tiny_preset):
    """`kv_read_bytes`: every layer's keys and values at the row's context, a sliding layer's up
    to its window (tiny mistral: 48 tokens), in the cache's dtype (kv8: 1 byte, float32: 4)."""
    from hibana_bench.models import load_bench_model
    from hibana_bench.workloads import decode_workload

    spec = {**_COMMON, **ARCH_CONFIGS["mistral"]}
    model = load_bench_model(tiny_preset("mistral"), CPU, torch.float32)
    report = decode_workload(model, [32, 96], 2, ["hibana_spec_off", "hibana+kv8"])
    rows = report["rows"]
    assert report["config"] == {"contexts": [32, 96], "generate": 2, "systems": ["hibana_spec_off", "hibana+kv8"],
                                "seed": 0, "fusions": ["auto"], "pdl": [True]}  # what the JSON measured
    per_token = 2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec["hidden_size"] // spec[
        "num_attention_heads"]  # keys and values of one token, elements
    got = {(r["system"], r["context"]): r["kv_read_bytes"] for r in rows}
    assert got == {("hibana_spec_off", 32): 4 * 32 * per_token, ("hibana_spec_off", 96): 4 * 48 * per_token,
                   ("hibana+kv8", 32): 32 * per_token, ("hibana+kv8", 96): 48 * per_token}


def test_bench_agents_fails_with_an_agents_error_rather_than_report_the_others(tiny_preset, monkeypatch):
    """An agent thread that failed printed a thread traceback, and the run reported the other
    agents' turns as its result; at Ctrl+C every agent printed one as the engine closed."""
    from hibana_bench.models import load_bench_model
    from hibana_bench.workloads import AgentsConfig, run_hibana_agents
    from hibana_core import QueueTimeoutError
    from hibana_core.state import StateHandle

    generate = StateHandle.generate

    def failing(self, *args, **kwargs):
        if self.id == "agent1":
            raise QueueTimeoutError("agent1 waited too long")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(StateHandle, "generate", failing)
    model = load_bench_model(tiny_preset("qwen3"), CPU, torch.float32)
    with pytest.raises(QueueTimeoutError, match="agent1 waited too long"):
        run_hibana_agents(model, AgentsConfig(agents=2, turns=2, system=32, tool_result=8, generate=4), retention=True)
