"""The MoE decode GEMV's instruction cost without a GPU: each MXFP4 decode kernel compiled here for
sm_90 (Triton's bundled ptxas), its SASS read back (the bundled cuobjdump), and the instructions of
its K loop counted per weight one pass of the loop reads (a thread's share), by pipe. A guide to
GEMV variants and tiles before the H200 times them (bench/tune_moe.py), not a timing (latency,
occupancy and memory are not in it; the registers a thread takes, which bound occupancy, are
printed beside). It chose between MXFP4's GEMVs: 5.9 instructions a weight for the code pairs
kept, 7.7 one code at a time, 9.2 on the tensor cores (gate|up loop, 8 x 512 tiles).

    python3 bench/sass_moe.py                        # DECODE_TILES' MXFP4 tiles and 8 x 256
    python3 bench/sass_moe.py --tiles 16,256,2 8,512,4

Needs the Triton of a Linux wheel (its NVIDIA backend and tools), no CUDA device; sm_90 code from
another Triton version may differ.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hibana_kernels import moe_triton
from hibana_kernels.moe_triton import DecodeTiles

H200 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
DEFAULT_TILES = [moe_triton.DECODE_TILES["mxfp4"], DecodeTiles(8, 256, 2, True)]
ALU = ("LOP3", "SHF", "PRMT", "MOV", "ISETP", "IADD3", "LEA", "SEL")  # the integer pipe
FMA = ("FFMA", "FMUL", "FADD", "HADD2", "HMUL2", "IMAD")  # the float pipe (IMAD shifts and moves too)
POINTERS = {"w_ptr": "*i32", "x_ptr": "*bf16", "act_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64",
            "weights_ptr": "*fp32", "s_ptr": "*u8", "z_ptr": "*u8", "b_ptr": "*fp32", "part_ptr": "*fp32",
            "counter_ptr": "*i32"}


DIVISIBLE = ("H", "I", "stride_xm", "stride_om", "stride_we", "stride_se", "stride_be")


def _arg_type(name: str) -> str:
    return "fp32" if name in ("alpha", "limit") else POINTERS.get(name, "i32")


def compile_decode(kernel, tiles: DecodeTiles, constexprs: dict):
    """`kernel` (a decode kernel of moe_triton) for sm_90 with MXFP4 weights: int32 words as
    fused_moe_launch passes them, bf16 x, scalar arguments int32 or float32."""
    signature = {p.name: "constexpr" if p.is_constexpr else _arg_type(p.name) for p in kernel.params}
    constexprs = dict(constexprs, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, FORMAT=1, GROUP=32, HAS_BIAS=True,
                      X_VECTOR=tiles.x_vector, TILES=0, PDL=False, DIRECT=tiles.direct, SPLIT=tiles.split > 1)
    # what a launch at gpt-oss-20b's shapes specializes: pointers and the ints divisible by 16 (the
    # row strides of words and scales, 360 and 90, are not)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if signature[p.name] != "constexpr" and (p.name.endswith("_ptr") or p.name in DIVISIBLE)}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=H200,
                          options=dict(num_warps=tiles.num_warps))


def sass_of(compiled) -> tuple[str, int]:
    """(SASS text, registers a thread) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", cubin.name], check=True, capture_output=True,
                              text=True).stdout
        usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin.name], check=True, capture_output=True,
                               text=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (without modifiers or predicates) of the longest loop: the instructions from a
    backward branch's target to the branch."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(code)}
    longest: list[str] = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target < address and target in index and i + 1 - index[target] > len(longest):
            longest = [t for _, t in code[index[target]:i + 1]]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in longest)


def report(name: str, kernel, rows: int, tiles: DecodeTiles, constexprs: dict) -> None:
    sass, registers = sass_of(compile_decode(kernel, tiles, constexprs))
    ops = loop_opcodes(sass)
    weights = rows * tiles.block_k / (32 * tiles.num_warps)  # a thread's share of one pass
    alu, fma = sum(ops[o] for o in ALU), sum(ops[o] for o in FMA)
    top = " ".join(f"{op} {n / weights:.2f}" for op, n in ops.most_common(6))
    print(f"{name:<8}{','.join(map(str, tiles)):<24}{sum(ops.values()) / weights:>8.2f}{alu / weights:>6.2f}"
          f"{fma / weights:>6.2f}{registers:>6}   {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", nargs="*", help="block_n,block_k,num_warps[,d][,sN] (down per route; d: direct, "
                        "sN: split-K in N)")
    args = parser.parse_args()
    tiles = DEFAULT_TILES if not args.tiles else [
        DecodeTiles(*map(int, t.split(",")[:3]), True, direct="d" in t.split(",")[3:],
                    split=next((int(f[1:]) for f in t.split(",")[3:] if f.startswith("s")), 1)) for t in args.tiles]
    print(f"{'kernel':<8}{'tiles':<24}{'instr/w':>8}{'alu':>6}{'fma':>6}{'regs':>6}   most frequent, a weight")
    for t in tiles:
        report("gate_up", moe_triton._gate_up_decode_kernel, 2 * t.block_n, t, dict(ACTIVATION=1))
        report("down", moe_triton._down_decode_kernel, t.block_n, t, dict(ROUTES=1))


if __name__ == "__main__":
    main()
