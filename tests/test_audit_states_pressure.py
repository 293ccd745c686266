"""The state-handle API of DESIGN.md under a small memory budget (an outside tester's audit): states
swapped to the host and disk tiers between turns, then forked, truncated, saved, pinned, closed,
streamed, cancelled and driven from asyncio. Greedy output must equal transformers' generate on the
full history (tiny seeded qwen3) or the same engine with a large budget (the bundled demo model),
and engine.stats() / engine.memory() must agree with engine.states() afterwards."""

from __future__ import annotations

import asyncio
import pathlib
import random
import threading
import time

import pytest

from hibana_core import HibanaError, SamplingParams, StateBusyError, StateClosedError, StateFileError
from tiny_models import assert_greedy_matches, make_tiny_checkpoint, open_engine, random_tokens

pytestmark = pytest.mark.timeout(120)

GEN = 5
BLOCK_BYTES = 2 * 2 * 16 * 2 * 32 * 4  # qwen3 tiny: 2 layers, K+V, 16 rows, 2 KV heads, head_dim 32, float32


def greedy(n: int = GEN, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny seeded random qwen3 checkpoint, written with save_pretrained."""
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("pressure") / "qwen3")


def pressured(path, tmp_path, blocks=14, host_states=1.0, **kw):
    """An engine whose device pool holds 2-3 agents of ~60-90 tokens, a host tier of about
    `host_states` such states, and a disk tier under tmp_path."""
    options = dict(num_blocks=blocks, speculation="off", state_dir=tmp_path / "states",
                   host_kv_bytes=int(host_states * 6 * BLOCK_BYTES), max_concurrent_agents=4)
    options.update(kw)
    return open_engine(path, **options)


def tiers(engine) -> dict[str, str]:
    return {info.id: info.tier for info in engine.states()}


def check_accounting(engine) -> None:
    """stats(), memory() and states() tell one story."""
    stats, memory, infos = engine.stats(), engine.memory(), engine.states()
    tier = stats.host_tier
    by_tier = {}
    for info in infos:
        by_tier.setdefault(info.tier, []).append(info)
    assert stats.states == len(infos)
    assert tier["bytes_used"] <= tier["budget_bytes"]
    assert memory["host"]["kv_parked"] == tier["bytes_used"]
    assert memory["disk"]["kv_parked"] == tier["disk_bytes_used"]
    assert tier["disk_states"] == len(by_tier.get("disk", []))
    assert tier["states"] >= len(by_tier.get("host", []))
    for info in infos:
        if info.tier in ("host", "disk", "none"):
            assert info.blocks == 0 and info.computed == 0, info
        if info.tier == "device":
            assert info.blocks > 0, info
    assert stats.kv_blocks_used <= stats.kv_blocks_total
    assert stats.kv_blocks_used <= sum(info.blocks for info in infos) + stats.kv_blocks_cached
    assert engine.pool.num_used <= sum(info.blocks for info in infos)
    on_host = sum(s["bytes"] for s in memory["states"].values() if s["tier"] == "host")
    assert on_host + memory["host"]["kv_shared"] == tier["bytes_used"]
    on_disk = sum(s["bytes"] for s in memory["states"].values() if s["tier"] == "disk")
    assert on_disk + memory["disk"]["kv_shared"] == tier["disk_bytes_used"]


# --- many agents, interleaved turns -------------------------------------------------------------


def test_twelve_agents_round_robin_through_every_tier(qwen3, tmp_path):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(1)
        hs = [engine.open_state(f"agent-{i}") for i in range(12)]
        histories = [random_tokens(rng, rng.randint(30, 50)) for _ in hs]
        seen = set()
        for turn in range(3):
            order = list(range(12))
            rng.shuffle(order)
            for i in order:
                prompt = histories[i] + random_tokens(rng, rng.randint(3, 9))
                done = hs[i].generate(greedy(), prompt=prompt)
                assert_greedy_matches(str(qwen3), prompt, done.token_ids)
                histories[i] = prompt + list(done.token_ids)
                assert hs[i].tokens == histories[i]
                if turn:  # a parked state comes back by copy: only its new tokens are computed
                    assert done.stats.computed <= len(prompt) - done.stats.reused
                seen.update(tiers(engine).values())
                check_accounting(engine)
        assert {"device", "host", "disk"} <= seen, seen
        stats = engine.stats()
        assert stats.parks >= 12 and stats.host_tier["spills"] >= 1 and stats.host_tier["disk_resumes"] >= 1
        assert stats.host_tier["dropped"] == 0
        for h, history in zip(hs, histories):
            assert h.tokens == history


def test_a_turn_after_park_computes_only_its_new_tokens(qwen3, tmp_path):
    """Every agent's second turn after it went to host or disk: reused covers its whole old history."""
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(2)
        hs = [engine.open_state(f"a{i}") for i in range(8)]
        for h in hs:
            h.generate(greedy(), prompt=random_tokens(rng, 40))
        where = tiers(engine)
        assert "disk" in where.values() and "host" in where.values(), where
        for h in hs:
            before = h.tokens
            prompt = before + random_tokens(rng, 4)
            done = h.generate(greedy(), prompt=prompt)
            # the last generated token has no KV yet: it and the 4 new ones are computed
            assert done.stats.computed == 5, (h.id, where[h.id], done.stats)
            assert_greedy_matches(str(qwen3), prompt, done.token_ids)


# --- fork / truncate / save of a swapped-out state ----------------------------------------------


def _park_all_but_last(engine, rng, n=6, length=40):
    hs = [engine.open_state(f"p{i}") for i in range(n)]
    for h in hs:
        h.generate(greedy(), prompt=random_tokens(rng, length))
    return hs


@pytest.mark.parametrize("where", ["host", "disk"])
def test_fork_of_a_swapped_out_state_then_both_branches_diverge(qwen3, tmp_path, where):
    with pressured(qwen3, tmp_path, host_states=3 if where == "host" else 0.0) as engine:
        rng = random.Random(3)
        hs = _park_all_but_last(engine, rng)
        parent = next(h for h in hs if tiers(engine)[h.id] == where)
        base = parent.tokens
        twin = parent.fork(parent.id + "-twin")
        assert twin.tokens == base and tiers(engine)[twin.id] == where
        check_accounting(engine)
        a, b = base + random_tokens(rng, 5), base[:-7] + random_tokens(rng, 3)
        done_b = twin.generate(greedy(), prompt=b)
        done_a = parent.generate(greedy(), prompt=a)
        assert_greedy_matches(str(qwen3), a, done_a.token_ids)
        assert_greedy_matches(str(qwen3), b, done_b.token_ids)
        # the parent's twin wrote its own KV: continuing the parent again still matches
        more = parent.tokens + random_tokens(rng, 2)
        assert_greedy_matches(str(qwen3), more, parent.generate(greedy(), prompt=more).token_ids)
        more = twin.tokens + random_tokens(rng, 2)
        assert_greedy_matches(str(qwen3), more, twin.generate(greedy(), prompt=more).token_ids)
        check_accounting(engine)


@pytest.mark.parametrize("where", ["host", "disk"])
@pytest.mark.parametrize("cut", [1, 16, 33, 44])
def test_truncate_of_a_swapped_out_state_then_continue(qwen3, tmp_path, where, cut):
    with pressured(qwen3, tmp_path, host_states=3 if where == "host" else 0.0) as engine:
        rng = random.Random(4)
        hs = _park_all_but_last(engine, rng)
        h = next(h for h in hs if tiers(engine)[h.id] == where)
        base = h.tokens
        h.truncate(cut)
        assert h.tokens == base[:cut]
        check_accounting(engine)
        done = h.generate(greedy())
        assert_greedy_matches(str(qwen3), base[:cut], done.token_ids)
        assert done.stats.computed <= 1 + (cut % 16 if cut >= 16 else cut)  # the rest came back by copy
        check_accounting(engine)


@pytest.mark.parametrize("where", ["host", "disk"])
def test_save_of_a_swapped_out_state_loads_into_a_fresh_engine(qwen3, tmp_path, where):
    engine = pressured(qwen3, tmp_path, host_states=3 if where == "host" else 0.0)
    rng = random.Random(5)
    try:
        hs = _park_all_but_last(engine, rng)
        h = next(h for h in hs if tiers(engine)[h.id] == where)
        base = h.tokens
        h.save(tmp_path / "saved.state")
        assert tiers(engine)[h.id] == where  # saving does not bring it back
    finally:
        engine.close()
    with pressured(qwen3, tmp_path / "fresh") as fresh:
        for i in range(3):  # fill the fresh pool first: the load has to evict or park
            fresh.open_state(f"f{i}").generate(greedy(), prompt=random_tokens(rng, 60))
        loaded = fresh.load_state(tmp_path / "saved.state")
        assert loaded.id == h.id and loaded.tokens == base
        prompt = base + random_tokens(rng, 3)
        done = loaded.generate(greedy(), prompt=prompt)
        assert done.stats.computed == 4, done.stats
        assert_greedy_matches(str(qwen3), prompt, done.token_ids)
        check_accounting(fresh)


# --- pins -----------------------------------------------------------------------------------------


def test_pins_under_a_full_budget(qwen3, tmp_path):
    """Pinned states stay on the device while others leave; pinning every state never blocks a
    request; pinning a parked state is harmless; unpin lets it go."""
    with pressured(qwen3, tmp_path, blocks=12, pin_budget=0.5) as engine:
        rng = random.Random(6)
        hs = [engine.open_state(f"s{i}") for i in range(3)]
        for h in hs:
            h.generate(greedy(), prompt=random_tokens(rng, 40))   # 3 blocks each: the pool is full-ish
        hs[2].pin()
        assert tiers(engine)["s2"] == "device"
        for i in range(3, 7):
            engine.open_state(f"s{i}").generate(greedy(), prompt=random_tokens(rng, 40))
            assert tiers(engine)["s2"] == "device"
        parked = next(h for h in hs[:2] if tiers(engine)[h.id] != "device")
        parked.pin()  # pinned while parked: it comes back at its next turn and then stays
        for info in engine.states():
            engine.open_state(info.id).pin()
        # everything pinned, the budget exceeded: a new, bigger request still runs (pins give way)
        big = random_tokens(rng, 120)
        done = engine.open_state("big").generate(greedy(), prompt=big)
        assert_greedy_matches(str(qwen3), big, done.token_ids)
        for info in engine.states():
            h = engine.open_state(info.id)
            prompt = h.tokens + [1, 2]
            assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(2), prompt=prompt).token_ids)
            h.unpin()
        check_accounting(engine)


