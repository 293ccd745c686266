"""Models by name: Hugging Face repo ids resolve through a hub cache built here in huggingface_hub's
layout (models--org--name/{blobs,refs,snapshots}); the Hub itself is never asked. Downloads are
checked against a stand-in for `huggingface_hub.snapshot_download` that copies from a directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hibana_core import CheckpointError, hub
from hibana_core.loader import resolve_checkpoint
from fake_hub import commit_hash, put_snapshot
from tiny_models import make_tiny_checkpoint, open_engine

ARCH = "qwen3"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Two versions of one tiny model (different weights) and a sharded one."""
    root = tmp_path_factory.mktemp("hub_sources")
    return {"v1": make_tiny_checkpoint(ARCH, root / "v1", seed=1),
            "v2": make_tiny_checkpoint(ARCH, root / "v2", seed=2),
            "sharded": make_tiny_checkpoint(ARCH, root / "sharded", seed=3, shard_size="100KB")}


@pytest.fixture
def hub_env(tmp_path, monkeypatch) -> Path:
    """An empty hub cache under HF_HOME, offline; returns the cache (HF_HOME/hub)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    return cache


def generate(engine, prompt=(5, 6, 7, 8, 9)) -> list[int]:
    from hibana_core import SamplingParams

    h = engine.open_state("probe")
    return list(h.generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=list(prompt)).token_ids)


# --- names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, ref", [
    ("Qwen/Qwen3-8B", hub.RepoRef("Qwen/Qwen3-8B")),
    ("Qwen/Qwen3-8B@main", hub.RepoRef("Qwen/Qwen3-8B", "main")),
    ("org/model@" + "a" * 40, hub.RepoRef("org/model", "a" * 40)),
    ("gpt2", hub.RepoRef("gpt2")),
    ("./models/x", None), ("/abs/path", None), ("~/models/x", None), ("a/b/c", None),
    ("org/model@", None), ("bad--name/x", None),
])
def test_parse_repo_id(model, ref):
    assert hub.parse_repo_id(model) == ref


def test_environment_is_read_when_resolving(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.cache_dir() == tmp_path / "cache"
    assert not hub.offline()
    for value, expected in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub.offline() is expected
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert hub.offline()


def test_an_empty_model_name_is_refused_not_the_working_directory(tmp_path, checkpoints, monkeypatch):
    """Path("") is the working directory: an empty model name (an unset environment variable) loaded
    whatever checkpoint was there, or blamed "."."""
    shutil.copytree(checkpoints["v1"], tmp_path / "here")
    monkeypatch.chdir(tmp_path / "here")
    for name in ("", " "):
        with pytest.raises(CheckpointError, match="model name is empty"):
            resolve_checkpoint(name)
    assert resolve_checkpoint(".") == Path(".")


# --- the cache ------------------------------------------------------------------------------------

def test_a_cached_repo_loads_offline_as_its_directory_does(checkpoints, hub_env):
    snapshot = put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], commit_hash("one"))
    assert resolve_checkpoint("acme/tiny") == snapshot
    with open_engine("acme/tiny", speculation="off") as by_name, \
            open_engine(checkpoints["v1"], speculation="off") as by_path:
        assert by_name.fingerprint == by_path.fingerprint
        assert generate(by_name) == generate(by_path)


def test_hf_hub_cache_wins_over_hf_home(checkpoints, hub_env, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    snapshot = put_snapshot(other, "acme/tiny", checkpoints["v2"], commit_hash("two"))
    put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], commit_hash("one"))
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_checkpoint("acme/tiny") == snapshot


def test_revisions_resolve_through_refs_and_commits(checkpoints, hub_env):
    one, two = commit_hash("one"), commit_hash("two")
    put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], one, refs=("main",))
    put_snapshot(hub_env, "acme/tiny", checkpoints["v2"], two, refs=("v2.0", "refs/pr/1"))
    repo = hub_env / "models--acme--tiny" / "snapshots"
    assert resolve_checkpoint("acme/tiny") == repo / one
    assert resolve_checkpoint("acme/tiny@main") == repo / one
    assert resolve_checkpoint("acme/tiny@v2.0") == repo / two
    assert resolve_checkpoint(f"acme/tiny@{one}") == repo / one
    with open_engine("acme/tiny@v2.0", speculation="off") as tagged, \
            open_engine(checkpoints["v2"], speculation="off") as direct:
        assert generate(tagged) == generate(direct)
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("acme/tiny@no-such-branch")
    assert "hf download acme/tiny --revision no-such-branch" in str(e.value)


def test_a_repo_missing_offline_says_what_to_do(hub_env):
    with pytest.raises(CheckpointError) as e:
        open_engine("acme/not-downloaded")
    message = str(e.value)
    for part in ("acme/not-downloaded", str(hub_env), "HF_HUB_OFFLINE", "hf download acme/not-downloaded",
                 "HF_HUB_OFFLINE=0", "local checkpoint directory"):
        assert part in message, message


@pytest.mark.parametrize("kept, lacks", [
    (("config.json",), "*.safetensors weights"),                      # what AutoConfig leaves behind
    (("model.safetensors", "tokenizer.json"), "config.json"),
    (("config.json", "model.safetensors"), "tokenizer files"),        # it loaded, and chat found no tokenizer
])
def test_a_partly_cached_repo_offline_says_what_it_lacks(checkpoints, hub_env, kept, lacks):
    snapshot = put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], commit_hash("one"), only=kept)
    with pytest.raises(CheckpointError) as e:
        open_engine("acme/tiny")
    message = str(e.value)
    assert "incomplete" in message and lacks in message and str(snapshot) in message, message
    assert "hf download acme/tiny" in message


def test_a_cached_repo_of_bin_weights_says_to_convert_not_to_download_again(checkpoints, hub_env, tmp_path):
    """A snapshot that holds PyTorch .bin weights alone was "incomplete: run hf download", which
    fetches the same .bin files again."""
    source = tmp_path / "bin"
    source.mkdir()
    for file in checkpoints["v1"].iterdir():
        if not file.name.endswith(".safetensors"):
            (source / file.name).write_bytes(file.read_bytes())
    (source / "pytorch_model.bin").write_bytes(b"not read")
    put_snapshot(hub_env, "acme/bin", source, commit_hash("bin"))
    with pytest.raises(CheckpointError, match=r"PyTorch \.bin weights.*save_pretrained") as e:
        resolve_checkpoint("acme/bin")
    assert "hf download" not in str(e.value)


def test_a_cached_repo_missing_a_shard_is_incomplete(checkpoints, hub_env):
    source = checkpoints["sharded"]
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    kept = tuple(p.name for p in source.iterdir() if p.name != shards[1])
    put_snapshot(hub_env, "acme/sharded", source, commit_hash("s"), only=kept)
    with pytest.raises(CheckpointError, match=shards[1]):
        resolve_checkpoint("acme/sharded")


def test_a_snapshot_huggingface_hub_finds_incomplete_is_incomplete(checkpoints, hub_env, monkeypatch):
    """Newer huggingface_hub checks a cached snapshot against the file list it cached with it
    (IncompleteSnapshotError, carrying the snapshot's path): config and weights may all be there."""
    import huggingface_hub
    from huggingface_hub import errors

    snapshot = put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], commit_hash("one"))
    incomplete = errors.LocalEntryNotFoundError("1 file(s) are missing (tokenizer.json)")
    incomplete.snapshot_path = str(snapshot)

    def snapshot_download(*args, **kwargs):
        raise incomplete

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(CheckpointError, match="is incomplete: it lacks files the Hub lists"):
        resolve_checkpoint("acme/tiny")


