"""How many instructions a Triton kernel's inner loop issues, without a GPU: the kernel compiled
for sm_90 (Triton's compiler and ptxas need no device), its cubin disassembled with the nvdisasm
Triton ships, the longest backward branch's body counted by opcode.

    python bench/kernel_sass.py                 # the int4 tensor-core kernels at their sweep's tiles, and
                                                # at 8-64 rows against the GEMM
    python bench/kernel_sass.py --moe           # the MoE experts' gate/up decode kernel at its tiles

An issue-bound kernel reads at most (warp instructions a second) / (instructions a byte) bytes a
second: the H200's 132 SMs x 4 schedulers x 1.98 GHz issue ~1.05e12 warp instructions a second,
so reading 4.8 TB/s leaves ~7 instructions a weight byte for each thread (a warp's iteration
handling 32 x the bytes a thread does). Used for the int4 kernels in bench/RESULTS.md (fourteenth
session); the counts are per thread and iteration of the loop over groups.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hibana_kernels import moe_triton as mt
from hibana_kernels import quant_triton as qt


def compile_sm90(kernel, constexprs: dict, types: dict, num_warps: int):
    """The kernel compiled for sm_90, pointers and strides assumed 16-divisible (as Triton
    specializes them at launch)."""
    signature = {name: "constexpr" if name in constexprs else
                 types.get(name, "*bf16" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name.endswith("_ptr") or name.startswith("stride") or name == "K"}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def loop_opcodes(compiled) -> collections.Counter:
    """Opcodes of the longest loop body of the compiled kernel's SASS."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        lines = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*\.(L_x_\d+):", line))}
    body: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > len(body):
            body = [x for x in lines[labels[m.group(1)]:i] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
    return collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", x).group(1) for x in body)


def moe_rows() -> None:
    """The experts' gate/up decode kernel at each kind's DECODE_TILES (gpt-oss's SwiGLU with bias
    for MXFP4, SiLU otherwise): weight bytes a thread streams a step, codes plus their scales."""
    print("experts gate/up   BLOCK_N BLOCK_K warps  bytes/thread  loop instr  instr/byte  top opcodes")
    ids = dict(ids_ptr="*i64", alpha="fp32", limit="fp32")
    for kind, fmt, group, code_bytes, types, activation in [
            ("dense", 0, 1, 2.0, {}, 0), ("mxfp4", 1, 32, 0.5 + 1 / 32, dict(w_ptr="*i32", s_ptr="*u8", z_ptr="*u8"), 1),
            ("int4", 3, 128, 0.5 + 4 / 128, dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16"), 0)]:
        tiles = mt.DECODE_TILES[kind]
        compiled = compile_sm90(mt._gate_up_decode_kernel, dict(
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, FORMAT=fmt, GROUP=group, ACTIVATION=activation,
            HAS_BIAS=kind == "mxfp4", X_VECTOR=False, PDL=True), dict(ids, **types), tiles.num_warps)
        ops = loop_opcodes(compiled)
        total, per_thread = sum(ops.values()), 2 * tiles.block_n * tiles.block_k * code_bytes / (32 * tiles.num_warps)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
        print(f"{kind:16s} {tiles.block_n:8d} {tiles.block_k:7d} {tiles.num_warps:5d} {per_thread:13.0f} {total:11d} "
              f"{total / per_thread:11.1f}  {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--moe", action="store_true", help="the MoE experts' decode kernel instead")
    args = parser.parse_args()
    if args.moe:
        moe_rows()
        return
    types = dict(s_ptr="*fp16", z_ptr="*fp16", part_ptr="*fp32", counter_ptr="*i32")
    print("kernel            BLOCK_N warps  bytes/thread  loop instr  instr/byte  top opcodes")
    for name, kernel, weight, tiles, variant in [
            ("int4 bytes", qt._int4_dot_kernel, "*u8", [(32, 4), (64, 4), (128, 4), (128, 8), (256, 8)], {}),
            ("int4 words", qt._int4_words_kernel, "*i32", [(64, 4), (128, 4), (128, 8), (256, 8)], {}),
            ("words prefetch", qt._int4_words_kernel, "*i32", [(128, 4), (256, 8)], dict(PREFETCH=True))]:
        for block_n, warps in tiles:
            compiled = compile_sm90(kernel, dict(BLOCK_M=16, BLOCK_N=block_n, GROUP=args.group, STAGES=4, FP16=False,
                                                 ASM=True, SPLIT=True, HAS_BIAS=False, PDL=True, **variant),
                                    dict(types, w_ptr=weight), warps)
            _row(name, block_n, warps, block_n * args.group // 2 / (32 * warps), loop_opcodes(compiled))
    batch_rows(args.group, types)


def batch_rows(group: int, types: dict) -> None:
    """Steps of several rows (verify and batch steps): the GEMM at its tiles for 8, 32 and 64 rows
    against the words kernel taking 16, 32 and 64 rows a program (BLOCK_M)."""
    print("\nrows a program    BLOCK_N warps  bytes/thread  loop instr  instr/byte  top opcodes")
    for rows in (8, 32, 64):
        t = qt._gemm_tiles(rows, 4096, group)
        compiled = compile_sm90(qt._gemm_kernel, dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                                      GROUP=group, INT4=True, HAS_BIAS=False, UPCAST=False),
                                dict(types, w_ptr="*u8"), t.num_warps)
        _row(f"gemm {t.block_m}", t.block_n, t.num_warps, t.block_n * t.block_k / 2 / (32 * t.num_warps),
             loop_opcodes(compiled))
    for block_m in (16, 32, 64):
        compiled = compile_sm90(qt._int4_words_kernel, dict(BLOCK_M=block_m, BLOCK_N=128, GROUP=group, STAGES=3,
                                                            FP16=False, ASM=True, SPLIT=True, HAS_BIAS=False,
                                                            PDL=True), dict(types, w_ptr="*i32"), 4)
        _row(f"words {block_m}", 128, 4, 128 * group // 2 / 128, loop_opcodes(compiled))


def _row(name: str, block_n: int, warps: int, per_thread: float, ops: collections.Counter) -> None:
    total = sum(ops.values())
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
    print(f"{name:16s} {block_n:8d} {warps:5d} {per_thread:13.0f} {total:11d} {total / per_thread:11.1f}  {top}")


if __name__ == "__main__":
    main()
