"""Compute kernels: each Triton kernel sits beside a plain-torch reference with the same signature.

    kernels/<name>.py          plain-torch references: the CPU path, and the oracle in the tests
    kernels/<name>_triton.py   Triton kernels, imported only when a CUDA tensor arrives

`hibana_core` calls the dispatching functions below: Triton for CUDA tensors when triton imports,
the references otherwise (CPU, or no triton), so nothing here needs triton to import or run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path


def _yield_the_name() -> None:
    """This folder imported as `kernels`: the repository's root is on sys.path (`python -m` run
    there, pytest), and `kernels` is another project's package (Hugging Face's, which transformers
    imports when it is installed). The import gets that package, found past this checkout; where
    none is installed, a module that reads as nothing installed. Hibana's own name is
    `hibana_kernels`."""
    root = Path(__file__).resolve().parent.parent
    others = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        sys.modules["kernels"] = _nothing_installed()
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what the import statement returns, once this file is run
    spec.loader.exec_module(module)


def _nothing_installed() -> types.ModuleType:
    """`kernels` where no package of that name is installed. Not an ImportError: transformers finds
    this folder by `find_spec`, finds no metadata, and imports the name to tell an editable install
    from a stray folder; an error there fails every model load. It takes a module with no `__file__`
    and no `__version__` (a namespace package's reading) as nothing installed, and so does a
    `from kernels import ...`, an ImportError here."""
    module = types.ModuleType("kernels", "No package named 'kernels' is installed "
                                         "(this checkout's kernels/ folder is hibana_kernels).")
    module.__spec__ = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
    module.__path__ = []

    def __getattr__(name: str):
        raise AttributeError(f"module 'kernels' has no attribute {name!r}: no package named 'kernels' is "
                             "installed (this checkout's kernels/ folder is hibana_kernels)")

    module.__getattr__ = __getattr__
    return module


if __name__ == "kernels":
    _yield_the_name()

import torch  # noqa: E402 (under `kernels`, the rest runs on a module no one holds: the cost of
#             importing torch and hibana_kernels, run from the repository root only)

from hibana_kernels import activation, attention, matmul, moe, norm, quant, recurrent, rotary
from hibana_kernels.moe import MoEExperts
from hibana_kernels.rotary import AttentionPrologue

__all__ = ["AttentionPrologue", "MoEExperts", "a8_order", "causal_conv1d", "conv_advance", "folds_a8", "folds_glu",
           "fused_add_rms_norm", "fused_moe", "fused_moe_a8", "gated_delta_advance", "gated_delta_rule",
           "gated_rms_norm", "gdn_gates", "gelu_tanh_and_mul", "linear", "linear_a8", "linear_fp8", "linear_int4",
           "linear_int8", "moe_folds_a8", "moe_norm_route", "moe_route", "mxfp4_dequantize", "paged_attention",
           "paged_attention_a8", "qk_norm_rotary_store", "rms_norm", "rms_norm_a8", "rms_norm_linear",
           "rotary_embedding", "silu_and_mul", "silu_and_mul_a8", "silu_and_mul_linear", "store_kv",
           "triton_available"]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton(module: str, tensor: torch.Tensor):
    """The Triton module for `tensor`, or None when the reference should run."""
    if tensor.is_cuda and triton_available():
        return importlib.import_module(f"hibana_kernels.{module}_triton")
    return None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, sliding_window: int | None = None,
                    uniform_query_len: bool = False, kv_scale: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, sink_tokens: int = 0,
                    prologue: AttentionPrologue | None = None) -> torch.Tensor:
    """Causal attention of packed varlen queries [T, H, D] over the paged KV cache (an fp8 cache
    with its `kv_scale`; per-head attention `sinks` [H]; with a sliding window, the first
    `sink_tokens` keys kept visible); see `hibana_kernels.attention.paged_attention`. With a
    `prologue`, q is the projection's and the layer's prologue (`qk_norm_rotary_store`: q/k norms,
    rotary, the new keys and values into the cache) runs first: inside the decode kernel on the
    GPU where the fusion policy folds it (`Fusion.attention_prologue`), the same results."""
    impl = _triton("attention", q)
    if impl is not None:
        return impl.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                    max_query_len, max_seq_len, scale, sliding_window, uniform_query_len,
                                    kv_scale, sinks, sink_tokens, prologue=prologue)
    if prologue is not None:
        q = prologue.run(rotary, q, k_cache, v_cache, kv_scale)
    return attention.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     max_query_len, max_seq_len, scale, sliding_window, uniform_query_len,
                                     kv_scale, sinks, sink_tokens)


def paged_attention_a8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                       scale: float, sliding_window: int | None, uniform_query_len: bool,
                       kv_scale: torch.Tensor | None, sinks: torch.Tensor | None, sink_tokens: int,
                       order: int, prologue: AttentionPrologue | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(`paged_attention`'s output, q, d): its rows [T, H * D] also as x's int8 codes in `order`
    for the output projection's x int8 GEMV (`linear_a8`), written by the decode's split merge
    where it runs (else one quantize launch). CUDA only: where `folds_a8` says so."""
    return importlib.import_module("hibana_kernels.attention_triton").paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
        sliding_window, uniform_query_len, kv_scale, sinks, sink_tokens, a8_order=order, prologue=prologue)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Write new keys/values [T, H_kv, D] to their cache slots (negative slot: skipped; an fp8
    cache: quantized with `kv_scale`)."""
    impl = _triton("attention", k) or attention
    impl.store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             cast_last: bool = False) -> torch.Tensor:
    """Hugging Face's RMSNorm over the last dim (`unit_offset`: Gemma's, by 1 + weight; `cast_last`:
    gpt-oss's, the weight's product in float32; see `norm`)."""
    return (_triton("norm", x) or norm).rms_norm(x, weight, eps, unit_offset, cast_last)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, unit_offset: bool = False,
                       cast_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), out of place."""
    return (_triton("norm", x) or norm).fused_add_rms_norm(x, residual, weight, eps, unit_offset, cast_last)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by position (rotate_half convention), out of place."""
    impl = _triton("rotary", q) or rotary
    return impl.rotary_embedding(positions, q, k, cos_table, sin_table)


def attention_prologue(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       prologue: AttentionPrologue, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`prologue` (what `paged_attention` runs first) as its own launch: the rotated q, the keys and
    values stored; for a layer that changes q between the two (Ministral 3's query scale)."""
    return prologue.run(_triton("rotary", q) or rotary, q, k_cache, v_cache, kv_scale)


