"""Model surgery: the load-time seam (one weight-copy path, passes, packed linear layers,
bytes and fingerprint) and the built-in weight-only passes w8 and w4 (on MoE experts too)."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from hibana_core import Engine, SamplingParams
from hibana_core.errors import CheckpointError, ConfigError, StateFileError, SurgeryGuardError
from hibana_core.loader import model_bytes
from hibana_core.models.moe import STACKS, StackedExperts
from hibana_core.surgery.quantize import group_size_for, quantize_int4, quantize_int8
from hibana_kernels.quant import dequantize_int4, dequantize_int8
from hibana_plugins.hookspecs import hookimpl
from hibana_plugins.manager import get_plugin_manager, reset_plugin_manager
from tiny_models import EVERY_TENSOR_USED, make_config, make_tiny_checkpoint, random_tokens

pytestmark = EVERY_TENSOR_USED

PASSES = ["w8", {"name": "w4", "group_size": 32}, "w4"]


def greedy(n: int = 24) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def dequantized_stack(experts, stack: str) -> torch.Tensor:
    """A packed expert stack [E, N, K] in float32, expert by expert as the linears dequantize."""
    codes, scales = getattr(experts, f"{stack}_qweight"), getattr(experts, f"{stack}_scales")
    if experts.experts_kind == "int8":
        return torch.stack([dequantize_int8(c, s, torch.float32) for c, s in zip(codes, scales)])
    group = 2 * codes.shape[2] // scales.shape[2]
    zeros = getattr(experts, f"{stack}_zeros")
    return torch.stack([dequantize_int4(c, s, z, group, torch.float32) for c, s, z in zip(codes, scales, zeros)])


@pytest.mark.parametrize("name", ["w8", "w4"])
def test_the_output_head_packs_in_int8_unless_asked_or_tied(name, tiny_checkpoints, make_engine):
    """w8 and w4 pack an output head with its own weight in int8 per channel (lm_head="int8", the
    default), keep it with lm_head="dense", and keep a head tied to the embedding (packing it
    would hold both); the bytes saved count the head's."""
    params = {"group_size": 32} if name == "w4" else {}
    path = tiny_checkpoints["llama"]  # its own head (the tiny qwen3's is its embedding)
    packed = make_engine(path, surgery=[{"name": name, **params}], speculation="off", surgery_guard=False)
    dense = make_engine(path, surgery=[{"name": name, **params, "lm_head": "dense"}], speculation="off",
                        surgery_guard=False)
    assert packed.surgery[0]["params"]["lm_head"] == "int8" and dense.surgery[0]["params"]["lm_head"] == "dense"
    assert (packed.model.lm_head.kind, dense.model.lm_head.kind) == ("int8", "dense"), packed.surgery
    head = dense.model.lm_head.weight
    assert dense.weight_bytes - packed.weight_bytes == head.numel() * head.element_size() - head.shape[0] * (
        head.shape[1] + 4)  # int8 codes and a float32 scale a row
    assert packed.surgery[0]["bytes_before"] - dense.surgery[0]["bytes_before"] == head.numel() * head.element_size()

    tied = make_engine(tiny_checkpoints["qwen3"], surgery=[{"name": name, **params}], speculation="off", surgery_guard=False)
    assert tied.surgery[0]["lm_head"] == "dense (tied to the embedding)" and tied.model.lm_head.kind == "dense"
    with pytest.raises(ConfigError, match="lm_head must be one of"):
        make_engine(path, surgery=[{"name": name, **params, "lm_head": "int4"}], surgery_guard=False)


