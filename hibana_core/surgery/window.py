"""The sink-plus-window pass ("window"): the full-attention layers that matter least for long
context attend to their first `sink_tokens` tokens and their last `window` tokens only, so their
KV per agent stops growing at sink + window tokens (`kv.layout`: those layers form window groups
whose blocks between the sinks and the window go back to the pool).

    rank     on the calibration text, each full-attention layer alone switched to sink + window
             (a probe window a quarter of the longest document, so that the text reaches past
             it): the increase of the mean negative log-likelihood; the layers whose increase is
             smallest rely least on distant context
    switch   the `layers` share of them (default half) with the smallest increase, or the layers
             named, to `window` and `sink_tokens` (StreamingLLM's attention sinks: the first
             tokens soak up attention that has nowhere else to go; without them a window drifts)

Positions keep their rotary angles (no re-rotation of the cached keys, unlike StreamingLLM's
rolling cache): a switched layer sees exactly the keys it saw before, fewer of them. The guard
measures the cost against the unmodified model on documents joined past `sink_tokens + window`
(`guard_reach`); where the model's positions or the text stop short of that, the pass is refused
unless forced (the record says how long the calibration's documents were).
"""

from __future__ import annotations

import logging
from typing import Any

from hibana_core.errors import ConfigError
from hibana_core.kv.layout import attention_layers

logger = logging.getLogger("hibana.surgery")

DEFAULTS = {"window": 1024, "sink_tokens": 4, "layers": 0.5}


def kv_bytes_per_agent(attentions: list[Any], context: int, per_layer: int) -> int:
    """KV bytes of an agent's `context` tokens: each layer's, a window layer's up to its window
    and sink tokens."""
    return per_layer * sum(context if m.sliding_window is None else min(context, m.sliding_window + m.sink_tokens)
                           for m in attentions)


