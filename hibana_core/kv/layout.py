"""How the model's layers share KV pages: one group of layers per block table.

A model whose layers all attend to the whole history keeps one group: a block (page) holds the
keys and values of every layer for `block_size` positions, and a state has one block table.
Models that mix sliding-window and full-attention layers (gpt-oss alternates them, Gemma 3 has
five local layers per global one) keep the layers of each kind in groups of equal size, so that
every group's pages are the same bytes and come from one pool (vLLM's hybrid allocator works
alike):

    gpt-oss-20b, 24 layers:    full  [1 3 5 ... 23]         window [0 2 4 ... 22]      2 groups of 12
    Gemma 3 12B, 48 layers:    full  [5 11 ... 47]          window x5 [0-4 6-10 ...]   6 groups of 8

A state holds one block table per group. A window group's table frees the blocks that fell out of
its window and points them at `NULL_BLOCK` (a zeroed block that is never handed out), so a long
history costs full KV only on its full-attention layers. A window at least as long as the
model's context frees nothing: such layers join the full ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

NULL_BLOCK = 0
"""The block a window group's table points at for positions outside its window (reserved by the
pool when the layout has window groups; its bytes are zeros, so kernels that read whole blocks
and mask by position read finite values)."""


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: `layers[i]` lives in slot i of a page."""

    window: int | None          # every layer's sliding window; None: full attention
    layers: tuple[int, ...]
    sink_tokens: int = 0        # under a window, the first tokens every query still sees (their blocks stay)


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    page_layers: int            # slots of a page: the largest group (smaller groups leave slots unused)
    _place: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        place = {layer: (g, slot) for g, group in enumerate(self.groups) for slot, layer in enumerate(group.layers)}
        object.__setattr__(self, "_place", place)

    @classmethod
    def plain(cls, num_layers: int) -> "KVLayout":
        """Every layer in one group, no window: the layout of models without sliding windows."""
        return cls((KVGroup(None, tuple(range(num_layers))),), num_layers)

    @classmethod
    def for_windows(cls, windows: Sequence[int | None], max_model_len: int,
                    sink_tokens: Sequence[int] | None = None) -> "KVLayout":
        """The layout of a model whose layer i has sliding window `windows[i]` (None: full) and,
        under it, `sink_tokens[i]` first tokens that stay visible (default none). Layers of one
        kind are split into groups as large as the smallest kind (the last group of a kind may be
        smaller)."""
        sinks = sink_tokens or [0] * len(windows)
        kinds: dict[tuple[int, int] | None, list[int]] = {}
        for layer, (window, sink) in enumerate(zip(windows, sinks)):
            full = window is None or window + sink >= max_model_len
            kinds.setdefault(None if full else (window, sink), []).append(layer)
        order = sorted(kinds, key=lambda kind: (kind is not None, kind or (0, 0)))
        if len(kinds) == 1:
            size = len(windows)
        else:
            size = min(len(layers) for layers in kinds.values())
        groups = []
        for kind in order:
            window, sink = kind or (None, 0)
            layers = kinds[kind]
            groups += [KVGroup(window, tuple(layers[i:i + size]), sink) for i in range(0, len(layers), size)]
        return cls(tuple(groups), size)

    @classmethod
    def of_model(cls, model: Any, max_model_len: int, num_layers: int) -> "KVLayout":
        """The layout of a loaded model of `num_layers` layers, read from its `attention_layers`:
        their `sliding_window` and `sink_tokens` as surgery left them; one plain group where the
        model has no such layers (a plugin's)."""
        layers = attention_layers(model)
        if [m.layer_idx for m in layers] != list(range(num_layers)):
            return cls.plain(num_layers)
        return cls.for_windows([m.sliding_window for m in layers], max_model_len,
                               [getattr(m, "sink_tokens", 0) for m in layers])

    @property
    def num_layers(self) -> int:
        return len(self._place)

    @property
    def windowed(self) -> bool:
        """Whether any group frees the blocks outside a window (the pool then reserves NULL_BLOCK)."""
        return any(g.window is not None for g in self.groups)

    def in_blocks(self, pages: int, *, up: bool = False) -> int:
        """`pages` of the pool in the blocks `kv_device_blocks` counts (each of every layer: n of
        them are ceil(n * num_layers / page_layers) pages), rounded down or (`up`) up: what
        `EngineStats` and `StateInfo` report, so that `kv_device_blocks=n` reads back as n."""
        layers = pages * self.page_layers
        return -(-layers // self.num_layers) if up else layers // self.num_layers

    def counted(self, pages: int, *, fewest: bool = False) -> str:
        """`pages` of the pool as error messages say them: in the blocks `kv_device_blocks` counts
        (each of every layer: n of them are ceil(n * num_layers / page_layers) pages) and, where a
        page holds fewer layers, the pages after them; the blocks the pages hold, or (`fewest`) the
        fewest blocks whose pool has that many pages."""
        if self.page_layers == self.num_layers:
            return str(pages)
        blocks = self.in_blocks(pages, up=fewest)
        return f"{blocks} ({pages} pages of {self.page_layers} of the {self.num_layers} layers)"

    def describe(self) -> list | None:
        """The layout as JSON-able lists (window, layers, sink tokens per group), for state
        files; None for one group without a window (every layer's KV in every page)."""
        if len(self.groups) == 1 and not self.windowed:
            return None
        return [[g.window, list(g.layers), g.sink_tokens] for g in self.groups]

    @property
    def sink_tokens(self) -> tuple[int, ...]:
        """Each group's sink tokens."""
        return tuple(g.sink_tokens for g in self.groups)

    def sink_blocks(self, block_size: int) -> tuple[int, ...]:
        """Each group's sink blocks: the leading blocks its window keeps."""
        return tuple(-(-g.sink_tokens // block_size) for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a model layer."""
        return self._place[layer]


def attention_layers(model: Any) -> list[Any]:
    """The model's attention layers (the modules that take KV scales: `set_kv_scales`), by
    `layer_idx`: what the KV layout, kv8's scales and the window pass read and rewrite."""
    return [m for _, m in sorted(((m.layer_idx, m) for m in model.modules() if hasattr(m, "set_kv_scales")),
                                 key=lambda item: item[0])]
