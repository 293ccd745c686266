"""Bad input gives its own HibanaError, leaves the state unchanged, and the engine keeps serving."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hibana_core
import hibana_plugins
from hibana_core import (CheckpointError, ConfigError, ContextLengthError, HibanaError,
                         InvalidTokenError, SamplingParams, StateClosedError, UnsupportedModelError,
                         errors)
from hibana_core.detokenizer import token_bytes
from hibana_plugins.manager import PluginError
from tiny_models import (VOCAB_SIZE, assert_greedy_matches, hf_greedy, make_tiny_checkpoint, make_tokenizer,
                         open_engine, random_tokens)

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma3_text", "phi3", "qwen3_moe", "gpt_oss")
ARCH = "llama"

pytestmark = pytest.mark.timeout(300)


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


class Bystander:
    """An agent that holds a state through other agents' failures and must come out intact."""

    def __init__(self, engine, path, name: str, length: int = 70):
        self.engine, self.path, self.name = engine, path, name
        self.history = random_tokens(random.Random(name), length)
        self.h = engine.open_state(name)
        self.h.sync(self.history)
        self.checks = 0

    def check(self) -> None:
        """The held state generates HF's output, and so does a handle opened now."""
        assert self.h.tokens == self.history
        assert_greedy_matches(self.path, self.history, list(self.h.generate(greedy()).token_ids))
        self.h.truncate(len(self.history))
        self.checks += 1
        new = self.engine.open_state(f"{self.name}-new-{self.checks}")
        prefix = self.history[:len(self.history) // 2]
        new.sync(prefix)
        assert_greedy_matches(self.path, prefix, list(new.generate(greedy()).token_ids))
        new.close()


@pytest.fixture(scope="module", params=[None, True], ids=["default", "async-scheduling"])
def served(tiny_checkpoints, request):
    """One engine for the whole module: every failure below happens on it, in turn; once as the
    CPU runs by default, once with async scheduling (the CUDA default)."""
    path = tiny_checkpoints[ARCH]
    engine = open_engine(path, async_scheduling=request.param)
    yield engine, path
    engine.close()


@pytest.fixture
def bystander(served, request):
    engine, path = served
    b = Bystander(engine, path, f"bystander-{request.node.name}")
    yield b
    b.h.close()


def test_every_error_is_a_hibana_error():
    assert hibana_core.HibanaError is errors.HibanaError
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) >= 10
    for cls in classes:
        assert issubclass(cls, HibanaError), cls


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_every_hibana_error_in_hibana_core_is_importable_from_hibana_core():
    """The README and callers write `from hibana_core import XError`: an error class defined in any
    hibana_core module (found by importing them all) is exported there and from `errors`."""
    for module in pkgutil.walk_packages(hibana_core.__path__, "hibana_core."):
        importlib.import_module(module.name)
    defined = {c for c in _subclasses(HibanaError) if c.__module__.split(".")[0] == "hibana_core"}
    assert len(defined) >= 20
    for cls in defined:
        assert cls.__name__ in hibana_core.__all__, cls
        assert getattr(hibana_core, cls.__name__) is cls, cls
        assert cls.__name__ in errors.__all__ and cls.__module__ == errors.__name__, cls


def test_every_hibana_error_a_plugin_module_defines_is_importable_from_hibana_core():
    """A caller catches what the plugin manager and adapters raise (PluginError for a missing or
    conflicting plugin name) by importing it from `hibana_core`, as every other HibanaError."""
    for module in pkgutil.walk_packages(hibana_plugins.__path__, "hibana_plugins."):
        try:
            importlib.import_module(module.name)
        except ImportError:  # an adapter whose framework is not installed
            continue
    defined = {c for c in _subclasses(HibanaError) if c.__module__.split(".")[0] == "hibana_plugins"}
    assert PluginError in defined
    for cls in defined:
        assert cls.__name__ in hibana_core.__all__ and getattr(hibana_core, cls.__name__) is cls, cls
        assert getattr(errors, cls.__name__) is cls, cls


# --- loading --------------------------------------------------------------------------------

def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_model_type(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=32, n_layer=1, n_head=2,
                               n_positions=64)).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    with pytest.raises(UnsupportedModelError) as e:
        open_engine(tmp_path)
    message = str(e.value)
    assert "gpt2" in message
    for name in SUPPORTED:
        assert name in message, f"the message should list the supported model types: {message}"


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(CheckpointError) as e:
        open_engine(missing)
    assert str(missing) in str(e.value)


