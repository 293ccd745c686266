"""`hibana bench decode | agents | grammar | serve`: workloads run side by side, a table, and
`--json PATH`. `serve` runs clients in tool loops over HTTP against `hibana serve` and the same
workload in process (`hibana_bench.serve_load`).

With `--trace NAME|PATH` both replay recorded agent conversations instead of random tokens
(trace-driven, `hibana_bench.trace_workloads`), on the speculation systems only. On a checkpoint
(not a random-weight preset) each system's cold start is measured first, in a fresh process:
from its launch to the first generated token, imports included (`hibana_bench.coldstart`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hibana_bench import coldstart, grammar_overhead, serve_load
from hibana_bench.argtypes import count as _count
from hibana_bench.argtypes import counts as _counts
from hibana_bench.argtypes import latency as _latency
from hibana_bench.argtypes import seconds as _seconds
from hibana_bench.models import PRESETS, load_bench_model, preset_weight_bytes
from hibana_core.surgery.checkpoint import MANIFEST
from hibana_bench.spec_systems import SPEC_SYSTEMS, BenchError
from hibana_bench.traces import TraceError
from hibana_bench.workloads import AgentsConfig, agents_workload, decode_workload, surgery_systems

if TYPE_CHECKING:
    from hibana_core.engine import Engine

DECODE_SYSTEMS = ("hibana", "hf_eager", "hf_compiled")
FUSION_POLICIES = ("auto", "on", "off")  # hibana_kernels.fusion.POLICIES
AGENT_SYSTEMS = ("hibana", "hibana_no_retention", "hf_reprefill", "hf_cache_reuse")
TRACE_SYSTEMS = tuple(SPEC_SYSTEMS)  # hibana_spec_off, hibana_spec_k4, hibana
ALL_SYSTEMS = ", ".join(dict.fromkeys(TRACE_SYSTEMS + DECODE_SYSTEMS + AGENT_SYSTEMS + ("hibana_recompute",)))
# the systems each workload runs (a trace runs the speculation systems and reports the rest skipped)
WORKLOAD_SYSTEMS = {"decode": tuple(dict.fromkeys(TRACE_SYSTEMS + DECODE_SYSTEMS)),
                    "agents": tuple(dict.fromkeys(TRACE_SYSTEMS + AGENT_SYSTEMS + ("hibana_recompute",)))}


DEFAULT_CONTEXTS = (512, 8192)
"""decode's context lengths where --context is not given (those the model takes: `_check_context`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hibana bench", description=__doc__)
    sub = parser.add_subparsers(dest="workload", required=True)
    basic = argparse.ArgumentParser(add_help=False)
    basic.add_argument("--model", default="demo",
                       help="checkpoint directory, Hugging Face repo id (org/name[@revision]), demo, or a preset "
                       f"with random weights: {', '.join(PRESETS)}")
    basic.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    basic.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="weights and compute dtype of every system (auto: bfloat16 on CUDA, float32 on CPU)")
    basic.add_argument("--json", type=Path, help="also write the figures to this file")
    common = argparse.ArgumentParser(add_help=False, parents=[basic])
    common.add_argument("--trace", help="replay a recorded trace (trace-driven): a shipped one (coding, demo) "
                        "or a path; runs the speculation systems only")
    common.add_argument("--real-outputs", action="store_true",
                        help="with --trace: the model generates its own outputs (up to the recorded length) "
                        "instead of being forced to the recorded ones")
    common.add_argument("--systems", help=f"comma-separated, from: {ALL_SYSTEMS}, and hibana+PASS (the "
                        "engine with that surgery pass, as --surgery adds); default: "
                        f"{','.join(TRACE_SYSTEMS)} with --trace, else the workload's own list")
    common.add_argument("--no-cold-start", action="store_true",
                        help="skip the cold-start measurement (a fresh process per system that loads the "
                        "checkpoint and generates one token; never run on random-weight presets)")
    decode = sub.add_parser("decode", parents=[common], help="batch-1 decode and prefill speed")
    decode.add_argument("--context", default=None, type=_counts,
                        help="comma-separated context lengths (default %s; a model of a shorter context: "
                             "%d and the longest it takes)" % (",".join(map(str, DEFAULT_CONTEXTS)), DEFAULT_CONTEXTS[0]))
    decode.add_argument("--generate", type=_count, default=128, help="tokens generated per context (default 128)")
    decode.add_argument("--conversations", type=_count, default=1,
                        help="with --trace: replay the first N conversations one after another (default 1)")
    decode.add_argument("--turns", type=_count, help="with --trace: at most this many turns per conversation")
    decode.add_argument("--surgery", default="", help="comma-separated surgery passes (e.g. w8,w4): adds a "
                        "system hibana+PASS for each, with its bytes per token and the guard's decision")
    decode.add_argument("--fusion", default="auto", help="comma-separated kernel-fusion policies (auto, on, "
                        "off: hibana_kernels.fusion): each Hibana system runs once under each; rows of a "
                        "policy other than auto are named SYSTEM/fuse-POLICY")
    decode.add_argument("--pdl", default="on", help="on, off or on,off: Hibana systems with programmatic "
                        "dependent launch (hibana_kernels.pdl; a GPU from Hopper on), without, or both; rows "
                        "without are named SYSTEM/pdl-off")
    agents = sub.add_parser("agents", parents=[common], help="agents in tool loops")
    agents.add_argument("--agents", type=_count, default=8,
                        help="concurrent agents (default 8); with --trace: agents cycle through the trace's "
                        "conversations")
    agents.add_argument("--turns", type=_count, help="turns per agent (default 4; with --trace: all recorded, "
                        "or at most this many)")
    agents.add_argument("--system", type=_count, default=512, help="system prompt tokens (half shared; default 512)")
    agents.add_argument("--tool-result", type=_count, default=64,
                        help="tokens each tool result adds to an agent's history per turn (default 64)")
    agents.add_argument("--generate", type=_count, default=32, help="tokens each agent generates per turn (default 32)")
    agents.add_argument("--peer-agents", type=_count, default=1,
                        help="agents the sequential transformers peers are timed on (default 1)")
    agents.add_argument("--tool-latency", type=_latency, metavar="LO[,HI]",
                        help="seconds each tool call takes before its result comes in, drawn uniformly "
                        "from [LO, HI] per call (default: none)")
    agents.add_argument("--device-kv-agents", type=_count, metavar="N",
                        help="size the device KV pool for N agents' whole histories, so the rest are "
                        "evicted (compare the systems hibana, with the host tier, and hibana_recompute)")
    agents.add_argument("--surgery", default="", help="comma-separated surgery passes (e.g. kv8): adds a "
                        "system hibana+PASS for each (the default engine with that pass; random trace only)")
    grammar = sub.add_parser("grammar", parents=[basic], help="constrained decoding's cost per token "
                             "(JSON schema against none), batch 1 and 32")
    grammar_overhead.add_arguments(grammar)
    serve = sub.add_parser("serve", parents=[basic], help="clients in tool loops over HTTP (hibana serve on "
                           "127.0.0.1) against the same workload in process: outputs, leaks, ttft, turns/h")
    serve.add_argument("--clients", type=_count, default=64, help="concurrent clients (default 64)")
    serve.add_argument("--turns", type=_count, default=20, help="chat completions per client (default 20)")
    serve.add_argument("--max-tokens", type=_count, default=64, help="most tokens a turn generates (default 64)")
    serve.add_argument("--client-processes", type=_count, default=1,
                       help="processes the HTTP clients are spread over, one openai SDK event loop each "
                       "(default 1; on a fast GPU one loop parsing every client's chunks can pace the run)")
    serve.add_argument("--switch-interval", type=_seconds, default=None, metavar="SECONDS",
                       help="sys.setswitchinterval for this process once each run's engine started (default: the "
                       "engine's own, hibana_core.engine_core.SWITCH_INTERVAL; 0.005 is Python's): how long a "
                       "thread waiting for the GIL (the engine's step loop) may wait for the one holding it")
    return parser


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.device, list[str]]:
    """The device and the systems to run, or exit with a usage error (status 2) for options that
    cannot work: unknown systems or surgery passes, a trace that cannot be read, a device this
    machine lacks, a model that is neither a preset nor a checkpoint that can be found, histories
    longer than the model's context. Runs before anything loads."""
    from hibana_core import HibanaError
    from hibana_core.engine import resolve_device

    try:
        device = resolve_device(args.device)
    except HibanaError as exc:
        parser.error(f"--device: {exc}")
    json_path = getattr(args, "json", None)
    if json_path is not None and (json_path.is_dir() or not json_path.parent.is_dir()):
        parser.error(f"--json: {str(json_path)!r} is a folder, or its folder does not exist; give a file's path")
    if args.workload == "grammar":
        if args.tokenizer is not None and not args.tokenizer.is_dir():
            parser.error(f"--tokenizer: {str(args.tokenizer)!r} is not a directory; give a tokenizer's folder")
        _check_context(parser, args, _check_model(parser, args.model))
        return device, []
    if args.workload == "serve":
        import importlib.util

        if importlib.util.find_spec("openai") is None:  # its clients are the openai SDK's, in their own processes
            parser.error("bench serve's clients need the openai package: pip install openai (the test extra has it)")
        _check_context(parser, args, _check_model(parser, args.model))
        return device, []
    default = TRACE_SYSTEMS if args.trace else DECODE_SYSTEMS if args.workload == "decode" else AGENT_SYSTEMS
    listed = (args.systems or ",".join(default)).split(",")
    systems = list(dict.fromkeys(s.strip() for s in listed if s.strip()))  # "a, b" too, each once
    known = ALL_SYSTEMS.split(", ") if args.trace else WORKLOAD_SYSTEMS[args.workload]
    if not systems:  # `--systems ,` ran nothing and printed an empty table
        parser.error(f"--systems {args.systems!r} names no system; name them with commas between, from: "
                     f"{', '.join(known)}")
    unknown = [s for s in systems if s not in known and not (s.startswith("hibana+") and not args.trace)]
    if unknown:
        parser.error(f"unknown system(s) for {args.workload}{' --trace' if args.trace else ''}: "
                     f"{', '.join(unknown)}; known: {', '.join(known)}")
    if args.trace:  # a bad trace fails before the cold start and the loads
        from hibana_bench.traces import load_trace

        try:
            load_trace(args.trace)
        except TraceError as exc:
            parser.error(f"--trace: {exc}")
    if args.workload == "agents" and args.trace and (args.tool_latency or args.device_kv_agents):
        parser.error("--tool-latency and --device-kv-agents apply to the random workload, not to --trace")
    bad_fusion = [f for f in getattr(args, "fusion", "auto").split(",") if f not in FUSION_POLICIES]
    if bad_fusion:
        parser.error(f"unknown fusion policy {', '.join(bad_fusion)}; known: {', '.join(FUSION_POLICIES)}")
    if any(p not in ("on", "off") for p in getattr(args, "pdl", "on").split(",")):
        parser.error(f"--pdl takes on, off or on,off, not {args.pdl!r}")
    named = [s.split("+", 1)[1] for s in systems if s.startswith("hibana+")]
    if "" in named:
        parser.error("--systems: hibana+ names no surgery pass (hibana+w4, say)")
    passes = list(dict.fromkeys([p.strip() for p in getattr(args, "surgery", "").split(",") if p.strip()] + named))
    if passes:
        from hibana_plugins.manager import get_plugin_manager

        registered = get_plugin_manager().surgery_passes()
        missing = [p for p in passes if p not in registered]
        if missing:
            parser.error(f"--surgery: no pass named {', '.join(missing)}; registered: {', '.join(sorted(registered))}")
        systems += [s for s in surgery_systems(passes) if s not in systems]  # `--systems hibana+w4` alone too
    peers = [s for s in systems if s.startswith("hf_")]
    if peers and PRESETS.get(args.model, {}).get("mxfp4_experts"):
        parser.error(f"--systems: {', '.join(peers)} cannot run {args.model}: the preset's experts are MXFP4, "
                     "which transformers runs only with the Hub's kernels; name the hibana systems alone")
    path = _check_model(parser, args.model)
    if peers and path is not None and (path / MANIFEST).is_file():
        parser.error(f"--systems: {', '.join(peers)} cannot run {args.model}: `hibana surgery` wrote it "
                     f"({MANIFEST}: packed layers, sink + window attention), which transformers does not read "
                     "(it would run made-up weights); bench its source checkpoint against transformers, or name "
                     "the hibana systems alone")
    if not args.trace:  # a trace's conversations are checked against the context once it is read
        _check_context(parser, args, path)
    if getattr(args, "context", 0) is None:  # no context limit read: the defaults as they are
        args.context = list(DEFAULT_CONTEXTS)
    return device, systems


