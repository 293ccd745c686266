"""Pre-quantized int4 checkpoints (GPTQ, AWQ, compressed-tensors) -> Hibana's int4 layout.
(FP8 checkpoints keep their codes; their configs are parsed here too, their layers in `fp8.py`.)

`parse_quantization_config` reads `config.json`'s `quantization_config` into a `QuantFormat`;
`repack_layer` turns one quantized linear layer's checkpoint tensors into the layout of
`kernels/quant.py` (uint8 [N, K // 2], fp16 scales and zeros [N, K // G]). Every format defines
w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]; the repack keeps q, z and s exactly, so
`dequantize_int4` of the result is the weight the format defines, bit for bit (scales stored in
another float type are rounded to fp16 once).

The three layouts (K = in_features, N = out_features, G = group size, "word" = int32, nibble i
of a word = bits 4i..4i+3):

    GPTQ     qweight [K/8, N]   word (r, n), nibble i = q[n, 8r + i]          packed along K
             qzeros  [K/G, N/8] word (g, c), nibble i = zero of n = 8c + i    packed along N
             scales  [K/G, N];  g_idx [K] = group of each input column k
             zero = nibble + 1 for checkpoint_format "gptq" (v1 stores zero - 1), nibble for
             "gptq_v2"
    AWQ      qweight [K, N/8]   word (k, c), nibble i = q[8c + ORDER[i], k]   packed along N,
             qzeros  [K/G, N/8] same packing, zero = nibble   ORDER = 0 2 4 6 1 3 5 7
             scales  [K/G, N]
    c-t      weight_packed [N, ceil(K/8)] int32, weight_scale [N, K/G], weight_shape [2],
             weight_zero_point [ceil(N/8), K/G] (asymmetric only), weight_g_idx [K] (optional);
             signed codes q in [-8, 7] stored as q + 8; unpacked by compressed-tensors itself

Act-order (GPTQ desc_act, compressed-tensors actorder "group"): g_idx assigns input columns to
groups out of order, while Hibana's groups are contiguous runs of K. The repack sorts K by group
and returns that permutation as `perm`: the layer must compute `F.linear(x[..., perm], W)`.
Layers fused along N (q/k/v, gate/up) can share one weight only when their perms are equal.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from hibana_core.errors import CheckpointError
from hibana_core.surgery import fp8
from hibana_kernels.quant import pack_int4

__all__ = ["Int4Weight", "QuantFormat", "parse_quantization_config", "repack_layer"]

Method = Literal["gptq", "awq", "compressed-tensors", "fp8"]

SUPPORTED = ("GPTQ (bits 4, checkpoint_format 'gptq' or 'gptq_v2', any group size, desc_act), "
             "AWQ (bits 4, version 'gemm', zero_point true), compressed-tensors "
             "'pack-quantized' (int4 weights, group or channel strategy, symmetric or not) and "
             + fp8.SUPPORTED)

# AutoAWQ's GEMM packing: nibble i of a word holds output column 8c + AWQ_ORDER[i]
# (casper-hansen/AutoAWQ awq/modules/linear/gemm.py `order_map`; awq/utils/packing_utils.py);
# AWQ_REVERSE[j] is the nibble that holds column 8c + j.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)

_TENSORS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # method: (required, optional)
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"),
                           ("weight_zero_point", "weight_g_idx")),
}


@dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint's linear layers are quantized; built by `parse_quantization_config`."""

    method: Method
    """Which packing the tensors use."""
    group_size: int
    """int4: inputs per scale along K; -1: one group spanning all of K (per output channel).
    Unused (0) for fp8."""
    sym: bool = True
    """Symmetric quantization (informational: the stored zeros are used either way)."""
    desc_act: bool = False
    """Act-order was used; `repack_layer` decides from g_idx itself whether K needs permuting."""
    zero_offset: int = 0
    """Added to each stored zero nibble: 1 for GPTQ v1 (it stores zero - 1), else 0."""
    skip: tuple[str, ...] = ()
    """Regexes (re.match on the full module name) of modules left unquantized."""
    only: tuple[str, ...] = ()
    """Regexes of the modules that are quantized; empty: every linear layer."""
    quantize_lm_head: bool = False
    """Whether the output head is quantized too (GPTQ `lm_head: true`; compressed-tensors'
    targets and ignore decide it through `only` and `skip`)."""
    kind: Literal["int4", "fp8"] = "int4"
    """What a quantized layer becomes: Hibana's int4 layout (repacked), or fp8 codes as stored."""
    block: tuple[int, int] = (0, 0)
    """fp8: (output rows, input columns) sharing one scale, 0 meaning the whole dimension: (0, 0)
    per tensor, (1, 0) per output channel, (1, g) per group of g inputs, (128, 128) blocks."""

    def __post_init__(self) -> None:
        if self.method not in (*_TENSORS, "fp8"):
            raise CheckpointError(f"unknown quantization method {self.method!r}; supported: {SUPPORTED}")
        if (self.kind == "fp8") != (self.method == "fp8") and self.method != "compressed-tensors":
            raise CheckpointError(f"{self.method} checkpoints hold int4 weights, fp8 ones hold fp8, not {self.kind}")
        if self.kind == "fp8":
            if len(self.block) != 2 or min(self.block) < 0:
                raise CheckpointError(f"fp8 block {self.block} is not two sizes (0: the whole dimension)")
        elif self.group_size != -1 and (self.group_size <= 0 or self.group_size % 2):
            raise CheckpointError(f"group_size {self.group_size} is not supported: Hibana's int4 "
                                  "layout needs a positive even group size (or -1, per channel)")
        if self.zero_offset not in (0, 1):
            raise CheckpointError(f"zero_offset must be 0 or 1, not {self.zero_offset}")

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """Suffixes of a quantized int4 layer's checkpoint tensors (`<module>.<suffix>`), required
        first (fp8 layers: `fp8.SCALES`)."""
        required, optional = _TENSORS[self.method]
        return required + optional

    def is_quantized(self, module_name: str) -> bool:
        """Whether the config says this linear layer is stored quantized. The checkpoint has the
        last word: a layer is quantized exactly when its `<module>.qweight` / `weight_packed`
        exists, and a loader should refuse a layer where the two disagree."""
        if any(re.match(p, module_name) for p in self.skip):
            return False
        if module_name.rsplit(".", 1)[-1] == "lm_head" and not self.quantize_lm_head:
            return False
        return not self.only or any(re.match(p, module_name) for p in self.only)


