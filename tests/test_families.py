"""What the shared golden runner (test_golden.py, every family of tiny_models.ARCHS) does not
reach: the language model of a multimodal gemma3 checkpoint, LongRoPE's per-position choice of
factors against transformers' rotary module, the options Hibana refuses, MoE experts loaded
from either of their layouts, and the bytes a decode token reads."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from hibana_core import SamplingParams, UnsupportedModelError
from hibana_core.models import phi3
from hibana_core.models.decoder import RotaryTables, longrope_switch
from tiny_models import (EVERY_TENSOR_USED, ODD_SHAPES, agent_turn_plan, assert_greedy_matches, greedy_turns_at_once,
                         make_config, make_tiny_checkpoint, make_tiny_gemma3_multimodal, open_engine,
                         random_tokens, run_agents_at_once)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]

AGENTS = TURNS = 3


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, make_engine):
    """3 agents x 3 turns at once on the text weights of a Gemma3ForConditionalGeneration
    checkpoint (vision tower left unread), each generation transformers' greedy on its history."""
    path = make_tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine(path)
    assert not [w for w in caught if "does not use" in str(w.message)]  # the tower is left out on purpose
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

    run_agents_at_once(run_agent, AGENTS)
    assert sorted(results) == list(range(AGENTS))
    assert engine.stats().prompt_tokens_reused > 0, "later turns must reuse the retained KV"
    for agent, turns in results.items():
        for history, generated in turns:
            assert_greedy_matches(path, history, generated)


@pytest.mark.parametrize("arch", ODD_SHAPES)
def test_odd_shapes_match_transformers(arch, tmp_path, make_engine):
    """Each family on shapes unlike the golden test's (tiny_models.ODD_SHAPES): 2 agents at once,
    2 turns each with retention, histories past every window; each generation transformers'."""
    path = make_tiny_checkpoint(arch, tmp_path / arch, **ODD_SHAPES[arch])
    engine = make_engine(path)
    for turns in greedy_turns_at_once(engine, "odd", [agent_turn_plan(9100 + agent, turns=2) for agent in range(2)]):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)


def test_gemma3_multimodal_eos_comes_from_its_text_config(tmp_path, make_engine):
    """A multimodal config keeps eos_token_id in its text_config, where transformers' generation
    config takes it from: a checkpoint without generation_config.json stops there, and an
    in-memory Gemma3ForConditionalGeneration loads (it once raised AttributeError), stopping where
    its generation config (made from its config, as transformers makes one) says."""
    from transformers import GenerationConfig

    from hibana_core import Engine
    from tiny_models import EOS_ID, _hf_model

    path = make_tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    hf_model = _hf_model(str(path))
    hf_model.generation_config = GenerationConfig.from_model_config(hf_model.config)
    with Engine.from_hf_model(hf_model, None, device="cpu", dtype="float32", block_size=16, num_blocks=16,
                              progress=False) as engine:
        assert engine.eos_token_ids == {EOS_ID}
    (path / "generation_config.json").unlink()
    assert make_engine(path).eos_token_ids == {EOS_ID}