def dense_twin(engine, make_engine, path):
    """A surgery-free engine on the same checkpoint whose linear layers (and MoE experts) hold
    the dequantized weights of `engine`'s packed ones: what the packed kernels must compute."""
    twin = make_engine(path, speculation="off")
    packed = dict(engine.model.named_modules())
    for name, layer in twin.model.named_modules():
        source = packed[name]
        if getattr(source, "experts_kind", "dense") != "dense":  # MoE experts: each as a linear layer
            for stack in STACKS:
                getattr(layer, stack).data.copy_(dequantized_stack(source, stack))
        elif getattr(source, "kind", "dense") == "int8":
            layer.weight.data.copy_(dequantize_int8(source.qweight, source.scales, torch.float32))
        elif getattr(source, "kind", "dense") == "int4":
            layer.weight.data.copy_(dequantize_int4(source.qweight, source.scales, source.zeros,
                                                    source.group_size, torch.float32))
    return twin


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("passes", PASSES, ids=["w8", "w4g32", "w4"])
def test_packed_model_computes_its_dequantized_weights(arch, passes, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = make_engine(path, surgery=[passes], speculation="off", surgery_guard=False)
    record, = engine.surgery
    kinds = {m.kind for n, m in engine.model.named_modules() if hasattr(m, "set_packed") and not n.endswith("lm_head")}
    assert kinds == {"int8" if record["name"] == "w8" else "int4"}
    assert record["layers"] == 2 * engine.model_args.num_layers * 2  # qkv, o, gate_up, down per layer
    tied = engine.model_args.tie_word_embeddings  # the tiny qwen3's head is its embedding, llama's its own
    assert (record["lm_head"], engine.model.lm_head.kind) == (("dense (tied to the embedding)", "dense") if tied
                                                               else ("int8", "int8"))
    assert record["bytes_after"] < record["bytes_before"] / (3.5 if record["name"] == "w8" or not tied else 6)

    twin = dense_twin(engine, make_engine, path)
    rng = random.Random(3)
    for turn in range(3):  # several turns: packed weights under prefill, decode, and retention
        prompt = random_tokens(rng, 30 + 7 * turn)
        h, t = engine.open_state(f"s{turn}"), twin.open_state(f"s{turn}")
        got = list(h.generate(greedy(), prompt=prompt).token_ids)
        want = list(t.generate(greedy(), prompt=prompt).token_ids)
        assert got == want
        got2 = list(h.generate(greedy(8), prompt=h.tokens + prompt[:5]).token_ids)
        assert got2 == list(t.generate(greedy(8), prompt=t.tokens + prompt[:5]).token_ids)


SPARSE_LAYERS = {"qwen3_moe": 2, "gpt_oss": 3}  # tiny_models: qwen3_moe's layer 1 is dense


def packed_expert_bytes(bits: int, i: int, h: int, group: int) -> int:
    """One expert's packed gate_up [2I, H] and down [H, I]: int8 codes and a float32 scale a row,
    or int4 codes and a float16 scale and zero a group of `group` inputs."""
    if bits == 8:
        return 3 * i * h + (2 * i + h) * 4
    return 3 * i * h // 2 + 2 * 2 * (2 * i * h // group + h * i // group)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("passes", ["w8", {"name": "w4", "group_size": 16}], ids=["w8", "w4g16"])
def test_moe_experts_pack_and_compute_their_dequantized_weights(arch, passes, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    plain = make_engine(path, speculation="off")
    engine = make_engine(path, surgery=[passes], speculation="off", surgery_guard=False)
    record, = engine.surgery
    bits = 8 if record["name"] == "w8" else 4
    experts = {n: m for n, m in engine.model.named_modules() if isinstance(m, StackedExperts)}
    assert len(experts) == SPARSE_LAYERS[arch]
    assert record["experts"] == len(experts) and record["experts_kept_float"] == []
    plain_modules = dict(plain.model.named_modules())
    for module_name, module in experts.items():
        kernel = module.kernel_experts()
        assert kernel.kind == f"int{bits}" and module.gate_up_proj is None and module.down_proj is None
        e, i, h = kernel.num_experts, kernel.intermediate_size, kernel.hidden_size
        assert kernel.group_sizes == ((0, 0) if bits == 8 else (16, 16))
        # each expert's float32 stacks -> int8 (about a quarter of the bytes) or int4 (about an eighth)
        saved = 3 * i * h * 4 - packed_expert_bytes(bits, i, h, group=16)
        assert model_bytes(plain_modules[module_name]) - model_bytes(module) == e * saved
    block = next(m for m in engine.model.modules() if hasattr(m, "unread_bytes_per_token"))
    unread_saved = SPARSE_LAYERS[arch] * (e - block.top_k) * saved
    assert plain.model.decode_bytes_per_token() - engine.model.decode_bytes_per_token() == \
        record["bytes_before"] - record["bytes_after"] - unread_saved, "a token reads only its k experts"
    assert engine.weight_bytes == plain.weight_bytes - record["bytes_before"] + record["bytes_after"]
    assert engine.weight_bytes == model_bytes(engine.model)

    twin = dense_twin(engine, make_engine, path)
    rng = random.Random(4)
    for turn in range(2):  # prefill (grouped routes) and decode, then a second turn on the kept state
        prompt = random_tokens(rng, 30 + 9 * turn)
        h, t = engine.open_state(f"s{turn}"), twin.open_state(f"s{turn}")
        assert list(h.generate(greedy(), prompt=prompt).token_ids) == \
            list(t.generate(greedy(), prompt=prompt).token_ids)
        assert list(h.generate(greedy(8), prompt=h.tokens + prompt[:5]).token_ids) == \
            list(t.generate(greedy(8), prompt=t.tokens + prompt[:5]).token_ids)


def test_w4_keeps_experts_float_where_no_even_group_divides_their_inputs(make_engine, tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "odd", moe_intermediate_size=33)  # down: 33 inputs
    engine = make_engine(path, surgery=["w4"], speculation="off", surgery_guard=False)
    record, = engine.surgery
    experts = [n for n, m in engine.model.named_modules() if isinstance(m, StackedExperts)]
    assert record["experts"] == 0 and record["experts_kept_float"] == experts and len(experts) == 2
    assert {m.experts_kind for m in engine.model.modules() if isinstance(m, StackedExperts)} == {"dense"}
    assert len(engine.open_state("a").generate(greedy(4), prompt=[5, 6, 7]).token_ids) == 4


def test_weight_bytes_count_packed_buffers(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    plain = make_engine(path, speculation="off")
    w8 = make_engine(path, surgery=["w8"], speculation="off", surgery_guard=False)
    assert plain.weight_bytes == model_bytes(plain.model)
    record, = w8.surgery
    assert w8.weight_bytes == plain.weight_bytes - record["bytes_before"] + record["bytes_after"]
    assert w8.weight_bytes == sum(t.numel() * t.element_size()
                                  for t in [*w8.model.parameters(), *w8.model.buffers()])


def test_state_files_refuse_another_surgery_or_dtype(tiny_checkpoints, make_engine, tmp_path):
    path = tiny_checkpoints["qwen2"]
    prompt = random_tokens(random.Random(5), 40)
    engines = {"plain": make_engine(path, speculation="off"),
               "w8": make_engine(path, surgery=["w8"], speculation="off", surgery_guard=False),
               "w4": make_engine(path, surgery=["w4"], speculation="off", surgery_guard=False),
               "w4g32": make_engine(path, surgery=[{"name": "w4", "group_size": 32}], speculation="off",
                                    surgery_guard=False),
               "bf16": make_engine(path, dtype="bfloat16", speculation="off")}
    assert len({e.fingerprint for e in engines.values()}) == len(engines)
    tokens = {}
    for name, engine in engines.items():
        h = engine.open_state("a")
        h.generate(greedy(4), prompt=prompt)
        h.save(tmp_path / f"{name}.hibana")
        tokens[name] = h.tokens
    for saved in engines:
        for name, engine in engines.items():
            if name == saved:
                assert engine.load_state(tmp_path / f"{saved}.hibana", "copy").tokens == tokens[saved]
                continue
            with pytest.raises(StateFileError, match="than this engine's: (surgery|dtype)"):
                engine.load_state(tmp_path / f"{saved}.hibana", f"from-{saved}")
    # the same configuration again (a new engine) reads it: the fingerprint is not per process
    again = make_engine(path, surgery=[{"name": "w8", "force": True}], speculation="off", surgery_guard=False)
    assert again.fingerprint == engines["w8"].fingerprint
    again.load_state(tmp_path / "w8.hibana")


def test_quantizers_round_trip_within_their_step():
    torch.manual_seed(0)
    w = torch.randn(37, 96)
    q8 = quantize_int8(w)
    assert q8["qweight"].dtype == torch.int8 and q8["scales"].shape == (37,)
    err8 = (dequantize_int8(q8["qweight"], q8["scales"], torch.float32) - w).abs()
    assert (err8 <= q8["scales"][:, None] / 2 + 1e-6).all()

    for group in (32, 96):
        plain = quantize_int4(w, group, clip=False)
        clipped = quantize_int4(w, group, clip=True)
        assert plain["qweight"].shape == (37, 48) and plain["scales"].shape == (37, 96 // group)
        errors = [(dequantize_int4(q["qweight"], q["scales"], q["zeros"], group, torch.float32) - w).square().sum()
                  for q in (plain, clipped)]
        assert errors[1] <= errors[0], "the clipping search keeps the unclipped range when that is best"
        assert errors[0] / w.square().sum() < 0.02
    zeros = torch.zeros(4, 64)
    q = quantize_int4(zeros, 32)
    assert dequantize_int4(q["qweight"], q["scales"], q["zeros"], 32, torch.float32).abs().max() == 0
    assert group_size_for(96, 128) == 96 and group_size_for(4096, 128) == 128 and group_size_for(7, 128) is None


def test_an_unknown_pass_is_refused_before_the_model_loads(monkeypatch):
    from hibana_core import Engine, engine as engine_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the pass names were checked")

    monkeypatch.setattr(engine_module, "load_model", no_loading)
    with pytest.raises(ConfigError, match=r"no surgery pass named 'w5'"):
        Engine.from_pretrained("demo", surgery=["w8", "w5"], device="cpu")
    # so are parameters the pass cannot take (the guard's reference run is minutes on a big model)
    with pytest.raises(ConfigError, match=r"group_size must be an even integer"):
        Engine.from_pretrained("demo", surgery=["w8", {"name": "w4", "group_size": 7}], device="cpu")
    with pytest.raises(ConfigError, match=r"w8 takes \['lm_head'\], got \['bogus'\]"):
        Engine.from_pretrained("demo", surgery=[{"name": "w8", "bogus": 1}], device="cpu")
    with pytest.raises(ConfigError, match=r"kv8 takes no parameters, got \['margin'\]"):
        Engine.from_pretrained("demo", surgery=[{"name": "kv8", "margin": 4}], device="cpu")
    # the command line's spelling, with a list `hibana serve --option surgery=...` reads too (JSON)
    with pytest.raises(ConfigError, match=r"surgery='w8,kv8' is one name; give a list") as refused:
        Engine.from_pretrained("demo", surgery="w8,kv8", device="cpu")
    assert json.loads(str(refused.value).split("give a list: surgery=")[1]) == ["w8", "kv8"]
    # and two weight passes: the second used to be refused only after the guard measured the first
    with pytest.raises(ConfigError, match=r"passes 'w8' and 'w4' both rewrite the linear weights; give one"):
        Engine.from_pretrained("demo", surgery=["w8", "kv8", {"name": "w4", "force": True}], device="cpu")


def test_the_record_and_fingerprint_hold_the_parameters_in_effect(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    default = make_engine(path, surgery=["w4"], surgery_guard=False, speculation="off")
    spelled = make_engine(path, surgery=[{"name": "w4", "group_size": 128, "clip": True}], surgery_guard=False,
                          speculation="off")
    other = make_engine(path, surgery=[{"name": "w4", "group_size": 32}], surgery_guard=False, speculation="off")
    dense_head = make_engine(path, surgery=[{"name": "w4", "lm_head": "dense"}], surgery_guard=False, speculation="off")
    assert default.surgery[0]["params"] == {"group_size": 128, "clip": True, "lm_head": "int8"}
    assert default.fingerprint == spelled.fingerprint != other.fingerprint
    assert dense_head.fingerprint not in (default.fingerprint, other.fingerprint)


@pytest.mark.parametrize("bad, message", [
    (["w9"], r"no surgery pass named 'w9'.*registered: kv8, w4, w8"),
    (["w8", "w8"], r"names a pass twice"),
    ([{"name": "w4", "group_size": 3}], r"group_size must be an even integer"),
    ([{"name": "w8", "group_size": 64}], r"w8 takes \['lm_head'\], got \['group_size'\]"),
    ([{"name": "w4", "clip": "yes"}], r"clip must be true or false"),
    ([{"name": "w8", "force": "yes"}], r"force must be true or false"),
    # an integer share: 1 reads as every layer or as layer 1, and the refusal said only "in (0, 1]"
    ([{"name": "window", "layers": 1}], r"with a point \(0\.5; 1\.0 for all of them\).*\(\[1\] for layer 1 alone\), got 1$"),
    ([{"name": "w4", "clip": True, "bogus": 1, 5: 2}], r"'w4': parameters must be plain data named by strings"),
    ([42], r"a surgery pass is a name"),
    ("", r"a surgery pass is a name"),
    (7, r"surgery must be a list"),
])
def test_bad_surgery_options_are_config_errors(bad, message, tiny_checkpoints, make_engine):
    with pytest.raises(ConfigError, match=message):
        make_engine(tiny_checkpoints["llama"], surgery=bad, surgery_guard=False)


class _Halve:
    """A third-party pass: halves every norm weight (easy to see in the output)."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, model, params):
        self.calls += 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.mul_(params.get("factor", 0.5))
        return {"factor": params.get("factor", 0.5)}


@contextlib.contextmanager
def registered_pass(name, surgery_pass):
    with registered_passes({name: surgery_pass}):
        yield


@contextlib.contextmanager
def registered_passes(passes):
    class Plugin:
        @hookimpl
        def register_surgery_passes(self, register):
            for name, surgery_pass in passes.items():
                register(name, surgery_pass)

    reset_plugin_manager()
    get_plugin_manager().register(Plugin(), name="hibana-test-surgery")
    try:
        yield
    finally:
        reset_plugin_manager()


def test_a_plugin_pass_runs_when_named_and_joins_the_fingerprint(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    halve = _Halve()
    with registered_pass("halve_norms", halve):
        plain = make_engine(path, speculation="off")
        assert halve.calls == 0, "registered passes run only when named"
        engine = make_engine(path, surgery=[{"name": "halve_norms", "factor": 0.25}, "w8"], speculation="off",
                             surgery_guard=False)
    assert halve.calls == 1
    assert [r["name"] for r in engine.surgery] == ["halve_norms", "w8"]
    assert engine.surgery[0]["factor"] == 0.25 and engine.fingerprint != plain.fingerprint
    norm = dict(engine.model.named_parameters())["model.norm.weight"]
    assert torch.allclose(norm, dict(plain.model.named_parameters())["model.norm.weight"] * 0.25)


class _ReturnsNothing:
    """A plugin's pass whose apply forgets to return its record."""

    def apply(self, model, params):
        return None


class _ApplyOfModelOnly:
    """A plugin's pass whose apply forgets the params argument."""

    def apply(self, model):
        return {}


class _CalibratedWithoutCalibration:
    """A calibrated pass whose apply does not take the calibration it is given."""

    calibrated = True

    def apply(self, model, params):
        return {}


@pytest.mark.parametrize("registered_obj, says", [
    (_Halve, r"'bad' is registered as the class test_surgery\._Halve, not an instance of it; register the pass "
             r"object: register\('bad', _Halve\(\)\)"),
    (lambda model, params: {}, r"'bad' is registered as the function test_surgery\.<lambda>, which has no "
                               r"apply\(model, params\) method"),
    (_ApplyOfModelOnly(), r"'bad' \(an instance of test_surgery\._ApplyOfModelOnly\) has an apply that cannot be "
                          r"called as apply\(model, params\); give it that signature"),
    (_CalibratedWithoutCalibration(), r"'bad' \(an instance of test_surgery\._CalibratedWithoutCalibration\) has an "
                                      r"apply that cannot be called as apply\(model, params, calibration\)"),
], ids=["class", "no-apply", "apply-of-model-only", "calibrated-without-calibration"])
def test_a_pass_registered_as_no_pass_object_is_refused_before_the_model_loads(registered_obj, says,
                                                                               tiny_checkpoints, monkeypatch):
    from hibana_core import engine as engine_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the registered pass was checked")

    monkeypatch.setattr(engine_module, "load_model", no_loading)
    with registered_pass("bad", registered_obj), pytest.raises(ConfigError, match=says):
        Engine.from_pretrained(tiny_checkpoints["llama"], surgery=["bad"], device="cpu")


def test_a_pass_whose_apply_returns_no_record_is_a_config_error(tiny_checkpoints, make_engine):
    with registered_pass("forgetful", _ReturnsNothing()), pytest.raises(
            ConfigError, match=r"surgery pass 'forgetful' \(an instance of test_surgery\._ReturnsNothing\) returned "
                               r"None from apply; apply\(model, params\) must return a dict"):
        make_engine(tiny_checkpoints["llama"], surgery=["forgetful"], surgery_guard=False, speculation="off")


class _ReturnsATensor:
    """A plugin's pass whose record holds what JSON cannot (the written checkpoint's manifest)."""

    def apply(self, model, params):
        return {"scale": torch.zeros(2), "seen": {1, 2}}


def test_a_pass_record_that_is_not_json_is_refused_and_no_checkpoint_is_half_written(tiny_checkpoints,
                                                                                      make_engine, tmp_path):
    """It was taken at load, then `hibana surgery --out` died in json.dumps with a traceback, leaving
    config.json and model.safetensors without their manifest; a write that fails leaves the folder empty."""
    from hibana_core import cli
    from hibana_core.surgery import checkpoint

    with registered_pass("tensor_record", _ReturnsATensor()):
        with pytest.raises(ConfigError, match=r"surgery pass 'tensor_record' .* returned a record that is not JSON "
                                              r"\(Object of type Tensor is not JSON serializable\)"):
            make_engine(tiny_checkpoints["llama"], surgery=["tensor_record"], surgery_guard=False,
                        speculation="off")
        out = tmp_path / "out"
        assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "tensor_record", "--no-guard",
                         "--device", "cpu", "--out", str(out)]) == 2
        assert not out.exists() or not any(out.iterdir())
    engine = make_engine(tiny_checkpoints["llama"], surgery=["w8"], surgery_guard=False, speculation="off")
    engine.surgery[0]["oops"] = object()  # a record that breaks only at the write
    with pytest.raises(TypeError):
        checkpoint.save(engine, tiny_checkpoints["llama"], out)
    assert out.is_dir() and not any(out.iterdir())


class _ReachRaises(_ReturnsNothing):
    def guard_reach(self, params):
        raise KeyError("window")


def test_a_pass_whose_guard_reach_raises_is_a_config_error_naming_it(tiny_checkpoints, make_engine):
    with registered_pass("reaching", _ReachRaises()), pytest.raises(
            ConfigError, match=r"surgery pass an instance of test_surgery\._ReachRaises raised KeyError from "
                               r"guard_reach .*fix the pass"):
        make_engine(tiny_checkpoints["llama"], surgery=["reaching"], speculation="off")


def test_in_memory_models_take_the_checked_copy_path():
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config("llama"))
    engine = Engine.from_hf_model(hf, device="cpu", dtype="float32", num_blocks=32, progress=False,
                                  speculation="off", surgery=["w8"], surgery_guard=False)
    assert engine.surgery[0]["layers"] > 0
    engine.close()

    state = hf.state_dict()
    del hf.model.layers[1].mlp.down_proj.weight  # a weight the config implies but the model lacks
    hf.model.layers[1].mlp.down_proj.register_parameter("weight", None)
    with pytest.raises(CheckpointError, match=r"lacks weights model\.layers\.1\.mlp\.down_proj\.weight"):
        Engine.from_hf_model(hf, device="cpu", dtype="float32", num_blocks=32, progress=False)
    hf.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(state["model.layers.1.mlp.down_proj.weight"][:, :-1])
    with pytest.raises(CheckpointError, match=r"down_proj\.weight in the in-memory .* has shape"):
        Engine.from_hf_model(hf, device="cpu", dtype="float32", num_blocks=32, progress=False)


def test_the_guard_on_an_in_memory_model_warns_of_no_indexing_errors(tiny_checkpoints, caplog):
    """The guard encodes texts longer than the tokenizer's model_max_length and cuts them into
    documents: transformers' "will result in indexing errors" is silenced for a tokenizer given to
    from_hf_model as for one the loader reads (it was logged there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoints["qwen3"]
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="transformers"):
        Engine.from_hf_model(hf, tokenizer, device="cpu", dtype="float32", num_blocks=32, progress=False,
                             speculation="off", surgery=["w8"]).close()
    assert not [r for r in caplog.records if "indexing errors" in r.getMessage()]


# --- the guard -----------------------------------------------------------------------------------


@pytest.mark.timeout(1800)  # the demo model's reference and two passes, greedy text included, on the CPU
def test_guard_measures_w8_then_kv8_on_the_demo_model_and_they_pass_their_floors(make_engine):
    """w8, then kv8 on top (the guard measures each pass's cumulative effect; kv8's scratch
    cache is fp8). The figures are printed (pytest -s) as `hibana surgery demo` prints them."""
    from hibana_core import Engine
    from hibana_core.surgery.guard import GuardReport, table

    engine = Engine.from_pretrained("demo", surgery=["w8", "kv8"], speculation="off", progress=False,
                                    num_blocks=64)
    try:
        guard = engine.surgery[0]["guard"]
        assert guard["decision"] == "ok" and guard["floors"] == {"ppl_ratio": 1.005}
        assert guard["ppl_ratio"] <= 1.005 and guard["top1_agreement"] > 0.97 and guard["mean_kl"] < 0.01
        assert guard["tokens"] > 2000 and 0 < guard["first_divergence"] <= 48
        # the demo conversations' tool calls, written by the model itself at each "<tool_call>"
        assert guard["tool_calls_valid_before"] >= 0.9 and guard["tool_calls_valid"] >= 0.9

        kv8 = engine.surgery[1]["guard"]
        assert engine.kv_cache.dtype == torch.float8_e4m3fn
        assert kv8["decision"] == "ok" and kv8["floors"] == {"ppl_ratio": 1.02, "top1_agreement": 0.95}
        assert kv8["ppl_ratio"] <= 1.02 and kv8["top1_agreement"] >= 0.95 and kv8["mean_kl"] < 0.02
        assert kv8["mean_kl"] > guard["mean_kl"], "fp8 KV costs more than int8 weights: it was measured"
        assert kv8["tool_calls_valid"] >= 0.8
        rows = [(r["name"], GuardReport(**{k: r["guard"][k] for k in ("ppl_ratio", "mean_kl", "top1_agreement",
                                                                     "first_divergence", "tokens")},
                                        tool_calls=r["guard"]["tool_calls_valid"],
                                        tool_calls_before=r["guard"]["tool_calls_valid_before"]),
                 r["guard"]["decision"]) for r in engine.surgery]
        print("\n" + table(rows))
    finally:
        engine.close()


def test_guard_measures_w8_with_int8_experts(tiny_checkpoints, make_engine):
    """The guard runs on an MoE model's w8 with its experts packed and reports the figures.
    (Forced: on the tiny random qwen3_moe, w8 of the linears alone costs a perplexity ratio of
    ~1.014, over w8's floor; routing near-ties flip; the experts add ~4e-4 to the mean KL.)"""
    engine = make_engine(tiny_checkpoints["qwen3_moe"], surgery=[{"name": "w8", "force": True}], speculation="off")
    record, = engine.surgery
    assert record["experts"] == SPARSE_LAYERS["qwen3_moe"]
    guard = record["guard"]
    assert (guard["decision"] == "ok" or guard["decision"].startswith("forced: ppl_ratio")) and guard["tokens"] > 1000
    assert 0 < guard["mean_kl"] < 0.05 and guard["top1_agreement"] > 0.85


def test_guard_documents_fit_a_short_context(tmp_path, make_engine):
    """The guard's documents and the greedy text after them stay within max_position_embeddings
    (a 512-position model once met an IndexError in its rotary tables, past position 511)."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3", tmp_path / "short", max_position_embeddings=512)
    engine = make_engine(path, surgery=[{"name": "w8", "force": True}], speculation="off")
    assert engine.surgery[0]["guard"]["tokens"] > 1000


class _Poison:
    """A broken pass: NaN in the first norm (and no floors of its own)."""

    def apply(self, model, params):
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(float("nan"))
                break
        return {}


def test_guard_refuses_a_pass_that_leaves_the_model_not_finite(tiny_checkpoints, make_engine):
    """NaN compares false against any ceiling: a pass that wrote NaN into the model passed its
    floors, and a pass without floors any guard (a new user's trial); both are refused now."""
    path = tiny_checkpoints["llama"]
    for floors in ({}, {"ppl_ratio": 1.005, "mean_kl": 0.01}):
        poison = _Poison()
        poison.floors = floors
        with registered_pass("poison", poison):
            with pytest.raises(SurgeryGuardError, match=r"ppl_ratio nan: the model's outputs are not finite"):
                make_engine(path, surgery=["poison"])


class _DecodeRowsOnly:
    """Changes what one-row forwards compute and nothing else (as the GPU's int8-x kernels of
    packed weights do): the output head's logits of a single row shifted off the argmax."""

    def apply(self, model, params):
        def hook(module, args, output):
            if output.shape[0] != 1:
                return output
            shifted = output.clone()
            shifted[0, output[0].argmax()] -= 1e4
            return shifted
        model.lm_head.register_forward_hook(hook)
        return {}


def test_the_guards_divergence_follows_decode_rows(tiny_checkpoints, make_engine):
    """Free greedy output decodes one row a step: a change only those rows see leaves the
    teacher-forced figures (whole documents) as they were and shows in the first divergence,
    which is taken as generation runs: the head on the prefill's last row alone, then one row a
    step (this pass changes the first token already)."""
    with registered_pass("decode_rows", _DecodeRowsOnly()):
        engine = make_engine(tiny_checkpoints["qwen3"], surgery=[{"name": "decode_rows", "force": True}],
                             speculation="off")
    guard = engine.surgery[0]["guard"]
    assert guard["ppl_ratio"] == 1.0 and guard["top1_agreement"] == 1.0 and guard["mean_kl"] < 1e-4  # (rounding)
    assert guard["first_divergence"] == 0.0
    plain = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    with registered_pass("decode_rows", _DecodeRowsOnly()):
        changed = make_engine(tiny_checkpoints["qwen3"], surgery=[{"name": "decode_rows", "force": True}],
                              speculation="off", surgery_guard=False)
    prompt = random_tokens(random.Random(4), 20)
    first = [list(e.open_state("a").generate(greedy(1), prompt=prompt).token_ids) for e in (plain, changed)]
    assert first[0] != first[1]  # as the guard says: generation's first token differs


def test_a_pass_that_raises_is_a_hibana_error_naming_it(tiny_checkpoints, make_engine):
    """A plugin pass's own bug (a module path it expected) is a HibanaError that names the pass,
    not its bare KeyError (a new user's trial)."""
    from hibana_core import HibanaError

    class Lost:
        def apply(self, model, params):
            return {"found": dict(model.named_modules())["model.layers.0.mlp.nowhere"]}

    with registered_pass("lost", Lost()):
        with pytest.raises(HibanaError, match=r"surgery pass 'lost' .*failed in apply: KeyError"):
            make_engine(tiny_checkpoints["llama"], surgery=["lost"], surgery_guard=False)


class _Nothing:
    """A pass that changes nothing, with floors nothing but the unmodified model meets."""

    floors = {"ppl_ratio": 1.0001, "top1_agreement": 0.9999}

    def apply(self, model, params):
        return {}


def test_a_pass_after_a_forced_one_is_held_to_its_own_cost(tiny_checkpoints, make_engine):
    """The floors bound what a pass itself costs: after a forced pass that costs much, a pass
    that costs nothing is kept, whatever the order (a new user's trial: w4 forced, then kv8,
    refused kv8 for w4's cost; kv8 then w4 was kept)."""
    path = tiny_checkpoints["llama"]
    halve = _Halve()
    halve.floors = {"top1_agreement": 1.0001}
    with registered_passes({"halve_norms": halve, "nothing": _Nothing()}):
        for order in (["halve_norms", "nothing"], ["nothing", "halve_norms"]):
            passes = [{"name": name, "force": True} if name == "halve_norms" else name for name in order]
            engine = make_engine(path, surgery=passes, speculation="off")
            records = {r["name"]: r["guard"] for r in engine.surgery}
            assert records["halve_norms"]["decision"].startswith("forced: ")
            assert records["nothing"]["decision"] == "ok", records["nothing"]
            later = records[order[1]]
            assert later["own_cost"]["after"] == [order[0]] and "own_cost" not in records[order[0]]
            if order[1] == "nothing":  # cumulative: halve's cost; its own: none
                assert later["top1_agreement"] < 1 and later["own_cost"]["top1_agreement"] == 1.0
                assert later["own_cost"]["ppl_ratio"] == pytest.approx(1.0)
            else:  # after a pass that changed nothing, its own cost is its cumulative one
                assert later["own_cost"]["top1_agreement"] == later["top1_agreement"] < 1
        # three passes: the middle one is measured against two models and keeps its own for the
        # last; only a later floor on the KL keeps whole distributions
        kl_floor = _Nothing()
        kl_floor.floors = {"mean_kl": 1e-6}
    with registered_passes({"halve_norms": halve, "nothing": _Nothing(), "kl_floor": kl_floor}):
        engine = make_engine(path, surgery=[{"name": "halve_norms", "force": True}, "nothing", "kl_floor"],
                             speculation="off")
        nothing, last = (r["guard"] for r in engine.surgery[1:])
        assert nothing["own_cost"]["after"] == ["halve_norms"] and nothing["own_cost"]["mean_kl"] is None
        assert last["own_cost"]["after"] == ["halve_norms", "nothing"]
        assert last["own_cost"]["mean_kl"] == pytest.approx(0.0, abs=1e-6) and last["decision"] == "ok"
        # and a pass whose own cost is over its floors after another is still refused
        harsh = _Halve()
        harsh.floors = {"top1_agreement": 1.0001}
    with registered_passes({"nothing": _Nothing(), "halve_norms": harsh}):
        with pytest.raises(SurgeryGuardError, match=r"(?s)'halve_norms' costs more.*against the model nothing "
                                                    r"left.*halve_norms's own cost"):
            make_engine(path, surgery=["nothing", "halve_norms"], speculation="off")


def test_guard_refuses_a_pass_over_its_floors_unless_forced(tiny_checkpoints, make_engine, tmp_path):
    path = tiny_checkpoints["llama"]
    harsh = _Halve()
    harsh.floors = {"ppl_ratio": 1.0001, "top1_agreement": 0.999}
    with registered_pass("halve_norms", harsh):
        with pytest.raises(SurgeryGuardError, match=r"(?s)'halve_norms' costs more quality.*ppl ratio.*"
                                                    r"'force': True"):
            make_engine(path, surgery=["halve_norms"])
        engine = make_engine(path, surgery=[{"name": "halve_norms", "force": True}])
        plain = make_engine(path, surgery=[{"name": "halve_norms", "factor": 1.0}])  # changes nothing
        text = tmp_path / "mine.txt"
        text.write_text("the user's own held-out text, repeated " * 80)
        own = make_engine(path, surgery=[{"name": "halve_norms", "factor": 1.0}], surgery_guard_text=str(text))
    guard = engine.surgery[0]["guard"]
    assert guard["decision"].startswith("forced: ") and guard["ppl_ratio"] != 1.0
    assert engine.surgery[0]["params"] == {}, "force is no parameter of the pass (nor of the fingerprint)"
    same = plain.surgery[0]["guard"]
    assert same["decision"] == "ok" and same["ppl_ratio"] == pytest.approx(1.0) and same["top1_agreement"] == 1.0
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-6) and same["first_divergence"] == 48
    assert same["tool_calls_valid"] is None, "the tiny tokenizer has no <tool_call> token: nothing to measure"

    assert own.surgery[0]["guard"]["tokens"] != same["tokens"]
    with pytest.raises(ConfigError, match=r"guard text .*nothing\.txt' does not exist"):
        make_engine(path, surgery=["w8"], surgery_guard_text=str(tmp_path / "nothing.txt"))


def test_the_guard_and_layer_skip_keep_their_text_within_a_short_context(make_engine, tmp_path):
    """A model of fewer positions than the held-out documents (1,024 tokens, plus the greedy
    text after them) is measured on documents cut to fit, not indexed past its rotary table."""
    path = make_tiny_checkpoint("qwen3", tmp_path / "short", max_position_embeddings=256)
    engine = make_engine(path, surgery=[{"name": "w8", "force": True}], speculation={"method": "layer_skip"})
    guard = engine.surgery[0]["guard"]
    assert guard["tokens"] > 1000 and 0 <= guard["mean_kl"] < 0.05
    assert len(engine.open_state("a").generate(greedy(8), prompt=random_tokens(random.Random(3), 40)).token_ids) == 8
    too_short = make_tiny_checkpoint("qwen3", tmp_path / "tiny", max_position_embeddings=160)
    with pytest.raises(ConfigError, match=r"160 positions leaves 96 per document: .*surgery_guard=False"):
        make_engine(too_short, surgery=["w8"])
    shorter = make_tiny_checkpoint("qwen3", tmp_path / "shorter", max_position_embeddings=48)
    for overrides in (dict(surgery=["w8"]), dict(speculation={"method": "layer_skip"})):
        with pytest.raises(ConfigError, match=r"48 positions leaves 0 per document: .*surgery_guard=False "
                                              r"\(`hibana surgery --no-guard`\), or use a drafter other than "
                                              r"layer_skip"):
            make_engine(shorter, **overrides)


def test_a_guard_text_that_is_no_utf8_file_is_a_config_error(tmp_path):
    from hibana_core.surgery.guard import heldout_documents

    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 ".encode("latin-1") * 200)
    with pytest.raises(ConfigError, match=r"cannot be read as UTF-8"):
        heldout_documents(None, 512, str(binary))
    with pytest.raises(ConfigError, match=r"is a directory"):
        heldout_documents(None, 512, str(tmp_path))
    if Path("/dev/null").exists():
        with pytest.raises(ConfigError, match=r"'/dev/null' is not a regular file"):
            heldout_documents(None, 512, "/dev/null")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"no document longer than .*give a longer text"):
        heldout_documents(lambda text, add_special_tokens: {"input_ids": [ord(c) % 512 for c in text]}, 512,
                          str(empty))


def test_a_guard_text_without_document_marks_is_scored_in_full(tmp_path):
    """A user's file of plain text (no '<|hibana-guard-document|>' lines) was one document cut to
    its first ~1,000 tokens: 4,000 tokens of a user's agent logs were scored on a quarter."""
    from hibana_core.surgery.guard import MAX_TOKENS, heldout_documents

    text = tmp_path / "logs.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(6000)))
    by_char = lambda part, add_special_tokens: {"input_ids": [ord(c) for c in part]}  # noqa: E731
    documents = heldout_documents(by_char, 512, str(text), max_positions=1024)
    assert [len(d) for d in documents] == [960] * 4 + [MAX_TOKENS - 4 * 960]
    assert sum(documents, []) == [ord(c) for c in text.read_text()[:MAX_TOKENS]]  # consecutive, in order


def test_a_missing_guard_text_is_refused_before_the_weights_load(tiny_checkpoints, monkeypatch):
    import hibana_core.engine

    def load(*args, **kwargs):
        raise AssertionError("the weights loaded before the guard text was checked")

    monkeypatch.setattr(hibana_core.engine, "load_model", load)
    with pytest.raises(ConfigError, match=r"guard text '/no/such/guard\.txt' does not exist"):
        Engine.from_pretrained(str(tiny_checkpoints["llama"]), device="cpu", surgery=["w8"], progress=False,
                               surgery_guard_text="/no/such/guard.txt")


def without_tokenizer(source, path):
    """A copy of the checkpoint at `source` with its weights and configs only."""
    import shutil

    return Path(shutil.copytree(source, path, ignore=shutil.ignore_patterns(
        "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")))


def test_the_guard_measures_a_checkpoint_without_a_tokenizer_on_seeded_random_tokens(tiny_checkpoints, make_engine,
                                                                                    tmp_path):
    """No tokenizer, no text to read: the guard scores seeded random ids cut as the held-out text
    is (here 4 documents of 1,024 tokens, as the tiny tokenizer reads it), and says so."""
    from transformers import AutoModelForCausalLM

    from hibana_core.surgery.calibration import Calibration
    from hibana_core.surgery.guard import RANDOM_TEXT, heldout_documents
    from tiny_models import make_tokenizer

    random_ids = heldout_documents(None, 512)
    assert random_ids == heldout_documents(None, 512), "seeded: the same documents every time"
    assert [len(d) for d in random_ids] == [len(d) for d in heldout_documents(make_tokenizer(), 512)]
    assert [len(d) for d in heldout_documents(None, 512, max_positions=256)] == [192] * 8  # one per conversation
    path = without_tokenizer(tiny_checkpoints["llama"], tmp_path / "notok")
    engine = make_engine(path, surgery=["w8"], speculation="off")
    assert engine.tokenizer is None
    guard = engine.surgery[0]["guard"]
    scored = heldout_documents(None, 512, max_positions=engine.model_args.max_position_embeddings)
    assert guard["text"] == RANDOM_TEXT and guard["decision"] == "ok"
    assert guard["tokens"] == sum(len(d) - 1 for d in scored) > 4000
    assert 0 < guard["mean_kl"] < 0.05 and guard["tool_calls_valid"] is None
    calibration = Calibration(engine.model, engine._ctx, engine.model_args, engine.dtype, engine.device)
    assert not {tuple(d[:16]) for d in calibration.documents} & {tuple(d[:16]) for d in random_ids}, \
        "the guard never scores the kv8 calibration's random tokens"
    mine = tmp_path / "mine.txt"
    mine.write_text("the user's own held-out text " * 80)
    with pytest.raises(ConfigError, match=r"needs the model's tokenizer to read .*leave surgery_guard_text out"):
        make_engine(path, surgery=["w8"], surgery_guard_text=str(mine), speculation="off")

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    in_memory = Engine.from_hf_model(hf, device="cpu", dtype="float32", num_blocks=32, progress=False,
                                     speculation="off", surgery=[{"name": "window", "window": 256, "force": True}])
    try:
        assert in_memory.surgery[0]["guard"]["text"] == RANDOM_TEXT
    finally:
        in_memory.close()


# --- surgery written to disk ---------------------------------------------------------------------


def test_a_checkpoint_written_from_a_float32_engine_keeps_the_sources_bfloat16(make_engine, tmp_path):
    """The demo model is bfloat16; the CPU computes in float32. The written checkpoint stores the
    tensors no pass rewrote (embeddings, norms) as they came, in bfloat16, the pass's own results
    in float32, and loads into the same model: a new user's trial found embeddings written in
    float32, twice their bytes."""
    from safetensors import safe_open

    from hibana_core.cli import main
    from hibana_core.loader import DEMO_MODEL_DIR

    out = tmp_path / "w8"
    assert main(["surgery", "demo", "--passes", "w8", "--out", str(out), "--no-guard", "--device", "cpu"]) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["model.norm.weight"] == "BF16"
    assert {dtypes[n] for n in dtypes if n.endswith("qweight")} == {"I8"}
    assert {dtypes[n] for n in dtypes if n.endswith("scales")} == {"F32"}  # as the kernels read them
    kv8 = tmp_path / "kv8"  # its scales are buffers; the attention weights stay the source's
    assert main(["surgery", "demo", "--passes", "kv8", "--out", str(kv8), "--no-guard", "--device", "cpu"]) == 0
    with safe_open(str(kv8 / "model.safetensors"), "pt") as f:
        kept = {name: f.get_slice(name).get_dtype() for name in f.keys() if not name.endswith("kv_scale")}
    assert set(kept.values()) == {"BF16"}, {n: d for n, d in kept.items() if d != "BF16"}
    direct = make_engine(DEMO_MODEL_DIR, surgery=["w8"], speculation="off", surgery_guard=False)
    saved = make_engine(out, speculation="off")
    prompt = random_tokens(random.Random(10), 40)
    assert list(saved.open_state("a").generate(greedy(), prompt=prompt).token_ids) == \
        list(direct.open_state("a").generate(greedy(), prompt=prompt).token_ids)


@pytest.mark.parametrize("arch, passes", [("qwen3", "w8"), ("qwen3", '[{"name": "w4", "group_size": 32}]'),
                                         ("qwen3_moe", "w8"), ("qwen3_moe", '[{"name": "w4", "group_size": 32}]')])
def test_hibana_surgery_writes_a_checkpoint_that_loads_with_its_passes(arch, passes, tiny_checkpoints, make_engine,
                                                                       tmp_path, capsys):
    from hibana_core.cli import main

    path, out = tiny_checkpoints[arch], tmp_path / "out"
    assert main(["surgery", str(path), "--passes", passes, "--out", str(out), "--no-guard", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and ("and 2 MoE expert layers" in printed) == (arch == "qwen3_moe")
    assert ("and the output head (int8)" in printed) == (arch == "qwen3_moe")  # the tiny qwen3's is its embedding
    name = "w8" if passes == "w8" else "w4"
    params = {} if name == "w8" else {"group_size": 32}
    direct = make_engine(path, surgery=[{"name": name, **params}], speculation="off", surgery_guard=False)
    saved = make_engine(out, speculation="off")
    in_effect = {"lm_head": "int8"} if name == "w8" else {"group_size": 32, "clip": True, "lm_head": "int8"}
    assert [r["name"] for r in saved.surgery] == [name] and saved.surgery[0]["params"] == in_effect
    assert saved.weight_bytes == direct.weight_bytes
    assert [m.experts_kind for m in saved.model.modules() if isinstance(m, StackedExperts)] == \
        [f"int{8 if name == 'w8' else 4}"] * SPARSE_LAYERS.get(arch, 0)
    prompt = random_tokens(random.Random(9), 33)
    assert list(saved.open_state("a").generate(greedy(), prompt=prompt).token_ids) == \
        list(direct.open_state("a").generate(greedy(), prompt=prompt).token_ids)
    # the checkpoint is its source with its passes, as the engine that wrote it: states go both ways
    assert saved.fingerprint == direct.fingerprint
    handle = direct.open_state("s")
    handle.sync(prompt)
    handle.save(tmp_path / "s.safetensors")
    assert saved.load_state(tmp_path / "s.safetensors", state_id="s").tokens == prompt

    # a second run refuses to overwrite, as it refuses any non-empty directory; no pass is no run;
    # a damaged manifest is a CheckpointError
    assert main(["surgery", str(path), "--passes", "w8", "--out", str(out), "--no-guard", "--device", "cpu"]) == 2
    assert "--out: " in (err := capsys.readouterr().err) and "already holds a checkpoint" in err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["surgery", str(path), "--passes", "w8", "--out", str(tmp_path / "busy"), "--no-guard",
                 "--device", "cpu"]) == 2  # a usage error, before anything loads
    assert "is not empty; choose a new or empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]
    assert main(["surgery", str(path), "--passes", "", "--device", "cpu"]) == 2
    assert "names no pass" in capsys.readouterr().err
    assert main(["surgery", str(path), "--passes", "[3]", "--force", "--device", "cpu"]) == 2
    assert "a surgery pass is a name or {'name': ..., parameters}, got 3" in capsys.readouterr().err
    assert main(["surgery", str(path), "--passes", '{"name": "nosuch", "bits": 3}', "--device", "cpu"]) == 2
    assert "no surgery pass named 'nosuch'" in capsys.readouterr().err  # one pass as a JSON object
    manifest = json.loads((out / "hibana_surgery.json").read_text())
    (out / "hibana_surgery.json").write_text(json.dumps({**manifest, "packed_layers": {}}))
    with pytest.raises(CheckpointError, match=r"stores .* packed .*neither its surgery manifest .* names it packed"):
        make_engine(out)  # (it blamed the layer for being "a MoE router, an embedding")
    (out / "hibana_surgery.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"hibana_surgery\.json is damaged"):
        make_engine(out)


def test_hibana_surgery_reports_a_refusal(tiny_checkpoints, capsys, tmp_path):
    """A refusal is exit 1 with the guard's advice, and leaves no --out directory it made behind
    (a new user's trial found empty ones after refusals, unknown passes and a second w8)."""
    from hibana_core.cli import main

    halve = _Halve()
    halve.floors = {"top1_agreement": 1.0001}  # nothing passes this
    with registered_pass("halve_norms", halve):
        assert main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "halve_norms", "--device", "cpu",
                     "--out", str(tmp_path / "refused")]) == 1
        err = capsys.readouterr().err
        assert "costs more quality than its floors allow" in err and "add --force" in err
        assert not (tmp_path / "refused").exists()
        assert main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w3", "--device", "cpu",
                     "--out", str(tmp_path / "unknown")]) == 2
        assert not (tmp_path / "unknown").exists()
        assert main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w3", "--device", "cpu",
                     "--out", str(tmp_path / "deep" / "er" / "out")]) == 2
        assert not (tmp_path / "deep").exists()  # every folder it made
        (tmp_path / "mine").mkdir()  # made by the user: stays
        assert main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w3", "--device", "cpu",
                     "--out", str(tmp_path / "mine")]) == 2
        assert (tmp_path / "mine").is_dir()
        assert main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "halve_norms", "--device", "cpu",
                     "--force"]) == 0
        assert "guard: forced" in capsys.readouterr().out


