"""Hugging Face checkpoint directory -> model modules, tokenizer and a fingerprint.

A checkpoint is config.json, one or many *.safetensors (with model.safetensors.index.json when
sharded), tokenizer files and optionally generation_config.json. It is named by its directory,
"demo", or a Hugging Face repo id that `hub.py` finds in the local cache or downloads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from hibana_core import hub
from hibana_core.errors import CheckpointError, ConfigError, HibanaError, MemoryBudgetError, UnsupportedModelError
from hibana_core.forward_context import ForwardContext
from hibana_core.kv.budget import device_memory
from hibana_core.models.decoder import rotary_bytes, rotary_positions, size_rotary
from hibana_core.models.moe import PACKED_PARTS, STACKS
from hibana_core.progress import LoadProgress, bar as progress_bar
from hibana_core.surgery.checkpoint import (MANIFEST, check_kv_scale, check_kv_scaled_layers, check_packed,
                                           check_packed_experts, read_manifest)
from hibana_plugins.manager import describe_registered, get_plugin_manager

DEMO_MODEL_DIR = Path(__file__).parent / "demo" / "model"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    args: Any                 # the family's args: num_layers, num_kv_heads, head_dim, vocab_size, ...
    hf_config: Any
    tokenizer: Any | None     # a transformers tokenizer, or None when the checkpoint has none
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    weight_bytes: int
    fingerprint: str          # sha256 of config, tokenizer, weight layout and values: guards state files
    surgery: list = field(default_factory=list)  # passes a surgery checkpoint was written with


@dataclass(frozen=True)
class ConvertedTensor:
    """Where a checkpoint tensor goes when no view of a parameter can take it as it is (a
    family's `checkpoint_tensors` may name one): `load(tensor)` writes it there (transposed,
    rows reordered), once its shape is checked against `shape`, the checkpoint's."""

    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]


FAMILY_QUANT_METHODS = ("mxfp4",)
"""quantization_config methods a family loads itself: its modules take the packed tensors as
they are (gpt-oss's MXFP4 experts: blocks and scales)."""


def resolve_checkpoint(model: str, progress: bool = False) -> Path:
    """The checkpoint directory `model` names: "demo" (the bundled model), a directory, or a
    Hugging Face repo id ("org/name" or "org/name@revision"), found in the local Hugging Face
    cache or downloaded into it (`hibana_core.hub`; `progress`: the download's bars)."""
    if not model.strip():  # Path("") is the working directory: whatever checkpoint happens to be there
        raise CheckpointError(f"the model name is empty ({model!r}); pass a Hugging Face repo id such as "
                              "Qwen/Qwen3-8B, a checkpoint directory (\".\" for the working one) or \"demo\"")
    path = DEMO_MODEL_DIR if model == "demo" else Path(model).expanduser()
    if path.is_dir():
        hub.check_not_cache_folder(path)
        return path
    if path.exists():
        raise CheckpointError(f"{str(path)!r} is a file, not a checkpoint directory; pass the directory that "
                              f"holds it{f' ({str(path.parent)!r})' if (path.parent / 'config.json').is_file() else ''}")
    repo = hub.parse_repo_id(model) if model != "demo" else None
    if repo is not None:
        return hub.snapshot(repo, progress)
    hint = " (the bundled demo model is missing from this install)" if model == "demo" else ""
    raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist{hint}; pass the path "
                          "of a Hugging Face checkpoint directory (config.json + *.safetensors), "
                          "or a Hugging Face repo id such as Qwen/Qwen3-8B")


def resolve_dtype(dtype: str, device: torch.device, hf_config: Any) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    declared = declared_dtype(hf_config)
    return declared if declared not in (None, torch.float32) else torch.bfloat16


def declared_dtype(hf_config: Any) -> torch.dtype | None:
    """The dtype config.json declares (`dtype`, transformers 4's `torch_dtype`), where it is one
    Hibana computes in; else None."""
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared)
    return declared if declared in _DTYPES.values() else None


def read_model_type(path: Path) -> str:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        config = hub.read_json_object(config_file)
    except ValueError as exc:
        raise CheckpointError(f"{config_file} is not a valid model config ({exc}); "
                              "re-export the checkpoint with save_pretrained") from exc
    quantization = config.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise CheckpointError(f"{config_file}'s quantization_config is a JSON {type(quantization).__name__}, not an "
                              "object naming its quant_method (gptq, awq, fp8, compressed-tensors); re-export the "
                              "checkpoint, or remove the field if its weights are not quantized")
    if "model_type" not in config:
        raise CheckpointError(f"{config_file} has no model_type, which names the architecture (\"llama\", "
                              "\"qwen3\", ...); re-export the checkpoint with save_pretrained")
    model_type = config["model_type"]
    if model_type is not None and not isinstance(model_type, (str, int, float)):
        raise UnsupportedModelError(f"{config_file}'s model_type is {model_type!r:.80}, not the name of an "
                                    "architecture; it should be a string such as \"llama\"")
    return model_type