def test_longrope_tables_hold_both_rotations():
    """The first max_position_embeddings rows rotate per position: below
    original_max_position_embeddings transformers' rotary of a sequence that short (short
    factors), from there on that of a longer one (long factors); the last rows are the long
    rotation of the positions below original_max_position_embeddings. All scaled by the
    attention factor; bit for bit."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = make_config("phi3")
    original, most = config.rope_parameters["original_max_position_embeddings"], config.max_position_embeddings
    args = phi3.args_from_config(config)
    rope = args.ropes[0]
    cos, sin = RotaryTables(rope, most).tables(torch.device("cpu"))
    hf = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    short_cos, short_sin = hf(x, torch.arange(original)[None])
    long_cos, long_sin = hf(x, torch.arange(most)[None])
    assert rope.dim == 12 and rope.attention_factor > 1.0 and longrope_switch(args) == original
    assert cos.shape[0] == most + original
    assert torch.equal(cos[:original], short_cos[0]) and torch.equal(sin[:original], short_sin[0])
    assert torch.equal(cos[original:most], long_cos[0, original:]) and torch.equal(sin[original:most], long_sin[0, original:])
    assert torch.equal(cos[most:], long_cos[0, :original]) and torch.equal(sin[most:], long_sin[0, :original])
    assert not torch.equal(cos[:original], long_cos[0, :original]), "short and long factors must differ here"


SWITCH = 64
"""original_max_position_embeddings of the LongRoPE checkpoint below: histories cross it."""


def three_turns_at_once(engine, prefix: str, prompts: list[list[int]]) -> tuple[dict, dict]:
    """Each prompt an agent of its own, all at once, 3 turns with retention (the prompt and 40
    tokens, then 10 new tokens and 6, then 2 and 6): per agent its turns as (history, generated)
    and each turn's computed count."""
    agents = greedy_turns_at_once(engine, prefix, [[(prompt, 40), (list(range(7, 17)), 6), ([11, 12], 6)]
                                                   for prompt in prompts])
    results = {agent: [(history, list(c.token_ids)) for history, c in turns] for agent, turns in enumerate(agents)}
    computed = {agent: [c.stats.computed for _, c in turns] for agent, turns in enumerate(agents)}
    return results, computed


@pytest.fixture(scope="module")
def longrope_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("phi3", tmp_path_factory.mktemp("longrope") / "phi3",
                                original_max_position_embeddings=SWITCH)


@pytest.mark.parametrize("speculation, async_scheduling", [("off", False), ("adaptive", False), ("off", True)])
def test_longrope_histories_past_the_switch_match_transformers(longrope_checkpoint, make_engine, speculation,
                                                               async_scheduling):
    """transformers rotates a sequence up to original_max_position_embeddings tokens by the short
    factors and a longer one by the long factors at every position: its generate recomputes the
    cache at the token that crosses. 3 agents at once, 3 turns each with retention: the first
    generation crosses the switch (the state recomputed once, within the request), the later
    turns compute only their new tokens; a state synced below the switch and then asked to
    generate on a longer history recomputes it once; a state whose history shares the first
    blocks of a long one under the other rotation computes its own (the prefix index keeps the
    two apart). Every generation is transformers' greedy on its history."""
    engine = make_engine(longrope_checkpoint, max_num_batched_tokens=48, speculation=speculation,
                         async_scheduling=async_scheduling)  # the recompute takes two chunks
    rng = random.Random(3)
    results, computed = three_turns_at_once(engine, "lr", [[rng.randrange(2, 512) for _ in range(36 + 4 * a)]
                                                           for a in range(AGENTS)])
    for agent, turns in results.items():
        (first, out), second, third = turns
        assert len(first) < SWITCH < len(first) + len(out)
        # a turn computes its new tokens and the last one generated (no step wrote its KV)
        assert computed[agent][1:] == [len(second[0]) - len(first + out) + 1, len(third[0]) - len(second[0] + second[1]) + 1]
        for history, generated in turns:
            assert_greedy_matches(longrope_checkpoint, history, generated)
    grown, history = engine.open_state("grown"), [rng.randrange(2, 512) for _ in range(SWITCH + 6)]
    grown.sync(history[:30])
    c = grown.generate(SamplingParams(max_tokens=6, ignore_eos=True), prompt=history)
    assert c.stats.computed == len(history), "its short-rotated KV was recomputed"
    assert_greedy_matches(longrope_checkpoint, history, c.token_ids)
    # a short history sharing the first blocks of a long one (alone in another engine's prefix
    # index): the long-rotated blocks are not adopted, the short one computes its own
    other = make_engine(longrope_checkpoint)
    long = results[0][1][0]
    other.open_state("long").generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=long)
    c = other.open_state("short").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=long[:48])
    assert c.stats.computed == 48
    assert_greedy_matches(longrope_checkpoint, long[:48], c.token_ids)


