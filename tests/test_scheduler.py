"""Scheduler and KV sequences on the CPU, with no model: token counting, chunking, admission,
prefix reuse, copy-on-write and preemption, asserted in exact token counts and block ids."""

from __future__ import annotations

from hibana_core.config import SamplingParams, SchedulerConfig
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.sequence import KVSequence
from hibana_core.scheduler import IdleLRUEviction, Request, RequestStatus, RunnerOutput, Scheduler

BS = 4


class Harness:
    def __init__(self, num_blocks=32, idle=(), **config):
        self.pool = BlockPool(num_blocks, BS)
        self.copies: list[tuple[int, int]] = []
        self.idle = list(idle)
        self.requests: list[Request] = []
        self.scheduler = Scheduler(SchedulerConfig(**config), self.pool,
                                   IdleLRUEviction(self.pool, self.idle_states))

    def idle_states(self) -> list[KVSequence]:
        """As the engine does: states whose requests all finished, plus those given by the test."""
        busy = {id(r.seq) for r in self.requests if r.status is not RequestStatus.FINISHED}
        done = [r.seq for r in self.requests if id(r.seq) not in busy]
        return self.idle + [s for i, s in enumerate(done) if s not in done[:i]]

    def seq(self, tokens) -> KVSequence:
        seq = KVSequence(self.pool, lambda src, dst: self.copies.append((src, dst)))
        seq.set_tokens(tokens)
        return seq

    def request(self, seq, max_tokens=None) -> Request:
        params = None if max_tokens is None else SamplingParams(max_tokens=max_tokens)
        request = Request(seq, params, max_len=1000)
        self.scheduler.add(request)
        self.requests.append(request)
        return request

    def step(self, token=7):
        output = self.scheduler.schedule()
        sampled = RunnerOutput([[token] if c.sample else [] for c in output.chunks])
        self.scheduler.update_from_output(output, sampled)
        return [(c.request.id, c.start, c.num_tokens, c.sample) for c in output.chunks]


def test_prefill_is_chunked_under_the_token_budget_and_decode_comes_first():
    h = Harness(max_num_batched_tokens=8, max_prefill_chunk=8)
    a = h.request(h.seq(range(10)), max_tokens=3)
    assert h.step() == [(a.id, 0, 8, False)]
    assert h.step() == [(a.id, 8, 2, True)]          # reaches the end: samples
    b = h.request(h.seq(range(100, 120)), max_tokens=1)
    # a decodes one token, b's prefill takes the rest of the budget
    assert h.step() == [(a.id, 10, 1, True), (b.id, 0, 7, False)]
    assert a.output == [7, 7]
    assert a.seq.num_computed == 11 and len(a.seq) == 12


def test_fifo_admission_respects_max_concurrent_agents():
    h = Harness(max_concurrent_agents=1)
    a = h.request(h.seq(range(4)), max_tokens=1)
    b = h.request(h.seq(range(4)), max_tokens=1)
    assert [c[0] for c in h.step()] == [a.id]
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "length"
    assert b.status is RequestStatus.WAITING
    assert [c[0] for c in h.step()] == [b.id]


def test_a_sync_request_computes_the_remainder_and_finishes_synced():
    h = Harness()
    seq = h.seq(range(10))
    r = h.request(seq)
    assert h.step() == [(r.id, 0, 10, False)]
    assert r.finish_reason == "synced" and r.computed == 10 and r.reused == 0
    assert seq.num_computed == 10 and seq.block_ids == [0, 1, 2]
    assert [h.pool.is_committed(b) for b in seq.block_ids] == [True, True, False]


def test_full_blocks_are_found_by_prefix_and_shared():
    h = Harness()
    first = h.seq(range(9))
    h.request(first)
    h.step()
    second = h.seq(list(range(8)) + [50, 51])
    r = h.request(second)
    assert h.step() == [(r.id, 8, 2, False)]        # two full blocks reused, two tokens computed
    assert r.reused == 8 and r.computed == 2
    assert second.block_ids[:2] == first.block_ids[:2]
    assert h.pool.ref_count(first.block_ids[0]) == 2


