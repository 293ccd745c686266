"""State files: a state's tokens and KV blocks in one safetensors file.

The metadata carries the fingerprint of model and tokenizer, so a state is never restored into a
model it was not computed by, and a checksum over the metadata and every KV byte, verified before
the engine allocates anything, so a damaged file is refused whole. A file with another block size
is re-cut into the engine's blocks (where a page would need a row the file does not hold, it
restores its tokens only and the KV is recomputed on next use). A checksum proves no origin: the
engine keeps loaded blocks private to the loaded state unless asked to share them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError

from hibana_core.config import is_kind
from hibana_core.errors import StateFileError
from hibana_core.kv.layout import KVLayout
from hibana_core.kv.recurrent_cache import STATE_TENSORS, file_tensors, from_file_tensors
from hibana_core.kv.sequence import page_counts

FORMAT = "hibana-state/2"
FINGERPRINT_SCHEME = "2"  # 2: fingerprints sample the weights' values (loader._fingerprint)
_CHECKED = ("format", "fingerprint", "state_id", "tokens", "num_computed", "block_size")
TMP_NAME_CHARS = 32  # of the state file's name in its temporary file's: 128 bytes at most, so that the temporary
# name stays within a folder's 255 bytes a name wherever the state file's own does
MAX_HEADER = 100 << 20  # bytes of a safetensors header at most (safetensors' own limit)
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
"""Modes of the files that hold a state (state files, spill files) and of the folders Hibana makes
for them: their owner's alone, whatever the umask, as llama.cpp's slot files and ssh's keys are. A
state's tokens are its whole conversation (every message and tool result), and text can be
recovered from its KV. A folder the caller gave that already exists keeps its mode (its files
are private all the same). Windows keeps only the read-only bit of a mode: there they are the
folder's ACL's."""


@dataclass(frozen=True)
class SavedState:
    state_id: str
    tokens: list[int]
    num_computed: int
    block_size: int
    kv: torch.Tensor  # [page_layers, 2, pages, block_size, H_kv, D]: `KVSequence.pages` order
    rotated_long: bool = False  # under LongRoPE's long rotation (`KVSequence.rotated_long`)
    starts: tuple[int, ...] = (0,)  # each layer group's first block among the pages (`KVSequence.pages`)
    recurrent: dict[str, torch.Tensor] | None = None  # a hybrid model's linear-attention state at
    # num_computed: "conv" [linear layers, conv_dim, kernel - 1], "ssm" [linear layers, Hv, Dk, Dv]


def reblocked(saved: SavedState, block_size: int, layout: KVLayout | None = None) -> SavedState | None:
    """`saved` cut into pages of `block_size` tokens: the KV of a position does not depend on the
    page it sits in, so a state saved by an engine of another block size keeps its KV (its
    computed tokens' rows, each last page padded). Each layer group of `layout` (None: one plain
    group) is re-cut on its own: its sink pages, then its window pages from the first new block
    whose rows the file holds. None where a new page would need a row the file does not hold
    (the caller then recomputes the KV)."""
    old, n = saved.block_size, saved.num_computed
    sinks_old = layout.sink_blocks(old) if layout is not None else (0,)
    sinks_new = layout.sink_blocks(block_size) if layout is not None else (0,)
    end_old, end_new = -(-n // old), -(-n // block_size)
    pieces, starts, at = [], [], 0
    for (sink, rest), start, sink_new in zip(page_counts(sinks_old, saved.starts, n, old), saved.starts, sinks_new):
        first = max(start, sink)  # the window pages resume at this old block
        held = list(range(sink)) + list(range(first, end_old))
        row = torch.full((end_old * old,), -1, dtype=torch.long)  # position -> row of the group's pages
        for i, block in enumerate(held):
            row[block * old:(block + 1) * old] = torch.arange(i * old, (i + 1) * old)
        kept_sinks = min(sink_new, end_new)
        new_start = kept_sinks if first == sink else min(max(-(-first * old // block_size), kept_sinks), end_new)
        blocks = list(range(kept_sinks)) + list(range(new_start, end_new))
        positions = torch.cat([torch.arange(b * block_size, min((b + 1) * block_size, n)) for b in blocks]) \
            if blocks else torch.zeros(0, dtype=torch.long)
        src = row[positions]
        if bool((src < 0).any()):
            return None
        dst = torch.cat([torch.arange(j * block_size, j * block_size + min(block_size, n - b * block_size))
                         for j, b in enumerate(blocks)]) if blocks else positions
        group = saved.kv[:, :, at:at + sink + rest].flatten(2, 3)  # [page_layers, 2, rows, H_kv, D]
        rows = group.new_zeros((*group.shape[:2], len(blocks) * block_size, *group.shape[3:]))
        rows[:, :, dst] = group[:, :, src]
        pieces.append(rows.unflatten(2, (len(blocks), block_size)))
        starts.append(new_start)
        at += sink + rest
    return dataclasses.replace(saved, block_size=block_size, kv=torch.cat(pieces, dim=2), starts=tuple(starts))


def as_path(path: object) -> Path:
    """A state file's path from what a caller gave (str or os.PathLike; `~` expanded)."""
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes):
        try:
            text = os.fspath(path)
        except TypeError:
            text = None
        if isinstance(text, str):
            if text.endswith(("/", os.sep)) and not _is_dir(Path(text).expanduser()):
                raise StateFileError(f"{text!r} ends with a separator, a folder's name; give the state file's path")
            try:
                return Path(text).expanduser()
            except RuntimeError:  # ~user of no such user
                return Path(text)
    raise StateFileError(f"a state file path is a str or os.PathLike, got {type(path).__name__}")


