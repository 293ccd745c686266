"""The host tier's copies in flight (kv/transfers.py) and prefetch between steps: a parked copy
still being copied to the host is waited for before anything reads it (a restore, a spill file,
a state file), and a state due back from its tools comes back while other agents step, into free
device blocks only. The CPU has no side stream; `DeferredCopies` stands in for one whose copies
finish only when waited for, their destination NaN until then (a read that skips the wait
restores garbage, and greedy output shows it)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hibana_core import SamplingParams
from hibana_core.kv import policies
from hibana_core.kv import transfers
from hibana_core.kv.transfers import CopyStream, PinnedReserve, Transfer, _copy_pages, _runs
from tiny_models import random_tokens

GREEDY_ONE = SamplingParams(max_tokens=1, ignore_eos=True)


class Deferred(Transfer):
    """A device-to-host copy in flight until waited for."""

    def __init__(self, source: torch.Tensor, host: torch.Tensor) -> None:
        super().__init__()
        self.source, self.host, self.waited = source.clone(), host, False
        host.fill_(float("nan"))

    @property
    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        if not self.waited:
            self.host.copy_(self.source)
            self.waited = True


class DeferredCopies(CopyStream):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), side=False)
        self.made: list[Deferred] = []

    def to_host(self, device_kv: torch.Tensor, host: torch.Tensor) -> Transfer:
        self.made.append(Deferred(device_kv, host))
        return self.made[-1]


def deferred_engine(make_engine, path, **overrides):
    engine = make_engine(path, speculation="off", eviction_policy="lru", **overrides)
    engine.host_tier.copies = DeferredCopies()
    return engine


def park_a(engine, rng) -> tuple:
    """State "a" (40 tokens and one generated) parked by "b" and "c" in a 10-block pool
    (3 blocks each), its copy to the host still in flight."""
    a = engine.open_state("a")
    a.generate(GREEDY_ONE, prompt=random_tokens(rng, 40))
    for other in ("b", "c", "d"):
        engine.open_state(other).generate(GREEDY_ONE, prompt=random_tokens(rng, 40))
    parked = engine.registry._entries["a"].seq.parked
    assert parked is not None and parked.tier == "host" and not parked.copy.done
    return a, parked.copy


def test_a_restore_waits_for_the_park_still_in_flight(tiny_checkpoints, make_engine, hf_greedy):
    path = tiny_checkpoints["llama"]
    engine = deferred_engine(make_engine, path, num_blocks=10)
    a, copy = park_a(engine, random.Random(1))
    prompt = a.tokens + [5, 6, 7]
    done = a.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert copy.waited and done.stats.computed == 4
    assert list(done.token_ids) == hf_greedy(str(path), prompt, 4)


def test_a_spill_waits_for_the_park_still_in_flight(tiny_checkpoints, make_engine, hf_greedy, tmp_path):
    """A host budget of one state: parking the next moves "a" to disk, from its copy in flight."""
    path = tiny_checkpoints["qwen3"]
    per_state = 3 * make_engine(path, num_blocks=10).kv_cache.bytes_per_block_here
    engine = deferred_engine(make_engine, path, num_blocks=10, state_dir=tmp_path, host_kv_bytes=per_state)
    rng = random.Random(2)
    a, copy = park_a(engine, rng)
    engine.open_state("e").generate(GREEDY_ONE, prompt=random_tokens(rng, 40))  # parks "b": "a" goes to disk
    assert {info.id: info.tier for info in engine.states()}["a"] == "disk" and copy.waited
    prompt = a.tokens + [5, 6, 7]
    done = a.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert done.stats.computed == 4 and list(done.token_ids) == hf_greedy(str(path), prompt, 4)
    assert engine.stats().host_tier["disk_resumes"] == 1


def test_a_state_file_of_a_parked_state_waits_for_its_copy(tiny_checkpoints, make_engine, hf_greedy, tmp_path):
    path = tiny_checkpoints["llama"]
    engine = deferred_engine(make_engine, path, num_blocks=10)
    a, copy = park_a(engine, random.Random(3))
    a.save(tmp_path / "a.state")
    assert copy.waited
    for other in ("b", "c", "d"):
        engine.open_state(other).close()
    twin = engine.load_state(tmp_path / "a.state", state_id="a2")
    prompt = twin.tokens + [5, 6, 7]
    done = twin.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert done.stats.computed == 4 and list(done.token_ids) == hf_greedy(str(path), prompt, 4)


def test_copy_time_is_counted_once_the_copy_is_done(tiny_checkpoints, make_engine):
    engine = deferred_engine(make_engine, tiny_checkpoints["llama"], num_blocks=10)
    _, copy = park_a(engine, random.Random(4))
    assert len(engine.host_tier._copying) == 1  # the park: its time unknown while in flight
    copy.wait()
    engine.stats()
    assert not engine.host_tier._copying


def due_at_once(monkeypatch) -> None:
    """An agent that calls tools is due back at once (and kept 20 s before its tool time is known)."""
    monkeypatch.setattr(policies, "DEFAULT_TOOL_SECONDS", 10.0)
    monkeypatch.setattr("hibana_core.registry.PREFETCH_LEAD", 10.0)


def test_a_due_state_comes_back_between_steps_into_free_blocks_only(tiny_checkpoints, make_engine, hf_greedy,
                                                                    monkeypatch):
    """Idle prefetch is off: "a" can only come back between other agents' steps. While "b"
    generates in a pool with as many free blocks as "a" needs and none to spare for "b" to grow
    into, "a" stays parked and nothing is evicted; once "c" closes there is room, and "a" comes
    back during "b"'s next generation."""
    due_at_once(monkeypatch)
    path = tiny_checkpoints["llama"]
    engine = deferred_engine(make_engine, path, num_blocks=10)
    engine.core.idle = None
    rng = random.Random(5)
    a, b, c, d = (engine.open_state(name) for name in "abcd")
    a.generate(GREEDY_ONE, prompt=random_tokens(rng, 40))  # 3 blocks of KV (40 tokens)
    engine.registry.note_turn(a, called_tools=True)
    c.generate(GREEDY_ONE, prompt=random_tokens(rng, 40))  # 3
    d.generate(GREEDY_ONE, prompt=random_tokens(rng, 40))  # 3
    b.generate(GREEDY_ONE, prompt=random_tokens(rng, 50))  # 4: "a" is parked
    d.close()                                              # 3 free
    assert {info.id: info.tier for info in engine.states()} == {"a": "host", "b": "device", "c": "device"}
    b.generate(SamplingParams(max_tokens=20, ignore_eos=True))  # grows into a 5th block
    tier = engine.stats().host_tier
    assert {info.id: info.tier for info in engine.states()} == {"a": "host", "b": "device", "c": "device"}
    assert tier["parks"] == 1 and tier["prefetches"] == 0
    c.close()                                              # 5 free
    b.generate(SamplingParams(max_tokens=4, ignore_eos=True))
    assert {info.id: info.tier for info in engine.states()}["a"] == "device"
    assert engine.stats().host_tier["prefetches"] == 1
    prompt = a.tokens + [5, 6, 7]
    done = a.generate(SamplingParams(max_tokens=4, ignore_eos=True), prompt=prompt)
    assert done.stats.computed == 4 and list(done.token_ids) == hf_greedy(str(path), prompt, 4)


