"""How many programs a norm's row takes: `bench/step_gaps.py` (batch 1, 512 keys) run once per setting,
in one process, each on an engine of its own. A setting is NxSxC: blocks of codes an
`_rms_norm_a8_kernel` program writes (the x int8 fold before w8 / w4 layers), an
`_silu_and_mul_a8_kernel` program's, and columns a plain `_rms_norm_kernel` program writes (0: the
whole row in one program):

    SETTINGS=16x32x0,4x32x0 PASS=w4 python bench/norm_programs.py
    SETTINGS=4x32x0,4x32x512 MODEL=phi4-mini python bench/norm_programs.py

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
    for spec in os.environ.get("SETTINGS", "16x32x0,4x32x0").split(","):
        blocks, silu, chunk = map(int, spec.split("x"))
        norm.A8_NORM_BLOCKS, activation.A8_SILU_BLOCKS, norm.NORM_CHUNK = blocks, silu, chunk
        sys.argv = ["step_gaps.py", "--model", os.environ.get("MODEL", "qwen3-8b"),
                    "--surgery", os.environ.get("PASS", ""), "--context", "512"]
        print("SETTING", spec, "PDL", os.environ.get("HIBANA_PDL", "default"), flush=True)
        runpy.run_path(str(Path(__file__).with_name("step_gaps.py")), run_name="__main__")


if __name__ == "__main__":
    main()
