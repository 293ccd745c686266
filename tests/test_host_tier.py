"""The host tier (hibana_core/kv/tiers.py): idle states' KV parked in host memory when the device
pool needs room, copied back when they resume, so a turn computes only its new tokens; output
equal to transformers' greedy on the full history throughout."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from hibana_core import ConfigError, MemoryBudgetError, SamplingParams, StateFileError
from hibana_core.kv import state_file
from tiny_models import random_tokens

AGENTS, TURNS, NEW, GENERATE = 8, 6, 8, 6
DEVICE_BLOCKS = 22  # two agents' whole histories (at most 60 + 6 x 14 = 144 tokens: 9 blocks each), a few spare


def round_robin(engine, seed: int, check=None) -> list[list[tuple[int, int]]]:
    """AGENTS agents take TURNS turns in turn order, each turn a few new tokens (a tool result)
    and a short generation. Returns per turn, per agent: (prompt tokens computed, tokens that
    were new since the state's last call, the last generated token included)."""
    rng = random.Random(seed)
    handles = [engine.open_state(f"agent-{i}") for i in range(AGENTS)]
    histories = [random_tokens(rng, 60) for _ in range(AGENTS)]
    known = [0] * AGENTS  # tokens of each history the engine already saw
    computed = []
    for _ in range(TURNS):
        row = []
        for i, h in enumerate(handles):
            prompt = histories[i] + random_tokens(rng, NEW)
            done = h.generate(SamplingParams(max_tokens=GENERATE, ignore_eos=True), prompt=prompt)
            if check is not None:
                check(prompt, done.token_ids)
            row.append((done.stats.computed, len(prompt) - max(0, known[i] - 1)))
            histories[i] = prompt + list(done.token_ids)
            known[i] = len(histories[i])
        computed.append(row)
    return computed


def assert_only_new_tokens_computed(computed: list[list[tuple[int, int]]]) -> None:
    """Every turn after the first of `round_robin` computed exactly its new tokens."""
    for turn, row in enumerate(computed[1:], 1):
        assert [c for c, _ in row] == [new for _, new in row], f"turn {turn}: (computed, new) {row}"


def test_turns_compute_only_their_new_tokens(tiny_checkpoints, make_engine, hf_greedy):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off")

    def check(prompt, got):
        assert list(got) == hf_greedy(str(path), prompt, GENERATE)

    computed = round_robin(engine, seed=1, check=check)
    assert_only_new_tokens_computed(computed)
    stats = engine.stats()
    assert stats.parks >= AGENTS and stats.resumes >= AGENTS * (TURNS - 2)
    assert stats.host_tier["tokens_restored"] > 0 and stats.host_tier["bytes_used"] <= stats.host_tier["budget_bytes"]
    assert stats.kv_blocks_used <= DEVICE_BLOCKS


def test_without_the_tier_the_same_turns_recompute(tiny_checkpoints, make_engine):
    """The baseline the tier is measured against (and proof the test above can fail)."""
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, speculation="off", host_kv_bytes=0)
    computed = round_robin(engine, seed=1)
    recomputed = sum(c - new for row in computed[1:] for c, new in row)
    assert recomputed > AGENTS * (TURNS - 1) * NEW
    assert engine.stats().parks == 0 and engine.stats().host_tier is None


def test_budget_drops_the_oldest_copies_and_output_stays_exact(tiny_checkpoints, make_engine, hf_greedy):
    """A host budget for about one state: older copies are dropped (those states recompute)."""
    path = tiny_checkpoints["qwen3"]
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off")
    per_state = 9 * engine.kv_cache.bytes_per_block_here
    engine.close()
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off", host_kv_bytes=per_state)

    def check(prompt, got):
        assert list(got) == hf_greedy(str(path), prompt, GENERATE)

    round_robin(engine, seed=2, check=check)
    tier = engine.stats().host_tier
    assert tier["dropped"] > 0 and tier["bytes_used"] <= per_state


def three_states(engine, seed: int):
    """States s0, s1, s2 synced to 130 random tokens each (9 blocks): the third parks the first."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, 130) for _ in range(3)]
    handles = [engine.open_state(f"s{i}") for i in range(3)]
    for h, p in zip(handles, prompts):
        h.sync(p)
    return handles, prompts


def test_states_memory_and_save_of_a_parked_state(tiny_checkpoints, make_engine, tmp_path, hf_greedy):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off")
    handles, prompts = three_states(engine, seed=3)
    tiers = {info.id: info.tier for info in engine.states()}
    assert tiers["s0"] == "host" and tiers["s2"] == "device"
    memory = engine.memory()
    assert memory["states"]["s0"]["tier"] == "host" and memory["states"]["s0"]["bytes"] > 0
    assert memory["host"]["kv_parked"] == sum(s["bytes"] for s in memory["states"].values() if s["tier"] == "host")
    assert memory["device"]["kv_used"] <= memory["device"]["kv_pool"]
    handles[0].save(tmp_path / "s0.state")  # from its parked copy: the file holds its KV
    handles[0].close()
    other = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off")
    loaded = other.load_state(tmp_path / "s0.state")
    done = loaded.generate(SamplingParams(max_tokens=GENERATE, ignore_eos=True))
    assert done.stats.computed == 1  # the last token's logits only
    assert list(done.token_ids) == hf_greedy(str(path), prompts[0], GENERATE)


def test_fork_of_a_parked_state_resumes_without_recompute(tiny_checkpoints, make_engine, hf_greedy):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=DEVICE_BLOCKS, speculation="off")
    handles, prompts = three_states(engine, seed=4)
    before = engine.stats().host_tier["bytes_used"]
    twin = handles[0].fork("s0-twin")
    assert engine.stats().host_tier["bytes_used"] == before  # one tensor for both: counted once
    handles[2].close()
    handles[1].close()
    done = twin.generate(SamplingParams(max_tokens=GENERATE, ignore_eos=True))
    assert done.stats.computed == 1
    assert list(done.token_ids) == hf_greedy(str(path), prompts[0], GENERATE)


def test_memory_lists_a_parked_copy_shared_by_a_fork_as_shared(tiny_checkpoints, make_engine):
    """A fork of a parked state holds its parent's host copy: as on the device, each lists it as
    `shared` (no `bytes` of its own: closing either frees nothing), the host's `kv_shared` once."""
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, speculation="off")
    handles, _ = three_states(engine, seed=4)
    size = engine.memory()["states"]["s0"]["bytes"]
    assert size > 0 and engine.memory()["host"]["kv_shared"] == 0
    handles[0].fork("s0-twin")
    memory = engine.memory()
    host, states = memory["host"], memory["states"]
    assert states["s0"] == states["s0-twin"] == {"tier": "host", "tokens": 130, "bytes": 0, "shared": size}
    assert host["kv_shared"] == size and host["kv_parked"] == size
    assert sum(s["bytes"] for s in states.values() if s["tier"] == "host") + host["kv_shared"] == host["kv_parked"]
    handles[0].close()
    memory = engine.memory()
    assert memory["states"]["s0-twin"]["bytes"] == size and memory["host"]["kv_shared"] == 0


