"""The draft-model drafter (hibana_core/speculation/draft_model.py) on the tiny checkpoints.

The target is tiny qwen3; drafts come from the same checkpoint (every greedy draft must be
accepted) or from tiny llama, another model with the same tokenizer (most drafts are rejected,
output must not change).
"""

from __future__ import annotations

import asyncio
import gc
import random

import pytest
import torch

import tiny_models
from hibana_core import SamplingParams
from hibana_core.errors import ConfigError
from hibana_core.speculation.controller import MAX_DRAFT, AcceptanceStats
from hibana_core.speculation.draft_model import DraftModelDrafter
from hibana_core.speculation.drafters import DraftInput


def spec(path, k=4) -> dict:
    return {"method": "draft_model", "draft_model": str(path), "k": k}


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [tiny_models.random_tokens(rng, rng.randint(20, 70)) for _ in range(n)]


def generate_all(engine, histories, params) -> list[list[int]]:
    """Generate on one state per history at once (the engine batches them): all submitted under
    the engine's lock, so that every step batches them on any machine (each `agenerate` of a
    gather waits for the lock on its own, and a step or more may run between them)."""
    handles = [engine.open_state(f"agent-{i}") for i in range(len(histories))]
    for h, tokens in zip(handles, histories):
        h.sync(tokens)

    async def run():
        with engine.core.lock:
            streams = [h.astream(params) for h in handles]

        async def last(events):
            event = None
            async for event in events:
                pass
            return event.completion
        return await asyncio.gather(*map(last, streams))

    return [list(c.token_ids) for c in asyncio.run(run())]


class Key:
    """A stand-in for a target state (draft KV is keyed weakly by it)."""


def test_same_model_as_draft_is_always_accepted_and_output_is_unchanged(tiny_checkpoints, make_engine):
    target = tiny_checkpoints["qwen3"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    histories = prompts(3)
    want = generate_all(make_engine(target, speculation="off"), histories, params)
    engine = make_engine(target, speculation=spec(target))
    assert generate_all(engine, histories, params) == want
    stats = engine.stats()
    assert stats.draft_tokens_proposed > 40
    assert stats.draft_tokens_accepted == stats.draft_tokens_proposed  # greedy drafts of the target itself
    own = stats.speculation["drafters"]["draft_model"]
    assert own["tokens_drafted"] >= stats.draft_tokens_proposed and own["ms_per_draft_token"] > 0
    assert own["tokens_drafted"] > 2 * 4 * own["calls"] / 2  # most calls drafted for several agents at once
    assert stats.steps < 20  # ~5 tokens per step and agent instead of 1 (40+ steps)


def test_other_model_with_the_same_tokenizer_leaves_output_unchanged(tiny_checkpoints, make_engine):
    target, draft = tiny_checkpoints["qwen3"], tiny_checkpoints["llama"]
    histories = prompts(4, seed=11)
    for params in (SamplingParams(max_tokens=32, ignore_eos=True),
                   SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.9, seed=5)):
        want = generate_all(make_engine(target, speculation="off"), histories, params)
        engine = make_engine(target, speculation=spec(draft, k=3))
        assert generate_all(engine, histories, params) == want
        assert engine.stats().draft_tokens_proposed > 0


def test_adaptive_draft_model_leaves_output_unchanged(tiny_checkpoints, make_engine):
    target = tiny_checkpoints["qwen3"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    histories = prompts(2, seed=3)
    want = generate_all(make_engine(target, speculation="off"), histories, params)
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(target)})
    assert generate_all(engine, histories, params) == want
    assert engine.stats().draft_tokens_accepted > 0


@pytest.mark.parametrize("asked", ["adaptive", True, {"method": "suffix"}])
def test_a_request_asking_adaptive_drafts_with_the_engines_drafter(tiny_checkpoints, make_engine, asked):
    """speculation="adaptive" (or True) on a request names no drafter: it drafted with suffix even
    where the engine's was a draft model; now with the engine's, as the request's own setting
    would. A request naming suffix gets suffix."""
    target = tiny_checkpoints["qwen3"]
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(target)})
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculation=asked)
    assert generate_all(engine, prompts(1, seed=4), params) == \
        generate_all(make_engine(target, speculation="off"), prompts(1, seed=4), params)
    drafters = engine.stats().speculation["drafters"]
    named = isinstance(asked, dict)
    assert ("suffix" in drafters) == named, drafters
    assert (drafters.get("draft_model", {}).get("calls", 0) > 0) != named, drafters