class Int4Weight(NamedTuple):
    """One linear layer in the layout of `kernels.quant.dequantize_int4` / `linear_int4`."""

    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # float16 [N, K // group_size]
    zeros: torch.Tensor  # float16 [N, K // group_size], in code units
    group_size: int
    perm: torch.Tensor | None
    """int64 [K] or None: the layer computes `linear_int4(x[..., perm], ...)` (act-order)."""


# ----------------------------------------------------------------------------------- config


def parse_quantization_config(cfg: dict) -> QuantFormat:
    """A HF `config.json`'s `quantization_config` dict -> QuantFormat, or CheckpointError saying
    what is supported."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"quantization_config must be a JSON object, not {type(cfg).__name__}")
    method = str(cfg.get("quant_method", "")).lower()
    if method == "gptq":
        return _parse_gptq(cfg)
    if method == "awq":
        return _parse_awq(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == "fp8":
        block, skip = fp8.parse_fp8(cfg)
        # transformers skips the output head by default, and only the modules listed when a list is given
        return QuantFormat("fp8", 0, skip=_not_converted(skip), quantize_lm_head=skip is not None,
                           kind="fp8", block=block)
    raise CheckpointError(f"quantization_config has quant_method {cfg.get('quant_method')!r}, which "
                          f"Hibana cannot load; supported: {SUPPORTED}")


def _bits4(cfg: dict, what: str, required: bool = False) -> None:
    if required and "bits" not in cfg:  # (transformers' GPTQConfig takes no default either)
        raise CheckpointError(f"the {what} quantization_config has no bits; it says how the weights are packed "
                              "(Hibana loads bits 4): re-export the checkpoint, or add \"bits\": 4 if it is 4-bit")
    bits = cfg.get("bits", 4)
    if bits != 4:
        raise CheckpointError(f"{what} checkpoint with bits={bits!r}: Hibana loads 4-bit weights only; "
                              "use a 4-bit checkpoint or the unquantized model")


def _group_size(cfg: dict, what: str) -> int:
    g = cfg.get("group_size", 128)
    if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or (g > 0 and g % 2 == 0)):
        raise CheckpointError(f"{what} group_size {g!r} is not supported: Hibana needs a positive even "
                              "group size or -1 (per channel)")
    return g


def _not_converted(names) -> tuple[str, ...]:
    """transformers' `modules_to_not_convert` as regexes: a key matches from the start of the name
    up to a module boundary (also as a regex), or as a suffix (transformers
    quantizers/quantizers_utils.py `should_convert_module`)."""
    if names is None:
        return ()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"modules_to_not_convert must be a list of names, not {names!r}")
    return tuple(rf"(?:{n})(?:(?<=\.)|(?=\.|$))|.*{re.escape(n)}$" for n in names)


def _parse_gptq(cfg: dict) -> QuantFormat:
    _bits4(cfg, "GPTQ", required=True)
    for key in ("sym", "desc_act", "lm_head"):
        if key in cfg and cfg[key] is not None and not isinstance(cfg[key], bool):
            raise CheckpointError(f"the GPTQ quantization_config has {key} = {cfg[key]!r:.40}, where true or false "
                                  "belongs; the checkpoint's config is damaged: re-export it")
    # transformers' GPTQConfig reads `checkpoint_format` (legacy) or `format`; GPTQModel writes v2
    fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
    if cfg.get("is_marlin_format") is True:  # AutoGPTQ <= 0.7.1's flag for it (vLLM's gptq_marlin reads it so)
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"GPTQ checkpoint_format {fmt!r} is packed for one kernel and cannot be "
                              "repacked by Hibana; supported: 'gptq' and 'gptq_v2'")
    # GPTQModel can pack into int16 / int8 / int64 words (its `pack_dtype`); Hibana reads int32 words
    pack_dtype = str(cfg.get("pack_dtype") or "int32").lower().removeprefix("torch.")
    if pack_dtype != "int32":
        raise CheckpointError(f"GPTQ pack_dtype {cfg['pack_dtype']!r} is not supported: Hibana reads GPTQ "
                              "tensors packed into int32 words (GPTQModel's default pack_dtype)")
    # GPTQModel's per-module `dynamic` overrides ("-:regex" skips a module, "+:regex" or a bare
    # regex overrides its bits/group_size/...), read as in vLLM's
    # model_executor/layers/quantization/utils/gptq_utils.py `get_dynamic_override`.
    skip = list(_not_converted(cfg.get("modules_to_not_convert")))
    dynamic = cfg.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(p, str) and isinstance(o, dict) for p, o in dynamic.items()):
        raise CheckpointError(f"the GPTQ quantization_config has dynamic = {dynamic!r:.80}, where an object of "
                              "module patterns and their overrides belongs; the checkpoint's config is damaged: re-export it")
    # an override of sym or desc_act changes nothing here (each layer's stored zeros and g_idx say
    # them); one of bits or group_size, compared as the config reads them (group_size 128 unsaid),
    # is the packing of those modules
    packing = {"bits": cfg.get("bits"), "group_size": cfg.get("group_size", 128)}
    for pattern, override in dynamic.items():
        if pattern.startswith("-:"):
            skip.append(pattern[2:])
        elif any(key in override and override[key] != value for key, value in packing.items()):
            raise CheckpointError(f"GPTQ dynamic override {pattern!r}: {override!r} gives some modules "
                                  "their own bits or group size, which Hibana does not load")
    only = []
    if cfg.get("modules_in_block_to_quantize"):  # [["self_attn.q_proj", ...], ...] inside blocks
        blocks = cfg["modules_in_block_to_quantize"]
        if not isinstance(blocks, list) or not all(
                isinstance(names, str) or (isinstance(names, list) and all(isinstance(n, str) for n in names))
                for names in blocks):
            raise CheckpointError(f"the GPTQ quantization_config has modules_in_block_to_quantize = {blocks!r:.80}, "
                                  "where a list of module names (or of lists of them) belongs; the checkpoint's "
                                  "config is damaged: re-export it")
        for names in blocks:
            only += [rf".*\.{re.escape(n)}$" for n in ([names] if isinstance(names, str) else names)]
        if cfg.get("lm_head"):
            only.append(r"(?:.*\.)?lm_head$")
    return QuantFormat("gptq", _group_size(cfg, "GPTQ"), sym=bool(cfg.get("sym", True)),
                       desc_act=bool(cfg.get("desc_act", False)), zero_offset=1 if fmt == "gptq" else 0,
                       skip=tuple(skip), only=tuple(only), quantize_lm_head=bool(cfg.get("lm_head", False)))


AUTOAWQ_KEYS = {"w_bit": "bits", "q_group_size": "group_size"}
"""AutoAWQ's own names (its quant_config.json, copied into some checkpoints' config.json) for
transformers' AwqConfig keys."""