def test_a_history_larger_than_the_pool_with_everything_pinned_is_a_clear_error(qwen3, tmp_path):
    with pressured(qwen3, tmp_path, blocks=8) as engine:
        rng = random.Random(7)
        h = engine.open_state("pinned")
        h.generate(greedy(), prompt=random_tokens(rng, 40))
        h.pin()
        other = engine.open_state("other")
        from hibana_core import MemoryBudgetError

        with pytest.raises(MemoryBudgetError, match="memory_budget|kv_device_blocks|num_blocks"):
            other.generate(greedy(), prompt=random_tokens(rng, 16 * 8 + 1))
        assert other.tokens == [] and tiers(engine)["pinned"] == "device"
        prompt = h.tokens + [3]
        assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(), prompt=prompt).token_ids)


# --- close while streaming; the same handle twice -------------------------------------------------


def test_closing_a_state_while_its_stream_runs(qwen3, tmp_path):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(8)
        bystanders = _park_all_but_last(engine, rng, n=4)
        h = engine.open_state("victim")
        events = h.stream(greedy(200), prompt=random_tokens(rng, 30))
        got = []
        for ev in events:
            if ev.token_id is not None:
                got.append(ev.token_id)
            if len(got) == 3:
                h.close()
                break
        list(events)  # a closed stream ends, it does not hang
        assert h.closed
        with pytest.raises(StateClosedError):
            h.tokens
        assert "victim" not in tiers(engine)
        again = engine.open_state("victim")
        assert again.tokens == []
        for b in bystanders:
            prompt = b.tokens + [4, 5]
            assert_greedy_matches(str(qwen3), prompt, b.generate(greedy(), prompt=prompt).token_ids)
        check_accounting(engine)


