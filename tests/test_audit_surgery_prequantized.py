"""Audit of pre-quantized and surgery checkpoints: what loading them costs in memory."""

from __future__ import annotations

import random

import pytest

from hibana_core import SamplingParams
from hibana_core.errors import CheckpointError
from hibana_core.models.decoder import Linear
from hibana_core.models.moe import StackedExperts
from fp8_checkpoints import write_fp8_checkpoint
from test_prequantized import write_quantized
from tiny_models import EVERY_TENSOR_USED, random_tokens

pytestmark = EVERY_TENSOR_USED


def _record_replaced(monkeypatch) -> list[tuple[str, str]]:
    """(what, device type) of every float weight a packed one replaces while loading."""
    replaced = []
    set_packed, set_packed_stacks = Linear.set_packed, StackedExperts.set_packed_stacks

    def packed(self, *args, **kwargs):
        replaced.append(("linear", self.weight.device.type))
        return set_packed(self, *args, **kwargs)

    def stacks(self, *args, **kwargs):
        replaced.append(("experts", self.gate_up_proj.device.type))
        return set_packed_stacks(self, *args, **kwargs)

    monkeypatch.setattr(Linear, "set_packed", packed)
    monkeypatch.setattr(StackedExperts, "set_packed_stacks", stacks)
    return replaced


@pytest.mark.parametrize("arch, method", [("llama", "gptq"), ("qwen3_moe", "awq"), ("qwen3", "fp8"),
                                          ("qwen3_moe", "surgery")])
def test_packed_checkpoints_never_hold_their_layers_dense(arch, method, tiny_checkpoints, make_engine, tmp_path,
                                                           monkeypatch):
    """A GPTQ / AWQ / FP8 / `hibana surgery` checkpoint's packed layers take their packed tensors
    before any dense weight of theirs is allocated: loading a 70B AWQ checkpoint (~40 GB) must not
    first allocate its 140 GB of bf16 weights (it was the whole model, dense, on the device)."""
    from hibana_core.surgery import checkpoint

    dst = tmp_path / f"{arch}-{method}"
    if method == "fp8":
        reference = write_fp8_checkpoint(tiny_checkpoints[arch], dst, "fp8")
    elif method == "surgery":
        checkpoint.save(make_engine(tiny_checkpoints[arch], surgery=[{"name": "w4", "group_size": 32}],
                                    surgery_guard=False), tiny_checkpoints[arch], dst)
        reference = None
    else:
        reference = write_quantized(tiny_checkpoints[arch], dst, method)
    replaced = _record_replaced(monkeypatch)
    packed = make_engine(dst, speculation="off")
    assert replaced and {device for _, device in replaced} == {"meta"}, replaced
    assert ("experts", "meta") in replaced if arch == "qwen3_moe" else True
    if reference is not None:  # and they compute what they did
        monkeypatch.undo()
        dense = make_engine(reference, speculation="off")
        prompt = random_tokens(random.Random(7), 29)
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert list(packed.open_state("a").generate(greedy, prompt=prompt).token_ids) == \
            list(dense.open_state("a").generate(greedy, prompt=prompt).token_ids)


@pytest.mark.parametrize("override", [{"sym": True}, {"group_size": 128, "desc_act": False}, {"sym": False},
                                      {"desc_act": True}, {"bits": 4, "group_size": 128}])
def test_a_gptq_dynamic_override_that_keeps_the_packing_loads(override):
    """GPTQModel's `dynamic` overrides are refused where they change a module's packing (bits,
    group size), not where they restate a default the config leaves out (group_size 128, sym
    true) nor where they change what each layer's tensors say themselves (sym: its zeros;
    desc_act: its g_idx). They were refused as "their own bits or group size"."""
    from hibana_core.surgery.formats import parse_quantization_config

    fmt = parse_quantization_config({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down_proj": override}})
    assert fmt.group_size == 128 and fmt.is_quantized("model.layers.0.mlp.down_proj")
    with pytest.raises(CheckpointError, match="own bits or group size"):
        parse_quantization_config({"quant_method": "gptq", "bits": 4, "dynamic": {r".*down_proj": {"group_size": 64}}})
