"""Engine facade: loads the model, sizes the KV cache, wires the parts, hands out state handles.

    Engine
      EngineCore      the step loop: schedule, launch, update (engine_core.py)
        Scheduler       which tokens of which requests run in a step (scheduler.py)
        ModelRunner     batch tensors, forward, sampling (runner.py)
        OutputProcessor detokenizing, stop strings, timing, events (output.py)
        Grammars        constrained decoding: compiled grammars, each step's masks (grammar/)
      StateRegistry   states by id, leasing, what StateHandle asks for (registry.py)

One lock serialises the step with edits of states, so a handle never sees a half-applied step.
"""

from __future__ import annotations

import collections
import gc
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

try:
    import fcntl
except ImportError:  # no flock (Windows): a spill folder lives by its pid
    fcntl = None

from hibana_core.config import EngineConfig
from hibana_core.engine_core import EngineCore
from hibana_core.errors import ConfigError, EngineClosedError, MemoryBudgetError
from hibana_core.forward_context import ForwardContext
from hibana_core.grammar import Grammars
from hibana_core.kv.block_pool import BlockPool
from hibana_core.kv.budget import device_memory, workspace_bytes
from hibana_core.kv.recurrent import RecurrentSlots, slots_within
from hibana_core.kv.recurrent_cache import RecurrentCache, VerifyStash
from hibana_core.kv.cache import KVCache, kv_cache_dtype
from hibana_core.kv.layout import KVLayout
from hibana_core.kv.sequence import LongRope
from hibana_core.kv.state_file import PRIVATE_DIR
from hibana_core import surgery
from hibana_core.surgery.calibration import Calibration
from hibana_core.loader import (LOAD_STAGES, check_max_model_len, context_limit, load_from_hf_model, load_model,
                                model_bytes)
from hibana_core.models.decoder import kv_layers, longrope_switch, rotary_bytes, rotary_positions, size_rotary
from hibana_core.output import OutputProcessor
from hibana_core.progress import LoadProgress
from hibana_core.registry import ModelLimits, StateRegistry
from hibana_core.runner import DecodeGraphs, ModelRunner
from hibana_core.sampler import Sampler
from hibana_core.kv.tiers import HostTier, default_host_budget
from hibana_core.kv.transfers import CopyStream
from hibana_core.scheduler import IdleLRUEviction, Scheduler
from hibana_core.speculation.speculator import Speculator, check_method, profile_step_costs
from hibana_core.state import StateHandle, StateInfo
from hibana_plugins.manager import get_plugin_manager

if TYPE_CHECKING:
    from hibana_core.chat import Chat

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger("hibana.engine")


# Engines that `Engine.shared` made, while anything uses them; the most recently asked for stay
# alive even unused, so a framework object made anew per call still finds its agents' KV.
_SHARED: "weakref.WeakValueDictionary[str, Engine]" = weakref.WeakValueDictionary()
_SHARED_RECENT: "collections.deque[Engine]" = collections.deque(maxlen=2)
_SHARED_LOCK = threading.Lock()


@dataclass(frozen=True)
class EngineStats:
    prompt_tokens_computed: int
    prompt_tokens_reused: int
    generated_tokens: int
    steps: int
    multi_sequence_steps: int     # steps that batched more than one sequence
    max_batch_sequences: int
    # the KV pool in the blocks kv_device_blocks counts, each block_size tokens of every layer (a
    # model with sliding-window layers keeps pages of fewer layers, kv/layout.py: total rounds down,
    # used and cached round up, so kv_device_blocks=n reads back as n and one page in use as 1)
    kv_blocks_total: int
    kv_blocks_used: int           # referenced by at least one state
    kv_blocks_cached: int         # unreferenced but still findable by prefix
    states: int
    draft_tokens_proposed: int = 0  # drafts verified (speculation)
    draft_tokens_accepted: int = 0
    verify_steps: int = 0           # steps that verified drafts
    verified_sequences: int = 0     # (sequence, step) pairs that verified drafts
    verified_tokens: int = 0        # tokens those emitted: accepted drafts + one each
    speculation: dict | None = None
    """The controller's figures: draft lengths chosen, acceptance by position per drafter (and per
    drafter for each state, "acceptance_by_state"), tokens per verifying sequence, the step-cost
    table."""
    parks: int = 0                  # idle states' KV parked in the host tier under device pressure
    resumes: int = 0                # parked KV copied back for a request (not recomputed)
    host_tier: dict | None = None   # its budget, bytes, bytes moved, time, tokens restored (kv/tiers.py)
    requests_waiting: int = 0       # requests queued for admission (a server's queue length)
    requests_running: int = 0       # requests admitted, generating or prefilling
    step_seconds: float = 0.0       # wall time of the engine's steps, summed
    step_time_buckets: tuple[int, ...] = ()  # steps per bucket of engine_core.STEP_TIME_BUCKETS, then past them
    pool_limited: int = 0           # requests ended "length" as their history outgrew the device KV pool