def qk_norm_rotary_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                         eps: float = 0.0, kv_scale: torch.Tensor | None = None,
                         unit_offset: bool = False) -> torch.Tensor:
    """An attention layer's prologue (q/k norm when weights are given, Gemma's with `unit_offset`;
    rotary on the first cos_table.shape[-1] dims of each head; K/V stored, into an fp8 cache
    quantized with `kv_scale`); returns the rotated q. See
    `hibana_kernels.rotary.qk_norm_rotary_store`."""
    impl = _triton("rotary", q) or rotary
    return impl.qk_norm_rotary_store(positions, q, k, v, cos_table, sin_table, k_cache, v_cache,
                                     slot_mapping, q_weight, k_weight, eps, kv_scale, unit_offset)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           glu: str | None = None) -> torch.Tensor:
    """x @ weight^T + bias; decode-sized bf16/fp16 batches take a Triton GEMV on CUDA. With
    `glu` ("silu", "gelu_tanh") the weight is a fused [gate | up] [2I, K] and the result
    act(gate) * up [..., I]: in the GEMV's epilogue where `folds_glu` says."""
    return (_triton("matmul", x) or matmul).linear(x, weight, bias, glu)


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    glu: str | None = None, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual), or (linear(rms_norm(x)), x) without a
    residual: one kernel where `hibana_kernels.fusion` folds the norm into the GEMV (`glu` as
    `linear`'s; `unit_offset`: Gemma's norm, as `rms_norm`'s)."""
    impl = _triton("matmul", x) or matmul
    return impl.rms_norm_linear(x, residual, norm_weight, eps, weight, bias, glu, unit_offset)


def folds_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether `rms_norm_linear` of x through `weight` after a norm of `norm_weight` is one launch
    (one decode row on the Triton GEMV, where `hibana_kernels.fusion` takes the width)."""
    return (_triton("matmul", x) or matmul).folds_norm(x, weight, norm_weight)


def folds_glu(x: torch.Tensor, weight: torch.Tensor, glu: str) -> bool:
    """Whether a gate/up projection of x takes its activation `glu` into the GEMV (`linear(...,
    glu=)`): one decode row on the Triton GEMV, where `hibana_kernels.fusion` takes the width.
    Then an MLP applies the activation there rather than folding it into the down GEMV."""
    return (_triton("matmul", x) or matmul).folds_glu(x, weight, glu)


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) of a fused [..., 2 * K] gate/up projection: one kernel where
    `hibana_kernels.fusion` folds the activation into the GEMV."""
    return (_triton("matmul", gate_up) or matmul).silu_and_mul_linear(gate_up, weight, bias)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias for a per-channel int8 weight; see `hibana_kernels.quant`."""
    return (_triton("quant", x) or quant).linear_int8(x, qweight, scales, bias)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias for a group-wise asymmetric int4 weight; see `hibana_kernels.quant`."""
    return (_triton("quant", x) or quant).linear_int4(x, qweight, scales, zeros, group_size, bias)


def linear_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias for an e4m3 weight with a float32 scale per (bn, bk) block; see
    `hibana_kernels.quant`."""
    return (_triton("quant", x) or quant).linear_fp8(x, qweight, scales, block, bias)


def folds_a8(x: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether the kernel writing the k-wide input of an int8 (group_size 1) or int4 linear layer
    from x (a tensor of the step's rows) hands the layer that input as int8 codes (`rms_norm_a8`,
    `silu_and_mul_a8`, `paged_attention_a8`, then `linear_a8`): on CUDA where the x int8 GEMV takes
    those rows (`quant_triton.takes_a8`) and the fusion policy folds (`Fusion.a8_fold`); never on the CPU."""
    from hibana_kernels import fusion

    impl = _triton("quant", x)
    return impl is not None and fusion.policy().a8_fold and impl.takes_a8(x, k, group_size)


def a8_order(kind: str) -> int:
    """The order of x's codes a `kind` ("int8", "int4", "mxfp4") weight's x int8 GEMV reads."""
    return {"int4": quant.A8_PAIRS, "mxfp4": quant.A8_HALVES}.get(kind, quant.A8_COLUMNS)


def moe_folds_a8(x: torch.Tensor, experts: MoEExperts) -> bool:
    """Whether the norm writing a sparse block's input from x (a tensor of the step's rows) hands
    the experts that input as int8 codes too (`rms_norm_a8` in `a8_order(experts.kind)`, then
    `fused_moe_a8`): on CUDA where the experts' decode GEMVs take int8 x (MXFP4's) and the fusion
    policy folds (`Fusion.a8_fold`); never on the CPU."""
    from hibana_kernels import fusion

    impl = _triton("moe", x)
    return impl is not None and fusion.policy().a8_fold and impl.takes_a8(x, experts)


def fused_moe_a8(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, experts: MoEExperts, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe` of x given with its int8 codes (q, d) (CUDA only: where `moe_folds_a8`)."""
    return importlib.import_module("hibana_kernels.moe_triton").fused_moe_a8(x, q, d, experts, weights, ids)


def rms_norm_a8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                unit_offset: bool, order: int,
                cast_last: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual, q, d) with the normed rows as int8 codes too (CUDA only:
    where `folds_a8`)."""
    return importlib.import_module("hibana_kernels.norm_triton").rms_norm_a8(x, residual, weight, eps, unit_offset,
                                                                             order, cast_last)


def silu_and_mul_a8(gate_up: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(gate) * up, q, d) with the product as int8 codes too (CUDA only: where `folds_a8`)."""
    return importlib.import_module("hibana_kernels.activation_triton").silu_and_mul_a8(gate_up, order)


def linear_a8(q: torch.Tensor, d: torch.Tensor, lead: tuple[int, ...], dtype: torch.dtype, qweight: torch.Tensor,
              scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_int8` / `linear_int4` (zeros given) of an input given as its int8 codes (CUDA only)."""
    return importlib.import_module("hibana_kernels.quant_triton").linear_a8(q, d, lead, dtype, qweight, scales, zeros,
                                                                            group_size, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2 * I] gate/up projection."""
    return (_triton("activation", gate_up) or activation).silu_and_mul(gate_up)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) of an attention output x [T, H, D] and its gate (a strided view, the
    same shape): one launch on the GPU, transformers' roundings."""
    return (_triton("activation", x) or activation).sigmoid_gate(x, gate)


def add_sigmoid_gated(base: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """base + sigmoid(gate) * x of [T, H] rows and a gate [T, 1] (a shared expert's output scaled by
    its gate, added to the routed experts'): one launch on the GPU, transformers' roundings."""
    return (_triton("activation", x) or activation).add_sigmoid_gated(base, gate, x)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of a fused [..., 2 * I] gate/up projection (Gemma's GeGLU). Plain
    torch on every device: one elementwise op, no Triton version yet."""
    return activation.gelu_tanh_and_mul(gate_up)


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
              renormalize: bool = False, correction_bias: torch.Tensor | None = None,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]) with the
    family's normalisation (sigmoid scoring: its correction bias and scale); see
    `hibana_kernels.moe.moe_route`."""
    impl = _triton("moe", router_logits) or moe
    return impl.moe_route(router_logits, top_k, scoring=scoring, renormalize=renormalize,
                          correction_bias=correction_bias, scale=scale)


def moe_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int, *,
                   scoring: str = "softmax", renormalize: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sparse block's start: (rms_norm(x + residual), x + residual, weights, ids) of its router
    (weight [E, H], bias) and top-k; one launch where `hibana_kernels.fusion` says. See
    `hibana_kernels.moe.norm_route`."""
    return (_triton("moe", x) or moe).norm_route(x, residual, norm_weight, eps, router_weight, router_bias, top_k,
                                                 scoring=scoring, renormalize=renormalize)


def fused_moe(x: torch.Tensor, experts: MoEExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] through each token's k experts `ids` [T, k], outputs scaled by `weights` [T, k]
    and summed -> [T, H] in x's dtype; dense or MXFP4 experts alike."""
    return (_triton("moe", x) or moe).fused_moe(x, experts, weights, ids)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks uint8 [..., G, 16] with e8m0 scales [..., G] -> values [..., G * 32] in `dtype`."""
    return (_triton("moe", blocks) or moe).mxfp4_dequantize(blocks, scales, dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                  query_start_loc: torch.Tensor, activation: str | None = "silu",
                  write: bool = True, skip: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  x_copy: torch.Tensor | None = None) -> torch.Tensor:
    """A linear-attention layer's short depthwise convolution of packed rows x [T, C] (weight
    [C, K]), each sequence continuing from its slot of conv_state [S, C, K-1] (`write`: left
    there after its rows; `skip`: padding rows in front of each sequence's; `out`, `x_copy`:
    buffers for the output and a copy of x's rows); see `hibana_kernels.recurrent.causal_conv1d`."""
    impl = _triton("recurrent", x) or recurrent
    return impl.causal_conv1d(x, weight, bias, conv_state, slots, has_state, query_start_loc, activation, write,
                              skip, out, x_copy)


def conv_advance(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                 query_start_loc: torch.Tensor, counts: torch.Tensor,
                 has_state: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
    """After `causal_conv1d(..., write=False)` over x, each slot's state after its sequence's first
    counts[b] rows alone (the tokens speculative decoding kept), counted after skip[b] rows."""
    (_triton("recurrent", x) or recurrent).conv_advance(x, conv_state, slots, query_start_loc, counts, has_state,
                                                        skip)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     has_state: torch.Tensor, query_start_loc: torch.Tensor,
                     write: bool = True, skip: torch.Tensor | None = None,
                     max_rows: int | None = None) -> torch.Tensor:
    """Gated DeltaNet's delta rule over packed rows (q, k [T, Hk, Dk], v [T, Hv, Dv], log decay g and
    beta [T, Hv]), each sequence continuing from its slot of the float32 state [S, Hv, Dk, Dv]
    (`write`: left there after its rows; `skip`: padding rows in front of each sequence's); see
    `hibana_kernels.recurrent.gated_delta_rule`. max_rows: a host bound on any sequence's rows;
    on the GPU from `recurrent_triton.CHUNKED_MIN_ROWS` the chunked kernel runs (a prefill chunk),
    else (or None) the token-by-token one."""
    impl = _triton("recurrent", v) or recurrent
    return impl.gated_delta_rule(q, k, v, g, beta, state, slots, has_state, query_start_loc, write, skip,
                                 max_rows)


def gated_delta_advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                        counts: torch.Tensor, has_state: torch.Tensor | None = None,
                        skip: torch.Tensor | None = None) -> None:
    """After `gated_delta_rule(..., write=False)`, each slot's state after its sequence's first
    counts[b] rows alone (the tokens speculative decoding kept), counted after skip[b] rows."""
    impl = _triton("recurrent", v) or recurrent
    impl.gated_delta_advance(k, v, g, beta, state, slots, query_start_loc, counts, has_state, skip)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's gates of rows a, b [T, Hv] (weights a_log, dt_bias [Hv]): (g =
    -exp(a_log) * softplus(a + dt_bias) float32, beta = sigmoid(b) in b's dtype), one launch on
    the GPU (`out`: their buffers, [T, Hv] each); see `hibana_kernels.recurrent.gdn_gates`."""
    return (_triton("recurrent", a) or recurrent).gdn_gates(a, b, a_log, dt_bias, out)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] times silu(gate) (a view of one shape), as transformers'
    Qwen3_5RMSNormGated rounds it, one launch on the GPU; see `hibana_kernels.recurrent.gated_rms_norm`."""
    return (_triton("recurrent", x) or recurrent).gated_rms_norm(x, gate, weight, eps)
