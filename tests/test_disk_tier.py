"""The disk tier (issue 17): with a `state_dir`, parked KV that the host budget cannot hold goes
to disk instead of being dropped, and comes back from there; output stays equal to transformers'
greedy, and every turn still computes only its new tokens."""

from __future__ import annotations

import random

import pytest

from hibana_core import SamplingParams
from test_host_tier import AGENTS, DEVICE_BLOCKS, GENERATE, TURNS, assert_only_new_tokens_computed, round_robin
from tiny_models import random_tokens


@pytest.mark.parametrize("host_states", [0, 1], ids=["disk only", "host for one state"])
def test_turns_compute_only_their_new_tokens_through_disk(tiny_checkpoints, make_engine, hf_greedy,
                                                          tmp_path, host_states):
    path = tiny_checkpoints["llama"]
    per_state = 9 * 65536  # bytes_per_block_here of the tiny llama is below 64 KiB: a state fits
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off", state_dir=tmp_path,
                         host_kv_bytes=host_states * per_state)
    tiers_seen = set()

    def check(prompt, got):
        assert list(got) == hf_greedy(str(path), prompt, GENERATE)
        tiers_seen.update(info.tier for info in engine.states())

    computed = round_robin(engine, seed=7, check=check)
    assert_only_new_tokens_computed(computed)
    tier = engine.stats().host_tier
    assert tier["spills"] >= AGENTS and tier["disk_resumes"] >= AGENTS
    assert tier["dropped"] == 0 and tier["bytes_used"] <= tier["budget_bytes"]
    assert "disk" in tiers_seen
    memory = engine.memory()
    spill = memory["disk"]["folder"]
    assert spill is not None and memory["disk"]["kv_parked"] == tier["disk_bytes_used"] > 0
    on_disk = sum(s["bytes"] for s in memory["states"].values() if s["tier"] == "disk")
    assert on_disk == tier["disk_bytes_used"]
    engine.close()
    assert not (tmp_path / spill).exists()  # the spill folder goes with the engine


def test_a_spilled_state_is_persisted_and_resumes_exactly(tiny_checkpoints, make_engine, hf_greedy, tmp_path):
    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off", state_dir=tmp_path, host_kv_bytes=0)
    round_robin(engine, seed=8)
    spilled = [info.id for info in engine.states() if info.tier == "disk"]
    assert spilled
    histories = {state_id: engine.open_state(state_id).tokens for state_id in spilled}
    engine.close()  # writes every named state, the spilled ones from their files
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off", state_dir=tmp_path, host_kv_bytes=0)
    for state_id, tokens in histories.items():
        h = engine.open_state(state_id)
        assert h.tokens == tokens
        more = tokens + [7, 8, 9]
        done = h.generate(_greedy(), prompt=more)
        assert done.stats.computed <= 4  # the 3 new tokens and the last generated one, nothing older
        assert list(done.token_ids) == hf_greedy(str(path), more, GENERATE)


def test_closing_a_spilled_state_deletes_its_file(tiny_checkpoints, make_engine, tmp_path):
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, speculation="off",
                         state_dir=tmp_path, host_kv_bytes=0)
    round_robin(engine, seed=9)
    folder = tmp_path / engine.memory()["disk"]["folder"]
    before = len(list(folder.iterdir()))
    spilled = next(info.id for info in engine.states() if info.tier == "disk")
    engine.open_state(spilled).close()
    assert len(list(folder.iterdir())) == before - 1


def _on_disk(tiny_checkpoints, make_engine, tmp_path, seed: int):
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, speculation="off",
                         state_dir=tmp_path, host_kv_bytes=0)
    round_robin(engine, seed=seed)
    return engine, next(info.id for info in engine.states() if info.tier == "disk")


def test_a_fork_of_a_state_on_disk_has_its_own_copy(tiny_checkpoints, make_engine, hf_greedy, tmp_path):
    """The parent closed (its file deleted), the fork still resumes from disk, exactly."""
    engine, spilled = _on_disk(tiny_checkpoints, make_engine, tmp_path, seed=10)
    parent = engine.open_state(spilled)
    twin = parent.fork("twin")
    assert {info.id: info.tier for info in engine.states()}["twin"] == "disk"
    parent.close()
    prompt = twin.tokens + [5, 6, 7]
    done = twin.generate(_greedy(), prompt=prompt)
    assert list(done.token_ids) == hf_greedy(str(tiny_checkpoints["llama"]), prompt, GENERATE)
    assert done.stats.computed <= 4