def test_a_host_budget_of_one_state_resumes_it_while_parking_another(tiny_checkpoints, make_engine, hf_greedy):
    """The host tier holds one copy and the device pool one state: resuming the parked state
    evicts the resident one, whose copy must not push out the very copy being resumed."""
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path, num_blocks=4, speculation="off")
    per_state = 3 * engine.kv_cache.bytes_per_block_here
    engine.close()
    engine = make_engine(path, num_blocks=4, speculation="off", host_kv_bytes=per_state)
    rng = random.Random(6)
    prompts = [random_tokens(rng, 40) for _ in range(2)]
    first, second = engine.open_state("first"), engine.open_state("second")
    first.sync(prompts[0])
    second.sync(prompts[1])  # parks the first
    assert {i.id: i.tier for i in engine.states()}["first"] == "host"
    done = first.generate(SamplingParams(max_tokens=GENERATE, ignore_eos=True))
    assert list(done.token_ids) == hf_greedy(str(path), prompts[0], GENERATE)
    assert done.stats.computed == 1  # resumed from its copy (the second, evicted, has no room there)
    done = second.generate(SamplingParams(max_tokens=GENERATE, ignore_eos=True))
    assert list(done.token_ids) == hf_greedy(str(path), prompts[1], GENERATE)
    first.close(), second.close()
    assert engine.stats().kv_blocks_used == 0 and engine.stats().host_tier["bytes_used"] == 0


def test_bad_host_budget(tiny_checkpoints, make_engine):
    with pytest.raises(ConfigError, match="host_kv_bytes"):
        make_engine(tiny_checkpoints["llama"], host_kv_bytes=-1)


def test_a_host_budget_larger_than_the_machine_is_a_memory_budget_error(tiny_checkpoints, make_engine):
    """As a memory_budget past the device's memory is: parking up to it would run the host out of
    memory (the process killed, every state lost) rather than spill or drop."""
    with pytest.raises(MemoryBudgetError, match="host_kv_bytes=.* is more than the .* bytes of host memory"):
        make_engine(tiny_checkpoints["llama"], host_kv_bytes=1 << 60)


# --- state_dir: states found again after a restart ---------------------------------------------

def test_states_resume_after_a_restart_with_nothing_recomputed(tiny_checkpoints, make_engine, tmp_path, hf_greedy):
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(5)
    histories = {f"agent/{i}": random_tokens(rng, rng.randint(20, 90)) for i in range(32)}
    engine = make_engine(path, state_dir=tmp_path, num_blocks=DEVICE_BLOCKS, speculation="off")
    for state_id, history in histories.items():
        done = engine.open_state(state_id).generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=history)
        histories[state_id] = history + list(done.token_ids)
    engine.open_state("closed").sync(random_tokens(rng, 40))
    engine.open_state("closed").close()  # a closed state is not persisted
    engine.close()
    assert len(list(tmp_path.glob("*.state"))) == len(histories)

    engine = make_engine(path, state_dir=tmp_path, num_blocks=DEVICE_BLOCKS, speculation="off")
    assert engine.open_state("closed").tokens == []
    for state_id, history in histories.items():
        h = engine.open_state(state_id)
        assert h.tokens == history
        new = random_tokens(rng, 5)
        done = h.generate(SamplingParams(max_tokens=6, ignore_eos=True), prompt=history + new)
        assert done.stats.computed == len(new) + 1  # + the last token generated before the restart
        assert list(done.token_ids) == hf_greedy(str(path), history + new, 6)
    assert engine.stats().prompt_tokens_computed == len(histories) * 6


def test_a_state_shorter_than_a_block_resumes_with_nothing_recomputed(tiny_checkpoints, make_engine, tmp_path):
    """A history shorter than one block (a first user message) comes back from its copy after a
    restart too: the copy is all of it, not a first block the history diverged from."""
    path = tiny_checkpoints["gemma3"]
    history = random_tokens(random.Random(8), 9)
    engine = make_engine(path, state_dir=tmp_path, num_blocks=DEVICE_BLOCKS, speculation="off")
    engine.open_state("short").sync(history)
    engine.close()
    engine = make_engine(path, state_dir=tmp_path, num_blocks=DEVICE_BLOCKS, speculation="off")
    done = engine.open_state("short").generate(SamplingParams(max_tokens=2, ignore_eos=True), prompt=history + [7, 8])
    assert done.stats.computed == 2 and engine.stats().resumes == 1


