"""Qwen3.5 (model_type qwen3_5 / qwen3_5_text), a hybrid of Gated DeltaNet linear-attention layers
and gated full attention, against transformers on tiny seeded checkpoints:

    qwen3_5      4 layers: linear attention at 0, 1 and 3 (2 key heads serving 4 value heads, a
                 convolution of width 4), gated full attention at 2 (q/k norms, a quarter of each
                 head rotated); every norm by 1 + weight
    qwen3_5_moe  4 layers: full attention at 1, one key head serving 2 value heads of 32 dims, a
                 convolution of width 3; every MLP top-2 of 8 experts (router rows tied in pairs)
                 beside a shared expert gated by sigmoid(shared_expert_gate(h))
    qwen3_next   Qwen3-Next: its checkpoint's interleaved in_proj_qkvz / in_proj_ba (2 key heads, 2
                 value heads each), full attention at 1 and 3, layer 1's MLP dense (mlp_only_layers)

A linear layer's state is valid at one position: retention continues from it, a history cut back
continues from a snapshot (a recent prompt's end) or from the start, a verify step folds in the
drafts kept and no others. Each is checked token for token against `generate` on the full history.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.errors import MemoryBudgetError
from hibana_core.kv.recurrent import SNAPSHOTS
from test_speculation import mixed_batch
from tiny_models import (EVERY_TENSOR_USED, VOCAB_SIZE, assert_greedy_matches, greedy_turns_at_once, hf_greedy,
                         make_tiny_checkpoint, make_tiny_qwen3_5_multimodal, random_tokens, three_agents_three_turns)

pytestmark = [pytest.mark.timeout(300), EVERY_TENSOR_USED]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "q")


def greedy(n: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **options)


def recurrent_of(engine, handle):
    return engine.registry._entry(handle).seq.recurrent


def test_qwen3_5_reads_its_hybrid_layers(qwen35, make_engine):
    engine = make_engine(qwen35)
    args = engine.model.args
    assert args.linear_attention.layers == (True, True, False, True) and args.num_kv_layers == 1
    assert args.attention_output_gate and args.qk_norm and args.unit_offset_norms
    assert {rope.dim for rope in args.ropes} == {8}  # a quarter of head_dim 32
    assert engine.kv_layout.num_layers == 1  # KV pages for the full-attention layer alone
    shape = engine.model.recurrent_shapes[0]
    assert (shape.conv_dim, shape.conv_width, shape.heads, shape.key_dim, shape.value_dim) == (128, 4, 4, 16, 16)
    assert len(engine.model.recurrent_shapes) == 3


def test_qwen3_5_agents_batched_with_retention_match_transformers(qwen35, make_engine):
    three_agents_three_turns(make_engine(qwen35), qwen35, "q35", 9100)


def test_qwen3_5_moe_agents_batched_with_retention_match_transformers(tmp_path, make_engine):
    path = make_tiny_checkpoint("qwen3_5_moe", tmp_path / "moe")
    engine = make_engine(path)
    args = engine.model.args
    assert args.moe.layers == (True,) * 4 and args.moe.top_k == 2 and args.moe.renormalize
    assert args.linear_attention.layers == (True, False, True, True)
    assert type(engine.model.model.layers[0].mlp).__name__ == "SharedExpertMoE"
    three_agents_three_turns(engine, path, "q35moe", 9300)


def test_qwen3_next_agents_batched_with_retention_match_transformers(tmp_path, make_engine):
    path = make_tiny_checkpoint("qwen3_next", tmp_path / "next")
    engine = make_engine(path)
    args = engine.model.args
    assert args.moe.layers == (True, False, True, True) and args.num_kv_layers == 2
    assert args.linear_attention.interleaved
    assert type(engine.model.model.layers[0].linear_attn).__name__ == "InterleavedGatedDeltaNet"
    three_agents_three_turns(engine, path, "q3next", 9400)


def test_qwen3_5_mixed_speculation_with_truncation_matches_transformers(qwen35, make_engine):
    """Suffix, n-gram and an oracle's drafts (every fifth wrong), fixed and adaptive, batched with
    async scheduling; each agent truncated back to its history and answering again. Rejected
    drafts never reach a state: the output is the one without speculation, and transformers'."""
    histories, want = mixed_batch(make_engine, qwen35, VOCAB_SIZE, seed=35)
    for history, out in zip(histories, want):
        assert_greedy_matches(qwen35, history, out)


def stand_in_graphs(monkeypatch) -> None:
    """CUDA graphs on the CPU: a capture runs the step once with no state slot, as a capture
    records without running; a replay runs it again on the static inputs into the captured
    logits and clears the layers' records of the step, as a replay leaves Python untouched."""
    from hibana_core.runner import DecodeGraphs

    class Graph:
        def replay(self):
            self.step()

    def capture(graphs, graph, bucket, q, span):
        model, slots = graphs.runner.model, graphs.state_slots.clone()
        graphs.state_slots.fill_(-1)
        logits = graphs._forward(bucket, q, span)
        graphs.state_slots.copy_(slots)

        def step():
            logits.copy_(graphs._forward(bucket, q, span))
            model.verified = [None] * len(model.verified)

        graph.step = step
        return logits

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)


