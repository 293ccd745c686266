"""Pre-quantized checkpoint formats (hibana_core/surgery/formats.py): GPTQ, AWQ and
compressed-tensors layers repacked into Hibana's int4 layout must dequantize to exactly the weight
each format defines, w = (q - z) * s.

GPTQ and AWQ tensors are packed here by packers written from each format's documented convention
(independent of the unpacker under test); compressed-tensors tensors are packed by that library's
own `pack_to_int32`, and its own decompressor is the oracle for one end-to-end check.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from hibana_core.errors import CheckpointError
from hibana_core.surgery.formats import QuantFormat, parse_quantization_config, repack_layer
from hibana_kernels.quant import dequantize_int4, linear_int4

HAS_CT = importlib.util.find_spec("compressed_tensors") is not None
needs_ct = pytest.mark.skipif(not HAS_CT, reason="compressed-tensors not installed (pip install hibana[quant])")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm.py order_map: nibble i holds column 8c + ORDER[i]
# (out_features N, in_features K, group size): odd multiples, one group per row, group == K
SHAPES = [(24, 40, 8), (40, 96, 32), (8, 64, -1), (56, 128, 128), (16, 48, 16)]


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values in [0, 15], nibble i -> bits 4i..4i+3 of an int32 (two's complement)."""
    v = sum(nibbles[..., i].long() << (4 * i) for i in range(8))
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def _layer(n, k, g, seed, stored_zero_max=15):
    """Random codes [N, K], stored zero nibbles [groups, N], fp16 scales [groups, N]."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if g == -1 else -(-k // g)  # a partial last group when g does not divide k
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, stored_zero_max + 1, (groups, n), generator=gen)
    z[0, 0] = stored_zero_max  # GPTQ v1's nibble 15 means zero 16
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    return q, z, s


def _reference(q, zero, s, g_idx):
    """w[n, k] = (q[n, k] - zero[g_idx[k], n]) * s[g_idx[k], n] in float32."""
    return (q.float() - zero.float()[g_idx].T) * s.float()[g_idx].T


def _g_idx(k, g):
    return torch.arange(k) // (k if g == -1 else g)


def _pack_gptq(q, z_stored, s, g_idx=None):
    k, n = q.shape[1], q.shape[0]
    qweight = _words(q.T.reshape(k // 8, 8, n).permute(0, 2, 1))  # word (r, n) nibble i = q[n, 8r+i]
    qzeros = _words(z_stored.reshape(z_stored.shape[0], n // 8, 8))  # word (g, c) nibble i = z[g, 8c+i]
    t = {"qweight": qweight, "qzeros": qzeros, "scales": s}
    if g_idx is not None:
        t["g_idx"] = g_idx.to(torch.int32)
    return t


def _pack_awq(q, z, s):
    k, n = q.shape[1], q.shape[0]
    order = torch.tensor(AWQ_ORDER)

    def pack(cols):  # [rows, N] -> [rows, N/8]: word c nibble i = cols[:, 8c + ORDER[i]]
        return _words(cols.reshape(cols.shape[0], n // 8, 8)[..., order])

    return {"qweight": pack(q.T), "qzeros": pack(z), "scales": s}


def _dequant(w):
    return dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size, torch.float32)


@pytest.mark.parametrize("checkpoint_format,offset", [("gptq", 1), ("gptq_v2", 0)])
@pytest.mark.parametrize("n,k,g", SHAPES)
def test_gptq_exact(n, k, g, checkpoint_format, offset):
    fmt = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False,
                                     "sym": False, "checkpoint_format": checkpoint_format})
    q, z, s = _layer(n, k, g, seed=n + k)
    g_idx = _g_idx(k, g)
    w = repack_layer(fmt, _pack_gptq(q, z, s, g_idx))
    assert w.perm is None and w.qweight.dtype == torch.uint8 and w.qweight.shape == (n, k // 2)
    assert w.scales.dtype == w.zeros.dtype == torch.float16
    assert torch.equal(_dequant(w), _reference(q, z + offset, s, g_idx))
    if offset:
        assert w.zeros.max().item() == 16  # a stored 15 is zero 16, as AutoGPTQ's `zeros + 1` computes


@pytest.mark.parametrize("n,k,g", [(24, 64, 8), (40, 96, 32), (16, 256, 64)])
def test_gptq_desc_act_permutes_input(n, k, g):
    fmt = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": True})
    q, z, s = _layer(n, k, g, seed=k)
    g_idx = _g_idx(k, g)[torch.randperm(k, generator=torch.Generator().manual_seed(1))]  # act-order
    ref = _reference(q, z + 1, s, g_idx)  # [N, K] in checkpoint column order
    w = repack_layer(fmt, _pack_gptq(q, z, s, g_idx))
    assert w.perm is not None and sorted(w.perm.tolist()) == list(range(k))
    assert torch.equal(_dequant(w), ref[:, w.perm])
    x = torch.randn(3, k)
    out = linear_int4(x[..., w.perm], w.qweight, w.scales, w.zeros, w.group_size)
    torch.testing.assert_close(out, x @ ref.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,g,desc_act", [(16, 40, 16, False), (8, 64, 128, False), (24, 96, 64, False),
                                             (16, 40, 16, True), (24, 96, 64, True)])
def test_gptq_partial_last_group(n, k, g, desc_act):
    """GPTQ gives the K % G inputs left their own last group (ceil(K / G) groups: hidden 64 with
    group 128 is one group of 64); the repack splits groups equally and keeps w exactly."""
    fmt = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": desc_act})
    q, z, s = _layer(n, k, g, seed=k + g)
    g_idx = _g_idx(k, g)
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(2))]
    ref = _reference(q, z + 1, s, g_idx)
    w = repack_layer(fmt, _pack_gptq(q, z, s, g_idx))
    assert k % w.group_size == 0
    assert torch.equal(_dequant(w), ref if w.perm is None else ref[:, w.perm])
    assert (w.perm is not None) == desc_act


@pytest.mark.parametrize("method,config", [
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True}),
    ("compressed-tensors", None),
])
def test_act_order_without_g_idx_is_refused(method, config):
    """Without g_idx the groups of an act-order layer's columns are unknown: loading it as if they
    were contiguous would compute garbage."""
    if method == "gptq":
        q, z, s = _layer(16, 64, 16, seed=0)
        t = _pack_gptq(q, z, s)  # no g_idx
    else:
        pytest.importorskip("compressed_tensors")
        config = _ct_config(True, group_size=8)
        config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
        t, _ = _ct_layer(24, 40, 8, symmetric=True, seed=1)
        t.pop("weight_g_idx", None)
    with pytest.raises(CheckpointError, match="activation order.*g_idx"):
        repack_layer(parse_quantization_config(config), t, name="model.layers.0.mlp.up_proj")


def test_gptq_int32_pack_dtype_is_read():
    for pack_dtype in ("int32", "torch.int32", None):
        assert parse_quantization_config({"quant_method": "gptq", "bits": 4, "pack_dtype": pack_dtype}).method == "gptq"


def test_gptq_desc_act_with_trivial_g_idx_needs_no_perm():
    fmt = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True})
    q, z, s = _layer(16, 64, 16, seed=3)
    assert repack_layer(fmt, _pack_gptq(q, z, s, _g_idx(64, 16))).perm is None


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_awq_exact(n, k, g):
    fmt = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": None})
    q, z, s = _layer(n, k, g, seed=2 * n + k)
    w = repack_layer(fmt, _pack_awq(q, z, s))
    assert w.perm is None
    assert torch.equal(_dequant(w), _reference(q, z, s, _g_idx(k, g)))


def _ct_config(symmetric, strategy="group", group_size=8, num_bits=4, fmt="pack-quantized", **extra):
    weights = {"num_bits": num_bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size if strategy == "group" else None, "actorder": None, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$"], **extra}


def _ct_layer(n, k, g, symmetric, seed):
    """Signed codes q in [-8, 7] [N, K], zero points [N, groups] (0 if symmetric), bf16 scales."""
    from compressed_tensors.compressors import pack_to_int32

    gen = torch.Generator().manual_seed(seed)
    groups = k // g
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    zp = torch.randint(-8, 8, (n, groups), generator=gen, dtype=torch.int8) if not symmetric \
        else torch.zeros(n, groups, dtype=torch.int8)
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).bfloat16()  # llm-compressor's usual dtype
    t = {"weight_packed": pack_to_int32(q, 4), "weight_scale": s, "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        t["weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
    ref = (q.float() - zp.float().repeat_interleave(g, 1)) * s.float().repeat_interleave(g, 1)
    return t, ref


@needs_ct
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,g", [(20, 36, 12), (24, 40, 8), (40, 96, 32), (8, 128, 128)])
def test_compressed_tensors_exact(n, k, g, symmetric):
    fmt = parse_quantization_config(_ct_config(symmetric, group_size=g))
    t, ref = _ct_layer(n, k, g, symmetric, seed=n * k)
    w = repack_layer(fmt, t)
    assert w.perm is None and w.group_size == g
    assert torch.equal(_dequant(w), ref)  # bf16 scales are exact in fp16 at these magnitudes


@needs_ct
def test_compressed_tensors_channel_strategy():
    fmt = parse_quantization_config(_ct_config(False, strategy="channel"))
    assert fmt.group_size == -1
    t, ref = _ct_layer(24, 40, 40, symmetric=False, seed=5)
    assert torch.equal(_dequant(repack_layer(fmt, t)), ref)


@needs_ct
def test_compressed_tensors_matches_its_own_decompressor():
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt = parse_quantization_config(_ct_config(False, group_size=16))
    t, _ = _ct_layer(32, 80, 16, symmetric=False, seed=9)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, symmetric=False, strategy="group", group_size=16))
    try:
        oracle = PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]
    except TypeError:  # the classmethod API of compressed-tensors >= 0.15; older ones differ
        pytest.skip("this compressed-tensors version has another decompress signature")
    torch.testing.assert_close(_dequant(repack_layer(fmt, t)), oracle.float(), rtol=1e-2, atol=1e-4)


@needs_ct
def test_compressed_tensors_act_order_g_idx():
    fmt = parse_quantization_config(_ct_config(True, group_size=8))
    t, ref = _ct_layer(16, 64, 8, symmetric=True, seed=11)
    # with a shuffled g_idx, column k belongs to group g_idx[k]: rebuild the reference that way
    g_idx = _g_idx(64, 8)[torch.randperm(64, generator=torch.Generator().manual_seed(2))]
    t["weight_g_idx"] = g_idx.to(torch.int32)
    from compressed_tensors.compressors import unpack_from_int32
    q = unpack_from_int32(t["weight_packed"], 4, torch.Size((16, 64))).float()
    ref = q * t["weight_scale"].float()[:, g_idx]
    w = repack_layer(fmt, t)
    assert torch.equal(_dequant(w), ref[:, w.perm])
    t["weight_g_idx"] = torch.full((64,), -1, dtype=torch.int32)  # never set: column order
    assert repack_layer(fmt, t).perm is None


# ------------------------------------------------------------------------- which modules


def test_which_modules_are_quantized():
    gptq = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                      "modules_to_not_convert": ["model.layers.1", "gate"],
                                      "dynamic": {"-:.*\\.mlp\\.down_proj": {}}})
    assert gptq.is_quantized("model.layers.0.self_attn.q_proj")
    assert not gptq.is_quantized("lm_head")
    assert not gptq.is_quantized("model.layers.1.self_attn.q_proj")
    assert gptq.is_quantized("model.layers.11.self_attn.q_proj")  # a prefix stops at a module boundary
    assert not gptq.is_quantized("model.layers.3.mlp.gate")
    assert not gptq.is_quantized("model.layers.0.mlp.down_proj")
    assert parse_quantization_config({"quant_method": "gptq", "bits": 4, "lm_head": True}).is_quantized("lm_head")
    only = parse_quantization_config({"quant_method": "gptq", "bits": 4,
                                      "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.up_proj"]]})
    assert only.is_quantized("model.layers.2.mlp.up_proj") and not only.is_quantized("model.layers.2.mlp.down_proj")
    assert not only.is_quantized("lm_head")
    head = parse_quantization_config({"quant_method": "gptq", "bits": 4, "lm_head": True,
                                      "modules_in_block_to_quantize": [["mlp.up_proj"]]})
    assert head.is_quantized("lm_head") and not head.is_quantized("model.layers.0.mlp.gate_proj")
    awq = parse_quantization_config({"quant_method": "awq", "bits": 4, "version": "GEMM"})
    assert awq.is_quantized("model.layers.0.mlp.down_proj") and not awq.is_quantized("lm_head")
    same = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 64,
                                      "dynamic": {"+:.*down_proj": {"bits": 4, "group_size": 64}}})
    assert same.is_quantized("model.layers.0.mlp.down_proj")  # an override that changes nothing
    assert gptq.tensor_names == ("qweight", "qzeros", "scales", "g_idx")


@needs_ct
def test_compressed_tensors_targets_and_ignore():
    fmt = parse_quantization_config(_ct_config(True))
    assert fmt.is_quantized("model.layers.0.self_attn.o_proj")
    assert not fmt.is_quantized("lm_head") and not fmt.is_quantized("model.layers.4.mlp.gate")
    cfg = _ct_config(True, ignore=[])
    cfg["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    narrow = parse_quantization_config(cfg)
    assert narrow.is_quantized("model.layers.0.self_attn.k_proj")
    assert not narrow.is_quantized("model.layers.0.mlp.up_proj")


# ------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("cfg,words", [
    ({"quant_method": "bitsandbytes"}, "gptq"),
    ({"bits": 4}, "supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "gptq", "bits": 3}, "4-bit"),
    ({"quant_method": "gptq", "bits": "4"}, "bits='4'"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype 'int16'"),  # was "qweight is int16: damaged"  # a string, named as one (not "bits=4: 4-bit only")
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "gptq_v2"),
    # old AutoGPTQ's marlin checkpoints (tensors B, s): a flag, not checkpoint_format; they were reported
    # as lacking every q_proj.weight, "incomplete or for another architecture"
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "checkpoint_format 'marlin' is packed for one kernel"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 7}, "even"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down": {"bits": 8}}}, "own bits"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemm'"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "'gemm'"),
    ({"quant_method": "awq", "bits": 4, "version": "marlin"}, "'gemm'"),
    ({"quant_method": "awq", "bits": 4, "backend": "llm-awq"}, "'gemm'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
    ({"quant_method": "awq", "bits": 8}, "4-bit"),
])
def test_unsupported_configs_are_refused(cfg, words):
    with pytest.raises(CheckpointError, match=words):
        parse_quantization_config(cfg)


@needs_ct
@pytest.mark.parametrize("cfg,words", [
    (_ct_config(True, num_bits=8), "int4"),
    (_ct_config(True, fmt="float-quantized"), "pack-quantized"),
    (_ct_config(True, strategy="tensor"), "group or channel"),
    (_ct_config(True, quantization_status="frozen"), "not stored packed"),
    (_ct_config(True, sparsity_config={"format": "sparse-24-bitmask"}), "sparse"),
])
def test_unsupported_compressed_tensors_configs_are_refused(cfg, words):
    with pytest.raises(CheckpointError, match=words):
        parse_quantization_config(cfg)


def test_compressed_tensors_without_the_package(monkeypatch):
    for mod in ("compressed_tensors", "compressed_tensors.quantization", "compressed_tensors.compressors"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(CheckpointError, match="pip install"):
        parse_quantization_config(_ct_config(True))
    with pytest.raises(CheckpointError, match="pip install"):
        repack_layer(QuantFormat("compressed-tensors", 8), {"weight_packed": torch.zeros(8, 1, dtype=torch.int32),
                                                         "weight_scale": torch.ones(8, 1),
                                                         "weight_shape": torch.tensor([8, 8])})


def _gptq_tensors():
    q, z, s = _layer(16, 64, 16, seed=0)
    return _pack_gptq(q, z, s, _g_idx(64, 16))


GPTQ = QuantFormat("gptq", 16, zero_offset=1)


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop("qzeros"), "lacks tensor"),
    (lambda t: t.update(qzeros=t["qzeros"][:, :1]), "qzeros"),
    (lambda t: t.update(scales=t["scales"][:2]), "scales"),
    (lambda t: t.update(qweight=t["qweight"].float()), "int32"),
    (lambda t: t.update(g_idx=torch.zeros(64, dtype=torch.int32)), "exactly 16"),
    (lambda t: t.update(g_idx=torch.zeros(5, dtype=torch.int32)), "g_idx"),
    (lambda t: t.update(scales=t["scales"].float() * 1e7), "not finite"),
    (lambda t: t.update(scales=torch.ones_like(t["scales"], dtype=torch.int32)), "scales is torch.int32, not a float"),
])
def test_malformed_gptq_layers_are_refused(edit, words):
    t = _gptq_tensors()
    edit(t)
    with pytest.raises(CheckpointError, match=words):
        repack_layer(GPTQ, t, name="model.layers.0.mlp.up_proj")


def test_group_count_must_match_the_config():
    t = _gptq_tensors()  # K 64 in groups of 16: 4 groups, where group_size 48 means 2
    with pytest.raises(CheckpointError, match="qzeros"):
        repack_layer(QuantFormat("gptq", 48), t)
    q, z, s = _layer(16, 64, 16, seed=0)
    with pytest.raises(CheckpointError, match="qzeros"):
        repack_layer(QuantFormat("awq", 32), _pack_awq(q, z, s))  # tensors from G=16, config G=32


def test_integer_awq_scales_are_refused():
    """Integer scales were cast to fp16 and loaded: weights off by orders of magnitude, no error."""
    q, z, s = _layer(16, 64, 16, seed=0)
    with pytest.raises(CheckpointError, match="scales is torch.int16, not a float"):
        repack_layer(QuantFormat("awq", 16), _pack_awq(q, z, s.to(torch.int16)))


@needs_ct
def test_malformed_compressed_tensors_layer_is_refused():
    fmt = parse_quantization_config(_ct_config(False, group_size=8))
    t, _ = _ct_layer(24, 40, 8, symmetric=False, seed=1)
    with pytest.raises(CheckpointError, match="weight_scale"):
        repack_layer(fmt, {**t, "weight_scale": t["weight_scale"][:, :2]})
    with pytest.raises(CheckpointError, match="weight_packed"):
        repack_layer(fmt, {**t, "weight_shape": torch.tensor([24, 80])})
    with pytest.raises(CheckpointError, match="weight_zero_point"):
        repack_layer(fmt, {k: v for k, v in t.items() if k != "weight_zero_point"})
