"""`hibana bench grammar`: the cost per token of grammar-constrained decoding, at batch 1 and 32.

    hibana bench grammar --model demo                          # CPU: the demo workload
    hibana bench grammar --model qwen3-8b --batch 1,32         # GPU: random weights, a 151k vocabulary

B agents decode at once, each from its own prompt, once unconstrained and once under a JSON schema
(objects of a string, an integer and an enum list, at least 64 of them: an output that cannot end
before --generate tokens), `--repeats` times, each repeat the pair back to back on the same
prompts. Figures: decode tokens per second (from the moment every agent has its first token,
the prefill's; median of the repeats) and the process's CPU seconds per decoded token; the
overhead is unconstrained / constrained - 1 of the medians (the JSON also has the median of each
pair's ratio). Speculation is off in both (it changes the step shapes, not the masks' cost). Also
timed on the engine's thread, per constrained step: starting and taking the masks
(`Grammars.start_masks`; where steps overlap the fill runs on the grammar's worker thread, and
the engine's part is the wait for it) and enqueuing their application (`Sampler.apply_masks`),
against the step's wall time: the host work that must hide under the forward on a GPU; and the
fill's own time per step, on whichever thread ran it; and in both runs the engine thread's step
and its parts (scheduling, launching; reading the previous step back, which waits for the device,
and within it taking its tokens into the requests, where the matchers accept them; delivering
them; launching the sampler, without the wait for the fill; with async scheduling a constrained
step is sampled inside the next step's launch, whose time then holds that sampling and its wait,
counted in "sample" and the wait too). The presets have no tokenizer: a
byte-level BPE of Qwen3's size is built
(`hibana_bench.grammar_libs.build_big_tokenizer`, ~1 min) unless `--tokenizer DIR` names one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hibana_bench.argtypes import count, counts, seconds
from hibana_core import SamplingParams

SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]}}},
    "required": ["name", "count", "tags"]}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=counts, default=[1, 32],
                        help="comma-separated numbers of agents decoding at once (default 1,32)")
    parser.add_argument("--generate", type=count, default=128, help="tokens per agent (default 128)")
    parser.add_argument("--prompt", type=count, default=256, help="prompt tokens per agent (default 256)")
    parser.add_argument("--repeats", type=count, default=5,
                        help="constrained/unconstrained pairs timed back to back; medians reported (default 5)")
    parser.add_argument("--switch-interval", type=seconds, metavar="SECONDS",
                        help="the process's GIL switch interval while the engine runs (default: the engine's "
                        "own, hibana_core.engine_core.SWITCH_INTERVAL; 0.005 is Python's default)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for a preset (default: build one "
                        "of Qwen3's size)")
    parser.add_argument("--profile", action="store_true",
                        help="then profile 32 decode steps of each run at the largest batch (torch.profiler): "
                        "the device's kernels per step, to tell the device's part of the overhead from the host's")


def _decode(engine, prompts: list[list[int]], params: SamplingParams,
            synced: Callable[[], None] | None = None) -> tuple[float, float, int]:
    """All prompts synced (then `synced` is called), then generated at once (one thread each):
    the decode time (from the moment every agent has its first token to the last token), the
    process's CPU time over the same span, and the tokens decoded in it."""
    handles = [engine.open_state(f"g{i}-{time.monotonic_ns()}") for i in range(len(prompts))]
    for h, p in zip(handles, prompts):
        h.sync(p)
    if synced is not None:
        synced()
    stamps: list[list[float]] = [[] for _ in handles]  # when each token arrived, per agent
    cpu: dict[str, float] = {}
    lock = threading.Lock()

    def run(i: int) -> None:
        for ev in handles[i].stream(params):
            if ev.token_id is not None:
                stamps[i].append(time.perf_counter())
                with lock:
                    if len(stamps[i]) == 1 and all(stamps):  # the last agent's first token
                        cpu["start"] = time.process_time()
        with lock:
            cpu["end"] = time.process_time()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in handles:
        h.close()
    start = max(s[0] for s in stamps)  # every agent is decoding from here on
    end = max(s[-1] for s in stamps)
    tokens = sum(sum(1 for t in s if start < t) for s in stamps)
    return end - start, cpu["end"] - cpu["start"], tokens


THREAD_PARTS = ("step", "schedule", "launch", "read_back", "update", "deliver", "sample")  # in both runs (HostTimer)


