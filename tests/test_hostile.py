"""Hostile and careless input (issue 12): no agent's input hurts another agent.

A request is validated completely before it joins a step; what still fails inside a step fails the
request that caused it alone: the step's requests run again one at a time until it is found.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest

from hibana_core import ConfigError, ContextLengthError, HibanaError, SamplingParams
from tiny_models import assert_greedy_matches, random_tokens

ARCH = "qwen3"
CULPRIT_SEED = 666

pytestmark = pytest.mark.timeout(300)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["one-step", "async"])
def test_a_request_that_fails_its_step_fails_alone(tiny_checkpoints, make_engine, async_scheduling):
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, async_scheduling=async_scheduling)
    sampler = engine.runner.sampler
    calls = []

    class FailingSampler:  # stands for any fault that one request's input causes
        logprobs = staticmethod(sampler.logprobs)  # the rest of the sampler's protocol, unchanged

        @staticmethod
        def sample(logits, rows, masks=None):
            calls.append(len(rows))
            if any(row.params.seed == CULPRIT_SEED for row in rows):
                raise RuntimeError("boom")
            return sampler.sample(logits, rows, masks)

    engine.runner.sampler = FailingSampler()
    rng = random.Random(5)
    prompts = [random_tokens(rng, 20 + 7 * i) for i in range(4)]
    handles = [engine.open_state(f"a{i}") for i in range(4)]
    with engine.core.lock:  # all four join the same first step
        streams = [h.stream(greedy(12, temperature=0.5, seed=CULPRIT_SEED) if i == 2 else greedy(12),
                            prompt=p) for i, (h, p) in enumerate(zip(handles, prompts))]
    outputs = {}
    for i, stream in enumerate(streams):
        try:
            outputs[i] = [ev.token_id for ev in stream if ev.token_id is not None]
        except HibanaError as exc:
            outputs[i] = exc
    assert isinstance(outputs[2], HibanaError) and "boom" in str(outputs[2])
    assert calls[0] == 4  # they did share a step
    for i in (0, 1, 3):
        assert_greedy_matches(path, prompts[i], outputs[i])
        assert handles[i].tokens == prompts[i] + outputs[i]
    assert handles[2].tokens == prompts[2]  # the failed request left its state as it was
    # the engine goes on serving, the culprit's state too
    assert_greedy_matches(path, prompts[2], handles[2].generate(greedy(6)).token_ids)


def test_bad_sampling_options_are_refused_before_they_reach_a_step():
    for bad in (dict(top_k=2.0), dict(max_tokens=2.5), dict(max_tokens=True), dict(temperature=float("nan")),
                dict(seed="1"), dict(stop_token_ids=[1.5]), dict(ignore_eos=1), dict(stop=5),
                dict(temperature=10**400)):  # past a float (was an OverflowError)
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_a_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=0.1).greedy


def test_a_state_at_the_context_limit_refuses_to_generate(tiny_checkpoints, make_engine):
    path = tiny_checkpoints[ARCH]
    engine = make_engine(path, max_model_len=64)
    h = engine.open_state("full")
    prompt = random_tokens(random.Random(1), 64)
    h.sync(prompt)
    for _ in range(2):
        with pytest.raises(ContextLengthError, match="no room"):
            h.generate(greedy(4))
    assert h.tokens == prompt
    # a prompt that fills the context is refused before the state changes
    h.sync(prompt[:10])
    with pytest.raises(ContextLengthError):
        h.generate(greedy(4), prompt=prompt)
    with pytest.raises(ContextLengthError):
        h.generate(greedy(4), prompt=[])
    assert h.tokens == prompt[:10]
    # one short of the limit: one token, then "length"
    done = h.generate(greedy(4), prompt=prompt[:63])
    assert len(done.token_ids) == 1 and done.finish_reason == "length" and len(h) == 64


def test_token_ids_of_other_types_are_refused(tiny_checkpoints, make_engine):
    from hibana_core import InvalidTokenError

    engine = make_engine(tiny_checkpoints[ARCH])
    h = engine.open_state("a")
    h.sync([1, 2, 3])
    for bad in ([1.5], ["5"], [True], "123", None, 7):
        with pytest.raises(InvalidTokenError):
            h.sync(bad)
        assert h.tokens == [1, 2, 3]


def test_adapter_calls_never_close_a_users_state_named_like_an_engine_one(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints[ARCH], max_unnamed_states=1)
    mine = engine.open_state("auto-pilot")
    mine.sync([1, 2, 3])
    for i in range(3):  # calls that name no state: the engine makes (and bounds) its own
        with engine.lease([7, 8, 9 + i]) as handle:
            handle.sync([7, 8, 9 + i])
            assert handle is not mine
    assert not mine.closed and mine.tokens == [1, 2, 3]
    assert engine.registry.is_unnamed(handle) and not engine.registry.is_unnamed(mine)


def test_a_script_that_exits_while_generating_exits_cleanly(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent("""
        import threading, time
        from hibana_core import Engine, SamplingParams
        engine = Engine.from_pretrained("demo", progress=False)
        handle = engine.open_state("a")
        def run():
            try:
                handle.generate(SamplingParams(max_tokens=4000, ignore_eos=True), prompt=list(range(5, 50)))
            except Exception:
                pass
        threading.Thread(target=run, daemon=True).start()
        time.sleep(0.5)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# --- state files -------------------------------------------------------------------------------

