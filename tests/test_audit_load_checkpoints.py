"""Checkpoints as an outside tester builds them: damaged values, and what loading them says."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from hibana_core import CheckpointError, SamplingParams


def _edited(source, dst, change):
    shutil.copytree(source, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value, held", [(float("nan"), "NaN"), (float("inf"), "infinite")])
def test_a_weight_that_is_not_finite_is_a_damaged_checkpoint(value, held, tiny_checkpoints, make_engine, tmp_path):
    """A NaN or infinity in a weight loaded in silence, and the model answered every prompt
    with token 0 (argmax of NaN logits); it is a CheckpointError naming the tensor."""
    name = "model.layers.1.mlp.down_proj.weight"
    path = _edited(tiny_checkpoints["qwen2"], tmp_path / "bad", lambda t: t[name].view(-1)[7:10].fill_(value))
    with pytest.raises(CheckpointError, match=rf"{name} of .*bad holds 3 {held} values .*damaged: re-download"):
        make_engine(path)


def test_values_past_float16s_range_say_to_load_in_bfloat16(tiny_checkpoints, make_engine, tmp_path):
    """A float32 checkpoint's large values become infinite in float16: the error says which dtype
    loads it, and float32 does."""
    name = "model.layers.0.self_attn.o_proj.weight"
    path = _edited(tiny_checkpoints["llama"], tmp_path / "large", lambda t: t[name].view(-1)[0].fill_(1e5))
    with pytest.raises(CheckpointError, match=r"o_proj.weight .* 1 infinite value .*float16.*dtype='bfloat16'"):
        make_engine(path, dtype="float16")
    engine = make_engine(path, speculation="off")
    out = engine.open_state("a").generate(SamplingParams(max_tokens=3, ignore_eos=True), prompt=[5, 6, 7])
    assert len(out.token_ids) == 3
