"""Rotary tables sized to what the engine addresses, not to max_position_embeddings.

A 1M-context config (max_position_embeddings 1_048_576) built cos/sin tables of 1M rows per rope
(~1 GB at head_dim 128) even when the engine served max_model_len=4096. They now hold max_model_len
rows, at least MIN_ROTARY_POSITIONS (4096: what layer_skip scores on), and a LongRoPE model's
long rows of the positions below its switch after them; greedy output stays transformers'."""

from __future__ import annotations

import random

import pytest

from hibana_core import SamplingParams
from hibana_core.models.decoder import MIN_ROTARY_POSITIONS, RotaryTables, rotary_bytes
from tiny_models import assert_greedy_matches, greedy_turns_at_once, make_tiny_checkpoint, random_tokens

pytestmark = pytest.mark.timeout(300)

MILLION = 1_048_576


def tables(model) -> list[RotaryTables]:
    found = {id(m.rotary): m.rotary for m in model.modules() if isinstance(getattr(m, "rotary", None), RotaryTables)}
    return list(found.values())


def test_a_million_position_config_builds_tables_of_max_model_len(tmp_path, make_engine):
    """llama3-scaled rope, max_position_embeddings 1M, max_model_len 256: each table 4096 rows
    of head_dim 16 (was 1M rows: 128 MiB here), and 3 agents of different lengths batched give
    transformers' greedy tokens."""
    path = make_tiny_checkpoint("llama", tmp_path / "m", max_position_embeddings=MILLION)
    engine = make_engine(path, max_model_len=256, speculation="off")
    plans = [[(random_tokens(random.Random(40 + a), n), 40)] for a, n in enumerate((9, 70, 150))]
    for turns in greedy_turns_at_once(engine, "m", plans):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    (rotary,) = tables(engine.model)
    assert MIN_ROTARY_POSITIONS == 4096 and rotary.cos.shape == rotary.sin.shape == (4096, 16)
    assert rotary_bytes(engine.model) == 2 * 4096 * 16 * 4 <= engine.workspace_bytes
    # and where max_model_len is more than the floor, the tables follow it
    assert tables(make_engine(path, max_model_len=5000, speculation="off").model)[0].max_positions == 5000


def test_a_draft_model_sizes_its_own_tables_to_what_it_drafts(tmp_path, make_engine):
    path = make_tiny_checkpoint("llama", tmp_path / "m", max_position_embeddings=MILLION)
    engine = make_engine(path, max_model_len=128, speculation={"method": "draft_model", "draft_model": str(path),
                                                               "k": 4})
    history = random_tokens(random.Random(5), 60)
    c = engine.open_state("a").generate(SamplingParams(max_tokens=30, ignore_eos=True), prompt=history)
    assert_greedy_matches(path, history, c.token_ids)
    drafter = engine.scheduler.speculation.drafter("draft_model")
    assert engine.stats().draft_tokens_proposed > 0
    assert [t.cos.shape[0] for t in tables(drafter.runner.model)] == [4096]
    assert drafter.weight_bytes < 10 * 2 ** 20  # (its 1M-row tables alone were 128 MiB)


SWITCH = 64


def test_longrope_long_rows_follow_tables_of_max_model_len(tmp_path, make_engine):
    """Phi-3's LongRoPE (switch 64, max_position_embeddings 8192) at max_model_len 160: tables of
    4096 per-position rows then the 64 long rows of the positions below the switch (they began at
    row 8192); generations that cross the switch, and a later turn that reads the long rows of
    a long-rotated state, stay transformers' greedy."""
    path = make_tiny_checkpoint("phi3", tmp_path / "p", original_max_position_embeddings=SWITCH,
                                max_position_embeddings=8192)
    engine = make_engine(path, max_model_len=160, speculation="off")
    rng = random.Random(8)
    plans = [[([rng.randrange(2, 512) for _ in range(40 + 5 * a)], 40), ([7, 8, 9], 10)] for a in range(2)]
    for turns in greedy_turns_at_once(engine, "p", plans):
        (first, out), _ = turns
        assert len(first) < SWITCH < len(first) + len(out.token_ids)
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    (rotary,) = tables(engine.model)
    assert rotary.cos.shape == (4096 + SWITCH, 12)