_DESCRIBED = ("fingerprint_scheme", "configuration")
"""Fields a file's checksum covers since 2026-12-05 (a flipped bit in them loaded unnoticed, and the
"what differs" of a refused file quotes `configuration`); files written before verify without them."""


def _checksum(meta: dict, kv: torch.Tensor, described: bool = True,
              recurrent: dict[str, torch.Tensor] | None = None) -> str:
    h = hashlib.blake2b(digest_size=32)
    # "rotation" is written only for LongRoPE's long rotation, "pages" and "layout" only for
    # layouts of several groups or windows, "recurrent" only for hybrid models: other files stay as they were
    optional = tuple(k for k in ("rotation", "pages", "layout", "recurrent", *(_DESCRIBED if described else ()))
                     if k in meta)
    h.update(json.dumps([meta.get(k) for k in _CHECKED + optional]).encode())
    for tensor in (kv, *((recurrent[name] for name in STATE_TENSORS) if recurrent is not None else ())):
        tensor = tensor.contiguous()
        h.update(json.dumps([str(tensor.dtype), list(tensor.shape)]).encode())
        h.update(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")  # its buffer: no copy
    return h.hexdigest()


def _metadata(data: bytes) -> dict:
    """The metadata in a safetensors file's header (8 bytes of its length, then JSON)."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]).get("__metadata__") or {}


def save_private(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file` to `path`, a file its owner alone can read (PRIVATE_FILE). The
    file is made owner-only before the write, not after, so that no other user opens it in
    between: safetensors < 0.8 writes into it in place, keeping its mode, 0.8 through an
    owner-only file renamed onto it (neither through the umask's 0644 for a file made here). The
    mode is set again after the write, whatever another version of safetensors did."""
    from safetensors.torch import save_file

    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE))
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, PRIVATE_FILE)  # (a file that was there kept its mode through O_CREAT)


def write(path: Path, state_id: str, tokens: Sequence[int], num_computed: int, block_size: int,
          kv: torch.Tensor, fingerprint: str, rotated_long: bool = False, starts: Sequence[int] = (0,),
          layout: KVLayout | None = None, configuration: dict | None = None,
          recurrent: dict[str, torch.Tensor] | None = None) -> None:
    """Write a state file at `path`, atomically (a temporary file beside it, renamed onto it) and
    owner-only (`save_private`); a folder it makes for it is owner-only too (PRIVATE_DIR)."""
    try:
        is_dir = path.is_dir()
    except (OSError, UnicodeError, ValueError) as exc:
        raise StateFileError(f"cannot write the state file {str(path)!r}: {exc}") from exc
    if is_dir:
        raise StateFileError(f"{str(path)!r} is a directory; save the state to a file path in it")
    try:
        if path.is_symlink():  # the link stays; the file it points to is written
            path = path.resolve()
        special = path.exists() and not path.is_file()
    except (OSError, RuntimeError, UnicodeError, ValueError) as exc:  # a link loop, a name the OS refuses
        raise StateFileError(f"cannot write the state file {str(path)!r}: {exc}") from exc
    if special:
        raise StateFileError(f"{str(path)!r} exists and is not a regular file (a device, a pipe, a socket); "
                             "save the state to a file path")
    metadata = {"format": FORMAT, "fingerprint": fingerprint, "fingerprint_scheme": FINGERPRINT_SCHEME,
                "state_id": state_id, "tokens": json.dumps(list(tokens)), "num_computed": str(num_computed),
                "block_size": str(block_size)}
    if rotated_long:
        metadata["rotation"] = "long"
    if tuple(starts) != (0,):
        metadata["pages"] = json.dumps(list(starts))
    if layout is not None and layout.describe() is not None:
        metadata["layout"] = json.dumps(layout.describe())
    if configuration is not None:  # what the fingerprint digests: an engine that refuses the file says what differs
        metadata["configuration"] = json.dumps(configuration, sort_keys=True)
    kv = kv.contiguous()
    tensors = {"kv": kv}
    if recurrent is not None:  # a hybrid model's linear-attention state at num_computed
        metadata["recurrent"] = "1"
        tensors.update(file_tensors(recurrent))
    metadata["checksum"] = _checksum(metadata, kv, recurrent=recurrent)
    tmp = None
    try:
        path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        # a temporary file of this writer's own: engines sharing a state_dir may write one state at once
        handle, tmp = tempfile.mkstemp(prefix=path.name[:TMP_NAME_CHARS] + ".", suffix=".tmp", dir=path.parent)
        os.close(handle)
        save_private(tensors, Path(tmp), metadata)  # owner-only before the rename: the state file is never else
        os.replace(tmp, path)  # never leave a half-written state file behind
        tmp = None
    # no room, no right, a name the OS refuses (safetensors reports a failed write as a SafetensorError)
    except (OSError, UnicodeError, ValueError, SafetensorError) as exc:
        raise StateFileError(f"cannot write the state file {str(path)!r}: {exc}; save it to a path in a folder "
                             "you can write, with room for it") from exc
    finally:  # (an interrupt too)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, UnicodeError, ValueError):
        return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, UnicodeError, ValueError):
        return False


