"""Audit of saving, loading and moving agent states, from the outside, with inputs unlike the
other state-file tests: files saved under one configuration (dtype, fp8 KV, surgery, block size,
max_model_len, sliding windows, a hybrid model, a draft model) and loaded under another, edited
checkpoints, damaged and foreign files, names and lifecycle, `state_dir` restarts under other
options, and writes that cannot complete (a full disk, a name near the folder's limit).

Every load is either exact (greedy output equal to the engine that kept the state, or to
transformers on the full history) or a StateFileError that names the difference; never silent
garbage, never another exception type, and a bystander agent's output never changes.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from hibana_core import ContextLengthError, SamplingParams, StateBusyError, StateExistsError, StateFileError
from tiny_models import assert_greedy_matches, make_tiny_checkpoint, make_tokenizer, open_engine, random_tokens

pytestmark = pytest.mark.timeout(300)

KV8 = [{"name": "kv8", "force": True}]  # (the tiny models' guard refuses kv8: forced, as a user would)
WINDOW = [{"name": "window", "window": 16, "layers": 0.5}]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("state_files2")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in ("qwen3", "gemma3", "qwen3_5")}


@pytest.fixture(scope="module")
def qwen3(ckpts):
    """A plain engine on the tiny qwen3, with a bystander agent whose next greedy tokens are known."""
    engine = open_engine(ckpts["qwen3"], speculation="off")
    bystander = engine.open_state("bystander")
    prompt = random_tokens(random.Random(7), 30)
    want = list(bystander.generate(greedy(8), prompt=prompt).token_ids)
    bystander.truncate(len(prompt))
    engine.bystander = (bystander, prompt, want)
    yield engine
    engine.close()


def assert_bystander_unchanged(engine) -> None:
    bystander, prompt, want = engine.bystander
    assert list(bystander.generate(greedy(8), prompt=prompt).token_ids) == want
    bystander.truncate(len(prompt))


@pytest.fixture(scope="module")
def saved(qwen3, tmp_path_factory):
    """A state file of the qwen3 engine: (path, its history)."""
    h = qwen3.open_state("saved")
    h.generate(greedy(4), prompt=random_tokens(random.Random(1), 45))
    path = tmp_path_factory.mktemp("saved") / "saved.state"
    h.save(path)
    return path, h.tokens


@contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` fail as on a full disk (EFBIG), in this process, for the block."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


# --- writes that cannot complete ----------------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE stands in for a full disk")
def test_a_state_file_on_a_full_disk_is_a_state_file_error_and_leaves_nothing_behind(qwen3, ckpts, tmp_path):
    """safetensors reports a failed write as a SafetensorError, not an OSError: it escaped `save`
    as no HibanaError, and the half-written temporary file stayed in the folder (in a state_dir,
    one more at every close on a full disk)."""
    h = qwen3.open_state("full-disk")
    h.generate(greedy(3), prompt=random_tokens(random.Random(2), 40))
    folder = tmp_path / "full"
    folder.mkdir()
    with file_size_limit(4096):
        with pytest.raises(StateFileError, match="cannot write the state file .*with room for it"):
            h.save(folder / "agent.state")
    assert list(folder.iterdir()) == []
    h.save(folder / "agent.state")  # with room, the same call writes it
    assert qwen3.load_state(folder / "agent.state", state_id="full-disk-2").tokens == h.tokens
    assert_bystander_unchanged(qwen3)

    # an engine closing on a full disk keeps the state_dir's earlier file whole, and no temporary one
    state_dir = tmp_path / "state_dir"
    first = open_engine(ckpts["qwen3"], speculation="off", state_dir=state_dir)
    first.open_state("a").generate(greedy(3), prompt=random_tokens(random.Random(3), 40))
    first.close()
    (written,) = state_dir.glob("*.state")
    before = written.read_bytes()
    second = open_engine(ckpts["qwen3"], speculation="off", state_dir=state_dir)
    history = second.open_state("a").tokens
    second.open_state("a").append([5, 6, 7])
    with file_size_limit(4096):
        second.close()  # logged, not raised: the other states are still written
    assert sorted(p.name for p in state_dir.iterdir() if p.is_file()) == [written.name]
    assert written.read_bytes() == before
    third = open_engine(ckpts["qwen3"], speculation="off", state_dir=state_dir)
    try:
        assert third.open_state("a").tokens == history
    finally:
        third.close()


@pytest.mark.parametrize("name", ["x" * 250, "状" * 85], ids=["250 ascii", "255 bytes of utf-8"])
def test_a_state_file_named_near_the_folders_limit_saves_and_loads(qwen3, tmp_path, name):
    """The temporary file was named after the whole state file plus 13 characters, so a name the
    folder takes (255 bytes) could not be saved: 'File name too long' for a valid path."""
    h = qwen3.open_state("long-name")
    if not h.tokens:
        h.generate(greedy(3), prompt=random_tokens(random.Random(4), 40))
    h.save(tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    loaded = qwen3.load_state(tmp_path / name, state_id=f"long-name-{len(name)}")
    assert loaded.tokens == h.tokens
    loaded.close()


# --- damaged and foreign files ------------------------------------------------------------------

def _damaged_variants(data: bytes) -> dict[str, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode()
    body = data[8 + length:]

    def with_header(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode() + body

    out = {f"truncated at {n}": data[:n] for n in (0, 1, 7, 8, 9, length // 2, length + 7, length + 8,
                                                    length + 9, len(data) // 2, len(data) - 1)}
    out["a byte more"] = data + b"\0"
    out["header length past the file"] = struct.pack("<Q", len(data)) + data[8:]
    out["header length of 2**63"] = struct.pack("<Q", 1 << 63) + data[8:]
    out["header length 0"] = struct.pack("<Q", 0) + data[8:]
    out["json"] = b'{"tokens": [1, 2, 3]}'
    out["text"] = b"not a state file at all"
    out["random bytes"] = random.Random(5).randbytes(4000)
    out["header a list"] = struct.pack("<Q", 2) + b"[]"
    meta = json.loads(header)
    meta["__metadata__"] = "a string"
    out["metadata a string"] = with_header(json.dumps(meta))
    for i in range(0, length, max(1, length // 24)):
        flipped = bytearray(data)
        flipped[8 + i] ^= 0x20
        out[f"header byte {i} flipped"] = bytes(flipped)
    for k in range(6):
        flipped = bytearray(data)
        at = 8 + length + len(body) * k // 6
        flipped[at] ^= 0x80
        out[f"kv byte {at} flipped"] = bytes(flipped)
    return out


def test_damaged_files_are_each_a_state_file_error_and_nothing_else_changes(qwen3, ckpts, saved, tmp_path):
    path, _ = saved
    used, states = qwen3.stats().kv_blocks_used, {s.id for s in qwen3.states()}
    variants = _damaged_variants(path.read_bytes())
    variants["a model checkpoint"] = (ckpts["qwen3"] / "model.safetensors").read_bytes()
    for i, (what, blob) in enumerate(variants.items()):
        bad = tmp_path / f"bad{i}.state"
        bad.write_bytes(blob)
        with pytest.raises(StateFileError) as caught:
            qwen3.load_state(bad, state_id=f"bad{i}")
        assert "; " in str(caught.value) or "does not exist" in str(caught.value), (what, caught.value)
        assert qwen3.stats().kv_blocks_used == used and {s.id for s in qwen3.states()} == states, what
    for what in (tmp_path / "missing.state", tmp_path, f"{tmp_path}{os.sep}", "", b"bytes.state", 7, None):
        with pytest.raises(StateFileError):
            qwen3.load_state(what, state_id="never")
    assert {s.id for s in qwen3.states()} == states
    assert_bystander_unchanged(qwen3)


def test_files_of_another_kind_or_version_say_what_they_are(qwen3, ckpts, saved, tmp_path):
    """A device or a pipe 'does not exist' (it does); a file of a newer Hibana's format, or a
    model checkpoint, was to be 'saved again', which neither mends."""
    path, _ = saved
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].decode().replace("hibana-state/2", "hibana-state/3")
    newer = tmp_path / "newer.state"
    newer.write_bytes(struct.pack("<Q", len(header)) + header.encode() + data[8 + length:])
    with pytest.raises(StateFileError, match=r"another version of Hibana \(format 'hibana-state/3'.*load it with "
                                             "the version that saved it"):
        qwen3.load_state(newer, state_id="newer")
    with pytest.raises(StateFileError, match=r"is not a Hibana state file .*'pt'.*a file that StateHandle.save wrote"):
        qwen3.load_state(ckpts["qwen3"] / "model.safetensors", state_id="weights")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for special in (pipe, Path(os.devnull)):
        with pytest.raises(StateFileError, match="is not a regular file"):
            qwen3.load_state(special, state_id="special")
    assert_bystander_unchanged(qwen3)


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="reads counted by /proc/self/io")
def test_a_large_file_of_another_kind_is_refused_from_its_header(qwen3, tmp_path):
    """Passing a model's weights (gigabytes) as a state file read them all into memory before
    looking at the header that says they are no state: seconds, and memory the engine's process
    may not have. A sparse file of 256 MiB with a checkpoint's header stands in for them."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    weights = tmp_path / "model.safetensors"
    with weights.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + bytes(16))
        f.truncate(256 << 20)

    def bytes_read() -> int:
        return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                        if line.startswith("rchar")).split()[1])

    before = bytes_read()
    with pytest.raises(StateFileError, match="is not a Hibana state file"):
        qwen3.load_state(weights, state_id="weights")
    assert bytes_read() - before < 16 << 20
    assert_bystander_unchanged(qwen3)


