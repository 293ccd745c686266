"""Configuration: frozen dataclasses, one per concern, validated on construction.

Values known only at run time (the number of KV blocks that fit, the model's shapes, the context
limit) live on the objects that find them (`Engine`, a model family's args, `registry.ModelLimits`) and are
never written back here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hibana_core.errors import ConfigError, GrammarError
from hibana_core.kv.budget import parse_budget, parse_bytes


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


_KINDS = {int: "a 64-bit integer", float: "a finite number", bool: "True or False", str: "a string"}

_SHOWN_AS = {"num_blocks": "kv_device_blocks (num_blocks)"}
"""Fields an error names as users usually write them (the memory manager's option names, see
`OPTION_ALIASES`), so the message points at the option they gave."""


def plain_token_ids(values: list, vocab_size: int) -> bool:
    """Whether `values` are all plain ints in [0, vocab_size), checked by C-speed builtins: the
    fast path before `is_kind` a value, which the rest (a bool, a numpy integer, an id out of
    range) takes for its error or conversion."""
    return not values or (set(map(type, values)) == _INT_ONLY and 0 <= min(values) and max(values) < vocab_size)


_INT_ONLY = {int}


def is_kind(value: Any, kind: type) -> bool:
    """Strict scalar types (options, token ids, counts): a bool is no integer, an integer fits
    int64, a number is finite, an integer may be a float only where a number is asked for."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:  # what torch and the step's int64 tensors can hold
        return isinstance(value, numbers.Integral) and -(2**63) <= value < 2**63
    if kind is float:
        try:
            return isinstance(value, numbers.Real) and math.isfinite(value)
        except OverflowError:  # an integer past a float's range
            return False
    return isinstance(value, kind)


def _check_types(obj: Any) -> None:
    """Every scalar field holds its annotated type (or None where the annotation allows it), so a
    wrong type fails here, with the field's name, rather than inside a step."""
    for name, kinds, optional in _scalar_fields(type(obj)):
        value = getattr(obj, name)
        if optional and value is None:
            continue
        kind = next((k for k in kinds if is_kind(value, k)), None)
        _check(kind is not None,
               f"{_SHOWN_AS.get(name, f'{type(obj).__name__}.{name}')} must be {_KINDS[kinds[0]]}"
               f"{' or None' if optional else ''}, got {value!r}")
        if kind in (int, float) and type(value) is not kind:  # numpy's scalars (and ints for floats): Python's own
            object.__setattr__(obj, name, kind(value))


