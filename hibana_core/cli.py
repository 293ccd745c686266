"""The `hibana` command: `hibana plugins | demo | bench | surgery ...`.

Each subcommand is one function taking the parsed arguments and returning the exit status.
Commands that live outside the core (the benchmark harness) are found by name in the
`hibana.commands` entry-point group, so the core never imports them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

STARTED = time.time()
"""When this module was imported (the console script's first import): where the OS does not say
when the process started, `hibana demo` reports its cold start from here."""

COMMAND_GROUP = "hibana.commands"
# Commands found through COMMAND_GROUP (Hibana's own pyproject declares them), with their help
# line: listing them in `hibana --help` must not import them. Each is `main(argv) -> int`.
ENTRY_POINT_COMMANDS = {
    "bench": "workloads side by side with transformers peers (hibana bench decode|agents|grammar|serve --help)",
    "serve": "an OpenAI-compatible HTTP server, conversations kept resident (hibana serve --help)",
}
COMMAND_EXTRAS = {"serve": "serve"}
"""The pip extra that brings a command's own dependencies (`hibana serve` needs FastAPI)."""


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --dtype as every command that loads a model for an engine reads them
    (`hibana surgery`, `hibana serve`), each passed to EngineConfig as it is."""
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="compute dtype (auto: on a GPU the checkpoint's 16-bit dtype, bfloat16 for a float32 "
                        "one; float32 on CPU)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hibana` console script; returns the exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:  # `hibana plugins --json | head`: the reader left; say nothing more
        try:  # and let the interpreter's last flush of stdout write nowhere instead of raising again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1
    except KeyboardInterrupt:  # Ctrl+C: one line, as a shell's own commands stop, not a traceback
        # on a line of its own: a progress bar may have left the cursor at the end of its line
        print("\nhibana: interrupted" if sys.stderr.isatty() else "hibana: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, what a shell reports for a command Ctrl+C stopped
    except Exception as exc:  # what a command did not say itself (a plugin set-up gone wrong): one line
        from hibana_core.errors import HibanaError

        if not isinstance(exc, HibanaError):
            raise
        print(f"hibana: {exc}", file=sys.stderr)
        return 1


def _main(argv: Sequence[str] | None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "demo":  # the demo and the benchmarks parse their own options
        return run_demo(rest)
    if args.command in ENTRY_POINT_COMMANDS:
        return run_entry_point_command(args.command, rest)
    if rest:  # the command's own usage line with the error (exit status 2)
        build_parser().commands.choices[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hibana", description="Local LLM inference engine for agents."
    )
    parser.add_argument("--version", action="version", version=version(),
                        help="print Hibana's version (and Python's and torch's) and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = commands  # each command's parser by name (`commands.choices`): its own usage errors

    plugins = commands.add_parser(
        "plugins", help="list every registered plugin and what it registers"
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(run=run_plugins)

    for name, summary in ENTRY_POINT_COMMANDS.items():
        commands.add_parser(name, add_help=False, help=summary)
    commands.add_parser(
        "demo", add_help=False,
        help="agents solving tasks in tool loops on the bundled demo model (hibana demo --help)",
    )

    surgery = commands.add_parser(
        "surgery", help="apply model surgery passes, measure them with the guard, write a checkpoint",
        description="Apply surgery passes to a checkpoint, print the guard's figures against the "
                    "unmodified model, and (with --out) write a checkpoint that loads with the "
                    "passes applied. Example: hibana surgery path/to/model --passes w4 --out model-w4")
    surgery.add_argument("model", help="checkpoint directory, Hugging Face repo id (org/name[@revision]), or demo")
    surgery.add_argument("--passes", required=True,
                         help='comma-separated pass names (w8, w4: int8/int4 weights; kv8: fp8 KV cache; window: '
                              'sink-plus-window attention on the layers that matter least for long context; '
                              '`hibana plugins` lists every registered pass), or a JSON list such as '
                              '\'[{"name": "w4", "group_size": 64}]\'')
    surgery.add_argument("--out", help="write the rewritten checkpoint to this (new or empty) directory")
    surgery.add_argument("--force", action="store_true", help="keep passes over their guard floors")
    surgery.add_argument("--guard-text", help="a UTF-8 text file to measure on instead of the demo conversations")
    surgery.add_argument("--no-guard", action="store_true", help="skip the guard (no quality figures)")
    add_device_arguments(surgery)
    surgery.set_defaults(run=run_surgery)
    return parser


def run_demo(argv: list[str]) -> int:
    from hibana_core.coldstart import process_start_time
    from hibana_core.demo.run import main as demo_main

    return demo_main(argv, started=process_start_time() or STARTED)


def version() -> str:
    """'hibana 0.1.0 (Python 3.11.7, torch 2.13.0+cpu)', read without importing torch."""
    from hibana_core import __version__

    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return f"hibana {__version__} (Python {platform.python_version()}, torch {torch})"


def run_entry_point_command(name: str, argv: list[str]) -> int:
    """Run the command registered as `name` in COMMAND_GROUP; say what to do when none is."""
    found = importlib.metadata.entry_points(group=COMMAND_GROUP, name=name)
    if not found:
        print(
            f"hibana {name}: no installed package provides this command (entry point {name!r} in"
            f" group {COMMAND_GROUP!r}). Install Hibana with pip (`pip install -e .` in a"
            f" checkout) so that its entry points are registered.",
            file=sys.stderr,
        )
        return 2
    try:
        command = next(iter(found)).load()  # one distribution found twice on sys.path: the first
    except ModuleNotFoundError as exc:
        extra = COMMAND_EXTRAS.get(name)
        hint = f"; install the {extra!r} extra: pip install -e \".[{extra}]\" in a checkout" if extra else ""
        print(f"hibana {name}: it needs {exc.name or exc}, which is not installed{hint}", file=sys.stderr)
        return 2
    return command(argv)


# -- hibana surgery ------------------------------------------------------------------------------


def run_surgery(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hibana_core import HibanaError
    from hibana_core.surgery import checkpoint

    text = args.passes.strip()
    try:
        named = not text.startswith(("[", "{"))  # names with commas between, not JSON
        passes = ([p.strip() for p in text.split(",")] if text else []) if named else json.loads(text)
        if isinstance(passes, dict):  # one pass as a JSON object
            passes = [passes]
    except json.JSONDecodeError as exc:
        print(f"hibana surgery: --passes is neither names nor JSON (a list of passes, or one) ({exc})", file=sys.stderr)
        return 2
    if not passes or (named and "" in passes):
        print(f"hibana surgery: --passes {args.passes!r} names {'an empty pass' if passes else 'no pass'}; "
              "name passes with commas between, e.g. --passes w8,kv8", file=sys.stderr)
        return 2
    if args.force:
        passes = [{**({"name": p} if isinstance(p, str) else p), "force": True} if isinstance(p, (str, dict)) else p
                  for p in passes]  # what is neither the engine refuses, saying what a pass is
    made = None  # the outermost directory this run makes for --out, removed again if it writes nothing
    if args.out:
        for folder in (Path(args.out).absolute(), *Path(args.out).absolute().parents):
            if folder.exists():
                break
            made = folder
    try:
        if args.out:  # before the minutes of loading, surgery and guard
            checkpoint.check_out(Path(args.out))
    except HibanaError as exc:  # the option's value: a usage error
        print(f"hibana surgery: --out: {exc}", file=sys.stderr)
        return 2
    try:
        return _surgery_run(args, passes)
    finally:  # a run that wrote nothing leaves no directory it made behind
        if made is not None and Path(args.out).is_dir() and not any(Path(args.out).iterdir()):
            shutil.rmtree(made)  # the folders it made down to --out, all empty


def _surgery_run(args: argparse.Namespace, passes: list) -> int:
    """`hibana surgery` after its options are checked: load with the passes, report, write."""
    from pathlib import Path

    from hibana_core import ConfigError, Engine, HibanaError, SurgeryGuardError
    from hibana_core.loader import family_of, read_model_type, resolve_checkpoint, weight_files
    from hibana_core.surgery import checkpoint

    try:  # a model that is not there is a usage error, said before a loading bar (as bench's `_check_model`)
        source = resolve_checkpoint(args.model, progress=True)  # a repo id is downloaded here, once
        family_of(read_model_type(source))  # a folder that is no checkpoint, or of an architecture none serves
        weight_files(source)  # no safetensors: said here, not after the config stage's bar
    except HibanaError as exc:
        print(f"hibana surgery: {exc}", file=sys.stderr)
        return 2
    try:
        engine = Engine.from_pretrained(args.model, surgery=passes, speculation="off", device=args.device,
                                        dtype=args.dtype, surgery_guard=not args.no_guard,
                                        surgery_guard_text=args.guard_text, num_blocks=16)
        with engine:
            for record in engine.surgery:
                saved = record.get("bytes_before", 0) - record.get("bytes_after", 0)
                what = f"{saved / 1e6:,.1f} MB less in memory ({str(engine.dtype).removeprefix('torch.')} weights)"
                if "kv_bytes_per_token_after" in record:  # kv8: the weights stay, the KV shrinks
                    what = (f"KV bytes per token {record['kv_bytes_per_token_before']:,} -> "
                            f"{record['kv_bytes_per_token_after']:,}")
                if "kv_bytes_per_agent" in record:  # window: the KV of a long history stops growing
                    before, after = record["kv_bytes_per_agent"]["32768"]
                    what = f"KV bytes of a 32k-token agent {before / 1e6:,.1f} MB -> {after / 1e6:,.1f} MB"
                layers = record.get("layers", "?")
                # window: how many of the model's full-attention layers it switched, and which
                # ("layers 2 of 1 full-attention" read as two of one)
                layers = (f"{len(layers)} of {record.get('full_layers_before', '?')} full-attention layers "
                          f"(layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))})"
                          if isinstance(layers, list) else f"{layers} layers")
                if record.get("experts"):
                    layers += f" and {record['experts']} MoE expert layers"
                if record.get("lm_head") == "int8":  # w8 / w4: an output head with its own weight
                    layers += " and the output head (int8)"
                asked = record.get("params", {}).get("group_size")
                if record.get("group_sizes_used") not in (None, [], [asked]):  # w4: where asked does not divide
                    layers += f" (groups of {', '.join(map(str, record['group_sizes_used']))})"
                if record.get("kept_dense"):  # w4: no even group size divides their inputs
                    layers += f" ({len(record['kept_dense'])} layers kept dense)"
                if record.get("experts_kept_float"):  # w4: no even group size divides their inputs
                    layers += f" ({len(record['experts_kept_float'])} MoE expert layers kept float)"
                print(f"{record['name']}: {layers}, {what}" + (f"; guard: {_guard_figures(record['guard'])}"
                                                               if "guard" in record else ""))
            print(f"model bytes now {engine.weight_bytes / 1e6:,.1f} MB")
            if args.out:
                out = checkpoint.save(engine, source, Path(args.out))
                sizes = [sum(f.stat().st_size for f in d.glob("*.safetensors")) for d in (out, source)]
                print(f"wrote {out}, {sizes[0] / 1e6:,.1f} MB of weights (the source's: {sizes[1] / 1e6:,.1f} MB; "
                      f"load it as any checkpoint: Engine.from_pretrained({str(out)!r}))")
    except SurgeryGuardError as exc:  # its advice is the Python form: say the command's too
        print(f"hibana surgery: {exc}\n(here: add --force to keep every pass over its floors)", file=sys.stderr)
        return 1
    except HibanaError as exc:
        print(f"hibana surgery: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1  # an option's value (a pass, its parameters): a usage error
    return 0


def _guard_figures(guard: dict) -> str:
    """'ok (ppl ratio 1.0052, mean KL 0.00424, top-1 96.9%)': the decision and what the pass cost,
    on stdout with the rest (the guard's full table goes to stderr with the progress bars); after
    other passes, its own cost (which the decision is on), then all the passes' so far."""
    def figures(f: dict) -> str:
        kl = "" if f["mean_kl"] is None else f", mean KL {f['mean_kl']:.5f}"
        return f"ppl ratio {f['ppl_ratio']:.4f}{kl}, top-1 {f['top1_agreement']:.1%}"

    own = guard.get("own_cost")
    if own is None:
        return f"{guard['decision']} ({figures(guard)})"
    return f"{guard['decision']} (its own: {figures(own)}; with {' + '.join(own['after'])}: {figures(guard)})"


# -- hibana plugins ------------------------------------------------------------------------------

PLUGIN_COLUMNS = ("plugin", "kind", "name", "package", "version", "builtin")


def run_plugins(args: argparse.Namespace) -> int:
    from hibana_plugins.manager import ENV_VAR, get_plugin_manager

    manager = get_plugin_manager()
    conflicts = list(manager.clashes)  # plugins of one name, names two plugins register: listed (exit status 1)
    infos = manager.describe(conflicts)  # (adds the names two plugins register)
    # a plugin that failed to load is listed and skipped, and the exit status is 1 too: a plugin
    # author's CI step `hibana plugins` must fail on a plugin that does not load
    status = 1 if conflicts or manager.load_errors else 0
    if args.json:
        print(
            json.dumps(
                {
                    "plugins": [asdict(info) for info in infos],
                    "load_errors": [
                        {"plugin": e.plugin, "stage": e.stage, "error": e.error}
                        for e in manager.load_errors
                    ],
                    "conflicts": conflicts,
                },
                indent=2,
            )
        )
        return status
    rows = [
        (
            info.plugin,
            info.kind or "-",
            info.name or "-",
            info.package or "-",
            info.version or "-",
            "yes" if info.builtin else "no",
        )
        for info in infos
    ]
    notes = []
    if manager.allow is not None:
        allowed = ", ".join(sorted(manager.allow)) or "none"
        notes.append(f"{ENV_VAR} is set: third-party plugins allowed: {allowed} (the table lists those loaded)")
    notes += [f"skipped {e.plugin} ({e.stage}): {e.error}" for e in manager.load_errors]
    notes += [f"conflict: {c} (the table lists the first)" for c in conflicts]
    _print_table(rows, notes)
    return status


def _print_table(rows: list[tuple[str, ...]], notes: list[str]) -> None:
    """A rich table on a terminal when rich is installed; aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None and sys.stdout.isatty():
        table = Table(*PLUGIN_COLUMNS)
        for row in rows:
            table.add_row(*row)
        console = Console()
        console.print(table)
        for note in notes:
            console.print(note, markup=False)
        return
    widths = [max(len(cell) for cell in column) for column in zip(PLUGIN_COLUMNS, *rows)]
    for row in (PLUGIN_COLUMNS, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for note in notes:
        print(note)


if __name__ == "__main__":
    sys.exit(main())
