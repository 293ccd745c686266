"""Sliding-window layers keep only their window's KV (issue 18): the layer groups of `KVLayout`,
a state's per-group block tables, blocks outside a window given back to the pool, and every path
that moves KV (prefix hits, parking, state files, edits of the history) exact against
transformers on the tiny gpt_oss (window 20: sliding, full, sliding) and gemma3 checkpoints."""

from __future__ import annotations

import random

import pytest

from hibana_core import SamplingParams
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.layout import NULL_BLOCK, KVGroup, KVLayout
from hibana_core.kv.sequence import KVSequence
from tiny_models import assert_greedy_matches, greedy_turns_at_once, random_tokens

BS = 16
WINDOW = 20  # the tiny gpt_oss and gemma3 checkpoints' window: more than one block, less than two


def test_layouts_group_layers_by_window():
    gpt_oss = KVLayout.for_windows([128 if i % 2 == 0 else None for i in range(24)], 131072)
    assert gpt_oss.page_layers == 12 and [g.window for g in gpt_oss.groups] == [None, 128]
    assert gpt_oss.groups[0].layers == tuple(range(1, 24, 2)) and gpt_oss.place(4) == (1, 2)
    gemma3 = KVLayout.for_windows([None if i % 6 == 5 else 1024 for i in range(48)], 131072)
    assert gemma3.page_layers == 8 and len(gemma3.groups) == 6 and gemma3.groups[0].window is None
    assert sorted(layer for g in gemma3.groups for layer in g.layers) == list(range(48))
    small = KVLayout.for_windows([None if i % 6 == 5 else 512 for i in range(26)], 32768)  # gemma3-1b: 4 full
    assert small.page_layers == 4 and [len(g.layers) for g in small.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert KVLayout.for_windows([None] * 8, 4096) == KVLayout.plain(8) and not KVLayout.plain(8).windowed
    # a window at least as long as the context frees nothing: those layers are full ones
    assert KVLayout.for_windows([4096, None, 4096], 4096) == KVLayout.plain(3)
    mistral = KVLayout.for_windows([4096] * 4, 32768)
    assert mistral.groups == (KVGroup(4096, (0, 1, 2, 3)),) and mistral.windowed


def windowed_sequence(pool: BlockPool) -> KVSequence:
    layout = KVLayout.for_windows([WINDOW, None], 1024)  # group 0 full, group 1 window
    return KVSequence(pool, lambda src, dst: None, layout=layout)


def write(seq: KVSequence, tokens: list[int]) -> None:
    """What a step does to a state's tables: append the tokens and write their KV."""
    seq.append(tokens)
    seq.prepare_write(len(tokens))
    seq.mark_computed(len(tokens))
    seq.commit_full_blocks()


def test_a_window_group_gives_back_the_blocks_no_query_reads():
    pool = BlockPool(64, BS, reserve_null=True)
    seq = windowed_sequence(pool)
    write(seq, list(range(100)))               # a prefill holds every block of the step
    assert [len(t) for t in seq.tables] == [7, 7] and seq.num_blocks == 14 == pool.num_used
    assert seq.blocks_needed(1) == 0 - 5 + 0   # the next write frees blocks 0-4 of the window group
    write(seq, [100])                          # queries from 100 on read keys from 81 on: block 5
    assert seq.tables[1][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in seq.tables[1][5:]
    assert seq.num_blocks == 7 + 2 == pool.num_used
    for token in range(101, 140):
        write(seq, [token])
    assert seq.num_blocks == 9 + 2 and len(seq.tables[0]) == 9  # the window group: blocks 7 and 8
    assert seq.pages(seq.num_computed) == (seq.tables[0] + seq.tables[1][7:], (0, 7))
    twin = seq.fork()
    twin.release()
    seq.release()
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks == 63


def test_a_cut_into_a_freed_window_drops_the_kv_and_the_prefix_index_gives_it_back():
    pool = BlockPool(64, BS, reserve_null=True)
    seq = windowed_sequence(pool)
    write(seq, list(range(100)))
    write(seq, [100])
    seq.trim(90)                   # the window of 90 (from 71, block 4) was freed: nothing is kept
    assert seq.num_computed == 0 and seq.num_blocks == 0
    # the freed blocks stay findable: a new state adopts the 5 full blocks below 90, of the window
    # group only those in the window of position 80 (from 61: blocks 3 and 4)
    other = windowed_sequence(pool)
    other.append(list(range(90)))
    assert other.reuse_cached_blocks(90) == 80
    assert other.tables[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in other.tables[0]
    assert other.num_blocks == 5 + 2


def test_sink_blocks_stay_and_the_middle_goes():
    """A group with 5 sink tokens (1 block) under a window of 20: blocks 1..k leave, block 0
    stays; the pages of a parked copy or a state file come back in place; a cut into the freed
    middle drops the KV; a new state's prefix hit needs the sink block too."""
    pool = BlockPool(64, BS, reserve_null=True)
    layout = KVLayout((KVGroup(None, (0,)), KVGroup(WINDOW, (1,), sink_tokens=5)), 1)
    seq = KVSequence(pool, lambda src, dst: None, layout=layout)
    write(seq, list(range(100)))
    write(seq, [100])
    assert seq.tables[1][0] != NULL_BLOCK and seq.tables[1][1:5] == [NULL_BLOCK] * 4
    assert seq.num_blocks == 7 + 1 + 2 == pool.num_used
    pages, starts = seq.pages(101)
    assert starts == (0, 5) and pages == seq.tables[0] + [seq.tables[1][0]] + seq.tables[1][5:]
    assert seq.pages_fit(starts, 101) and not seq.pages_fit(starts, 60) and seq.pages_fit(starts, 10)
    twin = KVSequence(pool, lambda src, dst: None, layout=layout, share=False)
    twin.tokens = list(seq.tokens)
    twin.place_pages(pool.allocate(len(pages)), starts, 101)
    assert [len(t) for t in twin.tables] == [7, 7] and twin.tables[1][1:5] == [NULL_BLOCK] * 4
    twin.release()
    other = KVSequence(pool, lambda src, dst: None, layout=layout)
    other.append(list(range(90)))
    assert other.reuse_cached_blocks(90) == 80  # window of 80: blocks 3 and 4, and sink block 0
    assert other.tables[1][0] == seq.tables[1][0] and other.tables[1][1:3] == [NULL_BLOCK] * 2
    seq.trim(60)  # the window of 60 (from 41, block 2) was freed
    assert seq.num_computed == 0 and seq.num_blocks == 0


@pytest.fixture(params=["gpt_oss", "gemma3"])
def windowed(request, tiny_checkpoints):
    return request.param, tiny_checkpoints[request.param]


def state_blocks(engine, state_id: str) -> int:
    return next(info.blocks for info in engine.states() if info.id == state_id)


@pytest.mark.parametrize("speculation", ["off", {"method": "ngram", "k": 4}], ids=["plain", "ngram"])
def test_agents_with_long_histories_match_transformers_holding_only_their_windows(windowed, make_engine,
                                                                                  speculation):
    """3 agents at once, 3 turns each, histories past 10 windows: every generation is
    transformers' greedy, and each state holds its full layers' blocks plus a window's worth."""
    arch, path = windowed
    engine = make_engine(path, speculation=speculation, max_num_batched_tokens=64)
    rng = random.Random(11)
    plans = [[(random_tokens(rng, 150 + 10 * agent), 24), (random_tokens(rng, 30), 12), ([7, 8, 9], 12)]
             for agent in range(3)]
    agents = greedy_turns_at_once(engine, "w", plans)
    layout = engine.kv_layout
    full = sum(g.window is None for g in layout.groups)
    for agent, turns in enumerate(agents):
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)
        last_history, last = turns[-1]
        blocks = -(-(len(last_history) + len(last.token_ids)) // BS)
        window_blocks = -(-WINDOW // BS) + 1
        assert state_blocks(engine, f"w-{agent}") <= full * blocks + (len(layout.groups) - full) * window_blocks


def test_a_shared_prompt_is_adopted_across_windows_and_an_edit_recomputes(windowed, make_engine):
    arch, path = windowed
    engine = make_engine(path, speculation="off")
    rng = random.Random(5)
    system = random_tokens(rng, 120)
    handle = engine.open_state("first")
    first = handle.generate(SamplingParams(max_tokens=40, ignore_eos=True), prompt=system + [3, 4, 5])
    second_prompt = system + [6, 7]
    second = engine.open_state("second").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=second_prompt)
    assert second.stats.reused == 112, "the shared prompt's full blocks, the windows' from the index"
    assert_greedy_matches(path, second_prompt, second.token_ids)
    # the first state cut back to 63 tokens: its window there was freed, so its KV goes; the
    # prefix index gives back 3 blocks (the windows' of position 48 included), the rest computes
    cut = system[:60] + [9, 9, 9]
    again = handle.generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=cut)
    assert (again.stats.reused, again.stats.computed) == (48, len(cut) - 48)
    assert_greedy_matches(path, cut, again.token_ids)
    assert list(first.token_ids)  # the first turn ran


def test_windowed_states_park_save_and_load_exactly(windowed, make_engine, tmp_path, hf_greedy):
    """Without prefix caching (nothing to adopt): a pool for about one long state at a time, so
    each agent's pages are parked in host memory and copied back; a saved state holds only its
    windows' pages and continues in another engine."""
    arch, path = windowed
    rng = random.Random(8)
    prompts = [random_tokens(rng, 200) for _ in range(2)]
    engine = make_engine(path, speculation="off", enable_prefix_caching=False, num_blocks=14)
    handles = [engine.open_state(f"p{i}") for i in range(2)]
    outputs = [h.generate(SamplingParams(max_tokens=10, ignore_eos=True), prompt=p) for h, p in zip(handles, prompts)]
    again = handles[0].generate(SamplingParams(max_tokens=10, ignore_eos=True))  # parked by p1: copied back
    stats = engine.stats()
    assert stats.parks >= 1 and stats.resumes >= 1 and again.stats.computed == 1
    history = prompts[0] + list(outputs[0].token_ids)
    assert list(again.token_ids) == hf_greedy(str(path), history, 10)
    handles[1].save(tmp_path / "p1.state")
    other = make_engine(path, speculation="off")
    loaded = other.load_state(tmp_path / "p1.state")
    done = loaded.generate(SamplingParams(max_tokens=10, ignore_eos=True))
    assert done.stats.computed == 1
    history = prompts[1] + list(outputs[1].token_ids)
    assert list(done.token_ids) == hf_greedy(str(path), history, 10)
    layout = other.kv_layout
    blocks = -(-len(history) // BS)
    assert state_blocks(other, loaded.id) < len(layout.groups) * blocks  # not every group's every block


@pytest.mark.parametrize("block_size", [8, 32])
def test_a_windowed_state_saved_in_other_blocks_keeps_its_kv(windowed, block_size, make_engine, tmp_path, hf_greedy):
    """A state past its windows, saved by an engine of 16-token blocks, loads into one of
    `block_size`-token blocks with its KV (each group's live pages re-cut), by load_state and from
    state_dir after a restart: the next turn computes only the last sampled token."""
    arch, path = windowed
    saver = make_engine(path, speculation="off", state_dir=str(tmp_path / "states"))
    h = saver.open_state("agent")
    h.generate(SamplingParams(max_tokens=6, ignore_eos=True), prompt=random_tokens(random.Random(21), 90))
    tokens = h.tokens
    h.save(tmp_path / "agent.state")
    saver.close()  # persists "agent" in state_dir
    other = make_engine(path, speculation="off", block_size=block_size, state_dir=str(tmp_path / "states"))
    for handle in (other.load_state(tmp_path / "agent.state", state_id="loaded"), other.open_state("agent")):
        assert handle.tokens == tokens
        out = handle.generate(SamplingParams(max_tokens=8, ignore_eos=True))
        assert out.stats.computed == 1
        assert list(out.token_ids) == hf_greedy(str(path), tokens, 8)


def test_a_prompt_past_a_small_pool_is_prefilled_in_chunks_that_fit(tmp_path, make_engine, hf_greedy):
    """All layers windowed (window 12) and a pool of 3 blocks: a 199-token prompt never fits in
    one chunk (a MemoryBudgetError once), but its KV need is bounded by the window, so the
    scheduler takes the chunks that fit; the output is transformers'."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint("mistral", tmp_path / "w12", sliding_window=12)
    engine = make_engine(path, speculation="off", num_blocks=3, enable_prefix_caching=False)
    prompt = random_tokens(random.Random(5), 199)
    out = engine.open_state("long").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=prompt)
    assert list(out.token_ids) == hf_greedy(str(path), prompt, 8)


# --- the window surgery pass: sink + window attention on the full layers that matter least ------

SINK_WINDOW = {"name": "window", "window": 24, "sink_tokens": 5, "layers": 0.5}


def test_the_window_pass_switches_the_layers_that_matter_least(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], surgery=[SINK_WINDOW], surgery_guard=False, speculation="off")
    (record,) = engine.surgery
    assert record["full_layers_before"] == 3 and len(record["layers"]) == 2 and record["probe_window"] == 24
    ranking = {int(i): v for i, v in record["nll_increase"].items()}
    assert sorted(ranking) == [0, 1, 2] and sorted(record["layers"]) == sorted(sorted(ranking, key=ranking.get)[:2])
    before, after = record["kv_bytes_per_agent"]["32768"]
    assert after < before / 2
    groups = engine.kv_layout.groups
    assert [(g.window, g.sink_tokens) for g in groups] == [(None, 0), (24, 5), (24, 5)]
    named = make_engine(tiny_checkpoints["llama"], surgery=[{"name": "window", "window": 24, "layers": [1]}],
                        surgery_guard=False, speculation="off")
    assert named.surgery[0]["layers"] == [1] and named.fingerprint != engine.fingerprint
    # after kv8 the KV is a byte an element: the window pass counted float32's four
    fp8 = make_engine(tiny_checkpoints["llama"], surgery=["kv8", {"name": "window", "window": 24, "layers": [1]}],
                      surgery_guard=False, speculation="off")
    assert fp8.surgery[-1]["kv_bytes_per_agent"] == {
        context: [b // 4 for b in pair] for context, pair in named.surgery[0]["kv_bytes_per_agent"].items()}
    # a model with windows of its own: those layers count their own window before and after
    gpt_oss = make_engine(tiny_checkpoints["gpt_oss"], surgery=[{"name": "window", "window": 24, "sink_tokens": 5,
                                                                 "layers": [1]}], surgery_guard=False)
    per_layer = 2 * 2 * 16 * 4  # k and v, 2 KV heads of 16 float32s
    assert gpt_oss.surgery[0]["kv_bytes_per_agent"]["32768"] == [per_layer * (20 + 32768 + 20), per_layer * (20 + 29 + 20)]


@pytest.mark.parametrize("bad, message", [
    ({"window": 0}, "window must be an integer"),
    ({"layers": 1.5}, "layers is a share"),
    ({"layers": []}, "non-empty list of distinct"),
    ({"layers": [0, 0]}, "non-empty list of distinct"),
    ({"layers": [7]}, "not full-attention layers"),
    ({"size": 3}, "takes"),
])
def test_bad_window_pass_options(bad, message, tiny_checkpoints, make_engine):
    from hibana_core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_engine(tiny_checkpoints["llama"], surgery=[{"name": "window", **bad}], surgery_guard=False)


def test_the_window_pass_names_the_model_type_it_finds_no_full_attention_layer_in(tiny_checkpoints, make_engine):
    from hibana_core.errors import ConfigError

    # (it said "this DecoderForCausalLM model", the class every family shares)
    with pytest.raises(ConfigError, match=r"every layer of this mistral model has a sliding window already"):
        make_engine(tiny_checkpoints["mistral"], surgery=["window"], surgery_guard=False)


def test_the_guard_scores_the_window_pass_past_its_window_or_refuses_it(tiny_checkpoints, make_engine):
    """The guard's documents were 1024 tokens at most, so with the default window (1024 + 4 sinks)
    it scored nothing the pass changes and said "ok" (a new user's trial of `hibana surgery`):
    documents are now joined past the window, and a pass the text cannot reach is refused."""
    from hibana_core.errors import ConfigError, SurgeryGuardError
    from hibana_core.surgery.guard import GREEDY_TAIL, MAX_DOCUMENT, heldout_documents

    assert max(map(len, heldout_documents(None, 512, max_positions=1024))) == MAX_DOCUMENT - GREEDY_TAIL
    joined = heldout_documents(None, 512, max_positions=4096, reach=1500)
    assert min(map(len, joined)) > 1500 and max(map(len, joined)) == 1500 + 750  # up to 750 tokens past it
    assert sum(map(len, joined)) <= 3 * 2250
    path = tiny_checkpoints["llama"]  # 1024 positions: documents of 960 tokens
    engine = make_engine(path, surgery=[{"name": "window", "window": 800, "layers": [1]}], speculation="off")
    guard = engine.surgery[0]["guard"]
    assert guard["decision"] == "ok" and guard["mean_kl"] > 0, guard  # 156 positions a document see fewer keys
    # greedy continuations start past the window (from each document's first 128 tokens, they never diverged)
    assert guard["first_divergence"] < 48, guard
    with pytest.raises(SurgeryGuardError, match=r"cannot be measured .* documents reach 960 tokens .* within 1004: "
                                                r"0 scored positions lie past it, 256 are asked; give a longer guard text"):
        make_engine(path, surgery=[{"name": "window", "window": 1000, "layers": [1]}], speculation="off")
    forced = make_engine(path, surgery=[{"name": "window", "window": 1000, "layers": [1], "force": True}],
                         speculation="off")
    assert forced.surgery[0]["guard"]["decision"].startswith("forced: not measured: the guard's documents reach 960")
    with pytest.raises(ConfigError, match=r"covers all 1024 positions of this model, so the pass would change nothing"):
        make_engine(path, surgery=[{"name": "window", "window": 1020}], surgery_guard=False)


def test_sink_window_layers_free_their_middle_and_turns_match_one_shot_prefills(tiny_checkpoints, make_engine,
                                                                              tmp_path):
    """The switched model is its own reference (transformers has no sink + window attention):
    3 turns with retention, small prefill chunks and speculation give each turn
    the tokens a fresh state gets by prefilling the whole history in one step (every key in the
    cache during that step), and the retained state holds its sink blocks and its window only.
    Written by `hibana surgery` and loaded again, the model keeps its windows."""
    from hibana_core.surgery import checkpoint

    path = tiny_checkpoints["llama"]
    options = dict(surgery=[SINK_WINDOW], surgery_guard=False)
    engine = make_engine(path, speculation={"method": "ngram", "k": 4}, max_num_batched_tokens=40, **options)
    oneshot = make_engine(path, speculation="off", **options)
    rng = random.Random(2)
    h, history = engine.open_state("agent"), []
    for turn, (new, n) in enumerate(((random_tokens(rng, 130), 20), (random_tokens(rng, 40), 10), ([4, 5] * 8, 10))):
        history = history + new
        got = h.generate(SamplingParams(max_tokens=n, ignore_eos=True), prompt=history)
        want = oneshot.open_state(f"fresh{turn}").generate(SamplingParams(max_tokens=n, ignore_eos=True),
                                                           prompt=history)
        assert list(got.token_ids) == list(want.token_ids), f"turn {turn}"
        history = history + list(got.token_ids)
    blocks = -(-len(history) // BS)
    sink_blocks, window_blocks = 1, -(-24 // BS) + 1
    assert state_blocks(engine, "agent") <= blocks + 2 * (sink_blocks + window_blocks)
    out = tmp_path / "windowed"
    checkpoint.save(engine, path, out)
    again = make_engine(out, speculation="off")
    assert again.kv_layout == engine.kv_layout and again.surgery == engine.surgery
    prompt = history[:150]
    assert list(again.open_state("a").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=prompt).token_ids) \
        == list(oneshot.open_state("b").generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=prompt).token_ids)


def test_a_state_file_names_its_layout(tiny_checkpoints, make_engine, tmp_path):
    """gpt_oss's window of 20 is full attention under a context of 20 tokens: the same checkpoint
    then shares its pages otherwise, and a state file of the other layout is refused, by name."""
    from hibana_core.errors import StateFileError

    path = tiny_checkpoints["gpt_oss"]
    engine = make_engine(path, speculation="off")
    h = engine.open_state("s")
    h.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=random_tokens(random.Random(1), 12))
    h.save(tmp_path / "s.state")
    short = make_engine(path, speculation="off", max_model_len=20)
    assert not short.kv_layout.windowed and engine.kv_layout.windowed
    with pytest.raises(StateFileError, match="max_model_len"):
        short.load_state(tmp_path / "s.state")
    assert make_engine(path, speculation="off").load_state(tmp_path / "s.state").tokens == h.tokens


def test_a_window_checkpoint_refuses_the_window_pass_again(tiny_checkpoints, make_engine, tmp_path):
    """In-process a pass applies once; so it does on a checkpoint written with it (where the window
    pass alone would still find a full-attention layer to switch)."""
    from hibana_core.errors import ConfigError
    from hibana_core.surgery import checkpoint

    engine = make_engine(tiny_checkpoints["llama"], surgery=[{"name": "window", "window": 24, "layers": [1]}],
                         surgery_guard=False, speculation="off")
    out = checkpoint.save(engine, tiny_checkpoints["llama"], tmp_path / "windowed")
    with pytest.raises(ConfigError, match=r"written with 'window' applied already .*leave it out of surgery"):
        make_engine(out, surgery=[{"name": "window", "window": 24, "layers": [0]}], surgery_guard=False)
    assert [r["name"] for r in make_engine(out, speculation="off").surgery] == ["window"]
    # a hand-damaged manifest is a CheckpointError, never Python's own errors or another window
    import json

    from hibana_core.errors import CheckpointError

    manifest = json.loads((out / "hibana_surgery.json").read_text())
    for damaged in ({"model.layers.1.self_attn": [24]}, {"model.layers.1.self_attn": ["24", 4]}, [[24, 4]],
                    {"model.layers.1.self_attn": [-3, 4]}):
        (out / "hibana_surgery.json").write_text(json.dumps({**manifest, "windowed_layers": damaged}))
        with pytest.raises(CheckpointError, match=r"windowed_layers in hibana_surgery.json is not a mapping"):
            make_engine(out, speculation="off")
