"""Recorded agent conversations as token ids, replayed by the trace-driven benchmarks.

A trace is one JSON object (a `.json` file, or `.json.gz`, loaded transparently):

    {
      "format": "hibana-trace/1",
      "name": "coding",
      "description": "what the conversations are",
      "command": "python -m hibana_bench.make_coding_trace",   # how the file was made
      "tokenizer": "which tokenizer produced the ids",
      "vocab_bound": 4096,                                      # max id + 1 over the whole file
      "agents": [                                               # one conversation per agent
        {"turns": [{"input": [...], "output": [...]}, ...]},
        ...
      ]
    }

A turn's `input` is what is appended to the conversation before the model's turn (the system
prompt and user message for the first, tool results later), its `output` what the model produced
(the end-of-turn token included). The conversation's history before turn t is every input and
output before it: the concatenation input_0 output_0 ... input_t.

Replaying with forced outputs (`hibana_core.speculation.force_outputs`) makes a model with random
weights run exactly the step shapes and draft acceptance of the model that produced the trace.
Regenerate the shipped traces with `python -m hibana_bench.record_demo_trace` and
`python -m hibana_bench.make_coding_trace` (both deterministic).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

FORMAT = "hibana-trace/1"
TRACES_DIR = Path(__file__).parent / "traces"
REPLICA_SALT_TOKENS = 8


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and the faulty field."""


@dataclass(frozen=True)
class Turn:
    input: tuple[int, ...]     # appended before the model's turn
    output: tuple[int, ...]    # what the model produced


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]

    @property
    def tokens(self) -> int:
        return sum(len(t.input) + len(t.output) for t in self.turns)

    @property
    def output_tokens(self) -> int:
        return sum(len(t.output) for t in self.turns)


@dataclass(frozen=True)
class Trace:
    name: str
    description: str
    command: str
    tokenizer: str
    vocab_bound: int
    agents: tuple[Conversation, ...]

    def check_vocab(self, vocab_size: int) -> None:
        if self.vocab_bound > vocab_size:
            raise TraceError(f"trace {self.name!r} holds token ids up to {self.vocab_bound - 1}, beyond the "
                             f"model's vocabulary of {vocab_size}; replay it on a model with a larger vocabulary")

    def conversations_for(self, n_agents: int) -> list[Conversation]:
        """One conversation per agent, cycling through the trace's. A repeat (agent i >= the
        number of conversations) gets a few salt tokens right after the prefix all conversations
        share (the system prompt), so that it shares with its original no more KV blocks than
        two distinct agents would. Its outputs still repeat the original's."""
        shared = self.shared_prefix()
        vocab = sorted({t for c in self.agents for turn in c.turns for t in turn.input})
        out = []
        for i in range(n_agents):
            original = self.agents[i % len(self.agents)]
            replica = i // len(self.agents)
            if replica == 0:
                out.append(original)
                continue
            salt = random.Random(f"{self.name}:{replica}").choices(vocab, k=REPLICA_SALT_TOKENS)
            first = original.turns[0]
            cut = min(shared, len(first.input))
            salted = Turn(first.input[:cut] + tuple(salt) + first.input[cut:], first.output)
            out.append(Conversation((salted,) + original.turns[1:]))
        return out

    def shared_prefix(self) -> int:
        """Length of the prefix common to every conversation's first input."""
        firsts = [c.turns[0].input for c in self.agents]
        n = 0
        while all(len(f) > n for f in firsts) and len({f[n] for f in firsts}) == 1:
            n += 1
        return n

    def to_json(self) -> dict:
        return {"format": FORMAT, "name": self.name, "description": self.description, "command": self.command,
                "tokenizer": self.tokenizer, "vocab_bound": self.vocab_bound,
                "agents": [{"turns": [{"input": list(t.input), "output": list(t.output)} for t in c.turns]}
                           for c in self.agents]}


def make_trace(name: str, description: str, command: str, tokenizer: str,
               agents: list[list[tuple[list[int], list[int]]]]) -> Trace:
    """A trace from per-agent lists of (input, output) turns; vocab_bound is computed."""
    convs = tuple(Conversation(tuple(Turn(tuple(i), tuple(o)) for i, o in turns)) for turns in agents)
    bound = 1 + max((t for c in convs for turn in c.turns for t in turn.input + turn.output), default=-1)
    trace = Trace(name, description, command, tokenizer, bound, convs)
    return parse_trace(trace.to_json(), name)  # the same checks a loaded file gets


