"""The built-in surgery passes: weight-only int8 ("w8") and int4 ("w4").

Both rewrite every linear layer of the decoder (attention and MLP projections) that supports a
packed weight (`set_packed`); the output head and the embeddings keep their precision, as
AWQ and GPTQ checkpoints keep them (the head is one layer that every token's logits go through).
A model loaded from an FP8 checkpoint is refused: its weights are 8-bit already, so w8 saves
nothing, and w4 from them would round twice (the unquantized checkpoint gives a better int4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hibana_core.errors import ConfigError
from hibana_plugins.hookspecs import hookimpl

if TYPE_CHECKING:  # imported by the plugin manager, which must not pull torch in
    import torch


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class WeightQuantPass:
    """Pack the dense linear weights of the decoder layers."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        # the guard's default floors (hibana_core.surgery.guard): int8 should be all but free
        self.floors = {"ppl_ratio": 1.005} if bits == 8 else {"ppl_ratio": 1.05, "top1_agreement": 0.93}

    def check(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters with their defaults (w4: group_size 128, clip true), or a ConfigError."""
        allowed = {"group_size": 128, "clip": True} if self.bits == 4 else {}
        unknown = set(params) - set(allowed)
        if unknown:
            raise ConfigError(f"surgery pass w{self.bits} takes {sorted(allowed) or 'no parameters'}, "
                              f"got {sorted(unknown)}")
        params = {**allowed, **params}
        if self.bits == 4:
            wanted = params["group_size"]
            if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 2 or wanted % 2:
                raise ConfigError(f"w4: group_size must be an even integer >= 2, got {wanted!r}")
            if not isinstance(params["clip"], bool):
                raise ConfigError(f"w4: clip must be true or false, got {params['clip']!r}")
        return params

    def apply(self, model: "torch.nn.Module", params: dict[str, Any]) -> dict[str, Any]:
        from tqdm.auto import tqdm

        from hibana_core.surgery.quantize import group_size_for, quantize_int4, quantize_int8

        params = self.check(params)
        wanted, clip = params.get("group_size"), params.get("clip")
        fp8 = [name for name, m in model.named_modules() if getattr(m, "kind", None) == "fp8"]
        if fp8:  # requantizing fp8 codes rounds twice, and w8 would not even save a byte
            raise ConfigError(f"surgery pass w{self.bits} on an FP8 checkpoint ({len(fp8)} fp8 layers, e.g. "
                              f"{fp8[0]}): its weights are already 8-bit; load it without w{self.bits}, or "
                              "apply w4 to the unquantized checkpoint")
        layers = [(name, m) for name, m in model.named_modules() if _packable(name, m)]
        before = after = 0
        kept: list[str] = []
        for name, layer in tqdm(layers, desc=f"surgery w{self.bits}", unit="layer", leave=False):
            weight = layer.weight.data
            group = 0
            if self.bits == 8:
                packed = quantize_int8(weight)
            else:
                group = group_size_for(weight.shape[1], wanted)
                if group is None:  # no even group size divides its inputs
                    kept.append(name)
                    continue
                packed = quantize_int4(weight, group, clip)
            before += _tensor_bytes([weight])
            layer.set_packed(f"int{self.bits}", packed, group)
            after += _tensor_bytes(packed.values())
        if not layers or len(kept) == len(layers):
            raise ConfigError(f"surgery pass w{self.bits} found no linear layer it can pack in this model")
        return {"layers": len(layers) - len(kept), "kept_dense": kept, "bytes_before": before,
                "bytes_after": after}


def _packable(name: str, module: "torch.nn.Module") -> bool:
    return (hasattr(module, "set_packed") and getattr(module, "kind", None) == "dense"
            and not name.endswith("lm_head") and module.weight is not None and module.weight.dim() == 2)


@hookimpl
def register_surgery_passes(register) -> None:
    register("w8", WeightQuantPass(8))
    register("w4", WeightQuantPass(4))