def test_hybrid_decode_and_verify_graphs_leave_their_padding_out(qwen35, make_engine, monkeypatch):
    """A hybrid model's CUDA-graph path, on the CPU: decode graphs, and verify graphs whose
    sequences are front-padded to the graph's rows (the linear layers leave the padding out) and
    which keep what the commit reads in the verify stash. A stand-in graph's capture runs the step
    once, as a capture records it; its replay runs it again on the static inputs into the captured
    logits and clears the layers' records of the step, which only the graph's record brings back,
    as after a real replay. mixed_batch's agents (several drafters, mixed draft lengths, async
    scheduling) give the output without speculation, and transformers'."""
    from hibana_core.runner import DecodeGraphs

    stand_in_graphs(monkeypatch)
    made = []

    def with_graphs(path, **options):
        engine = make_engine(path, **options)
        runner = engine.core.runner
        runner.graphs = DecodeGraphs(runner, engine.config.scheduler.max_concurrent_agents)
        made.append(runner.graphs)
        return engine

    histories, want = mixed_batch(with_graphs, qwen35, VOCAB_SIZE, seed=36)
    graphs = made[0]
    verify = {key for key in graphs.graphs if key[1] > 1}
    assert verify and verify == set(graphs.verified) and any(key[1] == 1 for key in graphs.graphs)
    assert any(key[0] > 1 for key in verify)  # sequences of several lengths in one graph
    for history, out in zip(histories, want):
        assert_greedy_matches(qwen35, history, out)

    # a hybrid draft model's decode graphs: the drafting steps write scratch copies of its states
    engine = with_graphs(qwen35, speculation={"method": "draft_model", "draft_model": str(qwen35), "k": 4},
                         async_scheduling=True)
    drafter = hybrid_drafter(engine)
    drafter.runner.graphs = DecodeGraphs(drafter.runner, engine.config.scheduler.max_concurrent_agents)
    rng = random.Random(3660)
    plans = [[(random_tokens(rng, 30), 9), (random_tokens(rng, 5), 9)] for _ in range(2)]
    for turns in greedy_turns_at_once(engine, "dg", plans):
        for history, completion in turns:
            assert_greedy_matches(qwen35, history, completion.token_ids)
    stats = engine.stats()  # (drafts only move speed: a draft state gone wrong shows as drafts rejected)
    assert drafter.runner.graphs.graphs and stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed > 0


def test_a_verify_graph_over_prompt_ends_with_fewer_sequences_than_its_bucket(qwen35, make_engine, monkeypatch):
    """Three agents' second turns (a few new tokens) verified with drafts in one graph of bucket 4:
    the kept rows of each reach past its prompt's end, so the commit folds them in two parts,
    padded to the graph's four sequences (it raised on the sizes, and left the states past what
    their slots held); each answer is transformers'."""
    from spec_drafters import OracleDrafter, registered

    from hibana_core.runner import DecodeGraphs

    stand_in_graphs(monkeypatch)
    rng, oracle, plans = random.Random(3680), OracleDrafter(VOCAB_SIZE), []
    for _ in range(3):
        first = random_tokens(rng, 24)
        out = hf_greedy(qwen35, first, 4)
        second = first + out + random_tokens(rng, 6)
        oracle.add(first, out)
        oracle.add(second, hf_greedy(qwen35, second, 8))
        plans.append((first, second))
    with registered(oracle=oracle):
        engine = make_engine(qwen35, speculation={"method": "oracle", "k": 4}, async_scheduling=True)
    runner = engine.core.runner
    runner.graphs = DecodeGraphs(runner, engine.config.scheduler.max_concurrent_agents)
    handles = [engine.open_state(f"g{i}") for i in range(3)]
    for h, (first, _) in zip(handles, plans):
        h.generate(greedy(4), prompt=first)
    with engine.core.lock:  # all three queued before a step: verified in the same steps
        streams = [h.stream(greedy(8), prompt=second) for h, (_, second) in zip(handles, plans)]
    done = [list([event for event in events][-1].completion.token_ids) for events in streams]
    assert any(bucket == 4 for bucket, _, _ in runner.graphs.verified), sorted(runner.graphs.verified)
    for i, (_, second) in enumerate(plans):
        assert_greedy_matches(qwen35, second, done[i])
        more = list(handles[i].generate(greedy(4)).token_ids)  # the states went on from the right place
        assert_greedy_matches(qwen35, second + done[i], more)


def test_a_history_cut_inside_the_last_reply_continues_from_the_prompts_snapshot(qwen35, make_engine):
    """The next turn re-renders the last reply differently (a template rewriting it): the state
    goes back to the snapshot taken where the last prompt ended, recomputes from there, and
    matches transformers; a cut before the first prompt's end recomputes from the start."""
    engine = make_engine(qwen35, speculation="off")
    rng = random.Random(3500)
    h = engine.open_state("cut")
    prompt = random_tokens(rng, 40)
    reply = list(h.generate(greedy(12), prompt=prompt).token_ids)
    assert [p for p, _ in recurrent_of(engine, h).snapshots] == [len(prompt)]
    edited = prompt + reply[:5] + random_tokens(rng, 9)  # the reply's sixth token changed, and more after it
    before = engine.stats().prompt_tokens_reused
    out = list(h.generate(greedy(10), prompt=edited).token_ids)
    assert_greedy_matches(qwen35, edited, out)
    assert engine.stats().prompt_tokens_reused - before == len(prompt)  # from the snapshot, not the cut
    state = recurrent_of(engine, h)
    assert [p for p, _ in state.snapshots] == [len(prompt), len(edited)]

    early = prompt[:20] + random_tokens(rng, 7)  # before every snapshot
    before = engine.stats().prompt_tokens_reused
    out = list(h.generate(greedy(8), prompt=early).token_ids)
    assert_greedy_matches(qwen35, early, out)
    assert engine.stats().prompt_tokens_reused == before  # all of it recomputed
    assert recurrent_of(engine, h).snapshots == [(len(early), recurrent_of(engine, h).snapshots[0][1])]


def test_snapshots_are_bounded_and_their_slots_reused(qwen35, make_engine):
    engine = make_engine(qwen35, speculation="off")
    rng = random.Random(3510)
    h, history = engine.open_state("many"), []
    free = engine.recurrent_slots.num_free
    for _ in range(SNAPSHOTS + 3):
        history += random_tokens(rng, 10)
        history += list(h.generate(greedy(4), prompt=history).token_ids)
    state = recurrent_of(engine, h)
    assert len(state.snapshots) == SNAPSHOTS and state.num_slots == SNAPSHOTS + 1
    assert engine.recurrent_slots.num_free == free - state.num_slots
    recurrent = engine.memory()["device"]["recurrent"]
    assert (recurrent["live"], recurrent["snapshots"], recurrent["free"]) == (1, SNAPSHOTS, free - state.num_slots)
    assert recurrent["bytes"] == (recurrent["slots"] + 1) * recurrent["slot_bytes"] > 0
    h.close()
    assert engine.recurrent_slots.num_free == free  # every slot back