def _check_model(parser: argparse.ArgumentParser, model: str) -> Path | None:
    """The checkpoint directory `model` names (None for a preset), or exit with a usage error
    unless it is a preset or a checkpoint that can be found."""
    from hibana_core import HibanaError
    from hibana_core.loader import family_of, read_model_type, resolve_checkpoint, weight_files

    if model in PRESETS:
        return None
    try:
        path = resolve_checkpoint(model, progress=True)  # a repo id is downloaded here, once
        family_of(read_model_type(path))  # an architecture no family serves: UnsupportedModelError, listing them
        weight_files(path)  # no safetensors (a pytorch_model.bin alone): said here, not by a cold-start subprocess
        return path
    except HibanaError as exc:
        parser.error(f"--model: {exc} (or name a preset: {', '.join(PRESETS)})")


def _check_context(parser: argparse.ArgumentParser, args: argparse.Namespace, path: Path | None) -> None:
    """Exit with a usage error where the workload's longest history (grammar: a prompt and its
    generation; serve: one turn's) is past the model's context (its config's
    max_position_embeddings), rather than fail on it after the loads."""
    if path is None:
        limit = PRESETS[args.model].get("max_position_embeddings")
    else:
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return  # the load names what is wrong with the checkpoint
        limit = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
            "max_position_embeddings")
    if not isinstance(limit, int):
        return
    if args.workload == "decode" and args.context is None:  # the defaults, within the model's context
        room = limit - args.generate
        short, long = DEFAULT_CONTEXTS
        args.context = [short, long] if room >= long else sorted({min(short, room), room}) if room > 0 else [short]
    if args.workload == "decode" and max(args.context) + args.generate > limit:
        parser.error(f"--context: {max(args.context)} tokens plus --generate {args.generate} exceed "
                     f"{args.model}'s context of {limit} tokens; give contexts up to {limit - args.generate}, "
                     f"e.g. --context 512,{limit - args.generate}")
    if args.workload == "grammar" and args.prompt + args.generate > limit:  # refused after the load, or cut short
        parser.error(f"--prompt {args.prompt} plus --generate {args.generate} tokens exceed {args.model}'s context "
                     f"of {limit} tokens; give fewer")
    if args.workload == "serve" and args.max_tokens > limit:  # every request over HTTP would be a 400
        parser.error(f"--max-tokens {args.max_tokens} is more than {args.model}'s context of {limit} tokens, which "
                     f"the server refuses; give at most {limit}")
    if args.workload == "agents":
        turns = args.turns or 4
        history = args.system + turns * (args.tool_result + args.generate)
        if history > limit:
            parser.error(f"an agent's history reaches {history} tokens (--system {args.system} plus --turns "
                         f"{turns} of --tool-result {args.tool_result} and --generate {args.generate}), past "
                         f"{args.model}'s context of {limit} tokens; give fewer turns or smaller parts")