def test_missing_config(tiny_checkpoints, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError):
        open_engine(ckpt)


@pytest.mark.parametrize("content, says", [
    (b"[1, 2]", "a JSON list, not an object"), (b'"llama"', "a JSON str, not an object"),
    (b"null", "a JSON NoneType, not an object"), (b"\xff\xfe{}", "not UTF-8 text"),
    ('{"model_type": "caf\u00e9"}'.encode("latin-1"), "not UTF-8 text"), (b"{}", "has no model_type"),
    (b'{"model_type": ["llama"]}', "not the name of an architecture"),
])
def test_a_config_of_the_wrong_kind_is_a_checkpoint_error(tiny_checkpoints, tmp_path, content, says):
    """A config.json that is JSON but no object, or no UTF-8, raised TypeError / UnicodeDecodeError
    (invalid JSON was already a CheckpointError); a missing model_type read "('model_type')"."""
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    (ckpt / "config.json").write_bytes(content)
    with pytest.raises(HibanaError, match=re.escape(says)):
        open_engine(ckpt)


@pytest.mark.parametrize("content, says", [
    (b"\xff\x00", "not UTF-8 text"), (b"[1]", "a JSON list, not an object"),
    (b'{"weight_map": [1]}', "its weight_map is list"), (b'{"weight_map": {"a": 1}}', "its weight_map is dict"),
])
def test_a_damaged_index_or_generation_config_is_said(tmp_path, content, says):
    """A weight index or generation_config.json that is not UTF-8, or JSON of another shape, raised
    UnicodeDecodeError / TypeError / AttributeError: the index is a CheckpointError saying it is
    damaged, a generation config a warning (config.json's eos_token_id is used), as invalid JSON was."""
    ckpt = make_tiny_checkpoint("qwen2", tmp_path / "sharded", shard_size="100KB")
    index = (ckpt / "model.safetensors.index.json").read_bytes()
    (ckpt / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(CheckpointError, match="index.json is damaged .*" + re.escape(says)):
        open_engine(ckpt)
    (ckpt / "model.safetensors.index.json").write_bytes(index)
    if b"weight_map" not in content:
        (ckpt / "generation_config.json").write_bytes(content)
        with pytest.warns(UserWarning, match="generation_config.json is damaged .*" + re.escape(says)):
            open_engine(ckpt).close()


def test_missing_weights(tiny_checkpoints, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError):
        open_engine(ckpt)


def test_weights_the_config_does_not_use_are_reported(tiny_checkpoints, tmp_path):
    """A checkpoint whose config names fewer layers than its weights hold loaded in silence (the
    extra layers dropped); transformers reports unexpected keys, and so does the loader now. A
    multimodal checkpoint's vision tower (test_families) and fp8 scales beside their weights are
    not reported."""
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["num_hidden_layers"] > 1
    config["num_hidden_layers"] -= 1
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=rf"tensors this model does not use \(model\.layers\.{config['num_hidden_layers']}\."):
        open_engine(ckpt).close()
    # a bias the config says the layers lack (attention_bias false) is left out and said, as transformers does
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "b")
    tensors = load_file(ckpt / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" not in tensors
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(tensors["model.layers.0.self_attn.q_proj.weight"].shape[0])
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 tensor this model does not use \(model\.layers\.0\.self_attn\.q_proj\.bias\)"):
        open_engine(ckpt).close()


def test_truncated_weights(tiny_checkpoints, tmp_path):
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        open_engine(ckpt)


def test_sharded_weights_load_and_a_missing_shard_fails(tmp_path):
    ckpt = make_tiny_checkpoint("qwen2", tmp_path / "sharded", shard_size="100KB")
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) >= 3 and (ckpt / "model.safetensors.index.json").exists()
    history = random_tokens(random.Random(3), 50)
    with open_engine(ckpt) as engine:
        h = engine.open_state("a")
        h.sync(history)
        assert_greedy_matches(ckpt, history, list(h.generate(greedy()).token_ids))
    shards[1].unlink()
    with pytest.raises(CheckpointError):
        open_engine(ckpt)


