"""The files that hold agents' conversations are their owner's alone (0600), whatever the umask:
saved state files, `state_dir`'s persisted states and the disk tier's spill files, and the folders
Hibana makes for them (0700). A state's tokens are its whole conversation, every user message and
tool result, and text can be recovered from its KV; on a shared machine a 0644 file is any local
user's to read.

The mode must not hang on how safetensors writes: before 0.8 its `save_file` writes in place
(`File::create`: a new file takes the umask's mode, 0644 under umask 022), from 0.8 through an
owner-only temporary file renamed onto the path. Each test runs under the installed safetensors
and under writers standing in for the others (`WRITERS`). POSIX only: Windows keeps only the
read-only bit of a mode."""

from __future__ import annotations

import os
import random
import shutil
import stat
from pathlib import Path

import pytest
import safetensors.torch

import tiny_models
from hibana_core import SamplingParams
from tiny_models import random_tokens

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes (Windows keeps only the read-only bit)")

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _in_place(tensors, filename, metadata=None):
    """safetensors < 0.8: the file written in place, a new one with the umask's mode."""
    with open(filename, "wb") as file:
        file.write(safetensors.torch.save(tensors, metadata=metadata))


def _anew(tensors, filename, metadata=None):
    """A writer that renames a file of its own, made with the umask's mode, onto the path."""
    with open(f"{filename}.new", "wb") as file:
        file.write(safetensors.torch.save(tensors, metadata=metadata))
    os.replace(f"{filename}.new", filename)


WRITERS = {"installed": None, "in place": _in_place, "anew": _anew}


@pytest.fixture(params=list(WRITERS))
def writer(request, monkeypatch):
    """Under umask 0o022 (restored after), with safetensors' `save_file` as each writer writes."""
    if WRITERS[request.param] is not None:
        monkeypatch.setattr(safetensors.torch, "save_file", WRITERS[request.param])
    old = os.umask(0o022)
    yield request.param
    os.umask(old)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_models.make_tiny_checkpoint("llama", tmp_path_factory.mktemp("private_files") / "llama")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_saved_state_file_is_owner_only(llama, make_engine, tmp_path, writer):
    engine = make_engine(llama, speculation="off")
    h = engine.open_state("agent")
    h.generate(PARAMS, prompt=list(range(5, 45)))
    path = tmp_path / "made" / "agent.state"  # its folder made by the save
    h.save(path)
    assert (_mode(path), _mode(path.parent)) == (0o600, 0o700)
    assert [p.name for p in path.parent.iterdir()] == ["agent.state"]  # written atomically: no temporary file left
    os.chmod(path, 0o644)
    h.save(path)  # over a readable file: replaced by an owner-only one (never loosened)
    assert _mode(path) == 0o600
    given = tmp_path / "given"  # a folder the caller made keeps its mode
    given.mkdir(mode=0o755)
    h.save(given / "agent.state")
    assert (_mode(given / "agent.state"), _mode(given)) == (0o600, 0o755)
    loaded = engine.load_state(path, "loaded")
    assert loaded.tokens == h.tokens
    more = loaded.tokens + [7, 8]
    assert loaded.generate(PARAMS, prompt=more).token_ids == h.generate(PARAMS, prompt=more).token_ids


def _spill(engine, prompts: dict[str, list[int]]) -> None:
    """One turn on each state: in a pool of 10 blocks (5 a state), each parks the one before last."""
    for state_id, prompt in prompts.items():
        h = engine.open_state(state_id)
        h.generate(PARAMS, prompt=(h.tokens or prompt) + [7])


def _spilled(folder: Path) -> list[Path]:
    files = list(folder.glob("*.kv"))
    assert files
    return files


def test_spill_files_and_the_folders_made_for_them_are_owner_only(llama, make_engine, tmp_path, writer):
    state_dir = tmp_path / "made" / "states"  # made by the engine
    engine = make_engine(llama, num_blocks=10, speculation="off", state_dir=state_dir, host_kv_bytes=0)
    rng = random.Random(3)
    prompts = {f"a{i}": random_tokens(rng, 60) for i in range(3)}
    _spill(engine, prompts)
    folder = state_dir / engine.memory()["disk"]["folder"]
    assert "disk" in {info.tier for info in engine.states()}
    assert (_mode(state_dir), _mode(folder)) == (0o700, 0o700)
    assert {_mode(f) for f in _spilled(folder)} == {0o600}
    shutil.rmtree(folder)  # (a cleanup job): the folder made again at the next spill, owner-only too
    _spill(engine, prompts)
    assert _mode(folder) == 0o700 and {_mode(f) for f in _spilled(folder)} == {0o600}
    on_disk = next(info.id for info in engine.states() if info.tier == "disk")
    h = engine.open_state(on_disk)  # resumes from its spill file, computing only its new tokens
    done = h.generate(PARAMS, prompt=h.tokens + [9])
    assert done.stats.computed <= 2
    histories = {info.id: engine.open_state(info.id).tokens for info in engine.states()}
    engine.close()  # every named state persisted in state_dir: owner-only files
    persisted = list(state_dir.glob("*.state"))
    assert len(persisted) == len(histories) and {_mode(f) for f in persisted} == {0o600}
    engine = make_engine(llama, num_blocks=10, speculation="off", state_dir=state_dir, host_kv_bytes=0)
    assert {state_id: engine.open_state(state_id).tokens for state_id in histories} == histories


def test_a_state_dir_the_caller_made_keeps_its_mode(llama, make_engine, tmp_path, writer):
    """Its mode is the caller's to choose (a group's backups may read it); the files in it are
    owner-only all the same, and the spill folder in it is."""
    state_dir = tmp_path / "states"
    state_dir.mkdir(mode=0o755)
    engine = make_engine(llama, num_blocks=10, speculation="off", state_dir=state_dir, host_kv_bytes=0)
    rng = random.Random(4)
    _spill(engine, {f"a{i}": random_tokens(rng, 60) for i in range(3)})
    folder = state_dir / engine.memory()["disk"]["folder"]
    assert (_mode(state_dir), _mode(folder)) == (0o755, 0o700)
    assert {_mode(f) for f in _spilled(folder)} == {0o600}
    engine.close()
    assert _mode(state_dir) == 0o755 and {_mode(f) for f in state_dir.glob("*.state")} == {0o600}