def tool_loops(engine, agents: int, turns: int, seed: int, join_all) -> dict[str, list[list[int]]]:
    """Agents in threads, each turn a generation then a short tool wait, agent i taking
    `turns + i % 2` turns and closing its state after them (its blocks free for the states of
    the others); their outputs."""
    rng = random.Random(seed)
    prompts = {f"agent-{i}": random_tokens(rng, 30 + 7 * i) for i in range(agents)}
    results: dict[str, list[list[int]]] = {name: [] for name in prompts}

    def run(name: str) -> None:
        h = engine.open_state(name)
        history = prompts[name]
        for turn in range(turns + int(name[-1]) % 2):
            done = h.generate(SamplingParams(max_tokens=5, ignore_eos=True), prompt=history)
            results[name].append(list(done.token_ids))
            engine.registry.note_turn(h, called_tools=True)
            time.sleep(0.05)
            history = history + list(done.token_ids) + [11 + turn, 12 + turn]
        h.close()

    threads = [threading.Thread(target=run, args=(name,)) for name in prompts]
    for t in threads:
        t.start()
    join_all(threads, 120)
    return results


def test_agents_in_tool_loops_give_the_same_tokens_with_the_tier(tiny_checkpoints, make_engine, monkeypatch, join_all):
    """Parks in flight and restores change no token: the same tool loops under a tight pool,
    with the tier and without (evicted KV recomputed). (Prefetch seldom finds free blocks here:
    idle states keep theirs until evicted; the test above makes room for it.)"""
    due_at_once(monkeypatch)
    path = tiny_checkpoints["qwen3"]
    engine = deferred_engine(make_engine, path, num_blocks=14)
    with_tier = tool_loops(engine, 5, 3, 6, join_all)
    assert engine.stats().host_tier["parks"] > 0
    without = tool_loops(make_engine(path, num_blocks=14, speculation="off", host_kv_bytes=0), 5, 3, 6, join_all)
    assert with_tier == without