class HostTimer:
    """Wall time spent in the engine's grammar calls and in its steps (instance attributes
    wrapped, so nothing else is touched): on the engine's thread starting a step's masks and
    taking them (`Grammars.start_masks` and the function it returns: where the fill runs on the
    grammar's worker, the wait for it is its part, "wait"), enqueuing their application
    (`Sampler.apply_masks`); and the fill itself, on whichever thread ran it ("fill")."""

    def __init__(self, engine) -> None:
        self.seconds = {"masks": 0.0, "wait": 0.0, "apply": 0.0, "fill": 0.0,
                        **dict.fromkeys(THREAD_PARTS, 0.0)}
        self.steps = 0
        self._wrap(engine.grammars, "start_masks", "masks", returns_call=True)
        self._wrap(engine.grammars, "_fill", "fill")
        self._wrap(engine.runner.sampler, "apply_masks", "apply")
        self._wrap(engine.core, "step", "step")
        # the rest of a step on the engine's thread, in both runs: scheduling and launching it,
        # reading the previous step's tokens back (waiting for the device: long where the host
        # is ahead) and taking them into the requests ("update": the matchers accept them),
        # delivering them, and launching the sampler (without the wait for the fill)
        self._wrap(engine.core.scheduler, "schedule", "schedule")
        self._wrap(engine.core, "_launch", "launch")
        self._wrap(engine.core, "_read_back", "read_back")
        self._wrap(engine.core.scheduler, "update_from_output", "update")
        self._wrap(engine.core, "_deliver", "deliver")
        self._wrap(engine.runner, "sample", "sample")

    def _wrap(self, owner, name: str, key: str, returns_call: bool = False) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
            self.steps += key == "step" and bool(result)  # steps that did work
            return self._timed_call(result) if returns_call else result
        setattr(owner, name, timed)

    def _timed_call(self, take):
        def timed():
            start = time.perf_counter()
            try:
                return take()
            finally:
                seconds = time.perf_counter() - start
                self.seconds["masks"] += seconds
                self.seconds["wait"] += seconds
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.steps = 0


def grammar_workload(model, batches: list[int], generate: int, prompt_len: int, repeats: int,
                     switch_interval: float | None = None, profile: bool = False) -> dict:
    rng = random.Random(0)
    vocab = len(model.tokenizer)
    rows = []
    engine = model.engine(speculation="off", max_concurrent_agents=max(batches),
                          max_model_len=prompt_len + generate + 16)
    if switch_interval is not None:  # after the engine set its own
        sys.setswitchinterval(switch_interval)
    interval = sys.getswitchinterval()
    with engine:
        warm = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(max(batches))]
        for params in (SamplingParams(max_tokens=8, ignore_eos=True),
                       SamplingParams(max_tokens=8, ignore_eos=True, json_schema=SCHEMA)):
            for b in batches:
                _decode(engine, warm[:b], params)  # graphs captured, the grammar compiled
        timer = HostTimer(engine)
        for b in batches:
            runs, host = [], []
            for r in range(repeats):
                prompts = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(b)]
                pair = {}
                for name, params in (("plain", SamplingParams(max_tokens=generate, ignore_eos=True)),
                                     ("constrained", SamplingParams(max_tokens=generate, ignore_eos=True,
                                                                    json_schema=SCHEMA))):
                    seconds, cpu, tokens = _decode(engine, prompts, params, synced=timer.reset)
                    steps = max(timer.steps, 1)
                    pair[name] = {"tok_s": tokens / seconds, "cpu_ms_per_token": 1e3 * cpu / tokens,
                                  **{f"{k}_ms_per_step": 1e3 * timer.seconds[k] / steps for k in THREAD_PARTS}}
                runs.append(pair)
                t = timer.seconds  # the constrained run's
                steps = max(timer.steps, 1)
                host.append({"ms_per_step": 1e3 * (t["masks"] + t["apply"]) / steps,
                             "share": (t["masks"] + t["apply"]) / t["step"],
                             "wait_ms_per_step": 1e3 * t["wait"] / steps, "fill_ms_per_step": 1e3 * t["fill"] / steps})
            row = {"batch": b,
                   "plain_tok_s": statistics.median(p["plain"]["tok_s"] for p in runs),
                   "constrained_tok_s": statistics.median(p["constrained"]["tok_s"] for p in runs),
                   "overhead_median_of_pairs": statistics.median(p["plain"]["tok_s"] / p["constrained"]["tok_s"] - 1
                                                                 for p in runs),
                   "cpu_overhead": statistics.median(p["constrained"]["cpu_ms_per_token"] /
                                                     p["plain"]["cpu_ms_per_token"] - 1 for p in runs),
                   "grammar_host_ms_per_step": statistics.median(h["ms_per_step"] for h in host),
                   "grammar_host_share_of_step": statistics.median(h["share"] for h in host),
                   "mask_wait_ms_per_step": statistics.median(h["wait_ms_per_step"] for h in host),
                   "mask_fill_ms_per_step": statistics.median(h["fill_ms_per_step"] for h in host),
                   "runs": runs}
            row["overhead"] = row["plain_tok_s"] / row["constrained_tok_s"] - 1
            row["engine_thread_ms_per_step"] = {
                name: {k: statistics.median(p[name][f"{k}_ms_per_step"] for p in runs) for k in THREAD_PARTS}
                for name in ("plain", "constrained")}
            rows.append(row)
            print(f"batch {b:>3}: unconstrained {row['plain_tok_s']:9.1f} tok/s   constrained "
                  f"{row['constrained_tok_s']:9.1f} tok/s   overhead {100 * row['overhead']:+.1f}% "
                  f"(CPU time per token {100 * row['cpu_overhead']:+.1f}%); grammar host work "
                  f"{row['grammar_host_ms_per_step']:.3f} ms per step, {100 * row['grammar_host_share_of_step']:.1f}% "
                  f"of step time (waiting for the fill {row['mask_wait_ms_per_step']:.3f} ms; the fill "
                  f"{row['mask_fill_ms_per_step']:.3f} ms a step, on the worker where steps overlap)", flush=True)
            parts = row["engine_thread_ms_per_step"]
            print("           engine thread, ms a step, unconstrained -> constrained: " + ", ".join(
                f"{k.replace('_', ' ')} {parts['plain'][k]:.3f} -> {parts['constrained'][k]:.3f}" for k in THREAD_PARTS),
                flush=True)
        if profile:
            _profile(engine, [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(max(batches))])
    return {"workload": "grammar", "model": model.name, "random_weights": model.random_weights,
            "switch_interval": interval, "schema": SCHEMA, "generate": generate, "prompt": prompt_len, "rows": rows}


