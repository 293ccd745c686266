"""Outside audit of features combined, where the other tests mostly take them one at a time:
surgery (w4, w8, kv8, window) under speculation (oracle drafts with rejections, layer_skip, suffix),
with mixed per-request settings, seeded sampling with every warper and penalty, grammars, small
pools that park states to host memory and disk, async scheduling, cancellation inside accepted
drafts, and a GPTQ checkpoint serving agents over several turns.

A rewritten model is its own reference (transformers has no int4 or fp8 KV): the same engine, or
one of the same passes, with speculation off. A pre-quantized checkpoint is held to transformers'
greedy on its dequantized weights.
"""

from __future__ import annotations

import random
import threading

import pytest

from hibana_core import SamplingParams
from spec_drafters import OracleDrafter, registered
from test_audit_spec_windows import held_blocks, window_kv
from tiny_models import VOCAB_SIZE, agent_turn_plan, assert_greedy_matches, greedy_turns_at_once, random_tokens

pytestmark = pytest.mark.timeout(120)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def at_once(run, args: list) -> list:
    """run(*a) for every a in args, each on its own thread, all at once; their results in order."""
    out: dict[int, object] = {}

    def one(i: int) -> None:
        out[i] = run(*args[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(out) == list(range(len(args))), "a request did not finish"
    return [out[i] for i in range(len(args))]


@pytest.mark.filterwarnings("ignore:layer_skip keeps all")  # phi3's 2 layers: the self-draft keeps both
@pytest.mark.parametrize("arch, passes", [("gemma3", ["w4"]), ("qwen3_moe", ["w4"]), ("gpt_oss", ["w8", "kv8"]),
                                          ("phi3", ["w4", "kv8"])])
def test_rewritten_models_speculate_their_own_greedy_tokens_and_kv(arch, passes, tiny_checkpoints, make_engine):
    """w4 / w8 / kv8 on sliding-window, MoE and LongRoPE families, drafted by an oracle that errs
    at every fifth position (k 4 and 9) and by layer_skip, under async scheduling: the
    tokens, the blocks each state holds and the KV its windows hold are those of the same model
    run without speculation."""
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 5 == 3)
    with registered(oracle=oracle):
        engine = make_engine(tiny_checkpoints[arch], surgery=passes, surgery_guard=False, speculation="off",
                             async_scheduling=True)
    rng = random.Random(3)
    base = random_tokens(rng, 12)
    prompts = [base * 3, random_tokens(rng, 29)]
    for i, prompt in enumerate(prompts):
        ref = engine.open_state(f"off{i}").generate(greedy(20), prompt=prompt)
        oracle.add(prompt, ref.token_ids)
    specs = [{"method": "oracle", "k": 4}, {"method": "oracle", "k": 9}, {"method": "layer_skip", "k": 2}]
    got = at_once(lambda i, j: list(engine.open_state(f"on{i}-{j}").generate(
        greedy(20, speculation=specs[j]), prompt=prompts[i]).token_ids),
        [(i, j) for i in range(len(prompts)) for j in range(len(specs))])
    for (i, j), tokens in zip([(i, j) for i in range(len(prompts)) for j in range(len(specs))], got):
        want = list(engine.open_state(f"off{i}").tokens[len(prompts[i]):])
        assert tokens == want, (arch, passes, specs[j])
        assert window_kv(engine, f"on{i}-{j}")[:2] == window_kv(engine, f"off{i}")[:2]
        assert held_blocks(engine, f"on{i}-{j}") == held_blocks(engine, f"off{i}")
        if j < 2:  # the oracle's states: what the plain run's windows hold, theirs hold
            on, off = window_kv(engine, f"on{i}-{j}")[2], window_kv(engine, f"off{i}")[2]
            assert on.keys() == off.keys()
            assert all((on[key].float() - off[key].float()).abs().max() <= 1e-4 for key in off), (i, j)
    stats = engine.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed


def test_sampled_requests_with_every_warper_grammar_and_penalty_on_int4_experts_ignore_drafts(tiny_checkpoints,
                                                                                            make_engine):
    """Seeded sampling with min_p, presence and frequency penalties, a logit bias, a JSON schema, a
    regex, logprobs, and an unseeded greedy row with penalties, batched at once on a w4 MoE model
    under async scheduling: the oracle's drafts (wrong at every fourth position) change no token
    and no finish reason, and the logprobs only by float rounding (a verify step's rows are
    computed in one batch: ~1e-6 apart)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    settings = [dict(temperature=0.8, seed=1, presence_penalty=0.5, frequency_penalty=0.3, json_schema=schema),
                dict(temperature=1.2, top_k=20, top_p=0.8, min_p=0.05, seed=2, logit_bias={5: 5.0, 7: -100},
                     ignore_eos=True),
                dict(temperature=0.6, repetition_penalty=1.2, seed=3, logprobs=True, top_logprobs=2, ignore_eos=True),
                dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, regex=r"[a-z]{3,8}( [a-z]{2,6}){2,4}"),
                dict(temperature=0.9, seed=4, grammar='root ::= "yes" | "no" | "maybe " [a-z]+', min_p=0.1)]
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 4 == 2)
    with registered(oracle=oracle):
        engine = make_engine(tiny_checkpoints["qwen3_moe"], surgery=["w4"], surgery_guard=False,
                             speculation={"method": "oracle", "k": 5}, async_scheduling=True)
    rng = random.Random(8)
    base = random_tokens(rng, 10)
    histories = [base * 3, random_tokens(rng, 25), base[:4] * 6, random_tokens(rng, 20), random_tokens(rng, 18)]

    def run(i: int, spec):
        c = engine.open_state(f"{spec}-{i}").generate(SamplingParams(max_tokens=20, speculation=spec, **settings[i]),
                                                      prompt=histories[i])
        return list(c.token_ids), c.finish_reason, [l.logprob for l in c.logprobs or ()]

    want = at_once(run, [(i, "off") for i in range(len(settings))])
    for history, (tokens, _, _) in zip(histories, want):
        oracle.add(history, tokens)
    got = at_once(run, [(i, None) for i in range(len(settings))])
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for (_, _, logprobs), (_, _, wanted) in zip(got, want):
        assert logprobs == pytest.approx(wanted, abs=1e-4)
    assert len(want[2][2]) == 20
    stats = engine.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed


def test_agents_with_every_setting_at_once_through_host_and_disk_tiers(tiny_checkpoints, make_engine, tmp_path):
    """Six agents, three turns each, on Gemma 3 with w4 weights and an fp8 KV cache: per request
    another speculation setting (off, the engine's layer_skip, oracle k 3 and 7, suffix, adaptive,
    {"k": 4}), greedy, seeded, penalised and grammar-held requests side by side, four at a time in
    a pool of four blocks with a small host tier and a disk tier below it, async scheduling. Each
    turn's output is that of a plain engine of the same passes with a pool that holds everyone."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"]}
    specs = ["off", None, {"method": "oracle", "k": 3}, {"method": "oracle", "k": 7}, {"method": "suffix", "k": 2},
             "adaptive", {"k": 4}]
    kinds = [dict(ignore_eos=True), dict(temperature=0.8, seed=5, ignore_eos=True), dict(json_schema=schema),
             dict(temperature=1.0, top_k=10, seed=9, repetition_penalty=1.2, ignore_eos=True),
             dict(frequency_penalty=0.5, ignore_eos=True), dict(temperature=0.5, seed=1, regex="[a-z ]{5,30}")]
    rng = random.Random(11)
    plans = [[(random_tokens(rng, rng.randint(8, 30)), rng.randint(6, 14)) for _ in range(3)] for _ in kinds]
    path, passes = tiny_checkpoints["gemma3"], ["w4", "kv8"]
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 4 == 3)
    with registered(oracle=oracle):
        engine = make_engine(path, surgery=passes, surgery_guard=False, speculation={"method": "layer_skip", "k": 2},
                             num_blocks=4, state_dir=tmp_path, host_kv_bytes=40_000, async_scheduling=True,
                             max_concurrent_agents=4)
    plain = make_engine(path, surgery=passes, surgery_guard=False, speculation="off")
    histories: list[list[int]] = [[] for _ in kinds]
    for turn in range(3):
        wants = []
        for a, kind in enumerate(kinds):
            histories[a] = histories[a] + plans[a][turn][0]
            w = plain.open_state(f"ref{a}-{turn}").generate(SamplingParams(max_tokens=plans[a][turn][1], **kind),
                                                            prompt=histories[a])
            wants.append((list(w.token_ids), w.finish_reason))
            oracle.add(histories[a], w.token_ids)

        def run(a: int):
            params = SamplingParams(max_tokens=plans[a][turn][1], speculation=specs[(a + turn) % len(specs)], **kinds[a])
            c = engine.open_state(f"agent{a}").generate(params, prompt=histories[a])
            return list(c.token_ids), c.finish_reason

        assert at_once(run, [(a,) for a in range(len(kinds))]) == wants, turn
        histories = [h + w[0] for h, w in zip(histories, wants)]
    stats = engine.stats()
    assert stats.host_tier["parks"] > 0 and stats.host_tier["spills"] > 0 and stats.host_tier["dropped"] == 0
    assert stats.draft_tokens_accepted > 0