def test_bad_engine_options(tiny_checkpoints):
    path = tiny_checkpoints[ARCH]
    with pytest.raises(ConfigError):
        open_engine(path, no_such_option=1)
    with pytest.raises(ConfigError):
        open_engine(path, block_size=12)
    # a nested config given whole must be one (a dict failed with AttributeError, after the weights
    # loaded for scheduler=); max_kv_bytes_cpu must be positive (-1 blamed free memory at start)
    from hibana_core.config import EngineConfig

    for whole, says in ((dict(cache={"block_size": 8}), "cache must be a CacheConfig, got dict"),
                        (dict(scheduler=None), "scheduler must be a SchedulerConfig, got NoneType"),
                        (dict(max_kv_bytes_cpu=-1), "max_kv_bytes_cpu must be a positive number of bytes")):
        with pytest.raises(ConfigError, match=says):
            EngineConfig.from_overrides(str(path), **whole)
    assert "model" not in EngineConfig.option_names()  # the first argument, not an option
    with pytest.raises(errors.MemoryBudgetError, match=r"memory_fraction=1e-07 .* raise memory_fraction"):
        hibana_core.Engine.from_pretrained(path, memory_fraction=1e-7, device="cpu", progress=False)


# --- requests -------------------------------------------------------------------------------

def test_context_longer_than_max_model_len(tiny_checkpoints, make_engine):
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, max_model_len=64)
    other = Bystander(engine, path, "other", length=40)
    history = random_tokens(random.Random(5), 50)
    h = engine.open_state("long")
    h.sync(history)
    with pytest.raises(ContextLengthError):
        h.append(random_tokens(random.Random(6), 20))
    assert h.tokens == history
    with pytest.raises(ContextLengthError):
        h.sync(history + random_tokens(random.Random(7), 20))
    assert h.tokens == history
    with pytest.raises(ContextLengthError):
        engine.open_state("too-long").sync(random_tokens(random.Random(8), 65))
    assert_greedy_matches(path, history, list(h.generate(greedy(8)).token_ids))
    other.check()


def test_context_longer_than_the_model(served, bystander):
    engine, path = served
    limit = 1024  # max_position_embeddings of the tiny checkpoints
    history = random_tokens(random.Random(9), 30)
    h = engine.open_state("longer-than-model")
    h.sync(history)
    with pytest.raises(ContextLengthError) as e:
        h.sync(history + random_tokens(random.Random(10), limit + 1 - len(history)))
    assert str(limit) in str(e.value)
    assert h.tokens == history
    bystander.check()
    assert_greedy_matches(path, history, list(h.generate(greedy()).token_ids))
    h.close()


def test_a_max_model_len_past_the_models_context_is_refused(tiny_checkpoints, make_engine, monkeypatch):
    """More positions than the model has is a ConfigError, before the weights load, not a quiet
    cap that a later ContextLengthError reveals (a new user's trial)."""
    from hibana_core import loader

    path = tiny_checkpoints["llama"]
    limit = make_engine(path).max_model_len
    with monkeypatch.context() as m:
        m.setattr(loader, "_load_weights", lambda *a, **k: pytest.fail("the weights loaded first"))
        with pytest.raises(ConfigError, match=rf"max_model_len={limit + 1} is more than this model's context of "
                                              rf"{limit}"):
            make_engine(path, max_model_len=limit + 1)
    assert make_engine(path, max_model_len=limit).max_model_len == limit


def test_closed_handle(served, bystander, tmp_path):
    engine, _ = served
    h = engine.open_state("to-close")
    h.sync([1, 2, 3])
    h.close()
    ops = {
        "sync": lambda: h.sync([1, 2, 3, 4]),
        "append": lambda: h.append([4]),
        "generate": lambda: h.generate(greedy()),
        "stream": lambda: list(h.stream(greedy())),
        "truncate": lambda: h.truncate(1),
        "fork": lambda: h.fork("from-closed"),
        "save": lambda: h.save(tmp_path / "closed.state"),
        "tokens": lambda: h.tokens,  # a closed state holds nothing to read ([] and 0 before: an empty state's)
        "len": lambda: len(h),
    }
    for name, op in ops.items():
        with pytest.raises(StateClosedError):
            op()
            pytest.fail(f"{name} on a closed handle did not raise")
    bystander.check()


async def test_closed_handle_async(served, bystander):
    engine, _ = served
    h = engine.open_state("to-close-async")
    h.sync([1, 2, 3])
    h.close()
    with pytest.raises(StateClosedError):
        await h.agenerate(greedy())
    with pytest.raises(StateClosedError):
        async for _ in h.astream(greedy()):
            pass
    bystander.check()


