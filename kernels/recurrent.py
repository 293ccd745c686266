"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): plain-torch references (CPU path, oracle).

A linear-attention layer keeps no KV cache: each sequence carries two fixed-size states, the short
convolution's last K-1 inputs and the delta rule's matrix, in slots of the layer's state tensors.
A step packs the rows of all its sequences back to back, as attention's does:

    rows:       | seq 0: 5 rows | seq 1: 1 | seq 2: 3 |    query_start_loc = [0, 5, 6, 9]
    slots:        3               0          -1            -1: no slot; skipped, its output rows zero
    has_state:    False           True       (any)         False: starts at position 0, from zeros

A sequence with a slot reads its state there (when `has_state`), runs its rows, and with `write`
leaves there the state after its last row; a sequence with no rows reads and writes nothing.
A verify step of speculative decoding runs with write=False: which rows are kept is known only
after sampling, and `conv_advance` / `gated_delta_advance` then apply the kept rows alone.

The arithmetic is transformers' (`modeling_qwen3_5`): the convolution in the weight's dtype, its
activation there, cast to the rows' dtype; the delta rule in float32 on L2-normalised q and k, the
state float32, the output cast to v's dtype. The layer's per-head gates (`gdn_gates`) and its
closing gated RMSNorm (`gated_rms_norm`) are here too: a handful of small torch ops each, one
launch each on the GPU, every rounding transformers'.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

CHUNK = 64
"""Rows per chunk of the delta rule's chunked form (transformers' `chunk_size`)."""
L2_EPS = 1e-6
ACTIVATIONS = ("silu", None)
SOFTPLUS_THRESHOLD = 20.0
"""F.softplus's default: above it, softplus(x) is x."""


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d takes activation 'silu' or None, not {activation!r}")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                  query_start_loc: torch.Tensor, activation: str | None = "silu",
                  write: bool = True, skip: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  x_copy: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of packed rows, each sequence continuing from its state.

    x: [T, C]; weight: [C, K]; bias: [C] or None; conv_state: [S, C, K-1] in x's dtype, a
    sequence's K-1 inputs before its first row. Returns y [T, C] in x's dtype: activation(conv of
    (previous K-1 inputs ++ rows)), computed in the weight's dtype as transformers'
    `causal_conv1d_update` does. `write`: the slot then holds the last K-1 inputs of
    (previous ++ rows), part of the previous state where a sequence has fewer than K-1 rows.

    skip: [B] int32 or None, rows at the front of each sequence's that are none of its own (a
    CUDA graph's padding): left out, as if its rows began after them. out: y's buffer ([T, C] or
    more rows; rows outside the sequences' are left as they are), else zeros. x_copy: [T, C] or
    more rows, where the sequences' rows of x are copied (a verify step's stash for `conv_advance`)."""
    check_activation(activation)
    y = torch.zeros_like(x) if out is None else out
    for slot, has, start, end in _sequences(slots, has_state, query_start_loc, skip=skip):
        if x_copy is not None:
            x_copy[start:end] = x[start:end]
        inputs = _with_previous(conv_state, slot, has, x[start:end])  # [C, K-1 + rows]
        out = F.conv1d(inputs.to(weight.dtype)[None], weight[:, None], bias, groups=x.shape[1])[0]
        if activation == "silu":
            out = F.silu(out)
        y[start:end] = out.t().to(x.dtype)
        if write:
            conv_state[slot] = _last(inputs, conv_state.shape[-1])
    return y


def conv_advance(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                 query_start_loc: torch.Tensor, counts: torch.Tensor,
                 has_state: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """After a `causal_conv1d(..., write=False)` step over x, the state `write=True` over the
    first counts[b] rows of each sequence alone would have left: the last K-1 inputs of
    (previous ++ those rows). counts: [B] int32, at most each sequence's rows; 0 leaves the slot
    as it is. has_state: as the step's (None: every slot holds its sequence's state). skip: as
    `causal_conv1d`'s, the rows counted from after them."""
    for slot, has, start, end in _sequences(slots, has_state, query_start_loc, counts, skip):
        conv_state[slot] = _last(_with_previous(conv_state, slot, has, x[start:end]), conv_state.shape[-1])


