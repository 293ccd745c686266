"""Surgery written to disk: a checkpoint directory that loads with its passes already applied.

    out/config.json, tokenizer files, generation_config.json   copied from the source
    out/model.safetensors      the rewritten model's tensors under Hibana's own module names
                               (fused q/k/v and gate/up; packed layers as qweight/scales/zeros)
    out/hibana_surgery.json    MANIFEST: the passes with their parameters and guard figures,
                               each packed layer's kind and group size (fp8: its scale block), the
                               MoE experts packed and their kind (`*_qweight`, `*_scales`, int4
                               `*_zeros`), and
                               the attention layers whose KV is stored in fp8 (kv8: their
                               `kv_scale` is in the weights), and those the window pass
                               switched to sink + window attention

`hibana_core.loader` reads the manifest: packed layers get their packed tensors, the rest load
by name, and the engine reports the manifest's passes as applied (they join its fingerprint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from hibana_core.errors import CheckpointError

MANIFEST = "hibana_surgery.json"
FORMAT = "hibana-surgery/1"
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
           "*.tiktoken", "chat_template.jinja", "additional_chat_templates/*.jinja")
"""The source's files the written checkpoint keeps as they are (those the hub fetches but the weights
and their index; `additional_chat_templates/`: the tokenizer's named chat templates, its tool_use one)."""


def packed_layers(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    return {name: {"kind": m.kind, "group_size": m.group_size, **({"block": list(m.block)} if getattr(m, "block", None) else {})}
            for name, m in model.named_modules() if getattr(m, "kind", "dense") != "dense"}


def packed_experts(model: torch.nn.Module) -> dict[str, str]:
    return {name: m.experts_kind for name, m in model.named_modules()
            if getattr(m, "experts_kind", "dense") != "dense"}


def kv_scaled_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "kv_scale", None) is not None]


def windowed_layers(model: torch.nn.Module) -> dict[str, list[int]]:
    """The attention layers the window pass switched: [window, sink_tokens] each."""
    return {name: list(m.surgery_window) for name, m in model.named_modules()
            if getattr(m, "surgery_window", None) is not None}


def check_out(out: Path) -> None:
    """CheckpointError unless `out` is a new or empty directory that can be written (made now,
    empty: a run checks it before its minutes of work)."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; choose a new or empty directory")
    if out.exists() and any(out.iterdir()):
        what = "already holds a checkpoint" if (out / MANIFEST).exists() or any(out.glob("*.safetensors")) \
            else "is not empty"
        raise CheckpointError(f"{out} {what}; choose a new or empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot make the directory {out} ({exc.strerror or exc}); choose one you can "
                              "write") from None


def save(engine: Any, source: Path, out: Path) -> Path:
    """Write `engine`'s rewritten model (loaded from `source`) as a checkpoint in `out`; a write that
    fails leaves `out` empty again (not a checkpoint without its manifest)."""
    check_out(out)
    try:
        _write(engine, source, out)
    except BaseException as exc:
        for written in out.iterdir():
            shutil.rmtree(written) if written.is_dir() else written.unlink()
        if isinstance(exc, OSError):  # a full disk, a quota: said in one line, not as a traceback
            raise CheckpointError(f"cannot write the checkpoint to {out} ({exc.strerror or exc}); free space there "
                                  "or choose another directory") from None
        raise
    return out


def _write(engine: Any, source: Path, out: Path) -> None:
    from safetensors.torch import save_file

    from hibana_core.loader import declared_dtype, surgery_fingerprint  # here: the loader reads this module's manifests

    for pattern in _COPIED:
        for file in sorted(source.glob(pattern)):
            if file.is_file():
                (out / file.relative_to(source)).parent.mkdir(exist_ok=True)
                shutil.copy2(file, out / file.relative_to(source))
    model = engine.model
    declared = declared_dtype(engine.hf_config)
    rewritten = tuple(f"{name}." for name in [*packed_layers(model), *packed_experts(model)])
    tensors = {name: t.detach().contiguous().cpu() for name, t in
               [*model.named_parameters(), *model.named_buffers()]}  # tied parameters once
    # the weights no pass packed, at their own size where that holds them exactly (kv8's layers
    # too: their scales are buffers, kept in the kernels' dtype, their weights are the source's)
    for name, _ in model.named_parameters():
        if not name.startswith(rewritten):
            tensors[name] = narrowed(tensors[name], declared)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    manifest = {"format": FORMAT, "source": str(source), "dtype": str(engine.dtype).removeprefix("torch."),
                "passes": engine.surgery, "packed_layers": packed_layers(model),
                "packed_experts": packed_experts(model),
                "kv_scaled_layers": kv_scaled_layers(model), "windowed_layers": windowed_layers(model)}
    if not engine.checkpoint_fingerprint.startswith("in-memory:"):
        # an engine on this checkpoint in the writer's dtype is the engine that wrote it (its weights
        # bit for bit, the same passes): it takes the source's fingerprint, and their states load
        # into each other, while the files and the manifest are as written
        # (`fingerprint`: of the weights and the manifest as read back, JSON's spelling of its values)
        manifest["source_fingerprint"] = engine.checkpoint_fingerprint
        manifest["fingerprint"] = surgery_fingerprint(out, json.loads(json.dumps(manifest)))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    # safetensors writes its file owner-only (0600): as readable as the manifest beside it, so
    # that whoever may read the checkpoint (a server under another user) can load it
    shutil.copymode(out / MANIFEST, out / "model.safetensors")


def narrowed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in the checkpoint's own `dtype` where that is narrower and holds it exactly, else
    as it is: a float32 engine (the CPU's default) upcast a bfloat16 checkpoint, and the weights
    no pass rewrote (embeddings, norms, layers left dense) go back at their own size (`save`
    leaves the rewritten layers' tensors, scales above all, in the dtypes their kernels read)."""
    if (dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype
            or tensor.element_size() <= dtype.itemsize):
        return tensor
    narrow = tensor.to(dtype)
    return narrow if torch.equal(narrow.to(tensor.dtype), tensor) else tensor