def test_closing_a_state_from_another_thread_while_it_streams(qwen3, tmp_path, join_all):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(9)
        h = engine.open_state("victim")
        started, result = threading.Event(), {}

        def reader():
            try:
                n = 0
                for ev in h.stream(greedy(300), prompt=random_tokens(rng, 30)):
                    n += 1
                    started.set()
                    result["last"] = ev
            except BaseException as exc:  # noqa: BLE001
                result["error"] = exc
            started.set()

        t = threading.Thread(target=reader)
        t.start()
        assert started.wait(30)
        h.close()
        join_all([t], 30)
        err = result.get("error")
        assert err is None or isinstance(err, HibanaError), repr(err)
        if err is None:
            assert result["last"].finish_reason == "cancelled", result["last"]
        assert engine.pool.num_used == 0 or all(info.id != "victim" for info in engine.states())
        check_accounting(engine)


def test_two_generates_on_one_handle_at_once_are_refused_or_serialised(qwen3, tmp_path, join_all):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(10)
        h = engine.open_state("shared")
        base = random_tokens(rng, 30)
        h.sync(base)
        outcomes, barrier = [], threading.Barrier(4)

        def call():
            barrier.wait()
            try:
                outcomes.append(("ok", h.generate(greedy(8))))
            except StateBusyError as exc:
                outcomes.append(("busy", exc))
            except BaseException as exc:  # noqa: BLE001
                outcomes.append(("other", exc))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        join_all(threads, 60)
        kinds = [k for k, _ in outcomes]
        assert "other" not in kinds, outcomes
        assert kinds.count("ok") >= 1
        # whatever ran, the state is one consistent history that greedy continues exactly
        tokens = h.tokens
        assert tokens[:30] == base and len(tokens) == 30 + 8 * kinds.count("ok")
        # every generated stretch is transformers' continuation of what came before it
        assert_greedy_matches(str(qwen3), base, tokens[30:])
        more = h.generate(greedy())
        assert_greedy_matches(str(qwen3), tokens, more.token_ids)