def test_adaptive_draft_model_drafts_what_the_plan_takes_and_nothing_once_it_stops(tiny_checkpoints, make_engine):
    """A draft model whose drafts are rejected (another model's) costs a forward a drafted token:
    the adaptive controller plans first and the draft model drafts what the plan took, not the
    most it could verify (15 forwards a step thrown away when the plan took none), and not one
    token a step once the plan takes none (a forward a step for nothing)."""
    target, draft = tiny_checkpoints["qwen3"], tiny_checkpoints["llama"]
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(draft)})
    generate_all(engine, prompts(1, seed=2), SamplingParams(max_tokens=48, ignore_eos=True))
    stats = engine.stats()
    own = stats.speculation["drafters"]["draft_model"]
    # every draft verified (how many the plan takes, none at all included, follows the step costs
    # profiled on this machine; the steps with a fixed plan: `PlanPattern` below)
    assert own["tokens_drafted"] == stats.draft_tokens_proposed, own
    assert own["calls"] < 10 and stats.steps > 40, (own, stats.steps)  # it stopped; the decodes went on


def test_a_draft_model_written_off_is_probed_and_taken_up_again(tiny_checkpoints, make_engine):
    """A draft model proposes only what the plan takes, so figures that fell low enough for the
    plan to take nothing were never measured again: its acceptance froze where it fell. Here the
    engine-wide figures say it never hits (as after a stretch of text it predicted badly) while
    its drafts are the target's own (every one is accepted): probes find that out and the plan
    drafts again; the output is the target's."""
    target = tiny_checkpoints["qwen3"]
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    histories = prompts(1, seed=5)
    want = generate_all(make_engine(target, speculation="off"), histories, params)
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(target)})
    written_off = engine.scheduler.speculation.global_stats.setdefault("draft_model", AcceptanceStats())
    for _ in range(200):
        written_off.record(MAX_DRAFT, 0)
    assert generate_all(engine, histories, params) == want
    stats = engine.stats()
    assert stats.draft_tokens_accepted == stats.draft_tokens_proposed
    lengths = stats.speculation["draft_lengths"]
    assert stats.draft_tokens_accepted > params.max_tokens // 4, lengths  # more than the probes alone
    assert any(int(k) > 1 and n for k, n in lengths.items()), lengths  # the plan took it up again


