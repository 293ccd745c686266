"""Model runner: prepares the batch tensors of a step once, runs the forward, samples.

On CUDA, decode-only steps replay a CUDA graph captured per batch-size bucket; everything else
runs eagerly. `launch` only enqueues work and returns the step in flight: its sampled tokens stay
on the device (the next step's inputs take them from there) and reach the host in
`StepInFlight.result`, the one host synchronisation of a step. A step with rows under a grammar
enqueues its forward in `launch` and its sampling in `sample`, once the engine core has filled the
grammar masks on the host (while the device runs the forward).
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hibana_core.forward_context import ForwardBatch, ForwardContext
from hibana_core.kv.recurrent_cache import VerifyStash
from hibana_core.kv.transfers import device_tensor
from hibana_core.sampler import DraftEstimates, DraftRow, Sampler, SamplingRow, StepLogprobs, TokenMasks
from hibana_core.scheduler import Request, RunnerOutput, SchedulerOutput
from hibana_core.state import TokenLogprob

logger = logging.getLogger("hibana.runner")

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    batch: ForwardBatch
    logits_indices: torch.Tensor  # [S]: rows of the sequences that sample this step


@dataclass(frozen=True)
class DeviceInput:
    """An input token that is still on the device: sampled by the previous step."""

    index: int   # position in the step's input ids
    row: int     # row of the previous step's sampled tokens


@dataclass(frozen=True)
class StepData:
    """A step's integer inputs, built on the host in one pass over the chunks."""

    ids: list[int]                 # 0 where the token comes from the device
    positions: list[int]
    slots: list[list[int]]         # per KV layer group (`KVLayout`): each token's cache slot
    seq_lens: list[int]
    starts: list[int]
    tables: list[list[list[int]]]  # per KV layer group: each sequence's block table
    logits_indices: list[int]
    max_query_len: int
    from_device: list[DeviceInput]
    state_slots: list[int] | None = None  # a hybrid model's: each sequence's recurrent slot,
    has_state: list[bool] | None = None   # and whether it continues a state (else from zeros, position 0)
    writes_state: bool = True             # False: a verify step (`ModelRunner.commit_recurrent`)


class StepTimer:
    """The device time of one step: CUDA events around its work on a GPU (the time the device
    spent on it, however the host and earlier steps overlapped it); wall time on a CPU, where
    launching a step runs it."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._start, self._seconds = time.perf_counter(), 0.0

    def stop(self) -> "StepTimer":
        if self._events is not None:
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._start
        return self

    def seconds(self) -> float:
        """After the step's result was read (its events have completed)."""
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._seconds


@dataclass(frozen=True)
class PendingSample:
    """A launched step's logits, waiting to be sampled (`ModelRunner.sample`)."""

    logits: torch.Tensor          # [S, vocab]
    rows: list[SamplingRow]
    timer: StepTimer | None       # stopped once sampling is enqueued, where the step is representative