# --- asyncio under pressure, cancellation and reuse -----------------------------------------------


def test_async_agents_under_pressure(qwen3, tmp_path):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(11)
        plans = {f"as{i}": [random_tokens(rng, rng.randint(20, 40))] + [random_tokens(rng, 4) for _ in range(2)]
                 for i in range(10)}
        record = []

        async def agent(state_id, plan):
            h = engine.open_state(state_id)
            history = []
            for j, new in enumerate(plan):
                prompt = history + new
                if j % 2:
                    toks = []
                    async for ev in h.astream(greedy(), prompt=prompt):
                        if ev.token_id is not None:
                            toks.append(ev.token_id)
                else:
                    toks = list((await h.agenerate(greedy(), prompt=prompt)).token_ids)
                record.append((prompt, toks))
                history = prompt + toks

        async def main():
            await asyncio.wait_for(asyncio.gather(*(agent(k, v) for k, v in plans.items())), 90)

        asyncio.run(main())
        assert len(record) == 30
        for prompt, toks in record:
            assert_greedy_matches(str(qwen3), prompt, toks)
        assert engine.stats().parks > 0
        check_accounting(engine)


def test_cancelled_async_streams_under_pressure_then_reuse(qwen3, tmp_path):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(12)
        prompts = {f"c{i}": random_tokens(rng, 40) for i in range(6)}

        read = {s: 0 for s in prompts}

        async def reader(state_id):
            h = engine.open_state(state_id)
            async for ev in h.astream(greedy(60), prompt=prompts[state_id]):
                read[state_id] += 1

        async def main():
            tasks = [asyncio.ensure_future(reader(s)) for s in prompts]
            deadline = time.monotonic() + 30
            while min(read.values()) < 3 and time.monotonic() < deadline:  # all six under way (4 slots)
                await asyncio.sleep(0.005)
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert min(read.values()) >= 3, read
            assert any(isinstance(r, asyncio.CancelledError) for r in results), results

        asyncio.run(main())
        deadline = time.monotonic() + 20
        while any(info.busy for info in engine.states()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for state_id, prompt in prompts.items():
            h = engine.open_state(state_id)
            tokens = h.tokens
            assert tokens[:40] == prompt
            assert_greedy_matches(str(qwen3), prompt, tokens[40:])  # what it kept is exact
            more = tokens + [9]
            assert_greedy_matches(str(qwen3), more, h.generate(greedy(), prompt=more).token_ids)
        check_accounting(engine)
        for info in engine.states():
            engine.open_state(info.id).close()
        assert engine.pool.num_used == 0
        tier = engine.stats().host_tier
        assert tier["bytes_used"] == 0 and tier["disk_bytes_used"] == 0 and tier["disk_states"] == 0


def test_a_sync_stream_cancelled_under_pressure_then_reused(qwen3, tmp_path):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(13)
        others = _park_all_but_last(engine, rng, n=4)
        h = engine.open_state("cut")
        prompt = random_tokens(rng, 50)
        events = h.stream(greedy(300), prompt=prompt)
        for n, ev in enumerate(events):
            if n == 4:
                break
        events.close()
        tokens = h.tokens
        assert tokens[:50] == prompt and len(tokens) >= 55
        assert_greedy_matches(str(qwen3), prompt, tokens[50:])
        for o in others:  # push it out of the device
            o.generate(greedy(), prompt=o.tokens + [1])
        more = tokens + [2, 3]
        assert_greedy_matches(str(qwen3), more, h.generate(greedy(), prompt=more).token_ids)
        check_accounting(engine)


# --- the disk going bad -----------------------------------------------------------------------------


def test_a_truncated_spill_file_costs_its_state_a_recompute_only(qwen3, tmp_path):
    with pressured(qwen3, tmp_path, host_states=0.0) as engine:
        rng = random.Random(14)
        hs = _park_all_but_last(engine, rng)
        on_disk = [h for h in hs if tiers(engine)[h.id] == "disk"]
        assert len(on_disk) >= 2
        victim = on_disk[0]
        file = engine.registry._entries[victim.id].seq.parked.path
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
        prompt = victim.tokens + [6]
        done = victim.generate(greedy(), prompt=prompt)
        assert_greedy_matches(str(qwen3), prompt, done.token_ids)
        for h in on_disk[1:]:
            prompt = h.tokens + [6]
            done = h.generate(greedy(), prompt=prompt)
            assert done.stats.computed == 2
            assert_greedy_matches(str(qwen3), prompt, done.token_ids)
        check_accounting(engine)


def test_a_spill_folder_replaced_by_a_file_drops_copies_not_requests(qwen3, tmp_path):
    """The disk tier becomes unwritable (its folder replaced by a file, as a cleanup job or a
    mistaken `mv` leaves it). Was: the failed spill's cleanup, `path.unlink(missing_ok=True)`,
    raised NotADirectoryError (missing_ok covers FileNotFoundError only), so every step that had
    to park a state failed all its requests ('engine step failed'); closing a state on disk raised
    it too, and the engine's close lost those states' histories ('was not persisted'). Now the
    copies are dropped (their states recompute), every request gets exact output, closes work and
    the histories are written."""
    import shutil

    engine = pressured(qwen3, tmp_path, host_states=0.0)
    rng = random.Random(15)
    hs = _park_all_but_last(engine, rng)
    folder = pathlib.Path(engine.memory()["disk"]["folder"])
    on_disk = [h.id for h in hs if tiers(engine)[h.id] == "disk"]
    assert len(on_disk) >= 2
    shutil.rmtree(folder)
    folder.write_bytes(b"not a folder")
    try:
        engine.open_state(on_disk[0]).close()  # its spill file cannot be removed: closed all the same
        assert on_disk[0] not in tiers(engine)
        histories = {}
        for h in hs[1:]:
            prompt = h.tokens + [7]
            assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(), prompt=prompt).token_ids)
            histories[h.id] = h.tokens
        check_accounting(engine)
    finally:
        engine.close()
        folder.unlink()
    with pressured(qwen3, tmp_path) as again:
        for state_id, tokens in histories.items():  # every history was written at close
            assert again.open_state(state_id).tokens == tokens, state_id


