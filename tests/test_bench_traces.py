"""The benchmark traces (bench/traces.py) and their replay (bench/trace_workloads.py), on the CPU.

A trace file that cannot be replayed is refused with a message naming the file and the field;
the coding trace is the same for the same seed; the shipped traces load; a replay on the demo
model reproduces the recorded outputs: generated greedily (the demo trace was recorded that
way) and, once the engine has `force_outputs` (issue 13), forced, with speculation off and on.
"""

from __future__ import annotations

import gzip
import io
import json
from contextlib import redirect_stdout

import pytest

from hibana_bench.make_coding_trace import make_coding_trace
from hibana_bench.spec_systems import COUNTERS, SpecCounters
from hibana_bench.trace_workloads import Replay
from hibana_bench.traces import (REPLICA_SALT_TOKENS, Trace, TraceError, load_trace, make_trace, parse_trace,
                                 save_trace)

QWEN3_VOCAB = 151936


def small_trace() -> Trace:
    return make_trace("t", "two agents", "by hand", "none", [
        [([1, 2, 3, 4], [5, 6]), ([7], [8, 9])],
        [([1, 2, 3, 9], [5]), ([2], [3])]])


def test_round_trip_plain_and_gzipped(tmp_path):
    trace = small_trace()
    assert trace.vocab_bound == 10
    for name in ("t.json", "t.json.gz"):
        save_trace(trace, tmp_path / name)
        assert load_trace(tmp_path / name) == trace
    assert gzip.decompress((tmp_path / "t.json.gz").read_bytes()) == (tmp_path / "t.json").read_bytes()


def _mutations():
    def set_(path, value):
        def mutate(d):
            *head, last = path
            for key in head:
                d = d[key]
            d[last] = value
        return mutate
    turn = ["agents", 0, "turns", 0]
    return [
        (set_(["format"], "other/1"), "format"),
        (set_(["name"], ""), "'name'"),
        (set_(["vocab_bound"], True), "vocab_bound"),
        (set_(["vocab_bound"], 50), "max id + 1"),
        (set_(["agents"], []), "'agents'"),
        (set_(["agents", 1], {"turns": []}), "agents[1]"),
        (set_(turn + ["output"], []), "agents[0].turns[0].output is empty"),
        (set_(turn + ["input"], [1, 2, 10]), "agents[0].turns[0].input"),
        (set_(turn + ["input"], [1, True]), "agents[0].turns[0].input"),
        (set_(turn + ["input"], [-1]), "agents[0].turns[0].input"),
        (set_(turn + ["extra"], 1), "exactly 'input' and 'output'"),
        (set_(turn + ["input"], []), "starts with a prompt"),
    ]


@pytest.mark.parametrize("mutate, message", _mutations())
def test_bad_traces_are_refused_with_the_field_named(tmp_path, mutate, message):
    data = small_trace().to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match="bad.json") as info:
        load_trace(path)
    assert message in str(info.value)


