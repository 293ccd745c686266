"""What bringing a parked agent back costs, against recomputing it (issue 17's resume targets).

One state of `--context` tokens is prefilled (the re-prefill cost), then parked by a second state
that needs the device pool (sized for one such state), then resumed by a one-token turn. The tier's
own counters give the restore's seconds and bytes (on a GPU the host-to-device copy on the tier's
side stream, timed by CUDA events; the resumed turn's wall time has the scatter too); beside them,
in the same run, the raw bandwidths they are measured against: a pinned host-to-device copy of the
same bytes, and reading a file of that size with the page cache dropped for it (posix_fadvise). Two tiers: host memory
(`host_kv_bytes` for one state) and disk (`host_kv_bytes=0`, spill files under a state_dir).

    python3 bench/resume_cost.py [--model qwen3-8b] [--context 8192] [--json FILE]

Run on the GPU through bench/run_h200.sh (stage resume); on the CPU with --model demo it checks the
script, its figures meaning little there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from hibana_bench.models import load_bench_model
from hibana_bench.peers import sync


def host_to_device_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes/s of a pinned host-to-device copy of `nbytes` (best of three)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        began = time.perf_counter()
        target.copy_(host)
        sync(device)
        best = min(best, time.perf_counter() - began)
    return nbytes / best


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so the next read comes from the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def file_read_bandwidth(nbytes: int, folder: Path) -> float:
    """Bytes/s of reading a file of `nbytes` written beforehand, its pages dropped from the cache."""
    path = folder / "bandwidth.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // (1 << 20) + 1))
    drop_from_page_cache(path)
    began = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    seconds = time.perf_counter() - began
    size = path.stat().st_size
    path.unlink()
    return size / seconds


# what a resumed turn's time is spent on: each call timed between device synchronisations
# (this serialises the asynchronous step loop: the breakdown is for reading, the turn's own
# time is taken without it)
BREAKDOWN = [("hibana_core.kv.tiers", "HostTier", "restore"), ("hibana_core.kv.tiers", "HostTier", "park"),
             ("hibana_core.kv.tiers", "HostTier", "_read_copy"), ("hibana_core.kv.cache", "KVCache", "write_blocks"),
             ("hibana_core.kv.sequence", "KVSequence", "commit_full_blocks"),
             ("hibana_core.kv.sequence", "KVSequence", "reuse_cached_blocks"),
             ("hibana_core.scheduler", "Scheduler", "schedule"), ("hibana_core.runner", "ModelRunner", "launch"),
             ("hibana_core.runner", "ModelRunner", "sample"), ("hibana_core.runner", "DecodeGraphs", "_capture"),
             ("hibana_core.engine_core", "EngineCore", "step")]


@contextlib.contextmanager
def timed_calls(device: torch.device, totals: dict[str, float]):
    """Add the seconds of every BREAKDOWN method called inside to `totals` (name -> seconds)."""
    originals = []
    for module, cls_name, name in BREAKDOWN:
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, name)
        originals.append((cls, name, original))

        def wrapper(*args, _original=original, _key=f"{cls_name}.{name}", **kwargs):
            sync(device)
            began = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                sync(device)
                totals[_key] = totals.get(_key, 0.0) + time.perf_counter() - began
        setattr(cls, name, wrapper)
    try:
        yield totals
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


def resume_once(model, context: int, host_states: int, folder: Path, vocab: int) -> dict:
    """Prefill a state, park it through a second one, resume it: the tier's figures."""
    from hibana_core import SamplingParams

    gen = torch.Generator().manual_seed(context)
    prompts = [torch.randint(10, vocab - 1, (context,), generator=gen).tolist() for _ in range(2)]
    blocks = -(-(context + 2) // 16) + 2
    engine = model.engine(block_size=16, kv_device_blocks=blocks, speculation="off", state_dir=str(folder),
                          host_kv_bytes=0)
    per_state = blocks * engine.kv_cache.bytes_per_block_here
    engine.close()
    engine = model.engine(block_size=16, kv_device_blocks=blocks, speculation="off", state_dir=str(folder),
                          host_kv_bytes=host_states * per_state)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    try:
        warm = engine.open_state("warm-up")
        warm.generate(one, prompt=prompts[0][:512])
        warm.generate(one, prompt=warm.tokens + [11])  # the resumed turn's shape: graphs captured now
        warm.close()
        a = engine.open_state("a")
        sync(engine.device)
        began = time.perf_counter()
        a.generate(one, prompt=prompts[0])
        sync(engine.device)
        prefill = time.perf_counter() - began
        engine.open_state("b").generate(one, prompt=prompts[1])  # needs the pool: "a" is parked
        tier_of_a = {info.id: info.tier for info in engine.states()}["a"]
        if tier_of_a == "disk":
            for spill in Path(engine.memory()["disk"]["folder"]).iterdir():
                drop_from_page_cache(spill)
        engine.open_state("b").close()
        sync(engine.device)  # the park's copy (on the tier's side stream) is done and counted before
        before = engine.stats().host_tier
        began = time.perf_counter()
        done = a.generate(one, prompt=a.tokens + [11])
        sync(engine.device)
        turn = time.perf_counter() - began
        after = engine.stats().host_tier
        breakdown: dict[str, float] = {}
        b = engine.open_state("b")  # once more, timed call by call: "a" parked by "b", then resumed
        b.generate(one, prompt=prompts[1])
        b.close()
        sync(engine.device)
        with timed_calls(engine.device, breakdown):
            a.generate(one, prompt=a.tokens + [12])
    finally:
        engine.close()
    seconds = after["seconds"] - before["seconds"] + after["disk_seconds"] - before["disk_seconds"]
    moved = after["bytes_moved"] - before["bytes_moved"]
    return dict(tier=tier_of_a, prefill_s=prefill, resume_turn_s=turn, restore_s=seconds, bytes=moved,
                disk_bytes=after["disk_bytes_moved"] - before["disk_bytes_moved"],
                disk_read_s=after["disk_seconds"] - before["disk_seconds"],
                computed=done.stats.computed, restore_bytes_s=moved / seconds if seconds else None,
                breakdown={k: round(v, 6) for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_bench_model(args.model, device, dtype)
    rows = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("RESUME_DIR")) as tmp:
        folder = Path(tmp)
        for name, host_states in (("host", 1), ("disk", 0)):
            rows[name] = resume_once(model, args.context, host_states, folder / name, model.vocab_size)
        nbytes = rows["host"]["bytes"]
        h2d = host_to_device_bandwidth(nbytes, device)
        disk = file_read_bandwidth(rows["disk"]["disk_bytes"] or nbytes, folder)
    print(f"{args.model}, one state of {args.context} tokens ({nbytes / 1e6:.1f} MB of KV), {device}")
    print(f"raw: host-to-device {h2d / 1e9:.2f} GB/s (pinned), file read {disk / 1e9:.2f} GB/s (page cache dropped)")
    for name, row in rows.items():
        raw = h2d if name == "host" else disk
        # from disk: the file's bytes over the whole restore (safetensors maps the file; its pages
        # are read by the copy to the device, after the tier's disk seconds stopped counting)
        speed = (row["bytes"] if name == "host" else row["disk_bytes"]) / row["restore_s"]
        row["of_raw_bandwidth"] = speed / raw
        print(f"{name:5s} tier={row['tier']:5s} restore {row['restore_s'] * 1e3:8.2f} ms "
              f"({speed / 1e9:.2f} GB/s, {speed / raw:.0%} of raw); resumed turn {row['resume_turn_s'] * 1e3:.1f} ms "
              f"computing {row['computed']} tokens; re-prefill {row['prefill_s'] * 1e3:.1f} ms "
              f"({row['prefill_s'] / row['resume_turn_s']:.1f}x the resumed turn)")
        print("      a second resume, call by call (synchronised): " +
              ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row["breakdown"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, context=args.context, device=str(device), host_to_device=h2d,
                           file_read=disk, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