def _profile(engine, prompts: list[list[int]], steps: int = 32) -> None:
    """Each run's device kernels over `steps` decode steps (torch.profiler, from the prompts'
    prefill on), per step: busy time against the span from the first kernel to the last, and the
    kernels that take most of it."""
    from torch.profiler import ProfilerActivity, profile

    kind = "CUDA" if engine.device.type == "cuda" else "CPU"  # on the CPU: the ops, nested (a test of the code)
    for name, params in (("unconstrained", SamplingParams(max_tokens=steps, ignore_eos=True)),
                         ("constrained", SamplingParams(max_tokens=steps, ignore_eos=True, json_schema=SCHEMA))):
        prof = profile(activities=[getattr(ProfilerActivity, kind)])
        _decode(engine, prompts, params, synced=prof.start)
        prof.stop()
        events = [e for e in prof.events() if e.device_type.name == kind]
        if not events:
            print(f"profile, {name}: no device kernels recorded", flush=True)
            continue
        busy = sum(e.time_range.elapsed_us() for e in events)
        span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
        print(f"profile, {name}, batch {len(prompts)}, {steps} steps: device busy {busy / 1e3 / steps:.3f} ms a step "
              f"of {span / 1e3 / steps:.3f}; most of it, us a step (launches a step):", flush=True)
        total = (lambda e: e.device_time_total) if kind == "CUDA" else (lambda e: e.self_cpu_time_total)
        for e in sorted(prof.key_averages(), key=lambda e: -total(e))[:12]:
            print(f"    {total(e) / steps:9.1f}  x{e.count / steps:5.1f}  {e.key[:90]}", flush=True)


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from hibana_bench.models import load_bench_model

    model = load_bench_model(args.model, device, dtype)
    if model.tokenizer is None:
        from hibana_bench.grammar_libs import build_big_tokenizer, load_tokenizer

        path = args.tokenizer or build_big_tokenizer(Path("/tmp/hibana-qwen3-size-tokenizer"))
        model.tokenizer = load_tokenizer(Path(path))
    return grammar_workload(model, args.batch, args.generate, args.prompt,
                            args.repeats, args.switch_interval, args.profile)


if __name__ == "__main__":
    import sys

    from hibana_bench.cli import main

    raise SystemExit(main(["grammar", *sys.argv[1:]]))