def test_a_gptq_checkpoint_speculates_and_retains_transformers_tokens(tiny_checkpoints, make_engine, tmp_path):
    """A GPTQ checkpoint (int4 layers as they are) drafted by layer_skip on its own packed layers,
    three agents at once for three turns each in a pool that parks them: every turn is
    transformers' greedy on the dequantized weights, the later turns reusing the retained KV."""
    from test_prequantized import write_quantized

    reference = write_quantized(tiny_checkpoints["llama"], tmp_path / "gptq", "gptq")
    engine = make_engine(tmp_path / "gptq", speculation={"method": "layer_skip", "k": 3}, num_blocks=20)
    agents = greedy_turns_at_once(engine, "g", [agent_turn_plan(40 + a, turns=3) for a in range(3)])
    for turns in agents:
        for history, completion in turns:
            assert_greedy_matches(reference, history, completion.token_ids)
    stats = engine.stats()
    assert stats.prompt_tokens_reused > 0 and stats.host_tier["parks"] > 0 and stats.draft_tokens_proposed > 0


def test_a_stream_closed_inside_accepted_drafts_leaves_a_rewritten_state_that_goes_on_exactly(tiny_checkpoints,
                                                                                          make_engine):
    """w4 weights and an fp8 KV cache on Gemma 3, drafts of 8 accepted in runs: a stream closed
    after a few tokens leaves the state holding the plain run's tokens up to where it stopped, no
    KV past them, and a next turn equal to a fresh prefill of that history."""
    oracle = OracleDrafter(VOCAB_SIZE, wrong=lambda p: p % 5 == 3)
    with registered(oracle=oracle):
        engine = make_engine(tiny_checkpoints["gemma3"], surgery=["w4", "kv8"], surgery_guard=False,
                             speculation={"method": "oracle", "k": 8})
    rng = random.Random(9)
    for trial in range(4):
        prompt = random_tokens(rng, 20 + trial)
        ref = engine.open_state(f"ref{trial}").generate(greedy(40, speculation="off"), prompt=prompt)
        oracle.add(prompt, ref.token_ids)
        h = engine.open_state(f"cut{trial}")
        events = h.stream(greedy(40), prompt=prompt)
        for n, _ in enumerate(events, 1):
            if n >= 3 + 4 * trial:
                break
        events.close()
        held = h.tokens
        assert held[:len(prompt)] == prompt and held[len(prompt):] == list(ref.token_ids[:len(held) - len(prompt)])
        seq = engine.registry._entry(h).seq
        assert seq.num_computed <= len(seq.tokens)
        assert list(h.generate(greedy(6)).token_ids) == \
            list(engine.open_state(f"fresh{trial}").generate(greedy(6, speculation="off"), prompt=held).token_ids)
    assert engine.stats().draft_tokens_accepted > 0



