"""FP8 checkpoints load as they are: tiny fp8 checkpoints in each format's real layout
(tests/fp8_checkpoints.py) keep their codes and scales in Hibana's fp8 layers and compute exactly
what the float checkpoint of their dequantized weights computes (float32 on the CPU: the fp8
path is the float path on the same weights). The layer reading is checked against transformers'
and compressed-tensors' own dequantization; unsupported variants are CheckpointErrors."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import quantize, write_fp8_checkpoint
from hibana_core import SamplingParams
from hibana_core.errors import CheckpointError, ConfigError, StateFileError
from hibana_core.loader import model_bytes
from hibana_core.surgery import fp8
from hibana_core.surgery.formats import parse_quantization_config
from hibana_kernels.quant import dequantize_fp8
from tiny_models import EVERY_TENSOR_USED, random_tokens

pytestmark = EVERY_TENSOR_USED

needs_ct = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                              reason="compressed-tensors not installed (pip install hibana[quant])")
CT = ("ct-channel", "ct-tensor", "ct-block", "ct-group")


def greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _schemes(*schemes):
    return [pytest.param(s, marks=needs_ct) if s in CT else s for s in schemes]


def _linears(engine):
    return {n: m for n, m in engine.model.named_modules() if hasattr(m, "set_packed")}


def _same_greedy(a, b, prompts: int = 2) -> None:
    rng = random.Random(3)
    for i in range(prompts):
        prompt = random_tokens(rng, 20 + 7 * i)
        got = a.open_state(f"a{i}").generate(greedy(), prompt=prompt)
        want = b.open_state(f"a{i}").generate(greedy(), prompt=prompt)
        assert list(got.token_ids) == list(want.token_ids)


# (scheme, block, arch): transformers' block fp8 with blocks that divide every part (fused
# scales concatenate) and blocks that divide nothing (partial blocks; fused layers go per row),
# per tensor (fused parts with different scales go per channel), AutoFP8's names with a static
# input scale, ue8m0 scales, and compressed-tensors' four strategies; q/k/v bias (qwen2), q/k
# norm and tied embeddings (qwen3)
CASES = [("fp8", (16, 16), "llama"), ("fp8", (24, 40), "llama"), ("fp8-tensor", (0, 0), "llama"),
         ("autofp8", (0, 0), "qwen2"), ("ue8m0", (32, 16), "qwen3"), ("ct-channel", (0, 0), "llama"),
         ("ct-tensor", (0, 0), "qwen3"), ("ct-block", (16, 32), "qwen2"), ("ct-group", (0, 32), "llama")]


@pytest.mark.parametrize("scheme, block, arch", [pytest.param(*c, marks=needs_ct) if c[0] in CT else c
                                                 for c in CASES], ids=[f"{c[0]}-{c[1][0]}x{c[1][1]}-{c[2]}" for c in CASES])
def test_fp8_checkpoint_computes_its_dequantized_weights(scheme, block, arch, tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / f"{arch}-{scheme}"
    reference = write_fp8_checkpoint(tiny_checkpoints[arch], dst, scheme, block)
    packed = make_engine(dst, speculation="off")
    dense = make_engine(reference, speculation="off")
    layers = _linears(packed)
    assert {m.kind for n, m in layers.items() if n != "lm_head"} == {"fp8"}
    assert layers["lm_head"].kind == "dense"  # modules_to_not_convert / ignore: ["lm_head"]
    assert all(m.qweight.dtype == torch.float8_e4m3fn and m.scales.dtype == torch.float32
               for m in layers.values() if m.kind == "fp8")
    assert packed.weight_bytes == model_bytes(packed.model) < dense.weight_bytes
    _same_greedy(packed, dense)
    attn, mlp = packed.model.model.layers[0].self_attn, packed.model.model.layers[0].mlp
    if scheme == "fp8" and block == (16, 16):  # every part fills whole blocks: the scales concatenate
        assert attn.qkv_proj.block == mlp.gate_up_proj.block == (16, 16)
    if scheme == "fp8" and block == (24, 40):  # q_proj's 64 rows are no multiple of 24: per row
        assert attn.qkv_proj.block == (1, 40) and attn.o_proj.block == (24, 40)
    if scheme in ("fp8-tensor", "autofp8", "ct-tensor"):  # per tensor, fused parts per channel
        assert attn.o_proj.block == (attn.o_proj.out_features, attn.o_proj.in_features)
        assert attn.qkv_proj.block == (1, attn.qkv_proj.in_features)


@pytest.mark.parametrize("scheme", _schemes("fp8", "ct-channel"))
def test_fp8_moe_experts_load_dequantized(scheme, tiny_checkpoints, make_engine, tmp_path):
    """Qwen3-MoE FP8 checkpoints store each expert's layers in fp8 with their scales: the dense
    layers keep their codes, the experts (which the fused-MoE kernels read in float, int8, int4
    or MXFP4, not fp8) load dequantized, and the model computes the dequantized weights."""
    dst = tmp_path / f"moe-{scheme}"
    reference = write_fp8_checkpoint(tiny_checkpoints["qwen3_moe"], dst, scheme, (16, 16))
    packed = make_engine(dst, speculation="off")
    dense = make_engine(reference, speculation="off")
    assert {m.kind for n, m in _linears(packed).items() if n != "lm_head"} == {"fp8"}
    assert {m.experts_kind for m in packed.model.modules() if hasattr(m, "experts_kind")} == {"dense"}
    _same_greedy(packed, dense)


@pytest.mark.parametrize("scheme", _schemes("fp8", "ct-channel"))
def test_an_fp8_output_head_loads_too(scheme, tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / scheme
    reference = write_fp8_checkpoint(tiny_checkpoints["llama"], dst, scheme, quantize_head=True)
    packed = make_engine(dst, speculation="off")
    assert packed.model.lm_head.kind == "fp8"
    _same_greedy(packed, make_engine(reference, speculation="off"), prompts=1)


def test_model_bytes_count_the_fp8_codes_and_scales(tiny_checkpoints, make_engine, tmp_path):
    write_fp8_checkpoint(tiny_checkpoints["llama"], tmp_path / "fp8", "fp8", (16, 16))
    packed = make_engine(tmp_path / "fp8", speculation="off")
    plain = make_engine(tiny_checkpoints["llama"], speculation="off")
    fp8_layers = [m for m in _linears(packed).values() if m.kind == "fp8"]
    codes = sum(m.qweight.numel() for m in fp8_layers)
    scales = sum(m.scales.numel() for m in fp8_layers)
    assert scales == codes // 256  # one float32 per 16x16 block
    assert packed.weight_bytes == plain.weight_bytes - 4 * codes + codes + 4 * scales


def test_state_files_refuse_the_dequantized_model(tiny_checkpoints, make_engine, tmp_path):
    """The fingerprint covers config.json (with its quantization_config) and the safetensors
    headers (fp8 dtypes, scale shapes): a state saved under the fp8 model is refused by the
    float model of the same weights, and read by the fp8 model again."""
    dst = tmp_path / "fp8"
    reference = write_fp8_checkpoint(tiny_checkpoints["qwen2"], dst, "fp8", (16, 16))
    packed, dense = make_engine(dst, speculation="off"), make_engine(reference, speculation="off")
    assert packed.fingerprint != dense.fingerprint
    h = packed.open_state("a")
    h.generate(greedy(4), prompt=random_tokens(random.Random(1), 30))
    h.save(tmp_path / "fp8.hibana")
    with pytest.raises(StateFileError):
        dense.load_state(tmp_path / "fp8.hibana")
    again = make_engine(dst, speculation="off")
    assert again.load_state(tmp_path / "fp8.hibana").tokens == h.tokens


def test_weight_surgery_on_an_fp8_checkpoint_is_refused_kv8_is_not(tiny_checkpoints, make_engine, tmp_path):
    write_fp8_checkpoint(tiny_checkpoints["llama"], tmp_path / "fp8", "fp8", (16, 16))
    for surgery in ("w8", "w4"):
        with pytest.raises(ConfigError, match=rf"{surgery} on an FP8 checkpoint.*already 8-bit"):
            make_engine(tmp_path / "fp8", surgery=[surgery], surgery_guard=False)
    kv8 = make_engine(tmp_path / "fp8", surgery=["kv8"], surgery_guard=False, speculation="off")
    assert {m.kind for n, m in _linears(kv8).items() if n != "lm_head"} == {"fp8"}
    assert len(kv8.open_state("a").generate(greedy(4), prompt=random_tokens(random.Random(2), 20)).token_ids) == 4


def test_an_fp8_checkpoint_passes_through_hibana_surgery(tiny_checkpoints, make_engine, tmp_path):
    """Written back by `hibana surgery` (fp8 buffers and their blocks in the manifest), loaded again."""
    from hibana_core.surgery import checkpoint

    dst = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_checkpoints["llama"], dst, "fp8", (24, 40))
    original = make_engine(dst, speculation="off")
    checkpoint.save(original, dst, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / checkpoint.MANIFEST).read_text())
    assert manifest["packed_layers"]["model.layers.0.self_attn.qkv_proj"] == {"kind": "fp8", "group_size": 0,
                                                                              "block": [1, 40]}
    again = make_engine(tmp_path / "out", speculation="off")
    assert again.model.model.layers[0].self_attn.o_proj.block == (24, 40)
    _same_greedy(again, original, prompts=1)


# ------------------------------------------------------------------------- layers and fusing


@pytest.mark.parametrize("n, k, block", [(48, 64, (16, 32)), (40, 72, (16, 32)), (24, 40, (128, 128))])
def test_fp8_layers_dequantize_as_transformers_does(n, k, block):
    """Hibana's reading of a FineGrainedFP8 layer equals transformers' own dequantization."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    codes, scales, _ = quantize(w, block)
    ours = dequantize_fp8(*fp8.read_layer(codes, scales, block, "layer"), torch.float32)
    try:
        theirs = finegrained._dequantize_fp8_weight(codes, scales, list(block), torch.float32)
    except (AttributeError, TypeError):
        pytest.skip("this transformers version has no _dequantize_fp8_weight(weight, scale, block, dtype)")
    assert torch.equal(ours, theirs)
    one, _, _ = quantize(w, (n, k))
    scalar = scales.flatten()[:1].reshape(())  # per tensor: transformers' block_size None
    assert torch.equal(dequantize_fp8(*fp8.read_layer(one, scalar, (0, 0), "layer"), torch.float32),
                       finegrained._dequantize_fp8_weight(one, scalar, None, torch.float32))


