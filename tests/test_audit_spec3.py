"""Outside audit of adaptive speculation (issue 13), third round: a closed engine asked for a
drafter, the controller after a start-up profile that other work slowed throughout, and checks
that passed (LongRoPE switched inside verify steps with rejections, a draft model of another family
with fewer positions, seeded sampling with every warper and penalty under a draft model, a draft
model's drawn drafts in distribution with min_p and a logit bias, gpt-oss windows and sinks after
rejections).

Drafts come from the oracle (tests/spec_drafters.py), which proposes the continuation a run
without speculation produced, so that drafts are accepted on random tiny models.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from hibana_core import EngineClosedError, SamplingParams, StateClosedError
from hibana_core.speculation.controller import AcceptanceStats, Candidate, Controller, StepCostModel
from spec_drafters import OracleDrafter, registered
from tiny_models import (ODD_SHAPES, VOCAB_SIZE, assert_greedy_matches, make_config, make_tiny_checkpoint,
                         open_engine, random_tokens)

pytestmark = pytest.mark.timeout(120)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


# --- a closed engine asked for a drafter ------------------------------------------------------------

@pytest.mark.parametrize("asked", ["adaptive", {"k": 2}, {"method": "draft_model"}, {"method": "layer_skip"}])
def test_a_closed_engine_says_so_before_a_drafter_is_built_for_a_request(tiny_checkpoints, monkeypatch, asked):
    """After close() the drafters are gone with the engine. A request naming speculation built its
    drafter again first: the engine's draft model loaded its weights anew and failed as its factory
    ('fix its plugin'), layer_skip said the model was no decoder it knows (a ConfigError each).
    The engine says it is closed, as a request without speculation hears, and nothing is loaded."""
    from hibana_core.speculation import draft_model

    path = tiny_checkpoints["qwen3"]
    engine = open_engine(path, speculation={"method": "draft_model", "draft_model": str(path), "k": 2})
    handle = engine.open_state("a")
    handle.generate(greedy(2), prompt=[5, 6, 7])
    engine.close()
    loads = []
    monkeypatch.setattr(draft_model, "load_model", lambda *a, **k: loads.append(a))
    with pytest.raises(EngineClosedError):
        handle.generate(greedy(2, speculation=asked), prompt=[5, 6, 7])
    assert loads == [] and engine.scheduler.speculation._drafters == {}


def test_a_closed_state_says_so_before_a_drafter_is_built_for_it(tiny_checkpoints):
    """A closed state's request that names a drafter not built yet (layer_skip ranks the model's
    layers to build) hears StateClosedError without that work, and the engine builds nothing."""
    engine = open_engine(tiny_checkpoints["qwen3"], speculation="off")
    try:
        handle = engine.open_state("a")
        handle.close()
        with pytest.raises(StateClosedError):
            handle.generate(greedy(2, speculation={"method": "layer_skip"}), prompt=[5, 6, 7])
        assert "layer_skip" not in engine.scheduler.speculation._drafters
        assert list(engine.open_state("b").generate(greedy(3), prompt=[5, 6, 7]).token_ids)  # still serves
    finally:
        engine.close()


# --- the step-cost model after a disturbed start-up profile ----------------------------------------

POINTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def flat(n: int) -> float:
    """A small model on a device where a step reads its weights once: extra tokens nearly free."""
    return 1e-3 + 1e-5 * n


def steep(n: int) -> float:
    """A compute-bound device: a token costs a step."""
    return 1e-3 * n


def kept(rate: float) -> AcceptanceStats:
    """An agent whose drafts of 16 are kept at `rate` at every position given the ones before
    (1.0, or 0.5: runs of kept drafts as long as the trailing zero bits of 1, 2, 3, ...)."""
    stats = AcceptanceStats(AcceptanceStats())
    for i in range(1, 1025):
        stats.record(16, 16 if rate == 1.0 else min(16, (i & -i).bit_length() - 1))
    return stats


def planned(profile: list[float], device, rate: float, steps: int = 200) -> list[int]:
    """The controller's draft length for one agent, step after step, each step timed on `device`
    (as the engine's steps refine the model)."""
    costs = StepCostModel(POINTS, profile, sync_overhead=1e-4)
    controller, stats, ks = Controller(costs), kept(rate), []
    for _ in range(steps):
        k = controller.plan([Candidate(stats, 16, None)], 1, 1)[0]
        ks.append(k)
        costs.observe(1 + k, device(1 + k))
    return ks


@pytest.mark.parametrize("profile, device, rate, best", [
    ([16e-3 * n for n in POINTS], flat, 1.0, 16),  # every timing 16x slow: drafted nothing for good
    ([0.14] * len(POINTS), steep, 0.5, 0),         # 140 ms a step whatever its tokens: drafted 3 for good
], ids=["slowed in proportion", "slowed alike"])
def test_a_start_up_profile_slowed_throughout_is_corrected_by_the_steps_that_run(profile, device, rate, best):
    """A start-up profile taken while other work ran slowed every timing, the one-token step's
    too. The steps the engine ran corrected only the points of their own sizes: slowed in
    proportion (16 ms a token against 1 ms), the bound that n tokens cost at most n one-token
    steps made every other point proportional to tokens once decode steps had timed the first,
    so no draft paid, no verify step ran to time them, and a drafter whose every draft is kept
    drafted nothing for good (on this 2-core machine an engine's oracle, every draft kept,
    drafted 0 or 1 tokens a step); slowed alike (140 ms a step), the first verify step's time
    became every smaller step's, one-token steps never ran to correct it, and drafts that cost
    more than they keep stayed. A first timing far below the profile now marks it disturbed:
    the points no step timed are guessed optimistically until a step times them. The plan ends
    where a clean profile's ends."""
    clean = planned([device(n) for n in POINTS], device, rate)
    ks = planned(profile, device, rate)
    assert clean[-20:] == [best] * 20
    assert ks[-20:] == [best] * 20, ks[:40]


def test_a_clean_profile_is_refined_by_smoothing_as_before():
    """A profile the device agrees with is refined as before (no timing is far below it): a
    compute-bound device's steps cost a step a token, and drafting never pays there."""
    costs = StepCostModel(POINTS, [steep(n) for n in POINTS], sync_overhead=1e-4)
    for n in (1, 2, 17, 1, 1):
        costs.observe(n, 1.05 * steep(n))
    assert [costs.cost(n, False) for n in POINTS] == pytest.approx([steep(n) for n in POINTS], rel=0.02)
    assert Controller(costs).plan([Candidate(kept(1.0), 16, None)], 1, 1) == [0]


# --- checks that passed ---------------------------------------------------------------------------

SWITCH = 64


@pytest.fixture(scope="module")
def phi3_switching(tmp_path_factory):
    """Phi-3 with LongRoPE whose switch (original_max_position_embeddings) is 64."""
    return make_tiny_checkpoint("phi3", tmp_path_factory.mktemp("phi3_switch"), original_max_position_embeddings=SWITCH)


def test_longrope_switched_inside_drafted_turns_with_rejections_is_transformers(phi3_switching):
    """Histories that cross Phi-3's LongRoPE switch while drafts of 8 are verified, every fourth
    draft wrong (a rejection next to the switch), async scheduling: each turn and the one after it
    (its KV recomputed under the long factors once) are transformers' greedy tokens."""
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 4 == 2)
    with registered(oracle=oracle):
        engine = open_engine(phi3_switching, speculation={"method": "oracle", "k": 8}, async_scheduling=True)
    try:
        rng = random.Random(5)
        for n in (58, 62):
            prompt = random_tokens(rng, n)
            ref = engine.open_state(f"ref{n}")
            want = list(ref.generate(greedy(14, speculation="off"), prompt=prompt).token_ids)
            oracle.add(prompt, want)
            h = engine.open_state(f"on{n}")
            assert list(h.generate(greedy(14), prompt=prompt).token_ids) == want
            history = h.tokens + [7, 8]
            nxt = list(ref.generate(greedy(6, speculation="off"), prompt=history).token_ids)
            oracle.add(history, nxt)
            assert list(h.generate(greedy(6), prompt=history).token_ids) == nxt
            assert_greedy_matches(phi3_switching, prompt, want)
            assert_greedy_matches(phi3_switching, history, nxt)
        stats = engine.stats()
        assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed
    finally:
        engine.close()


