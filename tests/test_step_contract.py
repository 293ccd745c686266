"""The step contract on the CPU, with no model: what the scheduler hands the runner, what the runner
hands back (any number of tokens per request, as speculation will), and how the runner assembles a
batch, placeholders for tokens still on the device included."""

from __future__ import annotations

import torch

from hibana_core.config import SamplingParams, SchedulerConfig
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.sequence import KVSequence
from hibana_core.runner import DeviceInput, ModelRunner, StepInFlight, gather_step
from hibana_core.sampler import Sampler
from hibana_core.scheduler import IdleLRUEviction, Request, RunnerOutput, Scheduler

BS = 4
STOP = 99


def make_scheduler(num_blocks=64, **config):
    pool = BlockPool(num_blocks, BS)
    return pool, Scheduler(SchedulerConfig(**config), pool, IdleLRUEviction(pool, lambda: []))


def add(scheduler, pool, tokens, max_tokens=None, max_len=1000):
    seq = KVSequence(pool, lambda src, dst: None)
    seq.set_tokens(tokens)
    params = None if max_tokens is None else SamplingParams(max_tokens=max_tokens)
    request = Request(seq, params, stop_token_ids=frozenset({STOP}), max_len=max_len)
    scheduler.add(request)
    return request


def test_a_step_may_give_each_request_zero_one_or_several_tokens():
    pool, scheduler = make_scheduler(max_prefill_chunk=6)
    prefill = add(scheduler, pool, range(10), max_tokens=5)     # 10 > chunk: no token this step
    one = add(scheduler, pool, range(20, 25), max_tokens=5)
    three = add(scheduler, pool, range(30, 35), max_tokens=5)
    stops = add(scheduler, pool, range(40, 45), max_tokens=5)
    capped = add(scheduler, pool, range(50, 55), max_tokens=2)
    step = scheduler.schedule()
    assert [(c.request, c.start, c.num_tokens, c.sample) for c in step.chunks] == [
        (prefill, 0, 6, False), (one, 0, 5, True), (three, 0, 5, True), (stops, 0, 5, True),
        (capped, 0, 5, True)]
    # KV counts as computed from schedule on; each sampling request holds one placeholder
    assert [r.seq.num_computed for r in (prefill, one, three)] == [6, 5, 5]
    assert [r.num_output_placeholders for r in (prefill, one, three)] == [0, 1, 1]
    assert len(one.seq) == 5  # the history holds real tokens only

    out = scheduler.update_from_output(step, RunnerOutput([[], [7], [7, 8, 9], [7, STOP, 8], [1, 2, 3]]))
    assert [(o.request, o.new_token_ids) for o in out] == [
        (one, [7]), (three, [7, 8, 9]), (stops, [7, STOP]), (capped, [1, 2])]
    assert one.seq.tokens == [20, 21, 22, 23, 24, 7] and one.output == [7]
    assert three.seq.tokens[5:] == [7, 8, 9] and three.output == [7, 8, 9]
    assert stops.seq.tokens[5:] == [7, STOP] and stops.finish_reason == "stop"    # 8 dropped
    assert capped.output == [1, 2] and capped.finish_reason == "length"           # 3 dropped
    # KV stays at what was computed: the new tokens are caught up next
    assert [r.seq.num_computed for r in (one, three, stops, capped)] == [5, 5, 5, 5]
    assert all(r.num_output_placeholders == 0 for r in (prefill, one, three, stops, capped))
    assert [r.id for r in scheduler.take_finished()] == [stops.id, capped.id]

    step = scheduler.schedule()  # decodes first, then the catching up (admission order)
    assert [(c.request, c.start, c.num_tokens, c.sample) for c in step.chunks] == [
        (one, 5, 1, True), (prefill, 6, 4, True), (three, 5, 3, True)]


def test_the_next_step_is_scheduled_before_the_previous_tokens_are_known():
    """Async scheduling: step 2 computes the position of the token step 1 sampled, before that
    token reaches the host; the history never holds a placeholder."""
    pool, scheduler = make_scheduler()
    a = add(scheduler, pool, range(6), max_tokens=2)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [(c.start, c.num_tokens, c.sample) for c in second.chunks] == [(6, 1, True)]
    assert a.num_output_placeholders == 2 and len(a.seq) == 6 and a.seq.num_computed == 7
    third = scheduler.schedule()  # its token in flight is its last: not scheduled again
    assert third.chunks == ()
    scheduler.update_from_output(first, RunnerOutput([[11]]))
    assert a.seq.tokens == [0, 1, 2, 3, 4, 5, 11] and a.num_output_placeholders == 1
    # block 1 (positions 4-7) is not published: its KV is counted up to position 6 only
    assert pool.is_committed(a.seq.block_ids[0]) and not pool.is_committed(a.seq.block_ids[1])
    scheduler.update_from_output(second, RunnerOutput([[12]]))
    assert a.seq.tokens[6:] == [11, 12] and a.seq.num_computed == 7 and a.finish_reason == "length"
    assert not pool.is_committed(a.seq.block_ids[1])  # the KV of token 12 was never computed


