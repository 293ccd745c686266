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

import tiny_models
from hibana_core import SamplingParams
from hibana_core.errors import ConfigError
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


def test_adaptive_draft_model_proposes_what_can_pay_not_sixteen_forwards_a_step(tiny_checkpoints, make_engine):
    """A draft model whose drafts are rejected (another model's) costs a forward a drafted token:
    the adaptive controller asks it for what could pay, and one more, not for the most it could
    verify (15 forwards a step thrown away when the plan took none)."""
    target, draft = tiny_checkpoints["qwen3"], tiny_checkpoints["llama"]
    engine = make_engine(target, speculation={"method": "draft_model", "draft_model": str(draft)})
    generate_all(engine, prompts(1, seed=2), SamplingParams(max_tokens=48, ignore_eos=True))
    own = engine.stats().speculation["drafters"]["draft_model"]
    assert own["calls"] > 20 and own["tokens_drafted"] <= 3 * own["calls"], own


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