def test_a_local_directory_wins_over_a_repo_id(checkpoints, hub_env, tmp_path, monkeypatch):
    put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], commit_hash("one"))
    shutil.copytree(checkpoints["v2"], tmp_path / "acme" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("acme/tiny") == Path("acme/tiny")


def test_a_file_is_named_a_file_not_a_missing_directory(checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json' is a file, not a checkpoint directory; pass the "
                                              r"directory that holds it \('"):
        resolve_checkpoint(str(checkpoints["v1"] / "config.json"))


def test_adapters_load_models_by_name(checkpoints, hub_env):
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from hibana_plugins.langchain import ChatHibana
    from hibana_plugins.llamaindex import HibanaLLM

    put_snapshot(hub_env, "acme/tiny", checkpoints["v1"], commit_hash("one"))
    options = dict(device="cpu", progress=False, speculation="off", num_blocks=64)
    chat = ChatHibana(model="acme/tiny", engine_kwargs=options)
    llm = HibanaLLM(model="acme/tiny", engine_kwargs=options)
    try:
        with open_engine(checkpoints["v1"], speculation="off") as direct:
            assert chat.engine.fingerprint == llm.engine.fingerprint == direct.fingerprint
    finally:
        chat.engine.close()
        llm.engine.close()


# --- downloads (a stand-in for the Hub) ----------------------------------------------------------

class FakeHub:
    """`snapshot_download` over `repos` (repo id -> source directory): fetches what the patterns
    select into the cache, as huggingface_hub does; records every call."""

    def __init__(self, repos: dict[str, Path], error: Exception | None = None) -> None:
        self.repos, self.error, self.calls = repos, error, []

    def __call__(self, repo_id, *, revision=None, cache_dir=None, local_files_only=False,
                 allow_patterns=None, ignore_patterns=None, tqdm_class=None, **_):
        from huggingface_hub import constants
        from huggingface_hub.errors import LocalEntryNotFoundError
        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(dict(repo_id=repo_id, local_files_only=local_files_only, allow=allow_patterns,
                               ignore=ignore_patterns, tqdm_class=tqdm_class))
        snapshot = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit_hash(repo_id)
        if local_files_only:
            if not snapshot.is_dir():
                raise LocalEntryNotFoundError("not cached")
            return str(snapshot)
        if constants.HF_HUB_OFFLINE:  # as huggingface_hub's requests refuse to go out, cache missing
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder for the specified "
                                          "revision on the local disk and outgoing traffic has been disabled. "
                                          "To enable repo look-ups and downloads online, set 'HF_HUB_OFFLINE=0' "
                                          "as environment variable.")
        if self.error is not None:
            raise self.error
        source = self.repos[repo_id]
        files = [str(p.relative_to(source)) for p in source.rglob("*") if p.is_file()]
        for name in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / name, snapshot / name)
        return str(snapshot)

    def fetched(self, cache: Path, repo_id: str) -> set[str]:
        snapshot = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit_hash(repo_id)
        return {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}


