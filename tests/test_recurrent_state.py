"""A hybrid model's per-agent recurrent state (hibana_core/kv/recurrent.py), plain Python: slots,
the position a state is at, snapshots, rewinds, verify commits and published prefix states, with
the device copies recorded instead of made."""

from __future__ import annotations

import pytest

from hibana_core.kv.recurrent import SNAPSHOTS, RecurrentSlots, RecurrentState


@pytest.fixture
def slots():
    copies: list[tuple[int, int]] = []
    pool = RecurrentSlots(6, lambda src, dst: copies.append((src, dst)), stride=64)
    pool.copies = copies
    return pool


def test_a_state_takes_a_slot_and_moves_with_the_steps_that_write_it(slots):
    state = RecurrentState(slots)
    assert not state.has_state and state.ensure_slot() and state.slot == 0
    state.advance(0, 40, writes=True)
    assert state.position == 40 and state.has_state
    with pytest.raises(RuntimeError, match="position 40 was scheduled from 30"):
        state.advance(30, 1, writes=True)


def test_a_verify_step_leaves_the_state_until_its_kept_tokens_are_committed(slots):
    state = RecurrentState(slots)
    state.ensure_slot()
    state.advance(0, 20, writes=True)
    state.advance(20, 5, writes=False)  # the input token and four drafts
    assert state.position == 20 and state.pending == 20
    assert state.commit(23) == 3 and state.position == 23 and state.pending is None  # two drafts kept
    assert state.commit(30) == 0  # nothing pending


def test_a_cut_rewinds_to_the_latest_snapshot_at_or_before_it(slots):
    state = RecurrentState(slots)
    state.ensure_slot()
    state.advance(0, 30, writes=True)
    state.snapshot()  # a prompt's end
    state.advance(30, 20, writes=True)
    state.snapshot()
    state.advance(50, 10, writes=True)
    assert [p for p, _ in state.snapshots] == [30, 50] and slots.num_free == 3
    assert state.rewind(70) == 60  # past it: nothing to do
    assert state.rewind(55) == 50 and slots.copies[-1] == (state.snapshots[-1][1], state.slot)
    assert state.rewind(45) == 30 and [p for p, _ in state.snapshots] == [30] and slots.num_free == 4
    assert state.rewind(10) == 0 and state.snapshots == [] and not state.has_state


def test_snapshots_past_the_bound_reuse_the_oldest_slot(slots):
    state = RecurrentState(slots)
    state.ensure_slot()
    for i in range(SNAPSHOTS + 2):
        state.advance(10 * i, 10, writes=True)
        state.snapshot()
    assert len(state.snapshots) == SNAPSHOTS and state.num_slots == SNAPSHOTS + 1
    assert [p for p, _ in state.snapshots] == [10 * k for k in range(3, SNAPSHOTS + 3)]  # the last ones


def test_a_fork_copies_the_live_state_and_release_gives_every_slot_back(slots):
    state = RecurrentState(slots)
    state.ensure_slot()
    state.advance(0, 12, writes=True)
    state.snapshot()
    twin = state.fork()
    assert twin.position == 12 and twin.slot != state.slot and slots.copies[-1] == (state.slot, twin.slot)
    assert twin.snapshots == []
    state.release()
    twin.release()
    assert slots.num_free == 6 and state.position == 0 and state.slot is None


def test_published_prefix_states_are_found_adopted_and_given_back_oldest_first(slots):
    slots.publish("a", 64, source=5)
    slots.publish("b", 128, source=5)
    slots.publish("a", 64, source=5)  # again: no second copy, now the most recently used
    assert slots.find("a") == 64 and slots.find("c") is None and len(slots.copies) == 2
    slots.adopt("b", 3)
    assert slots.copies[-1] == (slots.published["b"][1], 3)
    assert slots.unpublish_oldest() and list(slots.published) == ["b"]  # "a" was used before "b" was adopted
    assert slots.unpublish_oldest() and not slots.unpublish_oldest() and slots.num_free == 6