@needs_ct
@pytest.mark.parametrize("strategy, block", [("channel", (1, 0)), ("tensor", (0, 0)), ("block", (16, 32)),
                                             ("group", (1, 16))])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_layers_dequantize_as_compressed_tensors_does(strategy, block, scale_dtype):
    """... and equals compressed-tensors' own `dequantize` (bf16 scales: the library computes in
    bf16, Hibana in float32 rounded once, which is the same for e4m3 codes times bf16 scales)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    n, k = 40, 80
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))
    codes, scales, _ = quantize(w, (block[0] or n, block[1] or k), scale_dtype)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                            group_size=block[1] if strategy == "group" else None,
                            block_structure=list(block) if strategy == "block" else None)
    theirs = dequantize(codes, scales.reshape(1) if strategy == "tensor" else scales, args=args)
    ours = dequantize_fp8(*fp8.read_layer(codes, scales, block, "layer"), scale_dtype)
    assert theirs.dtype == scale_dtype and torch.equal(ours, theirs)


def test_ue8m0_scales_stored_as_bytes_read_as_powers_of_two():
    """transformers' MXFP8 checkpoints store ue8m0 scales as uint8 exponents (2^(byte - 127))."""
    codes, scales, dequantized = quantize(torch.randn(32, 48, generator=torch.Generator().manual_seed(2)),
                                          (16, 16), torch.float8_e8m0fnu)
    as_bytes = scales.view(torch.uint8).clone()
    assert torch.equal(dequantize_fp8(*fp8.read_layer(codes, as_bytes, (16, 16), "layer"), torch.float32), dequantized)
    as_bytes[0, 0] = 255  # e8m0's NaN
    with pytest.raises(CheckpointError, match="not finite"):
        fp8.read_layer(codes, as_bytes, (16, 16), "layer")