def _parse_awq(cfg: dict) -> QuantFormat:
    cfg = {**{ours: cfg[theirs] for theirs, ours in AUTOAWQ_KEYS.items() if theirs in cfg}, **cfg}
    _bits4(cfg, "AWQ")
    # AutoAWQ writes `version`; transformers 5 writes `format` (utils/quantization_config.py AwqConfig)
    version = str(cfg.get("version") or cfg.get("format") or "gemm").lower()
    if str(cfg.get("backend", "")).lower() == "llm-awq":
        version = "llm-awq"
    if version != "gemm":
        raise CheckpointError(f"AWQ version {version!r} is not supported (its packing is made for one "
                              "kernel); Hibana loads AWQ 'gemm' checkpoints, AutoAWQ's default")
    if not cfg.get("zero_point", True):
        raise CheckpointError("AWQ checkpoint with zero_point false is not supported; Hibana loads "
                              "AWQ GEMM checkpoints with zero points (zero_point true)")
    return QuantFormat("awq", _group_size(cfg, "AWQ"), sym=False,
                       skip=_not_converted(cfg.get("modules_to_not_convert")))


def _ct_patterns(targets) -> tuple[str, ...]:
    """compressed-tensors targets/ignore: "re:<regex>" or an exact module name; the class name
    "Linear" matches every linear layer (compressed_tensors/utils/match.py `match_name`, `_match_class`)."""
    return tuple(".*" if t == "Linear" else t[3:] if t.startswith("re:") else re.escape(t) + "$"
                 for t in targets)


