"""One memory budget: the weights, the KV blocks and the workspace of a step, on whatever memory
the device has.

A budget is given as bytes (`20_000_000_000`, "20GB", "18.5 GiB") or as a fraction of the
device's memory (`0.8`, "80%"). What the fraction is of depends on the memory: a discrete GPU's
own memory; on unified memory (an integrated GPU such as DGX Spark's, Apple silicon, or the CPU
itself) the system's memory less headroom kept for the operating system and other programs,
since the weights, the KV cache and everything else running there share it.
"""

from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hibana_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|[a-z]*)\s*$", re.IGNORECASE)


def parse_budget(value: int | float | str) -> int | float:
    """Bytes (an int, or a size string such as "20GB" / "512 MiB") or a fraction of the device's
    memory (a float in (0, 1], "80%", or "0.8" as the float reads). Anything else is a ConfigError
    that says what to write."""
    hint = 'write bytes (20_000_000_000, "20GB", "512MiB") or a fraction of the device ("80%", 0.8)'
    if isinstance(value, bool):
        raise ConfigError(f"memory_budget must be bytes or a fraction, got {value!r}; {hint}")
    if isinstance(value, numbers.Integral) and not isinstance(value, int):  # numpy's: Python's own
        value = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        value = float(value)
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"memory_budget must be positive, got {value}; {hint}")
        return value
    if isinstance(value, float):
        if 0.0 < value <= 1.0:
            return value
        if value > 1.0 and value.is_integer():
            return int(value)  # 2e10: bytes written as a float
        raise ConfigError(f"memory_budget {value!r} is neither a fraction in (0, 1] nor a byte count; {hint}")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            number, unit = float(match.group(1)), match.group(2).lower()
            if not unit and "." in match.group(1):  # "0.8", "1.0" (a CLI's or an env var's): a fraction
                if 0 < number <= 1:
                    return number
                raise ConfigError(f"memory_budget {value!r} is not a fraction in (0, 1]; {hint}")
            if unit == "%" and 0 < number <= 100:
                return number / 100
            size = _bytes_of(match)
            if size:
                return size
        raise ConfigError(f"memory_budget {value!r} is not a size, or a share of 100% or less; {hint}")
    raise ConfigError(f"memory_budget must be bytes or a fraction, got {type(value).__name__}; {hint}")


def parse_bytes(value: int | str, name: str) -> int:
    """A byte count given as an int (0 included) or a size string ("8GB", "512 MiB"), as
    `memory_budget` takes them; anything else is a ConfigError naming `name`."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    match = _SIZE.match(value) if isinstance(value, str) else None
    size = _bytes_of(match) if match else None
    if size is not None:
        return size
    raise ConfigError(f'{name} must be a number of bytes (8_000_000_000, "8GB", "512MiB"; 0: none), got {value!r}')


def _bytes_of(match: re.Match) -> int | None:
    """The bytes a size string names ("0.5GB", "512 MiB", "4096": a bare number is whole bytes, as
    an int is; "0" none at all), None where it names none ("80%", "0.25", "0.0001k")."""
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS or not (unit or number.is_integer()):
        return None
    size = number * _UNITS[unit]
    return int(size) if size >= 1 or number == 0 else None


@dataclass(frozen=True)
class DeviceMemory:
    """What the device can hold: its total and free bytes, and whether it shares them with the host."""

    total: int
    free: int
    unified: bool

    @property
    def headroom(self) -> int:
        """Bytes a budget given as a fraction leaves to everything else: on unified memory the
        operating system and other programs (a tenth of the memory, at least 2 GiB where the memory
        is large enough to spare it); a discrete GPU's memory is the engine's."""
        if not self.unified:
            return 0
        return max(self.total // 10, min(2 << 30, self.total // 4))

    def resolve(self, budget: int | float) -> int:
        """A budget in bytes: bytes as given, a fraction of what the device offers less headroom."""
        if isinstance(budget, int):
            return budget
        return int(budget * (self.total - self.headroom))


def device_memory(device: "torch.device") -> DeviceMemory:
    """Total and free memory of the device the engine runs on, and whether it is unified memory
    (an integrated GPU reports it, Apple's GPU always is, the CPU is by definition)."""
    import torch  # here: configs are built where torch is not imported (the adapters' start)

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        integrated = bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
        if integrated:  # the GPU's share is the system's memory: count it as the host sees it
            return DeviceMemory(*_system_memory(), unified=True)
        return DeviceMemory(total, free, unified=False)
    return DeviceMemory(*_system_memory(), unified=True)


def _system_memory() -> tuple[int, int]:
    """(total, available) bytes of system memory: /proc/meminfo's MemAvailable where there is one
    (it counts reclaimable page cache as available), sysconf otherwise."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return total, int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return total, page * os.sysconf("SC_AVPHYS_PAGES")


def workspace_bytes(*, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, vocab_size: int, max_batched_tokens: int, max_agents: int,
                    dtype_bytes: int, moe_top_k: int = 0, moe_intermediate_size: int = 0,
                    draft_rows: int = 0) -> int:
    """An upper estimate of what one step allocates besides weights and KV: the activations of a
    full prefill chunk (the residual stream twice, the fused qkv and gate/up outputs, attention's
    output, the MLP's product; a sparse block's k routes a token), float32 logits of every row
    that samples (three copies: logits, probabilities, the sampler's scratch), and an eighth more
    for the allocator's fragmentation and kernels' scratch. A sequence samples one row, and one
    more for each draft it verifies (`draft_rows` in a step at most; the step's tokens bound them
    too). `Engine.memory()` reports the measured peak on CUDA."""
    per_token = (2 * hidden_size + (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim
                 + 3 * intermediate_size) * dtype_bytes
    # a sparse block's routes: each token's k gate/up outputs, activations and expert outputs
    per_token += moe_top_k * (3 * moe_intermediate_size + hidden_size) * dtype_bytes
    sampled_rows = min(max_agents + draft_rows, max(max_agents, max_batched_tokens))
    estimate = max_batched_tokens * per_token + 3 * sampled_rows * vocab_size * 4
    return estimate + estimate // 8
