"""The disk tier (issue 17): with a `state_dir`, parked KV that the host budget cannot hold goes
to disk instead of being dropped, and comes back from there; output stays equal to transformers'
greedy, and every turn still computes only its new tokens."""

from __future__ import annotations

import pytest

from test_host_tier import AGENTS, DEVICE_BLOCKS, GENERATE, TURNS, round_robin


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
    for turn, row in enumerate(computed[1:], 1):
        assert [c for c, _ in row] == [new for _, new in row], f"turn {turn}: (computed, new) {row}"
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


def _greedy():
    from hibana_core import SamplingParams

    return SamplingParams(max_tokens=GENERATE, ignore_eos=True)
