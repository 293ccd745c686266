"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (and Qwen3-Next) hybrid models.

Three of four layers of a Qwen3.5 model mix tokens this way instead of attending: a short causal
convolution over the q/k/v projections, then the gated delta rule, whose state (a matrix per value
head) folds in the whole history, so the layer keeps no KV cache. Its states live in the slots of
the engine's recurrent cache (`hibana_core.kv.recurrent`), addressed by the batch's
`state_slots`; the arithmetic is transformers' (`modeling_qwen3_5.Qwen3_5GatedDeltaNet`) step by
step, through the kernels of `hibana_kernels.recurrent`.

A verify step of speculative decoding (`ForwardBatch.writes_state` False) computes its rows from
the states without changing them and keeps what the states need to fold in the rows that sampling
keeps (`commit`): its own tensors, or in a CUDA graph the static `VerifyStash`, where the graph's
sequences are front-padded (`ForwardBatch.state_skip`: rows the kernels leave out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

import hibana_kernels as kernels
from hibana_core.forward_context import ForwardContext
from hibana_core.kv.recurrent_cache import RecurrentShape


class Verified(NamedTuple):
    """What a verify step leaves for `GatedDeltaNet.commit`: the convolution's input rows, k, v, g
    and beta, and the step's sequences (slots, has_state, row starts, padding rows in front)."""

    inputs: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    slots: torch.Tensor
    has_state: torch.Tensor
    starts: torch.Tensor
    skip: torch.Tensor | None


@dataclass(frozen=True)
class LinearAttentionArgs:
    """The linear-attention layers of a hybrid model, read from its config."""

    layers: tuple[bool, ...]  # per model layer: a linear-attention layer (else full attention)
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    interleaved: bool = False  # the checkpoint's input projections are Qwen3-Next's (`InterleavedGatedDeltaNet`)

    @property
    def shape(self) -> RecurrentShape:
        key_dim = self.num_key_heads * self.key_head_dim
        return RecurrentShape(conv_dim=2 * key_dim + self.num_value_heads * self.value_head_dim,
                              conv_width=self.conv_kernel, heads=self.num_value_heads,
                              key_dim=self.key_head_dim, value_dim=self.value_head_dim)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `index` is its place among the model's linear layers (its
    tensors in the recurrent cache). The checkpoint's four input projections load into two fused
    ones (`fused_sizes`): in_proj_qkv and in_proj_z into `in_proj`, in_proj_b and in_proj_a into
    `in_proj_gates`."""

    def __init__(self, args, linear: LinearAttentionArgs, index: int, ctx: ForwardContext) -> None:
        super().__init__()
        from hibana_core.models.decoder import Linear  # (decoder.py builds these layers)

        self.index, self.ctx = index, ctx
        self.num_key_heads, self.num_value_heads = linear.num_key_heads, linear.num_value_heads
        self.key_head_dim, self.value_head_dim = linear.key_head_dim, linear.value_head_dim
        self.key_dim = linear.num_key_heads * linear.key_head_dim
        self.value_dim = linear.num_value_heads * linear.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = args.rms_norm_eps
        hv = linear.num_value_heads
        self._projections(args, Linear)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, linear.conv_kernel, groups=self.conv_dim, bias=False,
                                padding=linear.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = nn.Module()  # the gated RMSNorm's weight, under the checkpoint's name
        self.norm.weight = nn.Parameter(torch.ones(linear.value_head_dim))
        self.out_proj = Linear(self.value_dim, args.hidden_size, bias=False)
        self.verified: Verified | None = None
        """What the last verify step left for `commit` (a CUDA graph's, recorded at its capture, is
        given back after each replay: the graph's forward ran once, in Python)."""

    def _projections(self, args, linear: type) -> None:
        """Two fused projections, as quantized checkpoints allow: the wide q/k/v and z, and the
        narrow b and a (the per-head gates, which quantization recipes leave in 16 bits)."""
        hv = self.num_value_heads
        self.in_proj = linear(args.hidden_size, self.conv_dim + self.value_dim, bias=False)
        self.in_proj.fused_sizes = (self.conv_dim, self.value_dim)
        self.in_proj_gates = linear(args.hidden_size, 2 * hv, bias=False)
        self.in_proj_gates.fused_sizes = (hv, hv)

    @property
    def _inputs(self) -> tuple[nn.Module, nn.Module]:
        """The two input projections of the normed stream: the wide one, then the narrow one."""
        return self.in_proj, self.in_proj_gates

    def _parts(self, wide: torch.Tensor, narrow: torch.Tensor):
        """(q/k/v for the convolution [T, conv_dim], z [T, value_dim], b and a [T, Hv]) of the two
        projections' outputs."""
        mixed, z = wide.split(self.in_proj.fused_sizes, dim=-1)
        b, a = narrow.split(self.in_proj_gates.fused_sizes, dim=-1)
        return mixed, z, b, a

    def _project(self, x: torch.Tensor, residual: torch.Tensor | None, norm):
        """(mixed, z, b, a) of norm(x + residual), and x + residual. Where the GEMV can fold the
        norm into both projections (one decode row, dense weights: `kernels.folds_norm`), each
        does, the second from the stream the first wrote: two launches, not a norm and two GEMVs
        (the norm is recomputed, the same bits)."""
        wide, narrow = self._inputs
        folds = getattr(norm, "gemv_fold", False) and all(
            layer.kind == "dense" and kernels.folds_norm(x, layer.weight, norm.weight) for layer in (wide, narrow))
        if folds:
            wide_out, residual = wide.after_norm(norm, x, residual)
            narrow_out, _ = narrow.after_norm(norm, residual, None)
            return self._parts(wide_out, narrow_out), residual
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        return self._parts(wide(h), narrow(h)), residual

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over norm(x + residual); returns (its output, x + residual)."""
        tokens = x.shape[0]
        (mixed, z, b, a), residual = self._project(x, residual, norm)
        batch = self.ctx.batch
        conv_state, state = self.ctx.recurrent.layer(self.index)
        slots, has_state, starts, writes = batch.state_slots, batch.has_state, batch.query_start_loc, batch.writes_state
        skip = batch.state_skip  # a verify graph's padding rows, in front of each sequence's
        inputs = conv_out = gates = None
        if batch.state_stash is not None and not writes:  # a verify graph's: what `commit` reads, kept static
            inputs, conv_out, *gates = batch.state_stash.layer(self.index, tokens)
        # mixed [T, conv_dim]: a view of in_proj's rows, which the convolution (and its advance) read strided
        conv = kernels.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), None, conv_state, slots, has_state,
                                     starts, "silu", writes, skip, conv_out, inputs)
        q, k, v = conv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = q.reshape(tokens, self.num_key_heads, self.key_head_dim)
        k = k.reshape(tokens, self.num_key_heads, self.key_head_dim)
        v = v.reshape(tokens, self.num_value_heads, self.value_head_dim)
        g, beta = kernels.gdn_gates(a, b, self.A_log, self.dt_bias, gates)  # [T, Hv]: float32, the model dtype
        o = kernels.gated_delta_rule(q, k, v, g, beta, state, slots, has_state, starts, writes, skip,
                                     batch.max_query_len)  # [T, Hv, Dv]: chunked for a long prefill chunk
        self.verified = None if writes else Verified(mixed if inputs is None else inputs, k, v, g, beta, slots,
                                                      has_state, starts, skip)
        z = z.unflatten(-1, (self.num_value_heads, self.value_head_dim))  # [T, Hv, Dv], a view
        o = kernels.gated_rms_norm(o, z, self.norm.weight, self.eps)
        return self.out_proj(o.reshape(tokens, self.value_dim)), residual

    def commit(self, counts: torch.Tensor, skip: torch.Tensor | None = None) -> None:
        """Fold into each sequence's state counts[b] rows of the last verify step: its first, or
        (`skip`) those after its first skip[b] rows, folded in by the call before."""
        if self.verified is None:
            return
        mixed, k, v, g, beta, slots, has_state, starts, padding = self.verified
        if skip is not None:  # the states hold the rows skipped
            has_state = has_state | (skip > 0)
            padding = skip if padding is None else padding + skip
        conv_state, state = self.ctx.recurrent.layer(self.index)
        kernels.conv_advance(mixed, conv_state, slots, starts, counts, has_state, padding)
        kernels.gated_delta_advance(k, v, g, beta, state, slots, starts, counts, has_state, padding)


class InterleavedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layer: the same arithmetic, its checkpoint's two input projections kept as
    they are (in_proj_qkvz, in_proj_ba), whose rows interleave per key head its q, k, the v and z
    of the value heads it serves, and its b and a; each step reorders them as transformers'
    `fix_query_key_value_ordering` does (a few copies of one token's rows at decode)."""

    def _projections(self, args, linear: type) -> None:
        group = self.num_value_heads // self.num_key_heads
        self.in_proj_qkvz = linear(args.hidden_size, self.num_key_heads * (2 * self.key_head_dim + 2 * group
                                                                           * self.value_head_dim), bias=False)
        self.in_proj_ba = linear(args.hidden_size, 2 * self.num_value_heads, bias=False)

    @property
    def _inputs(self) -> tuple[nn.Module, nn.Module]:
        return self.in_proj_qkvz, self.in_proj_ba

    def _parts(self, wide: torch.Tensor, narrow: torch.Tensor):
        tokens, heads, group = wide.shape[0], self.num_key_heads, self.num_value_heads // self.num_key_heads
        dk, dv = self.key_head_dim, self.value_head_dim
        q, k, v, z = wide.view(tokens, heads, -1).split((dk, dk, group * dv, group * dv), dim=-1)
        b, a = narrow.view(tokens, heads, 2 * group).split((group, group), dim=-1)
        mixed = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        return mixed, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)