def test_equal_prefixes_computed_in_one_step_are_stored_once():
    h = Harness()
    a, b = h.seq(range(8)), h.seq(range(8))
    h.request(a), h.request(b)
    h.step()
    assert a.block_ids == b.block_ids and h.pool.num_used == 2


def test_a_fully_synced_state_recomputes_only_its_last_token_to_sample():
    h = Harness()
    seq = h.seq(range(8))
    h.request(seq)
    h.step()
    r = h.request(seq, max_tokens=1)
    assert h.step() == [(r.id, 7, 1, True)]
    # the last block was committed, so writing its last slot copied it first (the pool has blocks to
    # spare: the published block keeps its branch in the index; test_admission's exact fill has none)
    assert h.copies == [(1, 2)] and seq.block_ids == [0, 1]   # and the copy deduped back to block 1
    assert r.reused == 7 and r.computed == 1


def test_writing_into_a_shared_partial_block_copies_it():
    h = Harness()
    a = h.seq(range(6))
    h.request(a)
    h.step()
    b = a.fork()
    assert b.block_ids == a.block_ids and h.pool.ref_count(a.block_ids[1]) == 2
    b.set_tokens(list(range(6)) + [99])
    h.request(b)
    h.step()
    assert h.copies == [(1, 2)]
    assert b.block_ids == [0, 2] and a.block_ids == [0, 1]


def test_idle_states_give_their_blocks_back_under_memory_pressure():
    h = Harness(num_blocks=4)
    idle = h.seq(range(100, 112))
    h.request(idle)
    h.step()
    assert h.pool.num_used == 3
    r = h.request(h.seq(range(8)))
    h.step()
    assert r.finish_reason == "synced"
    assert idle.num_computed == 0 and idle.block_ids == [] and len(idle) == 12


def test_when_nothing_fits_the_newest_request_is_preempted_then_resumed():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    a = h.request(h.seq(range(8)), max_tokens=8)
    b = h.request(h.seq(range(20, 28)), max_tokens=8)
    for _ in range(12):
        h.step()
    assert a.status is RequestStatus.FINISHED
    assert len(a.output) == 8
    while b.status is not RequestStatus.FINISHED:
        h.step()
    assert len(b.output) == 8 and b.finish_reason == "length"


def test_a_request_larger_than_the_pool_fails_alone():
    h = Harness(num_blocks=2)
    r = h.request(h.seq(range(12)))
    h.step()
    assert r.finish_reason == "error" and "KV blocks" in str(r.error)


def test_an_edit_into_a_published_block_keeps_the_old_branch_in_the_index_where_the_pool_can_copy():
    """A state alone holding its published blocks, edited inside one (a regenerated reply, a tree
    search's rollback): the write copies the block where the pool has one to spare, so the old
    branch stays findable; only a pool with none to spare writes in place (test_admission's exact fill)."""
    h = Harness(num_blocks=10)
    history = list(range(1, 2 * BS + 1))  # two full blocks
    a = h.seq(history)
    h.request(a)
    h.step()
    edited = history[:2 * BS - 2] + [99, 100]
    a.set_tokens(edited)
    h.request(a)
    h.step()
    assert h.copies  # the second block was copied, not written in place
    probe = h.seq(history)
    assert probe.index_match(len(history)) == len(history)  # the old branch: still in the index


def test_a_waiting_request_times_out_while_suspects_run_one_at_a_time():
    """After a failed step of several requests, they run one a step to find the culprit (a path
    that admits nobody): a request waiting for a slot still fails at its queue_timeout_ms then."""
    from hibana_core.errors import QueueTimeoutError

    h = Harness(max_concurrent_agents=2, queue_timeout_ms=1.0)
    a = h.request(h.seq(range(4)), max_tokens=5)
    b = h.request(h.seq(range(10, 14)), max_tokens=5)
    waiting = h.request(h.seq(range(20, 24)), max_tokens=5)
    h.scheduler.fail(h.scheduler.schedule(), RuntimeError("a bad row"))
    assert a.suspect and b.suspect and waiting.status is RequestStatus.WAITING
    waiting.queued_at -= 1.0  # it has waited a second
    assert [c[0] for c in h.step()] == [a.id]  # one suspect alone
    assert waiting.status is RequestStatus.FINISHED and isinstance(waiting.error, QueueTimeoutError)