def test_fused_layers_concatenate_or_go_per_row():
    gen = torch.Generator().manual_seed(0)
    k = 48

    def part(n, block):
        codes, scales, _ = quantize(torch.randn(n, k, generator=gen), (block[0] or n, block[1] or k))
        return fp8.read_layer(codes, scales if block != (0, 0) else scales.reshape(()), block, "part")

    def dequantized(w):
        return dequantize_fp8(w.qweight, w.scales, w.block, torch.float32)

    for parts, block in [([part(32, (16, 16)), part(16, (16, 16)), part(20, (16, 16))], (16, 16)),  # last partial
                         ([part(24, (16, 16)), part(16, (16, 16))], (1, 16)),  # first part ends mid-block
                         ([part(24, (0, 0)), part(8, (0, 0))], (1, k)),  # per tensor, two scales
                         ([part(16, (16, 16)), part(16, (1, 24))], (1, 8)),  # widths 16 and 24: per row of 8
                         ([part(16, (8, 0)), part(8, (8, 0))], (8, k))]:
        fused = fp8.fuse(parts)
        assert fused.block == block
        assert torch.equal(dequantized(fused), torch.cat([dequantized(p) for p in parts]))


# ------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("cfg, words", [
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3 weights only"),
    ({"quant_method": "fp8", "scale_fmt": "nvfp4"}, "scale_fmt"),
    ({"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]}, "fp8 embeddings"),
    ({"quant_method": "fp8", "expert_dtype": "fp4"}, "fp4 experts"),
    ({"quant_method": "fp8", "kv_cache_scheme": "static"}, "KV cache"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "two positive integers"),
])
def test_unsupported_fp8_configs_are_refused(cfg, words):
    with pytest.raises(CheckpointError, match=words):
        parse_quantization_config(cfg)