def test_a_state_emptied_before_a_restart_comes_back_empty(tiny_checkpoints, make_engine, tmp_path):
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path, state_dir=tmp_path)
    for name in ("synced", "truncated", "kept"):
        engine.open_state(name).sync(list(range(5, 45)))
    engine.close()
    engine = make_engine(path, state_dir=tmp_path)
    engine.open_state("synced").sync([])
    engine.open_state("truncated").truncate(0)
    engine.close()
    engine = make_engine(path, state_dir=tmp_path)
    assert [len(engine.open_state(name)) for name in ("synced", "truncated", "kept")] == [0, 0, 40]


def test_a_saved_history_longer_than_the_context_says_how_to_open_it(tiny_checkpoints, make_engine, tmp_path):
    """A state kept (or saved) by an engine of a longer context, opened in one of a shorter
    max_model_len: the advice was "shorten the history (the state is unchanged)", which a
    caller who cannot open the state cannot follow; it names the context the file needs."""
    from hibana_core import ContextLengthError

    path = tiny_checkpoints["llama"]
    engine = make_engine(path, state_dir=tmp_path / "states")
    h = engine.open_state("long")
    h.sync(list(range(5, 205)))
    h.save(tmp_path / "long.state")
    engine.close()
    engine = make_engine(path, state_dir=tmp_path / "states", max_model_len=128)
    with pytest.raises(ContextLengthError, match=r"200 tokens, more than this engine's context of 128; open it "
                                                 r"in an engine with max_model_len >= 200 \(or remove it"):
        engine.open_state("long")
    with pytest.raises(ContextLengthError, match=r"long\.state holds a history of 200 tokens.*max_model_len >= 200"):
        engine.load_state(tmp_path / "long.state", state_id="other")
    assert {info.id for info in engine.states()} == set()
    engine.close()
    engine = make_engine(path, state_dir=tmp_path / "states")
    assert len(engine.open_state("long")) == 200  # the file was left as it was


def test_a_stored_state_is_neither_replaced_by_a_fork_or_load_nor_removed_by_another_engine(
        tiny_checkpoints, make_engine, tmp_path):
    """An outside tester: forking (or loading a file) onto the id of a state kept in state_dir but
    not open replaced its history for good; and an engine sharing the folder that had only
    opened an id (empty) removed, as it closed, the file another engine had written for it."""
    from hibana_core import StateExistsError

    path, history = tiny_checkpoints["qwen2"], list(range(5, 50))
    first = make_engine(path, state_dir=tmp_path)
    first.open_state("x").sync(history)
    first.close()
    engine = make_engine(path, state_dir=tmp_path)
    other = engine.open_state("y")
    other.sync([5, 6, 7])
    with pytest.raises(StateExistsError, match=r"state_dir keeps a state with id 'x' .* fork under another id"):
        other.fork("x")
    with pytest.raises(StateExistsError, match=r"damaged or foreign, a StateFileError, you remove"):
        other.fork("x")  # (the advice where open_state finds the file damaged: an outside audit)
    saved = tmp_path / "y.file"
    other.save(saved)
    with pytest.raises(StateExistsError, match=r"state_dir keeps a state with id 'x'"):
        engine.load_state(saved, state_id="x")
    engine.close()
    assert len(make_engine(path, state_dir=tmp_path).open_state("x")) == len(history)

    shared = tmp_path / "shared"
    a, b = make_engine(path, state_dir=shared), make_engine(path, state_dir=shared)
    b.open_state("z")  # nothing stored yet: B's "z" is new and empty
    a.open_state("z").sync(history)
    a.close()  # writes z
    b.close()  # B never held z's file: it leaves it
    assert len(make_engine(path, state_dir=shared).open_state("z")) == len(history)


def test_an_engine_that_only_resumed_a_state_leaves_a_newer_file_of_it(tiny_checkpoints, make_engine, tmp_path):
    """Two engines share a state_dir and both resume "x": one takes a turn and closes (writing
    it); the other, which changed nothing, wrote its older copy over that turn as it closed."""
    path, history = tiny_checkpoints["qwen2"], list(range(5, 50))
    first = make_engine(path, state_dir=tmp_path)
    first.open_state("x").sync(history)
    first.close()
    a, b = make_engine(path, state_dir=tmp_path), make_engine(path, state_dir=tmp_path)
    b.open_state("x")
    a.open_state("x").append([7, 8, 9])
    a.close()
    b.close()
    assert make_engine(path, state_dir=tmp_path).open_state("x").tokens == history + [7, 8, 9]


def test_a_state_id_no_state_file_can_hold_is_refused_up_front(tiny_checkpoints, make_engine, tmp_path):
    """A lone surrogate (JSON's "\\ud800") has no UTF-8: the state was opened and used, then
    not written when the engine closed (a warning in the log) and gone after the restart."""
    engine = make_engine(tiny_checkpoints["qwen2"], state_dir=tmp_path)
    for bad in ("\ud800", "agent-\udc80"):
        with pytest.raises(ConfigError, match="lone surrogate"):
            engine.open_state(bad)
        with pytest.raises(ConfigError, match="lone surrogate"):
            engine.open_state("fine").fork(bad)
    assert [info.id for info in engine.states()] == ["fine"]


