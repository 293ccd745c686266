"""Trace-driven workloads: recorded agent conversations replayed through the engine.

Each turn syncs the conversation so far plus the turn's input and generates the turn's output.
With forced outputs (the default) `hibana_core.speculation.force_outputs` makes the engine emit
exactly the recorded tokens while the model still runs every forward and drafts are verified
against them: a model with random weights then runs the step shapes and draft acceptance of the
model that produced the trace. With `real_outputs` the model generates its own tokens (up to the
recorded length; it may stop early), which is what the demo model on a CPU measures.

decode: the first N conversations one after another at batch 1; decode tok/s = tokens after
        each turn's first / time after each turn's first token (prefill excluded, as in `decode`).
agents: N agents at once, one thread each, cycling through the trace's conversations
        (`Trace.conversations_for`); turns/h and decode tok/s over the whole run.

Only the speculation systems (`spec_systems.SPEC_SYSTEMS`) run here: the transformers peers
cannot force outputs and hold no resident state, so they are skipped (run them without a trace).
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass
from typing import Callable

from hibana_core.progress import bar as progress_bar

from hibana_bench.models import BenchModel
from hibana_bench.spec_systems import (BASELINE, SPEC_SYSTEMS, BenchError, SpecCounters, capture_graphs,
                                       force_outputs_fn, open_engine, snapshot)
from hibana_bench.traces import REPLICA_SALT_TOKENS, Conversation, Trace, Turn
from hibana_bench.workloads import SystemResult, TurnRecord, run_agents
from hibana_core import SamplingParams

ForceFn = Callable[[object, list[int]], None]


@dataclass(frozen=True)
class Replay:
    """How turns are replayed: forced to the recorded outputs (force is the hook) or not."""

    force: ForceFn | None

    @classmethod
    def make(cls, real_outputs: bool) -> "Replay":
        return cls(None if real_outputs else force_outputs_fn())

    def turn(self, handle, history: list[int], turn: Turn):
        """Generate one turn on `handle`; returns the completion and the history after it."""
        prompt = history + list(turn.input)
        output = list(turn.output)
        if self.force is not None:
            self.force(handle, output)
            params = SamplingParams(max_tokens=len(output), ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=len(output))
        out = handle.generate(params, prompt=prompt)
        if self.force is not None and list(out.token_ids) != output:
            raise BenchError(f"state {handle.id}: forced outputs were not honoured ({len(out.token_ids)} tokens "
                             f"generated, {len(output)} recorded, first difference at "
                             f"{next((i for i, (a, b) in enumerate(zip(out.token_ids, output)) if a != b), 0)})")
        return out, prompt + list(out.token_ids)


def warm_up(engine, vocab: int, replay: Replay, sequences: int = 1) -> None:
    """Triton compiles and CUDA graphs (verify steps too, up to `sequences` sequences a step, every
    span) are captured before timing: a random prompt whose forced output copies part of it
    twice, so that drafts are made and accepted. Random tokens, so the drafters' memory learns
    nothing about the trace."""
    capture_graphs(engine, sequences)
    rng = random.Random(-1)
    prompt = [rng.randrange(16, vocab) for _ in range(96)]
    output = prompt[16:48] * 2 if replay.force is not None else prompt[:16]
    h = engine.open_state("warm-up")
    replay.turn(h, [], Turn(tuple(prompt), tuple(output)))
    h.close()


def first_turns(convs, max_turns: int | None) -> list[Conversation]:
    return [Conversation(c.turns[:max_turns]) for c in convs] if max_turns else list(convs)


def check_context(engine, convs: list[Conversation]) -> None:
    """A conversation longer than the model's context would end its turns early (finish "length")."""
    longest = max(c.tokens for c in convs)
    if longest > engine.max_model_len:
        raise BenchError(f"the trace's conversations reach {longest} tokens, beyond this model's context of "
                         f"{engine.max_model_len}; replay fewer turns (--turns) or use a model with a longer context")


def trace_summary(trace: Trace, path: str, real_outputs: bool) -> dict:
    return {"name": trace.name, "path": path, "description": trace.description, "command": trace.command,
            "tokenizer": trace.tokenizer, "vocab_bound": trace.vocab_bound, "conversations": len(trace.agents),
            "outputs": "real" if real_outputs else "forced"}


def _spec_systems(systems: list[str]) -> tuple[list[str], list[str]]:
    run = [s for s in systems if s in SPEC_SYSTEMS]
    return run, [s for s in systems if s not in SPEC_SYSTEMS]


# --- decode ---------------------------------------------------------------------------------

@dataclass
class TraceDecodeRow:
    system: str
    decode_tok_s: float
    decode_tokens: int      # generated tokens after each turn's first
    decode_seconds: float
    generated: int
    turns: int
    spec: dict              # SpecCounters.summary()


