"""Drawn drafts against chosen ones: what speculative sampling's min(1, p/q) keeps (issue 13).

The demo model drafts for itself through the layer-skip self-draft (half its layers, k fixed) on
the first turns of the recorded demo trace (`bench/traces/demo.json.gz`: each agent's prompt; the
model's own outputs, not the trace's), sampled at several temperatures. Each temperature runs
three times on one engine: "drawn", requests without a seed whose drafts the self-draft always
draws from its own distribution q, kept at min(1, p/q) (the per-state choice held at drawing);
"chosen", the same requests with seeds, whose drafts are the self-draft's argmax, kept where the
target's own draw equals them; "adaptive", requests without a seed as the engine runs them, each
state drawing or choosing by what kept more (`DrawChoice`). Reported: drafts kept of those
proposed, tokens a verify step emits, decode tokens/s.

    python bench/drawn_drafts.py [--temperatures 0.3,0.7,1.0] [--agents 8] [--tokens 48] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from hibana_core import Engine, SamplingParams
from hibana_core.speculation.speculator import DrawChoice
from hibana_bench.traces import load_trace


KINDS = ("drawn", "chosen", "adaptive")
ENGINE_MIN_SEEN = DrawChoice.MIN_SEEN


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Every prompt generated at once (one thread each: the engine batches them); the engine's
    speculation counters over this run, and tokens/s."""
    before = engine.stats()
    outs = [0] * len(prompts)

    def one(i: int) -> None:
        outs[i] = len(engine.open_state(f"s{time.monotonic_ns()}-{i}").generate(params[i], prompt=prompts[i]).token_ids)

    began = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    after = engine.stats()
    proposed = after.draft_tokens_proposed - before.draft_tokens_proposed
    kept = after.draft_tokens_accepted - before.draft_tokens_accepted
    verified = after.speculation["tokens_per_verify"]
    return {"proposed": proposed, "kept": kept, "kept_share": round(kept / proposed, 3) if proposed else None,
            "tokens_per_verify": None if verified is None else round(verified, 2),
            "tokens_per_s": round(sum(outs) / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperatures", default="0.3,0.7,1.0")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    trace = load_trace("demo")
    prompts = [list(c.turns[0].input) for c in trace.agents[:args.agents]]
    rows = []
    with Engine.from_pretrained("demo", speculation={"method": "layer_skip", "k": args.k}, progress=False) as engine:
        for seed in (None, 1):  # warm-up, both kinds (the first timed run was 30% slow without)
            run(engine, prompts, [SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=seed)] * len(prompts))
        for temperature in map(float, args.temperatures.split(",")):
            for kind in KINDS:
                params = [SamplingParams(max_tokens=args.tokens, temperature=temperature, ignore_eos=True,
                                         seed=1000 + i if kind == "chosen" else None) for i in range(len(prompts))]
                # "drawn": the per-state choice never leaves drawing (a bench-only override)
                DrawChoice.MIN_SEEN = 10**9 if kind == "drawn" else ENGINE_MIN_SEEN
                row = {"temperature": temperature, "drafts": kind, **run(engine, prompts, params)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| temperature | drafts | kept / proposed | tokens a verify step | tok/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['temperature']} | {r['drafts']} | {r['kept']} / {r['proposed']} ({r['kept_share']}) | "
              f"{r['tokens_per_verify']} | {r['tokens_per_s']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
