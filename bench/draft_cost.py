"""What a draft model costs per drafted token, beside the target's own step (issue 13).

A draft model pays only if drafting k tokens costs well under the target's step: with the
target's step T and the draft's cost d per token, a verify step that keeps a tokens of k emits
a + 1 tokens for T + k d (plus the verify's extra cost over a plain step). This runs the target
preset (random weights) at batch 1 with a fixed draft length through the draft-model drafter
(a second preset, random weights, saved as a checkpoint the drafter loads, as a user's would be),
and reports the drafter's own counters (`engine.stats().speculation`): wall time of its
proposals per drafted token, forwards per call; and the target's step with speculation off in
the same run. Random weights accept nothing, so the figures are costs, not speed-ups.

    python3 bench/draft_cost.py [--target qwen3-8b] [--draft qwen3-0.6b] [--k 4] [--tokens 256]

It imports hibana_bench: install the checkout, or run it through bench/run_h200.sh (stage
draft_cost).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from hibana_bench.models import load_bench_model


def _decode(engine, prompt: list[int], tokens: int, state: str = "bench") -> float:
    """Seconds per token of one greedy generation of `tokens` tokens after `prompt`, timed from
    the first token's arrival (the prefill excluded)."""
    from hibana_core import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    began = event = None
    for event in engine.open_state(state).stream(params, prompt=prompt):
        if began is None:
            began = time.perf_counter()
    emitted = len(event.completion.token_ids)
    return (time.perf_counter() - began) / max(1, emitted - 1)


def _drafter(engine) -> dict | None:
    spec = engine.stats().speculation or {}
    return (spec.get("drafters") or {}).get("draft_model")


def _since(before: dict | None, after: dict | None) -> dict | None:
    """The drafter's counters over the timed generation alone (the warm-up's subtracted)."""
    if after is None:
        return None
    row = dict(after)
    for key in ("calls", "tokens_drafted", "tokens_prefilled", "forwards", "seconds"):
        row[key] = after[key] - (before or {}).get(key, 0)
    row["ms_per_draft_token"] = round(1e3 * row["seconds"] / row["tokens_drafted"], 3) if row["tokens_drafted"] else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen3-8b")
    parser.add_argument("--draft", default="qwen3-0.6b")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompt = [int(t) for t in torch.randint(10, 1000, (args.prompt,), generator=torch.Generator().manual_seed(0))]
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        draft = load_bench_model(args.draft, device, dtype)
        with draft.peer_model() as hf_model:
            hf_model.save_pretrained(folder)
        del draft
        target = load_bench_model(args.target, device, dtype)
        for name, speculation in (("off", "off"),
                                  (f"draft model, k={args.k}", {"method": "draft_model", "draft_model": folder, "k": args.k})):
            engine = target.engine(speculation=speculation)
            _decode(engine, prompt[: args.prompt // 2], 64, "warm-up")  # warm-up: captures the graphs of both models
            before = _drafter(engine)
            seconds = _decode(engine, prompt, args.tokens)
            rows[name] = dict(ms_per_token=1e3 * seconds, drafter=_since(before, _drafter(engine)))
            engine.close()
    off = rows["off"]["ms_per_token"]
    print(f"{args.target} target, {args.draft} draft model (random weights: costs, not speed-ups), batch 1, "
          f"{args.prompt}-token prompt, {args.tokens} tokens, {device}")
    for name, row in rows.items():
        line = f"{name:22s} {row['ms_per_token']:8.3f} ms per emitted token"
        d = row["drafter"]
        if d and d.get("ms_per_draft_token") is not None:
            line += (f"; drafter {d['ms_per_draft_token']:.3f} ms per drafted token "
                     f"({d['ms_per_draft_token'] / off:.1%} of the target's plain step), "
                     f"{d['forwards'] / max(1, d['calls']):.1f} forwards per call")
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(target=args.target, draft=args.draft, k=args.k, device=str(device), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
