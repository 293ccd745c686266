"""The layer-skip self-draft: the target model with a subset of its decoder layers drafts for it.

    rank     on held-out text (the guard's documents; seeded random tokens for a checkpoint
             without a tokenizer), how much each layer turns the residual stream:
             1 - mean cosine(stream before the layer, stream after it); the layers that turn it
             least matter least
    keep     the first and the last layer always, then the most important of the rest, so that
             a `keep` share of the layers remains (default half)
    draft    a shallow copy of the model that shares every weight (packed ones too) and runs the
             kept layers on its own ForwardContext, so its KV (kept attention layers only) lives
             in its own cache; it drafts through `DraftModelDrafter` (its argmax, or for unseeded
             sampled requests a draw from its own distribution; verification stays lossless
             either way: output is the target's own)

A hybrid target's kept linear-attention layers (Qwen3.5's, Qwen3-Next's Gated DeltaNet) fold a
history into a state that depends on every layer below them, so the draft's states differ from
the target's even for the layers both run: they live in the draft's own recurrent cache, as a
hybrid draft model's do (`DraftModelDrafter`: a token short of each history, drafting on copies).

No weights are added: the draft costs its KV (and a hybrid's states) and about `keep` of a target
forward per token.
Used as `speculation={"method": "layer_skip", "k": 4}`.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch

from hibana_core.errors import ConfigError
from hibana_core.forward_context import ForwardContext
from hibana_core.loader import LoadedModel
from hibana_core.speculation.draft_model import DRAFT_KV_SHARE, DraftModelDrafter, check_reserved

DEFAULT_KEEP = 0.5


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(_mixer_name(l) for l in layers):
        raise ConfigError(f"the layer-skip self-draft needs a decoder of the llama kind (model.layers[i]."
                          f"self_attn, or a hybrid's linear_attn); {type(model).__name__} is not one; use "
                          "speculation method 'suffix'")
    return layers


def _mixer_name(layer: torch.nn.Module) -> str | None:
    """The attribute of a decoder layer's token mixer: its attention, or a hybrid model's
    linear-attention layer (`DecoderLayer.linear`); None for a layer of another kind."""
    if getattr(layer, "linear", False) and hasattr(layer, "linear_attn"):
        return "linear_attn"
    return "self_attn" if hasattr(layer, "self_attn") else None


def layer_importance(engine: Any, documents: list[list[int]]) -> list[float]:
    """Per decoder layer: 1 - mean cosine similarity of the residual stream before and after it."""
    from hibana_core.surgery.guard import Scorer

    layers = _layers(engine.model)
    turned = [0.0] * len(layers)
    count = [0]

    def hook(index: int):
        def record(module, inputs, output):
            _, x, residual = inputs
            before = x if residual is None else x + residual
            after = output[0] + output[1]
            turned[index] += (1 - torch.cosine_similarity(before.float(), after.float(), dim=-1)).sum().item()
        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        scorer = Scorer(engine.model, engine._ctx, engine.model_args, engine.dtype, engine.device,
                        max(len(d) for d in documents))
        for doc in documents:
            scorer.hidden(doc)
            count[0] += len(doc)
    finally:
        for handle in handles:
            handle.remove()
    return [t / count[0] for t in turned]


def kept_count(n: int, keep: float) -> int:
    """Layers a `keep` share of `n` keeps: the first and the last at least."""
    return max(2, min(n, round(keep * n)))


def choose_layers(importance: list[float], keep: float) -> list[int]:
    n = len(importance)
    wanted = kept_count(n, keep)
    middle = sorted(range(1, n - 1), key=lambda i: -importance[i])[:max(0, wanted - 2)]
    return sorted({0, n - 1, *middle})


def shallow_model(model: torch.nn.Module, keep: list[int], ctx: ForwardContext, args: Any) -> torch.nn.Module:
    """A copy of `model` sharing its weights, with only the `keep` layers, on `ctx`; `args` its
    DecoderArgs (`kept_args`), from which it declares its KV layers and (a hybrid's) states.
    Each kept mixer addresses the draft's caches by its place among the kept layers of its kind:
    an attention layer its KV layer, a linear-attention layer its state's tensors."""
    def clone(module: torch.nn.Module) -> torch.nn.Module:
        twin = copy.copy(module)
        twin._modules, twin._parameters, twin._buffers = (dict(module._modules), dict(module._parameters),
                                                          dict(module._buffers))
        return twin

    layers, counts = [], {"self_attn": 0, "linear_attn": 0}
    for old_index in keep:
        layer = clone(model.model.layers[old_index])
        name = _mixer_name(layer)
        mixer = clone(getattr(layer, name))
        mixer.ctx = ctx
        if name == "self_attn":
            mixer.layer_idx = counts[name]
        else:
            mixer.index, mixer.verified = counts[name], None
        counts[name] += 1
        setattr(layer, name, mixer)
        layers.append(layer)
    top, inner = clone(model), clone(model.model)
    inner.layers = torch.nn.ModuleList(layers)
    top.model, top.args = inner, args
    return top


def kept_args(args: Any, keep: list[int]) -> Any:
    """The target's DecoderArgs for the `keep` layers only: the per-layer fields (rotary, sliding
    window, sparse or dense MLP, a hybrid's linear or full attention) follow their layers."""
    def pick(values):
        return tuple(values[i] for i in keep)

    moe = None if args.moe is None else dataclasses.replace(args.moe, layers=pick(args.moe.layers))
    linear = args.linear_attention
    linear = None if linear is None else dataclasses.replace(linear, layers=pick(linear.layers))
    return dataclasses.replace(args, num_layers=len(keep), ropes=pick(args.ropes),
                               sliding_windows=pick(args.sliding_windows), moe=moe, linear_attention=linear)


class LayerSkipDrafter(DraftModelDrafter):
    """`DraftModelDrafter` on the target's own layers (a `keep` share of them); a hybrid target's
    draft keeps its own states for the linear-attention layers it runs, as a hybrid draft model."""

    method = "layer_skip"

    def __init__(self, engine: Any, keep: float = DEFAULT_KEEP, layers: list[int] | None = None,
                 num_blocks: int | None = None, kv_share: float = DRAFT_KV_SHARE) -> None:
        from hibana_core.surgery.guard import heldout_documents

        check_reserved(engine, self.method)
        n = engine.model_args.num_layers
        if layers is None:
            if not 0 < keep < 1:
                raise ConfigError(f"layer_skip: keep must lie in (0, 1), got {keep!r}")
            documents = heldout_documents(engine.tokenizer, engine.vocab_size,
                                          max_positions=engine.model_args.max_position_embeddings)
            layers = choose_layers(layer_importance(engine, documents), keep)
        if not layers or sorted(set(layers)) != list(layers) or layers[0] < 0 or layers[-1] >= n:
            raise ConfigError(f"layer_skip: layers must be increasing indices below {n}, got {layers!r}")
        if len(layers) == n:  # a 2-layer model (the first and the last are kept), keep=1.0, every layer named
            warnings.warn(f"layer_skip keeps all {n} layers of this model, so each drafted token costs a whole "
                          "forward of the target; suffix or ngram drafting costs next to nothing", stacklevel=2)
        self.layers = list(layers)
        ctx = ForwardContext()
        args = kept_args(engine.model_args, self.layers)
        model = shallow_model(engine.model, self.layers, ctx, args)
        loaded = LoadedModel(model, args, engine.hf_config, engine.tokenizer, tuple(engine.eos_token_ids),
                             engine.dtype, 0, "")
        super().__init__(engine, model=f"layer_skip({len(self.layers)}/{n} layers)", num_blocks=num_blocks,
                         kv_share=kv_share, loaded=loaded, ctx=ctx)

    def summary(self) -> dict:
        return {**super().summary(), "layers_kept": self.layers}