@pytest.mark.parametrize("before", [10, -6], ids=["crossing", "past"])
@pytest.mark.parametrize("family", ["phi3", "llama"])
def test_a_draft_model_holds_the_rotation_of_its_target(longrope_checkpoint, tmp_path_factory, make_engine,
                                                         family, before):
    """The checkpoint drafting for itself: every greedy draft is the target's token, on a history
    past the LongRoPE switch (its drafts read the per-position rotation where the target's state
    held the long one: 16 of 28 accepted) and on one that crosses it while generating: Phi-3's
    states turn long there, llama's keep the per-position rotation until the next request."""
    checkpoint = longrope_checkpoint if family == "phi3" else make_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("longrope") / "llama", rope_parameters=LONGROPE)
    engine = make_engine(checkpoint, speculation={"method": "draft_model", "draft_model": str(checkpoint), "k": 4})
    history = [random.Random(before).randrange(2, 512) for _ in range(SWITCH - before)]
    handle = engine.open_state("a")
    for turn in range(2):  # the second turn's request turns a llama state long
        c = handle.generate(SamplingParams(max_tokens=24, ignore_eos=True), prompt=history)
        assert_greedy_matches(checkpoint, history, c.token_ids)
        history = history + list(c.token_ids) + [7, 8]
    stats = engine.stats()
    assert stats.draft_tokens_accepted == stats.draft_tokens_proposed > 0, stats


LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=SWITCH,
                short_factor=[1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0],
                long_factor=[1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0])


@pytest.mark.parametrize("arch, speculation", [("llama", "off"), ("llama", "adaptive"), ("gemma3", "off")])
def test_longrope_on_a_family_whose_generate_keeps_its_cache(tmp_path_factory, make_engine, arch, speculation):
    """LongRoPE on llama (and on gemma3's global layers only, beside its sliding layers' plain
    rope): their transformers classes have no Phi-3 rule, so a generation that crosses the switch
    keeps the prefill's short-rotated KV and rotates only the positions past it by the long
    factors; the next turn's prefill (generate on the whole history) rotates every position by
    the long factors. 3 agents at once, 3 turns each with retention: the first generation
    computes no position twice, the second turn recomputes its whole history once, the third
    computes only its new tokens; every generation is transformers' greedy."""
    rope = LONGROPE if arch == "llama" else {
        "full_attention": {**LONGROPE, "rope_theta": 1e6}, "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
    checkpoint = make_tiny_checkpoint(arch, tmp_path_factory.mktemp("longrope") / arch, rope_parameters=rope)
    engine = make_engine(checkpoint, max_num_batched_tokens=48, speculation=speculation)
    rng = random.Random(5)
    results, computed = three_turns_at_once(engine, "llr", [[rng.randrange(2, 512) for _ in range(40 + 4 * a)]
                                                            for a in range(AGENTS)])
    for agent, turns in results.items():
        (first, out), second, third = turns
        assert len(first) < SWITCH < len(first) + len(out)
        assert computed[agent] == [len(first), len(second[0]),  # the first turn recomputed nothing
                                   len(third[0]) - len(second[0] + second[1]) + 1]
        for history, generated in turns:
            assert_greedy_matches(checkpoint, history, generated)


def test_a_plugin_family_loads_a_model_type_transformers_does_not_know(tiny_checkpoints, make_engine, tmp_path):
    """A family registered through register_model_families for a model_type of its own: the
    config reaches its build as a plain PretrainedConfig of config.json's fields (AutoConfig
    refused the type, and the load failed before the family was asked: a new user's trial)."""
    import json
    import shutil

    from hibana_core.models.decoder import DecoderArgs, DecoderForCausalLM
    from hibana_plugins.hookspecs import hookimpl
    from hibana_plugins.manager import get_plugin_manager, reset_plugin_manager

    built = []

    class Family:
        @staticmethod
        def build(hf_config, ctx):  # Qwen3's architecture under another name
            built.append(hf_config.model_type)
            args = DecoderArgs.from_config(hf_config, qkv_bias=False, o_bias=False, qk_norm=True)
            return DecoderForCausalLM(args, ctx), args

    class Plugin:
        @hookimpl
        def register_model_families(self, register):
            register("plugqwen", Family())

    source = tiny_checkpoints["qwen3"]
    path = tmp_path / "plugqwen"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "plugqwen"}))
    reset_plugin_manager()
    get_plugin_manager().register(Plugin(), name="hibana-test-family")
    try:
        engine = make_engine(path, speculation="off")
        prompt = list(range(3, 40))
        got = engine.open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=prompt)
    finally:
        reset_plugin_manager()
    assert built == ["plugqwen"]
    want = make_engine(source, speculation="off").open_state("a").generate(
        SamplingParams(max_tokens=12, ignore_eos=True), prompt=prompt)
    assert list(got.token_ids) == list(want.token_ids)