def read_config(path: Path, model_type: str) -> Any:
    """The checkpoint's transformers config: its own class where transformers knows the
    model_type, else (a plugin's family for a model transformers does not know) a plain
    PretrainedConfig holding config.json's fields as attributes, for the family's build to read."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        if model_type not in CONFIG_MAPPING:  # (from_pretrained would warn that the types differ)
            return PretrainedConfig.from_dict(PretrainedConfig.get_config_dict(path)[0])
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a bad config
        raise CheckpointError(f"cannot read {path / 'config.json'}: {exc}") from exc


LOAD_STAGES = ("resolve", "config", "weights", "tokenizer")
"""The stages of `load_model`, as `LoadProgress` names them."""


def context_limit(args: Any) -> int:
    """The most positions the model serves: max_position_embeddings, or further where a YaRN rope
    stretches its original_max_position_embeddings by its factor (Qwen's long-context recipe adds
    one to config.json and leaves max_position_embeddings as it was; vLLM derives its context
    alike, and transformers rotates every position the same way below it and past it). Not where a
    layer's rope is LongRoPE or dynamic NTK (Gemma 3 and OLMo 3 give each layer kind its own):
    LongRoPE's tables hold the long rotation's rows past max_position_embeddings, and past it
    transformers rescales a dynamic rope by the length of each forward, which its cache keeps
    rotated as it was and no paged cache reproduces."""
    limit = args.max_position_embeddings
    ropes = getattr(args, "ropes", None) or ()
    if any(getattr(rope, "rope_type", None) in ("longrope", "dynamic") for rope in ropes):
        return limit
    for rope in dict.fromkeys(ropes):
        if getattr(rope, "rope_type", None) == "yarn":
            scaling = dict(rope.scaling)
            limit = max(limit, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return limit


def check_max_model_len(asked: int | None, args: Any) -> None:
    """A ConfigError where `asked` is more positions than the model has (`context_limit`)."""
    limit = context_limit(args)
    if asked is not None and asked > limit:
        what = ("max_position_embeddings" if limit == args.max_position_embeddings
                else "its YaRN rope's original_max_position_embeddings x factor")
        raise ConfigError(f"max_model_len={asked} is more than this model's context of {limit} positions "
                          f"({what}); give at most that, or leave it out")


def load_model(model: str, device: torch.device, dtype: str, ctx: ForwardContext,
               progress: bool = True, stages: LoadProgress | None = None,
               max_model_len: int | None = None) -> LoadedModel:
    """`stages`: times (and shows) the LOAD_STAGES; without it, they run untimed. `max_model_len`
    is checked against the model's context before its weights load."""
    stages = stages or LoadProgress(model, LOAD_STAGES, enabled=False)
    with stages.stage("resolve"):
        path = resolve_checkpoint(model, progress)
    with stages.stage("config"):
        model_type = read_model_type(path)
        family = family_of(model_type)
        hf_config = read_config(path, model_type)
        torch_dtype = resolve_dtype(dtype, device, hf_config)
        quantization = getattr(hf_config, "quantization_config", None)
        if quantization is not None and not isinstance(quantization, dict):
            quantization = quantization.to_dict()
        manifest = read_manifest(path)
        # packed layers (a surgery checkpoint's, GPTQ / AWQ / FP8 ones) take their packed tensors
        # before the rest is allocated: never the whole model dense on the device first
        packed = manifest is not None or (quantization is not None
                                          and quantization.get("quant_method") not in FAMILY_QUANT_METHODS)
        module, args = _build(model_type, family, hf_config, device, torch_dtype, ctx, allocate=not packed)
        check_max_model_len(max_model_len, args)
    with stages.stage("weights"):
        _load_weights(module, path, progress, manifest, quantization, device)
    with stages.stage("tokenizer"):
        loaded = _loaded(module, args, hf_config, load_tokenizer(path, hf_config), _eos_token_ids(path, hf_config),
                         torch_dtype, _checkpoint_fingerprint(path, manifest, torch_dtype))
    loaded.surgery = list(manifest["passes"]) if manifest else []
    return loaded


def load_from_hf_model(hf_model: torch.nn.Module, device: torch.device, dtype: str,
                       ctx: ForwardContext, tokenizer: Any | None = None) -> LoadedModel:
    """Our model with the weights of an in-memory transformers model, or of anything with its
    `config`, `generation_config` and a `state_dict()` mapping names to tensors: the benchmarks'
    random presets make each weight on the device when it is read, so no second copy exists."""
    hf_config = hf_model.config
    family = family_of(hf_config.model_type)
    torch_dtype = resolve_dtype(dtype, device, hf_config)
    module, args = _build(hf_config.model_type, family, hf_config, device, torch_dtype, ctx)
    state = hf_model.state_dict()
    source = f"the in-memory {type(hf_model).__name__}"
    _copy_weights(module, ((name, source, lambda name=name: state[name]) for name in state), len(state),
                  source, progress=False)
    # what the model's own `generate` stops at: its generation config's EOS (none there: none), a
    # stand-in without a generation config its config's (as transformers would make one from it)
    generation_config = getattr(hf_model, "generation_config", None)
    eos = _config_eos(hf_config) if generation_config is None else getattr(generation_config, "eos_token_id", None)
    if generation_config is not None:
        _warn_greedy_options(f"{source}'s generation config",
                             {name: getattr(generation_config, name, None) for name in GREEDY_OPTIONS})
    digest = hashlib.sha256(hf_config.to_json_string().encode()).hexdigest()
    return _loaded(module, args, hf_config, quiet_length_warning(tokenizer), _as_ids(eos) or (), torch_dtype,
                   f"in-memory:{digest}:{id(hf_model)}")


def family_of(model_type: str) -> Any:
    families = get_plugin_manager().model_families()
    if model_type not in families:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(families))} (a plugin can add one through register_model_families)")
    return families[model_type]


def _build(model_type: str, family: Any, hf_config: Any, device: torch.device, dtype: torch.dtype,
           ctx: ForwardContext, allocate: bool = True) -> tuple[torch.nn.Module, Any]:
    """The family's module in `dtype` on `device`; `allocate=False` leaves its tensors on the meta
    device (tied), for `_allocate` once the packed layers have dropped their dense weights."""
    module, args = _built_on_meta(model_type, family, hf_config, ctx)
    module = keep_float32(module.to(dtype=dtype), dtype)
    if not allocate:
        if hasattr(module, "tie_weights"):
            module.tie_weights()
        return module, args
    _check_room(module, device)
    module = module.to_empty(device=device)
    if hasattr(module, "tie_weights"):
        module.tie_weights()  # to_empty gives each twin its own storage
    return module, args