def trace_decode_workload(model: BenchModel, trace: Trace, path: str, systems: list[str], conversations: int = 1,
                          real_outputs: bool = False, max_turns: int | None = None) -> dict:
    trace.check_vocab(model.vocab_size)
    run, skipped = _spec_systems(systems)
    replay = Replay.make(real_outputs)
    convs = first_turns(trace.agents[:max(1, conversations)], max_turns)
    rows: list[TraceDecodeRow] = []
    for system in run:
        with open_engine(model, system, max_model_len=max(c.tokens for c in convs) + 16,
                         max_concurrent_agents=4) as engine:
            check_context(engine, convs)
            warm_up(engine, min(trace.vocab_bound, model.vocab_size), replay)
            before = snapshot(engine)
            tokens, seconds, generated, turns = 0, 0.0, 0, 0
            bar = progress_bar(total=sum(len(c.turns) for c in convs), desc=f"{system} trace decode", leave=False)
            for i, conv in enumerate(convs):
                h, history = engine.open_state(f"trace-{i}"), []
                for turn in conv.turns:
                    out, history = replay.turn(h, history, turn)
                    generated += len(out.token_ids)
                    tokens += max(0, len(out.token_ids) - 1)
                    seconds += out.stats.elapsed - (out.stats.time_to_first_token or 0.0)
                    turns += 1
                    bar.update()
                h.close()
            bar.close()
            spec = SpecCounters.between(before, snapshot(engine)).summary()
        rows.append(TraceDecodeRow(system, tokens / max(seconds, 1e-9), tokens, seconds, generated, turns, spec))
    base = next((r.decode_tok_s for r in rows if r.system == BASELINE), None)
    return {"workload": "decode", "trace_driven": True, "model": model.name, "random_weights": model.random_weights,
            "weight_bytes": model.weight_bytes, "trace": trace_summary(trace, path, real_outputs),
            "conversations_replayed": len(convs), "max_turns": max_turns, "batch": 1, "skipped_systems": skipped,
            "rows": [dict(asdict(r), ratio_vs_spec_off=r.decode_tok_s / base if base else None) for r in rows]}


# --- agents ---------------------------------------------------------------------------------

def run_trace_agents(model: BenchModel, system: str, convs: list[Conversation], vocab: int,
                     replay: Replay) -> tuple[SystemResult, dict]:
    with open_engine(model, system, max_model_len=max(c.tokens for c in convs) + 16,
                     max_concurrent_agents=len(convs)) as engine:
        check_context(engine, convs)
        warm_up(engine, vocab, replay, len(convs))
        records: list[TurnRecord] = []
        lock = threading.Lock()
        bar = progress_bar(total=sum(len(c.turns) for c in convs), desc=f"{system} trace agents", leave=False)

        def agent(i: int) -> None:
            h, history = engine.open_state(f"trace-agent-{i}"), []
            for t, turn in enumerate(convs[i].turns):
                out, history = replay.turn(h, history, turn)
                with lock:
                    records.append(TurnRecord(i, t, out.stats.prompt_tokens, out.stats.computed, out.stats.reused,
                                              len(out.token_ids), out.stats.time_to_first_token or 0.0))
                    bar.update()

        before = snapshot(engine)
        seconds = run_agents(agent, len(convs))  # an agent's error raised once all have ended
        bar.close()
        spec = SpecCounters.between(before, snapshot(engine)).summary()
        spec["kv_blocks_total"] = engine.stats().kv_blocks_total  # the pool the agents shared
    return SystemResult(system, len(convs), seconds, records), spec


def trace_agents_workload(model: BenchModel, trace: Trace, path: str, systems: list[str], agents: int,
                          max_turns: int | None = None, real_outputs: bool = False) -> dict:
    trace.check_vocab(model.vocab_size)
    run, skipped = _spec_systems(systems)
    replay = Replay.make(real_outputs)
    convs = first_turns(trace.conversations_for(agents), max_turns)
    results = {}
    for system in run:
        result, spec = run_trace_agents(model, system, convs, min(trace.vocab_bound, model.vocab_size), replay)
        results[system] = {**result.summary(), **spec}
    base = results.get(BASELINE, {}).get("turns_per_hour")
    for summary in results.values():
        summary["ratio_vs_spec_off"] = summary["turns_per_hour"] / base if base else None
    return {"workload": "agents", "trace_driven": True, "model": model.name, "random_weights": model.random_weights,
            "trace": trace_summary(trace, path, real_outputs), "agents": agents,
            "distinct_conversations": min(agents, len(trace.agents)), "replica_salt_tokens": REPLICA_SALT_TOKENS,
            "max_turns": max_turns, "turns": sum(len(c.turns) for c in convs),
            "recorded_output_tokens": sum(c.output_tokens for c in convs), "skipped_systems": skipped, "results": results}