def main(argv: list[str] | None = None) -> int:
    from hibana_core import HibanaError

    parser = build_parser()
    args = parser.parse_args(argv)
    device, systems = check_options(parser, args)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.model in PRESETS:
        _check_preset_fits(parser, args.model, device, dtype)
    if args.workload == "grammar":
        try:
            report = grammar_overhead.run(args, device, dtype)
        except HibanaError as exc:
            print(f"hibana bench: {exc}", file=sys.stderr)
            return 2
        return _finish(args, report, device, dtype)
    if args.workload == "serve":
        try:
            return run_serve(args, device, dtype)
        except HibanaError as exc:
            print(f"hibana bench: {exc}", file=sys.stderr)
            return 2
    try:
        cold = cold_start(args, device, dtype)
        if cold:
            print_cold_start(cold)
        report = run_trace(args, device, dtype, systems) if args.trace else run_random(args, device, dtype, systems)
    except (BenchError, TraceError, HibanaError) as exc:
        print(f"hibana bench: {exc}", file=sys.stderr)
        return 2
    report["cold_start"] = cold
    return _finish(args, report, device, dtype)


def _check_preset_fits(parser: argparse.ArgumentParser, model: str, device: torch.device, dtype: torch.dtype) -> None:
    """Exit with a usage error where a preset's random weights alone are more than the device has
    free (a GPU preset on the CPU: qwen3-8b's 33 GB in float32), rather than be killed for memory, or
    fail with a traceback, while they are made."""
    from hibana_core.kv.budget import device_memory

    need, free = preset_weight_bytes(model, dtype), device_memory(device).free
    if need > free:
        name = str(dtype).removeprefix("torch.")
        smaller = ", give --dtype bfloat16 (half float32's bytes)" if dtype == torch.float32 else ""
        parser.error(f"--model: {model}'s weights take {need / 1e9:.1f} GB in {name}, more than the "
                     f"{free / 1e9:.1f} GB free on {device}; run it on a GPU that holds them (--device cuda)"
                     f"{smaller}, or name a smaller model (the demo model, a checkpoint)")