def test_state_slots_are_sized_within_the_memory_budget(qwen35, make_engine):
    """The recurrent cache takes 2 x max_concurrent_agents + 2 slots where memory allows, else at
    most half of what the budget leaves for agents (a real Qwen3.5's state is 62-151 MB: 130 of
    them do not fit a small GPU), never fewer than MIN_STATE_SLOTS; agents beyond the slots wait
    for one, and every output is transformers'."""
    from hibana_core.kv.recurrent import MIN_STATE_SLOTS

    roomy = make_engine(qwen35, speculation="off", num_blocks=None, memory_budget="1GB")
    recurrent = roomy.memory()["device"]["recurrent"]
    slot, others = recurrent["slot_bytes"], roomy.workspace_bytes - (recurrent["slots"] + 1) * recurrent["slot_bytes"]
    assert recurrent["slots"] == 2 * roomy.config.scheduler.max_concurrent_agents + 2
    roomy.close()
    budget = roomy.weight_bytes + others + 40 * slot  # 40 slots' bytes for agents: states get 20
    engine = make_engine(qwen35, speculation="off", num_blocks=None, memory_budget=budget)
    memory = engine.memory()["device"]
    assert memory["recurrent"]["slots"] == 19 and memory["recurrent"]["bytes"] == 20 * slot
    assert memory["weights"] + memory["workspace_estimate"] + memory["kv_pool"] <= budget
    tight = roomy.weight_bytes + others + (MIN_STATE_SLOTS + 1) * slot
    with pytest.raises(MemoryBudgetError):  # the fewest slots fit, two KV blocks beside them do not
        make_engine(qwen35, speculation="off", num_blocks=None, memory_budget=tight)
    small = make_engine(qwen35, speculation="off", num_blocks=None,
                        memory_budget=roomy.weight_bytes + others + 2 * (MIN_STATE_SLOTS + 1) * slot - 1)
    assert small.memory()["device"]["recurrent"]["slots"] == MIN_STATE_SLOTS
    rng = random.Random(3620)
    plans = [[(random_tokens(rng, 30), 6), (random_tokens(rng, 8), 6)] for _ in range(6)]  # more agents than slots
    for turns in greedy_turns_at_once(small, "few", plans):
        for history, completion in turns:
            assert_greedy_matches(qwen35, history, completion.token_ids)


def test_a_fork_continues_from_a_copy_of_the_state(qwen35, make_engine):
    engine = make_engine(qwen35, speculation="off")
    rng = random.Random(3520)
    a = engine.open_state("a")
    history = random_tokens(rng, 30)
    history += list(a.generate(greedy(6), prompt=history).token_ids)
    b = a.fork("b")
    assert recurrent_of(engine, b).slot != recurrent_of(engine, a).slot
    more_a, more_b = random_tokens(rng, 5), random_tokens(rng, 7)
    out_b = list(b.generate(greedy(8), prompt=history + more_b).token_ids)
    out_a = list(a.generate(greedy(8), prompt=history + more_a).token_ids)
    assert_greedy_matches(qwen35, history + more_a, out_a)
    assert_greedy_matches(qwen35, history + more_b, out_b)
    assert engine.stats().prompt_tokens_reused >= 2 * len(history) - 2


def test_idle_states_give_their_slots_back_when_new_agents_need_them(qwen35, make_engine):
    """One running agent: a recurrent cache of 2 x 1 + 2 slots. Six agents take turns: idle
    agents' snapshots go first, then whole idle states (recomputed when their agents return);
    every answer is still transformers'."""
    engine = make_engine(qwen35, speculation="off", max_concurrent_agents=1)
    assert engine.recurrent_slots.num_slots == 4
    rng = random.Random(3530)
    histories = {i: random_tokens(rng, 20) for i in range(6)}
    for turn in range(2):
        for i in range(6):
            h = engine.open_state(f"agent-{i}")
            histories[i] += random_tokens(rng, 5)
            out = list(h.generate(greedy(5), prompt=histories[i]).token_ids)
            assert_greedy_matches(qwen35, histories[i], out)
            histories[i] += out
    held = [recurrent_of(engine, engine.open_state(f"agent-{i}")) for i in range(6)]
    assert sum(r.num_slots for r in held) + engine.recurrent_slots.num_free == 4  # no slot lost or shared
    assert sum(r.slot is None for r in held) >= 2  # whole idle states gave theirs back


def test_a_draft_model_for_a_hybrid_target_leaves_its_output_unchanged(qwen35, tiny_checkpoints, make_engine):
    """Drafts from another model (tiny qwen3: same tokenizer), mostly rejected, some kept."""
    rng = random.Random(3540)
    history = random_tokens(rng, 30)
    want = hf_greedy(qwen35, history, 24)
    engine = make_engine(qwen35, speculation={"method": "draft_model", "draft_model": str(tiny_checkpoints["qwen3"]),
                                             "k": 3})
    out = list(engine.open_state("d").generate(greedy(24), prompt=history).token_ids)
    assert out == want
    assert engine.stats().draft_tokens_proposed > 0


def test_a_multimodal_qwen3_5_checkpoint_serves_its_language_model(tmp_path, make_engine):
    path = make_tiny_qwen3_5_multimodal(tmp_path / "mm")
    engine = make_engine(path)
    assert engine.model.args.model_type == "qwen3_5"
    agents = greedy_turns_at_once(engine, "mm", [[(random_tokens(random.Random(3550 + a), 25), 8)] for a in range(2)])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(path, history, completion.token_ids)