def resolve_device(device: str) -> torch.device:
    """The torch device `device` names ("auto", "cpu", "cuda", "cuda:N"), or a ConfigError saying
    what this machine has; checked before anything loads."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device={device!r} is not a device name ({exc}); use auto, cpu or cuda:N") from None
    if resolved.type == "cuda" and (not torch.cuda.is_available()
                                    or (resolved.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device={device!r} asks for a CUDA device this machine does not have "
                          f"({torch.cuda.device_count()} visible); use device='cpu' or 'auto'")
    if resolved.type == "mps":
        raise ConfigError("device='mps' is not supported yet; use device='cpu'")
    return resolved


def _moe_shape(hf_config) -> dict[str, int]:
    """A sparse model's routes per token and expert width, for the workspace estimate."""
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not top_k:
        return {}
    width = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    return {"moe_top_k": top_k, "moe_intermediate_size": width}


SPILL_LOCK = "owner.lock"
"""In a spill folder: the file its engine holds an exclusive flock on while it lives."""


def _check_state_dir(state_dir) -> None:
    """A ConfigError, before the weights load, where `state_dir` cannot be made or written (it
    was said only after minutes of loading, where `_spill_folder` first writes there)."""
    try:
        # made owner-only where it is made here (it keeps states' files); one that exists keeps its mode
        Path(state_dir).mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=state_dir):
            pass
    except (OSError, UnicodeError) as exc:
        raise _unwritable(state_dir, exc) from None


def _unwritable(state_dir, exc: BaseException) -> ConfigError:
    return ConfigError(f"state_dir {str(state_dir)!r} cannot be written ({exc}); give a folder this process may "
                       "write")


def _spill_folder(state_dir) -> tuple[Path, Any]:
    """This engine's own folder for spilled KV under `state_dir` (engines may share a state_dir),
    and the lock it holds on it while it lives (`_owned`); the folders of engines that died
    without closing are removed here. A ConfigError where it cannot be made."""
    try:
        Path(state_dir).mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)  # (as `_check_state_dir`)
        for stale in Path(state_dir).glob("spill-*-*"):
            if _abandoned(stale):
                try:  # (another engine starting may have removed it meanwhile)
                    spilled = sum(1 for f in stale.iterdir() if f.name != SPILL_LOCK)
                except OSError:
                    spilled = 0
                if spilled:  # scratch of an engine that never closed: said, not silently dropped
                    logger.warning("state_dir: removed %s, %d spilled KV file(s) of an engine that ended without "
                                   "closing; states are kept in state_dir only when their engine closes", stale,
                                   spilled)
                shutil.rmtree(stale, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(prefix=f"spill-{os.getpid()}-", dir=state_dir))  # owner-only (0700)
        return folder, _owned(folder)
    except (OSError, UnicodeError) as exc:
        raise _unwritable(state_dir, exc) from None


def _owned(folder: Path) -> Any:
    """An open file in `folder` whose exclusive flock this engine holds until it closes it (None
    where the platform has no flock): other engines see the folder as live, whatever their PID
    namespace (a container's) says of its pid."""
    if fcntl is None:
        return None
    handle = open(folder / SPILL_LOCK, "w")  # noqa: SIM115 - held open for the engine's life
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return handle