def test_a_long_rotated_state_persists_and_parks_as_it_is(longrope_checkpoint, tmp_path, make_engine):
    """A state under the long rotation, saved and loaded in another engine and parked in the host
    tier and brought back: its next turn computes only its new tokens and is transformers'."""
    rng = random.Random(4)
    history = [rng.randrange(2, 512) for _ in range(SWITCH + 20)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = make_engine(longrope_checkpoint)
    h = engine.open_state("long")
    first = h.generate(params, prompt=history)
    h.save(tmp_path / "long.state")
    # room for ~1 such state (its window: the checkpoint has sliding_window 48); no prefix index,
    # which would hand the parked blocks back instead
    other = make_engine(longrope_checkpoint, num_blocks=9, host_kv_bytes=1 << 26, enable_prefix_caching=False)
    h = other.load_state(tmp_path / "long.state")
    history = history + list(first.token_ids) + [5, 6]
    for turn in range(2):
        filler = other.open_state(f"filler{turn}")  # takes the device pool: "long" parks to the host
        filler.generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=[rng.randrange(2, 512) for _ in range(120)])
        c = h.generate(params, prompt=history)
        assert c.stats.computed == 3 and c.stats.reused == len(history) - 3  # the last generated and 2 new
        assert_greedy_matches(longrope_checkpoint, history, c.token_ids)
        history = history + list(c.token_ids) + [5, 6]
    assert other.stats().resumes > 0, "the state was parked and brought back"


@pytest.mark.parametrize("arch, override, message", [
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3", dict(hidden_activation="relu"), "activation 'relu'"),
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("llama", dict(hidden_act="relu"), "activation 'relu'"),
    ("mistral", dict(hidden_act="gelu"), "activation 'gelu'"),
    # transformers' scaled ropes apply the factor and its llama-family attention then fails
    ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0, partial_rotary_factor=0.5)),
     "partial_rotary_factor 0.5 with rope type 'linear'"),
    ("gpt_oss", dict(rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                          original_max_position_embeddings=4096, partial_rotary_factor=0.5)),
     "partial_rotary_factor 0.5 with rope type 'yarn'"),
])
def test_unsupported_options_are_refused(tmp_path, arch, override, message):
    path = make_tiny_checkpoint(arch, tmp_path / "m", **override)
    with pytest.raises(UnsupportedModelError, match=message):
        open_engine(path)