def test_a_saved_hybrid_state_comes_back_without_recomputing(qwen35, make_engine, tmp_path):
    """A state file of a hybrid model holds its linear layers' state beside its KV: loaded into
    another engine, the next turn computes only its new tokens and answers as transformers does."""
    rng = random.Random(3560)
    history = random_tokens(rng, 30)
    engine = make_engine(qwen35, speculation="off")
    h = engine.open_state("s")
    history += list(h.generate(greedy(6), prompt=history).token_ids)
    h.save(tmp_path / "s.hibana")
    other = make_engine(qwen35, speculation="off")
    loaded = other.load_state(tmp_path / "s.hibana")
    assert loaded.tokens == history
    state = recurrent_of(other, loaded)
    assert state.position == len(history) - 1 and state.slot is not None
    more = history + random_tokens(rng, 5)
    out = loaded.generate(greedy(6), prompt=more).token_ids
    assert_greedy_matches(qwen35, more, out)
    assert other.stats().prompt_tokens_computed == len(more) - (len(history) - 1)


def test_a_hybrid_state_file_with_a_damaged_state_is_refused(qwen35, make_engine, tmp_path):
    from safetensors.torch import load_file, save_file

    from hibana_core.errors import StateFileError
    from hibana_core.kv.state_file import _metadata

    engine = make_engine(qwen35, speculation="off")
    h = engine.open_state("d")
    h.generate(greedy(3), prompt=list(range(3, 25)))
    h.save(tmp_path / "d.hibana")
    data = (tmp_path / "d.hibana").read_bytes()
    tensors, meta = load_file(str(tmp_path / "d.hibana")), _metadata(data)
    tensors["recurrent.ssm"] = tensors["recurrent.ssm"] + 1e-3  # a flipped value in the matrix state
    save_file(tensors, str(tmp_path / "bad.hibana"), metadata=meta)
    with pytest.raises(StateFileError, match="damaged"):
        make_engine(qwen35, speculation="off").load_state(tmp_path / "bad.hibana")


def test_qwen3_5_in_bfloat16_runs(qwen35, make_engine):
    engine = make_engine(qwen35, dtype="bfloat16")
    out = engine.open_state("bf").generate(greedy(6), prompt=list(range(3, 30))).token_ids
    assert len(out) == 6
    assert engine.recurrent_slots is not None and engine._ctx.recurrent.ssm[0].dtype == torch.float32


def test_weight_surgery_on_a_hybrid_model_is_guarded_and_matches_its_own_greedy(qwen35, make_engine):
    """w8 on every linear layer (the linear-attention projections too), its guard measured on the
    hybrid model through the scorer's own recurrent slot."""
    engine = make_engine(qwen35, surgery=["w8"], speculation="off")
    record = engine.surgery[0]
    # 3 linear layers x (in_proj, in_proj_gates, out_proj), 1 attention layer x (qkv, o), 4 MLPs x 2
    assert record["name"] == "w8" and record["layers"] == 19, record
    assert record["guard"]["decision"] == "ok" and record["guard"]["tokens"] > 1000, record
    assert engine.model.model.layers[0].linear_attn.in_proj.kind == "int8"
    assert engine.model.model.layers[0].linear_attn.in_proj_gates.kind == "int8"
    out = engine.open_state("w8").generate(greedy(8), prompt=list(range(5, 40))).token_ids
    assert len(out) == 8


def layer_skip_engine(make_engine, path, monkeypatch, layers, **options):
    """An engine drafting with layer_skip on the target's `layers` (the ranking, seconds of the
    hybrid's forwards over the guard's text on the CPU, left out)."""
    from hibana_core.surgery import layer_skip

    monkeypatch.setattr(layer_skip, "layer_importance", lambda engine, documents: [0.0] * engine.model_args.num_layers)
    monkeypatch.setattr(layer_skip, "choose_layers", lambda importance, keep: list(layers))
    return make_engine(path, speculation={"method": "layer_skip", "k": 4}, **options)


def assert_layer_skip_draft_of(engine, kept: list[int]) -> None:
    """The draft runs the `kept` layers of the target on weights it shares, each mixer on the
    draft's own caches at its place among the kept layers of its kind: attention layers on the
    draft's KV (as many layers as it keeps), linear-attention layers on the draft's own state
    slots (as many as it keeps); the target's layers are untouched."""
    drafter = engine.core.speculation.drafter("layer_skip")
    target, draft = engine.model.model.layers, drafter.runner.model.model.layers
    linear = engine.model_args.linear_attention.layers
    args = drafter.runner.model.args
    assert drafter.layers == kept and args.num_layers == len(kept)
    assert args.linear_attention.layers == tuple(linear[i] for i in kept)
    assert drafter.kv_cache.layout.num_layers == args.num_kv_layers == sum(not linear[i] for i in kept)
    assert len(drafter.ctx.recurrent.conv) == len(drafter.runner.model.recurrent_shapes) == sum(linear[i] for i in kept)
    assert drafter.ctx.recurrent is not engine._ctx.recurrent and drafter.states is not engine.recurrent_slots
    places = {True: 0, False: 0}
    for old, layer in zip(kept, draft):
        mine, theirs = (layer.linear_attn, target[old].linear_attn) if linear[old] else (layer.self_attn,
                                                                                            target[old].self_attn)
        assert mine.ctx is drafter.ctx and theirs.ctx is engine._ctx
        assert (mine.index if linear[old] else mine.layer_idx) == places[linear[old]]
        assert (theirs.index if linear[old] else theirs.layer_idx) == sum(linear[i] == linear[old] for i in range(old))
        places[linear[old]] += 1
        assert layer.mlp is target[old].mlp and all(a is b for a, b in zip(mine.parameters(), theirs.parameters()))


