"""Outside audit of speculation (issue 13) on a model whose KV is split in layer groups: Gemma 3
with odd shapes (head_dim 24, one KV head, sliding window 10, shorter than a 16-token block), so
that 16-token drafts cross blocks and move the window past whole blocks.

Drafts come from an oracle that knows the continuation a run without speculation produced and
errs at every seventh position; requests end on a stop string, a stop token, max_tokens or the
context inside a draft. Output, text and finish reason equal the run without speculation, and so do
the blocks a state holds and the KV of every position its windows still hold.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from hibana_core import SamplingParams
from spec_drafters import OracleDrafter, registered
from tiny_models import ODD_SHAPES, VOCAB_SIZE, make_tiny_checkpoint, make_tokenizer, open_engine, random_tokens

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gemma_odd(tmp_path_factory):
    return make_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma_odd"), seed=41, **ODD_SHAPES["gemma3"])


def window_kv(engine, name: str) -> tuple[list[int], int, dict]:
    """A state's tokens, computed count and, per (group, position) its windows still hold, the KV."""
    seq = engine.registry._entry(engine.open_state(name)).seq
    bs, data, layout = engine.kv_cache.block_size, engine.kv_cache.data, engine.kv_cache.layout
    rows = {}
    for g, table in enumerate(seq.tables):
        for p in range(seq.num_computed):
            block = table[p // bs]
            if block:  # NULL_BLOCK (0): outside the window
                rows[g, p] = data[:len(layout.groups[g].layers), :, block, p % bs]
    return list(seq.tokens), seq.num_computed, rows


def held_blocks(engine, name: str) -> list[int]:
    """Per layer group, the blocks a state holds (those its windows left are NULL_BLOCK)."""
    return [sum(1 for block in table if block) for table in engine.registry._entry(engine.open_state(name)).seq.tables]


def test_drafts_across_windows_and_blocks_change_nothing(gemma_odd):
    rng = random.Random(12)
    tokenizer = make_tokenizer()
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 7 == 5)
    with registered(oracle=oracle):
        engine = open_engine(gemma_odd, max_model_len=80)
    try:
        prompts = [random_tokens(rng, n) for n in (23, 62)]
        plain = SamplingParams(max_tokens=40, ignore_eos=True, speculation="off")
        refs = [list(engine.open_state(f"ref{i}").generate(plain, prompt=p).token_ids) for i, p in enumerate(prompts)]
        for p, ref in zip(prompts, refs):
            oracle.add(p, ref)
        checked = 0
        for i, (prompt, ref) in enumerate(zip(prompts, refs)):
            text = tokenizer.decode(ref)
            ends = [SamplingParams(max_tokens=40, ignore_eos=True),  # the context (80) ends the second
                    SamplingParams(max_tokens=13, ignore_eos=True),
                    SamplingParams(max_tokens=40, stop_token_ids=[ref[11]]),
                    SamplingParams(max_tokens=40, ignore_eos=True, stop=[text[len(tokenizer.decode(ref[:8])) - 1:][:3]])]
            for j, params in enumerate(ends):
                want = engine.open_state(f"off{i}-{j}").generate(dataclasses.replace(params, speculation="off"),
                                                                  prompt=prompt)
                got = engine.open_state(f"on{i}-{j}").generate(
                    dataclasses.replace(params, speculation={"method": "oracle", "k": 16}), prompt=prompt)
                assert (list(got.token_ids), got.finish_reason, got.text) == \
                       (list(want.token_ids), want.finish_reason, want.text), (i, j, params)
                tokens, computed, kv = window_kv(engine, f"on{i}-{j}")
                want_tokens, want_computed, want_kv = window_kv(engine, f"off{i}-{j}")
                assert (tokens, computed) == (want_tokens, want_computed), (i, j)
                assert held_blocks(engine, f"on{i}-{j}") == held_blocks(engine, f"off{i}-{j}"), (i, j)
                for key, row in want_kv.items():  # what the plain run holds, the speculating one holds
                    assert key in kv and (kv[key] - row).abs().max() <= 1e-4, (i, j, key)
                    checked += 1
        stats = engine.stats()
        assert stats.draft_tokens_accepted > 50 and stats.draft_tokens_proposed > stats.draft_tokens_accepted
        assert checked > 300
    finally:
        engine.close()