@pytest.mark.parametrize("arch, rope", [
    ("qwen3", dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    ("gemma3", {"sliding_attention": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
                "full_attention": dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.25)}),
    ("llama", dict(rope_type="linear", factor=2.0, rope_theta=10000.0, attention_factor=1.5)),
    ("qwen2", dict(rope_type="default", rope_theta=10000.0, attention_factor=1.5)),
])
def test_rope_parameters_transformers_does_not_read_change_nothing(arch, rope, tmp_path, make_engine):
    """transformers' default rope rotates whole heads on every family but Phi-3, whatever
    partial_rotary_factor the config carries (a top-level one lands in rope_parameters), and only
    YaRN and LongRoPE scale cos and sin by an attention_factor; Hibana rotated only that part of
    each head, and scaled by any attention_factor: another model than transformers'."""
    path = make_tiny_checkpoint(arch, tmp_path / arch, rope_parameters=rope)
    history = random.Random(5).sample(range(1, 512), 80)
    c = make_engine(path).open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


@pytest.mark.parametrize("arch, top_k", [("qwen3_moe", 17), ("qwen3_moe", 0), ("gpt_oss", 9)])
def test_a_top_k_outside_the_experts_is_a_checkpoint_error(tmp_path, arch, top_k):
    """num_experts_per_tok outside [1, experts] cannot route: refused at load by name (it was a
    bare ValueError from the router's kernel in the warm-up forward)."""
    import json

    from hibana_core import CheckpointError

    path = make_tiny_checkpoint(arch, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": top_k}))
    with pytest.raises(CheckpointError, match=f"num_experts_per_tok {top_k} "):
        open_engine(path)


@pytest.mark.parametrize("arch, edit, error, message", [
    ("qwen3_moe", {"decoder_sparse_step": 0}, "CheckpointError", "decoder_sparse_step is 0"),
    ("gpt_oss", {"sliding_window": 0}, "CheckpointError", "sliding_window is 0"),
    ("gpt_oss", {"sliding_window": -4}, "CheckpointError", "sliding_window is -4"),
    ("gpt_oss", {"sliding_window": None}, "CheckpointError", "sliding_window is None"),
    ("gemma3", {"layer_types": ["chunked_attention", "full_attention"]}, "UnsupportedModelError",
     "chunked_attention"),
])
def test_a_config_that_cannot_be_run_as_written_is_refused(tmp_path, arch, edit, error, message):
    """Values transformers itself fails on (or, for a layer type, would run otherwise) are refused
    by name at load: they ran as full attention, or as a ZeroDivisionError."""
    import json

    import hibana_core

    path = make_tiny_checkpoint(arch, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    if "layer_types" in edit:
        edit = {"layer_types": (edit["layer_types"] * config["num_hidden_layers"])[:config["num_hidden_layers"]]}
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(getattr(hibana_core, error), match=message):
        open_engine(path)


def test_integer_weights_where_floats_belong_are_refused(tmp_path):
    """A checkpoint's int32 tensor for a float weight (a quantized checkpoint without its config, or
    a corrupt one) is refused; a copy would have cast its values without a word."""
    from safetensors.torch import load_file, save_file

    from hibana_core import CheckpointError

    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "m")
    [file] = path.glob("*.safetensors")
    tensors = load_file(file)
    name = next(n for n in tensors if "experts" in n)
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="int32"):
        open_engine(path)


def test_the_llama_family_reads_its_mlp_activation(tmp_path, make_engine):
    """transformers' llama-family MLP applies ACT2FN[hidden_act], silu only by default: a
    gelu-tanh one runs gelu-tanh (it once ran silu whatever the config said)."""
    path = make_tiny_checkpoint("qwen2", tmp_path / "gelu", hidden_act="gelu_pytorch_tanh")
    history = list(range(3, 40))
    c = make_engine(path).open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


def test_qwen3_moe_windows_every_layer_when_use_sliding_window(tmp_path, make_engine):
    """Qwen3-MoE's config has no layer_types; transformers windows every layer when
    use_sliding_window is on, max_window_layers notwithstanding (it once windowed only the layers
    from max_window_layers on, as Qwen2 4.x did)."""
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "windowed", use_sliding_window=True, sliding_window=20,
                                max_window_layers=2)
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (20, 20, 20)
    history = list(range(3, 70))
    c = engine.open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


