"""gpt-oss beyond the golden tests: YaRN's tables as transformers computes them, and MXFP4
checkpoints (the released format) loaded as they are, matching transformers' dequantized model."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.models import gpt_oss
from hibana_kernels.moe import E2M1_VALUES, MXFP4_BLOCK
from tiny_models import _hf_model, assert_greedy_matches, make_config, random_tokens


@pytest.mark.parametrize("rope", [
    {},  # the tiny checkpoint's: gpt-oss's own parameters
    dict(truncate=True, beta_fast=16.0, beta_slow=2.0),
    dict(factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=256),
    dict(attention_factor=1.25),
], ids=["gpt-oss", "truncated", "mscale", "given-attention-factor"])
def test_yarn_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**make_config("gpt_oss").rope_parameters, **rope}
    config = make_config("gpt_oss", rope_parameters={k: v for k, v in params.items() if v is not None})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = gpt_oss.args_from_config(config).ropes[0]
    assert torch.equal(ours.inv_freq(), inv_freq)
    assert ours.attention_factor == attention_factor
    kept = (ours.inv_freq() == 1.0 / ours.theta ** (torch.arange(0, 16, 2).float() / 16)).sum()
    assert 0 < kept < 8, "the tiny config should keep some frequencies and scale others"


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> MXFP4 (blocks uint8 [..., K // 32, 16], e8m0 scales uint8 [..., K // 32]):
    each block's scale the power of two that puts its largest magnitude in [4, 8), each value
    rounded to the nearest e2m1 code; the even index in the low nibble."""
    groups = w.float().unflatten(-1, (-1, MXFP4_BLOCK))
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -126))) - 2
    x = groups / torch.exp2(exponent)[..., None]
    magnitude = (x.abs()[..., None] - torch.tensor(E2M1_VALUES[:8])).abs().argmin(-1)
    codes = (magnitude | ((x < 0).long() << 3)).unflatten(-1, (MXFP4_BLOCK // 2, 2))
    return (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8), (exponent + 127).to(torch.uint8)


def make_mxfp4_checkpoint(source, path):
    """`source` (a float gpt_oss checkpoint) with its experts in MXFP4, as the released
    checkpoints hold them: gate_up_proj_blocks [E, 2I, H // 32, 16] (rows interleaved gate, up),
    down_proj_blocks [E, H, I // 32, 16], their scales, and quantization_config mxfp4."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] there
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            tensors[name] = tensor
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "dequantize": True}  # transformers' load option (on CPU it dequantizes anyway, but asks for
    # accelerate unless told); Hibana reads the blocks and scales all the same
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mxfp4_checkpoint_loads_as_is_and_matches_transformers_dequantized(tiny_checkpoints, make_engine, tmp_path):
    """The experts stay MXFP4 in the engine (blocks and scales, deinterleaved), and greedy output
    equals transformers' on the same checkpoint, which dequantizes the experts to float32 on CPU."""
    path = make_mxfp4_checkpoint(tiny_checkpoints["gpt_oss"], tmp_path / "mxfp4")
    hf_experts = _hf_model(str(path)).model.layers[0].mlp.experts
    assert hf_experts.gate_up_proj.dtype == torch.float32, "transformers should have dequantized"
    engine = make_engine(path)
    experts = engine.model.model.layers[0].mlp.experts.kernel_experts()
    assert experts.kind == "mxfp4" and experts.w13.dtype == torch.uint8
    assert torch.equal(experts.expert_weights(3, torch.float32)[0][:32],
                       hf_experts.gate_up_proj[3].t()[0::2])  # gate rows: the even ones there
    float_engine = make_engine(tiny_checkpoints["gpt_oss"])
    history = random_tokens(random.Random(7), 70)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = list(engine.open_state("q").generate(params, prompt=history).token_ids)
    assert_greedy_matches(path, history, got)
    unquantized = list(float_engine.open_state("f").generate(params, prompt=history).token_ids)
    assert got != unquantized, "MXFP4 rounding should change this tiny model's output"