def keep_float32(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`module` with the parameters its submodules name in `float32_parameters` back in float32
    after a cast to the model's dtype (a router transformers keeps in float32: GLM-4.5's,
    `_keep_in_fp32_modules_strict`), and, where that dtype is float16, those they name in
    `float32_parameters_under_float16` too (transformers' `_keep_in_fp32_modules`, which it keeps
    in float32 under float16 alone: gpt-oss's norms)."""
    for sub in module.modules():
        names = tuple(getattr(sub, "float32_parameters", ()))
        if dtype == torch.float16:
            names += tuple(getattr(sub, "float32_parameters_under_float16", ()))
        for name in names:
            param = getattr(sub, name)
            if param is not None and param.dtype != torch.float32:
                param.data = param.data.to(torch.float32)
    return module


def _check_room(module: torch.nn.Module, device: torch.device) -> None:
    """A MemoryBudgetError where the tensors still on the meta device take more bytes than the
    device has in all (torch's allocator said so in a traceback, or the OS killed the process)."""
    tensors = {id(t): t for sub in module.modules() for table in (sub._parameters, sub._buffers)
               for t in table.values() if t is not None and t.is_meta}
    need, total = sum(t.numel() * t.element_size() for t in tensors.values()), device_memory(device).total
    if need > total:
        dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
        hint = (", or load it in bfloat16 (dtype='bfloat16', `--dtype bfloat16`: on the CPU 'auto' is float32, twice "
                "a bfloat16 checkpoint's bytes)" if torch.float32 in dtypes else "")
        raise MemoryBudgetError(f"the model's weights take {need:,} bytes, more than the {total:,} bytes of memory "
                                f"{device} has; pick a smaller model or a quantized checkpoint{hint}")


def _allocate(module: torch.nn.Module, device: torch.device) -> None:
    """Give each parameter and buffer still on the meta device uninitialized storage on `device`
    (a tied parameter stays one), leaving those already there (packed layers') as they are."""
    _check_room(module, device)
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = (torch.nn.Parameter(empty, requires_grad=t.requires_grad)
                                   if isinstance(t, torch.nn.Parameter) else empty)
                table[name] = made[id(t)]


FAMILY_ARGS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings")
"""What the engine reads of a family's args (positive integers): the KV cache's layout and the limits."""


def _built_on_meta(model_type: str, family: Any, hf_config: Any, ctx: ForwardContext) -> tuple[torch.nn.Module, Any]:
    """`family.build(hf_config, ctx)` on the meta device (no memory, and no random init for weights
    about to be loaded), checked: what a plugin's build raises but a HibanaError, or a result of
    another shape, is a ConfigError that names the family and its plugin."""
    described = f"model family {model_type!r} ({describe_registered(family)})"
    if not callable(getattr(family, "build", None)):
        raise ConfigError(f"{described} has no build(hf_config, ctx) method; fix its plugin: register an "
                          "object or module with build")
    try:
        with torch.device("meta"), _no_init():
            built = family.build(hf_config, ctx)
    except HibanaError:
        raise
    except Exception as exc:
        raise ConfigError(f"{described} failed in build: {exc!r}; the checkpoint's config.json may lack what "
                          "the family reads, else fix its plugin or report it to its author") from exc
    shape = (" must return (model, args): an nn.Module with compute_logits(hidden), and args with "
             f"{', '.join(FAMILY_ARGS)} (positive integers); fix its plugin")
    if not isinstance(built, tuple) or len(built) != 2:
        raise ConfigError(f"{described} returned {_shown(built)} from build, which{shape}")
    module, args = built
    if not isinstance(module, torch.nn.Module) or not callable(getattr(module, "compute_logits", None)):
        raise ConfigError(f"{described} returned {_shown(module)} as the model from build, which{shape}")
    bad = [name for name in FAMILY_ARGS if not _positive_int(getattr(args, name, None))]
    if bad:
        raise ConfigError(f"{described} returned args whose {', '.join(bad)} "
                          f"{'is' if len(bad) == 1 else 'are'} missing or no positive integer "
                          f"({_shown(args)}) from build, which{shape}")
    return module, args


def _shown(value: Any) -> str:
    """A value in an error message: its type, and its repr cut short."""
    return f"{type(value).__name__} {value!r:.80}"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's functions as no-ops while a model is built on the meta device, whose
    values `to_empty` discards anyway: a meta tensor's normal_ goes through torch's reference
    implementations, whose first call imports torch._dynamo (1.8 s of a 7.8 s cold start of
    `hibana demo` on a 2-core CPU). As transformers' `no_init_weights`, this patches the module
    for the build's duration (milliseconds), for every thread."""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in _INIT_FUNCTIONS if hasattr(init, name)}
    for name in saved:
        setattr(init, name, _keep)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _loaded(module: torch.nn.Module, args: Any, hf_config: Any, tokenizer: Any | None,
            eos: tuple[int, ...], dtype: torch.dtype, fingerprint: str) -> LoadedModel:
    module.eval().requires_grad_(False)
    outside = [i for i in eos if i >= args.vocab_size]
    if outside:  # the model never generates them, as in transformers' generate; a grammar could not name them
        warnings.warn(f"eos_token_id {outside} lies outside the model's vocabulary of {args.vocab_size} tokens (the "
                      "generation config or config.json names a token the model cannot generate); left out of the "
                      "tokens generation stops at")
        eos = tuple(i for i in eos if i < args.vocab_size)
    return LoadedModel(module, args, hf_config, tokenizer, eos, dtype, model_bytes(module), fingerprint)


def model_bytes(module: torch.nn.Module) -> int:
    """Bytes the model holds on its device: parameters (tied ones once) and buffers (packed
    weights and their scales are buffers)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def planned_model(model: str, dtype: torch.dtype, max_model_len: int | None = None) -> tuple[int, Any]:
    """(bytes its weights take loaded in `dtype`, with the rotary tables it builds at `max_model_len`
    positions, as `size_rotary` sizes them (None: at its max_position_embeddings); its
    DecoderArgs), from its config alone: the module built on the meta device as `load_model`
    builds it, no weight read. A quantized checkpoint's weights count dense: at most what they take."""
    path = resolve_checkpoint(model)
    model_type = read_model_type(path)
    family = family_of(model_type)
    module, args = _built_on_meta(model_type, family, read_config(path, model_type), ForwardContext())
    positions = min(max_model_len or args.max_position_embeddings, args.max_position_embeddings)
    size_rotary(module, rotary_positions(positions, args))  # (not a 1M-token config's ~1 GB of tables)
    return model_bytes(keep_float32(module.to(dtype=dtype), dtype)) + rotary_bytes(module), args


def weight_files(path: Path) -> list[Path]:
    """The safetensors files a checkpoint directory's weights are read from, or a CheckpointError
    saying what is missing."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = hub.index_shards(index)
        except ValueError as exc:
            raise CheckpointError(f"{index} is damaged ({exc}); re-download or re-export the checkpoint") from exc
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing weight shards {missing}; the download is incomplete")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():  # as transformers reads one: never a consolidated.* or adapter_*
        return [path / "model.safetensors"]  # beside it (Mistral's repos ship both)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights; only safetensors checkpoints are "
                              "supported (convert .bin files with transformers' save_pretrained)")
    return files


def _load_weights(module: torch.nn.Module, path: Path, progress: bool, manifest: dict | None,
                  quantization: dict | None, device: torch.device) -> None:
    """Copy the checkpoint's tensors into `module`. A surgery checkpoint (`manifest`) names them
    as the module does, its packed layers take their packed tensors as they are and its kv8
    layers their KV scales; a GPTQ or AWQ checkpoint (`quantization`: its quantization_config)
    has its packed layers repacked, an FP8 one keeps its fp8 layers' codes and scales. `device`:
    where a module left on the meta device (`_build(allocate=False)`) is allocated once its packed
    layers have theirs."""
    from safetensors import safe_open

    files = weight_files(path)
    try:
        handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    except Exception as exc:
        raise CheckpointError(f"cannot open the weights in {path}: {exc}; the file is truncated or "
                              "damaged, re-download it") from exc

    def read(file: Path, handle: Any, name: str) -> torch.Tensor:
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name} from {file}: {exc}; "
                                  "the file is damaged, re-download it") from exc

    where = {name: (file, handle) for file, handle in zip(files, handles) for name in handle.keys()}
    readers: dict[str, Callable[[], torch.Tensor]] = {}  # names read otherwise than as stored
    own_names = manifest is not None
    if own_names:
        layers = dict(module.named_modules())
        for name, spec in manifest.get("packed_layers", {}).items():
            layer = layers.get(name)
            if layer is None or not hasattr(layer, "set_packed"):
                raise CheckpointError(f"{path}: packed layer {name} is not a linear layer of this model")
            parts = ("qweight", "scales", "zeros") if spec["kind"] == "int4" else ("qweight", "scales")
            if spec["kind"] == "fp8" and len(spec.get("block") or ()) != 2:
                raise CheckpointError(f"{path}: fp8 layer {name} has no scale block in {MANIFEST}; re-run `hibana surgery`")
            missing = [f"{name}.{p}" for p in parts if f"{name}.{p}" not in where]
            if missing:
                raise CheckpointError(f"{path} lacks {', '.join(missing)}; re-run `hibana surgery`")
            perm = where.pop(f"{name}.perm", None)  # a GPTQ layer quantized in activation order
            tensors = {p: read(*where[f"{name}.{p}"], f"{name}.{p}") for p in parts}
            perm = None if perm is None else read(*perm, f"{name}.perm")
            check_packed(path, name, spec, tensors, tuple(layer.weight.shape), perm)
            layer.set_packed(spec["kind"], {p: t.to(device) for p, t in tensors.items()}, spec.get("group_size", 0),
                             None if perm is None else perm.to(device),
                             tuple(spec["block"]) if spec["kind"] == "fp8" else None)
            for p in parts:
                del where[f"{name}.{p}"]
        for name, kind in manifest.get("packed_experts", {}).items():  # w8's / w4's MoE experts
            _load_packed_experts(layers.get(name), name, kind, where, read, path, device)
        for name in manifest.get("kv_scaled_layers", []):  # kv8: the layers' fp8 KV scales
            layer, tensor = layers.get(name), f"{name}.kv_scale"
            if layer is None or not hasattr(layer, "set_kv_scales") or tensor not in where:
                raise CheckpointError(f"{path}: {name} is no attention layer with KV scales in its weights; "
                                      "re-run `hibana surgery`")
            scale = read(*where.pop(tensor), tensor)
            check_kv_scale(path, tensor, scale, getattr(layer, "num_kv_heads", None))
            layer.set_kv_scales(scale.to(device))
        check_kv_scaled_layers(path, manifest, [name for name, m in layers.items() if hasattr(m, "set_kv_scales")])
        for name, (window, sinks) in _windowed_layers(manifest, path).items():  # the window pass's layers
            layer = layers.get(name)
            if layer is None or not hasattr(layer, "sink_tokens"):
                raise CheckpointError(f"{path}: {name} is no attention layer; re-run `hibana surgery`")
            layer.sliding_window, layer.sink_tokens, layer.surgery_window = window, sinks, (window, sinks)
    if quantization is None and not own_names:
        _refuse_packed_without_config(path, where)
    if quantization is not None and not own_names and quantization.get("quant_method") not in FAMILY_QUANT_METHODS:
        # GPTQ / AWQ / FP8: packed layers as they are
        from hibana_core.surgery.prequantized import fp8_expert_readers, load_packed_layers, parse_quantization_config

        # found by the module's names, as the weight copy renames them (`checkpoint_name`: a
        # multimodal checkpoint's language_model.model.* is model.*); the readers read lazily
        rename = getattr(module, "checkpoint_name", None) or (lambda name: name)
        stored = {rename(name): (name, *at) for name, at in where.items()}  # ours -> (theirs, file, handle)

        def read_ours(name: str) -> torch.Tensor:
            theirs, file, handle = stored[name]
            return read(file, handle, theirs)

        fmt = parse_quantization_config(quantization)
        consumed = load_packed_layers(module, set(stored), read_ours, fmt, getattr(module, "fused_layers", {}),
                                      str(path), device, progress, lambda name: stored[name][0])
        if fmt.kind == "fp8":  # fp8 MoE experts: dequantized into the float stacks
            expert_readers, beside = fp8_expert_readers(module, set(stored) - consumed, read_ours, fmt, str(path))
            readers = {stored[name][0]: reader for name, reader in expert_readers.items()}
            consumed |= beside
        for name in consumed:
            del where[stored[name][0]]
    _allocate(module, device)  # what the packed layers left (a no-op where `_build` allocated it all)
    items = ((name, str(file), readers.get(name) or (lambda f=file, h=handle, n=name: read(f, h, n)))
             for name, (file, handle) in where.items())
    _copy_weights(module, items, len(where), str(path), progress, desc="hibana: weights", own_names=own_names)


_PACKED_SUFFIXES = (".qweight", ".weight_packed")
"""The packed tensors of GPTQ / AWQ (`qweight`) and compressed-tensors (`weight_packed`) layers."""


def _windowed_layers(manifest: dict, path: Path) -> dict[str, tuple[int, int]]:
    """The manifest's window-pass layers, name -> (window, sink tokens): a CheckpointError for
    anything else (a hand-edited manifest must not load another model than it says)."""
    entries = manifest.get("windowed_layers", {})

    def whole(value: Any, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    if not isinstance(entries, dict) or not all(
            isinstance(v, (list, tuple)) and len(v) == 2 and whole(v[0], 1) and whole(v[1], 0) for v in entries.values()):
        raise CheckpointError(f"{path}: windowed_layers in {MANIFEST} is not a mapping of layer names to [window >= 1, "
                              f"sink tokens >= 0]; re-run `hibana surgery`")
    return {name: (v[0], v[1]) for name, v in entries.items()}


def _refuse_packed_without_config(path: Path, names) -> None:
    """Packed int4 layers without a quantization_config would be reported as missing weights;
    say what is missing instead (older AutoGPTQ / AutoAWQ checkpoints keep the config in a file
    of their own, which transformers does not read either)."""
    packed = sorted(n for n in names if n.endswith(_PACKED_SUFFIXES))
    if not packed:
        return
    beside = [f for f in ("quantize_config.json", "quant_config.json") if (path / f).is_file()]
    hint = (f"; its {beside[0]} holds that config: write it into config.json as \"quantization_config\" in "
            "transformers' terms (quant_method \"gptq\" or \"awq\", bits, group_size, ...)" if beside else "")
    if not beside and any(n.endswith(".qweight") and f"{n.removesuffix('.qweight')}.qzeros" not in names
                          for n in packed):
        # Hibana's own layout (int4 zeros or int8 codes, no GPTQ / AWQ qzeros): a `hibana surgery` output
        hint = (f"; its layout is that of a checkpoint written by `hibana surgery`, whose manifest ({MANIFEST}) says "
                "how its layers are packed and is not there: copy it back beside the weights, or run "
                "`hibana surgery` on the source again")
    raise CheckpointError(f"{path} holds packed quantized layers ({packed[0]}, {len(packed)} in all) but its "
                          f"config.json has no quantization_config saying how they are packed{hint}")


def _load_packed_experts(experts: torch.nn.Module | None, name: str, kind: str, where: dict[str, Any],
                         read: Callable[..., torch.Tensor], path: Path, device: torch.device) -> None:
    """A surgery checkpoint's packed experts `name`: their tensors (taken out of `where`) in
    place of the float stacks."""
    if experts is None or not hasattr(experts, "set_packed_stacks") or kind not in PACKED_PARTS:
        raise CheckpointError(f"{path}: packed experts {name} ({kind}) are no MoE experts of this model")
    tensors = {stack: {part: f"{name}.{stack}_{part}" for part in PACKED_PARTS[kind]} for stack in STACKS}
    missing = [t for parts in tensors.values() for t in parts.values() if t not in where]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; re-run `hibana surgery`")
    packed = {stack: {part: read(*where.pop(t), t) for part, t in parts.items()} for stack, parts in tensors.items()}
    check_packed_experts(path, name, kind, packed, {stack: tuple(getattr(experts, stack).shape) for stack in STACKS})
    experts.set_packed_stacks(kind, {stack: {part: t.to(device) for part, t in parts.items()}
                                     for stack, parts in packed.items()})


def _copy_weights(module: torch.nn.Module, items, total: int, source: str, progress: bool,
                  desc: str = "copying weights", own_names: bool = False) -> None:
    """The one weight-copy path (checkpoints and in-memory models): `items` yields (name, where,
    read) for each source tensor; every tensor the model needs must come, with its shape.
    `own_names`: the source names tensors as the module does (a surgery checkpoint), not as
    Hugging Face checkpoints do; otherwise a family may spell a checkpoint's names its own way
    first (`checkpoint_name`: e.g. the language model inside a multimodal checkpoint)."""
    rename = getattr(module, "checkpoint_name", None) if not own_names else None
    if rename is not None:
        items = [(rename(name), where, read) for name, where, read in items]
    if hasattr(module, "checkpoint_tensors") and not own_names:  # a family with fused or renamed parameters
        items = list(items)
        params = module.checkpoint_tensors({name for name, _, _ in items})
    else:
        params = dict(module.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unused: list[str] = []    # tensors of the checkpoint that no parameter takes
    packed: set[str] = set()  # layers the checkpoint stores packed that nothing took
    tied = set(getattr(module, "tied_weight_names", ()))
    stored_twins: dict[str, tuple[torch.Tensor, str]] = {}  # tied names the checkpoint stores too
    with progress_bar(total=total, desc=desc, unit="tensor", disable=not progress, leave=False) as bar:
        for name, where, read in items:
            bar.update()
            if name.endswith(_PACKED_SUFFIXES):
                packed.add(name.rpartition(".")[0])
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name not in params:
                unused.append(name)
                continue
            tensor, target = read(), params[name]
            if name in tied:  # its twin's storage: compared once both are read, not copied over it
                stored_twins[name] = (tensor, where)
                continue
            if tensor.dtype.is_floating_point and tensor.element_size() == 1:  # a copy would drop its scale
                raise CheckpointError(f"{name} in {where} is {tensor.dtype} without a weight scale Hibana "
                                      "applies; FP8 checkpoints need their quantization_config (quant_method "
                                      "'fp8' or 'compressed-tensors') and a scale for every fp8 weight")
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{name} in {where} has shape {tuple(tensor.shape)}, the config "
                                      f"implies {tuple(target.shape)}; config and weights disagree")
            if isinstance(target, ConvertedTensor):
                target.load(tensor)
            else:
                if target.dtype.is_floating_point and not tensor.dtype.is_floating_point:  # a copy would cast it
                    raise CheckpointError(f"{name} in {where} is {tensor.dtype}, where a floating-point weight "
                                          "belongs (a quantized checkpoint needs its quantization_config); "
                                          "the checkpoint is corrupt or its config is missing that section")
                target.data.copy_(tensor)
            loaded.add(name)
    for name, (tensor, where) in stored_twins.items():
        target = params[name]
        sources = [n for n, p in params.items() if n not in tied and isinstance(p, torch.Tensor)
                   and p.data_ptr() == target.data_ptr()]
        if sources and not loaded.intersection(sources) and tuple(tensor.shape) == tuple(target.shape) \
                and tensor.dtype.is_floating_point:
            target.data.copy_(tensor)  # the shared matrix stored under the twin's name alone: transformers loads it so
            loaded.update(sources)
            continue
        if tuple(tensor.shape) != tuple(target.shape) or not torch.equal(tensor.to(target.dtype), target.data):
            raise CheckpointError(f"config.json ties {name} to the input embedding (tie_word_embeddings), and {where} "
                                  f"stores {name} with other values; transformers uses the stored one: set "
                                  "\"tie_word_embeddings\": false in config.json, or drop the stored tensor")
    expected = set(params)
    if tied:
        expected -= tied  # filled by their twin
    missing = sorted(expected - loaded)
    unpackable = [m for m in missing if m.removesuffix(".weight") in packed]
    if unpackable:
        layer = unpackable[0].removesuffix(".weight")
        try:
            takes_packed = hasattr(module.get_submodule(layer), "kind")  # a Linear that dispatches on its kind
        except AttributeError:
            takes_packed = False
        if takes_packed:  # packed where nothing said so: a surgery manifest or quantization_config that lost it
            raise CheckpointError(f"{source} stores {layer} packed (quantized; {len(unpackable)} layers in all), "
                                  "and neither its surgery manifest (hibana_surgery.json) nor config.json's "
                                  "quantization_config names it packed: the manifest or the config is damaged or "
                                  "another checkpoint's; write the checkpoint again (hibana surgery)")
        # e.g. a MoE router quantized: its qweight is there, its weight is not
        raise CheckpointError(f"{source} stores {unpackable[0].removesuffix('.weight')} packed (quantized), which "
                              "Hibana loads into linear layers of its decoder only, and this layer is none (a MoE "
                              "router, an embedding); a checkpoint that leaves it unquantized loads")
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        tie = ("; if its output head is the input embedding, config.json needs \"tie_word_embeddings\": true "
               "(transformers would start the head from random values)" if missing == ["lm_head.weight"] else "")
        raise CheckpointError(f"{source} lacks weights {shown}; the checkpoint is incomplete or for "
                              f"another architecture{tie}")
    other_parts = tuple(getattr(module, "checkpoint_other_parts", ()))  # left out on purpose
    _report_unused(source, [name for name in unused if not name.startswith(other_parts)])
    _check_finite(module, source)


_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_finite(module: torch.nn.Module, source: str) -> None:
    """A CheckpointError where a loaded weight holds NaN or infinity (a damaged file, or values
    past float16's range loaded in float16): such a model runs, and answers every prompt with
    the same token. One min and max a tensor on its device, read back once for all of them."""
    named = {}  # the parameters and persistent buffers (packed weights' scales), tied ones once
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor is not None and tensor.dtype in _CHECKED_DTYPES and tensor.numel() and id(tensor) not in named:
            named[id(tensor)] = (name, tensor)
    if not named:
        return
    with torch.no_grad():
        ends = torch.stack([torch.stack(torch.aminmax(t.detach())).float() for _, t in named.values()])
        finite = torch.isfinite(ends).all(dim=1).tolist()  # one read back
    bad = [name_tensor for name_tensor, ok in zip(named.values(), finite) if not ok]
    if not bad:
        return
    name, tensor = bad[0]
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    held = " and ".join(f"{count:,} {what}" for count, what in ((nan, "NaN"), (inf, "infinite")) if count)
    others = f" (and {len(bad) - 1} more tensor{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
    fix = "the checkpoint is damaged: re-download or re-export it"
    if tensor.dtype == torch.float16 and not nan:  # a bfloat16 or float32 checkpoint's large values cast to float16
        fix = ("values past float16's range (+-65504) become infinite: load it with dtype='bfloat16' or 'float32', "
               f"or, if the checkpoint holds them itself, {fix}")
    raise CheckpointError(f"{name} of {source} holds {held} value{'s' if nan + inf > 1 else ''} "
                          f"once loaded ({tensor.dtype}){others}; {fix}")


def _report_unused(source: str, unused: list[str]) -> None:
    """Tensors of a checkpoint that no parameter took (a family's deliberately unread parts, such as
    a multimodal checkpoint's other towers, left out before), reported as transformers reports
    unexpected keys: loaded, said."""
    if not unused:
        return
    shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
    warnings.warn(f"{source} holds {len(unused)} tensor{'s' if len(unused) > 1 else ''} this model does not use "
                  f"({shown}), left out as transformers leaves unexpected keys out; config.json and the weights "
                  "may disagree (more layers than its num_hidden_layers, biases it does not have, another "
                  "model's weights)", stacklevel=3)


def load_tokenizer(path: Path, hf_config: Any | None = None) -> Any | None:
    """The checkpoint's tokenizer; None where it has no tokenizer files (a model alone).
    `hf_config`: the checkpoint's config (`read_config`), which transformers would otherwise read
    again, and for a model_type it does not know (a plugin's family) read with a warning that the
    types differ."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **({"config": hf_config} if hf_config is not None else {}))
    except Exception as exc:
        raise CheckpointError(f"cannot load the tokenizer in {path}: {exc}; re-download or re-save its tokenizer "
                              "files (tokenizer.save_pretrained), or remove them to load for token ids alone") from exc
    return quiet_length_warning(tokenizer)


def quiet_length_warning(tokenizer: Any) -> Any:
    """`tokenizer`, told that it has warned already: transformers warns once that a text longer than
    model_max_length "will result in indexing errors", while the engine measures contexts itself
    (a ContextLengthError says so) and cuts nothing, and the guard cuts its texts into documents."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def _eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    """The tokens transformers' `generate` stops at for this checkpoint: generation_config.json's
    eos_token_id where that file reads (none named there: none at all, as `generate` then has
    none), else config.json's (no such file, or not JSON: transformers then makes its generation
    config from config.json). Where transformers cannot load or generate at all (the file JSON of
    another shape, its eos_token_id no token ids), a warning, and config.json's."""
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            generation = hub.read_json_object(gen_file)
        except ValueError as exc:
            warnings.warn(f"{gen_file} is damaged ({exc}); using config.json's eos_token_id")
        else:
            _warn_greedy_options(str(gen_file), generation)
            eos = generation.get("eos_token_id")
            ids = _as_ids(eos)
            if ids == () and _as_ids(_config_eos(hf_config)):
                warnings.warn(f"{gen_file} names no eos_token_id: generation does not stop at config.json's "
                              f"({_config_eos(hf_config)!r:.60}), as transformers' generate does not; add "
                              "eos_token_id to it to stop there, or pass stop_token_ids")
            if ids is not None:
                return ids
            warnings.warn(f"{gen_file} has eos_token_id {eos!r:.60}, no token id or list of them; using config.json's")
    config_eos = _config_eos(hf_config)
    ids = _as_ids(config_eos)
    if ids is None:
        raise CheckpointError(f"{path / 'config.json'} has eos_token_id {config_eos!r:.60}, no token id or list of "
                              "them; fix it (the tokenizer's end-of-text token id, as an integer)")
    return ids


GREEDY_OPTIONS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None,
                  "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                  "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None}
"""A generation config's options that transformers' `generate` applies to greedy output too, each with
the value that changes nothing. A request applies its own options only (greedy unless it asks)."""


def _warn_greedy_options(where: str, generation: dict[str, Any]) -> None:
    """A warning where a generation config sets `GREEDY_OPTIONS` (Qwen2.5's repetition_penalty 1.05):
    greedy output then equals `generate`'s without them, not `generate`'s on the checkpoint as it is."""
    given = {name: generation.get(name) for name in GREEDY_OPTIONS}
    named = {name: value for name, value in given.items() if value not in (None, GREEDY_OPTIONS[name], [], {})}
    if not named:
        return
    penalty = named.get("repetition_penalty")
    warnings.warn(f"{where} sets {', '.join(f'{name}={value!r:.40}' for name, value in named.items())}, which "
                  "transformers' generate applies to greedy output too; a request applies only the options it "
                  "gives, so greedy output is generate's without them"
                  + (f" (SamplingParams(repetition_penalty={penalty!r}) applies generate's penalty)"
                     if penalty is not None else ""))


def _as_ids(eos: Any) -> tuple[int, ...] | None:
    """Token ids as a tuple (empty: None given), or None where `eos` holds something else."""
    if eos is None:
        return ()
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return None
    return tuple(ids)


def _config_eos(hf_config: Any) -> Any:
    """The config's eos_token_id where transformers' generation config takes it from
    (`GenerationConfig.from_model_config`): the config's own, else its text (decoder) config's,
    which a multimodal one (Gemma 3's) holds apart from its own fields."""
    own = getattr(hf_config, "eos_token_id", None)
    return own if own is not None else getattr(hf_config.get_text_config(decoder=True), "eos_token_id", None)


FINGERPRINT_SAMPLES = 64  # runs of bytes a larger tensor's values are sampled at, at most
FINGERPRINT_FILE_SAMPLES = 8192  # runs a weight file at most (per-expert MoE files hold ~10^4 tensors)
FINGERPRINT_RUN = 64  # bytes a run


SLOW_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                        "added_tokens.json", "special_tokens_map.json")
"""What a checkpoint without tokenizer.json is tokenized from (SentencePiece models, BPE and WordPiece
vocabularies, the tokens added to them), which the fingerprint then covers."""


def _fingerprint(path: Path) -> str:
    """Identifies model and tokenizer: config, tokenizer files (tokenizer.json, else the slow
    tokenizer's: SLOW_TOKENIZER_FILES) and, of each weight file the loader
    reads, its header (names, shapes, dtypes, offsets), its size and samples of its values (the
    whole of tensors up to FINGERPRINT_RUN * FINGERPRINT_SAMPLES bytes, evenly spaced runs of
    larger ones: about a megabyte read a file at most, in file order). Two checkpoints of one
    architecture, or one retrained or fine-tuned and saved over itself, differ in their values,
    so a state saved by one does not load into the other; a copy of a checkpoint (a directory, or
    the hub cache's snapshot) is the same model. An edit of a few values between the samples goes
    unseen."""
    digest = hashlib.sha256()
    # a checkpoint with no tokenizer.json is tokenized from its slow tokenizer's files
    slow = () if (path / "tokenizer.json").is_file() else SLOW_TOKENIZER_FILES
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", *slow):
        file = path / name
        if file.is_file():
            digest.update(name.encode() + file.read_bytes())
    try:
        files = weight_files(path)
    except CheckpointError:
        files = []  # loading the weights says what is wrong
    for file in files:
        try:
            _digest_weight_file(file, digest)
        except (OSError, ValueError, OverflowError):
            digest.update(b"unreadable")
    return digest.hexdigest()


def _checkpoint_fingerprint(path: Path, manifest: dict | None, dtype: torch.dtype) -> str:
    """A surgery checkpoint loaded in the dtype it was written in, its files as written, is its
    source with its passes (the engine adds them): the source's fingerprint, so that states of an
    engine that applied the passes to the source at load load here, and the other way round. In
    another dtype (the writer's narrower one held other values than this engine's would), or
    edited since, it is a checkpoint of its own."""
    own = _fingerprint(path) if manifest is None else surgery_fingerprint(path, manifest)
    source = manifest.get("source_fingerprint") if manifest else None
    if (isinstance(source, str) and source and manifest.get("fingerprint") == own
            and manifest.get("dtype") == str(dtype).removeprefix("torch.")):
        return source
    return own


def surgery_fingerprint(path: Path, manifest: dict) -> str:
    """A surgery checkpoint's own fingerprint: its files' (`_fingerprint`) and its manifest's, which
    says how the weights are read and which passes they carry (but its own "fingerprint", which
    `hibana surgery` writes as this): a manifest edited since is another model."""
    described = json.dumps({k: v for k, v in manifest.items() if k != "fingerprint"}, sort_keys=True)
    return hashlib.sha256((_fingerprint(path) + described).encode()).hexdigest()


def _digest_weight_file(file: Path, digest: Any) -> None:
    size = file.stat().st_size
    digest.update(str(size).encode())
    with file.open("rb", buffering=0) as f:  # unbuffered: a run is one read, no buffer refilled around it
        head = f.read(8)
        if len(head) < 8:
            return
        (length,) = struct.unpack("<Q", head)
        header = f.read(min(length, 100 << 20))
        digest.update(header)
        for offset, count in _samples(header, 8 + length, size):
            f.seek(offset)
            digest.update(f.read(count))


def _samples(header: bytes, data_start: int, file_size: int) -> list[tuple[int, int]]:
    """(file offset, bytes) of the runs `_fingerprint` reads from a safetensors file, in file
    order; none from a header that does not parse (loading the weights reports it) nor from a
    tensor whose bytes lie outside the file."""
    try:
        entries = json.loads(header)
    except ValueError:
        return []
    if not isinstance(entries, dict):
        return []
    spans = []
    for name, entry in entries.items():  # the runs are read in file order, whatever the header's
        offsets = entry.get("data_offsets") if name != "__metadata__" and isinstance(entry, dict) else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets):
            begin, end = offsets
            if 0 <= begin < end and data_start + end <= file_size:
                spans.append((data_start + begin, end - begin))
    run, whole = FINGERPRINT_RUN, FINGERPRINT_RUN * FINGERPRINT_SAMPLES
    large = sum(1 for _, size in spans if size > whole)
    per_tensor = max(2, min(FINGERPRINT_SAMPLES, FINGERPRINT_FILE_SAMPLES // max(large, 1)))
    runs = []
    for start, size in spans:
        if size <= whole:
            runs.append((start, size))
        else:
            runs.extend((start + i * (size - run) // (per_tensor - 1), run) for i in range(per_tensor))
    return sorted(runs)
