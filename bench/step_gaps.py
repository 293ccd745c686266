"""Where a batch-1 decode step's wall time goes beyond its CUDA graph: the device timeline of an
engine's decode (torch.profiler, CUDA activity) against the graph replayed alone.

    python bench/step_gaps.py --model qwen3-8b --surgery w4 --context 512 --steps 64

Prints, a step: the wall time (as `hibana bench decode` takes it), the graph's replay alone, the
device's busy time and span, the idle gaps between kernels by size, and the kernels that are not
the graph's (the step's work outside it: inputs, sampling, copies). A GPU tool: it runs on the
H200 (`bash bench/run_h200.sh step_gaps`).
"""
from __future__ import annotations

import argparse
import random
from collections import Counter

import torch
import triton.testing

from hibana_bench.models import load_bench_model
from hibana_bench.workloads import _surgery_overrides, random_tokens
from hibana_core import SamplingParams


def graph_kernels(engine, key) -> Counter:
    """Kernel names (first 60 characters) of one replay of the decode graph `key`."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = engine.runner.graphs.graphs[key]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names, times = Counter(), Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            names[e.name[:60]] += 1
            times[e.name[:60]] += e.device_time_total
    print("  the graph's kernels by time, us a step (launches)")
    for name, us in times.most_common(12):
        print(f"    {us:8.1f}  x{names[name]:<4d} {name}")
    return names


def profile_decode(handle, steps: int):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        out = handle.generate(SamplingParams(max_tokens=steps, ignore_eos=True))
        torch.cuda.synchronize()
    return out, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--surgery", default="", help="a pass (w4, w8) or empty for none")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's (default: the context and the steps, with room); the decode graphs' "
                             "attention splits for it (`hibana bench decode` at 512,8192 keys: 8336)")
    parser.add_argument("--speculation", default="off", help='"off" (the default) or "adaptive" (the bench\'s '
                        '"hibana"): then also the speculation figures and the steps read back early to draft')
    args = parser.parse_args()
    early = {"asked": 0, "yes": 0}
    if args.speculation != "off":  # count the steps whose tokens were read back before the next was scheduled
        from hibana_core.speculation import speculator

        wants = speculator.Speculator.wants_history

        def counted(self, running):
            yes = wants(self, running)
            early["asked"] += 1
            early["yes"] += yes
            return yes
        speculator.Speculator.wants_history = counted

    model = load_bench_model(args.model, torch.device("cuda"), torch.bfloat16)
    system = f"hibana+{args.surgery}" if args.surgery else "hibana"
    rng = random.Random(0)
    with model.engine(max_model_len=args.max_model_len or args.context + 2 * args.steps + 256, max_concurrent_agents=4,
                      speculation=args.speculation, **_surgery_overrides(model, system)) as engine:
        for i in range(2):  # compiles, graph captures
            warm = engine.open_state(f"warm{i}")
            warm.generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=random_tokens(rng, 64, model.vocab_size))
            warm.close()
        handle = engine.open_state("timed")
        handle.sync(random_tokens(rng, args.context, model.vocab_size))
        plain = handle.generate(SamplingParams(max_tokens=args.steps, ignore_eos=True))
        wall = (plain.stats.elapsed - (plain.stats.time_to_first_token or 0.0)) / (args.steps - 1)
        g = engine.runner.graphs
        key = g.key(1, 1, args.context + args.steps - 1)  # the graph the decodes ended on
        in_graph = graph_kernels(engine, key)
        graph, _ = g.graphs[key]
        replay = triton.testing.do_bench(graph.replay, rep=300, return_mode="median") / 1e3
        out, prof = profile_decode(handle, args.steps)
        profiled = (out.stats.elapsed - (out.stats.time_to_first_token or 0.0)) / (args.steps - 1)
        spec = engine.stats().speculation

    print(f"speculation {args.speculation}: steps read back early to draft {early['yes']} of {early['asked']}; {spec}")

    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    # every kernel of the profiled generate, its first step (the prefill of the last token) too
    n = args.steps
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    buckets = [(0, 2), (2, 5), (5, 20), (20, 100), (100, 1e9)]
    outside = Counter(e.name[:60] for e in kernels)
    for name, count in in_graph.items():
        outside[name] -= count * n
    outside = {name: c for name, c in outside.items() if c > 0}
    time_outside = Counter()
    for e in kernels:
        if e.name[:60] in outside:
            time_outside[e.name[:60]] += e.time_range.elapsed_us()

    print(f"{args.model} {system} batch 1 at {args.context} keys, {n} steps")
    print(f"  wall a step (bench decode's figure)  {wall * 1e3:8.3f} ms   ({1 / wall:.1f} tok/s)")
    print(f"  wall a step under the profiler       {profiled * 1e3:8.3f} ms")
    print(f"  graph replay alone                   {replay * 1e3:8.3f} ms   ({1 / replay:.1f} tok/s)")
    print(f"  device busy a step                   {busy / 1e3 / n:8.3f} ms")
    print(f"  device span a step                   {span / 1e3 / n:8.3f} ms")
    print(f"  kernels in the graph                 {sum(in_graph.values()):8d}")
    print("  idle gaps between kernels, a step: size (us) -> count, total us")
    for lo, hi in buckets:
        inside = [g for g in gaps if lo <= g < hi]
        print(f"    [{lo:>4}, {hi if hi < 1e9 else 'inf':>4})  {len(inside) / n:8.1f}  {sum(inside) / n:9.1f}")
    print("  kernels outside the graph, a step: count, us")
    for name, us in time_outside.most_common(15):
        print(f"    {outside[name] / n:6.2f}  {us / n:8.1f}  {name}")
    cpu = Counter()
    for e in prof.key_averages():
        if e.device_type.name == "CPU":
            cpu[e.key[:70]] = e.self_cpu_time_total
    print("  host: self CPU time a step, us (the largest)")
    for name, us in cpu.most_common(15):
        print(f"    {us / n:8.1f}  {name}")


if __name__ == "__main__":
    main()
