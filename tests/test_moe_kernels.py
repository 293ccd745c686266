"""MoE kernel tests: the references against transformers' own MoE modules (Qwen3-MoE's sparse
block, gpt-oss's MLP, dense and MXFP4) on tiny random configs, tied router logits included; then
the Triton kernels against the references, in test_kernels' interpreter worker (or compiled on
CUDA)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_kernels import interpreter_worker, run_check, thinned  # noqa: F401 - fixtures: one worker for both files
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hibana_kernels import moe
from hibana_kernels.moe import MoEExperts
from hibana_kernels.quant import dequantize_int4

HIDDEN, INTER, EXPERTS = 64, 32, 8


def _random_mxfp4(gen, *shape):
    """(blocks, scales) of random codes with scales around 2^0 (e8m0 127 +- 4)."""
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(123, 132, (*lead, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def _random_int8(gen, *shape, std):
    """(codes int8 [..., N, K], scales float32 [..., N]) of weights about `std`, the scales
    varying per row (codes uniform on [-127, 127]: a standard deviation of about 73)."""
    codes = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    scales = std / 73 * (0.5 + torch.rand(shape[:-1], generator=gen))
    return codes, scales


def _random_int4(gen, *shape, group, std):
    """(packed codes uint8 [..., N, K // 2], scales, zeros float16 [..., N, K // group]) of
    weights about `std` (codes uniform on 0..15: a standard deviation of about 4.6), fractional
    zeros around the middle."""
    *lead, k = shape
    packed = torch.randint(0, 256, (*lead, k // 2), generator=gen, dtype=torch.uint8)
    scales = (std / 4.6 * (0.5 + torch.rand(*lead, k // group, generator=gen))).half()
    zeros = (7.5 + torch.randn(*lead, k // group, generator=gen)).half()
    return packed, scales, zeros


def _tie_router_rows(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Copies expert 1's router row (and bias) onto experts 2, 4 and 6: their logits tie exactly."""
    with torch.no_grad():
        for e in (2, 4, 6):
            weight[e] = weight[1]
            if bias is not None:
                bias[e] = bias[1]


def _qwen3_block(top_k, norm_topk_prob, seed):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                            num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _gpt_oss_mlp(top_k, seed):
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                          num_experts_per_tok=top_k)
    torch.manual_seed(seed)
    mlp = GptOssMLP(config).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)  # gate/up beyond +-7 for a good share: the clamps matter
    return mlp


def _gpt_oss_dense_experts(mlp) -> MoEExperts:
    """GptOssExperts' [E, H, 2I] interleaved gate/up and [E, I, H] down, in w13/w2 layout."""
    ex = mlp.experts
    return MoEExperts("dense", w13=moe.deinterleave_gate_up(ex.gate_up_proj.detach().transpose(1, 2)),
                      w2=ex.down_proj.detach().transpose(1, 2).contiguous(),
                      b13=moe.deinterleave_gate_up(ex.gate_up_proj_bias.detach()),
                      b2=ex.down_proj_bias.detach(), activation="swiglu_oai",
                      swiglu_alpha=ex.alpha, swiglu_limit=ex.limit)


@pytest.mark.parametrize("top_k, norm_topk_prob", [(2, True), (3, False), (8, True)])
@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_reference_matches_qwen3_moe_block(top_k, norm_topk_prob, tied):
    block = _qwen3_block(top_k, norm_topk_prob, seed=top_k)
    if tied:
        _tie_router_rows(block.gate.weight)
    x = torch.randn(1, 11, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x)[0]
        h = x[0]
        weights, ids = moe.moe_route(torch.nn.functional.linear(h, block.gate.weight), top_k,
                                     renormalize=norm_topk_prob)
        experts = MoEExperts("dense", w13=block.experts.gate_up_proj, w2=block.experts.down_proj)
        out = moe.fused_moe(h, experts, weights, ids)
    _, hf_weights, hf_ids = block.gate(h)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    if tied:  # the ties do straddle the top-k boundary somewhere, or the test proves nothing
        assert any(0 < len({1, 2, 4, 6} & set(row)) < 4 for row in ids.tolist()) or top_k == 8
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_reference_matches_gpt_oss_mlp(top_k, tied):
    mlp = _gpt_oss_mlp(top_k, seed=10 + top_k)
    if tied:
        _tie_router_rows(mlp.router.weight, mlp.router.bias)
    x = torch.randn(1, 9, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, _ = mlp(x)
        h = x[0]
        logits = torch.nn.functional.linear(h, mlp.router.weight, mlp.router.bias)
        weights, ids = moe.moe_route(logits, top_k, scoring="topk_softmax")
        out = moe.fused_moe(h, _gpt_oss_dense_experts(mlp), weights, ids)
        _, hf_weights, hf_ids = mlp.router(h)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    # transformers multiplies by [H, 2I] views, the reference by [2I, H] rows: same sums, other order
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mxfp4_dequantize_matches_transformers(dtype):
    blocks, scales = _random_mxfp4(torch.Generator().manual_seed(3), 3, 2 * INTER, HIDDEN)
    ours = moe.mxfp4_dequantize(blocks, scales, dtype)  # [E, 2I, H]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, H, 2I]: transposed
    assert ours.shape == (3, 2 * INTER, HIDDEN) and ours.dtype == dtype
    torch.testing.assert_close(ours.transpose(1, 2), theirs, atol=0, rtol=0)


def test_mxfp4_dequantize_nibble_order_and_scale():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x92  # low nibble 2 (+1.0) is value 0, high nibble 9 (-0.5) is value 1
    out = moe.mxfp4_dequantize(blocks, torch.tensor([129], dtype=torch.uint8), torch.float32)
    assert out.shape == (32,) and out[:3].tolist() == [4.0, -2.0, 0.0]  # times 2^(129 - 127)


def test_reference_matches_gpt_oss_mlp_with_mxfp4_experts():
    """The loader's path: checkpoint blocks de-interleaved and kept packed, against transformers
    running the same checkpoint dequantized."""
    mlp = _gpt_oss_mlp(top_k=2, seed=5)
    gen = torch.Generator().manual_seed(6)
    gate_up = _random_mxfp4(gen, EXPERTS, 2 * INTER, HIDDEN)  # checkpoint order: interleaved rows
    down = _random_mxfp4(gen, EXPERTS, HIDDEN, INTER)
    with torch.no_grad():
        mlp.experts.gate_up_proj.copy_(convert_moe_packed_tensors(*gate_up, dtype=torch.float32))
        mlp.experts.down_proj.copy_(convert_moe_packed_tensors(*down, dtype=torch.float32))
    experts = MoEExperts("mxfp4", w13=moe.deinterleave_gate_up(gate_up[0]), w2=down[0],
                         w13_scales=moe.deinterleave_gate_up(gate_up[1]), w2_scales=down[1],
                         b13=moe.deinterleave_gate_up(mlp.experts.gate_up_proj_bias.detach()),
                         b2=mlp.experts.down_proj_bias.detach(), activation="swiglu_oai")
    x = torch.randn(1, 7, HIDDEN, generator=gen) * 0.1
    with torch.no_grad():
        expected, _ = mlp(x)
        weights, ids = moe.moe_route(torch.nn.functional.linear(x[0], mlp.router.weight, mlp.router.bias),
                                     2, scoring="topk_softmax")
        out = moe.fused_moe(x[0], experts, weights, ids)
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-5)


