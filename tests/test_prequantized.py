"""GPTQ and AWQ checkpoints load as they are: tiny packed checkpoints written here with the real
packing layouts (packers written from the formats' conventions, independent of the loader's
unpackers) must compute what their dequantized float weights compute."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hibana_core import SamplingParams
from hibana_core.errors import CheckpointError
from hibana_core.surgery.formats import AWQ_ORDER, parse_quantization_config
from fp8_checkpoints import write_fp8_checkpoint
from tiny_models import EVERY_TENSOR_USED, make_tiny_gemma3_multimodal, random_tokens

pytestmark = EVERY_TENSOR_USED

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32


def rtn(w: torch.Tensor, groups: torch.Tensor, n_groups: int):
    """Round-to-nearest asymmetric 4-bit of w [N, K] with input k in group groups[k]:
    codes [K, N], zeros [G, N] (integers), scales [G, N] (fp16), and the dequantized w [N, K]."""
    wt = w.t().float()  # [K, N]
    scales = torch.empty(n_groups, w.shape[0])
    zeros = torch.empty(n_groups, w.shape[0])
    for g in range(n_groups):
        rows = wt[groups == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((hi - lo) / 15).clamp(min=1e-4)
        zeros[g] = torch.round(-lo / scales[g]).clamp(0, 15)
    scales = scales.half()
    s, z = scales.float()[groups], zeros[groups]  # per input row
    codes = torch.round(wt / s + z).clamp(0, 15).to(torch.int64)
    return codes, zeros.to(torch.int64), scales, ((codes - z) * s).t()


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """[8R, C] nibbles -> int32 [R, C], value 8i + j in bits 4j (GPTQ's qweight)."""
    v = values.reshape(-1, 8, values.shape[1])
    word = sum(v[:, j] << (4 * j) for j in range(8))
    return word.to(torch.int64).apply_(lambda x: x - (1 << 32) if x >= (1 << 31) else x).to(torch.int32)


def pack_along_cols(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8C] nibbles -> int32 [R, C]; nibble i of word c holds column 8c + order[i]."""
    v = values.reshape(values.shape[0], -1, 8)
    word = sum(v[:, :, order[i]] << (4 * i) for i in range(8))
    return word.to(torch.int64).apply_(lambda x: x - (1 << 32) if x >= (1 << 31) else x).to(torch.int32)


def write_quantized(src, dst, method: str, desc_act: bool = False, v2: bool = False, seed: int = 0,
                    shared_order: bool = True):
    """`src` (a float tiny checkpoint) -> `dst` packed in `method`'s layout; returns the float
    checkpoint with the dequantized weights (what the packed one must compute) in dst.parent."""
    shutil.copytree(src, dst)
    reference = dst.parent / f"{dst.name}-dequantized"
    shutil.copytree(src, reference)
    (dst / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, dict(tensors)
    rng = torch.Generator().manual_seed(seed)
    orders: dict = {}  # layers reading one input share its activation order (GPTQ: one Hessian)
    for name, w in tensors.items():
        if not any(name.endswith(f"{p}.weight") for p in LINEARS):
            quantized[name] = w
            continue
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        n_groups = k // GROUP
        if desc_act:  # groups in a random activation order
            key = (prefix.rpartition(".")[0], k) if shared_order else prefix
            order = orders.setdefault(key, torch.randperm(k, generator=rng))
            groups = torch.empty(k, dtype=torch.long)
            groups[order] = torch.arange(k) // GROUP
        else:
            groups = torch.arange(k) // GROUP
        codes, zeros, scales, deq = rtn(w, groups, n_groups)
        dequantized[name] = deq.to(w.dtype)
        if method == "gptq":
            quantized[f"{prefix}.qweight"] = pack_along_rows(codes)
            quantized[f"{prefix}.qzeros"] = pack_along_cols((zeros - (0 if v2 else 1)) & 0xF)
            quantized[f"{prefix}.g_idx"] = groups.to(torch.int32)
        else:
            quantized[f"{prefix}.qweight"] = pack_along_cols(codes, AWQ_ORDER)
            quantized[f"{prefix}.qzeros"] = pack_along_cols(zeros, AWQ_ORDER)
        quantized[f"{prefix}.scales"] = scales
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(dst / "model.safetensors"))
    (reference / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(reference / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act,
                                         "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                         "version": "gemm", "zero_point": True}
    (dst / "config.json").write_text(json.dumps(config))
    return reference


def greedy(n: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("method, desc_act, v2", [("gptq", False, False), ("gptq", False, True),
                                                  ("gptq", True, False), ("awq", False, False)],
                         ids=["gptq", "gptq_v2", "gptq_desc_act", "awq"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_checkpoint_computes_its_dequantized_weights(method, desc_act, v2, arch, tiny_checkpoints,
                                                            make_engine, tmp_path):
    dst = tmp_path / f"{arch}-{method}"
    reference = write_quantized(tiny_checkpoints[arch], dst, method, desc_act, v2)
    packed = make_engine(dst, speculation="off")
    dense = make_engine(reference, speculation="off")
    kinds = {m.kind for n, m in packed.model.named_modules() if hasattr(m, "set_packed") and not n.endswith("lm_head")}
    assert kinds == {"int4"}
    assert packed.weight_bytes < dense.weight_bytes
    rng = random.Random(1)
    for i in range(3):
        prompt = random_tokens(rng, 25 + 5 * i)
        got = packed.open_state(f"a{i}").generate(greedy(), prompt=prompt)
        want = dense.open_state(f"a{i}").generate(greedy(), prompt=prompt)
        if desc_act:  # inputs summed in another order: equal up to rounding, so compare the first
            assert got.token_ids[0] == want.token_ids[0]
        else:
            assert list(got.token_ids) == list(want.token_ids)


def test_autogptq_zero_biases_beside_packed_layers_load_and_others_are_refused(tiny_checkpoints, make_engine,
                                                                             tmp_path):
    """AutoGPTQ writes an all-zero bias beside every packed layer (TheBloke's exports): they change
    nothing and load without a word (the unused-tensor warning, an error in this suite, stays
    quiet). A bias that is not zero for a layer of ours without one is a CheckpointError: the
    model would need it, and transformers' QuantLinear would apply it."""
    dst = tmp_path / "gptq-bias"
    reference = write_quantized(tiny_checkpoints["llama"], dst, "gptq")
    tensors = load_file(dst / "model.safetensors")
    biases = {k.replace(".qweight", ".bias"): torch.zeros(v.shape[1], dtype=torch.float16)
              for k, v in tensors.items() if k.endswith(".qweight")}
    save_file({**tensors, **biases}, dst / "model.safetensors", metadata={"format": "pt"})
    prompt = random_tokens(random.Random(2), 30)
    want = make_engine(reference, speculation="off").open_state("a").generate(greedy(), prompt=prompt)
    got = make_engine(dst, speculation="off").open_state("a").generate(greedy(), prompt=prompt)
    assert list(got.token_ids) == list(want.token_ids)
    name = next(iter(sorted(biases)))
    save_file({**tensors, **biases, name: torch.full_like(biases[name], 0.5)}, dst / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')} is not zero.*has no bias"):
        make_engine(dst)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_a_multimodal_gemma3_checkpoint_loads_its_quantized_language_model(method, make_engine, tmp_path):
    """Quantized Gemma 3 checkpoints of 4B and up are multimodal (language_model.model.* beside a
    vision tower): their packed layers were looked up under the checkpoint's names, which the
    model's are not, and the load failed saying the config did not name them packed."""
    src = make_tiny_gemma3_multimodal(tmp_path / "gemma3-mm")
    dst = tmp_path / f"gemma3-mm-{method}"
    reference = (write_fp8_checkpoint(src, dst, "fp8", (16, 16)) if method == "fp8"
                 else write_quantized(src, dst, method))
    packed = make_engine(dst, speculation="off")
    dense = make_engine(reference, speculation="off")
    kinds = {m.kind for n, m in packed.model.named_modules() if hasattr(m, "set_packed") and not n.endswith("lm_head")}
    assert kinds == {"int4" if method != "fp8" else "fp8"}
    prompt = random_tokens(random.Random(5), 30)
    assert list(packed.open_state("a").generate(greedy(), prompt=prompt).token_ids) == \
        list(dense.open_state("a").generate(greedy(), prompt=prompt).token_ids)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_moe_experts_load_as_int4_stacks(method, tiny_checkpoints, make_engine, tmp_path):
    """GPTQ / AWQ MoE checkpoints (Qwen3-MoE's) store each expert's layers packed; they load into
    the int4 expert stacks the fused-MoE kernels read, and compute the dequantized experts."""
    dst = tmp_path / f"moe-{method}"
    reference = write_quantized(tiny_checkpoints["qwen3_moe"], dst, method)
    packed = make_engine(dst, speculation="off")
    dense = make_engine(reference, speculation="off")
    assert {m.experts_kind for m in packed.model.modules() if hasattr(m, "experts_kind")} == {"int4"}
    rng = random.Random(2)
    for i in range(2):
        prompt = random_tokens(rng, 30 + 7 * i)
        got = packed.open_state(f"a{i}").generate(greedy(), prompt=prompt)
        want = dense.open_state(f"a{i}").generate(greedy(), prompt=prompt)
        assert list(got.token_ids) == list(want.token_ids)


def test_moe_experts_in_activation_order_are_refused(tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / "moe-desc-act"
    write_quantized(tiny_checkpoints["qwen3_moe"], dst, "gptq", desc_act=True)
    with pytest.raises(CheckpointError, match="experts of .* activation order"):
        make_engine(dst, speculation="off")


def test_an_unsupported_quantization_config_says_what_loads(tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / "bnb"
    shutil.copytree(tiny_checkpoints["llama"], dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'bitsandbytes'.*supported: GPTQ"):
        make_engine(dst)
    assert parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                                      "zero_point": True}).method == "awq"
    # AutoAWQ's own key names (its quant_config.json's) mean what transformers' do
    autoawq = parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "version": "GEMM",
                                         "zero_point": True})
    assert (autoawq.method, autoawq.group_size) == ("awq", 32)
    with pytest.raises(CheckpointError, match="bits=8"):
        parse_quantization_config({"quant_method": "awq", "w_bit": 8, "q_group_size": 32})
    # GPTQ's config says its bits (transformers' GPTQConfig has no default), and its flags are booleans
    with pytest.raises(CheckpointError, match="GPTQ quantization_config has no bits"):
        parse_quantization_config({"quant_method": "gptq", "group_size": 32})
    with pytest.raises(CheckpointError, match="desc_act = 'yes', where true or false belongs"):
        parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": "yes"})
    # its lists and overrides of the wrong shape: said so, not "'int' object is not iterable" (an outside audit)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    for key, bad in [("dynamic", {"+:.*mlp.*": 5}), ("dynamic", ["x"]), ("modules_in_block_to_quantize", 5),
                     ("modules_in_block_to_quantize", [[1]]), ("modules_to_not_convert", 5)]:
        with pytest.raises(CheckpointError, match=f"{key}"):
            parse_quantization_config({**gptq, key: bad})
    # a quantization_config that is no object: said so, not transformers' "'list' object has no attribute"
    for bad in ([1], "gptq", 4):
        config["quantization_config"] = bad
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=f"quantization_config is a JSON {type(bad).__name__}, not an object"):
            make_engine(dst)