@pytest.mark.parametrize("arch, kept", [("qwen3_5", [0, 3]), ("qwen3_5_moe", [0, 1, 3]), ("qwen3_next", [0, 3])])
def test_layer_skip_of_a_hybrid_model_matches_transformers(arch, kept, qwen35, tmp_path, make_engine, monkeypatch):
    """A hybrid target's layer-skip draft: the kept linear-attention layers hold states of their
    own (in the draft's recurrent cache, a token short of each history, as a hybrid draft model's),
    the kept attention layers KV of their own. Three agents at once, three turns each with
    retention: the tokens of speculation off, and transformers'. qwen3_5 ranks its layers on the
    guard's text (half of 4 layers: the first and the last, both linear: a draft with no KV at all);
    the others keep layers across kinds, their places among the kept ones not the target's."""
    path = qwen35 if arch == "qwen3_5" else make_tiny_checkpoint(arch, tmp_path / arch)
    if arch == "qwen3_5":
        engine = make_engine(path, speculation={"method": "layer_skip", "k": 4}, async_scheduling=True)
    else:
        engine = layer_skip_engine(make_engine, path, monkeypatch, kept, async_scheduling=True)
    assert_layer_skip_draft_of(engine, kept)
    rng = random.Random(3700 + len(arch))
    plans = [[(random_tokens(rng, 24), 8), (random_tokens(rng, 6), 8), (random_tokens(rng, 4), 8)] for _ in range(3)]
    agents = greedy_turns_at_once(engine, "ls", plans)
    plain = greedy_turns_at_once(make_engine(path, speculation="off"), "off", plans)
    for turns, off in zip(agents, plain):
        for (history, completion), (_, without) in zip(turns, off):
            assert list(completion.token_ids) == list(without.token_ids)
            assert_greedy_matches(path, history, completion.token_ids)
    summary, stats = engine.stats().speculation["drafters"]["layer_skip"], engine.stats()
    assert summary["layers_kept"] == kept and stats.draft_tokens_proposed > 0
    assert stats.prompt_tokens_reused > 0


def test_a_hybrids_layer_skip_draft_of_every_layer_is_kept_and_follows_cut_histories(qwen35, make_engine,
                                                                                     monkeypatch):
    """Every layer kept: the draft computes what the target does, on its own states, so nearly
    every draft is kept (a state shared with the target, or one a draft leaked into, would not
    be); a history cut back (truncate) continues from the draft's snapshot or the start."""
    with pytest.warns(UserWarning, match="keeps all 4 layers"):
        engine = layer_skip_engine(make_engine, qwen35, monkeypatch, [0, 1, 2, 3], async_scheduling=True)
    assert_layer_skip_draft_of(engine, [0, 1, 2, 3])
    rng = random.Random(3710)
    plans = [[(random_tokens(rng, 40), 10), (random_tokens(rng, 8), 10)] for _ in range(3)]
    for turns in greedy_turns_at_once(engine, "all", plans):
        for history, completion in turns:
            assert_greedy_matches(qwen35, history, completion.token_ids)
    h = engine.open_state("all-0")
    h.truncate(30)  # before the prompt's end: the draft's state starts again
    more = list(h.generate(greedy(8)).token_ids)
    assert_greedy_matches(qwen35, h.tokens[:30], more)
    stats = engine.stats()
    assert stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed > 0


def hybrid_drafter(engine):
    return engine.core.speculation.drafter("draft_model")


def test_a_hybrid_draft_model_drafts_for_a_hybrid_target(qwen35, make_engine):
    """A Qwen3.5 target drafted for by a Qwen3.5 draft model (the only kind sharing its tokenizer):
    here the target itself, so every draft is kept. Three agents at once, three turns each with
    retention, async scheduling: transformers' tokens. The draft model's live states stop a token
    short of each history and the drafting steps run on copies (scratch slots), so its states
    follow the histories without recomputing them, and no scratch slot is left taken."""
    engine = make_engine(qwen35, speculation={"method": "draft_model", "draft_model": str(qwen35), "k": 4},
                         async_scheduling=True)
    rng = random.Random(3630)
    plans = [[(random_tokens(rng, 40), 10), (random_tokens(rng, 12), 10), (random_tokens(rng, 6), 10)]
             for _ in range(3)]
    for turns in greedy_turns_at_once(engine, "hd", plans):
        for history, completion in turns:
            assert_greedy_matches(qwen35, history, completion.token_ids)
    stats, drafter = engine.stats(), hybrid_drafter(engine)
    assert stats.draft_tokens_accepted >= 0.9 * stats.draft_tokens_proposed > 0
    every = sum(len(new) + n for plan in plans for new, n in plan)  # all three agents' final histories
    assert drafter.summary()["tokens_prefilled"] <= every  # each history token caught up with once
    live = [e.seq.recurrent for e in drafter._states.values()]
    assert len(live) == 3 and all(r.slot is not None and r.position == e.seq.num_computed
                                  for r, e in zip(live, drafter._states.values()))
    taken = sum(r.num_slots for r in live)
    assert drafter.states.num_free == drafter.states.num_slots - taken  # no scratch slot left taken


def test_a_hybrid_draft_model_follows_cut_and_re_rendered_histories(qwen35, tmp_path, make_engine):
    """Another seed's Qwen3.5 drafts (mostly rejected) for a Qwen3.5 target; the history is cut
    back (truncate) and re-rendered inside the reply: the draft model's state goes back to the
    snapshot at the last prompt's end (or the start) and catches up; output as transformers'."""
    other = make_tiny_checkpoint("qwen3_5", tmp_path / "other", seed=4242)
    engine = make_engine(qwen35, speculation={"method": "draft_model", "draft_model": str(other), "k": 3})
    rng = random.Random(3640)
    h = engine.open_state("cut")
    prompt = random_tokens(rng, 50)
    reply = list(h.generate(greedy(12), prompt=prompt).token_ids)
    assert_greedy_matches(qwen35, prompt, reply)
    drafter = hybrid_drafter(engine)
    (entry,) = drafter._states.values()
    assert [p for p, _ in entry.seq.recurrent.snapshots] == [len(prompt) - 1]  # the new prompt's end, less one
    edited = prompt + reply[:4] + random_tokens(rng, 7)  # re-rendered: diverges inside the reply
    before = drafter.summary()["tokens_prefilled"]
    out = list(h.generate(greedy(8), prompt=edited).token_ids)
    assert_greedy_matches(qwen35, edited, out)
    # from the snapshot: the edited tail and the turn's own tokens (from the start: more than the prompt)
    assert drafter.summary()["tokens_prefilled"] - before <= len(edited) - (len(prompt) - 1) + 2 * 8
    h.truncate(20)  # before every snapshot: from the start
    more = list(h.generate(greedy(6)).token_ids)
    assert_greedy_matches(qwen35, edited[:20], more)
    assert engine.stats().draft_tokens_proposed > 0


