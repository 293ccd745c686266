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

import torch

from hibana_core import SamplingParams
from hibana_core.kv import policies
from hibana_core.kv import transfers
from hibana_core.kv.transfers import CopyStream, PinnedReserve, Transfer, _copy_pages, _runs, pinned_size
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


def test_pinned_sizes_are_four_classes_per_power_of_two():
    assert [pinned_size(n) for n in (1, 3, 5, 1000, 1024, 1025, 617 << 20)] == [1, 3, 5, 1024, 1024, 1280, 640 << 20]
    for n in range(1, 5000):
        assert n <= pinned_size(n) <= n * 1.25 + 1 and pinned_size(pinned_size(n)) == pinned_size(n)


def test_the_reserve_pins_spares_per_size_class_off_the_callers_thread(monkeypatch):
    """Pinning is simulated (the CPU has none): each pinned allocation is recorded with its
    thread. The first tensor of a class is pinned by the caller (cold); the warmer then pins
    spares of its class (one, and one more per cold allocation of it), which the next tensors of
    that class take; a tensor that dies gives its block back; the limit bounds the warmer."""
    pinned: list[tuple[int, str]] = []

    def fake_pin(nbytes):
        pinned.append((nbytes, threading.current_thread().name))
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(transfers, "pin_block", fake_pin)
    reserve = PinnedReserve(limit=4 * 2048 + 1024)

    def settle():
        deadline = time.monotonic() + 10
        while reserve._asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not reserve._asked

    def by(thread: str) -> list[int]:
        return [size for size, name in pinned if name == thread]

    first = reserve.empty(torch.Size([3, 150]), torch.float32)  # 1,800 bytes: the class of 2,048, cold
    first.fill_(1.0)
    settle()
    assert first.shape == (3, 150) and by("MainThread") == [2048]
    assert reserve.cold == 1 and by("hibana-pinned") == [2048, 2048]  # one spare + one per cold
    second = reserve.empty(torch.Size([500]), torch.float32)  # 2,000 bytes: the same class, warm
    settle()
    assert reserve.cold == 1 and len(reserve.free[2048]) == 2 and len(by("hibana-pinned")) == 3
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    del first  # its block comes back: a third free block, and nothing is pinned for it
    assert len(reserve.free[2048]) == 3 and len(pinned) == 4
    third = reserve.empty(torch.Size([2, 256]), torch.float16)  # 1,024 bytes: another class, cold
    settle()
    # 4 blocks of 2,048 and the cold one of 1,024 reach the limit: no spare of 1,024 is pinned
    assert reserve.cold == 2 and reserve.bytes == 4 * 2048 + 1024 and not reserve.free[1024]
    reserve.close()
    assert second.shape == (500,) and third.dtype == torch.float16
    del second  # after close, a block given back is let go
    assert not reserve.free[2048]


def test_the_reserve_hands_out_a_block_of_the_next_class_up(monkeypatch):
    """A tensor whose class has no free block takes one of the next class (a quarter larger at
    most) rather than pinning on the caller's thread; two classes up is too large."""
    pinned: list[int] = []
    monkeypatch.setattr(transfers, "pin_block", lambda n: pinned.append(n) or torch.empty(n, dtype=torch.uint8))
    reserve = PinnedReserve(limit=0)  # no spares: only what the caller pins
    first = reserve.empty(torch.Size([2048]), torch.uint8)
    del first  # the block of 2,048 is free
    assert pinned == [2048] and len(reserve.free[2048]) == 1
    assert pinned_size(1700) == 1792 and PinnedReserve.largest_block(1700) == 2048
    second = reserve.empty(torch.Size([1700]), torch.uint8)  # class 1,792: takes the free 2,048
    assert pinned == [2048] and reserve.cold == 1 and second.untyped_storage().nbytes() == 2048
    del second
    third = reserve.empty(torch.Size([1500]), torch.uint8)  # class 1,536: two classes below, pins its own
    assert pinned == [2048, 1536] and reserve.cold == 2 and third.untyped_storage().nbytes() == 1536
    reserve.close()