def _with_previous(conv_state: torch.Tensor, slot: int, has: bool, rows: torch.Tensor) -> torch.Tensor:
    """[C, K-1 + rows]: the slot's previous inputs (zeros for a fresh sequence), then the rows."""
    previous = conv_state[slot] if has else torch.zeros_like(conv_state[slot])
    return torch.cat((previous, rows.t()), dim=-1)


def _last(inputs: torch.Tensor, width: int) -> torch.Tensor:
    return inputs[:, inputs.shape[-1] - width:]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor, query_start_loc: torch.Tensor,
                     write: bool = True, skip: torch.Tensor | None = None,
                     max_rows: int | None = None) -> torch.Tensor:
    """The gated delta rule over packed rows, each sequence continuing from its state.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv], Hv a multiple of Hk (each q/k head serves Hv // Hk
    consecutive v heads); g: [T, Hv] log decay (<= 0); beta: [T, Hv]; state: [S, Hv, Dk, Dv]
    float32. Per token, with q and k L2-normalised and q scaled by Dk ** -0.5:

        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q

    Returns o [T, Hv, Dv] in v's dtype (zeros outside the sequences' rows); `write`: the slot then
    holds the state after the sequence's last row; skip: as `causal_conv1d`'s. A sequence of
    several rows runs the chunked form (transformers' `torch_chunk_gated_delta_rule`), a single row
    the recurrent one: the same to float32 rounding. max_rows: the caller's bound on any
    sequence's rows, by which the Triton kernels pick their form; not read here (each sequence's
    rows are counted on the host)."""
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    group = v.shape[1] // k.shape[1]
    for slot, has, start, end in _sequences(slots, has_state, query_start_loc, skip=skip):
        rows = slice(start, end)
        initial = state[slot] if has else torch.zeros_like(state[slot])
        form = _chunked if end - start > 1 else _recurrent
        out, final = form(_unit(q[rows], group) * q.shape[-1] ** -0.5, _unit(k[rows], group), v[rows].float(),
                          g[rows].float(), beta[rows].float(), initial)
        o[rows] = out.to(v.dtype)
        if write:
            state[slot] = final
    return o


def gated_delta_advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                        counts: torch.Tensor, has_state: torch.Tensor | None = None,
                        skip: torch.Tensor | None = None) -> None:
    """After a `gated_delta_rule(..., write=False)` step, the state `write=True` over the first
    counts[b] rows of each sequence alone would have left, token by token (the recurrent form).
    counts: [B] int32, at most each sequence's rows; 0 leaves the slot as it is. has_state: as
    the step's (None: every slot holds its sequence's state); skip: as `causal_conv1d`'s."""
    group = v.shape[1] // k.shape[1]
    for slot, has, start, end in _sequences(slots, has_state, query_start_loc, counts, skip):
        rows = slice(start, end)
        initial = state[slot] if has else torch.zeros_like(state[slot])
        _, state[slot] = _recurrent(None, _unit(k[rows], group), v[rows].float(), g[rows].float(),
                                    beta[rows].float(), initial)


def _unit(x: torch.Tensor, group: int) -> torch.Tensor:
    """[n, Hk, D] -> [n, Hk * group, D] float32, L2-normalised over D (transformers' `l2norm`), each
    head repeated for the `group` v heads it serves."""
    x = x.float()
    x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
    return x.repeat_interleave(group, dim=1)