@functools.cache
def _scalar_fields(cls: type) -> tuple[tuple[str, tuple[type, ...], bool], ...]:
    """A config class's scalar fields: (name, the kinds it may hold, whether None is allowed).
    Once per class: resolving the annotations costs about a millisecond, and a SamplingParams is
    made several times per request (a server's turn makes three)."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = tuple(k for k in typing.get_args(hint) if k is not type(None)) if union else (hint,)
        if all(k in _KINDS for k in kinds):  # containers and nested configs check themselves
            fields.append((f.name, kinds, union and type(None) in typing.get_args(hint)))
    return tuple(fields)


EVICTION_POLICIES = ("lru", "tool_aware")  # hibana_core.kv.policies.POLICIES


MAX_JSON_DEPTH = 128
"""Levels of objects and arrays a schema (or a request body) may nest: the grammar's schema checks
and chat templates recurse through them, and 200-400 levels ran them out of stack."""


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests dicts and lists more than `limit` levels deep (a walk without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block; also the granularity of prefix sharing."""
    num_blocks: int | None = None
    """Exact number of device KV blocks (also `kv_device_blocks`), each `block_size` tokens of
    every layer; None sizes the pool from `memory_budget`. (A model with sliding-window layers
    keeps its layers' KV in smaller pages, `kv.layout`: it gets the pages of these bytes.)"""
    memory_budget: int | float | str | None = None
    """The engine's memory on its device: weights, KV blocks and a step's workspace (and a draft
    model's weights and KV) together. Bytes (an int, "20GB", "512MiB") or a fraction of the
    device's memory (0.8, "80%"): of a discrete GPU's memory; on unified memory (an integrated
    GPU, the CPU) of system memory less headroom for the OS (kv/budget.py). What is left after
    the weights and the workspace becomes KV blocks. None: KV takes `memory_fraction` of the
    memory free at start."""
    memory_fraction: float = 0.5
    """Share of free device memory (host RAM on CPU) the KV cache may take when no budget is given."""
    max_kv_bytes_cpu: int = 2 << 30
    """Upper bound on KV bytes on the CPU backend when sized automatically (RAM is shared with the OS)."""
    enable_prefix_caching: bool = True
    """Share full blocks between states through the prefix index (off: benchmarks' baseline)."""
    kv_dtype: str = "auto"
    """KV cache dtype: "auto" (the model's: its compute dtype, or fp8 after kv8), "float32",
    "bfloat16", "float16" (each must be the compute dtype), or "fp8" ("float8_e4m3fn"): e4m3
    with per-head scales, which is the kv8 surgery pass (added to `surgery` if not named there)."""
    host_kv_bytes: int | str | None = None
    """The host tier: bytes of host memory (an int or a size string: "8GB", "512MiB") where idle
    states' KV is parked when the device pool needs room (and copied back when they resume)
    instead of being dropped and recomputed.
    None: half the host memory available at start, except on unified memory with a
    `memory_budget`, where the budget is one pool and there is no host tier (parking would copy
    within the same memory); 0: no host tier (drop and recompute). On unified memory a host tier
    given in bytes comes out of the budget. With `state_dir` set, what the host tier cannot hold
    (all of it, at 0) is parked on disk there instead of dropped."""
    state_dir: Any = None
    """A folder (str or os.PathLike) where named states persist across restarts: the engine writes
    each open named state there when it closes, and `open_state(id)` finds the state again
    (its KV parked in the host tier, copied to the device at its next request, so nothing is
    recomputed). Files carry the model's fingerprint and a checksum; a damaged or foreign file
    is a StateFileError for that `open_state` alone. They and the spill files are their owner's
    alone (0600; the folder too, 0700, where the engine makes it: one given keeps its mode), as
    they hold the conversations. Closing a state (`h.close()`) deletes its
    file. A relative path is of the working directory where the config is made (the engine
    opened), whatever `os.chdir` comes after. None: states live as long as the engine."""
    eviction_policy: str = "tool_aware"
    """Which idle state leaves the device first (hibana_core/kv/policies.py): "lru", or
    "tool_aware": least recently used first, except that a state whose last turn ended in tool
    calls is kept while its agent is expected back (twice its agent's mean tool time so far).
    Within the policy's order, idle states whose last request had a lower `SamplingParams.priority`
    leave first, and pinned states last (`pin_budget`)."""
    pin_budget: float = 0.5
    """Share of the device KV pool that pinned states (`StateHandle.pin()`) may hold. Pins made
    first are honoured first; a pin beyond the budget degrades to a retention priority above
    every unpinned state. Honoured pins leave the device only when a request could not run
    otherwise, so pins never deadlock the engine."""
    max_unnamed_states: int = 256
    """Idle states the engine made itself (`Engine.lease` for calls that name no state) kept at
    most; beyond it the least recently used are closed. Their full blocks stay findable in the
    prefix index until the pool reuses them, so a conversation that comes back recomputes little."""
    max_named_states: int = 4096
    """States that calls named and the engine opened for them (`Engine.lease(state_id=...)`: an
    adapter's `state_id` or LangGraph `thread_id`, a server client's name) kept at most, those in
    use counted and kept; beyond it the least recently used idle ones are put away: written to `state_dir` first where one is set (opening
    the id brings them back), else closed (the next call on the id recomputes the history it
    sends). States opened with `open_state`, `fork` or `load_state` are never counted."""

    def __post_init__(self) -> None:
        if self.memory_budget is not None:  # first: its own message for every wrong kind
            object.__setattr__(self, "memory_budget", parse_budget(self.memory_budget))
        _check_types(self)
        _check(self.num_blocks is None or self.memory_budget is None,
               "kv_device_blocks (num_blocks) and memory_budget both size the device KV: give one")
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               f"block_size must be a power of two, got {self.block_size}")
        _check(self.num_blocks is None or self.num_blocks >= 2,
               f"{_SHOWN_AS['num_blocks']} must be at least 2, got {self.num_blocks}")
        _check(0.0 < self.memory_fraction <= 1.0, "memory_fraction must lie in (0, 1]")
        _check(self.max_kv_bytes_cpu > 0, f"max_kv_bytes_cpu must be a positive number of bytes, got "
                                          f"{self.max_kv_bytes_cpu}")
        _check(self.max_unnamed_states >= 0, "max_unnamed_states must be >= 0")
        _check(self.max_named_states >= 0, "max_named_states must be >= 0")
        _check(0.0 <= self.pin_budget <= 1.0, f"pin_budget must lie in [0, 1], got {self.pin_budget}")
        _check(self.state_dir is None or (isinstance(self.state_dir, (str, os.PathLike))
                                          and not isinstance(self.state_dir, bytes) and str(self.state_dir) != ""),
               f"state_dir must be a folder path (str or os.PathLike) or None, got {self.state_dir!r}")
        if self.state_dir is not None:  # a relative one is of the folder it was given in, not of a later os.chdir
            object.__setattr__(self, "state_dir", os.path.abspath(self.state_dir))
        _check(self.eviction_policy in EVICTION_POLICIES,
               f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction_policy!r}")
        if self.host_kv_bytes is not None:  # bytes, or a size string as memory_budget takes
            object.__setattr__(self, "host_kv_bytes", parse_bytes(self.host_kv_bytes, "host_kv_bytes"))
        _check(self.kv_dtype in ("auto", "float32", "bfloat16", "float16", *FP8_KV_DTYPES),
               f"kv_dtype must be auto, float32, bfloat16, float16 or fp8, got {self.kv_dtype!r}")

    @property
    def fp8(self) -> bool:
        """kv_dtype asks for the fp8 cache of the kv8 pass."""
        return self.kv_dtype in FP8_KV_DTYPES