# --- cross-configuration loads ------------------------------------------------------------------

CONFIGS = {
    "float32": {},
    "block 8": dict(block_size=8),
    "max_model_len 128": dict(max_model_len=128),
    "bfloat16": dict(dtype="bfloat16"),
    "float16": dict(dtype="float16"),
    "kv8": dict(surgery=KV8),
    "kv8 block 32": dict(surgery=KV8, block_size=32),
    "bfloat16 kv8": dict(dtype="bfloat16", surgery=KV8),
    "w8": dict(surgery=["w8"], surgery_guard=False),
    "w4": dict(surgery=["w4"], surgery_guard=False),
    "window": dict(surgery=WINDOW, surgery_guard=False),
}
"""Options whose KV differs (dtype, KV dtype, passes) and options it does not depend on (block
size, a max_model_len that turns no window into full attention)."""


def _kv_key(options: dict) -> tuple:
    return options.get("dtype", "float32"), json.dumps(options.get("surgery", []), sort_keys=True)


def test_states_move_between_configurations_exactly_or_are_refused_naming_the_difference(ckpts, tmp_path):
    path = ckpts["qwen3"]
    prompt = random_tokens(random.Random(6), 45)
    engines, kept = {}, {}
    try:
        for name, options in CONFIGS.items():
            engine = engines[name] = open_engine(path, speculation="off", **options)
            h = engine.open_state("a")
            h.generate(greedy(5), prompt=prompt)
            h.save(tmp_path / f"{name}.state")
            history = h.tokens
            kept[name] = list(h.generate(greedy(6)).token_ids)  # what the engine that kept it goes on with
            if name == "float32":
                assert_greedy_matches(path, history, kept[name])
        for source, source_options in CONFIGS.items():
            for name, engine in engines.items():
                file = tmp_path / f"{source}.state"
                if _kv_key(source_options) != _kv_key(CONFIGS[name]):
                    with pytest.raises(StateFileError, match="than this engine's: .*(dtype|surgery)"):
                        engine.load_state(file, state_id=f"from {source}")
                    continue
                loaded = engine.load_state(file, state_id=f"from {source}")
                computed = engine.stats().prompt_tokens_computed
                assert list(loaded.generate(greedy(6)).token_ids) == kept[name], (source, name)
                assert engine.stats().prompt_tokens_computed - computed == 1, (source, name)  # its KV came back
                loaded.close()
    finally:
        for engine in engines.values():
            engine.close()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_5"])