def test_a_hybrid_draft_models_snapshots_give_way_to_drafting_states(qwen35, make_engine):
    """Two agents drafting at once with the fewest slots (live and scratch each, one more): the
    snapshots their new prompts took give way to a drafting state's scratch slot, so neither is
    skipped nor made to catch up its history again."""
    from hibana_core.speculation.drafters import DraftInput

    engine = make_engine(qwen35, speculation={"method": "draft_model", "draft_model": str(qwen35), "k": 4},
                         max_concurrent_agents=2)
    drafter, rng = hybrid_drafter(engine), random.Random(3690)

    class Key:  # a state's identity (weakly referenced)
        pass

    keys, histories = [Key(), Key()], [random_tokens(rng, 40), random_tokens(rng, 40)]
    for call in range(4):
        drafts = drafter.propose_many([DraftInput(h, k, 0) for h, k in zip(histories, keys)], [4, 4])
        assert [len(d) for d in drafts] == [4, 4], call
        for h in histories:  # a token kept a call
            h.append(rng.randrange(VOCAB_SIZE))
    summary = drafter.summary()
    # each call runs the tokens from a state's last end but one (the last on its scratch copy)
    assert summary["skipped"] == 0 and summary["tokens_prefilled"] == 2 * 40 + 3 * 2 * 2


def test_a_hybrid_draft_model_under_slot_pressure_evicts_idle_states(qwen35, tiny_checkpoints, make_engine):
    """A hybrid draft model with few state slots (one running agent's): idle agents' draft states
    are dropped least recently used first and recomputed when they return; a non-hybrid target
    (tiny qwen3, the same tokenizer) takes the hybrid's drafts as any; output as transformers'."""
    target = tiny_checkpoints["qwen3"]
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(qwen35), "k": 2},
                         max_concurrent_agents=1)
    drafter = hybrid_drafter(engine)
    assert drafter.states.num_slots == 2 * 1 + 1  # live and scratch of the one running agent, one more
    rng = random.Random(3650)
    histories = [random_tokens(rng, 25) for _ in range(4)]
    for round_ in range(2):
        for i, history in enumerate(histories):
            h = engine.open_state(f"p{i}")
            out = list(h.generate(greedy(6), prompt=history).token_ids)
            assert_greedy_matches(target, history, out)
            histories[i] = history + out + random_tokens(rng, 3)
    assert drafter.summary()["evictions"] > 0 and engine.stats().draft_tokens_proposed > 0


@pytest.mark.parametrize("method, gates", [("gptq", "dense"), ("awq", "packed")])
def test_a_gptq_or_awq_qwen3_5_checkpoint_loads_packed_and_computes_its_dequantized_model(
        method, gates, tmp_path, make_engine, monkeypatch):
    """A 4-bit Qwen3.5 checkpoint (its attention, MLP and linear-attention projections packed; the
    narrow b / a gate projections in 16 bits, as quantization recipes leave them, or packed too)
    loads onto the int4 kernels, its fused input projections included, and gives the greedy
    tokens of the float model with its dequantized weights."""
    import test_prequantized

    src = make_tiny_checkpoint("qwen3_5", tmp_path / "src", linear_num_value_heads=8)  # (8 gates: packable)
    linear = ("in_proj_qkv", "in_proj_z", "out_proj") + (("in_proj_b", "in_proj_a") if gates == "packed" else ())
    monkeypatch.setattr(test_prequantized, "LINEARS", test_prequantized.LINEARS + linear)
    reference = test_prequantized.write_quantized(src, tmp_path / method, method)
    packed, dense = make_engine(tmp_path / method, speculation="off"), make_engine(reference, speculation="off")
    kinds = {name.rpartition(".")[2]: m.kind for name, m in packed.model.named_modules() if hasattr(m, "set_packed")}
    assert kinds["in_proj"] == kinds["out_proj"] == "int4"
    assert kinds["in_proj_gates"] == ("int4" if gates == "packed" else "dense")
    assert packed.weight_bytes < dense.weight_bytes / 2
    rng = random.Random(3670)
    for i in range(2):
        prompt = random_tokens(rng, 30 + 9 * i)
        got = packed.open_state(f"a{i}").generate(greedy(12), prompt=prompt).token_ids
        assert list(got) == list(dense.open_state(f"a{i}").generate(greedy(12), prompt=prompt).token_ids)


