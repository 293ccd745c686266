"""Every failure a caller can cause, enumerated: each is a HibanaError whose message says what to
do, and options that cannot work fail before anything loads (no load, no 12-second wait)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from hibana_core import (ChatTimeoutError, CheckpointError, ConfigError, Engine, HibanaError, SamplingParams,
                         UnsupportedModelError)

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def no_load(monkeypatch):
    """Loading the model fails the test: the error must come first."""
    import hibana_core.engine

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the option was refused")

    monkeypatch.setattr(hibana_core.engine, "load_model", load)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def demo_engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", num_blocks=64) as engine:
        yield engine


def _open(model="demo", **overrides):
    return Engine.from_pretrained(model, progress=False, **overrides)


# (what the caller did, the call, the error class, fragments its message must hold)
BEFORE_LOADING = [
    pytest.param(lambda: _open(device="cuda"), ConfigError, ["cuda", "device='cpu'"],
                 marks=pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA"), id="cuda-on-a-cpu-build"),
    pytest.param(lambda: _open(device="cuda:7"), ConfigError, ["cuda:7", "device='cpu'"],
                 marks=pytest.mark.skipif(torch.cuda.device_count() > 7, reason="8 GPUs here"), id="cuda-index-absent"),
    pytest.param(lambda: _open(device="mps"), ConfigError, ["mps", "not supported", "device='cpu'"], id="mps"),
    pytest.param(lambda: _open(device="tpu"), ConfigError, ["auto, cpu, cuda or cuda:N", "'tpu'"], id="unknown-device"),
    pytest.param(lambda: _open(device="cuda:x"), ConfigError, ["cuda:x", "cuda:N"], id="malformed-device"),
    pytest.param(lambda: _open(devcie="cpu"), ConfigError, ["devcie", "known options", "device"], id="misspelt-option"),
    pytest.param(lambda: _open(block_size=12), ConfigError, ["block_size", "power of two"], id="bad-option-value"),
    pytest.param(lambda: _open(speculation={"method": "nope"}), ConfigError, ["nope", "suffix"], id="unknown-drafter"),
    pytest.param(lambda: _open(surgery=["w9"]), ConfigError, ["w9", "w8"], id="unknown-surgery-pass"),
    pytest.param(lambda: _open(dtype="float64"), ConfigError, ["float64", "bfloat16"], id="unknown-dtype"),
]


@pytest.mark.parametrize("call, cls, says", BEFORE_LOADING)
def test_options_that_cannot_work_fail_before_loading(call, cls, says, no_load):
    with pytest.raises(cls) as e:
        call()
    assert isinstance(e.value, HibanaError)
    for part in says:
        assert part in str(e.value), str(e.value)


def test_models_that_cannot_be_found(tmp_path, offline_hub):
    cases = [
        (str(tmp_path / "no-such-dir"), CheckpointError, ["does not exist", "repo id such as"]),
        ("acme/not-downloaded", CheckpointError, ["hf download acme/not-downloaded", "HF_HUB_OFFLINE=0",
                                                  "local checkpoint directory"]),
        ("acme/model@", CheckpointError, ["does not exist"]),  # an empty revision is no repo id
    ]
    for model, cls, says in cases:
        with pytest.raises(cls) as e:
            _open(model)
        for part in says:
            assert part in str(e.value), (model, str(e.value))


def test_an_unsupported_architecture_lists_the_supported_ones(tmp_path):
    import json
    import shutil

    from hibana_core.loader import DEMO_MODEL_DIR

    shutil.copytree(DEMO_MODEL_DIR, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="supported model types: exaone4, gemma3, gemma3_text, glm4_moe, gpt_oss, "
                       "granite, llama, minimax_m2, ministral, ministral3, mistral, mistral3, mixtral, olmo2, olmo3, phi3, "
                       "qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next, qwen3_vl, "
                       "seed_oss, smollm3"):
        _open(str(tmp_path / "m"))


def test_a_call_timeout_is_a_hibana_error_and_a_builtin_timeout_error(demo_engine):
    from hibana_core.chat import Chat

    assert issubclass(ChatTimeoutError, HibanaError) and issubclass(ChatTimeoutError, TimeoutError)
    chat = Chat(demo_engine, "timeout")
    for catch in (TimeoutError, HibanaError, ChatTimeoutError):
        with pytest.raises(catch) as e:
            chat.respond([{"role": "user", "content": "hi"}], timeout=1e-9)
        assert "raise the timeout" in str(e.value)
    with pytest.raises(ConfigError, match="timeout must be a number of seconds"):
        chat.respond([{"role": "user", "content": "hi"}], timeout=-1)


def test_stop_token_ids_outside_the_vocabulary_are_refused_and_the_state_kept(demo_engine):
    from hibana_core.errors import InvalidTokenError

    handle = demo_engine.open_state("stops")
    handle.sync([5, 6, 7])
    with pytest.raises(InvalidTokenError, match=r"stop_token_ids \[1000000\] lie outside the vocabulary"):
        handle.generate(SamplingParams(max_tokens=2, stop_token_ids=[3, 10 ** 6]), prompt=[5, 6, 7, 8])
    assert handle.tokens == [5, 6, 7]
    assert len(handle.generate(SamplingParams(max_tokens=2, ignore_eos=True)).token_ids) == 2


def test_numpy_scalars_are_taken_as_python_numbers(demo_engine):
    """A numpy seed (or any field) checks as an integer and is one: a seeded sample ran into torch's
    manual_seed with an np.int64 (a TypeError, after the state had taken the prompt)."""
    import numpy as np

    params = SamplingParams(max_tokens=np.int32(3), temperature=np.float32(0.5), seed=np.int64(3), ignore_eos=True)
    assert (type(params.max_tokens), type(params.temperature), type(params.seed)) == (int, float, int)
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=torch.tensor([3])).stop_token_ids == (3,)
    handle = demo_engine.open_state("numpy-seed")
    first = handle.generate(params, prompt=[5, 6, 7]).token_ids
    again = demo_engine.open_state("numpy-seed-2").generate(dataclasses.replace(params, seed=3), prompt=[5, 6, 7])
    assert first == again.token_ids and len(first) == 3


def test_unordered_token_ids_are_refused(demo_engine):
    from hibana_core.errors import InvalidTokenError

    handle = demo_engine.open_state("unordered")
    for unordered in ({5, 6}, frozenset({5, 6}), {5: 1}.keys()):
        with pytest.raises(InvalidTokenError, match="a list of integers"):
            handle.sync(unordered)
    assert handle.tokens == []


def test_a_tokenizers_output_is_taken_as_it_comes(demo_engine):
    """transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding, and
    return_tensors="pt" a batch of one: both were InvalidTokenErrors; a real batch still is."""
    from hibana_core.errors import InvalidTokenError

    tokenizer = demo_engine.tokenizer
    messages = [{"role": "user", "content": "Hi!"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    handle = demo_engine.open_state("tokenizer-output")
    for given in (tokenizer(tokenizer.decode(ids), add_special_tokens=False),
                  torch.tensor([ids]), [ids], {"input_ids": ids, "attention_mask": [1] * len(ids)}):
        handle.sync(given)
        assert handle.tokens == ids
    with pytest.raises(InvalidTokenError, match="one sequence, got a batch of 2"):
        handle.sync([ids, ids])
    assert handle.tokens == ids
    handle.close()


def test_astream_outside_an_event_loop_says_what_to_do(demo_engine):
    with pytest.raises(ConfigError, match="astream wants an event loop"):
        demo_engine.open_state("no-loop").astream(SamplingParams(max_tokens=2), prompt=[5, 6])


def test_a_stream_read_on_another_event_loop_says_so(demo_engine):
    """Its events go to the loop it was made on: read on another, it waited for good (an outside audit:
    made in one asyncio.run, read in the next). A ConfigError, and the state is free for the next turn."""
    import asyncio

    handle = demo_engine.open_state("other-loop")

    async def make():
        return handle.astream(SamplingParams(max_tokens=3, ignore_eos=True), prompt=[5, 6, 7])

    async def read(events):
        return [event async for event in events]

    events = asyncio.run(make())
    with pytest.raises(ConfigError, match="event loop it was made for"):
        asyncio.run(asyncio.wait_for(read(events), 30))
    with pytest.raises(ConfigError, match="made by stream"):
        asyncio.run(asyncio.wait_for(read(handle.stream(SamplingParams(max_tokens=2), prompt=[8])), 30))
    assert len(handle.generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=[9]).token_ids) == 2
    handle.close()


def test_a_sync_whose_state_closes_meanwhile_says_so(demo_engine):
    """Closed by another thread while its prefill ran: StateClosedError, not the stats of a prefill
    that the state no longer holds."""
    import threading
    import time

    from hibana_core.errors import StateClosedError

    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", num_blocks=64,
                                max_num_batched_tokens=2, max_prefill_chunk=2) as engine:
        handle = engine.open_state("closing")
        outcome = []

        def sync():
            try:
                outcome.append(handle.sync(list(range(5, 245))))
            except StateClosedError as exc:
                outcome.append(exc)
        worker = threading.Thread(target=sync)
        worker.start()
        deadline = time.monotonic() + 60
        while not any(s.busy for s in engine.states()):
            assert time.monotonic() < deadline and worker.is_alive(), outcome
            time.sleep(0.001)
        handle.close()
        worker.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], StateClosedError), outcome
        assert "closed while it synced" in str(outcome[0])


def test_bad_sampling_parameters():
    for kwargs, says in (({"temperature": -1}, "temperature must be >= 0"), ({"top_p": 0}, "top_p"),
                         ({"max_tokens": -1}, "max_tokens"), ({"stop": [""]}, "stop strings")):
        with pytest.raises(ConfigError, match=says):
            SamplingParams(**kwargs)


def test_vllms_top_k_minus_one_keeps_every_token():
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams().top_k


def test_unknown_sampling_options_name_the_close_match():
    for kwargs, says in (({"max_new_tokens": 8}, "'max_new_tokens' (did you mean 'max_tokens'?)"),
                         ({"n": 2}, "no option 'n'; its options: max_tokens, temperature")):
        with pytest.raises(ConfigError) as e:
            SamplingParams(**kwargs)
        assert says in str(e.value), str(e.value)
    params = SamplingParams(max_tokens=3, stop="x")  # the known ones still build, copy and pickle
    assert dataclasses.replace(params, seed=1).seed == 1 and pickle.loads(pickle.dumps(params)) == params


def test_adapters_report_a_model_that_cannot_be_found(offline_hub):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from hibana_plugins.langchain import ChatHibana
    from hibana_plugins.llamaindex import HibanaLLM

    with pytest.raises(CheckpointError, match="hf download acme/absent"):
        ChatHibana(model="acme/absent").invoke("hi")
    with pytest.raises(CheckpointError, match="hf download acme/absent"):
        HibanaLLM(model="acme/absent")
    with pytest.raises(ConfigError, match="device='cpu'"):
        ChatHibana(model="demo", engine_kwargs={"device": "mps"}).invoke("hi")