def read_manifest(path: Path) -> dict[str, Any] | None:
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_bytes().decode("utf-8"))
    except ValueError as exc:  # (not UTF-8 text, or not JSON)
        raise CheckpointError(f"{file} is damaged ({exc}); re-run `hibana surgery`") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{file} has format {found!r:.80}; this Hibana reads {FORMAT!r}")
    passes = manifest.get("passes", [])
    if not (isinstance(passes, list) and all(isinstance(r, dict) and isinstance(r.get("name"), str)
                                             and isinstance(r.get("params"), dict) for r in passes)):
        raise CheckpointError(f"{file} is damaged (its passes are not records with a name and parameters); "
                              "re-run `hibana surgery`")
    layers, experts = manifest.get("packed_layers", {}), manifest.get("packed_experts", {})
    scaled = manifest.get("kv_scaled_layers", [])
    shapes = [("packed_layers", isinstance(layers, dict) and all(_layer_spec(s) for s in layers.values()),
               "layer names and their {\"kind\": int8 / int4 / fp8, \"group_size\", \"block\" (fp8)}"),
              ("packed_experts", isinstance(experts, dict) and all(k in _EXPERT_KINDS for k in experts.values()),
               f"MoE expert names and their kind ({' / '.join(_EXPERT_KINDS)})"),
              ("kv_scaled_layers", isinstance(scaled, list) and all(isinstance(n, str) for n in scaled),
               "a list of attention layer names")]
    for key, ok, what in shapes:
        if not ok:
            raise CheckpointError(f"{file} is damaged (its {key} is not {what}); re-run `hibana surgery`")
    return manifest


_EXPERT_KINDS = ("int8", "int4")