@pytest.mark.parametrize("bad", [-1, VOCAB_SIZE, VOCAB_SIZE + 1000])
def test_token_ids_outside_the_vocabulary(bad, served, bystander):
    engine, path = served
    history = random_tokens(random.Random(12), 40)
    h = engine.open_state(f"oov{bad}")
    h.sync(history)
    with pytest.raises(InvalidTokenError):
        h.append([5, bad, 6])
    assert h.tokens == history
    with pytest.raises(InvalidTokenError):
        h.sync(history[:20] + [bad])
    assert h.tokens == history
    with pytest.raises(InvalidTokenError):
        engine.open_state(f"oov-new{bad}").sync([bad])
    bystander.check()
    assert_greedy_matches(path, history, list(h.generate(greedy()).token_ids))
    h.close()


def find_stop_case(path):
    """A history and a stop string that starts inside one generated token and ends inside the
    third; every generated token up to there decodes to plain ASCII, so any detokenizer agrees."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    for seed in range(100):
        history = random_tokens(random.Random(1000 + seed), 40)
        out = hf_greedy(path, history, 32)
        pieces = [tok.decode([t]) for t in out]
        for i in range(4, len(out) - 3):
            window = pieces[i:i + 3]
            if (any(t in tok.all_special_ids for t in out[:i + 3])
                    or not all(p.isascii() and p.isprintable() for p in pieces[:i + 3])
                    or not all(len(p) >= 2 for p in window)):
                continue
            stop = window[0][1:] + window[1] + window[2][:-1]
            full = tok.decode(out[:i + 3])
            before = tok.decode(out[:i])
            start = full.find(stop)
            if full.startswith(before) and start == len(before) + 1:
                return history, out, stop, full[:start], i + 3
    raise AssertionError("no history gave a multi-token stop string; change the seeds")


def test_stop_string_spanning_tokens(served, bystander):
    engine, path = served
    history, out, stop, text, n_tokens = find_stop_case(path)
    h = engine.open_state("stopper")
    h.sync(history)
    c = h.generate(greedy(32, stop=[stop]))
    assert c.finish_reason == "stop"
    assert stop not in c.text
    assert c.text == text
    assert list(c.token_ids) == out[:n_tokens], "generation must end at the token completing the stop"
    assert h.tokens == history + list(c.token_ids)
    # the same request without the stop string runs to max_tokens
    h.sync(history)
    c = h.generate(greedy(32))
    assert c.finish_reason == "length" and list(c.token_ids) == out
    bystander.check()
    h.close()


@pytest.mark.parametrize("stops", [["b", "ab"], ["ab", "b"]])
def test_stop_strings_ending_on_one_character_cut_at_the_first_to_begin(stops):
    """"ab" and "b" complete on the same "b": the text ends before "ab", whatever the list's order
    (it kept the "a" when "b" came first)."""
    from hibana_core.detokenizer import Detokenizer

    class Chars:  # one token per character
        def decode(self, ids, skip_special_tokens=False):
            return "".join(map(chr, ids))

    detok = Detokenizer(Chars(), [], stops)
    streamed = ""
    for char in "xa":
        assert not detok.add(ord(char))
        streamed += detok.take_delta()
    assert detok.add(ord("b"))
    streamed += detok.take_delta(final=True)
    assert detok.text == streamed == "x"


def _byte_fallback_tokenizer():
    """A byte-fallback tokenizer (Llama 2, Mistral, Phi-3 spell characters outside their vocabulary
    so) that has no character but "a" and " ": its decoder writes every byte of a run of byte
    tokens that is not valid UTF-8 as U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def _streamed(tokenizer, history, generated) -> str:
    from hibana_core.detokenizer import Detokenizer

    detok = Detokenizer(tokenizer, history, ())
    streamed = ""
    for token in generated:
        detok.add(token)
        streamed += detok.take_delta()
    streamed += detok.take_delta(final=True)
    assert streamed == detok.text
    return streamed