def _parse_compressed_tensors(cfg: dict) -> QuantFormat:
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise CheckpointError("this checkpoint is in compressed-tensors format, which needs the "
                              "compressed-tensors package: pip install 'hibana[quant]' "
                              "(or pip install compressed-tensors)") from None
    cfg, group_order = _group_actorder(cfg)
    try:
        qc = QuantizationConfig.model_validate(cfg)
    except (ValueError, TypeError, KeyError, NotImplementedError) as e:  # pydantic's ValidationError is a
        # ValueError; the library's own validators raise the others (a group_size "128", a 1-bit float)
        raise CheckpointError(f"malformed compressed-tensors quantization_config: {e}") from None
    status = str(getattr(qc.quantization_status, "value", qc.quantization_status))
    if status != "compressed":
        raise CheckpointError(f"compressed-tensors quantization_status is {status!r}: the weights are "
                              "not stored packed; Hibana loads 'compressed' checkpoints")
    for key in ("sparsity_config", "transform_config"):
        extra = cfg.get(key)
        if extra and (key != "sparsity_config" or not isinstance(extra, dict) or extra.get("format", "dense") != "dense"):
            raise CheckpointError(f"compressed-tensors checkpoint with a {key}: sparse or rotated "
                                  f"weights are not supported; supported: {SUPPORTED}")
    if qc.kv_cache_scheme is not None:
        raise fp8.kv_cache_error("compressed-tensors quantization_config has a kv_cache_scheme")
    weights, targets = set(), []
    for name, scheme in qc.config_groups.items():
        w = scheme.weights
        fmt = getattr(scheme, "format", None) or qc.format
        if w is not None and w.type == "float" and w.num_bits == 8:
            weights.add(("fp8", _ct_fp8_block(name, scheme, fmt)))
            targets += scheme.targets
            continue
        if (w is None or fmt != "pack-quantized" or w.type != "int" or w.num_bits != 4
                or w.strategy not in ("group", "channel") or w.dynamic
                or scheme.input_activations is not None or scheme.output_activations is not None):
            raise CheckpointError(
                f"compressed-tensors config group {name!r} ({fmt}, weights {w}) is not supported: "
                "Hibana loads 'pack-quantized' int4 weight-only schemes with group or channel strategy, "
                "and 8-bit float (fp8) weights")
        actorder = name in group_order or str(getattr(w.actorder, "value", w.actorder)) == "group"  # g_idx stored
        weights.add(("int4", w.group_size if w.strategy == "group" else -1, w.symmetric, actorder))
        targets += scheme.targets
    if len(weights) != 1:
        raise CheckpointError(f"compressed-tensors config groups use different weight schemes "
                              f"{sorted(weights, key=str)}; Hibana loads one scheme per checkpoint")
    ((kind, *scheme),) = weights
    if kind == "fp8":
        return QuantFormat("compressed-tensors", 0, skip=_ct_patterns(qc.ignore or ()), only=_ct_patterns(targets),
                           quantize_lm_head=True, kind="fp8", block=scheme[0])
    group_size, symmetric, actorder = scheme
    return QuantFormat("compressed-tensors", group_size, sym=symmetric, desc_act=actorder,
                       skip=_ct_patterns(qc.ignore or ()), only=_ct_patterns(targets),
                       quantize_lm_head=True)