def test_chat_timeouts_inside_drafted_turns_put_an_fp8_state_back(make_engine, tmp_path):
    """A Qwen3-style chat checkpoint with an fp8 KV cache, suffix drafts of 6 under async
    scheduling: chat calls that run past their timeout while drafts are verified leave the state as
    it was each time, and the turn after them is the one the same conversation gets without them."""
    from hibana_core.errors import ChatTimeoutError
    from reasoning_model import make_reasoning_checkpoint

    engine = make_engine(make_reasoning_checkpoint(tmp_path / "chat"), surgery=["kv8"], surgery_guard=False,
                         speculation={"method": "suffix", "k": 6}, async_scheduling=True)
    ask = [{"role": "user", "content": "Repeat: alpha beta gamma alpha beta gamma alpha beta gamma"}]

    def conversation(name: str, timeouts: tuple[float, ...]):
        chat = engine.chat(name)
        first = chat.respond(ask, params=SamplingParams(max_tokens=20, ignore_eos=True))
        again = ask + [{"role": "assistant", "content": first.text},
                       {"role": "user", "content": "again, longer: alpha beta gamma delta alpha beta gamma delta"}]
        held = chat.handle.tokens
        for timeout in timeouts:
            with pytest.raises(ChatTimeoutError):
                chat.respond(again, params=SamplingParams(max_tokens=800, ignore_eos=True), timeout=timeout)
            assert chat.handle.tokens == held
        last = chat.respond(again, params=SamplingParams(max_tokens=30, ignore_eos=True))
        return last.text, chat.handle.tokens

    assert conversation("timed-out", (0.02, 0.05, 0.1)) == conversation("plain", ())
    assert engine.stats().draft_tokens_proposed > 0
