"""One compute thread a pytest-xdist worker, set before torch loads.

Under pytest-xdist (CI: two workers on two cores) each worker is a process of its own, and
torch's intra-op threads, one per core in each, oversubscribe the cores: a tiny model's ops then
spend their time in OpenMP's spin-waits (the engine tests of test_state_api, test_hostile_fuzz and
test_retention took 79 s against 20 s). OMP_NUM_THREADS is read when torch loads; the Triton
interpreter's worker processes, and numpy's BLAS, inherit it. Imported by both conftests first.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    if "torch" in sys.modules:  # loaded before the conftests (a plugin): its pool is sized already
        sys.modules["torch"].set_num_threads(1)
