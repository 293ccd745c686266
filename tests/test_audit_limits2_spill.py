"""The disk tier's spill folder removed while the engine runs (an outside tester of limits, second pass)."""

from __future__ import annotations

import random
import shutil

from hibana_core import SamplingParams
from tiny_models import random_tokens


def test_a_spill_folder_removed_while_the_engine_runs_is_made_again(tiny_checkpoints, make_engine, hf_greedy,
                                                                     tmp_path):
    """rm -rf of the spill folder (a cleanup job on state_dir): every later spill failed ('cannot
    write a spill file'), so each parked state lost its KV and recomputed. The folder is made
    again at the next spill; the states whose files went recompute, output unchanged."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, num_blocks=10, speculation="off", state_dir=tmp_path, host_kv_bytes=0)
    rng = random.Random(3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = {f"a{i}": random_tokens(rng, 60) for i in range(3)}
    for state_id, prompt in prompts.items():  # 5 blocks each in a pool of 10: each parks the one before last
        engine.open_state(state_id).generate(params, prompt=prompt)
    tier = engine.stats().host_tier
    spill = engine.memory()["disk"]["folder"]
    assert tier["spills"] >= 1 and (tmp_path / spill).is_dir()
    shutil.rmtree(tmp_path / spill)
    for state_id, prompt in prompts.items():  # each turn parks another state: to the folder made again
        h = engine.open_state(state_id)
        history = h.tokens + [7, 8]
        assert list(h.generate(params, prompt=history).token_ids) == hf_greedy(str(path), history, 4)
    after = engine.stats().host_tier
    assert after["spills"] >= tier["spills"] + 2 and after["dropped"] == tier["dropped"]
    assert "disk" in {info.tier for info in engine.states()} and (tmp_path / spill).is_dir()
    last = engine.open_state("a0")  # parked to the new folder: resumes from it, computing only its new tokens
    history = last.tokens + [9]
    done = last.generate(params, prompt=history)
    assert done.stats.computed <= 2 and list(done.token_ids) == hf_greedy(str(path), history, 4)
    engine.close()
    assert not (tmp_path / spill).exists()