def test_hibana_surgery_without_a_tokenizer_guards_on_random_tokens_and_names_its_own_flag(tiny_checkpoints,
                                                                                          tmp_path, capsys):
    """On a checkpoint without a tokenizer `hibana surgery` guards on seeded random token ids;
    a guard text it cannot read without one is refused with the command's own flag named."""
    from hibana_core.cli import main

    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoints["llama"] / name, bare / name)
    assert main(["surgery", str(bare), "--passes", "w8", "--device", "cpu", "--out", str(tmp_path / "w8")]) == 0
    printed = capsys.readouterr()
    assert "guard: ok" in printed.out and "seeded random ids" in printed.err  # the guard's table
    text = tmp_path / "heldout.txt"
    text.write_text("some held-out text", encoding="utf-8")
    assert main(["surgery", str(bare), "--passes", "w8", "--device", "cpu", "--guard-text", str(text)]) == 2  # an option it cannot take: a usage error
    err = capsys.readouterr().err
    assert "needs the model's tokenizer" in err and "hibana surgery --no-guard" in err, err


def test_the_guard_table_is_logged_without_progress(tiny_checkpoints, make_engine, caplog, capfd):
    """progress=False prints no guard table; the hibana.engine logger still has it, and the
    figures are in engine.surgery[i]["guard"]."""
    caplog.set_level(logging.INFO, logger="hibana.engine")
    with registered_pass("halve_norms", _Halve()):
        engine = make_engine(tiny_checkpoints["llama"], surgery=["halve_norms"], speculation="off", progress=False)
    assert "surgery guard" not in capfd.readouterr().err
    logged = [r.getMessage() for r in caplog.records if r.name == "hibana.engine"]
    assert any(m.startswith("surgery guard, ") and "halve_norms" in m for m in logged), logged
    assert engine.surgery[0]["guard"]["decision"] == "ok"