@pytest.mark.parametrize("arch, windowing, edit", [
    ("qwen3_moe", dict(use_sliding_window=True), "layer_types"),
    ("phi3", {}, "layer_types"),
    ("phi3", {}, "use_sliding_window"),
    ("mistral", {}, "use_sliding_window"),
])
def test_windowing_keys_a_family_never_reads_change_nothing(arch, windowing, edit, tmp_path, make_engine):
    """transformers' Qwen3-MoE, Phi-3 and Mistral window every layer by sliding_window; Qwen3-MoE
    and Phi-3 never read layer_types, Phi-3 and Mistral never read use_sliding_window: a
    config.json that carries them (all full attention, or off) runs windowed all the same (Hibana
    once followed them, and attended to the whole history)."""
    import json

    path = make_tiny_checkpoint(arch, tmp_path / arch, sliding_window=9, **windowing)
    config = json.loads((path / "config.json").read_text())
    config[edit] = ["full_attention"] * config["num_hidden_layers"] if edit == "layer_types" else False
    (path / "config.json").write_text(json.dumps(config))
    engine = make_engine(path)
    assert set(engine.model.args.sliding_windows) == {9}
    history = list(range(3, 70))
    c = engine.open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


def test_gemma3_with_one_flat_rope_reads_each_layer_kinds_own(tmp_path, make_engine):
    """A Gemma 3 config given one flat rope_parameters keeps those keys beside the per-kind
    entries transformers adds (full: theta 1e6, sliding: the flat theta); HF's layers read the
    per-kind ones alone, and so does Hibana (it once read the flat keys as kinds and crashed)."""
    path = make_tiny_checkpoint("gemma3", tmp_path / "flat-rope",
                                rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    engine = make_engine(path)
    history = list(range(3, 60))
    c = engine.open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


def test_a_llama_config_carrying_a_sliding_window_attends_to_everything(tmp_path, make_engine):
    """transformers' LlamaAttention never reads sliding_window: a llama config.json that carries
    one (from a conversion) attends to the whole history there, and here (it once windowed every
    layer). Held to HF's forward on the whole sequence at each step: HF's generate is no reference
    here, as its cache keeps only the window's last tokens in decode while its prefill sees all."""
    from tiny_models import hf_next_logits

    path = make_tiny_checkpoint("llama", tmp_path / "llama-sw", sliding_window=12)
    engine = make_engine(path)
    assert engine.model.args.sliding_windows == (None, None, None)
    rng = random.Random(1)
    history = [rng.randrange(2, 512) for _ in range(80)]
    c = engine.open_state("a").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=history)
    want = []
    for _ in range(8):
        want.append(int(hf_next_logits(path, history + want).argmax()))
    assert list(c.token_ids) == want


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "llama"])
def test_mlp_bias_is_read_where_transformers_reads_it(arch, tmp_path, make_engine):
    """transformers' Qwen2, Qwen3 and Mistral MLPs have no bias whatever `mlp_bias` says (their
    checkpoints hold none); Llama's follows it. A stray "mlp_bias": true made these three refuse
    their complete checkpoints as missing the biases (an outside tester's config fuzz)."""
    path = make_tiny_checkpoint(arch, tmp_path / f"{arch}-mlp-bias", mlp_bias=True)
    engine = make_engine(path)
    assert (engine.model.args.mlp_bias is True) == (arch == "llama")
    history = [random.Random(2).randrange(2, 512) for _ in range(30)]
    c = engine.open_state("a").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)


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


