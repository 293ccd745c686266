"""`hibana bench decode | agents | grammar`: workloads run side by side, a table, and `--json PATH`.

With `--trace NAME|PATH` both replay recorded agent conversations instead of random tokens
(trace-driven, `hibana_bench.trace_workloads`), on the speculation systems only.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from hibana_bench import grammar_overhead
from hibana_bench.models import PRESETS, load_bench_model
from hibana_bench.spec_systems import SPEC_SYSTEMS, BenchError
from hibana_bench.traces import TraceError
from hibana_bench.workloads import AgentsConfig, agents_workload, decode_workload, surgery_systems

DECODE_SYSTEMS = ("hibana", "hf_eager", "hf_compiled")
AGENT_SYSTEMS = ("hibana", "hibana_no_retention", "hf_reprefill", "hf_cache_reuse")
TRACE_SYSTEMS = tuple(SPEC_SYSTEMS)  # hibana_spec_off, hibana_spec_k4, hibana
ALL_SYSTEMS = ", ".join(dict.fromkeys(TRACE_SYSTEMS + DECODE_SYSTEMS + AGENT_SYSTEMS))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hibana bench", description=__doc__)
    sub = parser.add_subparsers(dest="workload", required=True)
    basic = argparse.ArgumentParser(add_help=False)
    basic.add_argument("--model", default="demo",
                       help=f"checkpoint path, demo, or a preset: {', '.join(PRESETS)}")
    basic.add_argument("--device", default="auto")
    basic.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    basic.add_argument("--json", type=Path, help="also write the figures to this file")
    common = argparse.ArgumentParser(add_help=False, parents=[basic])
    common.add_argument("--trace", help="replay a recorded trace (trace-driven): a shipped one (coding, demo) "
                        "or a path; runs the speculation systems only")
    common.add_argument("--real-outputs", action="store_true",
                        help="with --trace: the model generates its own outputs (up to the recorded length) "
                        "instead of being forced to the recorded ones")
    common.add_argument("--systems", help=f"comma-separated, from: {ALL_SYSTEMS}; default: "
                        f"{','.join(TRACE_SYSTEMS)} with --trace, else the workload's own list")
    decode = sub.add_parser("decode", parents=[common], help="batch-1 decode and prefill speed")
    decode.add_argument("--context", default="512,8192", help="comma-separated context lengths")
    decode.add_argument("--generate", type=int, default=128)
    decode.add_argument("--conversations", type=int, default=1,
                        help="with --trace: replay the first N conversations one after another (default 1)")
    decode.add_argument("--turns", type=int, help="with --trace: at most this many turns per conversation")
    decode.add_argument("--surgery", default="", help="comma-separated surgery passes (e.g. w8,w4): adds a "
                        "system hibana+PASS for each, with its bytes per token and the guard's decision")
    agents = sub.add_parser("agents", parents=[common], help="agents in tool loops")
    agents.add_argument("--agents", type=int, default=8,
                        help="with --trace: agents cycle through the trace's conversations")
    agents.add_argument("--turns", type=int, help="turns per agent (default 4; with --trace: all recorded, "
                        "or at most this many)")
    agents.add_argument("--system", type=int, default=512, help="system prompt tokens (half shared)")
    agents.add_argument("--tool-result", type=int, default=64)
    agents.add_argument("--generate", type=int, default=32)
    agents.add_argument("--peer-agents", type=int, default=1,
                        help="agents the sequential transformers peers are timed on")
    grammar = sub.add_parser("grammar", parents=[basic], help="constrained decoding's cost per token "
                             "(JSON schema against none), batch 1 and 32")
    grammar_overhead.add_arguments(grammar)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.workload == "grammar":
        report = grammar_overhead.run(args, device, dtype)
        report["environment"] = environment(device, dtype)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return 0
    default = TRACE_SYSTEMS if args.trace else DECODE_SYSTEMS if args.workload == "decode" else AGENT_SYSTEMS
    systems = [s for s in (args.systems or ",".join(default)).split(",") if s]
    unknown = [s for s in systems if s not in ALL_SYSTEMS.split(", ")]
    if getattr(args, "surgery", ""):
        systems += surgery_systems([p for p in args.surgery.split(",") if p])
    if unknown:
        build_parser().error(f"unknown system(s) {', '.join(unknown)}; known: {ALL_SYSTEMS}")
    try:
        report = run_trace(args, device, dtype, systems) if args.trace else run_random(args, device, dtype, systems)
    except (BenchError, TraceError) as exc:
        print(f"hibana bench: {exc}", file=sys.stderr)
        return 2
    report["environment"] = environment(device, dtype)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


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
        report = decode_workload(model, [int(c) for c in args.context.split(",")], args.generate, systems)
        print_decode(report)
    else:
        cfg = AgentsConfig(args.agents, args.turns or 4, args.system, args.tool_result, args.generate,
                           args.peer_agents)
        report = agents_workload(model, cfg, systems)
        print_agents(report)
    return report


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or "cpu", "dtype": str(dtype),
            "torch": torch.__version__, "commit": commit}


def print_decode(report: dict) -> None:
    note = " (random weights: speed does not depend on weight values)" if report["random_weights"] else ""
    print(f"decode, {report['model']}{note}; weights {report['weight_bytes'] / 1e9:.2f} GB")
    roof = report["roofline_tok_s"]
    if roof:
        print(f"copy bandwidth {report['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s -> batch-1 roofline "
              f"{roof:.1f} tok/s (weights only)")
    print(f"{'system':<16}{'context':>8}{'decode tok/s':>14}{'% roofline':>12}{'prefill tok/s':>15}"
          f"{'weight GB':>11}{'x hibana':>10}  guard")
    bandwidth = report["copy_bandwidth_bytes_s"]
    base = {r["context"]: r["decode_tok_s"] for r in report["rows"] if r["system"] == "hibana"}
    for row in report["rows"]:
        # each system's own roofline: the bytes it reads per token (weights after surgery)
        own = bandwidth / row["weight_bytes"] if bandwidth and row.get("weight_bytes") else roof
        share = f"{100 * row['decode_tok_s'] / own:.0f}%" if own else "-"
        size = f"{row['weight_bytes'] / 1e9:.3f}" if row.get("weight_bytes") else "-"
        ratio = f"{row['decode_tok_s'] / base[row['context']]:.2f}x" if row["context"] in base else "-"
        guard = row.get("guard")
        verdict = "-" if not guard else (f"ppl x{guard['ppl_ratio']:.4f}, top-1 {guard['top1_agreement']:.1%}: "
                                         f"{guard['decision']}")
        print(f"{row['system']:<16}{row['context']:>8}{row['decode_tok_s']:>14.1f}{share:>12}"
              f"{row['prefill_tok_s']:>15.0f}{size:>11}{ratio:>10}  {verdict}")


def print_agents(report: dict) -> None:
    cfg = report["config"]
    note = " (random weights)" if report["random_weights"] else ""
    print(f"agents, {report['model']}{note}: {cfg['agents']} agents x {cfg['turns']} turns, system "
          f"{cfg['system']} (half shared), tool result {cfg['tool_result']}, generate {cfg['generate']}")
    header = ("system", "turns/h", "x hibana", "decode tok/s", "computed/turn", "reused/turn",
              "ttft p50", "ttft p95", "timed on")
    print("".join(f"{h:>14}" for h in header))
    for name, r in report["results"].items():
        timed = f"{r['agents_timed']} agents"
        ttft = (f"{r['ttft_p50_s']:.3f}s", f"{r['ttft_p95_s']:.3f}s") if r["ttft_p50_s"] == r["ttft_p50_s"] \
            else ("-", "-")
        cells = (name, f"{r['turns_per_hour']:.0f}", f"{r.get('hibana_ratio', float('nan')):.2f}",
                 f"{r['decode_tok_s']:.1f}", f"{r['computed_per_turn']:.0f}", f"{r['reused_per_turn']:.0f}",
                 *ttft, timed)
        print("".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    raise SystemExit(main())