FP8_KV_DTYPES = ("fp8", "float8_e4m3fn")


PRIORITY_STRATEGIES = ("fifo", "priority", "shortest_first")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching under a token budget."""

    max_num_batched_tokens: int = 2048
    """Tokens computed per step across all sequences (decode tokens + prefill chunks)."""
    max_concurrent_agents: int = 64
    """Requests running at once; further requests wait, admitted in `priority_strategy` order."""
    max_prefill_chunk: int = 2048
    """Longest prefill chunk one sequence may take in a step, so decodes are never starved."""
    queue_timeout_ms: float | None = None
    """A request still waiting for admission after this long fails with QueueTimeoutError (its
    state keeps the history it was called with); None: it waits as long as it takes."""
    priority_strategy: str = "fifo"
    """Admission order of waiting requests: "fifo" (arrival), "priority" (highest
    `SamplingParams.priority` first, arrival order among equals) or "shortest_first" (fewest
    tokens left to compute first: a turn that reuses its state's KV, resident
    or parked, goes before a cold prompt).
    A request that was preempted, or admitted and found no KV room yet, keeps its place at the head."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        _check(self.max_concurrent_agents >= 1, "max_concurrent_agents must be at least 1")
        _check(self.max_prefill_chunk >= 1, "max_prefill_chunk must be at least 1")
        _check(self.queue_timeout_ms is None or self.queue_timeout_ms > 0,
               f"queue_timeout_ms must be > 0 or None (no timeout), got {self.queue_timeout_ms}")
        _check(self.priority_strategy in PRIORITY_STRATEGIES,
               f"priority_strategy must be one of {', '.join(PRIORITY_STRATEGIES)}, got {self.priority_strategy!r}")