def test_windowed_and_hybrid_states_across_block_sizes_and_context_lengths(ckpts, arch, tmp_path):
    """gemma3's windows (20 tokens, mid-block) and qwen3_5's linear-attention state: re-cut into
    other blocks they give transformers' tokens (or recompute where the file lacks a window's first
    rows); an engine whose max_model_len turns the windows into full attention refuses the file,
    and one whose context is shorter than the history says so."""
    path = ckpts[arch]
    prompt = random_tokens(random.Random(8), 60)
    options = {"block 16": {}, "block 8": dict(block_size=8), "block 32": dict(block_size=32),
               "max_model_len 40": dict(max_model_len=40)}
    if arch == "gemma3":
        options["max_model_len 20"] = dict(max_model_len=20)  # window + sink >= max_model_len: full attention
    engines = {name: open_engine(path, speculation="off", **o) for name, o in options.items()}
    try:
        h = engines["block 16"].open_state("a")
        h.generate(greedy(5), prompt=prompt)
        h.save(tmp_path / "a.state")
        history = h.tokens
        short = engines["max_model_len 40"].open_state("short")
        short.generate(greedy(4), prompt=prompt[:24])
        short.save(tmp_path / "short.state")
        for name, engine in engines.items():
            if name.startswith("max_model_len"):
                error = StateFileError if name == "max_model_len 20" else ContextLengthError
                with pytest.raises(error, match="max_model_len"):
                    engine.load_state(tmp_path / "a.state", state_id="a2")
                continue
            for file, tokens in (("a.state", history), ("short.state", short.tokens)):
                loaded = engine.load_state(tmp_path / file, state_id=f"{file}-2")
                assert loaded.tokens == tokens
                assert_greedy_matches(path, tokens, loaded.generate(greedy(6)).token_ids)
                loaded.close()
    finally:
        for engine in engines.values():
            engine.close()


