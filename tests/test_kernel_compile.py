"""The kernels' GPU-only variants compile for the H200 (sm_90) without a GPU.

The interpreter runs every kernel's arithmetic on the CPU (test_kernels.py, test_moe_kernels.py), but
not what only a compiled kernel has: programmatic dependent launch (`gdc_wait` is not in the
interpreter, so `PDL=True` branches never run there) and the constexpr combinations the GPU's
dispatch picks (the 4-bit GEMVs' x_vector, the fused router, attention sinks in a split decode).
Triton's compiler and ptxas need no device, so each is compiled here for sm_90 down to PTX, with
its grid dependency instructions in it where PDL is asked for."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from hibana_kernels import activation_triton as act  # noqa: E402
from hibana_kernels import attention_triton as at  # noqa: E402
from hibana_kernels import matmul_triton as mm  # noqa: E402
from hibana_kernels import moe_triton as mt  # noqa: E402
from hibana_kernels import norm_triton as nt  # noqa: E402
from hibana_kernels import quant_triton as qt  # noqa: E402
from hibana_kernels import rotary_triton as rt  # noqa: E402

SPLIT_ATTENTION = dict(part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32")
EXPERT_IDS = dict(ids_ptr="*i64", alpha="fp32", limit="fp32")

# (name, kernel, constexprs, argument types where not "*bf16" for a pointer and "i32" otherwise)
CASES = [
    ("gemv", mm._gemv_kernel, dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, HAS_BIAS=False, EVEN_K=True,
                                   SILU_INPUT=False, TILES=0), {}),
    ("gemv-unrolled", mm._gemv_kernel, dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, HAS_BIAS=False, EVEN_K=False,
                                            SILU_INPUT=False, TILES=3), {}),
    ("gemv-silu", mm._gemv_kernel, dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=4096, HAS_BIAS=True, EVEN_K=False,
                                        SILU_INPUT=True, TILES=0), {}),
    ("norm-gemv", mm._norm_gemv_kernel, dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, HAS_RESIDUAL=True, HAS_BIAS=False,
                                             EVEN_K=True, ONE_TILE=True), dict(eps="fp32")),
    ("gemv-glu-silu", mm._gemv_kernel, dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, HAS_BIAS=True, EVEN_K=False,
                                            SILU_INPUT=False, TILES=3, GLU=1), {}),
    ("norm-gemv-glu-gelu", mm._norm_gemv_kernel, dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, HAS_RESIDUAL=True,
                                                      HAS_BIAS=False, EVEN_K=True, ONE_TILE=False, GLU=2),
     dict(eps="fp32")),
    ("rms-norm", nt._rms_norm_kernel, dict(N=2048, BLOCK=2048, HAS_RESIDUAL=True, UNIT_OFFSET=False,
                                           CAST_LAST=False),
     dict(eps="fp32")),
    ("silu-and-mul", act._silu_and_mul_kernel, dict(INTER=3072, BLOCK=1024), {}),
    ("norm-gemv-unit-offset", mm._norm_gemv_kernel, dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, HAS_RESIDUAL=True,
                                                         HAS_BIAS=False, EVEN_K=True, ONE_TILE=True, UNIT_OFFSET=True),
     dict(eps="fp32")),
    ("sigmoid-gate", act._sigmoid_gate_kernel, dict(D=256, WIDTH=2048, BLOCK=1024, LIBDEVICE=True), {}),
    ("add-sigmoid-gated", act._add_sigmoid_gated_kernel, dict(WIDTH=2048, BLOCK=1024, LIBDEVICE=True), {}),
    ("prologue", rt._prologue_kernel, dict(GROUP=4, HALF=64, PASS=0, BLOCK_G=4, BLOCK_HALF=64, BLOCK_PASS=1,
                                           BLOCK_D=128, HAS_NORM=True, UNIT_OFFSET=False, KV_FP8=False),
     dict(pos_ptr="*i64", slot_ptr="*i64", eps="fp32", cos_ptr="*fp32", sin_ptr="*fp32", k_scale_ptr="*fp32",
          v_scale_ptr="*fp32")),
    ("decode-attention-sinks-window", at._decode_kernel,
     dict(GROUP=8, HEAD_DIM=64, HEAD_DIM_P=64, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, SLIDING=True, SINK_TOKENS=False,
          SPLIT=True, SPLIT_TILE=64, MERGE=False, SPLITS_P=64, DOT_PRECISION="ieee", UPCAST=False, QUERY_LEN=1, KV_FP8=False,
          FP8_AS_FP16=False, SINKS=True, sink_tokens=None),
     dict(SPLIT_ATTENTION, counter_ptr="*i32", block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32",
          k_scale_ptr="*fp32", v_scale_ptr="*fp32", qk_scale="fp32")),
    ("decode-attention-fp8-cache", at._decode_kernel,  # bf16 queries, fp8 keys and values: the dots in fp16
     dict(GROUP=4, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, SLIDING=False,
          SINK_TOKENS=False, SPLIT=True, SPLIT_TILE=64, MERGE=True, SPLITS_P=64, DOT_PRECISION="ieee", UPCAST=False, QUERY_LEN=1,
          KV_FP8=True, FP8_AS_FP16=True, SINKS=False, sink_tokens=None, window=None),
     dict(SPLIT_ATTENTION, counter_ptr="*i32", block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32",
          k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32", qk_scale="fp32")),
    ("decode-attention-prologue", at._decode_kernel,  # q/k norms, rotary and the K/V store in the decode kernel
     dict(GROUP=4, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, SLIDING=False,
          SINK_TOKENS=False, SPLIT=True, SPLIT_TILE=64, MERGE=False, SPLITS_P=64, DOT_PRECISION="ieee", UPCAST=False,
          QUERY_LEN=1, KV_FP8=False, FP8_AS_FP16=False, SINKS=False, sink_tokens=None, window=None, PROLOGUE=True,
          HALF=64, PASS=0, BLOCK_T=1, HAS_NORM=True, UNIT_OFFSET=False),
     dict(SPLIT_ATTENTION, counter_ptr="*i32", block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32",
          k_scale_ptr="*fp32", v_scale_ptr="*fp32", qk_scale="fp32", pos_ptr="*i64", slot_ptr="*i64",
          cos_ptr="*fp32", sin_ptr="*fp32", eps="fp32")),
    ("reduce-splits", at._reduce_splits_kernel, dict(HEAD_DIM=64, HEAD_DIM_P=64, SPLITS_P=64, BLOCK_D=64),
     dict(SPLIT_ATTENTION, with_keys_ptr="*i32")),
    ("route", mt._route_kernel, dict(TOP_K=4, E_PAD=32, K_PAD=4, SCORING=1, HAS_BIAS=False, RENORMALIZE=False),
     dict(weights_ptr="*fp32", ids_ptr="*i64", scale="fp32")),
    ("route-sigmoid", mt._route_kernel, dict(TOP_K=8, E_PAD=128, K_PAD=8, SCORING=2, HAS_BIAS=True, RENORMALIZE=True),
     dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", scale="fp32")),
    ("norm-route", mt._norm_route_kernel, dict(TOP_K=8, E_PAD=128, K_PAD=8, BLOCK_E=2, BLOCK_K=2048, HAS_BIAS=False,
                                               SCORING=0, RENORMALIZE=True),
     dict(eps="fp32", counter_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i64")),
    ("experts-gate-up-bf16-wide", mt._gate_up_decode_kernel,
     dict(BLOCK_N=1, BLOCK_K=2048, FORMAT=0, GROUP=1, ACTIVATION=0, HAS_BIAS=False, X_VECTOR=False, TILES=0),
     EXPERT_IDS),
    ("experts-gate-up-bf16-unrolled", mt._gate_up_decode_kernel,
     dict(BLOCK_N=4, BLOCK_K=1024, FORMAT=0, GROUP=1, ACTIVATION=0, HAS_BIAS=False, X_VECTOR=False, TILES=2),
     EXPERT_IDS),
    ("experts-gate-up-mxfp4-x_vector", mt._gate_up_decode_kernel,
     dict(BLOCK_N=8, BLOCK_K=512, FORMAT=1, GROUP=32, ACTIVATION=1, HAS_BIAS=True, X_VECTOR=True, TILES=0),
     dict(EXPERT_IDS, w_ptr="*i32", s_ptr="*u8", z_ptr="*u8")),
    ("experts-gate-up-mxfp4", mt._gate_up_decode_kernel,
     dict(BLOCK_N=8, BLOCK_K=512, FORMAT=1, GROUP=32, ACTIVATION=1, HAS_BIAS=True, X_VECTOR=False, TILES=0),
     dict(EXPERT_IDS, w_ptr="*i32", s_ptr="*u8", z_ptr="*u8")),
    ("experts-gate-up-mxfp4-direct", mt._gate_up_decode_kernel,
     dict(BLOCK_N=4, BLOCK_K=1024, FORMAT=1, GROUP=32, ACTIVATION=1, HAS_BIAS=True, X_VECTOR=False, TILES=0,
          DIRECT=True),
     dict(EXPERT_IDS, w_ptr="*i32", s_ptr="*u8", z_ptr="*u8")),
    ("experts-down-mxfp4-direct", mt._down_decode_kernel,
     dict(ROUTES=1, BLOCK_N=8, BLOCK_K=512, FORMAT=1, GROUP=32, HAS_BIAS=True, X_VECTOR=False, TILES=0, DIRECT=True),
     dict(ids_ptr="*i64", weights_ptr="*fp32", w_ptr="*i32", s_ptr="*u8", z_ptr="*u8")),
    ("experts-gate-up-mxfp4-split", mt._gate_up_decode_kernel,
     dict(BLOCK_N=8, BLOCK_K=256, FORMAT=1, GROUP=32, ACTIVATION=1, HAS_BIAS=True, X_VECTOR=False, TILES=0,
          SPLIT=True),
     dict(EXPERT_IDS, w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", part_ptr="*fp32", counter_ptr="*i32")),
    ("experts-down-bf16-split", mt._down_decode_kernel,
     dict(ROUTES=1, BLOCK_N=4, BLOCK_K=256, FORMAT=0, GROUP=1, HAS_BIAS=False, X_VECTOR=False, TILES=2, SPLIT=True),
     dict(ids_ptr="*i64", weights_ptr="*fp32", part_ptr="*fp32", counter_ptr="*i32")),
    ("experts-down-mxfp4-x_vector", mt._down_decode_kernel,
     dict(ROUTES=1, BLOCK_N=8, BLOCK_K=512, FORMAT=1, GROUP=32, HAS_BIAS=True, X_VECTOR=True, TILES=0),
     dict(ids_ptr="*i64", weights_ptr="*fp32", w_ptr="*i32", s_ptr="*u8", z_ptr="*u8")),
    ("experts-gate-up-int4-x_vector", mt._gate_up_decode_kernel,
     dict(BLOCK_N=8, BLOCK_K=512, FORMAT=3, GROUP=128, ACTIVATION=0, HAS_BIAS=False, X_VECTOR=True, TILES=0),
     dict(EXPERT_IDS, w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16")),
    ("experts-combine", mt._combine_kernel, dict(TOP_K=8, BLOCK=1024), {}),
    ("int4-gemv-x_vector", qt._gemv_int4_kernel, dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, GROUP=128, HAS_BIAS=False,
                                                      X_VECTOR=True),
     dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16")),
    # int4 on tensor cores: the codes' conversion is inline PTX (never run by the interpreter)
    ("int4-dot-split-bf16", qt._int4_dot_kernel, dict(BLOCK_M=16, BLOCK_N=64, GROUP=128, STAGES=4, FP16=False,
                                                      ASM=True, SPLIT=True, HAS_BIAS=True),
     dict(w_ptr="*u8", s_ptr="*fp16", z_ptr="*fp16", part_ptr="*fp32", counter_ptr="*i32")),
    ("int4-words-split-bf16", qt._int4_words_kernel, dict(BLOCK_M=16, BLOCK_N=256, GROUP=128, STAGES=4, FP16=False,
                                                          ASM=True, SPLIT=True, HAS_BIAS=True),
     dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16", part_ptr="*fp32", counter_ptr="*i32")),
    ("int4-words-prefetch-bf16", qt._int4_words_kernel, dict(BLOCK_M=16, BLOCK_N=128, GROUP=128, STAGES=3,
                                                             FP16=False, ASM=True, SPLIT=True, HAS_BIAS=True,
                                                             PREFETCH=True),
     dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16", part_ptr="*fp32", counter_ptr="*i32")),
    ("int4-words-fp16", qt._int4_words_kernel, dict(BLOCK_M=16, BLOCK_N=64, GROUP=256, STAGES=3, FP16=True,
                                                    ASM=True, SPLIT=False, HAS_BIAS=False),
     dict(x_ptr="*fp16", y_ptr="*fp16", b_ptr="*fp16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16",
          part_ptr="*fp32", counter_ptr="*i32")),
    # int4 / int8 x int8 at one row: dp4a is inline PTX (the interpreter sums bytes instead)
    ("a8-gemv-int4", qt._a8_gemv_kernel, dict(BLOCK_N=2, BLOCK_K=2048, GROUP=128, INT4=True, STAGES=1, ASM=True,
                                              HAS_BIAS=True),
     dict(q_ptr="*i32", d_ptr="*fp32", w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16")),
    ("a8-gemv-int8", qt._a8_gemv_kernel, dict(BLOCK_N=4, BLOCK_K=1024, GROUP=1, INT4=False, STAGES=2, ASM=True,
                                              HAS_BIAS=False),
     dict(q_ptr="*i32", d_ptr="*fp32", w_ptr="*i32", s_ptr="*fp32", z_ptr="*fp32")),
    ("a8-gemv-int4-rows", qt._a8_gemv_kernel, dict(BLOCK_N=2, BLOCK_K=2048, GROUP=128, INT4=True, STAGES=1, ASM=True,
                                                   HAS_BIAS=True, BLOCK_M=4),
     dict(q_ptr="*i32", d_ptr="*fp32", w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16")),
    ("rms-norm-a8", nt._rms_norm_a8_kernel, dict(N=4096, BLOCK=4096, BLOCKS=16, HAS_RESIDUAL=True,
                                                 UNIT_OFFSET=False, CAST_LAST=True, ORDER=1),
     dict(eps="fp32", q_ptr="*i32", d_ptr="*fp32")),
    ("silu-and-mul-a8", act._silu_and_mul_a8_kernel, dict(INTER=12288, BLOCKS=32, ORDER=0),
     dict(q_ptr="*i32", d_ptr="*fp32")),
    ("reduce-splits-a8", at._reduce_splits_kernel, dict(HEAD_DIM=128, HEAD_DIM_P=128, SPLITS_P=64, BLOCK_D=128,
                                                        A8_ORDER=1),
     dict(part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", with_keys_ptr="*i32", q_ptr="*i32",
          d_ptr="*fp32")),
    ("quantize-a8", qt._quantize_a8_kernel, dict(BLOCKS=16, ORDER=2), dict(q_ptr="*i32", d_ptr="*fp32")),
    # MXFP4 experts against int8 x: the e2m1 table lookups and dp4a are inline PTX
    ("moe-gate-up-mxfp4-a8", mt._gate_up_decode_kernel,
     dict(BLOCK_N=8, BLOCK_K=64, FORMAT=1, GROUP=32, ACTIVATION=1, HAS_BIAS=True, X_VECTOR=False, TILES=0,
          A8=True, ASM=True, SPLIT=True),
     dict(ids_ptr="*i64", w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", q_ptr="*i32", d_ptr="*fp32", part_ptr="*fp32",
          counter_ptr="*i32", alpha="fp32", limit="fp32")),
    ("moe-down-mxfp4-a8", mt._down_decode_kernel,
     dict(ROUTES=1, BLOCK_N=8, BLOCK_K=64, FORMAT=1, GROUP=32, HAS_BIAS=True, X_VECTOR=False, TILES=0, A8=True,
          ASM=True, SPLIT=False),
     dict(ids_ptr="*i64", weights_ptr="*fp32", w_ptr="*i32", s_ptr="*u8", z_ptr="*u8", q_ptr="*i32", d_ptr="*fp32",
          part_ptr="*fp32", counter_ptr="*i32")),
    ("int4-dot-fp16", qt._int4_dot_kernel, dict(BLOCK_M=16, BLOCK_N=32, GROUP=32, STAGES=3, FP16=True,
                                                ASM=True, SPLIT=False, HAS_BIAS=False),
     dict(x_ptr="*fp16", y_ptr="*fp16", b_ptr="*fp16", w_ptr="*u8", s_ptr="*fp16", z_ptr="*fp16",
          part_ptr="*fp32", counter_ptr="*i32")),
]


def _compile(kernel, constexprs: dict, types: dict) -> str:
    """The kernel's PTX for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # constexprs the case leaves out take their defaults (a runtime argument in their place would
    # turn static branches into dynamic ones)
    constexprs = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default} | constexprs
    signature = {name: "constexpr" if name in constexprs else
                 types.get(name, "*bf16" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    return compiled.asm["ptx"]


@pytest.fixture(scope="module")
def can_compile_for_cuda():
    try:
        _compile(act._silu_and_mul_kernel, dict(INTER=64, BLOCK=64, PDL=False), {})
    except Exception as exc:  # noqa: BLE001 - a Triton without the NVIDIA backend or its ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("name, kernel, constexprs, types", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_compiles_for_sm90(can_compile_for_cuda, name, kernel, constexprs, types, pdl):
    ptx = _compile(kernel, dict(constexprs, PDL=pdl), types)
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert ("griddepcontrol.launch_dependents" in ptx) == pdl
