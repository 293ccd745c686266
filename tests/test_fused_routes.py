"""The decoder's fused-kernel routes, taken on the CPU: the GPU decides them by device and
fusion policy, which the CPU never meets, so here the references are told to take them and the
engine's greedy output is held to transformers' on those routes too."""

from __future__ import annotations

import pytest
import torch

import hibana_kernels as kernels
from hibana_core import SamplingParams
from hibana_kernels import matmul
from tiny_models import assert_greedy_matches, make_tiny_checkpoint


@pytest.mark.parametrize("arch, overrides, glu", [
    ("llama", {}, "silu"),  # after the foldable norm: `rms_norm_linear(..., glu=)`
    ("qwen2", dict(hidden_act="gelu_pytorch_tanh"), "gelu_tanh"),
    ("gemma3", {}, "gelu_tanh"),  # after Gemma's norm (by 1 + weight): `rms_norm_linear(..., glu=, unit_offset=True)`
])
def test_the_mlp_activation_in_the_gate_up_gemv_matches_transformers(tmp_path, make_engine, monkeypatch, arch,
                                                                     overrides, glu):
    """Where `kernels.folds_glu` says (one decode row under a policy with the GLU epilogue), the
    MLP asks its gate/up projection for act(gate) * up and the down projection takes that as it
    is: the route must be taken and must give transformers' tokens."""
    taken = []
    linear = matmul.linear

    def counted(x, weight, bias=None, glu=None):
        taken.append(glu)
        return linear(x, weight, bias, glu)

    monkeypatch.setattr(matmul, "folds_glu", lambda x, weight, glu: True)
    monkeypatch.setattr(matmul, "linear", counted)
    path = make_tiny_checkpoint(arch, tmp_path / arch, **overrides)
    history = list(range(3, 50))
    c = make_engine(path).open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    assert glu in taken, f"the MLP never asked for {glu} in the GEMV"
    assert_greedy_matches(path, history, c.token_ids)


def test_no_route_folds_the_activation_on_the_cpu():
    assert not kernels.folds_glu(torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(6, 8, dtype=torch.bfloat16), "silu")


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_both_linear_attention_inputs_fold_the_norm_and_match_transformers(tmp_path, make_engine, monkeypatch, arch):
    """Where `kernels.folds_norm` says, a linear-attention layer's two input projections each fold
    its norm (the second from the stream the first wrote, without a residual): the route must be
    taken on every linear layer and must give transformers' tokens."""
    folds = []
    rms_norm_linear = matmul.rms_norm_linear

    def counted(x, residual, norm_weight, eps, weight, bias=None, glu=None, unit_offset=False):
        folds.append((weight.shape[0], residual is None, unit_offset))
        return rms_norm_linear(x, residual, norm_weight, eps, weight, bias, glu, unit_offset)

    monkeypatch.setattr(matmul, "folds_norm", lambda x, weight, norm_weight: True)
    monkeypatch.setattr(matmul, "rms_norm_linear", counted)
    path = make_tiny_checkpoint(arch, tmp_path / arch)
    history = list(range(3, 50))
    engine = make_engine(path)
    c = engine.open_state("a").generate(SamplingParams(max_tokens=12, ignore_eos=True), prompt=history)
    narrow = 2 * engine.model_args.linear_attention.num_value_heads  # b and a: a row each a value head
    assert all(unit_offset for _, _, unit_offset in folds), "Qwen3.5's norms are Gemma's"
    assert any(rows == narrow and without for rows, without, _ in folds), "the narrow projection never folded"
    assert_greedy_matches(path, history, c.token_ids)
