"""Models by name: a Hugging Face repo id ("org/name", optionally "@revision") -> a checkpoint
directory in the local Hugging Face cache, downloaded first where it is missing and the Hub may
be asked.

The cache comes first: a snapshot that holds config and weights is used without asking the Hub
(`hf download org/name` updates it). Otherwise, online, only the files a model needs are
fetched, with a progress bar: config, generation config, tokenizer and chat-template files (the
named ones in `additional_chat_templates/` too), then the safetensors weights (exactly the shards
the index names). Other subfolders (`original/`, other formats) are never fetched.

The Hugging Face environment is honoured as huggingface_hub reads it, but when a model is
resolved rather than when huggingface_hub was imported: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE),
HF_HUB_CACHE, HF_HOME; huggingface_hub itself reads HF_TOKEN for gated and private models.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from hibana_core.errors import CheckpointError

logger = logging.getLogger("hibana.hub")

SMALL_FILES = ["*.json", "*.jinja", "tokenizer*", "merges.txt", "*.tiktoken"]
"""Config, generation config, weight index, tokenizer and chat-template files (top level)."""
SUBFOLDERS = ["*/*"]
"""Never fetched: other formats and copies of the weights (`original/`, `onnx/`, ...)."""
CHAT_TEMPLATES = ["additional_chat_templates/*.jinja"]
"""The one subfolder fetched: a tokenizer's named chat templates, where transformers writes them
(a "tool_use" template beside the default one, which `apply_chat_template` takes when tools are given)."""
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class RepoRef:
    """A model on the Hugging Face Hub: its repo id and, optionally, a branch, tag or commit."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id

    @property
    def download_command(self) -> str:
        return f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")