def _other_format(path: Path, format: object) -> str:
    """Why a file whose metadata names another format than FORMAT is refused, and what to do."""
    if isinstance(format, str) and format.startswith("hibana-state/"):
        return (f"{path} was written by another version of Hibana (format {format!r}; this one reads {FORMAT!r}); "
                "load it with the version that saved it, or save the state again")
    return (f"{path} is not a Hibana state file (its format is {format!r}: a checkpoint's weights, or another "
            "safetensors file?); pass the path of a file that StateHandle.save wrote")


def _differences(saved: str | None, ours: dict | None) -> str:
    """What differs between a state file's configuration (its JSON) and the engine's, in words;
    "" where either is unknown (a file from before they were saved) or nothing can be named."""
    try:
        theirs = json.loads(saved) if saved is not None else None
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict) or ours is None:
        return ""
    ours = json.loads(json.dumps(ours, sort_keys=True))  # as the file has it: a pass's tuple is a list there

    def passes(config: dict) -> str:
        return ", ".join(p.get("name", "?") + (f" {p['params']}" if p.get("params") else "")
                         for p in config.get("surgery") or ()) or "none"
    out = []
    if theirs.get("checkpoint") != ours.get("checkpoint"):
        out.append("another checkpoint or tokenizer (its weights, config or vocabulary differ)")
    for key in ("dtype", "kv_dtype"):
        if theirs.get(key) != ours.get(key):
            out.append(f"{key} {str(theirs.get(key)).removeprefix('torch.')} (this engine: "
                       f"{str(ours.get(key)).removeprefix('torch.')})")
    if theirs.get("surgery") != ours.get("surgery"):
        same = passes(theirs) == passes(ours)
        out.append(f"surgery {passes(theirs)} (this engine: {passes(ours)}"
                   + ("; the same passes, with other calibrated values (scales): calibrated on other text, "
                      "or on other weights or dtype" if same else "") + ")")
    return "; ".join(out)