def test_a_truncated_state_file_is_a_state_file_error_and_others_run(qwen3, tmp_path):
    with pressured(qwen3, tmp_path, host_states=0.0) as engine:
        rng = random.Random(16)
        hs = _park_all_but_last(engine, rng)
        h = next(h for h in hs if tiers(engine)[h.id] == "disk")
        h.save(tmp_path / "x.state")
        data = (tmp_path / "x.state").read_bytes()
        for cut in (0, 7, len(data) // 3, len(data) - 1):
            (tmp_path / "y.state").write_bytes(data[:cut])
            with pytest.raises(StateFileError):
                engine.load_state(tmp_path / "y.state", state_id="y")
        assert "y" not in tiers(engine)
        for h in hs:
            prompt = h.tokens + [8]
            assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(), prompt=prompt).token_ids)
        check_accounting(engine)


# --- the bundled demo model: a small budget against a large one -------------------------------------


DEMO_BLOCK_BYTES = 131072  # the demo's KV per 16-token block (float32 on the CPU)


def demo_prompts(tokenizer, n: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A shared system prompt, one question per agent, one tool result per agent (token ids)."""
    system = tokenizer.encode("You are a helpful agent. Use the tools to answer. Tools: weather(city), "
                              "calculator(expression), search(query). Answer briefly.\n")
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Rome", "Perth", "Dakar", "Hanoi", "Kyiv", "Bern"]
    questions = [tokenizer.encode(f"User: what is the weather in {c} and what is {i} times {i + 3}?\nAgent:")
                 for i, c in enumerate(cities[:n])]
    results = [tokenizer.encode(f"\nTool: {{\"city\": \"{c}\", \"temp\": {10 + i}, \"sky\": \"clear\"}}\nAgent:")
               for i, c in enumerate(cities[:n])]
    return system, questions, results


def demo_run(engine, tmp_path, fresh, picks=None) -> tuple[dict[str, list[int]], set[str], list[int]]:
    """One fixed sequence of operations; returns each generation's tokens by label, the tiers the
    states were seen in and which agents were forked, truncated and saved (`picks`: those of an
    earlier run; else parked ones)."""
    out, seen = {}, set()
    system, questions, results = demo_prompts(engine.tokenizer, 12)
    hs = [engine.open_state(f"agent-{i}") for i in range(12)]

    def turn(label, h, prompt, n=10):
        done = h.generate(greedy(n), prompt=prompt)
        out[label] = list(done.token_ids)
        seen.update(info.tier for info in engine.states())

    for i, h in enumerate(hs):
        turn(f"t1-{i}", h, system + questions[i])
    for i in (5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6):
        turn(f"t2-{i}", hs[i], hs[i].tokens + results[i])
    if picks is None:
        where = tiers(engine)
        parked = [i for i, h in enumerate(hs) if where[h.id] in ("host", "disk")]
        picks = [parked[0], parked[len(parked) // 2], parked[-1]]
    a, b, c = (hs[i] for i in picks)
    twin = a.fork("twin")
    turn("fork-parent", a, a.tokens + results[0])
    turn("fork-twin", twin, twin.tokens + results[1])
    b.truncate(len(b) - 7)
    turn("truncated", b, None)
    c.save(tmp_path / "c.state")
    other = fresh()
    try:
        loaded = other.load_state(tmp_path / "c.state")
        done = loaded.generate(greedy(10), prompt=loaded.tokens + results[2])
        out["loaded"] = list(done.token_ids)
    finally:
        other.close()
    hs[3].pin()
    for i in (6, 9, 3, 0):
        turn(f"t3-{i}", hs[i], hs[i].tokens + results[i][:4])
    hs[3].unpin()
    check_accounting(engine)
    return out, seen, picks


@pytest.mark.parametrize("speculation", ["off", "adaptive"])
def test_demo_agents_under_a_small_budget_match_a_large_one(tmp_path, speculation):
    from hibana_core import Engine

    common = dict(device="cpu", progress=False, speculation=speculation, max_concurrent_agents=4)
    host = 3 * 6 * DEMO_BLOCK_BYTES
    roomy = 200 << 20
    with Engine.from_pretrained("demo", memory_budget=roomy, host_kv_bytes=host, **common) as probe:
        fixed = roomy - probe.memory()["device"]["kv_pool"] - host  # weights, workspace, a drafter's share
    small_options = dict(common, memory_budget=fixed + 16 * DEMO_BLOCK_BYTES + host, host_kv_bytes=host)
    (tmp_path / "small").mkdir()
    with Engine.from_pretrained("demo", state_dir=tmp_path / "small", **small_options) as small:
        assert small.stats().kv_blocks_total <= 24, small.memory()
        fresh_options = dict(small_options, state_dir=tmp_path / "f")
        got, seen, picks = demo_run(small, tmp_path / "small", lambda: Engine.from_pretrained("demo", **fresh_options))
        stats = small.stats()
    with Engine.from_pretrained("demo", **common) as big:
        want, _, _ = demo_run(big, tmp_path / "big", lambda: Engine.from_pretrained("demo", **common), picks)
    assert {"host", "disk"} <= seen, seen
    assert stats.parks > 0 and stats.host_tier["disk_resumes"] > 0
    assert got.keys() == want.keys()
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not bad, bad


# --- a seeded walk over every handle operation, under pressure --------------------------------------


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_random_handle_operations_under_pressure(qwen3, tmp_path, seed):
    """generate / truncate / fork / save+load / close / pin / unpin / sync at random over 8-10
    states in a pool for 2-3, a host tier for one and a disk tier: after every operation each
    state holds exactly the history its caller expects, every generation is transformers', and the
    accounting agrees."""
    engine = pressured(qwen3, tmp_path, host_states=1.0)
    rng = random.Random(seed)
    expected: dict[str, list[int]] = {}
    made = 0
    try:
        for step in range(70):
            if len(expected) < 3 or rng.random() < 0.1:
                made += 1
                state_id = f"s{made}"
                expected[state_id] = []
                engine.open_state(state_id)
            state_id = rng.choice(sorted(expected))
            h = engine.open_state(state_id)
            history = expected[state_id]
            op = rng.choice(["gen", "gen", "gen", "truncate", "fork", "save", "close", "pin", "unpin", "sync"])
            if op == "gen" or not history:
                prompt = history + random_tokens(rng, rng.randint(1, 20))
                if len(prompt) > 120:
                    prompt = prompt[-60:]
                done = h.generate(greedy(rng.randint(1, 6)), prompt=prompt)
                assert_greedy_matches(str(qwen3), prompt, done.token_ids)
                expected[state_id] = prompt + list(done.token_ids)
            elif op == "truncate":
                n = rng.randint(0, len(history))
                h.truncate(n)
                expected[state_id] = history[:n]
            elif op == "fork":
                made += 1
                twin = h.fork(f"s{made}")
                expected[twin.id] = list(history)
            elif op == "save":
                made += 1
                h.save(tmp_path / f"{made}.state")
                loaded = engine.load_state(tmp_path / f"{made}.state", state_id=f"s{made}")
                expected[loaded.id] = list(history)
            elif op == "close":
                h.close()
                del expected[state_id]
            elif op == "pin":
                h.pin()
            elif op == "unpin":
                h.unpin()
            elif op == "sync":
                n = rng.randint(0, len(history))
                target = history[:n] + random_tokens(rng, rng.randint(0, 10))
                h.sync(target)
                expected[state_id] = target
            for sid, tokens in expected.items():
                assert engine.open_state(sid).tokens == tokens, (step, op, sid)
            check_accounting(engine)
        for sid in list(expected):  # a last turn on every state, wherever it is now
            h = engine.open_state(sid)
            prompt = expected[sid] + [11]
            assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(3), prompt=prompt).token_ids)
            h.close()
        assert engine.pool.num_used == 0
        tier = engine.stats().host_tier
        assert (tier["bytes_used"], tier["disk_bytes_used"], tier["disk_states"], tier["states"]) == (0, 0, 0, 0)
        assert not list(pathlib.Path(engine.memory()["disk"]["folder"]).glob("*.kv"))
    finally:
        engine.close()


def test_threads_generate_while_others_fork_save_pin_and_read_their_states(qwen3, tmp_path, join_all):
    """Owners run turns on their own states; a meddler forks, saves, pins and unpins those states
    and reads stats/memory/states meanwhile (StateBusyError is its only refusal). No owner's
    history or output changes, every fork and saved file holds a history its state had, and the
    accounting agrees afterwards."""
    engine = pressured(qwen3, tmp_path, max_concurrent_agents=3)
    errors, record, snapshots = [], [], []
    stop = threading.Event()

    def owner(k):
        rng = random.Random(100 + k)
        try:
            for j in range(2):
                h = engine.open_state(f"own{k}-{j}")
                h.sync(random_tokens(rng, 30))
            for turn in range(4):
                for j in range(2):
                    h = engine.open_state(f"own{k}-{j}")
                    prompt = h.tokens + random_tokens(rng, rng.randint(2, 8))
                    done = h.generate(greedy(4), prompt=prompt)
                    record.append((prompt, list(done.token_ids)))
                    assert h.tokens == prompt + list(done.token_ids)
                    if turn == 2:
                        h.truncate(len(h) - 3)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def meddler():
        rng = random.Random(7)
        n = 0
        try:
            while not stop.is_set():
                target = engine.open_state(f"own{rng.randrange(4)}-{rng.randrange(2)}")
                op = rng.choice(["fork", "save", "pin", "unpin", "read"])
                try:
                    if op == "fork":
                        n += 1
                        twin = target.fork(f"m{n}")
                        snapshots.append((twin.id, twin.tokens))
                    elif op == "save":
                        n += 1
                        target.save(tmp_path / f"m{n}.state")
                        snapshots.append((tmp_path / f"m{n}.state", None))
                    elif op == "pin":
                        target.pin()
                    elif op == "unpin":
                        target.unpin()
                    else:
                        engine.stats(), engine.memory(), engine.states()
                except StateBusyError:
                    pass
                time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        owners = [threading.Thread(target=owner, args=(k,)) for k in range(4)]
        m = threading.Thread(target=meddler)
        m.start()
        for t in owners:
            t.start()
        join_all(owners, 90)
        stop.set()
        join_all([m], 10)
        assert not errors, errors
        assert len(record) == 32
        for prompt, got in record:
            assert_greedy_matches(str(qwen3), prompt, got)
        for what, tokens in snapshots[:12]:  # forks and files continue exactly from what they hold
            h = engine.open_state(what) if tokens is not None else engine.load_state(what, state_id=f"l-{what.stem}")
            assert tokens is None or h.tokens == tokens
            if len(h):
                prompt = h.tokens + [3]
                assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(3), prompt=prompt).token_ids)
        check_accounting(engine)
    finally:
        engine.close()


def test_two_async_generations_on_one_handle(qwen3, tmp_path):
    with pressured(qwen3, tmp_path) as engine:
        rng = random.Random(31)
        _park_all_but_last(engine, rng, n=5)
        h = engine.open_state("p0")  # parked: its first request must bring it back
        base = h.tokens

        async def main():
            return await asyncio.gather(h.agenerate(greedy(6)), h.agenerate(greedy(6)), return_exceptions=True)

        results = asyncio.run(main())
        ok = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, StateBusyError) for r in refused), refused
        assert len(ok) >= 1
        assert h.tokens == base + [t for r in ok for t in r.token_ids]
        assert_greedy_matches(str(qwen3), base, h.tokens[len(base):])
        check_accounting(engine)


# --- requests that wait for room ---------------------------------------------------------------------


def _hold_the_pool(engine, rng, n=2, length=70):
    """n streams that hold most of the pool and run on (read one event each so they are running)."""
    streams = []
    for i in range(n):
        events = engine.open_state(f"runner{i}").stream(greedy(400), prompt=random_tokens(rng, length))
        next(iter(events))
        streams.append(events)
    return streams


def test_closing_a_parked_state_whose_request_waits_for_room(qwen3, tmp_path, join_all):
    engine = pressured(qwen3, tmp_path, blocks=14, max_concurrent_agents=2)
    rng = random.Random(41)
    try:
        parked = _park_all_but_last(engine, rng, n=5, length=40)
        victim = next(h for h in parked if tiers(engine)[h.id] in ("host", "disk"))
        step = engine.core.step

        def slow_step():  # the runners hold both slots for seconds
            time.sleep(0.02)
            return step()

        engine.core.step = slow_step
        streams = _hold_the_pool(engine, rng, length=20)
        result = {}

        def waiter():
            try:
                result["done"] = victim.generate(greedy(4), prompt=victim.tokens + [1, 2])
            except BaseException as exc:  # noqa: BLE001
                result["error"] = exc

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        victim.close()
        join_all([t], 30)
        err = result.get("error")
        assert err is None or isinstance(err, HibanaError), repr(err)
        if err is None:
            assert result["done"].finish_reason == "cancelled"
        assert "done" not in result or result["done"].finish_reason == "cancelled", result
        for events in streams:
            events.close()
        engine.core.step = step
        for h in parked:
            if h is not victim:
                prompt = h.tokens + [5]
                assert_greedy_matches(str(qwen3), prompt, h.generate(greedy(), prompt=prompt).token_ids)
        check_accounting(engine)
        for info in engine.states():
            engine.open_state(info.id).close()
        assert engine.pool.num_used == 0 and engine.stats().host_tier["disk_states"] == 0
    finally:
        engine.close()


def test_a_parked_state_whose_request_times_out_keeps_its_copy(qwen3, tmp_path):
    """QueueTimeoutError while running streams hold the pool: the state keeps the history it was
    called with, and its parked copy still serves its next turn (only the new tokens computed)."""
    from hibana_core import QueueTimeoutError

    engine = pressured(qwen3, tmp_path, blocks=14, queue_timeout_ms=200, max_concurrent_agents=2)
    rng = random.Random(42)
    try:
        parked = _park_all_but_last(engine, rng, n=5, length=40)
        victim = next(h for h in parked if tiers(engine)[h.id] in ("host", "disk"))
        before = victim.tokens
        step = engine.core.step

        def slow_step():  # the runners hold both slots for seconds
            time.sleep(0.02)
            return step()

        engine.core.step = slow_step
        streams = _hold_the_pool(engine, rng, length=20)
        prompt = before + [1, 2]
        with pytest.raises(QueueTimeoutError):
            victim.generate(greedy(4), prompt=prompt)
        assert victim.tokens == prompt
        assert tiers(engine)[victim.id] in ("host", "disk")
        for events in streams:
            events.close()
        engine.core.step = step
        done = victim.generate(greedy(4), prompt=prompt)
        assert_greedy_matches(str(qwen3), prompt, done.token_ids)
        assert done.stats.computed == 3, done.stats
        check_accounting(engine)
    finally:
        engine.close()


def test_closing_the_engine_while_streams_run_under_pressure_persists_consistent_histories(qwen3, tmp_path):
    engine = pressured(qwen3, tmp_path, blocks=14)
    rng = random.Random(43)
    prompts = {}
    parked = _park_all_but_last(engine, rng, n=5, length=40)
    expected = {h.id: h.tokens for h in parked}
    streams = []
    for i in range(2):
        prompts[f"live{i}"] = random_tokens(rng, 50)
        events = engine.open_state(f"live{i}").stream(greedy(400), prompt=prompts[f"live{i}"])
        next(iter(events))
        streams.append(events)
    engine.close()
    from hibana_core import EngineClosedError

    for events in streams:  # each ends, with the engine's error, never hangs
        with pytest.raises(EngineClosedError):
            list(events)
    with pressured(qwen3, tmp_path) as again:
        for state_id, tokens in expected.items():
            assert again.open_state(state_id).tokens == tokens, state_id
        for state_id, prompt in prompts.items():
            h = again.open_state(state_id)
            tokens = h.tokens
            assert tokens[:50] == prompt or tokens == [], (state_id, len(tokens))
            if len(tokens) > 50:
                assert_greedy_matches(str(qwen3), prompt, tokens[50:])
            more = (tokens or prompt) + [2]
            assert_greedy_matches(str(qwen3), more, h.generate(greedy(3), prompt=more).token_ids)
