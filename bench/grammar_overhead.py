"""`hibana bench grammar`: the cost per token of grammar-constrained decoding, at batch 1 and 32.

    hibana bench grammar --model demo                          # CPU: the demo workload
    hibana bench grammar --model qwen3-8b --batch 1,32         # GPU: random weights, a 151k vocabulary

B agents decode at once, each from its own prompt, once unconstrained and once under a JSON schema
(objects of a string, an integer and an enum list, at least 64 of them: an output that cannot end
before --generate tokens), `--repeats` times interleaved; the figure is decode tokens per second
(the first token of each request, the prefill's, excluded), best of the repeats, and the overhead
is unconstrained / constrained - 1. Speculation is off in both (it changes the step shapes, not
the masks' cost). The presets have no tokenizer: a byte-level BPE of Qwen3's size is built
(`hibana_bench.grammar_libs.build_big_tokenizer`, ~1 min) unless `--tokenizer DIR` names one.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import torch

from hibana_core import SamplingParams

SCHEMA = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]}}},
    "required": ["name", "count", "tags"]}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", default="1,32", help="comma-separated numbers of agents decoding at once")
    parser.add_argument("--generate", type=int, default=128, help="tokens per agent")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per agent")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory for a preset (default: build one "
                        "of Qwen3's size)")


def _decode(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """All prompts synced, then generated at once (one thread each); the decode time (from the
    last first token to the end) and the tokens decoded after each first one."""
    handles = [engine.open_state(f"g{i}-{time.monotonic_ns()}") for i in range(len(prompts))]
    for h, p in zip(handles, prompts):
        h.sync(p)
    stamps: list[list[float]] = [[] for _ in handles]  # when each token arrived, per agent

    def run(i: int) -> None:
        for ev in handles[i].stream(params):
            if ev.token_id is not None:
                stamps[i].append(time.perf_counter())
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
    return end - start, tokens


def grammar_workload(model, batches: list[int], generate: int, prompt_len: int, repeats: int) -> dict:
    rng = random.Random(0)
    vocab = len(model.tokenizer)
    rows = []
    engine = model.engine(speculation="off", max_concurrent_agents=max(batches),
                          max_model_len=prompt_len + generate + 16)
    with engine:
        warm = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(max(batches))]
        for params in (SamplingParams(max_tokens=8, ignore_eos=True),
                       SamplingParams(max_tokens=8, ignore_eos=True, json_schema=SCHEMA)):
            for b in batches:
                _decode(engine, warm[:b], params)  # graphs captured, the grammar compiled
        for b in batches:
            plain, constrained = [], []
            for r in range(repeats):
                prompts = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(b)]
                for params, into in ((SamplingParams(max_tokens=generate, ignore_eos=True), plain),
                                     (SamplingParams(max_tokens=generate, ignore_eos=True, json_schema=SCHEMA),
                                      constrained)):
                    seconds, tokens = _decode(engine, prompts, params)
                    into.append(tokens / seconds)
            row = {"batch": b, "plain_tok_s": max(plain), "constrained_tok_s": max(constrained),
                   "overhead": max(plain) / max(constrained) - 1, "plain_runs": plain, "constrained_runs": constrained}
            rows.append(row)
            print(f"batch {b:>3}: unconstrained {row['plain_tok_s']:9.1f} tok/s   constrained "
                  f"{row['constrained_tok_s']:9.1f} tok/s   overhead {100 * row['overhead']:+.1f}%", flush=True)
    return {"workload": "grammar", "model": model.name, "random_weights": model.random_weights,
            "schema": SCHEMA, "generate": generate, "prompt": prompt_len, "rows": rows}


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from hibana_bench.models import load_bench_model

    model = load_bench_model(args.model, device, dtype)
    if model.tokenizer is None:
        from hibana_bench.grammar_libs import build_big_tokenizer, load_tokenizer

        path = args.tokenizer or build_big_tokenizer(Path("/tmp/hibana-qwen3-size-tokenizer"))
        model.tokenizer = load_tokenizer(Path(path))
    return grammar_workload(model, [int(b) for b in args.batch.split(",")], args.generate, args.prompt,
                            args.repeats)


if __name__ == "__main__":
    import sys

    from hibana_bench.cli import main

    raise SystemExit(main(["grammar", *sys.argv[1:]]))
