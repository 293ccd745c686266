"""The tokens generation stops at are those transformers' `generate` stops at for the same
checkpoint: generation_config.json's eos_token_id where the file exists and reads (none there: no
EOS at all, as `generate` then has none), config.json's where there is no such file or it is not
JSON (transformers then makes its generation config from config.json). Held token for token
against `generate` on the model `from_pretrained` loads, its own generation config and all."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from hibana_core import SamplingParams
from tiny_models import EOS_ID, hf_greedy, open_engine, random_tokens

ARCH = "llama"
MAX_NEW = 12
STOP_AT = 4  # the continuation's token there is made the EOS


def hf_generate(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What `generate` gives on the model as transformers loads it: its generation config (EOS
    included) from the checkpoint, greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=EOS_ID)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def continuation(tiny_checkpoints):
    """(prompt, its greedy continuation ignoring any EOS, a token first met at STOP_AT in it, a
    token it never holds)."""
    path = tiny_checkpoints[ARCH]
    rng = random.Random(5)
    for _ in range(50):
        prompt = random_tokens(rng, 24)
        tokens = hf_greedy(str(path), prompt, MAX_NEW)
        stop = tokens[STOP_AT]
        if stop not in tokens[:STOP_AT] and stop != EOS_ID:
            unused = next(t for t in range(1, 500) if t not in tokens)
            return prompt, tokens, stop, unused
    raise AssertionError("no prompt whose continuation meets a new token at STOP_AT")


def checkpoint_with(source, path, config_eos, generation) -> object:
    """A copy of `source` whose config.json names `config_eos` and whose generation_config.json
    holds `generation` (bytes as they are; a dict as JSON; None: no such file)."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": config_eos}))
    (path / "generation_config.json").unlink()
    if isinstance(generation, bytes):
        (path / "generation_config.json").write_bytes(generation)
    elif generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


CASES = {  # name -> (config.json's eos, generation_config.json, the eos the engine must stop at)
    "no generation config": ("stop", None, {"stop"}),
    "an int there": ("unused", {"eos_token_id": "stop", "do_sample": False}, {"stop"}),
    "a list there": ("unused", {"eos_token_id": ["unused", "stop"]}, {"unused", "stop"}),
    "none there": ("stop", {"do_sample": False}, set()),
    "null there": ("stop", {"eos_token_id": None}, set()),
    "damaged": ("stop", b"{not json", {"stop"}),
}


@pytest.mark.filterwarnings("ignore:.*generation_config.json (names no eos_token_id|is damaged)")
@pytest.mark.parametrize("case", list(CASES))
def test_generation_stops_where_transformers_generate_does(case, continuation, tiny_checkpoints, tmp_path):
    prompt, tokens, stop, unused = continuation
    names = {"stop": stop, "unused": unused}

    def named(value):
        return [named(v) for v in value] if isinstance(value, list) else names.get(value, value)

    config_eos, generation, wanted = CASES[case]
    if isinstance(generation, dict):
        generation = {k: named(v) for k, v in generation.items()}
    path = checkpoint_with(tiny_checkpoints[ARCH], tmp_path / "c", named(config_eos), generation)
    want = hf_generate(path, prompt, MAX_NEW)
    assert want == (tokens[:STOP_AT + 1] if "stop" in wanted else tokens)  # the case is what it says
    with open_engine(path) as engine:
        assert engine.eos_token_ids == {names[n] for n in wanted}
        got = engine.open_state("a").generate(SamplingParams(max_tokens=MAX_NEW), prompt=prompt)
    assert list(got.token_ids) == want
    assert got.finish_reason == ("stop" if "stop" in wanted else "length")


def test_an_in_memory_model_stops_where_its_own_generate_does(continuation, tiny_checkpoints, tmp_path):
    """`from_hf_model`: the model's generation config is what its `generate` reads; one without an
    EOS stops nowhere (config.json's was taken), a stand-in with no generation config at config's."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from hibana_core import Engine

    prompt, tokens, stop, _ = continuation
    path = checkpoint_with(tiny_checkpoints[ARCH], tmp_path / "c", stop, {"do_sample": False})
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    options = dict(device="cpu", dtype="float32", block_size=16, num_blocks=32, progress=False)
    for generation, wanted in [(model.generation_config, set()),
                               (GenerationConfig.from_model_config(model.config), {stop})]:
        model.generation_config = generation
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                  do_sample=False, pad_token_id=EOS_ID)[0, len(prompt):].tolist()
        with Engine.from_hf_model(model, **options) as engine:
            assert engine.eos_token_ids == wanted
            assert list(engine.open_state("a").generate(SamplingParams(max_tokens=MAX_NEW), prompt=prompt)
                        .token_ids) == want


def test_a_generation_config_without_eos_says_what_it_changes(continuation, tiny_checkpoints, tmp_path):
    """config.json names an EOS that generate (and so the engine) does not stop at: a warning says
    so and how to stop there."""
    _, _, stop, _ = continuation
    path = checkpoint_with(tiny_checkpoints[ARCH], tmp_path / "c", stop, {"do_sample": False})
    with pytest.warns(UserWarning, match=rf"generation_config\.json names no eos_token_id.*config\.json's \({stop}\)"):
        open_engine(path).close()


EOS_TEMPLATE = """{%- for m in messages %}
{%- if m.role == "user" %}{{- "[INST] " + m.content + "[/INST]" }}
{%- elif m.role == "assistant" %}{{- " " + m.content + eos_token }}
{%- endif %}
{%- endfor %}"""
"""Mistral's and Llama 2's way: the tokenizer's eos_token ends an assistant turn."""


@pytest.mark.filterwarnings("ignore:.*generation_config.json names no eos_token_id")
def test_a_template_that_ends_turns_with_eos_token_ends_them_there_without_a_model_eos(tmp_path):
    """A chat turn ended at the model's EOS where the template writes eos_token after a reply; a
    checkpoint whose generation_config.json names none still ends its turns there."""
    import tiny_models

    from hibana_core.chat import Chat
    from hibana_core.speculation import force_outputs

    path = tiny_models.make_tiny_checkpoint("mistral", tmp_path / "m")
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.chat_template = EOS_TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    with open_engine(path) as engine:
        assert not engine.eos_token_ids
        reply = engine.tokenizer.encode("hello there", add_special_tokens=False)
        after = engine.tokenizer.encode(" and more", add_special_tokens=False)
        force_outputs(engine.open_state("a"), reply + [EOS_ID] + after)
        result = Chat(engine, "a").respond([{"role": "user", "content": "hi"}], None,
                                           SamplingParams(max_tokens=len(reply) + 1 + len(after)))
    assert (result.text, result.finish_reason) == ("hello there", "stop")
    assert result.usage.completion_tokens == len(reply) + 1


def test_the_configs_own_eos_comes_before_its_text_configs():
    """transformers' GenerationConfig.from_model_config takes a multimodal config's own
    eos_token_id, and its text (decoder) config's only where it has none."""
    from transformers import Gemma3Config, GenerationConfig

    from hibana_core.loader import _config_eos

    for config in (Gemma3Config(text_config={"eos_token_id": 7}, eos_token_id=5),
                   Gemma3Config(text_config={"eos_token_id": 7})):
        assert _config_eos(config) == GenerationConfig.from_model_config(config).eos_token_id
    assert _config_eos(Gemma3Config(text_config={"eos_token_id": 7}, eos_token_id=5)) == 5
