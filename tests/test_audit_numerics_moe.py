"""MoE numerics in bfloat16 against transformers' own blocks: each family's order of rounding.

transformers' Mixtral keeps the top-k routing weights in float32 (MixtralTopKRouter) and rounds
only each expert's weighted output; Qwen3-MoE rounds the weights to the logits' dtype first
(Qwen3MoeTopKRouter). In float32 the two agree; in bfloat16 rounding the weights first moves a
quarter of the outputs by a bfloat16 step, so each family must keep its own order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hibana_kernels import moe
from hibana_kernels.moe import MoEExperts
from test_kernels import interpreter_worker, run_check  # noqa: F401 - fixtures: the interpreter worker

HIDDEN, INTER, EXPERTS = 64, 32, 8


def _seeded_bf16(block: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    block.experts.config._experts_implementation = "eager"  # the modelling file's own loop
    return block.eval().to(torch.bfloat16)


def _hibana_block_output(block, h: torch.Tensor, top_k: int, round_weights: bool) -> torch.Tensor:
    weights, ids = moe.moe_route(torch.nn.functional.linear(h, block.gate.weight), top_k, renormalize=True)
    experts = MoEExperts("dense", w13=block.experts.gate_up_proj, w2=block.experts.down_proj,
                         round_weights=round_weights)
    return moe.fused_moe(h, experts, weights, ids)


def _bf16_tokens(seed: int, tokens: int = 64) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("top_k", [2, 3])
def test_mixtral_bf16_reference_keeps_routing_weights_in_float32(top_k):
    block = _seeded_bf16(MixtralSparseMoeBlock(MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=top_k)), seed=top_k)
    h = _bf16_tokens(1)
    with torch.no_grad():
        expected = block(h[None])[0]
        out = _hibana_block_output(block, h, top_k, round_weights=False)
        rounded_first = _hibana_block_output(block, h, top_k, round_weights=True)
    assert out.dtype == torch.bfloat16
    assert not torch.equal(rounded_first, expected), "the inputs must tell the two orders apart"
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_qwen3_moe_bf16_reference_rounds_routing_weights_first():
    block = _seeded_bf16(Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=2,
        norm_topk_prob=True)), seed=5)
    h = _bf16_tokens(2)
    with torch.no_grad():
        expected = block(h[None])[0]
        out = _hibana_block_output(block, h, 2, round_weights=True)
        kept_float32 = _hibana_block_output(block, h, 2, round_weights=False)
    assert not torch.equal(kept_float32, expected), "the inputs must tell the two orders apart"
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_mixtral_engine_blocks_route_as_transformers_mixtral_in_bf16(tmp_path):
    """The family's own order reaches the engine: a bf16 tiny Mixtral's sparse block (router,
    experts as loaded) gives transformers' MixtralSparseMoeBlock's output bit for bit. (Routers
    untied: tiny_models' tied pairs route top-2 to a pair at 0.5 each, which bf16 holds exactly.)"""
    from transformers import AutoModelForCausalLM

    import hibana_kernels as kernels
    from hibana_core import Engine
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("mixtral", tmp_path / "m", num_hidden_layers=1, tied_experts=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, experts_implementation="eager")
    h = _bf16_tokens(3)
    with Engine.from_pretrained(str(path), device="cpu", dtype="bfloat16", block_size=16, num_blocks=16,
                                progress=False) as engine, torch.no_grad():
        block = engine.model.model.layers[0].mlp
        weights, ids = block.route(h)
        experts = block.experts.kernel_experts()
        out = kernels.fused_moe(h, experts, weights, ids)
        rounded_first = kernels.fused_moe(h, dataclasses.replace(experts, round_weights=True), weights, ids)
        expected = hf.model.layers[0].mlp(h[None])[0]
    assert not torch.equal(rounded_first, expected), "the inputs must tell the two orders apart"
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# --- the Triton kernels keep the same order (interpreter worker, or compiled on CUDA) ---------

_WEIGHT = 1 + 0.999 * 2 ** -7
"""A float32 routing weight just under a bfloat16 step above 1: times an expert output of 1.5,
bfloat16 rounds (nearest or, as the interpreter does, toward zero) to 1.5078125 when the weight
stays in float32; rounded to bfloat16 first it gives 1.515625 (nearest) or 1.5 (toward zero)."""


def check_float32_weights_in_triton(device, tiles, round_weights):
    from hibana_kernels import moe_triton

    tokens, top_k, num_experts, hidden, inter = 3, 2, 4, 64, 32
    gen = torch.Generator().manual_seed(4)
    experts = MoEExperts("dense", w13=(torch.randn(num_experts, 2 * inter, hidden, generator=gen) / 8).to(torch.bfloat16),
                         w2=torch.zeros(num_experts, hidden, inter, dtype=torch.bfloat16),
                         b2=torch.full((num_experts, hidden), 1.5), round_weights=round_weights)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((tokens, top_k), _WEIGHT)
    on = {name: getattr(experts, name) for name in ("w13", "w2", "b2")}
    out = moe_triton.fused_moe_launch(
        x.to(device), MoEExperts("dense", **{k: v.to(device) for k, v in on.items()}, round_weights=round_weights),
        weights.to(device), ids.to(device), tiles).cpu()
    expected = moe.fused_moe(x, experts, weights, ids)
    if round_weights:  # the interpreter's rounding toward zero gives 2 * 1.5, compiled Triton's as the reference
        assert out.unique().tolist() in ([3.0], expected.unique().tolist())
    else:
        assert expected.unique().tolist() == [2 * 1.5078125]
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("path", ["decode", "decode-per-route", "grouped"])
@pytest.mark.parametrize("round_weights", [False, True])
def test_triton_experts_keep_float32_routing_weights_where_asked(run_check, path, round_weights):
    from hibana_kernels.moe_triton import DecodeTiles, GroupedTiles

    tiles = {"decode": DecodeTiles(16, 32, 4), "decode-per-route": DecodeTiles(16, 32, 4, down_per_route=True),
             "grouped": GroupedTiles(16, 32, 32, 4, 1)}[path]
    run_check(check_float32_weights_in_triton, tiles=tiles, round_weights=round_weights)