def _abandoned(folder: Path) -> bool:
    """Whether no live engine owns a spill folder: its lock can be taken (its engine's process
    died, in any PID namespace of this host; a pid alone named a live process in another
    container, or this one after a restart that reused it), or, without a lock (an earlier
    Hibana's folder, a platform without flock), no process has its pid."""
    if fcntl is not None and (folder / SPILL_LOCK).is_file():
        try:
            with open(folder / SPILL_LOCK, "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:  # held: its engine lives
            return False
    pid = folder.name.split("-")[1]
    return pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _release_tensors(model: torch.nn.Module) -> None:
    """Empty every parameter and buffer of a closing engine's model, so its weights' memory goes
    back whoever still holds the module. On the H200 something did after a CUDA engine with
    captured verify graphs closed (not found; not on the CPU, nor without graphs or speculation):
    the next engine in the process found the 61 GB of a qwen3-30b-a3b preset's weights still
    allocated and sized its KV pool from the rest. The engine's tensors are its own (loading
    copies into them), so a caller's transformers model keeps its weights."""
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        for key, tensor in module._buffers.items():
            if tensor is not None:
                module._buffers[key] = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


class Engine:
    def __init__(self, config: EngineConfig, hf_model: torch.nn.Module | None = None,
                 tokenizer=None) -> None:
        self._closing = threading.RLock()  # closes at once: the later ones return once the first is done
        self.config = config
        self.device = resolve_device(config.device)
        names = (LOAD_STAGES if hf_model is None else ("weights",)) + (("surgery",) if config.surgery else ()) \
            + ("kv cache", "warm-up")
        stages = LoadProgress(config.model, names, enabled=config.progress)
        try:
            self._start(config, hf_model, tokenizer, stages)
        finally:
            stages.close()
        self.load_times: dict[str, float] = dict(stages.times)
        """Seconds each stage of the start took: resolve (and download), config, weights,
        tokenizer, surgery, kv cache, warm-up (draft model, step-cost profile, CUDA graphs)."""
        logger.info("loaded %s on %s in %.2f s (%s)", config.model, self.device, stages.total, stages.summary())

    def _start(self, config: EngineConfig, hf_model: torch.nn.Module | None, tokenizer,
               stages: LoadProgress) -> None:
        self._ctx = ForwardContext()
        # (an engine without surgery reads no pass registry: two plugins' clash there is not its concern)
        registered = get_plugin_manager().surgery_passes() if config.surgery else {}
        passes = surgery.check_requests(config.surgery, registered)  # before loading
        if config.surgery and config.surgery_guard and config.surgery_guard_text is not None:
            from hibana_core.surgery.guard import guard_text_path

            guard_text_path(config.surgery_guard_text)  # a wrong path said before the weights load
        if config.speculation.enabled:  # (an engine that never speculates reads no drafter registry)
            check_method(config.speculation, list(get_plugin_manager().drafters()))
        if config.cache.state_dir is not None:
            _check_state_dir(config.cache.state_dir)
        if hf_model is None:
            loaded = load_model(config.model, self.device, config.dtype, self._ctx, config.progress, stages,
                                max_model_len=config.max_model_len)
        else:
            stages.begin("weights")
            loaded = load_from_hf_model(hf_model, self.device, config.dtype, self._ctx, tokenizer)
        check_max_model_len(config.max_model_len, loaded.args)  # (load_model checked before the weights)
        self.max_model_len = config.max_model_len or min(loaded.args.max_position_embeddings, context_limit(loaded.args))
        rotary_rows = rotary_positions(self.max_model_len, loaded.args)  # (LongRoPE's long rows start there)
        size_rotary(loaded.model, rotary_rows)  # before the guard's forwards: not the config's ~1 GB at 1M positions
        if config.cache.fp8 and any(record["name"] == "kv8" for record in loaded.surgery):
            # kv_dtype="fp8" on a checkpoint `hibana surgery` wrote with kv8: its KV is fp8 already (the kv8
            # pass that kv_dtype adds would be refused, as kv8 named twice)
            passes = tuple(request for request in passes if request.name != "kv8")
        if config.surgery:
            stages.begin("surgery")
        guard = self._guard(loaded, passes) if passes and config.surgery_guard else None
        calibration = Calibration(loaded.model, self._ctx, loaded.args, loaded.dtype, self.device, loaded.tokenizer)
        self.surgery = loaded.surgery + surgery.apply_passes(loaded.model, passes, registered, guard, calibration,
                                                             progress=config.progress,
                                                             applied=[record["name"] for record in loaded.surgery])
        """What each surgery pass changed (name, parameters, layers, bytes before and after) and,
        where the guard ran, its figures against the unmodified model."""
        if guard is not None:  # logged too: progress=False (servers, scripts) must not lose it
            logger.info("%s", guard.summary())
            if config.progress:  # above the loading bar, which tqdm draws again below it
                from tqdm.auto import tqdm
                tqdm.write(guard.summary(), file=sys.stderr)
        del guard, calibration  # their scratch KV caches
        self.model, self.model_args, self.tokenizer = loaded.model, loaded.args, loaded.tokenizer
        self.hf_config, self.dtype = loaded.hf_config, loaded.dtype
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.vocab_size = loaded.args.vocab_size
        size_rotary(loaded.model, rotary_rows)  # (again: tables a pass made anew)
        kv_dtype = kv_cache_dtype(loaded.model, loaded.dtype)  # after kv8: fp8
        if config.cache.kv_dtype != "auto" and not config.cache.fp8 and _DTYPES[config.cache.kv_dtype] != kv_dtype:
            raise ConfigError(f"kv_dtype={config.cache.kv_dtype!r} differs from the KV dtype of this model "
                              f"({str(kv_dtype).removeprefix('torch.')}); the KV cache is kept in the compute "
                              "dtype or, through model surgery, in fp8 (kv_dtype='fp8', the kv8 pass); leave "
                              "kv_dtype='auto' or set dtype to match")
        self.checkpoint_fingerprint = loaded.fingerprint  # the model as loaded, before this engine's passes
        self.fingerprint = surgery.fingerprint(loaded.fingerprint, loaded.dtype, kv_dtype, self.surgery)
        configuration = surgery.configuration(loaded.fingerprint, loaded.dtype, kv_dtype, self.surgery)
        self.weight_bytes = model_bytes(loaded.model)  # after surgery: packed weights, buffers too
        stages.begin("kv cache")
        self.kv_layout = KVLayout.of_model(loaded.model, self.max_model_len, kv_layers(loaded.args))
        """Which layers share a block table; sliding-window layers free the KV outside their window."""
        num_blocks = self._num_blocks(self.weight_bytes, kv_dtype)
        a, bs = loaded.args, config.cache.block_size
        try:
            self.kv_cache = KVCache(kv_layers(a), num_blocks, bs, a.num_kv_heads, a.head_dim, kv_dtype, self.device,
                                    self.kv_layout)
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            per_block = KVCache.bytes_per_block(self.kv_layout.page_layers, bs, a.num_kv_heads, a.head_dim, kv_dtype)
            layout = self.kv_layout  # (a layout of pages of fewer layers: in the blocks kv_device_blocks counts)
            blocks = f"{num_blocks:,}" if layout.page_layers == layout.num_layers else layout.counted(num_blocks - 1)
            raise MemoryBudgetError(f"cannot allocate {blocks} KV blocks ({num_blocks * per_block:,} bytes) "
                                    f"on {self.device}: {exc}; lower kv_device_blocks or memory_budget") from None
        self._ctx.kv_cache = self.kv_cache
        self.recurrent_slots = self._recurrent_cache()
        """A hybrid model's linear-attention states: their slots (None for other models)."""
        self.pool = BlockPool(num_blocks, bs, reserve_null=self.kv_layout.windowed)
        stages.begin("warm-up")
        runner = ModelRunner(self.model, self._ctx, Sampler(self.device, config.seed), self.device,
                             self.max_model_len, config.scheduler.max_concurrent_agents, config.cuda_graphs)
        me = weakref.proxy(self)  # the speculator holds neither the engine nor its runner
        speculator = Speculator(config.speculation, get_plugin_manager().drafters,
                                lambda: me._profile_steps(me.core.runner), self.vocab_size, me)
        host_bytes = config.cache.host_kv_bytes
        if host_bytes is None:  # on unified memory a budget is one pool: parking would only copy
            one_pool = self.memory_budget is not None and self.device_memory.unified
            host_bytes = 0 if one_pool else default_host_budget()
        elif host_bytes > (host_total := device_memory(torch.device("cpu")).total):  # parked until the OS kills us
            raise MemoryBudgetError(f"host_kv_bytes={host_bytes:,} is more than the {host_total:,} bytes of host "
                                    "memory; lower it, or leave it out (half the memory available at start)")
        spill_dir, self._spill_lock = (_spill_folder(config.cache.state_dir) if config.cache.state_dir is not None
                                       else (None, None))
        side = self.device.type == "cuda" and not self.device_memory.unified  # host memory behind a bus
        self.host_tier = (HostTier(self.kv_cache, self.pool, host_bytes, CopyStream(self.device, side), spill_dir)
                          if host_bytes or spill_dir else None)
        """Idle states' KV parked in host memory, and on disk past it with a state_dir, under
        device pressure (kv/tiers.py), a hybrid model's with its linear layers' state; None: off
        (evicted KV is dropped and recomputed)."""
        eviction = IdleLRUEviction(self.pool, self._idle_sequences, self.host_tier)
        scheduler = Scheduler(config.scheduler, self.pool, eviction, speculator)
        if self.host_tier is not None and self.recurrent_slots is not None:  # hybrid states park with their state
            self.host_tier.recurrent_cache, self.host_tier.recurrent_slot = self._ctx.recurrent, scheduler.recurrent_slot
        use_async = self.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids, self.device)
        """Compiles requests' JSON schemas, regexes and grammars; fills each step's masks."""
        self.core = EngineCore(scheduler, runner, OutputProcessor(self.tokenizer), threading.RLock(), use_async,
                               self.grammars)
        switch = longrope_switch(loaded.args)
        limits = ModelLimits(self.vocab_size, self.max_model_len, self.eos_token_ids, self.fingerprint,
                             self.tokenizer is not None, self.device,
                             None if switch is None else LongRope(switch, rotary_rows,
                                                                    loaded.args.longrope_recompute),
                             configuration)
        self.registry = StateRegistry(self.core, self.kv_cache, config.cache, limits, self.grammars,
                                      self.recurrent_slots, self._ctx.recurrent)
        self.registry.engine_ref = weakref.ref(self)
        if self.host_tier is not None:  # parked states whose agents are due come back ahead of them
            self.core.idle = self.registry.prefetch
            self.core.between_steps = self.registry.prefetch_between_steps
        speculator.start()  # the step-cost profile of adaptive speculation, on this device
        # one sequence's graphs at every span and draft length the default speculation uses, now:
        # the first step of each shape would capture its graph inside an agent's turn (tens of ms)
        self.core.capture_graphs(1, config.speculation.max_drafts)

    def _guard(self, loaded, passes) -> "guard.Guard":
        from hibana_core.surgery import guard

        registered = get_plugin_manager().surgery_passes()  # the documents reach past every pass's reach
        reach = max((guard.guard_reach(registered[p.name], {k: v for k, v in p.params.items() if k != "force"})
                     for p in passes), default=0)
        documents = guard.heldout_documents(loaded.tokenizer, loaded.args.vocab_size, self.config.surgery_guard_text,
                                            loaded.args.max_position_embeddings, reach)
        scorer = guard.Scorer(loaded.model, self._ctx, loaded.args, loaded.dtype, self.device,
                              guard.scorer_length(documents))
        return guard.Guard(scorer, documents, self.config.progress, loaded.tokenizer,
                           guard.heldout_source(loaded.tokenizer, self.config.surgery_guard_text), reach)

    def _profile_steps(self, runner: ModelRunner):
        device = self.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        # an eager profile step is one sequence at positions 0..n-1: never past the model's context
        most = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        return profile_step_costs(runner.profile, most, lambda: sync(device) if device.type == "cuda" else None)

    def _idle_sequences(self):
        return self.registry.idle_sequences()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "demo", **overrides) -> "Engine":
        """Load a model: a Hugging Face repo id ("Qwen/Qwen3-8B", "org/name@revision"), a
        checkpoint directory, or "demo"; overrides go to EngineConfig."""
        return cls(EngineConfig.from_overrides(str(model), **overrides))

    @classmethod
    def from_hf_model(cls, hf_model: torch.nn.Module, tokenizer=None, **overrides) -> "Engine":
        """An engine on the weights of an in-memory transformers model (copied, not shared), or of
        a stand-in with its config and state_dict (`hibana_core.loader.load_from_hf_model`)."""
        name = getattr(hf_model.config, "name_or_path", "") or hf_model.config.model_type
        return cls(EngineConfig.from_overrides(str(name), **overrides), hf_model, tokenizer)

    @classmethod
    def shared(cls, model: str | os.PathLike = "demo", **overrides) -> "Engine":
        """One engine per model and options (as parsed) per process: what adapters use, so several chat
        model objects on one checkpoint share weights, KV pool and step loop. An engine lives
        while an object uses it, the two most recently asked for also while none does."""
        config = EngineConfig.from_overrides(str(model), **overrides)
        # the parsed options: speculation=False and "off", or a dict in any key order, share one; so do
        # engines that differ only in whether loading draws its bars (two copies of the weights else)
        key = repr(replace(config, progress=True))
        with _SHARED_LOCK:
            engine = _SHARED.get(key)
            if engine is None or engine.core.closed:
                engine = _SHARED[key] = cls(config)
            if engine in _SHARED_RECENT:
                _SHARED_RECENT.remove(engine)
            _SHARED_RECENT.append(engine)  # one pushed out closes once nothing else uses it
            return engine

    def _num_blocks(self, weight_bytes: int, kv_dtype: torch.dtype) -> int:
        cache, a, sched = self.config.cache, self.model_args, self.config.scheduler
        per_block = KVCache.bytes_per_block(self.kv_layout.page_layers, cache.block_size, a.num_kv_heads,
                                            a.head_dim, kv_dtype)
        if self.device.type == "cuda":
            # memory that closed engines left in torch's caching allocator is free for this one
            gc.collect()
            torch.cuda.empty_cache()
        self.device_memory = device_memory(self.device)
        """The device's total and free bytes at start, and whether it is unified memory."""
        self.workspace_bytes = workspace_bytes(
            hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
            max_batched_tokens=sched.max_num_batched_tokens, max_agents=sched.max_concurrent_agents,
            dtype_bytes=self.dtype.itemsize, draft_rows=self.config.speculation.draft_rows(sched.max_concurrent_agents),
            **_moe_shape(self.hf_config)) + rotary_bytes(self.model)
        """What a step may allocate besides weights and KV (an estimate, kv/budget.py), the rotary
        tables the first step builds, and a hybrid model's recurrent cache (`_size_states`)."""
        self.memory_budget = None
        """The budget in bytes (None: none given; `num_blocks` or the default sizing)."""
        self.draft_reserve = None
        self.state_slots = 0
        if cache.num_blocks is not None:  # blocks of every layer: the layout's pages of those bytes
            self._size_states(None)
            layout = self.kv_layout
            return -(-cache.num_blocks * layout.num_layers // layout.page_layers) + layout.windowed
        if cache.memory_budget is not None:
            return self._blocks_in_budget(per_block, weight_bytes, kv_dtype)
        if self.device.type == "cuda":  # a fraction of what is free, never the workspace's share
            free = self.device_memory.free
            kv_bytes = min(int(free * cache.memory_fraction), free - self.workspace_bytes)
            kv_bytes -= self._size_states(kv_bytes)
        else:
            kv_bytes = min(cache.max_kv_bytes_cpu, int(self.device_memory.free * cache.memory_fraction))
            kv_bytes -= self._size_states(kv_bytes)
            # on the CPU, never more than every admitted agent at full context (zeroed RAM is slow)
            full = sched.max_concurrent_agents * -(-self.max_model_len // cache.block_size) \
                * len(self.kv_layout.groups)
            kv_bytes = min(kv_bytes, 2 * full * per_block)
        pages = self._least_pages()
        if kv_bytes < pages * per_block:
            limit = ("" if self.device.type == "cuda" else f", at most max_kv_bytes_cpu={cache.max_kv_bytes_cpu:,}")
            raise MemoryBudgetError(
                f"the KV cache sized from free memory holds {kv_bytes:,} bytes (memory_fraction="
                f"{cache.memory_fraction:g} of {self.device_memory.free:,} free{limit}), fewer than two blocks "
                f"({self._two_blocks(pages, per_block)}, block_size={cache.block_size}); raise memory_fraction, lower "
                "block_size, free memory, or set memory_budget / kv_device_blocks")
        return kv_bytes // per_block

    def _size_states(self, agent_bytes: int | None) -> int:
        """Slots of a hybrid model's recurrent cache (`state_slots`; 0 for other models): each
        running agent's state and as many more (idle agents' states, their snapshots, published
        prefixes), 2 x max_concurrent_agents + 2, within `agent_bytes`, the memory left for agents
        (KV and states; None: not known, a KV cache sized in blocks: `kv.recurrent.slots_within`).
        Returns their bytes with the scratch slot's (and on a GPU the verify graphs' stash), which
        join the workspace. (A Qwen3.5-27B state is 151 MB: 130 slots would take 20 GB.)"""
        self.state_slots, taken = self._states_within(agent_bytes)
        self.workspace_bytes += taken
        return taken

    def _states_within(self, agent_bytes: int | None) -> tuple[int, int]:
        """(state slots, their bytes with the scratch slot's and the verify stash's) within
        `agent_bytes`, as `_size_states` takes them; (0, 0) for other models."""
        shapes = getattr(self.model, "recurrent_shapes", None)
        if not shapes:
            return 0, 0
        slot = RecurrentCache.slot_bytes(shapes, self.dtype)
        slots = slots_within(2 * self.config.scheduler.max_concurrent_agents + 2, agent_bytes, slot)
        taken = (slots + 1) * slot
        if self.device.type == "cuda" and self.config.cuda_graphs:  # and the verify graphs' stash
            taken += DecodeGraphs.stash_rows(self.config.scheduler.max_concurrent_agents, shapes, self.dtype) \
                * VerifyStash.row_bytes(shapes, self.dtype)
        return slots, taken

    def _least_agent_bytes(self, rest: int) -> int:
        """The fewest bytes for agents that leave `rest` beside the states they hold: the states
        take a share of what agents get (`_states_within`), so more memory gives them more slots;
        the least fixed point of bytes = rest + states(bytes), from below."""
        least = rest
        for _ in range(10_000):  # (each round adds a slot or more: a handful of rounds in practice)
            grown = rest + self._states_within(least)[1]
            if grown <= least:
                return least
            least = grown
        return least

    def _recurrent_cache(self) -> RecurrentSlots | None:
        shapes = getattr(self.model, "recurrent_shapes", None)
        if not shapes:
            return None
        cache = RecurrentCache(shapes, self.state_slots, self.dtype, self.device)
        self._ctx.recurrent = cache
        return RecurrentSlots(cache.num_slots, cache.copy)

    def _least_pages(self) -> int:
        """Pages the smallest pool holds: two blocks of every layer, as `kv_device_blocks=2` gives
        (a model with sliding-window layers keeps them in pages of fewer layers, a block table a
        group, beside the null page its layout reserves: one page each would serve no request)."""
        layout = self.kv_layout
        return -(-2 * layout.num_layers // layout.page_layers) + layout.windowed

    @staticmethod
    def _two_blocks(pages: int, per_block: int) -> str:
        """The bytes of `_least_pages`' pages, as an error message says them."""
        return f"{pages * per_block:,} bytes" + (f": {pages} pages of {per_block:,}" if pages != 2 else "")

    def _blocks_in_budget(self, per_block: int, weight_bytes: int, kv_dtype: torch.dtype) -> int:
        """KV blocks that fit the budget once the weights, the workspace and a drafter's own model
        (`draft_reserve`: its weights, and its KV, which is sized from the target's) are counted."""
        memory, given = self.device_memory, self.config.cache.memory_budget
        budget = self.memory_budget = memory.resolve(given)
        if budget > memory.total:
            raise MemoryBudgetError(f"memory_budget={given!r} ({budget:,} bytes) is more than the "
                                    f"{memory.total:,} bytes of {self.device}; lower it, or give a fraction")
        from hibana_core.speculation.draft_model import draft_reserve

        reserve = self.draft_reserve = draft_reserve(self, kv_dtype)
        """What the budget holds for the drafter `speculation` names when it runs a model of its own."""
        draft_bytes = reserve.weight_bytes if reserve else 0
        draft_least = reserve.least_bytes if reserve else 0
        draft_share = reserve.share if reserve else 0.0
        host_bytes = (self.config.cache.host_kv_bytes or 0) if memory.unified else 0
        fixed = weight_bytes + self.workspace_bytes + draft_bytes + host_bytes  # (a host tier on unified
        states = self._size_states(budget - fixed)                             # memory: the same memory)
        # the drafter's KV is max(share x the target's, least): kv + that fits what is left
        left = budget - fixed - states
        kv_bytes = int(min(left / (1 + draft_share), left - draft_least))
        pages = self._least_pages()
        if kv_bytes < pages * per_block:
            parts = f"weights {weight_bytes:,}, workspace {self.workspace_bytes:,}"
            if self.state_slots:
                parts += f" (the {self.state_slots + 1} slots of linear-attention states among it)"
            if host_bytes:
                parts += f", the host tier's host_kv_bytes {host_bytes:,} (the same memory here)"
            if draft_bytes or draft_least:
                parts += (f", the {self.config.speculation.method} drafter's weights {draft_bytes:,} and KV "
                          f"(one full-context sequence at least, and a hybrid draft's fewest state slots: "
                          f"{draft_least:,})")
            rest = max(math.ceil(pages * per_block * (1 + draft_share)), pages * per_block + draft_least)
            least = fixed + self._least_agent_bytes(rest)  # (a hybrid's states grow with the budget)
            raise MemoryBudgetError(
                f"memory_budget={given!r} ({budget:,} bytes) cannot hold {parts} bytes and two KV blocks "
                f"({self._two_blocks(pages, per_block)}); raise it to at least {least:,} bytes, lower "
                + ("host_kv_bytes, " if host_bytes else "")
                + "max_num_batched_tokens / max_concurrent_agents (the workspace), or pick a smaller model")
        return kv_bytes // per_block

    def step(self) -> bool:
        """One engine step (the engine's thread runs these while there is work)."""
        return self.core.step()

    # --- states -------------------------------------------------------------------------------

    def open_state(self, state_id: str) -> StateHandle:
        """Get or create the state with this id."""
        return self.registry.open(state_id)

    def load_state(self, path: str | os.PathLike, state_id: str | None = None, *,
                   share: bool = False) -> StateHandle:
        """Restore a state written by `StateHandle.save` (same model and tokenizer only). A
        damaged or inconsistent file is a StateFileError and allocates nothing. The loaded KV
        stays private to this state; `share=True` lets other states reuse it (trusted files)."""
        return self.registry.load(path, state_id, share=share)

    def chat(self, state_id: str, *, tool_parser: str | None = None) -> "Chat":
        """The chat layer on one state: OpenAI-style messages and tools in, text and tool calls out.
        `tool_parser`: a registered tool parser's name (a plugin's too); None: the chat format's, else
        the one the chat template's call syntax reads as."""
        from hibana_core.chat import Chat

        return Chat(self, state_id, tool_parser)

    def match_state(self, token_ids: Sequence[int], *, min_shared: float = 0.0) -> StateHandle | None:
        """The idle, unleased state whose history shares the longest prefix with token_ids (the
        most recently used among equals), or None. The shared prefix must cover at least
        `min_shared` of the state's own tokens (1.0: token_ids continue its whole history)."""
        return self.registry.match(token_ids, min_shared=min_shared)

    @contextmanager
    def lease(self, token_ids: Sequence[int] = (), state_id: str | None = None, *,
              min_shared: float = 1.0) -> Iterator[StateHandle]:
        """One state held for one call, so concurrent calls never share a state (adapters serve
        every framework call this way). With `state_id`, that state (StateBusyError while another
        call holds it or it generates); otherwise the idle state that `match_state(token_ids,
        min_shared=...)` finds (by default only one whose whole history the call continues, so
        a call never takes over another conversation for a shared system prompt), else a new
        one, which still shares full prefix blocks with every other state. At most
        `max_unnamed_states` idle states made this way are kept (least recently used closed)."""
        with self.registry.lease(token_ids, state_id, min_shared=min_shared) as handle:
            yield handle

    def states(self) -> list[StateInfo]:
        return self.registry.infos()

    def stats(self) -> EngineStats:
        with self.core.lock:
            out, steps = self.core.outputs.counters, self.core.counters
            spec, tier = self.scheduler.speculation, self.host_tier
            blocks = self.kv_layout.in_blocks  # pages of the pool, in kv_device_blocks' blocks
            return EngineStats(out.prompt_computed, out.prompt_reused, out.generated, steps.steps,
                               steps.multi_sequence_steps, steps.max_batch_sequences,
                               blocks(self.pool.num_blocks), blocks(self.pool.num_used, up=True),
                               blocks(self.pool.num_cached, up=True), len(self.registry),
                               spec.counters.draft_tokens_proposed, spec.counters.draft_tokens_accepted,
                               spec.counters.verify_steps, spec.counters.verified_sequences,
                               spec.counters.verified_tokens,
                               {**spec.summary(), "acceptance_by_state": self.registry.acceptance(spec)},
                               tier.counters.parks if tier else 0, tier.counters.resumes if tier else 0,
                               tier.summary() if tier else None, len(self.scheduler.waiting),
                               len(self.scheduler.running), steps.step_seconds, tuple(steps.step_time_buckets),
                               self.scheduler.pool_limited)

    def memory(self) -> dict:
        """Bytes per tier and per state: the device (weights, the KV pool and what of it is in
        use, the workspace estimate, a draft model's weights and KV, the budget in bytes or None,
        the device's total and whether it is unified memory; on CUDA the allocator's current and
        peak bytes), the host tier (its budget and the host memory the parked copies hold: a copy
        shared by a fork and its parent once; on a GPU the pinned pages each copy takes), the disk
        tier (its spill files, a file forks hard-link once), and each state's tier, tokens and KV
        bytes there, split as a tier's total counts them: `bytes` what the state alone holds (what
        closing it frees), `shared` what it holds with other states (a fork's blocks or parked
        copy, a common system prompt's blocks), in each of their `shared` and in the tier's
        `kv_shared` once. So a tier's states' `bytes` plus its `kv_shared` make its `kv_used` or
        `kv_parked`. EngineClosedError once the engine is closed (it holds nothing then)."""
        with self.core.lock:
            if self.core.closed:
                raise EngineClosedError("the engine is closed and holds no memory; create a new one with "
                                        "Engine.from_pretrained")
            per_block = self.kv_cache.bytes_per_block_here
            slot_bytes = self._ctx.recurrent.bytes_per_slot if self.recurrent_slots is not None else 0
            held = self.registry.held_bytes(per_block, slot_bytes)
            states = {info.id: {"tier": info.tier, "tokens": info.tokens, "bytes": held[info.id].own,
                                "shared": held[info.id].shared} for info in self.registry.infos()}
            tier, memory = self.host_tier, self.device_memory
            device = {"weights": self.weight_bytes, "kv_pool": self.kv_cache.nbytes,
                      "kv_used": self.pool.num_used * per_block, "kv_shared": self.pool.num_shared * per_block,
                      "kv_cached": self.pool.num_cached * per_block,
                      "workspace_estimate": self.workspace_bytes, "budget": self.memory_budget,
                      "total": memory.total, "unified": memory.unified}
            draft = self.scheduler.speculation.resident_bytes()
            if draft:
                device["draft_model"] = draft
            if self.recurrent_slots is not None:  # a hybrid model's linear-attention states (kv/recurrent.py)
                device["recurrent"] = self._recurrent_memory()
            if self.device.type == "cuda":  # what torch's allocator really holds, and held at most
                device["allocated"] = torch.cuda.memory_allocated(self.device)
                device["peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            return {"device": device,
                    "host": {"budget": tier.budget_bytes if tier else 0, "kv_parked": tier.bytes_used if tier else 0,
                             "kv_shared": tier.shared_bytes if tier else 0},
                    "disk": {"kv_parked": tier.disk_bytes_used if tier else 0,
                             "kv_shared": tier.disk_shared_bytes if tier else 0,
                             "folder": str(tier.spill_dir) if tier and tier.spill_dir else None},
                    "states": states}

    def _recurrent_memory(self) -> dict:
        """A hybrid model's recurrent cache: its bytes and slots, and what holds them (the states'
        live slots, their snapshots, the published states of shared prefixes)."""
        slots, cache = self.recurrent_slots, self._ctx.recurrent
        held = [seq.recurrent for seq in self.registry.sequences() if seq.recurrent is not None]
        return {"bytes": cache.nbytes, "slot_bytes": cache.bytes_per_slot,
                "slots": slots.num_slots, "free": slots.num_free,
                "live": sum(r.slot is not None for r in held), "snapshots": sum(len(r.snapshots) for r in held),
                "published": len(slots.published)}

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop, fail pending requests, write the named states to `state_dir` (if set),
        free every state. Idempotent."""
        with self._closing:  # (a close beside one under way returned at once, everything still held)
            self._close()

    def _close(self) -> None:
        if self.core.closed:
            return
        self.core.close(EngineClosedError("the engine was closed while this request ran"))
        with self.core.lock:
            try:
                if self.config.cache.state_dir is not None:
                    self.registry.persist_all()  # found again by id after a restart
            finally:  # whatever writing the states met, everything is freed
                self.registry.close_all()
                self.scheduler.speculation.close()  # a draft model's weights and KV
                self.grammars.close()  # its worker thread
                if self.host_tier is not None:
                    self.host_tier.close()
                if self._spill_lock is not None:  # its folder is gone: the lock with it
                    self._spill_lock.close()
                # drop the big tensors now (weights, KV cache, CUDA graphs), not when the last handle
                # is collected: an engine opened next sizes its KV pool from the memory free then
                _release_tensors(self.model)
                self.model = self.core.runner = self.kv_cache = self._ctx.kv_cache = self.registry.kv_cache = None
        if self.device.type == "cuda":
            gc.collect()  # whatever cycle still holds device tensors (a plugin's, a drafter's)
            torch.cuda.empty_cache()  # the blocks it held go back to the device

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
