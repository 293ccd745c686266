"""What the detokenizer costs per generated token (issue 13: the host's work a step, per agent).

Each generated token is decoded twice over a sliding window (`hibana_core.detokenizer`). This
runs the same text through it two ways in one process, alternated, best of `--repeats`:
transformers' `decode` wrapper, and the fast tokenizer's Rust backend that `text_decoder` uses
where the two agree. CPU figures; the GPU's host is the same Python.

    python3 bench/detokenizer_cost.py [--model demo] [--text README.md] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import hibana_core.detokenizer as detokenizer
from hibana_core.loader import resolve_checkpoint


def per_token(tokenizer, ids: list[int]) -> float:
    """Microseconds a generated token costs `Detokenizer.add`, after a 10-token history."""
    start = time.perf_counter()
    detok = detokenizer.Detokenizer(tokenizer, ids[:10], ())
    for token in ids[10:]:
        detok.add(token)
    assert detok.text == tokenizer.decode(ids[10:], skip_special_tokens=False)
    return (time.perf_counter() - start) / (len(ids) - 10) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "README.md"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(args.model))
    ids = tokenizer.encode(Path(args.text).read_text()[:20000], add_special_tokens=False)
    fast = detokenizer.text_decoder
    ways = {"transformers decode": lambda t: lambda i: t.decode(i, skip_special_tokens=False), "backend": fast}
    best = {name: float("inf") for name in ways}
    try:
        for _ in range(args.repeats):
            for name, decoder in ways.items():
                detokenizer.text_decoder = decoder
                best[name] = min(best[name], per_token(tokenizer, ids))
    finally:
        detokenizer.text_decoder = fast
    print(f"{len(ids) - 10} tokens of {args.text}, best of {args.repeats}: " +
          ", ".join(f"{name} {us:.2f} us a token" for name, us in best.items()) +
          f" ({best['transformers decode'] / best['backend']:.2f}x)")


if __name__ == "__main__":
    main()