def run_serve(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> int:
    """The serve workload; exit status 1 when a check failed (an error, a leaked block, a
    conversation that differs over HTTP where outputs are exact: float32)."""
    cfg = serve_load.ServeLoadConfig(args.clients, args.turns, args.max_tokens, args.client_processes)
    open_engine = _serve_engines(args.model, device, dtype)
    if args.switch_interval is not None:  # after each engine lowered it to its own (set before, 5 ms was 0.5)
        engine_alone = open_engine

        def open_engine() -> Engine:
            engine = engine_alone()
            sys.setswitchinterval(args.switch_interval)
            return engine
    report = serve_load.serve_load(open_engine, args.model, cfg, exact=dtype == torch.float32)
    serve_load.print_serve_load(report)
    _finish(args, report, device, dtype)
    mismatched = report["mismatched_clients"] and report["exact"]
    return int(bool(report["errors"] or mismatched or any(report["leaked_blocks"].values())))


def _serve_engines(model: str, device: torch.device, dtype: torch.dtype) -> Callable[[], Engine]:
    """What opens each run's engine: the checkpoint's, or a random-weight preset's, built once,
    with the demo model's tokenizer and chat template (`models.chat_tokenizer`)."""
    from hibana_core import Engine

    dtype_name = str(dtype).removeprefix("torch.")
    if model in PRESETS:
        bench_model = load_bench_model(model, device, dtype, chat=True)
        return lambda: bench_model.engine(device=str(device), dtype=dtype_name)
    return lambda: Engine.from_pretrained(model, device=str(device), dtype=dtype_name, progress=False)


def _finish(args: argparse.Namespace, report: dict, device: torch.device, dtype: torch.dtype) -> int:
    report["environment"] = environment(device, dtype)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_finite(report), indent=2, allow_nan=False))
    return 0


