"""The benchmark workloads, each run side by side for Hibana and its peers in one process.

decode: batch-1 decode and prefill speed at given context lengths, against the roofline.
agents: N agents in tool loops (system prompt, then per turn a tool result in and G tokens out).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
from hibana_core.progress import bar as progress_bar

from hibana_bench.models import BenchModel
from hibana_bench.peers import HFPeer, sync
from hibana_bench.spec_systems import SPEC_SYSTEMS, capture_graphs, open_engine
from hibana_core import SamplingParams


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # stay clear of the low ids, where special tokens live
    return [rng.randrange(16, vocab) for _ in range(n)]


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write), the best of 10 copies of nbytes / 2
    timed on the device (CUDA events). Timed on the host it read ~10% low inside a bench process
    (3.67-3.81 TB/s on the H200 against 4.2-4.3 in a process of its own: the host's share of a
    1 ms copy), which made every share of the roofline as much too high (bench/RESULTS.md,
    twenty-eighth session)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 4, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(10):
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / best


# --- decode ---------------------------------------------------------------------------------

PREFILL_REPEATS = 3  # prefill is timed as the median of this many (one prefill is a noisy figure)

@dataclass
class DecodeRow:
    system: str
    context: int
    decode_tok_s: float
    prefill_tok_s: float
    weight_bytes: int | None = None   # what the engine holds (after surgery)
    guard: dict | None = None         # the surgery guard's figures (checkpoints with real weights)
    read_bytes: int | None = None     # weight bytes one decode token reads (MoE: its experts only)
    tokens_per_step: float | None = None  # generated tokens per engine step (above 1: drafts accepted)
    kv_read_bytes: int | None = None  # KV bytes one decode token reads at this context (kv8: 1 per value)


def surgery_systems(passes: list[str]) -> list[str]:
    """`--surgery w8,w4` -> systems "hibana+w8", "hibana+w4" (the default engine with that pass)."""
    return [f"hibana+{name}" for name in passes]


def _surgery_overrides(model: BenchModel, system: str) -> dict:
    if "+" not in system:
        return {}
    # random weights measure speed only: the guard has no meaning there; elsewhere it runs and a
    # pass over its floors is still timed (forced), its decision reported beside the speed
    return {"surgery": [{"name": system.split("+", 1)[1], "force": True}],
            "surgery_guard": not model.random_weights}


def _read_bytes(engine) -> int | None:
    """The weight bytes one decode token reads, where the engine's model says
    (`decode_bytes_per_token`: all weights but unselected experts and unread embedding rows)."""
    model = getattr(engine, "model", None)
    return model.decode_bytes_per_token() if hasattr(model, "decode_bytes_per_token") else None


def _kv_read_bytes(engine, context: int) -> int | None:
    """The KV bytes one decode token reads at `context` tokens of history: every attention
    layer's keys and values in the cache's dtype (after kv8: fp8), a sliding-window layer's (or
    one the window pass switched) up to its window and sink tokens."""
    from hibana_core.kv.layout import attention_layers
    from hibana_core.surgery.window import kv_bytes_per_agent

    cache, args = getattr(engine, "kv_cache", None), getattr(engine, "model_args", None)
    if cache is None or args is None:
        return None
    per_layer = 2 * args.num_kv_heads * args.head_dim * cache.dtype.itemsize  # of one token
    return kv_bytes_per_agent(attention_layers(engine.model), context, per_layer)


def decode_workload(model: BenchModel, contexts: list[int], generate: int, systems: list[str],
                    seed: int = 0, fusions: list[str] = ("auto",), pdls: list[bool] = (True,)) -> dict:
    """`fusions`: the kernel-fusion policies (`hibana_kernels.fusion`) each Hibana system runs
    under; a row under a policy other than "auto" is named SYSTEM/fuse-POLICY. `pdls`: with and
    or without programmatic dependent launch (`hibana_kernels.pdl`; a row without is named
    SYSTEM/pdl-off)."""
    from hibana_kernels import fusion, pdl

    device = model.device
    before = copy_bandwidth(device)  # before any engine: the memory as a fresh process finds it
    rng = random.Random(seed)
    prompts = {ctx: random_tokens(rng, ctx, model.vocab_size) for ctx in contexts}
    warmup = random_tokens(rng, 64, model.vocab_size)
    extra = random.Random(seed + 1)
    # fresh prompts per timed prefill, so no prefill finds the last one's blocks in the prefix
    # index; the same for every system, so each decodes from the same history (a real model's
    # continuation, and with it what a drafter predicts, depends on it)
    timed = {ctx: [prompts[ctx]] + [random_tokens(extra, ctx, model.vocab_size) for _ in range(PREFILL_REPEATS - 1)]
             for ctx in contexts}
    rows: list[DecodeRow] = []
    runs = [(system, policy, dependent) for system in systems if system in SPEC_SYSTEMS or system.startswith("hibana+")
            for policy in fusions for dependent in pdls]
    for system, policy, dependent in runs:
        label = (system if policy == "auto" else f"{system}/fuse-{policy}") + ("" if dependent else "/pdl-off")
        # room for the warm-up generations too (64 + 8 tokens), whatever the contexts asked for
        with fusion.using(policy), pdl.using(dependent), open_engine(
                model, system.split("+")[0], max_model_len=max(*contexts, len(warmup)) + max(generate, 8) + 16,
                max_concurrent_agents=8, **_surgery_overrides(model, system)) as engine:
            guard = next((r.get("guard") for r in getattr(engine, "surgery", [])), None)
            for prompt in (warmup, random_tokens(rng, min(contexts), model.vocab_size)):
                warm = engine.open_state("warm")  # Triton compiles
                warm.generate(SamplingParams(max_tokens=8, ignore_eos=True), prompt=prompt)
                warm.close()
            for ctx in progress_bar(contexts, desc=f"{label} decode", leave=False):
                times = []
                for prompt in timed[ctx]:
                    h = engine.open_state(f"ctx{ctx}-{len(times)}")
                    sync(device)
                    start = time.perf_counter()
                    h.sync(prompt)
                    sync(device)
                    times.append(time.perf_counter() - start)
                    if len(times) < PREFILL_REPEATS:
                        h.close()
                steps = engine.stats().steps
                out = h.generate(SamplingParams(max_tokens=generate, ignore_eos=True))
                decode = out.stats.elapsed - (out.stats.time_to_first_token or 0.0)
                rows.append(DecodeRow(label, ctx, (generate - 1) / decode, ctx / statistics.median(times),
                                      getattr(engine, "weight_bytes", None), guard, _read_bytes(engine),
                                      generate / max(1, engine.stats().steps - steps), _kv_read_bytes(engine, ctx)))
                h.close()
    peers = [(name, static) for name, static in (("hf_eager", False), ("hf_compiled", True)) if name in systems]
    if peers:
        with model.peer_model() as hf_model:  # the engines are closed: one copy of the weights at a time
            for name, static in peers:
                rows += _hf_decode_rows(HFPeer(hf_model, static_cache=static), name, prompts, warmup, generate)
    after = copy_bandwidth(device)
    # the roofline's bandwidth: the higher of the two (after the engines it has read up to 10% lower)
    bandwidth = max(before, after) if before and after else None
    roofline = bandwidth / model.weight_bytes if bandwidth else None
    return {"workload": "decode", "model": model.name, "random_weights": model.random_weights,
            "config": {"contexts": list(contexts), "generate": generate, "systems": list(systems), "seed": seed,
                       "fusions": list(fusions), "pdl": list(pdls)},
            "weight_bytes": model.weight_bytes, "copy_bandwidth_bytes_s": bandwidth,
            "copy_bandwidth_before_after": [before, after],
            "roofline_tok_s": roofline, "rows": [asdict(r) for r in rows]}


def _hf_decode_rows(peer: HFPeer, name: str, prompts: dict[int, list[int]], warmup: list[int],
                    generate: int) -> list[DecodeRow]:
    peer.generate(warmup, 4)
    rows = []
    for ctx, prompt in progress_bar(prompts.items(), desc=name, leave=False):
        if peer.static_cache:  # compile on these very shapes first
            peer.generate(prompt, generate)
            peer.generate(prompt, 1)
        first = statistics.median(peer.generate(prompt, 1)[1] for _ in range(PREFILL_REPEATS))
        _, total = peer.generate(prompt, generate)
        rows.append(DecodeRow(name, ctx, (generate - 1) / max(total - first, 1e-9), ctx / first))
    return rows


# --- agents ---------------------------------------------------------------------------------

@dataclass
class AgentsConfig:
    agents: int
    turns: int
    system: int
    tool_result: int
    generate: int
    peer_agents: int = 1  # sequential peers are timed on this many agents (all turns)
    seed: int = 0
    tool_latency: tuple[float, float] | None = None  # seconds a tool call takes: uniform in [lo, hi], per call
    device_kv_agents: int | None = None  # device KV pool sized for this many agents' whole histories


@dataclass
class TurnRecord:
    agent: int
    turn: int
    prompt: int
    computed: int
    reused: int
    generated: int
    ttft: float


@dataclass
class SystemResult:
    system: str
    agents_timed: int
    seconds: float
    records: list[TurnRecord] = field(default_factory=list)
    kv_blocks: int | None = None      # the engine's KV pool (Hibana systems): blocks and bytes,
    kv_bytes: int | None = None       # so a KV dtype's agents per GB show
    host_tier: dict | None = None     # parks, resumes, bytes moved, tokens restored (Hibana systems)
    timeline: dict | None = None      # `Timeline.summary()` (Hibana systems)

    def summary(self) -> dict:
        turns = len(self.records)
        ttfts = sorted(r.ttft for r in self.records)
        generated = sum(r.generated for r in self.records)
        return {
            "turns_per_hour": turns / self.seconds * 3600,
            "decode_tok_s": generated / self.seconds,
            "prompt_tokens_computed": sum(r.computed for r in self.records),
            "prompt_tokens_reused": sum(r.reused for r in self.records),
            "computed_per_turn": sum(r.computed for r in self.records) / turns,
            "reused_per_turn": sum(r.reused for r in self.records) / turns,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "turns_timed": turns,
            "agents_timed": self.agents_timed,
            "seconds": self.seconds,
            "kv_blocks": self.kv_blocks,
            "kv_bytes": self.kv_bytes,
            "host_tier": self.host_tier,
            "timeline": self.timeline,
        }


def agent_script(cfg: AgentsConfig, vocab: int) -> list[list[list[int]]]:
    """Per agent: the system prompt (first half shared by all agents), then one tool result per
    turn. Turn t's prompt is everything before it plus the turn's tool result."""
    rng = random.Random(cfg.seed)
    shared = random_tokens(rng, cfg.system // 2, vocab)
    script = []
    for _ in range(cfg.agents):
        own = random_tokens(rng, cfg.system - len(shared), vocab)
        results = [random_tokens(rng, cfg.tool_result, vocab) for _ in range(cfg.turns)]
        script.append([shared + own + results[0]] + results[1:])
    return script


def _memory_overrides(cfg: AgentsConfig, context: int, system: str) -> dict:
    """--device-kv-agents N: a device pool for N agents' whole histories (+ one spare agent's
    worth for the warm-up and block rounding); "hibana_recompute" turns the host tier off, so an
    evicted agent recomputes its history (the engine before the memory manager)."""
    overrides = {}
    if cfg.device_kv_agents is not None:
        block = 16
        overrides.update(block_size=block, num_blocks=(cfg.device_kv_agents + 1) * -(-context // block))
    if system == "hibana_recompute":
        overrides["host_kv_bytes"] = 0
    return overrides


def run_hibana_agents(model: BenchModel, cfg: AgentsConfig, retention: bool, system: str = "hibana") -> SystemResult:
    """`system` is one of SPEC_SYSTEMS (speculation off, fixed, adaptive), "hibana+PASS" (the
    default engine with a surgery pass) or "hibana_recompute" (no host tier); without retention
    the engine's default speculation runs."""
    script = agent_script(cfg, model.vocab_size)
    context = cfg.system + cfg.turns * (cfg.tool_result + cfg.generate) + 16
    params = SamplingParams(max_tokens=cfg.generate, ignore_eos=True)
    name = system if retention else "hibana_no_retention"
    engine_system = "hibana" if system == "hibana_recompute" else system.split("+")[0]
    with open_engine(model, engine_system, max_model_len=context, max_concurrent_agents=max(cfg.agents, 1),
                     enable_prefix_caching=retention, **_surgery_overrides(model, system),
                     **_memory_overrides(cfg, context, system)) as engine:
        capture_graphs(engine, cfg.agents)  # every step shape's graph, not inside the timed turns
        warm = engine.open_state("warm")  # Triton compiles
        warm.generate(SamplingParams(max_tokens=4, ignore_eos=True),
                      prompt=random_tokens(random.Random(-1), 64, model.vocab_size))
        warm.close()
        records: list[TurnRecord] = []
        bar = progress_bar(total=cfg.agents * cfg.turns, desc=name, leave=False)
        lock = threading.Lock()

        def agent(i: int) -> None:
            history: list[int] = []
            tool = random.Random(cfg.seed * 1000 + i)
            for turn, new in enumerate(script[i]):
                if turn and cfg.tool_latency is not None:  # the tool runs before its result comes in
                    time.sleep(tool.uniform(*cfg.tool_latency))
                history = history + new
                state_id = f"agent{i}" if retention else f"agent{i}-turn{turn}"
                h = engine.open_state(state_id)
                out = h.generate(params, prompt=history)
                history = history + list(out.token_ids)
                if not retention:
                    h.close()
                with lock:
                    records.append(TurnRecord(i, turn, out.stats.prompt_tokens, out.stats.computed,
                                              out.stats.reused, len(out.token_ids),
                                              out.stats.time_to_first_token or 0.0))
                    bar.update()

        with Timeline(engine) as timeline:
            seconds = run_agents(agent, cfg.agents)  # an agent's error raised once all have ended
        bar.close()
        stats = engine.stats()
        kv_blocks, kv_bytes = stats.kv_blocks_total, engine.kv_cache.nbytes
    return SystemResult(name, cfg.agents, seconds, records, kv_blocks, kv_bytes, stats.host_tier, timeline.summary())


