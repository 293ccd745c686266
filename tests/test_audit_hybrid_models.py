"""Audit of the hybrid families (qwen3_5, qwen3_5_moe, qwen3_next) on configs unlike those of
test_family_qwen3_5.py: each tiny seeded checkpoint changes what that file keeps fixed, and the
engine must still give transformers' greedy tokens through batching, chunked prefill, retention,
truncation and state files.

    first_full   qwen3_5: full attention at layers 0 and 3, one key head serving 4 value heads,
                 key heads of 32 dims and value heads of 64, a convolution of width 2, one KV
                 head of 64 dims, half of each head rotated, tied embeddings, vocab 517
    one_linear   qwen3_5: 3 layers, linear attention at 1 only, as many key as value heads, key
                 heads of 64 dims and value heads of 32, width 3, heads of 256 dims, YaRN
    next_step2   qwen3_next: layer_types from full_attention_interval 3, one key head serving 4
                 value heads, sparse layers by decoder_sparse_step 2, norm_topk_prob off, tied,
                 vocab 515
    moe_mm       qwen3_5_moe as its multimodal checkpoint (text_config nested), top-3 experts,
                 width 2, tied
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hibana_core import SamplingParams
from hibana_core.errors import StateFileError, UnsupportedModelError
from tiny_models import (EVERY_TENSOR_USED, VOCAB_SIZE, _save_seeded, assert_greedy_matches, greedy_turns_at_once,
                         make_config, make_tiny_checkpoint, random_tokens)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]

L, F = "linear_attention", "full_attention"
VARIANTS = {
    "first_full": ("qwen3_5", dict(
        layer_types=[F, L, L, F], linear_num_key_heads=1, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=64, linear_conv_kernel_dim=2, num_key_value_heads=1, head_dim=64,
        tie_word_embeddings=True, vocab_size=517,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "one_linear": ("qwen3_5", dict(
        num_hidden_layers=3, layer_types=[F, L, F], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=32, linear_conv_kernel_dim=3, head_dim=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, partial_rotary_factor=0.25, factor=4.0,
                             original_max_position_embeddings=256))),
    "next_step2": ("qwen3_next", dict(
        num_hidden_layers=3, layer_types=None, full_attention_interval=3, linear_num_key_heads=1,
        linear_num_value_heads=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
        tie_word_embeddings=True, vocab_size=515)),
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def make_moe_multimodal(path: Path) -> Path:
    """A Qwen3_5MoeForConditionalGeneration checkpoint (every Qwen3.5 MoE release): the tiny
    qwen3_5_moe language model as text_config, beside a one-layer vision tower."""
    from transformers import Qwen3_5MoeConfig

    text = make_config("qwen3_5_moe", tie_word_embeddings=True, linear_conv_kernel_dim=2,
                       num_experts_per_tok=3).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
                  num_position_embeddings=16)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=VOCAB_SIZE - 1,
                              video_token_id=VOCAB_SIZE - 2, vision_start_token_id=VOCAB_SIZE - 3,
                              vision_end_token_id=VOCAB_SIZE - 4, tie_word_embeddings=True)
    return _save_seeded(config, path, 1234)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> its checkpoint, made on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            if name == "moe_mm":
                made[name] = make_moe_multimodal(root / name)
            else:
                arch, overrides = VARIANTS[name]
                made[name] = make_tiny_checkpoint(arch, root / name, **overrides)
        return made[name]

    return get


@pytest.mark.parametrize("name", [*VARIANTS, "moe_mm"])
def test_hybrid_variants_batched_chunked_truncated_and_saved_match_transformers(name, checkpoints, make_engine,
                                                                                 tmp_path):
    """Three agents at once, two turns each, prefill chunks of 24 tokens under a step budget of
    40 (chunk ends inside and across 16-token blocks); then a cut inside the last reply, and the
    state saved and loaded into another engine, each continuing as transformers does."""
    path = checkpoints(name)
    options = dict(max_prefill_chunk=24, max_num_batched_tokens=40)
    engine = make_engine(path, **options)
    rng = random.Random(name)
    plans = [[(random_tokens(rng, rng.randint(20, 60)), 6), (random_tokens(rng, rng.randint(1, 25)), 6)]
             for _ in range(3)]
    for turns in greedy_turns_at_once(engine, name, plans):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
    assert engine.stats().prompt_tokens_reused > 0

    h = engine.open_state(f"{name}-0")
    history = h.tokens
    h.truncate(len(history) - 3)  # inside the last reply: back to a snapshot, or the start
    out = list(h.generate(greedy(5)).token_ids)
    assert_greedy_matches(path, history[:-3], out)
    history = history[:-3] + out
    h.save(tmp_path / "s.hibana")
    loaded = make_engine(path, **options).load_state(tmp_path / "s.hibana")
    assert loaded.tokens == history
    more = history + random_tokens(rng, 4)
    done = loaded.generate(greedy(5), prompt=more)
    assert_greedy_matches(path, more, done.token_ids)
    assert done.stats.computed == 5  # the new tokens and the last one generated: the state came back whole


def test_a_hybrid_state_file_is_refused_by_another_hybrid_model(checkpoints, make_engine, tmp_path):
    engine = make_engine(checkpoints("first_full"))
    h = engine.open_state("s")
    h.generate(greedy(3), prompt=list(range(5, 40)))
    h.save(tmp_path / "s.hibana")
    other = make_engine(checkpoints("one_linear"))
    with pytest.raises(StateFileError):
        other.load_state(tmp_path / "s.hibana")
    history = list(range(7, 30))  # the engine that refused it serves on
    assert_greedy_matches(checkpoints("one_linear"), history,
                          other.open_state("t").generate(greedy(4), prompt=history).token_ids)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_attention_biases_of_a_hybrid_config_are_read(arch, tmp_path, make_engine):
    """attention_bias true: transformers' q/k/v/o projections of the full-attention layers carry
    biases (q_proj's with its gate rows); the engine left them out (a warning that tensors went
    unused, then other tokens)."""
    path = make_tiny_checkpoint(arch, tmp_path / arch, attention_bias=True)
    engine = make_engine(path, speculation="off")
    assert engine.model.args.qkv_bias and engine.model.args.o_bias
    history = random_tokens(random.Random(7), 30)
    assert_greedy_matches(path, history, engine.open_state("b").generate(greedy(8), prompt=history).token_ids)


def test_a_hybrid_config_without_full_attention_layers_is_refused_clearly(tmp_path):
    """layer_types all linear_attention (transformers runs it): an UnsupportedModelError at load,
    not a bare ValueError from deep in the KV layout."""
    from tiny_models import open_engine

    path = make_tiny_checkpoint("qwen3_5", tmp_path / "linear", num_hidden_layers=2, layer_types=[L, L])
    with pytest.raises(UnsupportedModelError, match="full_attention"):
        open_engine(path)


def test_a_sync_then_a_generation_computes_the_last_token_only(checkpoints, make_engine, tmp_path):
    """DESIGN's `h.sync(history); h.generate(...)` and `h.append(tool_result); h.generate(...)` on a
    hybrid: a sync holds the last token back (the linear layers' state cannot step back a token),
    so the generation computes that one token. It recomputed the whole history after a sync (from
    the start: no snapshot before its end), and the last reply and the appended tokens after an
    append (from the last prompt's snapshot)."""
    path = checkpoints("next_step2")
    engine = make_engine(path, speculation="off")
    rng = random.Random(11)
    h, history = engine.open_state("s"), random_tokens(rng, 70)
    synced = h.sync(history)
    done = h.generate(greedy(5))
    assert done.stats.computed == 1
    assert (synced.reused, synced.computed) == (0, len(history) - 1)
    assert_greedy_matches(path, history, done.token_ids)

    history = h.tokens + random_tokens(rng, 12)
    assert h.append(history[len(h.tokens):]).computed == 12  # the last reply token and 11 of the 12
    assert h.sync(history).computed == 0  # (held already)
    before = engine.stats().prompt_tokens_computed
    done = h.generate(greedy(5))
    assert done.stats.computed == 1 and engine.stats().prompt_tokens_computed - before == 1
    assert_greedy_matches(path, history, done.token_ids)

    history = h.tokens + random_tokens(rng, 6)  # a synced state saved and loaded: the same
    h.sync(history)
    h.save(tmp_path / "synced.hibana")
    loaded = make_engine(path, speculation="off").load_state(tmp_path / "synced.hibana")
    done = loaded.generate(greedy(5))
    assert done.stats.computed == 1
    assert_greedy_matches(path, history, done.token_ids)


def test_mixed_speculation_on_a_one_linear_layer_model_matches_transformers(checkpoints, make_engine):
    """Suffix, n-gram and an oracle's drafts (every fifth wrong), fixed and adaptive k, batched with
    async scheduling, each agent truncated back and answering again (test_speculation's
    mixed_batch) on the model with a single linear layer between full ones: as without drafts,
    and as transformers."""
    from test_speculation import mixed_batch

    path = checkpoints("one_linear")
    histories, want = mixed_batch(make_engine, path, VOCAB_SIZE, seed=51)
    for history, out in zip(histories, want):
        assert_greedy_matches(path, history, out)


def test_bfloat16_hybrid_states_come_back_from_a_file_and_the_disk_tier_exactly(checkpoints, make_engine, tmp_path):
    """In bfloat16 (the convolution's state in bfloat16, the delta rule's in float32): a state
    saved after its first turn, loaded into an engine whose small pool spills it to disk, answers
    its second turn with the tokens of an engine that kept it all along, computing the new tokens
    only."""
    path = checkpoints("first_full")
    rng = random.Random(53)
    first = random_tokens(rng, 45)
    kept = make_engine(path, dtype="bfloat16", speculation="off").open_state("k")
    reply = list(kept.generate(greedy(8), prompt=first).token_ids)
    second = first + reply + random_tokens(rng, 7)
    want = list(kept.generate(greedy(8), prompt=second).token_ids)

    h = make_engine(path, dtype="bfloat16", speculation="off").open_state("h")
    assert list(h.generate(greedy(8), prompt=first).token_ids) == reply
    h.save(tmp_path / "h.hibana")
    engine = make_engine(path, dtype="bfloat16", speculation="off", num_blocks=10, state_dir=tmp_path,
                         host_kv_bytes=0)  # (in bfloat16 other chunks or verify rows may round to other tokens)
    loaded = engine.load_state(tmp_path / "h.hibana")
    for i in range(4):  # other agents push it out of the pool, onto disk
        engine.open_state(f"x{i}").generate(greedy(3), prompt=random_tokens(rng, 50))
    assert {s.id: s.tier for s in engine.states()}["h"] == "disk"
    done = loaded.generate(greedy(8), prompt=second)
    assert list(done.token_ids) == want and done.stats.computed == 8


def test_a_hybrid_state_kept_in_state_dir_resumes_after_a_restart(checkpoints, make_engine, tmp_path):
    """With a state_dir and the default host tier, a hybrid state written as its engine closes comes
    back into the next engine's host tier with its linear layers' state: the next turn computes its
    new tokens only, as transformers. Its KV came back without that state, and the state's first
    request failed ("engine step failed: TypeError")."""
    path = checkpoints("one_linear")
    rng = random.Random(57)
    engine = make_engine(path, speculation="off", state_dir=tmp_path)
    h, history = engine.open_state("kept"), random_tokens(rng, 40)
    history += list(h.generate(greedy(5), prompt=history).token_ids)
    engine.close()
    h = make_engine(path, speculation="off", state_dir=tmp_path).open_state("kept")
    assert h.tokens == history
    more = history + random_tokens(rng, 6)
    done = h.generate(greedy(5), prompt=more)
    assert done.stats.computed == 7  # the last reply token and the 6 new ones
    assert_greedy_matches(path, more, done.token_ids)