# --- the layer-skip self-draft -------------------------------------------------------------------


def test_layer_skip_self_draft_is_lossless_and_shares_the_weights(tiny_checkpoints, make_engine):
    from hibana_core.surgery.layer_skip import LayerSkipDrafter, choose_layers

    assert choose_layers([0.9, 0.1, 0.5, 0.2, 0.3, 0.8], 0.5) == [0, 2, 5]
    assert choose_layers([0.5, 0.1], 0.25) == [0, 1]
    path = tiny_checkpoints["qwen3"]
    plain = make_engine(path, speculation="off")
    engine = make_engine(path, speculation={"method": "layer_skip", "k": 3})
    rng = random.Random(11)
    prompts = [random_tokens(rng, 40) * 2 for _ in range(3)]  # repeats: something to draft right
    handles = [engine.open_state(f"s{i}") for i in range(3)]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(3) as pool:  # batched: several states draft in one call
        got = list(pool.map(lambda hp: list(hp[0].generate(greedy(30), prompt=hp[1]).token_ids),
                            zip(handles, prompts)))
    for i, (prompt, tokens) in enumerate(zip(prompts, got)):
        assert tokens == list(plain.open_state(f"p{i}").generate(greedy(30), prompt=prompt).token_ids)
    summary = engine.stats().speculation["drafters"]["layer_skip"]
    n = engine.model_args.num_layers
    assert summary["tokens_drafted"] > 0 and summary["layers_kept"][0] == 0 and summary["layers_kept"][-1] == n - 1

    drafter = LayerSkipDrafter(engine, layers=[0, 1])
    target, draft = engine.model.model.layers, drafter.runner.model.model.layers
    assert len(draft) == 2 and draft[1].self_attn.layer_idx == 1 and draft[1].self_attn.ctx is drafter.ctx
    assert draft[1].mlp.down_proj.weight.data_ptr() == target[1].mlp.down_proj.weight.data_ptr()
    assert target[1].self_attn.ctx is engine._ctx, "the target's layers are untouched"
    with pytest.raises(ConfigError, match=r"layers must be increasing indices"):
        LayerSkipDrafter(engine, layers=[1, 0])
    drafter.close()


