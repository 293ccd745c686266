"""The commands as a user meets them: `hibana --version`, help on every option, no command in
`--help` that does not run, and options that cannot work refused as usage errors (status 2, one
line, no traceback) before anything loads."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from hibana_core import cli
from tiny_models import make_tiny_checkpoint

NO_CUDA = not torch.cuda.is_available()


def _parsers():
    from hibana_bench import cli as bench_cli, coldstart
    from hibana_core.demo import run as demo

    parsers = {"hibana": cli.build_parser(), "hibana demo": demo.build_parser(),
               "hibana bench": bench_cli.build_parser(), "coldstart": coldstart.build_parser()}
    try:  # the server's extra (fastapi, uvicorn) may not be installed
        from hibana_plugins import server
    except ImportError:
        return parsers
    return {**parsers, "hibana serve": server.build_parser()}


def _actions(parser: argparse.ArgumentParser):
    """(parser, action) for every argument of `parser` and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield parser, choice   # the subcommand's line in --help
            for sub in action.choices.values():
                yield from _actions(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser, action


def test_version(capsys):
    from hibana_core import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hibana {__version__} (Python ") and f"torch {torch.__version__}" in out


@pytest.mark.parametrize("name", ["hibana", "hibana demo", "hibana bench", "coldstart", "hibana serve"])
def test_every_option_has_help(name):
    if name not in _parsers():
        pytest.skip("the serve extra is not installed")
    parser = _parsers()[name]
    missing = [f"{p.prog}: {a.option_strings or a.dest}" for p, a in _actions(parser)
               if not a.help or a.help == argparse.SUPPRESS or len(a.help) < 10]
    assert not missing, missing


COMMANDS = ("plugins", "demo", "bench", "serve", "surgery")


def test_help_lists_exactly_the_commands_checked_here():
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(commands.choices) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_listed_command_runs(command, capsys):
    """Its --help (surgery, demo and bench also run for real in test_surgery.py and below)."""
    if command == "bench":  # through its entry point where installed, else its own module
        from hibana_bench.cli import main as run
        argv = ["--help"]
    elif command == "serve":
        run, argv = pytest.importorskip("hibana_plugins.server").main, ["--help"]
    else:
        run, argv = cli.main, [command, "--help"]
    with pytest.raises(SystemExit) as e:
        run(argv)
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_serve_refuses_an_unknown_tool_parser_before_it_loads(monkeypatch, capsys):
    """`--tool-parser nope` was refused once the model had loaded (50 s on two cores for the demo)."""
    server = pytest.importorskip("hibana_plugins.server")
    from hibana_core import Engine

    def load(*args, **kwargs):
        raise AssertionError("hibana serve loaded the model before checking --tool-parser")

    monkeypatch.setattr(Engine, "from_pretrained", load)
    assert server.main(["demo", "--port", "0", "--tool-parser", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hibana serve: ") and "nope" in err and "hermes" in err and "Traceback" not in err, err


def test_serve_refuses_an_address_in_use_before_it_loads(monkeypatch, capsys):
    """It said so in uvicorn's words, once the model had loaded (minutes, for a large one)."""
    import socket

    server = pytest.importorskip("hibana_plugins.server")
    from hibana_core import Engine

    def load(*args, **kwargs):
        raise AssertionError("hibana serve loaded the model before binding its address")

    monkeypatch.setattr(Engine, "from_pretrained", load)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert server.main(["demo", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"hibana serve: cannot listen on 127.0.0.1:{port}" in err and "--port" in err, err
    assert "Traceback" not in err


def test_surgery_writes_a_checkpoint_as_readable_as_its_folder_lets_it(tiny_checkpoints, tmp_path, capsys):
    """safetensors writes owner-only (0600) files: the weights were the one file another user
    could not read."""
    import os
    import stat

    out = tmp_path / "w8"
    old = os.umask(0o022)
    try:
        assert cli.main(["surgery", str(tiny_checkpoints["qwen3"]), "--passes", "w8", "--out", str(out),
                         "--no-guard", "--device", "cpu"]) == 0
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`hibana plugins --json | head -3` printed a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    try:
        done = subprocess.run([sys.executable, "-m", "hibana_core.cli", "plugins", "--json"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_ctrl_c_stops_a_command_in_one_line():
    """Ctrl+C while `hibana demo` ran (or a bench, or `hibana serve` loading) printed a
    KeyboardInterrupt traceback; a bench's agent threads added one each."""
    import signal
    import subprocess
    import sys

    script = ("import sys, time\n"
              "from hibana_core import cli\n"
              "from hibana_core.demo import run\n"
              "def main(argv, started=None):\n"
              "    print('running', flush=True)\n"
              "    time.sleep(120)\n"
              "run.main = main\n"
              "sys.exit(cli.main(['demo']))\n")
    # a child of a shell's background job inherits SIGINT ignored: give it Python's own handling
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "running\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "hibana: interrupted\n", (proc.returncode, err)


def test_surgery_of_a_model_that_is_not_there_is_a_usage_error(tmp_path, capsys):
    """Exit status 1 after a loading bar, where demo, bench and serve say 2 at once."""
    assert cli.main(["surgery", str(tmp_path / "nowhere"), "--passes", "w8", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "hibana surgery: " in captured.err and "loading" not in captured.err and "Traceback" not in captured.err


def test_surgery_reads_pass_names_with_spaces_and_refuses_empty_ones(tiny_checkpoints, capsys, tmp_path):
    """`--passes 'w8, kv8'` was refused as no pass named ' kv8', and `w8,,kv8` taken silently
    (an outside tester)."""
    for empty in ("w8,,kv8", ",", " "):
        assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", empty, "--device", "cpu"]) == 2
        assert ("names an empty pass" if empty == "w8,,kv8" or empty == "," else "names no pass") in capsys.readouterr().err
    assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w8, kv8", "--device", "cpu",
                     "--no-guard"]) == 0
    out = capsys.readouterr().out
    assert "w8:" in out and "kv8:" in out, out


def test_surgery_prints_what_each_pass_cost_on_stdout(tiny_checkpoints, capsys, tmp_path):
    """The guard's figures with its decision, not the decision alone (the table went to stderr
    only); the window pass's layers as indices, not a Python list followed by "layers"."""
    assert cli.main(["surgery", str(tiny_checkpoints["qwen3"]), "--passes", "w8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"w8: 8 layers, .*; guard: ok \(ppl ratio \d\.\d{4}, mean KL \d\.\d{5}, top-1 \d+\.\d%\)",
                     out), out
    assert cli.main(["surgery", str(tiny_checkpoints["qwen3"]), "--passes", '[{"name": "window", "window": 256, "layers": [1]}]',
                     "--device", "cpu", "--no-guard"]) == 0
    out = capsys.readouterr().out
    assert "window: 1 of 2 full-attention layers (layer 1), KV bytes of a 32k-token agent" in out, out
    assert "[1]" not in out, out
    # the layers w4 leaves dense (no even group size divides their 77 inputs) are said, not only counted out
    odd = make_tiny_checkpoint("llama", tmp_path / "odd", intermediate_size=77)
    assert cli.main(["surgery", str(odd), "--passes", '[{"name": "w4", "group_size": 64}]', "--device", "cpu",
                     "--no-guard"]) == 0
    out = capsys.readouterr().out
    assert "w4: 9 layers and the output head (int8) (3 layers kept dense), " in out, out


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def no_load(monkeypatch):
    """A usage error must come before any model loads."""
    from hibana_bench import cli as bench_cli

    def load(*args, **kwargs):
        raise AssertionError("the bench loaded a model before refusing its options")

    monkeypatch.setattr(bench_cli, "load_bench_model", load)
    monkeypatch.setattr(bench_cli, "cold_start", load)


BENCH_USAGE_ERRORS = [
    (["agents", "--systems", "foo"], "unknown system(s) for agents: foo"),
    (["agents", "--systems", "hf_eager"], "unknown system(s) for agents: hf_eager"),
    (["decode", "--systems", "hibana,hf_reprefill"], "unknown system(s) for decode: hf_reprefill"),
    (["decode", "--surgery", "w9"], "--surgery: no pass named w9"),
    (["agents", "--model", "/no/such/checkpoint"], "--model: checkpoint directory '/no/such/checkpoint' does not"),
    (["agents", "--model", "acme/absent"], "hf download acme/absent"),
    (["decode", "--device", "tpu"], "--device: device must be auto, cpu, cuda or cuda:N"),
    pytest.param(["decode", "--device", "cuda"], "--device: device='cuda' asks for a CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")),
    (["decode", "--context", "512,abc"], "argument --context: 'abc' is not an integer"),
    (["agents", "--agents", "0"], "argument --agents: must be at least 1"),
    (["agents", "--generate", "-3"], "argument --generate: must be at least 1"),
    (["agents", "--model", "gpt-oss-20b", "--systems", "hibana,hf_reprefill"],
     "--systems: hf_reprefill cannot run gpt-oss-20b: the preset's experts are MXFP4"),
    # the demo model's context is 2,048 tokens: 8192 given does not fit (the defaults shrink to fit it)
    (["decode", "--model", "demo", "--context", "512,8192"],
     "--context: 8192 tokens plus --generate 128 exceed demo's context of 2048"),
    (["decode", "--model", "qwen3-0.6b", "--context", "40960"], "exceed qwen3-0.6b's context of 40960"),
    (["agents", "--model", "demo", "--turns", "20"], "an agent's history reaches 2432 tokens"),
    (["serve", "--model", "/no/such/checkpoint"], "--model: checkpoint directory '/no/such/checkpoint' does not"),
    (["serve", "--clients", "0"], "argument --clients: must be at least 1"),
    # these were tracebacks after the model loaded (grammar, serve) or came after the cold start (--trace)
    (["grammar", "--batch", "x"], "argument --batch: 'x' is not an integer"),
    (["grammar", "--batch", "1,0"], "argument --batch: must be at least 1, got 0"),
    (["grammar", "--generate", "0"], "argument --generate: must be at least 1"),
    (["grammar", "--prompt", "-1"], "argument --prompt: must be at least 1"),
    (["grammar", "--repeats", "0"], "argument --repeats: must be at least 1"),
    (["grammar", "--switch-interval", "-1"], "argument --switch-interval: must be more than 0 seconds"),
    (["grammar", "--tokenizer", "/no/such/tokenizer"], "--tokenizer: '/no/such/tokenizer' is not a directory"),
    (["serve", "--switch-interval", "0"], "argument --switch-interval: must be more than 0 seconds"),
    (["decode", "--trace", "nosuch"], "--trace: no trace file 'nosuch'"),
    (["decode", "--systems", ","], "--systems ',' names no system"),  # ran nothing: an empty table, status 0
    # a traceback (ZeroDivisionError) after both runs, every HTTP request refused; a 400 after the load
    (["serve", "--max-tokens", "5000"], "--max-tokens 5000 is more than demo's context of 2048 tokens"),
    (["grammar", "--prompt", "3000"], "--prompt 3000 plus --generate 128 tokens exceed demo's context of 2048"),
    (["agents", "--systems", " , ,"], "--systems ' , ,' names no system"),
    (["agents", "--trace", "nosuch"], "--trace: no trace file 'nosuch'"),
]


@pytest.mark.parametrize("argv, says", BENCH_USAGE_ERRORS)
def test_bench_refuses_options_that_cannot_work(argv, says, offline_hub, no_load, capsys):
    from hibana_bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("workload", ["decode", "agents", "grammar", "serve"])
def test_bench_refuses_a_preset_whose_weights_the_device_cannot_hold(workload, no_load, monkeypatch, capsys):
    """`hibana bench decode --model qwen3-8b` on a CPU of 24 GB made 33 GB of float32 weights until
    the kernel killed it (under a memory limit: a RuntimeError traceback from torch's allocator)."""
    from hibana_bench import cli as bench_cli, models
    from hibana_core.kv import budget

    monkeypatch.setattr(models, "load_bench_model", bench_cli.load_bench_model)  # grammar's: no_load's too
    monkeypatch.setattr(budget, "device_memory", lambda device: budget.DeviceMemory(24 << 30, 20 << 30, True))
    with pytest.raises(SystemExit) as e:
        bench_cli.main([workload, "--model", "qwen3-8b", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert "--model: qwen3-8b's weights take 32.8 GB in float32, more than the 21.5 GB free on cpu" in err, err
    assert "--dtype bfloat16" in err, err
    with pytest.raises(AssertionError, match="loaded a model"):  # half the bytes fit: it goes on to load
        bench_cli.main([workload, "--model", "qwen3-8b", "--device", "cpu", "--dtype", "bfloat16", "--no-cold-start"]
                       if workload in ("decode", "agents") else
                       [workload, "--model", "qwen3-8b", "--device", "cpu", "--dtype", "bfloat16"])


def test_bench_reads_systems_and_passes_with_spaces_after_the_commas():
    """`--systems "hibana, hf_eager"` was refused as an unknown system ' hf_eager' (as `hibana
    surgery --passes "w8, kv8"` once was)."""
    from hibana_bench.cli import build_parser, check_options

    parser = build_parser()
    args = parser.parse_args(["decode", "--model", "demo", "--systems", "hibana, hf_eager", "--surgery", "w8, kv8"])
    assert check_options(parser, args)[1] == ["hibana", "hf_eager", "hibana+w8", "hibana+kv8"]


def test_bench_decode_defaults_fit_the_models_context(tmp_path):
    """decode's default contexts (512,8192) shrink to what the model takes (the demo: 2,048 tokens,
    128 generated): `hibana bench decode` runs as it is; --json into a folder is refused first."""
    from hibana_bench.cli import build_parser, check_options

    parser = build_parser()
    args = parser.parse_args(["decode", "--model", "demo"])
    check_options(parser, args)
    assert args.context == [512, 2048 - 128]
    args = parser.parse_args(["decode", "--model", "qwen3-8b", "--device", "cpu"])
    check_options(parser, args)
    assert args.context == [512, 8192]
    with pytest.raises(SystemExit):
        check_options(parser, parser.parse_args(["decode", "--model", "demo", "--json", str(tmp_path)]))


def test_demo_reports_a_model_it_cannot_load(offline_hub, capsys):
    from hibana_core.demo.run import main

    assert main(["--model", "acme/absent", "--no-live"]) == 2  # the option's value: a usage error, as elsewhere
    out, err = capsys.readouterr()
    assert "hibana demo:" in err and "hf download acme/absent" in err and not out, (out, err)


def test_demo_refuses_a_model_whose_template_renders_no_tools_before_any_agent_runs(tmp_path, capsys):
    """It printed the tables with the ConversationError in a cell and a first token at 0.00 s."""
    import tiny_models

    from hibana_core.demo.run import main

    path = tiny_models.make_tiny_checkpoint("qwen3", tmp_path)
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer.save_pretrained(path)
    assert main(["--model", str(path), "--no-live", "--agents", "1", "--tasks", "1"]) == 1
    out, err = capsys.readouterr()
    assert "renders none" in err and not out, (out, err)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_demo_refuses_turns_of_no_tokens(value, capsys):
    """Before anything loads; --max-tokens 0 ran every agent's tasks generating nothing."""
    from hibana_core.demo.run import main

    with pytest.raises(SystemExit) as e:
        main(["--max-tokens", value, "--no-live"])
    assert e.value.code == 2
    assert f"--max-tokens must be at least 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["suffix:x", "suffix:", "suffix:-1", "ngram:4:5"])
def test_demo_refuses_a_speculation_length_that_is_no_count(value, capsys):
    """Before anything loads; it was adaptive speculation without a word."""
    from hibana_core.demo.run import main

    with pytest.raises(SystemExit) as e:
        main(["--speculation", value, "--no-live"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculation" in err and "K must be a number of tokens" in err, err


@pytest.mark.parametrize("argv, says", [(["--speculation", "draft_model:2"], "needs --draft-model PATH"),
                                         (["--draft-model", "somewhere"], "goes with --speculation draft_model")])
def test_demo_draft_model_speculation_takes_its_checkpoint_from_draft_model(argv, says, capsys):
    """A usage error that names the demo's own option (it told the user to call
    Engine.from_pretrained, which the command cannot)."""
    from hibana_core.demo.run import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-live"])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_demo_refuses_a_drafter_nobody_registered_in_its_own_words(capsys):
    """A usage error before anything loads, naming the drafters (it was the engine's ConfigError,
    in the Python form, with status 1)."""
    from hibana_core.demo.run import main

    with pytest.raises(SystemExit) as e:
        main(["--speculation", "bogus:4", "--no-live"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no drafter 'bogus' is registered" in err and "suffix" in err and "speculation={" not in err, err


def test_demo_reports_its_cold_start(capsys):
    from hibana_core.demo.run import main

    assert main(["--agents", "1", "--tasks", "1", "--no-live", "--device", "cpu", "--speculation", "off"]) == 0
    out = capsys.readouterr().out
    assert "cold start" in out and "to the first token" in out
    for stage in ("resolve", "config", "weights", "tokenizer", "kv cache", "warm-up", "first token"):
        assert stage in out, out


def test_bench_times_a_checkpoint_without_a_tokenizer(tiny_checkpoints, tmp_path, capsys):
    """A model alone (no tokenizer files) is timed on token ids, as a preset is."""
    import shutil

    from hibana_bench.cli import main

    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_checkpoints["qwen3"] / name, bare / name)
    out = tmp_path / "report.json"
    assert main(["decode", "--model", str(bare), "--device", "cpu", "--systems", "hibana", "--context", "16",
                 "--generate", "4", "--no-cold-start", "--json", str(out)]) == 0
    assert [row["system"] for row in json.loads(out.read_text())["rows"]] == ["hibana"]


def test_bench_refuses_a_checkpoint_of_an_unsupported_model_type_in_one_line(tiny_checkpoints, tmp_path, capsys):
    """A model_type no family serves was transformers' traceback from bench (it read the config
    with AutoConfig before anything else): now the usage error, exit 2, listing the supported ones,
    as Engine.from_pretrained says it."""
    import shutil

    from hibana_bench.cli import main

    unknown = tmp_path / "qwen4"
    shutil.copytree(tiny_checkpoints["qwen3"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps(dict(config, model_type="qwen4")))
    with pytest.raises(SystemExit) as exit_:
        main(["decode", "--model", str(unknown), "--device", "cpu", "--systems", "hibana", "--context", "16",
              "--generate", "4", "--no-cold-start"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'qwen4' is not supported" in err and "qwen3" in err and "Traceback" not in err


def test_bench_refuses_a_checkpoint_without_safetensors_before_anything_loads(tiny_checkpoints, tmp_path, capsys):
    """A pytorch_model.bin alone passed bench's check and failed in the cold-start subprocess, which
    printed its traceback: now the loader's CheckpointError as the usage error, exit 2."""
    import shutil

    from hibana_bench.cli import main

    binary = tmp_path / "bin_only"
    shutil.copytree(tiny_checkpoints["qwen3"], binary)
    for weights in binary.glob("*.safetensors*"):
        weights.unlink()
    (binary / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        main(["decode", "--model", str(binary), "--device", "cpu", "--systems", "hibana", "--context", "16",
              "--generate", "4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no *.safetensors weights" in err and "Traceback" not in err


def test_bench_decode_runs_each_system_with_and_without_pdl(tiny_checkpoints, tmp_path, capsys):
    """`--pdl on,off`: each Hibana system twice, the second row named SYSTEM/pdl-off (on the CPU
    both launch plainly; the rows still come); a value other than on and off is refused."""
    from hibana_bench.cli import main

    out = tmp_path / "report.json"
    assert main(["decode", "--model", str(tiny_checkpoints["qwen3"]), "--device", "cpu", "--systems", "hibana",
                 "--context", "16", "--generate", "4", "--no-cold-start", "--pdl", "on,off",
                 "--json", str(out)]) == 0
    assert [row["system"] for row in json.loads(out.read_text())["rows"]] == ["hibana", "hibana/pdl-off"]
    with pytest.raises(SystemExit):
        main(["decode", "--model", str(tiny_checkpoints["qwen3"]), "--device", "cpu", "--pdl", "maybe"])
    assert "--pdl takes on, off or on,off" in capsys.readouterr().err


def test_bench_measures_cold_start_in_fresh_processes(tiny_checkpoints, tmp_path, capsys):
    from hibana_bench.cli import main

    out = tmp_path / "report.json"
    assert main(["decode", "--model", str(tiny_checkpoints["qwen3"]), "--device", "cpu", "--systems", "hibana",
                 "--context", "16", "--generate", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cold start" in printed and "transformers" in printed
    cold = json.loads(out.read_text())["cold_start"]
    assert set(cold) == {"hibana", "transformers"}
    for figures in cold.values():
        assert figures["total_s"] >= figures["load_s"] > 0 and figures["startup_s"] > 0
        assert figures["first_token_s"] > 0
    assert list(cold["hibana"]["stages"]) == ["resolve", "config", "weights", "tokenizer", "kv cache", "warm-up"]

    assert main(["decode", "--model", str(tiny_checkpoints["qwen3"]), "--device", "cpu", "--systems", "hibana",
                 "--context", "16", "--generate", "4", "--no-cold-start", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cold_start"] is None


def test_bench_runs_a_surgery_checkpoint_as_written_and_refuses_transformers_on_it(tiny_checkpoints, tmp_path,
                                                                                    capsys):
    """`hibana bench decode` on a checkpoint `hibana surgery` wrote built its engines from
    transformers' model of it, whose packed layers transformers had left randomly initialised, and
    timed transformers on them too (an outside tester): the engines load the checkpoint as it is
    (its w8 layers: fewer bytes than the source's), and the transformers systems are refused."""
    from hibana_bench.cli import main

    written = tmp_path / "w8"
    assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w8", "--no-guard", "--device", "cpu",
                     "--out", str(written)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["decode", "--model", str(written), "--device", "cpu", "--systems", "hibana,hf_eager", "--context", "16",
              "--generate", "4", "--no-cold-start"])
    assert exit_.value.code == 2 and "hf_eager cannot run" in capsys.readouterr().err
    reports = {}
    for name, model in (("source", tiny_checkpoints["llama"]), ("w8", written)):
        out = tmp_path / f"{name}.json"
        assert main(["decode", "--model", str(model), "--device", "cpu", "--systems", "hibana", "--context", "16",
                     "--generate", "4", "--json", str(out)]) == 0
        reports[name] = json.loads(out.read_text())
    assert set(reports["w8"]["cold_start"]) == {"hibana"}  # transformers does not read it
    held = {name: r["rows"][0]["weight_bytes"] for name, r in reports.items()}
    assert held["w8"] < 0.6 * held["source"], held


def test_bench_json_is_json_that_strict_readers_take(tiny_checkpoints, tmp_path):
    """The agents report's transformers rows (no time to first token: NaN) were written as `NaN`,
    which JavaScript's JSON.parse, Go's and serde's readers refuse: null instead."""
    from hibana_bench.cli import main

    out = tmp_path / "agents.json"
    assert main(["agents", "--model", str(tiny_checkpoints["qwen3"]), "--device", "cpu", "--systems", "hf_reprefill",
                 "--agents", "1", "--turns", "1", "--system", "16", "--tool-result", "4", "--generate", "2",
                 "--no-cold-start", "--json", str(out)]) == 0

    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report["results"]["hf_reprefill"]["ttft_p50_s"] is None


def test_bench_serve_reports_a_run_whose_every_client_failed(monkeypatch, capsys):
    """Every request over HTTP refused (a 400) ended the report in a ZeroDivisionError traceback
    (the server's turns/h were 0), not with the errors it had."""
    from hibana_bench import serve_load
    from hibana_core import Engine

    def refused(engine, model, cfg):
        return serve_load.Run(0.5, [None] * cfg.clients, [f"client {i}: BadRequestError: 400" for i in range(cfg.clients)])

    monkeypatch.setattr(serve_load, "run_over_http", refused)
    report = serve_load.serve_load(lambda: Engine.from_pretrained("demo", device="cpu", progress=False), "demo",
                                   serve_load.ServeLoadConfig(clients=1, turns=1, max_tokens=4))
    assert report["server_overhead"] is None and report["errors"] == ["client 0: BadRequestError: 400"]
    serve_load.print_serve_load(report)
    out = capsys.readouterr().out
    assert "server overhead per turn: -" in out and "error: client 0: BadRequestError: 400" in out, out
    assert "nan" not in out, out


def test_bench_serve_switch_interval_holds_while_its_engines_run(tiny_checkpoints, monkeypatch, capsys):
    """--switch-interval 0.005 was set before the engine started, which lowers it to its own
    0.5 ms: the run measured the engine's interval whatever the option said."""
    import sys

    from hibana_bench import cli as bench_cli
    from hibana_bench import serve_load

    seen = []

    def fake_serve_load(open_engine, model, cfg, exact):
        with open_engine():
            seen.append(sys.getswitchinterval())
        return {"errors": [], "mismatched_clients": [], "exact": exact, "leaked_blocks": {}}

    monkeypatch.setattr(serve_load, "serve_load", fake_serve_load)
    monkeypatch.setattr(serve_load, "print_serve_load", lambda report: None)
    before = sys.getswitchinterval()
    try:
        assert bench_cli.main(["serve", "--model", str(tiny_checkpoints["qwen3"]), "--device", "cpu",
                               "--switch-interval", "0.005"]) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [0.005]


def test_serve_refuses_a_bad_engine_option_before_it_serves(capsys, monkeypatch):
    server = pytest.importorskip("hibana_plugins.server")
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("served despite a bad option"))
    assert server.main(["demo", "--option", "no_such_option=1"]) == 2
    assert "unknown engine option 'no_such_option'" in capsys.readouterr().err


def test_serve_without_its_extra_says_which_to_install(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the `serve` extra were not installed
    monkeypatch.delitem(sys.modules, "hibana_plugins.server", raising=False)
    assert cli.main(["serve", "demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hibana serve: it needs fastapi" in err and '".[serve]"' in err, err


@pytest.mark.parametrize("port, says", [("99999", "a port is 0 to 65535, got 99999"), ("http", "'http' is not a port")])
def test_serve_refuses_a_port_that_is_no_port(port, says, capsys):
    server = pytest.importorskip("hibana_plugins.server")
    with pytest.raises(SystemExit) as e:
        server.main(["demo", "--port", port])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_bench_decode_says_when_accepted_drafts_count(capsys):
    """A speculating row whose drafts were accepted (tok/step above 1) makes decode tok/s more than
    a decode speed: the table says so, and says nothing when every row took one token a step."""
    from hibana_bench.cli import print_decode

    row = dict(system="hibana", context=512, decode_tok_s=800.0, prefill_tok_s=1e4, weight_bytes=1e9,
               kv_read_bytes=1e6, tokens_per_step=2.78, guard=None)
    report = dict(model="tiny", random_weights=True, weight_bytes=1e9, roofline_tok_s=600.0,
                  copy_bandwidth_bytes_s=6e11, rows=[row, dict(row, system="hibana_spec_off", decode_tok_s=300.0,
                                                                tokens_per_step=1.0)])
    print_decode(report)
    assert "accepted drafts count" in capsys.readouterr().out
    print_decode(dict(report, rows=report["rows"][1:]))
    assert "accepted drafts" not in capsys.readouterr().out


def test_bench_decode_shows_the_roofline_with_the_kv_a_token_reads(capsys):
    """At long contexts a token reads its KV beside the weights: the table's "% +KV" column is the
    decode speed against both (300 tok/s x (1 GB + 0.5 GB) at 0.6 TB/s: 75%), "% roofline" against the
    weights alone (50%)."""
    from hibana_bench.cli import print_decode

    row = dict(system="hibana_spec_off", context=8192, decode_tok_s=300.0, prefill_tok_s=1e4, weight_bytes=1e9,
               read_bytes=1e9, kv_read_bytes=5e8, tokens_per_step=1.0, guard=None)
    print_decode(dict(model="tiny", random_weights=True, weight_bytes=1e9, roofline_tok_s=600.0,
                      copy_bandwidth_bytes_s=6e11, rows=[row]))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("hibana_spec_off"))
    assert line.split()[3:5] == ["50%", "75%"], line
