"""A Hugging Face hub cache written in huggingface_hub's layout (models--org--name/{blobs,refs,
snapshots}), for the tests that resolve repo ids without asking the Hub."""

from __future__ import annotations

import hashlib
from pathlib import Path


def commit_hash(tag: str) -> str:
    return hashlib.sha1(tag.encode()).hexdigest()


def put_snapshot(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 only: tuple[str, ...] | None = None) -> Path:
    """`source`'s files as huggingface_hub caches them: content in blobs/ named by hash, the
    snapshot a folder of links to them, `refs` naming the commit. `only`: just these files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if only is not None and file.name not in only:
            continue
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