def test_layer_skip_ranks_the_layers_of_a_checkpoint_without_a_tokenizer(tiny_checkpoints, make_engine, tmp_path):
    """With no held-out text to read, the layers are ranked on the guard's seeded random ids; the
    draft is built and greedy output is the target's own."""
    path = without_tokenizer(tiny_checkpoints["llama"], tmp_path / "notok")
    engine = make_engine(path, speculation={"method": "layer_skip", "k": 3})
    plain = make_engine(path, speculation="off")
    prompt = random_tokens(random.Random(7), 40) * 2
    got = engine.open_state("s").generate(greedy(30), prompt=prompt).token_ids
    assert list(got) == list(plain.open_state("p").generate(greedy(30), prompt=prompt).token_ids)
    summary = engine.stats().speculation["drafters"]["layer_skip"]
    assert summary["tokens_drafted"] > 0 and summary["layers_kept"][0] == 0


def test_a_layer_skip_named_first_mid_load_leaves_the_other_agents_alone(tiny_checkpoints, make_engine):
    """The first request naming layer_skip builds the drafter, which ranks the target's layers
    by running the target: between the engine's steps, never inside one (a new user's trial saw
    every other agent's request fail with "forward_batch scopes do not nest", and the scorer's
    swapped cache could have been read by their step)."""
    import threading

    path = tiny_checkpoints["llama"]  # 3 layers: the draft skips one
    engine = make_engine(path, speculation="off")
    plain = make_engine(path, speculation="off")
    rng = random.Random(13)
    prompts = [random_tokens(rng, 40) for _ in range(3)]
    handles = [engine.open_state(f"bg{i}") for i in range(3)]
    got, errors = {}, []

    def agent(i: int) -> None:
        try:
            got[i] = list(handles[i].generate(greedy(150), prompt=prompts[i]).token_ids)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while engine.stats().generated_tokens < 6:  # the three are decoding
        assert time.monotonic() < deadline
        time.sleep(0.005)
    skip = engine.open_state("skip").generate(SamplingParams(max_tokens=5, speculation={"method": "layer_skip", "k": 2}),
                                              prompt=prompts[0][:20])
    for thread in threads:
        thread.join()
    assert not errors and len(skip.token_ids) == 5
    for i in range(3):
        assert got[i] == list(plain.open_state(f"p{i}").generate(greedy(150), prompt=prompts[i]).token_ids)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_layer_skip_drops_layers_of_a_deeper_model(arch, tiny_checkpoints, make_engine):
    """Three layers, each with its own kind (gemma3: sliding, sliding, global with another rope;
    qwen3_moe: sparse, dense, sparse): the draft's per-layer arguments follow the layers it keeps."""
    from hibana_core.surgery.layer_skip import LayerSkipDrafter, kept_args

    path = tiny_checkpoints[arch]
    engine = make_engine(path, speculation={"method": "layer_skip", "k": 3})
    full = engine.model_args
    assert full.num_layers == 3
    args = kept_args(full, [0, 2])
    assert args.num_layers == 2 and args.ropes == (full.ropes[0], full.ropes[2])
    assert args.sliding_windows == (full.sliding_windows[0], full.sliding_windows[2])
    assert args.moe is None if full.moe is None else args.moe.layers == (full.moe.layers[0], full.moe.layers[2])
    LayerSkipDrafter(engine, layers=[0, 2]).close()
    plain = make_engine(path, speculation="off")
    prompt = random_tokens(random.Random(5), 30) * 2
    got = engine.open_state("s").generate(greedy(24), prompt=prompt).token_ids
    assert list(got) == list(plain.open_state("p").generate(greedy(24), prompt=prompt).token_ids)


