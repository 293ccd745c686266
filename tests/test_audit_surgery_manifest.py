"""Audit of `hibana surgery` checkpoints from outside: a manifest (hibana_surgery.json) edited by
hand, or of another checkpoint, is refused while loading with a CheckpointError, and never makes
the checkpoint pass for its source in the state files' fingerprint."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch

from hibana_core.errors import CheckpointError, StateFileError
from tiny_models import EVERY_TENSOR_USED, open_engine, random_tokens

pytestmark = EVERY_TENSOR_USED

W4 = {"name": "w4", "group_size": 32}


@pytest.fixture(scope="module")
def written(tiny_checkpoints, tmp_path_factory):
    """(source, a w4 checkpoint of it written by `hibana surgery`'s writer, its manifest)."""
    from hibana_core.surgery import checkpoint

    source = tiny_checkpoints["qwen3"]
    out = tmp_path_factory.mktemp("manifest") / "w4"
    with open_engine(source, surgery=[W4], surgery_guard=False, speculation="off") as engine:
        checkpoint.save(engine, source, out)
    return source, out, json.loads((out / checkpoint.MANIFEST).read_text())


def _edited(written, tmp_path, edit):
    _, out, manifest = written
    copy = shutil.copytree(out, tmp_path / "edited")
    manifest = json.loads(json.dumps(manifest))
    edit(manifest)
    (copy / "hibana_surgery.json").write_text(json.dumps(manifest))
    return copy


def test_a_manifest_whose_passes_were_edited_is_no_longer_its_source(written, tmp_path):
    """The checkpoint takes its source's fingerprint only as written: with its passes taken out
    of the manifest, it computed in int4 while a state saved by the unquantized source loaded
    into it (the fingerprint read the weight files alone, not the manifest beside them)."""
    source, _, _ = written
    edited = _edited(written, tmp_path, lambda m: m.update(passes=[]))
    prompt = random_tokens(random.Random(4), 40)
    with open_engine(source, speculation="off") as plain:
        state = plain.open_state("a")
        state.sync(prompt)
        state.save(tmp_path / "plain.state")
    with open_engine(edited, speculation="off") as engine:
        assert engine.model.model.layers[0].mlp.down_proj.kind == "int4"
        with pytest.raises(StateFileError):
            engine.load_state(tmp_path / "plain.state")


def _first(manifest):
    return manifest["packed_layers"][next(iter(manifest["packed_layers"]))]


@pytest.mark.parametrize("edit, says", [
    (lambda m: _first(m).update(group_size=64), "group"),
    (lambda m: _first(m).update(group_size=0), "group"),
    (lambda m: _first(m).update(group_size="32"), "group"),
    (lambda m: _first(m).update(kind="int8"), "int8"),
    (lambda m: _first(m).update(kind="int3"), "packed_layers"),
    (lambda m: _first(m).pop("kind"), "packed_layers"),
    (lambda m: m["packed_layers"].update({next(iter(m["packed_layers"])): [1]}), "packed_layers"),
    (lambda m: m.update(packed_layers=["model.layers.0.mlp.down_proj"]), "packed_layers"),
    (lambda m: m.update(packed_experts=["model.layers.0.mlp.experts"]), "packed_experts"),
    (lambda m: m.update(kv_scaled_layers="model.layers.0.self_attn"), "kv_scaled_layers"),
    (lambda m: m["passes"][0].pop("params"), "passes"),
], ids=["group64", "group0", "group-str", "kind-int8", "kind-int3", "no-kind", "spec-list", "layers-list",
        "experts-list", "kv-str", "record-without-params"])
def test_a_manifest_that_disagrees_with_the_weights_is_a_checkpoint_error(written, tmp_path, edit, says):
    """A packed layer's kind or group size that its tensors do not have loaded, and the first
    forward failed ("model step failed": a shape error, a division by zero); a manifest entry of
    another shape was a KeyError / TypeError / AttributeError / ValueError (a pass record without
    its parameters: a KeyError where the fingerprint read them)."""
    edited = _edited(written, tmp_path, edit)
    with pytest.raises(CheckpointError, match=says):
        open_engine(edited, speculation="off")


def test_a_surgery_checkpoint_without_its_manifest_says_the_manifest_is_missing(written, tmp_path):
    """It said the config.json had no quantization_config, as for a GPTQ / AWQ checkpoint that
    lost its config, where Hibana's own manifest is what is missing."""
    _, out, _ = written
    copy = shutil.copytree(out, tmp_path / "no-manifest")
    (copy / "hibana_surgery.json").unlink()
    with pytest.raises(CheckpointError, match=r"written by `hibana surgery`, whose manifest \(hibana_surgery.json\)"):
        open_engine(copy, speculation="off")


@pytest.mark.parametrize("edit", [lambda s: torch.ones(2, 3), lambda s: torch.zeros_like(s), lambda s: s.to(torch.int32)],
                         ids=["other-heads", "zero", "integer"])
def test_kv8_scales_that_are_not_kv8s_are_a_checkpoint_error(tiny_checkpoints, tmp_path, edit):
    """A kv_scale of another model's KV heads was a ValueError from the layer; zero ones (an
    integer cast) loaded and every generated token was the same one (the fp8 KV saturated)."""
    from safetensors.torch import load_file, save_file

    from hibana_core.surgery import checkpoint

    source, out = tiny_checkpoints["qwen3"], tmp_path / "kv8"
    with open_engine(source, surgery=["kv8"], surgery_guard=False, speculation="off") as engine:
        checkpoint.save(engine, source, out)
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.self_attn.kv_scale"
    tensors[name] = edit(tensors[name])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name} is .* positive floats"):
        open_engine(out, speculation="off")