def test_a_request_that_finishes_while_its_token_is_in_flight_drops_it():
    pool, scheduler = make_scheduler()
    a = add(scheduler, pool, range(6), max_tokens=8)
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.update_from_output(first, RunnerOutput([[STOP]]))   # stops: step 2 is a row too many
    assert a.finish_reason == "stop" and a.num_output_placeholders == 0
    assert a.seq.num_computed == len(a.seq) == 7
    scheduler.update_from_output(second, RunnerOutput([[5]]))
    assert a.output == [STOP] and len(a.seq) == 7


def test_a_failed_step_gives_back_the_kv_it_was_to_write():
    pool, scheduler = make_scheduler()
    a = add(scheduler, pool, range(6), max_tokens=4)
    scheduler.update_from_output(scheduler.schedule(), RunnerOutput([[7]]))
    step = scheduler.schedule()
    scheduler.fail(step, RuntimeError("boom"))
    assert a.finish_reason == "error" and a.seq.num_computed == 6 and len(a.seq) == 7


def test_runner_batch_assembly():
    """gather_step and prepare on a prefill chunk, a decode whose input is known, and a decode
    whose input is the previous step's token still on the device."""
    pool, scheduler = make_scheduler(max_prefill_chunk=16)
    a = add(scheduler, pool, range(6), max_tokens=4)
    b = add(scheduler, pool, range(10, 13), max_tokens=4)
    first = scheduler.schedule()
    data = gather_step(first)
    assert data.ids == [0, 1, 2, 3, 4, 5, 10, 11, 12]
    assert data.positions == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert data.seq_lens == [6, 3] and data.starts == [0, 6, 9] and data.max_query_len == 6
    assert data.tables == [[a.seq.block_ids, b.seq.block_ids]] and data.logits_indices == [5, 8]  # one layer group
    blocks_a, block_b = a.seq.block_ids, b.seq.block_ids[0]
    assert data.slots == [[blocks_a[0] * BS + i for i in range(4)] + [blocks_a[1] * BS + i for i in range(2)]
                          + [block_b * BS + i for i in range(3)]]
    assert data.from_device == []

    in_flight = StepInFlight(first, torch.tensor([40, 41]))   # what step 1 sampled, "on the device"
    scheduler.update_from_output(first, RunnerOutput([[40], []]))  # a's token is known, b's not yet
    b.num_output_placeholders = 1
    b.seq.tokens = b.seq.tokens[:3]
    second = scheduler.schedule()
    data = gather_step(second, in_flight)
    assert [(c.request, c.start) for c in second.chunks] == [(a, 6), (b, 3)]
    assert data.ids == [40, 0] and data.positions == [6, 3]
    assert data.from_device == [DeviceInput(index=1, row=1)]

    runner = ModelRunner(torch.nn.Identity(), None, Sampler(torch.device("cpu")), torch.device("cpu"),
                         max_model_len=64, max_batch=4)
    inputs = runner.prepare(data)
    runner.take_from_device(inputs.input_ids, data, in_flight)
    assert inputs.input_ids.tolist() == [40, 41]
    assert inputs.batch.block_tables.tolist() == [[a.seq.block_ids, b.seq.block_ids + [0]]]
    assert inputs.logits_indices.tolist() == [0, 1]


def test_step_results_read_back_per_chunk():
    pool, scheduler = make_scheduler(max_prefill_chunk=4)
    add(scheduler, pool, range(10), max_tokens=2)
    add(scheduler, pool, range(20, 23), max_tokens=2)
    step = scheduler.schedule()
    assert [c.sample for c in step.chunks] == [False, True]
    assert StepInFlight(step, torch.tensor([9])).result() == RunnerOutput([[], [9]])


def test_a_block_is_published_only_once_its_tokens_are_known():
    pool, scheduler = make_scheduler()
    a = add(scheduler, pool, range(7), max_tokens=4)
    first = scheduler.schedule()
    scheduler.schedule()   # counts the KV of position 7, whose token is still on the device
    assert a.seq.num_computed == 8 and len(a.seq) == 7
    a.seq.commit_full_blocks()
    assert not pool.is_committed(a.seq.block_ids[1])
    scheduler.update_from_output(first, RunnerOutput([[70]]))
    assert pool.is_committed(a.seq.block_ids[1])
    assert pool.lookup(a.seq.prefix_hash(1)) == a.seq.block_ids[1]