def _ct(weights=None, inputs="token", outputs=None, fmt="float-quantized", **extra):
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel", **(weights or {})}
    i = None if inputs is None else {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                     "strategy": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": i,
                                          "output_activations": outputs}}, "ignore": ["lm_head"], **extra}


@needs_ct
def test_compressed_tensors_fp8_configs():
    for weights, block in [({}, (1, 0)), ({"strategy": "tensor"}, (0, 0)),
                           ({"strategy": "block", "block_structure": [64, 128]}, (64, 128)),
                           ({"strategy": "group", "group_size": 128}, (1, 128))]:
        fmt = parse_quantization_config(_ct(weights))
        assert (fmt.kind, fmt.block) == ("fp8", block)
        assert fmt.is_quantized("model.layers.0.mlp.down_proj") and not fmt.is_quantized("lm_head")
    assert parse_quantization_config(_ct(inputs=None, fmt="naive-quantized")).kind == "fp8"


@needs_ct
@pytest.mark.parametrize("cfg, words", [
    (_ct({"symmetric": False}), "asymmetric"),
    (_ct({"dynamic": True}), "dynamic"),
    (_ct({"strategy": "tensor_group", "group_size": 16}), "strategy 'tensor_group'"),
    (_ct(fmt="pack-quantized"), "'float-quantized'"),
    (_ct(outputs={"num_bits": 8, "type": "float", "strategy": "tensor"}), "output activations"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "KV cache"),
    ({**_ct(), "config_groups": {"weights_only": {"targets": ["re:.*mlp.*"], "input_activations": None,
                                                  "format": "pack-quantized",
                                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                              "strategy": "group", "group_size": 32}},
                                 "fp8": {**_ct()["config_groups"]["group_0"], "targets": ["re:.*self_attn.*"],
                                         "format": "float-quantized"}}, "format": "mixed-precision"}, "one scheme"),
    ({**_ct(), "config_groups": {"acts_only": {"targets": ["Linear"], "weights": None,
                                               "input_activations": {"num_bits": 8, "type": "float"}}}},
     "not supported"),
])
def test_unsupported_compressed_tensors_fp8_configs_are_refused(cfg, words):
    with pytest.raises(CheckpointError, match=words):
        parse_quantization_config(cfg)


def _edit(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                         t["model.layers.0.mlp.down_proj.weight"].float().to(torch.float8_e5m2)}), "e5m2"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale_inv":
                         t["model.layers.0.mlp.down_proj.weight_scale_inv"][:, :1]}), r"down_proj: weight scale has shape"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale":
                         t["model.layers.0.mlp.down_proj.weight_scale_inv"].clone()}), "both weight_scale_inv and weight_scale"),
    (lambda t: t["model.layers.1.self_attn.o_proj.weight_scale_inv"].fill_(float("inf")), "not finite"),
    (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale_inv"), "only some are fp8"),
    (lambda t: t.pop("model.layers.0.mlp.down_proj.weight_scale_inv"), r"down_proj.weight .*float8_e4m3fn without a weight scale"),
    (lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}), "KV cache"),
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.weight"), "q_proj has a weight_scale_inv but no weight"),
    (lambda t: t.update({p: t[p][:, :48 // (16 if p.endswith("inv") else 1)].contiguous() for p in
                         ("model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.v_proj.weight_scale_inv")}),
     r"have shapes \[\(64, 64\), \(32, 64\), \(32, 48\)\].*config and weights disagree"),
])
def test_damaged_or_unsupported_fp8_layers_are_refused(change, words, tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_checkpoints["llama"], dst, "fp8", (16, 16))
    _edit(dst, change)
    with pytest.raises(CheckpointError, match=words):
        make_engine(dst)


def test_fp8_weights_without_a_quantization_config_are_refused(tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_checkpoints["llama"], dst, "fp8", (16, 16))
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="without a weight scale Hibana applies"):
        make_engine(dst)
    shutil.rmtree(dst)
