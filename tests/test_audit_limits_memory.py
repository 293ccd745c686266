"""A model larger than the machine's memory (an outside tester of limits and the CLI)."""

from __future__ import annotations

import pytest

import hibana_core.loader
from hibana_core import MemoryBudgetError, cli
from hibana_core.kv.budget import DeviceMemory
from tiny_models import open_engine


@pytest.fixture
def small_machine(monkeypatch):
    """A machine of 100 kB: the tiny models' weights do not fit it."""
    monkeypatch.setattr(hibana_core.loader, "device_memory", lambda device: DeviceMemory(100_000, 100_000, True))


def test_weights_past_the_devices_memory_are_a_memory_budget_error(tiny_checkpoints, small_machine):
    """`hibana surgery Qwen/Qwen3-32B --device cpu` on a 32 GB machine ended in torch's
    "DefaultCPUAllocator: can't allocate memory" traceback (or the OS killing the process)."""
    with pytest.raises(MemoryBudgetError, match=r"the model's weights take [\d,]+ bytes, more than the 100,000 "
                                                r"bytes of memory cpu has; .*load it in bfloat16"):
        open_engine(tiny_checkpoints["llama"])


def test_surgery_on_a_model_the_machine_cannot_hold_says_so_in_one_line(tiny_checkpoints, small_machine, capsys):
    assert cli.main(["surgery", str(tiny_checkpoints["llama"]), "--passes", "w8", "--device", "cpu",
                     "--no-guard"]) == 1
    err = capsys.readouterr().err
    assert "hibana surgery: the model's weights take" in err and "Traceback" not in err, err