def test_int8_reference_is_the_dense_reference_on_dequantized_weights():
    gen = torch.Generator().manual_seed(8)
    w13, s13 = _random_int8(gen, 4, 2 * INTER, HIDDEN, std=0.1)
    w2, s2 = _random_int8(gen, 4, HIDDEN, INTER, std=0.1)
    experts = MoEExperts("int8", w13=w13, w2=w2, w13_scales=s13, w2_scales=s2)
    for dtype in (torch.float32, torch.bfloat16):
        dequantized = MoEExperts("dense", w13=(w13.float() * s13[..., None]).to(dtype),
                                 w2=(w2.float() * s2[..., None]).to(dtype))
        x = torch.randn(6, HIDDEN, generator=gen).to(dtype)
        weights, ids = moe.moe_route(torch.randn(6, 4, generator=gen), 2)
        torch.testing.assert_close(moe.fused_moe(x, experts, weights, ids),
                                   moe.fused_moe(x, dequantized, weights, ids), atol=0, rtol=0)


def test_int4_reference_is_the_dense_reference_on_dequantized_weights():
    gen = torch.Generator().manual_seed(9)
    w13, s13, z13 = _random_int4(gen, 4, 2 * INTER, HIDDEN, group=16, std=0.1)
    w2, s2, z2 = _random_int4(gen, 4, HIDDEN, INTER, group=8, std=0.1)
    experts = MoEExperts("int4", w13=w13, w2=w2, w13_scales=s13, w2_scales=s2, w13_zeros=z13, w2_zeros=z2)
    assert experts.group_sizes == (16, 8)
    for dtype in (torch.float32, torch.bfloat16):
        dequantized = MoEExperts("dense",
                                 w13=torch.stack([dequantize_int4(*t, 16, dtype) for t in zip(w13, s13, z13)]),
                                 w2=torch.stack([dequantize_int4(*t, 8, dtype) for t in zip(w2, s2, z2)]))
        x = torch.randn(6, HIDDEN, generator=gen).to(dtype)
        weights, ids = moe.moe_route(torch.randn(6, 4, generator=gen), 2)
        torch.testing.assert_close(moe.fused_moe(x, experts, weights, ids),
                                   moe.fused_moe(x, dequantized, weights, ids), atol=0, rtol=0)