def test_an_activation_order_that_is_not_a_permutation_of_the_inputs_is_a_checkpoint_error(tiny_checkpoints,
                                                                                           tmp_path):
    """A GPTQ act-order layer written by `hibana surgery` keeps its input order as `perm`; one of
    another length or dtype loaded and failed in the first forward."""
    from safetensors.torch import load_file, save_file

    from hibana_core.surgery import checkpoint
    from test_prequantized import write_quantized

    source, out = tmp_path / "gptq", tmp_path / "written"
    write_quantized(tiny_checkpoints["qwen3"], source, "gptq", desc_act=True)
    with open_engine(source, speculation="off") as engine:
        checkpoint.save(engine, source, out)
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.perm"
    for wrong in (tensors[name].float(), tensors[name][:-2]):
        save_file({**tensors, name: wrong}, out / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=f"{name} is "):
            open_engine(out, speculation="off")


@pytest.fixture(scope="module")
def written_kv8(tiny_checkpoints, tmp_path_factory):
    """(source, a kv8 checkpoint of it written by `hibana surgery`'s writer, its manifest)."""
    from hibana_core.surgery import checkpoint

    source = tiny_checkpoints["qwen3"]
    out = tmp_path_factory.mktemp("manifest") / "kv8"
    with open_engine(source, surgery=["kv8"], surgery_guard=False, speculation="off") as engine:
        checkpoint.save(engine, source, out)
    return source, out, json.loads((out / checkpoint.MANIFEST).read_text())


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(kv_scaled_layers=[]), r"names the kv8 pass.*name none of them \(missing: "
                                              r"model.layers.0.self_attn, model.layers.1.self_attn\)"),
    (lambda m: m.pop("kv_scaled_layers"), "names the kv8 pass.*name none of them"),
    (lambda m: m["kv_scaled_layers"].pop(), r"names the kv8 pass.*name 1 of them \(missing: "
                                            r"model.layers.1.self_attn\)"),
    (lambda m: m.update(passes=[]), r"lists kv_scaled_layers \(2\).*do not name kv8"),
], ids=["none-listed", "no-list", "one-missing", "no-kv8-pass"])
def test_a_kv8_manifest_without_its_kv_scaled_layers_is_a_checkpoint_error(written_kv8, tmp_path, edit, says):
    """A manifest naming the kv8 pass but listing no KV-scaled layers (or only some) loaded with the KV
    cache in the compute dtype, silently, the engine reporting kv8 applied (its scales lay unread in the
    weights); layers listed without a kv8 pass, an fp8 cache no pass accounts for. Each is a
    CheckpointError naming the manifest and saying how to write it again; as written, it loads in fp8."""
    source, out, _ = written_kv8
    with open_engine(out, speculation="off") as engine:
        assert engine.kv_cache.dtype == torch.float8_e4m3fn and [r["name"] for r in engine.surgery] == ["kv8"]
    edited = shutil.copytree(out, tmp_path / "edited")
    manifest = json.loads((out / "hibana_surgery.json").read_text())
    edit(manifest)
    (edited / "hibana_surgery.json").write_text(json.dumps(manifest))
    named = re.escape(str(edited / "hibana_surgery.json"))
    with pytest.raises(CheckpointError, match=rf"^{named} {says}.*damaged: re-run `hibana surgery` on its source "
                                              rf"\({re.escape(str(source))}\) with (its|the) passes"):
        open_engine(edited, speculation="off")