@pytest.fixture
def online(hub_env, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as huggingface_hub read it at import
    return hub_env


def test_hf_hub_offline_unset_after_import_lets_the_download_go(checkpoints, online, monkeypatch):
    """HF_HUB_OFFLINE is read when a model is resolved: set to 1 when huggingface_hub was imported
    and to 0 since, the download ran into huggingface_hub's own offline mode, read once at its
    import, and failed as "the Hub cannot be reached (... set HF_HUB_OFFLINE=0 ...)"."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake = FakeHub({"acme/tiny": checkpoints["v1"]})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    path = resolve_checkpoint("acme/tiny")
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert constants.HF_HUB_OFFLINE is True, "online for the download only: other users of huggingface_hub as they were"


def test_hf_home_and_hf_hub_cache_expand_variables_as_huggingface_hub_does(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AUDIT_ROOT", str(tmp_path))
    monkeypatch.setenv("HF_HOME", "$AUDIT_ROOT/home")
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", "${AUDIT_ROOT}/cache")
    assert hub.cache_dir() == tmp_path / "cache"


@pytest.mark.parametrize("beside", [True, False])
def test_download_without_an_index_fetches_model_safetensors_alone(checkpoints, online, tmp_path, monkeypatch,
                                                                   beside):
    """No index: model.safetensors is the checkpoint, as the loader and transformers read it; a
    consolidated.safetensors beside it (Mistral's repos: the same weights again) stays on the Hub.
    A repo without a model.safetensors gets its *.safetensors."""
    import huggingface_hub

    source = tmp_path / "repo"
    shutil.copytree(checkpoints["v1"], source)
    assert not (source / "model.safetensors.index.json").exists()
    if beside:
        (source / "consolidated.safetensors").write_bytes(b"x" * 100)
    else:
        (source / "model.safetensors").rename(source / "weights.safetensors")
    fake = FakeHub({"acme/plain": source})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    path = resolve_checkpoint("acme/plain", progress=False)
    fetched = {name for name in fake.fetched(online, "acme/plain") if name.endswith(".safetensors")}
    assert fetched == ({"model.safetensors"} if beside else {"weights.safetensors"})
    assert [c["allow"] for c in fake.calls[3:]] == ([["model.safetensors"]] if beside else
                                                    [["model.safetensors"], ["*.safetensors"]])
    with open_engine(path, speculation="off") as downloaded, open_engine(checkpoints["v1"], speculation="off") as direct:
        assert generate(downloaded) == generate(direct)


def test_download_fetches_only_what_a_model_needs(checkpoints, online, tmp_path, monkeypatch):
    import huggingface_hub

    source = tmp_path / "repo"
    shutil.copytree(checkpoints["sharded"], source)
    (source / "original").mkdir()
    (source / "original" / "consolidated.00.pth").write_bytes(b"x" * 100)    # another format
    (source / "consolidated.safetensors").write_bytes(b"x" * 100)            # a copy the index does not name
    (source / "pytorch_model.bin").write_bytes(b"x" * 100)
    (source / "README.md").write_text("# a model card")
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "additional_chat_templates").mkdir()  # transformers' named templates: "tool_use"
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}{{ messages }}")
    (source / "onnx").mkdir()
    (source / "onnx" / "config.json").write_text("{}")
    fake = FakeHub({"acme/sharded": source})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)

    path = resolve_checkpoint("acme/sharded", progress=False)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    wanted = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates/tool_use.jinja", *shards}
    fetched = fake.fetched(online, "acme/sharded")
    assert wanted <= fetched, wanted - fetched
    assert not fetched & {"original/consolidated.00.pth", "consolidated.safetensors", "pytorch_model.bin",
                          "README.md", "onnx/config.json"}, fetched
    assert [c["local_files_only"] for c in fake.calls] == [True, False, False, False]  # the cache first
    assert all(c["tqdm_class"] is not None for c in fake.calls[1:])            # progress=False: silent bars
    with open_engine(path, speculation="off") as downloaded, \
            open_engine(checkpoints["sharded"], speculation="off") as direct:
        assert generate(downloaded) == generate(direct)
        # the tool_use template was fetched (it was not: subfolders were never fetched, and tools
        # were rendered by the default template)
        assert set(downloaded.tokenizer.chat_template) == {"default", "tool_use"}

    # cached now: no second download
    fake.calls.clear()
    assert resolve_checkpoint("acme/sharded") == path
    assert [c["local_files_only"] for c in fake.calls] == [True]


def test_a_partly_cached_repo_is_completed_online(checkpoints, online, monkeypatch):
    import huggingface_hub

    put_snapshot(online, "acme/tiny", checkpoints["v1"], commit_hash("acme/tiny"), only=("config.json",))
    fake = FakeHub({"acme/tiny": checkpoints["v1"]})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    path = resolve_checkpoint("acme/tiny")
    assert (path / "model.safetensors").is_file() and len(fake.calls) == 4


def test_a_partial_cache_the_unreachable_hub_cannot_complete_says_what_it_lacks(checkpoints, online,
                                                                               monkeypatch):
    """Online but the Hub unreachable, huggingface_hub answers from the cached snapshot without an
    error: what it lacks is named, with what to run (it was a loader's error about .bin files)."""
    import huggingface_hub

    snapshot = put_snapshot(online, "acme/tiny", checkpoints["v1"], commit_hash("one"), only=("config.json",))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snapshot))
    with pytest.raises(CheckpointError, match=r"has no \*\.safetensors weights: either the repo ships none .*"
                                              r"save_pretrained\) or the Hub could not be reached"):
        resolve_checkpoint("acme/tiny")
    source = checkpoints["sharded"]
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    snapshot = put_snapshot(online, "acme/sharded", source, commit_hash("two"),
                            only=("config.json", "model.safetensors.index.json", shards[0]))
    with pytest.raises(CheckpointError, match=rf"incomplete: it lacks {shards[1]}.*, and the Hub did not supply "
                                              r"them .*hf download acme/sharded.*retry once online"):
        resolve_checkpoint("acme/sharded")


def _http_error(cls, message, status=404):
    from types import SimpleNamespace

    return cls(message, response=SimpleNamespace(headers={}, request=None, status_code=status))


@pytest.mark.parametrize("error, says", [
    ("RepositoryNotFoundError", "has no model repository 'acme/nope'"),
    ("GatedRepoError", "gated model"),
    ("RevisionNotFoundError", "has no revision"),
    ("LocalEntryNotFoundError", "the Hub cannot be reached"),
    ("OSError", "failed"),
])
def test_download_failures_are_checkpoint_errors(error, says, online, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    if error == "LocalEntryNotFoundError":
        exc = errors.LocalEntryNotFoundError("connection refused")
    elif error == "OSError":
        exc = OSError("No space left on device")
    else:
        exc = _http_error(getattr(errors, error), "404")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, error=exc))
    with pytest.raises(CheckpointError, match=says):
        resolve_checkpoint("acme/nope")