@pytest.mark.parametrize("scheme", ["fp8", "ct-block"])
def test_an_fp8_qwen3_5_checkpoint_with_its_gates_in_16_bits_loads_as_it_is(qwen35, tmp_path, make_engine, scheme):
    """Quantized Qwen3.5 releases leave the linear layers' narrow b / a projections (and the
    convolution) unquantized: those load beside the fp8 q/k/v/z ones, and the engine computes the
    dequantized float model's greedy output."""
    from fp8_checkpoints import LINEARS, write_fp8_checkpoint

    reference = write_fp8_checkpoint(qwen35, tmp_path / scheme, scheme,
                                     linears=(*LINEARS, "in_proj_qkv", "in_proj_z", "out_proj"),
                                     skip=("model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b",
                                           "model.layers.1.linear_attn.in_proj_a", "model.layers.1.linear_attn.in_proj_b",
                                           "model.layers.3.linear_attn.in_proj_a", "model.layers.3.linear_attn.in_proj_b"))
    engine = make_engine(tmp_path / scheme, speculation="off")
    layer = engine.model.model.layers[0].linear_attn
    assert layer.in_proj.kind == "fp8" and layer.in_proj_gates.kind == "dense" and layer.out_proj.kind == "fp8"
    history = random_tokens(random.Random(3570), 30)
    out = engine.open_state("fp8").generate(greedy(10), prompt=history).token_ids
    assert_greedy_matches(reference, history, out)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_idle_hybrid_states_park_with_their_state_and_resume_exactly(qwen35, make_engine, tmp_path, tier):
    """Eight agents in turns over a KV pool for two: idle states park in the host tier (or spill to
    disk) with their linear layers' state and come back with it, so a turn computes only its new
    tokens, each answer transformers'."""
    from test_host_tier import AGENTS, DEVICE_BLOCKS, GENERATE, TURNS, assert_only_new_tokens_computed, round_robin

    options = dict(state_dir=tmp_path, host_kv_bytes=0) if tier == "disk" else {}
    engine = make_engine(qwen35, num_blocks=DEVICE_BLOCKS, speculation="off", **options)

    def check(prompt, got):
        assert list(got) == hf_greedy(str(qwen35), prompt, GENERATE)

    computed = round_robin(engine, seed=35, check=check)
    assert_only_new_tokens_computed(computed)
    stats = engine.stats()
    assert stats.parks >= AGENTS and stats.resumes >= AGENTS * (TURNS - 2)
    if tier == "disk":
        assert stats.host_tier["spills"] >= AGENTS and stats.host_tier["disk_resumes"] >= AGENTS


def test_a_stop_inside_an_accepted_draft_leaves_the_state_at_the_stop(qwen35, make_engine):
    """Drafts (an oracle's, all right) verified past a stop token: the states fold in the tokens
    up to the stop only, and the next turn goes on as transformers does."""
    import dataclasses

    from spec_drafters import OracleDrafter, registered

    history = random_tokens(random.Random(3580), 25)
    oracle = OracleDrafter(VOCAB_SIZE)
    with registered(oracle=oracle):
        engine = make_engine(qwen35, speculation={"method": "oracle", "k": 4}, async_scheduling=True)
    full = list(engine.open_state("ref").generate(greedy(16, speculation="off"), prompt=history).token_ids)
    oracle.add(history, full)
    at = next(i for i in range(2, 16) if full[i] not in full[:i])
    h = engine.open_state("stop")
    c = h.generate(dataclasses.replace(greedy(16), stop_token_ids=[full[at]]), prompt=history)
    assert list(c.token_ids) == full[:at + 1] and engine.stats().draft_tokens_accepted > 0
    state = recurrent_of(engine, h)
    assert state.position == engine.registry._entry(h).seq.num_computed <= len(history) + at + 1
    more = list(h.generate(greedy(6)).token_ids)
    assert_greedy_matches(qwen35, history + full[:at + 1], more)


@pytest.mark.parametrize("first_draft", ["right", "wrong"])
def test_a_verify_step_over_a_prompts_end_keeps_the_state_there(qwen35, make_engine, first_draft):
    """Drafts verified with a prompt's last chunk (an oracle's, its first right or wrong): the
    states fold in the prompt first, keep a snapshot at its end and publish it at a multiple of
    the share stride, then the drafts kept, as a step that writes the states does. The next turn,
    re-rendering the reply, and another agent with the same start continue from there."""
    from spec_drafters import OracleDrafter, registered

    rng = random.Random(3585)
    history = random_tokens(rng, 128)
    full = hf_greedy(qwen35, history, 12)
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: first_draft == "wrong" and p == 0)
    oracle.add(history, full)
    with registered(oracle=oracle):
        engine = make_engine(qwen35, speculation={"method": "oracle", "k": 4}, async_scheduling=True)
    engine.recurrent_slots.stride = 64
    h = engine.open_state("a")
    assert list(h.generate(greedy(12), prompt=history).token_ids) == full
    assert any(n == len(history) and draft for n, _, draft in oracle.calls)  # drafts beside the prompt's end
    assert [p for p, _ in recurrent_of(engine, h).snapshots] == [len(history)]
    assert sorted(p for p, _ in engine.recurrent_slots.published.values()) == [64, 128]

    edited = history + full[:3] + random_tokens(rng, 5)  # the reply re-rendered
    before = engine.stats().prompt_tokens_reused
    out = list(h.generate(greedy(6), prompt=edited).token_ids)
    assert engine.stats().prompt_tokens_reused - before == len(history)
    assert_greedy_matches(qwen35, edited, out)
    second = history + random_tokens(rng, 10)
    done = engine.open_state("b").generate(greedy(6), prompt=second)
    assert done.stats.reused == len(history)
    assert_greedy_matches(qwen35, second, done.token_ids)


def test_a_stream_dropped_mid_generation_leaves_a_state_that_goes_on_exactly(qwen35, make_engine):
    engine = make_engine(qwen35)
    history = random_tokens(random.Random(3590), 30)
    h = engine.open_state("cancel")
    stream = h.stream(greedy(40), prompt=history)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    kept = h.tokens
    assert len(kept) >= len(history) + 6
    state = recurrent_of(engine, h)
    assert state.position == engine.registry._entry(h).seq.num_computed
    out = list(h.generate(greedy(8)).token_ids)
    assert_greedy_matches(qwen35, kept, out)