def test_proposals_are_the_draft_models_greedy_continuation_batched_and_chunked(tiny_checkpoints, make_engine):
    target, draft = tiny_checkpoints["qwen3"], tiny_checkpoints["llama"]
    engine = make_engine(target, speculation=spec(draft), max_num_batched_tokens=48)
    drafter = engine.scheduler.speculation.drafter("draft_model")
    rng = random.Random(5)
    histories = [tiny_models.random_tokens(rng, n) for n in (130, 17, 1, 60)]  # 130: three chunks
    keys = [Key() for _ in histories]
    ks = [3, 5, 1, 4]
    got = drafter.propose_many([DraftInput(h, key, 0) for h, key in zip(histories, keys)], ks)
    for history, k, draft_tokens in zip(histories, ks, got):
        assert draft_tokens == tiny_models.hf_greedy(draft, history, k)
    bs = drafter.pool.block_size
    assert drafter.pool.num_used == sum(-(-len(h) // bs) for h in histories)  # the history's KV only
    # the histories grow: only what was appended is computed; unchanged, only the last token
    counters = drafter.counters
    for grow, computed in ((6, 4 * 6), (0, 4 * 1)):
        before = counters.tokens_prefilled
        for h in histories:
            h.extend(tiny_models.random_tokens(rng, grow))
        got = drafter.propose_many([DraftInput(h, key, 0) for h, key in zip(histories, keys)], ks)
        assert got == [tiny_models.hf_greedy(draft, h, k) for h, k in zip(histories, ks)]
        assert counters.tokens_prefilled - before == computed
    # an edit (new version) keeps the common prefix
    histories[0][100:] = tiny_models.random_tokens(rng, 10)
    assert drafter.propose(DraftInput(histories[0], keys[0], 1), 4) == tiny_models.hf_greedy(draft, histories[0], 4)
    # closed states (collected keys) give their draft KV back at the next call
    del keys, got
    gc.collect()
    last = Key()
    drafter.propose(DraftInput([1, 2, 3], last, 0), 1)
    assert drafter.summary()["states"] == 1 and drafter.pool.num_used == 1


def test_idle_states_draft_kv_is_dropped_lru_first_under_pressure(tiny_checkpoints, make_engine):
    target = tiny_checkpoints["qwen3"]
    engine = make_engine(target)
    drafter = DraftModelDrafter(engine, model=str(target), num_blocks=8)  # 128 tokens
    rng = random.Random(9)
    histories = [tiny_models.random_tokens(rng, 40) for _ in range(4)]  # 3 blocks + drafts each
    keys = [Key() for _ in histories]
    for h, key in zip(histories, keys):
        assert drafter.propose(DraftInput(h, key, 0), 4) == tiny_models.hf_greedy(target, h, 4)
    assert drafter.counters.evictions >= 2 and drafter.pool.num_used <= 8
    # a batch that cannot fit drafts for the states that fit, and nothing for the rest
    long = [tiny_models.random_tokens(rng, 100) for _ in range(2)]
    got = drafter.propose_many([DraftInput(h, Key(), 0) for h in long], [4, 4])
    assert sorted(map(len, got)) == [0, 4] and drafter.counters.skipped == 1
    drafter.close()
    assert drafter.propose(DraftInput(histories[0], keys[0], 0), 4) == []


def test_closing_states_and_the_engine_frees_the_draft_kv(tiny_checkpoints, make_engine):
    target = tiny_checkpoints["qwen3"]
    engine = make_engine(target, speculation=spec(target))
    drafter = engine.scheduler.speculation.drafter("draft_model")
    generate_all(engine, prompts(2, seed=1), SamplingParams(max_tokens=12, ignore_eos=True))
    assert drafter.summary()["states"] == 2 and drafter.pool.num_used > 0
    engine.open_state("agent-0").close()
    gc.collect()
    engine.open_state("agent-1").generate(SamplingParams(max_tokens=6, ignore_eos=True))
    assert drafter.summary()["states"] == 1
    engine.close()
    assert drafter.runner is None and drafter.kv_cache is None and drafter.pool.num_used == 0


def test_draft_checkpoint_must_share_the_tokenizer(tiny_checkpoints, make_engine, tmp_path):
    target = tiny_checkpoints["qwen3"]
    other = tiny_models.make_tiny_checkpoint("qwen3", tmp_path / "other")
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match="does not share the tokenizer") as info:
        make_engine(target, speculation=spec(other))
    assert str(other) in str(info.value) and str(target) in str(info.value)
    # the same tokenizer with a padded embedding (as within Qwen2.5) is fine
    padded = tiny_models.make_tiny_checkpoint("qwen3", tmp_path / "padded", vocab_size=576)
    make_engine(target, speculation=spec(padded))


def test_draft_model_options_are_checked(tiny_checkpoints, make_engine):
    target = tiny_checkpoints["qwen3"]
    with pytest.raises(ConfigError, match="needs a draft checkpoint"):
        make_engine(target, speculation={"method": "draft_model", "k": 2})
    with pytest.raises(ConfigError, match="checkpoint of method 'draft_model'"):
        make_engine(target, speculation={"method": "suffix", "draft_model": str(target)})
    engine = make_engine(target)  # suffix by default: a request may not ask for a draft model
    with pytest.raises(ConfigError, match="needs a draft checkpoint"):
        engine.open_state("a").generate(SamplingParams(max_tokens=2, speculation={"method": "draft_model"}))
    with pytest.raises(ConfigError, match="loaded once per engine"):
        engine.open_state("b").generate(SamplingParams(max_tokens=2, speculation=spec(target)))
    drafting = make_engine(target, speculation=spec(target))
    for same in (str(target) + "/", str(target) + "/."):  # the engine's directory, written otherwise
        out = drafting.open_state(same).generate(SamplingParams(max_tokens=2, speculation=spec(same, k=2)),
                                                 prompt=[5, 6, 7])
        assert len(out.token_ids) >= 1
    with pytest.raises(ConfigError, match="loaded once per engine"):
        drafting.open_state("c").generate(SamplingParams(max_tokens=2, speculation=spec(tiny_checkpoints["llama"])))


def test_drawn_drafts_of_the_target_itself_are_all_kept(tiny_checkpoints, make_engine):
    """Sampling without a seed, the draft model draws its drafts from its own distribution q and
    the target keeps each with probability min(1, p/q): drafting with the target's own checkpoint
    (q = p up to rounding) keeps them all, where its argmax would be kept only at the rate p gives
    it. A seeded request drafts the argmax (its tokens stay its own draws: the same as with
    speculation off)."""
    target = tiny_checkpoints["qwen3"]
    histories = prompts(3, seed=19)
    engine = make_engine(target, speculation=spec(target))
    generate_all(engine, histories, SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_k=50))
    drawn = engine.stats()
    assert drawn.draft_tokens_proposed > 40
    assert drawn.draft_tokens_accepted >= 0.97 * drawn.draft_tokens_proposed, drawn

    seeded = make_engine(target, speculation=spec(target))
    generate_all(seeded, histories, SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_k=50, seed=3))
    chosen = seeded.stats()
    assert chosen.draft_tokens_accepted < 0.8 * chosen.draft_tokens_proposed, chosen