def test_a_spill_file_shared_by_forks_is_counted_once(tiny_checkpoints, make_engine, tmp_path):
    """Forks of a state on disk hard-link its spill file: the disk tier's bytes are the files'
    (as the host tier counts a copy shared by forks once), each state lists its copy as shared."""
    engine, spilled = _on_disk(tiny_checkpoints, make_engine, tmp_path, seed=10)
    before = engine.memory()["disk"]["kv_parked"]
    size = engine.memory()["states"][spilled]["bytes"]
    assert size > 0 and engine.memory()["disk"]["kv_shared"] == 0
    parent = engine.open_state(spilled)
    parent.fork("twin-1"), parent.fork("twin-2")
    memory = engine.memory()
    folder = tmp_path / memory["disk"]["folder"]
    on_disk = sum({f.stat().st_ino: f.stat().st_size for f in folder.glob("*.kv")}.values())
    assert memory["disk"]["kv_parked"] == engine.stats().host_tier["disk_bytes_used"] == before == on_disk
    sizes = {(memory["states"][state_id]["bytes"], memory["states"][state_id]["shared"])
             for state_id in ("twin-1", "twin-2", spilled)}
    assert sizes == {(0, size)} and memory["disk"]["kv_shared"] == size
    parent.close()  # the forks' links keep the file
    assert engine.memory()["disk"]["kv_parked"] == before


def test_an_unreadable_spill_file_costs_its_state_a_recompute_only(tiny_checkpoints, make_engine, hf_greedy,
                                                                   tmp_path):
    engine, spilled = _on_disk(tiny_checkpoints, make_engine, tmp_path, seed=11)
    folder = tmp_path / engine.memory()["disk"]["folder"]
    before = {p.name for p in folder.iterdir()}
    h = engine.open_state(spilled)
    for path in folder.iterdir():  # every spill file damaged: the one of `spilled` among them
        path.write_bytes(b"not a safetensors file")
    prompt = h.tokens + [5, 6, 7]
    done = h.generate(_greedy(), prompt=prompt)
    assert list(done.token_ids) == hf_greedy(str(tiny_checkpoints["llama"]), prompt, GENERATE)
    assert done.stats.computed == len(prompt)  # recomputed, and the engine served it
    assert before  # (there were files to damage)
    histories = {info.id: engine.open_state(info.id).tokens for info in engine.states()}
    damaged = [info.id for info in engine.states() if info.tier == "disk"]
    engine.close()  # the other damaged states' KV is lost, not their histories: written as tokens
    assert not folder.exists() and damaged
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, speculation="off", state_dir=tmp_path,
                         host_kv_bytes=0)
    for state_id, tokens in histories.items():  # (they were not written at all: their histories lost)
        assert engine.open_state(state_id).tokens == tokens, state_id


@pytest.mark.parametrize("damage", ["bits flipped", "another state's file"])
def test_a_spill_file_damaged_in_its_data_is_refused_not_restored(tiny_checkpoints, make_engine, hf_greedy,
                                                                  tmp_path, damage):
    """A spill file that still parses, its KV bytes flipped or swapped for another state's file of
    the same shape: checked against the checksum taken when it was written, its state recomputes
    (it was restored as it was: greedy output all token 0)."""
    engine, _ = _on_disk(tiny_checkpoints, make_engine, tmp_path, seed=11)
    spilled = [info.id for info in engine.states() if info.tier == "disk"]
    files = {state_id: engine.registry._entries[state_id].seq.parked.path for state_id in spilled}
    victim = spilled[0]
    if damage == "bits flipped":
        data = bytearray(files[victim].read_bytes())
        for at in range(len(data) - 2000, len(data), 7):  # in the KV, past the header
            data[at] ^= 0x55
        files[victim].write_bytes(bytes(data))
    else:
        twin = next(s for s in spilled[1:] if files[s].stat().st_size == files[victim].stat().st_size)
        files[victim].write_bytes(files[twin].read_bytes())
    h = engine.open_state(victim)
    prompt = h.tokens + [5, 6, 7]
    done = h.generate(_greedy(), prompt=prompt)
    assert list(done.token_ids) == hf_greedy(str(tiny_checkpoints["llama"]), prompt, GENERATE)
    assert done.stats.computed == len(prompt)