def test_text_after_a_prompt_ending_in_byte_fallback_characters_is_decoded():
    """The decode window began 4 tokens back, inside the prompt's last character ("テ", after a
    byte of "の"), so the generated "キスト" came out as nine U+FFFD."""
    tokenizer = _byte_fallback_tokenizer()
    prompt = tokenizer.encode("日本語のテ", add_special_tokens=False)
    generated = tokenizer.encode("キスト a", add_special_tokens=False)
    assert len(prompt) == len(generated) + 4  # every character a run of byte tokens
    assert _streamed(tokenizer, prompt, generated) == "キスト a"


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_character_cut_by_one_generation_is_text_of_the_next(kind):
    """max_tokens may end a reply inside a character, whose text then waits for its last byte; the
    next generation on the state finishes it, and its text has the character (it was lost: the
    two texts joined missed it, where decoding all the tokens has it)."""
    tokenizer = make_tokenizer() if kind == "byte_level" else _byte_fallback_tokenizer()
    tokens = tokenizer.encode("The 中文 and 🙂 a", add_special_tokens=False)
    prompt = tokenizer.encode("The", add_special_tokens=False)
    for cut in range(len(prompt) + 1, len(tokens)):
        first = _streamed(tokenizer, prompt, tokens[len(prompt):cut])
        second = _streamed(tokenizer, tokens[:cut], tokens[cut:])
        assert first + second == tokenizer.decode(tokens[len(prompt):]), cut


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_bytes_that_make_no_character_are_replacement_characters_not_held(kind):
    """Generated bytes no later byte can make a character (lone continuation bytes, a lead byte
    followed by another lead) are U+FFFD as the tokenizer decodes them: the text waited for them
    to end a character, and held back every token after them to the end of the reply (a sampled
    reply of 40 tokens came out as its first 8 characters). A lead byte the reply ends on still
    waits for the next generation (the test above)."""
    tokenizer = make_tokenizer() if kind == "byte_level" else _byte_fallback_tokenizer()
    prompt = tokenizer.encode("The", add_special_tokens=False)
    lead, continuation = _byte_tokens(tokenizer, 0xC3), _byte_tokens(tokenizer, 0x9D)
    after = tokenizer.encode(" and then some", add_special_tokens=False)
    for generated in ([continuation] * 5 + after, [lead, lead, lead] + after, after + [continuation] * 3):
        # (a byte-fallback decoder writes a whole run of byte tokens as U+FFFD where one is bad:
        # the text streamed before the bad byte came stays as it was)
        expected = b"".join(map(token_bytes(tokenizer), generated)).decode("utf-8", "replace").replace("\u2581", " ")
        assert _streamed(tokenizer, prompt, generated) == expected
        assert kind == "byte_fallback" or expected == tokenizer.decode(generated)
    assert _streamed(tokenizer, prompt, after + [lead]) == tokenizer.decode(after)


def _byte_tokens(tokenizer, byte: int) -> int:
    """The token id that is this one byte."""
    as_bytes = token_bytes(tokenizer)
    return next(t for t in range(len(tokenizer)) if as_bytes(t) == bytes([byte]))


@pytest.mark.parametrize("bad", [
    dict(max_tokens=-1), dict(temperature=-0.5), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5),
    dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
    dict(frequency_penalty=-2.5), dict(stop=[""]),
])
def test_bad_sampling_params(bad):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**bad)
    assert isinstance(e.value, HibanaError) and isinstance(e.value, ValueError)
    assert str(e.value)


def generating(engine, state_id: str) -> bool:
    (info,) = [s for s in engine.states() if s.id == state_id]
    return info.busy


def test_failures_while_others_generate(served, bystander):
    """Failing requests made while another agent generates (its request provably runs from
    before the first failure to after the last) do not disturb it."""
    engine, path = served
    history = random_tokens(random.Random(77), 60)
    busy = engine.open_state("busy")
    busy.sync(history)
    events = busy.stream(greedy(96))  # the failures take a few of its steps (2 here)
    generated = [next(events).token_id]
    assert generating(engine, "busy")
    bad = engine.open_state("bad")
    bad.sync([1, 2, 3])
    with pytest.raises(InvalidTokenError):
        bad.append([VOCAB_SIZE])
    with pytest.raises(ContextLengthError):
        bad.sync(random_tokens(random.Random(78), 1100))
    bad.close()
    with pytest.raises(StateClosedError):
        bad.generate(greedy())
    assert generating(engine, "busy"), "the bystander finished before the failures: nothing was tested"
    for event in events:
        if event.token_id is not None:
            generated.append(event.token_id)
    assert event.finish_reason == "length" and list(event.completion.token_ids) == generated
    assert len(generated) == 96 and busy.tokens == history + generated
    assert_greedy_matches(path, history, generated)
    bystander.check()
    busy.close()