def _recurrent(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               s: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Token by token: (o [n, H, Dv] or None without q, the final state [H, Dk, Dv]).
    q, k: [n, H, Dk] float32; v: [n, H, Dv]; g, beta: [n, H]; s: [H, Dk, Dv]."""
    o = None if q is None else torch.empty_like(v)
    for t in range(k.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = (s * k[t][:, :, None]).sum(1)  # [H, Dv]: what the state recalls for k
        s = s + k[t][:, :, None] * (beta[t][:, None] * (v[t] - kv_mem))[:, None, :]
        if o is not None:
            o[t] = (s * q[t][:, :, None]).sum(1)
    return o, s


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_recurrent` in chunks of CHUNK rows, a few matmuls each. Within a chunk, with G_t the
    cumulative log decay up to row t and D[t, j] = exp(G_t - G_j) (j <= t), the state's updates
    u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{j<t} D[t, j] (k_t . k_j) u_j) solve one unit
    lower-triangular system; then o_t = exp(G_t) S0^T q_t + sum_{j<=t} D[t, j] (q_t . k_j) u_j and
    S = exp(G_last) S0 + sum_j D[last, j] k_j u_j^T."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, n, D]
    g, beta = g.t(), beta.t()  # [H, n]
    o = torch.empty_like(v)
    for c in range(0, q.shape[1], CHUNK):
        rows = slice(c, c + CHUNK)
        qc, kc, vc, bc = q[:, rows], k[:, rows], v[:, rows], beta[:, rows, None]
        decay = g[:, rows].cumsum(-1)  # [H, c]: G
        n = decay.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        pair = (decay[:, :, None] - decay[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, c, c]: D
        system = (bc * kc @ kc.transpose(-1, -2)) * pair  # its diagonal is not read (unitriangular)
        u = torch.linalg.solve_triangular(system, bc * (vc - decay.exp()[..., None] * (kc @ s)),
                                          upper=False, unitriangular=True)  # [H, c, Dv]
        o[:, rows] = decay.exp()[..., None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * pair) @ u
        last = decay[:, -1:]  # [H, 1]
        s = s * last.exp()[..., None] + (kc * (last - decay).exp()[..., None]).transpose(-1, -2) @ u
    return o.transpose(0, 1), s


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's gates of each row and value head: (g, beta).

    a, b: [T, Hv] in the model dtype (any row stride: views of the fused gate projection);
    a_log, dt_bias: [Hv]. g = -exp(a_log) * softplus(a + dt_bias) [T, Hv] float32, the log decay
    `gated_delta_rule` takes (a_log's exp in float32: in fp16 it could overflow; a + dt_bias
    float32 by type promotion; softplus with its threshold 20); beta = sigmoid(b) [T, Hv] in b's
    dtype (computed in float32 and rounded once, as torch does for 16-bit floats). transformers'
    two lines, as they are. out: (g, beta)'s buffers, [T, Hv] each, written and returned."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    if out is not None:
        out[0].copy_(g)
        out[1].copy_(beta)
        return out
    return g, beta


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5RMSNormGated, which closes a Gated DeltaNet layer: RMSNorm of x
    (statistic in float32, the normalised value cast back to x's dtype, times the weight: the
    product rounded to x's dtype for a weight of that dtype), then times silu(gate) in float32,
    cast to x's dtype. x, gate: [..., D] of one shape (gate any view, e.g. z's heads within the
    rows of the wider projection); weight: [D] in x's dtype or float32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def _sequences(slots: torch.Tensor, has_state: torch.Tensor | None, query_start_loc: torch.Tensor,
               counts: torch.Tensor | None = None,
               skip: torch.Tensor | None = None) -> Iterator[tuple[int, bool, int, int]]:
    """(slot, has_state, start, end) of each sequence with a slot and rows to run, as host ints:
    its rows after the first skip[b], or with `counts` the first counts[b] of those. has_state
    None: every slot holds its state."""
    bounds = query_start_loc.tolist()
    num = len(bounds) - 1
    has_state = [True] * num if has_state is None else has_state.tolist()
    counts = [None] * num if counts is None else counts.tolist()
    skip = [0] * num if skip is None else skip.tolist()
    for b, (slot, has, count) in enumerate(zip(slots.tolist(), has_state, counts)):
        start, end = min(bounds[b] + skip[b], bounds[b + 1]), bounds[b + 1]
        if count is not None:
            end = min(end, start + max(count, 0))
        if slot >= 0 and end > start:
            yield slot, has, start, end
