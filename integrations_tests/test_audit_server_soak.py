"""A short soak of `hibana serve` (bench/soak_server.py): the server as a subprocess on the demo
model, a few `openai` clients in a mix of tool loops, streams closed early, n=2, stops, legacy
completions, bad requests and overflows, its metrics and RSS sampled, then a SIGTERM with streams
open. The driver exits non-zero on a hang, a 5xx, a wrong reply, a leak or an unclean shutdown."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a run of 30 s whose leak and shutdown bounds are timings: kept out of the loaded CI run,
@pytest.mark.timeout(120)  # whose faster server tests cover each request kind; `-m slow` runs it
def test_short_soak_of_the_server_passes(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "soak_server.py"), "--minutes", "0.5", "--clients", "3",
               "--idle", "2", "--sample-every", "8", "--shutdown-timeout", "2", "--no-progress",
               "--log", str(tmp_path / "server.log"), "--json", str(tmp_path / "soak.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert "PASS" in result.stdout