def _layer_spec(spec: Any) -> bool:
    """Whether a manifest's packed_layers entry reads as `packed_layers` writes one."""
    def whole(value: Any, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    if not isinstance(spec, dict) or spec.get("kind") not in ("int8", "int4", "fp8"):
        return False
    if spec["kind"] == "fp8":
        block = spec.get("block")
        return isinstance(block, list) and len(block) == 2 and all(whole(b, 1) for b in block)
    return whole(spec.get("group_size", 0), 2 if spec["kind"] == "int4" else 0)


def check_packed(path: Path, name: str, spec: dict[str, Any], tensors: dict[str, torch.Tensor],
                 shape: tuple[int, ...], perm: torch.Tensor | None = None) -> None:
    """A CheckpointError unless the packed `tensors` of layer `name` (dense weight `shape`
    [N, K]) are those its manifest entry `spec` describes, as `packed_layers` wrote them: a layer
    of another kind or group size loaded, and the first forward failed on a shape."""
    n, k = shape
    kind = spec["kind"]
    if kind == "int4":
        g = spec["group_size"]
        want = {"qweight": (torch.uint8, (n, k // 2)), "scales": (None, (n, k // g)), "zeros": (None, (n, k // g))}
        if k % g:
            raise CheckpointError(f"{path}: {MANIFEST} gives {name} ({n}x{k}) groups of {g} inputs, which do not "
                                  f"divide its {k}; the manifest is damaged or another checkpoint's: re-run "
                                  "`hibana surgery`")
    elif kind == "int8":
        want = {"qweight": (torch.int8, (n, k)), "scales": (None, (n,))}
    else:
        bn, bk = spec["block"]
        want = {"qweight": (torch.float8_e4m3fn, (n, k)), "scales": (None, (-(-n // bn), -(-k // bk)))}
    if perm is not None:
        want["perm"] = (torch.int64, (k,))
        tensors = {**tensors, "perm": perm}
    for part, (dtype, expected) in want.items():
        t = tensors[part]
        if tuple(t.shape) != expected or (dtype is not None and t.dtype != dtype):
            group = f" in groups of {spec['group_size']}" if kind == "int4" else ""
            raise CheckpointError(f"{path}: {name}.{part} is {str(t.dtype).removeprefix('torch.')} "
                                  f"{list(t.shape)}, where {MANIFEST}'s {kind}{group} for a {n}x{k} layer needs "
                                  f"{str(dtype).removeprefix('torch.') + ' ' if dtype else ''}{list(expected)}; "
                                  "the manifest is damaged or another checkpoint's: re-run `hibana surgery`")


def check_packed_experts(path: Path, name: str, kind: str, tensors: dict[str, dict[str, torch.Tensor]],
                         shapes: dict[str, tuple[int, ...]]) -> None:
    """check_packed for MoE experts `name`: each stack's packed `tensors` against its float
    stack's shape [E, N, K] (int4's group size is the one its scales imply)."""
    for stack, parts in tensors.items():
        e, n, k = shapes[stack]
        groups = parts["scales"].shape[-1] if kind == "int4" and parts["scales"].dim() == 3 else 0
        want = ({"qweight": (torch.int8, (e, n, k)), "scales": (e, n)} if kind == "int8" else
                {"qweight": (torch.uint8, (e, n, k // 2)), "scales": (e, n, groups), "zeros": (e, n, groups)})
        for part, expected in want.items():
            dtype, expected = expected if part == "qweight" else (None, expected)
            t = parts[part]
            if tuple(t.shape) != expected or (dtype is not None and t.dtype != dtype) or (
                    kind == "int4" and (not groups or k % groups or (k // groups) % 2)):
                raise CheckpointError(f"{path}: {name}.{stack}_{part} is {str(t.dtype).removeprefix('torch.')} "
                                      f"{list(t.shape)}, which is no {kind} packing of {e} experts' {n}x{k} "
                                      f"{stack} ({MANIFEST}'s kind); the manifest is damaged or another "
                                      "checkpoint's: re-run `hibana surgery`")


def check_kv_scaled_layers(path: Path, manifest: dict[str, Any], attention: list[str]) -> None:
    """A CheckpointError unless the manifest's `kv_scaled_layers` are what its passes say: every one of
    the model's `attention` layers where they name kv8 (which scales them all), none where they do
    not. A kv8 checkpoint whose manifest listed none loaded with its KV cache in the compute dtype,
    reported as kv8 all the same (its scales lay unread in the weights)."""
    names = [record["name"] for record in manifest.get("passes", [])]
    scaled = set(manifest.get("kv_scaled_layers", []))
    missing = [name for name in attention if name not in scaled]
    redo = f"re-run `hibana surgery` on its source ({manifest.get('source', 'the checkpoint it was written from')})"
    if "kv8" in names and missing:
        listed = f"{len(attention) - len(missing)} of them" if scaled else "none of them"
        raise CheckpointError(f"{path / MANIFEST} names the kv8 pass, which scales the KV of every attention layer "
                              f"({len(attention)} in this model), but its kv_scaled_layers name {listed} (missing: "
                              f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): loaded so, the KV "
                              f"cache would not be fp8. The manifest is damaged: {redo} with its passes "
                              f"({', '.join(names)})")
    if "kv8" not in names and scaled:
        raise CheckpointError(f"{path / MANIFEST} lists kv_scaled_layers ({len(scaled)}), which only the kv8 pass "
                              f"writes, but its passes ({', '.join(names) or 'none'}) do not name kv8. The manifest "
                              f"is damaged: {redo} with the passes it was written with")


def check_kv_scale(path: Path, name: str, scale: torch.Tensor, kv_heads: int | None) -> None:
    """A CheckpointError unless `scale` reads as kv8 wrote it: float [2, kv_heads] (keys', values'
    scale per KV head), every one finite and positive (powers of two). A zero one (an integer
    tensor cast, a damaged file) loaded, and the layer's fp8 KV was all saturated: every token the same."""
    shape_ok = kv_heads is None or tuple(scale.shape) == (2, kv_heads)
    if not (scale.dtype.is_floating_point and shape_ok and bool((torch.isfinite(scale) & (scale > 0)).all())):
        want = f"[2, {kv_heads}]" if kv_heads is not None else "[2, KV heads]"
        raise CheckpointError(f"{path}: {name} is {str(scale.dtype).removeprefix('torch.')} {list(scale.shape)}, "
                              f"where kv8's fp8 KV scales are {want} positive floats (keys', values' per KV head); "
                              f"the checkpoint is damaged or its {MANIFEST} another's: re-run `hibana surgery`")