def parse_repo_id(model: str) -> RepoRef | None:
    """`model` read as "org/name[@revision]" (or a bare "name"), or None when it cannot be one
    (a path such as ./x, ~/x or /x, a name with characters a repo id cannot hold)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    name, at, revision = model.rpartition("@") if "@" in model else (model, "", "")
    if at and not revision:
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return RepoRef(name, revision or None)


def cache_dir() -> Path:
    """The hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else its default
    (`~` and `$VARS` in them expanded, as huggingface_hub expands them)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expanded(os.environ[var])
    if os.environ.get("HF_HOME"):
        return _expanded(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def _expanded(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) says the Hub must not be asked."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def check_not_cache_folder(path: Path) -> None:
    """A CheckpointError where `path` is a hub cache's folder of one repo (models--org--name, or its
    snapshots/), which holds snapshots of a checkpoint rather than being one: a new user's first try
    at a model they downloaded, which said no more than that it has no config.json."""
    folder = path.parent if path.name == "snapshots" else path
    if (path / "config.json").exists() or not folder.name.startswith("models--") \
            or not (folder / "snapshots").is_dir():
        return
    repo_id = folder.name.removeprefix("models--").replace("--", "/")  # a repo id never holds "--"
    snapshots = sorted(p.name for p in (folder / "snapshots").iterdir() if p.is_dir())
    one = f"{folder / 'snapshots' / snapshots[0]}" if len(snapshots) == 1 else f"{folder / 'snapshots'}/<commit>"
    found = ("found in the cache" if folder.parent.resolve() == cache_dir().resolve()
             else f"found there with HF_HUB_CACHE={folder.parent}")
    raise CheckpointError(f"{str(path)!r} is the Hugging Face cache's folder of {repo_id}, which holds its "
                          f"snapshots, not a checkpoint directory; pass the repo id {repo_id!r} ({found}), "
                          f"or a snapshot's directory: {one}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")
"""A checkpoint's tokenizer, in any of the forms transformers reads (tokenizer_config.json alone,
which a partial download keeps, is none)."""


def snapshot(ref: RepoRef, progress: bool = True) -> Path:
    """The checkpoint directory of `ref`: its cached snapshot when that holds config, weights and
    a tokenizer, else downloaded (online). A CheckpointError says what to do when neither works."""
    cache = cache_dir()
    cached, missing = _cached(ref, cache)
    if cached is not None and not any(any(cached.glob(pattern)) for pattern in TOKENIZER_FILES):
        # a snapshot cached without its tokenizer is one cached in part (a checkpoint directory without
        # one still loads, for token ids alone: pass the snapshot's path for that)
        missing = [*missing, "its tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"]
    if cached is not None and not missing:
        logger.info("%s: using the cached snapshot %s", ref, cached)
        return cached
    if offline():
        why = _not_cached(ref, cache, cached, missing, "and downloads are off (HF_HUB_OFFLINE is set)")
        fetched = "" if _bin_only(cached, missing) else "; or set HF_HUB_OFFLINE=0 to let Hibana fetch it"
        raise CheckpointError(why + fetched)
    return _download(ref, cache, progress)


def read_json_object(file: Path) -> dict:
    """A checkpoint's JSON file that holds an object; ValueError saying what it holds otherwise."""
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def index_shards(index: Path) -> list[str]:
    """The weight files a `model.safetensors.index.json` names, sorted; ValueError saying what is
    wrong where it is no object with a weight_map of file names."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
        raise ValueError(f"its weight_map is {type(weight_map).__name__}, not an object of file names")
    return sorted(set(weight_map.values()))


def missing_files(path: Path) -> list[str]:
    """What a checkpoint directory lacks to load: config.json, or weights (the shards its index
    names, or any *.safetensors)."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = index_shards(index)
        except ValueError:
            return missing + [f"{index.name} (damaged)"]
        missing += [name for name in shards if not (path / name).is_file()]
    elif not (path / "model.safetensors").is_file():  # else the loader reads it alone
        files = sorted(path.glob("*.safetensors"))
        # a cache's files are links into its blobs/: one whose blob is gone is listed, yet cannot be read
        missing += [f"{p.name} (a link to a file that is gone)" for p in files if not p.is_file()]
        if not files:
            missing.append("*.safetensors weights")
    return missing


def _cached(ref: RepoRef, cache: Path) -> tuple[Path | None, list[str]]:
    """The cached snapshot of `ref` (None when there is none) and what it lacks; no network."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(huggingface_hub.snapshot_download(
            ref.repo_id, revision=ref.revision, cache_dir=str(cache), local_files_only=True,
            allow_patterns=SMALL_FILES, ignore_patterns=SUBFOLDERS))
    except LocalEntryNotFoundError as exc:
        # newer huggingface_hub: a snapshot its cached file list shows incomplete (the weights
        # are still checked here, which its listing of the small files does not cover)
        partial = getattr(exc, "snapshot_path", None)
        if partial is None:
            return None, []
        path = Path(partial)
        return path, missing_files(path) or ["files the Hub lists for it (config or tokenizer files)"]
    return path, missing_files(path)


def _bin_only(cached: Path | None, missing: list[str]) -> bool:
    """Whether the cached snapshot lacks safetensors but holds .bin weights (fetching again changes nothing)."""
    return cached is not None and "*.safetensors weights" in missing and any(cached.glob("*.bin"))


def _not_cached(ref: RepoRef, cache: Path, cached: Path | None, missing: list[str], why: str) -> str:
    if _bin_only(cached, missing):
        return (f"the cached copy of {ref} ({cached}) holds PyTorch .bin weights, which Hibana does not read "
                "(safetensors only), and downloading it again would not change that if the repo ships no "
                "safetensors. Convert them: load it with transformers and save_pretrained(DIR) (safetensors by "
                "default), then pass DIR")
    held = _cached_revisions(ref, cache) if cached is None else []
    if held:  # the repo is cached, at other revisions: say which, they may be what was meant
        return (f"the cache ({cache}) holds {ref.repo_id} at {', '.join(held)} but not at "
                f"{'its default branch (main)' if ref.revision is None else f'revision {ref.revision!r}'}, {why}. "
                f"Pass one it holds ({ref.repo_id}@REVISION, a full commit hash or a branch or tag it names), or "
                f"download this one where the Hub is reachable: `{ref.download_command}`")
    if cached is None:
        what = (f"{str(ref)!r} is no checkpoint directory, and as a Hugging Face repo id it is not in "
                f"the cache ({cache}) {why}")
    else:
        what = f"the cached copy of {ref} ({cached}) is incomplete: it lacks {', '.join(missing)}, {why}"
    return (f"{what}. Download it where the Hub is reachable: `{ref.download_command}` (or "
            f"`huggingface-cli download ...` with an older huggingface_hub); or pass the path of a "
            "local checkpoint directory")


def _cached_revisions(ref: RepoRef, cache: Path, most: int = 4) -> list[str]:
    """The revisions of `ref`'s repo the cache holds a snapshot of, in huggingface_hub's layout:
    each branch or tag its refs/ name ("main (commit)"), then commits no ref names; no network."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    try:
        commits = sorted(p.name for p in (repo / "snapshots").iterdir() if p.is_dir())
        named = {str(f.relative_to(repo / "refs")): f.read_text().strip()
                 for f in sorted((repo / "refs").rglob("*")) if f.is_file()} if (repo / "refs").is_dir() else {}
    except (OSError, UnicodeDecodeError):
        return []
    held = [f"{name} ({commit})" for name, commit in named.items() if commit in commits]
    held += [commit for commit in commits if commit not in named.values()]
    return held[:most] + ([f"{len(held) - most} more"] if len(held) > most else [])


def _download(ref: RepoRef, cache: Path, progress: bool) -> Path:
    from huggingface_hub import constants

    # huggingface_hub read HF_HUB_OFFLINE once, when it was imported, and refuses every request while
    # that said offline; the environment says online now (offline() is False here), as it is read
    # when a model is resolved: online for this download, as it was for the rest of the process
    was_offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, False
    try:
        return _snapshot(ref, cache, progress)
    finally:
        constants.HF_HUB_OFFLINE = was_offline


def _snapshot(ref: RepoRef, cache: Path, progress: bool) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    options = dict(revision=ref.revision, cache_dir=str(cache), ignore_patterns=SUBFOLDERS)
    if not progress:
        options["tqdm_class"] = _silent_tqdm()
    logger.info("%s: downloading from the Hugging Face Hub into %s", ref, cache)
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        path = Path(huggingface_hub.snapshot_download(ref.repo_id, allow_patterns=SMALL_FILES, **options))
        path = Path(huggingface_hub.snapshot_download(ref.repo_id, allow_patterns=CHAT_TEMPLATES,
                                                      **{**options, "ignore_patterns": None}))
        for patterns in _weight_patterns(path):  # the first that brings weights
            path = Path(huggingface_hub.snapshot_download(ref.repo_id, allow_patterns=patterns, **options))
            if any(path.glob("*.safetensors")):
                break
    except GatedRepoError:
        raise CheckpointError(f"{ref.repo_id} is a gated model: accept its terms on "
                              f"https://huggingface.co/{ref.repo_id}, then {login}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{str(ref)!r} is no checkpoint directory, and the Hugging Face Hub has no "
                              f"model repository {ref.repo_id!r} (if it is private, {login}); pass a "
                              "checkpoint directory or a repo id such as Qwen/Qwen3-8B") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or commit); "
                              "leave out @revision for the default branch") from None
    except LocalEntryNotFoundError as exc:  # the Hub is unreachable and the cache cannot answer
        raise CheckpointError(_not_cached(ref, cache, None, [], f"and the Hub cannot be reached ({_one_line(exc)})")
                              + "; or retry once online") from None
    except (OSError, ValueError) as exc:  # HTTP errors are OSErrors; a full disk ...
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, HfHubHTTPError) and status == 401:  # a token it does not know (public repos too)
            raise CheckpointError(f"the Hugging Face Hub refused the token sent for {ref} (HF_TOKEN, or the one "
                                  f"`hf auth login` saved): {_one_line(exc)}. Check or renew it (`hf auth whoami` "
                                  "says whose it is), or unset HF_TOKEN for a public model") from None
        raise CheckpointError(f"downloading {ref} from the Hugging Face Hub failed: {_one_line(exc)}") from exc
    missing = missing_files(path)
    if missing == ["*.safetensors weights"]:  # a repo of .bin weights alone, or the Hub unreachable
        raise CheckpointError(f"{ref} ({path}) has no *.safetensors weights: either the repo ships none (Hibana "
                              "reads safetensors only; convert .bin weights with transformers' save_pretrained) or "
                              "the Hub could not be reached to fetch them (retry once online)")
    if missing:  # huggingface_hub answers from a partial cached snapshot when the Hub is unreachable
        raise CheckpointError(_not_cached(ref, cache, path, missing, "and the Hub did not supply them (it may "
                                          "be unreachable)") + "; or retry once online")
    logger.info("%s: downloaded to %s", ref, path)
    return path


def _one_line(exc: BaseException) -> str:
    """huggingface_hub's message on one line: its errors run over several, and the commands print
    an error as one line."""
    return " ".join(str(exc).split())


def _silent_tqdm() -> type:
    """A tqdm class whose bars never show (progress=False)."""
    from tqdm.auto import tqdm

    class SilentTqdm(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return SilentTqdm


def _weight_patterns(path: Path) -> list[list[str]]:
    """The weight files to fetch, in the order to try them: the shards the index names; without an
    index model.safetensors alone (transformers reads no other: Mistral's repos ship the same
    weights again as consolidated.safetensors), else every top-level *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [index_shards(index)]
        except ValueError as exc:
            raise CheckpointError(f"{index} is damaged ({exc}); delete it from the cache and retry") from exc
    return [["model.safetensors"], ["*.safetensors"]]