def test_other_agents_run_while_a_persisted_state_is_read(tiny_checkpoints, make_engine, tmp_path, monkeypatch):
    """Reading a large state file takes a while: it is read outside the engine's lock, so a
    request of another agent runs meanwhile instead of waiting for the read."""
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path, state_dir=tmp_path)
    engine.open_state("saved").sync(list(range(5, 45)))
    engine.close()
    engine = make_engine(path, state_dir=tmp_path)
    other, read, ran_meanwhile = engine.open_state("other"), state_file.read, []

    def read_while_another_agent_runs(*args, **kwargs):
        agent = threading.Thread(target=other.generate, args=(SamplingParams(max_tokens=2),), kwargs={"prompt": [5, 6]})
        agent.start()
        agent.join(60)  # a 2-token turn: seconds at most, even on a loaded machine
        ran_meanwhile.append(not agent.is_alive())
        return read(*args, **kwargs)

    monkeypatch.setattr(state_file, "read", read_while_another_agent_runs)
    assert engine.open_state("saved").tokens == list(range(5, 45))
    assert ran_meanwhile == [True]


def test_a_damaged_or_foreign_state_file_fails_its_open_alone(tiny_checkpoints, make_engine, tmp_path):
    engine = make_engine(tiny_checkpoints["llama"], state_dir=tmp_path)
    for name in ("good", "bad"):
        engine.open_state(name).sync(list(range(5, 45)))
    engine.close()
    bad = engine.registry.persisted_path("bad")
    data = bytearray(bad.read_bytes())
    data[-10] ^= 0xFF
    bad.write_bytes(bytes(data))
    engine = make_engine(tiny_checkpoints["llama"], state_dir=tmp_path)
    with pytest.raises(StateFileError, match=r"damaged.*\(or remove it to open 'bad' afresh\)"):
        engine.open_state("bad")
    assert engine.open_state("good").tokens == list(range(5, 45))
    bad.unlink()  # as the error says
    assert engine.open_state("bad").tokens == []
    engine.close()
    other = make_engine(tiny_checkpoints["qwen2"], state_dir=tmp_path)  # another model: foreign files
    with pytest.raises(StateFileError, match="another model"):
        other.open_state("good")
    other.close()
    other = make_engine(tiny_checkpoints["llama"], state_dir=tmp_path, dtype="bfloat16")  # the same, in bf16
    with pytest.raises(StateFileError, match="another dtype"):
        other.open_state("good")
    assert other.open_state("fresh").generate(SamplingParams(max_tokens=2), prompt=[5, 6, 7]).token_ids


def test_a_state_of_other_weights_in_one_architecture_is_foreign(tiny_checkpoints, make_engine, tmp_path):
    """Two checkpoints alike but for their values (one config, another seed: a retrained or
    fine-tuned model saved over the first) are two models: a state saved by one is refused by the
    other, through load_state and through state_dir (where it would otherwise reach new states
    sharing its prefix), and a copy of the same checkpoint is the same model."""
    import shutil

    from tiny_models import make_tiny_checkpoint

    other = make_tiny_checkpoint("llama", tmp_path / "retrained", seed=123)
    copy = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "copy")
    assert (other / "config.json").read_bytes() == (tiny_checkpoints["llama"] / "config.json").read_bytes()
    engine = make_engine(tiny_checkpoints["llama"], state_dir=tmp_path / "states")
    handle = engine.open_state("agent")
    handle.sync(list(range(5, 45)))
    handle.save(tmp_path / "agent.safetensors")
    engine.close()
    retrained = make_engine(other, state_dir=tmp_path / "states")
    assert retrained.fingerprint != engine.fingerprint
    with pytest.raises(StateFileError, match="another model"):
        retrained.load_state(tmp_path / "agent.safetensors")
    with pytest.raises(StateFileError, match="another model"):
        retrained.open_state("agent")
    fresh = retrained.open_state("fresh")
    assert fresh.sync(list(range(5, 45))).reused == 0  # nothing of the foreign state reached the prefix index
    retrained.close()
    same = make_engine(copy)
    assert same.fingerprint == engine.fingerprint
    assert same.load_state(tmp_path / "agent.safetensors").tokens == list(range(5, 45))


