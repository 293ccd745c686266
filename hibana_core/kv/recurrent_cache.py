"""The tensors of a hybrid model's recurrent states (`kv.recurrent`): one slot per state, every
linear-attention layer's, on the device.

    conv   [slots, conv_dim, kernel - 1]   model dtype, one tensor per linear layer
    ssm    [slots, Hv, Dk, Dv]             float32, one tensor per linear layer
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


STATE_TENSORS = ("conv", "ssm")
"""A slot's tensors as `RecurrentCache.read` gives them, each stacked over the linear layers."""


def file_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A slot's tensors as state files and spill files hold them, beside "kv": "recurrent.conv", "recurrent.ssm"."""
    return {f"recurrent.{name}": state[name].contiguous() for name in STATE_TENSORS}


def from_file_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """`file_tensors` read back (None where the file holds no linear-attention state)."""
    if f"recurrent.{STATE_TENSORS[0]}" not in tensors:
        return None
    return {name: tensors[f"recurrent.{name}"] for name in STATE_TENSORS}


@dataclass(frozen=True)
class RecurrentShape:
    """One linear-attention layer's state, as the model declares it."""

    conv_dim: int      # channels of the short convolution (q, k and v projections side by side)
    conv_width: int    # its kernel size; the state holds kernel - 1 inputs
    heads: int         # value heads (the matrix state's first dim)
    key_dim: int
    value_dim: int

    def nbytes(self, dtype: torch.dtype) -> int:
        """One slot's bytes of this layer (the conv state in `dtype`, the matrix in float32)."""
        conv = self.conv_dim * (self.conv_width - 1) * dtype.itemsize
        return conv + self.heads * self.key_dim * self.value_dim * 4


class RecurrentCache:
    """The slots' tensors of every linear layer, on the device: `num_slots` for states, and one
    more, `scratch`, for steps that belong to no state (the step-cost profile)."""

    def __init__(self, shapes: list[RecurrentShape], num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.num_slots, self.scratch = num_slots, num_slots
        num_slots += 1
        self.conv = [torch.zeros(num_slots, s.conv_dim, s.conv_width - 1, dtype=dtype, device=device) for s in shapes]
        self.ssm = [torch.zeros(num_slots, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device)
                    for s in shapes]

    @staticmethod
    def slot_bytes(shapes: list[RecurrentShape], dtype: torch.dtype) -> int:
        """What one slot takes across all layers."""
        return sum(s.nbytes(dtype) for s in shapes)

    @property
    def bytes_per_slot(self) -> int:
        """What one of this cache's slots takes across all layers."""
        return self.slot_bytes(self.shapes, self.dtype)

    @property
    def nbytes(self) -> int:
        return (self.num_slots + 1) * self.bytes_per_slot

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) of the index-th linear layer."""
        return self.conv[index], self.ssm[index]

    def copy(self, src: int, dst: int) -> None:
        """Slot dst := slot src, every layer (stream-ordered after the steps that wrote src)."""
        for conv, ssm in zip(self.conv, self.ssm):
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

    def copy_many(self, src: list[int], dst: list[int]) -> None:
        """Slots dst[i] := src[i], every layer, in two launches a layer whatever their count."""
        if not src:
            return
        s, d = (torch.tensor(x, dtype=torch.long).to(self.device, non_blocking=True) for x in (src, dst))
        for conv, ssm in zip(self.conv, self.ssm):
            conv.index_copy_(0, d, conv.index_select(0, s))
            ssm.index_copy_(0, d, ssm.index_select(0, s))

    def slot_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shapes and dtypes `read` gives (what a state file of this model holds)."""
        return {"conv": ((len(self.conv), *self.conv[0].shape[1:]), self.dtype),
                "ssm": ((len(self.ssm), *self.ssm[0].shape[1:]), torch.float32)}

    def read(self, slot: int) -> dict[str, torch.Tensor]:
        """A slot's tensors, copied to host memory (state files)."""
        return {"conv": torch.stack([c[slot] for c in self.conv]).cpu(),
                "ssm": torch.stack([s[slot] for s in self.ssm]).cpu()}

    def write(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        for i, (conv, ssm) in enumerate(zip(self.conv, self.ssm)):
            conv[slot].copy_(tensors["conv"][i])
            ssm[slot].copy_(tensors["ssm"][i])


class VerifyStash:
    """Static buffers in which a CUDA graph's verify step leaves, per linear layer, what the commit
    of its kept rows reads (`GatedDeltaNet.commit`): the convolution's inputs and outputs (k and v
    among them), g and beta, for up to `rows` rows. An eager step's tensors live until the commit
    by reference; a graph's would be the graph pool's, shared with the graphs captured after it."""

    def __init__(self, shapes: list[RecurrentShape], rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = rows
        self.inputs = [torch.zeros(rows, s.conv_dim, dtype=dtype, device=device) for s in shapes]
        self.outputs = [torch.zeros(rows, s.conv_dim, dtype=dtype, device=device) for s in shapes]
        self.g = [torch.zeros(rows, s.heads, dtype=torch.float32, device=device) for s in shapes]
        self.beta = [torch.zeros(rows, s.heads, dtype=dtype, device=device) for s in shapes]

    @staticmethod
    def row_bytes(shapes: list[RecurrentShape], dtype: torch.dtype) -> int:
        """A row's bytes across all layers."""
        return sum(2 * s.conv_dim * dtype.itemsize + s.heads * (4 + dtype.itemsize) for s in shapes)

    def layer(self, index: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv inputs, conv outputs, g, beta) of the index-th linear layer's first `rows` rows."""
        if rows > self.rows:
            raise ValueError(f"a verify stash of {self.rows} rows cannot hold a step of {rows}")
        return self.inputs[index][:rows], self.outputs[index][:rows], self.g[index][:rows], self.beta[index][:rows]