def test_a_token_the_hub_refuses_says_to_check_it(online, monkeypatch):
    """An invalid HF_TOKEN is a 401 even on a public repo (huggingface_hub raises its plain HTTP
    error): the message said only that the download failed."""
    import huggingface_hub
    from huggingface_hub import errors

    exc = _http_error(errors.HfHubHTTPError, "401 Client Error: Unauthorized for url: https://huggingface.co/api/"
                      "models/acme/nope\nInvalid credentials in Authorization header", status=401)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, error=exc))
    with pytest.raises(CheckpointError, match=r"refused the token .*HF_TOKEN.*Invalid credentials in Authorization "
                                              r"header\. Check or renew it") as e:
        resolve_checkpoint("acme/nope")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("error", ["LocalEntryNotFoundError", "OSError"])
def test_a_hub_error_over_several_lines_is_said_on_one(error, online, monkeypatch):
    """Offline, `hibana demo --model foo/bar` printed huggingface_hub's two-line message inside its
    own: the commands print an error as one line."""
    import huggingface_hub
    from huggingface_hub import errors

    message = ("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to "
               "locate the files on the Hub.")
    exc = errors.LocalEntryNotFoundError(message) if error == "LocalEntryNotFoundError" else OSError(message)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, error=exc))
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("acme/nope")
    assert "\n" not in str(e.value) and "Name or service not known An error happened" in str(e.value), str(e.value)
