"""The step loop: schedule, launch, update; the step in flight; the step counters.

    step N:    schedule N -> launch N -> [between steps: prefetch] -> update N-1 (its tokens
               read back) -> deliver events
               (without async scheduling, when a request's sampling reads its history on the
               host, or when step N verifies drafts: update N at once)

A step with constrained rows (json_schema, regex, grammar) launches its forward alone. Once
update N-1 has given every matcher its request's tokens, the grammar masks of step N are filled
on the host (`hibana_core.grammar`, on its worker thread) while the device runs forward N and
the engine thread delivers N-1's events, schedules N+1 and prepares its inputs; step N's
sampling is enqueued with the masks just before forward N+1 (`ModelRunner.launch`'s `ready`):

    step N+1:  schedule N+1 -> launch N+1 [host work -> sample N -> forward N+1] -> update N ...

so that the fill hides under the forward where the host is the bound (32 rows of a 151k
vocabulary take ~2.7 ms on the H200 machine's host). Without a step to launch next, step N is
sampled where the next step would have been launched; a sampling that fails there fails step N's
requests, and step N+1, scheduled meanwhile, is reverted and scheduled again.

Speculation needs a sequence's real history to draft from: when the speculation policy says some
running sequence would draft (`Speculator.wants_history`), the step in flight is updated before
the next is scheduled. Each step's wall time goes to the policy's step-cost model.

With async scheduling (on for CUDA) a step is launched before the previous step's tokens reach the
host: `Scheduler.schedule` already counted the previous step's KV and a placeholder per sampled
token, and the runner takes those tokens from the device. The host work of one step then overlaps
the device work of the next. One background thread steps while there is work; callers submit
requests from any thread or event loop and read their events (`RequestEvents`).
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import sys
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Callable

from hibana_core.errors import HibanaError, hibana_error
from hibana_core.output import OutputProcessor, RequestEvents
from hibana_core.runner import ModelRunner, StepInFlight
from hibana_core.sampler import needs_history
from hibana_core.scheduler import Request, RequestOutput, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from hibana_core.grammar import Grammars
    from hibana_core.sampler import TokenMasks


_LIVE_CORES: "weakref.WeakSet[EngineCore]" = weakref.WeakSet()


@atexit.register
def _close_live_cores() -> None:
    """A script that ends with generations in flight exits cleanly: the step threads stop before
    the interpreter tears down what they use (else the process aborts in native code)."""
    for core in list(_LIVE_CORES):
        core.close(HibanaError("the process is exiting"))


SWITCH_INTERVAL = 0.0005
"""The process's GIL switch interval while an engine runs (Python's default: 5 ms): how long a
thread that wants the GIL waits before the thread holding it must let go. The step loop lets
the GIL go at every native call (a torch launch, a wait on the device, xgrammar filling masks)
and must get it back at once: with callers' threads busy in Python (an HTTP server's event loop,
agents' threads reading their streams) it waited up to 5 ms each time while the device sat idle.
On the H200's qwen3-8b preset a turn over HTTP cost 18.6% more than in process at 5 ms and 5.1%
at 0.5 ms (`bench/run_h200.sh serve`)."""

_handoff_lock = threading.Lock()
_handoff_holders = 0
_switch_interval_before = 0.0


def _hold_quick_gil_handoff() -> None:
    """Lower the switch interval to `SWITCH_INTERVAL` (never raise it) while any engine runs."""
    global _handoff_holders, _switch_interval_before
    with _handoff_lock:
        if _handoff_holders == 0:
            _switch_interval_before = sys.getswitchinterval()
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        _handoff_holders += 1


def _release_quick_gil_handoff() -> None:
    """The last engine to stop puts the process's own switch interval back."""
    global _handoff_holders
    with _handoff_lock:
        _handoff_holders -= 1
        if _handoff_holders == 0:
            sys.setswitchinterval(_switch_interval_before)


STEP_TIME_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1.0, 2.5)
"""Upper bounds (seconds) of the step-time histogram's buckets (`StepCounters.timed`)."""