def read(path: Path, fingerprint: str, kv_shape: Sequence[int], kv_dtype: torch.dtype | None = None,
         layout: KVLayout | None = None, configuration: dict | None = None,
         recurrent: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> SavedState:
    """Read and verify a state file; `kv_shape` is the engine's [page_layers, 2, *, block, heads,
    dim], `kv_dtype` its cache's dtype (fp8 blocks are saved and restored as their bytes),
    `layout` how its layers share pages (`kv.layout.KVLayout`; None: one plain group),
    `configuration` what its fingerprint digests (`surgery.configuration`), to name what differs,
    `recurrent` a hybrid model's state tensors' shapes and dtypes (`RecurrentCache.slot_shapes`):
    a file with KV must hold that state too."""
    import safetensors.torch

    try:
        exists = path.is_file()
    except (OSError, UnicodeError, ValueError):
        exists = False
    if not exists:
        what = ("is a directory, not a state file" if _is_dir(path) else
                "is not a regular file (a device, a pipe, a socket)" if _exists(path) else "does not exist")
        raise StateFileError(f"state file {str(path)!r} {what}")
    try:
        # one open file, read once: a file another engine replaces meanwhile is read whole, old or new;
        # its header first, so that a file of another kind (a checkpoint's weights) is refused unread
        with path.open("rb") as file:
            header = file.read(8)
            (length,) = struct.unpack("<Q", header)
            meta = _metadata(header + file.read(min(length, MAX_HEADER)))
            if meta.get("format") != FORMAT:
                raise StateFileError(_other_format(path, meta.get("format")))
            file.seek(0)
            data = file.read()
        loaded = safetensors.torch.load(data)
        kv = loaded["kv"]
        held = from_file_tensors(loaded) if "recurrent" in meta else None
        del data, loaded  # the file's bytes, before the checksum copies the KV once more
        checksum_ok = meta.get("checksum") == _checksum(meta, kv, recurrent=held) or (
            any(k in meta for k in _DESCRIBED) and meta.get("checksum") == _checksum(meta, kv, False, held))
        tokens = json.loads(meta["tokens"])
        if not isinstance(tokens, list) or not all(is_kind(t, int) for t in tokens):
            raise ValueError("its tokens are not a list of integers")
        if meta.get("rotation", "long") != "long":
            raise ValueError(f"its rotation {meta['rotation']!r} is not 'long'")
        starts = tuple(json.loads(meta.get("pages", "[0]")))
        if not starts or not all(is_kind(s, int) and s >= 0 for s in starts):
            raise ValueError(f"its pages {meta['pages']!r} are not a list of block indices")
        if not meta["state_id"]:  # no call could name it: not even to delete its file
            raise ValueError("its state id is empty")
        saved = SavedState(str(meta["state_id"]), tokens, int(meta["num_computed"]),
                           int(meta["block_size"]), kv, "rotation" in meta, starts, held)
    except StateFileError:
        raise
    except Exception as exc:
        raise StateFileError(f"state file {path} is damaged ({exc}); save the state again") from exc
    if not checksum_ok:
        raise StateFileError(f"state file {path} is damaged (its checksum does not match); save the state again")
    if meta.get("fingerprint") != fingerprint:
        differs = _differences(meta.get("configuration"), configuration)
        if differs:
            raise StateFileError(f"{path} was saved by another model or tokenizer, or under another dtype, kv_dtype "
                                 f"or surgery, than this engine's: {differs}; load it into an engine on the same "
                                 "checkpoint with the same dtype, kv_dtype and surgery")
        older = ("; or by a Hibana from before 2026-12-04, whose fingerprints did not read the weights' values: "
                 "compute the state again" if "fingerprint_scheme" not in meta else "")
        raise StateFileError(f"{path} was saved by another model or tokenizer, or under another dtype, kv_dtype "
                             "or surgery; load it into an engine on the same checkpoint with the same dtype, "
                             f"kv_dtype and surgery{older}")
    if (json.loads(meta["layout"]) if "layout" in meta else None) != (layout.describe() if layout else None):
        raise StateFileError(f"{path} was saved by an engine whose layers share their KV pages otherwise (sliding "
                             "windows that max_model_len turns into full attention, or the window surgery pass): "
                             "load it into an engine with the same max_model_len and surgery")
    groups = len(layout.groups) if layout is not None else 1
    blocks = -1
    if saved.block_size > 0 and len(saved.starts) == groups:
        sinks = layout.sink_blocks(saved.block_size) if layout is not None else (0,)
        blocks = sum(a + b for a, b in page_counts(sinks, saved.starts, saved.num_computed, saved.block_size))
    if (not 0 <= saved.num_computed <= len(saved.tokens) or saved.block_size <= 0 or kv.dim() != 6
            or len(saved.starts) != groups
            or kv.shape[2] != blocks or kv.shape[3] != saved.block_size
            or (kv.shape[0], kv.shape[1], kv.shape[4], kv.shape[5]) != (kv_shape[0], kv_shape[1], kv_shape[4], kv_shape[5])
            or (kv_dtype is not None and kv.dtype != kv_dtype)):
        raise StateFileError(f"state file {path} is inconsistent (its KV does not fit its tokens or this "
                             "model's layout); save the state again")
    held = saved.recurrent
    if ((recurrent is None) != (held is None) and saved.num_computed) or (held is not None and recurrent is not None and any(
            (tuple(held[name].shape), held[name].dtype) != recurrent[name] for name in STATE_TENSORS)):
        raise StateFileError(f"state file {path} is inconsistent (its linear-attention state does not fit this "
                             "model's); save the state again")
    return saved
