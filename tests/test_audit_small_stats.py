"""Small defects audited: what EngineStats and StateInfo count on models with sliding-window layers."""

from __future__ import annotations

import random

import pytest
from tiny_models import random_tokens

from hibana_core import SamplingParams


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_kv_blocks_are_counted_as_kv_device_blocks_counts_them(arch, tiny_checkpoints, make_engine):
    """A windowed model keeps its layers' KV in pages of fewer layers (gemma3's 3 layers: pages of
    one); stats reported the pool's pages, so kv_device_blocks=40 read back as 120 blocks. They are
    counted in the blocks kv_device_blocks sets, each of every layer, as the pool's errors say them."""
    engine = make_engine(tiny_checkpoints[arch], num_blocks=40, speculation="off")
    layout, pool = engine.kv_layout, engine.pool
    assert engine.stats().kv_blocks_total == 40
    h = engine.open_state("a")
    h.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=random_tokens(random.Random(3), 90))
    stats, (info,) = engine.stats(), engine.states()
    pages = pool.num_used
    assert stats.kv_blocks_used == -(-pages * layout.page_layers // layout.num_layers) > 0
    assert info.blocks == stats.kv_blocks_used <= stats.kv_blocks_total
    h.close()
    assert engine.stats().kv_blocks_used == 0
    assert engine.stats().kv_blocks_cached == -(-pool.num_cached * layout.page_layers // layout.num_layers)
