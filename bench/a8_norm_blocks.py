"""The x int8 folds' programs a row: `bench/step_gaps.py` (qwen3-8b, batch 1, 512 keys) run once per
(blocks of codes an `_rms_norm_a8_kernel` program writes) x (an `_silu_and_mul_a8_kernel` program's)
setting, in one process, each on an engine of its own:

    BLOCKS=16x32,4x32,4x8 PASS=w4 python bench/a8_norm_blocks.py

Each run prints step_gaps' report (graph replay alone is the figure to compare; the kernels' own
times need HIBANA_PDL=0). A GPU tool: on the device, with the folders as `run_h200.sh` names them.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import hibana_kernels.activation_triton as activation
import hibana_kernels.norm_triton as norm


def main() -> None:
    for spec in os.environ.get("BLOCKS", "16x32,4x32").split(","):
        blocks, silu = map(int, spec.split("x"))
        norm.A8_NORM_BLOCKS, activation.A8_SILU_BLOCKS = blocks, silu
        sys.argv = ["step_gaps.py", "--model", "qwen3-8b", "--surgery", os.environ.get("PASS", "w4"), "--context", "512"]
        print("A8_NORM_BLOCKS", blocks, "SILU", silu, "PDL", os.environ.get("HIBANA_PDL", "default"), flush=True)
        runpy.run_path(str(Path(__file__).with_name("step_gaps.py")), run_name="__main__")


if __name__ == "__main__":
    main()
