"""Repo ids against a local Hugging Face cache in huggingface_hub's layout, as a new user's cache
holds them after an interrupted clean-up or a download by commit: a weights link whose blob is
gone, a repo cached at other revisions than the one asked for. The Hub is never asked."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hibana_core import CheckpointError
from hibana_core.loader import resolve_checkpoint
from fake_hub import commit_hash, put_snapshot


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A checkpoint's files as resolving a repo id checks them (present or not; never loaded here)."""
    path = tmp_path_factory.mktemp("hub_audit")
    for name, text in (("config.json", '{"model_type": "qwen3"}'), ("model.safetensors", "weights"),
                       ("tokenizer.json", "{}"), ("tokenizer_config.json", "{}")):
        (path / name).write_text(text)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


def test_a_weights_link_whose_blob_is_gone_is_an_incomplete_snapshot(source, cache, monkeypatch):
    """The snapshot was taken as complete (a link is listed by a glob): offline, the loader then said
    the weights file was 'truncated or damaged'; online, Hibana never fetched it again."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    snapshot = put_snapshot(cache, "acme/tiny", source, commit_hash("one"))
    os.remove(os.path.realpath(snapshot / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"is incomplete: it lacks model\.safetensors \(a link to a file that "
                                              r"is gone\).*hf download acme/tiny"):
        resolve_checkpoint("acme/tiny")

    asked = []

    def snapshot_download(repo_id, *, local_files_only=False, **options):
        if local_files_only:
            return str(snapshot)
        asked.append(options.get("allow_patterns"))
        raise LocalEntryNotFoundError("the Hub cannot be reached")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(CheckpointError, match="the Hub cannot be reached"):
        resolve_checkpoint("acme/tiny")
    assert asked, "the damaged snapshot was used without asking the Hub for its weights"


def test_a_repo_cached_at_other_revisions_names_them(source, cache):
    """'not in the cache' was all a user heard for a revision (or the default branch, after a
    download by commit) while the cache held the repo at another one."""
    put_snapshot(cache, "acme/tiny", source, commit_hash("one"), refs=("main",))
    put_snapshot(cache, "acme/tiny", source, commit_hash("two"), refs=("v2",))
    assert resolve_checkpoint("acme/tiny@v2").name == commit_hash("two")
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("acme/tiny@v9")
    message = str(e.value)
    for part in (f"holds acme/tiny at main ({commit_hash('one')}), v2 ({commit_hash('two')}) but not at revision 'v9'",
                 "HF_HUB_OFFLINE", "hf download acme/tiny --revision v9"):
        assert part in message, message

    put_snapshot(cache, "acme/by-commit", source, commit_hash("three"), refs=())  # `hf download --revision <sha>`
    with pytest.raises(CheckpointError, match=f"holds acme/by-commit at {commit_hash('three')} but not at its default "
                                              r"branch \(main\)"):
        resolve_checkpoint("acme/by-commit")
    assert resolve_checkpoint(f"acme/by-commit@{commit_hash('three')}").name == commit_hash("three")

    shutil.rmtree(cache / "models--acme--by-commit" / "snapshots")  # nothing held: the plain message
    with pytest.raises(CheckpointError, match=r"as a Hugging Face repo id it is not in the cache"):
        resolve_checkpoint("acme/by-commit")


def test_the_cache_folder_of_a_repo_passed_as_a_path_says_to_pass_the_repo_id(source, cache, tmp_path):
    """~/.cache/huggingface/hub/models--org--name (or its snapshots/) as the model: it is a directory,
    so it was taken as a checkpoint, and the loader said it 'has no config.json'."""
    snapshot = put_snapshot(cache, "acme/tiny", source, commit_hash("one"))
    folder = cache / "models--acme--tiny"
    for path in (folder, folder / "snapshots"):
        with pytest.raises(CheckpointError) as e:
            resolve_checkpoint(str(path))
        assert str(e.value) == (f"{str(path)!r} is the Hugging Face cache's folder of acme/tiny, which holds its "
                                "snapshots, not a checkpoint directory; pass the repo id 'acme/tiny' (found in the "
                                f"cache), or a snapshot's directory: {snapshot}")
    assert resolve_checkpoint(str(snapshot)) == snapshot and resolve_checkpoint("acme/tiny") == snapshot
    elsewhere = tmp_path / "other" / "models--acme--tiny"
    shutil.copytree(folder, elsewhere, symlinks=True)
    put_snapshot(tmp_path / "other", "acme/tiny", source, commit_hash("two"))
    with pytest.raises(CheckpointError, match=rf"found there with HF_HUB_CACHE={tmp_path / 'other'}\), or a "
                                              rf"snapshot's directory: {elsewhere / 'snapshots'}/<commit>"):
        resolve_checkpoint(str(elsewhere))