def test_a_parked_copy_of_the_other_rotation_is_never_restored(longrope_checkpoint, make_engine):
    """A state parked under the short rotation that turns long (it grew past the switch while its
    copy stayed parked, e.g. when restoring found no room) recomputes instead of taking the copy."""
    engine = make_engine(longrope_checkpoint, host_kv_bytes=1 << 26, enable_prefix_caching=False)
    history = list(range(2, 42))
    h = engine.open_state("a")
    h.generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=history)
    seq, tier = engine.registry._entries["a"].seq, engine.scheduler.eviction.tier
    with engine.core.lock:
        assert tier.park(seq) and seq.parked is not None and not seq.parked.rotated_long
        seq.rotate_for(SWITCH + 1)  # what a step past the switch does
        assert tier.restore(seq, lambda blocks: False) == 0
    assert seq.parked is None and seq.num_computed == 0


def test_only_a_recomputing_longrope_bounds_a_step_at_the_switch_and_turns_long_past_it():
    """`rotation_room` and `rotate_for` share one reading of when the switch matters: under no
    LongRoPE, or one that does not recompute, a step is unbounded and nothing turns; under a
    recomputing one, a step stops at the switch and crossing it turns the KV long, unbounded
    from then on."""
    from hibana_core.kv.block_pool import BlockPool
    from hibana_core.kv.sequence import KVSequence, LongRope

    pool = BlockPool(16, 16)
    for rope in (None, LongRope(SWITCH, 4 * SWITCH, recompute=False)):
        seq = KVSequence(pool, lambda src, dst: None, long_rope=rope)
        assert seq.rotation_room(SWITCH - 3) == 1 << 30
        assert not seq.rotate_for(SWITCH + 1) and not seq.rotated_long
    seq = KVSequence(pool, lambda src, dst: None, long_rope=LongRope(SWITCH, 4 * SWITCH))
    assert seq.rotation_room(SWITCH - 3) == 3 and seq.rotation_room(SWITCH + 5) == 0
    assert not seq.rotate_for(SWITCH) and not seq.rotated_long
    assert seq.rotate_for(SWITCH + 1) and seq.rotated_long
    assert seq.rotation_room(SWITCH - 3) == 1 << 30 and not seq.rotate_for(SWITCH + 2)


@pytest.mark.parametrize("tied", [False, True])
def test_mistral3_multimodal_checkpoint_serves_its_language_model(tmp_path, make_engine, tied):
    """Mistral Small 3.1 / 3.2 ship as Mistral3ForConditionalGeneration (model_type mistral3): its
    language model (text_config: mistral) serves, the Pixtral tower and projector left unread; 2
    agents x 2 turns at once with retention, each generation transformers' greedy (Mistral3's
    own class, text alone) on its history. Its own output head, or the embedding where tied."""
    from tiny_models import make_tiny_mistral3_multimodal

    path = make_tiny_mistral3_multimodal(tmp_path / "mistral3", tie_word_embeddings=tied)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine(path)
    assert not [w for w in caught if "does not use" in str(w.message)]  # the tower is left out on purpose
    for turns in greedy_turns_at_once(engine, "m3", [agent_turn_plan(9300 + agent, turns=2) for agent in range(2)]):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    assert engine.stats().prompt_tokens_reused > 0


@pytest.mark.parametrize("tied, text_tied", [(False, None), (True, None), (False, True), (True, False)],
                         ids=["untied", "tied", "untied-text-says-tied", "tied-text-says-untied"])
def test_qwen3_vl_multimodal_checkpoint_serves_its_language_model(tmp_path, make_engine, tied, text_tied):
    """Qwen3-VL (model_type qwen3_vl: Qwen3VLForConditionalGeneration) serves text-only prompts
    on its language model (text_config qwen3_vl_text: Qwen3's layers), the vision tower and its
    deepstack mergers left unread; its multimodal rope rotates a text-only prompt as Qwen3's rope.
    2 agents x 2 turns at once with retention, each generation transformers' greedy (its own
    class, text alone); the head tied to the embedding as the checkpoint's top-level config says,
    whatever its text config's own flag says (transformers does not read that one)."""
    from tiny_models import make_tiny_qwen3_vl

    path = make_tiny_qwen3_vl(tmp_path / "qwen3_vl", tie_word_embeddings=tied, text_tie_word_embeddings=text_tied)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine(path)
    assert not [w for w in caught if "does not use" in str(w.message)]  # the tower is left out on purpose
    assert engine.model.args.qk_norm and engine.model.args.tie_word_embeddings == tied
    for turns in greedy_turns_at_once(engine, "vl", [agent_turn_plan(9800 + agent, turns=2) for agent in range(2)]):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    assert engine.stats().prompt_tokens_reused > 0