def _saved(engine, tmp_path, n=40):
    h = engine.open_state("saved")
    prompt = random_tokens(random.Random(9), n)
    h.sync(prompt)
    path = tmp_path / "state.safetensors"
    h.save(path)
    return h, prompt, path


def test_a_bit_flip_anywhere_in_a_state_file_is_refused_with_nothing_allocated(tiny_checkpoints, make_engine,
                                                                               tmp_path):
    from hibana_core import StateFileError

    engine = make_engine(tiny_checkpoints[ARCH])
    _, _, path = _saved(engine, tmp_path)
    data = path.read_bytes()
    rng = random.Random(3)
    used = engine.stats().kv_blocks_used
    for i in range(30):
        at = rng.randrange(len(data)) if i % 2 else rng.randrange(len(data) - 2000, len(data))  # KV region too
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        bad = tmp_path / f"bad{i}.safetensors"
        bad.write_bytes(bytes(flipped))
        with pytest.raises(StateFileError):
            engine.load_state(bad, state_id=f"x{i}")
        assert engine.stats().kv_blocks_used == used and len(engine.states()) == 1
    # every byte of the metadata the checksum once left out ("configuration": a flip there loaded)
    for name in (b'"configuration"', b"float32", b'"fingerprint_scheme"'):
        flipped = bytearray(data)
        flipped[data.index(name) + 2] ^= 2
        bad = tmp_path / "described.safetensors"
        bad.write_bytes(bytes(flipped))
        with pytest.raises(StateFileError):
            engine.load_state(bad, state_id="described")


def test_a_state_file_written_before_its_checksum_covered_the_configuration_loads(tiny_checkpoints, make_engine,
                                                                                   tmp_path):
    import safetensors.torch as st
    from safetensors import safe_open

    from hibana_core.kv import state_file

    engine = make_engine(tiny_checkpoints[ARCH])
    _, prompt, path = _saved(engine, tmp_path)
    kv = st.load_file(str(path))["kv"]
    meta = safe_open(str(path), "pt").metadata()
    meta["checksum"] = state_file._checksum(meta, kv, described=False)  # as the earlier writer summed it
    old = tmp_path / "earlier.safetensors"
    st.save_file({"kv": kv}, str(old), metadata=meta)
    assert engine.load_state(old, state_id="earlier").tokens == engine.open_state("saved").tokens