def test_a_tool_call_is_valid_only_as_a_name_and_an_arguments_object():
    from hibana_core.surgery.guard import _is_call

    assert _is_call('\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n')
    for text in ('{"name": "lookup", "arguments": "Oslo"}', '{"name": 3, "arguments": {}}',
                 '{"name": "lookup", "arguments": {"city": "Os', '["lookup"]', ''):
        assert not _is_call(text), text


def test_progress_false_silences_the_passes_bars(tiny_checkpoints, capfd):
    """`progress=False` hides every surgery bar (w8's per-layer bar here), as it hides
    loading's; by default they show."""
    path = tiny_checkpoints["qwen3"]
    passes = [{"name": "w8", "force": True}, {"name": "window", "window": 16, "layers": [0], "force": True}]
    capfd.readouterr()
    Engine.from_pretrained(str(path), surgery=passes, speculation="off", progress=False, num_blocks=32).close()
    assert "surgery" not in capfd.readouterr().err
    Engine.from_pretrained(str(path), surgery=passes, speculation="off", num_blocks=32).close()
    err = capfd.readouterr().err
    assert "surgery w8" in err, err.replace("\r", "\n")


def test_a_surgery_checkpoint_is_its_source_only_in_its_writers_dtype_and_as_written(tiny_checkpoints, make_engine,
                                                                                     tmp_path):
    """Written by a bfloat16 engine from a float32 source, the checkpoint holds what a bfloat16
    engine applying the pass at load holds, not what a float32 one does: it shares the first's
    fingerprint only; edited afterwards, or written by an in-memory engine, it is its own."""
    from hibana_core.surgery import checkpoint

    path = tiny_checkpoints["llama"]
    writer = make_engine(path, dtype="bfloat16", surgery=["w8"], surgery_guard=False, speculation="off")
    out = checkpoint.save(writer, path, tmp_path / "w8-bf16")
    assert make_engine(out, dtype="bfloat16", speculation="off").fingerprint == writer.fingerprint
    direct = make_engine(path, dtype="float32", surgery=["w8"], surgery_guard=False, speculation="off")
    assert make_engine(out, dtype="float32", speculation="off").fingerprint != direct.fingerprint
    tokenizer = out / "tokenizer_config.json"  # edited: another tokenizer, as far as anyone can tell
    tokenizer.write_text(tokenizer.read_text().replace("}", ', "edited": 1}', 1))
    assert make_engine(out, dtype="bfloat16", speculation="off").fingerprint != writer.fingerprint


