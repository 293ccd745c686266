"""MoE kernel tests: the references against transformers' own MoE modules (Qwen3-MoE's sparse
block, gpt-oss's MLP, dense and MXFP4) on tiny random configs, tied router logits included."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hibana_kernels import moe
from hibana_kernels.moe import MoEExperts

HIDDEN, INTER, EXPERTS = 64, 32, 8


def _random_mxfp4(gen, *shape):
    """(blocks, scales) of random codes with scales around 2^0 (e8m0 127 +- 4)."""
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(123, 132, (*lead, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


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


def test_bad_experts_and_routing_arguments_are_refused():
    w13, w2 = torch.zeros(4, 64, 32), torch.zeros(4, 32, 32)
    with pytest.raises(ValueError, match="w13 \\[E, 2I, H\\]"):
        MoEExperts("dense", w13=w13, w2=w2[:, :, :16])
    with pytest.raises(ValueError, match="need w13_scales"):
        MoEExperts("mxfp4", w13=w13, w2=w2)
    with pytest.raises(ValueError, match="activation"):
        MoEExperts("dense", w13=w13, w2=w2, activation="gelu")
    with pytest.raises(ValueError, match="b2"):
        MoEExperts("dense", w13=w13, w2=w2, b2=torch.zeros(4, 64))
    with pytest.raises(ValueError, match="top_k"):
        moe.moe_route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="scoring"):
        moe.moe_route(torch.zeros(3, 4), 2, scoring="sigmoid")