class Timeline:
    """What the engine did over a run, sampled every `period` seconds from `engine.stats()`:
    requests running and waiting, KV blocks in use, steps and their time. Its summary says where
    the wall time went (how long requests queued while the engine ran few, how busy the step
    loop was), which turns/h alone does not."""

    def __init__(self, engine, period: float = 0.05) -> None:
        self.engine, self.period = engine, period
        self.samples: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Timeline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.period):
            self.samples.append((time.perf_counter() - start, self.engine.stats()))

    def summary(self) -> dict | None:
        if len(self.samples) < 2:
            return None
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        stats = [s for _, s in self.samples]
        blocks = max(first.kv_blocks_total, 1)
        queued = [s for s in stats if s.requests_waiting]
        return {
            "seconds": t1 - t0,
            "running_mean": statistics.fmean(s.requests_running for s in stats),
            "waiting_mean": statistics.fmean(s.requests_waiting for s in stats),
            "queued_fraction": len(queued) / len(stats),  # of the samples, those with a request waiting
            "running_when_queued": statistics.fmean(s.requests_running for s in queued) if queued else None,
            "kv_used_mean": statistics.fmean(s.kv_blocks_used for s in stats) / blocks,
            "kv_used_when_queued": statistics.fmean(s.kv_blocks_used for s in queued) / blocks if queued else None,
            "steps_per_s": (last.steps - first.steps) / (t1 - t0),
            "step_busy": (last.step_seconds - first.step_seconds) / (t1 - t0),  # fraction of wall time in steps
            "tokens_per_step": (last.generated_tokens - first.generated_tokens) / max(last.steps - first.steps, 1),
        }