class SinkWindowPass:
    calibrated = True

    def __init__(self) -> None:
        self.floors = {"ppl_ratio": 1.05, "top1_agreement": 0.93}  # as w4's: a visible but bounded cost
        self.advice = "switch fewer layers (a smaller layers share) or widen the window"

    def check(self, params: dict[str, Any]) -> dict[str, Any]:
        unknown = set(params) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"surgery pass window takes {sorted(DEFAULTS)}, got {sorted(unknown)}")
        params = {**DEFAULTS, **params}
        for key in ("window", "sink_tokens"):
            value = params[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "window" else 0):
                raise ConfigError(f"window: {key} must be an integer >= {1 if key == 'window' else 0}, got {value!r}")
        layers = params["layers"]
        share = isinstance(layers, float) and 0 < layers <= 1
        named = (isinstance(layers, list) and layers and len(set(layers)) == len(layers)
                 and all(isinstance(i, int) and not isinstance(i, bool) for i in layers))
        if not (share or named):
            # (an integer is neither: 1 reads as "all of them" or as "layer 1", so it is said which is which)
            raise ConfigError(f"window: layers is a share of the full-attention layers, a number in (0, 1] written "
                              f"with a point (0.5; 1.0 for all of them), or a non-empty list of distinct layer "
                              f"indices ([1] for layer 1 alone), got {layers!r}")
        return params

    def guard_reach(self, params: dict[str, Any]) -> int:
        """A document's first sink + window tokens attend as before: the guard must score past them."""
        params = self.check(params)
        return params["sink_tokens"] + params["window"]

    def refuse(self, model: Any, params: dict[str, Any]) -> None:
        """A ConfigError where the model has no full-attention layer, or not the ones named."""
        params = self.check(params)
        wanted, reach = params["layers"], params["sink_tokens"] + params["window"]
        full = [m.layer_idx for m in attention_layers(model) if m.sliding_window is None]
        if not full:
            what = getattr(getattr(model, "args", None), "model_type", None) or type(model).__name__
            raise ConfigError("surgery pass window found no full-attention layer to switch (every layer of "
                              f"this {what} model has a sliding window already); leave it out")
        if isinstance(wanted, list) and not set(wanted) <= set(full):
            raise ConfigError(f"window: layers {sorted(set(wanted) - set(full))} are not full-attention "
                              f"layers of this model (those are {full})")
        args = getattr(model, "args", None)
        positions = getattr(args, "max_position_embeddings", None)
        if isinstance(positions, int):
            from hibana_core.loader import context_limit  # (torch: not at import, the manager loads this module)

            positions = context_limit(args)  # a YaRN rope serves past max_position_embeddings (max_model_len may)
        if isinstance(positions, int) and positions <= reach:
            # (sink tokens that fill the positions alone leave no window to take)
            smaller = (f"a window under {positions - params['sink_tokens']}" if params["sink_tokens"] < positions - 1
                       else f"sink_tokens under {positions - 1} (and a window under the positions left)")
            raise ConfigError(f"window: sink_tokens + window ({reach}) covers all {positions} positions of this "
                              f"model, so the pass would change nothing; take {smaller} or leave the pass out")

    def apply(self, model: Any, params: dict[str, Any], calibration: Any) -> dict[str, Any]:
        params = self.check(params)
        self.refuse(model, params)
        window, sinks, wanted = params["window"], params["sink_tokens"], params["layers"]
        attentions = attention_layers(model)
        full = [m.layer_idx for m in attentions if m.sliding_window is None]
        ranking: dict[int, float] = {}
        probe = None
        if isinstance(wanted, list):
            chosen = sorted(set(wanted))
        else:
            probe, ranking = rank_layers(attentions, full, window, sinks, calibration)
            count = max(1, round(wanted * len(full)))
            chosen = sorted(sorted(full, key=lambda i: ranking[i])[:count])
        fp8 = any(getattr(m, "kv_scale", None) is not None for m in attentions)  # after kv8: a byte an element
        per_layer = 2 * calibration.args.num_kv_heads * calibration.args.head_dim * (1 if fp8 else calibration.dtype.itemsize)
        contexts = (8192, 32768)
        before = [kv_bytes_per_agent(attentions, c, per_layer) for c in contexts]
        for index in chosen:
            layer = attentions[index]
            layer.sliding_window, layer.sink_tokens = window, sinks
            layer.surgery_window = (window, sinks)  # what `hibana surgery` writes to its manifest
        longest = max(map(len, calibration.documents))
        if longest <= window + sinks:
            logger.warning("surgery window: the calibration documents (up to %d tokens) are shorter than "
                           "sink_tokens + window (%d): the guard's figures cannot show the pass's cost; "
                           "measure it on longer text", longest, window + sinks)
        return {"layers": chosen, "window": window, "sink_tokens": sinks, "full_layers_before": len(full),
                "probe_window": probe, "nll_increase": {str(i): round(v, 5) for i, v in sorted(ranking.items())},
                "longest_calibration_document": longest, "calibration": calibration.source,
                "kv_bytes_per_agent": {str(c): [b, kv_bytes_per_agent(attentions, c, per_layer)]
                                       for c, b in zip(contexts, before)}}


def rank_layers(attentions: list[Any], full: list[int], window: int, sinks: int,
                calibration: Any) -> tuple[int, dict[int, float]]:
    """(probe window, per full-attention layer the mean NLL increase on the calibration text when
    that layer alone attends to `sinks` first tokens and the probe window)."""
    from hibana_core.surgery import progress_bar
    from hibana_core.surgery.guard import Scorer

    documents = calibration.documents
    longest = max(map(len, documents))
    probe = max(1, min(window, longest // 4))
    scorer = Scorer(calibration.model, calibration.ctx, calibration.args, calibration.dtype, calibration.device,
                    longest)

    def nll() -> float:
        total, count = 0.0, 0
        for doc in documents:
            total += scorer.nll(doc)
            count += len(doc) - 1
        return total / max(count, 1)

    base = nll()
    ranking = {}
    for index in progress_bar(full, desc="surgery window: ranking layers", unit="layer", leave=False):
        layer = attentions[index]
        layer.sliding_window, layer.sink_tokens = probe, sinks
        try:
            ranking[index] = nll() - base
        finally:
            layer.sliding_window, layer.sink_tokens = None, 0
    return probe, ranking