class StepCounters:
    def __init__(self) -> None:
        self.steps = 0
        self.multi_sequence_steps = 0  # steps that batched more than one sequence
        self.max_batch_sequences = 0
        self.step_seconds = 0.0        # wall time of the steps that did work, summed
        self.step_time_buckets = [0] * (len(STEP_TIME_BUCKETS) + 1)  # steps per bucket; the last: past all

    def count(self, scheduled: SchedulerOutput) -> None:
        self.steps += 1
        self.multi_sequence_steps += len(scheduled.chunks) > 1
        self.max_batch_sequences = max(self.max_batch_sequences, len(scheduled.chunks))

    def timed(self, seconds: float) -> None:
        """One step's wall time: schedule, launch, read back (with async scheduling, the previous
        step's tokens), so under load the engine's cadence."""
        self.step_seconds += seconds
        self.step_time_buckets[bisect.bisect_left(STEP_TIME_BUCKETS, seconds)] += 1


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor,
                 lock: threading.RLock, async_scheduling: bool, grammars: "Grammars | None" = None) -> None:
        self.scheduler, self.runner, self.outputs = scheduler, runner, outputs
        self.grammars = grammars
        self.async_scheduling = async_scheduling
        self.counters = StepCounters()
        self.in_flight: StepInFlight | None = None
        self._masks: "Callable[[], TokenMasks | None] | None" = None
        """The grammar masks of the step in flight, being filled while it waits to be sampled"""
        self._ready_seconds = 0.0  # of this step's host time, spent sampling the previous step
        self.lock = lock
        self.work = threading.Condition(lock)
        self.idle: Callable[[], float] | None = None
        """Called (under the lock) when there is no work: what the engine does meanwhile (bring
        back the parked states whose agents are due); returns the seconds to sleep at most."""
        self.between_steps: Callable[[], None] | None = None
        self._marked: list[Request] = []  # cancelled without the lock, not yet ended (`end_cancelled`)
        """Called (under the lock) once a step is launched: work whose device part overlaps that
        step's forward (bring back a parked state whose agent is due, its copy on a side stream)."""
        self.closed = False
        # the loop holds the core weakly, so an engine nobody closed is still collected
        self._thread = threading.Thread(target=_run_loop, args=(weakref.ref(self),),
                                        name="hibana-engine", daemon=True)
        _hold_quick_gil_handoff()
        self._handoff = weakref.finalize(self, _release_quick_gil_handoff)  # once: at close or collection
        self._thread.start()
        _LIVE_CORES.add(self)

    def step(self) -> bool:
        """One engine step. False when there was nothing to do."""
        with self.lock:
            started = time.perf_counter()
            if self.speculation is not None and self.speculation.may_profile(self.scheduler.running):
                # profiling the step costs replays CUDA graphs, whose outputs may share memory
                # with the logits of a step still waiting to be sampled
                self._sample_in_flight()
            early = self.in_flight if self.in_flight is not None and self._drafting_next() else None
            if early is not None:  # drafts are made from the tokens it brings back
                self.in_flight = None
                if early.pending is None or self._sample(early, self._take_masks()) is not None:
                    self._update(early)
            host_started, self._ready_seconds = time.perf_counter(), 0.0
            scheduled = self.scheduler.schedule()
            launched = self._launch(scheduled) if scheduled.chunks else None
            self._sample_in_flight()  # where nothing was launched, or the launch failed before it
            if launched is not None and self.async_scheduling and self.speculation is not None:
                # the host's own work: not the previous step's sampling (and its wait for the fill)
                self.speculation.observe_host(time.perf_counter() - host_started - self._ready_seconds)
            if launched is not None and self.between_steps is not None:
                self._between_steps()
            previous, self.in_flight = self.in_flight, launched
            if previous is not None:
                updated = self._read_back(previous)
                if updated is None and launched is not None:
                    # the device failed under the previous step, whose tokens this one took as
                    # inputs: it is dropped, its requests scheduled again
                    self.in_flight, launched = None, None
                    self.scheduler.revert(scheduled)
                if updated is not None:
                    if launched is not None and launched.pending is not None:
                        # the matchers hold the previous step's tokens now
                        self._masks = self._start_masks(launched)
                    self._deliver(previous, updated, self._masks is not None)
            if launched is not None and launched.pending is not None:
                if self._overlaps(scheduled):  # sampled before the next step's forward
                    if self._masks is None:
                        self._masks = self._start_masks(launched)
                else:
                    launched = self._sample(launched, self._take_masks())
            if launched is not None and not self._overlaps(scheduled):
                self.in_flight = None
                self._update(launched)
            self.deliver_finished()
            worked = bool(scheduled.chunks) or previous is not None or early is not None
            if worked:
                self.counters.timed(time.perf_counter() - started)
            return worked

    def _between_steps(self) -> None:
        """`between_steps`, whose failure (a device out of memory for a copy) fails no request:
        it failed the step, and so every running agent's request."""
        try:
            self.between_steps()
        except Exception as exc:
            warnings.warn(f"Hibana engine: its work between steps failed, the requests go on: {exc!r}")

    @property
    def speculation(self):
        return self.scheduler.speculation

    def _drafting_next(self) -> bool:
        return self.speculation is not None and self.speculation.wants_history(self.scheduler.running)

    def _launch(self, scheduled: SchedulerOutput) -> StepInFlight | None:
        unsampled = self.in_flight is not None and self.in_flight.pending is not None
        try:
            launched = self.runner.launch(scheduled, self.in_flight,
                                          ready=self._ready_to_launch if unsampled else None)
        except _PreviousFailed:  # the step before it could not be sampled: this one runs later
            self.scheduler.revert(scheduled)
            return None
        except Exception as exc:  # fails this step's requests; their states keep their KV
            self.scheduler.fail(scheduled, hibana_error(exc, "model step failed"))
            return None
        self.counters.count(scheduled)
        return launched

    def _sample_in_flight(self) -> bool:
        """Enqueue the sampling of the step in flight if it waits for its masks (their fill
        began when the step before it was read back); False where that failed (the step's
        requests failed with it, and nothing is in flight)."""
        step = self.in_flight
        return step is None or step.pending is None or self._sample(step, self._take_masks()) is not None

    def _ready_to_launch(self) -> None:
        """`ModelRunner.launch`'s `ready`: a step scheduled after a step that could not be
        sampled must not run (it took that step's tokens as its inputs)."""
        started = time.perf_counter()
        sampled = self._sample_in_flight()
        self._ready_seconds += time.perf_counter() - started
        if not sampled:
            raise _PreviousFailed

    def _take_masks(self) -> "Callable[[], TokenMasks | None] | None":
        masks, self._masks = self._masks, None
        return masks

    def _sample(self, step: StepInFlight,
                started: "Callable[[], TokenMasks | None] | None" = None) -> StepInFlight | None:
        """Sample a step whose rows wait for grammar masks: the matchers now hold every token
        read back, the forward runs on the device meanwhile. `started`: their fill, under way."""
        try:
            masks = started() if started is not None else self.grammars.masks(step.scheduled,
                                                                               len(step.pending.rows))
            self.runner.sample(step, masks)
        except Exception as exc:  # fails this step's requests, as a failed launch does
            self.in_flight = None
            self.scheduler.fail(step.scheduled, hibana_error(exc, "model step failed"))
            return None
        return step

    def _start_masks(self, step: StepInFlight) -> "Callable[[], TokenMasks | None]":
        """Start filling a launched step's grammar masks; an error is raised where they are
        waited for (`_sample`, which fails the step's requests)."""
        try:
            return self.grammars.start_masks(step.scheduled, len(step.pending.rows))
        except Exception as exc:  # noqa: BLE001 - raised again by _sample
            error = exc  # (the clause unbinds `exc` as it ends: a closure over it raised a NameError)

            def failed() -> None:
                raise error
            return failed

    def _overlaps(self, scheduled: SchedulerOutput) -> bool:
        """Whether this step's tokens may be read during the next step: not where a request's
        sampling reads its history on the host (penalties), which must then be complete, nor
        where drafts are verified (how many are kept decides where the next step starts)."""
        return self.async_scheduling and not scheduled.verifies and not any(
            needs_history(c.request.params) for c in scheduled.sampling)

    def _update(self, step: StepInFlight) -> None:
        updated = self._read_back(step)
        if updated is not None:
            self._deliver(step, updated)

    def _read_back(self, step: StepInFlight) -> list[RequestOutput] | None:
        """A step's tokens, read back and taken into its requests (None if the device failed)."""
        try:
            output = step.result()
        except Exception as exc:  # the device failed under this step
            self.scheduler.fail(step.scheduled, HibanaError(f"model step failed on the device: {exc!r}"))
            return None
        updated = self.scheduler.update_from_output(step.scheduled, output)
        if step.scheduled.verifies:  # a hybrid model's states fold in the tokens kept, no others
            self.runner.commit_recurrent(step.scheduled)
        return updated

    def _deliver(self, step: StepInFlight, updated: list[RequestOutput], filling: bool = False) -> None:
        """The outputs of a step read back; the speculation's figures. `filling`: grammar masks
        are being filled meanwhile, which own the matchers until they end, also when this fails."""
        try:
            for request, exc in self.outputs.process(updated):  # its tokens stay in its state's history
                request.error = hibana_error(exc, "delivering the generated tokens failed")
                self.scheduler.finish(request, "error")
            if self.speculation is not None:
                self.speculation.updated(step.scheduled.chunks)
                self.speculation.observe_step(step.scheduled.num_tokens, step.scheduled.verifies,
                                              None if step.timer is None else step.timer.seconds())
        except BaseException:
            if filling:
                self.grammars.wait_fill()
            raise

    def deliver_finished(self) -> None:
        for request in self.scheduler.take_finished():
            self.outputs.finish(request)

    # --- what callers do ------------------------------------------------------------------------

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None) -> RequestEvents:
        """Queue a request (the caller holds the lock and validated it); its events follow."""
        if request.seq.begin_request() and request.seq.parked is not None:  # LongRoPE's rotation changed:
            self.scheduler.eviction.tier.forget(request.seq)                # a parked copy is of the old one
        stream = self.outputs.track(request, loop)
        self.scheduler.add(request)
        self.work.notify()
        return RequestEvents(request, stream, self.cancel)

    def cancel(self, request: Request, *, wait: bool = True) -> None:
        """Stop a request that still runs; its state keeps the tokens it has. `wait=False` never
        waits for the lock: an event loop ending a stream, or a dropped stream's finalizer, which
        the garbage collector runs on whatever thread it interrupts (this loop's mid-step, or the
        grammar worker a step waits for: waiting for the lock there hung the engine for good).
        Where the lock is not free at once, the request is marked, and ends at the next schedule
        or when a caller next asks which states are busy (`end_cancelled`)."""
        if not wait and (threading.current_thread() is self._thread or not self.lock.acquire(blocking=False)):
            request.cancelled = True
            self._marked.append(request)
            return
        if wait:
            self.lock.acquire()
        try:
            if not request.finished:
                request.cancelled = True
                self.scheduler.finish(request, "cancelled")
                self.deliver_finished()
        finally:
            self.lock.release()

    def end_cancelled(self) -> None:
        """End the requests marked cancelled without the lock (`cancel(wait=False)`, a stream whose
        event loop closed), before a caller's thread looks at which states are busy: a state is
        free for the next call once its stream is dropped, as once it is closed."""
        if not self._marked:  # (a listing of the states must not scan every request: states())
            return
        with self.lock:
            marked, self._marked = self._marked, []
            for request in marked:
                if not request.finished:
                    self.scheduler.finish(request, "cancelled")
            self.deliver_finished()

    def capture_graphs(self, max_sequences: int = 1, max_drafts: int | None = 0) -> int:
        """Capture the CUDA graphs of steps of up to `max_sequences` sequences with up to
        `max_drafts` drafts each (None: any) at every span now (`DecodeGraphs.capture`), not in
        the first step of each shape; the number captured (0 without graphs)."""
        with self.lock:
            graphs = self.runner.graphs
            if graphs is None or not self._sample_in_flight():  # replays write graph outputs
                return 0
            return graphs.capture(max_sequences, max_drafts)

    def abort_all(self, error: BaseException) -> None:
        with self.lock:
            self.in_flight = None
            if self._masks is not None:  # a fill under way owns the matchers until it ends
                self._masks = None
                self.grammars.wait_fill()
            self.scheduler.abort_all(error)
            self.deliver_finished()

    def close(self, error: BaseException) -> None:
        """Stop the loop; pending requests fail with `error`. Idempotent."""
        with self.work:
            if self.closed:
                return
            self.closed = True
            self.abort_all(error)
            self.work.notify_all()
        self._handoff()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class _PreviousFailed(Exception):
    """The step in flight could not be sampled (`EngineCore._ready_to_launch`)."""


def _run_loop(ref: "weakref.ReferenceType[EngineCore]") -> None:
    """The engine thread: step while there is work, sleep on the condition otherwise."""
    while True:
        core = ref()
        if core is None:
            return
        work = core.work
        with work:
            if core.closed:
                return
            if not core.scheduler.has_work() and core.in_flight is None:
                try:
                    wait = core.idle() if core.idle is not None else 1.0
                except Exception as exc:  # (it ended this thread: every later request waited for good)
                    warnings.warn(f"Hibana engine: its work while idle failed, the engine goes on: {exc!r}")
                    wait = 1.0
                del core  # never wait while holding the engine alive
                work.wait(timeout=wait)
                continue
            try:
                core.step()
            except BaseException as exc:  # a scheduling bug fails the pending requests, not the engine (a
                # plugin's BaseException too: a SystemExit or KeyboardInterrupt ended this thread)
                warnings.warn(f"Hibana engine step failed, its requests fail: {exc!r}")
                core.abort_all(HibanaError(f"engine step failed: {exc!r}"))
        del core
        time.sleep(0)  # let threads waiting for the lock in (the lock is not fair)