def run_agents(agent, n: int) -> float:
    """Run `agent(i)` for i < n, each in its own thread, all at once; the wall time in seconds. An
    agent's error is raised once every agent has ended (the first one's): a run missing an agent's
    turns is no result, and at Ctrl+C the engine closes under every agent, which must not print a
    traceback each."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            agent(i)
        except Exception as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def run_hf_agents(model: BenchModel, cfg: AgentsConfig, reuse_cache: bool) -> SystemResult:
    """One agent after another, as a framework integration does; timed on cfg.peer_agents. The
    model is on the device for this run alone (`BenchModel.peer_model`)."""
    with model.peer_model() as hf_model:
        return _hf_agents(HFPeer(hf_model), model.vocab_size, cfg, reuse_cache)


def _hf_agents(peer: HFPeer, vocab_size: int, cfg: AgentsConfig, reuse_cache: bool) -> SystemResult:
    script = agent_script(cfg, vocab_size)
    peer.generate(random_tokens(random.Random(-1), 64, vocab_size), 4)  # warm up
    name = "hf_cache_reuse" if reuse_cache else "hf_reprefill"
    records: list[TurnRecord] = []
    seconds = 0.0
    timed = min(cfg.peer_agents, cfg.agents)
    with progress_bar(total=timed * cfg.turns, desc=name, leave=False) as bar:
        for i in range(timed):
            history: list[int] = []
            cache = peer.new_cache() if reuse_cache else None
            for turn, new in enumerate(script[i]):
                history = history + new
                held = cache.get_seq_length() if cache is not None else 0
                out, took = peer.generate(history, cfg.generate, cache)
                seconds += took
                records.append(TurnRecord(i, turn, len(history), len(history) - held, held, len(out), float("nan")))
                history = history + out
                bar.update()
    return SystemResult(name, timed, seconds, records)


def _device_memory(device: torch.device) -> dict | None:
    """Free and total device bytes, and what this process's tensors hold (None off CUDA)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"free": free, "total": total, "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device)}