def test_copied_and_edited_checkpoints(ckpts, saved, tmp_path):
    """A copy of the checkpoint in another folder is the same model; a config field that changes
    outputs (rms_norm_eps, rope_theta) or an added token makes it another; a chat template does not
    enter a state (its tokens are what was rendered), so a new one leaves its states loadable."""
    source, (file, history) = ckpts["qwen3"], saved

    def variant(name, edit=None) -> Path:
        folder = tmp_path / name
        shutil.copytree(source, folder)
        if edit is not None:
            edit(folder)
        return folder

    def edit_config(**fields):
        def edit(folder):
            config = json.loads((folder / "config.json").read_text())
            for key, value in fields.items():
                if key == "rope_theta":
                    config["rope_parameters"]["rope_theta"] = value
                else:
                    config[key] = value
            (folder / "config.json").write_text(json.dumps(config))
        return edit

    def added_token(folder):
        tokenizer = make_tokenizer()
        tokenizer.add_tokens(["<new>"])
        tokenizer.save_pretrained(folder)

    def chat_template(folder):
        tokenizer = make_tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tokenizer.save_pretrained(folder)

    for name, edit, loads in (("copy", None, True), ("template", chat_template, True),
                              ("eps", edit_config(rms_norm_eps=1e-3), False),
                              ("theta", edit_config(rope_theta=5000.0), False), ("token", added_token, False)):
        folder = variant(name, edit)
        with open_engine(folder, speculation="off") as engine:
            if loads:
                loaded = engine.load_state(file)
                assert loaded.tokens == history
                assert_greedy_matches(folder, history, loaded.generate(greedy(6)).token_ids)
            else:
                with pytest.raises(StateFileError, match="another checkpoint or tokenizer"):
                    engine.load_state(file)


# --- names and lifecycle ------------------------------------------------------------------------