def test_a_draft_model_of_another_family_with_fewer_positions(tiny_checkpoints, tmp_path):
    """A llama draft model (another seed, the target's tokenizer, 64 positions) for the qwen3
    target: histories that outgrow its positions get no drafts (counted as skipped), nothing
    fails, and output is the one without speculation, greedy and seeded."""
    target = tiny_checkpoints["qwen3"]
    draft = make_tiny_checkpoint("llama", tmp_path / "short", seed=77, max_position_embeddings=64,
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    engine = open_engine(target, speculation={"method": "draft_model", "draft_model": str(draft), "k": 3},
                         async_scheduling=True)
    try:
        rng = random.Random(9)
        for n in (30, 58, 90):
            prompt = random_tokens(rng, n)
            for extra in ({}, dict(temperature=0.9, seed=4)):
                want = engine.open_state(f"off{n}{extra}").generate(greedy(16, speculation="off", **extra), prompt=prompt)
                got = engine.open_state(f"on{n}{extra}").generate(greedy(16, **extra), prompt=prompt)
                assert list(got.token_ids) == list(want.token_ids), (n, extra)
        speculation = engine.stats().speculation
        assert speculation["drafter_errors"] == {}
        assert speculation["drafters"]["draft_model"]["skipped"] > 0 and engine.stats().draft_tokens_proposed > 0
    finally:
        engine.close()


def test_seeded_requests_with_every_warper_and_penalty_under_a_draft_model(tiny_checkpoints):
    """The target drafting for itself: seeded requests take its drafts as chosen ones (kept where
    their own draw equals them), so min_p, top-k, top-p, penalties and a logit bias give the same
    tokens with speculation on and off."""
    path = tiny_checkpoints["qwen3"]
    engine = open_engine(path, speculation={"method": "draft_model", "draft_model": str(path), "k": 4})
    try:
        prompt = random_tokens(random.Random(4), 24)
        settings = [dict(temperature=1.0, min_p=0.1, logit_bias={7: 3.0, 11: -100.0}),
                    dict(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.7),
                    dict(temperature=1.3, repetition_penalty=1.3, min_p=0.05)]
        for i, setting in enumerate(settings):
            params = greedy(24, seed=10 + i, **setting)
            want = engine.open_state(f"off{i}").generate(dataclasses.replace(params, speculation="off"), prompt=prompt)
            got = engine.open_state(f"on{i}").generate(params, prompt=prompt)
            assert list(got.token_ids) == list(want.token_ids), setting
        assert engine.stats().draft_tokens_accepted > 0
    finally:
        engine.close()


V = 24
PROMPT = [3, 17, 5, 9, 12, 20]


def test_a_draft_models_drawn_drafts_keep_the_distribution_under_min_p_and_a_logit_bias(tmp_path):
    """A draft model of another seed (q != p) draws its drafts for unseeded requests under the
    request's warpers and bias; kept at min(1, p/q), else drawn from max(0, p - q): the first two
    tokens follow the target's distribution after its bias and min_p (24-token vocabulary, 2048
    requests)."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine
    from hibana_core.sampler import apply_logit_bias, apply_warpers

    def save(seed: int, name: str, **config):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(make_config("llama", **{"vocab_size": V, "num_hidden_layers": 2,
                                                                       **config}), dtype=torch.float32).eval()
        model.save_pretrained(tmp_path / name)
        return model, tmp_path / name

    model, target = save(5, "target")
    _, draft = save(9, "draft", num_hidden_layers=1)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, min_p=0.1, logit_bias={1: 2.0, 2: -100.0})

    def expected(context: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + context])).logits[:, -1].float()
        return apply_warpers(apply_logit_bias(logits, [params]), [params]).double().softmax(-1)[0].numpy()

    def check(samples: list[int], p: np.ndarray, what: str) -> None:
        counts = np.bincount(samples, minlength=V)
        assert not counts[p <= 1e-12].any(), f"{what}: tokens the target never draws"
        big = p * len(samples) >= 5
        observed = np.append(counts[big], counts[~big].sum())
        wanted = np.append(p[big], p[~big].sum()) * len(samples)
        assert chisquare(observed[wanted > 0], wanted[wanted > 0]).pvalue > 1e-4, what

    states = 256
    engine = Engine.from_pretrained(str(target), device="cpu", dtype="float32", block_size=16, num_blocks=2 * states + 16,
                                    max_concurrent_agents=states, progress=False, seed=3,
                                    speculation={"method": "draft_model", "draft_model": str(draft), "k": 2})
    try:
        handles = [engine.open_state(f"s{i}") for i in range(states)]
        outs = []
        for _ in range(8):
            streams = [h.stream(params, prompt=PROMPT) for h in handles]
            outs += [list(list(s)[-1].completion.token_ids) for s in streams]
        stats = engine.stats()
    finally:
        engine.close()
    assert stats.speculation["drawn_or_chosen"].get("drawn", 0) > 0 and stats.draft_tokens_accepted > 0
    p1 = expected([])
    check([o[0] for o in outs], p1, "t1")
    a = int(p1.argmax())
    check([o[1] for o in outs if o[0] == a], expected([a]), "t2 | t1 = a")


def test_gpt_oss_windows_and_sinks_hold_what_a_plain_run_holds_after_rejections(tmp_path):
    """gpt-oss with odd shapes (window 8, shorter than a block; attention sinks): drafts of 16
    and 5 with every seventh wrong, turns ended by max_tokens and a stop token inside drafts. The
    state holds the tokens, computed count, blocks per layer group and KV of every position its
    windows keep that a run without speculation holds."""
    from test_audit_spec_windows import held_blocks, window_kv

    path = make_tiny_checkpoint("gpt_oss", tmp_path / "gpt_oss", seed=41, **ODD_SHAPES["gpt_oss"])
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 7 == 5)
    with registered(oracle=oracle):
        engine = open_engine(path, max_model_len=80)
    try:
        rng = random.Random(12)
        checked = 0
        for i, n in enumerate((23, 38)):
            prompt = random_tokens(rng, n)
            ref = list(engine.open_state(f"ref{i}").generate(greedy(40, speculation="off"), prompt=prompt).token_ids)
            oracle.add(prompt, ref)
            for j, params in enumerate([greedy(13), SamplingParams(max_tokens=40, stop_token_ids=[ref[11]])]):
                for k in (16, 5):
                    name = f"{i}-{j}-{k}"
                    want = engine.open_state(f"off{name}").generate(dataclasses.replace(params, speculation="off"),
                                                                     prompt=prompt)
                    got = engine.open_state(f"on{name}").generate(
                        dataclasses.replace(params, speculation={"method": "oracle", "k": k}), prompt=prompt)
                    assert (list(got.token_ids), got.finish_reason) == (list(want.token_ids), want.finish_reason)
                    tokens, computed, kv = window_kv(engine, f"on{name}")
                    want_tokens, want_computed, want_kv = window_kv(engine, f"off{name}")
                    assert (tokens, computed) == (want_tokens, want_computed), name
                    assert held_blocks(engine, f"on{name}") == held_blocks(engine, f"off{name}"), name
                    for key, row in want_kv.items():
                        assert key in kv and (kv[key] - row).abs().max() <= 1e-4, (name, key)
                        checked += 1
        stats = engine.stats()
        assert stats.draft_tokens_proposed > stats.draft_tokens_accepted > 20 and checked > 100
    finally:
        engine.close()