def test_runs_of_pages():
    assert _runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert _runs([]) == []


def test_pages_are_staged_as_host_kv_selects_them():
    """The side stream's page copies (run by run, per layer slot and k/v), here on the CPU."""
    host = torch.randn(3, 2, 7, 4, 2, 5)  # [page_layers, 2, pages, block_size, H_kv, D]
    for pages in ([5, 6, 2, 3, 4], list(range(7)), [0], [6, 0]):
        staging = torch.empty(3, 2, len(pages), 4, 2, 5)
        _copy_pages(staging, host, pages)
        assert torch.equal(staging, host[:, :, pages])


PAGE = PinnedReserve.ALIGN


@pytest.fixture
def fake_pinning(monkeypatch):
    """Pinning simulated (the CPU has none): each pinned chunk recorded with its thread; chunks of
    8 pages."""
    pinned: list[tuple[int, str]] = []

    def fake_pin(nbytes):
        pinned.append((nbytes, threading.current_thread().name))
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(transfers, "pin_block", fake_pin)
    monkeypatch.setattr(PinnedReserve, "CHUNK", 8 * PAGE)
    return pinned


def settled(reserve: PinnedReserve) -> PinnedReserve:
    """`reserve` once its warmer has nothing left to pin."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with reserve._lock:
            if not reserve._wanted() and not reserve._wake.is_set():
                time.sleep(0.05)  # a chunk being pinned
                if not reserve._wanted():
                    return reserve
        time.sleep(0.01)
    raise AssertionError("the warmer did not settle")


def test_the_reserve_pins_chunks_ahead_off_the_callers_thread(fake_pinning):
    """The first tensor pins its own size on the caller's thread (cold); the warmer then pins
    chunks until SPARES + cold more copies of the largest size fit, which the next tensors take
    without pinning; the limit bounds the warmer."""
    reserve = PinnedReserve(limit=20 * PAGE)
    by = lambda thread: [size for size, name in fake_pinning if name == thread]  # noqa: E731
    first = reserve.empty(torch.Size([3, PAGE]), torch.uint8)  # 3 pages, cold
    first.fill_(1.0)
    settled(reserve)
    assert first.shape == (3, PAGE) and by("MainThread") == [3 * PAGE] and reserve.cold == 1
    # SPARES + cold = 3 more copies of 3 pages wanted: a chunk of 8 pages holds 2, so two chunks
    assert by("hibana-pinned") == [8 * PAGE, 8 * PAGE] and reserve.bytes == 19 * PAGE
    taken = [reserve.empty(torch.Size([3 * PAGE]), torch.uint8) for _ in range(4)]  # from the chunks, warm
    settled(reserve)  # room for fewer than 3 copies, but another chunk would pass the limit (20 pages)
    assert reserve.cold == 1 and len(fake_pinning) == 3 and reserve.free_bytes == 4 * PAGE
    assert len({t.data_ptr() for t in [first, *taken]}) == 5
    taken.append(reserve.empty(torch.Size([3 * PAGE]), torch.uint8))  # no range of 3 pages left: cold
    assert reserve.cold == 2 and by("MainThread") == [3 * PAGE, 3 * PAGE]
    reserve.close()
    assert all(t.shape == (3 * PAGE,) for t in taken) and first.sum() == 3 * PAGE


def test_pinned_ranges_come_back_when_their_storage_dies_and_merge(fake_pinning):
    """A range is free again only once no tensor uses its memory (a view keeps it), and freed
    neighbours merge, so a larger tensor fits where two smaller ones were."""
    reserve = PinnedReserve(limit=0)  # no warmer: only what the caller pins
    whole = reserve.empty(torch.Size([8 * PAGE]), torch.uint8)  # cold: a chunk of 8 pages, all used
    del whole
    assert reserve._free == [[(0, 8 * PAGE)]]
    a = reserve.empty(torch.Size([3 * PAGE]), torch.uint8)
    b = reserve.empty(torch.Size([PAGE + 1]), torch.uint8)  # 2 pages held
    assert reserve._free == [[(5 * PAGE, 3 * PAGE)]] and PinnedReserve.held(PAGE + 1) == 2 * PAGE
    view = a[PAGE:].view(torch.int32)
    del a
    assert reserve._free == [[(5 * PAGE, 3 * PAGE)]]  # the view holds its storage
    view.fill_(7)
    del view, b
    assert reserve._free == [[(0, 8 * PAGE)]]
    again = reserve.empty(torch.Size([4, PAGE]), torch.float16)  # 8 pages: no new pin
    assert [size for size, _ in fake_pinning] == [8 * PAGE] and reserve.cold == 1
    assert again.is_contiguous() and again.shape == (4, PAGE)
    reserve.close()
    assert reserve.bytes == 8 * PAGE  # in use: kept
    del again
    assert reserve.bytes == 0 and reserve._chunks == [None]


def test_a_range_that_dies_while_another_is_taken_is_given_back_after_the_take(fake_pinning):
    """A finalizer can run inside `_take` (an allocation there sets off the garbage collector) and
    give a range back while `_take` holds a position in the free list: the range comes back once
    the take is done, and the take hands out the range it chose, never one another tensor holds."""
    reserve = PinnedReserve(limit=0)
    chunk = reserve.empty(torch.Size([8 * PAGE]), torch.uint8)
    del chunk
    a = reserve.empty(torch.Size([2 * PAGE]), torch.uint8)   # pages 0-1
    b = reserve.empty(torch.Size([3 * PAGE]), torch.uint8)   # pages 2-4; free: 5-7
    victim = [a]
    del a

    class Dying(list):
        """The free list, whose walk lets `a` die at its end: its finalizer runs mid-take, after
        the take chose its range."""

        def __iter__(self):
            yield from list.__iter__(self)
            victim.clear()

    reserve._free[0] = Dying(reserve._free[0])
    base = b.data_ptr() - 2 * PAGE
    c = reserve.empty(torch.Size([3 * PAGE]), torch.uint8)
    assert c.data_ptr() - base == 5 * PAGE  # not page 0, whose 3 pages would run into b
    assert list(reserve._free[0]) == [(0, 2 * PAGE)] and not reserve._returned
    del b, c
    assert list(reserve._free[0]) == [(0, 8 * PAGE)]
    reserve.close()