MAX_DRAFT_TOKENS = 16
"""Longest draft a request verifies in a step (a fixed k at most this; the controller's longest)."""


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding: draft tokens from a drafter, verified in the ordinary step.

    Given as `speculation=` to the engine or to `SamplingParams`: "adaptive" or True (the
    default: the controller picks 0..16 drafts per agent and step by measured goodput), "off" or
    False, or a dict
    `{"method": "suffix" | "ngram" | "draft_model" | <a plugin's drafter>, "k": 4}` (k given:
    always draft k; k left out: adaptive with that drafter). Output is the same either way
    (greedy: token for token; sampling: the same distribution). The draft model is given on the
    engine: `speculation={"method": "draft_model", "draft_model": path, "k": 4}`.
    """

    enabled: bool = True
    method: str = "suffix"
    """The drafter, by the name it is registered under (`register_drafters`)."""
    k: int | None = None
    """Fixed draft length per step; None: adaptive."""
    draft_model: str | None = None
    """Checkpoint (directory or Hugging Face repo id) of the "draft_model" drafter (same tokenizer
    as the target); one per engine."""
    engines_drafter: bool = field(default=False, compare=False, repr=False)
    """Given as "adaptive", True or a dict without "method", which name no drafter: on a request,
    the engine's drafter (its draft model, say) with this k (adaptive for "adaptive"), as the
    engine's own setting would be; on the engine, suffix."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check(bool(self.method), "speculation method must name a drafter, e.g. 'suffix'")
        _check(self.draft_model is None or (self.method == "draft_model" and self.draft_model != ""),
               f"speculation draft_model is the checkpoint of method 'draft_model' (got "
               f"{'no method' if self.engines_drafter else f'method {self.method!r}'}, draft_model "
               f"{self.draft_model!r}); pass "
               "{'method': 'draft_model', 'draft_model': path}")
        _check(self.k is None or 0 <= self.k <= MAX_DRAFT_TOKENS,
               f"speculation k must lie in [0, {MAX_DRAFT_TOKENS}], got {self.k}")

    @classmethod
    def parse(cls, value: Any) -> "SpeculationConfig":
        """"adaptive" or True, "off" or False, a {"method": ..., "k": ...} dict, or a
        SpeculationConfig. None is refused: it means "the engine's" on a request alone."""
        if isinstance(value, cls):
            return value
        if value == "adaptive" or value is True:
            return cls(engines_drafter=True)
        if value == "off" or value is False:
            return cls(enabled=False)
        if value is None:
            raise ConfigError("speculation=None means \"the engine's setting\" on a request (SamplingParams) only; "
                              "the engine's own is 'adaptive' (the default; also True), 'off' (also False) or a dict "
                              "like {'method': 'suffix', 'k': 4}")
        if isinstance(value, dict):
            unknown = set(value) - {"method", "k", "draft_model"}
            _check(not unknown, f"speculation takes the keys 'method', 'k' and 'draft_model', "
                                f"got {sorted(map(str, unknown))}")
            return cls(**value, engines_drafter="method" not in value)  # {"k": 4}: the engine's drafter, 4 a step
        raise ConfigError(f"speculation must be 'adaptive' (or True), 'off' (or False) or a dict like "
                          f"{{'method': 'suffix', 'k': 4}}, got {value!r}")

    @property
    def adaptive(self) -> bool:
        return self.enabled and self.k is None

    @property
    def active(self) -> bool:
        return self.enabled and self.k != 0

    @property
    def max_drafts(self) -> int | None:
        """Drafts a sequence may verify in a step: 0 off, k fixed, None adaptive (any the
        controller picks)."""
        return self.k if self.enabled else 0

    def draft_rows(self, agent_slots: int) -> int:
        """Drafts a step may verify in all, as this engine-wide default sizes the step's workspace
        (each draft samples a row of logits) and the scheduler keeps to: k a slot under a fixed k,
        16 a slot when adaptive (the longest draft a sequence verifies: under load the trace-driven
        agents verify ~9 tokens a sequence, so a smaller share would slow them), none when off (a
        request that turns speculation on in such an engine drafts into the rows that other
        sequences leave unused)."""
        if not self.enabled:
            return 0
        return agent_slots * (MAX_DRAFT_TOKENS if self.k is None else self.k)


OPTION_ALIASES = {"kv_device_blocks": "num_blocks", "memory_budget_bytes": "memory_budget"}
"""Other names engine options answer to: the memory manager's (issue 17) and earlier releases'."""


