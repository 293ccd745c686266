"""State files: a state's tokens and KV blocks in one safetensors file.

The metadata carries the fingerprint of model and tokenizer, so a state is never restored into a
model it was not computed by. A file with another block size or KV layout restores its tokens
only (the KV is recomputed on next use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from hibana_core.errors import StateFileError

FORMAT = "hibana-state/1"


@dataclass(frozen=True)
class SavedState:
    state_id: str
    tokens: list[int]
    num_computed: int
    block_size: int
    kv: torch.Tensor  # [num_layers, 2, num_blocks, block_size, H_kv, D]


def write(path: Path, state_id: str, tokens: Sequence[int], num_computed: int, block_size: int,
          kv: torch.Tensor, fingerprint: str) -> None:
    from safetensors.torch import save_file

    metadata = {"format": FORMAT, "fingerprint": fingerprint, "state_id": state_id,
                "tokens": json.dumps(list(tokens)), "num_computed": str(num_computed),
                "block_size": str(block_size)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"kv": kv.contiguous()}, str(tmp), metadata=metadata)
    tmp.replace(path)  # never leave a half-written state file behind


def read(path: Path, fingerprint: str) -> SavedState:
    from safetensors import safe_open

    if not path.is_file():
        raise StateFileError(f"state file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise StateFileError(f"{path} is not a Hibana state file (format {meta.get('format')!r})")
            kv = f.get_tensor("kv")
        tokens = json.loads(meta["tokens"])
        saved = SavedState(meta["state_id"], [int(t) for t in tokens], int(meta["num_computed"]),
                           int(meta["block_size"]), kv)
    except StateFileError:
        raise
    except Exception as exc:
        raise StateFileError(f"state file {path} is damaged ({exc}); save the state again") from exc
    if meta.get("fingerprint") != fingerprint:
        raise StateFileError(f"{path} was saved by another model or tokenizer; load it into an engine "
                             "on the same checkpoint")
    if not 0 <= saved.num_computed <= len(saved.tokens):
        raise StateFileError(f"state file {path} is inconsistent; save the state again")
    return saved