def test_loaded_kv_is_private_unless_shared(tiny_checkpoints, make_engine, tmp_path):
    """A forged file (a valid checksum proves no origin) must not reach other agents through the
    prefix index: an innocent agent on the same prefix computes its own KV."""
    import safetensors.torch as st
    from safetensors import safe_open

    from hibana_core.kv import state_file

    path = tiny_checkpoints[ARCH]
    engine = make_engine(path)
    h, prompt, file = _saved(engine, tmp_path)
    h.close()
    engine.core.scheduler.pool.reset_prefix_index()
    tensors = st.load_file(str(file))
    meta = safe_open(str(file), "pt").metadata()
    forged = tensors["kv"].zero_()
    meta["checksum"] = state_file._checksum(meta, forged)
    st.save_file({"kv": forged}, str(tmp_path / "forged.safetensors"), metadata=meta)
    engine.load_state(tmp_path / "forged.safetensors", state_id="forged")
    innocent = engine.open_state("innocent")
    assert innocent.sync(prompt).computed == len(prompt)
    assert_greedy_matches(path, prompt, innocent.generate(greedy(8)).token_ids)
    # a trusted file shares its blocks when asked
    engine.load_state(file, state_id="trusted", share=True)
    assert engine.open_state("second").sync(prompt).reused >= len(prompt) - len(prompt) % 16


def test_an_inconsistent_state_file_is_refused(tiny_checkpoints, make_engine, tmp_path):
    import safetensors.torch as st
    from safetensors import safe_open

    from hibana_core import StateFileError
    from hibana_core.kv import state_file

    engine = make_engine(tiny_checkpoints[ARCH])
    _, _, file = _saved(engine, tmp_path)
    kv = st.load_file(str(file))["kv"]
    meta = safe_open(str(file), "pt").metadata()
    used = engine.stats().kv_blocks_used
    for name, tensor in (("layers", kv[:1]), ("blocks", kv.repeat(1, 1, 2, 1, 1, 1))):
        meta["checksum"] = state_file._checksum(meta, tensor)
        bad = tmp_path / f"{name}.safetensors"
        st.save_file({"kv": tensor.contiguous()}, str(bad), metadata=meta)
        with pytest.raises(StateFileError, match="inconsistent"):
            engine.load_state(bad, state_id=name)
        assert engine.stats().kv_blocks_used == used
    with pytest.raises(StateFileError, match="directory"):
        engine.open_state("saved").save(tmp_path)
    with pytest.raises(StateFileError, match="is a directory, not a state file"):
        engine.load_state(tmp_path, state_id="from-a-folder")


def test_a_state_file_naming_no_state_or_foreign_tokens_is_a_state_file_error(tiny_checkpoints, make_engine, tmp_path):
    """Files made by hand (the checksum proves no origin): an empty state id loaded as a state no
    call could reach (and, with a state_dir, a file no call could delete); token ids past the
    vocabulary were an InvalidTokenError ("tokenize with this model's tokenizer"), where the README
    promises a StateFileError for a foreign or damaged file."""
    import json

    import safetensors.torch as st
    from safetensors import safe_open

    from hibana_core import StateFileError
    from hibana_core.kv import state_file

    engine = make_engine(tiny_checkpoints[ARCH])
    _, _, file = _saved(engine, tmp_path)
    kv = st.load_file(str(file))["kv"]
    used = engine.stats().kv_blocks_used
    saved = safe_open(str(file), "pt").metadata()
    foreign = [10 ** 6, *json.loads(saved["tokens"])[1:]]  # as many tokens: the KV still fits them
    for name, change, says in (("no-id", {"state_id": ""}, "state id is empty"),
                               ("foreign", {"tokens": json.dumps(foreign)}, "cannot read")):
        meta = {**saved, **change}
        meta["checksum"] = state_file._checksum(meta, kv)
        bad = tmp_path / f"{name}.safetensors"
        st.save_file({"kv": kv}, str(bad), metadata=meta)
        with pytest.raises(StateFileError, match=says):
            engine.load_state(bad)
        assert engine.stats().kv_blocks_used == used and "" not in {s.id for s in engine.states()}


# --- options and state operations ----------------------------------------------------------------

