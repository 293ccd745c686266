"""Audit of pre-quantized checkpoints from outside, in layouts the other tests do not write:
compressed-tensors pack-quantized int4 loaded whole (dense and MoE), and GPTQ symmetric per
channel (group_size -1) in two shards with an index. Each must compute what its dequantized
float checkpoint computes."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hibana_core import SamplingParams
from test_prequantized import pack_along_cols, pack_along_rows
from tiny_models import EVERY_TENSOR_USED, random_tokens

pytestmark = EVERY_TENSOR_USED

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _groups(k: int, group: int) -> torch.Tensor:
    return torch.arange(k) // (k if group == -1 else group)  # a last, partial group where group does not divide k


def _ct_layer(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Asymmetric int4 in compressed-tensors' pack-quantized layout (signed codes, zero points
    packed along N), and the weight it defines."""
    from compressed_tensors.compressors import pack_to_int32

    n, k = w.shape
    groups = _groups(k, group)
    count = int(groups.max()) + 1
    scales, zeros = torch.empty(n, count), torch.empty(n, count)
    for g in range(count):
        cols = w.float()[:, groups == g]
        low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        scales[:, g] = ((high - low) / 15).clamp(min=1e-4)
        zeros[:, g] = torch.round(-low / scales[:, g]).clamp(0, 15) - 8
    scales = scales.bfloat16()
    s, z = scales.float()[:, groups], zeros[:, groups]
    codes = torch.round(w.float() / s + z).clamp(-8, 7)
    return ({"weight_packed": pack_to_int32(codes.to(torch.int8), 4), "weight_scale": scales,
             "weight_shape": torch.tensor([n, k]), "weight_zero_point": pack_to_int32(zeros.to(torch.int8), 4, packed_dim=0)},
            (codes - z) * s)


def _gptq_sym_layer(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric GPTQ v1 (zero 8, stored as 7), and the weight it defines."""
    n, k = w.shape
    groups = _groups(k, group)
    count = int(groups.max()) + 1
    scales = torch.stack([(w.float()[:, groups == g].abs().amax(1) / 7.5).clamp(min=1e-4) for g in range(count)])
    scales = scales.half()  # [groups, N]
    s = scales.float().t()[:, groups]  # [N, K]
    codes = torch.round(w.float() / s + 8).clamp(0, 15).to(torch.int64)
    return ({"qweight": pack_along_rows(codes.t()), "qzeros": pack_along_cols(torch.full((count, n), 7)),
             "scales": scales, "g_idx": groups.to(torch.int32)}, (codes - 8) * s)


def _write(src, dst, layer, quantization_config: dict, shards: int = 1):
    """src -> dst with every decoder linear packed by `layer`, and dst's float twin (returned)."""
    reference = dst.parent / f"{dst.name}-dequantized"
    for path in (dst, reference):
        shutil.copytree(src, path)
        (path / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    packed, dense = {}, dict(tensors)
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(LINEARS) or not name.endswith(".weight"):
            packed[name] = w
            continue
        parts, dense[name] = layer(w)
        dense[name] = dense[name].to(w.dtype)
        packed.update({f"{prefix}.{suffix}": t for suffix, t in parts.items()})
    save_file({k: v.contiguous() for k, v in dense.items()}, reference / "model.safetensors")
    names = sorted(packed)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else ["model.safetensors"]
    for i, file in enumerate(files):  # every layer's tensors spread over the shards
        save_file({k: packed[k].contiguous() for k in names[i::shards]}, dst / file, metadata={"format": "pt"})
    if shards > 1:
        index = {"metadata": {}, "weight_map": {k: files[names.index(k) % shards] for k in names}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return reference


def _same_greedy(packed, dense, make_engine):
    prompt = random_tokens(random.Random(9), 29)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = make_engine(packed, speculation="off").open_state("a").generate(params, prompt=prompt)
    want = make_engine(dense, speculation="off").open_state("a").generate(params, prompt=prompt)
    assert list(got.token_ids) == list(want.token_ids)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_compressed_tensors_int4_checkpoint_computes_its_dequantized_weights(arch, tiny_checkpoints, make_engine,
                                                                               tmp_path):
    pytest.importorskip("compressed_tensors")
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
               "actorder": None, "dynamic": False, "observer": "minmax"}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None}},
              "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}
    dst = tmp_path / f"{arch}-w4a16"
    reference = _write(tiny_checkpoints[arch], dst, lambda w: _ct_layer(w, 32), config)
    _same_greedy(dst, reference, make_engine)


def test_a_symmetric_per_channel_gptq_checkpoint_in_shards_computes_its_dequantized_weights(tiny_checkpoints,
                                                                                          make_engine, tmp_path):
    config = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}
    dst = tmp_path / "qwen3-gptq"
    reference = _write(tiny_checkpoints["qwen3"], dst, lambda w: _gptq_sym_layer(w, -1), config, shards=2)
    _same_greedy(dst, reference, make_engine)


@pytest.mark.parametrize("arch, shown", [("qwen3", "packed layers"), ("qwen3_moe", "packed experts")])
def test_repacking_a_quantized_checkpoint_shows_its_own_bar(arch, shown, tiny_checkpoints, make_engine, tmp_path,
                                                            capfd):
    """Repacking a GPTQ checkpoint's layers is the weights stage's long work (about 0.4 s for a
    4096x12288 layer on a CPU: a minute for an 8B model, ten for a 70B one), and it ran before
    the weights' bar, with none of its own."""
    from test_prequantized import write_quantized

    dst = tmp_path / f"{arch}-gptq"
    write_quantized(tiny_checkpoints[arch], dst, "gptq")
    capfd.readouterr()
    make_engine(dst, speculation="off", progress=True)
    assert f"hibana: {shown}" in capfd.readouterr().err
    make_engine(dst, speculation="off")  # (progress=False)
    assert "hibana: packed" not in capfd.readouterr().err