def test_agents_with_a_common_prefix_share_its_kv_and_its_published_state(qwen35, make_engine):
    """A prompt's chunks end at multiples of the share stride, where its linear layers' state is
    published under the prefix's hash: a second agent whose history starts with the same 150
    tokens adopts the KV and the state of the first 128 (the last multiple of 64 within them),
    computes the rest, and answers as transformers does."""
    engine = make_engine(qwen35, speculation="off")
    engine.recurrent_slots.stride = 64
    rng = random.Random(3600)
    system = random_tokens(rng, 150)
    first, second = system + random_tokens(rng, 40), system + random_tokens(rng, 30)
    a = engine.open_state("a")
    out_a = list(a.generate(greedy(6), prompt=first).token_ids)
    assert sorted(p for p, _ in engine.recurrent_slots.published.values()) == [64, 128]  # (not 192: past the system)
    b = engine.open_state("b")
    done = b.generate(greedy(6), prompt=second)
    assert done.stats.reused == 128 and done.stats.computed == len(second) - 128
    assert_greedy_matches(qwen35, first, out_a)
    assert_greedy_matches(qwen35, second, done.token_ids)
    # with no slot free and no idle snapshot left, a new agent takes the least recently used published state's
    before = len(engine.recurrent_slots.published)
    for h in (a, b):
        recurrent_of(engine, h).drop_snapshots()
    while engine.recurrent_slots.num_free:
        engine.recurrent_slots.allocate()
    c = engine.open_state("c")
    c.generate(greedy(2), prompt=random_tokens(rng, 20))
    assert len(engine.recurrent_slots.published) == before - 1


def test_agents_sharing_a_system_prompt_at_once_match_transformers(qwen35, make_engine):
    """Three agents at once whose first turns start with the same 200 tokens, three turns each,
    speculation on: the later agents adopt the published states as the prefill publishes them."""
    engine = make_engine(qwen35)
    engine.recurrent_slots.stride = 64
    rng = random.Random(3610)
    system = random_tokens(rng, 200)
    plans = [[(system + random_tokens(rng, 20), 8), (random_tokens(rng, 15), 8), (random_tokens(rng, 10), 8)]
             for _ in range(3)]
    for turns in greedy_turns_at_once(engine, "sys", plans):
        for history, completion in turns:
            assert_greedy_matches(qwen35, history, completion.token_ids)
    assert engine.recurrent_slots.published and engine.stats().prompt_tokens_reused > 0


def test_the_least_budget_holds_a_hybrid_draft_models_fewest_state_slots(qwen35, make_engine):
    """The least budget a MemoryBudgetError names with a hybrid draft model builds the engine (the
    target's state slots grow with the budget: the least is where they and two KV blocks fit), and
    with room for a few more blocks the drafter, once built, stays within the budget: its least KV
    (one full-context sequence) and its fewest state slots (MIN_STATE_SLOTS and a scratch one)."""
    spec = {"method": "draft_model", "draft_model": str(qwen35), "k": 2}
    options = dict(speculation=spec, num_blocks=None, max_model_len=64)
    with pytest.raises(MemoryBudgetError, match="raise it to at least") as info:
        make_engine(qwen35, **options, memory_budget="1MB")
    least = int(str(info.value).split("at least ")[1].split(" bytes")[0].replace(",", ""))
    per_block = make_engine(qwen35, **options, memory_budget=least).kv_cache.bytes_per_block_here
    budget = least + 12 * per_block  # the target's pool past the drafter's least KV (5 blocks of 16 tokens)
    engine = make_engine(qwen35, **options, memory_budget=budget)
    history = list(range(3, 40))
    completion = engine.open_state("a").generate(greedy(6), prompt=history)  # the drafter is built
    assert_greedy_matches(qwen35, history, completion.token_ids)
    device = engine.memory()["device"]
    assert engine.pool.num_blocks > 5 and device["draft_model"] > 0
    total = device["weights"] + device["workspace_estimate"] + device["kv_pool"] + device["draft_model"]
    assert total <= budget, (total, budget, device)


def test_a_hybrid_states_bytes_count_its_recurrent_slots(qwen35, make_engine):
    """`engine.memory()`'s bytes of a state are what closing it frees: on a hybrid model its KV
    blocks and its recurrent slots (the live state and its snapshots)."""
    engine = make_engine(qwen35)
    h = engine.open_state("a")
    h.generate(greedy(6), prompt=list(range(3, 40)))
    memory = engine.memory()
    slot, free = memory["device"]["recurrent"]["slot_bytes"], engine.recurrent_slots.num_free
    (seq,) = [e.seq for e in engine.registry._entries.values()]
    held = seq.recurrent.num_slots
    assert held >= 2  # the live state and the prompt end's snapshot
    per_block = engine.kv_cache.bytes_per_block_here
    assert memory["states"]["a"]["bytes"] == seq.num_blocks * per_block + held * slot
    h.close()
    assert engine.recurrent_slots.num_free == free + held


def test_a_new_user_turn_continues_from_where_the_generation_prompt_started(tmp_path, make_engine):
    """A template whose generation prompt opens the think block (Qwen3.5's) and which drops the
    block when it re-renders the reply cuts the history inside the prompt's end, before the
    prompt-end snapshot: the chat layer names where the generation prompt starts, the state keeps a
    snapshot there, and the next user turn continues from it (before: from the start, under 512
    tokens). Its reply is the one an engine computing the whole turn-2 prompt gives."""
    from hibana_core.chat import Chat
    from reasoning_model import ADDED, SPECIAL, TEMPLATE
    from tiny_models import make_chat_checkpoint

    asked = '{{- "<|im_start|>assistant\\n" -}}'
    assert asked in TEMPLATE
    opening = TEMPLATE.replace(asked, '{{- "<|im_start|>assistant\\n<think>\\n" -}}')
    path = make_chat_checkpoint("qwen3_5", tmp_path / "opens", opening, SPECIAL, ADDED)
    first = [{"role": "user", "content": "hi there, what is the weather like today in the city?"}]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = make_engine(path)
    chat = Chat(engine, "a")
    one = chat.respond(first, params=params)
    prompt_one = one.usage.prompt_tokens
    second = first + [{"role": "assistant", "content": one.text, "reasoning_content": one.reasoning},
                      {"role": "user", "content": "and tomorrow?"}]
    two = chat.respond(second, params=params)
    block = len(engine.tokenizer.encode("<think>\n", add_special_tokens=False))
    assert two.usage.cached_tokens == prompt_one - block  # up to where the generation prompt started
    fresh = Chat(make_engine(path), "b").respond(second, params=params)
    assert (two.text, two.reasoning) == (fresh.text, fresh.reasoning)
    assert fresh.usage.cached_tokens == 0