def test_the_guard_keeps_an_earlier_models_distributions_only_for_a_kl_floor():
    """What the guard holds between passes: the figures of the model the earlier passes left, its
    whole distributions (V numbers a position, as many bytes as the unmodified model's) only where
    a later pass's floors bound the KL, and nothing once the last pass is checked."""
    from hibana_core.surgery import guard as guard_module

    class Scorer:  # a model of 8 tokens whose distributions a pass may shift
        max_len, shift = 4096, 0.0

        def log_probs(self, doc):
            logits = torch.arange(8.0).repeat(len(doc) - 1, 1) * (1 + self.shift)
            return torch.log_softmax(logits, -1)

        def greedy(self, opening, n, stop=None):
            return [7] * n

        def forced_greedy(self, opening, continuation):
            return [7] * len(continuation)

    class Floors:
        def __init__(self, **floors):
            self.floors = floors

    scorer = Scorer()
    documents = [[1] * 200, [2] * 300]
    guard = guard_module.Guard(scorer, documents, progress=False)
    guard.measure_reference()
    guard.check("a", Floors(), force=False, later=[Floors(ppl_ratio=2.0)])
    assert guard.before is not None and guard.before.log_probs == []  # light: no distributions
    guard.check("b", Floors(), force=False, later=[Floors(mean_kl=0.1)])
    assert len(guard.before.log_probs) == 2 and guard.before.nll  # a KL floor follows
    scorer.shift = 0.5
    record = guard.check("c", Floors(mean_kl=1.0), force=False, later=[])
    assert guard.before is None and record["own_cost"]["mean_kl"] > 0  # measured against b's model
    with pytest.raises(RuntimeError, match="told no pass follows"):
        guard.check("d", Floors(), force=False, later=[])