def _finite(value):
    """`value` with NaN and infinities as null: JSON has no such numbers (Python writes NaN, which
    JavaScript's JSON.parse, Go's and serde's readers refuse); a figure not measured (a peer's time
    to first token) is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def cold_start(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict | None:
    """Hibana's and transformers' cold start on the checkpoint, each in a fresh process, before
    this process loads anything (Hibana's alone on a checkpoint `hibana surgery` wrote, which
    transformers does not read); None on a random-weight preset or with --no-cold-start."""
    if args.no_cold_start or args.model in PRESETS:
        return None
    dtype_name = str(dtype).removeprefix("torch.")
    from hibana_core.loader import resolve_checkpoint

    ours = (resolve_checkpoint(args.model) / MANIFEST).is_file()
    return {system: coldstart.measure(system, args.model, str(device), dtype_name) for system in coldstart.SYSTEMS
            if not ours or system != "transformers"}


def print_cold_start(cold: dict) -> None:
    print("cold start: a fresh process to its first generated token (imports, load, one-token generation)")
    print(f"{'system':<14}{'total s':>9}{'startup s':>11}{'load s':>9}{'1st token s':>13}  load stages (s)")
    for system, r in cold.items():
        stages = ", ".join(f"{name} {seconds:.2f}" for name, seconds in r["stages"].items()) or "-"
        print(f"{system:<14}{r['total_s']:>9.2f}{r['startup_s']:>11.2f}{r['load_s']:>9.2f}"
              f"{r['first_token_s']:>13.2f}  {stages}")


def run_trace(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, systems: list[str]) -> dict:
    from hibana_bench.trace_report import print_trace_agents, print_trace_decode
    from hibana_bench.trace_workloads import trace_agents_workload, trace_decode_workload
    from hibana_bench.traces import load_trace, resolve_trace_path

    path = str(resolve_trace_path(args.trace))
    trace = load_trace(path)  # a bad trace fails before the model loads
    model = load_bench_model(args.model, device, dtype)
    if args.workload == "decode":
        report = trace_decode_workload(model, trace, path, systems, args.conversations, args.real_outputs,
                                       args.turns)
        print_trace_decode(report)
    else:
        report = trace_agents_workload(model, trace, path, systems, args.agents, args.turns, args.real_outputs)
        print_trace_agents(report)
    return report


def run_random(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, systems: list[str]) -> dict:
    model = load_bench_model(args.model, device, dtype)
    if args.workload == "decode":
        report = decode_workload(model, args.context, args.generate, systems,
                                 fusions=[f for f in args.fusion.split(",") if f],
                                 pdls=[{"on": True, "off": False}[p] for p in args.pdl.split(",")])
        print_decode(report)
    else:
        cfg = AgentsConfig(args.agents, args.turns or 4, args.system, args.tool_result, args.generate,
                           args.peer_agents, tool_latency=args.tool_latency, device_kv_agents=args.device_kv_agents)
        report = agents_workload(model, cfg, systems)
        print_agents(report)
    return report


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """Where a report was made. The commit: $HIBANA_COMMIT where set (a copy of the tree whose git
    metadata is not the tree's, as on the device machine, which keeps its first copy's), else git's."""
    commit = os.environ.get("HIBANA_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        pass
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or "cpu", "dtype": str(dtype),
            "torch": torch.__version__, "commit": commit}