def test_unreadable_files_and_unknown_names(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    (tmp_path / "x.json.gz").write_bytes(b"not gzip")
    for name in ("x.json", "x.json.gz"):
        with pytest.raises(TraceError, match="not a readable trace file"):
            load_trace(tmp_path / name)
    with pytest.raises(TraceError, match="shipped traces"):
        load_trace("no-such-trace")
    with pytest.raises(TraceError, match="a JSON object"):
        parse_trace([1, 2], "here")


def test_vocab_check_and_replicas():
    trace = small_trace()
    with pytest.raises(TraceError, match="vocabulary of 8"):
        trace.check_vocab(8)
    assert trace.shared_prefix() == 3
    convs = trace.conversations_for(5)  # agents 2, 3, 4: conversations 0, 1, 0 again
    assert convs[:2] == list(trace.agents)
    for replica, original in ((convs[2], trace.agents[0]), (convs[3], trace.agents[1]), (convs[4], trace.agents[0])):
        first, orig = replica.turns[0].input, original.turns[0].input
        assert len(first) == len(orig) + REPLICA_SALT_TOKENS
        assert first[:3] == orig[:3] and first[3 + REPLICA_SALT_TOKENS:] == orig[3:]  # salt after the shared prefix
        assert [t.output for t in replica.turns] == [t.output for t in original.turns]
        assert replica.turns[1:] == original.turns[1:]
    assert convs[2].turns[0].input != convs[4].turns[0].input  # each repeat its own salt


def test_coding_trace_generator_is_deterministic_and_in_range():
    a, b = make_coding_trace(agents=3, seed=7), make_coding_trace(agents=3, seed=7)
    assert a == b
    assert make_coding_trace(agents=3, seed=8) != a
    assert a.vocab_bound <= 4096 < QWEN3_VOCAB
    for conv in a.agents:
        assert 6 <= len(conv.turns) <= 10
        assert max(len(t.output) for t in conv.turns) > 300   # a whole file written back
    assert a.shared_prefix() > 300                            # one system prompt and tool schemas for all


def test_shipped_traces_load():
    coding, demo = load_trace("coding"), load_trace("demo")
    assert (coding.name, len(coding.agents)) == ("coding", 64)
    assert demo.name == "demo" and len(demo.agents) == 8
    for trace in (coding, demo):
        trace.check_vocab(QWEN3_VOCAB)
        assert "tokenizer.json" in trace.tokenizer and trace.command.startswith("python -m hibana_bench.")
    assert coding.agents[:4] == make_coding_trace(agents=4, seed=0).agents  # the file is what its command makes


def test_spec_counters():
    old_engine = SpecCounters.between({"steps": 1, "generated_tokens": 10}, {"steps": 5, "generated_tokens": 30})
    assert old_engine.summary()["draft_tokens_proposed"] is None and old_engine.summary()["tokens_per_verify"] is None
    zero = dict.fromkeys(COUNTERS, 0)
    run = dict(steps=5, generated_tokens=30, draft_tokens_proposed=40, draft_tokens_accepted=30, verify_steps=10,
               verified_sequences=20, verified_tokens=50)
    figures = SpecCounters.between(zero, run).summary()
    assert figures["acceptance_rate"] == 0.75 and figures["tokens_per_verify"] == 2.5  # per sequence, not per step
    assert not figures["tokens_per_verify_estimated"]
    estimated = SpecCounters.between(zero, run | {"verified_sequences": None}).summary()
    assert estimated["tokens_per_verify"] == 4.0 and estimated["tokens_per_verify_estimated"]


# --- replay on the demo model ------------------------------------------------------------------

def _replay(engine, replay: Replay, conv, state_id: str) -> list[list[int]]:
    h, history, outputs = engine.open_state(state_id), [], []
    for turn in conv.turns:
        out, history = replay.turn(h, history, turn)
        outputs.append(list(out.token_ids))
    h.close()
    return outputs


def test_real_output_replay_of_the_demo_trace_reproduces_it():
    """The demo trace is what the demo model says greedily: replayed without forcing, the model
    produces the recorded outputs again (which checks the recorder's split into turns too)."""
    from hibana_core import Engine

    demo = load_trace("demo")
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off") as engine:
        outputs = _replay(engine, Replay(None), demo.agents[0], "real")
    assert outputs == [list(t.output) for t in demo.agents[0].turns]


def _force_outputs_available() -> bool:
    try:
        from hibana_core.speculation import force_outputs  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _force_outputs_available(), reason="the engine has no force_outputs yet (issue 13)")
@pytest.mark.parametrize("speculation", ["off", "adaptive"])
def test_forced_replay_emits_exactly_the_recorded_outputs(speculation):
    """Forced outputs on the demo model, speculation off and adaptive: the demo trace's first
    conversation, and the coding trace's first turn (outputs the demo model would not produce)."""
    from hibana_core import Engine

    demo, coding = load_trace("demo"), load_trace("coding")
    replay = Replay.make(real_outputs=False)
    first_turn = type(coding.agents[0])(coding.agents[0].turns[:1])
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation=speculation) as engine:
        for conv, name in ((demo.agents[0], "demo"), (first_turn, "coding")):
            assert _replay(engine, replay, conv, name) == [list(t.output) for t in conv.turns]
        stats = engine.stats()
    if speculation == "off":
        assert stats.draft_tokens_proposed == 0


def test_trace_decode_workload_on_the_demo_model_says_trace_driven():
    """The workload end to end (real outputs, which any engine can run): figures per system,
    peers skipped by name, and a table whose header says trace-driven."""
    import torch

    from hibana_bench.models import load_bench_model
    from hibana_bench.trace_report import print_trace_decode
    from hibana_bench.trace_workloads import trace_decode_workload

    model = load_bench_model("demo", torch.device("cpu"), torch.float32)
    report = trace_decode_workload(model, load_trace("demo"), "demo", ["hibana_spec_off", "hf_eager"], conversations=1,
                                   real_outputs=True)
    assert report["trace_driven"] and report["skipped_systems"] == ["hf_eager"]
    (row,) = report["rows"]
    recorded = load_trace("demo").agents[0]
    assert row["generated"] == recorded.output_tokens and row["decode_tok_s"] > 0
    assert row["decode_tokens"] == recorded.output_tokens - len(recorded.turns)
    text = io.StringIO()
    with redirect_stdout(text):
        print_trace_decode(report)
    assert text.getvalue().startswith("decode, trace-driven: trace 'demo'")
    assert "real outputs" in text.getvalue() and "skipped" in text.getvalue()
