"""The `hibana` command as a new user meets it (an outside tester of limits and the CLI)."""

from __future__ import annotations

import json

import pytest

from hibana_core import cli


@pytest.mark.parametrize("kind", ["no config.json", "unsupported model_type", "no weights"])
def test_surgery_of_a_folder_that_is_no_checkpoint_is_a_usage_error_before_any_bar(kind, tmp_path, capsys):
    """A folder without config.json, of a model_type no family serves, or without safetensors
    was said after the loading bar's resolve and config stages, with exit status 1, where
    `hibana demo --model` and `hibana bench --model` say it at once with 2."""
    folder = tmp_path / "model"
    folder.mkdir()
    if kind != "no config.json":
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen4" if kind.startswith("unsupported")
                                                        else "llama"}))
    assert cli.main(["surgery", str(folder), "--passes", "w8", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hibana surgery: ") and "loading" not in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("content, says", [(b"\xff\xfe\x00binary", "cannot be read as UTF-8"),
                                           (b" \n\t\n", "is empty")])
def test_surgery_refuses_a_guard_text_it_cannot_read_before_the_weights_load(content, says, tiny_checkpoints,
                                                                           tmp_path, monkeypatch, capsys):
    """A binary or empty --guard-text was refused only after the weights had loaded (minutes on a
    real model): only a path that is not there was said before."""
    import hibana_core.engine

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the guard text was read")

    monkeypatch.setattr(hibana_core.engine, "load_model", no_load)
    text = tmp_path / "guard.txt"
    text.write_bytes(content)
    assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w8", "--device", "cpu",
                     "--guard-text", str(text)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_demo_refuses_a_max_tokens_past_64_bits_before_it_loads(capsys):
    """`hibana demo --max-tokens 100000000000000000000` loaded the model, then ended with
    "hibana: SamplingParams.max_tokens must be a 64-bit integer" and exit status 1 (not the demo's
    usage error, and with no command name)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--max-tokens", str(10**20), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "hibana demo: error: --max-tokens must be a 64-bit integer" in err, err


def test_surgery_that_cannot_write_its_checkpoint_says_so_in_one_line(tiny_checkpoints, tmp_path, monkeypatch,
                                                                       capsys):
    """A full disk while `--out` was written ended in an OSError traceback (the folder was emptied)."""
    import errno

    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "new" / "w8"
    assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w8", "--no-guard", "--device", "cpu",
                     "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"hibana surgery: cannot write the checkpoint to {out} (No space left on device)" in err, err
    assert "Traceback" not in err and not (tmp_path / "new").exists()