def print_decode(report: dict) -> None:
    note = " (random weights: speed does not depend on weight values)" if report["random_weights"] else ""
    print(f"decode, {report['model']}{note}; weights {report['weight_bytes'] / 1e9:.2f} GB")
    roof = report["roofline_tok_s"]
    if roof:
        measured = report.get("copy_bandwidth_before_after")
        when = (" (measured before / after the engines: " + " / ".join(f"{b / 1e12:.2f}" for b in measured) + ")"
                if measured else "")
        print(f"copy bandwidth {report['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s{when} -> batch-1 roofline "
              f"{roof:.1f} tok/s (weights only)")
    print("weight GB: what the engine holds (after surgery); KV MB/tok: the keys and values one decode "
          "token reads at the row's context; % roofline: of the weight bytes a token reads, % +KV: of "
          "those and its KV bytes")
    print(f"{'system':<16}{'context':>8}{'decode tok/s':>14}{'% roofline':>12}{'% +KV':>7}{'tok/step':>9}"
          f"{'prefill tok/s':>15}{'weight GB':>11}{'KV MB/tok':>11}{'row/hibana':>11}  guard")
    bandwidth = report["copy_bandwidth_bytes_s"]
    base = {r["context"]: r["decode_tok_s"] for r in report["rows"] if r["system"] == "hibana"}
    for row in report["rows"]:
        # each system's own roofline: the weight bytes it reads per token (after surgery; of a
        # MoE model only the routed experts, of an untied embedding table only one row), else all.
        # Against it, a speculating system's tok/s counts accepted drafts (tok/step above 1)
        read = row.get("read_bytes") or row.get("weight_bytes")
        own = bandwidth / read if bandwidth and read else roof
        share = f"{100 * row['decode_tok_s'] / own:.0f}%" if own else "-"
        # the same against every byte a token reads: its weights and its context's keys and values
        with_kv = f"{100 * row['decode_tok_s'] * (read + row['kv_read_bytes']) / bandwidth:.0f}%" \
            if bandwidth and read and row.get("kv_read_bytes") else "-"
        size = f"{row['weight_bytes'] / 1e9:.3f}" if row.get("weight_bytes") else "-"
        kv = f"{row['kv_read_bytes'] / 1e6:.3f}" if row.get("kv_read_bytes") else "-"  # at the row's context
        ratio = f"{row['decode_tok_s'] / base[row['context']]:.2f}x" if row["context"] in base else "-"
        guard = row.get("guard")
        verdict = "-" if not guard else (f"ppl x{guard['ppl_ratio']:.4f}, top-1 {guard['top1_agreement']:.1%}: "
                                         f"{guard['decision']}")
        per_step = f"{row['tokens_per_step']:.2f}" if row.get("tokens_per_step") else "-"
        print(f"{row['system']:<16}{row['context']:>8}{row['decode_tok_s']:>14.1f}{share:>12}{with_kv:>7}{per_step:>9}"
              f"{row['prefill_tok_s']:>15.0f}{size:>11}{kv:>11}{ratio:>11}  {verdict}")
    if any((row.get("tokens_per_step") or 1.0) > 1.0 for row in report["rows"]):
        print("tok/step above 1: speculation's accepted drafts count in decode tok/s and % roofline"
              + (" (a random model's greedy output repeats itself)" if report.get("random_weights") else "")
              + ("; hibana_spec_off's rows are the decode speed"
                 if any(row["system"] == "hibana_spec_off" for row in report["rows"]) else ""))


