"""The state-handle API: prefix sharing, fork / truncate / sync edits, save / load, stream, bookkeeping.

Every greedy output is held to a fresh state on the same history and to transformers' generate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import threading
import time
import typing
from concurrent.futures import ThreadPoolExecutor

import pytest

import hibana_core
from hibana_core import (Completion, ConfigError, ContextLengthError, RequestStats, SamplingParams, StateFileError,
                         StateInfo, StreamEvent, SyncStats, TokenLogprob)
from tiny_models import ARCHS, VOCAB_SIZE, assert_greedy_matches, random_tokens

BLOCK = 16
N = 20  # tokens generated per check

pytestmark = pytest.mark.timeout(300)


def greedy(n: int = N, **options) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **options)


def check_output(engine, path, history: list[int], got: list[int], fresh_id: str) -> None:
    """`got` (from a reused / forked / edited state) must equal a fresh state's output and HF's."""
    fresh = engine.open_state(fresh_id)
    fresh.sync(history)
    assert fresh.tokens == history
    assert list(fresh.generate(greedy(len(got))).token_ids) == list(got), "differs from a fresh state"
    assert_greedy_matches(path, history, got)
    fresh.close()


# --- the public result types ---------------------------------------------------------------

PUBLIC_FIELDS = {
    "SyncStats": dict(reused=int, computed=int),
    "RequestStats": dict(prompt_tokens=int, reused=int, computed=int, generated=int,
                         time_to_first_token=float | None, elapsed=float, preemptions=int),
    "TokenLogprob": dict(token_id=int, logprob=float, top=tuple[tuple[int, float], ...]),
    "Completion": dict(token_ids=list[int], finish_reason=str, text=str, stats=RequestStats,
                       logprobs=list[TokenLogprob] | None, control_spans=tuple[tuple[int, int], ...] | None,
                       stop_string=str | None),
    "StreamEvent": dict(token_id=int | None, text=str, finish_reason=str | None,
                        completion=Completion | None, logprob=TokenLogprob | None,
                        control_spans=tuple[tuple[int, int], ...] | None),
    "StateInfo": dict(id=str, tokens=int, computed=int, blocks=int, tier=str, last_use=float,
                      busy=bool, pinned=bool, priority=int),
    "EngineStats": dict(prompt_tokens_computed=int, prompt_tokens_reused=int, generated_tokens=int,
                        steps=int, multi_sequence_steps=int, max_batch_sequences=int,
                        kv_blocks_total=int, kv_blocks_used=int, kv_blocks_cached=int, states=int, draft_tokens_proposed=int,
                        draft_tokens_accepted=int, verify_steps=int, verified_sequences=int,
                        verified_tokens=int, speculation=dict | None, parks=int, resumes=int,
                        host_tier=dict | None, requests_waiting=int, requests_running=int, step_seconds=float,
                        step_time_buckets=tuple[int, ...], pool_limited=int),
}
"""The stable API's result types (DESIGN.md, hibana_core/state.py): field names, order and types.
Adding, renaming or retyping a field is a conscious change of this table."""


def _matches(value, kind) -> bool:
    if isinstance(kind, type(int | None)):
        return any(_matches(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return type(value) is list and all(_matches(v, item) for v in value)
    if typing.get_origin(kind) is tuple:  # tuple[X, ...] or tuple[X, Y]
        items = typing.get_args(kind)
        if len(items) == 2 and items[1] is Ellipsis:
            return type(value) is tuple and all(_matches(v, items[0]) for v in value)
        return type(value) is tuple and len(value) == len(items) and all(map(_matches, value, items))
    return type(value) is kind  # exactly: no bool for int, no numpy or tensor scalars


def check_fields(obj) -> None:
    """Every field of a public result holds a value of its pinned type (nested results too)."""
    kinds = PUBLIC_FIELDS[type(obj).__name__]
    assert [f.name for f in dataclasses.fields(obj)] == list(kinds)
    for name, kind in kinds.items():
        value = getattr(obj, name)
        assert _matches(value, kind), f"{type(obj).__name__}.{name} = {value!r} is not {kind}"
        if dataclasses.is_dataclass(value):
            check_fields(value)


@pytest.mark.parametrize("name", list(PUBLIC_FIELDS))
def test_public_result_types_have_exactly_the_documented_fields(name):
    cls = getattr(hibana_core, name)
    assert name in hibana_core.__all__
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    assert [f.name for f in dataclasses.fields(cls)] == list(PUBLIC_FIELDS[name])
    assert typing.get_type_hints(cls) == PUBLIC_FIELDS[name]


def test_public_results_hold_values_of_their_types(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"])
    h = engine.open_state("typed")
    st = h.sync(random_tokens(random.Random(1), 20))
    check_fields(st)
    assert (st.reused, st.computed) == (0, 20)
    c = h.generate(greedy(4))
    check_fields(c)
    assert c.finish_reason == "length" and c.stats.prompt_tokens == 20 and c.stats.generated == 4
    events = list(h.stream(greedy(3)))
    for ev in events:
        check_fields(ev)
    events = list(h.stream(greedy(2, logprobs=True, top_logprobs=2)))
    for ev in events:
        check_fields(ev)
    for lp in events[-1].completion.logprobs:
        check_fields(lp)
    (info,) = engine.states()
    check_fields(info)
    assert (info.id, info.tokens, info.busy) == ("typed", 29, False)
    stats = engine.stats()
    check_fields(stats)
    assert stats.generated_tokens == 9 and stats.states == 1


# --- prefix sharing -------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [1, 50, 0], ids=["shares-1-token", "diverges-at-50", "fresh"])
def test_sync_takes_the_index_match_when_it_is_longer_than_the_states_own(shared, tiny_checkpoints,
                                                                         make_engine):
    """A state that shares a few tokens with the new history must not recompute what the prefix
    index holds (issue 11, defect 3: it reused 1 and computed 159 of a 160-token prompt)."""
    path = tiny_checkpoints["llama"]
    engine = make_engine(path)
    rng = random.Random(11)
    prompt = random_tokens(rng, 10 * BLOCK)
    engine.open_state("first").sync(prompt)
    h = engine.open_state("other")
    h.sync(prompt[:shared] + [(t + 1) % VOCAB_SIZE for t in random_tokens(rng, 30)])
    assert h.sync(prompt) == SyncStats(reused=160, computed=0)
    # and generation on it equals transformers' on the same history
    assert_greedy_matches(path, prompt, h.generate(greedy()).token_ids)



@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_shared_system_prefix_is_held_once(mode, tiny_checkpoints, make_engine):
    path = tiny_checkpoints["llama"]
    engine = make_engine(path, block_size=BLOCK)
    rng = random.Random(11)
    system = random_tokens(rng, 256)
    firsts = rng.sample(range(VOCAB_SIZE), 8)  # distinct first tail tokens: tails share no block
    tails = [[first] + random_tokens(rng, 19) for first in firsts]
    handles = [engine.open_state(f"agent-{i}") for i in range(8)]

    if mode == "sequential":
        stats = [h.sync(system + tail) for h, tail in zip(handles, tails)]
        assert (stats[0].reused, stats[0].computed) == (0, 276)
        for st in stats[1:]:
            assert (st.reused, st.computed) == (256, 20), st
        assert engine.stats().prompt_tokens_reused == 7 * 256
    else:
        start = threading.Barrier(8, timeout=60)

        def sync(i: int):
            start.wait()
            return handles[i].sync(system + tails[i])

        with ThreadPoolExecutor(8) as pool:
            stats = [f.result(timeout=120) for f in [pool.submit(sync, i) for i in range(8)]]
        for st in stats:
            assert st.reused + st.computed == 276, st

    for h, tail in zip(handles, tails):
        assert h.tokens == system + tail
    # 16 shared system blocks, then per agent one full tail block and one partial one (4 tokens)
    assert engine.stats().kv_blocks_used == 256 // BLOCK + 8 * 2
    assert engine.stats().kv_blocks_total >= engine.stats().kv_blocks_used

    c = handles[3].generate(greedy())
    assert_greedy_matches(path, system + tails[3], list(c.token_ids))


def test_memory_lists_blocks_shared_by_states_apart(tiny_checkpoints, make_engine):
    """A fork and a state with the same system prompt share blocks: each state's `bytes` are the
    blocks it alone holds (what closing it frees), its `shared` those it holds with others, and
    the device's `kv_shared` counts those once, so that the states' bytes add up to no more than
    `kv_used` (they were blocks x block bytes each, a shared block counted once per state)."""
    engine = make_engine(tiny_checkpoints["llama"], block_size=BLOCK, speculation="off")
    per_block = engine.kv_cache.bytes_per_block_here
    rng = random.Random(12)
    system = random_tokens(rng, 4 * BLOCK)
    a, b = engine.open_state("a"), engine.open_state("b")
    a.sync(system + random_tokens(rng, 2 * BLOCK))
    b.sync(system + random_tokens(rng, BLOCK + 3))
    a.fork("a-fork")

    def check():
        memory = engine.memory()
        device, states = memory["device"], memory["states"]
        assert sum(s["bytes"] for s in states.values()) <= device["kv_used"]
        assert sum(s["bytes"] for s in states.values()) + device["kv_shared"] == device["kv_used"]
        return states, device["kv_shared"]

    states, shared = check()
    assert states["a"] == states["a-fork"] == {"tier": "device", "tokens": 6 * BLOCK, "bytes": 0,
                                               "shared": 6 * per_block}
    assert states["b"] == {"tier": "device", "tokens": 5 * BLOCK + 3, "bytes": 2 * per_block,
                           "shared": 4 * per_block}
    assert shared == 6 * per_block  # the system prompt's blocks once, though three states hold them
    engine.open_state("a-fork").close()
    states, shared = check()
    assert (states["a"]["bytes"], states["a"]["shared"]) == (2 * per_block, 4 * per_block)
    assert shared == 4 * per_block


# --- fork, truncate, sync edits -------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_fork(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = make_engine(path)
    rng = random.Random(21)
    history = random_tokens(rng, 101)  # ends mid-block: both copies write into a shared block
    h = engine.open_state("parent")
    h.sync(history)
    g = h.fork("child")
    assert g.id == "child" and h.id == "parent"
    assert g.tokens == history and h.tokens == history

    out_g = list(g.generate(greedy()).token_ids)
    assert h.tokens == history, "generating on a fork must not touch the parent"
    out_h = list(h.generate(greedy()).token_ids)
    assert out_g == out_h
    check_output(engine, path, history, out_h, "fresh-0")

    # diverge: each appends different tokens, each must still match a fresh state
    g_new, h_new = random_tokens(rng, 13), random_tokens(rng, 29)
    g.append(g_new)
    h.append(h_new)
    g_hist, h_hist = history + out_g + g_new, history + out_h + h_new
    assert g.tokens == g_hist and h.tokens == h_hist
    out_g2 = list(g.generate(greedy()).token_ids)
    out_h2 = list(h.generate(greedy()).token_ids)
    check_output(engine, path, g_hist, out_g2, "fresh-1")
    check_output(engine, path, h_hist, out_h2, "fresh-2")


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = make_engine(path)
    rng = random.Random(31)
    h = engine.open_state("t")
    h.sync(random_tokens(rng, 150))
    h.generate(greedy())
    full = h.tokens

    for i, n in enumerate([137, 64, 3]):  # mid-block, on a block boundary, inside the first block
        h.sync(full)
        h.truncate(n)
        assert h.tokens == full[:n] and len(h) == n
        out = list(h.generate(greedy()).token_ids)
        assert h.tokens == full[:n] + out
        check_output(engine, path, full[:n], out, f"fresh-{i}")

    # appending after a truncate reuses what is left
    h.sync(full)
    h.truncate(100)
    new = random_tokens(rng, 30)
    st = h.append(new)
    assert st.reused + st.computed == 130
    assert st.computed <= len(new) + BLOCK, st
    out = list(h.generate(greedy()).token_ids)
    check_output(engine, path, full[:100] + new, out, "fresh-append")


@pytest.mark.parametrize("arch", ARCHS)
def test_sync_to_edited_history(arch, tiny_checkpoints, make_engine):
    path = tiny_checkpoints[arch]
    engine = make_engine(path)
    rng = random.Random(41)
    h = engine.open_state("e")
    h.sync(random_tokens(rng, 180))
    h.generate(greedy())
    full = h.tokens

    edited = list(full)
    edited[90] = (edited[90] + 1) % VOCAB_SIZE
    edited[91:91] = random_tokens(rng, 7)  # and an insertion right after it
    st = h.sync(edited)
    assert h.tokens == edited
    assert st.reused + st.computed == len(edited)
    assert 90 // BLOCK * BLOCK <= st.reused <= 90, st  # whole blocks before the edit are kept
    out = list(h.generate(greedy()).token_ids)
    check_output(engine, path, edited, out, "fresh-edit")

    # a history that shares nothing with the state
    other = random_tokens(random.Random(42), 60)
    other[0] = (edited[0] + 1) % VOCAB_SIZE
    st = h.sync(other)
    assert h.tokens == other and st.computed == 60
    out = list(h.generate(greedy()).token_ids)
    check_output(engine, path, other, out, "fresh-other")


# --- save / load ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_and_load_state(arch, tiny_checkpoints, make_engine, tmp_path):
    path = tiny_checkpoints[arch]
    engine = make_engine(path)
    rng = random.Random(51)
    h = engine.open_state("saver")
    h.sync(random_tokens(rng, 77))
    h.generate(greedy())
    tokens = h.tokens
    file = tmp_path / "saver.state"
    h.save(file)
    want = list(h.fork("saver-copy").generate(greedy()).token_ids)
    assert_greedy_matches(path, tokens, want)

    # into a fresh engine: nothing of the state is resident there
    other = make_engine(path)
    h2 = other.load_state(file)
    assert h2.tokens == tokens and len(h2) == len(tokens)
    restored = h2.generate(greedy())
    assert list(restored.token_ids) == want
    # the KV came from the file: only the last sampled token (never computed) is computed
    assert restored.stats.computed == 1 and restored.stats.reused == len(tokens) - 1

    # into the same engine, once the original is closed
    h.close()
    h3 = engine.load_state(str(file))
    assert h3.tokens == tokens
    assert list(h3.generate(greedy()).token_ids) == want


def test_a_state_files_checksum_reads_the_kv_without_copying_it():
    """The checksum hashes the KV's own buffer: it made a bytes copy of the whole KV (a state's
    size more host memory at every save and load), and its value is the one files carry."""
    import hashlib
    import json
    import tracemalloc

    import torch

    from hibana_core.kv import state_file

    kv = torch.randn(2, 2, 64, BLOCK, 8, 64)  # 8 MiB
    meta = {"format": state_file.FORMAT, "tokens": "[1, 2]"}
    tracemalloc.start()
    try:
        got = state_file._checksum(meta, kv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < kv.numel() * kv.element_size() // 8
    h = hashlib.blake2b(digest_size=32)  # as files written so far were checked
    h.update(json.dumps([meta.get(k) for k in state_file._CHECKED]).encode())
    h.update(json.dumps([str(kv.dtype), list(kv.shape)]).encode())
    h.update(kv.view(torch.uint8).numpy().tobytes())
    assert got == h.hexdigest()


@pytest.mark.parametrize("block_size", [8, 32])
def test_a_state_saved_in_other_blocks_keeps_its_kv(block_size, tiny_checkpoints, make_engine, tmp_path):
    """A state file of an engine with 16-token blocks loads into one with `block_size`-token blocks
    with its KV (re-cut into that engine's blocks), by load_state and from state_dir after a
    restart: only the last sampled token is computed, and greedy output is the saver's."""
    path = tiny_checkpoints["qwen3"]
    rng = random.Random(52)
    saver = make_engine(path, block_size=16, state_dir=str(tmp_path / "states"))
    h = saver.open_state("agent")
    h.sync(random_tokens(rng, 45))
    h.generate(greedy())
    tokens = h.tokens
    h.save(tmp_path / "agent.state")
    want = list(h.fork("agent-copy").generate(greedy()).token_ids)
    saver.close()  # persists "agent" in state_dir

    other = make_engine(path, block_size=block_size, state_dir=str(tmp_path / "states"))
    for handle in (other.load_state(tmp_path / "agent.state", state_id="loaded"), other.open_state("agent")):
        assert handle.tokens == tokens
        out = handle.generate(greedy())
        assert out.stats.computed == 1 and list(out.token_ids) == want
    assert_greedy_matches(path, tokens, want)


def check_stream_events(events: list) -> list[int]:
    """The tokens of a finished stream: one event per token, then exactly one final event (token_id
    None) with the finish reason and the completion, whose token ids are the streamed ones."""
    *tokens, final = events
    for ev in events:
        check_fields(ev)
    assert len(tokens) >= 2, "stream must yield as tokens are sampled, not once at the end"
    assert all(ev.token_id is not None and ev.finish_reason is None and ev.completion is None
               for ev in tokens)
    assert final.token_id is None and final.finish_reason == "length"
    streamed = [ev.token_id for ev in tokens]
    assert final.completion.token_ids == streamed and final.completion.stats.generated == len(streamed)
    return streamed


# --- stream ---------------------------------------------------------------------------------

def test_stream_yields_the_generated_tokens(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path)
    history = random_tokens(random.Random(61), 45)
    h = engine.open_state("s")
    h.sync(history)
    want = list(h.fork("s-copy").generate(greedy(24)).token_ids)

    events = list(h.stream(greedy(24)))
    streamed = check_stream_events(events)
    assert streamed == want
    assert h.tokens == history + want
    assert_greedy_matches(path, history, want)


async def test_astream_yields_the_generated_tokens(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path)
    history = random_tokens(random.Random(62), 45)
    h = engine.open_state("as")
    h.sync(history)
    want = list((await h.fork("as-copy").agenerate(greedy(24))).token_ids)

    streamed = check_stream_events([ev async for ev in h.astream(greedy(24))])
    assert streamed == want
    assert h.tokens == history + want
    assert_greedy_matches(path, history, want)


# --- bookkeeping ----------------------------------------------------------------------------

def test_open_state_is_get_or_create(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"])
    a = engine.open_state("a")
    a.sync([5, 6, 7])
    again = engine.open_state("a")
    assert again.id == "a" and again.tokens == [5, 6, 7]
    again.append([8])
    assert a.tokens == [5, 6, 7, 8], "both objects are the same state"
    b = engine.open_state("b")
    assert b.tokens == [] and len(b) == 0


def test_states_lists_handles(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"])
    assert engine.states() == []
    a, b = engine.open_state("a"), engine.open_state("b")
    a.sync(list(range(10, 40)))
    b.sync(list(range(10, 15)))
    infos = {s.id: s for s in engine.states()}
    assert set(infos) == {"a", "b"}
    for info in infos.values():
        check_fields(info)
    assert (infos["a"].tokens, infos["a"].computed, infos["a"].blocks, infos["a"].tier) == (30, 30, 2, "device")
    assert (infos["b"].tokens, infos["b"].busy) == (5, False)
    a.close()
    assert [s.id for s in engine.states()] == ["b"]


def test_len_and_tokens_is_a_copy(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"])
    h = engine.open_state("c")
    h.sync([1, 2, 3, 4])
    assert h.id == "c" and len(h) == 4 and list(h.tokens) == [1, 2, 3, 4]
    tokens = h.tokens
    if isinstance(tokens, list):
        tokens.append(9)
        tokens[0] = 7
    assert list(h.tokens) == [1, 2, 3, 4] and len(h) == 4


def test_match_state_picks_the_idle_state_with_the_longest_common_prefix(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"])
    base = list(range(10, 50))
    engine.open_state("short").sync(base[:10])
    engine.open_state("long").sync(base[:30] + [5, 6])
    engine.open_state("other").sync([7] + base[1:20])
    assert engine.match_state(base).id == "long"
    assert engine.match_state(base[:5]).id == "long"      # a tie: the most recently used wins
    assert engine.match_state([7, 8]).id == "other"
    assert engine.match_state([9, 9]) is None
    # min_shared: only a state whose history the tokens continue (enough of it)
    assert engine.match_state(base, min_shared=1.0).id == "short"  # "long" diverges at 30
    assert engine.match_state(base[:30] + [5, 6, 99], min_shared=1.0).id == "long"
    # the chat layer's candidates, best first: by the prefix shared, then the most recent use
    assert [h.id for h in engine.registry.matches(base, 3)] == ["long", "short"]
    assert [h.id for h in engine.registry.matches(base[:5], 1)] == ["long"]
    engine.open_state("short").sync(base[:10])  # used last now
    assert [h.id for h in engine.registry.matches(base[:5], 2)] == ["short", "long"]
    with engine.lease(base[:3]) as made:  # a state made for a call that named none, idle after it
        made.sync(base[:3])
    assert [h.id for h in engine.registry.matches(base[:5], 2, unnamed=True)] == [made.id]  # not "long"
    for limit in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="limit"):
            engine.registry.matches(base, limit)


def test_leases_keep_concurrent_calls_on_different_states(tiny_checkpoints, make_engine):
    from hibana_core import StateBusyError

    engine = make_engine(tiny_checkpoints["llama"])
    history = list(range(10, 60))
    engine.open_state("conv").sync(history)
    with engine.lease(history + [1, 2]) as first:
        assert first.id == "conv"
        with engine.lease(history + [1, 2]) as second:  # conv is held: a new state
            assert second.id != "conv"
            assert second.sync(history + [1, 2]).reused == 48  # yet it shares the full blocks
        with pytest.raises(StateBusyError):
            with engine.lease(state_id="conv"):
                pass
    with engine.lease(state_id="conv") as again:
        assert again.id == "conv"
    with engine.lease(history[:20] + [3]) as other:  # would wipe conv's history: not taken
        assert other.id != "conv"


def test_generate_with_a_prompt_syncs_and_generates_in_one_request(tiny_checkpoints, make_engine):
    path = tiny_checkpoints["qwen2"]
    engine = make_engine(path)
    history = random_tokens(random.Random(81), 50)
    h = engine.open_state("p")
    first = h.generate(greedy(8), prompt=history)
    assert first.stats.reused == 0 and first.stats.computed == 50
    assert_greedy_matches(path, history, first.token_ids)
    turn2 = h.tokens + random_tokens(random.Random(82), 12)
    second = h.generate(greedy(8), prompt=turn2)
    # the last sampled token and the 12 new ones; everything else was resident
    assert second.stats.computed == 13 and second.stats.reused == len(turn2) - 13
    assert_greedy_matches(path, turn2, second.token_ids)
    assert h.tokens == turn2 + list(second.token_ids)


def test_shared_engines_are_one_per_model_and_options(tiny_checkpoints):
    from hibana_core import Engine

    path = str(tiny_checkpoints["qwen3"])
    a = Engine.shared(path, device="cpu", num_blocks=64, progress=False)
    try:
        assert Engine.shared(path, device="cpu", num_blocks=64, progress=False) is a
        # whether loading draws bars is no other engine (ChatHibana(model=X) and one with
        # engine_kwargs={"progress": False} loaded the weights twice)
        assert Engine.shared(path, device="cpu", num_blocks=64) is a
        b = Engine.shared(path, device="cpu", num_blocks=32, progress=False)
        assert b is not a
        b.close()
        a.close()
        assert Engine.shared(path, device="cpu", num_blocks=64, progress=False) is not a  # reloaded
    finally:
        Engine.shared(path, device="cpu", num_blocks=64, progress=False).close()


def test_shared_engines_are_one_per_meaning_of_the_options(tiny_checkpoints):
    """Options that mean the same engine find it: speculation False and "off", a dict in another
    key order (two adapters' engine_kwargs); before, each loaded the model again."""
    from hibana_core import Engine

    path = str(tiny_checkpoints["qwen3"])
    options = dict(device="cpu", num_blocks=64, progress=False)
    off = Engine.shared(path, speculation=False, **options)
    ngram = Engine.shared(path, speculation={"method": "ngram", "k": 3}, **options)
    try:
        assert Engine.shared(path, speculation="off", **options) is off
        assert Engine.shared(path, **options, speculation={"k": 3, "method": "ngram"}) is ngram
        assert ngram is not off
    finally:
        off.close()
        ngram.close()


def test_without_prefix_caching_states_share_nothing(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], enable_prefix_caching=False)
    system = list(range(1, 65))
    stats = [engine.open_state(f"a{i}").sync(system + [100 + i]) for i in range(3)]
    assert [s.computed for s in stats] == [65, 65, 65]
    assert engine.stats().kv_blocks_used == 3 * 5
    h = engine.open_state("a0")
    assert h.append([7, 8]).computed == 2  # a state still keeps its own KV


def test_an_async_stream_whose_event_loop_closed_does_not_stop_the_engine(tiny_checkpoints, make_engine):
    import asyncio

    engine = make_engine(tiny_checkpoints["qwen2"])
    history = random_tokens(random.Random(91), 30)

    async def start_and_leave():
        engine.open_state("orphan").astream(greedy(200), prompt=history)  # never iterated

    asyncio.run(start_and_leave())  # the loop closes while the request runs
    h = engine.open_state("after")
    out = h.generate(greedy(8), prompt=history)
    assert len(out.token_ids) == 8
    assert engine.open_state("orphan").tokens[:30] == history  # its state stays consistent


def test_states_made_for_unnamed_calls_are_bounded(tiny_checkpoints, make_engine):
    """`lease` without an id makes a state per new conversation; of those, at most
    max_unnamed_states idle ones stay (the least recently used are closed), never counting or
    closing one a call holds, and never a named one."""
    engine = make_engine(tiny_checkpoints["llama"], max_unnamed_states=2)
    named = engine.open_state("named")
    named.sync(random_tokens(random.Random(0), 20))
    made = []
    with engine.lease(random_tokens(random.Random(1), 20)) as held:
        held.sync(random_tokens(random.Random(1), 20))
        for i in range(2, 7):
            prompt = random_tokens(random.Random(i), 20)
            with engine.lease(prompt) as h:
                h.sync(prompt)
                made.append(h)
        assert {s.id for s in engine.states()} == {"named", held.id, made[-2].id, made[-1].id}
        assert all(h.closed for h in made[:-2]) and not named.closed
    with engine.lease(random_tokens(random.Random(9), 20)) as new:
        # held (used longest ago) and made[-2] closed: made[-1] and the new one remain
        assert {s.id for s in engine.states()} == {"named", made[-1].id, new.id}


def test_unnamed_states_over_the_bound_close_when_their_calls_end(tiny_checkpoints, make_engine):
    """Concurrent calls may hold more unnamed states than max_unnamed_states; once they end, only
    that many idle ones stay (the least recently used are closed), not until the next new call."""
    engine = make_engine(tiny_checkpoints["llama"], max_unnamed_states=2)
    with contextlib.ExitStack() as stack:
        held = []
        for i in range(5):
            prompt = random_tokens(random.Random(i), 20)
            held.append(stack.enter_context(engine.lease(prompt)))
            held[-1].sync(prompt)
        assert len(engine.states()) == 5  # all busy: none is closed under a call
    assert {s.id for s in engine.states()} == {held[-2].id, held[-1].id}


def test_a_stream_stopped_early_still_ends_with_its_completion(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"])
    h = engine.open_state("a")
    prompt = random_tokens(random.Random(4), 30)
    # max_tokens far past what the engine makes while a loaded machine's reader is held up (the
    # engine's thread runs ahead of it): the stop lands before the request could end by itself
    events = h.stream(greedy(900), prompt=prompt)
    seen = [next(events).token_id for _ in range(3)]
    events.stop()
    rest = list(events)
    final = rest[-1]
    assert final.token_id is None and final.finish_reason == "cancelled"
    got = seen + [e.token_id for e in rest[:-1]]
    assert final.completion.token_ids == got and final.completion.stats.prompt_tokens == len(prompt)
    assert h.tokens == prompt + got


@pytest.mark.parametrize("speculation", ["off", "adaptive"])
def test_close_frees_weights_and_kv_while_the_engine_is_still_referenced(speculation, tiny_checkpoints,
                                                                         make_engine):
    """A program (or a benchmark) that closes an engine and opens the next gets the memory back
    at close, even where something still holds the closed engine: the next engine sizes its
    KV pool from the memory free at that moment."""
    import gc
    import weakref

    engine = make_engine(tiny_checkpoints["llama"], speculation=speculation)
    h = engine.open_state("a")
    h.generate(greedy(4), prompt=random_tokens(random.Random(0), 20))
    kv = weakref.ref(engine.kv_cache)
    weight = weakref.ref(next(engine.model.parameters()))
    engine.close()
    gc.collect()
    assert kv() is None and weight() is None, "the engine object is alive, its tensors must not be"
    assert engine.stats is not None and h is not None  # both still referenced here


def test_every_call_on_a_closed_engine_is_an_engine_closed_error(tiny_checkpoints, make_engine, tmp_path):
    """load_state read the cache's shape before it looked whether the engine was open (an
    AttributeError on the dropped cache)."""
    from hibana_core.errors import EngineClosedError

    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off")
    h = engine.open_state("a")
    h.sync(random_tokens(random.Random(1), 20))
    h.save(tmp_path / "a.state")
    engine.close()
    for name, call in {"load_state": lambda: engine.load_state(tmp_path / "a.state", state_id="b"),
                       "open_state": lambda: engine.open_state("c"), "chat": lambda: engine.chat("d").respond(
                           [{"role": "user", "content": "hi"}])}.items():
        with pytest.raises(EngineClosedError, match="closed"):
            call()


def test_close_empties_the_weights_even_where_something_holds_the_model(tiny_checkpoints, make_engine):
    """On the H200 a closed CUDA engine's model stayed referenced (graphs and speculation on) and
    its 61 GB of weights with it: close() now empties every weight of the model, whoever holds it.
    A transformers model the engine was made from keeps its own weights (the engine copies them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hibana_core import Engine

    path = tiny_checkpoints["qwen3_moe"]
    engine = make_engine(path, speculation="adaptive")
    engine.open_state("a").generate(greedy(4), prompt=random_tokens(random.Random(0), 20))
    held = engine.model  # as a leaked reference would
    engine.close()
    assert all(t.numel() == 0 for t in [*held.parameters(), *held.buffers()])

    hf = AutoModelForCausalLM.from_pretrained(path)
    before = {name: t.clone() for name, t in hf.state_dict().items()}
    with Engine.from_hf_model(hf, None, device="cpu", progress=False) as from_hf:
        from_hf.open_state("b").generate(greedy(2), prompt=[5, 6, 7])
    after = hf.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_close_frees_weights_without_the_garbage_collector(tiny_checkpoints, make_engine):
    """The runner's CUDA graphs point back at it without a reference cycle, so close() frees the
    weights at once (the GPU's second engine of a benchmark ran out of memory while a cycle kept
    the first one's weights until the collector ran). The graphs are built here on the CPU: their
    buffers need no GPU, and no capture happens before a step."""
    import gc
    import weakref

    from hibana_core.runner import DecodeGraphs

    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    runner = engine.core.runner
    runner.graphs = DecodeGraphs(runner, 4)
    weight = weakref.ref(next(engine.model.parameters()))
    del runner
    gc.disable()
    try:
        engine.close()
        assert weight() is None
    finally:
        gc.enable()


def test_a_failed_graph_capture_runs_the_step_without_a_graph(tiny_checkpoints, make_engine, monkeypatch, caplog):
    """A capture that raises (on the GPU: another thread's forbidden call, a synchronisation)
    does not fail the step: it runs eagerly on the same static inputs, the failure is logged, the
    next step of that shape captures again, and after MAX_CAPTURE_FAILURES that shape stays
    eager. The bookkeeping is exercised on the CPU with a stand-in graph (bench/gpu_correctness.py
    `graph_capture` makes real captures fail on the GPU)."""
    import torch

    from hibana_core.runner import DecodeGraphs

    class Graph:
        replays = 0

        def pool(self):  # as torch's after a failed capture
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture")

        def replay(self):
            Graph.replays += 1

    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    graphs = DecodeGraphs(engine.core.runner, 4)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    eager, captured = torch.full((1, 3), 7.0), torch.full((1, 3), 9.0)
    monkeypatch.setattr(graphs, "_forward", lambda bucket, q, span: eager)
    outcomes = iter([RuntimeError("capture invalidated"), captured,
                     RuntimeError("invalidated"), RuntimeError("invalidated again")])

    def capture(graph, bucket, q, span):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(graphs, "_capture", capture)
    with caplog.at_level("WARNING", logger="hibana.runner"):
        assert graphs._replay(1, 1, 1024) is eager  # failed: eager
        assert graphs._replay(1, 1, 1024) is captured and Graph.replays == 1  # captured on the next step
        assert graphs._replay(1, 1, 1024) is captured and Graph.replays == 2
        assert graphs._replay(2, 1, 1024) is eager and graphs._replay(2, 1, 1024) is eager  # two failures
        assert graphs._replay(2, 1, 1024) is eager  # that shape stays eager: no third capture
    assert graphs.failures == {(2, 1, 1024): 2, (1, 1, 1024): 1} and set(graphs.graphs) == {(1, 1, 1024)}
    assert len(graphs.failed_graphs) == 3 and graphs.mempool is None
    assert "capture invalidated" in caplog.text and "from now on" in caplog.text
    engine.close()


def test_decode_graphs_are_keyed_by_the_span_their_attention_splits_for(tiny_checkpoints, make_engine,
                                                                           monkeypatch):
    """A step's graph is the one of the shortest span (DecodeGraphs.SPANS, then max_model_len)
    covering its longest sequence, and that graph's attention is captured for that span (the
    decode kernel splits for it: fewer empty programs at short contexts). Exercised on the CPU
    with a stand-in for the capture."""
    import contextlib

    from hibana_core.runner import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "SPANS", (256, 512))  # the tiny model's context is 1024 positions
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    graphs = DecodeGraphs(engine.core.runner, 4)
    assert graphs.spans == [256, 512, 1024]
    assert graphs.key(1, 1, 1) == (1, 1, 256) and graphs.key(1, 1, 256) == (1, 1, 256)
    assert graphs.key(3, 2, 257) == (4, 2, 512) and graphs.key(2, 17, 1024) == (2, 17, 1024)
    short = DecodeGraphs(make_engine(tiny_checkpoints["llama"], speculation="off", max_model_len=300).core.runner, 1)
    assert short.spans == [256, 300] and short.key(1, 1, 299) == (1, 1, 300)

    seen = []
    forward_batch = graphs.runner.ctx.forward_batch

    @contextlib.contextmanager
    def recording(batch):
        seen.append(batch.max_seq_len)
        with forward_batch(batch):
            yield

    monkeypatch.setattr(graphs.runner.ctx, "forward_batch", recording)
    logits = graphs._forward(1, 1, 512)
    assert seen == [512] and logits.shape[0] == 1


def test_a_state_loaded_while_running_requests_hold_the_pool_keeps_its_tokens(tiny_checkpoints, make_engine,
                                                                              tmp_path):
    """An outside tester: load_state while another agent's running request held most of a small
    pool (no host tier) was a MemoryBudgetError pointing at idle states there were none of, where a
    request in the same spot waits for room. The state now holds its tokens, its KV computed at its
    next request, and generates what a state that never left would."""
    engine = make_engine(tiny_checkpoints["qwen3"], speculation="off", block_size=16, num_blocks=10,
                         host_kv_bytes=0)
    rng = random.Random(0)
    history = random_tokens(rng, 60)
    a = engine.open_state("a")
    a.sync(history)
    a.save(tmp_path / "a.state")
    a.close()
    busy = engine.open_state("busy")
    events = busy.stream(SamplingParams(max_tokens=40, ignore_eos=True), prompt=random_tokens(rng, 100))
    next(iter(events))  # running: 7 of the 10 blocks held
    loaded = engine.load_state(tmp_path / "a.state", state_id="a2")
    assert loaded.tokens == history
    for _ in events:
        pass
    out = loaded.generate(greedy(6))
    fresh = engine.open_state("fresh")
    assert out.token_ids == fresh.generate(greedy(6), prompt=history).token_ids


@pytest.mark.parametrize("host_kv_bytes", [0, 1 << 20], ids=["no host tier", "host tier"])
def test_a_loaded_state_longer_than_the_pool_is_refused_at_its_request(tiny_checkpoints, make_engine, tmp_path,
                                                                        host_kv_bytes):
    """A state saved by an engine of a larger pool holds a history this pool cannot hold whole: its
    generation is a MemoryBudgetError that says to shorten it, before anything moves (it parked
    the other agents' KV first, then failed saying to close idle states), and truncated it runs."""
    from hibana_core import MemoryBudgetError

    path = tiny_checkpoints["llama"]
    history = random_tokens(random.Random(3), 150)  # 10 blocks
    big = make_engine(path, speculation="off").open_state("big")
    big.sync(history)
    big.save(tmp_path / "big.state")
    engine = make_engine(path, speculation="off", num_blocks=6, host_kv_bytes=host_kv_bytes)
    other = engine.open_state("other")
    other.sync(random_tokens(random.Random(4), 40))
    loaded = engine.load_state(tmp_path / "big.state")
    with pytest.raises(MemoryBudgetError, match="shorten the history"):
        loaded.generate(greedy(4))
    assert loaded.tokens == history
    assert {info.id: info.tier for info in engine.states()}["other"] == "device"
    loaded.truncate(80)
    assert_greedy_matches(path, history[:80], loaded.generate(greedy(4)).token_ids)


def test_graphs_are_captured_ahead_for_every_span_and_draft_length(tiny_checkpoints, make_engine, monkeypatch):
    """`EngineCore.capture_graphs` captures the graphs a workload's steps may take before any step
    does (since graphs are keyed by span, a conversation crossing a span captured one per draft
    length inside its turns): every span, the buckets up to the sequences asked, the query-length
    tiers up to the drafts asked (None: every tier), none twice, none given up on; and the engine
    captures one sequence's at start-up for its default speculation. Exercised on the CPU with a
    stand-in for the capture."""
    from hibana_core.runner import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "SPANS", (256, 512))  # the tiny model's context is 1024 positions
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    graphs = engine.core.runner.graphs = DecodeGraphs(engine.core.runner, 8)
    replayed = []

    def replay(bucket, q, span):
        assert graphs.seq_lens[:bucket].tolist() == [q] * bucket  # inputs that write nowhere
        assert (graphs.slot_mapping[:, :bucket * q] == -1).all()
        replayed.append((bucket, q, span))
        graphs.graphs[(bucket, q, span)] = (None, None)

    monkeypatch.setattr(graphs, "_replay", replay)
    spans = (256, 512, 1024)
    assert engine.core.capture_graphs(1, 0) == 3 and replayed == [(1, 1, s) for s in spans]
    replayed.clear()
    graphs.failures[(1, 5, 512)] = DecodeGraphs.MAX_CAPTURE_FAILURES  # given up on: stays eager
    assert engine.core.capture_graphs(1, 4) == 8  # tiers 2, 3, 5 at three spans, less the eager one
    assert replayed == [(1, q, s) for q in (2, 3, 5) for s in spans if (q, s) != (5, 512)]
    replayed.clear()
    # buckets 1, 2, 4 x every tier x three spans, less those captured and the eager one
    assert engine.core.capture_graphs(3, None) == 3 * 6 * 3 - 3 - 8 - 1
    assert {b for b, _, _ in replayed} == {1, 2, 4} and {q for _, q, _ in replayed} == set(DecodeGraphs.QUERY_LENS)
    assert engine.core.capture_graphs(3, None) == 0
    engine.close()

    captured = []
    monkeypatch.setattr(DecodeGraphs, "capture", lambda self, sequences, drafts: captured.append((sequences, drafts)))
    monkeypatch.setattr(DecodeGraphs, "profile", lambda self, num_tokens: False)  # the profile's steps run eagerly
    from hibana_core import runner as runner_module

    monkeypatch.setattr(runner_module.ModelRunner, "__init__", _runner_with_graphs(runner_module.ModelRunner.__init__))
    for speculation, drafts in (("off", 0), ("adaptive", None), ({"method": "suffix", "k": 4}, 4)):
        captured.clear()
        make_engine(tiny_checkpoints["llama"], speculation=speculation).close()
        assert captured == [(1, drafts)], speculation


def _runner_with_graphs(init):
    """ModelRunner.__init__ that gives a CPU runner its DecodeGraphs (the engine's start-up asks
    for its captures; on the CPU there are none)."""
    def wrapped(self, *args, **kwargs):
        from hibana_core.runner import DecodeGraphs

        init(self, *args, **kwargs)
        self.graphs = DecodeGraphs(self, 4)
    return wrapped


def test_text_decoded_on_the_callers_side_is_the_engine_threads():
    """A request without stop strings is detokenized as its caller reads the events (the engine
    thread hands over token ids), one with stop strings on the engine thread: the events' text and
    control spans, and the completion's, are the same either way, an ended-by-stop-token turn's
    stop token left out of the text, for streams and generate alike (the demo model's chat
    markup: control tokens among the text)."""
    import random

    from hibana_core import Engine, SamplingParams

    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off") as engine:
        tokenizer = engine.tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        never = ["\x00no such text\x00"]
        for seed in range(4):
            rng = random.Random(seed)
            params = dict(max_tokens=rng.choice([5, 40, 120]), temperature=rng.choice([0.0, 1.0]), seed=seed)
            runs = []
            for stop in ([], never):
                h = engine.open_state(f"detok-{seed}-{len(stop)}")
                events = list(h.stream(SamplingParams(**params, stop=stop), prompt=prompt))
                h.close()
                final = events[-1].completion
                runs.append(([(e.token_id, e.text, e.control_spans) for e in events],
                             (final.token_ids, final.text, final.control_spans, final.finish_reason)))
            assert runs[0] == runs[1], seed
            h = engine.open_state(f"detok-gen-{seed}")
            done = h.generate(SamplingParams(**params), prompt=prompt)
            h.close()
            assert (done.token_ids, done.text, done.control_spans) == runs[0][1][:3]


def test_save_paths_as_a_user_writes_them(tiny_checkpoints, make_engine, tmp_path, monkeypatch):
    """An outside tester: save() replaced a FIFO or device node with a regular file, replaced a
    symlink rather than writing its target, made a folder literally named `~`, and wrote a file
    for "dir/name/". Now: `~` is the home folder, a link's target is written (the link stays), a
    path that is not a regular file or that ends with a separator is a StateFileError."""
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    h = engine.open_state("a")
    h.sync([5, 6, 7, 8])
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h.save("~/states/a.state")
    assert (tmp_path / "home" / "states" / "a.state").is_file()
    assert engine.load_state("~/states/a.state", "b").tokens == [5, 6, 7, 8]

    target, link = tmp_path / "target.state", tmp_path / "link.state"
    link.symlink_to(target)
    h.save(link)
    assert link.is_symlink() and target.is_file()
    assert engine.load_state(link, "c").tokens == [5, 6, 7, 8]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(StateFileError, match="not a regular file"):
        h.save(fifo)
    assert fifo.exists() and not fifo.is_file()
    with pytest.raises(StateFileError, match="ends with a separator"):
        h.save(str(tmp_path / "new") + "/")
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="share is True or False"):
        engine.load_state(target, "d", share="yes")


def test_an_empty_prompt_on_an_empty_state_says_so(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    h = engine.open_state("empty")
    with pytest.raises(ContextLengthError, match="the prompt given is empty"):
        h.generate(SamplingParams(max_tokens=3), prompt=[])
    with pytest.raises(ContextLengthError, match="holds no tokens") as caught:
        h.generate(SamplingParams(max_tokens=3))
    assert "prompt given" not in str(caught.value)
    h.sync([3, 4, 5])  # a state that holds tokens is not said to hold none
    with pytest.raises(ContextLengthError, match=r"prompt=\[\] would make state 'empty' \(holding 3 tokens\) an "
                                                 "empty history.*leave prompt out"):
        h.generate(SamplingParams(max_tokens=3), prompt=[])
    assert h.tokens == [3, 4, 5]


def test_a_states_last_use_is_in_unix_seconds(tiny_checkpoints, make_engine):
    """`StateInfo.last_use` was the monotonic clock's reading (41661.68 beside time.time()'s 1.8e9),
    a unit said nowhere; it is when a call last used the state, as the server's `last_used_at`."""
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    before = time.time()
    engine.open_state("clock").sync([3, 4, 5])
    (info,) = [info for info in engine.states() if info.id == "clock"]
    assert before - 1 <= info.last_use <= time.time() + 1


def test_sync_stats_unpack_as_the_pair_design_names(tiny_checkpoints, make_engine):
    engine = make_engine(tiny_checkpoints["llama"], speculation="off")
    h = engine.open_state("pair")
    reused, computed = h.sync([3, 4, 5])
    assert (reused, computed) == (0, 3) and tuple(h.sync([3, 4, 5, 6])) == (3, 1)