def test_packed_layers_without_a_quantization_config_say_so(tiny_checkpoints, make_engine, tmp_path):
    """Older AutoGPTQ checkpoints keep their config in quantize_config.json; without a
    quantization_config in config.json the packed layers were reported as missing weights."""
    dst = tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], dst, "gptq")
    config = json.loads((dst / "config.json").read_text())
    (dst / "quantize_config.json").write_text(json.dumps(config.pop("quantization_config")))
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"packed quantized layers .*qweight.* no quantization_config.*"
                                              r"its quantize_config.json holds"):
        make_engine(dst)


def test_a_quantized_moe_router_is_refused_by_name(tiny_checkpoints, make_engine, tmp_path):
    """A router stored packed (its qweight, no weight) was reported as a missing weight of an
    incomplete checkpoint; Hibana packs decoder linears only, and says so."""
    dst = tmp_path / "moe-gptq"
    write_quantized(tiny_checkpoints["qwen3_moe"], dst, "gptq")
    tensors = load_file(str(dst / "model.safetensors"))
    router = "model.layers.0.mlp.gate"
    w = tensors.pop(f"{router}.weight")  # [experts, hidden]
    groups = torch.arange(w.shape[1]) // GROUP
    codes, zeros, scales, _ = rtn(w, groups, w.shape[1] // GROUP)
    tensors.update({f"{router}.qweight": pack_along_rows(codes), f"{router}.qzeros": pack_along_cols((zeros - 1) & 0xF),
                    f"{router}.scales": scales, f"{router}.g_idx": groups.to(torch.int32)})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"stores {router} packed .*a MoE router"):
        make_engine(dst)