def _group_actorder(cfg: dict) -> tuple[dict, set[str]]:
    """(the config with every group's actorder "group" cleared, the names of those groups).
    recent compressed-tensors (0.20) refuses actorder "group" (its alias "dynamic", or true), which
    older llm-compressor wrote and whose checkpoints store weight_g_idx; Hibana reads that order
    itself, so the library only validates the rest."""
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict):
        return cfg, set()
    ordered = {name for name, scheme in groups.items()
               if isinstance(scheme, dict) and isinstance(scheme.get("weights"), dict)
               and str(scheme["weights"].get("actorder")).lower() in ("group", "dynamic", "true")}
    cleared = {name: {**scheme, "weights": {**scheme["weights"], "actorder": None}} if name in ordered else scheme
               for name, scheme in groups.items()}
    return {**cfg, "config_groups": cleared}, ordered


def _ct_fp8_block(name: str, scheme, fmt) -> tuple[int, int]:
    """A compressed-tensors config group of 8-bit float weights -> their block; activation
    quantization is ignored (Hibana computes weight-only), output quantization refused."""
    what = f"compressed-tensors config group {name!r}"
    if fmt not in ("float-quantized", "naive-quantized"):
        raise CheckpointError(f"{what}: fp8 weights in format {fmt!r}; Hibana loads them 'float-quantized' "
                              "or 'naive-quantized'")
    inputs = scheme.input_activations
    if inputs is not None and (inputs.type != "float" or inputs.num_bits != 8):
        raise CheckpointError(f"{what}: fp8 weights with {inputs.num_bits}-bit {inputs.type} activations "
                              f"are not supported; supported: {SUPPORTED}")
    if scheme.output_activations is not None:
        raise CheckpointError(f"{what} quantizes output activations, which Hibana does not; supported: {SUPPORTED}")
    return fp8.ct_block(scheme.weights, what)


# ----------------------------------------------------------------------------------- repack