class StepInFlight:
    """A launched step: its sampled tokens [S] are on the device at once and on the host after
    `result`. A sampling chunk has one row, or 1 + k where it verifies k drafts: the token
    sampled after each of its last 1 + k inputs. A step with constrained rows is sampled later
    than its forward is launched (`pending`), once the grammar masks are filled on the host."""

    def __init__(self, scheduled: SchedulerOutput, sampled: torch.Tensor | None = None,
                 timer: StepTimer | None = None, pending: PendingSample | None = None) -> None:
        self.scheduled = scheduled
        self.pending = pending
        """the logits to sample, while the step waits for its masks (None once sampled)"""
        self.rows: dict[int, int] = {}
        """request id -> the row of `sampled` holding its next input (its last row)"""
        row = -1
        for chunk in scheduled.sampling:
            row += 1 + len(chunk.draft_token_ids)
            self.rows[chunk.request.id] = row
        self.sampled: torch.Tensor | None = None
        self.timer: StepTimer | None = None
        """the step's device time, where it measures the step cost of the shape the engine runs
        (None: a step that captured a CUDA graph, or ran eagerly where decode steps use graphs)"""
        self._ready: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._logprobs: StepLogprobs | None = None  # on the host once `_ready`
        self._estimates: DraftEstimates | None = None  # likewise
        if sampled is not None:
            self.set_sampled(sampled, timer)

    @property
    def constrained(self) -> bool:
        """Whether a row of the step samples under a grammar."""
        return any(c.request.grammar is not None for c in self.scheduled.sampling)

    def set_sampled(self, sampled: torch.Tensor, timer: StepTimer | None = None,
                    logprobs: StepLogprobs | None = None, estimates: DraftEstimates | None = None) -> None:
        """The step's tokens (and the log-probabilities rows asked for, and what drawn and chosen
        drafts keep where drafts came with q), on the device; their copy to the host is enqueued now."""
        self.sampled, self.timer = sampled, timer
        self._host = _to_host(sampled)
        if logprobs is not None:
            self._logprobs = StepLogprobs(logprobs.rows, _to_host(logprobs.chosen), _to_host(logprobs.top_values),
                                          _to_host(logprobs.top_ids))
        if estimates is not None:
            self._estimates = DraftEstimates(estimates.rows, _to_host(estimates.kept))
        if sampled.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> RunnerOutput:
        """Wait for the step and read its tokens back (raises if the device failed under it)."""
        if self.pending is not None:
            raise RuntimeError("a step is read back before it was sampled (ModelRunner.sample)")
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host.tolist()
        logprobs = self._token_logprobs(tokens)
        estimates = None if self._estimates is None else dict(zip(self._estimates.rows,
                                                                  map(tuple, self._estimates.kept.tolist())))
        out, kept_logprobs, row = [], [], 0
        chunk_estimates: list[tuple[float, float] | None] = []
        for chunk in self.scheduled.chunks:
            if estimates is not None:
                chunk_estimates.append(estimates.get(row) if chunk.sample else None)  # its first draft's row
            if not chunk.sample:
                out.append([])
                kept_logprobs.append([])
                continue
            drafts = chunk.draft_token_ids
            start = row
            targets = tokens[start:start + 1 + len(drafts)]
            row += 1 + len(drafts)
            # drafts are kept while they equal what the target sampled after the input before
            # them; the first that differs is replaced by the target's token (lossless: see
            # `Sampler`), and when all match, the token after the last is a free one
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
                accepted += 1
            out.append(targets[:accepted + 1])
            kept_logprobs.append([logprobs[r] for r in range(start, start + accepted + 1) if r in logprobs])
        return RunnerOutput(out, kept_logprobs if logprobs else None, chunk_estimates if estimates else None)

    def _token_logprobs(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Sampling row -> its token's TokenLogprob, for the rows that asked (host tensors)."""
        if self._logprobs is None:
            return {}
        lp = self._logprobs
        params = [c.request.params for c in self.scheduled.sampling for _ in range(1 + len(c.draft_token_ids))]
        out = {}
        for row, chosen, values, ids in zip(lp.rows, lp.chosen.tolist(), lp.top_values.tolist(), lp.top_ids.tolist()):
            k = params[row].top_logprobs
            out[row] = TokenLogprob(tokens[row], chosen, tuple(zip(ids[:k], values[:k])))
        return out


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy to pinned host memory, enqueued (read it once the step's event is
    reached); a host tensor as it is."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def gather_step(scheduled: SchedulerOutput, previous: StepInFlight | None = None) -> StepData:
    """The step's inputs. Positions past a state's known history hold the token its request
    sampled in the previous step, still on the device (async scheduling)."""
    ids: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    logits_indices: list[int] = []
    from_device: list[DeviceInput] = []
    groups = len(scheduled.chunks[0].request.seq.tables)
    slots: list[list[int]] = [[] for _ in range(groups)]
    tables: list[list[list[int]]] = [[] for _ in range(groups)]
    for chunk in scheduled.chunks:
        seq = chunk.request.seq
        drafts = chunk.draft_token_ids
        end = chunk.end - len(drafts)  # inputs before `end`: history, or the token in flight
        known = min(end, len(seq))
        ids.extend(seq.tokens[chunk.start:known])
        if known < end:  # one placeholder: the previous step's token for this request
            if previous is None or chunk.request.id not in previous.rows or end - known != 1:
                raise RuntimeError(f"step input at position {known} is neither known nor in flight")
            from_device.append(DeviceInput(len(ids), previous.rows[chunk.request.id]))
            ids.append(0)
        ids.extend(drafts)
        positions.extend(seq.rope_positions(chunk.start, chunk.end))  # LongRoPE: its long rows
        for g, group_slots in enumerate(seq.slots(chunk.start, chunk.end)):
            slots[g].extend(group_slots)
            tables[g].append(seq.tables[g])
        seq_lens.append(chunk.end)
        starts.append(starts[-1] + chunk.num_tokens)
        if chunk.sample:
            logits_indices.extend(range(starts[-1] - 1 - len(drafts), starts[-1]))
    state_slots = has_state = None
    if scheduled.chunks[0].request.seq.recurrent is not None:  # a hybrid model's states
        state_slots = [-1 if c.request.seq.recurrent.slot is None else c.request.seq.recurrent.slot
                       for c in scheduled.chunks]
        has_state = [c.start > 0 for c in scheduled.chunks]
    return StepData(ids, positions, slots, seq_lens, starts, tables, logits_indices,
                    max(c.num_tokens for c in scheduled.chunks), from_device, state_slots, has_state,
                    not scheduled.verifies)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, ctx: ForwardContext, sampler: Sampler,
                 device: torch.device, max_model_len: int, max_batch: int,
                 cuda_graphs: bool = True) -> None:
        self.model, self.ctx, self.sampler, self.device = model, ctx, sampler, device
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda":
            self.graphs = DecodeGraphs(self, max_batch)

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return device_tensor(values, dtype, self.device)

    def prepare(self, data: StepData) -> ModelInput:
        width = max(len(t) for group in data.tables for t in group)
        padded = [[t + [0] * (width - len(t)) for t in group] for group in data.tables]
        batch = ForwardBatch(
            slot_mapping=self._tensor(data.slots),
            block_tables=self._tensor(padded, torch.int32),
            seq_lens=self._tensor(data.seq_lens, torch.int32),
            query_start_loc=self._tensor(data.starts, torch.int32),
            max_query_len=data.max_query_len,
            max_seq_len=max(data.seq_lens),
            **self._recurrent_inputs(data),
        )
        return ModelInput(self._tensor(data.ids), self._tensor(data.positions), batch,
                          self._tensor(data.logits_indices))

    def _recurrent_inputs(self, data: StepData) -> dict:
        """A hybrid model's batch fields: each sequence's state slot, and whether it continues a
        state (a chunk from position 0 starts from zeros)."""
        if data.state_slots is None:
            return {}
        return dict(state_slots=self._tensor(data.state_slots, torch.int32),
                    has_state=self._tensor(data.has_state, torch.bool), writes_state=data.writes_state)

    def _scratch_state(self) -> dict:
        """A hybrid model's batch fields for a step of one sequence that belongs to no state: the
        recurrent cache's scratch slot, from zeros."""
        if self.ctx.recurrent is None:
            return {}
        return dict(state_slots=self._tensor([self.ctx.recurrent.scratch], torch.int32),
                    has_state=self._tensor([False], torch.bool))

    def commit_recurrent(self, scheduled: SchedulerOutput) -> None:
        """After a verify step was taken into its requests: each hybrid state folds in the rows
        its sequence kept (drafts accepted, the input before them, whole prompt chunks). Rows that
        reach a prompt's end are folded in two parts, the state kept there between them
        (`keep_prompt_state`) as after a step that writes the states."""
        chunks = scheduled.chunks
        if chunks[0].request.seq.recurrent is None:
            return
        states = [c.request.seq.recurrent for c in chunks]
        try:
            # to the prompt's end (nothing for a chunk past it), then the rest
            first = [s.commit(min(c.request.seq.num_computed, max(c.request.num_prompt, c.start)), partial=True)
                     for s, c in zip(states, chunks)]
            if any(first):
                self.model.commit_recurrent(self._tensor(first, torch.int32))
                for state, chunk in zip(states, chunks):
                    if state.pending is not None and state.pending > chunk.start:
                        keep_prompt_state(chunk.request)
            rest = [s.commit(c.request.seq.num_computed) for s, c in zip(states, chunks)]
            if any(rest):
                self.model.commit_recurrent(self._tensor(rest, torch.int32),
                                            self._tensor(first, torch.int32) if any(first) else None)
        except BaseException:  # the states' positions may be past what their slots hold: recomputed
            for chunk in chunks:
                chunk.request.seq.release()
            raise

    def take_from_device(self, input_ids: torch.Tensor, data: StepData,
                         previous: StepInFlight | None) -> None:
        """Put the previous step's sampled tokens, still on the device, into this step's inputs."""
        if not data.from_device:
            return
        n = len(data.from_device)
        if (previous.sampled.shape[0] == n
                and all(d.index == i and d.row == i for i, d in enumerate(data.from_device))):
            input_ids[:n].copy_(previous.sampled)  # every row decodes, in the same order: the usual case
            return
        index = self._tensor([d.index for d in data.from_device])
        rows = self._tensor([d.row for d in data.from_device])
        input_ids.index_copy_(0, index, previous.sampled.index_select(0, rows))

    @torch.inference_mode()
    def launch(self, scheduled: SchedulerOutput, previous: StepInFlight | None = None,
               ready: Callable[[], None] | None = None) -> StepInFlight:
        """Enqueue one scheduled step. `previous`: the step before, which may still be in flight.
        A step with constrained rows comes back `pending`: its forward is enqueued and its
        sampling waits for `sample` with the grammar masks (filled while the device computes).
        `ready`: called once the step's host work is done, before its first device work that
        must follow the previous step's (which may still be `pending`: its sampling is enqueued
        there, so the host work overlaps the fill of its masks)."""
        data = gather_step(scheduled, previous)
        rows = sampling_rows(scheduled)
        timers: list[StepTimer] = []

        def start() -> None:  # the step's time counts from here, not from the previous one's sampling
            if ready is not None:
                ready()
            timers.append(StepTimer(self.device))

        # the steps speculation plans: decodes and verify steps (graph replays where graphs exist);
        # a prompt chunk's cost depends on its context as much as on its tokens
        representative = self.graphs is None and all(
            c.sample and c.num_tokens == 1 + len(c.draft_token_ids) for c in scheduled.chunks)
        if self.graphs is not None and self.graphs.fits(data, len(rows)):
            logits, captured = self.graphs.run(data, previous, start)
            representative = not captured
            if data.state_slots is not None and data.writes_state:  # (a decode graph's step writes the states)
                snapshot_states(scheduled)
        else:
            start()
            inputs = self.prepare(data)
            self.take_from_device(inputs.input_ids, data, previous)
            with self.ctx.forward_batch(inputs.batch):
                hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
            if data.state_slots is not None and data.writes_state:
                snapshot_states(scheduled)
            if not rows:
                return StepInFlight(scheduled, torch.empty(0, dtype=torch.long))
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, vocab]
        step = StepInFlight(scheduled, pending=PendingSample(logits, rows, timers[0] if representative else None))
        if not step.constrained:
            self.sample(step)
        return step

    @torch.inference_mode()
    def sample(self, step: StepInFlight, masks: TokenMasks | None = None) -> None:
        """Enqueue the sampling of a launched step (`masks`: its constrained rows' grammar masks)."""
        pending, step.pending = step.pending, None
        rows = pending.rows
        sampled, estimates = self.sampler.sample(pending.logits, rows, masks)  # (estimates: drafts that came with q)
        self._force(sampled, rows, step.scheduled)
        step.set_sampled(sampled, None if pending.timer is None else pending.timer.stop(),
                         self.sampler.logprobs(pending.logits, rows, sampled), estimates)

    def _force(self, sampled: torch.Tensor, rows: list[SamplingRow], scheduled: SchedulerOutput) -> None:
        """Trace replay (bench only): rows of requests with forced outputs take the recorded
        token, so drafts are verified against what the traced model produced."""
        if not any(c.request.forced is not None for c in scheduled.sampling):
            return
        index, tokens = [], []
        row = 0
        for chunk in scheduled.sampling:
            forced = chunk.request.forced
            for _ in range(1 + len(chunk.draft_token_ids)):
                if forced is not None and rows[row].draw < len(forced):
                    index.append(row)
                    tokens.append(forced[rows[row].draw])
                row += 1
        if index:
            sampled.index_copy_(0, self._tensor(index), self._tensor(tokens))

    @torch.inference_mode()
    def profile(self, num_tokens: int) -> None:
        """One step over `num_tokens` tokens that writes no KV, as the engine would run it (the
        step-cost profile of speculation's controller): the CUDA graph of that many decode and
        verify tokens where graphs are used (captured now if it was not), else one eager forward
        over one sequence."""
        if self.graphs is not None and self.graphs.profile(num_tokens):
            return
        bs, groups = self.ctx.kv_cache.block_size, len(self.ctx.kv_cache.layout.groups)
        batch = ForwardBatch(
            slot_mapping=self._tensor([[-1] * num_tokens] * groups),
            block_tables=self._tensor([[[0] * -(-num_tokens // bs)]] * groups, torch.int32),
            seq_lens=self._tensor([num_tokens], torch.int32),
            query_start_loc=self._tensor([0, num_tokens], torch.int32),
            max_query_len=num_tokens, max_seq_len=num_tokens, **self._scratch_state())
        with self.ctx.forward_batch(batch):
            hidden = self.model(self._tensor([0] * num_tokens), self._tensor(list(range(num_tokens))))
        self.model.compute_logits(hidden[-1:]).argmax(dim=-1)


def snapshot_states(scheduled: SchedulerOutput) -> None:
    """A hybrid model's states keep a copy of themselves where a request's prompt ends (enqueued
    after the step that computes it): where the next turn's history leaves this one (a template
    that re-renders the reply), they continue from there (`RecurrentState.rewind`). At multiples
    of the share stride they publish one for other agents (`KVSequence.publish_state`)."""
    for chunk in scheduled.chunks:
        if chunk.end <= chunk.request.num_prompt:
            keep_prompt_state(chunk.request)


def keep_prompt_state(request: Request) -> None:
    """A hybrid state just computed to a position within its request's prompt: at the prompt's end,
    and at the request's `snapshot_at` (where a chat template's generation prompt starts), it keeps
    a snapshot (`RecurrentState.snapshot`); at a multiple of the share stride it is published for
    other agents whose histories start alike (`KVSequence.publish_state`)."""
    seq = request.seq
    if seq.recurrent.position in (request.num_prompt, request.snapshot_at):
        seq.recurrent.snapshot()
    seq.publish_state()


def sampling_rows(scheduled: SchedulerOutput) -> list[SamplingRow]:
    """One row per token sampled this step: a chunk's last input, and each of its drafts (whose
    penalties count the drafts before it as generated). The row that samples where draft i stands
    carries it, with the distribution it was drawn from where the drafter sampled it."""
    rows = []
    for chunk in scheduled.sampling:
        r = chunk.request
        prompt = r.prompt if r.params.repetition_penalty != 1.0 else ()
        first = len(r.output) + r.num_output_placeholders - 1  # index of the token this row draws
        drafts, probs = chunk.draft_token_ids, chunk.draft_probs
        for i in range(1 + len(drafts)):
            output = r.output if i == 0 else [*r.output, *drafts[:i]]
            draft = DraftRow(drafts[i], probs[i], chunk.drafts_drawn, i) if probs is not None and i < len(drafts) else None
            rows.append(SamplingRow(r.params, r.generator, prompt, output, first + i, draft))
    return rows


class DecodeGraphs:
    """CUDA graphs of decode and verify steps, one per (batch-size bucket, query tokens per
    sequence): every sequence samples and has at most `query_len` new tokens (1 for decode;
    1 + drafts for a verify step, `query_len` rounded up to a tier). A sequence with fewer is
    padded at the front with rows that recompute earlier positions and write nowhere (slot -1):
    attention reads keys from the cache, so those rows change nothing; their logits are dropped.
    Padding sequences write nowhere either. A hybrid model's linear-attention layers leave the
    padding rows out (`ForwardBatch.state_skip`: a state folds in every row it runs) and their
    verify graphs keep what the commit of the kept rows reads in a static `VerifyStash` (of
    `STASH_BYTES` at most: steps of more rows run eagerly). Inputs live in static buffers.
    Attention is captured with max_seq_len = a span (`SPANS`, then the engine's max_model_len) at
    least the step's longest sequence, which the kernels allow (bounds may overstate): one graph
    per span serves every context length up to it.

        query_len 5:   seq 0 (2 new):  pad pad pad | t  d          (rows i * 5 ... i * 5 + 4)
                       seq 1 (5 new):  t   d   d   d  d
    """

    QUERY_LENS = (1, 2, 3, 5, 9, 17)  # 1 + draft tiers 0, 1, 2, 4, 8, 16
    STASH_BYTES = 256 << 20
    """A hybrid model's verify stash at most (every verify graph's rows up to what it holds):
    Qwen3.5-35B-A3B keeps 1.0 MB a row across its 30 linear layers, so 17 rows (batch 1, 16
    drafts) take 17 MB and 256 rows the whole 256 MB."""
    MAX_CAPTURE_FAILURES = 2  # then that shape runs eagerly
    SPANS = (1024, 2048)
    """Context lengths below the engine's max_model_len that get graphs of their own. Decode
    attention is split for the longest sequence a graph may see (`attention_triton._num_splits`),
    and a split past a sequence's keys is a program that does nothing: at batch 1 an 8k context
    makes 64 splits a KV head where 1024 keys make 16 (qwen3-8b w4 at 512 keys on the H200: a
    2.055 ms replay against 1.948, bench/RESULTS.md 2026-12-04). A shorter span splits the keys of
    a sequence it covers as the longer one does (splits are whole key tiles, and the merge reduces
    them in one order whatever their count), so a step's outputs agree to the bit whichever span
    runs it. Graphs are captured on first use: a span costs nothing
    until a step uses it."""

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        # a proxy: the runner holds its graphs, and a cycle back would keep the model's weights
        # alive after the engine closed until the garbage collector ran (a second engine on the
        # GPU meanwhile found its memory taken: qwen3-30b-a3b ran out of it loading)
        self.runner = weakref.proxy(runner)
        self.buckets = self.buckets_for(max_batch)
        self.max_blocks = -(-runner.max_model_len // runner.ctx.kv_cache.block_size)
        self.spans = sorted({s for s in self.SPANS if s < runner.max_model_len} | {runner.max_model_len})
        groups = len(runner.ctx.kv_cache.layout.groups)
        # keyed by (batch bucket, query length, span): `key`
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = None  # one CUDA graph memory pool shared by every graph
        self.failures: dict[tuple[int, int, int], int] = {}  # failed captures per key
        self.failed_graphs: list[torch.cuda.CUDAGraph] = []  # see `_forget`
        n, q, dev = self.buckets[-1], self.QUERY_LENS[-1], runner.device
        self.input_ids = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n * q, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((groups, n * q), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(groups, n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_starts = {q: torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=dev)
                             for q in self.QUERY_LENS}  # one per query length: graphs keep their own
        # a hybrid model's recurrent layers: each sequence's slot (-1: a padding sequence), whether it
        # continues one, the padding rows in front of its rows; the stash of verify graphs (their
        # records of it per graph: `verified`)
        recurrent = runner.ctx.recurrent
        self.hybrid = recurrent is not None
        self.state_slots = torch.full((n,), -1, dtype=torch.int32, device=dev) if self.hybrid else None
        self.has_state = torch.zeros(n, dtype=torch.bool, device=dev) if self.hybrid else None
        self.state_skip = torch.zeros(n, dtype=torch.int32, device=dev) if self.hybrid else None
        self.verify_rows = self.stash_rows(max_batch, recurrent.shapes, recurrent.dtype) if self.hybrid else 0
        self._stash: VerifyStash | None = None  # made at the first verify graph (a draft model's graphs have none)
        self.verified: dict[tuple[int, int, int], list] = {}

    @staticmethod
    def buckets_for(max_batch: int) -> list[int]:
        """The batch-size buckets of graphs for up to max_batch sequences."""
        buckets = [b for b in _BUCKETS if b <= max(1, max_batch)]
        if buckets[-1] < max_batch and max_batch <= _BUCKETS[-1]:
            buckets.append(_BUCKETS[bisect.bisect_left(_BUCKETS, max_batch)])
        return buckets

    @classmethod
    def stash_rows(cls, max_batch: int, shapes: list, dtype: torch.dtype) -> int:
        """Rows of a hybrid model's verify stash: the largest verify graph's, within `STASH_BYTES`."""
        return min(cls.buckets_for(max_batch)[-1] * cls.QUERY_LENS[-1],
                   cls.STASH_BYTES // VerifyStash.row_bytes(shapes, dtype))

    def fits(self, data: StepData, num_sampling: int) -> bool:
        """Every sequence samples (once, or after each draft) and has at most the largest query
        length and enough context for its front padding."""
        query_len = self._query_len(data.max_query_len)
        sequences = len(data.seq_lens)
        if self.hybrid and query_len is not None and (  # decode graphs write the states, verify graphs do not
                data.writes_state != (query_len == 1) or not self._stashed(sequences, query_len)):
            return False  # (a prompt's tail without drafts, or a verify step of more rows than the stash: eager)
        return (query_len is not None and sequences <= self.buckets[-1]
                and num_sampling == len(data.logits_indices)
                and (query_len == 1 or min(data.seq_lens) >= query_len)
                and self._samples_every_chunk(data)
                and max(data.seq_lens) <= self.spans[-1]
                and max(len(t) for group in data.tables for t in group) <= self.max_blocks)

    def _stashed(self, sequences: int, query_len: int) -> bool:
        """Whether a hybrid model's graph of this many sequences and rows each fits the verify stash
        (a decode graph does: it keeps nothing there)."""
        i = bisect.bisect_left(self.buckets, sequences)
        return query_len == 1 or (i < len(self.buckets) and self.buckets[i] * query_len <= self.verify_rows)

    @staticmethod
    def _samples_every_chunk(data: StepData) -> bool:
        ends = set(data.starts[1:])
        return len({i for i in data.logits_indices if i + 1 in ends}) == len(data.seq_lens)

    def key(self, sequences: int, max_query_len: int, longest: int) -> tuple[int, int, int]:
        """The graph of a step of `sequences` sequences, at most `max_query_len` new tokens each,
        the longest `longest` tokens with them (`fits` said one covers it): (batch bucket, query
        length tier, span)."""
        return (self.buckets[bisect.bisect_left(self.buckets, sequences)], self._query_len(max_query_len),
                self.spans[bisect.bisect_left(self.spans, longest)])

    def _query_len(self, max_query_len: int) -> int | None:
        i = bisect.bisect_left(self.QUERY_LENS, max_query_len)
        return self.QUERY_LENS[i] if i < len(self.QUERY_LENS) else None

    @staticmethod
    def _pad_rows(data: StepData, bucket: int, q: int):
        """Inputs of a verify graph: each sequence front-padded to q rows, then padding
        sequences; `rows`: the graph row of each packed input row; `pads`: each sequence's padding rows."""
        n = len(data.seq_lens)
        ids, positions, rows, pads = [], [], [], []
        slots: list[list[int]] = [[] for _ in data.slots]
        for i in range(bucket):
            if i < n:
                start, end, seq_len = data.starts[i], data.starts[i + 1], data.seq_lens[i]
                pad = q - (end - start)
                pads.append(pad)
                ids += [0] * pad + data.ids[start:end]
                positions += list(range(seq_len - q, seq_len - q + pad)) + data.positions[start:end]
                for group, group_slots in zip(slots, data.slots):
                    group += [-1] * pad + group_slots[start:end]
                rows += range(i * q + pad, (i + 1) * q)
            else:
                ids += [0] * q
                positions += list(range(q))
                for group in slots:
                    group += [-1] * q
                pads.append(0)
        return ids, positions, slots, rows, pads

    def run(self, data: StepData, previous: StepInFlight | None,
            ready: Callable[[], None] | None = None) -> tuple[torch.Tensor, bool]:
        """The step's logits, and whether its graph was captured now (`ready`: as for
        `ModelRunner.launch`, called between the host work and the copies)."""
        n = len(data.seq_lens)
        bucket, q, span = self.key(n, data.max_query_len, max(data.seq_lens))
        if q == 1:  # decode: the packed rows are the graph's rows
            pad = bucket - n
            ids, positions = data.ids + [0] * pad, data.positions + [0] * pad
            slots = [group + [-1] * pad for group in data.slots]
            rows, pads = range(bucket), None
        else:
            ids, positions, slots, rows, pads = self._pad_rows(data, bucket, q)
        # one host tensor and one copy per static input; the previous step's tokens on the device
        tables = torch.zeros(len(data.tables), bucket, self.max_blocks, dtype=torch.int32)
        for g, group in enumerate(data.tables):
            for i, table in enumerate(group):
                tables[g, i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        ids, positions, slots = torch.tensor(ids), torch.tensor(positions), torch.tensor(slots)
        seq_lens = torch.tensor(data.seq_lens + [q] * (bucket - n), dtype=torch.int32)
        if ready is not None:
            ready()
        size = bucket * q
        self.input_ids[:size].copy_(ids, non_blocking=True)
        self.positions[:size].copy_(positions, non_blocking=True)
        self.slot_mapping[:, :size].copy_(slots, non_blocking=True)
        self.seq_lens[:bucket].copy_(seq_lens, non_blocking=True)
        self.block_tables[:, :bucket].copy_(tables, non_blocking=True)
        if self.hybrid:
            self.state_slots[:bucket].copy_(torch.tensor(data.state_slots + [-1] * (bucket - n), dtype=torch.int32),
                                            non_blocking=True)
            self.has_state[:bucket].copy_(torch.tensor(data.has_state + [False] * (bucket - n)), non_blocking=True)
            if pads is not None:
                self.state_skip[:bucket].copy_(torch.tensor(pads, dtype=torch.int32), non_blocking=True)
        if data.from_device:
            moved = [DeviceInput(rows[d.index], d.row) for d in data.from_device]
            self.runner.take_from_device(self.input_ids, replace(data, from_device=moved), previous)
        # a capture (or an attempt) makes this step's time no measure of the shape's; a shape
        # that stays eager (`MAX_CAPTURE_FAILURES`) costs what it costs
        captured = (bucket, q, span) not in self.graphs and not self._stays_eager((bucket, q, span))
        logits = self._replay(bucket, q, span)
        if q == 1:
            return logits[:n], captured
        index = self.runner._tensor([rows[i] for i in data.logits_indices])
        return logits.index_select(0, index), captured

    def _replay(self, bucket: int, q: int, span: int) -> torch.Tensor:
        key = (bucket, q, span)
        if key not in self.graphs:
            if self._stays_eager(key):
                return self._forward(bucket, q, span)
            graph = torch.cuda.CUDAGraph()
            try:
                self.graphs[key] = graph, self._capture(graph, bucket, q, span)
                if self.hybrid and q > 1:  # what the captured forward left for the commit: the stash's rows
                    self.verified[key] = self.runner.model.verified
            except Exception as error:  # noqa: BLE001 - the step runs eagerly; the error is logged
                self.failures[key] = self.failures.get(key, 0) + 1
                self._forget(graph)
                logger.warning("CUDA graph capture for %d sequences x %d tokens up to %d keys failed (%s: %s); "
                               "this step runs without a graph%s", bucket, q, span, type(error).__name__, error,
                               ", and so will the steps of this shape from now on" if self._stays_eager(key) else "")
                return self._forward(bucket, q, span)
        graph, logits = self.graphs[key]
        graph.replay()
        if key in self.verified:  # a hybrid verify graph's record of its stash, for the commit
            self.runner.model.verified = self.verified[key]
        return logits

    def _stays_eager(self, key: tuple[int, int, int]) -> bool:
        return self.failures.get(key, 0) >= self.MAX_CAPTURE_FAILURES

    def profile(self, num_tokens: int) -> bool:
        """Replay the graph a step of `num_tokens` sampling tokens runs (one sequence with up to
        17 tokens; beyond that, sequences of 17), on inputs that write nowhere and attend to
        their own few positions. False where no graph covers that many tokens."""
        top = self.QUERY_LENS[-1]
        if num_tokens <= top:
            bucket, q = self.buckets[0], self._query_len(num_tokens)
        else:
            i = bisect.bisect_left(self.buckets, -(-num_tokens // top))
            if i == len(self.buckets):
                return False
            bucket, q = self.buckets[i], top
        if self.hybrid and q > 1 and not self._stashed(bucket, q):
            return False
        self._write_nowhere(bucket, q)
        self._replay(bucket, q, self.spans[0])  # the few positions fit the shortest span
        return True

    def capture(self, max_sequences: int = 1, max_drafts: int | None = 0) -> int:
        """Capture now the graphs of steps of up to `max_sequences` sequences with up to
        `max_drafts` drafts each (None: as many as a verify step takes) at every span, where not
        captured yet (or given up on): a graph is otherwise captured by the first step of its
        shape, which then takes tens of milliseconds longer (a conversation crossing a span, a
        draft length first chosen). Returns how many were captured."""
        tiers = self.QUERY_LENS if max_drafts is None else \
            self.QUERY_LENS[:bisect.bisect_left(self.QUERY_LENS, max_drafts + 1) + 1]  # up to max_drafts + 1's tier
        buckets = self.buckets[:bisect.bisect_left(self.buckets, max(1, max_sequences)) + 1]
        captured = 0
        for bucket in buckets:
            for q in tiers:
                for span in self.spans:
                    key = (bucket, q, span)
                    if key in self.graphs or self._stays_eager(key) or (
                            self.hybrid and q > 1 and not self._stashed(bucket, q)):
                        continue
                    self._write_nowhere(bucket, q)
                    self._replay(bucket, q, span)
                    captured += key in self.graphs
        return captured

    def _write_nowhere(self, bucket: int, q: int) -> None:
        """Inputs of `bucket` sequences of q tokens that write no KV (slot -1) and attend to their
        own few positions of block 0 (a profile's or an ahead capture's step)."""
        size = bucket * q
        self.input_ids[:size].zero_()
        self.positions[:size].copy_(torch.arange(size, device=self.positions.device) % q)
        self.slot_mapping[:, :size].fill_(-1)
        self.seq_lens[:bucket].fill_(q)
        self.block_tables[:, :bucket].zero_()
        if self.hybrid:  # no state read or written
            self.state_slots[:bucket].fill_(-1)
            self.state_skip[:bucket].zero_()

    def _forward(self, bucket: int, q: int, span: int) -> torch.Tensor:
        size = bucket * q
        recurrent = {}
        if self.hybrid:  # decode graphs write the states; verify graphs leave them to the commit
            recurrent = dict(state_slots=self.state_slots[:bucket], has_state=self.has_state[:bucket],
                             writes_state=q == 1)
            if q > 1:
                recurrent.update(state_skip=self.state_skip[:bucket], state_stash=self.stash)
        batch = ForwardBatch(self.slot_mapping[:, :size], self.block_tables[:, :bucket],
                             self.seq_lens[:bucket], self.query_starts[q][:bucket + 1],
                             max_query_len=q, max_seq_len=span,
                             uniform_query_len=True, **recurrent)
        model = self.runner.model
        with self.runner.ctx.forward_batch(batch):
            hidden = model(self.input_ids[:size], self.positions[:size])
        return model.compute_logits(hidden)

    @property
    def stash(self) -> VerifyStash:
        """The verify graphs' stash (`verify_rows` rows), made at first use."""
        if self._stash is None:
            recurrent = self.runner.ctx.recurrent
            self._stash = VerifyStash(recurrent.shapes, self.verify_rows, recurrent.dtype, self.state_slots.device)
        return self._stash

    def _forget(self, graph: torch.cuda.CUDAGraph) -> None:
        """After a failed capture: when ending the capture raised (an invalidated capture),
        torch has not ended the allocator's recording into the pool, whose filter refers to the
        graph object, so the graph is kept alive and the recording ended here where torch
        exposes it (`graph.pool()` itself raises after a failed capture: the pool is ours,
        `_capture`). Later graphs take a new pool; the failed one's memory stays allocated
        (torch releases a pool only after a capture that ended), at most two partial captures
        a shape."""
        self.failed_graphs.append(graph)
        failed, self.mempool = self.mempool, None
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if failed is not None and end is not None:
            try:
                end(self.runner.device.index or 0, failed)
            except Exception:  # noqa: BLE001, S110 - ended already (the capture's own end ran)
                pass

    def _capture(self, graph: torch.cuda.CUDAGraph, bucket: int, q: int, span: int) -> torch.Tensor:
        """Warm up, then capture. The capture is "thread_local": other threads of the process
        may meanwhile call what a capture forbids (the pinned-memory warmer of the host tier
        allocates page-locked chunks, a second engine loads), which in the default "global" mode
        invalidates this capture. On failure the outer stream context restores the step loop's
        stream, which `torch.cuda.graph` leaves set when ending the capture raises."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        slots = None
        if self.hybrid:  # warm-ups run the step for real: a recurrent state would fold its tokens in twice more
            slots = self.state_slots.clone()
            self.state_slots.fill_(-1)
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compiles, rotary tables get built
                self._forward(bucket, q, span)
        torch.cuda.current_stream().wait_stream(stream)
        if slots is not None:
            self.state_slots.copy_(slots)
        if self.mempool is None:  # the pool's id is ours, known also when the capture fails
            self.mempool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=self.mempool, stream=stream,
                                                         capture_error_mode="thread_local"):
            logits = self._forward(bucket, q, span)
        return logits