def test_bad_engine_options_and_state_ops_are_hibana_errors(tiny_checkpoints, make_engine):
    from hibana_core import ConfigError, Engine, MemoryBudgetError

    path = tiny_checkpoints[ARCH]
    for options, error in ((dict(device="cuda:7"), ConfigError), (dict(device="tpu"), ConfigError),
                           (dict(kv_dtype="bfloat16"), ConfigError), (dict(num_blocks=10**13), MemoryBudgetError),
                           (dict(max_num_batched_tokens=1.5), ConfigError), (dict(max_prefill_chunk=1.5), ConfigError),
                           (dict(block_size="16"), ConfigError), (dict(progress="yes"), ConfigError)):
        with pytest.raises(error):
            Engine.from_pretrained(path, **options)
    engine = make_engine(path)
    h = engine.open_state("a")
    h.sync([1, 2, 3])
    for bad in ("", None, 7):
        with pytest.raises(ConfigError):
            h.fork(bad)
    for bad in ("3", -1, 1.5, None):
        with pytest.raises(ConfigError):
            h.truncate(bad)
    assert h.tokens == [1, 2, 3] and [s.id for s in engine.states()] == ["a"]


def test_shared_engines_of_dropped_objects_do_not_accumulate(tiny_checkpoints):
    import gc
    import weakref

    from hibana_core import Engine

    path = tiny_checkpoints[ARCH]
    made = [weakref.ref(Engine.shared(path, progress=False, seed=seed)) for seed in range(6)]
    gc.collect()
    alive = [ref() for ref in made if ref() is not None]
    assert len(alive) <= 2
    assert Engine.shared(path, progress=False, seed=5) is made[5]()  # a recent one is found again
    for engine in alive:
        engine.close()


def test_a_long_stop_string_holds_back_only_a_possible_start_of_it():
    from hibana_core.detokenizer import Detokenizer

    class Chars:  # one token per character
        def decode(self, ids, skip_special_tokens=False):
            return "".join(map(chr, ids))

    detok = Detokenizer(Chars(), [], ["STOP" + "x" * 1_000_000])
    streamed = ""
    for char in "hello STO":
        assert not detok.add(ord(char))
        streamed += detok.take_delta()
    assert streamed == "hello "          # "STO" could still start the stop string
    for char in "Pyz":
        detok.add(ord(char))
        streamed += detok.take_delta()
    assert streamed == "hello STOPyz"    # it did not
    detok = Detokenizer(Chars(), [], ["</end>", "nd"])
    assert [detok.add(ord(c)) for c in "a</en"] == [False] * 5 and detok.add(ord("d"))
    assert detok.stopped and detok.text == "a</e" and detok.matched == "nd"  # "nd" completed first
    detok = Detokenizer(Chars(), [], ["b", "ab"])
    assert detok.add(ord("a")) is False and detok.add(ord("b"))
    assert (detok.text, detok.matched) == ("", "ab")  # of two completing at once, the longer began first


def test_long_work_for_one_caller_runs_outside_the_engine_lock(tiny_checkpoints, make_engine, monkeypatch):
    """Checking a caller's token list and scanning every state for a match run without the lock
    that the step loop needs: one caller with a huge list or a server with thousands of states
    does not stall the other agents' steps (issue 12, item 9)."""
    from hibana_core.registry import StateRegistry

    engine = make_engine(tiny_checkpoints[ARCH])
    for i in range(20):
        engine.open_state(f"s{i}").sync([1, 2, 3 + i])
    owned = []
    for name in ("_shared", "_validate"):
        original = getattr(StateRegistry, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            owned.append((_name, engine.core.lock._is_owned()))
            return _original(*args, **kwargs)

        monkeypatch.setattr(StateRegistry, name, staticmethod(spy) if name == "_shared" else spy)
    engine.match_state([1, 2, 5, 9])
    with engine.lease([1, 2, 5, 9], min_shared=0.5):
        pass
    engine.open_state("big").sync(random_tokens(random.Random(0), 200))
    scans = [o for n, o in owned if n == "_shared"]
    assert len(scans) >= 40 and scans.count(True) <= 1  # the lease re-checks its pick under the lock
    assert not any(o for n, o in owned if n == "_validate")