def repack_layer(fmt: QuantFormat, tensors: dict[str, torch.Tensor], name: str = "layer") -> Int4Weight:
    """One quantized linear layer's checkpoint tensors, keyed by suffix (`qweight`, `scales`, ...;
    see `QuantFormat.tensor_names`) -> Int4Weight. `name` is used in error messages."""
    required, optional = _TENSORS[fmt.method]
    missing = [s for s in required if s not in tensors]
    if missing:
        raise CheckpointError(f"{name}: {fmt.method} layer lacks tensor(s) {missing}; "
                              f"expected {list(required)} (+ optional {list(optional)})")
    order = {"gptq": "g_idx", "compressed-tensors": "weight_g_idx"}.get(fmt.method)
    if fmt.desc_act and order not in tensors:  # without it the columns' groups are unknown
        raise CheckpointError(f"{name}: quantized in activation order (desc_act / actorder) but has no {order}, "
                              "which says which group each input column belongs to; the checkpoint is incomplete")
    if fmt.method == "gptq":
        return _repack_gptq(fmt, tensors, name)
    if fmt.method == "awq":
        return _repack_awq(fmt, tensors, name)
    return _repack_compressed_tensors(fmt, tensors, name)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word (bits 4i..4i+3) at index i."""
    if sys.byteorder == "little" or words.device.type != "cpu":  # byte j of a word = bits 8j..8j+7
        b = words.contiguous().view(torch.uint8).view(*words.shape, 4)
        return torch.stack((b & 0xF, b >> 4), dim=-1).view(*words.shape, 8)
    return torch.stack([((words >> (4 * i)) & 0xF).to(torch.uint8) for i in range(8)], dim=-1)


def _int32(t: torch.Tensor, what: str, name: str, shape: tuple[int, ...] | None = None,
           group: int | None = None) -> torch.Tensor:
    """`t` where it is int32 words of `shape` (one row a group of `group` inputs), else CheckpointError."""
    if t.dtype != torch.int32 or t.dim() != 2 or (shape is not None and tuple(t.shape) != shape):
        want = f"int32 {list(shape)}" if shape else "a 2-D int32 tensor"
        groups = f" (groups of {group} inputs, its quantization_config's group_size)" if group else ""
        raise CheckpointError(f"{name}: {what} is {t.dtype} {list(t.shape)}, expected {want}{groups}; "
                              "the checkpoint is damaged or not in the format its config names")
    return t


def _shape(t: torch.Tensor, shape: tuple[int, ...], what: str, name: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{name}: {what} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def _scales(t: torch.Tensor, shape: tuple[int, ...], what: str, name: str) -> torch.Tensor:
    # an integer tensor here would be cast to fp16 and give weights off by orders of magnitude
    if not t.dtype.is_floating_point:
        raise CheckpointError(f"{name}: {what} is {t.dtype}, not a float; the checkpoint is damaged or "
                              "not in the format its config names")
    return _shape(t, shape, what, name)


def _groups(fmt: QuantFormat, k: int, name: str) -> tuple[int, int]:
    """(group size, number of groups) for K input features. When G does not divide K the last
    group holds the K % G inputs left (GPTQ's and compressed-tensors' ceil(K / G) groups);
    `_finish` splits the groups into equal ones."""
    g = k if fmt.group_size == -1 else fmt.group_size
    if k % 2 or g % 2:
        raise CheckpointError(f"{name}: in_features {k} with group_size {g}: Hibana's int4 layout "
                              "needs an even number of inputs and an even group size")
    return g, -(-k // g)


def _repack_gptq(fmt: QuantFormat, t: dict[str, torch.Tensor], name: str) -> Int4Weight:
    # Layouts: AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py (`pack` writes
    # q[k = 8r + i] into nibble i of qweight row r and zero - 1 into qzeros; `forward` unpacks
    # with `zeros + 1` and indexes scales/zeros by g_idx); v2 keeps the zero as is (GPTQModel
    # gptqmodel/utils/model.py `convert_gptq_v1_to_v2_format_module` adds the 1 back).
    qweight = _int32(t["qweight"], "qweight", name)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    g, groups = _groups(fmt, k, name)
    if n % 8:
        raise CheckpointError(f"{name}: out_features {n} is not a multiple of 8, as GPTQ's qzeros need")
    qzeros = _int32(t["qzeros"], "qzeros", name, (groups, n // 8), g)
    scales = _scales(t["scales"], (groups, n), "scales", name)
    codes = _nibbles(qweight).permute(0, 2, 1).reshape(k, n).T  # [N, K]
    zeros = _nibbles(qzeros).reshape(groups, n).T.float() + fmt.zero_offset  # [N, groups]
    return _finish(codes, scales.T, zeros, g, t.get("g_idx"), name)


def _repack_awq(fmt: QuantFormat, t: dict[str, torch.Tensor], name: str) -> Int4Weight:
    # Layout: AutoAWQ awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear packs along N with
    # order_map [0, 2, 4, 6, 1, 3, 5, 7], qzeros alike) and awq/utils/packing_utils.py
    # (`dequantize_gemm`: (q - zero) * scale, no offset on the zero).
    qweight = _int32(t["qweight"], "qweight", name)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g, groups = _groups(fmt, k, name)
    qzeros = _int32(t["qzeros"], "qzeros", name, (groups, n // 8), g)
    scales = _scales(t["scales"], (groups, n), "scales", name)
    reverse = list(AWQ_REVERSE)
    codes = _nibbles(qweight)[..., reverse].reshape(k, n).T  # [N, K]
    zeros = _nibbles(qzeros)[..., reverse].reshape(groups, n).T.float()
    return _finish(codes, scales.T, zeros, g, None, name)


def _repack_compressed_tensors(fmt: QuantFormat, t: dict[str, torch.Tensor], name: str) -> Int4Weight:
    # Layout and unpacking: compressed-tensors compressors/pack_quantized (PackedQuantizationCompressor:
    # signed codes + 8 packed along K, the asymmetric zero point packed along N with packed_dim=0,
    # weight = (q - zero_point) * scale). The unpacking is the library's own.
    try:
        from compressed_tensors.compressors import unpack_from_int32
    except ImportError:
        raise CheckpointError("compressed-tensors checkpoints need the compressed-tensors package: "
                              "pip install 'hibana[quant]' (or pip install compressed-tensors)") from None
    shape = t["weight_shape"].flatten().tolist()
    if len(shape) != 2 or min(shape) <= 0:
        raise CheckpointError(f"{name}: weight_shape {shape} is not [out_features, in_features]")
    n, k = (int(s) for s in shape)
    g, groups = _groups(fmt, k, name)
    packed = _int32(t["weight_packed"], "weight_packed", name, (n, -(-k // 8)))
    scales = _scales(t["weight_scale"], (n, groups), "weight_scale", name)
    codes = (unpack_from_int32(packed, 4, torch.Size((n, k))).to(torch.int16) + 8).to(torch.uint8)
    zp = t.get("weight_zero_point")
    if zp is None:
        if not fmt.sym:
            raise CheckpointError(f"{name}: asymmetric compressed-tensors layer lacks weight_zero_point")
        zeros = torch.full((n, groups), 8.0)
    elif zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // 8), groups):
        zeros = unpack_from_int32(zp, 4, torch.Size((n, groups)), packed_dim=0).float() + 8
    else:  # written unpacked (one signed value per group), as some versions did
        zeros = _shape(zp, (n, groups), "weight_zero_point", name).float() + 8
    # actorder "group" stores weight_g_idx; one holding -1 was never set and means column order
    # (compressed-tensors quantization/lifecycle/forward.py `_process_quantization`: is_column_order)
    g_idx = t.get("weight_g_idx")
    if g_idx is not None and bool((g_idx < 0).any()):
        g_idx = None
    return _finish(codes, scales, zeros, g, g_idx, name)


def _finish(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int,
            g_idx: torch.Tensor | None, name: str) -> Int4Weight:
    """codes [N, K] (checkpoint order of K), scales/zeros [N, groups] -> Int4Weight, sorting K
    by group when g_idx is not the contiguous k // g."""
    n, k = codes.shape
    contiguous = torch.arange(k, device=codes.device) // g
    perm = None
    if g_idx is not None:
        g_idx = _shape(g_idx, (k,), "g_idx", name).long()
        if not torch.equal(g_idx, contiguous):
            # act-order: any order inside a group works; the stable sort keeps the checkpoint's
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                raise CheckpointError(f"{name}: g_idx does not give every group exactly {g} input "
                                      "columns; the checkpoint is damaged or its group_size is wrong")
            codes = codes[:, perm]
    if k % g:  # a partial last group: Hibana's groups are equal, so split each into gcd(g, k) inputs
        sub = math.gcd(g, k)
        owner = torch.arange(0, k, sub, device=codes.device) // g  # the checkpoint group of each
        scales, zeros, g = scales[:, owner], zeros[:, owner], sub
    scales16 = scales.to(torch.float16)
    if not torch.isfinite(scales16).all():
        raise CheckpointError(f"{name}: scales are not finite in float16 (largest "
                              f"{scales.float().abs().max().item():.3g}); Hibana stores int4 scales as fp16")
    return Int4Weight(pack_int4(codes.contiguous()), scales16.contiguous(),
                      zeros.to(torch.float16).contiguous(), g, perm)