def test_loads_onto_taken_ids_and_saves_of_busy_forked_and_emptied_states(qwen3, ckpts, saved, tmp_path):
    path, (file, history) = ckpts["qwen3"], saved
    with pytest.raises(StateExistsError, match="is open"):
        qwen3.load_state(file)  # its own id, "saved", is open
    twice = [qwen3.load_state(file, state_id=f"twice-{i}") for i in range(2)]
    assert [t.tokens for t in twice] == [history] * 2
    with pytest.raises(StateExistsError):
        qwen3.load_state(file, state_id="twice-0")
    # a streaming state: neither saved nor replaced meanwhile, and its stream goes on exactly
    streaming = twice[0]
    events = streaming.stream(greedy(12))
    first = next(events)
    with pytest.raises(StateExistsError):
        qwen3.load_state(file, state_id="twice-0")
    with pytest.raises(StateBusyError):
        streaming.save(tmp_path / "busy.state")
    rest = [e for e in events]
    assert not (tmp_path / "busy.state").exists()
    assert_greedy_matches(path, history, streaming.tokens[len(history):])
    assert first is not None and rest
    # fork, then save both; each comes back as it was
    fork = twice[1].fork("twice-fork")
    fork.generate(greedy(4))
    for h in (twice[1], fork):
        h.save(tmp_path / f"{h.id}.state")
        back = qwen3.load_state(tmp_path / f"{h.id}.state", state_id=f"{h.id}-back")
        assert back.tokens == h.tokens
        assert_greedy_matches(path, h.tokens, back.generate(greedy(5)).token_ids)
        back.close()
    # emptied, then saved: an empty state comes back and takes a new history
    fork.truncate(0)
    fork.save(tmp_path / "empty.state")
    empty = qwen3.load_state(tmp_path / "empty.state", state_id="empty")
    assert empty.tokens == []
    prompt = random_tokens(random.Random(9), 12)
    assert_greedy_matches(path, prompt, empty.generate(greedy(5), prompt=prompt).token_ids)
    for h in (*twice, fork, empty):
        h.close()
    assert_bystander_unchanged(qwen3)


@pytest.mark.parametrize("arch, options, tier", [
    ("qwen3", dict(surgery=KV8), "disk"),
    ("qwen3_5", {}, "host"),
    ("qwen3_5", {}, "disk"),
    ("gemma3", dict(num_blocks=9), "disk"),
])
def test_parked_states_save_what_they_hold_even_when_cut_while_parked(ckpts, arch, options, tier, tmp_path):
    """fp8 KV, a hybrid model's linear-attention state and sliding windows, parked in host memory
    or on disk, saved as they are and after a truncate that leaves them parked: each file gives, in
    a fresh engine of the same options, the tokens a fork of the parked state gives where it is
    (transformers' tokens too, but under fp8 KV, which transformers does not have)."""
    path = ckpts[arch]
    extra = dict(state_dir=tmp_path / "state_dir", host_kv_bytes=0) if tier == "disk" else {}
    engine = open_engine(path, speculation="off", **{"num_blocks": 22, **options, **extra})
    fresh = open_engine(path, speculation="off", **{k: v for k, v in options.items() if k != "num_blocks"})
    try:
        rng = random.Random(10)
        handles = []
        for i in range(3):
            h = engine.open_state(f"s{i}")
            h.generate(greedy(3), prompt=random_tokens(rng, 130))
            handles.append(h)
        tiers = {s.id: s.tier for s in engine.states()}
        assert tiers["s0"] == tier, tiers
        parked = handles[0]
        for cut in (None, 100, 64):
            if cut is not None:
                parked.truncate(cut)
            parked.save(tmp_path / "parked.state")
            loaded = fresh.load_state(tmp_path / "parked.state", state_id=f"cut-{cut}")
            assert loaded.tokens == parked.tokens
            got = list(loaded.generate(greedy(5)).token_ids)
            twin = parked.fork(f"twin-{cut}")  # (a parked state's fork resumes from its parked copy)
            assert got == list(twin.generate(greedy(5)).token_ids), cut
            twin.close()
            if "surgery" not in options:
                assert_greedy_matches(path, parked.tokens, got)
            loaded.close()
    finally:
        engine.close()
        fresh.close()


