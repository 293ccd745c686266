"""Tables for the trace-driven workloads; every header says "trace-driven"."""

from __future__ import annotations


def _header(report: dict) -> str:
    trace = report["trace"]
    weights = " (random weights)" if report["random_weights"] else ""
    outputs = "outputs forced to the recorded ones" if trace["outputs"] == "forced" else "real outputs (not forced)"
    return (f"{report['workload']}, trace-driven: trace {trace['name']!r} ({trace['conversations']} conversations, "
            f"{trace['tokenizer']}), {report['model']}{weights}, {outputs}")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spec_cells(s: dict) -> tuple[str, ...]:
    return (_fmt(s["draft_tokens_proposed"], "d"), _fmt(s["draft_tokens_accepted"], "d"),
            _fmt(s["acceptance_rate"], ".1%"), _fmt(s["verify_steps"], "d"),
            _fmt(s["tokens_per_verify"], ".2f") + ("*" if s["tokens_per_verify_estimated"] else ""))


SPEC_COLUMNS = ("proposed", "accepted", "accept %", "verify steps", "tok/verify")
NOTE = ("tok/verify: mean tokens a sequence emits in a step that verifies its drafts (*: estimated as accepted / "
        "verify steps + 1); verify steps: engine steps (batched); ratio: against hibana_spec_off; '-': not counted")


def _skipped(report: dict) -> None:
    if report["skipped_systems"]:
        print(f"skipped in trace-driven mode (no forced outputs, no resident state): "
              f"{', '.join(report['skipped_systems'])}; run them without --trace")


def print_trace_decode(report: dict) -> None:
    print(_header(report))
    print(f"batch 1, {report['conversations_replayed']} conversation(s) replayed one after another; decode tok/s "
          f"excludes each turn's first token (prefill)")
    columns = ("system", "decode tok/s", "ratio", "decode tokens", "turns") + SPEC_COLUMNS
    print(f"{columns[0]:<16}" + "".join(f"{c:>14}" for c in columns[1:]))
    for r in report["rows"]:
        cells = (f"{r['decode_tok_s']:.1f}", _fmt(r["ratio_vs_spec_off"], ".2f"), str(r["decode_tokens"]),
                 str(r["turns"]), *_spec_cells(r["spec"]))
        print(f"{r['system']:<16}" + "".join(f"{c:>14}" for c in cells))
    print(NOTE)
    _skipped(report)


def print_trace_agents(report: dict) -> None:
    print(_header(report))
    repeats = "" if report["agents"] <= report["distinct_conversations"] else (
        f" (repeats get {report['replica_salt_tokens']} salt tokens after the shared prefix; their outputs repeat)")
    print(f"{report['agents']} agents at once over {report['distinct_conversations']} distinct conversations"
          f"{repeats}; {report['turns']} turns, {report['recorded_output_tokens']} recorded output tokens")
    columns = ("system", "turns/h", "ratio", "decode tok/s", "ttft p50", "ttft p95") + SPEC_COLUMNS
    print(f"{columns[0]:<16}" + "".join(f"{c:>14}" for c in columns[1:]))
    for name, r in report["results"].items():
        cells = (f"{r['turns_per_hour']:.0f}", _fmt(r["ratio_vs_spec_off"], ".2f"), f"{r['decode_tok_s']:.1f}",
                 f"{r['ttft_p50_s']:.3f}s", f"{r['ttft_p95_s']:.3f}s", *_spec_cells(r))
        print(f"{name:<16}" + "".join(f"{c:>14}" for c in cells))
    print(NOTE + "; decode tok/s: generated tokens / wall time of the whole run")
    _skipped(report)