@pytest.mark.parametrize("positions", [0, -5])
def test_a_config_without_positions_is_a_checkpoint_error(tiny_checkpoints, tmp_path, positions):
    """It was an IndexError from the rotary tables (0) or a RuntimeError from torch.arange (-5),
    raised out of from_pretrained (a new user's trial)."""
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    with pytest.raises(CheckpointError, match=f"max_position_embeddings is {positions}"):
        open_engine(ckpt)


def test_a_tied_config_beside_a_stored_head_of_other_values_is_a_checkpoint_error(tmp_path):
    """transformers keeps a stored lm_head.weight where config.json ties it (5.25); the engine tied
    the head to the embedding and differed from the first token. Now a CheckpointError saying
    what to change; a stored head equal to the embedding (exports that save both) loads."""
    untied = make_tiny_checkpoint("llama", tmp_path / "untied", tie_word_embeddings=False)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match=r"stores lm_head.weight with other values.*tie_word_embeddings"):
        open_engine(untied)

    from safetensors.torch import load_file, save_file

    both = make_tiny_checkpoint("llama", tmp_path / "both", tie_word_embeddings=True)
    tensors = load_file(both / "model.safetensors")
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
              str(both / "model.safetensors"), metadata={"format": "pt"})
    history = list(range(3, 30))
    with open_engine(both) as engine:
        got = engine.open_state("a").generate(SamplingParams(max_tokens=6, ignore_eos=True), prompt=history)
    assert_greedy_matches(both, history, got.token_ids)

    # the shared matrix stored under the head's name alone (as transformers loads it): refused before as
    # "other values" than an embedding never read, with advice that failed (an outside audit)
    head_only = make_tiny_checkpoint("llama", tmp_path / "head-only", tie_word_embeddings=True)
    tensors = load_file(head_only / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(head_only / "model.safetensors"), metadata={"format": "pt"})
    with open_engine(head_only) as engine:
        got = engine.open_state("a").generate(SamplingParams(max_tokens=6, ignore_eos=True), prompt=history)
    assert_greedy_matches(head_only, history, got.token_ids)


@pytest.mark.parametrize("eos", ["<|endoftext|>", [[0]], {"id": 0}, -1, True])
def test_an_eos_token_id_that_is_no_token_id_is_said_so(tiny_checkpoints, tmp_path, eos):
    """It was a ValueError / TypeError out of int() at load (an outside audit); -1 and true were taken
    as ids. generation_config.json's: a warning, config.json's used; config.json's: a CheckpointError."""
    ckpt = copy_checkpoint(tiny_checkpoints[ARCH], tmp_path / "c")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.warns(UserWarning, match="generation_config.json has eos_token_id .* no token id"):
        open_engine(ckpt).close()
    (ckpt / "generation_config.json").unlink()
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    with pytest.raises(CheckpointError, match=r"(?s)config\.json.*eos_token_id"):  # transformers' reading, or ours
        open_engine(ckpt)


def test_the_detokenizers_fast_decode_is_the_tokenizers_decode():
    """The detokenizer decodes through the fast tokenizer's backend (transformers' wrapper cost
    6 of every 7 us a call), but only where that is what `decode` gives: a tokenizer whose decode
    cleans up spaces (a WordPiece one, or cleanup forced) or a class with its own decode keeps it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hibana_core.detokenizer import _CLEANED_UP, Detokenizer, text_decoder

    words = sorted(set(_CLEANED_UP.replace("'", " ' ").split())) + ["'", "[UNK]"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    byte_level = make_tokenizer()

    class OwnDecode(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "<" + super().decode(token_ids, skip_special_tokens=skip_special_tokens) + ">"
    own = OwnDecode(tokenizer_object=byte_level.backend_tokenizer)
    for tokenizer, fast in ((byte_level, True), (wordpiece, False), (own, False)):
        ids = tokenizer.encode("a . b , c n't", add_special_tokens=False)
        decode = text_decoder(tokenizer)
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
        assert ("backend_decode" in decode.__code__.co_freevars) == fast
        detok = Detokenizer(tokenizer, [], ())
        for token in ids:
            detok.add(token)
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=False) or not fast