def test_bytes_per_token_counts_k_experts_weights_scales_and_biases():
    e, h, i = 4, 64, 32
    dense = MoEExperts("dense", w13=torch.zeros(e, 2 * i, h, dtype=torch.bfloat16),
                       w2=torch.zeros(e, h, i, dtype=torch.bfloat16))
    assert dense.bytes_per_token(2) == 2 * (2 * i * h + h * i) * 2
    quantized = MoEExperts("mxfp4", w13=torch.zeros(e, 2 * i, h // 32, 16, dtype=torch.uint8),
                           w2=torch.zeros(e, h, i // 32, 16, dtype=torch.uint8),
                           w13_scales=torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8),
                           w2_scales=torch.zeros(e, h, i // 32, dtype=torch.uint8),
                           b13=torch.zeros(e, 2 * i), b2=torch.zeros(e, h))
    codes, scales, biases = 3 * i * h // 2, 3 * i * h // 32, (2 * i + h) * 4
    assert quantized.bytes_per_token(4) == 4 * (codes + scales + biases)
    assert (quantized.num_experts, quantized.hidden_size, quantized.intermediate_size) == (e, h, i)
    int8 = MoEExperts("int8", w13=torch.zeros(e, 2 * i, h, dtype=torch.int8), w2=torch.zeros(e, h, i, dtype=torch.int8),
                      w13_scales=torch.zeros(e, 2 * i), w2_scales=torch.zeros(e, h))
    assert int8.bytes_per_token(2) == 2 * (3 * i * h + (2 * i + h) * 4)
    assert (int8.num_experts, int8.hidden_size, int8.intermediate_size) == (e, h, i)
    int4 = MoEExperts("int4", w13=torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8),
                      w2=torch.zeros(e, h, i // 2, dtype=torch.uint8),
                      w13_scales=torch.zeros(e, 2 * i, h // 16, dtype=torch.float16),
                      w13_zeros=torch.zeros(e, 2 * i, h // 16, dtype=torch.float16),
                      w2_scales=torch.zeros(e, h, i // 8, dtype=torch.float16),
                      w2_zeros=torch.zeros(e, h, i // 8, dtype=torch.float16))
    assert int4.bytes_per_token(2) == 2 * (3 * i * h // 2 + 2 * 2 * (2 * i * h // 16 + h * i // 8))
    assert (int4.num_experts, int4.hidden_size, int4.intermediate_size, int4.group_sizes) == (e, h, i, (16, 8))


def test_bad_experts_and_routing_arguments_are_refused():
    w13, w2 = torch.zeros(4, 64, 32), torch.zeros(4, 32, 32)
    with pytest.raises(ValueError, match="w13 \\[E, 2I, H\\]"):
        MoEExperts("dense", w13=w13, w2=w2[:, :, :16])
    with pytest.raises(ValueError, match="need w13_scales"):
        MoEExperts("mxfp4", w13=w13, w2=w2)
    codes13, codes2 = w13.to(torch.int8), w2.to(torch.int8)
    with pytest.raises(ValueError, match="int8 w13: codes must be int8"):
        MoEExperts("int8", w13=w13, w2=codes2, w13_scales=torch.ones(4, 64), w2_scales=torch.ones(4, 32))
    with pytest.raises(ValueError, match="int8 w2: want codes"):
        MoEExperts("int8", w13=codes13, w2=codes2, w13_scales=torch.ones(4, 64), w2_scales=torch.ones(4, 16))
    with pytest.raises(ValueError, match="int4 experts need w13_zeros"):
        MoEExperts("int4", w13=w13, w2=w2, w13_scales=torch.ones(4, 64), w2_scales=torch.ones(4, 32))
    packed13, packed2 = torch.zeros(4, 64, 16, dtype=torch.uint8), torch.zeros(4, 32, 16, dtype=torch.uint8)
    half = dict(dtype=torch.float16)
    with pytest.raises(ValueError, match="int4 w2: the input size 32 must be even and split into groups"):
        MoEExperts("int4", w13=packed13, w2=packed2, w13_scales=torch.ones(4, 64, 2, **half),
                   w13_zeros=torch.ones(4, 64, 2, **half), w2_scales=torch.ones(4, 32, 5, **half),
                   w2_zeros=torch.ones(4, 32, 5, **half))
    with pytest.raises(ValueError, match="kind"):
        MoEExperts("int2", w13=w13, w2=w2)
    with pytest.raises(ValueError, match="activation"):
        MoEExperts("dense", w13=w13, w2=w2, activation="gelu")
    with pytest.raises(ValueError, match="b2"):
        MoEExperts("dense", w13=w13, w2=w2, b2=torch.zeros(4, 64))
    experts = MoEExperts("dense", w13=w13, w2=w2)
    weights, ids = moe.moe_route(torch.randn(3, 4), 2)
    with pytest.raises(ValueError, match="x \\[T, 32\\]"):
        moe.fused_moe(torch.zeros(3, 16), experts, weights, ids)
    with pytest.raises(ValueError, match="weights and ids"):
        moe.fused_moe(torch.zeros(3, 32), experts, weights[:, :1], ids)
    with pytest.raises(ValueError, match="top_k"):
        moe.moe_route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="scoring"):
        moe.moe_route(torch.zeros(3, 4), 2, scoring="sigmoid_softmax")
    with pytest.raises(ValueError, match="sigmoid routing's"):
        moe.moe_route(torch.zeros(3, 4), 2, scale=2.5)
    with pytest.raises(ValueError, match="moe_route"):
        moe.norm_route(torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(4), 1e-6, torch.zeros(8, 4), None, 2,
                       scoring="sigmoid")


# ---------------------------------------------------------------------------------------------
# Triton kernels against the references (each check runs in the interpreter worker or on CUDA)


def _moe_triton():
    return importlib.import_module("hibana_kernels.moe_triton")


def _lowest_index_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k ids with ties to the lowest index: what the Triton router picks."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def check_route(device, scoring, renormalize, top_k, num_experts, tied, dtype):
    gen = torch.Generator().manual_seed(top_k * num_experts)
    logits = torch.randn(13, num_experts, generator=gen).to(dtype)
    if tied:  # ties straddling the top-k boundary: a block of equal logits at the top
        logits[:, 1:1 + 2 * top_k] = logits.max() + 1
    sigmoid = dict(correction_bias=torch.randn(num_experts, generator=gen) / 4, scale=2.5) if scoring == "sigmoid" else {}
    if tied and sigmoid:  # the choice is score + bias: tie those
        sigmoid["correction_bias"][1:1 + 2 * top_k] = 0.0
    weights, ids = _moe_triton().moe_route(logits.to(device), top_k, scoring=scoring, renormalize=renormalize,
                                           **{k: v.to(device) if torch.is_tensor(v) else v for k, v in sigmoid.items()})
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    ids, weights = ids.cpu(), weights.cpu()
    choice = logits.float().sigmoid() + sigmoid["correction_bias"] if sigmoid else logits.float()
    assert torch.equal(ids, _lowest_index_top_k(choice, top_k))
    ref_weights, ref_ids = moe.moe_route(logits, top_k, scoring=scoring, renormalize=renormalize, **sigmoid)
    if not tied:
        assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)  # tied: equal weights anyway
    if device == "cuda":  # the claim the kernel's tie rule rests on: torch.topk on CUDA picks these
        cuda_ids = moe.moe_route(logits.to(device), top_k, scoring=scoring,
                                 **{k: v.to(device) if torch.is_tensor(v) else v for k, v in sigmoid.items()})[1].cpu()
        assert torch.equal(cuda_ids.sort(dim=-1).values, ids.sort(dim=-1).values)


@pytest.mark.parametrize("scoring, renormalize, top_k, num_experts",
                         [("softmax", True, 8, 128), ("softmax", False, 2, 8), ("topk_softmax", False, 4, 32),
                          ("topk_softmax", False, 1, 5), ("sigmoid", True, 8, 128), ("sigmoid", False, 3, 20)])
@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_route(run_check, scoring, renormalize, top_k, num_experts, tied):
    run_check(check_route, scoring=scoring, renormalize=renormalize, top_k=top_k,
              num_experts=num_experts, tied=tied, dtype=torch.bfloat16 if tied else torch.float32)


def check_align(device, tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(tokens + num_experts)
    ids = torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    ids[: tokens // 2, 0] = 3  # one busy expert: several blocks
    blocks = _moe_triton().moe_align(ids.to(device), num_experts, block_m)
    expected = moe.moe_align(ids, num_experts, block_m)
    assert torch.equal(blocks.routes.cpu(), expected.routes)
    assert torch.equal(blocks.block_expert.cpu(), expected.block_expert)


@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", [(1, 8, 128, 16), (37, 2, 8, 16), (70, 4, 32, 64)])
def test_align(run_check, tokens, top_k, num_experts, block_m):
    run_check(check_align, tokens=tokens, top_k=top_k, num_experts=num_experts, block_m=block_m)


def test_reference_align_groups_routes_by_expert_in_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # routes 0..5
    blocks = moe.moe_align(ids, num_experts=4, block_m=2)
    assert blocks.block_expert.tolist() == [0, 1, 2, 2, -1, -1, -1]  # cdiv(6, 2) + 4 blocks
    assert blocks.routes.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]  # 6: padding


def check_mxfp4_dequantize(device, dtype):
    blocks, scales = _random_mxfp4(torch.Generator().manual_seed(7), 3, 24, 96)
    out = _moe_triton().mxfp4_dequantize(blocks.to(device), scales.to(device), dtype)
    torch.testing.assert_close(out.cpu(), moe.mxfp4_dequantize(blocks, scales, dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mxfp4_dequantize(run_check, dtype):
    run_check(check_mxfp4_dequantize, dtype=dtype)


def _random_experts(kind, activation, bias, num_experts, hidden, inter, gen, groups=(16, 32)):
    """Experts whose outputs stay O(1) for unit-variance x (int4: groups of w13's and w2's inputs)."""
    if kind == "dense":
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
        quantized = {}
    elif kind == "int8":
        (w13, s13), (w2, s2) = (_random_int8(gen, num_experts, n, k, std=k ** -0.5) for n, k in
                                ((2 * inter, hidden), (hidden, inter)))
        quantized = dict(w13_scales=s13, w2_scales=s2)
    elif kind == "int4":  # by default groups of 16 inputs in w13 (two a tile of 32 columns), of 32 in w2
        (w13, s13, z13), (w2, s2, z2) = (_random_int4(gen, num_experts, n, k, group=g, std=k ** -0.5)
                                         for n, k, g in ((2 * inter, hidden, groups[0]), (hidden, inter, groups[1])))
        quantized = dict(w13_scales=s13, w2_scales=s2, w13_zeros=z13, w2_zeros=z2)
    else:  # codes up to 6: scales of 2^-4 .. 2^-2
        (w13, s13), (w2, s2) = (_random_mxfp4(gen, num_experts, n, k) for n, k in
                                ((2 * inter, hidden), (hidden, inter)))
        s13, s2 = s13 - 6, s2 - 6
        quantized = dict(w13_scales=s13, w2_scales=s2)
    biases = dict(b13=torch.randn(num_experts, 2 * inter, generator=gen),
                  b2=torch.randn(num_experts, hidden, generator=gen)) if bias else {}
    return MoEExperts(kind, w13=w13, w2=w2, activation=activation, **quantized, **biases)


def _on(experts: MoEExperts, device) -> MoEExperts:
    fields = {name: getattr(experts, name) for name in ("w13", "w2", "w13_scales", "w2_scales", "w13_zeros",
                                                         "w2_zeros", "b13", "b2")}
    return MoEExperts(experts.kind, activation=experts.activation,
                      **{k: None if v is None else v.to(device) for k, v in fields.items()})


def check_fused_moe(device, kind, activation, bias, dtype, tokens, top_k, path):
    mt = _moe_triton()
    num_experts, hidden, inter = 8, 64, 32
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts = _random_experts(kind, activation, bias, num_experts, hidden, inter, gen)
    if kind == "dense":
        experts = MoEExperts("dense", w13=experts.w13.to(dtype), w2=experts.w2.to(dtype), b13=experts.b13,
                             b2=experts.b2, activation=activation)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = moe.moe_route(torch.randn(tokens, num_experts, generator=gen), top_k, renormalize=True)
    expected = moe.fused_moe(x, experts, weights, ids).float()
    tiles = mt.GroupedTiles(16, 32, 32, 4, 1) if path == "grouped" else mt.DecodeTiles(16, 32, 4)
    out = mt.fused_moe_launch(x.to(device), _on(experts, device), weights.to(device), ids.to(device), tiles)
    assert out.dtype == dtype and out.shape == x.shape
    # 16-bit: the reference rounds the sum of k at each add, the kernels once; and the interpreter
    # truncates at each of the ~10 roundings where compiled Triton rounds to nearest
    tolerance = {torch.float32: 1e-5, torch.float16: 5e-3}.get(dtype, 6e-2 if device == "cpu" else 2e-2)
    error = (out.cpu().float() - expected).abs().max() / expected.abs().max()
    assert error <= tolerance, f"relative error {error:.2e}"


# the default run takes each kind and activation on each path in one dtype, turning: both dtypes
# meet every kind and activation and every path; the whole product with -m slow
@thinned("path, tokens, top_k, dtype, kind, activation, bias", lambda path, dtype, kind: dtype == (path + kind) % 2,
         [("decode", 1, 4), ("decode", 3, 2), ("grouped", 37, 2), ("grouped", 5, 4)], [torch.float32, torch.bfloat16],
         [("dense", "silu", False), ("dense", "swiglu_oai", True), ("mxfp4", "swiglu_oai", True),
          ("mxfp4", "silu", False), ("int8", "silu", False), ("int8", "swiglu_oai", True), ("int4", "silu", False),
          ("int4", "swiglu_oai", True)])
def test_fused_moe(run_check, path, tokens, top_k, dtype, kind, activation, bias):
    run_check(check_fused_moe, kind=kind, activation=activation, bias=bias, dtype=dtype, tokens=tokens,
              top_k=top_k, path=path)


@pytest.mark.parametrize("kind, activation", [("dense", "silu"), ("mxfp4", "swiglu_oai"), ("int8", "silu"),
                                              ("int4", "swiglu_oai")])
def test_fused_moe_float16(run_check, kind, activation):
    for path in ("decode", "grouped"):
        run_check(check_fused_moe, kind=kind, activation=activation, bias=True, dtype=torch.float16,
                  tokens=9, top_k=2, path=path)


def check_norm_route(device, scoring, renormalize, bias, tokens, hidden, num_experts, top_k):
    """The one-launch norm + router + top-k against the separate Triton kernels (rms_norm, the
    router's GEMV or linear, moe_route): h and x + residual equal, the same experts, weights
    within a bfloat16 logit's rounding; and near the reference. Twice in a row: the arrival
    counts are zero again after a launch."""
    from hibana_kernels import fusion

    mt = _moe_triton()
    gen = torch.Generator().manual_seed(tokens * hidden + num_experts)
    x, res = (torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device) for _ in range(2))
    nw = (1 + torch.randn(hidden, generator=gen) / 4).to(torch.bfloat16).to(device)
    w = (torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16).to(device)
    b = torch.randn(num_experts, generator=gen).to(torch.bfloat16).to(device) if bias else None
    args = (x, res, nw, 1e-6, w, b, top_k)
    with fusion.using("off"):
        h0, r0, w0, i0 = mt.norm_route(*args, scoring=scoring, renormalize=renormalize)
    for _ in range(2):
        with fusion.using("on"):
            h1, r1, w1, i1 = mt.norm_route(*args, scoring=scoring, renormalize=renormalize)
        assert torch.equal(h1, h0) and torch.equal(r1, r0)
        assert torch.equal(i1, i0)
        # logits rounded to bfloat16 from float32 sums in another order (and, on more rows than
        # the GEMV takes, F.linear's): weights within a bfloat16 logit's step
        torch.testing.assert_close(w1, w0, rtol=1e-2, atol=1e-3)
    h, r, weights, ids = moe.norm_route(*(a if a is None or isinstance(a, (int, float)) else a.cpu() for a in args),
                                        scoring=scoring, renormalize=renormalize)
    # (the interpreter truncates where the GPU rounds to bfloat16: near the reference, not equal)
    torch.testing.assert_close(r1.cpu().float(), r.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(h1.cpu().float(), h.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scoring, renormalize, bias", [("softmax", True, False), ("topk_softmax", False, True)],
                         ids=["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens, hidden, num_experts, top_k", [(1, 64, 8, 2), (3, 96, 12, 4)],
                         ids=["one-row", "three-rows-odd-experts"])
def test_norm_route(run_check, scoring, renormalize, bias, tokens, hidden, num_experts, top_k):
    run_check(check_norm_route, scoring=scoring, renormalize=renormalize, bias=bias, tokens=tokens,
              hidden=hidden, num_experts=num_experts, top_k=top_k)


def check_fused_moe_tiles(device, kind, hidden, inter, groups, tiles):
    """fused_moe_launch against the reference at shapes the tiles do not divide (K not a whole
    number of BLOCK_K, N not of BLOCK_N), for each of several tiles of both paths: grouped tiles
    on 3 tokens routed to 4 experts each (experts shared among tokens), decode tiles on 2 tokens
    routed to 2 (a program set a route: in the interpreter, a third of 12 routes' time; several
    tokens at the decode path's default tiles are test_fused_moe's)."""
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(hidden + inter)
    experts = _random_experts(kind, "silu", False, 8, hidden, inter, gen, groups)
    x = torch.randn(3, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(3, 8, generator=gen)
    on_device = _on(experts, device)
    batches = {}
    for tile in tiles:
        tile = _tiles(mt, tile)
        grouped = isinstance(tile, mt.GroupedTiles)
        if grouped not in batches:
            rows, top_k = (3, 4) if grouped else (2, 2)
            weights, ids = moe.moe_route(logits[:rows], top_k, renormalize=True)
            batches[grouped] = (x[:rows], weights, ids, moe.fused_moe(x[:rows], experts, weights, ids).float())
        xs, weights, ids, expected = batches[grouped]
        out = mt.fused_moe_launch(xs.to(device), on_device, weights.to(device), ids.to(device), tile)
        error = (out.cpu().float() - expected).abs().max() / expected.abs().max()
        assert error <= (6e-2 if device == "cpu" else 2e-2), f"{tile}: relative error {error:.2e}"


# (hidden, inter, int4 groups of w13, w2): K = 3 groups (not a power of two), N odd where the kind allows
_TILE_SHAPES = {"int4": [(96, 96, (32, 32)), (192, 64, (64, 64)), (384, 128, (128, 128))],
                "mxfp4": [(96, 160, None)], "int8": [(72, 40, None), (33, 17, None)], "dense": [(33, 17, None)]}
_TILES = [(16, 32, 4), (8, 64, 2, True), (4, 256, 4, True), (16, 128, 4, False), (16, 32, 64, 4, 1),
          (16, 64, 128, 4, 1), (8, 64, 2, True, True)]


def _tiles(mt, tile: tuple):
    """A tile of the tests' lists as the kernels' NamedTuple: grouped tiles are five ints, decode
    tiles three ints and then down_per_route, x_vector, unroll, direct, down and split if given."""
    grouped = len(tile) == 5 and not isinstance(tile[4], bool)
    return (mt.GroupedTiles if grouped else mt.DecodeTiles)(*tile)


# int4 groups of 32 and 128 are slow in the interpreter (40 s each); groups of 64 meet tiles of
# K-blocks smaller and larger than a group as they do, and the GPU runs all three compiled
_SLOW_TILE_SHAPES = {("int4", 96, 96), ("int4", 384, 128)}


@pytest.mark.parametrize("kind, hidden, inter, groups", [
    pytest.param(k, *shape, marks=[pytest.mark.slow] if (k, *shape[:2]) in _SLOW_TILE_SHAPES else [])
    for k, shapes in _TILE_SHAPES.items() for shape in shapes])
def test_fused_moe_tiles(run_check, kind, hidden, inter, groups):
    # the larger shapes with a decode and a grouped tile (in the interpreter each tile of them costs
    # ~15 s): the smaller shapes of the same kind take every tile
    tiles = _TILES if hidden * inter <= 12288 else _TILES[1::3]
    tiles = tiles + ([(8, 16, 4)] if kind in ("dense", "int8") else [])  # 16 columns: no 4-bit tile
    # rows in 2-3 steps written out (unroll), the last masked
    tiles = tiles + ([(8, 32, 4, True, False, True)] if kind in ("dense", "int8") else [])
    tiles = tiles + ([(2, 16, 4, True, False, True)] if kind == "dense" else [])
    # the down projection on its own tiles (DecodeTiles.down), unrolled as the default's
    tiles = tiles + ([(4, 64, 4, True, False, True, False, (8, 16, 2))] if kind in ("dense", "int8") else [])
    # split-K: rows shared among 3 programs (the last shorter), the last to finish adding them; unrolled steps
    tiles = tiles + [(8, 32, 2, True, False, False, False, None, 3)]
    tiles = tiles + ([(8, 32, 4, True, False, True, False, None, 2)] if kind in ("dense", "int8") else [])
    # (MXFP4's direct GEMV, codes straight into float32 bits, a whole step and steps past K masked:
    # test_mxfp4_codes_and_scales_are_exact, bit for bit; here its two tiles took 90 s of the
    # interpreter's time)
    run_check(check_fused_moe_tiles, kind=kind, hidden=hidden, inter=inter, groups=groups, tiles=tiles)


def _a8_reference(x, experts, weights, ids):
    """What the MXFP4 decode with int8 x (DecodeTiles.a8) computes, in float64: gate|up against x
    rounded to int8 codes a block of 32, the activation rounded to x's dtype, the down projection
    against that rounded to int8 codes again, weighted, summed."""
    from hibana_kernels.quant import reference_quantize_a8

    def rounded(v):
        codes, d = reference_quantize_a8(v)
        return (codes.double().view(v.shape[0], -1, 32) * d.double()[..., None]).view(v.shape)

    out = torch.zeros(x.shape, dtype=torch.float64)
    x_hat = rounded(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[t, slot])
            w13, w2 = experts.expert_weights(expert, torch.float64)
            gate_up = x_hat[t] @ w13.T + (experts.b13[expert].double() if experts.b13 is not None else 0)
            act = moe.expert_activation(gate_up.float(), experts).to(x.dtype)
            y = rounded(act[None])[0] @ w2.T + (experts.b2[expert].double() if experts.b2 is not None else 0)
            out[t] += float(weights[t, slot]) * y
    return out


def check_mxfp4_a8(device, activation, bias, tokens, top_k, hidden, inter, tiles):
    """MXFP4 experts against x and the activations as int8 codes (DecodeTiles.a8): near what the
    same roundings give in float64, and within what rounding to 8 bits costs of the exact
    reference; every code value of e2m1 occurs."""
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(tokens * 100 + hidden)
    experts = _random_experts("mxfp4", activation, bias, 8, hidden, inter, gen)
    # float16: the interpreter truncates at each rounding where compiled Triton rounds to nearest,
    # which in bfloat16 costs about what rounding to 8 bits does
    x = torch.randn(tokens, hidden, generator=gen).to(torch.float16)
    x[0, 32:64] = 0  # an all-zero block of x (d = 0)
    weights, ids = moe.moe_route(torch.randn(tokens, 8, generator=gen), top_k, renormalize=True)
    codes = experts.w13[ids.unique()]
    assert torch.cat([codes & 15, codes >> 4]).unique().tolist() == list(range(16))  # every e2m1 value
    out = mt.fused_moe_launch(x.to(device), _on(experts, device), weights.to(device), ids.to(device),
                              mt.DecodeTiles(*tiles, a8=True)).cpu().double()
    reference = _a8_reference(x, experts, weights, ids)
    near = ((out - reference).abs().max() / reference.abs().max()).item()
    exact = moe.fused_moe(x.double(), experts, weights.double(), ids)
    off = ((out - exact).abs().max() / exact.abs().max()).item()
    assert near < 8e-3 and off < 3e-2, (near, off)  # (seen in the interpreter: 0.2-0.5% and 1.1-1.3%)


@pytest.mark.parametrize("activation, bias, tokens, top_k, hidden, inter, tiles", [
    ("swiglu_oai", True, 1, 4, 96, 160, (8, 64, 2, True)),  # steps past K masked, a route's down rows
    ("silu", False, 3, 2, 64, 64, (4, 32, 1, False)),  # a token's k experts in one program
    ("swiglu_oai", True, 1, 2, 128, 96, (8, 32, 2, True, False, False, False, None, 3))])  # split-K
def test_mxfp4_a8(run_check, activation, bias, tokens, top_k, hidden, inter, tiles):
    run_check(check_mxfp4_a8, activation=activation, bias=bias, tokens=tokens, top_k=top_k, hidden=hidden,
              inter=inter, tiles=tiles)


def check_split_counts_and_direct_inputs(device):
    """Split-K leaves its arrival counts at zero for the next launch (graphs replay them), also
    after launches of two kinds and shapes; the direct MXFP4 GEMV, which reads x as bf16 pairs,
    is not taken for fp16 or fp32 x (the fp16-pair GEMV runs: results as right as bf16's); decode
    tiles that step past whole MXFP4 blocks are refused."""
    from hibana_kernels import counters
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(23)
    for kind, hidden, inter in (("mxfp4", 96, 96), ("dense", 160, 96)):
        experts = _on(_random_experts(kind, "silu", False, 4, hidden, inter, gen), device)
        x = torch.randn(1, hidden, generator=gen)  # one token, two routes (the interpreter's time is by route)
        weights, ids = moe.moe_route(torch.randn(1, 4, generator=gen), 2)
        expected = moe.fused_moe(x, _on(experts, "cpu"), weights, ids).float()
        for dtype in (torch.bfloat16, torch.float16, torch.float32) if kind == "mxfp4" else (torch.bfloat16,):
            tiles = mt.DecodeTiles(8, 32, 2, True, direct=True, split=3)
            out = mt.fused_moe_launch(x.to(device, dtype), experts, weights.to(device), ids.to(device), tiles)
            error = (out.cpu().float() - expected).abs().max() / expected.abs().max()
            assert error <= 6e-2, f"{kind} {dtype}: relative error {error:.2e}"
        assert not counters.counters("moe decode split", mt.SPLIT_GROUPS, torch.device(device)).any()
    experts = _on(_random_experts("mxfp4", "silu", False, 4, 64, 64, gen), device)
    with pytest.raises(ValueError, match="multiple of 32"):
        mt.fused_moe_launch(torch.randn(1, 64, generator=gen).to(device, torch.bfloat16), experts, weights.to(device),
                            ids.to(device), mt.DecodeTiles(8, 16, 2, True))


def test_split_counts_and_direct_inputs(run_check):
    run_check(check_split_counts_and_direct_inputs)


def check_int4_groups_the_kernels_do_not_take(device):
    """Groups of 12 inputs (not a power of two): fused_moe runs the reference; the launch refuses."""
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(12)
    experts = _on(_random_experts("int4", "silu", False, 4, 48, 24, gen, (12, 12)), device)
    x = torch.randn(2, 48, generator=gen)
    weights, ids = moe.moe_route(torch.randn(2, 4, generator=gen), 2)
    assert not mt.supports(experts)
    out = mt.fused_moe(x.to(device), experts, weights.to(device), ids.to(device))
    torch.testing.assert_close(out.cpu(), moe.fused_moe(x, _on(experts, "cpu"), weights, ids))
    with pytest.raises(ValueError, match="powers of two"):
        mt.fused_moe_launch(x.to(device), experts, weights.to(device), ids.to(device), mt.DecodeTiles(8, 32, 4))


def check_unrolled_rows_of_more_than_four_steps(device):
    """Unrolled decode tiles on rows of more than 4 steps (gate_up's 80 inputs in steps of 16) loop
    there and write out the down projection's 2: the result is the reference's."""
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(5)
    experts = _random_experts("dense", "silu", False, 4, 80, 24, gen, None)
    x = torch.randn(1, 80, generator=gen).to(torch.bfloat16)
    weights, ids = moe.moe_route(torch.randn(1, 4, generator=gen), 2)
    expected = moe.fused_moe(x, experts, weights, ids).float()
    out = mt.fused_moe_launch(x.to(device), _on(experts, device), weights.to(device), ids.to(device),
                              mt.DecodeTiles(2, 16, 4, unroll=True))
    error = (out.cpu().float() - expected).abs().max() / expected.abs().max()
    assert error <= (6e-2 if device == "cpu" else 2e-2)


def test_unrolled_rows_of_more_than_four_steps(run_check):
    run_check(check_unrolled_rows_of_more_than_four_steps)


def test_int4_groups_the_kernels_do_not_take(run_check):
    run_check(check_int4_groups_the_kernels_do_not_take)


def check_fused_moe_picks_a_path(device, kind):
    """moe_triton.fused_moe at a decode batch and a prefill batch: its own path and tiles."""
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(11)
    experts = _random_experts(kind, "swiglu_oai", True, 8, 64, 32, gen)
    for tokens in (1, mt.DECODE_MAX_TOKENS[kind] + 1):
        x = torch.randn(tokens, 64, generator=gen)
        weights, ids = moe.moe_route(torch.randn(tokens, 8, generator=gen), 2, scoring="topk_softmax")
        out = mt.fused_moe(x.to(device), _on(experts, device), weights.to(device), ids.to(device))
        torch.testing.assert_close(out.cpu(), moe.fused_moe(x, experts, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["mxfp4", "int8", "int4"])
def test_fused_moe_picks_a_path(run_check, kind):
    run_check(check_fused_moe_picks_a_path, kind=kind)


def test_moe_dispatch_on_cpu_runs_the_references_without_importing_triton():
    script = textwrap.dedent("""
        import sys, torch
        import hibana_kernels as kernels
        weights, ids = kernels.moe_route(torch.randn(3, 4), 2, renormalize=True)
        experts = kernels.MoEExperts("dense", w13=torch.randn(4, 8, 6), w2=torch.randn(4, 6, 4))
        assert kernels.fused_moe(torch.randn(3, 6), experts, weights, ids).shape == (3, 6)
        kernels.mxfp4_dequantize(torch.zeros(2, 1, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8),
                                 torch.float32)
        assert "triton" not in sys.modules, "the CPU path imported triton"
    """)
    subprocess.run([sys.executable, "-c", script], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(moe.__file__))))


def _pack_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [N, K] -> MXFP4 blocks [N, K // 32, 16], the even column in the low nibble."""
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(codes.shape[0], -1, 16)


def check_mxfp4_codes_and_scales_are_exact(device, tiles, tokens=16):
    """Every e2m1 code at every e8m0 scale exponent from 2 to 240 through one tile, exactly: token
    t is the one-hot x = e_t, whose gate and up rows make the activation 64 at feature t alone
    (silu(64) is 64 in float32) and 0 elsewhere, so out[t, h] = 64 w2[h, t], one product, exact in
    bfloat16; w2's row h has the scale exponent min(h + 2, 240) and at feature t the code (h + t) % 16.
    (Below 2 a weight of 0.5 is a bfloat16 subnormal, which the reference's own matmul flushes; above
    240 `_e8m0_scale` is inf. Checkpoints' scales are near 2^0, exponent 127.) Fewer `tokens`
    check fewer codes at each exponent (4: four, every code at 64 exponents)."""
    mt = _moe_triton()
    tiles = _tiles(mt, tiles)
    hidden, inter = 256, 32
    diagonal = torch.arange(tokens)
    codes13 = torch.zeros(2 * inter, hidden, dtype=torch.uint8)
    codes13[diagonal, diagonal] = 6  # gate row t: 4 at column t
    codes13[inter + diagonal, diagonal] = 2  # up row t: 1 at column t
    s13 = torch.full((2 * inter, hidden // 32), 127, dtype=torch.uint8)
    s13[:inter] = 131  # gate: 4 * 2^4
    codes2 = ((torch.arange(hidden)[:, None] + torch.arange(inter)[None, :]) % 16).to(torch.uint8)
    s2 = (torch.arange(hidden) + 2).clamp(max=240).to(torch.uint8)[:, None].expand(hidden, inter // 32)
    idle = (torch.zeros_like(codes13), torch.zeros_like(codes2))  # expert 1, never routed to
    experts = MoEExperts("mxfp4", w13=torch.stack((_pack_mxfp4(codes13), _pack_mxfp4(idle[0]))),
                         w2=torch.stack((_pack_mxfp4(codes2), _pack_mxfp4(idle[1]))),
                         w13_scales=torch.stack((s13, s13)), w2_scales=torch.stack((s2, s2)))
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    x[diagonal, diagonal] = 1.0
    weights, ids = torch.ones(tokens, 1), torch.zeros(tokens, 1, dtype=torch.int64)
    expected = moe.fused_moe(x, experts, weights, ids)
    assert torch.equal(expected, 64 * moe.mxfp4_dequantize(experts.w2[0], s2, torch.float32).t()[:tokens].bfloat16())
    out = mt.fused_moe_launch(x.to(device), _on(experts, device), weights.to(device), ids.to(device), tiles)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("tiles, tokens", [((32, 64, 4, True), 16), ((32, 64, 4, True, True), 16),
                                           ((16, 64, 64, 4, 1), 16), ((32, 64, 4, True, False, False, True), 16),
                                           # K-steps past the end masked: the direct GEMV's codes are checked
                                           # whole above; 4 tokens (in the interpreter, 11 s against 43)
                                           ((8, 256, 2, True, False, False, True), 4)],
                         ids=["decode", "decode-x_vector", "grouped", "decode-direct", "decode-direct-masked"])
def test_mxfp4_codes_and_scales_are_exact(run_check, tiles, tokens):
    run_check(check_mxfp4_codes_and_scales_are_exact, tiles=tiles, tokens=tokens)


def test_mxfp4_decode_takes_int8_x_unless_turned_off(monkeypatch):
    """MXFP4 decode rows meet the experts as int8 codes of x by default (measured faster on the
    H200: DECODE_TILES), and HIBANA_A8_ROWS=0 (quant_triton.A8_MAX_ROWS 0) keeps x in 16 bits there
    as it does for the dense int4 / int8 layers (on MXFP4's float tiles); batches past the decode
    path are grouped."""
    mt = _moe_triton()
    from hibana_kernels import quant_triton

    monkeypatch.setattr(quant_triton, "A8_MAX_ROWS", 1)  # the default, whatever the environment says
    assert mt.choose_tiles(1, "mxfp4").a8 and mt.choose_tiles(mt.DECODE_MAX_TOKENS["mxfp4"], "mxfp4").a8
    assert isinstance(mt.choose_tiles(mt.DECODE_MAX_TOKENS["mxfp4"] + 1, "mxfp4"), mt.GroupedTiles)
    assert not mt.choose_tiles(1, "dense").a8
    monkeypatch.setattr(quant_triton, "A8_MAX_ROWS", 0)
    assert mt.choose_tiles(1, "mxfp4") == mt.FLOAT_TILES["mxfp4"] and not mt.FLOAT_TILES["mxfp4"].a8


def check_a8_tiles_on_float32_x_run_the_float_tiles(device):
    """float32 x cannot take int8 codes: a8 decode tiles run the float GEMV on FLOAT_TILES, to the bit."""
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(31)
    experts = _on(_random_experts("mxfp4", "silu", False, 4, 96, 64, gen), device)
    x = torch.randn(2, 96, generator=gen).to(device)
    weights, ids = (t.to(device) for t in moe.moe_route(torch.randn(2, 4, generator=gen), 2))
    got = mt.fused_moe_launch(x, experts, weights, ids, mt.DECODE_TILES["mxfp4"])
    want = mt.fused_moe_launch(x, experts, weights, ids, mt.FLOAT_TILES["mxfp4"])
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a8_tiles_on_float32_x_run_the_float_tiles(run_check):
    run_check(check_a8_tiles_on_float32_x_run_the_float_tiles)


def check_folds_give_the_separate_launches_bits(device, kind, tokens, top_k):
    """The decode path's launch folds give the bits of the launches they replace: the down
    projection summing a token's routes itself (`Fusion.moe_combine`: the last route to finish a
    tile adds them) and MXFP4's x codes handed over by the norm (`fused_moe_a8`, here from
    `quantize_a8`) rather than quantized in `fused_moe`; the arrival counts are back at zero."""
    from hibana_kernels import counters, fusion, quant_triton
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts = _on(_random_experts(kind, "swiglu_oai", True, 8, 96, 64, gen), device)
    x = torch.randn(tokens, 96, generator=gen).to(device, torch.float16)
    weights, ids = (t.to(device) for t in moe.moe_route(torch.randn(tokens, 8, generator=gen), top_k,
                                                         scoring="topk_softmax"))
    # dense: a program per route and 32 features (3 tiles of H); MXFP4 against int8 x
    tiles = mt.DecodeTiles(32, 32, 2, down_per_route=True) if kind == "dense" else \
        mt.DecodeTiles(8, 64, 2, down_per_route=True, a8=True)
    with fusion.using(dataclasses.replace(fusion.AUTO, moe_combine=False)):
        separate = mt.fused_moe_launch(x, experts, weights, ids, tiles)
    with fusion.using(dataclasses.replace(fusion.AUTO, moe_combine=True)):
        combined = mt.fused_moe_launch(x, experts, weights, ids, tiles)
        if kind == "mxfp4":
            handed = mt.fused_moe_launch(x, experts, weights, ids, tiles,
                                         x_codes=quant_triton.quantize_a8(x, quant_triton.A8_HALVES))
            torch.testing.assert_close(handed, separate, atol=0, rtol=0)
    torch.testing.assert_close(combined, separate, atol=0, rtol=0)
    assert not counters.counters("moe decode combine", mt.COMBINE_GROUPS, torch.device(device)).any()


@pytest.mark.parametrize("kind, tokens, top_k", [("dense", 1, 4), ("dense", 3, 2), ("mxfp4", 2, 4)])
def test_folds_give_the_separate_launches_bits(run_check, kind, tokens, top_k):
    run_check(check_folds_give_the_separate_launches_bits, kind=kind, tokens=tokens, top_k=top_k)


def test_moe_folds_a8_only_where_the_experts_take_int8_x(monkeypatch):
    """The norm hands a sparse block int8 codes only on CUDA, for experts whose decode tiles take
    int8 x (MXFP4, 16-bit x, decode batches) and under a policy that folds (`Fusion.a8_fold`)."""
    import hibana_kernels as kernels
    from hibana_kernels import fusion
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(3)
    mxfp4 = _random_experts("mxfp4", "swiglu_oai", True, 8, 96, 64, gen)
    dense = _random_experts("dense", "silu", False, 8, 96, 64, gen)
    x = torch.randn(1, 96, generator=gen).to(torch.bfloat16)
    assert not kernels.moe_folds_a8(x, mxfp4) and not mt.takes_a8(x, mxfp4)  # the CPU runs the references
    monkeypatch.setattr(mt.quant_triton, "A8_MAX_ROWS", 1)  # the default, whatever the environment says

    def takes(rows, experts, dtype=torch.bfloat16, hidden=96):  # takes_a8's rule, but for the device
        return mt._takes_a8(mt.choose_tiles(rows, experts.kind), experts, torch.zeros(rows, hidden, dtype=dtype))

    assert takes(1, mxfp4) and takes(mt.DECODE_MAX_TOKENS["mxfp4"], mxfp4, torch.float16)
    assert not takes(mt.DECODE_MAX_TOKENS["mxfp4"] + 1, mxfp4)  # grouped
    assert not takes(1, mxfp4, torch.float32) and not takes(1, dense)
    monkeypatch.setattr(mt.quant_triton, "A8_MAX_ROWS", 0)  # HIBANA_A8_ROWS=0: x stays in 16 bits
    assert not takes(1, mxfp4)
    assert not fusion.OFF.a8_fold and fusion.AUTO.a8_fold