def test_the_guards_scorer_runs_the_head_a_few_hundred_positions_at_a_time(tiny_checkpoints, make_engine,
                                                                           monkeypatch):
    """A window pass's documents run thousands of tokens: the scorer never asks the head for more
    than LOGIT_ROWS positions at once, and its figures are those of one whole-document head."""
    from hibana_core.surgery import guard as guard_module

    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    scorer = guard_module.Scorer(engine.model, engine._ctx, engine.model_args, engine.dtype, engine.device, 300)
    doc = random_tokens(random.Random(5), 300)
    whole = torch.log_softmax(scorer._forward(doc, 0)[:-1], dim=-1)
    monkeypatch.setattr(guard_module, "LOGIT_ROWS", 64)
    rows = []
    head = engine.model.compute_logits
    monkeypatch.setattr(engine.model, "compute_logits", lambda hidden: rows.append(len(hidden)) or head(hidden))
    chunked = scorer.log_probs(doc)
    assert max(rows) == 64 and sum(rows) == 299 and chunked.device.type == "cpu"
    torch.testing.assert_close(chunked, whole.cpu())
    target = torch.tensor(doc[1:])
    assert scorer.nll(doc) == pytest.approx(-whole.cpu().gather(1, target[:, None]).sum().item(), rel=1e-5)
    assert scorer.hidden(doc).shape[0] == 300


def test_the_guard_table_says_never_where_no_continuation_diverged():
    """A pass that changed nothing showed "diverges at 48.0" (the continuation's length, read as a
    divergence) and a mean KL of -1e-06."""
    from hibana_core.surgery.guard import CONTINUATION, GuardReport, table

    same = GuardReport(1.0, 0.0, 1.0, float(CONTINUATION), 512)
    some = GuardReport(1.01, 0.002, 0.97, 12.5, 512)
    lines = table([("noop", same, "ok"), ("w4", some, "ok")]).splitlines()
    assert f"never ({CONTINUATION})" in lines[1] and "12.5" in lines[2] and "never" not in lines[2]


def test_kv_dtype_fp8_on_a_checkpoint_written_with_kv8_is_that_checkpoint(tiny_checkpoints, make_engine, tmp_path):
    """kv_dtype="fp8" adds the kv8 pass, which a checkpoint written with kv8 refused ("already stores
    its KV cache in fp8"): its KV is fp8 already, so the engine is the checkpoint's, fingerprint and
    output alike. kv8 named in surgery on it is still refused (a pass applied twice)."""
    from hibana_core import ConfigError
    from hibana_core.cli import main

    out = tmp_path / "kv8"
    assert main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "kv8", "--out", str(out), "--no-guard",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    plain, asked = make_engine(out, speculation="off"), make_engine(out, speculation="off", kv_dtype="fp8")
    assert [r["name"] for r in asked.surgery] == [r["name"] for r in plain.surgery] == ["kv8"]
    assert asked.fingerprint == plain.fingerprint
    prompt = random_tokens(random.Random(3), 21)
    assert list(asked.open_state("a").generate(greedy(), prompt=prompt).token_ids) == \
        list(plain.open_state("a").generate(greedy(), prompt=prompt).token_ids)
    with pytest.raises(ConfigError, match="already stores its KV cache in fp8"):
        make_engine(out, speculation="off", surgery=["kv8"])