@pytest.mark.parametrize("biases", [dict(), dict(attention_out_bias=True, mlp_bias=True)],
                         ids=["qkv-bias", "qkv-o-and-mlp-biases"])
def test_seed_oss_reads_its_output_projections_own_bias_switch(tmp_path, make_engine, biases):
    """Seed-OSS (model_type seed_oss): Llama's layers, q/k/v biases by attention_bias and the
    o_proj's by its own attention_out_bias (False in Seed-OSS-36B), MLP biases by mlp_bias; 2
    agents x 2 turns at once with retention, each generation transformers' greedy."""
    path = make_tiny_checkpoint("seed_oss", tmp_path / "seed", **biases)
    engine = make_engine(path)
    args = engine.model.args
    assert (args.qkv_bias, args.o_bias, args.mlp_bias) == (True, bool(biases), bool(biases))
    for turns in greedy_turns_at_once(engine, "so", [agent_turn_plan(9700 + agent, turns=2) for agent in range(2)]):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)


def test_mistral3_with_another_language_model_is_refused_by_name():
    """A mistral3 checkpoint whose text_config is a family the llama family does not read (here
    Phi-3's) is an UnsupportedModelError naming both."""
    from transformers import Mistral3Config

    from hibana_core.models import llama

    with pytest.raises(UnsupportedModelError, match="mistral3.*phi3"):
        llama.args_from_config(Mistral3Config(text_config=make_config("phi3").to_dict()))


def test_ministral3_scales_its_queries_past_the_original_context(tmp_path, make_engine):
    """Ministral 3 (model_type ministral3, also as a mistral3 checkpoint's text_config): YaRN rope,
    queries scaled by 1 + beta * log(1 + floor(position / original_max_position_embeddings)) after
    rotary, as transformers scales them: histories and generations across that position (256 in the
    tiny config, 16,384 in Ministral 3's) greedy equal to transformers' with retention, the scale
    crossing inside a prefill chunk and inside a generation; the context is the YaRN rope's."""
    path = make_tiny_checkpoint("ministral3", tmp_path / "ministral3")
    engine = make_engine(path)
    assert engine.max_model_len == 1024 and engine.model.args.query_scaling_from == 256
    rng = random.Random(9400)
    plans = [[(random_tokens(rng, 230), 40), (random_tokens(rng, 30), 24)],  # generation crosses 256
             [(random_tokens(rng, 300), 16), (random_tokens(rng, 250), 16)]]  # prefills cross 256 and 512
    for turns in greedy_turns_at_once(engine, "m3", plans):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)


def test_ministral3_below_its_original_context_leaves_queries_as_they_are(tmp_path, make_engine, monkeypatch):
    """An engine whose positions stay below original_max_position_embeddings runs no scale: its
    attention takes the prologue folded as any llama layer's."""
    from hibana_core.models.decoder import Attention

    path = make_tiny_checkpoint("ministral3", tmp_path / "ministral3", max_position_embeddings=256)
    engine = make_engine(path, max_model_len=256)
    calls = []
    monkeypatch.setattr(Attention, "_scaled_queries", lambda self, positions, q: calls.append(q) or q)
    history = random_tokens(random.Random(9401), 60)
    from hibana_core import SamplingParams

    got = engine.open_state("m").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=history)
    assert not calls
    assert_greedy_matches(path, history, got.token_ids)