def test_a_state_dir_reopened_under_other_options(ckpts, tmp_path):
    """A restart over the same state_dir with another dtype, fp8 KV or surgery refuses that id
    alone, naming the difference, and leaves its file as it was; another block size resumes it
    exactly; a shorter context says which max_model_len opens it. The first options still resume it."""
    path, state_dir = ckpts["qwen3"], tmp_path / "state_dir"
    prompt = random_tokens(random.Random(11), 60)
    with open_engine(path, speculation="off", state_dir=state_dir) as engine:
        h = engine.open_state("a")
        h.generate(greedy(5), prompt=prompt)
        history = h.tokens
    (file,) = state_dir.glob("*.state")
    data = file.read_bytes()
    for options, error, says in ((dict(dtype="bfloat16"), StateFileError, "dtype float32 .this engine: bfloat16"),
                                 (dict(surgery=KV8), StateFileError, "kv8"),
                                 (dict(surgery=["w8"], surgery_guard=False), StateFileError, "surgery none"),
                                 (dict(max_model_len=32), ContextLengthError, "max_model_len >= 65")):
        with open_engine(path, speculation="off", state_dir=state_dir, **options) as engine:
            with pytest.raises(error, match=says):
                engine.open_state("a")
            other = engine.open_state("b")
            other.generate(greedy(2), prompt=prompt[:10])
            other.close()
        assert file.read_bytes() == data
    for options in (dict(block_size=8), {}):
        with open_engine(path, speculation="off", state_dir=state_dir, **options) as engine:
            h = engine.open_state("a")
            assert h.tokens == history
            computed = engine.stats().prompt_tokens_computed
            assert_greedy_matches(path, history, h.generate(greedy(5)).token_ids)
            assert engine.stats().prompt_tokens_computed - computed == 1
            h.truncate(len(history))


def test_a_state_saved_with_a_draft_model_loads_without_one_and_the_other_way(ckpts, tmp_path):
    """The file holds the target's KV only; the draft model's is rebuilt from the history."""
    path = ckpts["qwen3"]
    draft = {"method": "draft_model", "draft_model": str(path), "k": 4}
    prompt = random_tokens(random.Random(12), 50)
    with open_engine(path, speculation=draft) as drafting, open_engine(path, speculation="off") as plain:
        assert drafting.fingerprint == plain.fingerprint
        for source, target, name in ((drafting, plain, "drafted"), (plain, drafting, "plain")):
            h = source.open_state(name)
            h.generate(greedy(6), prompt=prompt)
            h.save(tmp_path / f"{name}.state")
            loaded = target.load_state(tmp_path / f"{name}.state", state_id=f"{name}-loaded")
            assert_greedy_matches(path, h.tokens, loaded.generate(greedy(10)).token_ids)
            loaded.append(prompt[:5])
            assert_greedy_matches(path, loaded.tokens, loaded.generate(greedy(8)).token_ids)


def test_a_slow_tokenizers_files_are_part_of_the_fingerprint(tmp_path):
    """A checkpoint with no tokenizer.json is tokenized from its slow tokenizer's files (here a
    GPT-2 vocab.json and merges.txt); the fingerprint covered tokenizer.json alone, so a state
    loaded into the same weights under another vocabulary, whose ids spell other text."""
    path = make_tiny_checkpoint("qwen3", tmp_path / "slow")
    model = json.loads((path / "tokenizer.json").read_text())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (path / "vocab.json").write_text(json.dumps(model["vocab"]))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (path / "tokenizer.json").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    with open_engine(path) as engine:
        handle = engine.open_state("slow")
        handle.sync(engine.tokenizer.encode("the state of a slow tokenizer's checkpoint"))
        handle.save(tmp_path / "slow.state")
    vocab = dict(model["vocab"])
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids that spell each other's text
    (path / "vocab.json").write_text(json.dumps(vocab))
    with open_engine(path) as engine, pytest.raises(StateFileError, match="another checkpoint or tokenizer"):
        engine.load_state(tmp_path / "slow.state")