def test_saving_a_state_whose_spill_file_is_damaged_writes_its_history(tiny_checkpoints, make_engine, hf_greedy,
                                                                         tmp_path):
    """h.save() of a state on disk whose spill file cannot be read: its history is saved and its KV
    recomputed after the load (h.save raised safetensors' own error, no HibanaError, and kept
    the damaged copy)."""
    path = tiny_checkpoints["llama"]
    engine, spilled = _on_disk(tiny_checkpoints, make_engine, tmp_path, seed=14)
    h = engine.open_state(spilled)
    engine.registry._entries[spilled].seq.parked.path.write_bytes(b"not a safetensors file")
    h.save(tmp_path / "saved.state")
    assert {info.id: info.tier for info in engine.states()}[spilled] == "none"
    loaded = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off").load_state(tmp_path / "saved.state")
    assert loaded.tokens == h.tokens
    prompt = h.tokens + [5, 6, 7]
    done = loaded.generate(_greedy(), prompt=prompt)
    assert list(done.token_ids) == hf_greedy(str(path), prompt, GENERATE) and done.stats.computed == len(prompt)


def test_closing_a_state_frees_its_parked_copy_at_once(tiny_checkpoints, make_engine, tmp_path):
    """Even while something else (here the test, as a finished stream would) still references its
    sequence: the copy is not left to the garbage collector."""
    engine, spilled = _on_disk(tiny_checkpoints, make_engine, tmp_path, seed=12)
    held = engine.registry._entries[spilled].seq  # noqa: F841 - the reference that must not matter
    disk_states = engine.stats().host_tier["disk_states"]
    files = len(list((tmp_path / engine.memory()["disk"]["folder"]).iterdir()))
    engine.open_state(spilled).close()
    assert engine.stats().host_tier["disk_states"] == disk_states - 1
    assert len(list((tmp_path / engine.memory()["disk"]["folder"]).iterdir())) == files - 1


def test_a_relative_state_dir_stays_where_it_was_given_after_a_chdir(tiny_checkpoints, make_engine, tmp_path,
                                                                     monkeypatch):
    """An agent's tool changes the working directory: spills went to a folder that did not exist
    there (KV dropped), states were written under the new directory and the spill folder was
    left behind."""
    (tmp_path / "given").mkdir(), (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "given")
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, speculation="off",
                         state_dir="states", host_kv_bytes=0)
    monkeypatch.chdir(tmp_path / "later")
    round_robin(engine, seed=13)
    assert engine.stats().host_tier["spills"] >= AGENTS and engine.stats().host_tier["dropped"] == 0
    engine.close()
    assert sorted(p.suffix for p in (tmp_path / "given" / "states").iterdir()) == [".state"] * AGENTS
    assert not any((tmp_path / "later").iterdir())


def _greedy():
    from hibana_core import SamplingParams

    return SamplingParams(max_tokens=GENERATE, ignore_eos=True)


def test_a_dead_process_spill_folder_is_removed_at_start(tiny_checkpoints, make_engine, tmp_path, caplog):
    import logging
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"spill-{dead.stdout.strip()}-abc123"
    stale.mkdir()
    (stale / "00000000.kv").write_bytes(b"left by a crash")
    with caplog.at_level(logging.WARNING, logger="hibana.engine"):
        mine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, state_dir=tmp_path, host_kv_bytes=0)
    assert not stale.exists()
    # scratch of an engine that never closed: removed, and said (an outside tester found it silent)
    assert "1 spilled KV file(s) of an engine that ended without closing" in caplog.text
    other = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, state_dir=tmp_path, host_kv_bytes=0)
    assert (tmp_path / mine.memory()["disk"]["folder"]).exists()  # a live process's folder stays
    other.close()


def test_a_spill_folder_lives_by_its_lock_not_its_pid(tiny_checkpoints, make_engine, tmp_path):
    """A pid means nothing in another container sharing the volume, and after a restart that
    reused it: a folder whose owner lock is held stays whatever its pid, and one whose lock is
    free goes, though its pid is this very process's (a new user's trial: a live engine's folder
    deleted by another container's, a crashed one's kept forever)."""
    import fcntl
    import os

    from hibana_core.engine import SPILL_LOCK

    live = tmp_path / "spill-999999999-other"  # no such pid here: another container's engine
    live.mkdir()
    held = open(live / SPILL_LOCK, "w")
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    crashed = tmp_path / f"spill-{os.getpid()}-crashed"  # this pid, reused after a crash
    crashed.mkdir()
    (crashed / SPILL_LOCK).write_text("")
    (crashed / "00000000.kv").write_bytes(b"left by a crash")
    try:
        engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, state_dir=tmp_path, host_kv_bytes=0)
        assert live.exists() and not crashed.exists()
        folder = tmp_path / engine.memory()["disk"]["folder"]
        assert (folder / SPILL_LOCK).is_file()
        engine.close()
        assert not folder.exists()
    finally:
        held.close()