def resolve_trace_path(name_or_path: str | Path) -> Path:
    """A path, or the name of a shipped trace ("coding", "demo")."""
    path = Path(name_or_path)
    if path.exists():
        return path
    for candidate in (TRACES_DIR / f"{name_or_path}.json.gz", TRACES_DIR / f"{name_or_path}.json"):
        if candidate.exists():
            return candidate
    shipped = sorted(p.name.split(".")[0] for p in TRACES_DIR.glob("*.json*"))
    raise TraceError(f"no trace file {str(name_or_path)!r}; give a path or one of the shipped traces: {shipped}")


def load_trace(name_or_path: str | Path) -> Trace:
    path = resolve_trace_path(name_or_path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        data = json.loads(raw)
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path}: not a readable trace file ({exc})") from None
    return parse_trace(data, str(path))


def save_trace(trace: Trace, path: Path) -> int:
    """Write `trace` (gzipped when the name ends in .gz, with a fixed mtime so the bytes are
    reproducible); returns the file size."""
    text = json.dumps(trace.to_json(), separators=(",", ":")).encode()
    data = gzip.compress(text, compresslevel=9, mtime=0) if path.suffix == ".gz" else text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return len(data)


def describe(trace: Trace) -> str:
    """"N agents, T turns, X tokens (Y generated), longest conversation L tokens"."""
    convs = trace.agents
    return (f"{len(convs)} agents, {sum(len(c.turns) for c in convs)} turns, {sum(c.tokens for c in convs)} "
            f"tokens ({sum(c.output_tokens for c in convs)} generated), longest conversation "
            f"{max(c.tokens for c in convs)} tokens")


def parse_trace(data: object, where: str) -> Trace:
    """Validate a decoded trace; every problem raises TraceError naming `where` and the field."""
    def fail(msg: str) -> TraceError:
        return TraceError(f"{where}: {msg}")

    if not isinstance(data, dict):
        raise fail(f"a trace is a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise fail(f"format is {data.get('format')!r}, expected {FORMAT!r}")
    for key in ("name", "description", "command", "tokenizer"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise fail(f"{key!r} must be a non-empty string")
    bound = data.get("vocab_bound")
    if not _is_int(bound) or bound < 1:
        raise fail(f"'vocab_bound' must be a positive integer (max id + 1), got {bound!r:.40}")
    agents = data.get("agents")
    if not isinstance(agents, list) or not agents:
        raise fail("'agents' must be a non-empty list of conversations")
    convs, top = [], -1
    for a, agent in enumerate(agents):
        turns = agent.get("turns") if isinstance(agent, dict) else None
        if not isinstance(turns, list) or not turns:
            raise fail(f"agents[{a}] must be an object with a non-empty 'turns' list")
        parsed = []
        for t, turn in enumerate(turns):
            if not isinstance(turn, dict) or set(turn) != {"input", "output"}:
                raise fail(f"agents[{a}].turns[{t}] must be an object with exactly 'input' and 'output'")
            ids = {}
            for key in ("input", "output"):
                seq = turn[key]
                if not isinstance(seq, list) or not all(_is_int(x) and 0 <= x < bound for x in seq):
                    raise fail(f"agents[{a}].turns[{t}].{key} must be a list of token ids in [0, {bound})")
                ids[key] = tuple(seq)
                top = max(top, max(seq, default=-1))
            if not ids["output"]:
                raise fail(f"agents[{a}].turns[{t}].output is empty; a turn has at least one generated token")
            if t == 0 and not ids["input"]:
                raise fail(f"agents[{a}].turns[0].input is empty; a conversation starts with a prompt")
            parsed.append(Turn(ids["input"], ids["output"]))
        convs.append(Conversation(tuple(parsed)))
    if top + 1 != bound:
        raise fail(f"'vocab_bound' is {bound} but the largest token id is {top}; it must be max id + 1")
    return Trace(data["name"], data["description"], data["command"], data["tokenizer"], bound, tuple(convs))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
