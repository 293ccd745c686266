"""Audit of pre-quantized checkpoint loading from outside (an issue-14 fuzz): configs and layouts the
other tests do not write. A quantization_config names modules as the checkpoint does, and a
multimodal checkpoint's names are not the model's own; a malformed compressed-tensors config is a
CheckpointError, never the library's bare TypeError / KeyError."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hibana_core import SamplingParams
from hibana_core.errors import CheckpointError
from hibana_core.surgery.formats import parse_quantization_config
from test_audit_surgery_formats import _ct_layer
from tiny_models import (EVERY_TENSOR_USED, assert_greedy_matches, make_tiny_gemma3_multimodal, make_tiny_qwen3_vl,
                         random_tokens)

pytestmark = EVERY_TENSOR_USED

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_language_model_packed(src, dst):
    """src -> dst with the language model's decoder linears in compressed-tensors pack-quantized
    int4 (the vision tower left as it is), its config targeting them by a regex over the
    checkpoint's own names; returns dst's float twin of the dequantized weights."""
    reference = dst.parent / f"{dst.name}-dequantized"
    for path in (dst, reference):
        shutil.copytree(src, path)
    tensors = load_file(src / "model.safetensors")
    packed, dense = {}, dict(tensors)
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if "language_model" not in name or not name.endswith(".weight") or not prefix.endswith(LINEARS):
            packed[name] = w
            continue
        parts, dequantized = _ct_layer(w, 32)
        dense[name] = dequantized.to(w.dtype)
        packed.update({f"{prefix}.{suffix}": t for suffix, t in parts.items()})
    save_file({k: v.contiguous() for k, v in packed.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in dense.items()}, reference / "model.safetensors", metadata={"format": "pt"})
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
               "actorder": None, "dynamic": False, "observer": "minmax"}
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": [r"re:.*language_model.*_proj$"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["re:.*lm_head", "re:.*vision.*", "re:.*visual.*", "re:.*multi_modal_projector.*"],
        "kv_cache_scheme": None}
    (dst / "config.json").write_text(json.dumps(config))
    return reference


@pytest.mark.parametrize("make", [make_tiny_gemma3_multimodal, make_tiny_qwen3_vl], ids=["gemma3", "qwen3_vl"])
def test_a_multimodal_checkpoint_whose_config_targets_its_own_names_loads(make, make_engine, tmp_path):
    """A multimodal checkpoint (language_model.model.* / model.language_model.*) whose config targets
    its language model by a regex over those names: its packed layers were checked against the
    model's own names (model.layers.*), which the regex does not match, and the load was refused
    as "stored packed, and the quantization_config says it is not quantized" (vLLM maps the
    config's patterns onto the checkpoint's names, and loads it)."""
    pytest.importorskip("compressed_tensors")
    dst = tmp_path / "packed"
    reference = _write_language_model_packed(make(tmp_path / "source"), dst)
    engine = make_engine(dst, speculation="off")
    assert {m.kind for m in engine.model.modules() if hasattr(m, "set_packed")} >= {"int4"}
    prompt = random_tokens(random.Random(3), 29)
    got = engine.open_state("a").generate(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                          prompt=prompt)
    assert_greedy_matches(reference, prompt, got.token_ids)  # transformers on the dequantized weights


_CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
           "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}},
       "ignore": ["lm_head"]}


def _with(path: tuple[str, ...], value) -> dict:
    cfg = json.loads(json.dumps(_CT))
    at = cfg
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    return cfg


@pytest.mark.parametrize("cfg", [
    _with(("config_groups", "group_0", "weights", "group_size"), "128"),  # the library's TypeError
    _with(("config_groups", "group_0", "weights", "group_size"), [128]),
    _with(("config_groups", "group_0", "weights"), {"num_bits": 1, "type": "float", "strategy": "tensor"}),  # its
    # NotImplementedError
    _with(("config_groups", "group_0"), []),  # its KeyError (a preset scheme's name)
    _with(("sparsity_config",), "dense"),  # 'str' object has no attribute 'get'
], ids=["group_size-str", "group_size-list", "float-1-bit", "group-list", "sparsity-str"])
def test_a_malformed_compressed_tensors_config_is_a_checkpoint_error(cfg):
    pytest.importorskip("compressed_tensors")
    with pytest.raises(CheckpointError, match="compressed-tensors"):
        parse_quantization_config(cfg)
    assert parse_quantization_config(_CT).group_size == 128  # the config they break loads