def print_agents(report: dict) -> None:
    cfg = report["config"]
    note = " (random weights)" if report["random_weights"] else ""
    print(f"agents, {report['model']}{note}: {cfg['agents']} agents x {cfg['turns']} turns, system "
          f"{cfg['system']} (half shared), tool result {cfg['tool_result']}, generate {cfg['generate']}"
          + (f", tool latency {cfg['tool_latency'][0]:g}-{cfg['tool_latency'][1]:g} s" if cfg.get("tool_latency") else "")
          + (f", device KV for {cfg['device_kv_agents']} agents" if cfg.get("device_kv_agents") else ""))
    # hibana/row: how many times this row's turns/h hibana's are (the speedup over a peer)
    header = ("turns/h", "hibana/row", "decode tok/s", "computed/turn", "reused/turn", "ttft p50", "ttft p95",
              "timed on")
    width = max(len(name) for name in report["results"]) + 2 if report["results"] else 14
    print(f"{'system':<{width}}" + "".join(f"{h:>14}" for h in header))
    for name, r in report["results"].items():
        timed = f"{r['agents_timed']} agents"
        ttft = (f"{r['ttft_p50_s']:.3f}s", f"{r['ttft_p95_s']:.3f}s") if r["ttft_p50_s"] == r["ttft_p50_s"] \
            else ("-", "-")
        cells = (f"{r['turns_per_hour']:.0f}", f"{r.get('hibana_ratio', float('nan')):.2f}x",
                 f"{r['decode_tok_s']:.1f}", f"{r['computed_per_turn']:.0f}", f"{r['reused_per_turn']:.0f}",
                 *ttft, timed)
        print(f"{name:<{width}}" + "".join(f"{c:>14}" for c in cells))
    for name, r in report["results"].items():
        if r.get("kv_blocks"):
            print(f"{name}: KV pool {r['kv_blocks']:,} blocks in {r['kv_bytes'] / 1e9:.2f} GB")
            if r.get("device_memory_before"):  # a system's pool is a share of what the one before it left free
                m = r["device_memory_before"]
                print(f"{name}: at its start {m['free'] / 1e9:.2f} GB of the device free, {m['allocated'] / 1e9:.2f} GB "
                      f"held by this process's tensors ({m['reserved'] / 1e9:.2f} GB reserved)")
        tier = r.get("host_tier")
        if tier and tier["parks"]:
            print(f"{name}: host tier {tier['parks']} parks, {tier['resumes']} resumes "
                  f"({tier['prefetches']} ahead of their turn), "
                  f"{tier['bytes_moved'] / 1e9:.2f} GB moved in {tier['seconds']:.2f} s "
                  f"({tier.get('host_seconds', 0):.2f} s of the step loop in parks and restores, "
                  f"{tier.get('pinned_cold', 0)} pinned allocations without a spare), "
                  f"{tier['tokens_restored']:,} prompt tokens not recomputed")
            if tier.get("host_phases"):
                print(f"{name}: the step loop's time in the tier by phase: "
                      + ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in tier["host_phases"].items()))
        line = r.get("timeline")
        if line:
            queued = (f"; a request waited {line['queued_fraction']:.0%} of the time, with "
                      f"{line['running_when_queued']:.1f} running and {line['kv_used_when_queued']:.0%} of KV in use"
                      if line["running_when_queued"] is not None else "")
            print(f"{name}: {line['running_mean']:.1f} requests running on average, {line['waiting_mean']:.1f} "
                  f"waiting; {line['steps_per_s']:.1f} steps/s, {line['step_busy']:.0%} of the time in steps, "
                  f"{line['tokens_per_step']:.1f} tokens generated a step{queued}")


if __name__ == "__main__":
    raise SystemExit(main())
