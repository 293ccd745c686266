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


def test_a_surgery_checkpoint_keeps_the_named_chat_templates(tiny_checkpoints, make_engine, tmp_path):
    """transformers writes a tokenizer's named templates (its tool_use one) in
    additional_chat_templates/; `hibana surgery --out` left them behind, so the written checkpoint
    rendered tools with its default template."""
    from hibana_core.cli import main

    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoints["qwen3"], source)
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools | tojson }}")
    out = tmp_path / "w8"
    assert main(["surgery", str(source), "--passes", "w8", "--no-guard", "--device", "cpu", "--out", str(out)]) == 0
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools | tojson }}"
    engine = make_engine(out, speculation="off")
    assert set(engine.tokenizer.chat_template) == {"default", "tool_use"}


def test_an_end_token_outside_the_vocabulary_is_left_out(tiny_checkpoints, make_engine, tmp_path):
    """generation_config.json naming an eos id the model cannot generate (a tokenizer's, past the
    model's vocabulary) made every request with a grammar fail with xgrammar's RuntimeError."""
    import json

    path = tmp_path / "eos"
    shutil.copytree(tiny_checkpoints["qwen3"], path)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [0, 100000]}))
    with pytest.warns(UserWarning, match=r"eos_token_id \[100000\] lies outside the model's vocabulary of 512"):
        engine = make_engine(path, speculation="off")
    assert engine.eos_token_ids == {0}
    out = engine.open_state("a").generate(SamplingParams(max_tokens=4, json_schema={"type": "object"}), prompt=[5, 6])
    assert out.finish_reason in ("stop", "length")


def test_a_missing_output_head_names_tie_word_embeddings(tiny_checkpoints, make_engine, tmp_path):
    """A checkpoint whose head is its embedding but whose config forgot to say so (an export that
    drops tie_word_embeddings): the error says which flag loads it, not only "incomplete"."""
    import json

    path = _edited(tiny_checkpoints["llama"], tmp_path / "headless", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lacks weights lm_head.weight; .*\"tie_word_embeddings\": true"):
        make_engine(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    make_engine(path, speculation="off")