def test_a_damaged_packed_layer_is_a_checkpoint_error(tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], dst, "gptq")
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.scales"] = tensors["model.layers.0.mlp.down_proj.scales"][:, :-8]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"down_proj"):
        make_engine(dst)
    del tensors["model.layers.0.mlp.down_proj.scales"]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks tensor\(s\) \['scales'\]"):
        make_engine(dst)


@pytest.mark.parametrize("says", [{"modules_to_not_convert": ["model.layers.0.self_attn"]}, {"dynamic": {"-:.*mlp\\.down_proj": {}}}],
                         ids=["not-convert", "dynamic-skip"])
def test_packed_layers_the_config_says_are_not_quantized_are_refused(tiny_checkpoints, make_engine, tmp_path, says):
    """Config and weights disagree: the config keeps some layers in 16 bits and the checkpoint holds them
    packed (they loaded packed, unnoticed: an outside audit; vLLM builds those layers unquantized)."""
    dst = tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], dst, "gptq")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(says)
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"stored packed, and the quantization_config says it is not quantized"):
        make_engine(dst)


def test_fused_layers_quantized_in_different_orders_are_refused(tiny_checkpoints, make_engine, tmp_path):
    dst = tmp_path / "gptq"
    write_quantized(tiny_checkpoints["llama"], dst, "gptq", desc_act=True, shared_order=False)
    with pytest.raises(CheckpointError, match=r"q_proj, .*k_proj, .*v_proj are quantized with different"):
        make_engine(dst)


def test_a_gptq_checkpoint_passes_through_hibana_surgery(tiny_checkpoints, make_engine, tmp_path):
    """Loaded (activation order and all), rewritten to disk by `hibana surgery`, loaded again."""
    from hibana_core.surgery import checkpoint

    dst = tmp_path / "gptq"
    write_quantized(tiny_checkpoints["qwen3"], dst, "gptq", desc_act=True)
    original = make_engine(dst, speculation="off")
    out = tmp_path / "out"
    checkpoint.save(original, dst, out)
    again = make_engine(out, speculation="off")
    prompt = random_tokens(random.Random(4), 30)
    assert list(again.open_state("a").generate(greedy(), prompt=prompt).token_ids) == \
        list(original.open_state("a").generate(greedy(), prompt=prompt).token_ids)
    assert again.model.model.layers[0].mlp.gate_up_proj.perm is not None
