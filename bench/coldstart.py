"""Cold start side by side: each system in a fresh process, from the process's launch to its first
generated token (imports, load, a one-token generation), as `hibana_core.coldstart` splits it.

    python -m hibana_bench.coldstart hibana|transformers MODEL --device cpu --dtype float32 --since T

prints the figures as one JSON line; `measure` launches it and reads them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SYSTEMS = ("hibana", "transformers")


def measure(system: str, model: str, device: str, dtype: str, timeout: float = 900) -> dict:
    """One system's cold start in a fresh Python process; a BenchError when that run fails."""
    from hibana_bench.spec_systems import BenchError

    launched = time.time()
    command = [sys.executable, "-m", "hibana_bench.coldstart", system, model, "--device", device,
               "--dtype", dtype, "--since", repr(launched)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"the cold-start run of {system} took more than {timeout:.0f} s") from None
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise BenchError(f"the cold-start run of {system} failed ({' '.join(command)}):\n{tail}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _hibana(model: str, since: float, device: str, dtype: str) -> dict:
    from hibana_core.coldstart import measure as measure_hibana

    cold, engine = measure_hibana(model, since, device=device, dtype=dtype, progress=False)
    engine.close()
    return cold.as_dict()


def _transformers(model: str, since: float, device: str, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hibana_core.loader import resolve_checkpoint

    hf_logging.set_verbosity_error()
    loading = time.time()
    path = resolve_checkpoint(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    load = time.time() - loading
    started = time.perf_counter()
    prompt = tokenizer("Hello", return_tensors="pt").input_ids.to(device)
    hf_model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                      pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    first = time.perf_counter() - started
    return {"startup_s": loading - since, "load_s": load, "first_token_s": first, "stages": {},
            "total_s": loading - since + load + first}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hibana_bench.coldstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", choices=SYSTEMS, help="what loads the model and generates the token")
    parser.add_argument("model", help="checkpoint directory, Hugging Face repo id, or demo")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weights and compute dtype")
    parser.add_argument("--since", type=float, default=None,
                        help="when the process was launched (time.time()); default: when the OS says it "
                        "started, else now")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.since is None:
        from hibana_core.coldstart import process_start_time

        args.since = process_start_time() or time.time()
    since = args.since
    run = _hibana if args.system == "hibana" else _transformers
    print(json.dumps(run(args.model, since, args.device, args.dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