def test_the_resume_benchmark_parks_and_resumes_through_each_tier(tmp_path):
    """bench/resume_cost.py (run_h200.sh resume) on the demo model: each tier takes the state and
    gives it back, the resumed turn computing only its new token and the last generated one."""
    import torch

    from hibana_bench.models import load_bench_model
    from hibana_bench.resume_cost import resume_once

    model = load_bench_model("demo", torch.device("cpu"), torch.float32)
    for name, host_states in (("host", 1), ("disk", 0)):
        row = resume_once(model, 200, host_states, tmp_path / name, model.vocab_size)
        assert row["tier"] == name and row["computed"] <= 2 and row["bytes"] > 0
        assert (row["disk_bytes"] > 0) == (name == "disk")


def test_a_persisted_state_opened_while_requests_fill_the_pool_waits_on_disk(tiny_checkpoints, make_engine, hf_greedy,
                                                                             tmp_path):
    """After a restart with no host tier, a state opened while running requests hold every device
    block cannot be placed there: it is parked on disk (a MemoryBudgetError before) and its next
    turn computes only its last token."""
    path = tiny_checkpoints["qwen2"]
    rng = random.Random(11)
    history = random_tokens(rng, 40)
    engine = make_engine(path, state_dir=tmp_path, num_blocks=6, host_kv_bytes=0, speculation="off")
    engine.open_state("saved").sync(history)
    engine.close()
    engine = make_engine(path, state_dir=tmp_path, num_blocks=6, host_kv_bytes=0, speculation="off")
    running = engine.open_state("runner").stream(SamplingParams(max_tokens=16, ignore_eos=True),
                                                  prompt=random_tokens(rng, 80))
    next(running)  # its 6 blocks are the whole pool
    saved = engine.open_state("saved")
    assert saved.tokens == history and {i.id: i.tier for i in engine.states()}["saved"] == "disk"
    for _ in running:
        pass
    done = saved.generate(SamplingParams(max_tokens=4, ignore_eos=True))
    assert done.stats.computed == 1 and list(done.token_ids) == hf_greedy(str(path), history, 4)


def test_a_state_file_loaded_while_requests_fill_the_pool_is_parked(tiny_checkpoints, make_engine, hf_greedy,
                                                                    tmp_path):
    """load_state while running requests hold every device block: the file's KV waits in the host
    tier (a MemoryBudgetError before) and the state's next turn computes only its last token."""
    path = tiny_checkpoints["qwen2"]
    rng = random.Random(12)
    history = random_tokens(rng, 40)
    first = make_engine(path, num_blocks=6, speculation="off")
    saved = first.open_state("saved")
    saved.sync(history)
    saved.save(tmp_path / "saved.state")
    engine = make_engine(path, num_blocks=6, speculation="off")
    running = engine.open_state("runner").stream(SamplingParams(max_tokens=16, ignore_eos=True),
                                                  prompt=random_tokens(rng, 80))
    next(running)  # its 6 blocks are the whole pool
    loaded = engine.load_state(tmp_path / "saved.state")
    assert loaded.tokens == history and {i.id: i.tier for i in engine.states()}["saved"] == "host"
    for _ in running:
        pass
    done = loaded.generate(SamplingParams(max_tokens=4, ignore_eos=True))
    assert done.stats.computed == 1 and list(done.token_ids) == hf_greedy(str(path), history, 4)


def test_a_state_dir_that_cannot_be_written_is_refused_before_the_weights_load(tiny_checkpoints, tmp_path,
                                                                                monkeypatch):
    """(`hibana serve --state-dir` on such a folder said so only after the whole load and warm-up)"""
    import hibana_core.engine
    from hibana_core import ConfigError, Engine

    def load(*args, **kwargs):
        raise AssertionError("the weights loaded before state_dir was checked")

    monkeypatch.setattr(hibana_core.engine, "load_model", load)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="state_dir .* cannot be written"):
        Engine.from_pretrained(str(tiny_checkpoints["llama"]), device="cpu", progress=False,
                               state_dir=str(blocker / "states"))