# --- steps planned at k=0 run no draft forward; the draft model catches up when next asked -------

KV_ATOL = 1e-4
"""Float32 on the CPU: a token's KV computed in a catch-up of several tokens runs matmuls of other
shapes than a one-token decode, so its sums may round differently (tests/test_speculation.py's
bound); a KV row of a wrong token or position differs by ~1e-1."""


def draft_kv(drafter, key) -> tuple[list[int], torch.Tensor]:
    """The tokens the drafter's sequence for `key` holds and their KV [n, layers, 2, kv_heads, head_dim]."""
    seq = next(e.seq for e in drafter._states.values() if e.ref() is key)
    data, bs = drafter.kv_cache.data, drafter.kv_cache.block_size
    assert seq.num_computed == len(seq.tokens)
    return list(seq.tokens), torch.stack([data[:, :, seq.block_ids[p // bs], p % bs] for p in range(len(seq.tokens))])


def test_a_draft_model_skipped_for_steps_catches_up_in_one_forward(tiny_checkpoints, make_engine):
    """States whose step drafted nothing are not passed to the draft model; when next asked it
    computes the tokens it missed, every state's in one batched forward (a prefill of the tail,
    not a forward a token), and its KV is then what it holds when asked at every step."""
    target, draft = tiny_checkpoints["qwen3"], tiny_checkpoints["llama"]
    engine = make_engine(target)
    every, skipping = DraftModelDrafter(engine, model=str(draft)), DraftModelDrafter(engine, model=str(draft))
    rng = random.Random(21)
    histories = [tiny_models.random_tokens(rng, n) for n in (30, 45, 9)]
    keys = {every: [Key() for _ in histories], skipping: [Key() for _ in histories]}

    def ask(drafter, ks, which=(0, 1, 2)):
        return drafter.propose_many([DraftInput(histories[i], keys[drafter][i], 0) for i in which], ks)

    ask(every, [2, 2, 2])
    ask(skipping, [2, 2, 2])
    for step in range(12):
        for h in histories:
            h.extend(tiny_models.random_tokens(rng, 1 + step % 3))  # a decode, or accepted drafts
        ask(every, [2, 2, 2])
        if step == 5:  # a step where one state drafts and the others plan k=0
            assert ask(skipping, [2], which=(1,)) == [tiny_models.hf_greedy(draft, histories[1], 2)]
    missed = sum(1 + s % 3 for s in range(12))
    c = skipping.counters
    forwards, prefilled = c.forwards, c.tokens_prefilled
    got = ask(skipping, [3, 1, 2])
    assert got == [tiny_models.hf_greedy(draft, h, k) for h, k in zip(histories, (3, 1, 2))]
    assert c.forwards - forwards == 1 + 2  # one catch-up for all three, then two decode steps
    assert c.tokens_prefilled - prefilled == 3 * missed - sum(1 + s % 3 for s in range(6))
    for i, h in enumerate(histories):
        want_tokens, want = draft_kv(every, keys[every][i])
        tokens, kv = draft_kv(skipping, keys[skipping][i])
        assert tokens == want_tokens == h
        diff = (kv - want).abs().flatten(1).amax(1)  # [positions]
        assert diff.max() <= KV_ATOL, f"state {i}: draft KV differs at position {int(diff.argmax())}"


class PlanPattern:
    """The controller's plan replaced by a fixed cycle over its calls: no sequence drafts, no
    sequence drafts, every other one drafts, all draft (2 tokens, or what the plan may take). It
    records each plan and what each draft-model call was asked (its ks and forwards)."""

    CYCLE = ("none", "none", "some", "all")

    def __init__(self, engine) -> None:
        self.plans: list[list[int]] = []
        self.calls: list[tuple[list[int], int]] = []
        speculation = engine.scheduler.speculation
        self.drafter = drafter = speculation.drafter("draft_model")
        controller = speculation.controller
        controller.ceiling = lambda stats, tokens, sampling, most: 1  # each candidate may take 2
        controller.plan = self.plan
        propose_many = drafter.propose_many

        def spy(states, ks):
            before = drafter.counters.forwards
            out = propose_many(states, ks)
            self.calls.append((list(ks), drafter.counters.forwards - before))
            return out
        drafter.propose_many = spy

    def plan(self, candidates, step_tokens, num_sampling) -> list[int]:
        turn = self.CYCLE[len(self.plans) % len(self.CYCLE)]
        ks = [0 if turn == "none" or (turn == "some" and j % 2) else min(2, c.available)
              for j, c in enumerate(candidates)]
        self.plans.append(ks)
        return ks


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_steps_planned_at_k0_run_no_draft_forward_and_output_is_unchanged(tiny_checkpoints, make_engine, arch):
    """The adaptive controller alternating between k=0 and k>0, for all sequences of a step or
    some: the draft model runs only in steps where some sequence drafts, for those sequences
    only, in one catch-up forward and k - 1 decodes; greedy output is transformers' (drafts of
    the target itself, all kept; of another model, mostly rejected), and the draft KV after the
    catch-ups is what the draft model computes of each history afresh."""
    target, draft = tiny_checkpoints["qwen3"], tiny_checkpoints[arch]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    histories = prompts(3, seed=23)
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(draft)})
    spy = PlanPattern(engine)
    got = generate_all(engine, histories, params)
    assert got == generate_all(make_engine(target, speculation="off"), histories, params)
    for history, tokens in zip(histories, got):
        tiny_models.assert_greedy_matches(target, history, tokens)

    asked = [[k for k in ks if k] for ks in spy.plans if any(ks)]
    assert [ks for ks, _ in spy.calls] == asked  # no call for a step of k=0, no row for a k=0 sequence
    assert sum(not any(ks) and len(ks) == 3 for ks in spy.plans) >= 4  # steps of three, none drafting
    assert sum(0 < sum(map(bool, ks)) < len(ks) for ks in spy.plans) >= 2  # steps where some drafted
    assert all(forwards == max(ks) for ks, forwards in spy.calls)  # one catch-up forward, k - 1 decodes
    stats = engine.stats()
    assert spy.drafter.counters.tokens_drafted == stats.draft_tokens_proposed > 0
    if arch == "qwen3":
        assert stats.draft_tokens_accepted == stats.draft_tokens_proposed

    fresh = DraftModelDrafter(engine, model=str(draft))
    for i in range(len(histories)):
        key = engine.registry._entry(engine.open_state(f"agent-{i}")).seq
        tokens, kv = draft_kv(spy.drafter, key)
        again = Key()
        fresh.propose(DraftInput(tokens, again, 0), 1)  # its history in one prefill
        diff = (kv - draft_kv(fresh, again)[1]).abs().flatten(1).amax(1)
        assert diff.max() <= KV_ATOL, f"agent {i}: draft KV differs at position {int(diff.argmax())}"
