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