def test_writers_of_one_state_file_at_once_each_write_it_whole(tmp_path, monkeypatch):
    """Engines sharing a state_dir may close at once and write the same state: a second writer
    that writes the file whole while the first is between writing and renaming its temporary
    file takes nothing of the first's, and the first then completes (its file is the one left)."""
    import safetensors.torch

    path, save_file = tmp_path / "agent.state", safetensors.torch.save_file
    kv = {value: torch.full((2, 2, 3, 16, 2, 16), value) for value in (1.0, 2.0)}

    def save_then_let_another_write(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        state_file.write(path, "agent", list(range(40)), 40, 16, kv[2.0], "fingerprint")

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_let_another_write)
    state_file.write(path, "agent", list(range(40)), 40, 16, kv[1.0], "fingerprint")
    saved = state_file.read(path, "fingerprint", (2, 2, 0, 16, 2, 16), torch.float32)
    assert saved.kv.unique().tolist() == [1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["agent.state"]


_REWRITER = """
import sys, torch
from pathlib import Path
from hibana_core.kv import state_file
path, stop = Path(sys.argv[1]), Path(sys.argv[2])
kv = [torch.full((2, 2, 3, 16, 2, 16), value) for value in (1.0, 2.0)]
turn = 0
while not stop.exists():
    turn += 1
    state_file.write(path, "agent", list(range(40)), 40, 16, kv[turn % 2], "fingerprint")
"""


def test_a_state_file_another_engine_rewrites_meanwhile_reads_whole(tmp_path):
    """An engine opening a state while an engine of another process writes it reads one file
    whole, the old or the new (a read that took the header of one and the KV of the next failed
    its checksum: a sound state refused as damaged). A race: about 1 read in 300 met it."""
    path, stop = tmp_path / "agent.state", tmp_path / "stop"
    state_file.write(path, "agent", list(range(40)), 40, 16, torch.zeros(2, 2, 3, 16, 2, 16), "fingerprint")
    first = path.stat().st_ino
    writer = subprocess.Popen([sys.executable, "-c", _REWRITER, str(path), str(stop)])
    damaged = []
    try:
        while path.stat().st_ino == first and writer.poll() is None:  # it writes
            time.sleep(0.01)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                state_file.read(path, "fingerprint", (2, 2, 0, 16, 2, 16), torch.float32)
            except StateFileError as exc:
                damaged.append(exc)
    finally:
        stop.touch()
        writer.wait(60)
    assert writer.returncode == 0 and not damaged, damaged[:1]


def test_state_dir_must_be_a_path(tiny_checkpoints, make_engine):
    with pytest.raises(ConfigError, match="state_dir"):
        make_engine(tiny_checkpoints["llama"], state_dir=3)


def test_preemption_parks_instead_of_discarding(tiny_checkpoints, make_engine, hf_greedy):
    """Two agents that cannot both fit: the newest is preempted, its KV parked and copied back,
    so neither computes its prompt twice; outputs equal transformers' greedy. Both are queued
    before a step (from threads, on a loaded machine the first could finish before the second
    arrived: then nothing running is preempted)."""
    path = tiny_checkpoints["llama"]
    rng = random.Random(6)
    prompts = [random_tokens(rng, 80) for _ in range(2)]

    for host, name in ((None, "tier"), (0, "recompute")):
        engine = make_engine(path, num_blocks=12, speculation="off", max_num_batched_tokens=64,
                             **({} if host is None else {"host_kv_bytes": host}))
        with engine.core.lock:
            streams = [engine.open_state(f"p{i}").stream(SamplingParams(max_tokens=60, ignore_eos=True), prompt=p)
                       for i, p in enumerate(prompts)]
        results = {i: list(events)[-1].completion for i, events in enumerate(streams)}
        assert sum(results[i].stats.preemptions for i in range(2)) >= 1, name
        for i, p in enumerate(prompts):
            assert list(results[i].token_ids) == hf_greedy(str(path), p, 60), name
        computed = sum(results[i].stats.computed for i in range(2))
        if name == "tier":
            assert engine.stats().parks >= 1 and computed == sum(len(p) for p in prompts)
        else:
            assert computed > sum(len(p) for p in prompts)  # the preempted one computed again


def test_bench_agents_with_tool_latency_and_a_small_device_pool(tiny_checkpoints, tmp_path):
    """`hibana bench agents --device-kv-agents N --tool-latency LO,HI`: the host tier (hibana)
    against drop-and-recompute (hibana_recompute) on the same script."""
    import json

    from hibana_bench.cli import main

    out = tmp_path / "agents.json"
    assert main(["agents", "--model", str(tiny_checkpoints["llama"]), "--agents", "4", "--turns", "3",
                 "--system", "96", "--tool-result", "16", "--generate", "4", "--device-kv-agents", "1",
                 "--tool-latency", "0,0.02", "--systems", "hibana,hibana_recompute", "--no-cold-start",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["tool_latency"] == [0.0, 0.02] and report["config"]["device_kv_agents"] == 1
    tier, recompute = report["results"]["hibana"], report["results"]["hibana_recompute"]
    assert tier["host_tier"]["parks"] > 0 and recompute["host_tier"] is None
    assert tier["computed_per_turn"] < recompute["computed_per_turn"]


# --- eviction order: tool-call-aware retention ---------------------------------------------------

@pytest.mark.parametrize("policy, parked", [("tool_aware", "b"), ("lru", "a")])
def test_a_state_waiting_on_tools_is_evicted_last(tiny_checkpoints, make_engine, policy, parked, monkeypatch):
    """a's turn ended in tool calls (its agent comes back soon), b's did not and b was used
    later: making room for c parks b under tool_aware, a under plain lru. (a's agent is expected
    back within 600 s: with the default 5 s it is kept ahead of b for 10 s only, which three
    130-token syncs on a loaded machine could use up.)"""
    from hibana_core.kv import policies

    monkeypatch.setattr(policies, "DEFAULT_TOOL_SECONDS", 600.0)
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=DEVICE_BLOCKS, eviction_policy=policy)
    rng = random.Random(7)
    a, b = engine.open_state("a"), engine.open_state("b")
    a.sync(random_tokens(rng, 130))
    engine.registry.note_turn(a, called_tools=True)
    b.sync(random_tokens(rng, 130))
    engine.registry.note_turn(b, called_tools=False)
    engine.open_state("c").sync(random_tokens(rng, 130))
    tiers = {info.id: info.tier for info in engine.states()}
    assert tiers[parked] == "host" and tiers["c"] == "device" and list(tiers.values()).count("device") == 2


def test_tool_wait_is_learned_and_expires():
    from hibana_core.kv.policies import DEFAULT_TOOL_SECONDS, PATIENCE, StateUse, ToolAwareOrder

    use = StateUse(last_use=0.0)
    use.turn_ended(10.0, called_tools=True)
    assert use.expected_back() == 10.0 + DEFAULT_TOOL_SECONDS
    use.request_came(11.0)  # the tool took 1 s
    assert use.tool_seconds == 1.0 and use.tool_since is None
    use.turn_ended(20.0, called_tools=True)
    other = StateUse(last_use=15.0)  # idle, no tool wait, used more recently
    order = ToolAwareOrder().order([("waiting", use), ("other", other)], now=20.5)
    assert order == ["other", "waiting"]
    late = 20.0 + PATIENCE * 1.0 + 0.1  # past its window: an ordinary idle state (older: first)
    assert ToolAwareOrder().order([("waiting", use), ("other", other)], now=late) == ["waiting", "other"]


def test_a_chat_turn_that_calls_tools_marks_its_state(make_engine):
    """Through the chat layer: the demo model calls a tool, and its state waits on it."""
    engine = make_engine("demo")
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    chat = engine.chat("agent")
    result = chat.respond([{"role": "user", "content": "What time is it in Paris?"}], tools=tools,
                          tool_choice="required")
    assert result.tool_calls
    use = engine.registry._entries["agent"].use
    assert use.tool_since is not None
    chat.respond([{"role": "user", "content": "What time is it in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "1", "content": "14:05"}], tools=tools)
    assert use.tool_seconds is not None


def test_a_resume_copies_only_what_other_states_do_not_hold(tiny_checkpoints, make_engine, hf_greedy):
    """A parked state whose system prompt another state still holds gets those blocks back from the
    prefix index: only its own blocks are copied, and output stays exact."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=12, speculation="off")
    rng = random.Random(11)
    system = random_tokens(rng, 48)  # three full blocks, shared
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    a, b = engine.open_state("a"), engine.open_state("b")
    a.generate(greedy, prompt=system + random_tokens(rng, 20))
    b.generate(greedy, prompt=system + random_tokens(rng, 20))
    b.pin()
    for other in ("c", "d"):  # room for these evicts "a" (and "c"), never the pinned "b"
        engine.open_state(other).generate(greedy, prompt=random_tokens(rng, 60))
    assert {info.id: info.tier for info in engine.states()}["a"] == "host"
    moved = engine.stats().host_tier["bytes_moved"]
    prompt = a.tokens + random_tokens(rng, 5)
    done = a.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert list(done.token_ids) == hf_greedy(str(path), prompt, 4)
    assert done.stats.computed == 6  # the 5 new tokens and the last generated one
    copied = engine.stats().host_tier["bytes_moved"] - moved
    assert copied == 2 * engine.kv_cache.bytes_per_block_here  # blocks 4 and 5 of 5; 1-3 came from "b"


def test_a_parked_state_comes_back_before_its_agent_does(tiny_checkpoints, make_engine, hf_greedy, monkeypatch):
    """Prefetch: while the engine is idle, a parked state whose agent is due back from its tools
    is copied into free device blocks before its request comes; that request then computes only
    its new tokens, output exact."""
    import time

    from hibana_core.kv import policies

    # due from 0.1 s after the turn, and kept due for 2 x 60 s (PATIENCE): with 2.0 and 1.9 the
    # prefetch had to happen within 4 s of the turn, three other agents' turns included
    monkeypatch.setattr(policies, "DEFAULT_TOOL_SECONDS", 60.0)
    monkeypatch.setattr("hibana_core.registry.PREFETCH_LEAD", 59.9)
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=10, speculation="off", eviction_policy="lru")
    rng = random.Random(12)
    greedy = SamplingParams(max_tokens=1, ignore_eos=True)
    a = engine.open_state("a")
    a.generate(greedy, prompt=random_tokens(rng, 40))
    engine.registry.note_turn(a, called_tools=True)  # as the chat layer does when a turn calls tools
    for other in ("b", "c", "d"):
        engine.open_state(other).generate(greedy, prompt=random_tokens(rng, 40))
    assert {info.id: info.tier for info in engine.states()}["a"] == "host"
    engine.open_state("b").close()
    engine.open_state("c").close()  # room again; nothing asks for "a"
    deadline = time.monotonic() + 30
    while {info.id: info.tier for info in engine.states()}["a"] != "device" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {info.id: info.tier for info in engine.states()}["a"] == "device"
    prompt = a.tokens + random_tokens(rng, 4)
    done = a.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert done.stats.computed == 5 and list(done.token_ids) == hf_greedy(str(path), prompt, 4)


def test_default_host_budget_is_half_the_available_memory(monkeypatch):
    from hibana_core.kv import tiers

    assert tiers._available_memory() > 0  # this machine's, read for real
    monkeypatch.setattr(tiers, "_available_memory", lambda: 100 << 30)
    assert tiers.default_host_budget() == 50 << 30
    monkeypatch.setattr(tiers, "_available_memory", lambda: None)
    assert tiers.default_host_budget() == 4 << 30


def test_a_parked_state_waits_for_room_rather_than_recompute(tiny_checkpoints, make_engine, hf_greedy):
    """A parked state's turn arrives while another agent's generation holds the pool: it waits
    until that one finishes and then comes back from its copy (its turn computes only its new
    tokens), instead of recomputing its history chunk by chunk in the little room there is (a
    prefill chunk smaller than the state, as on a GPU: 2,048 tokens against 8k-token histories)."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=10, speculation="off", max_prefill_chunk=16)
    rng = random.Random(11)
    history, other = random_tokens(rng, 64), random_tokens(rng, 112)
    parked, busy = engine.open_state("parked"), engine.open_state("busy")
    parked.sync(history)
    busy.sync(other)  # 7 blocks + parked's 4 > 10: "parked" goes to the host tier
    assert {i.id: i.tier for i in engine.states()}["parked"] == "host"
    new = random_tokens(rng, 5)
    with engine.core.lock:  # both queued before a step: "busy" first, then "parked"
        events = busy.stream(SamplingParams(max_tokens=40, ignore_eos=True))
        turn = parked.stream(SamplingParams(max_tokens=GENERATE, ignore_eos=True), prompt=history + new)
    rest = list(events)  # "busy" held 8 blocks from its first step on, 2 free (the parked state needs 5)
    out = list(turn)[-1].completion
    assert rest[-1].finish_reason == "length"
    assert out.stats.computed == len(new) and out.stats.preemptions == 0  # restored, not recomputed
    assert list(out.token_ids) == hf_greedy(str(path), history + new, GENERATE)
    assert engine.stats().host_tier["resumes"] >= 1


def test_a_restore_that_cannot_get_its_room_moves_nobody(tiny_checkpoints, make_engine):
    """Room for a restore is all or nothing: parking every idle state for a restore that still
    does not fit would only send them after it (`make_room(partial=False)`); the scheduler's
    own chunks still take the room there is."""
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=10, speculation="off")
    rng = random.Random(12)
    for name, n in (("a", 64), ("b", 80)):
        engine.open_state(name).sync(random_tokens(rng, n))
    eviction = engine.scheduler.eviction
    with engine.core.lock:
        assert not eviction.make_room(11, partial=False)
        assert {i.id: i.tier for i in engine.states()} == {"a": "device", "b": "device"}
        assert eviction.make_room(5, partial=False)  # b (or a and the free block) leaves: enough
        assert not eviction.make_room(11)  # partial: everything idle leaves, still not enough
        assert {i.tier for i in engine.states()} == {"host"}


def test_a_history_that_outgrows_the_pool_ends_with_length_and_keeps_its_output(tiny_checkpoints, make_engine,
                                                                                hf_greedy, join_all):
    """A state with KV on the device whose generation grows past the whole pool (its prompt fits):
    parking its own KV makes no room for it (its restore brings the same blocks back), so the
    request ends as at a context limit, finish reason "length", with the tokens it generated
    (transformers' greedy ones; the state holds them), instead of parking and restoring itself
    forever or failing and losing them; `pool_limited` counts it; the state serves on."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=4, speculation="off")  # 64 tokens
    rng = random.Random(12)
    state = engine.open_state("a")
    state.generate(SamplingParams(max_tokens=3, ignore_eos=True), prompt=random_tokens(rng, 20))
    history = state.tokens + random_tokens(rng, 40)
    results = []
    call = threading.Thread(target=lambda: results.append(state.generate(
        SamplingParams(max_tokens=20, ignore_eos=True), prompt=history)), daemon=True)
    call.start()
    join_all([call], 30)
    done, = results
    assert done.finish_reason == "length" and 0 < len(done.token_ids) < 20
    assert len(history) + len(done.token_ids) <= 64 + 1  # the last token has no KV yet
    assert list(done.token_ids) == hf_greedy(str(path), history, len(done.token_ids))
    assert state.tokens == history + list(done.token_ids)
    assert engine.stats().pool_limited == 1
    state.truncate(len(history) - 40)
    got = state.generate(SamplingParams(max_tokens=4, ignore_eos=True))
    assert list(got.token_ids) == hf_greedy(str(path), history[:-40], 4)
    assert engine.stats().kv_blocks_used <= engine.stats().kv_blocks_total


def test_a_history_the_pool_cannot_hold_is_refused_with_the_state_unchanged(tiny_checkpoints, make_engine, hf_greedy):
    """generate and sync on a history needing more blocks than the whole device pool: a
    MemoryBudgetError before the state takes it, as a refused call promises (the state unchanged)."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=4, speculation="off")  # 64 tokens
    rng = random.Random(13)
    state = engine.open_state("a")
    state.generate(SamplingParams(max_tokens=3, ignore_eos=True), prompt=random_tokens(rng, 20))
    history = state.tokens
    with pytest.raises(MemoryBudgetError, match="needs 7 KV blocks of 16 tokens.*the state is unchanged"):
        state.generate(SamplingParams(max_tokens=3, ignore_eos=True), prompt=history + random_tokens(rng, 80))
    assert state.tokens == history
    with pytest.raises(MemoryBudgetError, match="kv_device_blocks"):
        state.append(random_tokens(rng, 80))
    with pytest.raises(MemoryBudgetError, match="kv_device_blocks"):
        state.sync(random_tokens(rng, 65))
    assert state.tokens == history
    got = state.generate(SamplingParams(max_tokens=4, ignore_eos=True))
    assert got.stats.computed <= 1  # its KV stayed where it was
    assert list(got.token_ids) == hf_greedy(str(path), history, 4)


def test_a_parked_state_whose_blocks_the_index_holds_keeps_them_while_it_waits(tiny_checkpoints, make_engine,
                                                                               hf_greedy):
    """A parked state whose own freed blocks are all still in the prefix index drops its copy
    and adopts the blocks at admission; when its turn then waits for room, the blocks stay its
    own (parked again if need be). Before, they went back to the pool's free list and the next
    decode of another agent took one: the turn recomputed its history (seen with 40 LangGraph
    agents on a pool for a few: 58 tokens computed of 26 new; here 53 of 5)."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=10, speculation="off", max_prefill_chunk=16)
    rng = random.Random(13)
    history, other = random_tokens(rng, 64), random_tokens(rng, 90)
    parked, busy = engine.open_state("parked"), engine.open_state("busy")
    parked.sync(history)  # 4 full blocks, in the prefix index
    with engine.core.lock:
        engine.scheduler.eviction.make_room(10)  # parked in host memory, its blocks free but indexed
    busy.sync(other)  # 6 blocks (its last one partial: no copy-on-write when it decodes), the
    # never-used ones: the pool's free blocks are parked's 4
    assert {i.id: i.tier for i in engine.states()} == {"parked": "host", "busy": "device"}
    new = random_tokens(rng, 5)
    with engine.core.lock:  # "busy" decodes first; "parked" needs a fifth block, which the pool lacks
        events = busy.stream(SamplingParams(max_tokens=40, ignore_eos=True))
        turn = parked.stream(SamplingParams(max_tokens=GENERATE, ignore_eos=True), prompt=history + new)
    list(events)
    out = list(turn)[-1].completion
    assert out.stats.computed == len(new)  # its history came back, from the index or its copy
    assert list(out.token_ids) == hf_greedy(str(path), history + new, GENERATE)


def test_a_step_does_not_look_at_every_parked_state(tiny_checkpoints, make_engine, monkeypatch):
    """A server keeps thousands of idle conversations parked; a decode step must not scan them all
    (it did, for prefetch candidates: 4,000 parked states made a tiny model's step 2 ms -> 20 ms).
    Only states whose agents wait on tools, within the window they are kept for, are looked at."""
    import time

    from hibana_core.kv import policies
    from hibana_core.kv.sequence import KVSequence

    monkeypatch.setattr(policies, "DEFAULT_TOOL_SECONDS", 0.01)  # tool waits that expire at once
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=24, speculation="off")
    rng = random.Random(13)
    for i in range(60):
        h = engine.open_state(f"idle-{i}")
        h.sync(random_tokens(rng, 40))
        engine.registry.note_turn(h, called_tools=i % 2 == 0)  # half ended in tool calls, long ago
    time.sleep(0.2)  # the tool waits expire: no prefetch brings a state back while they are counted
    for info in engine.states():  # room for the runner: no eviction scan while it decodes
        if info.tier == "device":
            engine.open_state(info.id).close()
    parked = sum(info.tier == "host" for info in engine.states())
    assert parked >= 40  # (the states prefetched while the others were made are closed with the device's)
    runner = engine.open_state("runner")
    runner.sync(random_tokens(rng, 3))
    looked = 0
    num_blocks = KVSequence.num_blocks.fget

    def counted(seq):
        nonlocal looked
        looked += 1
        return num_blocks(seq)

    monkeypatch.setattr(KVSequence, "num_blocks", property(counted))
    steps = engine.stats().steps
    runner.generate(SamplingParams(max_tokens=30, ignore_eos=True))
    steps = engine.stats().steps - steps
    assert steps >= 30 and looked < 5 * steps, f"{looked} looks at states' blocks in {steps} steps, {parked} parked"


def test_listing_the_states_looks_at_the_requests_once(tiny_checkpoints, make_engine, monkeypatch):
    """`states()` and `memory()` (a server's /metrics, GET /v1/hibana/states) run under the
    engine's lock: each state's busy flag must not scan every queued request again (3,000 states
    and 1,000 queued requests held the step loop 150 ms a listing)."""
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=24, speculation="off")
    rng = random.Random(15)
    for i in range(40):
        engine.open_state(f"listed-{i}").sync(random_tokens(rng, 4))
    scheduler, scans = engine.core.scheduler, []
    requests = scheduler.requests

    def counted():
        scans.append(1)
        return requests()

    monkeypatch.setattr(scheduler, "requests", counted)
    with engine.core.lock:  # no step meanwhile
        assert len(engine.states()) == 40 and len(scans) == 1
        assert len(engine.memory()["states"]) == 40 and len(scans) == 2
        engine.registry.idle_sequences()
        assert len(scans) == 3


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_emptied_parked_state_lets_its_copy_go(tiny_checkpoints, make_engine, tmp_path, tier):
    """truncate(0) or sync([]) on a parked state: nothing of its copy can come back, so the host
    memory or spill file goes at once (it stayed, reported as the empty state's tier and bytes,
    until that state's next request)."""
    options = dict(host_kv_bytes=0, state_dir=tmp_path) if tier == "disk" else {}
    engine = make_engine(tiny_checkpoints["llama"], num_blocks=6, speculation="off", **options)
    rng = random.Random(14)
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    for emptied in ("truncate", "sync"):
        a = engine.open_state(f"a-{emptied}")
        a.generate(greedy, prompt=random_tokens(rng, 60))
        b = engine.open_state(f"b-{emptied}")
        b.generate(greedy, prompt=random_tokens(rng, 60))  # parks a
        assert engine.memory()["states"][a.id]["tier"] == tier
        a.truncate(0) if emptied == "truncate" else a.sync([])
        memory = engine.memory()
        assert memory["states"][a.id] == {"tier": "none", "tokens": 0, "bytes": 0, "shared": 0}
        assert memory["host"]["kv_parked"] == memory["disk"]["kv_parked"] == 0
        assert not list(tmp_path.rglob("*.kv"))  # no spill file left
        a.close()
        b.close()


def test_host_bytes_are_kept_as_a_running_total_with_shared_tensors_once():
    """HostTier.bytes_used is asked once a copy moved while making room: a running total, each
    tensor (a fork shares its parent's) counted while any state holds it."""
    from hibana_core.kv.tiers import _SharedBytes

    held = _SharedBytes()
    held.add(1, address=100, nbytes=10)
    held.add(2, address=100, nbytes=10)   # a fork: the parent's tensor
    held.add(3, address=200, nbytes=7)
    assert held.total == 17
    held.pop(1)
    assert held.total == 17               # the fork still holds the tensor
    held.add(3, address=300, nbytes=5)    # a new copy replaces the key's old one
    assert held.total == 15
    held.pop(2), held.pop(2), held.pop(9)
    assert held.total == 5
    held.clear()
    assert held.total == 0