def _alias_of(name: str) -> str | None:
    return next((alias for alias, target in OPTION_ALIASES.items() if target == name), None)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `Engine.from_pretrained` needs; overrides are keyword arguments of it."""

    model: str = "demo"
    """A Hugging Face repo id ("Qwen/Qwen3-8B", "org/name@revision": the local Hugging Face cache,
    else downloaded), a checkpoint directory, or "demo" for the bundled demo model."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    dtype: str = "auto"
    """"auto" (on a GPU the checkpoint's 16-bit dtype, bfloat16 where config.json declares float32
    or none; float32 on CPU), "float32", "bfloat16" or "float16"."""
    seed: int = 0
    """Seed of the engine's generator, used for sampling requests that give no seed."""
    max_model_len: int | None = None
    """Longest history a state may hold; None: the model's max_position_embeddings."""
    progress: bool = True
    """Show progress bars for long work (loading)."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs (CUDA only); False runs every step eagerly."""
    async_scheduling: bool | None = None
    """Launch each step before reading the previous one's tokens back, so host work overlaps
    the device's; None: on for CUDA (on the CPU nothing overlaps, but True runs the same logic)."""
    speculation: Any = "adaptive"
    """Speculative decoding for every request that does not set its own: "adaptive" (or True),
    "off" (or False), or {"method": ..., "k": ...} (see `SpeculationConfig`); stored parsed."""
    surgery: Any = ()
    """Model surgery passes applied at load, in order: names or {"name": ..., parameters}, e.g.
    ["w8"] or [{"name": "w4", "group_size": 64}] (see `hibana_core.surgery`); stored parsed."""
    surgery_guard: bool = True
    """Measure each surgery pass against the unmodified model on held-out text (seeded random
    tokens for a checkpoint without a tokenizer) and refuse one over its floors (see
    `hibana_core.surgery.guard`); False skips it (random-weight benchmarks)."""
    surgery_guard_text: str | None = None
    """A UTF-8 text file the guard measures on instead of the demo agents' conversations."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        from hibana_core.surgery import parse_passes

        for name, kind in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            _check(isinstance(getattr(self, name), kind),
                   f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}; give its fields as "
                   f"options instead (block_size=..., max_concurrent_agents=...)")
        _check_types(self)
        object.__setattr__(self, "speculation", SpeculationConfig.parse(self.speculation))
        object.__setattr__(self, "surgery", parse_passes(self.surgery))
        kv8 = any(r.name == "kv8" for r in self.surgery)
        _check(not kv8 or self.cache.kv_dtype == "auto" or self.cache.fp8,
               f"surgery kv8 stores the KV cache in fp8; kv_dtype={self.cache.kv_dtype!r} asks for another "
               "dtype: leave kv_dtype 'auto' (or 'fp8')")
        if self.cache.fp8 and not kv8:  # one path: kv_dtype="fp8" is the kv8 pass, applied last
            object.__setattr__(self, "surgery", self.surgery + parse_passes(["kv8"]))
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _check(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
               f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _check(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive")

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """Every key `from_overrides` takes: the fields, the nested configs' fields, the aliases
        (what the adapters' `engine_kwargs` take)."""
        nested = (CacheConfig, SchedulerConfig)
        fields = {f.name for kind in (cls, *nested) for f in dataclasses.fields(kind)} - {"model"}  # (the first argument)
        return frozenset(fields | OPTION_ALIASES.keys())

    @classmethod
    def from_overrides(cls, model: str, **overrides: Any) -> "EngineConfig":
        """Build a config from flat keyword overrides.

        A key that names a field of a nested config (`block_size=32`, `max_concurrent_agents=8`)
        goes to that config; `cache=` and `scheduler=` may also be given whole.
        """
        nested = {"cache": CacheConfig, "scheduler": SchedulerConfig}
        own = {f.name for f in dataclasses.fields(cls)}
        top: dict[str, Any] = {"model": model}
        parts: dict[str, dict[str, Any]] = {name: {} for name in nested}
        for key, value in overrides.items():
            if key in OPTION_ALIASES:
                _check(OPTION_ALIASES[key] not in overrides,
                       f"{key} is another name of {OPTION_ALIASES[key]}: give one of them")
                key = OPTION_ALIASES[key]
            if key in own:
                top[key] = value
                continue
            owner = [name for name, kind in nested.items()
                     if key in {f.name for f in dataclasses.fields(kind)}]
            if not owner:
                names = cls.option_names()
                close = difflib.get_close_matches(key, names, n=1)
                known = ", ".join(f"{name} (or {alias})" if (alias := _alias_of(name)) else name
                                  for name in sorted(names - OPTION_ALIASES.keys()))
                raise ConfigError(f"unknown engine option {key!r}"
                                  f"{f' (did you mean {close[0]!r}?)' if close else ''}; known options: {known}")
            parts[owner[0]][key] = value
        for name, kind in nested.items():
            if parts[name]:
                base = top.get(name, kind())
                top[name] = dataclasses.replace(base, **parts[name])
        return cls(**top)


GREEDY_TEMPERATURE = 1e-5
"""Below this temperature sampling is greedy (as in vLLM)."""


MAX_TOP_LOGPROBS = 20
"""The most alternatives per token `top_logprobs` may ask for (OpenAI's limit)."""

MAX_LOGIT_BIAS = 100.0
"""The largest bias `logit_bias` may give a token, either way (OpenAI's range: [-100, 100])."""

MAX_STOPS = 64
"""The most stop strings one request may give (the server's cap too): the engine's thread matches
each at every character generated, so 100,000 of them slowed every other agent's steps."""


def token_id_key(key: str) -> int | None:
    """A token id as JSON's object keys write one (OpenAI's logit_bias: {"1234": 5}): ASCII digits,
    spaces around them allowed, within int64; None where `key` is none ("١٢" is decimal to Python
    and no id to OpenAI; int() of 4,301 digits and more is a ValueError)."""
    digits = key.strip()
    if not (digits.isascii() and digits.isdecimal()) or len(digits.lstrip("0")) > 19:
        return None
    token = int(digits)
    return token if token < 2**63 else None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; the defaults are greedy decoding of up to 128 tokens."""

    max_tokens: int = 128
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all (so does -1, as vLLM spells it; stored as 0)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    repetition_penalty: float = 1.0
    """HF-style: divide positive logits (multiply negative) of tokens seen in the history."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtract from logits of tokens generated at least once."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtract count * penalty from logits of generated tokens."""
    logit_bias: Mapping[int, float] | None = None
    """OpenAI-style: token id -> a bias in [-100, 100] added to its logit at every position (before
    the penalties, after a grammar's mask: a bias never lets a forbidden token through); -100
    bans a token in practice and 100 all but forces it. Stored as a dict of ints to floats; ids
    outside the model's vocabulary are refused when the request is submitted."""
    seed: int | None = None
    """Per-request seed: same seed, same tokens, whatever else shares the batch."""
    stop_token_ids: Sequence[int] = ()
    """Generation ends after any of these tokens (it is kept in the state and the output)."""
    stop: Sequence[str] = ()
    """Generation ends when the decoded text contains any of these strings (it may span tokens); 64
    at most (`MAX_STOPS`)."""
    ignore_eos: bool = False
    """Do not stop on the model's end-of-sequence tokens."""
    logprobs: bool = False
    """Return each generated token's log-probability under the model (its raw distribution, before
    penalties, temperature, truncation and grammar masks, as vLLM and OpenAI report it, and before
    a logit bias)."""
    top_logprobs: int = 0
    """With logprobs: also the this many most likely tokens at each position (0 to 20)."""
    speculation: Any = None
    """This request's speculative decoding ("adaptive" or True: the engine's drafter, the draft
    length adaptive; "off" or False; {"method": ..., "k": ...}); None: the engine's. It changes
    speed only, never the output."""
    json_schema: Any = None
    """Constrain the output to JSON valid under this schema: a dict, its JSON text or a type (a
    pydantic model, a TypedDict, a dataclass; stored as its schema, a dict). The JSON is compact,
    spaced as `json.dumps` writes it."""
    strict_schema: bool = True
    """With json_schema: a keyword the grammar cannot hold the output to (`not`, `if`/`then`,
    `contains`, ...) is a GrammarError naming it (True), or is left to the model while the grammar
    holds the rest (False: as OpenAI's `strict: false` and vLLM's guided decoding do; the server's
    `response_format` without `"strict": true`). A schema the grammar holds whole is held either way."""
    regex: str | None = None
    """Constrain the whole output to match this regular expression."""
    grammar: Any = None
    """Constrain the output to a grammar: EBNF text (xgrammar's GBNF-like dialect, with a rule
    `root`), or a structural tag {"type": "structural_tag", "format": {...}} (xgrammar's format:
    free text with triggered tags, as tool calls use). One of json_schema, regex and grammar at
    most; the output ends (a stop token is allowed) only where the grammar is complete. A schema
    or grammar that does not compile fails its request alone, with a GrammarError."""
    priority: int = 0
    """Admission priority under `priority_strategy="priority"`: higher goes first."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "SamplingParams":
        # before the generated __init__, whose answer to a misspelt or foreign option
        # (`max_new_tokens`, `n`) is a bare TypeError
        known = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                raise ConfigError(f"SamplingParams has no option {name!r}"
                                  f"{f' (did you mean {close[0]!r}?)' if close else ''}; "
                                  f"its options: {', '.join(known)}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_types(self)
        if self.speculation is not None:
            object.__setattr__(self, "speculation", SpeculationConfig.parse(self.speculation))
        self._check_constraint()
        _check(self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.top_k >= -1, f"top_k must be >= 0 (0 or vLLM's -1 disables it), got {self.top_k}")
        if self.top_k == -1:  # vLLM's spelling of "every token"
            object.__setattr__(self, "top_k", 0)
        _check(0.0 < self.top_p <= 1.0, f"top_p must lie in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must lie in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must lie in [-2, 2] (0 disables it), got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must lie in [-2, 2] (0 disables it), got {self.frequency_penalty}")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(self.logprobs or not self.top_logprobs, "top_logprobs needs logprobs=True")
        _check(isinstance(self.stop, str) or isinstance(self.stop, Sequence), "stop must be a string or a list of them")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty str")
        _check(len(self.stop) <= MAX_STOPS, f"stop: at most {MAX_STOPS} stop strings per request, got "
               f"{len(self.stop)}; stop on fewer, or cut the text after generating")
        if hasattr(self.stop_token_ids, "tolist") and not isinstance(self.stop_token_ids, Sequence):  # as sync takes
            object.__setattr__(self, "stop_token_ids", self.stop_token_ids.tolist())  # an array, a tensor
        _check(isinstance(self.stop_token_ids, Sequence) and not isinstance(self.stop_token_ids, str)
               and all(is_kind(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        _check(isinstance(bias, Mapping), f"logit_bias must be a dict of token id -> bias, got {bias!r:.80}")
        if (set(map(type, bias)) <= {int} and set(map(type, bias.values())) <= {int, float}
                and all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in bias.values())  # (NaN fails too)
                and (not bias or 0 <= min(bias) and max(bias) < 2**63)):
            # the usual form, in one pass over it: a whole vocabulary's bias (150k ids) took 0.4 s below
            object.__setattr__(self, "logit_bias", {token: float(v) for token, v in bias.items()} or None)
            return
        checked: dict[int, float] = {}
        keys: dict[int, Any] = {}  # each id's key as given
        for key, value in bias.items():
            read = token_id_key(key) if isinstance(key, str) else None  # JSON's keys (OpenAI's form)
            token = key if read is None else read
            _check(is_kind(token, int) and token >= 0,
                   f"logit_bias keys must be token ids (integers >= 0), got {token!r:.40}")
            _check(is_kind(value, float) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
                   f"logit_bias[{token}] must lie in [-100, 100], got {value!r}")
            _check(int(token) not in keys, f"logit_bias names token {int(token)} twice (keys "
                   f"{keys.get(int(token))!r:.40} and {key!r:.40}); give each token id once")  # (the last one won)
            keys[int(token)] = key
            checked[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", checked or None)

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are argmax: dividing logits by them overflows."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def constrained(self) -> bool:
        """Whether a JSON schema, regex or grammar constrains the output."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    def _check_constraint(self) -> None:
        given = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        if len(given) > 1:
            raise GrammarError(f"give one of json_schema, regex and grammar, not {' and '.join(given)}; "
                               "write the constraints as one grammar")
        schema = self.json_schema
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
            schema = schema.model_json_schema()
        elif isinstance(schema, type) or typing.get_origin(schema) is not None:
            # a TypedDict, a dataclass, list[int], Optional[int], a Union, a Literal, Annotated[...]
            schema = _type_schema(schema)
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise GrammarError(f"json_schema is a string but not JSON ({exc}); pass the schema as a dict "
                                   "or its JSON text") from None
        if schema is not None and not isinstance(schema, (dict, bool)):
            raise GrammarError(f"json_schema must be a JSON schema (a dict, its JSON text, or a type: a pydantic "
                               f"model, a TypedDict, a dataclass), got {type(schema).__name__}")
        if nests_deeper(schema, MAX_JSON_DEPTH) or nests_deeper(self.grammar, MAX_JSON_DEPTH):
            raise GrammarError(f"the {'json_schema' if schema is not None else 'structural tag'} nests objects and "
                               f"arrays more than {MAX_JSON_DEPTH} levels deep, more than the grammar's checks take; "
                               "flatten it (a $ref to a shared definition instead of nesting it again)")
        object.__setattr__(self, "json_schema", schema)
        if self.regex is not None and not self.regex:
            raise GrammarError("regex is empty; pass a regular expression, or None for no constraint")
        grammar = self.grammar
        if grammar is not None and not (
                (isinstance(grammar, str) and grammar.strip())
                or (isinstance(grammar, dict) and grammar.get("type") == "structural_tag")):
            raise GrammarError(f"grammar must be EBNF text or a structural tag dict "
                               f"({{'type': 'structural_tag', 'format': ...}}), got {grammar!r:.80}")


# inspect (help(), IDEs, tests) reads a class's __new__ before its __init__: without this the fields
# and their defaults showed as (*args, **kwargs)
_init = inspect.signature(SamplingParams.__init__)
SamplingParams.__signature__ = _init.replace(parameters=list(_init.parameters.values())[1:])


def needs_history(p: SamplingParams) -> bool:
    """Whether sampling for p reads the request's earlier tokens on the host: the penalties."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _extension_typed_dicts(kind: Any, done: dict | None = None) -> Any:
    """`kind` with every `typing.TypedDict` in it (its own fields, list items, unions, ...) rebuilt
    as a `typing_extensions.TypedDict` with the same keys, required ones and docstring: before
    Python 3.12 pydantic reads only those, and refuses the other as LangChain's users write it."""
    import sys

    import typing_extensions

    if sys.version_info >= (3, 12):
        return kind
    done = {} if done is None else done
    if typing.is_typeddict(kind) and type(kind).__module__ == "typing":  # (typing's, not the extension's)
        if kind not in done:
            hints = typing.get_type_hints(kind, include_extras=True)
            done[kind] = None  # (a self-reference stays as written)
            fields = {key: (typing_extensions.Required if _required(key, hint, kind) else typing_extensions.NotRequired)[
                _extension_typed_dicts(_unmarked(hint), done)] for key, hint in hints.items()}
            rebuilt = typing_extensions.TypedDict(kind.__name__, fields)
            rebuilt.__doc__, rebuilt.__module__ = kind.__doc__, kind.__module__
            done[kind] = rebuilt
        return done[kind] or kind
    args = typing.get_args(kind)
    if not args:
        return kind
    rebuilt_args = tuple(_extension_typed_dicts(a, done) for a in args)  # (a Literal's values come back as they are)
    if rebuilt_args == args:
        return kind
    origin = typing.get_origin(kind)
    if origin is typing_extensions.Annotated or origin is typing.Annotated:
        return typing.Annotated[(rebuilt_args[0], *kind.__metadata__)]
    if origin is types.UnionType:
        return typing.Union[rebuilt_args]
    if isinstance(kind, types.GenericAlias):
        return types.GenericAlias(origin, rebuilt_args)
    return kind.copy_with(rebuilt_args) if hasattr(kind, "copy_with") else kind


def _required(key: str, hint: Any, kind: Any) -> bool:
    """Whether a TypedDict's key is required: its field's own mark where it has one (a postponed
    annotation's NotRequired is not in `__required_keys__` before Python 3.12), else its class's."""
    import typing_extensions

    origin = typing.get_origin(hint)
    if origin in (typing.Required, typing_extensions.Required):
        return True
    if origin in (typing.NotRequired, typing_extensions.NotRequired):
        return False
    return key in kind.__required_keys__


def _unmarked(hint: Any) -> Any:
    """A field's type without its Required / NotRequired mark (the rebuilt class marks each anew)."""
    import typing_extensions

    while typing.get_origin(hint) in (typing.Required, typing.NotRequired, typing_extensions.Required,
                                      typing_extensions.NotRequired):
        hint = typing.get_args(hint)[0]
    return hint


def _type_schema(kind: Any) -> dict:
    """The JSON schema of a type that is no pydantic model (a TypedDict, a dataclass, `list[int]`,
    `Optional[Model]`, `Literal["a", "b"]`), as pydantic writes it: the schema its parsing
    (`TypeAdapter(kind).validate_json`) checks."""
    import pydantic

    name = getattr(kind, "__name__", kind)
    try:
        return pydantic.TypeAdapter(_extension_typed_dicts(kind)).json_schema()
    except pydantic.PydanticSchemaGenerationError:
        raise GrammarError(f"json_schema is the type {name}, which has no JSON schema; pass a pydantic model, a "
                           "TypedDict, a dataclass or a schema dict") from None
    except pydantic.PydanticUserError as exc:  # typing.TypedDict before Python 3.12, ...
        raise GrammarError(f"json_schema is the type {name}, which pydantic writes no schema for: "
                           f"{str(exc).splitlines()[0]}") from None