def agents_workload(model: BenchModel, cfg: AgentsConfig, systems: list[str]) -> dict:
    runners = {
        **{name: (lambda name=name: run_hibana_agents(model, cfg, retention=True, system=name)) for name in SPEC_SYSTEMS},
        "hibana_no_retention": lambda: run_hibana_agents(model, cfg, retention=False),
        "hibana_recompute": lambda: run_hibana_agents(model, cfg, retention=True, system="hibana_recompute"),
        "hf_reprefill": lambda: run_hf_agents(model, cfg, reuse_cache=False),
        "hf_cache_reuse": lambda: run_hf_agents(model, cfg, reuse_cache=True),
    }
    for name in systems:
        if name.startswith("hibana+"):
            runners[name] = lambda name=name: run_hibana_agents(model, cfg, retention=True, system=name)
    results = {}
    for name in systems:
        memory = _device_memory(model.device)  # what the system's engine finds free (its KV pool's share)
        results[name] = runners[name]().summary()
        if memory is not None:
            results[name]["device_memory_before"] = memory
    if "hibana" in results:
        base = results["hibana"]["turns_per_hour"]
        for name, summary in results.items():
            summary["hibana_ratio"] = base / summary["turns_per_hour"]
    return {"workload": "agents", "model": model.name, "random_weights": model.random_weights,
            "config": asdict(cfg), "results": results}
